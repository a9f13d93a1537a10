//! `leasehold serve`: the HTTP API ([`leasehold::api::handle_http`]) on hyper, over the
//! embedded store or DynamoDB.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use leasehold::api::{self, HttpRequest, HttpResponse, MAX_BODY_BYTES};
use leasehold::env::StoreChoice;
use leasehold::store::{SqliteStore, Store};
use leasehold::{Coordinator, Error};

use crate::target::{choose, Either, Failure};
use crate::{duration, exit, output, Global};

/// What `serve --table` uses of the table: its key, the `state` index (the work routes) and the
/// `keepalive` index (an acquire with a keepalive is renewed through it by the deployment's
/// sweep). No route queues (task tokens arrive by direct invoke only), so not the `queue` index.
const SERVE_USES: &[leasehold::store::table::Part] = &[
    leasehold::store::table::Part::Key,
    leasehold::store::table::Part::Index(leasehold::store::dynamo::STATE_INDEX),
    leasehold::store::table::Part::Index(leasehold::store::dynamo::KEEPALIVE_INDEX),
];

pub const HELP: &str = "\
Routes (the same as the HTTP API of the AWS deployment):
  POST /leases/acquire/{key}   POST /leases/heartbeat/{key}   POST /leases/release/{key}
  GET  /leases/{key}           GET /openapi.json              GET /health
  POST /leases/next/{state}    POST /leases/put/{key}         POST /leases/count/{state}
Operator routes (this server only):
  GET  /                       the live page: held keys, queues, work states, events, force-release
  GET  /leases?prefix=P&limit=N                 POST /leases/force-release/{key}
  GET  /leases/history/{key}?since=1h&limit=N   who held the key when (GET /leases/history: every key)
  GET  /metrics                                 Prometheus text format (README, Metrics)
  GET  /summary?prefix=P&limit=N                held keys, keys per work state, queued waiters (the page's)
The page, /summary and the gauges of /metrics read a snapshot of the store, scanned again when a
view asks and it is older than --scan-every (10s with --table, 1s on the embedded store); this
server's own writes are applied to it as they land.
Anyone who can reach the server can use every route, force-release included: keep it on
127.0.0.1 (the default) or behind something that authenticates.
The key is the rest of the path, '/' included (/leases/acquire/jobs/nightly is the key
jobs/nightly); the path is percent-decoded once. Bodies over 64 KiB are refused with 413.

Examples:
  leasehold serve                                   # embedded store, 127.0.0.1:7878
  leasehold serve --addr 0.0.0.0:8080 --db /var/lib/leasehold/leases.db
  AWS_ENDPOINT_URL_DYNAMODB=http://localhost:8000 leasehold serve --table leases

Stops cleanly on SIGINT/SIGTERM (exit 0). Exit 1: cannot listen; 2: usage; 77: store unavailable.";

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on
    #[arg(long, default_value = "127.0.0.1:7878", value_name = "HOST:PORT")]
    pub addr: SocketAddr,
    /// How old the table snapshot the page, /summary and /metrics read may be before a view
    /// scans the table again (default: 10s with --table, 1s on the embedded store)
    #[arg(long = "scan-every", env = "LEASEHOLD_SCAN_EVERY", value_parser = duration::parse, value_name = "D")]
    pub scan_every: Option<Duration>,
    /// How often expired items of the embedded store are purged
    #[arg(long = "purge-every", default_value = "60s", value_parser = duration::parse, value_name = "D", hide = true)]
    pub purge_every: Duration,
}

pub fn main(g: &Global, args: ServeArgs) -> i32 {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .max_blocking_threads(4)
        .build()
        .expect("tokio runtime");
    let code = rt.block_on(serve(g, args));
    rt.shutdown_timeout(Duration::from_millis(500));
    code
}

