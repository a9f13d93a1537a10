//! The failures leases exist for, one defect each (DESIGN.md, "Failure cases"): a delayed
//! duplicate of a heartbeat, a lease_id used twice, a stale release after a force-release, a
//! grant that arrives too late, an answer lost until the deadline, wrong clocks, and fences
//! and TTLs near their bounds. Each case runs on both stores unless it is about DynamoDB.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold::api::{self, Operation};
use leasehold::store::{Condition, LeaseCondition, LeaseMutation, Mutation, NewLease, Store, Write};
use leasehold::{AcquireOptions, Config, Coordinator, Error, LeaseId, NotHolderReason};
use leasehold_tests::{both_backends, test_config, widest_first_margin, Backend, Counting, Fault, Faulty};
use serde_json::json;

both_backends!(
    delayed_heartbeat_never_shortens_the_lease,
    a_heartbeat_asking_for_less_leaves_the_lease_as_it_is,
    a_lease_id_is_single_use,
    stale_release_after_force_release_changes_nothing,
    late_grant_is_released_and_taken_anew_without_spinning,
    a_late_grant_still_live_is_renewed_in_place,
    a_late_slot_still_live_is_renewed_in_place,
    remote_callers_are_told_safe_for_ms,
    fence_beyond_2_53_is_refused_before_writing,
    an_implausibly_far_fence_is_never_copied,
    ttl_never_precedes_the_fence_plus_grace,
    a_wrong_clock_is_refused_and_takes_nothing,
);

fn secs(s: u64) -> Option<Duration> {
    Some(Duration::from_secs(s))
}

fn with_id(id: &LeaseId) -> AcquireOptions {
    AcquireOptions { lease_id: Some(id.clone()), ..Default::default() }
}

/// A heartbeat try delayed in the network lands after its retry: it must not move the expiry
/// back behind what the holder was told (the holder's safe time came from the retry).
async fn delayed_heartbeat_never_shortens_the_lease(b: Backend) {
    let faulty = Faulty::new(b.store());
    let mut cfg = test_config();
    cfg.retry_base = Duration::from_millis(60);
    let c = Coordinator::new(faulty.clone(), cfg);
    let l = c.acquire("hb", "h", secs(5), AcquireOptions::default()).await.unwrap();
    faulty.inject(&[Fault::DelayedDuplicate(Duration::from_millis(400))]);
    let h = c.heartbeat("hb", &l.lease_id, None).await.unwrap();
    assert_eq!(faulty.injected.load(Ordering::SeqCst), 1);
    let told = h.expires_at_ms.unwrap();
    // Let the stuck first try land, then look.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let now = c.get("hb").await.unwrap();
    assert!(
        now.expires_at_ms.unwrap() >= told,
        "the delayed try moved the expiry back from {told} to {:?}",
        now.expires_at_ms
    );
    // The same with an explicit duration.
    faulty.inject(&[Fault::DelayedDuplicate(Duration::from_millis(400))]);
    let h = c.heartbeat("hb", &l.lease_id, secs(5)).await.unwrap();
    let told = h.expires_at_ms.unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(c.get("hb").await.unwrap().expires_at_ms.unwrap() >= told);
}

/// The expiry never moves backwards: a heartbeat asking for less time than is left answers
/// with the lease as it is.
async fn a_heartbeat_asking_for_less_leaves_the_lease_as_it_is(b: Backend) {
    let c = b.coordinator(test_config());
    let l = c.acquire("short", "h", secs(30), AcquireOptions::default()).await.unwrap();
    let h = c.heartbeat("short", &l.lease_id, secs(2)).await.unwrap();
    assert_eq!(h.expires_at_ms, l.expires_at_ms);
    assert_eq!(c.get("short").await.unwrap().expires_at_ms, l.expires_at_ms);
}

