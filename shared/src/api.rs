//! The request/response vocabulary shared by every interface (direct invoke, HTTP, CLI
//! `--json`), the direct-invoke dispatcher and the framework-neutral HTTP router. The Lambda
//! functions and the local server are thin adapters over [`run`] and [`handle_http`].

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::error::{Error, ErrorName, Result};
use crate::model::Keepalive;
use crate::protocol::{AcquireOptions, Coordinator};
use crate::validate;

pub mod batch;

/// Body of an acquire (direct invoke, `POST /leases/acquire/{key}`, CLI).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AcquireRequest {
    /// Required for direct invoke; over HTTP the key comes from the path (a body key must match).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    pub holder: String,
    /// Lease duration; the configured default when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// A lease without expiry, freed only by release or force-release.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fail_closed: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_hold_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Map<String, Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keepalive: Option<Keepalive>,
    /// Caller-chosen secret (22..=128 of `[A-Za-z0-9_-]`) that makes a retried acquire return
    /// the lease its lost first attempt took. Generated (128 random bits) when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_id: Option<String>,
    /// A queued acquire (DESIGN.md, "The waiter queue"): the Step Functions task token
    /// (`$$.Task.Token` of a `.waitForTaskToken` task) the lease is delivered to, now if the
    /// key is free, else when the waiter's turn comes. The answer is then `{"key", "queued",
    /// "position"}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_token: Option<String>,
    /// With `task_token`: the task's own timeout (`TimeoutSeconds`) in ms; a waiter still
    /// queued after it is passed over without a delivery attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_timeout_ms: Option<u64>,
    /// A semaphore of this many slots (DESIGN.md, "Semaphores"): 1..=640; 1 or absent is a
    /// plain lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots: Option<u32>,
}

/// Body of a heartbeat.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeartbeatRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    pub lease_id: String,
    /// New duration from now; the lease's own duration when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
}

/// Body of a release.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    pub lease_id: String,
    /// Move the key into this work state in the same write (the live holder only); absent:
    /// the key keeps its state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
}

/// Body of a get (direct invoke only; HTTP uses `GET /leases/{key}`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct GetRequest {
    pub key: String,
    /// A queued acquire's lease_id: the answer then also carries its `queue_position` (1:
    /// next; absent when it is not queued).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_id: Option<String>,
}

/// The operations reachable by direct invoke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Acquire,
    Heartbeat,
    Release,
    Get,
    /// Batch lease of the free keys of a work state (acquire function).
    Next,
    /// Put a key into a work state (acquire function).
    Put,
    /// Count the keys in a work state (heartbeat function).
    Count,
}

impl Operation {
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Acquire => "acquire",
            Operation::Heartbeat => "heartbeat",
            Operation::Release => "release",
            Operation::Get => "get",
            Operation::Next => "next",
            Operation::Put => "put",
            Operation::Count => "count",
        }
    }
}

/// How much of a Lambda invocation's remaining time an acquire may spend waiting: the rest is
/// kept to answer `LeaseHeld` before the function times out.
pub const INVOKE_SAFETY_MARGIN: Duration = Duration::from_millis(1500);

/// When an operation of an invocation with `remaining` time must be done: the final attempt
/// of an acquire (and its retries) ends with half the safety margin to spare, in which the
/// answer is written.
pub(crate) fn invoke_deadline(received: std::time::Instant, remaining: Option<Duration>) -> Option<std::time::Instant> {
    remaining.map(|r| received + r.saturating_sub(INVOKE_SAFETY_MARGIN / 2))
}

