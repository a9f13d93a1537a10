//! Semaphores: at most N holders per key, each with its own lease_id, fence and expiry
//! (DESIGN.md, "Semaphores"). The take's loop, beside the lease's in `acquire.rs`; its decision
//! is `sort_take` in `decide.rs`. Heartbeat, release and force-release of one holder follow the
//! plain write that the semaphore's item refused.

use super::*;
use crate::model::{SemaphoreFields, SlotHolder};
use crate::protocol::line::Ticket;
use crate::protocol::pacing::aged;
use crate::protocol::retry::Lapse;
use crate::store::{CLEAN_CHUNK, EVICT_CHUNK};

/// A grant that saw more entries than N + this tidies the ended ones away.
const TIDY_ABOVE: usize = 16;

/// The shortest pause between a full semaphore's polls (SEM, 12 waiters: 50 ms gave per-worker
/// max/min 1.12 at 4.25 requests per acquisition, 20 ms 1.24 at 6.51, 10 ms 1.44 at 7.37;
/// BENCHMARKS.md, "Semaphores").
const SLOT_POLL_MIN: Duration = Duration::from_millis(50);

/// How the next take is written.
enum How {
    /// `SlotFree`: a free slot in one request.
    Blind,
    /// `Free` + a whole new semaphore item (no item, or a free plain lease).
    Make,
    /// `SlotsAsRead`: the ended entries of the item read cleaned, and a slot taken.
    Clean(Box<Record>),
}

/// One semaphore acquire call's state across its takes.
struct Take<'a> {
    key: &'a str,
    holder: &'a str,
    duration_ms: u64,
    opts: &'a AcquireOptions,
    slots: u32,
    lease_id: LeaseId,
    seen: Option<u64>,
    how: How,
    landed: bool,
    /// A waiting take's place in this coordinator's line for the key.
    ticket: Option<Ticket>,
    /// When the call began (the longer it has waited, the more often it polls).
    start: Instant,
    /// A generated lease_id's first take that may have landed, and when it may have expired
    /// ([`Lapse`]: sent again after that, the lease_id could take a second slot, the first
    /// cleaned away as ended, after a first grant nobody was told of).
    lapse: Option<Lapse>,
}

impl Take<'_> {
    /// A generated lease_id is single-use: after its slot ended (or may have, unanswered), it
    /// is replaced, and what the old one may have done is no longer this call's business.
    fn new_lease_id(&mut self) {
        (self.lease_id, self.landed, self.how) = (LeaseId::generate(), false, How::Blind);
        if let Some(l) = self.lapse.as_mut() {
            l.until_ms = None;
        }
    }

    fn entry(&self, fence: u64, now: u64) -> SlotHolder {
        SlotHolder {
            lease_id: self.lease_id.clone(),
            fence,
            holder: self.holder.to_string(),
            acquired_at_ms: now,
            renewed_at_ms: now,
            expires_at_ms: now + self.duration_ms,
            duration_ms: self.duration_ms,
            released_at_ms: None,
            metadata: self.opts.metadata.clone(),
            keepalive: self.opts.keepalive.clone(),
        }
    }
}

/// At most [`CLEAN_CHUNK`] ended entries of a semaphore at `now` (those still counted, expired
/// unreleased, first: each frees a slot), and the holders counted once they are gone: the live
/// ones and the counted ended ones left for a later write. One write names no more entries
/// than this, so that its expression stays within DynamoDB's limits (4 KB, 300 operators);
/// a map with more ended entries is cleaned by several writes, each under the item as read.
fn ended(r: &Record, now: u64) -> (Vec<LeaseId>, u32) {
    let holders = &r.semaphore.slot_holders;
    let counted = holders.iter().filter(|h| !h.is_live(now) && h.released_at_ms.is_none());
    let released = holders.iter().filter(|h| !h.is_live(now) && h.released_at_ms.is_some());
    let gone: Vec<LeaseId> = counted.clone().chain(released).take(CLEAN_CHUNK).map(|h| h.lease_id.clone()).collect();
    let left = counted.count().saturating_sub(gone.len());
    (gone, (r.live_slots(now).count() + left) as u32)
}

