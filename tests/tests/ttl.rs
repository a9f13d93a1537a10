//! TTL deletion for real: DynamoDB Local's sweeper and the embedded store's purge delete a
//! released item, and the next acquire still issues a higher fence.

use std::time::{Duration, Instant};

use leasehold::store::SqliteStore;
use leasehold::{AcquireOptions, Coordinator, Error};
use leasehold_tests::{dynamo_local, test_config, Counting, TempDir};

fn short_ttl_config() -> leasehold::Config {
    let mut c = test_config();
    c.ttl_grace = Duration::ZERO;
    c.limits.max_duration = Duration::from_secs(2);
    // TTLs also wait out the fence lead (see `Coordinator::ttl_after`): short here, so that the
    // sweep comes soon; the clocks below stay within it unless a test says otherwise.
    c.fence_lead = Duration::from_secs(1);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamodb_ttl_sweep_then_reacquire_with_higher_fence() {
    let local = tokio::task::spawn_blocking(dynamo_local).await.unwrap();
    // DynamoDB Local's TTL sweeper ignores tables with a global secondary index, so this table
    // is made without the keep-alive index; the items and their TTL are exactly the same.
    let store = leasehold::store::DynamoStore::new(local.client().await, "ttl-sweep");
    store.create_table_with(false).await.unwrap();
    let ttl = store.client().describe_time_to_live().table_name(store.table()).send().await.unwrap();
    let desc = ttl.time_to_live_description().expect("ttl description");
    assert_eq!(desc.attribute_name(), Some("ttl"));
    let c = Coordinator::new(std::sync::Arc::new(store), short_ttl_config());
    let l = c.acquire("swept", "h", Some(Duration::from_secs(1)), AcquireOptions::default()).await.unwrap();
    c.release("swept", &l.lease_id).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        match c.get("swept").await {
            Err(Error::NotFound { .. }) => break,
            Ok(_) => {
                assert!(Instant::now() < deadline, "DynamoDB Local never swept the expired item");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
    let again = c.acquire("swept", "h", Some(Duration::from_secs(1)), AcquireOptions::default()).await.unwrap();
    assert!(again.fence > l.fence, "{} after {}", again.fence, l.fence);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_purge_keeps_fences_monotonic() {
    let dir = TempDir::new("purge");
    let store = SqliteStore::open(dir.path().join("l.db")).unwrap();
    let arc = std::sync::Arc::new(store.clone());
    // A coordinator whose clock is `offset_ms` off and who sees no clock evidence (a blind
    // clock: one whose evidence checked it would be refused, or corrected back).
    let blind = |offset_ms: i64| {
        let mut cfg = short_ttl_config();
        cfg.clock_offset_ms = offset_ms;
        Coordinator::new(Counting::new(arc.clone()), cfg)
    };
    let c = Coordinator::new(arc.clone(), short_ttl_config());
    let l = c.acquire("p", "h", Some(Duration::from_secs(1)), AcquireOptions::default()).await.unwrap();
    // Held: never purged.
    assert_eq!(store.purge_expired(c.now_ms()).await.unwrap(), 0);
    c.release("p", &l.lease_id).await.unwrap();
    // Not yet past its TTL (release time + max_duration).
    assert_eq!(store.purge_expired(c.now_ms()).await.unwrap(), 0);
    // Six seconds later it is purged (a purge at that time: a coordinator's clock ahead of the
    // store's would be corrected back to it), and a fresh acquire starts above the purged fence.
    assert_eq!(store.purge_expired(c.now_ms() + 6_000).await.unwrap(), 1);
    assert!(matches!(c.get("p").await, Err(Error::NotFound { .. })));
    let again = c.acquire("p", "h", Some(Duration::from_secs(1)), AcquireOptions::default()).await.unwrap();
    assert!(again.fence > l.fence, "{} after {}", again.fence, l.fence);

    // A fence issued by a blind coordinator whose clock runs a minute fast is ahead of the
    // purger's clock: the purge keeps that item even past its TTL, so no later fence can fall
    // below it.
    let fast = blind(60_000);
    let f = fast.acquire("skewed", "h", Some(Duration::from_secs(1)), AcquireOptions::default()).await.unwrap();
    c.release("skewed", &f.lease_id).await.unwrap();
    let purged = store.purge_expired(c.now_ms() + 6_000).await.unwrap();
    assert!(c.get("skewed").await.is_ok(), "fence ahead of the clock: kept ({purged} purged)");
    // (Its release frees the key at its own clock's acquired_at, a minute ahead.)
    let next =
        blind(61_000).acquire("skewed", "h", Some(Duration::from_secs(1)), AcquireOptions::default()).await.unwrap();
    assert!(next.fence > f.fence);

    // A fail-closed lease carries no TTL and is never purged.
    let id = Some(leasehold::LeaseId::generate());
    let fc = c.acquire("forever", "h", None, AcquireOptions { lease_id: id, ..Default::default() }).await.unwrap();
    assert!(store.purge_expired(c.now_ms() + 10_000_000).await.unwrap() >= 1);
    for timed in ["p", "skewed"] {
        assert!(matches!(c.get(timed).await, Err(Error::NotFound { .. })), "{timed} is purged in the end");
    }
    assert_eq!(c.get("forever").await.unwrap().fence, fc.fence, "only the timed items go");
}

/// [`short_ttl_config`] with DONE a terminal state kept one second.
fn terminal_config() -> leasehold::Config {
    let mut c = short_ttl_config();
    c.terminal_states = vec!["DONE".into()];
    c.terminal_retention = Duration::from_secs(1);
    c
}

/// A key in a terminal state is deleted by TTL after its retention; a key in another state is
/// kept (DynamoDB Local's sweeper, on a table without indexes as above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamodb_ttl_deletes_keys_in_terminal_states_only() {
    let local = tokio::task::spawn_blocking(dynamo_local).await.unwrap();
    let store = leasehold::store::DynamoStore::new(local.client().await, "ttl-terminal");
    store.create_table_with(false).await.unwrap();
    let c = Coordinator::new(std::sync::Arc::new(store), terminal_config());
    c.put("finished", "DONE", "producer").await.unwrap();
    c.put("waiting", "PENDING", "producer").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        match c.get("finished").await {
            Err(Error::NotFound { .. }) => break,
            Ok(_) => {
                assert!(Instant::now() < deadline, "DynamoDB Local never swept the finished key");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
    let w = c.get("waiting").await.unwrap();
    assert_eq!(w.state.as_deref(), Some("PENDING"), "a key in a state that is not terminal is kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_purge_deletes_keys_in_terminal_states_only() {
    let dir = TempDir::new("purge-terminal");
    let store = SqliteStore::open(dir.path().join("l.db")).unwrap();
    let c = Coordinator::new(std::sync::Arc::new(store.clone()), terminal_config());
    c.put("finished", "DONE", "producer").await.unwrap();
    c.put("waiting", "PENDING", "producer").await.unwrap();
    assert_eq!(store.purge_expired(c.now_ms()).await.unwrap(), 0, "within its retention");
    // Past the retention and the fence lead (the grace is 0 here).
    assert_eq!(store.purge_expired(c.now_ms() + 5_000).await.unwrap(), 1);
    assert!(matches!(c.get("finished").await, Err(Error::NotFound { .. })));
    assert_eq!(c.get("waiting").await.unwrap().state.as_deref(), Some("PENDING"));
}
