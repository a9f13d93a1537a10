//! The waiter queue: acquires that wait without polling, in FIFO order, served by hand-over
//! when the key is freed (DESIGN.md, "The waiter queue").
//!
//! A queued acquire carries a Step Functions task token. It joins the key's queue (a counter
//! on the lease item and one waiter item per waiter) and returns; nothing runs while it waits.
//! Whoever frees the key (a release, a force-release, or the scheduled sweep for an expired
//! lease) grants it to the head waiter in one conditional write and delivers the lease through
//! [`Deliver`] (Step Functions `SendTaskSuccess` in the Lambda functions).

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::model::{Keepalive, Lease, LeaseId, Record, Released};
use crate::protocol::{AcquireOptions, Coordinator};
use crate::store::{Condition, Mutation, NewLease, ScanKind, Write};

/// Separates a lease key from its waiter suffix. Validated keys contain no control character,
/// so no waiter key is ever a lease key, nor a prefix of one.
pub const SEPARATOR: char = '\u{1f}';

/// First shard number of the queue's entries in the sparse index (keep-alive uses 0..8).
pub const QUEUE_SHARD_BASE: u32 = 1000;

/// Number of queue shards.
pub const QUEUE_SHARDS: u32 = 8;

/// A counter increment whose waiter item is still missing after this long belongs to an
/// enqueuer that died between its two writes: the waiter is skipped.
pub const ENQUEUE_GRACE_MS: u64 = 10_000;

/// A grant still marked undelivered this long after it was written is delivered again by
/// whoever serves the queue (the granting function died, or every delivery attempt failed).
pub const DELIVERY_GRACE_MS: u64 = 5_000;

/// The key of waiter `seq` of `key`.
pub fn waiter_key(key: &str, seq: u64) -> String {
    format!("{key}{SEPARATOR}q{seq}")
}

/// The lease key and sequence number of a waiter key.
pub fn split_waiter_key(k: &str) -> Option<(&str, u64)> {
    let (key, rest) = k.split_once(SEPARATOR)?;
    Some((key, rest.strip_prefix('q')?.parse().ok()?))
}

/// The index shard of a waiter item (of the lease key it waits for).
pub fn queue_shard(k: &str) -> u32 {
    let key = split_waiter_key(k).map_or(k, |(key, _)| key);
    QUEUE_SHARD_BASE + crate::store::keepalive_shard(key, QUEUE_SHARDS)
}

/// A queued acquire, as its waiter item stores it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Waiter {
    pub seq: u64,
    pub holder: String,
    pub lease_id: LeaseId,
    pub duration_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Map<String, Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keepalive: Option<Keepalive>,
    /// The Step Functions task token the lease is delivered to.
    pub task_token: String,
    pub enqueued_at_ms: u64,
    /// When the waiter's task times out (its state's `TimeoutSeconds`), if the caller said:
    /// a waiter past it is skipped without a delivery attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_at_ms: Option<u64>,
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
    /// The key was free: the lease was granted (and delivered).
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
}

impl Coordinator {
    /// This coordinator, delivering hand-over grants through `deliver`.
    pub fn with_deliver(mut self, deliver: Arc<dyn Deliver>) -> Self {
        self.deliver = Some(deliver);
        self
    }

    /// After a write that freed `key` (`r` as written): when waiters are queued, the key is
    /// theirs (no plain acquire takes a key with waiters), so serve the head one now.
    pub(crate) async fn hand_over_after_free(&self, key: &str, r: &Record) {
        if r.queue_len() == 0 || self.deliver.is_none() {
            return;
        }
        if let Err(e) = self.serve_queue(key).await {
            tracing::warn!(key, error = e.name(), "hand-over after release failed; the sweep serves the queue");
        }
    }

    /// Acquires of this coordinator waiting for `key` in its in-process line.
    pub fn waiting(&self, key: &str) -> usize {
        self.wakeups.waiting(key)
    }

