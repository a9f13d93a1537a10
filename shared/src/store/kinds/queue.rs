//! Waiters (DESIGN.md, "The waiter queue", "In-process waiters"): the conditions and the
//! mutations of the waiter queue (enqueue, waiter items, grants to the head waiter, their
//! delivery, the queue index) and of in-process hand-overs, their reference semantics, and
//! their DynamoDB rendering, side by side.

use aws_sdk_dynamodb::types::AttributeValue;

use super::lease::{updated, NewLease};
use super::lease_item_head;
use crate::error::{Error, Result};
use crate::model::{LeaseId, Record};
use crate::store::dynamo::expr::{guard, id, Expr, Guard, Request};
use crate::store::dynamo::item::{num, str_, Item};
use crate::store::keys::{keepalive_shard, KEEPALIVE_SHARDS};
use crate::store::table::attr;

/// The conditions of waiting for a key. Semantics are defined by [`QueueCondition::holds`];
/// the DynamoDB text of each is in DESIGN.md, and a test renders each and compares.
#[derive(Debug, Clone, PartialEq)]
pub enum QueueCondition {
    /// A waiter may join the key's queue: the item exists and is held, or its queue is not
    /// empty (a free key with waiters belongs to the head waiter), the queue's last slot is
    /// not already `lease_id`'s (a retried enqueue whose first try landed finds its slot in the
    /// refused answer instead of taking a second one), and a new queue (no counters on the
    /// item) starts at `start`, above the item's fence: every grant that replaced the whole
    /// item had a fence above the last queue's tail (`Free`), so a new queue's numbers are above
    /// every earlier queue's on the key, and a waiter item of an earlier queue is never served
    /// by a later one. DynamoDB:
    /// `attribute_exists(fence) AND (attribute_not_exists(expires_at_ms) OR expires_at_ms > :now
    /// OR queue_tail > queue_head) AND (attribute_not_exists(queue_tail_lease_id) OR
    /// queue_tail_lease_id <> :lease_id OR queue_tail <= queue_head) AND (attribute_exists(queue_head)
    /// OR fence < :queue_start)`
    Queueable { now_ms: u64, lease_id: LeaseId, start: u64 },
    /// The key is free, still carries the lease read (`fence`), and its queue head is still
    /// `head`: the head waiter may be granted it, or skipped. DynamoDB:
    /// `fence = :expected_fence AND expires_at_ms <= :now AND queue_head = :queue_head`
    HandOver { fence: u64, now_ms: u64, head: u64 },
    /// The grant with `fence` is still marked undelivered to `token`: a retried invocation of
    /// the waiter's task may have moved the mark to its own token, and then a delivery to the
    /// old one (dead: `Gone`) neither revokes the grant nor removes the new mark. DynamoDB:
    /// `fence = :expected_fence AND pending_token = :expected_token`
    Undelivered { fence: u64, token: String },
    /// [`QueueCondition::Undelivered`], the grant not released: the mark of a grant delivered
    /// while live goes, but not by a write that lands after the lease was released (one held in
    /// the network would date the key's freeing, `freed_at_ms`, before the release: the mark
    /// stays, and whoever serves the ended grant removes it with its own clock). DynamoDB:
    /// `fence = :expected_fence AND pending_token = :expected_token AND attribute_not_exists(released_at_ms)`
    UndeliveredLive { fence: u64, token: String },
    /// The item is not a lease (a waiter item, or nothing). DynamoDB:
    /// `attribute_not_exists(fence) OR fence = :zero`
    NotLease,
    /// A waiter item may be written at `now_ms`: [`QueueCondition::NotLease`], and not written
    /// since by a later try (a retried invocation writes the waiter item of its slot again with
    /// its own task token; a write of an earlier try, held in the network, must not put the dead
    /// token back). DynamoDB: `(attribute_not_exists(fence) OR fence = :zero) AND
    /// (attribute_not_exists(renewed_at_ms) OR renewed_at_ms <= :now)`
    WaiterNewer { now_ms: u64 },
    /// The release of `lease_id` may hand the key straight to an in-process waiter of
    /// `coordinator`: the item is still that lease as read (`fence`), unreleased, past its
    /// min_hold, without queued waiters, in no work state (the grant replaces the whole item),
    /// and not marked by a waiter of another coordinator since it was read. DynamoDB: `fence =
    /// :expected_fence AND lease_id = :lease_id AND attribute_not_exists(released_at_ms) AND
    /// min_hold_until_ms <= :now AND (attribute_not_exists(queue_tail) OR queue_tail <=
    /// queue_head) AND attribute_not_exists(state_shard) AND (attribute_not_exists(awaited_by)
    /// OR awaited_by = :coordinator)`
    HandTo { lease_id: LeaseId, fence: u64, now_ms: u64, coordinator: String },
    /// [`LeaseCondition::Unreleased`](super::LeaseCondition::Unreleased) on a key without
    /// queued waiters: the release of a coordinator that serves queues (with waiters, the
    /// release grants the head waiter in its own write, [`QueueCondition::ReleaseHandOver`]).
    /// DynamoDB: `lease_id = :lease_id AND attribute_not_exists(released_at_ms) AND
    /// (attribute_not_exists(queue_tail) OR queue_tail <= queue_head)`
    Unqueued { lease_id: LeaseId },
    /// The release of `lease_id` that grants the key to the head waiter in the same write: the
    /// item is still that lease as read (`fence`), unreleased, past its min_hold, and its queue
    /// head is still `head`. DynamoDB: `fence = :expected_fence AND lease_id =
    /// :releasing_lease_id AND attribute_not_exists(released_at_ms) AND min_hold_until_ms <= :now
    /// AND queue_head = :expected_head`
    ReleaseHandOver { lease_id: LeaseId, fence: u64, now_ms: u64, head: u64 },
    /// The key has no queued waiter and no undelivered grant: it may leave the queue index.
    /// DynamoDB: `(attribute_not_exists(queue_tail) OR queue_tail <= queue_head) AND
    /// attribute_not_exists(pending_token)`
    QueueIdle,
}

