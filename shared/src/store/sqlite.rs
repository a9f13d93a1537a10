//! The embedded store: one SQLite file that several processes on one machine can share.
//!
//! Every write is one `BEGIN IMMEDIATE` transaction (SQLite's database-wide write lock, held
//! across processes) that reads the item, evaluates the [`Condition`] and applies the
//! [`Mutation`] with their reference semantics, so the embedded store is linearizable for
//! every process that opens the same file. WAL mode lets readers proceed during writes;
//! `synchronous=FULL` makes every commit durable before it is answered (DESIGN.md).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

use super::{keepalive_shard, Condition, Mutation, Page, ScanKind, Store, Write, KEEPALIVE_SHARDS};
use crate::error::{Error, Result};
use crate::model::Record;

#[derive(Clone)]
pub struct SqliteStore {
    conn: Arc<Mutex<Connection>>,
    path: PathBuf,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore").field("path", &self.path).finish()
    }
}

fn store_err(e: rusqlite::Error) -> Error {
    Error::StoreUnavailable(format!("embedded store: {e}"))
}

fn decode(json: &str) -> Result<Record> {
    serde_json::from_str(json).map_err(|e| Error::StoreUnavailable(format!("embedded store: corrupt record: {e}")))
}

impl SqliteStore {
    /// Opens (creating if needed) the store file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        if let Some(dir) = path.parent() {
            if !dir.as_os_str().is_empty() {
                std::fs::create_dir_all(dir)
                    .map_err(|e| Error::StoreUnavailable(format!("cannot create {}: {e}", dir.display())))?;
            }
        }
        let conn = Connection::open(&path).map_err(store_err)?;
        conn.busy_timeout(Duration::from_secs(5)).map_err(store_err)?;
        conn.pragma_update(None, "journal_mode", "WAL").map_err(store_err)?;
        conn.pragma_update(None, "synchronous", "FULL").map_err(store_err)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS leases (
                key TEXT PRIMARY KEY NOT NULL,
                record TEXT NOT NULL,
                fence INTEGER NOT NULL,
                ka_shard INTEGER,
                ka_until_ms INTEGER,
                ttl INTEGER
            );
            CREATE INDEX IF NOT EXISTS leases_keepalive ON leases(ka_shard, ka_until_ms)
                WHERE ka_shard IS NOT NULL;",
        )
        .map_err(store_err)?;
        migrate_states(&conn)?;
        migrate_queues(&conn)?;
        Ok(SqliteStore { conn: Arc::new(Mutex::new(conn)), path })
    }

    /// The default store file: `$LEASEHOLD_DB`, else `$XDG_DATA_HOME/leasehold/leases.db`,
    /// else `~/.local/share/leasehold/leases.db`, else `./leasehold.db`.
    pub(crate) fn default_path() -> PathBuf {
        if let Some(p) = std::env::var_os("LEASEHOLD_DB") {
            return PathBuf::from(p);
        }
        if let Some(d) = std::env::var_os("XDG_DATA_HOME") {
            return PathBuf::from(d).join("leasehold").join("leases.db");
        }
        if let Some(h) = std::env::var_os("HOME") {
            return PathBuf::from(h).join(".local/share/leasehold/leases.db");
        }
        PathBuf::from("leasehold.db")
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The embedded store's TTL sweeper: deletes items whose TTL (epoch s) has passed and whose
    /// fence is below the current time in µs, so that a later acquire, which takes its fence
    /// from the current time in µs, always issues a higher one. Returns how many it deleted.
    pub async fn purge_expired(&self, now_ms: u64) -> Result<usize> {
        self.blocking(move |c| {
            c.execute(
                "DELETE FROM leases WHERE ttl IS NOT NULL AND ttl < ?1 AND fence < ?2",
                params![(now_ms / 1000) as i64, now_ms.saturating_mul(1000) as i64],
            )
            .map_err(store_err)
        })
        .await
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let conn = self.conn.clone();
        tokio::task::spawn_blocking(move || {
            let mut guard = conn.lock().unwrap_or_else(|p| p.into_inner());
            f(&mut guard)
        })
        .await
        .map_err(|e| Error::StoreUnavailable(format!("embedded store task failed: {e}")))?
    }
}

