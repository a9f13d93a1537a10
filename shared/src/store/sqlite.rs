//! The embedded store: one SQLite file that several processes on one machine can share.
//!
//! Every write is evaluated inside a `BEGIN IMMEDIATE` transaction (SQLite's database-wide
//! write lock, held across processes) that reads the item, evaluates the [`Condition`] and
//! applies the [`Mutation`] with their reference semantics, so the embedded store is
//! linearizable for every process that opens the same file. WAL mode lets readers proceed
//! during writes; `synchronous=FULL` makes every commit durable before it is answered.
//!
//! **Group commit.** One writer thread per store applies the writes; the writes that arrive
//! while a commit is in flight (its fsync) wait together and go into the next transaction:
//! one `BEGIN IMMEDIATE`, each write evaluated under its own condition in arrival order (a
//! later write sees the earlier ones; a failed condition touches nothing), one `COMMIT` and
//! one sync for all of them. Each write is answered only after the commit that holds it
//! returned (DESIGN.md, "The embedded store").

use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

use super::{keepalive_shard, reference, Condition, Mutation, Page, ScanKind, Store, Write, KEEPALIVE_SHARDS};
use crate::clock::{Clock, ClockSamples, Sample, SystemClock};
use crate::error::{Error, Result};
use crate::model::Record;

#[derive(Clone)]
pub struct SqliteStore {
    /// The connection reads (get, scan, count) use; in WAL mode they never wait for writes.
    conn: Arc<Mutex<Connection>>,
    /// The writer thread's queue (see [`writer`]): it ends when the last handle is dropped.
    writes: mpsc::Sender<Job>,
    /// The writer thread's connection (locked by that thread only, per group; kept here so
    /// tests can read its settings).
    #[cfg_attr(not(test), allow(dead_code))]
    write_conn: Arc<Mutex<Connection>>,
    /// How many transactions the writer committed (tests: writes were grouped).
    #[cfg_attr(not(test), allow(dead_code))]
    groups: Arc<std::sync::atomic::AtomicU64>,
    path: PathBuf,
    /// The store's own clock: this machine's, read as each answer comes back (DESIGN.md,
    /// "Clocks": the same check and corrections as for DynamoDB's `Date`, exact here).
    reference_clock: Arc<dyn Clock>,
    samples: Arc<ClockSamples>,
}

/// How the writer's commits are synced. The product always uses [`Synchronous::Full`]; `Normal`
/// exists for the `serve_load` benchmark's comparison only (a power loss can roll back
/// answered writes under it).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Synchronous {
    Full,
    Normal,
}

