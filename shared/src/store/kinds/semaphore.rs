//! Semaphores (DESIGN.md, "Semaphores"): N holders on one item, each an entry of its
//! `sem_holders` map. The conditions and the mutations of a semaphore's writes, their reference
//! semantics, and their DynamoDB rendering (the whole item, and the map's entries), side by side.

use aws_sdk_dynamodb::types::AttributeValue;

use super::lease::updated;
use super::lease_item_head;
use crate::model::{LeaseId, Record, SlotHolder};
use crate::store::dynamo::expr::{guard, slot_guard, Expr, Guard, Request};
use crate::store::dynamo::item::{num, str_, Item};
use crate::store::keys::{keepalive_shard, KEEPALIVE_SHARDS};
use crate::store::table::attr;

/// Most entries of the holders' map one cleaning take or tidy removes. DynamoDB refuses an
/// expression past 4 KB or 300 operators (`ValidationException`): one entry is a
/// `sem_holders.#ended99` path of 21 bytes and two operators, so a write of this many stays
/// within both (`one_write_stays_within_dynamodb_s_expression_limits`); a map with more ended
/// entries is cleaned by several writes in sequence, each under the item the last one left.
pub const CLEAN_CHUNK: usize = 100;

/// What a waiter of a full semaphore polls ([`crate::store::Store::slot_count`]): the holders
/// not released (`sem_taken`), N (`sem_slots`; `None`: the item is no semaphore) and the item's
/// `fence` (its newest holder's: a take raises it, a renewal or a release does not), by which a
/// waiter tells slots changing hands from the same holders keeping them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotCount {
    pub taken: u32,
    pub slots: Option<u32>,
    pub fence: u64,
}

/// Most holders one force-release evicts: each sets two paths (`released_at_ms`,
/// `expires_at_ms`, 90 bytes and six operators); more are evicted by several writes.
pub const EVICT_CHUNK: usize = 32;

/// The conditions of a semaphore's writes. Semantics are defined by
/// [`SemaphoreCondition::holds`]; the DynamoDB text of each is in DESIGN.md, and a test renders
/// each and compares.
#[derive(Debug, Clone, PartialEq)]
pub enum SemaphoreCondition {
    /// A semaphore has a free slot for `lease_id` at `fence`: the item is a semaphore, fewer
    /// than `slots` holders are counted, its last fence is below `fence`, `lease_id` has no
    /// entry (single-use), and no holder was cleaned away by a clock ahead of this take's
    /// `now_ms` (`sem_cleaned_at_ms`: a holder whose entry a clock far ahead judged expired may
    /// still believe it holds its slot). DynamoDB: `attribute_exists(sem_slots) AND sem_taken <
    /// :slots AND fence < :fence AND attribute_not_exists(sem_holders.#lease_id) AND
    /// (attribute_not_exists(sem_cleaned_at_ms) OR sem_cleaned_at_ms <= :now)`
    SlotFree { fence: u64, lease_id: LeaseId, slots: u32, now_ms: u64 },
    /// The semaphore is as read: no write since (every one bumps `sem_rev`). DynamoDB:
    /// `sem_rev = :expected_rev`
    SlotsAsRead { rev: u64 },
    /// The semaphore's holder `lease_id` is live and this renewal newer than its last, and its
    /// expiry does not move backwards. DynamoDB: `sem_holders.#lease_id.expires_at_ms > :now AND
    /// attribute_not_exists(sem_holders.#lease_id.released_at_ms) AND
    /// sem_holders.#lease_id.renewed_at_ms < :now AND sem_holders.#lease_id.expires_at_ms <=
    /// :expires_at`
    SlotRenew { lease_id: LeaseId, now_ms: u64, expires_at_ms: u64 },
    /// The semaphore's holder `lease_id` has an entry and is not released. DynamoDB:
    /// `attribute_exists(sem_holders.#lease_id) AND
    /// attribute_not_exists(sem_holders.#lease_id.released_at_ms)`
    SlotUnreleased { lease_id: LeaseId },
}