/// The writes of waiting for a key. Semantics are defined by [`QueueMutation::apply`].
// Built once per write and passed by reference: boxing the grant's lease would add an
// allocation to every grant.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum QueueMutation {
    /// Join the queue: `queue_tail + 1` (a new queue starts both counters at `start`, the
    /// clock in µs), `queue_tail_at_ms = now`, `queue_tail_lease_id = lease_id`, and the key
    /// enters the queue index (`shard`). The new tail is the waiter's sequence number.
    Enqueue { now_ms: u64, start: u64, lease_id: LeaseId, shard: u32 },
    /// Write a whole waiter item (DynamoDB: a PutItem).
    PutWaiter(Box<Record>),
    /// Hand the free key to the head waiter: the lease of `lease` (fence included), the queue
    /// head moved to `seq`, and the grant marked undelivered with the waiter's task token.
    /// Queue tail and `queue_tail_at_ms` stay.
    Grant { lease: NewLease, seq: u64, token: String },
    /// The grant was delivered, or its lease ended: the undelivered mark goes, and `freed_at_ms
    /// = now` (the writer's clock): on an ended lease this write frees the key to plain
    /// acquires, and a fail-closed acquire sent before it must not take it.
    Delivered { now_ms: u64 },
    /// A grant whose delivery failed is marked undelivered with the waiter's task token (a
    /// queued acquire that found the key free), and the key enters the queue index (`shard`),
    /// where the sweep finds it to deliver it again.
    MarkUndelivered { token: String, shard: u32 },
    /// The grant's waiter is gone: the key is freed at once (expires_at = 0), released_at = now,
    /// the undelivered mark and keep-alive removed; the TTL set, or removed (`None`: a key in a
    /// work state is kept until it is taken).
    Revoke { now_ms: u64, ttl: Option<u64> },
    /// Pass over the head waiter (gone, timed out, or never written): `queue_head = seq`, and
    /// `freed_at_ms = now` (the last waiter passed over frees the key to plain acquires).
    Skip { seq: u64, now_ms: u64 },
    /// The key leaves the queue index: its queue is empty and no grant is undelivered.
    Unindex,
    /// A waiter of coordinator `coordinator` waits while another coordinator's line has the key:
    /// it marks the lease (`awaited_by = coordinator`), so the releaser leaves the key free for
    /// it.
    WaitsIn { coordinator: String },
}

