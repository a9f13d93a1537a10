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

    /// Delivers once, then retries transient failures a few times. `Gone` is reported only
    /// when the first attempt says so: after an attempt that may have landed, a `Gone` may mean
    /// the task already has the lease.
    async fn deliver_with_retries(
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
    async fn redeliver(
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
    async fn rewritten(&self, key: &str, r: &Record, token: &str) -> Result<Option<String>> {
        let Some(seq) = r.queue.queue_head else { return Ok(None) };
        let deadline = self.monotonic() + self.config().retry_budget;
        let wk = waiter_key(key, seq);
        let w = self.read(deadline, || self.store().get(&wk)).await?.and_then(|w| w.queue.waiter);
        Ok(w.filter(|w| w.seq == seq && w.lease_id == r.lease_id && w.task_token != token).map(|w| w.task_token))
    }

    /// Moves the undelivered mark of the grant with `fence` from `old` to `new`; false when it
    /// no longer names `old` (revoked, delivered, or moved by the retried invocation itself).
    async fn move_mark(&self, key: &str, fence: u64, old: &str, new: &str) -> Result<bool> {
        let deadline = self.monotonic() + self.config().retry_budget;
        let cond = Condition::Queue(QueueCondition::Undelivered { fence, token: old.to_string() });
        let mark = Mutation::Queue(QueueMutation::MarkUndelivered { token: new.to_string(), shard: queue_shard(key) });
        let (w, _, _) =
            self.write(key, deadline, |_| Ok((cond.clone(), mark.clone()))).await.map_err(|f| f.into_error(key))?;
        Ok(matches!(w, Write::Applied(_)))
    }

    /// Passes over waiter `seq` (the head moves on) if the key is still free with the same head.
    async fn skip(&self, key: &str, r: &Record, now: u64, seq: u64) -> Result<bool> {
        let cond = Condition::Queue(QueueCondition::HandOver { fence: r.fence, now_ms: now, head: seq - 1 });
        let m = Mutation::Queue(QueueMutation::Skip { seq, now_ms: self.checked_now(key).await? });
        Ok(matches!(self.store().update(key, &cond, &m).await?, Write::Applied(_)))
    }

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
