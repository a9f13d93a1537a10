//! The lease record as stored, and the views of it handed to holders and observers.

use std::fmt;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The holder's secret. Serialised as a plain string; never printed by `Debug`/`Display`, so
/// a lease_id cannot reach a log line through formatting. The default is the empty lease_id,
/// which no caller can send and the coordinator never generates (a record that carries only
/// its key).
#[derive(Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct LeaseId(String);

impl LeaseId {
    /// 128 bits from the operating system's CSPRNG, as 32 lowercase hex characters.
    pub fn generate() -> Self {
        // A simulation (feature `testing`) draws ids from its seeded generator, so that a seed
        // replays exactly.
        #[cfg(feature = "testing")]
        if let Some(a) = crate::random::next_u64() {
            let b = crate::random::next_u64().unwrap_or(0);
            return LeaseId(format!("{a:016x}{b:016x}"));
        }
        let mut bytes = [0u8; 16];
        getrandom::fill(&mut bytes).expect("the operating system CSPRNG is unavailable");
        // The bytes in order, two hex digits each: one allocation, not one per byte.
        LeaseId(format!("{:032x}", u128::from_be_bytes(bytes)))
    }

    /// Wraps a caller-supplied id; validate it with `validate::lease_id` first.
    pub fn from_string(s: impl Into<String>) -> Self {
        LeaseId(s.into())
    }

    /// The secret itself, for storage and for handing back to the holder.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LeaseId(<redacted>)")
    }
}

/// Furthest a keep-alive deadline (`keepalive.until_ms`) may be ahead of its acquire: a year,
/// the longest a standard execution runs, and a day (validated at acquire).
pub const KEEPALIVE_HORIZON_MS: u64 = 366 * 24 * 3600 * 1000;

/// "Renew me until `until_ms`, and only while this Step Functions execution is RUNNING."
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Keepalive {
    pub until_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub execution_arn: Option<String>,
}

/// One item of the lease table, exactly as both stores keep it. See DESIGN.md for the schema.
///
/// The fields every item has come first (a plain lease's); the fields of each other kind of
/// lease are grouped by kind ([`QueueFields`], [`WorkFields`], [`SemaphoreFields`]), each empty
/// by default. The groups are flattened on the wire: the JSON the embedded store keeps (and
/// the attribute names of the DynamoDB item, `store::dynamo::item`) are those of one flat
/// record, field for field in this order.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub key: String,
    /// Last fencing token issued for this key (kept after release).
    pub fence: u64,
    /// Holder of the current or last lease.
    pub holder: String,
    /// Secret of the current or last lease (kept after release so a retried release is idempotent).
    pub lease_id: LeaseId,
    pub acquired_at_ms: u64,
    /// `None`: fail-closed lease, held until released or force-released.
    pub expires_at_ms: Option<u64>,
    /// The lease's duration (`None` for fail-closed leases); heartbeats extend by it by default.
    pub duration_ms: Option<u64>,
    /// A release never frees the key before this instant (acquired_at + min_hold).
    pub min_hold_until_ms: u64,
    pub released_at_ms: Option<u64>,
    pub metadata: Option<Map<String, Value>>,
    pub keepalive: Option<Keepalive>,
    /// DynamoDB TTL attribute (epoch seconds); `None` while a fail-closed lease is held.
    pub ttl: Option<u64>,
    /// The coordinator clock (ms) of the last write that set the expiry (acquire or heartbeat).
    /// Heartbeats are ordered by it: one whose clock reading is not above it (a delayed
    /// duplicate landing after its retry) is refused, so the expiry never moves backwards.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renewed_at_ms: Option<u64>,
    /// How often waiters poll this key (ms), learned by the acquirers that contended for it
    /// (DESIGN.md, "Contention"). `None` until the key has been contended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub poll_ms: Option<u64>,
    /// Waiters: the waiter queue and in-process hand-overs.
    #[serde(flatten)]
    pub queue: QueueFields,
    /// Work states.
    #[serde(flatten)]
    pub work: WorkFields,
    /// Semaphores.
    #[serde(flatten)]
    pub semaphore: SemaphoreFields,
}

