//! The waiter queue: acquires that wait without polling, in FIFO order, served by hand-over
//! when the key is freed (DESIGN.md, "The waiter queue").
//!
//! A queued acquire carries a Step Functions task token. It joins the key's queue (a counter
//! on the lease item and one waiter item per waiter) and returns; nothing runs while it waits.
//! Whoever frees the key (a release, a force-release, or the scheduled sweep for an expired
//! lease) grants it to the head waiter in one conditional write and delivers the lease through
//! [`Deliver`] (Step Functions `SendTaskSuccess` in the Lambda functions).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;

use crate::error::{Error, NotHolderReason as Reason, Result};
use crate::model::{Lease, LeaseId, Record, Released};
use crate::protocol::{AcquireOptions, Coordinator, ReleaseHook};
use crate::store::{Condition, Mutation, NewLease, QueueCondition, QueueMutation, ScanKind, Write};

mod delivery;
mod enqueue;
mod serve;
mod sweep;

/// The waiter key layout and the queue index partitions are the store's (`store/mod.rs`).
pub use crate::store::{queue_shard, split_waiter_key, waiter_key, QUEUE_SHARDS, QUEUE_SHARD_BASE, SEPARATOR};

/// A slot whose waiter item is still missing this long after the slot was taken belongs to an
/// enqueuer that died between its two writes (or whose put failed): the slot is skipped. A
/// slot's time is bounded by the enqueue time of the next waiter item after it (taken later),
/// or by `queue_tail_at_ms` when none follows.
pub const ENQUEUE_GRACE_MS: u64 = 10_000;

/// How long after its first try a queued acquire may be tried again with the same lease_id (a
/// retried invocation: QueuedSingleFlight retries its task 3 times, backoff 1-4 s, within the
/// acquire function's 60 s timeout each): a queued acquire with the caller's lease_id looks
/// this far back in the queue for a waiter item of its own before it takes a slot.
pub const RETRY_WINDOW_MS: u64 = 300_000;

/// The most waiter items that look reads (the newest slots within [`RETRY_WINDOW_MS`]): an
/// enqueue costs at most this many reads more, however long the queue. A retry with more
/// waiters enqueued after its first try takes a second slot, as before the look (DESIGN.md,
/// "The waiter queue": the first slot's grant goes to the dead token and is revoked).
pub const RETRY_SCAN_SLOTS: u64 = 16;

/// How long a waiter without a timeout of its own may wait (its item's TTL covers this).
pub const LONGEST_WAIT_MS: u64 = 366 * 24 * 3600 * 1000;

/// A release that leaves waiters behind a min_hold ending within this long waits for it and
/// serves the queue itself; a later end is served by the sweep.
pub const MIN_HOLD_WAIT_MS: u64 = 5_000;

/// Where consecutive queue sweeps of this process start (as the keep-alive sweep's).
static NEXT_START: AtomicU32 = AtomicU32::new(u32::MAX);

/// Starts the rotation of this process's queue sweeps afresh (a simulation replaying a seed).
#[cfg(feature = "testing")]
pub(crate) fn reset_rotation() {
    NEXT_START.store(u32::MAX, Ordering::Relaxed);
}

/// Keys read per page of the queue index.
const SWEEP_PAGE: u32 = 50;

/// A grant still marked undelivered this long after it was written is delivered again by
/// whoever serves the queue (the granting function died, or every delivery attempt failed).
pub const DELIVERY_GRACE_MS: u64 = 5_000;

pub use crate::model::Waiter;

/// What a queued acquire sent again with its lease_id finds of its earlier try.
enum Own {
    /// Its waiter item.
    Slot(Waiter),
    /// Its slot's grant, live, still marked undelivered (the item as read).
    Granted(Record),
    /// Its slot's grant, live, no longer marked (the item as read).
    Free(Record),
    /// Its slot's grant, ended.
    Ended(Reason),
}

/// The waiter queue as the core's release hook: a release of a key with queued waiters grants
/// the head waiter, and a key left free is handed over to it.
struct Queue {
    deliver: Arc<dyn Deliver>,
}

#[async_trait]
impl ReleaseHook for Queue {
    async fn release_queued(
        &self,
        c: &Coordinator,
        key: &str,
        lease_id: &LeaseId,
        r: &Record,
    ) -> Result<Option<Released>> {
        c.release_handing_over(key, lease_id, r).await
    }

