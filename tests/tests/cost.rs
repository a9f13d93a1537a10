//! What a lease costs, measured (COSTS.md prices these): for each common
//! shape, the DynamoDB requests per lease and the capacity units DynamoDB reports for them (a
//! proxy in front of DynamoDB Local asks each request for its consumed capacity, indexes
//! included), the requests of the keep-alive sweep per lease and run, and the bytes of log the
//! functions write per invocation (the real functions in the Lambda runtime emulator). The
//! shapes run through the library's coordinator, which is what the functions run; the Lambda
//! invocations and Step Functions transitions of each shape are counted where they happen
//! (the functions here, the state machines' executions in workflows.rs, queue_workflow.rs,
//! batch.rs and concurrency_limited.rs).
//!
//! Each measurement is asserted, so that BENCHMARKS.md's table cannot drift from the code
//! unnoticed; `--nocapture` prints the table.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use leasehold::queue::{Deliver, Enqueued};
use leasehold::{AcquireOptions, Coordinator, Keepalive, Lease, LeaseId};
use leasehold_tests::lambda_lab::{read_event, Lab};
use leasehold_tests::proxy::Proxy;
use leasehold_tests::{proxied_table, test_config, DeliveredLeases};
use serde_json::json;

/// Requests and capacity units of `n` repetitions of a shape, per repetition.
#[derive(Debug, Clone, PartialEq)]
struct PerLease {
    requests: BTreeMap<String, f64>,
    read_units: f64,
    /// The write units the answers report: a write refused by its condition reports none.
    write_units: f64,
    /// Requests answered with an error (here: writes refused by their condition).
    errors: f64,
    /// Writes refused by their condition: DynamoDB bills each the write units of the item it
    /// was checked against (one for these items, all under 1 KB).
    refused_writes: f64,
}

impl PerLease {
    /// The write units DynamoDB bills: those reported plus one per refused write.
    fn billed_write_units(&self) -> f64 {
        self.write_units + self.refused_writes
    }
}

const READS: [&str; 4] = ["GetItem", "Query", "Scan", "BatchGetItem"];

fn per(proxy: &Proxy, n: usize) -> PerLease {
    let n = n as f64;
    let requests = proxy.counts().into_iter().map(|(op, c)| (op, c as f64 / n)).collect();
    let (mut read_units, mut write_units, mut errors, mut refused_writes) = (0.0, 0.0, 0.0, 0.0);
    for (op, (units, errs)) in proxy.consumed() {
        if READS.contains(&op.as_str()) {
            read_units += units;
        } else {
            write_units += units;
            refused_writes += errs as f64;
        }
        errors += errs as f64;
    }
    PerLease {
        requests,
        read_units: read_units / n,
        write_units: write_units / n,
        errors: errors / n,
        refused_writes: refused_writes / n,
    }
}

fn start(proxy: &Proxy) {
    proxy.reset_counts();
    proxy.measure_capacity(true);
}

fn req(p: &PerLease, op: &str) -> f64 {
    p.requests.get(op).copied().unwrap_or(0.0)
}

const N: usize = 20;

/// A coordinator over a fresh table behind the measuring proxy, past its clock check's
/// first reads (a new process reads a key until it has 3 Date headers: a cold start's cost,
/// not a lease's).
async fn coordinator() -> (Arc<Proxy>, Coordinator, Arc<DeliveredLeases>) {
    let (proxy, table, conf) = proxied_table().await;
    let store = leasehold::store::DynamoStore::new(aws_sdk_dynamodb::Client::new(&conf), table);
    let rec = Arc::new(DeliveredLeases::default());
    let c = Coordinator::new(Arc::new(store), test_config()).with_deliver(rec.clone() as Arc<dyn Deliver>);
    for i in 0..4 {
        let l = c.acquire(&format!("warm/{i}"), "w", Some(Duration::from_secs(30)), AcquireOptions::default()).await;
        c.release(&format!("warm/{i}"), &l.unwrap().lease_id).await.unwrap();
    }
    (proxy, c, rec)
}

fn show(name: &str, p: &PerLease) {
    let reqs: Vec<String> = p.requests.iter().map(|(op, n)| format!("{op} {n:.2}")).collect();
    println!(
        "{name:<44} {:<48} read units {:.2}  write units {:.2} (billed {:.2})  refused {:.2}",
        reqs.join(", "),
        p.read_units,
        p.write_units,
        p.billed_write_units(),
        p.errors
    );
}