/// A [`Record`]'s fields of waiting for a key: the waiter queue's (DESIGN.md, "The waiter
/// queue"), and the marks of in-process hand-overs ("In-process waiters").
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct QueueFields {
    /// Set by an in-process hand-over (DESIGN.md, "In-process waiters"): the id of the
    /// coordinator whose line this lease came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handed_in: Option<String>,
    /// Set by a waiter of another coordinator while this lease (from a line, `handed_in`) holds
    /// the key: that coordinator's id. The releaser then leaves the key free for it instead of
    /// handing it over again. Kept apart from `handed_in`, so that a mark never hides whose line
    /// the lease came from (a waiter of that very line would otherwise take the mark for a
    /// hand-over elsewhere and overwrite it with its own coordinator's id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub awaited_by: Option<String>,
    /// Lease items with a queue (DESIGN.md, "The waiter queue"): the sequence number of the
    /// last waiter served (granted or skipped) ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_head: Option<u64>,
    /// ... and of the last waiter enqueued: the queue holds `queue_tail - queue_head` waiters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_tail: Option<u64>,
    /// When `queue_tail` last moved (coordinator clock, ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_tail_at_ms: Option<u64>,
    /// The writer's clock (ms) of the last queue write that may have left the key free to plain
    /// acquires without a release (an undelivered mark removed, a waiter passed over): a
    /// fail-closed acquire sent before it is refused, as one sent before a release
    /// (`released_at_ms`) is (DESIGN.md, "acquire").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub freed_at_ms: Option<u64>,
    /// A lease granted to a waiter by hand-over and not yet delivered: the waiter's task token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_token: Option<String>,
    /// The lease_id of the last enqueue's waiter: a retried enqueue of the same lease_id (a lost
    /// answer) finds its slot by it instead of taking a second one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_tail_lease_id: Option<LeaseId>,
    /// A grant that replaced a released lease (a hand-over) keeps that lease's id and fence, so
    /// that a retried release of it answers `already_released` instead of `wrong_lease_id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_lease_id: Option<LeaseId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_fence: Option<u64>,
    /// Waiter items only (at `queue::waiter_key(key, seq)`): the queued acquire.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiter: Option<Waiter>,
}

/// A [`Record`]'s fields of work states (DESIGN.md, "Work items and batch leases"); all `None`
/// on a plain lease key, in no state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkFields {
    /// The work state the key is in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// When the key entered its state (coordinator clock, ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_since_ms: Option<u64>,
    /// How many leases the key has been granted since it entered its state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<u32>,
}

/// A [`Record`]'s fields of a semaphore (DESIGN.md, "Semaphores"): present only on a
/// semaphore's item.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SemaphoreFields {
    /// The semaphore's N.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots: Option<u32>,
    /// The semaphore's holders not released (live, or expired and not yet cleaned).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots_taken: Option<u32>,
    /// Bumped by every write to the semaphore: "the item as read".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots_rev: Option<u64>,
    /// The semaphore's holders, live and ended but not yet cleaned.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slot_holders: Vec<SlotHolder>,
    /// The clock of the last write that cleaned away a holder still counted (expired,
    /// unreleased): no free slot is taken by a clock behind it (DESIGN.md, "Semaphores").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cleaned_at_ms: Option<u64>,
}

/// One holder of a semaphore's slot (DESIGN.md, "Semaphores"), keyed by its lease_id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SlotHolder {
    pub lease_id: LeaseId,
    pub fence: u64,
    pub holder: String,
    pub acquired_at_ms: u64,
    pub renewed_at_ms: u64,
    pub expires_at_ms: u64,
    pub duration_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Map<String, Value>>,
    /// Renewed by the keep-alive sweep until `until_ms`, and only while its execution runs;
    /// released once the execution has ended (DESIGN.md, "Keep-alive on the holder's behalf").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keepalive: Option<Keepalive>,
}

