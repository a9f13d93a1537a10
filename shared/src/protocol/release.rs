//! Release and force-release: the writes that end a lease (DESIGN.md, "Release").

use super::*;

impl Coordinator {
    /// Releases the lease. Idempotent: releasing a released lease (a retry after a lost
    /// answer, or a stale release after a force-release) changes nothing and answers with
    /// `already_released`.
    pub async fn release(&self, key: &str, lease_id: &LeaseId) -> Result<Released> {
        self.release_to(key, lease_id, None).await
    }

    /// [`Coordinator::release`], moving the key into work state `state` in the same write
    /// (only while the lease is live). `None` keeps the key's state.
    pub async fn release_to(&self, key: &str, lease_id: &LeaseId, state: Option<&str>) -> Result<Released> {
        self.config.limits.key(key)?;
        if let Some(s) = state {
            crate::validate::check_state(s)?;
        }
        // A key seen as a semaphore: the holder's slot first (DESIGN.md, "Semaphores": Cost).
        if let Some(released) = self.release_known_slot(key, lease_id, state).await? {
            return Ok(released);
        }
        // A head waiter of this coordinator sleeping on the key: hand it over in this write
        // (not when the key moves to a work state: the hand-over writes a lease in none).
        // A hand-over whose write failed ambiguously stays claimed (its waiter keeps waiting)
        // until the ordinary release below settles whether it landed.
        let mut unsettled = None;
        if let Some(claim) = state.is_none().then(|| self.wakeups.claim(key)).flatten() {
            match self.release_to_waiter(key, lease_id, claim).await {
                ToWaiter::Done(released) => return Ok(released),
                ToWaiter::NotDone => {}
                ToWaiter::Unsettled(u) => unsettled = Some(u),
            }
        }
        // A coordinator that serves queues releases in this write only a key without queued
        // waiters; with waiters, the release grants the head waiter in a write of its own
        // making (DESIGN.md, "The waiter queue": hand-over).
        let mut hand_over = state.is_none() && self.release_hook.is_some();
        loop {
            let (w, now) = self.release_write(key, lease_id, state, hand_over).await?;
            let waiter = unsettled.as_ref().map(|u| u.claim.offer().lease.lease_id.clone());
            match sort_release(w, lease_id, waiter.as_ref(), hand_over) {
                // The ambiguous hand-over did land: the key is the waiter's, and this release
                // is done.
                ReleaseAnswer::ToWaiter(r) => {
                    let u = unsettled.take().expect("unsettled");
                    self.settle_grant(key, u.claim, r, u.sent, u.now).await;
                    return Ok(u.released);
                }
                ReleaseAnswer::Released(r) => {
                    // This release landed, so the ambiguous hand-over never can (its condition
                    // needs the lease unreleased): its waiter tries by itself.
                    drop(unsettled.take());
                    self.keep_queued(key, &r).await;
                    self.freed(key, &r);
                    self.after_free(key, &r).await;
                    return Ok(released(key, &r, now, false));
                }
                ReleaseAnswer::Queued(r) => {
                    if let Some(done) = self.release_queued(key, lease_id, &r).await? {
                        return Ok(done);
                    }
                    // Not done (the head waiter is not ready to take it, or the item moved on):
                    // the ordinary release, then the queue is served after it.
                    hand_over = false;
                }
                ReleaseAnswer::Already(r) => return Ok(released(key, &r, now, true)),
                // Released by a hand-over that granted the key on in the same write (or right
                // after): the grant keeps the released lease's id and fence.
                ReleaseAnswer::HandedOn(r) => {
                    let fence = r.queue.released_fence.unwrap_or(r.fence);
                    return Ok(Released::at(key, fence, r.acquired_at_ms, true, r.work.state.clone()));
                }
                // A semaphore's item: the holder's own release (DESIGN.md, "Semaphores").
                ReleaseAnswer::NotHolder(Some(r)) if r.semaphore.slots.is_some() && state.is_none() => {
                    return self.release_slot(key, lease_id).await
                }
                ReleaseAnswer::NotHolder(r) => return Err(self.not_holder(key, lease_id, r.as_ref(), now)),
            }
        }
    }

