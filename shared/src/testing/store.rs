//! An in-memory [`Store`] with DynamoDB's semantics, and the faults of a real network.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;

use super::{splitmix64, SimClock};
use crate::clock::{Clock, ClockSamples, Sample};
use crate::error::{Error, Result};
use crate::model::Record;
use crate::store::{keepalive_shard, reference, Condition, Mutation, Page, ScanKind, Store, Write, KEEPALIVE_SHARDS};

/// The faults a [`SimStore`] injects, each a probability per request (0.0 to 1.0) or a range.
#[derive(Debug, Clone, PartialEq)]
pub struct Faults {
    /// One-way network latency, uniform in this range (ms); a request pays it twice.
    pub latency_ms: (u64, u64),
    /// The store client's attempt timeout: an answer later than this is a timeout
    /// (`StoreUnavailable`, which may have landed), whatever became of the request.
    pub attempt_timeout: Duration,
    /// The request lands, its answer never comes: the caller sees a timeout.
    pub lost_answer: f64,
    /// The request is held in the network past the attempt timeout (uniform in
    /// `held_ms`), and lands then: after the caller's retry, as a delayed duplicate.
    pub delayed_duplicate: f64,
    pub held_ms: (u64, u64),
    /// No connection: the request is never sent (`StoreUnavailable` that did not land).
    pub refused: f64,
    /// Throttled (`Throttled`, did not land).
    pub throttle: f64,
    /// A stall: the request and its answer take `stall_ms` longer (uniform), often past the
    /// attempt timeout.
    pub stall: f64,
    pub stall_ms: (u64, u64),
    /// How far the scanned indexes (keep-alive, work state, queue) lag the table (ms, uniform).
    pub index_lag_ms: (u64, u64),
    /// How late after its TTL an item is deleted (ms, uniform per item).
    pub ttl_lag_ms: (u64, u64),
}

impl Faults {
    /// A well-behaved store: 1-3 ms each way, indexes 0-10 ms behind, TTL deletion within a
    /// minute.
    pub fn none() -> Self {
        Faults {
            latency_ms: (1, 3),
            attempt_timeout: Duration::from_secs(1),
            lost_answer: 0.0,
            delayed_duplicate: 0.0,
            held_ms: (1000, 3000),
            refused: 0.0,
            throttle: 0.0,
            stall: 0.0,
            stall_ms: (500, 5000),
            index_lag_ms: (0, 10),
            ttl_lag_ms: (0, 60_000),
        }
    }

    /// Every fault, each on a few percent of the requests.
    pub fn all(rate: f64) -> Self {
        Faults {
            lost_answer: rate,
            delayed_duplicate: rate,
            refused: rate,
            throttle: rate,
            stall: rate / 2.0,
            index_lag_ms: (0, 2000),
            ..Faults::none()
        }
    }
}

/// How many of each fault a [`SimStore`] injected.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultCounts {
    pub lost_answer: u64,
    pub delayed_duplicate: u64,
    pub refused: u64,
    pub throttle: u64,
    pub stall: u64,
    /// Requests answered after the attempt timeout (lost answers and held requests aside).
    pub timeout: u64,
    /// Items deleted by TTL.
    pub ttl_delete: u64,
    /// Requests of a stopped process (never sent).
    pub stopped: u64,
}

/// One write that changed the table, in the order they were applied: the simulation's
/// checkers read the history from here.
#[derive(Debug, Clone)]
pub struct Applied {
    /// When it was applied (the store's monotonic clock).
    pub at: Instant,
    pub key: String,
    /// The mutation (`None`: a delete, or a TTL deletion when `ttl` is set).
    pub mutation: Option<Mutation>,
    pub ttl: bool,
    pub old: Option<Record>,
    pub new: Option<Record>,
}

/// An in-memory, linearizable [`Store`] with DynamoDB's semantics: each conditional write is
/// evaluated atomically by the reference evaluation (`store::reference`: [`Condition::holds`],
/// [`Mutation::apply`]), the embedded store's own; a refused write returns the item as it was
/// (`ALL_OLD`); scans of the keep-alive, work-state and queue indexes read a copy that lags the
/// table, like a global secondary index; items past their TTL are deleted late. Faults
/// ([`Faults`]) are drawn from a generator seeded at construction.
///
/// Each coordinator should get its own [`SimStore::handle`]: handles share the table and the
/// faults, but each keeps its own `Date` evidence ([`Store::clock`]), as each process's store
/// client does, and each can be stopped ([`SimStore::stop`]) as a crashed process is.
#[derive(Clone)]
pub struct SimStore {
    shared: Arc<Shared>,
    samples: Arc<ClockSamples>,
    id: u32,
    /// How far this handle's `Date` evidence is off the store's clock (ms).
    date_offset_ms: i64,
}

