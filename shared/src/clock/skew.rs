//! How far the coordinator's clock may be from the store's, from the `Date` header of the
//! store's answers (DESIGN.md, "Clocks").
//!
//! Expiry is judged by the acquiring coordinator's clock and written by the granting one, so a
//! clock that is wrong by more than the skew margin could take a live lease (clock ahead) or
//! write a lease that others see as expired at once (clock behind). Every DynamoDB answer
//! carries a `Date` header with the server's time in whole seconds. One answer bounds the
//! offset `server - coordinator` to an interval about one second plus one round trip wide:
//! the header was generated at some instant between sending the request and receiving the
//! answer, with the server's clock somewhere in `[date, date + 1 s)`. Answers arrive at
//! varied sub-second phases, so the intersection of the recent intervals narrows (towards a
//! round trip) as requests are made. A coordinator whose offset is *certainly* beyond the
//! margin (the whole interval beyond it) refuses to judge or write expiries.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One answer's evidence: sent and received on the coordinator's monotonic clock, and the
/// server's `Date` (epoch seconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sample {
    pub sent: Instant,
    pub received: Instant,
    pub date_s: u64,
}

/// Samples older than this are not used (clocks drift, and may be stepped): it is the bound
/// on the age of the evidence every judgement of an expiry rests on.
pub(crate) const MAX_AGE: Duration = Duration::from_secs(300);
/// Samples kept.
const MAX_SAMPLES: usize = 64;
/// Default allowance for a `Date` stamped a little before the answer left the server (a clock
/// cache): a stamp up to this much older than the server's clock is not taken for a wrong
/// clock here. (DynamoDB Local's stamps were never late by more than the round trip.)
/// Configurable: `Config::date_lag`, `LEASEHOLD_DATE_LAG_MS`.
pub const DATE_LAG_MS: i64 = 250;
/// How many answers must each certainly put the clock beyond the margin, in the same
/// direction, before the coordinator refuses: one answer stamped late (a slow front end, a
/// cached `Date`) must not stop every write. A coordinator with fewer recent answers than this
/// asks the store for more before it judges.
pub const AGREEMENT: usize = 3;

/// The recent `Date` samples of one store client, shared with its coordinators.
#[derive(Debug, Default)]
pub struct ClockSamples {
    samples: Mutex<VecDeque<Sample>>,
    /// Held by the one write that reads the store for evidence while there is too little: the
    /// other writes of the client wait for its answers instead of each reading for its own.
    reading: tokio::sync::Mutex<()>,
}

/// Bounds on `server clock - coordinator clock`, in ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Offset {
    pub lo: i64,
    pub hi: i64,
}

impl Offset {
    /// Is the coordinator's clock certainly more than `margin_ms` away from the server's?
    pub(crate) fn beyond(&self, margin_ms: i64) -> bool {
        self.lo > margin_ms || self.hi < -margin_ms
    }
}

/// What the recent samples say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Evidence {
    /// The intersection of the recent samples' intervals (the newest alone when they disagree).
    pub offset: Offset,
    /// Recent samples.
    pub samples: usize,
    /// The `AGREEMENT`-th tightest bounds (of all samples when fewer): at least that many
    /// samples each put the offset above `lo` (and as many below `hi`). The clock is refused
    /// when this interval is beyond the margin, i.e. when that many answers agree that it is.
    pub agreed: Offset,
}

impl ClockSamples {
    pub(crate) fn record(&self, s: Sample) {
        let mut q = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() >= MAX_SAMPLES {
            q.pop_front();
        }
        q.push_back(s);
    }

    /// Makes every sample `by` older, as if this process had been idle (or frozen) that long.
    /// For tests of the evidence's age bound.
    #[doc(hidden)]
    pub fn backdate(&self, by: Duration) {
        let mut q = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        for s in q.iter_mut() {
            if let (Some(sent), Some(received)) = (s.sent.checked_sub(by), s.received.checked_sub(by)) {
                (s.sent, s.received) = (sent, received);
            }
        }
    }

