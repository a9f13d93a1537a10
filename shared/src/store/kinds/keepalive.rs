//! Keep-alive on the holder's behalf (DESIGN.md, "Keep-alive on the holder's behalf"): the
//! sweep's own condition and mutation, their reference semantics and their DynamoDB rendering.
//! (The renewals and releases it makes on a holder's behalf are a lease's
//! [`Renew`](super::LeaseCondition::Renew) and [`Release`](super::LeaseMutation::Release).)

use super::lease::updated;
use crate::model::Record;
use crate::store::dynamo::expr::{guard, Expr, Guard, Request};
use crate::store::dynamo::item::num;

/// The keep-alive sweep's conditions. Semantics are defined by [`KeepaliveCondition::holds`];
/// the DynamoDB text of each is in DESIGN.md, and a test renders each and compares.
#[derive(Debug, Clone, PartialEq)]
pub enum KeepaliveCondition {
    /// The item is still the lease the keep-alive sweep read from its (eventually consistent)
    /// index: same fence and same expiry (`None`: no expiry). A renewal the index has not seen
    /// yet moved the expiry, so a live lease is never taken out of the sweep on a stale entry.
    /// DynamoDB: `fence = :expected_fence AND expires_at_ms = :expected_expiry` |
    /// `attribute_not_exists(expires_at_ms)`
    FenceAndExpiry { fence: u64, expires_at_ms: Option<u64> },
}

/// The keep-alive sweep's writes. Semantics are defined by [`KeepaliveMutation::apply`].
#[derive(Debug, Clone, PartialEq)]
pub enum KeepaliveMutation {
    /// Stop renewing on the holder's behalf (keep-alive deadline passed or execution gone).
    ClearKeepalive,
}

impl KeepaliveCondition {
    /// Reference semantics: does the condition hold for the current item (`None`: no item)?
    pub fn holds(&self, item: Option<&Record>) -> bool {
        let Some(r) = item else { return false };
        match self {
            KeepaliveCondition::FenceAndExpiry { fence, expires_at_ms } => {
                r.fence == *fence && r.expires_at_ms == *expires_at_ms
            }
        }
    }

    /// The DynamoDB `ConditionExpression` (numbered as in `dynamo/render.rs`'s protocol).
    pub(in crate::store) fn guard(&self) -> Guard {
        match self {
            // Step 5, the lease the keep-alive index showed, not renewed since (a renewal moves the
            // expiry).
            KeepaliveCondition::FenceAndExpiry { fence, expires_at_ms: Some(e) } => guard(
                "fence = :expected_fence AND expires_at_ms = :expected_expiry",
                [("expected_fence", num(*fence)), ("expected_expiry", num(*e))],
            ),
            KeepaliveCondition::FenceAndExpiry { fence, expires_at_ms: None } => guard(
                "fence = :expected_fence AND attribute_not_exists(expires_at_ms)",
                [("expected_fence", num(*fence))],
            ),
        }
    }
}

impl KeepaliveMutation {
    /// Reference semantics: the item after the write. `old` is the item the condition held for.
    pub fn apply(&self, old: Option<&Record>) -> Record {
        match self {
            KeepaliveMutation::ClearKeepalive => updated(old, |r| r.keepalive = None),
        }
    }

    /// The DynamoDB write: the `UpdateExpression`, rendered into `x`.
    pub(in crate::store) fn render(&self, x: &mut Expr) -> Request {
        match self {
            // Step 5, the key leaves the keep-alive index.
            KeepaliveMutation::ClearKeepalive => x.remove_keepalive(),
        }
        Request::Update
    }
}
