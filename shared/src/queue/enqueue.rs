//! A queued acquire: its waiter item, its place in the queue, its retry with the same
//! lease_id, and a grant on a key it found free (DESIGN.md, "The waiter queue").

use super::*;

impl Coordinator {
    /// Writes the waiter item of `waiter` (slot `waiter.seq` of `key`'s queue). Its task times
    /// out at `task_deadline` (this coordinator's monotonic clock): `timeout_at_ms` is dated by
    /// each try's clock, checked right before it, never by an unchecked reading (a clock stepped
    /// as the call began would date the timeout wrong, and the waiter would be passed over as
    /// timed out while its task still waits).
    async fn put_waiter(
        &self,
        key: &str,
        waiter: Waiter,
        task_deadline: Option<Instant>,
        deadline: Instant,
    ) -> Result<()> {
        let max_wait = self.config().limits.max_wait.as_millis() as u64;
        let wk = waiter_key(key, waiter.seq);
        let mut item = Record::key_only(wk.clone());
        item.holder = waiter.holder.clone();
        item.lease_id = waiter.lease_id.clone();
        item.acquired_at_ms = waiter.enqueued_at_ms;
        item.expires_at_ms = Some(0);
        item.queue.waiter = Some(waiter);
        // Stamped with this try's clock: a retried invocation writes the item again with its
        // own token, and a write of an earlier try held in the network must not put the dead
        // token back (`WaiterNewer`; refused, it changes nothing). This machine's own clock,
        // not the corrected one (the stamp judges no expiry): a new process's corrected clock
        // may lag the store's by up to a second and more (DESIGN.md, "Clocks"), and a retry on
        // a new process a second later would be refused as the older. Kept as long as the
        // waiter may wait (its own timeout, else a year) and then hold, from that same stamp
        // (never behind the corrected clock, so never a shorter TTL).
        self.write(&wk, deadline, |_| {
            let now = self.own_clock_ms();
            let left = |d: Instant| d.saturating_duration_since(self.monotonic()).as_millis() as u64;
            let timeout_at_ms = task_deadline.map(|d| now.saturating_add(left(d)));
            if let Some(w) = item.queue.waiter.as_mut() {
                w.timeout_at_ms = timeout_at_ms;
            }
            let waits_until = timeout_at_ms.unwrap_or(now.saturating_add(LONGEST_WAIT_MS)).max(now + max_wait);
            item.ttl = Some(self.ttl_after(waits_until.saturating_add(self.max_duration_ms())));
            item.renewed_at_ms = Some(now);
            Ok((
                Condition::Queue(QueueCondition::WaiterNewer { now_ms: now }),
                Mutation::Queue(QueueMutation::PutWaiter(Box::new(item.clone()))),
            ))
        })
        .await
        .map_err(|f| f.into_error(key))?;
        Ok(())
    }

