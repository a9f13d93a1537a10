//! Step Functions' quotas that moto does not enforce, enforced by the tests' adapter in front
//! of moto and the Lambda emulator:
//! - 256 KiB per payload: a Lambda task's input (the Invoke request) and its result (the
//!   Invoke answer), and a StartExecution's input. Step Functions fails such a task with
//!   `States.DataLimitExceeded`, which no `Catch` catches. The adapter records the violation
//!   ([`Quotas::violations`]) and answers the task with that error, so the execution fails
//!   and the test that checks the record fails too.
//! - 25,000 events in one execution's history: [`history_events`] counts them from moto's
//!   GetExecutionHistory and [`check_history_within`] records (and stops) an execution past
//!   them. The limit is a parameter, so that a test can lower it ([`MAX_HISTORY_EVENTS`] is
//!   Step Functions' own) and make a short drain cross it several times.
//! - 256 KiB per state's input and output (and an execution's): moto keeps them in the
//!   history, and [`check_history_within`] records each one over the quota (Step Functions
//!   fails such an execution with `States.DataLimitExceeded`).
//!
//! A state machine's `arn:aws:states:::states:startExecution` task (the BatchProcessor's
//! continue-as-new) cannot run on moto 5.2: its service integration hands the task's
//! parameters, cased as Step Functions writes them (`StateMachineArn`, `Name`, `Input`), to
//! boto3 unchanged (its `_normalise_parameters` does nothing; the mapping onto the API's
//! members, `_to_boto_request`, is there but never called) with parameter validation off,
//! and botocore's JSON serializer looks each name up among the API's members
//! (`stateMachineArn`, `name`, `input`): `KeyError: 'StateMachineArn'` before any request is
//! sent. The `.sync` and `.sync:2` variants and `aws-sdk:sfn:startExecution` go the same way,
//! and the camel-cased names that botocore would take are not what Step Functions accepts,
//! so no one definition runs on both. The tests therefore give moto the definition with each
//! such task's `Resource` (only that) pointed at a Lambda function the adapter serves
//! ([`route_start_execution_through_adapter`]): moto invokes it with the task's evaluated
//! `Parameters` as the payload, and the adapter starts the execution on moto through its
//! StartExecution API ([`start_execution_task`]) and answers what the integration answers
//! (`ExecutionArn`, `StartDate`). The history is the same length (scheduled, started,
//! succeeded: three events either way), so the history quota is measured as on AWS.
//!
//! moto 5.2 cannot start a second execution in a region that already ran one, so every
//! execution the adapter starts ([`start_execution_elsewhere`], [`start_execution_task`]) runs
//! the same state machine (definition and name) created in an unused region.

use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use aws_sdk_sfn::config::Region;
use bytes::Bytes;
use http_body_util::Full;
use hyper::Response;
use serde_json::{json, Value};

use crate::emulator::{forward_invoke, next_execution_region, request_id};
use crate::sdk_config_for;

/// Step Functions' largest state input, output or task result (UTF-8 bytes).
pub const MAX_PAYLOAD_BYTES: usize = 256 * 1024;
/// Step Functions' most events in one execution's history (standard workflows).
pub const MAX_HISTORY_EVENTS: usize = 25_000;

/// What the adapter saw that Step Functions would have refused.
#[derive(Default)]
pub struct Quotas {
    violations: Mutex<Vec<String>>,
}

impl Quotas {
    /// The one record of this test process.
    pub fn global() -> &'static Quotas {
        static Q: OnceLock<Quotas> = OnceLock::new();
        Q.get_or_init(Quotas::default)
    }

    pub fn record(&self, what: String) {
        eprintln!("Step Functions quota exceeded: {what}");
        self.violations.lock().unwrap().push(what);
    }

    pub fn violations(&self) -> Vec<String> {
        self.violations.lock().unwrap().clone()
    }

    /// Records `what` when `bytes` exceeds [`MAX_PAYLOAD_BYTES`]; true when it does.
    pub fn payload_exceeds(&self, what: &str, bytes: usize) -> bool {
        let over = bytes > MAX_PAYLOAD_BYTES;
        if over {
            self.record(format!("States.DataLimitExceeded: {what} is {bytes} bytes (limit {MAX_PAYLOAD_BYTES})"));
        }
        over
    }
}

