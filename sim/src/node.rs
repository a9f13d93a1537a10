//! Coordinator processes (the library users' and the functions'): their configuration, clocks
//! and crashes, and each one's keep-alive sweep.

use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold::testing::{SimClock, SimStore};
use leasehold::{Config, Coordinator, ExecutionState, Executions, LeaseId};

use crate::session::client;
use crate::sfn::SimSfn;
use crate::world::{draw, lock, now, Event, Node, Shared};
use crate::SKEW_MARGIN_MS;

/// A coordinator process and its tasks (clients, sweeper).
pub(crate) type Running = (Arc<Node>, Vec<tokio::task::JoinHandle<()>>);

pub(crate) struct SimExecutions(pub(crate) Shared);

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
pub(crate) fn config(clock: Arc<SimClock>, blind: bool) -> Config {
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
    // The sweeper's period here (`sweeper`: every 200 to 800 ms, now and then late), so that
    // keep-alive leases of 800 ms and more are accepted: with the product's 60 s a keep-alive
    // lease needs 180 s, and every one the sessions asked for was refused.
    c.limits.keepalive_sweep_period = Duration::from_millis(SWEEP_PERIOD_MS);
    if blind {
        // The product's fence lead, longer than the grace here, so that the TTL after the fence
        // is what keeps a copied fence from outliving its item; and leases of at most 30 s, so
        // that released items (TTL after `max_duration`) are deleted within the run.
        c.fence_lead = Duration::from_secs(60);
        c.limits.max_duration = Duration::from_secs(30);
    }
    c
}

/// How far past the skew margin an honest coordinator's clock at an edge of the accepted band
/// may be (ms): about what the check accepts ahead with steady answers (DESIGN.md, "Clocks").
const EDGE_BEYOND_MS: u64 = 300;

/// The index of the node that takes every key at the end of a run (finale.rs): its clock is
/// within the margin, so that the check never refuses it.
pub(crate) const FINAL_NODE: usize = 99;

/// How a coordinator's clock is.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Within the skew margin, or (in some nodes) at an edge of the band the check accepts.
    Honest,
    /// Beyond the margin: its check refuses it.
    Rogue,
    /// Beyond the margin, unseen by its check.
    Blind,
}

pub(crate) fn start_node(world: &Shared, store: &SimStore, truth: &Arc<SimClock>, i: usize, kind: Kind) -> Running {
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
        } else if i != FINAL_NODE && w.chance(0.3) {
            // At an edge of the band the check accepts: past the margin by up to what the
            // `Date` evidence cannot prove (its whole-second stamps, the allowance for a late
            // one), so that two such clocks at opposite edges differ by more than twice the
            // margin. Accepted while the evidence is wide; refused (`ClockSkew`) once answers
            // at enough phases narrow it.
            let o = w.between(SKEW_MARGIN_MS - 20, SKEW_MARGIN_MS + EDGE_BEYOND_MS) as i64;
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
    if kind == Kind::Honest && offset.unsigned_abs() >= SKEW_MARGIN_MS - 20 {
        lock(world).fault("clock_edge");
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

/// The functions' coordinator (a Lambda function's process): serves queues. The `n`th process
/// (after `n` crashes) has a clock of its own, within half the margin (the first: the store's).
pub(crate) fn functions_node(world: &Shared, store: &SimStore, truth: &Arc<SimClock>, n: usize) -> Arc<Node> {
    let offset = if n == 0 {
        0
    } else {
        draw(world, |w| w.between(0, SKEW_MARGIN_MS - 20) as i64) - (SKEW_MARGIN_MS / 2 - 10) as i64
    };
    let clock = Arc::new(SimClock::offset_from(truth, offset));
    let handle = store.handle();
    let coord = Coordinator::new(Arc::new(handle.clone()), config(clock.clone(), lock(world).blind_clock))
        .with_deliver(Arc::new(SimSfn(world.clone())));
    Arc::new(Node { coord, store: handle, clock, name: format!("fn{n}"), rogue: false, serves_queues: true })
}

/// The functions' process crashes (its requests stop; those sent still land; the invocations
/// running in it end unanswered, and Step Functions retries them) and a new one takes the next
/// invocations, with a clock of its own.
pub(crate) fn crash_functions(world: &Shared, store: &SimStore, truth: &Arc<SimClock>) {
    let (old, n) = {
        let mut w = lock(world);
        w.functions_crashed += 1;
        w.fault("function_crash");
        (w.functions.clone().expect("the functions"), w.functions_crashed)
    };
    old.store.stop();
    for inv in lock(world).invocations.remove(&old.name).unwrap_or_default() {
        inv.abort();
    }
    let new = functions_node(world, store, truth, n);
    lock(world).functions = Some(new);
}

/// A clock jumped beyond the margin: its node's name, when NTP steps it back, and by how much
/// it was stepped.
pub(crate) type Jumped = (Arc<SimClock>, String, Instant, i64);

/// Steps back the clocks whose time has come; now and then jumps one honest coordinator's clock
/// beyond the margin (1 s to 2 min, ahead more often than behind) for 0.5 to 8 s.
pub(crate) fn clock_jumps(world: &Shared, nodes: &[Option<Running>], jumped: &mut Vec<Jumped>) {
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
pub(crate) fn crash_node(world: &Shared, node: &Node, tasks: Vec<tokio::task::JoinHandle<()>>) {
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

/// The period the coordinators are configured with for the keep-alive sweep (ms): a keep-alive
/// lease lasts at least three of them (`KEEPALIVE_SWEEPS`).
pub(crate) const SWEEP_PERIOD_MS: u64 = 250;

/// The scheduled keep-alive sweep of a process: sometimes late, sometimes twice at once.
pub(crate) async fn sweeper(node: Arc<Node>, world: Shared) {
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