    /// A queued acquire: takes the key if it is free (and delivers the lease at once), else
    /// joins its queue and returns. The lease is delivered to `task_token` when the waiter's
    /// turn comes. `duration` is required (a waiter's grant must end by itself if it is never
    /// delivered). `task_timeout`: the task's timeout, counted from this call (a waiter whose
    /// timeout has passed is passed over).
    pub async fn acquire_or_enqueue(
        &self,
        key: &str,
        holder: &str,
        duration: Duration,
        opts: AcquireOptions,
        task_token: &str,
        task_timeout: Option<Duration>,
    ) -> Result<Enqueued> {
        self.check_queued(key, holder, duration, &opts, task_token)?;
        let task_deadline = task_timeout.map(|t| self.monotonic() + t);
        let deliver = self.deliverer()?;
        // Only a caller's lease_id can be sent again by a retried invocation.
        let mut retry_possible = opts.lease_id.is_some();
        let lease_id = opts.lease_id.clone().unwrap_or_else(LeaseId::generate);
        let opts = AcquireOptions { lease_id: Some(lease_id.clone()), ..opts };
        let shard = queue_shard(key);
        // A new queue starts above the item's fence (the enqueue's condition): learned from a
        // refused enqueue when this clock is not above it.
        let mut floor = 0;
        for _ in 0..8 {
            // Free and without waiters: the plain acquire (one request).
            match self.acquire(key, holder, Some(duration), opts.clone()).await {
                Ok(lease) => return self.deliver_free_grant(key, lease, task_token, &deliver, true).await,
                Err(Error::LeaseHeld { .. }) => {}
                Err(e) => return Err(e),
            }
            // A retried invocation whose earlier try's waiter item landed (its answer lost) keeps
            // that slot, with this try's task token, instead of taking a second one: one slot per
            // lease_id, so a lease_id is granted at most once; and one whose slot was granted
            // already takes that grant over.
            if std::mem::take(&mut retry_possible) {
                if let Some(done) = self.resume(key, &lease_id, task_token, task_deadline, &deliver).await? {
                    return Ok(done);
                }
            }
            // Held, or free with waiters: join the queue. Idempotent per lease_id: a retry
            // whose earlier try landed (or a retried invocation) finds the last slot is its own.
            let deadline = self.monotonic() + self.config().retry_budget;
            let start = self.now_us().max(floor + 1);
            let (w, now) = self.enqueue(key, &lease_id, start, shard, deadline).await?;
            let (r, enqueued_at) = match w {
                Write::Applied(r) => (r, now),
                Write::Rejected(Some(r))
                    if r.queue.queue_tail_lease_id.as_ref() == Some(&lease_id) && r.queue_len() > 0 =>
                {
                    let at = r.queue.queue_tail_at_ms.unwrap_or(now);
                    (r, at)
                }
                // A new queue, and its start not above the item's fence: go again above it.
                Write::Rejected(Some(r)) if r.queue.queue_head.is_none() && r.fence >= start => {
                    floor = r.fence;
                    continue;
                }
                // Freed in between: take it.
                Write::Rejected(_) => continue,
            };
            let seq = r.queue.queue_tail.expect("an enqueue sets the tail");
            let waiter = Waiter {
                seq,
                holder: holder.to_string(),
                lease_id: lease_id.clone(),
                duration_ms: duration.as_millis() as u64,
                metadata: opts.metadata.clone(),
                keepalive: opts.keepalive.clone(),
                task_token: task_token.to_string(),
                enqueued_at_ms: enqueued_at,
                // Dated by the waiter item's write, with its checked clock.
                timeout_at_ms: None,
            };
            let head = r.queue.queue_head.unwrap_or(seq - 1);
            return self.place_waiter(key, waiter, head, task_deadline, deadline).await;
        }
        Err(Error::StoreUnavailable(format!("{key:?} kept changing hands while joining its queue")))
    }

    /// The enqueue's write (a new queue's counters start at `start`), and its clock.
    async fn enqueue(
        &self,
        key: &str,
        lease_id: &LeaseId,
        start: u64,
        shard: u32,
        deadline: Instant,
    ) -> Result<(Write, u64)> {
        let (w, _, now) = self
            .write(key, deadline, |now| {
                let join = QueueCondition::Queueable { now_ms: now, lease_id: lease_id.clone(), start };
                let enqueue = QueueMutation::Enqueue { now_ms: now, start, lease_id: lease_id.clone(), shard };
                Ok((join.into(), enqueue.into()))
            })
            .await
            .map_err(|f| f.into_error(key))?;
        Ok((w, now))
    }

    /// What a queued acquire must be: a valid acquire with a duration, neither `min_hold` nor
    /// `wait`, and a task token of Step Functions' size.
    fn check_queued(
        &self,
        key: &str,
        holder: &str,
        duration: Duration,
        opts: &AcquireOptions,
        task_token: &str,
    ) -> Result<()> {
        self.check_acquire(key, holder, Some(duration), opts)?;
        if opts.min_hold.is_some() || opts.wait.is_some() {
            return Err(Error::invalid("a queued acquire takes neither min_hold_ms nor wait_ms"));
        }
        if task_token.is_empty() || task_token.len() > 2048 {
            return Err(Error::invalid("task_token must be 1..=2048 bytes (a Step Functions task token)"));
        }
        Ok(())
    }

    /// Writes the waiter item of a slot taken (or kept) in `key`'s queue, whose head is `head`,
    /// and answers `Queued`. The key may have been freed between the enqueue and this write,
    /// with nobody to serve this waiter: it is served now (one read when the key is still held).
    async fn place_waiter(
        &self,
        key: &str,
        waiter: Waiter,
        head: u64,
        task_deadline: Option<Instant>,
        deadline: Instant,
    ) -> Result<Enqueued> {
        let (seq, lease_id) = (waiter.seq, waiter.lease_id.clone());
        self.put_waiter(key, waiter, task_deadline, deadline).await?;
        if let Err(e) = self.serve_queue(key).await {
            tracing::warn!(key, error = e.name(), "serving the queue after an enqueue failed");
        }
        Ok(Enqueued::Queued { seq, position: seq.saturating_sub(head), lease_id })
    }

