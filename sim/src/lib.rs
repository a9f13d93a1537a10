//! Deterministic simulation of the lease protocol (DESIGN.md, "Simulation").
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

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold::queue::{Deliver, DeliveryError};
use leasehold::testing::{FaultCounts, Faults, SimClock, SimStore};
use leasehold::{
    AcquireOptions, Clock, Config, Coordinator, Error, ExecutionState, Executions, Keepalive, Lease, LeaseId,
    NotHolderReason,
};

mod check;
pub use check::Violation;

/// The wall time every run starts at (2027-01-15).
pub(crate) const EPOCH_MS: i64 = 1_800_000_000_000;
/// The skew margin of every coordinator; honest clocks stay within half of it of the truth.
pub(crate) const SKEW_MARGIN_MS: u64 = 200;
/// The store client's attempt timeout.
const ATTEMPT_TIMEOUT: Duration = Duration::from_millis(800);

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
    /// Semaphores: a fifth of the sessions take a slot of a semaphore (2 or 3 slots; one seed
    /// in eight, a class of its own).
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
            semaphores: seed % 8 == 6,
            held_leases: seed % 8 == 3,
        }
    }
}

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
    let out = rt.block_on(simulate(settings.clone()));
    drop(rt);
    leasehold::testing::unseed();
    out
}

/// One thing a client was told or did, in the order it happened.
#[derive(Debug, Clone)]
pub(crate) enum Event {
    /// A grant or renewal: the lease is the client's from `at` until `until` (`None`: until
    /// released, fail-closed).
    Told { key: String, lease: String, fence: u64, at: Instant, until: Option<Instant>, client: String, batch: bool },
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
    /// A coordinator's clock was stepped by `by_ms` (a jump beyond the margin, or its end).
    ClockJump { node: String, by_ms: i64, at: Instant },
}

/// The shared state of a run.
struct World {
    rng: u64,
    ops: u64,
    target: u64,
    stop: bool,
    events: Vec<Event>,
    violations: Vec<Violation>,
    /// The guarded resource: per key, the last accepted fence and its lease.
    resource: BTreeMap<String, (u64, String)>,
    /// Keep-alive executions (`true`: running).
    executions: BTreeMap<String, bool>,
    /// Leases each client believes it holds now (to end them when its process crashes).
    holding: BTreeMap<String, BTreeSet<(String, String)>>,
    /// Fail-closed lease_ids each client may hold (known before the acquire is sent).
    fail_closed: BTreeMap<String, BTreeSet<(String, String)>>,
    /// Fail-closed leases of crashed processes, released by the next process.
    orphans: Vec<(String, LeaseId)>,
    /// Fail-closed lease_ids released while an attempt of theirs may still have been in the
    /// network: released again at the end.
    released_orphans: Vec<(String, LeaseId)>,
    sim_faults: BTreeMap<&'static str, u64>,
    seed: u64,
    /// The simulated Step Functions' tasks waiting on task tokens, by token.
    tasks: BTreeMap<String, Task>,
    /// Executions holding a lease delivered to them (awaited at the end).
    exec_tasks: Vec<tokio::task::JoinHandle<()>>,
    /// The coordinator the executions' functions call (never crashes: a Lambda function).
    functions: Option<Arc<Node>>,
    /// The run is over: the functions' queue sweep stops.
    end: bool,
    /// See [`Settings::hot_key`].
    hot_key: bool,
    /// See [`Settings::blind_clock`].
    blind_clock: bool,
    /// See [`Settings::semaphores`].
    semaphores: bool,
    /// See [`Settings::held_leases`].
    held_leases: bool,
    /// Acquire-function invocations running in each process (stopped by its crash).
    invocations: BTreeMap<String, Vec<tokio::task::AbortHandle>>,
}

/// A `.waitForTaskToken` task of an execution (DESIGN.md, "The waiter queue").
#[derive(Debug, Clone)]
struct Task {
    /// The execution's name (the client name its lease is told to).
    exec: String,
    key: String,
    lease_id: String,
    /// Its timeout (the task's `TimeoutSeconds`): later deliveries answer `TaskTimedOut`.
    timeout: Instant,
    /// Closed: succeeded (the lease delivered), failed, or timed out.
    closed: bool,
    /// Its execution was stopped and deleted: deliveries answer `TaskDoesNotExist`.
    deleted: bool,
}

type Shared = Arc<Mutex<World>>;

fn lock(w: &Shared) -> std::sync::MutexGuard<'_, World> {
    w.lock().unwrap_or_else(|p| p.into_inner())
}

fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

fn split(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl World {
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            split(&mut self.rng) % n
        }
    }
    fn chance(&mut self, p: f64) -> bool {
        ((split(&mut self.rng) >> 11) as f64 / (1u64 << 53) as f64) < p
    }
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo) + 1)
    }
    fn fault(&mut self, name: &'static str) {
        *self.sim_faults.entry(name).or_default() += 1;
    }
}

/// Draws from the run's generator.
fn draw<T>(w: &Shared, f: impl FnOnce(&mut World) -> T) -> T {
    f(&mut lock(w))
}

/// One coordinator process.
struct Node {
    coord: Coordinator,
    store: SimStore,
    clock: Arc<SimClock>,
    name: String,
    /// Beyond the skew margin: every expiry it judges must be refused.
    rogue: bool,
    /// Serves waiter queues (delivers grants to the simulated Step Functions), as the Lambda
    /// functions do; the others are library users.
    serves_queues: bool,
}

/// A coordinator process and its tasks (clients, sweeper).
type Running = (Arc<Node>, Vec<tokio::task::JoinHandle<()>>);

/// The names of the keys (plain leases) and work items of a run.
const KEYS: usize = 5;
const WORK: usize = 8;

fn key(i: u64) -> String {
    format!("k{i}")
}

fn work_key(i: u64) -> String {
    format!("w{i}")
}

fn todo(seed: u64) -> String {
    format!("todo-{seed}")
}

fn done(seed: u64) -> String {
    format!("done-{seed}")
}

struct SimExecutions(Shared);

#[async_trait::async_trait]
impl Executions for SimExecutions {
    async fn state(&self, arn: &str) -> ExecutionState {
        match lock(&self.0).executions.get(arn) {
            Some(true) => ExecutionState::Running,
            _ => ExecutionState::Ended,
        }
    }
}

/// Every coordinator's configuration in a run (`blind`: a blind-clock run's).
fn config(clock: Arc<SimClock>, blind: bool) -> Config {
    let mut c = Config {
        skew_margin: Duration::from_millis(SKEW_MARGIN_MS),
        // Longer than a request can be held in the network (the attempt timeout and up to 3 s
        // more) and than a free key with waiters can wait for its queue (a missing slot's
        // `ENQUEUE_GRACE_MS`, 10 s): the 24 h default's roles, in the run's time scale.
        ttl_grace: Duration::from_secs(20),
        fence_lead: Duration::from_secs(5),
        retry_budget: Duration::from_secs(2),
        clock,
        ..Config::default()
    };
    if blind {
        // The product's fence lead, longer than the grace here, so that the TTL after the fence
        // is what keeps a copied fence from outliving its item; and leases of at most 30 s, so
        // that released items (TTL after `max_duration`) are deleted within the run.
        c.fence_lead = Duration::from_secs(60);
        c.limits.max_duration = Duration::from_secs(30);
    }
    c
}

