//! The QueuedSingleFlight state machine (statemachines/queued_single_flight.asl.json, the file
//! template.yaml deploys) executed by moto's Step Functions interpreter: its
//! `lambda:invoke.waitForTaskToken` task reaches the real acquire function in the Lambda
//! runtime emulator, which queues the execution; the lease reaches the execution through the
//! functions' real `SendTaskSuccess` calls to moto. Leases live in DynamoDB Local.
//!
//! Quirks of the local tools this harness works around (none concerns AWS):
//! - `cargo lambda watch` answers a function error with HTTP 500 where Lambda answers 200 with
//!   `X-Amz-Function-Error`; an adapter in front of the emulator gives moto the real contract.
//! - moto 5.2 cannot start a second execution in a region that already has one (it deep-copies
//!   a backend holding locks), so each execution runs in a region of its own, and moto looks a
//!   task token up only among the executions of the region a `SendTaskSuccess` is signed for.
//!   The same adapter is the functions' Step Functions endpoint: it offers each
//!   `SendTaskSuccess` to every region at once (the credential scope rewritten) and answers
//!   with the region that knows the token. `InvalidToken` answers from the other regions are
//!   never shown to the functions.
//!
//!   A call that names an execution (the keep-alive sweep's `DescribeExecution`) goes to the
//!   region of that execution only: another region's `ExecutionDoesNotExist` would tell the
//!   sweep a running execution had ended.
//!
//! The adapter can also play a `SendTaskSuccess` that lands and whose answer never comes in
//! time: the first one for a task whose lease is on a key containing `slow-answer` is answered
//! 4 s late (after the functions' 3 s timeout), once moto has taken it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use aws_sdk_sfn::types::{ExecutionStatus, HistoryEventType};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use leasehold::store::DynamoStore;
use leasehold::{Config, Coordinator, LeaseState};
use leasehold_tests::emulator::{forward_invoke, next_execution_region, serve_forever, Emulator, Moto, MOTO_REGIONS};
use leasehold_tests::{dynamo_local, free_port, http, sdk_config_for, set_local_credentials, statemachines};
use serde_json::{json, Value};

/// One region per execution (moto runs one execution per region); the functions' region
/// (us-east-1) is left to them.
fn next_region() -> &'static str {
    next_execution_region("us-east-1")
}

struct Stack {
    emulator: Emulator,
    moto: Moto,
    table: String,
    dynamo_endpoint: String,
}

/// Rewrites the region of a SigV4 `Authorization` header's credential scope.
fn with_region(auth: &str, region: &str) -> String {
    let mut parts: Vec<String> = auth.split('/').map(str::to_string).collect();
    if parts.len() > 3 {
        parts[2] = region.to_string();
    }
    parts.join("/")
}

