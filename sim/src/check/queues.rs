//! Queues and lines: the waiter queue's order, marks of waiters of other processes kept,
//! no waiter starved, releases answered by what became of their lease.

use leasehold::store::LeaseMutation;
use leasehold::store::QueueMutation;
use leasehold::store::SemaphoreMutation;
use leasehold::store::WorkMutation;
use std::collections::BTreeMap;
use std::time::Instant;

use leasehold::store::Mutation;
use leasehold::testing::Applied;
use leasehold::{LeaseId, Record};

use super::{describe, short};
use crate::violation::Violation;
use crate::world::Event;

/// A released lease stays as released (DESIGN.md, "Failure cases": a holder releasing after an
/// operator force-released its lease, or a release retried after its answer was lost, changes
/// nothing): no release or renewal is applied to an item whose lease is released already, nor
/// to a semaphore's holder released already (or no longer on the item).
pub(super) fn released_once(log: &[Applied], out: &mut Vec<Violation>) {
    for a in log {
        let (Some(m), Some(old)) = (&a.mutation, &a.old) else { continue };
        let again = matches!(
            m,
            Mutation::Lease(LeaseMutation::Release { .. })
                | Mutation::Work(WorkMutation::ReleaseTo { .. })
                | Mutation::Lease(LeaseMutation::Extend { .. })
        );
        let lease = if again && old.released_at_ms.is_some() && old.semaphore.slots.is_none() {
            Some(&old.lease_id)
        } else {
            slot_released_already(m, old)
        };
        if let Some(lease) = lease {
            let mut v = Violation::new(
                "released_lease_changed",
                &a.key,
                format!("{} was applied to lease {}, released already", describe(m), short(lease.expose())),
            );
            v.at = Some(a.at);
            out.push(v);
        }
    }
}

/// The holder a slot's renewal or release was applied to, if it was released already or had no
/// entry on the semaphore.
fn slot_released_already<'a>(m: &'a Mutation, old: &Record) -> Option<&'a LeaseId> {
    let (Mutation::Semaphore(SemaphoreMutation::RenewSlot { lease_id, .. })
    | Mutation::Semaphore(SemaphoreMutation::ReleaseSlot { lease_id, .. })) = m
    else {
        return None;
    };
    old.slot(lease_id).is_none_or(|h| h.released_at_ms.is_some()).then_some(lease_id)
}

/// A coordinator's line leaves the key free when a waiter of another coordinator marked the
/// lease it releases (DESIGN.md, "In-process waiters": fairness across processes): an
/// in-process hand-over never replaces an item whose `awaited_by` names another coordinator.
pub(super) fn marks_kept(log: &[Applied], out: &mut Vec<Violation>) {
    for a in log {
        let (Some(Mutation::Lease(LeaseMutation::Acquire(n))), Some(old)) = (&a.mutation, &a.old) else { continue };
        let (Some(line), Some(waiter)) = (&n.handed_in, &old.queue.awaited_by) else { continue };
        if line != waiter && a.new.is_some() {
            let mut v = Violation::new(
                "mark_ignored",
                &a.key,
                format!(
                    "coordinator {} handed the key on within its line over the mark of a waiter of {}",
                    short(line),
                    short(waiter)
                ),
            );
            v.at = Some(a.at);
            out.push(v);
        }
    }
}

/// How many hand-overs in a row within other coordinators' lines a waiter may see go by while
/// it waits. A waiter marks the first lease of another line it is refused by, and that lease's
/// release leaves the key free for it; but the line passes the key on while the waiter sleeps
/// between polls (up to 1.5 `poll_max`), and while one of its requests is delayed by faults (a
/// stall and the retries after it take up to the retry budget), and the hot key's holds are
/// short. Measured with the fairness in place: at most 7 in a row, in 1,000 seeds in one
/// process and the 125 hot-key seeds among them alone; with the waiter's mark removed, up to
/// 29, and 10 or more 37 times in 200 seeds (BENCHMARKS.md, "Deterministic simulation").
const STARVED_AFTER: usize = 10;

