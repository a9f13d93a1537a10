//! Safety through the HTTP API: the real built `leasehold serve --table T` in front of
//! DynamoDB Local, with the fault proxy between the two, and holders that are plain HTTP
//! clients believing exactly what they are told.
//!
//! The failure leases exist for is the delayed duplicate: a request the coordinator gave up on
//! (its connection closed without an answer, so it retried) still reaches DynamoDB later. Here
//! 40% of the `UpdateItem`s are held 1 s, their connection is then closed without an answer,
//! and the original request is forwarded 1.85 s after it arrived, after the retry. Twelve
//! holders contend for one key with 2 s leases, renewing every 0.7 s; each believes it holds
//! the lease from the instant the acquire's answer arrives until its own send instant of the
//! request that answered last + `safe_for_ms` (or until a renewal fails or it releases). Two
//! holders' believed windows must never intersect, and a fenced resource written only inside
//! a believed window must never see a fence below one it has already seen.
//!
//! The holders talk to three coordinators (three `leasehold serve` processes on the same
//! table) whose wall clocks differ by up to 120 ms, within the 200 ms skew margin (Debian's
//! `faketime` shifts a process's clock). A second run adds coordinators whose clocks are 5 s
//! ahead and 5 s behind, beyond the margin: their holders must be refused (`ClockSkew`), never
//! granted, and the honest holders must neither overlap nor lose the key.
//!
//! `short_serve_safety_run` (14 s) and `wrong_clocks_are_refused_through_serve` are in the
//! normal suite; the long run (>= 60 s, `LEASEHOLD_SAFETY_SECS` to change it) is
//! `cargo test -p leasehold-tests --test safety_serve -- --ignored --nocapture`.

mod cli_support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use cli_support::{command_with_clock, dynamo_env, Server};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use leasehold_tests::proxied_table;
use leasehold_tests::proxy::ProxyFault;
use serde_json::{json, Value};

/// Lease duration the holders ask for.
const LEASE_MS: u64 = 2000;
/// How often a holder renews.
const RENEW_EVERY: Duration = Duration::from_millis(700);
/// The server's skew margin (LEASEHOLD_SKEW_MARGIN_MS), also what the fallback belief
/// subtracts while answers carry no `safe_for_ms`.
const MARGIN_MS: u64 = 200;

/// The one place the HTTP routes are spelled: `op` is "acquire", "heartbeat" or "release".
fn lease_path(key: &str, op: &str) -> String {
    format!("/leases/{op}/{key}")
}

fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn rand(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

/// One holder's HTTP/1.1 connection to the server, reopened after a failure.
struct Conn {
    addr: String,
    sender: Option<SendRequest<Full<Bytes>>>,
}

impl Conn {
    fn new(addr: &str) -> Conn {
        Conn { addr: addr.to_string(), sender: None }
    }

    /// POSTs `body` to `path`: the status and the JSON answer.
    async fn post(&mut self, path: &str, body: &Value) -> std::io::Result<(u16, Value)> {
        if self.sender.as_ref().is_none_or(|s| s.is_closed()) {
            self.sender = None;
            let stream = tokio::net::TcpStream::connect(&self.addr).await?;
            let _ = stream.set_nodelay(true);
            let (sender, conn) =
                hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(std::io::Error::other)?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            self.sender = Some(sender);
        }
        let sender = self.sender.as_mut().expect("connected");
        let result = async {
            sender.ready().await.map_err(std::io::Error::other)?;
            let req = hyper::Request::post(path)
                .header("host", &self.addr)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body.to_string())))
                .map_err(std::io::Error::other)?;
            let resp = sender.send_request(req).await.map_err(std::io::Error::other)?;
            let status = resp.status().as_u16();
            let bytes = resp.into_body().collect().await.map_err(std::io::Error::other)?.to_bytes();
            let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            Ok((status, v))
        }
        .await;
        if result.is_err() {
            self.sender = None;
        }
        result
    }

    /// Forgets the connection (after a request was abandoned mid-flight).
    fn reset(&mut self) {
        self.sender = None;
    }
}

