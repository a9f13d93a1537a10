//! A Jepsen-style safety run: many workers contend on a few keys through a fault-injecting
//! proxy in front of DynamoDB Local (lost responses, resets, delays, stalls, delayed
//! duplicates, throttles, 5xx), holders are randomly paused longer than their lease, and every
//! write goes to a resource guarded by fences. Invariants checked:
//! 1. the resource never accepts a fence below one it has seen (by construction) and never
//!    rejects a write made by a holder before its `safe_until`;
//! 2. fences strictly increase per key in grant order;
//! 3. no two holders' safe windows on one key overlap;
//! 4. after the run every key is free again within its duration + skew margin (no lease is
//!    stranded by a lost response, nor by a coordinator with a wrong clock);
//! 5. a holder whose renewals fail is told no later than its safe time.
//!
//! The coordinators may run on different clocks (`Config::clock_offset_ms`): within the skew
//! margin nothing changes; a coordinator whose clock is far off must be refused
//! (`ClockSkew`) and must not disturb the others.
//!
//! `short_safety_run` and the clock runs are in the normal suite; the long run (>= 60 s) is
//! `cargo test -p leasehold-tests --test safety -- --ignored --nocapture`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::types::AttributeValue;
use leasehold::store::DynamoStore;
use leasehold::{AcquireOptions, Coordinator, Error, Lost};
use leasehold_tests::proxy::ProxyFault;
use leasehold_tests::{dynamo_local, proxied_table, test_config};

#[derive(Default)]
struct Resource {
    highest: u64,
    accepted: u64,
    rejected_stale: u64,
    /// Writes rejected although the writer was inside its safe window: must stay 0.
    rejected_safe: u64,
}

#[derive(Debug, Clone)]
struct Window {
    holder: String,
    fence: u64,
    start: Instant,
    end: Instant,
}

#[derive(Default)]
struct Totals {
    operations: AtomicU64,
    acquired: AtomicU64,
    held_errors: AtomicU64,
    store_errors: AtomicU64,
    losses: AtomicU64,
    late_loss_notices: AtomicU64,
    pauses: AtomicU64,
}

