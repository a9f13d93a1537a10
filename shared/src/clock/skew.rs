//! How far the coordinator's clock may be from the store's, from the `Date` header of the
//! store's answers (DESIGN.md, "Clocks").
//!
//! Every DynamoDB answer carries a `Date` header with the server's time in whole seconds. One
//! answer bounds the store's clock at any monotonic instant: the header was generated at some
//! instant between sending the request and receiving the answer, with the server's clock
//! somewhere in `[date, date + 1 s)`. From then on the store's clock advances as the
//! monotonic clock does, so the answer bounds it at every later instant too, to an interval
//! about one second plus one round trip wide. Answers arrive at varied sub-second phases, so
//! the recent intervals narrow the bounds (towards a round trip) as requests are made.
//!
//! The bounds are kept in terms of the monotonic clock, not the wall clock: `store clock at
//! instant x` lies in `[x + lo, x + hi]` (µs since this client's first sample). They are the
//! same for every coordinator sharing the store client, whatever its wall clock, and are
//! cached until the next answer (or until a sample ages out), so that reading the clock on
//! every write costs a lock and two additions, not a pass over the samples.
//!
//! - `lo` is certain: it assumes only that a stamp is not ahead of the server's clock and that
//!   the monotonic clock does not run fast. A coordinator's clock reading is never written
//!   ahead of it (`Coordinator::now_ms`).
//! - `hi` also assumes a stamp at most `date_lag` older than the request (a cached `Date`),
//!   and that the monotonic clock did not stop since the sample (a paused VM whose wall and
//!   monotonic clocks both stopped leaves old samples looking recent and their `hi` too low:
//!   the answers after it prove it, see [`ClockSamples::answered_since`]).
//!
//! Both are the [`AGREEMENT`]-th tightest bounds of the recent samples, so that two bad
//! stamps move neither.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One answer's evidence: sent and received on the coordinator's monotonic clock, and the
/// store's clock when it answered (epoch µs, truncated to the store's resolution).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sample {
    pub sent: Instant,
    pub received: Instant,
    pub date_us: i64,
}

