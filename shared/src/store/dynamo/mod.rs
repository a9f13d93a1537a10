//! The production store: one DynamoDB table, one request per conditional write.
//!
//! Conditions and mutations are translated into `ConditionExpression` / `UpdateExpression`
//! (the exact texts are in DESIGN.md). Every write asks for
//! `ReturnValuesOnConditionCheckFailure = ALL_OLD`, so a rejected write reports the current
//! item without a second request, and `ReturnValues = ALL_NEW`, so a successful one reports
//! the fence it issued.
//!
//! This module holds the requests; what they carry is built apart, without the SDK client:
//! - `render`: a write's expressions (or whole item), put together from its kind of lease's
//!   rendering (`store/kinds/`, each condition beside its reason, checked against DESIGN.md
//!   word for word), with the protocol's steps numbered;
//! - `expr`: the expression builder the kinds render with;
//! - `item`: items decoded into records, and the attribute values of the item schema;
//! - `scan`: the Scan and the index Queries behind [`Store::scan`] and [`Store::count`];
//! - `date`: the HTTP client wrapper that samples the `Date` of DynamoDB's answers for the clock
//!   check;
//! - `https`: the HTTPS client, its trust store loaded on first use.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_dynamodb::config::StalledStreamProtectionConfig;
use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::types::{ReturnValue, ReturnValuesOnConditionCheckFailure};
use aws_sdk_dynamodb::Client;

use super::table::{self, TableSpec, LEASE_TABLE};
use super::{Condition, Mutation, Page, ScanKind, SlotCount, Store, Write};
use crate::clock::ClockSamples;
use crate::error::{Error, Result};
use crate::model::Record;

mod date;
pub(in crate::store) mod expr;
mod https;
pub(in crate::store) mod item;
mod render;
mod scan;

/// The lease table's attribute and index names, defined with the table (`store::table`).
pub use super::table::{attr, KEEPALIVE_INDEX, QUEUE_INDEX, STATE_INDEX, STATE_INDEX_ATTRIBUTES};
pub(crate) use item::record_from_item;
pub use render::expressions;

use expr::{Expr, Request};
use item::{key_map, Item};

#[derive(Clone, Debug)]
pub struct DynamoStore {
    client: Client,
    table: String,
    clock: Arc<ClockSamples>,
}

/// The lease table as [`DynamoStore::create_table`] makes it on DynamoDB Local for tests and
/// benchmarks: [`LEASE_TABLE`] without the stream (nothing reads it there), deletion protection
/// and point-in-time recovery (throwaway tables).
const LOCAL_TABLE: TableSpec =
    TableSpec { stream: "", deletion_protection: false, point_in_time_recovery: false, ..LEASE_TABLE };

/// [`LOCAL_TABLE`] without its indexes (DynamoDB Local's TTL sweeper skips tables that have a
/// global secondary index).
const LOCAL_TABLE_WITHOUT_INDEXES: TableSpec = TableSpec { indexes: &[], ..LOCAL_TABLE };

/// The SDK's stalled-stream protection's grace period: a request bounded by a shorter timeout
/// needs no such protection.
const STALL_GRACE: Duration = Duration::from_secs(5);

/// How long [`DynamoStore::create_table`] waits for the table to become active.
const CREATE_WAIT: Duration = Duration::from_secs(60);

/// Builds an SDK config from the standard AWS environment (credentials chain, region,
/// `AWS_ENDPOINT_URL_DYNAMODB` / `AWS_ENDPOINT_URL`), with rustls on ring, SDK retries off
/// (the protocol retries itself, with the same lease_id, within the caller's deadline) and
/// bounded timeouts so a stalled store cannot outlive a lease. The platform's trust store is
/// read when the first connection is made, once for every client built from this config.
pub async fn load_sdk_config(attempt_timeout: Duration) -> aws_config::SdkConfig {
    aws_config::defaults(aws_config::BehaviorVersion::latest())
        .http_client(https::DeferredTrust::shared())
        .retry_config(aws_config::retry::RetryConfig::disabled())
        .timeout_config(
            aws_config::timeout::TimeoutConfig::builder()
                .connect_timeout(Duration::from_secs(2))
                .operation_attempt_timeout(attempt_timeout)
                .operation_timeout(attempt_timeout)
                .build(),
        )
        .load()
        .await
}

