//! The writes of the protocol, as data: what an acquire writes ([`NewLease`]) and every other
//! write ([`Mutation`]), with their reference semantics ([`Mutation::apply`], what the embedded
//! store writes and what the DynamoDB expressions of `dynamo::render` do).

use serde_json::{Map, Value};

use super::NO_LEASE;
use crate::model::{Keepalive, LeaseId, Record, SlotHolder};

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
    /// The lease `lease_id` of `holder`, written at `now_ms` for `duration_ms` (none: held
    /// until released) at `fence`; no min_hold, metadata, keep-alive, TTL, poll hint, visit,
    /// hand-over or released lease: those the caller sets.
    pub fn new(holder: &str, lease_id: LeaseId, now_ms: u64, duration_ms: Option<u64>, fence: u64) -> NewLease {
        NewLease {
            holder: holder.to_string(),
            lease_id,
            now_ms,
            duration_ms,
            min_hold_ms: 0,
            metadata: None,
            keepalive: None,
            ttl: None,
            fence,
            poll_ms: None,
            visit: None,
            handed_in: None,
            released: None,
        }
    }

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
            awaited_by: None,
            queue_head: None,
            queue_tail: None,
            queue_tail_at_ms: None,
            freed_at_ms: None,
            pending_token: None,
            queue_tail_lease_id: None,
            released_lease_id: self.released.as_ref().map(|r| r.0.clone()),
            released_fence: self.released.as_ref().map(|r| r.1),
            waiter: None,
            state: self.visit.as_ref().map(|v| v.state.clone()),
            state_since_ms: self.visit.as_ref().map(|v| v.since_ms),
            attempts: self.visit.as_ref().map(|v| v.attempts),
            slots: None,
            slots_taken: None,
            slots_rev: None,
            slot_holders: Vec::new(),
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
    /// The grant was delivered, or its lease ended: the undelivered mark goes, and `freed_at_ms
    /// = now` (the writer's clock): on an ended lease this write frees the key to plain
    /// acquires, and a fail-closed acquire sent before it must not take it.
    Delivered { now_ms: u64 },
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
    /// Pass over the head waiter (gone, timed out, or never written): `queue_head = seq`, and
    /// `freed_at_ms = now` (the last waiter passed over frees the key to plain acquires).
    Skip { seq: u64, now_ms: u64 },
    /// Write a whole waiter item (DynamoDB: a PutItem).
    PutWaiter(Box<Record>),
    /// Put the key into a work state without leasing it: free from `now_ms` (its expiry is set
    /// to it), entered now, no grants yet; the TTL `ttl` (a terminal state) or none (kept until
    /// taken). A new item gets fence 0, `holder` and an empty lease_id (no lease_id a caller
    /// can send).
    Enter { now_ms: u64, holder: String, state: String, shard: String, ttl: Option<u64> },
    /// [`Mutation::Release`] that also moves the key into `state` (entered now, no grants yet)
    /// with the TTL `ttl` (a terminal state) or none (a key in a state is kept until it is taken).
    ReleaseTo { now_ms: u64, state: String, shard: String, ttl: Option<u64> },
    /// Remove the TTL: a key in a work state is kept until it is taken.
    ClearTtl,
    /// A waiter of coordinator `coordinator` waits while another coordinator's line has the key:
    /// it marks the lease (`awaited_by = coordinator`), so the releaser leaves the key free for
    /// it.
    WaitsIn { coordinator: String },
    /// Write a whole semaphore item (DESIGN.md, "Semaphores"; DynamoDB: a PutItem): the first
    /// holder makes the semaphore.
    PutSemaphore(Box<Record>),
    /// Take a slot: the holder's entry, `fence` = its fence, `sem_slots` = `slots`, `sem_rev`
    /// plus one, the TTL; `sem_taken` plus one, or, cleaning (`clean`: the ended entries and the
    /// count left with this holder), the ended entries removed and `sem_taken` set.
    TakeSlot { slot: Box<SlotHolder>, slots: u32, ttl: u64, clean: Option<(Vec<LeaseId>, u32)> },
    /// Renew holder `lease_id`: expiry `now + duration`, renewed now.
    RenewSlot { lease_id: LeaseId, now_ms: u64, duration_ms: u64, ttl: u64 },
    /// Release holder `lease_id`: released and expired now, `sem_taken` - 1.
    ReleaseSlot { lease_id: LeaseId, now_ms: u64, ttl: u64 },
    /// Force-release holders `evicted`: released now, expired at 0, `sem_taken` = `taken`,
    /// fence + 1.
    EvictSlots { evicted: Vec<LeaseId>, now_ms: u64, taken: u32, ttl: u64 },
    /// Remove the ended entries `ended`, `sem_taken` = `taken`.
    TidySlots { ended: Vec<LeaseId>, taken: u32, ttl: u64 },
}