/// Parses a JSON payload, turning every serde complaint into a clear `InvalidRequest`.
pub(crate) fn parse<T: serde::de::DeserializeOwned>(payload: Value) -> Result<T> {
    if !payload.is_object() {
        return Err(Error::invalid(format!("the request must be a JSON object, not {}", kind(&payload))));
    }
    serde_json::from_value(payload).map_err(|e| Error::invalid(format!("invalid request: {e}")))
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

/// The key of a request: from the path (HTTP) or the body (direct invoke).
fn pick_key(path_key: Option<&str>, body_key: Option<String>) -> Result<String> {
    match (path_key, body_key) {
        (Some(p), Some(b)) if p != b => {
            Err(Error::invalid(format!("the key in the body ({b:?}) differs from the key in the path ({p:?})")))
        }
        (Some(p), _) => Ok(p.to_string()),
        (None, Some(b)) => Ok(b),
        (None, None) => Err(Error::invalid("missing field `key`")),
    }
}

/// Runs one operation. `remaining`: time left before the caller gives up (the Lambda
/// deadline); an acquire's wait is cut to fit inside it with [`INVOKE_SAFETY_MARGIN`] to spare.
pub async fn run(
    coord: &Coordinator,
    op: Operation,
    path_key: Option<&str>,
    payload: Value,
    remaining: Option<Duration>,
) -> Result<Value> {
    // Remote callers count `safe_for_ms` from their own send time, which is before this.
    let received = coord.monotonic();
    if matches!(op, Operation::Next | Operation::Put | Operation::Count) {
        return batch::run(coord, op, path_key, payload, remaining, received).await;
    }
    match op {
        Operation::Acquire => {
            let mut payload = payload;
            fill_keepalive_until(&mut payload, coord.now_ms());
            let r: AcquireRequest = parse(payload)?;
            let key = pick_key(path_key, r.key.clone())?;
            let duration = match (r.fail_closed, r.duration_ms) {
                (true, Some(_)) => return Err(Error::invalid("fail_closed leases take no duration_ms")),
                (true, None) => None,
                (false, d) => Some(d.map(ms).unwrap_or(coord.config().default_duration)),
            };
            if let Some(token) = r.task_token.as_deref() {
                return queued_acquire(coord, &key, r.holder.as_str(), duration, &r, token, received).await;
            }
            let mut wait = r.wait_ms.map(ms);
            if let (Some(w), Some(rem)) = (wait, remaining) {
                coord.config().limits.wait(w)?;
                wait = Some(w.min(rem.saturating_sub(INVOKE_SAFETY_MARGIN)));
            }
            let opts = AcquireOptions {
                wait,
                min_hold: r.min_hold_ms.map(ms),
                metadata: r.metadata,
                keepalive: r.keepalive,
                lease_id: r.lease_id.as_deref().map(validate::lease_id).transpose()?,
                deadline: invoke_deadline(received, remaining),
                slots: r.slots,
            };
            let lease = coord.acquire(&key, &r.holder, duration, opts).await?.with_safe_for(received);
            Ok(serde_json::to_value(lease).expect("lease serialises"))
        }
        Operation::Heartbeat => {
            let r: HeartbeatRequest = parse(payload)?;
            let key = pick_key(path_key, r.key)?;
            let id = validate::lease_id(&r.lease_id)?;
            let lease = coord.heartbeat(&key, &id, r.duration_ms.map(ms)).await?.with_safe_for(received);
            Ok(serde_json::to_value(lease).expect("lease serialises"))
        }
        Operation::Release => {
            let r: ReleaseRequest = parse(payload)?;
            let key = pick_key(path_key, r.key)?;
            let id = validate::lease_id(&r.lease_id)?;
            let released = coord.release_to(&key, &id, r.state.as_deref()).await?;
            Ok(serde_json::to_value(released).expect("release serialises"))
        }
        Operation::Get => {
            let (key, lease_id) = match path_key {
                Some(k) => (k.to_string(), None),
                None => {
                    let r = parse::<GetRequest>(payload)?;
                    (r.key, r.lease_id.as_deref().map(validate::lease_id).transpose()?)
                }
            };
            let state = coord.get(&key).await?;
            let mut v = serde_json::to_value(state).expect("state serialises");
            if let Some(id) = lease_id {
                // Reads the waiter items in order: bounded by the queue's first 1,000.
                if let Some(p) = coord.queue_position(&key, &id, 1000).await? {
                    v["queue_position"] = json!(p);
                }
            }
            Ok(v)
        }
        Operation::Next | Operation::Put | Operation::Count => unreachable!("handled above"),
    }
}

/// How long a keep-alive lease bound to an execution is kept alive when the request names no
/// `keepalive.until_ms`: 365 days, the longest a standard Step Functions execution runs. The
/// sweep renews it while the execution runs and releases it once the execution has ended.
pub const KEEPALIVE_RUN_HORIZON_MS: u64 = 365 * 24 * 3600 * 1000;

/// A `keepalive` naming an `execution_arn` but no `until_ms` lasts as long as the execution:
/// `until_ms` becomes now + [`KEEPALIVE_RUN_HORIZON_MS`] (a state machine cannot compute an
/// epoch time). Anything else is left for the parser to judge.
fn fill_keepalive_until(payload: &mut Value, now_ms: u64) {
    if let Some(ka) = payload.get_mut("keepalive").and_then(Value::as_object_mut) {
        if ka.get("execution_arn").is_some_and(Value::is_string) && !ka.contains_key("until_ms") {
            ka.insert("until_ms".into(), json!(now_ms.saturating_add(KEEPALIVE_RUN_HORIZON_MS)));
        }
    }
}

/// Fields only a direct invoke may send (DESIGN.md, "Interfaces over the protocol"): a
/// `task_token` makes the function complete a Step Functions task with the function's own
/// permission (SendTaskSuccess on any task), and a `keepalive.execution_arn` binds a lease to
/// an execution the function's role describes. Over HTTP, any caller allowed to call the API
/// could use them to complete or hold on behalf of executions it does not own: refused.
pub(crate) fn refuse_invoke_only_fields(op: Operation, payload: &Value) -> Result<()> {
    if !matches!(op, Operation::Acquire | Operation::Next) {
        return Ok(());
    }
    if payload.get("task_token").is_some() {
        return Err(Error::invalid(
            "task_token is accepted on direct invoke only (a Step Functions task invokes the acquire function), not over HTTP",
        ));
    }
    if payload.get("keepalive").and_then(|k| k.get("execution_arn")).is_some() {
        return Err(Error::invalid(
            "keepalive.execution_arn is accepted on direct invoke only (a Step Functions task invokes the acquire function), not over HTTP",
        ));
    }
    Ok(())
}

/// A queued acquire: granted and delivered now, or queued. Either way the lease reaches the
/// task through its token; the function's own answer is for logs and direct callers.
async fn queued_acquire(
    coord: &Coordinator,
    key: &str,
    holder: &str,
    duration: Option<Duration>,
    r: &AcquireRequest,
    token: &str,
    received: std::time::Instant,
) -> Result<Value> {
    let Some(duration) = duration else {
        return Err(Error::invalid("a queued acquire (task_token) takes a duration, not fail_closed"));
    };
    if r.slots.unwrap_or(1) >= 2 {
        return Err(Error::invalid("slots: a queued acquire (task_token) of a semaphore is not supported yet"));
    }
    if r.wait_ms.is_some() || r.min_hold_ms.is_some() {
        return Err(Error::invalid("a queued acquire (task_token) takes neither wait_ms nor min_hold_ms"));
    }
    let opts = AcquireOptions {
        metadata: r.metadata.clone(),
        keepalive: r.keepalive.clone(),
        lease_id: r.lease_id.as_deref().map(validate::lease_id).transpose()?,
        ..Default::default()
    };
    // Counted from the request's arrival on the monotonic clock; dated by the clock the waiter
    // item is written with, checked right before it (DESIGN.md, "The waiter queue").
    let since = coord.monotonic().saturating_duration_since(received);
    let task_timeout = r.task_timeout_ms.map(|t| Duration::from_millis(t).saturating_sub(since));
    match coord.acquire_or_enqueue(key, holder, duration, opts, token, task_timeout).await? {
        crate::queue::Enqueued::Granted(lease) => {
            let mut v = serde_json::to_value(lease.with_safe_for(received)).expect("lease serialises");
            v["queued"] = json!(false);
            Ok(v)
        }
        crate::queue::Enqueued::Queued { position, .. } => {
            Ok(json!({"key": key, "queued": true, "position": position}))
        }
    }
}

/// A framework-neutral HTTP request: what API Gateway and the local server both provide.
#[derive(Debug, Clone)]
pub struct HttpRequest {
    pub method: String,
    /// The path without the query string, percent-decoded exactly once: API Gateway's
    /// `rawPath` as it arrives (API Gateway decodes before it matches a route), or the request
    /// path `leasehold serve` decoded. Never decoded again.
    pub path: String,
    /// The key API Gateway matched (`pathParameters.key`), which wins over the key in `path`.
    pub key: Option<String>,
    pub body: Vec<u8>,
}

impl HttpRequest {
    /// A request whose path is still percent-encoded, as it arrives at an HTTP server: the
    /// query string is dropped and the path decoded once. A path that is not UTF-8 once
    /// decoded is answered with `InvalidRequest`.
    pub fn from_raw(method: &str, raw_path: &str, body: Vec<u8>) -> std::result::Result<HttpRequest, HttpResponse> {
        let path = raw_path.split('?').next().unwrap_or("");
        let path = percent_encoding::percent_decode_str(path).decode_utf8().map_err(|_| {
            route_error(400, ErrorName::InvalidRequest, "the path is not valid UTF-8 once percent-decoded".into())
        })?;
        Ok(HttpRequest { method: method.to_string(), path: path.into_owned(), key: None, body })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
    /// The error this response answers with (`None`: a success): what adapters count and log,
    /// without reading the body back.
    pub error: Option<ErrorName>,
}

impl HttpResponse {
    pub(crate) fn json(status: u16, body: &Value) -> Self {
        HttpResponse {
            status,
            headers: vec![("content-type".into(), "application/json".into())],
            body: body.to_string(),
            error: None,
        }
    }

    pub fn with_status(mut self, status: u16) -> Self {
        self.status = status;
        self
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// The response for an error: status, `Retry-After` where retrying makes sense, JSON body.
    pub fn error(e: &Error, now_ms: u64) -> Self {
        let mut r = HttpResponse::json(http_status(e), &e.to_json());
        r.error = Some(e.error_name());
        let retry_after = match e {
            Error::LeaseHeld { expires_at_ms: Some(exp), .. } => Some(exp.saturating_sub(now_ms).div_ceil(1000).max(1)),
            Error::LeaseHeld { expires_at_ms: None, .. } => Some(1),
            Error::StoreUnavailable(_) | Error::Throttled(_) | Error::OutcomeUnknown { .. } => Some(1),
            // It lasts until the clock is fixed: not a hot retry loop.
            Error::ClockSkew(_) => e.retry_after().map(|d| d.as_secs().max(1)),
            _ => None,
        };
        if let Some(s) = retry_after {
            r.headers.push(("retry-after".into(), s.to_string()));
        }
        r
    }
}

/// HTTP status of each error: 400 invalid, 404 unknown lease, 409 held or wrong lease_id,
/// 410 lease lost (expired, released, swept), 500 refused by the store (sending it again gets
/// the same answer), 503 store unavailable or throttled.
pub(crate) fn http_status(e: &Error) -> u16 {
    match e {
        Error::InvalidRequest(_) => 400,
        Error::NotFound { .. } => 404,
        Error::LeaseHeld { .. } => 409,
        Error::NotHolder { reason, .. } => {
            if reason.is_lost() {
                410
            } else {
                409
            }
        }
        Error::StoreRefused(_) => 500,
        Error::StoreUnavailable(_) | Error::Throttled(_) | Error::OutcomeUnknown { .. } | Error::ClockSkew(_) => 503,
    }
}

/// Largest request body accepted over HTTP.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// A route of the HTTP API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    Op(Operation, String),
    OpenApi,
    Health,
}

/// An error of the router itself (`UnknownRoute`, `MethodNotAllowed`, ...).
pub(crate) fn route_error(status: u16, name: ErrorName, message: String) -> HttpResponse {
    let mut r = HttpResponse::json(status, &json!({ "error": name.as_str(), "message": message }));
    r.error = Some(name);
    r
}

/// 405 with the `Allow` header naming the method that route takes (RFC 9110).
pub fn method_not_allowed(allow: &str, message: String) -> HttpResponse {
    let mut r = route_error(405, ErrorName::MethodNotAllowed, message);
    r.headers.push(("allow".into(), allow.into()));
    r
}

/// The routes of the HTTP API, the same in API Gateway (template.yaml) and `leasehold serve`.
/// The key is the greedy last part of the path, so it may contain `/`.
pub const ROUTES: [(&str, &str, Operation); 7] = [
    ("POST", "/leases/acquire/{key+}", Operation::Acquire),
    ("POST", "/leases/heartbeat/{key+}", Operation::Heartbeat),
    ("POST", "/leases/release/{key+}", Operation::Release),
    ("GET", "/leases/{key+}", Operation::Get),
    ("POST", "/leases/next/{state}", Operation::Next),
    ("POST", "/leases/put/{key+}", Operation::Put),
    ("POST", "/leases/count/{state}", Operation::Count),
];

/// Maps method + decoded path ([`HttpRequest::path`]) to a route: `POST
/// /leases/{acquire|heartbeat|release}/{key+}` and `GET /leases/{key+}`, where the key is
/// everything after the prefix, `/` included. A path prefix before `/leases/` (an API
/// Gateway stage) is ignored.
pub fn route(method: &str, path: &str) -> std::result::Result<Route, HttpResponse> {
    if path == "/openapi.json" {
        return if method == "GET" {
            Ok(Route::OpenApi)
        } else {
            Err(method_not_allowed("GET", format!("{method} is not allowed on {path}")))
        };
    }
    if path == "/health" && method == "GET" {
        return Ok(Route::Health);
    }
    let Some(rest) = path.find("/leases/").map(|i| &path[i + "/leases/".len()..]) else {
        return Err(route_error(404, ErrorName::UnknownRoute, format!("no route for {method} {path}")));
    };
    if method == "GET" {
        return Ok(Route::Op(Operation::Get, rest.to_string()));
    }
    let (action, key) = rest.split_once('/').unwrap_or((rest, ""));
    let op = match action {
        "acquire" => Operation::Acquire,
        "heartbeat" => Operation::Heartbeat,
        "release" => Operation::Release,
        a => match batch::operation_of(a) {
            Some(op) => op,
            None => return Err(method_not_allowed("GET", format!("use GET for /leases/{{key}}, not {method}"))),
        },
    };
    if method != "POST" {
        return Err(method_not_allowed("POST", format!("use POST for /leases/{action}/{{key}}, not {method}")));
    }
    Ok(Route::Op(op, key.to_string()))
}

/// Routes only `leasehold serve` answers: the operator page, the listing and force-release.
/// They are not deployed on the AWS HTTP API (DESIGN.md, "Interfaces over the protocol", the
/// operator page and routes): an operator lists and force-releases a deployment's table with
/// `leasehold --table NAME`.
pub const SERVE_ROUTES: [(&str, &str); 3] =
    [("GET", "/"), ("GET", "/leases"), ("POST", "/leases/force-release/{key+}")];

/// Most keys one `GET /leases` returns (and its default `limit`).
pub(crate) const MAX_LIST_LIMIT: usize = 1000;

/// The query of `GET /leases`: `prefix` (keys starting with it) and `limit` (1..=1000).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ListQuery {
    pub prefix: String,
    pub limit: usize,
}

impl ListQuery {
    /// Parses a raw (still percent-encoded) query string; `+` is a space, as in a form.
    /// Unknown or repeated parameters and a bad limit are `InvalidRequest`.
    pub(crate) fn parse(query: &str) -> Result<ListQuery> {
        let (mut prefix, mut limit) = (None, None);
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = percent_encoding::percent_decode_str(&value.replace('+', " "))
                .decode_utf8()
                .map_err(|_| Error::invalid(format!("the query parameter {name:?} is not valid UTF-8 once decoded")))?
                .into_owned();
            let slot = match name {
                "prefix" => &mut prefix,
                "limit" => &mut limit,
                _ => return Err(Error::invalid(format!("unknown query parameter {name:?}: use prefix and limit"))),
            };
            if slot.replace(value).is_some() {
                return Err(Error::invalid(format!("the query parameter {name:?} is given twice")));
            }
        }
        let limit = match limit {
            None => MAX_LIST_LIMIT,
            Some(l) => match l.parse::<usize>() {
                Ok(n) if (1..=MAX_LIST_LIMIT).contains(&n) => n,
                _ => {
                    return Err(Error::invalid(format!("limit must be an integer in 1..={MAX_LIST_LIMIT}, not {l:?}")))
                }
            },
        };
        Ok(ListQuery { prefix: prefix.unwrap_or_default(), limit })
    }
}