impl SlotHolder {
    /// Live at `now_ms`: not released and not expired.
    pub fn is_live(&self, now_ms: u64) -> bool {
        self.released_at_ms.is_none() && self.expires_at_ms > now_ms
    }

    /// What a take of this slot writes into the semaphore item's own keep-alive attributes,
    /// which place the item in the keep-alive index: nothing for a slot without keep-alive;
    /// for one with, an entry no slot's deadline outlasts (a deadline is at most
    /// `KEEPALIVE_HORIZON_MS` after its take, a day
    /// more covers any two takers' clocks). No take ever lowers it; the sweep takes the item out
    /// of the index once none of its slots is kept alive (DESIGN.md, "Keep-alive on the
    /// holder's behalf").
    pub fn index_keepalive(&self) -> Option<Keepalive> {
        const DAY_MS: u64 = 24 * 3600 * 1000;
        self.keepalive.as_ref().map(|_| Keepalive {
            until_ms: self.acquired_at_ms.saturating_add(KEEPALIVE_HORIZON_MS + DAY_MS),
            execution_arn: None,
        })
    }

    /// Kept alive at `now_ms`: live, and with a keep-alive deadline still ahead.
    pub fn kept_alive(&self, now_ms: u64) -> bool {
        self.is_live(now_ms) && self.keepalive.as_ref().is_some_and(|k| k.until_ms > now_ms)
    }

    /// The holder's view of this slot of `key`, `safe_until` measured as for a lease.
    pub fn lease(&self, key: &str, slots: Option<u32>, sent: Instant, now_ms: u64, margin_ms: u64) -> Lease {
        let remaining = self.expires_at_ms.saturating_sub(now_ms).saturating_sub(margin_ms);
        Lease {
            key: key.to_string(),
            holder: self.holder.clone(),
            lease_id: self.lease_id.clone(),
            fence: self.fence,
            acquired_at_ms: self.acquired_at_ms,
            expires_at_ms: Some(self.expires_at_ms),
            duration_ms: Some(self.duration_ms),
            min_hold_until_ms: self.acquired_at_ms,
            metadata: self.metadata.clone(),
            keepalive: self.keepalive.clone(),
            safe_until: Some(sent + std::time::Duration::from_millis(remaining)),
            safe_for_ms: None,
            state: None,
            attempts: None,
            slots,
        }
    }
}

/// A live holder of a semaphore, as `get` and `list` show it (no lease_id).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotState {
    pub holder: String,
    pub fence: u64,
    pub acquired_at_ms: u64,
    pub expires_at_ms: u64,
    /// The holder's keep-alive, when the sweep renews its slot on its behalf.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keepalive: Option<Keepalive>,
}

impl Record {
    /// The semaphore's holder of `lease_id`, if its entry is in the map.
    pub fn slot(&self, lease_id: &LeaseId) -> Option<&SlotHolder> {
        self.semaphore.slot_holders.iter().find(|h| &h.lease_id == lease_id)
    }

    /// The semaphore's live holders at `now_ms`.
    pub fn live_slots(&self, now_ms: u64) -> impl Iterator<Item = &SlotHolder> {
        self.semaphore.slot_holders.iter().filter(move |h| h.is_live(now_ms))
    }

    /// A record that carries only its key (an entry of a keys-only index).
    pub(crate) fn key_only(key: String) -> Record {
        Record { key, ..Record::default() }
    }

    /// Waiters queued on this lease item (0 without a queue).
    pub fn queue_len(&self) -> u64 {
        match (self.queue.queue_head, self.queue.queue_tail) {
            (Some(h), Some(t)) => t.saturating_sub(h),
            _ => 0,
        }
    }

    /// When the key was last made free by a write (its release, or a queue write that let plain
    /// acquires take it): a fail-closed acquire sent before then is refused (`FreeAfter`).
    pub fn freed_at(&self) -> Option<u64> {
        self.released_at_ms.max(self.queue.freed_at_ms)
    }

