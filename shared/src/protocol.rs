//! The lease protocol, written once over the [`Store`] trait. DESIGN.md is its specification.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Map, Value};

use crate::backoff::{jitter, Backoff};
use crate::clock::{Clock, SystemClock};
use crate::error::NotHolderReason as Reason;
use crate::error::{Error, Result};
use crate::model::{Keepalive, Lease, LeaseId, LeaseState, Record, Released};
use crate::pacing::{Pacer, Waiting};
use crate::store::{Condition, Mutation, NewLease, ScanKind, Store, Visit, Write};
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
    /// How far ahead of this coordinator's clock a key's last fence may plausibly be. Honest
    /// fences are a clock reading within the skew margin, or one more than an earlier fence; a
    /// fence further ahead was issued by a wrong clock and is never copied. It also bounds how
    /// far a fence can be ahead of the time its item's TTL is computed from (see `ttl_after`).
    pub fence_lead: Duration,
    /// Partitions of the work-state index per state (DESIGN.md, "Work items and batch leases").
    /// A property of the table: every coordinator on one table must use the same number.
    pub state_shards: u32,
    /// Allowance for a store `Date` header stamped before the answer left the server (DESIGN.md,
    /// "Clocks"): how late a stamp may be without being taken for a wrong clock here.
    pub date_lag: Duration,
    /// Where every reading of time comes from (the machine's clock by default; a virtual one
    /// in simulations and users' tests).
    pub clock: Arc<dyn Clock>,
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
            fence_lead: Duration::from_secs(60),
            state_shards: 1,
            date_lag: Duration::from_millis(crate::clock::DATE_LAG_MS as u64),
            clock: Arc::new(SystemClock),
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
    /// The whole acquire, its last attempt's retries included, ends by then (a Lambda
    /// invocation's end less its safety margin); `None`: the wait and the retry budget decide.
    /// A request already sent is bounded by the store client's attempt timeout.
    pub deadline: Option<Instant>,
}

/// The lease coordinator: validation, conditions, retries and fencing over one store.
#[derive(Clone)]
pub struct Coordinator {
    store: Arc<dyn Store>,
    config: Arc<Config>,
    pacer: Arc<Pacer>,
    /// Delivers hand-over grants to queued Step Functions waiters (DESIGN.md, "The waiter queue").
    pub(crate) deliver: Option<Arc<dyn crate::queue::Deliver>>,
    /// This coordinator's waiting acquires, woken by the releases it handles.
    pub(crate) wakeups: Arc<crate::wakeup::Wakeups>,
    /// Names this coordinator on the items its in-process hand-overs grant (`handed_in`).
    id: Arc<str>,
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator").field("store", &self.store.name()).field("config", &self.config).finish()
    }
}