async fn adapt(
    req: hyper::Request<hyper::body::Incoming>,
    emulator_port: u16,
    moto_port: u16,
) -> hyper::Response<Full<Bytes>> {
    let target = req.headers().get("x-amz-target").and_then(|t| t.to_str().ok()).unwrap_or("").to_string();
    let method = req.method().as_str().to_string();
    let path = req.uri().path_and_query().map(|p| p.as_str().to_string()).unwrap_or_default();
    let headers: Vec<(String, String)> = req
        .headers()
        .iter()
        .filter(|(k, _)| !matches!(k.as_str(), "host" | "content-length"))
        .map(|(k, v)| (k.as_str().to_string(), v.to_str().unwrap_or("").to_string()))
        .collect();
    let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    if target.starts_with("AWSStepFunctions.") {
        // A function's Step Functions call: one that names an execution goes to its region;
        // a task token's is offered to every region at once, and the answer of the region that
        // knows the token wins (all `InvalidToken`: that answer).
        let url = format!("http://127.0.0.1:{moto_port}{path}");
        let named = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| v["executionArn"].as_str().map(|a| a.split(':').nth(3).unwrap_or("").to_string()));
        let regions: Vec<&str> = match &named {
            Some(r) => MOTO_REGIONS.iter().copied().filter(|m| m == r).collect(),
            None => MOTO_REGIONS.to_vec(),
        };
        let mut set = tokio::task::JoinSet::new();
        for region in regions {
            let hs: Vec<(String, String)> =
                headers
                    .iter()
                    .map(|(k, v)| {
                        if k == "authorization" {
                            (k.clone(), with_region(v, region))
                        } else {
                            (k.clone(), v.clone())
                        }
                    })
                    .collect();
            let (url, method, body) = (url.clone(), method.clone(), body.clone());
            set.spawn(async move { http::request_with_headers(&method, &url, &hs, &body).await });
        }
        let mut last = None;
        while let Some(res) = set.join_next().await {
            match res.expect("fan-out task") {
                Ok(r) if r.status == 400 && r.text().contains("InvalidToken") => last = Some(r),
                Ok(r) => {
                    last = Some(r);
                    set.abort_all();
                    break;
                }
                Err(e) => {
                    return hyper::Response::builder().status(502).body(Full::new(Bytes::from(e.to_string()))).unwrap()
                }
            }
        }
        let r = last.expect("a region answered");
        if slow_answer(&target, &body) {
            tokio::time::sleep(Duration::from_secs(4)).await;
        }
        let mut b = hyper::Response::builder().status(r.status);
        for (k, v) in &r.headers {
            if !matches!(k.as_str(), "content-length" | "transfer-encoding" | "connection") {
                b = b.header(k.as_str(), v.as_str());
            }
        }
        return b.body(Full::new(Bytes::from(r.body))).unwrap();
    }
    // moto's Lambda invoke: the emulator's function error becomes Lambda's answer; a dry run
    // runs nothing (see leasehold_tests::sfn_quotas::invocation_type).
    let (path, invocation_type) = leasehold_tests::sfn_quotas::invocation_type(&path, &hyper::HeaderMap::new());
    if invocation_type.as_deref() == Some("DryRun") {
        return leasehold_tests::sfn_quotas::dry_run(&path);
    }
    forward_invoke(emulator_port, &method, &path, &body).await
}

/// Is this the first `SendTaskSuccess` to a task whose lease is on a `slow-answer` key? (Its
/// answer is then held back past the caller's timeout.)
fn slow_answer(target: &str, body: &[u8]) -> bool {
    static SEEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    if target != "AWSStepFunctions.SendTaskSuccess" {
        return false;
    }
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let output: Value = v["output"].as_str().and_then(|o| serde_json::from_str(o).ok()).unwrap_or(Value::Null);
    let token = v["taskToken"].as_str().unwrap_or("").to_string();
    if !output["key"].as_str().is_some_and(|k| k.contains("slow-answer")) {
        return false;
    }
    let mut seen = SEEN.lock().unwrap();
    if seen.contains(&token) {
        return false;
    }
    seen.push(token);
    true
}

fn start_adapter(port: u16, emulator_port: u16, moto_port: u16) {
    serve_forever(port, move |req| adapt(req, emulator_port, moto_port));
}

