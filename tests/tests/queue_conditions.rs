//! The waiter queue's conditions at their edges, on both stores (DESIGN.md, "The waiter
//! queue"): items built by the store's own mutations, and each condition tried one step either
//! side of each of its comparisons, so that the embedded store's reference semantics
//! (`QueueCondition::holds`) and the DynamoDB text are held to the same boundaries. The
//! protocol suites reach these conditions only through the answers the protocol needs; here
//! every clause is made to decide once.

use std::sync::Arc;

use leasehold::queue::Waiter;
use leasehold::store::{
    waiter_key, Condition, LeaseCondition, LeaseMutation, Mutation, NewLease, QueueCondition, QueueMutation, Store,
    Visit, Write,
};
use leasehold::{LeaseId, Record};
use leasehold_tests::{both_backends, Backend};

both_backends!(
    queueable_at_its_edges,
    hand_over_and_delivery_at_their_edges,
    waiter_items_at_their_edges,
    hand_to_at_its_edges,
    releases_and_idle_at_their_edges,
);

/// The lease's fence, acquisition time, duration and min_hold.
const FENCE: u64 = 5_000;
const AT: u64 = 1_800_000_000_000;
const DURATION: u64 = 1_000;
const HOLD: u64 = 200;

/// One item on a fresh key, changed only through the store's own mutations.
struct Item {
    store: Arc<dyn Store>,
    key: String,
    lease_id: LeaseId,
}

impl Item {
    /// A lease on a fresh key: fence `FENCE`, acquired at `AT`, expiring `DURATION` later,
    /// held at least `HOLD`; in a work state if `state` is given.
    async fn lease(b: &Backend, state: Option<&str>) -> Item {
        let (store, key, lease_id) =
            (b.store(), format!("qcond/{}", LeaseId::generate().expose()), LeaseId::generate());
        let mut lease = NewLease::new("holder", lease_id.clone(), AT, Some(DURATION), FENCE);
        lease.min_hold_ms = HOLD;
        lease.visit = state.map(|s| Visit { state: s.into(), shard: format!("{s}#0"), since_ms: AT, attempts: 1 });
        let free = LeaseCondition::Free { now_ms: AT, fence: FENCE, lease_id: lease_id.clone() };
        let w = store.update(&key, &free.into(), &Mutation::Lease(LeaseMutation::Acquire(lease))).await;
        assert!(matches!(w.expect("put"), Write::Applied(_)));
        Item { store, key, lease_id }
    }

    /// A waiter item of a fresh key's slot 7, stamped `renewed_at_ms` (`None`: never).
    async fn waiter(b: &Backend, renewed_at_ms: Option<u64>) -> Item {
        let lease_id = LeaseId::generate();
        let key = waiter_key(&format!("qcond/{}", LeaseId::generate().expose()), 7);
        let mut r = Record { key: key.clone(), ..Record::default() };
        r.lease_id = lease_id.clone();
        r.holder = "waiter".into();
        r.expires_at_ms = Some(0);
        r.renewed_at_ms = renewed_at_ms;
        r.queue.waiter = Some(Waiter {
            seq: 7,
            holder: "waiter".into(),
            lease_id: lease_id.clone(),
            duration_ms: DURATION,
            metadata: None,
            keepalive: None,
            task_token: "token".into(),
            enqueued_at_ms: AT,
            timeout_at_ms: None,
        });
        let (store, put) = (b.store(), Mutation::Queue(QueueMutation::PutWaiter(Box::new(r))));
        let w = store.update(&key, &QueueCondition::WaiterNewer { now_ms: AT }.into(), &put).await;
        assert!(matches!(w.expect("put"), Write::Applied(_)));
        Item { store, key, lease_id }
    }

    /// Changes the item, whatever it holds.
    async fn write(&self, m: Mutation) {
        let w = self.store.update(&self.key, &Condition::Exists, &m).await.expect("write");
        assert!(matches!(w, Write::Applied(_)), "{m:?}: {w:?}");
    }

    /// Joins the queue: a new queue starts at `start`, so its head is `start` and the new
    /// waiter's slot is `start + 1`.
    async fn enqueue(&self, start: u64, lease_id: &LeaseId) {
        let m = QueueMutation::Enqueue { now_ms: AT + 1, start, lease_id: lease_id.clone(), shard: 0 };
        self.write(Mutation::Queue(m)).await;
    }

    /// Whether `c` holds: a write that changes nothing any condition reads lands under it.
    async fn holds(&self, c: QueueCondition) -> bool {
        let (c, probe) = (Condition::Queue(c), Mutation::Queue(QueueMutation::Unindex));
        match self.store.update(&self.key, &c, &probe).await.expect("probe") {
            Write::Applied(_) => true,
            Write::Rejected(_) => false,
        }
    }

