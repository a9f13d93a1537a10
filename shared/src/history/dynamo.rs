//! The lease history on AWS: a DynamoDB table (partition `key`, sort `sk`, TTL on `ttl`) the
//! history function fills from the lease table's stream (NEW_AND_OLD_IMAGES), and `leasehold
//! history --table` reads. The events are [`super::events`] of each stream record's images.

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_dynamodb::error::ProvideErrorMetadata;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType, PutRequest, ScalarAttributeType,
    TimeToLiveSpecification, WriteRequest,
};
use aws_sdk_dynamodb::Client;

use super::{events, Event};
use crate::error::{Error, Result};
use crate::store::dynamo::record_from_item;

/// Attribute names of the history table.
pub mod attr {
    pub const KEY: &str = "key";
    /// Sort key: `{at_ms:015}#{fence:020}#{kind}`, unique per event of a key and in time order.
    pub const SK: &str = "sk";
    pub const AT: &str = "at_ms";
    /// The event as JSON.
    pub const EVENT: &str = "event";
    pub const TTL: &str = "ttl";
}

fn sdk<E: ProvideErrorMetadata + std::error::Error + 'static>(what: &str, e: &E) -> Error {
    match e.code() {
        Some(code) => Error::StoreUnavailable(format!("history {what}: {code}: {}", e.message().unwrap_or(""))),
        None => Error::StoreUnavailable(format!(
            "history {what}: {}",
            aws_smithy_types::error::display::DisplayErrorContext(e)
        )),
    }
}

/// The sort key of an event.
pub fn sort_key(e: &Event) -> String {
    format!("{:015}#{:020}#{}", e.at_ms, e.fence, e.kind.as_str())
}

/// The events of one stream record: its old and new images (DynamoDB items).
pub fn events_of_images(
    old: Option<&HashMap<String, AttributeValue>>,
    new: Option<&HashMap<String, AttributeValue>>,
) -> Result<Vec<Event>> {
    let old = old.filter(|m| !m.is_empty()).map(record_from_item).transpose()?;
    let new = new.filter(|m| !m.is_empty()).map(record_from_item).transpose()?;
    Ok(events(old.as_ref(), new.as_ref()))
}

/// Items one BatchWriteItem takes at most (DynamoDB's limit).
pub const BATCH: usize = 25;

/// Tries of one batch (its unprocessed items, or the whole request when it is throttled)
/// before the write fails (and Lambda retries the stream batch).
const TRIES: u32 = 8;

/// The history item of an event.
fn item(e: &Event, retention: Duration) -> HashMap<String, AttributeValue> {
    let ttl = e.at_ms / 1000 + retention.as_secs();
    HashMap::from([
        (attr::KEY.to_string(), AttributeValue::S(e.key.clone())),
        (attr::SK.to_string(), AttributeValue::S(sort_key(e))),
        (attr::AT.to_string(), AttributeValue::N(e.at_ms.to_string())),
        (attr::EVENT.to_string(), AttributeValue::S(serde_json::to_string(e).expect("event serialises"))),
        (attr::TTL.to_string(), AttributeValue::N(ttl.to_string())),
    ])
}

/// Writes `events` into `table`, each kept `retention` after it happened (TTL), 25 to a
/// BatchWriteItem; items DynamoDB leaves unprocessed (and a throttled request) are sent again
/// after a jittered pause, up to 8 tries. Idempotent: a stream record delivered twice writes the
/// same items (two events with the same key and sort key in one call are written once: a batch
/// may not name one item twice).
pub async fn write(client: &Client, table: &str, events: &[Event], retention: Duration) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    let unique: Vec<&Event> = events.iter().filter(|e| seen.insert((e.key.clone(), sort_key(e)))).collect();
    for chunk in unique.chunks(BATCH) {
        let requests = chunk
            .iter()
            .map(|e| {
                let put = PutRequest::builder()
                    .set_item(Some(item(e, retention)))
                    .build()
                    .map_err(|e| Error::StoreUnavailable(format!("history write: {e}")))?;
                Ok(WriteRequest::builder().put_request(put).build())
            })
            .collect::<Result<Vec<_>>>()?;
        write_batch(client, table, requests).await?;
    }
    Ok(())
}

