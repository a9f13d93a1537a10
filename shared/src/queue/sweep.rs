//! The queue sweep (scheduled with the heartbeat function) and a waiter's place in line
//! (DESIGN.md, "The waiter queue").

use super::*;

impl Coordinator {
    /// The scheduled sweep of every queue: reads the queue index (one entry per key with
    /// waiters or an undelivered grant) and serves each key as its page arrives (an expired
    /// holder is replaced, an undelivered grant delivered, a missing slot skipped after its
    /// grace); a key left with neither leaves the index. Shards are read one page of each in
    /// turn from a start that rotates from run to run (as the keep-alive sweep's), so a run cut
    /// short by `deadline` shares it among the shards. Stops starting keys at `deadline`.
    pub async fn sweep_queues(&self, deadline: Instant) -> Result<QueueSweep> {
        let mut report = QueueSweep { complete: true, ..Default::default() };
        self.check_clock("leasehold/queue-sweep").await?;
        let _ = NEXT_START.compare_exchange(
            u32::MAX,
            (self.now_ms() / 1000) as u32 % QUEUE_SHARDS,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
        let first = NEXT_START.fetch_add(1, Ordering::Relaxed) % QUEUE_SHARDS;
        // Per shard: where to continue, or None once the shard is done.
        let mut cursors: Vec<(u32, Option<Option<String>>)> =
            (0..QUEUE_SHARDS).map(|i| ((first + i) % QUEUE_SHARDS, Some(None))).collect();
        while cursors.iter().any(|(_, c)| c.is_some()) {
            for (shard, cursor) in cursors.iter_mut() {
                let Some(start) = cursor.clone() else { continue };
                if self.monotonic() >= deadline {
                    report.complete = false;
                    return Ok(report);
                }
                let kind = ScanKind::Queue { shard: QUEUE_SHARD_BASE + *shard };
                let page = match self.store().scan(&kind, start.as_deref(), SWEEP_PAGE).await {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::warn!(shard = *shard, error = e.name(), "queue sweep: index read failed");
                        report.errors += 1;
                        report.complete = false;
                        *cursor = None;
                        continue;
                    }
                };
                for item in &page.items {
                    if self.monotonic() >= deadline {
                        report.complete = false;
                        return Ok(report);
                    }
                    self.sweep_key(&item.key, &mut report).await;
                }
                *cursor = page.next.map(Some);
            }
        }
        Ok(report)
    }

    /// One key of the queue sweep: serve it, then take it out of the index if it is idle.
    async fn sweep_key(&self, key: &str, report: &mut QueueSweep) {
        report.keys += 1;
        match self.serve_queue(key).await {
            Ok(s) => {
                report.served.delivered += s.delivered;
                report.served.undelivered += s.undelivered;
                report.served.skipped += s.skipped;
            }
            Err(e) => {
                tracing::warn!(key, error = e.name(), "queue sweep: serving failed");
                report.errors += 1;
                return;
            }
        }
        match self.store().get(key).await {
            Ok(Some(r)) if r.queue_len() == 0 && r.queue.pending_token.is_none() => {
                if let Ok(Write::Applied(_)) = self
                    .store()
                    .update(key, &Condition::Queue(QueueCondition::QueueIdle), &Mutation::Queue(QueueMutation::Unindex))
                    .await
                {
                    report.unindexed += 1;
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(key, error = e.name(), "queue sweep: read failed");
                report.errors += 1;
            }
        }
    }

    /// The position of the waiter `lease_id` in `key`'s queue (1: next), `None` when it is not
    /// queued. Reads the waiter items in order (at most `limit` of them).
    pub async fn queue_position(&self, key: &str, lease_id: &LeaseId, limit: u64) -> Result<Option<u64>> {
        self.config().limits.key(key)?;
        let Some(r) = self.store().get(key).await? else { return Ok(None) };
        let (Some(head), Some(tail)) = (r.queue.queue_head, r.queue.queue_tail) else { return Ok(None) };
        for seq in head + 1..=tail.min(head + limit) {
            if let Some(w) = self.store().get(&waiter_key(key, seq)).await?.and_then(|w| w.queue.waiter) {
                if &w.lease_id == lease_id {
                    return Ok(Some(seq - head));
                }
            }
        }
        Ok(None)
    }
}
