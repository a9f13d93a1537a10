//! The conditions a write is made under, as data: what each means ([`Condition::holds`], the
//! reference semantics the embedded store evaluates) and, in each variant's documentation, the
//! DynamoDB expression the production store sends for it (`dynamo::render`).

use crate::model::{LeaseId, Record};

use super::Visit;

/// Conditions a write is made under. Semantics are defined by [`Condition::holds`]; the
/// DynamoDB text of each is in DESIGN.md, and a test renders each and compares.
#[derive(Debug, Clone, PartialEq)]
pub enum Condition {
    /// The key can be taken with fence `fence` by `lease_id`: no item, or an item whose expiry
    /// is present and `<= now_ms`, whose last fence is below `fence`, whose last lease is not
    /// `lease_id` (a lease_id is single-use: once its lease ended it is never granted again),
    /// without queued waiters (a free key with waiters belongs to the head waiter), without a
    /// grant still marked undelivered (its waiter is told before the key moves on), and which is
    /// in no work state (a key in a state is taken with [`Condition::FreeIn`], which keeps its
    /// state). DynamoDB: `attribute_not_exists(fence) OR (expires_at_ms <= :now AND fence <
    /// :fence AND lease_id <> :lease_id AND (attribute_not_exists(queue_tail) OR (queue_tail
    /// <= queue_head AND queue_tail < :fence)) AND attribute_not_exists(state_shard) AND
    /// attribute_not_exists(pending_token))` (every item has a fence; the last queue's tail
    /// stays below every later fence, so that a new queue starts above it, see `Queueable`)
    Free { now_ms: u64, fence: u64, lease_id: LeaseId },
    /// [`Condition::Free`] for a fail-closed acquire (no expiry: a lease nobody knows of would
    /// hold the key until an operator frees it), which also requires that the key was not
    /// released after `now_ms`, nor freed after it by a queue write (`freed_at_ms`: the
    /// undelivered mark of an ended grant removed, the last waiter passed over): an attempt
    /// held in the network never takes a key freed after it was sent (its caller may have
    /// given up on it). (A revocation stamps `released_at_ms`.) DynamoDB:
    /// `attribute_not_exists(fence) OR (expires_at_ms <= :now AND (attribute_not_exists(released_at_ms)
    /// OR released_at_ms <= :now) AND (attribute_not_exists(freed_at_ms) OR freed_at_ms <= :now) AND fence < :fence AND lease_id <> :lease_id AND
    /// (attribute_not_exists(queue_tail) OR queue_tail <= queue_head) AND
    /// attribute_not_exists(state_shard) AND attribute_not_exists(pending_token))`
    FreeAfter { now_ms: u64, fence: u64, lease_id: LeaseId },
    /// `lease_id` holds the key and this renewal is newer than the last one: same lease_id, not
    /// released, no expiry or expiry `> now_ms`, and no renewal at or after `now_ms` (a delayed
    /// duplicate of a heartbeat whose retry already landed is refused). With `expires_at_ms`
    /// (a heartbeat naming its duration) the current expiry must not be later than the new one;
    /// without (extend by the stored duration) the lease must have a stored duration. Either
    /// way the expiry never moves backwards. With `ttl` (the renewal writes a TTL) the item must
    /// be in no work state: a key in a state keeps no TTL, and its renewal is sent without one
    /// (removing any), so that no renewal, answered or not, leaves a TTL on it.
    /// DynamoDB: `lease_id = :lease_id AND attribute_not_exists(released_at_ms) AND
    /// (attribute_not_exists(expires_at_ms) OR expires_at_ms > :now) AND
    /// (attribute_not_exists(renewed_at_ms) OR renewed_at_ms < :now) AND`
    /// `(attribute_not_exists(expires_at_ms) OR expires_at_ms <= :expires_at)` |
    /// `attribute_exists(duration_ms)`, and with `ttl` ` AND attribute_not_exists(state_shard)`
    Renew { lease_id: LeaseId, now_ms: u64, expires_at_ms: Option<u64>, ttl: bool },
    /// The item carries `lease_id` and has not been released (a release or force-release
    /// already ended it). DynamoDB: `lease_id = :lease_id AND attribute_not_exists(released_at_ms)`
    Unreleased { lease_id: LeaseId },
    /// The item exists. DynamoDB: `attribute_exists(#key)`
    Exists,
    /// The item's last fence is `fence`: the same lease as when it was read (every grant and
    /// force-release changes the fence). DynamoDB: `fence = :expected_fence`
    FenceIs(u64),
    /// The item is still the lease the keep-alive sweep read from its (eventually consistent)
    /// index: same fence and same expiry (`None`: no expiry). A renewal the index has not seen
    /// yet moved the expiry, so a live lease is never taken out of the sweep on a stale entry.
    /// DynamoDB: `fence = :expected_fence AND expires_at_ms = :expected_expiry` |
    /// `attribute_not_exists(expires_at_ms)`
    FenceAndExpiry { fence: u64, expires_at_ms: Option<u64> },
    /// A waiter may join the key's queue: the item exists and is held, or its queue is not
    /// empty (a free key with waiters belongs to the head waiter), the queue's last slot is
    /// not already `lease_id`'s (a retried enqueue whose first try landed finds its slot in the
    /// refused answer instead of taking a second one), and a new queue (no counters on the
    /// item) starts at `start`, above the item's fence: every grant that replaced the whole
    /// item had a fence above the last queue's tail (`Free`), so a new queue's numbers are above
    /// every earlier queue's on the key, and a waiter item of an earlier queue is never served
    /// by a later one. DynamoDB:
    /// `attribute_exists(fence) AND (attribute_not_exists(expires_at_ms) OR expires_at_ms > :now
    /// OR queue_tail > queue_head) AND (attribute_not_exists(queue_tail_lease_id) OR
    /// queue_tail_lease_id <> :lease_id OR queue_tail <= queue_head) AND (attribute_exists(queue_head)
    /// OR fence < :queue_start)`
    Queueable { now_ms: u64, lease_id: LeaseId, start: u64 },
    /// The key is free, still carries the lease read (`fence`), and its queue head is still
    /// `head`: the head waiter may be granted it, or skipped. DynamoDB:
    /// `fence = :expected_fence AND expires_at_ms <= :now AND queue_head = :queue_head`
    HandOver { fence: u64, now_ms: u64, head: u64 },
    /// The grant with `fence` is still marked undelivered to `token`: a retried invocation of
    /// the waiter's task may have moved the mark to its own token, and then a delivery to the
    /// old one (dead: `Gone`) neither revokes the grant nor removes the new mark. DynamoDB:
    /// `fence = :expected_fence AND pending_token = :expected_token`
    Undelivered { fence: u64, token: String },
    /// [`Condition::Undelivered`], the grant not released: the mark of a grant delivered while
    /// live goes, but not by a write that lands after the lease was released (one held in the
    /// network would date the key's freeing, `freed_at_ms`, before the release: the mark stays,
    /// and whoever serves the ended grant removes it with its own clock). DynamoDB:
    /// `fence = :expected_fence AND pending_token = :expected_token AND attribute_not_exists(released_at_ms)`
    UndeliveredLive { fence: u64, token: String },
    /// The item is not a lease (a waiter item, or nothing). DynamoDB:
    /// `attribute_not_exists(fence) OR fence = :zero`
    NotLease,
    /// A waiter item may be written at `now_ms`: [`Condition::NotLease`], and not written since
    /// by a later try (a retried invocation writes the waiter item of its slot again with its
    /// own task token; a write of an earlier try, held in the network, must not put the dead
    /// token back). DynamoDB: `(attribute_not_exists(fence) OR fence = :zero) AND
    /// (attribute_not_exists(renewed_at_ms) OR renewed_at_ms <= :now)`
    WaiterNewer { now_ms: u64 },
    /// The release of `lease_id` may hand the key straight to an in-process waiter of
    /// `coordinator`: the item is still that lease as read (`fence`), unreleased, past its
    /// min_hold, without queued waiters, in no work state (the grant replaces the whole item),
    /// and not marked by a waiter of another coordinator since it was read. DynamoDB: `fence =
    /// :expected_fence AND lease_id = :lease_id AND attribute_not_exists(released_at_ms) AND
    /// min_hold_until_ms <= :now AND (attribute_not_exists(queue_tail) OR queue_tail <=
    /// queue_head) AND attribute_not_exists(state_shard) AND (attribute_not_exists(awaited_by)
    /// OR awaited_by = :coordinator)`
    HandTo { lease_id: LeaseId, fence: u64, now_ms: u64, coordinator: String },
    /// [`Condition::Free`] for a key in a work state, and still in the same visit of that state
    /// the coordinator read (same state, same entry time, same number of grants): a batch lease
    /// copies the state into the new item, so it must be the item's current one. DynamoDB:
    /// `expires_at_ms <= :now AND fence < :fence AND lease_id <> :lease_id AND
    /// (attribute_not_exists(queue_tail) OR queue_tail <= queue_head) AND state_shard =
    /// :state_shard AND state_since_ms = :state_since_ms AND attempts = :attempts AND
    /// attribute_not_exists(pending_token)`
    FreeIn { now_ms: u64, fence: u64, lease_id: LeaseId, visit: Visit },
    /// A key may be put into `state`: no item, or a free item not already in `state`.
    /// DynamoDB: `attribute_not_exists(fence) OR (expires_at_ms <= :now AND
    /// (attribute_not_exists(state_shard) OR state_shard <> :state_shard))`
    Enterable { now_ms: u64, state: String, shard: String },
    /// `lease_id` holds the key right now: same lease_id, not released, no expiry or expiry
    /// `> now_ms` (a state change is the live holder's alone). DynamoDB: `lease_id = :lease_id
    /// AND attribute_not_exists(released_at_ms) AND (attribute_not_exists(expires_at_ms) OR
    /// expires_at_ms > :now)`
    Live { lease_id: LeaseId, now_ms: u64 },
    /// [`Condition::Unreleased`] on a key without queued waiters: the release of a coordinator
    /// that serves queues (with waiters, the release grants the head waiter in its own write,
    /// [`Condition::ReleaseHandOver`]). DynamoDB: `lease_id = :lease_id AND
    /// attribute_not_exists(released_at_ms) AND (attribute_not_exists(queue_tail) OR queue_tail
    /// <= queue_head)`
    Unqueued { lease_id: LeaseId },
    /// The release of `lease_id` that grants the key to the head waiter in the same write: the
    /// item is still that lease as read (`fence`), unreleased, past its min_hold, and its queue
    /// head is still `head`. DynamoDB: `fence = :expected_fence AND lease_id =
    /// :releasing_lease_id AND attribute_not_exists(released_at_ms) AND min_hold_until_ms <= :now
    /// AND queue_head = :expected_head`
    ReleaseHandOver { lease_id: LeaseId, fence: u64, now_ms: u64, head: u64 },
    /// The key has no queued waiter and no undelivered grant: it may leave the queue index.
    /// DynamoDB: `(attribute_not_exists(queue_tail) OR queue_tail <= queue_head) AND
    /// attribute_not_exists(pending_token)`
    QueueIdle,
    /// A semaphore has a free slot for `lease_id` at `fence` (DESIGN.md, "Semaphores"): the
    /// item is a semaphore, fewer than `slots` holders are counted, its last fence is below
    /// `fence`, and `lease_id` has no entry (single-use). DynamoDB: `attribute_exists(sem_slots)
    /// AND sem_taken < :slots AND fence < :fence AND attribute_not_exists(sem_holders.#lease_id)`
    SlotFree { fence: u64, lease_id: LeaseId, slots: u32 },
    /// The semaphore is as read: no write since (every one bumps `sem_rev`). DynamoDB:
    /// `sem_rev = :expected_rev`
    SlotsAsRead { rev: u64 },
    /// The semaphore's holder `lease_id` is live and this renewal newer than its last, and its
    /// expiry does not move backwards. DynamoDB: `sem_holders.#lease_id.expires_at_ms > :now AND
    /// attribute_not_exists(sem_holders.#lease_id.released_at_ms) AND
    /// sem_holders.#lease_id.renewed_at_ms < :now AND sem_holders.#lease_id.expires_at_ms <=
    /// :expires_at`
    SlotRenew { lease_id: LeaseId, now_ms: u64, expires_at_ms: u64 },
    /// The semaphore's holder `lease_id` has an entry and is not released. DynamoDB:
    /// `attribute_exists(sem_holders.#lease_id) AND
    /// attribute_not_exists(sem_holders.#lease_id.released_at_ms)`
    SlotUnreleased { lease_id: LeaseId },
}