/// Step Functions fails the task with `States.DataLimitExceeded`, which no `Catch` catches.
/// moto fails an execution uncatchably (`States.Runtime`) when a Lambda Invoke answers with an
/// HTTP error: that is what it gets, so the execution ends as it would in AWS.
fn data_limit_error(what: &str) -> Response<Full<Bytes>> {
    let body = json!({"errorType": "States.DataLimitExceeded", "errorMessage": format!("{what} exceeds {MAX_PAYLOAD_BYTES} bytes")});
    Response::builder()
        .status(500)
        .header("x-amzn-requestid", request_id())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("response")
}

/// [`forward_invoke`] with the payload quota on the task's input and result.
pub async fn forward_invoke_within_quotas(
    emulator_port: u16,
    method: &str,
    path: &str,
    body: &[u8],
) -> Response<Full<Bytes>> {
    let q = Quotas::global();
    if q.payload_exceeds(&format!("the input of {path}"), body.len()) {
        return data_limit_error("the task input");
    }
    let (parts, answer) = forward_invoke(emulator_port, method, path, body).await.into_parts();
    let answer = http_body_util::BodyExt::collect(answer).await.map(|b| b.to_bytes()).unwrap_or_default();
    if q.payload_exceeds(&format!("the result of {path}"), answer.len()) {
        return data_limit_error("the task result");
    }
    Response::from_parts(parts, Full::new(answer))
}

/// Serves Lambda's Invoke API and Step Functions' StartExecution on `port` for a workflow test:
/// a StartExecution (a state machine's continue-as-new, as an API call or as its task) is
/// started on moto at `moto_port`, a `DryRun` answered here, an invocation of the function
/// `own` (its path holds `/functions/OWN/`) answered by `answer(path, body)`, and every other
/// invocation forwarded to the emulator at `emulator_port` within the payload quota.
pub fn serve_invoke_adapter<F, Fut>(port: u16, emulator_port: u16, moto_port: u16, own: &str, answer: F)
where
    F: Fn(String, Bytes) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    let own = format!("/functions/{own}/");
    crate::emulator::serve_forever(port, move |req: hyper::Request<hyper::body::Incoming>| {
        let (answer, own) = (answer.clone(), own.clone());
        async move {
            let method = req.method().as_str().to_string();
            let path = req.uri().path_and_query().map(|p| p.as_str().to_string()).unwrap_or_default();
            let target = req.headers().get("x-amz-target").and_then(|t| t.to_str().ok()).map(str::to_string);
            let (path, invocation_type) = invocation_type(&path, req.headers());
            let body =
                http_body_util::BodyExt::collect(req.into_body()).await.map(|b| b.to_bytes()).unwrap_or_default();
            let moto = format!("http://127.0.0.1:{moto_port}");
            if is_sfn_call(target.as_deref()) {
                return start_execution_elsewhere(&moto, target.as_deref().unwrap_or(""), &body).await;
            }
            if is_start_execution_task(&path) {
                // The ContinueAsNew task (moto cannot run it as written: see this module).
                return start_execution_task(&moto, &body).await;
            }
            if invocation_type.as_deref() == Some("DryRun") {
                return dry_run(&path);
            }
            if path.contains(&own) {
                return answer(path, body).await;
            }
            forward_invoke_within_quotas(emulator_port, &method, &path, &body).await
        }
    });
}

/// The invocation type a task asked for, and the Invoke path without it: moto drops a
/// `lambda:invoke` task's `InvocationType`, so the tests' loader carries it in `Qualifier`
/// (statemachines::for_moto), which reaches the adapter as `?Qualifier=` on the path; a
/// `X-Amz-Invocation-Type` header (an SDK's own Invoke) counts too. A `DryRun` is answered by
/// the adapter ([`dry_run`]): Lambda checks the request and runs nothing, where `cargo lambda
/// watch` would run the function.
pub fn invocation_type(path: &str, headers: &hyper::HeaderMap) -> (String, Option<String>) {
    let header = headers.get("x-amz-invocation-type").and_then(|v| v.to_str().ok()).map(str::to_string);
    let Some((base, query)) = path.split_once('?') else { return (path.to_string(), header) };
    let mut kept = Vec::new();
    let mut asked = header;
    for pair in query.split('&') {
        match pair.strip_prefix("Qualifier=") {
            Some(t @ ("RequestResponse" | "DryRun" | "Event")) => asked = Some(t.to_string()),
            _ => kept.push(pair),
        }
    }
    let path = if kept.is_empty() { base.to_string() } else { format!("{base}?{}", kept.join("&")) };
    (path, asked)
}