async fn simulate(s: Settings) -> Outcome {
    let t0 = now();
    let truth = Arc::new(SimClock::new(EPOCH_MS));
    let mut faults = Faults::all(s.fault_rate);
    faults.attempt_timeout = ATTEMPT_TIMEOUT;
    faults.ttl_lag_ms = (0, 5000);
    let store = SimStore::new(truth.clone(), Faults { attempt_timeout: ATTEMPT_TIMEOUT, ..Faults::none() }, s.seed);
    let world: Shared = Arc::new(Mutex::new(World {
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
        seed: s.seed,
        tasks: BTreeMap::new(),
        exec_tasks: Vec::new(),
        functions: None,
        invocations: BTreeMap::new(),
        end: false,
        hot_key: s.hot_key,
        blind_clock: s.blind_clock,
        semaphores: s.semaphores,
        held_leases: s.held_leases,
    }));
    // The work items enter their first state (no faults yet: setup).
    {
        let setup = Coordinator::new(Arc::new(store.handle()), config(truth.clone(), s.blind_clock));
        for i in 0..WORK as u64 {
            setup.put(&work_key(i), &todo(s.seed), "setup").await.expect("setup put");
        }
    }
    store.set_faults(faults);
    // The functions (Lambda) that executions call, and their scheduled queue sweep.
    let functions = functions_node(&world, &store, &truth);
    lock(&world).functions = Some(functions.clone());
    let queue_sweep = {
        let (n, w) = (functions.clone(), world.clone());
        tokio::spawn(async move { queue_sweeper(n, w).await })
    };
    let mut nodes: Vec<Option<Running>> = Vec::new();
    for i in 0..s.coordinators {
        nodes.push(Some(start_node(&world, &store, &truth, i, Kind::Honest)));
    }
    // A coordinator whose clock is beyond the skew margin, in some runs.
    let rogue = draw(&world, |w| w.chance(0.3)).then(|| {
        lock(&world).fault("clock_beyond_margin");
        start_node(&world, &store, &truth, s.coordinators, Kind::Rogue)
    });
    // A coordinator whose clock error its check cannot see, in the blind-clock runs.
    let blind = s.blind_clock.then(|| {
        lock(&world).fault("blind_clock");
        start_node(&world, &store, &truth, s.coordinators + 1, Kind::Blind)
    });
    // The driver: crashes, restarts, clock steps, force-releases, until the operations are done.
    let mut down: Vec<(usize, Instant)> = Vec::new();
    // Clocks jumped beyond the margin, and when NTP steps each back.
    let mut jumped: Vec<Jumped> = Vec::new();
    loop {
        let pause = draw(&world, |w| w.between(50, 400));
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let done_ops = {
            let w = lock(&world);
            w.ops >= w.target
        };
        if done_ops {
            break;
        }
        // Restarts.
        let t = now();
        for (i, _) in down.iter().filter(|(_, at)| *at <= t) {
            nodes[*i] = Some(start_node(&world, &store, &truth, *i, Kind::Honest));
            lock(&world).fault("restart");
        }
        down.retain(|(_, at)| *at > t);
        let (crash, step, force) = draw(&world, |w| (w.chance(0.01), w.chance(0.01), w.chance(0.003)));
        if crash {
            let i = draw(&world, |w| w.below(s.coordinators as u64)) as usize;
            if let Some((node, tasks)) = nodes[i].take() {
                crash_node(&world, &node, tasks);
                let back = draw(&world, |w| w.between(300, 3000));
                down.push((i, now() + Duration::from_millis(back)));
            }
        }
        if step {
            // An NTP step or drift change within the margin.
            let i = draw(&world, |w| w.below(s.coordinators as u64)) as usize;
            if let Some((node, _)) = &nodes[i] {
                let (delta, ppm) = draw(&world, |w| (w.between(0, 40) as i64 - 20, w.between(0, 40) as i64 - 20));
                let off = node.clock.wall_us() / 1000 - truth.wall_us() / 1000;
                if (off + delta).abs() <= (SKEW_MARGIN_MS / 2 - 10) as i64 {
                    node.clock.step(delta);
                }
                node.clock.set_drift_ppm(ppm);
                lock(&world).fault("clock_step");
            }
        }
        if s.clock_jumps {
            clock_jumps(&world, &nodes, &mut jumped);
        }
        // With a blind clock, its leases look stuck to the others (their expiry minutes away):
        // an operator force-releases such keys far more often, and the next grants must not
        // copy its fence (the fence lead) nor let TTL delete it early (the TTL after the fence).
        let force = force || (s.blind_clock && draw(&world, |w| w.chance(0.05)));
        // With held leases, a process is cut off from the store now and then (a network
        // partition of 0.5-5 s): its holders' renewals fail until their safe time ends.
        if s.held_leases && draw(&world, |w| w.chance(0.02)) {
            let (i, ms) = draw(&world, |w| (w.below(s.coordinators as u64) as usize, w.between(500, 5000)));
            if let Some((node, _)) = &nodes[i] {
                lock(&world).fault("partition");
                node.store.partition(Duration::from_millis(ms));
            }
        }
        if force {
            let i = draw(&world, |w| w.below(s.coordinators as u64)) as usize;
            if let Some((node, _)) = &nodes[i] {
                let k = key(draw(&world, |w| w.below(KEYS as u64)));
                lock(&world).fault("force_release");
                // Every belief from before the force-release is cut (the operator evicts whoever
                // held it; it may have landed even when unanswered).
                let at = now();
                lock(&world).events.push(Event::Force { key: k.clone(), at });
                let _ = node.coord.force_release(&k).await;
            }
        }
    }
    // Drain: no new sessions, no more faults; every client ends what it holds.
    for (clock, _, _, delta) in jumped.drain(..) {
        clock.step(-delta);
    }
    lock(&world).stop = true;
    store.set_faults(Faults { attempt_timeout: ATTEMPT_TIMEOUT, ..Faults::none() });
    for (i, _) in down.drain(..) {
        nodes[i] = Some(start_node(&world, &store, &truth, i, Kind::Honest));
    }
    let mut all: Vec<Running> = nodes.into_iter().flatten().collect();
    all.extend(rogue);
    all.extend(blind);
    for (_, tasks) in all.iter_mut() {
        for t in tasks.drain(..) {
            let _ = t.await;
        }
    }
    // After a blind clock, the others' clocks pass the last fence it issued (until then they
    // refuse to copy it, `ClockSkew`, and a key it had last is theirs to take only then).
    if s.blind_clock {
        tokio::time::sleep(Duration::from_secs(110)).await;
    }
    // Orphaned fail-closed leases are released by a process that knows their ids (before the
    // queued waiters are judged: a waiter behind a fail-closed lease waits for its release).
    let final_node = start_node(&world, &store, &truth, 99, Kind::Honest).0;
    let orphans = {
        let mut w = lock(&world);
        let mut all = std::mem::take(&mut w.orphans);
        all.append(&mut w.released_orphans);
        all
    };
    for (k, id) in &orphans {
        let _ = release_until_done(&final_node.coord, k, id).await;
    }
    // Queued waiters are served (by the functions' queue sweep) and their executions end.
    tokio::time::sleep(Duration::from_secs(25)).await;
    loop {
        let execs = std::mem::take(&mut lock(&world).exec_tasks);
        if execs.is_empty() {
            break;
        }
        for t in execs {
            let _ = t.await;
        }
    }
    lost_waiters(&world);
    // And again: an attempt still in the network at the first release may have landed since.
    for (k, id) in &orphans {
        let _ = release_until_done(&final_node.coord, k, id).await;
    }
    // Past every lease and keep-alive deadline: every key must be free to take.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let checker = &final_node.coord;
    for i in 0..KEYS as u64 {
        let k = key(i);
        let opts = AcquireOptions { wait: Some(Duration::from_secs(5)), ..Default::default() };
        match checker.acquire(&k, "checker", Some(Duration::from_secs(1)), opts).await {
            Ok(l) => {
                let _ = checker.release(&k, &l.lease_id).await;
            }
            Err(e) => {
                let mut v =
                    Violation::new("key_unusable", &k, format!("after every lease ended, {k} could not be taken: {e}"));
                // Held by a lease nobody was told of (a fail-closed acquire that landed, held in
                // the network, after its caller had given up on it: DESIGN.md, "acquire").
                let ghost = store.peek(&k).filter(|r| r.expires_at_ms.is_none()).is_some_and(|r| {
                    let id = r.lease_id.expose();
                    !lock(&world)
                        .events
                        .iter()
                        .any(|e| matches!(e, Event::Told { key, lease, .. } if *key == k && lease == id))
                });
                if ghost {
                    v.kind = "stale_acquire_holds_key";
                    // The key became free after the acquire was sent not by a release but by a
                    // queue write (the undelivered mark removed, the last waiter passed over):
                    // found by the simulation, fixed by `FreeAfter`'s `freed_at_ms` clause
                    // (DESIGN.md, "Simulation"); named apart, a violation as the other.
                    let id = store.peek(&k).map(|r| r.lease_id.expose().to_string()).unwrap_or_default();
                    if freed_by_queue_write(&store_log(&store), &k, &id) {
                        v.kind = "stale_acquire_after_queue_freed";
                    }
                }
                lock(&world).violations.push(v);
            }
        }
    }
    // Every slot of every semaphore can be taken at once.
    for (k, n) in SEMAPHORES.into_iter().filter(|_| s.semaphores) {
        let mut taken = Vec::new();
        for _ in 0..n {
            let opts = AcquireOptions { wait: Some(Duration::from_secs(5)), slots: Some(n), ..Default::default() };
            match checker.acquire(k, "checker", Some(Duration::from_secs(5)), opts).await {
                Ok(l) => taken.push(l.lease_id),
                Err(e) => lock(&world).violations.push(Violation::new(
                    "key_unusable",
                    k,
                    format!("after every slot ended, slot {} of {n} of {k} could not be taken: {e}", taken.len() + 1),
                )),
            }
        }
        for id in taken {
            let _ = checker.release(k, &id).await;
        }
    }
    for i in 0..WORK as u64 {
        let k = work_key(i);
        match store.peek(&k) {
            Some(r)
                if r.work.state.as_deref() == Some(todo(s.seed).as_str())
                    || r.work.state.as_deref() == Some(done(s.seed).as_str()) =>
            {
                if r.is_held(checker.now_ms()) {
                    lock(&world).violations.push(Violation::new(
                        "key_unusable",
                        &k,
                        format!("work item {k} is still held after every lease ended"),
                    ));
                }
            }
            other => {
                let mut v = Violation::new(
                    "work_item_lost",
                    &k,
                    format!("work item {k} left its states: {:?}", other.map(|r| r.work.state)),
                );
                // Deleted by TTL in its state (the store's log says so).
                if store_log(&store)
                    .iter()
                    .any(|a| a.key == k && a.ttl && a.old.as_ref().is_some_and(|r| r.work.state.is_some()))
                {
                    v.kind = "work_item_deleted_by_ttl";
                }
                lock(&world).violations.push(v);
            }
        }
    }
    lock(&world).end = true;
    let _ = queue_sweep.await;
    let log = store.take_log();
    // Last, outside the history (its writes are not in the log taken): the idle process.
    idle_past_evidence(&world, &store, &truth).await;
    let mut w = lock(&world);
    let events = std::mem::take(&mut w.events);
    let mut violations = std::mem::take(&mut w.violations);
    violations.extend(check::check(&events, &log, t0, config(truth.clone(), s.blind_clock).fence_lead));
    let findings = violations.iter().filter(|v| v.known).fold(BTreeMap::new(), |mut m, v| {
        *m.entry(v.kind).or_default() += 1;
        m
    });
    for v in violations.iter_mut() {
        v.history = check::history(
            &events,
            &log,
            t0,
            &v.key,
            v.at,
            std::env::var("SIM_HISTORY").ok().and_then(|s| s.parse().ok()).unwrap_or(24),
        );
    }
    let mut faults = fault_map(&store.fault_counts());
    for (k, v) in &w.sim_faults {
        faults.insert(k, *v);
    }
    Outcome {
        seed: s.seed,
        operations: w.ops,
        violations,
        findings,
        faults,
        trace_hash: check::trace_hash(&events, &log, t0),
        virtual_ms: now().duration_since(t0).as_millis() as u64,
    }
}