impl QueueCondition {
    /// Reference semantics: does the condition hold for the current item (`None`: no item)?
    pub fn holds(&self, item: Option<&Record>) -> bool {
        let Some(r) = item else {
            return matches!(self, QueueCondition::NotLease | QueueCondition::WaiterNewer { .. });
        };
        let q = &r.queue;
        match self {
            QueueCondition::Queueable { now_ms, lease_id, start } => {
                (r.is_held(*now_ms) || r.queue_len() > 0)
                    && (q.queue_tail_lease_id.as_ref() != Some(lease_id) || r.queue_len() == 0)
                    && (q.queue_head.is_some() || r.fence < *start)
            }
            QueueCondition::HandOver { fence, now_ms, head } => {
                r.fence == *fence && matches!(r.expires_at_ms, Some(e) if e <= *now_ms) && q.queue_head == Some(*head)
            }
            QueueCondition::Undelivered { fence, token } => {
                r.fence == *fence && q.pending_token.as_ref() == Some(token)
            }
            QueueCondition::UndeliveredLive { fence, token } => {
                r.fence == *fence && q.pending_token.as_ref() == Some(token) && r.released_at_ms.is_none()
            }
            QueueCondition::NotLease => r.fence == 0,
            QueueCondition::WaiterNewer { now_ms } => r.fence == 0 && r.renewed_at_ms.is_none_or(|t| t <= *now_ms),
            QueueCondition::HandTo { lease_id, fence, now_ms, coordinator } => {
                r.fence == *fence
                    && &r.lease_id == lease_id
                    && r.released_at_ms.is_none()
                    && r.min_hold_until_ms <= *now_ms
                    && r.queue_len() == 0
                    && r.work.state.is_none()
                    && q.awaited_by.as_ref().is_none_or(|w| w == coordinator)
            }
            QueueCondition::Unqueued { lease_id } => {
                &r.lease_id == lease_id && r.released_at_ms.is_none() && r.queue_len() == 0
            }
            QueueCondition::ReleaseHandOver { lease_id, fence, now_ms, head } => {
                r.fence == *fence
                    && &r.lease_id == lease_id
                    && r.released_at_ms.is_none()
                    && r.min_hold_until_ms <= *now_ms
                    && q.queue_head == Some(*head)
            }
            QueueCondition::QueueIdle => r.queue_len() == 0 && q.pending_token.is_none(),
        }
    }

