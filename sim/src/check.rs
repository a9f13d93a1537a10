//! The checker: reads a run's history and reports what the protocol promised and did not do.
//!
//! - **One holder at a time**: no two leases on a key are believed at once, judged by what
//!   each client was told (from the answer's arrival until its `safe_until`, or its release;
//!   fail-closed leases until released; an operator's force-release evicts without telling).
//! - **Fences** of the grants on a key strictly increase in the order the store applied them,
//!   above every fence the key carried before (TTL deletions included).
//! - **A lease_id is granted at most once** on a key (once told to a holder).
//! - **No late answer**: a grant or renewal is never told after its safe time passed.
//! - **Work items**: a release into the final state answered as done was applied exactly once.
//!
//! The run itself checks, as it goes: the guarded resource never sees two leases with one fence
//! and never refuses a holder within its safe time; every acquire ends by its deadline; a
//! coordinator with a clock beyond the skew margin is never granted; a fail-closed acquire
//! with its own lease_id is answered by what became of that lease; after every lease ended,
//! every key can be taken and every work item is still in a state.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use leasehold::store::{LeaseMutation, Mutation, QueueMutation, SemaphoreMutation, WorkMutation};
use leasehold::testing::Applied;

use crate::Event;

/// One broken promise.
#[derive(Debug, Clone)]
pub struct Violation {
    pub kind: &'static str,
    pub key: String,
    pub message: String,
    /// The history of the key around it (filled in at the end of the run).
    pub history: Vec<String>,
    /// When it happened, when known (the history shown ends shortly after).
    pub at: Option<Instant>,
    /// A known finding of the protocol, written down (DESIGN.md, "Simulation") and not yet
    /// fixed: reported, not counted as a violation.
    pub known: bool,
}

impl Violation {
    pub(crate) fn new(kind: &'static str, key: &str, message: String) -> Self {
        Violation {
            kind,
            key: key.to_string(),
            message,
            history: Vec::new(),
            at: Some(tokio::time::Instant::now().into_std()),
            known: false,
        }
    }
}

fn ms(t0: Instant, t: Instant) -> u64 {
    t.saturating_duration_since(t0).as_millis() as u64
}

fn short(id: &str) -> &str {
    &id[..id.len().min(8)]
}

/// Every check over the history; the violations carry the key's history around them.
pub(crate) fn check(events: &[Event], log: &[Applied], t0: Instant, fence_lead: Duration) -> Vec<Violation> {
    let mut out = Vec::new();
    overlaps(events, log, t0, &mut out);
    fences(events, log, &mut out);
    told_in_time(events, t0, &mut out);
    finished(events, log, &mut out);
    ttl_on_work_items(log, &mut out);
    deleted_before_its_fence(log, t0, &mut out);
    copied_past_lead(log, t0, fence_lead, &mut out);
    queues(log, &mut out);
    releases(events, log, &mut out);
    starvation(events, log, &mut out);
    marks_kept(log, &mut out);
    released_once(log, &mut out);
    out
}

/// A released lease stays as released (DESIGN.md, "Failure modes": a holder releasing after an
/// operator force-released its lease, or a release retried after its answer was lost, changes
/// nothing): no release or renewal is applied to an item whose lease is released already.
fn released_once(log: &[Applied], out: &mut Vec<Violation>) {
    for a in log {
        let (Some(m), Some(old)) = (&a.mutation, &a.old) else { continue };
        let again = matches!(
            m,
            Mutation::Lease(LeaseMutation::Release { .. })
                | Mutation::Work(WorkMutation::ReleaseTo { .. })
                | Mutation::Lease(LeaseMutation::Extend { .. })
        );
        if again && old.released_at_ms.is_some() && old.semaphore.slots.is_none() {
            let mut v = Violation::new(
                "released_lease_changed",
                &a.key,
                format!("{} was applied to lease {}, released already", describe(m), short(old.lease_id.expose())),
            );
            v.at = Some(a.at);
            out.push(v);
        }
    }
}

