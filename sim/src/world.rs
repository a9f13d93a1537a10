//! The shared state of a run: the history being written, the run's random draws, and what
//! clients were told and did (grants, ends, writes to the guarded resource).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use leasehold::testing::{SimClock, SimStore};
use leasehold::{Coordinator, Lease, LeaseId};

use crate::violation::Violation;
use crate::Settings;

/// One thing a client was told or did, in the order it happened.
#[derive(Debug, Clone)]
pub(crate) enum Event {
    /// A grant or renewal: the lease is the client's from `at` until `until` (`None`: until
    /// released, fail-closed).
    Told {
        key: String,
        lease: String,
        fence: u64,
        at: Instant,
        until: Option<Instant>,
        client: String,
        batch: bool,
        slot: bool,
    },
    /// The client stopped believing it holds the lease (release sent, told it lost it, crashed).
    End { key: String, lease: String, at: Instant },
    /// An operator force-released the key: whoever held it was evicted without being told.
    Force { key: String, at: Instant },
    /// A write to the guarded resource.
    Wrote { key: String, lease: String, fence: u64, at: Instant, accepted: bool, believed: bool },
    /// A release into the final work state was answered as done.
    Finished { key: String, lease: String, at: Instant },
    /// A release sent within the lease's safe time was answered `NotHolder`.
    ReleaseRefused { key: String, lease: String, at: Instant },
    /// An acquire of coordinator `coordinator` waited from `start` and was answered `LeaseHeld`
    /// at `end`.
    WaitedInVain { key: String, coordinator: String, start: Instant, end: Instant },
    /// A take of a slot by client `client` waited from `start` until its answer at `end`.
    SlotWaited { key: String, client: String, start: Instant, end: Instant },
    /// A coordinator's clock was stepped by `by_ms` (a jump beyond the margin, or its end).
    ClockJump { node: String, by_ms: i64, at: Instant },
}

/// The shared state of a run.
pub(crate) struct World {
    pub(crate) rng: u64,
    pub(crate) ops: u64,
    pub(crate) target: u64,
    pub(crate) stop: bool,
    pub(crate) events: Vec<Event>,
    pub(crate) violations: Vec<Violation>,
    /// The guarded resource: per key, the last accepted fence and its lease.
    pub(crate) resource: BTreeMap<String, (u64, String)>,
    /// Keep-alive executions (`true`: running).
    pub(crate) executions: BTreeMap<String, bool>,
    /// Leases each client believes it holds now (to end them when its process crashes).
    pub(crate) holding: BTreeMap<String, BTreeSet<(String, String)>>,
    /// Fail-closed lease_ids each client may hold (known before the acquire is sent).
    pub(crate) fail_closed: BTreeMap<String, BTreeSet<(String, String)>>,
    /// Fail-closed leases of crashed processes, released by the next process.
    pub(crate) orphans: Vec<(String, LeaseId)>,
    /// Fail-closed lease_ids released while an attempt of theirs may still have been in the
    /// network: released again at the end.
    pub(crate) released_orphans: Vec<(String, LeaseId)>,
    pub(crate) sim_faults: BTreeMap<&'static str, u64>,
    /// Leases granted to the sessions, by the shape of the acquire (`GRANTED_SHAPES`).
    pub(crate) granted: BTreeMap<&'static str, u64>,
    pub(crate) seed: u64,
    /// The simulated Step Functions' tasks waiting on task tokens, by token.
    pub(crate) tasks: BTreeMap<String, Task>,
    /// Executions holding a lease delivered to them (awaited at the end).
    pub(crate) exec_tasks: Vec<tokio::task::JoinHandle<()>>,
    /// The coordinator the executions' functions call (a Lambda function's process; replaced
    /// when it crashes).
    pub(crate) functions: Option<Arc<Node>>,
    /// How often the functions' process crashed (and was replaced).
    pub(crate) functions_crashed: usize,
    /// The run is over: the functions' queue sweep stops.
    pub(crate) end: bool,
    /// See [`Settings::hot_key`].
    pub(crate) hot_key: bool,
    /// See [`Settings::blind_clock`].
    pub(crate) blind_clock: bool,
    /// See [`Settings::semaphores`].
    pub(crate) semaphores: bool,
    /// See [`Settings::held_leases`].
    pub(crate) held_leases: bool,
    /// Acquire-function invocations running in each process (stopped by its crash).
    pub(crate) invocations: BTreeMap<String, Vec<tokio::task::AbortHandle>>,
}

/// One coordinator process.
pub(crate) struct Node {
    pub(crate) coord: Coordinator,
    pub(crate) store: SimStore,
    pub(crate) clock: Arc<SimClock>,
    pub(crate) name: String,
    /// Beyond the skew margin: every expiry it judges must be refused.
    pub(crate) rogue: bool,
    /// Serves waiter queues (delivers grants to the simulated Step Functions), as the Lambda
    /// functions do; the others are library users.
    pub(crate) serves_queues: bool,
}