impl Coordinator {
    pub fn new(store: Arc<dyn Store>, config: Config) -> Self {
        Coordinator {
            store,
            pacer: Arc::new(Pacer::new(config.clock.clone())),
            wakeups: Arc::new(crate::wakeup::Wakeups::new(config.clock.clone())),
            config: Arc::new(config),
            deliver: None,
            id: LeaseId::generate().expose()[..16].into(),
        }
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The coordinator's clock: epoch milliseconds.
    pub fn now_ms(&self) -> u64 {
        (self.config.clock.wall_ms() + self.config.clock_offset_ms).max(0) as u64
    }

    /// The coordinator's clock in epoch microseconds: where fences come from.
    pub fn now_us(&self) -> u64 {
        (self.config.clock.wall_us() + self.config.clock_offset_ms * 1000).max(0) as u64
    }

    /// The coordinator's monotonic clock: what deadlines and `safe_until` are measured in.
    pub fn monotonic(&self) -> Instant {
        self.config.clock.now()
    }

    pub(crate) fn skew_ms(&self) -> u64 {
        self.config.skew_margin.as_millis() as u64
    }

    /// TTL attribute (epoch seconds) for an item that stops mattering at `ms`: the grace after
    /// that, and never before the grace after its fence's own time (a fence is at most
    /// `fence_lead` ahead of the clock of the write that issued it, and every later write runs
    /// later), so that a key deleted by TTL restarts its fences above the old ones.
    pub(crate) fn ttl_after(&self, ms: u64) -> u64 {
        let lead = self.config.fence_lead.as_millis() as u64;
        ms.saturating_add(lead).div_ceil(1000) + self.config.ttl_grace.as_secs()
    }

    pub(crate) fn max_duration_ms(&self) -> u64 {
        self.config.limits.max_duration.as_millis() as u64
    }

    /// The coordinator's clock (epoch ms) at the monotonic instant `at`.
    fn clock_at(&self, at: Instant) -> i64 {
        self.now_ms() as i64 - self.monotonic().saturating_duration_since(at).as_millis() as i64
    }

    /// The measured offset `store clock - this clock` in ms (`lo`, `hi`), from the recent
    /// `Date` samples; `None` without recent evidence or on a store without one (the embedded
    /// store shares the machine's clock).
    pub fn clock_offset(&self) -> Option<(i64, i64)> {
        let samples = self.store.clock()?;
        let o = samples.offset(self.monotonic(), |at| self.clock_at(at), self.config.date_lag.as_millis() as i64)?;
        Some((o.lo, o.hi))
    }

    /// Refuses to judge or write expiries with a clock that is certainly further from the
    /// store's than the skew margin (DESIGN.md, "Clocks"). The evidence is the `Date` of the
    /// store's answers of the last [`MAX_AGE`](crate::clock::skew::MAX_AGE): with fewer recent
    /// answers than [`AGREEMENT`](crate::clock::AGREEMENT) (a new process, or one idle for
    /// minutes: when a thawed clock is most likely wrong), it reads `key` until it has them.
    /// It refuses only when that many answers agree that the clock is beyond the margin (when
    /// fewer could be had, all of them); with no recent answer at all it refuses to judge
    /// (`StoreUnavailable`, nothing sent).
    pub(crate) async fn check_clock(&self, key: &str) -> Result<()> {
        let Some(samples) = self.store.clock() else { return Ok(()) };
        let need = crate::clock::AGREEMENT;
        let deadline = self.monotonic() + self.config.retry_budget;
        // Bounded: answers may come without a usable `Date`.
        let mut reads = 0;
        while samples.recent(self.monotonic()) < need && reads < 2 * need && self.monotonic() < deadline {
            reads += 1;
            let _ = self.read(deadline, || self.store.get(key)).await;
        }
        let lag = self.config.date_lag.as_millis() as i64;
        let Some(e) = samples.evidence(self.monotonic(), |at| self.clock_at(at), lag) else {
            return Err(Error::not_sent(
                "no answer of the store in the last 5 minutes to check this coordinator's clock against; \
                 expiries are not judged without one",
            ));
        };
        let o = e.agreed;
        if o.beyond(self.skew_ms() as i64) {
            let (dir, lo, hi) = if o.lo > 0 { ("behind", o.lo, o.hi) } else { ("ahead of", -o.hi, -o.lo) };
            return Err(Error::ClockSkew(format!(
                "this coordinator's clock is {lo} to {hi} ms {dir} the store's ({} answers agree), beyond the skew \
                 margin of {} ms: it must not judge or write lease expiries until its time is synchronised",
                need.min(e.samples),
                self.skew_ms()
            )));
        }
        Ok(())
    }

    /// Runs one read, retrying throttled/unavailable answers with jittered backoff until
    /// `deadline`: a read is always safe to send again, and one lost answer must not fail the
    /// request that needed it.
    pub(crate) async fn read<T, F, Fut>(&self, deadline: Instant, mut read: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let mut backoff = Backoff::new(self.config.retry_base, self.config.retry_max);
        loop {
            match read().await {
                Err(e) if e.is_transient() => {
                    let pause = backoff.next_pause();
                    if self.monotonic() + pause >= deadline {
                        return Err(e);
                    }
                    tracing::debug!(error = e.name(), pause_ms = pause.as_millis() as u64, "retrying store read");
                    tokio::time::sleep(pause).await;
                }
                r => return r,
            }
        }
    }

    /// Runs one conditional write, retrying throttled/unavailable answers with jittered
    /// backoff until `deadline`. Every retry re-reads the clock and re-sends the same lease_id,
    /// so a retry after an ambiguous failure (the write landed, the answer was lost) is
    /// recognised by the caller from the item that comes back. `attempt` may refuse to write
    /// (a bound it checks before anything is sent).
    pub(crate) async fn write(
        &self,
        key: &str,
        deadline: Instant,
        attempt: impl FnMut(u64) -> Result<(Condition, Mutation)>,
    ) -> std::result::Result<(Write, Instant, u64), Failed> {
        self.write_noting(key, deadline, None, attempt, &mut false).await
    }

    /// [`Coordinator::write`], also setting `landed` when an attempt may have landed although
    /// a later one answered (an acquire carries that across its attempts). With `grants` (the
    /// lease_id the write may grant), each request runs in a task of its own, so that if the
    /// caller's future is dropped while it is in flight (a timeout, a disconnected HTTP client)
    /// the request still gets its answer, and a grant that lands for the departed caller is
    /// released at once (DESIGN.md, "Cancellation").
    pub(crate) async fn write_noting(
        &self,
        key: &str,
        deadline: Instant,
        grants: Option<&LeaseId>,
        mut attempt: impl FnMut(u64) -> Result<(Condition, Mutation)>,
        landed: &mut bool,
    ) -> std::result::Result<(Write, Instant, u64), Failed> {
        let mut backoff = Backoff::new(self.config.retry_base, self.config.retry_max);
        let mut maybe_landed = false;
        loop {
            let sent = self.monotonic();
            let now = self.now_ms();
            let (cond, m) = attempt(now).map_err(|error| Failed { error, maybe_landed })?;
            let answer = match grants {
                None => self.store.update(key, &cond, &m).await,
                Some(id) => self.update_detached(key, cond, m, id.clone()).await,
            };
            match answer {
                Ok(w) => return Ok((w, sent, now)),
                Err(e) if e.is_transient() => {
                    maybe_landed |= e.may_have_landed();
                    *landed |= maybe_landed;
                    let pause = backoff.next_pause();
                    if self.monotonic() + pause >= deadline {
                        return Err(Failed { error: e, maybe_landed });
                    }
                    tracing::debug!(
                        key,
                        error = e.name(),
                        pause_ms = pause.as_millis() as u64,
                        "retrying store request"
                    );
                    tokio::time::sleep(pause).await;
                }
                Err(error) => return Err(Failed { error, maybe_landed }),
            }
        }
    }

    /// One store write in a task of its own, answered through a channel. When nobody is left to
    /// take the answer (the caller's future was dropped) and the write granted, or may have
    /// granted, the lease `lease_id`, that lease is released at once.
    async fn update_detached(&self, key: &str, cond: Condition, m: Mutation, lease_id: LeaseId) -> Result<Write> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (coord, key) = (self.clone(), key.to_string());
        tokio::spawn(async move {
            let answer = coord.store.update(&key, &cond, &m).await;
            if let Err(answer) = tx.send(answer) {
                let granted = match answer {
                    Ok(Write::Applied(r) | Write::Rejected(Some(r))) => r.lease_id == lease_id,
                    Ok(Write::Rejected(None)) => false,
                    // It may have landed: look.
                    Err(e) => e.may_have_landed(),
                };
                if granted {
                    coord.release_departed(&key, &lease_id).await;
                }
            }
        });
        rx.await.unwrap_or_else(|_| Err(Error::StoreUnavailable("the store request ended without an answer".into())))
    }

    /// Releases the lease `lease_id` granted to an acquire that left before it could be told
    /// (its future was dropped). Nothing to do when it did not land or already ended.
    fn release_departed<'a>(
        &'a self,
        key: &'a str,
        lease_id: &'a LeaseId,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'a>> {
        Box::pin(self.release_departed_now(key, lease_id))
    }