async fn serve(g: &Global, args: ServeArgs) -> i32 {
    let choice = match choose(g, false) {
        Ok(Either::Store(c)) => c,
        Ok(Either::Http(_)) => unreachable!("choose refuses URLs here"),
        Err(f) => return output::failure(g, &f),
    };
    let config = match leasehold::env::config_from_env() {
        Ok(c) => c,
        Err(e) => return output::failure(g, &Failure::usage(e.to_string())),
    };
    let (store, sqlite) = match open(g, &choice).await {
        Ok(s) => s,
        Err(f) => return output::failure(g, &f),
    };
    let every = args.scan_every.unwrap_or(match &choice {
        StoreChoice::Dynamo { .. } => DYNAMO_SCAN_EVERY,
        StoreChoice::Embedded { .. } => Duration::from_secs(1),
    });
    let (coord, ops) = assemble(store, &choice, every, config);
    let listener = match tokio::net::TcpListener::bind(args.addr).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("leasehold: error: cannot listen on {}: {e}", args.addr);
            return exit::FAILED;
        }
    };
    let addr = listener.local_addr().unwrap_or(args.addr);
    // Before the banner: whoever reads it may signal at once.
    let shutdown = shutdown_signal();
    banner(addr, &choice);
    if let Some(s) = sqlite {
        purge_in_background(s, coord.clone(), args.purge_every.max(Duration::from_secs(1)));
    }
    accept_until(listener, coord, ops, shutdown).await;
    exit::OK
}

/// The store `choice` names: the embedded store (also returned as itself, for its purge) or
/// the DynamoDB table, checked for what the server uses of it.
async fn open(g: &Global, choice: &StoreChoice) -> Result<(Arc<dyn Store>, Option<SqliteStore>), Failure> {
    match choice {
        StoreChoice::Embedded { path } => match SqliteStore::open(path) {
            Ok(s) => Ok((Arc::new(s.clone()), Some(s))),
            Err(e) => Err(Failure::unreachable(format!("{}: {e}", choice.describe()))),
        },
        StoreChoice::Dynamo { .. } => Ok((crate::target::open_store(g, choice, SERVE_USES, true).await?, None)),
    }
}

/// The coordinator the routes use and what the operator routes read: both see the store
/// through the metrics, and the coordinator's writes land in the snapshot (scanned again when
/// older than `every`).
fn assemble(
    store: Arc<dyn Store>,
    choice: &StoreChoice,
    every: Duration,
    config: leasehold::Config,
) -> (Coordinator, Arc<Ops>) {
    let metrics = Arc::new(crate::metrics::Metrics::default());
    let scanned: Arc<dyn Store> =
        Arc::new(crate::metrics::Metered { inner: store.clone(), metrics: metrics.clone(), snapshot: None });
    let snapshot = Arc::new(crate::snapshot::Snapshot::new(scanned, every));
    let store: Arc<dyn Store> =
        Arc::new(crate::metrics::Metered { inner: store, metrics: metrics.clone(), snapshot: Some(snapshot.clone()) });
    let coord = Coordinator::new(store, config);
    let history = match choice {
        StoreChoice::Embedded { path } => crate::history::Source::Embedded(path.clone()),
        StoreChoice::Dynamo { table } => {
            crate::history::Source::Dynamo { history_table: crate::history::history_table_of(table, None) }
        }
    };
    (coord, Arc::new(Ops { metrics, snapshot, history }))
}

/// The lines on stdout that say the server is up, where, and how to try it.
fn banner(addr: SocketAddr, choice: &StoreChoice) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "leasehold: serving the HTTP API on http://{addr} ({})", choice.describe());
    let _ = writeln!(
        out,
        "try: curl -s -X POST http://{addr}/leases/acquire/jobs/demo -H 'content-type: application/json' -d '{{\"holder\":\"me\",\"duration_ms\":30000}}'"
    );
    let _ = out.flush();
}

/// Every `every`, purges the embedded store's expired items and prunes its history.
fn purge_in_background(s: SqliteStore, c: Coordinator, every: Duration) {
    let path = s.path().to_path_buf();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match s.purge_expired(c.now_ms()).await {
                Ok(0) => {}
                Ok(n) => tracing::debug!(purged = n, "purged expired items"),
                Err(e) => tracing::warn!(error = %e, "purge of expired items failed"),
            }
            let (p, now) = (path.clone(), c.now_ms());
            match tokio::task::spawn_blocking(move || leasehold::store::sqlite_history::prune(&p, now)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "history pruning failed"),
                Err(e) => tracing::warn!(error = %e, "history pruning failed"),
            }
        }
    });
}