impl Sample {
    /// An answer whose `Date` reads `date_s` (epoch seconds).
    pub(crate) fn dated(sent: Instant, received: Instant, date_s: u64) -> Sample {
        Sample { sent, received, date_us: date_s as i64 * 1_000_000 }
    }
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

/// The recent clock samples of one store client, shared with its coordinators.
#[derive(Debug)]
pub struct ClockSamples {
    inner: Mutex<Inner>,
    /// How far the store's clock may be past a stamp: 1 s for an HTTP `Date`, 1 µs for a clock
    /// read in this process (the embedded store's reference clock).
    resolution_us: i64,
    /// Whether a stamp may be taken before the request arrived (`date_lag` applies).
    lagged: bool,
    /// How many samples must agree on a bound ([`AGREEMENT`] for stamps that may be bad; one
    /// for a clock read in this process).
    agreement: usize,
    /// Held by the one write that reads the store for evidence while there is too little: the
    /// other writes of the client wait for its answers instead of each reading for its own.
    reading: tokio::sync::Mutex<()>,
}

impl Default for ClockSamples {
    /// The evidence of a remote store's `Date` headers: second resolution, stamps possibly late.
    fn default() -> Self {
        ClockSamples {
            inner: Mutex::default(),
            resolution_us: 1_000_000,
            lagged: true,
            agreement: AGREEMENT,
            reading: Default::default(),
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    samples: VecDeque<Sample>,
    /// What the bounds' instants are counted from (the first sample's send).
    epoch: Option<Instant>,
    /// The agreed bounds, until the next sample (or the first to age out).
    cached: Option<Cached>,
    /// The highest agreed `lo` so far, and when the oldest sample it could rest on ages out: a
    /// certain lower bound stays certain while its evidence is recent, so `lo` never moves
    /// down when a sample it rested on is evicted (the sample cap) or, with fewer samples than
    /// the agreement, a new one is lower. Every clock reading of the client's coordinators
    /// then only moves forward, and none is written below an earlier one.
    floor: Option<(i64, Instant)>,
}

#[derive(Debug, Clone, Copy)]
struct Cached {
    bounds: StoreClock,
    lag_us: i64,
    /// The oldest sample counted ages out then.
    until: Instant,
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

/// The agreed bounds on the store's clock: at the monotonic instant `x` it reads between
/// `x + lo` and `x + hi` (µs since `epoch`), [`AGREEMENT`] recent samples agreeing on each
/// (all of them when fewer could be had; one suffices for exact samples).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StoreClock {
    epoch: Instant,
    lo: i64,
    hi: i64,
    /// Recent samples counted.
    pub samples: usize,
}

/// µs from `epoch` to `at` (negative before it).
fn micros(epoch: Instant, at: Instant) -> i64 {
    match at.checked_duration_since(epoch) {
        Some(d) => d.as_micros() as i64,
        None => -(epoch.duration_since(at).as_micros() as i64),
    }
}

impl StoreClock {
    /// The store's clock is at least this at `at` (epoch µs).
    pub(crate) fn lo_at(&self, at: Instant) -> i64 {
        micros(self.epoch, at) + self.lo
    }

    /// The store's clock is at most this at `at` (epoch µs).
    pub(crate) fn hi_at(&self, at: Instant) -> i64 {
        micros(self.epoch, at) + self.hi
    }

    /// The offset `store - coordinator` (ms) for a coordinator whose clock reads `wall_us` at
    /// `at`: `lo` rounded down, `hi` up.
    pub(crate) fn offset(&self, at: Instant, wall_us: i64) -> Offset {
        Offset {
            lo: (self.lo_at(at) - wall_us).div_euclid(1000),
            hi: (self.hi_at(at) - wall_us + 999).div_euclid(1000),
        }
    }
}

/// What the recent samples say of a coordinator's clock (tests).
#[cfg(test)]
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
    /// The evidence of a clock read in this process as the store answers (the embedded store's
    /// reference clock): exact to the µs, and never stamped before the request.
    pub fn exact() -> Self {
        ClockSamples {
            inner: Mutex::default(),
            resolution_us: 1,
            lagged: false,
            agreement: 1,
            reading: Default::default(),
        }
    }

    /// How many recent samples a coordinator must have before it judges (and how many must
    /// agree on each bound).
    pub(crate) fn agreement(&self) -> usize {
        self.agreement
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn record(&self, s: Sample) {
        let mut q = self.lock();
        if q.samples.len() >= MAX_SAMPLES {
            q.samples.pop_front();
        }
        q.epoch.get_or_insert(s.sent);
        q.samples.push_back(s);
        q.cached = None;
    }

    /// Makes every sample `by` older, as if this process had been idle (or frozen) that long.
    /// For tests of the evidence's age bound.
    #[doc(hidden)]
    pub fn backdate(&self, by: Duration) {
        let mut q = self.lock();
        for s in q.samples.iter_mut() {
            if let (Some(sent), Some(received)) = (s.sent.checked_sub(by), s.received.checked_sub(by)) {
                (s.sent, s.received) = (sent, received);
            }
        }
        q.cached = None;
        q.floor = None;
    }

    /// The allowance for a late stamp that applies to these samples (µs).
    fn lag_us(&self, lag_ms: i64) -> i64 {
        if self.lagged {
            lag_ms * 1000
        } else {
            0
        }
    }

    /// The bounds one sample puts on the store's clock, as `lo`, `hi` of a [`StoreClock`].
    fn interval(&self, epoch: Instant, s: &Sample, lag_us: i64) -> (i64, i64) {
        (s.date_us - micros(epoch, s.received), s.date_us + self.resolution_us + lag_us - micros(epoch, s.sent))
    }

    /// The agreed bounds on the store's clock ([`StoreClock`]); `None` without a recent sample.
    /// `lag_ms`: the allowance for a late `Date`. Cached until the next sample. A sample whose
    /// `hi` lies below the agreed `lo` is proven stale (the monotonic clock stopped since it,
    /// or its stamp was later than the allowance) and is dropped: it would hold `hi` too low.
    /// (It is never one of the samples `lo` rests on, so `lo` stays as it was.)
    pub(crate) fn store_clock(&self, now: Instant, lag_ms: i64) -> Option<StoreClock> {
        let lag_us = self.lag_us(lag_ms);
        let mut q = self.lock();
        if let Some(c) = q.cached.filter(|c| c.lag_us == lag_us && now < c.until) {
            return Some(c.bounds);
        }
        q.cached = None;
        let epoch = q.epoch?;
        let fresh = |s: &Sample| now.saturating_duration_since(s.received) < MAX_AGE;
        let n = q.samples.iter().rev().take_while(|s| fresh(s)).count();
        if n == 0 {
            return None;
        }
        // Without allocating: this runs once per answer.
        let (mut los, mut his) = ([0i64; MAX_SAMPLES], [0i64; MAX_SAMPLES]);
        let start = q.samples.len() - n;
        for (i, s) in q.samples.range(start..).enumerate() {
            (los[i], his[i]) = self.interval(epoch, s, lag_us);
        }
        // With fewer answers than the agreement (the store could not give more), all of them:
        // the k-th largest `lo` and the k-th smallest `hi`.
        let lo = *los[..n].select_nth_unstable_by(self.agreement.min(n) - 1, |a, b| b.cmp(a)).1;
        let oldest_fresh = q.samples[q.samples.len() - n].received;
        let lo = match q.floor {
            Some((f, until)) if now < until && f >= lo => f,
            _ => {
                q.floor = Some((lo, oldest_fresh + MAX_AGE));
                lo
            }
        };
        let stale = |s: &Sample| self.interval(epoch, s, lag_us).1 < lo;
        let kept = if his[..n].iter().any(|&h| h < lo) {
            q.samples.retain(|s| !(fresh(s) && stale(s)));
            let mut m = 0;
            for (i, s) in q.samples.iter().rev().take_while(|s| fresh(s)).enumerate() {
                his[i] = self.interval(epoch, s, lag_us).1;
                m += 1;
            }
            m
        } else {
            n
        };
        let hi = *his[..kept].select_nth_unstable(self.agreement.min(kept) - 1).1;
        let oldest = q.samples[q.samples.len() - kept].received;
        let bounds = StoreClock { epoch, lo, hi, samples: kept };
        q.cached = Some(Cached { bounds, lag_us, until: oldest + MAX_AGE });
        Some(bounds)
    }

    /// The answers sent at or after `sent` (a write's own answer among them), checked against
    /// the agreed bounds `agreed`: when one of them puts the store's clock certainly above
    /// `agreed`'s `hi`, the older samples are stale (a pause that stopped this machine's wall
    /// and monotonic clocks alike, a thawed VM, leaves them looking recent) and `agreed`'s `hi`
    /// may be too low; then `agreed` with `hi` raised to the largest of those answers' own
    /// bounds, which do not rest on anything older than the write. `None`: no contradiction.
    pub(crate) fn answered_since(&self, sent: Instant, lag_ms: i64, agreed: &StoreClock) -> Option<StoreClock> {
        let lag_us = self.lag_us(lag_ms);
        let q = self.lock();
        let (mut proven, mut hi) = (false, agreed.hi);
        for s in q.samples.iter().rev().take_while(|s| s.received >= sent).filter(|s| s.sent >= sent) {
            let (l, h) = self.interval(agreed.epoch, s, lag_us);
            proven |= l > agreed.hi;
            hi = hi.max(h);
        }
        proven.then_some(StoreClock { hi, ..*agreed })
    }

    /// The turn to read the store for evidence: one write at a time, so that many writes
    /// finding too little evidence at once (a new process's workers) make one read each turn,
    /// not one each.
    pub(crate) async fn reading_turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.reading.lock().await
    }

    /// The offset of the clock `clock_at` (epoch ms at a monotonic instant) from the server's,
    /// as the intersection of the recent samples' intervals; when they disagree (a clock was
    /// stepped), the newest sample alone. `None` without a recent sample. `lag_ms`: the
    /// allowance for a late `Date`. (What the metrics show: tight, and sensitive to one bad
    /// stamp; the check and the clock's corrections use [`ClockSamples::store_clock`].)
    pub(crate) fn offset(&self, now: Instant, clock_at: impl Fn(Instant) -> i64, lag_ms: i64) -> Option<Offset> {
        let lag_us = self.lag_us(lag_ms);
        let q = self.lock();
        let mut newest = None;
        let mut both = Offset { lo: i64::MIN, hi: i64::MAX };
        for s in q.samples.iter().rev().take_while(|s| now.saturating_duration_since(s.received) < MAX_AGE) {
            let o = Offset {
                lo: (s.date_us / 1000) - clock_at(s.received),
                hi: (s.date_us + self.resolution_us + lag_us + 999) / 1000 - clock_at(s.sent),
            };
            newest.get_or_insert(o);
            both = Offset { lo: both.lo.max(o.lo), hi: both.hi.min(o.hi) };
        }
        let newest = newest?;
        Some(if both.lo <= both.hi { both } else { newest })
    }

    /// The intersection and the agreed bounds, for the clock `clock_at` (tests).
    #[cfg(test)]
    pub(crate) fn evidence(&self, now: Instant, clock_at: impl Fn(Instant) -> i64, lag_ms: i64) -> Option<Evidence> {
        let offset = self.offset(now, &clock_at, lag_ms)?;
        let sc = self.store_clock(now, lag_ms)?;
        Some(Evidence { offset, samples: sc.samples, agreed: sc.offset(now, clock_at(now) * 1000) })
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
        c.record(Sample::dated(at(base, 290), at(base, 310), 10_000));
        let o = c.offset(at(base, 1000), clock, DATE_LAG_MS).unwrap();
        assert_eq!((o.lo, o.hi), (-310, 1000 + DATE_LAG_MS - 290));
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
            c.record(Sample::dated(at(base, phase - 5), at(base, phase + 5), server_ms / 1000));
        }
        let o = c.offset(at(base, 1000), clock, DATE_LAG_MS).unwrap();
        assert!(o.lo >= -5_000 - 1000 && o.hi <= -5_000 + 1_000, "{o:?}");
        assert!(o.beyond(200), "{o:?}");
    }