/// Lambda's answer to a dry run of `path` (204, no payload), recorded for [`dry_runs`].
pub fn dry_run(path: &str) -> Response<Full<Bytes>> {
    DRY_RUNS.lock().unwrap().push(path.to_string());
    Response::builder()
        .status(204)
        .header("x-amzn-requestid", request_id())
        .body(Full::new(Bytes::new()))
        .expect("response")
}

/// The Invoke paths of every dry run answered so far.
pub fn dry_runs() -> Vec<String> {
    DRY_RUNS.lock().unwrap().clone()
}

static DRY_RUNS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// True for a Step Functions API call (a state machine's `states:` service integration).
pub fn is_sfn_call(target: Option<&str>) -> bool {
    target.is_some_and(|t| t.starts_with("AWSStepFunctions."))
}

/// Every execution started by a state machine through the adapter: (the caller's input
/// `AWS_STEP_FUNCTIONS_STARTED_BY_EXECUTION_ID`, the new execution's ARN).
pub fn started_by_machines() -> Vec<(String, String)> {
    STARTED.lock().unwrap().clone()
}

static STARTED: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());

/// A Step Functions client for moto in `region`. moto answers slowly while it interprets
/// executions on a busy machine (a page of a long history can take tens of seconds under
/// load): patient timeouts, a few retries (StartExecution is idempotent by name and input).
pub async fn sfn_client(moto_endpoint: &str, region: &str) -> aws_sdk_sfn::Client {
    let base = sdk_config_for(moto_endpoint).await;
    let timeouts = aws_sdk_sfn::config::timeout::TimeoutConfig::builder()
        .operation_attempt_timeout(Duration::from_secs(60))
        .operation_timeout(Duration::from_secs(300))
        .build();
    let conf = aws_sdk_sfn::config::Builder::from(&base)
        .region(Region::new(region.to_string()))
        .timeout_config(timeouts)
        .retry_config(aws_sdk_sfn::config::retry::RetryConfig::standard().with_max_attempts(3))
        .build();
    aws_sdk_sfn::Client::from_conf(conf)
}

fn sfn_answer(status: u16, body: Value) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("x-amzn-requestid", request_id())
        .header("content-type", "application/x-amz-json-1.0")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("response")
}

/// Answers a Step Functions `AWSStepFunctions.StartExecution` call (`target`, `body`, wire
/// names): the input quota, then the execution started in an unused region of moto at
/// `moto_endpoint` ([`start_in_unused_region`]). Other Step Functions calls are refused.
pub async fn start_execution_elsewhere(moto_endpoint: &str, target: &str, body: &[u8]) -> Response<Full<Bytes>> {
    if target != "AWSStepFunctions.StartExecution" {
        return sfn_answer(
            400,
            json!({"__type": "UnsupportedOperation", "message": format!("{target} is not served here")}),
        );
    }
    let req: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    // The wire names: stateMachineArn, name, input (a string; kept general).
    let input = input_text(&req["input"]);
    if Quotas::global().payload_exceeds("a StartExecution input", input.len()) {
        return sfn_answer(400, json!({"__type": "States.DataLimitExceeded", "message": "input too large"}));
    }
    let Some(arn) = req["stateMachineArn"].as_str() else {
        return sfn_answer(400, json!({"__type": "ValidationException", "message": "no StateMachineArn"}));
    };
    match start_in_unused_region(moto_endpoint, arn, req["name"].as_str(), &input).await {
        Ok((execution_arn, started)) => sfn_answer(200, json!({"executionArn": execution_arn, "startDate": started})),
        Err((code, message)) => sfn_answer(400, json!({"__type": code, "message": message})),
    }
}

/// A StartExecution input as Step Functions sends it: a string as it is, an object serialised.
fn input_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "{}".to_string(),
        other => other.to_string(),
    }
}

/// The Lambda function, served by the adapter, that stands for a `states:startExecution` task
/// on moto (see the module comment).
pub const START_EXECUTION_FUNCTION: &str = "leasehold-test-states-start-execution";