/// Serves each connection `listener` accepts until `shutdown` resolves, then gives the
/// requests still running up to 5 s.
async fn accept_until(
    listener: tokio::net::TcpListener,
    coord: Coordinator,
    ops: Arc<Ops>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(Duration::from_secs(30)).keep_alive(true);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    let (coord, ops) = (coord.clone(), ops.clone());
                    let service = hyper::service::service_fn(move |req| handle(coord.clone(), ops.clone(), req));
                    let conn = graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
                    tokio::spawn(async move {
                        if let Err(e) = conn.await {
                            tracing::debug!(error = %e, "connection ended with an error");
                        }
                    });
                }
                Err(e) => {
                    // Out of file descriptors and the like: pause instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = &mut shutdown => break,
        }
    }
    drop(listener);
    eprintln!("leasehold: shutting down");
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(Duration::from_secs(5)) => {
            eprintln!("leasehold: requests still running after 5s; closing them");
        }
    }
}

/// Installs the SIGTERM and SIGINT handlers now (not when the returned future is first polled:
/// a signal that arrives between the banner and the accept loop's first turn must still stop
/// the server cleanly) and resolves when either arrives.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    }
}

fn too_large() -> HttpResponse {
    let e = Error::invalid(format!("the body is larger than {MAX_BODY_BYTES} bytes"));
    let mut r = HttpResponse::error(&e, 0).with_status(413);
    r.headers.push(("connection".into(), "close".into()));
    r
}

/// What the operator routes of this server read besides the coordinator.
pub struct Ops {
    pub history: crate::history::Source,
    pub metrics: Arc<crate::metrics::Metrics>,
    /// The table as the page, `/summary` and `/metrics` read it.
    pub snapshot: Arc<crate::snapshot::Snapshot>,
}

/// How old the snapshot of a DynamoDB table may be before a view scans it again: a scan of
/// 10,000 items of 500 bytes reads about 640 read units (eventually consistent), so a page
/// left open costs at most one such scan every 10 s (COSTS.md).
const DYNAMO_SCAN_EVERY: Duration = Duration::from_secs(10);

async fn handle(coord: Coordinator, ops: Arc<Ops>, req: Request<Incoming>) -> Result<Response<Answer>, Infallible> {
    let acquire = req.method() == hyper::Method::POST && req.uri().path().starts_with("/leases/acquire/");
    let method = req.method().as_str().to_string();
    let path = req.uri().path_and_query().map(|p| p.as_str().to_string()).unwrap_or_else(|| "/".into());
    let declared = req
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    let json_body = req
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(';').next().unwrap_or("").trim().eq_ignore_ascii_case("application/json"));
    let started = std::time::Instant::now();
    let op = crate::metrics::operation(&method, req.uri().path());
    let mut waited = false;
    let resp = if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        too_large()
    } else {
        match Limited::new(req.into_body(), MAX_BODY_BYTES).collect().await {
            Ok(body) => match HttpRequest::from_raw(&method, &path, body.to_bytes().to_vec()) {
                Ok(req) if req.path == "/" => page(&method),
                Ok(req) if req.path == "/metrics" => metrics_route(&coord, &ops, &req).await,
                Ok(req) if req.path == "/summary" => summary_route(&coord, &ops, &req, &path).await,
                Ok(req) if req.path == "/leases/history" || req.path.starts_with("/leases/history/") => {
                    history_route(&coord, &ops, &req, &path).await
                }
                Ok(req) if req.path.starts_with("/leases/force-release/") && method == "POST" && !json_body => {
                    // A browser sends application/json across origins only after a preflight
                    // this server never approves: another site's page cannot force-release.
                    HttpResponse::error(
                        &Error::invalid("force-release needs the header content-type: application/json"),
                        0,
                    )
                    .with_status(415)
                }
                Ok(req) => {
                    if op == "acquire" {
                        waited = serde_json::from_slice::<serde_json::Value>(&req.body)
                            .ok()
                            .and_then(|v| v.get("wait_ms").and_then(serde_json::Value::as_u64))
                            .is_some_and(|w| w > 0);
                    }
                    let query = path.split_once('?').map(|(_, q)| q).unwrap_or("");
                    // Dropped here when the client disconnects: the coordinator then gives back
                    // whatever the acquire was granted (DESIGN.md, "Cancellation").
                    match api::handle_operator(&coord, &req, query).await {
                        Some(resp) => resp,
                        None => api::handle_http(&coord, req, None).await,
                    }
                }
                Err(resp) => resp,
            },
            Err(e) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => too_large(),
            Err(e) => HttpResponse::error(&Error::invalid(format!("could not read the request body: {e}")), 0),
        }
    };
    let leases = if op == "next" && resp.error.is_none() {
        serde_json::from_str::<serde_json::Value>(&resp.body)
            .ok()
            .and_then(|v| v.get("leases").and_then(serde_json::Value::as_array).map(|a| a.len() as u64))
            .unwrap_or(0)
    } else {
        0
    };
    ops.metrics.answered(op, resp.error.map(|e| e.as_str()), started.elapsed(), waited, leases);
    let unsent = if acquire && resp.status == 200 { Unsent::of(&coord, &resp.body) } else { None };
    Ok(to_hyper(resp, unsent))
}

