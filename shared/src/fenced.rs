//! Fenced writes to a DynamoDB table guarded by a lease (DESIGN.md, "Fenced writes").
//!
//! Two tools, for two guarantees:
//!
//! - [`FenceGuard`] makes the guarded resource itself refuse a stale holder. It turns a
//!   `PutItem`, `UpdateItem`, `DeleteItem` or the items of a `TransactWriteItems` into a
//!   fenced write: the write lands only if the item's recorded fence (attribute
//!   [`DEFAULT_ATTRIBUTE`] unless configured) is absent or not above the caller's, and (puts
//!   and updates) records the caller's fence in the same write. The caller's own condition,
//!   names and values are kept: the fence condition is ANDed to the caller's. A refusal is
//!   [`FencedError::Fenced`] with the higher fence the item holds; a failure of the caller's
//!   own condition is [`FencedError::ConditionFailed`] with the item.
//! - [`Coordinator::commit_while_live`] (and [`crate::HeldLease::commit_while_live`]) commits
//!   a `TransactWriteItems` only while the lease is live: it adds a `ConditionCheck` on the
//!   lease item (this `lease_id`, not released, not expired at the coordinator's clock plus
//!   the skew margin). A holder paused past its expiry cannot commit at all, and the resource
//!   needs no fence attribute. A refusal is [`FencedError::LeaseLost`], or
//!   [`FencedError::ConditionFailed`] with the index of the caller's item whose condition
//!   failed.
//!
//! Fencing an update:
//!
//! ```no_run
//! use aws_sdk_dynamodb::types::AttributeValue;
//! use leasehold::fenced::{FenceGuard, FencedError};
//!
//! # async fn example(client: aws_sdk_dynamodb::Client, fence: u64) -> Result<(), FencedError> {
//! let guard = FenceGuard::new(fence); // e.g. held.fence_guard(), or LEASEHOLD_FENCE
//! let update = client
//!     .update_item()
//!     .table_name("accounts")
//!     .key("id", AttributeValue::S("acct-1".into()))
//!     .update_expression("SET #balance = #balance + :amount")
//!     .condition_expression("#balance >= :zero")
//!     .expression_attribute_names("#balance", "balance")
//!     .expression_attribute_values(":amount", AttributeValue::N("10".into()))
//!     .expression_attribute_values(":zero", AttributeValue::N("0".into()));
//! match guard.send_update(update).await {
//!     Ok(_) => println!("written, fence {fence} recorded"),
//!     Err(FencedError::Fenced { seen, .. }) => println!("stale: a holder with fence {seen} wrote since"),
//!     Err(FencedError::ConditionFailed { .. }) => println!("our own condition failed"),
//!     Err(e) => return Err(e),
//! }
//! # Ok(()) }
//! ```
//!
//! Committing only while the lease is live:
//!
//! ```no_run
//! use aws_sdk_dynamodb::types::{AttributeValue, Put, TransactWriteItem};
//! use leasehold::fenced::FencedError;
//! use leasehold::HeldLease;
//!
//! # async fn example(held: &HeldLease, client: aws_sdk_dynamodb::Client) -> Result<(), Box<dyn std::error::Error>> {
//! let put = Put::builder()
//!     .table_name("reports")
//!     .item("id", AttributeValue::S("daily".into()))
//!     .item("body", AttributeValue::S("...".into()))
//!     .build()?;
//! let tx = client.transact_write_items().transact_items(TransactWriteItem::builder().put(put).build());
//! match held.commit_while_live("leasehold-leases", tx).await {
//!     Ok(_) => println!("committed while the lease was ours"),
//!     Err(FencedError::LeaseLost { .. }) => println!("lease lost: nothing was written"),
//!     Err(FencedError::ConditionFailed { index, .. }) => println!("item {index:?}: our own condition failed"),
//!     Err(e) => return Err(e.into()),
//! }
//! # Ok(()) }
//! ```

use std::collections::HashMap;