impl Synchronous {
    fn pragma(self) -> &'static str {
        match self {
            Synchronous::Full => "FULL",
            Synchronous::Normal => "NORMAL",
        }
    }

    /// `Full`, unless `LEASEHOLD_BENCH_SYNCHRONOUS=NORMAL` (undocumented: for the benchmark's
    /// comparison only).
    fn from_env() -> Synchronous {
        match std::env::var("LEASEHOLD_BENCH_SYNCHRONOUS") {
            Ok(v) if v.eq_ignore_ascii_case("normal") => {
                tracing::warn!("embedded store: synchronous=NORMAL (benchmark setting): answered writes can be lost");
                Synchronous::Normal
            }
            _ => Synchronous::Full,
        }
    }
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
    /// Opens (creating if needed) the store file at `path`. Any number of processes may open
    /// one file at once, new or old: the switch to WAL is retried while another process holds
    /// the file, and the schema is created and migrated in one write transaction, versioned
    /// with `PRAGMA user_version` (DESIGN.md, "The embedded store").
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        if let Some(dir) = path.parent() {
            if !dir.as_os_str().is_empty() {
                std::fs::create_dir_all(dir)
                    .map_err(|e| Error::StoreUnavailable(format!("cannot create {}: {e}", dir.display())))?;
            }
        }
        SqliteStore::open_with(path, Synchronous::from_env())
    }

    /// [`SqliteStore::open`] with the commits synced as `sync` says (the benchmark's comparison).
    #[doc(hidden)]
    pub fn open_with(path: PathBuf, sync: Synchronous) -> Result<Self> {
        let write_conn = Arc::new(Mutex::new(connect(&path, sync)?));
        let groups = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let conn = connect(&path, sync)?;
        let (writes, queue) = mpsc::channel();
        let (c, g) = (write_conn.clone(), groups.clone());
        std::thread::Builder::new()
            .name("leasehold-sqlite-writer".into())
            .spawn(move || writer(&c, &queue, &g))
            .map_err(|e| Error::StoreUnavailable(format!("embedded store: cannot start its writer: {e}")))?;
        Ok(SqliteStore {
            conn: Arc::new(Mutex::new(conn)),
            writes,
            write_conn,
            groups,
            path,
            reference_clock: Arc::new(SystemClock),
            samples: Arc::new(ClockSamples::exact()),
        })
    }

    /// This handle with `clock` as the store's own clock (tests: a machine's clock that
    /// coordinators with clocks of their own are judged against), and evidence of its own.
    #[doc(hidden)]
    pub fn with_reference_clock(self, clock: Arc<dyn Clock>) -> Self {
        SqliteStore { reference_clock: clock, samples: Arc::new(ClockSamples::exact()), ..self }
    }

    /// `answer`, noting the store's clock as it comes back: the evidence coordinators check
    /// their clocks against (read after the request was made and before it is answered).
    fn sampled<T>(&self, sent: Instant, answer: Result<T>) -> Result<T> {
        if answer.is_ok() {
            let date_us = self.reference_clock.wall_us();
            self.samples.record(Sample { sent, received: self.reference_clock.now(), date_us });
        }
        answer
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
        self.submit(|reply| Job::Purge { now_ms, reply }).await
    }

    /// Queues one write for the writer thread and waits for its answer, which comes after the
    /// commit that holds it.
    async fn submit<T>(&self, job: impl FnOnce(Reply<T>) -> Job) -> Result<T> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let gone = || Error::StoreUnavailable("embedded store: its writer stopped".into());
        self.writes.send(job(Reply::new(reply))).map_err(|_| gone())?;
        answer.await.map_err(|_| gone())?
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

/// How long a statement waits for another connection's lock (SQLite's busy handler) before
/// it answers `SQLITE_BUSY`.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// How long opening a file keeps retrying the steps SQLite can answer `SQLITE_BUSY` to without
/// waiting in its busy handler (the switch to WAL while other processes open the same file).
const OPEN_TIMEOUT: Duration = Duration::from_secs(30);

/// The schema version of the file (`PRAGMA user_version`), set by [`migrate`] in the same
/// transaction that brings the schema to it. 0: a new file, or one made before versioning.
/// 1: the `leases` table with the work-state columns and the keep-alive and state indexes.
/// 2: the queue index (`q_shard`). 3: the lease history table and its indexes. Migrations only
/// add (columns, tables, indexes), so a file of a later version opens as it is.
const SCHEMA_VERSION: i64 = 3;

/// One connection to the file, ready for use: the busy timeout first (every later statement,
/// on every connection, waits for other processes' locks), WAL (retried: switching the
/// journal mode can answer `SQLITE_BUSY` without calling the busy handler while another
/// process opens or switches the same file), `synchronous=FULL` with `fullfsync`, and the
/// schema at [`SCHEMA_VERSION`].
fn connect(path: &Path, sync: Synchronous) -> Result<Connection> {
    let conn = Connection::open(path).map_err(store_err)?;
    conn.busy_timeout(BUSY_TIMEOUT).map_err(store_err)?;
    let deadline = SystemClock.now() + OPEN_TIMEOUT;
    retry_busy(deadline, || {
        let mode: String = conn.pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))?;
        if mode.eq_ignore_ascii_case("wal") {
            return Ok(());
        }
        // The mode could not be changed now (it answers the old one): as busy, try again.
        Err(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_BUSY),
            Some(format!("journal_mode is {mode}, not wal")),
        ))
    })
    .map_err(store_err)?;
    conn.pragma_update(None, "synchronous", sync.pragma()).map_err(store_err)?;
    // On macOS a plain fsync() does not reach the disk's platters (only F_FULLFSYNC does), so
    // `synchronous=FULL` alone would not make a commit durable there. Elsewhere SQLite
    // ignores it.
    conn.pragma_update(None, "fullfsync", "ON").map_err(store_err)?;
    retry_busy(deadline, || migrate(&conn)).map_err(store_err)?;
    Ok(conn)
}

