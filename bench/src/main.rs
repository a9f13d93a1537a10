//! leasehold benchmarks on DynamoDB Local, behind a request-counting proxy.
//!
//! `leasehold-bench [--quick] [--scenarios m1,m2,m3,m4,batch] [--m1-cycles N] [--warmup N]
//! [--batch-items N]` starts DynamoDB Local and the proxy, then runs every scenario for every
//! library in a child process of its own (separate clients, separate peak RSS), interleaving
//! the libraries round by round, and prints one table per scenario with ratios. `batch` (not
//! run by default; see `batch.rs`) drains a work state with 8 workers against a hand-written
//! floor. Libraries: `leasehold` (on a table of
//! the same schema as the others), `leasehold+index` (on the table template.yaml deploys, with
//! the keep-alive index; M1 and M2 only), `raw` (a bare aws-sdk conditional PutItem +
//! DeleteItem loop: the floor), and with `--features compare` the `dynamodb-lease` crate (in
//! M3 twice: releasing with `Lease::release().await`, and by dropping the lease). Every library
//! first runs unmeasured M1 cycles (`--warmup`, default 3,000 each): DynamoDB Local's JIT
//! compiler otherwise takes a core for tens of thousands of requests. A different library
//! starts each M1 round. This is a benchmark, not a test: it asserts nothing and prints
//! figures.

mod batch;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::types::AttributeValue;
use leasehold::store::DynamoStore;
use leasehold::{AcquireOptions, Config, Coordinator};
use leasehold_tests::proxy::Proxy;
use leasehold_tests::{sdk_config_for, DynamoLocal, Holds};
use serde_json::{json, Value};

const LEASE: Duration = Duration::from_secs(10);

/// `leasehold` runs on a table of the same schema as the others (key + TTL); `leasehold+index`
/// on the table template.yaml deploys, with the sparse keep-alive index. DynamoDB Local
/// maintains a global secondary index synchronously inside every write (DynamoDB propagates
/// it asynchronously, off the write's latency), so the second row shows what the index costs
/// here, not in production.
fn libraries() -> Vec<&'static str> {
    let mut v = vec!["leasehold", "leasehold+index", "raw"];
    if cfg!(feature = "compare") {
        v.push("dynamodb-lease");
    }
    v
}

fn peak_rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).map(|l| l.to_string()))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|n| n.parse().ok()))
        .unwrap_or(0)
}

/// CPU time this process has used so far, in ms (every thread's run time from
/// /proc/self/task/*/schedstat, in ns).
fn cpu_ms() -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return f64::NAN };
    let mut ns = 0u64;
    for t in tasks.flatten() {
        if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
            ns += s.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        }
    }
    ns as f64 / 1e6
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// leasehold's configuration: the defaults, except that `LEASEHOLD_BENCH_POLL_MAX_MS` sets the
/// longest pause between a waiter's attempts (to see what it trades in M3).
fn config() -> Config {
    let mut c = Config::default();
    if let Some(ms) = std::env::var("LEASEHOLD_BENCH_POLL_MAX_MS").ok().and_then(|v| v.parse().ok()) {
        c.poll_max = Duration::from_millis(ms);
    }
    c
}

/// One library behind a uniform acquire/release interface.
enum Lib {
    Leasehold(Coordinator),
    /// leasehold with a lease other than `LEASE` (M4).
    LeaseholdShort(Coordinator, Duration),
    Raw(aws_sdk_dynamodb::Client, String),
    /// dynamodb-lease; with `true`, leases are released by dropping them (the crate then
    /// deletes the item in a spawned task) instead of awaiting `Lease::release`.
    #[cfg(feature = "compare")]
    DynamodbLease(dynamodb_lease::Client, bool),
}

/// A held lease of any library.
enum Held {
    Leasehold(String, leasehold::LeaseId),
    Raw(String, String),
    #[cfg(feature = "compare")]
    DynamodbLease(dynamodb_lease::Lease),
}

impl Lib {
    fn coord(&self) -> &Coordinator {
        match self {
            Lib::Leasehold(c) | Lib::LeaseholdShort(c, _) => c,
            _ => unreachable!("not leasehold"),
        }
    }

    fn lease(&self) -> Duration {
        match self {
            Lib::LeaseholdShort(_, d) => *d,
            _ => LEASE,
        }
    }

