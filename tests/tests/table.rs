//! `leasehold table create|check` against DynamoDB Local: a fresh server, `table create`, then
//! `serve --table leases` answers every route (batches included); a table without the `state`
//! index is named by `table check` and refused by `serve` and the commands that use it; a table
//! as earlier versions' template made it serves today's commands; the check of a command is
//! made once (then kept), skipped on request, and a throttled control plane only warns.

mod cli_support;

use std::time::Duration;

use cli_support::{clean_command, dynamo_env, http, output, Server};
use leasehold_tests::{dynamo_local, set_local_credentials, DynamoLocal};
use serde_json::Value;

/// A client of `local` whose requests may take a minute: a loaded machine's DynamoDB Local can
/// take longer than the store's 3 s to create a table with indexes.
async fn patient_client(local: &DynamoLocal) -> aws_sdk_dynamodb::Client {
    set_local_credentials();
    let conf = leasehold::store::dynamo::load_sdk_config(Duration::from_secs(60)).await;
    aws_sdk_dynamodb::Client::new(&conf.into_builder().endpoint_url(&local.endpoint).build())
}

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
    assert_eq!(d.table().unwrap().deletion_protection_enabled(), Some(true), "deletion protection");

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
        let client = patient_client(local).await;
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
    // A command fails on the parts it uses only: `get` uses the key, `count` the `state` index.
    table_cmd(ep, &["--table", &table, "get", "some/key"]).code(1);
    let c = table_cmd(ep, &["--table", &table, "count", "PENDING"]).code(77);
    assert!(c.stderr.contains("index `state` is missing"), "{c:?}");
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

/// Creates `name` as CloudFormation made a template's `LeaseTable` (`props`, parameters
/// resolved): its billing, key schema, attribute definitions, indexes with their projections,
/// stream and deletion protection, then TTL. (Point-in-time recovery and encryption at rest do
/// not exist on DynamoDB Local.)
async fn create_as_the_template_did(client: &aws_sdk_dynamodb::Client, name: &str, props: &Value) {
    use aws_sdk_dynamodb::types::*;
    let ks = |k: &Value| {
        KeySchemaElement::builder()
            .attribute_name(k["AttributeName"].as_str().unwrap())
            .key_type(KeyType::from(k["KeyType"].as_str().unwrap()))
            .build()
            .unwrap()
    };
    let list = |v: &Value| v.as_array().cloned().unwrap_or_default();
    let mut req = client
        .create_table()
        .table_name(name)
        .billing_mode(BillingMode::from(props["BillingMode"].as_str().unwrap()))
        .set_key_schema(Some(list(&props["KeySchema"]).iter().map(ks).collect()));
    for d in list(&props["AttributeDefinitions"]) {
        req = req.attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name(d["AttributeName"].as_str().unwrap())
                .attribute_type(ScalarAttributeType::from(d["AttributeType"].as_str().unwrap()))
                .build()
                .unwrap(),
        );
    }
    for g in list(&props["GlobalSecondaryIndexes"]) {
        let p = &g["Projection"];
        let non_key =
            p.get("NonKeyAttributes").map(|a| list(a).iter().map(|x| x.as_str().unwrap().to_string()).collect());
        let projection = Projection::builder()
            .projection_type(ProjectionType::from(p["ProjectionType"].as_str().unwrap()))
            .set_non_key_attributes(non_key)
            .build();
        req = req.global_secondary_indexes(
            GlobalSecondaryIndex::builder()
                .index_name(g["IndexName"].as_str().unwrap())
                .set_key_schema(Some(list(&g["KeySchema"]).iter().map(ks).collect()))
                .projection(projection)
                .build()
                .unwrap(),
        );
    }
    if let Some(view) = props["StreamSpecification"]["StreamViewType"].as_str() {
        req = req.stream_specification(
            StreamSpecification::builder()
                .stream_enabled(true)
                .stream_view_type(StreamViewType::from(view))
                .build()
                .unwrap(),
        );
    }
    if let Some(p) = props["DeletionProtectionEnabled"].as_bool() {
        req = req.deletion_protection_enabled(p);
    }
    req.send().await.unwrap();
    let ttl = &props["TimeToLiveSpecification"];
    if ttl["Enabled"] == serde_json::json!(true) {
        client
            .update_time_to_live()
            .table_name(name)
            .time_to_live_specification(
                TimeToLiveSpecification::builder()
                    .attribute_name(ttl["AttributeName"].as_str().unwrap())
                    .enabled(true)
                    .build()
                    .unwrap(),
            )
            .send()
            .await
            .unwrap();
    }
}

