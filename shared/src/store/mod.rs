//! The narrow storage interface: conditional update, conditional delete, get, and paged scans.
//!
//! The protocol (see `protocol.rs`) decides *what* to write and *under which condition*; a
//! store only evaluates a [`Condition`] against the current item and applies a [`Mutation`]
//! atomically, in one request. Both are plain data so that each backend translates them once:
//! DynamoDB into a `ConditionExpression`/`UpdateExpression`, the embedded store into the
//! reference evaluation below ([`Condition::holds`], [`Mutation::apply`]) inside one
//! SQLite write transaction. The shared protocol test suite runs against both.

use async_trait::async_trait;
use serde_json::{Map, Value};

use crate::clock::ClockSamples;
use crate::error::Result;
use crate::model::{Keepalive, LeaseId, Record};

pub mod dynamo;
pub mod events;
pub mod sqlite;
pub mod sqlite_history;
pub mod table;

pub use dynamo::DynamoStore;
pub use sqlite::SqliteStore;

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
    /// :fence AND lease_id <> :lease_id AND (attribute_not_exists(queue_tail) OR queue_tail <=
    /// queue_head) AND attribute_not_exists(state_shard) AND attribute_not_exists(pending_token))`
    /// (every item has a fence)
    Free { now_ms: u64, fence: u64, lease_id: LeaseId },
    /// `lease_id` holds the key and this renewal is newer than the last one: same lease_id, not
    /// released, no expiry or expiry `> now_ms`, and no renewal at or after `now_ms` (a delayed
    /// duplicate of a heartbeat whose retry already landed is refused). With `expires_at_ms`
    /// (a heartbeat naming its duration) the current expiry must not be later than the new one;
    /// without (extend by the stored duration) the lease must have a stored duration. Either
    /// way the expiry never moves backwards.
    /// DynamoDB: `lease_id = :lease_id AND attribute_not_exists(released_at_ms) AND
    /// (attribute_not_exists(expires_at_ms) OR expires_at_ms > :now) AND
    /// (attribute_not_exists(renewed_at_ms) OR renewed_at_ms < :now) AND`
    /// `(attribute_not_exists(expires_at_ms) OR expires_at_ms <= :expires_at)` |
    /// `attribute_exists(duration_ms)`
    Renew { lease_id: LeaseId, now_ms: u64, expires_at_ms: Option<u64> },
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
    /// empty (a free key with waiters belongs to the head waiter), and the queue's last slot is
    /// not already `lease_id`'s (a retried enqueue whose first try landed finds its slot in the
    /// refused answer instead of taking a second one). DynamoDB:
    /// `attribute_exists(fence) AND (attribute_not_exists(expires_at_ms) OR expires_at_ms > :now
    /// OR queue_tail > queue_head) AND (attribute_not_exists(queue_tail_lease_id) OR
    /// queue_tail_lease_id <> :lease_id OR queue_tail <= queue_head)`
    Queueable { now_ms: u64, lease_id: LeaseId },
    /// The key is free, still carries the lease read (`fence`), and its queue head is still
    /// `head`: the head waiter may be granted it, or skipped. DynamoDB:
    /// `fence = :expected_fence AND expires_at_ms <= :now AND queue_head = :queue_head`
    HandOver { fence: u64, now_ms: u64, head: u64 },
    /// The grant with `fence` is still marked undelivered. DynamoDB:
    /// `fence = :expected_fence AND attribute_exists(pending_token)`
    Undelivered { fence: u64 },
    /// The item is not a lease (a waiter item, or nothing). DynamoDB:
    /// `attribute_not_exists(fence) OR fence = :zero`
    NotLease,
    /// The release of `lease_id` may hand the key straight to an in-process waiter: the item is
    /// still that lease as read (`fence`), unreleased, past its min_hold, without queued
    /// waiters, and in no work state (the grant replaces the whole item). DynamoDB: `fence =
    /// :expected_fence AND lease_id = :lease_id AND attribute_not_exists(released_at_ms) AND
    /// min_hold_until_ms <= :now AND (attribute_not_exists(queue_tail) OR queue_tail <=
    /// queue_head) AND attribute_not_exists(state_shard)`
    HandTo { lease_id: LeaseId, fence: u64, now_ms: u64 },
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
}