use aws_sdk_dynamodb::error::SdkError;
use aws_sdk_dynamodb::operation::delete_item::builders::DeleteItemFluentBuilder;
use aws_sdk_dynamodb::operation::delete_item::{DeleteItemError, DeleteItemOutput};
use aws_sdk_dynamodb::operation::put_item::builders::PutItemFluentBuilder;
use aws_sdk_dynamodb::operation::put_item::{PutItemError, PutItemOutput};
use aws_sdk_dynamodb::operation::transact_write_items::builders::TransactWriteItemsFluentBuilder;
use aws_sdk_dynamodb::operation::transact_write_items::{TransactWriteItemsError, TransactWriteItemsOutput};
use aws_sdk_dynamodb::operation::update_item::builders::UpdateItemFluentBuilder;
use aws_sdk_dynamodb::operation::update_item::{UpdateItemError, UpdateItemOutput};
use aws_sdk_dynamodb::types::{AttributeValue, ConditionCheck, ReturnValuesOnConditionCheckFailure, TransactWriteItem};

use crate::model::LeaseId;
use crate::protocol::Coordinator;
use crate::store::dynamo::attr;

/// A DynamoDB item.
pub type Item = HashMap<String, AttributeValue>;

/// The attribute a [`FenceGuard`] records the fence in unless told otherwise.
pub const DEFAULT_ATTRIBUTE: &str = "lease_fence";
/// The `ExpressionAttributeNames` placeholder of the fence attribute.
pub const FENCE_NAME: &str = "#lh_fence";
/// The `ExpressionAttributeValues` placeholder of the caller's fence.
pub const FENCE_VALUE: &str = ":lh_fence";
/// The fence condition ANDed to the caller's: the recorded fence is absent or not above ours.
pub const FENCE_CONDITION: &str = "attribute_not_exists(#lh_fence) OR #lh_fence <= :lh_fence";
/// The condition of the lease-live `ConditionCheck` on the lease item (`:lh_now` is the
/// coordinator's clock plus its safe margin): the item's lease, or the semaphore holder whose
/// entry in the holders' map is named by the lease_id (`#lh_lease_id`: a semaphore's item
/// carries `lease_id = -`, which no caller's lease_id is, and a lease's item has no map).
pub(crate) const LEASE_LIVE_CONDITION: &str = "(lease_id = :lh_lease_id AND attribute_not_exists(released_at_ms) \
     AND (attribute_not_exists(expires_at_ms) OR expires_at_ms > :lh_now)) \
     OR (sem_holders.#lh_lease_id.expires_at_ms > :lh_now AND attribute_not_exists(sem_holders.#lh_lease_id.released_at_ms))";

/// Why a fenced write or a lease-live commit did not land.
#[derive(Debug, thiserror::Error)]
pub enum FencedError {
    /// The item records a fence above ours: a newer holder has written it. `index`: the item
    /// of a transaction (`None` for a single write).
    #[error("fenced: the item records fence {seen}, above ours")]
    Fenced { seen: u64, index: Option<usize> },
    /// The caller's own condition failed (the fence check passed, or the write was not
    /// fenced). `item`: the item as it was (absent if it did not exist).
    #[error("the write's own condition failed")]
    ConditionFailed { index: Option<usize>, item: Option<Item> },
    /// The lease-live check refused the commit: the lease was released, expired (or within the
    /// skew margin of expiry) or taken over. Nothing was written. `lease`: the lease item.
    #[error("lease lost: the commit was refused and nothing was written")]
    LeaseLost { lease: Option<Item> },
    /// The request cannot be fenced (placeholder collision, legacy parameters, missing fields).
    #[error("cannot fence this request: {0}")]
    Invalid(String),
    /// Any other DynamoDB error (throttling, validation, network).
    #[error("DynamoDB: {0}")]
    Dynamo(Box<aws_sdk_dynamodb::Error>),
}

impl FencedError {
    fn dynamo<E, R>(e: SdkError<E, R>) -> Self
    where
        aws_sdk_dynamodb::Error: From<SdkError<E, R>>,
    {
        FencedError::Dynamo(Box::new(e.into()))
    }
}

/// Turns writes into fenced writes: see the module documentation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceGuard {
    attribute: String,
    fence: u64,
}

impl FenceGuard {
    /// A guard for `fence`, recorded in [`DEFAULT_ATTRIBUTE`].
    pub fn new(fence: u64) -> Self {
        FenceGuard { attribute: DEFAULT_ATTRIBUTE.to_string(), fence }
    }

