//! A run's history as read back: the lines shown around a violation, and its hash.

use leasehold::store::LeaseMutation;
use leasehold::store::QueueMutation;
use leasehold::store::SemaphoreMutation;
use std::time::Instant;

use leasehold::store::Mutation;
use leasehold::testing::Applied;

use super::{ms, short};
use crate::world::Event;

/// A task token as the history shows it: the retry it belongs to (the simulated tokens end in
/// `-<attempt>` after the first).
pub(super) fn short_token(t: &str) -> String {
    match t.rsplit_once('-') {
        Some((_, n)) if n.len() <= 2 => format!("#{n}"),
        _ => "#0".to_string(),
    }
}

/// The history lines of `key` (client events and store writes), in time order.
pub(crate) fn history(
    events: &[Event],
    log: &[Applied],
    t0: Instant,
    key: &str,
    until: Option<Instant>,
    last: usize,
) -> Vec<String> {
    let mut lines: Vec<(u64, usize, String)> = Vec::new();
    for (i, e) in events.iter().enumerate() {
        if let Some((at, line)) = event_line(e, key, t0) {
            lines.push((at, i, line));
        }
    }
    // The key's writes, and its queue's waiter items (`<key>` U+001F `q<seq>`).
    let waiter = |k: &str| k.strip_prefix(key).is_some_and(|rest| rest.starts_with(leasehold::queue::SEPARATOR));
    for (i, a) in log.iter().enumerate().filter(|(_, a)| a.key == key || waiter(&a.key)) {
        lines.push((ms(t0, a.at), events.len() + i, store_line(a, key)));
    }
    lines.sort_by_key(|l| (l.0, l.1));
    if let Some(u) = until {
        let end = ms(t0, u) + 50;
        lines.retain(|l| l.0 <= end);
    }
    let skip = lines.len().saturating_sub(last);
    lines.into_iter().skip(skip).map(|(t, _, s)| format!("{t:>9} ms  {s}")).collect()
}

/// The history line of a client event on `key` (clock jumps on every key): when, and what.
fn event_line(e: &Event, key: &str, t0: Instant) -> Option<(u64, String)> {
    Some(match e {
        Event::Told { key: k, lease, fence, at, until, client, .. } if k == key => (
            ms(t0, *at),
            format!(
                "{client} told: lease {} fence {fence} safe until {}",
                short(lease),
                until.map_or("released".into(), |u| format!("{} ms", ms(t0, u)))
            ),
        ),
        Event::End { key: k, lease, at } if k == key => (ms(t0, *at), format!("lease {} ends", short(lease))),
        Event::Force { key: k, at } if k == key => (ms(t0, *at), "operator force-release".to_string()),
        Event::ClockJump { node, by_ms, at } => (ms(t0, *at), format!("{node}'s clock is stepped by {by_ms} ms")),
        Event::Wrote { key: k, lease, fence, at, accepted, believed } if k == key => (
            ms(t0, *at),
            format!(
                "lease {} writes with fence {fence} ({}): {}",
                short(lease),
                if *believed { "within its safe time" } else { "after a pause" },
                if *accepted { "accepted" } else { "refused" }
            ),
        ),
        Event::Finished { key: k, lease, at } if k == key => {
            (ms(t0, *at), format!("lease {} released into the final state", short(lease)))
        }
        Event::ReleaseRefused { key: k, lease, at } if k == key => {
            (ms(t0, *at), format!("lease {} release answered NotHolder", short(lease)))
        }
        Event::WaitedInVain { key: k, coordinator, start, end } if k == key => (
            ms(t0, *end),
            format!("an acquire of {} waiting since {} ms answered LeaseHeld", short(coordinator), ms(t0, *start)),
        ),
        _ => return None,
    })
}

/// The history line of a write the store applied to `key` or one of its waiter items.
fn store_line(a: &Applied, key: &str) -> String {
    let what = match (&a.mutation, a.ttl) {
        (_, true) => "TTL deletion".to_string(),
        (None, _) => "delete".to_string(),
        (Some(m), _) => describe(m),
    };
    let what = if a.key == key { what } else { format!("{what} of waiter {}", &a.key[key.len() + 1..]) };
    let new = a.new.as_ref().map_or(String::new(), |r| {
        let queue = match (r.queue.queue_head, r.queue.queue_tail) {
            (Some(h), Some(t)) => format!(" queue {}..{}", h % 10_000, t % 10_000),
            _ => String::new(),
        };
        let mark = match (&r.queue.pending_token, &r.queue.waiter) {
            (Some(t), _) => format!(" undelivered to {}", short_token(t)),
            (None, Some(w)) => format!(" token {}", short_token(&w.task_token)),
            _ => String::new(),
        };
        format!(" -> lease {} fence {} expires {:?}{queue}{mark}", short(r.lease_id.expose()), r.fence, r.expires_at_ms)
    });
    format!("store applies {what}{new}")
}

