//! The core's extension point for features that act inside a release (DESIGN.md, "Code
//! map"). The core calls these at fixed points and knows nothing of what they do; the waiter
//! queue (`queue/`) is the one feature that plugs in here today.

use async_trait::async_trait;

use super::*;

/// A feature acting at a release of this coordinator.
#[async_trait]
pub(crate) trait ReleaseHook: Send + Sync + 'static {
    /// The release of the live lease `lease_id` found its item `r` with waiters queued (the
    /// release's own write is conditional on there being none): release it by granting the
    /// head waiter, in one write of the feature's making. `None`: not done; the core's
    /// ordinary release follows, and then [`ReleaseHook::freed`].
    async fn release_queued(
        &self,
        c: &Coordinator,
        key: &str,
        lease_id: &LeaseId,
        r: &Record,
    ) -> Result<Option<Released>>;

    /// A write of this coordinator left `key` free (`r`, the item as written).
    async fn freed(&self, c: &Coordinator, key: &str, r: &Record);

    /// The feature itself, for its own methods on [`Coordinator`].
    fn as_any(&self) -> &dyn std::any::Any;
}

impl Coordinator {
    /// A write of this coordinator left `key` free: the release hook acts, if there is one.
    pub(crate) async fn after_free(&self, key: &str, r: &Record) {
        if let Some(h) = &self.release_hook {
            h.freed(self, key, r).await;
        }
    }
}
