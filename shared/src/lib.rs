//! leasehold: distributed leases with fencing tokens for serverless systems.
//!
//! The protocol ([`Coordinator`]) is written once over a narrow [`store::Store`] trait with
//! two implementations: DynamoDB ([`store::DynamoStore`]) and an embedded SQLite file
//! ([`store::SqliteStore`]). Lambda functions, the local server and the CLI are thin adapters
//! over it. DESIGN.md at the repository root specifies the protocol.

pub mod api;
pub mod backoff;
pub mod batch;
pub mod clock;
pub mod env;
pub mod error;
pub mod fenced;
pub mod holder;
pub mod keepalive;
pub mod model;
pub mod pacing;
pub mod protocol;
pub mod store;
pub mod validate;

pub use error::{Error, ErrorName, NotHolderReason, Result};
pub use fenced::{FenceGuard, FencedError};
pub use holder::{HeldLease, HoldState, Lost};
pub use model::{Keepalive, Lease, LeaseId, LeaseState, Record, Released};
pub use protocol::{AcquireOptions, Config, Coordinator};

#[cfg(feature = "lambda")]
pub mod lambda;
