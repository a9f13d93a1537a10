//! Acquire: the attempts of one acquire call (DESIGN.md, "Acquire").
//!
//! [`Coordinator::acquire_attempts`] is the loop: wait for a turn in this coordinator's line,
//! check the clock, send one conditional write, and act on what its answer means
//! ([`AcquireAnswer`], sorted in `decide.rs`). Each answer has a function of its own here that
//! says whether the call is done or goes round again.

use super::retry::Lapse;
use super::*;

/// What an acquire asks for.
pub(crate) struct Ask<'a> {
    pub(crate) key: &'a str,
    pub(crate) holder: &'a str,
    pub(crate) duration: Option<Duration>,
    pub(crate) opts: &'a AcquireOptions,
    /// The work-state visit the state index showed (a batch lease); `None` for a plain acquire.
    pub(crate) want: Option<&'a Visit>,
}

impl Ask<'_> {
    /// The lease this acquire writes, with the fence, clock, TTL and visit left to the attempt
    /// (or, in a hand-over, to the releaser).
    fn lease(&self, lease_id: &LeaseId, poll_ms: Option<u64>) -> NewLease {
        NewLease {
            min_hold_ms: self.opts.min_hold.unwrap_or_default().as_millis() as u64,
            metadata: self.opts.metadata.clone(),
            keepalive: self.opts.keepalive.clone(),
            poll_ms,
            ..NewLease::new(self.holder, lease_id.clone(), 0, self.duration.map(|d| d.as_millis() as u64), 0)
        }
    }
}

/// One acquire call's state across its attempts.
pub(crate) struct Attempts<'a> {
    ask: Ask<'a>,
    /// The lease_id written: a generated one is replaced when its lease ended.
    lease_id: &'a mut LeaseId,
    /// Set once an attempt may have landed (its answer was lost or it timed out).
    landed: &'a mut bool,
    /// A timed lease under a generated lease_id: once the first attempt of it that may have
    /// landed has expired, the lease_id is replaced ([`Lapse`]). A keep-alive lease keeps its id: the
    /// sweep may be renewing the grant that landed.
    lapse: Option<Lapse>,
    /// The work-state visit the key is believed to be in: the write keeps it (and is refused
    /// if the key has moved on since).
    visit: Option<Visit>,
    /// The last fence seen on this key: the next one must be above it.
    seen_fence: Option<u64>,
    /// The next attempt is made on a key seen freed by a clock ahead of this one ([`Freed`]).
    freed: Option<Freed>,
    /// The fence floor of the last item an attempt was pinned to: once per item.
    pinned: Option<u64>,
    /// The end of the caller's wait, and of the whole call (the wait, or the retry budget,
    /// or the caller's deadline).
    wait_deadline: Instant,
    deadline: Instant,
    wait: Waiting<'a>,
    /// This call's place in this coordinator's line of waiters on the key (waiting calls only).
    ticket: Option<InLine>,
}

/// A key seen freed (released, or freed by a queue write) at `at_ms` by the clock of the
/// coordinator that freed it, with its expiry not after that: free by that clock, though
/// perhaps not yet by this one, which may be further behind the store's (DESIGN.md, "Clocks":
/// a released key is free to every taker). The next attempt is made with a `:now` of at least
/// `at_ms`, and with its fence pinned just above the item's fence floor: every later grant on
/// the key has a fence above that floor, so the attempt can take this very item or nothing.
#[derive(Debug, Clone, Copy)]
struct Freed {
    floor: u64,
    at_ms: u64,
}

impl Freed {
    fn of(r: &Record) -> Option<Freed> {
        let at_ms = r.freed_by_stamp()?;
        let free = r.queue_len() == 0 && r.queue.pending_token.is_none();
        free.then(|| Freed { floor: r.fence_floor(), at_ms })
    }

    /// The attempt's clock: this coordinator's, or the freeing one's if that is later.
    fn now(self, now: u64) -> u64 {
        now.max(self.at_ms)
    }
}

