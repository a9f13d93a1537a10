//! Heartbeat: a live lease's expiry moved on from now, in one conditional write that never
//! moves it backwards (DESIGN.md, "heartbeat(key, lease_id, duration?)"); a key seen as a semaphore renews the holder's
//! slot instead. Also why a lease_id is not the holder, for every operation's `NotHolder`.

use super::*;

impl Coordinator {
    /// Extends a live lease by `duration` (default: the lease's own duration) from now.
    pub async fn heartbeat(&self, key: &str, lease_id: &LeaseId, duration: Option<Duration>) -> Result<Lease> {
        let deadline = self.monotonic() + self.config.retry_budget;
        self.heartbeat_until(key, lease_id, duration, deadline).await
    }

    /// [`Coordinator::heartbeat`], retrying transient failures until `deadline`. The expiry
    /// never moves backwards: a delayed duplicate of an earlier try, or a request for less
    /// time than the lease has left, leaves the lease as it is and answers with it.
    pub async fn heartbeat_until(
        &self,
        key: &str,
        lease_id: &LeaseId,
        duration: Option<Duration>,
        deadline: Instant,
    ) -> Result<Lease> {
        let lease = self.renew(key, lease_id, duration, deadline).await?;
        // Renewed, but answered with no safe time left (a slow answer, or a safe margin as long
        // as the lease: DESIGN.md, "Clocks"): of no use to the holder, which must stop now. It
        // is never told as a renewal; a heartbeat sent again may get a safe time.
        if lease.safe_until.is_some_and(|s| s <= self.monotonic()) {
            return Err(Error::StoreUnavailable(format!(
                "{key:?} was renewed, but the answer came after the renewed lease's safe time had passed"
            )));
        }
        Ok(lease)
    }

    /// The renewal of [`Coordinator::heartbeat_until`], its safe time as it came.
    async fn renew(
        &self,
        key: &str,
        lease_id: &LeaseId,
        duration: Option<Duration>,
        deadline: Instant,
    ) -> Result<Lease> {
        self.config.limits.key(key)?;
        if let Some(d) = duration {
            self.config.limits.duration("duration_ms", d)?;
        }
        // The clock is checked by each write itself, right before it is sent (`write`): the
        // slot's renewal and the lease's alike.
        let duration_ms = duration.map(|d| d.as_millis() as u64);
        if let Some(done) = self.renew_known_slot(key, lease_id, duration_ms, deadline).await? {
            return done;
        }
        let max = self.max_duration_ms();
        // A key in a work state keeps no TTL: a renewal writing one is conditional on no state,
        // and one refused because the key is in a state goes again without (removing any TTL a
        // release or force-release left). No renewal, answered or not, leaves a TTL on a work
        // item (DESIGN.md, "Work items and batch leases").
        let mut in_state = false;
        let mut terminal = false;
        // Set once, to a later renewal's stamp another clock wrote ([`Coordinator::after_renewal`]).
        let mut floor: Option<u64> = None;
        loop {
            let (w, sent, now) = self
                .write(key, deadline, |now| {
                    let now = floor.map_or(now, |f| now.max(f));
                    let cond = Condition::Lease(LeaseCondition::Renew {
                        lease_id: lease_id.clone(),
                        now_ms: now,
                        expires_at_ms: duration_ms.map(|d| now + d),
                        ttl: !in_state,
                    });
                    let ttl = (!in_state || terminal).then(|| self.ttl_after(now + duration_ms.unwrap_or(max)));
                    Ok((cond, Mutation::Lease(LeaseMutation::Extend { now_ms: now, duration_ms, ttl })))
                })
                .await
                .map_err(|f| f.into_error(key))?;
            let now = floor.map_or(now, |f| now.max(f));
            // Refused because the last renewal (or the grant) was stamped at or after this
            // clock by another coordinator's, which is ahead of this one: once more at that
            // stamp, so that a clock behind renews as far as one on time would.
            if let (None, Write::Rejected(Some(r))) = (floor, &w) {
                if let Some(stamp) = self.after_renewal(r, lease_id, now) {
                    floor = Some(stamp);
                    continue;
                }
            }
            return match w {
                Write::Applied(r) => {
                    check_fence(&r)?;
                    Ok(r.lease(sent, now, self.safe_margin(sent, now)))
                }
                // Refused for the TTL alone: the same renewal without it; in a terminal state,
                // whose keys keep a lease's TTL (DESIGN.md, "Terminal states"), with it but
                // without the clause (the state cannot change while this lease is live: only
                // its holder's release moves it, and that ends the lease).
                Write::Rejected(Some(r)) if !in_state && r.work.state.is_some() && r.is_live_for(lease_id, now) => {
                    in_state = true;
                    terminal = r.work.state.as_deref().is_some_and(|s| self.is_terminal(s));
                    continue;
                }
                // Still ours, but not extended: a fail-closed lease (nothing to extend), a later
                // renewal already landed, or the new expiry would be earlier. The lease as it is.
                Write::Rejected(Some(r)) if r.is_live_for(lease_id, now) => {
                    check_fence(&r)?;
                    Ok(r.lease(sent, now, self.safe_margin(sent, now)))
                }
                // A semaphore's item: the holder's own renewal (DESIGN.md, "Semaphores").
                Write::Rejected(Some(r)) if r.semaphore.slots.is_some() => {
                    self.heartbeat_slot(key, lease_id, duration, deadline, &r).await
                }
                Write::Rejected(r) => Err(self.not_holder(key, lease_id, r.as_ref(), now)),
            };
        }
    }

    /// A key seen as a semaphore: the holder's slot first (one request), the plain lease only
    /// if the item is no semaphore (DESIGN.md, "Semaphores": Cost). `None`: renew the lease.
    async fn renew_known_slot(
        &self,
        key: &str,
        lease_id: &LeaseId,
        duration_ms: Option<u64>,
        deadline: Instant,
    ) -> Result<Option<Result<Lease>>> {
        let Some(d) = duration_ms.filter(|_| self.known_semaphore(key)) else { return Ok(None) };
        Ok(match self.renew_slot(key, lease_id, d, deadline).await? {
            Ok(lease) => Some(Ok(lease)),
            Err((Some(r), now)) if r.semaphore.slots.is_some() => {
                Some(Err(self.slot_or_plain_not_holder(key, lease_id, Some(&r), now)))
            }
            Err(_) => None,
        })
    }

    /// For a renewal of `lease_id` refused at `now` only for its order: the item is live for
    /// it and its last renewal (or grant) is stamped at or after `now`, by a coordinator whose
    /// clock is ahead of this one's, the stamp a renewal sent again should carry: one past
    /// that stamp, if the store's clock may already be past it (a stamp beyond what the store's
    /// clock can be now is a wrong clock's, never adopted). Every coordinator's stamps are
    /// never ahead of the store's clock (DESIGN.md, "Clocks"), so the adopted stamp is not
    /// either, and the expiry still only grows. `None` otherwise.
    pub(crate) fn after_renewal(&self, r: &Record, lease_id: &LeaseId, now: u64) -> Option<u64> {
        let t = r.renewed_at_ms?;
        let latest = self.now_ms() + self.safe_margin_now().as_millis() as u64;
        (r.is_live_for(lease_id, now) && t >= now && t < latest).then_some(t + 1)
    }

    pub(crate) fn not_holder(&self, key: &str, lease_id: &LeaseId, r: Option<&Record>, now: u64) -> Error {
        let reason = match r {
            None => Reason::Missing,
            Some(r) => ended_reason(r, lease_id, now).unwrap_or(Reason::Expired),
        };
        Error::NotHolder { key: key.to_string(), reason }
    }
}
