//! The simulated Step Functions: task tokens and deliveries, the functions' queue sweep, and
//! the executions of queued waiters.

use std::sync::Arc;
use std::time::Duration;

use leasehold::queue::{Deliver, DeliveryError};
use leasehold::{AcquireOptions, Error, Lease, LeaseId};

use crate::session::hold;
use crate::violation::Violation;
use crate::world::{draw, lock, now, told, Node, Shared, Task};

/// The simulated Step Functions: task tokens, `SendTaskSuccess` / `SendTaskFailure` with
/// latency, refusals and lost answers (the call lands, the answer never comes: the caller's
/// 3 s client timeout), token timeouts and deleted executions. A closed task answers
/// `TaskTimedOut`, an unknown or deleted one `TaskDoesNotExist`, as Step Functions does.
pub(crate) struct SimSfn(pub(crate) Shared);

#[async_trait::async_trait]
impl Deliver for SimSfn {
    async fn success(&self, token: &str, lease: &Lease) -> Result<(), DeliveryError> {
        let (latency, fault) = draw(&self.0, |w| (w.between(5, 80), w.below(100)));
        tokio::time::sleep(Duration::from_millis(latency)).await;
        if fault < 4 {
            lock(&self.0).fault("sfn_throttled");
            return Err(DeliveryError::Transient("ThrottlingException".into()));
        }
        if (4..7).contains(&fault) {
            // Held in the network, landing late: past the client's 3 s timeout the caller has
            // given up (and may deliver again) before it lands.
            let held = draw(&self.0, |w| w.between(300, 6000));
            lock(&self.0).fault("sfn_delivery_held");
            if held >= 3000 {
                let (w, token, lease) = (self.0.clone(), token.to_string(), lease.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(held)).await;
                    let _ = land(&w, &token, &lease);
                });
                tokio::time::sleep(Duration::from_secs(3)).await;
                return Err(DeliveryError::Transient("timeout".into()));
            }
            tokio::time::sleep(Duration::from_millis(held)).await;
        }
        land(&self.0, token, lease)?;
        if (7..13).contains(&fault) {
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

/// A `SendTaskSuccess` lands: the task, if it still waits, has its output, and the execution
/// holds the lease (heartbeats, writes, release through the functions) unless it came too late
/// to use.
fn land(world: &Shared, token: &str, lease: &Lease) -> Result<(), DeliveryError> {
    let answer = {
        let mut w = lock(world);
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
    let exec = answer?;
    // The task has its output: the execution holds the lease (heartbeats, writes, release
    // through the functions).
    if lease.key.is_empty() || lease.safe_until.is_some_and(|s| s <= now()) {
        // Delivered too late to use: the execution does not use it (it ends with its
        // duration).
        lock(world).fault("sfn_late_delivery");
    } else {
        told(world, &exec, lease);
        let (w, l) = (world.clone(), lease.clone());
        let node = lock(world).functions.clone().expect("the functions");
        let h = tokio::spawn(async move { hold(&node, &w, &exec, l, None).await });
        lock(world).exec_tasks.push(h);
    }
    Ok(())
}

/// The scheduled queue sweep (the heartbeat function's), until the run is over: each run in
/// the functions' process of the moment.
pub(crate) async fn queue_sweeper(world: Shared) {
    loop {
        let every = draw(&world, |w| w.between(500, 1500));
        tokio::time::sleep(Duration::from_millis(every)).await;
        if lock(&world).end {
            return;
        }
        let node = lock(&world).functions.clone().expect("the functions");
        let _ = node.coord.sweep_queues(now() + Duration::from_secs(2)).await;
    }
}

/// A queued execution's task, as the acquire function is invoked for it.
pub(crate) struct Execution {
    pub(crate) task: Task,
    pub(crate) tag: u64,
    pub(crate) lease_id: LeaseId,
    pub(crate) dur: u64,
}

/// Invokes the acquire function for `x` until its task waits (the token it waits on), or
/// fails (`None`): each invocation that fails is retried (3 attempts), with a new token.
pub(crate) async fn execution(mut f: Arc<Node>, world: &Shared, x: Execution) -> Option<String> {
    let mut token = format!("token-{:016x}", x.tag);
    lock(world).tasks.insert(token.clone(), x.task.clone());
    let opts = AcquireOptions { lease_id: Some(x.lease_id.clone()), ..Default::default() };
    let (k, exec) = (x.task.key.clone(), x.task.exec.clone());
    for attempt in 1..=3 {
        let inv = {
            let (f, k, exec, opts, token) = (f.clone(), k.clone(), exec.clone(), opts.clone(), token.clone());
            // What is left of the task's timeout, as the acquire function is told it.
            let (d, t) = (Duration::from_millis(x.dur), Some(x.task.timeout.saturating_duration_since(now())));
            tokio::spawn(async move { f.coord.acquire_or_enqueue(&k, &exec, d, opts, &token, t).await })
        };
        // The invocation runs in `f`'s process: a crash of that process stops it.
        {
            let mut w = lock(world);
            let running = w.invocations.entry(f.name.clone()).or_default();
            running.retain(|h| !h.is_finished());
            running.push(inv.abort_handle());
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
pub(crate) async fn delete_later(world: &Shared, token: String, timeout: u64) {
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
pub(crate) fn lost_waiters(world: &Shared) {
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
