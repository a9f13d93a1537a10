//! `GET /metrics` of `leasehold serve`: the Prometheus text format, parsed by a Prometheus
//! text-format parser (the `prometheus-parse` crate), with the values a scripted set of
//! requests must leave: acquisitions, contention, a waited acquire, releases, an expiry taken
//! over, errors by name, store latency, a queue length, work-state counts and a semaphore's slots and holders. The gauges come
//! from a snapshot of the store: one series per key for the 20 longest queues only, and on
//! DynamoDB one eventually consistent scan per `--scan-every` however many views ask, with the
//! server's own writes applied in between.

mod cli_support;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use cli_support::{http, Server, Target};
use leasehold::queue::{Deliver, DeliveryError, Enqueued};
use leasehold::{AcquireOptions, Coordinator, Lease};
use leasehold_tests::test_config;
use prometheus_parse::{Sample, Scrape, Value as P};
use serde_json::Value;

struct Nobody;

#[async_trait]
impl Deliver for Nobody {
    async fn success(&self, _: &str, _: &Lease) -> Result<(), DeliveryError> {
        Ok(())
    }
    async fn failure(&self, _: &str, _: &str, _: &str) -> Result<(), DeliveryError> {
        Ok(())
    }
}

fn post(addr: &str, path: &str, body: &str) -> (u16, Value) {
    let (s, _, b) = http(addr, "POST", path, &[("content-type", "application/json")], body.as_bytes());
    (s, serde_json::from_str(&b).unwrap_or(Value::Null))
}

fn scrape(addr: &str) -> (Scrape, String) {
    let (s, h, b) = http(addr, "GET", "/metrics", &[], b"");
    assert_eq!(s, 200, "{b}");
    let ct = h.iter().find(|(k, _)| k == "content-type").map(|(_, v)| v.as_str()).unwrap_or("");
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    let parsed = Scrape::parse(b.lines().map(|l| Ok(l.to_string()))).expect("the Prometheus text format parses");
    (parsed, b)
}

fn find<'a>(s: &'a Scrape, metric: &str, labels: &[(&str, &str)]) -> Option<&'a Sample> {
    s.samples.iter().find(|x| x.metric == metric && labels.iter().all(|(k, v)| x.labels.get(k) == Some(*v)))
}

fn num(s: &Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    match find(s, metric, labels).map(|x| &x.value) {
        Some(P::Counter(v) | P::Gauge(v) | P::Untyped(v)) => *v,
        other => panic!("{metric} {labels:?}: {other:?}"),
    }
}

