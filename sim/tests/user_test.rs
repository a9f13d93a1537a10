//! The user's test shown in README.md ("Testing your code without DynamoDB"), kept compiling
//! and passing here.

use std::{sync::Arc, time::Duration};

use leasehold::testing::{Faults, SimClock, SimStore};
use leasehold::{AcquireOptions, Config, Coordinator, Error};

#[tokio::test(start_paused = true)] // virtual time: 30 s leases expire in microseconds
async fn a_second_worker_takes_over_after_the_first_one_stops() {
    let clock = Arc::new(SimClock::new(1_800_000_000_000));
    let store = SimStore::new(clock.clone(), Faults::none(), 42);
    let worker =
        |c: Arc<SimClock>| Coordinator::new(Arc::new(store.handle()), Config { clock: c, ..Config::default() });
    let a = worker(clock.clone());
    let b = worker(Arc::new(SimClock::offset_from(&clock, 80))); // its clock runs 80 ms ahead

    let lease = a.acquire("job", "a", Some(Duration::from_secs(30)), AcquireOptions::default()).await.unwrap();
    let held = b.acquire("job", "b", Some(Duration::from_secs(30)), AcquireOptions::default()).await;
    assert!(matches!(held, Err(Error::LeaseHeld { .. })));

    // `a` stops without releasing; `b` waits for the lease to expire and takes over.
    let wait = AcquireOptions { wait: Some(Duration::from_secs(60)), ..Default::default() };
    let next = b.acquire("job", "b", Some(Duration::from_secs(30)), wait).await.unwrap();
    assert!(next.fence > lease.fence);
    assert!(matches!(a.heartbeat("job", &lease.lease_id, None).await, Err(Error::NotHolder { .. })));

    // With faults: lost answers are retried with the same lease_id, and what may have landed
    // is named in the error.
    store.set_faults(Faults::all(0.2));
    match b.release("job", &next.lease_id).await {
        Ok(_) | Err(Error::OutcomeUnknown { .. } | Error::StoreUnavailable(_) | Error::Throttled(_)) => {}
        Err(e) => panic!("{e}"),
    }
}