/// Answers the operator routes of `leasehold serve` other than the page (`GET /leases`,
/// `POST /leases/force-release/{key+}`); `None` for every other request. `raw_query`: the
/// query string as it arrived (still percent-encoded), without the `?`.
pub async fn handle_operator(coord: &Coordinator, req: &HttpRequest, raw_query: &str) -> Option<HttpResponse> {
    let result = if req.path == "/leases" {
        if req.method != "GET" {
            return Some(method_not_allowed("GET", format!("use GET for /leases, not {}", req.method)));
        }
        match ListQuery::parse(raw_query) {
            Ok(q) => coord.list_prefix(&q.prefix, q.limit).await.map(|l| json!({ "leases": l })),
            Err(e) => Err(e),
        }
    } else if let Some(key) = req.path.strip_prefix("/leases/force-release/") {
        match req.method.as_str() {
            "POST" => {}
            // GET /leases/force-release/x reads the key "force-release/x".
            "GET" => return None,
            m => {
                return Some(method_not_allowed("POST", format!("use POST for /leases/force-release/{{key}}, not {m}")))
            }
        }
        let fence = match force_release_fence(&req.body) {
            Ok(f) => f,
            Err(e) => return Some(HttpResponse::error(&e, coord.now_ms())),
        };
        match fence {
            // One holder of a semaphore, named by its fence.
            Some(f) => coord.force_release_slot(key, f).await,
            None => coord.force_release(key).await,
        }
        .map(|s| serde_json::to_value(s).expect("state serialises"))
    } else {
        return None;
    };
    Some(match result {
        Ok(v) => HttpResponse::json(200, &v),
        Err(e) => HttpResponse::error(&e, coord.now_ms()),
    })
}