/// A lease_id is single-use: once its lease was released or expired, an acquire with it (a
/// workflow's retry still in flight) gets NotHolder and takes nothing.
async fn a_lease_id_is_single_use(b: Backend) {
    let c = b.coordinator(test_config());
    let id = LeaseId::generate();
    let l = c.acquire("once", "h", secs(30), with_id(&id)).await.unwrap();
    c.release("once", &id).await.unwrap();
    let r = c.acquire("once", "h", secs(30), with_id(&id)).await;
    assert!(matches!(r, Err(Error::NotHolder { reason: NotHolderReason::Released, .. })), "{r:?}");
    let s = c.get("once").await.unwrap();
    assert!(!s.held && s.fence == l.fence, "nothing was taken: {s:?}");
    // Expired, not released: the same.
    // 2 s: a loaded machine can answer a grant later than a shorter lease's safe time.
    let id = LeaseId::generate();
    let l = c.acquire("once", "h", secs(2), with_id(&id)).await.unwrap();
    let left = l.expires_at_ms.unwrap().saturating_sub(c.now_ms());
    tokio::time::sleep(Duration::from_millis(left + 100)).await;
    let r = c.acquire("once", "h", secs(30), AcquireOptions { wait: secs(1), ..with_id(&id) }).await;
    assert!(matches!(r, Err(Error::NotHolder { reason: NotHolderReason::Expired, .. })), "{r:?}");
    assert!(!c.get("once").await.unwrap().held);
    // A fresh lease_id takes the key.
    c.acquire("once", "h", secs(30), AcquireOptions::default()).await.unwrap();
}

/// An operator force-released a lease with a min-hold; its holder's late release must not
/// re-block the key (nor rewrite when it was released): it answers as already released.
async fn stale_release_after_force_release_changes_nothing(b: Backend) {
    let c = b.coordinator(test_config());
    let opts = AcquireOptions { min_hold: secs(20), ..AcquireOptions::default() };
    let l = c.acquire("fr", "h", secs(30), opts).await.unwrap();
    let forced = c.force_release("fr").await.unwrap();
    let r = c.release("fr", &l.lease_id).await.unwrap();
    assert!(r.already_released, "{r:?}");
    let s = c.get("fr").await.unwrap();
    assert!(!s.held, "the stale release re-blocked the key: {s:?}");
    assert_eq!((s.released_at_ms, s.fence), (forced.released_at_ms, forced.fence));
    // A retried release of a normally released lease answers the same way.
    let l = c.acquire("fr", "h", secs(30), AcquireOptions::default()).await.unwrap();
    let first = c.release("fr", &l.lease_id).await.unwrap();
    let again = c.release("fr", &l.lease_id).await.unwrap();
    assert!(!first.already_released && again.already_released);
    assert_eq!((again.fence, again.released_at_ms), (first.fence, first.released_at_ms));
}

/// A grant whose answer arrives after the lease's safe time is useless: it is released and
/// the key taken anew (a new lease_id, a higher fence), with a handful of requests, not a
/// tight loop until the stale grant expires. With the caller's own lease_id it is an error,
/// and the key is left free.
async fn late_grant_is_released_and_taken_anew_without_spinning(b: Backend) {
    let counting = Counting::new(b.store());
    let faulty = Faulty::new(counting.clone());
    // A budget for the late answer, the release of its grant and a fresh grant on a loaded
    // machine (the test's default 3 s is less than those can take there).
    let c = Coordinator::new(faulty.clone(), Config { retry_budget: Duration::from_secs(10), ..test_config() });
    // The first answer comes after the lease's safe time (1.5 s lease, 1.6 s answer); the
    // retry has the whole safe time of a 1.5 s lease to be answered in, room on a loaded machine.
    let d = Some(Duration::from_millis(1500));
    faulty.inject(&[Fault::SlowAnswer(Duration::from_millis(1600))]);
    let l = c.acquire("late", "h", d, AcquireOptions::default()).await.unwrap();
    assert!(l.safe_until.unwrap() > Instant::now());
    let writes = counting.updates.load(Ordering::SeqCst);
    assert!(writes <= 4, "{writes} writes: the late grant was retried in a loop");
    assert!(c.get("late").await.unwrap().held);
    c.release("late", &l.lease_id).await.unwrap();

    let id = LeaseId::generate();
    faulty.inject(&[Fault::SlowAnswer(Duration::from_millis(1600))]);
    let r = c.acquire("late", "h", d, with_id(&id)).await;
    assert!(matches!(r, Err(Error::StoreUnavailable(_))), "{r:?}");
    assert!(!c.get("late").await.unwrap().held, "the late grant was released");
}

