//! Input bounds and validation. Every violation is an `InvalidRequest` naming the field.

use std::time::Duration;

use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::model::{Keepalive, LeaseId, KEEPALIVE_HORIZON_MS};

/// Bounds on every input. The defaults are those documented in DESIGN.md.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    pub max_key_bytes: usize,
    pub max_holder_bytes: usize,
    pub min_duration: Duration,
    pub max_duration: Duration,
    pub max_wait: Duration,
    pub max_metadata_bytes: usize,
    /// Period of the scheduled keep-alive sweep: a keep-alive lease must last at least
    /// [`KEEPALIVE_SWEEPS`] periods, so that one late or failed sweep cannot let it lapse.
    /// Zero: no sweep runs and no minimum applies.
    pub keepalive_sweep_period: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_key_bytes: 1024,
            max_holder_bytes: 256,
            min_duration: Duration::from_secs(1),
            max_duration: Duration::from_secs(12 * 3600),
            max_wait: Duration::from_secs(12 * 3600),
            max_metadata_bytes: 4096,
            keepalive_sweep_period: Duration::from_secs(60),
        }
    }
}

/// Smallest and largest length of a lease_id a caller may supply (32 hex chars are generated;
/// a UUID, 36 chars, is accepted so that `States.UUID()` can make one in a state machine).
pub(crate) const LEASE_ID_MIN_LEN: usize = 22;
pub(crate) const LEASE_ID_MAX_LEN: usize = 128;
/// The most leases one `acquire_next` takes, and the longest work state name, in bytes.
/// DynamoDB's largest item, in bytes.
pub const ITEM_LIMIT_BYTES: usize = 400 * 1024;
/// What a semaphore's item takes besides its holders' map, at most: its key (up to 1,024
/// bytes), holder, fence, times, TTL, `sem_*` counters, attribute names (DESIGN.md,
/// "Semaphores", "Cost").
pub const SEMAPHORE_BASE_BYTES: usize = 2048;
/// One holder's entry in a semaphore's map without its metadata, at most, by DynamoDB's item
/// size rules (a name's UTF-8 bytes; a number at most 21 bytes; a map 3 bytes plus, per
/// element, its name, its value and 1 byte): its name (a lease_id of up to 128 bytes) and 1,
/// the map's 3, its 8 elements' names (84 bytes) and 1 each, 6 numbers, a holder of up to 256
/// bytes. A holder's metadata adds its JSON's length.
pub const SLOT_ENTRY_BYTES: usize = (LEASE_ID_MAX_LEN + 1) + 3 + (84 + 8) + 6 * 21 + 256;
/// Entries the holders' map of a semaphore of N slots is sized for: its bound N + 16 (a grant
/// past it tidies the ended entries), and as many again for tidies refused by concurrent writes.
pub const fn slot_entries(n: u32) -> usize {
    n as usize + 32
}
/// The bytes each holder's entry may take in a semaphore of `n` slots: the item's limit
/// shared by its entries.
pub const fn slot_entry_budget(n: u32) -> usize {
    (ITEM_LIMIT_BYTES - SEMAPHORE_BASE_BYTES) / slot_entries(n)
}
/// Most slots of a semaphore (DESIGN.md, "Semaphores"): the largest N whose map of entries
/// without metadata fits a DynamoDB item (640).
pub const MAX_SLOTS: u32 = ((ITEM_LIMIT_BYTES - SEMAPHORE_BASE_BYTES) / SLOT_ENTRY_BYTES - slot_entries(0)) as u32;
/// The most metadata (bytes of JSON) a holder of a semaphore of `n` slots may carry, so that
/// the item fits DynamoDB's 400 KB with every entry at its largest.
pub const fn max_slot_metadata_bytes(n: u32) -> usize {
    slot_entry_budget(n).saturating_sub(SLOT_ENTRY_BYTES)
}

/// A semaphore's `slots`: 1..=[`MAX_SLOTS`]; a holder of two or more slots needs a duration
/// and takes no min_hold.
pub(crate) fn slots(slots: Option<u32>, timed: bool, min_hold: bool) -> Result<()> {
    let Some(n) = slots else { return Ok(()) };
    if !(1..=MAX_SLOTS).contains(&n) {
        return Err(Error::invalid(format!(
            "slots must be between 1 and {MAX_SLOTS} (the most holders a DynamoDB item of 400 KB keeps), got {n}"
        )));
    }
    if n >= 2 && !timed {
        return Err(Error::invalid("slots: a semaphore's holder needs a duration (no fail_closed slot)"));
    }
    if n >= 2 && min_hold {
        return Err(Error::invalid("slots: a semaphore's holder takes no min_hold_ms"));
    }
    Ok(())
}

/// What a holder's keep-alive adds to its entry in a semaphore's map, by DynamoDB's item size
/// rules: `ka_until_ms` (its name, a number of at most 21 bytes and 1), and with an execution
/// `ka_execution_arn` (its name, the ARN and 1).
pub fn slot_keepalive_bytes(k: &Keepalive) -> usize {
    let until = "ka_until_ms".len() + 21 + 1;
    until + k.execution_arn.as_ref().map_or(0, |a| "ka_execution_arn".len() + a.len() + 1)
}

