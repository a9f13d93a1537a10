//! Lease history (DESIGN.md, "Lease history"): a scripted run (acquire, heartbeat, release into a
//! state, a crash taken over after expiry, a force-release, a queue hand-over) and a semaphore's
//! (each holder's grant, renewal, release and eviction, a crashed holder taken over), then
//! `leasehold history KEY` lists exactly those events with their fences, on the embedded store
//! (written in the same transaction as each change), through `serve` and through DynamoDB
//! Streams.

mod cli_support;

use std::sync::Arc;
use std::time::Duration;

use cli_support::{http, Server, Target};
use leasehold::queue::{Deliver, Enqueued};
use leasehold::{AcquireOptions, Coordinator};
use leasehold_tests::{test_config, DeliveredLeases};
use serde_json::Value;

/// One expected event: kind, holder, fence, state, previous (holder, fence).
type Expected = (String, String, u64, Option<String>, Option<(String, u64)>);

fn ev(kind: &str, holder: &str, fence: u64) -> Expected {
    (kind.into(), holder.into(), fence, None, None)
}

/// The scripted run on `key`; returns the events it must leave, in order.
async fn scripted_run(c: &Coordinator, rec: &DeliveredLeases, key: &str) -> Vec<Expected> {
    let long = Some(Duration::from_secs(60));
    let opts = AcquireOptions::default;
    let mut want = Vec::new();
    // Acquire, heartbeat, release into a state.
    let a = c.acquire(key, "w1", long, opts()).await.unwrap();
    want.push(ev("granted", "w1", a.fence));
    // A renewal is ordered after the grant by its clock (`renewed_at_ms < :now`): one in the
    // grant's own millisecond is refused and renews nothing, so it comes a little later.
    tokio::time::sleep(Duration::from_millis(3)).await;
    c.heartbeat(key, &a.lease_id, Some(Duration::from_secs(90))).await.unwrap();
    want.push(ev("renewed", "w1", a.fence));
    let r = c.release_to(key, &a.lease_id, Some("DONE")).await.unwrap();
    assert_eq!(r.state.as_deref(), Some("DONE"));
    want.push(("released".into(), "w1".into(), a.fence, Some("DONE".into()), None));
    // A holder that crashes: its lease expires unreleased and w2 takes the key over.
    let crash = c.acquire(key, "crasher", Some(Duration::from_millis(1000)), opts()).await.unwrap();
    want.push(("granted".into(), "crasher".into(), crash.fence, Some("DONE".into()), None));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let w2 = c.acquire(key, "w2", long, opts()).await.unwrap();
    want.push(("taken_over".into(), "w2".into(), w2.fence, Some("DONE".into()), Some(("crasher".into(), crash.fence))));
    // An operator's force-release: the evicted lease's holder and fence.
    c.force_release(key).await.unwrap();
    want.push(ev("force_released", "w2", w2.fence));
    // A queue hand-over: q1 holds, q2 waits, q1's release hands the key to q2 in its own write.
    let (d, o) = (Duration::from_secs(60), AcquireOptions::default());
    let Enqueued::Granted(q1) = c.acquire_or_enqueue(key, "q1", d, o.clone(), "token-1", None).await.unwrap() else {
        panic!("a free key is granted")
    };
    want.push(("granted".into(), "q1".into(), q1.fence, Some("DONE".into()), None));
    let q = c.acquire_or_enqueue(key, "q2", d, o, "token-2", None).await.unwrap();
    assert!(matches!(q, Enqueued::Queued { .. }), "{q:?}");
    c.release(key, &q1.lease_id).await.unwrap();
    let q2 = rec.leases().last().cloned().expect("q2 was delivered its lease");
    assert_eq!(q2.holder, "q2");
    want.push(ev("released", "q1", q1.fence));
    want.push(("handed_over".into(), "q2".into(), q2.fence, Some("DONE".into()), None));
    want
}

