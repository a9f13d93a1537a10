//! The store's vocabulary by kind of lease: one file per kind, each holding that kind's
//! conditions and mutations as data, their reference semantics (`holds`, `apply`: what the
//! embedded store and the test store evaluate) and their DynamoDB rendering (`guard`, `render`:
//! what the production store sends), side by side. [`Condition`](super::Condition) and
//! [`Mutation`](super::Mutation) have one variant per kind, and delegate to it.
//!
//! - `lease.rs`: the plain lease (acquire, heartbeat, release, force-release) and what an
//!   acquire writes (`NewLease`, with a work state's `Visit`); the other kinds build on it;
//! - `queue.rs`: waiters (the waiter queue, and in-process hand-overs);
//! - `work.rs`: work states (put, taken in a state, released into the next);
//! - `semaphore.rs`: semaphores (N holders on one item);
//! - `keepalive.rs`: the keep-alive sweep.
//!
//! A new kind of lease is a new file here, with its two enums, their semantics and rendering;
//! one variant of each in `condition.rs` and `mutation.rs`, one arm in `dynamo/render.rs`; its
//! fields as a group of `model::Record`, their attribute names in `table.rs` and their decoding
//! in `dynamo/item.rs` (DESIGN.md, "Code map").

use crate::model::Record;
use crate::store::dynamo::item::{num, str_, Item};
use crate::store::table::attr;

mod keepalive;
mod lease;
mod queue;
mod semaphore;
mod work;

pub use keepalive::{KeepaliveCondition, KeepaliveMutation};
pub use lease::{LeaseCondition, LeaseMutation, NewLease, Visit};
pub use queue::{QueueCondition, QueueMutation};
pub use semaphore::{SemaphoreCondition, SemaphoreMutation, SlotCount, CLEAN_CHUNK, EVICT_CHUNK};
pub use work::{WorkCondition, WorkMutation};

/// The attributes every item written whole from a [`Record`] opens with (a waiter's, a new
/// semaphore's): key, fence, holder, lease_id, acquired-at, minimum hold and TTL, in an item
/// with room for `capacity` attributes.
fn lease_item_head(r: &Record, capacity: usize) -> Item {
    let mut item = Item::with_capacity(capacity);
    item.insert(attr::KEY.to_string(), str_(&r.key));
    item.insert(attr::FENCE.to_string(), num(r.fence));
    item.insert(attr::HOLDER.to_string(), str_(&r.holder));
    item.insert(attr::LEASE_ID.to_string(), str_(r.lease_id.expose()));
    item.insert(attr::ACQUIRED_AT.to_string(), num(r.acquired_at_ms));
    item.insert(attr::MIN_HOLD_UNTIL.to_string(), num(r.min_hold_until_ms));
    if let Some(t) = r.ttl {
        item.insert(attr::TTL.to_string(), num(t));
    }
    item
}
