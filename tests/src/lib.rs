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
use leasehold::store::{Condition, DynamoStore, LeaseMutation, Mutation, Page, ScanKind, SqliteStore, Store, Write};
use leasehold::{Config, Coordinator, Error, Record, Result};

pub mod apigw;
pub mod cfn;
pub mod emulator;
pub mod http;
pub mod lambda_lab;
pub mod proxy;
pub mod sfn_quotas;
pub mod sfn_throttle;
pub mod statemachines;
pub mod wrap;

pub use wrap::{wrap, Intercept, Wrapped};

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("repo root").to_path_buf()
}

/// Where the test tools live (see scripts/install-test-deps.sh).
pub fn tools_dir() -> PathBuf {
    std::env::var_os("LEASEHOLD_TOOLS").map(PathBuf::from).unwrap_or_else(|| repo_root().join(".tools"))
}

/// A port for a server a test is about to start. Chosen below the kernel's ephemeral range
/// (32768 and up on Linux), so that no outgoing connection can be given it between this
/// choice and the server's bind, and never the same port twice in one process (two servers
/// started side by side once got the same port and one answered the other's requests).
pub fn free_port() -> u16 {
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static HANDED: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let mut handed = HANDED.lock().unwrap_or_else(|e| e.into_inner());
    // A different start in each process, so test processes running at once rarely collide.
    let seed = std::process::id().wrapping_mul(2_654_435_761)
        ^ std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    for i in 0..SPAN {
        let port = (LOW + (seed.wrapping_add(i.wrapping_mul(7_919))) % SPAN) as u16;
        if handed.contains(&port) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            handed.push(port);
            return port;
        }
    }
    panic!("no free port in {LOW}..{}", LOW + SPAN)
}

/// A server process owned by this test process. It runs in its own process group under a
/// small shell watchdog that kills the whole group when this process's end of a pipe
/// closes, so no server (nor its children) outlives the tests, even when they panic or are
/// killed.
pub struct Guarded {
    pub name: String,
    child: Child,
    pub log: PathBuf,
}

