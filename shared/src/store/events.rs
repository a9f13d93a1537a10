//! The lease history's events: who held a key when, with which fence (DESIGN.md, "Lease
//! history"), derived from the item before and after each write.
//!
//! Events are derived by one pure function, [`events`], shared by both stores' paths: the
//! embedded store calls it inside the write's own SQLite transaction (`store::sqlite_history`),
//! and on AWS the history function calls it on each DynamoDB Streams record's old and new
//! images (`history::dynamo`). No request is added to the lease path. It belongs to the store
//! layer because the embedded store's write path needs it; the history module re-exports it.
//!
//! The time of an event is read from the record itself (acquired_at, renewed_at, released_at),
//! so both paths give the same times, and the store's clock does not matter.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::keys::NO_LEASE;
use crate::model::{Record, SlotHolder};

/// What happened to a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A lease was granted on a free key (acquire, a batch's `next`, an in-process waiter).
    Granted,
    /// A lease was granted on a key whose last lease expired unreleased (its holder crashed or
    /// stopped renewing): `previous_holder` / `previous_fence` name it.
    TakenOver,
    /// A renewal that moved the holder's deadline.
    Renewed,
    /// The holder released the lease (`state`: the work state it moved the key into).
    Released,
    /// An operator freed the key; `fence` is the evicted lease's, `holder` its holder.
    ForceReleased,
    /// The queue granted the key to its head waiter (a queued acquire's task token).
    HandedOver,
    /// A hand-over whose waiter was gone was taken back.
    Revoked,
    /// The key was put into a work state without a lease (`state`).
    Put,
}

impl EventKind {
    pub fn as_str(&self) -> &'static str {
        match self {
            EventKind::Granted => "granted",
            EventKind::TakenOver => "taken_over",
            EventKind::Renewed => "renewed",
            EventKind::Released => "released",
            EventKind::ForceReleased => "force_released",
            EventKind::HandedOver => "handed_over",
            EventKind::Revoked => "revoked",
            EventKind::Put => "put",
        }
    }
}

/// One event of a key's history. Never carries a lease_id: only its first
/// [`LEASE_ID_PREFIX_CHARS`] characters, enough to tell leases apart in an incident, far too
/// few to act as one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// When it happened (coordinator clock, epoch ms, as written in the record).
    pub at_ms: u64,
    pub key: String,
    pub kind: EventKind,
    pub holder: String,
    pub fence: u64,
    /// The lease_id's first characters (empty for a key put into a state without a lease).
    pub lease_id_prefix: String,
    /// The work state: moved into by a release, entered by a put, or the state of a granted key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// `taken_over`: the holder and fence of the lease that expired.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_holder: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_fence: Option<u64>,
    /// A semaphore holder's event (DESIGN.md, "Semaphores"): the semaphore's N. `holder`,
    /// `fence` and `lease_id_prefix` are that holder's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots: Option<u32>,
    /// By which interface (see [`set_interface`]): `queue` for hand-overs, `step_functions`
    /// for leases with a keep-alive on an execution, else the process's own (`http` for
    /// `leasehold serve`, `cli`, `lambda`) or `unknown` (the Streams path cannot know it).
    pub interface: String,
}

/// A lease's renewals give a `renewed` event at most once per this long from its grant: the
/// first renewal always, then the first one past each further 15 minutes. A keep-alive lease is
/// renewed every sweep period (a minute by default) and a `leasehold run` lease every third of
/// its duration; the history keeps that the lease was still held, not every beat (one item and
/// one write a minute per keep-alive lease otherwise). Decided from the record alone, so both
/// stores, and a stream record delivered twice, decide the same.
pub const RENEWAL_EVENT_EVERY_MS: u64 = 15 * 60 * 1000;