/// Plain lease (acquire, release), with a renewal; semaphore slot (acquire, release).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_and_capacity_per_lease() {
    let (proxy, c, _) = coordinator().await;
    let d = Some(Duration::from_secs(60));
    // Plain: one PutItem, one UpdateItem, one write unit each (items under 1 KB, no index).
    start(&proxy);
    for i in 0..N {
        let l = c.acquire(&format!("plain/{i}"), "worker-1", d, AcquireOptions::default()).await.unwrap();
        c.release(&l.key, &l.lease_id).await.unwrap();
    }
    let plain = per(&proxy, N);
    show("plain lease (acquire + release)", &plain);
    assert_eq!((req(&plain, "PutItem"), req(&plain, "UpdateItem")), (1.0, 1.0), "{plain:?}");
    assert_eq!(plain.requests.values().sum::<f64>(), 2.0, "{plain:?}");
    assert_eq!((plain.write_units, plain.read_units), (2.0, 0.0), "{plain:?}");

    // A renewal (heartbeat): one UpdateItem, one write unit.
    let held: Vec<Lease> = {
        let mut v = Vec::new();
        for i in 0..N {
            v.push(c.acquire(&format!("renewed/{i}"), "worker-1", d, AcquireOptions::default()).await.unwrap());
        }
        v
    };
    start(&proxy);
    for l in &held {
        c.heartbeat(&l.key, &l.lease_id, d).await.unwrap();
    }
    let renewal = per(&proxy, N);
    show("renewal (heartbeat)", &renewal);
    assert_eq!((req(&renewal, "UpdateItem"), renewal.write_units), (1.0, 1.0), "{renewal:?}");

    // A semaphore slot of 4: the item is the semaphore's (its holders in a map).
    start(&proxy);
    for i in 0..N {
        let opts = AcquireOptions { slots: Some(4), ..Default::default() };
        let l = c.acquire(&format!("sem/{}", i % 5), "worker-1", d, opts).await.unwrap();
        c.release(&l.key, &l.lease_id).await.unwrap();
    }
    let sem = per(&proxy, N);
    show("semaphore slot of 4 (acquire + release)", &sem);
    // Two UpdateItems (take a slot, give it back); the first slot of each of the 5 keys is
    // first refused (no item yet) and put instead.
    assert_eq!((req(&sem, "UpdateItem"), req(&sem, "PutItem"), sem.errors), (2.0, 0.25, 0.25), "{sem:?}");
    assert_eq!((sem.write_units, sem.billed_write_units()), (2.0, 2.25), "{sem:?}");

    // A busy semaphore: its item holds every live holder (about 150 bytes each), and a write
    // is billed per started kilobyte of the item, so with 12 of 16 slots held elsewhere a
    // slot's take and release cost more than one unit each.
    let busy_opts = || AcquireOptions { slots: Some(16), ..Default::default() };
    for i in 0..12 {
        c.acquire("sem-busy", &format!("holder-{i}"), d, busy_opts()).await.unwrap();
    }
    start(&proxy);
    for _ in 0..N {
        let l = c.acquire("sem-busy", "worker-1", d, busy_opts()).await.unwrap();
        c.release(&l.key, &l.lease_id).await.unwrap();
    }
    let busy = per(&proxy, N);
    show("semaphore slot of 16, 12 held elsewhere", &busy);
    assert_eq!((req(&busy, "UpdateItem"), busy.errors), (2.0, 0.0), "{busy:?}");
    assert!(busy.write_units > 2.0 && busy.write_units <= 16.0, "{busy:?}");
}

