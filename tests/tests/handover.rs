//! The in-process hand-over under cancellation (DESIGN.md, "In-process waiters" and
//! "Cancellation"): an acquire dropped at any await point (a caller's timeout, a disconnected
//! HTTP client, a deadline) leaves no lease behind, and a hand-over never grants a lease_id
//! twice nor lands for a waiter that answered. Every case runs on both stores.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use leasehold::store::{Condition, Mutation, QueueCondition, QueueMutation, Store, Write};
use leasehold::{AcquireOptions, Coordinator, Error, LeaseId, NotHolderReason};
use leasehold_tests::{both_backends, test_config, wrap, Backend, Fault, Faulty, Intercept};

both_backends!(
    a_waiter_dropped_while_its_grant_is_written_leaves_the_key_free,
    a_grant_never_read_by_a_dropped_waiter_is_released,
    acquires_cut_at_any_point_strand_no_lease,
    a_hand_over_never_grants_a_lease_id_twice,
    an_ambiguous_hand_over_that_lands_late_is_settled_by_the_release,
    a_waiter_elsewhere_is_not_passed_over_by_the_line_s_own_waiters,
    a_mark_landing_before_the_hand_over_s_write_leaves_the_key_free,
    a_callers_lease_id_sent_again_after_a_dropped_acquire_keeps_its_lease,
    a_mark_that_did_not_land_is_written_again_at_the_next_refusal,
);

const LONG: Option<Duration> = Some(Duration::from_secs(30));

fn waiting(wait: Duration) -> AcquireOptions {
    AcquireOptions { wait: Some(wait), ..Default::default() }
}

/// A coordinator whose waiters never poll during the test: every hand-over is a wake-up.
fn quiet(store: Arc<dyn Store>) -> Coordinator {
    let mut config = test_config();
    config.poll_max = Duration::from_secs(20);
    Coordinator::new(store, config)
}

