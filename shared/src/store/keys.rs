//! The key layout every store shares: the keep-alive shards, the waiter keys of a key's queue,
//! the queue shards, and the lease_id of an item never leased. A leaf of the store layer: the
//! kinds of lease, the stores and the features all read it, and it reads nothing of theirs.

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
