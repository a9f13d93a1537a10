//! The `leasehold` command: a local HTTP server, one subcommand per lease operation, and
//! `run`, which executes a command while holding a lease.
//!
//! Exit codes (every subcommand):
//!
//! | code | meaning |
//! |------|---------|
//! | 0    | success |
//! | 1    | not the holder, or no such lease (`NotHolder`, `NotFound`) |
//! | 2    | usage error: bad flag, bad duration, invalid request (`InvalidRequest`) |
//! | 75   | the lease is held by someone else (`LeaseHeld`) |
//! | 76   | `run` only: the lease was lost while the command ran; the command was stopped |
//! | 77   | the store or the API could not be reached, or the store refused the request (`StoreUnavailable`, `Throttled`, `OutcomeUnknown`, `ClockSkew`, `StoreRefused`) |
//!
//! `run` otherwise exits with its command's status (128 + N when the command was killed by
//! signal N; 126 when it cannot be executed, 127 when it is not found).

mod client;
mod duration;
mod history;
mod metrics;
mod output;
mod run;
mod serve;
mod snapshot;
mod table;
mod target;
mod work;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use serde_json::{Map, Value};

/// Exit codes, documented in the module comment and in `--help`.
pub mod exit {
    pub const OK: i32 = 0;
    pub const FAILED: i32 = 1;
    pub const USAGE: i32 = 2;
    pub const HELD: i32 = 75;
    pub const LOST: i32 = 76;
    pub const STORE: i32 = 77;
}

const MAIN_HELP: &str = "\
Stores (flags over environment over default):
  --url URL     a running `leasehold serve` or other leasehold HTTP API  [env: LEASEHOLD_URL]
  --table NAME  a DynamoDB table (standard AWS configuration, AWS_ENDPOINT_URL_DYNAMODB) [env: LEASEHOLD_TABLE]
  --db PATH     the embedded store file (default ~/.local/share/leasehold/leases.db) [env: LEASEHOLD_DB]

Durations: 500ms, 30s, 5m, 2h, or plain milliseconds.

Examples:
  leasehold acquire jobs/nightly --duration 5m --wait 30s
  leasehold heartbeat jobs/nightly --lease-id \"$LEASE_ID\"
  leasehold release jobs/nightly --lease-id \"$LEASE_ID\"
  leasehold get jobs/nightly --json
  leasehold run jobs/nightly --skip-if-held -- ./nightly.sh
  leasehold serve --addr 127.0.0.1:7878
  leasehold --url http://127.0.0.1:7878 acquire jobs/nightly --holder worker-1

Exit codes:
  0 success, 1 not the holder or no such lease, 2 usage error or invalid request,
  75 lease held by someone else, 76 lease lost while `run` ran its command,
  77 store or API unreachable. `run` otherwise exits with its command's status.";

