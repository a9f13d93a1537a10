//! The history function (functions/history): each DynamoDB Streams record of the lease table
//! (NEW_AND_OLD_IMAGES) becomes the events [`crate::history::events`] derives from its old and new
//! images, written into the history table (`LEASEHOLD_HISTORY_TABLE`) with a TTL of
//! `LEASEHOLD_HISTORY_RETENTION_S` (default 7 days), the whole batch's events 25 to a
//! BatchWriteItem. A failed write fails the invocation, so Lambda retries the batch (bisected,
//! then sent to the on-failure queue: template.yaml); writes are idempotent (the same record
//! writes the same items).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use aws_lambda_events::dynamodb::Event;
use aws_sdk_dynamodb::types::AttributeValue;
use aws_sdk_dynamodb::Client;
use lambda_runtime::{service_fn, Diagnostic, LambdaEvent};
use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::history::dynamo::{events_of_images, write};

/// A DynamoDB-JSON attribute value (`{"S": "x"}`, `{"N": "1"}`, `{"M": {...}}`, ...), as a
/// stream record in a Lambda event carries it, as the SDK's type.
pub fn attribute_from_json(v: &Value) -> Option<AttributeValue> {
    let (tag, inner) = v.as_object()?.iter().next()?;
    let strings =
        |x: &Value| -> Option<Vec<String>> { x.as_array()?.iter().map(|s| s.as_str().map(str::to_string)).collect() };
    Some(match tag.as_str() {
        "S" => AttributeValue::S(inner.as_str()?.to_string()),
        "N" => AttributeValue::N(inner.as_str()?.to_string()),
        "BOOL" => AttributeValue::Bool(inner.as_bool()?),
        "NULL" => AttributeValue::Null(true),
        "M" => AttributeValue::M(item_from_json(inner)?),
        "L" => AttributeValue::L(inner.as_array()?.iter().map(attribute_from_json).collect::<Option<_>>()?),
        "SS" => AttributeValue::Ss(strings(inner)?),
        "NS" => AttributeValue::Ns(strings(inner)?),
        // Binary attributes: the lease table has none.
        _ => return None,
    })
}

/// A DynamoDB-JSON item as the SDK's map.
pub fn item_from_json(v: &Value) -> Option<HashMap<String, AttributeValue>> {
    v.as_object()?.iter().map(|(k, a)| Some((k.clone(), attribute_from_json(a)?))).collect()
}

/// Handles one batch of stream records: derives every record's events, then writes them all
/// (25 to a BatchWriteItem); returns how many events it wrote.
pub async fn handle(client: &Client, table: &str, retention: Duration, event: Event) -> Result<Value> {
    let mut all = Vec::new();
    for rec in &event.records {
        let image = |i: &aws_lambda_events::dynamodb::EventRecord, new: bool| -> Result<Option<HashMap<_, _>>> {
            let item = if new { &i.change.new_image } else { &i.change.old_image };
            if item.is_empty() {
                return Ok(None);
            }
            let v = serde_json::to_value(item).map_err(|e| Error::invalid(format!("stream record: {e}")))?;
            item_from_json(&v).map(Some).ok_or_else(|| Error::invalid("stream record: unreadable image"))
        };
        let (old, new) = (image(rec, false)?, image(rec, true)?);
        all.extend(events_of_images(old.as_ref(), new.as_ref())?);
    }
    write(client, table, &all, retention).await?;
    let written = all.len();
    tracing::info!(records = event.records.len(), events = written, "history written");
    Ok(json!({ "records": event.records.len(), "events": written }))
}

/// The whole `main` of the history function.
pub async fn run() -> std::result::Result<(), lambda_runtime::Error> {
    crate::env::init_tracing(true);
    let table = std::env::var("LEASEHOLD_HISTORY_TABLE")
        .ok()
        .filter(|t| !t.trim().is_empty())
        .ok_or("LEASEHOLD_HISTORY_TABLE is not set")?;
    let conf = crate::store::dynamo::load_sdk_config(Duration::from_secs(5)).await;
    let client = Arc::new(Client::new(&conf));
    let retention = crate::history::retention();
    tracing::info!(function = "history", "ready");
    lambda_runtime::run(service_fn(move |ev: LambdaEvent<Event>| {
        let (client, table) = (client.clone(), table.clone());
        async move { handle(&client, &table, retention, ev.payload).await.map_err(|e| Diagnostic::from(&e)) }
    }))
    .await
}