    async fn release_departed_now(&self, key: &str, lease_id: &LeaseId) {
        // The ordinary release, without a hand-over of its own (that would make this recursive):
        // the next waiter is woken and tries.
        let deadline = self.monotonic() + self.config.retry_budget;
        let max = self.max_duration_ms();
        let w = self
            .write(key, deadline, |now| {
                let cond = Condition::Unreleased { lease_id: lease_id.clone() };
                Ok((cond, Mutation::Release { now_ms: now, ttl: self.ttl_after(now + max) }))
            })
            .await;
        match w {
            Ok((Write::Applied(r), _, _)) => {
                tracing::debug!(key, "released a grant whose acquire had left");
                self.keep_queued(key, &r).await;
                self.freed(key, &r);
                self.hand_over_after_free(key, &r).await;
            }
            Ok(_) => {}
            Err(f) => tracing::warn!(
                key,
                error = f.into_error(key).name(),
                "could not release a grant whose acquire had left; it expires on its own"
            ),
        }
    }

    /// Validates an acquire's inputs.
    pub(crate) fn check_acquire(
        &self,
        key: &str,
        holder: &str,
        duration: Option<Duration>,
        opts: &AcquireOptions,
    ) -> Result<()> {
        let limits = &self.config.limits;
        limits.key(key)?;
        limits.holder(holder)?;
        if let Some(d) = duration {
            limits.duration("duration_ms", d)?;
        }
        limits.wait(opts.wait.unwrap_or_default())?;
        limits.min_hold(opts.min_hold.unwrap_or_default(), duration)?;
        if let Some(m) = &opts.metadata {
            limits.metadata(m)?;
        }
        if let Some(k) = &opts.keepalive {
            limits.keepalive(k, self.now_ms(), duration)?;
        }
        if duration.is_none() && opts.lease_id.is_none() {
            // A fail-closed lease whose answer is lost would otherwise be held forever under an
            // id nobody knows; with the caller's own id, a retry or a release reaches it.
            return Err(Error::invalid(
                "a fail_closed lease needs a caller-chosen lease_id, so that a retry or a release can reach it \
                 if the answer is lost",
            ));
        }
        Ok(())
    }

    /// The fence an attempt writes: the clock in µs, above the last fence seen on the key.
    /// Refused before anything is written when the seen fence is implausibly far ahead of this
    /// clock (this clock is wrong, or another coordinator's was: copying it would spread the
    /// error) or when the fence would pass [`MAX_FENCE`].
    pub(crate) fn next_fence(&self, key: &str, seen: Option<u64>) -> Result<u64> {
        let now_us = self.now_us();
        let lead = self.config.fence_lead.as_micros() as u64;
        if let Some(s) = seen.filter(|&s| s > now_us.saturating_add(lead)) {
            return Err(Error::ClockSkew(format!(
                "the last fence of {key:?} is {} ms ahead of this coordinator's clock (at most {} ms is plausible): \
                 this clock, or the clock of the coordinator that issued it, is wrong",
                (s - now_us) / 1000,
                lead / 1000
            )));
        }
        let fence = now_us.max(seen.map_or(0, |f| f.saturating_add(1)));
        if fence > MAX_FENCE {
            return Err(Error::StoreUnavailable(format!(
                "the next fence of {key:?} would pass 2^53; this coordinator's clock is wrong or the key must be retired"
            )));
        }
        Ok(fence)
    }

    /// Takes the lease on `key` for `duration` (`None`: a fail-closed lease, held until
    /// released; it needs a caller-chosen lease_id). One store request when the key is free.
    pub async fn acquire(
        &self,
        key: &str,
        holder: &str,
        duration: Option<Duration>,
        opts: AcquireOptions,
    ) -> Result<Lease> {
        self.acquire_visit(key, holder, duration, opts, None).await
    }

    /// [`Coordinator::acquire`]; with `want`, only while the key is in `want`'s state (a batch
    /// lease: `want` is the visit the state index showed; `NotFound` when the key is no longer
    /// in that state). A key in a work state keeps it, and the grant counts as an attempt.
    pub(crate) async fn acquire_visit(
        &self,
        key: &str,
        holder: &str,
        duration: Option<Duration>,
        opts: AcquireOptions,
        want: Option<Visit>,
    ) -> Result<Lease> {
        // "May have landed" is carried across the whole acquire: an attempt whose answer was
        // lost may still land after a later attempt saw the key held or the store throttled,
        // so such an end is `OutcomeUnknown`; and every `OutcomeUnknown` names the lease_id it
        // is about (the caller's, or the generated one), which a release reaches.
        let mut lease_id = opts.lease_id.clone().unwrap_or_else(LeaseId::generate);
        let mut landed = false;
        // (A batch lease is written under the state visit the index showed, and every grant
        // counts an attempt of the visit: once another lease holds the key, a write of ours can
        // never land, so `LeaseHeld` stays what it is.)
        let batch = want.is_some();
        let res = self.acquire_attempts(key, holder, duration, opts, want, &mut lease_id, &mut landed).await;
        res.map_err(|e| {
            let open = matches!(e, Error::StoreUnavailable(_) | Error::Throttled(_))
                || (matches!(e, Error::LeaseHeld { .. }) && !batch);
            let e = if landed && open {
                Error::outcome_unknown(
                    key,
                    format!(
                        "{e}; an earlier attempt of this acquire timed out and may still land: release with this \
                         lease_id, or send the same request again with it"
                    ),
                )
            } else {
                e
            };
            e.with_lease_id(&lease_id)
        })
    }