    /// The DynamoDB `ConditionExpression` (numbered as in `dynamo/render.rs`'s protocol).
    pub(in crate::store) fn guard(&self) -> Guard {
        match self {
            // Step 6a, enqueue: held, or with waiters ahead; and this lease_id's slot not already
            // taken (a retried enqueue finds its slot in the refused answer). A new queue starts
            // above the item's fence (`:queue_start`, the update's own value).
            QueueCondition::Queueable { now_ms, lease_id, start } => guard(
                "attribute_exists(fence) AND (attribute_not_exists(expires_at_ms) OR expires_at_ms > :now \
                 OR queue_tail > queue_head) AND (attribute_not_exists(queue_tail_lease_id) \
                 OR queue_tail_lease_id <> :lease_id OR queue_tail <= queue_head) \
                 AND (attribute_exists(queue_head) OR fence < :queue_start)",
                [("now", num(*now_ms)), ("lease_id", id(lease_id)), ("queue_start", num(*start))],
            ),
            // Step 6c, serve the head: free, the lease read, and the head still `head`: grant the
            // head waiter, or skip it.
            QueueCondition::HandOver { fence, now_ms, head } => guard(
                "fence = :expected_fence AND expires_at_ms <= :now AND queue_head = :expected_head",
                [("expected_fence", num(*fence)), ("now", num(*now_ms)), ("expected_head", num(*head))],
            ),
            // Step 6d, delivery: the grant is still marked undelivered, to this token.
            QueueCondition::Undelivered { fence, token } => guard(
                "fence = :expected_fence AND pending_token = :expected_token",
                [("expected_fence", num(*fence)), ("expected_token", str_(token))],
            ),
            // Step 6d, the same, not released: a delivered mark held in the network never frees a
            // released key.
            QueueCondition::UndeliveredLive { fence, token } => guard(
                "fence = :expected_fence AND pending_token = :expected_token AND attribute_not_exists(released_at_ms)",
                [("expected_fence", num(*fence)), ("expected_token", str_(token))],
            ),
            // Step 6b, a waiter item's removal: a waiter item, or nothing; never a lease.
            QueueCondition::NotLease => guard("attribute_not_exists(fence) OR fence = :zero", [("zero", num(0))]),
            // Step 6b, a waiter item (or nothing), not written since by a later try of its queued
            // acquire (a retried invocation's token is never overwritten by an earlier try's).
            QueueCondition::WaiterNewer { now_ms } => guard(
                "(attribute_not_exists(fence) OR fence = :zero) AND (attribute_not_exists(renewed_at_ms) OR renewed_at_ms <= :now)",
                [("zero", num(0)), ("now", num(*now_ms))],
            ),
            QueueCondition::HandTo { lease_id, fence, now_ms, coordinator } => hand_to(lease_id, *fence, *now_ms, coordinator),
            // Step 3, release with a queue: without queued waiters (with waiters, `ReleaseHandOver`
            // grants the head).
            QueueCondition::Unqueued { lease_id } => guard(
                "lease_id = :lease_id AND attribute_not_exists(released_at_ms) \
                 AND (attribute_not_exists(queue_tail) OR queue_tail <= queue_head)",
                [("lease_id", id(lease_id))],
            ),
            // Step 3, a release that grants the head waiter in its own write: the lease read,
            // unreleased, past its min_hold, the head unchanged. (The grant sets `lease_id` to
            // the waiter's `:lease_id`, so the releasing one has its own placeholder.)
            QueueCondition::ReleaseHandOver { lease_id, fence, now_ms, head } => guard(
                "fence = :expected_fence AND lease_id = :releasing_lease_id AND attribute_not_exists(released_at_ms) \
                 AND min_hold_until_ms <= :now AND queue_head = :expected_head",
                [
                    ("expected_fence", num(*fence)),
                    ("releasing_lease_id", id(lease_id)),
                    ("now", num(*now_ms)),
                    ("expected_head", num(*head)),
                ],
            ),
            // Step 6f, leave the queue index: no queued waiter and no undelivered grant.
            QueueCondition::QueueIdle => guard(
                "(attribute_not_exists(queue_tail) OR queue_tail <= queue_head) AND attribute_not_exists(pending_token)",
                [],
            ),
        }
    }
}

/// Step 7, a release straight to an in-process waiter: the lease read, unreleased, past its
/// min_hold, no queued waiters, no work state (the grant replaces the whole item), and no waiter
/// of another coordinator marked it since the read (the key goes free for it).
fn hand_to(lease_id: &LeaseId, fence: u64, now_ms: u64, coordinator: &str) -> Guard {
    guard(
        "fence = :expected_fence AND lease_id = :lease_id AND attribute_not_exists(released_at_ms) \
         AND min_hold_until_ms <= :now AND (attribute_not_exists(queue_tail) OR queue_tail <= queue_head) \
         AND attribute_not_exists(state_shard) \
         AND (attribute_not_exists(awaited_by) OR awaited_by = :coordinator)",
        [
            ("expected_fence", num(fence)),
            ("lease_id", id(lease_id)),
            ("now", num(now_ms)),
            ("coordinator", str_(coordinator)),
        ],
    )
}

