//! The lease protocol, written once over the [`Store`] trait. DESIGN.md is its specification.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value};

use crate::error::{Error, NotHolderReason, Result};
use crate::model::{Keepalive, Lease, LeaseId, LeaseState, Record, Released};
use crate::pacing::{aged, next_period, period_of, Pacer};
use crate::store::{Condition, Mutation, NewLease, ScanKind, Store, Write};
use crate::validate::Limits;

/// Largest fence the protocol will issue: 2^53, the largest integer JSON/JavaScript clients
/// read exactly. Fences are drawn from the clock in epoch µs (about 2^50.6 in 2026; 2^53 is
/// reached in the year 2255).
pub const MAX_FENCE: u64 = 1 << 53;

/// Coordinator settings. Every field has a documented default.
#[derive(Debug, Clone)]
pub struct Config {
    pub limits: Limits,
    /// Duration of a lease when the request names none.
    pub default_duration: Duration,
    /// Largest difference assumed between any two coordinator clocks (and between a holder's
    /// monotonic clock rate and real time over one lease): `safe_until` ends this much before
    /// the expiry.
    pub skew_margin: Duration,
    /// How long after its expiry an item may be swept by TTL.
    pub ttl_grace: Duration,
    /// Retries of throttled/unavailable store requests: first pause, longest pause, and how
    /// long an operation without its own deadline keeps retrying.
    pub retry_base: Duration,
    pub retry_max: Duration,
    pub retry_budget: Duration,
    /// Waiting acquires poll at most this often when the holder's expiry is further away.
    pub poll_max: Duration,
    /// Added to the wall clock (tests use it to play a coordinator with a skewed clock).
    pub clock_offset_ms: i64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            limits: Limits::default(),
            default_duration: Duration::from_secs(60),
            skew_margin: Duration::from_millis(200),
            ttl_grace: Duration::from_secs(24 * 3600),
            retry_base: Duration::from_millis(25),
            retry_max: Duration::from_secs(1),
            retry_budget: Duration::from_secs(5),
            poll_max: Duration::from_millis(500),
            clock_offset_ms: 0,
        }
    }
}

/// Options of an acquire.
#[derive(Debug, Clone, Default)]
pub struct AcquireOptions {
    /// Keep trying this long while the key is held.
    pub wait: Option<Duration>,
    /// A release never frees the key before acquired_at + min_hold.
    pub min_hold: Option<Duration>,
    /// Small JSON object stored with the lease (<= 4 KiB).
    pub metadata: Option<Map<String, Value>>,
    /// Let the scheduled heartbeat renew this lease on the holder's behalf.
    pub keepalive: Option<Keepalive>,
    /// Caller-chosen lease_id, so a retried acquire (lost response) gets the same lease.
    /// When `None`, 128 bits are drawn from the OS CSPRNG.
    pub lease_id: Option<LeaseId>,
}

/// Exponential backoff with "equal jitter": each pause is uniform in [d/2, d].
#[derive(Debug, Clone)]
pub struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    pub fn new(base: Duration, max: Duration) -> Self {
        Backoff { next: base, max }
    }

    pub fn next_pause(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        jitter(d)
    }
}

/// A uniform random duration in [d/2, d].
pub fn jitter(d: Duration) -> Duration {
    uniform(d / 2, d)
}

/// A uniform random duration in [lo, hi] (`lo` when `hi <= lo`).
pub fn uniform(lo: Duration, hi: Duration) -> Duration {
    let mut b = [0u8; 8];
    let r = if getrandom::fill(&mut b).is_ok() { u64::from_le_bytes(b) } else { 0 };
    let span = hi.saturating_sub(lo).as_nanos() as u64;
    lo + Duration::from_nanos(if span == 0 { 0 } else { r % (span + 1) })
}

/// The lease coordinator: validation, conditions, retries and fencing over one store.
#[derive(Clone)]
pub struct Coordinator {
    store: Arc<dyn Store>,
    config: Arc<Config>,
    pacer: Arc<Pacer>,
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator").field("store", &self.store.name()).field("config", &self.config).finish()
    }
}

impl Coordinator {
    pub fn new(store: Arc<dyn Store>, config: Config) -> Self {
        Coordinator { store, config: Arc::new(config), pacer: Arc::default() }
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The coordinator's clock: epoch milliseconds.
    pub fn now_ms(&self) -> u64 {
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0);
        (wall + self.config.clock_offset_ms).max(0) as u64
    }

