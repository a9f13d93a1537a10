//! Leases held with `HeldLease`: renewed in the background, the work run under `run`, then
//! released or dropped; in the semaphore runs, a third of them slots of a semaphore.

use std::time::Duration;

use leasehold::AcquireOptions;

use super::{release_unknown, SEMAPHORES};
use crate::violation::Violation;
use crate::world::{draw, ended, key, lock, now, op, told, write_resource, Node, Shared, KEYS};

/// A lease held with [`leasehold::HeldLease`]: renewed in the background (every renewal the
/// holder is given is told), the work run under `run` (cancelled at a loss or at the safe time)
/// and writing to the guarded resource when done, then released, or dropped (released in the
/// background).
pub(crate) async fn held(node: &Node, world: &Shared, name: &str) {
    let semaphores = lock(world).semaphores;
    let (k, dur, work, drop_it, slots) = draw(world, |w| {
        let (k, dur, work, drop_it) =
            (key(w.below(KEYS as u64)), w.between(600, 3000), w.between(100, 6000), w.chance(0.3));
        // In the semaphore runs, a third hold a slot instead.
        match (semaphores && w.chance(1.0 / 3.0)).then(|| SEMAPHORES[w.below(SEMAPHORES.len() as u64) as usize]) {
            Some((k, n)) => (k.to_string(), dur, work, drop_it, Some(n)),
            None => (k, dur, work, drop_it, None),
        }
    });
    if !op(world) {
        return;
    }
    let opts = AcquireOptions { slots, ..Default::default() };
    let h = match node.coord.hold(&k, name, Duration::from_millis(dur), opts).await {
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
            // N holders of a semaphore write side by side: no guarded resource (the checker
            // counts a slot's holders instead, `over_slots`).
            if let Some(l) = h.lease().filter(|_| slots.is_none()) {
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