    /// The stamp at which a write freed this key, when its expiry was not after it: the key was
    /// free by the clock of the coordinator that freed it, whatever the clock of the one reading
    /// it now (DESIGN.md, "Clocks": a released key is free to every taker).
    pub fn freed_by_stamp(&self) -> Option<u64> {
        // A key put into a work state without a lease is free from its putter's clock reading,
        // written as both its expiry and its entry time (no lease's expiry equals its entry
        // time: a lease lasts at least the minimum duration from a clock at or after it).
        let put = self.work.state_since_ms.filter(|s| self.expires_at_ms == Some(*s));
        let at = self.freed_at().max(put)?;
        self.expires_at_ms.is_some_and(|e| e <= at).then_some(at)
    }

    /// What a grant that replaces the whole item must write a fence above: the last fence, and
    /// the last queue's tail when its queue is empty (a new queue starts above the fence, so
    /// its numbers stay above every earlier queue's: DESIGN.md, "The waiter queue", Layout).
    pub fn fence_floor(&self) -> u64 {
        match self.queue.queue_tail {
            Some(t) if self.queue_len() == 0 => self.fence.max(t),
            _ => self.fence,
        }
    }

    /// Is the key unavailable to others at `now_ms` (by the coordinator's clock)? (A
    /// semaphore's item has no expiry: for the plain protocol it is held.)
    pub fn is_held(&self, now_ms: u64) -> bool {
        match self.expires_at_ms {
            None => true,
            Some(e) => e > now_ms,
        }
    }

    /// Released with no minimum hold pending: free to every reader, whatever its clock. (The
    /// expiry a release leaves is the acquirer's clock reading, which a reader whose corrected
    /// clock is behind that acquirer's would otherwise see as still ahead: DESIGN.md, "Clocks".)
    pub fn released_outright(&self) -> bool {
        self.released_at_ms.is_some() && self.expires_at_ms.is_some_and(|e| e <= self.acquired_at_ms)
    }

    /// Is the key held, as views show it (`get`, `list`, the page, `/metrics`): held at `now_ms`
    /// and not released outright.
    pub fn shows_held(&self, now_ms: u64) -> bool {
        self.is_held(now_ms) && !self.released_outright()
    }

    /// Does the lease `lease_id` still hold this key at `now_ms`?
    pub fn is_live_for(&self, lease_id: &LeaseId, now_ms: u64) -> bool {
        &self.lease_id == lease_id && self.released_at_ms.is_none() && self.is_held(now_ms)
    }

    /// The public view (no lease_id).
    pub fn state(&self, now_ms: u64) -> LeaseState {
        if self.semaphore.slots.is_some() {
            return self.semaphore_state(now_ms);
        }
        LeaseState {
            key: self.key.clone(),
            held: self.shows_held(now_ms),
            holder: self.holder.clone(),
            fence: self.fence,
            acquired_at_ms: self.acquired_at_ms,
            expires_at_ms: self.expires_at_ms,
            duration_ms: self.duration_ms,
            released_at_ms: self.released_at_ms,
            min_hold_until_ms: Some(self.min_hold_until_ms).filter(|m| *m > self.acquired_at_ms),
            metadata: self.metadata.clone(),
            keepalive: self.keepalive.clone(),
            queue_length: self.queue_len(),
            state: self.work.state.clone(),
            state_since_ms: self.work.state_since_ms,
            attempts: self.work.attempts,
            slots: None,
            slots_taken: None,
            holders: Vec::new(),
        }
    }

