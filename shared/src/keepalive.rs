//! Keep-alive on the holder's behalf: the scheduled heartbeat renews leases that asked for it
//! (until their deadline, and only while their Step Functions execution runs) and releases
//! those whose execution has ended.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use serde::Serialize;

use crate::model::SlotHolder;
use crate::protocol::Coordinator;
use crate::store::{
    Condition, KeepaliveCondition, KeepaliveMutation, LeaseCondition, LeaseMutation, Mutation, ScanKind,
    SemaphoreCondition, Write, KEEPALIVE_SHARDS,
};
use crate::Record;

/// What the execution a keep-alive lease is bound to is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecutionState {
    /// RUNNING (or about to be redriven): keep renewing.
    Running,
    /// SUCCEEDED, FAILED, TIMED_OUT, ABORTED, or no such execution: release now.
    Ended,
    /// Could not tell (throttled, no permission): renew, erring on the side of the holder.
    Unknown,
}

/// Answers "is this execution still running?" (Step Functions DescribeExecution in Lambda).
#[async_trait]
pub trait Executions: Send + Sync {
    async fn state(&self, execution_arn: &str) -> ExecutionState;
}

/// What one sweep did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SweepReport {
    pub scanned: u32,
    pub renewed: u32,
    pub released: u32,
    /// Found in the index but expired, released or past its keep-alive deadline.
    pub skipped: u32,
    /// Of the skipped, how many had their keep-alive attributes removed (they leave the index).
    pub cleared: u32,
    /// Changed under the sweep (released or taken over in between): left alone.
    pub raced: u32,
    pub errors: u32,
    /// Leases renewed without knowing whether their execution still runs: DescribeExecution
    /// failed (throttled past its retries, AccessDenied for a state machine the role may not
    /// describe, ...). Renewing errs on the side of the holder, but a lease whose execution has
    /// ended stays held until this is fixed: counted, published and alarmed on
    /// (`SweepDescribeFailures`, the SweepFailing alarm).
    pub describe_failures: u32,
    /// False when the lease budget or the time ran out before every shard was read.
    pub complete: bool,
}

/// Leases handled concurrently within a page.
const CONCURRENCY: usize = 16;
const PAGE: u32 = 50;

/// Where consecutive sweeps of this process start (each run starts one shard further on, from
/// a point set by the clock, so that fresh processes do not all start at shard 0).
static NEXT_START: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(u32::MAX);

/// Starts the rotation of this process's sweeps afresh (a simulation replaying a seed).
#[cfg(feature = "testing")]
pub(crate) fn reset_rotation() {
    NEXT_START.store(u32::MAX, std::sync::atomic::Ordering::Relaxed);
}

enum Outcome {
    Renewed,
    Released,
    Skipped { cleared: bool },
    Raced,
    Error,
}

impl SweepReport {
    /// Counts one lease's outcome; whether it counts against the run's budget (a live lease).
    fn count(&mut self, outcome: Outcome) -> bool {
        match outcome {
            Outcome::Renewed => self.renewed += 1,
            Outcome::Released => self.released += 1,
            Outcome::Skipped { cleared } => {
                self.skipped += 1;
                self.cleared += cleared as u32;
                return false;
            }
            Outcome::Raced => self.raced += 1,
            Outcome::Error => self.errors += 1,
        }
        true
    }
}

