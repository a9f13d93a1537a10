//! Time. This module is the only one that reads a clock: everything else is passed a
//! [`Clock`] (in [`Config::clock`](crate::Config::clock)) and asks it, so the whole protocol
//! can run on a virtual clock (a paused tokio runtime, a simulation) as well as on the
//! machine's.
//!
//! Two readings, for two purposes:
//! - **wall time** (epoch µs/ms): what expiries, fences and TTLs are written in, and what other
//!   coordinators compare against. It may be wrong, stepped, or skewed; the `skew` module checks it
//!   against the store's.
//! - **monotonic time** ([`Instant`]): what deadlines, pauses, and a holder's `safe_until` are
//!   measured in. It is tokio's clock, so that sleeps and timeouts (tokio's timer) agree with it:
//!   in a paused runtime it is virtual.

use std::fmt;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

pub(crate) mod skew;

pub use skew::ClockSamples;
pub(crate) use skew::{Sample, DATE_LAG_MS};

/// A source of wall and monotonic time.
///
/// Implementations must keep [`Clock::now`] on tokio's timer clock (sleeps and timeouts are
/// tokio's); the wall time is theirs to choose (an offset, drift, a step).
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// Wall time in epoch microseconds.
    fn wall_us(&self) -> i64;

    /// Monotonic time.
    fn now(&self) -> Instant;

    /// Wall time in epoch milliseconds.
    fn wall_ms(&self) -> i64 {
        self.wall_us().div_euclid(1000)
    }
}

/// The machine's clock: `SystemTime` for wall time, tokio's clock for monotonic time.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn wall_us(&self) -> i64 {
        SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as i64).unwrap_or(0)
    }

    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }
}
