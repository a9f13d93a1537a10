//! One error type for every interface, with stable machine names.
//!
//! The names (`LeaseHeld`, `NotHolder`, `NotFound`, `InvalidRequest`, `StoreUnavailable`,
//! `Throttled`, `OutcomeUnknown`, `ClockSkew`) are part of the public contract: they are the `error` field of JSON error
//! bodies, the `errorType` of Lambda function errors (so Step Functions can `Retry`/`Catch`
//! on them) and the variant names here.

use serde_json::{json, Value};

/// Why a caller is not (or no longer) the holder of a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotHolderReason {
    /// The key carries a different lease_id: another holder took it, or the id is wrong.
    WrongLeaseId,
    /// The caller's lease passed its expiry (it must stop working and re-acquire).
    Expired,
    /// The caller's lease was released (by its holder, an operator or the keep-alive sweep).
    Released,
    /// There is no lease item for this key at all.
    Missing,
}

impl NotHolderReason {
    pub fn as_str(self) -> &'static str {
        match self {
            NotHolderReason::WrongLeaseId => "wrong_lease_id",
            NotHolderReason::Expired => "expired",
            NotHolderReason::Released => "released",
            NotHolderReason::Missing => "missing",
        }
    }

    /// True when the caller's lease is gone for good (HTTP 410), false when the key is
    /// held under another lease_id (HTTP 409).
    pub fn is_lost(self) -> bool {
        !matches!(self, NotHolderReason::WrongLeaseId)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("lease on {key:?} is held by {holder:?} {}", until(*expires_at_ms))]
    LeaseHeld { key: String, holder: String, expires_at_ms: Option<u64> },

    #[error("not the holder of the lease on {key:?}: {}", describe(*reason))]
    NotHolder { key: String, reason: NotHolderReason },

    #[error("no lease has ever been taken on {key:?} (or it was swept after expiry)")]
    NotFound { key: String },

    #[error("{0}")]
    InvalidRequest(String),

    #[error("lease store unavailable: {0}")]
    StoreUnavailable(String),

    #[error("lease store throttled the request: {0}")]
    Throttled(String),

    /// The store could not be reached in time and a write of this request may have landed:
    /// retrying the same request with the same lease_id (or releasing with it) is safe.
    #[error("the outcome on {key:?} is unknown: {message}")]
    OutcomeUnknown { key: String, message: String },

    /// This coordinator's clock is certainly further from the store's than the skew margin: it
    /// must not judge or write expiries (DESIGN.md, "Clocks").
    #[error("{0}")]
    ClockSkew(String),
}

fn until(expires_at_ms: Option<u64>) -> String {
    match expires_at_ms {
        Some(ms) => format!("until {ms} (epoch ms)"),
        None => "until released (fail-closed lease)".to_string(),
    }
}

fn describe(reason: NotHolderReason) -> &'static str {
    match reason {
        NotHolderReason::WrongLeaseId => "the key is held under another lease_id",
        NotHolderReason::Expired => "the lease expired",
        NotHolderReason::Released => "the lease was released",
        NotHolderReason::Missing => "there is no lease on this key",
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How the message of a `StoreUnavailable` that was never sent begins (see [`Error::not_sent`]).
const NOT_SENT: &str = "not sent: ";

impl Error {
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidRequest(msg.into())
    }

    /// The stable machine name of this error.
    pub fn name(&self) -> &'static str {
        match self {
            Error::LeaseHeld { .. } => "LeaseHeld",
            Error::NotHolder { .. } => "NotHolder",
            Error::NotFound { .. } => "NotFound",
            Error::InvalidRequest(_) => "InvalidRequest",
            Error::StoreUnavailable(_) => "StoreUnavailable",
            Error::Throttled(_) => "Throttled",
            Error::OutcomeUnknown { .. } => "OutcomeUnknown",
            Error::ClockSkew(_) => "ClockSkew",
        }
    }

    /// A store failure where the request certainly never reached the store (no connection could
    /// be made): unlike a timeout or a lost answer, nothing can have landed.
    pub fn not_sent(msg: impl std::fmt::Display) -> Self {
        Error::StoreUnavailable(format!("{NOT_SENT}{msg}"))
    }

    /// Could a write that failed with this error have landed all the same? Throttles and
    /// requests that were never sent did not; a timeout, a lost answer or a 5xx may have.
    pub fn may_have_landed(&self) -> bool {
        match self {
            Error::StoreUnavailable(m) => !m.starts_with(NOT_SENT),
            Error::OutcomeUnknown { .. } => true,
            _ => false,
        }
    }

    /// Errors that may succeed when the same request is sent again.
    pub fn is_transient(&self) -> bool {
        matches!(self, Error::StoreUnavailable(_) | Error::Throttled(_))
    }

    /// `{"error": NAME, "message": ..., <details>}`: the body of every JSON error.
    pub fn to_json(&self) -> Value {
        let mut body = json!({ "error": self.name(), "message": self.to_string() });
        let obj = body.as_object_mut().expect("object");
        match self {
            Error::LeaseHeld { key, holder, expires_at_ms } => {
                obj.insert("key".into(), json!(key));
                obj.insert("holder".into(), json!(holder));
                obj.insert("expires_at_ms".into(), json!(expires_at_ms));
            }
            Error::NotHolder { key, reason } => {
                obj.insert("key".into(), json!(key));
                obj.insert("reason".into(), json!(reason.as_str()));
            }
            Error::NotFound { key } | Error::OutcomeUnknown { key, .. } => {
                obj.insert("key".into(), json!(key));
            }
            _ => {}
        }
        body
    }
}
