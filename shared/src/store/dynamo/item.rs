//! Records as DynamoDB items and back (DESIGN.md, "Item schema"): the whole items a PutItem
//! writes (an acquire's lease, a waiter), and the decoding of every item a request returns.
//! Pure attribute maps, no request.

use std::collections::HashMap;

use aws_sdk_dynamodb::types::AttributeValue;

use super::attr;
use crate::error::{Error, Result};
use crate::model::{Keepalive, LeaseId, Record, SlotHolder};
use crate::store::{keepalive_shard, NewLease, KEEPALIVE_SHARDS};

/// A DynamoDB item as the SDK returns it.
pub(super) type Item = HashMap<String, AttributeValue>;

pub(super) fn num(v: u64) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

pub(super) fn str_(v: &str) -> AttributeValue {
    AttributeValue::S(v.to_string())
}

/// The primary key of `key`'s item.
pub(super) fn key_map(key: &str) -> Item {
    HashMap::from([(attr::KEY.to_string(), str_(key))])
}

pub(super) fn get_n(item: &Item, name: &str) -> Result<Option<u64>> {
    match item.get(name) {
        None | Some(AttributeValue::Null(_)) => Ok(None),
        Some(AttributeValue::N(n)) => n
            .parse::<u64>()
            .map(Some)
            .map_err(|_| Error::StoreUnavailable(format!("lease item: attribute {name} is not a u64: {n}"))),
        Some(other) => Err(Error::StoreUnavailable(format!("lease item: attribute {name} has type {other:?}"))),
    }
}

pub(super) fn get_s(item: &Item, name: &str) -> Result<Option<String>> {
    match item.get(name) {
        None | Some(AttributeValue::Null(_)) => Ok(None),
        Some(AttributeValue::S(s)) => Ok(Some(s.clone())),
        Some(_) => Err(Error::StoreUnavailable(format!("lease item: attribute {name} is not a string"))),
    }
}

pub(super) fn need<T>(v: Option<T>, name: &str) -> Result<T> {
    v.ok_or_else(|| Error::StoreUnavailable(format!("lease item: attribute {name} is missing")))
}

/// A JSON attribute (`metadata`, `waiter`) of an item, decoded.
fn get_json<T: serde::de::DeserializeOwned>(item: &Item, name: &str, what: &str) -> Result<Option<T>> {
    get_s(item, name)?
        .map(|s| serde_json::from_str(&s).map_err(|e| Error::StoreUnavailable(format!("{what}: {e}"))))
        .transpose()
}

/// Decodes a lease item (or a waiter item). Crate-visible for the history's stream images.
pub(crate) fn record_from_item(item: &Item) -> Result<Record> {
    let metadata = get_json(item, attr::METADATA, "lease item: metadata is not a JSON object")?;
    let waiter = get_json(item, attr::WAITER, "waiter item: waiter is not valid")?;
    // A waiter item's index attributes place it in the queue shards, not a keep-alive.
    let keepalive = match get_n(item, attr::KA_UNTIL)? {
        _ if waiter.is_some() => None,
        None => None,
        Some(until_ms) => Some(Keepalive { until_ms, execution_arn: get_s(item, attr::KA_EXECUTION_ARN)? }),
    };
    Ok(Record {
        key: need(get_s(item, attr::KEY)?, attr::KEY)?,
        fence: need(get_n(item, attr::FENCE)?, attr::FENCE)?,
        holder: need(get_s(item, attr::HOLDER)?, attr::HOLDER)?,
        lease_id: LeaseId::from_string(need(get_s(item, attr::LEASE_ID)?, attr::LEASE_ID)?),
        acquired_at_ms: need(get_n(item, attr::ACQUIRED_AT)?, attr::ACQUIRED_AT)?,
        expires_at_ms: get_n(item, attr::EXPIRES_AT)?,
        duration_ms: get_n(item, attr::DURATION)?,
        min_hold_until_ms: get_n(item, attr::MIN_HOLD_UNTIL)?.unwrap_or(0),
        released_at_ms: get_n(item, attr::RELEASED_AT)?,
        metadata,
        keepalive,
        ttl: get_n(item, attr::TTL)?,
        poll_ms: get_n(item, attr::POLL)?,
        handed_in: get_s(item, attr::HANDED_IN)?,
        awaited_by: get_s(item, attr::AWAITED_BY)?,
        renewed_at_ms: get_n(item, attr::RENEWED_AT)?,
        queue_head: get_n(item, attr::QUEUE_HEAD)?,
        queue_tail: get_n(item, attr::QUEUE_TAIL)?,
        queue_tail_at_ms: get_n(item, attr::QUEUE_TAIL_AT)?,
        freed_at_ms: get_n(item, attr::FREED_AT)?,
        pending_token: get_s(item, attr::PENDING_TOKEN)?,
        queue_tail_lease_id: get_s(item, attr::QUEUE_TAIL_LEASE_ID)?.map(LeaseId::from_string),
        released_lease_id: get_s(item, attr::RELEASED_LEASE_ID)?.map(LeaseId::from_string),
        released_fence: get_n(item, attr::RELEASED_FENCE)?,
        waiter,
        state: get_s(item, attr::STATE_SHARD)?.map(|s| s.rsplit_once('#').map_or(s.as_str(), |(st, _)| st).to_string()),
        state_since_ms: get_n(item, attr::STATE_SINCE)?,
        attempts: get_n(item, attr::ATTEMPTS)?.map(|a| a.min(u32::MAX as u64) as u32),
        slots: get_n(item, attr::SEM_SLOTS)?.map(|a| a.min(u32::MAX as u64) as u32),
        slots_taken: get_n(item, attr::SEM_TAKEN)?.map(|a| a.min(u32::MAX as u64) as u32),
        slots_rev: get_n(item, attr::SEM_REV)?,
        slot_holders: slot_holders(item)?,
    })
}

