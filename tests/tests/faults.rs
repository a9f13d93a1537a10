//! Lost answers and what the caller is told about them (issues 22 and 27): an `OutcomeUnknown`
//! names the lease_id it is about on every interface, a "may have landed" is carried across a
//! whole acquire, `ClockSkew` tells when to try again, the clock check never judges on stale
//! evidence, and a batch taker drains a state through a store that drops and delays answers.

mod cli_support;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cli_support::{clean_command, command_with_clock, dynamo_env, output, Server};
use leasehold::api::{self, Operation};
use leasehold::store::DynamoStore;
use leasehold::{AcquireOptions, Config, Coordinator, Error, LeaseId};
use leasehold_tests::proxy::ProxyFault;
use leasehold_tests::{
    both_backends, dynamo_local, proxied_table, test_config, wrap, Backend, Fault, Faulty, Intercept, Wrapped,
};
use serde_json::{json, Value};

both_backends!(
    an_acquire_whose_answers_are_all_lost_names_its_lease_id,
    a_throttled_end_after_a_lost_answer_is_outcome_unknown,
    a_wait_that_lost_an_answer_and_then_saw_the_key_held_is_outcome_unknown,
    an_invocation_ends_within_its_remaining_time,
    a_lost_batch_names_the_leases_it_may_have_taken,
);

fn secs(s: u64) -> Option<Duration> {
    Some(Duration::from_secs(s))
}

/// The lease_id an `OutcomeUnknown` names (panics on anything else).
fn unknown_id(r: Result<leasehold::Lease, Error>) -> LeaseId {
    match r {
        Err(Error::OutcomeUnknown { lease_id: Some(id), .. }) => leasehold::validate::lease_id(&id).unwrap(),
        other => panic!("expected OutcomeUnknown with a lease_id, got {other:?}"),
    }
}

/// Every answer to an acquire is lost (the writes land): the caller, who let the coordinator
/// choose the lease_id, is told `OutcomeUnknown` with that lease_id; a release with it frees
/// the key at once and another holder takes it. The same through direct invoke (the error
/// body's `lease_id`).
async fn an_acquire_whose_answers_are_all_lost_names_its_lease_id(b: Backend) {
    let faulty = Faulty::new(b.store());
    let cfg = Config { retry_budget: Duration::from_millis(500), ..test_config() };
    let c = Coordinator::new(faulty.clone(), cfg);
    let other = b.coordinator(test_config());
    faulty.inject(&vec![Fault::LoseResponse; 1000]);
    let r = c.acquire("lost", "a", secs(600), AcquireOptions::default()).await;
    faulty.plan.lock().unwrap().clear();
    let id = unknown_id(r);
    // It landed: a 10-minute lease nobody else can take ...
    let held = other.acquire("lost", "b", secs(60), AcquireOptions::default()).await;
    assert!(matches!(held, Err(Error::LeaseHeld { .. })), "{held:?}");
    // ... until it is released with the lease_id the answer named.
    let released = c.release("lost", &id).await.unwrap();
    assert!(!released.already_released);
    other.acquire("lost", "b", secs(60), AcquireOptions::default()).await.unwrap();

    // Direct invoke: the error body carries it.
    faulty.inject(&vec![Fault::LoseResponse; 1000]);
    let r = api::run(&c, Operation::Acquire, None, json!({"key": "lost2", "holder": "a", "duration_ms": 600000}), None)
        .await;
    faulty.plan.lock().unwrap().clear();
    let body = r.expect_err("the outcome is unknown").to_json();
    assert_eq!(body["error"], "OutcomeUnknown", "{body}");
    let id = body["lease_id"].as_str().unwrap_or_else(|| panic!("no lease_id in {body}")).to_string();
    assert_eq!(body["key"], "lost2");
    api::run(&c, Operation::Release, None, json!({"key": "lost2", "lease_id": id}), None).await.unwrap();
    other.acquire("lost2", "b", secs(60), AcquireOptions::default()).await.unwrap();
}

/// A write that timed out and was then throttled until the deadline may have landed: the end
/// is `OutcomeUnknown` (DESIGN.md), not `Throttled`.
async fn a_throttled_end_after_a_lost_answer_is_outcome_unknown(b: Backend) {
    let faulty = Faulty::new(b.store());
    let cfg = Config { retry_budget: Duration::from_millis(500), ..test_config() };
    let c = Coordinator::new(faulty.clone(), cfg);
    let mut plan = vec![Fault::LoseResponse];
    plan.extend(vec![Fault::Throttle; 1000]);
    faulty.inject(&plan);
    let r = c.acquire("throttled", "a", secs(600), AcquireOptions::default()).await;
    faulty.plan.lock().unwrap().clear();
    let id = unknown_id(r);
    c.release("throttled", &id).await.unwrap();
    b.coordinator(test_config()).acquire("throttled", "b", secs(60), AcquireOptions::default()).await.unwrap();
}

