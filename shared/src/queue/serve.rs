//! Serving a queue: the head waiter granted in one write, the grant delivered, a grant that
//! could not be delivered ended, and a release that hands the key over (DESIGN.md, "The
//! waiter queue").

use super::*;

impl Coordinator {
    /// Serves `key`'s queue: when the key is free and waiters are queued, grants it to the head
    /// waiter in one conditional write and delivers the lease; a waiter that is gone is passed
    /// over (its grant revoked) and the next one served. Also delivers again a grant left
    /// undelivered for longer than [`DELIVERY_GRACE_MS`]. Safe to run concurrently with
    /// anything: every write is conditional on what was read.
    pub async fn serve_queue(&self, key: &str) -> Result<Served> {
        let mut served = Served::default();
        let Some(deliver) = self.deliver() else { return Ok(served) };
        // Bounded: each pass either serves one waiter or stops; races re-read.
        for _ in 0..64 {
            let Some(r) = self.store().get(key).await? else { return Ok(served) };
            // The grant below is written as of `now`, and its safe time counted from `sent`,
            // read together: a `sent` read later (after the waiter item's read, which may be
            // slow) would stretch the safe time past the lease's end by as much. It judges
            // expiry and writes one: the clock is checked after the read, right before it is
            // read (a step during the read is refused, not written).
            let now = self.checked_now(key).await?;
            let sent = self.monotonic();
            // Every write below is conditional on this very item (its fence): judged free by the
            // clock that freed it, if that is later than this one.
            let at = self.freed_floor(&r, now);
            if r.is_held(at) {
                if let Some(token) = r.queue.pending_token.clone() {
                    if now.saturating_sub(r.acquired_at_ms) >= DELIVERY_GRACE_MS {
                        self.redeliver(key, &r, &token, &deliver, &mut served).await?;
                    }
                }
                return Ok(served);
            }
            if let Some(token) = r.queue.pending_token.clone() {
                // A grant still marked undelivered whose lease has ended: released by its
                // holder (so it was delivered), or expired before any delivery was known to land.
                if !self.end_undelivered(key, &r, &token, &deliver, &mut served).await? {
                    return Ok(served);
                }
                continue;
            }
            if r.queue_len() == 0 {
                return Ok(served);
            }
            let head = r.queue.queue_head.expect("a queue has a head");
            let seq = head + 1;
            let wk = waiter_key(key, seq);
            let waiter = self.store().get(&wk).await?.and_then(|w| w.queue.waiter).filter(|w| w.seq == seq);
            let waiter = match waiter {
                Some(w) if w.timeout_at_ms.is_none_or(|t| t > now) => w,
                Some(_) => {
                    // Its task timed out: pass over it.
                    if self.skip(key, &r, at, seq).await? {
                        served.skipped += 1;
                        let _ = self.store().delete(&wk, &Condition::Queue(QueueCondition::NotLease)).await;
                    }
                    continue;
                }
                None => {
                    if now.saturating_sub(self.slot_taken_by(key, &r, seq).await?) < ENQUEUE_GRACE_MS {
                        // Its enqueuer may be between its two writes; it serves the queue itself
                        // right after the second (or the sweep does).
                        return Ok(served);
                    }
                    if self.skip(key, &r, at, seq).await? {
                        served.skipped += 1;
                    }
                    continue;
                }
            };
            // Grant: the waiter's lease, a fence above every earlier one, the head moved on.
            let mut lease = self.waiter_lease(key, &r, &waiter, at)?;
            lease.released = r.released_at_ms.map(|_| (r.lease_id.clone(), r.fence));
            let cond = Condition::Queue(QueueCondition::HandOver { fence: r.fence, now_ms: at, head });
            let grant = Mutation::Queue(QueueMutation::Grant { lease, seq, token: waiter.task_token.clone() });
            let granted = match self.store().update(key, &cond, &grant).await? {
                Write::Applied(g) => g,
                Write::Rejected(_) => continue,
            };
            if !self.deliver_grant(&deliver, key, &granted, sent, at, &waiter, &mut served).await? {
                return Ok(served);
            }
        }
        Ok(served)
    }

    /// When slot `seq` (missing its waiter item) was taken, at the latest: the enqueue time of
    /// the first waiter item after it (its slot was taken later), else when the tail last moved.
    async fn slot_taken_by(&self, key: &str, r: &Record, seq: u64) -> Result<u64> {
        let tail = r.queue.queue_tail.unwrap_or(seq);
        for next in seq + 1..=tail.min(seq + 4) {
            if let Some(w) = self.store().get(&waiter_key(key, next)).await?.and_then(|w| w.queue.waiter) {
                return Ok(w.enqueued_at_ms);
            }
        }
        Ok(r.queue.queue_tail_at_ms.unwrap_or(0))
    }