/// A stretch of time during which one holder believed it held the key.
#[derive(Debug, Clone)]
struct Window {
    holder: String,
    fence: u64,
    start: Instant,
    end: Instant,
}

/// The resource the lease guards: written only inside a believed window.
#[derive(Default)]
struct Resource {
    highest: u64,
    accepted: u64,
    /// Writes made inside a believed window with a fence below the highest seen.
    stale: Vec<String>,
}

#[derive(Default)]
struct Totals {
    requests: AtomicU64,
    acquired: AtomicU64,
    held: AtomicU64,
    told_too_late: AtomicU64,
    heartbeats: AtomicU64,
    releases: AtomicU64,
    beliefs_ran_out: AtomicU64,
    errors: Mutex<BTreeMap<String, u64>>,
}

impl Totals {
    fn error(&self, what: impl Into<String>) {
        *self.errors.lock().unwrap().entry(what.into()).or_default() += 1;
    }
}

/// How long the holder may believe, from what an acquire or heartbeat answered: its own send
/// instant + `safe_for_ms`; while answers lack that field, `expires_at_ms` - the local wall
/// clock at the send - the margin (the server runs on this machine's clock).
fn belief(sent: Instant, sent_wall_ms: u64, answer: &Value, missing: &AtomicBool) -> Instant {
    if let Some(ms) = answer.get("safe_for_ms").and_then(Value::as_u64) {
        return sent + Duration::from_millis(ms);
    }
    if !missing.swap(true, Ordering::Relaxed) {
        eprintln!(
            "answers carry no safe_for_ms: believing until expires_at_ms - local clock at send - {MARGIN_MS} ms instead"
        );
    }
    let expires = answer.get("expires_at_ms").and_then(Value::as_u64).unwrap_or(0);
    sent + Duration::from_millis(expires.saturating_sub(sent_wall_ms).saturating_sub(MARGIN_MS))
}

struct Shared {
    /// Coordinators whose clocks are within the margin; holder n < `honest_holders` talks to
    /// `honest[n % len]`.
    honest: Vec<String>,
    honest_holders: usize,
    /// Coordinators whose clocks are beyond the margin; the other holders talk to these.
    rogue: Vec<String>,
    /// Leases granted to such holders (must stay 0).
    rogue_granted: AtomicU64,
    key: String,
    stop_at: Instant,
    t0: Instant,
    resource: Mutex<Resource>,
    windows: Mutex<Vec<Window>>,
    totals: Totals,
    missing_safe_for: AtomicBool,
}

impl Shared {
    /// A write to the resource, made only while `now < believed_until` (checked under the
    /// resource's lock, so a holder descheduled past its belief never writes).
    fn write(&self, holder: &str, fence: u64, believed_until: Instant) {
        let mut r = self.resource.lock().unwrap();
        let now = Instant::now();
        if now >= believed_until {
            return;
        }
        if fence < r.highest {
            let msg = format!(
                "{holder} wrote fence {fence} at {} ms inside its believed window, after fence {} was written",
                self.ms(now),
                r.highest
            );
            r.stale.push(msg);
        } else {
            r.highest = fence;
            r.accepted += 1;
        }
    }

    /// An instant as ms since the run started.
    fn ms(&self, t: Instant) -> i64 {
        if t >= self.t0 {
            t.duration_since(self.t0).as_millis() as i64
        } else {
            -(self.t0.duration_since(t).as_millis() as i64)
        }
    }
}

