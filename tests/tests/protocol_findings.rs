//! Protocol defects the deterministic simulation found (FINDINGS.md), each
//! replayed here against both stores: the embedded one and DynamoDB Local.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use leasehold::queue::{queue_shard, Deliver, DeliveryError, Enqueued, SEPARATOR};
use leasehold::store::{Condition, Mutation, QueueCondition, QueueMutation, Store, Write};
use leasehold::{AcquireOptions, Clock, Config, Coordinator, Error, Lease, LeaseId, Record, SystemClock};
use leasehold_tests::{both_backends, test_config, wrap, Backend, Fault, Faulty, Intercept, Wrapped};

both_backends!(
    a_stale_fail_closed_acquire_never_takes_a_key_released_after_it_was_sent,
    a_stale_fail_closed_acquire_never_takes_a_key_a_queue_write_freed_after_it_was_sent,
    a_stale_plain_acquire_never_takes_a_key_a_queue_write_freed_after_it_was_sent,
    a_retried_queued_acquire_keeps_its_slot_behind_a_later_waiter,
    a_delayed_waiter_write_of_an_earlier_try_keeps_the_retry_s_token,
    a_retried_invocation_takes_over_the_grant_made_to_its_dead_token,
    a_take_over_whose_mark_answer_is_lost_is_recognised_by_its_retry,
    a_queue_grant_after_a_slow_read_is_told_no_safe_time_past_its_end,
    a_new_queue_starts_above_the_numbers_of_the_queue_before,
    dropping_a_late_grant_does_not_wait_for_a_queue_delivery,
    an_acquire_right_after_a_release_by_a_clock_ahead_is_granted,
    an_unanswered_renewal_leaves_no_ttl_on_a_work_item,
    a_renewal_of_a_work_item_extends_it_without_a_ttl,
    a_slot_rewritten_during_its_hand_over_is_delivered_to_the_new_token,
    a_slot_rewritten_after_its_grant_was_judged_gone_is_told_not_holder,
    a_retry_that_finds_its_rewritten_slot_delivered_keeps_the_lease,
);

fn secs(s: u64) -> Option<Duration> {
    Some(Duration::from_secs(s))
}

/// Seed 3 of the simulation. A fail-closed acquire (the caller's own lease_id) is held in the
/// network past its attempt timeout; its retry finds the key held by another lease, and the
/// caller's release of its lease_id finds that other lease (`NotHolder`): the caller believes
/// its lease_id holds nothing. That lease is then released, and the stale first attempt lands.
/// It must be refused: otherwise the key is held, with no expiry, by a lease nobody knows of.
async fn a_stale_fail_closed_acquire_never_takes_a_key_released_after_it_was_sent(b: Backend) {
    let faulty = Faulty::new(b.store());
    let c = Coordinator::new(faulty.clone(), test_config());
    let other = b.coordinator(test_config());
    let held = other.acquire("fc-stale", "other", secs(60), AcquireOptions::default()).await.unwrap();
    // Make sure the stale attempt's clock is past the grant it will find (as in the run).
    tokio::time::sleep(Duration::from_millis(5)).await;
    let id = LeaseId::generate();
    // The first attempt is held in the network for 3 s, to land after everything below.
    faulty.inject(&[Fault::DelayedDuplicate(Duration::from_secs(3))]);
    let sent = Instant::now();
    let r = c.acquire("fc-stale", "h", None, AcquireOptions { lease_id: Some(id.clone()), ..Default::default() }).await;
    assert!(r.is_err(), "the key is held: {r:?}");
    assert_eq!(faulty.injected.load(Ordering::SeqCst), 1);
    // The caller gives up: its release finds another lease.
    let rel = c.release("fc-stale", &id).await;
    assert!(matches!(rel, Err(Error::NotHolder { .. })), "{rel:?}");
    other.release("fc-stale", &held.lease_id).await.unwrap();
    assert!(sent.elapsed() < Duration::from_secs(3), "the stale attempt must land after the release");
    // The stale attempt lands (3 s after it was sent), and is refused.
    tokio::time::sleep(Duration::from_secs(3).saturating_sub(sent.elapsed()) + Duration::from_millis(700)).await;
    let s = other.get("fc-stale").await.unwrap();
    assert!(!s.held, "the key is held by a lease nobody was told of: {s:?}");
    let next = other.acquire("fc-stale", "next", secs(5), AcquireOptions::default()).await.unwrap();
    assert!(next.fence > held.fence);
}

/// Step Functions that takes every delivery.
struct Delivers;

#[async_trait]
impl Deliver for Delivers {
    async fn success(&self, _: &str, _: &Lease) -> Result<(), DeliveryError> {
        Ok(())
    }
    async fn failure(&self, _: &str, _: &str, _: &str) -> Result<(), DeliveryError> {
        Ok(())
    }
}

