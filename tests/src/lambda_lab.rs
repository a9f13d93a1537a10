//! The Lambda lab of the end-to-end tests (tests/tests/lambda_e2e.rs): the real Lambda runtime
//! emulator (`cargo lambda watch`) serving the acquire/heartbeat/release binaries over a
//! DynamoDB Local table, the test's own coordinator on that table, and the interpreter of
//! events/expected.json (what each event file answers, case by case).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold::store::{Condition, DynamoStore, ScanKind, Store};
use leasehold::{AcquireOptions, Coordinator, LeaseId, LeaseState, Record};
use serde_json::{json, Map, Value};

use crate::emulator::{Emulator, Invocation};
use crate::{dynamo_local, free_port, repo_root, test_config};

/// The first invoke of a function compiles it (debug) inside the emulator; the shared target
/// directory may be locked by other builds for a while.
pub const INVOKE_TIMEOUT: Duration = Duration::from_secs(900);
pub const PLACEHOLDER: &str = "REPLACE_WITH_LEASE_ID";
pub const FUNCTIONS: [&str; 3] = ["acquire", "heartbeat", "release"];

pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

/// One emulator serving the three functions over one table, and the test's own coordinator on
/// the same table (to set up leases and look at the items).
pub struct Lab {
    pub emu: Emulator,
    pub store: DynamoStore,
    pub coord: Coordinator,
    /// Functions invoked so far (each one instance at the emulator's default concurrency).
    pub invoked: std::sync::Mutex<BTreeSet<String>>,
}

impl Lab {
    pub async fn start(extra_env: &[(&str, String)], args: &[&str]) -> Lab {
        let local = tokio::task::spawn_blocking(dynamo_local).await.expect("DynamoDB Local");
        let store = local.store().await;
        Lab::start_on(store, extra_env, args).await
    }

