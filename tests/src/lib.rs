//! Test harness: starts the real DynamoDB Local (installed by scripts/install-test-deps.sh),
//! builds coordinators over both stores, and wraps stores to inject faults or count requests.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use leasehold::store::{Condition, DynamoStore, Mutation, Page, ScanKind, SqliteStore, Store, Write};
use leasehold::{Config, Coordinator, Error, Record, Result};

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("repo root").to_path_buf()
}

/// Where the test tools live (see scripts/install-test-deps.sh).
pub fn tools_dir() -> PathBuf {
    std::env::var_os("LEASEHOLD_TOOLS").map(PathBuf::from).unwrap_or_else(|| repo_root().join(".tools"))
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// A DynamoDB Local server owned by this test process. It is started under a small shell
/// watchdog that kills it when this process's end of a pipe closes, so no server outlives
/// the tests even when they panic or are killed.
pub struct DynamoLocal {
    pub endpoint: String,
    pub port: u16,
    child: Mutex<Child>,
}

impl DynamoLocal {
    /// Starts DynamoDB Local on a free port, in memory (or persisting into `db_path`).
    pub fn start(db_path: Option<&std::path::Path>) -> DynamoLocal {
        Self::start_on(free_port(), db_path)
    }

    pub fn start_on(port: u16, db_path: Option<&std::path::Path>) -> DynamoLocal {
        let dir = tools_dir().join("dynamodb-local");
        let jar = dir.join("DynamoDBLocal.jar");
        assert!(jar.exists(), "DynamoDB Local is not installed at {}: run scripts/install-test-deps.sh", jar.display());
        let storage = match db_path {
            Some(p) => format!("-dbPath '{}'", p.display()),
            None => "-inMemory".to_string(),
        };
        let work = std::env::temp_dir().join(format!("leasehold-ddb-{port}"));
        std::fs::create_dir_all(&work).expect("workdir");
        let script = format!(
            "java -Djava.library.path='{lib}' -jar '{jar}' {storage} -port {port} -disableTelemetry >/dev/null 2>&1 & pid=$!; \
             echo started; cat >/dev/null; kill $pid 2>/dev/null; sleep 0.5; kill -9 $pid 2>/dev/null",
            lib = dir.join("DynamoDBLocal_lib").display(),
            jar = jar.display(),
        );
        let mut child = Command::new("bash")
            .arg("-c")
            .arg(script)
            .current_dir(&work)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start DynamoDB Local");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("watchdog");
        let me = DynamoLocal { endpoint: format!("http://127.0.0.1:{port}"), port, child: Mutex::new(child) };
        me.wait_ready();
        me
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
        let client = rt.block_on(self.client());
        loop {
            if rt.block_on(client.list_tables().send()).is_ok() {
                return;
            }
            assert!(Instant::now() < deadline, "DynamoDB Local did not become ready on port {}", self.port);
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Stops the server (the watchdog kills java when its stdin closes).
    pub fn stop(&self) {
        let mut child = self.child.lock().unwrap();
        drop(child.stdin.take());
        let _ = child.wait();
    }

    pub async fn sdk_config(&self) -> aws_config::SdkConfig {
        sdk_config_for(&self.endpoint).await
    }

    pub async fn client(&self) -> aws_sdk_dynamodb::Client {
        aws_sdk_dynamodb::Client::new(&self.sdk_config().await)
    }

    /// A fresh, uniquely named lease table on this server.
    pub async fn store(&self) -> DynamoStore {
        static N: AtomicU64 = AtomicU64::new(0);
        let table = format!("leases-{}-{}", std::process::id(), N.fetch_add(1, Ordering::SeqCst));
        let store = DynamoStore::new(self.client().await, table);
        store.create_table().await.expect("create table");
        store
    }
}

impl Drop for DynamoLocal {
    fn drop(&mut self) {
        self.stop();
    }
}

/// SDK configuration for DynamoDB Local at `endpoint`, as the production store builds it
/// (retries off, bounded timeouts) but with dummy credentials.
pub async fn sdk_config_for(endpoint: &str) -> aws_config::SdkConfig {
    set_local_credentials();
    let base = leasehold::store::dynamo::load_sdk_config(Duration::from_secs(3)).await;
    base.into_builder().endpoint_url(endpoint).build()
}

/// DynamoDB Local accepts any credentials; make sure some are present.
pub fn set_local_credentials() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        // Set once, before any test thread reads the environment through the SDK.
        unsafe {
            if std::env::var_os("AWS_ACCESS_KEY_ID").is_none() {
                std::env::set_var("AWS_ACCESS_KEY_ID", "test");
                std::env::set_var("AWS_SECRET_ACCESS_KEY", "test");
            }
            if std::env::var_os("AWS_REGION").is_none() {
                std::env::set_var("AWS_REGION", "us-east-1");
            }
        }
    });
}

