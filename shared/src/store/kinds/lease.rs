//! The plain lease (DESIGN.md, "acquire", "heartbeat", "release", "force-release"): what an
//! acquire writes ([`NewLease`]), the conditions and the mutations of one lease's life, their
//! reference semantics, and their DynamoDB rendering, side by side.

use serde_json::{Map, Value};

use crate::model::{Keepalive, LeaseId, QueueFields, Record, WorkFields};
use crate::store::dynamo::expr::{guard, id, Expr, Guard, Request};
use crate::store::dynamo::item::{num, str_, Item};
use crate::store::keys::{keepalive_shard, KEEPALIVE_SHARDS};
use crate::store::table::attr;

/// Everything an acquire writes.
#[derive(Debug, Clone, PartialEq)]
pub struct NewLease {
    pub holder: String,
    pub lease_id: LeaseId,
    pub now_ms: u64,
    /// `None`: fail-closed.
    pub duration_ms: Option<u64>,
    pub min_hold_ms: u64,
    pub metadata: Option<Map<String, Value>>,
    pub keepalive: Option<Keepalive>,
    pub ttl: Option<u64>,
    /// The fence this lease carries, chosen by the coordinator: the current time in µs, or
    /// one more than the last fence it saw on the key if that is higher (see DESIGN.md).
    pub fence: u64,
    /// The key's poll period for waiters, when the key is contended (see `pacing`).
    pub poll_ms: Option<u64>,
    /// The work state the key stays in, with `attempts` counting this grant.
    pub visit: Option<Visit>,
    /// An in-process hand-over's grant: the releasing coordinator's id (see
    /// [`QueueFields::handed_in`]).
    pub handed_in: Option<String>,
    /// A hand-over: the released lease this grant replaces (its lease_id and fence), kept on the
    /// item so that a retried release of it answers `already_released`.
    pub released: Option<(LeaseId, u64)>,
}

/// One stay of a key in a work state: the state, its index partition (`state_shard`), when the
/// key entered it, and how many leases it has been granted since.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Visit {
    pub state: String,
    pub shard: String,
    pub since_ms: u64,
    pub attempts: u32,
}

impl Visit {
    /// The record's work-state fields of this visit.
    fn fields(&self) -> WorkFields {
        WorkFields {
            state: Some(self.state.clone()),
            state_since_ms: Some(self.since_ms),
            attempts: Some(self.attempts),
        }
    }
}

impl NewLease {
    /// The lease `lease_id` of `holder`, written at `now_ms` for `duration_ms` (none: held
    /// until released) at `fence`; no min_hold, metadata, keep-alive, TTL, poll hint, visit,
    /// hand-over or released lease: those the caller sets.
    pub fn new(holder: &str, lease_id: LeaseId, now_ms: u64, duration_ms: Option<u64>, fence: u64) -> NewLease {
        NewLease {
            holder: holder.to_string(),
            lease_id,
            now_ms,
            duration_ms,
            min_hold_ms: 0,
            metadata: None,
            keepalive: None,
            ttl: None,
            fence,
            poll_ms: None,
            visit: None,
            handed_in: None,
            released: None,
        }
    }

    /// The whole item an acquire writes for `key`: nothing of the previous lease survives.
    pub fn record(&self, key: &str) -> Record {
        Record {
            key: key.to_string(),
            fence: self.fence,
            holder: self.holder.clone(),
            lease_id: self.lease_id.clone(),
            acquired_at_ms: self.now_ms,
            expires_at_ms: self.duration_ms.map(|d| self.now_ms.saturating_add(d)),
            duration_ms: self.duration_ms,
            min_hold_until_ms: self.now_ms.saturating_add(self.min_hold_ms),
            released_at_ms: None,
            metadata: self.metadata.clone(),
            keepalive: self.keepalive.clone(),
            ttl: self.ttl,
            renewed_at_ms: Some(self.now_ms),
            poll_ms: self.poll_ms,
            queue: QueueFields {
                handed_in: self.handed_in.clone(),
                released_lease_id: self.released.as_ref().map(|r| r.0.clone()),
                released_fence: self.released.as_ref().map(|r| r.1),
                ..QueueFields::default()
            },
            work: self.visit.as_ref().map(Visit::fields).unwrap_or_default(),
            semaphore: Default::default(),
        }
    }
}