/// The `sem_cleaned_at_ms` a write removing the entries `gone` of `r` at `now` sets: when one of
/// them is still counted (expired unreleased: its holder may believe it holds its slot until a
/// clock far behind ours passes its expiry), our clock, never below the stamp read; `None`
/// (left as it is) when all were released.
fn cleaned_at(r: &Record, gone: &[LeaseId], now: u64) -> Option<u64> {
    let counted = r.semaphore.slot_holders.iter().any(|h| h.released_at_ms.is_none() && gone.contains(&h.lease_id));
    counted.then(|| r.semaphore.cleaned_at_ms.unwrap_or(0).max(now))
}

impl Coordinator {
    /// An acquire with `slots >= 2`: one slot of the semaphore `key` (validated by the caller).
    pub(crate) async fn acquire_slot(
        &self,
        key: &str,
        holder: &str,
        duration: Duration,
        opts: &AcquireOptions,
    ) -> Result<Lease> {
        let start = self.monotonic();
        let wait_deadline = start + opts.wait.unwrap_or_default();
        let mut deadline = wait_deadline.max(start + self.config.retry_budget);
        if let Some(d) = opts.deadline {
            deadline = deadline.min(d);
        }
        let lease_id = opts.lease_id.clone().unwrap_or_else(LeaseId::generate);
        let slots = opts.slots.unwrap_or(1);
        let duration_ms = duration.as_millis() as u64;
        // Waiting takes of this coordinator line up per key, as a lease's acquires do: only
        // the head sends, and a slot this coordinator frees wakes it at once, so the slots
        // freed here go to its waiters in arrival order.
        let ticket = (!opts.wait.unwrap_or_default().is_zero()).then(|| self.wakeups.enter(key));
        let (seen, how, landed) = (None, How::Blind, false);
        let lapse = opts.lease_id.is_none().then(|| Lapse::new(duration_ms));
        // A coordinator does not jump the line it just left: a moment after it released a slot
        // of a full semaphore (or found one full), the head of its line waits a random part of
        // the key's poll period before its first take, so that a waiter of another process
        // polling meanwhile finds the slot free. A take that does not wait tries at once.
        if ticket.as_ref().is_some_and(|t| t.is_head()) {
            if let Some(c) = self.pacer.begin(key).courtesy {
                tokio::time::sleep(c.min(wait_deadline.saturating_duration_since(start))).await;
            }
        }
        let mut t = Take { key, holder, duration_ms, opts, slots, lease_id, seen, how, landed, ticket, start, lapse };
        let res = self.takes(&mut t, wait_deadline, deadline).await;
        res.map_err(|e| {
            let open = matches!(
                e,
                Error::StoreUnavailable(_) | Error::Throttled(_) | Error::StoreRefused(_) | Error::LeaseHeld { .. }
            );
            let e = if t.landed && open {
                Error::outcome_unknown(key, format!("{e}; an earlier attempt of this acquire may still land"))
            } else {
                e
            };
            e.with_lease_id(&t.lease_id)
        })
    }

    /// The loop of a semaphore acquire: one take (the clock checked by its write, right before
    /// it is sent), and what its answer means.
    async fn takes(&self, t: &mut Take<'_>, wait_deadline: Instant, deadline: Instant) -> Result<Lease> {
        loop {
            self.await_slot_turn(t, wait_deadline).await;
            let Some((w, sent, now, fence)) = self.take_once(t, deadline).await? else {
                // Not sent: the first take that may have landed may have expired ([`Lapse`]).
                t.new_lease_id();
                continue;
            };
            match sort_take(w, &t.lease_id, fence, now, t.slots) {
                SlotAnswer::Granted(r) => {
                    let mut lease = self.slot_granted(t, r, sent, now).await;
                    // Answered after its safe time (a stalled request), as for a lease: renewed
                    // in place while it is live (the caller's own lease_id stays usable),
                    // else of no use to the holder, and the slot is given back and taken anew.
                    if lease.safe_until.is_some_and(|s| s <= self.monotonic()) {
                        if let Some(renewed) = self.renew_late_grant(&lease, deadline).await {
                            lease = renewed;
                        }
                    }
                    if lease.safe_until.is_some_and(|s| s > self.monotonic()) {
                        return Ok(lease);
                    }
                    self.drop_late_grant(t.key, &t.lease_id, deadline).await;
                    if t.opts.lease_id.is_some() {
                        return Err(Error::StoreUnavailable("the store answered after the slot's safe time".into()));
                    }
                    t.new_lease_id();
                }
                SlotAnswer::Ended(reason) => {
                    if t.opts.lease_id.is_some() {
                        return Err(Error::NotHolder { key: t.key.to_string(), reason });
                    }
                    t.new_lease_id();
                }
                SlotAnswer::Make(seen) => (t.seen, t.how) = (seen.or(t.seen), How::Make),
                SlotAnswer::Early(r) => {
                    (t.seen, t.how) = (Some(r.fence_floor()), How::Make);
                    self.slot_early(t, &r, now, deadline).await?;
                }
                SlotAnswer::Cleaned(r) => {
                    (t.seen, t.how) = (Some(r.fence), How::Blind);
                    self.slot_early(t, &r, now, deadline).await?;
                }
                SlotAnswer::Above(f) => (t.seen, t.how) = (Some(f), How::Blind),
                SlotAnswer::Clean(r) => (t.seen, t.how) = (Some(r.fence), How::Clean(Box::new(r))),
                SlotAnswer::Held(r) => {
                    t.how = How::Blind;
                    self.slot_held(t, &r, wait_deadline).await?;
                }
            }
            if self.monotonic() >= deadline {
                return Err(Error::StoreUnavailable(format!("{:?} kept changing until the deadline", t.key)));
            }
        }
    }

