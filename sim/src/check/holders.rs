//! One holder at a time: no two leases of a key believed at once (N for a semaphore), the
//! guarded resource never refusing a holder within its safe time, and no grant told late.

use leasehold::store::{LeaseMutation, SemaphoreMutation};
use std::collections::BTreeMap;
use std::time::Instant;

use leasehold::store::Mutation;
use leasehold::testing::Applied;

use super::{blind, ms, short};
use crate::violation::Violation;
use crate::world::Event;

/// One lease believed: from, until, its lease_id, its client, and whether it is a slot.
type Belief<'a> = (Instant, Instant, &'a str, &'a str, bool);

/// No two leases of one key believed at once.
pub(super) fn overlaps(events: &[Event], log: &[Applied], t0: Instant, out: &mut Vec<Violation>) {
    // Per lease: its end, and per key the force-releases as they landed (a retried one may land
    // late, and evict a later lease: the operator's action, not the protocol's).
    let mut ends: BTreeMap<(&str, &str), Instant> = BTreeMap::new();
    for e in events {
        if let Event::End { key, lease, at } = e {
            ends.entry((key.as_str(), lease.as_str())).or_insert(*at);
        }
    }
    let forces = forces(log);
    fenced_out(events, &forces, out);
    // Per key: belief intervals (start, stop, lease, client).
    let far = t0 + std::time::Duration::from_secs(1 << 30);
    let mut beliefs: BTreeMap<&str, Vec<Belief>> = BTreeMap::new();
    for e in events {
        let Event::Told { key, lease, fence, at, until, client, slot, .. } = e else { continue };
        let mut stop = until.unwrap_or(far);
        if let Some(end) = ends.get(&(key.as_str(), lease.as_str())) {
            stop = stop.min(*end);
        }
        // An operator's force-release evicts the lease it found (and every older one), even
        // one whose holder is told of a renewal after it landed.
        if let Some((f, _)) = forces.get(key.as_str()).and_then(|fs| fs.iter().find(|(_, old)| *old >= *fence)) {
            stop = stop.min((*f).max(*at));
        }
        if stop > *at {
            beliefs.entry(key.as_str()).or_default().push((*at, stop, lease.as_str(), client.as_str(), *slot));
        }
    }
    for (key, mut list) in beliefs {
        list.sort();
        if let Some(n) = slots(key) {
            over_slots(key, n, &list, t0, out);
            continue;
        }
        let mut active: Vec<(Instant, &str, &str)> = Vec::new();
        for (start, stop, lease, client, _) in list {
            active.retain(|(s, _, _)| *s > start);
            // A coordinator with a blind clock takes keys over their holders (see
            // `Settings::blind_clock`): its overlaps are the clock error's, not the protocol's.
            let other = active.iter().find(|(_, l, c)| *l != lease && !blind(c) && !blind(client));
            if let Some((other_stop, other, other_client)) = other {
                let mut v = Violation::new(
                    "two_holders",
                    key,
                    format!(
                        "{client} was told lease {} at {} ms while {other_client} believed lease {} until {} ms",
                        short(lease),
                        ms(t0, start),
                        short(other),
                        ms(t0, *other_stop)
                    ),
                );
                v.at = Some(start);
                out.push(v);
                return;
            }
            active.push((stop, lease, client));
        }
    }
}

/// A holder refused by the guarded resource within its safe time: a newer lease wrote while it
/// believed it held the key (unless an operator evicted it, or a coordinator with a blind clock
/// took the key over: the fence refusing it is the defence left then).
fn fenced_out(events: &[Event], forces: &BTreeMap<&str, Vec<(Instant, u64)>>, out: &mut Vec<Violation>) {
    for e in events {
        let Event::Wrote { key, lease, fence, at, accepted: false, believed: true } = e else { continue };
        let evicted = forces.get(key.as_str()).is_some_and(|fs| fs.iter().any(|(f, old)| *old >= *fence && f <= at));
        let blinded = events.iter().any(|b| {
            matches!(b, Event::Told { key: k, fence: f, at: t, client, .. }
                if k == key && f > fence && t <= at && blind(client))
        });
        if !evicted && !blinded {
            let mut v = Violation::new(
                "fenced_out_while_safe",
                key,
                format!(
                    "lease {} (fence {fence}) was refused by the guarded resource within its safe time",
                    short(lease)
                ),
            );
            v.at = Some(*at);
            out.push(v);
        }
    }
}

