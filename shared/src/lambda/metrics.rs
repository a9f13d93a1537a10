//! The functions' metrics: one CloudWatch embedded-metric line per invocation (DESIGN.md,
//! "Observability").

use super::*;

/// The CloudWatch namespace of every metric the functions emit.
pub const METRIC_NAMESPACE: &str = "leasehold";

/// Per-invocation metrics with dimensions `Function` and `Outcome` (`ok` or the error name;
/// `sweep` for a keep-alive sweep).
pub const OUTCOME_METRICS: [&str; 2] = ["Latency", "Invocations"];

/// Counts published per `Function` and over all functions (no dimension). Each invocation
/// sends those that apply to it, 0 or more: `Acquired`, `Contended` (answered `LeaseHeld`)
/// and `Waited` (asked to wait: `wait_ms` > 0) for acquires; `Lost` (`NotHolder`, lease gone
/// for good: HTTP 410) for heartbeats and releases; `Throttled` for every function; and the
/// keep-alive sweep's report: `SweepScanned`, `SweepRenewed`, `SweepReleased` (leases of
/// executions that ended without releasing: crashed or stopped), `SweepErrors`,
/// `SweepDescribeFailures` (leases renewed because DescribeExecution failed for their
/// execution), `SweepIncomplete` (1 when the budget or the time ran out before every shard
/// was read), `QueueSweepErrors` (keys the queue sweep could not serve, or 1 when it could not
/// read the queue index at all); `ClockSkew` (answered `ClockSkew`: this function's clock is
/// refused, see DESIGN.md, "Clocks").
pub const COUNT_METRICS: [&str; 13] = [
    "ClockSkew",
    "Acquired",
    "Contended",
    "Waited",
    "Lost",
    "Throttled",
    "SweepScanned",
    "SweepRenewed",
    "SweepReleased",
    "SweepErrors",
    "SweepDescribeFailures",
    "SweepIncomplete",
    "QueueSweepErrors",
];

/// The counts of one invocation (names from [`COUNT_METRICS`]).
pub(super) fn counts(function: Function, outcome: &str, waited: bool, lost: bool) -> Vec<(&'static str, u64)> {
    let mut c =
        vec![("Throttled", u64::from(outcome == "Throttled")), ("ClockSkew", u64::from(outcome == "ClockSkew"))];
    match function {
        Function::Acquire => c.extend([
            ("Acquired", u64::from(outcome == "ok")),
            ("Contended", u64::from(outcome == "LeaseHeld")),
            ("Waited", u64::from(waited)),
        ]),
        Function::Heartbeat | Function::Release => c.push(("Lost", u64::from(lost))),
    }
    c
}

/// The counts of a scheduled run: the keep-alive sweep's report, the queue sweep's errors.
pub(super) fn sweep_counts(r: &SweepReport, queue_errors: u32, clock_skew: bool) -> Vec<(&'static str, u64)> {
    vec![
        ("Throttled", 0),
        ("ClockSkew", u64::from(clock_skew)),
        ("SweepScanned", r.scanned.into()),
        ("SweepRenewed", r.renewed.into()),
        ("SweepReleased", r.released.into()),
        ("SweepErrors", r.errors.into()),
        ("SweepDescribeFailures", r.describe_failures.into()),
        ("SweepIncomplete", u64::from(!r.complete)),
        ("QueueSweepErrors", queue_errors.into()),
    ]
}

/// One CloudWatch Embedded Metric Format line: Latency and Invocations by Function and
/// Outcome, and the counts by Function and in total.
pub(crate) fn metric_line(function: &str, outcome: &str, latency_ms: f64, counts: &[(&'static str, u64)]) -> Value {
    // A log line's own time stamp: the machine's clock, whatever the coordinator's is.
    let ts = crate::clock::SystemClock.wall_ms().max(0) as u64;
    let mut line = json!({
        "_aws": {
            "Timestamp": ts,
            "CloudWatchMetrics": [{
                "Namespace": METRIC_NAMESPACE,
                "Dimensions": [["Function", "Outcome"]],
                "Metrics": [{"Name": "Latency", "Unit": "Milliseconds"}, {"Name": "Invocations", "Unit": "Count"}]
            }, {
                "Namespace": METRIC_NAMESPACE,
                "Dimensions": [["Function"], []],
                "Metrics": counts.iter().map(|(n, _)| json!({"Name": n, "Unit": "Count"})).collect::<Vec<_>>()
            }]
        },
        "Function": function,
        "Outcome": outcome,
        "Latency": latency_ms,
        "Invocations": 1
    });
    for (n, v) in counts {
        line[*n] = json!(v);
    }
    line
}

/// The clock check's evidence, by `Function` (on every metric line with recent evidence): the bounds of the
/// measured offset `store clock - function clock` in ms, as the recent `Date` headers of the
/// store's answers give it (DESIGN.md, "Clocks").
pub const CLOCK_METRICS: [&str; 2] = ["ClockOffsetLoMs", "ClockOffsetHiMs"];

/// `line` with the measured clock offset interval, when there is recent evidence.
pub(crate) fn with_clock_offset(mut line: Value, offset: Option<(i64, i64)>) -> Value {
    let Some((lo, hi)) = offset else { return line };
    let directive = json!({
        "Namespace": METRIC_NAMESPACE,
        "Dimensions": [["Function"]],
        "Metrics": CLOCK_METRICS.map(|n| json!({"Name": n, "Unit": "Milliseconds"}))
    });
    if let Some(d) = line["_aws"]["CloudWatchMetrics"].as_array_mut() {
        d.push(directive);
    }
    line["ClockOffsetLoMs"] = json!(lo);
    line["ClockOffsetHiMs"] = json!(hi);
    line
}

pub(super) fn emit_metric(function: &str, outcome: &str, latency_ms: f64, counts: &[(&'static str, u64)]) {
    // CloudWatch Embedded Metric Format: one JSON line on stdout per invocation.
    println!("{}", metric_line(function, outcome, latency_ms, counts));
}