    async fn new(name: &str, endpoint: &str, table: &str) -> Lib {
        let conf = sdk_config_for(endpoint).await;
        let client = aws_sdk_dynamodb::Client::new(&conf);
        match name {
            "leasehold" | "leasehold+index" => {
                Lib::Leasehold(Coordinator::new(Arc::new(DynamoStore::new(client, table)), config()))
            }
            "raw" => Lib::Raw(client, table.to_string()),
            #[cfg(feature = "compare")]
            "dynamodb-lease" | "dynamodb-lease/drop" => Lib::DynamodbLease(
                dynamodb_lease::Client::builder()
                    .table_name(table)
                    .lease_ttl_seconds(LEASE.as_secs() as u32)
                    .build_and_check_db(client)
                    .await
                    .expect("dynamodb-lease client"),
                name.ends_with("/drop"),
            ),
            other => panic!("unknown library {other}"),
        }
    }

    /// Acquire without waiting.
    async fn try_acquire(&self, key: &str, holder: &str) -> Option<Held> {
        match self {
            Lib::Leasehold(_) | Lib::LeaseholdShort(..) => {
                match self.coord().acquire(key, holder, Some(self.lease()), AcquireOptions::default()).await {
                    Ok(l) => Some(Held::Leasehold(key.into(), l.lease_id)),
                    Err(leasehold::Error::LeaseHeld { .. }) => None,
                    Err(e) => panic!("{e}"),
                }
            }
            Lib::Raw(c, t) => {
                let v = format!("{holder}-{}", Instant::now().elapsed().as_nanos());
                let r = c
                    .put_item()
                    .table_name(t)
                    .item("key", AttributeValue::S(key.into()))
                    .item("v", AttributeValue::S(v.clone()))
                    .condition_expression("attribute_not_exists(#k)")
                    .expression_attribute_names("#k", "key")
                    .send()
                    .await;
                match r {
                    Ok(_) => Some(Held::Raw(key.into(), v)),
                    Err(e) if e.as_service_error().is_some_and(|s| s.is_conditional_check_failed_exception()) => None,
                    Err(e) => panic!("{e:?}"),
                }
            }
            #[cfg(feature = "compare")]
            Lib::DynamodbLease(c, _) => c.try_acquire(key).await.expect("try_acquire").map(Held::DynamodbLease),
        }
    }

