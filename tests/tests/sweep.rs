//! The keep-alive sweep against what a real account does and the local stores do not: an
//! eventually consistent index, and DescribeExecution failing. Both stores.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use leasehold::store::{Page, ScanKind, Store};
use leasehold::{AcquireOptions, Coordinator, Error, ExecutionState, Executions, Keepalive, Result};
use leasehold_tests::{both_backends, test_config, wrap, Backend, Intercept};

both_backends!(
    a_stale_index_entry_never_clears_a_renewed_lease,
    describe_failures_are_counted,
    slots_kept_alive_live_while_their_execution_runs_and_are_freed_once_it_ended,
    a_stale_index_entry_never_clears_a_semaphore_with_a_slot_kept_alive,
);

/// The keep-alive index as DynamoDB may serve it: a copy older than the item. Every entry
/// shows the expiry the lease had before its last renewal (here: already past).
struct StaleIndex {
    shown: AtomicUsize,
}

#[async_trait]
impl Intercept for StaleIndex {
    async fn scan(&self, store: &Arc<dyn Store>, kind: &ScanKind, start: Option<&str>, limit: u32) -> Result<Page> {
        let mut page = store.scan(kind, start, limit).await?;
        if matches!(kind, ScanKind::Keepalive { .. }) {
            for r in &mut page.items {
                r.expires_at_ms = Some(r.acquired_at_ms + 1);
                self.shown.fetch_add(1, Ordering::SeqCst);
            }
        }
        Ok(page)
    }
}

/// The index says the lease expired; the item was renewed meanwhile. The sweep skips the entry
/// but must not take the live lease out of the index (the clear is conditioned on the expiry
/// it read): a later sweep renews it again.
async fn a_stale_index_entry_never_clears_a_renewed_lease(b: Backend) {
    let stale = wrap(b.store(), StaleIndex { shown: AtomicUsize::new(0) });
    let c = Coordinator::new(stale.clone(), test_config());
    let ka = Keepalive { until_ms: c.now_ms() + 600_000, execution_arn: None };
    let l = c
        .acquire(
            "stale/k",
            "etl",
            Some(Duration::from_secs(60)),
            AcquireOptions { keepalive: Some(ka), ..Default::default() },
        )
        .await
        .unwrap();
    let report = c.keepalive_sweep(None, 100, Instant::now() + Duration::from_secs(60)).await;
    assert!(stale.shown.load(Ordering::SeqCst) >= 1, "{report:?}");
    assert_eq!((report.skipped, report.cleared, report.errors), (1, 0, 0), "{report:?}");
    let s = c.get("stale/k").await.unwrap();
    assert!(s.held && s.fence == l.fence, "{s:?}");
    assert!(s.keepalive.is_some(), "the live lease keeps its keep-alive: {s:?}");
    // A consistent read of the index renews it.
    let fresh = Coordinator::new(b.store(), test_config());
    let report = fresh.keepalive_sweep(None, 100, Instant::now() + Duration::from_secs(60)).await;
    assert_eq!(report.renewed, 1, "{report:?}");
}

/// DescribeExecution failing (throttled past its retries, AccessDenied).
struct Undescribable(AtomicUsize);

#[async_trait]
impl Executions for Undescribable {
    async fn state(&self, _execution_arn: &str) -> ExecutionState {
        self.0.fetch_add(1, Ordering::SeqCst);
        ExecutionState::Unknown
    }
}

/// A lease whose execution cannot be described is renewed (the holder may still run) and
/// counted in `describe_failures`, which the functions publish and the SweepFailing alarm
/// watches; leases without an execution are not counted.
async fn describe_failures_are_counted(b: Backend) {
    let c = b.coordinator(test_config());
    let until = c.now_ms() + 600_000;
    for (key, arn) in
        [("described/a", Some("arn:aws:states:us-east-1:123456789012:execution:m:a")), ("described/b", None)]
    {
        let ka = Keepalive { until_ms: until, execution_arn: arn.map(str::to_string) };
        let opts = AcquireOptions { keepalive: Some(ka), ..Default::default() };
        c.acquire(key, "etl", Some(Duration::from_secs(60)), opts).await.unwrap();
    }
    let ex = Arc::new(Undescribable(AtomicUsize::new(0)));
    let report = c.keepalive_sweep(Some(ex.clone()), 100, Instant::now() + Duration::from_secs(60)).await;
    assert_eq!(ex.0.load(Ordering::SeqCst), 1);
    assert_eq!((report.renewed, report.describe_failures, report.errors), (2, 1, 0), "{report:?}");
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["describe_failures"], 1, "in the sweep's answer: {json}");
}

