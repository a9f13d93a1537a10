//! The protocol suite: every case runs against the embedded store and against DynamoDB Local.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold::store::{Condition, Write};
use leasehold::{AcquireOptions, Coordinator, Error, Keepalive, LeaseId, Lost, NotHolderReason};
use leasehold_tests::{both_backends, test_config, Backend, Counting, Fault, Faulty, Gated, GuardedResource, Holds};
use serde_json::json;

both_backends!(
    acquire_get_release,
    held_key_reports_holder_and_expiry,
    fences_strictly_increase,
    wrong_lease_id_changes_nothing,
    expired_lease_is_lost_and_taken_over,
    lost_responses_are_idempotent,
    swept_item_restarts_fence_higher,
    validation_rules,
    min_hold_blocks_early_release,
    fail_closed_lease,
    wait_for_release,
    one_request_per_uncontended_operation,
    transient_errors_are_retried_then_reported,
    contenders_never_overlap,
    waiters_share_a_contended_key_evenly,
    crash_handover_within_bound,
    held_lease_renews_and_notices_loss,
    late_heartbeat_does_not_keep_a_lost_lease,
    keepalive_and_metadata_round_trip,
    keepalive_sweep_renews_every_live_lease,
    two_handles_on_one_store,
);

fn secs(s: u64) -> Option<Duration> {
    Some(Duration::from_secs(s))
}

fn ms(m: u64) -> Option<Duration> {
    Some(Duration::from_millis(m))
}