    /// A free key whose last grant is still marked undelivered: a released grant was delivered
    /// (its holder had the lease_id), so only the mark goes; an expired one may never have
    /// reached its waiter, which would then wait until its own timeout: it is told
    /// (`SendTaskFailure`, `LeaseExpired`), at the token of the slot's waiter item too when a
    /// retried invocation wrote it again ([`Self::rewritten`]), and the mark goes, stamped with
    /// this clock checked right before it is read (after the failure, which may take seconds).
    /// `false`: the failure could not be sent (transient), the mark stays and the queue waits
    /// for the next sweep.
    async fn end_undelivered(
        &self,
        key: &str,
        r: &Record,
        token: &str,
        deliver: &Arc<dyn Deliver>,
        served: &mut Served,
    ) -> Result<bool> {
        if r.released_at_ms.is_none() {
            let cause = format!(
                "the lease granted on {key:?} (fence {}) expired before its delivery was confirmed; acquire again",
                r.fence
            );
            let newer = self.rewritten(key, r, token).await?;
            for to in std::iter::once(token).chain(newer.as_deref()) {
                match deliver.failure(to, "LeaseExpired", &cause).await {
                    Ok(()) | Err(DeliveryError::Gone(_)) => {}
                    Err(DeliveryError::Transient(why)) => {
                        tracing::warn!(
                            key,
                            why,
                            "could not tell the waiter of an expired grant; the sweep tries again"
                        );
                        served.undelivered += 1;
                        return Ok(false);
                    }
                }
            }
            served.skipped += 1;
        }
        let freed = Mutation::Queue(QueueMutation::Delivered { now_ms: self.checked_now(key).await? });
        self.store()
            .update(
                key,
                &Condition::Queue(QueueCondition::Undelivered { fence: r.fence, token: token.to_string() }),
                &freed,
            )
            .await?;
        if let Some(seq) = r.queue.queue_head {
            let _ = self.store().delete(&waiter_key(key, seq), &Condition::Queue(QueueCondition::NotLease)).await;
        }
        Ok(true)
    }

    /// The lease a grant gives `waiter` on the item `r` read at `now`: the waiter's own
    /// lease_id, duration, metadata and keep-alive, and a fence above every earlier one.
    fn waiter_lease(&self, key: &str, r: &Record, waiter: &Waiter, now: u64) -> Result<NewLease> {
        let fence = self.next_fence(key, Some(r.fence))?;
        Ok(NewLease {
            metadata: waiter.metadata.clone(),
            keepalive: waiter.keepalive.clone(),
            // A key in a work state is kept until it is taken: no TTL (as for a batch grant).
            ttl: r.work.state.is_none().then(|| self.ttl_after(now + waiter.duration_ms)),
            ..NewLease::new(&waiter.holder, waiter.lease_id.clone(), now, Some(waiter.duration_ms), fence)
        })
    }

    /// After a grant landed (`granted`, written at `now`, sent at `sent`): delivers it, then
    /// the undelivered mark goes and the waiter item is deleted. A waiter that is gone has its
    /// grant revoked: `true`, the queue needs serving again. A delivery that keeps failing
    /// leaves the grant marked for the sweep.
    #[allow(clippy::too_many_arguments)]
    async fn deliver_grant(
        &self,
        deliver: &Arc<dyn Deliver>,
        key: &str,
        granted: &Record,
        sent: Instant,
        now: u64,
        waiter: &Waiter,
        served: &mut Served,
    ) -> Result<bool> {
        let (fence, seq, wk) = (granted.fence, waiter.seq, waiter_key(key, waiter.seq));
        let lease = granted.lease(sent, now, self.safe_margin(sent, now)).with_safe_for(sent);
        let token = waiter.task_token.clone();
        match self.deliver_with_retries(deliver, &token, &lease).await {
            Ok(()) => {
                served.delivered += 1;
                let delivered = Mutation::Queue(QueueMutation::Delivered { now_ms: self.checked_now(key).await? });
                let _ = self
                    .store()
                    .update(key, &Condition::Queue(QueueCondition::UndeliveredLive { fence, token }), &delivered)
                    .await?;
                let _ = self.store().delete(&wk, &Condition::Queue(QueueCondition::NotLease)).await;
                Ok(false)
            }
            Err(DeliveryError::Gone(why)) => {
                // A retried invocation of the waiter's task wrote the slot's waiter item again
                // with its own token after it was read for this grant: the grant goes to that
                // token (the mark moves to it, so the revoke below cannot land), never revoked.
                if let Some(newer) = self.rewritten(key, granted, &token).await? {
                    tracing::info!(key, seq, why, "the waiter's task was retried; its grant goes to the new token");
                    if self.move_mark(key, fence, &token, &newer).await? {
                        self.redeliver(key, granted, &newer, deliver, served).await?;
                    }
                    return Ok(false);
                }
                // Never delivered (the first answer said so): nobody holds it. Free the key and
                // serve the next waiter; unless a retried invocation of the waiter's task moved
                // the mark to its own token (this one died with its attempt): then the grant is
                // that invocation's to deliver, and the revoke is refused.
                tracing::info!(key, seq, why, "queued waiter is gone; its grant is revoked");
                // A key in a work state is kept until it is taken: no TTL.
                let ttl = granted.work.state.is_none().then(|| self.ttl_after(now + self.max_duration_ms()));
                let m = Mutation::Queue(QueueMutation::Revoke { now_ms: self.checked_now(key).await?, ttl });
                self.store().update(key, &Condition::Queue(QueueCondition::Undelivered { fence, token }), &m).await?;
                let _ = self.store().delete(&wk, &Condition::Queue(QueueCondition::NotLease)).await;
                served.skipped += 1;
                Ok(true)
            }
            Err(DeliveryError::Transient(why)) => {
                tracing::warn!(key, seq, why, "delivery of a hand-over grant failed; the sweep delivers it");
                served.undelivered += 1;
                Ok(false)
            }
        }
    }

