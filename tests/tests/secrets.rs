//! lease_ids never reach a log line: a full run through the Lambda handler (direct invoke,
//! HTTP, the scheduled keep-alive sweep, errors) and the holder API, over DynamoDB Local,
//! with every log statement enabled, captured and searched.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold::lambda::{Function, Handler};
use leasehold::{AcquireOptions, Coordinator};
use leasehold_tests::{dynamo_local, test_config};
use serde_json::{json, Value};

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn http_event(method: &str, path: &str, body: &Value) -> Value {
    let key = path.splitn(4, '/').nth(3).unwrap_or_default();
    json!({
        "version": "2.0", "routeKey": "$default", "rawPath": path, "rawQueryString": "", "pathParameters": {"key": key},
        "headers": {"content-type": "application/json"},
        "requestContext": {"http": {"method": method, "path": path, "protocol": "HTTP/1.1", "sourceIp": "127.0.0.1", "userAgent": "test"},
                           "requestId": "r", "routeKey": "$default", "stage": "$default", "timeEpoch": 0},
        "body": body.to_string(), "isBase64Encoded": false
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_lease_id_in_any_log_line() {
    let capture = Capture::default();
    let writer = capture.clone();
    // The functions' own logging set-up, at the most verbose RUST_LOG there is: the SDK's
    // wire logging and the runtime's event logging stay capped.
    // LOG_SENSITIVE_BODIES makes the SDK log request and response bodies at trace.
    std::env::set_var("RUST_LOG", "trace");
    std::env::set_var("LOG_SENSITIVE_BODIES", "true");
    let subscriber = leasehold::env::subscriber(true, move || writer.clone());
    let _guard = tracing::subscriber::set_default(subscriber);

    let local = tokio::task::spawn_blocking(dynamo_local).await.unwrap();
    let store = Arc::new(local.store().await);
    let coord = Coordinator::new(store, test_config());
    let mut secrets = Vec::new();
    let h = |f| Handler { function: f, coord: coord.clone(), executions: None, running: None, sweep_max_items: 100 };
    let (acq, hb, rel) = (h(Function::Acquire), h(Function::Heartbeat), h(Function::Release));
    let t = Duration::from_secs(10);

    // Direct invoke: acquire (with keep-alive), held, heartbeat, forged heartbeat, release.
    let until = coord.now_ms() + 600_000;
    let lease = acq
        .handle(json!({"key": "s1", "holder": "h", "duration_ms": 5000, "keepalive": {"until_ms": until}}), t)
        .await
        .unwrap();
    let id = lease["lease_id"].as_str().unwrap().to_string();
    secrets.push(id.clone());
    assert!(acq.handle(json!({"key": "s1", "holder": "x"}), t).await.is_err());
    hb.handle(json!({"key": "s1", "lease_id": id}), t).await.unwrap();
    let forged = "f".repeat(32);
    secrets.push(forged.clone());
    assert!(hb.handle(json!({"key": "s1", "lease_id": forged}), t).await.is_err());
    // The scheduled sweep renews it, reading the lease_id from the index.
    let sweep =
        hb.handle(json!({"source": "aws.events", "detail-type": "Scheduled Event", "detail": {}}), t).await.unwrap();
    assert!(sweep["renewed"].as_u64().unwrap() >= 1, "{sweep}");
    rel.handle(json!({"key": "s1", "lease_id": id}), t).await.unwrap();

    // HTTP: acquire, heartbeat, release, bad lease_id.
    let r = acq.handle(http_event("POST", "/leases/acquire/s2", &json!({"holder": "h"})), t).await.unwrap();
    let body: Value = serde_json::from_str(r["body"].as_str().unwrap()).unwrap();
    let id2 = body["lease_id"].as_str().unwrap().to_string();
    secrets.push(id2.clone());
    hb.handle(http_event("POST", "/leases/heartbeat/s2", &json!({"lease_id": id2})), t).await.unwrap();
    rel.handle(http_event("POST", "/leases/release/s2", &json!({"lease_id": id2})), t).await.unwrap();
    rel.handle(http_event("POST", "/leases/release/s2", &json!({"lease_id": "g".repeat(40)})), t).await.unwrap();
    secrets.push("g".repeat(40));

    // Holder API: renewals in the background, drop releases.
    // 3 s, renewed every second: room for a loaded machine's late answers.
    let held = coord.hold("s3", "h", Duration::from_secs(3), AcquireOptions::default()).await.unwrap();
    secrets.push(held.lease().unwrap().lease_id.expose().to_string());
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    drop(held);
    tokio::time::sleep(Duration::from_millis(300)).await;

    tracing::trace!(target: "leasehold_tests::secrets", "capture at trace");
    let logs = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
    assert!(logs.contains("capture at trace"), "RUST_LOG=trace reached the subscriber:\n{logs}");
    assert!(logs.lines().count() > 5, "the capture must have seen the run's logs:\n{logs}");
    assert!(logs.contains("s1") && logs.contains("keep-alive"), "logs carry keys and outcomes");
    for s in &secrets {
        assert!(!logs.contains(s.as_str()), "a lease_id reached the logs");
    }
}