/// The definition `definition` (JSON text) with the `Resource` of each
/// `arn:aws:states:::states:startExecution` task, at any depth (Map and Parallel states
/// included), pointed at [`START_EXECUTION_FUNCTION`]; every other field as written. Returns the
/// definition and how many tasks were pointed.
pub fn route_start_execution_through_adapter(definition: &str) -> (String, usize) {
    fn visit(states: &mut serde_json::Map<String, Value>, n: &mut usize) {
        for state in states.values_mut() {
            if state["Type"] == "Task" && state["Resource"] == "arn:aws:states:::states:startExecution" {
                state["Resource"] =
                    json!(format!("arn:aws:lambda:us-east-1:123456789012:function:{START_EXECUTION_FUNCTION}"));
                *n += 1;
            }
            for inner in ["ItemProcessor", "Iterator"] {
                if let Some(s) = state.get_mut(inner).and_then(|p| p.get_mut("States")).and_then(Value::as_object_mut) {
                    visit(s, n);
                }
            }
            if let Some(branches) = state.get_mut("Branches").and_then(Value::as_array_mut) {
                for b in branches {
                    if let Some(s) = b.get_mut("States").and_then(Value::as_object_mut) {
                        visit(s, n);
                    }
                }
            }
        }
    }
    let mut def: Value = serde_json::from_str(definition).expect("a definition is JSON");
    let mut n = 0;
    if let Some(states) = def.get_mut("States").and_then(Value::as_object_mut) {
        visit(states, &mut n);
    }
    (def.to_string(), n)
}

/// True for an Invoke of [`START_EXECUTION_FUNCTION`] (`path`: the Invoke request's path,
/// which names the function by its ARN).
pub fn is_start_execution_task(path: &str) -> bool {
    path.contains("/functions/") && path.contains(START_EXECUTION_FUNCTION)
}

/// Executions started by [`start_execution_task`]: name -> (input, execution ARN).
static BY_NAME: Mutex<Vec<(String, String, String)>> = Mutex::new(Vec::new());

/// Where moto runs the execution that Step Functions would name `arn`: an execution started by
/// [`start_execution_task`] runs in an unused region, so an ARN a definition builds itself
/// (`arn:...:REGION:...:execution:MACHINE:NAME`, in the region of the execution that started
/// it) is found by its name; any other ARN is returned as it is.
pub fn where_moto_runs(arn: &str) -> String {
    let name = arn.rsplit(':').next().unwrap_or_default();
    let started = BY_NAME.lock().unwrap().iter().find(|(n, _, _)| n == name).map(|(_, _, e)| e.clone());
    match started {
        Some(e) if e.split(':').skip(4).eq(arn.split(':').skip(4)) => e,
        _ => arn.to_string(),
    }
}

/// Markers of [`lose_start_answer`]: (marker, lost already).
static LOSE_ANSWER: Mutex<Vec<(String, bool)>> = Mutex::new(Vec::new());

/// The first [`start_execution_task`] whose input contains `marker` starts its execution and
/// answers as if its answer were lost (a transient error, which the task retries); the retry
/// is answered only once that execution has ended, as a retry that comes late.
pub fn lose_start_answer(marker: &str) {
    LOSE_ANSWER.lock().unwrap().push((marker.to_string(), false));
}

/// Does `input` carry a marker whose answer is yet to be lost? (Marks it lost.)
fn lose_this_answer(input: &str) -> bool {
    let mut m = LOSE_ANSWER.lock().unwrap();
    match m.iter_mut().find(|(marker, lost)| !*lost && input.contains(marker.as_str())) {
        Some(e) => {
            e.1 = true;
            true
        }
        None => false,
    }
}

/// Was the answer of the start with `input` lost? (Its retry then waits for the execution.)
fn answer_was_lost(input: &str) -> bool {
    LOSE_ANSWER.lock().unwrap().iter().any(|(marker, lost)| *lost && input.contains(marker.as_str()))
}

/// Is the execution `arn` still running (moto's DescribeExecution)?
async fn running(moto_endpoint: &str, arn: &str) -> bool {
    let c = client_for(moto_endpoint, arn).await;
    let d = c.describe_execution().execution_arn(arn).send().await.unwrap_or_else(|e| panic!("describe {arn}: {e:?}"));
    *d.status() == aws_sdk_sfn::types::ExecutionStatus::Running
}