struct Shared {
    /// The store's own (true) clock: `Date` of its answers, TTL deletion.
    clock: Arc<SimClock>,
    state: Mutex<State>,
}

struct State {
    items: BTreeMap<String, Record>,
    /// The lagging copy scans of the indexes read, and the writes still on their way to it.
    index: BTreeMap<String, Record>,
    pending: VecDeque<(Instant, String, Option<Record>)>,
    last_visible: Option<Instant>,
    faults: Faults,
    rng: u64,
    counts: FaultCounts,
    stopped: Vec<u32>,
    /// Handles cut off from the store until then (a network partition).
    partitioned: BTreeMap<u32, Instant>,
    next_id: u32,
    log: Vec<Applied>,
    next_ttl_check: i64,
}

impl std::fmt::Debug for SimStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimStore").field("handle", &self.id).finish()
    }
}

enum Op<'a> {
    Get(&'a str),
    Update(&'a str, &'a Condition, &'a Mutation),
    Delete(&'a str, &'a Condition),
    Scan(&'a ScanKind, Option<&'a str>, u32),
}

enum Done {
    Item(Option<Record>),
    Write(Write),
    Page(Page),
}

impl SimStore {
    /// A new, empty store whose clock is `clock` (the true time; coordinators may have others),
    /// injecting `faults`, drawing them from a generator seeded with `seed`.
    pub fn new(clock: Arc<SimClock>, faults: Faults, seed: u64) -> Self {
        let state = State {
            items: BTreeMap::new(),
            index: BTreeMap::new(),
            pending: VecDeque::new(),
            last_visible: None,
            faults,
            rng: seed ^ 0x5eed_5eed_5eed_5eed,
            counts: FaultCounts::default(),
            stopped: Vec::new(),
            partitioned: BTreeMap::new(),
            next_id: 1,
            log: Vec::new(),
            next_ttl_check: 0,
        };
        SimStore {
            shared: Arc::new(Shared { clock, state: Mutex::new(state) }),
            samples: Arc::default(),
            id: 0,
            date_offset_ms: 0,
        }
    }

    /// Another client of the same table, with its own `Date` evidence (one per coordinator).
    pub fn handle(&self) -> SimStore {
        let mut s = self.state();
        let id = s.next_id;
        s.next_id += 1;
        SimStore { shared: self.shared.clone(), samples: Arc::default(), id, date_offset_ms: 0 }
    }

    /// Another client (as [`SimStore::handle`]) whose `Date` evidence is `ms` off the store's
    /// clock: its answers pass through something that stamps them with a wrong clock. A
    /// coordinator whose own clock is off by as much cannot see its error (DESIGN.md, "Clocks"):
    /// what is left to defend the others is the fence.
    pub fn handle_with_date_offset(&self, ms: i64) -> SimStore {
        SimStore { date_offset_ms: ms, ..self.handle() }
    }

    /// The process of this handle stops (a crash): its requests are never sent from now on.
    /// Requests already sent still land.
    pub fn stop(&self) {
        self.state().stopped.push(self.id);
    }

    /// The process of this handle is cut off from the store for `duration` (a network
    /// partition): its requests are refused, not sent, until then. Requests already sent still
    /// land.
    pub fn partition(&self, duration: Duration) {
        let until = tokio_now() + duration;
        self.state().partitioned.insert(self.id, until);
    }

    /// Has the process of this handle stopped ([`SimStore::stop`])?
    pub fn is_stopped(&self) -> bool {
        self.state().stopped.contains(&self.id)
    }

    /// Replaces the faults injected from now on.
    pub fn set_faults(&self, faults: Faults) {
        self.state().faults = faults;
    }

    /// The faults injected so far.
    pub fn fault_counts(&self) -> FaultCounts {
        self.state().counts.clone()
    }

    /// The writes applied so far, in order (the log is emptied).
    pub fn take_log(&self) -> Vec<Applied> {
        std::mem::take(&mut self.state().log)
    }

    /// Puts `log` back in front of the writes applied since it was taken.
    pub fn put_back_log(&self, mut log: Vec<Applied>) {
        let mut s = self.state();
        log.append(&mut s.log);
        s.log = log;
    }

    /// The item of `key` as it is now, without faults (for checks).
    pub fn peek(&self, key: &str) -> Option<Record> {
        self.state().items.get(key).cloned()
    }

    /// Every key of the table, without faults (for checks).
    pub fn keys(&self) -> Vec<String> {
        self.state().items.keys().cloned().collect()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The fate of one request (a write may be held back), drawn when it is sent: what happens
    /// to it, its latency out and back, and the caller's attempt timeout.
    fn fate(&self, write: bool) -> Result<(Fate, Duration, Duration, Duration)> {
        let mut s = self.state();
        if s.stopped.contains(&self.id) {
            s.counts.stopped += 1;
            drop(s);
            return Err(Error::not_sent("simulated store: this process has stopped"));
        }
        if s.partitioned.get(&self.id).is_some_and(|u| tokio_now() < *u) {
            return Err(Error::not_sent("simulated store: this process is cut off from the store"));
        }
        let f = s.faults.clone();
        let mut out = s.between(f.latency_ms);
        let back = s.between(f.latency_ms);
        let x = s.unit();
        let mut edge = 0.0;
        let mut pick = |p: f64| {
            edge += p;
            x < edge
        };
        let fate = if pick(f.refused) {
            s.counts.refused += 1;
            Fate::Refused
        } else if pick(f.throttle) {
            s.counts.throttle += 1;
            Fate::Throttled
        } else if pick(f.lost_answer) {
            s.counts.lost_answer += 1;
            Fate::Lost
        } else if write && pick(f.delayed_duplicate) {
            s.counts.delayed_duplicate += 1;
            out = f.attempt_timeout.as_millis() as u64 + s.between(f.held_ms);
            Fate::Held
        } else if pick(f.stall) {
            s.counts.stall += 1;
            out += s.between(f.stall_ms);
            Fate::Normal
        } else {
            Fate::Normal
        };
        Ok((fate, ms(out), ms(back), f.attempt_timeout))
    }

    async fn request(&self, op: Op<'_>) -> Result<Done> {
        let sent = tokio_now();
        let write = matches!(op, Op::Update(..) | Op::Delete(..));
        // The fate of this request, drawn when it is sent.
        let (fate, out, back, timeout) = self.fate(write)?;
        let timed_out = || Error::StoreUnavailable("simulated store: the request timed out".into());
        match fate {
            Fate::Refused => {
                tokio::time::sleep(out).await;
                Err(Error::not_sent("simulated store: connection refused"))
            }
            Fate::Throttled => {
                tokio::time::sleep(out + back).await;
                Err(Error::Throttled("simulated store: ProvisionedThroughputExceededException".into()))
            }
            Fate::Held => {
                // In the network past the caller's timeout: it lands later, whatever the caller
                // does meanwhile.
                let (me, op) = (self.clone(), op.owned());
                tokio::spawn(async move {
                    tokio::time::sleep(out).await;
                    let _ = me.apply(&op.borrow());
                });
                tokio::time::sleep(timeout).await;
                Err(timed_out())
            }
            Fate::Lost => {
                tokio::time::sleep(out.min(timeout)).await;
                let _ = self.apply(&op);
                tokio::time::sleep(timeout.saturating_sub(out)).await;
                Err(timed_out())
            }
            Fate::Normal => {
                if out >= timeout {
                    self.state().counts.timeout += 1;
                    let (me, op) = (self.clone(), op.owned());
                    tokio::spawn(async move {
                        tokio::time::sleep(out).await;
                        let _ = me.apply(&op.borrow());
                    });
                    tokio::time::sleep(timeout).await;
                    return Err(timed_out());
                }
                tokio::time::sleep(out).await;
                let (done, date_ms) = self.apply(&op);
                if out + back >= timeout {
                    self.state().counts.timeout += 1;
                    tokio::time::sleep(timeout - out).await;
                    return Err(timed_out());
                }
                tokio::time::sleep(back).await;
                if date_ms > 0 {
                    let date_s = ((date_ms + self.date_offset_ms).max(0) / 1000) as u64;
                    self.samples.record(Sample { sent, received: tokio_now(), date_s });
                }
                Ok(done)
            }
        }
    }

    /// Applies one request to the table, atomically; also the store's clock (ms) when it did.
    fn apply(&self, op: &Op<'_>) -> (Done, i64) {
        let now_ms = self.shared.clock.wall_ms();
        let now = tokio_now();
        let mut s = self.state();
        s.expire(now_ms, now);
        let done = match *op {
            Op::Get(key) => Done::Item(s.items.get(key).cloned()),
            Op::Update(key, cond, m) => {
                let applied = reference::update(&mut Table { state: &mut s, now }, key, cond, m);
                Done::Write(applied.unwrap_or_else(|never| match never {}))
            }
            Op::Delete(key, cond) => {
                let deleted = reference::delete(&mut Table { state: &mut s, now }, key, cond);
                Done::Write(deleted.unwrap_or_else(|never| match never {}))
            }
            Op::Scan(kind, start, limit) => Done::Page(s.scan(now, kind, start, limit)),
        };
        (done, now_ms)
    }
}

/// The table as the reference evaluation reads and writes it (under the state's lock): every
/// change logged for the checkers, and sent on its way to the lagging index.
struct Table<'a> {
    state: &'a mut State,
    now: Instant,
}

impl reference::Table for Table<'_> {
    type Error = std::convert::Infallible;

    fn read(&mut self, key: &str) -> std::result::Result<Option<Record>, Self::Error> {
        Ok(self.state.items.get(key).cloned())
    }

    fn put(
        &mut self,
        key: &str,
        old: Option<Record>,
        new: &Record,
        m: &Mutation,
    ) -> std::result::Result<(), Self::Error> {
        self.state.items.insert(key.to_string(), new.clone());
        self.state.changed(self.now, key, Some(m.clone()), old, Some(new.clone()));
        Ok(())
    }

    fn remove(&mut self, key: &str, old: &Record) -> std::result::Result<(), Self::Error> {
        self.state.items.remove(key);
        self.state.changed(self.now, key, None, Some(old.clone()), None);
        Ok(())
    }
}