    /// The attempts of [`Coordinator::acquire_visit`]: `lease_id` is the one it writes (a
    /// generated one is replaced when it ended), `landed` is set once an attempt may have landed.
    // `&lease_id` on the `&mut` binding: the body reads as it did when the id was a local.
    #[allow(clippy::too_many_arguments, clippy::needless_borrow)]
    async fn acquire_attempts(
        &self,
        key: &str,
        holder: &str,
        duration: Option<Duration>,
        opts: AcquireOptions,
        want: Option<Visit>,
        lease_id: &mut LeaseId,
        landed: &mut bool,
    ) -> Result<Lease> {
        let start = self.monotonic();
        self.check_acquire(key, holder, duration, &opts)?;
        // The work-state visit the key is believed to be in: the write keeps it (and is
        // refused if the key has moved on since).
        let mut visit = want.clone();
        let wait_deadline = start + opts.wait.unwrap_or_default();
        let mut deadline = wait_deadline.max(start + self.config.retry_budget);
        if let Some(d) = opts.deadline {
            deadline = deadline.min(d);
        }
        let mut wait = Waiting::new(&self.pacer, key, self.config.poll_max, start);
        // Waiting acquires of this coordinator line up per key: only the head tries, and a
        // release handled here wakes it at once (DESIGN.md, "In-process waiters").
        let mut ticket = (!opts.wait.unwrap_or_default().is_zero())
            .then(|| InLine { ticket: self.wakeups.enter(key), coord: self.clone() });
        if ticket.as_ref().is_some_and(|t| t.is_head()) {
            wait.courtesy(wait_deadline).await;
        }
        // The last fence seen on this key: the next one must be above it.
        let mut seen_fence: Option<u64> = None;
        loop {
            // Behind the head of this coordinator's line nothing is sent (one last attempt at
            // the deadline); the head polls as a fallback, since another process may free it.
            if let Some(t) = ticket.as_mut() {
                loop {
                    let now = self.monotonic();
                    if t.is_head() || now >= wait_deadline {
                        break;
                    }
                    // The offer counts once this waiter is head: the head may be granted the
                    // key by the release that frees it without having tried since.
                    let offer = Self::offer(holder, &lease_id, duration, &opts, wait.advertise());
                    let pause = self.config.poll_max.min(wait_deadline - now);
                    if let Some(lease) = self.handed(t.wait_offering(pause, offer, deadline).await)? {
                        wait.granted(lease.1);
                        t.granted = true;
                        return Ok(lease.0);
                    }
                    if t.departed() {
                        return Err(Error::StoreUnavailable(DEPARTED.into()));
                    }
                }
            }
            // The key was left free for a waiter of another process: this coordinator's waiters
            // let it have it (DESIGN.md, "In-process waiters": fairness across processes).
            if let Some(until) = ticket.as_ref().and(self.wakeups.held_back(key)) {
                tokio::time::sleep_until(until.min(wait_deadline).into()).await;
            }
            // Every attempt judges expiry with this clock: it must agree with the store's.
            self.check_clock(key).await?;
            wait.attempts += 1;
            let new = |now: u64, fence: u64| NewLease {
                holder: holder.to_string(),
                lease_id: lease_id.clone(),
                now_ms: now,
                duration_ms: duration.map(|d| d.as_millis() as u64),
                min_hold_ms: opts.min_hold.unwrap_or_default().as_millis() as u64,
                metadata: opts.metadata.clone(),
                keepalive: opts.keepalive.clone(),
                // A key in a work state is kept until it is taken: no TTL.
                ttl: duration.filter(|_| visit.is_none()).map(|d| self.ttl_after(now + d.as_millis() as u64)),
                fence,
                poll_ms: wait.advertise(),
                visit: visit.as_ref().map(|v| Visit { attempts: v.attempts.saturating_add(1), ..v.clone() }),
                handed_in: None,
                released: None,
            };
            let mut fence = 0;
            let (w, sent, now) = self
                .write_noting(
                    key,
                    deadline,
                    Some(&lease_id),
                    |now| {
                        fence = self.next_fence(key, seen_fence)?;
                        let cond = match &visit {
                            None => Condition::Free { now_ms: now, fence, lease_id: lease_id.clone() },
                            Some(v) => {
                                Condition::FreeIn { now_ms: now, fence, lease_id: lease_id.clone(), visit: v.clone() }
                            }
                        };
                        Ok((cond, Mutation::Acquire(new(now, fence))))
                    },
                    landed,
                )
                .await
                .map_err(|f| f.into_error(key))?;
            if want.is_some() && matches!(w, Write::Rejected(None)) {
                return Err(Error::NotFound { key: key.to_string() });
            }
            match sort_acquire(w, &lease_id, fence, now, visit.as_ref())? {
                AcquireAnswer::Granted(r) => {
                    check_fence(&r)?;
                    let advertised = r.poll_ms;
                    let lease = r.lease(sent, now, self.skew_ms());
                    if lease.safe_until.is_none_or(|t| t > self.monotonic()) {
                        wait.granted(advertised);
                        if let Some(t) = ticket.as_mut() {
                            t.granted = true;
                        }
                        return Ok(lease);
                    }
                    // Granted, but the answer came after the lease's safe time (a stalled
                    // request): useless to the holder. Free the key again, and take it anew
                    // with a new lease_id (a lease_id is single-use) if ours was generated.
                    self.drop_late_grant(key, &lease_id).await;
                    if opts.lease_id.is_some() || self.monotonic() >= deadline {
                        return Err(Error::StoreUnavailable(
                            "the store answered after the granted lease's safe time had passed; the late grant was \
                             released"
                                .into(),
                        ));
                    }
                    *lease_id = LeaseId::generate();
                    *landed = false;
                    tokio::time::sleep(jitter(self.config.retry_base).min(deadline - self.monotonic())).await;
                }
                // Free, but its last fence is not below ours (a coordinator whose clock runs
                // ahead, a force-release, or µs collisions): go again just above it, paced
                // if it happens again.
                AcquireAnswer::Above(r) => {
                    if seen_fence.is_some() {
                        tokio::time::sleep(jitter(self.config.retry_base)).await;
                    }
                    seen_fence = Some(r.fence);
                    visit = self.revisit(key, &r, want.as_ref())?;
                    if self.monotonic() >= deadline {
                        return Err(Error::StoreUnavailable(format!("{key:?} kept changing hands until the deadline")));
                    }
                }
                // Free, but in another work-state visit than the one written under (a key in
                // a state, or one that moved on): go again keeping the visit it is in.
                AcquireAnswer::Moved(r) => {
                    visit = self.revisit(key, &r, want.as_ref())?;
                    if self.monotonic() >= deadline {
                        return Err(Error::StoreUnavailable(format!("{key:?} kept changing state until the deadline")));
                    }
                }
                // Our lease_id's lease already ended on this key: a lease_id is single-use. A
                // generated one (our own earlier attempt, expired before we heard of it) is
                // replaced; a caller's is refused.
                AcquireAnswer::Ended(reason) => {
                    if opts.lease_id.is_some() || self.monotonic() >= deadline {
                        return Err(Error::NotHolder { key: key.to_string(), reason });
                    }
                    *lease_id = LeaseId::generate();
                    *landed = false;
                }
                AcquireAnswer::Held(r) => {
                    // A free key kept for its queued waiters has no expiry to wake up for: the
                    // paced poll alone (not a tight loop on an expiry already past).
                    let queued = (r.queue_len() > 0 || r.pending_token.is_some()) && !r.is_held(self.now_ms());
                    let until_expiry = r
                        .expires_at_ms
                        .filter(|_| !queued)
                        .map(|e| Duration::from_millis(e.saturating_sub(self.now_ms()) + 1));
                    let pause = wait.held(r.fence, r.poll_ms, until_expiry, wait_deadline);
                    // The key went to another coordinator's in-process line while this acquire
                    // waited: it says so on the item, and that coordinator's next release leaves
                    // the key free for it instead of handing it over again.
                    // The mark is written within the pause (best effort), so that the acquire
                    // still ends by its deadline.
                    let until = pause.map(|p| self.monotonic() + p);
                    if let Some(until) = until.filter(|_| wait.missed_turn() && self.turn_elsewhere(&r)) {
                        let _ = tokio::time::timeout_at(until.into(), self.waits_in(key, r.fence)).await;
                    }
                    match until.map(|u| u.saturating_duration_since(self.monotonic())) {
                        Some(pause) => match ticket.as_mut() {
                            Some(t) => {
                                // Asleep, this waiter offers its lease to this coordinator's
                                // releases: one of them may grant it in its own write.
                                let offer = Self::offer(holder, &lease_id, duration, &opts, wait.advertise());
                                if let Some(lease) = self.handed(t.wait_offering(pause, offer, deadline).await)? {
                                    wait.granted(lease.1);
                                    t.granted = true;
                                    return Ok(lease.0);
                                }
                                // The deadline came while a release was writing this waiter's
                                // grant: it left (a grant that lands is given back), and tries
                                // nothing more (its own attempt could find that grant).
                                if t.departed() {
                                    let (holder, expires_at_ms) = (r.holder, r.expires_at_ms);
                                    return Err(Error::LeaseHeld { key: key.to_string(), holder, expires_at_ms });
                                }
                            }
                            None => tokio::time::sleep(pause).await,
                        },
                        None => {
                            return Err(Error::LeaseHeld {
                                key: key.to_string(),
                                holder: r.holder,
                                expires_at_ms: r.expires_at_ms,
                            })
                        }
                    }
                }
            }
        }
    }