/// Executions as the test sets them (RUNNING unless said otherwise), and how often each was
/// described.
#[derive(Default)]
struct Runs {
    ended: Mutex<Vec<String>>,
    described: Mutex<HashMap<String, usize>>,
}

#[async_trait]
impl Executions for Runs {
    async fn state(&self, arn: &str) -> ExecutionState {
        *self.described.lock().unwrap().entry(arn.to_string()).or_default() += 1;
        match self.ended.lock().unwrap().iter().any(|a| a == arn) {
            true => ExecutionState::Ended,
            false => ExecutionState::Running,
        }
    }
}

fn arn(name: &str) -> String {
    format!("arn:aws:states:us-east-1:123456789012:execution:concurrency-limited:{name}")
}

fn slot(c: &Coordinator, execution: Option<&str>) -> AcquireOptions {
    let keepalive = execution.map(|e| Keepalive { until_ms: c.now_ms() + 600_000, execution_arn: Some(arn(e)) });
    AcquireOptions { slots: Some(3), keepalive, ..Default::default() }
}

/// The expiry of `holder`'s slot of `key`, as `get` shows it.
async fn expiry(c: &Coordinator, key: &str, holder: &str) -> Option<u64> {
    let s = c.get(key).await.unwrap();
    s.holders.iter().find(|x| x.holder == holder).map(|x| x.expires_at_ms)
}

/// A slot taken with a keep-alive bound to an execution is renewed by the sweep while the
/// execution runs and released once it has ended, one slot at a time; a slot without one is
/// left alone; once no slot is kept alive the semaphore leaves the index.
async fn slots_kept_alive_live_while_their_execution_runs_and_are_freed_once_it_ended(b: Backend) {
    let c = b.coordinator(test_config());
    let (k, d) = ("sem/kept", Some(Duration::from_secs(60)));
    let a = c.acquire(k, "run-a/0", d, slot(&c, Some("run-a"))).await.unwrap();
    assert_eq!(a.keepalive.as_ref().and_then(|k| k.execution_arn.clone()), Some(arn("run-a")), "{a:?}");
    let _b = c.acquire(k, "run-b/0", d, slot(&c, Some("run-b"))).await.unwrap();
    let plain = c.acquire(k, "plain", d, slot(&c, None)).await.unwrap();
    let full = c.acquire(k, "late", d, slot(&c, None)).await;
    assert!(matches!(full, Err(Error::LeaseHeld { .. })), "{full:?}");
    let s = c.get(k).await.unwrap();
    let shown: Vec<_> = s.holders.iter().map(|h| (h.holder.as_str(), h.keepalive.is_some())).collect();
    assert_eq!(shown, [("run-a/0", true), ("run-b/0", true), ("plain", false)], "get shows who is kept alive");
    let before = (expiry(&c, k, "run-a/0").await, expiry(&c, k, "plain").await);
    tokio::time::sleep(Duration::from_millis(20)).await;

    let runs = Arc::new(Runs::default());
    let ex: Arc<dyn Executions> = runs.clone();
    let deadline = || Instant::now() + Duration::from_secs(60);
    let report = c.keepalive_sweep(Some(ex.clone()), 100, deadline()).await;
    assert_eq!((report.renewed, report.released, report.errors, report.skipped), (2, 0, 0, 0), "{report:?}");
    assert!(expiry(&c, k, "run-a/0").await > before.0, "the kept slot was renewed");
    assert_eq!(expiry(&c, k, "plain").await, before.1, "the slot without keep-alive was left alone");

    // run-b stopped (StopExecution, a timeout, a failure): its slot is freed at the next sweep,
    // and a waiter elsewhere takes it.
    runs.ended.lock().unwrap().push(arn("run-b"));
    let report = c.keepalive_sweep(Some(ex.clone()), 100, deadline()).await;
    assert_eq!((report.renewed, report.released, report.errors), (1, 1, 0), "{report:?}");
    let other = Coordinator::new(b.store(), test_config());
    let late = other.acquire(k, "late", d, slot(&other, None)).await.expect("the stopped execution's slot");
    let r = c.heartbeat(k, &a.lease_id, None).await;
    assert!(r.is_ok(), "run-a still holds its slot: {r:?}");

    // run-a ended too: released; then nothing is kept alive and the item leaves the index.
    runs.ended.lock().unwrap().push(arn("run-a"));
    let report = c.keepalive_sweep(Some(ex.clone()), 100, deadline()).await;
    assert_eq!((report.renewed, report.released), (0, 1), "{report:?}");
    let r = c.heartbeat(k, &a.lease_id, None).await;
    assert!(matches!(r, Err(Error::NotHolder { .. })), "run-a's slot was released: {r:?}");
    let report = c.keepalive_sweep(Some(ex.clone()), 100, deadline()).await;
    assert_eq!((report.scanned, report.skipped, report.cleared), (1, 1, 1), "{report:?}");
    let report = c.keepalive_sweep(Some(ex), 100, deadline()).await;
    assert_eq!(report.scanned, 0, "out of the index: {report:?}");
    let described = runs.described.lock().unwrap().clone();
    assert_eq!((described[&arn("run-a")], described[&arn("run-b")]), (3, 2), "one description per slot and sweep");
    for l in [plain, late] {
        c.release(k, &l.lease_id).await.unwrap();
    }
}