impl Coordinator {
    /// One keep-alive pass over the sparse index, handling at most `max_items` live leases
    /// and stopping before `deadline`. Safe to run concurrently with itself: every write is
    /// conditional on what was read from the index.
    ///
    /// Shards are read interleaved, one page of each in turn, starting at a shard that rotates
    /// from run to run, so a run cut short by its budget shares it among the shards. Entries
    /// that are no longer live (expired, or past their keep-alive deadline) do not count
    /// against `max_items` and leave the index (a conditional `ClearKeepalive`), so they cost
    /// one read and one write once, not every run. A page is not started unless the longest
    /// page so far still fits before `deadline`, and every request is cut at `deadline`.
    pub async fn keepalive_sweep(
        &self,
        executions: Option<Arc<dyn Executions>>,
        max_items: u32,
        deadline: Instant,
    ) -> SweepReport {
        let mut report = SweepReport { complete: true, ..Default::default() };
        // Renewals write expiries: not with a clock the store's disagrees with.
        if let Err(e) = self.check_clock("leasehold/keepalive-sweep").await {
            tracing::error!(error = e.name(), message = %e, "keep-alive sweep refused");
            report.errors += 1;
            report.complete = false;
            return report;
        }
        let shards = KEEPALIVE_SHARDS;
        let first = self.first_shard();
        // Per shard: where to continue, or None once the shard is done.
        let mut cursors: Vec<(u32, Option<Option<String>>)> =
            (0..shards).map(|i| ((first + i) % shards, Some(None))).collect();
        let mut handled: u32 = 0;
        let mut longest_page = std::time::Duration::ZERO;
        while cursors.iter().any(|(_, c)| c.is_some()) {
            for (shard, cursor) in cursors.iter_mut() {
                let Some(start) = cursor.clone() else { continue };
                let began = self.monotonic();
                if handled >= max_items || began + longest_page >= deadline {
                    report.complete = false;
                    return report;
                }
                let limit = PAGE.min(max_items - handled);
                let kind = ScanKind::Keepalive { shard: *shard, after_ms: self.now_ms() };
                let page =
                    match tokio::time::timeout_at(deadline.into(), self.store().scan(&kind, start.as_deref(), limit))
                        .await
                    {
                        Ok(Ok(p)) => p,
                        Ok(Err(e)) => {
                            tracing::warn!(shard = *shard, error = e.name(), "keep-alive scan failed");
                            report.errors += 1;
                            report.complete = false;
                            *cursor = None;
                            continue;
                        }
                        Err(_) => {
                            report.complete = false;
                            return report;
                        }
                    };
                report.scanned += page.items.len() as u32;
                handled += self.keep_page(page.items, &executions, deadline, &mut report).await;
                longest_page = longest_page.max(self.monotonic().saturating_duration_since(began));
                *cursor = page.next.map(Some);
            }
        }
        report
    }

    /// The shard this run starts at: one further than the last run's (the first run of a
    /// process starts at a shard set by the clock, so that fresh processes spread).
    fn first_shard(&self) -> u32 {
        let _ = NEXT_START.compare_exchange(
            u32::MAX,
            (self.now_ms() / 1000) as u32 % KEEPALIVE_SHARDS,
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
        );
        NEXT_START.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % KEEPALIVE_SHARDS
    }

    /// One page of the index, `CONCURRENCY` leases at a time, each cut at `deadline`; the
    /// outcomes counted in `report`. Returns how many live leases it handled (skipped entries do
    /// not count against the run's budget).
    async fn keep_page(
        &self,
        items: Vec<Record>,
        executions: &Option<Arc<dyn Executions>>,
        deadline: Instant,
        report: &mut SweepReport,
    ) -> u32 {
        let mut handled = 0;
        for chunk in items.chunks(CONCURRENCY) {
            let mut set = tokio::task::JoinSet::new();
            for rec in chunk.iter().cloned() {
                let (c, ex) = (self.clone(), executions.clone());
                set.spawn(async move {
                    let kept = async {
                        match rec.semaphore.slots.is_some() {
                            true => c.keep_slots(rec, ex, deadline).await,
                            false => vec![c.keep_one(rec, ex).await],
                        }
                    };
                    tokio::time::timeout_at(deadline.into(), kept)
                        .await
                        .unwrap_or_else(|_| vec![(Outcome::Error, false)])
                });
            }
            while let Some(r) = set.join_next().await {
                for (outcome, undescribed) in r.unwrap_or_else(|_| vec![(Outcome::Error, false)]) {
                    report.describe_failures += u32::from(undescribed);
                    handled += u32::from(report.count(outcome));
                }
            }
        }
        handled
    }

    /// One lease: its outcome, and whether its execution could not be described.
    async fn keep_one(&self, rec: Record, executions: Option<Arc<dyn Executions>>) -> (Outcome, bool) {
        let now = self.now_ms();
        let Some(ka) = rec.keepalive.clone() else { return (Outcome::Skipped { cleared: false }, false) };
        if !rec.is_live_for(&rec.lease_id, now) || ka.until_ms <= now || rec.duration_ms.is_none() {
            return (Outcome::Skipped { cleared: self.clear_keepalive(&rec).await }, false);
        }
        let state = execution_state(ka.execution_arn.as_deref(), &executions).await;
        let undescribed = state == ExecutionState::Unknown;
        (self.keep_or_release(rec, state).await, undescribed)
    }