/// The body of a force-release: none, `{}`, or `{"fence": F}` (one holder of a semaphore).
fn force_release_fence(body: &[u8]) -> Result<Option<u64>> {
    if body.is_empty() {
        return Ok(None);
    }
    let v: Value =
        serde_json::from_slice(body).map_err(|e| Error::invalid(format!("the body is not valid JSON: {e}")))?;
    let fields = || Error::invalid("force-release takes at most a fence: send {}, {\"fence\": F} or no body");
    let obj = v.as_object().ok_or_else(fields)?;
    if obj.keys().any(|k| k != "fence") {
        return Err(fields());
    }
    match obj.get("fence") {
        None => Ok(None),
        Some(f) => f.as_u64().map(Some).ok_or_else(|| Error::invalid("fence must be a non-negative integer")),
    }
}

/// The OpenAPI 3 description of the HTTP API (committed as shared/openapi.json).
pub(crate) const OPENAPI_JSON: &str = include_str!("../openapi.json");

/// Handles one HTTP request. Never panics on input, and every failure is a typed JSON error;
/// 500 only for `StoreRefused` (a request the store will never accept: a missing table, no
/// permission), never for any input.
pub async fn handle_http(coord: &Coordinator, req: HttpRequest, remaining: Option<Duration>) -> HttpResponse {
    match route(&req.method, &req.path) {
        Ok(r) => handle_route(coord, r, req, remaining).await,
        Err(resp) => resp,
    }
}