    #[test]
    fn a_stepped_clock_falls_back_to_the_newest_sample() {
        let c = ClockSamples::default();
        let base = Instant::now();
        c.record(Sample::dated(at(base, 0), at(base, 10), 10_000));
        c.record(Sample::dated(at(base, 20), at(base, 30), 20_000));
        let clock = |i: Instant| 10_000_000 + i.saturating_duration_since(base).as_millis() as i64;
        let o = c.offset(at(base, 1000), clock, DATE_LAG_MS).unwrap();
        assert!(o.lo > 9_000_000, "{o:?}");
    }

    #[test]
    fn one_late_date_does_not_refuse_but_several_agreeing_answers_do() {
        let c = ClockSamples::default();
        let base = Instant::now();
        // Our clock runs 2 s ahead of the server's; answers at three phases say so.
        let clock = |i: Instant| 10_002_000 + i.saturating_duration_since(base).as_millis() as i64;
        c.record(Sample::dated(at(base, 95), at(base, 105), 10_000));
        // One answer stamped 2 s early (a server clock ahead): alone it says ours is right.
        c.record(Sample::dated(at(base, 200), at(base, 210), 10_002));
        for phase in [400u64, 700] {
            let e = c.evidence(at(base, 1000), clock, DATE_LAG_MS).unwrap();
            assert!(!e.agreed.beyond(200), "fewer than three agree: {e:?}");
            c.record(Sample::dated(at(base, phase - 5), at(base, phase + 5), 10_000));
        }
        // Three agree: refused, the early stamp notwithstanding.
        let e = c.evidence(at(base, 1000), clock, DATE_LAG_MS).unwrap();
        assert!(e.agreed.beyond(200) && e.samples == 4, "{e:?}");
    }