#[derive(Parser, Debug)]
#[command(name = "leasehold", version, about = "Distributed leases with fencing tokens", after_help = MAIN_HELP)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Args, Debug, Clone)]
pub struct Global {
    /// Base URL of a leasehold HTTP API, e.g. http://127.0.0.1:7878 [env: LEASEHOLD_URL]
    #[arg(long, global = true, value_name = "URL")]
    pub url: Option<String>,
    /// DynamoDB table [env: LEASEHOLD_TABLE]
    #[arg(long, global = true, value_name = "NAME")]
    pub table: Option<String>,
    /// Embedded store file [env: LEASEHOLD_DB]
    #[arg(long, global = true, value_name = "PATH")]
    pub db: Option<PathBuf>,
    /// Print the API's JSON (results and errors) on stdout instead of text
    #[arg(long, global = true)]
    pub json: bool,
    /// Do not check the DynamoDB table's definition before the command (it is otherwise
    /// checked at most once an hour per table) [env: LEASEHOLD_SKIP_TABLE_CHECK]
    #[arg(long = "skip-table-check", global = true, env = "LEASEHOLD_SKIP_TABLE_CHECK", hide_env = true,
          value_parser = clap::builder::FalseyValueParser::new())]
    pub skip_table_check: bool,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Serve the HTTP API (embedded store by default, DynamoDB with --table)
    #[command(after_help = serve::HELP)]
    Serve(serve::ServeArgs),
    /// Take the lease on KEY; prints the lease_id needed to renew and release it
    #[command(
        after_help = "Examples:\n  leasehold acquire jobs/nightly --holder worker-1 --duration 5m\n  leasehold acquire jobs/nightly --wait 30s --min-hold 10s --metadata '{\"run\":42}'\n  LEASE_ID=$(leasehold acquire jobs/nightly --json | jq -r .lease_id)\n\nExit codes: 0 acquired, 75 held by someone else (after --wait), 2 invalid, 77 store unreachable."
    )]
    Acquire(AcquireArgs),
    /// Extend a lease you hold
    #[command(
        after_help = "Examples:\n  leasehold heartbeat jobs/nightly --lease-id \"$LEASE_ID\"\n  LEASEHOLD_LEASE_ID=... leasehold heartbeat jobs/nightly --duration 10m\n\nExit codes: 0 renewed, 1 not the holder (lost, released, taken over), 2 invalid, 77 store unreachable."
    )]
    Heartbeat(HeartbeatArgs),
    /// Release a lease you hold
    #[command(
        after_help = "Examples:\n  leasehold release jobs/nightly --lease-id \"$LEASE_ID\"\n\nExit codes: 0 released, 1 not the holder, 2 invalid, 77 store unreachable."
    )]
    Release(ReleaseArgs),
    /// Show the state of KEY (never its lease_id)
    #[command(
        after_help = "Examples:\n  leasehold get jobs/nightly\n  leasehold get jobs/nightly --json | jq .fence\n  leasehold get jobs/nightly --watch --every 2s\n\n--watch redraws the state every --every (default 1s) until interrupted (Ctrl-C: exit 0);\nwith --json it prints one JSON line per refresh. A failed refresh is shown and retried.\nExit codes: 0 found (or a watch interrupted), 1 no lease on KEY, 77 store unreachable."
    )]
    Get(GetArgs),
    /// List the keys held right now: key, holder, fence, expires in, state
    #[command(
        after_help = "Examples:\n  leasehold list\n  leasehold list --prefix jobs/\n  leasehold --table leases list --limit 10 --json\n\nSTATE is held, fail-closed (held until released) or free (expired since it was listed)."
    )]
    List(ListArgs),
    /// Operator release: free KEY at once whoever holds it, advancing its fence
    #[command(
        name = "force-release",
        after_help = "Examples:\n  leasehold force-release jobs/nightly\n\nThe evicted holder's next heartbeat fails; its fence is below every later one.\nExit codes: 0 freed, 1 no lease on KEY, 77 store unreachable."
    )]
    ForceRelease(ForceReleaseArgs),
    /// Run a command while holding the lease on KEY (renewed in the background)
    #[command(after_help = run::HELP)]
    Run(run::RunArgs),
    /// Put KEY into a work state without leasing it
    #[command(after_help = work::PUT_HELP)]
    Put(work::PutArgs),
    /// Lease up to --limit free keys of a work state, the longest waiting first
    #[command(after_help = work::NEXT_HELP)]
    Next(work::NextArgs),
    /// Count the keys in a work state
    #[command(after_help = work::COUNT_HELP)]
    Count(work::CountArgs),
    /// Create or check the DynamoDB lease table (--table)
    #[command(after_help = table::HELP)]
    Table(table::TableArgs),
    /// Who held KEY when, with which fence: grants, renewals, releases, take-overs
    #[command(after_help = history::HELP)]
    History(history::HistoryArgs),
}

#[derive(Args, Debug)]
pub struct KeyArg {
    /// The lease key
    pub key: String,
}

#[derive(Args, Debug)]
pub struct ForceReleaseArgs {
    /// The lease key
    pub key: String,
    /// On a semaphore: only the holder with this fence (its slot frees at once)
    #[arg(long, value_name = "F")]
    pub fence: Option<u64>,
}

#[derive(Args, Debug)]
pub struct GetArgs {
    /// The lease key
    pub key: String,
    /// Redraw the state until interrupted (Ctrl-C)
    #[arg(long)]
    pub watch: bool,
    /// How often --watch refreshes
    #[arg(long, default_value = "1s", value_parser = duration::parse, value_name = "D", requires = "watch")]
    pub every: Duration,
}

#[derive(Args, Debug)]
pub struct AcquireArgs {
    /// The lease key
    pub key: String,
    /// Who holds the lease (shown to others) [default: user@hostname]
    #[arg(long, env = "LEASEHOLD_HOLDER")]
    pub holder: Option<String>,
    /// Lease duration [default: the coordinator's, 60s]
    #[arg(long, value_parser = duration::parse, value_name = "D", conflicts_with = "fail_closed")]
    pub duration: Option<Duration>,
    /// Keep trying this long while the key is held
    #[arg(long, value_parser = duration::parse, value_name = "D")]
    pub wait: Option<Duration>,
    /// A release never frees the key before this much time after the acquire
    #[arg(long = "min-hold", value_parser = duration::parse, value_name = "D")]
    pub min_hold: Option<Duration>,
    /// A lease without expiry, freed only by release or force-release
    #[arg(long = "fail-closed")]
    pub fail_closed: bool,
    /// JSON object stored with the lease (<= 4 KiB)
    #[arg(long, value_parser = parse_metadata, value_name = "JSON")]
    pub metadata: Option<Map<String, Value>>,
    /// Your own lease_id (22..128 of [A-Za-z0-9_-]), so a retried acquire gets the same lease
    #[arg(long = "lease-id", value_name = "ID")]
    pub lease_id: Option<String>,
    /// A semaphore of N slots: at most N holders of KEY at once (1..=640; 1 is a plain lease)
    #[arg(long, value_name = "N")]
    pub slots: Option<u32>,
    /// Kept alive this long from now by the keep-alive sweep (the deployment's scheduled
    /// heartbeat, or `leasehold serve`), which renews the lease (or the slot) by its duration
    /// until then (`keepalive.until_ms`); the duration must be at least 3 sweep periods
    #[arg(long, value_parser = duration::parse, value_name = "D", conflicts_with = "fail_closed")]
    pub keepalive: Option<Duration>,
}