    /// The coordinator's clock in epoch microseconds: where fences come from.
    pub fn now_us(&self) -> u64 {
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as i64).unwrap_or(0);
        (wall + self.config.clock_offset_ms * 1000).max(0) as u64
    }

    fn skew_ms(&self) -> u64 {
        self.config.skew_margin.as_millis() as u64
    }

    /// TTL attribute (epoch seconds) for an item that stops mattering at `ms`.
    pub(crate) fn ttl_after(&self, ms: u64) -> u64 {
        ms.div_ceil(1000) + self.config.ttl_grace.as_secs()
    }

    pub(crate) fn max_duration_ms(&self) -> u64 {
        self.config.limits.max_duration.as_millis() as u64
    }

    /// Runs one conditional write, retrying throttled/unavailable answers with jittered
    /// backoff until `deadline`. Every retry re-reads the clock and re-sends the same lease_id,
    /// so a retry after an ambiguous failure (the write landed, the answer was lost) is
    /// recognised by the caller from the item that comes back.
    async fn write(
        &self,
        key: &str,
        deadline: Instant,
        mut attempt: impl FnMut(u64) -> (Condition, Mutation),
    ) -> Result<(Write, Instant, u64)> {
        let mut backoff = Backoff::new(self.config.retry_base, self.config.retry_max);
        loop {
            let sent = Instant::now();
            let now = self.now_ms();
            let (cond, m) = attempt(now);
            match self.store.update(key, &cond, &m).await {
                Ok(w) => return Ok((w, sent, now)),
                Err(e) if e.is_transient() => {
                    let pause = backoff.next_pause();
                    if Instant::now() + pause >= deadline {
                        return Err(e);
                    }
                    tracing::debug!(
                        key,
                        error = e.name(),
                        pause_ms = pause.as_millis() as u64,
                        "retrying store request"
                    );
                    tokio::time::sleep(pause).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Takes the lease on `key` for `duration` (`None`: a fail-closed lease, held until
    /// released). One store request when the key is free.
    pub async fn acquire(
        &self,
        key: &str,
        holder: &str,
        duration: Option<Duration>,
        opts: AcquireOptions,
    ) -> Result<Lease> {
        let start = Instant::now();
        let limits = &self.config.limits;
        limits.key(key)?;
        limits.holder(holder)?;
        if let Some(d) = duration {
            limits.duration("duration_ms", d)?;
        }
        let wait = opts.wait.unwrap_or_default();
        limits.wait(wait)?;
        let min_hold = opts.min_hold.unwrap_or_default();
        limits.min_hold(min_hold, duration)?;
        if let Some(m) = &opts.metadata {
            limits.metadata(m)?;
        }
        if let Some(k) = &opts.keepalive {
            limits.keepalive(k, self.now_ms(), duration)?;
        }
        let lease_id = opts.lease_id.clone().unwrap_or_else(LeaseId::generate);
        let wait_deadline = start + wait;
        let retry_deadline = wait_deadline.max(start + self.config.retry_budget);
        let duration_ms = duration.map(|d| d.as_millis() as u64);
        // Pacing of the attempts while the key is held (see `pacing`): a coordinator that
        // found this key contended a moment ago first waits a random part of the key's poll
        // period, so that it competes with the waiters instead of jumping ahead of them.
        let pace = self.pacer.begin(key);
        let mut attempts = 0u32;
        let mut contended = false;
        if let (Some(c), true) = (pace.courtesy, wait > Duration::ZERO) {
            contended = true;
            tokio::time::sleep(c.min(wait_deadline.saturating_duration_since(Instant::now()))).await;
        }
        let mut period = pace.period;
        let mut pause = period;
        // The last fence seen on this key: the next one must be above it.
        let mut seen_fence: Option<u64> = None;
        // The lease that held the key at the last rejection.
        let mut held_by: Option<u64> = None;
        loop {
            attempts += 1;
            let mut fence = 0;
            let (w, sent, now) = self
                .write(key, retry_deadline, |now| {
                    fence = self.now_us().max(seen_fence.map_or(0, |f| f + 1));
                    let m = Mutation::Acquire(NewLease {
                        holder: holder.to_string(),
                        lease_id: lease_id.clone(),
                        now_ms: now,
                        duration_ms,
                        min_hold_ms: min_hold.as_millis() as u64,
                        metadata: opts.metadata.clone(),
                        keepalive: opts.keepalive.clone(),
                        ttl: duration_ms.map(|d| self.ttl_after(now + d)),
                        fence,
                        // Passed on to the key's waiters (see `pacing`).
                        poll_ms: contended
                            .then(|| next_period(period, attempts, self.config.poll_max).as_millis() as u64),
                    });
                    (Condition::Free { now_ms: now, fence }, m)
                })
                .await?;
            let granted = match w {
                Write::Applied(r) => {
                    check_fence(&r)?;
                    Ok(r)
                }
                // An earlier attempt with this lease_id landed (its answer was lost, or the
                // caller retried): the same lease, the same fence.
                Write::Rejected(Some(r)) if r.is_live_for(&lease_id, now) => Ok(r),
                // Free, but its last fence is not below ours (a coordinator whose clock runs
                // ahead, a force-release, or µs collisions): go again just above it.
                Write::Rejected(Some(r)) if !r.is_held(now) && r.fence >= fence => {
                    seen_fence = Some(r.fence);
                    continue;
                }
                Write::Rejected(Some(r)) => Err(r),
                Write::Rejected(None) => {
                    return Err(Error::StoreUnavailable("store rejected a write on a missing item".into()))
                }
            };
            let current = match granted {
                Ok(r) => {
                    // The period the granted item advertises (written by an acquire that
                    // contended), remembered for this coordinator's next call.
                    let advertised = r.poll_ms;
                    match self.usable(r, sent, now, retry_deadline)? {
                        Some(lease) => {
                            if advertised.is_some() {
                                self.pacer.contended(key, period_of(advertised, self.config.poll_max));
                            }
                            return Ok(lease);
                        }
                        None => continue,
                    }
                }
                Err(r) => r,
            };
            contended = true;
            period = period_of(current.poll_ms, self.config.poll_max);
            self.pacer.contended(key, period);
            let held = Error::LeaseHeld {
                key: key.to_string(),
                holder: current.holder.clone(),
                expires_at_ms: current.expires_at_ms,
            };
            let now_i = Instant::now();
            if now_i >= wait_deadline {
                return Err(held);
            }
            // While the key changes hands, poll at the period its item advertises, aged by our
            // wait; while one lease stays on it, double the pause up to poll_max. Never sleep
            // past the holder's known expiry (a crashed holder is replaced promptly), nor past
            // our own deadline (one last attempt is made at the deadline).
            pause = if held_by == Some(current.fence) {
                (pause * 2).min(self.config.poll_max.max(period))
            } else {
                aged(period, start.elapsed())
            };
            held_by = Some(current.fence);
            let mut sleep = uniform(pause / 2, pause + pause / 2);
            if let Some(e) = current.expires_at_ms {
                let until_expiry = Duration::from_millis(e.saturating_sub(self.now_ms()) + 1);
                sleep = sleep.min(until_expiry);
            }
            sleep = sleep.min(wait_deadline - now_i);
            tokio::time::sleep(sleep).await;
        }
    }

    /// The lease a grant gives the holder, or `None` when the answer arrived after the lease's
    /// safe time (a stalled request): such a lease is of no use to the holder, so the caller
    /// takes the key again (the stale grant has expired, the retry gets the next fence) while
    /// its deadline allows.
    fn usable(&self, r: Record, sent: Instant, now: u64, deadline: Instant) -> Result<Option<Lease>> {
        let lease = r.lease(sent, now, self.skew_ms());
        if lease.safe_until.is_none_or(|t| t > Instant::now()) {
            return Ok(Some(lease));
        }
        if Instant::now() >= deadline {
            return Err(Error::StoreUnavailable(
                "the store answered after the granted lease's safe time had passed".into(),
            ));
        }
        tracing::debug!(key = %r.key, "granted lease arrived after its safe time; acquiring again");
        Ok(None)
    }

    /// Extends a live lease by `duration` (default: the lease's own duration) from now.
    pub async fn heartbeat(&self, key: &str, lease_id: &LeaseId, duration: Option<Duration>) -> Result<Lease> {
        let deadline = Instant::now() + self.config.retry_budget;
        self.heartbeat_until(key, lease_id, duration, deadline).await
    }

    /// [`Coordinator::heartbeat`], retrying transient failures until `deadline`.
    pub async fn heartbeat_until(
        &self,
        key: &str,
        lease_id: &LeaseId,
        duration: Option<Duration>,
        deadline: Instant,
    ) -> Result<Lease> {
        self.config.limits.key(key)?;
        if let Some(d) = duration {
            self.config.limits.duration("duration_ms", d)?;
        }
        let duration_ms = duration.map(|d| d.as_millis() as u64);
        let max = self.max_duration_ms();
        let (w, sent, now) = self
            .write(key, deadline, |now| {
                (
                    Condition::Live { lease_id: lease_id.clone(), now_ms: now, timed: duration_ms.is_none() },
                    Mutation::Extend {
                        now_ms: now,
                        duration_ms,
                        ttl: Some(self.ttl_after(now + duration_ms.unwrap_or(max))),
                    },
                )
            })
            .await?;
        match w {
            Write::Applied(r) => Ok(r.lease(sent, now, self.skew_ms())),
            Write::Rejected(Some(r)) => {
                if r.is_live_for(lease_id, now) && r.duration_ms.is_none() {
                    // A fail-closed lease has nothing to extend: it is held until released.
                    return Ok(r.lease(sent, now, self.skew_ms()));
                }
                Err(self.not_holder(key, lease_id, Some(&r), now))
            }
            Write::Rejected(None) => Err(self.not_holder(key, lease_id, None, now)),
        }
    }

    fn not_holder(&self, key: &str, lease_id: &LeaseId, r: Option<&Record>, now: u64) -> Error {
        let reason = match r {
            None => NotHolderReason::Missing,
            Some(r) if &r.lease_id != lease_id => NotHolderReason::WrongLeaseId,
            Some(r) if r.released_at_ms.is_some() => NotHolderReason::Released,
            Some(r) if !r.is_held(now) => NotHolderReason::Expired,
            // Live for lease_id, but the condition failed: only when a duration was needed.
            Some(_) => NotHolderReason::Expired,
        };
        Error::NotHolder { key: key.to_string(), reason }
    }

    /// Releases the lease. Idempotent: a retried release of the same lease_id succeeds again
    /// as long as nobody else has taken the key since.
    pub async fn release(&self, key: &str, lease_id: &LeaseId) -> Result<Released> {
        self.config.limits.key(key)?;
        let deadline = Instant::now() + self.config.retry_budget;
        let max = self.max_duration_ms();
        let (w, _, now) = self
            .write(key, deadline, |now| {
                (
                    Condition::Owns { lease_id: lease_id.clone() },
                    Mutation::Release { now_ms: now, ttl: self.ttl_after(now + max) },
                )
            })
            .await?;
        match w {
            Write::Applied(r) => Ok(Released {
                key: key.to_string(),
                fence: r.fence,
                released_at_ms: now,
                free_at_ms: r.expires_at_ms.unwrap_or(now).max(now),
            }),
            Write::Rejected(r) => Err(self.not_holder(key, lease_id, r.as_ref(), now)),
        }
    }

    /// Operator release: frees the key at once whoever holds it (min_hold ignored) and
    /// advances the fence, so the evicted holder's fence is below any later one.
    pub async fn force_release(&self, key: &str) -> Result<LeaseState> {
        self.config.limits.key(key)?;
        let deadline = Instant::now() + self.config.retry_budget;
        let max = self.max_duration_ms();
        let (w, _, now) = self
            .write(key, deadline, |now| {
                (Condition::Exists, Mutation::ForceRelease { now_ms: now, ttl: self.ttl_after(now + max) })
            })
            .await?;
        match w {
            Write::Applied(r) => Ok(r.state(now)),
            Write::Rejected(_) => Err(Error::NotFound { key: key.to_string() }),
        }
    }

    /// The public state of `key` (never the lease_id).
    pub async fn get(&self, key: &str) -> Result<LeaseState> {
        self.config.limits.key(key)?;
        match self.store.get(key).await? {
            Some(r) => Ok(r.state(self.now_ms())),
            None => Err(Error::NotFound { key: key.to_string() }),
        }
    }

    /// Keys held right now, at most `limit` of them, in the store's order.
    pub async fn list(&self, limit: usize) -> Result<Vec<LeaseState>> {
        let mut out = Vec::new();
        let mut start: Option<String> = None;
        loop {
            let page = self.store.scan(&ScanKind::All, start.as_deref(), 100).await?;
            let now = self.now_ms();
            out.extend(page.items.iter().filter(|r| r.is_held(now)).map(|r| r.state(now)));
            if out.len() >= limit {
                out.truncate(limit);
                return Ok(out);
            }
            match page.next {
                Some(n) => start = Some(n),
                None => return Ok(out),
            }
        }
    }
}

fn check_fence(r: &Record) -> Result<()> {
    if r.fence > MAX_FENCE {
        return Err(Error::StoreUnavailable(format!("fence of {:?} passed 2^53; the key must be retired", r.key)));
    }
    Ok(())
}