    /// An emulator over an existing table.
    pub async fn start_on(store: DynamoStore, extra_env: &[(&str, String)], args: &[&str]) -> Lab {
        let local = tokio::task::spawn_blocking(dynamo_local).await.expect("DynamoDB Local");
        let mut env: Vec<(String, String)> = vec![
            ("LEASEHOLD_TABLE".into(), store.table().to_string()),
            ("AWS_ENDPOINT_URL_DYNAMODB".into(), local.endpoint.clone()),
            ("AWS_ACCESS_KEY_ID".into(), "test".into()),
            ("AWS_SECRET_ACCESS_KEY".into(), "test".into()),
            ("AWS_REGION".into(), "us-east-1".into()),
            ("AWS_DEFAULT_REGION".into(), "us-east-1".into()),
            ("AWS_EC2_METADATA_DISABLED".into(), "true".into()),
            // No network: Step Functions calls go to a closed local port unless a test passes
            // moto's endpoint.
            ("AWS_ENDPOINT_URL_SFN".into(), format!("http://127.0.0.1:{}", free_port())),
            ("LEASEHOLD_MIN_DURATION_MS".into(), "100".into()),
            ("LEASEHOLD_SKEW_MARGIN_MS".into(), "50".into()),
        ];
        for (k, v) in extra_env {
            env.retain(|(name, _)| name != k);
            env.push((k.to_string(), v.clone()));
        }
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let emu = tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            Emulator::start_with(free_port(), &env, &args)
        })
        .await
        .expect("emulator");
        let coord = Coordinator::new(Arc::new(store.clone()), test_config());
        let lab = Lab { emu, store, coord, invoked: Default::default() };
        // Start (and if needed compile) the three functions before any timing matters.
        let warm = |f: &'static str| {
            let lab = &lab;
            async move {
                let r = lab.invoke(f, &json!({})).await;
                assert_eq!(r.error_type.as_deref(), Some("InvalidRequest"), "warm-up of {f}: {:?}", r.body);
            }
        };
        tokio::join!(warm("acquire"), warm("heartbeat"), warm("release"));
        lab
    }

    pub async fn invoke(&self, function: &str, payload: &Value) -> Invocation {
        self.invoke_raw(function, payload.to_string().as_bytes()).await
    }

    pub async fn invoke_raw(&self, function: &str, payload: &[u8]) -> Invocation {
        self.invoked.lock().unwrap().insert(function.to_string());
        match tokio::time::timeout(INVOKE_TIMEOUT, self.emu.invoke_raw(function, payload)).await {
            Ok(r) => r,
            Err(_) => panic!("invoke {function} timed out\nemulator log:\n{}", self.log_tail()),
        }
    }

    pub fn log_tail(&self) -> String {
        let log = self.emu.server.log_text();
        let start = log.len().saturating_sub(6000);
        let start = (start..log.len()).find(|i| log.is_char_boundary(*i)).unwrap_or(log.len());
        log[start..].to_string()
    }

    /// Every function instance the emulator started: more than one per invoked function
    /// (at concurrency 1) means a function process died and was started again.
    pub fn instances_started(&self) -> usize {
        self.emu.server.log_text().matches("spawning function instance").count()
    }

    /// No function process exited or panicked (the emulator logs `command exited` when one
    /// does, and starts another).
    pub fn assert_no_crash(&self) {
        let log = self.emu.server.log_text();
        for sign in ["command exited", "panicked at"] {
            assert!(!log.contains(sign), "a function process crashed ({sign})\n{}", self.log_tail());
        }
    }

    pub fn assert_no_respawn(&self) {
        self.assert_no_crash();
        let invoked = self.invoked.lock().unwrap().len();
        assert_eq!(
            self.instances_started(),
            invoked,
            "a function process was restarted (crashed?)\nemulator log:\n{}",
            self.log_tail()
        );
    }

    pub async fn remove(&self, key: &str) {
        self.store.delete(key, &Condition::Exists).await.expect("delete item");
    }

    pub async fn item(&self, key: &str) -> Option<Record> {
        self.store.get(key).await.expect("get item")
    }

    pub async fn state(&self, key: &str) -> LeaseState {
        self.coord.get(key).await.expect("get state")
    }

    pub async fn snapshot(&self) -> Vec<Record> {
        let mut out = Vec::new();
        let mut start: Option<String> = None;
        loop {
            let page = self.store.scan(&ScanKind::All, start.as_deref(), 100).await.expect("scan");
            out.extend(page.items);
            match page.next {
                Some(n) => start = Some(n),
                None => break,
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        out
    }

    /// A lease taken for a test's setup. A grant answered after its safe time is released by
    /// the coordinator (`StoreUnavailable`, DESIGN.md, "Clocks"); setup takes the key again
    /// then, at most twice more, and says so.
    pub async fn take(&self, key: &str, holder: &str, ms: u64, opts: AcquireOptions) -> leasehold::Lease {
        let d = Some(Duration::from_millis(ms));
        for _ in 0..2 {
            match self.coord.acquire(key, holder, d, opts.clone()).await {
                Ok(l) => return l,
                Err(leasehold::Error::StoreUnavailable(e)) => eprintln!("setup acquire of {key:?} again: {e}"),
                Err(e) => panic!("setup acquire: {e}"),
            }
        }
        self.coord.acquire(key, holder, d, opts).await.expect("setup acquire")
    }
}

/// `a.b.c` inside a JSON value.
pub fn at<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(v, |v, part| v.get(part))
}

pub fn substitute(v: &mut Value, from: &str, to: &str) {
    match v {
        Value::String(s) if s.contains(from) => *s = s.replace(from, to),
        Value::Array(a) => a.iter_mut().for_each(|x| substitute(x, from, to)),
        Value::Object(o) => o.values_mut().for_each(|x| substitute(x, from, to)),
        _ => {}
    }
}

pub fn read_event(name: &str) -> Value {
    let path = repo_root().join("events").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name} is not JSON: {e}"))
}