/// Answers the Invoke of [`START_EXECUTION_FUNCTION`] as Step Functions' `states:startExecution`
/// integration answers the task: `body` is the task's evaluated `Parameters`
/// (`StateMachineArn`, `Name`, `Input` as an object or a string); the input quota; the
/// execution started on moto at `moto_endpoint` ([`start_in_unused_region`]); the result
/// `{"ExecutionArn", "StartDate"}`. StartExecution is idempotent by name as in AWS: a retry
/// with the same name and input gets the same execution while it runs; once it has ended, or
/// with another input, a name already used fails with
/// `StepFunctions.ExecutionAlreadyExistsException`. Failures are function errors named as the
/// integration names them. See [`lose_start_answer`] for a start whose answer is lost.
pub async fn start_execution_task(moto_endpoint: &str, body: &[u8]) -> Response<Full<Bytes>> {
    let params: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let input = input_text(&params["Input"]);
    if Quotas::global().payload_exceeds("a StartExecution input", input.len()) {
        return data_limit_error("the StartExecution input");
    }
    let Some(arn) = params["StateMachineArn"].as_str() else {
        return function_error("StepFunctions.ValidationException", "no StateMachineArn");
    };
    let name = params["Name"].as_str().map(str::to_string);
    if let Some(n) = &name {
        let seen = BY_NAME.lock().unwrap().iter().find(|(m, _, _)| m == n).cloned();
        match seen {
            Some((_, i, e)) if i == input => {
                if answer_was_lost(&input) {
                    // The retry of a start whose answer was lost comes after its execution ended.
                    let deadline = std::time::Instant::now() + Duration::from_secs(600);
                    while running(moto_endpoint, &e).await {
                        assert!(std::time::Instant::now() < deadline, "{e} still running");
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                }
                if running(moto_endpoint, &e).await {
                    return task_answer(json!({"ExecutionArn": e, "StartDate": 0}));
                }
                return function_error(
                    "StepFunctions.ExecutionAlreadyExistsException",
                    &format!("an execution named {n} has already ended"),
                );
            }
            Some(_) => {
                return function_error(
                    "StepFunctions.ExecutionAlreadyExistsException",
                    &format!("an execution named {n} exists with another input"),
                )
            }
            None => {}
        }
    }
    match start_in_unused_region(moto_endpoint, arn, name.as_deref(), &input).await {
        Ok((execution_arn, started)) => {
            let lost = lose_this_answer(&input);
            if let Some(n) = name {
                BY_NAME.lock().unwrap().push((n, input, execution_arn.clone()));
            }
            if lost {
                return function_error("StepFunctions.SdkClientException", "the answer was lost (a test's fault)");
            }
            task_answer(json!({"ExecutionArn": execution_arn, "StartDate": started}))
        }
        Err((code, message)) => function_error(&format!("StepFunctions.{code}Exception"), &message),
    }
}

fn task_answer(body: Value) -> Response<Full<Bytes>> {
    Response::builder()
        .status(200)
        .header("x-amzn-requestid", request_id())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("response")
}

fn function_error(error_type: &str, message: &str) -> Response<Full<Bytes>> {
    Response::builder()
        .status(200)
        .header("x-amzn-requestid", request_id())
        .header("x-amz-function-error", "Unhandled")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(json!({"errorType": error_type, "errorMessage": message}).to_string())))
        .expect("response")
}

