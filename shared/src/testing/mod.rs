//! Testing without DynamoDB (feature `testing`): an in-memory store with DynamoDB's
//! semantics and injectable faults ([`SimStore`]), a virtual clock ([`SimClock`]), and a seeded
//! generator for everything the library draws at random ([`seed`]).
//!
//! Run the test in a current-thread tokio runtime with paused time
//! (`#[tokio::test(start_paused = true)]`, tokio's `test-util` feature): sleeps and timeouts
//! then take no real time, the runtime jumps to the next timer when every task waits, and a
//! 60 s lease expires in microseconds. [`SimClock`] reads its monotonic time from tokio's clock,
//! so `tokio::time::advance` (or a plain `sleep`) moves every coordinator's time; its wall time
//! can be offset, stepped or made to drift per coordinator.
//!
//! ```
//! # use std::{sync::Arc, time::Duration};
//! # use leasehold::{AcquireOptions, Config, Coordinator};
//! # use leasehold::testing::{SimClock, SimStore, Faults};
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! let clock = Arc::new(SimClock::new(1_800_000_000_000));
//! let store = SimStore::new(clock.clone(), Faults::none(), 7);
//! let config = Config { clock: clock.clone(), ..Config::default() };
//! let coord = Coordinator::new(Arc::new(store.handle()), config);
//! let lease = coord.acquire("report", "worker-1", Some(Duration::from_secs(60)), AcquireOptions::default()).await.unwrap();
//! tokio::time::sleep(Duration::from_secs(61)).await; // instant: the runtime's time is paused
//! let next = coord.acquire("report", "worker-2", Some(Duration::from_secs(60)), AcquireOptions::default()).await.unwrap();
//! assert!(next.fence > lease.fence);
//! # }
//! ```
//!
//! Everything here is deterministic for one seed as long as the runtime is current-thread:
//! the store draws its faults from its own seeded generator, and [`seed`] makes lease ids and
//! retry jitter come from a seeded generator on this thread.

mod clock;
mod store;

pub use clock::SimClock;
pub use store::{Applied, FaultCounts, Faults, SimStore};

/// Makes this thread's lease ids and retry jitter come from a generator seeded with `seed`
/// (until [`unseed`]), and starts the keep-alive and queue sweeps' shard rotations afresh, so
/// that a run on a current-thread runtime repeats exactly, alone or after other runs.
pub fn seed(seed: u64) {
    crate::random::set_seed(Some(seed));
    crate::keepalive::reset_rotation();
    crate::queue::reset_rotation();
}

/// Back to the operating system's randomness on this thread.
pub fn unseed() {
    crate::random::set_seed(None);
}

pub(crate) use crate::random::splitmix64;