    /// Is the head of this coordinator's line for `key` asleep, offering its lease to a release?
    pub fn head_waiter_offers(&self, key: &str) -> bool {
        self.wakeups.head_offers(key)
    }

    fn deliverer(&self) -> Result<&Arc<dyn Deliver>> {
        self.deliver.as_ref().ok_or_else(|| Error::invalid("a queued acquire needs Step Functions delivery"))
    }

    /// A queued acquire: takes the key if it is free (and delivers the lease at once), else
    /// joins its queue and returns. The lease is delivered to `task_token` when the waiter's
    /// turn comes. `duration` is required (a waiter's grant must end by itself if it is never
    /// delivered).
    pub async fn acquire_or_enqueue(
        &self,
        key: &str,
        holder: &str,
        duration: Duration,
        opts: AcquireOptions,
        task_token: &str,
        timeout_at_ms: Option<u64>,
    ) -> Result<Enqueued> {
        self.check_acquire(key, holder, Some(duration), &opts)?;
        if opts.min_hold.is_some() || opts.wait.is_some() {
            return Err(Error::invalid("a queued acquire takes neither min_hold_ms nor wait_ms"));
        }
        if task_token.is_empty() || task_token.len() > 2048 {
            return Err(Error::invalid("task_token must be 1..=2048 bytes (a Step Functions task token)"));
        }
        let deliver = self.deliverer()?.clone();
        let lease_id = opts.lease_id.clone().unwrap_or_else(LeaseId::generate);
        let opts = AcquireOptions { lease_id: Some(lease_id.clone()), ..opts };
        for _ in 0..8 {
            // Free and without waiters: the plain acquire (one request).
            match self.acquire(key, holder, Some(duration), opts.clone()).await {
                Ok(lease) => {
                    return match deliver.success(task_token, &lease).await {
                        Ok(()) => Ok(Enqueued::Granted(lease)),
                        Err(e) => {
                            // Nobody will use it: free the key (and serve any waiter behind).
                            let _ = self.release(key, &lease_id).await;
                            Err(Error::invalid(format!("the lease could not be delivered: {e:?}")))
                        }
                    };
                }
                Err(Error::LeaseHeld { .. }) => {}
                Err(e) => return Err(e),
            }
            // Held, or free with waiters: join the queue.
            let deadline = Instant::now() + self.config().retry_budget;
            let start = self.now_us();
            let (w, _, now) = self
                .write(key, deadline, |now| {
                    Ok((Condition::Queueable { now_ms: now }, Mutation::Enqueue { now_ms: now, start }))
                })
                .await
                .map_err(|f| f.into_error(key))?;
            let r = match w {
                Write::Applied(r) => r,
                // Freed in between: take it.
                Write::Rejected(_) => continue,
            };
            let seq = r.queue_tail.expect("an enqueue sets the tail");
            let waiter = Waiter {
                seq,
                holder: holder.to_string(),
                lease_id: lease_id.clone(),
                duration_ms: duration.as_millis() as u64,
                metadata: opts.metadata.clone(),
                keepalive: opts.keepalive.clone(),
                task_token: task_token.to_string(),
                enqueued_at_ms: now,
                timeout_at_ms,
            };
            let max_wait = self.config().limits.max_wait.as_millis() as u64;
            let item = Record {
                key: waiter_key(key, seq),
                fence: 0,
                holder: holder.to_string(),
                lease_id: lease_id.clone(),
                acquired_at_ms: now,
                expires_at_ms: Some(0),
                duration_ms: None,
                min_hold_until_ms: 0,
                released_at_ms: None,
                metadata: None,
                keepalive: None,
                ttl: Some(self.ttl_after(now + max_wait + self.max_duration_ms())),
                renewed_at_ms: None,
                poll_ms: None,
                handed_in: None,
                queue_head: None,
                queue_tail: None,
                queue_tail_at_ms: None,
                pending_token: None,
                waiter: Some(waiter),
                state: None,
                state_since_ms: None,
                attempts: None,
            };
            let wk = waiter_key(key, seq);
            self.write(&wk, deadline, |_| Ok((Condition::NotLease, Mutation::PutWaiter(Box::new(item.clone())))))
                .await
                .map_err(|f| f.into_error(key))?;
            // The key may have been freed between the two writes, with nobody to serve this
            // waiter: serve it now (one read when the key is still held).
            if let Err(e) = self.serve_queue(key).await {
                tracing::warn!(key, error = e.name(), "serving the queue after an enqueue failed");
            }
            let head = r.queue_head.unwrap_or(seq - 1);
            return Ok(Enqueued::Queued { seq, position: seq.saturating_sub(head), lease_id });
        }
        Err(Error::StoreUnavailable(format!("{key:?} kept changing hands while joining its queue")))
    }

