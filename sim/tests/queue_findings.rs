//! Waiter-queue defects reproduced on the simulated store (`leasehold::testing`), each
//! deterministic for its seed: a current-thread runtime with paused time, `SimStore` and
//! `SimClock`. The same defects on both real stores: `tests/tests/protocol_findings.rs`.

use leasehold::store::QueueMutation;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use leasehold::queue::{Deliver, DeliveryError, Enqueued};
use leasehold::store::Mutation;
use leasehold::testing::{Faults, SimClock, SimStore};
use leasehold::{AcquireOptions, Clock, Config, Coordinator, Error, Lease, LeaseId};

const EPOCH_MS: i64 = 1_800_000_000_000;

/// Step Functions as the queue sees it: a delivery takes `latency`; a token in `dead` (an
/// attempt whose invocation failed) answers `Gone`, as does a token whose task already has its
/// output (`TaskTimedOut`); every other delivery lands. With `step_on_failure`, the clock given
/// is stepped by that much (ms) while a `SendTaskFailure` is under way.
#[derive(Default)]
struct Sfn {
    latency: Duration,
    dead: Mutex<BTreeSet<String>>,
    transient: Mutex<bool>,
    delivered: Mutex<Vec<(String, Lease)>>,
    failed: Mutex<Vec<(String, String)>>,
    step_on_failure: Mutex<Option<(Arc<SimClock>, i64)>>,
}

#[async_trait]
impl Deliver for Sfn {
    async fn success(&self, token: &str, lease: &Lease) -> Result<(), DeliveryError> {
        tokio::time::sleep(self.latency).await;
        if *self.transient.lock().unwrap() {
            return Err(DeliveryError::Transient("ThrottlingException".into()));
        }
        if self.dead.lock().unwrap().contains(token) {
            return Err(DeliveryError::Gone("TaskTimedOut".into()));
        }
        let mut delivered = self.delivered.lock().unwrap();
        if delivered.iter().any(|(t, _)| t == token) {
            return Err(DeliveryError::Gone("TaskTimedOut".into()));
        }
        delivered.push((token.to_string(), lease.clone()));
        Ok(())
    }

    async fn failure(&self, token: &str, error: &str, _: &str) -> Result<(), DeliveryError> {
        tokio::time::sleep(self.latency / 2).await;
        if let Some((clock, by)) = self.step_on_failure.lock().unwrap().take() {
            clock.step(by);
        }
        tokio::time::sleep(self.latency / 2).await;
        self.failed.lock().unwrap().push((token.to_string(), error.to_string()));
        if self.dead.lock().unwrap().contains(token) {
            return Err(DeliveryError::Gone("TaskTimedOut".into()));
        }
        Ok(())
    }
}

/// What one race of a retried invocation against the hand-over of its slot ended with.
#[derive(Debug)]
struct Race {
    /// The retried invocation's answer.
    answer: Result<Enqueued, Error>,
    /// Deliveries to the retried invocation's token (each a lease that landed).
    to_retry: Vec<Lease>,
    /// Fences of the grants revoked.
    revoked: Vec<u64>,
}

