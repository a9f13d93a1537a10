//! The simulated store's log and faults, as the run reads them back.

use std::collections::BTreeMap;

use leasehold::testing::{FaultCounts, SimStore};

/// Whether the write before the acquire of `lease_id` that took `key` freed it without a
/// release: a queue write (the undelivered mark removed, the last waiter passed over or
/// revoked) on an item that was released or expired but not yet free to plain acquires.
pub(crate) fn freed_by_queue_write(log: &[leasehold::testing::Applied], key: &str, lease_id: &str) -> bool {
    let on_key: Vec<_> = log.iter().filter(|a| a.key == key).collect();
    let Some(i) = on_key.iter().rposition(
        |a| matches!(&a.mutation, Some(leasehold::store::Mutation::Lease(leasehold::store::LeaseMutation::Acquire(n))) if n.lease_id.expose() == lease_id),
    ) else {
        return false;
    };
    let blocked = |r: &leasehold::Record| r.queue.pending_token.is_some() || r.queue_len() > 0;
    // Back from the acquire to the last write that ended or granted a lease: a queue write
    // since then unblocked the key.
    for a in on_key[..i].iter().rev() {
        use leasehold::store::{LeaseMutation as L, Mutation as M, QueueMutation as Q};
        if matches!(
            a.mutation,
            None | Some(
                M::Lease(L::Release { .. } | L::ForceRelease { .. } | L::Acquire(_)) | M::Queue(Q::Grant { .. })
            )
        ) {
            return false;
        }
        if a.old.as_ref().is_some_and(blocked) && a.new.as_ref().is_some_and(|r| !blocked(r)) {
            return true;
        }
    }
    false
}

/// The store's log so far (kept in the store).
pub(crate) fn store_log(store: &SimStore) -> Vec<leasehold::testing::Applied> {
    let log = store.take_log();
    store.put_back_log(log.clone());
    log
}

pub(crate) fn fault_map(c: &FaultCounts) -> BTreeMap<&'static str, u64> {
    BTreeMap::from([
        ("lost_answer", c.lost_answer),
        ("delayed_duplicate", c.delayed_duplicate),
        ("refused", c.refused),
        ("throttle", c.throttle),
        ("stall", c.stall),
        ("timeout", c.timeout),
        ("ttl_delete", c.ttl_delete),
    ])
}
