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

/// A clock 60 s ahead is refused by its own check, unless its store answers carry `Date`
/// stamps wrong by as much (`handle_with_date_offset`): then the check sees nothing, it judges
/// the other lease expired and takes the key, and only the fence tells the two apart.
#[tokio::test(start_paused = true)]
async fn a_clock_error_the_date_stamps_share_passes_the_check_and_only_the_fence_remains() {
    let truth = Arc::new(SimClock::new(1_800_000_000_000));
    let store = SimStore::new(truth.clone(), Faults::none(), 7);
    let honest = Coordinator::new(Arc::new(store.handle()), Config { clock: truth.clone(), ..Config::default() });
    let ahead = || Arc::new(SimClock::offset_from(&truth, 60_000));
    let checked = Coordinator::new(Arc::new(store.handle()), Config { clock: ahead(), ..Config::default() });
    let blind = Coordinator::new(
        Arc::new(store.handle_with_date_offset(60_000)),
        Config { clock: ahead(), ..Config::default() },
    );

    let held = honest.acquire("job", "honest", Some(Duration::from_secs(30)), AcquireOptions::default()).await.unwrap();
    // Evidence first (a read), as a running process has it.
    let _ = checked.get("job").await;
    let _ = blind.get("job").await;
    let refused = checked.acquire("job", "checked", Some(Duration::from_secs(30)), AcquireOptions::default()).await;
    assert!(matches!(refused, Err(Error::ClockSkew(_))), "{refused:?}");
    let taken = blind.acquire("job", "blind", Some(Duration::from_secs(30)), AcquireOptions::default()).await.unwrap();
    assert!(taken.fence > held.fence, "the fence still grows");
    assert!(taken.fence >= 1_800_000_060_000_000, "issued from the clock ahead: {}", taken.fence);
}