/// The conditions of one lease's life: acquire, heartbeat, release. Semantics are defined by
/// [`LeaseCondition::holds`]; the DynamoDB text of each is in DESIGN.md, and a test renders
/// each and compares.
#[derive(Debug, Clone, PartialEq)]
pub enum LeaseCondition {
    /// The key can be taken with fence `fence` by `lease_id`: no item, or an item whose expiry
    /// is present and `<= now_ms`, whose last fence is below `fence`, whose last lease is not
    /// `lease_id` (a lease_id is single-use: once its lease ended it is never granted again),
    /// without queued waiters (a free key with waiters belongs to the head waiter), without a
    /// grant still marked undelivered (its waiter is told before the key moves on), and which is
    /// in no work state (a key in a state is taken with
    /// [`WorkCondition::FreeIn`](super::WorkCondition::FreeIn), which keeps its state).
    /// DynamoDB: `attribute_not_exists(fence) OR (expires_at_ms <= :now AND fence < :fence AND
    /// lease_id <> :lease_id AND (attribute_not_exists(queue_tail) OR (queue_tail <= queue_head
    /// AND queue_tail < :fence)) AND attribute_not_exists(state_shard) AND
    /// attribute_not_exists(pending_token))` (every item has a fence; the last queue's tail
    /// stays below every later fence, so that a new queue starts above it, see `Queueable`)
    Free { now_ms: u64, fence: u64, lease_id: LeaseId },
    /// [`LeaseCondition::Free`] for a fail-closed acquire (no expiry: a lease nobody knows of
    /// would hold the key until an operator frees it), which also requires that the key was not
    /// released after `now_ms`, nor freed after it by a queue write (`freed_at_ms`: the
    /// undelivered mark of an ended grant removed, the last waiter passed over): an attempt
    /// held in the network never takes a key freed after it was sent (its caller may have
    /// given up on it). (A revocation stamps `released_at_ms`.) DynamoDB:
    /// `attribute_not_exists(fence) OR (expires_at_ms <= :now AND (attribute_not_exists(released_at_ms)
    /// OR released_at_ms <= :now) AND (attribute_not_exists(freed_at_ms) OR freed_at_ms <= :now) AND fence < :fence AND lease_id <> :lease_id AND
    /// (attribute_not_exists(queue_tail) OR queue_tail <= queue_head) AND
    /// attribute_not_exists(state_shard) AND attribute_not_exists(pending_token))`
    FreeAfter { now_ms: u64, fence: u64, lease_id: LeaseId },
    /// `lease_id` holds the key and this renewal is newer than the last one: same lease_id, not
    /// released, no expiry or expiry `> now_ms`, and no renewal at or after `now_ms` (a delayed
    /// duplicate of a heartbeat whose retry already landed is refused). With `expires_at_ms`
    /// (a heartbeat naming its duration) the current expiry must not be later than the new one;
    /// without (extend by the stored duration) the lease must have a stored duration. Either
    /// way the expiry never moves backwards. With `ttl` (the renewal writes a TTL) the item must
    /// be in no work state: a key in a state keeps no TTL, and its renewal is sent without one
    /// (removing any), so that no renewal, answered or not, leaves a TTL on it.
    /// DynamoDB: `lease_id = :lease_id AND attribute_not_exists(released_at_ms) AND
    /// (attribute_not_exists(expires_at_ms) OR expires_at_ms > :now) AND
    /// (attribute_not_exists(renewed_at_ms) OR renewed_at_ms < :now) AND`
    /// `(attribute_not_exists(expires_at_ms) OR expires_at_ms <= :expires_at)` |
    /// `attribute_exists(duration_ms)`, and with `ttl` ` AND attribute_not_exists(state_shard)`
    Renew { lease_id: LeaseId, now_ms: u64, expires_at_ms: Option<u64>, ttl: bool },
    /// The item carries `lease_id` and has not been released (a release or force-release
    /// already ended it). DynamoDB: `lease_id = :lease_id AND attribute_not_exists(released_at_ms)`
    Unreleased { lease_id: LeaseId },
    /// `lease_id` holds the key right now: same lease_id, not released, no expiry or expiry
    /// `> now_ms` (a state change is the live holder's alone). DynamoDB: `lease_id = :lease_id
    /// AND attribute_not_exists(released_at_ms) AND (attribute_not_exists(expires_at_ms) OR
    /// expires_at_ms > :now)`
    Live { lease_id: LeaseId, now_ms: u64 },
}