    /// Serves `key`'s queue: when the key is free and waiters are queued, grants it to the head
    /// waiter in one conditional write and delivers the lease; a waiter that is gone is passed
    /// over (its grant revoked) and the next one served. Also delivers again a grant left
    /// undelivered for longer than [`DELIVERY_GRACE_MS`]. Safe to run concurrently with
    /// anything: every write is conditional on what was read.
    pub async fn serve_queue(&self, key: &str) -> Result<Served> {
        let mut served = Served::default();
        let Some(deliver) = self.deliver.clone() else { return Ok(served) };
        // It judges expiry and writes one: not with a clock the store's disagrees with.
        self.check_clock(key).await?;
        // Bounded: each pass either serves one waiter or stops; races re-read.
        for _ in 0..64 {
            let Some(r) = self.store().get(key).await? else { return Ok(served) };
            let now = self.now_ms();
            if r.is_held(now) {
                if let Some(token) = r.pending_token.clone() {
                    if now.saturating_sub(r.acquired_at_ms) >= DELIVERY_GRACE_MS {
                        self.redeliver(key, &r, &token, &deliver, &mut served).await?;
                    }
                }
                return Ok(served);
            }
            if r.queue_len() == 0 {
                return Ok(served);
            }
            let head = r.queue_head.expect("a queue has a head");
            let seq = head + 1;
            let wk = waiter_key(key, seq);
            let waiter = self.store().get(&wk).await?.and_then(|w| w.waiter).filter(|w| w.seq == seq);
            let waiter = match waiter {
                Some(w) if w.timeout_at_ms.is_none_or(|t| t > now) => w,
                Some(_) => {
                    // Its task timed out: pass over it.
                    if self.skip(key, &r, now, seq).await? {
                        served.skipped += 1;
                        let _ = self.store().delete(&wk, &Condition::NotLease).await;
                    }
                    continue;
                }
                None => {
                    if now.saturating_sub(r.queue_tail_at_ms.unwrap_or(0)) < ENQUEUE_GRACE_MS {
                        // Its enqueuer is between its two writes; it serves the queue itself
                        // right after the second (or the sweep does).
                        return Ok(served);
                    }
                    if self.skip(key, &r, now, seq).await? {
                        served.skipped += 1;
                    }
                    continue;
                }
            };
            // Grant: the waiter's lease, a fence above every earlier one, the head moved on.
            let lease = self.waiter_lease(key, &r, &waiter, now)?;
            let sent = Instant::now();
            let cond = Condition::HandOver { fence: r.fence, now_ms: now, head };
            let grant = Mutation::Grant { lease, seq, token: waiter.task_token.clone() };
            let granted = match self.store().update(key, &cond, &grant).await? {
                Write::Applied(g) => g,
                Write::Rejected(_) => continue,
            };
            if !self.deliver_grant(&deliver, key, &granted, sent, now, &waiter, &mut served).await? {
                return Ok(served);
            }
        }
        Ok(served)
    }

