//! The three Lambda functions end to end: the real Lambda runtime emulator (`cargo lambda
//! watch`) runs the real acquire/heartbeat/release binaries over a real DynamoDB Local table
//! (and, for the keep-alive sweep, moto's Step Functions API).
//!
//! - every file in events/ answers as events/expected.json documents;
//! - lease flows over direct invoke and over API Gateway HTTP API events;
//! - an acquire's wait is cut to fit the invocation;
//! - hostile direct-invoke payloads get typed `InvalidRequest` errors and change nothing;
//! - the scheduled keep-alive sweep renews, releases, skips, runs concurrently and pages.
//!
//! Deadline note: `cargo lambda watch` sends `Lambda-Runtime-Deadline-Ms: 600000` (a constant,
//! i.e. 1970), so the functions fall back to Lambda's default 3 s timeout: a wait is cut to
//! 3 s - 1.5 s safety margin = 1.5 s, and a sweep gets 1.5 s.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use leasehold::store::{keepalive_shard, KEEPALIVE_SHARDS};
use leasehold::{AcquireOptions, Keepalive, LeaseId};
use leasehold_tests::apigw;
use leasehold_tests::emulator::Moto;
use leasehold_tests::lambda_lab::{
    check_case, http_answer, http_event, now_ms, read_event, HttpAnswer, Lab, FUNCTIONS,
};
use leasehold_tests::{free_port, repo_root};
use serde_json::{json, Value};

// ------------------------------------------------------------------------------------------
// The event catalogue (events/expected.json, interpreted by leasehold_tests::lambda_lab)
// ------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_file_answers_as_documented() {
    let expected: Value = read_event("expected.json");
    let specs = expected["events"].as_object().expect("events");
    let files: BTreeSet<String> = std::fs::read_dir(repo_root().join("events"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".json") && n != "expected.json")
        .collect();
    let listed: BTreeSet<String> = specs.keys().cloned().collect();
    assert_eq!(files, listed, "events/expected.json must list exactly the event files");

    let lab = Lab::start(&[], &[]).await;
    let mut failures = Vec::new();
    let mut cases = 0;
    for (name, spec) in specs {
        for (i, case) in spec["cases"].as_array().expect("cases").iter().enumerate() {
            cases += 1;
            let function = case.get("function").or(spec.get("function")).and_then(Value::as_str).unwrap();
            let setup = case["setup"].as_str().unwrap();
            match check_case(&lab, name, spec, case).await {
                Ok(outcome) => println!("ok   {name:<34} #{i} {function:<9} {setup:<21} {outcome}"),
                Err(why) => {
                    println!("FAIL {name:<34} #{i} {function:<9} {setup:<21} {why}");
                    failures.push(format!("{name} case {i} ({function}, {setup}): {why}"));
                }
            }
        }
    }
    lab.assert_no_respawn();
    assert!(failures.is_empty(), "{} of {cases} cases failed:\n{}", failures.len(), failures.join("\n"));
    println!("{cases} cases over {} event files passed", specs.len());
}

// ------------------------------------------------------------------------------------------
// Flows
// ------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_invoke_flow_acquire_held_heartbeat_release_reacquire() {
    let lab = Lab::start(&[], &[]).await;
    let key = "flows/direct/orders-7";
    let a = lab.invoke("acquire", &json!({"key": key, "holder": "worker-a", "duration_ms": 5000})).await;
    assert!(a.error_type.is_none(), "{}", a.body);
    let lease_a = a.body["lease_id"].as_str().unwrap().to_string();
    let fence = a.body["fence"].as_u64().unwrap();
    let expires = a.body["expires_at_ms"].as_u64().unwrap();

    // A second holder: LeaseHeld, naming the holder and when the lease expires.
    let b = lab.invoke("acquire", &json!({"key": key, "holder": "worker-b", "duration_ms": 5000})).await;
    assert_eq!(b.error_type.as_deref(), Some("LeaseHeld"), "{}", b.body);
    let held = b.error_body();
    assert_eq!(held["error"], "LeaseHeld");
    assert_eq!(held["holder"], "worker-a");
    assert_eq!(held["key"], key);
    assert_eq!(held["expires_at_ms"].as_u64(), Some(expires));
    assert!(held.get("lease_id").is_none(), "a LeaseHeld error must not reveal the lease_id");

    tokio::time::sleep(Duration::from_millis(30)).await;
    let hb = lab.invoke("heartbeat", &json!({"key": key, "lease_id": lease_a, "duration_ms": 8000})).await;
    assert!(hb.error_type.is_none(), "{}", hb.body);
    assert_eq!(hb.body["fence"].as_u64(), Some(fence));
    assert!(hb.body["expires_at_ms"].as_u64().unwrap() > expires, "heartbeat extends the lease");
    assert_eq!(hb.body["duration_ms"], 8000);

    let wrong = lab.invoke("heartbeat", &json!({"key": key, "lease_id": LeaseId::generate().expose()})).await;
    assert_eq!(wrong.error_type.as_deref(), Some("NotHolder"));
    assert_eq!(wrong.error_body()["reason"], "wrong_lease_id");

    let rel = lab.invoke("release", &json!({"key": key, "lease_id": lease_a})).await;
    assert!(rel.error_type.is_none(), "{}", rel.body);
    assert_eq!(rel.body["fence"].as_u64(), Some(fence));
    let again = lab.invoke("release", &json!({"key": key, "lease_id": lease_a})).await;
    assert!(again.error_type.is_none(), "a retried release succeeds: {}", again.body);

    let late = lab.invoke("heartbeat", &json!({"key": key, "lease_id": lease_a})).await;
    assert_eq!(late.error_type.as_deref(), Some("NotHolder"));
    assert_eq!(late.error_body()["reason"], "released");

    let state = lab.state(key).await;
    assert!(!state.held);
    assert_eq!(state.fence, fence, "release keeps the fence");

    let c = lab.invoke("acquire", &json!({"key": key, "holder": "worker-b", "duration_ms": 5000})).await;
    assert!(c.error_type.is_none(), "{}", c.body);
    assert!(c.body["fence"].as_u64().unwrap() > fence, "re-acquire gets the next fence");
    assert_eq!(c.body["holder"], "worker-b");

    let stale = lab.invoke("release", &json!({"key": key, "lease_id": lease_a})).await;
    assert_eq!(stale.error_type.as_deref(), Some("NotHolder"), "the old holder cannot release the new lease");
    assert_eq!(lab.state(key).await.holder, "worker-b");

    // lease_ids never reach a log line (the functions log to the emulator's output).
    let log = lab.emu.server.log_text();
    for id in [lease_a.as_str(), c.body["lease_id"].as_str().unwrap()] {
        assert!(!log.contains(id), "a lease_id was logged");
    }
    assert!(log.contains("\"Namespace\":\"leasehold\""), "an EMF metric line per invocation");
    // The counts the dashboard and alarms read: an acquire, a heartbeat that found its lease
    // gone (Lost), one that renewed (not lost).
    let emf: Vec<Value> = log
        .lines()
        .filter(|l| l.contains("\"_aws\""))
        .filter_map(|l| l.find('{').and_then(|i| serde_json::from_str(&l[i..]).ok()))
        .collect();
    let has = |function: &str, outcome: &str, metric: &str, value: u64| {
        emf.iter().any(|m| m["Function"] == function && m["Outcome"] == outcome && m[metric] == value)
    };
    assert!(has("acquire", "ok", "Acquired", 1) && has("acquire", "ok", "Contended", 0), "{emf:#?}");
    assert!(has("heartbeat", "NotHolder", "Lost", 1) && has("heartbeat", "ok", "Lost", 0), "{emf:#?}");
    lab.assert_no_respawn();
}

