//! Where lease commands go: a coordinator over the embedded store or DynamoDB, or a running
//! HTTP API. Both answer with the API's JSON, so `--json` output is the same everywhere.

use std::sync::Arc;

use leasehold::api::{self, AcquireRequest, HeartbeatRequest, Operation, ReleaseRequest};
use leasehold::env::StoreChoice;
use leasehold::store::table::Part;
use leasehold::store::Store;
use leasehold::Coordinator;
use serde_json::{json, Value};

use crate::client::{self, Endpoint};
pub use crate::output::Failure;
use crate::Global;

/// The store a command uses when it needs a coordinator: flags over environment over default.
/// `Ok(None)`: the HTTP API (`--url` or `LEASEHOLD_URL`), when `allow_url`.
pub fn choose(g: &Global, allow_url: bool) -> Result<Either, Failure> {
    let flags = [g.url.is_some(), g.table.is_some(), g.db.is_some()].iter().filter(|b| **b).count();
    if flags > 1 {
        return Err(Failure::usage("--url, --table and --db each name a different store: give at most one"));
    }
    let from_env = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let url = if flags == 0 { from_env("LEASEHOLD_URL") } else { g.url.clone() };
    if let Some(url) = url {
        if !allow_url {
            return Err(Failure::usage(
                "this command works on the embedded store (--db) or DynamoDB (--table), not over --url/LEASEHOLD_URL",
            ));
        }
        return Endpoint::parse(&url).map(Either::Http).map_err(Failure::usage);
    }
    Ok(Either::Store(match (&g.table, &g.db) {
        (Some(t), _) => StoreChoice::Dynamo { table: t.clone() },
        (None, Some(p)) => StoreChoice::Embedded { path: p.clone() },
        (None, None) => StoreChoice::resolve(None, None),
    }))
}

pub enum Either {
    Store(StoreChoice),
    Http(Endpoint),
}

/// Opens a coordinator on `choice` with the configuration from the environment; `uses`: the
/// parts of a DynamoDB table the command uses (see [`open_store`]).
pub async fn coordinator(
    g: &Global,
    choice: &StoreChoice,
    uses: &[Part],
) -> Result<(Coordinator, Arc<dyn Store>), Failure> {
    let config = leasehold::env::config_from_env().map_err(|e| Failure::usage(e.to_string()))?;
    let store = open_store(g, choice, uses, false).await?;
    Ok((Coordinator::new(store.clone(), config), store))
}

/// Opens the store of `choice`; a DynamoDB table is first checked for the parts of it the
/// command `uses` (`crate::table::check_before`: at most once an hour per table), so a missing
/// index fails here, not at the first batch. `all_warnings`: also log the warnings of parts no
/// command fails on (the stream: `serve`).
pub async fn open_store(
    g: &Global,
    choice: &StoreChoice,
    uses: &[Part],
    all_warnings: bool,
) -> Result<Arc<dyn Store>, Failure> {
    if let StoreChoice::Dynamo { table } = choice {
        let store = leasehold::store::DynamoStore::from_env(table.clone(), std::time::Duration::from_secs(3)).await;
        crate::table::check_before(g, &store, uses, all_warnings).await?;
        return Ok(Arc::new(store));
    }
    choice.open().await.map_err(|e| Failure::unreachable(format!("{}: {e}", choice.describe())))
}

pub enum Target {
    Local(Coordinator),
    Http(Endpoint),
}

impl Target {
    /// `uses`: the parts of a DynamoDB table the command uses ([`open_store`]).
    pub async fn open(g: &Global, allow_url: bool, uses: &[Part]) -> Result<Target, Failure> {
        match choose(g, allow_url)? {
            Either::Http(e) => Ok(Target::Http(e)),
            Either::Store(choice) => Ok(Target::Local(coordinator(g, &choice, uses).await?.0)),
        }
    }

    async fn op(&self, op: Operation, key: &str, body: Value) -> Result<Value, Failure> {
        match self {
            Target::Local(c) => Ok(api::run(c, op, Some(key), body, None).await?),
            Target::Http(e) => {
                // A key API Gateway would change on the way is refused before it is sent.
                leasehold::validate::key_travels(key)?;
                let (method, body) = match op {
                    Operation::Get => ("GET", None),
                    _ => ("POST", Some(body)),
                };
                http(e, method, &client::path(op, key), body, None).await
            }
        }
    }
    pub async fn acquire(&self, key: &str, req: AcquireRequest) -> Result<Value, Failure> {
        self.op(Operation::Acquire, key, serde_json::to_value(req).expect("serialises")).await
    }

