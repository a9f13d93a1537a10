//! The narrow storage interface: conditional update, conditional delete, get, and paged scans.
//!
//! The protocol (see `protocol.rs`) decides *what* to write and *under which condition*; a
//! store only evaluates a [`Condition`] against the current item and applies a [`Mutation`]
//! atomically, in one request. Both are plain data so that each backend translates them once:
//! DynamoDB into a `ConditionExpression`/`UpdateExpression`, the embedded store into the
//! reference evaluation ([`Condition::holds`], [`Mutation::apply`]) inside one SQLite write
//! transaction. The shared protocol test suite runs against both.
//!
//! The store layer imports the model, errors, the clock and backoff's jitter, never the
//! protocol, a feature or an adapter:
//! - this file: the [`Store`] trait, its answers, and the key layout every store shares
//!   (keep-alive shards, waiter keys, queue shards);
//! - `condition.rs`, `mutation.rs`: the writes as data, with their reference semantics;
//! - [`dynamo`]: the DynamoDB store (its expressions rendered apart from its requests), and
//!   [`table`]: the lease table's definition;
//! - [`sqlite`]: the embedded store, and [`sqlite_history`]: its history table;
//! - [`events`]: the lease history's events, derived from an item before and after a write (the
//!   embedded store records them in the write's transaction; `history` re-exports them).
//!
//! A new store implements [`Store`]: it evaluates each [`Condition`] and applies each
//! [`Mutation`] atomically, as `holds` and `apply` define them, and the protocol suite
//! (`both_backends!`) runs against it.

use async_trait::async_trait;

use crate::clock::ClockSamples;
use crate::error::Result;
use crate::model::Record;

mod condition;
pub mod dynamo;
pub mod events;
mod mutation;
pub mod sqlite;
pub mod sqlite_history;
pub mod table;

pub use condition::Condition;
pub use dynamo::DynamoStore;
pub use mutation::{Mutation, NewLease, Visit};
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

    /// Delete the item if `condition` holds (a served waiter's item leaves the queue this way).
    async fn delete(&self, key: &str, condition: &Condition) -> Result<Write>;

    /// One page of at most `limit` items after `start`.
    async fn scan(&self, kind: &ScanKind, start: Option<&str>, limit: u32) -> Result<Page>;

    /// Evidence of the store's own clock (the `Date` of its answers), when the store is remote:
    /// coordinators check their clock against it before judging or writing expiries. `None`:
    /// the store shares the coordinators' clock (the embedded store, one machine).
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

/// The lease_id of an item put into a state and never leased: no lease_id a caller can send
/// (those are 22..=128 characters) or the coordinator generates.
pub const NO_LEASE: &str = "-";

/// Number of keep-alive shards (partitions of the sparse keep-alive index).
pub const KEEPALIVE_SHARDS: u32 = 8;

/// Keep-alive shard of a key: spreads the sparse index over several partitions.
pub fn keepalive_shard(key: &str, shards: u32) -> u32 {
    // FNV-1a: stable across processes and releases (unlike std's RandomState).
    let mut h: u32 = 0x811c9dc5;
    for b in key.as_bytes() {
        h ^= *b as u32;
        h = h.wrapping_mul(0x01000193);
    }
    h % shards.max(1)
}

/// Separates a lease key from its waiter suffix. Validated keys contain no control character,
/// so no waiter key is ever a lease key, nor a prefix of one.
pub const SEPARATOR: char = '\u{1f}';

/// First shard number of the queue index's partitions (`q_shard`: 1000..1008; numbered apart
/// from the keep-alive shards 0..8, which waiter items of earlier versions shared).
pub const QUEUE_SHARD_BASE: u32 = 1000;

/// Number of queue shards.
pub const QUEUE_SHARDS: u32 = 8;

/// The key of waiter `seq` of `key` (DESIGN.md, "The waiter queue").
pub fn waiter_key(key: &str, seq: u64) -> String {
    format!("{key}{SEPARATOR}q{seq}")
}

/// The lease key and sequence number of a waiter key.
pub fn split_waiter_key(k: &str) -> Option<(&str, u64)> {
    let (key, rest) = k.split_once(SEPARATOR)?;
    Some((key, rest.strip_prefix('q')?.parse().ok()?))
}

/// The queue index partition of a key (of the lease key, for a waiter key).
pub fn queue_shard(k: &str) -> u32 {
    let key = split_waiter_key(k).map_or(k, |(key, _)| key);
    QUEUE_SHARD_BASE + keepalive_shard(key, QUEUE_SHARDS)
}