/// Runs `step` again (after a short random pause) while it answers `SQLITE_BUSY` or
/// `SQLITE_LOCKED`, until `deadline`.
fn retry_busy<T>(deadline: Instant, mut step: impl FnMut() -> rusqlite::Result<T>) -> rusqlite::Result<T> {
    loop {
        match step() {
            Err(rusqlite::Error::SqliteFailure(e, _))
                if matches!(e.code, rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
                    && SystemClock.now() < deadline =>
            {
                std::thread::sleep(crate::backoff::jitter(Duration::from_millis(20)));
            }
            r => return r,
        }
    }
}

/// Brings the schema to [`SCHEMA_VERSION`] in one `BEGIN IMMEDIATE` transaction (the file's
/// write lock, across processes), which also sets the version: another process opening the
/// same file at once either sees the whole schema or waits for it, never a part. A file made
/// before versioning (version 0 with a `leases` table) gets what it lacks: the work-state
/// columns (`state`, and `due_ms`: the expiry of a key in a state, NULL while it is held
/// fail-closed; NULL is right for the rows written before, which hold no state) and the
/// indexes.
fn migrate(conn: &Connection) -> rusqlite::Result<()> {
    let version = |c: &Connection| c.pragma_query_value(None, "user_version", |r| r.get::<_, i64>(0));
    if version(conn)? >= SCHEMA_VERSION {
        return Ok(());
    }
    let tx = rusqlite::Transaction::new_unchecked(conn, TransactionBehavior::Immediate)?;
    if version(&tx)? < 1 {
        tx.execute_batch(
            "CREATE TABLE IF NOT EXISTS leases (
                key TEXT PRIMARY KEY NOT NULL,
                record TEXT NOT NULL,
                fence INTEGER NOT NULL,
                ka_shard INTEGER,
                ka_until_ms INTEGER,
                ttl INTEGER,
                state TEXT,
                due_ms INTEGER
            );",
        )?;
        for column in ["state TEXT", "due_ms INTEGER"] {
            let name = column.split(' ').next().expect("column name");
            let has: i64 =
                tx.query_row("SELECT COUNT(*) FROM pragma_table_info('leases') WHERE name = ?1", [name], |r| r.get(0))?;
            if has == 0 {
                tx.execute_batch(&format!("ALTER TABLE leases ADD COLUMN {column};"))?;
            }
        }
        tx.execute_batch(
            "CREATE INDEX IF NOT EXISTS leases_keepalive ON leases(ka_shard, ka_until_ms)
                WHERE ka_shard IS NOT NULL;
             CREATE INDEX IF NOT EXISTS leases_state ON leases(state, due_ms, key) WHERE state IS NOT NULL;",
        )?;
    }
    if version(&tx)? < 2 {
        // The queue index column (`q_shard`: the queue shard of a lease item with queued
        // waiters or an undelivered grant, NULL otherwise) and its index. Rows of keys with a
        // queue get their shard, and waiter items leave the keep-alive index (they are in no
        // index now): rewritten as `write` writes them.
        let has: i64 =
            tx.query_row("SELECT COUNT(*) FROM pragma_table_info('leases') WHERE name = 'q_shard'", [], |r| r.get(0))?;
        if has == 0 {
            tx.execute_batch("ALTER TABLE leases ADD COLUMN q_shard INTEGER;")?;
        }
        let rows: Vec<String> = tx
            .prepare(
                "SELECT record FROM leases WHERE record LIKE '%\"queue_tail\"%' OR record LIKE '%\"pending_token\"%'
                 OR record LIKE '%\"waiter\"%'",
            )?
            .query_map([], |r| r.get(0))?
            .collect::<rusqlite::Result<_>>()?;
        for json in rows {
            let record = decode(&json).map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?;
            write(&tx, &record)?;
        }
        tx.execute_batch("CREATE INDEX IF NOT EXISTS leases_queue ON leases(q_shard, key) WHERE q_shard IS NOT NULL;")?;
    }
    if version(&tx)? < 3 {
        // Files of version 2 may have the history table already (it was made on every open,
        // outside the versioned migration): the statements are idempotent.
        super::sqlite_history::create_schema(&tx)?;
    }
    tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
    tx.commit()
}

