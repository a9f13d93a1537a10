//! Holding a lease from a long-running Rust process: background renewal, loss notification,
//! self-fencing and release on drop.

use std::future::Future;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use aws_sdk_dynamodb::operation::transact_write_items::builders::TransactWriteItemsFluentBuilder;
use aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsOutput;

use crate::error::{Error, NotHolderReason, Result};
use crate::fenced::{FenceGuard, FencedError};
use crate::model::{Lease, LeaseId, Released};
use crate::protocol::{AcquireOptions, Coordinator};

/// Why a held lease ended without the holder releasing it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lost {
    /// The coordinator says the lease is no longer ours (expired, released, taken over).
    NotHolder(NotHolderReason),
    /// Renewals kept failing (store unavailable or throttled) until the safe time ran out.
    SafeTimeExpired,
}

impl std::fmt::Display for Lost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Lost::NotHolder(r) => write!(f, "lease lost: {}", r.as_str()),
            Lost::SafeTimeExpired => f.write_str("lease lost: renewals failed until the safe time ran out"),
        }
    }
}

impl std::error::Error for Lost {}

/// State published by the renewal task.
#[derive(Debug, Clone)]
pub enum HoldState {
    Held(Box<Lease>),
    Lost(Lost),
}

/// A lease held by this process and renewed in the background (every third of its duration, or
/// halfway to its safe time when that is sooner).
/// Dropping it releases the lease in the background; [`HeldLease::release`] does so and waits.
/// Both also release after a loss: a renewal sent before the loss may have landed late and
/// extended the lease (the release is conditional on the lease_id, so it cannot free a lease
/// somebody else took over). When renewals fail until the safe time ends, the renewal task
/// itself sends that release at once.
pub struct HeldLease {
    coord: Coordinator,
    key: String,
    lease_id: LeaseId,
    first: Lease,
    state: watch::Receiver<HoldState>,
    /// Safe time of the last lease the holder was given (kept after a loss).
    last_safe: std::sync::Arc<std::sync::Mutex<Option<Instant>>>,
    task: Option<JoinHandle<()>>,
    released: bool,
}

impl std::fmt::Debug for HeldLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldLease").field("key", &self.key).field("fence", &self.first.fence).finish()
    }
}

impl Coordinator {
    /// Acquires `key` and keeps it renewed until the returned handle is released or dropped.
    pub async fn hold(&self, key: &str, holder: &str, duration: Duration, opts: AcquireOptions) -> Result<HeldLease> {
        let lease = self.acquire(key, holder, Some(duration), opts).await?;
        Ok(self.keep(lease))
    }

    /// Keeps a lease already granted (one of a batch, say) renewed until the returned handle
    /// is released or dropped.
    pub fn keep(&self, lease: Lease) -> HeldLease {
        let key = lease.key.clone();
        let (tx, rx) = watch::channel(HoldState::Held(Box::new(lease.clone())));
        let last_safe = std::sync::Arc::new(std::sync::Mutex::new(lease.safe_until));
        let task = tokio::spawn(renew_loop(self.clone(), lease.clone(), tx, last_safe.clone()));
        HeldLease {
            coord: self.clone(),
            key,
            lease_id: lease.lease_id.clone(),
            first: lease,
            state: rx,
            last_safe,
            task: Some(task),
            released: false,
        }
    }
}

async fn renew_loop(
    coord: Coordinator,
    mut lease: Lease,
    tx: watch::Sender<HoldState>,
    last_safe: std::sync::Arc<std::sync::Mutex<Option<Instant>>>,
) {
    let Some(duration_ms) = lease.duration_ms else { return };
    let interval = Duration::from_millis((duration_ms / 3).max(1));
    // After an answer that says when to try again (`ClockSkew`), no sooner than that.
    let mut pause = interval;
    loop {
        let Some(safe_until) = lease.safe_until else { return };
        // Every third of the duration, or halfway to the safe time when that is sooner (a safe
        // margin large against the duration: DESIGN.md, "Clocks"); after a `ClockSkew`, no
        // sooner than it asked.
        let now = coord.monotonic();
        let mut next = (now + pause).min(safe_until);
        if pause == interval {
            next = next.min(now + safe_until.saturating_duration_since(now) / 2);
        }
        pause = interval;
        tokio::time::sleep_until(next.into()).await;
        if tx.is_closed() {
            return;
        }
        // A semaphore's holder names its duration: its renewal then goes straight to its slot.
        let by = lease.slots.map(|_| Duration::from_millis(duration_ms));
        let renewal = coord.heartbeat_until(&lease.key, &lease.lease_id, by, safe_until);
        // `biased`: polled in order, so that a run on a virtual clock replays exactly (tokio's
        // random start draws from an unseeded generator); the renewal first.
        let outcome = tokio::select! {
            biased;
            r = renewal => Some(r),
            _ = tokio::time::sleep_until(safe_until.into()) => None,
        };
        match outcome {
            Some(Ok(l)) => {
                lease = l;
                *last_safe.lock().unwrap_or_else(|p| p.into_inner()) = lease.safe_until;
                let _ = tx.send(HoldState::Held(Box::new(lease.clone())));
            }
            Some(Err(Error::NotHolder { reason, .. })) => {
                tracing::warn!(key = %lease.key, fence = lease.fence, reason = reason.as_str(), "lease lost");
                let _ = tx.send(HoldState::Lost(Lost::NotHolder(reason)));
                return;
            }
            Some(Err(e)) if e.is_transient() || coord.monotonic() >= safe_until => {
                tracing::warn!(key = %lease.key, fence = lease.fence, error = e.name(), "renewals failed until safe time");
                let _ = tx.send(HoldState::Lost(Lost::SafeTimeExpired));
                release_after_loss(&coord, &lease).await;
                return;
            }
            Some(Err(e)) => {
                // Not transient and not a loss: keep trying until the safe time ends, backing
                // off as the answer asks (`ClockSkew` lasts until a clock is fixed).
                tracing::warn!(key = %lease.key, error = e.name(), "renewal failed");
                pause = e.retry_after().map_or(interval, |r| r.max(interval));
            }
            None => {
                tracing::warn!(key = %lease.key, fence = lease.fence, "renewal did not finish before safe time");
                let _ = tx.send(HoldState::Lost(Lost::SafeTimeExpired));
                release_after_loss(&coord, &lease).await;
                return;
            }
        }
    }
}

