//! The protocol's writes as DynamoDB expressions: a [`Condition`] into a
//! `ConditionExpression`, a [`Mutation`] into an `UpdateExpression` (or the whole item of a
//! `PutItem`), with their attribute names and values. Pure text, no request: each kind of lease
//! renders its own writes beside their reference semantics (`store/kinds/`), with the toolkit
//! of `expr.rs`; this file delegates to the kinds, renders the two conditions every kind uses,
//! and a test checks that DESIGN.md prints every expression rendered, word for word.
//!
//! The protocol, step by step (DESIGN.md's sections). Each condition's text is written where
//! its kind renders it, exactly as DESIGN.md prints it, beside the reason it guards and this
//! step's number:
//! 1. acquire, a `PutItem` of the whole lease (`LeaseMutation::Acquire`), if the key is free:
//!    `LeaseCondition::Free`; fail-closed, `LeaseCondition::FreeAfter` (`kinds/lease.rs`).
//! 2. heartbeat: `LeaseCondition::Renew` + `LeaseMutation::Extend` (`kinds/lease.rs`).
//! 3. release: `LeaseCondition::Unreleased` + `LeaseMutation::Release`; with a waiter queue,
//!    `QueueCondition::Unqueued` + `Release`, or `QueueCondition::ReleaseHandOver` +
//!    `QueueMutation::Grant` (`kinds/queue.rs`); into a work state, `LeaseCondition::Live` +
//!    `WorkMutation::ReleaseTo` (`kinds/work.rs`).
//! 4. force-release: [`Condition::Exists`] (below) + `LeaseMutation::ForceRelease`.
//! 5. keep-alive sweep: `KeepaliveCondition::FenceAndExpiry` +
//!    `KeepaliveMutation::ClearKeepalive` (`kinds/keepalive.rs`); the renewals and releases it
//!    makes are steps 2 and 3.
//! 6. the waiter queue (`kinds/queue.rs`):
//!    a. enqueue: `QueueCondition::Queueable` + `QueueMutation::Enqueue`;
//!    b. the waiter item: `QueueCondition::WaiterNewer` + `QueueMutation::PutWaiter` (a
//!    `PutItem`), deleted under `QueueCondition::NotLease`;
//!    c. serve the head waiter: `QueueCondition::HandOver` + `QueueMutation::Grant` /
//!    `QueueMutation::Skip`;
//!    d. delivery: `QueueCondition::Undelivered` / `QueueCondition::UndeliveredLive` +
//!    `QueueMutation::Delivered` / `QueueMutation::Revoke`;
//!    e. a grant marked undelivered: [`Condition::FenceIs`] (below) or
//!    `QueueCondition::Undelivered` + `QueueMutation::MarkUndelivered`;
//!    f. leave the queue index: `QueueCondition::QueueIdle` + `QueueMutation::Unindex`.
//! 7. in-process waiters (`kinds/queue.rs`): the release's grant, `QueueCondition::HandTo` +
//!    `LeaseMutation::Acquire` (a `PutItem`); a waiter's mark, [`Condition::FenceIs`] +
//!    `QueueMutation::WaitsIn`.
//! 8. work states (`kinds/work.rs`):
//!    a. put: `WorkCondition::Enterable` + `WorkMutation::Enter`;
//!    b. a batch lease: `WorkCondition::FreeIn` + `LeaseMutation::Acquire` (a `PutItem`);
//!    c. release into the next state: `LeaseCondition::Live` + `WorkMutation::ReleaseTo`;
//!    d. a key in a state keeps no TTL: [`Condition::FenceIs`] + `WorkMutation::ClearTtl`.
//! 9. semaphores (`kinds/semaphore.rs`):
//!    a. the first holder makes it: `LeaseCondition::Free` + `SemaphoreMutation::PutSemaphore`
//!    (a `PutItem`);
//!    b. take a slot: `SemaphoreCondition::SlotFree` + `SemaphoreMutation::TakeSlot`;
//!    c. clean the ended holders and take: `SemaphoreCondition::SlotsAsRead` + `TakeSlot`;
//!    d. tidy: `SemaphoreCondition::SlotsAsRead` + `SemaphoreMutation::TidySlots`;
//!    e. heartbeat: `SemaphoreCondition::SlotRenew` + `SemaphoreMutation::RenewSlot`;
//!    f. release: `SemaphoreCondition::SlotUnreleased` + `SemaphoreMutation::ReleaseSlot`;
//!    g. force-release: `SemaphoreCondition::SlotsAsRead` + `SemaphoreMutation::EvictSlots`.