/// A table made by the template of cf5d284 (v0.2.0: `state` projecting ALL, no `queue` index,
/// no stream), and today's CLI on it: lease commands, `run`, work items and `serve` work; only
/// `table check` names what is missing. The check of a command costs one DescribeTable and one
/// DescribeTimeToLive, then none for an hour (kept on disk, whatever the table lacks that the
/// command does not use); `--skip-table-check` makes none; a throttled control plane is a
/// warning, and the command runs.
#[test]
fn todays_cli_runs_on_a_table_an_earlier_version_made() {
    use leasehold_tests::cfn;
    use leasehold_tests::proxy::{Proxy, ProxyFault};
    let local = dynamo_local();
    set_local_credentials();
    let dir = leasehold_tests::TempDir::new("old-table");
    let old = cfn::template_json(&["raw", cfn::template_at(cfn::BEFORE_TAGS, dir.path()).to_str().unwrap()]);
    let props = cfn::Resolver::new(&old, &[]).resolve(&old["Resources"]["LeaseTable"]["Properties"]);
    let table = format!("made-by-{}-{}", cfn::BEFORE_TAGS, std::process::id());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async { create_as_the_template_did(&patient_client(local).await, &table, &props).await });
    let proxy = rt.block_on(Proxy::start(format!("127.0.0.1:{}", local.port).parse().unwrap()));
    let ep = proxy.endpoint();
    let described = || proxy.counts().get("DescribeTable").copied().unwrap_or(0);
    let cache = dir.path().join("cache");
    let cli = |args: &[&str]| {
        let mut c = clean_command();
        c.args(["--table", &table]).args(args).env("LEASEHOLD_CACHE_DIR", &cache);
        for (k, v) in dynamo_env(&ep) {
            c.env(k, v);
        }
        output(c)
    };

    let a = cli(&["acquire", "old/k", "--duration", "30s", "--json"]).ok().json();
    assert_eq!((described(), proxy.counts().get("DescribeTimeToLive").copied()), (1, Some(1)), "one check");
    let id = a["lease_id"].as_str().unwrap();
    cli(&["heartbeat", "old/k", "--lease-id", id]).ok();
    assert_eq!(cli(&["get", "old/k", "--json"]).ok().json()["holder"], "tester");
    cli(&["release", "old/k", "--lease-id", id]).ok();
    cli(&["run", "old/r", "--duration", "10s", "--", "true"]).ok();
    assert_eq!(cli(&["list", "--json"]).ok().json()["leases"].as_array().map(Vec::len), Some(0));
    // Work items through the `state` index projecting ALL.
    for k in ["orders/1", "orders/2"] {
        cli(&["put", k, "--state", "PENDING"]).ok();
    }
    assert_eq!(cli(&["count", "PENDING", "--json"]).ok().json()["count"], 2);
    let n = cli(&["next", "PENDING", "--limit", "5", "--json"]).ok().json();
    let leases = n["leases"].as_array().cloned().unwrap_or_default();
    assert_eq!(leases.len(), 2, "{n}");
    for l in &leases {
        cli(&["release", l["key"].as_str().unwrap(), "--lease-id", l["lease_id"].as_str().unwrap(), "--state", "DONE"])
            .ok();
    }
    assert_eq!(described(), 1, "checked once, then kept: {:?}", proxy.counts());

    // `table check` names what this version adds, and its answer is kept too: a command that
    // does not use the `queue` index still makes no request for it.
    let c = cli(&["table", "check"]).code(1);
    assert!(c.stderr.contains("index `queue` is missing"), "{c:?}");
    assert!(!c.stderr.contains("`state`") && !c.stderr.contains("`keepalive`"), "{c:?}");
    assert_eq!(described(), 2);
    cli(&["get", "old/k"]).ok();
    assert_eq!(described(), 2, "{:?}", proxy.counts());
    let server = Server::start(&["--table".into(), table.clone()], &{
        let mut env = dynamo_env(&ep);
        env.push(("LEASEHOLD_CACHE_DIR".into(), cache.display().to_string()));
        env
    });
    let (s, _, b) = http(&server.addr, "POST", "/leases/count/DONE", &[("content-type", "application/json")], b"{}");
    assert_eq!((s, json(&b)["count"].as_u64()), (200, Some(2)), "{b}");
    drop(server);
    assert_eq!(described(), 2, "serve used the kept answer too");

    // No check at all on request; a throttled control plane warns and the command runs.
    let fresh = dir.path().join("fresh");
    let run = |args: &[&str]| {
        let mut c = clean_command();
        c.args(["--table", &table]).args(args).env("LEASEHOLD_CACHE_DIR", &fresh);
        for (k, v) in dynamo_env(&ep) {
            c.env(k, v);
        }
        output(c)
    };
    run(&["--skip-table-check", "get", "old/k"]).ok();
    assert_eq!(described(), 2);
    proxy.random_faults_on("DescribeTable", 1000, &[ProxyFault::ControlPlaneThrottle], 7);
    let t = run(&["acquire", "old/throttled", "--duration", "10s"]).ok();
    assert!(t.stderr.contains("warning") && t.stderr.contains("throttled"), "{t:?}");
    assert_eq!(described(), 3);
    // Not kept: the next command checks again.
    proxy.clear_faults();
    run(&["get", "old/throttled"]).ok();
    assert_eq!(described(), 4);
}
