//! `GET /metrics` of `leasehold serve`, in the Prometheus text format (version 0.0.4): what this
//! server answered (acquisitions, contention, waits, releases, errors by name), how long its
//! store took, and, from the operator views' snapshot (`crate::snapshot`), queue lengths and
//! work-state counts. README lists every metric.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use leasehold::store::{Condition, Mutation, Page, ScanKind, Store, Write};
use leasehold::{ClockSamples, Record};

use crate::snapshot::SCRAPE_ITEMS;

/// A histogram with fixed upper bounds (seconds).
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_us: AtomicU64,
    total: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
            total: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            if s <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.sum_us.fetch_add(d.as_micros() as u64, Ordering::Relaxed);
        self.total.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {}", c.load(Ordering::Relaxed));
        }
        let total = self.total.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {total}");
        let braces = if labels.is_empty() { String::new() } else { format!("{{{labels}}}") };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum_us.load(Ordering::Relaxed) as f64 / 1e6);
        let _ = writeln!(out, "{name}_count{braces} {total}");
    }
}

const WAIT_BOUNDS: &[f64] = &[0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
const STORE_BOUNDS: &[f64] = &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5];
const STORE_OPS: [&str; 4] = ["get", "update", "delete", "scan"];

/// Keys with a `leasehold_queue_length` series: the longest queues (a series per key with
/// waiters would grow with the number of keys).
pub const QUEUE_SERIES: usize = 20;

pub struct Metrics {
    /// (operation, outcome): outcome `ok` or the error's name.
    requests: Mutex<BTreeMap<(String, String), u64>>,
    pub acquisitions: AtomicU64,
    pub contention: AtomicU64,
    pub releases: AtomicU64,
    waits: Histogram,
    store: Vec<Histogram>,
    started: Instant,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::new(BTreeMap::new()),
            acquisitions: AtomicU64::new(0),
            contention: AtomicU64::new(0),
            releases: AtomicU64::new(0),
            waits: Histogram::new(WAIT_BOUNDS),
            store: STORE_OPS.iter().map(|_| Histogram::new(STORE_BOUNDS)).collect(),
            started: Instant::now(),
        }
    }
}

/// The operation a request path names (for labels).
pub fn operation(method: &str, path: &str) -> &'static str {
    let rest = path.strip_prefix("/leases/").unwrap_or("");
    let first = rest.split('/').next().unwrap_or("");
    match (method, path, first) {
        (_, "/", _) => "page",
        (_, "/health", _) => "health",
        (_, "/metrics", _) => "metrics",
        (_, "/summary", _) => "summary",
        (_, "/openapi.json", _) => "openapi",
        (_, "/leases", _) => "list",
        ("POST", _, "acquire") => "acquire",
        ("POST", _, "heartbeat") => "heartbeat",
        ("POST", _, "release") => "release",
        ("POST", _, "force-release") => "force_release",
        ("POST", _, "next") => "next",
        ("POST", _, "put") => "put",
        ("POST", _, "count") => "count",
        (_, _, "history") => "history",
        ("GET", _, _) if !rest.is_empty() => "get",
        _ => "other",
    }
}