/// A holder of a semaphore of `n` slots (`n >= 2`) carries at most
/// [`max_slot_metadata_bytes`]`(n)` bytes of metadata and keep-alive together (its JSON's
/// length and [`slot_keepalive_bytes`]): the item of N holders, each with as much, fits
/// DynamoDB's 400 KB.
pub(crate) fn slot_extras(n: u32, m: Option<&Map<String, Value>>, k: Option<&Keepalive>) -> Result<()> {
    let meta = m.map_or(0, |m| serde_json::to_vec(m).map(|v| v.len()).unwrap_or(usize::MAX));
    let keep = k.map_or(0, slot_keepalive_bytes);
    let max = max_slot_metadata_bytes(n);
    if n >= 2 && meta.saturating_add(keep) > max {
        let what = match (m.is_some(), k.is_some()) {
            (true, true) => format!("metadata ({meta} bytes as JSON) and keepalive ({keep} bytes) take"),
            (false, true) => format!("keepalive takes {keep} bytes;"),
            _ => format!("metadata is {meta} bytes as JSON;"),
        };
        return Err(Error::invalid(format!(
            "{what} a holder of a semaphore of {n} slots carries at most {max} bytes of metadata and keepalive \
             (N holders' entries share a DynamoDB item of 400 KB)"
        )));
    }
    Ok(())
}

/// Most leases one `acquire_next` takes.
pub const MAX_BATCH: u32 = 100;

/// Longest state name, in bytes.
pub const MAX_STATE_BYTES: usize = 64;

/// A state name: 1..=64 of `[A-Za-z0-9_-]` (it is part of the index partition key
/// `STATE#n`, so no `#`).
pub fn check_state(state: &str) -> Result<()> {
    if state.is_empty() || state.len() > MAX_STATE_BYTES {
        return Err(Error::invalid(format!("state must be 1 to {MAX_STATE_BYTES} bytes long")));
    }
    if let Some(c) = state.chars().find(|c| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-')) {
        return Err(Error::invalid(format!("state contains {c:?}; a state is made of A-Z, a-z, 0-9, '_' and '-'")));
    }
    Ok(())
}

/// A keep-alive lease lasts at least this many sweep periods.
pub const KEEPALIVE_SWEEPS: u32 = 3;
/// Longest Step Functions execution ARN accepted for keep-alive.
pub(crate) const MAX_EXECUTION_ARN_LEN: usize = 2048;

fn text(field: &str, value: &str, max: usize) -> Result<()> {
    if value.is_empty() {
        return Err(Error::invalid(format!("{field} must not be empty")));
    }
    if value.len() > max {
        return Err(Error::invalid(format!(
            "{field} is {} bytes long; the limit is {max} bytes of UTF-8",
            value.len()
        )));
    }
    if let Some(c) = value.chars().find(|c| c.is_control()) {
        return Err(Error::invalid(format!("{field} contains the control character U+{:04X}", c as u32)));
    }
    Ok(())
}

/// The key rule, the same on every interface: a key must reach the functions unchanged
/// through API Gateway, which percent-decodes the request path before it matches a route.
/// So no `?` or `#` (a decoded one ends the path), and, split at `/`, no empty segment (no
/// leading, trailing or doubled `/`) and no `.` or `..` segment (clients and proxies
/// normalise those away).
pub fn key_travels(key: &str) -> Result<()> {
    if let Some(c) = key.chars().find(|c| matches!(c, '?' | '#')) {
        return Err(Error::invalid(format!(
            "key must not contain {c:?} (keys travel in the HTTP path, where it would end the path)"
        )));
    }
    for segment in key.split('/') {
        match segment {
            "" => return Err(Error::invalid(
                "key must not start or end with '/' or contain '//' (every '/'-separated segment must be non-empty)",
            )),
            "." | ".." => {
                return Err(Error::invalid(format!(
                    "key must not have a {segment:?} segment (HTTP clients remove dot segments from paths)"
                )))
            }
            _ => {}
        }
    }
    Ok(())
}

impl Limits {
    pub(crate) fn key(&self, key: &str) -> Result<()> {
        text("key", key, self.max_key_bytes)?;
        key_travels(key)
    }

    /// Shortest duration of a keep-alive lease.
    pub(crate) fn min_keepalive_duration(&self) -> Duration {
        self.keepalive_sweep_period * KEEPALIVE_SWEEPS
    }

    pub(crate) fn holder(&self, holder: &str) -> Result<()> {
        text("holder", holder, self.max_holder_bytes)
    }

    pub(crate) fn duration(&self, field: &str, d: Duration) -> Result<()> {
        if d < self.min_duration || d > self.max_duration {
            return Err(Error::invalid(format!(
                "{field} is {} ms; it must be between {} and {} ms",
                d.as_millis(),
                self.min_duration.as_millis(),
                self.max_duration.as_millis()
            )));
        }
        Ok(())
    }