/// A waiting acquire whose first attempt's answer was lost, and which then saw the key held
/// until its wait ended: its first write may still land (a request stuck in the network), so
/// it answers `OutcomeUnknown` with its lease_id, not `LeaseHeld`.
async fn a_wait_that_lost_an_answer_and_then_saw_the_key_held_is_outcome_unknown(b: Backend) {
    let holder = b.coordinator(test_config());
    holder.acquire("busy", "holder", secs(60), AcquireOptions::default()).await.unwrap();
    let faulty = Faulty::new(b.store());
    let c = Coordinator::new(faulty.clone(), test_config());
    faulty.inject(&[Fault::LoseResponse]);
    let r = c.acquire(
        "busy",
        "w",
        secs(60),
        AcquireOptions { wait: Some(Duration::from_millis(600)), ..Default::default() },
    );
    let r = r.await;
    assert_eq!(faulty.injected.load(Ordering::SeqCst), 1);
    unknown_id(r);
    // Without a lost answer, the same wait ends `LeaseHeld`.
    let r = c.acquire(
        "busy",
        "w",
        secs(60),
        AcquireOptions { wait: Some(Duration::from_millis(300)), ..Default::default() },
    );
    assert!(matches!(r.await, Err(Error::LeaseHeld { .. })));
}

/// Clock evidence older than its bound (5 minutes: an idle process, a thawed VM) is not
/// evidence: the first decision after it reads the store again, and a wrong clock is refused
/// (the old check read again only when no sample at all was kept, and let this acquire take
/// the key with a clock 5 s ahead).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stale_clock_evidence_is_refreshed_before_judging() {
    let b = Backend::dynamo().await;
    let store = b.store();
    let honest = Coordinator::new(store.clone(), test_config());
    honest.acquire("stale-a", "honest", secs(60), AcquireOptions::default()).await.unwrap();
    store.clock().expect("DynamoDB keeps clock samples").backdate(Duration::from_secs(6 * 60));
    let wrong = Coordinator::new(store.clone(), Config { clock_offset_ms: 5_000, ..test_config() });
    let r = wrong.acquire("stale-b", "wrong", secs(60), AcquireOptions::default()).await;
    assert!(matches!(r, Err(Error::ClockSkew(_))), "{r:?}");
    assert!(matches!(honest.get("stale-b").await, Err(Error::NotFound { .. })), "nothing was written");
    // The honest coordinator, on the refreshed evidence, goes on.
    honest.acquire("stale-c", "honest", secs(60), AcquireOptions::default()).await.unwrap();
}

/// A new process's workers all find too little clock evidence at once: they share the reads
/// one of them makes for it, instead of each reading for its own (16 workers read up to 48
/// times before, each waiting for a lock and a round trip). The evidence is then as before:
/// every acquire was checked and granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_finding_too_little_clock_evidence_share_the_reads_for_it() {
    let (proxy, table, conf) = proxied_table().await;
    let store = Arc::new(DynamoStore::new(aws_sdk_dynamodb::Client::new(&conf), table));
    let c = Coordinator::new(store, test_config());
    proxy.reset_counts();
    let mut tasks = Vec::new();
    for w in 0..16 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            c.acquire(&format!("evidence-{w}"), "w", secs(60), AcquireOptions::default()).await.map(|_| ())
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let counts = proxy.counts();
    let reads = counts.get("GetItem").copied().unwrap_or(0);
    assert_eq!(counts.get("PutItem").copied(), Some(16), "{counts:?}");
    // `AGREEMENT` answers are needed; a read may come without a usable `Date` (twice that).
    assert!((3..=6).contains(&reads), "reads for clock evidence: {reads} ({counts:?})");
}

/// A wall clock that a test steps (the machine's, plus an offset).
#[derive(Debug, Default)]
struct Stepped(std::sync::atomic::AtomicI64);

impl leasehold::Clock for Stepped {
    fn wall_us(&self) -> i64 {
        leasehold::SystemClock.wall_us() + self.0.load(Ordering::SeqCst)
    }
    fn now(&self) -> Instant {
        leasehold::SystemClock.now()
    }
}

/// Once armed, steps `clock` 60 s ahead: on the next write, which it answers "throttled"
/// without sending it (the clock jumps while the write waits for its retry), or, with
/// `on_read`, during the next read, which it answers as the store does.
struct JumpOnWrite {
    clock: Arc<Stepped>,
    armed: std::sync::atomic::AtomicBool,
    on_read: bool,
}