/// A grant answered after its safe time but before its expiry (a safe margin nearly as long as
/// the lease, and a slow answer: a loaded machine) is renewed by its own lease_id, its safe time
/// counted from the renewal: the caller's own lease_id is not spent (a shipped workflow retries
/// its acquire with it: given back, the key could never be taken under it again), the fence is
/// the grant's, and nothing is released.
async fn a_late_grant_still_live_is_renewed_in_place(b: Backend) {
    let counting = Counting::new(b.store());
    let faulty = Faulty::new(counting.clone());
    // A 2 s margin on a 5 s lease: 3 s of safe time, and the answer comes at 3.5 s, 1.5 s
    // before the expiry: room for the renewal on a loaded machine.
    let cfg = Config { skew_margin: Duration::from_secs(2), retry_budget: Duration::from_secs(10), ..test_config() };
    let c = Coordinator::new(faulty.clone(), cfg);
    let id = LeaseId::generate();
    let before = counting.updates.load(Ordering::SeqCst);
    faulty.inject(&[Fault::SlowAnswer(Duration::from_millis(3500))]);
    let t = Instant::now();
    let l = c.acquire("late-live", "h", secs(5), with_id(&id)).await.expect("renewed, not given back");
    assert!(t.elapsed() >= Duration::from_millis(3500));
    assert_eq!(l.lease_id, id, "the caller's own lease_id");
    assert!(l.safe_until.unwrap() > Instant::now());
    // Its expiry is the renewal's: about 5 s after the answer, not the grant's 1.5 s.
    assert!(l.expires_at_ms.unwrap() >= c.now_ms() + 4000, "{l:?}");
    assert_eq!(counting.updates.load(Ordering::SeqCst) - before, 2, "the grant and its renewal, no release");
    let s = c.get("late-live").await.unwrap();
    assert!(s.held && s.fence == l.fence && s.released_at_ms.is_none(), "{s:?}");
    c.release("late-live", &l.lease_id).await.unwrap();
}

/// The same for a semaphore's slot: taken under the caller's own lease_id and answered after
/// its safe time, it is renewed by that lease_id, not given back (a ConcurrencyLimited
/// execution retries its take with its own lease_id: given back, it could never take a slot
/// under it again).
async fn a_late_slot_still_live_is_renewed_in_place(b: Backend) {
    let counting = Counting::new(b.store());
    let faulty = Faulty::new(counting.clone());
    let cfg = Config { skew_margin: Duration::from_secs(2), retry_budget: Duration::from_secs(10), ..test_config() };
    let c = Coordinator::new(faulty.clone(), cfg);
    let slots = AcquireOptions { slots: Some(3), ..Default::default() };
    // Another holder made the semaphore: the next write is this take of a slot.
    let other = c.acquire("late-slot", "other", secs(30), slots.clone()).await.unwrap();
    let id = LeaseId::generate();
    let before = counting.updates.load(Ordering::SeqCst);
    faulty.inject(&[Fault::SlowAnswer(Duration::from_millis(3500))]);
    let t = Instant::now();
    let opts = AcquireOptions { lease_id: Some(id.clone()), ..slots };
    let l = c.acquire("late-slot", "h", secs(5), opts).await.expect("renewed, not given back");
    assert!(t.elapsed() >= Duration::from_millis(3500));
    assert_eq!(l.lease_id, id, "the caller's own lease_id");
    assert!(l.safe_until.unwrap() > Instant::now());
    assert!(l.expires_at_ms.unwrap() >= c.now_ms() + 4000, "the renewal's expiry: {l:?}");
    assert_eq!(counting.updates.load(Ordering::SeqCst) - before, 2, "the take and its renewal, no release");
    let s = c.get("late-slot").await.unwrap();
    let mine = s.holders.iter().find(|h| h.fence == l.fence).expect("the slot is still taken");
    assert!(mine.holder == "h" && Some(mine.expires_at_ms) == l.expires_at_ms, "{s:?}");
    assert_eq!(s.slots_taken, Some(2), "{s:?}");
    c.release("late-slot", &l.lease_id).await.unwrap();
    c.release("late-slot", &other.lease_id).await.unwrap();
}

