//! The protocol's writes as DynamoDB expressions: [`Condition`] into a `ConditionExpression`,
//! [`Mutation`] into an `UpdateExpression`, with their attribute names and values. Pure text,
//! no request: this file can be read against DESIGN.md without the SDK calls around it, and a
//! test checks that DESIGN.md prints every expression rendered here, word for word.
//!
//! Each condition is written below exactly as DESIGN.md prints it, beside the reason it
//! guards. Where a lease's writes come from (DESIGN.md sections):
//! 1. acquire (PutItem of the whole lease, `item::lease_item`): [`Condition::Free`];
//! 2. heartbeat: [`Condition::Renew`] + [`Mutation::Extend`];
//! 3. release: [`Condition::Unreleased`] + [`Mutation::Release`]; with a waiter queue,
//!    [`Condition::Unqueued`], or [`Condition::ReleaseHandOver`] + [`Mutation::Grant`];
//! 4. force-release: [`Condition::Exists`] + [`Mutation::ForceRelease`];
//! 5. keep-alive sweep: [`Condition::FenceAndExpiry`] / [`Condition::FenceIs`] +
//!    [`Mutation::ClearKeepalive`];
//! 6. the waiter queue: [`Condition::Queueable`] + [`Mutation::Enqueue`], [`Condition::NotLease`]
//!    (waiter items), [`Condition::HandOver`] + [`Mutation::Grant`] / [`Mutation::Skip`],
//!    [`Condition::Undelivered`] + [`Mutation::Delivered`] / [`Mutation::Revoke`],
//!    [`Condition::FenceIs`] + [`Mutation::MarkUndelivered`], [`Condition::QueueIdle`] +
//!    [`Mutation::Unindex`];
//! 7. in-process waiters: [`Condition::HandTo`], [`Condition::FenceIs`] + [`Mutation::WaitsIn`];
//! 8. work states: [`Condition::Enterable`] + [`Mutation::Enter`], [`Condition::FreeIn`]
//!    (PutItem), [`Condition::Live`] + [`Mutation::ReleaseTo`], [`Condition::FenceIs`] +
//!    [`Mutation::ClearTtl`].

use std::collections::HashMap;

use aws_sdk_dynamodb::types::AttributeValue;

use super::attr;
use super::item::{num, str_};
use crate::store::{keepalive_shard, Condition, Mutation, NewLease, KEEPALIVE_SHARDS, NO_LEASE};

