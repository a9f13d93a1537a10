//! The rule every state machine that works under a lease keeps (DESIGN.md, "Work inside the
//! lease"), checked on the definition as written:
//!
//! - **Every work state runs under a lease.** A work state is a Task that is not a lease
//!   operation (the acquire, heartbeat and release functions) and starts no execution: the work
//!   function, a write to another table. Each path from `StartAt` to it passes a take (the
//!   acquire function: `acquire`, a queued acquire, `next`) and no release after it.
//! - **The lease outlasts the work**, one of two ways on each path:
//!   - *bound*: the take names `keepalive.execution_arn` = `$$.Execution.Id`, so the keep-alive
//!     sweep renews the lease while the execution runs and frees it once the execution ended;
//!   - *timed*: the lease's duration (a literal, or a path that a `Choice` before the take
//!     refuses below a minimum) covers everything the path does under it before its release or
//!     its end, plus [`SLACK_S`]: each work Task `attempts x TimeoutSeconds + backoff` (a Task
//!     without `TimeoutSeconds` cannot be timed), each `Wait` its `Seconds` (or the largest value
//!     a `Choice` lets through its `SecondsPath`). A heartbeat restarts the count.
//! - **No invocation outlives its place in the lease.** A Step Functions timeout or a Lambda
//!   service error ([`UNSETTLED`]) ends a Lambda task while its invocation may still run: after
//!   one, no retry comes sooner than [`LONGEST_INVOCATION_S`] (`IntervalSeconds`), and the path
//!   that catches it waits that long (a `Wait`) before it releases, works again or ends. So a
//!   slot never serves two invocations at once, and is never handed on while one may run.
//! - **A redrive takes the lease anew.** `RedriveExecution` resumes an execution at the state
//!   that failed, with the input that state had, after the sweep may have released the lease:
//!   every work Task's parameters refer to `$$.Execution.RedriveCount` (the definitions make
//!   the invocation of an older run's lease a `DryRun` and take the lease again).
//!
//! [`check`] walks every path of a definition (and of its `Map` iterations, which inherit the
//! lease and the checked bounds through `ItemSelector`) and returns what breaks the rule.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use serde_json::{Map, Value};

/// The longest a Lambda invocation runs: 900 s (Lambda's largest function timeout), plus the
/// 10 s of init an on-demand function may spend before it, plus a margin.
pub const LONGEST_INVOCATION_S: u64 = 930;
/// Time a timed lease keeps in hand beyond its work: the transitions between the take and the
/// work and between the work and the release, and the clock margin of its safe time.
pub const SLACK_S: u64 = 60;
/// Errors with which a Lambda task ends while its invocation may still run (or start).
pub const UNSETTLED: [&str; 5] = [
    "States.Timeout",
    "Lambda.ServiceException",
    "Lambda.AWSLambdaException",
    "Lambda.SdkClientException",
    "Lambda.ClientExecutionTimeoutException",
];
/// The context object field a redrive increments.
pub const REDRIVE_COUNT: &str = "$$.Execution.RedriveCount";

/// What the walk found: the violations, and how many work states each kind of lease covered.
#[derive(Debug, Default)]
pub struct Report {
    pub violations: BTreeSet<String>,
    /// Takes found (states).
    pub takes: BTreeSet<String>,
    /// Work states reached under a bound lease.
    pub bound_work: BTreeSet<String>,
    /// Work states reached under a timed lease.
    pub timed_work: BTreeSet<String>,
}

impl Report {
    /// True when the definition takes a lease somewhere.
    pub fn works_under_a_lease(&self) -> bool {
        !self.takes.is_empty()
    }
}

