//! How a waiting acquire paces its attempts on a held key (DESIGN.md, "Contention").
//!
//! DynamoDB cannot tell a waiter that a key was released, so waiting is polling, and every
//! poll is a request. Three rules keep waiters even and requests few:
//!
//! - **The key carries its poll period.** Every lease item records `poll_ms`, the period at
//!   which waiters poll that key, and a rejected attempt returns the item, so every waiter
//!   polls at the same rate: none gets ahead by polling faster.
//! - **The period is learned by the acquirers.** An acquire that contended writes the period
//!   moved towards `Config::poll_attempts` attempts per acquisition: up when it took more
//!   attempts, down when it took fewer (a small step each time). As all waiters share the period,
//!   the average over acquisitions settles near the target, whatever the number of waiters.
//!   Between attempts a waiter pauses a jittered period while it sees the key change hands,
//!   shortened the longer it has waited (so the longest waiter is the likeliest to try first
//!   after a release), and doubles the pause (up to `poll_max`) while the same lease stays on
//!   it.
//! - **A coordinator does not jump the queue it just left.** An acquire on a key that was
//!   contended a moment ago makes its first attempt after a random part of the period
//!   instead of at once, so a holder that releases and asks again competes with the waiters
//!   on equal terms rather than winning every time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::backoff::uniform;
use crate::clock::{Clock, SystemClock};

/// The attempts per acquisition `Config::poll_attempts` accepts: above 1 (at 1 the period
/// could only grow), and few enough that waiters still pace themselves.
pub const POLL_ATTEMPTS: std::ops::RangeInclusive<f64> = 1.1..=10.0;

/// `Config::poll_attempts` by default (DESIGN.md, "Contention": what the target trades).
pub(crate) const DEFAULT_POLL_ATTEMPTS: f64 = 2.5;

/// How strongly one acquisition moves the period: attempts - target, times this, is the
/// relative step.
const GAIN: f64 = 0.25;

/// The shortest poll period.
pub(crate) const MIN_PERIOD: Duration = Duration::from_millis(10);

/// How long a key counts as contended after an acquire last found it held.
const CONTENDED_FOR: Duration = Duration::from_secs(2);

/// Waiting this many periods halves a waiter's pause (see [`aged`]).
pub(crate) const AGING: f64 = 1.0;

/// Keys remembered at most; the least recently used half is dropped when full.
const MAX_KEYS: usize = 4096;

#[derive(Debug, Clone, Copy)]
struct KeyPace {
    /// The key's period as last seen on its item.
    period: Duration,
    contended_at: Instant,
}

/// What one coordinator remembers of the keys it found contended.
#[derive(Debug)]
pub(crate) struct Pacer {
    keys: Mutex<HashMap<String, KeyPace>>,
    clock: Arc<dyn Clock>,
}

impl Default for Pacer {
    fn default() -> Self {
        Pacer::new(Arc::new(SystemClock))
    }
}

/// The pacing of one acquire call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pace {
    /// The key's poll period.
    pub period: Duration,
    /// Somebody else held the key a moment ago: wait this long before the first attempt.
    pub courtesy: Option<Duration>,
}

/// The period an item advertises (`None`: never contended), within `[MIN_PERIOD, max]`: it
/// is advice written by other coordinators, never trusted beyond this coordinator's own
/// `poll_max`.
pub(crate) fn period_of(poll_ms: Option<u64>, max: Duration) -> Duration {
    poll_ms.map_or(MIN_PERIOD, Duration::from_millis).clamp(MIN_PERIOD, max.max(MIN_PERIOD))
}

/// The period an acquire that contended writes, when it succeeds with its `attempts`-th
/// attempt on a key whose period was `period`: a step proportional to how far `attempts` is
/// from `target` (so that the *average* over acquisitions settles on the target), at most
/// doubling or halving, within `[MIN_PERIOD, max]`.
pub(crate) fn next_period(period: Duration, attempts: u32, target: f64, max: Duration) -> Duration {
    let factor = (1.0 + GAIN * (attempts.max(1) as f64 - target)).clamp(0.5, 2.0);
    period.mul_f64(factor).clamp(MIN_PERIOD, max.max(MIN_PERIOD))
}

