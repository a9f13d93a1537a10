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

use crate::clock::{Clock, SystemClock};
use crate::model::Record;
use crate::store::NewLease;

/// What a sleeping head waiter offers a releaser: its lease, to be granted in the release's
/// own write (the fence and clock are the releaser's to fill in).
#[derive(Debug, Clone)]
pub struct Offer {
    pub lease: NewLease,
}

/// A waiter's hand-over state.
#[derive(Debug)]
// One per waiting acquire: boxing the offer would only add an allocation per sleep.
#[allow(clippy::large_enum_variant)]
enum Hand {
    /// Trying or sleeping; `Some` while it sleeps and takes a hand-over.
    Open(Option<Offer>),
    /// A releaser is writing the grant: the waiter must await the outcome.
    Claimed,
    /// The releaser's write granted it: the item as written, when the releaser sent it.
    Granted(Box<Record>, std::time::Instant, u64),
    /// The waiter left (its acquire answered, or its future was dropped): nothing may be
    /// granted to it any more, and a releaser that was writing its grant gives it back.
    Gone,
}

/// A waiter's wake-up and hand-over slot.
#[derive(Debug)]
struct Slot {
    notify: Notify,
    hand: Mutex<Hand>,
}

/// Each key's line: (ticket id, its slot), oldest first.
type Lines = HashMap<String, VecDeque<(u64, Arc<Slot>)>>;

/// The per-key lines of waiting acquires of one coordinator.
#[derive(Debug)]
pub struct Wakeups {
    keys: Mutex<Lines>,
    next: AtomicU64,
    /// Keys this coordinator left free for a waiter of another process, and until when its
    /// own waiters hold back (DESIGN.md, "In-process waiters": fairness across processes).
    held_back: Mutex<HashMap<String, std::time::Instant>>,
    clock: Arc<dyn Clock>,
}

impl Default for Wakeups {
    fn default() -> Self {
        Wakeups::new(Arc::new(SystemClock))
    }
}

/// Keys remembered as held back at most; expired entries are dropped when it is reached.
const MAX_HELD_BACK: usize = 1024;

/// One waiting acquire's place in its key's line. Leaving (drop) passes the turn on when this
/// waiter gave up without the key.
#[derive(Debug)]
pub struct Ticket {
    wakeups: Arc<Wakeups>,
    key: String,
    id: u64,
    slot: Arc<Slot>,
    /// Set when this waiter took the key: its leaving wakes nobody (the key is held).
    pub granted: bool,
}

impl Wakeups {
    pub(crate) fn new(clock: Arc<dyn Clock>) -> Self {
        Wakeups { keys: Mutex::default(), next: AtomicU64::new(0), held_back: Mutex::default(), clock }
    }

    /// Joins the end of `key`'s line.
    pub fn enter(self: &Arc<Self>, key: &str) -> Ticket {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(Slot { notify: Notify::new(), hand: Mutex::new(Hand::Open(None)) });
        self.lock().entry(key.to_string()).or_default().push_back((id, slot.clone()));
        Ticket { wakeups: self.clone(), key: key.to_string(), id, slot, granted: false }
    }

    /// The key was freed by this coordinator: the head waiter tries at once.
    pub fn wake(&self, key: &str) {
        if let Some(s) = self.head(key) {
            s.notify.notify_one();
        }
    }

    /// Is the head waiter of `key` asleep, offering its lease to a release?
    pub fn head_offers(&self, key: &str) -> bool {
        self.head(key)
            .is_some_and(|s| matches!(&*s.hand.lock().unwrap_or_else(|e| e.into_inner()), Hand::Open(Some(_))))
    }

    fn head(&self, key: &str) -> Option<Arc<Slot>> {
        self.lock().get(key).and_then(|q| q.front()).map(|(_, s)| s.clone())
    }

    /// A releaser of `key` claims the sleeping head waiter's offer, to grant it the lease in the
    /// release's own write. The claim must be settled with [`Claim::granted`] or dropped
    /// (the waiter then tries by itself).
    pub fn claim(&self, key: &str) -> Option<Claim> {
        let slot = self.head(key)?;
        let mut hand = slot.hand.lock().unwrap_or_else(|e| e.into_inner());
        let Hand::Open(Some(offer)) = &*hand else { return None };
        let offer = offer.clone();
        *hand = Hand::Claimed;
        drop(hand);
        Some(Claim { slot, offer: Some(offer) })
    }

    /// This coordinator's waiters of `key` make no attempt for `for_`: the key was left free for
    /// a waiter of another process, which polls.
    pub fn hold_back(&self, key: &str, for_: Duration) {
        let until = self.clock.now() + for_;
        let mut held = self.held_back.lock().unwrap_or_else(|e| e.into_inner());
        if held.len() >= MAX_HELD_BACK {
            let now = self.clock.now();
            held.retain(|_, u| *u > now);
        }
        held.insert(key.to_string(), until);
    }

    /// The key left free was taken: this coordinator's waiters of `key` hold back no longer.
    pub fn end_hold_back(&self, key: &str) {
        self.held_back.lock().unwrap_or_else(|e| e.into_inner()).remove(key);
    }