/// One BatchWriteItem of at most [`BATCH`] puts, until every item is processed.
async fn write_batch(client: &Client, table: &str, mut pending: Vec<WriteRequest>) -> Result<()> {
    let mut backoff = crate::backoff::Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    for _ in 0..TRIES {
        let sent = client.batch_write_item().request_items(table, pending.clone()).send().await;
        match sent {
            Ok(out) => {
                pending = out.unprocessed_items().and_then(|u| u.get(table)).cloned().unwrap_or_default();
                if pending.is_empty() {
                    return Ok(());
                }
            }
            Err(e)
                if matches!(
                    e.code(),
                    Some("ProvisionedThroughputExceededException" | "ThrottlingException" | "RequestLimitExceeded")
                ) => {}
            Err(e) => return Err(sdk("write", &e)),
        }
        tokio::time::sleep(backoff.next_pause()).await;
    }
    Err(Error::StoreUnavailable(format!(
        "history write: {} items still unprocessed after {TRIES} tries",
        pending.len()
    )))
}

/// The events of `key` at or after `since_ms`, oldest first, at most the newest `limit`.
pub async fn read(client: &Client, table: &str, key: &str, since_ms: u64, limit: usize) -> Result<Vec<Event>> {
    let mut out: Vec<Event> = Vec::new();
    let mut start: Option<HashMap<String, AttributeValue>> = None;
    loop {
        let res = client
            .query()
            .table_name(table)
            .key_condition_expression("#k = :k AND #s >= :s")
            .expression_attribute_names("#k", attr::KEY)
            .expression_attribute_names("#s", attr::SK)
            .expression_attribute_values(":k", AttributeValue::S(key.to_string()))
            .expression_attribute_values(":s", AttributeValue::S(format!("{since_ms:015}")))
            .scan_index_forward(false)
            .limit(limit.min(1000) as i32)
            .set_exclusive_start_key(start.take())
            .send()
            .await
            .map_err(|e| sdk("read", &e))?;
        for item in res.items() {
            if let Some(AttributeValue::S(json)) = item.get(attr::EVENT) {
                out.push(
                    serde_json::from_str(json)
                        .map_err(|e| Error::StoreUnavailable(format!("history: corrupt event: {e}")))?,
                );
            }
        }
        match res.last_evaluated_key() {
            Some(k) if out.len() < limit => start = Some(k.clone()),
            _ => break,
        }
    }
    out.truncate(limit);
    out.reverse();
    Ok(out)
}

/// Creates the history table as template.yaml declares it (on-demand, `key` + `sk`, TTL on
/// `ttl`). For local use and tests; idempotent.
pub async fn create_table(client: &Client, table: &str) -> Result<()> {
    let s = |n: &str| {
        AttributeDefinition::builder().attribute_name(n).attribute_type(ScalarAttributeType::S).build().expect("def")
    };
    let ks = |n: &str, t: KeyType| KeySchemaElement::builder().attribute_name(n).key_type(t).build().expect("key");
    match client
        .create_table()
        .table_name(table)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(s(attr::KEY))
        .attribute_definitions(s(attr::SK))
        .key_schema(ks(attr::KEY, KeyType::Hash))
        .key_schema(ks(attr::SK, KeyType::Range))
        .send()
        .await
    {
        Ok(_) => {}
        Err(e) if e.code() == Some("ResourceInUseException") => {}
        Err(e) => return Err(sdk("create table", &e)),
    }
    let ttl = TimeToLiveSpecification::builder().attribute_name(attr::TTL).enabled(true).build().expect("ttl");
    match client.update_time_to_live().table_name(table).time_to_live_specification(ttl).send().await {
        Ok(_) => Ok(()),
        Err(e) if e.code() == Some("ValidationException") => Ok(()),
        Err(e) => Err(sdk("enable TTL", &e)),
    }
}
