//! Keep-alive leases bound to an execution, and the execution that ends with or without a
//! release; in the semaphore runs, a third of them slots of a semaphore.

use std::time::Duration;

use leasehold::{AcquireOptions, Keepalive, LeaseId};

use super::{acquire, SEMAPHORES};
use crate::world::{draw, ended, key, lock, now, op, split, write_resource, Node, Shared, KEYS};

/// A keep-alive lease bound to an execution: renewed by the sweep while the execution runs.
/// A slot of a semaphore is held the same way (the checker counts its holders, `over_slots`).
pub(crate) async fn keepalive(node: &Node, world: &Shared, name: &str) {
    let semaphores = lock(world).semaphores;
    let (k, dur, until, arn, slots) = draw(world, |w| {
        let arn = format!("arn:aws:states:us-east-1:123456789012:execution:sim:exec-{:016x}", split(&mut w.rng));
        let slot = (semaphores && w.chance(1.0 / 3.0)).then(|| SEMAPHORES[w.below(SEMAPHORES.len() as u64) as usize]);
        let k = slot.map_or_else(|| key(w.below(KEYS as u64)), |(k, _)| k.to_string());
        (k, w.between(800, 2000), w.between(2000, 8000), arn, slot.map(|(_, n)| n))
    });
    if !op(world) {
        return;
    }
    lock(world).executions.insert(arn.clone(), true);
    let ka = Keepalive { until_ms: node.coord.now_ms() + until, execution_arn: Some(arn.clone()) };
    let opts = AcquireOptions { keepalive: Some(ka), slots, ..Default::default() };
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
    // N holders of a semaphore write side by side: no guarded resource.
    if safe && slots.is_none() {
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