/// An HTTP API answer as API Gateway would turn it into an HTTP response.
#[derive(Debug)]
pub struct HttpAnswer {
    pub status: u64,
    pub headers: Map<String, Value>,
    pub body: Value,
}

impl HttpAnswer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).and_then(|(_, v)| v.as_str())
    }
}

/// HTTP API events always get an HTTP response: never a function error, never a 500, and
/// always a JSON body.
pub fn http_answer(inv: &Invocation) -> Result<HttpAnswer, String> {
    if let Some(t) = &inv.error_type {
        return Err(format!("HTTP event answered with a function error {t}: {}", inv.body));
    }
    let status = inv.body.get("statusCode").and_then(Value::as_u64).ok_or(format!("no statusCode: {}", inv.body))?;
    if status >= 500 {
        return Err(format!("HTTP {status}: {}", inv.body));
    }
    let text = inv.body.get("body").and_then(Value::as_str).ok_or(format!("no body: {}", inv.body))?;
    let body: Value = serde_json::from_str(text).map_err(|e| format!("body is not JSON ({e}): {text}"))?;
    let headers = inv.body.get("headers").and_then(Value::as_object).cloned().unwrap_or_default();
    if !headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("content-type") && v == "application/json") {
        return Err(format!("no JSON content-type: {headers:?}"));
    }
    Ok(HttpAnswer { status, headers, body })
}

/// An API Gateway HTTP API (payload 2.0) event built from events/http-acquire.json, for a
/// path as API Gateway delivers it (decoded once), arriving now. `pathParameters.key` is the
/// key the route takes from the path (none for a path no route takes).
pub fn http_event(method: &str, path: &str, route_key: &str, body: Option<&str>) -> Value {
    let mut ev = read_event("http-acquire.json");
    ev["rawPath"] = json!(path);
    ev["routeKey"] = json!(route_key);
    ev["requestContext"]["routeKey"] = json!(route_key);
    ev["requestContext"]["http"]["method"] = json!(method);
    ev["requestContext"]["http"]["path"] = json!(path);
    ev["requestContext"]["requestId"] = json!(format!("req-{}", LeaseId::generate().expose()));
    ev["requestContext"]["timeEpoch"] = json!(now_ms());
    match leasehold::api::route(method, path) {
        Ok(leasehold::api::Route::Op(_, key)) => ev["pathParameters"] = json!({ "key": key }),
        _ => {
            ev.as_object_mut().unwrap().remove("pathParameters");
        }
    }
    let obj = ev.as_object_mut().unwrap();
    match body {
        Some(b) => {
            obj.insert("body".into(), json!(b));
            ev["headers"]["content-length"] = json!(b.len().to_string());
        }
        None => {
            obj.remove("body");
            ev["headers"].as_object_mut().unwrap().remove("content-length");
            ev["headers"].as_object_mut().unwrap().remove("content-type");
        }
    }
    ev
}

// ------------------------------------------------------------------------------------------
// The event catalogue
// ------------------------------------------------------------------------------------------

/// What the setup of a case left behind.
#[derive(Default)]
pub struct Setup {
    pub lease_id: Option<String>,
    pub fence: Option<u64>,
}