impl Condition {
    /// Reference semantics: does the condition hold for the current item (`None`: no item)?
    pub fn holds(&self, item: Option<&Record>) -> bool {
        match (self, item) {
            (Condition::Free { .. } | Condition::FreeAfter { .. }, None) => true,
            (Condition::FreeAfter { now_ms, fence, lease_id }, Some(r)) => {
                r.released_at_ms.is_none_or(|t| t <= *now_ms)
                    && r.freed_at_ms.is_none_or(|t| t <= *now_ms)
                    && Condition::Free { now_ms: *now_ms, fence: *fence, lease_id: lease_id.clone() }.holds(Some(r))
            }
            (Condition::Free { now_ms, fence, lease_id }, Some(r)) => {
                matches!(r.expires_at_ms, Some(e) if e <= *now_ms)
                    && r.freed_at_ms.is_none_or(|t| t <= *now_ms)
                    && r.fence < *fence
                    && &r.lease_id != lease_id
                    && r.queue_len() == 0
                    && r.queue_tail.is_none_or(|t| t < *fence)
                    && r.state.is_none()
                    && r.pending_token.is_none()
            }
            (Condition::Renew { lease_id, now_ms, expires_at_ms, ttl }, Some(r)) => {
                r.is_live_for(lease_id, *now_ms)
                    && (!ttl || r.state.is_none())
                    && r.renewed_at_ms.is_none_or(|t| t < *now_ms)
                    && match expires_at_ms {
                        Some(new) => r.expires_at_ms.is_none_or(|e| e <= *new),
                        None => r.duration_ms.is_some(),
                    }
            }
            (Condition::Unreleased { lease_id }, Some(r)) => &r.lease_id == lease_id && r.released_at_ms.is_none(),
            (Condition::Exists, Some(_)) => true,
            (Condition::FenceIs(f), Some(r)) => r.fence == *f,
            (Condition::FenceAndExpiry { fence, expires_at_ms }, Some(r)) => {
                r.fence == *fence && r.expires_at_ms == *expires_at_ms
            }
            (Condition::NotLease | Condition::WaiterNewer { .. } | Condition::Enterable { .. }, None) => true,
            (Condition::NotLease, Some(r)) => r.fence == 0,
            (Condition::HandTo { lease_id, fence, now_ms, coordinator }, Some(r)) => {
                r.fence == *fence
                    && &r.lease_id == lease_id
                    && r.released_at_ms.is_none()
                    && r.min_hold_until_ms <= *now_ms
                    && r.queue_len() == 0
                    && r.state.is_none()
                    && r.awaited_by.as_ref().is_none_or(|w| w == coordinator)
            }
            (Condition::FreeIn { now_ms, fence, lease_id, visit }, Some(r)) => {
                matches!(r.expires_at_ms, Some(e) if e <= *now_ms)
                    && r.fence < *fence
                    && &r.lease_id != lease_id
                    && r.queue_len() == 0
                    && r.queue_tail.is_none_or(|t| t < *fence)
                    && r.state.as_deref() == Some(visit.state.as_str())
                    && r.state_since_ms == Some(visit.since_ms)
                    && r.attempts.unwrap_or(0) == visit.attempts
                    && r.pending_token.is_none()
            }
            (Condition::Live { lease_id, now_ms }, Some(r)) => r.is_live_for(lease_id, *now_ms),
            (
                Condition::Queueable { .. }
                | Condition::HandOver { .. }
                | Condition::Undelivered { .. }
                | Condition::UndeliveredLive { .. }
                | Condition::Unqueued { .. }
                | Condition::ReleaseHandOver { .. }
                | Condition::QueueIdle
                | Condition::WaiterNewer { .. },
                Some(r),
            ) => self.holds_on_queue(r),
            (
                Condition::SlotFree { .. }
                | Condition::SlotsAsRead { .. }
                | Condition::SlotRenew { .. }
                | Condition::SlotUnreleased { .. },
                Some(r),
            ) => self.holds_on_semaphore(r),
            (Condition::Enterable { now_ms, state, .. }, Some(r)) => {
                matches!(r.expires_at_ms, Some(e) if e <= *now_ms) && r.state.as_deref() != Some(state.as_str())
            }
            (_, None) => false,
        }
    }