    /// What a sleeping waiter offers to this coordinator's releases (DESIGN.md, "In-process
    /// waiters"): its lease, fence and clock left to the releaser.
    fn offer(
        holder: &str,
        lease_id: &LeaseId,
        duration: Option<Duration>,
        opts: &AcquireOptions,
        poll_ms: Option<u64>,
    ) -> crate::wakeup::Offer {
        crate::wakeup::Offer {
            lease: NewLease {
                holder: holder.to_string(),
                lease_id: lease_id.clone(),
                now_ms: 0,
                duration_ms: duration.map(|d| d.as_millis() as u64),
                min_hold_ms: opts.min_hold.unwrap_or_default().as_millis() as u64,
                metadata: opts.metadata.clone(),
                keepalive: opts.keepalive.clone(),
                ttl: None,
                fence: 0,
                poll_ms,
                visit: None,
                handed_in: None,
                released: None,
            },
        }
    }

    /// A grant a release handed to this waiter: the lease and the item's advertised poll
    /// period, unless it came too late to use (then it is the key's lease still, and the
    /// waiter's next attempt finds it and drops it).
    fn handed(&self, grant: Option<(Record, Instant, u64)>) -> Result<Option<(Lease, Option<u64>)>> {
        let Some((g, sent, now)) = grant else { return Ok(None) };
        check_fence(&g)?;
        let lease = g.lease(sent, now, self.skew_ms());
        Ok(lease.safe_until.is_none_or(|s| s > self.monotonic()).then_some((lease, g.poll_ms)))
    }

    /// Releases a grant that arrived too late to be used, so the key does not stay blocked for
    /// the rest of its duration. Best effort: if it fails, the grant expires on its own.
    async fn drop_late_grant(&self, key: &str, lease_id: &LeaseId) {
        if let Err(e) = self.release(key, lease_id).await {
            tracing::warn!(key, error = e.name(), "could not release a late grant; it expires on its own");
        }
    }

    /// Extends a live lease by `duration` (default: the lease's own duration) from now.
    pub async fn heartbeat(&self, key: &str, lease_id: &LeaseId, duration: Option<Duration>) -> Result<Lease> {
        let deadline = self.monotonic() + self.config.retry_budget;
        self.heartbeat_until(key, lease_id, duration, deadline).await
    }