    #[test]
    fn late_answers_that_certain_bounds_contradict_are_dropped() {
        let c = ClockSamples::default();
        let base = Instant::now();
        // An honest clock: our clock equals the server's.
        let clock = |i: Instant| 10_000_000 + i.saturating_duration_since(base).as_millis() as i64;
        for phase in [100u64, 400, 700] {
            c.record(Sample::dated(at(base, phase - 5), at(base, phase + 5), 10_000));
        }
        // Answers stamped 2 s late (a cached `Date`) say our clock is ahead. But three answers
        // put the server's clock certainly above what theirs allow even with the allowance for
        // a late stamp: they are dropped, one or three of them.
        for (n, phase) in [800u64, 820, 840].into_iter().enumerate() {
            c.record(Sample::dated(at(base, phase), at(base, phase + 10), 9_998));
            let e = c.evidence(at(base, 1000), clock, DATE_LAG_MS).unwrap();
            assert!(e.offset.beyond(200), "the intersection would refuse: {e:?}");
            assert!(!e.agreed.beyond(200) && e.samples == 3, "after {} late answers: {e:?}", n + 1);
        }
    }

    #[test]
    fn with_fewer_answers_than_the_agreement_all_must_agree() {
        let c = ClockSamples::default();
        let base = Instant::now();
        let clock = |i: Instant| 10_000_000 + i.saturating_duration_since(base).as_millis() as i64;
        c.record(Sample::dated(at(base, 0), at(base, 10), 9_990));
        let e = c.evidence(at(base, 1000), clock, DATE_LAG_MS).unwrap();
        assert!(e.agreed.beyond(200) && e.samples == 1, "{e:?}");
        c.record(Sample::dated(at(base, 20), at(base, 30), 10_000));
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
            let s = Sample::dated(at(base, i * 10), at(base, i * 10 + (x >> 60)), 9_998 + (x >> 33) % 5);
            c.record(s);
            all.push(s);
        }
        let kept = &all[all.len() - MAX_SAMPLES..];
        let date = |s: &Sample| s.date_us / 1000;
        let mut los: Vec<i64> = kept.iter().map(|s| date(s) - clock(s.received)).collect();
        let mut his: Vec<i64> = kept.iter().map(|s| date(s) + 1000 + DATE_LAG_MS - clock(s.sent)).collect();
        los.sort_unstable_by(|a, b| b.cmp(a));
        // The samples whose `hi` is below the agreed `lo` are proven stale and dropped.
        his.retain(|&h| h >= los[AGREEMENT - 1]);
        his.sort_unstable();
        assert!(his.len() < MAX_SAMPLES, "dates 4 s apart: some samples contradict the others");
        let e = c.evidence(at(base, 1000), clock, DATE_LAG_MS).unwrap();
        assert_eq!(e.samples, his.len());
        assert_eq!(e.agreed, Offset { lo: los[AGREEMENT - 1], hi: his[AGREEMENT - 1] });
    }