    /// A semaphore's public view: its live holders, held while any is live, the earliest
    /// expiry of a live holder and that holder's name (the slot that frees next; when none is
    /// live, the last holder granted).
    fn semaphore_state(&self, now_ms: u64) -> LeaseState {
        let next = self.live_slots(now_ms).min_by_key(|h| h.expires_at_ms);
        let last = self.semaphore.slot_holders.iter().max_by_key(|h| h.fence);
        let holder = next.or(last).map_or_else(|| self.holder.clone(), |h| h.holder.clone());
        let live: Vec<SlotState> = self
            .live_slots(now_ms)
            .map(|h| SlotState {
                holder: h.holder.clone(),
                fence: h.fence,
                acquired_at_ms: h.acquired_at_ms,
                expires_at_ms: h.expires_at_ms,
                keepalive: h.keepalive.clone(),
            })
            .collect();
        LeaseState {
            key: self.key.clone(),
            held: !live.is_empty(),
            holder,
            fence: self.fence,
            acquired_at_ms: self.acquired_at_ms,
            expires_at_ms: live.iter().map(|h| h.expires_at_ms).min(),
            duration_ms: None,
            released_at_ms: None,
            min_hold_until_ms: None,
            metadata: None,
            keepalive: None,
            queue_length: 0,
            state: None,
            state_since_ms: None,
            attempts: None,
            slots: self.semaphore.slots,
            slots_taken: Some(live.len() as u32),
            holders: live,
        }
    }

    /// The holder's view, with `safe_until` measured on the holder's monotonic clock from the
    /// instant the request was sent (`sent`, when the coordinator clock read `now_ms`): it ends
    /// `margin_ms` before the expiry by that clock (the coordinator's safe margin: DESIGN.md,
    /// "Clocks").
    pub fn lease(&self, sent: Instant, now_ms: u64, margin_ms: u64) -> Lease {
        let safe_until = self.expires_at_ms.map(|e| {
            let remaining = e.saturating_sub(now_ms).saturating_sub(margin_ms);
            sent + std::time::Duration::from_millis(remaining)
        });
        Lease {
            key: self.key.clone(),
            holder: self.holder.clone(),
            lease_id: self.lease_id.clone(),
            fence: self.fence,
            acquired_at_ms: self.acquired_at_ms,
            expires_at_ms: self.expires_at_ms,
            duration_ms: self.duration_ms,
            min_hold_until_ms: self.min_hold_until_ms,
            metadata: self.metadata.clone(),
            keepalive: self.keepalive.clone(),
            safe_until,
            safe_for_ms: None,
            state: self.work.state.clone(),
            attempts: self.work.attempts,
            slots: None,
        }
    }
}

/// What a successful acquire or heartbeat hands to the holder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Lease {
    pub key: String,
    pub holder: String,
    pub lease_id: LeaseId,
    pub fence: u64,
    pub acquired_at_ms: u64,
    /// `null` for a fail-closed lease.
    pub expires_at_ms: Option<u64>,
    pub duration_ms: Option<u64>,
    pub min_hold_until_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Map<String, Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keepalive: Option<Keepalive>,
    /// Holder-side monotonic deadline: stop working before it. `None` for fail-closed leases.
    #[serde(skip)]
    pub safe_until: Option<Instant>,
    /// For remote callers (HTTP, invoke, CLI `--url`): how long the holder may work, counted
    /// from the instant it *sent* its request (the coordinator measures it from when the request
    /// arrived, after the skew margin and the time it spent). Set by the API layer; `None` for
    /// fail-closed leases.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub safe_for_ms: Option<u64>,
    /// The work state of the key (absent for a key in no state).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// Leases granted on the key since it entered its state, this one included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<u32>,
    /// A semaphore holder's lease: the semaphore's N (absent for a plain lease).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots: Option<u32>,
}

impl Lease {
    /// Fills in [`Lease::safe_for_ms`] for a request that arrived at `received`.
    pub fn with_safe_for(mut self, received: Instant) -> Self {
        self.safe_for_ms = self.safe_until.map(|t| t.saturating_duration_since(received).as_millis() as u64);
        self
    }
}