/// `stale_acquire_after_queue_freed` of the simulation (seed 23 when diagnosed). A queue grant
/// is released by its holder with its undelivered mark still on (the `Delivered` write's
/// answer was lost): plain acquires cannot take the key until the queue removes the mark. A
/// fail-closed acquire is held in the network; its retry finds the mark and its caller's
/// release finds nothing, so the caller believes its lease_id holds nothing. The queue then
/// removes the mark (a write that is no release), and the stale attempt lands: it must be
/// refused, or the key is held, with no expiry, by a lease nobody knows of.
async fn a_stale_fail_closed_acquire_never_takes_a_key_a_queue_write_freed_after_it_was_sent(b: Backend) {
    let k = "fc-queue-freed";
    let faulty = Faulty::new(b.store());
    let c = Coordinator::new(faulty.clone(), test_config());
    let other = b.coordinator(test_config());
    let server = b.coordinator(test_config()).with_deliver(Arc::new(Delivers));
    let held = other.acquire(k, "other", secs(60), AcquireOptions::default()).await.unwrap();
    let mark = Mutation::Queue(QueueMutation::MarkUndelivered { token: "task".into(), shard: queue_shard(k) });
    let w = b.store().update(k, &Condition::FenceIs(held.fence), &mark).await.unwrap();
    assert!(matches!(w, leasehold::store::Write::Applied(_)), "{w:?}");
    // Released by a coordinator that serves no queue: the mark stays.
    other.release(k, &held.lease_id).await.unwrap();
    assert!(b.store().get(k).await.unwrap().unwrap().queue.pending_token.is_some());
    // The stale attempt's clock is past the release (a release before it is not compared).
    tokio::time::sleep(Duration::from_millis(5)).await;
    let id = LeaseId::generate();
    // The first attempt is held in the network for 3 s, to land after everything below.
    faulty.inject(&[Fault::DelayedDuplicate(Duration::from_secs(3))]);
    let sent = Instant::now();
    let r = c.acquire(k, "h", None, AcquireOptions { lease_id: Some(id.clone()), ..Default::default() }).await;
    assert!(r.is_err(), "the key has an undelivered grant: {r:?}");
    assert_eq!(faulty.injected.load(Ordering::SeqCst), 1);
    let rel = c.release(k, &id).await;
    assert!(matches!(rel, Err(Error::NotHolder { .. })), "{rel:?}");
    // The queue ends the released grant's mark: the key is free to plain acquires from now.
    tokio::time::sleep(Duration::from_millis(5)).await;
    server.serve_queue(k).await.unwrap();
    let item = b.store().get(k).await.unwrap().unwrap();
    assert!(item.queue.pending_token.is_none(), "{item:?}");
    assert!(sent.elapsed() < Duration::from_secs(3), "the stale attempt must land after the mark went");
    // The stale attempt lands (3 s after it was sent), and is refused.
    tokio::time::sleep(Duration::from_secs(3).saturating_sub(sent.elapsed()) + Duration::from_millis(700)).await;
    let s = other.get(k).await.unwrap();
    assert!(!s.held, "the key is held by a lease nobody was told of: {s:?}");
    let next = other.acquire(k, "next", secs(5), AcquireOptions::default()).await.unwrap();
    assert!(next.fence > held.fence);
}

/// Seed 359 of `--seeds 1000`. As above, with a plain acquire held in the network as well, sent
/// just before the fail-closed one: it lands first, after the queue write freed the key. Its
/// item replaces the whole item, so without `Free`'s `freed_at_ms` clause it took the key and
/// erased the stamp, its short lease expired at once, and the stale fail-closed attempt then
/// took the key: a lease nobody was told of. Both must be refused.
async fn a_stale_plain_acquire_never_takes_a_key_a_queue_write_freed_after_it_was_sent(b: Backend) {
    let k = "plain-queue-freed";
    let faulty = Faulty::new(b.store());
    let c = Coordinator::new(faulty.clone(), test_config());
    let other = b.coordinator(test_config());
    let server = b.coordinator(test_config()).with_deliver(Arc::new(Delivers));
    let held = other.acquire(k, "other", secs(60), AcquireOptions::default()).await.unwrap();
    let mark = Mutation::Queue(QueueMutation::MarkUndelivered { token: "task".into(), shard: queue_shard(k) });
    let w = b.store().update(k, &Condition::FenceIs(held.fence), &mark).await.unwrap();
    assert!(matches!(w, leasehold::store::Write::Applied(_)), "{w:?}");
    other.release(k, &held.lease_id).await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    // The plain attempt (a 100 ms lease) lands 3 s after it was sent, the fail-closed one 3.5 s
    // after it was sent, 150 ms later: past the plain lease's end on its own clock.
    faulty.inject(&[Fault::DelayedDuplicate(Duration::from_secs(3))]);
    let sent = Instant::now();
    let p = c.acquire(k, "p", Some(Duration::from_millis(100)), AcquireOptions::default()).await;
    assert!(p.is_err(), "the key has an undelivered grant: {p:?}");
    tokio::time::sleep(Duration::from_millis(150).saturating_sub(sent.elapsed())).await;
    let id = LeaseId::generate();
    faulty.inject(&[Fault::DelayedDuplicate(Duration::from_millis(3500))]);
    let f = c.acquire(k, "f", None, AcquireOptions { lease_id: Some(id.clone()), ..Default::default() }).await;
    assert!(f.is_err(), "the key has an undelivered grant: {f:?}");
    assert_eq!(faulty.injected.load(Ordering::SeqCst), 2);
    let rel = c.release(k, &id).await;
    assert!(matches!(rel, Err(Error::NotHolder { .. })), "{rel:?}");
    // The queue ends the released grant's mark, stamping `freed_at_ms`.
    tokio::time::sleep(Duration::from_millis(5)).await;
    server.serve_queue(k).await.unwrap();
    assert!(b.store().get(k).await.unwrap().unwrap().queue.freed_at_ms.is_some());
    assert!(sent.elapsed() < Duration::from_secs(3), "both stale attempts must land after the mark went");
    // Both land, and are refused.
    tokio::time::sleep(Duration::from_millis(3650 + 700).saturating_sub(sent.elapsed())).await;
    let s = other.get(k).await.unwrap();
    assert!(!s.held, "the key is held by a lease nobody was told of: {s:?}");
    let r = b.store().get(k).await.unwrap().unwrap();
    assert_eq!(r.lease_id, held.lease_id, "neither stale attempt landed: {r:?}");
    let next = other.acquire(k, "next", secs(5), AcquireOptions::default()).await.unwrap();
    assert!(next.fence > held.fence);
}

/// Step Functions that takes every delivery and records it (token, lease).
#[derive(Default)]
struct Records(std::sync::Mutex<Vec<(String, Lease)>>);

#[async_trait]
impl Deliver for Records {
    async fn success(&self, token: &str, lease: &Lease) -> Result<(), DeliveryError> {
        self.0.lock().unwrap().push((token.to_string(), lease.clone()));
        Ok(())
    }
    async fn failure(&self, _: &str, _: &str, _: &str) -> Result<(), DeliveryError> {
        Ok(())
    }
}