    /// Behind the head of this coordinator's line nothing is sent (one last take at the wait's
    /// end). A head that leaves, with a slot or without, wakes the next one: another slot may
    /// be free.
    async fn await_slot_turn(&self, t: &Take<'_>, wait_deadline: Instant) {
        while let Some(ticket) = &t.ticket {
            let now = self.monotonic();
            if ticket.is_head() || now >= wait_deadline {
                return;
            }
            ticket.wait_woken(self.config.poll_max.min(wait_deadline - now)).await;
        }
    }

    /// One take, written as `t.how` says; its answer, when it was sent, the clock, the fence.
    /// `None`: not sent, as the first take that may have landed may have expired ([`Lapse`]).
    async fn take_once(&self, t: &mut Take<'_>, deadline: Instant) -> Result<Option<(Write, Instant, u64, u64)>> {
        self.settle_margin(t.key, t.duration_ms, deadline).await;
        let mut fence = 0;
        let max = self.max_duration_ms();
        let mut landed = t.landed;
        let mut lapse = t.lapse.take();
        let res = self
            .write_noting(
                t.key,
                deadline,
                t.opts.lease_id.is_none().then_some(&t.lease_id),
                |now| {
                    fence = self.next_fence(t.key, t.seen)?;
                    let ttl = self.ttl_after(now + max);
                    let slot = Box::new(t.entry(fence, now));
                    Ok(match &t.how {
                        How::Blind => (
                            Condition::Semaphore(SemaphoreCondition::SlotFree {
                                fence,
                                lease_id: t.lease_id.clone(),
                                slots: t.slots,
                                now_ms: now,
                            }),
                            Mutation::Semaphore(SemaphoreMutation::TakeSlot {
                                slot,
                                slots: t.slots,
                                ttl,
                                clean: None,
                                cleaned_at: None,
                            }),
                        ),
                        How::Make => (
                            Condition::Lease(LeaseCondition::Free { now_ms: now, fence, lease_id: t.lease_id.clone() }),
                            Mutation::Semaphore(SemaphoreMutation::PutSemaphore(Box::new(new_semaphore(
                                t, *slot, ttl,
                            )))),
                        ),
                        How::Clean(r) => {
                            let (gone, live) = ended(r, now);
                            let rev = r.semaphore.slots_rev.unwrap_or(0);
                            let cleaned_at = cleaned_at(r, &gone, now);
                            let clean = Some((gone, live + 1));
                            (
                                Condition::Semaphore(SemaphoreCondition::SlotsAsRead { rev }),
                                Mutation::Semaphore(SemaphoreMutation::TakeSlot {
                                    slot,
                                    slots: t.slots,
                                    ttl,
                                    clean,
                                    cleaned_at,
                                }),
                            )
                        }
                    })
                },
                &mut landed,
                lapse.as_mut(),
            )
            .await;
        (t.landed, t.lapse) = (landed, lapse);
        match res {
            Ok((w, sent, now)) => Ok(Some((w, sent, now, fence))),
            Err(f) if f.lapsed => Ok(None),
            Err(f) => Err(f.into_error(t.key)),
        }
    }