    async fn freed(&self, c: &Coordinator, key: &str, r: &Record) {
        c.hand_over_after_free(key, r).await;
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Why a delivery failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeliveryError {
    /// The task no longer exists or no longer waits (`TaskDoesNotExist`, `TaskTimedOut`,
    /// `InvalidToken`): it will never take the lease.
    Gone(String),
    /// Anything else (throttled, unreachable, timed out): the delivery may be tried again.
    Transient(String),
}

/// Delivers a queued acquire's outcome to its waiter (Step Functions: `SendTaskSuccess` /
/// `SendTaskFailure`). The protocol does not depend on how.
#[async_trait]
pub trait Deliver: Send + Sync + 'static {
    async fn success(&self, token: &str, lease: &Lease) -> std::result::Result<(), DeliveryError>;
    async fn failure(&self, token: &str, error: &str, cause: &str) -> std::result::Result<(), DeliveryError>;
}

/// The outcome of a queued acquire.
#[derive(Debug, Clone, PartialEq)]
// One answer per call, never stored in bulk: boxing the lease would only add an allocation.
#[allow(clippy::large_enum_variant)]
pub enum Enqueued {
    /// The key was free: the lease was granted and delivered, or, when every delivery attempt
    /// failed for a transient reason (it may have landed), kept and marked undelivered for the
    /// sweep to deliver again.
    Granted(Lease),
    /// The waiter joined the queue: `position` 1 is next.
    Queued { seq: u64, position: u64, lease_id: LeaseId },
}

/// What one pass over a key's queue did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Served {
    /// Grants written and delivered.
    pub delivered: u32,
    /// Grants written whose delivery failed for a transient reason (left for the sweep).
    pub undelivered: u32,
    /// Waiters passed over: gone, timed out, or never written.
    pub skipped: u32,
}

/// What one run of the queue sweep did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueSweep {
    pub keys: u32,
    pub served: Served,
    pub errors: u32,
    /// Keys that left the queue index (no waiter, no undelivered grant).
    pub unindexed: u32,
    /// False when the deadline came before every shard was read.
    pub complete: bool,
}

impl Coordinator {
    /// This coordinator, delivering hand-over grants through `deliver`.
    pub fn with_deliver(mut self, deliver: Arc<dyn Deliver>) -> Self {
        self.release_hook = Some(Arc::new(Queue { deliver }));
        self
    }

    /// After a write that freed `key` (`r` as written): when waiters are queued, the key is
    /// theirs (no plain acquire takes a key with waiters), so serve the head one now.
    pub(crate) async fn hand_over_after_free(&self, key: &str, r: &Record) {
        if r.queue_len() == 0 || self.deliver().is_none() {
            return;
        }
        // A min_hold still running: nothing else serves the queue when it ends (but the sweep),
        // so a short one is waited for here.
        if let Some(free_at) = r.expires_at_ms.filter(|_| r.released_at_ms.is_some()) {
            let left = free_at.saturating_sub(self.now_ms());
            if left > 0 && left <= MIN_HOLD_WAIT_MS {
                tokio::time::sleep(Duration::from_millis(left + 1)).await;
            }
        }
        if let Err(e) = self.serve_queue(key).await {
            tracing::warn!(key, error = e.name(), "hand-over after release failed; the sweep serves the queue");
        }
    }

    /// The delivery of the queue this coordinator serves (set by [`Coordinator::with_deliver`]).
    fn deliver(&self) -> Option<Arc<dyn Deliver>> {
        let queue = self.release_hook.as_ref()?.as_any().downcast_ref::<Queue>()?;
        Some(queue.deliver.clone())
    }

    fn deliverer(&self) -> Result<Arc<dyn Deliver>> {
        self.deliver().ok_or_else(|| Error::invalid("a queued acquire needs Step Functions delivery"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiter_keys_round_trip_and_never_validate() {
        let k = waiter_key("orders/42", 17);
        assert_eq!(split_waiter_key(&k), Some(("orders/42", 17)));
        assert!(crate::validate::Limits::default().key(&k).is_err());
        assert!(queue_shard(&k) >= QUEUE_SHARD_BASE && queue_shard(&k) < QUEUE_SHARD_BASE + QUEUE_SHARDS);
        assert_eq!(queue_shard(&k), queue_shard(&waiter_key("orders/42", 99)));
    }
}