/// The queue index entry of a record: lease items with queued waiters or an undelivered grant.
fn queue_index(r: &Record) -> Option<i64> {
    (r.queue.waiter.is_none() && (r.queue_len() > 0 || r.queue.pending_token.is_some()))
        .then(|| super::queue_shard(&r.key) as i64)
}

fn read(c: &Connection, key: &str) -> Result<Option<Record>> {
    read_json(c, key).map_err(store_err)?.as_deref().map(decode).transpose()
}

fn read_json(c: &Connection, key: &str) -> rusqlite::Result<Option<String>> {
    c.prepare_cached("SELECT record FROM leases WHERE key = ?1")
        .and_then(|mut st| st.query_row([key], |r| r.get(0)).optional())
}

fn write(c: &Connection, r: &Record) -> rusqlite::Result<()> {
    let json = serde_json::to_string(r).expect("record serialises");
    let (shard, until) = match (&r.keepalive, &r.queue.waiter) {
        (Some(k), None) => (Some(keepalive_shard(&r.key, KEEPALIVE_SHARDS) as i64), Some(k.until_ms as i64)),
        _ => (None, None),
    };
    let q_shard = queue_index(r);
    let due = r.work.state.as_ref().and(r.expires_at_ms).map(|e| e.min(i64::MAX as u64) as i64);
    // Statements are prepared once per connection (the write path is the hot path).
    c.prepare_cached(
        "INSERT INTO leases (key, record, fence, ka_shard, ka_until_ms, ttl, state, due_ms, q_shard)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
         ON CONFLICT(key) DO UPDATE SET record = excluded.record, fence = excluded.fence,
           ka_shard = excluded.ka_shard, ka_until_ms = excluded.ka_until_ms, ttl = excluded.ttl,
           state = excluded.state, due_ms = excluded.due_ms, q_shard = excluded.q_shard",
    )
    .and_then(|mut st| {
        st.execute(params![
            r.key,
            json,
            r.fence as i64,
            shard,
            until,
            r.ttl.map(|t| t as i64),
            r.work.state,
            due,
            q_shard
        ])
    })?;
    Ok(())
}

/// One write for the writer thread, and where its answer goes: a write's answer is a
/// [`Write`], a purge's how many items it deleted.
// Moved once, through the writer's queue: boxing the large variant would only add an allocation.
#[allow(clippy::large_enum_variant)]
enum Job {
    Update {
        key: String,
        condition: Condition,
        mutation: Mutation,
        reply: Reply<Write>,
    },
    Delete {
        key: String,
        condition: Condition,
        reply: Reply<Write>,
    },
    /// [`SqliteStore::purge_expired`].
    Purge {
        now_ms: u64,
        reply: Reply<usize>,
    },
}

/// Where a job's answer goes, and the answer its group's transaction gave it (none before);
/// sent once that transaction committed, or failed.
struct Reply<T> {
    to: tokio::sync::oneshot::Sender<Result<T>>,
    answer: Option<Result<T>>,
}

impl<T> Reply<T> {
    fn new(to: tokio::sync::oneshot::Sender<Result<T>>) -> Reply<T> {
        Reply { to, answer: None }
    }

    /// Keeps the answer of an evaluation; a failed statement abandons the transaction.
    fn keep(&mut self, evaluated: rusqlite::Result<Result<T>>) -> rusqlite::Result<()> {
        self.answer = Some(evaluated?);
        Ok(())
    }

