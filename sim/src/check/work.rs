//! Work items: kept in their states, and released into the final state once.

use leasehold::store::LeaseMutation;
use leasehold::store::QueueMutation;
use leasehold::store::WorkMutation;
use std::collections::BTreeMap;

use leasehold::store::Mutation;
use leasehold::testing::Applied;

use crate::violation::Violation;
use crate::world::Event;

/// No item in a work state is deleted by TTL (a key in a state is kept until it is taken).
pub(super) fn ttl_on_work_items(log: &[Applied], out: &mut Vec<Violation>) {
    for a in log.iter().filter(|a| a.ttl) {
        if let Some(old) = a.old.as_ref().filter(|r| r.work.state.is_some()) {
            let mut v = Violation::new(
                "work_item_deleted_by_ttl",
                &a.key,
                format!(
                    "TTL deleted a key in work state {:?} (a renewal left its TTL)",
                    old.work.state.as_deref().unwrap_or("")
                ),
            );
            v.at = Some(a.at);
            out.push(v);
        }
    }
}

/// Each release into the final state that was answered as done landed exactly once.
pub(super) fn finished(events: &[Event], log: &[Applied], out: &mut Vec<Violation>) {
    let mut landed: BTreeMap<(&str, &str), u32> = BTreeMap::new();
    for a in log {
        if let (Some(Mutation::Work(WorkMutation::ReleaseTo { .. })), Some(old)) = (&a.mutation, &a.old) {
            *landed.entry((a.key.as_str(), old.lease_id.expose())).or_default() += 1;
        }
    }
    for e in events {
        let Event::Finished { key, lease, .. } = e else { continue };
        let n = landed.get(&(key.as_str(), lease.as_str())).copied().unwrap_or(0);
        if n != 1 {
            out.push(Violation::new(
                "work_item_not_once",
                key,
                format!("a release into the final state answered as done landed {n} times"),
            ));
        }
    }
}

/// An item in its final state is never taken again: a take from a work state lands only on an
/// item still in the visit it read (`FreeIn`), so no grant moves an item out of its final state
/// (a take from the first state on a finished item would write the first state back into it).
/// An acquire of the key by name keeps the state it is in, the final one included.
pub(super) fn final_items_kept(log: &[Applied], final_state: &str, out: &mut Vec<Violation>) {
    for a in log {
        let (
            Some(Mutation::Lease(LeaseMutation::Acquire(_)) | Mutation::Queue(QueueMutation::Grant { .. })),
            Some(old),
            Some(new),
        ) = (&a.mutation, &a.old, &a.new)
        else {
            continue;
        };
        if old.work.state.as_deref() == Some(final_state) && new.work.state != old.work.state {
            let mut v = Violation::new(
                "finished_item_taken",
                &a.key,
                format!(
                    "{}, in its final state, was taken again by lease {} of state {:?}",
                    a.key,
                    super::short(new.lease_id.expose()),
                    new.work.state.as_deref().unwrap_or("")
                ),
            );
            v.at = Some(a.at);
            out.push(v);
        }
    }
}

/// Each item enters its final state once per `put`: between two puts of an item (its setup
/// included), at most one release into the final state lands on it.
pub(super) fn finished_once_per_put(log: &[Applied], final_state: &str, out: &mut Vec<Violation>) {
    // Per item: entries into the final state since its last put.
    let mut entries: BTreeMap<&str, u32> = BTreeMap::new();
    for a in log {
        match (&a.mutation, &a.new) {
            (Some(Mutation::Work(WorkMutation::Enter { .. })), Some(_)) => {
                entries.insert(a.key.as_str(), 0);
            }
            (Some(Mutation::Work(WorkMutation::ReleaseTo { state, .. })), Some(_)) if state == final_state => {
                let n = entries.entry(a.key.as_str()).or_default();
                *n += 1;
                if *n > 1 {
                    let mut v = Violation::new(
                        "finished_twice_per_put",
                        &a.key,
                        format!("{} entered its final state {n} times since it was last put", a.key),
                    );
                    v.at = Some(a.at);
                    out.push(v);
                }
            }
            _ => {}
        }
    }
}