/// The writes of a semaphore. Semantics are defined by [`SemaphoreMutation::apply`]; every
/// write but the first holder's bumps `sem_rev`.
#[derive(Debug, Clone, PartialEq)]
pub enum SemaphoreMutation {
    /// Write a whole semaphore item (DynamoDB: a PutItem): the first holder makes the semaphore.
    PutSemaphore(Box<Record>),
    /// Take a slot: the holder's entry, `fence` = its fence, `sem_slots` = `slots`, `sem_rev`
    /// plus one, the TTL; `sem_taken` plus one, or, cleaning (`clean`: the ended entries and the
    /// count left with this holder), the ended entries removed and `sem_taken` set.
    /// `sem_cleaned_at_ms` = `cleaned_at` when given (a holder counted, expired unreleased, is
    /// cleaned away: the writer's clock, never below the stamp it read).
    TakeSlot {
        slot: Box<SlotHolder>,
        slots: u32,
        ttl: u64,
        clean: Option<(Vec<LeaseId>, u32)>,
        cleaned_at: Option<u64>,
    },
    /// Renew holder `lease_id`: expiry `now + duration`, renewed now.
    RenewSlot { lease_id: LeaseId, now_ms: u64, duration_ms: u64, ttl: u64 },
    /// Release holder `lease_id`: released and expired now, `sem_taken` - 1.
    ReleaseSlot { lease_id: LeaseId, now_ms: u64, ttl: u64 },
    /// Force-release holders `evicted`: released now, expired at 0, `sem_taken` = `taken`,
    /// fence + 1.
    EvictSlots { evicted: Vec<LeaseId>, now_ms: u64, taken: u32, ttl: u64 },
    /// Remove the ended entries `ended`, `sem_taken` = `taken`; `sem_cleaned_at_ms` =
    /// `cleaned_at` when given (as [`SemaphoreMutation::TakeSlot`]'s).
    TidySlots { ended: Vec<LeaseId>, taken: u32, ttl: u64, cleaned_at: Option<u64> },
}

impl SemaphoreCondition {
    /// Reference semantics: does the condition hold for the current item (`None`: no item)?
    pub fn holds(&self, item: Option<&Record>) -> bool {
        let Some(r) = item else { return false };
        let s = &r.semaphore;
        match self {
            SemaphoreCondition::SlotFree { fence, lease_id, slots, now_ms } => {
                s.slots.is_some()
                    && s.slots_taken.unwrap_or(0) < *slots
                    && r.fence < *fence
                    && r.slot(lease_id).is_none()
                    && s.cleaned_at_ms.is_none_or(|t| t <= *now_ms)
            }
            SemaphoreCondition::SlotsAsRead { rev } => s.slots_rev == Some(*rev),
            SemaphoreCondition::SlotRenew { lease_id, now_ms, expires_at_ms } => r
                .slot(lease_id)
                .is_some_and(|h| h.is_live(*now_ms) && h.renewed_at_ms < *now_ms && h.expires_at_ms <= *expires_at_ms),
            SemaphoreCondition::SlotUnreleased { lease_id } => {
                r.slot(lease_id).is_some_and(|h| h.released_at_ms.is_none())
            }
        }
    }

