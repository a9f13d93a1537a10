//! A Jepsen-style safety run: many workers contend on a few keys through a fault-injecting
//! proxy in front of DynamoDB Local (lost responses, resets, delays, stalls, throttles, 5xx),
//! holders are randomly paused longer than their lease, and every write goes to a resource
//! guarded by fences. Invariants checked:
//! 1. the resource never accepts a fence below one it has seen (by construction) and never
//!    rejects a write made by a holder before its `safe_until`;
//! 2. fences strictly increase per key in grant order;
//! 3. no two holders' safe windows on one key overlap;
//! 4. after the run every key is free again within its duration + skew margin (no lease is
//!    stranded by a lost response);
//! 5. a holder whose renewals fail is told no later than its safe time.
//!
//! `short_safety_run` runs in the normal suite; the long run (>= 60 s) is
//! `cargo test -p leasehold-tests --test safety -- --ignored --nocapture`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    fence: u64,
    acquired_at_ms: u64,
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

async fn safety_run(seconds: u64, workers: usize, keys: usize) {
    let (proxy, table, conf) = proxied_table().await;
    let local = dynamo_local();
    let mut cfg = test_config();
    cfg.retry_budget = Duration::from_millis(1500);
    let margin = cfg.skew_margin;
    let lease = Duration::from_millis(1200);
    let resources: Arc<Vec<Mutex<Resource>>> = Arc::new((0..keys).map(|_| Mutex::new(Resource::default())).collect());
    let windows: Arc<Mutex<HashMap<usize, Vec<Window>>>> = Arc::new(Mutex::new(HashMap::new()));
    let totals = Arc::new(Totals::default());
    proxy.random_faults(
        80,
        &[
            ProxyFault::DropResponse,
            ProxyFault::Reset,
            ProxyFault::Delay(Duration::from_millis(150)),
            ProxyFault::Throttle,
            ProxyFault::ServerError,
            ProxyFault::Stall(Duration::from_millis(1500)),
        ],
        0x5EED,
    );
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
    let mut tasks = Vec::new();
    for w in 0..workers {
        // Every worker has its own client, as separate machines would.
        let coord = Coordinator::new(
            Arc::new(DynamoStore::new(aws_sdk_dynamodb::Client::new(&conf), table.clone())),
            cfg.clone(),
        );
        let (resources, windows, totals, timer_lag_us) =
            (resources.clone(), windows.clone(), totals.clone(), timer_lag_us.clone());
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
                    Err(e) => {
                        assert!(e.is_transient(), "worker {w}: unexpected {e}");
                        totals.store_errors.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                };
                totals.acquired.fetch_add(1, Ordering::Relaxed);
                let fence = held.fence();
                let acquired_at_ms = held.lease().map(|l| l.acquired_at_ms).unwrap_or(0);
                let start = Instant::now();
                let mut last_safe_write = start;
                let writes = 1 + rand(&mut seed) % 4;
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
                windows.lock().unwrap().entry(k).or_default().push(Window {
                    fence,
                    acquired_at_ms,
                    start,
                    end: last_safe_write,
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
    for t in tasks {
        t.await.unwrap();
    }
    let injected = proxy.injected();
    proxy.clear_faults();
    lag_monitor.abort();

    // 4. No stranded lease: every key is free within lease + margin after the run.
    let clean = Coordinator::new(Arc::new(DynamoStore::new(local.client().await, table.clone())), test_config());
    let deadline = Instant::now() + lease + margin + Duration::from_millis(2000);
    for k in 0..keys {
        let key = format!("safety-{k}");
        let l = clean
            .acquire(
                &key,
                "checker",
                Some(Duration::from_secs(5)),
                AcquireOptions { wait: Some(deadline.saturating_duration_since(Instant::now())), ..Default::default() },
            )
            .await
            .unwrap_or_else(|e| panic!("{key} stayed held after the run: {e}"));
        clean.release(&key, &l.lease_id).await.unwrap();
    }

    // 2 + 3. Fences strictly increase per key in grant order; safe windows never overlap.
    let mut violations = 0u64;
    let windows = windows.lock().unwrap();
    for (k, ws) in windows.iter() {
        let mut ws = ws.clone();
        ws.sort_by_key(|w| (w.acquired_at_ms, w.fence));
        for pair in ws.windows(2) {
            if pair[1].fence <= pair[0].fence {
                violations += 1;
                eprintln!("key {k}: fence {} granted after {}", pair[1].fence, pair[0].fence);
            }
            if pair[1].start < pair[0].end {
                violations += 1;
                eprintln!("key {k}: safe windows of fences {} and {} overlap", pair[0].fence, pair[1].fence);
            }
        }
    }
    let mut accepted = 0;
    let mut rejected_stale = 0;
    for r in resources.iter() {
        let r = r.lock().unwrap();
        if r.rejected_safe > 0 {
            eprintln!("{} write(s) inside a safe window were rejected", r.rejected_safe);
        }
        violations += r.rejected_safe;
        accepted += r.accepted;
        rejected_stale += r.rejected_stale;
    }
    let late = totals.late_loss_notices.load(Ordering::Relaxed);
    if late > 0 {
        eprintln!("{late} holder(s) were told of a lost lease after their safe time");
    }
    violations += late;
    let t = &totals;
    println!(
        "safety: {seconds} s, {workers} workers, {keys} keys: operations {}, acquired {}, LeaseHeld {}, store errors {}, \
         losses {}, pauses {}, writes accepted {accepted}, stale writes rejected {rejected_stale}, faults injected {injected}, max timer lag {} ms, violations {violations}",
        t.operations.load(Ordering::Relaxed),
        t.acquired.load(Ordering::Relaxed),
        t.held_errors.load(Ordering::Relaxed),
        t.store_errors.load(Ordering::Relaxed),
        t.losses.load(Ordering::Relaxed),
        t.pauses.load(Ordering::Relaxed),
        timer_lag_us.load(Ordering::Relaxed) / 1000,
    );
    assert_eq!(violations, 0);
    assert!(injected > 10, "the run must actually inject faults: {injected}");
    assert!(t.acquired.load(Ordering::Relaxed) > 20, "too little happened to mean anything");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn short_safety_run() {
    safety_run(10, 16, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "long run (>= 60 s): cargo test -p leasehold-tests --test safety -- --ignored --nocapture"]
async fn long_safety_run() {
    let secs = std::env::var("LEASEHOLD_SAFETY_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(60);
    safety_run(secs, 16, 3).await;
}
