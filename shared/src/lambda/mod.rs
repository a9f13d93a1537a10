//! Lambda adapters: runtime wiring shared by the three functions. Each function's `main.rs`
//! calls [`run`] with its [`Function`]; the event shape decides the path:
//! - API Gateway HTTP API (payload 2.0) events go through the HTTP router and always answer
//!   an HTTP response (never a function error);
//! - EventBridge scheduled events run the keep-alive sweep (heartbeat function);
//! - anything else is a direct invoke of the function's operation; failures are function
//!   errors whose `errorType` is the stable error name, so Step Functions can `Retry` on
//!   `LeaseHeld` and `Catch` the rest.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::clock::Clock;

use async_trait::async_trait;
use aws_lambda_events::apigw::{ApiGatewayV2httpRequest, ApiGatewayV2httpResponse};
use aws_lambda_events::encodings::Body;
use lambda_runtime::{service_fn, Diagnostic, LambdaEvent};
use serde_json::{json, Value};
use tracing::Instrument;

use crate::api::{self, HttpRequest, Operation};
use crate::env::{config_from_env, init_tracing, StoreChoice};
use crate::error::{Error, ErrorName};
use crate::keepalive::SweepReport;
use crate::keepalive::{ExecutionState, Executions};
use crate::protocol::Coordinator;

/// The history function's handler (functions/history): the lease table's stream into the
/// history table.
#[cfg(feature = "streams")]
pub mod history;

/// How the keep-alive sweep learns which executions ended: listed per state machine,
/// described as the fallback.
pub mod executions;
mod http;
mod metrics;
mod step_functions;

use http::*;
use metrics::*;
pub use metrics::{CLOCK_METRICS, COUNT_METRICS, METRIC_NAMESPACE, OUTCOME_METRICS};
pub use step_functions::StepFunctions;

/// The three deployed functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Function {
    Acquire,
    Heartbeat,
    Release,
}

impl Function {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Function::Acquire => "acquire",
            Function::Heartbeat => "heartbeat",
            Function::Release => "release",
        }
    }
    /// The HTTP operations this function answers: its own, and for heartbeat also the
    /// read-only `GET /leases/{key+}`.
    pub(crate) fn serves(self, op: Operation) -> bool {
        op == self.operation()
            || (self == Function::Heartbeat && matches!(op, Operation::Get | Operation::Count))
            || (self == Function::Acquire && matches!(op, Operation::Next | Operation::Put))
    }

    fn operation(self) -> Operation {
        match self {
            Function::Acquire => Operation::Acquire,
            Function::Heartbeat => Operation::Heartbeat,
            Function::Release => Operation::Release,
        }
    }
}

/// What kind of event arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventKind {
    Http,
    Schedule,
    Direct,
}

pub(crate) fn classify(event: &Value) -> EventKind {
    let obj = match event.as_object() {
        Some(o) => o,
        None => return EventKind::Direct,
    };
    if obj.get("requestContext").is_some_and(|c| c.get("http").is_some()) && obj.contains_key("rawPath") {
        return EventKind::Http;
    }
    let detail_type = obj.get("detail-type").and_then(Value::as_str);
    let source = obj.get("source").and_then(Value::as_str);
    if detail_type == Some("Scheduled Event") || matches!(source, Some("aws.events" | "aws.scheduler")) {
        return EventKind::Schedule;
    }
    EventKind::Direct
}

/// An invocation payload as it arrived: JSON, or the parse error of bytes that are not JSON.
/// The runtime would otherwise answer malformed bytes itself with its own error type; with
/// this, they become an `InvalidRequest` like every other bad input.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Payload {
    Json(Value),
    Malformed(String),
}

impl<'de> serde::Deserialize<'de> for Payload {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match <Value as serde::Deserialize>::deserialize(d) {
            Ok(v) => Payload::Json(v),
            Err(e) => Payload::Malformed(e.to_string()),
        })
    }
}

/// Everything a function needs, built once at init.
pub struct Handler {
    pub function: Function,
    pub coord: Coordinator,
    pub executions: Option<Arc<dyn Executions>>,
    /// With `executions`: the state machines' RUNNING executions, listed once per scheduled run
    /// ([`executions::ListedRun`]); `executions` then only answers what the lists do not.
    pub running: Option<Arc<dyn executions::RunningExecutions>>,
    /// Most live keep-alive leases one scheduled run renews or releases (stale index entries
    /// do not count).
    pub sweep_max_items: u32,
}