/// Checks the definition `def` (named `name` in the messages).
pub fn check(name: &str, def: &Value) -> Report {
    let mut w = Walker { name: name.to_string(), report: Report::default(), seen: HashSet::new() };
    let states = def["States"].as_object().expect("States");
    let start = def["StartAt"].as_str().expect("StartAt");
    w.scope("", states, start, Flow::default());
    w.report
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Duration {
    Literal(u64),
    Path(String),
    Unknown,
}

/// The last `$.request` a Pass built (the take sends it).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Request {
    bound: bool,
    duration: Duration,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Hold {
    take: String,
    bound: bool,
    /// The least duration the lease can have (timed leases), ms.
    min_ms: Option<u64>,
    /// What the path did under it since it was taken or renewed, s (timed leases).
    elapsed_s: u64,
}

/// The abstract state of one path.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
struct Flow {
    hold: Option<Hold>,
    request: Option<Request>,
    /// Bounds a Choice established on a path's value: (least, most).
    guards: BTreeMap<String, (Option<i64>, Option<i64>)>,
    /// A work invocation may still run.
    pending: bool,
}

enum Kind {
    Take,
    Renew,
    Release,
    /// Starts an execution, or a lease operation that is neither (count, put, get).
    Control,
    Work {
        lambda: bool,
    },
}

fn kind(s: &Value) -> Kind {
    let resource = s["Resource"].as_str().unwrap_or_default();
    if resource.contains(":states:::states:startExecution") {
        return Kind::Control;
    }
    let p = &s["Parameters"];
    let function = p["FunctionName"].as_str().unwrap_or_default();
    let op = p["Payload"]["op"].as_str();
    match function {
        "${AcquireFunctionArn}" if matches!(op, None | Some("acquire" | "next")) => Kind::Take,
        "${HeartbeatFunctionArn}" if op.is_none() => Kind::Renew,
        "${ReleaseFunctionArn}" => Kind::Release,
        "${AcquireFunctionArn}" | "${HeartbeatFunctionArn}" => Kind::Control,
        _ => Kind::Work { lambda: resource.contains(":lambda:invoke") || resource.contains(":function:") },
    }
}

/// Does `error` match the `ErrorEquals` list?
fn matches(error_equals: &Value, error: &str) -> bool {
    error_equals
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .any(|e| e == error || e == "States.ALL" || (e == "States.TaskFailed" && error != "States.Timeout"))
}

fn mentions(v: &Value, needle: &str) -> bool {
    match v {
        Value::String(s) => s.contains(needle),
        Value::Array(a) => a.iter().any(|v| mentions(v, needle)),
        Value::Object(o) => o.values().any(|v| mentions(v, needle)),
        _ => false,
    }
}

/// A plain reference path (no intrinsic function, no context object).
fn plain_path(v: &str) -> Option<&str> {
    (v == "$" || v.starts_with("$.")).then_some(v)
}

/// The successors of a Choice state: each rule's, under its bound and the negation of every
/// earlier rule's, and the default's, under the negation of all of them.
fn choices(s: &Value, flow: &Flow) -> Vec<(String, Flow)> {
    let mut out = Vec::new();
    let rules = s["Choices"].as_array().cloned().unwrap_or_default();
    for (i, rule) in rules.iter().enumerate() {
        let mut f = flow.clone();
        for earlier in &rules[..i] {
            if let Some(b) = bound_of(earlier, false) {
                add_bound(&mut f.guards, b);
            }
        }
        if let Some(b) = bound_of(rule, true) {
            add_bound(&mut f.guards, b);
        }
        out.push((rule["Next"].as_str().unwrap_or_default().to_string(), f));
    }
    let mut f = flow.clone();
    for r in &rules {
        if let Some(b) = bound_of(r, false) {
            add_bound(&mut f.guards, b);
        }
    }
    if let Some(d) = s["Default"].as_str() {
        out.push((d.to_string(), f));
    }
    out
}

/// The guards of `guards` seen through a payload template `params` whose output is written
/// at `result_path` (`$`: the template is the whole output, the rest of the input is gone).
fn map_guards(
    guards: &BTreeMap<String, (Option<i64>, Option<i64>)>,
    params: &Value,
    result_path: &str,
) -> BTreeMap<String, (Option<i64>, Option<i64>)> {
    let mut out: BTreeMap<String, (Option<i64>, Option<i64>)> = if result_path == "$" {
        BTreeMap::new()
    } else {
        guards
            .iter()
            .filter(|(k, _)| !(k.as_str() == result_path || k.starts_with(&format!("{result_path}."))))
            .map(|(k, v)| (k.clone(), *v))
            .collect()
    };
    fn visit(
        obj: &Map<String, Value>,
        prefix: &str,
        guards: &BTreeMap<String, (Option<i64>, Option<i64>)>,
        out: &mut BTreeMap<String, (Option<i64>, Option<i64>)>,
    ) {
        for (k, v) in obj {
            if let Some(name) = k.strip_suffix(".$") {
                let Some(src) = v.as_str().and_then(plain_path) else { continue };
                for (g, b) in guards {
                    let rest = if g == src {
                        Some("")
                    } else if src == "$" {
                        g.strip_prefix('$')
                    } else {
                        g.strip_prefix(src).filter(|r| r.starts_with('.'))
                    };
                    if let Some(rest) = rest {
                        out.insert(format!("{prefix}.{name}{rest}"), *b);
                    }
                }
            } else if let Some(inner) = v.as_object() {
                visit(inner, &format!("{prefix}.{k}"), guards, out);
            }
        }
    }
    if let Some(obj) = params.as_object() {
        visit(obj, result_path, guards, &mut out);
    }
    out
}

/// The bound a numeric comparison with a literal puts on its variable when it holds (`taken`)
/// or when it does not.
fn bound_of(rule: &Value, taken: bool) -> Option<(String, Option<i64>, Option<i64>)> {
    let var = rule["Variable"].as_str()?.to_string();
    for (op, lower_when_taken) in [
        ("NumericLessThan", false),
        ("NumericLessThanEquals", false),
        ("NumericGreaterThan", true),
        ("NumericGreaterThanEquals", true),
    ] {
        if let Some(c) = rule[op].as_f64() {
            // Taken: a lower bound for >, >=; an upper one for <, <=. Not taken: the reverse.
            let lower = lower_when_taken == taken;
            let (lo, hi) = if lower { (Some(c.ceil() as i64), None) } else { (None, Some(c.floor() as i64)) };
            return Some((var, lo, hi));
        }
    }
    if let Some(c) = rule["NumericEquals"].as_f64() {
        if taken {
            return Some((var, Some(c as i64), Some(c as i64)));
        }
    }
    None
}

fn add_bound(guards: &mut BTreeMap<String, (Option<i64>, Option<i64>)>, b: (String, Option<i64>, Option<i64>)) {
    let e = guards.entry(b.0).or_insert((None, None));
    e.0 = match (e.0, b.1) {
        (Some(a), Some(c)) => Some(a.max(c)),
        (a, c) => a.or(c),
    };
    e.1 = match (e.1, b.2) {
        (Some(a), Some(c)) => Some(a.min(c)),
        (a, c) => a.or(c),
    };
}

fn request_of(params: &Value) -> Request {
    let bound = params["keepalive"]["execution_arn.$"] == "$$.Execution.Id";
    let duration = if let Some(ms) = params["duration_ms"].as_u64() {
        Duration::Literal(ms)
    } else if let Some(p) = params["duration_ms.$"].as_str().and_then(plain_path) {
        Duration::Path(p.to_string())
    } else {
        Duration::Unknown
    };
    Request { bound, duration }
}

/// (attempts, backoff seconds) of a Task's `Retry` at its worst.
fn attempts_and_backoff(s: &Value) -> (u64, u64) {
    let mut attempts = 1;
    let mut backoff = 0.0;
    for r in s["Retry"].as_array().into_iter().flatten() {
        let n = r["MaxAttempts"].as_u64().unwrap_or(3);
        let interval = r["IntervalSeconds"].as_f64().unwrap_or(1.0);
        let rate = r["BackoffRate"].as_f64().unwrap_or(2.0);
        let cap = r["MaxDelaySeconds"].as_f64().unwrap_or(f64::INFINITY);
        attempts += n;
        for i in 0..n {
            backoff += (interval * rate.powi(i as i32)).min(cap);
        }
    }
    (attempts, backoff.ceil() as u64)
}

struct Walker {
    name: String,
    report: Report,
    seen: HashSet<(String, String, Flow)>,
}

impl Walker {
    fn violation(&mut self, scope: &str, state: &str, what: String) {
        let at = if scope.is_empty() { state.to_string() } else { format!("{scope}/{state}") };
        self.report.violations.insert(format!("{}: {at}: {what}", self.name));
    }

    /// A timed lease's work so far against its least duration.
    fn check_time(&mut self, scope: &str, state: &str, hold: &Hold) {
        if hold.bound {
            return;
        }
        match hold.min_ms {
            None => self.violation(
                scope,
                state,
                format!("the lease taken at {} is neither bound to the execution nor of a checked duration", hold.take),
            ),
            Some(ms) if (hold.elapsed_s + SLACK_S) * 1000 > ms => self.violation(
                scope,
                state,
                format!(
                    "the lease taken at {} lasts at least {ms} ms, but the path runs {} s under it (+{SLACK_S} s)",
                    hold.take, hold.elapsed_s
                ),
            ),
            Some(_) => {}
        }
    }

    /// The end of a path (an end state, or the lease given up): nothing may still run.
    fn end(&mut self, scope: &str, state: &str, flow: &Flow) {
        if flow.pending {
            self.violation(scope, state, "the path ends while the work's invocation may still run".into());
        }
        if let Some(h) = &flow.hold {
            self.check_time(scope, state, h);
        }
    }

    fn scope(&mut self, scope: &str, states: &Map<String, Value>, start: &str, flow: Flow) {
        let mut todo = vec![(start.to_string(), flow)];
        while let Some((name, flow)) = todo.pop() {
            // A timed lease going round a loop without a heartbeat: reported once, not followed.
            if flow.hold.as_ref().is_some_and(|h| h.elapsed_s > 10_000_000) {
                self.violation(scope, &name, "an unbounded loop under a timed lease".into());
                continue;
            }
            if !self.seen.insert((scope.to_string(), name.clone(), flow.clone())) {
                continue;
            }
            let Some(s) = states.get(&name) else {
                self.violation(scope, &name, "no such state".into());
                continue;
            };
            for (next, f) in self.step(scope, &name, s, flow) {
                todo.push((next, f));
            }
        }
    }

    /// The successors of state `name` and the flow along each.
    fn step(&mut self, scope: &str, name: &str, s: &Value, mut flow: Flow) -> Vec<(String, Flow)> {
        let mut out = Vec::new();
        let next = s["Next"].as_str().map(str::to_string);
        match s["Type"].as_str().unwrap_or_default() {
            "Pass" => {
                let rp = s["ResultPath"].as_str().unwrap_or("$");
                if s.get("Parameters").is_some() {
                    flow.guards = map_guards(&flow.guards, &s["Parameters"], rp);
                }
                if rp == "$.request" {
                    flow.request = Some(request_of(&s["Parameters"]));
                }
            }
            "Choice" => return choices(s, &flow),
            "Wait" => self.wait(scope, name, s, &mut flow),
            "Task" => return self.task(scope, name, s, flow),
            "Map" | "Parallel" => out = self.nested(scope, name, s, &mut flow),
            _ => {
                // Succeed, Fail.
                self.end(scope, name, &flow);
                return out;
            }
        }
        match next {
            Some(n) => out.push((n, flow)),
            None => self.end(scope, name, &flow),
        }
        out
    }

    /// A Wait state: its seconds (given, or the guarded value of its path) add to a timed
    /// lease's time; a long one outlasts the work's invocation.
    fn wait(&mut self, scope: &str, name: &str, s: &Value, flow: &mut Flow) {
        let seconds = s["Seconds"].as_u64().or_else(|| {
            let p = s["SecondsPath"].as_str()?;
            flow.guards.get(p).and_then(|g| g.1).map(|v| v.max(0) as u64)
        });
        if seconds.is_some_and(|w| w >= LONGEST_INVOCATION_S) {
            flow.pending = false;
        }
        if let Some(h) = flow.hold.as_mut().filter(|h| !h.bound) {
            match seconds {
                Some(w) => h.elapsed_s += w,
                None => {
                    let what = "a Wait of unchecked length under a timed lease".to_string();
                    self.violation(scope, name, what);
                }
            }
            let h = h.clone();
            self.check_time(scope, name, &h);
        }
    }

    /// A Map or Parallel state: each of its processors or branches checked as a scope of its
    /// own; the successors along its catches (its `Next` is the caller's).
    fn nested(&mut self, scope: &str, name: &str, s: &Value, flow: &mut Flow) -> Vec<(String, Flow)> {
        let mut out = Vec::new();
        if flow.hold.as_ref().is_some_and(|h| !h.bound) {
            self.violation(scope, name, "a timed lease held across a Map or Parallel state".into());
        }
        let inner_flow = Flow {
            hold: flow.hold.clone(),
            request: None,
            guards: map_guards(&flow.guards, s.get("ItemSelector").unwrap_or(&Value::Null), "$"),
            pending: false,
        };
        let procs: Vec<&Value> = match s.get("ItemProcessor").or(s.get("Iterator")) {
            Some(p) => vec![p],
            None => s["Branches"].as_array().map(|b| b.iter().collect()).unwrap_or_default(),
        };
        for p in procs {
            let inner = p["States"].as_object().expect("States");
            let start = p["StartAt"].as_str().expect("StartAt");
            let sub = if scope.is_empty() { name.to_string() } else { format!("{scope}/{name}") };
            self.scope(&sub, inner, start, inner_flow.clone());
        }
        if let Some(rp) = s["ResultPath"].as_str() {
            flow.guards.retain(|k, _| !(k == rp || k.starts_with(&format!("{rp}."))));
        }
        for c in s["Catch"].as_array().into_iter().flatten() {
            out.push((c["Next"].as_str().unwrap_or_default().to_string(), flow.clone()));
        }
        out
    }

    fn task(&mut self, scope: &str, name: &str, s: &Value, flow: Flow) -> Vec<(String, Flow)> {
        let mut after = flow.clone();
        if let Some(rp) = s["ResultPath"].as_str() {
            after.guards.retain(|k, _| !(k == rp || k.starts_with(&format!("{rp}."))));
        }
        let mut on_catch: Vec<Flow> = vec![];
        let catches = s["Catch"].as_array().cloned().unwrap_or_default();
        match kind(s) {
            Kind::Take => {
                let at = if scope.is_empty() { name.to_string() } else { format!("{scope}/{name}") };
                self.report.takes.insert(at.clone());
                if flow.pending {
                    self.violation(scope, name, "takes a lease while the last work's invocation may still run".into());
                }
                let hold = self.hold_of(scope, name, s, &flow, at);
                after.hold = Some(hold);
                after.pending = false;
                for c in &catches {
                    let mut f = after.clone();
                    if c["ErrorEquals"] == serde_json::json!(["LeaseHeld"]) {
                        // Refused: nothing was taken.
                        f.hold = flow.hold.clone();
                    }
                    on_catch.push(f);
                }
            }
            Kind::Renew => {
                if let Some(h) = after.hold.as_mut() {
                    h.elapsed_s = 0;
                }
                on_catch = catches.iter().map(|_| after.clone()).collect();
            }
            Kind::Release => {
                if flow.pending {
                    self.violation(scope, name, "releases while the work's invocation may still run".into());
                }
                if let Some(h) = &flow.hold {
                    self.check_time(scope, name, h);
                }
                after.hold = None;
                after.pending = false;
                on_catch = catches.iter().map(|_| after.clone()).collect();
            }
            Kind::Control => {
                on_catch = catches.iter().map(|_| after.clone()).collect();
            }
            Kind::Work { lambda } => {
                self.work(scope, name, s, &flow, lambda, &mut after);
                let mut unsettled: Vec<&str> = if lambda { UNSETTLED.to_vec() } else { vec![] };
                for c in &catches {
                    let mut f = after.clone();
                    let caught: Vec<&str> =
                        unsettled.iter().copied().filter(|e| matches(&c["ErrorEquals"], e)).collect();
                    unsettled.retain(|e| !caught.contains(e));
                    f.pending = !caught.is_empty();
                    on_catch.push(f);
                }
                if !unsettled.is_empty() {
                    // Uncaught, they end the execution with the invocation perhaps running.
                    let mut f = after.clone();
                    f.pending = true;
                    self.end(scope, name, &f);
                }
            }
        }
        let mut out = Vec::new();
        for (c, f) in catches.iter().zip(on_catch) {
            let mut f = f;
            if let Some(rp) = c["ResultPath"].as_str() {
                f.guards.retain(|k, _| !(k == rp || k.starts_with(&format!("{rp}."))));
            }
            out.push((c["Next"].as_str().unwrap_or_default().to_string(), f));
        }
        match s["Next"].as_str() {
            Some(n) => out.push((n.to_string(), after)),
            None => self.end(scope, name, &after),
        }
        out
    }

    fn hold_of(&mut self, scope: &str, name: &str, s: &Value, flow: &Flow, at: String) -> Hold {
        let p = &s["Parameters"];
        let request = match (p.get("Payload.$").and_then(Value::as_str), p.get("Payload")) {
            (Some("$.request"), _) => flow.request.clone(),
            (None, Some(payload)) => {
                let mut r = request_of(payload);
                if payload["keepalive.$"] == "$.request.keepalive" {
                    r.bound = flow.request.as_ref().is_some_and(|q| q.bound);
                }
                if let Duration::Path(d) = &r.duration {
                    if d.starts_with("$.request.") {
                        r.duration = flow.request.as_ref().map(|q| q.duration.clone()).unwrap_or(Duration::Unknown);
                    }
                }
                Some(r)
            }
            _ => None,
        };
        let Some(request) = request else {
            self.violation(scope, name, "a take whose request is not known (Payload.$ other than $.request)".into());
            return Hold { take: at, bound: false, min_ms: None, elapsed_s: 0 };
        };
        let min_ms = match &request.duration {
            Duration::Literal(ms) => Some(*ms),
            Duration::Path(p) => flow.guards.get(p).and_then(|g| g.0).map(|v| v.max(0) as u64),
            Duration::Unknown => None,
        };
        Hold { take: at, bound: request.bound, min_ms, elapsed_s: 0 }
    }

    fn work(&mut self, scope: &str, name: &str, s: &Value, flow: &Flow, lambda: bool, after: &mut Flow) {
        let at = if scope.is_empty() { name.to_string() } else { format!("{scope}/{name}") };
        let Some(hold) = flow.hold.clone() else {
            self.violation(scope, name, "works without a lease".into());
            return;
        };
        if hold.bound {
            self.report.bound_work.insert(at);
        } else {
            self.report.timed_work.insert(at);
        }
        if !mentions(&s["Parameters"], REDRIVE_COUNT) {
            self.violation(
                scope,
                name,
                format!("runs on a redrive with the lease of an earlier run (no {REDRIVE_COUNT})"),
            );
        }
        if flow.pending {
            self.violation(scope, name, "starts an invocation while the last one may still run".into());
        }
        if lambda {
            for r in s["Retry"].as_array().into_iter().flatten() {
                let unsettled = UNSETTLED.iter().any(|e| matches(&r["ErrorEquals"], e));
                if unsettled && r["IntervalSeconds"].as_u64().unwrap_or(1) < LONGEST_INVOCATION_S {
                    self.violation(
                        scope,
                        name,
                        format!("retries {} sooner than the last invocation must have ended", r["ErrorEquals"]),
                    );
                }
            }
        }
        if let Some(h) = after.hold.as_mut().filter(|h| !h.bound) {
            match s["TimeoutSeconds"].as_u64() {
                Some(t) => {
                    let (attempts, backoff) = attempts_and_backoff(s);
                    h.elapsed_s += attempts * t + backoff;
                }
                None => {
                    let what = "a work state without TimeoutSeconds under a timed lease".to_string();
                    self.violation(scope, name, what);
                }
            }
            let h = h.clone();
            self.check_time(scope, name, &h);
        }
        after.pending = false;
    }
}
