//! The clock check and the clock's corrections (DESIGN.md, "Clocks"). The recent answers of the
//! store bound its clock (`clock::skew`): before a write judges or sets an expiry, this
//! coordinator's clock must not be certainly beyond the skew margin from it (`ClockSkew`);
//! every clock reading written is never ahead of the store's clock; and a holder's safe time
//! ends before the store's clock can reach the lease's expiry, however far the clock of the
//! next taker is, as long as the check accepted it.

use super::*;
use crate::clock::skew::StoreClock;

impl Coordinator {
    /// This coordinator's own clock in epoch µs, uncorrected: what the check judges.
    fn wall_us(&self) -> i64 {
        self.config.clock.wall_us() + self.config.clock_offset_ms * 1000
    }

    /// This coordinator's own clock in epoch ms, uncorrected: for stamps that only order one
    /// writer's tries and judge no expiry.
    pub(crate) fn own_clock_ms(&self) -> u64 {
        self.wall_us().div_euclid(1000).max(0) as u64
    }

    /// The coordinator's uncorrected clock (epoch ms) at a monotonic instant, from one reading
    /// of both clocks taken now (the instants asked about are before it): one reading for all
    /// the samples of a check, not two per sample.
    pub(crate) fn clock_at(&self) -> impl Fn(Instant) -> i64 {
        let (wall, mono) = (self.wall_us().div_euclid(1000), self.monotonic());
        move |at| wall - mono.saturating_duration_since(at).as_millis() as i64
    }

    fn date_lag_ms(&self) -> i64 {
        self.config.date_lag.as_millis() as i64
    }

    /// The agreed bounds on the store's clock, from its recent answers; `None` without recent
    /// evidence or on a store without any.
    fn store_clock(&self) -> Option<StoreClock> {
        self.store.clock()?.store_clock(self.monotonic(), self.date_lag_ms())
    }

    /// The clock every write is made with (epoch µs): this coordinator's clock, moved back to
    /// the certain lower bound of the store's clock when it is above it, so that no `:now`,
    /// expiry or fence is ever ahead of the store's clock (a clock behind is left as it is).
    pub(crate) fn corrected_us(&self) -> u64 {
        let wall = self.wall_us();
        let low = self.store_clock().map_or(wall, |s| s.lo_at(self.monotonic()));
        wall.min(low).max(0) as u64
    }

    /// How long before a lease's expiry its holder's safe time ends, for an answer to a write
    /// sent at `sent` with the clock `now_ms` ([`Record::lease`]): the expiry is in the store's
    /// clock, which at `sent` was at most the agreed `hi` of its recent answers, so the safe time
    /// ends `hi - now` before it, and never less than the skew margin (what the monotonic
    /// clock's drift over one lease may take, and all of it on a store without evidence). When
    /// the answers to this very write put the store's clock certainly above `hi` (a pause that
    /// stopped both of this machine's clocks left old evidence looking recent), their own bounds
    /// count instead: a holder is never told a safe time it does not have.
    pub(crate) fn safe_margin(&self, sent: Instant, now_ms: u64) -> u64 {
        let skew = self.skew_ms();
        let Some(samples) = self.store.clock() else { return skew };
        let Some(mut clock) = samples.store_clock(self.monotonic(), self.date_lag_ms()) else { return skew };
        if let Some(fresh) = samples.answered_since(sent, self.date_lag_ms(), &clock) {
            let o = clock.offset(sent, self.clock_at()(sent) * 1000);
            tracing::warn!(
                store = self.store.name(),
                believed_hi_ms = o.hi,
                "the store's answer shows its clock further ahead of this coordinator's than its recent answers \
                 did (were both of this machine's clocks paused?): the holder's safe time is counted from that \
                 answer alone"
            );
            clock = fresh;
        }
        let hi_ms = (clock.hi_at(sent) + 999).div_euclid(1000);
        (hi_ms - now_ms as i64).max(skew as i64) as u64
    }

    /// The holder's view of the lease `r` as of now (an item read earlier, whose expiry is
    /// what it is): its safe time counted from this instant.
    pub(crate) fn lease_now(&self, r: &Record) -> Lease {
        let (at, now) = (self.monotonic(), self.now_ms());
        r.lease(at, now, self.safe_margin(at, now))
    }