/// A semaphore's holders (DESIGN.md, "Semaphores"): the map keyed by lease_id.
fn slot_holders(item: &Item) -> Result<Vec<SlotHolder>> {
    let Some(AttributeValue::M(m)) = item.get(attr::SEM_HOLDERS) else { return Ok(Vec::new()) };
    let mut holders = Vec::with_capacity(m.len());
    for (id, v) in m {
        let AttributeValue::M(h) = v else {
            return Err(Error::StoreUnavailable("semaphore item: a holder is not a map".into()));
        };
        holders.push(SlotHolder {
            lease_id: LeaseId::from_string(id.clone()),
            fence: need(get_n(h, attr::FENCE)?, attr::FENCE)?,
            holder: need(get_s(h, attr::HOLDER)?, attr::HOLDER)?,
            acquired_at_ms: need(get_n(h, attr::ACQUIRED_AT)?, attr::ACQUIRED_AT)?,
            renewed_at_ms: need(get_n(h, attr::RENEWED_AT)?, attr::RENEWED_AT)?,
            expires_at_ms: need(get_n(h, attr::EXPIRES_AT)?, attr::EXPIRES_AT)?,
            duration_ms: need(get_n(h, attr::DURATION)?, attr::DURATION)?,
            released_at_ms: get_n(h, attr::RELEASED_AT)?,
            metadata: get_json(h, attr::METADATA, "semaphore item: metadata is not a JSON object")?,
        });
    }
    holders.sort_by_key(|h| h.fence);
    Ok(holders)
}

/// One holder's entry in a semaphore's map.
pub(super) fn slot_holder_value(h: &SlotHolder) -> AttributeValue {
    let mut m = HashMap::with_capacity(8);
    m.insert(attr::FENCE.to_string(), num(h.fence));
    m.insert(attr::HOLDER.to_string(), str_(&h.holder));
    m.insert(attr::ACQUIRED_AT.to_string(), num(h.acquired_at_ms));
    m.insert(attr::RENEWED_AT.to_string(), num(h.renewed_at_ms));
    m.insert(attr::EXPIRES_AT.to_string(), num(h.expires_at_ms));
    m.insert(attr::DURATION.to_string(), num(h.duration_ms));
    if let Some(r) = h.released_at_ms {
        m.insert(attr::RELEASED_AT.to_string(), num(r));
    }
    if let Some(md) = &h.metadata {
        m.insert(attr::METADATA.to_string(), AttributeValue::S(serde_json::Value::Object(md.clone()).to_string()));
    }
    AttributeValue::M(m)
}

