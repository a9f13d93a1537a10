//! Coordinators whose clocks sit at the edges of the band the clock check accepts (DESIGN.md,
//! "Clocks"), on both stores, in process: each coordinator has a store client of its own (as
//! a process of its own would: its own clock evidence) and a clock offset from this machine's,
//! which is the store's clock (DynamoDB Local, the embedded store).
//!
//! - `edges_never_overlap`: the band's edges are found first (the largest offsets ahead of
//!   and behind the store's clock at which a coordinator with steady traffic is not refused),
//!   then two coordinators just inside opposite edges hand keys to each other: a holder
//!   believes exactly its `safe_until`, and half the time lets the lease lapse while the other
//!   coordinator waits to take it the moment it expires by that coordinator's clock; the other
//!   half it releases. No two believed holds may overlap.
//! - `a_released_key_is_free_to_a_clock_behind`: a key released by one coordinator is taken at
//!   once by another whose clock is behind the first's (within the margin), without waiting
//!   for its clock to pass the releaser's stamps.
//! - `a_renewal_by_a_clock_behind_moves_the_expiry_on`: a lease granted by one coordinator is
//!   renewed at once by another whose clock is behind, as far as a clock on time would.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold::{AcquireOptions, Config, Coordinator, Error};
use leasehold_tests::{accepted_band, steady_traffic, test_config, Backend};

const MARGIN: Duration = Duration::from_millis(200);
const LEASE: Duration = Duration::from_millis(1500);
/// Keys handed back and forth at once, and how long.
const KEYS: usize = 6;
/// The run goes on past `RUN` until it has seen what it must (takeovers at expiry and releases
/// taken over, both ways), up to `LONGEST_RUN`: a loaded machine's evidence refuses the clock at
/// the edge more often, and fewer holds fit in the same time.
const RUN: Duration = Duration::from_secs(8);
const LONGEST_RUN: Duration = Duration::from_secs(40);
/// Takeovers at expiry and releases taken over, in each direction.
const SEEN: usize = 3;

fn config(offset_ms: i64) -> Config {
    Config { skew_margin: MARGIN, clock_offset_ms: offset_ms, ..test_config() }
}

/// One believed hold: from the instant the grant's answer arrived to the holder's safe time
/// (lapsed) or the instant it sent its release.
#[derive(Debug, Clone)]
struct Window {
    by: usize,
    key: usize,
    fence: u64,
    start: Instant,
    end: Instant,
    lapsed: bool,
}

#[derive(Default)]
struct Tally {
    windows: Vec<Window>,
    refused: u64,
    told_too_late: u64,
    errors: Vec<String>,
}