/// A semaphore's scripted run on `key` (2 slots): each holder's grant, renewal, release and
/// eviction, and a holder that crashes, taken over by the take that cleans it away; returns the
/// events it must leave, in order.
async fn semaphore_run(c: &Coordinator, key: &str) -> Vec<Expected> {
    let long = Some(Duration::from_secs(60));
    let slots = || AcquireOptions { slots: Some(2), ..Default::default() };
    let mut want = Vec::new();
    let a = c.acquire(key, "s1", long, slots()).await.unwrap();
    want.push(ev("granted", "s1", a.fence));
    let crash = c.acquire(key, "crasher", Some(Duration::from_millis(1000)), slots()).await.unwrap();
    want.push(ev("granted", "crasher", crash.fence));
    // A renewal is ordered after the grant by its clock (`renewed_at_ms < :now`): one in the
    // grant's own millisecond is refused and renews nothing, so it comes a little later.
    tokio::time::sleep(Duration::from_millis(3)).await;
    c.heartbeat(key, &a.lease_id, Some(Duration::from_secs(90))).await.unwrap();
    want.push(ev("renewed", "s1", a.fence));
    // Full only by the crasher, expired unreleased: the next take cleans it away, taking over.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let b = c.acquire(key, "s2", long, slots()).await.unwrap();
    want.push(("taken_over".into(), "s2".into(), b.fence, None, Some(("crasher".into(), crash.fence))));
    c.release(key, &a.lease_id).await.unwrap();
    want.push(ev("released", "s1", a.fence));
    c.force_release_slot(key, b.fence).await.unwrap();
    want.push(ev("force_released", "s2", b.fence));
    want
}