/// The error of a direct invoke: `errorType` = stable name, `errorMessage` = the JSON error
/// body (a state machine can read its fields with `States.StringToJson($.Cause)`).
impl From<&Error> for Diagnostic {
    fn from(e: &Error) -> Diagnostic {
        Diagnostic { error_type: e.error_name().as_str().to_string(), error_message: e.to_json().to_string() }
    }
}

/// What one event came to: the function's answer, and what its metric line records.
struct Handled {
    result: Result<Value, Error>,
    outcome: String,
    counts: Vec<(&'static str, u64)>,
}

impl Handler {
    /// The function's wall clock in epoch ms (the coordinator's clock, without its test offset):
    /// what Lambda's and API Gateway's deadlines are compared with.
    fn wall_ms(&self) -> u64 {
        self.coord.config().clock.wall_ms().max(0) as u64
    }

    /// Handles one event. `remaining`: time left in the invocation. The event's shape picks
    /// the path, each its own function; every path emits one metric line.
    pub async fn handle(&self, event: Value, remaining: Duration) -> Result<Value, Error> {
        let started = self.coord.monotonic();
        let h = match classify(&event) {
            EventKind::Http => self.http(event, remaining).await,
            EventKind::Schedule => self.schedule(remaining).await,
            EventKind::Direct => self.direct(event, remaining, started).await,
        };
        let line = metric_line(
            self.function.name(),
            &h.outcome,
            self.coord.monotonic().saturating_duration_since(started).as_secs_f64() * 1000.0,
            &h.counts,
        );
        // CloudWatch Embedded Metric Format: one JSON line on stdout per invocation.
        println!("{}", with_clock_offset(line, self.coord.clock_offset()));
        h.result
    }

    /// An API Gateway HTTP API event: routed once, always answered with an HTTP response.
    async fn http(&self, event: Value, remaining: Duration) -> Handled {
        let mut waited = false;
        let resp = match http_request(event, self.wall_ms()) {
            Err(e) => api::HttpResponse::error(&e, self.coord.now_ms()),
            Ok((req, api_remaining)) => {
                // An acquire waits no longer than API Gateway does for the answer.
                let remaining = api_remaining.map_or(remaining, |r| r.min(remaining));
                match api::route(&req.method, &req.path) {
                    Err(resp) => resp,
                    // Each function serves only its own routes, so its IAM policy is all a
                    // route can reach even if API Gateway were mis-wired.
                    Ok(api::Route::Op(op, _)) if !self.function.serves(op) => api::route_error(
                        404,
                        ErrorName::UnknownRoute,
                        format!("the {} function does not serve {} {}", self.function.name(), req.method, req.path),
                    ),
                    Ok(route) => {
                        if matches!(route, api::Route::Op(Operation::Acquire, _)) {
                            waited = asks_to_wait(serde_json::from_slice::<Value>(&req.body).ok().as_ref());
                        }
                        api::handle_route(&self.coord, route, req, Some(remaining)).await
                    }
                }
            }
        };
        let outcome = resp.error.map_or("ok", ErrorName::as_str).to_string();
        let counts = counts(self.function, &outcome, waited, resp.status == 410);
        Handled { result: Ok(http_response(resp)), outcome, counts }
    }