impl Condition {
    /// Reference semantics: does the condition hold for the current item (`None`: no item)?
    pub fn holds(&self, item: Option<&Record>) -> bool {
        match (self, item) {
            (Condition::Free { .. }, None) => true,
            (Condition::Free { now_ms, fence, lease_id }, Some(r)) => {
                matches!(r.expires_at_ms, Some(e) if e <= *now_ms)
                    && r.fence < *fence
                    && &r.lease_id != lease_id
                    && r.queue_len() == 0
                    && r.state.is_none()
                    && r.pending_token.is_none()
            }
            (Condition::Renew { lease_id, now_ms, expires_at_ms }, Some(r)) => {
                r.is_live_for(lease_id, *now_ms)
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
            (Condition::Queueable { now_ms, lease_id }, Some(r)) => {
                (r.is_held(*now_ms) || r.queue_len() > 0)
                    && (r.queue_tail_lease_id.as_ref() != Some(lease_id) || r.queue_len() == 0)
            }
            (Condition::HandOver { fence, now_ms, head }, Some(r)) => {
                r.fence == *fence && matches!(r.expires_at_ms, Some(e) if e <= *now_ms) && r.queue_head == Some(*head)
            }
            (Condition::Undelivered { fence }, Some(r)) => r.fence == *fence && r.pending_token.is_some(),
            (Condition::NotLease, None) => true,
            (Condition::NotLease, Some(r)) => r.fence == 0,
            (Condition::HandTo { lease_id, fence, now_ms }, Some(r)) => {
                r.fence == *fence
                    && &r.lease_id == lease_id
                    && r.released_at_ms.is_none()
                    && r.min_hold_until_ms <= *now_ms
                    && r.queue_len() == 0
                    && r.state.is_none()
            }
            (Condition::FreeIn { now_ms, fence, lease_id, visit }, Some(r)) => {
                matches!(r.expires_at_ms, Some(e) if e <= *now_ms)
                    && r.fence < *fence
                    && &r.lease_id != lease_id
                    && r.queue_len() == 0
                    && r.state.as_deref() == Some(visit.state.as_str())
                    && r.state_since_ms == Some(visit.since_ms)
                    && r.attempts.unwrap_or(0) == visit.attempts
                    && r.pending_token.is_none()
            }
            (Condition::Live { lease_id, now_ms }, Some(r)) => r.is_live_for(lease_id, *now_ms),
            (Condition::Unqueued { lease_id }, Some(r)) => {
                &r.lease_id == lease_id && r.released_at_ms.is_none() && r.queue_len() == 0
            }
            (Condition::ReleaseHandOver { lease_id, fence, now_ms, head }, Some(r)) => {
                r.fence == *fence
                    && &r.lease_id == lease_id
                    && r.released_at_ms.is_none()
                    && r.min_hold_until_ms <= *now_ms
                    && r.queue_head == Some(*head)
            }
            (Condition::QueueIdle, Some(r)) => r.queue_len() == 0 && r.pending_token.is_none(),
            (Condition::Enterable { .. }, None) => true,
            (Condition::Enterable { now_ms, state, .. }, Some(r)) => {
                matches!(r.expires_at_ms, Some(e) if e <= *now_ms) && r.state.as_deref() != Some(state.as_str())
            }
            (_, None) => false,
        }
    }
}

/// Everything an acquire writes.
#[derive(Debug, Clone, PartialEq)]
pub struct NewLease {
    pub holder: String,
    pub lease_id: LeaseId,
    pub now_ms: u64,
    /// `None`: fail-closed.
    pub duration_ms: Option<u64>,
    pub min_hold_ms: u64,
    pub metadata: Option<Map<String, Value>>,
    pub keepalive: Option<Keepalive>,
    pub ttl: Option<u64>,
    /// The fence this lease carries, chosen by the coordinator: the current time in µs, or
    /// one more than the last fence it saw on the key if that is higher (see DESIGN.md).
    pub fence: u64,
    /// The key's poll period for waiters, when the key is contended (see `pacing`).
    pub poll_ms: Option<u64>,
    /// The work state the key stays in, with `attempts` counting this grant.
    pub visit: Option<Visit>,
    /// An in-process hand-over's grant: the releasing coordinator's id (see [`Record::handed_in`]).
    pub handed_in: Option<String>,
    /// A hand-over: the released lease this grant replaces (its lease_id and fence), kept on the
    /// item so that a retried release of it answers `already_released`.
    pub released: Option<(LeaseId, u64)>,
}

/// One stay of a key in a work state: the state, its index partition (`state_shard`), when the
/// key entered it, and how many leases it has been granted since.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Visit {
    pub state: String,
    pub shard: String,
    pub since_ms: u64,
    pub attempts: u32,
}

