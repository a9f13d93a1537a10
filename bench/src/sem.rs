//! `sem`: a semaphore of 4 slots shared by 16 workers (each its own client, as on its own
//! machine), each holding a slot 5 ms then releasing it, on DynamoDB Local behind the counting
//! proxy; against the hand-written floor in the same run, rounds interleaved.
//!
//! - `leasehold`: `acquire(key, w, 10 s, slots: 4, wait)` (DESIGN.md, "Semaphores"), then
//!   `release`. A full semaphore's waiter sleeps until the next expiry or `poll_max` (500 ms by
//!   default); the second row sets `poll_max` to the floor's 10 ms.
//! - `floor`: the approach of AWS's Step Functions concurrency-control sample: one item per
//!   semaphore with a counter and a map of holders. Take a slot: one `UpdateItem`
//!   `ADD #count :one SET #holders.#id = :now` under `#count < :limit AND
//!   attribute_not_exists(#holders.#id)`; release: `ADD #count :minus_one REMOVE #holders.#id`
//!   under `attribute_exists(#holders.#id)`. A refused take polls again after 10 ms (the bench's
//!   `raw` M3 floor's pause). No expiry, no fence: a crashed holder's slot is lost until
//!   someone cleans it.
//!
//! Reported per side: acquisitions, per-worker min..max and max/min, every request per
//! acquisition (proxy count, releases included), the most holders seen at once (must be <= 4),
//! acquires that failed with a transient error (the worker tries again).

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use aws_sdk_dynamodb::types::AttributeValue;
use leasehold::store::DynamoStore;
use leasehold::{AcquireOptions, Coordinator, Error};
use leasehold_tests::proxy::Proxy;
use leasehold_tests::sdk_config_for;

use crate::harness::{config, scenario_run, Params, Rss, Setup, LEASE};

const WORKERS: usize = 16;
const SLOTS: u32 = 4;
const HOLD: Duration = Duration::from_millis(5);
/// The floor's pause after a refused take, and the `poll_max` of the second leasehold row.
const POLL: Duration = Duration::from_millis(10);

/// Holders at once: `enter` when a hold starts, `leave` when it ends; the most seen.
#[derive(Default)]
struct Slots {
    now: AtomicI64,
    most: AtomicI64,
    /// Acquires that failed with a transient error (the worker then tries again).
    errors: AtomicI64,
}

