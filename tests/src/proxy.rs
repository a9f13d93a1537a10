//! An HTTP proxy between a DynamoDB client and DynamoDB Local that counts requests per
//! `X-Amz-Target` and injects faults: added latency, a response dropped after the request was
//! forwarded (an ambiguous write), connection resets, stalls, delayed duplicates (a request
//! the client gave up on that still reaches the server after the client's retry), and
//! throttling / 5xx answers.

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

/// One fault, applied to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyFault {
    /// Wait, then forward normally.
    Delay(Duration),
    /// Forward the request, then close the connection instead of answering: the write landed,
    /// the client cannot know.
    DropResponse,
    /// Close the connection without forwarding.
    Reset,
    /// Hold the request this long before forwarding (longer than a lease, or than the client's
    /// timeout).
    Stall(Duration),
    /// Answer 400 ProvisionedThroughputExceededException without forwarding.
    Throttle,
    /// Answer 400 ThrottlingException without forwarding: what DynamoDB's control plane
    /// (DescribeTable, DescribeTimeToLive, ...) answers past its per-account rate.
    ControlPlaneThrottle,
    /// Answer 500 InternalServerError without forwarding.
    ServerError,
    /// A delayed duplicate: hold the request `hold`, then close the client's connection
    /// without an answer (so the client retries, on a new connection), and forward the
    /// ORIGINAL request upstream `forward_after` its arrival, on a connection and task of its
    /// own, so that it lands after the client's retry (as a packet stuck in a network does).
    DelayedDuplicate { hold: Duration, forward_after: Duration },
}

/// One forwarded (or faulted) request, for tests that reason about timing.
#[derive(Debug, Clone)]
pub struct ProxyEvent {
    /// Epoch ms when the upstream answered (or the fault was applied).
    pub at_ms: u64,
    pub target: String,
    /// HTTP status returned to the client (0: connection closed).
    pub status: u16,
    pub fault: Option<ProxyFault>,
    pub request: String,
    /// This event is the late forward of a [`ProxyFault::DelayedDuplicate`] (the client's
    /// connection was closed long before): `status` is what the upstream answered it.
    pub late: bool,
}

#[derive(Default)]
struct State {
    counts: BTreeMap<String, u64>,
    /// Faults for the next requests, in order; each for any operation, or only the named one
    /// (requests for others pass it by).
    queue: VecDeque<(Option<String>, ProxyFault)>,
    /// Each request draws a fault with this probability (per mille) from `random_faults`.
    random_per_mille: u32,
    random_faults: Vec<ProxyFault>,
    /// Random faults only hit this operation (`X-Amz-Target`, e.g. "UpdateItem") when set.
    random_target: Option<String>,
    rng: u64,
    injected: u64,
    /// Delayed duplicates whose original request reached the upstream (and was answered).
    late_forwarded: u64,
    record: bool,
    events: Vec<ProxyEvent>,
    /// More random faults, each with its own operations and rate (see [`Proxy::add_random_faults`]).
    rules: Vec<Rule>,
    /// Ask DynamoDB for each request's consumed capacity ([`Proxy::measure_capacity`]).
    capacity: bool,
    /// Per operation: capacity units consumed (the answers' ConsumedCapacity, indexes
    /// included), and requests answered with an error.
    consumed: BTreeMap<String, (f64, u64)>,
}

/// Random faults on some operations: each matching request draws one with this probability.
struct Rule {
    /// `X-Amz-Target` operation names; empty: every operation.
    targets: Vec<String>,
    per_mille: u32,
    faults: Vec<ProxyFault>,
}

