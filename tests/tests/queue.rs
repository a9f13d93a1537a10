//! The waiter queue (DESIGN.md, "The waiter queue") on both stores: FIFO hand-over, waiters
//! that are gone, racing releases and sweeps, undelivered grants, 1,000 waiters on one key.
//!
//! Delivery goes through the protocol's `Deliver` boundary, recorded in process here (what the
//! Step Functions side does with a delivered lease is not under test in this file); each
//! recorded delivery is checked against the store.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use leasehold::queue::{Deliver, DeliveryError, Enqueued, DELIVERY_GRACE_MS};
use leasehold::store::{
    Condition, Mutation, Page, QueueCondition, QueueMutation, ScanKind, Store, WorkMutation, Write,
};
use leasehold::{AcquireOptions, Coordinator, Lease, LeaseId, Record};
use leasehold_tests::{both_backends, test_config, widest_first_margin, wrap, Backend, Counting, Intercept, Wrapped};

both_backends!(
    waiters_are_served_in_order,
    gone_and_timed_out_waiters_are_passed_over,
    the_sweep_passes_over_a_timed_out_waiter_to_one_still_waiting,
    the_sweep_keeps_an_undelivered_grant_and_revokes_a_gone_one,
    racing_releases_and_sweeps_grant_once,
    crashed_holder_is_replaced_by_the_sweep,
    undelivered_grant_is_delivered_by_the_sweep,
    the_sweep_delivers_to_a_rewritten_slot_s_new_token,
    plain_acquire_does_not_jump_the_queue,
    thousand_waiters_constant_requests_per_hand_over,
    in_process_waiters_are_woken_in_order,
    queued_acquire_refuses_bad_input,
    work_items_keep_their_state_through_the_queue,
    release_grants_the_head_waiter_in_its_own_write,
    a_waiters_grant_carries_its_metadata_keepalive_and_ttl,
    free_key_grant_whose_delivery_answer_is_lost_is_kept,
    waiters_outlive_the_ttl_of_a_day,
    a_retried_enqueue_takes_one_slot,
    a_retried_invocation_keeps_its_slot_ahead_of_later_waiters,
    a_new_queue_starts_above_a_fence_ahead_of_this_clock,
    a_key_freed_while_joining_its_queue_is_taken,
    a_missing_slot_is_skipped_after_its_own_grace,
    a_missing_slot_is_waited_for_within_its_grace,
    retried_release_after_a_hand_over_is_already_released,
    an_ambiguous_hand_over_is_recognised_by_its_retry,
    an_expired_undelivered_grant_is_ended_and_the_next_served,
    min_hold_end_serves_the_queue,
    a_long_min_hold_is_left_to_the_sweep,
    a_release_without_waiters_reads_nothing,
    revoke_keeps_a_work_state_without_ttl,
    heartbeat_answers_without_waiting_for_the_ttl_removal,
    sweep_reads_one_entry_per_key_and_rotates,
    a_key_the_sweep_cannot_serve_is_counted_and_kept,
    an_index_page_the_sweep_cannot_read_is_counted,
);

/// Records deliveries; tokens in `gone` answer `Gone`; the next `transient` attempts fail;
/// the next `landed_but_lost` attempts are delivered but answered `Transient` (a
/// `SendTaskSuccess` that landed and whose answer timed out), and a task that has its output
/// answers `Gone` (`TaskTimedOut`) to any later attempt.
#[derive(Default)]
struct Recorder {
    delivered: Mutex<Vec<(String, Lease)>>,
    failed: Mutex<Vec<(String, String)>>,
    gone: Mutex<HashSet<String>>,
    transient: AtomicUsize,
    landed_but_lost: AtomicUsize,
    attempts: AtomicUsize,
    /// The next `failing` failure notices fail for a transient reason.
    failing: AtomicUsize,
}

#[async_trait]
impl Deliver for Recorder {
    async fn success(&self, token: &str, lease: &Lease) -> Result<(), DeliveryError> {
        self.attempts.fetch_add(1, Ordering::SeqCst);
        if self.gone.lock().unwrap().contains(token) {
            return Err(DeliveryError::Gone("TaskTimedOut".into()));
        }
        if self.transient.load(Ordering::SeqCst) > 0 {
            self.transient.fetch_sub(1, Ordering::SeqCst);
            return Err(DeliveryError::Transient("ThrottlingException".into()));
        }
        if self.delivered.lock().unwrap().iter().any(|(t, _)| t == token) {
            return Err(DeliveryError::Gone("TaskTimedOut".into()));
        }
        self.delivered.lock().unwrap().push((token.to_string(), lease.clone()));
        if self.landed_but_lost.load(Ordering::SeqCst) > 0 {
            self.landed_but_lost.fetch_sub(1, Ordering::SeqCst);
            return Err(DeliveryError::Transient("timeout: the answer never came".into()));
        }
        Ok(())
    }
    async fn failure(&self, token: &str, error: &str, _: &str) -> Result<(), DeliveryError> {
        if self.failing.load(Ordering::SeqCst) > 0 {
            self.failing.fetch_sub(1, Ordering::SeqCst);
            return Err(DeliveryError::Transient("ThrottlingException".into()));
        }
        self.failed.lock().unwrap().push((token.to_string(), error.to_string()));
        Ok(())
    }
}

impl Recorder {
    fn tokens(&self) -> Vec<String> {
        self.delivered.lock().unwrap().iter().map(|(t, _)| t.clone()).collect()
    }
    fn last(&self) -> Lease {
        self.delivered.lock().unwrap().last().expect("a delivery").1.clone()
    }
}

fn coord(b: &Backend, rec: &Arc<Recorder>) -> Coordinator {
    b.coordinator(test_config()).with_deliver(rec.clone())
}

fn key(tag: &str) -> String {
    format!("queue/{tag}/{}", LeaseId::generate().expose())
}

async fn enqueue(c: &Coordinator, key: &str, token: &str, duration: Duration) -> Enqueued {
    c.acquire_or_enqueue(key, token, duration, AcquireOptions::default(), token, None).await.expect("enqueue")
}

async fn waiters_are_served_in_order(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let c = coord(&b, &rec);
    let k = key("fifo");
    let first = enqueue(&c, &k, "t0", Duration::from_secs(30)).await;
    let Enqueued::Granted(mut lease) = first else { panic!("free key must be granted: {first:?}") };
    assert_eq!(rec.tokens(), ["t0"], "a grant on a free key is delivered at once");
    let mut ids = Vec::new();
    for i in 1..=5 {
        match enqueue(&c, &k, &format!("t{i}"), Duration::from_secs(30)).await {
            Enqueued::Queued { position, lease_id, .. } => {
                assert_eq!(position, i, "positions count from the head");
                ids.push(lease_id);
            }
            other => panic!("held key must queue: {other:?}"),
        }
    }
    assert_eq!(c.get(&k).await.unwrap().queue_length, 5);
    assert_eq!(c.queue_position(&k, &ids[2], 100).await.unwrap(), Some(3));
    // The same through the request vocabulary: `get` with a queued lease_id.
    let get = |id: &LeaseId| serde_json::json!({"key": k, "lease_id": id.expose()});
    let v = leasehold::api::run(&c, leasehold::api::Operation::Get, None, get(&ids[2]), None).await.unwrap();
    assert_eq!((v["queue_length"].as_u64(), v["queue_position"].as_u64()), (Some(5), Some(3)), "{v}");
    let v =
        leasehold::api::run(&c, leasehold::api::Operation::Get, None, get(&LeaseId::generate()), None).await.unwrap();
    assert!(v.get("queue_position").is_none(), "not queued: {v}");
    for i in 1..=5 {
        let before = lease.fence;
        c.release(&k, &lease.lease_id).await.unwrap();
        lease = rec.last();
        assert_eq!(rec.tokens().len(), i + 1, "one delivery per release");
        assert_eq!(rec.tokens()[i], format!("t{i}"), "FIFO");
        assert_eq!(lease.lease_id, ids[i - 1], "the waiter's own lease_id");
        assert!(lease.fence > before, "a hand-over fence is above every earlier one");
        let st = c.get(&k).await.unwrap();
        assert!(st.held && st.holder == format!("t{i}") && st.fence == lease.fence, "{st:?}");
        assert_eq!(st.queue_length, 5 - i as u64);
        assert!(c.heartbeat(&k, &lease.lease_id, None).await.is_ok(), "the delivered lease is live");
    }
    c.release(&k, &lease.lease_id).await.unwrap();
    assert!(!c.get(&k).await.unwrap().held, "the last release frees the key");
    let again = c.acquire(&k, "plain", Some(Duration::from_secs(5)), AcquireOptions::default()).await.unwrap();
    assert!(again.fence > lease.fence);
}