/// The work-state columns (`state`, and `due_ms`: the expiry of a key in a state, NULL while
/// it is held fail-closed) and their index, added to files created before them. Rows written
/// before hold no state, so NULL is right for them.
fn migrate_states(conn: &Connection) -> Result<()> {
    let has_state: bool = conn
        .query_row("SELECT COUNT(*) FROM pragma_table_info('leases') WHERE name = 'state'", [], |r| r.get::<_, i64>(0))
        .map_err(store_err)?
        > 0;
    if !has_state {
        // Two processes may open an old file at once: the loser's ALTER fails on the column
        // the winner added, which is fine.
        let r = conn
            .execute_batch("ALTER TABLE leases ADD COLUMN state TEXT; ALTER TABLE leases ADD COLUMN due_ms INTEGER;");
        if let Err(e) = r {
            if !e.to_string().contains("duplicate column") {
                return Err(store_err(e));
            }
        }
    }
    conn.execute_batch("CREATE INDEX IF NOT EXISTS leases_state ON leases(state, due_ms, key) WHERE state IS NOT NULL;")
        .map_err(store_err)
}

/// The queue index column (`q_shard`: the queue shard of a lease item with queued waiters or an
/// undelivered grant, NULL otherwise) and its index, added to files created before them; rows
/// of keys with a queue get their shard, and waiter items leave the keep-alive index (they are
/// in no index now).
fn migrate_queues(conn: &Connection) -> Result<()> {
    let has: bool = conn
        .query_row("SELECT COUNT(*) FROM pragma_table_info('leases') WHERE name = 'q_shard'", [], |r| {
            r.get::<_, i64>(0)
        })
        .map_err(store_err)?
        > 0;
    if !has {
        if let Err(e) = conn.execute_batch("ALTER TABLE leases ADD COLUMN q_shard INTEGER;") {
            if !e.to_string().contains("duplicate column") {
                return Err(store_err(e));
            }
        }
        let rows: Vec<(String, String)> = conn
            .prepare("SELECT key, record FROM leases WHERE record LIKE '%\"queue_tail\"%' OR record LIKE '%\"pending_token\"%' OR record LIKE '%\"waiter\"%'")
            .and_then(|mut st| st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?.collect())
            .map_err(store_err)?;
        for (_, json) in rows {
            write(conn, &decode(&json)?)?;
        }
    }
    conn.execute_batch("CREATE INDEX IF NOT EXISTS leases_queue ON leases(q_shard, key) WHERE q_shard IS NOT NULL;")
        .map_err(store_err)
}

/// The queue index entry of a record: lease items with queued waiters or an undelivered grant.
fn queue_index(r: &Record) -> Option<i64> {
    (r.waiter.is_none() && (r.queue_len() > 0 || r.pending_token.is_some()))
        .then(|| crate::queue::queue_shard(&r.key) as i64)
}

fn read(c: &Connection, key: &str) -> Result<Option<Record>> {
    let json: Option<String> = c
        .prepare_cached("SELECT record FROM leases WHERE key = ?1")
        .and_then(|mut st| st.query_row([key], |r| r.get(0)).optional())
        .map_err(store_err)?;
    json.as_deref().map(decode).transpose()
}

fn write(c: &Connection, r: &Record) -> Result<()> {
    let json = serde_json::to_string(r).expect("record serialises");
    let (shard, until) = match (&r.keepalive, &r.waiter) {
        (Some(k), None) => (Some(keepalive_shard(&r.key, KEEPALIVE_SHARDS) as i64), Some(k.until_ms as i64)),
        _ => (None, None),
    };
    let q_shard = queue_index(r);
    let due = r.state.as_ref().and(r.expires_at_ms).map(|e| e.min(i64::MAX as u64) as i64);
    // Statements are prepared once per connection (the write path is the hot path).
    c.prepare_cached(
        "INSERT INTO leases (key, record, fence, ka_shard, ka_until_ms, ttl, state, due_ms, q_shard)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
         ON CONFLICT(key) DO UPDATE SET record = excluded.record, fence = excluded.fence,
           ka_shard = excluded.ka_shard, ka_until_ms = excluded.ka_until_ms, ttl = excluded.ttl,
           state = excluded.state, due_ms = excluded.due_ms, q_shard = excluded.q_shard",
    )
    .and_then(|mut st| {
        st.execute(params![r.key, json, r.fence as i64, shard, until, r.ttl.map(|t| t as i64), r.state, due, q_shard])
    })
    .map_err(store_err)?;
    Ok(())
}