/// `queued_lease_id_regranted` of the simulation (seeds 75 and 180 when diagnosed). A queued
/// acquire's waiter item lands with its answer lost, so its invocation fails; another waiter
/// joins behind it; Step Functions retries the invocation (same lease_id, a new task token).
/// The retry must keep its first slot (with the new token) rather than take a second one:
/// otherwise both slots are granted in turn, and the lease_id is granted twice.
async fn a_retried_queued_acquire_keeps_its_slot_behind_a_later_waiter(b: Backend) {
    let k = "queued-retry";
    let rec = Arc::new(Records::default());
    let c = b.coordinator(test_config()).with_deliver(rec.clone());
    let d = Duration::from_secs(30);
    let held = c.acquire(k, "holder", Some(d), AcquireOptions::default()).await.unwrap();
    let id = LeaseId::generate();
    let mine = AcquireOptions { lease_id: Some(id.clone()), ..Default::default() };
    // The first invocation: its slot and waiter item land (its answer is lost).
    let first = c.acquire_or_enqueue(k, "exec", d, mine.clone(), "token-1", None).await.unwrap();
    let Enqueued::Queued { seq, .. } = first else { panic!("the key is held: {first:?}") };
    let other = c.acquire_or_enqueue(k, "other", d, AcquireOptions::default(), "token-2", None).await.unwrap();
    assert!(matches!(other, Enqueued::Queued { position: 2, .. }), "{other:?}");
    // The retried invocation, with a new task token.
    let retry = c.acquire_or_enqueue(k, "exec", d, mine, "token-3", None).await.unwrap();
    assert!(matches!(retry, Enqueued::Queued { seq: s, position: 1, .. } if s == seq), "{retry:?}");
    assert_eq!(c.get(k).await.unwrap().queue_length, 2, "the retry took a second slot");
    // Serve the whole queue: each waiter granted once, the first with the retry's token.
    c.release(k, &held.lease_id).await.unwrap();
    let granted = rec.0.lock().unwrap().last().cloned().expect("the head waiter was served");
    assert_eq!((granted.0.as_str(), &granted.1.lease_id), ("token-3", &id));
    c.release(k, &id).await.unwrap();
    let next = rec.0.lock().unwrap().last().cloned().expect("the next waiter was served").1;
    c.release(k, &next.lease_id).await.unwrap();
    let st = c.get(k).await.unwrap();
    assert_eq!(st.queue_length, 0);
    let ids: Vec<LeaseId> = rec.0.lock().unwrap().iter().map(|(_, l)| l.lease_id.clone()).collect();
    assert_eq!(ids.iter().filter(|l| **l == id).count(), 1, "the lease_id was granted again: {ids:?}");
    assert_eq!(ids.len(), 2, "{ids:?}");
    // The key is free: the queue holds nobody else.
    let last = c.acquire(k, "last", Some(d), AcquireOptions::default()).await.unwrap();
    assert!(last.fence > next.fence);
}

/// A store that holds back the first write of a waiter item once armed: it answers "unavailable"
/// at once (so the writer retries) and applies the held write when `gate` opens, as a request
/// stuck in the network lands after its sender moved on.
struct HeldWaiterWrite {
    armed: std::sync::atomic::AtomicBool,
    gate: Arc<tokio::sync::Notify>,
    landed: Arc<tokio::sync::Notify>,
}

#[async_trait]
impl Intercept for HeldWaiterWrite {
    async fn update(&self, store: &Arc<dyn Store>, key: &str, c: &Condition, m: &Mutation) -> leasehold::Result<Write> {
        if matches!(m, Mutation::Queue(QueueMutation::PutWaiter(_))) && self.armed.swap(false, Ordering::SeqCst) {
            let (inner, key, c, m) = (store.clone(), key.to_string(), c.clone(), m.clone());
            let (gate, landed) = (self.gate.clone(), self.landed.clone());
            tokio::spawn(async move {
                gate.notified().await;
                let _ = inner.update(&key, &c, &m).await;
                landed.notify_one();
            });
            return Err(Error::StoreUnavailable("injected: request stuck in the network".into()));
        }
        store.update(key, c, m).await
    }
    fn passes_clock(&self) -> bool {
        true
    }
}

/// `waiter_lost` of the simulation (seed 925 of `--seeds 1000`, with clock jumps). A queued
/// acquire's first put of its waiter item is held in the network; its retry lands and the
/// invocation fails later on; Step Functions retries it with a new task token, and the retry
/// writes its slot's waiter item again with that token. Then the held put of the first try
/// lands. It must be refused (`WaiterNewer`): otherwise the slot's grant goes to the first
/// try's token, which died with its try (a delivery answers `Gone`), is revoked, and the
/// execution waits unserved.
async fn a_delayed_waiter_write_of_an_earlier_try_keeps_the_retry_s_token(b: Backend) {
    let k = "held-waiter-write";
    let held = HeldWaiterWrite { armed: Default::default(), gate: Default::default(), landed: Default::default() };
    let store = wrap(b.store(), held);
    let rec = Arc::new(Records::default());
    let c = Coordinator::new(store.clone(), test_config()).with_deliver(rec.clone());
    let d = Duration::from_secs(30);
    let held = c.acquire(k, "holder", Some(d), AcquireOptions::default()).await.unwrap();
    let id = LeaseId::generate();
    let mine = AcquireOptions { lease_id: Some(id.clone()), ..Default::default() };
    store.armed.store(true, Ordering::SeqCst);
    let first = c.acquire_or_enqueue(k, "exec", d, mine.clone(), "token-1", None).await.unwrap();
    let Enqueued::Queued { seq, .. } = first else { panic!("the key is held: {first:?}") };
    assert!(!store.armed.load(Ordering::SeqCst), "the first put was held");
    tokio::time::sleep(Duration::from_millis(20)).await;
    // The retried invocation keeps the slot, with its own token.
    let retry = c.acquire_or_enqueue(k, "exec", d, mine, "token-2", None).await.unwrap();
    assert!(matches!(retry, Enqueued::Queued { seq: s, .. } if s == seq), "{retry:?}");
    // The first try's put lands now.
    store.gate.notify_one();
    store.landed.notified().await;
    c.release(k, &held.lease_id).await.unwrap();
    let delivered = rec.0.lock().unwrap().clone();
    assert_eq!(delivered.len(), 1, "{delivered:?}");
    assert_eq!((delivered[0].0.as_str(), &delivered[0].1.lease_id), ("token-2", &id), "{delivered:?}");
    c.release(k, &id).await.unwrap();
}