async fn until(limit: Duration, what: &str, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !f().await {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn head_offers(c: &Coordinator, k: &str) {
    until(Duration::from_secs(10), "the head waiter settles, offering its lease", async || c.head_waiter_offers(k))
        .await;
}

/// The key is free (nobody's lease on it), soon: nothing was stranded.
async fn free_soon(c: &Coordinator, k: &str, what: &str) {
    until(Duration::from_secs(10), what, async || match c.get(k).await {
        Ok(s) => !s.held,
        Err(Error::NotFound { .. }) => true,
        Err(e) => panic!("{e}"),
    })
    .await;
}

/// The waiter's acquire is dropped while a release writes its grant (`Claimed`): the release
/// gives the grant back before it answers, and the key is free for anybody at once.
async fn a_waiter_dropped_while_its_grant_is_written_leaves_the_key_free(b: Backend) {
    // The hand-over's write lands at once but answers 1.5 s later; the waiter's own polls pass
    // untouched.
    let faulty = Faulty::on(b.store(), |c| matches!(c, Condition::Queue(QueueCondition::HandTo { .. })));
    let c = quiet(faulty.clone());
    // The head withdraws its offer while it polls (an attempt of its own); a release in that
    // window hands nothing over and tests nothing here. Such a round is run again on a new key.
    for round in 0.. {
        assert!(round < 5, "the release never found the head waiter offering in 5 rounds");
        let k: &'static str = Box::leak(format!("claimed{round}").into_boxed_str());
        let h = c.acquire(k, "h", LONG, AcquireOptions::default()).await.unwrap();
        let c2 = c.clone();
        let waiter = tokio::spawn(async move { c2.acquire(k, "w", LONG, waiting(Duration::from_secs(20))).await });
        head_offers(&c, k).await;
        faulty.inject(&[Fault::SlowAnswer(Duration::from_millis(1500))]);
        let c3 = c.clone();
        let id = h.lease_id.clone();
        let release = tokio::spawn(async move { c3.release(k, &id).await });
        // The waiter is claimed throughout the hand-over, and leaves (its task aborted) in the
        // middle.
        tokio::time::sleep(Duration::from_millis(500)).await;
        waiter.abort();
        let left = waiter.await;
        let released = release.await.unwrap().unwrap();
        assert!(!released.already_released);
        if faulty.injected.load(Ordering::SeqCst) == 0 {
            // No hand-over was written: the waiter was polling when the release came.
            faulty.plan.lock().unwrap().clear();
            if let Ok(Ok(l)) = left {
                c.release(k, &l.lease_id).await.unwrap();
            }
            continue;
        }
        assert!(left.unwrap_err().is_cancelled(), "the waiter was claimed until it left");
        let s = c.get(k).await.unwrap();
        assert!(!s.held, "the grant of a waiter that left is given back by the release: {s:?}");
        c.acquire(k, "next", LONG, AcquireOptions::default()).await.expect("free for anybody at once");
        return;
    }
}

/// The release's write granted the sleeping waiter, and the waiter's acquire is dropped before
/// it is polled again (`Granted`, never read): the grant is released.
async fn a_grant_never_read_by_a_dropped_waiter_is_released(b: Backend) {
    let c = quiet(b.store());
    let k = "unread";
    let h = c.acquire(k, "h", LONG, AcquireOptions::default()).await.unwrap();
    // Driven by this task only: once it sleeps offering, it is not polled again.
    let mut waiter = Box::pin(c.acquire(k, "w", LONG, waiting(Duration::from_secs(20))));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !c.head_waiter_offers(k) {
        assert!(Instant::now() < deadline, "the waiter never settled");
        tokio::select! {
            biased;
            r = &mut waiter => panic!("the waiter answered while the key was held: {r:?}"),
            _ = tokio::time::sleep(Duration::from_millis(10)) => {}
        }
    }
    c.release(k, &h.lease_id).await.unwrap();
    assert_eq!(c.get(k).await.unwrap().holder, "w", "the release granted the waiter in its own write");
    drop(waiter);
    free_soon(&c, k, "the unread grant of a dropped waiter is released").await;
    c.acquire(k, "next", LONG, AcquireOptions::default()).await.expect("free for anybody");
}

/// Acquires dropped after many different delays (inside their first write, while they wait,
/// while a release hands them the key, just after): whatever they got is released, and no
/// lease is left on the key.
async fn acquires_cut_at_any_point_strand_no_lease(b: Backend) {
    let c = quiet(b.store());
    // A free key, acquires cut within their first request.
    for (i, cut_us) in (0..3000).step_by(150).enumerate() {
        let k = format!("free{i}");
        let got =
            tokio::time::timeout(Duration::from_micros(cut_us), c.acquire(&k, "cut", LONG, AcquireOptions::default()))
                .await;
        if let Ok(lease) = got {
            c.release(&k, &lease.unwrap().lease_id).await.unwrap();
        }
        free_soon(&c, &k, &format!("an acquire cut after {cut_us} µs")).await;
    }
    // A held key, released 40 ms into the wait: waiters cut before, around and after it.
    for cut_ms in [1u64, 5, 15, 30, 38, 40, 41, 42, 44, 47, 50, 60, 80, 120] {
        let k = format!("held{cut_ms}");
        let h = c.acquire(&k, "h", LONG, AcquireOptions::default()).await.unwrap();
        let (c2, k2) = (c.clone(), k.clone());
        let release = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(40)).await;
            c2.release(&k2, &h.lease_id).await.unwrap();
        });
        let got = tokio::time::timeout(
            Duration::from_millis(cut_ms),
            c.acquire(&k, "w", LONG, waiting(Duration::from_secs(20))),
        )
        .await;
        release.await.unwrap();
        if let Ok(lease) = got {
            c.release(&k, &lease.unwrap().lease_id).await.unwrap();
        }
        free_soon(&c, &k, &format!("a waiter cut after {cut_ms} ms")).await;
    }
}

