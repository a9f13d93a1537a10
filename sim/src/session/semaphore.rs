//! Semaphore slots: taken (waited for or not), renewed, paused past, released; the checker counts
//! the holders of each semaphore (`over_slots`).

use std::time::Duration;

use leasehold::{AcquireOptions, Error, LeaseId};

use super::{acquire, release_unknown, release_until_done};
use crate::world::{draw, ended, lock, now, op, split, told, Node, Shared};

/// The semaphores of the semaphore runs (`Settings::semaphores`): key and N.
pub(crate) const SEMAPHORES: [(&str, u32); 2] = [("sem2", 2), ("sem3", 3)];

/// A semaphore's slot, waited for or not: held with heartbeats and now and then a pause past
/// its safe time, then released. No guarded resource: N holders write side by side (the
/// checker counts the holders instead, `over_slots`).
pub(crate) async fn semaphore(node: &Node, world: &Shared, name: &str) {
    let (i, wait, dur, steps) = draw(world, |w| {
        let wait = [0u64, 300, 2000][w.below(3) as usize];
        (w.below(SEMAPHORES.len() as u64) as usize, wait, w.between(300, 3000), w.between(1, 4))
    });
    let (k, n) = SEMAPHORES[i];
    // A quarter of the takes send the caller's own lease_id, sent again after an answer that
    // did not say.
    let own = draw(world, |w| {
        w.chance(0.25).then(|| LeaseId::from_string(format!("sl-{:016x}{:016x}", split(&mut w.rng), split(&mut w.rng))))
    });
    if let Some(id) = own {
        return own_id(node, world, name, (k, n), (wait, dur, steps), id).await;
    }
    if !op(world) {
        return;
    }
    let wait = Some(Duration::from_millis(wait)).filter(|w| !w.is_zero());
    let opts = AcquireOptions { wait, slots: Some(n), ..Default::default() };
    let lease = match acquire(node, world, k, name, Some(Duration::from_millis(dur)), opts).await {
        Ok(l) => l,
        Err(e) => {
            release_unknown(node, world, k, &e).await;
            return;
        }
    };
    hold_slot(node, world, name, k, lease, steps).await;
}

/// A slot taken with the caller's own lease_id: the same request again after an answer that
/// did not say (idempotent with the same lease_id), then held; the id is kept (as a process
/// would persist it) until a release is definite, and released again at the end when no
/// answer was (an attempt may still be in the network).
async fn own_id(
    node: &Node,
    world: &Shared,
    name: &str,
    (k, n): (&str, u32),
    (wait, dur, steps): (u64, u64, u64),
    id: LeaseId,
) {
    let entry = (k.to_string(), id.expose().to_string());
    lock(world).fail_closed.entry(name.to_string()).or_default().insert(entry.clone());
    let mut definite = false;
    for _ in 0..4 {
        if !op(world) {
            break;
        }
        let wait = Some(Duration::from_millis(wait)).filter(|w| !w.is_zero());
        let opts = AcquireOptions { wait, slots: Some(n), lease_id: Some(id.clone()), ..Default::default() };
        match acquire(node, world, k, name, Some(Duration::from_millis(dur)), opts).await {
            Ok(l) => {
                hold_slot(node, world, name, k, l, steps).await;
                definite = true;
                break;
            }
            Err(Error::LeaseHeld { .. } | Error::NotHolder { .. }) => break,
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    if !release_until_done(&node.coord, k, &id).await {
        lock(world).orphans.push((k.to_string(), id));
    } else if !definite {
        lock(world).released_orphans.push((k.to_string(), id));
    }
    if let Some(s) = lock(world).fail_closed.get_mut(name) {
        s.remove(&entry);
    }
}

/// Holds a slot: heartbeats, now and then a pause past its safe time, then the release.
async fn hold_slot(node: &Node, world: &Shared, name: &str, k: &str, mut lease: leasehold::Lease, steps: u64) {
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

/// Turns on a hot semaphore: a slot of `sem2` taken with a long wait, held briefly, released,
/// and at once asked for again (a few times), as a worker looping on a limited resource does.
/// Several clients of one coordinator doing this keep its line busy; a waiting take of another
/// coordinator must still get slots (the checker's `slot_waiter_starved`).
pub(crate) async fn hot(node: &Node, world: &Shared, name: &str) {
    let turns = draw(world, |w| w.between(1, 12));
    let (k, n) = SEMAPHORES[0];
    for _ in 0..turns {
        if !op(world) {
            return;
        }
        let opts = AcquireOptions { wait: Some(Duration::from_secs(8)), slots: Some(n), ..Default::default() };
        let lease = match acquire(node, world, k, name, Some(Duration::from_secs(3)), opts).await {
            Ok(l) => l,
            Err(e) => {
                release_unknown(node, world, k, &e).await;
                return;
            }
        };
        let work = draw(world, |w| w.between(20, 300));
        tokio::time::sleep(Duration::from_millis(work)).await;
        ended(world, name, k, &lease.lease_id);
        op(world);
        let _ = node.coord.release(k, &lease.lease_id).await;
    }
}