    /// Acquire with the library's own waiting.
    async fn acquire_wait(&self, key: &str, holder: &str, wait: Duration) -> Option<Held> {
        match self {
            Lib::Leasehold(_) | Lib::LeaseholdShort(..) => {
                match self
                    .coord()
                    .acquire(key, holder, Some(self.lease()), AcquireOptions { wait: Some(wait), ..Default::default() })
                    .await
                {
                    Ok(l) => Some(Held::Leasehold(key.into(), l.lease_id)),
                    Err(leasehold::Error::LeaseHeld { .. }) => None,
                    Err(e) => panic!("{e}"),
                }
            }
            Lib::Raw(..) => {
                let deadline = Instant::now() + wait;
                loop {
                    if let Some(h) = self.try_acquire(key, holder).await {
                        return Some(h);
                    }
                    if Instant::now() > deadline {
                        return None;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            #[cfg(feature = "compare")]
            Lib::DynamodbLease(c, _) => c.acquire_timeout(key, wait).await.ok().map(Held::DynamodbLease),
        }
    }

    async fn release(&self, held: Held) {
        match (self, held) {
            (Lib::Leasehold(_) | Lib::LeaseholdShort(..), Held::Leasehold(k, id)) => {
                self.coord().release(&k, &id).await.expect("release");
            }
            (Lib::Raw(c, t), Held::Raw(k, v)) => {
                c.delete_item()
                    .table_name(t)
                    .key("key", AttributeValue::S(k))
                    .condition_expression("#v = :v")
                    .expression_attribute_names("#v", "v")
                    .expression_attribute_values(":v", AttributeValue::S(v))
                    .send()
                    .await
                    .expect("delete");
            }
            #[cfg(feature = "compare")]
            (Lib::DynamodbLease(_, false), Held::DynamodbLease(l)) => l.release().await.expect("release"),
            #[cfg(feature = "compare")]
            (Lib::DynamodbLease(_, true), Held::DynamodbLease(l)) => drop(l),
            _ => unreachable!("lease of another library"),
        }
    }
}

/// Child process: runs one scenario of one library and prints one JSON line.
async fn child(lib: &str, scenario: &str, endpoint: &str, table: &str, n: usize, secs: u64, tag: &str) -> Value {
    match scenario {
        "m1" => {
            let l = Lib::new(lib, endpoint, table).await;
            let mut lat = Vec::with_capacity(n);
            let (mut acq, mut rel) = (Vec::with_capacity(n), Vec::with_capacity(n));
            let cpu0 = cpu_ms();
            let t = Instant::now();
            for i in 0..n {
                let s = Instant::now();
                let h = l.try_acquire(&format!("m1-{tag}-{i}"), "w").await.expect("uncontended acquire");
                let a = s.elapsed().as_secs_f64() * 1000.0;
                l.release(h).await;
                let total = s.elapsed().as_secs_f64() * 1000.0;
                lat.push(total);
                acq.push(a);
                rel.push(total - a);
            }
            let el = t.elapsed().as_secs_f64();
            let cpu = cpu_ms() - cpu0;
            for v in [&mut lat, &mut acq, &mut rel] {
                v.sort_by(|a, b| a.partial_cmp(b).unwrap());
            }
            json!({"cycles": n, "secs": el, "p50": pct(&lat, 0.5), "p99": pct(&lat, 0.99),
                   "acquire_p50": pct(&acq, 0.5), "release_p50": pct(&rel, 0.5), "cpu_ms": cpu, "rss_kb": peak_rss_kb()})
        }
        "m2" => {
            let l = Arc::new(Lib::new(lib, endpoint, table).await);
            let next = Arc::new(AtomicU64::new(0));
            let t = Instant::now();
            let mut tasks = Vec::new();
            for _ in 0..16 {
                let (l, next, tag) = (l.clone(), next.clone(), tag.to_string());
                tasks.push(tokio::spawn(async move {
                    loop {
                        let i = next.fetch_add(1, Ordering::SeqCst);
                        if i as usize >= n {
                            break;
                        }
                        let h = l.try_acquire(&format!("m2-{tag}-{i}"), "w").await.expect("distinct key");
                        l.release(h).await;
                    }
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
            json!({"cycles": n, "secs": t.elapsed().as_secs_f64(), "rss_kb": peak_rss_kb()})
        }
        "m3" => {
            // 8 workers, each with its own client, on one key.
            let mut libs = Vec::new();
            for _ in 0..8 {
                libs.push(Arc::new(Lib::new(lib, endpoint, table).await));
            }
            let key = format!("m3-{tag}");
            let holds = Arc::new(Holds::default());
            let last_release = Arc::new(Mutex::new(None::<Instant>));
            let handovers = Arc::new(Mutex::new(Vec::<f64>::new()));
            let stop_at = Instant::now() + Duration::from_secs(secs);
            let mut tasks = Vec::new();
            for (w, l) in libs.into_iter().enumerate() {
                let (key, holds, last_release, handovers) =
                    (key.clone(), holds.clone(), last_release.clone(), handovers.clone());
                tasks.push(tokio::spawn(async move {
                    let mut mine = 0u64;
                    while Instant::now() < stop_at {
                        let remaining = stop_at.saturating_duration_since(Instant::now());
                        let Some(h) =
                            l.acquire_wait(&key, &format!("w{w}"), remaining.max(Duration::from_millis(1))).await
                        else {
                            continue;
                        };
                        if let Some(r) = *last_release.lock().unwrap() {
                            handovers.lock().unwrap().push(r.elapsed().as_secs_f64() * 1000.0);
                        }
                        holds.enter();
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        holds.leave();
                        *last_release.lock().unwrap() = Some(Instant::now());
                        l.release(h).await;
                        mine += 1;
                    }
                    mine
                }));
            }
            let mut per = Vec::new();
            for t in tasks {
                per.push(t.await.unwrap());
            }
            let mut h = handovers.lock().unwrap().clone();
            h.sort_by(|a, b| a.partial_cmp(b).unwrap());
            json!({"per_worker": per, "acquisitions": per.iter().sum::<u64>(), "overlaps": holds.overlaps(),
                   "handover_p50": pct(&h, 0.5), "handover_p99": pct(&h, 0.99), "rss_kb": peak_rss_kb()})
        }
        other => panic!("unknown scenario {other}"),
    }
}

/// M1 figures of one library, summed over its rounds.
#[derive(Default)]
struct M1Acc {
    secs: f64,
    cycles: usize,
    p50: Vec<f64>,
    p99: Vec<f64>,
    requests: u64,
    cpu_ms: f64,
}

impl M1Acc {
    fn rate(&self) -> f64 {
        self.cycles as f64 / self.secs
    }
}

struct Setup {
    _local: DynamoLocal,
    proxy: Proxy,
    tables: BTreeMap<&'static str, String>,
}

async fn setup() -> Setup {
    let local = tokio::task::spawn_blocking(|| DynamoLocal::start(None)).await.unwrap();
    let upstream = format!("127.0.0.1:{}", local.port).parse().unwrap();
    let proxy = Proxy::start(upstream).await;
    let client = local.client().await;
    let mut tables = BTreeMap::new();
    for lib in libraries() {
        let table = format!("bench-{}", lib.replace(['-', '+'], "_"));
        match lib {
            "leasehold" | "leasehold+index" => DynamoStore::new(client.clone(), table.clone())
                .create_table_with(lib == "leasehold+index")
                .await
                .expect("table"),
            _ => {
                use aws_sdk_dynamodb::types::*;
                client
                    .create_table()
                    .table_name(&table)
                    .billing_mode(BillingMode::PayPerRequest)
                    .attribute_definitions(
                        AttributeDefinition::builder()
                            .attribute_name("key")
                            .attribute_type(ScalarAttributeType::S)
                            .build()
                            .unwrap(),
                    )
                    .key_schema(
                        KeySchemaElement::builder().attribute_name("key").key_type(KeyType::Hash).build().unwrap(),
                    )
                    .send()
                    .await
                    .expect("table");
                client
                    .update_time_to_live()
                    .table_name(&table)
                    .time_to_live_specification(
                        TimeToLiveSpecification::builder()
                            .attribute_name("lease_expiry")
                            .enabled(true)
                            .build()
                            .unwrap(),
                    )
                    .send()
                    .await
                    .expect("ttl");
            }
        }
        tables.insert(lib, table);
    }
    Setup { _local: local, proxy, tables }
}

/// Runs one child and returns its JSON plus the proxy's request count during it.
async fn run_child(s: &Setup, lib: &str, scenario: &str, n: usize, secs: u64, tag: &str) -> (Value, u64) {
    let (v, counts) = run_child_counts(s, lib, scenario, n, secs, tag).await;
    (v, counts.values().sum())
}

/// Runs one child and returns its JSON plus the proxy's requests during it, per operation.
async fn run_child_counts(
    s: &Setup,
    lib: &str,
    scenario: &str,
    n: usize,
    secs: u64,
    tag: &str,
) -> (Value, BTreeMap<String, u64>) {
    s.proxy.reset_counts();
    let exe = std::env::current_exe().unwrap();
    let out = tokio::process::Command::new(exe)
        .args([
            "--child",
            lib,
            scenario,
            &s.proxy.endpoint(),
            &s.tables[lib.trim_end_matches("/drop")],
            &n.to_string(),
            &secs.to_string(),
            tag,
        ])
        .output()
        .await
        .expect("child");
    assert!(out.status.success(), "{lib} {scenario} failed: {}", String::from_utf8_lossy(&out.stderr));
    let line = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(line.lines().last().unwrap_or("")).expect("child json");
    (v, s.proxy.counts())
}

/// M3's physical limit, measured here: the median time a 5 ms hold really takes (the timer's
/// granularity included) and the median round trip of a `GetItem` through the proxy.
async fn hold_and_round_trip(s: &Setup) -> (f64, f64) {
    let client = aws_sdk_dynamodb::Client::new(&sdk_config_for(&s.proxy.endpoint()).await);
    let table = &s.tables["leasehold"];
    let (mut holds, mut rtts) = (Vec::new(), Vec::new());
    for i in 0..200 {
        let t = Instant::now();
        tokio::time::sleep(Duration::from_millis(5)).await;
        holds.push(t.elapsed().as_secs_f64() * 1000.0);
        let t = Instant::now();
        client
            .get_item()
            .table_name(table)
            .key("key", AttributeValue::S(format!("rtt-{i}")))
            .consistent_read(true)
            .send()
            .await
            .expect("get");
        rtts.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    for v in [&mut holds, &mut rtts] {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    }
    (pct(&holds, 0.5), pct(&rtts, 0.5))
}

/// M4: A holds a 2 s lease and dies; B already waits. The gap between A's last write and B's
/// acquiring write, from the proxy's log.
async fn m4(s: &Setup, lib: &str, trial: usize) -> f64 {
    let key = format!("m4-{lib}-{trial}");
    s.proxy.record(true);
    let endpoint = s.proxy.endpoint();
    let table = s.tables[lib].clone();
    // A in its own runtime, torn down without releasing: a crash.
    let (k2, e2, t2, l2) = (key.clone(), endpoint.clone(), table.clone(), lib.to_string());
    let a_done = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        rt.block_on(async {
            let l = Lib::new_with_lease(&l2, &e2, &t2, Duration::from_secs(2)).await;
            let h = l.try_acquire(&k2, "A").await.expect("A acquires");
            std::mem::forget(h);
            std::mem::forget(l);
        });
        rt.shutdown_background();
    });
    a_done.join().unwrap();
    let b = Lib::new_with_lease(lib, &endpoint, &table, Duration::from_secs(2)).await;
    let h = b.acquire_wait(&key, "B", Duration::from_secs(10)).await.expect("B acquires");
    s.proxy.record(false);
    let events = s.proxy.events();
    let writes: Vec<_> = events
        .iter()
        .filter(|e| {
            e.status == 200 && matches!(e.target.as_str(), "PutItem" | "UpdateItem") && e.request.contains(&key)
        })
        .collect();
    let gap = match (writes.first(), writes.last()) {
        (Some(a), Some(b)) if writes.len() >= 2 => (b.at_ms - a.at_ms) as f64,
        _ => f64::NAN,
    };
    b.release(h).await;
    gap
}

impl Lib {
    async fn new_with_lease(name: &str, endpoint: &str, table: &str, lease: Duration) -> Lib {
        match name {
            "leasehold" => {
                let conf = sdk_config_for(endpoint).await;
                let store = DynamoStore::new(aws_sdk_dynamodb::Client::new(&conf), table);
                Lib::LeaseholdShort(Coordinator::new(Arc::new(store), config()), lease)
            }
            #[cfg(feature = "compare")]
            "dynamodb-lease" => {
                let conf = sdk_config_for(endpoint).await;
                Lib::DynamodbLease(
                    dynamodb_lease::Client::builder()
                        .table_name(table)
                        .lease_ttl_seconds(lease.as_secs() as u32)
                        .build_and_check_db(aws_sdk_dynamodb::Client::new(&conf))
                        .await
                        .expect("client"),
                    false,
                )
            }
            _ => Lib::new(name, endpoint, table).await,
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    if args.get(1).map(String::as_str) == Some("--child") {
        let a = &args[2..];
        let v = rt.block_on(child(&a[0], &a[1], &a[2], &a[3], a[4].parse().unwrap(), a[5].parse().unwrap(), &a[6]));
        println!("{v}");
        return;
    }
    let quick = args.iter().any(|a| a == "--quick");
    let scenarios: Vec<String> = args
        .iter()
        .position(|a| a == "--scenarios")
        .and_then(|i| args.get(i + 1))
        .map(|s| s.split(',').map(str::to_string).collect())
        .unwrap_or_else(|| vec!["m1".into(), "m2".into(), "m3".into(), "m4".into()]);
    rt.block_on(main_async(quick, scenarios));
}

async fn main_async(quick: bool, scenarios: Vec<String>) {
    let s = setup().await;
    let libs = libraries();
    let (mut m1n, m2n, m3s, m4trials, mut rounds) = if quick { (200, 600, 5, 2, 2) } else { (1000, 3000, 20, 4, 4) };
    // `--m1-cycles N`: more M1 cycles (in rounds of 250) for steadier ratios on a noisy machine.
    let args: Vec<String> = std::env::args().collect();
    if let Some(n) =
        args.iter().position(|a| a == "--m1-cycles").and_then(|i| args.get(i + 1)).and_then(|v| v.parse::<usize>().ok())
    {
        m1n = n.max(250);
        rounds = m1n / 250;
    }
    // `--warmup N`: unmeasured M1 cycles per library first. DynamoDB Local's JIT compiler
    // keeps a core busy for tens of thousands of requests; measured before it settles, the
    // figures mostly say who ran while it was compiling.
    let warmup = args
        .iter()
        .position(|a| a == "--warmup")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(if quick { 200 } else { 3000 });
    let has = |x: &str| scenarios.iter().any(|s| s == x);
    println!(
        "leasehold-bench: DynamoDB Local 3.3.1 (in memory) behind a counting proxy; lease 10 s; libraries: {}",
        libs.join(", ")
    );
    let mut rss: BTreeMap<&str, u64> = BTreeMap::new();
    if has("m1") {
        // Interleaved rounds: every library runs a slice of the cycles in turn.
        let mut acc: BTreeMap<&str, M1Acc> = BTreeMap::new();
        // Warm-up, not measured: DynamoDB Local's JIT compiles each request shape on first use,
        // which would otherwise be charged to whichever library runs first.
        for lib in &libs {
            run_child(&s, lib, "m1", warmup, 0, &format!("{lib}-warm")).await;
        }
        for r in 0..rounds {
            // A different library starts each round.
            let mut order = libs.clone();
            order.rotate_left(r % libs.len());
            for lib in &order {
                let (v, reqs) = run_child(&s, lib, "m1", m1n / rounds, 0, &format!("{lib}-{r}")).await;
                if std::env::var_os("LEASEHOLD_BENCH_VERBOSE").is_some() {
                    eprintln!("m1 {lib} round {r}: {v}");
                }
                let e = acc.entry(lib).or_default();
                e.secs += v["secs"].as_f64().unwrap();
                e.cycles += v["cycles"].as_u64().unwrap() as usize;
                e.p50.push(v["p50"].as_f64().unwrap());
                e.p99.push(v["p99"].as_f64().unwrap());
                e.requests += reqs;
                e.cpu_ms += v["cpu_ms"].as_f64().unwrap_or(f64::NAN);
                *rss.entry(lib).or_default() = rss.get(lib).copied().unwrap_or(0).max(v["rss_kb"].as_u64().unwrap());
            }
        }
        let floor = acc["raw"].rate();
        println!("\nM1 uncontended: 1 worker, acquire+release of distinct keys, {m1n} cycles each, {rounds} interleaved rounds");
        println!("(p50/p99: medians over the rounds; client CPU: the harness process's CPU time per cycle)");
        println!(
            "{:<16} {:>10} {:>9} {:>9} {:>13} {:>12} {:>9}",
            "library", "cycles/s", "p50 ms", "p99 ms", "requests/cyc", "client CPU", "vs raw"
        );
        for lib in &libs {
            let a = &acc[lib];
            let med = |v: &Vec<f64>| {
                let mut v = v.clone();
                v.sort_by(|a, b| a.partial_cmp(b).unwrap());
                pct(&v, 0.5)
            };
            println!(
                "{:<16} {:>10.0} {:>9.2} {:>9.2} {:>13.2} {:>10.0}µs {:>8.2}x",
                lib,
                a.rate(),
                med(&a.p50),
                med(&a.p99),
                a.requests as f64 / a.cycles as f64,
                a.cpu_ms * 1000.0 / a.cycles as f64,
                a.rate() / floor
            );
        }
        if let Some(dl) = acc.get("dynamodb-lease") {
            println!("leasehold / dynamodb-lease: {:.2}x", acc["leasehold"].rate() / dl.rate());
        }
    }
    if has("m2") {
        for lib in &libs {
            run_child(&s, lib, "m2", 300, 0, &format!("{lib}-m2warm")).await;
        }
        println!("\nM2 parallel: 16 workers on distinct keys, {m2n} cycles");
        println!("{:<16} {:>10} {:>13}", "library", "cycles/s", "requests/cyc");
        for lib in &libs {
            let (v, reqs) = run_child(&s, lib, "m2", m2n, 0, &format!("{lib}-m2")).await;
            let cps = m2n as f64 / v["secs"].as_f64().unwrap();
            *rss.entry(lib).or_default() = rss.get(lib).copied().unwrap_or(0).max(v["rss_kb"].as_u64().unwrap());
            println!("{:<16} {:>10.0} {:>13.2}", lib, cps, reqs as f64 / m2n as f64);
        }
    }
    if has("m3") {
        println!("\nM3 contention: 8 workers (separate clients) on ONE key for {m3s} s, hold 5 ms, each library's own waiting");
        println!(
            "(req/acq: every request per acquisition, releases included; put/acq: acquiring PutItems per acquisition)"
        );
        println!(
            "{:<20} {:>8} {:>16} {:>9} {:>11} {:>11} {:>9} {:>9} {:>9}",
            "library", "acq", "per-worker", "max/min", "hand p50", "hand p99", "req/acq", "put/acq", "overlaps"
        );
        let mut acqs = BTreeMap::new();
        // dynamodb-lease twice: releasing with `Lease::release().await`, and by dropping the
        // lease (its documented default: the item is deleted in a spawned task).
        let mut m3libs: Vec<&str> = libs.iter().copied().filter(|l| !matches!(*l, "raw" | "leasehold+index")).collect();
        if cfg!(feature = "compare") {
            m3libs.push("dynamodb-lease/drop");
        }
        for lib in &m3libs {
            let (v, counts) = run_child_counts(&s, lib, "m3", 0, m3s, &format!("{}-m3", lib.replace('/', "-"))).await;
            // Client set-up (dynamodb-lease describes the table) is not part of the contention.
            let reqs: u64 = counts.iter().filter(|(op, _)| !op.starts_with("Describe")).map(|(_, n)| n).sum();
            let puts = counts.get("PutItem").copied().unwrap_or(0);
            if std::env::var_os("LEASEHOLD_BENCH_VERBOSE").is_some() {
                eprintln!("m3 {lib}: {v}");
            }
            let per: Vec<u64> = v["per_worker"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
            let acq = v["acquisitions"].as_u64().unwrap();
            acqs.insert(*lib, acq);
            let (mx, mn) = (*per.iter().max().unwrap(), *per.iter().min().unwrap());
            *rss.entry(lib).or_default() = rss.get(lib).copied().unwrap_or(0).max(v["rss_kb"].as_u64().unwrap());
            println!(
                "{:<20} {:>8} {:>16} {:>9} {:>9.1}ms {:>9.1}ms {:>9.2} {:>9.2} {:>9}",
                lib,
                acq,
                format!("{mn}..{mx}"),
                if mn == 0 { "inf".to_string() } else { format!("{:.2}", mx as f64 / mn as f64) },
                v["handover_p50"].as_f64().unwrap_or(f64::NAN),
                v["handover_p99"].as_f64().unwrap_or(f64::NAN),
                reqs as f64 / acq.max(1) as f64,
                puts as f64 / acq.max(1) as f64,
                v["overlaps"]
            );
        }
        for other in ["dynamodb-lease", "dynamodb-lease/drop"] {
            if let Some(dl) = acqs.get(other) {
                println!("leasehold / {other} acquisitions: {:.2}x", acqs["leasehold"] as f64 / (*dl).max(1) as f64);
            }
        }
        // What no library can exceed: holds back to back, each next holder learning of the
        // release within one request round trip, without a single wasted request.
        let (hold, rtt) = hold_and_round_trip(&s).await;
        let ceiling = m3s as f64 * 1000.0 / (hold + rtt);
        println!(
            "ceiling for any library without overlapping holds: {m3s} s / (hold {hold:.2} ms + one round trip {rtt:.2} ms) = {ceiling:.0} acquisitions"
        );
    }
    if has("m4") {
        let margin = Config::default().skew_margin.as_millis();
        println!("\nM4 crash handover: A holds a 2,000 ms lease and dies, B already waits; gap between A's last write and B's acquiring write (proxy clock); skew margin {margin} ms, bound 2,000..={} ms", 2000 + margin + 100);
        for lib in libs.iter().filter(|l| !matches!(**l, "raw" | "leasehold+index")) {
            let mut gaps = Vec::new();
            for t in 0..m4trials {
                gaps.push(m4(&s, lib, t).await);
            }
            println!("{:<16} gaps ms: {}", lib, gaps.iter().map(|g| format!("{g:.0}")).collect::<Vec<_>>().join(", "));
        }
    }
    if has("batch") {
        // `--batch-items N` (default 5,000; 1,000 with --quick), 8 workers, batches of 10.
        let items = args
            .iter()
            .position(|a| a == "--batch-items")
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(if quick { 1000 } else { 5000 });
        batch::run(&s.proxy, items, 8, 10, if quick { 1 } else { 2 }).await;
    }
    println!("\nPeak RSS of each harness process (VmHWM):");
    for (lib, kb) in &rss {
        println!("{:<16} {:>6.1} MB", lib, *kb as f64 / 1024.0);
    }
}
