//! The example state machines of template.yaml, executed: moto's Step Functions interpreter
//! runs each definition exactly as the template has it (only the function references are
//! replaced by plain names), its Lambda tasks reach the real functions in the Lambda runtime
//! emulator, and the functions keep their leases in DynamoDB Local.
//!
//! Two quirks of the local tools shape this harness (neither concerns real AWS):
//! - `cargo lambda watch` answers a function error with HTTP 500, where Lambda's Invoke API
//!   answers 200 with `X-Amz-Function-Error`; moto then fails the execution with an
//!   uncatchable `States.Runtime`. A small adapter in front of the emulator gives moto the real
//!   Invoke contract, so `Retry`/`Catch` on `LeaseHeld`, `InvalidRequest`, ... work as in AWS.
//! - moto sends a state machine's DynamoDB service integration tasks
//!   (`arn:aws:states:::dynamodb:updateItem`) to `localhost:$MOTO_PORT` too, signed for the
//!   execution's region with the access key `ak`. The adapter sends those (recognised by their
//!   `X-Amz-Target`) on to DynamoDB Local with the region of the signature's scope replaced by
//!   the functions' region, so every execution writes the one target table, a real DynamoDB
//!   table (DynamoDB Local keeps tables per access key and region; it checks no signature).
//! - moto 5.2 cannot start a second execution in a region that already ran one (it deep-copies
//!   the backend, locks included), so every execution gets a region of its own. Regions only
//!   separate moto's bookkeeping: all executions share one emulator and one lease table.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use aws_sdk_sfn::types::{ExecutionStatus, HistoryEventType};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use leasehold::store::DynamoStore;
use leasehold::{Config, Coordinator, LeaseState};
use leasehold_tests::emulator::{next_execution_region, request_id, serve_forever, Emulator, Moto, MOTO_REGIONS};
use leasehold_tests::{
    dynamo_local, free_port, http, sdk_config_for, set_local_credentials, sfn_quotas, statemachines,
};
use serde_json::{json, Value};

// ---- the local stack ------------------------------------------------------------------------

struct Stack {
    emulator: Emulator,
    moto: Moto,
    table: String,
    dynamo_endpoint: String,
}

/// The region the functions run in (their Step Functions client asks moto there): the
/// test process's AWS_REGION, us-east-1 unless set.
fn function_region() -> String {
    set_local_credentials();
    std::env::var("AWS_REGION").expect("AWS_REGION")
}

/// One region per execution (see the module comment); the functions' region is kept for the
/// keep-alive test, whose execution the heartbeat function must find.
fn next_region() -> &'static str {
    next_execution_region(&function_region())
}

/// Serves Lambda's Invoke API on `port` by forwarding to the emulator, turning its HTTP 500
/// function errors into Lambda's answer: 200, `X-Amz-Function-Error: Unhandled`, the
/// `{errorType, errorMessage}` body. Runs on its own thread for the life of the process.
fn start_invoke_adapter(port: u16, emulator_port: u16, dynamo_port: u16, dynamo_region: String, moto_port: u16) {
    serve_forever(port, move |req: hyper::Request<hyper::body::Incoming>| {
        let dynamo_region = dynamo_region.clone();
        async move {
            let is_dynamodb = req
                .headers()
                .get("x-amz-target")
                .and_then(|t| t.to_str().ok())
                .is_some_and(|t| t.starts_with("DynamoDB_"));
            if is_dynamodb {
                return forward_to_dynamodb(req, dynamo_port, &dynamo_region).await;
            }
            let target = req.headers().get("x-amz-target").and_then(|t| t.to_str().ok()).map(str::to_string);
            if sfn_quotas::is_sfn_call(target.as_deref()) {
                return forward_to_moto(req, moto_port).await;
            }
            let method = req.method().as_str().to_string();
            let path = req.uri().path_and_query().map(|p| p.as_str().to_string()).unwrap_or_default();
            let (path, invocation_type) = sfn_quotas::invocation_type(&path, req.headers());
            if invocation_type.as_deref() == Some("DryRun") {
                return sfn_quotas::dry_run(&path);
            }
            let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            if path.contains("/functions/redrive-work/") {
                // The work function of the redrive test (see `RedriveWork`).
                return redrive_work().handle(&path, &body).await;
            }
            if path.contains("/functions/huge/") {
                // A work function whose answer exceeds Step Functions' 256 KiB result quota.
                return sfn_quotas::oversized_result(&path, 300 * 1024).await;
            }
            sfn_quotas::forward_invoke_within_quotas(emulator_port, &method, &path, &body).await
        }
    });
}

/// Sends a Step Functions call to moto, in the region of the execution it names: the
/// heartbeat function's DescribeExecution (signed for the functions' region) reaches the
/// execution in the region it runs in (see the module comment). A state machine's
/// StartExecution lands in an unused region (leasehold_tests::sfn_quotas).
async fn forward_to_moto(req: hyper::Request<hyper::body::Incoming>, moto_port: u16) -> hyper::Response<Full<Bytes>> {
    let target = req.headers().get("x-amz-target").and_then(|t| t.to_str().ok()).unwrap_or("").to_string();
    let mut headers = Vec::new();
    for (k, v) in req.headers() {
        let k = k.as_str().to_string();
        if k != "host" && k != "content-length" {
            headers.push((k, v.to_str().unwrap_or_default().to_string()));
        }
    }
    let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let moto = format!("http://127.0.0.1:{moto_port}");
    if target == "AWSStepFunctions.StartExecution" {
        return sfn_quotas::start_execution_elsewhere(&moto, &target, &body).await;
    }
    let named = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v["executionArn"].as_str().map(|a| sfn_quotas::region_of(a).to_string()));
    if let Some(region) = named {
        for (k, v) in headers.iter_mut() {
            if k == "authorization" {
                // Credential=KEY/DATE/<region>/states/aws4_request
                let mut parts: Vec<String> = v.split('/').map(str::to_string).collect();
                if parts.len() > 3 && parts[3] == "states" {
                    parts[2] = region.clone();
                    *v = parts.join("/");
                }
            }
        }
    }
    match http::request_with_headers("POST", &format!("{moto}/"), &headers, &body).await {
        Ok(r) => {
            let mut b = hyper::Response::builder().status(r.status);
            for (k, v) in &r.headers {
                if k != "content-length" && k != "transfer-encoding" && k != "connection" {
                    b = b.header(k.as_str(), v.as_str());
                }
            }
            b.body(Full::new(Bytes::from(r.body))).expect("response")
        }
        Err(e) => hyper::Response::builder().status(502).body(Full::new(Bytes::from(format!("moto: {e}")))).unwrap(),
    }
}

/// Sends a DynamoDB request of a state machine's service integration to DynamoDB Local, in
/// `region` whatever region moto signed it for (see the module comment).
async fn forward_to_dynamodb(
    req: hyper::Request<hyper::body::Incoming>,
    dynamo_port: u16,
    region: &str,
) -> hyper::Response<Full<Bytes>> {
    let mut headers = Vec::new();
    for (k, v) in req.headers() {
        let (k, mut v) = (k.as_str().to_string(), v.to_str().unwrap_or_default().to_string());
        if k == "host" || k == "content-length" {
            continue;
        }
        if k == "authorization" {
            // Credential=ak/20260101/<region>/dynamodb/aws4_request
            let parts: Vec<String> = v.split('/').map(str::to_string).collect();
            if parts.len() > 3 && parts[3] == "dynamodb" {
                let mut parts = parts;
                parts[2] = region.to_string();
                v = parts.join("/");
            }
        }
        headers.push((k, v));
    }
    let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let url = format!("http://127.0.0.1:{dynamo_port}/");
    match http::request_with_headers("POST", &url, &headers, &body).await {
        Ok(r) => {
            let mut b = hyper::Response::builder().status(r.status);
            for (k, v) in &r.headers {
                if k != "content-length" && k != "transfer-encoding" && k != "connection" {
                    b = b.header(k.as_str(), v.as_str());
                }
            }
            b.body(Full::new(Bytes::from(r.body))).expect("response")
        }
        Err(e) => {
            hyper::Response::builder().status(502).body(Full::new(Bytes::from(format!("dynamodb: {e}")))).unwrap()
        }
    }
}