#[async_trait::async_trait]
impl Intercept for JumpOnWrite {
    async fn get(
        &self,
        store: &Arc<dyn leasehold::store::Store>,
        key: &str,
    ) -> leasehold::Result<Option<leasehold::Record>> {
        let r = store.get(key).await;
        if self.on_read && self.armed.swap(false, Ordering::SeqCst) {
            self.clock.0.fetch_add(60_000_000, Ordering::SeqCst);
        }
        r
    }
    async fn update(
        &self,
        store: &Arc<dyn leasehold::store::Store>,
        key: &str,
        c: &leasehold::store::Condition,
        m: &leasehold::store::Mutation,
    ) -> leasehold::Result<leasehold::store::Write> {
        if !self.on_read && self.armed.swap(false, Ordering::SeqCst) {
            self.clock.0.fetch_add(60_000_000, Ordering::SeqCst);
            return Err(Error::Throttled("injected".into()));
        }
        store.update(key, c, m).await
    }
    fn passes_clock(&self) -> bool {
        true
    }
}

/// The store of `b` with a [`JumpOnWrite`] stepping `clock`.
fn jump_on(b: &Backend, clock: &Arc<Stepped>, on_read: bool) -> Arc<Wrapped<JumpOnWrite>> {
    wrap(b.store(), JumpOnWrite { clock: clock.clone(), armed: Default::default(), on_read })
}

/// The simulation's clock jumps (seed 2 of the simulation; FINDINGS.md). The clock
/// was checked before an acquire's first try; the try was throttled, and during the backoff
/// the clock was stepped 60 s ahead. The retry must check the clock again: sent as it was, its
/// `:now` saw the live lease of another holder as expired and took the key (two holders).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_retried_after_a_clock_step_checks_the_clock_again() {
    let b = Backend::dynamo().await;
    let honest = b.coordinator(test_config());
    let held = honest.acquire("jump", "honest", secs(30), AcquireOptions::default()).await.unwrap();
    let clock = Arc::new(Stepped::default());
    let store = jump_on(&b, &clock, false);
    let jumper = Coordinator::new(store.clone(), Config { clock: clock.clone(), ..test_config() });
    // Evidence first: the jumper's clock agrees with the store's.
    let other = jumper.acquire("jump-other", "jumper", secs(30), AcquireOptions::default()).await.unwrap();
    jumper.release("jump-other", &other.lease_id).await.unwrap();
    store.armed.store(true, Ordering::SeqCst);
    let r = jumper.acquire("jump", "jumper", secs(30), AcquireOptions::default()).await;
    assert!(!store.armed.load(Ordering::SeqCst), "the first try was sent");
    assert!(matches!(r, Err(Error::ClockSkew(_))), "{r:?}");
    // The honest holder still holds its lease, and renews it.
    let s = honest.get("jump").await.unwrap();
    assert!(s.held && s.holder == "honest" && s.fence == held.fence, "{s:?}");
    honest.heartbeat("jump", &held.lease_id, secs(30)).await.unwrap();
    honest.release("jump", &held.lease_id).await.unwrap();
}

/// The simulation's clock jumps (seed 362 of `--seeds 1000`, `two_holders`). Serving a queue
/// reads the lease item, then judges it free and grants it to the head waiter with the clock
/// as it is after the read. The clock was checked before the read, and stepped 60 s ahead
/// during it: the live lease looked expired, and the waiter was granted the key under its
/// holder. The clock is now checked after the read, right before it is read for the grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_served_after_a_clock_step_during_its_read_grants_nothing() {
    let b = Backend::dynamo().await;
    let rec = Arc::new(Deliveries::default());
    let honest = b.coordinator(test_config()).with_deliver(rec.clone());
    let k = "jump-queue";
    let held = honest.acquire(k, "honest", secs(30), AcquireOptions::default()).await.unwrap();
    let d = Duration::from_secs(30);
    let q = honest.acquire_or_enqueue(k, "waiter", d, AcquireOptions::default(), "token-w", None).await.unwrap();
    assert!(matches!(q, leasehold::queue::Enqueued::Queued { .. }), "{q:?}");
    let clock = Arc::new(Stepped::default());
    let store = jump_on(&b, &clock, true);
    let jumper =
        Coordinator::new(store.clone(), Config { clock: clock.clone(), ..test_config() }).with_deliver(rec.clone());
    // Evidence first: the jumper's clock agrees with the store's.
    let other = jumper.acquire("jump-queue-other", "jumper", secs(30), AcquireOptions::default()).await.unwrap();
    jumper.release("jump-queue-other", &other.lease_id).await.unwrap();
    store.armed.store(true, Ordering::SeqCst);
    let r = jumper.serve_queue(k).await;
    assert!(!store.armed.load(Ordering::SeqCst), "the lease item was read");
    assert!(matches!(r, Err(Error::ClockSkew(_))), "{r:?}");
    assert!(rec.0.lock().unwrap().is_empty(), "a grant was delivered");
    let s = honest.get(k).await.unwrap();
    assert!(s.held && s.holder == "honest" && s.fence == held.fence, "{s:?}");
    honest.release(k, &held.lease_id).await.unwrap();
}