/// The writes of one lease's life. Semantics are defined by [`LeaseMutation::apply`].
// Built once per write and passed by reference: boxing the new lease would add an allocation to
// every acquire.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum LeaseMutation {
    /// Take the key: the whole item is replaced by the new lease (DynamoDB: one PutItem).
    Acquire(NewLease),
    /// Extend a live lease: expires_at = now + (duration, or the stored duration_ms),
    /// renewed_at = now. A given duration replaces the stored one.
    Extend { now_ms: u64, duration_ms: Option<u64>, ttl: Option<u64> },
    /// Release: expires_at = min_hold_until (never earlier than acquired_at + min_hold),
    /// released_at = now, keep-alive removed. Fence, holder and lease_id stay.
    Release { now_ms: u64, ttl: u64 },
    /// Operator release: fence + 1, expires_at = 0 (free at once, min_hold ignored),
    /// released_at = now, keep-alive removed.
    ForceRelease { now_ms: u64, ttl: u64 },
}

impl LeaseCondition {
    /// Reference semantics: does the condition hold for the current item (`None`: no item)?
    pub fn holds(&self, item: Option<&Record>) -> bool {
        let Some(r) = item else {
            return matches!(self, LeaseCondition::Free { .. } | LeaseCondition::FreeAfter { .. });
        };
        match self {
            LeaseCondition::Free { now_ms, fence, lease_id } => free(r, *now_ms, *fence, lease_id),
            LeaseCondition::FreeAfter { now_ms, fence, lease_id } => {
                r.released_at_ms.is_none_or(|t| t <= *now_ms)
                    && r.queue.freed_at_ms.is_none_or(|t| t <= *now_ms)
                    && free(r, *now_ms, *fence, lease_id)
            }
            LeaseCondition::Renew { lease_id, now_ms, expires_at_ms, ttl } => {
                r.is_live_for(lease_id, *now_ms)
                    && (!ttl || r.work.state.is_none())
                    && r.renewed_at_ms.is_none_or(|t| t < *now_ms)
                    && match expires_at_ms {
                        Some(new) => r.expires_at_ms.is_none_or(|e| e <= *new),
                        None => r.duration_ms.is_some(),
                    }
            }
            LeaseCondition::Unreleased { lease_id } => &r.lease_id == lease_id && r.released_at_ms.is_none(),
            LeaseCondition::Live { lease_id, now_ms } => r.is_live_for(lease_id, *now_ms),
        }
    }

    /// The DynamoDB `ConditionExpression` (numbered as in `dynamo/render.rs`'s protocol).
    pub(in crate::store) fn guard(&self) -> Guard {
        match self {
            // Step 1, acquire: no item (every item has a fence), or one that expired, with a lower
            // fence and another lease_id, no queued waiter, no work state and no undelivered
            // grant.
            LeaseCondition::Free { now_ms, fence, lease_id } => guard(
                "attribute_not_exists(fence) OR (expires_at_ms <= :now AND (attribute_not_exists(freed_at_ms) \
                 OR freed_at_ms <= :now) AND fence < :fence AND lease_id <> :lease_id \
                 AND (attribute_not_exists(queue_tail) OR (queue_tail <= queue_head AND queue_tail < :fence)) \
                 AND attribute_not_exists(state_shard) AND attribute_not_exists(pending_token))",
                [("now", num(*now_ms)), ("fence", num(*fence)), ("lease_id", id(lease_id))],
            ),
            // Step 1, a fail-closed acquire: also not released, nor freed by a queue write, after
            // this attempt's clock (a stale attempt never takes a key freed after it was sent).
            LeaseCondition::FreeAfter { now_ms, fence, lease_id } => guard(
                "attribute_not_exists(fence) OR (expires_at_ms <= :now AND (attribute_not_exists(released_at_ms) \
                 OR released_at_ms <= :now) AND (attribute_not_exists(freed_at_ms) OR freed_at_ms <= :now) AND fence < :fence AND lease_id <> :lease_id \
                 AND (attribute_not_exists(queue_tail) OR (queue_tail <= queue_head AND queue_tail < :fence)) \
                 AND attribute_not_exists(state_shard) AND attribute_not_exists(pending_token))",
                [("now", num(*now_ms)), ("fence", num(*fence)), ("lease_id", id(lease_id))],
            ),
            LeaseCondition::Renew { lease_id, now_ms, expires_at_ms, ttl } => renew_guard(lease_id, *now_ms, *expires_at_ms, *ttl),
            // Step 3, release: a release or force-release already ended it otherwise.
            LeaseCondition::Unreleased { lease_id } => {
                guard("lease_id = :lease_id AND attribute_not_exists(released_at_ms)", [("lease_id", id(lease_id))])
            }
            // Steps 3 and 8c, release into a work state: a state change is the live holder's alone.
            LeaseCondition::Live { lease_id, now_ms } => guard(
                "lease_id = :lease_id AND attribute_not_exists(released_at_ms) AND (attribute_not_exists(expires_at_ms) \
                 OR expires_at_ms > :now)",
                [("lease_id", id(lease_id)), ("now", num(*now_ms))],
            ),
        }
    }
}