impl DynamoStore {
    /// A store on `table` through `client`, whose HTTP client it wraps in the `Date` sampler
    /// of the clock check (a client without an HTTP client of its own gets leasehold's: rustls
    /// on ring, the platform's trust store read on first use).
    pub fn new(client: Client, table: impl Into<String>) -> Self {
        let clock = Arc::new(ClockSamples::default());
        let http = client.config().http_client().unwrap_or_else(https::DeferredTrust::shared);
        let mut conf = client.config().to_builder().http_client(date::DateSampling::new(http, clock.clone()));
        // Stalled-stream protection off when a timeout bounds every request (as
        // `load_sdk_config`'s does), its answer's body included, inside the protection's 5 s
        // grace period: the protection then guards nothing, and costs a body wrapper and an
        // interceptor on every request.
        let bounded = client.config().timeout_config().is_some_and(|t| {
            [t.operation_attempt_timeout(), t.operation_timeout()].into_iter().flatten().any(|d| d <= STALL_GRACE)
        });
        if bounded {
            conf = conf.stalled_stream_protection(StalledStreamProtectionConfig::disabled());
        }
        DynamoStore { client: Client::from_conf(conf.build()), table: table.into(), clock }
    }

    /// A store on `table` configured from the standard AWS environment.
    pub async fn from_env(table: impl Into<String>, attempt_timeout: Duration) -> Self {
        let conf = load_sdk_config(attempt_timeout).await;
        DynamoStore::new(Client::new(&conf), table)
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn table(&self) -> &str {
        &self.table
    }

    /// Creates the lease table (on-demand, key schema, keep-alive, work-state and queue
    /// indexes) and enables TTL: [`table::create`] without the stream.
    /// For local use and tests: production tables come from template.yaml (or `leasehold table
    /// create`). Idempotent.
    pub async fn create_table(&self) -> Result<()> {
        self.create_table_with(true).await
    }

    /// [`DynamoStore::create_table`], optionally without the indexes (DynamoDB Local's TTL
    /// sweeper skips tables that have a global secondary index).
    pub async fn create_table_with(&self, indexes: bool) -> Result<()> {
        let spec = if indexes { &LOCAL_TABLE } else { &LOCAL_TABLE_WITHOUT_INDEXES };
        table::create_as(&self.client, &self.table, spec, CREATE_WAIT).await.map(|_| ())
    }
}

/// DynamoDB's answers that refuse a request for good: the request itself is invalid (an item
/// past 400 KB, an expression past its limits: `ValidationException`), the table is missing, or
/// the caller may not use it. Nothing was written, and the same request would be refused again:
/// `StoreRefused`, never retried, never "may have landed".
const REFUSALS: &[&str] = &[
    "ValidationException",
    "ResourceNotFoundException",
    "ItemCollectionSizeLimitExceededException",
    "AccessDeniedException",
    "UnrecognizedClientException",
    "MissingAuthenticationTokenException",
    "SerializationException",
];

/// Classifies SDK failures into the protocol's error names.
fn map_err<E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static, R: std::fmt::Debug>(
    e: SdkError<E, R>,
) -> Error {
    match &e {
        SdkError::ServiceError(se) => {
            let code = se.err().code().unwrap_or("Unknown");
            let msg = se.err().message().unwrap_or("");
            match code {
                "ProvisionedThroughputExceededException"
                | "ThrottlingException"
                | "RequestLimitExceeded"
                | "LimitExceededException" => Error::Throttled(format!("{code}: {msg}")),
                c if REFUSALS.contains(&c) => Error::StoreRefused(format!("{code}: {msg}")),
                _ => Error::StoreUnavailable(format!("{code}: {msg}")),
            }
        }
        SdkError::TimeoutError(_) => Error::StoreUnavailable("request to DynamoDB timed out".into()),
        SdkError::DispatchFailure(d) if d.as_connector_error().is_some_and(|c| never_connected(c)) => Error::not_sent(
            format!("could not connect to DynamoDB: {}", aws_smithy_types::error::display::DisplayErrorContext(&e)),
        ),
        SdkError::ConstructionFailure(_) => {
            Error::not_sent(format!("DynamoDB: {}", aws_smithy_types::error::display::DisplayErrorContext(&e)))
        }
        SdkError::DispatchFailure(d) => Error::StoreUnavailable(format!(
            "could not reach DynamoDB: {}",
            aws_smithy_types::error::display::DisplayErrorContext(
                d.as_connector_error().map(|c| c as &dyn std::error::Error).unwrap_or(&e)
            )
        )),
        SdkError::ResponseError(_) => Error::StoreUnavailable("malformed or cut response from DynamoDB".into()),
        _ => {
            Error::StoreUnavailable(format!("DynamoDB: {}", aws_smithy_types::error::display::DisplayErrorContext(&e)))
        }
    }
}

/// Did the request fail before a connection was made (refused, unreachable, no such host)?
/// Then it cannot have landed.
fn never_connected(e: &(dyn std::error::Error + 'static)) -> bool {
    use std::io::ErrorKind::{AddrNotAvailable, ConnectionRefused, HostUnreachable, NetworkUnreachable};
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if matches!(io.kind(), ConnectionRefused | AddrNotAvailable | HostUnreachable | NetworkUnreachable) {
                return true;
            }
        }
        if err.to_string().contains("dns error") {
            return true;
        }
        cur = err.source();
    }
    false
}