    #[test]
    fn the_allowance_for_a_late_date_is_a_parameter() {
        let c = ClockSamples::default();
        let base = Instant::now();
        // Our clock is 1.5 s ahead of the stamps: beyond with 250 ms of allowance, not with 2 s.
        let clock = |i: Instant| 10_001_500 + i.saturating_duration_since(base).as_millis() as i64;
        for phase in [10u64, 20, 30] {
            c.record(Sample::dated(at(base, phase - 5), at(base, phase + 5), 10_000));
        }
        assert!(c.evidence(at(base, 1000), clock, 250).unwrap().agreed.beyond(200));
        assert!(!c.evidence(at(base, 1000), clock, 2_000).unwrap().agreed.beyond(200));
    }

    /// A store whose clock reads `store_ms` at `base`, answering requests sent at `sent_ms`
    /// (after `base`) that spend `rtt_ms` in flight, stamped `late_ms` before it answered.
    fn answer(base: Instant, store_ms: i64, sent_ms: u64, rtt_ms: u64, late_ms: i64) -> Sample {
        let stamp_at = sent_ms as i64 + rtt_ms as i64 / 2 - late_ms;
        Sample::dated(at(base, sent_ms), at(base, sent_ms + rtt_ms), ((store_ms + stamp_at) / 1000) as u64)
    }

    fn lcg(x: &mut u64) -> u64 {
        *x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        *x >> 33
    }

    #[test]
    fn the_bounds_hold_the_store_clock_and_narrow_with_traffic() {
        let mut x = 11u64;
        for run in 0..200 {
            let c = ClockSamples::default();
            let base = Instant::now();
            let store_ms = 1_800_000_000_000 + (lcg(&mut x) % 100_000) as i64;
            // Answers every 10-60 ms, 1-20 ms round trips, stamps up to the allowance late; a
            // third of the runs have two answers stamped far later (a cached `Date`).
            let mut t = 0;
            for i in 0..40 {
                t += 10 + lcg(&mut x) % 50;
                let late = if run % 3 == 0 && i % 17 == 5 { 3_000 } else { (lcg(&mut x) % 250) as i64 };
                c.record(answer(base, store_ms, t, 1 + lcg(&mut x) % 20, late));
                let now = at(base, t + 25);
                let b = c.store_clock(now, DATE_LAG_MS).unwrap();
                let truth = (store_ms + (t + 25) as i64) * 1000;
                assert!(b.lo_at(now) <= truth && truth <= b.hi_at(now), "run {run}, answer {i}: {b:?} vs {truth}");
            }
            let b = c.store_clock(at(base, t + 25), DATE_LAG_MS).unwrap();
            // Over about a second of phases, about the allowance plus the round trips wide.
            assert!(b.hi - b.lo < 700_000, "run {run}: {} ms wide", (b.hi - b.lo) / 1000);
        }
    }

    #[test]
    fn the_low_bound_is_certain_whatever_the_stamps_lateness() {
        let mut x = 5u64;
        let c = ClockSamples::default();
        let base = Instant::now();
        let store_ms = 1_800_000_000_777;
        for i in 0..64u64 {
            // Every stamp is late, by up to 10 s: `hi` is then wrong, `lo` never.
            c.record(answer(base, store_ms, i * 7, 3, (lcg(&mut x) % 10_000) as i64));
            let now = at(base, i * 7 + 3);
            let b = c.store_clock(now, DATE_LAG_MS).unwrap();
            assert!(b.lo_at(now) <= (store_ms + (i * 7 + 3) as i64) * 1000, "{b:?}");
        }
    }

