//! The production store: one DynamoDB table, one request per conditional write.
//!
//! Conditions and mutations are translated into `ConditionExpression` / `UpdateExpression`
//! (the exact texts are in DESIGN.md). Every write asks for
//! `ReturnValuesOnConditionCheckFailure = ALL_OLD`, so a rejected write reports the current
//! item without a second request, and `ReturnValues = ALL_NEW`, so a successful one reports
//! the fence it issued.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, GlobalSecondaryIndex, KeySchemaElement, KeyType, Projection,
    ProjectionType, ReturnValue, ReturnValuesOnConditionCheckFailure, ScalarAttributeType, TimeToLiveSpecification,
};
use aws_sdk_dynamodb::Client;
use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::interceptors::context::{
    BeforeDeserializationInterceptorContextRef, BeforeTransmitInterceptorContextRef,
};
use aws_smithy_runtime_api::client::interceptors::Intercept;
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_types::config_bag::{ConfigBag, Storable, StoreReplace};
use aws_smithy_types::date_time::{DateTime, Format as DateFormat};

use super::{keepalive_shard, Condition, Mutation, NewLease, Page, ScanKind, Store, Write, KEEPALIVE_SHARDS};
use crate::clock::{Clock, ClockSamples, Sample, SystemClock};
use crate::error::{Error, Result};
use crate::model::{Keepalive, LeaseId, Record};

/// Attribute names of the lease table (see DESIGN.md, "Item schema").
pub mod attr {
    pub const KEY: &str = "key";
    pub(crate) const FENCE: &str = "fence";
    pub(crate) const HOLDER: &str = "holder";
    pub(crate) const LEASE_ID: &str = "lease_id";
    pub(crate) const ACQUIRED_AT: &str = "acquired_at_ms";
    pub const EXPIRES_AT: &str = "expires_at_ms";
    pub(crate) const DURATION: &str = "duration_ms";
    pub(crate) const MIN_HOLD_UNTIL: &str = "min_hold_until_ms";
    pub(crate) const RELEASED_AT: &str = "released_at_ms";
    pub(crate) const METADATA: &str = "metadata";
    pub const KA_SHARD: &str = "ka_shard";
    pub const KA_UNTIL: &str = "ka_until_ms";
    pub(crate) const KA_EXECUTION_ARN: &str = "ka_execution_arn";
    pub const TTL: &str = "ttl";
    pub(crate) const POLL: &str = "poll_ms";
    pub(crate) const HANDED_IN: &str = "handed_in";
    pub(crate) const RENEWED_AT: &str = "renewed_at_ms";
    pub(crate) const QUEUE_HEAD: &str = "queue_head";
    pub(crate) const QUEUE_TAIL: &str = "queue_tail";
    pub(crate) const QUEUE_TAIL_AT: &str = "queue_tail_at_ms";
    pub(crate) const PENDING_TOKEN: &str = "pending_token";
    pub(crate) const WAITER: &str = "waiter";
    pub(crate) const QUEUE_TAIL_LEASE_ID: &str = "queue_tail_lease_id";
    pub(crate) const RELEASED_LEASE_ID: &str = "released_lease_id";
    pub(crate) const RELEASED_FENCE: &str = "released_fence";
    /// Present only on lease items with queued waiters or an undelivered grant: the sparse
    /// `queue` index (one entry per such key).
    pub const Q_SHARD: &str = "q_shard";
    /// `STATE#n`: the work state and the index partition (present only on keys in a state).
    pub const STATE_SHARD: &str = "state_shard";
    pub(crate) const STATE_SINCE: &str = "state_since_ms";
    pub(crate) const ATTEMPTS: &str = "attempts";

    /// Every attribute above.
    pub const ALL: &[&str] = &[
        KEY,
        FENCE,
        HOLDER,
        LEASE_ID,
        ACQUIRED_AT,
        EXPIRES_AT,
        DURATION,
        MIN_HOLD_UNTIL,
        RELEASED_AT,
        METADATA,
        KA_SHARD,
        KA_UNTIL,
        KA_EXECUTION_ARN,
        TTL,
        POLL,
        HANDED_IN,
        QUEUE_HEAD,
        QUEUE_TAIL,
        QUEUE_TAIL_AT,
        PENDING_TOKEN,
        WAITER,
        QUEUE_TAIL_LEASE_ID,
        RELEASED_LEASE_ID,
        RELEASED_FENCE,
        Q_SHARD,
        STATE_SHARD,
        STATE_SINCE,
        ATTEMPTS,
    ];

    /// The attributes that are DynamoDB reserved words, so an expression must name them through
    /// an `ExpressionAttributeNames` alias. The others are written as they are: every alias is
    /// work for the server on every request (DESIGN.md has the figure), and a test checks this
    /// list against DynamoDB Local.
    pub const RESERVED: &[&str] = &[KEY, TTL];
}

/// Name of the sparse keep-alive index (partition `ka_shard`, sort `ka_until_ms`).
pub const KEEPALIVE_INDEX: &str = "keepalive";

/// Name of the sparse work-state index (partition `state_shard`, sort `expires_at_ms`).
pub const STATE_INDEX: &str = "state";

/// Name of the sparse queue index (partition `q_shard`, keys only): one entry per key with
/// queued waiters or an undelivered grant.
pub const QUEUE_INDEX: &str = "queue";

#[derive(Clone, Debug)]
pub struct DynamoStore {
    client: Client,
    table: String,
    clock: Arc<ClockSamples>,
}

/// Records the `Date` of every DynamoDB answer with the instants the request was sent and the
/// answer received (see `crate::clock`).
#[derive(Debug)]
struct DateSampler(Arc<ClockSamples>);

#[derive(Debug, Clone, Copy)]
struct SentAt(Instant);

impl Storable for SentAt {
    type Storer = StoreReplace<Self>;
}