/// Remote callers cannot read the coordinator's monotonic clock: acquire and heartbeat answers
/// carry `safe_for_ms`, counted from when the request arrived, at most the duration less the
/// skew margin.
async fn remote_callers_are_told_safe_for_ms(b: Backend) {
    let c = b.coordinator(test_config());
    let margin = c.config().skew_margin.as_millis() as u64;
    let t = Instant::now();
    let v = api::run(&c, Operation::Acquire, None, json!({"key": "remote", "holder": "h", "duration_ms": 5000}), None)
        .await
        .unwrap();
    let spent = t.elapsed().as_millis() as u64;
    let safe = v["safe_for_ms"].as_u64().expect("safe_for_ms");
    // Counted from the arrival: reads made before the write (the clock check's) come on top,
    // never more than the time the request took. The safe margin is the skew margin at least,
    // more while the clock evidence (all of it from this request) is uncertain.
    let widest = widest_first_margin(&c, t.elapsed()).as_millis() as u64;
    assert!(safe <= 5000 - margin + spent && safe + spent + 5 >= 5000 - widest, "{safe} (spent {spent} ms)");
    let id = v["lease_id"].as_str().unwrap();
    let v = api::run(&c, Operation::Heartbeat, None, json!({"key": "remote", "lease_id": id}), None).await.unwrap();
    assert!(v["safe_for_ms"].as_u64().is_some_and(|s| s <= 5000 - margin), "{v}");
    let fc = json!({"key": "remote-fc", "holder": "h", "fail_closed": true, "lease_id": LeaseId::generate().expose()});
    let v = api::run(&c, Operation::Acquire, None, fc, None).await.unwrap();
    assert!(v.get("safe_for_ms").is_none(), "a fail-closed lease has no safe time: {v}");
}

/// A coordinator whose clock reads far in the future would issue a fence above 2^53; it is
/// refused before anything is written, so the key stays usable.
async fn fence_beyond_2_53_is_refused_before_writing(b: Backend) {
    let mut cfg = test_config();
    cfg.clock_offset_ms = 300 * 365 * 24 * 3600 * 1000;
    let wrong = b.coordinator(cfg);
    let honest = b.coordinator(test_config());
    let l = honest.acquire("far", "h", secs(5), AcquireOptions::default()).await.unwrap();
    honest.release("far", &l.lease_id).await.unwrap();
    let r = wrong.acquire("far", "x", secs(1), AcquireOptions::default()).await;
    assert!(matches!(r, Err(Error::StoreUnavailable(_) | Error::ClockSkew(_))), "{r:?}");
    let s = honest.get("far").await.unwrap();
    assert_eq!((s.fence, s.holder.as_str()), (l.fence, "h"), "nothing was written");
    honest.acquire("far", "h", secs(5), AcquireOptions::default()).await.unwrap();
}

/// An item whose fence is far ahead of the clock (left by a wrong clock) is not copied into
/// new fences: the acquire is refused with ClockSkew and writes nothing.
async fn an_implausibly_far_fence_is_never_copied(b: Backend) {
    let store = b.store();
    let c = b.coordinator(test_config());
    let now = c.now_ms();
    let ahead = c.now_us() + 2 * 3600 * 1_000_000;
    put(&store, "ahead", ahead, now).await;
    let r = c.acquire("ahead", "h", secs(5), AcquireOptions::default()).await;
    assert!(matches!(r, Err(Error::ClockSkew(_))), "{r:?}");
    assert_eq!(c.get("ahead").await.unwrap().fence, ahead);
    // Ahead within the plausible lead (a clock a little fast, then a collision): copied.
    // (Judged against the fence written, not the clock after a possibly slow answer.)
    let near = c.now_us() + 5_000_000;
    put(&store, "ahead", near, now).await;
    let l = c.acquire("ahead", "h", secs(5), AcquireOptions::default()).await.unwrap();
    assert!(l.fence > near, "{} after {near}", l.fence);
}

/// Writes an expired lease item with `fence` directly (what another coordinator left).
async fn put(store: &Arc<dyn Store>, key: &str, fence: u64, now: u64) {
    let n = NewLease::new("gone", LeaseId::generate(), now - 5000, Some(1000), fence);
    let w = store.update(key, &Condition::Exists, &Mutation::Lease(LeaseMutation::Acquire(n.clone()))).await.unwrap();
    if let Write::Rejected(_) = w {
        let free =
            Condition::Lease(LeaseCondition::Free { now_ms: now, fence: u64::MAX, lease_id: LeaseId::generate() });
        assert!(matches!(
            store.update(key, &free, &Mutation::Lease(LeaseMutation::Acquire(n))).await.unwrap(),
            Write::Applied(_)
        ));
    }
}