/// The DynamoDB Local shared by every test of this process.
pub fn dynamo_local() -> &'static DynamoLocal {
    static LOCAL: OnceLock<DynamoLocal> = OnceLock::new();
    LOCAL.get_or_init(|| {
        // Started on a plain thread: the readiness poll uses its own runtime.
        std::thread::spawn(|| DynamoLocal::start(None)).join().expect("start DynamoDB Local")
    })
}

/// A temporary directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicU64 = AtomicU64::new(0);
        let p = std::env::temp_dir().join(format!(
            "leasehold-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&p).expect("tempdir");
        TempDir(p)
    }
    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Test configuration: the documented defaults with short leases allowed.
pub fn test_config() -> Config {
    let mut c = Config::default();
    c.limits.min_duration = Duration::from_millis(100);
    c.skew_margin = Duration::from_millis(50);
    c.retry_budget = Duration::from_secs(3);
    c
}

pub enum Backend {
    Sqlite(SqliteStore, TempDir),
    Dynamo(DynamoStore),
}

impl Backend {
    pub async fn sqlite() -> Backend {
        let dir = TempDir::new("sqlite");
        Backend::Sqlite(SqliteStore::open(dir.path().join("leases.db")).expect("open sqlite"), dir)
    }
    pub async fn dynamo() -> Backend {
        let local = tokio::task::spawn_blocking(dynamo_local).await.expect("dynamo local");
        Backend::Dynamo(local.store().await)
    }
    pub fn store(&self) -> Arc<dyn Store> {
        match self {
            Backend::Sqlite(s, _) => Arc::new(s.clone()),
            Backend::Dynamo(d) => Arc::new(d.clone()),
        }
    }
    /// Another handle on the same data (another process's view, for the embedded store).
    pub fn reopen(&self) -> Arc<dyn Store> {
        match self {
            Backend::Sqlite(s, _) => Arc::new(SqliteStore::open(s.path()).expect("reopen")),
            Backend::Dynamo(d) => Arc::new(d.clone()),
        }
    }
    pub fn coordinator(&self, config: Config) -> Coordinator {
        Coordinator::new(self.store(), config)
    }
}

/// Counts the requests a coordinator sends to its store.
pub struct Counting {
    pub inner: Arc<dyn Store>,
    pub gets: AtomicUsize,
    pub updates: AtomicUsize,
    pub deletes: AtomicUsize,
    pub scans: AtomicUsize,
}

impl Counting {
    pub fn new(inner: Arc<dyn Store>) -> Arc<Counting> {
        Arc::new(Counting {
            inner,
            gets: AtomicUsize::new(0),
            updates: AtomicUsize::new(0),
            deletes: AtomicUsize::new(0),
            scans: AtomicUsize::new(0),
        })
    }
    pub fn total(&self) -> usize {
        self.gets.load(Ordering::SeqCst)
            + self.updates.load(Ordering::SeqCst)
            + self.deletes.load(Ordering::SeqCst)
            + self.scans.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl Store for Counting {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    async fn get(&self, key: &str) -> Result<Option<Record>> {
        self.gets.fetch_add(1, Ordering::SeqCst);
        self.inner.get(key).await
    }
    async fn update(&self, key: &str, c: &Condition, m: &Mutation) -> Result<Write> {
        self.updates.fetch_add(1, Ordering::SeqCst);
        self.inner.update(key, c, m).await
    }
    async fn delete(&self, key: &str, c: &Condition) -> Result<Write> {
        self.deletes.fetch_add(1, Ordering::SeqCst);
        self.inner.delete(key, c).await
    }
    async fn scan(&self, k: &ScanKind, s: Option<&str>, l: u32) -> Result<Page> {
        self.scans.fetch_add(1, Ordering::SeqCst);
        self.inner.scan(k, s, l).await
    }
}

/// What a [`Faulty`] store does to the next writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forward the write, then lose the answer (an ambiguous failure).
    LoseResponse,
    /// Answer "throttled" without forwarding.
    Throttle,
    /// Answer "unavailable" without forwarding.
    Unavailable,
}

/// Injects faults into the next writes of a real store.
pub struct Faulty {
    pub inner: Arc<dyn Store>,
    pub plan: Mutex<Vec<Fault>>,
    pub injected: AtomicUsize,
}

impl Faulty {
    pub fn new(inner: Arc<dyn Store>) -> Arc<Faulty> {
        Arc::new(Faulty { inner, plan: Mutex::new(Vec::new()), injected: AtomicUsize::new(0) })
    }
    /// Faults for the next writes, in order.
    pub fn inject(&self, faults: &[Fault]) {
        let mut p = self.plan.lock().unwrap();
        p.extend(faults.iter().rev());
    }
    fn next_fault(&self) -> Option<Fault> {
        let f = self.plan.lock().unwrap().pop();
        if f.is_some() {
            self.injected.fetch_add(1, Ordering::SeqCst);
        }
        f
    }
}

#[async_trait]
impl Store for Faulty {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    async fn get(&self, key: &str) -> Result<Option<Record>> {
        self.inner.get(key).await
    }
    async fn update(&self, key: &str, c: &Condition, m: &Mutation) -> Result<Write> {
        match self.next_fault() {
            None => self.inner.update(key, c, m).await,
            Some(Fault::LoseResponse) => {
                let _ = self.inner.update(key, c, m).await?;
                Err(Error::StoreUnavailable("injected: response lost after the write".into()))
            }
            Some(Fault::Throttle) => Err(Error::Throttled("injected throttle".into())),
            Some(Fault::Unavailable) => Err(Error::StoreUnavailable("injected outage".into())),
        }
    }
    async fn delete(&self, key: &str, c: &Condition) -> Result<Write> {
        self.inner.delete(key, c).await
    }
    async fn scan(&self, k: &ScanKind, s: Option<&str>, l: u32) -> Result<Page> {
        self.inner.scan(k, s, l).await
    }
}

/// The resource a lease guards: it accepts a write only with a fence at least as high as the
/// highest it has seen, and records every accepted write for overlap checks.
#[derive(Default)]
pub struct GuardedResource {
    inner: Mutex<GuardState>,
}

#[derive(Default)]
struct GuardState {
    highest: u64,
    accepted: u64,
    rejected: u64,
}

impl GuardedResource {
    /// Returns false (and counts a rejection) when `fence` is below the highest seen.
    pub fn write(&self, fence: u64) -> bool {
        let mut s = self.inner.lock().unwrap();
        if fence < s.highest {
            s.rejected += 1;
            return false;
        }
        s.highest = fence;
        s.accepted += 1;
        true
    }
    pub fn accepted(&self) -> u64 {
        self.inner.lock().unwrap().accepted
    }
    pub fn rejected(&self) -> u64 {
        self.inner.lock().unwrap().rejected
    }
}
