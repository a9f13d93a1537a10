//! Step Functions' API throttling, which moto does not do, enforced by an adapter in front of
//! moto: one token bucket per throttled action, per account and Region as Step Functions keeps
//! them (a bucket of `size` tokens refilled at `refill` per second; a call with no token left is
//! answered `400 ThrottlingException` and never reaches moto). Every other call passes.
//!
//! [`DOCUMENTED`] holds the default quotas of the Step Functions Developer Guide ("Quotas",
//! the API actions table, US East (N. Virginia), US West (Oregon) and Europe (Ireland) column;
//! awsdocs/aws-step-functions-developer-guide, doc_source/limits-overview.md): DescribeExecution
//! 300 and 15 per second, ListExecutions 200 and 5 per second (250 / 10 and 100 / 2 in the other
//! Regions). AWS may raise them at any time; these are the floors a deployment must live with.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

/// (action, bucket size, refill per second): Step Functions' documented defaults in its
/// largest Regions.
pub const DOCUMENTED: [(&str, f64, f64); 2] = [("DescribeExecution", 300.0, 15.0), ("ListExecutions", 200.0, 5.0)];

/// One action's token bucket, full at the start.
struct Bucket {
    size: f64,
    refill: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn take(&mut self, now: Instant) -> bool {
        self.tokens = (self.tokens + now.duration_since(self.at).as_secs_f64() * self.refill).min(self.size);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[derive(Default)]
struct State {
    buckets: BTreeMap<String, Bucket>,
    /// Per action: (passed to moto, throttled).
    calls: BTreeMap<String, (u64, u64)>,
}

/// The adapter, on 127.0.0.1; dropped, it stops accepting.
pub struct SfnThrottle {
    pub port: u16,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl SfnThrottle {
    /// Starts the adapter in front of moto at `upstream`, throttling `buckets`.
    pub async fn start(upstream: SocketAddr, buckets: &[(&str, f64, f64)]) -> SfnThrottle {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let now = Instant::now();
        let mut st = State::default();
        for (action, size, refill) in buckets {
            st.buckets.insert(action.to_string(), Bucket { size: *size, refill: *refill, tokens: *size, at: now });
        }
        let state = Arc::new(Mutex::new(st));
        let st = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let st = st.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let st = st.clone();
                        async move { handle(st, upstream, req).await }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .keep_alive(true)
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        SfnThrottle { port, state, task }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// (passed, throttled) calls of `action` so far.
    pub fn calls(&self, action: &str) -> (u64, u64) {
        self.state.lock().unwrap().calls.get(action).copied().unwrap_or_default()
    }

    /// Every action's (passed, throttled) calls so far.
    pub fn all_calls(&self) -> BTreeMap<String, (u64, u64)> {
        self.state.lock().unwrap().calls.clone()
    }

    /// Refills every bucket and forgets the counts (a fresh minute of quota).
    pub fn reset(&self) {
        let mut s = self.state.lock().unwrap();
        let now = Instant::now();
        for b in s.buckets.values_mut() {
            b.tokens = b.size;
            b.at = now;
        }
        s.calls.clear();
    }
}

impl Drop for SfnThrottle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn handle(
    st: Arc<Mutex<State>>,
    upstream: SocketAddr,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, std::io::Error> {
    let action = req
        .headers()
        .get("x-amz-target")
        .and_then(|v| v.to_str().ok())
        .and_then(|t| t.rsplit('.').next())
        .unwrap_or("")
        .to_string();
    let allowed = {
        let mut s = st.lock().unwrap();
        let ok = s.buckets.get_mut(&action).is_none_or(|b| b.take(Instant::now()));
        let c = s.calls.entry(action).or_default();
        if ok {
            c.0 += 1;
        } else {
            c.1 += 1;
        }
        ok
    };
    if !allowed {
        return Ok(Response::builder()
            .status(400)
            .header("content-type", "application/x-amz-json-1.0")
            .header("x-amzn-requestid", "throttled-by-the-tests-adapter")
            .body(Full::new(Bytes::from_static(br#"{"__type":"ThrottlingException","message":"Rate exceeded"}"#)))
            .expect("response"));
    }
    let (parts, body) = req.into_parts();
    let body = body.collect().await.map_err(std::io::Error::other)?.to_bytes();
    let stream = TcpStream::connect(upstream).await?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(std::io::Error::other)?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut fwd = Request::builder().method(parts.method).uri(parts.uri);
    for (k, v) in parts.headers.iter() {
        fwd = fwd.header(k, v);
    }
    let resp = sender
        .send_request(fwd.body(Full::new(body)).map_err(std::io::Error::other)?)
        .await
        .map_err(std::io::Error::other)?;
    let (rparts, rbody) = resp.into_parts();
    let rbody = rbody.collect().await.map_err(std::io::Error::other)?.to_bytes();
    Ok(Response::from_parts(rparts, Full::new(rbody)))
}