/// Key `key` handed between the two coordinators until `stop`: each grant is believed until
/// its safe time, and either lapses (the other coordinator, already waiting, takes it as soon
/// as its clock says it expired) or is released a little before its safe time.
async fn hand_over(coords: Arc<[Coordinator; 2]>, key: usize, stop: Arc<AtomicBool>, tally: Arc<Mutex<Tally>>) {
    let name = format!("edge-{key}");
    let (mut by, mut round) = (key % 2, key);
    while !stop.load(Ordering::SeqCst) {
        round += 1;
        let opts = AcquireOptions { wait: Some(Duration::from_secs(5)), ..Default::default() };
        let granted = coords[by].acquire(&name, &format!("c{by}"), Some(LEASE), opts).await;
        let start = Instant::now();
        let lease = match granted {
            Ok(l) => l,
            Err(Error::ClockSkew(_)) => {
                // At the very edge the evidence's fluctuations may refuse now and then.
                tally.lock().unwrap().refused += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(e) => {
                tally.lock().unwrap().errors.push(format!("c{by} acquiring {name}: {e}"));
                by = 1 - by;
                continue;
            }
        };
        let safe = lease.safe_until.expect("a timed lease has a safe time");
        if safe <= start {
            tally.lock().unwrap().told_too_late += 1;
            let _ = coords[by].release(&name, &lease.lease_id).await;
            continue;
        }
        // Both coordinators' leases lapse, and both release: by round, lapse, lapse, release,
        // release (the holder alternates every round).
        let lapsed = round / 2 % 2 == 0;
        let end = if lapsed {
            // Stops believing at its safe time and sends nothing: the other coordinator's
            // acquire, sent at once, waits for the expiry.
            safe
        } else {
            tokio::time::sleep_until(safe.checked_sub(Duration::from_millis(100)).unwrap_or(safe).max(start).into())
                .await;
            let end = Instant::now().min(safe);
            if let Err(e) = coords[by].release(&name, &lease.lease_id).await {
                tally.lock().unwrap().errors.push(format!("c{by} releasing {name}: {e}"));
            }
            end
        };
        tally.lock().unwrap().windows.push(Window { by, key, fence: lease.fence, start, end, lapsed });
        by = 1 - by;
    }
}

/// The gaps between a lapsed hold's end and the next holder's start (ms; negative: overlap),
/// by the direction of the takeover, and the releases taken over by the other coordinator.
fn takeovers(ws: &[Window]) -> ([Vec<i64>; 2], [usize; 2]) {
    let mut gaps: [Vec<i64>; 2] = [Vec::new(), Vec::new()];
    let mut handed = [0usize; 2];
    for (i, w) in ws.iter().enumerate() {
        let Some(next) = ws[i + 1..].iter().find(|n| n.key == w.key) else { continue };
        if next.by == w.by {
            continue;
        }
        if w.lapsed {
            let gap = next.start.duration_since(w.end.min(next.start)).as_millis() as i64
                - w.end.duration_since(next.start.min(w.end)).as_millis() as i64;
            gaps[w.by].push(gap);
        } else {
            handed[w.by] += 1;
        }
    }
    (gaps, handed)
}

/// The windows so far, in the order they began.
fn sorted(tally: &Mutex<Tally>) -> Vec<Window> {
    let mut ws = tally.lock().unwrap().windows.clone();
    ws.sort_by_key(|w| w.start);
    ws
}

/// Every pair of believed holds of one key that intersect, in words.
fn overlaps(ws: &[Window], t0: Instant) -> Vec<String> {
    let ms = |t: Instant| t.saturating_duration_since(t0).as_millis();
    let mut found = Vec::new();
    for (i, b) in ws.iter().enumerate() {
        for a in ws[..i].iter().filter(|a| a.key == b.key) {
            if a.start < b.end && b.start < a.end {
                found.push(format!(
                    "key {}: c{} (fence {}) believed [{}, {}] ms and c{} (fence {}) [{}, {}] ms",
                    a.key,
                    a.by,
                    a.fence,
                    ms(a.start),
                    ms(a.end),
                    b.by,
                    b.fence,
                    ms(b.start),
                    ms(b.end)
                ));
            }
        }
    }
    found
}

async fn edges_never_overlap(b: Backend) {
    // Two processes' views of the store: each its own client, its own clock evidence, kept
    // busy as a server's would be.
    let stores = [Backend::dynamo_store_like(&b).await, Backend::dynamo_store_like(&b).await];
    let traffic: Vec<_> = stores.iter().map(|s| steady_traffic(s.clone(), "edge-traffic")).collect();
    // The edges, as narrow as the evidence makes them over a second and a half of steady
    // answers (a loaded machine's answers may come less evenly at first).
    let (mut ahead, mut behind) = (i64::MAX, i64::MAX);
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        ahead = ahead.min(accepted_band(stores[0].clone(), &config(0), 5, 3000).await.0);
        behind = behind.min(accepted_band(stores[1].clone(), &config(0), 5, 3000).await.1);
    }
    // Inside the edges: coordinator 0 ahead of the store's clock, 1 behind it. A long-lived
    // coordinator's evidence may come to narrow its band below what these first answers
    // showed (one quiet round trip does it), and a clock outside it is refused for good: each
    // clock stands in from its edge by a quarter of what the band has beyond the margin, so
    // that they stay well over the margin apart.
    let inset = 20.max((ahead + behind - MARGIN.as_millis() as i64) / 4);
    let offsets = [ahead - inset, -(behind - inset)];
    let coords = Arc::new([0, 1].map(|i| Coordinator::new(stores[i].clone(), config(offsets[i]))));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let t0 = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> =
        (0..KEYS).map(|k| tokio::spawn(hand_over(coords.clone(), k, stop.clone(), tally.clone()))).collect();
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let (gaps, handed) = takeovers(&sorted(&tally));
        let seen = gaps.iter().all(|g| g.len() >= SEEN) && handed.iter().all(|&h| h >= SEEN);
        if (seen && t0.elapsed() >= RUN) || t0.elapsed() >= LONGEST_RUN {
            break;
        }
    }
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        t.await.expect("hand-over task");
    }
    let margins = coords.each_ref().map(|c| c.safe_margin_now().as_millis());
    traffic.iter().for_each(|t| t.abort());
    let ws = sorted(&tally);
    let t = tally.lock().unwrap();
    let found = overlaps(&ws, t0);
    let (gaps, handed) = takeovers(&ws);
    println!(
        "{}: band edges {ahead} ms ahead, {behind} ms behind (margin {} ms); clocks at {offsets:?} ms; \
         {} holds in {} ms, lapsed and taken over ahead->behind {} (gaps {:?}..{:?} ms), behind->ahead {} (gaps {:?}..{:?} ms), \
         released and taken {handed:?}; safe margins now {margins:?} ms; refused {}, told too late {}, errors {:?}; \
         overlaps {}",
        b.store().name(),
        MARGIN.as_millis(),
        ws.len(),
        t0.elapsed().as_millis(),
        gaps[0].len(),
        gaps[0].iter().min(),
        gaps[0].iter().max(),
        gaps[1].len(),
        gaps[1].iter().min(),
        gaps[1].iter().max(),
        t.refused,
        t.told_too_late,
        t.errors,
        found.len()
    );
    assert!(found.is_empty(), "{} overlapping believed holds:\n{}", found.len(), found.join("\n"));
    assert!(t.errors.is_empty(), "{:?}", t.errors);
    // It tested what it claims: clocks further apart than the margin, takeovers at expiry in
    // both directions, and releases taken by the other clock.
    assert!(offsets[0] - offsets[1] > MARGIN.as_millis() as i64, "{offsets:?}");
    assert!(gaps.iter().all(|g| g.len() >= SEEN), "too few takeovers at expiry: {gaps:?}");
    assert!(handed.iter().all(|&h| h >= SEEN), "too few releases taken over: {handed:?}");
}

