//! Work states (DESIGN.md, "Work items and batch leases"): the conditions and the mutations
//! that put a key into a state, take it in its state, and release it into the next, their
//! reference semantics, and their DynamoDB rendering, side by side. (A batch lease's write is a
//! lease's [`Acquire`](super::LeaseMutation::Acquire) that carries the state's [`Visit`].)

use super::lease::{release, updated, Visit};
use crate::model::{LeaseId, Record};
use crate::store::dynamo::expr::{guard, id, Expr, Guard, Request};
use crate::store::dynamo::item::{num, str_};
use crate::store::keys::NO_LEASE;
use crate::store::table::attr;

/// The conditions of work states. Semantics are defined by [`WorkCondition::holds`]; the
/// DynamoDB text of each is in DESIGN.md, and a test renders each and compares.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkCondition {
    /// [`LeaseCondition::Free`](super::LeaseCondition::Free) for a key in a work state, and
    /// still in the same visit of that state the coordinator read (same state, same entry time,
    /// same number of grants): a batch lease copies the state into the new item, so it must be
    /// the item's current one. DynamoDB: `expires_at_ms <= :now AND fence < :fence AND lease_id
    /// <> :lease_id AND (attribute_not_exists(queue_tail) OR queue_tail <= queue_head) AND
    /// state_shard = :state_shard AND state_since_ms = :state_since_ms AND attempts = :attempts
    /// AND attribute_not_exists(pending_token)`
    FreeIn { now_ms: u64, fence: u64, lease_id: LeaseId, visit: Visit },
    /// A key may be put into `state`: no item, or a free item not already in `state`.
    /// DynamoDB: `attribute_not_exists(fence) OR (expires_at_ms <= :now AND
    /// (attribute_not_exists(state_shard) OR state_shard <> :state_shard))`
    Enterable { now_ms: u64, state: String, shard: String },
}

/// The writes of work states. Semantics are defined by [`WorkMutation::apply`].
#[derive(Debug, Clone, PartialEq)]
pub enum WorkMutation {
    /// Put the key into a work state without leasing it: free from `now_ms` (its expiry is set
    /// to it), entered now, no grants yet; the TTL `ttl` (a terminal state) or none (kept until
    /// taken). A new item gets fence 0, `holder` and an empty lease_id (no lease_id a caller
    /// can send).
    Enter { now_ms: u64, holder: String, state: String, shard: String, ttl: Option<u64> },
    /// [`LeaseMutation::Release`](super::LeaseMutation::Release) that also moves the key into
    /// `state` (entered now, no grants yet) with the TTL `ttl` (a terminal state) or none (a
    /// key in a state is kept until it is taken).
    ReleaseTo { now_ms: u64, state: String, shard: String, ttl: Option<u64> },
    /// Remove the TTL: a key in a work state is kept until it is taken.
    ClearTtl,
}

impl WorkCondition {
    /// Reference semantics: does the condition hold for the current item (`None`: no item)?
    pub fn holds(&self, item: Option<&Record>) -> bool {
        let Some(r) = item else { return matches!(self, WorkCondition::Enterable { .. }) };
        match self {
            WorkCondition::FreeIn { now_ms, fence, lease_id, visit } => {
                matches!(r.expires_at_ms, Some(e) if e <= *now_ms)
                    && r.fence < *fence
                    && &r.lease_id != lease_id
                    && r.queue_len() == 0
                    && r.queue.queue_tail.is_none_or(|t| t < *fence)
                    && r.work.state.as_deref() == Some(visit.state.as_str())
                    && r.work.state_since_ms == Some(visit.since_ms)
                    && r.work.attempts.unwrap_or(0) == visit.attempts
                    && r.queue.pending_token.is_none()
            }
            WorkCondition::Enterable { now_ms, state, .. } => {
                matches!(r.expires_at_ms, Some(e) if e <= *now_ms) && r.work.state.as_deref() != Some(state.as_str())
            }
        }
    }

    /// The DynamoDB `ConditionExpression` (numbered as in `dynamo/render.rs`'s protocol).
    pub(in crate::store) fn guard(&self) -> Guard {
        match self {
            // Step 8b, take a key in its state: `Free`, still in the visit read (the put copies it
            // over).
            WorkCondition::FreeIn { now_ms, fence, lease_id, visit } => guard(
                "expires_at_ms <= :now AND fence < :fence AND lease_id <> :lease_id AND (attribute_not_exists(queue_tail) \
                 OR (queue_tail <= queue_head AND queue_tail < :fence)) AND state_shard = :state_shard AND state_since_ms = :state_since_ms \
                 AND attempts = :attempts AND attribute_not_exists(pending_token)",
                [
                    ("now", num(*now_ms)),
                    ("fence", num(*fence)),
                    ("lease_id", id(lease_id)),
                    ("state_shard", str_(&visit.shard)),
                    ("state_since_ms", num(visit.since_ms)),
                    ("attempts", num(visit.attempts as u64)),
                ],
            ),
            // Step 8a, put: no item, or a free one not already in this state.
            WorkCondition::Enterable { now_ms, shard, .. } => guard(
                "attribute_not_exists(fence) OR (expires_at_ms <= :now AND (attribute_not_exists(state_shard) \
                 OR state_shard <> :state_shard))",
                [("now", num(*now_ms)), ("state_shard", str_(shard))],
            ),
        }
    }
}