/// The whole item of a new semaphore (DESIGN.md, "Semaphores").
pub(super) fn semaphore_item(r: &Record) -> Item {
    let holders = r.slot_holders.iter().map(|h| (h.lease_id.expose().to_string(), slot_holder_value(h))).collect();
    let mut item: Item = HashMap::with_capacity(10);
    let mut put = |a: &str, v: AttributeValue| {
        item.insert(a.to_string(), v);
    };
    put(attr::KEY, str_(&r.key));
    put(attr::FENCE, num(r.fence));
    put(attr::HOLDER, str_(&r.holder));
    put(attr::LEASE_ID, str_(r.lease_id.expose()));
    put(attr::ACQUIRED_AT, num(r.acquired_at_ms));
    put(attr::MIN_HOLD_UNTIL, num(r.min_hold_until_ms));
    if let Some(t) = r.ttl {
        put(attr::TTL, num(t));
    }
    put(attr::SEM_SLOTS, num(r.slots.unwrap_or(1) as u64));
    put(attr::SEM_TAKEN, num(r.slots_taken.unwrap_or(0) as u64));
    put(attr::SEM_REV, num(r.slots_rev.unwrap_or(0)));
    put(attr::SEM_HOLDERS, AttributeValue::M(holders));
    item
}

/// The item an acquire writes: the whole lease, nothing of the previous one.
pub(super) fn lease_item(key: &str, n: &NewLease) -> Item {
    let mut item = HashMap::with_capacity(12);
    let mut put = |a: &str, v: AttributeValue| {
        item.insert(a.to_string(), v);
    };
    put(attr::KEY, str_(key));
    put(attr::FENCE, num(n.fence));
    put(attr::HOLDER, str_(&n.holder));
    put(attr::LEASE_ID, str_(n.lease_id.expose()));
    put(attr::ACQUIRED_AT, num(n.now_ms));
    put(attr::MIN_HOLD_UNTIL, num(n.now_ms.saturating_add(n.min_hold_ms)));
    put(attr::RENEWED_AT, num(n.now_ms));
    if let Some(d) = n.duration_ms {
        put(attr::EXPIRES_AT, num(n.now_ms.saturating_add(d)));
        put(attr::DURATION, num(d));
    }
    if let Some(m) = &n.metadata {
        put(attr::METADATA, AttributeValue::S(serde_json::Value::Object(m.clone()).to_string()));
    }
    if let Some(k) = &n.keepalive {
        put(attr::KA_SHARD, num(keepalive_shard(key, KEEPALIVE_SHARDS) as u64));
        put(attr::KA_UNTIL, num(k.until_ms));
        if let Some(arn) = &k.execution_arn {
            put(attr::KA_EXECUTION_ARN, str_(arn));
        }
    }
    if let Some(t) = n.ttl {
        put(attr::TTL, num(t));
    }
    if let Some(p) = n.poll_ms {
        put(attr::POLL, num(p));
    }
    if let Some(c) = &n.handed_in {
        put(attr::HANDED_IN, str_(c));
    }
    if let Some(v) = &n.visit {
        put(attr::STATE_SHARD, str_(&v.shard));
        put(attr::STATE_SINCE, num(v.since_ms));
        put(attr::ATTEMPTS, num(v.attempts as u64));
    }
    if let Some((id, fence)) = &n.released {
        put(attr::RELEASED_LEASE_ID, str_(id.expose()));
        put(attr::RELEASED_FENCE, num(*fence));
    }
    item
}

/// A waiter item (DESIGN.md, "The waiter queue"): the waiter as one JSON attribute. It is in no
/// index: the sweep finds keys with waiters through the lease items (`q_shard`).
pub(super) fn waiter_item(r: &Record) -> Result<Item> {
    let w = r.waiter.as_ref().ok_or_else(|| Error::invalid("a waiter item needs a waiter"))?;
    let mut item = HashMap::with_capacity(10);
    let mut put = |a: &str, v: AttributeValue| {
        item.insert(a.to_string(), v);
    };
    put(attr::KEY, str_(&r.key));
    put(attr::FENCE, num(r.fence));
    put(attr::HOLDER, str_(&r.holder));
    put(attr::LEASE_ID, str_(r.lease_id.expose()));
    put(attr::ACQUIRED_AT, num(r.acquired_at_ms));
    put(attr::EXPIRES_AT, num(r.expires_at_ms.unwrap_or(0)));
    put(attr::MIN_HOLD_UNTIL, num(r.min_hold_until_ms));
    if let Some(t) = r.ttl {
        put(attr::TTL, num(t));
    }
    // When this try wrote it (`WaiterNewer`).
    if let Some(t) = r.renewed_at_ms {
        put(attr::RENEWED_AT, num(t));
    }
    put(attr::WAITER, AttributeValue::S(serde_json::to_string(w).expect("waiter serialises")));
    Ok(item)
}