/// Step Functions for a task retried after its first attempt failed: the first attempt's
/// token (`token-1`) died with it, and a delivery to it answers `Gone` (`TaskTimedOut`), but
/// only once `gate` opens (held in the network until the retry has run); any other token takes
/// its delivery.
#[derive(Default)]
struct RetriedTask {
    entered: tokio::sync::Notify,
    gate: tokio::sync::Notify,
    delivered: std::sync::Mutex<Vec<(String, Lease)>>,
}

#[async_trait]
impl Deliver for RetriedTask {
    async fn success(&self, token: &str, lease: &Lease) -> Result<(), DeliveryError> {
        if token == "token-1" {
            self.entered.notify_one();
            self.gate.notified().await;
            return Err(DeliveryError::Gone("TaskTimedOut".into()));
        }
        self.delivered.lock().unwrap().push((token.to_string(), lease.clone()));
        Ok(())
    }
    async fn failure(&self, _: &str, _: &str, _: &str) -> Result<(), DeliveryError> {
        Ok(())
    }
}

/// FINDINGS.md (a retried invocation with a fresh task token). A queued acquire
/// is queued; its invocation then fails, and Step Functions retries it with the same lease_id
/// and a new token, the first token dead. Between the two, the holder releases and the queue
/// grants the waiter's slot to the first token. The retry finds its lease_id's lease live: it
/// must not take it as a free grant (delivered to its token, the queue's delivery to the dead
/// token answers `Gone` and revokes the lease under the execution that holds it), but move the
/// grant's undelivered mark to its token and deliver it, so that the revoke is refused.
async fn a_retried_invocation_takes_over_the_grant_made_to_its_dead_token(b: Backend) {
    take_over(b, false).await;
}

/// The same, with the answer to the take-over's mark lost: its retry, refused (the mark is
/// this token's already), is recognised as the earlier try landed, within the retry budget.
async fn a_take_over_whose_mark_answer_is_lost_is_recognised_by_its_retry(b: Backend) {
    take_over(b, true).await;
}

async fn take_over(b: Backend, lose_mark_answer: bool) {
    let k = "queued-grant-retry";
    let task = Arc::new(RetriedTask::default());
    let faulty = Faulty::on(b.store(), |c| matches!(c, Condition::Queue(QueueCondition::Undelivered { .. })));
    let c = Coordinator::new(faulty.clone(), test_config()).with_deliver(task.clone());
    let d = Duration::from_secs(60);
    let held = c.acquire(k, "holder", Some(d), AcquireOptions::default()).await.unwrap();
    let id = LeaseId::generate();
    let mine = AcquireOptions { lease_id: Some(id.clone()), ..Default::default() };
    let first = c.acquire_or_enqueue(k, "exec", d, mine.clone(), "token-1", None).await.unwrap();
    assert!(matches!(first, Enqueued::Queued { position: 1, .. }), "{first:?}");
    // The holder releases: the slot is granted to token-1, whose delivery is under way.
    let releasing = {
        let (c, id) = (c.clone(), held.lease_id.clone());
        tokio::spawn(async move { c.release(k, &id).await })
    };
    task.entered.notified().await;
    // The retried invocation, with its own token, while that delivery is in flight.
    if lose_mark_answer {
        faulty.inject(&[Fault::LoseResponse]);
    }
    let retry = c.acquire_or_enqueue(k, "exec", d, mine, "token-2", None).await.unwrap();
    assert_eq!(faulty.injected.load(Ordering::SeqCst), usize::from(lose_mark_answer));
    assert!(matches!(&retry, Enqueued::Granted(l) if l.lease_id == id), "{retry:?}");
    // The delivery to the dead token answers `Gone`.
    task.gate.notify_one();
    releasing.await.unwrap().unwrap();
    let delivered = task.delivered.lock().unwrap().clone();
    assert_eq!(delivered.len(), 1, "{delivered:?}");
    assert_eq!((delivered[0].0.as_str(), &delivered[0].1.lease_id), ("token-2", &id));
    // The execution holds the lease it was delivered: not revoked, and nobody else takes it.
    let s = c.get(k).await.unwrap();
    assert!(s.held && s.holder == "exec" && s.released_at_ms.is_none(), "the grant was revoked: {s:?}");
    c.heartbeat(k, &id, Some(d)).await.expect("the execution still holds its lease");
    let other = c.acquire(k, "other", Some(d), AcquireOptions::default()).await;
    assert!(matches!(other, Err(Error::LeaseHeld { .. })), "{other:?}");
    c.release(k, &id).await.unwrap();
}

/// A store whose reads of waiter items answer 2 s late once `slow` is set.
struct SlowWaiterReads {
    slow: std::sync::atomic::AtomicBool,
}

#[async_trait]
impl Intercept for SlowWaiterReads {
    async fn get(&self, store: &Arc<dyn Store>, key: &str) -> leasehold::Result<Option<Record>> {
        if key.contains(SEPARATOR) && self.slow.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        store.get(key).await
    }
    fn passes_clock(&self) -> bool {
        true
    }
}

/// Each delivery with the instant and the wall clock (ms) it arrived at.
#[derive(Default)]
struct Timed(std::sync::Mutex<Vec<(Instant, u64, Lease)>>);

#[async_trait]
impl Deliver for Timed {
    async fn success(&self, _: &str, lease: &Lease) -> Result<(), DeliveryError> {
        let wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
        self.0.lock().unwrap().push((Instant::now(), wall, lease.clone()));
        Ok(())
    }
    async fn failure(&self, _: &str, _: &str, _: &str) -> Result<(), DeliveryError> {
        Ok(())
    }
}