/// A process idle past the clock evidence's age bound (5 minutes), whose wall clock was stepped
/// while it idled (a thawed VM, an NTP step), in every run after everything else, alone (so the
/// run's history and its hash are as they were): it took a lease before idling, so it keeps `Date` samples,
/// all old now. With the clock stepped beyond the skew margin it must be refused, on fresh
/// evidence it reads before judging (`stale_clock_evidence` otherwise); within the margin, or
/// idle for less, it is granted.
async fn idle_past_evidence(world: &Shared, store: &SimStore, truth: &Arc<SimClock>) {
    let (idle_s, ahead_ms, beyond) =
        draw(world, |w| (w.between(200, 420), w.between(2000, 5000) as i64, w.chance(0.7)));
    let clock = Arc::new(SimClock::offset_from(truth, 0));
    let coord = Coordinator::new(Arc::new(store.handle()), config(clock.clone(), lock(world).blind_clock));
    let k = "idle";
    if let Ok(l) = coord.acquire(k, "idle", Some(Duration::from_secs(1)), AcquireOptions::default()).await {
        let _ = coord.release(k, &l.lease_id).await;
    }
    tokio::time::sleep(Duration::from_secs(idle_s)).await;
    clock.step(if beyond { ahead_ms } else { SKEW_MARGIN_MS as i64 / 4 });
    lock(world).fault(if beyond { "idle_clock_beyond_margin" } else { "idle_clock_within_margin" });
    let r = coord.acquire(k, "idle", Some(Duration::from_secs(1)), AcquireOptions::default()).await;
    let wrong = match &r {
        Ok(_) if beyond => Some(format!("granted with a clock {ahead_ms} ms ahead after {idle_s} s idle")),
        Err(e) if !beyond => Some(format!("refused with a clock within the margin after {idle_s} s idle: {e}")),
        _ => None,
    };
    if let Some(what) = wrong {
        lock(world).violations.push(Violation::new("stale_clock_evidence", k, what));
    }
    if let Ok(l) = r {
        let _ = coord.release(k, &l.lease_id).await;
    }
}

/// Whether the write before the acquire of `lease_id` that took `key` freed it without a
/// release: a queue write (the undelivered mark removed, the last waiter passed over or
/// revoked) on an item that was released or expired but not yet free to plain acquires.
fn freed_by_queue_write(log: &[leasehold::testing::Applied], key: &str, lease_id: &str) -> bool {
    let on_key: Vec<_> = log.iter().filter(|a| a.key == key).collect();
    let Some(i) = on_key.iter().rposition(
        |a| matches!(&a.mutation, Some(leasehold::store::Mutation::Lease(leasehold::store::LeaseMutation::Acquire(n))) if n.lease_id.expose() == lease_id),
    ) else {
        return false;
    };
    let blocked = |r: &leasehold::Record| r.queue.pending_token.is_some() || r.queue_len() > 0;
    // Back from the acquire to the last write that ended or granted a lease: a queue write
    // since then unblocked the key.
    for a in on_key[..i].iter().rev() {
        use leasehold::store::{LeaseMutation as L, Mutation as M, QueueMutation as Q};
        if matches!(
            a.mutation,
            None | Some(
                M::Lease(L::Release { .. } | L::ForceRelease { .. } | L::Acquire(_)) | M::Queue(Q::Grant { .. })
            )
        ) {
            return false;
        }
        if a.old.as_ref().is_some_and(blocked) && a.new.as_ref().is_some_and(|r| !blocked(r)) {
            return true;
        }
    }
    false
}

/// The store's log so far (kept in the store).
fn store_log(store: &SimStore) -> Vec<leasehold::testing::Applied> {
    let log = store.take_log();
    store.put_back_log(log.clone());
    log
}