    /// [`Coordinator::heartbeat`], retrying transient failures until `deadline`. The expiry
    /// never moves backwards: a delayed duplicate of an earlier try, or a request for less
    /// time than the lease has left, leaves the lease as it is and answers with it.
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
        self.check_clock(key).await?;
        let duration_ms = duration.map(|d| d.as_millis() as u64);
        let max = self.max_duration_ms();
        let (w, sent, now) = self
            .write(key, deadline, |now| {
                let cond = Condition::Renew {
                    lease_id: lease_id.clone(),
                    now_ms: now,
                    expires_at_ms: duration_ms.map(|d| now + d),
                };
                let ttl = Some(self.ttl_after(now + duration_ms.unwrap_or(max)));
                Ok((cond, Mutation::Extend { now_ms: now, duration_ms, ttl }))
            })
            .await
            .map_err(|f| f.into_error(key))?;
        match w {
            Write::Applied(r) => {
                check_fence(&r)?;
                // A key in a work state keeps no TTL. The renewal has landed: the removal gets
                // one try of at most 1 s (and never past the heartbeat's deadline) before the
                // answer, and any retries run after it, so a slow store cannot hold a landed
                // renewal back past the holder's safe time.
                if r.state.is_some() && r.ttl.is_some() {
                    let bound = deadline.min(self.monotonic() + Duration::from_secs(1));
                    let cond = Condition::FenceIs(r.fence);
                    let once = self.store.update(key, &cond, &Mutation::ClearTtl);
                    if !matches!(tokio::time::timeout_at(bound.into(), once).await, Ok(Ok(_))) {
                        let (c, k, r) = (self.clone(), key.to_string(), r.clone());
                        tokio::spawn(async move { c.keep_queued(&k, &r).await });
                    }
                }
                Ok(r.lease(sent, now, self.skew_ms()))
            }
            // Still ours, but not extended: a fail-closed lease (nothing to extend), a later
            // renewal already landed, or the new expiry would be earlier. The lease as it is.
            Write::Rejected(Some(r)) if r.is_live_for(lease_id, now) => {
                check_fence(&r)?;
                Ok(r.lease(sent, now, self.skew_ms()))
            }
            Write::Rejected(r) => Err(self.not_holder(key, lease_id, r.as_ref(), now)),
        }
    }

    fn not_holder(&self, key: &str, lease_id: &LeaseId, r: Option<&Record>, now: u64) -> Error {
        let reason = match r {
            None => Reason::Missing,
            Some(r) => ended_reason(r, lease_id, now).unwrap_or(Reason::Expired),
        };
        Error::NotHolder { key: key.to_string(), reason }
    }

    /// Releases the lease. Idempotent: releasing a released lease (a retry after a lost
    /// answer, or a stale release after a force-release) changes nothing and answers with
    /// `already_released`.
    pub async fn release(&self, key: &str, lease_id: &LeaseId) -> Result<Released> {
        self.release_to(key, lease_id, None).await
    }

    /// [`Coordinator::release`], moving the key into work state `state` in the same write
    /// (only while the lease is live). `None` keeps the key's state.
    pub async fn release_to(&self, key: &str, lease_id: &LeaseId, state: Option<&str>) -> Result<Released> {
        self.config.limits.key(key)?;
        if let Some(s) = state {
            crate::batch::check_state(s)?;
        }
        // A head waiter of this coordinator sleeping on the key: hand it over in this write
        // (not when the key moves to a work state: the hand-over writes a lease in none).
        // A hand-over whose write failed ambiguously stays claimed (its waiter keeps waiting)
        // until the ordinary release below settles whether it landed.
        let mut unsettled = None;
        if let Some(claim) = state.is_none().then(|| self.wakeups.claim(key)).flatten() {
            match self.release_to_waiter(key, lease_id, claim).await {
                ToWaiter::Done(released) => return Ok(released),
                ToWaiter::NotDone => {}
                ToWaiter::Unsettled(u) => unsettled = Some(u),
            }
        }
        // A coordinator that serves queues releases in this write only a key without queued
        // waiters; with waiters, the release grants the head waiter in a write of its own
        // making (DESIGN.md, "The waiter queue": hand-over).
        let mut hand_over = state.is_none() && self.deliver.is_some();
        let max = self.max_duration_ms();
        loop {
            let deadline = self.monotonic() + self.config.retry_budget;
            let (w, _, now) = self
                .write(key, deadline, |now| {
                    let ttl = self.ttl_after(now + max);
                    let lease_id = lease_id.clone();
                    Ok(match state {
                        None if hand_over => (Condition::Unqueued { lease_id }, Mutation::Release { now_ms: now, ttl }),
                        None => (Condition::Unreleased { lease_id }, Mutation::Release { now_ms: now, ttl }),
                        Some(s) => (
                            Condition::Live { lease_id, now_ms: now },
                            Mutation::ReleaseTo { now_ms: now, state: s.to_string(), shard: self.state_shard(key, s) },
                        ),
                    })
                })
                .await
                .map_err(|f| f.into_error(key))?;
            let released = |r: &Record, already_released| Released {
                key: key.to_string(),
                fence: r.fence,
                released_at_ms: r.released_at_ms.unwrap_or(now),
                free_at_ms: r.expires_at_ms.unwrap_or(now).max(now),
                already_released,
                state: r.state.clone(),
            };
            match w {
                // The ambiguous hand-over did land: the key is the waiter's, and this release
                // is done.
                Write::Rejected(Some(r))
                    if unsettled.as_ref().is_some_and(|u| u.claim.offer().lease.lease_id == r.lease_id) =>
                {
                    let u = unsettled.take().expect("unsettled");
                    self.settle_grant(key, u.claim, r, u.sent, u.now).await;
                    return Ok(u.released);
                }
                Write::Applied(r) => {
                    // This release landed, so the ambiguous hand-over never can (its condition
                    // needs the lease unreleased): its waiter tries by itself.
                    drop(unsettled.take());
                    self.keep_queued(key, &r).await;
                    self.freed(key, &r);
                    self.hand_over_after_free(key, &r).await;
                    return Ok(released(&r, false));
                }
                Write::Rejected(Some(r))
                    if hand_over && &r.lease_id == lease_id && r.released_at_ms.is_none() && r.queue_len() > 0 =>
                {
                    if let Some(done) = self.release_handing_over(key, lease_id, &r).await? {
                        return Ok(done);
                    }
                    // Not done (the head waiter is not ready to take it, or the item moved on):
                    // the ordinary release, then the queue is served after it.
                    hand_over = false;
                }
                Write::Rejected(Some(r)) if &r.lease_id == lease_id && r.released_at_ms.is_some() => {
                    return Ok(released(&r, true))
                }
                // Released by a hand-over that granted the key on in the same write (or right
                // after): the grant keeps the released lease's id and fence.
                Write::Rejected(Some(r)) if r.released_lease_id.as_ref() == Some(lease_id) => {
                    return Ok(Released {
                        key: key.to_string(),
                        fence: r.released_fence.unwrap_or(r.fence),
                        released_at_ms: r.acquired_at_ms,
                        free_at_ms: r.acquired_at_ms,
                        already_released: true,
                        state: r.state.clone(),
                    })
                }
                Write::Rejected(r) => return Err(self.not_holder(key, lease_id, r.as_ref(), now)),
            }
        }
    }

    /// How long this coordinator's waiters hold back after leaving a key free for a waiter of
    /// another process: well over that waiter's longest pause between polls (`poll_max`, up
    /// to 1.5 times with jitter; coordinators of one table are assumed to share `poll_max`), so
    /// that a loaded machine's late poll still finds the key free.
    fn yield_for(&self) -> Duration {
        self.config.poll_max * 3
    }

    /// The key is free after this coordinator's release of item `r`: the head of its line tries
    /// at once, unless a waiter of another process marked the item (it missed a turn to this
    /// coordinator's line) and this coordinator has waiters that would win the race: they hold
    /// back while it polls.
    fn freed(&self, key: &str, r: &Record) {
        if r.handed_in.as_deref().is_some_and(|c| c != &*self.id) && self.wakeups.waiting(key) > 0 {
            self.wakeups.hold_back(key, self.yield_for());
        } else {
            self.wakeups.wake(key);
        }
    }

    /// Did the lease on item `r` come from the in-process line of another coordinator (and
    /// nobody marked it yet)?
    fn turn_elsewhere(&self, r: &Record) -> bool {
        r.handed_in.as_deref().is_some_and(|c| c != &*self.id) && r.is_held(self.now_ms())
    }

    /// Marks the lease of fence `fence` on `key`: a waiter of this coordinator missed a turn to
    /// another coordinator's line. Best effort (one write; a lost mark is written again at the
    /// next missed turn).
    async fn waits_in(&self, key: &str, fence: u64) {
        let m = Mutation::WaitsIn { coordinator: self.id.to_string() };
        if let Err(e) = self.store.update(key, &Condition::FenceIs(fence), &m).await {
            tracing::debug!(key, error = e.name(), "could not mark the key as awaited elsewhere");
        }
    }

    /// The release of `lease_id` as one write that grants the key to the claimed in-process
    /// waiter (DESIGN.md, "In-process waiters"). `None`: not done (the claim is dropped and the
    /// waiter tries by itself); the ordinary release follows.
    async fn release_to_waiter(&self, key: &str, lease_id: &LeaseId, claim: crate::wakeup::Claim) -> ToWaiter {
        use ToWaiter::NotDone;
        if self.check_clock(key).await.is_err() {
            return NotDone;
        }
        let Ok(Some(r)) = self.store.get(key).await else { return NotDone };
        let sent = self.monotonic();
        let now = self.now_ms();
        if &r.lease_id != lease_id || r.released_at_ms.is_some() || r.min_hold_until_ms > now || r.queue_len() > 0 {
            return NotDone;
        }
        // A lease_id is single-use: a waiter offering the very lease_id being released (two
        // acquires with one caller id) must not be granted it again.
        if &claim.offer().lease.lease_id == lease_id {
            return NotDone;
        }
        // A waiter of another process missed a turn to this coordinator's line: the key goes
        // free for it, and this coordinator's waiters hold back while it polls.
        if r.handed_in.as_deref().is_some_and(|c| c != &*self.id) {
            self.wakeups.hold_back(key, self.yield_for());
            return NotDone;
        }
        let mut lease = claim.offer().lease.clone();
        lease.now_ms = now;
        lease.handed_in = Some(self.id.to_string());
        let Ok(fence) = self.next_fence(key, Some(r.fence)) else { return NotDone };
        lease.fence = fence;
        lease.ttl = lease.duration_ms.map(|d| self.ttl_after(now + d));
        // A retried release of the releasing lease answers `already_released` (not
        // `wrong_lease_id`): the grant keeps its id and fence.
        lease.released = Some((lease_id.clone(), r.fence));
        let cond = Condition::HandTo { lease_id: lease_id.clone(), fence: r.fence, now_ms: now };
        let released = Released {
            key: key.to_string(),
            fence: r.fence,
            released_at_ms: now,
            free_at_ms: now,
            already_released: false,
            state: None,
        };
        let waiter = lease.lease_id.clone();
        match self.store.update(key, &cond, &Mutation::Acquire(lease)).await {
            Ok(Write::Applied(g)) => {
                self.settle_grant(key, claim, g, sent, now).await;
                ToWaiter::Done(released)
            }
            // The grant may have landed, or may still land (a request stuck in the network): if
            // the read shows it, it is the waiter's and this release is done; otherwise the claim
            // stays (its waiter keeps waiting) until the ordinary release settles it.
            Err(e) if e.may_have_landed() => match self.store.get(key).await {
                Ok(Some(g)) if g.lease_id == waiter && g.is_live_for(&waiter, self.now_ms()) => {
                    self.settle_grant(key, claim, g, sent, now).await;
                    ToWaiter::Done(released)
                }
                _ => ToWaiter::Unsettled(Box::new(Unsettled { claim, sent, now, released })),
            },
            _ => NotDone,
        }
    }

    /// Hands a grant that landed to its claimed waiter; if the waiter left while the grant was
    /// being written, the grant is nobody's and is released at once.
    async fn settle_grant(&self, key: &str, claim: crate::wakeup::Claim, g: Record, sent: Instant, now: u64) {
        if let Err(lease_id) = claim.granted(g, sent, now) {
            self.release_departed(key, &lease_id).await;
        }
    }

    /// Operator release: frees the key at once whoever holds it (min_hold ignored) and
    /// advances the fence, so the evicted holder's fence is below any later one.
    pub async fn force_release(&self, key: &str) -> Result<LeaseState> {
        self.config.limits.key(key)?;
        let deadline = self.monotonic() + self.config.retry_budget;
        let max = self.max_duration_ms();
        let (w, _, now) = self
            .write(key, deadline, |now| {
                Ok((Condition::Exists, Mutation::ForceRelease { now_ms: now, ttl: self.ttl_after(now + max) }))
            })
            .await
            .map_err(|f| f.into_error(key))?;
        match w {
            Write::Applied(r) => {
                self.keep_queued(key, &r).await;
                self.wakeups.wake(key);
                self.hand_over_after_free(key, &r).await;
                Ok(r.state(now))
            }
            Write::Rejected(_) => Err(Error::NotFound { key: key.to_string() }),
        }
    }

    /// The public state of `key` (never the lease_id).
    pub async fn get(&self, key: &str) -> Result<LeaseState> {
        self.config.limits.key(key)?;
        let deadline = self.monotonic() + self.config.retry_budget;
        match self.read(deadline, || self.store.get(key)).await? {
            Some(r) => Ok(r.state(self.now_ms())),
            None => Err(Error::NotFound { key: key.to_string() }),
        }
    }

    /// Keys held right now, at most `limit` of them, in the store's order.
    pub async fn list(&self, limit: usize) -> Result<Vec<LeaseState>> {
        self.list_prefix("", limit).await
    }

    /// Keys held right now that start with `prefix`, at most `limit` of them, in the store's
    /// order. The filter runs over the full scan (an operator listing, not a hot path).
    pub async fn list_prefix(&self, prefix: &str, limit: usize) -> Result<Vec<LeaseState>> {
        let mut out = Vec::new();
        let mut start: Option<String> = None;
        loop {
            let deadline = self.monotonic() + self.config.retry_budget;
            let page = self.read(deadline, || self.store.scan(&ScanKind::All, start.as_deref(), 100)).await?;
            let now = self.now_ms();
            out.extend(page.items.iter().filter(|r| r.is_held(now) && r.key.starts_with(prefix)).map(|r| r.state(now)));
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

/// The end of a waiter whose deadline came while a release was writing its grant.
const DEPARTED: &str =
    "the acquire's deadline passed while a release was handing it the key; the hand-over is given back";

/// What became of a release's hand-over to its in-process waiter.
enum ToWaiter {
    /// The waiter has the key; the release is done.
    Done(Released),
    /// Nothing was granted: the claim is dropped (the waiter tries by itself).
    NotDone,
    /// The grant's write failed ambiguously: it may land yet. The claim is kept until the
    /// ordinary release's answer says whether it did.
    Unsettled(Box<Unsettled>),
}

struct Unsettled {
    claim: crate::wakeup::Claim,
    sent: Instant,
    now: u64,
    released: Released,
}

/// A waiting acquire's place in its coordinator's line. When the acquire's future is dropped
/// (a timeout, a disconnected HTTP client, a deadline), the waiter departs: a release writing
/// its grant right now gives the grant back, and a grant that landed but was never read is
/// released here (DESIGN.md, "Cancellation").
struct InLine {
    ticket: crate::wakeup::Ticket,
    coord: Coordinator,
}

impl std::ops::Deref for InLine {
    type Target = crate::wakeup::Ticket;
    fn deref(&self) -> &Self::Target {
        &self.ticket
    }
}

impl std::ops::DerefMut for InLine {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.ticket
    }
}

impl Drop for InLine {
    fn drop(&mut self) {
        let Some((r, _, _)) = self.ticket.depart() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                let coord = self.coord.clone();
                rt.spawn(async move { coord.release_departed(&r.key, &r.lease_id).await });
            }
            Err(_) => tracing::warn!(key = %r.key, "a grant left unread by a departed acquire expires on its own"),
        }
    }
}