    /// A semaphore in the index: each slot kept alive renewed while its execution runs, and
    /// released once it has ended, one outcome each, `CONCURRENCY` slots at a time (each write
    /// is conditioned on its own entry alone, so they do not refuse each other); none left to
    /// keep, the item leaves the index (one outcome, skipped).
    async fn keep_slots(
        &self,
        rec: Record,
        executions: Option<Arc<dyn Executions>>,
        deadline: Instant,
    ) -> Vec<(Outcome, bool)> {
        let now = self.now_ms();
        let kept: Vec<SlotHolder> = rec.semaphore.slot_holders.iter().filter(|h| h.kept_alive(now)).cloned().collect();
        if kept.is_empty() {
            return vec![(Outcome::Skipped { cleared: self.clear_slots_keepalive(&rec).await }, false)];
        }
        let mut outcomes = Vec::with_capacity(kept.len());
        for chunk in kept.chunks(CONCURRENCY) {
            let mut set = tokio::task::JoinSet::new();
            for h in chunk.iter().cloned() {
                let (c, ex, key) = (self.clone(), executions.clone(), rec.key.clone());
                set.spawn(async move { c.keep_slot(&key, h, ex, deadline).await });
            }
            while let Some(r) = set.join_next().await {
                outcomes.push(r.unwrap_or((Outcome::Error, false)));
            }
        }
        outcomes
    }

    /// One slot kept alive: its outcome, and whether its execution could not be described.
    async fn keep_slot(
        &self,
        key: &str,
        h: SlotHolder,
        executions: Option<Arc<dyn Executions>>,
        deadline: Instant,
    ) -> (Outcome, bool) {
        let arn = h.keepalive.as_ref().and_then(|k| k.execution_arn.as_deref());
        let state = execution_state(arn, &executions).await;
        let outcome = match state {
            // The holder's own release, on its behalf: refused once it was released or
            // evicted meanwhile.
            ExecutionState::Ended => match self.free_slot(key, &h.lease_id).await {
                Ok(Ok(r)) if !r.already_released => Outcome::Released,
                Ok(_) => Outcome::Raced,
                Err(_) => Outcome::Error,
            },
            // Its heartbeat, by its own duration: refused once it ended meanwhile.
            _ => match self.renew_slot(key, &h.lease_id, h.duration_ms, deadline).await {
                Ok(Ok(_)) => Outcome::Renewed,
                Ok(Err(_)) => Outcome::Raced,
                Err(_) => Outcome::Error,
            },
        };
        let said = match outcome {
            Outcome::Released => Some("released"),
            Outcome::Renewed => Some("renewed"),
            Outcome::Error => Some("failed"),
            _ => None,
        };
        if let Some(said) = said {
            tracing::info!(key = %key, holder = %h.holder, fence = h.fence, outcome = said, "keep-alive of a slot");
        }
        (outcome, state == ExecutionState::Unknown)
    }

    async fn keep_or_release(&self, rec: Record, state: ExecutionState) -> Outcome {
        // Checked after the execution's description was awaited, right before the write.
        let Ok(mut now) = self.checked_now(&rec.key).await else { return Outcome::Error };
        let mut adopted = false;
        loop {
            let (cond, m, ok) = self.keep_write(&rec, state, now);
            return match self.store().update(&rec.key, &cond, &m).await {
                Ok(Write::Applied(r)) => {
                    tracing::info!(key = %r.key, holder = %r.holder, fence = r.fence, outcome = if matches!(ok, Outcome::Released) { "released" } else { "renewed" }, "keep-alive");
                    // A key in a work state keeps no TTL (DESIGN.md, "Work items and batch leases").
                    self.keep_queued(&r.key, &r).await;
                    ok
                }
                // A renewal refused for its order alone, the last one stamped by a clock ahead
                // of this one: once more at that stamp ([`Coordinator::after_renewal`]).
                Ok(Write::Rejected(Some(r))) if !adopted && matches!(ok, Outcome::Renewed) => {
                    match self.after_renewal(&r, &rec.lease_id, now) {
                        Some(t) => {
                            (now, adopted) = (t, true);
                            continue;
                        }
                        None => Outcome::Raced,
                    }
                }
                Ok(Write::Rejected(_)) => Outcome::Raced,
                Err(e) => {
                    tracing::warn!(key = %rec.key, error = e.name(), "keep-alive write failed");
                    Outcome::Error
                }
            };
        }
    }