/// [`handle_http`] for a request already routed (by [`route`]).
pub(crate) async fn handle_route(
    coord: &Coordinator,
    route: Route,
    req: HttpRequest,
    remaining: Option<Duration>,
) -> HttpResponse {
    let (op, key) = match route {
        Route::OpenApi => {
            return HttpResponse {
                status: 200,
                headers: vec![("content-type".into(), "application/json".into())],
                body: OPENAPI_JSON.to_string(),
                error: None,
            }
        }
        Route::Health => return HttpResponse::json(200, &json!({"status": "ok", "store": coord.store().name()})),
        Route::Op(op, key) => (op, req.key.clone().unwrap_or(key)),
    };
    if req.body.len() > MAX_BODY_BYTES {
        return HttpResponse::error(
            &Error::invalid(format!("the body is {} bytes; the limit is {MAX_BODY_BYTES}", req.body.len())),
            coord.now_ms(),
        )
        .with_status(413);
    }
    // A count needs no body.
    let payload = if op == Operation::Get || (op == Operation::Count && req.body.is_empty()) {
        Value::Object(Map::new())
    } else {
        match serde_json::from_slice::<Value>(&req.body) {
            Ok(v) => v,
            Err(e) => {
                return HttpResponse::error(&Error::invalid(format!("the body is not valid JSON: {e}")), coord.now_ms())
            }
        }
    };
    if let Err(e) = refuse_invoke_only_fields(op, &payload) {
        return HttpResponse::error(&e, coord.now_ms());
    }
    match run(coord, op, Some(&key), payload, remaining).await {
        Ok(v) => HttpResponse::json(200, &v),
        Err(e) => HttpResponse::error(&e, coord.now_ms()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error names the OpenAPI document lists are exactly the names adapters map from.
    #[test]
    fn openapi_lists_every_error_name() {
        let doc: Value = serde_json::from_str(OPENAPI_JSON).unwrap();
        let listed: Vec<&str> = doc["components"]["schemas"]["Error"]["properties"]["error"]["enum"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        let mut named: Vec<&str> = ErrorName::ALL.iter().map(|n| n.as_str()).collect();
        let mut listed_sorted = listed.clone();
        listed_sorted.sort_unstable();
        named.sort_unstable();
        assert_eq!(listed_sorted, named);
        for n in ErrorName::ALL {
            assert_eq!(ErrorName::parse(n.as_str()), Some(n));
        }
    }

    /// `slots` in the acquire body (direct invoke; HTTP has the same router): N holders, the
    /// next refused with when a slot frees; bad `slots` and a queued semaphore acquire refused.
    #[tokio::test]
    async fn slots_in_the_acquire_body() {
        let dir = std::env::temp_dir().join(format!("leasehold-api-slots-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let store = std::sync::Arc::new(crate::store::SqliteStore::open(dir.join("leases.db")).unwrap());
        let coord = Coordinator::new(store, crate::Config::default());
        let body =
            |h: &str, slots: Value| json!({"key": "api/sem", "holder": h, "duration_ms": 30_000, "slots": slots});
        let a = run(&coord, Operation::Acquire, None, body("a", json!(2)), None).await.unwrap();
        let b = run(&coord, Operation::Acquire, None, body("b", json!(2)), None).await.unwrap();
        assert_eq!((a["slots"].as_u64(), b["slots"].as_u64()), (Some(2), Some(2)));
        assert!(b["fence"].as_u64() > a["fence"].as_u64());
        assert!(b["safe_for_ms"].as_u64().is_some());
        let held = run(&coord, Operation::Acquire, None, body("c", json!(2)), None).await.unwrap_err();
        assert!(matches!(held, Error::LeaseHeld { expires_at_ms, .. } if expires_at_ms == a["expires_at_ms"].as_u64()));
        let got = run(&coord, Operation::Get, Some("api/sem"), json!({}), None).await.unwrap();
        assert_eq!(got["holders"].as_array().unwrap().len(), 2);
        for bad in [json!(0), json!(1001), json!(-1), json!("2")] {
            let e = run(&coord, Operation::Acquire, None, body("d", bad.clone()), None).await.unwrap_err();
            assert!(matches!(e, Error::InvalidRequest(_)), "{bad}: {e:?}");
        }
        let mut queued = body("q", json!(2));
        queued["task_token"] = json!("token");
        let e = run(&coord, Operation::Acquire, None, queued, None).await.unwrap_err();
        assert!(matches!(e, Error::InvalidRequest(ref m) if m.contains("slots")), "{e:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn op(method: &str, path: &str) -> (Operation, String) {
        match route(method, path) {
            Ok(Route::Op(op, key)) => (op, key),
            other => panic!("{method} {path}: {other:?}"),
        }
    }

    #[test]
    fn the_key_is_the_rest_of_the_path() {
        assert_eq!(op("POST", "/leases/acquire/orders/42"), (Operation::Acquire, "orders/42".into()));
        assert_eq!(op("POST", "/leases/heartbeat/a b/c"), (Operation::Heartbeat, "a b/c".into()));
        assert_eq!(op("POST", "/leases/release/x"), (Operation::Release, "x".into()));
        assert_eq!(op("GET", "/leases/jobs/nightly"), (Operation::Get, "jobs/nightly".into()));
        // GET is only ever a read: this is the key "acquire/x".
        assert_eq!(op("GET", "/leases/acquire/x"), (Operation::Get, "acquire/x".into()));
        // An API Gateway stage before /leases/.
        assert_eq!(op("POST", "/prod/leases/acquire/k"), (Operation::Acquire, "k".into()));
        // Never decoded here: the path arrives decoded once.
        assert_eq!(op("POST", "/leases/acquire/a%41"), (Operation::Acquire, "a%41".into()));
        for (method, path, allow) in
            [("PUT", "/leases/acquire/k", "POST"), ("POST", "/leases/k", "GET"), ("DELETE", "/leases/k", "GET")]
        {
            let r = route(method, path).unwrap_err();
            assert_eq!((r.status, r.header("allow")), (405, Some(allow)), "{method} {path}");
        }
        assert_eq!(route("GET", "/nothing").unwrap_err().status, 404);
    }

    #[test]
    fn invoke_only_fields_are_refused_over_http_and_keepalive_binds_to_the_execution() {
        let ka = json!({"holder": "h", "keepalive": {"execution_arn": "arn:aws:states:r:1:execution:m:e"}});
        for op in [Operation::Acquire, Operation::Next] {
            assert!(refuse_invoke_only_fields(op, &json!({"holder": "h", "task_token": "t"})).is_err());
            assert!(refuse_invoke_only_fields(op, &ka).is_err());
            assert!(refuse_invoke_only_fields(op, &json!({"holder": "h", "keepalive": {"until_ms": 5}})).is_ok());
        }
        assert!(refuse_invoke_only_fields(Operation::Release, &json!({"task_token": "t"})).is_ok());
        let mut p = ka.clone();
        fill_keepalive_until(&mut p, 1_000);
        assert_eq!(p["keepalive"]["until_ms"], json!(1_000 + KEEPALIVE_RUN_HORIZON_MS));
        // A given until_ms is kept; without an execution nothing is filled in.
        let mut p = json!({"keepalive": {"execution_arn": "arn:x", "until_ms": 7}});
        fill_keepalive_until(&mut p, 1_000);
        assert_eq!(p["keepalive"]["until_ms"], 7);
        let mut p = json!({"keepalive": {}});
        fill_keepalive_until(&mut p, 1_000);
        assert!(p["keepalive"].get("until_ms").is_none());
    }

    #[test]
    fn list_queries() {
        assert_eq!(ListQuery::parse("").unwrap(), ListQuery { prefix: String::new(), limit: MAX_LIST_LIMIT });
        assert_eq!(
            ListQuery::parse("prefix=jobs%2Fa+b&limit=5").unwrap(),
            ListQuery { prefix: "jobs/a b".into(), limit: 5 }
        );
        for bad in ["limit=0", "limit=1001", "limit=x", "limit=", "other=1", "prefix=a&prefix=b", "prefix=%FF"] {
            assert!(matches!(ListQuery::parse(bad), Err(Error::InvalidRequest(_))), "{bad}");
        }
    }

    #[test]
    fn a_raw_path_is_decoded_once_without_its_query() {
        let r = HttpRequest::from_raw("POST", "/leases/acquire/a%2Fb%2541?x=%2F", vec![]).unwrap();
        assert_eq!(r.path, "/leases/acquire/a/b%41");
        assert_eq!(HttpRequest::from_raw("GET", "/leases/%FF", vec![]).unwrap_err().status, 400);
    }
}