/// A failed write: a failed condition is an answer (the item as it was, from
/// `ReturnValuesOnConditionCheckFailure = ALL_OLD`; `ccf_item` picks it out of the operation's
/// error), anything else an error.
fn rejected_or_err<E, R>(e: SdkError<E, R>, ccf_item: fn(&E) -> Option<Option<&Item>>) -> Result<Write>
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug,
{
    match e.as_service_error().and_then(ccf_item) {
        Some(item) => Ok(Write::Rejected(item.map(record_from_item).transpose()?)),
        None => Err(map_err(e)),
    }
}

impl DynamoStore {
    /// A strongly consistent `GetItem` of `key`'s item, to be sent (with a projection, or not).
    fn read_item(&self, key: &str) -> aws_sdk_dynamodb::operation::get_item::builders::GetItemFluentBuilder {
        self.client.get_item().table_name(&self.table).set_key(Some(key_map(key))).consistent_read(true)
    }

    /// An acquire: one conditional PutItem of the whole lease. Nothing of the previous lease
    /// survives by mistake, and DynamoDB Local spends less time on it than on the equivalent
    /// SET/REMOVE update expression (DESIGN.md has the figures).
    async fn put_item(&self, mut x: Expr, cond: String, item: Item, written: Record) -> Result<Write> {
        let res = self
            .client
            .put_item()
            .table_name(&self.table)
            .set_item(Some(item))
            .condition_expression(cond)
            .set_expression_attribute_names(x.names())
            .set_expression_attribute_values(x.values())
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match res {
            // The item is exactly what was sent.
            Ok(_) => Ok(Write::Applied(written)),
            Err(e) => rejected_or_err(e, |e| match e {
                aws_sdk_dynamodb::operation::put_item::PutItemError::ConditionalCheckFailedException(c) => {
                    Some(c.item())
                }
                _ => None,
            }),
        }
    }

    /// Any other write: one conditional UpdateItem (its expressions rendered into `x`),
    /// answering the item as written.
    async fn update_item(&self, key: &str, mut x: Expr, cond: String) -> Result<Write> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .set_key(Some(key_map(key)))
            .update_expression(x.update_expression())
            .condition_expression(cond)
            .set_expression_attribute_names(x.names())
            .set_expression_attribute_values(x.values())
            .return_values(ReturnValue::AllNew)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match res {
            Ok(out) => {
                let item = out
                    .attributes()
                    .ok_or_else(|| Error::StoreUnavailable("UpdateItem returned no attributes".into()))?;
                Ok(Write::Applied(record_from_item(item)?))
            }
            Err(e) => rejected_or_err(e, |e| match e {
                aws_sdk_dynamodb::operation::update_item::UpdateItemError::ConditionalCheckFailedException(c) => {
                    Some(c.item())
                }
                _ => None,
            }),
        }
    }
}