    /// Records the fence in `attribute` instead.
    pub fn with_attribute(mut self, attribute: impl Into<String>) -> Self {
        self.attribute = attribute.into();
        self
    }

    pub fn fence(&self) -> u64 {
        self.fence
    }

    pub fn attribute(&self) -> &str {
        &self.attribute
    }

    /// The caller's condition, names and values with the fence's merged in.
    fn merge(
        &self,
        condition: Option<&str>,
        names: Option<&HashMap<String, String>>,
        values: Option<&Item>,
    ) -> Result<(String, HashMap<String, String>, Item), FencedError> {
        if names.is_some_and(|n| n.contains_key(FENCE_NAME)) {
            return Err(FencedError::Invalid(format!("the expression attribute name {FENCE_NAME} is already used")));
        }
        if values.is_some_and(|v| v.contains_key(FENCE_VALUE)) {
            return Err(FencedError::Invalid(format!("the expression attribute value {FENCE_VALUE} is already used")));
        }
        let condition = match condition {
            Some(c) if !c.trim().is_empty() => format!("({c}) AND ({FENCE_CONDITION})"),
            _ => FENCE_CONDITION.to_string(),
        };
        let mut names = names.cloned().unwrap_or_default();
        names.insert(FENCE_NAME.to_string(), self.attribute.clone());
        let mut values = values.cloned().unwrap_or_default();
        values.insert(FENCE_VALUE.to_string(), AttributeValue::N(self.fence.to_string()));
        Ok((condition, names, values))
    }

    fn fence_value(&self) -> AttributeValue {
        AttributeValue::N(self.fence.to_string())
    }