async fn gone_and_timed_out_waiters_are_passed_over(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let c = coord(&b, &rec);
    let k = key("gone");
    let Enqueued::Granted(lease) = enqueue(&c, &k, "holder", Duration::from_secs(30)).await else { panic!() };
    enqueue(&c, &k, "gone", Duration::from_secs(30)).await;
    let past = Some(Duration::from_millis(300));
    c.acquire_or_enqueue(&k, "late", Duration::from_secs(30), AcquireOptions::default(), "late", past).await.unwrap();
    enqueue(&c, &k, "live", Duration::from_secs(30)).await;
    rec.gone.lock().unwrap().insert("gone".into());
    // Past the late waiter's timeout by the coordinator's clock: the timeout is dated by its
    // write's stamp, and the release's stamp may stand behind this machine's clock by up to
    // the width of the store clock's band (DESIGN.md, "Clocks").
    tokio::time::sleep(Duration::from_millis(400) + widest_first_margin(&c, Duration::from_millis(200))).await;
    let attempts = rec.attempts.load(Ordering::SeqCst);
    c.release(&k, &lease.lease_id).await.unwrap();
    assert_eq!(rec.tokens(), ["holder", "live"], "gone and timed-out waiters are passed over");
    assert_eq!(rec.attempts.load(Ordering::SeqCst) - attempts, 2, "no delivery to a timed-out waiter");
    let st = c.get(&k).await.unwrap();
    assert!(st.held && st.holder == "live" && st.queue_length == 0, "{st:?}");
}

/// The sweep serving a crashed holder's key, in one pass: revokes the grant of a waiter that is
/// gone, passes over one whose task timed out (neither is delivered to; both counted as
/// skipped) and grants the next, whose task still has a minute to wait (a waiter with a timeout
/// of its own, as every QueuedSingleFlight waiter has).
async fn the_sweep_passes_over_a_timed_out_waiter_to_one_still_waiting(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let c = coord(&b, &rec);
    let k = key("timed-out");
    let Enqueued::Granted(crashed) = enqueue(&c, &k, "crashed", Duration::from_millis(3000)).await else { panic!() };
    let minute = Some(Duration::from_secs(60));
    let (past, long) = (Some(Duration::from_millis(300)), Duration::from_secs(30));
    enqueue(&c, &k, "gone", long).await;
    rec.gone.lock().unwrap().insert("gone".into());
    let late = c.acquire_or_enqueue(&k, "late", long, AcquireOptions::default(), "late", past).await.unwrap();
    let live = c.acquire_or_enqueue(&k, "live", long, AcquireOptions::default(), "live", minute).await.unwrap();
    assert!(matches!((&late, &live), (Enqueued::Queued { .. }, Enqueued::Queued { .. })), "{late:?} {live:?}");
    // Past the crashed holder's expiry (and so the late waiter's timeout) by the widest band
    // the store's clock may have.
    let left = crashed.expires_at_ms.unwrap().saturating_sub(c.now_ms());
    tokio::time::sleep(Duration::from_millis(left + 100) + widest_first_margin(&c, Duration::from_millis(200))).await;
    let r = c.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert_eq!((r.keys, r.served.delivered, r.served.skipped, r.errors), (1, 1, 2, 0), "{r:?}");
    assert_eq!(rec.tokens(), ["crashed", "live"]);
    let st = c.get(&k).await.unwrap();
    assert!(st.held && st.holder == "live" && st.queue_length == 0, "{st:?}");
}

/// After their holders crashed, the sweep grants each key to its waiter: a grant whose delivery
/// keeps failing is kept, marked undelivered (counted; the next sweep delivers it); one whose
/// waiter is gone is revoked (counted as skipped), and the key, free, keeps a TTL well after
/// now (TTL never deletes an item whose fence a later lease must pass).
async fn the_sweep_keeps_an_undelivered_grant_and_revokes_a_gone_one(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let c = coord(&b, &rec);
    let (kept, revoked) = (key("sweep-undelivered"), key("sweep-revoked"));
    let mut expiry = 0;
    for (k, holder, waiter) in [(&kept, "crashed-1", "slow"), (&revoked, "crashed-2", "gone")] {
        let Enqueued::Granted(l) = enqueue(&c, k, holder, Duration::from_millis(3000)).await else { panic!() };
        expiry = expiry.max(l.expires_at_ms.unwrap());
        let queued = enqueue(&c, k, waiter, Duration::from_secs(30)).await;
        assert!(matches!(queued, Enqueued::Queued { .. }), "{queued:?}");
    }
    rec.gone.lock().unwrap().insert("gone".into());
    let left = expiry.saturating_sub(c.now_ms());
    tokio::time::sleep(Duration::from_millis(left + 100) + widest_first_margin(&c, Duration::from_millis(200))).await;
    rec.transient.store(100, Ordering::SeqCst);
    let before = c.now_ms();
    let r = c.sweep_queues(Instant::now() + Duration::from_secs(20)).await.unwrap();
    rec.transient.store(0, Ordering::SeqCst);
    let counts = (r.keys, r.served.delivered, r.served.undelivered, r.served.skipped, r.errors);
    assert_eq!(counts, (2, 0, 1, 1, 0), "{r:?}");
    let st = c.get(&kept).await.unwrap();
    assert!(st.held && st.holder == "slow", "kept for its delivery: {st:?}");
    let item = b.store().get(&revoked).await.unwrap().expect("the item");
    assert!(item.released_at_ms.is_some() && item.queue_len() == 0, "{item:?}");
    // The longest lease after the revoke, the fence lead and the TTL grace.
    let cfg = c.config();
    let after = cfg.limits.max_duration.as_millis() as u64 + (cfg.fence_lead + cfg.ttl_grace).as_millis() as u64;
    let ttl_ms = item.ttl.expect("a TTL") * 1000;
    assert!(ttl_ms >= before + after && ttl_ms <= c.now_ms() + after + 1000, "{item:?}");
}

async fn racing_releases_and_sweeps_grant_once(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let coords: Vec<Coordinator> = (0..4)
        .map(|_| Coordinator::new(b.reopen(), test_config()).with_deliver(rec.clone() as Arc<dyn Deliver>))
        .collect();
    let c = &coords[0];
    let k = key("race");
    let Enqueued::Granted(mut lease) = enqueue(c, &k, "t0", Duration::from_secs(30)).await else { panic!() };
    for i in 1..=4 {
        enqueue(c, &k, &format!("t{i}"), Duration::from_secs(30)).await;
    }
    for round in 1..=4 {
        // The holder's release, twice (a retry), while other coordinators serve the queue and
        // sweep at the same time.
        let mut tasks = Vec::new();
        for (i, co) in coords.iter().enumerate() {
            let (co, k, id) = (co.clone(), k.clone(), lease.lease_id.clone());
            tasks.push(tokio::spawn(async move {
                match i {
                    // The holder's release and its retry: whichever lands second finds the
                    // key released (already_released) or already handed over (another
                    // lease's: wrong_lease_id), and changes nothing.
                    0 | 1 => match co.release(&k, &id).await {
                        Ok(_) => return 1,
                        Err(leasehold::Error::NotHolder {
                            reason: leasehold::NotHolderReason::WrongLeaseId, ..
                        }) => {}
                        Err(e) => panic!("{e:?}"),
                    },
                    2 => {
                        co.serve_queue(&k).await.unwrap();
                    }
                    _ => {
                        co.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap();
                    }
                }
                0
            }));
        }
        let mut released = 0;
        for t in tasks {
            released += t.await.unwrap();
        }
        assert!(released >= 1, "the release landed");
        coords[1].serve_queue(&k).await.unwrap();
        let tokens = rec.tokens();
        assert_eq!(tokens.len(), round + 1, "exactly one grant per release: {tokens:?}");
        assert_eq!(tokens[round], format!("t{round}"));
        lease = rec.last();
        let st = c.get(&k).await.unwrap();
        assert!(st.held && st.fence == lease.fence, "the delivered grant is the key's lease: {st:?}");
    }
}

async fn crashed_holder_is_replaced_by_the_sweep(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let c = coord(&b, &rec);
    let k = key("crash");
    let short = Duration::from_millis(2000);
    let Enqueued::Granted(crashed) = enqueue(&c, &k, "crashed", short).await else { panic!() };
    enqueue(&c, &k, "next", Duration::from_secs(30)).await;
    let early = c.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap();
    // A sweep that ran wholly before the expiry hands nothing over (on a loaded machine it
    // may not have: then it is the sweep after the expiry).
    if c.now_ms() < crashed.expires_at_ms.unwrap() {
        assert_eq!(early.served.delivered, 0, "a live holder is never replaced");
    }
    let left = crashed.expires_at_ms.unwrap().saturating_sub(c.now_ms());
    tokio::time::sleep(Duration::from_millis(left + 100)).await;
    let report = c.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert_eq!(early.served.delivered + report.served.delivered, 1, "{early:?} {report:?}");
    assert_eq!(rec.tokens(), ["crashed", "next"]);
    // Each run read the one key with waiters; the grant left its queue empty, and the key left
    // the index in the run that made it.
    assert_eq!((early.keys, report.keys, early.errors + report.errors), (1, 1, 0), "{early:?} {report:?}");
    assert_eq!(early.unindexed + report.unindexed, 1, "{early:?} {report:?}");
    assert_eq!(c.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap().keys, 0, "left the index");
    assert!(rec.last().fence > crashed.fence);
    // A force-release hands over the same way.
    enqueue(&c, &k, "after-force", Duration::from_secs(30)).await;
    c.force_release(&k).await.unwrap();
    assert_eq!(rec.tokens().last().unwrap(), "after-force");
}

