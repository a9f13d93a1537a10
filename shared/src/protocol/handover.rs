//! The in-process hand-over (DESIGN.md, "In-process waiters"): a release of this coordinator
//! grants the key to the sleeping head of its line in the release's own write; a key freed
//! here wakes that head; fairness across processes (a key left free for another process's
//! waiter, the "awaited elsewhere" mark); and a waiter's place in line, which gives back a
//! grant its dropped acquire never read (DESIGN.md, "Cancellation").

use super::*;

/// How many leases one waiter's mark follows when each was released before the mark landed.
const MARK_TRIES: usize = 3;

impl Coordinator {
    /// Acquires of this coordinator waiting for `key` in its in-process line.
    pub fn waiting(&self, key: &str) -> usize {
        self.wakeups.waiting(key)
    }

    /// Is the head of this coordinator's line for `key` asleep, offering its lease to a release?
    pub fn head_waiter_offers(&self, key: &str) -> bool {
        self.wakeups.head_offers(key)
    }

    /// How long this coordinator's waiters hold back after leaving a key free for a waiter of
    /// another process: well over that waiter's longest pause between polls (`poll_max`, up
    /// to 1.5 times with jitter; coordinators of one table are assumed to share `poll_max`), so
    /// that a loaded machine's late poll still finds the key free.
    pub(crate) fn yield_for(&self) -> Duration {
        self.config.poll_max * 3
    }

    /// The key is free after this coordinator's release of item `r`: the head of its line tries
    /// at once, unless a waiter of another process marked the item (it waits while this
    /// coordinator's line has the key) and this coordinator has waiters that would win the race:
    /// they hold back while it polls.
    pub(crate) fn freed(&self, key: &str, r: &Record) {
        if self.awaited_elsewhere(r) && self.wakeups.waiting(key) > 0 {
            self.wakeups.hold_back(key, self.yield_for());
        } else {
            self.wakeups.wake(key);
        }
    }

    /// This coordinator's waiter holds back while `key` is left free for a waiter of another
    /// process: until `until`, or until the key is taken (by that waiter, or anyone), which it
    /// reads for at its pace. Without the reads, a line of another coordinator that took the
    /// key could pass it among its own waiters for the whole hold-back, unseen and unmarked.
    pub(crate) async fn hold_back(&self, key: &str, until: Instant) {
        let step = self.config.poll_max / 2;
        loop {
            let next = (self.monotonic() + step).min(until);
            tokio::time::sleep_until(next.into()).await;
            if next >= until {
                return;
            }
            // A read is cut off at `until`: the hold-back must not outlast the waiter's wait.
            let read = tokio::time::timeout_at(until.into(), self.store.get(key)).await;
            if let Ok(Ok(Some(r))) = read {
                if r.is_held(self.now_ms()) {
                    self.wakeups.end_hold_back(key);
                    return;
                }
            }
        }
    }

    /// Did the lease on item `r` come from the in-process line of another coordinator, and no
    /// waiter marked it yet? (One mark makes that line leave the key free; a second would only
    /// cost a write.)
    pub(crate) fn turn_elsewhere(&self, r: &Record) -> bool {
        r.queue.handed_in.as_deref().is_some_and(|c| c != &*self.id)
            && r.queue.awaited_by.is_none()
            && r.is_held(self.now_ms())
    }

    /// Does a waiter of another coordinator wait for the key of item `r`? Its mark
    /// (`awaited_by`), or, as written by earlier versions, `handed_in` naming another
    /// coordinator than the one releasing the lease.
    fn awaited_elsewhere(&self, r: &Record) -> bool {
        let other = |c: &Option<String>| c.as_deref().is_some_and(|c| c != &*self.id);
        other(&r.queue.awaited_by) || other(&r.queue.handed_in)
    }

    /// Marks the lease of fence `fence` on `key`: a waiter of this coordinator waits while the
    /// key is in another coordinator's line. Best effort, one write; when that lease was released
    /// before the mark landed and the refusal shows the next lease of another coordinator's line
    /// (a hold shorter than a request), that lease is marked instead, a few times at most.
    pub(crate) async fn waits_in(&self, key: &str, mut fence: u64) {
        let m = Mutation::Queue(QueueMutation::WaitsIn { coordinator: self.id.to_string() });
        for _ in 0..MARK_TRIES {
            match self.store.update(key, &Condition::FenceIs(fence), &m).await {
                Ok(Write::Rejected(Some(r))) if r.fence != fence && self.turn_elsewhere(&r) => fence = r.fence,
                Ok(_) => return,
                Err(e) => {
                    tracing::debug!(key, error = e.name(), "could not mark the key as awaited elsewhere");
                    return;
                }
            }
        }
    }

