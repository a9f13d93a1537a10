//! The clients: sessions of every kind, and the acquire, hold and release they share.

use std::sync::Arc;
use std::time::Duration;

use leasehold::{AcquireOptions, Coordinator, Error, Lease, LeaseId, NotHolderReason};

use crate::violation::Violation;
use crate::world::{draw, ended, lock, now, op, told, write_resource, Event, Node, Shared};
use crate::ATTEMPT_TIMEOUT;

mod batch;
mod fail_closed;
mod held;
mod keepalive;
mod plain;
mod queued;
mod semaphore;

pub(crate) use semaphore::SEMAPHORES;

/// One client: sessions of every kind until the run has made its operations.
pub(crate) async fn client(node: Arc<Node>, world: Shared, n: usize) {
    let name = format!("{}/{n}", node.name);
    // Orphans of a crashed process are released first (their ids were kept).
    if !node.rogue {
        let orphans = std::mem::take(&mut lock(&world).orphans);
        // This client's own until released: a crash meanwhile hands them on again.
        {
            let mut w = lock(&world);
            let own = w.fail_closed.entry(name.clone()).or_default();
            own.extend(orphans.iter().map(|(k, id)| (k.clone(), id.expose().to_string())));
        }
        for (k, id) in orphans {
            let done = release_until_done(&node.coord, &k, &id).await;
            let mut w = lock(&world);
            if let Some(own) = w.fail_closed.get_mut(&name) {
                own.remove(&(k.clone(), id.expose().to_string()));
            }
            // Released now, and again at the end: an attempt the crashed process had in flight
            // may land after this release found nothing (DESIGN.md, "acquire": the limit that
            // remains), so the id is kept, as a process keeps a fail-closed lease_id until it
            // knows no attempt of it can land.
            if done {
                w.released_orphans.push((k, id));
            } else {
                w.orphans.push((k, id));
            }
        }
    }
    loop {
        if lock(&world).stop {
            return;
        }
        let kind = draw(&world, |w| w.below(100));
        if lock(&world).hot_key && kind < 20 {
            // With semaphores, they loop on a semaphore's slot instead.
            if lock(&world).semaphores {
                semaphore::hot(&node, &world, &name).await;
            } else {
                plain::hot(&node, &world, &name).await;
            }
            continue;
        }
        if lock(&world).held_leases && kind < 10 {
            held::held(&node, &world, &name).await;
            continue;
        }
        if lock(&world).semaphores && kind < 20 {
            semaphore::semaphore(&node, &world, &name).await;
            continue;
        }
        match kind {
            0..=39 => plain::plain(&node, &world, &name).await,
            40..=49 => fail_closed::fail_closed(&node, &world, &name).await,
            50..=62 => keepalive::keepalive(&node, &world, &name).await,
            63..=74 => queued::queued(&node, &world, &name).await,
            _ => batch::batch(&node, &world, &name).await,
        }
        let idle = draw(&world, |w| w.between(0, 300));
        tokio::time::sleep(Duration::from_millis(idle)).await;
    }
}

/// Acquire with an optional wait; checks that the acquire ends by its deadline.
/// How often a session's acquire is cancelled by its caller.
const CANCEL_CHANCE: f64 = 0.03;