/// Step Functions whose every `SendTaskSuccess` is throttled, and during whose
/// first `SendTaskFailure` the clock given is stepped 60 s back (an NTP step while the call is
/// under way); it records the tokens told.
struct ThrottledThenStepped {
    clock: Arc<Stepped>,
    step: std::sync::atomic::AtomicBool,
    failed: Mutex<Vec<String>>,
}

#[async_trait::async_trait]
impl leasehold::queue::Deliver for ThrottledThenStepped {
    async fn success(&self, _: &str, _: &leasehold::Lease) -> Result<(), leasehold::queue::DeliveryError> {
        Err(leasehold::queue::DeliveryError::Transient("ThrottlingException".into()))
    }
    async fn failure(&self, token: &str, _: &str, _: &str) -> Result<(), leasehold::queue::DeliveryError> {
        if self.step.swap(false, Ordering::SeqCst) {
            self.clock.0.fetch_sub(60_000_000, Ordering::SeqCst);
        }
        self.failed.lock().unwrap().push(token.to_string());
        Ok(())
    }
}

/// `end_undelivered`'s stamp (`sim/tests/queue_findings.rs` on the simulated store). A queue
/// grant whose every delivery failed expired; serving the key tells its waiter
/// (`SendTaskFailure`, `LeaseExpired`) and removes the undelivered mark, stamping `freed_at_ms`
/// (from then on plain and fail-closed acquires sent later may take the key). The clock was
/// stepped 60 s back during the `SendTaskFailure`, and the stamp was written with it unchecked:
/// 60 s before the key was freed. The clock is now checked right before it is read for that
/// write: refused, the mark stays until a clock that passes the check removes it. (DynamoDB
/// only: the embedded store has no remote clock to check a coordinator's against.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_grant_s_mark_is_not_stamped_with_a_clock_stepped_during_its_failure() {
    let b = Backend::dynamo().await;
    let clock = Arc::new(Stepped::default());
    let sfn = Arc::new(ThrottledThenStepped { clock: clock.clone(), step: true.into(), failed: Mutex::default() });
    let c = Coordinator::new(b.store(), Config { clock: clock.clone(), ..test_config() }).with_deliver(sfn.clone());
    let k = "jump-expired-grant";
    let held = c.acquire(k, "holder", secs(30), AcquireOptions::default()).await.unwrap();
    let d = Duration::from_millis(500);
    let q = c.acquire_or_enqueue(k, "waiter", d, AcquireOptions::default(), "token-w", None).await.unwrap();
    assert!(matches!(q, leasehold::queue::Enqueued::Queued { .. }), "{q:?}");
    // The hand-over's grant is never delivered: it stays marked, and expires.
    c.release(k, &held.lease_id).await.unwrap();
    let item = b.store().get(k).await.unwrap().unwrap();
    assert_eq!(item.queue.pending_token.as_deref(), Some("token-w"), "{item:?}");
    tokio::time::sleep(d + Duration::from_millis(200)).await;
    let before = leasehold::Clock::wall_ms(&leasehold::SystemClock) as u64;
    let r = c.serve_queue(k).await;
    assert_eq!(*sfn.failed.lock().unwrap(), ["token-w"], "the waiter was told");
    let item = b.store().get(k).await.unwrap().unwrap();
    assert!(
        item.queue.freed_at_ms.is_none_or(|f| f >= before),
        "the key's freeing was stamped {} ms before it happened ({r:?})",
        before.saturating_sub(item.queue.freed_at_ms.unwrap_or(before))
    );
    assert!(matches!(r, Err(Error::ClockSkew(_))), "{r:?}");
    assert!(item.queue.pending_token.is_some(), "the mark stays for a clock that passes the check: {item:?}");
    // NTP steps the clock back: the mark goes, stamped with a true clock. Every stamp is the
    // coordinator's clock moved back to what the store's answers prove its clock to be at
    // least (DESIGN.md, "Clocks"): up to a second behind this machine's with DynamoDB's
    // whole-second `Date`, so the stamp is compared with that clock as it was before.
    clock.0.fetch_add(60_000_000, Ordering::SeqCst);
    let before = c.now_ms();
    c.serve_queue(k).await.unwrap();
    let item = b.store().get(k).await.unwrap().unwrap();
    assert!(item.queue.pending_token.is_none() && item.queue.freed_at_ms.is_some_and(|f| f >= before), "{item:?}");
}