impl Slots {
    fn enter(&self) {
        let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(n, Ordering::SeqCst);
    }
    fn leave(&self) {
        self.now.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What one round of one side measured.
struct Round {
    per_worker: Vec<u64>,
    requests: u64,
    most: i64,
    errors: i64,
    secs: f64,
}

#[derive(Clone, Copy, PartialEq)]
enum Side {
    Leasehold,
    LeaseholdFastPoll,
    Floor,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Leasehold => "leasehold",
            Side::LeaseholdFastPoll => "leasehold poll 10ms",
            Side::Floor => "floor (AWS sample)",
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

async fn client(proxy: &Proxy) -> aws_sdk_dynamodb::Client {
    aws_sdk_dynamodb::Client::new(&sdk_config_for(&proxy.endpoint()).await)
}

/// One leasehold worker: take a slot (waiting), hold 5 ms, release; until `stop_at`.
async fn leasehold_worker(c: Coordinator, key: String, w: usize, stop_at: Instant, slots: Arc<Slots>) -> u64 {
    let mut mine = 0;
    while Instant::now() < stop_at {
        let wait = stop_at.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let opts = AcquireOptions { slots: Some(SLOTS), wait: Some(wait), ..Default::default() };
        let l = match c.acquire(&key, &format!("w{w}"), Some(LEASE), opts).await {
            Ok(l) => l,
            Err(Error::LeaseHeld { .. }) => continue,
            // Counted and reported: e.g. "kept changing until the deadline" when the takes of
            // many contenders keep changing the item under a loaded machine.
            Err(e) if e.is_transient() => {
                slots.errors.fetch_add(1, Ordering::SeqCst);
                continue;
            }
            Err(e) => panic!("acquire: {e}"),
        };
        slots.enter();
        tokio::time::sleep(HOLD).await;
        slots.leave();
        c.release(&key, &l.lease_id).await.expect("release");
        mine += 1;
    }
    mine
}

/// One floor worker: the counter-and-map conditional update, polling every 10 ms when full.
async fn floor_worker(
    client: aws_sdk_dynamodb::Client,
    table: String,
    key: String,
    w: usize,
    stop_at: Instant,
    slots: Arc<Slots>,
) -> u64 {
    let (mut mine, mut turn) = (0, 0u64);
    let k = AttributeValue::S(key);
    while Instant::now() < stop_at {
        // One id per acquisition, as the sample's execution id.
        let id = format!("w{w}-{turn}");
        turn += 1;
        loop {
            let r = client
                .update_item()
                .table_name(&table)
                .key("key", k.clone())
                .update_expression("ADD #count :one SET #holders.#id = :now")
                .condition_expression("#count < :limit AND attribute_not_exists(#holders.#id)")
                .expression_attribute_names("#count", "count")
                .expression_attribute_names("#holders", "holders")
                .expression_attribute_names("#id", &id)
                .expression_attribute_values(":one", AttributeValue::N("1".into()))
                .expression_attribute_values(":limit", AttributeValue::N(SLOTS.to_string()))
                .expression_attribute_values(":now", AttributeValue::N(now_ms().to_string()))
                .send()
                .await;
            match r {
                Ok(_) => break,
                Err(e) if e.as_service_error().is_some_and(|s| s.is_conditional_check_failed_exception()) => {
                    if Instant::now() >= stop_at {
                        return mine;
                    }
                    tokio::time::sleep(POLL).await;
                }
                Err(e) => panic!("floor take: {e:?}"),
            }
        }
        slots.enter();
        tokio::time::sleep(HOLD).await;
        slots.leave();
        client
            .update_item()
            .table_name(&table)
            .key("key", k.clone())
            .update_expression("ADD #count :minus_one REMOVE #holders.#id")
            .condition_expression("attribute_exists(#holders.#id)")
            .expression_attribute_names("#count", "count")
            .expression_attribute_names("#holders", "holders")
            .expression_attribute_names("#id", &id)
            .expression_attribute_values(":minus_one", AttributeValue::N("-1".into()))
            .send()
            .await
            .expect("floor release");
        mine += 1;
    }
    mine
}

/// One round of one side: 16 workers for `length` on a key of their own.
async fn round(s: &Setup, side: Side, tag: &str, length: Duration) -> Round {
    let slots = Arc::new(Slots::default());
    let key = format!("sem-{tag}");
    let mut workers = Vec::new();
    match side {
        Side::Leasehold | Side::LeaseholdFastPoll => {
            let mut cfg = config();
            if side == Side::LeaseholdFastPoll {
                cfg.poll_max = POLL;
            }
            for _ in 0..WORKERS {
                let store = DynamoStore::new(client(&s.proxy).await, s.tables["leasehold"].clone());
                workers.push(Coordinator::new(Arc::new(store), cfg.clone()));
            }
        }
        Side::Floor => {
            // The sample's lock item exists before any execution takes a slot.
            client(&s.proxy)
                .await
                .put_item()
                .table_name(&s.tables["raw"])
                .item("key", AttributeValue::S(key.clone()))
                .item("count", AttributeValue::N("0".into()))
                .item("holders", AttributeValue::M(Default::default()))
                .send()
                .await
                .expect("floor item");
        }
    }
    let mut floor_clients = Vec::new();
    if side == Side::Floor {
        for _ in 0..WORKERS {
            floor_clients.push(client(&s.proxy).await);
        }
    }
    s.proxy.reset_counts();
    let start = Instant::now();
    let stop_at = start + length;
    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        let (key, slots) = (key.clone(), slots.clone());
        tasks.push(match side {
            Side::Floor => {
                let (c, table) = (floor_clients[w].clone(), s.tables["raw"].clone());
                tokio::spawn(floor_worker(c, table, key, w, stop_at, slots))
            }
            _ => tokio::spawn(leasehold_worker(workers[w].clone(), key, w, stop_at, slots)),
        });
    }
    let mut per_worker = Vec::new();
    for t in tasks {
        per_worker.push(t.await.expect("worker"));
    }
    let secs = start.elapsed().as_secs_f64();
    let (most, errors) = (slots.most.load(Ordering::SeqCst), slots.errors.load(Ordering::SeqCst));
    Round { per_worker, requests: s.proxy.total(), most, errors, secs }
}

scenario_run!(parent_only report);

/// `Params::m3s` per side (20 s; 5 with `--quick`), in 4 interleaved rounds (2 with `--quick`),
/// after an unmeasured round per side (3 s; 1 s with `--quick`).
async fn report(s: &Setup, p: &Params, _: &mut Rss) {
    let rounds: u32 = if p.m3s >= 20 { 4 } else { 2 };
    let length = Duration::from_secs(p.m3s) / rounds;
    println!(
        "\nSEM: {WORKERS} workers (separate clients) on ONE semaphore of {SLOTS} slots for {} s per side, hold 5 ms, \
         {rounds} interleaved rounds of {:.1} s",
        p.m3s,
        length.as_secs_f64()
    );
    println!("(req/acq: every request per acquisition, releases included; most: holders seen at once)");
    let sides = [Side::Leasehold, Side::LeaseholdFastPoll, Side::Floor];
    // Unmeasured first, so that no side pays for DynamoDB Local warming up.
    let warm = Duration::from_secs(if p.m3s >= 20 { 3 } else { 1 });
    for side in sides {
        round(s, side, &format!("warm-{}", side as u8), warm).await;
    }
    let mut results: Vec<Vec<Round>> = sides.iter().map(|_| Vec::new()).collect();
    for r in 0..rounds {
        // A different side starts each round.
        for i in 0..sides.len() {
            let i = (i + r as usize) % sides.len();
            results[i].push(round(s, sides[i], &format!("{}-{r}", sides[i] as u8), length).await);
        }
    }
    println!(
        "{:<20} {:>8} {:>8} {:>12} {:>9} {:>9} {:>6} {:>7}   per round",
        "side", "acq", "acq/s", "per-worker", "max/min", "req/acq", "most", "errors"
    );
    let mut totals = Vec::new();
    for (side, rs) in sides.iter().zip(&results) {
        let mut per = [0u64; WORKERS];
        for r in rs {
            for (w, n) in r.per_worker.iter().enumerate() {
                per[w] += n;
            }
        }
        let acq: u64 = per.iter().sum();
        let secs: f64 = rs.iter().map(|r| r.secs).sum();
        let reqs: u64 = rs.iter().map(|r| r.requests).sum();
        let most = rs.iter().map(|r| r.most).max().unwrap_or(0);
        let errors: i64 = rs.iter().map(|r| r.errors).sum();
        let (mx, mn) = (*per.iter().max().unwrap(), *per.iter().min().unwrap());
        totals.push(acq);
        println!(
            "{:<20} {:>8} {:>8.0} {:>12} {:>9} {:>9.2} {:>6} {:>7}   {}",
            side.name(),
            acq,
            acq as f64 / secs,
            format!("{mn}..{mx}"),
            if mn == 0 { "inf".to_string() } else { format!("{:.2}", mx as f64 / mn as f64) },
            reqs as f64 / acq.max(1) as f64,
            most,
            errors,
            rs.iter().map(|r| r.per_worker.iter().sum::<u64>().to_string()).collect::<Vec<_>>().join(", ")
        );
        assert!(most <= SLOTS as i64, "{}: {most} holders at once on {SLOTS} slots", side.name());
    }
    println!(
        "leasehold / floor: {:.2}x acquisitions; leasehold poll 10ms / floor: {:.2}x",
        totals[0] as f64 / totals[2].max(1) as f64,
        totals[1] as f64 / totals[2].max(1) as f64
    );
}
