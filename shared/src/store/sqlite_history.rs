//! The embedded store's lease history: a `history` table in the same SQLite file, written in
//! the same transaction as each change (`record`, called by the store's write path with the
//! item before and after), so an event is committed exactly when its change is. Events come
//! from [`super::events::events`], the function the DynamoDB Streams path uses too.
//!
//! Retention ([`super::events::retention`], default 7 days) is applied on the write path once
//! every [`PRUNE_EVERY`] recorded writes of a process, and by [`prune`] (`leasehold serve`'s
//! purge loop).

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use rusqlite::{params, Connection, OpenFlags};

use super::events::{count, events, retention, Event};
use crate::error::{Error, Result};
use crate::model::Record;

/// How many recorded writes pass between two prunings on the write path.
pub const PRUNE_EVERY: u64 = 1024;

fn err(e: rusqlite::Error) -> Error {
    Error::StoreUnavailable(format!("embedded store history: {e}"))
}

/// Creates the history table and its indexes (idempotent): schema version 3 of the store's
/// migration, inside its transaction.
pub(crate) fn create_schema(c: &Connection) -> rusqlite::Result<()> {
    c.execute_batch(
        "CREATE TABLE IF NOT EXISTS history (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            key TEXT NOT NULL,
            at_ms INTEGER NOT NULL,
            event TEXT NOT NULL
        );
        CREATE INDEX IF NOT EXISTS history_key ON history(key, at_ms);
        CREATE INDEX IF NOT EXISTS history_at ON history(at_ms);",
    )
}

/// Whether the file has the history table (a file the store has not opened yet has none).
fn has_history(c: &Connection) -> Result<bool> {
    let n: i64 = c
        .query_row("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'history'", [], |r| r.get(0))
        .map_err(err)?;
    Ok(n > 0)
}

/// Records the events of one write, inside its transaction (`c` is the transaction). The
/// store's write path calls it with the item before and after the write.
pub(crate) fn record(c: &Connection, old: Option<&Record>, new: Option<&Record>) -> Result<()> {
    let evs = events(old, new);
    if evs.is_empty() {
        return Ok(());
    }
    count(&evs);
    let keep = retention();
    if keep.is_zero() {
        return Ok(());
    }
    let mut st = c.prepare_cached("INSERT INTO history (key, at_ms, event) VALUES (?1, ?2, ?3)").map_err(err)?;
    for e in &evs {
        let json = serde_json::to_string(e).expect("event serialises");
        st.execute(params![e.key, e.at_ms.min(i64::MAX as u64) as i64, json]).map_err(err)?;
    }
    static WRITES: AtomicU64 = AtomicU64::new(0);
    if WRITES.fetch_add(1, Ordering::Relaxed) % PRUNE_EVERY == PRUNE_EVERY - 1 {
        let newest = evs.iter().map(|e| e.at_ms).max().unwrap_or(0);
        delete_before(c, newest.saturating_sub(keep.as_millis() as u64))?;
    }
    Ok(())
}

fn delete_before(c: &Connection, cutoff_ms: u64) -> Result<usize> {
    c.execute("DELETE FROM history WHERE at_ms < ?1", [cutoff_ms.min(i64::MAX as u64) as i64]).map_err(err)
}

/// Deletes the events older than the retention at `now_ms`. Returns how many.
pub fn prune(path: &Path, now_ms: u64) -> Result<usize> {
    let c = Connection::open(path).map_err(err)?;
    c.busy_timeout(std::time::Duration::from_secs(5)).map_err(err)?;
    if !has_history(&c)? {
        return Ok(0);
    }
    delete_before(&c, now_ms.saturating_sub(retention().as_millis() as u64))
}

/// The events of `key` at or after `since_ms`, oldest first, at most the newest `limit`.
pub fn read(path: &Path, key: &str, since_ms: u64, limit: usize) -> Result<Vec<Event>> {
    let c = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)
        .map_err(err)?;
    c.busy_timeout(std::time::Duration::from_secs(5)).map_err(err)?;
    if !has_history(&c)? {
        return Ok(vec![]);
    }
    let mut st = c
        .prepare(
            "SELECT event FROM (SELECT seq, event FROM history WHERE key = ?1 AND at_ms >= ?2
             ORDER BY at_ms DESC, seq DESC LIMIT ?3) ORDER BY seq",
        )
        .map_err(err)?;
    let rows = st
        .query_map(params![key, since_ms.min(i64::MAX as u64) as i64, limit.min(i64::MAX as usize) as i64], |r| {
            r.get::<_, String>(0)
        })
        .map_err(err)?;
    let mut out = Vec::new();
    for row in rows {
        let json = row.map_err(err)?;
        out.push(
            serde_json::from_str(&json)
                .map_err(|e| Error::StoreUnavailable(format!("embedded store history: corrupt event: {e}")))?,
        );
    }
    Ok(out)
}

/// The newest events of every key at or after `since_ms`, oldest first, at most `limit` (the
/// operator page's recent events).
pub fn recent(path: &Path, since_ms: u64, limit: usize) -> Result<Vec<Event>> {
    let c = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)
        .map_err(err)?;
    if !has_history(&c)? {
        return Ok(vec![]);
    }
    let mut st = c
        .prepare(
            "SELECT event FROM (SELECT seq, event FROM history WHERE at_ms >= ?1
             ORDER BY at_ms DESC, seq DESC LIMIT ?2) ORDER BY seq",
        )
        .map_err(err)?;
    let rows = st
        .query_map(params![since_ms.min(i64::MAX as u64) as i64, limit.min(i64::MAX as usize) as i64], |r| {
            r.get::<_, String>(0)
        })
        .map_err(err)?;
    let mut out = Vec::new();
    for row in rows {
        out.push(
            serde_json::from_str(&row.map_err(err)?)
                .map_err(|e| Error::StoreUnavailable(format!("embedded store history: corrupt event: {e}")))?,
        );
    }
    Ok(out)
}
