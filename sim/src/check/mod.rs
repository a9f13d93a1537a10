//! The checker: reads a run's history and reports what the protocol promised and did not do.
//!
//! - **One holder at a time**: no two leases on a key are believed at once, judged by what
//!   each client was told (from the answer's arrival until its `safe_until`, or its release;
//!   fail-closed leases until released; an operator's force-release evicts without telling).
//! - **Fences** of the grants on a key strictly increase in the order the store applied them,
//!   above every fence the key carried before (TTL deletions included).
//! - **A lease_id is granted at most once** on a key (once told to a holder).
//! - **No late answer**: a grant or renewal is never told after its safe time passed.
//! - **Work items**: a release into the final state answered as done was applied exactly once;
//!   an item in its final state is never taken again from the state it left; each item enters
//!   its final state once per `put`.
//!
//! The run itself checks, as it goes: the guarded resource never sees two leases with one fence
//! and never refuses a holder within its safe time; every acquire ends by its deadline; a
//! coordinator with a clock beyond the skew margin is never granted; a fail-closed acquire
//! with its own lease_id is answered by what became of that lease; after every lease ended,
//! every key can be taken and every work item is still in a state.

use std::time::{Duration, Instant};

use leasehold::testing::Applied;

use crate::violation::Violation;
use crate::world::Event;

mod fences;
mod history;
mod holders;
mod queues;
mod work;

use history::describe;
pub(crate) use history::{history, trace_hash};

pub(super) fn ms(t0: Instant, t: Instant) -> u64 {
    t.saturating_duration_since(t0).as_millis() as u64
}

pub(super) fn short(id: &str) -> &str {
    &id[..id.len().min(8)]
}

/// Every check over the history; the violations carry the key's history around them.
pub(crate) fn check(
    events: &[Event],
    log: &[Applied],
    t0: Instant,
    fence_lead: Duration,
    final_state: &str,
) -> Vec<Violation> {
    let mut out = Vec::new();
    holders::overlaps(events, log, t0, &mut out);
    fences::fences(events, log, &mut out);
    holders::told_in_time(events, t0, &mut out);
    work::finished(events, log, &mut out);
    work::ttl_on_work_items(log, &mut out);
    work::final_items_kept(log, final_state, &mut out);
    work::finished_once_per_put(log, final_state, &mut out);
    fences::deleted_before_its_fence(log, t0, &mut out);
    fences::copied_past_lead(log, t0, fence_lead, &mut out);
    queues::queues(log, &mut out);
    queues::releases(events, log, &mut out);
    queues::starvation(events, log, &mut out);
    queues::slot_starvation(events, log, &mut out);
    queues::marks_kept(log, &mut out);
    queues::released_once(log, &mut out);
    out
}

/// The true time of `at`, in µs (the store's clock: the run's epoch at `t0`).
pub(super) fn true_us(t0: Instant, at: Instant) -> u64 {
    crate::EPOCH_MS as u64 * 1000 + at.duration_since(t0).as_micros() as u64
}

/// Is `client` one of a coordinator with a blind clock (`Settings::blind_clock`)?
pub(super) fn blind(client: &str) -> bool {
    client.starts_with("blind")
}
