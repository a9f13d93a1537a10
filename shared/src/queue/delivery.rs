//! Delivering grants: retries, deliveries again after a grace, the undelivered mark moved
//! with a rewritten grant, and a head waiter passed over (DESIGN.md, "The waiter queue").

use super::*;

impl Coordinator {
    /// Delivers once, then retries transient failures a few times. `Gone` is reported only
    /// when the first attempt says so: after an attempt that may have landed, a `Gone` may mean
    /// the task already has the lease.
    pub(super) async fn deliver_with_retries(
        &self,
        deliver: &Arc<dyn Deliver>,
        token: &str,
        lease: &Lease,
    ) -> std::result::Result<(), DeliveryError> {
        let mut pause = self.config().retry_base;
        let mut last = None;
        for attempt in 0..4 {
            match deliver.success(token, lease).await {
                Ok(()) => return Ok(()),
                Err(DeliveryError::Gone(g)) if attempt == 0 => return Err(DeliveryError::Gone(g)),
                Err(DeliveryError::Gone(g)) => {
                    return Err(DeliveryError::Transient(format!("gone after an earlier attempt: {g}")))
                }
                Err(DeliveryError::Transient(t)) => last = Some(t),
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(self.config().retry_max);
        }
        Err(DeliveryError::Transient(last.unwrap_or_default()))
    }

    /// A grant left undelivered: deliver it again. Whatever the answer, the mark goes (an
    /// answer of `Gone` may follow an earlier delivery that landed, so the lease is not
    /// revoked: it ends with its duration), unless the delivery failed transiently. A `Gone`
    /// whose slot's waiter item carries another token now (a retried invocation's,
    /// [`Self::rewritten`]) moves the mark to that token and delivers there.
    pub(super) async fn redeliver(
        &self,
        key: &str,
        r: &Record,
        token: &str,
        deliver: &Arc<dyn Deliver>,
        served: &mut Served,
    ) -> Result<()> {
        let lease = self.lease_now(r).with_safe_for(self.monotonic());
        let mut token = token.to_string();
        // Bounded: a task is tried a few times, each try with one token.
        for _ in 0..4 {
            match deliver.success(&token, &lease).await {
                Ok(()) => served.delivered += 1,
                Err(DeliveryError::Gone(why)) => {
                    if let Some(newer) = self.rewritten(key, r, &token).await? {
                        if !self.move_mark(key, r.fence, &token, &newer).await? {
                            // Moved by the retried invocation itself: its delivery.
                            return Ok(());
                        }
                        token = newer;
                        continue;
                    }
                    tracing::info!(key, why, "undelivered grant's waiter is gone; the grant ends with its duration");
                }
                Err(DeliveryError::Transient(why)) => {
                    tracing::warn!(key, why, "redelivery failed; the next sweep tries again");
                    served.undelivered += 1;
                    return Ok(());
                }
            }
            break;
        }
        let cond = Condition::Queue(QueueCondition::UndeliveredLive { fence: r.fence, token: token.clone() });
        self.store()
            .update(key, &cond, &Mutation::Queue(QueueMutation::Delivered { now_ms: self.checked_now(key).await? }))
            .await?;
        if let Some(seq) = r.queue.queue_head {
            let _ = self.store().delete(&waiter_key(key, seq), &Condition::Queue(QueueCondition::NotLease)).await;
        }
        Ok(())
    }

    /// The task token the waiter item of grant `r`'s slot carries now, when it is another than
    /// `token`, the one the grant was delivered to: a retried invocation of the waiter's task
    /// (Step Functions gives each try a token of its own, the failed try's is dead) wrote the
    /// item again after it was read for the grant. One read, made only when a delivery to
    /// `token` answered `Gone` or its grant expired undelivered.
    pub(super) async fn rewritten(&self, key: &str, r: &Record, token: &str) -> Result<Option<String>> {
        let Some(seq) = r.queue.queue_head else { return Ok(None) };
        let deadline = self.monotonic() + self.config().retry_budget;
        let wk = waiter_key(key, seq);
        let w = self.read(deadline, || self.store().get(&wk)).await?.and_then(|w| w.queue.waiter);
        Ok(w.filter(|w| w.seq == seq && w.lease_id == r.lease_id && w.task_token != token).map(|w| w.task_token))
    }

    /// Moves the undelivered mark of the grant with `fence` from `old` to `new`; false when it
    /// no longer names `old` (revoked, delivered, or moved by the retried invocation itself).
    pub(super) async fn move_mark(&self, key: &str, fence: u64, old: &str, new: &str) -> Result<bool> {
        let deadline = self.monotonic() + self.config().retry_budget;
        let cond = Condition::Queue(QueueCondition::Undelivered { fence, token: old.to_string() });
        let mark = Mutation::Queue(QueueMutation::MarkUndelivered { token: new.to_string(), shard: queue_shard(key) });
        let (w, _, _) =
            self.write(key, deadline, |_| Ok((cond.clone(), mark.clone()))).await.map_err(|f| f.into_error(key))?;
        Ok(matches!(w, Write::Applied(_)))
    }

    /// Passes over waiter `seq` (the head moves on) if the key is still free with the same head.
    pub(super) async fn skip(&self, key: &str, r: &Record, now: u64, seq: u64) -> Result<bool> {
        let cond = Condition::Queue(QueueCondition::HandOver { fence: r.fence, now_ms: now, head: seq - 1 });
        let m = Mutation::Queue(QueueMutation::Skip { seq, now_ms: self.checked_now(key).await? });
        Ok(matches!(self.store().update(key, &cond, &m).await?, Write::Applied(_)))
    }
}