impl Intercept for DateSampler {
    fn name(&self) -> &'static str {
        "leasehold-date-sampler"
    }

    fn read_before_transmit(
        &self,
        _: &BeforeTransmitInterceptorContextRef<'_>,
        _: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> std::result::Result<(), BoxError> {
        cfg.interceptor_state().store_put(SentAt(SystemClock.now()));
        Ok(())
    }

    fn read_after_transmit(
        &self,
        ctx: &BeforeDeserializationInterceptorContextRef<'_>,
        _: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> std::result::Result<(), BoxError> {
        let received = SystemClock.now();
        let date = ctx.response().headers().get("date").and_then(|d| DateTime::from_str(d, DateFormat::HttpDate).ok());
        if let (Some(SentAt(sent)), Some(date)) = (cfg.load::<SentAt>().copied(), date) {
            if date.secs() > 0 {
                self.0.record(Sample { sent, received, date_s: date.secs() as u64 });
            }
        }
        Ok(())
    }
}

/// Builds an SDK config from the standard AWS environment (credentials chain, region,
/// `AWS_ENDPOINT_URL_DYNAMODB` / `AWS_ENDPOINT_URL`), with rustls on ring, SDK retries off
/// (the protocol retries itself, with the same lease_id, within the caller's deadline) and
/// bounded timeouts so a stalled store cannot outlive a lease.
pub async fn load_sdk_config(attempt_timeout: Duration) -> aws_config::SdkConfig {
    use aws_smithy_http_client::tls;
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(tls::rustls_provider::CryptoMode::Ring))
        .build_https();
    aws_config::defaults(aws_config::BehaviorVersion::latest())
        .http_client(http)
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
    /// A store on `table` through `client` (to which it adds the `Date` sampler of the clock
    /// check).
    pub fn new(client: Client, table: impl Into<String>) -> Self {
        let clock = Arc::new(ClockSamples::default());
        let conf = client.config().to_builder().interceptor(DateSampler(clock.clone())).build();
        DynamoStore { client: Client::from_conf(conf), table: table.into(), clock }
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

    /// Creates the lease table (on-demand, key schema, keep-alive and work-state indexes) and
    /// enables TTL.
    /// For local use and tests: production tables come from template.yaml. Idempotent.
    pub async fn create_table(&self) -> Result<()> {
        self.create_table_with(true).await
    }

    /// [`DynamoStore::create_table`], optionally without the keep-alive and work-state indexes
    /// (DynamoDB Local's TTL sweeper skips tables that have a global secondary index).
    pub async fn create_table_with(&self, keepalive_index: bool) -> Result<()> {
        let s =
            |n: &str| AttributeDefinition::builder().attribute_name(n).attribute_type(ScalarAttributeType::S).build();
        let n =
            |n: &str| AttributeDefinition::builder().attribute_name(n).attribute_type(ScalarAttributeType::N).build();
        let ks = |n: &str, t: KeyType| KeySchemaElement::builder().attribute_name(n).key_type(t).build();
        let gsi = GlobalSecondaryIndex::builder()
            .index_name(KEEPALIVE_INDEX)
            .key_schema(built(ks(attr::KA_SHARD, KeyType::Hash))?)
            .key_schema(built(ks(attr::KA_UNTIL, KeyType::Range))?)
            .projection(Projection::builder().projection_type(ProjectionType::All).build())
            .build();
        let state_gsi = GlobalSecondaryIndex::builder()
            .index_name(STATE_INDEX)
            .key_schema(built(ks(attr::STATE_SHARD, KeyType::Hash))?)
            .key_schema(built(ks(attr::EXPIRES_AT, KeyType::Range))?)
            .projection(Projection::builder().projection_type(ProjectionType::All).build())
            .build();
        let queue_gsi = GlobalSecondaryIndex::builder()
            .index_name(QUEUE_INDEX)
            .key_schema(built(ks(attr::Q_SHARD, KeyType::Hash))?)
            .projection(Projection::builder().projection_type(ProjectionType::KeysOnly).build())
            .build();
        let mut req = self
            .client
            .create_table()
            .table_name(&self.table)
            .billing_mode(BillingMode::PayPerRequest)
            .attribute_definitions(built(s(attr::KEY))?)
            .key_schema(built(ks(attr::KEY, KeyType::Hash))?);
        if keepalive_index {
            req = req
                .attribute_definitions(built(n(attr::KA_SHARD))?)
                .attribute_definitions(built(n(attr::KA_UNTIL))?)
                .attribute_definitions(built(s(attr::STATE_SHARD))?)
                .attribute_definitions(built(n(attr::EXPIRES_AT))?)
                .attribute_definitions(built(n(attr::Q_SHARD))?)
                .global_secondary_indexes(built(gsi)?)
                .global_secondary_indexes(built(state_gsi)?)
                .global_secondary_indexes(built(queue_gsi)?);
        }
        let res = req.send().await;
        match res {
            Ok(_) => {}
            Err(e) if e.code() == Some("ResourceInUseException") => {}
            Err(e) => return Err(map_err(e)),
        }
        let ttl = TimeToLiveSpecification::builder().attribute_name(attr::TTL).enabled(true).build();
        let res = self
            .client
            .update_time_to_live()
            .table_name(&self.table)
            .time_to_live_specification(built(ttl)?)
            .send()
            .await;
        match res {
            Ok(_) => Ok(()),
            // Already enabled.
            Err(e) if e.code() == Some("ValidationException") => Ok(()),
            Err(e) => Err(map_err(e)),
        }
    }
}

fn built<T>(r: std::result::Result<T, aws_sdk_dynamodb::error::BuildError>) -> Result<T> {
    r.map_err(|e| Error::StoreUnavailable(format!("create table: {e}")))
}

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

fn num(v: u64) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

fn str_(v: &str) -> AttributeValue {
    AttributeValue::S(v.to_string())
}

fn get_n(item: &HashMap<String, AttributeValue>, name: &str) -> Result<Option<u64>> {
    match item.get(name) {
        None | Some(AttributeValue::Null(_)) => Ok(None),
        Some(AttributeValue::N(n)) => n
            .parse::<u64>()
            .map(Some)
            .map_err(|_| Error::StoreUnavailable(format!("lease item: attribute {name} is not a u64: {n}"))),
        Some(other) => Err(Error::StoreUnavailable(format!("lease item: attribute {name} has type {other:?}"))),
    }
}

fn get_s(item: &HashMap<String, AttributeValue>, name: &str) -> Result<Option<String>> {
    match item.get(name) {
        None | Some(AttributeValue::Null(_)) => Ok(None),
        Some(AttributeValue::S(s)) => Ok(Some(s.clone())),
        Some(_) => Err(Error::StoreUnavailable(format!("lease item: attribute {name} is not a string"))),
    }
}

fn need<T>(v: Option<T>, name: &str) -> Result<T> {
    v.ok_or_else(|| Error::StoreUnavailable(format!("lease item: attribute {name} is missing")))
}

/// Decodes a lease item. Public for tests and tools that inspect the table.
pub(crate) fn record_from_item(item: &HashMap<String, AttributeValue>) -> Result<Record> {
    let metadata = match get_s(item, attr::METADATA)? {
        None => None,
        Some(s) => Some(
            serde_json::from_str(&s)
                .map_err(|e| Error::StoreUnavailable(format!("lease item: metadata is not a JSON object: {e}")))?,
        ),
    };
    let waiter = match get_s(item, attr::WAITER)? {
        None => None,
        Some(s) => Some(
            serde_json::from_str(&s)
                .map_err(|e| Error::StoreUnavailable(format!("waiter item: waiter is not valid: {e}")))?,
        ),
    };
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
        renewed_at_ms: get_n(item, attr::RENEWED_AT)?,
        queue_head: get_n(item, attr::QUEUE_HEAD)?,
        queue_tail: get_n(item, attr::QUEUE_TAIL)?,
        queue_tail_at_ms: get_n(item, attr::QUEUE_TAIL_AT)?,
        pending_token: get_s(item, attr::PENDING_TOKEN)?,
        queue_tail_lease_id: get_s(item, attr::QUEUE_TAIL_LEASE_ID)?.map(LeaseId::from_string),
        released_lease_id: get_s(item, attr::RELEASED_LEASE_ID)?.map(LeaseId::from_string),
        released_fence: get_n(item, attr::RELEASED_FENCE)?,
        waiter,
        state: get_s(item, attr::STATE_SHARD)?.map(|s| s.rsplit_once('#').map_or(s.as_str(), |(st, _)| st).to_string()),
        state_since_ms: get_n(item, attr::STATE_SINCE)?,
        attempts: get_n(item, attr::ATTEMPTS)?.map(|a| a.min(u32::MAX as u64) as u32),
    })
}