/// The scheduling delay this runtime suffers while a timing check runs: a task sleeping 1 ms
/// over and over records the largest overshoot. A deadline the code promises to meet can be
/// met no sooner than its timer fires plus this delay, so the checks below add exactly it
/// instead of a fixed slack that only a quiet machine keeps.
struct Lag {
    max_us: Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Lag {
    fn start() -> Lag {
        let max_us = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let m = max_us.clone();
        let task = tokio::spawn(async move {
            loop {
                let t = Instant::now();
                tokio::time::sleep(Duration::from_millis(1)).await;
                let over = t.elapsed().saturating_sub(Duration::from_millis(1));
                m.fetch_max(over.as_micros() as u64, Ordering::Relaxed);
            }
        });
        Lag { max_us, task }
    }

    fn max(&self) -> Duration {
        Duration::from_micros(self.max_us.load(Ordering::Relaxed))
    }
}

impl Drop for Lag {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The longest of a few refused acquires (one request each) on a held key: what one attempt
/// costs on this machine right now.
async fn attempt_time(c: &Coordinator, held_key: &str) -> Duration {
    let mut worst = Duration::ZERO;
    for _ in 0..5 {
        let t = Instant::now();
        let r = c.acquire(held_key, "probe", secs(1), AcquireOptions::default()).await;
        assert!(matches!(r, Err(Error::LeaseHeld { .. })), "{r:?}");
        worst = worst.max(t.elapsed());
    }
    worst
}

async fn acquire_get_release(b: Backend) {
    let c = b.coordinator(test_config());
    let lease = c.acquire("jobs/nightly", "worker-1", secs(30), AcquireOptions::default()).await.unwrap();
    assert_eq!(lease.key, "jobs/nightly");
    assert_eq!(lease.holder, "worker-1");
    assert_eq!(lease.lease_id.expose().len(), 32, "128-bit hex lease_id");
    assert_eq!(lease.expires_at_ms, Some(lease.acquired_at_ms + 30_000));
    let now = c.now_us();
    assert!(lease.fence >= now - 5_000_000 && lease.fence <= now, "fresh key starts its fence at the clock in µs");
    let safe = lease.safe_until.expect("timed lease");
    assert!(safe > Instant::now() + Duration::from_secs(29) && safe < Instant::now() + Duration::from_secs(30));

    let state = c.get("jobs/nightly").await.unwrap();
    assert!(state.held);
    assert_eq!(state.fence, lease.fence);
    assert_eq!(state.holder, "worker-1");
    let json = serde_json::to_string(&state).unwrap();
    assert!(
        !json.contains("lease_id") && !json.contains(lease.lease_id.expose()),
        "get never reveals the lease_id: {json}"
    );

    let rel = c.release("jobs/nightly", &lease.lease_id).await.unwrap();
    assert_eq!(rel.fence, lease.fence);
    let state = c.get("jobs/nightly").await.unwrap();
    assert!(!state.held);
    assert!(state.released_at_ms.is_some());
    // Released: the next acquire succeeds at once.
    let next = c.acquire("jobs/nightly", "worker-2", secs(30), AcquireOptions::default()).await.unwrap();
    assert!(next.fence > lease.fence, "{} after {}", next.fence, lease.fence);
    assert!(matches!(c.get("never/taken").await, Err(Error::NotFound { .. })));
}

async fn held_key_reports_holder_and_expiry(b: Backend) {
    let c = b.coordinator(test_config());
    let l = c.acquire("k", "alice", secs(20), AcquireOptions::default()).await.unwrap();
    match c.acquire("k", "bob", secs(20), AcquireOptions::default()).await {
        Err(Error::LeaseHeld { key, holder, expires_at_ms }) => {
            assert_eq!(key, "k");
            assert_eq!(holder, "alice");
            assert_eq!(expires_at_ms, l.expires_at_ms);
        }
        other => panic!("expected LeaseHeld, got {other:?}"),
    }
    // The failed attempt changed nothing.
    let s = c.get("k").await.unwrap();
    assert_eq!((s.holder.as_str(), s.fence, s.expires_at_ms), ("alice", l.fence, l.expires_at_ms));
}

async fn fences_strictly_increase(b: Backend) {
    let c = b.coordinator(test_config());
    let mut last = 0;
    for i in 0..5 {
        let l = c.acquire("f", "h", secs(10), AcquireOptions::default()).await.unwrap();
        assert!(l.fence > last, "round {i}: {} after {last}", l.fence);
        last = l.fence;
        if i % 2 == 0 {
            c.release("f", &l.lease_id).await.unwrap();
        } else {
            let s = c.force_release("f").await.unwrap();
            assert_eq!(s.fence, l.fence + 1, "force-release advances the fence");
            assert!(!s.held);
            last = s.fence;
        }
    }
    assert!(matches!(c.force_release("nothing-here").await, Err(Error::NotFound { .. })));

    // Fences come from the acquiring coordinator's clock in µs; one whose clock runs behind
    // still issues a higher fence than the last one on the key (the store rejects a fence that
    // is not above it, and the coordinator goes again just above the one it was shown).
    let counting = Counting::new(b.store());
    let at = |offset_ms: i64| {
        let mut cfg = test_config();
        cfg.clock_offset_ms = offset_ms;
        Coordinator::new(counting.clone(), cfg)
    };
    let ahead = at(60_000).acquire("skew", "fast", secs(10), AcquireOptions::default()).await.unwrap();
    assert!(ahead.fence >= (at(0).now_ms() + 59_000) * 1000, "µs fence from the fast clock: {}", ahead.fence);
    let freed = at(60_000).force_release("skew").await.unwrap();
    let before = counting.total();
    let behind = at(0).acquire("skew", "slow", secs(10), AcquireOptions::default()).await.unwrap();
    assert_eq!(behind.fence, freed.fence + 1, "just above the fence it was shown");
    assert_eq!(counting.total() - before, 2, "one rejected put, one that lands");
    assert!(ahead.fence < freed.fence && freed.fence < behind.fence);
}

async fn wrong_lease_id_changes_nothing(b: Backend) {
    let c = b.coordinator(test_config());
    let l = c.acquire("w", "owner", secs(30), AcquireOptions::default()).await.unwrap();
    let forged = LeaseId::generate();
    for r in [c.heartbeat("w", &forged, None).await.map(|_| ()), c.release("w", &forged).await.map(|_| ())] {
        assert!(matches!(r, Err(Error::NotHolder { reason: NotHolderReason::WrongLeaseId, .. })), "{r:?}");
    }
    let s = c.get("w").await.unwrap();
    assert!(s.held);
    assert_eq!((s.fence, s.expires_at_ms, s.released_at_ms), (l.fence, l.expires_at_ms, None));
    let missing = c.release("nope", &forged).await;
    assert!(matches!(missing, Err(Error::NotHolder { reason: NotHolderReason::Missing, .. })), "{missing:?}");
}

async fn expired_lease_is_lost_and_taken_over(b: Backend) {
    let c = b.coordinator(test_config());
    let old = c.acquire("e", "slow", ms(300), AcquireOptions::default()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let r = c.heartbeat("e", &old.lease_id, None).await;
    assert!(matches!(r, Err(Error::NotHolder { reason: NotHolderReason::Expired, .. })), "{r:?}");
    let new = c.acquire("e", "fast", secs(30), AcquireOptions::default()).await.unwrap();
    assert!(new.fence > old.fence, "{} after {}", new.fence, old.fence);
    let r = c.heartbeat("e", &old.lease_id, None).await;
    assert!(matches!(r, Err(Error::NotHolder { reason: NotHolderReason::WrongLeaseId, .. })), "{r:?}");
    let r = c.release("e", &old.lease_id).await;
    assert!(matches!(r, Err(Error::NotHolder { .. })), "{r:?}");
    assert_eq!(c.get("e").await.unwrap().holder, "fast");
    // A heartbeat of a released lease says so.
    c.release("e", &new.lease_id).await.unwrap();
    let r = c.heartbeat("e", &new.lease_id, None).await;
    assert!(matches!(r, Err(Error::NotHolder { reason: NotHolderReason::Released, .. })), "{r:?}");
}

async fn lost_responses_are_idempotent(b: Backend) {
    let faulty = Faulty::new(b.store());
    let c = Coordinator::new(faulty.clone(), test_config());
    // Acquire: the write lands, the answer is lost twice; the retry returns the same lease.
    faulty.inject(&[Fault::LoseResponse, Fault::LoseResponse]);
    let l = c.acquire("i", "h", secs(30), AcquireOptions::default()).await.unwrap();
    assert_eq!(faulty.injected.load(Ordering::SeqCst), 2);
    let s = c.get("i").await.unwrap();
    assert_eq!(s.fence, l.fence, "no second fence was issued");
    // A caller-side retry with the same lease_id (a new request) also gets the same lease.
    let again = c
        .acquire("i", "h", secs(30), AcquireOptions { lease_id: Some(l.lease_id.clone()), ..Default::default() })
        .await
        .unwrap();
    assert_eq!(again.fence, l.fence);
    // Heartbeat with a lost answer: retried, same outcome (extended).
    faulty.inject(&[Fault::LoseResponse]);
    let h = c.heartbeat("i", &l.lease_id, Some(Duration::from_secs(40))).await.unwrap();
    assert_eq!(h.fence, l.fence);
    assert_eq!(h.duration_ms, Some(40_000));
    // Release with a lost answer: retried, succeeds; nothing is stranded.
    faulty.inject(&[Fault::LoseResponse]);
    c.release("i", &l.lease_id).await.unwrap();
    let s = c.get("i").await.unwrap();
    assert!(!s.held);
    let next = c.acquire("i", "other", secs(30), AcquireOptions::default()).await.unwrap();
    assert!(next.fence > l.fence, "{} after {}", next.fence, l.fence);
    // Ambiguous failure with no retry budget left is reported, and the lease still exists
    // for the caller to retry with its lease_id.
    let id = LeaseId::generate();
    c.release("i", &next.lease_id).await.unwrap();
    faulty.inject(&[Fault::LoseResponse; 50]);
    let mut cfg = test_config();
    cfg.retry_budget = Duration::from_millis(1);
    let impatient = Coordinator::new(faulty.clone(), cfg);
    let r = impatient
        .acquire("i", "h2", secs(30), AcquireOptions { lease_id: Some(id.clone()), ..Default::default() })
        .await;
    assert!(matches!(r, Err(Error::OutcomeUnknown { .. })), "the answer says the outcome is unknown: {r:?}");
    faulty.plan.lock().unwrap().clear();
    let landed = c.get("i").await.unwrap();
    assert!(landed.held && landed.holder == "h2" && landed.fence > next.fence, "{landed:?}");
    let recovered = c
        .acquire("i", "h2", secs(30), AcquireOptions { lease_id: Some(id.clone()), ..Default::default() })
        .await
        .unwrap();
    assert_eq!(recovered.fence, landed.fence, "the landed write is found, not repeated");
}

async fn swept_item_restarts_fence_higher(b: Backend) {
    let c = b.coordinator(test_config());
    let l = c.acquire("ttl", "h", secs(10), AcquireOptions::default()).await.unwrap();
    c.release("ttl", &l.lease_id).await.unwrap();
    // Push the fence ahead of the clock as far as a busy key could, then sweep the item.
    for _ in 0..20 {
        let l = c.acquire("ttl", "h", secs(10), AcquireOptions::default()).await.unwrap();
        c.release("ttl", &l.lease_id).await.unwrap();
    }
    let last = c.get("ttl").await.unwrap().fence;
    // Simulate the TTL sweeper deleting the item (the real sweeper runs in dynamo_ttl.rs).
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(matches!(b.delete("ttl", &Condition::Exists).await.unwrap(), Write::Applied(_)));
    assert!(matches!(c.get("ttl").await, Err(Error::NotFound { .. })));
    let fresh = c.acquire("ttl", "h", secs(10), AcquireOptions::default()).await.unwrap();
    assert!(fresh.fence > last, "fresh item fence {} must exceed the swept item's {last}", fresh.fence);
}

async fn validation_rules(b: Backend) {
    let c = b.coordinator(leasehold::Config::default());
    let d = secs(30);
    let o = AcquireOptions::default;
    let cases: Vec<(&str, leasehold::Result<leasehold::Lease>)> = vec![
        ("empty key", c.acquire("", "h", d, o()).await),
        ("long key", c.acquire(&"k".repeat(1025), "h", d, o()).await),
        ("control char key", c.acquire("a\nb", "h", d, o()).await),
        ("nul key", c.acquire("a\0b", "h", d, o()).await),
        ("empty holder", c.acquire("k", "", d, o()).await),
        ("long holder", c.acquire("k", &"h".repeat(257), d, o()).await),
        ("short duration", c.acquire("k", "h", ms(999), o()).await),
        ("long duration", c.acquire("k", "h", Some(Duration::from_secs(12 * 3600 + 1)), o()).await),
        ("min_hold > duration", c.acquire("k", "h", d, AcquireOptions { min_hold: secs(31), ..o() }).await),
        (
            "metadata > 4 KiB",
            c.acquire(
                "k",
                "h",
                d,
                AcquireOptions { metadata: Some(json!({"x": "y".repeat(4100)}).as_object().unwrap().clone()), ..o() },
            )
            .await,
        ),
        (
            "wait too long",
            c.acquire("k", "h", d, AcquireOptions { wait: Some(Duration::from_secs(13 * 3600)), ..o() }).await,
        ),
        (
            "keepalive in the past",
            c.acquire(
                "k",
                "h",
                d,
                AcquireOptions { keepalive: Some(Keepalive { until_ms: 1, execution_arn: None }), ..o() },
            )
            .await,
        ),
        (
            "keepalive bad arn",
            c.acquire(
                "k",
                "h",
                d,
                AcquireOptions {
                    keepalive: Some(Keepalive {
                        until_ms: c.now_ms() + 60_000,
                        execution_arn: Some("not-an-arn".into()),
                    }),
                    ..o()
                },
            )
            .await,
        ),
        (
            "keepalive on fail-closed",
            c.acquire(
                "k",
                "h",
                None,
                AcquireOptions {
                    keepalive: Some(Keepalive { until_ms: c.now_ms() + 60_000, execution_arn: None }),
                    ..o()
                },
            )
            .await,
        ),
    ];
    for (what, r) in cases {
        assert!(matches!(r, Err(Error::InvalidRequest(_))), "{what}: {r:?}");
    }
    // Exactly at the bounds is fine.
    c.acquire(&"k".repeat(1024), &"h".repeat(256), secs(1), o()).await.unwrap();
    c.acquire("ключ/🔒", "держатель", Some(Duration::from_secs(12 * 3600)), o()).await.unwrap();
    assert!(matches!(leasehold::validate::lease_id("short"), Err(Error::InvalidRequest(_))));
    assert!(leasehold::validate::lease_id(&"a".repeat(22)).is_ok());
    assert!(matches!(
        leasehold::validate::lease_id("0123456789abcdef0123456789abcdef!"),
        Err(Error::InvalidRequest(_))
    ));
    let r = c.heartbeat("k", &LeaseId::generate(), Some(Duration::from_secs(0))).await;
    assert!(matches!(r, Err(Error::InvalidRequest(_))), "{r:?}");
    // Nothing was written by any rejected request.
    assert!(matches!(c.get("k").await, Err(Error::NotFound { .. })));
}

async fn min_hold_blocks_early_release(b: Backend) {
    let c = b.coordinator(test_config());
    let l = c.acquire("mh", "h", secs(10), AcquireOptions { min_hold: ms(800), ..Default::default() }).await.unwrap();
    let rel = c.release("mh", &l.lease_id).await.unwrap();
    assert_eq!(rel.free_at_ms, l.acquired_at_ms + 800);
    let r = c.acquire("mh", "other", secs(10), AcquireOptions::default()).await;
    match r {
        Err(Error::LeaseHeld { expires_at_ms, .. }) => assert_eq!(expires_at_ms, Some(l.acquired_at_ms + 800)),
        other => panic!("expected LeaseHeld during min_hold, got {other:?}"),
    }
    let t = Instant::now();
    let next =
        c.acquire("mh", "other", secs(10), AcquireOptions { wait: secs(5), ..Default::default() }).await.unwrap();
    assert!(c.now_ms() >= l.acquired_at_ms + 800);
    assert!(t.elapsed() < Duration::from_secs(2), "the waiter slept until the min_hold end, {:?}", t.elapsed());
    assert!(next.fence > l.fence, "{} after {}", next.fence, l.fence);
}

async fn fail_closed_lease(b: Backend) {
    let c = b.coordinator(test_config());
    // Without a caller-chosen lease_id, a lost answer would strand it forever: refused.
    let r = c.acquire("fc", "h", None, AcquireOptions::default()).await;
    assert!(matches!(&r, Err(Error::InvalidRequest(m)) if m.contains("lease_id")), "{r:?}");
    let id = Some(LeaseId::generate());
    let l = c.acquire("fc", "h", None, AcquireOptions { lease_id: id, ..Default::default() }).await.unwrap();
    assert_eq!(l.expires_at_ms, None);
    assert_eq!(l.safe_until, None);
    let s = c.get("fc").await.unwrap();
    assert!(s.held && s.expires_at_ms.is_none());
    // Heartbeat is a no-op for a fail-closed lease; it stays held.
    let h = c.heartbeat("fc", &l.lease_id, None).await.unwrap();
    assert_eq!((h.fence, h.expires_at_ms), (l.fence, None));
    assert!(matches!(
        c.acquire("fc", "x", secs(1), AcquireOptions::default()).await,
        Err(Error::LeaseHeld { expires_at_ms: None, .. })
    ));
    // Operators free it, and the fence moves on.
    let s = c.force_release("fc").await.unwrap();
    assert_eq!(s.fence, l.fence + 1);
    let r = c.heartbeat("fc", &l.lease_id, None).await;
    assert!(matches!(r, Err(Error::NotHolder { reason: NotHolderReason::Released, .. })), "{r:?}");
    let n = c.acquire("fc", "x", secs(1), AcquireOptions::default()).await.unwrap();
    assert!(n.fence > s.fence, "{} after {}", n.fence, s.fence);
}

async fn wait_for_release(b: Backend) {
    let cfg = test_config();
    let poll_max = cfg.poll_max;
    let c = b.coordinator(cfg);
    let lag = Lag::start();
    let l = c.acquire("wr", "a", secs(30), AcquireOptions::default()).await.unwrap();
    let attempt = attempt_time(&c, "wr").await;
    let c2 = c.clone();
    let waiter = tokio::spawn(async move {
        let t = Instant::now();
        let r = c2.acquire("wr", "b", secs(30), AcquireOptions { wait: secs(10), ..Default::default() }).await;
        (r, t.elapsed(), Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.release("wr", &l.lease_id).await.unwrap();
    let released = Instant::now();
    let (r, waited, got_at) = waiter.await.unwrap();
    let got = r.unwrap();
    assert_eq!(got.holder, "b");
    assert!(got.fence > l.fence, "{} after {}", got.fence, l.fence);
    assert!(waited >= Duration::from_millis(300), "{waited:?}");
    // A waiter polling a key whose lease does not change sleeps at most 1.5 x poll_max
    // between tries (DESIGN.md, "Contention"): after the release it tries within that, and
    // the try costs one attempt; plus the scheduling delay measured meanwhile.
    let after = got_at.saturating_duration_since(released);
    let bound = poll_max.mul_f64(1.5) + 2 * attempt + lag.max();
    assert!(
        after <= bound,
        "took the key {after:?} after the release, bound {bound:?} (attempt {attempt:?}, lag {:?})",
        lag.max()
    );
    // A wait that runs out reports LeaseHeld, never before its end and at most one attempt
    // (plus the scheduling delay) after it.
    let attempt = attempt_time(&c, "wr").await;
    let t = Instant::now();
    let r = c.acquire("wr", "c", secs(30), AcquireOptions { wait: ms(400), ..Default::default() }).await;
    let took = t.elapsed();
    assert!(matches!(r, Err(Error::LeaseHeld { .. })), "{r:?}");
    let bound = Duration::from_millis(400) + 2 * attempt + lag.max();
    assert!(took >= Duration::from_millis(400) && took <= bound, "{took:?}, bound {bound:?}");
}

async fn one_request_per_uncontended_operation(b: Backend) {
    let counting = Counting::new(b.store());
    let c = Coordinator::new(counting.clone(), test_config());
    let l = c.acquire("one", "h", secs(30), AcquireOptions::default()).await.unwrap();
    assert_eq!(counting.total(), 1, "acquire");
    c.heartbeat("one", &l.lease_id, None).await.unwrap();
    assert_eq!(counting.total(), 2, "heartbeat");
    c.release("one", &l.lease_id).await.unwrap();
    assert_eq!(counting.total(), 3, "release");
    // A failed acquire learns holder and expiry from the rejected write itself: no GetItem.
    let _held = c.acquire("one", "h", secs(30), AcquireOptions::default()).await.unwrap();
    let before = counting.total();
    assert!(matches!(c.acquire("one", "x", secs(30), AcquireOptions::default()).await, Err(Error::LeaseHeld { .. })));
    assert_eq!(counting.total() - before, 1, "failed acquire");
    assert_eq!(counting.gets.load(Ordering::SeqCst), 0);
}

async fn transient_errors_are_retried_then_reported(b: Backend) {
    let faulty = Faulty::new(b.store());
    let c = Coordinator::new(faulty.clone(), test_config());
    faulty.inject(&[Fault::Throttle, Fault::Unavailable, Fault::Throttle]);
    let l = c.acquire("t", "h", secs(30), AcquireOptions::default()).await.unwrap();
    assert_eq!(faulty.injected.load(Ordering::SeqCst), 3);
    faulty.inject(&[Fault::Throttle; 1000]);
    let mut cfg = test_config();
    cfg.retry_budget = Duration::from_millis(300);
    let c = Coordinator::new(faulty.clone(), cfg);
    let t = Instant::now();
    let r = c.heartbeat("t", &l.lease_id, None).await;
    assert!(matches!(r, Err(Error::Throttled(_))), "{r:?}");
    assert!(t.elapsed() < Duration::from_millis(1500), "bounded by the deadline: {:?}", t.elapsed());
    faulty.plan.lock().unwrap().clear();
    faulty.inject(&[Fault::Unavailable; 1000]);
    let r = c.release("t", &l.lease_id).await;
    assert!(matches!(r, Err(Error::StoreUnavailable(_))), "{r:?}");
    faulty.plan.lock().unwrap().clear();
    // Nothing was lost: the lease is intact and releasable.
    c.release("t", &l.lease_id).await.unwrap();
}

/// >= 8 contenders on one key for several seconds, each writing to a resource guarded by
/// > fences while it believes it holds the lease.
async fn contenders_never_overlap(b: Backend) {
    let c = b.coordinator(test_config());
    let resource = Arc::new(GuardedResource::default());
    let holds = Arc::new(Holds::default());
    let fences = Arc::new(Mutex::new(Vec::<u64>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for w in 0..8 {
        let (c, resource, holds, fences, stop) =
            (c.clone(), resource.clone(), holds.clone(), fences.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut mine = 0u32;
            while !stop.load(Ordering::SeqCst) {
                let opts = AcquireOptions { wait: ms(500), ..Default::default() };
                let l = match c.acquire("hot", &format!("w{w}"), secs(5), opts).await {
                    Ok(l) => l,
                    Err(Error::LeaseHeld { .. }) => continue,
                    Err(e) => panic!("worker {w}: {e}"),
                };
                holds.enter();
                fences.lock().unwrap().push(l.fence);
                assert!(resource.write(l.fence), "current holder {w} was rejected at fence {}", l.fence);
                tokio::time::sleep(Duration::from_millis(2)).await;
                assert!(resource.write(l.fence), "current holder {w} was rejected at fence {}", l.fence);
                holds.leave();
                c.release("hot", &l.lease_id).await.unwrap();
                mine += 1;
            }
            mine
        }));
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, Ordering::SeqCst);
    let mut per_worker = Vec::new();
    for t in tasks {
        per_worker.push(t.await.unwrap());
    }
    let fences = fences.lock().unwrap().clone();
    assert_eq!(holds.overlaps(), 0, "two holds overlapped");
    assert!(fences.len() >= 20, "too few acquisitions to mean anything: {}", fences.len());
    assert!(fences.windows(2).all(|w| w[1] > w[0]), "fences did not strictly increase in grant order");
    assert_eq!(fences.iter().collect::<HashSet<_>>().len(), fences.len());
    assert_eq!(resource.rejected(), 0);
    assert_eq!(resource.accepted(), 2 * fences.len() as u64);
    assert!(per_worker.iter().filter(|n| **n > 0).count() >= 4, "work spread: {per_worker:?}");
}

/// Six workers, each with its own coordinator (its own client, as on separate machines), take
/// turns on one key: hold 5 ms, release, ask again at once. Releasing and asking again must not
/// beat the workers already waiting: every worker gets a fair part of the acquisitions, at a
/// bounded number of requests each (DESIGN.md, "Contention").
async fn waiters_share_a_contended_key_evenly(b: Backend) {
    const WORKERS: usize = 6;
    // Judged on a number of turns, not on what a machine manages in a fixed time: a loaded
    // machine takes longer to reach it, the evenness is the same. The limit only guards hangs.
    const TURNS: u64 = 150;
    let holds = Arc::new(Holds::default());
    let taken = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let limit = Instant::now() + Duration::from_secs(300);
    let mut tasks = Vec::new();
    let mut counters = Vec::new();
    for w in 0..WORKERS {
        let counting = Counting::new(b.reopen());
        counters.push(counting.clone());
        let c = Coordinator::new(counting, test_config());
        let (holds, taken) = (holds.clone(), taken.clone());
        tasks.push(tokio::spawn(async move {
            let mut mine = 0u64;
            while taken.load(Ordering::SeqCst) < TURNS {
                let wait = limit.saturating_duration_since(Instant::now());
                let opts = AcquireOptions { wait: Some(wait), ..Default::default() };
                let l = match c.acquire("turns", &format!("w{w}"), secs(10), opts).await {
                    Ok(l) => l,
                    Err(e) => panic!("worker {w}: {e}"),
                };
                // A turn counts only while the target is not reached (the others are still
                // waiting for theirs); later ones are handed straight back.
                let counted = taken.fetch_add(1, Ordering::SeqCst) < TURNS;
                if counted {
                    holds.enter();
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    holds.leave();
                    mine += 1;
                }
                c.release("turns", &l.lease_id).await.unwrap();
            }
            mine
        }));
    }
    let mut per_worker = Vec::new();
    for t in tasks {
        per_worker.push(t.await.unwrap());
    }
    let total: u64 = per_worker.iter().sum();
    let requests: usize = counters.iter().map(|c| c.total()).sum();
    assert_eq!(holds.overlaps(), 0, "two holds overlapped");
    assert_eq!(total, TURNS, "{per_worker:?}");
    // A fair share is total / WORKERS; random polling spreads it, a releaser that wins again
    // at once starves the others far below it.
    let fair = total as f64 / WORKERS as f64;
    assert!(per_worker.iter().all(|n| *n as f64 >= 0.4 * fair), "uneven turns: {per_worker:?} (fair share {fair:.0})");
    // Per acquisition, the turns handed straight back after the target included.
    let per_acquisition = requests as f64 / taken.load(Ordering::SeqCst) as f64;
    eprintln!("turns per worker {per_worker:?}, {per_acquisition:.2} requests per acquisition");
    assert!(per_acquisition <= 3.0, "{per_acquisition:.2} requests per acquisition, {per_worker:?}");
}

/// A holder that stops renewing is replaced within duration + skew margin + 100 ms of its
/// last write, and never before its duration.
async fn crash_handover_within_bound(b: Backend) {
    let cfg = test_config();
    let margin = cfg.skew_margin;
    let c = b.coordinator(cfg);
    for trial in 0..3 {
        let key = format!("crash-{trial}");
        let lag = Lag::start();
        let before_write = c.now_ms();
        let l = c.acquire(&key, "doomed", Some(Duration::from_millis(1000)), AcquireOptions::default()).await.unwrap();
        let attempt = attempt_time(&c, &key).await;
        // The holder "crashes": it never renews. A waiter is already waiting.
        let taken =
            c.acquire(&key, "heir", secs(10), AcquireOptions { wait: secs(5), ..Default::default() }).await.unwrap();
        let gap = taken.acquired_at_ms - l.acquired_at_ms;
        assert!(taken.acquired_at_ms >= l.expires_at_ms.unwrap(), "trial {trial}: taken before expiry");
        assert!(gap >= 1000, "trial {trial}: handover after {gap} ms, before the 1000 ms duration");
        // A waiter never sleeps past the holder's expiry: its winning try is sent by then plus
        // the skew margin, one refused try that was already on its way (an attempt), the
        // millisecond resolution of both timestamps and the scheduling delay measured meanwhile.
        let slack = attempt + lag.max() + Duration::from_millis(2);
        let bound = 1000 + margin.as_millis() as u64 + slack.as_millis() as u64;
        assert!(
            gap <= bound,
            "trial {trial}: handover after {gap} ms > {bound} ms (attempt {attempt:?}, lag {:?})",
            lag.max()
        );
        assert!(l.acquired_at_ms >= before_write);
        assert!(taken.fence > l.fence, "{} after {}", taken.fence, l.fence);
    }
}

async fn held_lease_renews_and_notices_loss(b: Backend) {
    let c = b.coordinator(test_config());
    // Survives 2.5 durations thanks to renewals. A renewal has the duration less a third and
    // the skew margin to land (1.28 s here): a loaded 2-core machine can hold a request to
    // DynamoDB Local for longer than the 350 ms a 600 ms lease leaves, which is a slow store,
    // not a defect; a duration of 2 s checks the same thing.
    let held = c.hold("bg", "h", Duration::from_secs(2), AcquireOptions::default()).await.unwrap();
    let fence = held.fence();
    let out = held.run(tokio::time::sleep(Duration::from_millis(5000))).await;
    assert!(out.is_ok(), "{out:?}");
    let s = c.get("bg").await.unwrap();
    assert!(s.held && s.fence == fence);
    assert!(held.safe_until().unwrap() > Instant::now());
    // An operator evicts it: the holder is told and its work is cancelled.
    c.force_release("bg").await.unwrap();
    let out = held.run(tokio::time::sleep(Duration::from_secs(10))).await;
    assert_eq!(out, Err(Lost::NotHolder(NotHolderReason::Released)));
    assert!(held.is_lost());
    drop(held);
    // Dropping a live handle releases it in the background.
    let held = c.hold("bg2", "h", Duration::from_secs(30), AcquireOptions::default()).await.unwrap();
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(5);
    while c.get("bg2").await.unwrap().held {
        assert!(Instant::now() < deadline, "drop did not release");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Renewals that keep failing end the hold before its safe time runs out.
    let faulty = Faulty::new(b.store());
    let fc = Coordinator::new(faulty.clone(), test_config());
    let lag = Lag::start();
    let held = fc.hold("bg3", "h", Duration::from_millis(600), AcquireOptions::default()).await.unwrap();
    let safe = held.safe_until().unwrap();
    faulty.inject(&[Fault::Unavailable; 10_000]);
    let lost = held.lost().await;
    let told = Instant::now();
    assert_eq!(lost, Lost::SafeTimeExpired);
    // Told when its timer at the safe time fires: late by no more than the scheduling delay
    // this runtime showed meanwhile (plus 1 ms of timer resolution).
    let late = told.saturating_duration_since(safe);
    assert!(late <= lag.max() + Duration::from_millis(1), "told late: {late:?} after safe time (lag {:?})", lag.max());
    faulty.plan.lock().unwrap().clear();
}

/// A renewal held up in the network past the holder's safe time: the holder is told the lease
/// is lost, then the renewal lands (its condition carries the time it was sent, when the lease
/// was live) and extends the lease. The holder must release what it may still hold, or the key
/// stays blocked for another duration with nobody working under it. Ordering only: the key
/// must be free before the expiry the late renewal wrote.
async fn late_heartbeat_does_not_keep_a_lost_lease(b: Backend) {
    for drop_first in [false, true] {
        let key = format!("late-{drop_first}");
        let gated = Gated::new(b.store());
        let c = Coordinator::new(gated.clone(), test_config());
        let other = b.coordinator(test_config());
        gated.arm();
        let held = c.hold(&key, "a", Duration::from_millis(900), AcquireOptions::default()).await.unwrap();
        assert_eq!(held.lost().await, Lost::SafeTimeExpired);
        if drop_first {
            // The holder gives up its handle as soon as it is told.
            drop_handle(held);
            gated.open();
            check_late(&gated, &other, &key).await;
        } else {
            // The holder keeps its handle (a `run` waiting for its command to stop).
            gated.open();
            check_late(&gated, &other, &key).await;
            drop(held);
        }
    }
}

fn drop_handle(held: leasehold::HeldLease) {
    drop(held);
}

async fn check_late(gated: &Gated, other: &Coordinator, key: &str) {
    let late = gated.wait_landed().await;
    let got = other.acquire(key, "b", secs(5), AcquireOptions { wait: secs(10), ..Default::default() }).await.unwrap();
    match late {
        Write::Applied(r) => {
            let blocked_until = r.expires_at_ms.unwrap();
            assert!(
                got.acquired_at_ms < blocked_until,
                "{key}: the late renewal kept the key blocked until {blocked_until} (acquired at {})",
                got.acquired_at_ms
            );
        }
        // The release after the loss landed first: the late renewal found the lease released.
        Write::Rejected(r) => assert!(r.unwrap().released_at_ms.is_some(), "{key}: rejected for another reason"),
    }
}

async fn keepalive_and_metadata_round_trip(b: Backend) {
    let c = b.coordinator(test_config());
    let meta = json!({"job": "reindex", "attempt": 3, "tags": ["a", "b"]}).as_object().unwrap().clone();
    let ka = Keepalive {
        until_ms: c.now_ms() + 3_600_000,
        execution_arn: Some("arn:aws:states:us-east-1:123456789012:execution:sm:run-1".into()),
    };
    let l = c
        .acquire(
            "meta",
            "h",
            secs(30),
            AcquireOptions { metadata: Some(meta.clone()), keepalive: Some(ka.clone()), ..Default::default() },
        )
        .await
        .unwrap();
    assert_eq!(l.metadata.as_ref(), Some(&meta));
    let s = c.get("meta").await.unwrap();
    assert_eq!(s.metadata, Some(meta));
    assert_eq!(s.keepalive, Some(ka.clone()));
    // The keep-alive index finds it; after release it is gone from the index.
    let shard = leasehold::store::keepalive_shard("meta", leasehold::store::KEEPALIVE_SHARDS);
    let page =
        b.store().scan(&leasehold::store::ScanKind::Keepalive { shard, after_ms: c.now_ms() }, None, 10).await.unwrap();
    assert_eq!(page.items.iter().filter(|r| r.key == "meta").count(), 1);
    c.release("meta", &l.lease_id).await.unwrap();
    let page =
        b.store().scan(&leasehold::store::ScanKind::Keepalive { shard, after_ms: c.now_ms() }, None, 10).await.unwrap();
    assert_eq!(page.items.iter().filter(|r| r.key == "meta").count(), 0);
    assert_eq!(c.get("meta").await.unwrap().keepalive, None);
    let listed = c.list(100).await.unwrap();
    assert!(listed.iter().all(|s| s.key != "meta"), "released keys are not listed as held");
}

/// More keep-alive entries than one run's lease budget, most of them stale (their lease
/// expired): every live one is renewed in one run, the stale ones do not count against the
/// budget and leave the index, so the next run reads only the live ones. Prints the renewal
/// rate of a run (the per-run capacity in DESIGN.md comes from it).
async fn keepalive_sweep_renews_every_live_lease(b: Backend) {
    let c = b.coordinator(test_config());
    let ka = Keepalive { until_ms: c.now_ms() + 600_000, execution_arn: None };
    let opts = || AcquireOptions { keepalive: Some(ka.clone()), ..Default::default() };
    let (stale, live, budget) = (150, 60, 100u32);
    // "a/..." sorts before "z/..." in every shard: a sweep reading shards from the start and
    // counting stale entries spends its budget on them first.
    for i in 0..stale {
        // The shortest keep-alive lease the test config allows (3 sweep periods of 50 ms).
        c.acquire(&format!("a/stale-{i}"), "gone", ms(150), opts()).await.unwrap();
    }
    let mut lives = Vec::new();
    for i in 0..live {
        lives.push(c.acquire(&format!("z/live-{i}"), "etl", secs(60), opts()).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = c.now_ms();
    let report = c.keepalive_sweep(None, budget, Instant::now() + Duration::from_secs(60)).await;
    println!("{} sweep 1: {report:?}", b.store().name());
    for l in &lives {
        let s = c.get(&l.key).await.unwrap();
        assert!(
            s.expires_at_ms.unwrap() >= started + 60_000,
            "{} not renewed by a run whose budget ({budget}) covers every live lease: {report:?}",
            l.key
        );
        assert_eq!(s.fence, l.fence);
    }
    assert_eq!((report.renewed, report.skipped, report.cleared, report.errors), (live, stale, stale, 0), "{report:?}");
    assert!(report.complete, "{report:?}");
    // The stale entries left the index: the next run reads the live leases only.
    let t0 = Instant::now();
    let report = c.keepalive_sweep(None, budget, Instant::now() + Duration::from_secs(60)).await;
    let took = t0.elapsed();
    println!(
        "{} sweep 2: {report:?} in {took:?}: {:.0} renewals/s",
        b.store().name(),
        report.renewed as f64 / took.as_secs_f64()
    );
    assert_eq!((report.scanned, report.renewed, report.skipped), (live, live, 0), "{report:?}");
    // A run given a third of that time stops by its deadline (plus the scheduling delay
    // measured meanwhile), not after the page it is in, and says it is incomplete.
    let lag = Lag::start();
    let deadline = Instant::now() + took / 3;
    let report = c.keepalive_sweep(None, budget, deadline).await;
    let over = Instant::now().saturating_duration_since(deadline);
    assert!(over <= lag.max() + Duration::from_millis(1), "returned {over:?} after its deadline: {report:?}");
    assert!(!report.complete && report.renewed < live, "{report:?}");
    // Stale entries of the first run are untouched otherwise (free, same fence).
    let s = c.get("a/stale-0").await.unwrap();
    assert!(!s.held && s.keepalive.is_none(), "{s:?}");
}

async fn two_handles_on_one_store(b: Backend) {
    // Two coordinators over separate handles (two processes for the embedded store).
    let c1 = Coordinator::new(b.store(), test_config());
    let c2 = Coordinator::new(b.reopen(), test_config());
    let l = c1.acquire("shared", "p1", secs(30), AcquireOptions::default()).await.unwrap();
    assert!(matches!(
        c2.acquire("shared", "p2", secs(30), AcquireOptions::default()).await,
        Err(Error::LeaseHeld { .. })
    ));
    c1.release("shared", &l.lease_id).await.unwrap();
    let l2 = c2.acquire("shared", "p2", secs(30), AcquireOptions::default()).await.unwrap();
    assert!(l2.fence > l.fence, "{} after {}", l2.fence, l.fence);
    let listed = c1.list(100).await.unwrap();
    assert_eq!(listed.iter().map(|s| s.key.as_str()).collect::<Vec<_>>(), vec!["shared"]);
}

#[test]
fn lease_id_never_formats() {
    let id = LeaseId::generate();
    let secret = id.expose().to_string();
    assert_eq!(secret.len(), 32);
    assert!(secret.bytes().all(|b| b.is_ascii_hexdigit()));
    assert_ne!(LeaseId::generate(), id);
    assert!(!format!("{id:?}").contains(&secret));
    let r = leasehold::Record {
        key: "k".into(),
        fence: 1,
        holder: "h".into(),
        lease_id: id,
        acquired_at_ms: 0,
        expires_at_ms: Some(1),
        duration_ms: Some(1),
        min_hold_until_ms: 0,
        released_at_ms: None,
        metadata: None,
        keepalive: None,
        ttl: None,
        poll_ms: None,
        renewed_at_ms: None,
    };
    assert!(!format!("{r:?}").contains(&secret));
    assert!(!format!("{:?}", r.lease(Instant::now(), 0, 0)).contains(&secret));
}

/// Expressions name attributes as they are, except `attr::RESERVED`, which go through aliases.
/// DynamoDB Local knows the reserved words: every attribute it refuses in an expression must be
/// on that list, and nothing on the list may be accepted (an alias that costs for nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserved_attribute_names_are_aliased() {
    use leasehold::store::dynamo::attr;
    let local = tokio::task::spawn_blocking(leasehold_tests::dynamo_local).await.unwrap();
    let store = local.store().await;
    let mut refused = Vec::new();
    for a in attr::ALL {
        let r = store
            .client()
            .get_item()
            .table_name(store.table())
            .key(attr::KEY, aws_sdk_dynamodb::types::AttributeValue::S("probe".into()))
            .projection_expression(*a)
            .send()
            .await;
        match r {
            Ok(_) => {}
            Err(e) => {
                let msg = e.into_service_error().meta().message().unwrap_or_default().to_string();
                assert!(msg.contains("reserved keyword"), "{a}: unexpected error {msg}");
                refused.push(*a);
            }
        }
    }
    assert_eq!(refused, attr::RESERVED, "attributes DynamoDB Local refuses in expressions");
}
