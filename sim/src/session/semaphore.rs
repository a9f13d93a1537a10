//! Semaphore slots: taken (waited for or not), renewed, paused past, released; the checker counts
//! the holders of each semaphore (`over_slots`).

use std::time::Duration;

use leasehold::{AcquireOptions, Error};

use super::{acquire, release_unknown};
use crate::world::{draw, ended, lock, now, op, told, Node, Shared};

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