/// Two waiters of one coordinator with one caller lease_id: the first gets the key; its
/// release must not hand the same lease_id to the second (a lease_id is single-use).
async fn a_hand_over_never_grants_a_lease_id_twice(b: Backend) {
    let c = quiet(b.store());
    let k = "twice";
    let h = c.acquire(k, "h", LONG, AcquireOptions::default()).await.unwrap();
    let id = LeaseId::generate();
    let opts = AcquireOptions { wait: Some(Duration::from_secs(15)), lease_id: Some(id.clone()), ..Default::default() };
    let (c1, o1) = (c.clone(), opts.clone());
    let first = tokio::spawn(async move {
        let l = c1.acquire(k, "w1", LONG, o1).await.unwrap();
        c1.release(k, &l.lease_id).await.unwrap();
        l
    });
    until(Duration::from_secs(10), "the first waiter lines up", async || c.waiting(k) == 1).await;
    let c2 = c.clone();
    let second = tokio::spawn(async move { c2.acquire(k, "w2", LONG, opts).await });
    until(Duration::from_secs(10), "the second waiter lines up", async || c.waiting(k) == 2).await;
    head_offers(&c, k).await;
    c.release(k, &h.lease_id).await.unwrap();
    let l = first.await.unwrap();
    assert_eq!(l.lease_id, id);
    // The release that granted the first waiter leaves the second (same lease_id) to try by
    // itself. Trying before the first waiter's release lands, it finds that lease live under its
    // own id and is answered with it (a caller's lease_id names one lease: a second acquire with
    // it is a retry of the first); trying after, it finds the lease released and is refused.
    // Never a new grant under the id.
    match second.await.unwrap() {
        Err(Error::NotHolder { reason: NotHolderReason::Released, .. }) => {}
        Ok(same) if same.fence == l.fence && same.acquired_at_ms == l.acquired_at_ms => {}
        other => panic!("the released lease_id was granted again or refused wrongly: {other:?}"),
    }
    let s = c.get(k).await.unwrap();
    assert!(!s.held && s.holder == "w1", "{s:?}");
}

/// A store that holds back the in-process hand-over's write (`HandTo`), answers it with an
/// ambiguous error, and lets it land just before the next write (a request stuck in the
/// network that arrives late).
struct LateHandTo {
    armed: AtomicBool,
    held: Mutex<Option<(String, Condition, Mutation)>>,
}

#[async_trait]
impl Intercept for LateHandTo {
    async fn update(&self, store: &Arc<dyn Store>, key: &str, c: &Condition, m: &Mutation) -> leasehold::Result<Write> {
        if matches!(c, Condition::Queue(QueueCondition::HandTo { .. })) && self.armed.swap(false, Ordering::SeqCst) {
            *self.held.lock().unwrap() = Some((key.to_string(), c.clone(), m.clone()));
            return Err(Error::StoreUnavailable("injected: the hand-over is stuck in the network".into()));
        }
        let late = self.held.lock().unwrap().take();
        if let Some((k, c, m)) = late {
            store.update(&k, &c, &m).await?;
        }
        store.update(key, c, m).await
    }
}

/// The hand-over's write fails ambiguously and lands later, before the ordinary release that
/// follows it: the release answers as done (not `wrong_lease_id`), and the waiter, which
/// waited for the outcome, holds the key.
async fn an_ambiguous_hand_over_that_lands_late_is_settled_by_the_release(b: Backend) {
    let store = wrap(b.store(), LateHandTo { armed: AtomicBool::new(false), held: Mutex::new(None) });
    let c = quiet(store.clone());
    // The head withdraws its offer while it polls (an attempt of its own); a release in that
    // window hands nothing over and tests nothing here. Such a round is run again on a new key.
    for round in 0.. {
        assert!(round < 5, "the release never found the head waiter offering in 5 rounds");
        let k: &'static str = Box::leak(format!("late{round}").into_boxed_str());
        let h = c.acquire(k, "h", LONG, AcquireOptions::default()).await.unwrap();
        let c2 = c.clone();
        let waiter = tokio::spawn(async move { c2.acquire(k, "w", LONG, waiting(Duration::from_secs(20))).await });
        head_offers(&c, k).await;
        store.armed.store(true, Ordering::SeqCst);
        let released = c.release(k, &h.lease_id).await.expect("the release is done, whichever write landed");
        assert!(!released.already_released);
        let w = waiter.await.unwrap().expect("the waiter holds the key");
        if store.armed.swap(false, Ordering::SeqCst) {
            // No hand-over was written: the waiter took the freed key by itself.
            c.release(k, &w.lease_id).await.unwrap();
            continue;
        }
        let s = c.get(k).await.unwrap();
        assert!(s.held && s.holder == "w" && s.fence == w.fence, "{s:?} / {w:?}");
        c.release(k, &w.lease_id).await.unwrap();
        free_soon(&c, k, "released by its holder").await;
        return;
    }
}

/// A coordinator whose waiters pause at most 1.5 x `poll_max` between polls, and hold back
/// 3 x `poll_max` for a waiter of another process.
fn polling_every(store: Arc<dyn Store>, poll_max: Duration) -> Coordinator {
    let mut config = test_config();
    config.poll_max = poll_max;
    Coordinator::new(store, config)
}