/// Two processes' coordinators, each over its own client kept busy by steady traffic: one on
/// time, one whose clock runs behind it by a little less than the margin.
async fn on_time_and_behind(
    b: &Backend,
    traffic_key: &str,
) -> (Coordinator, Coordinator, Vec<tokio::task::AbortHandle>) {
    let stores = [Backend::dynamo_store_like(b).await, Backend::dynamo_store_like(b).await];
    let traffic = stores.iter().map(|s| steady_traffic(s.clone(), traffic_key)).collect();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let on_time = Coordinator::new(stores[0].clone(), config(0));
    let behind = Coordinator::new(stores[1].clone(), config(-(MARGIN.as_millis() as i64) + 30));
    (on_time, behind, traffic)
}

/// A key released by one coordinator is taken at once by another whose clock runs behind the
/// first's by a little less than the margin: the release freed it, whatever the clocks.
async fn a_released_key_is_free_to_a_clock_behind(b: Backend) {
    let (on_time, behind, traffic) = on_time_and_behind(&b, "behind-traffic").await;
    for i in 0..10 {
        let key = format!("behind-{i}");
        let l = on_time.acquire(&key, "first", Some(LEASE), AcquireOptions::default()).await.unwrap();
        on_time.release(&key, &l.lease_id).await.unwrap();
        let next = behind.acquire(&key, "second", Some(LEASE), AcquireOptions::default()).await;
        let next = next.unwrap_or_else(|e| panic!("round {i}: the released key was refused: {e}"));
        assert!(next.fence > l.fence, "round {i}: {} after {}", next.fence, l.fence);
        let safe = next.safe_until.expect("safe time").saturating_duration_since(Instant::now());
        assert!(safe > Duration::from_millis(300), "round {i}: safe for {safe:?} only");
    }
    traffic.iter().for_each(|t| t.abort());
}