    /// Fences a `PutItem`: the fence condition, and the fence attribute in the item.
    pub fn put(&self, b: PutItemFluentBuilder) -> Result<PutItemFluentBuilder, FencedError> {
        if b.get_expected().is_some() || b.get_conditional_operator().is_some() {
            return Err(legacy());
        }
        let (c, n, v) = self.merge(
            b.get_condition_expression().as_deref(),
            b.get_expression_attribute_names().as_ref(),
            b.get_expression_attribute_values().as_ref(),
        )?;
        Ok(b.item(self.attribute.clone(), self.fence_value())
            .condition_expression(c)
            .set_expression_attribute_names(Some(n))
            .set_expression_attribute_values(Some(v))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld))
    }

    /// Fences an `UpdateItem`: the fence condition, and `SET #lh_fence = :lh_fence` merged
    /// into the update expression (into its SET clause if it has one).
    pub fn update(&self, b: UpdateItemFluentBuilder) -> Result<UpdateItemFluentBuilder, FencedError> {
        if b.get_expected().is_some() || b.get_conditional_operator().is_some() || b.get_attribute_updates().is_some() {
            return Err(legacy());
        }
        let (c, n, v) = self.merge(
            b.get_condition_expression().as_deref(),
            b.get_expression_attribute_names().as_ref(),
            b.get_expression_attribute_values().as_ref(),
        )?;
        let update = merge_update(b.get_update_expression().as_deref());
        Ok(b.update_expression(update)
            .condition_expression(c)
            .set_expression_attribute_names(Some(n))
            .set_expression_attribute_values(Some(v))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld))
    }

    /// Fences a `DeleteItem`: the fence condition only. A deleted item keeps no fence, so a
    /// later stale write to it is accepted; where that matters, mark the item deleted with a
    /// fenced update (a tombstone) instead.
    pub fn delete(&self, b: DeleteItemFluentBuilder) -> Result<DeleteItemFluentBuilder, FencedError> {
        if b.get_expected().is_some() || b.get_conditional_operator().is_some() {
            return Err(legacy());
        }
        let (c, n, v) = self.merge(
            b.get_condition_expression().as_deref(),
            b.get_expression_attribute_names().as_ref(),
            b.get_expression_attribute_values().as_ref(),
        )?;
        Ok(b.condition_expression(c)
            .set_expression_attribute_names(Some(n))
            .set_expression_attribute_values(Some(v))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld))
    }

    /// Fences one item of a `TransactWriteItems`: a `Put` or `Update` as [`FenceGuard::put`] /
    /// [`FenceGuard::update`], a `Delete` or `ConditionCheck` with the fence condition only.
    pub fn transact_item(&self, mut item: TransactWriteItem) -> Result<TransactWriteItem, FencedError> {
        let all_old = Some(ReturnValuesOnConditionCheckFailure::AllOld);
        if let Some(p) = item.put.as_mut() {
            let (c, n, v) = self.merge(
                p.condition_expression.as_deref(),
                p.expression_attribute_names.as_ref(),
                p.expression_attribute_values.as_ref(),
            )?;
            p.item.insert(self.attribute.clone(), self.fence_value());
            (p.condition_expression, p.expression_attribute_names, p.expression_attribute_values) =
                (Some(c), Some(n), Some(v));
            p.return_values_on_condition_check_failure = all_old;
        } else if let Some(u) = item.update.as_mut() {
            let (c, n, v) = self.merge(
                u.condition_expression.as_deref(),
                u.expression_attribute_names.as_ref(),
                u.expression_attribute_values.as_ref(),
            )?;
            u.update_expression = merge_update(Some(&u.update_expression));
            (u.condition_expression, u.expression_attribute_names, u.expression_attribute_values) =
                (Some(c), Some(n), Some(v));
            u.return_values_on_condition_check_failure = all_old;
        } else if let Some(d) = item.delete.as_mut() {
            let (c, n, v) = self.merge(
                d.condition_expression.as_deref(),
                d.expression_attribute_names.as_ref(),
                d.expression_attribute_values.as_ref(),
            )?;
            (d.condition_expression, d.expression_attribute_names, d.expression_attribute_values) =
                (Some(c), Some(n), Some(v));
            d.return_values_on_condition_check_failure = all_old;
        } else if let Some(cc) = item.condition_check.as_mut() {
            let (c, n, v) = self.merge(
                Some(&cc.condition_expression),
                cc.expression_attribute_names.as_ref(),
                cc.expression_attribute_values.as_ref(),
            )?;
            (cc.condition_expression, cc.expression_attribute_names, cc.expression_attribute_values) =
                (c, Some(n), Some(v));
            cc.return_values_on_condition_check_failure = all_old;
        } else {
            return Err(FencedError::Invalid("an empty TransactWriteItem".into()));
        }
        Ok(item)
    }

    /// Fences every item of a `TransactWriteItems`.
    pub fn transaction(
        &self,
        b: TransactWriteItemsFluentBuilder,
    ) -> Result<TransactWriteItemsFluentBuilder, FencedError> {
        let items = b.get_transact_items().clone().unwrap_or_default();
        let items = items.into_iter().map(|i| self.transact_item(i)).collect::<Result<Vec<_>, _>>()?;
        Ok(b.set_transact_items(Some(items)))
    }

    /// What a failed condition on a fenced item means: `Fenced` if the item records a fence
    /// above ours, otherwise the caller's own condition failed.
    pub fn refusal(&self, item: Option<Item>, index: Option<usize>) -> FencedError {
        match item.as_ref().and_then(|i| recorded_fence(i, &self.attribute)) {
            Some(seen) if seen > self.fence => FencedError::Fenced { seen, index },
            _ => FencedError::ConditionFailed { index, item },
        }
    }

    /// Fences and sends a `PutItem`.
    pub async fn send_put(&self, b: PutItemFluentBuilder) -> Result<PutItemOutput, FencedError> {
        self.put(b)?.send().await.map_err(|e| match e.as_service_error() {
            Some(PutItemError::ConditionalCheckFailedException(c)) => self.refusal(c.item.clone(), None),
            _ => FencedError::dynamo(e),
        })
    }

    /// Fences and sends an `UpdateItem`.
    pub async fn send_update(&self, b: UpdateItemFluentBuilder) -> Result<UpdateItemOutput, FencedError> {
        self.update(b)?.send().await.map_err(|e| match e.as_service_error() {
            Some(UpdateItemError::ConditionalCheckFailedException(c)) => self.refusal(c.item.clone(), None),
            _ => FencedError::dynamo(e),
        })
    }

    /// Fences and sends a `DeleteItem` (see [`FenceGuard::delete`] on what a delete leaves).
    pub async fn send_delete(&self, b: DeleteItemFluentBuilder) -> Result<DeleteItemOutput, FencedError> {
        self.delete(b)?.send().await.map_err(|e| match e.as_service_error() {
            Some(DeleteItemError::ConditionalCheckFailedException(c)) => self.refusal(c.item.clone(), None),
            _ => FencedError::dynamo(e),
        })
    }

    /// Fences every item of a `TransactWriteItems` and sends it. A refusal names the item:
    /// `Fenced { index }` if any item records a higher fence, else `ConditionFailed { index }`.
    pub async fn send_transaction(
        &self,
        b: TransactWriteItemsFluentBuilder,
    ) -> Result<TransactWriteItemsOutput, FencedError> {
        self.transaction(b)?.send().await.map_err(|e| transaction_refusal(e, Some(self), None))
    }
}