/// Fairness across processes (DESIGN.md, "In-process waiters"): a waiter of coordinator W marks
/// the lease that coordinator X's line handed over; X's next waiter in line, polling meanwhile,
/// must not undo the mark (when the mark was written over `handed_in`, it took it for a
/// hand-over elsewhere and wrote its own coordinator's id back, and X handed the key on to
/// it). X's next release leaves the key to W's waiter.
async fn a_waiter_elsewhere_is_not_passed_over_by_the_line_s_own_waiters(b: Backend) {
    // X's waiters hold back 3 s (3 x its `poll_max`) for W's waiter, which pauses at most
    // 150 ms between polls: on a loaded machine W's late poll still finds the key free (with
    // both at 100 ms, a poll 150 ms late lost the key to x2 and W waited in vain).
    let x = polling_every(b.store(), Duration::from_secs(1));
    let w = polling_every(b.store(), Duration::from_millis(100));
    let k = "passed-over";
    let h = x.acquire(k, "h", LONG, AcquireOptions::default()).await.unwrap();
    let x1 = tokio::spawn({
        let x = x.clone();
        async move { x.acquire(k, "x1", LONG, waiting(Duration::from_secs(20))).await }
    });
    head_offers(&x, k).await;
    x.release(k, &h.lease_id).await.unwrap();
    let l1 = x1.await.unwrap().expect("x1 is handed the key");
    let handed = b.store().get(k).await.unwrap().expect("the item");
    assert_eq!(handed.queue.handed_in.as_deref(), Some(x.id()), "x1's lease came from x's line");
    let x2 = tokio::spawn({
        let x = x.clone();
        async move { x.acquire(k, "x2", LONG, waiting(Duration::from_secs(30))).await }
    });
    let wl = tokio::spawn({
        let w = w.clone();
        async move { w.acquire(k, "w", LONG, waiting(Duration::from_secs(30))).await }
    });
    until(Duration::from_secs(10), "w's waiter marks x1's lease", async || {
        b.store().get(k).await.unwrap().is_some_and(|r| r.queue.awaited_by.as_deref() == Some(w.id()))
    })
    .await;
    // x2, head of x's line, polls several times while x1 holds the key.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let r = b.store().get(k).await.unwrap().expect("the item");
    assert_eq!((r.queue.handed_in.as_deref(), r.queue.awaited_by.as_deref()), (Some(x.id()), Some(w.id())), "{r:?}");
    x.release(k, &l1.lease_id).await.unwrap();
    let got = wl.await.unwrap().expect("w's waiter gets the key x's line left free");
    assert!(got.fence > l1.fence);
    assert!(!x2.is_finished(), "x2 was not handed the key over w's mark");
    w.release(k, &got.lease_id).await.unwrap();
    let l2 = x2.await.unwrap().expect("x2 takes its turn after w");
    x.release(k, &l2.lease_id).await.unwrap();
}

/// A store that marks the key for a waiter of another coordinator (`awaited_by`) just before
/// the in-process hand-over's write: the mark lands between the release's read and its write.
struct MarkBeforeHandTo;

#[async_trait]
impl Intercept for MarkBeforeHandTo {
    async fn update(&self, store: &Arc<dyn Store>, key: &str, c: &Condition, m: &Mutation) -> leasehold::Result<Write> {
        if let Condition::Queue(QueueCondition::HandTo { fence, .. }) = c {
            let mark = Mutation::Queue(QueueMutation::WaitsIn { coordinator: "elsewhere".into() });
            assert!(matches!(store.update(key, &Condition::FenceIs(*fence), &mark).await?, Write::Applied(_)));
        }
        store.update(key, c, m).await
    }
}