/// A condition as DESIGN.md prints it: attribute names as they are (the reserved words through
/// `#name` aliases, see `attr::RESERVED`), and `:name` placeholders with their values.
struct Guard {
    text: &'static str,
    values: Vec<(&'static str, AttributeValue)>,
    /// Aliases whose name is not the alias itself: `#lease_id`, a semaphore holder's key in
    /// the `sem_holders` map.
    names: Vec<(&'static str, String)>,
}

fn guard(text: &'static str, values: impl IntoIterator<Item = (&'static str, AttributeValue)>) -> Guard {
    Guard { text, values: values.into_iter().collect(), names: Vec::new() }
}

/// A guard on the semaphore holder `lease_id`'s entry (`sem_holders.#lease_id`).
fn slot_guard(
    text: &'static str,
    lease_id: &crate::model::LeaseId,
    values: impl IntoIterator<Item = (&'static str, AttributeValue)>,
) -> Guard {
    Guard { names: vec![("lease_id", lease_id.expose().to_string())], ..guard(text, values) }
}

fn id(lease_id: &crate::model::LeaseId) -> AttributeValue {
    str_(lease_id.expose())
}

/// The condition's expression, by the part of the protocol it belongs to.
fn condition_guard(c: &Condition) -> Guard {
    use Condition::*;
    match c {
        Free { .. } | FreeAfter { .. } | Renew { .. } | Unreleased { .. } | Exists | Live { .. } => lease_guard(c),
        FenceIs(_) | FenceAndExpiry { .. } | NotLease => read_guard(c),
        WaiterNewer { .. } => queue_guard(c),
        Queueable { .. }
        | HandOver { .. }
        | Undelivered { .. }
        | UndeliveredLive { .. }
        | Unqueued { .. }
        | ReleaseHandOver { .. }
        | QueueIdle
        | HandTo { .. } => queue_guard(c),
        FreeIn { .. } | Enterable { .. } => state_guard(c),
        SlotFree { .. } | SlotsAsRead { .. } | SlotRenew { .. } | SlotUnreleased { .. } => semaphore_guard(c),
    }
}

/// The conditions of a semaphore's writes (DESIGN.md, "Semaphores").
fn semaphore_guard(c: &Condition) -> Guard {
    match c {
        // A semaphore with fewer than N holders counted, a lower last fence, and no entry of
        // this lease_id (single-use; a retry finds its entry in the refused answer).
        Condition::SlotFree { fence, lease_id, slots } => slot_guard(
            "attribute_exists(sem_slots) AND sem_taken < :slots AND fence < :fence \
             AND attribute_not_exists(sem_holders.#lease_id)",
            lease_id,
            [("slots", num(*slots as u64)), ("fence", num(*fence))],
        ),
        // The item as read: cleaning, tidying and evicting count what they read.
        Condition::SlotsAsRead { rev } => guard("sem_rev = :expected_rev", [("expected_rev", num(*rev))]),
        // This holder live, this renewal newer, the expiry never backwards.
        Condition::SlotRenew { lease_id, now_ms, expires_at_ms } => slot_guard(
            "sem_holders.#lease_id.expires_at_ms > :now AND attribute_not_exists(sem_holders.#lease_id.released_at_ms) \
             AND sem_holders.#lease_id.renewed_at_ms < :now AND sem_holders.#lease_id.expires_at_ms <= :expires_at",
            lease_id,
            [("now", num(*now_ms)), ("expires_at", num(*expires_at_ms))],
        ),
        // This holder's entry, not released yet (a retried release finds it released).
        Condition::SlotUnreleased { lease_id } => slot_guard(
            "attribute_exists(sem_holders.#lease_id) AND attribute_not_exists(sem_holders.#lease_id.released_at_ms)",
            lease_id,
            [],
        ),
        _ => unreachable!("not a semaphore condition: {c:?}"),
    }
}

/// The conditions of one lease's life: acquire, heartbeat, release, force-release.
fn lease_guard(c: &Condition) -> Guard {
    match c {
        // No item (every item has a fence), or one that expired, with a lower fence and another
        // lease_id, no queued waiter, no work state and no undelivered grant.
        Condition::Free { now_ms, fence, lease_id } => guard(
            "attribute_not_exists(fence) OR (expires_at_ms <= :now AND (attribute_not_exists(freed_at_ms) \
             OR freed_at_ms <= :now) AND fence < :fence AND lease_id <> :lease_id \
             AND (attribute_not_exists(queue_tail) OR (queue_tail <= queue_head AND queue_tail < :fence)) \
             AND attribute_not_exists(state_shard) AND attribute_not_exists(pending_token))",
            [("now", num(*now_ms)), ("fence", num(*fence)), ("lease_id", id(lease_id))],
        ),
        // A fail-closed acquire: also not released, nor freed by a queue write, after this
        // attempt's clock (a stale attempt never takes a key freed after it was sent).
        Condition::FreeAfter { now_ms, fence, lease_id } => guard(
            "attribute_not_exists(fence) OR (expires_at_ms <= :now AND (attribute_not_exists(released_at_ms) \
             OR released_at_ms <= :now) AND (attribute_not_exists(freed_at_ms) OR freed_at_ms <= :now) AND fence < :fence AND lease_id <> :lease_id \
             AND (attribute_not_exists(queue_tail) OR (queue_tail <= queue_head AND queue_tail < :fence)) \
             AND attribute_not_exists(state_shard) AND attribute_not_exists(pending_token))",
            [("now", num(*now_ms)), ("fence", num(*fence)), ("lease_id", id(lease_id))],
        ),
        // This lease, live, and this renewal newer than the last one; the expiry never moves
        // backwards (a given expiry), or the lease has a stored duration to extend by.
        // With a TTL, only on a key in no work state (a key in a state keeps none: its renewal
        // is sent without one, and removes any).
        Condition::Renew { lease_id, now_ms, expires_at_ms: Some(x), ttl: true } => guard(
            "lease_id = :lease_id AND attribute_not_exists(released_at_ms) AND (attribute_not_exists(expires_at_ms) \
             OR expires_at_ms > :now) AND (attribute_not_exists(renewed_at_ms) OR renewed_at_ms < :now) \
             AND (attribute_not_exists(expires_at_ms) OR expires_at_ms <= :expires_at) \
             AND attribute_not_exists(state_shard)",
            [("lease_id", id(lease_id)), ("now", num(*now_ms)), ("expires_at", num(*x))],
        ),
        Condition::Renew { lease_id, now_ms, expires_at_ms: Some(x), ttl: false } => guard(
            "lease_id = :lease_id AND attribute_not_exists(released_at_ms) AND (attribute_not_exists(expires_at_ms) \
             OR expires_at_ms > :now) AND (attribute_not_exists(renewed_at_ms) OR renewed_at_ms < :now) \
             AND (attribute_not_exists(expires_at_ms) OR expires_at_ms <= :expires_at)",
            [("lease_id", id(lease_id)), ("now", num(*now_ms)), ("expires_at", num(*x))],
        ),
        Condition::Renew { lease_id, now_ms, expires_at_ms: None, ttl: true } => guard(
            "lease_id = :lease_id AND attribute_not_exists(released_at_ms) AND (attribute_not_exists(expires_at_ms) \
             OR expires_at_ms > :now) AND (attribute_not_exists(renewed_at_ms) OR renewed_at_ms < :now) \
             AND attribute_exists(duration_ms) AND attribute_not_exists(state_shard)",
            [("lease_id", id(lease_id)), ("now", num(*now_ms))],
        ),
        Condition::Renew { lease_id, now_ms, expires_at_ms: None, ttl: false } => guard(
            "lease_id = :lease_id AND attribute_not_exists(released_at_ms) AND (attribute_not_exists(expires_at_ms) \
             OR expires_at_ms > :now) AND (attribute_not_exists(renewed_at_ms) OR renewed_at_ms < :now) \
             AND attribute_exists(duration_ms)",
            [("lease_id", id(lease_id)), ("now", num(*now_ms))],
        ),
        // A release or force-release already ended it otherwise.
        Condition::Unreleased { lease_id } => {
            guard("lease_id = :lease_id AND attribute_not_exists(released_at_ms)", [("lease_id", id(lease_id))])
        }
        // An operator's force-release: any item.
        Condition::Exists => guard("attribute_exists(#key)", []),
        // A state change is the live holder's alone.
        Condition::Live { lease_id, now_ms } => guard(
            "lease_id = :lease_id AND attribute_not_exists(released_at_ms) AND (attribute_not_exists(expires_at_ms) \
             OR expires_at_ms > :now)",
            [("lease_id", id(lease_id)), ("now", num(*now_ms))],
        ),
        _ => unreachable!("not a lease condition: {c:?}"),
    }
}

/// The conditions that the item is still what a sweep read.
fn read_guard(c: &Condition) -> Guard {
    match c {
        // The same lease as read: every grant and force-release changes the fence.
        Condition::FenceIs(f) => guard("fence = :expected_fence", [("expected_fence", num(*f))]),
        // The lease the keep-alive index showed, not renewed since (a renewal moves the expiry).
        Condition::FenceAndExpiry { fence, expires_at_ms: Some(e) } => guard(
            "fence = :expected_fence AND expires_at_ms = :expected_expiry",
            [("expected_fence", num(*fence)), ("expected_expiry", num(*e))],
        ),
        Condition::FenceAndExpiry { fence, expires_at_ms: None } => {
            guard("fence = :expected_fence AND attribute_not_exists(expires_at_ms)", [("expected_fence", num(*fence))])
        }
        // A waiter item, or nothing: never a lease.
        Condition::NotLease => guard("attribute_not_exists(fence) OR fence = :zero", [("zero", num(0))]),
        _ => unreachable!("not a read condition: {c:?}"),
    }
}

/// The conditions of the waiter queue and of in-process hand-overs.
fn queue_guard(c: &Condition) -> Guard {
    match c {
        // A waiter item (or nothing), not written since by a later try of its queued acquire
        // (a retried invocation's token is never overwritten by an earlier try's).
        Condition::WaiterNewer { now_ms } => guard(
            "(attribute_not_exists(fence) OR fence = :zero) AND (attribute_not_exists(renewed_at_ms) OR renewed_at_ms <= :now)",
            [("zero", num(0)), ("now", num(*now_ms))],
        ),
        // Held, or with waiters ahead; and this lease_id's slot not already taken (a retried
        // enqueue finds its slot in the refused answer).
        // A new queue starts above the item's fence (`:queue_start`, the update's own value).
        Condition::Queueable { now_ms, lease_id, start } => guard(
            "attribute_exists(fence) AND (attribute_not_exists(expires_at_ms) OR expires_at_ms > :now \
             OR queue_tail > queue_head) AND (attribute_not_exists(queue_tail_lease_id) \
             OR queue_tail_lease_id <> :lease_id OR queue_tail <= queue_head) \
             AND (attribute_exists(queue_head) OR fence < :queue_start)",
            [("now", num(*now_ms)), ("lease_id", id(lease_id)), ("queue_start", num(*start))],
        ),
        // Free, the lease read, and the head still `head`: grant the head waiter, or skip it.
        Condition::HandOver { fence, now_ms, head } => guard(
            "fence = :expected_fence AND expires_at_ms <= :now AND queue_head = :expected_head",
            [("expected_fence", num(*fence)), ("now", num(*now_ms)), ("expected_head", num(*head))],
        ),
        // The grant is still marked undelivered, to this token.
        Condition::Undelivered { fence, token } => guard(
            "fence = :expected_fence AND pending_token = :expected_token",
            [("expected_fence", num(*fence)), ("expected_token", str_(token))],
        ),
        // The same, not released: a delivered mark held in the network never frees a released key.
        Condition::UndeliveredLive { fence, token } => guard(
            "fence = :expected_fence AND pending_token = :expected_token AND attribute_not_exists(released_at_ms)",
            [("expected_fence", num(*fence)), ("expected_token", str_(token))],
        ),
        // A release without queued waiters (with waiters, `ReleaseHandOver` grants the head).
        Condition::Unqueued { lease_id } => guard(
            "lease_id = :lease_id AND attribute_not_exists(released_at_ms) \
             AND (attribute_not_exists(queue_tail) OR queue_tail <= queue_head)",
            [("lease_id", id(lease_id))],
        ),
        // A release that grants the head waiter in its own write: the lease read, unreleased,
        // past its min_hold, the head unchanged. (The grant sets `lease_id` to the waiter's
        // `:lease_id`, so the releasing one has its own placeholder.)
        Condition::ReleaseHandOver { lease_id, fence, now_ms, head } => guard(
            "fence = :expected_fence AND lease_id = :releasing_lease_id AND attribute_not_exists(released_at_ms) \
             AND min_hold_until_ms <= :now AND queue_head = :expected_head",
            [
                ("expected_fence", num(*fence)),
                ("releasing_lease_id", id(lease_id)),
                ("now", num(*now_ms)),
                ("expected_head", num(*head)),
            ],
        ),
        // No queued waiter and no undelivered grant: the key may leave the queue index.
        Condition::QueueIdle => guard(
            "(attribute_not_exists(queue_tail) OR queue_tail <= queue_head) AND attribute_not_exists(pending_token)",
            [],
        ),
        // A release straight to an in-process waiter: the lease read, unreleased, past its
        // min_hold, no queued waiters, no work state (the grant replaces the whole item), and no
        // waiter of another coordinator marked it since the read (the key goes free for it).
        Condition::HandTo { lease_id, fence, now_ms, coordinator } => guard(
            "fence = :expected_fence AND lease_id = :lease_id AND attribute_not_exists(released_at_ms) \
             AND min_hold_until_ms <= :now AND (attribute_not_exists(queue_tail) OR queue_tail <= queue_head) \
             AND attribute_not_exists(state_shard) \
             AND (attribute_not_exists(awaited_by) OR awaited_by = :coordinator)",
            [
                ("expected_fence", num(*fence)),
                ("lease_id", id(lease_id)),
                ("now", num(*now_ms)),
                ("coordinator", str_(coordinator)),
            ],
        ),
        _ => unreachable!("not a queue condition: {c:?}"),
    }
}

/// The conditions of work states.
fn state_guard(c: &Condition) -> Guard {
    match c {
        // `Free` for a key in a work state, still in the visit read (the put copies it over).
        Condition::FreeIn { now_ms, fence, lease_id, visit } => guard(
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
        // No item, or a free one not already in this state.
        Condition::Enterable { now_ms, shard, .. } => guard(
            "attribute_not_exists(fence) OR (expires_at_ms <= :now AND (attribute_not_exists(state_shard) \
             OR state_shard <> :state_shard))",
            [("now", num(*now_ms)), ("state_shard", str_(shard))],
        ),
        _ => unreachable!("not a work-state condition: {c:?}"),
    }
}

/// The `#name` aliases an expression's text uses, and its `:name` placeholders.
fn tokens(text: &str, sigil: char) -> impl Iterator<Item = &str> {
    text.match_indices(sigil).map(move |(i, _)| {
        let rest = &text[i + 1..];
        &rest[..rest.find(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_')).unwrap_or(rest.len())]
    })
}

/// An expression under construction: attribute names as they are, except the reserved words
/// (`attr::RESERVED`), which go through `#name` aliases; `:value` placeholders for every value.
#[derive(Default)]
pub(super) struct Expr {
    set: Vec<String>,
    remove: Vec<String>,
    names: HashMap<String, String>,
    values: HashMap<String, AttributeValue>,
}

impl Expr {
    /// The `ConditionExpression` of `c`, its aliases and values bound.
    pub(super) fn condition(&mut self, c: &Condition) -> String {
        let g = condition_guard(c);
        for a in tokens(g.text, '#') {
            let name = g.names.iter().find(|(n, _)| *n == a).map_or(a.to_string(), |(_, v)| v.clone());
            self.names.insert(format!("#{a}"), name);
        }
        for (name, value) in g.values {
            self.v(name, value);
        }
        debug_assert!(tokens(g.text, ':').all(|p| self.values.contains_key(&format!(":{p}"))), "{}", g.text);
        g.text.to_string()
    }

    /// The alias map, or none when no reserved word was used (an empty map is invalid).
    pub(super) fn names(&mut self) -> Option<HashMap<String, String>> {
        Some(std::mem::take(&mut self.names)).filter(|n| !n.is_empty())
    }

    /// The value map, or none when the expressions use no value (an empty map is invalid).
    pub(super) fn values(&mut self) -> Option<HashMap<String, AttributeValue>> {
        Some(std::mem::take(&mut self.values)).filter(|v| !v.is_empty())
    }

    /// `SET ...` and `REMOVE ...` of the mutations rendered.
    pub(super) fn update_expression(&self) -> String {
        let mut parts = Vec::new();
        if !self.set.is_empty() {
            parts.push(format!("SET {}", self.set.join(", ")));
        }
        if !self.remove.is_empty() {
            parts.push(format!("REMOVE {}", self.remove.join(", ")));
        }
        parts.join(" ")
    }

    fn n(&mut self, attribute: &str) -> String {
        if !attr::RESERVED.contains(&attribute) {
            return attribute.to_string();
        }
        let p = format!("#{attribute}");
        self.names.insert(p.clone(), attribute.to_string());
        p
    }

    fn v(&mut self, name: &str, value: AttributeValue) -> String {
        let p = format!(":{name}");
        // One placeholder, one value: a condition and an update naming the same placeholder for
        // two values would silently check the wrong one.
        match self.values.entry(p.clone()) {
            std::collections::hash_map::Entry::Occupied(old) => {
                assert_eq!(old.get(), &value, "placeholder {p} bound to two values")
            }
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(value);
            }
        }
        p
    }

    fn set(&mut self, attribute: &str, rhs: String) {
        let a = self.n(attribute);
        self.set.push(format!("{a} = {rhs}"));
    }

    /// `attribute = :attribute`.
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

    /// The `UpdateExpression` of `m` on `key`, by the part of the protocol it belongs to. An
    /// acquire and a waiter item are whole items (PutItem, `item::lease_item` / `waiter_item`).
    pub(super) fn mutation(&mut self, key: &str, m: &Mutation) {
        use Mutation::*;
        match m {
            Acquire(_) | PutWaiter(_) => unreachable!("a whole item is a PutItem"),
            Extend { .. } | Release { .. } | ForceRelease { .. } | ClearKeepalive | Revoke { .. } => {
                self.lease_update(m)
            }
            Enqueue { .. } | Delivered { .. } | MarkUndelivered { .. } | Unindex | Skip { .. } | WaitsIn { .. } => {
                self.queue_update(m)
            }
            Grant { lease, seq, token } => self.grant(key, lease, *seq, token),
            Enter { .. } | ReleaseTo { .. } | ClearTtl => self.state_update(m),
            PutSemaphore(_) => unreachable!("a whole item is a PutItem"),
            TakeSlot { .. } | RenewSlot { .. } | ReleaseSlot { .. } | EvictSlots { .. } | TidySlots { .. } => {
                self.slot_update(m)
            }
        }
    }

    /// `sem_holders.#alias`, the alias naming the holder's lease_id.
    fn holder_path(&mut self, alias: &str, lease_id: &crate::model::LeaseId) -> String {
        self.names.insert(format!("#{alias}"), lease_id.expose().to_string());
        format!("{}.#{alias}", attr::SEM_HOLDERS)
    }

    /// `lhs = rhs` for a document path.
    fn set_path(&mut self, lhs: String, rhs: String) {
        self.set.push(format!("{lhs} = {rhs}"));
    }

    /// `attribute = attribute + :one` (`-` with `minus`).
    fn bump(&mut self, attribute: &str, minus: bool) {
        let a = self.n(attribute);
        let one = self.v("one", num(1));
        self.set(attribute, format!("{a} {} {one}", if minus { "-" } else { "+" }));
    }

    /// The semaphore's writes (DESIGN.md, "Semaphores"); each bumps `sem_rev` and sets the TTL.
    fn slot_update(&mut self, m: &Mutation) {
        match m {
            Mutation::TakeSlot { slot, slots, ttl, clean } => {
                let p = self.holder_path("lease_id", &slot.lease_id);
                let v = self.v("slot_holder", super::item::slot_holder_value(slot));
                self.set_path(p, v);
                self.set_value(attr::FENCE, num(slot.fence));
                self.set_value(attr::SEM_SLOTS, num(*slots as u64));
                match clean {
                    None => self.bump(attr::SEM_TAKEN, false),
                    Some((ended, taken)) => {
                        self.remove_holders("ended", ended);
                        self.set_value(attr::SEM_TAKEN, num(*taken as u64));
                    }
                }
                self.bump(attr::SEM_REV, false);
                self.set_value(attr::TTL, num(*ttl));
            }
            Mutation::RenewSlot { lease_id, now_ms, duration_ms, ttl } => {
                let p = self.holder_path("lease_id", lease_id);
                let e = self.v("expires_at", num(now_ms + duration_ms));
                self.set_path(format!("{p}.{}", attr::EXPIRES_AT), e);
                let d = self.v("duration_ms", num(*duration_ms));
                self.set_path(format!("{p}.{}", attr::DURATION), d);
                let now = self.v("now", num(*now_ms));
                self.set_path(format!("{p}.{}", attr::RENEWED_AT), now);
                self.bump(attr::SEM_REV, false);
                self.set_value(attr::TTL, num(*ttl));
            }
            Mutation::ReleaseSlot { lease_id, now_ms, ttl } => {
                let p = self.holder_path("lease_id", lease_id);
                let now = self.v("now", num(*now_ms));
                self.set_path(format!("{p}.{}", attr::RELEASED_AT), now.clone());
                self.set_path(format!("{p}.{}", attr::EXPIRES_AT), now);
                self.bump(attr::SEM_TAKEN, true);
                self.bump(attr::SEM_REV, false);
                self.set_value(attr::TTL, num(*ttl));
            }
            _ => self.slot_sweep(m),
        }
    }

    /// The semaphore's writes under the item as read: force-release and tidying.
    fn slot_sweep(&mut self, m: &Mutation) {
        match m {
            Mutation::EvictSlots { evicted, now_ms, taken, ttl } => {
                let (now, zero) = (self.v("now", num(*now_ms)), self.v("zero", num(0)));
                for (i, id) in evicted.iter().enumerate() {
                    let p = self.holder_path(&format!("evicted{i}"), id);
                    self.set_path(format!("{p}.{}", attr::RELEASED_AT), now.clone());
                    self.set_path(format!("{p}.{}", attr::EXPIRES_AT), zero.clone());
                }
                self.set_value(attr::SEM_TAKEN, num(*taken as u64));
                self.bump(attr::FENCE, false);
                self.bump(attr::SEM_REV, false);
                self.set_value(attr::TTL, num(*ttl));
            }
            Mutation::TidySlots { ended, taken, ttl } => {
                self.set_value(attr::SEM_TAKEN, num(*taken as u64));
                self.bump(attr::SEM_REV, false);
                self.set_value(attr::TTL, num(*ttl));
                self.remove_holders("ended", ended);
            }
            _ => unreachable!("not a semaphore update: {m:?}"),
        }
    }

    /// `REMOVE sem_holders.#ended0, ...`.
    fn remove_holders(&mut self, alias: &str, ids: &[crate::model::LeaseId]) {
        for (i, id) in ids.iter().enumerate() {
            let p = self.holder_path(&format!("{alias}{i}"), id);
            self.remove.push(p);
        }
    }

    /// The updates of one lease's life: heartbeat, release, force-release, keep-alive end, and
    /// the revocation of an undelivered grant.
    fn lease_update(&mut self, m: &Mutation) {
        match m {
            // `SET expires_at_ms = :expires_at_ms, duration_ms = :duration_ms, ...` with a
            // duration; by the stored one `SET expires_at_ms = duration_ms + :now_ext, ...`.
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
            // Free at min_hold_until; fence, holder and lease_id stay.
            Mutation::Release { now_ms, ttl } => {
                let mh = self.n(attr::MIN_HOLD_UNTIL);
                self.set(attr::EXPIRES_AT, mh);
                self.set_value(attr::RELEASED_AT, num(*now_ms));
                self.set_value(attr::TTL, num(*ttl));
                self.remove_keepalive();
            }
            // Free at once, with a fence the evicted holder's writes are refused against.
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
            // The grant's waiter is gone: free at once, the undelivered mark gone.
            Mutation::Revoke { now_ms, ttl } => {
                self.set_value(attr::EXPIRES_AT, num(0));
                self.set_value(attr::RELEASED_AT, num(*now_ms));
                self.set_or_remove(attr::TTL, ttl.map(num));
                self.remove(attr::PENDING_TOKEN);
                self.remove_keepalive();
            }
            _ => unreachable!("not a lease update: {m:?}"),
        }
    }

    /// The updates of the waiter queue and of in-process hand-overs (the grant aside).
    fn queue_update(&mut self, m: &Mutation) {
        match m {
            // A new queue starts both counters at `:queue_start`; the new tail is the waiter's
            // sequence number, and the key enters the queue index.
            Mutation::Enqueue { now_ms, start, lease_id, shard } => {
                let (qh, qt) = (self.n(attr::QUEUE_HEAD), self.n(attr::QUEUE_TAIL));
                let st = self.v("queue_start", num(*start));
                let one = self.v("one", num(1));
                self.set(attr::QUEUE_HEAD, format!("if_not_exists({qh}, {st})"));
                self.set(attr::QUEUE_TAIL, format!("if_not_exists({qt}, {st}) + {one}"));
                self.set_value(attr::QUEUE_TAIL_AT, num(*now_ms));
                // The condition's `:lease_id` is the same value.
                let lid = self.v("lease_id", id(lease_id));
                self.set(attr::QUEUE_TAIL_LEASE_ID, lid);
                self.set_value(attr::Q_SHARD, num(*shard as u64));
            }
            Mutation::Delivered { now_ms } => {
                self.set_value(attr::FREED_AT, num(*now_ms));
                self.remove(attr::PENDING_TOKEN);
            }
            Mutation::MarkUndelivered { token, shard } => {
                self.set_value(attr::PENDING_TOKEN, str_(token));
                self.set_value(attr::Q_SHARD, num(*shard as u64));
            }
            Mutation::Unindex => self.remove(attr::Q_SHARD),
            Mutation::Skip { seq, now_ms } => {
                self.set_value(attr::QUEUE_HEAD, num(*seq));
                self.set_value(attr::FREED_AT, num(*now_ms));
            }
            Mutation::WaitsIn { coordinator } => self.set_value(attr::AWAITED_BY, str_(coordinator)),
            _ => unreachable!("not a queue update: {m:?}"),
        }
    }

    /// The head waiter's grant: the new lease over the old one (an UpdateItem, so the queue
    /// counters and a work state stay), its head moved to `seq`, marked undelivered.
    fn grant(&mut self, key: &str, n: &NewLease, seq: u64, token: &str) {
        self.set_value(attr::FENCE, num(n.fence));
        self.set_value(attr::HOLDER, str_(&n.holder));
        self.set_value(attr::LEASE_ID, id(&n.lease_id));
        self.set_value(attr::ACQUIRED_AT, num(n.now_ms));
        self.set_value(attr::RENEWED_AT, num(n.now_ms));
        self.set_value(attr::MIN_HOLD_UNTIL, num(n.now_ms.saturating_add(n.min_hold_ms)));
        self.set_or_remove(attr::EXPIRES_AT, n.duration_ms.map(|d| num(n.now_ms.saturating_add(d))));
        self.set_or_remove(attr::DURATION, n.duration_ms.map(num));
        self.set_or_remove(attr::TTL, n.ttl.map(num));
        self.set_value(attr::QUEUE_HEAD, num(seq));
        self.set_value(attr::PENDING_TOKEN, str_(token));
        let metadata = n.metadata.as_ref().map(|m| AttributeValue::S(serde_json::Value::Object(m.clone()).to_string()));
        self.set_or_remove(attr::METADATA, metadata);
        match &n.keepalive {
            Some(k) => {
                self.set_value(attr::KA_SHARD, num(keepalive_shard(key, KEEPALIVE_SHARDS) as u64));
                self.set_value(attr::KA_UNTIL, num(k.until_ms));
                self.set_or_remove(attr::KA_EXECUTION_ARN, k.execution_arn.as_deref().map(str_));
            }
            None => self.remove_keepalive(),
        }
        self.set_or_remove(attr::RELEASED_LEASE_ID, n.released.as_ref().map(|r| id(&r.0)));
        self.set_or_remove(attr::RELEASED_FENCE, n.released.as_ref().map(|r| num(r.1)));
        self.remove(attr::RELEASED_AT);
        self.remove(attr::POLL);
    }

    /// The updates of work states.
    fn state_update(&mut self, m: &Mutation) {
        match m {
            Mutation::Enter { now_ms, holder, shard, ttl, .. } => self.enter(*now_ms, holder, shard, *ttl),
            // A release that moves the key into a state, kept until taken (no TTL) or, in a
            // terminal state, until its TTL.
            Mutation::ReleaseTo { now_ms, shard, ttl, .. } => {
                let mh = self.n(attr::MIN_HOLD_UNTIL);
                self.set(attr::EXPIRES_AT, mh);
                let now = self.v("released_at_ms", num(*now_ms));
                self.set(attr::RELEASED_AT, now.clone());
                self.set_value(attr::STATE_SHARD, str_(shard));
                self.set(attr::STATE_SINCE, now);
                self.set_value(attr::ATTEMPTS, num(0));
                self.remove_keepalive();
                self.set_or_remove(attr::TTL, ttl.map(num));
            }
            Mutation::ClearTtl => self.remove(attr::TTL),
            _ => unreachable!("not a work-state update: {m:?}"),
        }
    }

    /// A key put into a state without a lease: a new item gets fence 0, `holder` and no
    /// lease_id a caller can send; free from now, entered now, no grants yet, the TTL `ttl`
    /// (a terminal state) or none.
    fn enter(&mut self, now_ms: u64, holder: &str, shard: &str, ttl: Option<u64>) {
        let now = self.v("now", num(now_ms));
        for (a, v) in [
            (attr::FENCE, self.v("zero", num(0))),
            (attr::HOLDER, self.v("holder", str_(holder))),
            (attr::LEASE_ID, self.v("no_lease", str_(NO_LEASE))),
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
        self.set_or_remove(attr::TTL, ttl.map(num));
    }
}

/// The expressions a write is sent with: `ConditionExpression`, and `UpdateExpression` (empty
/// for an acquire, which is a `PutItem` of the whole item). DESIGN.md prints each, and a test
/// compares them, so the specification cannot drift from what is sent.
pub fn expressions(condition: &Condition, mutation: &Mutation) -> (String, String) {
    let mut x = Expr::default();
    let cond = x.condition(condition);
    if !matches!(mutation, Mutation::Acquire(_) | Mutation::PutWaiter(_) | Mutation::PutSemaphore(_)) {
        x.mutation("", mutation);
    }
    (cond, x.update_expression())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::LeaseId;
    use crate::store::{NewLease, Visit};

    /// DESIGN.md is the specification: every expression the store sends is printed there, word
    /// for word (`ConditionExpression: ` / `UpdateExpression: ` followed by it in backticks).
    #[test]
    fn design_prints_every_expression_sent() {
        let design = include_str!("../../../../DESIGN.md");
        let id = LeaseId::generate();
        let (now, ttl) = (1, Some(2));
        let writes = [
            (Condition::Free { now_ms: now, fence: 3, lease_id: id.clone() }, None),
            (Condition::FreeAfter { now_ms: now, fence: 3, lease_id: id.clone() }, None),
            (
                Condition::Renew { lease_id: id.clone(), now_ms: now, expires_at_ms: Some(4), ttl: true },
                Some(Mutation::Extend { now_ms: now, duration_ms: Some(3), ttl }),
            ),
            (
                Condition::Renew { lease_id: id.clone(), now_ms: now, expires_at_ms: None, ttl: true },
                Some(Mutation::Extend { now_ms: now, duration_ms: None, ttl }),
            ),
            (
                Condition::Renew { lease_id: id.clone(), now_ms: now, expires_at_ms: Some(4), ttl: false },
                Some(Mutation::Extend { now_ms: now, duration_ms: Some(3), ttl: None }),
            ),
            (
                Condition::Renew { lease_id: id.clone(), now_ms: now, expires_at_ms: None, ttl: false },
                Some(Mutation::Extend { now_ms: now, duration_ms: None, ttl: None }),
            ),
            (Condition::Unreleased { lease_id: id.clone() }, Some(Mutation::Release { now_ms: now, ttl: 2 })),
            (Condition::Exists, Some(Mutation::ForceRelease { now_ms: now, ttl: 2 })),
            (Condition::FenceIs(3), Some(Mutation::ClearKeepalive)),
            (Condition::FenceAndExpiry { fence: 3, expires_at_ms: Some(4) }, Some(Mutation::ClearKeepalive)),
            (Condition::FenceAndExpiry { fence: 3, expires_at_ms: None }, Some(Mutation::ClearKeepalive)),
            (
                Condition::Queueable { now_ms: now, lease_id: id.clone(), start: 5 },
                Some(Mutation::Enqueue { now_ms: now, start: 5, lease_id: id.clone(), shard: 1003 }),
            ),
            (
                Condition::HandOver { fence: 3, now_ms: now, head: 5 },
                Some(Mutation::Grant {
                    lease: NewLease {
                        ttl,
                        released: Some((id.clone(), 2)),
                        ..NewLease::new("h", id.clone(), now, Some(3), 4)
                    },
                    seq: 6,
                    token: "t".into(),
                }),
            ),
            (Condition::HandOver { fence: 3, now_ms: now, head: 5 }, Some(Mutation::Skip { seq: 6, now_ms: now })),
            (Condition::Undelivered { fence: 3, token: "t".into() }, Some(Mutation::Delivered { now_ms: now })),
            (Condition::UndeliveredLive { fence: 3, token: "t".into() }, Some(Mutation::Delivered { now_ms: now })),
            (
                Condition::Undelivered { fence: 3, token: "t".into() },
                Some(Mutation::Revoke { now_ms: now, ttl: Some(2) }),
            ),
            (Condition::Undelivered { fence: 3, token: "t".into() }, Some(Mutation::Revoke { now_ms: now, ttl: None })),
            (Condition::FenceIs(3), Some(Mutation::MarkUndelivered { token: "t".into(), shard: 1003 })),
            (
                Condition::Undelivered { fence: 3, token: "t".into() },
                Some(Mutation::MarkUndelivered { token: "u".into(), shard: 1003 }),
            ),
            (Condition::QueueIdle, Some(Mutation::Unindex)),
            (Condition::NotLease, None),
            (Condition::WaiterNewer { now_ms: now }, None),
            (Condition::HandTo { lease_id: id.clone(), fence: 3, now_ms: now, coordinator: "c".into() }, None),
            (
                Condition::FreeIn {
                    now_ms: now,
                    fence: 3,
                    lease_id: id.clone(),
                    visit: Visit { state: "S".into(), shard: "S#0".into(), since_ms: 1, attempts: 0 },
                },
                None,
            ),
            (
                Condition::Enterable { now_ms: now, state: "S".into(), shard: "S#0".into() },
                Some(Mutation::Enter {
                    now_ms: now,
                    holder: "h".into(),
                    state: "S".into(),
                    shard: "S#0".into(),
                    ttl: None,
                }),
            ),
            (
                Condition::Live { lease_id: id.clone(), now_ms: now },
                Some(Mutation::ReleaseTo { now_ms: now, state: "S".into(), shard: "S#0".into(), ttl: None }),
            ),
            // Into a terminal state: with a TTL.
            (
                Condition::Enterable { now_ms: now, state: "S".into(), shard: "S#0".into() },
                Some(Mutation::Enter {
                    now_ms: now,
                    holder: "h".into(),
                    state: "S".into(),
                    shard: "S#0".into(),
                    ttl: Some(2),
                }),
            ),
            (
                Condition::Live { lease_id: id.clone(), now_ms: now },
                Some(Mutation::ReleaseTo { now_ms: now, state: "S".into(), shard: "S#0".into(), ttl: Some(2) }),
            ),
            (Condition::FenceIs(3), Some(Mutation::ClearTtl)),
            (Condition::FenceIs(3), Some(Mutation::WaitsIn { coordinator: "c".into() })),
            (Condition::Unqueued { lease_id: id.clone() }, Some(Mutation::Release { now_ms: now, ttl: 2 })),
            (Condition::ReleaseHandOver { lease_id: id.clone(), fence: 3, now_ms: now, head: 5 }, None),
            // Semaphores: take, clean and take, tidy, heartbeat, release, force-release.
            (
                Condition::SlotFree { fence: 4, lease_id: id.clone(), slots: 3 },
                Some(Mutation::TakeSlot { slot: Box::new(slot(&id)), slots: 3, ttl: 2, clean: None }),
            ),
            (
                Condition::SlotsAsRead { rev: 7 },
                Some(Mutation::TakeSlot {
                    slot: Box::new(slot(&id)),
                    slots: 3,
                    ttl: 2,
                    clean: Some((vec![LeaseId::generate()], 2)),
                }),
            ),
            (
                Condition::SlotsAsRead { rev: 7 },
                Some(Mutation::TidySlots { ended: vec![LeaseId::generate()], taken: 2, ttl: 2 }),
            ),
            (
                Condition::SlotRenew { lease_id: id.clone(), now_ms: now, expires_at_ms: 5 },
                Some(Mutation::RenewSlot { lease_id: id.clone(), now_ms: now, duration_ms: 4, ttl: 2 }),
            ),
            (
                Condition::SlotUnreleased { lease_id: id.clone() },
                Some(Mutation::ReleaseSlot { lease_id: id.clone(), now_ms: now, ttl: 2 }),
            ),
            (
                Condition::SlotsAsRead { rev: 7 },
                Some(Mutation::EvictSlots { evicted: vec![LeaseId::generate()], now_ms: now, taken: 1, ttl: 2 }),
            ),
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

    fn slot(id: &LeaseId) -> crate::model::SlotHolder {
        crate::model::SlotHolder {
            lease_id: id.clone(),
            fence: 4,
            holder: "h".into(),
            acquired_at_ms: 1,
            renewed_at_ms: 1,
            expires_at_ms: 5,
            duration_ms: 4,
            released_at_ms: None,
            metadata: None,
        }
    }

    /// Every condition names attributes of the item schema (`attr::ALL`), the reserved words
    /// only through their `#name` aliases: the texts above are written out, so this is what
    /// keeps them in step with the attribute names.
    #[test]
    fn conditions_name_only_schema_attributes() {
        let id = LeaseId::generate();
        let visit = Visit { state: "S".into(), shard: "S#0".into(), since_ms: 1, attempts: 0 };
        let all = [
            Condition::Free { now_ms: 1, fence: 3, lease_id: id.clone() },
            Condition::FreeAfter { now_ms: 1, fence: 3, lease_id: id.clone() },
            Condition::Renew { lease_id: id.clone(), now_ms: 1, expires_at_ms: Some(4), ttl: true },
            Condition::Renew { lease_id: id.clone(), now_ms: 1, expires_at_ms: None, ttl: true },
            Condition::Renew { lease_id: id.clone(), now_ms: 1, expires_at_ms: Some(4), ttl: false },
            Condition::Renew { lease_id: id.clone(), now_ms: 1, expires_at_ms: None, ttl: false },
            Condition::Unreleased { lease_id: id.clone() },
            Condition::Exists,
            Condition::FenceIs(3),
            Condition::FenceAndExpiry { fence: 3, expires_at_ms: Some(4) },
            Condition::FenceAndExpiry { fence: 3, expires_at_ms: None },
            Condition::Queueable { now_ms: 1, lease_id: id.clone(), start: 5 },
            Condition::HandOver { fence: 3, now_ms: 1, head: 5 },
            Condition::Undelivered { fence: 3, token: "t".into() },
            Condition::UndeliveredLive { fence: 3, token: "t".into() },
            Condition::NotLease,
            Condition::WaiterNewer { now_ms: 1 },
            Condition::HandTo { lease_id: id.clone(), fence: 3, now_ms: 1, coordinator: "c".into() },
            Condition::FreeIn { now_ms: 1, fence: 3, lease_id: id.clone(), visit },
            Condition::Enterable { now_ms: 1, state: "S".into(), shard: "S#0".into() },
            Condition::Live { lease_id: id.clone(), now_ms: 1 },
            Condition::Unqueued { lease_id: id.clone() },
            Condition::ReleaseHandOver { lease_id: id.clone(), fence: 3, now_ms: 1, head: 5 },
            Condition::QueueIdle,
            Condition::SlotFree { fence: 3, lease_id: id.clone(), slots: 2 },
            Condition::SlotsAsRead { rev: 3 },
            Condition::SlotRenew { lease_id: id.clone(), now_ms: 1, expires_at_ms: 4 },
            Condition::SlotUnreleased { lease_id: id.clone() },
        ];
        let words = ["AND", "OR", "attribute_exists", "attribute_not_exists"];
        for c in &all {
            let mut x = Expr::default();
            let text = x.condition(c);
            let names = x.names().unwrap_or_default();
            for (alias, name) in &names {
                // `#lease_id`: a semaphore holder's key in `sem_holders`, the lease_id itself.
                let holder_key = alias == "#lease_id" && name == id.expose();
                assert!(
                    holder_key || attr::RESERVED.contains(&name.as_str()) && alias == &format!("#{name}"),
                    "{text}"
                );
            }
            let values = x.values().unwrap_or_default();
            for token in text.split(|ch: char| !(ch.is_ascii_alphanumeric() || "_#:".contains(ch))) {
                match token.chars().next() {
                    None => {}
                    Some('#') => assert!(names.contains_key(token), "{token} unbound in {text}"),
                    Some(':') => assert!(values.contains_key(token), "{token} unbound in {text}"),
                    _ if words.contains(&token) => {}
                    _ => assert!(
                        attr::ALL.contains(&token) && !attr::RESERVED.contains(&token),
                        "{token} in {text} is no attribute, or a reserved word without its alias"
                    ),
                }
            }
        }
    }
}
