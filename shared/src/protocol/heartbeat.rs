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
        self.config.limits.key(key)?;
        if let Some(d) = duration {
            self.config.limits.duration("duration_ms", d)?;
        }
        // The clock is checked by each write itself, right before it is sent (`write`): the
        // slot's renewal and the lease's alike.
        let duration_ms = duration.map(|d| d.as_millis() as u64);
        // A key seen as a semaphore: the holder's slot first (one request), the plain lease
        // only if the item is no semaphore (DESIGN.md, "Semaphores": Cost).
        if let Some(d) = duration_ms.filter(|_| self.known_semaphore(key)) {
            match self.renew_slot(key, lease_id, d, deadline).await? {
                Ok(lease) => return Ok(lease),
                Err((Some(r), now)) if r.semaphore.slots.is_some() => {
                    return Err(self.slot_or_plain_not_holder(key, lease_id, Some(&r), now))
                }
                Err(_) => {}
            }
        }
        let max = self.max_duration_ms();
        // A key in a work state keeps no TTL: a renewal writing one is conditional on no state,
        // and one refused because the key is in a state goes again without (removing any TTL a
        // release or force-release left). No renewal, answered or not, leaves a TTL on a work
        // item (DESIGN.md, "Work items and batch leases").
        let mut in_state = false;
        let mut terminal = false;
        loop {
            let (w, sent, now) = self
                .write(key, deadline, |now| {
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
            return match w {
                Write::Applied(r) => {
                    check_fence(&r)?;
                    Ok(r.lease(sent, now, self.skew_ms()))
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
                    Ok(r.lease(sent, now, self.skew_ms()))
                }
                // A semaphore's item: the holder's own renewal (DESIGN.md, "Semaphores").
                Write::Rejected(Some(r)) if r.semaphore.slots.is_some() => {
                    self.heartbeat_slot(key, lease_id, duration, deadline, &r).await
                }
                Write::Rejected(r) => Err(self.not_holder(key, lease_id, r.as_ref(), now)),
            };
        }
    }

    pub(crate) fn not_holder(&self, key: &str, lease_id: &LeaseId, r: Option<&Record>, now: u64) -> Error {
        let reason = match r {
            None => Reason::Missing,
            Some(r) => ended_reason(r, lease_id, now).unwrap_or(Reason::Expired),
        };
        Error::NotHolder { key: key.to_string(), reason }
    }
}