/// The events of an answer, as [`Expected`] tuples.
fn got(v: &Value) -> Vec<Expected> {
    v["events"]
        .as_array()
        .unwrap_or_else(|| panic!("no events in {v}"))
        .iter()
        .map(|e| {
            let prev = e["previous_holder"].as_str().map(|h| (h.to_string(), e["previous_fence"].as_u64().unwrap()));
            (
                e["kind"].as_str().unwrap().to_string(),
                e["holder"].as_str().unwrap().to_string(),
                e["fence"].as_u64().unwrap(),
                e["state"].as_str().map(str::to_string),
                prev,
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scripted_run_on_the_embedded_store() {
    let target = Target::embedded();
    let db = std::path::PathBuf::from(&target.args[1]);
    let store = leasehold::store::SqliteStore::open(&db).unwrap();
    let rec = Arc::new(DeliveredLeases::default());
    let c = Coordinator::new(Arc::new(store), test_config()).with_deliver(rec.clone() as Arc<dyn Deliver>);
    let key = "orders/42";
    let want = scripted_run(&c, &rec, key).await;
    let sem = semaphore_run(&c, "pool/7").await;
    // Another key's events are not listed.
    let other = c.acquire("orders/43", "x", Some(Duration::from_secs(60)), AcquireOptions::default()).await.unwrap();
    let out = tokio::task::spawn_blocking(move || {
        let j = target.run(&["history", key, "--json"]).ok().json();
        let text = target.run(&["history", key]).ok().stdout;
        let one = target.run(&["history", "orders/43", "--json"]).ok().json();
        let none = target.run(&["history", "orders/42", "--since", "1ms", "--json"]).ok().json();
        let pool = target.run(&["history", "pool/7", "--json"]).ok().json();
        (j, text, one, none, pool, target)
    })
    .await
    .unwrap();
    let (j, text, one, none, pool, target) = out;
    assert_eq!(got(&j), want, "{j:#}");
    assert_eq!(got(&pool), sem, "{pool:#}");
    assert!(pool["events"].as_array().unwrap().iter().all(|e| e["slots"] == 2), "{pool:#}");
    let events = j["events"].as_array().unwrap();
    // Times come from the records: in order; the lease_id never appears, only its start.
    let times: Vec<u64> = events.iter().map(|e| e["at_ms"].as_u64().unwrap()).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    assert!(events.iter().all(|e| e["lease_id_prefix"].as_str().unwrap().len() == 6), "{j}");
    assert!(!j.to_string().contains(other.lease_id.expose()), "no whole lease_id in the history");
    assert_eq!(events[8]["interface"], "queue");
    assert_eq!(got(&one), vec![ev("granted", "x", other.fence)]);
    assert_eq!(none["events"], serde_json::json!([]));
    // The text lists one line per event with its fence.
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), want.len(), "{text}");
    for (line, w) in lines.iter().zip(&want) {
        assert!(line.contains(&w.0) && line.contains(&format!("fence {}", w.2)), "{line} / {w:?}");
    }
    assert!(lines[4].contains("from crasher"), "{}", lines[4]);

    // The same through `serve` (GET /leases/history/{key+}), and the CLI over --url; a write
    // made through serve names its interface.
    let server = Server::start(&target.args, &[]);
    let (s, _, b) = http(&server.addr, "GET", "/leases/history/orders/42", &[], b"");
    assert_eq!(s, 200, "{b}");
    assert_eq!(got(&serde_json::from_str(&b).unwrap()), want);
    let (s, _, b) = http(
        &server.addr,
        "POST",
        "/leases/acquire/via/http",
        &[("content-type", "application/json")],
        br#"{"holder":"web","duration_ms":30000}"#,
    );
    assert_eq!(s, 200, "{b}");
    let (s, _, b) = http(&server.addr, "GET", "/leases/history/via%2Fhttp", &[], b"");
    assert_eq!(s, 200, "{b}");
    let v: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(
        (v["events"][0]["kind"].as_str(), v["events"][0]["interface"].as_str()),
        (Some("granted"), Some("http"))
    );
    let (s, _, b) = http(&server.addr, "GET", "/leases/history?limit=3", &[], b"");
    assert_eq!(s, 200, "{b}");
    assert_eq!(serde_json::from_str::<Value>(&b).unwrap()["events"].as_array().map(Vec::len), Some(3));
    let (s, _, b) = http(&server.addr, "GET", "/leases/history/orders/42?limit=x", &[], b"");
    assert_eq!((s, serde_json::from_str::<Value>(&b).unwrap()["error"].as_str()), (400, Some("InvalidRequest")));
    let (s, _, _) = http(&server.addr, "POST", "/leases/history/orders/42", &[], b"{}");
    assert_eq!(s, 405);
    let url = Target { args: vec!["--url".into(), server.url.clone()], env: vec![], server: None, dir: target.dir };
    let over =
        tokio::task::spawn_blocking(move || url.run(&["history", "orders/42", "--json"]).ok().json()).await.unwrap();
    assert_eq!(got(&over), want);
}

/// Events are kept for the retention (default 7 days) and pruned after it.
#[tokio::test]
async fn retention_prunes_old_events() {
    let dir = leasehold_tests::TempDir::new("history-retention");
    let path = dir.path().join("leases.db");
    let store = leasehold::store::SqliteStore::open(&path).unwrap();
    let c = Coordinator::new(Arc::new(store), test_config());
    let l = c.acquire("r/1", "h", Some(Duration::from_secs(60)), AcquireOptions::default()).await.unwrap();
    let read = |p: &std::path::Path| leasehold::store::sqlite_history::read(p, "r/1", 0, 100).unwrap();
    assert_eq!(read(&path).len(), 1);
    let day = 86_400_000;
    let at = l.acquired_at_ms;
    assert_eq!(leasehold::store::sqlite_history::prune(&path, at + 6 * day).unwrap(), 0);
    assert_eq!(read(&path).len(), 1);
    assert_eq!(leasehold::store::sqlite_history::prune(&path, at + 7 * day + 1).unwrap(), 1);
    assert!(read(&path).is_empty());
}

/// DynamoDB-JSON of a stream record's attribute (what a Lambda event carries).
fn ddb_json(v: &aws_sdk_dynamodbstreams::types::AttributeValue) -> Value {
    use aws_sdk_dynamodbstreams::types::AttributeValue as A;
    use serde_json::json;
    match v {
        A::S(s) => json!({ "S": s }),
        A::N(n) => json!({ "N": n }),
        A::Bool(b) => json!({ "BOOL": b }),
        A::Null(_) => json!({ "NULL": true }),
        A::M(m) => json!({ "M": item_json(m) }),
        A::L(l) => json!({ "L": l.iter().map(ddb_json).collect::<Vec<_>>() }),
        A::Ss(s) => json!({ "SS": s }),
        A::Ns(s) => json!({ "NS": s }),
        other => panic!("the lease table has no attribute like {other:?}"),
    }
}

fn item_json(m: &std::collections::HashMap<String, aws_sdk_dynamodbstreams::types::AttributeValue>) -> Value {
    Value::Object(m.iter().map(|(k, v)| (k.clone(), ddb_json(v))).collect())
}

/// Every record of `table`'s stream so far, as the records of a Lambda DynamoDB event.
async fn stream_records(conf: &aws_config::SdkConfig, client: &aws_sdk_dynamodb::Client, table: &str) -> Vec<Value> {
    let streams = aws_sdk_dynamodbstreams::Client::new(conf);
    let d = client.describe_table().table_name(table).send().await.unwrap();
    let arn = d.table().and_then(|t| t.latest_stream_arn()).expect("the lease table has a stream").to_string();
    let desc = streams.describe_stream().stream_arn(&arn).send().await.unwrap();
    let shards = desc.stream_description().map(|s| s.shards().to_vec()).unwrap_or_default();
    assert!(!shards.is_empty(), "{desc:?}");
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for shard in shards {
        let it = streams
            .get_shard_iterator()
            .stream_arn(&arn)
            .shard_id(shard.shard_id().unwrap())
            .shard_iterator_type(aws_sdk_dynamodbstreams::types::ShardIteratorType::TrimHorizon)
            .send()
            .await
            .unwrap();
        let mut iter = it.shard_iterator().map(str::to_string);
        let mut empty = 0;
        while let Some(i) = iter.take() {
            let r = streams.get_records().shard_iterator(i).send().await.unwrap();
            if r.records().is_empty() {
                empty += 1;
                if empty >= 3 {
                    break;
                }
            }
            for rec in r.records() {
                let s = rec.dynamodb().expect("a change");
                // A shard read again (a parent and its child) must not hand a record over twice.
                if !seen.insert(s.sequence_number().unwrap_or_default().to_string()) {
                    continue;
                }
                let mut change = serde_json::json!({
                    "ApproximateCreationDateTime": s.approximate_creation_date_time().map(|t| t.secs()).unwrap_or(0),
                    "Keys": item_json(s.keys().unwrap_or(&Default::default())),
                    "SequenceNumber": s.sequence_number(),
                    "SizeBytes": s.size_bytes().unwrap_or(0),
                    "StreamViewType": s.stream_view_type().map(|v| v.as_str()),
                });
                if let Some(n) = s.new_image() {
                    change["NewImage"] = item_json(n);
                }
                if let Some(o) = s.old_image() {
                    change["OldImage"] = item_json(o);
                }
                out.push(serde_json::json!({
                    "eventID": rec.event_id(),
                    "eventName": rec.event_name().map(|n| n.as_str()),
                    "eventVersion": rec.event_version(),
                    "eventSource": "aws:dynamodb",
                    "awsRegion": "us-east-1",
                    "eventSourceARN": arn,
                    "dynamodb": change,
                }));
            }
            iter = r.next_shard_iterator().map(str::to_string);
        }
    }
    out
}

/// The same scripted run on a table made by `leasehold table create`'s definition, on DynamoDB
/// Local: its stream is read, handed to the history function in the Lambda emulator as DynamoDB
/// events (in batches, as the event source mapping would), and `leasehold history --table`
/// lists exactly the run's events from the history table.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scripted_run_through_the_stream() {
    let local = tokio::task::spawn_blocking(leasehold_tests::dynamo_local).await.unwrap();
    // Generous timeouts: creating a table with a stream on a loaded machine takes seconds.
    leasehold_tests::set_local_credentials();
    let conf = leasehold::store::dynamo::load_sdk_config(Duration::from_secs(60))
        .await
        .into_builder()
        .endpoint_url(&local.endpoint)
        .build();
    let client = aws_sdk_dynamodb::Client::new(&conf);
    let table = format!("streamed-{}", std::process::id());
    let history = format!("{table}-history");
    leasehold::store::table::create(&client, &table, Duration::from_secs(60)).await.unwrap();
    leasehold::history::dynamo::create_table(&client, &history).await.unwrap();
    let store = leasehold::store::DynamoStore::new(client.clone(), table.clone());
    let rec = Arc::new(DeliveredLeases::default());
    let c = Coordinator::new(Arc::new(store), test_config()).with_deliver(rec.clone() as Arc<dyn Deliver>);
    let key = "orders/42";
    let want = scripted_run(&c, &rec, key).await;
    let sem = semaphore_run(&c, "pool/7").await;
    c.acquire("orders/43", "x", Some(Duration::from_secs(60)), AcquireOptions::default()).await.unwrap();

    let records = stream_records(&conf, &client, &table).await;
    assert!(records.len() >= want.len(), "{records:#?}");
    // The function's requests go through a counting proxy (and a throttle injected below).
    let proxy = leasehold_tests::proxy::Proxy::start(format!("127.0.0.1:{}", local.port).parse().unwrap()).await;
    let env: Vec<(String, String)> = vec![
        ("LEASEHOLD_HISTORY_TABLE".into(), history.clone()),
        ("AWS_ENDPOINT_URL_DYNAMODB".into(), proxy.endpoint()),
        ("AWS_ACCESS_KEY_ID".into(), "test".into()),
        ("AWS_SECRET_ACCESS_KEY".into(), "test".into()),
        ("AWS_REGION".into(), "us-east-1".into()),
        ("AWS_EC2_METADATA_DISABLED".into(), "true".into()),
    ];
    let emu = tokio::task::spawn_blocking(move || leasehold_tests::emulator::Emulator::start(&env)).await.unwrap();
    let mut written = 0;
    let mut with_events = 0;
    for batch in records.chunks(4) {
        let event = serde_json::json!({ "Records": batch });
        // What the function receives is an aws_lambda_events DynamoDB event.
        let parsed: aws_lambda_events::dynamodb::Event = serde_json::from_value(event.clone()).unwrap();
        assert_eq!(parsed.records.len(), batch.len());
        let r = emu.invoke("history", &event).await;
        assert!(r.error_type.is_none(), "{:?}\n{}", r.body, emu.server.log_text());
        let n = r.body["events"].as_u64().unwrap();
        written += n;
        with_events += u64::from(n > 0);
    }
    // One BatchWriteItem per invocation with events (at most 25 of them), no PutItem.
    let counts = proxy.counts();
    assert_eq!(counts.get("BatchWriteItem").copied(), Some(with_events), "{counts:?}");
    assert_eq!(counts.get("PutItem"), None, "{counts:?}");
    // A batch delivered twice (a retry) writes nothing new; two throttled writes are sent again.
    proxy.reset_counts();
    proxy.inject(&[leasehold_tests::proxy::ProxyFault::Throttle, leasehold_tests::proxy::ProxyFault::Throttle]);
    let again = emu.invoke("history", &serde_json::json!({ "Records": records })).await;
    assert!(again.error_type.is_none(), "{:?}", again.body);
    assert_eq!(proxy.counts().get("BatchWriteItem").copied(), Some(3), "two throttled, then written");

    let mut env = cli_support::dynamo_env(&local.endpoint);
    env.push(("LEASEHOLD_HISTORY_TABLE".into(), history.clone()));
    let t = Target {
        args: vec!["--table".into(), table.clone()],
        env,
        server: None,
        dir: leasehold_tests::TempDir::new("hist"),
    };
    let (j, text, pool) = tokio::task::spawn_blocking(move || {
        let pool = t.run(&["history", "pool/7", "--json"]).ok().json();
        (t.run(&["history", key, "--json"]).ok().json(), t.run(&["history", key]).ok().stdout, pool)
    })
    .await
    .unwrap();
    assert_eq!(got(&j), want, "{j:#}");
    assert_eq!(got(&pool), sem, "{pool:#}");
    assert_eq!(j["events"][8]["interface"], "queue");
    assert_eq!(text.lines().count(), want.len(), "{text}");
    let names: Vec<(&str, &str)> = records
        .iter()
        .map(|r| (r["eventName"].as_str().unwrap_or(""), r["dynamodb"]["Keys"]["key"]["S"].as_str().unwrap_or("")))
        .collect();
    assert_eq!(
        written as usize,
        want.len() + sem.len() + 1,
        "the runs' events and orders/43's grant; records: {names:?}"
    );
}
