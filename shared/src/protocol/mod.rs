//! The lease protocol, written once over the [`Store`] trait. DESIGN.md is its specification.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Map, Value};

use crate::backoff::{jitter, Backoff};

mod acquire;
mod clock_check;
mod decide;
mod handover;
mod heartbeat;
pub(crate) mod hooks;
mod inspect;
pub(crate) mod line;
pub(crate) mod pacing;
pub use pacing::POLL_ATTEMPTS;
mod release;
mod retry;
mod semaphore;
mod states;

use crate::clock::{Clock, SystemClock};
use crate::error::NotHolderReason as Reason;
use crate::error::{Error, Result};
use crate::model::{Keepalive, Lease, LeaseId, LeaseState, Record, Released};
use crate::protocol::pacing::{Pacer, Waiting};
use crate::store::{
    Condition, LeaseCondition, LeaseMutation, Mutation, NewLease, QueueCondition, QueueMutation, ScanKind,
    SemaphoreCondition, SemaphoreMutation, SlotCount, Store, Visit, WorkCondition, WorkMutation, Write,
};
use crate::validate::Limits;
pub(crate) use decide::ended_reason;
use decide::*;
use handover::*;
pub(crate) use hooks::ReleaseHook;
use line::Offer;
use states::in_visit;

/// Largest fence the protocol will issue: 2^53, the largest integer JSON/JavaScript clients
/// read exactly. Fences are drawn from the clock in epoch µs (about 2^50.6 in 2026; 2^53 is
/// reached in the year 2255).
pub const MAX_FENCE: u64 = 1 << 53;

/// Coordinator settings. Every field has a documented default.
#[derive(Debug, Clone)]
pub struct Config {
    pub limits: Limits,
    /// Duration of a lease when the request names none.
    pub default_duration: Duration,
    /// The largest error of this coordinator's clock against the store's that is not refused
    /// (`ClockSkew` once the store's answers agree it is beyond), and the least time
    /// `safe_until` ends before the expiry (an allowance for the drift of the holder's monotonic
    /// clock over one lease; more when the store's answers leave its clock less certain,
    /// DESIGN.md, "Clocks").
    pub skew_margin: Duration,
    /// How long after its expiry an item may be swept by TTL.
    pub ttl_grace: Duration,
    /// Retries of throttled/unavailable store requests: first pause, longest pause, and how
    /// long an operation without its own deadline keeps retrying.
    pub retry_base: Duration,
    pub retry_max: Duration,
    pub retry_budget: Duration,
    /// Waiting acquires poll at most this often when the holder's expiry is further away.
    pub poll_max: Duration,
    /// The attempts per acquisition waiting acquires aim at on a key that changes hands
    /// quickly, the one that succeeds included (DESIGN.md, "Contention"): the key's shared poll
    /// period is moved towards it. More attempts leave the key free for less time after each
    /// release, at one request each. Within [`POLL_ATTEMPTS`] (a value outside is taken as
    /// the nearest bound).
    pub poll_attempts: f64,
    /// Added to the wall clock (tests use it to play a coordinator with a skewed clock).
    pub clock_offset_ms: i64,
    /// How far ahead of this coordinator's clock a key's last fence may plausibly be. Honest
    /// fences are a clock reading within the skew margin, or one more than an earlier fence; a
    /// fence further ahead was issued by a wrong clock and is never copied. It also bounds how
    /// far a fence can be ahead of the time its item's TTL is computed from (see `ttl_after`).
    pub fence_lead: Duration,
    /// Partitions of the work-state index per state (DESIGN.md, "Work items and batch leases").
    /// A property of the table: every coordinator on one table must use the same number.
    pub state_shards: u32,
    /// Work states keys end in (DESIGN.md, "Terminal states"): a key released or put into one
    /// gets a TTL, so that finished keys do not pile up in the table and its index. Empty (the
    /// default): every state keeps its keys until they are taken.
    pub terminal_states: Vec<String>,
    /// How long a key stays in a terminal state before TTL may delete it (counted from when it
    /// entered the state; `ttl_grace` comes on top, as on every TTL).
    pub terminal_retention: Duration,
    /// Allowance for a store `Date` header stamped before the answer left the server (DESIGN.md,
    /// "Clocks"): how late a stamp may be without being taken for a wrong clock here.
    pub date_lag: Duration,
    /// Where every reading of time comes from (the machine's clock by default; a virtual one
    /// in simulations and users' tests).
    pub clock: Arc<dyn Clock>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            limits: Limits::default(),
            default_duration: Duration::from_secs(60),
            skew_margin: Duration::from_millis(200),
            ttl_grace: Duration::from_secs(24 * 3600),
            retry_base: Duration::from_millis(25),
            retry_max: Duration::from_secs(1),
            retry_budget: Duration::from_secs(5),
            poll_max: Duration::from_millis(500),
            poll_attempts: pacing::DEFAULT_POLL_ATTEMPTS,
            clock_offset_ms: 0,
            fence_lead: Duration::from_secs(60),
            state_shards: 1,
            terminal_states: Vec::new(),
            terminal_retention: Duration::from_secs(30 * 24 * 3600),
            date_lag: Duration::from_millis(crate::clock::DATE_LAG_MS as u64),
            clock: Arc::new(SystemClock),
        }
    }
}

