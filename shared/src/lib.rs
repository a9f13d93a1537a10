//! leasehold: distributed leases with fencing tokens for serverless systems.
//!
//! The protocol ([`Coordinator`]) is written once over a narrow [`store::Store`] trait with
//! two implementations: DynamoDB ([`store::DynamoStore`]) and an embedded SQLite file
//! ([`store::SqliteStore`]). Lambda functions, the local server and the CLI are thin adapters
//! over it. DESIGN.md at the repository root specifies the protocol.
//!
//! The public surface is what adapters and library users call: the re-exports below, the
//! request vocabulary and routers of [`api`], environment wiring in [`env`](mod@env), fenced writes in
//! [`fenced`], the [`store`] trait and its two stores, [`validate`]'s limits, and with the
//! `lambda` feature the Lambda adapter. Everything else is crate-internal.
#![warn(unnameable_types)]

pub mod api;
mod backoff;
mod batch;
pub mod clock;
pub mod env;
mod error;
pub mod fenced;
pub mod history;
mod holder;
mod keepalive;
mod model;
mod protocol;
pub mod queue;
#[cfg(feature = "testing")]
mod random;
pub mod store;
#[cfg(feature = "testing")]
pub mod testing;
pub mod validate;

pub use clock::{Clock, ClockSamples, SystemClock};
pub use error::{Error, ErrorName, NotHolderReason, Result, CLOCK_SKEW_RETRY_AFTER};
pub use fenced::{FenceGuard, FencedError};
pub use holder::{HeldLease, HoldState, Lost};
pub use keepalive::{ExecutionState, Executions, SweepReport};
pub use model::{
    Keepalive, Lease, LeaseId, LeaseState, QueueFields, Record, Released, SemaphoreFields, SlotHolder, SlotState,
    WorkFields,
};
pub use protocol::{AcquireOptions, Config, Coordinator, POLL_ATTEMPTS};

#[cfg(feature = "lambda")]
pub mod lambda;