    #[test]
    fn a_pause_of_both_clocks_is_caught_by_the_next_answers() {
        let c = ClockSamples::default();
        let base = Instant::now();
        let store_ms = 1_800_000_000_000;
        // Steady answers for a second: the bounds are a few hundred ms wide.
        for i in 0..40u64 {
            c.record(answer(base, store_ms, i * 25, 2, 0));
        }
        // The machine is frozen for 3 s: its monotonic clock (and wall clock) stopped, the
        // store's did not. Every answer from now on carries a clock 3 s further on.
        let thawed = store_ms + 3_000;
        let before = c.store_clock(at(base, 1_000), DATE_LAG_MS).unwrap();
        let sent = at(base, 1_010);
        c.record(answer(base, thawed, 1_010, 2, 0));
        let now = at(base, 1_012);
        let agreed = c.store_clock(now, DATE_LAG_MS).unwrap();
        let truth = |t: u64| (thawed + t as i64) * 1000;
        assert!(agreed.hi_at(sent) < truth(1_010), "the old evidence alone is stale: {agreed:?}");
        assert!(agreed.lo < before.lo + 1_000_000, "one answer does not carry the agreed bounds: {agreed:?}");
        // The write's own answer proves it: its bounds replace the stale `hi`.
        let fresh = c.answered_since(sent, DATE_LAG_MS, &agreed).expect("contradiction found");
        assert!(fresh.hi_at(sent) >= truth(1_010), "{fresh:?}");
        assert_eq!(fresh.lo, agreed.lo);
        // A write sent before that answer's request does not count it as its own.
        assert!(c.answered_since(at(base, 1_009), DATE_LAG_MS, &agreed).is_some());
        assert!(c.answered_since(at(base, 1_011), DATE_LAG_MS, &agreed).is_none());
        // Three answers after the pause agree: the stale samples are dropped, and the agreed
        // bounds hold the store's clock again.
        for t in [1_030u64, 1_050] {
            c.record(answer(base, thawed, t, 2, 0));
        }
        let now = at(base, 1_060);
        let b = c.store_clock(now, DATE_LAG_MS).unwrap();
        assert!(b.lo_at(now) <= truth(1_060) && truth(1_060) <= b.hi_at(now), "{b:?}");
        assert_eq!(b.samples, 3, "{b:?}");
    }

    #[test]
    fn the_bounds_are_cached_until_the_next_answer_or_until_one_ages_out() {
        let c = ClockSamples::default();
        let base = Instant::now();
        c.record(answer(base, 1_800_000_000_000, 0, 2, 0));
        let first = c.store_clock(at(base, 10), DATE_LAG_MS).unwrap();
        assert!(c.lock().cached.is_some());
        assert_eq!(c.store_clock(at(base, 20), DATE_LAG_MS), Some(first));
        c.record(answer(base, 1_800_000_000_000, 500, 2, 0));
        assert!(c.lock().cached.is_none(), "an answer invalidates the cache");
        let second = c.store_clock(at(base, 600), DATE_LAG_MS).unwrap();
        assert_eq!(second.samples, 2);
        // The first answer ages out: one sample left, without a new answer.
        let later = at(base, 2) + MAX_AGE;
        assert_eq!(c.store_clock(later, DATE_LAG_MS).unwrap().samples, 1);
        assert_eq!(c.store_clock(at(base, 503) + MAX_AGE, DATE_LAG_MS), None);
    }

    #[test]
    fn exact_samples_bound_the_clock_to_the_round_trip() {
        let c = ClockSamples::exact();
        let base = Instant::now();
        // The reference clock read 1_800_000_000_000_400 µs as it answered, between 0 and 3 ms.
        c.record(Sample { sent: at(base, 0), received: at(base, 3), date_us: 1_800_000_000_000_400 });
        let b = c.store_clock(at(base, 3), DATE_LAG_MS).unwrap();
        assert_eq!((b.lo_at(at(base, 3)), b.hi_at(at(base, 3))), (1_800_000_000_000_400, 1_800_000_000_003_401));
        // Our clock reads the same: no offset beyond a round trip, no allowance for a late stamp.
        let o = b.offset(at(base, 3), 1_800_000_000_002_000);
        assert_eq!((o.lo, o.hi), (-2, 2));
    }
}