/// An expression under construction: attribute names as they are, except the reserved words
/// (`attr::RESERVED`), which go through `#name` aliases; `:value` placeholders for every value.
#[derive(Default)]
struct Expr {
    set: Vec<String>,
    remove: Vec<String>,
    names: HashMap<String, String>,
    values: HashMap<String, AttributeValue>,
}

impl Expr {
    fn n(&mut self, attribute: &str) -> String {
        if !attr::RESERVED.contains(&attribute) {
            return attribute.to_string();
        }
        let p = format!("#{attribute}");
        self.names.insert(p.clone(), attribute.to_string());
        p
    }
    /// The alias map, or none when no reserved word was used (an empty map is invalid).
    fn names(&mut self) -> Option<HashMap<String, String>> {
        Some(std::mem::take(&mut self.names)).filter(|n| !n.is_empty())
    }
    /// The value map, or none when the expressions use no value (an empty map is invalid).
    fn values(&mut self) -> Option<HashMap<String, AttributeValue>> {
        Some(std::mem::take(&mut self.values)).filter(|v| !v.is_empty())
    }
    fn v(&mut self, name: &str, value: AttributeValue) -> String {
        let p = format!(":{name}");
        // One placeholder, one value: a condition and an update naming the same placeholder for
        // two values would silently check the wrong one.
        if let Some(old) = self.values.insert(p.clone(), value.clone()) {
            assert_eq!(old, value, "placeholder {p} bound to two values");
        }
        p
    }
    fn set(&mut self, attribute: &str, rhs: String) {
        let a = self.n(attribute);
        self.set.push(format!("{a} = {rhs}"));
    }
    fn set_value(&mut self, attribute: &str, value: AttributeValue) {
        let v = self.v(attribute, value);
        self.set(attribute, v);
    }
    fn set_or_remove(&mut self, attribute: &str, value: Option<AttributeValue>) {
        match value {
            Some(v) => self.set_value(attribute, v),
            None => self.remove(attribute),
        }
    }
    fn remove(&mut self, attribute: &str) {
        let a = self.n(attribute);
        self.remove.push(a);
    }
    fn remove_keepalive(&mut self) {
        for a in [attr::KA_SHARD, attr::KA_UNTIL, attr::KA_EXECUTION_ARN] {
            self.remove(a);
        }
    }
    fn update_expression(&self) -> String {
        let mut parts = Vec::new();
        if !self.set.is_empty() {
            parts.push(format!("SET {}", self.set.join(", ")));
        }
        if !self.remove.is_empty() {
            parts.push(format!("REMOVE {}", self.remove.join(", ")));
        }
        parts.join(" ")
    }