fn legacy() -> FencedError {
    FencedError::Invalid(
        "legacy parameters (Expected, ConditionalOperator, AttributeUpdates) cannot be combined with expressions"
            .into(),
    )
}

/// The fence recorded in `item`'s `attribute`, if it holds a number.
pub fn recorded_fence(item: &Item, attribute: &str) -> Option<u64> {
    match item.get(attribute) {
        Some(AttributeValue::N(n)) => n.parse().ok(),
        _ => None,
    }
}

/// `expr` with `#lh_fence = :lh_fence` set: added to its SET clause if it has one (an update
/// expression has at most one), otherwise as a SET clause of its own in front.
pub fn merge_update(expr: Option<&str>) -> String {
    let assignment = format!("{FENCE_NAME} = {FENCE_VALUE}");
    let expr = expr.unwrap_or("").trim();
    if expr.is_empty() {
        return format!("SET {assignment}");
    }
    match set_keyword_end(expr) {
        Some(end) => format!("{} {assignment},{}", &expr[..end], &expr[end..]),
        None => format!("SET {assignment} {expr}"),
    }
}

/// The byte offset just after the `SET` keyword of an update expression. Keywords are bare
/// words outside brackets; `SET`, `REMOVE`, `ADD` and `DELETE` are reserved words, so an
/// attribute of that name appears only as a `#placeholder` and never matches.
fn set_keyword_end(expr: &str) -> Option<usize> {
    let b = expr.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut depth = 0i32;
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if depth == 0 && ident(c) && (i == 0 || !(ident(b[i - 1]) || matches!(b[i - 1], b'#' | b':' | b'.'))) {
            let start = i;
            while i < b.len() && ident(b[i]) {
                i += 1;
            }
            if expr[start..i].eq_ignore_ascii_case("SET") {
                return Some(i);
            }
            continue;
        }
        match c {
            b'(' | b'[' => depth += 1,
            b')' | b']' => depth -= 1,
            _ => {}
        }
        i += 1;
    }
    None
}

/// Maps a cancelled transaction to a typed refusal. `lease_index`: the position of the
/// lease-live check, whose failure means `LeaseLost` whatever else failed.
fn transaction_refusal<R>(
    e: SdkError<TransactWriteItemsError, R>,
    guard: Option<&FenceGuard>,
    lease_index: Option<usize>,
) -> FencedError
where
    aws_sdk_dynamodb::Error: From<SdkError<TransactWriteItemsError, R>>,
{
    if let Some(TransactWriteItemsError::TransactionCanceledException(t)) = e.as_service_error() {
        let reasons = t.cancellation_reasons();
        let failed: Vec<(usize, Option<Item>)> = reasons
            .iter()
            .enumerate()
            .filter(|(_, r)| r.code() == Some("ConditionalCheckFailed"))
            .map(|(i, r)| (i, r.item().cloned()))
            .collect();
        if let Some((_, lease)) = failed.iter().find(|(i, _)| Some(*i) == lease_index) {
            return FencedError::LeaseLost { lease: lease.clone() };
        }
        let refusals: Vec<FencedError> = failed
            .into_iter()
            .map(|(i, item)| match guard {
                Some(g) => g.refusal(item, Some(i)),
                None => FencedError::ConditionFailed { index: Some(i), item },
            })
            .collect();
        if let Some(pos) = refusals.iter().position(|r| matches!(r, FencedError::Fenced { .. })) {
            return refusals.into_iter().nth(pos).expect("position");
        }
        if let Some(r) = refusals.into_iter().next() {
            return r;
        }
    }
    FencedError::dynamo(e)
}