impl QueueMutation {
    /// Reference semantics: the item after the write. `old` is the item the condition held for.
    pub fn apply(&self, key: &str, old: Option<&Record>) -> Record {
        match self {
            QueueMutation::PutWaiter(w) => (**w).clone(),
            QueueMutation::Enqueue { now_ms, start, lease_id, .. } => updated(old, |r| {
                let q = &mut r.queue;
                q.queue_head = Some(q.queue_head.unwrap_or(*start));
                q.queue_tail = Some(q.queue_tail.unwrap_or(*start) + 1);
                q.queue_tail_at_ms = Some(*now_ms);
                q.queue_tail_lease_id = Some(lease_id.clone());
            }),
            QueueMutation::Grant { lease, seq, token } => updated(old, |r| *r = granted(key, lease, *seq, token, r)),
            QueueMutation::Delivered { now_ms } => updated(old, |r| {
                r.queue.pending_token = None;
                r.queue.freed_at_ms = Some(*now_ms);
            }),
            QueueMutation::MarkUndelivered { token, .. } => {
                updated(old, |r| r.queue.pending_token = Some(token.clone()))
            }
            QueueMutation::Revoke { now_ms, ttl } => updated(old, |r| {
                r.expires_at_ms = Some(0);
                r.released_at_ms = Some(*now_ms);
                r.queue.pending_token = None;
                r.keepalive = None;
                r.ttl = *ttl;
            }),
            QueueMutation::Skip { seq, now_ms } => updated(old, |r| {
                r.queue.queue_head = Some(*seq);
                r.queue.freed_at_ms = Some(*now_ms);
            }),
            // The embedded store derives its queue index column from the record.
            QueueMutation::Unindex => updated(old, |_| {}),
            QueueMutation::WaitsIn { coordinator } => updated(old, |r| r.queue.awaited_by = Some(coordinator.clone())),
        }
    }

    /// The DynamoDB write: the whole item of a waiter, or the `UpdateExpression` of the others
    /// rendered into `x`.
    pub(in crate::store) fn render(&self, key: &str, x: &mut Expr) -> Result<Request> {
        match self {
            QueueMutation::PutWaiter(r) => return Ok(Request::Put(waiter_item(r)?, (**r).clone())),
            // Step 6a, a new queue starts both counters at `:queue_start`; the new tail is the
            // waiter's sequence number, and the key enters the queue index.
            QueueMutation::Enqueue { now_ms, start, lease_id, shard } => {
                let (qh, qt) = (x.n(attr::QUEUE_HEAD), x.n(attr::QUEUE_TAIL));
                let st = x.v("queue_start", num(*start));
                let one = x.v("one", num(1));
                x.set(attr::QUEUE_HEAD, format!("if_not_exists({qh}, {st})"));
                x.set(attr::QUEUE_TAIL, format!("if_not_exists({qt}, {st}) + {one}"));
                x.set_value(attr::QUEUE_TAIL_AT, num(*now_ms));
                // The condition's `:lease_id` is the same value.
                let lid = x.v("lease_id", id(lease_id));
                x.set(attr::QUEUE_TAIL_LEASE_ID, lid);
                x.set_value(attr::Q_SHARD, num(*shard as u64));
            }
            QueueMutation::Grant { lease, seq, token } => grant(x, key, lease, *seq, token),
            QueueMutation::Delivered { now_ms } => {
                x.set_value(attr::FREED_AT, num(*now_ms));
                x.remove(attr::PENDING_TOKEN);
            }
            QueueMutation::MarkUndelivered { token, shard } => {
                x.set_value(attr::PENDING_TOKEN, str_(token));
                x.set_value(attr::Q_SHARD, num(*shard as u64));
            }
            // Step 6d, the grant's waiter is gone: free at once, the undelivered mark gone.
            QueueMutation::Revoke { now_ms, ttl } => {
                x.set_value(attr::EXPIRES_AT, num(0));
                x.set_value(attr::RELEASED_AT, num(*now_ms));
                x.set_or_remove(attr::TTL, ttl.map(num));
                x.remove(attr::PENDING_TOKEN);
                x.remove_keepalive();
            }
            QueueMutation::Skip { seq, now_ms } => {
                x.set_value(attr::QUEUE_HEAD, num(*seq));
                x.set_value(attr::FREED_AT, num(*now_ms));
            }
            QueueMutation::Unindex => x.remove(attr::Q_SHARD),
            QueueMutation::WaitsIn { coordinator } => x.set_value(attr::AWAITED_BY, str_(coordinator)),
        }
        Ok(Request::Update)
    }
}