    /// Until when this coordinator's waiters of `key` hold back, if they do.
    pub fn held_back(&self, key: &str) -> Option<std::time::Instant> {
        let mut held = self.held_back.lock().unwrap_or_else(|e| e.into_inner());
        match held.get(key) {
            Some(u) if *u > self.clock.now() => Some(*u),
            Some(_) => {
                held.remove(key);
                None
            }
            None => None,
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

/// A releaser's claim on a head waiter's offer.
#[derive(Debug)]
pub struct Claim {
    slot: Arc<Slot>,
    offer: Option<Offer>,
}

impl Claim {
    pub fn offer(&self) -> &Offer {
        self.offer.as_ref().expect("claimed offer")
    }

    /// The release's write granted the waiter: hand it the item as written. `Err` with the
    /// granted lease_id when the waiter left while the grant was being written (its acquire was
    /// dropped): the grant is nobody's, and the releaser must release it at once.
    pub fn granted(mut self, r: Record, sent: std::time::Instant, now_ms: u64) -> Result<(), crate::model::LeaseId> {
        self.offer = None;
        let mut hand = self.slot.hand.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(*hand, Hand::Gone) {
            return Err(r.lease_id);
        }
        *hand = Hand::Granted(Box::new(r), sent, now_ms);
        drop(hand);
        self.slot.notify.notify_one();
        Ok(())
    }
}

impl Drop for Claim {
    /// Not granted: the offer goes back and the waiter is woken to try by itself (unless it
    /// left meanwhile).
    fn drop(&mut self) {
        if let Some(offer) = self.offer.take() {
            let mut hand = self.slot.hand.lock().unwrap_or_else(|e| e.into_inner());
            if !matches!(*hand, Hand::Gone) {
                *hand = Hand::Open(Some(offer));
                drop(hand);
                self.slot.notify.notify_one();
            }
        }
    }
}

impl Ticket {
    /// Is this waiter at the head of its line (the one that tries)?
    pub fn is_head(&self) -> bool {
        self.wakeups.lock().get(&self.key).and_then(|q| q.front()).is_some_and(|(id, _)| *id == self.id)
    }

    /// Sleeps `pause` or until woken, whichever comes first, offering `offer` to a releaser meanwhile. Returns the
    /// grant (the item as written, the releaser's send instant and clock) if a release handed
    /// the key over; the offer is withdrawn before returning, so no grant lands after it. A grant
    /// being written when the pause ends is waited for until `deadline` (the acquire's own): then
    /// the waiter leaves (a grant landing later is given back) and offers nothing again.
    pub async fn wait_offering(
        &self,
        pause: Duration,
        offer: Offer,
        deadline: std::time::Instant,
    ) -> Option<(Record, std::time::Instant, u64)> {
        let gone = {
            let mut hand = self.hand();
            let gone = matches!(*hand, Hand::Gone);
            if !gone {
                *hand = Hand::Open(Some(offer));
            }
            gone
        };
        if gone {
            tokio::time::sleep(pause).await;
            return None;
        }
        let _ = tokio::time::timeout(pause, self.slot.notify.notified()).await;
        loop {
            {
                let mut hand = self.hand();
                match std::mem::replace(&mut *hand, Hand::Open(None)) {
                    Hand::Granted(r, sent, now) => return Some((*r, sent, now)),
                    Hand::Open(_) => return None,
                    Hand::Gone => {
                        *hand = Hand::Gone;
                        return None;
                    }
                    Hand::Claimed => *hand = Hand::Claimed,
                }
            }
            // A releaser is writing this waiter's grant: its outcome comes within that write,
            // unless the acquire's deadline comes first.
            if tokio::time::timeout_at(deadline.into(), self.slot.notify.notified()).await.is_err() {
                return match std::mem::replace(&mut *self.hand(), Hand::Gone) {
                    Hand::Granted(r, sent, now) => Some((*r, sent, now)),
                    _ => None,
                };
            }
        }
    }

    /// Sleeps `pause` or until woken, whichever comes first, offering nothing: a semaphore's
    /// waiter, woken by a slot this coordinator frees, takes it by itself.
    pub async fn wait_woken(&self, pause: Duration) {
        let _ = tokio::time::timeout(pause, self.slot.notify.notified()).await;
    }

    /// Has this waiter left (its deadline came while a release was writing its grant)?
    pub fn departed(&self) -> bool {
        matches!(*self.hand(), Hand::Gone)
    }

    fn hand(&self) -> std::sync::MutexGuard<'_, Hand> {
        self.slot.hand.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// This waiter leaves: from now on no release grants it anything (a release writing its
    /// grant right now is told so when its write lands, and gives the grant back). Returns a
    /// grant that landed and was never read (the acquire was dropped between the grant and its
    /// reading): the caller must release it.
    pub fn depart(&mut self) -> Option<(Record, std::time::Instant, u64)> {
        match std::mem::replace(&mut *self.hand(), Hand::Gone) {
            Hand::Granted(r, sent, now) => Some((*r, sent, now)),
            _ => None,
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some((r, _, _)) = self.depart() {
            // Without a guard that releases it (see `protocol`), the grant expires on its own.
            tracing::warn!(key = %r.key, "a hand-over grant was left unread by a departed waiter");
        }
        let mut keys = self.wakeups.lock();
        let Some(q) = keys.get_mut(&self.key) else { return };
        let was_head = q.front().is_some_and(|(id, _)| *id == self.id);
        q.retain(|(id, _)| *id != self.id);
        let next = q.front().map(|(_, s)| s.clone());
        if q.is_empty() {
            keys.remove(&self.key);
        }
        drop(keys);
        // A head that leaves without the key (gave up, failed) hands the turn on: the next one
        // tries now. A head that took the key wakes nobody: the next one waits for the release
        // (or its fallback poll), so no request is wasted on a key just taken.
        if let Some(s) = next.filter(|_| was_head && !self.granted) {
            s.notify.notify_one();
        }
    }
}
