//! Lease history: who held a key when, with which fence (DESIGN.md, "Lease history").
//!
//! The events themselves are derived in the store layer ([`crate::store::events`], re-exported
//! here), since the embedded store writes them in each write's own transaction. This module
//! adds the history on AWS: the history table the history function fills from the lease
//! table's stream, and `leasehold history --table` reads ([`dynamo`]). The history function's
//! Lambda handler is an adapter (`lambda::history`, feature `streams`).

pub mod dynamo;

pub use crate::store::events::{
    counted, events, retention, set_interface, Event, EventKind, DEFAULT_RETENTION, LEASE_ID_PREFIX_CHARS,
};