#[derive(Args, Debug)]
pub struct HeartbeatArgs {
    /// The lease key
    pub key: String,
    /// The lease_id printed by acquire
    #[arg(long = "lease-id", env = "LEASEHOLD_LEASE_ID", hide_env_values = true, value_name = "ID")]
    pub lease_id: String,
    /// New duration from now [default: the lease's own]
    #[arg(long, value_parser = duration::parse, value_name = "D")]
    pub duration: Option<Duration>,
}

#[derive(Args, Debug)]
pub struct ReleaseArgs {
    /// The lease key
    pub key: String,
    /// The lease_id printed by acquire
    #[arg(long = "lease-id", env = "LEASEHOLD_LEASE_ID", hide_env_values = true, value_name = "ID")]
    pub lease_id: String,
    /// Move the key into this work state in the same write (the live holder only)
    #[arg(long, value_name = "STATE")]
    pub state: Option<String>,
}

#[derive(Args, Debug)]
pub struct ListArgs {
    /// At most this many keys
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub limit: u32,
    /// Only keys that start with this
    #[arg(long, default_value = "", value_name = "PREFIX")]
    pub prefix: String,
    /// The keys in this work state instead, held or not, the longest waiting first
    #[arg(long, value_name = "STATE", conflicts_with = "prefix")]
    pub state: Option<String>,
}

pub fn parse_metadata(s: &str) -> Result<Map<String, Value>, String> {
    match serde_json::from_str::<Value>(s) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err("metadata must be a JSON object, e.g. '{\"run\": 42}'".into()),
        Err(e) => Err(format!("metadata is not valid JSON: {e}")),
    }
}

/// `user@hostname`, the default holder.
pub fn default_holder() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "user".into());
    format!("{user}@{}", hostname())
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates on success.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        if let Ok(s) = std::str::from_utf8(&buf[..end]) {
            if !s.is_empty() {
                return s.to_string();
            }
        }
    }
    "localhost".into()
}

/// Prints a usage error the way clap does and exits 2.
pub fn usage_error(msg: impl std::fmt::Display) -> ! {
    use clap::CommandFactory;
    Cli::command().error(clap::error::ErrorKind::ArgumentConflict, msg).exit()
}

fn main() {
    let cli = Cli::parse();
    let is_serve = matches!(cli.cmd, Cmd::Serve(_));
    if std::env::var_os("RUST_LOG").is_none() && !is_serve {
        // Commands report what happens themselves (a lost lease, a failed release). The
        // variable is set for the logger only, so `run` does not hand it to its command.
        std::env::set_var("RUST_LOG", "error");
        leasehold::env::init_tracing(false);
        std::env::remove_var("RUST_LOG");
    } else {
        leasehold::env::init_tracing(false);
    }
    leasehold::history::set_interface(if is_serve { "http" } else { "cli" });
    let code = match cli.cmd {
        Cmd::Serve(args) => serve::main(&cli.global, args),
        Cmd::Run(args) => run::main(&cli.global, args),
        Cmd::Put(a) => work::main(&cli.global, work::Work::Put(a)),
        Cmd::Next(a) => work::main(&cli.global, work::Work::Next(a)),
        Cmd::Count(a) => work::main(&cli.global, work::Work::Count(a)),
        Cmd::Table(a) => table::main(&cli.global, a),
        Cmd::History(a) => history::main(&cli.global, a),
        cmd => {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
            rt.block_on(lease_command(&cli.global, cmd))
        }
    };
    std::process::exit(code);
}