use super::expr::{guard, Expr, Guard, Request};
use super::item::num;
use crate::error::Result;
use crate::store::{Condition, Mutation};

/// The condition's expression, by the kind of lease it belongs to.
fn condition_guard(c: &Condition) -> Guard {
    match c {
        Condition::Lease(c) => c.guard(),
        Condition::Queue(c) => c.guard(),
        Condition::Work(c) => c.guard(),
        Condition::Semaphore(c) => c.guard(),
        Condition::Keepalive(c) => c.guard(),
        // Step 4, force-release: an operator's, of any item.
        Condition::Exists => guard("attribute_exists(#key)", []),
        // Steps 6e, 7, 8d, the same lease as read: every grant and force-release changes the fence.
        Condition::FenceIs(f) => guard("fence = :expected_fence", [("expected_fence", num(*f))]),
    }
}

/// The `ConditionExpression` of `c`, its aliases and values bound in `x`.
pub(super) fn condition(x: &mut Expr, c: &Condition) -> String {
    x.condition(condition_guard(c))
}

/// How `m` is written on `key`: the whole item of a `PutItem`, or an `UpdateItem` whose
/// expression is rendered into `x`, by the kind of lease it belongs to.
pub(super) fn mutation(x: &mut Expr, key: &str, m: &Mutation) -> Result<Request> {
    Ok(match m {
        Mutation::Lease(m) => m.render(key, x),
        Mutation::Queue(m) => m.render(key, x)?,
        Mutation::Work(m) => m.render(x),
        Mutation::Semaphore(m) => m.render(key, x),
        Mutation::Keepalive(m) => m.render(x),
    })
}