/// The `ConditionCheck` that lets a transaction commit only while the lease `lease_id` on
/// `key` is live at `live_at_ms` (see [`LEASE_LIVE_CONDITION`]).
pub(crate) fn lease_live_check(
    lease_table: &str,
    key: &str,
    lease_id: &LeaseId,
    live_at_ms: u64,
) -> Result<TransactWriteItem, FencedError> {
    let check = ConditionCheck::builder()
        .table_name(lease_table)
        .key(attr::KEY, AttributeValue::S(key.to_string()))
        .condition_expression(LEASE_LIVE_CONDITION)
        .expression_attribute_names("#lh_lease_id", lease_id.expose())
        .expression_attribute_values(":lh_lease_id", AttributeValue::S(lease_id.expose().to_string()))
        .expression_attribute_values(":lh_now", AttributeValue::N(live_at_ms.to_string()))
        .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
        .build()
        .map_err(|e| FencedError::Invalid(e.to_string()))?;
    Ok(TransactWriteItem::builder().condition_check(check).build())
}

impl Coordinator {
    /// The lease-live `ConditionCheck` for the lease `lease_id` on `key`, at this
    /// coordinator's clock plus its safe margin (the skew margin, or more while the store's
    /// answers leave its clock less certain: DESIGN.md, "Clocks"): a commit carrying it is
    /// refused once the lease is past its holder's safe time.
    pub(crate) fn lease_live_check(
        &self,
        lease_table: &str,
        key: &str,
        lease_id: &LeaseId,
    ) -> Result<TransactWriteItem, FencedError> {
        let live_at = self.now_ms() + self.safe_margin_now().as_millis() as u64;
        lease_live_check(lease_table, key, lease_id, live_at)
    }

    /// Sends the transaction `tx` with the lease-live check appended (after the caller's
    /// items, so their indexes are unchanged). Refused: `LeaseLost` if the check failed,
    /// otherwise `Fenced`/`ConditionFailed` for the caller's item (`fence` is compared with
    /// the [`DEFAULT_ATTRIBUTE`] of items fenced with `FenceGuard::new(fence)`).
    pub async fn commit_while_live(
        &self,
        lease_table: &str,
        key: &str,
        lease_id: &LeaseId,
        fence: u64,
        tx: TransactWriteItemsFluentBuilder,
    ) -> Result<TransactWriteItemsOutput, FencedError> {
        let mut items = tx.get_transact_items().clone().unwrap_or_default();
        let lease_index = items.len();
        items.push(self.lease_live_check(lease_table, key, lease_id)?);
        let guard = FenceGuard::new(fence);
        tx.set_transact_items(Some(items))
            .send()
            .await
            .map_err(|e| transaction_refusal(e, Some(&guard), Some(lease_index)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn update_expressions_merge_into_the_one_set_clause() {
        let m = |e: &str| merge_update(Some(e));
        assert_eq!(merge_update(None), "SET #lh_fence = :lh_fence");
        assert_eq!(m("SET a = :a"), "SET #lh_fence = :lh_fence, a = :a");
        assert_eq!(m("set a = :a"), "set #lh_fence = :lh_fence, a = :a");
        assert_eq!(m("REMOVE b SET a = :a"), "REMOVE b SET #lh_fence = :lh_fence, a = :a");
        assert_eq!(m("ADD n :one DELETE s :x"), "SET #lh_fence = :lh_fence ADD n :one DELETE s :x");
        // Placeholders, paths and function names that contain "set" are not the keyword.
        assert_eq!(m("ADD #set :set, asset.set :x"), "SET #lh_fence = :lh_fence ADD #set :set, asset.set :x");
        assert_eq!(
            m("REMOVE l[0] SET x = list_append(if_not_exists(x, :e), :set)"),
            "REMOVE l[0] SET #lh_fence = :lh_fence, x = list_append(if_not_exists(x, :e), :set)"
        );
    }
}