pub(crate) async fn acquire(
    node: &Node,
    world: &Shared,
    k: &str,
    name: &str,
    duration: Option<Duration>,
    mut opts: AcquireOptions,
) -> Result<Lease, Error> {
    let start = now();
    let deadline = start + opts.wait.unwrap_or_default().max(Duration::from_secs(2));
    opts.deadline = Some(deadline);
    // A fail-closed acquire's own lease: whether the item holds it (it never expires).
    let own = opts.lease_id.clone().filter(|_| duration.is_none());
    let holds_own = |id: &LeaseId| {
        node.store
            .peek(k)
            .is_some_and(|r| &r.lease_id == id && r.released_at_ms.is_none() && r.semaphore.slots.is_none())
    };
    let held_before = own.as_ref().is_some_and(holds_own);
    let opts_waited = opts.wait.is_some_and(|w| !w.is_zero());
    let shape = match (opts.slots.is_some(), opts.keepalive.is_some(), duration.is_none()) {
        (true, true, _) => "slot_kept_alive",
        (true, false, _) if opts.lease_id.is_some() => "slot_own_id",
        (true, false, _) => "slot",
        (false, true, _) => "kept_alive",
        (false, false, true) => "fail_closed",
        (false, false, false) => "plain",
    };
    // Now and then the caller gives up on the acquire at a random instant (a request's own
    // timeout, a Lambda out of time, a dropped task): the future is dropped at whatever await
    // it is in. Nothing it may have taken is believed; the key must stay safe and usable.
    let cancel_after = draw(world, |w| w.chance(CANCEL_CHANCE).then(|| w.between(1, 2500)));
    let r = match cancel_after {
        None => node.coord.acquire(k, name, duration, opts).await,
        Some(ms) => {
            match tokio::time::timeout(Duration::from_millis(ms), node.coord.acquire(k, name, duration, opts)).await {
                Ok(r) => r,
                Err(_) => {
                    lock(world).fault("acquire_cancelled");
                    return Err(Error::StoreUnavailable(format!("{name} cancelled its acquire after {ms} ms")));
                }
            }
        }
    };
    let end = now();
    if r.is_ok() {
        *lock(world).granted.entry(shape).or_default() += 1;
    }
    if let Some(id) = &own {
        answered_by_own_lease(world, k, name, id, &r, held_before && holds_own(id), holds_own(id));
    }
    // A request already sent is bounded by the attempt timeout.
    if end > deadline + ATTEMPT_TIMEOUT + Duration::from_millis(1) {
        let late = end.duration_since(deadline).as_millis();
        lock(world).violations.push(Violation::new(
            "wait_past_deadline",
            k,
            format!("{name}'s acquire ended {late} ms after its deadline"),
        ));
    }
    if matches!(r, Err(Error::LeaseHeld { .. })) && opts_waited {
        let coordinator = node.coord.id().to_string();
        lock(world).events.push(Event::WaitedInVain { key: k.to_string(), coordinator, start, end });
    }
    if shape.starts_with("slot") && opts_waited {
        let (key, client) = (k.to_string(), name.to_string());
        lock(world).events.push(Event::SlotWaited { key, client, start, end });
    }
    if let Ok(l) = &r {
        if node.rogue {
            lock(world).violations.push(Violation::new(
                "skewed_clock_granted",
                k,
                format!("{name}, whose clock is beyond the skew margin, was granted fence {}", l.fence),
            ));
        }
        told(world, name, l);
    }
    r
}

/// What a fail-closed acquire with the caller's lease_id is answered must match what became
/// of that lease: `LeaseHeld` never while its own lease held the key from before the call
/// until the answer (every attempt was evaluated on it: the answer is the lease);
/// `NotHolder` only for a lease that ended (released, expired), never `wrong_lease_id` (a
/// lease_id that never held the key has nothing that ended) and never while its lease holds
/// the key.
pub(crate) fn answered_by_own_lease(
    world: &Shared,
    k: &str,
    name: &str,
    id: &LeaseId,
    r: &Result<Lease, Error>,
    held_throughout: bool,
    held_at_answer: bool,
) {
    let wrong = match r {
        Err(Error::LeaseHeld { .. }) if held_throughout => Some("its own lease held the key: LeaseHeld"),
        Err(Error::NotHolder { reason: NotHolderReason::WrongLeaseId, .. }) => {
            Some("NotHolder (wrong_lease_id) for a lease_id whose lease never ended")
        }
        Err(Error::NotHolder { .. }) if held_at_answer => Some("its lease holds the key: NotHolder"),
        _ => None,
    };
    if let Some(what) = wrong {
        lock(world).violations.push(Violation::new(
            "wrong_answer_to_own_lease_id",
            k,
            format!("{name}'s fail-closed acquire with lease {}: {what}", &id.expose()[..id.expose().len().min(12)]),
        ));
    }
}

