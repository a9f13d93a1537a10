//! Work-item subcommands (DESIGN.md, "Work items and batch leases"): `put` a key into a work
//! state, take the `next` free keys of a state in one batch, `count` the keys in a state.
//! Moving a key on is `release --state`; `get` shows a key's state and `list --state` lists a
//! state's keys.

use std::time::Duration;

use clap::Args;
use leasehold::api::Operation;
use serde_json::{json, Map, Value};

use crate::target::Target;
use crate::{default_holder, duration, exit, output, Global};

pub const PUT_HELP: &str = "Examples:\n  leasehold put orders/42 --state PENDING\n\nA key already in STATE is left as it is. Exit codes: 0 put, 75 the key is held, 2 invalid, 77 store unreachable.";
pub const NEXT_HELP: &str = "Examples:\n  leasehold next PENDING --limit 10 --duration 5m\n  leasehold next PENDING --json | jq -r '.leases[] | \"\\(.key) \\(.lease_id) \\(.fence)\"'\n  leasehold release orders/42 --lease-id \"$ID\" --state DONE\n\nPrints one line per lease: key, fence, attempts, lease_id. Exit codes: 0 (also when no key was free:\nnothing is printed, or {\"leases\": []} with --json), 2 invalid, 77 store unreachable.";
pub const COUNT_HELP: &str =
    "Examples:\n  leasehold count PENDING\n\nCounts the keys in STATE, held or not (those held fail-closed excepted).";

#[derive(Args, Debug)]
pub struct PutArgs {
    /// The key
    pub key: String,
    /// The work state to put it in (A-Z, a-z, 0-9, '_', '-')
    #[arg(long)]
    pub state: String,
    /// Who puts it (kept as the holder of a new key) [default: user@hostname]
    #[arg(long, env = "LEASEHOLD_HOLDER")]
    pub holder: Option<String>,
}

#[derive(Args, Debug)]
pub struct NextArgs {
    /// The work state to take keys from
    pub state: String,
    /// Most keys to take (1..=100)
    #[arg(long, default_value_t = 1)]
    pub limit: u32,
    /// Who holds the leases [default: user@hostname]
    #[arg(long, env = "LEASEHOLD_HOLDER")]
    pub holder: Option<String>,
    /// Duration of each lease [default: the coordinator's, 60s]
    #[arg(long, value_parser = duration::parse, value_name = "D")]
    pub duration: Option<Duration>,
    /// Wait this long for at least one free key
    #[arg(long, value_parser = duration::parse, value_name = "D")]
    pub wait: Option<Duration>,
    /// JSON object stored with each lease (<= 4 KiB)
    #[arg(long, value_parser = crate::parse_metadata, value_name = "JSON")]
    pub metadata: Option<Map<String, Value>>,
}

#[derive(Args, Debug)]
pub struct CountArgs {
    /// The work state
    pub state: String,
}

/// What a work subcommand asks.
#[derive(Debug)]
pub enum Work {
    Put(PutArgs),
    Next(NextArgs),
    Count(CountArgs),
}

pub fn main(g: &Global, w: Work) -> i32 {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    rt.block_on(async {
        let target = match Target::open(g, true, crate::table::uses(true)).await {
            Ok(t) => t,
            Err(f) => return output::failure(g, &f),
        };
        let holder = |h: &Option<String>| h.clone().filter(|h| !h.is_empty()).unwrap_or_else(default_holder);
        let result = match &w {
            Work::Put(p) => {
                target.work(Operation::Put, &p.key, json!({ "state": p.state, "holder": holder(&p.holder) })).await
            }
            Work::Next(n) => {
                let mut body = json!({ "holder": holder(&n.holder), "limit": n.limit });
                if let Some(d) = n.duration {
                    body["duration_ms"] = json!(d.as_millis() as u64);
                }
                if let Some(d) = n.wait {
                    body["wait_ms"] = json!(d.as_millis() as u64);
                }
                if let Some(m) = &n.metadata {
                    body["metadata"] = Value::Object(m.clone());
                }
                target.work(Operation::Next, &n.state, body).await
            }
            Work::Count(c) => target.work(Operation::Count, &c.state, json!({})).await,
        };
        match result {
            Ok(v) => {
                print(g, &w, &v);
                exit::OK
            }
            Err(f) => output::failure(g, &f),
        }
    })
}

fn print(g: &Global, w: &Work, v: &Value) {
    if g.json {
        println!("{v}");
        return;
    }
    let s = |v: &Value, k: &str| v.get(k).map(|x| x.as_str().map_or_else(|| x.to_string(), str::to_string));
    match w {
        Work::Put(_) => {
            println!("{:?} is in state {}", s(v, "key").unwrap_or_default(), s(v, "state").unwrap_or_default())
        }
        Work::Next(_) => {
            for l in v.get("leases").and_then(Value::as_array).into_iter().flatten() {
                println!(
                    "{}  fence {}  attempts {}  lease_id {}",
                    s(l, "key").unwrap_or_default(),
                    s(l, "fence").unwrap_or_default(),
                    s(l, "attempts").unwrap_or_default(),
                    s(l, "lease_id").unwrap_or_default()
                );
            }
        }
        Work::Count(_) => {
            println!("{} keys in state {}", s(v, "count").unwrap_or_default(), s(v, "state").unwrap_or_default())
        }
    }
}