fn fault_map(c: &FaultCounts) -> BTreeMap<&'static str, u64> {
    BTreeMap::from([
        ("lost_answer", c.lost_answer),
        ("delayed_duplicate", c.delayed_duplicate),
        ("refused", c.refused),
        ("throttle", c.throttle),
        ("stall", c.stall),
        ("timeout", c.timeout),
        ("ttl_delete", c.ttl_delete),
    ])
}

/// How a coordinator's clock is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Within the skew margin.
    Honest,
    /// Beyond the margin: its check refuses it.
    Rogue,
    /// Beyond the margin, unseen by its check.
    Blind,
}

fn start_node(world: &Shared, store: &SimStore, truth: &Arc<SimClock>, i: usize, kind: Kind) -> Running {
    let rogue = kind == Kind::Rogue;
    let blind = kind == Kind::Blind;
    let (offset, ppm, clients) = draw(world, |w| {
        let off = if blind {
            w.between(30_000, 100_000) as i64
        } else if rogue {
            let o = w.between(2000, 5000) as i64;
            if w.chance(0.5) {
                o
            } else {
                -o
            }
        } else {
            w.between(0, SKEW_MARGIN_MS - 20) as i64 - (SKEW_MARGIN_MS / 2 - 10) as i64
        };
        (off, w.between(0, 40) as i64 - 20, if kind == Kind::Honest { 3 } else { 2 })
    });
    if offset != 0 {
        lock(world).fault("clock_offset");
    }
    let clock = Arc::new(SimClock::offset_from(truth, offset));
    clock.set_drift_ppm(ppm);
    let handle = if blind { store.handle_with_date_offset(offset) } else { store.handle() };
    let mut coord = Coordinator::new(Arc::new(handle.clone()), config(clock.clone(), lock(world).blind_clock));
    // Every other coordinator serves queues (a Lambda function); the rest are library users.
    let serves_queues = kind == Kind::Honest && i.is_multiple_of(2);
    if serves_queues {
        coord = coord.with_deliver(Arc::new(SimSfn(world.clone())));
    }
    let name = match kind {
        Kind::Honest => format!("c{i}"),
        Kind::Rogue => format!("rogue{i}"),
        Kind::Blind => format!("blind{i}"),
    };
    let node = Arc::new(Node { coord, store: handle, clock, name, rogue, serves_queues });
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (n, w) = (node.clone(), world.clone());
        tasks.push(tokio::spawn(async move { client(n, w, c).await }));
    }
    if kind == Kind::Honest {
        let (n, w) = (node.clone(), world.clone());
        tasks.push(tokio::spawn(async move { sweeper(n, w).await }));
    }
    (node, tasks)
}

/// A clock jumped beyond the margin: its node's name, when NTP steps it back, and by how much
/// it was stepped.
type Jumped = (Arc<SimClock>, String, Instant, i64);

/// Steps back the clocks whose time has come; now and then jumps one honest coordinator's clock
/// beyond the margin (1 s to 2 min, ahead more often than behind) for 0.5 to 8 s.
fn clock_jumps(world: &Shared, nodes: &[Option<Running>], jumped: &mut Vec<Jumped>) {
    let t = now();
    jumped.retain(|(clock, node, at, delta)| {
        if *at <= t {
            clock.step(-delta);
            lock(world).events.push(Event::ClockJump { node: node.clone(), by_ms: -delta, at: t });
        }
        *at > t
    });
    let (jump, i, ahead, by, spell) = draw(world, |w| {
        (
            w.chance(0.01),
            w.below(nodes.len() as u64) as usize,
            w.chance(0.7),
            w.between(1_000, 120_000),
            w.between(500, 8_000),
        )
    });
    let Some((node, _)) = nodes[i].as_ref().filter(|_| jump) else { return };
    if jumped.iter().any(|(c, ..)| Arc::ptr_eq(c, &node.clock)) {
        return;
    }
    let delta = if ahead { by as i64 } else { -(by as i64) };
    node.clock.step(delta);
    jumped.push((node.clock.clone(), node.name.clone(), t + Duration::from_millis(spell), delta));
    let mut w = lock(world);
    w.fault("clock_jump");
    w.events.push(Event::ClockJump { node: node.name.clone(), by_ms: delta, at: t });
}

/// A crash: the process's tasks stop where they are, its requests are no longer sent, and
/// what its clients believed ends with them.
fn crash_node(world: &Shared, node: &Node, tasks: Vec<tokio::task::JoinHandle<()>>) {
    for t in tasks {
        t.abort();
    }
    node.store.stop();
    let mut w = lock(world);
    for inv in w.invocations.remove(&node.name).unwrap_or_default() {
        inv.abort();
    }
    w.fault("crash");
    let at = now();
    let prefix = format!("{}/", node.name);
    let ended: Vec<(String, String)> =
        w.holding.iter().filter(|(c, _)| c.starts_with(&prefix)).flat_map(|(_, s)| s.iter().cloned()).collect();
    w.holding.retain(|c, _| !c.starts_with(&prefix));
    let ids: Vec<(String, String)> =
        w.fail_closed.iter().filter(|(c, _)| c.starts_with(&prefix)).flat_map(|(_, s)| s.iter().cloned()).collect();
    w.fail_closed.retain(|c, _| !c.starts_with(&prefix));
    w.orphans.extend(ids.into_iter().map(|(k, id)| (k, LeaseId::from_string(id))));
    for (key, lease) in ended {
        w.events.push(Event::End { key, lease, at });
    }
}

/// Counts one library call; false once the run has made its operations.
fn op(world: &Shared) -> bool {
    let mut w = lock(world);
    w.ops += 1;
    !w.stop
}

fn told(world: &Shared, client: &str, l: &Lease) {
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
    });
}

fn ended(world: &Shared, client: &str, key: &str, lease: &LeaseId) {
    let mut w = lock(world);
    if let Some(s) = w.holding.get_mut(client) {
        s.remove(&(key.to_string(), lease.expose().to_string()));
    }
    let at = now();
    w.events.push(Event::End { key: key.to_string(), lease: lease.expose().to_string(), at });
}

