//! In-process waiters: acquires of one coordinator that wait for the same key line up in
//! arrival order, and a release, force-release or expiry this coordinator handles wakes the
//! head one at once (DESIGN.md, "In-process waiters"). Waiters behind the head make no request
//! at all; the head keeps a bounded fallback poll, since another process may free the key and
//! an expiry has no event.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

/// Each key's line: (ticket id, its wake-up), oldest first.
type Lines = HashMap<String, VecDeque<(u64, Arc<Notify>)>>;

/// The per-key lines of waiting acquires of one coordinator.
#[derive(Debug, Default)]
pub struct Wakeups {
    keys: Mutex<Lines>,
    next: AtomicU64,
}

/// One waiting acquire's place in its key's line. Leaving (drop) passes the turn on when this
/// waiter gave up without the key.
#[derive(Debug)]
pub struct Ticket {
    wakeups: Arc<Wakeups>,
    key: String,
    id: u64,
    notify: Arc<Notify>,
    /// Set when this waiter took the key: its leaving wakes nobody (the key is held).
    pub granted: bool,
}

impl Wakeups {
    /// Joins the end of `key`'s line.
    pub fn enter(self: &Arc<Self>, key: &str) -> Ticket {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let notify = Arc::new(Notify::new());
        self.lock().entry(key.to_string()).or_default().push_back((id, notify.clone()));
        Ticket { wakeups: self.clone(), key: key.to_string(), id, notify, granted: false }
    }

    /// The key was freed by this coordinator: the head waiter tries at once.
    pub fn wake(&self, key: &str) {
        if let Some(n) = self.lock().get(key).and_then(|q| q.front()).map(|(_, n)| n.clone()) {
            n.notify_one();
        }
    }

    /// How many acquires of this coordinator wait for `key`.
    pub fn waiting(&self, key: &str) -> usize {
        self.lock().get(key).map_or(0, VecDeque::len)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lines> {
        self.keys.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Ticket {
    /// Is this waiter at the head of its line (the one that tries)?
    pub fn is_head(&self) -> bool {
        self.wakeups.lock().get(&self.key).and_then(|q| q.front()).is_some_and(|(id, _)| *id == self.id)
    }

    /// Sleeps `pause` or until woken, whichever comes first.
    pub async fn wait(&self, pause: Duration) {
        let _ = tokio::time::timeout(pause, self.notify.notified()).await;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut keys = self.wakeups.lock();
        let Some(q) = keys.get_mut(&self.key) else { return };
        let was_head = q.front().is_some_and(|(id, _)| *id == self.id);
        q.retain(|(id, _)| *id != self.id);
        let next = q.front().map(|(_, n)| n.clone());
        if q.is_empty() {
            keys.remove(&self.key);
        }
        drop(keys);
        // A head that leaves without the key (gave up, failed) hands the turn on: the next one
        // tries now. A head that took the key wakes nobody: the next one waits for the release
        // (or its fallback poll), so no request is wasted on a key just taken.
        if let Some(n) = next.filter(|_| was_head && !self.granted) {
            n.notify_one();
        }
    }
}
