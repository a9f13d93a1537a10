//! Work items: kept in their states, and released into the final state once.

use std::collections::BTreeMap;

use leasehold::store::Mutation;
use leasehold::testing::Applied;

use super::Violation;
use crate::world::Event;

/// No item in a work state is deleted by TTL (a key in a state is kept until it is taken).
pub(super) fn ttl_on_work_items(log: &[Applied], out: &mut Vec<Violation>) {
    for a in log.iter().filter(|a| a.ttl) {
        if let Some(old) = a.old.as_ref().filter(|r| r.state.is_some()) {
            let mut v = Violation::new(
                "work_item_deleted_by_ttl",
                &a.key,
                format!(
                    "TTL deleted a key in work state {:?} (a renewal left its TTL)",
                    old.state.as_deref().unwrap_or("")
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
        if let (Some(Mutation::ReleaseTo { .. }), Some(old)) = (&a.mutation, &a.old) {
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
