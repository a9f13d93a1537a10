//! The harness every scenario shares: DynamoDB Local behind the counting proxy with one table
//! per library, child processes (one per scenario, library and round), and the figures'
//! arithmetic.

use std::collections::BTreeMap;
use std::time::Duration;

use leasehold::store::DynamoStore;
use leasehold::Config;
use leasehold_tests::proxy::Proxy;
use leasehold_tests::DynamoLocal;
use serde_json::Value;

pub const LEASE: Duration = Duration::from_secs(10);

/// `leasehold` runs on a table of the same schema as the others (key + TTL); `leasehold+index`
/// on the table template.yaml deploys, with the sparse keep-alive index. DynamoDB Local
/// maintains a global secondary index synchronously inside every write (DynamoDB propagates
/// it asynchronously, off the write's latency), so the second row shows what the index costs
/// here, not in production.
pub fn libraries() -> Vec<&'static str> {
    let mut v = vec!["leasehold", "leasehold+index", "raw"];
    // `LEASEHOLD_BENCH_SHAPED`: also the bare SDK client sending leasehold's own requests;
    // `=parts`, also the variants that each leave one part of that shape out (for M1; M4
    // leaves them out).
    if let Some(shaped) = std::env::var_os("LEASEHOLD_BENCH_SHAPED") {
        v.push("raw-shaped");
        if shaped == "parts" {
            v.extend(["shaped-bare-condition", "shaped-delete", "shaped-two-attributes"]);
        }
    }
    if cfg!(feature = "compare") {
        v.push("dynamodb-lease");
    }
    v
}

pub fn peak_rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).map(|l| l.to_string()))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|n| n.parse().ok()))
        .unwrap_or(0)
}

/// CPU time this process has used so far, in ms (every thread's run time from
/// /proc/self/task/*/schedstat, in ns).
pub fn cpu_ms() -> f64 {
    sched_totals().map_or(f64::NAN, |(ns, _)| ns as f64 / 1e6)
}

/// How many times this process's threads have been put on a CPU so far (the third field of
/// /proc/self/task/*/schedstat): each is a thread woken (or preempted and resumed).
pub fn cpu_runs() -> u64 {
    sched_totals().map_or(0, |(_, runs)| runs)
}

/// Every thread's run time (ns) and run count, summed, from /proc/self/task/*/schedstat.
fn sched_totals() -> Option<(u64, u64)> {
    sched_totals_of("self")
}

/// CPU time (user and system) process `pid` has used so far, its exited threads' included,
/// in ms (from /proc/PID/stat, in clock ticks of 10 ms): for a process whose threads come and
/// go (a JVM), which the per-thread sums above would lose.
fn process_cpu_ms(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name (in parentheses, which may hold spaces): utime and
    // stime are the 14th and 15th fields of the line, the 12th and 13th after the name.
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut f = rest.split_whitespace().skip(11).map(|v| v.parse::<u64>().ok());
    let (user, system) = (f.next()??, f.next()??);
    Some((user + system) as f64 * 10.0)
}

/// Every thread's run time (ns) and run count, summed, from /proc/PID/task/*/schedstat
/// ("self": this process).
fn sched_totals_of(pid: &str) -> Option<(u64, u64)> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let (mut ns, mut runs) = (0u64, 0u64);
    for t in tasks.flatten() {
        if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
            let mut f = s.split_whitespace().map(|v| v.parse::<u64>().unwrap_or(0));
            ns += f.next().unwrap_or(0);
            runs += f.nth(1).unwrap_or(0);
        }
    }
    Some((ns, runs))
}

/// The process id of the DynamoDB Local server listening on `port` (its command line names the
/// jar and the port), to read its CPU time.
fn server_pid(port: u16) -> Option<String> {
    let want = format!("-port {port}");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid = e.file_name().to_string_lossy().to_string();
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        // The java process itself, not the watchdog shell whose command line names it too.
        let java = cmd.split(' ').next().is_some_and(|exe| exe.ends_with("java"));
        (pid.bytes().all(|b| b.is_ascii_digit()) && java && cmd.contains("DynamoDBLocal.jar") && cmd.contains(&want))
            .then_some(pid)
    })
}