    pub(crate) fn wait(&self, d: Duration) -> Result<()> {
        if d > self.max_wait {
            return Err(Error::invalid(format!(
                "wait_ms is {} ms; the limit is {} ms",
                d.as_millis(),
                self.max_wait.as_millis()
            )));
        }
        Ok(())
    }

    /// min_hold may not exceed the lease's duration (a release would otherwise extend it).
    pub(crate) fn min_hold(&self, min_hold: Duration, duration: Option<Duration>) -> Result<()> {
        if let Some(d) = duration {
            if min_hold > d {
                return Err(Error::invalid(format!(
                    "min_hold_ms ({} ms) must not exceed duration_ms ({} ms)",
                    min_hold.as_millis(),
                    d.as_millis()
                )));
            }
        } else if min_hold > self.max_duration {
            return Err(Error::invalid(format!(
                "min_hold_ms ({} ms) must not exceed {} ms",
                min_hold.as_millis(),
                self.max_duration.as_millis()
            )));
        }
        Ok(())
    }

    pub(crate) fn metadata(&self, m: &Map<String, Value>) -> Result<()> {
        let size = serde_json::to_vec(m).map(|v| v.len()).unwrap_or(usize::MAX);
        if size > self.max_metadata_bytes {
            return Err(Error::invalid(format!(
                "metadata is {size} bytes as JSON; the limit is {} bytes",
                self.max_metadata_bytes
            )));
        }
        Ok(())
    }

    pub(crate) fn keepalive(&self, k: &Keepalive, now_ms: u64, duration: Option<Duration>) -> Result<()> {
        let Some(duration) = duration else {
            return Err(Error::invalid("keepalive needs a lease with a duration (not fail_closed)"));
        };
        let min = self.min_keepalive_duration();
        if duration < min {
            return Err(Error::invalid(format!(
                "duration_ms is {} ms; a keepalive lease needs at least {} ms ({KEEPALIVE_SWEEPS} periods of the {} ms keep-alive sweep), so that a late sweep cannot let it lapse",
                duration.as_millis(),
                min.as_millis(),
                self.keepalive_sweep_period.as_millis()
            )));
        }
        if k.until_ms <= now_ms {
            return Err(Error::invalid(format!("keepalive.until_ms ({}) is in the past", k.until_ms)));
        }
        let horizon = now_ms + KEEPALIVE_HORIZON_MS;
        if k.until_ms > horizon {
            return Err(Error::invalid("keepalive.until_ms is more than a year away"));
        }
        if let Some(arn) = &k.execution_arn {
            if !arn.starts_with("arn:") || arn.len() > MAX_EXECUTION_ARN_LEN || arn.chars().any(char::is_control) {
                return Err(Error::invalid(
                    "keepalive.execution_arn must be a Step Functions execution ARN (arn:...:execution:...)",
                ));
            }
        }
        Ok(())
    }
}

/// A lease_id from a request: 22..=128 characters of `[A-Za-z0-9_-]`.
pub fn lease_id(s: &str) -> Result<LeaseId> {
    if s.len() < LEASE_ID_MIN_LEN || s.len() > LEASE_ID_MAX_LEN {
        return Err(Error::invalid(format!(
            "lease_id must be {LEASE_ID_MIN_LEN} to {LEASE_ID_MAX_LEN} characters long"
        )));
    }
    if !s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
        return Err(Error::invalid("lease_id may contain only A-Z, a-z, 0-9, '-' and '_'"));
    }
    Ok(LeaseId::from_string(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_that_travel_through_an_http_path() {
        let l = Limits::default();
        for ok in ["a", "orders/42", "a b", "100%", "a%2Fb", "café/🔒", "...", ".hidden", "a..b", "a+b"] {
            assert!(l.key(ok).is_ok(), "{ok:?}");
        }
        assert!(l.key(&"k".repeat(1024)).is_ok());
        for bad in ["", "/a", "a/", "a//b", ".", "..", "a/./b", "a/..", "a?b", "a#b", "a\nb"] {
            let e = l.key(bad).unwrap_err();
            assert_eq!(e.name(), "InvalidRequest", "{bad:?}");
        }
        assert!(l.key(&"k".repeat(1025)).is_err());
    }

    #[test]
    fn keepalive_leases_outlast_three_sweeps() {
        let l = Limits { keepalive_sweep_period: Duration::from_secs(60), ..Limits::default() };
        let k = Keepalive { until_ms: 2_000_000, execution_arn: None };
        let e = l.keepalive(&k, 1_000_000, Some(Duration::from_secs(60))).unwrap_err();
        assert!(e.to_string().contains("180000 ms"), "names the minimum: {e}");
        assert!(l.keepalive(&k, 1_000_000, Some(Duration::from_secs(180))).is_ok());
        let none = Limits { keepalive_sweep_period: Duration::ZERO, ..Limits::default() };
        assert!(none.keepalive(&k, 1_000_000, Some(Duration::from_secs(1))).is_ok());
    }
}