/// One race, `offset_ms` apart: the holder's release hands slot `seq` over (reading its waiter
/// item, granting it, delivering it to the first attempt's token, dead: `Gone`), while the
/// retried invocation of that waiter's task (same lease_id, a new token) writes the slot's
/// waiter item again with its own token. Then the queue sweep runs past every grace.
async fn race(seed: u64, offset_ms: i64) -> Race {
    leasehold::testing::seed(seed);
    let truth = Arc::new(SimClock::new(EPOCH_MS));
    let store = SimStore::new(truth.clone(), Faults::none(), seed);
    let sfn = Arc::new(Sfn { latency: Duration::from_millis(20), ..Default::default() });
    let coordinator = || {
        Coordinator::new(Arc::new(store.handle()), Config { clock: truth.clone(), ..Config::default() })
            .with_deliver(sfn.clone())
    };
    let (functions, retry_fn) = (coordinator(), coordinator());
    let k = "race";
    let d = Duration::from_secs(30);
    let held = functions.acquire(k, "holder", Some(d), AcquireOptions::default()).await.unwrap();
    let id = LeaseId::from_string(format!("exec-{seed}-{offset_ms}"));
    let mine = AcquireOptions { lease_id: Some(id.clone()), ..Default::default() };
    let first = functions.acquire_or_enqueue(k, "exec", d, mine.clone(), "token-1", None).await.unwrap();
    assert!(matches!(first, Enqueued::Queued { position: 1, .. }), "{first:?}");
    // The first attempt's invocation failed: its token is dead, and Step Functions retries it.
    sfn.dead.lock().unwrap().insert("token-1".into());
    let _ = store.take_log();
    // The release starts `offset_ms` after the retry when positive, before it when negative.
    let release = {
        let (c, lease_id) = (functions.clone(), held.lease_id.clone());
        let after = Duration::from_millis(offset_ms.max(0) as u64);
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            c.release(k, &lease_id).await
        })
    };
    tokio::time::sleep(Duration::from_millis(offset_ms.min(0).unsigned_abs())).await;
    let answer = retry_fn.acquire_or_enqueue(k, "exec", d, mine, "token-2", None).await;
    release.await.unwrap().unwrap();
    // Every grace passes; the queue sweep runs (a grant left marked is delivered again).
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_secs(6)).await;
        functions.sweep_queues(truth.now() + Duration::from_secs(2)).await.unwrap();
    }
    let to_retry =
        sfn.delivered.lock().unwrap().iter().filter(|(t, _)| t == "token-2").map(|(_, l)| l.clone()).collect();
    let revoked = store
        .take_log()
        .into_iter()
        .filter(|a| a.key == k && matches!(a.mutation, Some(Mutation::Queue(QueueMutation::Revoke { .. }))))
        .filter_map(|a| a.old.map(|o| o.fence))
        .collect();
    leasehold::testing::unseed();
    Race { answer, to_retry, revoked }
}

/// `waiter_lost` through a rewrite (seeds 1 to 10, the retry and the release started -40 to
/// 40 ms apart). A queued acquire's invocation fails after its waiter item landed, and Step
/// Functions retries it with the same lease_id and a new task token; the retry finds its slot's
/// waiter item and writes it again with its token, while the holder's release hands that slot
/// over from the item as it was: the grant went to the dead token, whose delivery answered
/// `Gone`, and was revoked. The retry answered `Queued` and its execution waited, unserved,
/// until its queue timeout (124 of these 810 races; 7 with the retry's read of the key after its
/// rewrite, and none with the deliverer's read of the waiter item alone, whose counterpart is
/// `a_slot_rewritten_after_its_grant_was_judged_gone_is_told_not_holder`).
///
/// Whatever the interleaving, the retried invocation's task must end its wait: the lease is
/// delivered to its token exactly once (and that grant is never revoked), or the invocation
/// answers an error at once (its slot's grant was revoked before it could take it over).
#[tokio::test(start_paused = true)]
async fn a_retried_invocation_rewriting_its_slot_during_its_hand_over_is_served_or_told() {
    let (mut outcomes, mut lost) = (BTreeMap::<&str, u32>::new(), Vec::new());
    for offset in -40..=40 {
        for seed in 1..=10 {
            let r = race(seed, offset).await;
            let what = match (&r.answer, r.to_retry.as_slice()) {
                (_, [lease]) if r.revoked.contains(&lease.fence) => {
                    panic!("seed {seed} offset {offset}: the lease delivered to the live token was revoked: {r:?}")
                }
                (_, [_]) => "delivered",
                (Err(Error::NotHolder { .. }), []) => "told NotHolder",
                _ => {
                    lost.push(format!(
                        "seed {seed} offset {offset}: {:?}, {} deliveries, revoked {:?}",
                        r.answer,
                        r.to_retry.len(),
                        r.revoked
                    ));
                    "lost"
                }
            };
            *outcomes.entry(what).or_default() += 1;
        }
    }
    assert!(lost.is_empty(), "the retried invocation's execution waits unserved ({outcomes:?}):\n{}", lost.join("\n"));
    // The range covers the retry running after the revoke, during the hand-over, and before it.
    assert!(outcomes.contains_key("delivered") && outcomes.contains_key("told NotHolder"), "{outcomes:?}");
}