    /// The DynamoDB `ConditionExpression` (numbered as in `dynamo/render.rs`'s protocol).
    pub(in crate::store) fn guard(&self) -> Guard {
        match self {
            // Step 9b, take: a semaphore with fewer than N holders counted, a lower last fence,
            // no entry of this lease_id (single-use; a retry finds its entry in the refused
            // answer), and no holder cleaned away by a clock ahead of ours (its holder may
            // believe until our clock passes the cleaner's).
            SemaphoreCondition::SlotFree { fence, lease_id, slots, now_ms } => slot_guard(
                "attribute_exists(sem_slots) AND sem_taken < :slots AND fence < :fence \
                 AND attribute_not_exists(sem_holders.#lease_id) \
                 AND (attribute_not_exists(sem_cleaned_at_ms) OR sem_cleaned_at_ms <= :now)",
                lease_id,
                [("slots", num(*slots as u64)), ("fence", num(*fence)), ("now", num(*now_ms))],
            ),
            // Steps 9c, 9d, 9g, the item as read: cleaning, tidying and evicting count what they read.
            SemaphoreCondition::SlotsAsRead { rev } => guard("sem_rev = :expected_rev", [("expected_rev", num(*rev))]),
            // Step 9e, heartbeat: this holder live, this renewal newer, the expiry never backwards.
            SemaphoreCondition::SlotRenew { lease_id, now_ms, expires_at_ms } => slot_guard(
                "sem_holders.#lease_id.expires_at_ms > :now AND attribute_not_exists(sem_holders.#lease_id.released_at_ms) \
                 AND sem_holders.#lease_id.renewed_at_ms < :now AND sem_holders.#lease_id.expires_at_ms <= :expires_at",
                lease_id,
                [("now", num(*now_ms)), ("expires_at", num(*expires_at_ms))],
            ),
            // Step 9f, release: this holder's entry, not released yet (a retried release finds it
            // released).
            SemaphoreCondition::SlotUnreleased { lease_id } => slot_guard(
                "attribute_exists(sem_holders.#lease_id) AND attribute_not_exists(sem_holders.#lease_id.released_at_ms)",
                lease_id,
                [],
            ),
        }
    }
}

impl SemaphoreMutation {
    /// Reference semantics: the item after the write. `old` is the item the condition held for.
    pub fn apply(&self, old: Option<&Record>) -> Record {
        match self {
            SemaphoreMutation::PutSemaphore(r) => (**r).clone(),
            SemaphoreMutation::TakeSlot { slot: h, slots, ttl, clean, cleaned_at } => revised(old, |r| {
                let s = &mut r.semaphore;
                if cleaned_at.is_some() {
                    s.cleaned_at_ms = *cleaned_at;
                }
                if let Some((ended, taken)) = clean {
                    s.slot_holders.retain(|e| !ended.contains(&e.lease_id));
                    s.slots_taken = Some(*taken);
                } else {
                    s.slots_taken = Some(s.slots_taken.unwrap_or(0) + 1);
                }
                s.slot_holders.push((**h).clone());
                s.slots = Some(*slots);
                r.fence = h.fence;
                r.ttl = Some(*ttl);
                if let Some(k) = h.index_keepalive() {
                    r.keepalive = Some(k);
                }
            }),
            SemaphoreMutation::RenewSlot { lease_id, now_ms, duration_ms, ttl } => revised(old, |r| {
                let h = entry(r, lease_id);
                h.expires_at_ms = now_ms + duration_ms;
                h.duration_ms = *duration_ms;
                h.renewed_at_ms = *now_ms;
                r.ttl = Some(*ttl);
            }),
            SemaphoreMutation::ReleaseSlot { lease_id, now_ms, ttl } => revised(old, |r| {
                let h = entry(r, lease_id);
                h.released_at_ms = Some(*now_ms);
                h.expires_at_ms = *now_ms;
                r.semaphore.slots_taken = Some(r.semaphore.slots_taken.unwrap_or(0).saturating_sub(1));
                r.ttl = Some(*ttl);
            }),
            SemaphoreMutation::EvictSlots { evicted, now_ms, taken, ttl } => revised(old, |r| {
                for h in r.semaphore.slot_holders.iter_mut().filter(|h| evicted.contains(&h.lease_id)) {
                    h.released_at_ms = Some(*now_ms);
                    h.expires_at_ms = 0;
                }
                r.semaphore.slots_taken = Some(*taken);
                r.fence = r.fence.saturating_add(1);
                r.ttl = Some(*ttl);
            }),
            SemaphoreMutation::TidySlots { ended, taken, ttl, cleaned_at } => revised(old, |r| {
                if cleaned_at.is_some() {
                    r.semaphore.cleaned_at_ms = *cleaned_at;
                }
                r.semaphore.slot_holders.retain(|e| !ended.contains(&e.lease_id));
                r.semaphore.slots_taken = Some(*taken);
                r.ttl = Some(*ttl);
            }),
        }
    }

