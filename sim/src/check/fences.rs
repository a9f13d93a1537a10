//! Fences: strictly increasing in grant order, never copied past the fence lead, never deleted
//! by TTL before the clocks reached them; a lease_id granted once.

use leasehold::store::LeaseMutation;
use leasehold::store::QueueMutation;
use leasehold::store::SemaphoreMutation;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use leasehold::store::Mutation;
use leasehold::testing::Applied;

use super::{blind, short, true_us};
use crate::violation::Violation;
use crate::world::Event;

/// Fences strictly increase in grant order; a lease_id is granted once.
pub(super) fn fences(events: &[Event], log: &[Applied], out: &mut Vec<Violation>) {
    // When each lease was first told to a client.
    let mut told: BTreeMap<(&str, &str), Instant> = BTreeMap::new();
    for e in events {
        if let Event::Told { key, lease, at, .. } = e {
            told.entry((key.as_str(), lease.as_str())).or_insert(*at);
        }
    }
    // When each lease was last told to a client (a renewal included).
    let mut told_after: BTreeMap<(&str, &str), Instant> = BTreeMap::new();
    for e in events {
        if let Event::Told { key, lease, at, .. } = e {
            told_after.insert((key.as_str(), lease.as_str()), *at);
        }
    }
    let mut top: BTreeMap<&str, u64> = BTreeMap::new();
    let mut granted: BTreeSet<(&str, &str)> = BTreeSet::new();
    let mut seqs: BTreeSet<(&str, u64)> = BTreeSet::new();
    for a in log {
        if let Some((fence, lease_id)) = slot_granted(a) {
            // A semaphore's slot: above every fence of the key, and a lease_id once.
            let before = top.get(a.key.as_str()).copied().unwrap_or(0);
            if fence <= before {
                let mut v = Violation::new(
                    "fence_not_increasing",
                    &a.key,
                    format!("a slot was granted fence {fence} after fence {before}"),
                );
                v.at = Some(a.at);
                out.push(v);
            }
            if !granted.insert((a.key.as_str(), lease_id)) {
                let mut v = Violation::new(
                    "lease_id_granted_twice",
                    &a.key,
                    format!("slot {} was granted a second time", short(lease_id)),
                );
                v.at = Some(a.at);
                out.push(v);
            }
        }
        let grant = match a.mutation.as_ref() {
            Some(Mutation::Lease(LeaseMutation::Acquire(n))) => Some(n),
            Some(Mutation::Queue(QueueMutation::Grant { lease, .. })) => Some(lease),
            _ => None,
        };
        if let Some(n) = grant {
            let before = top.get(a.key.as_str()).copied().unwrap_or(0);
            if n.fence <= before {
                let mut v = Violation::new(
                    "fence_not_increasing",
                    &a.key,
                    format!("a grant wrote fence {} after fence {before}", n.fence),
                );
                v.at = Some(a.at);
                out.push(v);
            }
            // A queue sequence number granted again (reported by `queues`).
            let reused = match a.mutation.as_ref() {
                Some(Mutation::Queue(QueueMutation::Grant { seq, .. })) => !seqs.insert((a.key.as_str(), *seq)),
                _ => false,
            };
            if !granted.insert((a.key.as_str(), n.lease_id.expose())) && !reused {
                out.push(granted_again(a, n.lease_id.expose(), &told, &told_after));
            }
        }
        for r in [&a.old, &a.new].into_iter().flatten() {
            let t = top.entry(a.key.as_str()).or_default();
            *t = (*t).max(r.fence);
        }
    }
}

