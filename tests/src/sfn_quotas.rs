//! Step Functions' quotas that moto does not enforce, enforced by the tests' adapter in front
//! of moto and the Lambda emulator:
//! - 256 KiB per payload: a Lambda task's input (the Invoke request) and its result (the
//!   Invoke answer), and a StartExecution's input. Step Functions fails such a task with
//!   `States.DataLimitExceeded`, which no `Catch` catches. The adapter records the violation
//!   ([`Quotas::violations`]) and answers the task with that error, so the execution fails
//!   and the test that checks the record fails too.
//! - 25,000 events in one execution's history: [`history_events`] counts them from moto's
//!   GetExecutionHistory and [`check_history`] records (and stops) an execution past them.
//!
//! The adapter also answers what a state machine's `arn:aws:states:::states:startExecution`
//! task sends (moto sends every service call to `localhost:$MOTO_PORT`, the adapter): moto
//! 5.2 cannot start a second execution in a region that already ran one, so
//! [`start_execution_elsewhere`] creates the same state machine (definition and name) in an
//! unused region and starts the execution there: a continue-as-new lands where moto can run it.

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
/// executions on a busy machine: patient timeouts, a few retries (StartExecution is idempotent
/// by name and input).
pub async fn sfn_client(moto_endpoint: &str, region: &str) -> aws_sdk_sfn::Client {
    let base = sdk_config_for(moto_endpoint).await;
    let timeouts = aws_sdk_sfn::config::timeout::TimeoutConfig::builder()
        .operation_attempt_timeout(Duration::from_secs(30))
        .operation_timeout(Duration::from_secs(90))
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

/// Answers a state machine's `AWSStepFunctions.StartExecution` (`target`, `body`): the
/// input quota, then the same state machine created in an unused region of moto at
/// `moto_endpoint` and the execution started there (see the module comment). Other Step
/// Functions calls are refused.
pub async fn start_execution_elsewhere(moto_endpoint: &str, target: &str, body: &[u8]) -> Response<Full<Bytes>> {
    if target != "AWSStepFunctions.StartExecution" {
        return sfn_answer(
            400,
            json!({"__type": "UnsupportedOperation", "message": format!("{target} is not served here")}),
        );
    }
    let req: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    // The wire names: stateMachineArn, name, input (a string; kept general).
    let input = match &req["input"] {
        Value::String(s) => s.clone(),
        Value::Null => "{}".to_string(),
        other => other.to_string(),
    };
    if Quotas::global().payload_exceeds("a StartExecution input", input.len()) {
        return sfn_answer(400, json!({"__type": "States.DataLimitExceeded", "message": "input too large"}));
    }
    let Some(arn) = req["stateMachineArn"].as_str() else {
        return sfn_answer(400, json!({"__type": "ValidationException", "message": "no StateMachineArn"}));
    };
    // arn:aws:states:REGION:ACCOUNT:stateMachine:NAME
    let parts: Vec<&str> = arn.split(':').collect();
    if parts.len() < 7 {
        return sfn_answer(400, json!({"__type": "InvalidArn", "message": arn}));
    }
    let from = sfn_client(moto_endpoint, parts[3]).await;
    let sm = match from.describe_state_machine().state_machine_arn(arn).send().await {
        Ok(sm) => sm,
        Err(e) => {
            return sfn_answer(400, json!({"__type": "StateMachineDoesNotExist", "message": format!("{e:?}")}));
        }
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
        .unwrap_or_else(|e| panic!("create the continued state machine in {region}: {e:?}"));
    let mut start = to.start_execution().state_machine_arn(created.state_machine_arn()).input(&input);
    if let Some(name) = req["name"].as_str() {
        start = start.name(name);
    }
    match start.send().await {
        Ok(out) => {
            let parent = serde_json::from_str::<Value>(&input)
                .ok()
                .and_then(|v| v["AWS_STEP_FUNCTIONS_STARTED_BY_EXECUTION_ID"].as_str().map(str::to_string))
                .unwrap_or_default();
            STARTED.lock().unwrap().push((parent, out.execution_arn().to_string()));
            let started = out.start_date().secs() as f64 + f64::from(out.start_date().subsec_nanos()) / 1e9;
            sfn_answer(200, json!({"executionArn": out.execution_arn(), "startDate": started}))
        }
        Err(e) => sfn_answer(400, json!({"__type": "ExecutionStartFailed", "message": format!("{e:?}")})),
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

/// How many events the execution's history holds (moto's GetExecutionHistory, every page).
pub async fn history_events(client: &aws_sdk_sfn::Client, arn: &str) -> usize {
    let mut n = 0;
    let mut token: Option<String> = None;
    loop {
        let out = client
            .get_execution_history()
            .execution_arn(arn)
            .max_results(1000)
            .set_next_token(token.clone())
            .send()
            .await
            .unwrap_or_else(|e| panic!("history of {arn}: {e:?}"));
        n += out.events().len();
        token = out.next_token().map(str::to_string);
        if token.is_none() {
            return n;
        }
    }
}

/// Counts the execution's history events; past [`MAX_HISTORY_EVENTS`] the execution is
/// stopped (Step Functions would have failed it) and the violation recorded. Returns the count.
pub async fn check_history(client: &aws_sdk_sfn::Client, arn: &str) -> usize {
    let n = history_events(client, arn).await;
    if n > MAX_HISTORY_EVENTS {
        Quotas::global().record(format!("{arn}: {n} history events (limit {MAX_HISTORY_EVENTS})"));
        let _ = client.stop_execution().execution_arn(arn).error("States.HistoryLimitExceeded").send().await;
    }
    n
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