impl Mutation {
    /// Reference semantics: the item after the write. `old` is the item the condition held for.
    pub fn apply(&self, key: &str, old: Option<&Record>) -> Record {
        match self {
            Mutation::Acquire(n) => n.record(key),
            Mutation::PutWaiter(w) | Mutation::PutSemaphore(w) => (**w).clone(),
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
            Acquire(_) | PutWaiter(_) | PutSemaphore(_) => unreachable!("a whole item is written, not updated"),
            TakeSlot { .. } | RenewSlot { .. } | ReleaseSlot { .. } | EvictSlots { .. } | TidySlots { .. } => {
                self.update_slots(r)
            }
            Extend { .. } | Release { .. } | ForceRelease { .. } | ClearKeepalive | Revoke { .. } => {
                self.update_lease(r)
            }
            Enqueue { .. } | Delivered { .. } | MarkUndelivered { .. } | Unindex | Skip { .. } | WaitsIn { .. } => {
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
            Mutation::Delivered { now_ms } => {
                r.pending_token = None;
                r.freed_at_ms = Some(*now_ms);
            }
            Mutation::MarkUndelivered { token, .. } => r.pending_token = Some(token.clone()),
            // The embedded store derives its queue index column from the record.
            Mutation::Unindex => {}
            Mutation::Skip { seq, now_ms } => {
                r.queue_head = Some(*seq);
                r.freed_at_ms = Some(*now_ms);
            }
            Mutation::WaitsIn { coordinator } => r.awaited_by = Some(coordinator.clone()),
            _ => unreachable!("not a queue update: {self:?}"),
        }
    }

    /// Work states: entered (from now, no grants yet), and kept until taken (no TTL) or, in a
    /// terminal state, until its TTL.
    fn update_state(&self, r: &mut Record) {
        match self {
            Mutation::Enter { now_ms, state, ttl, .. } => {
                r.expires_at_ms = Some(*now_ms);
                enter(r, state, *now_ms);
                r.ttl = *ttl;
            }
            Mutation::ReleaseTo { now_ms, state, ttl, .. } => {
                release(r, *now_ms);
                enter(r, state, *now_ms);
                r.ttl = *ttl;
            }
            Mutation::ClearTtl => r.ttl = None,
            _ => unreachable!("not a work-state update: {self:?}"),
        }
    }
}

impl Mutation {
    /// A semaphore's writes (DESIGN.md, "Semaphores"); each bumps `sem_rev`.
    fn update_slots(&self, r: &mut Record) {
        r.slots_rev = Some(r.slots_rev.unwrap_or(0) + 1);
        let slot = |r: &Record, id: &LeaseId| {
            r.slot_holders.iter().position(|h| &h.lease_id == id).expect("the condition found the entry")
        };
        match self {
            Mutation::TakeSlot { slot: h, slots, ttl, clean } => {
                if let Some((ended, taken)) = clean {
                    r.slot_holders.retain(|e| !ended.contains(&e.lease_id));
                    r.slots_taken = Some(*taken);
                } else {
                    r.slots_taken = Some(r.slots_taken.unwrap_or(0) + 1);
                }
                r.slot_holders.push((**h).clone());
                r.fence = h.fence;
                r.slots = Some(*slots);
                r.ttl = Some(*ttl);
            }
            Mutation::RenewSlot { lease_id, now_ms, duration_ms, ttl } => {
                let i = slot(r, lease_id);
                let h = &mut r.slot_holders[i];
                h.expires_at_ms = now_ms + duration_ms;
                h.duration_ms = *duration_ms;
                h.renewed_at_ms = *now_ms;
                r.ttl = Some(*ttl);
            }
            Mutation::ReleaseSlot { lease_id, now_ms, ttl } => {
                let i = slot(r, lease_id);
                r.slot_holders[i].released_at_ms = Some(*now_ms);
                r.slot_holders[i].expires_at_ms = *now_ms;
                r.slots_taken = Some(r.slots_taken.unwrap_or(0).saturating_sub(1));
                r.ttl = Some(*ttl);
            }
            Mutation::EvictSlots { evicted, now_ms, taken, ttl } => {
                for h in r.slot_holders.iter_mut().filter(|h| evicted.contains(&h.lease_id)) {
                    h.released_at_ms = Some(*now_ms);
                    h.expires_at_ms = 0;
                }
                r.slots_taken = Some(*taken);
                r.fence = r.fence.saturating_add(1);
                r.ttl = Some(*ttl);
            }
            Mutation::TidySlots { ended, taken, ttl } => {
                r.slot_holders.retain(|e| !ended.contains(&e.lease_id));
                r.slots_taken = Some(*taken);
                r.ttl = Some(*ttl);
            }
            _ => unreachable!("not a semaphore update: {self:?}"),
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
        // An UpdateItem: the stamp stays (this lease ends by a release, an expiry or a
        // revocation, each dated on its own).
        freed_at_ms: old.freed_at_ms,
        queue_tail_lease_id: old.queue_tail_lease_id.clone(),
        pending_token: Some(token.to_string()),
        state: old.state.clone(),
        state_since_ms: old.state_since_ms,
        attempts: old.attempts,
        ..lease.record(key)
    }
}