    /// Sends the answer (a write its group never answered was not committed). A caller that
    /// stopped waiting (a dropped future) gets nothing; its write stands.
    fn send(self) {
        let not_committed = || Err(Error::StoreUnavailable("embedded store: the write was not committed".into()));
        let _ = self.to.send(self.answer.unwrap_or_else(not_committed));
    }
}

impl Job {
    /// Evaluates this job inside the open transaction `tx`, keeping its answer for after the
    /// commit. The error is a failed statement (the transaction is abandoned); a write's own
    /// error (an undecodable item, or a panic in its evaluation before it wrote anything) is
    /// its answer.
    fn run(&mut self, tx: &Connection) -> rusqlite::Result<()> {
        match self {
            Job::Update { key, condition, mutation, reply } => {
                reply.keep(guarded(|| evaluated(reference::update(&mut Txn(tx), key, condition, mutation))))
            }
            Job::Delete { key, condition, reply } => {
                reply.keep(guarded(|| evaluated(reference::delete(&mut Txn(tx), key, condition))))
            }
            Job::Purge { now_ms, reply } => reply.keep(guarded(|| {
                let n = tx
                    .prepare_cached("DELETE FROM leases WHERE ttl IS NOT NULL AND ttl < ?1 AND fence < ?2")?
                    .execute(params![(*now_ms / 1000) as i64, now_ms.saturating_mul(1000) as i64])?;
                Ok(Ok(n))
            })),
        }
    }

    /// This job failed with its group's transaction.
    fn fail(&mut self, e: Error) {
        match self {
            Job::Update { reply, .. } | Job::Delete { reply, .. } => reply.answer = Some(Err(e)),
            Job::Purge { reply, .. } => reply.answer = Some(Err(e)),
        }
    }

    fn send(self) {
        match self {
            Job::Update { reply, .. } | Job::Delete { reply, .. } => reply.send(),
            Job::Purge { reply, .. } => reply.send(),
        }
    }
}

/// A panic in a write's own evaluation (before it wrote anything) is that write's error.
fn guarded<T>(f: impl FnOnce() -> rusqlite::Result<Result<T>>) -> rusqlite::Result<Result<T>> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|_| Ok(Err(Error::StoreUnavailable("embedded store: the write panicked".into()))))
}

/// The embedded store's table, as the reference evaluation reads and writes it: the open write
/// transaction. Everything a write changes is written here, in that transaction.
struct Txn<'a>(&'a Connection);

/// Why an evaluation stopped: a failed statement (the transaction is abandoned), or this
/// write's own item that cannot be decoded (nothing written).
enum Stop {
    Statement(rusqlite::Error),
    Item(Error),
}

/// The outcome of an evaluation: the outer error abandons the transaction, the inner one is the
/// write's alone.
fn evaluated(r: std::result::Result<Write, Stop>) -> rusqlite::Result<Result<Write>> {
    match r {
        Ok(w) => Ok(Ok(w)),
        Err(Stop::Item(e)) => Ok(Err(e)),
        Err(Stop::Statement(e)) => Err(e),
    }
}

impl reference::Table for Txn<'_> {
    type Error = Stop;

    fn read(&mut self, key: &str) -> std::result::Result<Option<Record>, Stop> {
        read_json(self.0, key).map_err(Stop::Statement)?.as_deref().map(decode).transpose().map_err(Stop::Item)
    }

    fn put(&mut self, _key: &str, old: Option<Record>, new: &Record, _: &Mutation) -> std::result::Result<(), Stop> {
        write(self.0, new).map_err(Stop::Statement)?;
        // The lease history, in the same transaction as the change (a failure abandons the
        // transaction, as a failed statement does).
        super::sqlite_history::record(self.0, old.as_ref(), Some(new))
            .map_err(|e| Stop::Statement(rusqlite::Error::ToSqlConversionFailure(Box::new(e))))
    }

    fn remove(&mut self, key: &str, _: &Record) -> std::result::Result<(), Stop> {
        let mut st = self.0.prepare_cached("DELETE FROM leases WHERE key = ?1").map_err(Stop::Statement)?;
        st.execute([key]).map(|_| ()).map_err(Stop::Statement)
    }
}

