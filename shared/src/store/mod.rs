//! The narrow storage interface: conditional update, conditional delete, get, and paged scans.
//!
//! The protocol (see `protocol.rs`) decides *what* to write and *under which condition*; a
//! store only evaluates a [`Condition`] against the current item and applies a [`Mutation`]
//! atomically, in one request. Both are plain data, nested by kind of lease (`kinds/`), so that
//! each backend translates them once: DynamoDB into a `ConditionExpression`/`UpdateExpression`,
//! the embedded store into the reference evaluation ([`reference`](mod@reference): [`Condition::holds`],
//! [`Mutation::apply`]) inside one SQLite write transaction. The shared protocol test suite
//! runs against both.
//!
//! The store layer imports the model, errors, the clock and backoff's jitter, never the
//! protocol, a feature or an adapter:
//! - this file: the [`Store`] trait and its answers; `keys.rs`: the key layout every store
//!   shares (keep-alive shards, waiter keys, queue shards);
//! - `condition.rs`, `mutation.rs`: the writes as data, one variant per kind of lease;
//! - `kinds/`: each kind's conditions and mutations, their reference semantics and their
//!   DynamoDB rendering, side by side;
//! - [`reference`](mod@reference): the reference evaluation of a write (read, check, apply, write), which the
//!   embedded store and the test store share;
//! - [`dynamo`]: the DynamoDB store (its expressions put together apart from its requests), and
//!   [`table`]: the lease table's definition (attribute and index names included);
//! - [`sqlite`]: the embedded store, and [`sqlite_history`]: its history table;
//! - [`events`]: the lease history's events, derived from an item before and after a write (the
//!   embedded store records them in the write's transaction; `history` re-exports them).
//!
//! A new store implements [`Store`]: it evaluates each [`Condition`] and applies each
//! [`Mutation`] atomically, as `holds` and `apply` define them (a store that evaluates writes
//! itself runs [`reference::update`] and [`reference::delete`] over its own table), and the
//! protocol suite (`both_backends!`) runs against it.

use async_trait::async_trait;

use crate::clock::ClockSamples;
use crate::error::Result;
use crate::model::Record;

mod condition;
pub mod dynamo;
pub mod events;
mod keys;
mod kinds;
mod mutation;
pub mod reference;
pub mod sqlite;
pub mod sqlite_history;
pub mod table;

pub use condition::Condition;
pub use dynamo::DynamoStore;
pub use keys::{
    keepalive_shard, queue_shard, split_waiter_key, waiter_key, KEEPALIVE_SHARDS, NO_LEASE, QUEUE_SHARDS,
    QUEUE_SHARD_BASE, SEPARATOR,
};
/// Each kind of lease's conditions and mutations (`LeaseCondition`, `QueueMutation`, ...).
pub use kinds::*;
pub use mutation::Mutation;
pub use sqlite::SqliteStore;

/// The result of a conditional write.
#[derive(Debug, Clone, PartialEq)]
pub enum Write {
    /// The condition held; the item as written.
    Applied(Record),
    /// The condition failed; the item as it was (`None`: no item), read in the same request.
    Rejected(Option<Record>),
}

/// Which items a scan returns.
#[derive(Debug, Clone, PartialEq)]
pub enum ScanKind {
    /// Every item (operator listing).
    All,
    /// Every item, read as cheaply as the store can (DynamoDB: an eventually consistent Scan,
    /// half the read units): the operator views of `leasehold serve`, which refresh a snapshot
    /// of the table at most every few seconds and tolerate an answer a moment old.
    Snapshot,
    /// Items of one keep-alive shard whose keep-alive deadline is after `after_ms`
    /// (DynamoDB: a Query on the sparse `keepalive` index).
    Keepalive { shard: u32, after_ms: u64 },
    /// Items in work state `state` whose index partition is `shard`, in the order they became
    /// free (expiry ascending), those free at `free_at_ms` only when given. Fail-closed held
    /// items (no expiry) are not listed. (DynamoDB: a Query on the sparse `state` index; with
    /// `free_at_ms`, a batch's candidates, it reads only the attributes a candidate is judged
    /// and taken by: key, fence, holder, lease_id, times, state, attempts. Other fields of
    /// those records are absent.)
    State { state: String, shard: String, free_at_ms: Option<u64> },
    /// Lease items of one queue shard ([`QUEUE_SHARD_BASE`] + n) that have queued waiters
    /// or an undelivered grant (DynamoDB: a Query on the sparse `queue` index, keys only: the
    /// records carry the key alone, and the reader gets each item it serves). One entry per key,
    /// however many waiters it has.
    Queue { shard: u32 },
}

/// One page of a scan; pass `next` back as `start` to continue.
#[derive(Debug, Clone, PartialEq)]
pub struct Page {
    pub items: Vec<Record>,
    pub next: Option<String>,
}

#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// A short name for logs and metrics ("dynamodb", "sqlite").
    fn name(&self) -> &'static str;

    /// Read one item (strongly consistent).
    async fn get(&self, key: &str) -> Result<Option<Record>>;

    /// Apply `mutation` if `condition` holds, in one atomic request.
    async fn update(&self, key: &str, condition: &Condition, mutation: &Mutation) -> Result<Write>;

    /// A semaphore's [`SlotCount`], read alone (`None`: no item): what a waiter of a full
    /// semaphore polls (DESIGN.md, "Semaphores": Waiting). DynamoDB reads three attributes of the
    /// item, not the map. By default, from [`Store::get`].
    async fn slot_count(&self, key: &str) -> Result<Option<SlotCount>> {
        Ok(self.get(key).await?.map(|r| SlotCount {
            taken: r.semaphore.slots_taken.unwrap_or(0),
            slots: r.semaphore.slots,
            fence: r.fence,
        }))
    }

    /// Delete the item if `condition` holds (a served waiter's item leaves the queue this way).
    async fn delete(&self, key: &str, condition: &Condition) -> Result<Write>;

    /// One page of at most `limit` items after `start`.
    async fn scan(&self, kind: &ScanKind, start: Option<&str>, limit: u32) -> Result<Page>;

    /// Evidence of the store's own clock (the `Date` of DynamoDB's answers, the machine's clock
    /// as the embedded store answers): coordinators check their clock against it before judging
    /// or writing expiries, never write a clock reading ahead of it, and count their holders'
    /// safe time by it (DESIGN.md, "Clocks"). `None`: no evidence; coordinators use their own
    /// clock as it is, with the skew margin alone.
    fn clock(&self) -> Option<&ClockSamples> {
        None
    }

    /// How many items a scan of `kind` would return (every page).
    async fn count(&self, kind: &ScanKind) -> Result<u64> {
        count_pages(self, kind).await
    }
}

/// [`Store::count`] by reading every page of the scan.
pub async fn count_pages<S: Store + ?Sized>(store: &S, kind: &ScanKind) -> Result<u64> {
    let (mut n, mut start) = (0u64, None::<String>);
    loop {
        let page = store.scan(kind, start.as_deref(), 1000).await?;
        n += page.items.len() as u64;
        match page.next {
            Some(s) => start = Some(s),
            None => return Ok(n),
        }
    }
}