/// A coordinator's line leaves the key free when a waiter of another coordinator marked the
/// lease it releases (DESIGN.md, "In-process waiters": fairness across processes): an
/// in-process hand-over never replaces an item whose `awaited_by` names another coordinator.
fn marks_kept(log: &[Applied], out: &mut Vec<Violation>) {
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
fn starvation(events: &[Event], log: &[Applied], out: &mut Vec<Violation>) {
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
        let from = grants.partition_point(|(at, _)| at <= start);
        let (mut streak, mut longest) = (0, 0);
        for (_, by) in grants[from..].iter().take_while(|(at, _)| at < end) {
            streak = if by.is_some_and(|c| c != coordinator) { streak + 1 } else { 0 };
            longest = longest.max(streak);
        }
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

/// The waiter queue: a key's grants to its waiters go in queue order (each grant's sequence
/// number above the last, across the key's successive queues: a new queue starts above the
/// last one's tail), and a waiter takes one slot (an enqueue never lands on a queue whose last
/// slot is already its own).
fn queues(log: &[Applied], out: &mut Vec<Violation>) {
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
                    // its waiter items (found by the simulation, fixed: DESIGN.md, "Simulation").
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
fn releases(events: &[Event], log: &[Applied], out: &mut Vec<Violation>) {
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

/// A grant or renewal is never handed to a holder after its safe time has passed (a late
/// answer is released, not told).
fn told_in_time(events: &[Event], t0: Instant, out: &mut Vec<Violation>) {
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

/// The true time of `at`, in µs (the store's clock: the run's epoch at `t0`).
fn true_us(t0: Instant, at: Instant) -> u64 {
    crate::EPOCH_MS as u64 * 1000 + at.duration_since(t0).as_micros() as u64
}

/// A coordinator never grants a fence further ahead of its clock than the fence lead
/// (DESIGN.md, "acquire": a `last_fence_seen` further ahead is never copied): honest clocks are
/// within the margin of the truth, so no grant to a client of an honest coordinator is further
/// ahead of the true clock than the lead and the margin. (A blind clock's own grants are its
/// clock's reading, far ahead: they are the fault, not the protocol.)
fn copied_past_lead(log: &[Applied], t0: Instant, lead: Duration, out: &mut Vec<Violation>) {
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
fn deleted_before_its_fence(log: &[Applied], t0: Instant, out: &mut Vec<Violation>) {
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

/// No item in a work state is deleted by TTL (a key in a state is kept until it is taken).
fn ttl_on_work_items(log: &[Applied], out: &mut Vec<Violation>) {
    for a in log.iter().filter(|a| a.ttl) {
        if let Some(old) = a.old.as_ref().filter(|r| r.work.state.is_some()) {
            let mut v = Violation::new(
                "work_item_deleted_by_ttl",
                &a.key,
                format!(
                    "TTL deleted a key in work state {:?} (a renewal left its TTL)",
                    old.work.state.as_deref().unwrap_or("")
                ),
            );
            v.at = Some(a.at);
            out.push(v);
        }
    }
}

/// A task token as the history shows it: the retry it belongs to (the simulated tokens end in
/// `-<attempt>` after the first).
fn short_token(t: &str) -> String {
    match t.rsplit_once('-') {
        Some((_, n)) if n.len() <= 2 => format!("#{n}"),
        _ => "#0".to_string(),
    }
}

/// The history lines of `key` (client events and store writes), in time order.
pub(crate) fn history(
    events: &[Event],
    log: &[Applied],
    t0: Instant,
    key: &str,
    until: Option<Instant>,
    last: usize,
) -> Vec<String> {
    let mut lines: Vec<(u64, usize, String)> = Vec::new();
    for (i, e) in events.iter().enumerate() {
        let line = match e {
            Event::Told { key: k, lease, fence, at, until, client, .. } if k == key => (
                ms(t0, *at),
                format!(
                    "{client} told: lease {} fence {fence} safe until {}",
                    short(lease),
                    until.map_or("released".into(), |u| format!("{} ms", ms(t0, u)))
                ),
            ),
            Event::End { key: k, lease, at } if k == key => (ms(t0, *at), format!("lease {} ends", short(lease))),
            Event::Force { key: k, at } if k == key => (ms(t0, *at), "operator force-release".to_string()),
            Event::ClockJump { node, by_ms, at } => (ms(t0, *at), format!("{node}'s clock is stepped by {by_ms} ms")),
            Event::Wrote { key: k, lease, fence, at, accepted, believed } if k == key => (
                ms(t0, *at),
                format!(
                    "lease {} writes with fence {fence} ({}): {}",
                    short(lease),
                    if *believed { "within its safe time" } else { "after a pause" },
                    if *accepted { "accepted" } else { "refused" }
                ),
            ),
            Event::Finished { key: k, lease, at } if k == key => {
                (ms(t0, *at), format!("lease {} released into the final state", short(lease)))
            }
            Event::ReleaseRefused { key: k, lease, at } if k == key => {
                (ms(t0, *at), format!("lease {} release answered NotHolder", short(lease)))
            }
            Event::WaitedInVain { key: k, coordinator, start, end } if k == key => (
                ms(t0, *end),
                format!("an acquire of {} waiting since {} ms answered LeaseHeld", short(coordinator), ms(t0, *start)),
            ),
            _ => continue,
        };
        lines.push((line.0, i, line.1));
    }
    // The key's writes, and its queue's waiter items (`<key>` U+001F `q<seq>`).
    let waiter = |k: &str| k.strip_prefix(key).is_some_and(|rest| rest.starts_with(leasehold::queue::SEPARATOR));
    for (i, a) in log.iter().enumerate().filter(|(_, a)| a.key == key || waiter(&a.key)) {
        let what = match (&a.mutation, a.ttl) {
            (_, true) => "TTL deletion".to_string(),
            (None, _) => "delete".to_string(),
            (Some(m), _) => describe(m),
        };
        let what = if a.key == key { what } else { format!("{what} of waiter {}", &a.key[key.len() + 1..]) };
        let new = a.new.as_ref().map_or(String::new(), |r| {
            let queue = match (r.queue.queue_head, r.queue.queue_tail) {
                (Some(h), Some(t)) => format!(" queue {}..{}", h % 10_000, t % 10_000),
                _ => String::new(),
            };
            let mark = match (&r.queue.pending_token, &r.queue.waiter) {
                (Some(t), _) => format!(" undelivered to {}", short_token(t)),
                (None, Some(w)) => format!(" token {}", short_token(&w.task_token)),
                _ => String::new(),
            };
            format!(
                " -> lease {} fence {} expires {:?}{queue}{mark}",
                short(r.lease_id.expose()),
                r.fence,
                r.expires_at_ms
            )
        });
        lines.push((ms(t0, a.at), events.len() + i, format!("store applies {what}{new}")));
    }
    lines.sort_by_key(|l| (l.0, l.1));
    if let Some(u) = until {
        let end = ms(t0, u) + 50;
        lines.retain(|l| l.0 <= end);
    }
    let skip = lines.len().saturating_sub(last);
    lines.into_iter().skip(skip).map(|(t, _, s)| format!("{t:>9} ms  {s}")).collect()
}

fn describe(m: &Mutation) -> String {
    match m {
        Mutation::Lease(LeaseMutation::Acquire(n)) if n.handed_in.is_some() => {
            format!("Acquire (handed over within {})", short(n.handed_in.as_deref().unwrap_or_default()))
        }
        Mutation::Queue(QueueMutation::WaitsIn { coordinator }) => format!("WaitsIn (by {})", short(coordinator)),
        Mutation::Semaphore(SemaphoreMutation::TakeSlot { slot, .. }) => {
            format!("TakeSlot of {}", short(slot.lease_id.expose()))
        }
        Mutation::Semaphore(SemaphoreMutation::RenewSlot { lease_id, .. }) => {
            format!("RenewSlot of {}", short(lease_id.expose()))
        }
        Mutation::Semaphore(SemaphoreMutation::ReleaseSlot { lease_id, .. }) => {
            format!("ReleaseSlot of {}", short(lease_id.expose()))
        }
        Mutation::Semaphore(SemaphoreMutation::TidySlots { ended, .. }) => {
            format!("TidySlots of {}", ended.iter().map(|l| short(l.expose())).collect::<Vec<_>>().join(", "))
        }
        _ => {
            // The kind's own variant: `Lease(Extend { .. })` is an `Extend`.
            let s = format!("{m:?}");
            let inner = s.split_once('(').map_or(s.as_str(), |(_, variant)| variant);
            inner.split([' ', '(', '{', ')']).next().unwrap_or("").to_string()
        }
    }
}

/// No two leases of one key believed at once.
fn overlaps(events: &[Event], log: &[Applied], t0: Instant, out: &mut Vec<Violation>) {
    // Per lease: its end, and per key the force-releases as they landed (a retried one may land
    // late, and evict a later lease: the operator's action, not the protocol's).
    let mut ends: BTreeMap<(&str, &str), Instant> = BTreeMap::new();
    for e in events {
        if let Event::End { key, lease, at } = e {
            ends.entry((key.as_str(), lease.as_str())).or_insert(*at);
        }
    }
    let forces = forces(log);
    // A holder refused by the guarded resource within its safe time: a newer lease wrote while
    // it believed it held the key (unless an operator evicted it, or a coordinator with a blind
    // clock took the key over: the fence refusing it is the defence left then).
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
    // Per key: belief intervals (start, stop, lease, client).
    let far = t0 + std::time::Duration::from_secs(1 << 30);
    let mut beliefs: BTreeMap<&str, Vec<(Instant, Instant, &str, &str)>> = BTreeMap::new();
    for e in events {
        let Event::Told { key, lease, fence, at, until, client, .. } = e else { continue };
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
            beliefs.entry(key.as_str()).or_default().push((*at, stop, lease.as_str(), client.as_str()));
        }
    }
    for (key, mut list) in beliefs {
        list.sort();
        if let Some(n) = slots(key) {
            over_slots(key, n, &list, t0, out);
            continue;
        }
        let mut active: Vec<(Instant, &str, &str)> = Vec::new();
        for (start, stop, lease, client) in list {
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

/// The N of a semaphore's key (`crate::SEMAPHORES`), or `None` for a plain key.
fn slots(key: &str) -> Option<u32> {
    crate::SEMAPHORES.iter().find(|(k, _)| *k == key).map(|(_, n)| *n)
}

/// A semaphore of N slots: at no instant do more than N leases believe they hold a slot
/// (`list`: belief intervals sorted by their start).
fn over_slots(key: &str, n: u32, list: &[(Instant, Instant, &str, &str)], t0: Instant, out: &mut Vec<Violation>) {
    let mut active: Vec<(Instant, &str, &str)> = Vec::new();
    for &(start, stop, lease, client) in list {
        active.retain(|(s, l, _)| *s > start && *l != lease);
        active.push((stop, lease, client));
        if active.len() > n as usize {
            let others: Vec<String> = active.iter().map(|(_, l, c)| format!("{c} ({})", short(l))).collect();
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

/// Is `client` one of a coordinator with a blind clock (`Settings::blind_clock`)?
fn blind(client: &str) -> bool {
    client.starts_with("blind")
}

/// Where force-releases landed: per key, when and over which fence.
fn forces(log: &[Applied]) -> BTreeMap<&str, Vec<(Instant, u64)>> {
    let mut out: BTreeMap<&str, Vec<(Instant, u64)>> = BTreeMap::new();
    for a in log {
        if let (Some(Mutation::Lease(LeaseMutation::ForceRelease { .. })), Some(old)) = (&a.mutation, &a.old) {
            out.entry(a.key.as_str()).or_default().push((a.at, old.fence));
        }
    }
    out
}

/// Fences strictly increase in grant order; a lease_id is granted once.
fn fences(events: &[Event], log: &[Applied], out: &mut Vec<Violation>) {
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
                // Known finding when nobody was told of the first grant (a coordinator's retry
                // of its own generated id, after the first attempt's lost grant expired and
                // another lease came and went): no holder ever believed it twice.
                let was_told = told.get(&(a.key.as_str(), n.lease_id.expose())).is_some_and(|t| *t < a.at);
                // Known finding when the second grant is a queue grant nobody was told of: a
                // retried queued acquire took a second slot while the waiter item of its first
                // was there, and both slots were granted; only one delivery can reach the task.
                // A retry now keeps its earlier slot when it finds that item; left: the earlier
                // item landing after the retry looked (DESIGN.md, "Simulation").
                let second_told = told_after.get(&(a.key.as_str(), n.lease_id.expose())).is_some_and(|t| *t > a.at);
                let queued_untold = was_told
                    && !second_told
                    && matches!(a.mutation, Some(Mutation::Queue(QueueMutation::Grant { .. })));
                let mut v = Violation::new(
                    if queued_untold {
                        "queued_lease_id_regranted"
                    } else if was_told {
                        "lease_id_granted_twice"
                    } else {
                        "lease_id_regranted_untold"
                    },
                    &a.key,
                    format!("lease {} was granted a second time", short(n.lease_id.expose())),
                );
                v.at = Some(a.at);
                v.known = !was_told || queued_untold;
                out.push(v);
            }
        }
        for r in [&a.old, &a.new].into_iter().flatten() {
            let t = top.entry(a.key.as_str()).or_default();
            *t = (*t).max(r.fence);
        }
    }
}

/// The slot a write granted, if it took one: its fence and lease_id.
fn slot_granted(a: &Applied) -> Option<(u64, &str)> {
    match a.mutation.as_ref()? {
        Mutation::Semaphore(SemaphoreMutation::TakeSlot { slot, .. }) => Some((slot.fence, slot.lease_id.expose())),
        Mutation::Semaphore(SemaphoreMutation::PutSemaphore(r)) => {
            r.semaphore.slot_holders.iter().find(|h| h.fence == r.fence).map(|h| (h.fence, h.lease_id.expose()))
        }
        _ => None,
    }
}

/// Each release into the final state that was answered as done landed exactly once.
fn finished(events: &[Event], log: &[Applied], out: &mut Vec<Violation>) {
    let mut landed: BTreeMap<(&str, &str), u32> = BTreeMap::new();
    for a in log {
        if let (Some(Mutation::Work(WorkMutation::ReleaseTo { .. })), Some(old)) = (&a.mutation, &a.old) {
            *landed.entry((a.key.as_str(), old.lease_id.expose())).or_default() += 1;
        }
    }
    for e in events {
        let Event::Finished { key, lease, .. } = e else { continue };
        let n = landed.get(&(key.as_str(), lease.as_str())).copied().unwrap_or(0);
        if n != 1 {
            out.push(Violation::new(
                "work_item_not_once",
                key,
                format!("a release into the final state answered as done landed {n} times"),
            ));
        }
    }
}

/// FNV-1a over the run's history: what clients were told and did, and every applied write.
pub(crate) fn trace_hash(events: &[Event], log: &[Applied], t0: Instant) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= *b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    let us = |t: Instant| t.saturating_duration_since(t0).as_micros() as u64;
    for e in events {
        match e {
            Event::Told { key, lease, fence, at, until, client, .. } => {
                eat(b"T");
                eat(key.as_bytes());
                eat(lease.as_bytes());
                eat(&fence.to_le_bytes());
                eat(&us(*at).to_le_bytes());
                eat(&until.map_or(0, us).to_le_bytes());
                eat(client.as_bytes());
            }
            Event::End { key, lease, at } => {
                eat(b"E");
                eat(key.as_bytes());
                eat(lease.as_bytes());
                eat(&us(*at).to_le_bytes());
            }
            Event::Force { key, at } => {
                eat(b"F");
                eat(key.as_bytes());
                eat(&us(*at).to_le_bytes());
            }
            Event::Wrote { key, lease, fence, at, accepted, .. } => {
                eat(b"W");
                eat(key.as_bytes());
                eat(lease.as_bytes());
                eat(&fence.to_le_bytes());
                eat(&us(*at).to_le_bytes());
                eat(&[*accepted as u8]);
            }
            Event::ReleaseRefused { key, lease, at } => {
                eat(b"R");
                eat(key.as_bytes());
                eat(lease.as_bytes());
                eat(&us(*at).to_le_bytes());
            }
            // Not hashed: a checker's annotation, so that every seed's hash stays as it was.
            Event::WaitedInVain { .. } => {}
            Event::ClockJump { node, by_ms, at } => {
                eat(b"J");
                eat(node.as_bytes());
                eat(&by_ms.to_le_bytes());
                eat(&us(*at).to_le_bytes());
            }
            Event::Finished { key, lease, at } => {
                eat(b"D");
                eat(key.as_bytes());
                eat(lease.as_bytes());
                eat(&us(*at).to_le_bytes());
            }
        }
    }
    for a in log {
        eat(b"S");
        eat(a.key.as_bytes());
        eat(&us(a.at).to_le_bytes());
        if let Some(r) = &a.new {
            eat(r.lease_id.expose().as_bytes());
            eat(&r.fence.to_le_bytes());
            eat(&r.expires_at_ms.unwrap_or(0).to_le_bytes());
            eat(&r.released_at_ms.unwrap_or(0).to_le_bytes());
        }
    }
    h
}