    /// The clock to judge the item `r` by in a write conditional on that very item (its fence):
    /// `now`, raised to the stamp of the write that freed it when that is later and within what
    /// the store's clock can be now (DESIGN.md, "Clocks": a released key is free to every
    /// taker). Still not ahead of the store's clock: the stamp was a corrected clock's.
    pub(crate) fn freed_floor(&self, r: &Record, now: u64) -> u64 {
        match r.freed_by_stamp() {
            Some(at) if at > now && at <= now + self.safe_margin_now().as_millis() as u64 => at,
            _ => now,
        }
    }

    /// The safe margin for a write sent now (DESIGN.md, "Clocks"): how much before its expiry
    /// a lease written now stops being safe for its holder. The skew margin, or more while the
    /// store's answers leave this clock uncertain (on DynamoDB, about 350 ms with steady
    /// traffic, up to about 1.3 s after a new process's first answers).
    pub fn safe_margin_now(&self) -> Duration {
        Duration::from_millis(self.safe_margin(self.monotonic(), self.now_ms()))
    }

    /// Before a grant of a lease of `duration_ms` is written: while the clock evidence leaves
    /// it less than a quarter of its duration of safe time (a new process's first answers,
    /// read back to back, leave a safe margin of about 1.25 s on DynamoDB), reads `key` a
    /// little apart, each answer adding evidence at another sub-second phase, until the margin
    /// is at most three quarters of the duration, or for a second at most, or until `deadline`
    /// nears. Otherwise the grant would come back with little or no safe time, to be released
    /// and taken again. A read still unanswered as the deadline nears is given up (it changes
    /// nothing), so that the write is sent by the deadline.
    pub(crate) async fn settle_margin(&self, key: &str, duration_ms: u64, deadline: Instant) {
        const APART: Duration = Duration::from_millis(90);
        // Answers over one second cover every sub-second phase: reads after that add nothing a
        // read before did not (a lease too short for any margin the store's evidence can give,
        // say 100 ms on DynamoDB, would otherwise read until its deadline).
        let deadline = deadline.min(self.monotonic() + Duration::from_secs(1) + 2 * APART);
        while self.store.clock().is_some()
            && self.safe_margin_now().as_millis() as u64 * 4 > duration_ms * 3
            && self.monotonic() + 2 * APART < deadline
        {
            tokio::time::sleep(crate::backoff::jitter(APART)).await;
            let _ = tokio::time::timeout_at((deadline - APART).into(), self.store.get(key)).await;
        }
    }

    /// The measured offset `store clock - this clock` in ms (`lo`, `hi`), from the recent
    /// `Date` samples; `None` without recent evidence or on a store without one.
    pub fn clock_offset(&self) -> Option<(i64, i64)> {
        let samples = self.store.clock()?;
        let o = samples.offset(self.monotonic(), self.clock_at(), self.date_lag_ms())?;
        Some((o.lo, o.hi))
    }

    /// This clock (epoch ms) for a write about to be sent, checked first: a step during what
    /// was awaited since the last check (a read, a delivery) is refused, never written.
    pub(crate) async fn checked_now(&self, key: &str) -> Result<u64> {
        self.check_clock(key).await?;
        Ok(self.now_ms())
    }

    /// Refuses to judge or write expiries with a clock that is certainly further from the
    /// store's than the skew margin (DESIGN.md, "Clocks"). The evidence is the store's answers
    /// of the last [`MAX_AGE`](crate::clock::skew::MAX_AGE): with fewer recent answers than
    /// [`AGREEMENT`](crate::clock::skew::AGREEMENT) (a new process, or one idle for minutes: when a
    /// thawed clock is most likely wrong; one for the embedded store's exact clock), it reads
    /// `key` until it has them. It refuses only when that many answers agree that the clock is
    /// beyond the margin (when fewer could be had, all of them); with no recent answer at all
    /// it refuses to judge (`StoreUnavailable`, nothing sent).
    pub(crate) async fn check_clock(&self, key: &str) -> Result<()> {
        self.check_clock_by(key, self.monotonic() + self.config.retry_budget).await
    }