/// Whether a renewal from `o` to `new` (the same lease) is one the history records.
fn renewal_recorded(o: &Record, new: &Record) -> bool {
    let (Some(before), Some(now)) = (o.renewed_at_ms, new.renewed_at_ms) else { return true };
    // A grant stamps its own time as the last renewal: the first renewal comes after it.
    let first = before <= new.acquired_at_ms;
    let mark = |t: u64| t.saturating_sub(new.acquired_at_ms) / RENEWAL_EVENT_EVERY_MS;
    first || mark(now) > mark(before)
}

/// How many characters of a lease_id an event keeps.
pub const LEASE_ID_PREFIX_CHARS: usize = 6;

/// Default retention of the history: 7 days (`LEASEHOLD_HISTORY_RETENTION_S`).
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// The history's retention: `LEASEHOLD_HISTORY_RETENTION_S` (seconds; 0 keeps no history),
/// else [`DEFAULT_RETENTION`].
pub fn retention() -> Duration {
    std::env::var("LEASEHOLD_HISTORY_RETENTION_S")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_RETENTION)
}

static INTERFACE: OnceLock<&'static str> = OnceLock::new();

const KINDS: [EventKind; 8] = [
    EventKind::Granted,
    EventKind::TakenOver,
    EventKind::Renewed,
    EventKind::Released,
    EventKind::ForceReleased,
    EventKind::HandedOver,
    EventKind::Revoked,
    EventKind::Put,
];

static COUNTS: [AtomicU64; 8] = [const { AtomicU64::new(0) }; 8];

/// Events of `kind` this process recorded (the embedded store's write path counts them): what
/// `leasehold serve`'s `/metrics` reports as expiries taken over.
pub fn counted(kind: EventKind) -> u64 {
    KINDS.iter().position(|k| *k == kind).map_or(0, |i| COUNTS[i].load(Ordering::Relaxed))
}