#[async_trait]
impl Store for SqliteStore {
    async fn delete(&self, key: &str, condition: &Condition) -> Result<Write> {
        let (key, condition) = (key.to_string(), condition.clone());
        self.blocking(move |c| {
            let tx = c.transaction_with_behavior(TransactionBehavior::Immediate).map_err(store_err)?;
            let old = read(&tx, &key)?;
            if !condition.holds(old.as_ref()) {
                return Ok(Write::Rejected(old));
            }
            tx.execute("DELETE FROM leases WHERE key = ?1", [&key]).map_err(store_err)?;
            tx.commit().map_err(store_err)?;
            Ok(Write::Applied(old.expect("condition held on an existing item")))
        })
        .await
    }

    fn name(&self) -> &'static str {
        "sqlite"
    }

    async fn get(&self, key: &str) -> Result<Option<Record>> {
        let key = key.to_string();
        self.blocking(move |c| read(c, &key)).await
    }

    async fn update(&self, key: &str, condition: &Condition, mutation: &Mutation) -> Result<Write> {
        let (key, condition, mutation) = (key.to_string(), condition.clone(), mutation.clone());
        self.blocking(move |c| {
            let tx = c.transaction_with_behavior(TransactionBehavior::Immediate).map_err(store_err)?;
            let old = read(&tx, &key)?;
            if !condition.holds(old.as_ref()) {
                return Ok(Write::Rejected(old));
            }
            let new = mutation.apply(&key, old.as_ref());
            write(&tx, &new)?;
            tx.commit().map_err(store_err)?;
            Ok(Write::Applied(new))
        })
        .await
    }

    async fn count(&self, kind: &ScanKind) -> Result<u64> {
        let ScanKind::State { state, free_at_ms, .. } = kind.clone() else {
            return super::count_pages(self, kind).await;
        };
        let until = free_at_ms.map_or(i64::MAX, |f| f.min(i64::MAX as u64) as i64);
        self.blocking(move |c| {
            c.query_row("SELECT COUNT(*) FROM leases WHERE state = ?1 AND due_ms <= ?2", params![state, until], |r| {
                r.get::<_, i64>(0)
            })
            .map(|n| n as u64)
            .map_err(store_err)
        })
        .await
    }

    async fn scan(&self, kind: &ScanKind, start: Option<&str>, limit: u32) -> Result<Page> {
        let (kind, start) = (kind.clone(), start.unwrap_or("").to_string());
        if let ScanKind::State { state, free_at_ms, .. } = kind {
            return self.blocking(move |c| scan_state(c, &state, free_at_ms, &start, limit)).await;
        }
        self.blocking(move |c| {
            let limit = limit.max(1) as i64;
            let rows: Vec<(String, String)> = match kind {
                ScanKind::All => {
                    let mut st = c
                        .prepare_cached("SELECT key, record FROM leases WHERE key > ?1 ORDER BY key LIMIT ?2")
                        .map_err(store_err)?;
                    let it = st.query_map(params![start, limit], |r| Ok((r.get(0)?, r.get(1)?))).map_err(store_err)?;
                    it.collect::<rusqlite::Result<_>>().map_err(store_err)?
                }
                ScanKind::Keepalive { shard, after_ms } => {
                    let mut st = c
                        .prepare_cached(
                            "SELECT key, record FROM leases WHERE ka_shard = ?1 AND ka_until_ms > ?2
                             AND key > ?3 ORDER BY key LIMIT ?4",
                        )
                        .map_err(store_err)?;
                    let it = st
                        .query_map(params![shard as i64, after_ms as i64, start, limit], |r| Ok((r.get(0)?, r.get(1)?)))
                        .map_err(store_err)?;
                    it.collect::<rusqlite::Result<_>>().map_err(store_err)?
                }
                ScanKind::Queue { shard } => {
                    let mut st = c
                        .prepare_cached(
                            "SELECT key, record FROM leases WHERE q_shard = ?1 AND key > ?2 ORDER BY key LIMIT ?3",
                        )
                        .map_err(store_err)?;
                    let it = st
                        .query_map(params![shard as i64, start, limit], |r| Ok((r.get(0)?, r.get(1)?)))
                        .map_err(store_err)?;
                    it.collect::<rusqlite::Result<_>>().map_err(store_err)?
                }
                ScanKind::State { .. } => unreachable!("scanned by scan_state"),
            };
            let next = if rows.len() as i64 == limit { rows.last().map(|(k, _)| k.clone()) } else { None };
            let items = rows.iter().map(|(_, j)| decode(j)).collect::<Result<Vec<_>>>()?;
            Ok(Page { items, next })
        })
        .await
    }
}