    /// An EventBridge schedule: the keep-alive sweep (heartbeat function only).
    async fn schedule(&self, remaining: Duration) -> Handled {
        if self.function != Function::Heartbeat {
            let outcome = ErrorName::InvalidRequest.as_str().to_string();
            return Handled {
                result: Err(Error::invalid(format!(
                    "the {} function does not take scheduled events",
                    self.function.name()
                ))),
                counts: counts(self.function, &outcome, false, false),
                outcome,
            };
        }
        let deadline = self.coord.monotonic() + remaining.saturating_sub(api::INVOKE_SAFETY_MARGIN);
        // Both sweeps judge and write expiries: a function whose clock is refused runs neither
        // (the queue sweep would hand a live key to the head waiter).
        if let Err(e) = self.coord.check_clock("leasehold/keepalive-sweep").await {
            tracing::error!(error = e.name(), message = %e, "keep-alive and queue sweeps refused");
            let report = SweepReport { errors: 1, complete: false, ..Default::default() };
            return Handled {
                counts: sweep_counts(&report, 0, matches!(e, Error::ClockSkew(_))),
                result: Ok(serde_json::to_value(&report).expect("report serialises")),
                outcome: e.name().to_string(),
            };
        }
        let listed = match (&self.executions, &self.running) {
            (Some(describe), Some(lister)) => {
                Some(Arc::new(executions::ListedRun::new(lister.clone(), describe.clone())))
            }
            _ => None,
        };
        let ex = listed.clone().map(|l| l as Arc<dyn Executions>).or_else(|| self.executions.clone());
        let report = self.coord.keepalive_sweep(ex, self.sweep_max_items, deadline).await;
        let (list_pages, described) = listed.map_or((0, 0), |l| l.calls());
        // Then the waiter queues: expired holders replaced, undelivered grants delivered.
        let queue_errors = match self.coord.sweep_queues(deadline).await {
            Ok(q) => {
                tracing::info!(
                    keys = q.keys,
                    delivered = q.served.delivered,
                    undelivered = q.served.undelivered,
                    skipped = q.served.skipped,
                    errors = q.errors,
                    "queue sweep"
                );
                q.errors
            }
            Err(e) => {
                tracing::warn!(error = e.name(), message = %e, "queue sweep failed");
                1
            }
        };
        tracing::info!(
            scanned = report.scanned,
            renewed = report.renewed,
            released = report.released,
            skipped = report.skipped,
            raced = report.raced,
            errors = report.errors,
            describe_failures = report.describe_failures,
            complete = report.complete,
            list_pages,
            described,
            "keep-alive sweep"
        );
        Handled {
            counts: sweep_counts(&report, queue_errors, false),
            result: Ok(serde_json::to_value(&report).expect("report serialises")),
            outcome: "sweep".to_string(),
        }
    }