pub fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// leasehold's configuration: the defaults, except that `LEASEHOLD_BENCH_POLL_MAX_MS` sets the
/// longest pause between a waiter's attempts (to see what it trades in M3).
pub fn config() -> Config {
    let mut c = Config::default();
    if let Some(ms) = std::env::var("LEASEHOLD_BENCH_POLL_MAX_MS").ok().and_then(|v| v.parse().ok()) {
        c.poll_max = Duration::from_millis(ms);
    }
    c
}

/// Sizes of a run (`--quick` or full, `--m1-cycles`, `--warmup`).
pub struct Params {
    /// M1 cycles per library, run in `rounds` interleaved rounds.
    pub m1n: usize,
    pub rounds: usize,
    /// Unmeasured M1 cycles per library first.
    pub warmup: usize,
    pub m2n: usize,
    /// M3's duration, in s.
    pub m3s: u64,
    pub m4trials: usize,
    /// The batch scenario's items (`--batch-items`) and interleaved rounds per side.
    pub batch_items: usize,
    pub batch_rounds: usize,
}

/// Peak RSS (VmHWM, KB) of each library's harness processes so far.
pub type Rss = BTreeMap<&'static str, u64>;

/// Keeps the larger peak RSS of `lib` (from a child's JSON `rss_kb`).
pub fn note_rss(rss: &mut Rss, lib: &'static str, v: &Value) {
    let kb = v["rss_kb"].as_u64().unwrap();
    *rss.entry(lib).or_default() = rss.get(lib).copied().unwrap_or(0).max(kb);
}

/// What a child process runs: one scenario for one library.
pub struct ChildArgs {
    pub lib: String,
    pub endpoint: String,
    pub table: String,
    pub n: usize,
    pub secs: u64,
    pub tag: String,
}

