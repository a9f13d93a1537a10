//! Work states in the core: a key's state visit, which every acquire writes under and a
//! release can move on (DESIGN.md, "Work items and batch leases"). Batches over the state
//! index are a feature above the core (`batch.rs`).

use super::*;
use crate::store::{keepalive_shard, WorkMutation};

/// Is `r` in the work-state visit `visit` (`None`: in no state)?
pub(crate) fn in_visit(r: &Record, visit: Option<&Visit>) -> bool {
    match visit {
        None => r.work.state.is_none(),
        Some(v) => {
            r.work.state.as_deref() == Some(v.state.as_str())
                && r.work.state_since_ms == Some(v.since_ms)
                && r.work.attempts.unwrap_or(0) == v.attempts
        }
    }
}

impl Coordinator {
    /// Must the TTL of `r` be removed: a key in a work state other than a terminal one, with a
    /// TTL?
    pub(crate) fn keeps_no_ttl(&self, r: &Record) -> bool {
        r.ttl.is_some() && r.work.state.as_deref().is_some_and(|s| !self.is_terminal(s))
    }

    /// The index partition of `key` in `state`: `STATE#n`, n = FNV-1a(key) mod `state_shards`
    /// (a store-level test or tool that writes a visit's condition itself needs it).
    pub fn state_shard(&self, key: &str, state: &str) -> String {
        format!("{state}#{}", keepalive_shard(key, self.config().state_shards.max(1)))
    }

    /// The visit `r` is in, for an acquire that found it free: `NotFound` when a batch lease
    /// (`want`) finds the key in another state than the one it was taken from.
    pub(crate) fn revisit(&self, key: &str, r: &Record, want: Option<&Visit>) -> Result<Option<Visit>> {
        let visit = r.work.state.as_ref().map(|s| Visit {
            state: s.clone(),
            shard: self.state_shard(key, s),
            since_ms: r.work.state_since_ms.unwrap_or(0),
            attempts: r.work.attempts.unwrap_or(0),
        });
        match want {
            Some(w) if visit.as_ref().map(|v| v.state.as_str()) != Some(w.state.as_str()) => {
                Err(Error::NotFound { key: key.to_string() })
            }
            _ => Ok(visit),
        }
    }

    /// A key in a work state is kept until it is taken: a write that gave it a TTL (a release
    /// keeping the state, a heartbeat, a force-release) is followed by one removing it, under
    /// the same fence (a newer grant writes no TTL on a key in a state). Best effort: logged
    /// when it fails (the TTL is then at least `ttl_grace` away). A key in a terminal state
    /// keeps its TTL.
    pub(crate) async fn keep_queued(&self, key: &str, r: &Record) {
        if !self.keeps_no_ttl(r) {
            return;
        }
        let deadline = self.monotonic() + self.config().retry_budget;
        if let Err(f) = self
            .write(key, deadline, |_| Ok((Condition::FenceIs(r.fence), Mutation::Work(WorkMutation::ClearTtl))))
            .await
        {
            let e = f.into_error(key);
            tracing::warn!(key, error = e.name(), "could not remove the TTL of a key in a work state");
        }
    }
}
