//! The operator page of `leasehold serve` in a real browser: headless Chromium (Debian's
//! package, driven by playwright-core from tests/browser/page.test.mjs) loads the page of the
//! real binary on the embedded store while this test takes and releases leases through the
//! HTTP API. The script checks the rows, the countdown, the prefix filter, force-release
//! behind its confirmation and that no lease_id reaches the page; it leaves two screenshots in
//! target/artifacts/: operator-page-held.png (three held keys) and operator-page.png (after a
//! release and a force-release from the page).

mod cli_support;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cli_support::{http, Server, Target};
use leasehold_tests::{repo_root, tools_dir};
use serde_json::{json, Value};

fn acquire(addr: &str, key: &str, body: Value) -> Value {
    let (s, _, b) = http(addr, "POST", &format!("/leases/acquire/{key}"), &[], body.to_string().as_bytes());
    assert_eq!(s, 200, "acquire {key}: {b}");
    serde_json::from_str(&b).unwrap()
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

#[test]
fn the_operator_page_shows_the_leases_live_in_chromium() {
    let browser_tools = tools_dir().join("browser");
    assert!(
        browser_tools.join("node_modules/playwright-core").is_dir()
            && std::path::Path::new("/usr/bin/chromium").exists(),
        "chromium or playwright-core is missing: run scripts/install-test-deps.sh"
    );
    let store = Target::embedded();
    let server = Server::start(&store.args, &[]);
    let a = &server.addr;

    let mut secrets = Vec::new();
    let mut take = |key: &str, body: Value| {
        let lease = acquire(a, key, body);
        secrets.push(lease["lease_id"].as_str().expect("a lease_id").to_string());
        lease
    };
    let job_a = take("jobs/a", json!({"holder": "worker-1", "duration_ms": 60_000}));
    let job_b =
        take("jobs/b", json!({"holder": "worker-2", "fail_closed": true, "lease_id": "browser-test-fail-closed-b"}));
    take(
        "reports/x",
        json!({
            "holder": "worker-3",
            "duration_ms": 300_000,
            "min_hold_ms": 120_000,
            "keepalive": {"until_ms": now_ms() + 3_600_000}
        }),
    );

    let artifacts = repo_root().join("target/artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    let shot = artifacts.join("operator-page.png");
    let _ = std::fs::remove_file(&shot);
    let _ = std::fs::remove_file(artifacts.join("operator-page-held.png"));
    let mut node = Command::new("node")
        .arg(repo_root().join("tests/browser/page.test.mjs"))
        .arg(format!("{}/", server.url))
        .arg(&shot)
        .env("LEASEHOLD_BROWSER_TOOLS", &browser_tools)
        .env("LEASEHOLD_SECRETS", secrets.join("\n"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("node");
    let mut to_node = node.stdin.take().unwrap();
    let from_node = BufReader::new(node.stdout.take().unwrap());
    let started = Instant::now();
    let (mut checks, mut result, mut failed) = (Vec::new(), None, None);
    for line in from_node.lines() {
        let line = line.expect("node output");
        println!("page.test.mjs: {line}");
        assert!(started.elapsed() < Duration::from_secs(120), "the browser script runs too long");
        if let Some(step) = line.strip_prefix("STEP ") {
            assert_eq!(step, "release jobs/a, acquire jobs/c");
            let body = json!({"lease_id": job_a["lease_id"]}).to_string();
            let (s, _, b) = http(a, "POST", "/leases/release/jobs/a", &[], body.as_bytes());
            assert_eq!(s, 200, "release jobs/a: {b}");
            acquire(a, "jobs/c", json!({"holder": "worker-4", "duration_ms": 45_000}));
            writeln!(to_node, "done").unwrap();
        } else if let Some(c) = line.strip_prefix("ok ") {
            checks.push(c.to_string());
        } else if let Some(r) = line.strip_prefix("RESULT ") {
            result = Some(serde_json::from_str::<Value>(r).unwrap());
        } else if line.starts_with("FAILED ") {
            failed = Some(line);
        }
    }
    let status = node.wait().unwrap();
    assert!(failed.is_none() && status.success(), "the browser checks failed: {failed:?} (passed: {checks:#?})");
    assert!(checks.len() >= 15, "{checks:#?}");
    let held = artifacts.join("operator-page-held.png");
    for s in [&held, &shot] {
        assert!(s.is_file(), "no screenshot at {}", s.display());
        println!("screenshot: {}", s.display());
    }

    // What the page reported is what the store holds: jobs/b free, with the fence the page showed.
    let result = result.expect("a RESULT line");
    let (s, _, b) = http(a, "GET", "/leases/jobs/b", &[], b"");
    assert_eq!(s, 200);
    let state: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(state["held"], false);
    assert_eq!(state["fence"].to_string(), result["fence"].as_str().unwrap());
    assert!(state["fence"].as_u64() > job_b["fence"].as_u64());
}

/// The page shows the whole product: keys per work state (and how many are held), the queue
/// length beside a holder, the recent events of the keys shown, a key's timeline when it is
/// clicked, and a semaphore as one: its slots taken of N, each holder with its fence and time
/// left, its holders' timeline, and one holder force-released from its row
/// (tests/browser/ops.test.mjs). Screenshot: target/artifacts/operator-page-ops.png.
#[test]
fn the_operator_page_shows_states_queues_and_timelines_in_chromium() {
    use std::sync::Arc;
    let browser_tools = tools_dir().join("browser");
    assert!(
        browser_tools.join("node_modules/playwright-core").is_dir()
            && std::path::Path::new("/usr/bin/chromium").exists(),
        "chromium or playwright-core is missing: run scripts/install-test-deps.sh"
    );
    let store = Target::embedded();
    let server = Server::start(&store.args, &[]);
    let a = &server.addr;
    let post = |path: &str, body: Value| {
        let (s, _, b) = http(a, "POST", path, &[("content-type", "application/json")], body.to_string().as_bytes());
        assert_eq!(s, 200, "{path}: {b}");
        serde_json::from_str::<Value>(&b).unwrap()
    };
    // Work items: three in PENDING (one of them taken), one moved on to DONE.
    for k in ["orders/1", "orders/2", "orders/3", "orders/4"] {
        post(&format!("/leases/put/{k}"), json!({"state": "PENDING", "holder": "producer"}));
    }
    let next = post("/leases/next/PENDING", json!({"holder": "w", "limit": 2, "duration_ms": 300_000}));
    let first = &next["leases"][0];
    post(
        &format!("/leases/release/{}", first["key"].as_str().unwrap()),
        json!({"lease_id": first["lease_id"], "state": "DONE"}),
    );
    // A key with history: granted, then renewed.
    let t = post("/leases/acquire/jobs/t", json!({"holder": "worker-t", "duration_ms": 120_000}));
    post("/leases/heartbeat/jobs/t", json!({"lease_id": t["lease_id"], "duration_ms": 300_000}));
    // A key no longer shown: its events stay off the page.
    let g = post("/leases/acquire/gone/key", json!({"holder": "x", "duration_ms": 60_000}));
    post("/leases/release/gone/key", json!({"lease_id": g["lease_id"]}));
    // A held key with two queued waiters (written by another process on the same file).
    post("/leases/acquire/jobs/q", json!({"holder": "holder-q", "duration_ms": 300_000}));
    struct Nobody;
    #[async_trait::async_trait]
    impl leasehold::queue::Deliver for Nobody {
        async fn success(&self, _: &str, _: &leasehold::Lease) -> Result<(), leasehold::queue::DeliveryError> {
            Ok(())
        }
        async fn failure(&self, _: &str, _: &str, _: &str) -> Result<(), leasehold::queue::DeliveryError> {
            Ok(())
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let s = leasehold::store::SqliteStore::open(&store.args[1]).unwrap();
        let c = leasehold::Coordinator::new(Arc::new(s), leasehold_tests::test_config())
            .with_deliver(Arc::new(Nobody) as Arc<dyn leasehold::queue::Deliver>);
        for tok in ["tok-1", "tok-2"] {
            let o = leasehold::AcquireOptions::default();
            c.acquire_or_enqueue("jobs/q", "waiter", Duration::from_secs(60), o, tok, None).await.unwrap();
        }
    });
    let fence = t["fence"].as_u64().unwrap().to_string();
    // A semaphore of 4 slots with 3 holders.
    let pool: Vec<(String, String)> = ["s1", "s2", "s3"]
        .iter()
        .map(|h| {
            let l = post("/leases/acquire/pool/x", json!({"holder": h, "duration_ms": 120_000, "slots": 4}));
            (h.to_string(), l["fence"].as_u64().unwrap().to_string())
        })
        .collect();
    let expect = json!({"timeline": [["granted", fence], ["renewed", fence]], "pool": pool});

    let artifacts = repo_root().join("target/artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    let shot = artifacts.join("operator-page-ops.png");
    let _ = std::fs::remove_file(&shot);
    let out = Command::new("node")
        .arg(repo_root().join("tests/browser/ops.test.mjs"))
        .arg(format!("{}/", server.url))
        .arg(&shot)
        .env("LEASEHOLD_BROWSER_TOOLS", &browser_tools)
        .env("LEASEHOLD_EXPECT", expect.to_string())
        .stdin(Stdio::null())
        .output()
        .expect("node");
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && !text.contains("FAILED"), "the browser checks failed:\n{text}");
    assert!(text.lines().filter(|l| l.starts_with("ok ")).count() >= 8, "{text}");
    assert!(shot.is_file(), "no screenshot at {}", shot.display());
    println!("screenshot: {}", shot.display());
}