pub async fn run_setup(lab: &Lab, name: &str, function: &str, payload: &Value, setup: &str, key: &str) -> Setup {
    lab.remove(key).await;
    let long = 60_000;
    match setup {
        // Nothing on the key; a well-formed lease_id for events that need one.
        "free" => Setup { lease_id: Some(LeaseId::generate().expose().to_string()), fence: None },
        "held" => {
            let l = lab.take(key, "worker-1", long, Default::default()).await;
            Setup { lease_id: Some(l.lease_id.expose().to_string()), fence: Some(l.fence) }
        }
        "held-by-other" => {
            let l = lab.take(key, "other-worker", long, Default::default()).await;
            // A well-formed lease_id that is not the holder's.
            Setup { lease_id: Some(LeaseId::generate().expose().to_string()), fence: Some(l.fence) }
        }
        "held-briefly-by-other" => {
            let l = lab.take(key, "other-worker", 700, Default::default()).await;
            Setup { lease_id: None, fence: Some(l.fence) }
        }
        "released" => {
            let l = lab.take(key, "worker-1", long, Default::default()).await;
            lab.coord.release(key, &l.lease_id).await.expect("setup release");
            Setup { lease_id: Some(l.lease_id.expose().to_string()), fence: Some(l.fence) }
        }
        "same-event" => {
            let r = lab.invoke(function, payload).await;
            assert!(r.error_type.is_none(), "{name}: first invoke of the same event failed: {}", r.body);
            Setup { lease_id: None, fence: r.body.get("fence").and_then(Value::as_u64) }
        }
        other => panic!("{name}: unknown setup {other:?}"),
    }
}

/// Checks one case; returns a one-line outcome or the reasons it failed.
pub async fn check_case(lab: &Lab, name: &str, spec: &Value, case: &Value) -> Result<String, String> {
    let function = case.get("function").or(spec.get("function")).and_then(Value::as_str).expect("function");
    let trigger = spec["trigger"].as_str().expect("trigger");
    let key = spec["key"].as_str().expect("key");
    let expect = &case["expect"];
    let (payload, setup) = prepare(lab, name, function, key, case).await;
    let expected_error = expect.get("error").and_then(Value::as_str);
    let expected_status = expect.get("status").and_then(Value::as_u64);
    let rejects = expected_error == Some("InvalidRequest") || matches!(expected_status, Some(400 | 405));
    let before = if rejects { Some(lab.snapshot().await) } else { None };

    let started = Instant::now();
    let inv = lab.invoke(function, &payload).await;
    let elapsed = started.elapsed();

    let mut problems = Vec::new();
    let (body, outcome) = if trigger == "http" {
        http_outcome(&inv, expect, &mut problems)?
    } else {
        direct_outcome(&inv, expected_error, &mut problems)
    };
    check_body(name, expect, &body, &setup, &mut problems)?;
    if let Some(ms) = expect.get("within_ms").and_then(Value::as_u64) {
        if elapsed > Duration::from_millis(ms) {
            problems.push(format!("answered after {elapsed:?} (limit {ms} ms)"));
        }
    }
    if let Some(before) = before {
        if lab.snapshot().await != before {
            problems.push("a rejected request changed the table".into());
        }
    }
    if problems.is_empty() {
        Ok(format!("{outcome} in {} ms", elapsed.as_millis()))
    } else {
        Err(problems.join("; "))
    }
}

/// The case's event (a keep-alive's far `until_ms` moved to an hour from now), after its
/// setup ran, with the setup's lease_id in place of the placeholder unless the case says not to.
async fn prepare(lab: &Lab, name: &str, function: &str, key: &str, case: &Value) -> (Value, Setup) {
    let setup_name = case["setup"].as_str().expect("setup");
    let substitute_ids = case.get("substitute").and_then(Value::as_bool).unwrap_or(true);
    let mut payload = read_event(name);
    if let Some(ka) = payload.get_mut("keepalive").and_then(Value::as_object_mut) {
        if ka.get("until_ms").and_then(Value::as_u64).is_some_and(|u| u > 1_000_000) {
            ka.insert("until_ms".into(), json!(now_ms() + 3_600_000));
        }
    }
    let setup = run_setup(lab, name, function, &payload, setup_name, key).await;
    if substitute_ids {
        if let Some(id) = &setup.lease_id {
            substitute(&mut payload, PLACEHOLDER, id);
        }
    }
    (payload, setup)
}

