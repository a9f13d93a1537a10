//! `leasehold-sim`: runs seeds of the deterministic simulation and reports what it injected
//! and found. `--seeds N` (seeds 1..=N), `--seed S` (one, to replay), `--ops` per seed,
//! `--coordinators`, `--fault-rate`, `--trace-hash` (print the run's history hash last).

use std::collections::BTreeMap;

use leasehold_sim::{run, Settings};

fn main() {
    let mut args = std::env::args().skip(1);
    let mut verbose = false;
    // Stop at the first seed with a violation (how many seeds it takes to find a bug).
    let mut first = false;
    let (mut seeds, mut one, mut ops, mut coords, mut rate, mut trace) =
        (200u64, None, 5000u64, 3usize, 0.02f64, false);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| usage(&format!("{a} needs a value")));
        match a.as_str() {
            "--seeds" => seeds = val().parse().unwrap_or_else(|_| usage("--seeds N")),
            "--seed" => one = Some(val().parse().unwrap_or_else(|_| usage("--seed S"))),
            "--ops" => ops = val().parse().unwrap_or_else(|_| usage("--ops N")),
            "--coordinators" => coords = val().parse().unwrap_or_else(|_| usage("--coordinators N")),
            "--fault-rate" => rate = val().parse().unwrap_or_else(|_| usage("--fault-rate P")),
            "--trace-hash" => trace = true,
            "--findings" => verbose = true,
            "--first" => first = true,
            "-h" | "--help" => usage(""),
            other => usage(&format!("unknown argument {other}")),
        }
    }
    let list: Vec<u64> = match one {
        Some(s) => vec![s],
        None => (1..=seeds).collect(),
    };
    let started = std::time::Instant::now();
    let (mut operations, mut violations, mut faults) = (0u64, 0u64, BTreeMap::<&str, u64>::new());
    let mut findings = BTreeMap::<&str, u64>::new();
    let mut last_hash = 0;
    let mut ran = None;
    for (i, seed) in list.iter().enumerate() {
        let s = Settings { ops, coordinators: coords, fault_rate: rate, ..Settings::new(*seed) };
        let out = run(&s);
        operations += out.operations;
        for (k, v) in &out.faults {
            *faults.entry(k).or_default() += v;
        }
        last_hash = out.trace_hash;
        for (k, v) in &out.findings {
            *findings.entry(k).or_default() += v;
        }
        for v in &out.violations {
            if v.known {
                if verbose {
                    println!("known finding, seed {seed}: {} on {:?}: {}", v.kind, v.key, v.message);
                    for line in &v.history {
                        println!("    {line}");
                    }
                }
                continue;
            }
            violations += 1;
            println!("VIOLATION seed {seed}: {} on {:?}: {}", v.kind, v.key, v.message);
            for line in &v.history {
                println!("    {line}");
            }
            println!(
                "    replay: cargo run --release -p leasehold-sim -- --seed {seed} --ops {ops} --coordinators {coords} --fault-rate {rate}"
            );
        }
        if first && violations > 0 {
            ran = Some(i + 1);
            break;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let ran = ran.unwrap_or(list.len());
    println!("seeds {ran}  operations {operations}  violations {violations}  seconds {seconds:.1}");
    println!("faults injected:");
    for (k, v) in &faults {
        println!("  {k:<26} {v}");
    }
    if !findings.is_empty() {
        println!("known findings (DESIGN.md, \"Simulation\"; --findings shows them):");
        for (k, v) in &findings {
            println!("  {k:<26} {v}");
        }
    }
    let summary = serde_json::json!({
        "seeds": ran,
        "operations": operations,
        "violations": violations,
        "faults": faults,
        "findings": findings,
        "seconds": (seconds * 10.0).round() / 10.0,
    });
    println!("{summary}");
    if trace && one.is_some() {
        println!("{last_hash:016x}");
    }
    if violations > 0 {
        std::process::exit(1);
    }
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