/// The most writes one transaction takes (the rest go into the next).
const MAX_GROUP: usize = 256;

/// The writer thread: takes the first queued write, and with it every write queued behind it
/// (those that arrived while the previous commit was in flight), commits them as one group,
/// answers each, and goes again. Ends when every [`SqliteStore`] handle is gone.
fn writer(conn: &Mutex<Connection>, queue: &mpsc::Receiver<Job>, groups: &std::sync::atomic::AtomicU64) {
    while let Ok(first) = queue.recv() {
        let mut group = vec![first];
        while group.len() < MAX_GROUP {
            match queue.try_recv() {
                Ok(job) => group.push(job),
                Err(_) => break,
            }
        }
        let conn = conn.lock().unwrap_or_else(|p| p.into_inner());
        commit_group(&conn, &mut group);
        groups.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        for job in group {
            job.send();
        }
    }
}

/// Why a group's transaction failed.
enum GroupFailure {
    /// `BEGIN IMMEDIATE` failed (the file's write lock not had within the busy timeout):
    /// nothing was tried.
    Begin(rusqlite::Error),
    /// A statement or the `COMMIT` failed: the whole group was rolled back.
    Later(rusqlite::Error),
}

/// One transaction for `group`, in order, each answered as its own write would have been. If
/// the transaction fails after its start (a statement or the commit), nothing of it stays and
/// each write is tried again alone, so one write's failure is not the others'.
fn commit_group(conn: &Connection, group: &mut [Job]) {
    match run_group(conn, group) {
        Ok(()) => {}
        Err(GroupFailure::Later(_)) if group.len() > 1 => {
            for job in group.iter_mut() {
                if let Err(GroupFailure::Begin(e) | GroupFailure::Later(e)) = run_group(conn, std::slice::from_mut(job))
                {
                    job.fail(store_err(e));
                }
            }
        }
        Err(GroupFailure::Begin(e) | GroupFailure::Later(e)) => {
            let msg = store_err(e).to_string();
            for job in group.iter_mut() {
                job.fail(Error::StoreUnavailable(msg.clone()));
            }
        }
    }
}

fn run_group(conn: &Connection, group: &mut [Job]) -> std::result::Result<(), GroupFailure> {
    let tx = rusqlite::Transaction::new_unchecked(conn, TransactionBehavior::Immediate).map_err(GroupFailure::Begin)?;
    for job in group.iter_mut() {
        job.run(&tx).map_err(GroupFailure::Later)?;
    }
    tx.commit().map_err(GroupFailure::Later)
}

#[async_trait]
impl Store for SqliteStore {
    async fn delete(&self, key: &str, condition: &Condition) -> Result<Write> {
        self.submit(|reply| Job::Delete { key: key.to_string(), condition: condition.clone(), reply }).await
    }

    fn name(&self) -> &'static str {
        "sqlite"
    }

    async fn get(&self, key: &str) -> Result<Option<Record>> {
        let (key, sent) = (key.to_string(), self.reference_clock.now());
        let answer = self.blocking(move |c| read(c, &key)).await;
        self.sampled(sent, answer)
    }

    async fn update(&self, key: &str, condition: &Condition, mutation: &Mutation) -> Result<Write> {
        let job = |reply| Job::Update {
            key: key.to_string(),
            condition: condition.clone(),
            mutation: mutation.clone(),
            reply,
        };
        let sent = self.reference_clock.now();
        let answer = self.submit(job).await;
        self.sampled(sent, answer)
    }

    fn clock(&self) -> Option<&ClockSamples> {
        Some(&self.samples)
    }

    async fn count(&self, kind: &ScanKind) -> Result<u64> {
        let ScanKind::State { state, free_at_ms, shard } = kind.clone() else {
            return super::count_pages(self, kind).await;
        };
        if !first_partition(&shard) {
            return Ok(0);
        }
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
        self.blocking(move |c| {
            let max = limit.max(1) as i64;
            let rows: Vec<(String, String)> = match kind {
                ScanKind::State { shard, .. } if !first_partition(&shard) => {
                    return Ok(Page { items: vec![], next: None })
                }
                ScanKind::State { state, free_at_ms, .. } => return scan_state(c, &state, free_at_ms, &start, limit),
                ScanKind::All | ScanKind::Snapshot => {
                    let mut st = c
                        .prepare_cached("SELECT key, record FROM leases WHERE key > ?1 ORDER BY key LIMIT ?2")
                        .map_err(store_err)?;
                    let it = st.query_map(params![start, max], |r| Ok((r.get(0)?, r.get(1)?))).map_err(store_err)?;
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
                        .query_map(params![shard as i64, after_ms as i64, start, max], |r| Ok((r.get(0)?, r.get(1)?)))
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
                        .query_map(params![shard as i64, start, max], |r| Ok((r.get(0)?, r.get(1)?)))
                        .map_err(store_err)?;
                    it.collect::<rusqlite::Result<_>>().map_err(store_err)?
                }
            };
            let next = if rows.len() as i64 == max { rows.last().map(|(k, _)| k.clone()) } else { None };
            let items = rows.iter().map(|(_, j)| decode(j)).collect::<Result<Vec<_>>>()?;
            Ok(Page { items, next })
        })
        .await
    }
}