    /// The lease a grant gives `waiter` on the item `r` read at `now`: the waiter's own
    /// lease_id, duration, metadata and keep-alive, and a fence above every earlier one.
    fn waiter_lease(&self, key: &str, r: &Record, waiter: &Waiter, now: u64) -> Result<NewLease> {
        Ok(NewLease {
            holder: waiter.holder.clone(),
            lease_id: waiter.lease_id.clone(),
            now_ms: now,
            duration_ms: Some(waiter.duration_ms),
            min_hold_ms: 0,
            metadata: waiter.metadata.clone(),
            keepalive: waiter.keepalive.clone(),
            // A key in a work state is kept until it is taken: no TTL (as for a batch grant).
            ttl: r.state.is_none().then(|| self.ttl_after(now + waiter.duration_ms)),
            fence: self.next_fence(key, Some(r.fence))?,
            poll_ms: None,
            visit: None,
            handed_in: None,
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
        let lease = granted.lease(sent, now, self.skew_ms()).with_safe_for(sent);
        match self.deliver_with_retries(deliver, &waiter.task_token, &lease).await {
            Ok(()) => {
                served.delivered += 1;
                let _ = self.store().update(key, &Condition::Undelivered { fence }, &Mutation::Delivered).await?;
                let _ = self.store().delete(&wk, &Condition::NotLease).await;
                Ok(false)
            }
            Err(DeliveryError::Gone(why)) => {
                // Never delivered (the first answer said so): nobody holds it. Free the key and
                // serve the next waiter.
                tracing::info!(key, seq, why, "queued waiter is gone; its grant is revoked");
                let ttl = self.ttl_after(now + self.max_duration_ms());
                let m = Mutation::Revoke { now_ms: self.now_ms(), ttl };
                self.store().update(key, &Condition::Undelivered { fence }, &m).await?;
                let _ = self.store().delete(&wk, &Condition::NotLease).await;
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
        let (Some(deliver), Some(head)) = (self.deliver.clone(), r.queue_head) else { return Ok(None) };
        self.check_clock(key).await?;
        let now = self.now_ms();
        if r.min_hold_until_ms > now {
            return Ok(None);
        }
        let seq = head + 1;
        let waiter = self.store().get(&waiter_key(key, seq)).await?.and_then(|w| w.waiter).filter(|w| w.seq == seq);
        let Some(waiter) = waiter.filter(|w| w.timeout_at_ms.is_none_or(|t| t > now)) else { return Ok(None) };
        let lease = self.waiter_lease(key, r, &waiter, now)?;
        let sent = Instant::now();
        let cond = Condition::ReleaseHandOver { lease_id: lease_id.clone(), fence: r.fence, now_ms: now, head };
        let grant = Mutation::Grant { lease, seq, token: waiter.task_token.clone() };
        let Write::Applied(granted) = self.store().update(key, &cond, &grant).await? else { return Ok(None) };
        let released = Released {
            key: key.to_string(),
            fence: r.fence,
            released_at_ms: now,
            free_at_ms: now,
            already_released: false,
            state: r.state.clone(),
        };
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
    /// revoked: it ends with its duration), unless the delivery failed transiently.
    async fn redeliver(
        &self,
        key: &str,
        r: &Record,
        token: &str,
        deliver: &Arc<dyn Deliver>,
        served: &mut Served,
    ) -> Result<()> {
        let now = self.now_ms();
        let lease = r.lease(Instant::now(), now, self.skew_ms()).with_safe_for(Instant::now());
        match deliver.success(token, &lease).await {
            Ok(()) => served.delivered += 1,
            Err(DeliveryError::Gone(why)) => {
                tracing::info!(key, why, "undelivered grant's waiter is gone; the grant ends with its duration");
            }
            Err(DeliveryError::Transient(why)) => {
                tracing::warn!(key, why, "redelivery failed; the next sweep tries again");
                served.undelivered += 1;
                return Ok(());
            }
        }
        self.store().update(key, &Condition::Undelivered { fence: r.fence }, &Mutation::Delivered).await?;
        if let Some(seq) = r.queue_head {
            let _ = self.store().delete(&waiter_key(key, seq), &Condition::NotLease).await;
        }
        Ok(())
    }

    /// Passes over waiter `seq` (the head moves on) if the key is still free with the same head.
    async fn skip(&self, key: &str, r: &Record, now: u64, seq: u64) -> Result<bool> {
        let cond = Condition::HandOver { fence: r.fence, now_ms: now, head: seq - 1 };
        Ok(matches!(self.store().update(key, &cond, &Mutation::Skip { seq }).await?, Write::Applied(_)))
    }

    /// The scheduled sweep of every queue: serves each key with waiters (an expired holder is
    /// replaced, an undelivered grant delivered) and deletes waiter items left behind. Stops
    /// starting keys at `deadline`.
    pub async fn sweep_queues(&self, deadline: Instant) -> Result<QueueSweep> {
        let mut report = QueueSweep::default();
        self.check_clock("leasehold/queue-sweep").await?;
        for shard in 0..QUEUE_SHARDS {
            let mut start: Option<String> = None;
            let mut keys: Vec<String> = Vec::new();
            let mut dead: Vec<(String, String)> = Vec::new();
            loop {
                if Instant::now() >= deadline {
                    return Ok(report);
                }
                let kind = ScanKind::Keepalive { shard: QUEUE_SHARD_BASE + shard, after_ms: 0 };
                let page = self.store().scan(&kind, start.as_deref(), 100).await?;
                for item in &page.items {
                    if let Some((key, _)) = split_waiter_key(&item.key) {
                        if keys.last().map(String::as_str) != Some(key) && !keys.iter().any(|k| k == key) {
                            keys.push(key.to_string());
                        }
                        dead.push((key.to_string(), item.key.clone()));
                    }
                }
                match page.next {
                    Some(n) => start = Some(n),
                    None => break,
                }
            }
            for key in keys {
                if Instant::now() >= deadline {
                    return Ok(report);
                }
                report.keys += 1;
                match self.serve_queue(&key).await {
                    Ok(s) => {
                        report.served.delivered += s.delivered;
                        report.served.undelivered += s.undelivered;
                        report.served.skipped += s.skipped;
                    }
                    Err(e) => {
                        tracing::warn!(key, error = e.name(), "queue sweep: serving failed");
                        report.errors += 1;
                        continue;
                    }
                }
                // Waiter items at or below the head are served: delete them (an undelivered
                // grant keeps its waiter item until it is delivered).
                let Ok(Some(r)) = self.store().get(&key).await else { continue };
                let head = r.queue_head.unwrap_or(0);
                for (_, wk) in dead.iter().filter(|(k, _)| k == &key) {
                    let seq = split_waiter_key(wk).map_or(0, |(_, s)| s);
                    let pending = r.pending_token.is_some() && seq == head;
                    if seq <= head && !pending {
                        let _ = self.store().delete(wk, &Condition::NotLease).await;
                    }
                }
            }
        }
        Ok(report)
    }

    /// The position of the waiter `lease_id` in `key`'s queue (1: next), `None` when it is not
    /// queued. Reads the waiter items in order (at most `limit` of them).
    pub async fn queue_position(&self, key: &str, lease_id: &LeaseId, limit: u64) -> Result<Option<u64>> {
        self.config().limits.key(key)?;
        let Some(r) = self.store().get(key).await? else { return Ok(None) };
        let (Some(head), Some(tail)) = (r.queue_head, r.queue_tail) else { return Ok(None) };
        for seq in head + 1..=tail.min(head + limit) {
            if let Some(w) = self.store().get(&waiter_key(key, seq)).await?.and_then(|w| w.waiter) {
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