impl Attempts<'_> {
    /// Makes the next attempt on the freed item `r` ([`Freed`]), once per item and before the
    /// call's deadline: `false` when it is not freed, was tried so already, or was freed at a
    /// stamp past `latest_ms` (what the store's clock can be now: a stamp beyond is a wrong
    /// clock's, never adopted), or the deadline has come.
    fn pin(&mut self, r: &Record, latest_ms: u64, now: Instant) -> bool {
        if now >= self.deadline {
            return false;
        }
        match Freed::of(r).filter(|f| self.pinned != Some(f.floor) && f.at_ms <= latest_ms) {
            Some(f) => {
                (self.pinned, self.freed) = (Some(f.floor), Some(f));
                true
            }
            None => false,
        }
    }

    /// Has this call left its line (its deadline came while a release was writing its grant)?
    fn departed(&self) -> bool {
        self.ticket.as_ref().is_some_and(|t| t.departed())
    }

    /// A lease_id is single-use: after its lease ended, a generated id is replaced, and what
    /// the old one may have done is no longer this call's business.
    fn new_lease_id(&mut self) {
        *self.lease_id = LeaseId::generate();
        *self.landed = false;
        if let Some(l) = self.lapse.as_mut() {
            l.until_ms = None;
        }
    }
}

/// The end of a waiter whose deadline came while a release was writing its grant.
const DEPARTED: &str =
    "the acquire's deadline passed while a release was handing it the key; the hand-over is given back";

/// After one answer: the call is done, or it goes round again.
// One per attempt, moved at once: boxing the lease would only add an allocation.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Next {
    Done(Lease),
    Again,
}