/// After the safe time ran out without a renewal, a heartbeat still in flight may land and
/// extend the lease, blocking the key for another duration while this holder has already
/// stopped. The release is conditional on the lease_id: it frees what a late heartbeat
/// extended and changes nothing if the lease was taken over (`NotHolder`).
async fn release_after_loss(coord: &Coordinator, lease: &Lease) {
    match coord.release(&lease.key, &lease.lease_id).await {
        Ok(_) => tracing::info!(key = %lease.key, fence = lease.fence, "released after the loss"),
        Err(e) => tracing::debug!(key = %lease.key, error = e.name(), "release after the loss"),
    }
}

impl HeldLease {
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The fencing token: pass it with every write to the guarded resource.
    pub fn fence(&self) -> u64 {
        self.first.fence
    }

    /// The lease as last renewed, or `None` once lost.
    pub fn lease(&self) -> Option<Lease> {
        match &*self.state.borrow() {
            HoldState::Held(l) => Some(l.as_ref().clone()),
            HoldState::Lost(_) => None,
        }
    }

    /// Work must stop before this instant unless a renewal moves it. `None`: fail-closed lease,
    /// or the lease is lost (check [`HeldLease::is_lost`]).
    pub fn safe_until(&self) -> Option<Instant> {
        self.lease().and_then(|l| l.safe_until)
    }

    /// The safe time of the last lease this holder was given, also after the lease was lost:
    /// work done before it was covered by the lease.
    pub fn last_safe_until(&self) -> Option<Instant> {
        *self.last_safe.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn is_lost(&self) -> bool {
        matches!(&*self.state.borrow(), HoldState::Lost(_))
    }

    /// A receiver of every state change (renewed lease, or loss).
    pub fn watch(&self) -> watch::Receiver<HoldState> {
        self.state.clone()
    }

    /// Resolves when the lease is lost, or when its safe time passes without a renewal.
    pub async fn lost(&self) -> Lost {
        let mut rx = self.state.clone();
        loop {
            let safe_until = match &*rx.borrow_and_update() {
                HoldState::Lost(l) => return l.clone(),
                HoldState::Held(l) => l.safe_until,
            };
            let expired = async {
                match safe_until {
                    Some(t) => tokio::time::sleep_until(t.into()).await,
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                biased;
                changed = rx.changed() => {
                    if changed.is_err() {
                        // The renewal task ended without a verdict (fail-closed lease): wait on safe time only.
                        if safe_until.is_none() { return std::future::pending().await; }
                    }
                }
                _ = expired => return Lost::SafeTimeExpired,
            }
        }
    }

    /// Runs `work`, cancelling it (dropping the future) if the lease is lost or its safe time
    /// passes first: self-fencing for holders that cannot pass the fence to their resource.
    pub async fn run<F: Future>(&self, work: F) -> std::result::Result<F::Output, Lost> {
        // The work first: finished at the instant the lease is lost, its output stands (its
        // effects are done).
        tokio::select! {
            biased;
            out = work => Ok(out),
            lost = self.lost() => Err(lost),
        }
    }

    /// A [`FenceGuard`] for this lease's fence: fenced writes to the guarded DynamoDB table
    /// (see [`crate::fenced`]).
    pub fn fence_guard(&self) -> FenceGuard {
        FenceGuard::new(self.fence())
    }

    /// Sends the transaction `tx` only while this lease is live: a `ConditionCheck` on the
    /// lease item in `lease_table` (this lease_id, not released, not expired at the
    /// coordinator's clock plus the skew margin) is appended to the caller's items. Refused:
    /// [`FencedError::LeaseLost`], or the caller's own item (`ConditionFailed { index }`, or
    /// `Fenced { index }` for items fenced with [`HeldLease::fence_guard`]).
    pub async fn commit_while_live(
        &self,
        lease_table: &str,
        tx: TransactWriteItemsFluentBuilder,
    ) -> std::result::Result<TransactWriteItemsOutput, FencedError> {
        self.coord.commit_while_live(lease_table, &self.key, &self.lease_id, self.fence(), tx).await
    }

    /// Stops renewing and releases the lease.
    pub async fn release(self) -> Result<Released> {
        self.release_to(None).await
    }

    /// [`HeldLease::release`], moving the key into work state `state` (`None`: keeps it).
    pub async fn release_to(mut self, state: Option<&str>) -> Result<Released> {
        if let Some(t) = self.task.take() {
            t.abort();
        }
        self.released = true;
        self.coord.release_to(&self.key, &self.lease_id, state).await
    }
}

impl Drop for HeldLease {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
        if self.released {
            return;
        }
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let (coord, key, id) = (self.coord.clone(), self.key.clone(), self.lease_id.clone());
            handle.spawn(async move {
                if let Err(e) = coord.release(&key, &id).await {
                    tracing::warn!(key = %key, error = e.name(), "background release failed");
                }
            });
        }
    }
}
