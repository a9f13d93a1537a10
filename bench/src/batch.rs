//! The batch scenario: `workers` workers drain `items` keys from `PENDING` to `DONE` on
//! DynamoDB Local (behind the counting proxy), each taking batches of `limit`.
//!
//! - `leasehold`: `acquire_next(PENDING, limit)` (one Query of the sparse state index, then one
//!   conditional PutItem per candidate, in parallel), then `release(key, lease_id, DONE)` per
//!   key (in parallel).
//! - `floor`: the hand-written way with the SDK: a Query of a `status` index for the first
//!   `limit` PENDING items, one conditional UpdateItem per item to take it (`status = PENDING`
//!   -> `LEASED`, with an owner and an expiry), and one conditional UpdateItem per item to mark
//!   it `DONE` (`owner = me`), both in parallel.
//!
//! Reported: items per second over the drain, requests per item (proxy count), collisions
//! (taking writes that lost to another worker), items processed twice (must be 0). Each worker
//! has its own client (as on its own machine).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, GlobalSecondaryIndex, KeySchemaElement, KeyType, Projection,
    ProjectionType, ScalarAttributeType,
};
use leasehold::store::DynamoStore;
use leasehold::{AcquireOptions, Config, Coordinator};
use leasehold_tests::proxy::Proxy;
use leasehold_tests::sdk_config_for;

use crate::harness::{scenario_run, Params, Rss, Setup};

const STATE: &str = "PENDING";

/// What one drain measured.
#[derive(Debug, Default)]
struct Drain {
    secs: f64,
    requests: u64,
    taking_writes: u64,
    collisions: u64,
    twice: u64,
    processed: u64,
}

fn seen(done: &Mutex<HashMap<String, u32>>, key: &str) -> bool {
    let mut d = done.lock().unwrap();
    let n = d.entry(key.to_string()).or_insert(0);
    *n += 1;
    *n > 1
}