/// A lease granted or renewed by a coordinator on time is renewed by one whose clock runs
/// behind it (a new process's, say) right afterwards: the renewal's order (`renewed_at_ms <
/// :now`) refuses the behind clock's stamp, and the renewal goes again at the later stamp, so
/// the expiry moves on as far as a clock on time would move it; the keep-alive sweep of such a
/// process renews rather than counting the lease as raced.
async fn a_renewal_by_a_clock_behind_moves_the_expiry_on(b: Backend) {
    let (on_time, behind, traffic) = on_time_and_behind(&b, "renew-traffic").await;
    let long = Duration::from_secs(20);
    for i in 0..10 {
        let key = format!("renew-behind-{i}");
        let l = on_time.acquire(&key, "first", Some(LEASE), AcquireOptions::default()).await.unwrap();
        let before = l.expires_at_ms.expect("a timed lease");
        let r = behind.heartbeat(&key, &l.lease_id, Some(long)).await.unwrap();
        let after = r.expires_at_ms.expect("a timed lease");
        assert!(
            after >= before + long.as_millis() as u64 - LEASE.as_millis() as u64,
            "round {i}: renewed to {after}, granted until {before}: the renewal did not land"
        );
        assert_eq!(r.fence, l.fence);
        on_time.release(&key, &l.lease_id).await.unwrap();
    }
    traffic.iter().for_each(|t| t.abort());
}

leasehold_tests::both_backends!(
    edges_never_overlap,
    a_released_key_is_free_to_a_clock_behind,
    a_renewal_by_a_clock_behind_moves_the_expiry_on
);

/// Figures for DESIGN.md and BENCHMARKS.md ("Clocks"): the safe margin an honest coordinator
/// (its clock this machine's, the store's) counts on DynamoDB Local, right after its first
/// answers (three reads back to back and its first write) and then every 250 ms under steady
/// traffic (a read every 17 ms), and the band's edges.
/// `cargo test -p leasehold-tests --test clock_edges -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "figures: run by hand on a quiet machine"]
async fn safe_margin_figures() {
    let b = Backend::dynamo().await;
    let mut fresh = Vec::new();
    for i in 0..20 {
        let c = Coordinator::new(Backend::dynamo_store_like(&b).await, config(0));
        let l = c.acquire(&format!("fresh-{i}"), "f", Some(Duration::from_secs(30)), AcquireOptions::default()).await;
        l.expect("acquire");
        fresh.push(c.safe_margin_now().as_millis() as u64);
    }
    let store = Backend::dynamo_store_like(&b).await;
    let traffic = steady_traffic(store.clone(), "figures");
    let c = Coordinator::new(store.clone(), config(0));
    let mut steady = Vec::new();
    for i in 0..40 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if i >= 8 {
            steady.push(c.safe_margin_now().as_millis() as u64);
        }
    }
    let (ahead, behind) = accepted_band(store.clone(), &config(0), 5, 3000).await;
    traffic.abort();
    let stats = |v: &mut Vec<u64>| {
        v.sort_unstable();
        format!("min {} / median {} / max {} ms (n {})", v[0], v[v.len() / 2], v[v.len() - 1], v.len())
    };
    println!(
        "safe margin (skew margin {} ms, date lag 250 ms): first answers {}; steady traffic {}; band {ahead} ms ahead, \
         {behind} ms behind",
        MARGIN.as_millis(),
        stats(&mut fresh),
        stats(&mut steady)
    );
}