    /// The turn to read the store for evidence: one write at a time, so that many writes
    /// finding too little evidence at once (a new process's workers) make one read each turn,
    /// not one each.
    pub(crate) async fn reading_turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.reading.lock().await
    }

    /// How many samples are younger than [`MAX_AGE`].
    pub(crate) fn recent(&self, now: Instant) -> usize {
        let q = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        q.iter().rev().take_while(|s| now.saturating_duration_since(s.received) < MAX_AGE).count()
    }

    /// The offset of the clock `clock_at` (epoch ms at a monotonic instant) from the server's,
    /// as the intersection of the recent samples' intervals; when they disagree (a clock was
    /// stepped), the newest sample alone. `None` without a recent sample. `lag_ms`: the
    /// allowance for a late `Date`.
    pub(crate) fn offset(&self, now: Instant, clock_at: impl Fn(Instant) -> i64, lag_ms: i64) -> Option<Offset> {
        self.evidence(now, clock_at, lag_ms).map(|e| e.offset)
    }

    /// The offset and how far the recent samples agree on it (see [`Evidence`]). Runs before
    /// every acquire and heartbeat: no allocation, and the `AGREEMENT`-th bounds by selection
    /// rather than by sorting every sample.
    pub(crate) fn evidence(&self, now: Instant, clock_at: impl Fn(Instant) -> i64, lag_ms: i64) -> Option<Evidence> {
        let q = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        let interval = |s: &Sample| {
            let date = s.date_s as i64 * 1000;
            Offset { lo: date - clock_at(s.received), hi: date + 999 + lag_ms - clock_at(s.sent) }
        };
        let (mut los, mut his) = ([0i64; MAX_SAMPLES], [0i64; MAX_SAMPLES]);
        let mut n = 0;
        let mut newest = None;
        let mut both = Offset { lo: i64::MIN, hi: i64::MAX };
        for o in q.iter().rev().take_while(|s| now.saturating_duration_since(s.received) < MAX_AGE).map(interval) {
            newest.get_or_insert(o);
            both = Offset { lo: both.lo.max(o.lo), hi: both.hi.min(o.hi) };
            (los[n], his[n]) = (o.lo, o.hi);
            n += 1;
        }
        drop(q);
        let newest = newest?;
        let offset = if both.lo <= both.hi { both } else { newest };
        // With fewer answers than the agreement (the store could not give more), all of them:
        // the k-th largest `lo` and the k-th smallest `hi`.
        let k = AGREEMENT.min(n) - 1;
        let lo = *los[..n].select_nth_unstable_by(k, |a, b| b.cmp(a)).1;
        let hi = *his[..n].select_nth_unstable(k).1;
        Some(Evidence { offset, samples: n, agreed: Offset { lo, hi } })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(base: Instant, ms: u64) -> Instant {
        base + Duration::from_millis(ms)
    }

    #[test]
    fn one_answer_bounds_the_offset_to_about_a_second() {
        let c = ClockSamples::default();
        let base = Instant::now();
        // Our clock reads 10_000.000 s at `base`; the server stamps 10_000 s at +300 ms.
        let clock = |i: Instant| 10_000_000 + i.saturating_duration_since(base).as_millis() as i64;
        c.record(Sample { sent: at(base, 290), received: at(base, 310), date_s: 10_000 });
        let o = c.offset(at(base, 1000), clock, DATE_LAG_MS).unwrap();
        assert_eq!((o.lo, o.hi), (-310, 999 + DATE_LAG_MS - 290));
        assert!(!o.beyond(200));
    }

    #[test]
    fn answers_at_several_phases_narrow_it_and_a_wrong_clock_is_certainly_beyond() {
        let c = ClockSamples::default();
        let base = Instant::now();
        // Our clock runs 5 s ahead of the server's.
        let clock = |i: Instant| 10_005_000 + i.saturating_duration_since(base).as_millis() as i64;
        for phase in [100u64, 400, 700, 950] {
            let server_ms = 10_000_000 + phase;
            c.record(Sample { sent: at(base, phase - 5), received: at(base, phase + 5), date_s: server_ms / 1000 });
        }
        let o = c.offset(at(base, 1000), clock, DATE_LAG_MS).unwrap();
        assert!(o.lo >= -5_000 - 1000 && o.hi <= -5_000 + 1_000, "{o:?}");
        assert!(o.beyond(200), "{o:?}");
    }

    #[test]
    fn a_stepped_clock_falls_back_to_the_newest_sample() {
        let c = ClockSamples::default();
        let base = Instant::now();
        c.record(Sample { sent: at(base, 0), received: at(base, 10), date_s: 10_000 });
        c.record(Sample { sent: at(base, 20), received: at(base, 30), date_s: 20_000 });
        let clock = |i: Instant| 10_000_000 + i.saturating_duration_since(base).as_millis() as i64;
        let o = c.offset(at(base, 1000), clock, DATE_LAG_MS).unwrap();
        assert!(o.lo > 9_000_000, "{o:?}");
    }

    #[test]
    fn one_late_date_does_not_refuse_but_several_agreeing_answers_do() {
        let c = ClockSamples::default();
        let base = Instant::now();
        // An honest clock: our clock equals the server's.
        let clock = |i: Instant| 10_000_000 + i.saturating_duration_since(base).as_millis() as i64;
        for phase in [100u64, 400, 700] {
            c.record(Sample { sent: at(base, phase - 5), received: at(base, phase + 5), date_s: 10_000 });
        }
        // One answer stamped 2 s late (a cached `Date`): alone it says our clock is ahead.
        c.record(Sample { sent: at(base, 800), received: at(base, 810), date_s: 9_998 });
        let e = c.evidence(at(base, 1000), clock, DATE_LAG_MS).unwrap();
        assert!(e.offset.beyond(200), "one sample alone would refuse: {e:?}");
        assert!(!e.agreed.beyond(200), "{e:?}");
        // Two more late answers: three agree, and the clock is refused.
        c.record(Sample { sent: at(base, 820), received: at(base, 830), date_s: 9_998 });
        assert!(!c.evidence(at(base, 1000), clock, DATE_LAG_MS).unwrap().agreed.beyond(200));
        c.record(Sample { sent: at(base, 840), received: at(base, 850), date_s: 9_998 });
        assert!(c.evidence(at(base, 1000), clock, DATE_LAG_MS).unwrap().agreed.beyond(200));
    }

    #[test]
    fn with_fewer_answers_than_the_agreement_all_must_agree() {
        let c = ClockSamples::default();
        let base = Instant::now();
        let clock = |i: Instant| 10_000_000 + i.saturating_duration_since(base).as_millis() as i64;
        c.record(Sample { sent: at(base, 0), received: at(base, 10), date_s: 9_990 });
        let e = c.evidence(at(base, 1000), clock, DATE_LAG_MS).unwrap();
        assert!(e.agreed.beyond(200) && e.samples == 1, "{e:?}");
        c.record(Sample { sent: at(base, 20), received: at(base, 30), date_s: 10_000 });
        assert!(!c.evidence(at(base, 1000), clock, DATE_LAG_MS).unwrap().agreed.beyond(200));
    }

    #[test]
    fn the_agreed_bounds_are_the_agreement_th_tightest_of_the_kept_samples() {
        let c = ClockSamples::default();
        let base = Instant::now();
        let clock = |i: Instant| 10_000_000 + i.saturating_duration_since(base).as_millis() as i64;
        // More answers than are kept, at scattered round trips and dates.
        let (mut x, mut all) = (7u64, Vec::new());
        for i in 0..(MAX_SAMPLES as u64 + 6) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let s = Sample {
                sent: at(base, i * 10),
                received: at(base, i * 10 + (x >> 60)),
                date_s: 9_998 + (x >> 33) % 5,
            };
            c.record(s);
            all.push(s);
        }
        let kept = &all[all.len() - MAX_SAMPLES..];
        let date = |s: &Sample| s.date_s as i64 * 1000;
        let mut los: Vec<i64> = kept.iter().map(|s| date(s) - clock(s.received)).collect();
        let mut his: Vec<i64> = kept.iter().map(|s| date(s) + 999 + DATE_LAG_MS - clock(s.sent)).collect();
        los.sort_unstable_by(|a, b| b.cmp(a));
        his.sort_unstable();
        let e = c.evidence(at(base, 1000), clock, DATE_LAG_MS).unwrap();
        assert_eq!(e.samples, MAX_SAMPLES);
        assert_eq!(e.agreed, Offset { lo: los[AGREEMENT - 1], hi: his[AGREEMENT - 1] });
    }

    #[test]
    fn the_allowance_for_a_late_date_is_a_parameter() {
        let c = ClockSamples::default();
        let base = Instant::now();
        // Our clock is 1.5 s ahead of the stamps: beyond with 250 ms of allowance, not with 2 s.
        let clock = |i: Instant| 10_001_500 + i.saturating_duration_since(base).as_millis() as i64;
        for phase in [10u64, 20, 30] {
            c.record(Sample { sent: at(base, phase - 5), received: at(base, phase + 5), date_s: 10_000 });
        }
        assert!(c.evidence(at(base, 1000), clock, 250).unwrap().agreed.beyond(200));
        assert!(!c.evidence(at(base, 1000), clock, 2_000).unwrap().agreed.beyond(200));
    }
}