    /// The DynamoDB write: the whole item of a new semaphore, or the `UpdateExpression` of the
    /// others rendered into `x`. Each update bumps `sem_rev` and sets the TTL.
    pub(in crate::store) fn render(&self, key: &str, x: &mut Expr) -> Request {
        match self {
            // Step 9a, the first holder makes the semaphore.
            SemaphoreMutation::PutSemaphore(r) => return Request::Put(semaphore_item(r), (**r).clone()),
            // Steps 9b, 9c, take (cleaning the ended entries first when the semaphore was full).
            SemaphoreMutation::TakeSlot { slot, slots, ttl, clean, cleaned_at } => {
                let p = x.holder_path("lease_id", &slot.lease_id);
                let v = x.v("slot_holder", slot_holder_value(slot));
                x.set_path(p, v);
                x.set_value(attr::FENCE, num(slot.fence));
                x.set_value(attr::SEM_SLOTS, num(*slots as u64));
                match clean {
                    None => x.bump(attr::SEM_TAKEN, false),
                    Some((ended, taken)) => {
                        remove_holders(x, "ended", ended);
                        x.set_value(attr::SEM_TAKEN, num(*taken as u64));
                    }
                }
                if let Some(t) = cleaned_at {
                    x.set_value(attr::SEM_CLEANED_AT, num(*t));
                }
                x.bump(attr::SEM_REV, false);
                x.set_value(attr::TTL, num(*ttl));
                // A slot kept alive places the item in the keep-alive index.
                if let Some(k) = slot.index_keepalive() {
                    x.set_value(attr::KA_SHARD, num(keepalive_shard(key, KEEPALIVE_SHARDS) as u64));
                    x.set_value(attr::KA_UNTIL, num(k.until_ms));
                }
            }
            // Step 9e, heartbeat.
            SemaphoreMutation::RenewSlot { lease_id, now_ms, duration_ms, ttl } => {
                let p = x.holder_path("lease_id", lease_id);
                let e = x.v("expires_at", num(now_ms + duration_ms));
                x.set_path(format!("{p}.{}", attr::EXPIRES_AT), e);
                let d = x.v("duration_ms", num(*duration_ms));
                x.set_path(format!("{p}.{}", attr::DURATION), d);
                let now = x.v("now", num(*now_ms));
                x.set_path(format!("{p}.{}", attr::RENEWED_AT), now);
                x.bump(attr::SEM_REV, false);
                x.set_value(attr::TTL, num(*ttl));
            }
            // Step 9f, release.
            SemaphoreMutation::ReleaseSlot { lease_id, now_ms, ttl } => {
                let p = x.holder_path("lease_id", lease_id);
                let now = x.v("now", num(*now_ms));
                x.set_path(format!("{p}.{}", attr::RELEASED_AT), now.clone());
                x.set_path(format!("{p}.{}", attr::EXPIRES_AT), now);
                x.bump(attr::SEM_TAKEN, true);
                x.bump(attr::SEM_REV, false);
                x.set_value(attr::TTL, num(*ttl));
            }
            SemaphoreMutation::EvictSlots { evicted, now_ms, taken, ttl } => evict(x, evicted, *now_ms, *taken, *ttl),
            // Step 9d, tidy: the ended entries removed.
            SemaphoreMutation::TidySlots { ended, taken, ttl, cleaned_at } => {
                x.set_value(attr::SEM_TAKEN, num(*taken as u64));
                if let Some(t) = cleaned_at {
                    x.set_value(attr::SEM_CLEANED_AT, num(*t));
                }
                x.bump(attr::SEM_REV, false);
                x.set_value(attr::TTL, num(*ttl));
                remove_holders(x, "ended", ended);
            }
        }
        Request::Update
    }
}

/// An update of the existing semaphore `old` by `f`, its revision bumped.
fn revised(old: Option<&Record>, f: impl FnOnce(&mut Record)) -> Record {
    updated(old, |r| {
        r.semaphore.slots_rev = Some(r.semaphore.slots_rev.unwrap_or(0) + 1);
        f(r)
    })
}