    /// A direct invoke of this function's operation; a failure is a function error.
    async fn direct(&self, mut event: Value, remaining: Duration, started: Instant) -> Handled {
        let key = event.get("key").and_then(Value::as_str).map(str::to_string);
        let holder = event.get("holder").and_then(Value::as_str).map(str::to_string);
        let waited = self.function == Function::Acquire && asks_to_wait(Some(&event));
        // A work operation (`"op": "next"`, ...) on the function that serves it.
        let op = match api::batch::take_op(&mut event) {
            Ok(Some(op)) if self.function.serves(op) => Ok(op),
            Ok(Some(op)) => Err(Error::invalid(format!(
                "the {} function does not serve the {} operation",
                self.function.name(),
                op.as_str()
            ))),
            Ok(None) => Ok(self.function.operation()),
            Err(e) => Err(e),
        };
        let ran = op.as_ref().ok().copied();
        let result = match op {
            Ok(op) => api::run(&self.coord, op, None, event, Some(remaining)).await,
            Err(e) => Err(e),
        };
        let outcome = result.as_ref().err().map_or("ok", Error::name).to_string();
        let lost = matches!(&result, Err(Error::NotHolder { reason, .. }) if reason.is_lost());
        let fence = result.as_ref().ok().and_then(|v| v.get("fence")).and_then(Value::as_u64);
        tracing::info!(
            key = key.as_deref().unwrap_or(""), holder = holder.as_deref().unwrap_or(""),
            fence, outcome = %outcome, latency_ms = self.coord.monotonic().saturating_duration_since(started).as_secs_f64() * 1000.0,
            "direct invoke"
        );
        let mut counts = counts(self.function, &outcome, waited, lost);
        // A batch counts the leases it took; a put takes none.
        if let (Some(op @ (Operation::Next | Operation::Put)), Ok(v)) = (ran, &result) {
            let n = if op == Operation::Next { v["leases"].as_array().map_or(0, Vec::len) as u64 } else { 0 };
            counts.iter_mut().filter(|(name, _)| *name == "Acquired").for_each(|c| c.1 = n);
        }
        Handled { counts, result, outcome }
    }
}

impl Handler {
    /// Answers a payload that is not JSON: `InvalidRequest`, nothing read or written.
    pub(crate) fn reject_malformed(&self, parse_error: &str) -> Result<Value, Error> {
        emit_metric(
            self.function.name(),
            "InvalidRequest",
            0.0,
            &counts(self.function, "InvalidRequest", false, false),
        );
        Err(Error::invalid(format!("the payload is not valid JSON: {parse_error}")))
    }
}

/// Builds the handler from the environment: `LEASEHOLD_TABLE` (the DynamoDB table; without
/// it, an embedded store under `LEASEHOLD_DB` or /tmp, for local emulation), the bounds of
/// [`config_from_env`], and `LEASEHOLD_SWEEP_MAX_ITEMS` (default 1000).
pub(crate) async fn handler_from_env(function: Function) -> Result<Handler, Error> {
    let config = config_from_env()?;
    let db =
        std::env::var_os("LEASEHOLD_DB").map(Into::into).unwrap_or_else(|| std::env::temp_dir().join("leasehold.db"));
    let choice = StoreChoice::resolve(None, Some(db));
    if let StoreChoice::Embedded { .. } = &choice {
        tracing::warn!(store = %choice.describe(), "LEASEHOLD_TABLE is not set: using the embedded store");
    }
    // One SDK configuration (credentials chain, region, HTTP client) for every client of the
    // process. Its trust store is read on the first connection, not here: it was most of the
    // time before ready (BENCHMARKS.md, "Cold start").
    let conf = crate::store::dynamo::load_sdk_config(Duration::from_secs(3)).await;
    let store: Arc<dyn crate::store::Store> = match &choice {
        StoreChoice::Dynamo { table } => {
            Arc::new(crate::store::DynamoStore::new(aws_sdk_dynamodb::Client::new(&conf), table.clone()))
        }
        StoreChoice::Embedded { .. } => choice.open().await?,
    };
    // Every function may deliver a queued waiter's lease (acquire: a free key; release: the
    // hand-over; heartbeat: the sweep), and the heartbeat function describes executions.
    let sfn = Arc::new(StepFunctions(aws_sdk_sfn::Client::new(&conf)));
    // DescribeExecution with adaptive retries (client-side rate limiting when throttled):
    // one sweep may describe hundreds of executions, and a failure counts against the sweep.
    // Delivery keeps its own client (no SDK retries: the queue decides what a failure means).
    // ListExecutions (once per state machine and run) before DescribeExecution: DESIGN.md,
    // "Keep-alive on the holder's behalf".
    let sweep_sfn = (function == Function::Heartbeat).then(|| {
        let conf = aws_sdk_sfn::config::Builder::from(&conf)
            .retry_config(aws_smithy_types::retry::RetryConfig::adaptive().with_max_attempts(4))
            .build();
        Arc::new(StepFunctions(aws_sdk_sfn::Client::from_conf(conf)))
    });
    let executions = sweep_sfn.clone().map(|s| s as Arc<dyn Executions>);
    let running = sweep_sfn.map(|s| s as Arc<dyn executions::RunningExecutions>);
    let sweep_max_items = std::env::var("LEASEHOLD_SWEEP_MAX_ITEMS").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let coord = Coordinator::new(store, config).with_deliver(sfn);
    Ok(Handler { function, coord, executions, running, sweep_max_items })
}

/// The whole `main` of a function: logging, clients built once, then the runtime loop.
pub async fn run(function: Function) -> Result<(), lambda_runtime::Error> {
    init_tracing(true);
    let handler = Arc::new(handler_from_env(function).await.map_err(|e| format!("{}: {e}", e.name()))?);
    tracing::info!(function = function.name(), "ready");
    // The time an invocation is assumed to have when the runtime sends no usable deadline
    // (local emulators): Lambda's default timeout unless `LEASEHOLD_ASSUMED_TIMEOUT_MS` says.
    let assumed = std::env::var("LEASEHOLD_ASSUMED_TIMEOUT_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::from_secs(3), Duration::from_millis);
    lambda_runtime::run(service_fn(move |ev: LambdaEvent<Payload>| {
        let handler = handler.clone();
        async move {
            let remaining = Duration::from_millis(ev.context.deadline.saturating_sub(handler.wall_ms()));
            // No usable deadline (local emulators send a constant such as 600000, i.e. 1970):
            // assume Lambda's default 3 s timeout (or `LEASEHOLD_ASSUMED_TIMEOUT_MS`).
            let remaining = if remaining.is_zero() { assumed } else { remaining };
            let span = tracing::info_span!("invocation", request_id = %ev.context.request_id);
            let result = match ev.payload {
                Payload::Json(event) => handler.handle(event, remaining).instrument(span).await,
                Payload::Malformed(e) => handler.reject_malformed(&e),
            };
            result.map_err(|e| Diagnostic::from(&e))
        }
    }))
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_lines_declare_what_they_carry() {
        let sweep = SweepReport {
            scanned: 9,
            renewed: 5,
            released: 2,
            errors: 1,
            describe_failures: 3,
            complete: false,
            ..Default::default()
        };
        let cases = [
            ("acquire", "ok", counts(Function::Acquire, "ok", true, false)),
            ("acquire", "LeaseHeld", counts(Function::Acquire, "LeaseHeld", false, false)),
            ("heartbeat", "NotHolder", counts(Function::Heartbeat, "NotHolder", false, true)),
            ("release", "Throttled", counts(Function::Release, "Throttled", false, false)),
            ("heartbeat", "sweep", sweep_counts(&sweep, 4, false)),
            ("heartbeat", "ClockSkew", sweep_counts(&sweep, 0, true)),
        ];
        for (f, outcome, c) in &cases {
            let line = with_clock_offset(metric_line(f, outcome, 1.5, c), Some((-120, 900)));
            let directives = line["_aws"]["CloudWatchMetrics"].as_array().unwrap();
            for d in directives {
                assert_eq!(d["Namespace"], METRIC_NAMESPACE);
                for m in d["Metrics"].as_array().unwrap() {
                    let name = m["Name"].as_str().unwrap();
                    assert!(
                        OUTCOME_METRICS.contains(&name)
                            || COUNT_METRICS.contains(&name)
                            || CLOCK_METRICS.contains(&name),
                        "{name}"
                    );
                    assert!(line[name].is_number(), "{name} has a value in {line}");
                }
                for set in d["Dimensions"].as_array().unwrap() {
                    for dim in set.as_array().unwrap() {
                        assert!(line[dim.as_str().unwrap()].is_string(), "dimension {dim} in {line}");
                    }
                }
            }
        }
        let get = |i: usize, n: &str| metric_line("x", "y", 0.0, &cases[i].2)[n].as_u64();
        assert_eq!((get(0, "Acquired"), get(0, "Waited"), get(0, "Contended")), (Some(1), Some(1), Some(0)));
        assert_eq!((get(1, "Acquired"), get(1, "Contended")), (Some(0), Some(1)));
        assert_eq!((get(2, "Lost"), get(2, "Acquired")), (Some(1), None));
        assert_eq!((get(3, "Throttled"), get(3, "Lost")), (Some(1), Some(0)));
        assert_eq!(
            [
                "SweepScanned",
                "SweepRenewed",
                "SweepReleased",
                "SweepErrors",
                "SweepDescribeFailures",
                "SweepIncomplete",
                "QueueSweepErrors"
            ]
            .map(|n| get(4, n)),
            [Some(9), Some(5), Some(2), Some(1), Some(3), Some(1), Some(4)]
        );
        assert_eq!((get(4, "ClockSkew"), get(5, "ClockSkew")), (Some(0), Some(1)));
        let line = with_clock_offset(
            metric_line("x", "ClockSkew", 0.0, &counts(Function::Acquire, "ClockSkew", false, false)),
            Some((-120, 900)),
        );
        assert_eq!(
            (line["ClockSkew"].as_u64(), line["ClockOffsetLoMs"].as_i64(), line["ClockOffsetHiMs"].as_i64()),
            (Some(1), Some(-120), Some(900))
        );
        assert!(with_clock_offset(metric_line("x", "ok", 0.0, &[]), None).get("ClockOffsetLoMs").is_none());
    }

    #[test]
    fn http_api_remaining_counts_from_the_arrival() {
        let ms = Duration::from_millis;
        assert_eq!(http_api_remaining(1_000_000, 1_000_000), Some(ms(30_000)));
        assert_eq!(http_api_remaining(1_000_000, 1_027_500), Some(ms(2_500)));
        assert_eq!(http_api_remaining(1_000_000, 1_031_000), Some(Duration::ZERO), "already past");
        assert_eq!(http_api_remaining(0, 1_000_000), None, "no arrival time");
        assert_eq!(http_api_remaining(-5, 1_000_000), None);
    }
}