/// The public state of a key: what `get` and `list` return. Never carries the lease_id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaseState {
    pub key: String,
    /// Whether the key is unavailable to others right now.
    pub held: bool,
    /// Holder of the current or, when `held` is false, the last lease.
    pub holder: String,
    pub fence: u64,
    pub acquired_at_ms: u64,
    pub expires_at_ms: Option<u64>,
    pub duration_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_at_ms: Option<u64>,
    /// A release does not free the key before this instant (acquired_at + min_hold); absent
    /// when the lease was taken without a min-hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_hold_until_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Map<String, Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keepalive: Option<Keepalive>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_since_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<u32>,
    /// Waiters queued for the key (DESIGN.md, "The waiter queue"); absent when none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub queue_length: u64,
    /// A semaphore (DESIGN.md, "Semaphores"): its N, how many hold now, and the live holders.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots_taken: Option<u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub holders: Vec<SlotState>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The answer to a release.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Released {
    pub key: String,
    pub fence: u64,
    pub released_at_ms: u64,
    /// When others can take the key: the release instant, or acquired_at + min_hold if later.
    pub free_at_ms: u64,
    /// The lease had already been released (a retried or stale release): nothing changed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub already_released: bool,
    /// The key's work state after the release (absent for a key in no state).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
}

impl Released {
    /// A release at `at_ms` that left the key free, or granted it on, at that instant.
    pub(crate) fn at(key: &str, fence: u64, at_ms: u64, already_released: bool, state: Option<String>) -> Released {
        Released { key: key.to_string(), fence, released_at_ms: at_ms, free_at_ms: at_ms, already_released, state }
    }
}

/// A queued acquire (DESIGN.md, "The waiter queue"), as its waiter item stores it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Waiter {
    pub seq: u64,
    pub holder: String,
    pub lease_id: LeaseId,
    pub duration_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Map<String, Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keepalive: Option<Keepalive>,
    /// The Step Functions task token the lease is delivered to.
    pub task_token: String,
    pub enqueued_at_ms: u64,
    /// When the waiter's task times out (its state's `TimeoutSeconds`), if the caller said:
    /// a waiter past it is skipped without a delivery attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_at_ms: Option<u64>,
}

#[cfg(test)]
mod lease_id_tests {
    use super::LeaseId;

    /// A generated lease_id is 128 bits as 32 lowercase hex digits (the format the API's
    /// validation and the stores expect), and two are never the same.
    #[test]
    fn generated_ids_are_32_lowercase_hex_digits() {
        let ids: std::collections::HashSet<String> =
            (0..1000).map(|_| LeaseId::generate().expose().to_string()).collect();
        assert_eq!(ids.len(), 1000);
        for id in &ids {
            assert_eq!(id.len(), 32, "{id}");
            assert!(id.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)), "{id}");
        }
        // Leading zero bytes keep their digits: over 1000 ids, some start with '0'.
        assert!(ids.iter().any(|id| id.starts_with('0')));
    }
}

#[cfg(test)]
mod record_tests {
    use super::*;

