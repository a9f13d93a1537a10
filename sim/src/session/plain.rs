//! Plain leases, maybe waited for, and the hot key taken again and again by its looping
//! workers.

use std::time::Duration;

use leasehold::{AcquireOptions, LeaseId};

use super::semaphore::SEMAPHORES;
use super::{acquire, hold, release_unknown};
use crate::world::{draw, ended, key, lock, now, op, write_resource, Node, Shared, KEYS};

/// A plain lease, maybe waited for: work, heartbeats, a pause now and then, release.
pub(crate) async fn plain(node: &Node, world: &Shared, name: &str) {
    let on_semaphore = lock(world).semaphores && draw(world, |w| w.chance(0.1));
    let (mut k, wait, dur) = draw(world, |w| {
        let wait = [0u64, 0, 300, 2000, 5000][w.below(5) as usize];
        (key(w.below(KEYS as u64)), wait, w.between(300, 3000))
    });
    if on_semaphore {
        // A plain lease on a semaphore's key: granted only where no semaphore item is (at the
        // start, or after TTL deleted it), and believed alone (`over_slots` weighs it as N).
        k = draw(world, |w| SEMAPHORES[w.below(SEMAPHORES.len() as u64) as usize].0).to_string();
    }
    if !op(world) {
        return;
    }
    let opts =
        AcquireOptions { wait: Some(Duration::from_millis(wait)).filter(|w| !w.is_zero()), ..Default::default() };
    let lease = match acquire(node, world, &k, name, Some(Duration::from_millis(dur)), opts).await {
        Ok(l) => {
            if on_semaphore {
                lock(world).fault("plain_on_semaphore");
            }
            l
        }
        Err(e) => {
            release_unknown(node, world, &k, &e).await;
            return;
        }
    };
    hold(node, world, name, lease, None).await;
}

/// Turns on the hot key: acquire with a long wait, a short hold, release, and at once again
/// (a few times), as a worker looping on one key does. Several clients of one coordinator doing
/// this keep its in-process line busy; a waiter of another coordinator must still get turns
/// (the checker's `waiter_starved`).
pub(crate) async fn hot(node: &Node, world: &Shared, name: &str) {
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