impl Coordinator {
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
        crate::validate::slots(opts.slots, duration.is_some(), opts.min_hold.is_some())?;
        if let Some(n) = opts.slots {
            crate::validate::slot_extras(n, opts.metadata.as_ref(), opts.keepalive.as_ref())?;
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

    /// Takes the lease on `key` for `duration` (`None`: a fail-closed lease, held until
    /// released; it needs a caller-chosen lease_id). One store request when the key is free.
    pub async fn acquire(
        &self,
        key: &str,
        holder: &str,
        duration: Option<Duration>,
        opts: AcquireOptions,
    ) -> Result<Lease> {
        if let (Some(2..), Some(d)) = (opts.slots, duration) {
            self.check_acquire(key, holder, duration, &opts)?;
            return self.acquire_slot(key, holder, d, &opts).await;
        }
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
        let ask = Ask { key, holder, duration, opts: &opts, want: want.as_ref() };
        let res = match self.begin(ask, &mut lease_id, &mut landed).await {
            Ok(mut attempts) => self.acquire_attempts(&mut attempts).await,
            Err(e) => Err(e),
        };
        // (A batch lease is written under the state visit the index showed, and every grant
        // counts an attempt of the visit: once another lease holds the key, a write of ours can
        // never land, so `LeaseHeld` stays what it is.)
        let batch = want.is_some();
        res.map_err(|e| {
            let open = matches!(e, Error::StoreUnavailable(_) | Error::Throttled(_) | Error::StoreRefused(_))
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

    /// Validates the request and sets up its attempts: deadlines, pacing, and (for a waiting
    /// call) a place in this coordinator's line for the key (DESIGN.md, "In-process waiters").
    async fn begin<'a>(
        &'a self,
        ask: Ask<'a>,
        lease_id: &'a mut LeaseId,
        landed: &'a mut bool,
    ) -> Result<Attempts<'a>> {
        let start = self.monotonic();
        self.check_acquire(ask.key, ask.holder, ask.duration, ask.opts)?;
        let wait_deadline = start + ask.opts.wait.unwrap_or_default();
        let mut deadline = wait_deadline.max(start + self.config.retry_budget);
        if let Some(d) = ask.opts.deadline {
            deadline = deadline.min(d);
        }
        let mut wait = Waiting::new(&self.pacer, ask.key, self.config.poll_max, self.config.poll_attempts, start);
        // Waiting acquires of this coordinator line up per key: only the head tries, and a
        // release handled here wakes it at once.
        let ticket = (!ask.opts.wait.unwrap_or_default().is_zero()).then(|| InLine {
            ticket: self.wakeups.enter(ask.key),
            coord: self.clone(),
            release_departed: ask.opts.lease_id.is_none(),
        });
        if ticket.as_ref().is_some_and(|t| t.is_head()) {
            wait.courtesy(wait_deadline).await;
        }
        let visit = ask.want.cloned();
        let generated = ask.opts.lease_id.is_none() && ask.opts.keepalive.is_none();
        let lapse = ask.duration.filter(|_| generated).map(|d| Lapse::new(d.as_millis() as u64));
        Ok(Attempts {
            ask,
            lease_id,
            landed,
            lapse,
            visit,
            seen_fence: None,
            freed: None,
            pinned: None,
            wait_deadline,
            deadline,
            wait,
            ticket,
        })
    }

    /// The loop of an acquire call: its turn, the clock check, one attempt, and what the
    /// answer means.
    pub(crate) async fn acquire_attempts(&self, a: &mut Attempts<'_>) -> Result<Lease> {
        loop {
            if let Some(lease) = self.await_turn(a).await? {
                return Ok(lease);
            }
            // The key was left free for a waiter of another process: this coordinator's waiters
            // let it have it (DESIGN.md, "In-process waiters": fairness across processes).
            if let Some(until) = a.ticket.as_ref().and(self.wakeups.held_back(a.ask.key)) {
                self.hold_back(a.ask.key, until.min(a.wait_deadline)).await;
            }
            // Every attempt judges expiry with this clock, checked against the store's by the
            // write itself, right before it is sent (`write_noting`).
            a.wait.attempts += 1;
            let (answer, sent, now) = self.attempt(a).await?;
            let next = match answer {
                AcquireAnswer::Granted(r) => self.on_granted(a, r, sent, now).await?,
                AcquireAnswer::Above(r) => self.on_above(a, r).await?,
                AcquireAnswer::Early(r) => self.on_early(a, r, now).await?,
                AcquireAnswer::Moved(r) => self.on_moved(a, r)?,
                AcquireAnswer::Ended(reason) => self.on_ended(a, reason)?,
                AcquireAnswer::Held(r) => self.on_held(a, r).await?,
                AcquireAnswer::Lapsed => Next::Again,
            };
            if let Next::Done(lease) = next {
                return Ok(lease);
            }
        }
    }

    /// Behind the head of this coordinator's line nothing is sent (one last attempt at the
    /// wait's end); the head polls as a fallback, since another process may free the key.
    /// Asleep in line, the waiter may be handed the key by a release of this coordinator.
    async fn await_turn(&self, a: &mut Attempts<'_>) -> Result<Option<Lease>> {
        while let Some(t) = a.ticket.as_ref() {
            let now = self.monotonic();
            if t.is_head() || now >= a.wait_deadline {
                break;
            }
            // The offer counts once this waiter is head: the head may be granted the key by
            // the release that frees it without having tried since.
            let pause = self.config.poll_max.min(a.wait_deadline - now);
            if let Some(lease) = self.sleep_offering(a, pause).await? {
                return Ok(Some(lease));
            }
            if a.departed() {
                return Err(Error::StoreUnavailable(DEPARTED.into()));
            }
        }
        Ok(None)
    }

    /// Sleeps `pause`. A waiter in this coordinator's line sleeps offering its lease to this
    /// coordinator's releases: one of them may grant it in its own write.
    async fn sleep_offering(&self, a: &mut Attempts<'_>, pause: Duration) -> Result<Option<Lease>> {
        let Some(t) = a.ticket.as_mut() else {
            tokio::time::sleep(pause).await;
            return Ok(None);
        };
        let offer = Offer { lease: a.ask.lease(a.lease_id, a.wait.advertise()) };
        match self.handed(t.wait_offering(pause, offer, a.deadline).await)? {
            Some((lease, poll_ms)) => {
                a.wait.granted(poll_ms);
                t.granted = true;
                Ok(Some(lease))
            }
            None => Ok(None),
        }
    }

    /// One conditional write of the lease: free (in the visit believed), at a fence above the
    /// last one seen. The answer sorted ([`sort_acquire`]), with when it was sent and the clock.
    async fn attempt(&self, a: &mut Attempts<'_>) -> Result<(AcquireAnswer, Instant, u64)> {
        let key = a.ask.key;
        // An attempt of the lease_id that may have landed has expired unanswered: sent again, it
        // could be granted a second time, so a new one is generated ([`Lapse`]).
        if a.lapse.is_some_and(|l| l.lapsed(self.now_ms())) {
            a.new_lease_id();
        }
        let template = a.ask.lease(a.lease_id, a.wait.advertise());
        if let Some(d) = template.duration_ms {
            self.settle_margin(key, d, a.deadline).await;
        }
        let (lease_id, visit, seen, freed) = (&*a.lease_id, &a.visit, a.seen_fence, a.freed.take());
        // A grant whose caller left is given back only under a lease_id generated here: a
        // caller's own lease_id stays the caller's to send again or release (a retry of it is
        // answered with this very lease, which a departed attempt's release would end under it).
        let departed_release = a.ask.opts.lease_id.is_none().then_some(lease_id);
        let mut fence = 0;
        let (w, sent, now) = match self
            .write_noting(
                key,
                a.deadline,
                departed_release,
                |now| {
                    let now = freed.map_or(now, |f| f.now(now));
                    fence = match freed {
                        // Checked as any fence above the item's would be, then pinned to it.
                        Some(f) => self.next_fence(key, Some(f.floor)).map(|_| f.floor + 1)?,
                        None => self.next_fence(key, seen)?,
                    };
                    let cond = match visit {
                        // Fail-closed: never on a key released after this attempt's clock.
                        None if template.duration_ms.is_none() => Condition::Lease(LeaseCondition::FreeAfter {
                            now_ms: now,
                            fence,
                            lease_id: lease_id.clone(),
                        }),
                        None => {
                            Condition::Lease(LeaseCondition::Free { now_ms: now, fence, lease_id: lease_id.clone() })
                        }
                        Some(v) => Condition::Work(WorkCondition::FreeIn {
                            now_ms: now,
                            fence,
                            lease_id: lease_id.clone(),
                            visit: v.clone(),
                        }),
                    };
                    let lease = NewLease {
                        now_ms: now,
                        // A key in a work state is kept until it is taken: no TTL; one in a
                        // terminal state keeps a TTL (a lease's, as a key in no state).
                        ttl: template
                            .duration_ms
                            .filter(|_| visit.as_ref().is_none_or(|v| self.is_terminal(&v.state)))
                            .map(|d| self.ttl_after(now + d)),
                        fence,
                        visit: visit.as_ref().map(|v| Visit { attempts: v.attempts.saturating_add(1), ..v.clone() }),
                        ..template.clone()
                    };
                    Ok((cond, Mutation::Lease(LeaseMutation::Acquire(lease))))
                },
                a.landed,
                a.lapse.as_mut(),
            )
            .await
        {
            Ok(answer) => answer,
            Err(f) if f.lapsed => {
                a.new_lease_id();
                return Ok((AcquireAnswer::Lapsed, self.monotonic(), self.now_ms()));
            }
            Err(f) => return Err(f.into_error(key)),
        };
        if a.ask.want.is_some() && matches!(w, Write::Rejected(None)) {
            return Err(Error::NotFound { key: key.to_string() });
        }
        let now = freed.map_or(now, |f| f.now(now));
        let after = visit.is_none() && template.duration_ms.is_none();
        Ok((sort_acquire(w, lease_id, fence, now, visit.as_ref(), after)?, sent, now))
    }

    /// The lease is ours, and usable unless the answer came after its safe time (a slow answer,
    /// or a safe margin nearly as long as the lease): then it is renewed in place, its safe time
    /// counted from the renewal; failing that (it expired, or the renewal came late too), the
    /// key is freed again and taken anew with a new lease_id (a lease_id is single-use) if ours
    /// was generated.
    async fn on_granted(&self, a: &mut Attempts<'_>, r: Record, sent: Instant, now: u64) -> Result<Next> {
        check_fence(&r)?;
        let advertised = r.poll_ms;
        let mut lease = r.lease(sent, now, self.safe_margin(sent, now));
        if lease.safe_until.is_some_and(|t| t <= self.monotonic()) {
            if let Some(renewed) = self.renew_late_grant(&lease, a.deadline).await {
                lease = renewed;
            }
        }
        if lease.safe_until.is_none_or(|t| t > self.monotonic()) {
            a.wait.granted(advertised);
            if let Some(t) = a.ticket.as_mut() {
                t.granted = true;
            }
            return Ok(Next::Done(lease));
        }
        self.drop_late_grant(a.ask.key, a.lease_id, a.deadline).await;
        if a.ask.opts.lease_id.is_some() || self.monotonic() >= a.deadline {
            return Err(Error::StoreUnavailable(
                "the store answered after the granted lease's safe time had passed; the late grant was released".into(),
            ));
        }
        a.new_lease_id();
        tokio::time::sleep(jitter(self.config.retry_base).min(a.deadline - self.monotonic())).await;
        Ok(Next::Again)
    }

    /// Free, but its last fence is not below ours (a coordinator whose clock runs ahead, a
    /// force-release, or µs collisions): go again just above it, paced if it happens again.
    async fn on_above(&self, a: &mut Attempts<'_>, r: Record) -> Result<Next> {
        if a.seen_fence.is_some() {
            tokio::time::sleep(jitter(self.config.retry_base)).await;
        }
        a.seen_fence = Some(r.fence_floor());
        a.visit = self.revisit(a.ask.key, &r, a.ask.want)?;
        if self.monotonic() >= a.deadline {
            return Err(Error::StoreUnavailable(format!("{:?} kept changing hands until the deadline", a.ask.key)));
        }
        Ok(Next::Again)
    }

    /// Free, but released after this fail-closed attempt's `:now` (the releaser's clock is
    /// ahead of ours): a fail-closed acquire never takes a key released after it was sent (one
    /// held in the network may have been given up on by its caller). Go again once this clock
    /// has passed the release.
    async fn on_early(&self, a: &mut Attempts<'_>, r: Record, now: u64) -> Result<Next> {
        if a.pin(&r, self.now_ms() + self.safe_margin_now().as_millis() as u64, self.monotonic()) {
            return Ok(Next::Again);
        }
        let freed_at = r.freed_at();
        let ahead = freed_at.unwrap_or(now).saturating_sub(now) + 1;
        let until = self.monotonic() + Duration::from_millis(ahead);
        if until >= a.deadline {
            return Err(Error::LeaseHeld { key: a.ask.key.to_string(), holder: r.holder, expires_at_ms: freed_at });
        }
        tokio::time::sleep_until(until.into()).await;
        Ok(Next::Again)
    }

    /// Free, but in another work-state visit than the one written under (a key in a state, or
    /// one that moved on): go again keeping the visit it is in.
    fn on_moved(&self, a: &mut Attempts<'_>, r: Record) -> Result<Next> {
        a.visit = self.revisit(a.ask.key, &r, a.ask.want)?;
        if self.monotonic() >= a.deadline {
            return Err(Error::StoreUnavailable(format!("{:?} kept changing state until the deadline", a.ask.key)));
        }
        Ok(Next::Again)
    }

    /// Our lease_id's lease already ended on this key: a lease_id is single-use. A generated
    /// one (our own earlier attempt, expired before we heard of it) is replaced; a caller's is
    /// refused.
    fn on_ended(&self, a: &mut Attempts<'_>, reason: Reason) -> Result<Next> {
        if a.ask.opts.lease_id.is_some() || self.monotonic() >= a.deadline {
            return Err(Error::NotHolder { key: a.ask.key.to_string(), reason });
        }
        a.new_lease_id();
        Ok(Next::Again)
    }

    /// Another lease holds the key: sleep until the next paced attempt, or answer `LeaseHeld`
    /// once the wait is over.
    async fn on_held(&self, a: &mut Attempts<'_>, r: Record) -> Result<Next> {
        if a.pin(&r, self.now_ms() + self.safe_margin_now().as_millis() as u64, self.monotonic()) {
            return Ok(Next::Again);
        }
        // A free key kept for its queued waiters has no expiry to wake up for: the paced poll
        // alone (not a tight loop on an expiry already past).
        let now = self.now_ms();
        let queued = (r.queue_len() > 0 || r.queue.pending_token.is_some()) && !r.is_held(now);
        let until_expiry =
            r.expires_at_ms.filter(|_| !queued).map(|e| Duration::from_millis(e.saturating_sub(now) + 1));
        let pause = a.wait.held(r.fence, r.poll_ms, until_expiry, a.wait_deadline);
        let key = a.ask.key;
        let held =
            |r: Record| Error::LeaseHeld { key: key.to_string(), holder: r.holder, expires_at_ms: r.expires_at_ms };
        let Some(until) = pause.map(|p| self.monotonic() + p) else { return Err(held(r)) };
        // The key is in another coordinator's in-process line while this acquire waits: it says
        // so on the item, and that coordinator's next release leaves the key free for it instead
        // of handing it over again. The mark is written within the pause (best effort), so that
        // the acquire still ends by its deadline; a mark that did not land in it (a slow store,
        // a short pause) is written again at the next refusal that shows the lease unmarked.
        if self.turn_elsewhere(&r) {
            let _ = tokio::time::timeout_at(until.into(), self.waits_in(key, r.fence)).await;
        }
        let pause = until.saturating_duration_since(self.monotonic());
        if let Some(lease) = self.sleep_offering(a, pause).await? {
            return Ok(Next::Done(lease));
        }
        // The deadline came while a release was writing this waiter's grant: it left (a grant
        // that lands is given back), and tries nothing more (its own attempt could find that
        // grant).
        if a.departed() {
            return Err(held(r));
        }
        Ok(Next::Again)
    }

    /// A grant a release handed to this waiter: the lease and the item's advertised poll
    /// period, unless it came too late to use (then it is the key's lease still, and the
    /// waiter's next attempt finds it and drops it).
    pub(crate) fn handed(&self, grant: Option<(Record, Instant, u64)>) -> Result<Option<(Lease, Option<u64>)>> {
        let Some((g, sent, now)) = grant else { return Ok(None) };
        check_fence(&g)?;
        let lease = g.lease(sent, now, self.safe_margin(sent, now));
        Ok(lease.safe_until.is_none_or(|s| s > self.monotonic()).then_some((lease, g.poll_ms)))
    }

    /// A grant answered after its safe time, renewed by its own lease_id while time is left: a
    /// renewal lands only on that very lease still live (no other grant came between: each
    /// writes its own lease_id), and is judged by its own answer's safe time. One write where
    /// giving the grant back and taking the key anew takes two, and a caller's own lease_id,
    /// which a release would spend, stays usable. `None` when it cannot be had in time.
    pub(crate) async fn renew_late_grant(&self, lease: &Lease, deadline: Instant) -> Option<Lease> {
        if self.monotonic() >= deadline {
            return None;
        }
        let duration = lease.duration_ms.map(Duration::from_millis);
        match self.heartbeat_until(&lease.key, &lease.lease_id, duration, deadline).await {
            Ok(renewed) => Some(renewed),
            Err(e) => {
                tracing::info!(
                    key = lease.key,
                    error = e.name(),
                    "a late grant could not be renewed; it is given back"
                );
                None
            }
        }
    }

    /// Releases a grant that arrived too late to be used, so the key does not stay blocked for
    /// the rest of its duration. Best effort: if it fails, the grant expires on its own. Waited
    /// for until `until` (the caller's deadline) at most, then left to finish in a task of its
    /// own: a release on a coordinator that serves queues hands the key to the head waiter and
    /// delivers it (`SendTaskSuccess`, up to its 3 s client timeout and retries), which is no
    /// part of the caller's time (found by the simulation: an acquire that dropped a late grant
    /// ended 3 s past its deadline).
    pub(crate) async fn drop_late_grant(&self, key: &str, lease_id: &LeaseId, until: Instant) {
        let (c, k, id) = (self.clone(), key.to_string(), lease_id.clone());
        let release = async move {
            if let Err(e) = c.release(&k, &id).await {
                tracing::warn!(key = k, error = e.name(), "could not release a late grant; it expires on its own");
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                let task = rt.spawn(release);
                let _ = tokio::time::timeout(until.saturating_duration_since(self.monotonic()), task).await;
            }
            Err(_) => release.await,
        }
    }
}