    /// The slot is ours. A grant that saw many ended entries tidies them (best effort) before
    /// it answers, so that the next grant finds the map tidied; a caller that leaves meanwhile
    /// (its deadline) never had the slot, which is given back ([`Unanswered`]).
    async fn slot_granted(&self, t: &Take<'_>, r: Record, sent: Instant, now: u64) -> Lease {
        self.note_semaphore(t.key);
        if r.semaphore.slot_holders.len() > r.semaphore.slots.unwrap_or(1) as usize + TIDY_ABOVE {
            let ttl = self.ttl_after(now + self.max_duration_ms());
            let unanswered =
                // Only a generated lease_id's slot is given back (see `Attempts`' departed release).
                Unanswered {
                    coord: self.clone(),
                    key: t.key.to_string(),
                    lease_id: t.opts.lease_id.is_none().then(|| t.lease_id.clone()),
                };
            // In chunks of at most `CLEAN_CHUNK` entries, each write under the item the last
            // one left; the first refused (the item changed) ends the tidy.
            let mut cur = r.clone();
            loop {
                let (gone, taken) = ended(&cur, now);
                if gone.is_empty() {
                    break;
                }
                let rev = cur.semaphore.slots_rev.unwrap_or(0);
                let cond = Condition::Semaphore(SemaphoreCondition::SlotsAsRead { rev });
                let cleaned_at = cleaned_at(&cur, &gone, now);
                let m = Mutation::Semaphore(SemaphoreMutation::TidySlots { ended: gone, taken, ttl, cleaned_at });
                match self.store.update(t.key, &cond, &m).await {
                    Ok(Write::Applied(next)) => cur = next,
                    _ => break,
                }
            }
            unanswered.answered();
        }
        let h = r.slot(&t.lease_id).expect("a granted take has its entry");
        h.lease(t.key, r.semaphore.slots, sent, now, self.safe_margin(sent, now))
    }

    /// A free plain lease `r` freed by a clock ahead of ours (its `freed_at_ms` after this
    /// take's clock `now`), or a semaphore a holder of which a clock ahead of ours cleaned away
    /// (`sem_cleaned_at_ms`): sleep until this clock has passed it (once: no take is sent
    /// before), or answer `LeaseHeld` when that is past the deadline.
    async fn slot_early(&self, t: &Take<'_>, r: &Record, now: u64, deadline: Instant) -> Result<()> {
        let at = r.semaphore.cleaned_at_ms.filter(|t| *t > now).or(r.queue.freed_at_ms).unwrap_or(now);
        let until = self.monotonic() + Duration::from_millis(at.saturating_sub(now) + 1);
        if until >= deadline {
            return Err(Error::LeaseHeld { key: t.key.to_string(), holder: r.holder.clone(), expires_at_ms: Some(at) });
        }
        tokio::time::sleep_until(until.into()).await;
        Ok(())
    }