/// A write to the guarded resource, which honours fences: it accepts a fence not below the
/// last one it accepted (the same lease may write again).
fn write_resource(world: &Shared, key: &str, lease: &Lease, believed: bool) -> bool {
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

/// One client: sessions of every kind until the run has made its operations.
async fn client(node: Arc<Node>, world: Shared, n: usize) {
    let name = format!("{}/{n}", node.name);
    // Orphans of a crashed process are released first (their ids were kept).
    if !node.rogue {
        let orphans = std::mem::take(&mut lock(&world).orphans);
        // This client's own until released: a crash meanwhile hands them on again.
        {
            let mut w = lock(&world);
            let own = w.fail_closed.entry(name.clone()).or_default();
            own.extend(orphans.iter().map(|(k, id)| (k.clone(), id.expose().to_string())));
        }
        for (k, id) in orphans {
            let done = release_until_done(&node.coord, &k, &id).await;
            let mut w = lock(&world);
            if let Some(own) = w.fail_closed.get_mut(&name) {
                own.remove(&(k.clone(), id.expose().to_string()));
            }
            // Released now, and again at the end: an attempt the crashed process had in flight
            // may land after this release found nothing (DESIGN.md, "acquire": the limit that
            // remains), so the id is kept, as a process keeps a fail-closed lease_id until it
            // knows no attempt of it can land.
            if done {
                w.released_orphans.push((k, id));
            } else {
                w.orphans.push((k, id));
            }
        }
    }
    loop {
        if lock(&world).stop {
            return;
        }
        let kind = draw(&world, |w| w.below(100));
        if lock(&world).hot_key && kind < 20 {
            hot(&node, &world, &name).await;
            continue;
        }
        if lock(&world).semaphores && kind < 20 {
            semaphore(&node, &world, &name).await;
            continue;
        }
        if lock(&world).held_leases && kind < 10 {
            held(&node, &world, &name).await;
            continue;
        }
        match kind {
            0..=39 => plain(&node, &world, &name).await,
            40..=49 => fail_closed(&node, &world, &name).await,
            50..=62 => keepalive(&node, &world, &name).await,
            63..=74 => queued(&node, &world, &name).await,
            _ => batch(&node, &world, &name).await,
        }
        let idle = draw(&world, |w| w.between(0, 300));
        tokio::time::sleep(Duration::from_millis(idle)).await;
    }
}

/// Acquire with an optional wait; checks that the acquire ends by its deadline.
async fn acquire(
    node: &Node,
    world: &Shared,
    k: &str,
    name: &str,
    duration: Option<Duration>,
    mut opts: AcquireOptions,
) -> Result<Lease, Error> {
    let start = now();
    let deadline = start + opts.wait.unwrap_or_default().max(Duration::from_secs(2));
    opts.deadline = Some(deadline);
    // A fail-closed acquire's own lease: whether the item holds it (it never expires).
    let own = opts.lease_id.clone().filter(|_| duration.is_none());
    let holds_own = |id: &LeaseId| {
        node.store
            .peek(k)
            .is_some_and(|r| &r.lease_id == id && r.released_at_ms.is_none() && r.semaphore.slots.is_none())
    };
    let held_before = own.as_ref().is_some_and(holds_own);
    let opts_waited = opts.wait.is_some_and(|w| !w.is_zero());
    let r = node.coord.acquire(k, name, duration, opts).await;
    let end = now();
    if let Some(id) = &own {
        answered_by_own_lease(world, k, name, id, &r, held_before && holds_own(id), holds_own(id));
    }
    // A request already sent is bounded by the attempt timeout.
    if end > deadline + ATTEMPT_TIMEOUT + Duration::from_millis(1) {
        let late = end.duration_since(deadline).as_millis();
        lock(world).violations.push(Violation::new(
            "wait_past_deadline",
            k,
            format!("{name}'s acquire ended {late} ms after its deadline"),
        ));
    }
    if matches!(r, Err(Error::LeaseHeld { .. })) && opts_waited {
        let coordinator = node.coord.id().to_string();
        lock(world).events.push(Event::WaitedInVain { key: k.to_string(), coordinator, start, end });
    }
    if let Ok(l) = &r {
        if node.rogue {
            lock(world).violations.push(Violation::new(
                "skewed_clock_granted",
                k,
                format!("{name}, whose clock is beyond the skew margin, was granted fence {}", l.fence),
            ));
        }
        told(world, name, l);
    }
    r
}

/// What a fail-closed acquire with the caller's lease_id is answered must match what became
/// of that lease: `LeaseHeld` never while its own lease held the key from before the call
/// until the answer (every attempt was evaluated on it: the answer is the lease);
/// `NotHolder` only for a lease that ended (released, expired), never `wrong_lease_id` (a
/// lease_id that never held the key has nothing that ended) and never while its lease holds
/// the key.
fn answered_by_own_lease(
    world: &Shared,
    k: &str,
    name: &str,
    id: &LeaseId,
    r: &Result<Lease, Error>,
    held_throughout: bool,
    held_at_answer: bool,
) {
    let wrong = match r {
        Err(Error::LeaseHeld { .. }) if held_throughout => Some("its own lease held the key: LeaseHeld"),
        Err(Error::NotHolder { reason: NotHolderReason::WrongLeaseId, .. }) => {
            Some("NotHolder (wrong_lease_id) for a lease_id whose lease never ended")
        }
        Err(Error::NotHolder { .. }) if held_at_answer => Some("its lease holds the key: NotHolder"),
        _ => None,
    };
    if let Some(what) = wrong {
        lock(world).violations.push(Violation::new(
            "wrong_answer_to_own_lease_id",
            k,
            format!("{name}'s fail-closed acquire with lease {}: {what}", &id.expose()[..id.expose().len().min(12)]),
        ));
    }
}

/// An acquire that failed ambiguously: the lease that may have landed is released with the id
/// the error names (one call more).
async fn release_unknown(node: &Node, world: &Shared, k: &str, e: &Error) {
    if let Some((_, id)) = e.unknown_leases().into_iter().next() {
        if op(world) {
            let _ = node.coord.release(k, &LeaseId::from_string(id)).await;
        }
    }
}

/// A plain lease, maybe waited for: work, heartbeats, a pause now and then, release.
async fn plain(node: &Node, world: &Shared, name: &str) {
    let (k, wait, dur) = draw(world, |w| {
        let wait = [0u64, 0, 300, 2000, 5000][w.below(5) as usize];
        (key(w.below(KEYS as u64)), wait, w.between(300, 3000))
    });
    if !op(world) {
        return;
    }
    let opts =
        AcquireOptions { wait: Some(Duration::from_millis(wait)).filter(|w| !w.is_zero()), ..Default::default() };
    let lease = match acquire(node, world, &k, name, Some(Duration::from_millis(dur)), opts).await {
        Ok(l) => l,
        Err(e) => {
            release_unknown(node, world, &k, &e).await;
            return;
        }
    };
    hold(node, world, name, lease, None).await;
}

/// A lease held with [`leasehold::HeldLease`]: renewed in the background (every renewal the
/// holder is given is told), the work run under `run` (cancelled at a loss or at the safe time)
/// and writing to the guarded resource when done, then released, or dropped (released in the
/// background).
async fn held(node: &Node, world: &Shared, name: &str) {
    let (k, dur, work, drop_it) =
        draw(world, |w| (key(w.below(KEYS as u64)), w.between(600, 3000), w.between(100, 6000), w.chance(0.3)));
    if !op(world) {
        return;
    }
    let h = match node.coord.hold(&k, name, Duration::from_millis(dur), AcquireOptions::default()).await {
        Ok(h) => h,
        Err(e) => {
            release_unknown(node, world, &k, &e).await;
            return;
        }
    };
    let Some(first) = h.lease() else { return };
    told(world, name, &first);
    let mut rx = h.watch();
    let watcher = {
        let (w, n) = (world.clone(), name.to_string());
        tokio::spawn(async move {
            while rx.changed().await.is_ok() {
                let state = rx.borrow_and_update().clone();
                match state {
                    leasehold::HoldState::Held(l) => told(&w, &n, &l),
                    leasehold::HoldState::Lost(_) => return,
                }
            }
        })
    };
    let done = h
        .run(async {
            tokio::time::sleep(Duration::from_millis(work)).await;
            // `run` cancels the work at a loss or at the safe time: it never gets this far later.
            if h.last_safe_until().is_some_and(|s| now() > s) {
                lock(world).violations.push(Violation::new(
                    "worked_past_safe_time",
                    &k,
                    format!("{name}'s work under HeldLease::run went on past the lease's safe time"),
                ));
            }
            if let Some(l) = h.lease() {
                write_resource(world, &k, &l, true);
            }
        })
        .await;
    if done.is_err() {
        lock(world).fault("held_lease_lost");
    }
    ended(world, name, &k, &first.lease_id);
    op(world);
    if drop_it {
        drop(h);
    } else {
        let _ = h.release().await;
    }
    watcher.abort();
}

/// The semaphores of the semaphore runs (`Settings::semaphores`): key and N.
pub(crate) const SEMAPHORES: [(&str, u32); 2] = [("sem2", 2), ("sem3", 3)];

/// A semaphore's slot, waited for or not: held with heartbeats and now and then a pause past
/// its safe time, then released. No guarded resource: N holders write side by side (the
/// checker counts the holders instead, `over_slots`).
async fn semaphore(node: &Node, world: &Shared, name: &str) {
    let (i, wait, dur, steps) = draw(world, |w| {
        let wait = [0u64, 300, 2000][w.below(3) as usize];
        (w.below(SEMAPHORES.len() as u64) as usize, wait, w.between(300, 3000), w.between(1, 4))
    });
    let (k, n) = SEMAPHORES[i];
    if !op(world) {
        return;
    }
    let wait = Some(Duration::from_millis(wait)).filter(|w| !w.is_zero());
    let opts = AcquireOptions { wait, slots: Some(n), ..Default::default() };
    let mut lease = match acquire(node, world, k, name, Some(Duration::from_millis(dur)), opts).await {
        Ok(l) => l,
        Err(e) => {
            release_unknown(node, world, k, &e).await;
            return;
        }
    };
    for _ in 0..steps {
        if draw(world, |w| w.chance(0.03)) {
            lock(world).fault("pause");
            let past = draw(world, |w| w.between(100, 4000));
            let until = lease.safe_until.unwrap_or_else(now);
            tokio::time::sleep_until((until.max(now()) + Duration::from_millis(past)).into()).await;
            break;
        }
        let left = lease.safe_until.map_or(500, |s| s.saturating_duration_since(now()).as_millis() as u64);
        let work = draw(world, |w| w.between(0, left / 2));
        tokio::time::sleep(Duration::from_millis(work)).await;
        if !op(world) {
            break;
        }
        let d = draw(world, |w| w.chance(0.5).then(|| Duration::from_millis(w.between(300, 3000))));
        match node.coord.heartbeat(k, &lease.lease_id, d).await {
            Ok(l) => {
                told(world, name, &l);
                lease = l;
            }
            Err(Error::NotHolder { .. }) => break,
            Err(_) if lease.safe_until.is_some_and(|s| now() >= s) => break,
            Err(_) => {}
        }
    }
    ended(world, name, k, &lease.lease_id);
    op(world);
    let _ = node.coord.release(k, &lease.lease_id).await;
}

/// Turns on the hot key: acquire with a long wait, a short hold, release, and at once again
/// (a few times), as a worker looping on one key does. Several clients of one coordinator doing
/// this keep its in-process line busy; a waiter of another coordinator must still get turns
/// (the checker's `waiter_starved`).
async fn hot(node: &Node, world: &Shared, name: &str) {
    let turns = draw(world, |w| w.between(1, 6));
    let k = key(0);
    for _ in 0..turns {
        if !op(world) {
            return;
        }
        let opts = AcquireOptions { wait: Some(Duration::from_secs(8)), ..Default::default() };
        let lease = match acquire(node, world, &k, name, Some(Duration::from_secs(3)), opts).await {
            Ok(l) => l,
            Err(e) => {
                if let Some((_, id)) = e.unknown_leases().into_iter().next() {
                    let _ = node.coord.release(&k, &LeaseId::from_string(id)).await;
                }
                return;
            }
        };
        let work = draw(world, |w| w.between(20, 300));
        tokio::time::sleep(Duration::from_millis(work)).await;
        if lease.safe_until.is_none_or(|s| now() < s) {
            write_resource(world, &k, &lease, true);
        }
        ended(world, name, &k, &lease.lease_id);
        op(world);
        let _ = node.coord.release(&k, &lease.lease_id).await;
    }
}

/// Holds `lease`: writes, heartbeats, maybe a pause; then releases (into `to` for a work item).
async fn hold(node: &Node, world: &Shared, name: &str, mut lease: Lease, to: Option<String>) {
    let k = lease.key.clone();
    let steps = draw(world, |w| w.between(1, 5));
    for _ in 0..steps {
        let pause = draw(world, |w| w.chance(0.03));
        if pause {
            // Frozen past the lease (a GC pause), then resuming its writes as if nothing happened.
            lock(world).fault("pause");
            let past = draw(world, |w| w.between(100, 4000));
            let until = lease.safe_until.unwrap_or_else(now);
            tokio::time::sleep_until((until.max(now()) + Duration::from_millis(past)).into()).await;
            write_resource(world, &k, &lease, false);
        } else {
            let left = lease.safe_until.map_or(500, |s| s.saturating_duration_since(now()).as_millis() as u64);
            let work = draw(world, |w| w.between(0, left / 2));
            tokio::time::sleep(Duration::from_millis(work)).await;
            if lease.safe_until.is_none_or(|s| now() < s) {
                write_resource(world, &k, &lease, true);
            } else {
                break;
            }
        }
        if lease.safe_until.is_none() {
            continue;
        }
        if !op(world) {
            break;
        }
        let d = draw(world, |w| w.chance(0.5).then(|| Duration::from_millis(w.between(300, 3000))));
        match node.coord.heartbeat(&k, &lease.lease_id, d).await {
            Ok(l) => {
                told(world, name, &l);
                lease = l;
            }
            Err(Error::NotHolder { .. }) => {
                ended(world, name, &k, &lease.lease_id);
                return;
            }
            Err(_) => {
                if lease.safe_until.is_some_and(|s| now() >= s) {
                    break;
                }
            }
        }
    }
    ended(world, name, &k, &lease.lease_id);
    op(world);
    let sent = now();
    let r = node.coord.release_to(&k, &lease.lease_id, to.as_deref()).await;
    // A release sent while the lease was live (its safe time) finds it ours, released by an
    // earlier try of its own (`already_released`), or handed on: never `NotHolder`, unless an
    // operator evicted it (the checker allows for that).
    if matches!(r, Err(Error::NotHolder { .. })) && lease.safe_until.is_some_and(|s| sent < s) {
        let (key, id) = (k.clone(), lease.lease_id.expose().to_string());
        lock(world).events.push(Event::ReleaseRefused { key, lease: id, at: now() });
    }
    // (The release after an unknown outcome is awaited in its own arm.)
    #[allow(clippy::collapsible_match)]
    match (r, to) {
        (Ok(rel), Some(to)) if !rel.already_released && rel.state.as_deref() == Some(to.as_str()) => {
            let at = now();
            lock(world).events.push(Event::Finished { key: k, lease: lease.lease_id.expose().to_string(), at });
        }
        (Err(e), _) if e.is_transient() && lease.safe_until.is_none() => {
            if !release_until_done(&node.coord, &k, &lease.lease_id).await {
                lock(world).orphans.push((k, lease.lease_id.clone()));
            }
        }
        _ => {}
    }
}

/// Releases until the answer is definite; false if it never was.
async fn release_until_done(coord: &Coordinator, k: &str, id: &LeaseId) -> bool {
    for _ in 0..20 {
        match coord.release(k, id).await {
            Ok(_) | Err(Error::NotHolder { .. } | Error::NotFound { .. }) => return true,
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
    false
}

/// A fail-closed lease with the client's own lease_id: a lost answer is retried with it.
async fn fail_closed(node: &Node, world: &Shared, name: &str) {
    let (k, id) = draw(world, |w| {
        let id = format!("fc-{:016x}{:016x}", split(&mut w.rng), split(&mut w.rng));
        (key(w.below(KEYS as u64)), LeaseId::from_string(id))
    });
    // The id is kept (as a process would persist it) until a release is definite.
    let entry = (k.clone(), id.expose().to_string());
    lock(world).fail_closed.entry(name.to_string()).or_default().insert(entry.clone());
    let definite = fail_closed_session(node, world, name, &k, &id).await;
    // Released, or never definite: release what may have landed (and keep the id if even
    // that fails). Without a definite answer to any try, an attempt may still be in the
    // network and land after this release found nothing (DESIGN.md, "acquire": the limit that
    // remains): the id is kept, and released again at the end.
    if !release_until_done(&node.coord, &k, &id).await {
        lock(world).orphans.push((k, id));
    } else if !definite {
        lock(world).released_orphans.push((k, id));
    }
    if let Some(s) = lock(world).fail_closed.get_mut(name) {
        s.remove(&entry);
    }
}

/// Whether the session ended definitely: granted, or refused (`LeaseHeld`, `NotHolder`) with no
/// earlier call of it left unanswered.
async fn fail_closed_session(node: &Node, world: &Shared, name: &str, k: &str, id: &LeaseId) -> bool {
    let k = k.to_string();
    // An earlier call's attempt may still be in the network after a later call's definite
    // refusal: the refusal does not make the session definite.
    let mut unsure = false;
    for _ in 0..5 {
        if !op(world) {
            break;
        }
        let opts = AcquireOptions { lease_id: Some(id.clone()), ..Default::default() };
        match acquire(node, world, &k, name, None, opts).await {
            Ok(l) => {
                hold(node, world, name, l, None).await;
                return true;
            }
            Err(Error::LeaseHeld { .. } | Error::NotHolder { .. }) => return !unsure,
            // Unknown or failed: the same request again (idempotent with the same lease_id).
            Err(_) => {
                unsure = true;
                tokio::time::sleep(Duration::from_millis(100)).await
            }
        }
    }
    false
}

/// A keep-alive lease bound to an execution: renewed by the sweep while the execution runs.
async fn keepalive(node: &Node, world: &Shared, name: &str) {
    let (k, dur, until, arn) = draw(world, |w| {
        let arn = format!("exec-{:016x}", split(&mut w.rng));
        (key(w.below(KEYS as u64)), w.between(800, 2000), w.between(2000, 8000), arn)
    });
    if !op(world) {
        return;
    }
    lock(world).executions.insert(arn.clone(), true);
    let ka = Keepalive { until_ms: node.coord.now_ms() + until, execution_arn: Some(arn.clone()) };
    let opts = AcquireOptions { keepalive: Some(ka), ..Default::default() };
    let lease = match acquire(node, world, &k, name, Some(Duration::from_millis(dur)), opts).await {
        Ok(l) => l,
        Err(e) => {
            lock(world).executions.insert(arn, false);
            if let Some((_, id)) = e.unknown_leases().into_iter().next() {
                let _ = node.coord.release(&k, &LeaseId::from_string(id)).await;
            }
            return;
        }
    };
    // The holder works within what it was told, writing with its fence.
    let work = draw(world, |w| w.between(0, dur));
    tokio::time::sleep(Duration::from_millis(work)).await;
    let safe = lease.safe_until.is_none_or(|s| now() < s);
    if safe {
        write_resource(world, &k, &lease, true);
    }
    ended(world, name, &k, &lease.lease_id);
    // The execution ends: it releases itself, or leaves the release to the sweep.
    let end = draw(world, |w| w.below(3));
    let extra = draw(world, |w| w.between(0, until));
    tokio::time::sleep(Duration::from_millis(extra)).await;
    lock(world).executions.insert(arn, false);
    if end == 0 && op(world) {
        let _ = node.coord.release(&k, &lease.lease_id).await;
    }
}

/// The scheduled keep-alive sweep of a process: sometimes late, sometimes twice at once.
async fn sweeper(node: Arc<Node>, world: Shared) {
    let ex: Arc<dyn Executions> = Arc::new(SimExecutions(world.clone()));
    loop {
        let (every, twice) = draw(&world, |w| {
            let late = w.chance(0.05);
            if late {
                w.fault("sweep_late");
            }
            (if late { w.between(2000, 6000) } else { w.between(200, 800) }, w.chance(0.05))
        });
        tokio::time::sleep(Duration::from_millis(every)).await;
        if lock(&world).stop {
            return;
        }
        lock(&world).ops += 1;
        let deadline = now() + Duration::from_secs(2);
        if twice {
            lock(&world).fault("sweep_twice");
            let (a, b) = (node.coord.clone(), node.coord.clone());
            let (e1, e2) = (ex.clone(), ex.clone());
            let t = tokio::spawn(async move { a.keepalive_sweep(Some(e1), 100, deadline).await });
            b.keepalive_sweep(Some(e2), 100, deadline).await;
            let _ = t.await;
        } else {
            node.coord.keepalive_sweep(Some(ex.clone()), 100, deadline).await;
        }
    }
}

/// A batch over the work items: take up to a few free items of the first state, work, and
/// release each into the final state (or back, unfinished); a producer puts finished items back.
async fn batch(node: &Node, world: &Shared, name: &str) {
    let seed = lock(world).seed;
    let (limit, dur, wait, refill) =
        draw(world, |w| (w.between(1, 3) as u32, w.between(500, 3000), w.chance(0.3), w.chance(0.3)));
    if refill {
        let k = work_key(draw(world, |w| w.below(WORK as u64)));
        if op(world) {
            let _ = node.coord.put(&k, &todo(seed), name).await;
        }
        return;
    }
    if !op(world) {
        return;
    }
    let opts = AcquireOptions { wait: wait.then(|| Duration::from_millis(1000)), ..Default::default() };
    let leases = match node.coord.acquire_next(&todo(seed), limit, name, Some(Duration::from_millis(dur)), opts).await {
        Ok(l) => l,
        Err(e) => {
            for (k, id) in e.unknown_leases() {
                let _ = node.coord.release(&k, &LeaseId::from_string(id)).await;
            }
            return;
        }
    };
    for l in &leases {
        if node.rogue {
            lock(world).violations.push(Violation::new(
                "skewed_clock_granted",
                &l.key,
                format!("{name}, whose clock is beyond the skew margin, was granted a batch lease"),
            ));
        }
        told(world, name, l);
    }
    for l in leases {
        let finish = draw(world, |w| w.chance(0.8));
        hold(node, world, name, l, finish.then(|| done(seed)).or(Some(todo(seed)))).await;
    }
}

/// The simulated Step Functions: task tokens, `SendTaskSuccess` / `SendTaskFailure` with
/// latency, refusals and lost answers (the call lands, the answer never comes: the caller's
/// 3 s client timeout), token timeouts and deleted executions. A closed task answers
/// `TaskTimedOut`, an unknown or deleted one `TaskDoesNotExist`, as Step Functions does.
struct SimSfn(Shared);

#[async_trait::async_trait]
impl Deliver for SimSfn {
    async fn success(&self, token: &str, lease: &Lease) -> Result<(), DeliveryError> {
        let (latency, fault) = draw(&self.0, |w| (w.between(5, 80), w.below(100)));
        tokio::time::sleep(Duration::from_millis(latency)).await;
        if fault < 4 {
            lock(&self.0).fault("sfn_throttled");
            return Err(DeliveryError::Transient("ThrottlingException".into()));
        }
        let answer = {
            let mut w = lock(&self.0);
            let at = now();
            match w.tasks.get_mut(token) {
                None => Err(DeliveryError::Gone("TaskDoesNotExist".into())),
                Some(t) if t.deleted => Err(DeliveryError::Gone("TaskDoesNotExist".into())),
                Some(t) if t.closed || at >= t.timeout => {
                    t.closed = true;
                    Err(DeliveryError::Gone("TaskTimedOut".into()))
                }
                Some(t) => {
                    t.closed = true;
                    Ok(t.exec.clone())
                }
            }
        };
        let exec = match answer {
            Ok(exec) => exec,
            Err(e) => return Err(e),
        };
        // The task has its output: the execution holds the lease (heartbeats, writes, release
        // through the functions).
        if lease.key.is_empty() || lease.safe_until.is_some_and(|s| s <= now()) {
            // Delivered too late to use: the execution does not use it (it ends with its
            // duration).
            lock(&self.0).fault("sfn_late_delivery");
        } else {
            told(&self.0, &exec, lease);
            let (w, l) = (self.0.clone(), lease.clone());
            let node = lock(&self.0).functions.clone().expect("the functions");
            let h = tokio::spawn(async move { hold(&node, &w, &exec, l, None).await });
            lock(&self.0).exec_tasks.push(h);
        }
        if fault < 10 {
            // Landed, but the answer is lost: the client's timeout.
            lock(&self.0).fault("sfn_lost_answer");
            tokio::time::sleep(Duration::from_secs(3)).await;
            return Err(DeliveryError::Transient("timeout".into()));
        }
        Ok(())
    }

    async fn failure(&self, token: &str, _error: &str, _cause: &str) -> Result<(), DeliveryError> {
        let latency = draw(&self.0, |w| w.between(5, 80));
        tokio::time::sleep(Duration::from_millis(latency)).await;
        let mut w = lock(&self.0);
        let at = now();
        match w.tasks.get_mut(token) {
            Some(t) if !t.deleted && !t.closed && at < t.timeout => {
                t.closed = true;
                Ok(())
            }
            Some(t) if !t.deleted => Err(DeliveryError::Gone("TaskTimedOut".into())),
            _ => Err(DeliveryError::Gone("TaskDoesNotExist".into())),
        }
    }
}

/// The functions' coordinator: serves queues, never crashes (a Lambda function).
fn functions_node(world: &Shared, store: &SimStore, truth: &Arc<SimClock>) -> Arc<Node> {
    let clock = Arc::new(SimClock::offset_from(truth, 0));
    let handle = store.handle();
    let coord = Coordinator::new(Arc::new(handle.clone()), config(clock.clone(), lock(world).blind_clock))
        .with_deliver(Arc::new(SimSfn(world.clone())));
    Arc::new(Node { coord, store: handle, clock, name: "fn".into(), rogue: false, serves_queues: true })
}

/// The scheduled queue sweep (the heartbeat function's), until the run is over.
async fn queue_sweeper(node: Arc<Node>, world: Shared) {
    loop {
        let every = draw(&world, |w| w.between(500, 1500));
        tokio::time::sleep(Duration::from_millis(every)).await;
        if lock(&world).end {
            return;
        }
        let _ = node.coord.sweep_queues(now() + Duration::from_secs(2)).await;
    }
}

/// A Step Functions execution that waits for a key in its queue (QueuedSingleFlight): the
/// acquire function enqueues it with the task token (a retried invocation sends the same
/// lease_id with a new token: Step Functions gives each attempt of a task its own, and the
/// failed attempt's token is dead); the execution learns its lease only from `SendTaskSuccess`.
/// Some executions are stopped and deleted while they wait. The execution lives in Step
/// Functions, not in the client's process: it runs on (a crash of the client's process does not
/// stop it), and an invocation cut short by a crash of the process it runs in fails, and is
/// retried on another (a Lambda retry runs on any instance).
async fn queued(node: &Arc<Node>, world: &Shared, name: &str) {
    let (k, dur, timeout, tag, delete) = draw(world, |w| {
        (key(w.below(KEYS as u64)), w.between(800, 3000), w.between(2000, 40000), split(&mut w.rng), w.chance(0.1))
    });
    if !op(world) {
        return;
    }
    let exec = format!("{name}/exec-{tag:016x}");
    let lease_id = LeaseId::from_string(format!("q-{tag:016x}"));
    let task = Task {
        exec: exec.clone(),
        key: k.clone(),
        lease_id: lease_id.expose().to_string(),
        timeout: now() + Duration::from_millis(timeout),
        closed: false,
        deleted: false,
    };
    // The acquire function: this process when it serves queues, else the functions.
    let f = if node.serves_queues { node.clone() } else { lock(world).functions.clone().expect("the functions") };
    let timeout_at_ms = f.coord.now_ms() + timeout;
    let x = Execution { task, tag, lease_id, dur, timeout_at_ms };
    let w = world.clone();
    let h = tokio::spawn(async move {
        if let Some(token) = execution(f, &w, x).await {
            if delete {
                delete_later(&w, token, timeout).await;
            }
        }
    });
    let _ = h.await;
}

/// A queued execution's task, as the acquire function is invoked for it.
struct Execution {
    task: Task,
    tag: u64,
    lease_id: LeaseId,
    dur: u64,
    timeout_at_ms: u64,
}

/// Invokes the acquire function for `x` until its task waits (the token it waits on), or
/// fails (`None`): each invocation that fails is retried (3 attempts), with a new token.
async fn execution(mut f: Arc<Node>, world: &Shared, x: Execution) -> Option<String> {
    let mut token = format!("token-{:016x}", x.tag);
    lock(world).tasks.insert(token.clone(), x.task.clone());
    let opts = AcquireOptions { lease_id: Some(x.lease_id.clone()), ..Default::default() };
    let (k, exec) = (x.task.key.clone(), x.task.exec.clone());
    for attempt in 1..=3 {
        let inv = {
            let (f, k, exec, opts, token) = (f.clone(), k.clone(), exec.clone(), opts.clone(), token.clone());
            let (d, t) = (Duration::from_millis(x.dur), Some(x.timeout_at_ms));
            tokio::spawn(async move { f.coord.acquire_or_enqueue(&k, &exec, d, opts, &token, t).await })
        };
        // The invocation runs in `f`'s process: a crash of that process stops it.
        if !f.name.starts_with("fn") {
            lock(world).invocations.entry(f.name.clone()).or_default().push(inv.abort_handle());
        }
        let crashed = || Error::StoreUnavailable("the acquire function's process crashed".into());
        let res = inv.await.unwrap_or_else(|_| Err(crashed()));
        match res {
            Ok(_) => return Some(token),
            // The invocation failed: Step Functions retries the task (same input, a new token).
            Err(e) if e.is_transient() || matches!(e, Error::OutcomeUnknown { .. }) => {
                // Step Functions retries a task only while it waits: a task whose token a
                // delivery already completed (`SendTaskSuccess` landed while this invocation
                // ran) has moved on with its lease, and its invocation's late failure is
                // ignored; a task that timed out is not retried either.
                {
                    let mut w = lock(world);
                    let t = w.tasks.get_mut(&token)?;
                    if t.closed {
                        return Some(token);
                    }
                    // The attempt failed with its invocation: its token is dead from now on
                    // (a delivery to it answers `TaskTimedOut`).
                    t.closed = true;
                }
                if attempt == 3 {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
                // The retried attempt waits on a token of its own, as on Step Functions, and
                // runs in a live process (a crashed one is gone).
                token = format!("token-{:016x}-{attempt}", x.tag);
                let mut w = lock(world);
                if f.store.is_stopped() {
                    f = w.functions.clone().expect("the functions");
                }
                w.tasks.insert(token.clone(), x.task.clone());
                w.fault("invocation_retried");
            }
            Err(_) => break,
        }
    }
    // The task failed (its invocation did): it waits for nothing more. (A slot it may have
    // taken, or a grant made to it, is the queue's to skip or revoke.)
    if let Some(t) = lock(world).tasks.get_mut(&token) {
        t.closed = true;
    }
    None
}

/// Stops and deletes the execution waiting on `token` at some point within its timeout.
async fn delete_later(world: &Shared, token: String, timeout: u64) {
    let after = draw(world, |w| w.between(0, timeout));
    let w = world.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(after)).await;
        let mut w = lock(&w);
        if let Some(t) = w.tasks.get_mut(&token) {
            if !t.closed {
                t.deleted = true;
                w.fault("execution_deleted");
            }
        }
    });
}

/// No queued waiter is lost while its execution lives: at the end of the run (every holder
/// gone, the queue sweep running), each task still waiting within its timeout is a violation.
fn lost_waiters(world: &Shared) {
    let mut w = lock(world);
    let at = now();
    let lost: Vec<Task> = w.tasks.values().filter(|t| !t.closed && !t.deleted && t.timeout > at).cloned().collect();
    for t in lost {
        let v = Violation::new(
            "waiter_lost",
            &t.key,
            format!("{} (lease {}) still waits, unserved, after every lease ended", t.exec, &t.lease_id[..10]),
        );
        w.violations.push(v);
    }
}