/// The N of a semaphore's key (`crate::session::SEMAPHORES`), or `None` for a plain key.
pub(super) fn slots(key: &str) -> Option<u32> {
    crate::session::SEMAPHORES.iter().find(|(k, _)| *k == key).map(|(_, n)| *n)
}

/// A semaphore of N slots: at no instant do more than N leases believe they hold a slot, and a
/// plain lease on the key (granted where no semaphore item was) is believed alone: it
/// weighs all N (`list`: belief intervals sorted by their start, each marked if a slot).
pub(super) fn over_slots(key: &str, n: u32, list: &[Belief], t0: Instant, out: &mut Vec<Violation>) {
    let mut active: Vec<(Instant, &str, &str, bool)> = Vec::new();
    for &(start, stop, lease, client, slot) in list {
        // A coordinator with a blind clock takes slots over their holders (see
        // `Settings::blind_clock`): its holds are the clock error's, not the protocol's.
        if blind(client) {
            continue;
        }
        active.retain(|(s, l, _, _)| *s > start && *l != lease);
        active.push((stop, lease, client, slot));
        let weight: u32 = active.iter().map(|(_, _, _, slot)| if *slot { 1 } else { n }).sum();
        if weight > n {
            let others: Vec<String> = active
                .iter()
                .map(|(_, l, c, slot)| format!("{c} ({}{})", short(l), if *slot { "" } else { ", plain" }))
                .collect();
            let mut v = Violation::new(
                "over_slots",
                key,
                format!(
                    "{} leases believed a slot of {n} at {} ms: {}",
                    active.len(),
                    ms(t0, start),
                    others.join(", ")
                ),
            );
            v.at = Some(start);
            out.push(v);
            return;
        }
    }
}

/// Where force-releases landed: per key, when and over which fence.
pub(super) fn forces(log: &[Applied]) -> BTreeMap<&str, Vec<(Instant, u64)>> {
    let mut out: BTreeMap<&str, Vec<(Instant, u64)>> = BTreeMap::new();
    for a in log {
        let Some(old) = &a.old else { continue };
        match &a.mutation {
            Some(Mutation::Lease(LeaseMutation::ForceRelease { .. })) => {
                out.entry(a.key.as_str()).or_default().push((a.at, old.fence))
            }
            // A semaphore's force-release evicts its holders (in writes of a chunk each): every
            // slot up to the highest fence evicted.
            Some(Mutation::Semaphore(SemaphoreMutation::EvictSlots { evicted, .. })) => {
                let holders = old.semaphore.slot_holders.iter();
                if let Some(f) = holders.filter(|h| evicted.contains(&h.lease_id)).map(|h| h.fence).max() {
                    out.entry(a.key.as_str()).or_default().push((a.at, f));
                }
            }
            _ => {}
        }
    }
    out
}

/// A grant or renewal is never handed to a holder after its safe time has passed (a late
/// answer is released, not told).
pub(super) fn told_in_time(events: &[Event], t0: Instant, out: &mut Vec<Violation>) {
    for e in events {
        let Event::Told { key, lease, at, until: Some(until), client, batch, .. } = e else { continue };
        if until < at {
            let mut v = Violation::new(
                if *batch { "batch_lease_told_late" } else { "told_past_safe_time" },
                key,
                format!(
                    "{client} was told lease {} {} ms after its safe time",
                    short(lease),
                    ms(t0, *at) - ms(t0, *until)
                ),
            );
            v.at = Some(*at);
            out.push(v);
            return;
        }
    }
}