/// Keys in `state` (free at `free_at_ms` only, when given), in the order they became free
/// (`due_ms`, then key). The page token is the last row's `due_ms` and key.
fn scan_state(c: &Connection, state: &str, free_at_ms: Option<u64>, start: &str, limit: u32) -> Result<Page> {
    let limit = limit.max(1) as i64;
    let until = free_at_ms.map_or(i64::MAX, |f| f.min(i64::MAX as u64) as i64);
    let (after_due, after_key) = match start.split_once('\t') {
        Some((d, k)) => (d.parse::<i64>().map_err(|_| Error::invalid("invalid page token"))?, k.to_string()),
        None => (i64::MIN, String::new()),
    };
    let mut st = c
        .prepare_cached(
            "SELECT key, record, due_ms FROM leases WHERE state = ?1 AND due_ms <= ?2
             AND (due_ms, key) > (?3, ?4) ORDER BY due_ms, key LIMIT ?5",
        )
        .map_err(store_err)?;
    let rows: Vec<(String, String, i64)> = st
        .query_map(params![state, until, after_due, after_key, limit], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .map_err(store_err)?
        .collect::<rusqlite::Result<_>>()
        .map_err(store_err)?;
    let next = if rows.len() as i64 == limit { rows.last().map(|(k, _, d)| format!("{d}\t{k}")) } else { None };
    let items = rows.iter().map(|(_, j, _)| decode(j)).collect::<Result<Vec<_>>>()?;
    Ok(Page { items, next })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file made before the work-state columns existed opens, keeps its leases, and gets
    /// the columns and their index.
    #[tokio::test]
    async fn an_old_file_gets_the_state_columns() {
        let dir = std::env::temp_dir().join(format!("leasehold-migrate-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("leases.db");
        {
            let c = Connection::open(&path).unwrap();
            c.execute_batch(
                "CREATE TABLE leases (key TEXT PRIMARY KEY NOT NULL, record TEXT NOT NULL, fence INTEGER NOT NULL,
                   ka_shard INTEGER, ka_until_ms INTEGER, ttl INTEGER);
                 CREATE INDEX leases_keepalive ON leases(ka_shard, ka_until_ms) WHERE ka_shard IS NOT NULL;",
            )
            .unwrap();
            let old = r#"{"key":"old","fence":7,"holder":"h","lease_id":"abcdefghijabcdefghijab","acquired_at_ms":1,
                "expires_at_ms":2,"duration_ms":1,"min_hold_until_ms":1,"released_at_ms":null,"metadata":null,
                "keepalive":null,"ttl":null}"#;
            c.execute("INSERT INTO leases (key, record, fence) VALUES ('old', ?1, 7)", [old]).unwrap();
        }
        let store = SqliteStore::open(&path).unwrap();
        let r = store.get("old").await.unwrap().unwrap();
        assert_eq!((r.fence, r.state), (7, None));
        let m = Mutation::Enter { now_ms: 10, holder: "p".into(), state: "S".into(), shard: "S#0".into() };
        let c = Condition::Enterable { now_ms: 10, state: "S".into(), shard: "S#0".into() };
        assert!(matches!(store.update("old", &c, &m).await.unwrap(), Write::Applied(_)));
        let kind = ScanKind::State { state: "S".into(), shard: "S#0".into(), free_at_ms: Some(10) };
        assert_eq!(store.scan(&kind, None, 10).await.unwrap().items.len(), 1);
        assert_eq!(store.count(&kind).await.unwrap(), 1);
        drop(store);
        // Opening again (the columns exist now) changes nothing.
        let again = SqliteStore::open(&path).unwrap();
        assert_eq!(again.get("old").await.unwrap().unwrap().state.as_deref(), Some("S"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Every commit is synced before it is answered: `synchronous=FULL` (2) on the connection
    /// that writes, in WAL mode. NORMAL (1) could lose answered grants on power loss.
    #[test]
    fn every_commit_is_durable() {
        let dir = std::env::temp_dir().join(format!("leasehold-sync-{}", std::process::id()));
        let store = SqliteStore::open(dir.join("leases.db")).unwrap();
        let conn = store.conn.lock().unwrap();
        let sync: i64 = conn.query_row("PRAGMA synchronous", [], |r| r.get(0)).unwrap();
        let mode: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0)).unwrap();
        drop(conn);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!((sync, mode.as_str()), (2, "wal"), "synchronous must be FULL (2) in WAL mode");
    }
}
