//! `leasehold table create|check` against DynamoDB Local: a fresh server, `table create`, then
//! `serve --table leases` answers every route (batches included); a table without the `state`
//! index is named by `table check` and refused by `serve` and the CLI at start.

mod cli_support;

use std::time::Duration;

use cli_support::{clean_command, dynamo_env, http, output, Server};
use leasehold_tests::{dynamo_local, set_local_credentials, DynamoLocal};
use serde_json::Value;

fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"))
}

fn table_cmd(endpoint: &str, args: &[&str]) -> cli_support::Out {
    let mut c = clean_command();
    c.args(args);
    for (k, v) in dynamo_env(endpoint) {
        c.env(k, v);
    }
    output(c)
}

#[test]
fn table_create_then_serve_answers_every_route() {
    let local = std::thread::spawn(|| DynamoLocal::start(None)).join().expect("DynamoDB Local");
    let ep = local.endpoint.clone();
    // Nothing there yet: check names the missing table.
    let c = table_cmd(&ep, &["--table", "leases", "table", "check"]).code(1);
    assert!(c.stderr.contains("table leases does not exist") && c.stderr.contains("table create"), "{c:?}");
    let out = table_cmd(&ep, &["--table", "leases", "table", "create"]).ok();
    assert!(out.stdout.contains("created table leases"), "{out:?}");
    // Idempotent, and the table it made is what the code needs.
    let again = table_cmd(&ep, &["--table", "leases", "table", "create", "--json"]).ok().json();
    assert_eq!((again["created"].as_bool(), again["ok"].as_bool()), (Some(false), Some(true)), "{again}");
    assert_eq!(again["warnings"], serde_json::json!([]), "the stream is there too");
    let chk = table_cmd(&ep, &["table", "check"]).code(2);
    assert!(chk.stderr.contains("--table NAME or LEASEHOLD_TABLE"), "{chk:?}");
    table_cmd(&ep, &["--table", "leases", "table", "check"]).ok();
    // The work-state index projects only what a batch's candidate needs (DynamoDB Local keeps
    // an INCLUDE projection as asked).
    set_local_credentials();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let d = rt.block_on(async { local.client().await.describe_table().table_name("leases").send().await.unwrap() });
    let state = d.table().unwrap().global_secondary_indexes().iter().find(|g| g.index_name() == Some("state"));
    let p = state.and_then(|g| g.projection()).expect("the state index's projection");
    assert_eq!(p.projection_type(), Some(&aws_sdk_dynamodb::types::ProjectionType::Include));
    let mut have = p.non_key_attributes().to_vec();
    let mut want: Vec<String> =
        leasehold::store::dynamo::STATE_INDEX_ATTRIBUTES.iter().map(|a| a.to_string()).collect();
    have.sort();
    want.sort();
    assert_eq!(have, want);

    let server = Server::start(&["--table".into(), "leases".into()], &dynamo_env(&ep));
    let a = &server.addr;
    let ct = [("content-type", "application/json")];
    let (s, _, b) = http(a, "GET", "/health", &[], b"");
    assert_eq!(s, 200, "{b}");
    assert_eq!(http(a, "GET", "/openapi.json", &[], b"").0, 200);
    let (s, _, b) = http(a, "POST", "/leases/acquire/jobs/a", &ct, br#"{"holder":"h1","duration_ms":30000}"#);
    assert_eq!(s, 200, "{b}");
    let id = json(&b)["lease_id"].as_str().unwrap().to_string();
    let hb = format!(r#"{{"lease_id":"{id}"}}"#);
    let (s, _, b) = http(a, "POST", "/leases/heartbeat/jobs/a", &ct, hb.as_bytes());
    assert_eq!(s, 200, "{b}");
    let (s, _, b) = http(a, "GET", "/leases/jobs/a", &[], b"");
    assert_eq!((s, json(&b)["holder"].as_str()), (200, Some("h1")), "{b}");
    let (s, _, b) = http(a, "GET", "/leases?prefix=jobs/", &[], b"");
    assert_eq!(s, 200, "{b}");
    assert_eq!(json(&b)["leases"].as_array().map(Vec::len), Some(1), "{b}");
    let (s, _, b) = http(a, "POST", "/leases/release/jobs/a", &ct, hb.as_bytes());
    assert_eq!(s, 200, "{b}");
    // Work items and a batch: put, count, next (the `state` index), release into a state.
    for k in ["orders/1", "orders/2"] {
        let (s, _, b) =
            http(a, "POST", &format!("/leases/put/{k}"), &ct, br#"{"state":"PENDING","holder":"producer"}"#);
        assert_eq!(s, 200, "{b}");
    }
    let (s, _, b) = http(a, "POST", "/leases/count/PENDING", &ct, b"{}");
    assert_eq!((s, json(&b)["count"].as_u64()), (200, Some(2)), "{b}");
    let (s, _, b) = http(a, "POST", "/leases/next/PENDING", &ct, br#"{"holder":"w","limit":5,"duration_ms":30000}"#);
    assert_eq!(s, 200, "{b}");
    let leases = json(&b)["leases"].as_array().cloned().unwrap_or_default();
    assert_eq!(leases.len(), 2, "{b}");
    let done = serde_json::json!({"lease_id": leases[0]["lease_id"], "state": "DONE"}).to_string();
    let (s, _, b) =
        http(a, "POST", &format!("/leases/release/{}", leases[0]["key"].as_str().unwrap()), &ct, done.as_bytes());
    assert_eq!((s, json(&b)["state"].as_str()), (200, Some("DONE")), "{b}");
    let (s, _, b) = http(a, "POST", "/leases/force-release/orders/2", &ct, b"{}");
    assert_eq!(s, 200, "{b}");
    let (s, _, b) = http(a, "GET", "/", &[], b"");
    assert_eq!(s, 200, "{b}");
    drop(server);
    local.stop();
}

/// A table made by hand without the `state` index: check names it and what fails; `serve` and
/// the CLI on it stop at start with that message instead of failing at the first batch.
#[test]
fn a_table_without_the_state_index_is_named() {
    let local = dynamo_local();
    set_local_credentials();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let table = format!("no-state-{}", std::process::id());
    rt.block_on(async {
        use aws_sdk_dynamodb::types::*;
        let client = local.client().await;
        let ad = |n: &str, t: ScalarAttributeType| {
            AttributeDefinition::builder().attribute_name(n).attribute_type(t).build().unwrap()
        };
        let ks = |n: &str, t: KeyType| KeySchemaElement::builder().attribute_name(n).key_type(t).build().unwrap();
        client
            .create_table()
            .table_name(&table)
            .billing_mode(BillingMode::PayPerRequest)
            .attribute_definitions(ad("key", ScalarAttributeType::S))
            .attribute_definitions(ad("ka_shard", ScalarAttributeType::N))
            .attribute_definitions(ad("ka_until_ms", ScalarAttributeType::N))
            .attribute_definitions(ad("q_shard", ScalarAttributeType::N))
            .key_schema(ks("key", KeyType::Hash))
            .global_secondary_indexes(
                GlobalSecondaryIndex::builder()
                    .index_name("keepalive")
                    .key_schema(ks("ka_shard", KeyType::Hash))
                    .key_schema(ks("ka_until_ms", KeyType::Range))
                    .projection(Projection::builder().projection_type(ProjectionType::All).build())
                    .build()
                    .unwrap(),
            )
            .global_secondary_indexes(
                GlobalSecondaryIndex::builder()
                    .index_name("queue")
                    .key_schema(ks("q_shard", KeyType::Hash))
                    .projection(Projection::builder().projection_type(ProjectionType::KeysOnly).build())
                    .build()
                    .unwrap(),
            )
            .send()
            .await
            .unwrap();
        client
            .update_time_to_live()
            .table_name(&table)
            .time_to_live_specification(
                TimeToLiveSpecification::builder().attribute_name("ttl").enabled(true).build().unwrap(),
            )
            .send()
            .await
            .unwrap();
    });
    let ep = &local.endpoint;
    let c = table_cmd(ep, &["--table", &table, "table", "check"]).code(1);
    assert!(c.stderr.contains("index `state` is missing"), "{c:?}");
    assert!(c.stderr.contains("`next`") && c.stderr.contains("`count`"), "names what fails: {c:?}");
    assert!(!c.stderr.contains("`keepalive`") && !c.stderr.contains("`queue`"), "the other indexes are there: {c:?}");
    let j = table_cmd(ep, &["--table", &table, "table", "check", "--json"]).code(1).json();
    assert_eq!(j["error"], "StoreUnavailable");
    assert_eq!(j["problems"].as_array().map(Vec::len), Some(1), "{j}");
    // The CLI and serve check once at start.
    let g = table_cmd(ep, &["--table", &table, "get", "some/key"]).code(77);
    assert!(g.stderr.contains("index `state` is missing"), "{g:?}");
    let mut c = clean_command();
    c.args(["--table", &table, "serve", "--addr", "127.0.0.1:0"]);
    for (k, v) in dynamo_env(ep) {
        c.env(k, v);
    }
    let mut p = cli_support::spawn(c);
    let s = p.wait(Duration::from_secs(60)).code(77);
    assert!(s.stderr.contains("index `state` is missing"), "{s:?}");
    // `table create` on it changes nothing and says what is wrong.
    let cr = table_cmd(ep, &["--table", &table, "table", "create"]).code(1);
    assert!(cr.stderr.contains("index `state` is missing"), "{cr:?}");
}
