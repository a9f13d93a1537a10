//! The conditions a write is made under, as data: one variant per kind of lease, each wrapping
//! that kind's own conditions (`kinds/`), and the two that every kind uses. What each means is
//! [`Condition::holds`] (the reference semantics the embedded store and the test store
//! evaluate), which delegates to the kind; the DynamoDB expression the production store sends
//! for each is in its documentation, and rendered beside its kind's semantics.

use super::kinds::{KeepaliveCondition, LeaseCondition, QueueCondition, SemaphoreCondition, WorkCondition};
use crate::model::Record;

/// Conditions a write is made under. Semantics are defined by [`Condition::holds`]; the
/// DynamoDB text of each is in DESIGN.md, and a test renders each and compares.
#[derive(Debug, Clone, PartialEq)]
pub enum Condition {
    /// The plain lease's: acquire, heartbeat, release.
    Lease(LeaseCondition),
    /// Waiters': the waiter queue, and in-process hand-overs.
    Queue(QueueCondition),
    /// Work states'.
    Work(WorkCondition),
    /// Semaphores'.
    Semaphore(SemaphoreCondition),
    /// The keep-alive sweep's.
    Keepalive(KeepaliveCondition),
    /// The item exists (an operator's force-release, of any item). DynamoDB:
    /// `attribute_exists(#key)`
    Exists,
    /// The item's last fence is `fence`: the same lease as when it was read (every grant and
    /// force-release changes the fence). DynamoDB: `fence = :expected_fence`
    FenceIs(u64),
}

impl Condition {
    /// Reference semantics: does the condition hold for the current item (`None`: no item)?
    pub fn holds(&self, item: Option<&Record>) -> bool {
        match self {
            Condition::Lease(c) => c.holds(item),
            Condition::Queue(c) => c.holds(item),
            Condition::Work(c) => c.holds(item),
            Condition::Semaphore(c) => c.holds(item),
            Condition::Keepalive(c) => c.holds(item),
            Condition::Exists => item.is_some(),
            Condition::FenceIs(f) => item.is_some_and(|r| r.fence == *f),
        }
    }
}

/// A kind's condition is a [`Condition`].
macro_rules! kind_condition {
    ($($variant:ident($kind:ty)),*) => {$(
        impl From<$kind> for Condition {
            fn from(c: $kind) -> Condition {
                Condition::$variant(c)
            }
        }
    )*};
}

kind_condition!(
    Lease(LeaseCondition),
    Queue(QueueCondition),
    Work(WorkCondition),
    Semaphore(SemaphoreCondition),
    Keepalive(KeepaliveCondition)
);