/// A waiter of one coordinator is not starved by other coordinators' in-process lines
/// (DESIGN.md, "In-process waiters"): while an acquire waited (and was answered `LeaseHeld`),
/// its key was not granted [`STARVED_AFTER`] times in a row by hand-overs within other
/// coordinators. Any other grant (an acquire that found the key free, as this waiter could
/// have; a queued waiter's, which comes first; its own coordinator's) ends the streak.
pub(super) fn starvation(events: &[Event], log: &[Applied], out: &mut Vec<Violation>) {
    // Per key, its grants in store order: when, and the coordinator whose line handed it on.
    let mut grants: BTreeMap<&str, Vec<(Instant, Option<&str>)>> = BTreeMap::new();
    for a in log {
        match (&a.mutation, &a.new) {
            (Some(Mutation::Lease(LeaseMutation::Acquire(n))), Some(_)) => {
                grants.entry(a.key.as_str()).or_default().push((a.at, n.handed_in.as_deref()))
            }
            (Some(Mutation::Queue(QueueMutation::Grant { .. })), Some(_)) => {
                grants.entry(a.key.as_str()).or_default().push((a.at, None))
            }
            _ => {}
        }
    }
    for e in events {
        let Event::WaitedInVain { key, coordinator, start, end } = e else { continue };
        let Some(grants) = grants.get(key.as_str()) else { continue };
        let longest = longest_run(grants, *start, *end, |by| by.is_some_and(|c| c != coordinator));
        if longest >= STARVED_AFTER {
            let mut v = Violation::new(
                "waiter_starved",
                key,
                format!(
                    "an acquire of coordinator {} waited {} ms in vain while the key was handed over within \
                     other coordinators {longest} times in a row",
                    short(coordinator),
                    end.duration_since(*start).as_millis(),
                ),
            );
            v.at = Some(*end);
            out.push(v);
        }
    }
}

/// How many slots of a semaphore the takes of other processes may be granted in a row while a
/// waiting take of one process waits. Its takes poll the count at the semaphore's pace and a
/// releaser defers to them (DESIGN.md, "Semaphores": "Waiting, and what is left for later"),
/// but a freed slot still goes to whichever take lands first: not FIFO across processes.
/// Measured on the hot semaphore (BENCHMARKS.md, "Deterministic simulation"): at most 40 in a
/// row in `--seeds 1000`; with the pacing and the deferring reverted, up to 58 in `--seeds 200`
/// (`scripts/sim-reverts/slot-waiters-unpaced.patch`).
const SLOT_STARVED_AFTER: usize = 45;

/// A waiting take of a semaphore's slot in one process is not starved by the takes of other
/// processes: while it waited (until its answer, a slot or `LeaseHeld`), the semaphore's slots
/// were not granted [`SLOT_STARVED_AFTER`] times in a row to other processes. A grant to its own
/// process ends the streak (its own line hands its slots on in arrival order).
pub(super) fn slot_starvation(events: &[Event], log: &[Applied], out: &mut Vec<Violation>) {
    // Per semaphore: its grants in store order, when and to which process.
    let mut grants: BTreeMap<&str, Vec<(Instant, &str)>> = BTreeMap::new();
    for a in log {
        let holder = match (&a.mutation, &a.new) {
            (Some(Mutation::Semaphore(SemaphoreMutation::TakeSlot { slot, .. })), Some(_)) => slot.holder.as_str(),
            (Some(Mutation::Semaphore(SemaphoreMutation::PutSemaphore(r))), Some(_)) => r.holder.as_str(),
            _ => continue,
        };
        grants.entry(a.key.as_str()).or_default().push((a.at, process(holder)));
    }
    for e in events {
        let Event::SlotWaited { key, client, start, end } = e else { continue };
        let Some(grants) = grants.get(key.as_str()) else { continue };
        let own = process(client);
        let longest = longest_run(grants, *start, *end, |by| *by != own);
        if longest >= SLOT_STARVED_AFTER {
            let mut v = Violation::new(
                "slot_waiter_starved",
                key,
                format!(
                    "a take of {client} waited {} ms while {longest} slots in a row went to other processes",
                    end.duration_since(*start).as_millis(),
                ),
            );
            v.at = Some(*end);
            out.push(v);
        }
    }
}