/// The entry of holder `lease_id` (its condition found it).
fn entry<'a>(r: &'a mut Record, lease_id: &LeaseId) -> &'a mut SlotHolder {
    r.semaphore.slot_holders.iter_mut().find(|h| &h.lease_id == lease_id).expect("the condition found the entry")
}

/// Step 9g, force-release: the holders `evicted` released now and expired at 0, the fence bumped.
fn evict(x: &mut Expr, evicted: &[LeaseId], now_ms: u64, taken: u32, ttl: u64) {
    let (now, zero) = (x.v("now", num(now_ms)), x.v("zero", num(0)));
    for (i, id) in evicted.iter().enumerate() {
        let p = x.holder_path(&format!("evicted{i}"), id);
        x.set_path(format!("{p}.{}", attr::RELEASED_AT), now.clone());
        x.set_path(format!("{p}.{}", attr::EXPIRES_AT), zero.clone());
    }
    x.set_value(attr::SEM_TAKEN, num(taken as u64));
    x.bump(attr::FENCE, false);
    x.bump(attr::SEM_REV, false);
    x.set_value(attr::TTL, num(ttl));
}

/// `REMOVE sem_holders.#ended0, ...`.
fn remove_holders(x: &mut Expr, alias: &str, ids: &[LeaseId]) {
    for (i, id) in ids.iter().enumerate() {
        let p = x.holder_path(&format!("{alias}{i}"), id);
        x.remove_path(p);
    }
}

/// One holder's entry in a semaphore's map.
fn slot_holder_value(h: &SlotHolder) -> AttributeValue {
    let mut m = Item::with_capacity(8);
    m.insert(attr::FENCE.to_string(), num(h.fence));
    m.insert(attr::HOLDER.to_string(), str_(&h.holder));
    m.insert(attr::ACQUIRED_AT.to_string(), num(h.acquired_at_ms));
    m.insert(attr::RENEWED_AT.to_string(), num(h.renewed_at_ms));
    m.insert(attr::EXPIRES_AT.to_string(), num(h.expires_at_ms));
    m.insert(attr::DURATION.to_string(), num(h.duration_ms));
    if let Some(r) = h.released_at_ms {
        m.insert(attr::RELEASED_AT.to_string(), num(r));
    }
    if let Some(md) = &h.metadata {
        m.insert(attr::METADATA.to_string(), AttributeValue::S(serde_json::Value::Object(md.clone()).to_string()));
    }
    if let Some(k) = &h.keepalive {
        m.insert(attr::KA_UNTIL.to_string(), num(k.until_ms));
        if let Some(arn) = &k.execution_arn {
            m.insert(attr::KA_EXECUTION_ARN.to_string(), str_(arn));
        }
    }
    AttributeValue::M(m)
}