    /// Full, or a live plain lease: wait until a slot may be free, or answer `LeaseHeld` with
    /// when the next one frees once the wait is over. A full semaphore is polled at its pace
    /// ([`slot_period`]) by reads of its count ([`Store::slot_count`]) until one shows a slot free
    /// or the item no semaphore, or the earliest holder's expiry comes (the take then cleans the
    /// expired ones); the take follows. A read is one read unit on DynamoDB (up to 4 KB of item),
    /// where a refused take costs a write unit per KB, five times the price each. A plain lease on the key is waited
    /// for until its expiry, or `poll_max`.
    async fn slot_held(&self, t: &Take<'_>, r: &Record, wait_deadline: Instant) -> Result<()> {
        let now = self.now_ms();
        let (holder, expires) = match r.live_slots(now).min_by_key(|h| h.expires_at_ms) {
            Some(h) => (h.holder.clone(), Some(h.expires_at_ms)),
            None => (r.holder.clone(), r.expires_at_ms),
        };
        let left = wait_deadline.saturating_duration_since(self.monotonic());
        if left.is_zero() {
            return Err(Error::LeaseHeld { key: t.key.to_string(), holder, expires_at_ms: expires });
        }
        let until = expires.map_or(self.config.poll_max, |e| Duration::from_millis(e.saturating_sub(now) + 1));
        if r.semaphore.slots.is_none() {
            let base = until.min(self.config.poll_max);
            self.pause_slot(t, crate::backoff::uniform(base / 2, base * 3 / 2).min(left)).await;
            return Ok(());
        }
        let period = slot_period(r, now, self.config.poll_max);
        self.pacer.contended(t.key, period);
        let end = self.monotonic() + until.min(left);
        // The item's fence as last seen, and the pause while the same holders keep every slot.
        let (mut fence, mut changed, mut quiet) = (r.fence, true, period);
        loop {
            let at = self.monotonic();
            if at >= end {
                return Ok(());
            }
            // While slots change hands, the longer this call has waited, the more often it
            // reads (the likeliest to find a freed slot first is the one that waited longest);
            // while the same holders keep every slot (no take since the last read: the item's
            // fence did not move), the pause doubles up to `poll_max`, as for a lease held on
            // ("Contention"): a long hold costs few reads.
            let p = if changed { aged(period, at.saturating_duration_since(t.start)) } else { quiet };
            self.pause_slot(t, crate::backoff::uniform(p / 2, p * 3 / 2).min(end - at)).await;
            if self.monotonic() >= end {
                return Ok(());
            }
            // A failed read leaves the decision to the take.
            match self.store.slot_count(t.key).await {
                Ok(Some(SlotCount { taken, slots: Some(_), fence: f })) if taken >= t.slots => {
                    changed = f != fence;
                    fence = f;
                    quiet = if changed { period } else { (quiet * 2).min(self.config.poll_max.max(period)) };
                }
                _ => return Ok(()),
            }
        }
    }

    /// One pause of a waiting take; a slot freed by this coordinator wakes the head of its line
    /// at once.
    async fn pause_slot(&self, t: &Take<'_>, pause: Duration) {
        match &t.ticket {
            Some(ticket) => ticket.wait_woken(pause).await,
            None => tokio::time::sleep(pause).await,
        }
    }
}

/// The pace at which the waiters of the full semaphore `r` poll it: how often a slot frees,
/// judged from the map (the median hold of its ended entries, from their take to their release
/// or expiry, or while none has ended the live holders' median age, over N), within
/// `[SLOT_POLL_MIN, poll_max]` (`poll_max` alone when it is shorter). Every waiter reads it from
/// the same item, so all poll at one pace without writing it: the waiters of a semaphore whose
/// holders keep their slots a few ms poll at the shortest period, those of one whose holders
/// keep them for minutes at `poll_max`. It is judged by holds, not by the intervals between
/// grants, which grow with the time freed slots stay idle and would slow the waiters that idle
/// time waits for; by the median, so that one holder that crashed does not slow them.
pub(crate) fn slot_period(r: &Record, now: u64, poll_max: Duration) -> Duration {
    let holders = &r.semaphore.slot_holders;
    let mut holds: Vec<u64> = holders
        .iter()
        .filter(|h| !h.is_live(now))
        .map(|h| h.released_at_ms.unwrap_or(h.expires_at_ms).saturating_sub(h.acquired_at_ms))
        .collect();
    if holds.is_empty() {
        holds = holders.iter().map(|h| now.saturating_sub(h.acquired_at_ms)).collect();
    }
    holds.sort_unstable();
    let median = holds.get(holds.len() / 2).copied().unwrap_or(u64::MAX);
    let every = Duration::from_millis(median / r.semaphore.slots.unwrap_or(1).max(1) as u64);
    every.clamp(SLOT_POLL_MIN.min(poll_max), poll_max)
}

impl Coordinator {
    /// Remembers `key` as a semaphore (bounded: forgotten wholesale past 4,096 keys).
    pub(crate) fn note_semaphore(&self, key: &str) {
        let mut known = self.semaphores.lock().unwrap_or_else(|p| p.into_inner());
        if known.len() >= 4096 {
            known.clear();
        }
        known.insert(key.to_string());
    }

    /// Was `key` a semaphore when this coordinator last saw it?
    pub(crate) fn known_semaphore(&self, key: &str) -> bool {
        self.semaphores.lock().unwrap_or_else(|p| p.into_inner()).contains(key)
    }

