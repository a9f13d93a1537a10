//! What an answer means, apart from any I/O: the fence an attempt writes, and the sorting of
//! an acquire's, a release's and a semaphore take's answer into the cases the loops act on
//! (DESIGN.md, "Operations: one request each": each case beside the condition that
//! produced it).

use super::*;

impl Coordinator {
    /// The fence an attempt writes: the clock in µs, above the last fence seen on the key.
    /// Refused before anything is written when the seen fence is implausibly far ahead of this
    /// clock (this clock is wrong, or another coordinator's was: copying it would spread the
    /// error) or when the fence would pass [`MAX_FENCE`].
    pub(crate) fn next_fence(&self, key: &str, seen: Option<u64>) -> Result<u64> {
        let now_us = self.now_us();
        let lead = self.config.fence_lead.as_micros() as u64;
        if let Some(s) = seen.filter(|&s| s > now_us.saturating_add(lead)) {
            return Err(Error::ClockSkew(format!(
                "the last fence of {key:?} is {} ms ahead of this coordinator's clock (at most {} ms is plausible): \
                 this clock, or the clock of the coordinator that issued it, is wrong",
                (s - now_us) / 1000,
                lead / 1000
            )));
        }
        let fence = now_us.max(seen.map_or(0, |f| f.saturating_add(1)));
        if fence > MAX_FENCE {
            return Err(Error::StoreUnavailable(format!(
                "the next fence of {key:?} would pass 2^53; this coordinator's clock is wrong or the key must be retired"
            )));
        }
        Ok(fence)
    }
}

/// What one acquire attempt's answer means.
pub(crate) enum AcquireAnswer {
    /// The lease is ours: this attempt's, or an earlier one of the same lease_id that landed.
    Granted(Record),
    /// The key is free but its last fence is not below ours: go again above this one.
    Above(Record),
    /// The key is free but not in the work-state visit the write was made under.
    Moved(Record),
    /// Our lease_id's lease already ended on this key (released or expired): never again.
    Ended(Reason),
    /// The key is free, but it was freed by a queue write after this attempt's clock (`Free`'s
    /// `freed_at_ms` clause), or released after it for a fail-closed attempt (`FreeAfter`): a
    /// freeing clock ahead of ours: go again once ours passes it.
    Early(Record),
    /// Another lease holds the key.
    Held(Record),
    /// Not sent: an earlier attempt that may have landed has expired, and the generated
    /// lease_id was replaced ([`Lapse`](super::retry::Lapse)); go again with the new one.
    Lapsed,
}

pub(crate) fn sort_acquire(
    w: Write,
    lease_id: &LeaseId,
    fence: u64,
    now: u64,
    visit: Option<&Visit>,
    after: bool,
) -> Result<AcquireAnswer> {
    Ok(match w {
        Write::Applied(r) => AcquireAnswer::Granted(r),
        // Our lease_id's live lease, unless it is a queue's grant still being delivered
        // (`pending_token`; a plain grant never carries one): that lease is the queue's to
        // deliver to its waiter's task token, and it may revoke it (DESIGN.md, "The waiter
        // queue": a retried invocation and its queue grant). Held, to an acquire.
        Write::Rejected(Some(r)) if r.is_live_for(lease_id, now) && r.queue.pending_token.is_none() => {
            AcquireAnswer::Granted(r)
        }
        Write::Rejected(Some(r)) => match ended_reason(&r, lease_id, now) {
            Some(reason) if reason != Reason::WrongLeaseId => AcquireAnswer::Ended(reason),
            // Freed by a queue write after this attempt's clock (`freed_at_ms`, every acquire), or
            // released after it (a fail-closed one).
            _ if !r.is_held(now) && if after { r.freed_at() } else { r.queue.freed_at_ms }.is_some_and(|t| t > now) => {
                AcquireAnswer::Early(r)
            }
            _ if !r.is_held(now) && r.fence_floor() >= fence => AcquireAnswer::Above(r),
            _ if !r.is_held(now) && !in_visit(&r, visit) => AcquireAnswer::Moved(r),
            _ => AcquireAnswer::Held(r),
        },
        Write::Rejected(None) => {
            return Err(Error::StoreUnavailable("store rejected a write on a missing item".into()));
        }
    })
}

/// Why the lease `lease_id` is not live on item `r` (`None` when it is).
pub(crate) fn ended_reason(r: &Record, lease_id: &LeaseId, now: u64) -> Option<Reason> {
    if &r.lease_id != lease_id {
        Some(Reason::WrongLeaseId)
    } else if r.released_at_ms.is_some() {
        Some(Reason::Released)
    } else if !r.is_held(now) {
        Some(Reason::Expired)
    } else {
        None
    }
}

pub(crate) fn check_fence(r: &Record) -> Result<()> {
    if r.fence > MAX_FENCE {
        return Err(Error::StoreUnavailable(format!("fence of {:?} passed 2^53; the key must be retired", r.key)));
    }
    Ok(())
}