    /// The release's conditional write (retried): into `state` while the lease is live, or
    /// freeing the key while it is unreleased (with `hand_over`, only while nobody is queued).
    async fn release_write(
        &self,
        key: &str,
        lease_id: &LeaseId,
        state: Option<&str>,
        hand_over: bool,
    ) -> Result<(Write, u64)> {
        let deadline = self.monotonic() + self.config.retry_budget;
        let max = self.max_duration_ms();
        let attempt = |now| {
            let ttl = self.ttl_after(now + max);
            let lease_id = lease_id.clone();
            Ok(match state {
                None if hand_over => (
                    Condition::Queue(QueueCondition::Unqueued { lease_id }),
                    Mutation::Lease(LeaseMutation::Release { now_ms: now, ttl }),
                ),
                None => (
                    Condition::Lease(LeaseCondition::Unreleased { lease_id }),
                    Mutation::Lease(LeaseMutation::Release { now_ms: now, ttl }),
                ),
                Some(s) => (
                    Condition::Lease(LeaseCondition::Live { lease_id, now_ms: now }),
                    Mutation::Work(WorkMutation::ReleaseTo {
                        now_ms: now,
                        state: s.to_string(),
                        shard: self.state_shard(key, s),
                        ttl: self.state_ttl(s, now),
                    }),
                ),
            })
        };
        // A plain release judges no expiry and sets none (its `released_at_ms` only delays a
        // fail-closed acquire sent before it): a coordinator whose clock is refused may still
        // release. A release into a state judges the lease live with this clock (`Live`).
        let (w, _, now) = match state {
            None => self.write_unchecked(key, deadline, attempt).await,
            Some(_) => self.write(key, deadline, attempt).await,
        }
        .map_err(|f| f.into_error(key))?;
        Ok((w, now))
    }

    /// Operator release: frees the key at once whoever holds it (min_hold ignored) and
    /// advances the fence, so the evicted holder's fence is below any later one.
    /// On a semaphore, every holder is evicted. The item is read first, and the write lands only
    /// on the item as read (its fence: every grant moves it), so that a plain force-release
    /// never lands on a semaphore made in between (DESIGN.md, "force_release(key)").
    pub async fn force_release(&self, key: &str) -> Result<LeaseState> {
        self.config.limits.key(key)?;
        let deadline = self.monotonic() + self.config.retry_budget;
        loop {
            let Some(r) = self.read(deadline, || self.store.get(key)).await? else {
                return Err(Error::NotFound { key: key.to_string() });
            };
            let done = match r.semaphore.slots {
                Some(_) => self.evict_slots(key, &r, None, deadline).await?,
                None => self.force_release_lease(key, &r, deadline).await?,
            };
            if let Some(s) = done {
                return Ok(s);
            }
            if self.monotonic() >= deadline {
                return Err(Error::StoreUnavailable(format!("{key:?} kept changing until the deadline")));
            }
        }
    }

    /// The force-release of the plain lease `r` (the item as read). `None`: the key changed
    /// hands since it was read (read it again).
    async fn force_release_lease(&self, key: &str, r: &Record, deadline: Instant) -> Result<Option<LeaseState>> {
        let max = self.max_duration_ms();
        let (w, _, now) = self
            .write_unchecked(key, deadline, |now| {
                let m = Mutation::Lease(LeaseMutation::ForceRelease { now_ms: now, ttl: self.ttl_after(now + max) });
                Ok((Condition::FenceIs(r.fence), m))
            })
            .await
            .map_err(|f| f.into_error(key))?;
        match w {
            Write::Applied(r) => {
                self.keep_queued(key, &r).await;
                self.wakeups.wake(key);
                self.after_free(key, &r).await;
                Ok(Some(r.state(now)))
            }
            Write::Rejected(None) => Err(Error::NotFound { key: key.to_string() }),
            Write::Rejected(Some(_)) => Ok(None),
        }
    }

    /// Operator release of the one holder of semaphore `key` whose fence is `fence` (its slot
    /// frees at once, and the key's fence moves past every fence issued). `NotFound` when no
    /// unreleased holder has that fence; `InvalidRequest` when `key` is no semaphore.
    pub async fn force_release_slot(&self, key: &str, fence: u64) -> Result<LeaseState> {
        self.config.limits.key(key)?;
        let deadline = self.monotonic() + self.config.retry_budget;
        loop {
            let Some(r) = self.read(deadline, || self.store.get(key)).await? else {
                return Err(Error::NotFound { key: key.to_string() });
            };
            if r.semaphore.slots.is_none() {
                return Err(Error::invalid(format!("{key:?} is no semaphore: force-release it without a fence")));
            }
            if let Some(s) = self.evict_slots(key, &r, Some(fence), deadline).await? {
                return Ok(s);
            }
            if self.monotonic() >= deadline {
                return Err(Error::StoreUnavailable(format!("{key:?} kept changing until the deadline")));
            }
        }
    }

    /// The release hook's release of a lease with queued waiters (`None`: not done).
    async fn release_queued(&self, key: &str, lease_id: &LeaseId, r: &Record) -> Result<Option<Released>> {
        match &self.release_hook {
            Some(h) => h.release_queued(self, key, lease_id, r).await,
            None => Ok(None),
        }
    }
}

/// The answer to a release of item `r` at `now`.
fn released(key: &str, r: &Record, now: u64, already_released: bool) -> Released {
    Released {
        key: key.to_string(),
        fence: r.fence,
        released_at_ms: r.released_at_ms.unwrap_or(now),
        free_at_ms: r.expires_at_ms.unwrap_or(now).max(now),
        already_released,
        state: r.work.state.clone(),
    }
}