/// [`LeaseCondition::Free`] on an existing item.
fn free(r: &Record, now_ms: u64, fence: u64, lease_id: &LeaseId) -> bool {
    matches!(r.expires_at_ms, Some(e) if e <= now_ms)
        && r.queue.freed_at_ms.is_none_or(|t| t <= now_ms)
        && r.fence < fence
        && &r.lease_id != lease_id
        && r.queue_len() == 0
        && r.queue.queue_tail.is_none_or(|t| t < fence)
        && r.work.state.is_none()
        && r.queue.pending_token.is_none()
}

/// Step 2, heartbeat: this lease, live, and this renewal newer than the last one; the expiry never
/// moves backwards (a given expiry), or the lease has a stored duration to extend by. With a
/// TTL, only on a key in no work state (a key in a state keeps none: its renewal is sent
/// without one, and removes any).
fn renew_guard(lease_id: &LeaseId, now_ms: u64, expires_at_ms: Option<u64>, ttl: bool) -> Guard {
    match (expires_at_ms, ttl) {
        (Some(x), true) => guard(
            "lease_id = :lease_id AND attribute_not_exists(released_at_ms) AND (attribute_not_exists(expires_at_ms) \
             OR expires_at_ms > :now) AND (attribute_not_exists(renewed_at_ms) OR renewed_at_ms < :now) \
             AND (attribute_not_exists(expires_at_ms) OR expires_at_ms <= :expires_at) \
             AND attribute_not_exists(state_shard)",
            [("lease_id", id(lease_id)), ("now", num(now_ms)), ("expires_at", num(x))],
        ),
        (Some(x), false) => guard(
            "lease_id = :lease_id AND attribute_not_exists(released_at_ms) AND (attribute_not_exists(expires_at_ms) \
             OR expires_at_ms > :now) AND (attribute_not_exists(renewed_at_ms) OR renewed_at_ms < :now) \
             AND (attribute_not_exists(expires_at_ms) OR expires_at_ms <= :expires_at)",
            [("lease_id", id(lease_id)), ("now", num(now_ms)), ("expires_at", num(x))],
        ),
        (None, true) => guard(
            "lease_id = :lease_id AND attribute_not_exists(released_at_ms) AND (attribute_not_exists(expires_at_ms) \
             OR expires_at_ms > :now) AND (attribute_not_exists(renewed_at_ms) OR renewed_at_ms < :now) \
             AND attribute_exists(duration_ms) AND attribute_not_exists(state_shard)",
            [("lease_id", id(lease_id)), ("now", num(now_ms))],
        ),
        (None, false) => guard(
            "lease_id = :lease_id AND attribute_not_exists(released_at_ms) AND (attribute_not_exists(expires_at_ms) \
             OR expires_at_ms > :now) AND (attribute_not_exists(renewed_at_ms) OR renewed_at_ms < :now) \
             AND attribute_exists(duration_ms)",
            [("lease_id", id(lease_id)), ("now", num(now_ms))],
        ),
    }
}