/// The expressions a write is sent with: `ConditionExpression`, and `UpdateExpression` (empty
/// for a whole item, which is a `PutItem`). DESIGN.md prints each, and a test compares them, so
/// the specification cannot drift from what is sent.
pub fn expressions(c: &Condition, m: &Mutation) -> (String, String) {
    let mut x = Expr::default();
    let cond = condition(&mut x, c);
    // A whole item has no update expression (nor does a waiter item without its waiter, which
    // the store refuses).
    let _ = mutation(&mut x, "", m);
    (cond, x.update_expression())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::LeaseId;
    use crate::store::table::attr;
    use crate::store::{
        KeepaliveCondition, KeepaliveMutation, LeaseCondition, LeaseMutation, NewLease, QueueCondition, QueueMutation,
        SemaphoreCondition, SemaphoreMutation, Visit, WorkCondition, WorkMutation,
    };

    /// DESIGN.md is the specification: every expression the store sends is printed there, word
    /// for word (`ConditionExpression: ` / `UpdateExpression: ` followed by it in backticks).
    #[test]
    fn design_prints_every_expression_sent() {
        let design = include_str!("../../../../DESIGN.md");
        let id = LeaseId::generate();
        let (now, ttl) = (1, Some(2));
        let writes = [
            (Condition::Lease(LeaseCondition::Free { now_ms: now, fence: 3, lease_id: id.clone() }), None),
            (Condition::Lease(LeaseCondition::FreeAfter { now_ms: now, fence: 3, lease_id: id.clone() }), None),
            (
                Condition::Lease(LeaseCondition::Renew {
                    lease_id: id.clone(),
                    now_ms: now,
                    expires_at_ms: Some(4),
                    ttl: true,
                }),
                Some(Mutation::Lease(LeaseMutation::Extend { now_ms: now, duration_ms: Some(3), ttl })),
            ),
            (
                Condition::Lease(LeaseCondition::Renew {
                    lease_id: id.clone(),
                    now_ms: now,
                    expires_at_ms: None,
                    ttl: true,
                }),
                Some(Mutation::Lease(LeaseMutation::Extend { now_ms: now, duration_ms: None, ttl })),
            ),
            (
                Condition::Lease(LeaseCondition::Renew {
                    lease_id: id.clone(),
                    now_ms: now,
                    expires_at_ms: Some(4),
                    ttl: false,
                }),
                Some(Mutation::Lease(LeaseMutation::Extend { now_ms: now, duration_ms: Some(3), ttl: None })),
            ),
            (
                Condition::Lease(LeaseCondition::Renew {
                    lease_id: id.clone(),
                    now_ms: now,
                    expires_at_ms: None,
                    ttl: false,
                }),
                Some(Mutation::Lease(LeaseMutation::Extend { now_ms: now, duration_ms: None, ttl: None })),
            ),
            (
                Condition::Lease(LeaseCondition::Unreleased { lease_id: id.clone() }),
                Some(Mutation::Lease(LeaseMutation::Release { now_ms: now, ttl: 2 })),
            ),
            (Condition::Exists, Some(Mutation::Lease(LeaseMutation::ForceRelease { now_ms: now, ttl: 2 }))),
            (Condition::FenceIs(3), Some(Mutation::Keepalive(KeepaliveMutation::ClearKeepalive))),
            (
                Condition::Keepalive(KeepaliveCondition::FenceAndExpiry { fence: 3, expires_at_ms: Some(4) }),
                Some(Mutation::Keepalive(KeepaliveMutation::ClearKeepalive)),
            ),
            (
                Condition::Keepalive(KeepaliveCondition::FenceAndExpiry { fence: 3, expires_at_ms: None }),
                Some(Mutation::Keepalive(KeepaliveMutation::ClearKeepalive)),
            ),
            (
                Condition::Queue(QueueCondition::Queueable { now_ms: now, lease_id: id.clone(), start: 5 }),
                Some(Mutation::Queue(QueueMutation::Enqueue {
                    now_ms: now,
                    start: 5,
                    lease_id: id.clone(),
                    shard: 1003,
                })),
            ),
            (
                Condition::Queue(QueueCondition::HandOver { fence: 3, now_ms: now, head: 5 }),
                Some(Mutation::Queue(QueueMutation::Grant {
                    lease: NewLease {
                        ttl,
                        released: Some((id.clone(), 2)),
                        ..NewLease::new("h", id.clone(), now, Some(3), 4)
                    },
                    seq: 6,
                    token: "t".into(),
                })),
            ),
            (
                Condition::Queue(QueueCondition::HandOver { fence: 3, now_ms: now, head: 5 }),
                Some(Mutation::Queue(QueueMutation::Skip { seq: 6, now_ms: now })),
            ),
            (
                Condition::Queue(QueueCondition::Undelivered { fence: 3, token: "t".into() }),
                Some(Mutation::Queue(QueueMutation::Delivered { now_ms: now })),
            ),
            (
                Condition::Queue(QueueCondition::UndeliveredLive { fence: 3, token: "t".into() }),
                Some(Mutation::Queue(QueueMutation::Delivered { now_ms: now })),
            ),
            (
                Condition::Queue(QueueCondition::Undelivered { fence: 3, token: "t".into() }),
                Some(Mutation::Queue(QueueMutation::Revoke { now_ms: now, ttl: Some(2) })),
            ),
            (
                Condition::Queue(QueueCondition::Undelivered { fence: 3, token: "t".into() }),
                Some(Mutation::Queue(QueueMutation::Revoke { now_ms: now, ttl: None })),
            ),
            (
                Condition::FenceIs(3),
                Some(Mutation::Queue(QueueMutation::MarkUndelivered { token: "t".into(), shard: 1003 })),
            ),
            (
                Condition::Queue(QueueCondition::Undelivered { fence: 3, token: "t".into() }),
                Some(Mutation::Queue(QueueMutation::MarkUndelivered { token: "u".into(), shard: 1003 })),
            ),
            (Condition::Queue(QueueCondition::QueueIdle), Some(Mutation::Queue(QueueMutation::Unindex))),
            (Condition::Queue(QueueCondition::NotLease), None),
            (Condition::Queue(QueueCondition::WaiterNewer { now_ms: now }), None),
            (
                Condition::Queue(QueueCondition::HandTo {
                    lease_id: id.clone(),
                    fence: 3,
                    now_ms: now,
                    coordinator: "c".into(),
                }),
                None,
            ),
            (
                Condition::Work(WorkCondition::FreeIn {
                    now_ms: now,
                    fence: 3,
                    lease_id: id.clone(),
                    visit: Visit { state: "S".into(), shard: "S#0".into(), since_ms: 1, attempts: 0 },
                }),
                None,
            ),
            (
                Condition::Work(WorkCondition::Enterable { now_ms: now, state: "S".into(), shard: "S#0".into() }),
                Some(Mutation::Work(WorkMutation::Enter {
                    now_ms: now,
                    holder: "h".into(),
                    state: "S".into(),
                    shard: "S#0".into(),
                    ttl: None,
                })),
            ),
            (
                Condition::Lease(LeaseCondition::Live { lease_id: id.clone(), now_ms: now }),
                Some(Mutation::Work(WorkMutation::ReleaseTo {
                    now_ms: now,
                    state: "S".into(),
                    shard: "S#0".into(),
                    ttl: None,
                })),
            ),
            // Into a terminal state: with a TTL.
            (
                Condition::Work(WorkCondition::Enterable { now_ms: now, state: "S".into(), shard: "S#0".into() }),
                Some(Mutation::Work(WorkMutation::Enter {
                    now_ms: now,
                    holder: "h".into(),
                    state: "S".into(),
                    shard: "S#0".into(),
                    ttl: Some(2),
                })),
            ),
            (
                Condition::Lease(LeaseCondition::Live { lease_id: id.clone(), now_ms: now }),
                Some(Mutation::Work(WorkMutation::ReleaseTo {
                    now_ms: now,
                    state: "S".into(),
                    shard: "S#0".into(),
                    ttl: Some(2),
                })),
            ),
            (Condition::FenceIs(3), Some(Mutation::Work(WorkMutation::ClearTtl))),
            (Condition::FenceIs(3), Some(Mutation::Queue(QueueMutation::WaitsIn { coordinator: "c".into() }))),
            (
                Condition::Queue(QueueCondition::Unqueued { lease_id: id.clone() }),
                Some(Mutation::Lease(LeaseMutation::Release { now_ms: now, ttl: 2 })),
            ),
            (
                Condition::Queue(QueueCondition::ReleaseHandOver {
                    lease_id: id.clone(),
                    fence: 3,
                    now_ms: now,
                    head: 5,
                }),
                None,
            ),
            // Semaphores: take, clean and take, tidy, heartbeat, release, force-release.
            (
                Condition::Semaphore(SemaphoreCondition::SlotFree {
                    fence: 4,
                    lease_id: id.clone(),
                    slots: 3,
                    now_ms: now,
                }),
                Some(Mutation::Semaphore(SemaphoreMutation::TakeSlot {
                    slot: Box::new(slot(&id)),
                    slots: 3,
                    ttl: 2,
                    clean: None,
                    cleaned_at: None,
                })),
            ),
            (
                Condition::Semaphore(SemaphoreCondition::SlotsAsRead { rev: 7 }),
                Some(Mutation::Semaphore(SemaphoreMutation::TakeSlot {
                    slot: Box::new(slot(&id)),
                    slots: 3,
                    ttl: 2,
                    clean: Some((vec![LeaseId::generate()], 2)),
                    cleaned_at: Some(now),
                })),
            ),
            (
                Condition::Semaphore(SemaphoreCondition::SlotsAsRead { rev: 7 }),
                Some(Mutation::Semaphore(SemaphoreMutation::TidySlots {
                    ended: vec![LeaseId::generate()],
                    taken: 2,
                    ttl: 2,
                    cleaned_at: Some(now),
                })),
            ),
            (
                Condition::Semaphore(SemaphoreCondition::SlotRenew {
                    lease_id: id.clone(),
                    now_ms: now,
                    expires_at_ms: 5,
                }),
                Some(Mutation::Semaphore(SemaphoreMutation::RenewSlot {
                    lease_id: id.clone(),
                    now_ms: now,
                    duration_ms: 4,
                    ttl: 2,
                })),
            ),
            (
                Condition::Semaphore(SemaphoreCondition::SlotUnreleased { lease_id: id.clone() }),
                Some(Mutation::Semaphore(SemaphoreMutation::ReleaseSlot { lease_id: id.clone(), now_ms: now, ttl: 2 })),
            ),
            (
                Condition::Semaphore(SemaphoreCondition::SlotsAsRead { rev: 7 }),
                Some(Mutation::Semaphore(SemaphoreMutation::EvictSlots {
                    evicted: vec![LeaseId::generate()],
                    now_ms: now,
                    taken: 1,
                    ttl: 2,
                })),
            ),
        ];
        for (c, m) in writes {
            let (cond, update) =
                expressions(&c, m.as_ref().unwrap_or(&Mutation::Keepalive(KeepaliveMutation::ClearKeepalive)));
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
            keepalive: None,
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
            Condition::Lease(LeaseCondition::Free { now_ms: 1, fence: 3, lease_id: id.clone() }),
            Condition::Lease(LeaseCondition::FreeAfter { now_ms: 1, fence: 3, lease_id: id.clone() }),
            Condition::Lease(LeaseCondition::Renew {
                lease_id: id.clone(),
                now_ms: 1,
                expires_at_ms: Some(4),
                ttl: true,
            }),
            Condition::Lease(LeaseCondition::Renew { lease_id: id.clone(), now_ms: 1, expires_at_ms: None, ttl: true }),
            Condition::Lease(LeaseCondition::Renew {
                lease_id: id.clone(),
                now_ms: 1,
                expires_at_ms: Some(4),
                ttl: false,
            }),
            Condition::Lease(LeaseCondition::Renew {
                lease_id: id.clone(),
                now_ms: 1,
                expires_at_ms: None,
                ttl: false,
            }),
            Condition::Lease(LeaseCondition::Unreleased { lease_id: id.clone() }),
            Condition::Exists,
            Condition::FenceIs(3),
            Condition::Keepalive(KeepaliveCondition::FenceAndExpiry { fence: 3, expires_at_ms: Some(4) }),
            Condition::Keepalive(KeepaliveCondition::FenceAndExpiry { fence: 3, expires_at_ms: None }),
            Condition::Queue(QueueCondition::Queueable { now_ms: 1, lease_id: id.clone(), start: 5 }),
            Condition::Queue(QueueCondition::HandOver { fence: 3, now_ms: 1, head: 5 }),
            Condition::Queue(QueueCondition::Undelivered { fence: 3, token: "t".into() }),
            Condition::Queue(QueueCondition::UndeliveredLive { fence: 3, token: "t".into() }),
            Condition::Queue(QueueCondition::NotLease),
            Condition::Queue(QueueCondition::WaiterNewer { now_ms: 1 }),
            Condition::Queue(QueueCondition::HandTo {
                lease_id: id.clone(),
                fence: 3,
                now_ms: 1,
                coordinator: "c".into(),
            }),
            Condition::Work(WorkCondition::FreeIn { now_ms: 1, fence: 3, lease_id: id.clone(), visit }),
            Condition::Work(WorkCondition::Enterable { now_ms: 1, state: "S".into(), shard: "S#0".into() }),
            Condition::Lease(LeaseCondition::Live { lease_id: id.clone(), now_ms: 1 }),
            Condition::Queue(QueueCondition::Unqueued { lease_id: id.clone() }),
            Condition::Queue(QueueCondition::ReleaseHandOver { lease_id: id.clone(), fence: 3, now_ms: 1, head: 5 }),
            Condition::Queue(QueueCondition::QueueIdle),
            Condition::Semaphore(SemaphoreCondition::SlotFree { fence: 3, lease_id: id.clone(), slots: 2, now_ms: 1 }),
            Condition::Semaphore(SemaphoreCondition::SlotsAsRead { rev: 3 }),
            Condition::Semaphore(SemaphoreCondition::SlotRenew { lease_id: id.clone(), now_ms: 1, expires_at_ms: 4 }),
            Condition::Semaphore(SemaphoreCondition::SlotUnreleased { lease_id: id.clone() }),
        ];
        let words = ["AND", "OR", "attribute_exists", "attribute_not_exists"];
        for c in &all {
            let mut x = Expr::default();
            let text = condition(&mut x, c);
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