/// The pause of a waiter that has waited `waited` on a key whose period is `period`: the
/// period, shortened as the wait grows (halved after [`AGING`] periods of waiting, a third
/// after twice that, ...), so that whoever has waited longest is the likeliest to try first
/// after a release. Never below half of [`MIN_PERIOD`].
pub(crate) fn aged(period: Duration, waited: Duration) -> Duration {
    let periods = waited.as_secs_f64() / period.as_secs_f64().max(1e-3);
    period.div_f64(1.0 + periods / AGING).max(MIN_PERIOD / 2)
}

/// The waiting state of one acquire call: what it advertises on the item, how long it sleeps
/// after a held answer, and what it records when granted.
#[derive(Debug)]
pub(crate) struct Waiting<'a> {
    pacer: &'a Pacer,
    key: &'a str,
    poll_max: Duration,
    /// The attempts per acquisition the period is moved towards (`Config::poll_attempts`).
    target: f64,
    start: Instant,
    /// Attempts so far, counting the one under way.
    pub attempts: u32,
    courtesy: Option<Duration>,
    /// Whether this acquire has contended (it then advertises a period on its lease).
    contended: bool,
    /// The key's poll period as last seen.
    period: Duration,
    pause: Duration,
    /// The fence of the lease that held the key at the last rejection.
    held_by: Option<u64>,
}

impl<'a> Waiting<'a> {
    pub(crate) fn new(pacer: &'a Pacer, key: &'a str, poll_max: Duration, target: f64, start: Instant) -> Self {
        let pace = pacer.begin(key);
        Waiting {
            pacer,
            key,
            poll_max,
            target: if target.is_nan() {
                DEFAULT_POLL_ATTEMPTS
            } else {
                target.clamp(*POLL_ATTEMPTS.start(), *POLL_ATTEMPTS.end())
            },
            start,
            attempts: 0,
            courtesy: pace.courtesy,
            contended: false,
            period: pace.period,
            pause: pace.period,
            held_by: None,
        }
    }

    /// Before the first attempt on a key this coordinator found contended a moment ago: a
    /// random part of its period, so that it competes with the waiters instead of jumping ahead.
    pub(crate) async fn courtesy(&mut self, deadline: Instant) {
        if let Some(c) = self.courtesy.take() {
            self.contended = true;
            tokio::time::sleep(c.min(deadline.saturating_duration_since(self.pacer.clock.now()))).await;
        }
    }

    /// The period this attempt writes with its lease (`poll_ms`), when it contended.
    pub(crate) fn advertise(&self) -> Option<u64> {
        self.contended.then(|| next_period(self.period, self.attempts, self.target, self.poll_max).as_millis() as u64)
    }

    /// Granted by an item advertising `poll_ms`: remembered for this coordinator's next call.
    pub(crate) fn granted(&self, poll_ms: Option<u64>) {
        if poll_ms.is_some() {
            self.pacer.contended(self.key, period_of(poll_ms, self.poll_max));
        }
    }

    /// Held by the lease of fence `fence`, whose item advertises `poll_ms` and expires in
    /// `until_expiry`: how long to sleep before the next attempt, or `None` once `deadline`
    /// has passed. While the key changes hands the pause is the advertised period aged by this
    /// call's wait; while one lease stays on it, the pause doubles up to `poll_max`. Never past
    /// the holder's known expiry (a crashed holder is replaced promptly) nor past `deadline`
    /// (one last attempt is made then).
    pub(crate) fn held(
        &mut self,
        fence: u64,
        poll_ms: Option<u64>,
        until_expiry: Option<Duration>,
        deadline: Instant,
    ) -> Option<Duration> {
        self.contended = true;
        self.period = period_of(poll_ms, self.poll_max);
        self.pacer.contended(self.key, self.period);
        let now = self.pacer.clock.now();
        if now >= deadline {
            return None;
        }
        self.pause = if self.held_by == Some(fence) {
            (self.pause * 2).min(self.poll_max.max(self.period))
        } else {
            aged(self.period, now.saturating_duration_since(self.start))
        };
        self.held_by = Some(fence);
        let mut sleep = uniform(self.pause / 2, self.pause + self.pause / 2);
        if let Some(u) = until_expiry {
            sleep = sleep.min(u);
        }
        Some(sleep.min(deadline - now))
    }
}

impl Pacer {
    pub(crate) fn new(clock: Arc<dyn Clock>) -> Self {
        Pacer { keys: Mutex::default(), clock }
    }