#[async_trait]
impl Store for DynamoStore {
    async fn delete(&self, key: &str, condition: &Condition) -> Result<Write> {
        let mut x = Expr::default();
        let cond = render::condition(&mut x, condition);
        let res = self
            .client
            .delete_item()
            .table_name(&self.table)
            .set_key(Some(key_map(key)))
            .condition_expression(cond)
            .set_expression_attribute_names(x.names())
            .set_expression_attribute_values(x.values())
            .return_values(ReturnValue::AllOld)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match res {
            Ok(out) => match out.attributes() {
                Some(item) => Ok(Write::Applied(record_from_item(item)?)),
                // No item was there: nothing deleted (as the embedded store answers).
                None => Ok(Write::Rejected(None)),
            },
            Err(e) => rejected_or_err(e, |e| match e {
                aws_sdk_dynamodb::operation::delete_item::DeleteItemError::ConditionalCheckFailedException(c) => {
                    Some(c.item())
                }
                _ => None,
            }),
        }
    }

    fn name(&self) -> &'static str {
        "dynamodb"
    }

    fn clock(&self) -> Option<&ClockSamples> {
        Some(&self.clock)
    }

    async fn get(&self, key: &str) -> Result<Option<Record>> {
        let out = self.read_item(key).send().await.map_err(map_err)?;
        out.item().map(record_from_item).transpose()
    }

    async fn slot_count(&self, key: &str) -> Result<Option<SlotCount>> {
        let out = self
            .read_item(key)
            .projection_expression("#taken, #slots, #fence")
            .expression_attribute_names("#taken", attr::SEM_TAKEN)
            .expression_attribute_names("#slots", attr::SEM_SLOTS)
            .expression_attribute_names("#fence", attr::FENCE)
            .send()
            .await
            .map_err(map_err)?;
        let Some(item) = out.item() else { return Ok(None) };
        let n = |name| item::get_n(item, name).map(|n| n.map(|n| n.min(u32::MAX as u64) as u32));
        let fence = item::get_n(item, attr::FENCE)?.unwrap_or(0);
        Ok(Some(SlotCount { taken: n(attr::SEM_TAKEN)?.unwrap_or(0), slots: n(attr::SEM_SLOTS)?, fence }))
    }

    async fn update(&self, key: &str, condition: &Condition, mutation: &Mutation) -> Result<Write> {
        let mut x = Expr::default();
        let cond = render::condition(&mut x, condition);
        // One call site of each request: every `.await` of an SDK request holds its future
        // (about 6 KB) inline in this one's frame.
        let (item, written) = match render::mutation(&mut x, key, mutation)? {
            Request::Put(item, written) => (item, written),
            Request::Update => return self.update_item(key, x, cond).await,
        };
        self.put_item(x, cond, item, written).await
    }

    async fn scan(&self, kind: &ScanKind, start: Option<&str>, limit: u32) -> Result<Page> {
        self.scan_page(kind, start, limit).await
    }

    async fn count(&self, kind: &ScanKind) -> Result<u64> {
        self.count_items(kind).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(timeout: Option<Duration>) -> Client {
        let mut conf = aws_sdk_dynamodb::Config::builder().behavior_version(aws_config::BehaviorVersion::latest());
        if let Some(t) = timeout {
            conf =
                conf.timeout_config(aws_config::timeout::TimeoutConfig::builder().operation_attempt_timeout(t).build());
        }
        Client::from_conf(conf.build())
    }

    fn stall_protected(s: &DynamoStore) -> bool {
        s.client().config().stalled_stream_protection().is_none_or(|c| c.is_enabled())
    }

    /// The store's client always has an HTTP client (the `Date` sampler wraps it), and goes
    /// without stalled-stream protection only when a timeout inside its grace period bounds
    /// every request.
    #[test]
    fn the_store_client_samples_dates_and_drops_stall_protection_only_when_bounded() {
        let bounded = DynamoStore::new(client(Some(Duration::from_secs(3))), "t");
        assert!(bounded.client().config().http_client().is_some());
        assert!(!stall_protected(&bounded));
        let unbounded = DynamoStore::new(client(None), "t");
        assert!(unbounded.client().config().http_client().is_some());
        assert!(stall_protected(&unbounded));
        let long = DynamoStore::new(client(Some(Duration::from_secs(30))), "t");
        assert!(stall_protected(&long));
    }
}