fn rand(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

/// What one run does.
struct Scenario {
    seconds: u64,
    workers: usize,
    keys: usize,
    /// Clock offset (ms) of each worker's coordinator; workers past the end use 0.
    offsets: Vec<i64>,
    /// A coordinator whose clock is this far off (ms) contends as well: it must be refused.
    rogue: Option<i64>,
    /// Only delayed duplicates, on this share (per mille) of the UpdateItems (heartbeats and
    /// releases), instead of the mixed faults on every request.
    duplicates_only: Option<u32>,
}

impl Scenario {
    fn new(seconds: u64, workers: usize, keys: usize) -> Scenario {
        Scenario { seconds, workers, keys, offsets: Vec::new(), rogue: None, duplicates_only: None }
    }
}

/// What a run found. `violations` lists every broken invariant, each in words.
#[derive(Default)]
struct Report {
    violations: Vec<String>,
    acquired: u64,
    injected: u64,
    late_duplicates: u64,
    /// Leases granted to the rogue coordinator (must be 0).
    rogue_grants: u64,
    /// The rogue coordinator's errors by `Error::name()`.
    rogue_errors: BTreeMap<String, u64>,
}

/// The faults of every run: each request draws one with probability 8%.
fn faults() -> Vec<ProxyFault> {
    vec![
        ProxyFault::DropResponse,
        ProxyFault::Reset,
        ProxyFault::Delay(Duration::from_millis(150)),
        ProxyFault::Throttle,
        ProxyFault::ServerError,
        ProxyFault::Stall(Duration::from_millis(1500)),
        DUPLICATE,
    ]
}

/// Scaled to the runs' 1.2 s leases: held half a lease, then the original lands after the
/// coordinator's retry, within one lease of being sent.
const DUPLICATE: ProxyFault =
    ProxyFault::DelayedDuplicate { hold: Duration::from_millis(600), forward_after: Duration::from_millis(1100) };

/// The fault-injected runs share the machine (read); the guarded-table run takes it alone
/// (write): its load would otherwise stretch their requests past the retry budget.
static MACHINE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

async fn safety_run(sc: Scenario) -> Report {
    let _shared = MACHINE.read().await;
    let Scenario { seconds, workers, keys, ref offsets, rogue, duplicates_only } = sc;
    let (proxy, table, conf) = proxied_table().await;
    let local = dynamo_local();
    let mut cfg = test_config();
    cfg.retry_budget = Duration::from_millis(1500);
    let margin = cfg.skew_margin;
    let lease = Duration::from_millis(1200);
    let resources: Arc<Vec<Mutex<Resource>>> = Arc::new((0..keys).map(|_| Mutex::new(Resource::default())).collect());
    let windows: Arc<Mutex<HashMap<usize, Vec<Window>>>> = Arc::new(Mutex::new(HashMap::new()));
    let problems: Arc<Mutex<Vec<String>>> = Arc::default();
    let rogue_errors: Arc<Mutex<BTreeMap<String, u64>>> = Arc::default();
    let rogue_grants = Arc::new(AtomicU64::new(0));
    let totals = Arc::new(Totals::default());
    match duplicates_only {
        None => proxy.random_faults(80, &faults(), 0x5EED),
        Some(per_mille) => proxy.random_faults_on("UpdateItem", per_mille, &[DUPLICATE], 0x5EED),
    }
    let stop_at = Instant::now() + Duration::from_secs(seconds);
    // How late this runtime's timers fire under the run's load: no holder can be told of a
    // loss sooner than its runtime wakes it, so lateness is judged against this lag.
    let timer_lag_us = Arc::new(AtomicU64::new(0));
    let lag_monitor = {
        let lag = timer_lag_us.clone();
        tokio::spawn(async move {
            let mut next = Instant::now();
            while Instant::now() < stop_at + Duration::from_secs(5) {
                next += Duration::from_millis(10);
                tokio::time::sleep_until(next.into()).await;
                let late = Instant::now().saturating_duration_since(next).as_micros() as u64;
                lag.fetch_max(late, Ordering::Relaxed);
            }
        })
    };
    // Every worker has its own client, as separate machines would.
    let coordinator = |offset_ms: i64| {
        let mut c = cfg.clone();
        c.clock_offset_ms = offset_ms;
        Coordinator::new(Arc::new(DynamoStore::new(aws_sdk_dynamodb::Client::new(&conf), table.clone())), c)
    };
    let mut tasks = Vec::new();
    for w in 0..workers {
        let coord = coordinator(offsets.get(w).copied().unwrap_or(0));
        let (resources, windows, totals, timer_lag_us, problems) =
            (resources.clone(), windows.clone(), totals.clone(), timer_lag_us.clone(), problems.clone());
        tasks.push(tokio::spawn(async move {
            let mut seed = 0x9E37_79B9_7F4A_7C15u64 ^ ((w as u64 + 1) * 0x1000_0001);
            while Instant::now() < stop_at {
                let k = (rand(&mut seed) % keys as u64) as usize;
                let key = format!("safety-{k}");
                totals.operations.fetch_add(1, Ordering::Relaxed);
                let opts = AcquireOptions { wait: Some(Duration::from_millis(300)), ..Default::default() };
                if rand(&mut seed).is_multiple_of(10) {
                    // A holder frozen past its lease (a GC pause, a stopped VM: its renewals
                    // freeze too): it does not know time passed, writes with its old fence
                    // when it wakes up, then crashes without releasing.
                    let Ok(l) = coord.acquire(&key, &format!("w{w}-paused"), Some(lease), opts).await else { continue };
                    totals.acquired.fetch_add(1, Ordering::Relaxed);
                    totals.pauses.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(lease + Duration::from_millis(400)).await;
                    let mut r = resources[k].lock().unwrap();
                    if l.fence < r.highest {
                        r.rejected_stale += 1;
                    } else {
                        r.highest = l.fence;
                        r.accepted += 1;
                    }
                    continue;
                }
                let held = match coord.hold(&key, &format!("w{w}"), lease, opts).await {
                    Ok(h) => h,
                    Err(Error::LeaseHeld { .. }) => {
                        totals.held_errors.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    Err(e) if e.is_transient() => {
                        totals.store_errors.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    Err(e) => {
                        problems
                            .lock()
                            .unwrap()
                            .push(format!("worker w{w} (honest clock): unexpected {}: {e}", e.name()));
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                totals.acquired.fetch_add(1, Ordering::Relaxed);
                let fence = held.fence();
                let start = Instant::now();
                let mut last_safe_write = start;
                // Under duplicates only, holders work through several renewals.
                let writes = if duplicates_only.is_some() { 4 + rand(&mut seed) % 9 } else { 1 + rand(&mut seed) % 4 };
                let outcome = held
                    .run(async {
                        for _ in 0..writes {
                            // Only write while inside the safe window, as a careful holder does.
                            let safe = held.safe_until().is_some_and(|t| Instant::now() < t);
                            if !safe {
                                break;
                            }
                            {
                                let mut r = resources[k].lock().unwrap();
                                if fence < r.highest {
                                    r.rejected_safe += 1;
                                } else {
                                    r.highest = fence;
                                    r.accepted += 1;
                                }
                            }
                            last_safe_write = Instant::now();
                            tokio::time::sleep(Duration::from_millis(rand(&mut seed) % 500)).await;
                        }
                    })
                    .await;
                // The holder believed it held the key until it stopped (to release, or told
                // of the loss) or its last safe time, whichever came first.
                let believed_until = held.last_safe_until().map_or(last_safe_write, |t| t.min(Instant::now()));
                windows.lock().unwrap().entry(k).or_default().push(Window {
                    holder: format!("w{w}"),
                    fence,
                    start,
                    end: believed_until.max(last_safe_write),
                });
                match outcome {
                    Ok(()) => {
                        let _ = held.release().await;
                    }
                    Err(lost) => {
                        totals.losses.fetch_add(1, Ordering::Relaxed);
                        // Told at its safe time at the latest, give or take how late this
                        // runtime's timers run under the load.
                        let told = Instant::now();
                        if let Some(safe) = held.last_safe_until() {
                            let slack =
                                Duration::from_millis(50) + Duration::from_micros(timer_lag_us.load(Ordering::Relaxed));
                            if lost == Lost::SafeTimeExpired && told > safe + slack {
                                eprintln!("told {:?} after the safe time (timer lag up to {slack:?})", told - safe);
                                totals.late_loss_notices.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                }
            }
        }));
    }
    if let Some(offset) = rogue {
        // The coordinator with the wrong clock tries the same keys the same way; whatever it
        // is granted is recorded like any holder's, so an overlap it causes is found.
        let coord = coordinator(offset);
        let (resources, windows, rogue_errors, rogue_grants) =
            (resources.clone(), windows.clone(), rogue_errors.clone(), rogue_grants.clone());
        tasks.push(tokio::spawn(async move {
            let mut seed = 0xDEAD_BEEF_u64;
            while Instant::now() < stop_at {
                let k = (rand(&mut seed) % keys as u64) as usize;
                let key = format!("safety-{k}");
                let opts = AcquireOptions { wait: Some(Duration::from_millis(300)), ..Default::default() };
                match coord.acquire(&key, "rogue", Some(lease), opts).await {
                    Ok(l) => {
                        rogue_grants.fetch_add(1, Ordering::Relaxed);
                        let start = Instant::now();
                        let mut end = start;
                        while l.safe_until.is_some_and(|t| Instant::now() < t) {
                            {
                                let mut r = resources[k].lock().unwrap();
                                if l.fence < r.highest {
                                    r.rejected_safe += 1;
                                } else {
                                    r.highest = l.fence;
                                    r.accepted += 1;
                                }
                            }
                            end = Instant::now();
                            // Its idea of its safe window can be long: stop writing after a lease.
                            if end > start + lease {
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                        windows.lock().unwrap().entry(k).or_default().push(Window {
                            holder: "rogue".into(),
                            fence: l.fence,
                            start,
                            end,
                        });
                        let _ = coord.release(&key, &l.lease_id).await;
                    }
                    Err(e) => *rogue_errors.lock().unwrap().entry(e.name().to_string()).or_default() += 1,
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let injected = proxy.injected();
    proxy.clear_faults();
    lag_monitor.abort();
    let mut violations = std::mem::take(&mut *problems.lock().unwrap());

    // 4. No stranded lease: every key is free within lease + margin after the run (give or
    // take a loaded machine's scheduling).
    let clean = Coordinator::new(Arc::new(DynamoStore::new(local.client().await, table.clone())), test_config());
    let deadline = Instant::now() + lease + margin + Duration::from_millis(2000);
    for k in 0..keys {
        let key = format!("safety-{k}");
        let wait = deadline.saturating_duration_since(Instant::now());
        match clean
            .acquire(
                &key,
                "checker",
                Some(Duration::from_secs(5)),
                AcquireOptions { wait: Some(wait), ..Default::default() },
            )
            .await
        {
            Ok(l) => {
                let _ = clean.release(&key, &l.lease_id).await;
            }
            Err(e) => violations.push(format!("{key} stayed unusable for an honest coordinator after the run: {e}")),
        }
    }

    // 2 + 3. In the order the holders learned of their grants, fences strictly increase per
    // key and no safe window starts before an earlier one ended.
    {
        let windows = windows.lock().unwrap();
        for (k, ws) in windows.iter() {
            let mut ws = ws.clone();
            ws.sort_by_key(|w| w.start);
            for (i, b) in ws.iter().enumerate() {
                for a in &ws[..i] {
                    if a.end > b.start {
                        violations.push(format!(
                            "key {k}: safe windows overlap: {} (fence {}) until {:?} after {} (fence {}) started",
                            a.holder,
                            a.fence,
                            a.end - b.start,
                            b.holder,
                            b.fence
                        ));
                    }
                }
                if i > 0 && b.fence <= ws[i - 1].fence {
                    violations.push(format!(
                        "key {k}: fence {} ({}) granted after {} ({})",
                        b.fence,
                        b.holder,
                        ws[i - 1].fence,
                        ws[i - 1].holder
                    ));
                }
            }
        }
    }
    let mut accepted = 0;
    let mut rejected_stale = 0;
    for (k, r) in resources.iter().enumerate() {
        let r = r.lock().unwrap();
        if r.rejected_safe > 0 {
            violations.push(format!("key {k}: {} write(s) inside a safe window were rejected", r.rejected_safe));
        }
        accepted += r.accepted;
        rejected_stale += r.rejected_stale;
    }
    let late = totals.late_loss_notices.load(Ordering::Relaxed);
    if late > 0 {
        violations.push(format!("{late} holder(s) were told of a lost lease after their safe time"));
    }
    let t = &totals;
    let report = Report {
        acquired: t.acquired.load(Ordering::Relaxed),
        injected,
        late_duplicates: proxy.late_forwarded(),
        rogue_grants: rogue_grants.load(Ordering::Relaxed),
        rogue_errors: rogue_errors.lock().unwrap().clone(),
        violations,
    };
    println!(
        "safety: {seconds} s, {workers} workers (clock offsets {offsets:?} ms), {keys} keys, rogue clock {rogue:?} ms: \
         operations {}, acquired {}, LeaseHeld {}, store errors {}, losses {}, pauses {}, writes accepted {accepted}, \
         stale writes rejected {rejected_stale}, faults injected {injected}, duplicates forwarded late {}, \
         rogue grants {}, rogue errors {:?}, max timer lag {} ms, violations {}",
        t.operations.load(Ordering::Relaxed),
        report.acquired,
        t.held_errors.load(Ordering::Relaxed),
        t.store_errors.load(Ordering::Relaxed),
        t.losses.load(Ordering::Relaxed),
        t.pauses.load(Ordering::Relaxed),
        report.late_duplicates,
        report.rogue_grants,
        report.rogue_errors,
        timer_lag_us.load(Ordering::Relaxed) / 1000,
        report.violations.len(),
    );
    report
}

/// The run must have exercised something, and broken nothing.
#[track_caller]
fn assert_safe(r: &Report, min_acquired: u64) {
    assert!(r.violations.is_empty(), "{} violation(s):\n{}", r.violations.len(), r.violations.join("\n"));
    assert!(r.injected > 10, "the run must actually inject faults: {}", r.injected);
    assert!(r.late_duplicates > 0, "no delayed duplicate reached DynamoDB late");
    assert!(r.acquired >= min_acquired, "too little happened to mean anything: {} acquisitions", r.acquired);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn short_safety_run() {
    assert_safe(&safety_run(Scenario::new(10, 16, 3)).await, 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "long run (>= 60 s): cargo test -p leasehold-tests --test safety -- --ignored --nocapture"]
async fn long_safety_run() {
    let secs = std::env::var("LEASEHOLD_SAFETY_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(60);
    assert_safe(&safety_run(Scenario::new(secs, 16, 3)).await, 20);
}

/// The library's holders (`Coordinator::hold`, renewing by themselves) under the failure
/// leases exist for: 40% of the UpdateItems (heartbeats, releases) are delayed duplicates
/// whose original lands after the coordinator's retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn delayed_duplicates_of_renewals_stay_safe() {
    assert_safe(&safety_run(Scenario { duplicates_only: Some(400), ..Scenario::new(12, 12, 2) }).await, 6);
}

/// Coordinators whose clocks disagree by up to the skew margin (offsets spread evenly over
/// ±margin/2, so two of them are a whole margin apart) keep every invariant: the margin is
/// what `safe_until` subtracts for exactly this.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn coordinators_on_clocks_within_the_margin_stay_safe() {
    let workers = 12;
    let half = test_config().skew_margin.as_millis() as i64 / 2;
    let offsets = (0..workers as i64).map(|w| -half + 2 * half * w / (workers as i64 - 1)).collect();
    assert_safe(&safety_run(Scenario { offsets, ..Scenario::new(8, workers, 3) }).await, 15);
}

/// One coordinator whose clock is far beyond the skew margin (5 s, 2 h, 300 years ahead: a
/// misconfigured host, a bad NTP answer) contends with honest ones. It must be refused with
/// `ClockSkew` and never granted a lease, so it can neither cause an overlap nor leave a key
/// held (or its fence pushed out of reach) for the honest coordinators afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_coordinator_with_a_clock_far_off_is_refused() {
    const YEAR_MS: i64 = 365 * 24 * 3600 * 1000;
    let mut failures = Vec::new();
    for (what, offset) in [("+5 s", 5_000), ("+2 h", 2 * 3600 * 1000), ("+300 years", 300 * YEAR_MS)] {
        let r = safety_run(Scenario { rogue: Some(offset), ..Scenario::new(5, 8, 2) }).await;
        let mut problems = r.violations.clone();
        if r.rogue_grants > 0 {
            problems.push(format!("it was granted {} lease(s)", r.rogue_grants));
        }
        if r.rogue_errors.get("ClockSkew").copied().unwrap_or(0) == 0 {
            problems.push(format!("it was never refused with ClockSkew (its errors: {:?})", r.rogue_errors));
        }
        if r.acquired < 5 {
            problems.push(format!("the honest coordinators acquired only {} lease(s)", r.acquired));
        }
        if !problems.is_empty() {
            failures.push(format!("clock {what}:\n  {}", problems.join("\n  ")));
        }
    }
    assert!(failures.is_empty(), "a coordinator with a clock far off:\n{}", failures.join("\n"));
}

/// The delayed-duplicate fault does what the safety runs rely on: the client's request is
/// held, its connection closed without an answer, the client's retry is answered, and then
/// the ORIGINAL request reaches DynamoDB Local and overwrites what the retry wrote.
#[tokio::test]
async fn a_delayed_duplicate_lands_after_the_retry() {
    let (proxy, table, conf) = proxied_table().await;
    let client = aws_sdk_dynamodb::Client::new(&conf);
    let put = |v: &'static str| {
        client
            .update_item()
            .table_name(&table)
            .key("key", AttributeValue::S("dup".into()))
            .update_expression("SET note = :v")
            .expression_attribute_values(":v", AttributeValue::S(v.into()))
            .send()
    };
    proxy.record(true);
    let (hold, forward_after) = (Duration::from_millis(300), Duration::from_millis(2000));
    proxy.inject(&[ProxyFault::DelayedDuplicate { hold, forward_after }]);
    let sent = Instant::now();
    assert!(put("original").await.is_err(), "the held request must fail without an answer");
    assert!(sent.elapsed() >= hold, "the connection was closed after {:?}, before the hold", sent.elapsed());
    put("retry").await.expect("the retry is answered");
    assert_eq!(proxy.late_forwarded(), 0, "the original must not land before the retry");
    // Wait for the original to land (bounded; not a speed assertion).
    let limit = Instant::now() + Duration::from_secs(20);
    while proxy.late_forwarded() == 0 {
        assert!(Instant::now() < limit, "the original never reached DynamoDB");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(sent.elapsed() >= forward_after);
    let got = client.get_item().table_name(&table).key("key", AttributeValue::S("dup".into())).send().await.unwrap();
    let note = got.item().and_then(|i| i.get("note")).and_then(|v| v.as_s().ok()).cloned();
    assert_eq!(note.as_deref(), Some("original"), "the late original overwrites the retry");
    let ev: Vec<_> = proxy.events().into_iter().filter(|e| e.target == "UpdateItem").collect();
    assert_eq!(ev.len(), 3, "{ev:?}");
    assert_eq!((ev[0].status, ev[0].late), (0, false), "held, closed without an answer");
    assert_eq!((ev[1].status, ev[1].late), (200, false), "the retry");
    assert_eq!((ev[2].status, ev[2].late), (200, true), "the original, late");
    assert!(ev[2].request.contains("original") && ev[1].request.contains("retry"));
}

// ---- a guarded DynamoDB table ---------------------------------------------------------------

/// What the guarded-table run saw, by helper and by whether the holder was paused past its
/// lease's expiry before writing.
#[derive(Default, Debug)]
struct GuardedCounts {
    fenced_accepted: u64,
    fenced_refused: u64,
    paused_fenced_accepted: u64,
    paused_fenced_refused: u64,
    live_committed: u64,
    live_refused: u64,
    /// Commits that landed after the holder was paused past its expiry: stale, must be 0.
    paused_live_committed: u64,
    paused_live_refused: u64,
    /// Refusals whose type does not match what they report: must stay empty.
    mistyped: Vec<String>,
    other_errors: BTreeMap<String, u64>,
}

impl GuardedCounts {
    /// The run has exercised what the test claims: enough writes on both paths, and paused
    /// holders refused on both.
    fn enough(&self) -> bool {
        self.fenced_accepted > 20
            && self.live_committed > 20
            && self.paused_fenced_refused > 0
            && self.paused_live_refused > 0
    }
}

/// Appends `fence` to the item's `history` list (DynamoDB's own serialisation order of the
/// writes that landed) and names the writer; `frozen` never exists, so the caller's own
/// condition always holds and only the fence can refuse.
fn history_update(table: &str, id: &str, fence: u64, holder: &str) -> aws_sdk_dynamodb::types::Update {
    aws_sdk_dynamodb::types::Update::builder()
        .table_name(table)
        .key("id", AttributeValue::S(id.to_string()))
        .update_expression("SET #h = list_append(if_not_exists(#h, :empty), :me), #w = :w")
        .condition_expression("attribute_not_exists(#frozen)")
        .expression_attribute_names("#h", "history")
        .expression_attribute_names("#w", "writer")
        .expression_attribute_names("#frozen", "frozen")
        .expression_attribute_values(":empty", AttributeValue::L(vec![]))
        .expression_attribute_values(":me", AttributeValue::L(vec![AttributeValue::N(fence.to_string())]))
        .expression_attribute_values(":w", AttributeValue::S(holder.to_string()))
        .build()
        .expect("update")
}

/// Holders contend on two keys of a real lease table on DynamoDB Local; a third of them are
/// paused past their lease's expiry before writing. Every holder then writes to a guarded
/// DynamoDB table through both helpers: a fenced update, and a lease-live transaction. The
/// items' histories (kept by DynamoDB in commit order) must never show a fence below an
/// earlier one, no lease-live commit may land after a pause past expiry, and every refusal
/// must be of the type its reported state calls for.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn guarded_dynamodb_table_accepts_no_stale_write() {
    use leasehold::fenced::{recorded_fence, FenceGuard, FencedError, DEFAULT_ATTRIBUTE};
    const KEYS: u64 = 2;
    let _alone = MACHINE.write().await;
    let local = tokio::task::spawn_blocking(dynamo_local).await.expect("dynamo local");
    let leases = local.store().await.table().to_string();
    let client = local.client().await;
    let target = leasehold_tests::guarded_table(&client).await;
    let cfg = test_config();
    // Longer than the safe margin of a coordinator with steady answers (about 320 ms on
    // DynamoDB Local, DESIGN.md "Clocks"), so that most grants leave time to write.
    let duration = Duration::from_millis(1500);
    let counts: Arc<Mutex<GuardedCounts>> = Arc::default();
    // The run lasts at least 12 s, and on until it has exercised enough (a loaded machine
    // widens a new coordinator's margin and leaves fewer grants with time to write).
    let start = Instant::now();
    let (least, most) = (start + Duration::from_secs(12), start + Duration::from_secs(60));
    let mut tasks = Vec::new();
    for w in 0..6u64 {
        let (client, leases, target, cfg, counts) =
            (client.clone(), leases.clone(), target.clone(), cfg.clone(), counts.clone());
        tasks.push(tokio::spawn(async move {
            let coord = Coordinator::new(Arc::new(DynamoStore::new(client.clone(), leases.clone())), cfg);
            let holder = format!("w{w}");
            let mut seed = 0x9E37_79B9_7F4A_7C15 ^ (w + 1);
            loop {
                let t = Instant::now();
                if t >= most || (t >= least && counts.lock().unwrap().enough()) {
                    break;
                }
                let key = format!("g{}", rand(&mut seed) % KEYS);
                let opts = AcquireOptions { wait: Some(Duration::from_millis(600)), ..Default::default() };
                let Ok(lease) = coord.acquire(&key, &holder, Some(duration), opts).await else { continue };
                let paused = rand(&mut seed).is_multiple_of(3);
                let nap = if paused {
                    duration.as_millis() as u64 + 50 + rand(&mut seed) % 250
                } else {
                    rand(&mut seed) % 40
                };
                tokio::time::sleep(Duration::from_millis(nap)).await;

                // 1. The fence guard on the resource's own item.
                let guard = FenceGuard::new(lease.fence);
                let u = history_update(&target, &key, lease.fence, &holder);
                let b = client
                    .update_item()
                    .table_name(&target)
                    .set_key(Some(u.key))
                    .update_expression(u.update_expression)
                    .set_condition_expression(u.condition_expression)
                    .set_expression_attribute_names(u.expression_attribute_names)
                    .set_expression_attribute_values(u.expression_attribute_values);
                let r = guard.send_update(b).await;
                {
                    let mut c = counts.lock().unwrap();
                    match r {
                        Ok(_) if paused => c.paused_fenced_accepted += 1,
                        Ok(_) => c.fenced_accepted += 1,
                        Err(FencedError::Fenced { seen, index: None }) if seen > lease.fence => {
                            if paused {
                                c.paused_fenced_refused += 1
                            } else {
                                c.fenced_refused += 1
                            }
                        }
                        Err(FencedError::Dynamo(e)) => *c.other_errors.entry(format!("{e}")).or_default() += 1,
                        Err(e) => c.mistyped.push(format!("fenced update with fence {}: {e:?}", lease.fence)),
                    }
                }

                // 2. The lease-live commit on another item (no fence attribute involved).
                let u = history_update(&target, &format!("live-{key}"), lease.fence, &holder);
                let item = aws_sdk_dynamodb::types::TransactWriteItem::builder().update(u).build();
                let tx = client.transact_write_items().transact_items(item);
                // The check is judged at this coordinator's clock plus its safe margin when it
                // is sent; no store call comes between here and then, so the margin is this one.
                let margin = coord.safe_margin_now().as_millis() as u64;
                let r = coord.commit_while_live(&leases, &key, &lease.lease_id, lease.fence, tx).await;
                let live_at = coord.now_ms() + margin;
                {
                    let mut c = counts.lock().unwrap();
                    match r {
                        Ok(_) if paused => c.paused_live_committed += 1,
                        Ok(_) => c.live_committed += 1,
                        Err(FencedError::LeaseLost { lease: item }) => {
                            // The lease item as the check saw it: not ours, released, or past
                            // the holder's safe time at the clock the check used (at most
                            // `live_at`).
                            let s = |a: &str| match item.as_ref().and_then(|i| i.get(a)) {
                                Some(AttributeValue::S(v)) => Some(v.clone()),
                                _ => None,
                            };
                            let expires = item.as_ref().and_then(|i| recorded_fence(i, "expires_at_ms"));
                            let lost = item.is_none()
                                || s("lease_id").as_deref() != Some(lease.lease_id.expose())
                                || item.as_ref().is_some_and(|i| i.contains_key("released_at_ms"))
                                || expires.is_some_and(|e| e <= live_at);
                            if !lost {
                                c.mistyped.push(format!("LeaseLost while the lease item is live: {item:?}"));
                            } else if paused {
                                c.paused_live_refused += 1
                            } else {
                                c.live_refused += 1
                            }
                        }
                        Err(FencedError::Dynamo(e)) => *c.other_errors.entry(format!("{e}")).or_default() += 1,
                        Err(e) => c.mistyped.push(format!("lease-live commit: {e:?}")),
                    }
                }
                let _ = coord.release(&key, &lease.lease_id).await;
            }
        }));
    }
    for t in tasks {
        t.await.expect("worker");
    }
    let c = Arc::try_unwrap(counts).expect("workers done").into_inner().unwrap();

    // Stale writes accepted: a fence below an earlier one in an item's commit-order history.
    let mut stale = 0;
    let mut landed = (0, 0);
    for k in 0..KEYS {
        for (id, live) in [(format!("g{k}"), false), (format!("live-g{k}"), true)] {
            let item = client
                .get_item()
                .table_name(&target)
                .key("id", AttributeValue::S(id.clone()))
                .consistent_read(true)
                .send()
                .await
                .unwrap()
                .item
                .unwrap_or_default();
            let history: Vec<u64> = match item.get("history") {
                Some(AttributeValue::L(l)) => l.iter().map(|v| v.as_n().unwrap().parse().unwrap()).collect(),
                _ => Vec::new(),
            };
            stale += history.windows(2).filter(|w| w[1] < w[0]).count();
            if live {
                landed.1 += history.len() as u64;
            } else {
                landed.0 += history.len() as u64;
                assert_eq!(
                    recorded_fence(&item, DEFAULT_ATTRIBUTE),
                    history.last().copied(),
                    "{id}: the fence recorded"
                );
            }
        }
    }
    eprintln!("guarded table: {c:?}; stale writes accepted: {stale}");
    assert_eq!(stale, 0, "stale writes accepted by the guarded table");
    assert_eq!(c.paused_live_committed, 0, "lease-live commits landed after a pause past expiry");
    assert!(c.mistyped.is_empty(), "refusals of the wrong type: {:?}", c.mistyped);
    assert_eq!(
        landed,
        (c.fenced_accepted + c.paused_fenced_accepted, c.live_committed),
        "every write that landed was counted"
    );
    // The run exercised what it claims to.
    assert!(c.enough(), "the run did not exercise enough in {:?}: {c:?}", start.elapsed());
}