fn stack() -> &'static Stack {
    static STACK: OnceLock<Stack> = OnceLock::new();
    STACK.get_or_init(|| {
        std::thread::spawn(|| {
            let local = dynamo_local();
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let store = rt.block_on(local.store());
            // DynamoDB Local keeps tables per access key and region: the functions use the
            // credentials the table was made with.
            let region = function_region();
            let key_id = std::env::var("AWS_ACCESS_KEY_ID").unwrap();
            let secret = std::env::var("AWS_SECRET_ACCESS_KEY").unwrap_or_default();
            let moto_port = free_port();
            let adapter_port = free_port();
            let env: Vec<(String, String)> = [
                ("LEASEHOLD_TABLE", store.table().to_string()),
                ("AWS_ENDPOINT_URL_DYNAMODB", local.endpoint.clone()),
                // Through the adapter: DescribeExecution reaches each execution's region.
                ("AWS_ENDPOINT_URL_SFN", format!("http://127.0.0.1:{adapter_port}")),
                ("AWS_ACCESS_KEY_ID", key_id),
                ("AWS_SECRET_ACCESS_KEY", secret),
                ("AWS_REGION", region.clone()),
                ("AWS_DEFAULT_REGION", region.clone()),
                ("LEASEHOLD_SWEEP_PERIOD_MS", SWEEP_PERIOD_MS.to_string()),
                ("LEASEHOLD_MIN_DURATION_MS", "500".to_string()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
            // Several instances per function: executions of concurrent tests do not queue
            // behind each other's waiting acquires.
            let emulator = Emulator::start_with(free_port(), &env, &["--concurrency", "4"]);
            start_invoke_adapter(adapter_port, emulator.port, local.port, region.clone(), moto_port);
            rt.block_on(create_fenced_target(&local.endpoint, &region));
            let moto = Moto::start(moto_port, adapter_port);
            rt.block_on(async {
                moto.enable_execution().await;
                // The emulator compiles each function on its first invoke: do that now, not
                // inside a task with a timeout.
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

/// The FencedUpdate workflow's target table, on DynamoDB Local under the access key moto
/// signs with (`ak`) and the functions' region (see the module comment).
fn fenced_target() -> String {
    format!("fenced-target-{}", std::process::id())
}

async fn fenced_target_client(endpoint: &str, region: &str) -> aws_sdk_dynamodb::Client {
    let base = sdk_config_for(endpoint).await;
    let conf = aws_sdk_dynamodb::config::Builder::from(&base)
        .region(aws_sdk_dynamodb::config::Region::new(region.to_string()))
        .credentials_provider(aws_sdk_dynamodb::config::Credentials::new("ak", "sk", None, None, "moto"))
        .build();
    aws_sdk_dynamodb::Client::from_conf(conf)
}

async fn create_fenced_target(endpoint: &str, region: &str) {
    let client = fenced_target_client(endpoint, region).await;
    leasehold_tests::create_id_table(&client, &fenced_target()).await;
}

async fn coordinator() -> Coordinator {
    let s = stack();
    let client = aws_sdk_dynamodb::Client::new(&sdk_config_for(&s.dynamo_endpoint).await);
    Coordinator::new(std::sync::Arc::new(DynamoStore::new(client, s.table.clone())), Config::default())
}

async fn lease_state(key: &str) -> LeaseState {
    coordinator().await.get(key).await.unwrap_or_else(|e| panic!("get {key}: {e}"))
}

fn unique(tag: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!("{tag}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::SeqCst))
}

// ---- definitions: statemachines/*.asl.json, as template.yaml deploys them ---------------------

fn raw_template() -> &'static Value {
    static RAW: OnceLock<Value> = OnceLock::new();
    RAW.get_or_init(leasehold_tests::apigw::raw_template)
}

/// The definition file template.yaml names for `machine`, with its DefinitionSubstitutions
/// replaced by the names the emulator serves (`work`: the work function, "" for the Wait
/// placeholder), as moto runs it (an execution never redriven: statemachines::for_moto).
fn definition(machine: &str, work: &str) -> String {
    statemachines::for_moto(&definition_as_written(machine, work), 0)
}

/// [`definition`] as written, before [`statemachines::for_moto`].
fn definition_as_written(machine: &str, work: &str) -> String {
    let props = &raw_template()["Resources"][machine]["Properties"];
    let subs = props["DefinitionSubstitutions"].as_object().expect("DefinitionSubstitutions");
    let fenced_target = FENCED_TARGET.get_or_init(fenced_target).as_str();
    let values: Vec<(&str, &str)> = subs
        .keys()
        .map(|name| {
            let value = match name.as_str() {
                "AcquireFunctionArn" => "acquire",
                "ReleaseFunctionArn" => "release",
                "WorkFunctionArn" => work,
                "Partition" => "aws",
                "KeepaliveDurationMs" => KEEPALIVE_DURATION_MS,
                "FencedTargetTableName" => fenced_target,
                other => panic!("unexpected substitution {other}"),
            };
            (name.as_str(), value)
        })
        .collect();
    let uri = props["DefinitionUri"].as_str().expect("DefinitionUri");
    statemachines::definition(statemachines::name_of_uri(uri), &values)
}

const SINGLE_FLIGHT: &str = "SingleFlightStateMachine";
/// The sweep period the functions are told (LEASEHOLD_SWEEP_PERIOD_MS), and the keep-alive
/// duration the template's mapping gives the workflow for it (3 periods). Not shorter: a grant
/// is written once its safe margin is at most three quarters of its duration, so a quarter of
/// it (less the write's round trip) is all a holder may be left with, and a grant answered after
/// its safe time must be renewed, or given back. At 1.8 s a loaded 2-core machine's round trip
/// took all of it (before late grants were renewed, the execution's lease_id was spent by the
/// give-back, and it never took the key).
const SWEEP_PERIOD_MS: &str = "2000";
const KEEPALIVE_DURATION_MS: &str = "6000";
const SCHEDULED: &str = "ScheduledJobStateMachine";
const FENCED: &str = "FencedUpdateStateMachine";
static FENCED_TARGET: OnceLock<String> = OnceLock::new();

// ---- executions ---------------------------------------------------------------------------------

async fn sfn(region: &str) -> aws_sdk_sfn::Client {
    sfn_quotas::sfn_client(&stack().moto.endpoint(), region).await
}

/// One execution: its region's client and ARN.
struct Run {
    client: aws_sdk_sfn::Client,
    arn: String,
    name: String,
}

/// Creates the state machine in a fresh region and starts one execution of it.
async fn start(machine: &str, work: &str, input: Value) -> Run {
    start_in(next_region(), machine, work, input).await
}

async fn start_in(region: &str, machine: &str, work: &str, input: Value) -> Run {
    start_definition(region, machine, definition(machine, work), input).await
}

/// Creates a state machine of `definition` (named after `machine`) in `region` and starts one
/// execution of it.
async fn start_definition(region: &str, machine: &str, definition: String, input: Value) -> Run {
    let client = sfn(region).await;
    // One create at a time: moto parses each definition with an ANTLR parser whose caches are
    // shared by its server's threads, and two parses at once can fail one of them
    // (`InvalidDefinition`, "Error=IndexError", seen once in a fresh-clone run; Step Functions
    // itself has no such limit).
    static CREATING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let creating = CREATING.lock().await;
    let sm = client
        .create_state_machine()
        .name(unique(machine))
        .definition(definition)
        .role_arn("arn:aws:iam::123456789012:role/leasehold-example")
        .send()
        .await
        .unwrap_or_else(|e| panic!("create {machine}: {}", aws_smithy_types_display(&e)));
    drop(creating);
    // Named explicitly: the workflows use $$.Execution.Name as the holder (moto leaves it
    // null when StartExecution has no name; Step Functions always makes one).
    let name = unique("run");
    let out = client
        .start_execution()
        .state_machine_arn(sm.state_machine_arn())
        .name(&name)
        .input(input.to_string())
        .send()
        .await
        .unwrap_or_else(|e| panic!("start {machine}: {}", aws_smithy_types_display(&e)));
    Run { client, arn: out.execution_arn().to_string(), name }
}

fn aws_smithy_types_display<E: std::error::Error>(e: &E) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(&format!(": {inner}"));
        src = inner.source();
    }
    s
}

/// The end of an execution.
#[derive(Debug)]
struct Ended {
    status: ExecutionStatus,
    output: Value,
    error: Option<String>,
    cause: Option<String>,
    history: Vec<Event>,
}

/// One history event, flattened.
#[derive(Debug, Clone)]
struct Event {
    kind: HistoryEventType,
    /// The state it belongs to (task events carry none: the last entered state's name).
    state: String,
    error: Option<String>,
    /// A failed or timed-out task's cause, for failure messages.
    cause: Option<String>,
    output: Option<Value>,
}

impl Ended {
    /// Task failures of `state` with their error names.
    fn task_errors(&self, state: &str) -> Vec<String> {
        self.history
            .iter()
            .filter(|e| e.kind == HistoryEventType::TaskFailed && e.state == state)
            .filter_map(|e| e.error.clone())
            .collect()
    }
    fn succeeded_tasks(&self, state: &str) -> Vec<&Event> {
        self.history.iter().filter(|e| e.kind == HistoryEventType::TaskSucceeded && e.state == state).collect()
    }
    fn entered(&self, state: &str) -> bool {
        self.history.iter().any(|e| e.state == state && format!("{:?}", e.kind).ends_with("StateEntered"))
    }
    /// The lambda result (`Payload`) of the last successful `state` task.
    fn task_payload(&self, state: &str) -> Value {
        let ev =
            self.succeeded_tasks(state).last().copied().unwrap_or_else(|| panic!("{state} never succeeded: {self:#?}"));
        ev.output.as_ref().expect("task output")["Payload"].clone()
    }
    fn describe(&self) -> String {
        let mut s = format!(
            "status {:?}, error {:?}, cause {:?}, output {}\n",
            self.status, self.error, self.cause, self.output
        );
        for e in &self.history {
            s.push_str(&format!("  {:?} [{}] {:?} {}\n", e.kind, e.state, e.error, e.cause.as_deref().unwrap_or("")));
        }
        s
    }
}

async fn history(run: &Run) -> Vec<Event> {
    let mut events = vec![];
    let mut state = String::new();
    for e in sfn_quotas::all_history(&run.client, &run.arn).await {
        if let Some(d) = e.state_entered_event_details() {
            state = d.name().to_string();
        }
        let (error, cause, output) = if let Some(d) = e.task_failed_event_details() {
            (d.error().map(str::to_string), d.cause().map(str::to_string), None)
        } else if let Some(d) = e.task_succeeded_event_details() {
            (None, None, d.output().and_then(|o| serde_json::from_str(o).ok()))
        } else if let Some(d) = e.state_exited_event_details() {
            (None, None, d.output().and_then(|o| serde_json::from_str(o).ok()))
        } else if let Some(d) = e.task_timed_out_event_details() {
            (d.error().map(str::to_string), d.cause().map(str::to_string), None)
        } else {
            (None, None, None)
        };
        events.push(Event { kind: e.r#type().clone(), state: state.clone(), error, cause, output });
    }
    events
}

async fn wait_end(run: &Run, timeout: Duration) -> Ended {
    let deadline = Instant::now() + timeout;
    loop {
        let d = run
            .client
            .describe_execution()
            .execution_arn(&run.arn)
            .send()
            .await
            .unwrap_or_else(|e| panic!("describe: {}", aws_smithy_types_display(&e)));
        if *d.status() != ExecutionStatus::Running {
            let output = d.output().and_then(|o| serde_json::from_str(o).ok()).unwrap_or(Value::Null);
            let events = sfn_quotas::check_history(&run.client, &run.arn).await;
            assert!(events <= sfn_quotas::MAX_HISTORY_EVENTS, "{}: {events} history events", run.arn);
            return Ended {
                status: d.status().clone(),
                output,
                error: d.error().map(str::to_string),
                cause: d.cause().map(str::to_string),
                history: history(run).await,
            };
        }
        if Instant::now() > deadline {
            let h = history(run).await;
            panic!(
                "execution {} still running after {timeout:?}: {h:#?}\nemulator log:\n{}",
                run.arn,
                tail(&stack().emulator.server.log_text())
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Waits until the execution's Acquire task succeeded; returns the lease it took.
async fn wait_acquired(run: &Run, timeout: Duration) -> Value {
    let deadline = Instant::now() + timeout;
    loop {
        let h = history(run).await;
        if let Some(e) = h.iter().find(|e| e.kind == HistoryEventType::TaskSucceeded && e.state == "Acquire") {
            return e.output.as_ref().unwrap()["Payload"].clone();
        }
        let ended = h.iter().any(|e| {
            matches!(
                e.kind,
                HistoryEventType::ExecutionFailed
                    | HistoryEventType::ExecutionSucceeded
                    | HistoryEventType::ExecutionAborted
                    | HistoryEventType::ExecutionTimedOut
            )
        });
        if ended || Instant::now() > deadline {
            let ended = wait_end(run, Duration::from_secs(5)).await;
            panic!(
                "{} ended or ran {timeout:?} without acquiring: {}\nemulator log:\n{}",
                run.arn,
                ended.describe(),
                tail(&stack().emulator.server.log_text())
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// EventBridge's Scheduled Event: the heartbeat function runs the keep-alive sweep.
fn scheduled_event() -> Value {
    json!({
        "version": "0", "id": "6a7e8feb-b491-4cf7-a9f1-bf3703467718", "detail-type": "Scheduled Event",
        "source": "aws.events", "account": "123456789012", "time": "2026-01-01T00:00:00Z",
        "region": function_region(), "resources": ["arn:aws:events:us-east-1:123456789012:rule/keepalive"], "detail": {}
    })
}

fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

const LONG: Duration = Duration::from_secs(240);

// ---- fenced update ------------------------------------------------------------------------------

/// A holder whose lease is taken from it during its work (an operator's force-release, and
/// another execution takes the key and writes) writes last with the lower fence: the service
/// integration's fenced write is refused, and the execution fails with Fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_update_refuses_the_stale_holders_write() {
    let s = tokio::task::spawn_blocking(stack).await.unwrap();
    let target = fenced_target_client(&s.dynamo_endpoint, &function_region()).await;
    let coord = coordinator().await;
    let (key, item) = (unique("fenced"), unique("item"));
    // A: 8 s of "work" before its write.
    let a = start(FENCED, "", json!({"key": key, "item_id": item, "value": "A", "work_seconds": 8})).await;
    let lease_a = wait_acquired(&a, LONG).await;
    assert_eq!(lease_a["keepalive"]["execution_arn"], a.arn.as_str(), "bound to the execution: {lease_a}");
    // The key is taken from A during its work; B takes it and writes at once.
    coord.force_release(&key).await.expect("force-release");
    let b = start(FENCED, "", json!({"key": key, "item_id": item, "value": "B", "wait_ms": 20000})).await;
    let end_b = wait_end(&b, LONG).await;
    assert_eq!(end_b.status, ExecutionStatus::Succeeded, "{}", end_b.describe());
    let fence_b = end_b.output["fence"].as_u64().unwrap();
    assert!(fence_b > lease_a["fence"].as_u64().unwrap());
    // A wakes up with the lower fence: the service integration's write is refused.
    let end_a = wait_end(&a, LONG).await;
    assert_eq!(end_a.status, ExecutionStatus::Failed, "{}", end_a.describe());
    assert_eq!(end_a.error.as_deref(), Some("Fenced"), "{}", end_a.describe());
    assert_eq!(end_a.task_errors("FencedWrite"), vec!["DynamoDB.ConditionalCheckFailedException".to_string()]);
    assert!(end_a.entered("Release"), "the stale holder released before failing");
    // The item holds B's value and fence; A's stale write did not land.
    let got = target
        .get_item()
        .table_name(fenced_target())
        .key("id", aws_sdk_dynamodb::types::AttributeValue::S(item.clone()))
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item
        .expect("B's write landed");
    assert_eq!(got.get("value"), Some(&aws_sdk_dynamodb::types::AttributeValue::S("B".into())), "{got:?}");
    assert_eq!(leasehold::fenced::recorded_fence(&got, leasehold::fenced::DEFAULT_ATTRIBUTE), Some(fence_b));
    assert!(!lease_state(&key).await.held, "both executions released");
}

// ---- single flight ------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_flight_racers_take_turns_and_the_loser_retries() {
    tokio::task::spawn_blocking(stack).await.unwrap();
    let key = unique("single-flight");
    // A short server-side wait (cut further by the emulator's deadline), then Retry on LeaseHeld.
    let input = json!({"key": key, "wait_ms": 1000, "work_seconds": 3, "duration_ms": 60000});
    let (a, b) = tokio::join!(start(SINGLE_FLIGHT, "", input.clone()), start(SINGLE_FLIGHT, "", input.clone()));
    let (a_end, b_end) = tokio::join!(wait_end(&a, LONG), wait_end(&b, LONG));
    for (run, end) in [(&a, &a_end), (&b, &b_end)] {
        assert_eq!(end.status, ExecutionStatus::Succeeded, "{}", end.describe());
        assert_eq!(end.output["key"], key.as_str());
        assert_eq!(end.output["holder"], run.name.as_str(), "the holder is the execution's name");
        assert!(end.output["released_at_ms"].as_u64().is_some(), "{}", end.output);
        // Every attempt of one execution sent the same lease_id (made once by States.UUID()).
        let ids: std::collections::BTreeSet<String> = end
            .history
            .iter()
            .filter_map(|e| e.output.as_ref())
            .filter_map(|o| o["request"]["lease_id"].as_str().map(str::to_string))
            .collect();
        assert!(ids.len() <= 1, "{ids:?}");
    }
    let (first, second) = if a_end.output["fence"].as_u64() < b_end.output["fence"].as_u64() {
        (&a_end, &b_end)
    } else {
        (&b_end, &a_end)
    };
    let (f1, f2) = (first.output["fence"].as_u64().unwrap(), second.output["fence"].as_u64().unwrap());
    assert!(f2 > f1, "the later holder has the higher fence: {f1} then {f2}");
    // One worked while the other retried: the second's acquire failed with LeaseHeld at least
    // once, and took the lease only after the first released it.
    assert!(first.task_errors("Acquire").is_empty(), "{}", first.describe());
    let held = second.task_errors("Acquire");
    assert!(!held.is_empty() && held.iter().all(|e| e == "LeaseHeld"), "{}", second.describe());
    // The two stamps come from the functions' clocks, each moved back to the lower bound of
    // the store's clock (DESIGN.md, "Clocks"): two emulator instances may stand up to about a
    // second apart on DynamoDB Local. An overlap would put the second grant a whole work
    // (3 s) before the release.
    assert!(
        second.output["acquired_at_ms"].as_u64().unwrap() + 1_500 >= first.output["released_at_ms"].as_u64().unwrap(),
        "no overlap: {} / {}",
        first.output,
        second.output
    );
    // The work step got the fence in its state: $.lease.fence.
    let placeholder_input = second
        .history
        .iter()
        .find(|e| e.state == "Placeholder" && e.kind == HistoryEventType::WaitStateExited)
        .and_then(|e| e.output.clone())
        .expect("the placeholder ran");
    assert_eq!(placeholder_input["lease"]["fence"].as_u64(), Some(f2));

    let state = lease_state(&key).await;
    assert!(!state.held, "{state:?}");
    assert_eq!(state.fence, f2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_flight_failing_work_still_releases() {
    tokio::task::spawn_blocking(stack).await.unwrap();
    let key = unique("single-flight-fail");
    // The work step invokes `acquire` with the work payload ({key, fence, holder, input}),
    // which it rejects with InvalidRequest: a work function that fails.
    let run = start(SINGLE_FLIGHT, "acquire", json!({"key": key, "duration_ms": 60000})).await;
    let end = wait_end(&run, LONG).await;
    assert_eq!(end.status, ExecutionStatus::Failed, "{}", end.describe());
    assert_eq!(end.error.as_deref(), Some("WorkflowFailed"));
    let cause: Value = serde_json::from_str(end.cause.as_deref().unwrap()).expect("cause is JSON");
    assert_eq!(cause["Error"], "InvalidRequest", "{cause}");
    assert_eq!(end.task_errors("Work"), vec!["InvalidRequest".to_string()]);
    // The work got the lease's fence.
    let fence = end.task_payload("Acquire")["fence"].as_u64().unwrap();
    assert!(end.entered("Release"));
    assert_eq!(end.task_payload("Release")["fence"].as_u64(), Some(fence), "{}", end.describe());
    let state = lease_state(&key).await;
    assert!(!state.held, "released although the work failed: {state:?}");
    assert_eq!(state.fence, fence);

    // The next execution takes the key at once, with a higher fence.
    let next = start(SINGLE_FLIGHT, "", json!({"key": key, "work_seconds": 0, "duration_ms": 60000})).await;
    let next_end = wait_end(&next, LONG).await;
    assert_eq!(next_end.status, ExecutionStatus::Succeeded, "{}", next_end.describe());
    assert!(next_end.task_errors("Acquire").is_empty());
    assert!(next_end.output["fence"].as_u64().unwrap() > fence, "{} after {fence}", next_end.output);
    assert!(!lease_state(&key).await.held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_flight_keepalive_outlives_the_lease_duration() {
    tokio::task::spawn_blocking(stack).await.unwrap();
    let coord = coordinator().await;
    // An 8 s lease held through 24 s of work: the scheduled sweep (the heartbeat function with
    // EventBridge's Scheduled Event) renews it while the execution runs. The execution runs in
    // the functions' region so that their DescribeExecution finds it. (8 s: one round of this
    // loop, a sweep included, took more than 4 s on a heavily loaded machine.)
    let key = unique("keepalive");
    let until = coord.now_ms() + 10 * 60 * 1000;
    let input = json!({"key": key, "duration_ms": 8000, "work_seconds": 24, "keepalive_until_ms": until});
    let run = start_in(&function_region(), SINGLE_FLIGHT, "", input).await;
    let lease = wait_acquired(&run, LONG).await;
    assert_eq!(lease["keepalive"]["until_ms"].as_u64(), Some(until), "{lease}");
    assert_eq!(lease["keepalive"]["execution_arn"], run.arn.as_str());
    let first_expiry = lease["expires_at_ms"].as_u64().unwrap();
    let scheduled = scheduled_event();
    let mut renewed = 0;
    let mut held_past_first_expiry = false;
    let end = loop {
        let d = run.client.describe_execution().execution_arn(&run.arn).send().await.unwrap();
        if *d.status() != ExecutionStatus::Running {
            break wait_end(&run, LONG).await;
        }
        let inv = stack().emulator.invoke("heartbeat", &scheduled).await;
        assert!(inv.error_type.is_none(), "sweep: {:?}", inv.body);
        // A run cut short by its invocation's end (3 s in the emulator, which sends no deadline:
        // a loaded machine's DescribeExecution can take most of it) counts the lease it was
        // handling as an error and says it is incomplete; the next run handles it. A complete
        // run has no error.
        if inv.body["complete"] == true {
            assert_eq!(inv.body["errors"], 0, "{}", inv.body);
        }
        renewed += inv.body["renewed"].as_u64().unwrap_or(0);
        let state = lease_state(&key).await;
        if coord.now_ms() > first_expiry + 500 && state.held {
            assert!(state.expires_at_ms.unwrap() > first_expiry, "{state:?}");
            held_past_first_expiry = true;
        }
        tokio::time::sleep(Duration::from_millis(700)).await;
    };
    assert!(held_past_first_expiry, "the sweep kept the 8 s lease alive");
    assert_eq!(end.status, ExecutionStatus::Succeeded, "{}", end.describe());
    assert!(renewed >= 3, "renewed {renewed} times");
    let released = end.output["released_at_ms"].as_u64().unwrap();
    assert!(released > first_expiry + 2000, "held well past its first expiry ({first_expiry}) until {released}");
    assert!(!lease_state(&key).await.held);
}

/// A plain lease ("keepalive": false) is not renewed, so it must outlast the longest the work
/// step can run: a shorter one is refused before anything is taken. One taken from the
/// execution during its work (an operator's force-release, and another holder takes the key)
/// fails the execution with LeaseNotReleased instead of reporting success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_flight_plain_lease_outlasts_its_work_or_is_refused() {
    tokio::task::spawn_blocking(stack).await.unwrap();
    let coord = coordinator().await;
    let key = unique("plain-short");
    let input = json!({"key": key, "duration_ms": 60000, "work_seconds": 1, "keepalive": false});
    let end = wait_end(&start(SINGLE_FLIGHT, "", input).await, LONG).await;
    assert_eq!(end.status, ExecutionStatus::Failed, "{}", end.describe());
    assert_eq!(end.error.as_deref(), Some("InvalidInput"), "{}", end.describe());
    assert!(!end.entered("Acquire"), "{}", end.describe());
    assert!(coord.get(&key).await.is_err(), "nothing was written for {key}");

    let key = unique("lost");
    let input = json!({"key": key, "duration_ms": 3_600_000, "work_seconds": 6, "keepalive": false});
    let run = start(SINGLE_FLIGHT, "", input).await;
    let lease = wait_acquired(&run, LONG).await;
    assert!(lease.get("keepalive").is_none(), "a plain lease: {lease}");
    coord.force_release(&key).await.expect("force-release");
    let other = coord
        .acquire(&key, "other", Some(Duration::from_secs(30)), leasehold::AcquireOptions::default())
        .await
        .expect("the force-released key is free to take");
    assert!(other.fence > lease["fence"].as_u64().unwrap());
    let end = wait_end(&run, LONG).await;
    assert_eq!(end.status, ExecutionStatus::Failed, "{}", end.describe());
    assert_eq!(end.error.as_deref(), Some("LeaseNotReleased"));
    assert_eq!(end.task_errors("Release"), vec!["NotHolder".to_string()]);
    // The other holder's lease is untouched.
    let state = lease_state(&key).await;
    assert!(state.held && state.holder == "other" && state.fence == other.fence, "{state:?}");
    coord.release(&key, &other.lease_id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_flight_keepalive_lasts_three_sweeps_and_shorter_is_refused() {
    tokio::task::spawn_blocking(stack).await.unwrap();
    let coord = coordinator().await;
    let until = coord.now_ms() + 10 * 60 * 1000;
    // No duration_ms: the workflow asks for the template's keep-alive duration (3 sweeps),
    // not its 60 s default... here the test's 2 s sweep, so 6 s.
    let key = unique("keepalive-default");
    let run = start(SINGLE_FLIGHT, "", json!({"key": key, "work_seconds": 0, "keepalive_until_ms": until})).await;
    let end = wait_end(&run, LONG).await;
    assert_eq!(end.status, ExecutionStatus::Succeeded, "{}", end.describe());
    let lease = end.task_payload("Acquire");
    let want: u64 = KEEPALIVE_DURATION_MS.parse().unwrap();
    assert_eq!(lease["duration_ms"].as_u64(), Some(want), "{lease}");
    assert_eq!(want, 3 * SWEEP_PERIOD_MS.parse::<u64>().unwrap());

    // A shorter keep-alive lease is refused (InvalidRequest naming the minimum): nothing is
    // taken, and the execution fails after its release.
    let key = unique("keepalive-short");
    let run = start(SINGLE_FLIGHT, "", json!({"key": key, "duration_ms": 1000, "keepalive_until_ms": until})).await;
    let end = wait_end(&run, LONG).await;
    assert_eq!(end.status, ExecutionStatus::Failed, "{}", end.describe());
    assert_eq!(end.error.as_deref(), Some("WorkflowFailed"));
    assert_eq!(end.task_errors("Acquire"), vec!["InvalidRequest".to_string()]);
    let cause: Value = serde_json::from_str(end.cause.as_deref().unwrap()).unwrap();
    assert!(cause["Cause"].as_str().unwrap().contains(&format!("{want} ms")), "names the minimum: {cause}");
    assert!(coord.get(&key).await.is_err(), "nothing was written for the refused lease");
}

// ---- scheduled single execution -----------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduled_job_takes_its_key_base64_encoded_from_the_schedule() {
    tokio::task::spawn_blocking(stack).await.unwrap();
    // The schedule's input as the template builds it (Fn::Base64 of ScheduledJobKey): a key
    // with a quote and a backslash stays valid JSON and arrives intact.
    let key = format!("{}/\"quoted\"\\back\\slash", unique("scheduled-b64"));
    let input = json!({"key_base64": aws_smithy_types::base64::encode(&key), "duration_ms": 60000});
    let run = start(SCHEDULED, "", input).await;
    let end = wait_end(&run, LONG).await;
    assert_eq!(end.status, ExecutionStatus::Succeeded, "{}", end.describe());
    assert_eq!(end.output["skipped"], false, "{}", end.output);
    assert_eq!(end.output["key"], key.as_str());
    let state = lease_state(&key).await;
    assert!(!state.held && state.fence == end.output["fence"].as_u64().unwrap(), "{state:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduled_job_runs_once_and_the_overlapping_run_skips() {
    tokio::task::spawn_blocking(stack).await.unwrap();
    let key = unique("scheduled");
    let input = json!({"key": key, "work_seconds": 3, "duration_ms": 60000});
    let (a, b) = tokio::join!(start(SCHEDULED, "", input.clone()), start(SCHEDULED, "", input.clone()));
    let (a_end, b_end) = tokio::join!(wait_end(&a, LONG), wait_end(&b, LONG));
    let mut ran = vec![];
    let mut skipped = vec![];
    for end in [&a_end, &b_end] {
        assert_eq!(end.status, ExecutionStatus::Succeeded, "{}", end.describe());
        if end.output["skipped"] == true {
            skipped.push(end);
        } else {
            ran.push(end);
        }
    }
    assert_eq!((ran.len(), skipped.len()), (1, 1), "{}\n{}", a_end.describe(), b_end.describe());
    let (ran, skipped) = (ran[0], skipped[0]);
    assert_eq!(skipped.output, json!({"skipped": true, "key": key, "reason": "LeaseHeld"}));
    // It tried once, without waiting or retrying, and released nothing.
    assert_eq!(skipped.task_errors("Acquire"), vec!["LeaseHeld".to_string()]);
    assert!(!skipped.entered("Release") && !skipped.entered("Placeholder"));
    assert_eq!(ran.output["skipped"], false);
    let fence = ran.output["fence"].as_u64().unwrap();
    assert!(ran.entered("Placeholder") && ran.entered("Release"));
    let state = lease_state(&key).await;
    assert!(!state.held);
    assert_eq!(state.fence, fence);

    // The next scheduled run finds the key free and works with a higher fence.
    let next = start(SCHEDULED, "", json!({"key": key, "work_seconds": 0, "duration_ms": 60000})).await;
    let next_end = wait_end(&next, LONG).await;
    assert_eq!(next_end.status, ExecutionStatus::Succeeded, "{}", next_end.describe());
    assert_eq!(next_end.output["skipped"], false);
    assert!(next_end.output["fence"].as_u64().unwrap() > fence);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduled_job_failing_work_still_releases() {
    tokio::task::spawn_blocking(stack).await.unwrap();
    let key = unique("scheduled-fail");
    let run = start(SCHEDULED, "acquire", json!({"key": key, "duration_ms": 60000})).await;
    let end = wait_end(&run, LONG).await;
    assert_eq!(end.status, ExecutionStatus::Failed, "{}", end.describe());
    assert_eq!(end.error.as_deref(), Some("WorkflowFailed"));
    assert_eq!(end.task_errors("Work"), vec!["InvalidRequest".to_string()]);
    let fence = end.task_payload("Acquire")["fence"].as_u64().unwrap();
    assert_eq!(end.task_payload("Release")["fence"].as_u64(), Some(fence));
    let state = lease_state(&key).await;
    assert!(!state.held, "{state:?}");

    let next = start(SCHEDULED, "", json!({"key": key, "work_seconds": 0, "duration_ms": 60000})).await;
    let next_end = wait_end(&next, LONG).await;
    assert_eq!(next_end.status, ExecutionStatus::Succeeded, "{}", next_end.describe());
    assert_eq!(next_end.output["skipped"], false, "the failed run left the key free");
    assert!(next_end.output["fence"].as_u64().unwrap() > fence);
}

/// Each execution needs a region of its own (see the module comment).
#[test]
fn regions_are_distinct() {
    let set: std::collections::BTreeSet<&str> = MOTO_REGIONS.iter().copied().collect();
    assert_eq!(set.len(), MOTO_REGIONS.len());
    // Executions started by the tests (at most 21 here) fit, with the functions' region left out.
    assert!(MOTO_REGIONS.len() > 22);
}

// ---- what States.ALL cannot catch ---------------------------------------------------------------

/// A work result over Step Functions' 256 KiB (the adapter enforces the quota) fails the task
/// with an error no Catch catches: the execution ends without its Release. The lease is a
/// keep-alive lease bound to the execution (the workflow's default), so the next sweep finds
/// the execution ended and frees the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_flight_oversized_work_result_leaves_the_key_to_the_sweep() {
    tokio::task::spawn_blocking(stack).await.unwrap();
    let key = unique("huge-result");
    let run = start(SINGLE_FLIGHT, "huge", json!({"key": key, "duration_ms": 60000})).await;
    sfn_quotas::fail_on_violation(&run.client, &run.arn, "/functions/huge/", LONG).await;
    let end = wait_end(&run, LONG).await;
    assert!(matches!(end.status, ExecutionStatus::Aborted | ExecutionStatus::Failed), "{}", end.describe());
    assert!(!end.entered("Release"), "nothing caught it: {}", end.describe());
    let seen = sfn_quotas::Quotas::global().violations();
    assert!(seen.iter().any(|v| v.contains("/functions/huge/")), "the adapter enforced the quota: {seen:?}");
    // Other tests run their own sweeps at the same time (every 0.7 s), and one of those may
    // already have released this lease: then it is released, after the execution ended and by
    // no Release of its own (checked above), which is what a sweep does.
    let state = lease_state(&key).await;
    if !state.held {
        assert!(state.released_at_ms.is_some(), "released, not lapsed: {state:?}");
        sfn_quotas::assert_within_quotas_except(&["/functions/huge/", "/functions/redrive-work/"]);
        return;
    }
    let ka = state.keepalive.clone().expect("a keep-alive lease by default");
    assert_eq!(ka.execution_arn.as_deref(), Some(run.arn.as_str()), "{state:?}");
    let coord = coordinator().await;
    assert!(ka.until_ms > coord.now_ms() + 300 * 24 * 3600 * 1000, "kept alive for the execution's life: {ka:?}");
    // The sweep describes the execution (FAILED) and releases its lease. A concurrent sweep may
    // release it first: if after this sweep read the index, this one counts it as raced; if
    // before, the lease has left the index and this sweep does not see it (it scans only the
    // other tests' leases). Either way a sweep freed the key: released, not lapsed.
    let inv = stack().emulator.invoke("heartbeat", &scheduled_event()).await;
    assert!(inv.error_type.is_none(), "sweep: {:?}", inv.body);
    let state = lease_state(&key).await;
    assert!(!state.held, "the sweep freed the key: {state:?}");
    assert!(state.released_at_ms.is_some(), "released, not lapsed: {state:?}");
    sfn_quotas::assert_within_quotas_except(&["/functions/huge/", "/functions/redrive-work/"]);
}

/// FencedUpdate without item_id: refused before the acquire (after it, the missing path would
/// fail the execution with States.Runtime, holding the lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_update_without_item_id_leases_nothing() {
    tokio::task::spawn_blocking(stack).await.unwrap();
    let key = unique("fenced-no-item");
    let run = start(FENCED, "", json!({"key": key, "value": "A"})).await;
    let end = wait_end(&run, LONG).await;
    assert_eq!(end.status, ExecutionStatus::Failed, "{}", end.describe());
    assert_eq!(end.error.as_deref(), Some("InvalidInput"), "{}", end.describe());
    assert!(!end.entered("Acquire"), "{}", end.describe());
    assert!(coordinator().await.get(&key).await.is_err(), "nothing was written for {key}");
}

/// Over HTTP (an API Gateway event), `task_token` and `keepalive.execution_arn` are refused
/// with InvalidRequest and nothing is written; a direct invoke still takes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_refuses_invoke_only_fields() {
    tokio::task::spawn_blocking(stack).await.unwrap();
    let routes = leasehold_tests::apigw::routes(raw_template());
    let coord = coordinator().await;
    let key = unique("invoke-only");
    let arn = "arn:aws:states:us-east-1:123456789012:execution:other:run-1";
    let bodies = [
        (json!({"holder": "h", "duration_ms": 60000, "task_token": "AAAAtoken"}), "task_token"),
        (
            json!({"holder": "h", "duration_ms": 60000, "keepalive": {"until_ms": coord.now_ms() + 600_000, "execution_arn": arn}}),
            "keepalive.execution_arn",
        ),
    ];
    for (body, field) in &bodies {
        let (function, event) = leasehold_tests::apigw::request(
            &routes,
            "POST",
            &format!("/leases/acquire/{key}"),
            Some(&body.to_string()),
            coord.now_ms(),
        )
        .expect("routed");
        assert_eq!(function, "acquire");
        let inv = stack().emulator.invoke("acquire", &event).await;
        assert!(inv.error_type.is_none(), "HTTP answers are never function errors: {:?}", inv.body);
        assert_eq!(inv.body["statusCode"], 400, "{}", inv.body);
        let answer: Value = serde_json::from_str(inv.body["body"].as_str().unwrap()).unwrap();
        assert_eq!(answer["error"], "InvalidRequest", "{answer}");
        assert!(answer["message"].as_str().unwrap().contains(field), "names {field}: {answer}");
        assert!(coord.get(&key).await.is_err(), "nothing written");
    }
    // The same keep-alive by direct invoke (a state machine's task) is taken.
    let mut direct = bodies[1].0.clone();
    direct["key"] = json!(key);
    let inv = stack().emulator.invoke("acquire", &direct).await;
    assert!(inv.error_type.is_none(), "{:?}", inv.body);
    assert_eq!(inv.body["keepalive"]["execution_arn"], arn);
    coord.release(&key, &leasehold::LeaseId::from_string(inv.body["lease_id"].as_str().unwrap())).await.unwrap();
}

// ---- redrive ------------------------------------------------------------------------------------

/// The redrive test's work function, served by the invoke adapter as `redrive-work`: records
/// each call (key, fence, when); its first call answers more than Step Functions' 256 KiB (the
/// execution fails at the work step with States.DataLimitExceeded, which no Catch catches:
/// what an operator then fixes and redrives), later ones a small answer after `REDRIVE_WORK`.
#[derive(Default)]
struct RedriveWork {
    calls: std::sync::Mutex<Vec<(String, u64, u64)>>,
}

const REDRIVE_WORK: Duration = Duration::from_millis(500);

fn redrive_work() -> &'static RedriveWork {
    static W: OnceLock<RedriveWork> = OnceLock::new();
    W.get_or_init(RedriveWork::default)
}

impl RedriveWork {
    async fn handle(&self, path: &str, body: &[u8]) -> hyper::Response<Full<Bytes>> {
        let payload: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let key = payload["key"].as_str().unwrap_or("?").to_string();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
        let first = {
            let mut calls = self.calls.lock().unwrap();
            let first = !calls.iter().any(|(k, _, _)| *k == key);
            calls.push((key, payload["fence"].as_u64().unwrap_or(0), now));
            first
        };
        if first {
            return sfn_quotas::oversized_result(path, 300 * 1024).await;
        }
        tokio::time::sleep(REDRIVE_WORK).await;
        hyper::Response::builder()
            .status(200)
            .header("x-amzn-requestid", request_id())
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(json!({"done": payload["fence"]}).to_string())))
            .expect("response")
    }

    fn calls(&self, key: &str) -> Vec<(u64, u64)> {
        self.calls.lock().unwrap().iter().filter(|(k, _, _)| k == key).map(|(_, f, t)| (*f, *t)).collect()
    }
}

/// The scheduled keep-alive sweep, run every 500 ms (several times per sweep period here) until the
/// guard is dropped, as EventBridge runs it.
struct Sweeping(tokio::task::JoinHandle<()>);

impl Drop for Sweeping {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn sweeping() -> Sweeping {
    Sweeping(tokio::spawn(async {
        loop {
            let inv = stack().emulator.invoke("heartbeat", &scheduled_event()).await;
            assert!(inv.error_type.is_none(), "sweep: {:?}", inv.body);
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }))
}

/// The input the state `state` was entered with in the execution's history.
async fn entered_with(run: &Run, state: &str) -> Value {
    let h = sfn_quotas::all_history(&run.client, &run.arn).await;
    let d = h
        .iter()
        .filter_map(|e| e.state_entered_event_details())
        .rfind(|d| d.name() == state)
        .unwrap_or_else(|| panic!("{state} was never entered"));
    serde_json::from_str(d.input().expect("input")).expect("JSON input")
}

/// `RedriveExecution` resumes a failed execution at the state that failed, with the input it
/// had there, after the keep-alive sweep released its lease (the execution had ended) and
/// another holder took the key. moto runs no redrive (statemachines::for_moto), so the test
/// runs what Step Functions runs: the definition from that state (Work), in run 1, with its
/// input from the first run's history. The redriven work step is a DryRun: the work function
/// never sees the stale fence while the other holder has the key; the execution gives back
/// the old lease_id, takes a new one (`-r1`), waits for the other holder and works with a fence
/// above its. The same resumption with the work step's gate removed calls the work function
/// with the stale fence while another holder has the key: what the gate prevents.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redriven_execution_takes_its_lease_anew_before_it_works() {
    tokio::task::spawn_blocking(stack).await.unwrap();
    let coord = coordinator().await;
    let key = unique("redrive");
    let sweep = sweeping();
    // Run 0 fails at its work step (a result over 256 KiB): no Release of its own.
    // An 8 s lease: a loaded machine's sweep (the loop below) can take seconds.
    let first = start(SINGLE_FLIGHT, "redrive-work", json!({"key": key, "wait_ms": 1000, "duration_ms": 8000})).await;
    sfn_quotas::fail_on_violation(&first.client, &first.arn, "/functions/redrive-work/", LONG).await;
    let end = wait_end(&first, LONG).await;
    assert!(matches!(end.status, ExecutionStatus::Aborted | ExecutionStatus::Failed), "{}", end.describe());
    assert!(!end.entered("Release"), "{}", end.describe());
    let stale_fence = end.task_payload("Acquire")["fence"].as_u64().unwrap();
    let work_input = entered_with(&first, "Work").await;
    assert_eq!(work_input["lease"]["fence"].as_u64(), Some(stale_fence));
    // The sweep renewed the lease while the execution ran, and releases it once it ended.
    let deadline = Instant::now() + Duration::from_secs(30);
    let st = loop {
        let st = lease_state(&key).await;
        if !st.held || Instant::now() > deadline {
            break st;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(!st.held && st.released_at_ms.is_some(), "the sweep released it: {st:?}");
    // Another holder takes the key for 4 s.
    let other = coord
        .acquire(&key, "other", Some(Duration::from_secs(60)), leasehold::AcquireOptions::default())
        .await
        .expect("the released key is free");
    let holder = {
        let (coord, key, other) = (coord.clone(), key.clone(), other.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(4)).await;
            let released = coord.release(&key, &other.lease_id).await.expect("release");
            released.released_at_ms
        })
    };
    // The redrive: run 1, from Work, with Work's input.
    let redriven = statemachines::resumed_at(&definition_as_written(SINGLE_FLIGHT, "redrive-work"), "Work", 1);
    let dry_before = sfn_quotas::dry_runs().iter().filter(|p| p.contains("/functions/redrive-work/")).count();
    let run = start_definition(next_region(), SINGLE_FLIGHT, redriven, work_input.clone()).await;
    let end = wait_end(&run, LONG).await;
    let other_released = holder.await.unwrap();
    assert_eq!(end.status, ExecutionStatus::Succeeded, "{}", end.describe());
    let dry = sfn_quotas::dry_runs().iter().filter(|p| p.contains("/functions/redrive-work/")).count();
    assert_eq!(dry, dry_before + 1, "the resumed work step was a dry run");
    let calls = redrive_work().calls(&key);
    assert_eq!(calls.len(), 2, "one call in run 0, one after the new take: {calls:?}");
    let (fence, at) = calls[1];
    assert!(fence > other.fence && other.fence > stale_fence, "{stale_fence} < {} < {fence}", other.fence);
    assert!(at >= other_released, "worked at {at}, after the other holder released at {other_released}");
    assert_eq!(end.output["fence"].as_u64(), Some(fence), "{}", end.output);
    let ids: std::collections::BTreeSet<String> = end
        .history
        .iter()
        .filter_map(|e| e.output.as_ref())
        .filter_map(|o| o["request"]["lease_id"].as_str().map(str::to_string))
        .collect();
    let old_id = work_input["request"]["lease_id"].as_str().unwrap();
    assert!(ids.contains(&format!("{old_id}-r1")), "a new lease_id for the new take: {ids:?}");
    assert!(!lease_state(&key).await.held);
    drop(sweep);

    // Without the gate, the same resumption works on the stale fence while another holds the key.
    let intruder = coord
        .acquire(&key, "intruder-check", Some(Duration::from_secs(60)), leasehold::AcquireOptions::default())
        .await
        .expect("free");
    let mut ungated: Value = serde_json::from_str(&definition_as_written(SINGLE_FLIGHT, "redrive-work")).unwrap();
    ungated["States"]["Work"]["Parameters"].as_object_mut().unwrap().remove("InvocationType.$");
    let ungated = statemachines::resumed_at(&ungated.to_string(), "Work", 1);
    let control = start_definition(next_region(), SINGLE_FLIGHT, ungated, work_input).await;
    let deadline = Instant::now() + LONG;
    while redrive_work().calls(&key).len() < 3 {
        assert!(Instant::now() < deadline, "the ungated work step never ran");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(redrive_work().calls(&key)[2].0, stale_fence, "the stale fence reached the work function");
    assert!(lease_state(&key).await.held, "while another holder had the key");
    control.client.stop_execution().execution_arn(&control.arn).send().await.expect("stop");
    coord.release(&key, &intruder.lease_id).await.unwrap();
    sfn_quotas::assert_within_quotas_except(&["/functions/huge/", "/functions/redrive-work/"]);
}

// ---- the rule: work inside the lease ---------------------------------------------------------

/// Every definition in statemachines/ that takes a lease keeps its work inside it (the rule of
/// leasehold_tests::statemachines::rule): a new state machine cannot ship without it.
#[test]
fn every_state_machine_keeps_its_work_inside_its_lease() {
    let all = statemachines::all();
    assert!(all.len() >= 6, "{:?}", all.iter().map(|(n, _)| n).collect::<Vec<_>>());
    let mut problems = Vec::new();
    for (name, def) in &all {
        let r = statemachines::rule::check(name, def);
        println!("{name}: takes {:?}, bound work {:?}, timed work {:?}", r.takes, r.bound_work, r.timed_work);
        problems.extend(r.violations.iter().cloned());
        if r.works_under_a_lease() {
            assert!(!r.bound_work.is_empty() || !r.timed_work.is_empty(), "{name}: no work state found");
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
    // A bound lease is renewed and freed by the sweep only if the sweep may describe the
    // executions it is bound to: every state machine of the template whose definition binds a
    // lease has its executions in the heartbeat role's DescribeExecution grant.
    let t = raw_template();
    let grant = t["Resources"]["HeartbeatRole"]["Properties"]["Policies"].to_string();
    for (logical, r) in t["Resources"].as_object().unwrap() {
        if r["Type"] != "AWS::Serverless::StateMachine" {
            continue;
        }
        let uri = r["Properties"]["DefinitionUri"].as_str().unwrap();
        let name = statemachines::name_of_uri(uri);
        let rule = statemachines::rule::check(name, &statemachines::parsed(name));
        if rule.bound_work.is_empty() {
            continue;
        }
        let named = match r["Properties"]["Name"]["Fn::Sub"][0].as_str() {
            Some(pattern) => format!("execution:{pattern}:*"),
            None => format!("execution:${{{logical}.Name}}:*"),
        };
        assert!(grant.contains(&named), "{logical} binds leases, but the sweep may not describe {named}");
    }
}

/// The rule finds what it is for: each mutation below of a shipped definition (the first is
/// QueuedSingleFlight as it shipped before: a lease not bound to the execution, a work step
/// without a timeout whose Lambda errors are retried at once) breaks it, and is named.
#[test]
fn the_rule_finds_work_outside_the_lease() {
    type Mutation = fn(&mut Value);
    fn states(d: &mut Value) -> &mut serde_json::Map<String, Value> {
        d["States"].as_object_mut().unwrap()
    }
    fn iteration<'a>(d: &'a mut Value, map: &str) -> &'a mut serde_json::Map<String, Value> {
        d["States"][map]["ItemProcessor"]["States"].as_object_mut().unwrap()
    }
    fn choices_without(d: &mut Value, state: &str, var: &str) {
        let c = d["States"][state]["Choices"].as_array_mut().unwrap();
        c.retain(|r| r["Variable"] != var && r["Not"]["Variable"] != var);
    }
    let cases: Vec<(&str, Mutation, &str)> = vec![
        (
            "queued_single_flight",
            |d| {
                let s = states(d);
                s["Request"]["Parameters"].as_object_mut().unwrap().remove("keepalive");
                s["WaitForTurn"]["Parameters"]["Payload"].as_object_mut().unwrap().remove("keepalive.$");
                let w = s["Work"].as_object_mut().unwrap();
                w.remove("TimeoutSeconds");
                w["Retry"] = json!([{"ErrorEquals": ["Lambda.ServiceException", "Lambda.TooManyRequestsException"], "IntervalSeconds": 1, "BackoffRate": 2, "MaxAttempts": 3}]);
            },
            "neither bound to the execution nor of a checked duration",
        ),
        (
            "queued_single_flight",
            |d| drop(states(d)["Work"]["Parameters"].as_object_mut().unwrap().remove("InvocationType.$")),
            "runs on a redrive",
        ),
        (
            "single_flight",
            |d| {
                states(d)["Work"]["Retry"] =
                    json!([{"ErrorEquals": ["Lambda.ServiceException"], "IntervalSeconds": 1, "MaxAttempts": 1}]);
            },
            "sooner than the last invocation must have ended",
        ),
        (
            "single_flight",
            |d| states(d)["Settle"]["Seconds"] = json!(10),
            "releases while the work's invocation may still run",
        ),
        (
            "single_flight",
            |d| drop(states(d)["Work"]["Catch"].as_array_mut().unwrap().remove(0)),
            "releases while the work's invocation may still run",
        ),
        (
            "single_flight",
            |d| {
                for c in states(d)["PlainLease"]["Choices"].as_array_mut().unwrap() {
                    if c["NumericLessThan"].is_u64() {
                        c["NumericLessThan"] = json!(60000);
                    }
                }
            },
            "lasts at least 60000 ms, but the path runs",
        ),
        (
            "scheduled_job",
            |d| drop(states(d)["Work"].as_object_mut().unwrap().remove("TimeoutSeconds")),
            "without TimeoutSeconds under a timed lease",
        ),
        ("scheduled_job", |d| choices_without(d, "PlainLease", "$.args.work_seconds"), "a Wait of unchecked length"),
        (
            "concurrency_limited",
            |d| iteration(d, "ForEachItem")["Work"]["Retry"][0]["MaxAttempts"] = json!(3),
            "but the path runs",
        ),
        ("concurrency_limited", |d| choices_without(d, "Validate", "$.args.duration_ms"), "nor of a checked duration"),
        (
            "fenced_update",
            |d| {
                let p = states(d)["FencedWrite"]["Parameters"].as_object_mut().unwrap();
                p.remove("ConditionExpression.$");
                p.insert("ConditionExpression".into(), json!(leasehold::fenced::FENCE_CONDITION));
            },
            "runs on a redrive",
        ),
        (
            "batch_processor",
            |d| drop(states(d)["TakeBatch"]["Parameters"]["Payload"].as_object_mut().unwrap().remove("keepalive")),
            "a timed lease held across a Map",
        ),
    ];
    for (name, mutate, expect) in cases {
        let mut def = statemachines::parsed(name);
        assert!(statemachines::rule::check(name, &def).violations.is_empty(), "{name} as shipped");
        mutate(&mut def);
        let found = statemachines::rule::check(name, &def).violations;
        assert!(found.iter().any(|v| v.contains(expect)), "{name}: expected {expect:?}, found {found:#?}");
    }
}

/// States entered (Step Functions bills one state transition each) and Lambda tasks scheduled
/// (invocations) of an execution's history.
fn transitions_and_invocations(end: &Ended) -> (usize, usize) {
    let entered = end.history.iter().filter(|e| format!("{:?}", e.kind).ends_with("StateEntered")).count();
    let lambdas = end
        .history
        .iter()
        .filter(|e| matches!(e.kind, HistoryEventType::TaskScheduled | HistoryEventType::LambdaFunctionScheduled))
        .count();
    (entered, lambdas)
}

/// What a SingleFlight run costs in Step Functions and Lambda (COSTS.md): uncontended (the
/// placeholder work step, the default keep-alive) it enters 14 states (its input checked and
/// configured, acquire, work, release, the outcome) and invokes the functions twice (acquire,
/// release). ConcurrencyLimited's are measured in concurrency_limited.rs, the BatchProcessor's in
/// batch.rs, QueuedSingleFlight's in queue_workflow.rs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_transitions_and_invocations_per_run() {
    tokio::task::spawn_blocking(stack).await.unwrap();
    let run = start(SINGLE_FLIGHT, "", json!({"key": unique("cost"), "work_seconds": 0})).await;
    let end = wait_end(&run, LONG).await;
    assert_eq!(end.status, ExecutionStatus::Succeeded, "{}", end.describe());
    let (transitions, invocations) = transitions_and_invocations(&end);
    println!("single flight, uncontended: {transitions} state transitions, {invocations} Lambda invocations");
    assert_eq!((transitions, invocations), (14, 2), "{}", end.describe());
}
