//! The clock check (DESIGN.md, "Clocks"): before a write judges or sets an expiry, this
//! coordinator's clock must agree with the store's, judged from the `Date` of recent answers;
//! a clock certainly beyond the skew margin is refused with `ClockSkew`.

use super::*;

impl Coordinator {
    /// The coordinator's clock (epoch ms) at a monotonic instant, from one reading of both
    /// clocks taken now (the instants asked about are before it): one reading for all the
    /// samples of a check, not two per sample.
    pub(crate) fn clock_at(&self) -> impl Fn(Instant) -> i64 {
        let (wall, mono) = (self.now_ms() as i64, self.monotonic());
        move |at| wall - mono.saturating_duration_since(at).as_millis() as i64
    }

    /// The measured offset `store clock - this clock` in ms (`lo`, `hi`), from the recent
    /// `Date` samples; `None` without recent evidence or on a store without one (the embedded
    /// store shares the machine's clock).
    pub fn clock_offset(&self) -> Option<(i64, i64)> {
        let samples = self.store.clock()?;
        let o = samples.offset(self.monotonic(), self.clock_at(), self.config.date_lag.as_millis() as i64)?;
        Some((o.lo, o.hi))
    }

    /// This clock (epoch ms) for a write about to be sent, checked first: a step during what
    /// was awaited since the last check (a read, a delivery) is refused, never written.
    pub(crate) async fn checked_now(&self, key: &str) -> Result<u64> {
        self.check_clock(key).await?;
        Ok(self.now_ms())
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
        self.check_clock_by(key, self.monotonic() + self.config.retry_budget).await
    }

    /// [`Coordinator::check_clock`], reading for evidence until `deadline` at most (a write's
    /// own deadline: the check is part of its time).
    pub(crate) async fn check_clock_by(&self, key: &str, deadline: Instant) -> Result<()> {
        let Some(samples) = self.store.clock() else { return Ok(()) };
        let need = crate::clock::AGREEMENT;
        // Bounded: answers may come without a usable `Date`. One write of this store's client
        // reads at a time; the others wait for its answers (a new process's workers would
        // otherwise each read for evidence they all share).
        let mut reads = 0;
        while samples.recent(self.monotonic()) < need && reads < 2 * need && self.monotonic() < deadline {
            let Ok(_turn) = tokio::time::timeout_at(deadline.into(), samples.reading_turn()).await else { break };
            if samples.recent(self.monotonic()) >= need {
                break;
            }
            reads += 1;
            let _ = self.read(deadline, || self.store.get(key)).await;
        }
        let lag = self.config.date_lag.as_millis() as i64;
        let Some(e) = samples.evidence(self.monotonic(), self.clock_at(), lag) else {
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
}