impl LeaseMutation {
    /// Reference semantics: the item after the write. `old` is the item the condition held for.
    pub fn apply(&self, key: &str, old: Option<&Record>) -> Record {
        match self {
            LeaseMutation::Acquire(n) => n.record(key),
            LeaseMutation::Extend { now_ms, duration_ms, ttl } => updated(old, |r| {
                let d = duration_ms.or(r.duration_ms).expect("extend needs a duration");
                r.expires_at_ms = Some(now_ms.saturating_add(d));
                r.duration_ms = Some(d);
                r.renewed_at_ms = Some(*now_ms);
                r.ttl = *ttl;
            }),
            LeaseMutation::Release { now_ms, ttl } => updated(old, |r| {
                release(r, *now_ms);
                r.ttl = Some(*ttl);
            }),
            LeaseMutation::ForceRelease { now_ms, ttl } => updated(old, |r| {
                r.fence = r.fence.saturating_add(1);
                r.expires_at_ms = Some(0);
                r.released_at_ms = Some(*now_ms);
                r.keepalive = None;
                r.ttl = Some(*ttl);
            }),
        }
    }

    /// The DynamoDB write: the whole item of an acquire, or the `UpdateExpression` of the
    /// others rendered into `x`.
    pub(in crate::store) fn render(&self, key: &str, x: &mut Expr) -> Request {
        match self {
            LeaseMutation::Acquire(n) => return Request::Put(lease_item(key, n), n.record(key)),
            // Step 2, heartbeat: `SET expires_at_ms = :expires_at_ms, duration_ms = :duration_ms,
            // ...` with a duration; by the stored one `SET expires_at_ms = duration_ms +
            // :now_ext, ...`.
            LeaseMutation::Extend { now_ms, duration_ms, ttl } => {
                match duration_ms {
                    Some(d) => {
                        x.set_value(attr::EXPIRES_AT, num(now_ms + d));
                        x.set_value(attr::DURATION, num(*d));
                    }
                    None => {
                        let d = x.n(attr::DURATION);
                        let now = x.v("now_ext", num(*now_ms));
                        x.set(attr::EXPIRES_AT, format!("{d} + {now}"));
                    }
                }
                x.set_value(attr::RENEWED_AT, num(*now_ms));
                x.set_or_remove(attr::TTL, ttl.map(num));
            }
            // Step 3, release: free at min_hold_until; fence, holder and lease_id stay.
            LeaseMutation::Release { now_ms, ttl } => {
                let mh = x.n(attr::MIN_HOLD_UNTIL);
                x.set(attr::EXPIRES_AT, mh);
                x.set_value(attr::RELEASED_AT, num(*now_ms));
                x.set_value(attr::TTL, num(*ttl));
                x.remove_keepalive();
            }
            // Step 4, force-release: free at once, with a fence the evicted holder's writes are
            // refused against.
            LeaseMutation::ForceRelease { now_ms, ttl } => {
                let f = x.n(attr::FENCE);
                let one = x.v("one", num(1));
                x.set(attr::FENCE, format!("{f} + {one}"));
                x.set_value(attr::EXPIRES_AT, num(0));
                x.set_value(attr::RELEASED_AT, num(*now_ms));
                x.set_value(attr::TTL, num(*ttl));
                x.remove_keepalive();
            }
        }
        Request::Update
    }
}

/// An update of the existing item `old` (every update's condition requires one) by `f`.
pub(in crate::store) fn updated(old: Option<&Record>, f: impl FnOnce(&mut Record)) -> Record {
    let mut r = old.expect("an update applies to an existing item").clone();
    f(&mut r);
    r
}

/// A release: free at min_hold_until, released now, keep-alive removed; fence, holder and
/// lease_id stay.
pub(in crate::store) fn release(r: &mut Record, now_ms: u64) {
    r.expires_at_ms = Some(r.min_hold_until_ms);
    r.released_at_ms = Some(now_ms);
    r.keepalive = None;
}

/// The item an acquire writes: the whole lease, nothing of the previous one.
fn lease_item(key: &str, n: &NewLease) -> Item {
    let mut item = Item::with_capacity(12);
    let mut put = |a: &str, v: aws_sdk_dynamodb::types::AttributeValue| {
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
        put(attr::METADATA, aws_sdk_dynamodb::types::AttributeValue::S(Value::Object(m.clone()).to_string()));
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
