//! Semaphores at the sizes DynamoDB's limits bite (DESIGN.md, "Semaphores": Cost), end to end
//! through `leasehold serve --table` on DynamoDB Local: a 300-slot semaphore used one holder at
//! a time for 700 cycles (two tidies of 316 ended entries: 6.6 KB of paths in one expression
//! unchunked), 60 holders of a 100-slot semaphore force-released at once (5.4 KB unchunked),
//! and a take on a semaphore full of 200 expired holders (4.2 KB unchunked). Each is then
//! taken again.

mod cli_support;

use std::time::{Duration, Instant};

use cli_support::{http, Server, Target};
use serde_json::{json, Value};

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

fn post(addr: &str, path: &str, body: Value) -> (u16, Value) {
    let (s, _, b) = http(addr, "POST", path, &[("content-type", "application/json")], body.to_string().as_bytes());
    (s, serde_json::from_str(&b).unwrap_or_else(|e| panic!("{path}: {e}: {b}")))
}

fn take(addr: &str, key: &str, holder: &str, slots: u32, duration_ms: u64) -> Value {
    let body = json!({"holder": holder, "slots": slots, "duration_ms": duration_ms});
    let (s, l) = post(addr, &format!("/leases/acquire/{key}"), body);
    assert_eq!(s, 200, "take {holder} of {key}: {l}");
    l
}

fn release(addr: &str, key: &str, lease: &Value) {
    let (s, r) = post(addr, &format!("/leases/release/{key}"), json!({"lease_id": lease["lease_id"]}));
    assert_eq!(s, 200, "release of {key}: {r}");
}

/// The semaphore's item as the table holds it: its holders' map entries.
fn entries(t: &Target, key: &str) -> usize {
    let table = t.args[1].clone();
    let key = key.to_string();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async move {
        let local = leasehold_tests::dynamo_local();
        let store = leasehold::store::DynamoStore::new(local.client().await, table);
        let r = leasehold::store::Store::get(&store, &key).await.unwrap().expect("the item");
        r.semaphore.slot_holders.len()
    })
}

fn serve() -> (Target, Server) {
    let t = Target::dynamo();
    let env = vec![("LEASEHOLD_MIN_DURATION_MS".to_string(), "100".to_string())];
    let server = Server::start(&t.args, &[t.env.clone(), env].concat());
    (t, server)
}

/// A 300-slot semaphore taken and released 700 times (`LEASEHOLD_SEM_CYCLES`; BENCHMARKS.md
/// gives a run of 2,500), one holder at a time: its map stays within its bound (the ended
/// entries are tidied as it goes, 316 at a time: past 4 KB in one expression, so in chunks),
/// and it is taken again after.
#[test]
fn a_300_slot_semaphore_used_one_at_a_time_700_times_is_taken_again() {
    let cycles: usize = std::env::var("LEASEHOLD_SEM_CYCLES").ok().and_then(|v| v.parse().ok()).unwrap_or(700);
    let (t, server) = serve();
    let a = &server.addr;
    let started = Instant::now();
    for i in 0..cycles {
        let l = take(a, "big/one-at-a-time", &format!("h{i}"), 300, 60_000);
        release(a, "big/one-at-a-time", &l);
    }
    println!("{cycles} cycles in {:?}", started.elapsed());
    let again = take(a, "big/one-at-a-time", "again", 300, 60_000);
    assert_eq!(again["slots"], 300);
    let n = entries(&t, "big/one-at-a-time");
    println!("{n} entries in the map after {cycles} cycles and one take");
    assert!(n <= 300 + 16 + 1, "{n} entries in the map");
}

/// 60 holders of a 100-slot semaphore force-released at once: every one is evicted (its
/// heartbeat refused), and the semaphore is taken again.
#[test]
fn sixty_holders_of_a_100_slot_semaphore_force_released_at_once_then_taken_again() {
    let (_t, server) = serve();
    let a = &server.addr;
    let held: Vec<Value> = (0..60).map(|i| take(a, "big/evict", &format!("h{i}"), 100, 120_000)).collect();
    let (s, state) = post(a, "/leases/force-release/big/evict", json!({}));
    assert_eq!(s, 200, "{state}");
    assert_eq!((state["held"].as_bool(), state["slots_taken"].as_u64()), (Some(false), Some(0)), "{state}");
    for l in &held {
        let (s, r) = post(a, "/leases/heartbeat/big/evict", json!({"lease_id": l["lease_id"]}));
        assert_eq!((s, r["error"].as_str()), (410, Some("NotHolder")), "{r}");
        assert!(state["fence"].as_u64() > l["fence"].as_u64());
    }
    let again = take(a, "big/evict", "again", 100, 120_000);
    assert!(again["fence"].as_u64() > state["fence"].as_u64());
}

/// A take on a semaphore full of 200 expired holders succeeds (cleaning them as it goes).
#[test]
fn a_take_on_a_semaphore_full_of_200_expired_holders_succeeds() {
    let (_t, server) = serve();
    let a = &server.addr;
    // 20 s: all 200 are taken before the first expires, on a loaded machine too.
    let held: Vec<Value> = (0..200).map(|i| take(a, "big/expired", &format!("h{i}"), 200, 20_000)).collect();
    let (s, full) = post(a, "/leases/acquire/big/expired", json!({"holder": "x", "slots": 200, "duration_ms": 60_000}));
    assert_eq!((s, full["error"].as_str()), (409, Some("LeaseHeld")), "{full}");
    let last = held.iter().filter_map(|l| l["expires_at_ms"].as_u64()).max().unwrap();
    while now_ms() <= last + 100 {
        std::thread::sleep(Duration::from_millis(100));
    }
    let l = take(a, "big/expired", "after", 200, 60_000);
    let (s, _, body) = http(a, "GET", "/leases/big/expired", &[], b"");
    let state: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((s, state["slots_taken"].as_u64()), (200, Some(1)), "{state}");
    assert!(l["fence"].as_u64() > held.iter().filter_map(|h| h["fence"].as_u64()).max());
}
