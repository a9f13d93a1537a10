//! Queued waiters: a client starts a Step Functions execution that waits for a key in its
//! queue.

use std::sync::Arc;
use std::time::Duration;

use crate::sfn::{delete_later, execution, Execution};
use crate::world::{draw, key, lock, now, op, split, Node, Shared, Task, KEYS};
use leasehold::LeaseId;

/// A Step Functions execution that waits for a key in its queue (QueuedSingleFlight): the
/// acquire function enqueues it with the task token (a retried invocation sends the same
/// lease_id with a new token: Step Functions gives each attempt of a task its own, and the
/// failed attempt's token is dead); the execution learns its lease only from `SendTaskSuccess`.
/// Some executions are stopped and deleted while they wait. The execution lives in Step
/// Functions, not in the client's process: it runs on (a crash of the client's process does not
/// stop it), and an invocation cut short by a crash of the process it runs in fails, and is
/// retried on another (a Lambda retry runs on any instance).
pub(crate) async fn queued(node: &Arc<Node>, world: &Shared, name: &str) {
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
    let x = Execution { task, tag, lease_id, dur };
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