/// A key's visit to a work state, as the BatchProcessor makes it: put, taken by `next` (10
/// a batch), released into DONE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_and_capacity_per_work_item() {
    let (proxy, c, _) = coordinator().await;
    start(&proxy);
    for i in 0..N {
        c.put(&format!("orders/{i}"), "PENDING", "producer").await.unwrap();
    }
    let put = per(&proxy, N);
    show("work item: put", &put);
    start(&proxy);
    let mut taken = Vec::new();
    while taken.len() < N {
        let batch =
            c.acquire_next("PENDING", 10, "batch", Some(Duration::from_secs(60)), AcquireOptions::default()).await;
        taken.extend(batch.unwrap());
    }
    let next = per(&proxy, N);
    show("work item: next (batches of 10), per key", &next);
    start(&proxy);
    for l in &taken {
        c.heartbeat(&l.key, &l.lease_id, Some(Duration::from_secs(60))).await.unwrap();
    }
    let renew = per(&proxy, N);
    show("work item: renewal (the BatchProcessor's Renew)", &renew);
    start(&proxy);
    for l in &taken {
        c.release_to(&l.key, &l.lease_id, Some("DONE")).await.unwrap();
    }
    let done = per(&proxy, N);
    show("work item: release into DONE", &done);
    // Each write also writes the state index (a key in a state has state_shard): the put
    // inserts its entry (2 units); the grant and the release move it (its sort key, the expiry,
    // changes: a delete and an insert, 3 units).
    assert_eq!((req(&put, "UpdateItem"), put.write_units), (1.0, 2.0), "{put:?}");
    assert_eq!((req(&next, "PutItem"), req(&next, "Query")), (1.0, 0.1), "a grant per key, a Query per 10: {next:?}");
    assert_eq!((next.write_units, next.read_units, next.errors), (3.0, 0.05, 0.0), "{next:?}");
    assert_eq!((req(&done, "UpdateItem"), done.write_units, done.errors), (1.0, 3.0, 0.0), "{done:?}");
    // A renewal moves the expiry too, so the index entry with it; and it is sent twice: a
    // renewal first writes a TTL under the condition that the key is in no state, is refused
    // for it, and goes again without (the coordinator does not know the key is a work item).
    assert_eq!((req(&renew, "UpdateItem"), renew.write_units, renew.errors), (2.0, 3.0, 1.0), "{renew:?}");
    assert_eq!(renew.billed_write_units(), 4.0, "{renew:?}");
}

/// A queued acquire (QueuedSingleFlight): the waiter joins the holder's queue, and the
/// holder's release hands the key over in its own write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_and_capacity_per_queued_lease() {
    let (proxy, c, rec) = coordinator().await;
    let d = Duration::from_secs(60);
    let mut holders = Vec::new();
    for i in 0..N {
        holders.push(c.acquire(&format!("queued/{i}"), "first", Some(d), AcquireOptions::default()).await.unwrap());
    }
    start(&proxy);
    for i in 0..N {
        let opts = AcquireOptions { lease_id: Some(LeaseId::generate()), ..Default::default() };
        let q = c.acquire_or_enqueue(&format!("queued/{i}"), "waiter", d, opts, &format!("token-{i}"), None).await;
        assert!(matches!(q.unwrap(), Enqueued::Queued { .. }));
    }
    let join = per(&proxy, N);
    show("queued: join the queue", &join);
    start(&proxy);
    for l in &holders {
        c.release(&l.key, &l.lease_id).await.unwrap();
    }
    let handover = per(&proxy, N);
    show("queued: release handing over", &handover);
    assert_eq!(rec.leases().len(), N, "every waiter got its lease");
    start(&proxy);
    let granted = rec.leases();
    for l in granted {
        c.release(&l.key, &l.lease_id).await.unwrap();
    }
    let last = per(&proxy, N);
    show("queued: the waiter's own release", &last);
    // Joining: the acquire refused (the key is held), the queue joined on the lease item, the
    // waiter's own item put, read back. The hand-over: the release refused as a plain one (the
    // key has waiters), the head waiter read, granted in the release's write, its item deleted.
    assert_eq!(join.requests.values().sum::<f64>(), 5.0, "{join:?}");
    assert_eq!((join.write_units, join.read_units, join.errors), (3.0, 2.0, 1.0), "{join:?}");
    assert_eq!(join.billed_write_units(), 4.0, "{join:?}");
    assert_eq!(handover.requests.values().sum::<f64>(), 5.0, "{handover:?}");
    assert_eq!((handover.write_units, handover.read_units, handover.errors), (3.0, 1.0, 1.0), "{handover:?}");
    assert_eq!(handover.billed_write_units(), 4.0, "{handover:?}");
    assert_eq!((last.write_units, last.errors), (1.0, 0.0), "{last:?}");
}