/// A scenario's two sides: in a child process, run it for one library and return its JSON
/// line; in the parent, run the children for every library and print the table.
pub enum Step<'a> {
    Child(&'a ChildArgs),
    Report(&'a Setup, &'a Params, &'a mut Rss),
}

/// A scenario module's `run(step)`: `child(&ChildArgs) -> Value` in the child process,
/// `report(&Setup, &Params, &mut Rss)` in the parent (`parent_only` for a scenario without
/// children).
macro_rules! scenario_run {
    ($child:ident, $report:ident) => {
        pub async fn run(step: $crate::harness::Step<'_>) -> Option<serde_json::Value> {
            match step {
                $crate::harness::Step::Child(a) => Some($child(a).await),
                $crate::harness::Step::Report(s, p, rss) => {
                    $report(s, p, rss).await;
                    None
                }
            }
        }
    };
    (parent_only $report:ident) => {
        pub async fn run(step: $crate::harness::Step<'_>) -> Option<serde_json::Value> {
            match step {
                $crate::harness::Step::Child(_) => panic!("{} runs in the parent process", module_path!()),
                $crate::harness::Step::Report(s, p, rss) => {
                    $report(s, p, rss).await;
                    None
                }
            }
        }
    };
}
pub(crate) use scenario_run;

pub struct Setup {
    _local: DynamoLocal,
    /// DynamoDB Local's process id (its CPU time is read around each child).
    server: Option<String>,
    pub proxy: Proxy,
    pub tables: BTreeMap<&'static str, String>,
}

pub async fn setup() -> Setup {
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
    let server = server_pid(local.port);
    Setup { _local: local, server, proxy, tables }
}

impl Setup {
    /// CPU time DynamoDB Local has used so far, in ms (NaN when its process was not found).
    pub fn server_cpu_ms(&self) -> f64 {
        self.server.as_deref().and_then(process_cpu_ms).unwrap_or(f64::NAN)
    }

    /// CPU time this (the parent) process has used so far, in ms: the proxy's, while a child runs.
    pub fn proxy_cpu_ms(&self) -> f64 {
        cpu_ms()
    }
}

/// Runs one child and returns its JSON plus the proxy's request count during it.
pub async fn run_child(s: &Setup, lib: &str, scenario: &str, n: usize, secs: u64, tag: &str) -> (Value, u64) {
    let (v, counts) = run_child_counts(s, lib, scenario, n, secs, tag).await;
    (v, counts.values().sum())
}

/// Runs one child and returns its JSON plus the proxy's requests during it, per operation.
pub async fn run_child_counts(
    s: &Setup,
    lib: &str,
    scenario: &str,
    n: usize,
    secs: u64,
    tag: &str,
) -> (Value, BTreeMap<String, u64>) {
    s.proxy.reset_counts();
    let exe = std::env::current_exe().unwrap();
    // `LEASEHOLD_BENCH_PERF_SERVER=DIR`: DynamoDB Local is profiled while each child runs
    // (`perf record -F 2999 -p`, by thread: its JIT compiler's threads are named), its profile
    // written to DIR/server-LIB-SCENARIO-TAG.data.
    let server_perf = match (std::env::var_os("LEASEHOLD_BENCH_PERF_SERVER"), &s.server) {
        (Some(dir), Some(pid)) => {
            let file = format!("server-{}-{scenario}-{tag}.data", lib.replace(['/', '+'], "_"));
            let child = tokio::process::Command::new("perf")
                .args(["record", "-q", "-F", "2999", "-p", pid, "-o"])
                .arg(std::path::Path::new(&dir).join(file))
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("perf record");
            // perf attaches before it samples: give it a moment.
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            Some(child)
        }
        _ => None,
    };
    // `LEASEHOLD_BENCH_PERF=DIR`: every child runs under `perf record` (flat, 2,999 Hz), its
    // profile written to DIR/LIB-SCENARIO-TAG.data (the figures then include perf's cost).
    let mut cmd = match std::env::var_os("LEASEHOLD_BENCH_PERF") {
        Some(dir) => {
            let file = format!("{}-{scenario}-{tag}.data", lib.replace(['/', '+'], "_"));
            let mut c = tokio::process::Command::new("perf");
            c.args(["record", "-q", "-F", "2999"]);
            // `LEASEHOLD_BENCH_PERF_ARGS`: more `perf record` arguments (`--call-graph dwarf`,
            // `-e sched:sched_switch` for where threads go off the CPU, ...).
            if let Ok(more) = std::env::var("LEASEHOLD_BENCH_PERF_ARGS") {
                c.args(more.split_whitespace());
            }
            c.arg("-o").arg(std::path::Path::new(&dir).join(file)).arg("--").arg(exe);
            c
        }
        None => tokio::process::Command::new(exe),
    };
    let out = cmd
        .args([
            "--child",
            lib,
            scenario,
            &s.proxy.endpoint(),
            // A variant of a library (`/drop`, `/poll=X`) runs on that library's table.
            &s.tables[lib.split('/').next().unwrap_or(lib)],
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
    if let Some(mut perf) = server_perf {
        if let Some(pid) = perf.id() {
            let _ = std::process::Command::new("kill").args(["-INT", &pid.to_string()]).status();
        }
        let _ = perf.wait().await;
    }
    (v, s.proxy.counts())
}

pub fn print_header(libs: &[&str]) {
    println!(
        "leasehold-bench: DynamoDB Local 3.3.1 (in memory) behind a counting proxy; lease 10 s; libraries: {}",
        libs.join(", ")
    );
}

pub fn print_rss(rss: &Rss) {
    println!("\nPeak RSS of each harness process (VmHWM):");
    for (lib, kb) in rss {
        println!("{:<16} {:>6.1} MB", lib, *kb as f64 / 1024.0);
    }
}