/// Whether `shard` (`STATE#n`) is a state's first partition. The embedded store keeps each
/// state in one partition, its index on (`state`, `due_ms`, `key`): the whole state answers as
/// partition 0 and the others are empty, so a coordinator configured with `state_shards` > 1
/// reads, lists and counts each key once.
fn first_partition(shard: &str) -> bool {
    shard.rsplit_once('#').is_none_or(|(_, n)| n == "0")
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
    use crate::store::{WorkCondition, WorkMutation};

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
        assert_eq!((r.fence, r.work.state), (7, None));
        let m = Mutation::Work(WorkMutation::Enter {
            now_ms: 10,
            holder: "p".into(),
            state: "S".into(),
            shard: "S#0".into(),
            ttl: None,
        });
        let c = Condition::Work(WorkCondition::Enterable { now_ms: 10, state: "S".into(), shard: "S#0".into() });
        assert!(matches!(store.update("old", &c, &m).await.unwrap(), Write::Applied(_)));
        let kind = ScanKind::State { state: "S".into(), shard: "S#0".into(), free_at_ms: Some(10) };
        assert_eq!(store.scan(&kind, None, 10).await.unwrap().items.len(), 1);
        assert_eq!(store.count(&kind).await.unwrap(), 1);
        drop(store);
        let version: i64 = Connection::open(&path).unwrap().query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
        assert_eq!(version, SCHEMA_VERSION);
        // The history table came with the versioned migration, and it holds the entry's event.
        let history: i64 = Connection::open(&path)
            .unwrap()
            .query_row("SELECT COUNT(*) FROM history WHERE key = 'old'", [], |r| r.get(0))
            .unwrap();
        assert_eq!(history, 1);
        // Opening again (the columns exist now) changes nothing.
        let again = SqliteStore::open(&path).unwrap();
        assert_eq!(again.get("old").await.unwrap().unwrap().work.state.as_deref(), Some("S"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A file an earlier build left half-migrated (it added `state` and `due_ms` in two
    /// statements, and could stop between them) gets the missing column.
    #[tokio::test]
    async fn a_half_migrated_file_gets_the_missing_column() {
        let dir = std::env::temp_dir().join(format!("leasehold-migrate-half-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("leases.db");
        Connection::open(&path)
            .unwrap()
            .execute_batch(
                "CREATE TABLE leases (key TEXT PRIMARY KEY NOT NULL, record TEXT NOT NULL, fence INTEGER NOT NULL,
                   ka_shard INTEGER, ka_until_ms INTEGER, ttl INTEGER, state TEXT);",
            )
            .unwrap();
        let store = SqliteStore::open(&path).unwrap();
        let m = Mutation::Work(WorkMutation::Enter {
            now_ms: 10,
            holder: "p".into(),
            state: "S".into(),
            shard: "S#0".into(),
            ttl: None,
        });
        let c = Condition::Work(WorkCondition::Enterable { now_ms: 10, state: "S".into(), shard: "S#0".into() });
        assert!(matches!(store.update("k", &c, &m).await.unwrap(), Write::Applied(_)));
        let kind = ScanKind::State { state: "S".into(), shard: "S#0".into(), free_at_ms: Some(10) };
        assert_eq!(store.count(&kind).await.unwrap(), 1);
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Writes that queue while a commit is in flight go into one transaction, each under its
    /// own condition, in order: a later write sees the earlier ones, a failed condition
    /// changes nothing and does not stop the others.
    #[tokio::test]
    async fn queued_writes_commit_as_one_group_each_under_its_own_condition() {
        let dir = std::env::temp_dir().join(format!("leasehold-group-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = SqliteStore::open(dir.join("leases.db")).unwrap();
        fn update(key: &str, state: &str, reply: Reply<Write>) -> Job {
            let mutation = WorkMutation::Enter {
                now_ms: 10,
                holder: "p".into(),
                state: state.into(),
                shard: "s".into(),
                ttl: None,
            };
            let condition = WorkCondition::Enterable { now_ms: 10, state: state.into(), shard: "s".into() };
            Job::Update { key: key.into(), condition: condition.into(), mutation: mutation.into(), reply }
        }
        let send = |job: fn(Reply<Write>) -> Job| {
            let (reply, answer) = tokio::sync::oneshot::channel();
            store.writes.send(job(Reply::new(reply))).unwrap();
            answer
        };
        // The writer takes the first write and waits for its connection (held here); the
        // next five queue behind it.
        let held = store.write_conn.lock().unwrap();
        let first = send(|reply| update("a", "S", reply));
        std::thread::sleep(Duration::from_millis(200));
        let jobs: [fn(Reply<Write>) -> Job; 5] = [
            |reply| update("k", "S", reply),
            |reply| update("k", "S", reply),
            |reply| Job::Delete { key: "none".into(), condition: Condition::Exists, reply },
            |reply| update("j", "S", reply),
            |reply| update("k", "T", reply),
        ];
        let answers: Vec<_> = jobs.into_iter().map(send).collect();
        drop(held);
        assert!(matches!(first.await.unwrap().unwrap(), Write::Applied(_)));
        let mut got = Vec::new();
        for a in answers {
            got.push(a.await.unwrap().unwrap());
        }
        let state = |w: &Write| match w {
            Write::Applied(r) => format!("applied {}", r.work.state.as_deref().unwrap_or("-")),
            Write::Rejected(r) => {
                format!("rejected {}", r.as_ref().and_then(|r| r.work.state.as_deref()).unwrap_or("none"))
            }
        };
        let got: Vec<String> = got.iter().map(state).collect();
        assert_eq!(got, ["applied S", "rejected S", "rejected none", "applied S", "applied T"]);
        assert_eq!(store.groups.load(std::sync::atomic::Ordering::Relaxed), 2, "one transaction for the five");
        assert_eq!(store.get("k").await.unwrap().unwrap().work.state.as_deref(), Some("T"));
        assert_eq!(store.get("j").await.unwrap().unwrap().work.state.as_deref(), Some("S"));
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Every commit is synced before it is answered: `synchronous=FULL` (2) on the connection
    /// that writes, in WAL mode. NORMAL (1) could lose answered grants on power loss.
    #[test]
    fn every_commit_is_durable() {
        let dir = std::env::temp_dir().join(format!("leasehold-sync-{}", std::process::id()));
        let store = SqliteStore::open(dir.join("leases.db")).unwrap();
        let conn = store.write_conn.lock().unwrap();
        let sync: i64 = conn.query_row("PRAGMA synchronous", [], |r| r.get(0)).unwrap();
        let mode: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0)).unwrap();
        let fullfsync: i64 = conn.query_row("PRAGMA fullfsync", [], |r| r.get(0)).unwrap();
        drop(conn);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!((sync, mode.as_str()), (2, "wal"), "synchronous must be FULL (2) in WAL mode");
        assert_eq!(fullfsync, 1, "fullfsync must be on (macOS: a plain fsync does not reach the disk)");
    }
}