impl NewLease {
    /// The whole item an acquire writes for `key`: nothing of the previous lease survives.
    pub fn record(&self, key: &str) -> Record {
        Record {
            key: key.to_string(),
            fence: self.fence,
            holder: self.holder.clone(),
            lease_id: self.lease_id.clone(),
            acquired_at_ms: self.now_ms,
            expires_at_ms: self.duration_ms.map(|d| self.now_ms.saturating_add(d)),
            duration_ms: self.duration_ms,
            min_hold_until_ms: self.now_ms.saturating_add(self.min_hold_ms),
            released_at_ms: None,
            metadata: self.metadata.clone(),
            keepalive: self.keepalive.clone(),
            ttl: self.ttl,
            renewed_at_ms: Some(self.now_ms),
            poll_ms: self.poll_ms,
            handed_in: self.handed_in.clone(),
            queue_head: None,
            queue_tail: None,
            queue_tail_at_ms: None,
            pending_token: None,
            queue_tail_lease_id: None,
            released_lease_id: self.released.as_ref().map(|r| r.0.clone()),
            released_fence: self.released.as_ref().map(|r| r.1),
            waiter: None,
            state: self.visit.as_ref().map(|v| v.state.clone()),
            state_since_ms: self.visit.as_ref().map(|v| v.since_ms),
            attempts: self.visit.as_ref().map(|v| v.attempts),
        }
    }
}

/// The writes of the protocol. Semantics are defined by [`Mutation::apply`].
#[derive(Debug, Clone, PartialEq)]
pub enum Mutation {
    /// Take the key: the whole item is replaced by the new lease (DynamoDB: one PutItem).
    Acquire(NewLease),
    /// Extend a live lease: expires_at = now + (duration, or the stored duration_ms),
    /// renewed_at = now. A given duration replaces the stored one.
    Extend { now_ms: u64, duration_ms: Option<u64>, ttl: Option<u64> },
    /// Release: expires_at = min_hold_until (never earlier than acquired_at + min_hold),
    /// released_at = now, keep-alive removed. Fence, holder and lease_id stay.
    Release { now_ms: u64, ttl: u64 },
    /// Operator release: fence + 1, expires_at = 0 (free at once, min_hold ignored),
    /// released_at = now, keep-alive removed.
    ForceRelease { now_ms: u64, ttl: u64 },
    /// Stop renewing on the holder's behalf (keep-alive deadline passed or execution gone).
    ClearKeepalive,
    /// Join the queue: `queue_tail + 1` (a new queue starts both counters at `start`, the
    /// clock in µs), `queue_tail_at_ms = now`, `queue_tail_lease_id = lease_id`, and the key
    /// enters the queue index (`shard`). The new tail is the waiter's sequence number.
    Enqueue { now_ms: u64, start: u64, lease_id: LeaseId, shard: u32 },
    /// Hand the free key to the head waiter: the lease of `lease` (fence included), the queue
    /// head moved to `seq`, and the grant marked undelivered with the waiter's task token.
    /// Queue tail and `queue_tail_at_ms` stay.
    Grant { lease: NewLease, seq: u64, token: String },
    /// The grant was delivered: the undelivered mark goes.
    Delivered,
    /// A grant whose delivery failed is marked undelivered with the waiter's task token (a
    /// queued acquire that found the key free), and the key enters the queue index (`shard`),
    /// where the sweep finds it to deliver it again.
    MarkUndelivered { token: String, shard: u32 },
    /// The grant's waiter is gone: the key is freed at once (expires_at = 0), released_at = now,
    /// the undelivered mark and keep-alive removed; the TTL set, or removed (`None`: a key in a
    /// work state is kept until it is taken).
    Revoke { now_ms: u64, ttl: Option<u64> },
    /// The key leaves the queue index: its queue is empty and no grant is undelivered.
    Unindex,
    /// Pass over the head waiter (gone, timed out, or never written): `queue_head = seq`.
    Skip { seq: u64 },
    /// Write a whole waiter item (DynamoDB: a PutItem).
    PutWaiter(Box<Record>),
    /// Put the key into a work state without leasing it: free from `now_ms` (its expiry is set
    /// to it), entered now, no grants yet, no TTL. A new item gets fence 0, `holder` and an
    /// empty lease_id (no lease_id a caller can send).
    Enter { now_ms: u64, holder: String, state: String, shard: String },
    /// [`Mutation::Release`] that also moves the key into `state` (entered now, no grants yet)
    /// and removes the TTL (a key in a state is kept until it is taken).
    ReleaseTo { now_ms: u64, state: String, shard: String },
    /// Remove the TTL: a key in a work state is kept until it is taken.
    ClearTtl,
    /// A waiter of coordinator `coordinator` missed a turn to an in-process hand-over: it takes
    /// the mark (`handed_in = coordinator`), so the releaser leaves the key free for it.
    WaitsIn { coordinator: String },
}

