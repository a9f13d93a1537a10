//! Load benchmark of `leasehold serve` on the embedded store.
//!
//! Starts the built `leasehold serve` on a fresh store file, then drives acquire + release
//! cycles over HTTP from N concurrent clients, each on its own keep-alive connection and its
//! own key, for a fixed duration (after a warm-up), and prints cycles/s, request and cycle
//! latency percentiles and the server's peak RSS (VmHWM).
//!
//!     cargo bench -p leasehold-cli --bench serve_load -- [--clients 16] [--secs 10] [--warmup 2]
//!         [--sync full|normal] [--bin PATH]
//!
//! `--sync` is how the server syncs its commits: `full` (the default, and the only setting the
//! product uses) or `normal` (for the comparison only: a power loss can lose answered writes;
//! set through the undocumented `LEASEHOLD_BENCH_SYNCHRONOUS`). `--bin` measures another
//! build of `leasehold` (e.g. an earlier one) with this bench.
//!
//! Target on 2 cores: >= 5,000 cycles/s, p99 < 5 ms, peak RSS <= 20 MB; `full` at least 0.8x
//! of `normal`'s cycles/s.

#[path = "../src/client.rs"]
#[allow(dead_code, unused_imports)]
mod client;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use client::Endpoint;

struct Opts {
    clients: usize,
    secs: u64,
    warmup: u64,
    /// `FULL` or `NORMAL`.
    sync: &'static str,
    bin: Option<String>,
}

fn opts() -> Opts {
    let mut o = Opts { clients: 16, secs: 10, warmup: 2, sync: "FULL", bin: None };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let val = || {
            args.get(i + 1).and_then(|v| v.parse::<u64>().ok()).unwrap_or_else(|| panic!("{} needs a number", args[i]))
        };
        match args[i].as_str() {
            "--clients" => o.clients = val() as usize,
            "--secs" => o.secs = val(),
            "--warmup" => o.warmup = val(),
            "--sync" => {
                o.sync = match args.get(i + 1).map(|s| s.to_ascii_lowercase()).as_deref() {
                    Some("full") => "FULL",
                    Some("normal") => "NORMAL",
                    _ => panic!("--sync takes full or normal"),
                }
            }
            "--bin" => o.bin = Some(args.get(i + 1).expect("--bin needs a path").clone()),
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    o
}

#[derive(Default)]
struct Stats {
    cycles: u64,
    errors: u64,
    request_us: Vec<u32>,
    cycle_us: Vec<u32>,
}

fn vm_hwm_kb(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()
}

fn pct(v: &mut [u32], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_unstable();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i] as f64 / 1000.0
}

fn main() {
    let o = opts();
    let bin = o.bin.clone().unwrap_or_else(|| env!("CARGO_BIN_EXE_leasehold").to_string());
    let dir = std::env::temp_dir().join(format!("leasehold-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut server = Command::new(&bin)
        .args(["serve", "--addr", "127.0.0.1:0", "--db"])
        .arg(dir.join("leases.db"))
        .env_remove("LEASEHOLD_URL")
        .env_remove("LEASEHOLD_TABLE")
        .env("LEASEHOLD_BENCH_SYNCHRONOUS", o.sync)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .expect("start leasehold serve");
    let mut line = String::new();
    BufReader::new(server.stdout.take().expect("stdout")).read_line(&mut line).expect("banner");
    let url = line.split_whitespace().find(|w| w.starts_with("http://")).expect("URL in banner").to_string();
    let endpoint = Endpoint::parse(&url).expect("endpoint");

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for c in 0..o.clients {
        let (endpoint, measuring, stop) = (endpoint.clone(), measuring.clone(), stop.clone());
        tasks.push(rt.spawn(async move {
            let mut conn = endpoint.connect().await.expect("connect");
            let key = format!("bench%2Fclient-{c}");
            let acquire = format!("/leases/acquire/{key}");
            let release = format!("/leases/release/{key}");
            let body = br#"{"holder":"bench","duration_ms":30000}"#.to_vec();
            let mut st = Stats::default();
            while !stop.load(Ordering::Relaxed) {
                let t0 = Instant::now();
                let (s, b) = conn.request("POST", &acquire, Some(body.clone())).await.expect("acquire");
                let t1 = Instant::now();
                if s != 200 {
                    st.errors += 1;
                    continue;
                }
                let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
                let rel = format!(r#"{{"lease_id":"{}"}}"#, v["lease_id"].as_str().expect("lease_id"));
                let (s, _) = conn.request("POST", &release, Some(rel.into_bytes())).await.expect("release");
                let t2 = Instant::now();
                if s != 200 {
                    st.errors += 1;
                    continue;
                }
                if measuring.load(Ordering::Relaxed) {
                    st.cycles += 1;
                    st.request_us.push((t1 - t0).as_micros() as u32);
                    st.request_us.push((t2 - t1).as_micros() as u32);
                    st.cycle_us.push((t2 - t0).as_micros() as u32);
                }
            }
            st
        }));
    }
    std::thread::sleep(Duration::from_secs(o.warmup));
    measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs(o.secs));
    measuring.store(false, Ordering::Relaxed);
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let mut all = Stats::default();
    for t in tasks {
        let s = rt.block_on(t).expect("client task");
        all.cycles += s.cycles;
        all.errors += s.errors;
        all.request_us.extend(s.request_us);
        all.cycle_us.extend(s.cycle_us);
    }
    let hwm = vm_hwm_kb(server.id());
    let _ = Command::new("kill").arg("-TERM").arg(server.id().to_string()).status();
    let status = server.wait().expect("server exit");
    let _ = std::fs::remove_dir_all(&dir);

    let rate = all.cycles as f64 / elapsed.as_secs_f64();
    println!(
        "leasehold serve: {} clients x keep-alive, acquire+release on the embedded store, {:.1}s measured",
        o.clients,
        elapsed.as_secs_f64()
    );
    println!("{:<24} {:>12}", "metric", "value");
    println!("{:<24} {:>12}", "synchronous", o.sync);
    println!("{:<24} {:>12.0}", "cycles/s", rate);
    println!("{:<24} {:>12.0}", "requests/s", rate * 2.0);
    println!("{:<24} {:>12.3}", "request p50 (ms)", pct(&mut all.request_us, 0.50));
    println!("{:<24} {:>12.3}", "request p99 (ms)", pct(&mut all.request_us, 0.99));
    println!("{:<24} {:>12.3}", "cycle p50 (ms)", pct(&mut all.cycle_us, 0.50));
    println!("{:<24} {:>12.3}", "cycle p99 (ms)", pct(&mut all.cycle_us, 0.99));
    println!("{:<24} {:>12}", "errors", all.errors);
    match hwm {
        Some(kb) => println!("{:<24} {:>12.1}", "server peak RSS (MB)", kb as f64 / 1024.0),
        None => println!("{:<24} {:>12}", "server peak RSS (MB)", "n/a"),
    }
    println!(
        "{:<24} {:>12}",
        "server exit on SIGTERM",
        status.code().map(|c| c.to_string()).unwrap_or("signal".into())
    );
}
