//! Reads for operators and callers: one key's public state, and the keys held now (never a
//! lease_id).

use super::*;

impl Coordinator {
    /// The public state of `key` (never the lease_id).
    pub async fn get(&self, key: &str) -> Result<LeaseState> {
        self.config.limits.key(key)?;
        let deadline = self.monotonic() + self.config.retry_budget;
        match self.read(deadline, || self.store.get(key)).await? {
            Some(r) => Ok(r.state(self.now_ms())),
            None => Err(Error::NotFound { key: key.to_string() }),
        }
    }

    /// Keys held right now, at most `limit` of them, in the store's order.
    pub async fn list(&self, limit: usize) -> Result<Vec<LeaseState>> {
        self.list_prefix("", limit).await
    }

    /// Keys held right now that start with `prefix`, at most `limit` of them, in the store's
    /// order. The filter runs over the full scan (an operator listing, not a hot path).
    pub async fn list_prefix(&self, prefix: &str, limit: usize) -> Result<Vec<LeaseState>> {
        let mut out = Vec::new();
        let mut start: Option<String> = None;
        loop {
            let deadline = self.monotonic() + self.config.retry_budget;
            let page = self.read(deadline, || self.store.scan(&ScanKind::All, start.as_deref(), 100)).await?;
            let now = self.now_ms();
            let states =
                page.items.iter().filter(|r| r.shows_held(now) && r.key.starts_with(prefix)).map(|r| r.state(now));
            // A semaphore's item has no expiry: it is held while a holder is live.
            out.extend(states.filter(|s| s.held));
            if out.len() >= limit {
                out.truncate(limit);
                return Ok(out);
            }
            match page.next {
                Some(n) => start = Some(n),
                None => return Ok(out),
            }
        }
    }
}