/// Seed 965 of `--seeds 1000` (in one process; `two_holders`). Serving a queue reads the
/// lease item (and the clock), then the head's waiter item, then writes the grant as of the
/// clock it read first. The grant's safe time was counted from an instant taken after the
/// waiter item's read: when that read was slow (670 ms in the run), the waiter was told a safe
/// time past its lease's end by as much, and a plain acquire took the key while it believed it
/// held it. The safe time is now counted from the instant the clock was read.
async fn a_queue_grant_after_a_slow_read_is_told_no_safe_time_past_its_end(b: Backend) {
    let k = "slow-waiter-read";
    let store = wrap(b.store(), SlowWaiterReads { slow: Default::default() });
    let rec = Arc::new(Timed::default());
    let c = Coordinator::new(store.clone(), test_config()).with_deliver(rec.clone());
    // The holder's process serves no queue: its release leaves the key free for the waiter.
    let plain = Coordinator::new(store.clone(), test_config());
    let held = plain.acquire(k, "holder", secs(60), AcquireOptions::default()).await.unwrap();
    let d = Duration::from_secs(4);
    let q = c.acquire_or_enqueue(k, "waiter", d, AcquireOptions::default(), "token", None).await.unwrap();
    assert!(matches!(q, Enqueued::Queued { position: 1, .. }), "{q:?}");
    plain.release(k, &held.lease_id).await.unwrap();
    // The queue is served with a slow read of the waiter item.
    store.slow.store(true, Ordering::SeqCst);
    let served = c.serve_queue(k).await.unwrap();
    assert_eq!(served.delivered, 1, "{served:?}");
    let (at, wall, lease) = rec.0.lock().unwrap().last().cloned().expect("delivered");
    let ends = at + Duration::from_millis(lease.expires_at_ms.unwrap().saturating_sub(wall));
    let safe = lease.safe_until.expect("a lease with a duration");
    // (20 ms for the clocks' reading apart; the slow read was 2 s.)
    assert!(
        safe <= ends + Duration::from_millis(20),
        "told a safe time {} ms past the lease's end",
        safe.saturating_duration_since(ends).as_millis()
    );
}

/// `queue_seq_reused` of the simulation. A queue's numbers start at its first enqueuer's clock
/// in µs; once the queue is empty a plain acquire replaces the item (and its counters), and a
/// later queue started by a clock behind the first one's would reuse its numbers, and serve a
/// waiter item of the earlier queue left behind. A new queue must start above the last one's
/// tail: the plain acquire writes a fence above it, and a new queue starts above the fence.
async fn a_new_queue_starts_above_the_numbers_of_the_queue_before(b: Backend) {
    let k = "queue-numbers";
    let rec = Arc::new(Records::default());
    // Clocks 4 s apart, within the skew margin of this test.
    let cfg = || Config { skew_margin: Duration::from_secs(10), ..test_config() };
    let ahead = b.coordinator(Config { clock: Arc::new(Ahead(4_000_000)), ..cfg() }).with_deliver(rec.clone());
    let c = b.coordinator(cfg()).with_deliver(rec.clone());
    let d = Duration::from_secs(60);
    let held = c.acquire(k, "holder", Some(d), AcquireOptions::default()).await.unwrap();
    // The first queue, numbered by the clock ahead.
    let first = ahead.acquire_or_enqueue(k, "w1", d, AcquireOptions::default(), "t1", None).await.unwrap();
    let Enqueued::Queued { seq: s1, .. } = first else { panic!("the key is held: {first:?}") };
    c.release(k, &held.lease_id).await.unwrap();
    let w1 = rec.0.lock().unwrap().last().cloned().expect("the waiter was served").1;
    c.release(k, &w1.lease_id).await.unwrap();
    assert_eq!(c.get(k).await.unwrap().queue_length, 0);
    // A plain acquire by the clock behind replaces the item; a second queue follows.
    let plain = c.acquire(k, "plain", Some(d), AcquireOptions::default()).await.unwrap();
    assert!(plain.fence > s1, "fence {} not above the last queue's tail {s1}", plain.fence);
    let second = c.acquire_or_enqueue(k, "w2", d, AcquireOptions::default(), "t2", None).await.unwrap();
    let Enqueued::Queued { seq: s2, position: 1, .. } = second else { panic!("the key is held: {second:?}") };
    assert!(s2 > s1, "the second queue reused the first one's numbers: {s2} <= {s1}");
    c.release(k, &plain.lease_id).await.unwrap();
    let w2 = rec.0.lock().unwrap().last().cloned().expect("the second waiter was served");
    assert_eq!(w2.0, "t2");
    assert!(w2.1.fence > plain.fence);
}

/// Step Functions whose every `SendTaskSuccess` takes 3 s (its answer times out) and lands.
struct SlowDelivery;

#[async_trait]
impl Deliver for SlowDelivery {
    async fn success(&self, _: &str, _: &Lease) -> Result<(), DeliveryError> {
        // Longer than the real client's 3 s timeout, so that an acquire held by the delivery
        // ends well past the bound the test allows (on a loaded machine too).
        tokio::time::sleep(Duration::from_secs(8)).await;
        Ok(())
    }
    async fn failure(&self, _: &str, _: &str, _: &str) -> Result<(), DeliveryError> {
        Ok(())
    }
}