impl Mutation {
    /// Reference semantics: the item after the write. `old` is the item the condition held for.
    pub fn apply(&self, key: &str, old: Option<&Record>) -> Record {
        match self {
            Mutation::Acquire(n) => n.record(key),
            Mutation::PutWaiter(w) => (**w).clone(),
            Mutation::Enter { now_ms, holder, .. } => {
                let mut r = old.cloned().unwrap_or_else(|| unleased(key, holder, *now_ms));
                self.update(key, &mut r);
                r
            }
            _ => {
                let mut r = old.expect("an update applies to an existing item").clone();
                self.update(key, &mut r);
                r
            }
        }
    }

    /// An update of the existing item `r`, by the part of the protocol it belongs to (as
    /// `dynamo::render` renders them).
    fn update(&self, key: &str, r: &mut Record) {
        use Mutation::*;
        match self {
            Acquire(_) | PutWaiter(_) => unreachable!("a whole item is written, not updated"),
            Extend { .. } | Release { .. } | ForceRelease { .. } | ClearKeepalive | Revoke { .. } => {
                self.update_lease(r)
            }
            Enqueue { .. } | Delivered | MarkUndelivered { .. } | Unindex | Skip { .. } | WaitsIn { .. } => {
                self.update_queue(r)
            }
            Grant { lease, seq, token } => *r = granted(key, lease, *seq, token, r),
            Enter { .. } | ReleaseTo { .. } | ClearTtl => self.update_state(r),
        }
    }

    /// Heartbeat, release, force-release, keep-alive end, revocation of an undelivered grant.
    fn update_lease(&self, r: &mut Record) {
        match self {
            Mutation::Extend { now_ms, duration_ms, ttl } => {
                let d = duration_ms.or(r.duration_ms).expect("extend needs a duration");
                r.expires_at_ms = Some(now_ms.saturating_add(d));
                r.duration_ms = Some(d);
                r.renewed_at_ms = Some(*now_ms);
                r.ttl = *ttl;
            }
            Mutation::Release { now_ms, ttl } => {
                release(r, *now_ms);
                r.ttl = Some(*ttl);
            }
            Mutation::ForceRelease { now_ms, ttl } => {
                r.fence = r.fence.saturating_add(1);
                r.expires_at_ms = Some(0);
                r.released_at_ms = Some(*now_ms);
                r.keepalive = None;
                r.ttl = Some(*ttl);
            }
            Mutation::ClearKeepalive => r.keepalive = None,
            Mutation::Revoke { now_ms, ttl } => {
                r.expires_at_ms = Some(0);
                r.released_at_ms = Some(*now_ms);
                r.pending_token = None;
                r.keepalive = None;
                r.ttl = *ttl;
            }
            _ => unreachable!("not a lease update: {self:?}"),
        }
    }