/// The whole item of a new semaphore.
fn semaphore_item(r: &Record) -> Item {
    let s = &r.semaphore;
    let holders = s.slot_holders.iter().map(|h| (h.lease_id.expose().to_string(), slot_holder_value(h))).collect();
    let mut item = lease_item_head(r, 10);
    let mut put = |a: &str, v: AttributeValue| {
        item.insert(a.to_string(), v);
    };
    put(attr::SEM_SLOTS, num(s.slots.unwrap_or(1) as u64));
    put(attr::SEM_TAKEN, num(s.slots_taken.unwrap_or(0) as u64));
    put(attr::SEM_REV, num(s.slots_rev.unwrap_or(0)));
    put(attr::SEM_HOLDERS, AttributeValue::M(holders));
    if let Some(t) = s.cleaned_at_ms {
        put(attr::SEM_CLEANED_AT, num(t));
    }
    if let Some(k) = &r.keepalive {
        put(attr::KA_SHARD, num(keepalive_shard(&r.key, KEEPALIVE_SHARDS) as u64));
        put(attr::KA_UNTIL, num(k.until_ms));
    }
    item
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Keepalive;
    use crate::store::dynamo::expressions;
    use crate::store::{Condition, Mutation};
    use crate::validate::{
        max_slot_metadata_bytes, slot_entries, slot_keepalive_bytes, ITEM_LIMIT_BYTES, MAX_EXECUTION_ARN_LEN,
        MAX_SLOTS, SEMAPHORE_BASE_BYTES, SLOT_ENTRY_BYTES,
    };

    /// DynamoDB's operators in an expression, counted generously: comparators, arithmetic,
    /// `AND`/`OR`/`NOT`, functions, and each dereference of a document path (`.`).
    fn operators(e: &str) -> usize {
        let symbols = e.matches(['=', '<', '>', '+', '-', '.', '(']).count();
        let words = e.split_whitespace().filter(|w| matches!(*w, "AND" | "OR" | "NOT" | "BETWEEN" | "IN")).count();
        symbols + words
    }

    fn ids(n: usize) -> Vec<LeaseId> {
        (0..n).map(|i| LeaseId::from_string(format!("{i:0>128}"))).collect()
    }

    fn holder(id: &LeaseId, metadata: usize) -> SlotHolder {
        let mut md = serde_json::Map::new();
        if metadata > 0 {
            // `{"m":"..."}`: 8 bytes of JSON around the text.
            md.insert("m".into(), serde_json::Value::String("x".repeat(metadata - 8)));
        }
        SlotHolder {
            lease_id: id.clone(),
            fence: u64::MAX,
            holder: "h".repeat(256),
            acquired_at_ms: u64::MAX,
            renewed_at_ms: u64::MAX,
            expires_at_ms: u64::MAX,
            duration_ms: u64::MAX,
            released_at_ms: Some(u64::MAX),
            metadata: (metadata > 0).then_some(md),
            keepalive: None,
        }
    }

    /// The cleaning take, the tidy and the force-release name at most `CLEAN_CHUNK` /
    /// `EVICT_CHUNK` entries each: every such write's expressions stay under 4 KB and 300
    /// operators, with the longest names DynamoDB aliases carry.
    #[test]
    fn one_write_stays_within_dynamodb_s_expression_limits() {
        let rev = Condition::Semaphore(SemaphoreCondition::SlotsAsRead { rev: u64::MAX });
        let slot = Box::new(holder(&ids(1)[0], 4096));
        let writes = [
            Mutation::Semaphore(SemaphoreMutation::TakeSlot {
                slot,
                slots: MAX_SLOTS,
                ttl: u64::MAX,
                clean: Some((ids(CLEAN_CHUNK), MAX_SLOTS)),
                cleaned_at: Some(u64::MAX),
            }),
            Mutation::Semaphore(SemaphoreMutation::TidySlots {
                ended: ids(CLEAN_CHUNK),
                taken: MAX_SLOTS,
                ttl: u64::MAX,
                cleaned_at: Some(u64::MAX),
            }),
            Mutation::Semaphore(SemaphoreMutation::EvictSlots {
                evicted: ids(EVICT_CHUNK),
                now_ms: u64::MAX,
                taken: MAX_SLOTS,
                ttl: u64::MAX,
            }),
        ];
        for m in &writes {
            let (cond, update) = expressions(&rev, m);
            for e in [&cond, &update] {
                assert!(e.len() < 4096, "{} bytes: {e}", e.len());
                assert!(operators(e) < 300, "{} operators: {e}", operators(e));
            }
            // Half as many again would not do for at least one limit, or the chunk is far too
            // small: each write is sized to use the limits well.
            assert!(update.len() > 1024 || operators(&update) > 75, "{update}");
        }
    }

    /// DynamoDB's item size: a name's bytes plus its value's (a number at most 21 bytes: its
    /// significant digits halved, plus 1; a map 3 bytes plus, per element, name, value, 1).
    fn value_size(v: &AttributeValue) -> usize {
        match v {
            AttributeValue::S(s) => s.len(),
            AttributeValue::N(n) => n.trim_start_matches('-').len().div_ceil(2) + 1,
            AttributeValue::M(m) => 3 + m.iter().map(|(k, v)| k.len() + value_size(v) + 1).sum::<usize>(),
            other => panic!("{other:?}"),
        }
    }

    /// The largest semaphore `validate` admits fits a DynamoDB item (400 KB): `MAX_SLOTS`
    /// holders' map at its sized bound, every entry at its largest (a 128-byte lease_id, a
    /// 256-byte holder, the metadata allowed at that N), derived from the limits; a key of
    /// 1,024 bytes. At N = 4 a holder carries the 4 KB of metadata any lease may. The same with
    /// every holder kept alive, its execution's ARN as long as the budget left allows (up to
    /// the 2,048 bytes accepted), the item in the keep-alive index.
    #[test]
    fn the_largest_semaphore_admitted_fits_a_dynamodb_item() {
        let sizes = [2, 4, 16, 100, 300, MAX_SLOTS];
        for (n, kept) in sizes.iter().map(|n| (*n, false)).chain(sizes.iter().map(|n| (*n, true))) {
            let budget = max_slot_metadata_bytes(n);
            let until = slot_keepalive_bytes(&Keepalive { until_ms: 0, execution_arn: None });
            // The longest ARN the budget leaves room for, and the metadata after it.
            let arn = (kept && budget >= until + 17 + 5)
                .then(|| format!("arn:{}", "x".repeat((budget - until - 17).min(MAX_EXECUTION_ARN_LEN) - 4)));
            let keepalive = arn.map(|a| Keepalive { until_ms: u64::MAX, execution_arn: Some(a) });
            let keep = keepalive.as_ref().map_or(0, slot_keepalive_bytes);
            let meta = match (budget - keep).min(4096) {
                m if m < 9 => 0,
                m => m,
            };
            if kept && keepalive.is_none() {
                continue;
            }
            let holders: Vec<SlotHolder> = ids(slot_entries(n))
                .iter()
                .map(|id| SlotHolder { keepalive: keepalive.clone(), ..holder(id, meta) })
                .collect();
            let mut r = Record::key_only("k".repeat(1024));
            r.keepalive = holders[0].index_keepalive();
            r.holder = "h".repeat(256);
            (r.fence, r.acquired_at_ms, r.min_hold_until_ms, r.ttl) = (u64::MAX, u64::MAX, u64::MAX, Some(u64::MAX));
            r.semaphore.slots = Some(n);
            (r.semaphore.slots_taken, r.semaphore.slots_rev) = (Some(n), Some(u64::MAX));
            r.semaphore.cleaned_at_ms = Some(u64::MAX);
            r.semaphore.slot_holders = holders;
            let item = semaphore_item(&r);
            let size: usize = item.iter().map(|(k, v)| k.len() + value_size(v)).sum();
            assert!(size <= ITEM_LIMIT_BYTES, "N = {n}, metadata {meta}, keep-alive {keep}: {size} bytes");
            // The model is not far off: the base and the entries as counted bound what is sent.
            let entry = |h: &SlotHolder| h.lease_id.expose().len() + value_size(&slot_holder_value(h)) + 1;
            assert!(r.semaphore.slot_holders.iter().all(|h| entry(h) <= SLOT_ENTRY_BYTES + meta + keep), "N = {n}");
            let base = size - r.semaphore.slot_holders.iter().map(entry).sum::<usize>();
            assert!(base <= SEMAPHORE_BASE_BYTES, "N = {n}: base {base}");
        }
        assert_eq!(MAX_SLOTS, 640);
        assert_eq!(max_slot_metadata_bytes(4), 10_714);
        assert_eq!(max_slot_metadata_bytes(100), 2_481);
        assert_eq!(max_slot_metadata_bytes(MAX_SLOTS), 0);
        // One slot more, with entries at their largest, would not fit.
        let over = slot_entries(MAX_SLOTS + 1) * SLOT_ENTRY_BYTES + SEMAPHORE_BASE_BYTES;
        assert!(over > ITEM_LIMIT_BYTES, "{over}");
    }
}
