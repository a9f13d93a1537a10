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

/// Samples older than this are not used (clocks drift, and may be stepped).
const MAX_AGE: Duration = Duration::from_secs(300);
/// Samples kept.
const MAX_SAMPLES: usize = 64;
/// Allowance for a `Date` stamped a little before the answer left the server (a clock cache):
/// a stamp up to this much older than the server's clock is not taken for a wrong clock here.
/// (DynamoDB Local's stamps were never late by more than the round trip.)
pub(crate) const DATE_LAG_MS: i64 = 250;

/// The recent `Date` samples of one store client, shared with its coordinators.
#[derive(Debug, Default)]
pub struct ClockSamples {
    samples: Mutex<VecDeque<Sample>>,
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

impl ClockSamples {
    pub(crate) fn record(&self, s: Sample) {
        let mut q = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() >= MAX_SAMPLES {
            q.pop_front();
        }
        q.push_back(s);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.samples.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
    }

    /// The offset of the clock `clock_at` (epoch ms at a monotonic instant) from the server's,
    /// as the intersection of the recent samples' intervals; when they disagree (a clock was
    /// stepped), the newest sample alone. `None` without a recent sample.
    pub(crate) fn offset(&self, clock_at: impl Fn(Instant) -> i64) -> Option<Offset> {
        let q = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let interval = |s: &Sample| {
            let date = s.date_s as i64 * 1000;
            Offset { lo: date - clock_at(s.received), hi: date + 999 + DATE_LAG_MS - clock_at(s.sent) }
        };
        let recent: Vec<Offset> =
            q.iter().rev().take_while(|s| now.saturating_duration_since(s.received) < MAX_AGE).map(interval).collect();
        let newest = *recent.first()?;
        let both = recent.iter().fold(newest, |a, b| Offset { lo: a.lo.max(b.lo), hi: a.hi.min(b.hi) });
        Some(if both.lo <= both.hi { both } else { newest })
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
        let o = c.offset(clock).unwrap();
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
        let o = c.offset(clock).unwrap();
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
        let o = c.offset(clock).unwrap();
        assert!(o.lo > 9_000_000, "{o:?}");
    }
}