/// The index as DynamoDB may serve it: a copy of the semaphore from before a slot kept alive
/// was taken (no such slot, the revision before).
struct StaleSemaphore;

#[async_trait]
impl Intercept for StaleSemaphore {
    async fn scan(&self, store: &Arc<dyn Store>, kind: &ScanKind, start: Option<&str>, limit: u32) -> Result<Page> {
        let mut page = store.scan(kind, start, limit).await?;
        if matches!(kind, ScanKind::Keepalive { .. }) {
            for r in &mut page.items {
                r.semaphore.slot_holders.retain(|h| h.keepalive.is_none());
                r.semaphore.slots_rev = r.semaphore.slots_rev.map(|v| v - 1);
            }
        }
        Ok(page)
    }
}

/// The sweep judges "no slot kept alive any more" from the index's copy; the clear is
/// conditioned on the revision it read, so a slot taken since keeps the item in the index, and a
/// consistent read renews it. Once nothing is kept alive, a copy behind the item still clears.
async fn a_stale_index_entry_never_clears_a_semaphore_with_a_slot_kept_alive(b: Backend) {
    let stale = wrap(b.store(), StaleSemaphore);
    let c = Coordinator::new(stale, test_config());
    let k = "sem/stale";
    let l = c.acquire(k, "run-c/0", Some(Duration::from_secs(60)), slot(&c, Some("run-c"))).await.unwrap();
    let report = c.keepalive_sweep(None, 100, Instant::now() + Duration::from_secs(60)).await;
    assert_eq!((report.skipped, report.cleared, report.errors), (1, 0, 0), "{report:?}");
    let fresh = Coordinator::new(b.store(), test_config());
    let runs: Arc<dyn Executions> = Arc::new(Runs::default());
    let report = fresh.keepalive_sweep(Some(runs), 100, Instant::now() + Duration::from_secs(60)).await;
    assert_eq!(report.renewed, 1, "{report:?}");
    // Released: nothing kept alive. The copy's revision is still behind the item's (as for a
    // semaphore written more often than the index catches up); the clear refused at it is sent
    // again at the revision of the item that refused it.
    c.release(k, &l.lease_id).await.unwrap();
    let report = c.keepalive_sweep(None, 100, Instant::now() + Duration::from_secs(60)).await;
    assert_eq!((report.skipped, report.cleared, report.errors), (1, 1, 0), "{report:?}");
    let report = fresh.keepalive_sweep(None, 100, Instant::now() + Duration::from_secs(60)).await;
    assert_eq!(report.scanned, 0, "out of the index: {report:?}");
}
