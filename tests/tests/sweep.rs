//! The keep-alive sweep against what a real account does and the local stores do not: an
//! eventually consistent index, and DescribeExecution failing. Both stores.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use leasehold::store::{Page, ScanKind, Store};
use leasehold::{AcquireOptions, Coordinator, ExecutionState, Executions, Keepalive, Result};
use leasehold_tests::{both_backends, test_config, wrap, Backend, Intercept};

both_backends!(a_stale_index_entry_never_clears_a_renewed_lease, describe_failures_are_counted);

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
