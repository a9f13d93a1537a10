//! `leasehold history KEY`: who held KEY when, with which fence (DESIGN.md, "Lease history"),
//! and the history part of `serve`'s operator routes (`GET /leases/history/{key+}`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use leasehold::env::StoreChoice;
use leasehold::history::Event;
use leasehold::store::sqlite_history;
use serde_json::{json, Value};

use crate::target::{choose, Either, Failure};
use crate::{client, duration, exit, output, Global};

pub const HELP: &str = "\
Examples:
  leasehold history jobs/nightly
  leasehold history jobs/nightly --since 24h --json
  leasehold --url http://127.0.0.1:7878 history jobs/nightly

One line per event, oldest first: time, what happened (granted, renewed, released, taken_over,
force_released, handed_over, revoked, put), fence, holder, the lease_id's first characters,
the work state and the interface. Events are kept LEASEHOLD_HISTORY_RETENTION_S seconds
(default 7 days). On DynamoDB (--table) the history table is --history-table or
LEASEHOLD_HISTORY_TABLE (default: the lease table's name with -history), written by the
history function from the table's stream. Exit codes: 0 (also with no events), 2 invalid,
77 store unreachable.";

#[derive(Args, Debug)]
pub struct HistoryArgs {
    /// The lease key
    pub key: String,
    /// Only events this recent
    #[arg(long, default_value = "7d", value_parser = parse_since, value_name = "D")]
    pub since: Duration,
    /// At most this many events (the newest)
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub limit: u32,
    /// The DynamoDB history table [env: LEASEHOLD_HISTORY_TABLE] [default: TABLE-history]
    #[arg(long = "history-table", value_name = "NAME")]
    pub history_table: Option<String>,
}

/// A duration, with days (`7d`) too.
pub fn parse_since(s: &str) -> Result<Duration, String> {
    match s.strip_suffix('d').and_then(|d| d.trim().parse::<u64>().ok()) {
        Some(days) => Ok(Duration::from_secs(days * 86_400)),
        None => duration::parse(s),
    }
}

/// The default history table of lease table `table`.
pub fn history_table_of(table: &str, flag: Option<&str>) -> String {
    flag.map(str::to_string)
        .or_else(|| std::env::var("LEASEHOLD_HISTORY_TABLE").ok().filter(|t| !t.trim().is_empty()))
        .unwrap_or_else(|| format!("{table}-history"))
}

/// Where the history is read from.
pub enum Source {
    Embedded(PathBuf),
    Dynamo { history_table: String },
}

impl Source {
    pub async fn read(&self, key: &str, since_ms: u64, limit: usize) -> Result<Vec<Event>, Failure> {
        match self {
            Source::Embedded(path) => {
                let (path, key) = (path.clone(), key.to_string());
                tokio::task::spawn_blocking(move || sqlite_history::read(&path, &key, since_ms, limit))
                    .await
                    .map_err(|e| Failure::unreachable(e.to_string()))?
                    .map_err(Failure::from)
            }
            Source::Dynamo { history_table } => {
                let store =
                    leasehold::store::DynamoStore::from_env(history_table.clone(), Duration::from_secs(10)).await;
                leasehold::history::dynamo::read(store.client(), history_table, key, since_ms, limit)
                    .await
                    .map_err(Failure::from)
            }
        }
    }
}

pub fn main(g: &Global, args: HistoryArgs) -> i32 {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    rt.block_on(async {
        let since_ms = output::now_ms().saturating_sub(args.since.as_millis() as u64);
        let result = match choose(g, true) {
            Err(f) => Err(f),
            Ok(Either::Http(e)) => {
                if let Err(err) = leasehold::validate::key_travels(&args.key) {
                    return output::failure(g, &Failure::from(err));
                }
                let path = format!(
                    "/leases/history/{}?since_ms={since_ms}&limit={}",
                    client::encode_key(&args.key),
                    args.limit
                );
                crate::target::http(&e, "GET", &path, None, Some("history")).await
            }
            Ok(Either::Store(choice)) => {
                let source = match &choice {
                    StoreChoice::Embedded { path } => Source::Embedded(path.clone()),
                    StoreChoice::Dynamo { table } => {
                        Source::Dynamo { history_table: history_table_of(table, args.history_table.as_deref()) }
                    }
                };
                source.read(&args.key, since_ms, args.limit as usize).await.map(|ev| answer(&args.key, ev))
            }
        };
        match result {
            Err(f) => output::failure(g, &f),
            Ok(v) => {
                if g.json {
                    println!("{v}");
                } else {
                    print!("{}", text(&v));
                }
                exit::OK
            }
        }
    })
}

/// The JSON of a key's history (CLI `--json` and `GET /leases/history/{key}`).
pub fn answer(key: &str, events: Vec<Event>) -> Value {
    json!({ "key": key, "events": events })
}

/// One line per event.
pub fn text(v: &Value) -> String {
    let events = v["events"].as_array().cloned().unwrap_or_default();
    if events.is_empty() {
        return format!("no events for {:?} in that time\n", v["key"].as_str().unwrap_or(""));
    }
    let mut out = String::new();
    for e in events {
        let s = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("").to_string();
        let mut line = format!(
            "{}  {:<14} fence {:<18} holder {:<20} lease {:<6}",
            duration::rfc3339(e["at_ms"].as_u64().unwrap_or(0)),
            s("kind"),
            e["fence"].as_u64().unwrap_or(0),
            s("holder"),
            s("lease_id_prefix"),
        );
        if let Some(st) = e.get("state").and_then(Value::as_str) {
            line.push_str(&format!("  state {st}"));
        }
        if let Some(n) = e["slots"].as_u64() {
            line.push_str(&format!("  slot of {n}"));
        }
        if let (Some(h), Some(f)) = (e.get("previous_holder").and_then(Value::as_str), e["previous_fence"].as_u64()) {
            line.push_str(&format!("  from {h} (fence {f})"));
        }
        line.push_str(&format!("  via {}", s("interface")));
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// `GET /leases/history/{key}` and `GET /leases/history` (every key's recent events) of
/// `serve`: `?since_ms=` (epoch ms) or `?since=` (a duration back from now), `&limit=`.
pub async fn route(source: &Source, key: Option<&str>, query: &str, now_ms: u64) -> Result<Value, Failure> {
    let mut since_ms = now_ms.saturating_sub(leasehold::history::retention().as_millis() as u64);
    let mut limit = 1000usize;
    for (k, v) in query.split('&').filter_map(|p| p.split_once('=')) {
        let v = percent_encoding::percent_decode_str(v).decode_utf8_lossy();
        match k {
            "since_ms" => since_ms = v.parse().map_err(|_| Failure::usage("since_ms must be epoch milliseconds"))?,
            "since" => since_ms = now_ms.saturating_sub(parse_since(&v).map_err(Failure::usage)?.as_millis() as u64),
            "limit" => {
                limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=100_000).contains(n))
                    .ok_or_else(|| Failure::usage("limit must be 1..=100000"))?
            }
            _ => {}
        }
    }
    match key {
        Some(k) => Ok(answer(k, source.read(k, since_ms, limit).await?)),
        None => match source {
            Source::Embedded(p) => {
                let p: PathBuf = p.clone();
                let ev = tokio::task::spawn_blocking(move || sqlite_history::recent(Path::new(&p), since_ms, limit))
                    .await
                    .map_err(|e| Failure::unreachable(e.to_string()))?
                    .map_err(Failure::from)?;
                Ok(json!({ "events": ev }))
            }
            Source::Dynamo { .. } => Err(Failure::usage(
                "the recent events of every key are kept by the embedded store only: ask for one key",
            )),
        },
    }
}