    /// The waiter queue's counters and marks, and an in-process waiter's mark (the grant aside).
    fn update_queue(&self, r: &mut Record) {
        match self {
            Mutation::Enqueue { now_ms, start, lease_id, .. } => {
                r.queue_head = Some(r.queue_head.unwrap_or(*start));
                r.queue_tail = Some(r.queue_tail.unwrap_or(*start) + 1);
                r.queue_tail_at_ms = Some(*now_ms);
                r.queue_tail_lease_id = Some(lease_id.clone());
            }
            Mutation::Delivered => r.pending_token = None,
            Mutation::MarkUndelivered { token, .. } => r.pending_token = Some(token.clone()),
            // The embedded store derives its queue index column from the record.
            Mutation::Unindex => {}
            Mutation::Skip { seq } => r.queue_head = Some(*seq),
            Mutation::WaitsIn { coordinator } => r.handed_in = Some(coordinator.clone()),
            _ => unreachable!("not a queue update: {self:?}"),
        }
    }

    /// Work states: entered (from now, no grants yet), and kept until taken (no TTL).
    fn update_state(&self, r: &mut Record) {
        match self {
            Mutation::Enter { now_ms, state, .. } => {
                r.expires_at_ms = Some(*now_ms);
                enter(r, state, *now_ms);
            }
            Mutation::ReleaseTo { now_ms, state, .. } => {
                release(r, *now_ms);
                enter(r, state, *now_ms);
            }
            Mutation::ClearTtl => r.ttl = None,
            _ => unreachable!("not a work-state update: {self:?}"),
        }
    }
}

/// A release: free at min_hold_until, released now, keep-alive removed; fence, holder and
/// lease_id stay.
fn release(r: &mut Record, now_ms: u64) {
    r.expires_at_ms = Some(r.min_hold_until_ms);
    r.released_at_ms = Some(now_ms);
    r.keepalive = None;
}

/// Into work state `state` at `now_ms`, no grants yet, no TTL.
fn enter(r: &mut Record, state: &str, now_ms: u64) {
    r.state = Some(state.to_string());
    r.state_since_ms = Some(now_ms);
    r.attempts = Some(0);
    r.ttl = None;
}

/// The item of a key put into a state that had none: fence 0, `holder`, and no lease_id a
/// caller can send ([`NO_LEASE`]).
fn unleased(key: &str, holder: &str, now_ms: u64) -> Record {
    Record {
        holder: holder.to_string(),
        lease_id: LeaseId::from_string(NO_LEASE),
        acquired_at_ms: now_ms,
        min_hold_until_ms: now_ms,
        ..Record::key_only(key.to_string())
    }
}

/// The head waiter's grant over `old`: the new lease, its queue head moved to `seq` and marked
/// undelivered; the queue tail and, as in an UpdateItem, a work state stay.
fn granted(key: &str, lease: &NewLease, seq: u64, token: &str, old: &Record) -> Record {
    Record {
        queue_head: Some(seq),
        queue_tail: old.queue_tail,
        queue_tail_at_ms: old.queue_tail_at_ms,
        queue_tail_lease_id: old.queue_tail_lease_id.clone(),
        pending_token: Some(token.to_string()),
        state: old.state.clone(),
        state_since_ms: old.state_since_ms,
        attempts: old.attempts,
        ..lease.record(key)
    }
}

/// The result of a conditional write.
#[derive(Debug, Clone, PartialEq)]
pub enum Write {
    /// The condition held; the item as written.
    Applied(Record),
    /// The condition failed; the item as it was (`None`: no item), read in the same request.
    Rejected(Option<Record>),
}

/// Which items a scan returns.
#[derive(Debug, Clone, PartialEq)]
pub enum ScanKind {
    /// Every item (operator listing).
    All,
    /// Items of one keep-alive shard whose keep-alive deadline is after `after_ms`
    /// (DynamoDB: a Query on the sparse `keepalive` index).
    Keepalive { shard: u32, after_ms: u64 },
    /// Items in work state `state` whose index partition is `shard`, in the order they became
    /// free (expiry ascending), those free at `free_at_ms` only when given. Fail-closed held
    /// items (no expiry) are not listed. (DynamoDB: a Query on the sparse `state` index; with
    /// `free_at_ms`, a batch's candidates, it reads only the attributes a candidate is judged
    /// and taken by: key, fence, holder, lease_id, times, state, attempts. Other fields of
    /// those records are absent.)
    State { state: String, shard: String, free_at_ms: Option<u64> },
    /// Lease items of one queue shard ([`QUEUE_SHARD_BASE`] + n) that have queued waiters
    /// or an undelivered grant (DynamoDB: a Query on the sparse `queue` index, keys only: the
    /// records carry the key alone, and the reader gets each item it serves). One entry per key,
    /// however many waiters it has.
    Queue { shard: u32 },
}