async fn leasehold_drain(proxy: &Proxy, table: &str, items: usize, workers: usize, limit: u32) -> Drain {
    let client = aws_sdk_dynamodb::Client::new(&sdk_config_for(&proxy.endpoint()).await);
    let store = DynamoStore::new(client, table);
    store.create_table().await.expect("table");
    let c = Coordinator::new(Arc::new(store), Config::default());
    fill(items, |k| {
        let c = c.clone();
        async move {
            c.put(&k, STATE, "producer").await.expect("put");
        }
    })
    .await;
    let done = Arc::new(Mutex::new(HashMap::new()));
    proxy.reset_counts();
    proxy.record(true);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..workers {
        let client = aws_sdk_dynamodb::Client::new(&sdk_config_for(&proxy.endpoint()).await);
        let c = Coordinator::new(Arc::new(DynamoStore::new(client, table)), Config::default());
        let done = done.clone();
        tasks.push(tokio::spawn(async move {
            let mut empty = 0;
            while empty < 2 {
                let batch = c
                    .acquire_next(
                        STATE,
                        limit,
                        &format!("w{w}"),
                        Some(Duration::from_secs(60)),
                        AcquireOptions::default(),
                    )
                    .await
                    .expect("acquire_next");
                if batch.is_empty() {
                    empty += 1;
                    continue;
                }
                empty = 0;
                let mut rel = tokio::task::JoinSet::new();
                for l in batch {
                    seen(&done, &l.key);
                    let c = c.clone();
                    rel.spawn(async move { c.release_to(&l.key, &l.lease_id, Some("DONE")).await.expect("release") });
                }
                while rel.join_next().await.is_some() {}
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let secs = start.elapsed().as_secs_f64();
    proxy.record(false);
    // Taking writes are the acquires' PutItems; a lost one is a failed condition (400).
    let takes: Vec<u16> = proxy.events().iter().filter(|e| e.target == "PutItem").map(|e| e.status).collect();
    let d = done.lock().unwrap();
    Drain {
        secs,
        requests: proxy.total(),
        taking_writes: takes.len() as u64,
        collisions: takes.iter().filter(|s| **s == 400).count() as u64,
        twice: d.values().map(|n| (*n as u64).saturating_sub(1)).sum(),
        processed: d.len() as u64,
    }
}

/// Puts `items` keys in, 16 at a time.
async fn fill<F, Fut>(items: usize, put: F)
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let mut set = tokio::task::JoinSet::new();
    for i in 0..items {
        if set.len() >= 16 {
            set.join_next().await;
        }
        set.spawn(put(format!("item/{i:06}")));
    }
    while set.join_next().await.is_some() {}
}

fn s(v: &str) -> AttributeValue {
    AttributeValue::S(v.to_string())
}

fn n(v: u64) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

async fn floor_table(client: &aws_sdk_dynamodb::Client, table: &str) {
    let def = |name: &str, t: ScalarAttributeType| {
        AttributeDefinition::builder().attribute_name(name).attribute_type(t).build().unwrap()
    };
    let ks = |name: &str, t: KeyType| KeySchemaElement::builder().attribute_name(name).key_type(t).build().unwrap();
    client
        .create_table()
        .table_name(table)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(def("key", ScalarAttributeType::S))
        .attribute_definitions(def("status", ScalarAttributeType::S))
        .attribute_definitions(def("since", ScalarAttributeType::N))
        .key_schema(ks("key", KeyType::Hash))
        .global_secondary_indexes(
            GlobalSecondaryIndex::builder()
                .index_name("by_status")
                .key_schema(ks("status", KeyType::Hash))
                .key_schema(ks("since", KeyType::Range))
                .projection(Projection::builder().projection_type(ProjectionType::KeysOnly).build())
                .build()
                .unwrap(),
        )
        .send()
        .await
        .expect("floor table");
}

async fn floor_drain(proxy: &Proxy, table: &str, items: usize, workers: usize, limit: u32) -> Drain {
    let client = aws_sdk_dynamodb::Client::new(&sdk_config_for(&proxy.endpoint()).await);
    floor_table(&client, table).await;
    floor_fill(&client, table, items).await;
    let done = Arc::new(Mutex::new(HashMap::new()));
    let (writes, lost) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    proxy.reset_counts();
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..workers {
        let worker = FloorWorker {
            client: aws_sdk_dynamodb::Client::new(&sdk_config_for(&proxy.endpoint()).await),
            table: table.to_string(),
            me: format!("w{w}"),
            limit,
            done: done.clone(),
            writes: writes.clone(),
            lost: lost.clone(),
        };
        tasks.push(tokio::spawn(async move { worker.drain().await }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let secs = start.elapsed().as_secs_f64();
    let d = done.lock().unwrap();
    Drain {
        secs,
        requests: proxy.total(),
        taking_writes: writes.load(Ordering::Relaxed),
        collisions: lost.load(Ordering::Relaxed),
        twice: d.values().map(|n| (*n as u64).saturating_sub(1)).sum(),
        processed: d.len() as u64,
    }
}

/// The floor's items: `items` keys in `STATE`, since now.
async fn floor_fill(client: &aws_sdk_dynamodb::Client, table: &str, items: usize) {
    let t0 = leasehold_tests_now_ms();
    fill(items, |k| {
        let (client, table) = (client.clone(), table.to_string());
        async move {
            client
                .put_item()
                .table_name(table)
                .item("key", s(&k))
                .item("status", s(STATE))
                .item("since", n(t0))
                .send()
                .await
                .expect("put");
        }
    })
    .await;
}

/// One worker of the floor, with its own client, and the counts every worker adds to.
struct FloorWorker {
    client: aws_sdk_dynamodb::Client,
    table: String,
    me: String,
    limit: u32,
    /// How often each key was marked done.
    done: Arc<Mutex<HashMap<String, u32>>>,
    /// Taking writes sent.
    writes: Arc<AtomicU64>,
    /// Taking writes that lost to another worker.
    lost: Arc<AtomicU64>,
}

impl FloorWorker {
    /// Pages of the `status` index until two in a row are empty: takes each page's items, then
    /// marks the ones it took done.
    async fn drain(self) {
        let mut empty = 0;
        while empty < 2 {
            let page = self
                .client
                .query()
                .table_name(&self.table)
                .index_name("by_status")
                .key_condition_expression("#s = :p")
                .expression_attribute_names("#s", "status")
                .expression_attribute_values(":p", s(STATE))
                .limit(self.limit as i32)
                .send()
                .await
                .expect("query");
            if page.items().is_empty() {
                empty += 1;
                continue;
            }
            empty = 0;
            let mine = self.take(page.items()).await;
            self.finish(mine).await;
        }
    }

    /// One conditional UpdateItem per item (`status = PENDING` -> `LEASED`, owner, expiry), in
    /// parallel: the keys this worker took.
    async fn take(&self, items: &[HashMap<String, AttributeValue>]) -> Vec<AttributeValue> {
        let mut take = tokio::task::JoinSet::new();
        for item in items {
            let key = item["key"].clone();
            let (client, table, me) = (self.client.clone(), self.table.clone(), self.me.clone());
            self.writes.fetch_add(1, Ordering::Relaxed);
            take.spawn(async move {
                let r = client
                    .update_item()
                    .table_name(&table)
                    .key("key", key.clone())
                    .update_expression("SET #s = :leased, #o = :me, #e = :e")
                    .condition_expression("#s = :p")
                    .expression_attribute_names("#s", "status")
                    .expression_attribute_names("#o", "owner")
                    .expression_attribute_names("#e", "expires")
                    .expression_attribute_values(":leased", s("LEASED"))
                    .expression_attribute_values(":p", s(STATE))
                    .expression_attribute_values(":me", s(&me))
                    .expression_attribute_values(":e", n(leasehold_tests_now_ms() + 60_000))
                    .send()
                    .await;
                match r {
                    Ok(_) => Some(key),
                    Err(e) if e.as_service_error().is_some_and(|s| s.is_conditional_check_failed_exception()) => None,
                    Err(e) => panic!("{e:?}"),
                }
            });
        }
        let mut mine = Vec::new();
        while let Some(r) = take.join_next().await {
            match r.unwrap() {
                Some(k) => mine.push(k),
                None => {
                    self.lost.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        mine
    }

    /// One conditional UpdateItem per key taken (`owner = me` -> `DONE`), in parallel.
    async fn finish(&self, mine: Vec<AttributeValue>) {
        let mut finish = tokio::task::JoinSet::new();
        for key in mine {
            seen(&self.done, key.as_s().unwrap());
            let (client, table, me) = (self.client.clone(), self.table.clone(), self.me.clone());
            finish.spawn(async move {
                client
                    .update_item()
                    .table_name(&table)
                    .key("key", key)
                    .update_expression("SET #s = :done")
                    .condition_expression("#o = :me")
                    .expression_attribute_names("#s", "status")
                    .expression_attribute_names("#o", "owner")
                    .expression_attribute_values(":done", s("DONE"))
                    .expression_attribute_values(":me", s(&me))
                    .send()
                    .await
                    .expect("done");
            });
        }
        while finish.join_next().await.is_some() {}
    }
}

fn leasehold_tests_now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

scenario_run!(parent_only report);

/// 8 workers, batches of 10, `Params::batch_items` items, `Params::batch_rounds` rounds per side.
async fn report(s: &Setup, p: &Params, _: &mut Rss) {
    drains(&s.proxy, p.batch_items, 8, 10, p.batch_rounds).await;
}

/// Runs the scenario `rounds` times per side, interleaved, and prints the table.
async fn drains(proxy: &Proxy, items: usize, workers: usize, limit: u32, rounds: usize) {
    println!(
        "\nBATCH: {workers} workers drain {items} items PENDING -> DONE, batches of {limit} (each worker its own client); {rounds} rounds each, interleaved, after an unmeasured drain of {} per side",
        (items / 5).max(100)
    );
    // Unmeasured first: DynamoDB Local's JIT compiler takes a core for the first tens of
    // thousands of requests, and whichever side ran first would pay for it (as in M1's warmup).
    let warm = (items / 5).max(100);
    leasehold_drain(proxy, "batch-warmup-leasehold", warm, workers, limit).await;
    floor_drain(proxy, "batch-warmup-floor", warm, workers, limit).await;
    let mut rows: Vec<(&str, Vec<Drain>)> = vec![("leasehold", Vec::new()), ("floor", Vec::new())];
    for r in 0..rounds {
        let order: [usize; 2] = if r % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let table = format!("batch-{}-{r}", rows[i].0);
            let d = if i == 0 {
                leasehold_drain(proxy, &table, items, workers, limit).await
            } else {
                floor_drain(proxy, &table, items, workers, limit).await
            };
            assert_eq!(d.processed as usize, items, "{}: not every item was processed", rows[i].0);
            rows[i].1.push(d);
        }
    }
    println!(
        "{:<10} {:>10} {:>12} {:>14} {:>12} {:>8}",
        "side", "items/s", "req/item", "taking writes", "collisions", "twice"
    );
    let mut rates = Vec::new();
    for (name, ds) in &rows {
        let per: Vec<f64> = ds.iter().map(|d| items as f64 / d.secs).collect();
        let rate = per.iter().sum::<f64>() / per.len() as f64;
        rates.push(rate);
        let reqs = ds.iter().map(|d| d.requests).sum::<u64>() as f64 / (items * ds.len()) as f64;
        let writes: u64 = ds.iter().map(|d| d.taking_writes).sum();
        let coll: u64 = ds.iter().map(|d| d.collisions).sum();
        let twice: u64 = ds.iter().map(|d| d.twice).sum();
        println!(
            "{:<10} {:>10.0} {:>12.2} {:>14} {:>7} ({:>4.1}%) {:>6}   per round: {}",
            name,
            rate,
            reqs,
            writes,
            coll,
            100.0 * coll as f64 / writes.max(1) as f64,
            twice,
            per.iter().map(|r| format!("{r:.0}")).collect::<Vec<_>>().join(", ")
        );
    }
    println!("leasehold / floor: {:.2}x items/s", rates[0] / rates[1]);
}
