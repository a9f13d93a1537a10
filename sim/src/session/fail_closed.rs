//! Fail-closed leases with the client's own lease_id: sent again after a lost answer, and
//! released (or kept for the end) when no answer was definite.

use std::time::Duration;

use leasehold::{AcquireOptions, Error, LeaseId};

use super::{acquire, hold, release_until_done};
use crate::world::{draw, key, lock, op, split, Node, Shared, KEYS};

/// A fail-closed lease with the client's own lease_id: a lost answer is retried with it.
pub(crate) async fn fail_closed(node: &Node, world: &Shared, name: &str) {
    let (k, id) = draw(world, |w| {
        let id = format!("fc-{:016x}{:016x}", split(&mut w.rng), split(&mut w.rng));
        (key(w.below(KEYS as u64)), LeaseId::from_string(id))
    });
    // The id is kept (as a process would persist it) until a release is definite.
    let entry = (k.clone(), id.expose().to_string());
    lock(world).fail_closed.entry(name.to_string()).or_default().insert(entry.clone());
    let definite = fail_closed_session(node, world, name, &k, &id).await;
    // Released, or never definite: release what may have landed (and keep the id if even
    // that fails). Without a definite answer to any try, an attempt may still be in the
    // network and land after this release found nothing (DESIGN.md, "acquire": the limit that
    // remains): the id is kept, and released again at the end.
    if !release_until_done(&node.coord, &k, &id).await {
        lock(world).orphans.push((k, id));
    } else if !definite {
        lock(world).released_orphans.push((k, id));
    }
    if let Some(s) = lock(world).fail_closed.get_mut(name) {
        s.remove(&entry);
    }
}

/// Whether the session ended definitely: granted, or refused (`LeaseHeld`, `NotHolder`) with no
/// earlier call of it left unanswered.
pub(crate) async fn fail_closed_session(node: &Node, world: &Shared, name: &str, k: &str, id: &LeaseId) -> bool {
    let k = k.to_string();
    // An earlier call's attempt may still be in the network after a later call's definite
    // refusal: the refusal does not make the session definite.
    let mut unsure = false;
    for _ in 0..5 {
        if !op(world) {
            break;
        }
        let opts = AcquireOptions { lease_id: Some(id.clone()), ..Default::default() };
        match acquire(node, world, &k, name, None, opts).await {
            Ok(l) => {
                hold(node, world, name, l, None).await;
                return true;
            }
            Err(Error::LeaseHeld { .. } | Error::NotHolder { .. }) => return !unsure,
            // Unknown or failed: the same request again (idempotent with the same lease_id).
            Err(_) => {
                unsure = true;
                tokio::time::sleep(Duration::from_millis(100)).await
            }
        }
    }
    false
}