    /// Renews the semaphore holder `lease_id` of `key`, whose item `r` refused the plain
    /// heartbeat. Without a duration, by the holder's stored one.
    pub(crate) async fn heartbeat_slot(
        &self,
        key: &str,
        lease_id: &LeaseId,
        duration: Option<Duration>,
        deadline: Instant,
        r: &Record,
    ) -> Result<Lease> {
        self.note_semaphore(key);
        let now = self.now_ms();
        let Some(h) = r.slot(lease_id).filter(|h| h.is_live(now)) else {
            return Err(slot_not_holder(key, lease_id, r));
        };
        let d = duration.map_or(h.duration_ms, |d| d.as_millis() as u64);
        match self.renew_slot(key, lease_id, d, deadline).await? {
            Ok(lease) => Ok(lease),
            Err((r, now)) => Err(self.slot_or_plain_not_holder(key, lease_id, r.as_ref(), now)),
        }
    }

    /// The semaphore holder's renewal by `d` ms: the lease, or the refusing item (none: no
    /// item) and the clock it was judged by.
    pub(crate) async fn renew_slot(
        &self,
        key: &str,
        lease_id: &LeaseId,
        d: u64,
        deadline: Instant,
    ) -> Result<std::result::Result<Lease, (Option<Record>, u64)>> {
        let max = self.max_duration_ms();
        let (w, sent, now) = self
            .write(key, deadline, |now| {
                let cond = Condition::Semaphore(SemaphoreCondition::SlotRenew {
                    lease_id: lease_id.clone(),
                    now_ms: now,
                    expires_at_ms: now + d,
                });
                let ttl = self.ttl_after(now + max);
                Ok((
                    cond,
                    Mutation::Semaphore(SemaphoreMutation::RenewSlot {
                        lease_id: lease_id.clone(),
                        now_ms: now,
                        duration_ms: d,
                        ttl,
                    }),
                ))
            })
            .await
            .map_err(|f| f.into_error(key))?;
        // Refused but still live: a later renewal landed, or a shorter one was asked; the
        // holder as it is.
        let r = match w {
            Write::Applied(r) => r,
            Write::Rejected(Some(r)) if r.slot(lease_id).is_some_and(|h| h.is_live(now)) => r,
            Write::Rejected(r) => return Ok(Err((r, now))),
        };
        let h = r.slot(lease_id).expect("a live holder has its entry");
        Ok(Ok(h.lease(key, r.semaphore.slots, sent, now, self.safe_margin(sent, now))))
    }

    /// Releases the semaphore holder `lease_id` of `key`. Idempotent: a released holder whose
    /// entry is still in the map answers `already_released`.
    pub(crate) async fn release_slot(&self, key: &str, lease_id: &LeaseId) -> Result<Released> {
        self.note_semaphore(key);
        match self.free_slot(key, lease_id).await? {
            Ok(released) => Ok(released),
            Err((r, now)) => Err(self.slot_or_plain_not_holder(key, lease_id, r.as_ref(), now)),
        }
    }

    /// A release on a key this coordinator saw as a semaphore (and into no work state): the
    /// holder's slot first, in one request; `None` when the item is no semaphore (the plain
    /// release follows).
    pub(crate) async fn release_known_slot(
        &self,
        key: &str,
        lease_id: &LeaseId,
        state: Option<&str>,
    ) -> Result<Option<Released>> {
        if state.is_some() || !self.known_semaphore(key) {
            return Ok(None);
        }
        match self.free_slot(key, lease_id).await? {
            Ok(released) => Ok(Some(released)),
            Err((Some(r), now)) if r.semaphore.slots.is_some() => {
                Err(self.slot_or_plain_not_holder(key, lease_id, Some(&r), now))
            }
            Err(_) => Ok(None),
        }
    }