/// A server whose clock is refused says when to try again: `Retry-After` (and
/// `retry_after_ms` in the body), so that clients retrying 503s do not hot-loop on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clock_skew_says_when_to_retry_over_http() {
    let local = tokio::task::spawn_blocking(dynamo_local).await.unwrap();
    leasehold_tests::set_local_credentials();
    let table = local.store().await.table().to_string();
    let env = dynamo_env(&local.endpoint);
    let server = tokio::task::spawn_blocking(move || {
        Server::start_command(command_with_clock(5.0), &["--table".to_string(), table], &env)
    })
    .await
    .unwrap();
    let url = format!("{}/leases/acquire/skewed", server.url);
    let r = leasehold_tests::http::post_json(&url, &json!({"holder": "h", "duration_ms": 5000})).await.unwrap();
    let body = r.json();
    assert_eq!((r.status, body["error"].as_str()), (503, Some("ClockSkew")), "{body}");
    let after: u64 = r.header("retry-after").expect("a Retry-After").parse().unwrap();
    assert!(after >= leasehold::CLOCK_SKEW_RETRY_AFTER.as_secs(), "Retry-After: {after}");
    assert_eq!(body["retry_after_ms"].as_u64(), Some(leasehold::CLOCK_SKEW_RETRY_AFTER.as_millis() as u64));
    // The CLI asked to wait retries no sooner than that (once within a 7 s wait), and then
    // reports the refusal.
    let t = Instant::now();
    let mut c = clean_command();
    c.args(["--url", &server.url, "acquire", "skewed", "--holder", "cli", "--wait", "7s", "--json"]);
    let out = tokio::task::spawn_blocking(move || output(c)).await.unwrap();
    assert_eq!((out.code, out.json()["error"].as_str()), (77, Some("ClockSkew")), "{out:?}");
    assert!(t.elapsed() >= leasehold::CLOCK_SKEW_RETRY_AFTER, "retried after {:?}", t.elapsed());
}