    /// A queued acquire sent again with its lease_id (a retried invocation, with a new task
    /// token): what became of its earlier try. Its waiter item found in the queue: the slot is
    /// kept, the item written again with this try's token ([`Self::after_rewrite`]). Its slot
    /// granted already, the grant still marked undelivered to the earlier try's token: taken
    /// over ([`Self::take_over`]). `None`: neither, the acquire goes on (enqueues).
    async fn resume(
        &self,
        key: &str,
        lease_id: &LeaseId,
        task_token: &str,
        task_deadline: Option<Instant>,
        deliver: &Arc<dyn Deliver>,
    ) -> Result<Option<Enqueued>> {
        match self.own_waiter(key, lease_id).await? {
            None => Ok(None),
            Some(Own::Slot(w)) => {
                let deadline = self.monotonic() + self.config().retry_budget;
                let seq = w.seq;
                let waiter = Waiter { task_token: task_token.to_string(), ..w };
                self.put_waiter(key, waiter, task_deadline, deadline).await?;
                self.after_rewrite(key, lease_id, seq, task_token, deliver).await.map(Some)
            }
            Some(Own::Granted(r)) => self.take_over(key, &r, task_token, deliver).await.map(Some),
            // Its mark went meanwhile (a delivery to the dead token answered `Gone`): as a
            // plain acquire that finds its own live lease.
            Some(Own::Free(r)) => {
                let lease = self.lease_now(&r);
                self.deliver_free_grant(key, lease, task_token, deliver, true).await.map(Some)
            }
            // Revoked meanwhile (its delivery to the dead token answered `Gone`), or expired.
            Some(Own::Ended(reason)) => Err(Error::NotHolder { key: key.to_string(), reason }),
        }
    }

    /// A retried invocation wrote its slot `seq`'s waiter item again with its own `token`; the
    /// slot may have been granted meanwhile from the item as it was, to the earlier try's token
    /// (dead: its delivery answers `Gone`, and the grant would be revoked, this token left
    /// waiting). So the lease item is read again. The slot not granted yet: its grant is written
    /// after this read, and whoever delivers it reads the waiter item again before taking a
    /// `Gone` as final ([`Self::rewritten`]): this token is served. Granted: as when the look
    /// finds the grant: still marked, taken over ([`Self::take_over`]); no longer marked,
    /// delivered to this token but never released on `Gone` (this token may have it already:
    /// a deliverer that read the rewritten item); ended, or the key moved on past the slot,
    /// `NotHolder` (released) at once, as a retry that comes after the revoke is answered: the
    /// grant was revoked before the mark could move (or this token had it, and its task has
    /// moved on). The rewritten item of a slot served is deleted.
    async fn after_rewrite(
        &self,
        key: &str,
        lease_id: &LeaseId,
        seq: u64,
        token: &str,
        deliver: &Arc<dyn Deliver>,
    ) -> Result<Enqueued> {
        let deadline = self.monotonic() + self.config().retry_budget;
        let r = self.read(deadline, || self.store().get(key)).await?;
        if let Some(head) = r.as_ref().and_then(|r| r.queue.queue_head).filter(|h| *h < seq) {
            if let Err(e) = self.serve_queue(key).await {
                tracing::warn!(key, error = e.name(), "serving the queue after an enqueue failed");
            }
            return Ok(Enqueued::Queued { seq, position: seq - head, lease_id: lease_id.clone() });
        }
        let own = r.filter(|r| &r.lease_id == lease_id);
        let done = match own.map(|r| (crate::protocol::ended_reason(&r, lease_id, self.now_ms()), r)) {
            Some((None, r)) if r.queue.pending_token.is_some() => self.take_over(key, &r, token, deliver).await,
            Some((None, r)) => {
                let lease = self.lease_now(&r);
                self.deliver_free_grant(key, lease, token, deliver, false).await
            }
            Some((Some(reason), _)) => Err(Error::NotHolder { key: key.to_string(), reason }),
            None => Err(Error::NotHolder { key: key.to_string(), reason: Reason::Released }),
        };
        let _ = self.store().delete(&waiter_key(key, seq), &Condition::Queue(QueueCondition::NotLease)).await;
        done
    }