impl Metrics {
    /// Counts one answered request. `waited`: the acquire asked to wait (`wait_ms` > 0);
    /// `leases`: how many leases a successful `next` granted.
    pub fn answered(&self, op: &str, error: Option<&str>, took: Duration, waited: bool, leases: u64) {
        *self.requests.lock().unwrap().entry((op.to_string(), error.unwrap_or("ok").to_string())).or_default() += 1;
        match (op, error) {
            ("acquire", None) => {
                self.acquisitions.fetch_add(1, Ordering::Relaxed);
            }
            ("next", None) => {
                self.acquisitions.fetch_add(leases, Ordering::Relaxed);
            }
            ("acquire", Some("LeaseHeld")) => {
                self.contention.fetch_add(1, Ordering::Relaxed);
            }
            ("release", None) => {
                self.releases.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
        if op == "acquire" && waited {
            self.waits.observe(took);
        }
    }

    fn store_op(&self, op: usize, took: Duration) {
        self.store[op].observe(took);
    }

    /// The exposition: this process's counters, then the gauges of the operator views'
    /// snapshot `view` (queue lengths of the [`QUEUE_SERIES`] longest queues, waiters and keys
    /// with waiters in all, keys per work state).
    pub fn render(&self, view: &crate::snapshot::View, now_ms: u64) -> String {
        let mut o = String::new();
        self.render_counters(&mut o);
        let items: Vec<&Record> = view.items.values().filter(|r| r.queue.waiter.is_none()).collect();
        queue_lengths(&mut o, &items);
        work_states(&mut o, &items, now_ms);
        semaphores(&mut o, &items, now_ms);
        self.render_scrape(&mut o, view);
        o
    }

    /// This process's counters and latency histograms.
    fn render_counters(&self, o: &mut String) {
        let counter = |o: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        counter(
            o,
            "leasehold_acquisitions_total",
            "Leases granted by acquire and next.",
            self.acquisitions.load(Ordering::Relaxed),
        );
        counter(
            o,
            "leasehold_contention_total",
            "Acquires refused because the key was held (LeaseHeld).",
            self.contention.load(Ordering::Relaxed),
        );
        counter(
            o,
            "leasehold_releases_total",
            "Leases released by their holder.",
            self.releases.load(Ordering::Relaxed),
        );
        let taken = leasehold::history::counted(leasehold::history::EventKind::TakenOver);
        counter(
            o,
            "leasehold_expiries_taken_over_total",
            "Grants on keys whose last lease expired unreleased, written by this server (embedded store only).",
            taken,
        );
        let _ = writeln!(o, "# HELP leasehold_requests_total Requests answered, by operation and outcome (ok or the error's name).\n# TYPE leasehold_requests_total counter");
        let requests = self.requests.lock().unwrap().clone();
        for ((op, outcome), n) in &requests {
            let _ = writeln!(o, "leasehold_requests_total{{operation=\"{op}\",outcome=\"{outcome}\"}} {n}");
        }
        let _ = writeln!(o, "# HELP leasehold_errors_total Requests answered with an error, by error name.\n# TYPE leasehold_errors_total counter");
        let mut errors: BTreeMap<&str, u64> = BTreeMap::new();
        for ((_, outcome), n) in &requests {
            if outcome != "ok" {
                *errors.entry(outcome.as_str()).or_default() += n;
            }
        }
        for (name, n) in errors {
            let _ = writeln!(o, "leasehold_errors_total{{error=\"{name}\"}} {n}");
        }
        let _ = writeln!(o, "# HELP leasehold_acquire_wait_seconds Time acquires that asked to wait (wait_ms > 0) took, any outcome.\n# TYPE leasehold_acquire_wait_seconds histogram");
        self.waits.render(o, "leasehold_acquire_wait_seconds", "");
        let _ = writeln!(o, "# HELP leasehold_store_latency_seconds Time of each store request, by operation.\n# TYPE leasehold_store_latency_seconds histogram");
        for (i, op) in STORE_OPS.iter().enumerate() {
            self.store[i].render(o, "leasehold_store_latency_seconds", &format!("operation=\"{op}\""));
        }
    }

    /// How complete and how old the snapshot behind the gauges is, and this server's uptime.
    fn render_scrape(&self, o: &mut String, view: &crate::snapshot::View) {
        let _ = writeln!(o, "# HELP leasehold_scrape_complete 1 when the snapshot's scan read every item (at most {SCRAPE_ITEMS}), 0 when the gauges above count only the first ones.\n# TYPE leasehold_scrape_complete gauge\nleasehold_scrape_complete {}", u8::from(view.complete));
        let _ = writeln!(o, "# HELP leasehold_scrapes_total Scans of the store this server made for its page, /summary and /metrics (at most one per --scan-every).\n# TYPE leasehold_scrapes_total counter\nleasehold_scrapes_total {}", view.scans);
        let _ = writeln!(o, "# HELP leasehold_scrape_age_seconds Age of the scan the gauges above come from (this server's own writes since included).\n# TYPE leasehold_scrape_age_seconds gauge\nleasehold_scrape_age_seconds {}", view.age.as_secs_f64());
        let _ = writeln!(o, "# HELP leasehold_uptime_seconds Seconds since this server started.\n# TYPE leasehold_uptime_seconds gauge\nleasehold_uptime_seconds {}", self.started.elapsed().as_secs());
    }
}

/// The [`QUEUE_SERIES`] longest queues among `items`, and the waiters and keys with waiters in all.
fn queue_lengths(o: &mut String, items: &[&Record]) {
    let mut queues: Vec<(u64, &str)> =
        items.iter().filter(|r| r.queue_len() > 0).map(|r| (r.queue_len(), r.key.as_str())).collect();
    queues.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
    let _ = writeln!(o, "# HELP leasehold_queue_length Waiters queued on a key: the {QUEUE_SERIES} longest queues only (leasehold_queued_keys says how many keys have waiters).\n# TYPE leasehold_queue_length gauge");
    for (n, key) in queues.iter().take(QUEUE_SERIES) {
        let _ = writeln!(o, "leasehold_queue_length{{key=\"{}\"}} {n}", escape(key));
    }
    let _ = writeln!(o, "# HELP leasehold_queued_waiters Waiters queued on every key.\n# TYPE leasehold_queued_waiters gauge\nleasehold_queued_waiters {}", queues.iter().map(|q| q.0).sum::<u64>());
    let _ = writeln!(o, "# HELP leasehold_queued_keys Keys with waiters queued.\n# TYPE leasehold_queued_keys gauge\nleasehold_queued_keys {}", queues.len());
}

/// Keys per work state among `items`, and how many of them are held at `now_ms`.
fn work_states(o: &mut String, items: &[&Record], now_ms: u64) {
    let mut states: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for r in items {
        if let Some(s) = &r.work.state {
            let e = states.entry(s.as_str()).or_default();
            e.0 += 1;
            if r.shows_held(now_ms) {
                e.1 += 1;
            }
        }
    }
    let _ = writeln!(
        o,
        "# HELP leasehold_work_state_keys Keys in each work state.\n# TYPE leasehold_work_state_keys gauge"
    );
    for (s, (n, _)) in &states {
        let _ = writeln!(o, "leasehold_work_state_keys{{state=\"{}\"}} {n}", escape(s));
    }
    let _ = writeln!(o, "# HELP leasehold_work_state_held_keys Keys in each work state held right now.\n# TYPE leasehold_work_state_held_keys gauge");
    for (s, (_, h)) in &states {
        let _ = writeln!(o, "leasehold_work_state_held_keys{{state=\"{}\"}} {h}", escape(s));
    }
}

/// The semaphores among `items` (DESIGN.md, "Semaphores"): each one's N and live holders, and
/// each live holder's time left, labelled with its holder and fence (never a lease_id).
fn semaphores(o: &mut String, items: &[&Record], now_ms: u64) {
    let sems: Vec<&Record> = items.iter().copied().filter(|r| r.semaphore.slots.is_some()).collect();
    let _ = writeln!(o, "# HELP leasehold_semaphore_slots A semaphore's N.\n# TYPE leasehold_semaphore_slots gauge");
    for r in &sems {
        let _ =
            writeln!(o, "leasehold_semaphore_slots{{key=\"{}\"}} {}", escape(&r.key), r.semaphore.slots.unwrap_or(0));
    }
    let _ = writeln!(o, "# HELP leasehold_semaphore_slots_taken A semaphore's live holders.\n# TYPE leasehold_semaphore_slots_taken gauge");
    for r in &sems {
        let _ = writeln!(
            o,
            "leasehold_semaphore_slots_taken{{key=\"{}\"}} {}",
            escape(&r.key),
            r.live_slots(now_ms).count()
        );
    }
    let _ = writeln!(o, "# HELP leasehold_semaphore_holder_expires_in_seconds Time left of each live holder of a semaphore, by holder and fence.\n# TYPE leasehold_semaphore_holder_expires_in_seconds gauge");
    for r in &sems {
        for h in r.live_slots(now_ms) {
            let left = h.expires_at_ms.saturating_sub(now_ms) as f64 / 1000.0;
            let (k, holder) = (escape(&r.key), escape(&h.holder));
            let _ = writeln!(
                o,
                "leasehold_semaphore_holder_expires_in_seconds{{key=\"{k}\",holder=\"{holder}\",fence=\"{}\"}} {left}",
                h.fence
            );
        }
    }
}

/// A label value with `\`, `"` and newlines escaped.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// The store, timed: every request's latency goes to `leasehold_store_latency_seconds`; and
/// every item a request answers (written, rejected with the current item, read, deleted) goes
/// to the operator views' snapshot, when there is one.
pub struct Metered {
    pub inner: Arc<dyn Store>,
    pub metrics: Arc<Metrics>,
    pub snapshot: Option<Arc<crate::snapshot::Snapshot>>,
}

impl Metered {
    fn saw(&self, key: &str, record: Option<&Record>) {
        if let Some(s) = &self.snapshot {
            s.wrote(key, record);
        }
    }
}

#[async_trait]
impl Store for Metered {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    async fn get(&self, key: &str) -> leasehold::Result<Option<Record>> {
        let t = Instant::now();
        let r = self.inner.get(key).await;
        self.metrics.store_op(0, t.elapsed());
        if let Ok(item) = &r {
            self.saw(key, item.as_ref());
        }
        r
    }

    async fn update(&self, key: &str, condition: &Condition, mutation: &Mutation) -> leasehold::Result<Write> {
        let t = Instant::now();
        let r = self.inner.update(key, condition, mutation).await;
        self.metrics.store_op(1, t.elapsed());
        match &r {
            Ok(Write::Applied(item)) => self.saw(key, Some(item)),
            Ok(Write::Rejected(item)) => self.saw(key, item.as_ref()),
            Err(_) => {}
        }
        r
    }

    async fn delete(&self, key: &str, condition: &Condition) -> leasehold::Result<Write> {
        let t = Instant::now();
        let r = self.inner.delete(key, condition).await;
        self.metrics.store_op(2, t.elapsed());
        match &r {
            Ok(Write::Applied(_)) => self.saw(key, None),
            Ok(Write::Rejected(item)) => self.saw(key, item.as_ref()),
            Err(_) => {}
        }
        r
    }

    async fn scan(&self, kind: &ScanKind, start: Option<&str>, limit: u32) -> leasehold::Result<Page> {
        let t = Instant::now();
        let r = self.inner.scan(kind, start, limit).await;
        self.metrics.store_op(3, t.elapsed());
        r
    }

    fn clock(&self) -> Option<&ClockSamples> {
        self.inner.clock()
    }

    async fn count(&self, kind: &ScanKind) -> leasehold::Result<u64> {
        let t = Instant::now();
        let r = self.inner.count(kind).await;
        self.metrics.store_op(3, t.elapsed());
        r
    }
}
