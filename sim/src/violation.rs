//! What the run and its checker report: one broken promise of the protocol, with the key's
//! history around it.

use std::time::Instant;

/// One broken promise.
#[derive(Debug, Clone)]
pub struct Violation {
    pub kind: &'static str,
    pub key: String,
    pub message: String,
    /// The history of the key around it (filled in at the end of the run).
    pub history: Vec<String>,
    /// When it happened, when known (the history shown ends shortly after).
    pub at: Option<Instant>,
    /// A known finding of the protocol, written down (sim/README.md, "Known findings") and not yet
    /// fixed: reported, not counted as a violation.
    pub known: bool,
}

impl Violation {
    pub(crate) fn new(kind: &'static str, key: &str, message: String) -> Self {
        Violation {
            kind,
            key: key.to_string(),
            message,
            history: Vec::new(),
            at: Some(tokio::time::Instant::now().into_std()),
            known: false,
        }
    }
}
