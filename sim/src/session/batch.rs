//! Batches over the work items: leases taken with `acquire_next` and released into the next
//! state, and the producer that puts finished items back.

use std::time::Duration;

use leasehold::{AcquireOptions, LeaseId};

use super::{hold, told};
use crate::violation::Violation;
use crate::world::{done, draw, lock, op, todo, work_key, Node, Shared, WORK};

/// A batch over the work items: take up to a few free items of the first state, work, and
/// release each into the final state (or back, unfinished); a producer puts finished items back.
pub(crate) async fn batch(node: &Node, world: &Shared, name: &str) {
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