/// A release that handed the key to the head of its queue (a queued acquire, over direct
/// invoke; its delivery fails here, which leaves the grant marked for the sweep) answers a
/// retry (a lost answer, a Lambda retry) with `already_released` and the released lease's
/// fence, not `wrong_lease_id`, and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_invoke_retried_release_after_a_hand_over_is_already_released() {
    // 30 s instead of the 3 s the functions assume without a deadline: on a loaded machine one
    // DynamoDB Local request can take the 3 s attempt timeout, and the retry that recognises the
    // grant by its lease_id needs time left. (What is tested is the retried release's answer.)
    let lab = Lab::start(&[("LEASEHOLD_ASSUMED_TIMEOUT_MS", "30000".to_string())], &[]).await;
    let key = "flows/direct/hand-over-retry";
    let a = lab.invoke("acquire", &json!({"key": key, "holder": "worker-a", "duration_ms": 30000})).await;
    assert!(a.error_type.is_none(), "{}", a.body);
    let (lease_a, fence) = (a.body["lease_id"].as_str().unwrap().to_string(), a.body["fence"].as_u64().unwrap());
    let q = lab
        .invoke("acquire", &json!({"key": key, "holder": "queued-b", "duration_ms": 30000, "task_token": "token-b"}))
        .await;
    assert!(q.error_type.is_none(), "{}", q.body);
    assert_eq!(q.body["queued"], true, "{}", q.body);
    let rel = lab.invoke("release", &json!({"key": key, "lease_id": lease_a})).await;
    assert!(rel.error_type.is_none(), "{}", rel.body);
    assert_eq!(rel.body["fence"].as_u64(), Some(fence));
    let state = lab.state(key).await;
    assert!(state.held && state.holder == "queued-b", "handed over: {state:?}");
    let again = lab.invoke("release", &json!({"key": key, "lease_id": lease_a})).await;
    assert!(again.error_type.is_none(), "a retried release after the hand-over: {}", again.body);
    assert_eq!(again.body["already_released"], true, "{}", again.body);
    assert_eq!(again.body["fence"].as_u64(), Some(fence));
    assert_eq!(lab.state(key).await.holder, "queued-b", "the retry changed nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_api_flow_statuses_headers_and_bodies() {
    let lab = Lab::start(&[], &[]).await;
    let key = "tenants/acme/jobs/nightly";
    let acquire = |holder: &str, ms: u64| {
        http_event(
            "POST",
            &format!("/leases/acquire/{key}"),
            "POST /leases/acquire/{key+}",
            Some(&json!({"holder": holder, "duration_ms": ms}).to_string()),
        )
    };
    let call = |function: &'static str, ev: Value| {
        let lab = &lab;
        async move { http_answer(&lab.invoke(function, &ev).await).unwrap_or_else(|e| panic!("{e}")) }
    };

    let a = call("acquire", acquire("worker-a", 20_000)).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(a.body["key"], key, "the whole rest of the path is the key");
    let lease_a = a.body["lease_id"].as_str().unwrap().to_string();
    let fence = a.body["fence"].as_u64().unwrap();

    let b = call("acquire", acquire("worker-b", 20_000)).await;
    assert_eq!(b.status, 409, "{:?}", b.body);
    assert_eq!(b.body["error"], "LeaseHeld");
    assert_eq!(b.body["holder"], "worker-a");
    assert!(b.body["expires_at_ms"].as_u64().is_some());
    let retry: u64 = b.header("retry-after").expect("Retry-After on 409").parse().unwrap();
    assert!((1..=20).contains(&retry), "Retry-After {retry} s within the lease's remaining time");

    let hb_ev = |id: &str| {
        http_event(
            "POST",
            &format!("/leases/heartbeat/{key}"),
            "POST /leases/heartbeat/{key+}",
            Some(&json!({"lease_id": id}).to_string()),
        )
    };
    let hb = call("heartbeat", hb_ev(&lease_a)).await;
    assert_eq!(hb.status, 200, "{:?}", hb.body);
    assert_eq!(hb.body["fence"].as_u64(), Some(fence));

    let rel_ev = |id: &str| {
        http_event(
            "POST",
            &format!("/leases/release/{key}"),
            "POST /leases/release/{key+}",
            Some(&json!({"lease_id": id}).to_string()),
        )
    };
    let rel = call("release", rel_ev(&lease_a)).await;
    assert_eq!(rel.status, 200, "{:?}", rel.body);

    let gone = call("heartbeat", hb_ev(&lease_a)).await;
    assert_eq!(gone.status, 410, "heartbeat after release: {:?}", gone.body);
    assert_eq!(gone.body["error"], "NotHolder");
    assert_eq!(gone.body["reason"], "released");

    let get = call("heartbeat", http_event("GET", &format!("/leases/{key}"), "GET /leases/{key+}", None)).await;
    assert_eq!(get.status, 200);
    assert_eq!(get.body["held"], false);
    assert_eq!(get.body["fence"].as_u64(), Some(fence));
    assert!(get.body.get("lease_id").is_none(), "GET never shows the lease_id");

    let unknown = call("heartbeat", http_event("GET", "/leases/no/such/key", "GET /leases/{key+}", None)).await;
    assert_eq!(unknown.status, 404);
    assert_eq!(unknown.body["error"], "NotFound");

    let c = call("acquire", acquire("worker-b", 20_000)).await;
    assert_eq!(c.status, 200, "{:?}", c.body);
    assert!(c.body["fence"].as_u64().unwrap() > fence);

    // A unicode key (API Gateway delivers it decoded).
    let ukey = "café/ключ/🔒";
    let u = call(
        "acquire",
        http_event(
            "POST",
            &format!("/leases/acquire/{ukey}"),
            "POST /leases/acquire/{key+}",
            Some(r#"{"holder":"w"}"#),
        ),
    )
    .await;
    assert_eq!(u.status, 200, "{:?}", u.body);
    assert_eq!(u.body["key"], ukey);
    let ug = call("heartbeat", http_event("GET", &format!("/leases/{ukey}"), "GET /leases/{key+}", None)).await;
    assert_eq!(ug.body["held"], true);

    // Bad inputs: always a 4xx with a JSON error body, never a 500 or a function error.
    let p = format!("/leases/acquire/{key}");
    let rk = "POST /leases/acquire/{key+}";
    let mut bad: Vec<(&str, Value, u64)> = vec![
        ("malformed JSON", http_event("POST", &p, rk, Some("{\"holder\": ")), 400),
        ("no body", http_event("POST", &p, rk, None), 400),
        ("empty body", http_event("POST", &p, rk, Some("")), 400),
        ("missing holder", http_event("POST", &p, rk, Some("{}")), 400),
        ("negative duration", http_event("POST", &p, rk, Some(r#"{"holder":"w","duration_ms":-1}"#)), 400),
        (
            "huge duration",
            http_event("POST", &p, rk, Some(r#"{"holder":"w","duration_ms":18446744073709551615}"#)),
            400,
        ),
        ("overflowing duration", http_event("POST", &p, rk, Some(r#"{"holder":"w","duration_ms":1e40}"#)), 400),
        ("wrong types", http_event("POST", &p, rk, Some(r#"{"holder":["w"],"wait_ms":"1s"}"#)), 400),
        ("unknown field", http_event("POST", &p, rk, Some(r#"{"holder":"w","steal":true}"#)), 400),
        ("non-object", http_event("POST", &p, rk, Some(r#""x""#)), 400),
        ("control chars in key", http_event("POST", "/leases/acquire/a\u{0}b", rk, Some(r#"{"holder":"w"}"#)), 400),
        ("dot segment in key", http_event("POST", "/leases/acquire/a/../b", rk, Some(r#"{"holder":"w"}"#)), 400),
        ("empty segment in key", http_event("POST", "/leases/acquire/a//b", rk, Some(r#"{"holder":"w"}"#)), 400),
        (
            "2 KB key",
            http_event("POST", &format!("/leases/acquire/{}", "k".repeat(2048)), rk, Some(r#"{"holder":"w"}"#)),
            400,
        ),
        (
            "body over 64 KiB",
            http_event("POST", &p, rk, Some(&format!(r#"{{"holder":"{}"}}"#, "w".repeat(70_000)))),
            413,
        ),
        ("wrong method", http_event("PUT", &p, "PUT /leases/acquire/{key+}", Some("{}")), 405),
        ("unknown route", http_event("GET", "/nothing/here", "GET /nothing/here", None), 404),
    ];
    let mut b64 = http_event("POST", &p, rk, Some("%%% not base64 %%%"));
    b64["isBase64Encoded"] = json!(true);
    bad.push(("bad base64 body", b64, 400));
    let mut no_method = http_event("POST", &p, rk, Some("{}"));
    no_method["requestContext"]["http"].as_object_mut().unwrap().remove("method");
    bad.push(("event without a method", no_method, 400));

    let before = lab.snapshot().await;
    for (what, ev, status) in bad {
        for function in FUNCTIONS {
            let inv = lab.invoke(function, &ev).await;
            let a = http_answer(&inv).unwrap_or_else(|e| panic!("{what} on {function}: {e}"));
            assert!(a.body["error"].is_string() && a.body["message"].is_string(), "{what}: {:?}", a.body);
            if function != "acquire" && a.body["error"] == "UnknownRoute" {
                // Each function serves only its own routes: an acquire route reaching the
                // heartbeat or release function is refused before its body is read.
                assert_eq!(a.status, 404, "{what} on {function}: {:?}", a.body);
                continue;
            }
            assert_eq!(a.status, status, "{what} on {function}: {:?}", a.body);
        }
    }
    // Route ownership: the release function does not take an acquire.
    let ev = http_event("POST", "/leases/acquire/owned", "POST /leases/acquire/{key+}", Some(r#"{"holder":"w"}"#));
    let a = http_answer(&lab.invoke("release", &ev).await).unwrap();
    assert_eq!((a.status, a.body["error"].as_str()), (404, Some("UnknownRoute")), "{:?}", a.body);
    assert_eq!(lab.snapshot().await, before, "rejected HTTP requests changed the table");
    lab.assert_no_respawn();
}

/// The longest of three refused acquires (no wait) of the held `key` through the emulator: what
/// one invoke costs on this machine right now. Bounds on a wait's end add it, so that a loaded
/// machine's slow invokes are not read as a wait that ran long.
async fn invoke_time(lab: &Lab, key: &str) -> Duration {
    let mut worst = Duration::ZERO;
    for _ in 0..3 {
        let t = Instant::now();
        let r = lab.invoke("acquire", &json!({"key": key, "holder": "probe"})).await;
        assert_eq!(r.error_type.as_deref(), Some("LeaseHeld"), "{}", r.body);
        worst = worst.max(t.elapsed());
    }
    worst
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_wait_is_cut_to_fit_the_invocation() {
    let lab = Lab::start(&[], &[]).await;
    let key = "wait/cut";
    lab.take(key, "other-worker", 60_000, Default::default()).await;
    let invoke = invoke_time(&lab, key).await;
    // The function answers 1.5 s before its 3 s deadline; an invoke of this machine adds its own
    // cost (a loaded machine's can pass the 1.5 s kept).
    let answered_by = Duration::from_millis(3000).max(Duration::from_millis(1500) + 2 * invoke);

    // 20 s asked; the emulator gives no usable deadline, so the function assumes Lambda's
    // default 3 s and keeps 1.5 s to answer: LeaseHeld after about 1.5 s, not 20 s.
    let t = Instant::now();
    let r = lab.invoke("acquire", &json!({"key": key, "holder": "w", "wait_ms": 20_000})).await;
    let took = t.elapsed();
    assert_eq!(r.error_type.as_deref(), Some("LeaseHeld"), "{}", r.body);
    assert!(took >= Duration::from_millis(1300), "the wait was honoured up to the cut ({took:?})");
    assert!(took < answered_by, "answered before the 3 s deadline ({took:?}, invoke {invoke:?})");

    // The same over HTTP: 409 before the deadline.
    let ev = http_event(
        "POST",
        "/leases/acquire/wait/cut",
        "POST /leases/acquire/{key+}",
        Some(r#"{"holder":"w","wait_ms":20000}"#),
    );
    let t = Instant::now();
    let a = http_answer(&lab.invoke("acquire", &ev).await).unwrap();
    let took = t.elapsed();
    assert_eq!(a.status, 409, "{:?}", a.body);
    assert!(took < answered_by, "HTTP answered before the deadline ({took:?}, invoke {invoke:?})");

    // A wait that fits is honoured in full.
    let t = Instant::now();
    let r = lab.invoke("acquire", &json!({"key": key, "holder": "w", "wait_ms": 600})).await;
    assert_eq!(r.error_type.as_deref(), Some("LeaseHeld"));
    assert!(t.elapsed() >= Duration::from_millis(600));

    // A wait over the configured maximum is refused outright.
    let r = lab.invoke("acquire", &json!({"key": key, "holder": "w", "wait_ms": 13 * 3_600_000u64})).await;
    assert_eq!(r.error_type.as_deref(), Some("InvalidRequest"), "{}", r.body);

    // And a waiter gets the lease when it frees up within the cut wait.
    lab.take("wait/frees", "other-worker", 500, Default::default()).await;
    let t = Instant::now();
    let r = lab.invoke("acquire", &json!({"key": "wait/frees", "holder": "w", "wait_ms": 20_000})).await;
    assert!(r.error_type.is_none(), "{}", r.body);
    let bound = Duration::from_millis(1500).max(Duration::from_millis(500) + 3 * invoke);
    assert!(t.elapsed() < bound, "{:?}, bound {bound:?}", t.elapsed());
    lab.assert_no_respawn();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_direct_invoke_payloads_get_typed_errors_and_change_nothing() {
    let lab = Lab::start(&[], &[]).await;
    let held = lab.take("a", "worker-1", 60_000, Default::default()).await;
    let id = held.lease_id.expose().to_string();
    let before = lab.snapshot().await;

    let big_holder = "h".repeat(200_000);
    let deep = format!("{}{}", "[".repeat(5000), "]".repeat(5000));
    let raw: Vec<(&str, Vec<u8>)> = vec![
        ("truncated JSON", br#"{"key": "a", "holder": "#.to_vec()),
        ("not JSON", b"acquire a please".to_vec()),
        ("empty payload", Vec::new()),
        ("invalid UTF-8", vec![0x7b, 0x22, 0xff, 0xfe, 0x22, 0x7d]),
        ("lone surrogate", br#"{"key": "\ud800", "holder": "h"}"#.to_vec()),
        ("deep nesting", deep.into_bytes()),
        ("NaN", b"NaN".to_vec()),
    ];
    let values: Vec<(&str, Value)> = vec![
        ("null", Value::Null),
        ("number", json!(42)),
        ("string", json!("x")),
        ("array", json!([{"key": "b", "holder": "h"}])),
        ("empty object", json!({})),
        ("missing key", json!({"holder": "h"})),
        ("missing holder", json!({"key": "b"})),
        ("key of wrong type", json!({"key": 7, "holder": "h", "lease_id": id})),
        ("holder of wrong type", json!({"key": "b", "holder": {"name": "h"}})),
        ("duration as string", json!({"key": "b", "holder": "h", "duration_ms": "10s"})),
        ("negative duration", json!({"key": "b", "holder": "h", "duration_ms": -1, "lease_id": id})),
        ("zero duration", json!({"key": "b", "holder": "h", "duration_ms": 0, "lease_id": id})),
        ("huge duration", json!({"key": "a", "holder": "h", "duration_ms": u64::MAX, "lease_id": id})),
        ("overflowing duration", json!({"key": "b", "holder": "h", "duration_ms": 1e40})),
        ("fractional duration", json!({"key": "b", "holder": "h", "duration_ms": 1500.5})),
        ("negative wait", json!({"key": "b", "holder": "h", "wait_ms": -5})),
        ("huge wait", json!({"key": "b", "holder": "h", "wait_ms": u64::MAX})),
        ("huge min_hold", json!({"key": "b", "holder": "h", "min_hold_ms": u64::MAX})),
        ("2 KB key", json!({"key": "k".repeat(2048), "holder": "h", "lease_id": id})),
        ("2 KB unicode key", json!({"key": "🔒".repeat(512), "holder": "h", "lease_id": id})),
        ("key with NUL", json!({"key": "a\u{0}", "holder": "h", "lease_id": id})),
        ("key with newline", json!({"key": "a\nb", "holder": "h", "lease_id": id})),
        ("key with DEL", json!({"key": "a\u{7f}", "holder": "h", "lease_id": id})),
        ("key with C1 control", json!({"key": "a\u{85}", "holder": "h", "lease_id": id})),
        ("empty key", json!({"key": "", "holder": "h", "lease_id": id})),
        ("empty holder", json!({"key": "b", "holder": ""})),
        ("200 KB holder", json!({"key": "b", "holder": big_holder})),
        ("holder with control chars", json!({"key": "b", "holder": "h\u{1b}[31m"})),
        ("unknown field", json!({"key": "a", "holder": "h", "lease_id": id, "force": true})),
        ("metadata not an object", json!({"key": "b", "holder": "h", "metadata": "x"})),
        ("metadata over 4 KiB", json!({"key": "b", "holder": "h", "metadata": {"x": "y".repeat(5000)}})),
        ("fail_closed with duration", json!({"key": "b", "holder": "h", "fail_closed": true, "duration_ms": 1000})),
        ("fail_closed as string", json!({"key": "b", "holder": "h", "fail_closed": "yes"})),
        (
            "keepalive on fail_closed",
            json!({"key": "b", "holder": "h", "fail_closed": true, "keepalive": {"until_ms": now_ms() + 60_000}}),
        ),
        ("keepalive in the past", json!({"key": "b", "holder": "h", "keepalive": {"until_ms": 5}})),
        ("keepalive too far", json!({"key": "b", "holder": "h", "keepalive": {"until_ms": u64::MAX}})),
        (
            "keepalive bad arn",
            json!({"key": "b", "holder": "h", "keepalive": {"until_ms": now_ms() + 60_000, "execution_arn": "not-an-arn"}}),
        ),
        (
            "keepalive unknown field",
            json!({"key": "b", "holder": "h", "keepalive": {"until_ms": now_ms() + 60_000, "every": 5}}),
        ),
        ("short lease_id", json!({"key": "a", "holder": "h", "lease_id": "abc"})),
        ("lease_id with spaces", json!({"key": "a", "holder": "h", "lease_id": "x x x x x x x x x x x x x x x"})),
        ("lease_id of 300 chars", json!({"key": "a", "lease_id": "a".repeat(300)})),
        ("lease_id of wrong type", json!({"key": "a", "lease_id": 12345})),
        ("heartbeat duration huge", json!({"key": "a", "lease_id": id, "duration_ms": u64::MAX})),
        ("heartbeat duration zero", json!({"key": "a", "lease_id": id, "duration_ms": 0})),
        ("heartbeat without lease_id", json!({"key": "a"})),
        (
            "scheduled-looking with extras",
            json!({"source": "aws.events", "detail-type": "Scheduled Event", "key": "a"}),
        ),
    ];

    let mut payloads: Vec<(String, Vec<u8>)> = raw.into_iter().map(|(w, b)| (w.to_string(), b)).collect();
    payloads.extend(values.into_iter().map(|(w, v)| (w.to_string(), v.to_string().into_bytes())));
    let mut problems = Vec::new();
    for (what, bytes) in &payloads {
        for function in FUNCTIONS {
            // The scheduled-looking payload is a real sweep on the heartbeat function.
            if what.starts_with("scheduled") && function == "heartbeat" {
                continue;
            }
            let inv = lab.invoke_raw(function, bytes).await;
            let body = inv.error_body();
            let typed = inv.error_type.as_deref() == Some("InvalidRequest") && body["error"] == "InvalidRequest";
            if !typed {
                problems.push(format!("{what} on {function}: {:?} {}", inv.error_type, inv.body));
            }
        }
    }
    assert!(problems.is_empty(), "not typed InvalidRequest errors:\n{}", problems.join("\n"));
    assert_eq!(lab.snapshot().await, before, "hostile payloads changed the table");

    // The functions are still up and the lease untouched.
    let hb = lab.invoke("heartbeat", &json!({"key": "a", "lease_id": id})).await;
    assert!(hb.error_type.is_none(), "{}", hb.body);
    assert_eq!(hb.body["fence"].as_u64(), Some(held.fence));
    // A valid unicode key works.
    let u = lab.invoke("acquire", &json!({"key": "ключ/🔒/é", "holder": "h"})).await;
    assert!(u.error_type.is_none(), "{}", u.body);
    lab.assert_no_respawn();
    println!("{} hostile payloads x 3 functions: all InvalidRequest, table unchanged", payloads.len());
}

// ------------------------------------------------------------------------------------------
// The keep-alive sweep against Step Functions (moto)
// ------------------------------------------------------------------------------------------

struct Sfn {
    client: aws_sdk_sfn::Client,
    machine: String,
}

impl Sfn {
    async fn new(moto: &Moto) -> Sfn {
        let region = std::env::var("AWS_REGION").unwrap_or_else(|_| "us-east-1".into());
        let client = leasehold_tests::sfn_quotas::sfn_client(&moto.endpoint(), &region).await;
        let out = client
            .create_state_machine()
            .name("leasehold-keepalive-e2e")
            .definition(r#"{"StartAt":"Work","States":{"Work":{"Type":"Wait","Seconds":3600,"End":true}}}"#)
            .role_arn("arn:aws:iam::123456789012:role/leasehold-e2e")
            .send()
            .await
            .expect("CreateStateMachine");
        Sfn { client, machine: out.state_machine_arn().to_string() }
    }

    async fn start(&self, name: &str) -> String {
        let out = self
            .client
            .start_execution()
            .state_machine_arn(&self.machine)
            .name(name)
            .send()
            .await
            .expect("StartExecution");
        out.execution_arn().to_string()
    }

    async fn status(&self, arn: &str) -> String {
        let out = self.client.describe_execution().execution_arn(arn).send().await.expect("DescribeExecution");
        out.status().as_str().to_string()
    }
}

fn keepalive(until_ms: u64, execution_arn: Option<&str>) -> AcquireOptions {
    AcquireOptions {
        keepalive: Some(Keepalive { until_ms, execution_arn: execution_arn.map(str::to_string) }),
        ..Default::default()
    }
}

async fn sweep(lab: &Lab) -> Value {
    let r = lab.invoke("heartbeat", &read_event("scheduled.json")).await;
    assert!(r.error_type.is_none(), "scheduled run failed: {}", r.body);
    r.body
}

fn n(report: &Value, field: &str) -> u64 {
    report[field].as_u64().unwrap_or_else(|| panic!("{field} in {report}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalive_sweep_against_step_functions() {
    let moto = tokio::task::spawn_blocking(|| Moto::start(free_port(), free_port())).await.unwrap();
    let sfn = Sfn::new(&moto).await;
    // The emulator sends no usable deadline: the functions would assume 3 s, which a loaded
    // machine can spend on fewer than the 156 leases the full sweep below must cover in one run.
    let env = [("AWS_ENDPOINT_URL_SFN", moto.endpoint()), ("LEASEHOLD_ASSUMED_TIMEOUT_MS", "30000".to_string())];
    let lab = Lab::start(&env, &["--concurrency", "2"]).await;
    // A second emulator on the same table whose runs read at most 60 leases. Started (and
    // warmed) first: a slow start must not run into the short leases below.
    let bounded = Lab::start_on(
        lab.store.clone(),
        &[
            ("AWS_ENDPOINT_URL_SFN", moto.endpoint()),
            ("LEASEHOLD_SWEEP_MAX_ITEMS", "60".into()),
            // Bounded by its item budget, not by the 3 s the emulator's functions assume.
            ("LEASEHOLD_ASSUMED_TIMEOUT_MS", "30000".into()),
        ],
        &[],
    )
    .await;
    let region_arn = |name: &str| sfn.machine.replace(":stateMachine:", ":execution:") + ":" + name;

    let running = sfn.start("running-1").await;
    let aborted = sfn.start("aborted-1").await;
    assert_eq!(sfn.status(&running).await, "RUNNING");
    let missing = region_arn("never-started");

    let until = now_ms() + 600_000;
    let d = 8_000;
    let l_running = lab.take("ka/running", "etl", d, keepalive(until, Some(&running))).await;
    let l_aborted = lab.take("ka/aborted", "etl", d, keepalive(until, Some(&aborted))).await;
    let l_missing = lab.take("ka/missing", "etl", d, keepalive(until, Some(&missing))).await;
    let l_no_arn = lab.take("ka/no-arn", "etl", d, keepalive(until, None)).await;
    // Past its keep-alive deadline by the sweep, yet granted with a safe time: longer than the
    // safe margin (about 320 ms with steady answers: DESIGN.md, "Clocks").
    let past_until = now_ms() + 1_000;
    let l_past = lab.take("ka/past", "etl", d, keepalive(past_until, Some(&running))).await;
    let l_plain = lab.take("ka/plain", "etl", d, Default::default()).await;
    // Keep-alive asked for, but the lease expires before any scheduled run: not resurrected.
    let l_lapsed = lab.take("ka/lapsed", "etl", 600, keepalive(until, None)).await;

    sfn.client.stop_execution().execution_arn(&aborted).send().await.expect("StopExecution");
    assert_eq!(sfn.status(&aborted).await, "ABORTED");
    // Until the keep-alive deadline has passed and the lapsed lease has expired, by the clock
    // of the functions' process too: a process's clock is kept at or behind the store's, by
    // up to its safe margin (about 1.25 s while its evidence is fresh: DESIGN.md, "Clocks"),
    // and until its clock passes the expiry the lapsed lease is live to it.
    let lapsed_at = l_lapsed.expires_at_ms.expect("a lease with a duration");
    tokio::time::sleep(Duration::from_millis(past_until.max(lapsed_at).saturating_sub(now_ms()) + 1_500)).await;

    let report = sweep(&lab).await;
    println!("sweep 1: {report}");
    assert_eq!(n(&report, "errors"), 0, "{report}");
    assert_eq!(report["complete"], true);
    assert_eq!(n(&report, "renewed"), 2, "running + no execution_arn: {report}");
    assert_eq!(n(&report, "released"), 2, "aborted + no such execution: {report}");
    assert_eq!(n(&report, "skipped"), 1, "the lease that expired before the run: {report}");
    assert_eq!(n(&report, "cleared"), 1, "and it leaves the index: {report}");
    assert_eq!(n(&report, "scanned"), 5, "the lease past its keep-alive deadline is not even read: {report}");

    // Bound to a RUNNING execution: renewed, same fence.
    let r = lab.item("ka/running").await.unwrap();
    assert!(r.expires_at_ms.unwrap() > l_running.expires_at_ms.unwrap() + 400, "renewed forward");
    assert_eq!(r.fence, l_running.fence);
    assert_eq!(r.lease_id, l_running.lease_id);
    // No execution_arn: renewed on the deadline alone.
    let r = lab.item("ka/no-arn").await.unwrap();
    assert!(r.expires_at_ms.unwrap() > l_no_arn.expires_at_ms.unwrap() + 400);
    assert_eq!(r.fence, l_no_arn.fence);
    // Past its keep-alive deadline, and no keep-alive at all: untouched.
    assert_eq!(lab.item("ka/past").await.unwrap().expires_at_ms, l_past.expires_at_ms);
    assert_eq!(lab.item("ka/plain").await.unwrap().expires_at_ms, l_plain.expires_at_ms);
    let lapsed = lab.item("ka/lapsed").await.unwrap();
    assert_eq!(lapsed.expires_at_ms, l_lapsed.expires_at_ms, "an expired lease is not renewed");
    assert!(!lab.state("ka/lapsed").await.held);
    // ABORTED, and an execution that does not exist: released at once, fence kept.
    for (key, l) in [("ka/aborted", &l_aborted), ("ka/missing", &l_missing)] {
        let s = lab.state(key).await;
        assert!(!s.held, "{key} released");
        assert!(s.released_at_ms.is_some());
        assert!(s.keepalive.is_none(), "{key}: keep-alive cleared");
        assert_eq!(s.fence, l.fence, "{key}: fence kept");
        let next = lab.invoke("acquire", &json!({"key": key, "holder": "next", "duration_ms": 5000})).await;
        assert!(next.error_type.is_none(), "{}", next.body);
        assert!(next.body["fence"].as_u64().unwrap() > l.fence, "{key}: a new acquire gets a higher fence");
    }
    // The released lease's holder learns it lost the lease.
    let lost = lab.invoke("heartbeat", &json!({"key": "ka/aborted", "lease_id": l_aborted.lease_id.expose()})).await;
    assert_eq!(lost.error_type.as_deref(), Some("NotHolder"));

    // Two scheduled runs at once: both succeed, every lease renewed, nothing lost.
    let before_running = lab.item("ka/running").await.unwrap();
    let before_no_arn = lab.item("ka/no-arn").await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (r1, r2) = tokio::join!(sweep(&lab), sweep(&lab));
    println!("concurrent sweeps: {r1} / {r2}");
    for r in [&r1, &r2] {
        assert_eq!(n(r, "errors"), 0, "{r}");
        assert_eq!(n(r, "released"), 0, "{r}");
        assert_eq!(n(r, "renewed") + n(r, "raced"), 2, "{r}");
        assert_eq!(n(r, "skipped"), 0, "ka/lapsed left the index in the first run: {r}");
        assert_eq!(r["complete"], true);
    }
    for before in [&before_running, &before_no_arn] {
        let after = lab.item(&before.key).await.unwrap();
        assert_eq!(after.fence, before.fence);
        assert_eq!(after.lease_id, before.lease_id);
        assert!(after.released_at_ms.is_none());
        assert!(after.expires_at_ms > before.expires_at_ms, "{} renewed again", before.key);
    }
    let heartbeat_instances =
        lab.emu.server.log_text().matches("spawning function instance function=\"heartbeat\"").count();
    println!("heartbeat instances started by the emulator: {heartbeat_instances}");
    // Keep these two alive through the slower steps below (heartbeat with a longer duration).
    for l in [&l_running, &l_no_arn] {
        lab.coord.heartbeat(&l.key, &l.lease_id, Some(Duration::from_secs(120))).await.expect("heartbeat");
    }

    // Paging: more keep-alive leases than one page (50), many of them in one shard, plus a
    // few bound to the running execution.
    let mut keys = Vec::new();
    let mut i = 0;
    while keys.iter().filter(|k: &&String| keepalive_shard(k, KEEPALIVE_SHARDS) == 0).count() < 120 {
        let k = format!("ka/page/{i}");
        if keepalive_shard(&k, KEEPALIVE_SHARDS) == 0 || i % 25 == 0 {
            keys.push(k);
        }
        i += 1;
    }
    let until = now_ms() + 600_000;
    let mut originals = Vec::new();
    for (j, k) in keys.iter().enumerate() {
        let arn = if j % 20 == 0 { Some(running.as_str()) } else { None };
        originals.push(lab.take(k, "pager", 120_000, keepalive(until, arn)).await);
    }
    let shards: BTreeSet<u32> = keys.iter().map(|k| keepalive_shard(k, KEEPALIVE_SHARDS)).collect();
    assert!(shards.len() > 1, "leases across shards");
    let live = keys.len() as u64 + 2; // plus ka/running and ka/no-arn

    // A run bounded by LEASEHOLD_SWEEP_MAX_ITEMS handles at most that many live leases and
    // says so (no stale entry is left in the index to read).
    let report = sweep(&bounded).await;
    println!("bounded sweep: {report}");
    assert_eq!(n(&report, "scanned"), 60, "{report}");
    assert_eq!(report["complete"], false, "{report}");
    assert_eq!(n(&report, "errors"), 0, "{report}");
    assert_eq!(n(&report, "renewed") + n(&report, "skipped"), 60, "{report}");

    // Three seconds after the bounded run: a lease it renewed and the full run did not
    // expires three seconds and more before one the full run renewed (below).
    tokio::time::sleep(Duration::from_millis(3000)).await;
    let started = now_ms();
    let report = sweep(&lab).await;
    println!("full sweep over {live} keep-alive leases: {report}");
    assert_eq!(n(&report, "scanned"), live, "ka/lapsed is no longer in the index: {report}");
    assert_eq!(report["complete"], true, "{report}");
    assert_eq!(n(&report, "renewed"), live, "{report}");
    assert_eq!(n(&report, "skipped"), 0, "{report}");
    assert_eq!(n(&report, "errors"), 0, "{report}");
    for l in &originals {
        let r = lab.item(&l.key).await.unwrap();
        assert_eq!(r.fence, l.fence);
        // Renewed at the function's corrected clock, which may run behind this one by up to a
        // `Date`'s second and its allowance on DynamoDB Local (DESIGN.md, "Clocks"); unrenewed,
        // the lease would expire a minute and more earlier.
        assert!(r.expires_at_ms.unwrap() >= started + 120_000 - 2_000, "{} renewed by the full run", l.key);
    }
    // At --concurrency 2 the emulator may start two instances per function: no count, but
    // no crash either.
    lab.assert_no_crash();
    bounded.assert_no_respawn();
}

/// Runs `f` on every item, `width` at a time, in order.
async fn each<T, F, Fut, R>(items: Vec<T>, width: usize, f: F) -> Vec<R>
where
    F: Fn(T) -> Fut,
    Fut: std::future::Future<Output = R>,
{
    let mut out = Vec::with_capacity(items.len());
    let mut items = items.into_iter().peekable();
    while items.peek().is_some() {
        out.extend(join_all(items.by_ref().take(width).map(&f).collect()).await);
    }
    out
}

/// Polls every future until all are done; their outputs in order.
async fn join_all<Fut: std::future::Future>(futs: Vec<Fut>) -> Vec<Fut::Output> {
    use std::task::Poll;
    let mut futs: Vec<std::pin::Pin<Box<Fut>>> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<Fut::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in futs.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => *o = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    out.into_iter().map(|o| o.expect("done")).collect()
}

/// 1,000 keep-alive leases, each bound to its own execution, with Step Functions'
/// DescribeExecution and ListExecutions throttled at their documented quotas (300 and 15 per
/// second, 200 and 5 per second: the tests' adapter in front of moto): one scheduled run of
/// the real heartbeat function renews every lease of a running execution and releases every
/// lease of a stopped one, without one throttled call, because it lists the state machine's
/// running executions once and describes only what the list does not show. The same leases
/// judged by DescribeExecution alone (the sweep before the lists, with the function's client's
/// adaptive retries) run into the quota: leases of ended executions are renewed instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalive_sweep_of_1000_executions_within_step_functions_quotas() {
    use leasehold_tests::sfn_throttle::{SfnThrottle, DOCUMENTED};
    let moto = tokio::task::spawn_blocking(|| Moto::start(free_port(), free_port())).await.unwrap();
    let throttle = SfnThrottle::start(format!("127.0.0.1:{}", moto.port).parse().unwrap(), &DOCUMENTED).await;
    let sfn = Sfn::new(&moto).await;
    let env = [
        ("AWS_ENDPOINT_URL_SFN", throttle.endpoint()),
        ("LEASEHOLD_ASSUMED_TIMEOUT_MS", "60000".to_string()),
        // Room for all of them in one run (a run that spends its whole budget says incomplete).
        ("LEASEHOLD_SWEEP_MAX_ITEMS", "1100".to_string()),
    ];
    let lab = Lab::start(&env, &[]).await;
    const N: usize = 1000;
    let arns = each((0..N).collect(), 16, |i| {
        let sfn = &sfn;
        async move { sfn.start(&format!("ka-{i}")).await }
    })
    .await;
    let until = now_ms() + 600_000;
    // Set-up on a loaded machine: an acquire that timed out is sent again with its lease_id.
    let leases = each(arns.iter().enumerate().collect(), 8, |(i, arn)| {
        let (lab, key) = (&lab, format!("ka/many/{i}"));
        let opts = AcquireOptions { lease_id: Some(LeaseId::generate()), ..keepalive(until, Some(arn)) };
        async move {
            loop {
                match lab.coord.acquire(&key, "etl", Some(Duration::from_secs(120)), opts.clone()).await {
                    Ok(l) => break l,
                    Err(e) if e.is_transient() => tokio::time::sleep(Duration::from_millis(200)).await,
                    Err(e) => panic!("set-up acquire of {key}: {e}"),
                }
            }
        }
    })
    .await;
    // Every 40th execution stops (25 of them): their leases must be released.
    let stopped: Vec<usize> = (0..N).step_by(40).collect();
    for &i in &stopped {
        sfn.client.stop_execution().execution_arn(&arns[i]).send().await.expect("StopExecution");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    let report = sweep(&lab).await;
    println!("sweep over {N} keep-alive executions: {report}; Step Functions calls: {:?}", throttle.all_calls());
    assert_eq!(n(&report, "errors"), 0, "{report}");
    assert_eq!(n(&report, "describe_failures"), 0, "{report}");
    assert_eq!(report["complete"], true, "{report}");
    assert_eq!(n(&report, "released") as usize, stopped.len(), "{report}");
    assert_eq!(n(&report, "renewed") as usize, N - stopped.len(), "{report}");
    let (listed, list_throttled) = throttle.calls("ListExecutions");
    let (described, describe_throttled) = throttle.calls("DescribeExecution");
    assert_eq!((list_throttled, describe_throttled), (0, 0), "{:?}", throttle.all_calls());
    assert!((1..=2).contains(&listed), "one list of 1,000 (and at most one more page): {listed}");
    let most = leasehold::lambda::executions::DESCRIBE_BEFORE_LISTING as u64 + stopped.len() as u64;
    assert!(described <= most, "described {described}, at most {most}");
    for (i, l) in leases.iter().enumerate() {
        let s = lab.state(&l.key).await;
        assert_eq!(s.held, !stopped.contains(&i), "{}", l.key);
        assert_eq!(s.fence, l.fence);
    }

    // DescribeExecution alone (the sweep before the lists) asks once per lease: 1,000 calls a
    // run against a quota of 300 at once and 15 per second (1,200 a minute at best, 850 outside
    // the largest Regions, shared with every other caller in the account). Fired as the sweep
    // fires them (16 at a time, no retries), the adapter passes no more than the quota allows.
    throttle.reset();
    let base = leasehold_tests::sfn_quotas::sfn_client(&throttle.endpoint(), "us-east-1").await;
    let once = base.config().to_builder().retry_config(aws_smithy_types::retry::RetryConfig::disabled()).build();
    let describe_only = leasehold::lambda::StepFunctions(aws_sdk_sfn::Client::from_conf(once));
    let started = std::time::Instant::now();
    let states = each(arns.clone(), 16, |arn| {
        let d = &describe_only;
        async move { leasehold::Executions::state(d, &arn).await }
    })
    .await;
    let elapsed = started.elapsed().as_secs_f64();
    let (passed, throttled) = throttle.calls("DescribeExecution");
    let unknown = states.iter().filter(|s| **s == leasehold::ExecutionState::Unknown).count() as u64;
    println!("DescribeExecution alone: {passed} passed, {throttled} throttled ({unknown} unjudged) in {elapsed:.1} s");
    assert_eq!(passed + throttled, N as u64, "one call per lease");
    assert!(passed as f64 <= 300.0 + 15.0 * elapsed + 1.0, "{passed} passed in {elapsed:.1} s");
    assert_eq!(unknown, throttled, "a throttled call leaves its lease unjudged");
}

/// The EMF metric lines of a lab's functions so far.
fn metric_lines(lab: &Lab) -> Vec<Value> {
    lab.emu
        .server
        .log_text()
        .lines()
        .filter(|l| l.contains("\"_aws\""))
        .filter_map(|l| l.find('{').and_then(|i| serde_json::from_str(&l[i..]).ok()))
        .collect()
}

/// A queue sweep that fails (here: a table made before the `queue` index, as during an
/// upgrade's backfill) is counted in the scheduled run's metric line (`QueueSweepErrors`, the
/// QueueSweepFailing alarm), not only logged; the keep-alive sweep still runs; a run on a full
/// table counts none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_queue_sweep_is_counted() {
    use leasehold::store::table::{create_as, TableSpec, LEASE_TABLE};
    let local = tokio::task::spawn_blocking(leasehold_tests::dynamo_local).await.unwrap();
    let name = format!("no-queue-{}", std::process::id());
    let without_queue: Vec<_> = LEASE_TABLE.indexes.iter().filter(|i| i.name != "queue").cloned().collect();
    let spec = TableSpec {
        indexes: Box::leak(without_queue.into_boxed_slice()),
        stream: "",
        deletion_protection: false,
        point_in_time_recovery: false,
        ..LEASE_TABLE
    };
    let client = local.client().await;
    create_as(&client, &name, &spec, Duration::from_secs(120)).await.expect("create table");
    let store = leasehold::store::DynamoStore::new(client, name);
    let env = [("LEASEHOLD_ASSUMED_TIMEOUT_MS", "30000".to_string())];
    let lab = Lab::start_on(store, &env, &[]).await;
    let report = sweep(&lab).await;
    assert_eq!(n(&report, "errors"), 0, "the keep-alive sweep is fine: {report}");
    let count = |lab: &Lab| {
        let lines = metric_lines(lab);
        let sweeps: Vec<&Value> =
            lines.iter().filter(|m| m["Function"] == "heartbeat" && m["Outcome"] == "sweep").collect();
        assert_eq!(sweeps.len(), 1, "{lines:#?}");
        sweeps[0]["QueueSweepErrors"].as_u64()
    };
    // One per queue shard whose Query failed.
    assert!(count(&lab).is_some_and(|n| n >= 1), "{:?}", count(&lab));
    let full = Lab::start(&env, &[]).await;
    sweep(&full).await;
    assert_eq!(count(&full), Some(0));
}

// ------------------------------------------------------------------------------------------
// API Gateway's own routing, from template.yaml
// ------------------------------------------------------------------------------------------

/// Sends a client's request through the emulated API Gateway of template.yaml to the real
/// function it routes to; `None` when API Gateway would answer 404 itself.
async fn through_api_gateway(
    lab: &Lab,
    routes: &[apigw::Route],
    method: &str,
    target: &str,
    body: Option<&str>,
) -> Option<HttpAnswer> {
    let (function, ev) = apigw::request(routes, method, target, body, now_ms())?;
    Some(http_answer(&lab.invoke(&function, &ev).await).unwrap_or_else(|e| panic!("{method} {target}: {e}")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_api_routes_from_the_template_carry_every_key() {
    let lab = Lab::start(&[], &[]).await;
    let routes = tokio::task::spawn_blocking(|| apigw::routes(&apigw::raw_template())).await.unwrap();
    assert_eq!(routes.len(), 7, "{routes:?}");
    let corpus: Vec<String> = vec![
        "orders/42".into(),
        "jobs/nightly".into(),
        "tenants/acme/jobs/nightly run".into(),
        "100%".into(),
        "a%41".into(),
        "a%2Fb".into(),
        "x+y=z&w;v,u:t@s!$'()*".into(),
        "café/ключ/🔒".into(),
        "...".into(),
        "acquire/x".into(),
        "k".repeat(1024),
        format!("{}/{}", "é".repeat(300), "k".repeat(423)),
    ];
    for (i, key) in corpus.iter().enumerate() {
        assert!(key.len() <= 1024);
        // Clients send the key's '/' as is or as %2F: API Gateway decodes both alike.
        let enc = apigw::encode(key, i % 2 == 1);
        let short = &key[..key.char_indices().nth(24).map_or(key.len(), |(i, _)| i)];
        let body = json!({"holder": "gw", "duration_ms": 30_000}).to_string();
        let a = through_api_gateway(&lab, &routes, "POST", &format!("/leases/acquire/{enc}"), Some(&body))
            .await
            .unwrap_or_else(|| panic!("{short:?}: API Gateway finds no acquire route"));
        assert_eq!(a.status, 200, "{short:?}: {:?}", a.body);
        assert_eq!(a.body["key"], key.as_str(), "the key arrives as the client meant it");
        let fence = a.body["fence"].as_u64().unwrap();
        let id = a.body["lease_id"].as_str().unwrap().to_string();
        // The same lease in the table the library and direct invoke use.
        let state = lab.state(key).await;
        assert!(state.held && state.fence == fence && state.holder == "gw", "{short:?}: {state:?}");

        let g = through_api_gateway(&lab, &routes, "GET", &format!("/leases/{enc}"), None).await.expect("GET route");
        assert_eq!((g.status, g.body["key"].as_str(), g.body["held"].as_bool()), (200, Some(key.as_str()), Some(true)));
        let lease = json!({"lease_id": id}).to_string();
        let h = through_api_gateway(&lab, &routes, "POST", &format!("/leases/heartbeat/{enc}"), Some(&lease))
            .await
            .expect("heartbeat route");
        assert_eq!((h.status, h.body["fence"].as_u64()), (200, Some(fence)), "{short:?}: {:?}", h.body);
        let r = through_api_gateway(&lab, &routes, "POST", &format!("/leases/release/{enc}"), Some(&lease))
            .await
            .expect("release route");
        assert_eq!(r.status, 200, "{short:?}: {:?}", r.body);

        // Direct invoke names the same lease: the next fence on the same key.
        let d = lab.invoke("acquire", &json!({"key": key, "holder": "direct", "duration_ms": 30_000})).await;
        assert!(d.error_type.is_none(), "{short:?}: {}", d.body);
        assert!(d.body["fence"].as_u64().unwrap() > fence, "{short:?}: the same key over invoke and HTTP");
        let id = d.body["lease_id"].as_str().unwrap();
        assert!(lab.invoke("release", &json!({"key": key, "lease_id": id})).await.error_type.is_none());
    }

    // Work items through the same routes: put, next (a batch), count, release into a state.
    let put = json!({"state": "GW_PENDING", "holder": "gw"}).to_string();
    let p = through_api_gateway(&lab, &routes, "POST", "/leases/put/tenants%2Facme/job%201", Some(&put)).await;
    let p = p.expect("put route");
    assert_eq!(
        (p.status, p.body["key"].as_str(), p.body["state"].as_str()),
        (200, Some("tenants/acme/job 1"), Some("GW_PENDING"))
    );
    let next = json!({"holder": "gw", "limit": 5, "duration_ms": 30_000}).to_string();
    let n =
        through_api_gateway(&lab, &routes, "POST", "/leases/next/GW_PENDING", Some(&next)).await.expect("next route");
    assert_eq!(n.status, 200, "{:?}", n.body);
    let leases = n.body["leases"].as_array().expect("leases").clone();
    assert_eq!(leases.len(), 1, "{:?}", n.body);
    assert_eq!((leases[0]["key"].as_str(), leases[0]["attempts"].as_u64()), (Some("tenants/acme/job 1"), Some(1)));
    let c = through_api_gateway(&lab, &routes, "POST", "/leases/count/GW_PENDING", None).await.expect("count route");
    assert_eq!((c.status, c.body["count"].as_u64()), (200, Some(1)), "{:?}", c.body);
    let done = json!({"lease_id": leases[0]["lease_id"], "state": "GW_DONE"}).to_string();
    let r = through_api_gateway(&lab, &routes, "POST", "/leases/release/tenants/acme/job%201", Some(&done))
        .await
        .expect("release route");
    assert_eq!((r.status, r.body["state"].as_str()), (200, Some("GW_DONE")), "{:?}", r.body);
    let bad =
        through_api_gateway(&lab, &routes, "POST", "/leases/next/GW_PENDING", Some(r#"{"holder": "gw", "limit": 0}"#))
            .await
            .expect("next route");
    assert_eq!((bad.status, bad.body["error"].as_str()), (400, Some("InvalidRequest")));

    // Keys that would not travel through API Gateway unchanged are refused on every other
    // interface, so nobody can hold a lease that HTTP callers cannot name.
    let before = lab.snapshot().await;
    for key in ["a//b", "/lead", "trail/", "a/./b", "a/../b", ".", "..", "a?b=1", "a#frag"] {
        let d = lab.invoke("acquire", &json!({"key": key, "holder": "direct"})).await;
        assert_eq!(d.error_type.as_deref(), Some("InvalidRequest"), "direct invoke of {key:?}: {}", d.body);
        let e = lab.coord.acquire(key, "lib", Some(Duration::from_secs(30)), AcquireOptions::default()).await;
        assert_eq!(e.map_err(|e| e.name()).err(), Some("InvalidRequest"), "library acquire of {key:?}");
    }
    assert_eq!(lab.snapshot().await, before, "refused keys changed the table");
    lab.assert_no_respawn();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_acquire_answers_before_api_gateway_gives_up() {
    // MaxWaitMs raised to its maximum does not matter: API Gateway stops waiting 30 s after
    // the request arrived, so the wait ends 1.5 s before that.
    let lab = Lab::start(&[("LEASEHOLD_MAX_WAIT_MS", "58000".to_string())], &[]).await;
    let routes = tokio::task::spawn_blocking(|| apigw::routes(&apigw::raw_template())).await.unwrap();
    let key = "gw/deadline";
    let other = lab.take(key, "other-worker", 60_000, Default::default()).await;
    let invoke = invoke_time(&lab, key).await;
    let body = r#"{"holder":"w","wait_ms":58000}"#;
    let ask = |arrived_ms_ago: u64| {
        let (function, mut ev) =
            apigw::request(&routes, "POST", "/leases/acquire/gw/deadline", Some(body), now_ms()).unwrap();
        ev["requestContext"]["timeEpoch"] = json!(now_ms() - arrived_ms_ago);
        let lab = &lab;
        async move {
            let t = Instant::now();
            let a = http_answer(&lab.invoke(&function, &ev).await).unwrap();
            (a, t.elapsed())
        }
    };
    // Arrived 29.2 s ago: 0.8 s left, less than the 1.5 s kept to answer, so no wait at all
    // (the function's own deadline, 3 s in the emulator, would allow a 1.5 s wait).
    let (a, took) = ask(29_200).await;
    assert_eq!((a.status, a.body["error"].as_str()), (409, Some("LeaseHeld")), "{:?}", a.body);
    // (An invoke of this machine costs `invoke`; a loaded one's more than the 1.2 s.)
    let at_once = Duration::from_millis(1200).max(2 * invoke);
    assert!(took < at_once, "answered at once, not after the function's own cut: {took:?}, invoke {invoke:?}");
    // Arrived 28 s ago: 2 s left, so a wait of about 0.5 s.
    let (a, took) = ask(28_000).await;
    assert_eq!(a.status, 409, "{:?}", a.body);
    assert!(took >= Duration::from_millis(300), "the wait that fits is honoured: {took:?}");
    let bound = Duration::from_millis(1400).max(Duration::from_millis(500) + 2 * invoke);
    assert!(took < bound, "{took:?}, bound {bound:?}");
    // Nothing was taken behind API Gateway's back.
    let state = lab.state(key).await;
    assert!(state.held && state.holder == "other-worker" && state.fence == other.fence, "{state:?}");
    lab.assert_no_respawn();
}