/// The head waiter's grant over `old`: the new lease, its queue head moved to `seq` and marked
/// undelivered; the queue tail and, as in an UpdateItem, a work state stay.
fn granted(key: &str, lease: &NewLease, seq: u64, token: &str, old: &Record) -> Record {
    let mut r = lease.record(key);
    let (q, o) = (&mut r.queue, &old.queue);
    q.queue_head = Some(seq);
    q.queue_tail = o.queue_tail;
    q.queue_tail_at_ms = o.queue_tail_at_ms;
    // An UpdateItem: the stamp stays (this lease ends by a release, an expiry or a revocation,
    // each dated on its own).
    q.freed_at_ms = o.freed_at_ms;
    q.queue_tail_lease_id = o.queue_tail_lease_id.clone();
    q.pending_token = Some(token.to_string());
    r.work = old.work.clone();
    r
}

/// Steps 6c and 3, the head waiter's grant: the new lease over the old one (an UpdateItem, so the
/// queue counters and a work state stay), its head moved to `seq`, marked undelivered.
fn grant(x: &mut Expr, key: &str, n: &NewLease, seq: u64, token: &str) {
    x.set_value(attr::FENCE, num(n.fence));
    x.set_value(attr::HOLDER, str_(&n.holder));
    x.set_value(attr::LEASE_ID, id(&n.lease_id));
    x.set_value(attr::ACQUIRED_AT, num(n.now_ms));
    x.set_value(attr::RENEWED_AT, num(n.now_ms));
    x.set_value(attr::MIN_HOLD_UNTIL, num(n.now_ms.saturating_add(n.min_hold_ms)));
    x.set_or_remove(attr::EXPIRES_AT, n.duration_ms.map(|d| num(n.now_ms.saturating_add(d))));
    x.set_or_remove(attr::DURATION, n.duration_ms.map(num));
    x.set_or_remove(attr::TTL, n.ttl.map(num));
    x.set_value(attr::QUEUE_HEAD, num(seq));
    x.set_value(attr::PENDING_TOKEN, str_(token));
    let metadata = n.metadata.as_ref().map(|m| AttributeValue::S(serde_json::Value::Object(m.clone()).to_string()));
    x.set_or_remove(attr::METADATA, metadata);
    match &n.keepalive {
        Some(k) => {
            x.set_value(attr::KA_SHARD, num(keepalive_shard(key, KEEPALIVE_SHARDS) as u64));
            x.set_value(attr::KA_UNTIL, num(k.until_ms));
            x.set_or_remove(attr::KA_EXECUTION_ARN, k.execution_arn.as_deref().map(str_));
        }
        None => x.remove_keepalive(),
    }
    x.set_or_remove(attr::RELEASED_LEASE_ID, n.released.as_ref().map(|r| id(&r.0)));
    x.set_or_remove(attr::RELEASED_FENCE, n.released.as_ref().map(|r| num(r.1)));
    x.remove(attr::RELEASED_AT);
    x.remove(attr::POLL);
}

/// A waiter item (DESIGN.md, "The waiter queue"): the waiter as one JSON attribute. It is in no
/// index: the sweep finds keys with waiters through the lease items (`q_shard`).
fn waiter_item(r: &Record) -> Result<Item> {
    let w = r.queue.waiter.as_ref().ok_or_else(|| Error::invalid("a waiter item needs a waiter"))?;
    let mut item = lease_item_head(r, 10);
    let mut put = |a: &str, v: AttributeValue| {
        item.insert(a.to_string(), v);
    };
    put(attr::EXPIRES_AT, num(r.expires_at_ms.unwrap_or(0)));
    // When this try wrote it (`WaiterNewer`).
    if let Some(t) = r.renewed_at_ms {
        put(attr::RENEWED_AT, num(t));
    }
    put(attr::WAITER, AttributeValue::S(serde_json::to_string(w).expect("waiter serialises")));
    Ok(item)
}
