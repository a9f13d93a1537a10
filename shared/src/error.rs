//! One error type for every interface, with stable machine names.
//!
//! The names (`LeaseHeld`, `NotHolder`, `NotFound`, `InvalidRequest`, `StoreUnavailable`,
//! `Throttled`, `OutcomeUnknown`, `ClockSkew`, `StoreRefused`) are part of the public
//! contract: they are the `error` field of JSON error bodies, the `errorType` of Lambda
//! function errors (so Step Functions can `Retry`/`Catch` on them) and the variant names here.

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

/// Every `error` name an interface answers with: the [`Error`] variants, and the HTTP
/// router's own two. Adapters map from it (Lambda `errorType`, CLI exit codes, metrics), never
/// from the text of a body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorName {
    LeaseHeld,
    NotHolder,
    NotFound,
    InvalidRequest,
    StoreUnavailable,
    Throttled,
    OutcomeUnknown,
    ClockSkew,
    StoreRefused,
    /// HTTP only: no route for the path (or not on this function).
    UnknownRoute,
    /// HTTP only: the route takes another method (with `Allow`).
    MethodNotAllowed,
}

impl ErrorName {
    pub const ALL: [ErrorName; 11] = [
        ErrorName::LeaseHeld,
        ErrorName::NotHolder,
        ErrorName::NotFound,
        ErrorName::InvalidRequest,
        ErrorName::StoreUnavailable,
        ErrorName::Throttled,
        ErrorName::OutcomeUnknown,
        ErrorName::ClockSkew,
        ErrorName::StoreRefused,
        ErrorName::UnknownRoute,
        ErrorName::MethodNotAllowed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorName::LeaseHeld => "LeaseHeld",
            ErrorName::NotHolder => "NotHolder",
            ErrorName::NotFound => "NotFound",
            ErrorName::InvalidRequest => "InvalidRequest",
            ErrorName::StoreUnavailable => "StoreUnavailable",
            ErrorName::Throttled => "Throttled",
            ErrorName::OutcomeUnknown => "OutcomeUnknown",
            ErrorName::ClockSkew => "ClockSkew",
            ErrorName::StoreRefused => "StoreRefused",
            ErrorName::UnknownRoute => "UnknownRoute",
            ErrorName::MethodNotAllowed => "MethodNotAllowed",
        }
    }

    /// The name an answer carries (`None`: not one of ours).
    pub fn parse(name: &str) -> Option<ErrorName> {
        ErrorName::ALL.into_iter().find(|n| n.as_str() == name)
    }
}

impl std::fmt::Display for ErrorName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&Error> for ErrorName {
    fn from(e: &Error) -> ErrorName {
        e.error_name()
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
    /// `lease_id`: an acquire's lease_id (the caller's own or the generated one), so a caller
    /// who let the coordinator choose can release what may have landed; `leases`: for a batch,
    /// every `(key, lease_id)` it may have taken.
    #[error("the outcome on {key:?} is unknown{}: {message}", lease_hint(lease_id.as_deref(), leases))]
    OutcomeUnknown { key: String, message: String, lease_id: Option<String>, leases: Vec<(String, String)> },

    /// This coordinator's clock is certainly further from the store's than the skew margin: it
    /// must not judge or write expiries (DESIGN.md, "Clocks"). It lasts until the clock is
    /// fixed: callers retry no sooner than [`CLOCK_SKEW_RETRY_AFTER`].
    #[error("{0}")]
    ClockSkew(String),

    /// The store refused the request as one it will never accept (DynamoDB's
    /// `ValidationException`: an item or expression past its limits; a missing table; no
    /// permission): nothing was written, and sending the same request again gets the same
    /// answer, so it is not retried.
    #[error("lease store refused the request: {0}")]
    StoreRefused(String),
}

/// How long a caller waits before retrying after `ClockSkew` (`Retry-After` over HTTP,
/// `retry_after_ms` in the body): a wrong clock is not fixed in milliseconds, and a hot retry
/// loop only loads the store.
pub const CLOCK_SKEW_RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(5);

fn lease_hint(lease_id: Option<&str>, leases: &[(String, String)]) -> String {
    match (lease_id, leases.len()) {
        (Some(id), _) => format!(" (lease_id {id})"),
        (None, 0) => String::new(),
        (None, n) => format!(" ({n} leases may have been taken)"),
    }
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

    /// `OutcomeUnknown` on `key` without a lease_id to report.
    pub fn outcome_unknown(key: impl Into<String>, message: impl Into<String>) -> Self {
        Error::OutcomeUnknown { key: key.into(), message: message.into(), lease_id: None, leases: Vec::new() }
    }

    /// This error, carrying the acquire's `lease_id` when it is `OutcomeUnknown`.
    pub fn with_lease_id(self, id: &crate::model::LeaseId) -> Self {
        match self {
            Error::OutcomeUnknown { key, message, leases, .. } => {
                Error::OutcomeUnknown { key, message, lease_id: Some(id.expose().to_string()), leases }
            }
            e => e,
        }
    }

    /// The lease_ids an `OutcomeUnknown` says may have been taken (an acquire's one, or a
    /// batch's), with their keys.
    pub fn unknown_leases(&self) -> Vec<(String, String)> {
        match self {
            Error::OutcomeUnknown { key, lease_id: Some(id), .. } => vec![(key.clone(), id.clone())],
            Error::OutcomeUnknown { leases, .. } => leases.clone(),
            _ => Vec::new(),
        }
    }

    /// How long to wait before sending the same request again, when the error says (`ClockSkew`).
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        matches!(self, Error::ClockSkew(_)).then_some(CLOCK_SKEW_RETRY_AFTER)
    }

    /// The stable machine name of this error, as text (logs, metrics).
    pub fn name(&self) -> &'static str {
        self.error_name().as_str()
    }

    /// The stable machine name of this error.
    pub fn error_name(&self) -> ErrorName {
        match self {
            Error::LeaseHeld { .. } => ErrorName::LeaseHeld,
            Error::NotHolder { .. } => ErrorName::NotHolder,
            Error::NotFound { .. } => ErrorName::NotFound,
            Error::InvalidRequest(_) => ErrorName::InvalidRequest,
            Error::StoreUnavailable(_) => ErrorName::StoreUnavailable,
            Error::Throttled(_) => ErrorName::Throttled,
            Error::OutcomeUnknown { .. } => ErrorName::OutcomeUnknown,
            Error::ClockSkew(_) => ErrorName::ClockSkew,
            Error::StoreRefused(_) => ErrorName::StoreRefused,
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
        matches!(self, Error::StoreUnavailable(_) | Error::Throttled(_) | Error::OutcomeUnknown { .. })
    }

    /// `{"error": NAME, "message": ..., <details>}`: the body of every JSON error.
    pub fn to_json(&self) -> Value {
        let mut body = json!({ "error": self.error_name().as_str(), "message": self.to_string() });
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
            Error::NotFound { key } => {
                obj.insert("key".into(), json!(key));
            }
            Error::OutcomeUnknown { key, lease_id, leases, .. } => {
                obj.insert("key".into(), json!(key));
                if let Some(id) = lease_id {
                    obj.insert("lease_id".into(), json!(id));
                }
                if !leases.is_empty() {
                    let l: Vec<Value> = leases.iter().map(|(k, id)| json!({"key": k, "lease_id": id})).collect();
                    obj.insert("leases".into(), Value::Array(l));
                }
            }
            Error::ClockSkew(_) => {
                obj.insert("retry_after_ms".into(), json!(CLOCK_SKEW_RETRY_AFTER.as_millis() as u64));
            }
            _ => {}
        }
        body
    }
}