/// A granted lease whose answer was not yet handed to the connection for writing. If the
/// connection drops the answer unwritten (the client left), the lease is released at once:
/// nobody else has its lease_id.
struct Unsent {
    coord: Coordinator,
    key: String,
    lease_id: leasehold::LeaseId,
}

impl Unsent {
    fn of(coord: &Coordinator, body: &str) -> Option<Unsent> {
        let v: serde_json::Value = serde_json::from_str(body).ok()?;
        Some(Unsent {
            coord: coord.clone(),
            key: v.get("key")?.as_str()?.to_string(),
            lease_id: leasehold::LeaseId::from_string(v.get("lease_id")?.as_str()?),
        })
    }
}

impl Unsent {
    fn release(self) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let Unsent { coord, key, lease_id: id } = self;
        rt.spawn(async move {
            match coord.release(&key, &id).await {
                Ok(_) => tracing::debug!(key, "released a lease whose answer could not be written"),
                Err(e) => tracing::warn!(key, error = e.name(), "could not release a lease whose answer was lost"),
            }
        });
    }
}

/// A response body that releases its lease ([`Unsent`]) when the connection drops it before
/// taking it for writing.
struct Answer {
    body: Bytes,
    unsent: Option<Unsent>,
}

impl hyper::body::Body for Answer {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        // Taken for writing: from here on it is lost only as any answer in transit is.
        this.unsent = None;
        let body = std::mem::take(&mut this.body);
        std::task::Poll::Ready((!body.is_empty()).then(|| Ok(hyper::body::Frame::data(body))))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_empty()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.body.len() as u64)
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        if let Some(u) = self.unsent.take() {
            u.release();
        }
    }
}

/// `GET /summary[?prefix=P&limit=N]`: keys per work state (and how many of them are held),
/// queued waiters, and the held leases whose key starts with `prefix` (at most `limit`, default
/// 1,000), for the operator page; from the snapshot (`as_of_ms`: when its scan was read; this
/// server's own writes since are in it).
async fn summary_route(coord: &Coordinator, ops: &Ops, req: &HttpRequest, raw: &str) -> HttpResponse {
    if req.method != "GET" && req.method != "HEAD" {
        return api::method_not_allowed("GET", format!("use GET for /summary, not {}", req.method));
    }
    let query = raw.split_once('?').map(|(_, q)| q).unwrap_or("");
    let param = |name: &str| {
        query.split('&').filter_map(|kv| kv.split_once('=')).find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
    };
    let decoded =
        |v: String| percent_encoding::percent_decode_str(&v.replace('+', " ")).decode_utf8_lossy().into_owned();
    let prefix = param("prefix").map(decoded).unwrap_or_default();
    let limit = param("limit").and_then(|l| l.parse::<usize>().ok()).unwrap_or(1000).min(10_000);
    let view = match ops.snapshot.view().await {
        Ok(v) => v,
        Err(e) => return HttpResponse::error(&e, coord.now_ms()),
    };
    let now = coord.now_ms();
    let mut states: std::collections::BTreeMap<&str, (u64, u64)> = Default::default();
    let mut queued = 0;
    let mut leases = Vec::new();
    for r in view.items.values().filter(|r| r.queue.waiter.is_none()) {
        queued += r.queue_len();
        if let Some(s) = &r.work.state {
            let e = states.entry(s.as_str()).or_default();
            e.0 += 1;
            e.1 += u64::from(r.shows_held(now));
        }
        if leases.len() < limit && r.key.starts_with(prefix.as_str()) && r.shows_held(now) {
            let st = r.state(now);
            if st.held {
                leases.push(st);
            }
        }
    }
    let states: Vec<serde_json::Value> =
        states.iter().map(|(s, (n, h))| serde_json::json!({ "state": s, "keys": n, "held": h })).collect();
    let as_of = now.saturating_sub(view.age.as_millis() as u64);
    let v = serde_json::json!({
        "states": states, "queued_waiters": queued, "complete": view.complete, "as_of_ms": as_of, "leases": leases,
    });
    HttpResponse {
        status: 200,
        headers: vec![("content-type".into(), "application/json".into())],
        body: v.to_string(),
        error: None,
    }
}