/// What one release write's answer means.
pub(crate) enum ReleaseAnswer {
    /// The in-process hand-over whose write was ambiguous did land (the item is the waiter's
    /// lease): the release is done.
    ToWaiter(Record),
    /// This write released the lease.
    Released(Record),
    /// Our lease is live but waiters are queued: the queue's hand-over releases it.
    Queued(Record),
    /// Our lease was released already (a retry, or a stale release after a force-release).
    Already(Record),
    /// A hand-over released our lease and granted the key on, keeping its id and fence.
    HandedOn(Record),
    /// Not our lease (any more).
    NotHolder(Option<Record>),
}

/// Sorts a release write's answer. `waiter`: the lease_id of an in-process hand-over whose
/// write was ambiguous; `hand_over`: the write was conditional on an empty queue.
pub(crate) fn sort_release(w: Write, lease_id: &LeaseId, waiter: Option<&LeaseId>, hand_over: bool) -> ReleaseAnswer {
    match w {
        Write::Rejected(Some(r)) if waiter == Some(&r.lease_id) => ReleaseAnswer::ToWaiter(r),
        Write::Applied(r) => ReleaseAnswer::Released(r),
        Write::Rejected(Some(r))
            if hand_over && &r.lease_id == lease_id && r.released_at_ms.is_none() && r.queue_len() > 0 =>
        {
            ReleaseAnswer::Queued(r)
        }
        Write::Rejected(Some(r)) if &r.lease_id == lease_id && r.released_at_ms.is_some() => ReleaseAnswer::Already(r),
        Write::Rejected(Some(r)) if r.queue.released_lease_id.as_ref() == Some(lease_id) => ReleaseAnswer::HandedOn(r),
        Write::Rejected(r) => ReleaseAnswer::NotHolder(r),
    }
}

/// What one semaphore take's answer means (DESIGN.md, "Semaphores").
pub(crate) enum SlotAnswer {
    /// A slot is ours: this take's, or an earlier one of the same lease_id that landed.
    Granted(Record),
    /// Our lease_id's slot already ended (released or expired): never again.
    Ended(Reason),
    /// No item, or a free plain lease (what its whole replacement must be fenced above, if
    /// any: its fence, and its last queue's tail, see `Record::fence_floor`): the first holder
    /// makes the semaphore.
    Make(Option<u64>),
    /// A free plain lease, freed by a queue write stamped after this take's clock
    /// (`freed_at_ms`, which `Free` refuses: a clock ahead of ours): make the semaphore once
    /// this clock has passed the stamp.
    Early(Record),
    /// A holder of the semaphore was cleaned away by a clock ahead of ours
    /// (`sem_cleaned_at_ms` after this take's clock: to ours it may not have expired yet, and
    /// its holder may still believe): take once this clock has passed the stamp.
    Cleaned(Record),
    /// A slot may be free but the last fence is not below ours: go again above it.
    Above(u64),
    /// Full only by ended holders: take again, cleaning them under the item as read.
    Clean(Record),
    /// Full with live holders, or a live plain lease.
    Held(Record),
}

/// Sorts a take's answer (`slots`: the N asked).
pub(crate) fn sort_take(w: Write, lease_id: &LeaseId, fence: u64, now: u64, slots: u32) -> SlotAnswer {
    let r = match w {
        Write::Applied(r) => return SlotAnswer::Granted(r),
        Write::Rejected(None) => return SlotAnswer::Make(None),
        Write::Rejected(Some(r)) => r,
    };
    if r.semaphore.slots.is_none() {
        if &r.lease_id == lease_id {
            return SlotAnswer::Ended(ended_reason(&r, lease_id, now).unwrap_or(Reason::WrongLeaseId));
        }
        let free = !r.is_held(now) && r.queue_len() == 0 && r.work.state.is_none() && r.queue.pending_token.is_none();
        return match r.queue.freed_at_ms {
            _ if !free => SlotAnswer::Held(r),
            Some(t) if t > now => SlotAnswer::Early(r),
            _ => SlotAnswer::Make(Some(r.fence_floor())),
        };
    }
    if let Some(h) = r.slot(lease_id) {
        return match (h.released_at_ms, h.is_live(now)) {
            (None, true) => SlotAnswer::Granted(r),
            (Some(_), _) => SlotAnswer::Ended(Reason::Released),
            (None, false) => SlotAnswer::Ended(Reason::Expired),
        };
    }
    if r.semaphore.cleaned_at_ms.is_some_and(|t| t > now) {
        return SlotAnswer::Cleaned(r);
    }
    if r.fence >= fence {
        return SlotAnswer::Above(r.fence);
    }
    if r.semaphore.slots_taken.unwrap_or(0) < slots {
        // Not full (any more): the refusal was an entry or fence that moved; go again.
        return SlotAnswer::Above(r.fence);
    }
    if (r.live_slots(now).count() as u32) < slots {
        SlotAnswer::Clean(r)
    } else {
        SlotAnswer::Held(r)
    }
}