async fn undelivered_grant_is_delivered_by_the_sweep(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let c = coord(&b, &rec);
    let k = key("undelivered");
    let Enqueued::Granted(lease) = enqueue(&c, &k, "t0", Duration::from_secs(30)).await else { panic!() };
    enqueue(&c, &k, "t1", Duration::from_secs(30)).await;
    rec.transient.store(100, Ordering::SeqCst);
    c.release(&k, &lease.lease_id).await.unwrap();
    assert_eq!(rec.tokens(), ["t0"], "every delivery attempt failed");
    let st = c.get(&k).await.unwrap();
    assert!(st.held && st.holder == "t1", "the grant is written, pending delivery: {st:?}");
    rec.transient.store(0, Ordering::SeqCst);
    // Within the grace the sweep leaves it (the granting function may still be delivering).
    c.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert_eq!(rec.tokens(), ["t0"]);
    tokio::time::sleep(Duration::from_millis(DELIVERY_GRACE_MS + 100)).await;
    // Its delivery failing once more: counted, and left for the next sweep.
    rec.transient.store(1, Ordering::SeqCst);
    let swept = c.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert_eq!((swept.served.undelivered, swept.served.delivered), (1, 0), "{swept:?}");
    assert_eq!(rec.tokens(), ["t0"]);
    let swept = c.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert_eq!(rec.tokens(), ["t0", "t1"], "the sweep delivers a grant left undelivered");
    assert_eq!(rec.last().fence, st.fence);
    assert_eq!(swept.served.delivered, 1, "and counts it: {swept:?}");
    let swept = c.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert_eq!(rec.tokens().len(), 2, "delivered once");
    assert_eq!(swept.served.delivered, 0, "{swept:?}");
}

/// A grant left undelivered whose waiter's task is gone while its slot's waiter item was written
/// again with a new token (a retried invocation that stopped after its rewrite): the sweep's
/// delivery to the old token answers `Gone`, and the same sweep moves the mark to the new token
/// and delivers there, once.
async fn the_sweep_delivers_to_a_rewritten_slot_s_new_token(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let c = coord(&b, &rec);
    let k = key("rewritten");
    let Enqueued::Granted(lease) = enqueue(&c, &k, "t0", Duration::from_secs(30)).await else { panic!() };
    let Enqueued::Queued { seq, lease_id, .. } = enqueue(&c, &k, "t1", Duration::from_secs(30)).await else { panic!() };
    rec.transient.store(100, Ordering::SeqCst);
    c.release(&k, &lease.lease_id).await.unwrap();
    rec.transient.store(0, Ordering::SeqCst);
    // The retried invocation's rewrite of its slot: the same waiter, the new token.
    let wk = leasehold::store::waiter_key(&k, seq);
    let mut item = c.store().get(&wk).await.unwrap().expect("the waiter item");
    item.queue.waiter.as_mut().expect("a waiter").task_token = "t1-retry".into();
    item.renewed_at_ms = item.renewed_at_ms.map(|t| t + 1);
    let put = Mutation::Queue(QueueMutation::PutWaiter(Box::new(item)));
    let w = c.store().update(&wk, &Condition::Queue(QueueCondition::NotLease), &put).await.unwrap();
    assert!(matches!(w, Write::Applied(_)), "{w:?}");
    rec.gone.lock().unwrap().insert("t1".into());
    tokio::time::sleep(Duration::from_millis(DELIVERY_GRACE_MS + 100)).await;
    let swept = c.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert_eq!(rec.tokens(), ["t0", "t1-retry"], "delivered to the new token in the same sweep");
    assert_eq!((rec.last().lease_id.expose(), swept.served.delivered), (lease_id.expose(), 1), "{swept:?}");
    let r = c.store().get(&k).await.unwrap().unwrap();
    assert_eq!(r.queue.pending_token, None, "delivered: the mark goes");
    c.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert_eq!(rec.tokens().len(), 2, "delivered once");
}

async fn plain_acquire_does_not_jump_the_queue(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let c = coord(&b, &rec);
    // Without a deliverer: nobody serves the queue when the holder expires.
    let plain = b.coordinator(test_config());
    let k = key("jump");
    // 2 s: a loaded machine can answer a grant later than a shorter lease's safe time.
    let Enqueued::Granted(t0) = enqueue(&c, &k, "t0", Duration::from_secs(2)).await else { panic!() };
    enqueue(&c, &k, "t1", Duration::from_secs(30)).await;
    let left = t0.expires_at_ms.unwrap().saturating_sub(c.now_ms());
    tokio::time::sleep(Duration::from_millis(left + 100)).await;
    let err = plain.acquire(&k, "jumper", Some(Duration::from_secs(5)), AcquireOptions::default()).await;
    assert!(matches!(err, Err(leasehold::Error::LeaseHeld { .. })), "a free key with waiters is theirs: {err:?}");
    c.serve_queue(&k).await.unwrap();
    assert_eq!(rec.tokens(), ["t0", "t1"]);
}