/// The longest run of `grants` (in store order) after `start` and before `end` that went to
/// others (`other`).
fn longest_run<T>(grants: &[(Instant, T)], start: Instant, end: Instant, other: impl Fn(&T) -> bool) -> usize {
    let from = grants.partition_point(|(at, _)| *at <= start);
    let (mut streak, mut longest) = (0, 0);
    for (_, by) in grants[from..].iter().take_while(|(at, _)| *at < end) {
        streak = if other(by) { streak + 1 } else { 0 };
        longest = longest.max(streak);
    }
    longest
}

/// The process of a client (`c1/2`: `c1`).
fn process(client: &str) -> &str {
    client.split_once('/').map_or(client, |(p, _)| p)
}

/// The waiter queue: a key's grants to its waiters go in queue order (each grant's sequence
/// number above the last, across the key's successive queues: a new queue starts above the
/// last one's tail), and a waiter takes one slot (an enqueue never lands on a queue whose last
/// slot is already its own).
pub(super) fn queues(log: &[Applied], out: &mut Vec<Violation>) {
    let mut last: BTreeMap<&str, u64> = BTreeMap::new();
    for a in log {
        // The item deleted by TTL: its counters are gone with it (a later queue starts above
        // the later fences, as the fence does).
        if a.new.is_none() {
            last.remove(a.key.as_str());
        }
        match (&a.mutation, &a.old) {
            (Some(Mutation::Queue(QueueMutation::Grant { seq, .. })), _) => {
                let before = last.insert(a.key.as_str(), *seq).unwrap_or(0);
                if *seq <= before {
                    // A repeated number is a later queue reusing an earlier one's numbers, and
                    // its waiter items (found by the simulation, fixed: FINDINGS.md).
                    let reused = *seq == before;
                    let mut v = Violation::new(
                        if reused { "queue_seq_reused" } else { "queue_not_fifo" },
                        &a.key,
                        format!("waiter {seq} was granted the key after waiter {before}"),
                    );
                    v.at = Some(a.at);
                    out.push(v);
                }
            }
            (Some(Mutation::Queue(QueueMutation::Enqueue { lease_id, .. })), Some(old))
                if old.queue_len() > 0 && old.queue.queue_tail_lease_id.as_ref() == Some(lease_id) =>
            {
                let mut v = Violation::new(
                    "enqueued_twice",
                    &a.key,
                    format!("waiter {} took a second slot behind its own", short(lease_id.expose())),
                );
                v.at = Some(a.at);
                out.push(v);
            }
            _ => {}
        }
    }
}

/// A release is never answered `NotHolder` while the key's item says a hand-over released that
/// lease and granted the key on (`released_lease_id`): the answer must be `already_released`.
/// (A release whose answer was lost, retried after an ordinary acquire replaced the whole item,
/// can only be answered `NotHolder`.)
pub(super) fn releases(events: &[Event], log: &[Applied], out: &mut Vec<Violation>) {
    for e in events {
        let Event::ReleaseRefused { key, lease, at } = e else { continue };
        let item = log.iter().rev().find(|a| a.key == *key && a.at <= *at).and_then(|a| a.new.as_ref());
        if item.is_some_and(|r| r.queue.released_lease_id.as_ref().is_some_and(|id| id.expose() == lease)) {
            let mut v = Violation::new(
                "release_not_holder",
                key,
                format!("the release of lease {}, handed on by a hand-over, was answered NotHolder", short(lease)),
            );
            v.at = Some(*at);
            out.push(v);
        }
    }
}