/// A write that did not get an answer in time.
pub(crate) struct Failed {
    error: Error,
    /// Some attempt may have landed (its answer was lost or it timed out).
    maybe_landed: bool,
}

impl Failed {
    /// The error to report. A write that may have landed is `OutcomeUnknown`: the caller's
    /// lease_id reaches what it did (an acquire's retry returns the lease and a release frees
    /// it; a release's retry answers `already_released`).
    pub(crate) fn into_error(self, key: &str) -> Error {
        match self.error {
            // A throttled end after an attempt that timed out is no less unknown.
            e @ (Error::StoreUnavailable(_) | Error::Throttled(_)) if self.maybe_landed => Error::outcome_unknown(
                key,
                format!(
                    "{e}; a write may have landed: send the same request again with the same lease_id (it is \
                     idempotent), or release with it"
                ),
            ),
            e => e,
        }
    }
}

/// What one acquire attempt's answer means.
enum AcquireAnswer {
    /// The lease is ours: this attempt's, or an earlier one of the same lease_id that landed.
    Granted(Record),
    /// The key is free but its last fence is not below ours: go again above this one.
    Above(Record),
    /// The key is free but not in the work-state visit the write was made under.
    Moved(Record),
    /// Our lease_id's lease already ended on this key (released or expired): never again.
    Ended(Reason),
    /// Another lease holds the key.
    Held(Record),
}