async fn lease_command(g: &Global, cmd: Cmd) -> i32 {
    // The work-state commands use the `state` index; the others only the key.
    let states = match &cmd {
        Cmd::List(l) => l.state.is_some(),
        Cmd::Release(r) => r.state.is_some(),
        _ => false,
    };
    let target = match target::Target::open(g, true, table::uses(states)).await {
        Ok(t) => t,
        Err(f) => return output::failure(g, &f),
    };
    let result = match &cmd {
        Cmd::Acquire(a) => {
            let req = leasehold::api::AcquireRequest {
                key: None,
                holder: a.holder.clone().filter(|h| !h.is_empty()).unwrap_or_else(default_holder),
                duration_ms: a.duration.map(|d| d.as_millis() as u64),
                fail_closed: a.fail_closed,
                wait_ms: a.wait.map(|d| d.as_millis() as u64),
                min_hold_ms: a.min_hold.map(|d| d.as_millis() as u64),
                metadata: a.metadata.clone(),
                keepalive: a.keepalive.map(|d| leasehold::Keepalive {
                    until_ms: output::now_ms() + d.as_millis() as u64,
                    execution_arn: None,
                }),
                // Chosen here, before anything is sent: a lost answer leaves a lease this command
                // can still name (and a fail-closed lease requires it).
                lease_id: Some(
                    a.lease_id.clone().unwrap_or_else(|| leasehold::LeaseId::generate().expose().to_string()),
                ),
                slots: a.slots,
                ..Default::default()
            };
            acquire(&target, &a.key, req, a.fail_closed).await
        }
        Cmd::Heartbeat(h) => {
            let req = leasehold::api::HeartbeatRequest {
                key: None,
                lease_id: h.lease_id.clone(),
                duration_ms: h.duration.map(|d| d.as_millis() as u64),
            };
            target.heartbeat(&h.key, req).await
        }
        Cmd::Release(r) => {
            let req =
                leasehold::api::ReleaseRequest { key: None, lease_id: r.lease_id.clone(), state: r.state.clone() };
            target.release(&r.key, req).await
        }
        Cmd::Get(k) if k.watch => return watch(g, &target, k).await,
        Cmd::Get(k) => target.get(&k.key).await,
        Cmd::List(l) => match &l.state {
            Some(state) => target.list_state(state, l.limit as usize).await,
            None => target.list(&l.prefix, l.limit as usize).await,
        },
        Cmd::ForceRelease(k) => target.force_release(&k.key, k.fence).await,
        Cmd::Serve(_) | Cmd::Run(_) | Cmd::Put(_) | Cmd::Next(_) | Cmd::Count(_) | Cmd::Table(_) | Cmd::History(_) => {
            unreachable!("handled in main")
        }
    };
    match result {
        Ok(v) => {
            output::success(g, &cmd, v);
            exit::OK
        }
        Err(f) => output::failure(g, &f),
    }
}

/// An acquire. With `--wait`, a `ClockSkew` answer is retried after the pause it names
/// (`retry_after_ms`) while the wait lasts, never at once. Every failure of a fail-closed acquire,
/// and every `OutcomeUnknown`, carries the lease_id this command chose, so that what may have
/// landed can be released.
async fn acquire(
    target: &target::Target,
    key: &str,
    mut req: leasehold::api::AcquireRequest,
    fail_closed: bool,
) -> Result<serde_json::Value, target::Failure> {
    let started = std::time::Instant::now();
    let wait = Duration::from_millis(req.wait_ms.unwrap_or(0));
    let lease_id = req.lease_id.clone().unwrap_or_default();
    let result = loop {
        let r = target.acquire(key, req.clone()).await;
        let skew_pause = r.as_ref().err().filter(|f| f.name() == Some(leasehold::ErrorName::ClockSkew)).map(|f| {
            f.json
                .get("retry_after_ms")
                .and_then(serde_json::Value::as_u64)
                .map_or(leasehold::CLOCK_SKEW_RETRY_AFTER, Duration::from_millis)
        });
        match skew_pause {
            Some(p) if started.elapsed() + p < wait => {
                tokio::time::sleep(p).await;
                req.wait_ms = Some(wait.saturating_sub(started.elapsed()).as_millis() as u64);
            }
            _ => break r,
        }
    };
    result.map_err(|mut f| {
        let unknown = f.name() == Some(leasehold::ErrorName::OutcomeUnknown);
        if (fail_closed || unknown) && f.json.get("lease_id").is_none() {
            f.json["lease_id"] = serde_json::json!(lease_id);
        }
        f
    })
}

/// `get --watch`: the state of the key every `every` until SIGINT or SIGTERM (exit 0). A
/// failed refresh (no lease yet, store unreachable) is shown and the watch goes on.
async fn watch(g: &Global, target: &target::Target, args: &GetArgs) -> i32 {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) else {
        return output::failure(g, &target::Failure::usage("cannot install the signal handlers --watch needs"));
    };
    let every = args.every.max(Duration::from_millis(100));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let result = target.get(&args.key).await;
                output::watch_frame(g, &args.key, every, result);
            }
            _ = int.recv() => return exit::OK,
            _ = term.recv() => return exit::OK,
        }
    }
}