async fn thousand_waiters_constant_requests_per_hand_over(b: Backend) {
    let n: usize = 1000;
    let rec = Arc::new(Recorder::default());
    let counting = Counting::new(b.store());
    let c = Coordinator::new(counting.clone(), test_config()).with_deliver(rec.clone() as Arc<dyn Deliver>);
    let k = key("thousand");
    let Enqueued::Granted(mut lease) = enqueue(&c, &k, "t0", Duration::from_secs(600)).await else { panic!() };
    // Enqueued from 8 tasks at once: the order is the sequence order.
    let seqs = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for t in 0..8 {
        let (c, k, seqs) = (c.clone(), k.clone(), seqs.clone());
        tasks.push(tokio::spawn(async move {
            for i in (t..n).step_by(8) {
                let token = format!("w{i}");
                match enqueue(&c, &k, &token, Duration::from_secs(600)).await {
                    Enqueued::Queued { seq, .. } => seqs.lock().unwrap().push((seq, token)),
                    other => panic!("{other:?}"),
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let mut expected = seqs.lock().unwrap().clone();
    expected.sort();
    assert_eq!(c.get(&k).await.unwrap().queue_length, n as u64);
    // An enqueue with the caller's lease_id (as QueuedSingleFlight sends) looks for an earlier
    // try's waiter item of its own over the newest slots only: its reads do not grow with the
    // queue (1,000 waiters were enqueued moments ago, all within the retry window).
    let g = counting.gets.load(Ordering::SeqCst);
    let mine = AcquireOptions { lease_id: Some(LeaseId::generate()), ..Default::default() };
    let last = c.acquire_or_enqueue(&k, "last", Duration::from_secs(600), mine, "w-last", None).await.unwrap();
    let Enqueued::Queued { seq, .. } = last else { panic!("{last:?}") };
    let reads = counting.gets.load(Ordering::SeqCst) - g;
    assert!(reads as u64 <= 3 + leasehold::queue::RETRY_SCAN_SLOTS, "an enqueue behind {n} waiters read {reads} items");
    expected.push((seq, "w-last".to_string()));
    let mut max_reads = 0;
    let mut max_writes = 0;
    for (i, (_, token)) in expected.iter().enumerate() {
        let (g, u, d) = (
            counting.gets.load(Ordering::SeqCst),
            counting.updates.load(Ordering::SeqCst),
            counting.deletes.load(Ordering::SeqCst),
        );
        c.release(&k, &lease.lease_id).await.unwrap();
        max_reads = max_reads.max(counting.gets.load(Ordering::SeqCst) - g);
        max_writes =
            max_writes.max(counting.updates.load(Ordering::SeqCst) - u + counting.deletes.load(Ordering::SeqCst) - d);
        lease = rec.last();
        assert_eq!(&rec.tokens()[i + 1], token, "FIFO at position {i}");
    }
    assert!(max_writes <= 4 && max_reads <= 1, "per hand-over: {max_writes} writes, {max_reads} reads");
    assert_eq!(rec.attempts.load(Ordering::SeqCst), n + 2, "one SendTaskSuccess per hand-over");
    println!("per hand-over (release included): at most {max_writes} writes, {max_reads} reads, 1 delivery");
}

/// Acquires waiting in one coordinator line up: a release it handles grants the key to the
/// head in the release's own write (far sooner than the fallback poll), in arrival order, and
/// waiters send nothing while they wait.
async fn in_process_waiters_are_woken_in_order(b: Backend) {
    let counting = Counting::new(b.store());
    let mut config = test_config();
    // A fallback poll far longer than the test: every hand-over below is a wake-up.
    config.poll_max = Duration::from_secs(20);
    let c = Coordinator::new(counting.clone(), config);
    let k = key("inproc");
    let long = Some(Duration::from_secs(30));
    let first = c.acquire(&k, "h0", long, AcquireOptions::default()).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 1..=4 {
        let (c2, k2, order) = (c.clone(), k.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let opts = AcquireOptions { wait: Some(Duration::from_secs(15)), ..Default::default() };
            let lease = c2.acquire(&k2, &format!("h{i}"), Some(Duration::from_secs(30)), opts).await.unwrap();
            order.lock().unwrap().push((i, lease.fence, Instant::now()));
            c2.release(&k2, &lease.lease_id).await.unwrap();
        }));
        let deadline = Instant::now() + Duration::from_secs(10);
        while c.waiting(&k) < i {
            assert!(Instant::now() < deadline, "waiter {i} never lined up");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    // Settled: the head tried once and sleeps offering its lease; the others sent nothing.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !c.head_waiter_offers(&k) {
        assert!(Instant::now() < deadline, "the head waiter never settled");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before = counting.updates.load(Ordering::SeqCst);
    let released = Instant::now();
    c.release(&k, &first.lease_id).await.unwrap();
    for t in tasks {
        t.await.unwrap();
    }
    let took = released.elapsed();
    let order = order.lock().unwrap().clone();
    assert_eq!(order.iter().map(|o| o.0).collect::<Vec<_>>(), [1, 2, 3, 4], "FIFO");
    assert!(order.windows(2).all(|w| w[1].1 > w[0].1), "fences increase");
    assert!(took < Duration::from_secs(5), "4 hand-overs by wake-up took {took:?} (fallback poll: 20 s)");
    // Each of the 4 grants is written by the release that frees the key, in its own write (the
    // waiters send nothing): 5 writes in all, the last release an ordinary one.
    assert_eq!(counting.updates.load(Ordering::SeqCst) - before, 5, "one write per release, grant included");
}

/// A queued acquire with inputs it cannot take is `InvalidRequest` and writes nothing.
async fn queued_acquire_refuses_bad_input(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let c = coord(&b, &rec);
    let k = key("bad");
    let long_token = "t".repeat(2049);
    let bad = [
        serde_json::json!({"key": k, "holder": "h", "task_token": ""}),
        serde_json::json!({"key": k, "holder": "h", "task_token": long_token}),
        serde_json::json!({"key": k, "holder": "h", "task_token": "t", "fail_closed": true, "lease_id": "a".repeat(22)}),
        serde_json::json!({"key": k, "holder": "h", "task_token": "t", "wait_ms": 1000}),
        serde_json::json!({"key": k, "holder": "h", "task_token": "t", "min_hold_ms": 1000}),
        serde_json::json!({"key": k, "holder": "h", "task_token": "t", "duration_ms": 1}),
        serde_json::json!({"key": format!("{k}/"), "holder": "h", "task_token": "t"}),
    ];
    for body in bad {
        let out = leasehold::api::run(&c, leasehold::api::Operation::Acquire, None, body.clone(), None).await;
        assert!(matches!(out, Err(leasehold::Error::InvalidRequest(_))), "{body}: {out:?}");
    }
    // The library's callers are checked by the core itself: `wait` alone, `min_hold` alone.
    let d = Duration::from_secs(30);
    for opts in [
        AcquireOptions { wait: Some(Duration::from_secs(1)), ..Default::default() },
        AcquireOptions { min_hold: Some(Duration::from_secs(1)), ..Default::default() },
    ] {
        let out = c.acquire_or_enqueue(&k, "h", d, opts.clone(), "t", None).await;
        assert!(matches!(out, Err(leasehold::Error::InvalidRequest(_))), "{opts:?}: {out:?}");
    }
    assert!(matches!(c.get(&k).await, Err(leasehold::Error::NotFound { .. })), "nothing was written");
    assert_eq!(rec.attempts.load(Ordering::SeqCst), 0, "nothing was delivered");
    // Without a deliverer (a coordinator that cannot reach Step Functions): refused too.
    let plain = b.coordinator(test_config());
    let body = serde_json::json!({"key": k, "holder": "h", "task_token": "t"});
    let out = leasehold::api::run(&plain, leasehold::api::Operation::Acquire, None, body, None).await;
    assert!(matches!(out, Err(leasehold::Error::InvalidRequest(_))), "{out:?}");
    assert!(c.get(&k).await.is_err(), "nothing was written");
    // The longest token Step Functions issues, 2,048 bytes, is taken.
    let body = serde_json::json!({"key": key("bad-edge"), "holder": "h", "task_token": "t".repeat(2048)});
    let out = leasehold::api::run(&c, leasehold::api::Operation::Acquire, None, body, None).await;
    assert!(out.is_ok(), "a 2,048-byte task token: {out:?}");
}

/// A key in a work state (DESIGN.md, "Work items and batch leases") with queued waiters: a
/// batch taker does not jump the queue, the hand-over keeps the state and writes no TTL (a key
/// in a state is kept until it is taken), and the waiter moves it on like any holder.
async fn work_items_keep_their_state_through_the_queue(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let c = coord(&b, &rec);
    // Without a deliverer: nobody serves the queue when the holder expires.
    let plain = b.coordinator(test_config());
    let k = key("work");
    c.put(&k, "PENDING", "producer").await.unwrap();
    // 2 s: a loaded machine can answer a grant later than a shorter lease's safe time.
    let Enqueued::Granted(first) = enqueue(&c, &k, "t0", Duration::from_secs(2)).await else {
        panic!("a free key is granted")
    };
    assert_eq!(first.state.as_deref(), Some("PENDING"), "{first:?}");
    enqueue(&c, &k, "t1", Duration::from_secs(30)).await;
    let left = first.expires_at_ms.unwrap().saturating_sub(c.now_ms());
    tokio::time::sleep(Duration::from_millis(left + 100)).await;
    let taken =
        plain.acquire_next("PENDING", 10, "batch", Some(Duration::from_secs(5)), AcquireOptions::default()).await;
    assert!(
        taken.as_ref().is_ok_and(|v| v.iter().all(|l| l.key != k)),
        "a free key with waiters is theirs, batch takers included: {taken:?}"
    );
    c.serve_queue(&k).await.unwrap();
    assert_eq!(rec.tokens(), ["t0", "t1"]);
    let granted = rec.last();
    assert!(granted.fence > first.fence);
    let item = b.store().get(&k).await.unwrap().expect("item");
    assert_eq!(item.work.state.as_deref(), Some("PENDING"), "the hand-over keeps the state: {item:?}");
    assert_eq!(item.ttl, None, "a key in a state keeps no TTL: {item:?}");
    assert_eq!(item.lease_id, granted.lease_id);
    let released = c.release_to(&k, &granted.lease_id, Some("DONE")).await.unwrap();
    assert_eq!(released.state.as_deref(), Some("DONE"));
    assert_eq!(c.get(&k).await.unwrap().state.as_deref(), Some("DONE"));
}

/// Keeps every item a write of the lease key left behind, in order.
struct Recording {
    key: String,
    written: Mutex<Vec<Record>>,
}

#[async_trait]
impl Intercept for Recording {
    async fn update(&self, store: &Arc<dyn Store>, key: &str, c: &Condition, m: &Mutation) -> leasehold::Result<Write> {
        let w = store.update(key, c, m).await?;
        if let (true, Write::Applied(r)) = (key == self.key, &w) {
            self.written.lock().unwrap().push(r.clone());
        }
        Ok(w)
    }
}

/// The release that frees a key with waiters grants the head waiter in the same conditional
/// write: no write ever leaves the key released (free) between the two leases, and the next
/// holder's fence is above the released one.
async fn release_grants_the_head_waiter_in_its_own_write(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let k = key("one-write");
    let store = wrap(b.store(), Recording { key: k.clone(), written: Mutex::new(Vec::new()) });
    let c = Coordinator::new(store.clone(), test_config()).with_deliver(rec.clone() as Arc<dyn Deliver>);
    let Enqueued::Granted(held) = enqueue(&c, &k, "t0", Duration::from_secs(30)).await else { panic!() };
    // t1's task has a timeout of its own, a minute away (as a QueuedSingleFlight waiter's).
    let (d, minute) = (Duration::from_secs(30), Some(Duration::from_secs(60)));
    c.acquire_or_enqueue(&k, "t1", d, AcquireOptions::default(), "t1", minute).await.unwrap();
    enqueue(&c, &k, "t2", Duration::from_secs(30)).await;
    store.written.lock().unwrap().clear();
    let released = c.release(&k, &held.lease_id).await.unwrap();
    assert_eq!(released.fence, held.fence);
    assert!(!released.already_released);
    assert_eq!(rec.tokens(), ["t0", "t1"]);
    let next = rec.last();
    assert!(next.fence > held.fence);
    let written = store.written.lock().unwrap().clone();
    assert!(
        written.iter().all(|r| r.released_at_ms.is_none() && r.lease_id == next.lease_id),
        "every write of the release left the key held by the next waiter: {written:#?}"
    );
    assert!(c.get(&k).await.unwrap().held);
    // The next release does the same for the last waiter; the one after it frees the key.
    c.release(&k, &next.lease_id).await.unwrap();
    assert_eq!(rec.tokens(), ["t0", "t1", "t2"]);
    let last = rec.last();
    let freed = c.release(&k, &last.lease_id).await.unwrap();
    assert!(!freed.already_released);
    assert!(!c.get(&k).await.unwrap().held);
}

/// The grant a waiter is handed carries what it asked for when it queued: its metadata, its
/// keep-alive (the sweep renews the lease while its execution runs), and a TTL after its own
/// expiry (TTL never deletes a live lease; a lease left behind is deleted a grace after it).
async fn a_waiters_grant_carries_its_metadata_keepalive_and_ttl(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let c = coord(&b, &rec);
    let k = key("carried");
    let Enqueued::Granted(held) = enqueue(&c, &k, "t0", Duration::from_secs(30)).await else { panic!() };
    let metadata = serde_json::json!({"run": "r-1", "attempt": 2}).as_object().cloned();
    let arn = "arn:aws:states:us-east-1:123456789012:execution:sm:run-1".to_string();
    let keepalive = Some(leasehold::Keepalive { until_ms: c.now_ms() + 600_000, execution_arn: Some(arn) });
    let opts = AcquireOptions { metadata: metadata.clone(), keepalive: keepalive.clone(), ..Default::default() };
    let d = Duration::from_secs(40);
    c.acquire_or_enqueue(&k, "t1", d, opts, "t1", None).await.unwrap();
    c.release(&k, &held.lease_id).await.unwrap();
    assert_eq!(rec.tokens(), ["t0", "t1"]);
    let lease = rec.last();
    assert_eq!((&lease.metadata, &lease.keepalive), (&metadata, &keepalive), "{lease:?}");
    let item = b.store().get(&k).await.unwrap().expect("the item");
    let (ttl_ms, expiry) = (item.ttl.expect("a TTL") * 1000, item.expires_at_ms.unwrap());
    let cfg = c.config();
    let (lead, grace) = (cfg.fence_lead.as_millis() as u64, cfg.ttl_grace.as_millis() as u64);
    assert!(ttl_ms >= expiry + lead + grace && ttl_ms <= expiry + lead + grace + 1000, "{item:?}");
    assert_eq!(item.metadata, metadata);
}

/// Two executions must never hold one key: a queued acquire that took a free key and whose
/// `SendTaskSuccess` landed but answered with a timeout keeps the lease (marked undelivered),
/// so nobody else takes the key while the task works; the sweep delivers it again after the
/// grace (answered `Gone`: the task has it) and clears the mark. A first attempt answered
/// `Gone` still frees the key.
async fn free_key_grant_whose_delivery_answer_is_lost_is_kept(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let c = coord(&b, &rec);
    let k = key("lost-answer");
    rec.landed_but_lost.store(1, Ordering::SeqCst);
    let out = enqueue(&c, &k, "t0", Duration::from_secs(60)).await;
    let Enqueued::Granted(lease) = out else { panic!("the key was free: {out:?}") };
    assert_eq!(rec.tokens(), ["t0"], "the task has its lease");
    let other = c.acquire(&k, "other", Some(Duration::from_secs(5)), AcquireOptions::default()).await;
    assert!(matches!(other, Err(leasehold::Error::LeaseHeld { .. })), "one holder at a time: {other:?}");
    let item = b.store().get(&k).await.unwrap().unwrap();
    assert_eq!(item.lease_id, lease.lease_id);
    assert_eq!(item.queue.pending_token.as_deref(), Some("t0"), "marked for the sweep");
    tokio::time::sleep(Duration::from_millis(DELIVERY_GRACE_MS + 100)).await;
    let report = c.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert!(report.keys >= 1, "{report:?}");
    let item = b.store().get(&k).await.unwrap().unwrap();
    assert!(item.queue.pending_token.is_none() && item.lease_id == lease.lease_id, "{item:?}");
    assert!(c.heartbeat(&k, &lease.lease_id, None).await.is_ok(), "still the task's lease");
    // A first attempt answered Gone: never delivered, the key is freed.
    let k2 = key("gone-at-once");
    rec.gone.lock().unwrap().insert("t-gone".into());
    let out = c.acquire_or_enqueue(&k2, "g", Duration::from_secs(60), AcquireOptions::default(), "t-gone", None).await;
    assert!(out.is_err(), "{out:?}");
    assert!(!c.get(&k2).await.unwrap().held);
}

/// The real store as DynamoDB's TTL leaves it at a later time: deletes every item whose `ttl`
/// (epoch s) is before `at_s`, as the TTL sweeper would have by then; how many.
async fn purge_expired(store: &dyn Store, at_s: u64) -> usize {
    let (mut n, mut start) = (0, None::<String>);
    loop {
        let page = store.scan(&ScanKind::All, start.as_deref(), 100).await.unwrap();
        for r in page.items.iter().filter(|r| r.ttl.is_some_and(|t| t < at_s)) {
            let cond =
                if r.fence == 0 { Condition::Queue(QueueCondition::NotLease) } else { Condition::FenceIs(r.fence) };
            if let Write::Applied(_) = store.delete(&r.key, &cond).await.unwrap() {
                n += 1;
            }
        }
        match page.next {
            Some(next) => start = Some(next),
            None => return n,
        }
    }
}

/// A waiter's item outlives the default TTL horizon (about 36 h): it is kept until its own
/// timeout, or a year without one. Played with the TTL deletions 20 days on, behind a
/// fail-closed holder (no TTL of its own).
async fn waiters_outlive_the_ttl_of_a_day(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let store = b.store();
    let c = Coordinator::new(store.clone(), test_config()).with_deliver(rec.clone() as Arc<dyn Deliver>);
    let k = key("long-wait");
    let id = LeaseId::generate();
    let opts = AcquireOptions { lease_id: Some(id.clone()), ..Default::default() };
    c.acquire(&k, "holder", None, opts).await.unwrap();
    let day = 24 * 3600 * 1000;
    c.acquire_or_enqueue(&k, "w1", Duration::from_secs(30), AcquireOptions::default(), "w1", None).await.unwrap();
    let timeout = Some(Duration::from_millis(30 * day));
    c.acquire_or_enqueue(&k, "w2", Duration::from_secs(30), AcquireOptions::default(), "w2", timeout).await.unwrap();
    let purged = purge_expired(&*store, (c.now_ms() + 20 * day) / 1000).await;
    assert_eq!(c.get(&k).await.unwrap().queue_length, 2);
    c.release(&k, &id).await.unwrap();
    assert_eq!(rec.tokens(), ["w1"], "the waiter without a timeout is still queued ({purged} items purged)");
    c.release(&k, &rec.last().lease_id).await.unwrap();
    assert_eq!(rec.tokens(), ["w1", "w2"], "the waiter with a 30-day timeout is still queued");
}

/// What [`Faults`] does to a write it matches.
#[derive(Clone, Copy)]
enum Act {
    /// Make the write, then lose its answer (ambiguous failure).
    LoseAnswer,
    /// Fail without writing.
    Fail,
    /// Make the write after this long.
    Delay(Duration),
    /// Make the write and answer it; the next read (of any key) fails, not sent.
    ThenFailRead,
}

type Rule = Box<dyn Fn(&str, &Mutation) -> Option<Act> + Send + Sync>;

/// The real store with a fault on the writes a rule matches (each rule fires once, but a
/// `Fail` on every matching write).
struct Faults {
    rules: Mutex<Vec<Rule>>,
    /// Reads to fail next ([`Act::ThenFailRead`]).
    failing_reads: AtomicUsize,
}

impl Faults {
    fn new(inner: Arc<dyn Store>) -> Arc<Wrapped<Faults>> {
        wrap(inner, Faults { rules: Mutex::new(Vec::new()), failing_reads: AtomicUsize::new(0) })
    }
    fn once(&self, rule: impl Fn(&str, &Mutation) -> Option<Act> + Send + Sync + 'static) {
        self.rules.lock().unwrap().push(Box::new(rule));
    }
}

#[async_trait]
impl Intercept for Faults {
    async fn get(&self, store: &Arc<dyn Store>, key: &str) -> leasehold::Result<Option<Record>> {
        let fail = self.failing_reads.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if fail.is_ok() {
            return Err(leasehold::Error::not_sent("injected: the read failed"));
        }
        store.get(key).await
    }
    async fn update(&self, store: &Arc<dyn Store>, key: &str, c: &Condition, m: &Mutation) -> leasehold::Result<Write> {
        let act = {
            let mut rules = self.rules.lock().unwrap();
            let hit = rules.iter().position(|r| r(key, m).is_some());
            hit.map(|i| match rules[i](key, m).unwrap() {
                // A failing write fails every try.
                Act::Fail => Act::Fail,
                _ => rules.remove(i)(key, m).unwrap(),
            })
        };
        match act {
            None => store.update(key, c, m).await,
            Some(Act::LoseAnswer) => {
                store.update(key, c, m).await?;
                Err(leasehold::Error::StoreUnavailable("injected: the answer was lost".into()))
            }
            Some(Act::Fail) => Err(leasehold::Error::StoreUnavailable("injected: failed".into())),
            Some(Act::Delay(d)) => {
                tokio::time::sleep(d).await;
                store.update(key, c, m).await
            }
            Some(Act::ThenFailRead) => {
                let w = store.update(key, c, m).await;
                self.failing_reads.fetch_add(1, Ordering::SeqCst);
                w
            }
        }
    }
}

fn is_enqueue(m: &Mutation) -> bool {
    matches!(m, Mutation::Queue(QueueMutation::Enqueue { .. }))
}

/// A coordinator serving queues through `rec`, on `b`'s store behind [`Faults`].
fn faulty_coord(b: &Backend, rec: &Arc<Recorder>) -> (Arc<Wrapped<Faults>>, Coordinator) {
    let faults = Faults::new(b.store());
    let c = Coordinator::new(faults.clone(), test_config()).with_deliver(rec.clone() as Arc<dyn Deliver>);
    (faults, c)
}

fn puts_waiter(m: &Mutation, token: &str) -> bool {
    matches!(m, Mutation::Queue(QueueMutation::PutWaiter(r)) if r.queue.waiter.as_ref().is_some_and(|w| w.task_token == token))
}

/// An enqueue whose answer is lost is retried with the same lease_id and finds its own slot
/// (one slot, not two); a retried invocation (same lease_id, a new task token) too, and the
/// lease goes to the newer token. A release then serves the waiter at once.
async fn a_retried_enqueue_takes_one_slot(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let (faults, c) = faulty_coord(&b, &rec);
    let k = key("idempotent");
    let Enqueued::Granted(held) = enqueue(&c, &k, "t0", Duration::from_secs(30)).await else { panic!() };
    faults.once(|_, m| is_enqueue(m).then_some(Act::LoseAnswer));
    let id = LeaseId::generate();
    let opts = AcquireOptions { lease_id: Some(id.clone()), ..Default::default() };
    let out = c.acquire_or_enqueue(&k, "w", Duration::from_secs(30), opts.clone(), "w-first", None).await.unwrap();
    assert!(matches!(out, Enqueued::Queued { position: 1, .. }), "{out:?}");
    assert_eq!(c.get(&k).await.unwrap().queue_length, 1, "a lost answer's retry takes no second slot");
    let again = c.acquire_or_enqueue(&k, "w", Duration::from_secs(30), opts, "w-retry", None).await.unwrap();
    assert!(matches!(again, Enqueued::Queued { position: 1, .. }), "{again:?}");
    assert_eq!(c.get(&k).await.unwrap().queue_length, 1, "a retried invocation takes no second slot");
    c.release(&k, &held.lease_id).await.unwrap();
    assert_eq!(rec.tokens(), ["t0", "w-retry"], "served at once, to the newer task");
    assert_eq!(rec.last().lease_id, id);
}

/// A retried invocation whose first try's slot is no longer the queue's tail (another waiter
/// joined after it) still keeps that slot, ahead of the later waiter, and rewrites its item
/// with the new token within its retry budget (the rewrite's first answer is lost here), and
/// then reads the key within it too (that read's first try fails).
async fn a_retried_invocation_keeps_its_slot_ahead_of_later_waiters(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let (faults, c) = faulty_coord(&b, &rec);
    let k = key("resume");
    let Enqueued::Granted(held) = enqueue(&c, &k, "t0", Duration::from_secs(30)).await else { panic!() };
    let Enqueued::Queued { position: 1, .. } = enqueue(&c, &k, "v", Duration::from_secs(30)).await else { panic!() };
    let id = LeaseId::generate();
    let opts = AcquireOptions { lease_id: Some(id.clone()), ..Default::default() };
    let first = c.acquire_or_enqueue(&k, "w", Duration::from_secs(30), opts.clone(), "w-first", None).await.unwrap();
    let Enqueued::Queued { seq, position: 2, .. } = first else { panic!("{first:?}") };
    let later = enqueue(&c, &k, "x", Duration::from_secs(30)).await;
    assert!(matches!(later, Enqueued::Queued { position: 3, .. }), "{later:?}");
    faults.once(|_, m| puts_waiter(m, "w-retry").then_some(Act::LoseAnswer));
    faults.once(|_, m| puts_waiter(m, "w-retry").then_some(Act::ThenFailRead));
    let again = c.acquire_or_enqueue(&k, "w", Duration::from_secs(30), opts, "w-retry", None).await.unwrap();
    assert!(matches!(again, Enqueued::Queued { seq: s, position: 2, .. } if s == seq), "{again:?}");
    assert_eq!(c.get(&k).await.unwrap().queue_length, 3, "the retried invocation took no second slot");
    c.release(&k, &held.lease_id).await.unwrap();
    c.release(&k, &rec.last().lease_id).await.unwrap();
    assert_eq!(rec.tokens(), ["t0", "v", "w-retry"], "its own slot, ahead of x, to the newer task");
    assert_eq!(rec.last().lease_id, id);
    c.release(&k, &id).await.unwrap();
    assert_eq!(rec.tokens(), ["t0", "v", "w-retry", "x"]);
}

/// A new queue's counters start above the key's fence (the enqueue's condition). A lease
/// taken by a coordinator whose clock runs ahead carries a fence above this clock's
/// microseconds: the refused enqueue shows it, and the next starts above it; the waiter is
/// queued and served with a fence above the holder's. (2 s ahead: the lease's min_hold, its
/// take time by that clock, ends well within what the release waits for before it serves the
/// queue itself, `MIN_HOLD_WAIT_MS`.)
async fn a_new_queue_starts_above_a_fence_ahead_of_this_clock(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let c = coord(&b, &rec);
    let ahead = {
        let mut cfg = test_config();
        cfg.clock_offset_ms = 2_000;
        Coordinator::new(Counting::new(b.store()), cfg)
    };
    let k = key("fence-ahead");
    let held = ahead.acquire(&k, "ahead", Some(Duration::from_secs(30)), AcquireOptions::default()).await.unwrap();
    assert!(held.fence > c.now_us(), "the holder's fence is ahead of this clock");
    let out = enqueue(&c, &k, "w", Duration::from_secs(30)).await;
    assert!(matches!(out, Enqueued::Queued { position: 1, .. }), "{out:?}");
    // Released through the coordinator that serves the queue: the head waiter is handed it.
    c.release(&k, &held.lease_id).await.unwrap();
    assert_eq!(rec.tokens(), ["w"]);
    assert!(rec.last().fence > held.fence);
}

/// The key is released between the queued acquire's refused take and its enqueue: the
/// enqueue is refused (a free key without waiters is taken, not queued for), and the acquire
/// takes the key and delivers it at once.
async fn a_key_freed_while_joining_its_queue_is_taken(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let (faults, c) = faulty_coord(&b, &rec);
    let k = key("freed-joining");
    let held = c.acquire(&k, "h", Some(Duration::from_secs(30)), AcquireOptions::default()).await.unwrap();
    // The release comes 200 ms in, the enqueue lands 1.5 s in: long after, also on a loaded
    // machine.
    faults.once(|_, m| is_enqueue(m).then_some(Act::Delay(Duration::from_millis(1500))));
    let releaser = {
        let (c, k, id) = (c.clone(), k.clone(), held.lease_id.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            c.release(&k, &id).await.unwrap();
        })
    };
    let out = enqueue(&c, &k, "w", Duration::from_secs(30)).await;
    releaser.await.unwrap();
    assert!(matches!(out, Enqueued::Granted(_)), "{out:?}");
    assert_eq!(rec.tokens(), ["w"]);
    assert_eq!(c.get(&k).await.unwrap().queue_length, 0, "nobody queued");
}

/// A slot whose waiter item never came (its put failed) is skipped once ITS grace has passed,
/// however recently others joined after it; and a key whose only slot is missing is found by
/// the sweep (no waiter item exists to find it by) and freed for plain acquires.
async fn a_missing_slot_is_skipped_after_its_own_grace(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let (faults, c) = faulty_coord(&b, &rec);
    let (k, lonely) = (key("missing"), key("lonely"));
    let Enqueued::Granted(held) = enqueue(&c, &k, "t0", Duration::from_secs(60)).await else { panic!() };
    let short = Duration::from_millis(4000);
    let Enqueued::Granted(_) = enqueue(&c, &lonely, "l0", short).await else { panic!() };
    // Each failing put is retried for the retry budget (3 s) before its enqueue gives up.
    for (key, token) in [(&lonely, "l-dead"), (&k, "dead")] {
        faults.once(move |_, m| puts_waiter(m, token).then_some(Act::Fail));
        let out =
            c.acquire_or_enqueue(key, token, Duration::from_secs(30), AcquireOptions::default(), token, None).await;
        assert!(out.is_err(), "its put failed: {out:?}");
    }
    enqueue(&c, &k, "w2", Duration::from_secs(30)).await;
    let started = Instant::now();
    tokio::time::sleep(Duration::from_millis(leasehold::queue::ENQUEUE_GRACE_MS * 6 / 10)).await;
    // Another waiter joins late: the grace of the missing slot does not start again.
    enqueue(&c, &k, "w3", Duration::from_secs(30)).await;
    let left = Duration::from_millis(leasehold::queue::ENQUEUE_GRACE_MS + 200).saturating_sub(started.elapsed());
    tokio::time::sleep(left).await;
    c.release(&k, &held.lease_id).await.unwrap();
    assert!(rec.tokens().contains(&"w2".to_string()), "the missing slot was skipped: {:?}", rec.tokens());
    let plain = b.coordinator(test_config());
    let refused = plain.acquire(&lonely, "p", Some(Duration::from_secs(5)), AcquireOptions::default()).await;
    assert!(refused.is_err(), "a free key with a slot is the slot's");
    let report = c.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap();
    let st = c.get(&lonely).await.unwrap();
    assert!(!st.held && st.queue_length == 0, "the sweep skipped the missing slot: {st:?}");
    // Both keys read; the missing slot counted as skipped, and its key, idle, left the index
    // (the other still has a waiter).
    let counts = (report.keys, report.served.skipped, report.unindexed, report.errors);
    assert_eq!(counts, (2, 1, 1, 0), "{report:?}");
    plain.acquire(&lonely, "p", Some(Duration::from_secs(5)), AcquireOptions::default()).await.unwrap();
}

/// A slot whose waiter item is missing is not passed over within its grace (its enqueuer may be
/// between its two writes): neither the release nor the sweep after it serves the waiter behind
/// it yet, and the free key stays the queue's.
async fn a_missing_slot_is_waited_for_within_its_grace(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let (faults, c) = faulty_coord(&b, &rec);
    let k = key("in-grace");
    let Enqueued::Granted(held) = enqueue(&c, &k, "t0", Duration::from_secs(60)).await else { panic!() };
    faults.once(move |_, m| puts_waiter(m, "dead").then_some(Act::Fail));
    let out = c.acquire_or_enqueue(&k, "dead", Duration::from_secs(30), AcquireOptions::default(), "dead", None).await;
    assert!(out.is_err(), "its put failed: {out:?}");
    enqueue(&c, &k, "w2", Duration::from_secs(30)).await;
    // Seconds into the grace (10 s): the failing put was retried for the retry budget (3 s).
    c.release(&k, &held.lease_id).await.unwrap();
    let r = c.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert_eq!(rec.tokens(), ["t0"], "the waiter behind a slot in its grace waits");
    assert_eq!((r.keys, r.served.delivered, r.served.skipped, r.errors), (1, 0, 0, 0), "{r:?}");
    let st = c.get(&k).await.unwrap();
    assert!(!st.held && st.queue_length == 2, "{st:?}");
}

/// A release that handed the key over (to a queued waiter, or to an in-process waiter in the
/// release's own write) and is retried (a lost answer) answers `already_released` with the
/// released lease's fence, not `wrong_lease_id`.
async fn retried_release_after_a_hand_over_is_already_released(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let c = coord(&b, &rec);
    let k = key("retry-queued");
    let Enqueued::Granted(held) = enqueue(&c, &k, "t0", Duration::from_secs(30)).await else { panic!() };
    enqueue(&c, &k, "t1", Duration::from_secs(30)).await;
    let first = c.release(&k, &held.lease_id).await.unwrap();
    assert_eq!(rec.tokens(), ["t0", "t1"]);
    let retry = c.release(&k, &held.lease_id).await.unwrap();
    assert!(retry.already_released, "{retry:?}");
    assert_eq!((retry.fence, first.fence), (held.fence, held.fence));
    assert!(c.get(&k).await.unwrap().held, "the retry changed nothing");
    // The in-process hand-over (a coordinator without delivery, a waiting acquire).
    let mut config = test_config();
    config.poll_max = Duration::from_secs(20);
    let plain = b.coordinator(config);
    let k = key("retry-inproc");
    let held = plain.acquire(&k, "h0", Some(Duration::from_secs(30)), AcquireOptions::default()).await.unwrap();
    let (p, k2) = (plain.clone(), k.clone());
    let waiter = tokio::spawn(async move {
        let opts = AcquireOptions { wait: Some(Duration::from_secs(15)), ..Default::default() };
        p.acquire(&k2, "h1", Some(Duration::from_secs(30)), opts).await.unwrap()
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while !plain.head_waiter_offers(&k) {
        assert!(Instant::now() < deadline, "the waiter never settled");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    plain.release(&k, &held.lease_id).await.unwrap();
    let next = waiter.await.unwrap();
    let retry = plain.release(&k, &held.lease_id).await.unwrap();
    assert!(retry.already_released && retry.fence == held.fence, "{retry:?}");
    assert!(plain.heartbeat(&k, &next.lease_id, None).await.is_ok(), "the next holder keeps the key");
}

/// The release-and-grant write's answer is lost: the release's own retry recognises the grant
/// (it carries the releasing lease's id) and answers the release; the grant, marked
/// undelivered, is delivered by the sweep after the grace; nothing is granted twice.
async fn an_ambiguous_hand_over_is_recognised_by_its_retry(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let (faults, c) = faulty_coord(&b, &rec);
    let k = key("ambiguous-grant");
    let Enqueued::Granted(held) = enqueue(&c, &k, "t0", Duration::from_secs(30)).await else { panic!() };
    enqueue(&c, &k, "t1", Duration::from_secs(30)).await;
    enqueue(&c, &k, "t2", Duration::from_secs(30)).await;
    faults.once(|_, m| matches!(m, Mutation::Queue(QueueMutation::Grant { .. })).then_some(Act::LoseAnswer));
    let released = c.release(&k, &held.lease_id).await.expect("the retry finds the grant");
    assert!(!released.already_released);
    assert_eq!(released.fence, held.fence);
    let st = c.get(&k).await.unwrap();
    assert!(st.held && st.holder == "t1" && st.queue_length == 1, "granted once: {st:?}");
    tokio::time::sleep(Duration::from_millis(DELIVERY_GRACE_MS + 100)).await;
    c.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert_eq!(rec.tokens(), ["t0", "t1"], "delivered once");
    let retry = c.release(&k, &held.lease_id).await.unwrap();
    assert!(retry.already_released && retry.fence == held.fence, "{retry:?}");
}

/// A hand-over grant whose every delivery failed and whose lease expired before the sweep
/// came: its waiter is told (`SendTaskFailure`, `LeaseExpired`) instead of waiting until its
/// own timeout, and the next waiter is served.
async fn an_expired_undelivered_grant_is_ended_and_the_next_served(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let c = coord(&b, &rec);
    let k = key("expired-undelivered");
    let Enqueued::Granted(held) = enqueue(&c, &k, "t0", Duration::from_secs(30)).await else { panic!() };
    enqueue(&c, &k, "t1", Duration::from_millis(500)).await;
    enqueue(&c, &k, "t2", Duration::from_secs(30)).await;
    rec.transient.store(100, Ordering::SeqCst);
    c.release(&k, &held.lease_id).await.unwrap();
    rec.transient.store(0, Ordering::SeqCst);
    assert_eq!(rec.tokens(), ["t0"], "t1's grant was not delivered");
    tokio::time::sleep(Duration::from_millis(700)).await;
    // The first sweep cannot tell t1 (its failure notice fails): counted undelivered, and the
    // queue waits for the next sweep, which tells it (skipped) and serves t2.
    rec.failing.store(1, Ordering::SeqCst);
    let r = c.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap();
    let counts = |r: &leasehold::queue::QueueSweep| (r.served.undelivered, r.served.skipped, r.served.delivered);
    assert_eq!(counts(&r), (1, 0, 0), "{r:?}");
    assert!(rec.failed.lock().unwrap().is_empty() && rec.tokens() == ["t0"]);
    let r = c.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert_eq!(counts(&r), (0, 1, 1), "{r:?}");
    assert_eq!(*rec.failed.lock().unwrap(), [("t1".to_string(), "LeaseExpired".to_string())]);
    assert_eq!(rec.tokens(), ["t0", "t2"]);
    let st = c.get(&k).await.unwrap();
    assert!(st.held && st.holder == "t2", "{st:?}");
    // A queued acquire's grant of a free key, never delivered, expired: no plain acquire takes
    // the key over the mark (its waiter would never be told); the sweep tells it, then the key
    // is free for anyone.
    let k = key("expired-free-grant");
    rec.transient.store(100, Ordering::SeqCst);
    let out = enqueue(&c, &k, "f0", Duration::from_millis(500)).await;
    rec.transient.store(0, Ordering::SeqCst);
    assert!(matches!(out, Enqueued::Granted(_)), "{out:?}");
    tokio::time::sleep(Duration::from_millis(700)).await;
    let plain = b.coordinator(test_config());
    let taken = plain.acquire(&k, "p", Some(Duration::from_secs(5)), AcquireOptions::default()).await;
    assert!(matches!(taken, Err(leasehold::Error::LeaseHeld { .. })), "{taken:?}");
    c.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert!(rec.failed.lock().unwrap().iter().any(|(t, e)| t == "f0" && e == "LeaseExpired"));
    plain.acquire(&k, "p", Some(Duration::from_secs(5)), AcquireOptions::default()).await.unwrap();
}

/// A release whose min_hold is still running leaves the key blocked until it ends: the release
/// (a short min_hold) waits for it and hands the key to the queued waiter, without the sweep.
async fn min_hold_end_serves_the_queue(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let c = coord(&b, &rec);
    let k = key("min-hold");
    let opts = AcquireOptions { min_hold: Some(Duration::from_millis(1500)), ..Default::default() };
    let held = c.acquire(&k, "h", Some(Duration::from_secs(30)), opts).await.unwrap();
    enqueue(&c, &k, "t1", Duration::from_secs(30)).await;
    c.release(&k, &held.lease_id).await.unwrap();
    assert_eq!(rec.tokens(), ["t1"], "served when the min_hold ended");
    let st = c.get(&k).await.unwrap();
    assert!(st.held && st.holder == "t1" && st.acquired_at_ms >= held.min_hold_until_ms, "{st:?}");
}

/// A release whose min_hold ends later than `MIN_HOLD_WAIT_MS` does not wait for it (the
/// release would take as long as the min_hold): it answers at once, the key stays blocked, and
/// the sweep serves the waiter once the min_hold has ended.
async fn a_long_min_hold_is_left_to_the_sweep(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let c = coord(&b, &rec);
    let k = key("long-min-hold");
    let opts = AcquireOptions { min_hold: Some(Duration::from_secs(60)), ..Default::default() };
    let held = c.acquire(&k, "h", Some(Duration::from_secs(90)), opts).await.unwrap();
    enqueue(&c, &k, "t1", Duration::from_secs(30)).await;
    let t = Instant::now();
    c.release(&k, &held.lease_id).await.unwrap();
    assert!(t.elapsed() < Duration::from_secs(20), "the release waited {:?} for the min_hold", t.elapsed());
    assert!(rec.tokens().is_empty(), "nobody was served before the min_hold ended: {:?}", rec.tokens());
    let st = c.get(&k).await.unwrap();
    assert!(st.held && st.fence == held.fence, "{st:?}");
}

/// A release of a key without waiters, by a coordinator that serves queues, is its one write:
/// no read of a queue that is not there.
async fn a_release_without_waiters_reads_nothing(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let counting = Counting::new(b.store());
    let c = Coordinator::new(counting.clone(), test_config()).with_deliver(rec.clone() as Arc<dyn Deliver>);
    let k = key("no-waiters");
    let held = c.acquire(&k, "h", Some(Duration::from_secs(30)), AcquireOptions::default()).await.unwrap();
    let (gets, updates) = (counting.gets.load(Ordering::SeqCst), counting.updates.load(Ordering::SeqCst));
    c.release(&k, &held.lease_id).await.unwrap();
    assert_eq!(counting.updates.load(Ordering::SeqCst) - updates, 1, "one write");
    assert_eq!(counting.gets.load(Ordering::SeqCst) - gets, 0, "no read after the release");
    assert!(!c.get(&k).await.unwrap().held);
}

/// A revoked grant (its waiter is gone) on a key in a work state writes no TTL: a key in a
/// state is kept until it is taken.
async fn revoke_keeps_a_work_state_without_ttl(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let c = coord(&b, &rec);
    let k = key("revoke-state");
    c.put(&k, "PENDING", "producer").await.unwrap();
    let Enqueued::Granted(held) = enqueue(&c, &k, "t0", Duration::from_secs(30)).await else { panic!() };
    enqueue(&c, &k, "gone", Duration::from_secs(30)).await;
    rec.gone.lock().unwrap().insert("gone".into());
    c.release(&k, &held.lease_id).await.unwrap();
    let item = b.store().get(&k).await.unwrap().unwrap();
    assert!(item.released_at_ms.is_some() && item.queue.pending_token.is_none(), "revoked: {item:?}");
    assert_eq!(item.work.state.as_deref(), Some("PENDING"));
    assert_eq!(item.ttl, None, "no TTL on a key in a state: {item:?}");
}

/// The TTL removal that follows a heartbeat on a key in a work state is not on the renewal's
/// answer path: a slow one does not hold the renewal back (which could make a landed renewal
/// come back after the holder's safe time).
async fn heartbeat_answers_without_waiting_for_the_ttl_removal(b: Backend) {
    let faults = Faults::new(b.store());
    let c = Coordinator::new(faults.clone(), test_config());
    let k = key("hb-state");
    c.put(&k, "PENDING", "producer").await.unwrap();
    let lease = c.acquire(&k, "h", Some(Duration::from_secs(30)), AcquireOptions::default()).await.unwrap();
    faults.once(|_, m| {
        matches!(m, Mutation::Work(WorkMutation::ClearTtl)).then_some(Act::Delay(Duration::from_secs(20)))
    });
    // A renewal lands only with a later clock reading than the grant's: one in the grant's own
    // millisecond (a fast embedded store) leaves the expiry as it was.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let sent = Instant::now();
    let renewed = c.heartbeat(&k, &lease.lease_id, None).await.unwrap();
    assert!(sent.elapsed() < Duration::from_secs(15), "the renewal waited for the TTL removal: {:?}", sent.elapsed());
    assert!(renewed.expires_at_ms > lease.expires_at_ms);
}

/// Records which queue shards a sweep reads, in order, and how many entries come back.
struct ScanLog {
    shards: Mutex<Vec<u32>>,
    entries: AtomicUsize,
}

#[async_trait]
impl Intercept for ScanLog {
    async fn scan(&self, store: &Arc<dyn Store>, k: &ScanKind, s: Option<&str>, l: u32) -> leasehold::Result<Page> {
        let page = store.scan(k, s, l).await?;
        if let ScanKind::Queue { shard } | ScanKind::Keepalive { shard, .. } = k {
            self.shards.lock().unwrap().push(*shard);
            self.entries.fetch_add(page.items.len(), Ordering::SeqCst);
        }
        Ok(page)
    }
}

/// The queue sweep reads one index entry per key with waiters, however many waiters it has
/// (200 here), one page per shard, from a start shard that moves on from run to run; a key
/// whose queue emptied leaves the index.
async fn sweep_reads_one_entry_per_key_and_rotates(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let log = wrap(b.store(), ScanLog { shards: Mutex::new(Vec::new()), entries: AtomicUsize::new(0) });
    let c = Coordinator::new(log.clone(), test_config()).with_deliver(rec.clone() as Arc<dyn Deliver>);
    let k = key("sweep-index");
    let Enqueued::Granted(held) = enqueue(&c, &k, "t0", Duration::from_secs(60)).await else { panic!() };
    for i in 0..200 {
        enqueue(&c, &k, &format!("w{i}"), Duration::from_secs(60)).await;
    }
    log.shards.lock().unwrap().clear();
    log.entries.store(0, Ordering::SeqCst);
    let first = c.sweep_queues(Instant::now() + Duration::from_secs(30)).await.unwrap();
    assert!(first.complete, "{first:?}");
    let shards = log.shards.lock().unwrap().clone();
    assert_eq!(shards.len(), 8, "one page per shard: {shards:?}");
    let entries = log.entries.load(Ordering::SeqCst);
    assert_eq!(entries, 1, "one entry per key, not per waiter");
    // Consecutive runs start at consecutive shards (other tests' sweeps in this process move
    // the start too, so three runs may not all start at the same one).
    let mut starts = vec![shards[0]];
    for _ in 0..2 {
        log.shards.lock().unwrap().clear();
        c.sweep_queues(Instant::now() + Duration::from_secs(30)).await.unwrap();
        starts.push(log.shards.lock().unwrap()[0]);
    }
    assert!(starts.iter().any(|s| *s != starts[0]), "the start shard rotates: {starts:?}");
    // Drain the queue: the key leaves the index.
    let mut id = held.lease_id;
    for _ in 0..200 {
        c.release(&k, &id).await.unwrap();
        id = rec.last().lease_id;
    }
    c.release(&k, &id).await.unwrap();
    c.sweep_queues(Instant::now() + Duration::from_secs(30)).await.unwrap();
    let shard = leasehold::queue::queue_shard(&k);
    let page = b.store().scan(&ScanKind::Queue { shard }, None, 1000).await.unwrap();
    assert!(page.items.iter().all(|r| r.key != k), "an idle key leaves the queue index");
}

/// A key the sweep cannot serve (its grant's write failing every try) is counted as an error
/// and stays in the index; the next run serves it and takes it out.
async fn a_key_the_sweep_cannot_serve_is_counted_and_kept(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let (faults, c) = faulty_coord(&b, &rec);
    let k = key("unserved");
    // 3 s: the next waiter is queued behind a live grant even on a loaded machine (at 1 s the
    // grant could expire first, and the waiter take the key itself).
    let Enqueued::Granted(crashed) = enqueue(&c, &k, "crashed", Duration::from_millis(3000)).await else { panic!() };
    let next = enqueue(&c, &k, "next", Duration::from_secs(30)).await;
    assert!(matches!(next, Enqueued::Queued { .. }), "{next:?}");
    let left = crashed.expires_at_ms.unwrap().saturating_sub(c.now_ms());
    tokio::time::sleep(Duration::from_millis(left + 100)).await;
    let failing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let f = failing.clone();
    faults.once(move |_, m| {
        (f.load(Ordering::SeqCst) && matches!(m, Mutation::Queue(QueueMutation::Grant { .. }))).then_some(Act::Fail)
    });
    let r = c.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert_eq!((r.keys, r.errors, r.served.delivered, r.unindexed), (1, 1, 0, 0), "{r:?}");
    assert_eq!(rec.tokens(), ["crashed"]);
    failing.store(false, Ordering::SeqCst);
    let r = c.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert_eq!((r.keys, r.errors, r.served.delivered, r.unindexed), (1, 0, 1, 1), "{r:?}");
    assert_eq!(rec.tokens(), ["crashed", "next"]);
}

/// Fails every read of an index page.
struct FailedScans;

#[async_trait]
impl Intercept for FailedScans {
    async fn scan(&self, _: &Arc<dyn Store>, _: &ScanKind, _: Option<&str>, _: u32) -> leasehold::Result<Page> {
        Err(leasehold::Error::StoreUnavailable("injected: the page was not read".into()))
    }
}

/// An index page the sweep cannot read is counted as an error, once per shard, and the run is
/// reported incomplete; the sweep itself answers (the next run reads the index again).
async fn an_index_page_the_sweep_cannot_read_is_counted(b: Backend) {
    let rec = Arc::new(Recorder::default());
    let k = key("unread");
    let c = coord(&b, &rec);
    enqueue(&c, &k, "t0", Duration::from_secs(30)).await;
    enqueue(&c, &k, "t1", Duration::from_secs(30)).await;
    let blind = Coordinator::new(wrap(b.store(), FailedScans), test_config()).with_deliver(rec.clone());
    let r = blind.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert_eq!((r.keys, r.errors, r.complete), (0, leasehold::store::QUEUE_SHARDS, false), "{r:?}");
    let r = c.sweep_queues(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert_eq!((r.keys, r.errors, r.complete), (1, 0, true), "{r:?}");
}