/// A lease_id granted a second time on a key, by the write `a`: a violation once a holder was
/// told of the first grant.
fn granted_again(
    a: &Applied,
    id: &str,
    told: &BTreeMap<(&str, &str), Instant>,
    told_after: &BTreeMap<(&str, &str), Instant>,
) -> Violation {
    // Known finding when nobody was told of the first grant (a coordinator's retry of its own
    // generated id, after the first attempt's lost grant expired and another lease came and
    // went): no holder ever believed it twice.
    let was_told = told.get(&(a.key.as_str(), id)).is_some_and(|t| *t < a.at);
    // Known finding when the second grant is a queue grant nobody was told of: a retried queued
    // acquire took a second slot while the waiter item of its first was there, and both slots
    // were granted; only one delivery can reach the task. A retry now keeps its earlier slot
    // when it finds that item; left: the earlier item landing after the retry looked
    // (sim/README.md, "Known findings").
    let second_told = told_after.get(&(a.key.as_str(), id)).is_some_and(|t| *t > a.at);
    let queued_untold =
        was_told && !second_told && matches!(a.mutation, Some(Mutation::Queue(QueueMutation::Grant { .. })));
    let kind = if queued_untold {
        "queued_lease_id_regranted"
    } else if was_told {
        "lease_id_granted_twice"
    } else {
        "lease_id_regranted_untold"
    };
    let mut v = Violation::new(kind, &a.key, format!("lease {} was granted a second time", short(id)));
    v.at = Some(a.at);
    v.known = !was_told || queued_untold;
    v
}

/// The slot a write granted, if it took one: its fence and lease_id.
pub(super) fn slot_granted(a: &Applied) -> Option<(u64, &str)> {
    match a.mutation.as_ref()? {
        Mutation::Semaphore(SemaphoreMutation::TakeSlot { slot, .. }) => Some((slot.fence, slot.lease_id.expose())),
        Mutation::Semaphore(SemaphoreMutation::PutSemaphore(r)) => {
            r.semaphore.slot_holders.iter().find(|h| h.fence == r.fence).map(|h| (h.fence, h.lease_id.expose()))
        }
        _ => None,
    }
}

/// A coordinator never grants a fence further ahead of its clock than the fence lead
/// (DESIGN.md, "acquire": a `last_fence_seen` further ahead is never copied): honest clocks are
/// within the margin of the truth, so no grant to a client of an honest coordinator is further
/// ahead of the true clock than the lead and the margin. (A blind clock's own grants are its
/// clock's reading, far ahead: they are the fault, not the protocol.)
pub(super) fn copied_past_lead(log: &[Applied], t0: Instant, lead: Duration, out: &mut Vec<Violation>) {
    let bound = (lead + Duration::from_millis(crate::SKEW_MARGIN_MS)).as_micros() as u64;
    for a in log {
        let lease = match a.mutation.as_ref() {
            Some(Mutation::Lease(LeaseMutation::Acquire(n))) => n,
            Some(Mutation::Queue(QueueMutation::Grant { lease, .. })) => lease,
            _ => continue,
        };
        let now = true_us(t0, a.at);
        if !blind(&lease.holder) && lease.fence > now + bound {
            let mut v = Violation::new(
                "fence_copied_past_lead",
                &a.key,
                format!(
                    "{} was granted fence {}, {} ms ahead of the clock (the lead allows {} ms)",
                    lease.holder,
                    lease.fence,
                    (lease.fence - now) / 1000,
                    lead.as_millis()
                ),
            );
            v.at = Some(a.at);
            out.push(v);
        }
    }
}

/// TTL deletes an item only once the true clock has passed its fence (DESIGN.md, "The fencing
/// token", 3): the first grant after the deletion issues a fence from its clock, which
/// would be below the one deleted. Honest fences are a clock reading within the margin, or one
/// more than an earlier fence; a fence copied from a clock far ahead (a blind one) must never be
/// copied past the fence lead, and its item's TTL counts from the fence's own time.
pub(super) fn deleted_before_its_fence(log: &[Applied], t0: Instant, out: &mut Vec<Violation>) {
    for a in log.iter().filter(|a| a.ttl) {
        let Some(old) = &a.old else { continue };
        let true_us = true_us(t0, a.at);
        if old.fence > true_us {
            let mut v = Violation::new(
                "deleted_before_its_fence",
                &a.key,
                format!(
                    "TTL deleted the item of fence {} while the clock was {} ms behind it: the next grant's fence is lower",
                    old.fence,
                    (old.fence - true_us) / 1000
                ),
            );
            v.at = Some(a.at);
            out.push(v);
        }
    }
}
