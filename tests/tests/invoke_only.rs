//! Fields a direct invoke may send but an HTTP caller may not (DESIGN.md, "Interfaces over
//! the protocol"): `task_token` (the function would complete a Step Functions task with its
//! own permission) and `keepalive.execution_arn`. `leasehold serve` refuses them as API
//! Gateway's route does (tests/tests/workflows.rs checks the Lambda function).

mod cli_support;

use cli_support::{http, Server, Target};
use serde_json::{json, Value};

#[test]
fn serve_refuses_invoke_only_fields() {
    let store = Target::embedded();
    let server = Server::start(&store.args, &[]);
    let arn = "arn:aws:states:us-east-1:123456789012:execution:other:run-1";
    let until =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64 + 600_000;
    let cases = [
        (
            "/leases/acquire/jobs/a",
            json!({"holder": "h", "duration_ms": 60000, "task_token": "AAAAtoken"}),
            "task_token",
        ),
        (
            "/leases/acquire/jobs/a",
            json!({"holder": "h", "duration_ms": 60000, "keepalive": {"until_ms": until, "execution_arn": arn}}),
            "keepalive.execution_arn",
        ),
        (
            "/leases/next/PENDING",
            json!({"holder": "h", "duration_ms": 60000, "keepalive": {"until_ms": until, "execution_arn": arn}}),
            "keepalive.execution_arn",
        ),
    ];
    for (path, body, field) in &cases {
        let (status, _, answer) =
            http(&server.addr, "POST", path, &[("content-type", "application/json")], body.to_string().as_bytes());
        let answer: Value = serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{e}: {answer}"));
        assert_eq!(status, 400, "{path} {body}: {answer}");
        assert_eq!(answer["error"], "InvalidRequest", "{answer}");
        assert!(answer["message"].as_str().unwrap().contains(field), "names {field}: {answer}");
    }
    // Nothing was taken: the key is still free to a plain acquire, and a keep-alive without an
    // execution is still accepted over HTTP.
    let body = json!({"holder": "h", "duration_ms": 180000, "keepalive": {"until_ms": until}});
    let (status, _, answer) = http(
        &server.addr,
        "POST",
        "/leases/acquire/jobs/a",
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{answer}");
}