    /// The keep-alive's write of `rec` at `now`: its release when its execution ended, its
    /// renewal otherwise, and the outcome it counts as once applied.
    fn keep_write(&self, rec: &Record, state: ExecutionState, now: u64) -> (Condition, Mutation, Outcome) {
        if state == ExecutionState::Ended {
            let ttl = self.ttl_after(now + self.max_duration_ms());
            return (
                Condition::Lease(LeaseCondition::Unreleased { lease_id: rec.lease_id.clone() }),
                Mutation::Lease(LeaseMutation::Release { now_ms: now, ttl }),
                Outcome::Released,
            );
        }
        // A key in a work state keeps no TTL (and the condition checks the index's copy).
        let stateless = rec.work.state.is_none();
        let ttl = stateless.then(|| self.ttl_after(now + rec.duration_ms.unwrap_or(0)));
        (
            Condition::Lease(LeaseCondition::Renew {
                lease_id: rec.lease_id.clone(),
                now_ms: now,
                expires_at_ms: None,
                ttl: stateless,
            }),
            Mutation::Lease(LeaseMutation::Extend { now_ms: now, duration_ms: None, ttl }),
            Outcome::Renewed,
        )
    }

    /// Takes a lease that can no longer be kept alive (expired, released, past its keep-alive
    /// deadline, or without a duration) out of the index. It was judged from the index, which
    /// is eventually consistent: the condition is the grant's fence and the expiry read. A newer
    /// grant on the key has a higher fence, and a renewal the index has not seen yet moved the
    /// expiry, so a lease that is still live keeps its keep-alive.
    async fn clear_keepalive(&self, rec: &Record) -> bool {
        let cond = Condition::Keepalive(KeepaliveCondition::FenceAndExpiry {
            fence: rec.fence,
            expires_at_ms: rec.expires_at_ms,
        });
        matches!(self.clear_index_entry(rec, cond).await, Ok(Write::Applied(_)))
    }

    /// Takes a semaphore none of whose slots is kept alive any more out of the index. It was
    /// judged from the index's copy: the condition is the revision read, which every write to
    /// the semaphore bumps, so a slot taken with keep-alive since keeps the item in the index.
    ///
    /// A semaphore written more often than the index catches up would have every clear refused
    /// (the copy's revision is always behind): refused, the clear is sent once more at the
    /// revision of the item that refused it, if none of its slots is kept alive either.
    async fn clear_slots_keepalive(&self, rec: &Record) -> bool {
        let clear = |r: &Record| {
            let rev = r.semaphore.slots_rev.unwrap_or(0);
            Condition::Semaphore(SemaphoreCondition::SlotsAsRead { rev })
        };
        match self.clear_index_entry(rec, clear(rec)).await {
            Ok(Write::Applied(_)) => true,
            Ok(Write::Rejected(Some(cur)))
                if cur.semaphore.slots.is_some()
                    && cur.keepalive.is_some()
                    && !cur.semaphore.slot_holders.iter().any(|h| h.kept_alive(self.now_ms())) =>
            {
                matches!(self.clear_index_entry(&cur, clear(&cur)).await, Ok(Write::Applied(_)))
            }
            _ => false,
        }
    }

    async fn clear_index_entry(&self, rec: &Record, cond: Condition) -> crate::Result<Write> {
        let r = self.store().update(&rec.key, &cond, &Mutation::Keepalive(KeepaliveMutation::ClearKeepalive)).await;
        if let Err(e) = &r {
            tracing::warn!(key = %rec.key, error = e.name(), "keep-alive clear failed");
        }
        r
    }
}

/// The state of a kept-alive lease's execution: described when it names one and the sweep has
/// a source (`Unknown` without one), `Running` when it names none (kept alive until
/// `until_ms` alone).
async fn execution_state(arn: Option<&str>, executions: &Option<Arc<dyn Executions>>) -> ExecutionState {
    match (arn, executions) {
        (Some(arn), Some(ex)) => ex.state(arn).await,
        (Some(_), None) => ExecutionState::Unknown,
        (None, _) => ExecutionState::Running,
    }
}