    /// The release of `lease_id` as one write that grants the key to the claimed in-process
    /// waiter (DESIGN.md, "In-process waiters"). `None`: not done (the claim is dropped and the
    /// waiter tries by itself); the ordinary release follows.
    pub(crate) async fn release_to_waiter(
        &self,
        key: &str,
        lease_id: &LeaseId,
        claim: crate::protocol::line::Claim,
    ) -> ToWaiter {
        use ToWaiter::NotDone;
        let Ok(Some(r)) = self.store.get(key).await else { return NotDone };
        // Checked after the read, right before the clock is read for the grant.
        let Ok(now) = self.checked_now(key).await else { return NotDone };
        let sent = self.monotonic();
        if &r.lease_id != lease_id || r.released_at_ms.is_some() || r.min_hold_until_ms > now || r.queue_len() > 0 {
            return NotDone;
        }
        // A lease_id is single-use: a waiter offering the very lease_id being released (two
        // acquires with one caller id) must not be granted it again.
        if &claim.offer().lease.lease_id == lease_id {
            return NotDone;
        }
        // A waiter of another process waits while this coordinator's line has the key: the key
        // goes free for it, and this coordinator's waiters hold back while it polls.
        if self.awaited_elsewhere(&r) {
            self.wakeups.hold_back(key, self.yield_for());
            return NotDone;
        }
        let mut lease = claim.offer().lease.clone();
        lease.now_ms = now;
        lease.handed_in = Some(self.id.to_string());
        // The grant replaces the whole item: above the last queue's tail too (see `fence_floor`).
        let Ok(fence) = self.next_fence(key, Some(r.fence_floor())) else { return NotDone };
        lease.fence = fence;
        lease.ttl = lease.duration_ms.map(|d| self.ttl_after(now + d));
        // A retried release of the releasing lease answers `already_released` (not
        // `wrong_lease_id`): the grant keeps its id and fence.
        lease.released = Some((lease_id.clone(), r.fence));
        let cond = Condition::Queue(QueueCondition::HandTo {
            lease_id: lease_id.clone(),
            fence: r.fence,
            now_ms: now,
            coordinator: self.id.to_string(),
        });
        let released = Released::at(key, r.fence, now, false, None);
        let waiter = lease.lease_id.clone();
        match self.store.update(key, &cond, &Mutation::Lease(LeaseMutation::Acquire(lease))).await {
            Ok(Write::Applied(g)) => {
                self.settle_grant(key, claim, g, sent, now).await;
                ToWaiter::Done(released)
            }
            // The grant may have landed, or may still land (a request stuck in the network): if
            // the read shows it, it is the waiter's and this release is done; otherwise the claim
            // stays (its waiter keeps waiting) until the ordinary release settles it.
            Err(e) if e.may_have_landed() => match self.store.get(key).await {
                Ok(Some(g)) if g.lease_id == waiter && g.is_live_for(&waiter, self.now_ms()) => {
                    self.settle_grant(key, claim, g, sent, now).await;
                    ToWaiter::Done(released)
                }
                _ => ToWaiter::Unsettled(Box::new(Unsettled { claim, sent, now, released })),
            },
            // Marked since the read: the key goes free for that waiter, and this coordinator's
            // waiters hold back before the dropped claim wakes the head.
            Ok(Write::Rejected(Some(r))) if self.awaited_elsewhere(&r) => {
                self.wakeups.hold_back(key, self.yield_for());
                NotDone
            }
            _ => NotDone,
        }
    }

    /// Hands a grant that landed to its claimed waiter; if the waiter left while the grant was
    /// being written, the grant is nobody's and is released at once.
    pub(crate) async fn settle_grant(
        &self,
        key: &str,
        claim: crate::protocol::line::Claim,
        g: Record,
        sent: Instant,
        now: u64,
    ) {
        if let Err(lease_id) = claim.granted(g, sent, now) {
            self.release_departed(key, &lease_id).await;
        }
    }
}
/// What became of a release's hand-over to its in-process waiter.
pub(crate) enum ToWaiter {
    /// The waiter has the key; the release is done.
    Done(Released),
    /// Nothing was granted: the claim is dropped (the waiter tries by itself).
    NotDone,
    /// The grant's write failed ambiguously: it may land yet. The claim is kept until the
    /// ordinary release's answer says whether it did.
    Unsettled(Box<Unsettled>),
}

pub(crate) struct Unsettled {
    pub(crate) claim: crate::protocol::line::Claim,
    pub(crate) sent: Instant,
    pub(crate) now: u64,
    pub(crate) released: Released,
}

/// A waiting acquire's place in its coordinator's line. When the acquire's future is dropped
/// (a timeout, a disconnected HTTP client, a deadline), the waiter departs: a release writing
/// its grant right now gives the grant back, and a grant that landed but was never read is
/// released here (DESIGN.md, "Cancellation").
pub(crate) struct InLine {
    pub(crate) ticket: crate::protocol::line::Ticket,
    pub(crate) coord: Coordinator,
    /// Whether a grant left unread is released when the waiter departs: only under a lease_id
    /// generated by the acquire (a caller's own lease_id stays the caller's to retry or release).
    pub(crate) release_departed: bool,
}

impl std::ops::Deref for InLine {
    type Target = crate::protocol::line::Ticket;
    fn deref(&self) -> &Self::Target {
        &self.ticket
    }
}

impl std::ops::DerefMut for InLine {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.ticket
    }
}

impl Drop for InLine {
    fn drop(&mut self) {
        let Some((r, _, _)) = self.ticket.depart() else { return };
        if !self.release_departed {
            tracing::debug!(key = %r.key, "a grant under the caller's own lease_id left unread: the caller's to retry or release");
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                let coord = self.coord.clone();
                rt.spawn(async move { coord.release_departed(&r.key, &r.lease_id).await });
            }
            Err(_) => tracing::warn!(key = %r.key, "a grant left unread by a departed acquire expires on its own"),
        }
    }
}