    /// A record with every field set: every group, a waiter and a semaphore holder.
    fn full() -> Record {
        let mut md = Map::new();
        md.insert("a".into(), Value::from(1));
        let waiter = Waiter {
            seq: 4,
            holder: "w".into(),
            lease_id: LeaseId::from_string("id4"),
            duration_ms: 30,
            metadata: Some(md.clone()),
            keepalive: None,
            task_token: "tt".into(),
            enqueued_at_ms: 9,
            timeout_at_ms: Some(50),
        };
        let holder = SlotHolder {
            lease_id: LeaseId::from_string("id5"),
            fence: 7,
            holder: "s".into(),
            acquired_at_ms: 1,
            renewed_at_ms: 2,
            expires_at_ms: 3,
            duration_ms: 4,
            released_at_ms: Some(2),
            metadata: Some(md.clone()),
            keepalive: Some(Keepalive { until_ms: 98, execution_arn: Some("arn2".into()) }),
        };
        Record {
            key: "k".into(),
            fence: 7,
            holder: "h".into(),
            lease_id: LeaseId::from_string("id1"),
            acquired_at_ms: 10,
            expires_at_ms: Some(20),
            duration_ms: Some(10),
            min_hold_until_ms: 12,
            released_at_ms: Some(15),
            metadata: Some(md),
            keepalive: Some(Keepalive { until_ms: 99, execution_arn: Some("arn".into()) }),
            ttl: Some(1000),
            renewed_at_ms: Some(11),
            poll_ms: Some(5),
            queue: QueueFields {
                handed_in: Some("c1".into()),
                awaited_by: Some("c2".into()),
                queue_head: Some(3),
                queue_tail: Some(4),
                queue_tail_at_ms: Some(13),
                freed_at_ms: Some(14),
                pending_token: Some("tok".into()),
                queue_tail_lease_id: Some(LeaseId::from_string("id2")),
                released_lease_id: Some(LeaseId::from_string("id3")),
                released_fence: Some(6),
                waiter: Some(waiter),
            },
            work: WorkFields { state: Some("S".into()), state_since_ms: Some(8), attempts: Some(2) },
            semaphore: SemaphoreFields {
                slots: Some(3),
                slots_taken: Some(1),
                slots_rev: Some(5),
                slot_holders: vec![holder],
                cleaned_at_ms: Some(9),
            },
        }
    }

    /// The JSON the embedded store keeps is one flat record, its fields in one order whatever
    /// group of [`Record`] holds them: the bytes every version writes, and reads back the same.
    #[test]
    fn the_stored_json_is_one_flat_record() {
        let full_json = concat!(
            r#"{"key":"k","fence":7,"holder":"h","lease_id":"id1","acquired_at_ms":10,"expires_at_ms":20,"#,
            r#""duration_ms":10,"min_hold_until_ms":12,"released_at_ms":15,"metadata":{"a":1},"#,
            r#""keepalive":{"until_ms":99,"execution_arn":"arn"},"ttl":1000,"renewed_at_ms":11,"poll_ms":5,"#,
            r#""handed_in":"c1","awaited_by":"c2","queue_head":3,"queue_tail":4,"queue_tail_at_ms":13,"#,
            r#""freed_at_ms":14,"pending_token":"tok","queue_tail_lease_id":"id2","released_lease_id":"id3","#,
            r#""released_fence":6,"waiter":{"seq":4,"holder":"w","lease_id":"id4","duration_ms":30,"#,
            r#""metadata":{"a":1},"task_token":"tt","enqueued_at_ms":9,"timeout_at_ms":50},"state":"S","#,
            r#""state_since_ms":8,"attempts":2,"slots":3,"slots_taken":1,"slots_rev":5,"slot_holders":"#,
            r#"[{"lease_id":"id5","fence":7,"holder":"s","acquired_at_ms":1,"renewed_at_ms":2,"#,
            r#""expires_at_ms":3,"duration_ms":4,"released_at_ms":2,"metadata":{"a":1},"#,
            r#""keepalive":{"until_ms":98,"execution_arn":"arn2"}}],"cleaned_at_ms":9}"#
        );
        let key_only_json = concat!(
            r#"{"key":"k","fence":0,"holder":"","lease_id":"","acquired_at_ms":0,"expires_at_ms":null,"#,
            r#""duration_ms":null,"min_hold_until_ms":0,"released_at_ms":null,"metadata":null,"keepalive":null,"#,
            r#""ttl":null}"#
        );
        for (record, json) in [(full(), full_json), (Record::key_only("k".into()), key_only_json)] {
            assert_eq!(serde_json::to_string(&record).unwrap(), json);
            assert_eq!(serde_json::from_str::<Record>(json).unwrap(), record);
        }
        // A plain lease's fields alone, as every earlier version wrote them: no group's field.
        let plain: Record = serde_json::from_str(key_only_json).unwrap();
        assert_eq!((plain.queue, plain.work, plain.semaphore), Default::default());
    }
}
