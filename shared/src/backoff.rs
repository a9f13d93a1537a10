//! Randomised pauses: exponential backoff for retries, and uniform jitter for pacing.

use std::time::Duration;

/// Exponential backoff with "equal jitter": each pause is uniform in [d/2, d].
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    pub(crate) fn new(base: Duration, max: Duration) -> Self {
        Backoff { next: base, max }
    }

    pub(crate) fn next_pause(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        jitter(d)
    }
}

/// A uniform random duration in [d/2, d].
pub(crate) fn jitter(d: Duration) -> Duration {
    uniform(d / 2, d)
}

/// A uniform random duration in [lo, hi] (`lo` when `hi <= lo`).
pub(crate) fn uniform(lo: Duration, hi: Duration) -> Duration {
    let r = random_u64();
    let span = hi.saturating_sub(lo).as_nanos() as u64;
    lo + Duration::from_nanos(if span == 0 { 0 } else { r % (span + 1) })
}

/// 64 random bits: from the seeded generator of a simulation when one is set on this thread
/// (feature `testing`), otherwise from the operating system.
fn random_u64() -> u64 {
    #[cfg(feature = "testing")]
    if let Some(r) = crate::random::next_u64() {
        return r;
    }
    let mut b = [0u8; 8];
    if getrandom::fill(&mut b).is_ok() {
        u64::from_le_bytes(b)
    } else {
        0
    }
}
