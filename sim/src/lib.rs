//! Deterministic simulation of the lease protocol (sim/README.md; DESIGN.md, "Simulation").
//!
//! One seed is one run: several coordinators (the real [`Coordinator`], with every feature it
//! has) share one simulated store ([`SimStore`]: DynamoDB's conditional writes, a lagging index,
//! late TTL deletion, and lost answers, delayed duplicates, refused connections, throttles and
//! stalls), each with its own skewed and drifting clock ([`SimClock`]), all on one thread in a
//! tokio runtime whose time is virtual. Clients take plain, waiting, fail-closed, keep-alive,
//! queued and batch leases, semaphore slots and leases held with `HeldLease`, write to a guarded
//! resource with their fences, pause past their leases and crash; processes are cut off from
//! the store, and clocks step, jump and go wrong unseen. Everything random comes from the seed,
//! so a seed replays exactly.
//!
//! A checker then reads the history (what each client was told, the store's applied writes)
//! and reports every violation of the protocol's promises (see [`check`]).

use std::collections::BTreeMap;
use std::time::Duration;

mod check;
mod finale;
mod node;
mod run;
mod session;
mod sfn;
mod store_log;
mod violation;
mod world;

pub use violation::Violation;

/// The wall time every run starts at (2027-01-15).
pub(crate) const EPOCH_MS: i64 = 1_800_000_000_000;
/// The skew margin of every coordinator; honest clocks stay within half of it of the truth.
pub(crate) const SKEW_MARGIN_MS: u64 = 200;
/// The store client's attempt timeout.
pub(crate) const ATTEMPT_TIMEOUT: Duration = Duration::from_millis(800);

/// What to run.
#[derive(Debug, Clone)]
pub struct Settings {
    pub seed: u64,
    /// Library calls to make (the run stops starting new ones after that).
    pub ops: u64,
    /// Honest coordinators (a coordinator with a clock beyond the margin may come on top).
    pub coordinators: usize,
    /// Probability of each store fault per request.
    pub fault_rate: f64,
    /// A hot key: a fifth of the sessions take one key again and again with a long wait and a
    /// short hold, so that in-process lines form in every coordinator (one seed in eight: the
    /// other seeds' histories stay as they were).
    pub hot_key: bool,
    /// Clock jumps: now and then an honest coordinator's clock is stepped far beyond the
    /// margin (seconds to minutes, mostly ahead: a bad NTP source, a restored VM) and stepped
    /// back a few seconds later; whatever it writes meanwhile must be refused or harmless (one
    /// seed in eight, another class than the hot key's and the regression seeds').
    pub clock_jumps: bool,
    /// A blind clock: a coordinator whose clock runs 30 to 100 s ahead and whose store answers
    /// carry `Date` stamps off by as much (they pass through something with the same wrong
    /// clock), so its clock check sees nothing. It judges leases expired early and takes keys
    /// over their holders, as any lock whose clocks are wrong does: the fence is what protects
    /// the guarded resource then, and the others must never copy its fence far ahead nor let
    /// TTL delete an item before the clocks passed its fence (one seed in eight, a class of its
    /// own).
    pub blind_clock: bool,
    /// Semaphores: a fifth of the sessions take a slot of a semaphore (2 or 3 slots), a tenth
    /// of the plain leases are taken on a semaphore's key, and a quarter of the force-releases
    /// land on one. A class of its own (one seed in eight), and half of the clock-jump, of the
    /// hot-key and of the blind-clock seeds (`seed % 16` 2, 15 and 11), so that slots meet those
    /// faults: with the blind clock, slots held with `HeldLease` and a coordinator that takes
    /// slots over their holders (its own holds are the clock error's, and the checker leaves
    /// them out of the count). The other half of those classes, where the regression seeds 7,
    /// 26, 211 and 378 are, keeps its histories.
    pub semaphores: bool,
    /// Held leases: a tenth of the sessions hold a lease with [`leasehold::HeldLease`] (the Rust
    /// library's holder: renewed in the background, the work run under `run`, released or
    /// dropped), and now and then a process is cut off from the store for 0.5-5 s (its holders'
    /// renewals fail until their safe time ends). In the blind-clock class (no regression seed
    /// there: the others' histories stay as they were).
    pub held_leases: bool,
}

impl Settings {
    pub fn new(seed: u64) -> Self {
        Settings {
            seed,
            ops: 5000,
            coordinators: 3,
            fault_rate: 0.02,
            hot_key: seed % 8 == 7,
            clock_jumps: seed % 8 == 2,
            blind_clock: seed % 8 == 3,
            semaphores: seed % 8 == 6 || matches!(seed % 16, 2 | 11 | 15),
            held_leases: seed % 8 == 3,
        }
    }
}

/// The shapes of the sessions' acquires, each of which some seeds of a run must be granted
/// (FINDINGS.md, "A class of the simulation that ran nothing").
pub const GRANTED_SHAPES: [&str; 6] = ["plain", "fail_closed", "kept_alive", "slot", "slot_kept_alive", "slot_own_id"];

/// What one run did and found.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub seed: u64,
    pub operations: u64,
    pub violations: Vec<Violation>,
    /// Known findings of the protocol (reported, not violations), by kind.
    pub findings: BTreeMap<&'static str, u64>,
    /// Faults injected, by name.
    pub faults: BTreeMap<&'static str, u64>,
    /// Leases the sessions were granted, by the shape of their acquire ([`GRANTED_SHAPES`]): a
    /// shape never granted is a class of the run that exercised nothing.
    pub granted: BTreeMap<&'static str, u64>,
    /// A hash of the run's history: the same on every replay of the seed.
    pub trace_hash: u64,
    /// Virtual time the run took (ms).
    pub virtual_ms: u64,
}

/// Runs one seed on a fresh current-thread runtime with paused time.
pub fn run(settings: &Settings) -> Outcome {
    leasehold::testing::seed(settings.seed);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime");
    let out = rt.block_on(run::simulate(settings.clone()));
    drop(rt);
    leasehold::testing::unseed();
    out
}