    async fn release(&self) {
        let m = LeaseMutation::Release { now_ms: AT + HOLD, ttl: AT / 1000 + 86_400 };
        self.write(Mutation::Lease(m)).await;
    }
}

/// `Queueable`: held (an expiry after `now`) or with waiters ahead; the slot not already this
/// lease_id's while the queue is not empty; a new queue starting above the fence.
async fn queueable_at_its_edges(b: Backend) {
    let (other, start) = (LeaseId::generate(), FENCE + 10);
    let q = |now_ms: u64, lease_id: &LeaseId, start: u64| QueueCondition::Queueable {
        now_ms,
        lease_id: lease_id.clone(),
        start,
    };
    let i = Item::lease(&b, None).await;
    assert!(i.holds(q(AT + DURATION - 1, &other, start)).await, "held, a new queue above the fence");
    assert!(!i.holds(q(AT + DURATION, &other, start)).await, "expired at `now`, no waiters");
    assert!(!i.holds(q(AT + 1, &other, FENCE)).await, "a new queue starting at the fence");
    assert!(i.holds(q(AT + 1, &other, FENCE + 1)).await, "a new queue starting one above it");

    i.enqueue(start, &i.lease_id).await;
    assert!(i.holds(q(AT + 10 * DURATION, &other, 0)).await, "expired, waiters ahead, the queue exists");
    assert!(!i.holds(q(AT + 1, &i.lease_id, start)).await, "the queue's last slot is this lease_id's");
    assert!(i.holds(q(AT + 1, &other, 0)).await, "another lease_id joins an existing queue");
    // The last waiter passed over: the queue is empty, and the same lease_id may join again.
    i.write(Mutation::Queue(QueueMutation::Skip { seq: start + 1, now_ms: AT + 2 })).await;
    assert!(i.holds(q(AT + 1, &i.lease_id, 0)).await, "an empty queue: its last slot no longer counts");
    assert!(!i.holds(q(AT + 10 * DURATION, &other, 0)).await, "expired, and no waiter ahead");
}

/// `HandOver` (free at `now`, the lease and head as read) and `Undelivered`/`UndeliveredLive`
/// (the grant still marked undelivered to this token; live: not released).
async fn hand_over_and_delivery_at_their_edges(b: Backend) {
    let start = FENCE + 10;
    let i = Item::lease(&b, None).await;
    i.enqueue(start, &LeaseId::generate()).await;
    let h = |fence: u64, now_ms: u64, head: u64| QueueCondition::HandOver { fence, now_ms, head };
    assert!(i.holds(h(FENCE, AT + DURATION, start)).await, "expired at `now`");
    assert!(!i.holds(h(FENCE, AT + DURATION - 1, start)).await, "expires after `now`");
    assert!(!i.holds(h(FENCE + 1, AT + DURATION, start)).await, "another lease");
    assert!(!i.holds(h(FENCE, AT + DURATION, start + 1)).await, "another head");

    i.write(Mutation::Queue(QueueMutation::MarkUndelivered { token: "tok".into(), shard: 0 })).await;
    let u = |fence: u64, token: &str| QueueCondition::Undelivered { fence, token: token.into() };
    let live = |fence: u64, token: &str| QueueCondition::UndeliveredLive { fence, token: token.into() };
    for (fence, token, expected) in [(FENCE, "tok", true), (FENCE, "other", false), (FENCE + 1, "tok", false)] {
        assert_eq!(i.holds(u(fence, token)).await, expected, "undelivered {fence} {token}");
        assert_eq!(i.holds(live(fence, token)).await, expected, "undelivered, live {fence} {token}");
    }
    i.release().await;
    assert!(i.holds(u(FENCE, "tok")).await, "released, still marked");
    assert!(!i.holds(live(FENCE, "tok")).await, "released: not live");
}

/// `NotLease` (a waiter item, never a lease) and `WaiterNewer` (a waiter item not written
/// since `now` by a later try).
async fn waiter_items_at_their_edges(b: Backend) {
    let stamped = Item::waiter(&b, Some(AT)).await;
    let newer = |now_ms: u64| QueueCondition::WaiterNewer { now_ms };
    assert!(stamped.holds(QueueCondition::NotLease).await, "a waiter item");
    assert!(stamped.holds(newer(AT)).await, "written at `now`");
    assert!(!stamped.holds(newer(AT - 1)).await, "written after `now`");
    let unstamped = Item::waiter(&b, None).await;
    assert!(unstamped.holds(newer(0)).await, "never stamped");
    let lease = Item::lease(&b, None).await;
    assert!(!lease.holds(QueueCondition::NotLease).await, "a lease");
    assert!(!lease.holds(newer(AT + 10 * DURATION)).await, "a lease, written before `now`");
}