/// A waiter of another coordinator marks the lease between the release's read and its
/// hand-over's write: the write is refused (its condition requires no mark of another
/// coordinator), the release goes the ordinary way, and the key is free for that waiter while
/// this coordinator's waiter holds back.
async fn a_mark_landing_before_the_hand_over_s_write_leaves_the_key_free(b: Backend) {
    let c = quiet(wrap(b.store(), MarkBeforeHandTo));
    let k = "marked-late";
    let h = c.acquire(k, "h", LONG, AcquireOptions::default()).await.unwrap();
    let c2 = c.clone();
    let waiter = tokio::spawn(async move { c2.acquire(k, "w", LONG, waiting(Duration::from_secs(20))).await });
    head_offers(&c, k).await;
    let released = c.release(k, &h.lease_id).await.unwrap();
    assert!(!released.already_released);
    let s = c.get(k).await.unwrap();
    assert!(!s.held && s.holder == "h", "the key went free, not to the line's waiter: {s:?}");
    // A waiter of another coordinator takes it.
    let other = Coordinator::new(b.store(), test_config());
    let l = other.acquire(k, "elsewhere", LONG, AcquireOptions::default()).await.expect("the key is free");
    assert!(!waiter.is_finished());
    other.release(k, &l.lease_id).await.unwrap();
    waiter.abort();
}

/// An acquire under the caller's own lease_id is dropped while its write is in flight (it
/// lands at once, its answer comes 800 ms later), and the caller sends the same request again
/// at once, as DESIGN.md says to: the retry is answered with the lease, and the dropped
/// attempt's answer, arriving afterwards, must not give that lease back (it is the caller's
/// now; found by the simulation's cancelled acquires: the departed attempt's release ended the
/// retried fail-closed lease while its holder believed it). A generated lease_id's grant is
/// still given back (`acquires_cut_at_any_point_strand_no_lease`).
async fn a_callers_lease_id_sent_again_after_a_dropped_acquire_keeps_its_lease(b: Backend) {
    let faulty = Faulty::new(b.store());
    let c = quiet(faulty.clone());
    for (k, duration) in [("own-id", LONG), ("own-id-fail-closed", None)] {
        let id = LeaseId::from_string(format!("{k}-lease"));
        let opts = AcquireOptions { lease_id: Some(id.clone()), ..Default::default() };
        faulty.inject(&[Fault::SlowAnswer(Duration::from_millis(800))]);
        let first = tokio::time::timeout(Duration::from_millis(200), c.acquire(k, "h", duration, opts.clone())).await;
        assert!(first.is_err(), "{k}: the first acquire was dropped with its write in flight");
        let l = c.acquire(k, "h", duration, opts).await.expect("the same request again answers the lease");
        assert_eq!(l.lease_id, id);
        // The dropped attempt's answer arrives, and whatever it sets off has time to land.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let s = c.get(k).await.unwrap();
        assert!(s.held, "{k}: the caller's lease was given back by its dropped attempt: {s:?}");
        c.heartbeat(k, &id, duration).await.expect("still the caller's lease");
        c.release(k, &id).await.unwrap();
    }
}

/// A waiter of another coordinator whose mark of the lease (`awaited_by`) does not land (the
/// store refuses the write, or it outlasts the waiter's pause on a slow store) marks it again at
/// its next refusal: it is not left unmarked, passed over by that line for as long as it waits.
async fn a_mark_that_did_not_land_is_written_again_at_the_next_refusal(b: Backend) {
    let x = polling_every(b.store(), Duration::from_secs(1));
    // The marks are the only writes under `FenceIs`; the first one is not sent.
    let faulty = Faulty::on(b.store(), |c| matches!(c, Condition::FenceIs(_)));
    faulty.inject(&[Fault::Unavailable]);
    let w = polling_every(faulty.clone(), Duration::from_millis(100));
    let k = "mark-again";
    let h = x.acquire(k, "h", LONG, AcquireOptions::default()).await.unwrap();
    let x1 = tokio::spawn({
        let x = x.clone();
        async move { x.acquire(k, "x1", LONG, waiting(Duration::from_secs(20))).await }
    });
    head_offers(&x, k).await;
    x.release(k, &h.lease_id).await.unwrap();
    let l1 = x1.await.unwrap().expect("x1 is handed the key");
    let wl = tokio::spawn({
        let w = w.clone();
        async move { w.acquire(k, "w", LONG, waiting(Duration::from_secs(30))).await }
    });
    until(Duration::from_secs(10), "w's waiter marks x1's lease after its first mark was lost", async || {
        b.store().get(k).await.unwrap().is_some_and(|r| r.queue.awaited_by.as_deref() == Some(w.id()))
    })
    .await;
    assert_eq!(faulty.injected.load(Ordering::SeqCst), 1, "the first mark was not sent");
    x.release(k, &l1.lease_id).await.unwrap();
    let got = wl.await.unwrap().expect("w's waiter gets the key");
    w.release(k, &got.lease_id).await.unwrap();
}