    /// The queue's grant `r` of this acquire's lease_id, marked undelivered to an earlier try's
    /// token, which died with that try (Step Functions gives each attempt of a task its own
    /// token): a delivery to it answers `Gone`, and its deliverer would revoke the grant. So
    /// the mark moves to this try's token (conditional on the old one: the revoke, conditional
    /// on the token it delivered to, is then refused), and the lease is delivered to this
    /// token as the sweep delivers again, never revoked (another delivery to the same token may
    /// reach the task first). Neither delivered as a free grant nor released: a free grant's
    /// first `Gone` proves nothing here. Revoked before the mark moved: `NotHolder` (released),
    /// as a plain acquire of an ended lease_id. The same token (an invocation sent again as it
    /// was): left to the queue's delivery.
    async fn take_over(&self, key: &str, r: &Record, token: &str, deliver: &Arc<dyn Deliver>) -> Result<Enqueued> {
        let old = r.queue.pending_token.clone().unwrap_or_default();
        let lease = self.lease_now(r).with_safe_for(self.monotonic());
        if old == token {
            return Ok(Enqueued::Granted(lease));
        }
        let deadline = self.monotonic() + self.config().retry_budget;
        let cond = Condition::Queue(QueueCondition::Undelivered { fence: r.fence, token: old });
        let mark =
            Mutation::Queue(QueueMutation::MarkUndelivered { token: token.to_string(), shard: queue_shard(key) });
        let (w, _, _) =
            self.write(key, deadline, |_| Ok((cond.clone(), mark.clone()))).await.map_err(|f| f.into_error(key))?;
        match w {
            Write::Applied(_) => {}
            // An earlier try of this write landed (its answer lost).
            Write::Rejected(Some(g)) if g.fence == r.fence && g.queue.pending_token.as_deref() == Some(token) => {}
            Write::Rejected(_) => return Err(Error::NotHolder { key: key.to_string(), reason: Reason::Released }),
        }
        let mut served = Served::default();
        self.redeliver(key, r, token, deliver, &mut served).await?;
        Ok(Enqueued::Granted(lease))
    }

    /// What a queued acquire's earlier try left in `key`'s queue, if anything: its waiter item
    /// (with the queue's head), read from the tail back, over the items enqueued within
    /// [`RETRY_WINDOW_MS`] (an earlier try of the same queued acquire is no older), at most
    /// [`RETRY_SCAN_SLOTS`] of them; or its slot's grant, live and still marked undelivered.
    async fn own_waiter(&self, key: &str, lease_id: &LeaseId) -> Result<Option<Own>> {
        // Reads retried (a lost answer must not fail the acquire), within the retry budget.
        let deadline = self.monotonic() + self.config().retry_budget;
        let Some(r) = self.read(deadline, || self.store().get(key)).await? else { return Ok(None) };
        if &r.lease_id == lease_id {
            // Its slot was granted (the plain acquire before saw it marked undelivered).
            return Ok(Some(match crate::protocol::ended_reason(&r, lease_id, self.now_ms()) {
                None if r.queue.pending_token.is_some() => Own::Granted(r),
                None => Own::Free(r),
                Some(reason) => Own::Ended(reason),
            }));
        }
        let (Some(head), Some(tail)) = (r.queue.queue_head, r.queue.queue_tail) else { return Ok(None) };
        let since = self.now_ms().saturating_sub(RETRY_WINDOW_MS);
        for seq in (head + 1..=tail).rev().take(RETRY_SCAN_SLOTS as usize) {
            let wk = waiter_key(key, seq);
            let Some(w) = self.read(deadline, || self.store().get(&wk)).await?.and_then(|w| w.queue.waiter) else {
                continue;
            };
            if &w.lease_id == lease_id && w.seq == seq {
                return Ok(Some(Own::Slot(w)));
            }
            if w.enqueued_at_ms < since {
                break;
            }
        }
        Ok(None)
    }

    /// A queued acquire took the free key: delivers the lease. Only a first attempt answered
    /// `Gone` proves the task never had it (`gone_proves`: nobody else could have delivered it
    /// to this token): then the lease is released. Any other failure may follow a delivery that
    /// landed (its answer lost), so the grant is kept, marked undelivered, and the sweep
    /// delivers it again.
    async fn deliver_free_grant(
        &self,
        key: &str,
        lease: Lease,
        token: &str,
        deliver: &Arc<dyn Deliver>,
        gone_proves: bool,
    ) -> Result<Enqueued> {
        match self.deliver_with_retries(deliver, token, &lease).await {
            Ok(()) => Ok(Enqueued::Granted(lease)),
            // The lease may be this token's already: it ends with its duration.
            Err(DeliveryError::Gone(_)) if !gone_proves => Ok(Enqueued::Granted(lease)),
            Err(DeliveryError::Gone(why)) => {
                // Nobody will use it: free the key (and serve any waiter behind).
                let _ = self.release(key, &lease.lease_id).await;
                Err(Error::invalid(format!("the lease could not be delivered, the task is gone: {why}")))
            }
            Err(DeliveryError::Transient(why)) => {
                tracing::warn!(key, why, "delivery of a queued acquire's grant failed; the sweep delivers it");
                let deadline = self.monotonic() + self.config().retry_budget;
                let mark = Mutation::Queue(QueueMutation::MarkUndelivered {
                    token: token.to_string(),
                    shard: queue_shard(key),
                });
                if let Err(f) = self.write(key, deadline, |_| Ok((Condition::FenceIs(lease.fence), mark.clone()))).await
                {
                    let e = f.into_error(key);
                    tracing::warn!(
                        key,
                        error = e.name(),
                        "could not mark a grant undelivered; it ends with its duration"
                    );
                }
                Ok(Enqueued::Granted(lease))
            }
        }
    }
}