/// An acquire that failed ambiguously: the lease that may have landed is released with the id
/// the error names (one call more).
pub(crate) async fn release_unknown(node: &Node, world: &Shared, k: &str, e: &Error) {
    if let Some((_, id)) = e.unknown_leases().into_iter().next() {
        if op(world) {
            let _ = node.coord.release(k, &LeaseId::from_string(id)).await;
        }
    }
}

/// Holds `lease`: writes, heartbeats, maybe a pause; then releases (into `to` for a work item).
pub(crate) async fn hold(node: &Node, world: &Shared, name: &str, mut lease: Lease, to: Option<String>) {
    let k = lease.key.clone();
    let steps = draw(world, |w| w.between(1, 5));
    for _ in 0..steps {
        let pause = draw(world, |w| w.chance(0.03));
        if pause {
            // Frozen past the lease (a GC pause), then resuming its writes as if nothing happened.
            lock(world).fault("pause");
            let past = draw(world, |w| w.between(100, 4000));
            let until = lease.safe_until.unwrap_or_else(now);
            tokio::time::sleep_until((until.max(now()) + Duration::from_millis(past)).into()).await;
            write_resource(world, &k, &lease, false);
        } else {
            let left = lease.safe_until.map_or(500, |s| s.saturating_duration_since(now()).as_millis() as u64);
            let work = draw(world, |w| w.between(0, left / 2));
            tokio::time::sleep(Duration::from_millis(work)).await;
            if lease.safe_until.is_none_or(|s| now() < s) {
                write_resource(world, &k, &lease, true);
            } else {
                break;
            }
        }
        if lease.safe_until.is_none() {
            continue;
        }
        if !op(world) {
            break;
        }
        let d = draw(world, |w| w.chance(0.5).then(|| Duration::from_millis(w.between(300, 3000))));
        match node.coord.heartbeat(&k, &lease.lease_id, d).await {
            Ok(l) => {
                told(world, name, &l);
                lease = l;
            }
            Err(Error::NotHolder { .. }) => {
                ended(world, name, &k, &lease.lease_id);
                return;
            }
            Err(_) => {
                if lease.safe_until.is_some_and(|s| now() >= s) {
                    break;
                }
            }
        }
    }
    ended(world, name, &k, &lease.lease_id);
    op(world);
    let sent = now();
    let r = node.coord.release_to(&k, &lease.lease_id, to.as_deref()).await;
    // A release sent while the lease was live (its safe time) finds it ours, released by an
    // earlier try of its own (`already_released`), or handed on: never `NotHolder`, unless an
    // operator evicted it (the checker allows for that).
    if matches!(r, Err(Error::NotHolder { .. })) && lease.safe_until.is_some_and(|s| sent < s) {
        let (key, id) = (k.clone(), lease.lease_id.expose().to_string());
        lock(world).events.push(Event::ReleaseRefused { key, lease: id, at: now() });
    }
    // (The release after an unknown outcome is awaited in its own arm.)
    #[allow(clippy::collapsible_match)]
    match (r, to) {
        (Ok(rel), Some(to)) if !rel.already_released && rel.state.as_deref() == Some(to.as_str()) => {
            let at = now();
            lock(world).events.push(Event::Finished { key: k, lease: lease.lease_id.expose().to_string(), at });
        }
        (Err(e), _) if e.is_transient() && lease.safe_until.is_none() => {
            if !release_until_done(&node.coord, &k, &lease.lease_id).await {
                lock(world).orphans.push((k, lease.lease_id.clone()));
            }
        }
        _ => {}
    }
}

/// Releases until the answer is definite; false if it never was.
pub(crate) async fn release_until_done(coord: &Coordinator, k: &str, id: &LeaseId) -> bool {
    for _ in 0..20 {
        match coord.release(k, id).await {
            Ok(_) | Err(Error::NotHolder { .. } | Error::NotFound { .. }) => return true,
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
    false
}