/// The keep-alive sweep: per run, one Query per shard (8) and one per queue shard (8) however
/// many leases; per live keep-alive lease, one UpdateItem (the table and the `keepalive`
/// index: 2 write units) and its share of the index's pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_and_capacity_of_the_keepalive_sweep() {
    let (proxy, c, _) = coordinator().await;
    let until = leasehold::Clock::wall_ms(&leasehold::SystemClock).max(0) as u64 + 600_000;
    start(&proxy);
    let mut taken = Vec::new();
    for i in 0..N {
        let opts = AcquireOptions {
            keepalive: Some(Keepalive { until_ms: until, execution_arn: None }),
            ..Default::default()
        };
        taken.push(c.acquire(&format!("ka/{i}"), "execution", Some(Duration::from_secs(180)), opts).await.unwrap());
    }
    let acquire = per(&proxy, N);
    show("keep-alive lease: acquire", &acquire);
    // An empty run: the fixed cost of a sweep (every keep-alive and queue shard read once).
    let (empty_proxy, empty, _) = coordinator().await;
    start(&empty_proxy);
    let deadline = std::time::Instant::now() + Duration::from_secs(50);
    let r = empty.keepalive_sweep(None, 1000, deadline).await;
    empty.sweep_queues(deadline).await.unwrap();
    let fixed = per(&empty_proxy, 1);
    show("sweep run, no lease (fixed, per run)", &fixed);
    assert_eq!((r.scanned, req(&fixed, "Query")), (0, 16.0), "{fixed:?}");
    start(&proxy);
    let r = c.keepalive_sweep(None, 1000, std::time::Instant::now() + Duration::from_secs(50)).await;
    assert_eq!(r.renewed as usize, N, "{r:?}");
    let run = per(&proxy, N);
    show("sweep run, per live keep-alive lease", &run);
    assert_eq!(req(&run, "UpdateItem"), 1.0, "{run:?}");
    assert!(run.write_units <= 2.0, "the table and the keepalive index: {run:?}");
    start(&proxy);
    for l in &taken {
        c.release(&l.key, &l.lease_id).await.unwrap();
    }
    let release = per(&proxy, N);
    show("keep-alive lease: release", &release);
    assert!(acquire.write_units <= 2.0 && release.write_units <= 2.0, "{acquire:?} {release:?}");
}

/// The bytes of log the functions write per invocation: the metric line (always) and, at
/// RUST_LOG=info, the invocation's own line; the platform lines (START, END, REPORT) are
/// Lambda's and not written here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_bytes_per_invocation() {
    let lab = Lab::start(&[("RUST_LOG", "info".to_string())], &[]).await;
    let before = lab.emu.server.log_text().len();
    for i in 0..N {
        let key = format!("logs/{i}");
        let id = LeaseId::generate().expose().to_string();
        let a = lab
            .invoke("acquire", &json!({"key": key, "holder": "worker-1", "duration_ms": 60000, "lease_id": id}))
            .await;
        assert!(a.error_type.is_none(), "{}", a.body);
        let r = lab.invoke("release", &json!({"key": key, "lease_id": id})).await;
        assert!(r.error_type.is_none(), "{}", r.body);
    }
    let log = lab.emu.server.log_text()[before..].to_string();
    let lines = |pred: &dyn Fn(&str) -> bool| -> (usize, usize) {
        let l: Vec<&str> = log.lines().filter(|l| pred(l)).collect();
        (l.len(), l.iter().map(|x| x.find('{').map_or(0, |i| x.len() - i + 1)).sum())
    };
    let (metric_lines, metric_bytes) = lines(&|l| l.contains("\"_aws\""));
    let (info_lines, info_bytes) = lines(&|l| l.contains("direct invoke"));
    let invocations = 2 * N;
    println!(
        "per invocation: metric line {} bytes (always), info line {} bytes (LogLevel info)",
        metric_bytes / metric_lines.max(1),
        info_bytes / info_lines.max(1)
    );
    assert_eq!(metric_lines, invocations, "one metric line per invocation");
    assert_eq!(info_lines, invocations, "one info line per invocation at RUST_LOG=info");
    assert!((300..1500).contains(&(metric_bytes / metric_lines)), "{metric_bytes}");
    // The scheduled sweep's: one metric line per run (one run per sweep period), whatever the
    // leases.
    let before = lab.emu.server.log_text().len();
    let s = lab.invoke("heartbeat", &read_event("scheduled.json")).await;
    assert!(s.error_type.is_none(), "{}", s.body);
    let log = lab.emu.server.log_text()[before..].to_string();
    let sweep: Vec<usize> =
        log.lines().filter(|l| l.contains("\"_aws\"")).map(|l| l.find('{').map_or(0, |i| l.len() - i + 1)).collect();
    println!("per sweep run: metric line {sweep:?} bytes");
    assert_eq!(sweep.len(), 1, "{log}");
    assert!((300..2500).contains(&sweep[0]), "{sweep:?}");
    lab.assert_no_crash();
}