/// A `.waitForTaskToken` task of an execution (DESIGN.md, "The waiter queue").
#[derive(Debug, Clone)]
pub(crate) struct Task {
    /// The execution's name (the client name its lease is told to).
    pub(crate) exec: String,
    pub(crate) key: String,
    pub(crate) lease_id: String,
    /// Its timeout (the task's `TimeoutSeconds`): later deliveries answer `TaskTimedOut`.
    pub(crate) timeout: Instant,
    /// Closed: succeeded (the lease delivered), failed, or timed out.
    pub(crate) closed: bool,
    /// Its execution was stopped and deleted: deliveries answer `TaskDoesNotExist`.
    pub(crate) deleted: bool,
}

pub(crate) type Shared = Arc<Mutex<World>>;

pub(crate) fn lock(w: &Shared) -> std::sync::MutexGuard<'_, World> {
    w.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

pub(crate) fn split(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl World {
    /// The state a run starts with: its generator seeded from the seed, nothing happened yet.
    pub(crate) fn new(s: &Settings) -> World {
        World {
            rng: s.seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0xdead_beef,
            ops: 0,
            target: s.ops,
            stop: false,
            events: Vec::new(),
            violations: Vec::new(),
            resource: BTreeMap::new(),
            executions: BTreeMap::new(),
            holding: BTreeMap::new(),
            orphans: Vec::new(),
            released_orphans: Vec::new(),
            fail_closed: BTreeMap::new(),
            sim_faults: BTreeMap::new(),
            granted: BTreeMap::new(),
            seed: s.seed,
            tasks: BTreeMap::new(),
            exec_tasks: Vec::new(),
            functions: None,
            functions_crashed: 0,
            invocations: BTreeMap::new(),
            end: false,
            hot_key: s.hot_key,
            blind_clock: s.blind_clock,
            semaphores: s.semaphores,
            held_leases: s.held_leases,
        }
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            split(&mut self.rng) % n
        }
    }
    pub(crate) fn chance(&mut self, p: f64) -> bool {
        ((split(&mut self.rng) >> 11) as f64 / (1u64 << 53) as f64) < p
    }
    pub(crate) fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo) + 1)
    }
    pub(crate) fn fault(&mut self, name: &'static str) {
        *self.sim_faults.entry(name).or_default() += 1;
    }
}

/// Draws from the run's generator.
pub(crate) fn draw<T>(w: &Shared, f: impl FnOnce(&mut World) -> T) -> T {
    f(&mut lock(w))
}

/// The names of the keys (plain leases) and work items of a run.
pub(crate) const KEYS: usize = 5;
pub(crate) const WORK: usize = 8;

pub(crate) fn key(i: u64) -> String {
    format!("k{i}")
}

pub(crate) fn work_key(i: u64) -> String {
    format!("w{i}")
}

pub(crate) fn todo(seed: u64) -> String {
    format!("todo-{seed}")
}

pub(crate) fn done(seed: u64) -> String {
    format!("done-{seed}")
}

/// Counts one library call; false once the run has made its operations.
pub(crate) fn op(world: &Shared) -> bool {
    let mut w = lock(world);
    w.ops += 1;
    !w.stop
}

pub(crate) fn told(world: &Shared, client: &str, l: &Lease) {
    let mut w = lock(world);
    w.holding.entry(client.to_string()).or_default().insert((l.key.clone(), l.lease_id.expose().to_string()));
    let at = now();
    w.events.push(Event::Told {
        key: l.key.clone(),
        lease: l.lease_id.expose().to_string(),
        fence: l.fence,
        at,
        until: l.safe_until,
        client: client.to_string(),
        batch: l.state.is_some(),
        slot: l.slots.is_some(),
    });
}

pub(crate) fn ended(world: &Shared, client: &str, key: &str, lease: &LeaseId) {
    let mut w = lock(world);
    if let Some(s) = w.holding.get_mut(client) {
        s.remove(&(key.to_string(), lease.expose().to_string()));
    }
    let at = now();
    w.events.push(Event::End { key: key.to_string(), lease: lease.expose().to_string(), at });
}

/// A write to the guarded resource, which honours fences: it accepts a fence not below the
/// last one it accepted (the same lease may write again).
pub(crate) fn write_resource(world: &Shared, key: &str, lease: &Lease, believed: bool) -> bool {
    let mut w = lock(world);
    let id = lease.lease_id.expose().to_string();
    let last = w.resource.get(key).cloned();
    let accepted = match &last {
        None => true,
        Some((f, l)) => lease.fence > *f || (lease.fence == *f && *l == id),
    };
    if let Some((f, l)) = &last {
        if lease.fence == *f && *l != id {
            let v = Violation::new(
                "fence_shared",
                key,
                format!("the guarded resource saw two leases with fence {f}: the second would overwrite the first"),
            );
            w.violations.push(v);
        }
    }
    if accepted {
        w.resource.insert(key.to_string(), (lease.fence, id.clone()));
    }
    let at = now();
    w.events.push(Event::Wrote { key: key.to_string(), lease: id, fence: lease.fence, at, accepted, believed });
    accepted
}