/// Options of an acquire.
#[derive(Debug, Clone, Default)]
pub struct AcquireOptions {
    /// Keep trying this long while the key is held.
    pub wait: Option<Duration>,
    /// A release never frees the key before acquired_at + min_hold.
    pub min_hold: Option<Duration>,
    /// Small JSON object stored with the lease (<= 4 KiB).
    pub metadata: Option<Map<String, Value>>,
    /// Let the scheduled heartbeat renew this lease on the holder's behalf.
    pub keepalive: Option<Keepalive>,
    /// Caller-chosen lease_id, so a retried acquire (lost response) gets the same lease.
    /// When `None`, 128 bits are drawn from the OS CSPRNG.
    pub lease_id: Option<LeaseId>,
    /// The whole acquire, its last attempt's retries included, ends by then (a Lambda
    /// invocation's end less its safety margin); `None`: the wait and the retry budget decide.
    /// A request already sent is bounded by the store client's attempt timeout.
    pub deadline: Option<Instant>,
    /// A semaphore of this many slots (DESIGN.md, "Semaphores"): at most N holders at once,
    /// 1..=640. `None` or 1: a plain lease, exactly as without.
    pub slots: Option<u32>,
}

/// The lease coordinator: validation, conditions, retries and fencing over one store.
#[derive(Clone)]
pub struct Coordinator {
    store: Arc<dyn Store>,
    config: Arc<Config>,
    pacer: Arc<Pacer>,
    /// Delivers hand-over grants to queued Step Functions waiters (DESIGN.md, "The waiter queue").
    pub(crate) release_hook: Option<Arc<dyn ReleaseHook>>,
    /// This coordinator's waiting acquires, woken by the releases it handles.
    pub(crate) wakeups: Arc<crate::protocol::line::Wakeups>,
    /// Names this coordinator on the items its in-process hand-overs grant (`handed_in`).
    id: Arc<str>,
    /// Keys this coordinator saw as semaphores: their heartbeats (naming a duration) and
    /// releases go to the holder's slot first (DESIGN.md, "Semaphores": Cost).
    pub(crate) semaphores: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator").field("store", &self.store.name()).field("config", &self.config).finish()
    }
}

impl Coordinator {
    pub fn new(store: Arc<dyn Store>, config: Config) -> Self {
        Coordinator {
            store,
            pacer: Arc::new(Pacer::new(config.clock.clone())),
            wakeups: Arc::new(crate::protocol::line::Wakeups::new(config.clock.clone())),
            config: Arc::new(config),
            release_hook: None,
            id: LeaseId::generate().expose()[..16].into(),
            semaphores: Arc::default(),
        }
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The name this coordinator writes on the items its in-process hand-overs grant
    /// (`handed_in`), and on a key whose turn one of its waiters missed (DESIGN.md, "In-process
    /// waiters").
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The coordinator's clock: epoch milliseconds, never ahead of what the store's recent
    /// answers prove its clock to be (DESIGN.md, "Clocks").
    pub fn now_ms(&self) -> u64 {
        self.corrected_us() / 1000
    }

    /// The coordinator's clock in epoch microseconds: where fences come from.
    pub fn now_us(&self) -> u64 {
        self.corrected_us()
    }

    /// The coordinator's monotonic clock: what deadlines and `safe_until` are measured in.
    pub fn monotonic(&self) -> Instant {
        self.config.clock.now()
    }

    pub(crate) fn skew_ms(&self) -> u64 {
        self.config.skew_margin.as_millis() as u64
    }

    /// TTL attribute (epoch seconds) for an item that stops mattering at `ms`: the grace after
    /// that, and never before the grace after its fence's own time (a fence is at most
    /// `fence_lead` ahead of the clock of the write that issued it, and every later write runs
    /// later), so that a key deleted by TTL restarts its fences above the old ones.
    pub(crate) fn ttl_after(&self, ms: u64) -> u64 {
        let lead = self.config.fence_lead.as_millis() as u64;
        ms.saturating_add(lead).div_ceil(1000) + self.config.ttl_grace.as_secs()
    }

    /// Is `state` one of [`Config::terminal_states`]?
    pub(crate) fn is_terminal(&self, state: &str) -> bool {
        self.config.terminal_states.iter().any(|s| s == state)
    }

    /// The TTL of a key entering `state` at `now_ms`: for a terminal state,
    /// [`Config::terminal_retention`] later (with the grace and fence lead of every TTL);
    /// `None` (kept until taken) for any other.
    pub(crate) fn state_ttl(&self, state: &str, now_ms: u64) -> Option<u64> {
        let retention = self.config.terminal_retention.as_millis() as u64;
        self.is_terminal(state).then(|| self.ttl_after(now_ms.saturating_add(retention)))
    }

    pub(crate) fn max_duration_ms(&self) -> u64 {
        self.config.limits.max_duration.as_millis() as u64
    }
}