    /// The waiter queue's conditions (DESIGN.md, "The waiter queue") on an existing item.
    fn holds_on_queue(&self, r: &Record) -> bool {
        match self {
            Condition::WaiterNewer { now_ms } => r.fence == 0 && r.renewed_at_ms.is_none_or(|t| t <= *now_ms),
            Condition::Queueable { now_ms, lease_id, start } => {
                (r.is_held(*now_ms) || r.queue_len() > 0)
                    && (r.queue_tail_lease_id.as_ref() != Some(lease_id) || r.queue_len() == 0)
                    && (r.queue_head.is_some() || r.fence < *start)
            }
            Condition::HandOver { fence, now_ms, head } => {
                r.fence == *fence && matches!(r.expires_at_ms, Some(e) if e <= *now_ms) && r.queue_head == Some(*head)
            }
            Condition::Undelivered { fence, token } => r.fence == *fence && r.pending_token.as_ref() == Some(token),
            Condition::UndeliveredLive { fence, token } => {
                r.fence == *fence && r.pending_token.as_ref() == Some(token) && r.released_at_ms.is_none()
            }
            Condition::Unqueued { lease_id } => {
                &r.lease_id == lease_id && r.released_at_ms.is_none() && r.queue_len() == 0
            }
            Condition::ReleaseHandOver { lease_id, fence, now_ms, head } => {
                r.fence == *fence
                    && &r.lease_id == lease_id
                    && r.released_at_ms.is_none()
                    && r.min_hold_until_ms <= *now_ms
                    && r.queue_head == Some(*head)
            }
            Condition::QueueIdle => r.queue_len() == 0 && r.pending_token.is_none(),
            _ => unreachable!("not a queue condition: {self:?}"),
        }
    }

    /// The semaphore's conditions (DESIGN.md, "Semaphores") on an existing item.
    fn holds_on_semaphore(&self, r: &Record) -> bool {
        match self {
            Condition::SlotFree { fence, lease_id, slots } => {
                r.slots.is_some()
                    && r.slots_taken.unwrap_or(0) < *slots
                    && r.fence < *fence
                    && r.slot(lease_id).is_none()
            }
            Condition::SlotsAsRead { rev } => r.slots_rev == Some(*rev),
            Condition::SlotRenew { lease_id, now_ms, expires_at_ms } => r
                .slot(lease_id)
                .is_some_and(|h| h.is_live(*now_ms) && h.renewed_at_ms < *now_ms && h.expires_at_ms <= *expires_at_ms),
            Condition::SlotUnreleased { lease_id } => r.slot(lease_id).is_some_and(|h| h.released_at_ms.is_none()),
            _ => unreachable!("not a semaphore condition: {self:?}"),
        }
    }
}
