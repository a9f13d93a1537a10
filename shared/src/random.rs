//! Seeded randomness for simulations (feature `testing`): when a thread has a seed, lease ids
//! and retry jitter come from it instead of the operating system, so that a seeded run on a
//! current-thread runtime repeats exactly. A bottom-layer module: `model` and `backoff` ask it.

use std::cell::Cell;

thread_local! {
    static RNG: Cell<Option<u64>> = const { Cell::new(None) };
}

/// Seeds this thread's generator (`None`: back to the operating system's randomness).
pub(crate) fn set_seed(seed: Option<u64>) {
    RNG.with(|r| r.set(seed));
}

/// The next value of this thread's seeded generator (`None`: none is set).
pub(crate) fn next_u64() -> Option<u64> {
    RNG.with(|r| {
        let mut s = r.get()?;
        let out = splitmix64(&mut s);
        r.set(Some(s));
        Some(out)
    })
}

/// SplitMix64: a small, fast, well-distributed generator (not for secrets).
pub(crate) fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