/// DynamoDB's TTL deletes by `ttl` alone: an item must not become deletable before its
/// fence's own time plus the grace, or a later acquire (fence = clock in µs) could reissue a
/// lower fence.
async fn ttl_never_precedes_the_fence_plus_grace(b: Backend) {
    let store = b.store();
    let c = b.coordinator(test_config());
    let grace = c.config().ttl_grace.as_secs();
    put(&store, "ttl-f", c.now_us() + 30_000_000, c.now_ms()).await;
    let l = c.acquire("ttl-f", "h", secs(1), AcquireOptions::default()).await.unwrap();
    let fence_s = l.fence.div_ceil(1_000_000);
    let check = |what: &str, ttl: Option<u64>| {
        let ttl = ttl.expect("ttl");
        assert!(ttl >= fence_s + grace, "{what}: ttl {ttl} before fence time {fence_s} + grace {grace}");
    };
    check("acquire", store.get("ttl-f").await.unwrap().unwrap().ttl);
    c.heartbeat("ttl-f", &l.lease_id, None).await.unwrap();
    check("heartbeat", store.get("ttl-f").await.unwrap().unwrap().ttl);
    c.release("ttl-f", &l.lease_id).await.unwrap();
    check("release", store.get("ttl-f").await.unwrap().unwrap().ttl);
}

/// A coordinator whose clock is wrong by more than the skew margin (checked against the
/// store's clock: DynamoDB's `Date`, the embedded store's machine clock) is refused before it
/// can take a live lease or write an expiry; the honest holder keeps its lease and the key
/// stays usable.
async fn a_wrong_clock_is_refused_and_takes_nothing(b: Backend) {
    let honest = b.coordinator(test_config());
    for offset_ms in [5_000i64, -5_000, 2 * 3600 * 1000, 300 * 365 * 24 * 3600 * 1000] {
        let key = format!("clock{offset_ms}");
        // 30 s: held all through the wrong coordinator's attempts, however slow (released below).
        let l = honest.acquire(&key, "honest", secs(30), AcquireOptions::default()).await.unwrap();
        let cfg = Config { clock_offset_ms: offset_ms, ..test_config() };
        // A new process with its own client: it has not talked to the store yet.
        let wrong = Coordinator::new(Backend::dynamo_store_like(&b).await, cfg);
        let r = wrong.acquire(&key, "wrong", secs(2), AcquireOptions { wait: secs(1), ..Default::default() }).await;
        assert!(matches!(r, Err(Error::ClockSkew(_))), "offset {offset_ms} ms: {r:?}");
        let r = wrong.heartbeat(&key, &l.lease_id, None).await;
        assert!(matches!(r, Err(Error::ClockSkew(_))), "offset {offset_ms} ms: {r:?}");
        let s = honest.get(&key).await.unwrap();
        assert!(s.held && s.holder == "honest" && s.fence == l.fence, "{s:?}");
        honest.release(&key, &l.lease_id).await.unwrap();
        honest.acquire(&key, "honest", secs(5), AcquireOptions::default()).await.unwrap();
    }
    // A slot of a semaphore: refused alike, at once, and the slots stay as they were.
    let sem = AcquireOptions { slots: Some(3), ..Default::default() };
    let l = honest.acquire("clock-sem", "honest", secs(30), sem.clone()).await.unwrap();
    let cfg = Config { clock_offset_ms: 5_000, ..test_config() };
    let wrong = Coordinator::new(Backend::dynamo_store_like(&b).await, cfg);
    let r = wrong.acquire("clock-sem", "wrong", secs(2), AcquireOptions { wait: secs(1), ..sem }).await;
    assert!(matches!(r, Err(Error::ClockSkew(_))), "a slot: {r:?}");
    assert_eq!(honest.get("clock-sem").await.unwrap().slots_taken, Some(1));
    honest.release("clock-sem", &l.lease_id).await.unwrap();
    // Within the margin: served.
    let cfg = Config { clock_offset_ms: 20, ..test_config() };
    let near = Coordinator::new(Backend::dynamo_store_like(&b).await, cfg);
    near.acquire("clock-near", "near", secs(1), AcquireOptions::default()).await.unwrap();
}