    /// The semaphore holder's release: the answer, or the refusing item (none: no item) and
    /// the clock it was judged by.
    pub(crate) async fn free_slot(
        &self,
        key: &str,
        lease_id: &LeaseId,
    ) -> Result<std::result::Result<Released, (Option<Record>, u64)>> {
        let deadline = self.monotonic() + self.config.retry_budget;
        let max = self.max_duration_ms();
        // As a plain release: judges no expiry, so not refused for this clock.
        let (w, _, now) = self
            .write_unchecked(key, deadline, |now| {
                let ttl = self.ttl_after(now + max);
                let cond = Condition::Semaphore(SemaphoreCondition::SlotUnreleased { lease_id: lease_id.clone() });
                Ok((
                    cond,
                    Mutation::Semaphore(SemaphoreMutation::ReleaseSlot {
                        lease_id: lease_id.clone(),
                        now_ms: now,
                        ttl,
                    }),
                ))
            })
            .await
            .map_err(|f| f.into_error(key))?;
        let (r, already) = match w {
            Write::Applied(r) => {
                self.wakeups.wake(key);
                // The semaphore was full: waiters of other processes may be polling it, and this
                // coordinator's next take on it defers to them (`acquire_slot`'s courtesy).
                if r.semaphore.slots_taken.unwrap_or(0) + 1 >= r.semaphore.slots.unwrap_or(1) {
                    self.pacer.contended(key, slot_period(&r, now, self.config.poll_max));
                }
                (r, false)
            }
            Write::Rejected(Some(r)) if r.slot(lease_id).is_some_and(|h| h.released_at_ms.is_some()) => (r, true),
            Write::Rejected(r) => return Ok(Err((r, now))),
        };
        let h = r.slot(lease_id).expect("a released holder has its entry");
        Ok(Ok(Released::at(key, h.fence, h.released_at_ms.unwrap_or(now), already, None)))
    }

    pub(crate) fn slot_or_plain_not_holder(
        &self,
        key: &str,
        lease_id: &LeaseId,
        r: Option<&Record>,
        now: u64,
    ) -> Error {
        match r {
            Some(r) if r.semaphore.slots.is_some() => slot_not_holder(key, lease_id, r),
            r => self.not_holder(key, lease_id, r, now),
        }
    }

    /// Operator release of the semaphore `r` (the item as read): the holder whose fence is
    /// `fence`, or every unreleased one; the fence moves past all issued. `None`: the item
    /// changed since it was read (read it again).
    pub(crate) async fn evict_slots(
        &self,
        key: &str,
        r: &Record,
        fence: Option<u64>,
        deadline: Instant,
    ) -> Result<Option<LeaseState>> {
        let max = self.max_duration_ms();
        let hit = |h: &&SlotHolder| h.released_at_ms.is_none() && fence.is_none_or(|f| h.fence == f);
        let evicted: Vec<LeaseId> = r.semaphore.slot_holders.iter().filter(hit).map(|h| h.lease_id.clone()).collect();
        if evicted.is_empty() && fence.is_some() {
            return Err(Error::NotFound { key: format!("{key} (no unreleased holder with fence {fence:?})") });
        }
        // In chunks of at most `EVICT_CHUNK` holders (DynamoDB's expression limits), each
        // write under the item the last one left, so each is whole on its own: its holders
        // released and fenced off, `sem_taken` what it leaves. A refused chunk (the item
        // changed) ends it: read again, the holders still unreleased are evicted then.
        // Nobody to evict (every holder released): one write still moves the fence.
        let chunks: Vec<&[LeaseId]> =
            if evicted.is_empty() { vec![&[]] } else { evicted.chunks(EVICT_CHUNK).collect() };
        let mut cur = r.clone();
        let mut answer = None;
        for chunk in chunks {
            let unreleased = cur.semaphore.slot_holders.iter().filter(|h| h.released_at_ms.is_none()).count();
            let taken = unreleased.saturating_sub(chunk.len());
            let rev = cur.semaphore.slots_rev.unwrap_or(0);
            // As a force-release: not refused for this clock.
            let (w, _, now) = self
                .write_unchecked(key, deadline, |now| {
                    let m = Mutation::Semaphore(SemaphoreMutation::EvictSlots {
                        evicted: chunk.to_vec(),
                        now_ms: now,
                        taken: taken as u32,
                        ttl: self.ttl_after(now + max),
                    });
                    Ok((Condition::Semaphore(SemaphoreCondition::SlotsAsRead { rev }), m))
                })
                .await
                .map_err(|f| f.into_error(key))?;
            match w {
                Write::Applied(next) => {
                    self.wakeups.wake(key);
                    answer = Some(next.state(now));
                    cur = next;
                }
                _ => return Ok(None),
            }
        }
        Ok(answer)
    }
}

/// A slot granted to a take that has not answered yet: dropped before [`Unanswered::answered`]
/// (its caller left), the slot is given back in a task of its own (DESIGN.md, "Cancellation").
struct Unanswered {
    coord: Coordinator,
    key: String,
    lease_id: Option<LeaseId>,
}