/// An HTTP event's answer checked against the expected status, headers and error: its body
/// and a one-line outcome.
fn http_outcome(inv: &Invocation, expect: &Value, problems: &mut Vec<String>) -> Result<(Value, String), String> {
    let expected_error = expect.get("error").and_then(Value::as_str);
    let expected_status = expect.get("status").and_then(Value::as_u64);
    let a = http_answer(inv)?;
    if let Some(s) = expected_status {
        if a.status != s {
            problems.push(format!("status {} (expected {s}): {}", a.status, a.body));
        }
    }
    for h in expect.get("headers").and_then(Value::as_array).into_iter().flatten() {
        let h = h.as_str().unwrap();
        match a.header(h) {
            Some(v) if h == "retry-after" && v.parse::<u64>().map_or(true, |s| s < 1) => {
                problems.push(format!("bad {h}: {v}"))
            }
            Some(_) => {}
            None => problems.push(format!("no {h} header: {:?}", a.headers)),
        }
    }
    if let Some(e) = expected_error {
        if a.body.get("error").and_then(Value::as_str) != Some(e) {
            problems.push(format!("error {:?} (expected {e})", a.body.get("error")));
        }
        if a.body.get("message").and_then(Value::as_str).is_none_or(str::is_empty) {
            problems.push("error body without a message".into());
        }
    }
    let outcome = format!("HTTP {}{}", a.status, a.body.get("error").map(|e| format!(" {e}")).unwrap_or_default());
    Ok((a.body, outcome))
}

/// A direct invocation's answer checked against the expected error type: its body (the error
/// body for a function error) and a one-line outcome.
fn direct_outcome(inv: &Invocation, expected_error: Option<&str>, problems: &mut Vec<String>) -> (Value, String) {
    match (&inv.error_type, expected_error) {
        (None, None) => {}
        (Some(t), Some(e)) if t == e => {
            let b = inv.error_body();
            if b.get("error").and_then(Value::as_str) != Some(e) {
                problems.push(format!("errorMessage is not the JSON error body: {}", inv.body));
            }
        }
        (got, want) => problems.push(format!("errorType {got:?} (expected {want:?}): {}", inv.body)),
    }
    let body = if inv.error_type.is_some() { inv.error_body() } else { inv.body.clone() };
    let outcome = match &inv.error_type {
        Some(t) => format!("error {t}"),
        None => "ok".to_string(),
    };
    (body, outcome)
}

/// The answer's body checked against the expected fields, present and absent paths, and its
/// fence against the setup's; an error for an expectation the case cannot have.
fn check_body(
    name: &str,
    expect: &Value,
    body: &Value,
    setup: &Setup,
    problems: &mut Vec<String>,
) -> Result<(), String> {
    for (path, want) in expect.get("fields").and_then(Value::as_object).into_iter().flatten() {
        let got = at(body, path);
        let matches = match (got, want) {
            (None, Value::Null) => true,
            (Some(g), w) => g == w,
            (None, _) => false,
        };
        if !matches {
            problems.push(format!("{path} = {got:?} (expected {want})"));
        }
    }
    for path in expect.get("has").and_then(Value::as_array).into_iter().flatten() {
        let path = path.as_str().unwrap();
        if at(body, path).is_none_or(Value::is_null) {
            problems.push(format!("{path} missing"));
        }
    }
    for path in expect.get("absent").and_then(Value::as_array).into_iter().flatten() {
        let path = path.as_str().unwrap();
        if at(body, path).is_some() {
            problems.push(format!("{path} present"));
        }
    }
    if let Some(rel) = expect.get("fence").and_then(Value::as_str) {
        let base = setup.fence.ok_or(format!("{name}: fence check without a setup fence"))?;
        let got = body.get("fence").and_then(Value::as_u64);
        let ok = match rel {
            "higher" => got.is_some_and(|f| f > base),
            "same" => got == Some(base),
            other => return Err(format!("{name}: unknown fence expectation {other:?}")),
        };
        if !ok {
            problems.push(format!("fence {got:?} (expected {rel} than/as {base})"));
        }
    }
    Ok(())
}