/// `GET /metrics`: the Prometheus text exposition (see `metrics`), its gauges from the snapshot.
async fn metrics_route(coord: &Coordinator, ops: &Ops, req: &HttpRequest) -> HttpResponse {
    if req.method != "GET" && req.method != "HEAD" {
        return api::method_not_allowed("GET", format!("use GET for /metrics, not {}", req.method));
    }
    match ops.snapshot.view().await {
        Ok(view) => HttpResponse {
            status: 200,
            headers: vec![("content-type".into(), "text/plain; version=0.0.4; charset=utf-8".into())],
            body: ops.metrics.render(&view, coord.now_ms()),
            error: None,
        },
        Err(e) => HttpResponse::error(&e, coord.now_ms()),
    }
}

/// `GET /leases/history/{key+}` (one key's events) and `GET /leases/history` (every key's
/// recent events, embedded store only).
async fn history_route(coord: &Coordinator, ops: &Ops, req: &HttpRequest, raw: &str) -> HttpResponse {
    if req.method != "GET" && req.method != "HEAD" {
        return api::method_not_allowed("GET", format!("use GET for {}, not {}", req.path, req.method));
    }
    let key = req.path.strip_prefix("/leases/history/");
    let query = raw.split_once('?').map(|(_, q)| q).unwrap_or("");
    match crate::history::route(&ops.history, key, query, coord.now_ms()).await {
        Ok(v) => HttpResponse {
            status: 200,
            headers: vec![("content-type".into(), "application/json".into())],
            body: v.to_string(),
            error: None,
        },
        Err(f) => {
            let name = f.json.get("error").and_then(serde_json::Value::as_str).and_then(leasehold::ErrorName::parse);
            let status = match name {
                Some(leasehold::ErrorName::InvalidRequest) => 400,
                _ => 503,
            };
            HttpResponse {
                status,
                headers: vec![("content-type".into(), "application/json".into())],
                body: f.json.to_string(),
                error: name,
            }
        }
    }
}

/// The operator page: one static file, its script polling `GET /leases` (no lease_id ever
/// reaches it: the listing carries none).
const PAGE_HTML: &str = include_str!("page.html");

fn page(method: &str) -> HttpResponse {
    if method != "GET" && method != "HEAD" {
        return api::method_not_allowed("GET", format!("use GET for /, not {method}"));
    }
    HttpResponse {
        status: 200,
        headers: vec![
            ("content-type".into(), "text/html; charset=utf-8".into()),
            ("cache-control".into(), "no-store".into()),
            (
                "content-security-policy".into(),
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'".into(),
            ),
            ("x-content-type-options".into(), "nosniff".into()),
        ],
        body: PAGE_HTML.to_string(),
        error: None,
    }
}

fn to_hyper(r: HttpResponse, unsent: Option<Unsent>) -> Response<Answer> {
    let mut resp = Response::new(Answer { body: Bytes::from(r.body), unsent });
    *resp.status_mut() = StatusCode::from_u16(r.status).unwrap_or(StatusCode::BAD_REQUEST);
    let headers = resp.headers_mut();
    for (name, value) in r.headers {
        if let (Ok(n), Ok(v)) =
            (hyper::header::HeaderName::from_bytes(name.as_bytes()), hyper::header::HeaderValue::from_str(&value))
        {
            headers.append(n, v);
        }
    }
    resp
}