fn stack() -> &'static Stack {
    static STACK: OnceLock<Stack> = OnceLock::new();
    STACK.get_or_init(|| {
        std::thread::spawn(|| {
            set_local_credentials();
            let local = dynamo_local();
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let store = rt.block_on(local.store());
            let region = std::env::var("AWS_REGION").expect("AWS_REGION");
            let moto_port = free_port();
            let adapter_port = free_port();
            let emulator_port = free_port();
            let env: Vec<(String, String)> = [
                ("LEASEHOLD_TABLE", store.table().to_string()),
                ("AWS_ENDPOINT_URL_DYNAMODB", local.endpoint.clone()),
                ("AWS_ENDPOINT_URL_SFN", format!("http://127.0.0.1:{adapter_port}")),
                ("AWS_ACCESS_KEY_ID", std::env::var("AWS_ACCESS_KEY_ID").unwrap()),
                ("AWS_SECRET_ACCESS_KEY", std::env::var("AWS_SECRET_ACCESS_KEY").unwrap_or_default()),
                ("AWS_REGION", region.clone()),
                ("AWS_DEFAULT_REGION", region),
                ("LEASEHOLD_MIN_DURATION_MS", "500".to_string()),
                // Keep-alive leases last at least 3 periods: 1.5 s here.
                ("LEASEHOLD_SWEEP_PERIOD_MS", SWEEP_PERIOD_MS.to_string()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
            let emulator = Emulator::start_with(emulator_port, &env, &["--concurrency", "4"]);
            start_adapter(adapter_port, emulator_port, moto_port);
            let moto = Moto::start(moto_port, adapter_port);
            rt.block_on(async {
                moto.enable_execution().await;
                for f in ["acquire", "release", "heartbeat"] {
                    let inv = emulator.invoke(f, &json!({})).await;
                    assert_eq!(inv.error_type.as_deref(), Some("InvalidRequest"), "{f} warm-up: {:?}", inv.body);
                }
            });
            Stack { emulator, moto, table: store.table().to_string(), dynamo_endpoint: local.endpoint.clone() }
        })
        .join()
        .expect("start the local stack")
    })
}

async fn coordinator() -> Coordinator {
    let s = stack();
    let client = aws_sdk_dynamodb::Client::new(&sdk_config_for(&s.dynamo_endpoint).await);
    Coordinator::new(std::sync::Arc::new(DynamoStore::new(client, s.table.clone())), Config::default())
}

async fn state(key: &str) -> Option<LeaseState> {
    coordinator().await.get(key).await.ok()
}

fn unique(tag: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!("{tag}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::SeqCst))
}

/// The sweep period the functions are told, and the keep-alive duration the template gives
/// the workflow for it (3 periods). Not shorter: a grant may be left with a quarter of its
/// duration less the write's round trip (see workflows.rs), all of it on a loaded machine at 1.5 s.
const SWEEP_PERIOD_MS: u64 = 1500;
const KEEPALIVE_DURATION_MS: &str = "4500";

/// The definition as the template deploys it, with its substitutions replaced by the names the
/// emulator serves ("" for the work function: the Wait placeholder), as moto runs it (an
/// execution never redriven: statemachines::for_moto).
fn definition() -> String {
    let text = statemachines::definition(
        "queued_single_flight",
        &[
            ("AcquireFunctionArn", "acquire"),
            ("ReleaseFunctionArn", "release"),
            ("WorkFunctionArn", ""),
            ("Partition", "aws"),
            ("KeepaliveDurationMs", KEEPALIVE_DURATION_MS),
        ],
    );
    statemachines::for_moto(&text, 0)
}

struct Run {
    client: aws_sdk_sfn::Client,
    arn: String,
    name: String,
}

/// moto's client: patient timeouts and a few retries (the SDK config the product uses has
/// retries off, and moto drops a connection now and then on a loaded machine).
async fn sfn(region: &str) -> aws_sdk_sfn::Client {
    leasehold_tests::sfn_quotas::sfn_client(&stack().moto.endpoint(), region).await
}

async fn start(input: Value) -> Run {
    let client = sfn(next_region()).await;
    let sm = client
        .create_state_machine()
        .name(unique("QueuedSingleFlight"))
        .definition(definition())
        .role_arn("arn:aws:iam::123456789012:role/leasehold-example")
        .send()
        .await
        .unwrap_or_else(|e| panic!("create: {e:?}"));
    let name = unique("run");
    let out = client
        .start_execution()
        .state_machine_arn(sm.state_machine_arn())
        .name(&name)
        .input(input.to_string())
        .send()
        .await
        .unwrap_or_else(|e| panic!("start: {e:?}"));
    Run { client, arn: out.execution_arn().to_string(), name }
}

#[derive(Debug)]
struct Ended {
    status: ExecutionStatus,
    error: Option<String>,
    output: Value,
    /// When the WaitForTurn task succeeded (moto's clock, epoch ms): the lease reached it.
    lease_arrived_ms: Option<u64>,
}

async fn wait_end(run: &Run, timeout: Duration) -> Ended {
    let deadline = Instant::now() + timeout;
    loop {
        let d = run.client.describe_execution().execution_arn(&run.arn).send().await.expect("describe");
        if *d.status() != ExecutionStatus::Running {
            let h = leasehold_tests::sfn_quotas::all_history(&run.client, &run.arn).await;
            let lease_arrived_ms = h
                .iter()
                .find(|e| *e.r#type() == HistoryEventType::TaskSucceeded)
                .map(|e| e.timestamp().to_millis().unwrap() as u64);
            return Ended {
                status: d.status().clone(),
                error: d.error().map(str::to_string),
                output: d.output().and_then(|o| serde_json::from_str(o).ok()).unwrap_or(Value::Null),
                lease_arrived_ms,
            };
        }
        assert!(
            Instant::now() < deadline,
            "{} still running after {timeout:?}\nemulator log:\n{}",
            run.arn,
            stack().emulator.server.log_text().lines().rev().take(40).collect::<Vec<_>>().join("\n")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until `key` is held by `holder`, or has `queued` waiters.
async fn wait_for(key: &str, what: &str, ok: impl Fn(&LeaseState) -> bool) -> LeaseState {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(s) = state(key).await.filter(|s| ok(s)) {
            return s;
        }
        assert!(Instant::now() < deadline, "{key}: {what} never happened: {:?}", state(key).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Several executions queued on one key work one at a time, in arrival order; one whose queue
/// timeout passes while it waits is passed over. Prints the hand-over latency (the release of
/// one execution to the next execution's task receiving its lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queued_executions_are_served_one_at_a_time_in_order() {
    stack();
    let key = unique("queued");
    let input = |queue_timeout_seconds: u64, work_seconds: u64| json!({"key": key, "duration_ms": 60000, "work_seconds": work_seconds, "queue_timeout_seconds": queue_timeout_seconds});
    // The first holder works until every other execution has joined the queue.
    let mut runs = vec![start(input(120, 25)).await];
    wait_for(&key, "the first execution's lease", |s| s.held && s.holder == runs[0].name).await;
    // Queued in a known order: each joins only after the one before is counted.
    // Twelve executions (regions: see the module comment): ten hand-overs measured.
    for i in 1..12u64 {
        // The fourth waits at most 1 s: it times out in the queue.
        let timeout = if i == 3 { 1 } else { 120 };
        runs.push(start(input(timeout, 1)).await);
        wait_for(&key, "the queue to grow", |s| s.queue_length >= i).await;
    }
    let mut ended = Vec::new();
    for r in &runs {
        ended.push(wait_end(r, Duration::from_secs(180)).await);
    }
    let timed_out = &ended[3];
    assert_eq!(timed_out.status, ExecutionStatus::Failed, "{timed_out:?}");
    assert_eq!(timed_out.error.as_deref(), Some("TimedOutInQueue"), "{timed_out:?}");
    let served: Vec<(usize, &Ended)> = ended.iter().enumerate().filter(|(i, _)| *i != 3).collect();
    let mut latencies = Vec::new();
    for w in served.windows(2) {
        let ((i, a), (j, b)) = (w[0], w[1]);
        assert_eq!(a.status, ExecutionStatus::Succeeded, "run {i}: {a:?}");
        assert_eq!(b.status, ExecutionStatus::Succeeded, "run {j}: {b:?}");
        let (fa, fb) = (a.output["fence"].as_u64().unwrap(), b.output["fence"].as_u64().unwrap());
        assert!(fb > fa, "in order: run {j}'s fence {fb} above run {i}'s {fa}");
        let released = a.output["released_at_ms"].as_u64().unwrap();
        let acquired = b.output["acquired_at_ms"].as_u64().unwrap();
        assert!(acquired >= released, "one at a time: run {j} acquired at {acquired}, run {i} released at {released}");
        assert_eq!(b.output["holder"], runs[j].name);
        latencies.push(b.lease_arrived_ms.unwrap().saturating_sub(released));
    }
    latencies.sort();
    println!(
        "hand-over latency (release to the next execution's task receiving its lease), {} hand-overs: p50 {} ms, p99 {} ms",
        latencies.len(),
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99)
    );
    let end = state(&key).await.unwrap();
    assert!(!end.held && end.queue_length == 0, "{end:?}");
}

/// EventBridge's scheduled event: the heartbeat function runs the keep-alive and queue sweeps.
fn scheduled_event() -> Value {
    json!({"source": "aws.events", "detail-type": "Scheduled Event", "detail": {}})
}

async fn sweep_once() {
    let sweep = stack().emulator.invoke("heartbeat", &scheduled_event()).await;
    assert!(sweep.error_type.is_none(), "{:?}", sweep.body);
}

/// The scheduled sweep, run every 400 ms (several times per sweep period here) until the guard is
/// dropped, as EventBridge runs it.
struct Sweeping(tokio::task::JoinHandle<()>);

impl Drop for Sweeping {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn sweeping() -> Sweeping {
    Sweeping(tokio::spawn(async {
        loop {
            sweep_once().await;
            tokio::time::sleep(Duration::from_millis(400)).await;
        }
    }))
}

/// The lease reaches a queued execution bound to it (keep-alive): a holder stopped mid-work
/// does not keep the key until its lease expires. The sweep finds the execution ended,
/// releases the lease and hands the key to the head waiter, long before the lease's expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopped_holder_is_replaced_at_the_next_sweep() {
    stack();
    let key = unique("stopped");
    let holder =
        start(json!({"key": key, "duration_ms": 120_000, "work_seconds": 60, "queue_timeout_seconds": 120})).await;
    let held = wait_for(&key, "the holder's lease", |s| s.held && s.holder == holder.name).await;
    let ka = held.keepalive.clone().expect("a keep-alive lease");
    assert_eq!(ka.execution_arn.as_deref(), Some(holder.arn.as_str()), "bound to the execution: {held:?}");
    let next = start(json!({"key": key, "work_seconds": 1, "queue_timeout_seconds": 120})).await;
    wait_for(&key, "the waiter queued", |s| s.queue_length == 1).await;
    holder.client.stop_execution().execution_arn(&holder.arn).send().await.expect("stop");
    // moto ends a stopped execution when its current state ends: wait for it.
    let stopped = wait_end(&holder, Duration::from_secs(90)).await;
    assert_eq!(stopped.status, ExecutionStatus::Aborted, "{stopped:?}");
    sweep_once().await;
    let e = wait_end(&next, Duration::from_secs(60)).await;
    assert_eq!(e.status, ExecutionStatus::Succeeded, "{e:?}");
    assert!(e.output["fence"].as_u64().unwrap() > held.fence);
    let acquired = e.output["acquired_at_ms"].as_u64().unwrap();
    assert!(acquired < held.expires_at_ms.unwrap(), "freed by the sweep at {acquired}, not by the expiry {held:?}");
}

/// A queued execution's lease is renewed while the execution runs, however long its work: a
/// holder whose work (18 s) outlasts its lease (6 s: a loaded machine's sweep can take
/// seconds) keeps the key while the sweep runs; the execution queued behind it gets the key
/// only once it released (a lease not bound to the execution expired under the work, and the
/// sweep handed the key on).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queued_executions_lease_outlives_its_duration_while_it_works() {
    stack();
    let _sweep = sweeping();
    let key = unique("long-work");
    let first = start(json!({"key": key, "duration_ms": 6000, "work_seconds": 18, "queue_timeout_seconds": 120})).await;
    let held = wait_for(&key, "the first execution's lease", |s| s.held && s.holder == first.name).await;
    // The second's lease outlasts its 1 s of work by more than a loaded machine's sweep and a
    // corrected clock's lag behind the store's (up to a `Date`'s second on DynamoDB Local:
    // DESIGN.md, "Clocks").
    let second = start(json!({"key": key, "duration_ms": 6000, "work_seconds": 1, "queue_timeout_seconds": 120})).await;
    let (a, b) = (wait_end(&first, Duration::from_secs(120)).await, wait_end(&second, Duration::from_secs(120)).await);
    assert_eq!(a.status, ExecutionStatus::Succeeded, "{a:?}");
    assert_eq!(b.status, ExecutionStatus::Succeeded, "{b:?}");
    let released = a.output["released_at_ms"].as_u64().unwrap();
    assert!(released > held.expires_at_ms.unwrap() + 6000, "held well past its first expiry {held:?}: {released}");
    let acquired = b.output["acquired_at_ms"].as_u64().unwrap();
    assert!(acquired >= released, "one at a time: the second acquired at {acquired}, the first released at {released}");
    assert!(b.output["fence"].as_u64().unwrap() > a.output["fence"].as_u64().unwrap());
}

/// The functions' delivery (`StepFunctions` as the queue's `Deliver`) against moto: a task
/// token no task waits on is classified `Gone` (`InvalidToken`), and a queued acquire whose
/// grant on a free key cannot be delivered does not keep it: the key stays free.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_grant_nobody_waits_for_is_released() {
    use leasehold::queue::{Deliver, DeliveryError};
    stack();
    let sfn = std::sync::Arc::new(leasehold::lambda::StepFunctions(sfn(next_region()).await));
    let c = coordinator().await;
    let key = unique("gone");
    let lease = c.acquire(&key, "probe", Some(Duration::from_secs(5)), Default::default()).await.unwrap();
    match sfn.success("no-such-token", &lease).await {
        Err(DeliveryError::Gone(why)) => assert!(why.contains("InvalidToken"), "{why}"),
        other => panic!("a token nobody waits on must be Gone: {other:?}"),
    }
    c.release(&key, &lease.lease_id).await.unwrap();
    let c = c.with_deliver(sfn);
    let out =
        c.acquire_or_enqueue(&key, "nobody", Duration::from_secs(30), Default::default(), "no-such-token", None).await;
    assert!(out.is_err(), "{out:?}");
    let st = state(&key).await.expect("the grant was written, then released");
    assert!(!st.held, "{st:?}");
}

/// Two executions never hold one key: a queued acquire that finds the key free grants it and
/// delivers it with `SendTaskSuccess`; when that call lands but its answer comes after the
/// functions' timeout, the execution works with the lease, so the grant is kept (marked for
/// the sweep) and the next execution queues behind it instead of taking the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delivery_that_landed_but_timed_out_keeps_the_key() {
    stack();
    let key = unique("slow-answer");
    let first =
        start(json!({"key": key, "duration_ms": 60000, "work_seconds": 10, "queue_timeout_seconds": 120})).await;
    wait_for(&key, "the first execution's lease", |s| s.held && s.holder == first.name).await;
    // The acquire function gives up on its delivery after its 3 s timeout and retries.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let st = state(&key).await.expect("the key");
    assert!(st.held && st.holder == first.name, "the working execution keeps its lease: {st:?}");
    let second =
        start(json!({"key": key, "duration_ms": 60000, "work_seconds": 1, "queue_timeout_seconds": 120})).await;
    let (a, b) = (wait_end(&first, Duration::from_secs(120)).await, wait_end(&second, Duration::from_secs(120)).await);
    assert_eq!(a.status, ExecutionStatus::Succeeded, "{a:?}");
    assert_eq!(b.status, ExecutionStatus::Succeeded, "{b:?}");
    let released = a.output["released_at_ms"].as_u64().unwrap();
    let acquired = b.output["acquired_at_ms"].as_u64().unwrap();
    assert!(acquired >= released, "one at a time: the second acquired at {acquired}, the first released at {released}");
    assert!(b.output["fence"].as_u64().unwrap() > a.output["fence"].as_u64().unwrap());
}

/// What a QueuedSingleFlight execution costs in Step Functions and Lambda (COSTS.md): the states it
/// entered (one transition each) and the Lambda tasks it scheduled, alone and queued behind
/// another.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn state_transitions_and_invocations_per_run() {
    stack();
    let key = unique("queued-cost");
    let input = |work_seconds: u64| json!({"key": key, "duration_ms": 60000, "work_seconds": work_seconds});
    let first = start(input(4)).await;
    wait_for(&key, "the first execution's lease", |s| s.held && s.holder == first.name).await;
    let second = start(input(0)).await;
    wait_for(&key, "the second execution queued", |s| s.queue_length == 1).await;
    let mut counts = Vec::new();
    for run in [&first, &second] {
        let end = wait_end(run, Duration::from_secs(180)).await;
        assert_eq!(end.status, ExecutionStatus::Succeeded, "{end:?}");
        let h = leasehold_tests::sfn_quotas::all_history(&run.client, &run.arn).await;
        let entered = h.iter().filter(|e| e.r#type().as_str().ends_with("StateEntered")).count();
        let lambdas = h
            .iter()
            .filter(|e| {
                matches!(e.r#type(), HistoryEventType::TaskScheduled | HistoryEventType::LambdaFunctionScheduled)
            })
            .count();
        counts.push((entered, lambdas));
    }
    println!(
        "queued single flight: alone {:?}, queued behind another {:?} (state transitions, Lambda invocations)",
        counts[0], counts[1]
    );
    assert_eq!(counts[0], counts[1], "waiting in the queue costs no transition: {counts:?}");
    assert_eq!(counts[0], (12, 2), "{counts:?}");
}
