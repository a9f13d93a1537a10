//! Records as DynamoDB items (DESIGN.md, "Item schema"): the decoding of every item a request
//! returns, and the attribute values every kind of lease encodes its writes with (each kind
//! builds its own whole items, `store/kinds/`). Pure attribute maps, no request.

use std::collections::HashMap;

use aws_sdk_dynamodb::types::AttributeValue;

use crate::error::{Error, Result};
use crate::model::{Keepalive, LeaseId, QueueFields, Record, SemaphoreFields, SlotHolder, WorkFields};
use crate::store::table::attr;

/// A DynamoDB item as the SDK returns it.
pub(in crate::store) type Item = HashMap<String, AttributeValue>;

pub(in crate::store) fn num(v: u64) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

pub(in crate::store) fn str_(v: &str) -> AttributeValue {
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
        renewed_at_ms: get_n(item, attr::RENEWED_AT)?,
        poll_ms: get_n(item, attr::POLL)?,
        queue: QueueFields {
            handed_in: get_s(item, attr::HANDED_IN)?,
            awaited_by: get_s(item, attr::AWAITED_BY)?,
            queue_head: get_n(item, attr::QUEUE_HEAD)?,
            queue_tail: get_n(item, attr::QUEUE_TAIL)?,
            queue_tail_at_ms: get_n(item, attr::QUEUE_TAIL_AT)?,
            freed_at_ms: get_n(item, attr::FREED_AT)?,
            pending_token: get_s(item, attr::PENDING_TOKEN)?,
            queue_tail_lease_id: get_s(item, attr::QUEUE_TAIL_LEASE_ID)?.map(LeaseId::from_string),
            released_lease_id: get_s(item, attr::RELEASED_LEASE_ID)?.map(LeaseId::from_string),
            released_fence: get_n(item, attr::RELEASED_FENCE)?,
            waiter,
        },
        work: WorkFields {
            state: get_s(item, attr::STATE_SHARD)?
                .map(|s| s.rsplit_once('#').map_or(s.as_str(), |(st, _)| st).to_string()),
            state_since_ms: get_n(item, attr::STATE_SINCE)?,
            attempts: get_n(item, attr::ATTEMPTS)?.map(|a| a.min(u32::MAX as u64) as u32),
        },
        semaphore: SemaphoreFields {
            slots: get_n(item, attr::SEM_SLOTS)?.map(|a| a.min(u32::MAX as u64) as u32),
            slots_taken: get_n(item, attr::SEM_TAKEN)?.map(|a| a.min(u32::MAX as u64) as u32),
            slots_rev: get_n(item, attr::SEM_REV)?,
            slot_holders: slot_holders(item)?,
            cleaned_at_ms: get_n(item, attr::SEM_CLEANED_AT)?,
        },
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
            keepalive: match get_n(h, attr::KA_UNTIL)? {
                None => None,
                Some(until_ms) => Some(Keepalive { until_ms, execution_arn: get_s(h, attr::KA_EXECUTION_ARN)? }),
            },
        });
    }
    holders.sort_by_key(|h| h.fence);
    Ok(holders)
}