    /// A release that found waiters (its `Unqueued` release was refused, `r` the item with the
    /// releasing lease still unreleased): ends the lease and grants the key to the head waiter
    /// in ONE conditional write, then delivers the grant. `None`: not done, nothing written
    /// (the min_hold has not passed, the head waiter is timed out or its item is not there, or
    /// the item moved on): the caller releases the ordinary way and the queue is served after.
    pub(crate) async fn release_handing_over(
        &self,
        key: &str,
        lease_id: &LeaseId,
        r: &Record,
    ) -> Result<Option<Released>> {
        let (Some(deliver), Some(head)) = (self.deliver(), r.queue.queue_head) else { return Ok(None) };
        self.check_clock(key).await?;
        let now = self.now_ms();
        if r.min_hold_until_ms > now {
            return Ok(None);
        }
        let seq = head + 1;
        let waiter =
            self.store().get(&waiter_key(key, seq)).await?.and_then(|w| w.queue.waiter).filter(|w| w.seq == seq);
        let Some(waiter) = waiter.filter(|w| w.timeout_at_ms.is_none_or(|t| t > now)) else { return Ok(None) };
        // Through the retrying write: the grant keeps the releasing lease's id, so a retry whose
        // earlier try landed recognises it (as does a retried release), and a write that may
        // have landed answers `OutcomeUnknown`.
        let deadline = self.monotonic() + self.config().retry_budget;
        let released_id = (lease_id.clone(), r.fence);
        let mut tries = 0;
        let (w, sent, now) = self
            .write(key, deadline, |now| {
                tries += 1;
                let mut lease = self.waiter_lease(key, r, &waiter, now)?;
                lease.released = Some(released_id.clone());
                Ok((
                    Condition::Queue(QueueCondition::ReleaseHandOver {
                        lease_id: lease_id.clone(),
                        fence: r.fence,
                        now_ms: now,
                        head,
                    }),
                    Mutation::Queue(QueueMutation::Grant { lease, seq, token: waiter.task_token.clone() }),
                ))
            })
            .await
            .map_err(|f| f.into_error(key))?;
        let granted = match w {
            Write::Applied(g) => g,
            // The grant is there: an earlier try of this write landed (its answer lost), or a
            // concurrent release of the same lease (a retry) made it. This one cannot tell
            // which, so it does not deliver: a delivery of another's grant could reach the task
            // first, and that release revokes a grant its first delivery finds gone. The grant
            // stays marked; the sweep delivers it after the grace, and never revokes.
            Write::Rejected(Some(g))
                if g.queue.released_lease_id.as_ref() == Some(lease_id)
                    && g.lease_id == waiter.lease_id
                    && g.queue.queue_head == Some(seq) =>
            {
                return Ok(Some(Released::at(key, r.fence, g.acquired_at_ms, tries == 1, r.work.state.clone())));
            }
            Write::Rejected(_) => return Ok(None),
        };
        let released = Released::at(key, r.fence, now, false, r.work.state.clone());
        let mut served = Served::default();
        if self.deliver_grant(&deliver, key, &granted, sent, now, &waiter, &mut served).await? {
            if let Err(e) = self.serve_queue(key).await {
                tracing::warn!(
                    key,
                    error = e.name(),
                    "serving the queue after a gone waiter failed; the sweep serves it"
                );
            }
        }
        Ok(Some(released))
    }
}