impl WorkMutation {
    /// Reference semantics: the item after the write. `old` is the item the condition held for.
    pub fn apply(&self, key: &str, old: Option<&Record>) -> Record {
        match self {
            WorkMutation::Enter { now_ms, holder, state, ttl, .. } => {
                let mut r = old.cloned().unwrap_or_else(|| unleased(key, holder, *now_ms));
                r.expires_at_ms = Some(*now_ms);
                enter(&mut r, state, *now_ms);
                r.ttl = *ttl;
                r
            }
            WorkMutation::ReleaseTo { now_ms, state, ttl, .. } => updated(old, |r| {
                release(r, *now_ms);
                enter(r, state, *now_ms);
                r.ttl = *ttl;
            }),
            WorkMutation::ClearTtl => updated(old, |r| r.ttl = None),
        }
    }

    /// The DynamoDB write: the `UpdateExpression`, rendered into `x`.
    pub(in crate::store) fn render(&self, x: &mut Expr) -> Request {
        match self {
            WorkMutation::Enter { now_ms, holder, shard, ttl, .. } => enter_update(x, *now_ms, holder, shard, *ttl),
            // Step 8c, a release that moves the key into a state, kept until taken (no TTL) or, in a
            // terminal state, until its TTL.
            WorkMutation::ReleaseTo { now_ms, shard, ttl, .. } => {
                let mh = x.n(attr::MIN_HOLD_UNTIL);
                x.set(attr::EXPIRES_AT, mh);
                let now = x.v("released_at_ms", num(*now_ms));
                x.set(attr::RELEASED_AT, now.clone());
                x.set_value(attr::STATE_SHARD, str_(shard));
                x.set(attr::STATE_SINCE, now);
                x.set_value(attr::ATTEMPTS, num(0));
                x.remove_keepalive();
                x.set_or_remove(attr::TTL, ttl.map(num));
            }
            // Step 8d, a key in a state keeps no TTL.
            WorkMutation::ClearTtl => x.remove(attr::TTL),
        }
        Request::Update
    }
}

/// Into work state `state` at `now_ms`, no grants yet, no TTL.
fn enter(r: &mut Record, state: &str, now_ms: u64) {
    r.work.state = Some(state.to_string());
    r.work.state_since_ms = Some(now_ms);
    r.work.attempts = Some(0);
    r.ttl = None;
}

/// The item of a key put into a state that had none: fence 0, `holder`, and no lease_id a
/// caller can send ([`NO_LEASE`]).
fn unleased(key: &str, holder: &str, now_ms: u64) -> Record {
    Record {
        holder: holder.to_string(),
        lease_id: LeaseId::from_string(NO_LEASE),
        acquired_at_ms: now_ms,
        min_hold_until_ms: now_ms,
        ..Record::key_only(key.to_string())
    }
}

/// Step 8a, a key put into a state without a lease: a new item gets fence 0, `holder` and no
/// lease_id a caller can send; free from now, entered now, no grants yet, the TTL `ttl` (a
/// terminal state) or none.
fn enter_update(x: &mut Expr, now_ms: u64, holder: &str, shard: &str, ttl: Option<u64>) {
    let now = x.v("now", num(now_ms));
    for (a, v) in [
        (attr::FENCE, x.v("zero", num(0))),
        (attr::HOLDER, x.v("holder", str_(holder))),
        (attr::LEASE_ID, x.v("no_lease", str_(NO_LEASE))),
        (attr::ACQUIRED_AT, now.clone()),
        (attr::MIN_HOLD_UNTIL, now.clone()),
    ] {
        let n = x.n(a);
        x.set(a, format!("if_not_exists({n}, {v})"));
    }
    x.set(attr::EXPIRES_AT, now.clone());
    x.set_value(attr::STATE_SHARD, str_(shard));
    x.set(attr::STATE_SINCE, now);
    let zero = x.v("zero", num(0));
    x.set(attr::ATTEMPTS, zero);
    x.set_or_remove(attr::TTL, ttl.map(num));
}