    fn condition(&mut self, c: &Condition) -> String {
        match c {
            // No item (every item has a fence), or one that has expired with a lower fence and
            // another lease_id.
            Condition::Free { now_ms, fence, lease_id } => {
                let (e, f, l) = (self.n(attr::EXPIRES_AT), self.n(attr::FENCE), self.n(attr::LEASE_ID));
                let now = self.v("now", num(*now_ms));
                let fv = self.v("fence", num(*fence));
                let lid = self.v("lease_id", str_(lease_id.expose()));
                let (qt, qh) = (self.n(attr::QUEUE_TAIL), self.n(attr::QUEUE_HEAD));
                let (ss, p) = (self.n(attr::STATE_SHARD), self.n(attr::PENDING_TOKEN));
                format!(
                    "attribute_not_exists({f}) OR ({e} <= {now} AND {f} < {fv} AND {l} <> {lid} \
                     AND (attribute_not_exists({qt}) OR {qt} <= {qh}) AND attribute_not_exists({ss}) \
                     AND attribute_not_exists({p}))"
                )
            }
            Condition::Renew { lease_id, now_ms, expires_at_ms } => {
                let (l, r, e) = (self.n(attr::LEASE_ID), self.n(attr::RELEASED_AT), self.n(attr::EXPIRES_AT));
                let w = self.n(attr::RENEWED_AT);
                let lid = self.v("lease_id", str_(lease_id.expose()));
                let now = self.v("now", num(*now_ms));
                let tail = match expires_at_ms {
                    Some(x) => {
                        let xv = self.v("expires_at", num(*x));
                        format!("(attribute_not_exists({e}) OR {e} <= {xv})")
                    }
                    None => format!("attribute_exists({})", self.n(attr::DURATION)),
                };
                format!(
                    "{l} = {lid} AND attribute_not_exists({r}) AND (attribute_not_exists({e}) OR {e} > {now}) \
                     AND (attribute_not_exists({w}) OR {w} < {now}) AND {tail}"
                )
            }
            Condition::Unreleased { lease_id } => {
                let (l, r) = (self.n(attr::LEASE_ID), self.n(attr::RELEASED_AT));
                let lid = self.v("lease_id", str_(lease_id.expose()));
                format!("{l} = {lid} AND attribute_not_exists({r})")
            }
            Condition::Exists => {
                let k = self.n(attr::KEY);
                format!("attribute_exists({k})")
            }
            Condition::FenceIs(f) => {
                let a = self.n(attr::FENCE);
                let v = self.v("expected_fence", num(*f));
                format!("{a} = {v}")
            }
            Condition::FenceAndExpiry { fence, expires_at_ms } => {
                let (a, e) = (self.n(attr::FENCE), self.n(attr::EXPIRES_AT));
                let v = self.v("expected_fence", num(*fence));
                match expires_at_ms {
                    Some(exp) => {
                        let ev = self.v("expected_expiry", num(*exp));
                        format!("{a} = {v} AND {e} = {ev}")
                    }
                    None => format!("{a} = {v} AND attribute_not_exists({e})"),
                }
            }
            Condition::Queueable { now_ms, lease_id } => {
                let (f, e) = (self.n(attr::FENCE), self.n(attr::EXPIRES_AT));
                let (qt, qh, ql) =
                    (self.n(attr::QUEUE_TAIL), self.n(attr::QUEUE_HEAD), self.n(attr::QUEUE_TAIL_LEASE_ID));
                let now = self.v("now", num(*now_ms));
                let lid = self.v("lease_id", str_(lease_id.expose()));
                format!(
                    "attribute_exists({f}) AND (attribute_not_exists({e}) OR {e} > {now} OR {qt} > {qh}) \
                     AND (attribute_not_exists({ql}) OR {ql} <> {lid} OR {qt} <= {qh})"
                )
            }
            Condition::QueueIdle => {
                let (qt, qh, p) = (self.n(attr::QUEUE_TAIL), self.n(attr::QUEUE_HEAD), self.n(attr::PENDING_TOKEN));
                format!("(attribute_not_exists({qt}) OR {qt} <= {qh}) AND attribute_not_exists({p})")
            }
            Condition::HandOver { fence, now_ms, head } => {
                let (f, e, qh) = (self.n(attr::FENCE), self.n(attr::EXPIRES_AT), self.n(attr::QUEUE_HEAD));
                let fv = self.v("expected_fence", num(*fence));
                let now = self.v("now", num(*now_ms));
                let hv = self.v("expected_head", num(*head));
                format!("{f} = {fv} AND {e} <= {now} AND {qh} = {hv}")
            }
            Condition::Undelivered { fence } => {
                let (f, p) = (self.n(attr::FENCE), self.n(attr::PENDING_TOKEN));
                let fv = self.v("expected_fence", num(*fence));
                format!("{f} = {fv} AND attribute_exists({p})")
            }
            Condition::HandTo { lease_id, fence, now_ms } => {
                let (f, l, r) = (self.n(attr::FENCE), self.n(attr::LEASE_ID), self.n(attr::RELEASED_AT));
                let (m, qt, qh) = (self.n(attr::MIN_HOLD_UNTIL), self.n(attr::QUEUE_TAIL), self.n(attr::QUEUE_HEAD));
                let ss = self.n(attr::STATE_SHARD);
                let fv = self.v("expected_fence", num(*fence));
                let lid = self.v("lease_id", str_(lease_id.expose()));
                let now = self.v("now", num(*now_ms));
                format!(
                    "{f} = {fv} AND {l} = {lid} AND attribute_not_exists({r}) AND {m} <= {now} \
                     AND (attribute_not_exists({qt}) OR {qt} <= {qh}) AND attribute_not_exists({ss})"
                )
            }
            Condition::NotLease => {
                let f = self.n(attr::FENCE);
                let z = self.v("zero", num(0));
                format!("attribute_not_exists({f}) OR {f} = {z}")
            }
            // Free, and still in the visit of the state the coordinator read (the write copies
            // it into the new item).
            Condition::FreeIn { now_ms, fence, lease_id, visit } => {
                let (e, f, l) = (self.n(attr::EXPIRES_AT), self.n(attr::FENCE), self.n(attr::LEASE_ID));
                let (ss, si, at) = (self.n(attr::STATE_SHARD), self.n(attr::STATE_SINCE), self.n(attr::ATTEMPTS));
                let now = self.v("now", num(*now_ms));
                let fv = self.v("fence", num(*fence));
                let lid = self.v("lease_id", str_(lease_id.expose()));
                let ssv = self.v("state_shard", str_(&visit.shard));
                let siv = self.v("state_since_ms", num(visit.since_ms));
                let atv = self.v("attempts", num(visit.attempts as u64));
                let (qt, qh, p) = (self.n(attr::QUEUE_TAIL), self.n(attr::QUEUE_HEAD), self.n(attr::PENDING_TOKEN));
                format!(
                    "{e} <= {now} AND {f} < {fv} AND {l} <> {lid} AND (attribute_not_exists({qt}) OR {qt} <= {qh}) \
                     AND {ss} = {ssv} AND {si} = {siv} AND {at} = {atv} AND attribute_not_exists({p})"
                )
            }
            Condition::Enterable { now_ms, shard, .. } => {
                let (f, e, ss) = (self.n(attr::FENCE), self.n(attr::EXPIRES_AT), self.n(attr::STATE_SHARD));
                let now = self.v("now", num(*now_ms));
                let ssv = self.v("state_shard", str_(shard));
                format!("attribute_not_exists({f}) OR ({e} <= {now} AND (attribute_not_exists({ss}) OR {ss} <> {ssv}))")
            }
            Condition::Live { lease_id, now_ms } => {
                let (l, r, e) = (self.n(attr::LEASE_ID), self.n(attr::RELEASED_AT), self.n(attr::EXPIRES_AT));
                let lid = self.v("lease_id", str_(lease_id.expose()));
                let now = self.v("now", num(*now_ms));
                format!("{l} = {lid} AND attribute_not_exists({r}) AND (attribute_not_exists({e}) OR {e} > {now})")
            }
            Condition::Unqueued { lease_id } => {
                let (l, r) = (self.n(attr::LEASE_ID), self.n(attr::RELEASED_AT));
                let (qt, qh) = (self.n(attr::QUEUE_TAIL), self.n(attr::QUEUE_HEAD));
                let lid = self.v("lease_id", str_(lease_id.expose()));
                format!("{l} = {lid} AND attribute_not_exists({r}) AND (attribute_not_exists({qt}) OR {qt} <= {qh})")
            }
            Condition::ReleaseHandOver { lease_id, fence, now_ms, head } => {
                let (f, l, r) = (self.n(attr::FENCE), self.n(attr::LEASE_ID), self.n(attr::RELEASED_AT));
                let (m, qh) = (self.n(attr::MIN_HOLD_UNTIL), self.n(attr::QUEUE_HEAD));
                let fv = self.v("expected_fence", num(*fence));
                // The grant's update sets `lease_id` to the waiter's (`:lease_id`).
                let lid = self.v("releasing_lease_id", str_(lease_id.expose()));
                let now = self.v("now", num(*now_ms));
                let hv = self.v("expected_head", num(*head));
                format!("{f} = {fv} AND {l} = {lid} AND attribute_not_exists({r}) AND {m} <= {now} AND {qh} = {hv}")
            }
        }
    }