impl Unanswered {
    fn answered(mut self) {
        self.lease_id = None;
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        let Some(id) = self.lease_id.take() else { return };
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let (coord, key) = (self.coord.clone(), std::mem::take(&mut self.key));
        rt.spawn(async move { coord.release_departed_now(&key, &id).await });
    }
}

/// Why `lease_id` holds no slot of the semaphore `r`.
fn slot_not_holder(key: &str, lease_id: &LeaseId, r: &Record) -> Error {
    let reason = match r.slot(lease_id) {
        None => Reason::Missing,
        Some(h) if h.released_at_ms.is_some() => Reason::Released,
        // Expired, or (live, by another clock than the store's) refused as if it were.
        Some(_) => Reason::Expired,
    };
    Error::NotHolder { key: key.to_string(), reason }
}

/// The whole item of a new semaphore whose first holder is `slot`.
fn new_semaphore(t: &Take<'_>, slot: SlotHolder, ttl: u64) -> Record {
    Record {
        fence: slot.fence,
        holder: slot.holder.clone(),
        lease_id: LeaseId::from_string(crate::store::NO_LEASE),
        acquired_at_ms: slot.acquired_at_ms,
        min_hold_until_ms: slot.acquired_at_ms,
        ttl: Some(ttl),
        keepalive: slot.index_keepalive(),
        semaphore: SemaphoreFields {
            slots: Some(t.slots),
            slots_taken: Some(1),
            slots_rev: Some(1),
            slot_holders: vec![slot],
            cleaned_at_ms: None,
        },
        ..Record::key_only(t.key.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A semaphore of `n` slots whose entries were taken at `taken` ms and ended (released) at
    /// `ended` ms, `None`: live.
    fn semaphore(n: u32, entries: &[(u64, Option<u64>)]) -> Record {
        let mut r = Record::key_only("k".into());
        r.semaphore.slots = Some(n);
        r.semaphore.slot_holders = entries
            .iter()
            .map(|&(taken, ended)| SlotHolder {
                lease_id: LeaseId::generate(),
                fence: 1,
                holder: "h".into(),
                acquired_at_ms: taken,
                renewed_at_ms: taken,
                expires_at_ms: ended.unwrap_or(taken + 3_600_000),
                duration_ms: 3_600_000,
                released_at_ms: ended,
                metadata: None,
                keepalive: None,
            })
            .collect();
        r
    }

    #[test]
    fn a_full_semaphore_is_polled_at_how_often_its_slots_free() {
        let max = Duration::from_millis(500);
        let now = 10_000_000;
        // Holds of 5 ms on 4 slots: the shortest period.
        let fast: Vec<_> = (0..8).map(|i| (now - 100 + i, Some(now - 95 + i))).collect();
        assert_eq!(slot_period(&semaphore(4, &fast), now, max), SLOT_POLL_MIN);
        // Holds of 800 ms on 4 slots: a slot frees every 200 ms.
        let mid: Vec<_> = (0..8).map(|i| (now - 5_000 + i, Some(now - 4_200 + i))).collect();
        assert_eq!(slot_period(&semaphore(4, &mid), now, max), Duration::from_millis(200));
        // Holds of a minute: `poll_max`.
        let slow: Vec<_> = (0..3).map(|i| (now - 90_000 + i, Some(now - 30_000 + i))).collect();
        assert_eq!(slot_period(&semaphore(3, &slow), now, max), max);
        // One holder that crashed and expired after an hour does not slow the waiters.
        let mut crashed = fast.clone();
        crashed.push((now - 3_600_000, None));
        assert_eq!(slot_period(&semaphore(4, &crashed), now, max), SLOT_POLL_MIN);
        // Nothing ended yet: the live holders' age so far (2 s over 4 slots).
        let live: Vec<_> = (0..4).map(|_| (now - 2_000, None)).collect();
        assert_eq!(slot_period(&semaphore(4, &live), now, max), max);
        let live: Vec<_> = (0..4).map(|_| (now - 800, None)).collect();
        assert_eq!(slot_period(&semaphore(4, &live), now, max), Duration::from_millis(200));
        // A `poll_max` below the shortest period is kept.
        assert_eq!(slot_period(&semaphore(4, &fast), now, Duration::from_millis(20)), Duration::from_millis(20));
    }
}
