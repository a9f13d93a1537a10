//! M1 uncontended: one worker, acquire + release of distinct keys, in interleaved rounds (a
//! different library starts each round), after unmeasured warm-up cycles.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use leasehold_tests::proxy::ProxyFault;

use serde_json::{json, Value};

use crate::harness::{
    cpu_ms, cpu_runs, libraries, note_rss, pct, peak_rss_kb, run_child, scenario_run, ChildArgs, Params, Rss, Setup,
};
use crate::libs::Lib;

/// M1 figures of one library, summed over its rounds.
#[derive(Default)]
struct M1Acc {
    secs: f64,
    cycles: usize,
    p50: Vec<f64>,
    p99: Vec<f64>,
    requests: u64,
    cpu_ms: f64,
    runs: u64,
}

impl M1Acc {
    fn rate(&self) -> f64 {
        self.cycles as f64 / self.secs
    }

    /// Client CPU per cycle, in µs.
    fn cpu_us(&self) -> f64 {
        self.cpu_ms * 1000.0 / self.cycles as f64
    }
}

scenario_run!(child, report);

/// Child process: M1 for one library.
async fn child(a: &ChildArgs) -> Value {
    let (lib, endpoint, table, n, tag) = (a.lib.as_str(), a.endpoint.as_str(), a.table.as_str(), a.n, a.tag.as_str());
    let l = Lib::new(lib, endpoint, table).await;
    let mut lat = Vec::with_capacity(n);
    let (mut acq, mut rel) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let (cpu0, runs0) = (cpu_ms(), cpu_runs());
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
    let (cpu, runs) = (cpu_ms() - cpu0, cpu_runs() - runs0);
    for v in [&mut lat, &mut acq, &mut rel] {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    }
    json!({"cycles": n, "secs": el, "p50": pct(&lat, 0.5), "p99": pct(&lat, 0.99),
               "acquire_p50": pct(&acq, 0.5), "release_p50": pct(&rel, 0.5), "cpu_ms": cpu, "runs": runs, "rss_kb": peak_rss_kb()})
}

async fn report(s: &Setup, p: &Params, rss: &mut Rss) {
    let libs = libraries();
    let Params { m1n, rounds, .. } = *p;
    // `LEASEHOLD_BENCH_RTT_MS=N`: the proxy holds every request N ms before forwarding it, for
    // every library alike (an in-region round trip instead of DynamoDB Local's sub-millisecond
    // answers): every request then parks the client's threads until its answer, in either
    // library, as it does against DynamoDB, so the client CPU no longer depends on how fast
    // the local server evaluates each library's requests.
    let rtt = std::env::var("LEASEHOLD_BENCH_RTT_MS").ok().and_then(|v| v.parse::<u64>().ok()).filter(|&ms| ms > 0);
    if let Some(ms) = rtt {
        s.proxy.random_faults(1000, &[ProxyFault::Delay(Duration::from_millis(ms))], 1);
    }
    let acc = measure(s, p, &libs, rss).await;
    s.proxy.clear_faults();
    print_table(&acc, &libs, m1n, rounds, rtt);
}

/// Interleaved rounds, after a warm-up: every library runs a slice of the cycles in turn. What
/// each library's rounds add up to.
async fn measure(s: &Setup, p: &Params, libs: &[&'static str], rss: &mut Rss) -> BTreeMap<&'static str, M1Acc> {
    let Params { m1n, rounds, warmup, .. } = *p;
    let mut acc: BTreeMap<&'static str, M1Acc> = BTreeMap::new();
    // Warm-up, not measured: DynamoDB Local's JIT compiles each request shape on first use,
    // which would otherwise be charged to whichever library runs first.
    for lib in libs {
        run_child(s, lib, "m1", warmup, 0, &format!("{lib}-warm")).await;
    }
    for r in 0..rounds {
        // A different library starts each round.
        let mut order = libs.to_vec();
        order.rotate_left(r % libs.len());
        for lib in &order {
            let (v, reqs) = run_child(s, lib, "m1", m1n / rounds, 0, &format!("{lib}-{r}")).await;
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
            e.runs += v["runs"].as_u64().unwrap_or(0);
            note_rss(rss, lib, &v);
        }
    }
    acc
}

/// The table of the libraries' figures, and leasehold's ratios to the floors and its peer.
fn print_table(
    acc: &BTreeMap<&'static str, M1Acc>,
    libs: &[&'static str],
    m1n: usize,
    rounds: usize,
    rtt: Option<u64>,
) {
    let floor = acc["raw"].rate();
    println!(
        "\nM1 uncontended: 1 worker, acquire+release of distinct keys, {m1n} cycles each, {rounds} interleaved rounds"
    );
    if let Some(ms) = rtt {
        println!("(every request held {ms} ms by the proxy: LEASEHOLD_BENCH_RTT_MS)");
    }
    println!(
        "(p50/p99: medians over the rounds; client CPU: the harness process's CPU time per cycle; \
         runs/cyc: times its threads were put on a CPU per cycle, i.e. woken)"
    );
    println!(
        "{:<22} {:>10} {:>9} {:>9} {:>13} {:>12} {:>9} {:>9}",
        "library", "cycles/s", "p50 ms", "p99 ms", "requests/cyc", "client CPU", "runs/cyc", "vs raw"
    );
    for lib in libs {
        let a = &acc[lib];
        let med = |v: &Vec<f64>| {
            let mut v = v.clone();
            v.sort_by(|a, b| a.partial_cmp(b).unwrap());
            pct(&v, 0.5)
        };
        println!(
            "{:<22} {:>10.0} {:>9.2} {:>9.2} {:>13.2} {:>10.0}µs {:>9.2} {:>8.2}x",
            lib,
            a.rate(),
            med(&a.p50),
            med(&a.p99),
            a.requests as f64 / a.cycles as f64,
            a.cpu_us(),
            a.runs as f64 / a.cycles as f64,
            a.rate() / floor
        );
    }
    // The target is leasehold's client CPU per cycle and its cycles/s against the bare
    // pair's; against raw-shaped, what leasehold's own code costs beyond its requests.
    for floor in ["raw", "raw-shaped"] {
        if let Some(f) = acc.get(floor) {
            let l = &acc["leasehold"];
            println!(
                "leasehold / {floor}: client CPU per cycle {:.3}x, cycles/s {:.3}x",
                l.cpu_us() / f.cpu_us(),
                l.rate() / f.rate()
            );
        }
    }
    if let Some(dl) = acc.get("dynamodb-lease") {
        println!("leasehold / dynamodb-lease: {:.2}x", acc["leasehold"].rate() / dl.rate());
    }
}