/// Starts an execution of the state machine `arn` (named `name`, with `input`) on moto at
/// `moto_endpoint`: the same state machine (definition, name, role) created in an unused
/// region and the execution started there, and recorded for [`started_by_machines`]. Returns
/// the execution's ARN and start time (epoch seconds), or an error code and message.
pub async fn start_in_unused_region(
    moto_endpoint: &str,
    arn: &str,
    name: Option<&str>,
    input: &str,
) -> Result<(String, f64), (String, String)> {
    // arn:aws:states:REGION:ACCOUNT:stateMachine:NAME
    if arn.split(':').count() < 7 {
        return Err(("InvalidArn".into(), arn.to_string()));
    }
    let from = sfn_client(moto_endpoint, region_of(arn)).await;
    let sm = match from.describe_state_machine().state_machine_arn(arn).send().await {
        Ok(sm) => sm,
        Err(e) => return Err(("StateMachineDoesNotExist".into(), format!("{e:?}"))),
    };
    let region = next_execution_region("");
    let to = sfn_client(moto_endpoint, region).await;
    let created = to
        .create_state_machine()
        .name(sm.name())
        .definition(sm.definition())
        .role_arn(sm.role_arn())
        .send()
        .await
        .unwrap_or_else(|e| panic!("create the state machine in {region}: {e:?}"));
    let start = to
        .start_execution()
        .state_machine_arn(created.state_machine_arn())
        .input(input)
        .set_name(name.map(str::to_string));
    match start.send().await {
        Ok(out) => {
            let parent = serde_json::from_str::<Value>(input)
                .ok()
                .and_then(|v| v["AWS_STEP_FUNCTIONS_STARTED_BY_EXECUTION_ID"].as_str().map(str::to_string))
                .unwrap_or_default();
            STARTED.lock().unwrap().push((parent, out.execution_arn().to_string()));
            let started = out.start_date().secs() as f64 + f64::from(out.start_date().subsec_nanos()) / 1e9;
            Ok((out.execution_arn().to_string(), started))
        }
        Err(e) => Err(("ExecutionStartFailed".into(), format!("{e:?}"))),
    }
}

/// The region of an execution or state machine ARN.
pub fn region_of(arn: &str) -> &str {
    arn.split(':').nth(3).unwrap_or("us-east-1")
}

/// A client for moto at `moto_endpoint` in the region of `arn`.
pub async fn client_for(moto_endpoint: &str, arn: &str) -> aws_sdk_sfn::Client {
    sfn_client(moto_endpoint, region_of(arn)).await
}

/// The execution's whole history (moto's GetExecutionHistory, every page), oldest first.
pub async fn all_history(client: &aws_sdk_sfn::Client, arn: &str) -> Vec<aws_sdk_sfn::types::HistoryEvent> {
    try_all_history(client, arn).await.unwrap_or_else(|e| panic!("history of {arn}: {e}"))
}

/// [`all_history`], or why moto would not answer it.
pub async fn try_all_history(
    client: &aws_sdk_sfn::Client,
    arn: &str,
) -> Result<Vec<aws_sdk_sfn::types::HistoryEvent>, String> {
    let mut events = Vec::new();
    let mut token: Option<String> = None;
    loop {
        // moto's server has answered 500 (an HTML error page) to a history read of an execution
        // the adapter had just stopped: once in a full run, and six times in a row over 3 s in
        // a run beside another one. A page answered 5xx is asked again, as the SDK's own
        // retries would against Step Functions, for up to about 30 s.
        let mut tries = 0;
        let out = loop {
            let sent = client
                .get_execution_history()
                .execution_arn(arn)
                .max_results(1000)
                .set_next_token(token.clone())
                .send()
                .await;
            match sent {
                Ok(out) => break out,
                Err(e) if tries < 30 && e.raw_response().is_some_and(|r| r.status().is_server_error()) => {
                    tries += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(200 * tries.min(5))).await;
                }
                Err(e) => return Err(format!("{e:?}")),
            }
        };
        events.extend(out.events().iter().cloned());
        token = out.next_token().map(str::to_string);
        if token.is_none() {
            return Ok(events);
        }
    }
}

/// How many events the execution's history holds.
pub async fn history_events(client: &aws_sdk_sfn::Client, arn: &str) -> usize {
    all_history(client, arn).await.len()
}

/// Counts the execution's history events; past [`MAX_HISTORY_EVENTS`] the execution is
/// stopped (Step Functions would have failed it) and the violation recorded. Returns the count.
pub async fn check_history(client: &aws_sdk_sfn::Client, arn: &str) -> usize {
    check_history_within(client, arn, MAX_HISTORY_EVENTS).await
}

/// [`check_history`] against `limit` events instead of Step Functions' own quota (a test's
/// lowered quota).
pub async fn check_history_within(client: &aws_sdk_sfn::Client, arn: &str, limit: usize) -> usize {
    try_check_history_within(client, arn, limit).await.unwrap_or_else(|e| panic!("history of {arn}: {e}"))
}

