//! Faults between the DynamoDB store and DynamoDB Local, injected by the proxy (so the real
//! SDK error paths run), and DynamoDB Local restarted mid-run with its data on disk.

use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold::store::DynamoStore;
use leasehold::{AcquireOptions, Coordinator, Error, Lost};
use leasehold_tests::proxy::{Proxy, ProxyFault};
use leasehold_tests::{
    dynamo_local, free_port, proxied_table, sdk_config_for, test_config, DynamoLocal, SchedLag, TempDir,
};

async fn through_proxy() -> (Arc<Proxy>, Coordinator, Coordinator) {
    let (proxy, table, conf) = proxied_table().await;
    let local = dynamo_local();
    let mut cfg = test_config();
    cfg.retry_budget = Duration::from_millis(800);
    let faulty = Coordinator::new(Arc::new(DynamoStore::new(aws_sdk_dynamodb::Client::new(&conf), table.clone())), cfg);
    let direct = Coordinator::new(Arc::new(DynamoStore::new(local.client().await, table)), test_config());
    (proxy, faulty, direct)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_faults_are_classified_and_retried() {
    let (proxy, c, direct) = through_proxy().await;
    let d = Some(Duration::from_secs(30));
    // A few throttles and 5xx answers are retried away.
    proxy.inject(&[ProxyFault::Throttle, ProxyFault::ServerError, ProxyFault::Reset]);
    let l = c.acquire("p1", "h", d, AcquireOptions::default()).await.unwrap();
    assert_eq!(proxy.injected(), 3);
    // Persistent throttling ends as Throttled, persistent 5xx as OutcomeUnknown (DynamoDB may
    // have applied a write it answered 500), both within the retry budget.
    proxy.inject(&[ProxyFault::Throttle; 200]);
    let t = Instant::now();
    let r = c.heartbeat("p1", &l.lease_id, None).await;
    assert!(matches!(r, Err(Error::Throttled(_))), "{r:?}");
    // Bounded by the 800 ms budget (200 throttles would take far longer), with room for a
    // loaded machine.
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    proxy.clear_faults();
    proxy.inject(&[ProxyFault::ServerError; 200]);
    let r = c.heartbeat("p1", &l.lease_id, None).await;
    assert!(matches!(r, Err(Error::OutcomeUnknown { .. })), "{r:?}");
    proxy.clear_faults();
    // The lease is intact.
    assert_eq!(direct.get("p1").await.unwrap().fence, l.fence);

    // A response dropped after DynamoDB applied the acquire: the retry finds the same lease.
    proxy.inject_on("PutItem", &[ProxyFault::DropResponse]);
    let l2 = c.acquire("p2", "h", d, AcquireOptions::default()).await.unwrap();
    assert_eq!(direct.get("p2").await.unwrap().fence, l2.fence, "one grant, one fence");
    // Dropped release answer: the retry succeeds, nothing stranded.
    proxy.inject(&[ProxyFault::DropResponse]);
    c.release("p2", &l2.lease_id).await.unwrap();
    assert!(!direct.get("p2").await.unwrap().held);

    // Added latency is absorbed.
    proxy.inject(&[ProxyFault::Delay(Duration::from_millis(200))]);
    let l3 = c.acquire("p3", "h", d, AcquireOptions::default()).await.unwrap();
    assert_eq!(direct.get("p3").await.unwrap().fence, l3.fence);

    // A stall longer than the client's 3 s attempt timeout: the caller is told the outcome is
    // unknown, the stalled write lands afterwards, and a retry with the same lease_id gets
    // that lease.
    let id = leasehold::LeaseId::generate();
    let with_id = || AcquireOptions { lease_id: Some(id.clone()), ..Default::default() };
    proxy.inject_on("PutItem", &[ProxyFault::Stall(Duration::from_millis(3500))]);
    let r = c.acquire("p4", "h", d, with_id()).await;
    assert!(matches!(r, Err(Error::OutcomeUnknown { .. })), "{r:?}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !matches!(direct.get("p4").await, Ok(ref s) if s.held) {
        assert!(Instant::now() < deadline, "the stalled write never landed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let fence = direct.get("p4").await.unwrap().fence;
    let again = c.acquire("p4", "h", d, with_id()).await.unwrap();
    assert_eq!(again.fence, fence, "the retry found the landed write: no second fence");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_failing_until_safe_time_are_reported() {
    let (proxy, c, direct) = through_proxy().await;
    // 4 s: a new process's safe margin is about 1.25 s on DynamoDB Local (DESIGN.md, "Clocks"),
    // and a loaded machine can answer a grant later than a shorter lease's safe time.
    let held = c.hold("r1", "h", Duration::from_secs(4), AcquireOptions::default()).await.unwrap();
    let fence = held.fence();
    let lag = SchedLag::start();
    let safe = held.safe_until().unwrap();
    proxy.inject(&[ProxyFault::Reset; 10_000]);
    let lost = held.lost().await;
    assert_eq!(lost, Lost::SafeTimeExpired);
    // Told when its timer at the safe time fires: late by the scheduling delay measured
    // meanwhile, and 100 ms more for a renewal attempt that was already on its way.
    assert!(
        Instant::now() <= safe + Duration::from_millis(100) + lag.max(),
        "told {:?} after the safe time (lag {:?})",
        Instant::now() - safe,
        lag.max()
    );
    proxy.clear_faults();
    // The key is still the lost lease's: nothing the failed renewals or the release after the
    // loss sent gave it to anyone else, or moved its fence.
    let s = direct.get("r1").await.unwrap();
    assert_eq!((s.holder.as_str(), s.fence), ("h", fence), "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamodb_local_restart_keeps_leases() {
    let dir = TempDir::new("ddb-data");
    let port = free_port();
    let path = dir.path().to_path_buf();
    let first = tokio::task::spawn_blocking(move || DynamoLocal::start_on(port, Some(&path))).await.unwrap();
    let store = first.store().await;
    let table = store.table().to_string();
    let conf = sdk_config_for(&first.endpoint).await;
    let mut cfg = test_config();
    cfg.retry_budget = Duration::from_millis(500);
    let c = Coordinator::new(Arc::new(DynamoStore::new(aws_sdk_dynamodb::Client::new(&conf), table.clone())), cfg);
    let long = c.hold("survivor", "h", Duration::from_secs(60), AcquireOptions::default()).await.unwrap();
    let plain = c.acquire("plain", "h", Some(Duration::from_secs(60)), AcquireOptions::default()).await.unwrap();

    // Outage: every operation fails fast with a typed error, and changes nothing. Nothing
    // could connect, so nothing can have landed: StoreUnavailable, not OutcomeUnknown.
    tokio::task::spawn_blocking(move || drop(first)).await.unwrap();
    let t = Instant::now();
    let r = c.acquire("plain", "other", Some(Duration::from_secs(5)), AcquireOptions::default()).await;
    assert!(matches!(r, Err(Error::StoreUnavailable(_))), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(5), "bounded by the retry budget: {:?}", t.elapsed());
    assert!(matches!(c.get("plain").await, Err(Error::StoreUnavailable(_))));

    // Restart on the same port with the same data directory.
    let path = dir.path().to_path_buf();
    let _second = tokio::task::spawn_blocking(move || DynamoLocal::start_on(port, Some(&path))).await.unwrap();
    let s = c.get("plain").await.unwrap();
    assert!(s.held);
    assert_eq!(s.fence, plain.fence);
    assert!(!long.is_lost(), "a 60 s lease survives an outage shorter than its safe time");
    let renewed = c.heartbeat("survivor", &long.lease().unwrap().lease_id, None).await.unwrap();
    assert_eq!(renewed.fence, long.fence());
    c.release("plain", &plain.lease_id).await.unwrap();
    let next = c.acquire("plain", "other", Some(Duration::from_secs(5)), AcquireOptions::default()).await.unwrap();
    assert!(next.fence > plain.fence, "{} after {}", next.fence, plain.fence);
    long.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_answered_after_its_safe_time_is_not_handed_out() {
    let (proxy, c, direct) = through_proxy().await;
    let mut cfg = test_config();
    cfg.retry_budget = Duration::from_secs(8);
    let patient = Coordinator::new(c.store().clone(), cfg);
    // The acquire's request is held 2.5 s, longer than the 2 s lease it asks for: when the
    // answer arrives, that lease is already past its safe time (the safety run found this).
    // (2 s: well over the widest safe margin a new coordinator counts on DynamoDB Local, about
    // 1.25 s, so that the fresh grant after it is safe even on a loaded machine.)
    // (The stall waits for the acquire's write: a coordinator's first requests are reads for
    // its clock check.)
    proxy.reset_counts();
    proxy.inject_on("PutItem", &[ProxyFault::Stall(Duration::from_millis(2500))]);
    let l = patient.acquire("late", "h", Some(Duration::from_secs(2)), AcquireOptions::default()).await.unwrap();
    assert!(l.safe_until.unwrap() > Instant::now(), "a lease handed out must still be safe to use");
    assert_eq!(proxy.counts().get("PutItem"), Some(&2), "the stale grant was followed by a fresh one");
    assert_eq!(direct.get("late").await.unwrap().fence, l.fence);
    // Without time left to try again, the caller gets a typed error instead of a dead lease:
    // a coordinator whose retry budget (1 s) is spent by the time the stalled answer (1.5 s)
    // arrives. (With time left, whether a fresh 1 s grant is safe depends on how wide the
    // coordinator's margin is on this machine: not what this checks.)
    let mut cfg = test_config();
    cfg.retry_budget = Duration::from_secs(1);
    let hasty = Coordinator::new(c.store().clone(), cfg);
    proxy.inject_on("PutItem", &[ProxyFault::Stall(Duration::from_millis(1500))]);
    let r = hasty.acquire("late2", "h", Some(Duration::from_secs(1)), AcquireOptions::default()).await;
    assert!(matches!(r, Err(Error::StoreUnavailable(_))), "{r:?}");
    // The late grant is given back in the background once the deadline has come: released,
    // not left to expire.
    let t = Instant::now();
    let s = loop {
        let s = direct.get("late2").await.unwrap();
        if s.released_at_ms.is_some() || t.elapsed() > Duration::from_secs(10) {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(!s.held && s.released_at_ms.is_some(), "the late grant was given back: {s:?}");
}