    /// [`Coordinator::check_clock`], reading for evidence until `deadline` at most (a write's
    /// own deadline: the check is part of its time).
    pub(crate) async fn check_clock_by(&self, key: &str, deadline: Instant) -> Result<()> {
        let Some(samples) = self.store.clock() else { return Ok(()) };
        let need = samples.agreement();
        // Bounded: answers may come without a usable `Date`. One write of this store's client
        // reads at a time; the others wait for its answers (a new process's workers would
        // otherwise each read for evidence they all share).
        let mut reads = 0;
        while self.store_clock().map_or(0, |s| s.samples) < need && reads < 2 * need && self.monotonic() < deadline {
            let Ok(_turn) = tokio::time::timeout_at(deadline.into(), samples.reading_turn()).await else { break };
            if self.store_clock().map_or(0, |s| s.samples) >= need {
                break;
            }
            reads += 1;
            let _ = self.read(deadline, || self.store.get(key)).await;
        }
        let Some(clock) = self.store_clock() else {
            return Err(Error::not_sent(
                "no answer of the store in the last 5 minutes to check this coordinator's clock against; \
                 expiries are not judged without one",
            ));
        };
        let o = clock.offset(self.monotonic(), self.wall_us());
        if o.beyond(self.skew_ms() as i64) {
            let (dir, lo, hi) = if o.lo > 0 { ("behind", o.lo, o.hi) } else { ("ahead of", -o.hi, -o.lo) };
            return Err(Error::ClockSkew(format!(
                "this coordinator's clock is {lo} to {hi} ms {dir} the store's ({} answers agree), beyond the skew \
                 margin of {} ms: it must not judge or write lease expiries until its time is synchronised",
                need.min(clock.samples),
                self.skew_ms()
            )));
        }
        Ok(())
    }
}

#[cfg(all(test, feature = "testing"))]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use crate::testing::{Faults, SimClock, SimStore};
    use crate::{AcquireOptions, Clock, Config, Coordinator, Error};

    /// A machine frozen with both its clocks (a paused VM): when it thaws, the store's clock has
    /// moved on by the pause and its own have not, and its clock evidence, all from before the
    /// pause, still looks recent and still agrees with its clock. The first write's `:now` is
    /// behind the store's clock by the pause, so its expiry is earlier on the store's clock than
    /// the evidence allows for: the write's own answer shows it, and the holder's safe time is
    /// counted from that answer (without it, the holder would believe 2.7 s past its expiry).
    /// Three answers after the pause drop the stale evidence, and the clock is refused.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_thawed_machine_s_first_writes_are_caught_by_their_own_answers() {
        let truth = Arc::new(SimClock::new(1_800_000_000_000));
        let store = SimStore::new(truth.clone(), Faults::none(), 7);
        let clock = Arc::new(SimClock::offset_from(&truth, 0));
        let config = Config { clock: clock.clone(), ..Config::default() };
        let c = Coordinator::new(Arc::new(store.handle()), config);
        // Steady answers for a second: the evidence is a few hundred ms wide.
        for _ in 0..40 {
            let _ = c.get("warm").await;
            tokio::time::sleep(Duration::from_millis(23)).await;
        }
        assert!(c.safe_margin_now() < Duration::from_millis(600), "{:?}", c.safe_margin_now());
        // Frozen for 3 s: the store's clock moves on, this machine's do not.
        truth.step(3_000);
        let lease = c.acquire("k", "h", Some(Duration::from_secs(10)), AcquireOptions::default()).await.unwrap();
        // When the store's clock reaches the lease's expiry, on the monotonic clock.
        let expires =
            c.monotonic() + Duration::from_millis(lease.expires_at_ms.unwrap().saturating_sub(truth.wall_ms() as u64));
        let safe = lease.safe_until.unwrap();
        assert!(safe <= expires, "safe {:?} past the expiry", safe - expires);
        assert!(expires - safe < Duration::from_millis(2_000), "{:?} early", expires - safe);
        // A renewal, with the evidence still mostly stale: the same.
        let renewed = c.heartbeat("k", &lease.lease_id, None).await.unwrap();
        let expires = c.monotonic()
            + Duration::from_millis(renewed.expires_at_ms.unwrap().saturating_sub(truth.wall_ms() as u64));
        assert!(renewed.safe_until.unwrap() <= expires);
        // One more answer after the pause: three agree, the stale evidence goes, and this
        // clock, 3 s behind the store's, is refused.
        let _ = c.get("k").await;
        let r = c.acquire("k2", "h", Some(Duration::from_secs(10)), AcquireOptions::default()).await;
        assert!(matches!(r, Err(Error::ClockSkew(_))), "{r:?}");
        assert!(clock.wall_ms() < truth.wall_ms() - 2_900);
    }
}