    fn mutation(&mut self, key: &str, m: &Mutation) {
        match m {
            // Whole-item replacement: sent as a PutItem (see `put_item`).
            Mutation::Acquire(_) => unreachable!("acquire is a PutItem"),
            Mutation::Extend { now_ms, duration_ms, ttl } => {
                match duration_ms {
                    Some(d) => {
                        self.set_value(attr::EXPIRES_AT, num(now_ms + d));
                        self.set_value(attr::DURATION, num(*d));
                    }
                    None => {
                        let d = self.n(attr::DURATION);
                        let now = self.v("now_ext", num(*now_ms));
                        self.set(attr::EXPIRES_AT, format!("{d} + {now}"));
                    }
                }
                self.set_value(attr::RENEWED_AT, num(*now_ms));
                self.set_or_remove(attr::TTL, ttl.map(num));
            }
            Mutation::Release { now_ms, ttl } => {
                let mh = self.n(attr::MIN_HOLD_UNTIL);
                self.set(attr::EXPIRES_AT, mh);
                self.set_value(attr::RELEASED_AT, num(*now_ms));
                self.set_value(attr::TTL, num(*ttl));
                self.remove_keepalive();
            }
            Mutation::ForceRelease { now_ms, ttl } => {
                let f = self.n(attr::FENCE);
                let one = self.v("one", num(1));
                self.set(attr::FENCE, format!("{f} + {one}"));
                self.set_value(attr::EXPIRES_AT, num(0));
                self.set_value(attr::RELEASED_AT, num(*now_ms));
                self.set_value(attr::TTL, num(*ttl));
                self.remove_keepalive();
            }
            Mutation::ClearKeepalive => self.remove_keepalive(),
            Mutation::WaitsIn { coordinator } => self.set_value(attr::HANDED_IN, str_(coordinator)),
            Mutation::Enqueue { now_ms, start, lease_id, shard } => {
                let (qh, qt) = (self.n(attr::QUEUE_HEAD), self.n(attr::QUEUE_TAIL));
                let st = self.v("queue_start", num(*start));
                let one = self.v("one", num(1));
                self.set(attr::QUEUE_HEAD, format!("if_not_exists({qh}, {st})"));
                self.set(attr::QUEUE_TAIL, format!("if_not_exists({qt}, {st}) + {one}"));
                self.set_value(attr::QUEUE_TAIL_AT, num(*now_ms));
                // The condition's `:lease_id` is the same value.
                let lid = self.v("lease_id", str_(lease_id.expose()));
                self.set(attr::QUEUE_TAIL_LEASE_ID, lid);
                self.set_value(attr::Q_SHARD, num(*shard as u64));
            }
            Mutation::Grant { lease: n, seq, token } => {
                self.set_value(attr::FENCE, num(n.fence));
                self.set_value(attr::HOLDER, str_(&n.holder));
                self.set_value(attr::LEASE_ID, str_(n.lease_id.expose()));
                self.set_value(attr::ACQUIRED_AT, num(n.now_ms));
                self.set_value(attr::RENEWED_AT, num(n.now_ms));
                self.set_value(attr::MIN_HOLD_UNTIL, num(n.now_ms.saturating_add(n.min_hold_ms)));
                self.set_or_remove(attr::EXPIRES_AT, n.duration_ms.map(|d| num(n.now_ms.saturating_add(d))));
                self.set_or_remove(attr::DURATION, n.duration_ms.map(num));
                self.set_or_remove(attr::TTL, n.ttl.map(num));
                self.set_value(attr::QUEUE_HEAD, num(*seq));
                self.set_value(attr::PENDING_TOKEN, str_(token));
                let metadata =
                    n.metadata.as_ref().map(|m| AttributeValue::S(serde_json::Value::Object(m.clone()).to_string()));
                self.set_or_remove(attr::METADATA, metadata);
                match &n.keepalive {
                    Some(k) => {
                        self.set_value(attr::KA_SHARD, num(keepalive_shard(key, KEEPALIVE_SHARDS) as u64));
                        self.set_value(attr::KA_UNTIL, num(k.until_ms));
                        self.set_or_remove(attr::KA_EXECUTION_ARN, k.execution_arn.as_deref().map(str_));
                    }
                    None => self.remove_keepalive(),
                }
                self.set_or_remove(attr::RELEASED_LEASE_ID, n.released.as_ref().map(|r| str_(r.0.expose())));
                self.set_or_remove(attr::RELEASED_FENCE, n.released.as_ref().map(|r| num(r.1)));
                self.remove(attr::RELEASED_AT);
                self.remove(attr::POLL);
            }
            Mutation::Delivered => self.remove(attr::PENDING_TOKEN),
            Mutation::MarkUndelivered { token, shard } => {
                self.set_value(attr::PENDING_TOKEN, str_(token));
                self.set_value(attr::Q_SHARD, num(*shard as u64));
            }
            Mutation::Revoke { now_ms, ttl } => {
                self.set_value(attr::EXPIRES_AT, num(0));
                self.set_value(attr::RELEASED_AT, num(*now_ms));
                self.set_or_remove(attr::TTL, ttl.map(num));
                self.remove(attr::PENDING_TOKEN);
                self.remove_keepalive();
            }
            Mutation::Unindex => self.remove(attr::Q_SHARD),
            Mutation::Skip { seq } => self.set_value(attr::QUEUE_HEAD, num(*seq)),
            Mutation::PutWaiter(_) => unreachable!("a waiter item is a PutItem"),
            Mutation::Enter { now_ms, holder, shard, .. } => {
                let now = self.v("now", num(*now_ms));
                for (a, v) in [
                    (attr::FENCE, self.v("zero", num(0))),
                    (attr::HOLDER, self.v("holder", str_(holder))),
                    (attr::LEASE_ID, self.v("no_lease", str_(super::NO_LEASE))),
                    (attr::ACQUIRED_AT, now.clone()),
                    (attr::MIN_HOLD_UNTIL, now.clone()),
                ] {
                    let n = self.n(a);
                    self.set(a, format!("if_not_exists({n}, {v})"));
                }
                self.set(attr::EXPIRES_AT, now.clone());
                self.set_value(attr::STATE_SHARD, str_(shard));
                self.set(attr::STATE_SINCE, now);
                let zero = self.v("zero", num(0));
                self.set(attr::ATTEMPTS, zero);
                self.remove(attr::TTL);
            }
            Mutation::ReleaseTo { now_ms, shard, .. } => {
                let mh = self.n(attr::MIN_HOLD_UNTIL);
                self.set(attr::EXPIRES_AT, mh);
                let now = self.v("released_at_ms", num(*now_ms));
                self.set(attr::RELEASED_AT, now.clone());
                self.set_value(attr::STATE_SHARD, str_(shard));
                self.set(attr::STATE_SINCE, now);
                self.set_value(attr::ATTEMPTS, num(0));
                self.remove_keepalive();
                self.remove(attr::TTL);
            }
            Mutation::ClearTtl => self.remove(attr::TTL),
        }
    }
}

