//! Keep-alive on the holder's behalf: the scheduled heartbeat renews leases that asked for it
//! (until their deadline, and only while their Step Functions execution runs) and releases
//! those whose execution has ended.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use serde::Serialize;

use crate::protocol::Coordinator;
use crate::store::{Condition, Mutation, ScanKind, Write, KEEPALIVE_SHARDS};
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
    /// Changed under the sweep (released or taken over in between): left alone.
    pub raced: u32,
    pub errors: u32,
    /// False when the item or time budget ran out before every shard was read.
    pub complete: bool,
}

/// Leases handled concurrently within a page.
const CONCURRENCY: usize = 16;
const PAGE: u32 = 50;

enum Outcome {
    Renewed,
    Released,
    Skipped,
    Raced,
    Error,
}

impl Coordinator {
    /// One keep-alive pass over the sparse index, reading at most `max_items` leases and
    /// stopping at `deadline`. Safe to run concurrently with itself: every write is
    /// conditional on the lease_id read from the index.
    pub async fn keepalive_sweep(
        &self,
        executions: Option<Arc<dyn Executions>>,
        max_items: u32,
        deadline: Instant,
    ) -> SweepReport {
        let mut report = SweepReport { complete: true, ..Default::default() };
        for shard in 0..KEEPALIVE_SHARDS {
            let mut start: Option<String> = None;
            loop {
                if Instant::now() >= deadline || report.scanned >= max_items {
                    report.complete = false;
                    return report;
                }
                let limit = PAGE.min(max_items - report.scanned);
                let page = match self
                    .store()
                    .scan(&ScanKind::Keepalive { shard, after_ms: self.now_ms() }, start.as_deref(), limit)
                    .await
                {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::warn!(shard, error = e.name(), "keep-alive scan failed");
                        report.errors += 1;
                        report.complete = false;
                        break;
                    }
                };
                report.scanned += page.items.len() as u32;
                for chunk in page.items.chunks(CONCURRENCY) {
                    let mut set = tokio::task::JoinSet::new();
                    for rec in chunk.iter().cloned() {
                        let (c, ex) = (self.clone(), executions.clone());
                        set.spawn(async move { c.keep_one(rec, ex).await });
                    }
                    while let Some(r) = set.join_next().await {
                        match r.unwrap_or(Outcome::Error) {
                            Outcome::Renewed => report.renewed += 1,
                            Outcome::Released => report.released += 1,
                            Outcome::Skipped => report.skipped += 1,
                            Outcome::Raced => report.raced += 1,
                            Outcome::Error => report.errors += 1,
                        }
                    }
                }
                match page.next {
                    Some(n) => start = Some(n),
                    None => break,
                }
            }
        }
        report
    }

    async fn keep_one(&self, rec: Record, executions: Option<Arc<dyn Executions>>) -> Outcome {
        let now = self.now_ms();
        let Some(ka) = rec.keepalive.clone() else { return Outcome::Skipped };
        if !rec.is_live_for(&rec.lease_id, now) || ka.until_ms <= now || rec.duration_ms.is_none() {
            return Outcome::Skipped;
        }
        let state = match (&ka.execution_arn, &executions) {
            (Some(arn), Some(ex)) => ex.state(arn).await,
            (Some(_), None) => ExecutionState::Unknown,
            (None, _) => ExecutionState::Running,
        };
        let now = self.now_ms();
        let (cond, m, ok) = if state == ExecutionState::Ended {
            let ttl = self.ttl_after(now + self.max_duration_ms());
            (
                Condition::Unreleased { lease_id: rec.lease_id.clone() },
                Mutation::Release { now_ms: now, ttl },
                Outcome::Released,
            )
        } else {
            let ttl = self.ttl_after(now + rec.duration_ms.unwrap_or(0));
            (
                Condition::Renew { lease_id: rec.lease_id.clone(), now_ms: now, expires_at_ms: None },
                Mutation::Extend { now_ms: now, duration_ms: None, ttl: Some(ttl) },
                Outcome::Renewed,
            )
        };
        match self.store().update(&rec.key, &cond, &m).await {
            Ok(Write::Applied(r)) => {
                tracing::info!(key = %r.key, holder = %r.holder, fence = r.fence, outcome = if matches!(ok, Outcome::Released) { "released" } else { "renewed" }, "keep-alive");
                ok
            }
            Ok(Write::Rejected(_)) => Outcome::Raced,
            Err(e) => {
                tracing::warn!(key = %rec.key, error = e.name(), "keep-alive write failed");
                Outcome::Error
            }
        }
    }
}