    /// The pacing for a new acquire of `key`.
    pub(crate) fn begin(&self, key: &str) -> Pace {
        let now = self.clock.now();
        let keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        match keys.get(key) {
            Some(p) => Pace {
                period: p.period,
                courtesy: (now.duration_since(p.contended_at) < CONTENDED_FOR)
                    .then(|| uniform(Duration::ZERO, p.period)),
            },
            None => Pace { period: MIN_PERIOD, courtesy: None },
        }
    }

    /// An attempt found `key` held, by an item advertising `period`.
    pub(crate) fn contended(&self, key: &str, period: Duration) {
        let now = self.clock.now();
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        if keys.len() >= MAX_KEYS && !keys.contains_key(key) {
            let mut ages: Vec<Instant> = keys.values().map(|p| p.contended_at).collect();
            ages.sort_unstable();
            let cut = ages[ages.len() / 2];
            keys.retain(|_, p| p.contended_at > cut);
        }
        keys.insert(key.to_string(), KeyPace { period, contended_at: now });
    }

    /// The period last seen for `key`.
    #[cfg(test)]
    fn period(&self, key: &str) -> Option<Duration> {
        self.keys.lock().unwrap_or_else(|e| e.into_inner()).get(key).map(|p| p.period)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn period_moves_towards_the_target_within_bounds() {
        let max = Duration::from_millis(500);
        assert_eq!(period_of(None, max), MIN_PERIOD);
        assert_eq!(period_of(Some(3), max), MIN_PERIOD);
        assert_eq!(period_of(Some(80), max), Duration::from_millis(80));
        assert_eq!(period_of(Some(u64::MAX), max), max, "advice from the item is bounded");
        let near = |d: Duration, ms: f64| (d.as_secs_f64() * 1000.0 - ms).abs() < 0.5;
        for target in [1.2, 2.5] {
            // Many attempts per acquisition: the period grows, at most doubling per step.
            assert_eq!(next_period(MIN_PERIOD, 20, target, max), MIN_PERIOD * 2);
            assert_eq!(next_period(max, 50, target, max), max);
            // Fewer attempts than the target: it shrinks, never below MIN_PERIOD.
            assert_eq!(next_period(MIN_PERIOD, 1, target, max), MIN_PERIOD);
        }
        // One step is a quarter of how far the attempts were from the target.
        let p = Duration::from_millis(100);
        assert!(near(next_period(p, 2, 1.2, max), 120.0), "{:?}", next_period(p, 2, 1.2, max));
        assert!(near(next_period(p, 1, 1.2, max), 95.0));
        assert!(near(next_period(p, 2, 2.5, max), 87.5), "a second attempt is below a target of 2.5");
        assert!(near(next_period(p, 4, 2.5, max), 137.5));
        assert!(near(next_period(p, 1, 2.5, max), 62.5));
    }

    #[test]
    fn the_longer_a_waiter_has_waited_the_shorter_its_pause() {
        let p = Duration::from_millis(80);
        assert_eq!(aged(p, Duration::ZERO), p);
        let close = |a: Duration, b: Duration| a.abs_diff(b) < Duration::from_micros(10);
        assert!(close(aged(p, p.mul_f64(AGING)), p / 2));
        assert!(close(aged(p, p.mul_f64(2.0 * AGING)), p / 3));
        assert!(aged(p, Duration::from_secs(3600)) >= MIN_PERIOD / 2);
    }

    #[test]
    fn a_recently_contended_key_gets_a_courtesy_pause_within_its_period() {
        let p = Pacer::default();
        assert!(p.begin("k").courtesy.is_none(), "an unknown key is not contended");
        p.contended("k", Duration::from_millis(40));
        for _ in 0..100 {
            let pace = p.begin("k");
            assert_eq!(pace.period, Duration::from_millis(40));
            assert!(pace.courtesy.is_some_and(|c| c <= pace.period), "{pace:?}");
        }
    }

    #[test]
    fn memory_stays_bounded() {
        let p = Pacer::default();
        for i in 0..(MAX_KEYS * 3) {
            p.contended(&format!("k{i}"), MIN_PERIOD);
        }
        assert!(p.keys.lock().unwrap().len() <= MAX_KEYS);
        assert!(p.period(&format!("k{}", MAX_KEYS * 3 - 1)).is_some(), "the newest key is kept");
    }
}