impl State {
    fn next_random(&mut self) -> u64 {
        // xorshift64*: deterministic for a seed, good enough to pick faults.
        let mut x = self.rng.max(1);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn pick(&mut self, target: &str) -> Option<ProxyFault> {
        if self.queue.front().is_some_and(|(t, _)| t.as_deref().is_none_or(|t| t == target)) {
            self.injected += 1;
            return self.queue.pop_front().map(|(_, f)| f);
        }
        let targeted = self.random_target.as_deref().is_none_or(|t| t == target);
        if targeted && self.random_per_mille > 0 && !self.random_faults.is_empty() {
            let r = self.next_random();
            if (r % 1000) < self.random_per_mille as u64 {
                let f = self.random_faults[(r / 1000) as usize % self.random_faults.len()];
                self.injected += 1;
                return Some(f);
            }
        }
        for i in 0..self.rules.len() {
            let rule = &self.rules[i];
            if !rule.targets.is_empty() && !rule.targets.iter().any(|t| t == target) {
                continue;
            }
            let (per_mille, n) = (rule.per_mille as u64, rule.faults.len());
            let r = self.next_random();
            if n > 0 && (r % 1000) < per_mille {
                let f = self.rules[i].faults[(r / 1000) as usize % n];
                self.injected += 1;
                return Some(f);
            }
        }
        None
    }
}

/// A running proxy on 127.0.0.1; dropped, it stops accepting.
pub struct Proxy {
    pub port: u16,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

impl Proxy {
    /// Starts a proxy in front of `upstream` (`127.0.0.1:PORT`).
    pub async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("addr").port();
        let state = Arc::new(Mutex::new(State { rng: 0x9E37_79B9_7F4A_7C15, ..Default::default() }));
        let st = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let _ = stream.set_nodelay(true);
                let st = st.clone();
                tokio::spawn(async move {
                    let upstream_conn: Arc<
                        tokio::sync::Mutex<Option<hyper::client::conn::http1::SendRequest<Full<Bytes>>>>,
                    > = Arc::new(tokio::sync::Mutex::new(None));
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let (st, up) = (st.clone(), upstream_conn.clone());
                        async move { handle(st, up, upstream, req).await }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .keep_alive(true)
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Proxy { port, state, task }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Faults for the next requests, in order.
    pub fn inject(&self, faults: &[ProxyFault]) {
        self.state.lock().unwrap().queue.extend(faults.iter().map(|f| (None, *f)));
    }

    /// [`Proxy::inject`], but the faults wait for requests for the operation `target` (the
    /// `X-Amz-Target` operation name, e.g. "PutItem"); others pass untouched meanwhile.
    pub fn inject_on(&self, target: &str, faults: &[ProxyFault]) {
        let mut s = self.state.lock().unwrap();
        s.queue.extend(faults.iter().map(|f| (Some(target.to_string()), *f)));
    }

    /// From now on each request gets one of `faults` with probability `per_mille`/1000
    /// (deterministic for `seed`).
    pub fn random_faults(&self, per_mille: u32, faults: &[ProxyFault], seed: u64) {
        let mut s = self.state.lock().unwrap();
        s.random_per_mille = per_mille;
        s.random_faults = faults.to_vec();
        s.random_target = None;
        s.rng = seed.max(1);
    }

    /// [`Proxy::random_faults`], but only requests for the operation `target` (the
    /// `X-Amz-Target` operation name, e.g. "UpdateItem") draw a fault; others pass untouched.
    pub fn random_faults_on(&self, target: &str, per_mille: u32, faults: &[ProxyFault], seed: u64) {
        self.random_faults(per_mille, faults, seed);
        self.state.lock().unwrap().random_target = Some(target.to_string());
    }

    /// Adds a rule of random faults: from now on each request for one of `targets` (operation
    /// names such as "Query"; none: every operation) that drew no other fault gets one of
    /// `faults` with probability `per_mille`/1000. Rules are drawn in the order they were added.
    pub fn add_random_faults(&self, targets: &[&str], per_mille: u32, faults: &[ProxyFault]) {
        let mut s = self.state.lock().unwrap();
        let targets = targets.iter().map(|t| t.to_string()).collect();
        s.rules.push(Rule { targets, per_mille, faults: faults.to_vec() });
    }

    /// How many delayed duplicates have reached the upstream so far (after their client was
    /// cut off).
    pub fn late_forwarded(&self) -> u64 {
        self.state.lock().unwrap().late_forwarded
    }

    pub fn clear_faults(&self) {
        let mut s = self.state.lock().unwrap();
        s.queue.clear();
        s.random_per_mille = 0;
        s.rules.clear();
    }

    pub fn injected(&self) -> u64 {
        self.state.lock().unwrap().injected
    }

    /// Requests seen per `X-Amz-Target` operation name (e.g. "UpdateItem").
    pub fn counts(&self) -> BTreeMap<String, u64> {
        self.state.lock().unwrap().counts.clone()
    }

    pub fn total(&self) -> u64 {
        self.state.lock().unwrap().counts.values().sum()
    }

    pub fn reset_counts(&self) {
        self.state.lock().unwrap().counts.clear();
    }

    /// Keep a log of every request (with its body) from now on.
    pub fn record(&self, on: bool) {
        let mut s = self.state.lock().unwrap();
        s.record = on;
        if on {
            s.events.clear();
        }
    }

    pub fn events(&self) -> Vec<ProxyEvent> {
        self.state.lock().unwrap().events.clone()
    }

    /// From now on every request that can say so asks for its consumed capacity, indexes
    /// included (`ReturnConsumedCapacity: INDEXES`, added unless the client asked itself),
    /// and [`Proxy::consumed`] sums what the answers report.
    pub fn measure_capacity(&self, on: bool) {
        let mut s = self.state.lock().unwrap();
        s.capacity = on;
        s.consumed.clear();
    }

    /// Per operation ("PutItem", "Query", ...): (capacity units consumed, error answers). A
    /// write refused by its condition reports no capacity here; DynamoDB charges it all the
    /// same (at least one write unit).
    pub fn consumed(&self) -> BTreeMap<String, (f64, u64)> {
        self.state.lock().unwrap().consumed.clone()
    }
}

/// Operations that take `ReturnConsumedCapacity`.
const CAPACITY_OPS: [&str; 9] = [
    "GetItem",
    "PutItem",
    "UpdateItem",
    "DeleteItem",
    "Query",
    "Scan",
    "BatchGetItem",
    "BatchWriteItem",
    "TransactWriteItems",
];

/// `body` asking for its consumed capacity (unchanged when it cannot or already does).
fn with_capacity(target: &str, body: &Bytes) -> Bytes {
    if !CAPACITY_OPS.contains(&target) {
        return body.clone();
    }
    match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(serde_json::Value::Object(mut m)) if !m.contains_key("ReturnConsumedCapacity") => {
            m.insert("ReturnConsumedCapacity".into(), "INDEXES".into());
            Bytes::from(serde_json::Value::Object(m).to_string())
        }
        _ => body.clone(),
    }
}

/// The capacity units an answer reports (one `ConsumedCapacity`, or a list of them).
fn capacity_of(answer: &[u8]) -> f64 {
    let v: serde_json::Value = serde_json::from_slice(answer).unwrap_or_default();
    let one = |c: &serde_json::Value| c["CapacityUnits"].as_f64().unwrap_or(0.0);
    match &v["ConsumedCapacity"] {
        serde_json::Value::Array(a) => a.iter().map(one).sum(),
        c => one(c),
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Upstream = Arc<tokio::sync::Mutex<Option<hyper::client::conn::http1::SendRequest<Full<Bytes>>>>>;

fn json_error(status: u16, ty: &str, msg: &str) -> Response<Full<Bytes>> {
    let body = serde_json::json!({"__type": ty, "message": msg}).to_string();
    Response::builder()
        .status(status)
        .header("content-type", "application/x-amz-json-1.0")
        .header("x-amzn-requestid", "proxy")
        .body(Full::new(Bytes::from(body)))
        .expect("response")
}

/// What the proxy answers its client: a response, or a closed connection.
type Answer = Result<Response<Full<Bytes>>, std::io::Error>;

async fn handle(st: Arc<Mutex<State>>, up: Upstream, upstream: SocketAddr, req: Request<Incoming>) -> Answer {
    let target = req
        .headers()
        .get("x-amz-target")
        .and_then(|v| v.to_str().ok())
        .map(|t| t.rsplit('.').next().unwrap_or(t).to_string())
        .unwrap_or_else(|| "-".into());
    let (parts, body) = req.into_parts();
    let body = body.collect().await.map_err(std::io::Error::other)?.to_bytes();
    let (fault, record, capacity) = {
        let mut s = st.lock().unwrap();
        *s.counts.entry(target.clone()).or_default() += 1;
        (s.pick(&target), s.record, s.capacity)
    };
    let body = if capacity { with_capacity(&target, &body) } else { body };
    let log = |status: u16| {
        if record {
            let mut s = st.lock().unwrap();
            s.events.push(ProxyEvent {
                at_ms: now_ms(),
                target: target.clone(),
                status,
                fault,
                request: String::from_utf8_lossy(&body).into_owned(),
                late: false,
            });
        }
    };
    if let Some((status, answer)) = answer_instead(fault) {
        log(status);
        return answer;
    }
    if let Some(ProxyFault::Delay(d)) = fault {
        tokio::time::sleep(d).await;
    }
    let fwd = upstream_request(parts, body.clone())?;
    if let Some(ProxyFault::DelayedDuplicate { hold, forward_after }) = fault {
        // The original goes on by itself, on a fresh upstream connection, at its own time.
        let late = Late { st: st.clone(), target: target.clone(), body: body.clone(), fault, record };
        tokio::spawn(late.forward(upstream, fwd, tokio::time::Instant::now() + forward_after));
        tokio::time::sleep(hold).await;
        log(0);
        return Err(std::io::Error::other("injected: request held, connection closed without an answer"));
    }
    let resp = if let Some(ProxyFault::Stall(d)) = fault {
        // The stalled request is forwarded by a task of its own, so it still lands after the
        // client gave up and closed its connection (as a request stuck in a network would).
        let up = up.clone();
        let landed = tokio::spawn(async move {
            tokio::time::sleep(d).await;
            forward(&up, upstream, fwd).await
        });
        landed.await.map_err(std::io::Error::other)??
    } else {
        forward(&up, upstream, fwd).await?
    };
    let status = resp.status().as_u16();
    let (rparts, rbody) = resp.into_parts();
    let rbody = rbody.collect().await.map_err(std::io::Error::other)?.to_bytes();
    if capacity {
        let mut s = st.lock().unwrap();
        let e = s.consumed.entry(target.clone()).or_default();
        e.0 += capacity_of(&rbody);
        e.1 += u64::from(status >= 400);
    }
    if fault == Some(ProxyFault::DropResponse) {
        log(0);
        return Err(std::io::Error::other("injected: response dropped after forwarding"));
    }
    log(status);
    Ok(Response::from_parts(rparts, Full::new(rbody)))
}

/// The answer a fault gives without forwarding (with the status to log), if it is one of
/// those.
fn answer_instead(fault: Option<ProxyFault>) -> Option<(u16, Answer)> {
    let ddb = |ty: &str| format!("com.amazonaws.dynamodb.v20120810#{ty}");
    Some(match fault? {
        ProxyFault::Reset => (0, Err(std::io::Error::other("injected reset"))),
        ProxyFault::Throttle => {
            (400, Ok(json_error(400, &ddb("ProvisionedThroughputExceededException"), "injected throttle")))
        }
        ProxyFault::ControlPlaneThrottle => {
            (400, Ok(json_error(400, &ddb("ThrottlingException"), "Rate of requests exceeds the allowed throughput.")))
        }
        ProxyFault::ServerError => (500, Ok(json_error(500, &ddb("InternalServerError"), "injected 5xx"))),
        _ => return None,
    })
}

/// The request to send upstream: the client's, with its body's length.
fn upstream_request(parts: hyper::http::request::Parts, body: Bytes) -> Result<Request<Full<Bytes>>, std::io::Error> {
    let mut fwd = Request::builder().method(parts.method).uri(parts.uri.path());
    for (k, v) in parts.headers.iter() {
        if k != hyper::header::CONTENT_LENGTH {
            fwd = fwd.header(k, v);
        }
    }
    fwd = fwd.header(hyper::header::CONTENT_LENGTH, body.len());
    fwd.body(Full::new(body)).map_err(std::io::Error::other)
}

/// A delayed duplicate's original request, forwarded on its own after its client was cut off.
struct Late {
    st: Arc<Mutex<State>>,
    target: String,
    body: Bytes,
    fault: Option<ProxyFault>,
    record: bool,
}

impl Late {
    /// Forwards `fwd` at `at` on a fresh upstream connection, and counts (and records) it.
    async fn forward(self, upstream: SocketAddr, fwd: Request<Full<Bytes>>, at: tokio::time::Instant) {
        tokio::time::sleep_until(at).await;
        let own: Upstream = Arc::new(tokio::sync::Mutex::new(None));
        let status = match forward(&own, upstream, fwd).await {
            Ok(resp) => {
                let status = resp.status().as_u16();
                let _ = resp.into_body().collect().await;
                status
            }
            Err(_) => 0,
        };
        let mut s = self.st.lock().unwrap();
        if status != 0 {
            s.late_forwarded += 1;
        }
        if self.record {
            s.events.push(ProxyEvent {
                at_ms: now_ms(),
                target: self.target,
                status,
                fault: self.fault,
                request: String::from_utf8_lossy(&self.body).into_owned(),
                late: true,
            });
        }
    }
}

async fn forward(
    up: &Upstream,
    upstream: SocketAddr,
    req: Request<Full<Bytes>>,
) -> Result<Response<Incoming>, std::io::Error> {
    let mut guard = up.lock().await;
    let need_new = match guard.as_ref() {
        None => true,
        Some(s) => s.is_closed(),
    };
    if need_new {
        let stream = TcpStream::connect(upstream).await?;
        let _ = stream.set_nodelay(true);
        let (sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(std::io::Error::other)?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        *guard = Some(sender);
    }
    let sender = guard.as_mut().expect("sender");
    sender.ready().await.map_err(std::io::Error::other)?;
    sender.send_request(req).await.map_err(std::io::Error::other)
}