/// One page of a scan; pass `next` back as `start` to continue.
#[derive(Debug, Clone, PartialEq)]
pub struct Page {
    pub items: Vec<Record>,
    pub next: Option<String>,
}

#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// A short name for logs and metrics ("dynamodb", "sqlite").
    fn name(&self) -> &'static str;

    /// Read one item (strongly consistent).
    async fn get(&self, key: &str) -> Result<Option<Record>>;

    /// Apply `mutation` if `condition` holds, in one atomic request.
    async fn update(&self, key: &str, condition: &Condition, mutation: &Mutation) -> Result<Write>;

    /// Delete the item if `condition` holds (a served waiter's item leaves the queue this way).
    async fn delete(&self, key: &str, condition: &Condition) -> Result<Write>;

    /// One page of at most `limit` items after `start`.
    async fn scan(&self, kind: &ScanKind, start: Option<&str>, limit: u32) -> Result<Page>;

    /// Evidence of the store's own clock (the `Date` of its answers), when the store is remote:
    /// coordinators check their clock against it before judging or writing expiries. `None`:
    /// the store shares the coordinators' clock (the embedded store, one machine).
    fn clock(&self) -> Option<&ClockSamples> {
        None
    }

    /// How many items a scan of `kind` would return (every page).
    async fn count(&self, kind: &ScanKind) -> Result<u64> {
        count_pages(self, kind).await
    }
}

/// [`Store::count`] by reading every page of the scan.
pub async fn count_pages<S: Store + ?Sized>(store: &S, kind: &ScanKind) -> Result<u64> {
    let (mut n, mut start) = (0u64, None::<String>);
    loop {
        let page = store.scan(kind, start.as_deref(), 1000).await?;
        n += page.items.len() as u64;
        match page.next {
            Some(s) => start = Some(s),
            None => return Ok(n),
        }
    }
}

/// The lease_id of an item put into a state and never leased: no lease_id a caller can send
/// (those are 22..=128 characters) or the coordinator generates.
pub const NO_LEASE: &str = "-";

/// Number of keep-alive shards (partitions of the sparse keep-alive index).
pub const KEEPALIVE_SHARDS: u32 = 8;

/// Keep-alive shard of a key: spreads the sparse index over several partitions.
pub fn keepalive_shard(key: &str, shards: u32) -> u32 {
    // FNV-1a: stable across processes and releases (unlike std's RandomState).
    let mut h: u32 = 0x811c9dc5;
    for b in key.as_bytes() {
        h ^= *b as u32;
        h = h.wrapping_mul(0x01000193);
    }
    h % shards.max(1)
}

/// Separates a lease key from its waiter suffix. Validated keys contain no control character,
/// so no waiter key is ever a lease key, nor a prefix of one.
pub const SEPARATOR: char = '\u{1f}';

/// First shard number of the queue index's partitions (`q_shard`: 1000..1008; numbered apart
/// from the keep-alive shards 0..8, which waiter items of earlier versions shared).
pub const QUEUE_SHARD_BASE: u32 = 1000;

/// Number of queue shards.
pub const QUEUE_SHARDS: u32 = 8;

/// The key of waiter `seq` of `key` (DESIGN.md, "The waiter queue").
pub fn waiter_key(key: &str, seq: u64) -> String {
    format!("{key}{SEPARATOR}q{seq}")
}

/// The lease key and sequence number of a waiter key.
pub fn split_waiter_key(k: &str) -> Option<(&str, u64)> {
    let (key, rest) = k.split_once(SEPARATOR)?;
    Some((key, rest.strip_prefix('q')?.parse().ok()?))
}

/// The queue index partition of a key (of the lease key, for a waiter key).
pub fn queue_shard(k: &str) -> u32 {
    let key = split_waiter_key(k).map_or(k, |(key, _)| key);
    QUEUE_SHARD_BASE + keepalive_shard(key, QUEUE_SHARDS)
}
