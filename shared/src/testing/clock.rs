//! A virtual clock: monotonic time is tokio's (virtual in a paused runtime), wall time follows
//! it from a chosen epoch, with an offset, steps and drift of its own.

use std::sync::Mutex;
use std::time::Instant;

use crate::clock::{Clock, SystemClock};

/// A [`Clock`] for tests and simulations. Wall time starts at the epoch given to
/// [`SimClock::new`] and advances with tokio's clock (so with `tokio::time::advance` and
/// sleeps in a paused runtime), plus an offset ([`SimClock::step`]) and a drift rate
/// ([`SimClock::set_drift_ppm`]). Several coordinators may each have their own `SimClock`: their
/// monotonic time is the same, their wall times differ as set.
#[derive(Debug)]
pub struct SimClock {
    anchor: Mutex<Anchor>,
}

#[derive(Debug, Clone, Copy)]
struct Anchor {
    at: Instant,
    wall_us: i64,
    drift_ppm: i64,
}

impl SimClock {
    /// A clock whose wall time reads `epoch_ms` now. Create it inside the runtime (its
    /// monotonic time is the runtime's).
    pub fn new(epoch_ms: i64) -> Self {
        SimClock { anchor: Mutex::new(Anchor { at: tokio_now(), wall_us: epoch_ms * 1000, drift_ppm: 0 }) }
    }

    /// A clock that reads `offset_ms` ahead of `other` (behind when negative), drifting as it does.
    pub fn offset_from(other: &SimClock, offset_ms: i64) -> Self {
        let c = SimClock::new(0);
        let a = *other.anchor();
        *c.anchor() = Anchor { wall_us: a.wall_us + offset_ms * 1000, ..a };
        c
    }

    fn anchor(&self) -> std::sync::MutexGuard<'_, Anchor> {
        self.anchor.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Moves the wall time by `delta_ms` at once (an NTP step; negative: backwards).
    pub fn step(&self, delta_ms: i64) {
        self.anchor().wall_us += delta_ms * 1000;
    }

    /// From now on, the wall time runs `ppm` millionths faster than the monotonic time (slower
    /// when negative).
    pub fn set_drift_ppm(&self, ppm: i64) {
        let now = tokio_now();
        let mut a = self.anchor();
        let wall = wall_at(&a, now);
        *a = Anchor { at: now, wall_us: wall, drift_ppm: ppm };
    }
}

/// tokio's clock, which a simulation pauses (the machine's monotonic clock as the core sees it).
fn tokio_now() -> Instant {
    SystemClock.now()
}

fn wall_at(a: &Anchor, now: Instant) -> i64 {
    let d = now.saturating_duration_since(a.at).as_micros() as i64;
    a.wall_us + d + d * a.drift_ppm / 1_000_000
}

impl Clock for SimClock {
    fn wall_us(&self) -> i64 {
        wall_at(&self.anchor(), tokio_now())
    }

    fn now(&self) -> Instant {
        tokio_now()
    }
}