    pub async fn heartbeat(&self, key: &str, req: HeartbeatRequest) -> Result<Value, Failure> {
        self.op(Operation::Heartbeat, key, serde_json::to_value(req).expect("serialises")).await
    }

    pub async fn release(&self, key: &str, req: ReleaseRequest) -> Result<Value, Failure> {
        self.op(Operation::Release, key, serde_json::to_value(req).expect("serialises")).await
    }

    pub async fn get(&self, key: &str) -> Result<Value, Failure> {
        self.op(Operation::Get, key, json!({})).await
    }

    pub async fn list(&self, prefix: &str, limit: usize) -> Result<Value, Failure> {
        match self {
            Target::Local(c) => Ok(json!({ "leases": c.list_prefix(prefix, limit).await? })),
            Target::Http(e) => {
                let mut path = format!("/leases?limit={limit}");
                if !prefix.is_empty() {
                    path.push_str(&format!("&prefix={}", client::encode_query(prefix)));
                }
                http(e, "GET", &path, None, Some("list")).await
            }
        }
    }

    /// A work operation (`next`, `put`, `count`) on `param` (a state, or a key for put).
    pub async fn work(&self, op: Operation, param: &str, body: Value) -> Result<Value, Failure> {
        self.op(op, param, body).await
    }

    /// The keys in work state `state` (embedded store or DynamoDB only).
    pub async fn list_state(&self, state: &str, limit: usize) -> Result<Value, Failure> {
        match self {
            Target::Local(c) => Ok(json!({ "leases": c.list_in_state(state, limit).await? })),
            Target::Http(_) => Err(not_over_http("list --state")),
        }
    }

    /// `fence`: one holder of a semaphore (DESIGN.md, "Semaphores"), on a local target.
    pub async fn force_release(&self, key: &str, fence: Option<u64>) -> Result<Value, Failure> {
        match (self, fence) {
            (Target::Local(c), Some(f)) => {
                Ok(serde_json::to_value(c.force_release_slot(key, f).await?).expect("serialises"))
            }
            (Target::Local(c), None) => Ok(serde_json::to_value(c.force_release(key).await?).expect("serialises")),
            (Target::Http(e), fence) => {
                leasehold::validate::key_travels(key)?;
                let path = format!("/leases/force-release/{}", client::encode_key(key));
                let body = fence.map_or_else(|| json!({}), |f| json!({ "fence": f }));
                http(e, "POST", &path, Some(body), Some("force-release")).await
            }
        }
    }
}

/// One request to the HTTP API: the answer's JSON, or its error as a [`Failure`].
/// `operator`: the command, for the routes only `leasehold serve` has (an API without them,
/// such as the AWS deployment, answers 404 without an error of ours).
pub(crate) async fn http(
    e: &Endpoint,
    method: &str,
    path: &str,
    body: Option<Value>,
    operator: Option<&str>,
) -> Result<Value, Failure> {
    let mut conn = e.connect().await.map_err(Failure::unreachable)?;
    let body = body.map(|b| serde_json::to_vec(&b).expect("request serialises"));
    let (status, answer) = conn.request(method, path, body).await.map_err(Failure::unreachable)?;
    let json: Option<Value> = serde_json::from_slice(&answer).ok();
    match (status, json) {
        (200, Some(v)) => Ok(v),
        (_, Some(v)) if v.get("error").is_some_and(Value::is_string) => Err(Failure::from_json(v)),
        (404, _) if operator.is_some() => Err(not_over_http(operator.unwrap_or_default())),
        (s, _) => Err(Failure::unreachable(format!(
            "{} answered HTTP {s}: {}",
            e.url(),
            String::from_utf8_lossy(&answer[..answer.len().min(200)])
        ))),
    }
}

fn not_over_http(cmd: &str) -> Failure {
    Failure::usage(format!(
        "{cmd} is not supported by this HTTP API (only `leasehold serve` has the route): use --db or --table on the store it uses"
    ))
}