/// `end_undelivered`'s stamp under a clock step (seed 5 here). A queue grant whose every
/// delivery failed expired; serving the key tells its waiter (`SendTaskFailure`, `LeaseExpired`)
/// and removes the undelivered mark, stamping `freed_at_ms` with the writer's clock. The clock
/// was stepped 60 s back during the `SendTaskFailure`, and the stamp was written with it
/// unchecked: the key's freeing dated 60 s early, so that a fail-closed acquire sent in that
/// minute (and held in the network) may take the key. The clock must be checked right before it
/// is read for the write: refused (`ClockSkew`), the mark stays, and it goes later with a clock
/// that passes the check.
#[tokio::test(start_paused = true)]
async fn an_expired_grant_s_mark_is_not_stamped_with_a_clock_stepped_during_its_failure() {
    let seed = 5;
    leasehold::testing::seed(seed);
    let truth = Arc::new(SimClock::new(EPOCH_MS));
    let store = SimStore::new(truth.clone(), Faults::none(), seed);
    let clock = Arc::new(SimClock::offset_from(&truth, 0));
    let sfn = Arc::new(Sfn { latency: Duration::from_millis(20), ..Default::default() });
    let c = Coordinator::new(Arc::new(store.handle()), Config { clock: clock.clone(), ..Config::default() })
        .with_deliver(sfn.clone());
    let k = "expired-grant";
    let held = c.acquire(k, "holder", Some(Duration::from_secs(30)), AcquireOptions::default()).await.unwrap();
    let q = c.acquire_or_enqueue(k, "w", Duration::from_secs(2), AcquireOptions::default(), "token-w", None).await;
    assert!(matches!(q, Ok(Enqueued::Queued { .. })), "{q:?}");
    // Every delivery of the hand-over's grant fails: it stays marked, and expires.
    *sfn.transient.lock().unwrap() = true;
    c.release(k, &held.lease_id).await.unwrap();
    let item = store.peek(k).unwrap();
    assert_eq!(item.queue.pending_token.as_deref(), Some("token-w"), "{item:?}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Serving the key tells the waiter; the clock is stepped 60 s back meanwhile.
    *sfn.step_on_failure.lock().unwrap() = Some((clock.clone(), -60_000));
    let before = truth.wall_ms() as u64;
    let served = c.serve_queue(k).await;
    assert_eq!(sfn.failed.lock().unwrap().len(), 1, "the waiter was told");
    let item = store.peek(k).unwrap();
    assert!(
        item.queue.freed_at_ms.is_none_or(|f| f >= before),
        "the key's freeing was stamped {} ms before it happened ({served:?})",
        before - item.queue.freed_at_ms.unwrap()
    );
    assert!(matches!(served, Err(Error::ClockSkew(_))), "{served:?}");
    assert!(item.queue.pending_token.is_some(), "the mark stays for a clock that passes the check: {item:?}");
    // NTP steps the clock back; the key is served again, the mark goes with a true stamp.
    clock.step(60_000);
    let before = truth.wall_ms() as u64;
    c.serve_queue(k).await.unwrap();
    let item = store.peek(k).unwrap();
    assert!(item.queue.pending_token.is_none() && item.queue.freed_at_ms.is_some_and(|f| f >= before), "{item:?}");
    leasehold::testing::unseed();
}