fn sort_acquire(w: Write, lease_id: &LeaseId, fence: u64, now: u64, visit: Option<&Visit>) -> Result<AcquireAnswer> {
    Ok(match w {
        Write::Applied(r) => AcquireAnswer::Granted(r),
        Write::Rejected(Some(r)) if r.is_live_for(lease_id, now) => AcquireAnswer::Granted(r),
        Write::Rejected(Some(r)) => match ended_reason(&r, lease_id, now) {
            Some(reason) if reason != Reason::WrongLeaseId => AcquireAnswer::Ended(reason),
            _ if !r.is_held(now) && r.fence >= fence => AcquireAnswer::Above(r),
            _ if !r.is_held(now) && !crate::batch::in_visit(&r, visit) => AcquireAnswer::Moved(r),
            _ => AcquireAnswer::Held(r),
        },
        Write::Rejected(None) => {
            return Err(Error::StoreUnavailable("store rejected a write on a missing item".into()));
        }
    })
}

/// Why the lease `lease_id` is not live on item `r` (`None` when it is).
fn ended_reason(r: &Record, lease_id: &LeaseId, now: u64) -> Option<Reason> {
    if &r.lease_id != lease_id {
        Some(Reason::WrongLeaseId)
    } else if r.released_at_ms.is_some() {
        Some(Reason::Released)
    } else if !r.is_held(now) {
        Some(Reason::Expired)
    } else {
        None
    }
}

fn check_fence(r: &Record) -> Result<()> {
    if r.fence > MAX_FENCE {
        return Err(Error::StoreUnavailable(format!("fence of {:?} passed 2^53; the key must be retired", r.key)));
    }
    Ok(())
}
