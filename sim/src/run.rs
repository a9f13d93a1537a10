//! The run loop: setup, the driver (crashes, restarts, clock steps, jumps, partitions,
//! force-releases), the drain, and the outcome.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold::testing::{Faults, SimClock, SimStore};
use leasehold::{Clock, Coordinator};

use crate::finale;
use crate::node::{
    clock_jumps, config, crash_functions, crash_node, functions_node, start_node, Jumped, Kind, Running,
};
use crate::session::SEMAPHORES;
use crate::sfn::queue_sweeper;
use crate::store_log::fault_map;
use crate::world::{done, draw, key, lock, now, todo, work_key, Event, Shared, World, KEYS, WORK};
use crate::{check, Outcome, Settings, ATTEMPT_TIMEOUT, EPOCH_MS, SKEW_MARGIN_MS};

/// The processes of a run, and the faults the driver has under way.
struct Fleet {
    world: Shared,
    store: SimStore,
    /// The true clock (the store's).
    truth: Arc<SimClock>,
    /// The honest coordinators (`None`: crashed, until its restart).
    nodes: Vec<Option<Running>>,
    /// The coordinators with a clock beyond the margin (rogue, blind), when the run has them.
    others: Vec<Running>,
    /// Crashed coordinators, and when each restarts.
    down: Vec<(usize, Instant)>,
    /// Clocks jumped beyond the margin, and when NTP steps each back.
    jumped: Vec<Jumped>,
}

pub(crate) async fn simulate(s: Settings) -> Outcome {
    let t0 = now();
    let truth = Arc::new(SimClock::new(EPOCH_MS));
    let mut faults = Faults::all(s.fault_rate);
    faults.attempt_timeout = ATTEMPT_TIMEOUT;
    faults.ttl_lag_ms = (0, 5000);
    let store = SimStore::new(truth.clone(), no_faults(), s.seed);
    let world: Shared = Arc::new(Mutex::new(World::new(&s)));
    // The work items enter their first state (no faults yet: setup).
    {
        let setup = Coordinator::new(Arc::new(store.handle()), config(truth.clone(), s.blind_clock));
        for i in 0..WORK as u64 {
            setup.put(&work_key(i), &todo(s.seed), "setup").await.expect("setup put");
        }
    }
    store.set_faults(faults);
    // The functions (Lambda) that executions call, and their scheduled queue sweep.
    let functions = functions_node(&world, &store, &truth, 0);
    lock(&world).functions = Some(functions);
    let queue_sweep = {
        let w = world.clone();
        tokio::spawn(async move { queue_sweeper(w).await })
    };
    let mut fleet = Fleet::start(&s, world.clone(), store.clone(), truth.clone());
    fleet.drive(&s).await;
    fleet.drain(&s).await;
    let final_node = finale::after_every_lease(&world, &store, &truth, &s).await;
    lock(&world).end = true;
    let _ = queue_sweep.await;
    let log = store.take_log();
    // Last, outside the history (its writes are not in the log taken): the idle process.
    finale::idle_past_evidence(&world, &store, &truth).await;
    let out = outcome(&s, &world, &store, log, t0, &truth);
    drop(final_node);
    out
}

/// The store's faults outside the run proper (setup, drain): none, with the run's timeout.
fn no_faults() -> Faults {
    Faults { attempt_timeout: ATTEMPT_TIMEOUT, ..Faults::none() }
}

/// What the run did and found: the checker's verdict over the history.
fn outcome(
    s: &Settings,
    world: &Shared,
    store: &SimStore,
    log: Vec<leasehold::testing::Applied>,
    t0: Instant,
    truth: &Arc<SimClock>,
) -> Outcome {
    let mut w = lock(world);
    let events = std::mem::take(&mut w.events);
    let mut violations = std::mem::take(&mut w.violations);
    let lead = config(truth.clone(), s.blind_clock).fence_lead;
    violations.extend(check::check(&events, &log, t0, lead, &done(s.seed)));
    let findings = violations.iter().filter(|v| v.known).fold(BTreeMap::new(), |mut m, v| {
        *m.entry(v.kind).or_default() += 1;
        m
    });
    let shown = std::env::var("SIM_HISTORY").ok().and_then(|s| s.parse().ok()).unwrap_or(24);
    for v in violations.iter_mut() {
        v.history = check::history(&events, &log, t0, &v.key, v.at, shown);
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
        granted: std::mem::take(&mut w.granted),
        trace_hash: check::trace_hash(&events, &log, t0),
        virtual_ms: now().duration_since(t0).as_millis() as u64,
    }
}

impl Fleet {
    /// The honest coordinators, and in some runs a coordinator whose clock is beyond the skew
    /// margin, and in the blind-clock runs one whose clock error its check cannot see.
    fn start(s: &Settings, world: Shared, store: SimStore, truth: Arc<SimClock>) -> Fleet {
        let mut f =
            Fleet { world, store, truth, nodes: Vec::new(), others: Vec::new(), down: Vec::new(), jumped: Vec::new() };
        for i in 0..s.coordinators {
            let n = f.start_node(i, Kind::Honest);
            f.nodes.push(Some(n));
        }
        if draw(&f.world, |w| w.chance(0.3)) {
            lock(&f.world).fault("clock_beyond_margin");
            let n = f.start_node(s.coordinators, Kind::Rogue);
            f.others.push(n);
        }
        if s.blind_clock {
            lock(&f.world).fault("blind_clock");
            let n = f.start_node(s.coordinators + 1, Kind::Blind);
            f.others.push(n);
        }
        f
    }