impl Guarded {
    /// Runs `cmd` (a bash command line) in `cwd` with extra `env`; output goes to a log file.
    pub fn spawn(name: &str, cmd: &str, cwd: &std::path::Path, env: &[(String, String)]) -> Guarded {
        static N: AtomicU64 = AtomicU64::new(0);
        let log = std::env::temp_dir().join(format!(
            "leasehold-{name}-{}-{}.log",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let script = format!(
            "set -m; ( {cmd} ) >'{log}' 2>&1 & pid=$!; echo started; cat >/dev/null; \
             kill -TERM -- -$pid 2>/dev/null; for i in 1 2 3 4 5 6 7 8 9 10; do kill -0 -- -$pid 2>/dev/null || exit 0; sleep 0.2; done; \
             kill -KILL -- -$pid 2>/dev/null; exit 0",
            log = log.display()
        );
        let mut command = Command::new("bash");
        command
            .arg("-c")
            .arg(script)
            .current_dir(cwd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        for (k, v) in env {
            command.env(k, v);
        }
        let mut child = command.spawn().unwrap_or_else(|e| panic!("start {name}: {e}"));
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("watchdog");
        Guarded { name: name.to_string(), child, log }
    }

    /// The server's output so far (for failure messages).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Stops the server and its children and waits for the watchdog.
    pub fn stop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Waits until something accepts TCP connections on `port` (without sending a byte: any
/// request to the Lambda emulator's port may trigger an invocation).
pub fn wait_for_port(port: u16, timeout: Duration, what: &str) {
    let deadline = Instant::now() + timeout;
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "{what} did not listen on port {port} within {timeout:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A DynamoDB Local server owned by this test process.
pub struct DynamoLocal {
    pub endpoint: String,
    pub port: u16,
    child: Mutex<Guarded>,
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
        let cmd = format!(
            "exec java -Djava.library.path='{lib}' -jar '{jar}' {storage} -port {port} -disableTelemetry",
            lib = dir.join("DynamoDBLocal_lib").display(),
            jar = jar.display(),
        );
        let child = Guarded::spawn("dynamodb-local", &cmd, &work, &[]);
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

    /// Stops the server.
    pub fn stop(&self) {
        self.child.lock().unwrap().stop();
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
        // A loaded machine's DynamoDB Local can take longer than the client's attempt timeout
        // to create a table (with its indexes): try again (an existing table is accepted).
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            match store.create_table().await {
                Ok(()) => break,
                Err(e) if e.is_transient() && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(500)).await
                }
                Err(e) => panic!("create table: {e:?}"),
            }
        }
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

/// A fresh table keyed by `id` (S) on the server `client` reaches: a resource guarded by
/// fenced writes.
pub async fn guarded_table(client: &aws_sdk_dynamodb::Client) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let table = format!("guarded-{}-{}", std::process::id(), N.fetch_add(1, Ordering::SeqCst));
    create_id_table(client, &table).await;
    table
}

/// Creates an on-demand table `name` keyed by the string attribute `id` (a resource the tests
/// guard with fences).
pub async fn create_id_table(client: &aws_sdk_dynamodb::Client, name: &str) {
    use aws_sdk_dynamodb::error::ProvideErrorMetadata;
    use aws_sdk_dynamodb::types::{AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType};
    // Tried again while a loaded machine's DynamoDB Local answers late (the table may exist
    // by then: ResourceInUseException).
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let r = client
            .create_table()
            .table_name(name)
            .billing_mode(BillingMode::PayPerRequest)
            .attribute_definitions(
                AttributeDefinition::builder()
                    .attribute_name("id")
                    .attribute_type(ScalarAttributeType::S)
                    .build()
                    .unwrap(),
            )
            .key_schema(KeySchemaElement::builder().attribute_name("id").key_type(KeyType::Hash).build().unwrap())
            .send()
            .await;
        match r {
            Ok(_) => return,
            Err(e) if e.code() == Some("ResourceInUseException") => return,
            Err(aws_sdk_dynamodb::error::SdkError::ServiceError(e)) => panic!("create table {name}: {e:?}"),
            Err(e) if Instant::now() < deadline => {
                tracing::debug!("create table {name}: {e:?}; trying again");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("create table {name}: {e:?}"),
        }
    }
}

/// The DynamoDB Local shared by every test of this process.
pub fn dynamo_local() -> &'static DynamoLocal {
    static LOCAL: OnceLock<DynamoLocal> = OnceLock::new();
    LOCAL.get_or_init(|| {
        // Started on a plain thread: the readiness poll uses its own runtime.
        std::thread::spawn(|| DynamoLocal::start(None)).join().expect("start DynamoDB Local")
    })
}

/// A fresh lease table on the shared DynamoDB Local with a fault-injecting proxy in front of
/// the server: the proxy, the table's name, and an SDK configuration that goes through it.
pub async fn proxied_table() -> (Arc<proxy::Proxy>, String, aws_config::SdkConfig) {
    let local = tokio::task::spawn_blocking(dynamo_local).await.expect("dynamo local");
    let table = local.store().await.table().to_string();
    let upstream = format!("127.0.0.1:{}", local.port).parse().expect("address");
    let proxy = Arc::new(proxy::Proxy::start(upstream).await);
    let conf = sdk_config_for(&proxy.endpoint()).await;
    (proxy, table, conf)
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

/// The scheduling delay a tokio runtime suffers while a timing check runs: a task sleeping
/// 1 ms over and over records the largest overshoot. A deadline the code promises to meet can
/// be met no sooner than its timer fires plus this delay, so timing checks add exactly it
/// instead of a fixed slack that only a quiet machine keeps. (Start it inside the runtime.)
pub struct SchedLag {
    max_us: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl SchedLag {
    pub fn start() -> SchedLag {
        let max_us = Arc::new(AtomicU64::new(0));
        let m = max_us.clone();
        let task = tokio::spawn(async move {
            loop {
                let t = Instant::now();
                tokio::time::sleep(Duration::from_millis(1)).await;
                let over = t.elapsed().saturating_sub(Duration::from_millis(1));
                m.fetch_max(over.as_micros() as u64, Ordering::Relaxed);
            }
        });
        SchedLag { max_us, task }
    }

    /// The largest delay seen so far.
    pub fn max(&self) -> Duration {
        Duration::from_micros(self.max_us.load(Ordering::Relaxed))
    }
}

impl Drop for SchedLag {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Test configuration: the documented defaults with short leases allowed.
pub fn test_config() -> Config {
    let mut c = Config::default();
    c.limits.min_duration = Duration::from_millis(100);
    c.skew_margin = Duration::from_millis(50);
    c.retry_budget = Duration::from_secs(3);
    // A sweep every 50 ms: keep-alive leases from 150 ms.
    c.limits.keepalive_sweep_period = Duration::from_millis(50);
    c
}

/// The widest safe margin (DESIGN.md, "Clocks") a coordinator may count when every answer its
/// clock evidence rests on came within `spent` (a new coordinator's first request): its skew
/// margin on the embedded store, whose evidence is exact; on DynamoDB, each answer an interval
/// a second (the `Date`'s resolution) plus the allowance for a late stamp plus its round trip
/// wide, every one of them holding the store's clock, so that their agreed bounds are at most
/// twice that apart.
pub fn widest_first_margin(c: &Coordinator, spent: Duration) -> Duration {
    let skew = c.config().skew_margin;
    if c.store().name() == "sqlite" {
        skew
    } else {
        skew.max(2 * (Duration::from_millis(1001) + c.config().date_lag + spent))
    }
}

/// Keeps `store`'s client answering steadily (a read of `key` every 17 ms, so that the answers'
/// sub-second phases cover the second) until the returned guard is dropped: the clock evidence
/// of a coordinator with steady traffic.
pub fn steady_traffic(store: Arc<dyn Store>, key: &str) -> tokio::task::AbortHandle {
    let key = key.to_string();
    tokio::spawn(async move {
        loop {
            let _ = store.get(&key).await;
            tokio::time::sleep(Duration::from_millis(17)).await;
        }
    })
    .abort_handle()
}

/// The edges of the band of clocks a coordinator on `store` is accepted with (DESIGN.md,
/// "Clocks"): the largest offsets (ms) ahead of the store's clock and behind it at which an
/// acquire with `config` is not refused with `ClockSkew`, to within `step` ms, searched up to
/// `cap` ms. `store` should have answered steadily for a second first ([`steady_traffic`]).
/// The store's clock must be this machine's (DynamoDB Local, the embedded store).
pub async fn accepted_band(store: Arc<dyn Store>, config: &Config, step: i64, cap: i64) -> (i64, i64) {
    let accepted = |offset_ms: i64| {
        let (store, config) = (store.clone(), config.clone());
        async move {
            let c = Coordinator::new(store, Config { clock_offset_ms: offset_ms, ..config });
            // A loaded machine's store may time out: each try on a key of its own.
            for attempt in 0..5 {
                let key = format!("band-probe{offset_ms}-{attempt}");
                let opts = leasehold::AcquireOptions::default();
                match c.acquire(&key, "probe", Some(Duration::from_secs(5)), opts).await {
                    Ok(l) => {
                        let _ = c.release(&key, &l.lease_id).await;
                        return true;
                    }
                    Err(Error::ClockSkew(_)) => return false,
                    Err(e) if e.is_transient() => continue,
                    Err(e) => panic!("probing the band at {offset_ms} ms: {e}"),
                }
            }
            panic!("probing the band at {offset_ms} ms: the store did not answer")
        }
    };
    let mut edges = [0i64; 2];
    for (side, sign) in [(0, 1i64), (1, -1)] {
        // Accepted at `lo`, refused at `hi` (or `hi` is the cap).
        let (mut lo, mut hi) = (0, cap);
        if accepted(sign * cap).await {
            lo = cap;
        }
        while hi - lo > step {
            let mid = (lo + hi) / 2;
            if accepted(sign * mid).await {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        edges[side] = lo;
    }
    (edges[0], edges[1])
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
    /// A new DynamoDB client (as another process would have) on the same table as `b`.
    pub async fn dynamo_store_like(b: &Backend) -> Arc<dyn Store> {
        match b {
            Backend::Dynamo(d) => Arc::new(DynamoStore::new(dynamo_local().client().await, d.table())),
            Backend::Sqlite(..) => b.reopen(),
        }
    }
}

/// Counts the requests a coordinator sends to its store.
#[derive(Default)]
pub struct Counting {
    pub gets: AtomicUsize,
    pub updates: AtomicUsize,
    pub deletes: AtomicUsize,
    pub scans: AtomicUsize,
}

impl Counting {
    pub fn new(inner: Arc<dyn Store>) -> Arc<Wrapped<Counting>> {
        wrap(inner, Counting::default())
    }
    pub fn total(&self) -> usize {
        self.gets.load(Ordering::SeqCst)
            + self.updates.load(Ordering::SeqCst)
            + self.deletes.load(Ordering::SeqCst)
            + self.scans.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl Intercept for Counting {
    async fn get(&self, store: &Arc<dyn Store>, key: &str) -> Result<Option<Record>> {
        self.gets.fetch_add(1, Ordering::SeqCst);
        store.get(key).await
    }
    async fn update(&self, store: &Arc<dyn Store>, key: &str, c: &Condition, m: &Mutation) -> Result<Write> {
        self.updates.fetch_add(1, Ordering::SeqCst);
        store.update(key, c, m).await
    }
    async fn delete(&self, store: &Arc<dyn Store>, key: &str, c: &Condition) -> Result<Write> {
        self.deletes.fetch_add(1, Ordering::SeqCst);
        store.delete(key, c).await
    }
    async fn scan(&self, store: &Arc<dyn Store>, k: &ScanKind, s: Option<&str>, l: u32) -> Result<Page> {
        self.scans.fetch_add(1, Ordering::SeqCst);
        store.scan(k, s, l).await
    }
}

/// What a [`Faulty`] store does to the next writes.
#[derive(Debug, Clone)]
pub enum Fault {
    /// Forward the write, then lose the answer (an ambiguous failure).
    LoseResponse,
    /// Answer "throttled" without forwarding.
    Throttle,
    /// Answer "unavailable" without forwarding.
    Unavailable,
    /// A request stuck in the network: answer "unavailable" at once (so the caller retries),
    /// and make the original write this much later, after the retry.
    DelayedDuplicate(std::time::Duration),
    /// Make the write, then answer only this much later (a stalled answer).
    SlowAnswer(std::time::Duration),
    /// Make the write, then lose its answer once the test says so (a request that timed out
    /// after it landed, when the test has made what it needs happen meanwhile).
    LoseResponseWhen(Arc<tokio::sync::Notify>),
}

/// Injects faults into the next writes of a real store (of those its filter picks).
pub struct Faulty {
    pub plan: Mutex<Vec<Fault>>,
    pub injected: AtomicUsize,
    /// The writes a fault was injected into, in order.
    pub faulted: Mutex<Vec<Mutation>>,
    /// Which writes the faults are for, by their condition; the others pass untouched.
    only: fn(&Condition) -> bool,
}

impl Faulty {
    pub fn new(inner: Arc<dyn Store>) -> Arc<Wrapped<Faulty>> {
        Faulty::on(inner, |_| true)
    }
    /// Faults only for the writes whose condition `only` picks (say, a hand-over's, while
    /// waiters poll beside it).
    pub fn on(inner: Arc<dyn Store>, only: fn(&Condition) -> bool) -> Arc<Wrapped<Faulty>> {
        let faulty =
            Faulty { plan: Mutex::new(Vec::new()), injected: AtomicUsize::new(0), faulted: Mutex::default(), only };
        wrap(inner, faulty)
    }
    /// Faults for the next writes, in order.
    pub fn inject(&self, faults: &[Fault]) {
        let mut p = self.plan.lock().unwrap();
        p.extend(faults.iter().rev().cloned());
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
impl Intercept for Faulty {
    async fn update(&self, store: &Arc<dyn Store>, key: &str, c: &Condition, m: &Mutation) -> Result<Write> {
        let fault = if (self.only)(c) { self.next_fault() } else { None };
        if fault.is_some() {
            self.faulted.lock().unwrap().push(m.clone());
        }
        match fault {
            None => store.update(key, c, m).await,
            Some(Fault::LoseResponse) => {
                let _ = store.update(key, c, m).await?;
                Err(Error::StoreUnavailable("injected: response lost after the write".into()))
            }
            Some(Fault::Throttle) => Err(Error::Throttled("injected throttle".into())),
            Some(Fault::Unavailable) => Err(Error::not_sent("injected outage")),
            Some(Fault::DelayedDuplicate(after)) => {
                let (inner, key, c, m) = (store.clone(), key.to_string(), c.clone(), m.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(after).await;
                    let _ = inner.update(&key, &c, &m).await;
                });
                Err(Error::StoreUnavailable("injected: request stuck in the network".into()))
            }
            Some(Fault::SlowAnswer(after)) => {
                let w = store.update(key, c, m).await;
                tokio::time::sleep(after).await;
                w
            }
            Some(Fault::LoseResponseWhen(told)) => {
                let _ = store.update(key, c, m).await?;
                told.notified().await;
                Err(Error::StoreUnavailable("injected: the answer timed out after the write".into()))
            }
        }
    }
    // A wrapper of the store is the store: its clock evidence is the store's.
    fn passes_clock(&self) -> bool {
        true
    }
}

/// Holds back the next heartbeat (an `Extend` write) until [`Gated::open`] is called, then
/// applies it: a request that was sent, then sat in the network while its sender gave up on
/// it, and lands later. The write runs in its own task, so a caller dropping its future (a
/// timeout) does not stop it from landing, as with a real request already on the wire.
pub struct Gated {
    armed: std::sync::atomic::AtomicBool,
    gate: Arc<tokio::sync::Notify>,
    /// The held-back write's outcome, once it landed.
    pub landed: tokio::sync::watch::Sender<Option<Write>>,
}

impl Gated {
    pub fn new(inner: Arc<dyn Store>) -> Arc<Wrapped<Gated>> {
        let gated = Gated {
            armed: std::sync::atomic::AtomicBool::new(false),
            gate: Arc::new(tokio::sync::Notify::new()),
            landed: tokio::sync::watch::channel(None).0,
        };
        wrap(inner, gated)
    }
    /// Hold back the next heartbeat.
    pub fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }
    /// Let the held-back heartbeat land.
    pub fn open(&self) {
        self.gate.notify_one();
    }
    /// Waits until the held-back heartbeat landed; its outcome.
    pub async fn wait_landed(&self) -> Write {
        let mut rx = self.landed.subscribe();
        let w = rx.wait_for(|w| w.is_some()).await.expect("gated store alive");
        w.clone().expect("landed")
    }
}

#[async_trait]
impl Intercept for Gated {
    async fn update(&self, store: &Arc<dyn Store>, key: &str, c: &Condition, m: &Mutation) -> Result<Write> {
        if !matches!(m, Mutation::Lease(LeaseMutation::Extend { .. })) || !self.armed.swap(false, Ordering::SeqCst) {
            return store.update(key, c, m).await;
        }
        let (inner, gate, landed) = (store.clone(), self.gate.clone(), self.landed.clone());
        let (key, c, m) = (key.to_string(), c.clone(), m.clone());
        let task = tokio::spawn(async move {
            gate.notified().await;
            let r = inner.update(&key, &c, &m).await;
            if let Ok(w) = &r {
                landed.send_replace(Some(w.clone()));
            }
            r
        });
        task.await.unwrap_or_else(|e| Err(Error::StoreUnavailable(format!("gated write: {e}"))))
    }
    fn passes_clock(&self) -> bool {
        true
    }
}

/// Counts holds that overlap: a worker calls `enter` when it starts working under a lease and
/// `leave` when it stops; `overlaps` is how many holds started while another was running.
#[derive(Default)]
pub struct Holds {
    running: AtomicU64,
    overlaps: AtomicU64,
}

impl Holds {
    pub fn enter(&self) {
        if self.running.fetch_add(1, Ordering::SeqCst) != 0 {
            self.overlaps.fetch_add(1, Ordering::SeqCst);
        }
    }
    pub fn leave(&self) {
        self.running.fetch_sub(1, Ordering::SeqCst);
    }
    pub fn overlaps(&self) -> u64 {
        self.overlaps.load(Ordering::SeqCst)
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

/// The longest one case of [`variants!`] may run: a case that hangs (a task it waits for
/// panicked, a notice never sent) fails after it, instead of holding the whole suite.
pub const CASE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// Runs each named case of the calling test file once per variant, as `case::variant`:
///
/// `variants!(sync [embedded => &Target::embedded(), dynamodb => &Target::dynamo()]: case_a, case_b)`
/// makes `#[test] fn case_a::embedded() { case_a(&Target::embedded()) }` and so on; `async`
/// makes multi-threaded `#[tokio::test]`s that await the case (the variant expression may await
/// too), each within [`CASE_TIMEOUT`]. The variant expressions resolve in the calling file.
#[macro_export]
macro_rules! variants {
    (@case sync $case:ident [$($variant:ident => $make:expr),+ $(,)?]) => {
        mod $case {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $variant() {
                    super::$case($make)
                }
            )+
        }
    };
    (@case async $case:ident [$($variant:ident => $make:expr),+ $(,)?]) => {
        mod $case {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $variant() {
                    let case = async { super::$case($make).await };
                    if tokio::time::timeout($crate::CASE_TIMEOUT, case).await.is_err() {
                        panic!("the case did not end within {:?}: it hangs", $crate::CASE_TIMEOUT);
                    }
                }
            )+
        }
    };
    ($mode:ident $variants:tt: $($case:ident),* $(,)?) => {
        $($crate::variants!(@case $mode $case $variants);)*
    };
}

/// Runs each named `async fn case(b: Backend)` of the calling test file against both stores:
/// `case::sqlite` and `case::dynamodb`.
#[macro_export]
macro_rules! both_backends {
    ($($case:ident),* $(,)?) => {
        $crate::variants!(async [
            sqlite => $crate::Backend::sqlite().await,
            dynamodb => $crate::Backend::dynamo().await,
        ]: $($case),*);
    };
}

/// Delivers queued grants in process and keeps each delivered lease, in order; every failure
/// report is accepted and dropped. (The tests that need gone tokens or transient errors have
/// deliverers of their own.)
#[derive(Default)]
pub struct DeliveredLeases(Mutex<Vec<leasehold::Lease>>);

impl DeliveredLeases {
    /// The leases delivered so far, in the order they were delivered.
    pub fn leases(&self) -> Vec<leasehold::Lease> {
        self.0.lock().unwrap().clone()
    }
}

#[async_trait]
impl leasehold::queue::Deliver for DeliveredLeases {
    async fn success(
        &self,
        _: &str,
        lease: &leasehold::Lease,
    ) -> std::result::Result<(), leasehold::queue::DeliveryError> {
        self.0.lock().unwrap().push(lease.clone());
        Ok(())
    }
    async fn failure(&self, _: &str, _: &str, _: &str) -> std::result::Result<(), leasehold::queue::DeliveryError> {
        Ok(())
    }
}
