//! M2 parallel: 16 workers on distinct keys, in interleaved rounds (a different library starts
//! each round), after unmeasured warm-up cycles; with the CPU each cycle cost the client, the
//! proxy and DynamoDB Local.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};

use crate::harness::{
    cpu_ms, cpu_runs, libraries, note_rss, peak_rss_kb, run_child, scenario_run, ChildArgs, Params, Rss, Setup,
};
use crate::libs::Lib;

scenario_run!(child, report);

/// Child process: M2 for one library.
async fn child(a: &ChildArgs) -> Value {
    let (lib, endpoint, table, n, tag) = (a.lib.as_str(), a.endpoint.as_str(), a.table.as_str(), a.n, a.tag.as_str());
    let l = Arc::new(Lib::new(lib, endpoint, table).await);
    let next = Arc::new(AtomicU64::new(0));
    let (cpu0, runs0) = (cpu_ms(), cpu_runs());
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
    let secs = t.elapsed().as_secs_f64();
    let (cpu, runs) = (cpu_ms() - cpu0, cpu_runs() - runs0);
    json!({"cycles": n, "secs": secs, "cpu_ms": cpu, "runs": runs, "rss_kb": peak_rss_kb()})
}

/// M2 figures of one library, summed over its rounds.
#[derive(Default)]
struct M2Acc {
    secs: f64,
    cycles: usize,
    requests: u64,
    /// CPU time of the child (the library's client), the parent (the proxy) and DynamoDB Local.
    client_ms: f64,
    proxy_ms: f64,
    server_ms: f64,
    runs: u64,
    /// Each round's cycles/s.
    rates: Vec<f64>,
}

impl M2Acc {
    fn rate(&self) -> f64 {
        self.cycles as f64 / self.secs
    }

    /// CPU per cycle, in µs.
    fn per_cycle(&self, ms: f64) -> f64 {
        ms * 1000.0 / self.cycles as f64
    }
}

async fn report(s: &Setup, p: &Params, rss: &mut Rss) {
    let libs = libraries();
    let Params { m2n, rounds, warmup, .. } = *p;
    // Warm-up, not measured: DynamoDB Local's JIT compiles each request shape on first use
    // (and, run alone, M2 follows no M1 warm-up), which would be charged to whichever library
    // runs first.
    for lib in &libs {
        run_child(s, lib, "m2", warmup.max(300), 0, &format!("{lib}-m2warm")).await;
    }
    let mut acc: BTreeMap<&str, M2Acc> = BTreeMap::new();
    let per_round = (m2n / rounds).max(16);
    for r in 0..rounds {
        let mut order = libs.clone();
        order.rotate_left(r % libs.len());
        for lib in &order {
            let (server0, proxy0) = (s.server_cpu_ms(), s.proxy_cpu_ms());
            let (v, reqs) = run_child(s, lib, "m2", per_round, 0, &format!("{lib}-m2-{r}")).await;
            let (server, proxy) = (s.server_cpu_ms() - server0, s.proxy_cpu_ms() - proxy0);
            if std::env::var_os("LEASEHOLD_BENCH_VERBOSE").is_some() {
                eprintln!("m2 {lib} round {r}: {v}");
            }
            let e = acc.entry(lib).or_default();
            let secs = v["secs"].as_f64().unwrap();
            e.secs += secs;
            e.cycles += per_round;
            e.rates.push(per_round as f64 / secs);
            e.requests += reqs;
            e.client_ms += v["cpu_ms"].as_f64().unwrap_or(f64::NAN);
            e.runs += v["runs"].as_u64().unwrap_or(0);
            e.server_ms += server;
            e.proxy_ms += proxy;
            note_rss(rss, lib, &v);
        }
    }
    println!(
        "\nM2 parallel: 16 workers on distinct keys, {} cycles each, {rounds} interleaved rounds",
        per_round * rounds
    );
    println!(
        "(CPU per cycle: the library's process (client), the bench's (the proxy, run in it) and DynamoDB Local's \
         (server), while the library's child ran; runs/cyc: times the client's threads were put on a CPU)"
    );
    println!(
        "{:<22} {:>10} {:>22} {:>13} {:>11} {:>10} {:>11} {:>9} {:>8}",
        "library", "cycles/s", "rounds", "requests/cyc", "client CPU", "proxy CPU", "server CPU", "runs/cyc", "vs raw"
    );
    let floor = acc["raw"].rate();
    for lib in &libs {
        let a = &acc[lib];
        let rounds: Vec<String> = a.rates.iter().map(|r| format!("{r:.0}")).collect();
        println!(
            "{:<22} {:>10.0} {:>22} {:>13.2} {:>9.0}µs {:>8.0}µs {:>9.0}µs {:>9.2} {:>7.2}x",
            lib,
            a.rate(),
            rounds.join("/"),
            a.requests as f64 / a.cycles as f64,
            a.per_cycle(a.client_ms),
            a.per_cycle(a.proxy_ms),
            a.per_cycle(a.server_ms),
            a.runs as f64 / a.cycles as f64,
            a.rate() / floor
        );
    }
    if let Some(dl) = acc.get("dynamodb-lease") {
        println!("leasehold / dynamodb-lease: {:.2}x", acc["leasehold"].rate() / dl.rate());
    }
}