pub(crate) fn count(events: &[Event]) {
    for e in events {
        if let Some(i) = KINDS.iter().position(|k| *k == e.kind) {
            COUNTS[i].fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Names the interface this process serves (`http`, `cli`, `lambda`), recorded in the events
/// the embedded store writes. The store itself cannot tell who called it; unset, events say
/// `unknown` unless the record shows more (see [`Event::interface`]).
pub fn set_interface(name: &'static str) {
    let _ = INTERFACE.set(name);
}

fn prefix(r: &Record) -> String {
    let id = r.lease_id.expose();
    if id == NO_LEASE {
        return String::new();
    }
    id.chars().take(LEASE_ID_PREFIX_CHARS).collect()
}

fn is_lease(r: &Record) -> bool {
    r.queue.waiter.is_none() && r.fence > 0
}

fn interface_of(r: &Record, kind: EventKind) -> String {
    if kind == EventKind::HandedOver || kind == EventKind::Revoked {
        return "queue".into();
    }
    if r.keepalive.as_ref().is_some_and(|k| k.execution_arn.is_some()) {
        return "step_functions".into();
    }
    INTERFACE.get().copied().unwrap_or("unknown").to_string()
}

fn event(r: &Record, kind: EventKind, at_ms: u64) -> Event {
    Event {
        at_ms,
        key: r.key.clone(),
        kind,
        holder: r.holder.clone(),
        fence: r.fence,
        lease_id_prefix: prefix(r),
        state: None,
        previous_holder: None,
        previous_fence: None,
        slots: None,
        interface: interface_of(r, kind),
    }
}

/// One event of the semaphore `r`'s holder `h`.
fn slot_event(r: &Record, h: &SlotHolder, kind: EventKind, at_ms: u64) -> Event {
    Event {
        holder: h.holder.clone(),
        fence: h.fence,
        lease_id_prefix: h.lease_id.expose().chars().take(LEASE_ID_PREFIX_CHARS).collect(),
        slots: r.semaphore.slots,
        ..event(r, kind, at_ms)
    }
}

/// The events of a write to a semaphore (DESIGN.md, "Semaphores"), each of one holder, from the
/// holders' map before and after it: a new entry is `granted` (`taken_over` when the same write
/// cleaned away a holder that had expired unreleased, or replaced a plain lease that had: the
/// earliest such one is named), an entry newly released is `released` (`force_released` when an
/// operator evicted it: its expiry set to 0), and a live entry whose expiry moved is `renewed`.
/// Entries cleaned away give none of their own.
fn slot_events(old: Option<&Record>, new: &Record) -> Vec<Event> {
    let before: &[SlotHolder] = old.filter(|o| o.semaphore.slots.is_some()).map_or(&[], |o| &o.semaphore.slot_holders);
    let mut out = Vec::new();
    for h in &new.semaphore.slot_holders {
        let Some(o) = before.iter().find(|o| o.lease_id == h.lease_id) else {
            let at = h.acquired_at_ms;
            let expired = |e: Option<u64>| e.is_some_and(|e| e <= at);
            let cleaned = before
                .iter()
                .filter(|o| {
                    o.released_at_ms.is_none() && expired(Some(o.expires_at_ms)) && new.slot(&o.lease_id).is_none()
                })
                .min_by_key(|o| o.expires_at_ms)
                .map(|o| (o.holder.clone(), o.fence));
            let plain = old
                .filter(|o| {
                    o.semaphore.slots.is_none() && is_lease(o) && o.released_at_ms.is_none() && expired(o.expires_at_ms)
                })
                .map(|o| (o.holder.clone(), o.fence));
            let mut e = slot_event(new, h, EventKind::Granted, at);
            if let Some((holder, fence)) = cleaned.or(plain) {
                (e.kind, e.previous_holder, e.previous_fence) = (EventKind::TakenOver, Some(holder), Some(fence));
            }
            out.push(e);
            continue;
        };
        match (o.released_at_ms, h.released_at_ms) {
            (None, Some(at)) => {
                let kind = if h.expires_at_ms == 0 { EventKind::ForceReleased } else { EventKind::Released };
                out.push(slot_event(new, h, kind, at));
            }
            (None, None) if h.expires_at_ms != o.expires_at_ms => {
                out.push(slot_event(new, h, EventKind::Renewed, h.renewed_at_ms));
            }
            _ => {}
        }
    }
    out
}

/// The events of one write: the item before (`None`: there was none) and after (`None`: it was
/// deleted). Waiter items, deletions (a TTL sweep, a served waiter) and writes that change no
/// holder, deadline or state (a delivery mark, a queue counter, a keep-alive cleared) give none.
/// A write that ends a live lease and grants the next one (a release handing the key to a
/// waiter) gives two events: the release, then the grant.
pub fn events(old: Option<&Record>, new: Option<&Record>) -> Vec<Event> {
    let Some(new) = new else { return vec![] };
    if new.queue.waiter.is_some() || old.is_some_and(|o| o.queue.waiter.is_some()) {
        return vec![];
    }
    // A semaphore's events are its holders'; its item's own attributes are no lease.
    if new.semaphore.slots.is_some() {
        return slot_events(old, new);
    }
    if old.is_some_and(|o| o.semaphore.slots.is_some()) {
        return vec![];
    }
    let old = old.filter(|o| is_lease(o) || o.work.state.is_some());
    let mut out = Vec::new();
    let new_lease = is_lease(new) && old.is_none_or(|o| o.lease_id != new.lease_id);
    if new_lease {
        let at = new.acquired_at_ms;
        let handed = new.queue.pending_token.is_some() && old.is_none_or(|o| o.queue.pending_token.is_none());
        let mut kind = if handed { EventKind::HandedOver } else { EventKind::Granted };
        if let Some(o) = old.filter(|o| is_lease(o) && o.released_at_ms.is_none()) {
            if o.expires_at_ms.is_none_or(|e| e > at) {
                // Still live when this write landed: this write released it (a release that
                // hands the key on in the same write).
                out.push(event(o, EventKind::Released, at));
            } else if !handed {
                kind = EventKind::TakenOver;
            }
        }
        let mut e = event(new, kind, at);
        e.state = new.work.state.clone();
        if kind == EventKind::TakenOver {
            let o = old.expect("taken over from a lease");
            e.previous_holder = Some(o.holder.clone());
            e.previous_fence = Some(o.fence);
        }
        out.push(e);
        return out;
    }
    let Some(o) = old else {
        // A key put into a state without a lease (a new item of fence 0).
        if new.work.state.is_some() {
            let mut e = event(new, EventKind::Put, new.work.state_since_ms.unwrap_or(new.acquired_at_ms));
            e.state = new.work.state.clone();
            out.push(e);
        }
        return out;
    };
    // The same lease (or a key that is no lease), changed.
    let released_now = o.released_at_ms.is_none() && new.released_at_ms.is_some();
    if is_lease(o) && new.fence > o.fence {
        let at = new.released_at_ms.unwrap_or(new.acquired_at_ms);
        out.push(event(o, EventKind::ForceReleased, at));
    } else if released_now && o.queue.pending_token.is_some() && new.queue.pending_token.is_none() {
        out.push(event(new, EventKind::Revoked, new.released_at_ms.unwrap_or(0)));
    } else if released_now {
        let mut e = event(new, EventKind::Released, new.released_at_ms.unwrap_or(0));
        if new.work.state != o.work.state || new.work.state_since_ms != o.work.state_since_ms {
            e.state = new.work.state.clone();
        }
        out.push(e);
    } else if new.work.state.is_some()
        && (new.work.state != o.work.state || new.work.state_since_ms != o.work.state_since_ms)
    {
        let mut e = event(new, EventKind::Put, new.work.state_since_ms.unwrap_or(0));
        e.state = new.work.state.clone();
        out.push(e);
    } else if is_lease(new)
        && new.released_at_ms.is_none()
        && new.expires_at_ms != o.expires_at_ms
        && renewal_recorded(o, new)
    {
        out.push(event(new, EventKind::Renewed, new.renewed_at_ms.unwrap_or(0)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Keepalive, LeaseId, SemaphoreFields, SlotHolder};
    use crate::store::{
        KeepaliveMutation, LeaseMutation, Mutation, NewLease, QueueMutation, SemaphoreMutation, Visit, WorkMutation,
    };

    fn lease(holder: &str, id: &str, now: u64, fence: u64) -> NewLease {
        NewLease::new(holder, LeaseId::from_string(id), now, Some(1000), fence)
    }

    fn apply(m: &Mutation, old: Option<&Record>) -> (Record, Vec<Event>) {
        let new = m.apply("k", old);
        let ev = events(old, Some(&new));
        (new, ev)
    }

    fn kinds(ev: &[Event]) -> Vec<(EventKind, &str, u64, u64)> {
        ev.iter().map(|e| (e.kind, e.holder.as_str(), e.fence, e.at_ms)).collect()
    }

    /// A keep-alive lease renewed every minute for two hours: its first renewal, then one per
    /// 15 minutes from the grant (8), not 120; the same records decide the same again.
    #[test]
    fn renewals_are_recorded_at_most_once_per_fifteen_minutes() {
        let minute = 60_000;
        let (mut r, _) =
            apply(&Mutation::Lease(LeaseMutation::Acquire(lease("a", "aaaaaaaaaaaaaaaaaaaaaaaa", 1_000, 10))), None);
        let mut at = Vec::new();
        for i in 1..=120 {
            let now = 1_000 + i * minute;
            let (next, ev) =
                apply(&Mutation::Lease(LeaseMutation::Extend { now_ms: now, duration_ms: None, ttl: None }), Some(&r));
            assert!(ev.iter().all(|e| e.kind == EventKind::Renewed && e.at_ms == now), "{ev:?}");
            assert_eq!(events(Some(&r), Some(&next)), ev, "decided from the records alone");
            at.extend(ev.iter().map(|e| (e.at_ms - 1_000) / minute));
            r = next;
        }
        assert_eq!(at, vec![1, 15, 30, 45, 60, 75, 90, 105, 120]);
    }

    #[test]
    fn a_lease_s_life() {
        use EventKind::*;
        let (r, ev) =
            apply(&Mutation::Lease(LeaseMutation::Acquire(lease("a", "aaaaaaaaaaaaaaaaaaaaaaaa", 100, 10))), None);
        assert_eq!(kinds(&ev), vec![(Granted, "a", 10, 100)]);
        assert_eq!(ev[0].lease_id_prefix, "aaaaaa");
        // A renewal that moves the deadline; one that does not (same instant) gives nothing.
        let (r, ev) =
            apply(&Mutation::Lease(LeaseMutation::Extend { now_ms: 200, duration_ms: None, ttl: None }), Some(&r));
        assert_eq!(kinds(&ev), vec![(Renewed, "a", 10, 200)]);
        assert!(events(Some(&r), Some(&r)).is_empty());
        // Expired unreleased, then taken by b: taken over from a.
        let (r, ev) =
            apply(&Mutation::Lease(LeaseMutation::Acquire(lease("b", "bbbbbbbbbbbbbbbbbbbbbbbb", 5000, 11))), Some(&r));
        assert_eq!(kinds(&ev), vec![(TakenOver, "b", 11, 5000)]);
        assert_eq!((ev[0].previous_holder.as_deref(), ev[0].previous_fence), (Some("a"), Some(10)));
        // Released into a state.
        let (r, ev) = apply(
            &Mutation::Work(WorkMutation::ReleaseTo {
                now_ms: 5100,
                state: "DONE".into(),
                shard: "DONE#0".into(),
                ttl: None,
            }),
            Some(&r),
        );
        assert_eq!(kinds(&ev), vec![(Released, "b", 11, 5100)]);
        assert_eq!(ev[0].state.as_deref(), Some("DONE"));
        // A plain release of a lease that was already released: nothing.
        assert!(events(Some(&r), Some(&r)).is_empty());
        // Granted again after a release: a grant, not a take-over.
        let (r, ev) =
            apply(&Mutation::Lease(LeaseMutation::Acquire(lease("c", "cccccccccccccccccccccccc", 6000, 12))), Some(&r));
        assert_eq!(kinds(&ev), vec![(Granted, "c", 12, 6000)]);
        // Force-released: the evicted lease's holder and fence.
        let (r, ev) = apply(&Mutation::Lease(LeaseMutation::ForceRelease { now_ms: 6100, ttl: 1 }), Some(&r));
        assert_eq!(kinds(&ev), vec![(ForceReleased, "c", 12, 6100)]);
        assert_eq!(r.fence, 13);
        // Queue counters and delivery marks are no events.
        let (r, ev) = apply(
            &Mutation::Queue(QueueMutation::Enqueue {
                now_ms: 6200,
                start: 1,
                lease_id: LeaseId::from_string("w"),
                shard: 1000,
            }),
            Some(&r),
        );
        assert!(ev.is_empty());
        let (_, ev) = apply(&Mutation::Keepalive(KeepaliveMutation::ClearKeepalive), Some(&r));
        assert!(ev.is_empty());
    }

    #[test]
    fn hand_overs_and_a_release_that_hands_on() {
        use EventKind::*;
        let (r, _) =
            apply(&Mutation::Lease(LeaseMutation::Acquire(lease("a", "aaaaaaaaaaaaaaaaaaaaaaaa", 100, 10))), None);
        let (r, _) = apply(
            &Mutation::Queue(QueueMutation::Enqueue {
                now_ms: 150,
                start: 1,
                lease_id: LeaseId::from_string("w"),
                shard: 1000,
            }),
            Some(&r),
        );
        // The release grants the head waiter in its own write: released, then handed over.
        let grant = Mutation::Queue(QueueMutation::Grant {
            lease: lease("w", "wwwwwwwwwwwwwwwwwwwwwwww", 300, 11),
            seq: 2,
            token: "t".into(),
        });
        let (r, ev) = apply(&grant, Some(&r));
        assert_eq!(kinds(&ev), vec![(Released, "a", 10, 300), (HandedOver, "w", 11, 300)]);
        assert_eq!((ev[0].interface.as_str(), ev[1].interface.as_str()), ("unknown", "queue"));
        let (r, ev) = apply(&Mutation::Queue(QueueMutation::Delivered { now_ms: 1 }), Some(&r));
        assert!(ev.is_empty());
        // A grant of a free key to the head waiter after an expiry is a hand-over.
        let (r2, _) = apply(
            &Mutation::Queue(QueueMutation::Enqueue {
                now_ms: 400,
                start: 1,
                lease_id: LeaseId::from_string("w"),
                shard: 1000,
            }),
            Some(&r),
        );
        let grant = Mutation::Queue(QueueMutation::Grant {
            lease: lease("x", "xxxxxxxxxxxxxxxxxxxxxxxx", 9000, 12),
            seq: 3,
            token: "u".into(),
        });
        let (r3, ev) = apply(&grant, Some(&r2));
        assert_eq!(kinds(&ev), vec![(HandedOver, "x", 12, 9000)]);
        let (_, ev) = apply(&Mutation::Queue(QueueMutation::Revoke { now_ms: 9100, ttl: Some(1) }), Some(&r3));
        assert_eq!(kinds(&ev), vec![(Revoked, "x", 12, 9100)]);
    }

    fn holder(name: &str, id: &str, now: u64, fence: u64, duration: u64) -> SlotHolder {
        SlotHolder {
            lease_id: LeaseId::from_string(id),
            fence,
            holder: name.into(),
            acquired_at_ms: now,
            renewed_at_ms: now,
            expires_at_ms: now + duration,
            duration_ms: duration,
            released_at_ms: None,
            metadata: None,
            keepalive: None,
        }
    }

    fn take(h: SlotHolder, clean: Option<(Vec<LeaseId>, u32)>) -> Mutation {
        Mutation::Semaphore(SemaphoreMutation::TakeSlot {
            slot: Box::new(h),
            slots: 2,
            ttl: 1,
            clean,
            cleaned_at: None,
        })
    }

    /// Each holder of a semaphore has its own events, with its holder, fence and lease_id's
    /// start, and the semaphore's N; cleaning and tidying give none of their own.
    #[test]
    fn a_semaphore_s_holders() {
        use EventKind::*;
        let id = |s: &str| LeaseId::from_string(s.repeat(24));
        // A plain lease expired unreleased: the take that makes the semaphore takes it over.
        let (plain, _) =
            apply(&Mutation::Lease(LeaseMutation::Acquire(lease("p", "pppppppppppppppppppppppp", 100, 10))), None);
        let first = holder("a", &"a".repeat(24), 5000, 16, 1000);
        let mut sem = Record {
            semaphore: SemaphoreFields {
                slots: Some(2),
                slots_taken: Some(1),
                slots_rev: Some(1),
                slot_holders: vec![first],
                cleaned_at_ms: None,
            },
            fence: 16,
            lease_id: LeaseId::from_string(NO_LEASE),
            ..Record::key_only("k".into())
        };
        sem.holder = "a".into();
        let (r, ev) = apply(&Mutation::Semaphore(SemaphoreMutation::PutSemaphore(Box::new(sem))), Some(&plain));
        assert_eq!(kinds(&ev), vec![(TakenOver, "a", 16, 5000)]);
        assert_eq!(
            (ev[0].previous_holder.as_deref(), ev[0].previous_fence, ev[0].slots),
            (Some("p"), Some(10), Some(2))
        );
        assert_eq!(ev[0].lease_id_prefix, "aaaaaa");
        let (r, ev) = apply(&take(holder("b", &"b".repeat(24), 5100, 17, 1000), None), Some(&r));
        assert_eq!(kinds(&ev), vec![(Granted, "b", 17, 5100)]);
        let renew = Mutation::Semaphore(SemaphoreMutation::RenewSlot {
            lease_id: id("b"),
            now_ms: 5200,
            duration_ms: 1000,
            ttl: 1,
        });
        let (r, ev) = apply(&renew, Some(&r));
        assert_eq!(kinds(&ev), vec![(Renewed, "b", 17, 5200)]);
        let (r, ev) = apply(
            &Mutation::Semaphore(SemaphoreMutation::ReleaseSlot { lease_id: id("b"), now_ms: 5300, ttl: 1 }),
            Some(&r),
        );
        assert_eq!(kinds(&ev), vec![(Released, "b", 17, 5300)]);
        // A released again: nothing changes, nothing recorded.
        assert!(events(Some(&r), Some(&r)).is_empty());
        // a expired unreleased at 6000; c's take cleans a and b away: taken over from a.
        let (r, ev) =
            apply(&take(holder("c", &"c".repeat(24), 7000, 18, 1000), Some((vec![id("a"), id("b")], 1))), Some(&r));
        assert_eq!(kinds(&ev), vec![(TakenOver, "c", 18, 7000)]);
        assert_eq!((ev[0].previous_holder.as_deref(), ev[0].previous_fence), (Some("a"), Some(16)));
        let (r, ev) = apply(&take(holder("d", &"d".repeat(24), 7100, 19, 1000), None), Some(&r));
        assert_eq!(kinds(&ev), vec![(Granted, "d", 19, 7100)]);
        // An operator evicts both: one event each, with the evicted holder's fence.
        let evict = Mutation::Semaphore(SemaphoreMutation::EvictSlots {
            evicted: vec![id("c"), id("d")],
            now_ms: 7200,
            taken: 0,
            ttl: 1,
        });
        let (r, ev) = apply(&evict, Some(&r));
        assert_eq!(kinds(&ev), vec![(ForceReleased, "c", 18, 7200), (ForceReleased, "d", 19, 7200)]);
        // A tidy removes ended entries: nothing recorded.
        let (_, ev) = apply(
            &Mutation::Semaphore(SemaphoreMutation::TidySlots {
                ended: vec![id("c"), id("d")],
                taken: 0,
                ttl: 1,
                cleaned_at: None,
            }),
            Some(&r),
        );
        assert!(ev.is_empty());
    }

    #[test]
    fn work_items_and_interfaces() {
        use EventKind::*;
        let put = Mutation::Work(WorkMutation::Enter {
            now_ms: 50,
            holder: "p".into(),
            state: "PENDING".into(),
            shard: "PENDING#0".into(),
            ttl: None,
        });
        let (r, ev) = apply(&put, None);
        assert_eq!(kinds(&ev), vec![(Put, "p", 0, 50)]);
        assert_eq!((ev[0].state.as_deref(), ev[0].lease_id_prefix.as_str()), (Some("PENDING"), ""));
        let mut l = lease("w", "wwwwwwwwwwwwwwwwwwwwwwww", 100, 20);
        l.visit = Some(Visit { state: "PENDING".into(), shard: "PENDING#0".into(), since_ms: 50, attempts: 1 });
        l.keepalive = Some(Keepalive { until_ms: 999, execution_arn: Some("arn:x".into()) });
        let (_, ev) = apply(&Mutation::Lease(LeaseMutation::Acquire(l)), Some(&r));
        assert_eq!(kinds(&ev), vec![(Granted, "w", 20, 100)]);
        assert_eq!((ev[0].state.as_deref(), ev[0].interface.as_str()), (Some("PENDING"), "step_functions"));
        // Deletions give nothing.
        assert!(events(Some(&r), None).is_empty());
    }
}
