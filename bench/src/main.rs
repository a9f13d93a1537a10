//! leasehold benchmarks on DynamoDB Local, behind a request-counting proxy.
//!
//! `leasehold-bench [--quick] [--scenarios m1,m2,m3,m4,serve-m3,batch,sem] [--m1-cycles N] [--warmup N]
//! [--batch-items N]` starts
//! DynamoDB Local and the proxy, then runs every scenario for every library in a child process
//! of its own (separate clients, separate peak RSS), interleaving the libraries round by
//! round, and prints one table per scenario with ratios. Libraries: `leasehold` (on a table of
//! the same schema as the others), `leasehold+index` (on the table template.yaml deploys, with
//! the keep-alive index; M1 and M2 only), `raw` (a bare aws-sdk conditional PutItem +
//! DeleteItem loop: the floor), with `LEASEHOLD_BENCH_SHAPED` set `raw-shaped` (the bare SDK
//! client sending leasehold's own acquire and release requests: what the requests' shape costs
//! apart from leasehold's code; with `LEASEHOLD_BENCH_SHAPED=parts` also three variants of it
//! that each leave one part out, `shaped-bare-condition`, `shaped-delete` and
//! `shaped-two-attributes`: what each part costs DynamoDB Local), and with `--features compare`
//! the `dynamodb-lease` crate (in M3 twice: releasing with `Lease::release().await`, and by
//! dropping the lease). Every library first runs unmeasured M1 cycles (`--warmup`, default
//! 3,000 each): DynamoDB Local's JIT compiler otherwise takes a core for tens of thousands of
//! requests. A different library starts each M1 round. This is a benchmark, not a test: it
//! asserts nothing and prints figures. Two scenarios run only when named: `serve-m3` (M3's shape over HTTP through
//! `leasehold serve` on the embedded store, with in-process wake-ups) and `batch` (8 workers
//! drain a work state against a hand-written Query + UpdateItem floor). `sem` (16 workers on a
//! semaphore of 4 slots against the counter-and-map floor of AWS's concurrency-control sample)
//! runs only when named too. With `LEASEHOLD_BENCH_PERF=DIR`, every child runs under `perf
//! record -F 2999`, its profile in DIR (one file per library, scenario and round). With
//! `LEASEHOLD_BENCH_RTT_MS=N`, M1 runs (warm-up included) with every request held N ms by the
//! proxy (a round trip like DynamoDB's, the same for every library). With
//! `LEASEHOLD_BENCH_POLL_ATTEMPTS=1.2,3`, M3 also runs leasehold with those targets of attempts
//! per acquisition (`Config::poll_attempts`), as `leasehold/poll=1.2` and so on.

//!
//! One module per scenario, each with a `run` for both sides of a [`Step`]; the
//! libraries are in `libs`, the shared harness in `harness`. A new scenario is one `mod` line
//! and one arm in [`scenario`].

mod batch;
mod harness;
mod libs;
mod m1;
mod m2;
mod m3;
mod m4;
mod sem;
mod serve_m3;

use harness::{ChildArgs, Params, Rss, Step};
use serde_json::Value;

/// The scenarios run when `--scenarios` names none, in this order.
const DEFAULT_SCENARIOS: [&str; 4] = ["m1", "m2", "m3", "m4"];

/// Every scenario by name: one arm each.
async fn scenario(name: &str, step: Step<'_>) -> Option<Value> {
    match name {
        "m1" => m1::run(step).await,
        "m2" => m2::run(step).await,
        "m3" => m3::run(step).await,
        "m4" => m4::run(step).await,
        "serve-m3" => serve_m3::run(step).await,
        "batch" => batch::run(step).await,
        "sem" => sem::run(step).await,
        other => panic!("unknown scenario {other}"),
    }
}

/// The value after `flag`, parsed.
fn flag<T: std::str::FromStr>(args: &[String], flag: &str) -> Option<T> {
    args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    if args.get(1).map(String::as_str) == Some("--child") {
        // --child LIB SCENARIO ENDPOINT TABLE N SECS TAG
        let a = &args[2..];
        let child = ChildArgs {
            lib: a[0].clone(),
            endpoint: a[2].clone(),
            table: a[3].clone(),
            n: a[4].parse().unwrap(),
            secs: a[5].parse().unwrap(),
            tag: a[6].clone(),
        };
        let v = rt.block_on(scenario(&a[1], Step::Child(&child))).expect("a child's JSON line");
        println!("{v}");
        return;
    }
    let quick = args.iter().any(|a| a == "--quick");
    let scenarios: Vec<String> = flag::<String>(&args, "--scenarios")
        .map(|s| s.split(',').map(str::to_string).collect())
        .unwrap_or_else(|| DEFAULT_SCENARIOS.iter().map(|s| s.to_string()).collect());
    let (mut m1n, m2n, m3s, m4trials, mut rounds) = if quick { (200, 600, 5, 2, 2) } else { (1000, 3000, 20, 4, 4) };
    // `--m1-cycles N`: more M1 cycles (in rounds of 250) for steadier ratios on a noisy machine.
    if let Some(n) = flag::<usize>(&args, "--m1-cycles") {
        m1n = n.max(250);
        rounds = m1n / 250;
    }
    // `--warmup N`: unmeasured M1 cycles per library first. DynamoDB Local's JIT compiler
    // keeps a core busy for tens of thousands of requests; measured before it settles, the
    // figures mostly say who ran while it was compiling.
    let warmup = flag(&args, "--warmup").unwrap_or(if quick { 200 } else { 3000 });
    // `--batch-items N`: the batch scenario's items (8 workers, batches of 10).
    let batch_items = flag(&args, "--batch-items").unwrap_or(if quick { 1000 } else { 5000 });
    let batch_rounds = if quick { 1 } else { 2 };
    let params = Params { m1n, rounds, warmup, m2n, m3s, m4trials, batch_items, batch_rounds };
    rt.block_on(async {
        let s = harness::setup().await;
        harness::print_header(&harness::libraries());
        let mut rss = Rss::new();
        // The scenarios in their usual order, whatever the order they were named in.
        for name in DEFAULT_SCENARIOS.iter().filter(|d| scenarios.iter().any(|s| s == *d)) {
            scenario(name, Step::Report(&s, &params, &mut rss)).await;
        }
        for name in scenarios.iter().filter(|s| !DEFAULT_SCENARIOS.contains(&s.as_str())) {
            scenario(name, Step::Report(&s, &params, &mut rss)).await;
        }
        harness::print_rss(&rss);
    });
}
