//! `serve-m3`: M3's shape (8 workers on ONE key, 5 ms holds, each acquire waiting) over HTTP
//! through `leasehold serve` on the embedded store, where waiting acquires are woken in
//! process by the release that frees the key (DESIGN.md, "In-process waiters").
//!
//! Needs the `leasehold` binary beside this one (`cargo build --release -p leasehold-cli
//! -p leasehold-bench`). Prints acquisitions, turns per worker (max/min), hand-over p50/p99
//! (the next grant's `acquired_at_ms` minus the release's `released_at_ms`, both the server's
//! clock) and the ceiling: the run's length over (one 5 ms hold as it really sleeps + one HTTP
//! round trip to the server), the same bound as M3's.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold_tests::http;
use serde_json::Value;

use crate::harness::{pct, scenario_run, Params, Rss, Setup};

const WORKERS: usize = 8;
const HOLD: Duration = Duration::from_millis(5);

scenario_run!(parent_only report);

/// Runs as long as M3 does (`Params::m3s`); no child processes, no DynamoDB Local.
async fn report(_: &Setup, params: &Params, _: &mut Rss) {
    let secs = params.m3s;
    let exe = std::env::current_exe().expect("exe").parent().expect("dir").join("leasehold");
    assert!(exe.exists(), "{} is missing: cargo build --release -p leasehold-cli", exe.display());
    let dir = std::env::temp_dir().join(format!("leasehold-serve-m3-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let (mut server, url) = start_server(&exe, &dir);

    let key = "bench/serve-m3";
    let stop = Arc::new(AtomicBool::new(false));
    // (fence, acquired_at_ms, released_at_ms) of every grant.
    let grants = Arc::new(Mutex::new(Vec::new()));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        let (url, stop, grants) = (url.clone(), stop.clone(), grants.clone());
        tasks.push(tokio::spawn(async move { worker(&url, key, w, &stop, &grants).await }));
    }
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let mut per = Vec::new();
    for t in tasks {
        per.push(t.await.expect("worker"));
    }
    let elapsed = started.elapsed().as_secs_f64();
    let mut g = grants.lock().unwrap().clone();
    g.sort();
    let mut hand: Vec<f64> = g.windows(2).map(|w| w[1].1 as f64 - w[0].2 as f64).collect();
    let overlaps = hand.iter().filter(|h| **h < 0.0).count();
    hand.sort_by(|a, b| a.partial_cmp(b).unwrap());

    let (hold, rtt) = hold_and_round_trip(&url, key).await;
    let ceiling = elapsed * 1000.0 / (hold + rtt);
    let acq: u64 = per.iter().sum();
    let (mx, mn) = (*per.iter().max().unwrap(), *per.iter().min().unwrap());
    println!("\nserve-M3: {WORKERS} HTTP clients on ONE key through `leasehold serve` (embedded store), hold 5 ms, waiting acquires woken in process");
    println!(
        "acquisitions {acq} in {elapsed:.1} s; per worker {mn}..{mx} (max/min {:.2}); hand-over p50 {:.1} ms, p99 {:.1} ms; overlaps {overlaps}",
        mx as f64 / mn.max(1) as f64,
        pct(&hand, 0.5),
        pct(&hand, 0.99)
    );
    println!(
        "ceiling: {elapsed:.1} s / (hold {hold:.2} ms + one HTTP round trip {rtt:.2} ms) = {ceiling:.0} acquisitions; reached {:.2}x",
        acq as f64 / ceiling
    );
    let _ = server.kill();
    let _ = server.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

/// `leasehold serve` on an embedded store in `dir`, on a free port: the process and its URL
/// (read from its banner).
fn start_server(exe: &std::path::Path, dir: &std::path::Path) -> (std::process::Child, String) {
    let mut server = Command::new(exe)
        .args(["serve", "--addr", "127.0.0.1:0", "--db"])
        .arg(dir.join("leases.db"))
        .env_remove("LEASEHOLD_URL")
        .env_remove("LEASEHOLD_TABLE")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .expect("start leasehold serve");
    let mut line = String::new();
    BufReader::new(server.stdout.take().expect("stdout")).read_line(&mut line).expect("banner");
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .expect("URL in banner")
        .trim_end_matches('/')
        .to_string();
    (server, url)
}

/// Worker `w`: acquires `key` (waiting), holds it 5 ms and releases it, until `stop`; records
/// each grant's (fence, acquired_at_ms, released_at_ms) in `grants`. Its turns.
async fn worker(url: &str, key: &str, w: usize, stop: &AtomicBool, grants: &Mutex<Vec<(u64, u64, u64)>>) -> u64 {
    let acquire = format!("{url}/leases/acquire/{key}");
    let release = format!("{url}/leases/release/{key}");
    let body = format!(r#"{{"holder":"w{w}","duration_ms":10000,"wait_ms":10000}}"#);
    let mut turns = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let r = http::request("POST", &acquire, Some(body.as_bytes())).await.expect("acquire");
        if r.status != 200 {
            continue;
        }
        let lease: Value = r.json();
        tokio::time::sleep(HOLD).await;
        let rel = format!(r#"{{"lease_id":"{}"}}"#, lease["lease_id"].as_str().expect("lease_id"));
        let r = http::request("POST", &release, Some(rel.as_bytes())).await.expect("release");
        assert_eq!(r.status, 200, "release: {}", r.text());
        let released: Value = r.json();
        grants.lock().unwrap().push((
            lease["fence"].as_u64().unwrap(),
            lease["acquired_at_ms"].as_u64().unwrap(),
            released["released_at_ms"].as_u64().unwrap(),
        ));
        turns += 1;
    }
    turns
}

/// The ceiling's parts, medians of 200 in ms: a 5 ms hold as it really sleeps, and one HTTP
/// round trip to the server.
async fn hold_and_round_trip(url: &str, key: &str) -> (f64, f64) {
    let (mut holds, mut rtts) = (Vec::new(), Vec::new());
    for _ in 0..200 {
        let t = Instant::now();
        tokio::time::sleep(HOLD).await;
        holds.push(t.elapsed().as_secs_f64() * 1000.0);
        let t = Instant::now();
        http::request("GET", &format!("{url}/leases/{key}"), None).await.expect("get");
        rtts.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    for v in [&mut holds, &mut rtts] {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    }
    (pct(&holds, 0.5), pct(&rtts, 0.5))
}