    fn start_node(&self, i: usize, kind: Kind) -> Running {
        start_node(&self.world, &self.store, &self.truth, i, kind)
    }

    /// The driver: crashes, restarts, clock steps, force-releases, until the operations are
    /// done.
    async fn drive(&mut self, s: &Settings) {
        loop {
            let pause = draw(&self.world, |w| w.between(50, 400));
            tokio::time::sleep(Duration::from_millis(pause)).await;
            let done_ops = {
                let w = lock(&self.world);
                w.ops >= w.target
            };
            if done_ops {
                break;
            }
            self.restarts();
            let (crash, step, force) = draw(&self.world, |w| (w.chance(0.01), w.chance(0.01), w.chance(0.003)));
            if crash {
                self.crash(s);
            }
            if draw(&self.world, |w| w.chance(0.005)) {
                crash_functions(&self.world, &self.store, &self.truth);
            }
            if step {
                self.step(s);
            }
            if s.clock_jumps {
                clock_jumps(&self.world, &self.nodes, &mut self.jumped);
            }
            // With a blind clock, its leases look stuck to the others (their expiry minutes
            // away): an operator force-releases such keys far more often, and the next grants
            // must not copy its fence (the fence lead) nor let TTL delete it early (the TTL
            // after the fence).
            let force = force || (s.blind_clock && draw(&self.world, |w| w.chance(0.05)));
            if s.held_leases && draw(&self.world, |w| w.chance(0.02)) {
                self.partition(s);
            }
            if force {
                self.force_release(s).await;
            }
        }
    }

    /// Restarts the crashed coordinators whose time has come.
    fn restarts(&mut self) {
        let t = now();
        let due: Vec<usize> = self.down.iter().filter(|(_, at)| *at <= t).map(|(i, _)| *i).collect();
        for i in due {
            self.nodes[i] = Some(self.start_node(i, Kind::Honest));
            lock(&self.world).fault("restart");
        }
        self.down.retain(|(_, at)| *at > t);
    }

    /// Crashes an honest coordinator; it restarts 0.3-3 s later.
    fn crash(&mut self, s: &Settings) {
        let i = draw(&self.world, |w| w.below(s.coordinators as u64)) as usize;
        if let Some((node, tasks)) = self.nodes[i].take() {
            crash_node(&self.world, &node, tasks);
            let back = draw(&self.world, |w| w.between(300, 3000));
            self.down.push((i, now() + Duration::from_millis(back)));
        }
    }

    /// An NTP step or drift change within the margin.
    fn step(&mut self, s: &Settings) {
        let i = draw(&self.world, |w| w.below(s.coordinators as u64)) as usize;
        if let Some((node, _)) = &self.nodes[i] {
            let (delta, ppm) = draw(&self.world, |w| (w.between(0, 40) as i64 - 20, w.between(0, 40) as i64 - 20));
            let off = node.clock.wall_us() / 1000 - self.truth.wall_us() / 1000;
            if (off + delta).abs() <= (SKEW_MARGIN_MS / 2 - 10) as i64 {
                node.clock.step(delta);
            }
            node.clock.set_drift_ppm(ppm);
            lock(&self.world).fault("clock_step");
        }
    }

    /// With held leases, a process is cut off from the store now and then (a network partition
    /// of 0.5-5 s): its holders' renewals fail until their safe time ends.
    fn partition(&mut self, s: &Settings) {
        let (i, ms) = draw(&self.world, |w| (w.below(s.coordinators as u64) as usize, w.between(500, 5000)));
        if let Some((node, _)) = &self.nodes[i] {
            lock(&self.world).fault("partition");
            node.store.partition(Duration::from_millis(ms));
        }
    }

    /// An operator force-releases a key through one of the coordinators.
    async fn force_release(&mut self, s: &Settings) {
        let i = draw(&self.world, |w| w.below(s.coordinators as u64)) as usize;
        if let Some((node, _)) = &self.nodes[i] {
            let mut k = key(draw(&self.world, |w| w.below(KEYS as u64)));
            // With semaphores, a quarter land on one: every slot holder is evicted at once.
            if s.semaphores && draw(&self.world, |w| w.chance(0.25)) {
                let i = draw(&self.world, |w| w.below(SEMAPHORES.len() as u64)) as usize;
                k = SEMAPHORES[i].0.to_string();
            }
            lock(&self.world).fault("force_release");
            // Every belief from before the force-release is cut (the operator evicts whoever
            // held it; it may have landed even when unanswered).
            let at = now();
            lock(&self.world).events.push(Event::Force { key: k.clone(), at });
            let _ = node.coord.force_release(&k).await;
        }
    }

    /// Drain: no new sessions, no more faults; every client ends what it holds.
    async fn drain(&mut self, s: &Settings) {
        for (clock, _, _, delta) in self.jumped.drain(..) {
            clock.step(-delta);
        }
        lock(&self.world).stop = true;
        self.store.set_faults(no_faults());
        for (i, _) in std::mem::take(&mut self.down) {
            self.nodes[i] = Some(self.start_node(i, Kind::Honest));
        }
        let mut all: Vec<Running> = self.nodes.drain(..).flatten().collect();
        all.append(&mut self.others);
        for (_, tasks) in all.iter_mut() {
            for t in tasks.drain(..) {
                let _ = t.await;
            }
        }
        // After a blind clock, the others' clocks pass the last fence it issued (until then
        // they refuse to copy it, `ClockSkew`, and a key it had last is theirs to take only
        // then).
        if s.blind_clock {
            tokio::time::sleep(Duration::from_secs(110)).await;
        }
    }
}