/// [`check_history_within`] for a test that follows an execution, given `seen`, the count
/// last taken while it ran. moto has answered every history read of an execution stopped
/// here past `limit` (inside a Map) with a 500 for half a minute: the count that stopped it,
/// taken and recorded while it ran, then stands. Any other failed read panics.
pub async fn check_history_after(client: &aws_sdk_sfn::Client, arn: &str, limit: usize, seen: usize) -> usize {
    match try_check_history_within(client, arn, limit).await {
        Ok(n) => n,
        Err(e) if seen > limit => {
            eprintln!("{arn}: history unreadable after its stop ({e}); {seen} events counted before it");
            seen
        }
        Err(e) => panic!("history of {arn}: {e}"),
    }
}

/// [`check_history_within`], or why moto would not answer the history.
pub async fn try_check_history_within(client: &aws_sdk_sfn::Client, arn: &str, limit: usize) -> Result<usize, String> {
    let events = try_all_history(client, arn).await?;
    let n = events.len();
    let q = Quotas::global();
    for e in &events {
        let data = [
            e.state_entered_event_details().and_then(|d| d.input()),
            e.state_exited_event_details().and_then(|d| d.output()),
            e.execution_started_event_details().and_then(|d| d.input()),
            e.execution_succeeded_event_details().and_then(|d| d.output()),
        ];
        for d in data.into_iter().flatten() {
            q.payload_exceeds(&format!("{arn}: the data of event {} ({:?})", e.id(), e.r#type()), d.len());
        }
    }
    if n > limit {
        Quotas::global().record(format!("{arn}: {n} history events (limit {limit})"));
        let _ = client.stop_execution().execution_arn(arn).error("States.HistoryLimitExceeded").send().await;
    }
    Ok(n)
}

/// Panics with every recorded violation, if any.
pub fn assert_within_quotas() {
    let v = Quotas::global().violations();
    assert!(v.is_empty(), "Step Functions quotas exceeded: {v:#?}");
}

/// What Step Functions does with a Lambda task whose result exceeds [`MAX_PAYLOAD_BYTES`]
/// (`bytes` long, from `path`): the violation is recorded, and the task never completes in
/// moto (its answer is held back), because Step Functions fails the execution with
/// `States.DataLimitExceeded`, which no `Catch` or `Retry` sees, and moto would let `States.ALL`
/// catch any error it got. [`fail_on_violation`] ends the execution as Step Functions does.
pub async fn oversized_result(path: &str, bytes: usize) -> Response<Full<Bytes>> {
    Quotas::global().payload_exceeds(&format!("the result of {path}"), bytes);
    // moto's StopExecution takes effect when the task returns: by then the execution is
    // stopping, and the error fails it without any Catch.
    tokio::time::sleep(HELD_BACK).await;
    data_limit_error("the task result")
}

/// How long the answer of a task over the payload quota is held back: time for
/// [`fail_on_violation`] to stop the execution first.
pub const HELD_BACK: Duration = Duration::from_secs(10);

/// Waits (up to `timeout`) for a payload violation whose text contains `marker` (the path of
/// the task that exceeded it), then fails the execution `arn` with `States.DataLimitExceeded`
/// (moto's StopExecution), as Step Functions fails it: no Catch, no further state. moto ends
/// it when the held-back task returns, as ABORTED or FAILED (`Lambda.500`), never through a
/// Catch.
pub async fn fail_on_violation(client: &aws_sdk_sfn::Client, arn: &str, marker: &str, timeout: Duration) {
    let deadline = std::time::Instant::now() + timeout;
    while !Quotas::global().violations().iter().any(|v| v.contains(marker)) {
        assert!(std::time::Instant::now() < deadline, "no quota violation with {marker} within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    client
        .stop_execution()
        .execution_arn(arn)
        .error("States.DataLimitExceeded")
        .cause(format!("a task result over {MAX_PAYLOAD_BYTES} bytes"))
        .send()
        .await
        .unwrap_or_else(|e| panic!("stop {arn}: {e:?}"));
}

/// [`assert_within_quotas`], except violations whose text contains one of `expected` (a
/// test's own deliberate ones).
pub fn assert_within_quotas_except(expected: &[&str]) {
    let v: Vec<String> =
        Quotas::global().violations().into_iter().filter(|v| !expected.iter().any(|e| v.contains(e))).collect();
    assert!(v.is_empty(), "Step Functions quotas exceeded: {v:#?}");
}