#[derive(Clone, Copy)]
enum Fate {
    Normal,
    Refused,
    Throttled,
    Lost,
    Held,
}

/// A request that outlives its caller (held in the network). Moved once into its task.
#[allow(clippy::large_enum_variant)]
enum OwnedOp {
    Update(String, Condition, Mutation),
    Delete(String, Condition),
    Read,
}

impl Op<'_> {
    fn owned(&self) -> OwnedOp {
        match *self {
            Op::Update(k, c, m) => OwnedOp::Update(k.to_string(), c.clone(), m.clone()),
            Op::Delete(k, c) => OwnedOp::Delete(k.to_string(), c.clone()),
            Op::Get(_) | Op::Scan(..) => OwnedOp::Read,
        }
    }
}

impl OwnedOp {
    fn borrow(&self) -> Op<'_> {
        match self {
            OwnedOp::Update(k, c, m) => Op::Update(k, c, m),
            OwnedOp::Delete(k, c) => Op::Delete(k, c),
            OwnedOp::Read => Op::Get(""),
        }
    }
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// tokio's clock, which a simulation pauses: the machine's monotonic clock as the core sees it.
fn tokio_now() -> Instant {
    crate::clock::SystemClock.now()
}

impl State {
    fn unit(&mut self) -> f64 {
        (splitmix64(&mut self.rng) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn between(&mut self, (lo, hi): (u64, u64)) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + splitmix64(&mut self.rng) % (hi - lo + 1)
    }

    fn changed(
        &mut self,
        now: Instant,
        key: &str,
        mutation: Option<Mutation>,
        old: Option<Record>,
        new: Option<Record>,
    ) {
        let lag = ms(self.between(self.faults.index_lag_ms));
        // An item's index entries change in the order of its writes.
        let visible = self.last_visible.map_or(now + lag, |v| v.max(now + lag));
        self.last_visible = Some(visible);
        self.pending.push_back((visible, key.to_string(), new.clone()));
        self.log.push(Applied { at: now, key: key.to_string(), mutation, ttl: false, old, new });
    }

    /// Deletes items past their TTL, each some time after it (checked once a second).
    fn expire(&mut self, now_ms: i64, now: Instant) {
        if now_ms < self.next_ttl_check {
            return;
        }
        self.next_ttl_check = now_ms + 1000;
        let (lo, hi) = self.faults.ttl_lag_ms;
        let due: Vec<String> = self
            .items
            .values()
            .filter(|r| {
                r.ttl.is_some_and(|t| {
                    // A per-item lag, fixed by the item and its TTL.
                    let mut h = t ^ keepalive_shard(&r.key, u32::MAX) as u64;
                    let lag = lo + splitmix64(&mut h) % (hi.saturating_sub(lo) + 1);
                    (t * 1000 + lag) as i64 <= now_ms
                })
            })
            .map(|r| r.key.clone())
            .collect();
        for key in due {
            let old = self.items.remove(&key);
            self.counts.ttl_delete += 1;
            let lag = ms(self.between(self.faults.index_lag_ms));
            let visible = self.last_visible.map_or(now + lag, |v| v.max(now + lag));
            self.last_visible = Some(visible);
            self.pending.push_back((visible, key.clone(), None));
            self.log.push(Applied { at: now, key, mutation: None, ttl: true, old, new: None });
        }
    }

    fn scan(&mut self, now: Instant, kind: &ScanKind, start: Option<&str>, limit: u32) -> Page {
        while self.pending.front().is_some_and(|(at, _, _)| *at <= now) {
            let (_, key, new) = self.pending.pop_front().expect("front");
            match new {
                Some(r) => self.index.insert(key, r),
                None => self.index.remove(&key),
            };
        }
        let limit = limit.max(1) as usize;
        let start = start.unwrap_or("");
        if let ScanKind::State { state, free_at_ms, .. } = kind {
            // In the order the keys became free (expiry, then key); the page token is both.
            let mut rows: Vec<(u64, &Record)> = self
                .index
                .values()
                .filter(|r| r.work.state.as_deref() == Some(state.as_str()))
                .filter_map(|r| r.expires_at_ms.map(|e| (e, r)))
                .filter(|(e, _)| free_at_ms.is_none_or(|f| *e <= f))
                .collect();
            rows.sort_by(|a, b| (a.0, &a.1.key).cmp(&(b.0, &b.1.key)));
            let after = start.split_once('\t').map(|(d, k)| (d.parse::<u64>().unwrap_or(0), k.to_string()));
            let items: Vec<Record> = rows
                .into_iter()
                .filter(|(e, r)| after.as_ref().is_none_or(|(d, k)| (*e, &r.key) > (*d, k)))
                .take(limit)
                .map(|(_, r)| r.clone())
                .collect();
            let next = (items.len() == limit).then(|| {
                let last = items.last().expect("a full page");
                format!("{}\t{}", last.expires_at_ms.unwrap_or(0), last.key)
            });
            return Page { items, next };
        }
        let source = if matches!(kind, ScanKind::All) { &self.items } else { &self.index };
        let items: Vec<Record> = source
            .range::<str, _>((std::ops::Bound::Excluded(start), std::ops::Bound::Unbounded))
            .map(|(_, r)| r)
            .filter(|r| match kind {
                ScanKind::All => true,
                ScanKind::Keepalive { shard, after_ms } => {
                    r.queue.waiter.is_none()
                        && r.keepalive.as_ref().is_some_and(|k| k.until_ms > *after_ms)
                        && keepalive_shard(&r.key, KEEPALIVE_SHARDS) == *shard
                }
                ScanKind::Queue { shard } => {
                    r.queue.waiter.is_none()
                        && (r.queue_len() > 0 || r.queue.pending_token.is_some())
                        && crate::queue::queue_shard(&r.key) == *shard
                }
                ScanKind::State { .. } => unreachable!("scanned above"),
            })
            .take(limit)
            .map(|r| if matches!(kind, ScanKind::Queue { .. }) { Record::key_only(r.key.clone()) } else { r.clone() })
            .collect();
        let next = (items.len() == limit).then(|| items.last().expect("a full page").key.clone());
        Page { items, next }
    }
}

#[async_trait]
impl Store for SimStore {
    fn name(&self) -> &'static str {
        "simulated"
    }

    async fn get(&self, key: &str) -> Result<Option<Record>> {
        match self.request(Op::Get(key)).await? {
            Done::Item(r) => Ok(r),
            _ => unreachable!("a get answers an item"),
        }
    }

    async fn update(&self, key: &str, condition: &Condition, mutation: &Mutation) -> Result<Write> {
        match self.request(Op::Update(key, condition, mutation)).await? {
            Done::Write(w) => Ok(w),
            _ => unreachable!("an update answers a write"),
        }
    }

    async fn delete(&self, key: &str, condition: &Condition) -> Result<Write> {
        match self.request(Op::Delete(key, condition)).await? {
            Done::Write(w) => Ok(w),
            _ => unreachable!("a delete answers a write"),
        }
    }

    async fn scan(&self, kind: &ScanKind, start: Option<&str>, limit: u32) -> Result<Page> {
        match self.request(Op::Scan(kind, start, limit)).await? {
            Done::Page(p) => Ok(p),
            _ => unreachable!("a scan answers a page"),
        }
    }

    fn clock(&self) -> Option<&ClockSamples> {
        Some(&self.samples)
    }
}