/// `HandTo`: the lease as read, unreleased, past its min_hold, no queued waiter, no work state,
/// and awaited by no other coordinator.
async fn hand_to_at_its_edges(b: Backend) {
    let i = Item::lease(&b, None).await;
    let to = |lease_id: &LeaseId, fence: u64, now_ms: u64, coordinator: &str| QueueCondition::HandTo {
        lease_id: lease_id.clone(),
        fence,
        now_ms,
        coordinator: coordinator.into(),
    };
    let id = i.lease_id.clone();
    assert!(i.holds(to(&id, FENCE, AT + HOLD, "c1")).await, "past min_hold at `now`");
    assert!(!i.holds(to(&id, FENCE, AT + HOLD - 1, "c1")).await, "min_hold after `now`");
    assert!(!i.holds(to(&LeaseId::generate(), FENCE, AT + HOLD, "c1")).await, "another lease_id");
    assert!(!i.holds(to(&id, FENCE + 1, AT + HOLD, "c1")).await, "another fence");
    i.write(Mutation::Queue(QueueMutation::WaitsIn { coordinator: "c2".into() })).await;
    assert!(!i.holds(to(&id, FENCE, AT + HOLD, "c1")).await, "awaited by another coordinator");
    assert!(i.holds(to(&id, FENCE, AT + HOLD, "c2")).await, "awaited by this one");
    i.enqueue(FENCE + 10, &LeaseId::generate()).await;
    assert!(!i.holds(to(&id, FENCE, AT + HOLD, "c2")).await, "a queued waiter");

    let work = Item::lease(&b, Some("PENDING")).await;
    assert!(!work.holds(to(&work.lease_id, FENCE, AT + HOLD, "c1")).await, "in a work state");
    let released = Item::lease(&b, None).await;
    released.release().await;
    let id = released.lease_id.clone();
    assert!(!released.holds(to(&id, FENCE, AT + HOLD, "c1")).await, "released");
}

/// `Unqueued` (this lease, unreleased, no queued waiter), `ReleaseHandOver` (the lease as read,
/// unreleased, past min_hold, the head as read) and `QueueIdle` (no queued waiter, no
/// undelivered grant).
async fn releases_and_idle_at_their_edges(b: Backend) {
    let start = FENCE + 10;
    let i = Item::lease(&b, None).await;
    let id = i.lease_id.clone();
    let unqueued = |lease_id: &LeaseId| QueueCondition::Unqueued { lease_id: lease_id.clone() };
    assert!(i.holds(unqueued(&id)).await && i.holds(QueueCondition::QueueIdle).await, "no queue");
    assert!(!i.holds(unqueued(&LeaseId::generate())).await, "another lease_id");

    i.enqueue(start, &LeaseId::generate()).await;
    assert!(!i.holds(unqueued(&id)).await, "a queued waiter");
    assert!(!i.holds(QueueCondition::QueueIdle).await, "a queued waiter: not idle");
    let rh = |lease_id: &LeaseId, fence: u64, now_ms: u64, head: u64| QueueCondition::ReleaseHandOver {
        lease_id: lease_id.clone(),
        fence,
        now_ms,
        head,
    };
    assert!(i.holds(rh(&id, FENCE, AT + HOLD, start)).await, "past min_hold at `now`");
    assert!(!i.holds(rh(&id, FENCE, AT + HOLD - 1, start)).await, "min_hold after `now`");
    assert!(!i.holds(rh(&id, FENCE + 1, AT + HOLD, start)).await, "another fence");
    assert!(!i.holds(rh(&id, FENCE, AT + HOLD, start + 1)).await, "another head");
    assert!(!i.holds(rh(&LeaseId::generate(), FENCE, AT + HOLD, start)).await, "another lease_id");

    // The waiter passed over (the queue empty) but a grant undelivered: not idle.
    i.write(Mutation::Queue(QueueMutation::Skip { seq: start + 1, now_ms: AT + 2 })).await;
    assert!(i.holds(unqueued(&id)).await, "an emptied queue");
    i.write(Mutation::Queue(QueueMutation::MarkUndelivered { token: "tok".into(), shard: 0 })).await;
    assert!(!i.holds(QueueCondition::QueueIdle).await, "an undelivered grant: not idle");
    i.release().await;
    assert!(!i.holds(unqueued(&id)).await, "released");
    assert!(!i.holds(rh(&id, FENCE, AT + HOLD, start + 1)).await, "released");
}