pub(super) fn describe(m: &Mutation) -> String {
    match m {
        Mutation::Lease(LeaseMutation::Acquire(n)) if n.handed_in.is_some() => {
            format!("Acquire (handed over within {})", short(n.handed_in.as_deref().unwrap_or_default()))
        }
        Mutation::Queue(QueueMutation::WaitsIn { coordinator }) => format!("WaitsIn (by {})", short(coordinator)),
        Mutation::Semaphore(SemaphoreMutation::TakeSlot { slot, .. }) => {
            format!("TakeSlot of {}", short(slot.lease_id.expose()))
        }
        Mutation::Semaphore(SemaphoreMutation::RenewSlot { lease_id, .. }) => {
            format!("RenewSlot of {}", short(lease_id.expose()))
        }
        Mutation::Semaphore(SemaphoreMutation::ReleaseSlot { lease_id, .. }) => {
            format!("ReleaseSlot of {}", short(lease_id.expose()))
        }
        Mutation::Semaphore(SemaphoreMutation::TidySlots { ended, .. }) => {
            format!("TidySlots of {}", ended.iter().map(|l| short(l.expose())).collect::<Vec<_>>().join(", "))
        }
        _ => {
            let s = format!("{m:?}");
            s.split([' ', '(', '{']).next().unwrap_or("").to_string()
        }
    }
}

/// FNV-1a over the run's history: what clients were told and did, and every applied write.
pub(crate) fn trace_hash(events: &[Event], log: &[Applied], t0: Instant) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= *b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    let us = |t: Instant| t.saturating_duration_since(t0).as_micros() as u64;
    for e in events {
        match e {
            Event::Told { key, lease, fence, at, until, client, .. } => {
                eat(b"T");
                eat(key.as_bytes());
                eat(lease.as_bytes());
                eat(&fence.to_le_bytes());
                eat(&us(*at).to_le_bytes());
                eat(&until.map_or(0, us).to_le_bytes());
                eat(client.as_bytes());
            }
            Event::End { key, lease, at } => {
                eat(b"E");
                eat(key.as_bytes());
                eat(lease.as_bytes());
                eat(&us(*at).to_le_bytes());
            }
            Event::Force { key, at } => {
                eat(b"F");
                eat(key.as_bytes());
                eat(&us(*at).to_le_bytes());
            }
            Event::Wrote { key, lease, fence, at, accepted, .. } => {
                eat(b"W");
                eat(key.as_bytes());
                eat(lease.as_bytes());
                eat(&fence.to_le_bytes());
                eat(&us(*at).to_le_bytes());
                eat(&[*accepted as u8]);
            }
            Event::ReleaseRefused { key, lease, at } => {
                eat(b"R");
                eat(key.as_bytes());
                eat(lease.as_bytes());
                eat(&us(*at).to_le_bytes());
            }
            // Not hashed: a checker's annotation, so that every seed's hash stays as it was.
            Event::WaitedInVain { .. } | Event::SlotWaited { .. } => {}
            Event::ClockJump { node, by_ms, at } => {
                eat(b"J");
                eat(node.as_bytes());
                eat(&by_ms.to_le_bytes());
                eat(&us(*at).to_le_bytes());
            }
            Event::Finished { key, lease, at } => {
                eat(b"D");
                eat(key.as_bytes());
                eat(lease.as_bytes());
                eat(&us(*at).to_le_bytes());
            }
        }
    }
    for a in log {
        eat(b"S");
        eat(a.key.as_bytes());
        eat(&us(a.at).to_le_bytes());
        if let Some(r) = &a.new {
            eat(r.lease_id.expose().as_bytes());
            eat(&r.fence.to_le_bytes());
            eat(&r.expires_at_ms.unwrap_or(0).to_le_bytes());
            eat(&r.released_at_ms.unwrap_or(0).to_le_bytes());
        }
    }
    h
}
