//! The writes of the protocol, as data: one variant per kind of lease, each wrapping that
//! kind's own mutations (`kinds/`). What each writes is [`Mutation::apply`] (the reference
//! semantics the embedded store and the test store evaluate, and what the DynamoDB expressions
//! rendered beside it do), which delegates to the kind.

use super::kinds::{KeepaliveMutation, LeaseMutation, QueueMutation, SemaphoreMutation, WorkMutation};
use crate::model::Record;

/// The writes of the protocol. Semantics are defined by [`Mutation::apply`].
#[derive(Debug, Clone, PartialEq)]
pub enum Mutation {
    /// The plain lease's: acquire, heartbeat, release, force-release.
    Lease(LeaseMutation),
    /// Waiters': the waiter queue, and in-process hand-overs.
    Queue(QueueMutation),
    /// Work states'.
    Work(WorkMutation),
    /// Semaphores'.
    Semaphore(SemaphoreMutation),
    /// The keep-alive sweep's.
    Keepalive(KeepaliveMutation),
}

impl Mutation {
    /// Reference semantics: the item after the write. `old` is the item the condition held for.
    pub fn apply(&self, key: &str, old: Option<&Record>) -> Record {
        match self {
            Mutation::Lease(m) => m.apply(key, old),
            Mutation::Queue(m) => m.apply(key, old),
            Mutation::Work(m) => m.apply(key, old),
            Mutation::Semaphore(m) => m.apply(old),
            Mutation::Keepalive(m) => m.apply(old),
        }
    }
}

/// A kind's mutation is a [`Mutation`].
macro_rules! kind_mutation {
    ($($variant:ident($kind:ty)),*) => {$(
        impl From<$kind> for Mutation {
            fn from(m: $kind) -> Mutation {
                Mutation::$variant(m)
            }
        }
    )*};
}

kind_mutation!(
    Lease(LeaseMutation),
    Queue(QueueMutation),
    Work(WorkMutation),
    Semaphore(SemaphoreMutation),
    Keepalive(KeepaliveMutation)
);
