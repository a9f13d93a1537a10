//! The HTTP API fuzzed from its OpenAPI document (shared/openapi.json) with schemathesis
//! against `leasehold serve` on the embedded store: no 5xx, no crash, every response
//! conforming to the document (every error a JSON body whose `error` is a stable name), and
//! 405 answers carrying `Allow`. Checks that "schema-valid data must be accepted" are left
//! out: the document cannot express every rule (a key in the body must equal the path key,
//! keepalive.until_ms must be in the future, min_hold_ms <= duration_ms), and such requests
//! rightly get 400.

mod cli_support;

use std::process::Command;

use cli_support::{http, Server, Target};
use leasehold_tests::{repo_root, tools_dir};

#[test]
fn schemathesis_finds_no_server_error() {
    let store = Target::embedded();
    // Waits are capped below schemathesis's request timeout: a generated acquire on a held key
    // with a long wait_ms would otherwise be a harness timeout, not a finding (longer waits
    // are then refused with 400, which the document allows).
    let server = Server::start(&store.args, &[("LEASEHOLD_MAX_WAIT_MS".to_string(), "3000".to_string())]);
    let st = tools_dir().join("venv/bin/schemathesis");
    assert!(st.exists(), "schemathesis is not installed: run scripts/install-test-deps.sh");
    let report = store.dir.path().join("schemathesis.xml");
    let schema = repo_root().join("shared/openapi.json");
    let out = Command::new(&st)
        // schemathesis keeps its example database in the working directory: a temporary one.
        .current_dir(store.dir.path())
        .args([
            "run",
            schema.to_str().unwrap(),
            "--url",
            &server.url,
            "--checks",
            "all",
            "--exclude-checks",
            "positive_data_acceptance,negative_data_rejection",
            "--max-examples",
            "60",
            "--seed",
            "20261122",
            "--request-timeout",
            "10",
            "--report",
            "junit",
            "--report-junit-path",
            report.to_str().unwrap(),
        ])
        .output()
        .expect("run schemathesis");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "schemathesis found failures:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    // It really exercised the API.
    let xml = std::fs::read_to_string(&report).expect("junit report");
    assert!(xml.contains("POST /leases/acquire/{key}") && xml.contains("GET /leases/{key}"), "{xml}");
    let generated: u64 = stdout
        .lines()
        .find_map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
            // "  546 generated, 546 passed" (a warning line may also say "generated").
            [n, "generated,", ..] => n.parse().ok(),
            _ => None,
        })
        .unwrap_or(0);
    assert!(generated >= 100, "too few test cases generated: {stdout}");
    // The server survived it.
    let (status, _, body) = http(&server.addr, "GET", "/health", &[], b"");
    assert_eq!(status, 200, "{body}");
}