fn histogram_count(s: &Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    match find(s, metric, labels).map(|x| &x.value) {
        Some(P::Histogram(b)) => b.iter().map(|c| c.count).fold(0.0, f64::max),
        other => panic!("{metric} {labels:?}: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_parse_and_count_what_happened() {
    let target = Target::embedded();
    let env = vec![
        ("LEASEHOLD_MIN_DURATION_MS".to_string(), "100".to_string()),
        ("LEASEHOLD_SKEW_MARGIN_MS".to_string(), "50".to_string()),
    ];
    let server = Server::start(&target.args, &env);
    let a = server.addr.clone();
    let db = std::path::PathBuf::from(&target.args[1]);
    let addr = a.clone();
    let put_keys = 3;
    let (queued_key, fences) = tokio::task::spawn_blocking(move || {
        let a = addr;
        // Acquire; contention (refused, and refused after a wait); a bad heartbeat; a release.
        let (s, l) = post(&a, "/leases/acquire/m/a", r#"{"holder":"h","duration_ms":30000}"#);
        assert_eq!(s, 200, "{l}");
        assert_eq!(post(&a, "/leases/acquire/m/a", r#"{"holder":"x"}"#).0, 409);
        assert_eq!(post(&a, "/leases/acquire/m/a", r#"{"holder":"x","wait_ms":300}"#).0, 409);
        let bad = r#"{"lease_id":"zzzzzzzzzzzzzzzzzzzzzzzzzz"}"#;
        assert_eq!(post(&a, "/leases/heartbeat/m/a", bad).1["error"], "NotHolder");
        let rel = serde_json::json!({"lease_id": l["lease_id"]}).to_string();
        assert_eq!(post(&a, "/leases/release/m/a", &rel).0, 200);
        // Work items: three keys put into PENDING, one taken by next.
        for k in ["w/1", "w/2", "w/3"] {
            assert_eq!(post(&a, &format!("/leases/put/{k}"), r#"{"state":"PENDING","holder":"p"}"#).0, 200);
        }
        let (s, n) = post(&a, "/leases/next/PENDING", r#"{"holder":"w","limit":1,"duration_ms":30000}"#);
        assert_eq!((s, n["leases"].as_array().map(Vec::len)), (200, Some(1)), "{n}");
        // A crash taken over after expiry.
        assert_eq!(post(&a, "/leases/acquire/m/t", r#"{"holder":"crash","duration_ms":1000}"#).0, 200);
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(post(&a, "/leases/acquire/m/t", r#"{"holder":"next","duration_ms":30000}"#).0, 200);
        // A held key for a waiter to queue on.
        assert_eq!(post(&a, "/leases/acquire/m/q", r#"{"holder":"q","duration_ms":30000}"#).0, 200);
        // A semaphore of 4 slots with 3 holders.
        let mut fences = Vec::new();
        for h in ["s1", "s2", "s3"] {
            let body = format!(r#"{{"holder":"{h}","duration_ms":30000,"slots":4}}"#);
            let (s, l) = post(&a, "/leases/acquire/m/sem", &body);
            assert_eq!(s, 200, "{l}");
            fences.push((h, l["fence"].as_u64().unwrap()));
        }
        ("m/q", fences)
    })
    .await
    .unwrap();
    // A queued waiter, written by another process on the same store file.
    let store = leasehold::store::SqliteStore::open(&db).unwrap();
    let c = Coordinator::new(Arc::new(store), test_config()).with_deliver(Arc::new(Nobody) as Arc<dyn Deliver>);
    let q = c
        .acquire_or_enqueue(queued_key, "waiter", Duration::from_secs(60), AcquireOptions::default(), "tok", None)
        .await
        .unwrap();
    assert!(matches!(q, Enqueued::Queued { .. }), "{q:?}");

    let (m, text) = tokio::task::spawn_blocking(move || scrape(&a)).await.unwrap();
    // acquire m/a, next (1 lease), m/t twice, m/q, three slots of m/sem.
    assert_eq!(num(&m, "leasehold_acquisitions_total", &[]), 8.0, "{text}");
    assert_eq!(num(&m, "leasehold_semaphore_slots", &[("key", "m/sem")]), 4.0, "{text}");
    assert_eq!(num(&m, "leasehold_semaphore_slots_taken", &[("key", "m/sem")]), 3.0, "{text}");
    for (h, f) in &fences {
        let left = num(
            &m,
            "leasehold_semaphore_holder_expires_in_seconds",
            &[("key", "m/sem"), ("holder", h), ("fence", &f.to_string())],
        );
        assert!(left > 0.0 && left <= 30.0, "{h}: {left}\n{text}");
    }
    assert_eq!(num(&m, "leasehold_contention_total", &[]), 2.0, "{text}");
    assert_eq!(num(&m, "leasehold_releases_total", &[]), 1.0, "{text}");
    assert_eq!(num(&m, "leasehold_expiries_taken_over_total", &[]), 1.0, "{text}");
    assert_eq!(num(&m, "leasehold_errors_total", &[("error", "LeaseHeld")]), 2.0, "{text}");
    assert_eq!(num(&m, "leasehold_errors_total", &[("error", "NotHolder")]), 1.0, "{text}");
    assert_eq!(num(&m, "leasehold_requests_total", &[("operation", "put"), ("outcome", "ok")]), put_keys as f64);
    assert_eq!(histogram_count(&m, "leasehold_acquire_wait_seconds", &[]), 1.0, "{text}");
    assert!(histogram_count(&m, "leasehold_store_latency_seconds", &[("operation", "update")]) >= 10.0, "{text}");
    assert_eq!(num(&m, "leasehold_queue_length", &[("key", "m/q")]), 1.0, "{text}");
    assert_eq!(num(&m, "leasehold_queued_waiters", &[]), 1.0, "{text}");
    assert_eq!(num(&m, "leasehold_queued_keys", &[]), 1.0, "{text}");
    assert_eq!(num(&m, "leasehold_work_state_keys", &[("state", "PENDING")]), 3.0, "{text}");
    assert_eq!(num(&m, "leasehold_work_state_held_keys", &[("state", "PENDING")]), 1.0, "{text}");
    assert_eq!(num(&m, "leasehold_scrape_complete", &[]), 1.0);
    // Every metric is documented in the exposition (HELP and TYPE).
    for name in [
        "leasehold_acquisitions_total",
        "leasehold_contention_total",
        "leasehold_acquire_wait_seconds",
        "leasehold_store_latency_seconds",
        "leasehold_queue_length",
        "leasehold_work_state_keys",
        "leasehold_semaphore_slots",
        "leasehold_semaphore_slots_taken",
        "leasehold_semaphore_holder_expires_in_seconds",
    ] {
        assert!(m.docs.contains_key(name), "{name} has HELP");
        assert!(text.contains(&format!("# TYPE {name} ")), "{name} has TYPE");
    }
    // README describes each metric.
    let readme = std::fs::read_to_string(leasehold_tests::repo_root().join("README.md")).unwrap();
    for name in m.docs.keys() {
        assert!(readme.contains(name.as_str()), "README describes {name}");
    }
    drop(server);
}

/// 25 keys with queues of 1..=25 waiters: `leasehold_queue_length` has a series for the 20
/// longest only; the totals count all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queue_length_series_are_bounded() {
    let target = Target::embedded();
    let db = std::path::PathBuf::from(&target.args[1]);
    let store = leasehold::store::SqliteStore::open(&db).unwrap();
    let c = Coordinator::new(Arc::new(store), test_config()).with_deliver(Arc::new(Nobody) as Arc<dyn Deliver>);
    let d = Duration::from_secs(60);
    for k in 1..=25u32 {
        let key = format!("q/{k:02}");
        c.acquire(&key, "holder", Some(d), AcquireOptions::default()).await.unwrap();
        for w in 0..k {
            let token = format!("tok-{k}-{w}");
            let q = c.acquire_or_enqueue(&key, "waiter", d, AcquireOptions::default(), &token, None).await.unwrap();
            assert!(matches!(q, Enqueued::Queued { .. }), "{q:?}");
        }
    }
    let server = Server::start(&target.args, &[]);
    let a = server.addr.clone();
    let (m, text) = tokio::task::spawn_blocking(move || scrape(&a)).await.unwrap();
    let series: Vec<&Sample> = m.samples.iter().filter(|s| s.metric == "leasehold_queue_length").collect();
    // QUEUE_SERIES in cli/src/metrics.rs.
    assert_eq!(series.len(), 20, "{text}");
    let mut keys: Vec<&str> = series.iter().map(|s| s.labels.get("key").unwrap()).collect();
    keys.sort();
    let want: Vec<String> = (6..=25).map(|k| format!("q/{k:02}")).collect();
    assert_eq!(keys, want.iter().map(String::as_str).collect::<Vec<_>>(), "the longest queues");
    assert_eq!(num(&m, "leasehold_queue_length", &[("key", "q/25")]), 25.0);
    assert_eq!(num(&m, "leasehold_queued_keys", &[]), 25.0);
    assert_eq!(num(&m, "leasehold_queued_waiters", &[]), (1..=25).sum::<u32>() as f64);
    drop(server);
}

/// `serve --table`'s page, `/summary` and `/metrics` read the table through one snapshot: one
/// eventually consistent Scan for many views within `--scan-every`; the server's own acquire
/// and release show at once (applied to the snapshot), another writer's only at the next scan.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn serve_table_scans_once_per_scan_every() {
    let (proxy, table, conf) = leasehold_tests::proxied_table().await;
    proxy.record(true);
    let mut env = cli_support::dynamo_env(&proxy.endpoint());
    env.push(("LEASEHOLD_SKIP_TABLE_CHECK".into(), "1".into()));
    env.push(("LEASEHOLD_SCAN_EVERY".into(), "600s".into()));
    let args = vec!["--table".to_string(), table.clone()];
    let server = tokio::task::spawn_blocking(move || Server::start(&args, &env)).await.unwrap();
    let a = server.addr.clone();
    let scans = || proxy.events().iter().filter(|e| e.target == "Scan").count();
    let summary = |a: &str| {
        let (s, _, b) = http(a, "GET", "/summary?prefix=s/", &[], b"");
        assert_eq!(s, 200, "{b}");
        serde_json::from_str::<Value>(&b).unwrap()
    };
    let listed = |v: &Value| -> Vec<String> {
        v["leases"].as_array().unwrap().iter().map(|l| l["key"].as_str().unwrap().to_string()).collect()
    };
    let a2 = a.clone();
    let (lease, first) = tokio::task::spawn_blocking(move || {
        let (s, l) = post(&a2, "/leases/acquire/s/mine", r#"{"holder":"h","duration_ms":30000}"#);
        assert_eq!(s, 200, "{l}");
        (l, summary(&a2))
    })
    .await
    .unwrap();
    assert_eq!(listed(&first), vec!["s/mine"], "{first}");
    assert_eq!(scans(), 1);
    // Another writer on the same table: not seen until the next scan.
    let other = Coordinator::new(
        Arc::new(leasehold::store::DynamoStore::new(aws_sdk_dynamodb::Client::new(&conf), table.clone())),
        test_config(),
    );
    other.acquire("s/theirs", "them", Some(Duration::from_secs(30)), AcquireOptions::default()).await.unwrap();
    let a3 = a.clone();
    let views = tokio::task::spawn_blocking(move || {
        let mut out = Vec::new();
        for _ in 0..20 {
            out.push(summary(&a3));
        }
        let (_, text) = scrape(&a3);
        let rel = serde_json::json!({"lease_id": lease["lease_id"]}).to_string();
        assert_eq!(post(&a3, "/leases/release/s/mine", &rel).0, 200);
        out.push(summary(&a3));
        (out, text)
    })
    .await
    .unwrap();
    let (out, text) = views;
    assert_eq!(scans(), 1, "21 summaries and a scrape, one scan");
    assert!(out[..20].iter().all(|v| listed(v) == vec!["s/mine"]), "{:?}", out[0]);
    assert!(listed(&out[20]).is_empty(), "the server's own release shows at once: {}", out[20]);
    assert!(text.contains("leasehold_scrapes_total 1"), "{text}");
    let consistent: Vec<String> = proxy
        .events()
        .iter()
        .filter(|e| e.target == "Scan")
        .map(|e| e.request.clone())
        .filter(|r| r.contains("\"ConsistentRead\":true"))
        .collect();
    assert!(consistent.is_empty(), "eventually consistent scans: {consistent:?}");
    drop(server);
}