/// Seed 185 of the simulation's `--seeds 200` (in one process): `wait_past_deadline`. An
/// acquire on a coordinator that serves queues has its grant answered after the lease's safe
/// time, and releases that grant; a waiter queued meanwhile, the release hands it the key and
/// delivers it, and the delivery (`SendTaskSuccess`, up to its 3 s client timeout) held the
/// acquire 3 s past its deadline. The acquire must end by its deadline.
async fn dropping_a_late_grant_does_not_wait_for_a_queue_delivery(b: Backend) {
    let k = "late-grant-queue";
    let faulty = Faulty::new(b.store());
    let c = Coordinator::new(faulty.clone(), test_config()).with_deliver(Arc::new(SlowDelivery));
    let other = b.coordinator(test_config()).with_deliver(Arc::new(SlowDelivery));
    // The grant lands at once; its answer comes after the lease's safe time (1.5 s lease).
    faulty.inject(&[Fault::SlowAnswer(Duration::from_millis(1600))]);
    let start = Instant::now();
    let deadline = start + Duration::from_millis(2500);
    let opts = AcquireOptions { deadline: Some(deadline), ..Default::default() };
    let acquire = {
        let c = c.clone();
        tokio::spawn(async move { c.acquire(k, "h", Some(Duration::from_millis(1500)), opts).await })
    };
    // A waiter joins the queue of the key the late grant holds, once the grant has landed (a
    // fresh coordinator on DynamoDB first reads the key for clock evidence, for up to a second;
    // the answer then comes 1.6 s after the write).
    let landed = Instant::now() + Duration::from_secs(10);
    while !b.store().get(k).await.unwrap().is_some_and(|r| r.holder == "h" && r.released_at_ms.is_none()) {
        assert!(Instant::now() < landed, "the grant never landed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let q = other.acquire_or_enqueue(k, "w", Duration::from_secs(30), AcquireOptions::default(), "t", None).await;
    assert!(matches!(q, Ok(Enqueued::Queued { .. })), "{q:?}");
    let r = acquire.await.unwrap();
    let ended = start.elapsed();
    // Its deadline, plus room for a loaded machine (the clock reads, the slow answer, the
    // release of the late grant): well short of a wait for the 8 s delivery, which began
    // after the slow answer.
    assert!(ended < Duration::from_millis(2500 + 4000), "the acquire ended after {ended:?}: {r:?}");
    assert!(r.is_err(), "the key was handed to the waiter: {r:?}");
}

/// A wall clock `ahead` of the machine's.
#[derive(Debug)]
struct Ahead(i64);

impl Clock for Ahead {
    fn wall_us(&self) -> i64 {
        SystemClock.wall_us() + self.0
    }
    fn now(&self) -> Instant {
        SystemClock.now()
    }
}

/// The fail-closed acquire's condition refuses a key released after the attempt's `:now`: a
/// coordinator whose clock is behind the releaser's goes again once its clock has passed the
/// release, and is granted the key within the call (no `LeaseHeld`). A timed acquire is not
/// held back by a releaser's clock at all.
async fn an_acquire_right_after_a_release_by_a_clock_ahead_is_granted(b: Backend) {
    let ahead_us = 40_000; // 40 ms, within the test skew margin of 50 ms
    let cfg = Config { clock: Arc::new(Ahead(ahead_us)), ..test_config() };
    let releaser = b.coordinator(cfg);
    let taker = b.coordinator(test_config());
    for fail_closed in [true, false, true] {
        let l = releaser.acquire("ahead", "r", secs(30), AcquireOptions::default()).await.unwrap();
        // Held long enough that the key is free to the taker's clock at once (the release
        // frees it at the acquire's time), while its `released_at_ms` is still ahead.
        tokio::time::sleep(Duration::from_millis(100)).await;
        releaser.release("ahead", &l.lease_id).await.unwrap();
        let (d, id) = if fail_closed { (None, Some(LeaseId::generate())) } else { (secs(30), None) };
        let next = taker.acquire("ahead", "t", d, AcquireOptions { lease_id: id, ..Default::default() }).await.unwrap();
        assert!(next.fence > l.fence);
        taker.release("ahead", &next.lease_id).await.unwrap();
        // Let the taker's clock pass its own release before the releaser acquires again.
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
}

/// Seed 149 of the simulation. A renewal of a batch lease (a key in a work state) whose answer
/// is lost must not leave a TTL on the work item (TTL would delete it).
async fn an_unanswered_renewal_leaves_no_ttl_on_a_work_item(b: Backend) {
    let faulty = Faulty::new(b.store());
    let c = Coordinator::new(faulty.clone(), test_config());
    c.put("wi-ttl", "todo-ttl", "producer").await.unwrap();
    let leases = c.acquire_next("todo-ttl", 1, "h", secs(30), AcquireOptions::default()).await.unwrap();
    assert_eq!(leases.len(), 1);
    let l = &leases[0];
    assert_eq!(b.store().get("wi-ttl").await.unwrap().unwrap().ttl, None);
    // Every answer of the renewal is lost (its writes are made), and the caller gives up.
    let mut cfg = test_config();
    cfg.retry_budget = Duration::from_millis(1);
    let impatient = Coordinator::new(faulty.clone(), cfg);
    faulty.inject(&vec![Fault::LoseResponse; 20]);
    let r = impatient.heartbeat("wi-ttl", &l.lease_id, secs(40)).await;
    assert!(r.is_err(), "{r:?}");
    faulty.plan.lock().unwrap().clear();
    let item = b.store().get("wi-ttl").await.unwrap().unwrap();
    assert_eq!(item.work.state.as_deref(), Some("todo-ttl"));
    assert_eq!(item.ttl, None, "a renewal left a TTL on a work item: {item:?}");
}

/// The renewal of a work item extends it, keeps its state and writes no TTL, and so does the
/// renewal of a plain lease write one.
async fn a_renewal_of_a_work_item_extends_it_without_a_ttl(b: Backend) {
    let c = b.coordinator(test_config());
    c.put("wi-renew", "todo-renew", "producer").await.unwrap();
    let leases = c.acquire_next("todo-renew", 1, "h", secs(30), AcquireOptions::default()).await.unwrap();
    let l = &leases[0];
    for d in [secs(40), None] {
        let h = c.heartbeat("wi-renew", &l.lease_id, d).await.unwrap();
        assert_eq!(h.fence, l.fence);
        assert!(h.expires_at_ms >= l.expires_at_ms);
        let item = b.store().get("wi-renew").await.unwrap().unwrap();
        assert_eq!(item.work.state.as_deref(), Some("todo-renew"));
        assert_eq!(item.ttl, None, "{item:?}");
    }
    let plain = c.acquire("plain-renew", "h", secs(30), AcquireOptions::default()).await.unwrap();
    let before = b.store().get("plain-renew").await.unwrap().unwrap().ttl.expect("a plain lease has a TTL");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    c.heartbeat("plain-renew", &plain.lease_id, secs(40)).await.unwrap();
    let after = b.store().get("plain-renew").await.unwrap().unwrap().ttl.expect("a plain lease keeps a TTL");
    assert!(after > before, "the renewal moved the TTL: {before} -> {after}");
    let r = c.heartbeat("wi-renew", &LeaseId::generate(), None).await;
    assert!(matches!(r, Err(Error::NotHolder { .. })), "{r:?}");
}

/// A store that holds one write, once armed: the first whose mutation `pick` chooses. It tells
/// `arrived` when that write comes, sends it once `go` is told, tells `landed` when it landed,
/// and with `hold_answer` answers only once `answer` is told (the answer held in the network).
struct Gate {
    pick: fn(&Mutation) -> bool,
    hold_answer: bool,
    armed: std::sync::atomic::AtomicBool,
    arrived: tokio::sync::Notify,
    go: tokio::sync::Notify,
    landed: tokio::sync::Notify,
    answer: tokio::sync::Notify,
}

impl Gate {
    fn new(inner: Arc<dyn Store>, pick: fn(&Mutation) -> bool, hold_answer: bool) -> Arc<Wrapped<Gate>> {
        wrap(
            inner,
            Gate {
                pick,
                hold_answer,
                armed: Default::default(),
                arrived: Default::default(),
                go: Default::default(),
                landed: Default::default(),
                answer: Default::default(),
            },
        )
    }
}

#[async_trait]
impl Intercept for Gate {
    async fn update(&self, store: &Arc<dyn Store>, key: &str, c: &Condition, m: &Mutation) -> leasehold::Result<Write> {
        if !((self.pick)(m) && self.armed.swap(false, Ordering::SeqCst)) {
            return store.update(key, c, m).await;
        }
        self.arrived.notify_one();
        self.go.notified().await;
        let w = store.update(key, c, m).await;
        self.landed.notify_one();
        if self.hold_answer {
            self.answer.notified().await;
        }
        w
    }
    fn passes_clock(&self) -> bool {
        true
    }
}

/// Step Functions for a task whose first attempt's invocation failed: `token-1` is dead (a
/// delivery to it answers `Gone`), and a task that has its output answers `Gone`
/// (`TaskTimedOut`) to any later delivery; every other delivery lands and is recorded.
#[derive(Default)]
struct Retried(std::sync::Mutex<Vec<(String, Lease)>>);

#[async_trait]
impl Deliver for Retried {
    async fn success(&self, token: &str, lease: &Lease) -> Result<(), DeliveryError> {
        let mut delivered = self.0.lock().unwrap();
        if token == "token-1" || delivered.iter().any(|(t, _)| t == token) {
            return Err(DeliveryError::Gone("TaskTimedOut".into()));
        }
        delivered.push((token.to_string(), lease.clone()));
        Ok(())
    }
    async fn failure(&self, _: &str, _: &str, _: &str) -> Result<(), DeliveryError> {
        Ok(())
    }
}

/// What every race of a retried invocation with its slot's hand-over starts from: `k` held by
/// `holder` through `functions`, and the execution's first invocation queued behind it (its
/// token, `token-1`, dead from now on: the invocation failed and Step Functions retries it).
async fn queued_behind(functions: &Coordinator, k: &str, id: &LeaseId) -> (Lease, u64) {
    let d = Duration::from_secs(30);
    let held = functions.acquire(k, "holder", Some(d), AcquireOptions::default()).await.unwrap();
    let mine = AcquireOptions { lease_id: Some(id.clone()), ..Default::default() };
    let first = functions.acquire_or_enqueue(k, "exec", d, mine, "token-1", None).await.unwrap();
    let Enqueued::Queued { seq, position: 1, .. } = first else { panic!("the key is held: {first:?}") };
    (held, seq)
}

/// The retried invocation (the execution's lease_id, a new token).
async fn retried(c: &Coordinator, k: &str, id: &LeaseId) -> leasehold::Result<Enqueued> {
    let mine = AcquireOptions { lease_id: Some(id.clone()), ..Default::default() };
    c.acquire_or_enqueue(k, "exec", Duration::from_secs(30), mine, "token-2", None).await
}

/// The execution holds the lease delivered to its retried invocation's token: once, not
/// revoked, renewable, and nobody else takes the key.
async fn holds_what_it_was_delivered(c: &Coordinator, rec: &Retried, k: &str, id: &LeaseId) {
    let delivered = rec.0.lock().unwrap().clone();
    assert_eq!(delivered.len(), 1, "{delivered:?}");
    assert_eq!((delivered[0].0.as_str(), &delivered[0].1.lease_id), ("token-2", id), "{delivered:?}");
    let s = c.get(k).await.unwrap();
    assert!(s.held && s.holder == "exec" && s.fence == delivered[0].1.fence, "the grant was revoked: {s:?}");
    c.heartbeat(k, id, secs(30)).await.expect("the execution still holds its lease");
    let other = c.acquire(k, "other", secs(30), AcquireOptions::default()).await;
    assert!(matches!(other, Err(Error::LeaseHeld { .. })), "{other:?}");
    c.release(k, id).await.unwrap();
}

/// `waiter_lost` through a rewrite (`sim/tests/queue_findings.rs` on the simulated store). A
/// retried invocation writes its slot's waiter item again with its token after the holder's
/// release read it for the hand-over, and answers `Queued` before the release's grant lands:
/// the grant goes to the dead token, whose delivery answers `Gone`. The grant must not be
/// revoked: its deliverer reads the waiter item again, finds the new token and delivers there
/// (before, it revoked the grant and the execution waited, unserved, until its queue timeout).
async fn a_slot_rewritten_during_its_hand_over_is_delivered_to_the_new_token(b: Backend) {
    let k = "rewrite-before-grant";
    let rec = Arc::new(Retried::default());
    let gate = Gate::new(b.store(), |m| matches!(m, Mutation::Queue(QueueMutation::Grant { .. })), false);
    let functions = Coordinator::new(gate.clone(), test_config()).with_deliver(rec.clone());
    let id = LeaseId::generate();
    let (held, seq) = queued_behind(&functions, k, &id).await;
    // The holder releases: the hand-over reads the waiter item (token-1), its grant is held.
    gate.armed.store(true, Ordering::SeqCst);
    let releasing = {
        let (c, lease_id) = (functions.clone(), held.lease_id.clone());
        tokio::spawn(async move { c.release(k, &lease_id).await })
    };
    gate.arrived.notified().await;
    let retry = retried(&b.coordinator(test_config()).with_deliver(rec.clone()), k, &id).await;
    assert!(matches!(retry, Ok(Enqueued::Queued { seq: s, .. }) if s == seq), "{retry:?}");
    gate.go.notify_one();
    releasing.await.unwrap().unwrap();
    holds_what_it_was_delivered(&functions, &rec, k, &id).await;
}

/// As above, the retried invocation's rewrite landing only after the deliverer read the waiter
/// item again (still `token-1`) and before its revoke, and reading the key after the revoke:
/// its slot was granted and revoked, told to nobody. It must not answer `Queued` (its execution
/// would wait unserved until its queue timeout) but `NotHolder` (released) at once, as a retry
/// that comes after the revoke is answered; and it deletes the waiter item it wrote again.
async fn a_slot_rewritten_after_its_grant_was_judged_gone_is_told_not_holder(b: Backend) {
    let k = "rewrite-after-gone";
    let rec = Arc::new(Retried::default());
    let s_gate = Gate::new(b.store(), |m| matches!(m, Mutation::Queue(QueueMutation::Revoke { .. })), false);
    let r_gate = Gate::new(b.store(), |m| matches!(m, Mutation::Queue(QueueMutation::PutWaiter(_))), true);
    let functions = Coordinator::new(s_gate.clone(), test_config()).with_deliver(rec.clone());
    let retry_fn = Coordinator::new(r_gate.clone(), test_config()).with_deliver(rec.clone());
    let id = LeaseId::generate();
    let (held, seq) = queued_behind(&functions, k, &id).await;
    // The retry finds its slot's waiter item; its rewrite is held in the network.
    r_gate.armed.store(true, Ordering::SeqCst);
    let retrying = {
        let (c, id) = (retry_fn.clone(), id.clone());
        tokio::spawn(async move { retried(&c, k, &id).await })
    };
    r_gate.arrived.notified().await;
    // The holder releases: granted to token-1, `Gone`; its revoke is held.
    s_gate.armed.store(true, Ordering::SeqCst);
    let releasing = {
        let (c, lease_id) = (functions.clone(), held.lease_id.clone());
        tokio::spawn(async move { c.release(k, &lease_id).await })
    };
    s_gate.arrived.notified().await;
    // The rewrite lands, then the revoke; then the retry has its answer.
    r_gate.go.notify_one();
    r_gate.landed.notified().await;
    s_gate.go.notify_one();
    releasing.await.unwrap().unwrap();
    r_gate.answer.notify_one();
    let retry = retrying.await.unwrap();
    assert!(
        matches!(retry, Err(Error::NotHolder { reason: leasehold::NotHolderReason::Released, .. })),
        "the execution waits for a slot already served: {retry:?}"
    );
    assert!(rec.0.lock().unwrap().is_empty());
    let wk = format!("{k}{SEPARATOR}q{seq}");
    assert!(b.store().get(&wk).await.unwrap().is_none(), "the rewritten waiter item of a served slot is left");
    let next = functions.acquire(k, "next", secs(5), AcquireOptions::default()).await.unwrap();
    assert!(next.fence > held.fence);
}

/// As above, the rewrite landing before the hand-over read the waiter item: the grant goes to
/// the retry's token and is delivered, and the retry reads the key only after that. It finds its
/// lease live and no longer marked; its delivery to its own token answers `Gone` (the task has
/// its output). That `Gone` proves nothing here: the lease must not be released under the
/// execution that holds it.
async fn a_retry_that_finds_its_rewritten_slot_delivered_keeps_the_lease(b: Backend) {
    let k = "rewrite-then-delivered";
    let rec = Arc::new(Retried::default());
    let s_gate = Gate::new(b.store(), |m| matches!(m, Mutation::Queue(QueueMutation::Delivered { .. })), false);
    let r_gate = Gate::new(b.store(), |m| matches!(m, Mutation::Queue(QueueMutation::PutWaiter(_))), true);
    let functions = Coordinator::new(s_gate.clone(), test_config()).with_deliver(rec.clone());
    let retry_fn = Coordinator::new(r_gate.clone(), test_config()).with_deliver(rec.clone());
    let id = LeaseId::generate();
    let (held, _) = queued_behind(&functions, k, &id).await;
    // The retry's rewrite lands; its answer is held.
    r_gate.armed.store(true, Ordering::SeqCst);
    r_gate.go.notify_one();
    let retrying = {
        let (c, id) = (retry_fn.clone(), id.clone());
        tokio::spawn(async move { retried(&c, k, &id).await })
    };
    r_gate.landed.notified().await;
    // The holder releases: the grant goes to token-2, delivered, its mark removed.
    s_gate.armed.store(true, Ordering::SeqCst);
    s_gate.go.notify_one();
    functions.release(k, &held.lease_id).await.unwrap();
    s_gate.landed.notified().await;
    r_gate.answer.notify_one();
    // (Its answer does not matter: the task has its output, and ignores it.)
    let _ = retrying.await.unwrap();
    holds_what_it_was_delivered(&functions, &rec, k, &id).await;
}