/// One holder: acquire, renew every 0.7 s while it believes it holds the key, release after 2-8
/// renewals; again until the run ends.
async fn holder(sh: Arc<Shared>, n: usize) {
    let name = format!("h{n}");
    let mut seed = 0x9E37_79B9_7F4A_7C15u64 ^ ((n as u64 + 1) * 0x1000_0001);
    let rogue = n >= sh.honest_holders;
    let mut conn = if rogue {
        Conn::new(&sh.rogue[(n - sh.honest_holders) % sh.rogue.len()])
    } else {
        Conn::new(&sh.honest[n % sh.honest.len()])
    };
    let t = &sh.totals;
    while Instant::now() < sh.stop_at {
        // Its own lease_id, so that a retried acquire returns the lease a lost attempt took.
        let lease_id = format!("{:016x}{:016x}", rand(&mut seed), rand(&mut seed));
        let acquire = json!({"holder": name, "duration_ms": LEASE_MS, "wait_ms": 1500, "lease_id": lease_id});
        let mut granted = None;
        for _attempt in 0..3 {
            let (sent, sent_wall) = (Instant::now(), wall_ms());
            t.requests.fetch_add(1, Ordering::Relaxed);
            match tokio::time::timeout(Duration::from_secs(15), conn.post(&lease_path(&sh.key, "acquire"), &acquire))
                .await
            {
                Ok(Ok((200, v))) => {
                    granted = Some((sent, sent_wall, v));
                    break;
                }
                Ok(Ok((409, _))) => {
                    t.held.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Ok(Ok((status, v))) => {
                    t.error(format!("acquire {status} {}", v["error"].as_str().unwrap_or("?")));
                    if status < 500 {
                        break;
                    }
                }
                Ok(Err(_)) | Err(_) => {
                    conn.reset();
                    t.error("acquire: no answer");
                }
            }
        }
        let Some((sent, sent_wall, answer)) = granted else {
            if rogue {
                // Refused at once: ask again a little later.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            continue;
        };
        if rogue {
            sh.rogue_granted.fetch_add(1, Ordering::Relaxed);
        }
        let start = Instant::now();
        let fence = answer["fence"].as_u64().expect("fence in the acquire answer");
        let mut believed_until = belief(sent, sent_wall, &answer, &sh.missing_safe_for);
        t.acquired.fetch_add(1, Ordering::Relaxed);
        let release = json!({"lease_id": lease_id});
        if believed_until <= start {
            // The answer arrived after the lease's safe time: never believed.
            t.told_too_late.fetch_add(1, Ordering::Relaxed);
            let _ = tokio::time::timeout(Duration::from_secs(5), conn.post(&lease_path(&sh.key, "release"), &release))
                .await;
            continue;
        }
        sh.write(&name, fence, believed_until);
        let renewals = 2 + rand(&mut seed) % 7;
        // Renewals every 0.7 s: the first 0.7 s after the grant arrived (an acquire may have
        // waited), then 0.7 s after each heartbeat was sent.
        let mut next_renewal = start + RENEW_EVERY;
        let mut end = None;
        for _ in 0..renewals {
            // Work a little in the middle of the interval, then renew.
            let mid = next_renewal - RENEW_EVERY / 2;
            tokio::time::sleep_until(mid.min(believed_until).into()).await;
            sh.write(&name, fence, believed_until);
            tokio::time::sleep_until(next_renewal.min(believed_until).into()).await;
            if Instant::now() >= believed_until {
                t.beliefs_ran_out.fetch_add(1, Ordering::Relaxed);
                end = Some(believed_until);
                break;
            }
            let (hb_sent, hb_wall) = (Instant::now(), wall_ms());
            next_renewal = hb_sent + RENEW_EVERY;
            t.requests.fetch_add(1, Ordering::Relaxed);
            let hb = json!({"lease_id": lease_id});
            // It stops believing when its belief runs out, answer or not.
            let answered =
                tokio::time::timeout_at(believed_until.into(), conn.post(&lease_path(&sh.key, "heartbeat"), &hb)).await;
            let now = Instant::now();
            match answered {
                Ok(Ok((200, v))) => {
                    t.heartbeats.fetch_add(1, Ordering::Relaxed);
                    let told = belief(hb_sent, hb_wall, &v, &sh.missing_safe_for);
                    if told <= now {
                        end = Some(now.min(believed_until));
                        t.told_too_late.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                    believed_until = told;
                    sh.write(&name, fence, believed_until);
                }
                Ok(Ok((status, v))) => {
                    t.error(format!("heartbeat {status} {}", v["error"].as_str().unwrap_or("?")));
                    end = Some(now.min(believed_until));
                    break;
                }
                Ok(Err(_)) => {
                    t.error("heartbeat: no answer");
                    end = Some(now.min(believed_until));
                    break;
                }
                Err(_) => {
                    conn.reset();
                    t.beliefs_ran_out.fetch_add(1, Ordering::Relaxed);
                    end = Some(believed_until);
                    break;
                }
            }
        }
        // Done (or no longer believing): stop believing as the release is sent, then release.
        let end = end.unwrap_or_else(|| Instant::now().min(believed_until));
        sh.windows.lock().unwrap().push(Window { holder: name.clone(), fence, start, end });
        t.requests.fetch_add(1, Ordering::Relaxed);
        match tokio::time::timeout(Duration::from_secs(5), conn.post(&lease_path(&sh.key, "release"), &release)).await {
            Ok(Ok((200, _))) => {
                t.releases.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Ok((status, v))) => t.error(format!("release {status} {}", v["error"].as_str().unwrap_or("?"))),
            _ => {
                conn.reset();
                t.error("release: no answer");
            }
        }
    }
}

/// Every pair of different holders' windows that intersect, in words.
fn overlaps(sh: &Shared) -> Vec<String> {
    let mut ws = sh.windows.lock().unwrap().clone();
    ws.sort_by_key(|w| w.start);
    let mut found = Vec::new();
    for (i, b) in ws.iter().enumerate() {
        for a in &ws[..i] {
            if a.holder != b.holder && a.end > b.start {
                found.push(format!(
                    "{} (fence {}) believed [{} ms, {} ms] and {} (fence {}) believed [{} ms, {} ms]: {} ms together",
                    a.holder,
                    a.fence,
                    sh.ms(a.start),
                    sh.ms(a.end),
                    b.holder,
                    b.fence,
                    sh.ms(b.start),
                    sh.ms(b.end),
                    sh.ms(a.end.min(b.end)) - sh.ms(b.start)
                ));
            }
        }
    }
    found
}

/// Clock offsets (s) of the coordinators within the margin: up to 120 ms apart.
const HONEST_CLOCKS: [f64; 3] = [0.0, 0.06, -0.06];

async fn serve_safety_run(seconds: u64, rogue_clocks: &[f64]) {
    let holders = 12;
    let rogue_holders = if rogue_clocks.is_empty() { 0 } else { 4 };
    let (proxy, table, _) = proxied_table().await;
    let mut env = dynamo_env(&proxy.endpoint());
    for (k, v) in [
        ("LEASEHOLD_MIN_DURATION_MS", "100".to_string()),
        ("LEASEHOLD_SKEW_MARGIN_MS", MARGIN_MS.to_string()),
        ("LEASEHOLD_RETRY_BUDGET_MS", "2500".to_string()),
        ("RUST_LOG", "warn".to_string()),
    ] {
        env.push((k.to_string(), v));
    }
    let store_args = vec!["--table".to_string(), table.clone()];
    let start = |offsets: Vec<f64>| {
        let (store_args, env) = (store_args.clone(), env.clone());
        tokio::task::spawn_blocking(move || {
            offsets.iter().map(|&o| Server::start_command(command_with_clock(o), &store_args, &env)).collect::<Vec<_>>()
        })
    };
    let honest = start(HONEST_CLOCKS.to_vec()).await.expect("start servers");
    let rogue = start(rogue_clocks.to_vec()).await.expect("start servers");
    proxy.random_faults_on(
        "UpdateItem",
        400,
        &[ProxyFault::DelayedDuplicate {
            hold: Duration::from_millis(1000),
            forward_after: Duration::from_millis(1850),
        }],
        0x5AFE,
    );
    let t0 = Instant::now();
    let sh = Arc::new(Shared {
        honest: honest.iter().map(|s| s.addr.clone()).collect(),
        honest_holders: holders,
        rogue: rogue.iter().map(|s| s.addr.clone()).collect(),
        rogue_granted: AtomicU64::new(0),
        key: "contended".into(),
        stop_at: t0 + Duration::from_secs(seconds),
        t0,
        resource: Mutex::default(),
        windows: Mutex::default(),
        totals: Totals::default(),
        missing_safe_for: AtomicBool::new(false),
    });
    let tasks: Vec<_> = (0..holders + rogue_holders).map(|n| tokio::spawn(holder(sh.clone(), n))).collect();
    for task in tasks {
        task.await.expect("holder");
    }
    // Let the last delayed duplicates land before counting them.
    tokio::time::sleep(Duration::from_millis(2000)).await;
    proxy.clear_faults();
    let found = overlaps(&sh);
    let stale = sh.resource.lock().unwrap().stale.clone();
    let t = &sh.totals;
    // Acquires are PutItems; heartbeats and releases are the UpdateItems the faults hit.
    let store_requests = proxy.counts();
    println!(
        "serve safety: {seconds} s, {holders} holders on one key through coordinators with clocks {HONEST_CLOCKS:?} s, \
         {rogue_holders} more through clocks {rogue_clocks:?} s (granted {}): HTTP requests {}, acquisitions {}, LeaseHeld {}, \
         heartbeats {}, releases {}, beliefs run out {}, answers too late to believe {}, errors {:?}, \
         DynamoDB requests {store_requests:?}, faults injected {}, duplicates forwarded late {}, writes accepted {}, \
         stale writes {}, overlaps {}{}",
        sh.rogue_granted.load(Ordering::Relaxed),
        t.requests.load(Ordering::Relaxed),
        t.acquired.load(Ordering::Relaxed),
        t.held.load(Ordering::Relaxed),
        t.heartbeats.load(Ordering::Relaxed),
        t.releases.load(Ordering::Relaxed),
        t.beliefs_ran_out.load(Ordering::Relaxed),
        t.told_too_late.load(Ordering::Relaxed),
        t.errors.lock().unwrap(),
        proxy.injected(),
        proxy.late_forwarded(),
        sh.resource.lock().unwrap().accepted,
        stale.len(),
        found.len(),
        if sh.missing_safe_for.load(Ordering::Relaxed) { " (fallback belief: no safe_for_ms)" } else { "" },
    );
    assert!(
        found.is_empty() && stale.is_empty(),
        "{} overlapping hold(s), {} stale write(s) (times in ms since the run started):\n{}\n{}",
        found.len(),
        stale.len(),
        found.join("\n"),
        stale.join("\n")
    );
    // The run must have exercised what it claims to.
    assert!(proxy.late_forwarded() > 0, "no delayed duplicate reached DynamoDB");
    assert!(t.acquired.load(Ordering::Relaxed) >= 2, "the key never changed hands");
    assert!(t.heartbeats.load(Ordering::Relaxed) >= 5, "too few renewals to mean anything");
    if rogue_holders > 0 {
        let refused =
            t.errors.lock().unwrap().iter().filter(|(k, _)| k.contains("ClockSkew")).map(|(_, n)| *n).sum::<u64>();
        assert_eq!(sh.rogue_granted.load(Ordering::Relaxed), 0, "a coordinator with a wrong clock granted a lease");
        assert!(refused > 0, "the wrong clocks were never refused with ClockSkew: {:?}", t.errors.lock().unwrap());
    }
    drop((honest, rogue));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_serve_safety_run() {
    serve_safety_run(14, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_clocks_are_refused_through_serve() {
    serve_safety_run(8, &[5.0, -5.0]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long run (>= 60 s): cargo test -p leasehold-tests --test safety_serve -- --ignored --nocapture"]
async fn long_serve_safety_run() {
    let secs = std::env::var("LEASEHOLD_SAFETY_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(60);
    serve_safety_run(secs, &[]).await;
}
