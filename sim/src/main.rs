//! `leasehold-sim`: runs seeds of the deterministic simulation and reports what it injected
//! and found. `--seeds N` (seeds 1..=N), `--seed S` (one, to replay), `--ops` per seed,
//! `--coordinators`, `--fault-rate`, `--trace-hash` (print the run's history hash last).

use std::collections::BTreeMap;

use leasehold_sim::{run, Outcome, Settings};

/// The command line.
struct Args {
    seeds: u64,
    one: Option<u64>,
    ops: u64,
    coords: usize,
    rate: f64,
    trace: bool,
    /// Show the known findings too.
    verbose: bool,
    /// Stop at the first seed with a violation (how many seeds it takes to find a bug).
    first: bool,
}

/// What the seeds run so far add up to.
#[derive(Default)]
struct Totals {
    operations: u64,
    violations: u64,
    faults: BTreeMap<&'static str, u64>,
    findings: BTreeMap<&'static str, u64>,
    granted: BTreeMap<&'static str, u64>,
    last_hash: u64,
}

fn main() {
    let a = parse_args();
    let list: Vec<u64> = match a.one {
        Some(s) => vec![s],
        None => (1..=a.seeds).collect(),
    };
    let started = std::time::Instant::now();
    let mut t = Totals::default();
    let mut ran = None;
    for (i, seed) in list.iter().enumerate() {
        let s = Settings { ops: a.ops, coordinators: a.coords, fault_rate: a.rate, ..Settings::new(*seed) };
        let out = run(&s);
        add(&a, &mut t, *seed, &out);
        if a.first && t.violations > 0 {
            ran = Some(i + 1);
            break;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    report(&t, ran.unwrap_or(list.len()), seconds);
    if a.trace && a.one.is_some() {
        println!("{:016x}", t.last_hash);
    }
    if t.violations > 0 {
        std::process::exit(1);
    }
}

fn parse_args() -> Args {
    let mut args = std::env::args().skip(1);
    let mut a =
        Args { seeds: 200, one: None, ops: 5000, coords: 3, rate: 0.02, trace: false, verbose: false, first: false };
    while let Some(arg) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| usage(&format!("{arg} needs a value")));
        match arg.as_str() {
            "--seeds" => a.seeds = val().parse().unwrap_or_else(|_| usage("--seeds N")),
            "--seed" => a.one = Some(val().parse().unwrap_or_else(|_| usage("--seed S"))),
            "--ops" => a.ops = val().parse().unwrap_or_else(|_| usage("--ops N")),
            "--coordinators" => a.coords = val().parse().unwrap_or_else(|_| usage("--coordinators N")),
            "--fault-rate" => a.rate = val().parse().unwrap_or_else(|_| usage("--fault-rate P")),
            "--trace-hash" => a.trace = true,
            "--findings" => a.verbose = true,
            "--first" => a.first = true,
            "-h" | "--help" => usage(""),
            other => usage(&format!("unknown argument {other}")),
        }
    }
    a
}

/// Adds one seed's outcome to the totals, printing its violations (and known findings when
/// asked) with their histories.
fn add(a: &Args, t: &mut Totals, seed: u64, out: &Outcome) {
    t.operations += out.operations;
    for (k, v) in &out.faults {
        *t.faults.entry(k).or_default() += v;
    }
    t.last_hash = out.trace_hash;
    for (k, v) in &out.granted {
        *t.granted.entry(k).or_default() += v;
    }
    for (k, v) in &out.findings {
        *t.findings.entry(k).or_default() += v;
    }
    for v in &out.violations {
        if v.known {
            if a.verbose {
                println!("known finding, seed {seed}: {} on {:?}: {}", v.kind, v.key, v.message);
                for line in &v.history {
                    println!("    {line}");
                }
            }
            continue;
        }
        t.violations += 1;
        println!("VIOLATION seed {seed}: {} on {:?}: {}", v.kind, v.key, v.message);
        for line in &v.history {
            println!("    {line}");
        }
        println!(
            "    replay: cargo run --release -p leasehold-sim -- --seed {seed} --ops {} --coordinators {} --fault-rate {}",
            a.ops, a.coords, a.rate
        );
    }
}

/// The summary: counts, the faults injected, the known findings, and the same as JSON.
fn report(t: &Totals, ran: usize, seconds: f64) {
    println!("seeds {ran}  operations {}  violations {}  seconds {seconds:.1}", t.operations, t.violations);
    println!("faults injected:");
    for (k, v) in &t.faults {
        println!("  {k:<26} {v}");
    }
    println!("leases granted, by the shape of the acquire:");
    for (k, v) in &t.granted {
        println!("  {k:<26} {v}");
    }
    if !t.findings.is_empty() {
        println!("known findings (sim/README.md; --findings shows them):");
        for (k, v) in &t.findings {
            println!("  {k:<26} {v}");
        }
    }
    let summary = serde_json::json!({
        "seeds": ran,
        "operations": t.operations,
        "violations": t.violations,
        "faults": t.faults,
        "findings": t.findings,
        "granted": t.granted,
        "seconds": (seconds * 10.0).round() / 10.0,
    });
    println!("{summary}");
}

fn usage(msg: &str) -> ! {
    if !msg.is_empty() {
        eprintln!("{msg}");
    }
    eprintln!(
        "usage: leasehold-sim [--seeds N | --seed S [--trace-hash]] [--ops N] [--coordinators N] [--fault-rate P] [--findings] [--first]"
    );
    std::process::exit(2)
}