/// The expressions a write is sent with: `ConditionExpression`, and `UpdateExpression` (empty
/// for an acquire, which is a `PutItem` of the whole item). DESIGN.md prints each, and a test
/// compares them, so the specification cannot drift from what is sent.
pub fn expressions(condition: &Condition, mutation: &Mutation) -> (String, String) {
    let mut x = Expr::default();
    let cond = x.condition(condition);
    if !matches!(mutation, Mutation::Acquire(_) | Mutation::PutWaiter(_)) {
        x.mutation("", mutation);
    }
    (cond, x.update_expression())
}

/// The item an acquire writes: the whole lease, nothing of the previous one.
fn lease_item(key: &str, n: &NewLease) -> HashMap<String, AttributeValue> {
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
fn waiter_item(r: &Record) -> Result<HashMap<String, AttributeValue>> {
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
    put(attr::WAITER, AttributeValue::S(serde_json::to_string(w).expect("waiter serialises")));
    Ok(item)
}

/// A DynamoDB item as the SDK returns it.
type Item = HashMap<String, AttributeValue>;

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

fn key_map(key: &str) -> HashMap<String, AttributeValue> {
    HashMap::from([(attr::KEY.to_string(), str_(key))])
}

impl DynamoStore {
    /// An acquire: one conditional PutItem of the whole lease. Nothing of the previous lease
    /// survives by mistake, and DynamoDB Local spends less time on it than on the equivalent
    /// SET/REMOVE update expression (DESIGN.md has the figures).
    async fn put_item(&self, key: &str, condition: &Condition, item: Item, written: Record) -> Result<Write> {
        let _ = key;
        let mut x = Expr::default();
        let cond = x.condition(condition);
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
}

impl DynamoStore {
    /// A Query of one partition of the work-state index, oldest expiry first: the items free at
    /// `free_at_ms` (`expires_at_ms <= :now`), or all of them.
    fn state_query(
        &self,
        shard: &str,
        free_at_ms: Option<u64>,
    ) -> aws_sdk_dynamodb::operation::query::builders::QueryFluentBuilder {
        let q = self
            .client
            .query()
            .table_name(&self.table)
            .index_name(STATE_INDEX)
            .expression_attribute_names("#s", attr::STATE_SHARD)
            .expression_attribute_values(":s", str_(shard))
            .scan_index_forward(true);
        match free_at_ms {
            Some(now) => q
                .key_condition_expression("#s = :s AND #e <= :now")
                .expression_attribute_names("#e", attr::EXPIRES_AT)
                .expression_attribute_values(":now", num(now)),
            None => q.key_condition_expression("#s = :s"),
        }
    }
}

#[async_trait]
impl Store for DynamoStore {
    async fn delete(&self, key: &str, condition: &Condition) -> Result<Write> {
        let mut x = Expr::default();
        let cond = x.condition(condition);
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
                None => Err(Error::StoreUnavailable("DeleteItem returned no attributes".into())),
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
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .set_key(Some(key_map(key)))
            .consistent_read(true)
            .send()
            .await
            .map_err(map_err)?;
        out.item().map(record_from_item).transpose()
    }

    async fn update(&self, key: &str, condition: &Condition, mutation: &Mutation) -> Result<Write> {
        if let Mutation::Acquire(n) = mutation {
            return self.put_item(key, condition, lease_item(key, n), n.record(key)).await;
        }
        if let Mutation::PutWaiter(r) = mutation {
            return self.put_item(key, condition, waiter_item(r)?, (**r).clone()).await;
        }
        let mut x = Expr::default();
        let cond = x.condition(condition);
        x.mutation(key, mutation);
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

    async fn scan(&self, kind: &ScanKind, start: Option<&str>, limit: u32) -> Result<Page> {
        let start_key = match start {
            None => None,
            Some(token) => Some(decode_token(token)?),
        };
        let (items, last) = match kind {
            ScanKind::All => {
                let out = self
                    .client
                    .scan()
                    .table_name(&self.table)
                    .consistent_read(true)
                    .limit(limit.max(1) as i32)
                    .set_exclusive_start_key(start_key)
                    .send()
                    .await
                    .map_err(map_err)?;
                (out.items().to_vec(), out.last_evaluated_key().cloned())
            }
            ScanKind::Keepalive { shard, after_ms } => {
                let out = self
                    .client
                    .query()
                    .table_name(&self.table)
                    .index_name(KEEPALIVE_INDEX)
                    .key_condition_expression("#s = :s AND #u > :after")
                    .expression_attribute_names("#s", attr::KA_SHARD)
                    .expression_attribute_names("#u", attr::KA_UNTIL)
                    .expression_attribute_values(":s", num(*shard as u64))
                    .expression_attribute_values(":after", num(*after_ms))
                    .limit(limit.max(1) as i32)
                    .set_exclusive_start_key(start_key)
                    .send()
                    .await
                    .map_err(map_err)?;
                (out.items().to_vec(), out.last_evaluated_key().cloned())
            }
            ScanKind::Queue { shard } => {
                let out = self
                    .client
                    .query()
                    .table_name(&self.table)
                    .index_name(QUEUE_INDEX)
                    .key_condition_expression("#s = :s")
                    .expression_attribute_names("#s", attr::Q_SHARD)
                    .expression_attribute_values(":s", num(*shard as u64))
                    .limit(limit.max(1) as i32)
                    .set_exclusive_start_key(start_key)
                    .send()
                    .await
                    .map_err(map_err)?;
                // Keys only: the reader gets each item it serves.
                let items = out
                    .items()
                    .iter()
                    .map(|i| Ok(Record::key_only(need(get_s(i, attr::KEY)?, attr::KEY)?)))
                    .collect::<Result<_>>()?;
                return Ok(Page { items, next: out.last_evaluated_key().map(encode_token) });
            }
            ScanKind::State { shard, free_at_ms, .. } => {
                let mut q = self.state_query(shard, *free_at_ms);
                if free_at_ms.is_some() {
                    // A batch's candidates (up to 1,000 per Query when contended): only what a
                    // candidate is judged and taken by, not whole items (`#s`, `#e`: the
                    // query's own aliases of state_shard and expires_at_ms).
                    q = q
                        .projection_expression(format!(
                            "#k, {}, {}, {}, {}, #e, {}, {}, #s, {}, {}",
                            attr::FENCE,
                            attr::HOLDER,
                            attr::LEASE_ID,
                            attr::ACQUIRED_AT,
                            attr::MIN_HOLD_UNTIL,
                            attr::RELEASED_AT,
                            attr::STATE_SINCE,
                            attr::ATTEMPTS
                        ))
                        .expression_attribute_names("#k", attr::KEY);
                }
                let out =
                    q.limit(limit.max(1) as i32).set_exclusive_start_key(start_key).send().await.map_err(map_err)?;
                (out.items().to_vec(), out.last_evaluated_key().cloned())
            }
        };
        Ok(Page {
            items: items.iter().map(record_from_item).collect::<Result<_>>()?,
            next: last.as_ref().map(encode_token),
        })
    }

    async fn count(&self, kind: &ScanKind) -> Result<u64> {
        let ScanKind::State { shard, free_at_ms, .. } = kind else {
            return super::count_pages(self, kind).await;
        };
        let (mut n, mut start) = (0u64, None);
        loop {
            let out = self
                .state_query(shard, *free_at_ms)
                .select(aws_sdk_dynamodb::types::Select::Count)
                .set_exclusive_start_key(start)
                .send()
                .await
                .map_err(map_err)?;
            n += out.count().max(0) as u64;
            match out.last_evaluated_key() {
                Some(k) => start = Some(k.clone()),
                None => return Ok(n),
            }
        }
    }
}

/// Page tokens are DynamoDB's LastEvaluatedKey as a JSON object of attribute -> ["S"|"N", value].
fn encode_token(k: &HashMap<String, AttributeValue>) -> String {
    let mut m = serde_json::Map::new();
    for (name, v) in k {
        let enc = match v {
            AttributeValue::S(s) => serde_json::json!(["S", s]),
            AttributeValue::N(n) => serde_json::json!(["N", n]),
            _ => continue,
        };
        m.insert(name.clone(), enc);
    }
    serde_json::Value::Object(m).to_string()
}

fn decode_token(token: &str) -> Result<HashMap<String, AttributeValue>> {
    let bad = || Error::invalid("invalid page token");
    let v: serde_json::Value = serde_json::from_str(token).map_err(|_| bad())?;
    let mut out = HashMap::new();
    for (name, enc) in v.as_object().ok_or_else(bad)? {
        let pair = enc.as_array().filter(|a| a.len() == 2).ok_or_else(bad)?;
        let val = pair[1].as_str().ok_or_else(bad)?.to_string();
        let av = match pair[0].as_str() {
            Some("S") => AttributeValue::S(val),
            Some("N") => AttributeValue::N(val),
            _ => return Err(bad()),
        };
        out.insert(name.clone(), av);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DESIGN.md is the specification: every expression the store sends is printed there, word
    /// for word (`ConditionExpression: ` / `UpdateExpression: ` followed by it in backticks).
    #[test]
    fn design_prints_every_expression_sent() {
        let design = include_str!("../../../DESIGN.md");
        let id = LeaseId::generate();
        let (now, ttl) = (1, Some(2));
        let writes = [
            (Condition::Free { now_ms: now, fence: 3, lease_id: id.clone() }, None),
            (
                Condition::Renew { lease_id: id.clone(), now_ms: now, expires_at_ms: Some(4) },
                Some(Mutation::Extend { now_ms: now, duration_ms: Some(3), ttl }),
            ),
            (
                Condition::Renew { lease_id: id.clone(), now_ms: now, expires_at_ms: None },
                Some(Mutation::Extend { now_ms: now, duration_ms: None, ttl }),
            ),
            (Condition::Unreleased { lease_id: id.clone() }, Some(Mutation::Release { now_ms: now, ttl: 2 })),
            (Condition::Exists, Some(Mutation::ForceRelease { now_ms: now, ttl: 2 })),
            (Condition::FenceIs(3), Some(Mutation::ClearKeepalive)),
            (Condition::FenceAndExpiry { fence: 3, expires_at_ms: Some(4) }, Some(Mutation::ClearKeepalive)),
            (Condition::FenceAndExpiry { fence: 3, expires_at_ms: None }, Some(Mutation::ClearKeepalive)),
            (
                Condition::Queueable { now_ms: now, lease_id: id.clone() },
                Some(Mutation::Enqueue { now_ms: now, start: 5, lease_id: id.clone(), shard: 1003 }),
            ),
            (
                Condition::HandOver { fence: 3, now_ms: now, head: 5 },
                Some(Mutation::Grant {
                    lease: NewLease {
                        holder: "h".into(),
                        lease_id: id.clone(),
                        now_ms: now,
                        duration_ms: Some(3),
                        min_hold_ms: 0,
                        metadata: None,
                        keepalive: None,
                        ttl,
                        fence: 4,
                        poll_ms: None,
                        visit: None,
                        handed_in: None,
                        released: Some((id.clone(), 2)),
                    },
                    seq: 6,
                    token: "t".into(),
                }),
            ),
            (Condition::HandOver { fence: 3, now_ms: now, head: 5 }, Some(Mutation::Skip { seq: 6 })),
            (Condition::Undelivered { fence: 3 }, Some(Mutation::Delivered)),
            (Condition::Undelivered { fence: 3 }, Some(Mutation::Revoke { now_ms: now, ttl: Some(2) })),
            (Condition::Undelivered { fence: 3 }, Some(Mutation::Revoke { now_ms: now, ttl: None })),
            (Condition::FenceIs(3), Some(Mutation::MarkUndelivered { token: "t".into(), shard: 1003 })),
            (Condition::QueueIdle, Some(Mutation::Unindex)),
            (Condition::NotLease, None),
            (Condition::HandTo { lease_id: id.clone(), fence: 3, now_ms: now }, None),
            (
                Condition::FreeIn {
                    now_ms: now,
                    fence: 3,
                    lease_id: id.clone(),
                    visit: crate::store::Visit { state: "S".into(), shard: "S#0".into(), since_ms: 1, attempts: 0 },
                },
                None,
            ),
            (
                Condition::Enterable { now_ms: now, state: "S".into(), shard: "S#0".into() },
                Some(Mutation::Enter { now_ms: now, holder: "h".into(), state: "S".into(), shard: "S#0".into() }),
            ),
            (
                Condition::Live { lease_id: id.clone(), now_ms: now },
                Some(Mutation::ReleaseTo { now_ms: now, state: "S".into(), shard: "S#0".into() }),
            ),
            (Condition::FenceIs(3), Some(Mutation::ClearTtl)),
            (Condition::FenceIs(3), Some(Mutation::WaitsIn { coordinator: "c".into() })),
            (Condition::Unqueued { lease_id: id.clone() }, Some(Mutation::Release { now_ms: now, ttl: 2 })),
            (Condition::ReleaseHandOver { lease_id: id.clone(), fence: 3, now_ms: now, head: 5 }, None),
        ];
        for (c, m) in writes {
            let (cond, update) = expressions(&c, m.as_ref().unwrap_or(&Mutation::ClearKeepalive));
            let line = format!("ConditionExpression: `{cond}`");
            if std::env::var_os("LEASEHOLD_PRINT_EXPRESSIONS").is_some() {
                println!("{line}\nUpdateExpression: `{update}`\n");
                continue;
            }
            assert!(design.contains(&line), "DESIGN.md lacks {line}");
            if m.is_some() {
                let line = format!("UpdateExpression: `{update}`");
                assert!(design.contains(&line), "DESIGN.md lacks {line}");
            }
        }
    }
}