/// A fresh table behind the fault proxy, with `leasehold serve --table` in front of it.
async fn served_through_proxy(
    extra_env: &[(&str, &str)],
) -> (Arc<leasehold_tests::proxy::Proxy>, String, Server, Coordinator) {
    let (proxy, table, _) = proxied_table().await;
    let mut env = dynamo_env(&proxy.endpoint());
    env.extend(extra_env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let args = vec!["--table".to_string(), table.clone()];
    let server = tokio::task::spawn_blocking(move || Server::start(&args, &env)).await.unwrap();
    let local = dynamo_local();
    let direct = Coordinator::new(Arc::new(DynamoStore::new(local.client().await, table.clone())), test_config());
    (proxy, table, server, direct)
}

/// The issue-22 check through `leasehold serve --table` and the CLI: every answer to an
/// acquire's writes is dropped; the answer is `OutcomeUnknown` with the lease_id (HTTP body,
/// CLI `--json` and text), a release with it frees the key, and another holder takes it at
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_acquire_names_its_lease_id_over_http_and_the_cli() {
    let (proxy, table, server, direct) = served_through_proxy(&[("LEASEHOLD_RETRY_BUDGET_MS", "800")]).await;
    let post = |path: String, body: Value| {
        let url = format!("{}{path}", server.url);
        async move { leasehold_tests::http::post_json(&url, &body).await.unwrap() }
    };
    // Warm the clock evidence, then lose every acquire write's answer. The warming lease is
    // longer than a new process's safe margin (about 1.25 s on DynamoDB Local: DESIGN.md,
    // "Clocks"), so that it is granted with a safe time within the 800 ms retry budget.
    let warm = post("/leases/acquire/warm".into(), json!({"holder": "h", "duration_ms": 30000})).await;
    assert_eq!(warm.status, 200, "{}", warm.json());
    proxy.add_random_faults(&["PutItem"], 1000, &[ProxyFault::DropResponse]);
    let r = post("/leases/acquire/k1".into(), json!({"holder": "a", "duration_ms": 600000})).await;
    proxy.clear_faults();
    let body = r.json();
    assert_eq!((r.status, body["error"].as_str()), (503, Some("OutcomeUnknown")), "{body}");
    let id = body["lease_id"].as_str().unwrap_or_else(|| panic!("no lease_id in {body}")).to_string();
    assert!(direct.get("k1").await.unwrap().held, "the write landed");
    let r = post("/leases/release/k1".into(), json!({"lease_id": id})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = post("/leases/acquire/k1".into(), json!({"holder": "b", "duration_ms": 60000})).await;
    assert_eq!(r.status, 200, "another holder takes it at once: {}", r.text());

    // The CLI on the same table, through the proxy: --json and text.
    let cli = |args: &[&str]| {
        let mut c = clean_command();
        c.args(["--table", &table]).args(args);
        for (k, v) in dynamo_env(&proxy.endpoint()) {
            c.env(k, v);
        }
        c.env("LEASEHOLD_RETRY_BUDGET_MS", "800");
        c
    };
    for (key, json_out) in [("k2", true), ("k3", false)] {
        // Warm this process's clock evidence with reads first: the drop hits only writes.
        proxy.add_random_faults(&["PutItem"], 1000, &[ProxyFault::DropResponse]);
        let mut args = vec!["acquire", key, "--holder", "cli", "--duration", "10m"];
        if json_out {
            args.push("--json");
        }
        let out = tokio::task::spawn_blocking({
            let c = cli(&args);
            move || output(c)
        })
        .await
        .unwrap();
        proxy.clear_faults();
        assert_eq!(out.code, 77, "{out:?}");
        let id = if json_out {
            let v = out.json();
            assert_eq!(v["error"], "OutcomeUnknown", "{v}");
            v["lease_id"].as_str().unwrap_or_else(|| panic!("no lease_id in {v}")).to_string()
        } else {
            let line = out.stderr.lines().find(|l| l.trim_start().starts_with("lease_id")).unwrap_or_else(|| {
                panic!("no lease_id line in {:?}", out.stderr);
            });
            line.split_whitespace().nth(1).unwrap().to_string()
        };
        let released = tokio::task::spawn_blocking({
            let c = cli(&["release", key, "--lease-id", &id]);
            move || output(c)
        })
        .await
        .unwrap();
        assert_eq!(released.code, 0, "{released:?}");
        direct.acquire(key, "other", secs(60), AcquireOptions::default()).await.unwrap();
    }
}

/// `leasehold acquire --fail-closed` prints the lease_id it chose with every error (a
/// fail-closed lease whose outcome is unknown can otherwise only be force-released).
#[test]
fn a_fail_closed_acquire_prints_its_lease_id_with_every_error() {
    let t = cli_support::Target::embedded();
    t.run(&["acquire", "fc", "--holder", "a", "--duration", "1m"]).ok();
    let out = t.run(&["acquire", "fc", "--holder", "b", "--fail-closed", "--json"]).code(75);
    let v = out.json();
    assert_eq!(v["error"], "LeaseHeld");
    leasehold::validate::lease_id(v["lease_id"].as_str().unwrap_or_else(|| panic!("no lease_id in {v}"))).unwrap();
    let out = t.run(&["acquire", "fc", "--holder", "b", "--fail-closed"]).code(75);
    assert!(out.stderr.contains("lease_id"), "{:?}", out.stderr);
    // Not for an ordinary acquire that certainly took nothing.
    let v = t.run(&["acquire", "fc", "--holder", "b", "--duration", "1m", "--json"]).code(75).json();
    assert!(v.get("lease_id").is_none(), "{v}");
}

/// Issue 22's "Done when": through `leasehold serve --table` on DynamoDB Local, with 3% of the
/// store's answers dropped and 10% of its Query, PutItem and UpdateItem requests held 1 s then
/// cut (and forwarded 1.85 s after they arrived, after the retry), 8 takers drain 300 work
/// items with `next --limit 5`: at most 2% of the batches answer 503, every item reaches its
/// final state, and no item is processed twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn takers_drain_a_state_through_dropped_and_delayed_answers() {
    const ITEMS: usize = 300;
    const TAKERS: usize = 8;
    let (proxy, _table, server, direct) = served_through_proxy(&[("RUST_LOG", "error")]).await;
    for i in 0..ITEMS {
        direct.put(&format!("item/{i:03}"), "TODO", "loader").await.unwrap();
    }
    proxy.add_random_faults(
        &["Query", "PutItem", "UpdateItem"],
        100,
        &[ProxyFault::DelayedDuplicate {
            hold: Duration::from_millis(1000),
            forward_after: Duration::from_millis(1850),
        }],
    );
    proxy.add_random_faults(&[], 30, &[ProxyFault::DropResponse]);

    #[derive(Default)]
    struct Tally {
        /// next calls that answered leases or an error (empty answers not counted).
        batches: AtomicU64,
        unavailable: AtomicU64,
        errors: Mutex<BTreeMap<String, u64>>,
        /// key -> the lease_ids whose work ran on it.
        processed: Mutex<HashMap<String, Vec<String>>>,
        done: AtomicU64,
    }
    let tally = Arc::new(Tally::default());
    let started = Instant::now();
    let give_up = started + Duration::from_secs(150);
    let mut tasks = Vec::new();
    for t in 0..TAKERS {
        let (tally, url) = (tally.clone(), server.url.clone());
        tasks.push(tokio::spawn(async move {
            let holder = format!("taker-{t}");
            while tally.done.load(Ordering::SeqCst) < ITEMS as u64 && Instant::now() < give_up {
                let body = json!({"holder": holder, "limit": 5, "duration_ms": 30000});
                let r = match leasehold_tests::http::post_json(&format!("{url}/leases/next/TODO"), &body).await {
                    Ok(r) => r,
                    Err(e) => panic!("the server did not answer: {e}"),
                };
                let v = r.json();
                if r.status != 200 {
                    tally.batches.fetch_add(1, Ordering::SeqCst);
                    if r.status == 503 {
                        tally.unavailable.fetch_add(1, Ordering::SeqCst);
                    }
                    *tally.errors.lock().unwrap().entry(format!("{} {}", r.status, v["error"])).or_default() += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                let leases = v["leases"].as_array().cloned().unwrap_or_default();
                if leases.is_empty() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                tally.batches.fetch_add(1, Ordering::SeqCst);
                for l in leases {
                    let (key, id) =
                        (l["key"].as_str().unwrap().to_string(), l["lease_id"].as_str().unwrap().to_string());
                    tally.processed.lock().unwrap().entry(key.clone()).or_default().push(id.clone());
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    // Into the final state; a retry of the same release is idempotent.
                    let path = format!("{url}/leases/release/{key}");
                    let mut tries = 0;
                    loop {
                        tries += 1;
                        let r = leasehold_tests::http::post_json(&path, &json!({"lease_id": id, "state": "DONE"}))
                            .await
                            .unwrap();
                        if r.status == 200 {
                            tally.done.fetch_add(1, Ordering::SeqCst);
                            break;
                        }
                        assert!(r.status == 503 && tries < 20, "release of {key}: {} {}", r.status, r.text());
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("taker");
    }
    proxy.clear_faults();
    let (batches, unavailable) = (tally.batches.load(Ordering::SeqCst), tally.unavailable.load(Ordering::SeqCst));
    let processed = tally.processed.lock().unwrap().clone();
    let twice: Vec<_> = processed.iter().filter(|(_, ids)| ids.len() > 1).collect();
    let done = direct.count_in_state("DONE").await.unwrap();
    println!(
        "fault run: {ITEMS} items, {TAKERS} takers, {:.1} s, {batches} batches, {unavailable} answered 503 ({:.1}%), \
         errors {:?}, proxy injected {} faults ({} late forwards), DONE {done}",
        started.elapsed().as_secs_f64(),
        100.0 * unavailable as f64 / batches.max(1) as f64,
        tally.errors.lock().unwrap(),
        proxy.injected(),
        proxy.late_forwarded(),
    );
    assert!(twice.is_empty(), "processed twice: {twice:?}");
    assert_eq!(done, ITEMS as u64, "every item reached its final state");
    assert_eq!(direct.count_in_state("TODO").await.unwrap(), 0);
    assert!(unavailable * 50 <= batches, "{unavailable} of {batches} batches answered 503 (at most 2%)");
}

/// Records deliveries of queued grants.
#[derive(Default)]
struct Deliveries(Mutex<Vec<String>>);

#[async_trait::async_trait]
impl leasehold::queue::Deliver for Deliveries {
    async fn success(&self, token: &str, _: &leasehold::Lease) -> Result<(), leasehold::queue::DeliveryError> {
        self.0.lock().unwrap().push(token.to_string());
        Ok(())
    }
    async fn failure(&self, _: &str, _: &str, _: &str) -> Result<(), leasehold::queue::DeliveryError> {
        Ok(())
    }
}

/// The scheduled heartbeat function on a clock 30 s ahead: the keep-alive sweep is refused with
/// `ClockSkew`, and so is the queue sweep after it; the old handler ran the queue sweep anyway,
/// saw the live lease as expired and handed the key to the head waiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_clock_runs_no_queue_sweep() {
    use leasehold::lambda::{Function, Handler};
    let b = Backend::dynamo().await;
    let deliveries = Arc::new(Deliveries::default());
    let honest = Coordinator::new(b.store(), test_config()).with_deliver(deliveries.clone());
    let held = honest.acquire("queued", "holder", secs(20), AcquireOptions::default()).await.unwrap();
    let q = honest
        .acquire_or_enqueue("queued", "waiter", Duration::from_secs(60), AcquireOptions::default(), "token-1", None)
        .await
        .unwrap();
    assert!(matches!(q, leasehold::queue::Enqueued::Queued { .. }), "{q:?}");
    // A new heartbeat function whose clock runs 30 s ahead (its own store client): to it the
    // 20 s lease looks expired.
    let Backend::Dynamo(ddb) = &b else { unreachable!() };
    let store: Arc<dyn leasehold::store::Store> =
        Arc::new(DynamoStore::new(dynamo_local().client().await, ddb.table().to_string()));
    let wrong =
        Coordinator::new(store, Config { clock_offset_ms: 30_000, ..test_config() }).with_deliver(deliveries.clone());
    let h =
        Handler { function: Function::Heartbeat, coord: wrong, executions: None, running: None, sweep_max_items: 100 };
    let event = json!({"source": "aws.events", "detail-type": "Scheduled Event", "detail": {}});
    let _ = h.handle(event, Duration::from_secs(20)).await;
    assert!(deliveries.0.lock().unwrap().is_empty(), "a live key was handed over: {:?}", deliveries.0.lock().unwrap());
    let s = honest.get("queued").await.unwrap();
    assert!(s.held && s.fence == held.fence, "{s:?}");
}

/// An invocation with `remaining` time (a Lambda's): an acquire or a batch whose writes are
/// throttled answers before the invocation ends, not when the retry budget does (the final
/// attempt's retries used to run on past the invoke's safety margin).
async fn an_invocation_ends_within_its_remaining_time(b: Backend) {
    let faulty = Faulty::new(b.store());
    let cfg = Config { retry_budget: Duration::from_secs(8), ..test_config() };
    let c = Coordinator::new(faulty.clone(), cfg);
    c.put("inv/1", "INV", "loader").await.unwrap();
    faulty.inject(&vec![Fault::Throttle; 10_000]);
    let remaining = Duration::from_millis(2500);
    let t = Instant::now();
    let acquire = json!({"key": "inv", "holder": "h", "duration_ms": 60000, "wait_ms": 500});
    let r = api::run(&c, Operation::Acquire, None, acquire, Some(remaining)).await;
    assert!(matches!(r, Err(Error::Throttled(_))), "{r:?}");
    assert!(t.elapsed() < remaining, "the acquire answered after {:?}", t.elapsed());
    let t = Instant::now();
    let next = json!({"holder": "h", "limit": 1, "duration_ms": 60000, "wait_ms": 500});
    let r = api::run(&c, Operation::Next, Some("INV"), next, Some(remaining)).await;
    assert!(matches!(r, Err(Error::Throttled(_))), "{r:?}");
    assert!(t.elapsed() < remaining, "the batch answered after {:?}", t.elapsed());
    faulty.plan.lock().unwrap().clear();
}

/// A batch whose every write answer is lost: `OutcomeUnknown` names the `(key, lease_id)` of
/// every lease it may have taken; releasing them frees those keys at once (the old answer named
/// none, so they stayed held until they expired).
async fn a_lost_batch_names_the_leases_it_may_have_taken(b: Backend) {
    let faulty = Faulty::new(b.store());
    let cfg = Config { retry_budget: Duration::from_millis(300), ..test_config() };
    let c = Coordinator::new(faulty.clone(), cfg);
    for i in 0..6 {
        c.put(&format!("lb/{i}"), "LB", "loader").await.unwrap();
    }
    faulty.inject(&vec![Fault::LoseResponse; 200]);
    let r = c.acquire_next("LB", 4, "t", secs(600), AcquireOptions::default()).await;
    faulty.plan.lock().unwrap().clear();
    let leases = match &r {
        Err(e @ Error::OutcomeUnknown { .. }) => e.unknown_leases(),
        other => panic!("expected OutcomeUnknown, got {other:?}"),
    };
    assert!(!leases.is_empty(), "{r:?}");
    let body = r.unwrap_err().to_json();
    assert_eq!(body["leases"].as_array().map(Vec::len), Some(leases.len()), "{body}");
    let other = b.coordinator(test_config());
    for (key, id) in &leases {
        c.release(key, &leasehold::validate::lease_id(id).unwrap()).await.unwrap();
    }
    // Every key is free again at once: all six are taken now.
    let got = other.acquire_next("LB", 10, "u", secs(60), AcquireOptions::default()).await.unwrap();
    assert_eq!(got.len(), 6, "{got:?}");
}
