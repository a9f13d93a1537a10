//! Safety through the HTTP API: the real built `leasehold serve --table T` in front of
//! DynamoDB Local, with the fault proxy between the two, and holders that are plain HTTP
//! clients believing exactly what they are told.
//!
//! The failure leases exist for is the delayed duplicate: a request the coordinator gave up on
//! (its connection closed without an answer, so it retried) still reaches DynamoDB later. Here
//! 40% of the `UpdateItem`s are held 1 s, their connection is then closed without an answer,
//! and the original request is forwarded 1.85 s after it arrived, after the retry. Twelve
//! holders contend for one key with 3 s leases, renewing every 0.7 s; each believes it holds
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
//! `edge_clocks_through_serve_stay_safe` runs the same with two coordinators whose clocks sit
//! just inside opposite edges of the band the clock check accepts with steady traffic (found
//! first, in process, through the same proxy: about 490 ms ahead and 230 ms behind the
//! store's clock with the 200 ms margin): each is accepted, and their clocks differ by more
//! than three times the margin (DESIGN.md, "Clocks").
//!
//! A semaphore run (`semaphore_serve_safety_run`) puts 16 holders on a semaphore of 4 slots, on
//! the embedded store and on DynamoDB, with the fault proxy also between the holders and the
//! servers: never more than 4 may believe at once, and every holder must be served.
//!
//! `short_serve_safety_run` (14 s), `edge_clocks_through_serve_stay_safe` (14 s),
//! `wrong_clocks_are_refused_through_serve` and
//! `short_semaphore_serve_safety_run::{embedded,dynamodb}` (16 s) are in the normal suite; the
//! long runs (>= 60 s, `LEASEHOLD_SAFETY_SECS` to change it) are
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
use leasehold::store::DynamoStore;
use leasehold_tests::proxy::{Proxy, ProxyFault};
use leasehold_tests::{accepted_band, proxied_table, steady_traffic, test_config};
use serde_json::{json, Value};

/// Lease duration the holders ask for.
const LEASE_MS: u64 = 2000;
/// The plain run's: a renewal held 1 s by the fault proxy must still be answered within the
/// holder's belief (its safe time, which ends the safe margin before the expiry: 350 to 550 ms
/// on DynamoDB with steady traffic, up to about 1.3 s for a process's first answers; DESIGN.md,
/// "Clocks"), 0.7 s after the last renewal's send.
const SERVE_LEASE_MS: u64 = 3000;
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

/// The clocks of the coordinators the honest holders talk to.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Clocks {
    /// [`HONEST_CLOCKS`]: up to 120 ms apart.
    Near,
    /// Two coordinators just inside opposite edges of the band the clock check accepts.
    Edges,
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
    /// Acquisitions by the index of the coordinator that granted them.
    by_server: Mutex<BTreeMap<usize, u64>>,
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
    /// Holds of one renewal (the run at the clock band's edges).
    short_holds: bool,
    /// With short holds: the coordinator whose holders ask next, and when the last grant came.
    /// Each grant passes the turn to the other coordinator, so the key changes sides at nearly
    /// every hand-over; after 3 s without a grant every holder asks.
    turn: Mutex<(usize, Instant)>,
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

/// An acquire through `conn`, sent up to 3 times while it fails without an answer or with a
/// 5xx (the body carries the holder's own lease_id, so a retry returns what a lost attempt
/// took). The grant with its send instant and wall clock, or None (held, refused, no answer).
async fn acquire(conn: &mut Conn, key: &str, body: &Value, t: &Totals) -> Option<(Instant, u64, Value)> {
    for _attempt in 0..3 {
        let (sent, sent_wall) = (Instant::now(), wall_ms());
        t.requests.fetch_add(1, Ordering::Relaxed);
        match tokio::time::timeout(Duration::from_secs(15), conn.post(&lease_path(key, "acquire"), body)).await {
            Ok(Ok((200, v))) => return Some((sent, sent_wall, v)),
            Ok(Ok((409, _))) => {
                t.held.fetch_add(1, Ordering::Relaxed);
                return None;
            }
            Ok(Ok((status, v))) => {
                t.error(format!("acquire {status} {}", v["error"].as_str().unwrap_or("?")));
                if status < 500 {
                    return None;
                }
            }
            Ok(Err(_)) | Err(_) => {
                conn.reset();
                t.error("acquire: no answer");
            }
        }
    }
    None
}

/// What a holder believes after a heartbeat.
enum Renewal {
    /// Renewed: it may believe until then.
    Until(Instant),
    /// It stopped believing then (refused, no answer, or told after the new safe time).
    Ended(Instant),
}

/// One heartbeat of `lease_id`. The holder stops believing when its belief runs out, answer
/// or not.
async fn renew(
    conn: &mut Conn,
    key: &str,
    lease_id: &str,
    believed_until: Instant,
    t: &Totals,
    missing_safe_for: &AtomicBool,
) -> Renewal {
    let (sent, sent_wall) = (Instant::now(), wall_ms());
    t.requests.fetch_add(1, Ordering::Relaxed);
    let hb = json!({"lease_id": lease_id});
    let answered = tokio::time::timeout_at(believed_until.into(), conn.post(&lease_path(key, "heartbeat"), &hb)).await;
    let now = Instant::now();
    match answered {
        Ok(Ok((200, v))) => {
            t.heartbeats.fetch_add(1, Ordering::Relaxed);
            let told = belief(sent, sent_wall, &v, missing_safe_for);
            if told <= now {
                t.told_too_late.fetch_add(1, Ordering::Relaxed);
                return Renewal::Ended(now.min(believed_until));
            }
            Renewal::Until(told)
        }
        Ok(Ok((status, v))) => {
            t.error(format!("heartbeat {status} {}", v["error"].as_str().unwrap_or("?")));
            Renewal::Ended(now.min(believed_until))
        }
        Ok(Err(_)) => {
            conn.reset();
            t.error("heartbeat: no answer");
            Renewal::Ended(now.min(believed_until))
        }
        Err(_) => {
            conn.reset();
            t.beliefs_ran_out.fetch_add(1, Ordering::Relaxed);
            Renewal::Ended(believed_until)
        }
    }
}

/// Releases `lease_id` (one try, 5 s).
async fn release(conn: &mut Conn, key: &str, lease_id: &str, t: &Totals) {
    t.requests.fetch_add(1, Ordering::Relaxed);
    let body = json!({"lease_id": lease_id});
    match tokio::time::timeout(Duration::from_secs(5), conn.post(&lease_path(key, "release"), &body)).await {
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
        // At the clock band's edges, holders poll rather than queue: a coordinator wakes its own
        // waiters first, which would keep the key on one side; polled, it passes to whichever
        // side asks first after a release.
        let wait_ms = if sh.short_holds { 0 } else { 1500 };
        let side = n % sh.honest.len().max(1);
        if sh.short_holds && !rogue {
            let (turn, since) = *sh.turn.lock().unwrap();
            if turn != side && since.elapsed() < Duration::from_secs(3) {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        }
        let acquire_body =
            json!({"holder": name, "duration_ms": SERVE_LEASE_MS, "wait_ms": wait_ms, "lease_id": lease_id});
        let granted = acquire(&mut conn, &sh.key, &acquire_body, t).await;
        let Some((sent, sent_wall, answer)) = granted else {
            if rogue {
                // Refused at once: ask again a little later.
                tokio::time::sleep(Duration::from_millis(100)).await;
            } else if sh.short_holds {
                tokio::time::sleep(Duration::from_millis(20 + rand(&mut seed) % 200)).await;
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
        if !rogue {
            *t.by_server.lock().unwrap().entry(side).or_default() += 1;
            *sh.turn.lock().unwrap() = ((side + 1) % sh.honest.len(), Instant::now());
        }
        let release_body = json!({"lease_id": lease_id});
        if believed_until <= start {
            // The answer arrived after the lease's safe time: never believed.
            t.told_too_late.fetch_add(1, Ordering::Relaxed);
            let _ =
                tokio::time::timeout(Duration::from_secs(5), conn.post(&lease_path(&sh.key, "release"), &release_body))
                    .await;
            continue;
        }
        sh.write(&name, fence, believed_until);
        // At the clock band's edges the holds are short, so that the key changes hands (and
        // coordinators) often within the run.
        let renewals = if sh.short_holds { 1 } else { 2 + rand(&mut seed) % 7 };
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
            next_renewal = Instant::now() + RENEW_EVERY;
            match renew(&mut conn, &sh.key, &lease_id, believed_until, t, &sh.missing_safe_for).await {
                Renewal::Until(told) => {
                    believed_until = told;
                    sh.write(&name, fence, believed_until);
                }
                Renewal::Ended(at) => {
                    end = Some(at);
                    break;
                }
            }
        }
        // Done (or no longer believing): stop believing as the release is sent, then release.
        let end = end.unwrap_or_else(|| Instant::now().min(believed_until));
        sh.windows.lock().unwrap().push(Window { holder: name.clone(), fence, start, end });
        release(&mut conn, &sh.key, &lease_id, t).await;
    }
}

/// How often the key passed from one coordinator's holder to the next grant's coordinator,
/// by (from, to): windows in fence order (every grant's fence is above the one before).
fn hand_overs(sh: &Shared) -> BTreeMap<(usize, usize), u64> {
    let mut ws = sh.windows.lock().unwrap().clone();
    ws.sort_by_key(|w| w.fence);
    let server = |w: &Window| w.holder[1..].parse::<usize>().expect("holder h<n>") % sh.honest.len();
    let mut handed = BTreeMap::new();
    for pair in ws.windows(2) {
        let (from, to) = (server(&pair[0]), server(&pair[1]));
        if from != to {
            *handed.entry((from, to)).or_default() += 1;
        }
    }
    handed
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

/// The clock offsets (s) of two coordinators just inside opposite edges of the band the clock
/// check accepts on `table` through `conf` (the run's proxy), with steady traffic: found in
/// process, on the same DynamoDB Local and proxy, as the narrowest edges over a second and a
/// half of steady answers (DESIGN.md, "Clocks").
async fn edge_clocks(conf: &aws_config::SdkConfig, table: &str) -> Vec<f64> {
    let store: Arc<dyn leasehold::store::Store> =
        Arc::new(DynamoStore::new(aws_sdk_dynamodb::Client::new(conf), table.to_string()));
    let traffic = steady_traffic(store.clone(), "edge-traffic");
    let config = leasehold::Config { skew_margin: Duration::from_millis(MARGIN_MS), ..test_config() };
    let (mut ahead, mut behind) = (i64::MAX, i64::MAX);
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (a, b) = accepted_band(store.clone(), &config, 5, 3000).await;
        (ahead, behind) = (ahead.min(a), behind.min(b));
    }
    traffic.abort();
    println!("band the clock check accepts with steady traffic: {ahead} ms ahead, {behind} ms behind");
    // A server's evidence keeps narrowing over the run (answers at ever more phases), and a
    // clock at the band's measured edge would soon be refused (`ClockSkew`), leaving the run
    // to one coordinator. So the clocks stay a little inside: behind within the margin, ahead
    // 60 ms inside the measured edge, still further apart than twice the margin.
    let behind = behind.min(MARGIN_MS as i64) - 20;
    vec![(ahead - 60) as f64 / 1000.0, -behind as f64 / 1000.0]
}

async fn serve_safety_run(seconds: u64, clocks: Clocks, rogue_clocks: &[f64]) {
    let holders = 12;
    let rogue_holders = if rogue_clocks.is_empty() { 0 } else { 4 };
    let (proxy, table, conf) = proxied_table().await;
    let honest_clocks = match clocks {
        Clocks::Near => HONEST_CLOCKS.to_vec(),
        Clocks::Edges => edge_clocks(&conf, &table).await,
    };
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
    let honest = start(honest_clocks.clone()).await.expect("start servers");
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
        short_holds: clocks == Clocks::Edges,
        turn: Mutex::new((0, t0)),
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
        "serve safety: {seconds} s, {holders} holders on one key through coordinators with clocks {honest_clocks:?} s, \
         {rogue_holders} more through clocks {rogue_clocks:?} s (granted {}): HTTP requests {}, acquisitions {} (by coordinator {:?}), LeaseHeld {}, \
         heartbeats {}, releases {}, beliefs run out {}, answers too late to believe {}, errors {:?}, \
         DynamoDB requests {store_requests:?}, faults injected {}, duplicates forwarded late {}, writes accepted {}, \
         stale writes {}, overlaps {}{}",
        sh.rogue_granted.load(Ordering::Relaxed),
        t.requests.load(Ordering::Relaxed),
        t.acquired.load(Ordering::Relaxed),
        t.by_server.lock().unwrap(),
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
    if clocks == Clocks::Edges {
        // The key passed from each edge to the other, again and again: the hand-overs that an
        // overlap would show in.
        let by = t.by_server.lock().unwrap().clone();
        let handed = hand_overs(&sh);
        println!("hand-overs between the edges' coordinators (from, to): {handed:?}");
        assert!(
            [(0, 1), (1, 0)].iter().all(|pair| handed.get(pair).is_some_and(|&n| n >= 3)),
            "the key seldom passed between the edges: grants by coordinator {by:?}, hand-overs {handed:?}"
        );
    }
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
    serve_safety_run(14, Clocks::Near, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_clocks_are_refused_through_serve() {
    serve_safety_run(8, Clocks::Near, &[5.0, -5.0]).await;
}

/// Two coordinators just inside opposite edges of the band the clock check accepts (each
/// accepted, their clocks further apart than the margin: about 700 ms with the 200 ms margin),
/// under the same run: no two believed holds may overlap (DESIGN.md, "Clocks").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edge_clocks_through_serve_stay_safe() {
    serve_safety_run(24, Clocks::Edges, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long run (>= 60 s): cargo test -p leasehold-tests --test safety_serve -- --ignored --nocapture"]
async fn long_serve_safety_run() {
    let secs = std::env::var("LEASEHOLD_SAFETY_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(60);
    serve_safety_run(secs, Clocks::Near, &[]).await;
}

// ---- semaphores ---------------------------------------------------------------------------------

/// The semaphore run: 16 holders on a semaphore of 4 slots.
const SEM_SLOTS: u64 = 4;
const SEM_HOLDERS: usize = 16;
/// Clock offsets (s) of the semaphore run's two coordinators, within the margin.
const SEM_CLOCKS: [f64; 2] = [0.0, 0.06];
/// How long a holder never served by the end of the run keeps trying.
const SEM_OVERTIME: Duration = Duration::from_secs(30);

/// Where the semaphore run's `leasehold serve` processes keep the semaphore.
#[derive(Clone, Copy, Debug)]
enum SemStore {
    /// `--db FILE`: both servers on one embedded store file.
    Embedded,
    /// `--table T` on DynamoDB Local, behind the DynamoDB fault proxy.
    Dynamo,
}

struct SemShared {
    /// The holders' entry points: the HTTP fault proxy in front of each server.
    servers: Vec<String>,
    key: String,
    stop_at: Instant,
    t0: Instant,
    windows: Mutex<Vec<Window>>,
    /// Acquisitions each holder believed.
    served: Vec<AtomicU64>,
    /// Holders first served after the end, in their overtime.
    served_late: AtomicU64,
    /// The lease_id each fence was granted to: two grants never share a fence.
    fences: Mutex<BTreeMap<u64, String>>,
    shared_fences: Mutex<Vec<String>>,
    pauses: AtomicU64,
    /// Heartbeats granted to a holder paused past its slot's expiry: must stay 0.
    revived: AtomicU64,
    totals: Totals,
    missing_safe_for: AtomicBool,
}

impl SemShared {
    /// An instant as ms since the run started.
    fn ms(&self, t: Instant) -> i64 {
        if t >= self.t0 {
            t.duration_since(self.t0).as_millis() as i64
        } else {
            -(self.t0.duration_since(t).as_millis() as i64)
        }
    }
}

/// One semaphore holder: take a slot (waiting up to 1.5 s), renew it 1-3 times every 0.7 s
/// while it believes it holds it, release it, pause 0.2-1.2 s; again until the run ends. One
/// grant in eight, the holder is instead frozen past its slot's expiry (a GC pause, a stopped
/// VM: its renewals freeze too); it believes until its safe time, and when it wakes its renewal
/// must be refused.
async fn sem_holder(sh: Arc<SemShared>, n: usize) {
    let name = format!("s{n}");
    let mut seed = 0x5E3A_F00D_u64 ^ ((n as u64 + 1) * 0x1000_0001);
    let mut conn = Conn::new(&sh.servers[n % sh.servers.len()]);
    let t = &sh.totals;
    // A holder never served by the end keeps trying (the faults go on) for up to SEM_OVERTIME:
    // the order across processes is not FIFO, so a waiter is only promised a slot eventually.
    let unserved = || sh.served[n].load(Ordering::Relaxed) == 0;
    while Instant::now() < sh.stop_at || (unserved() && Instant::now() < sh.stop_at + SEM_OVERTIME) {
        let lease_id = format!("{:016x}{:016x}", rand(&mut seed), rand(&mut seed));
        let acquire_body = json!({"holder": name, "duration_ms": LEASE_MS, "wait_ms": 1500, "lease_id": lease_id,
                                  "slots": SEM_SLOTS});
        let granted = acquire(&mut conn, &sh.key, &acquire_body, t).await;
        let Some((sent, sent_wall, answer)) = granted else { continue };
        let start = Instant::now();
        let fence = answer["fence"].as_u64().expect("fence in the acquire answer");
        if let Some(other) = sh.fences.lock().unwrap().insert(fence, lease_id.clone()) {
            if other != lease_id {
                sh.shared_fences.lock().unwrap().push(format!("fence {fence} granted to {other} and {lease_id}"));
            }
        }
        let mut believed_until = belief(sent, sent_wall, &answer, &sh.missing_safe_for);
        t.acquired.fetch_add(1, Ordering::Relaxed);
        let release_body = json!({"lease_id": lease_id});
        let hb = json!({"lease_id": lease_id});
        if believed_until <= start {
            t.told_too_late.fetch_add(1, Ordering::Relaxed);
            let _ =
                tokio::time::timeout(Duration::from_secs(5), conn.post(&lease_path(&sh.key, "release"), &release_body))
                    .await;
            continue;
        }
        if sh.served[n].fetch_add(1, Ordering::Relaxed) == 0 && start >= sh.stop_at {
            sh.served_late.fetch_add(1, Ordering::Relaxed);
        }
        let end = if rand(&mut seed).is_multiple_of(8) {
            sh.pauses.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep_until((start + Duration::from_millis(LEASE_MS + 400)).into()).await;
            t.requests.fetch_add(1, Ordering::Relaxed);
            let renewed =
                tokio::time::timeout(Duration::from_secs(5), conn.post(&lease_path(&sh.key, "heartbeat"), &hb)).await;
            match renewed {
                Ok(Ok((200, v))) => {
                    sh.revived.fetch_add(1, Ordering::Relaxed);
                    eprintln!("{name}: renewed {v} after a pause past its slot's expiry");
                }
                Ok(Ok(_)) => {}
                _ => conn.reset(),
            }
            believed_until
        } else {
            let mut next_renewal = start + RENEW_EVERY;
            let mut end = None;
            for _ in 0..1 + rand(&mut seed) % 3 {
                tokio::time::sleep_until(next_renewal.min(believed_until).into()).await;
                if Instant::now() >= believed_until {
                    t.beliefs_ran_out.fetch_add(1, Ordering::Relaxed);
                    end = Some(believed_until);
                    break;
                }
                next_renewal = Instant::now() + RENEW_EVERY;
                match renew(&mut conn, &sh.key, &lease_id, believed_until, t, &sh.missing_safe_for).await {
                    Renewal::Until(told) => believed_until = told,
                    Renewal::Ended(at) => {
                        end = Some(at);
                        break;
                    }
                }
            }
            // Done: it stops believing as it sends the release.
            end.unwrap_or_else(|| Instant::now().min(believed_until))
        };
        sh.windows.lock().unwrap().push(Window { holder: name.clone(), fence, start, end });
        release(&mut conn, &sh.key, &lease_id, t).await;
        tokio::time::sleep(Duration::from_millis(200 + rand(&mut seed) % 1000)).await;
    }
}

/// The most windows that intersect at one instant, and one such instant (ms since the start).
fn most_at_once(sh: &SemShared) -> (usize, i64) {
    let ws = sh.windows.lock().unwrap();
    let mut edges: Vec<(Instant, i32)> = ws.iter().flat_map(|w| [(w.start, 1), (w.end, -1)]).collect();
    // At equal instants an end counts before a start: the windows are half-open.
    edges.sort_by_key(|(t, d)| (*t, *d));
    let (mut now, mut most, mut at) = (0i64, 0i64, 0);
    for (t, d) in edges {
        now += d as i64;
        if now > most {
            (most, at) = (now, sh.ms(t));
        }
    }
    (most.max(0) as usize, at)
}

/// The windows that contain the instant `at_ms` (ms since the start), in words.
fn believers_at(sh: &SemShared, at_ms: i64) -> Vec<String> {
    let ws = sh.windows.lock().unwrap();
    ws.iter()
        .filter(|w| sh.ms(w.start) <= at_ms && sh.ms(w.end) > at_ms)
        .map(|w| format!("{} (fence {}) [{} ms, {} ms]", w.holder, w.fence, sh.ms(w.start), sh.ms(w.end)))
        .collect()
}

/// 16 holders (plain HTTP clients believing exactly what they are told) on a semaphore of 4
/// slots through two `leasehold serve` processes on one store, whose clocks differ by 60 ms.
/// Between each holder and its server, the fault proxy delays duplicates (the request held
/// 1 s, its connection closed without an answer, the original forwarded 1.85 s after it
/// arrived, after the holder's retry) and loses answers (the request forwarded, the connection
/// closed) on 10% of the requests; on DynamoDB, the proxy in front of DynamoDB Local does the
/// same to 10% of the UpdateItems (takes, renewals, releases). One grant in eight is
/// frozen past its slot's expiry. Never more than 4 holders may believe at once, no two grants
/// may share a fence, no frozen holder's slot may be renewed after its expiry, and every
/// holder must be served (one not served by the end keeps trying, faults and all, for up to
/// 30 s more: the order across processes is not FIFO, only each waiter's turn eventually).
async fn semaphore_serve_safety_run(store: SemStore, seconds: u64) {
    let dir = leasehold_tests::TempDir::new("sem-safety");
    let mut env = Vec::new();
    let mut dynamo_proxy = None;
    let store_args = match store {
        SemStore::Embedded => vec!["--db".to_string(), dir.path().join("leases.db").display().to_string()],
        SemStore::Dynamo => {
            let (proxy, table, _) = proxied_table().await;
            env = dynamo_env(&proxy.endpoint());
            dynamo_proxy = Some(proxy);
            vec!["--table".to_string(), table]
        }
    };
    for (k, v) in [
        ("LEASEHOLD_MIN_DURATION_MS", "100".to_string()),
        ("LEASEHOLD_SKEW_MARGIN_MS", MARGIN_MS.to_string()),
        ("LEASEHOLD_RETRY_BUDGET_MS", "2500".to_string()),
        ("RUST_LOG", "warn".to_string()),
    ] {
        env.push((k.to_string(), v));
    }
    let servers = {
        let (store_args, env) = (store_args.clone(), env.clone());
        tokio::task::spawn_blocking(move || {
            SEM_CLOCKS
                .iter()
                .map(|&o| Server::start_command(command_with_clock(o), &store_args, &env))
                .collect::<Vec<_>>()
        })
        .await
        .expect("start servers")
    };
    let duplicate =
        ProxyFault::DelayedDuplicate { hold: Duration::from_millis(1000), forward_after: Duration::from_millis(1850) };
    let mut http_proxies = Vec::new();
    for (i, s) in servers.iter().enumerate() {
        let p = Proxy::start(s.addr.parse().expect("server address")).await;
        p.random_faults(100, &[duplicate, ProxyFault::DropResponse], 0x5E4A + i as u64);
        http_proxies.push(p);
    }
    if let Some(p) = &dynamo_proxy {
        p.random_faults_on("UpdateItem", 100, &[duplicate, ProxyFault::DropResponse], 0x5E4D);
    }
    let t0 = Instant::now();
    let sh = Arc::new(SemShared {
        servers: http_proxies.iter().map(|p| format!("127.0.0.1:{}", p.port)).collect(),
        key: "semaphore".into(),
        stop_at: t0 + Duration::from_secs(seconds),
        t0,
        windows: Mutex::default(),
        served: (0..SEM_HOLDERS).map(|_| AtomicU64::new(0)).collect(),
        served_late: AtomicU64::new(0),
        fences: Mutex::default(),
        shared_fences: Mutex::default(),
        pauses: AtomicU64::new(0),
        revived: AtomicU64::new(0),
        totals: Totals::default(),
        missing_safe_for: AtomicBool::new(false),
    });
    let tasks: Vec<_> = (0..SEM_HOLDERS).map(|n| tokio::spawn(sem_holder(sh.clone(), n))).collect();
    for task in tasks {
        task.await.expect("holder");
    }
    // Let the last delayed duplicates land before counting them.
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let late = http_proxies.iter().map(|p| p.late_forwarded()).sum::<u64>()
        + dynamo_proxy.as_ref().map_or(0, |p| p.late_forwarded());
    let injected =
        http_proxies.iter().map(|p| p.injected()).sum::<u64>() + dynamo_proxy.as_ref().map_or(0, |p| p.injected());
    let (most, at) = most_at_once(&sh);
    let served: Vec<u64> = sh.served.iter().map(|s| s.load(Ordering::Relaxed)).collect();
    let shared = sh.shared_fences.lock().unwrap().clone();
    let t = &sh.totals;
    println!(
        "semaphore serve safety ({store:?}): {seconds} s, {SEM_HOLDERS} holders on {SEM_SLOTS} slots through \
         coordinators with clocks {SEM_CLOCKS:?} s: HTTP requests {}, acquisitions {}, served per holder {}..{} \
         ({served:?}, {} first served in overtime), LeaseHeld {}, heartbeats {}, releases {}, pauses past expiry {}, renewed after expiry {}, \
         beliefs run out {}, answers too late to believe {}, errors {:?}, DynamoDB requests {:?}, faults injected \
         {injected}, duplicates forwarded late {late}, most believed holders at once {most} (at {at} ms), \
         fences shared {}{}",
        t.requests.load(Ordering::Relaxed),
        t.acquired.load(Ordering::Relaxed),
        served.iter().min().unwrap(),
        served.iter().max().unwrap(),
        sh.served_late.load(Ordering::Relaxed),
        t.held.load(Ordering::Relaxed),
        t.heartbeats.load(Ordering::Relaxed),
        t.releases.load(Ordering::Relaxed),
        sh.pauses.load(Ordering::Relaxed),
        sh.revived.load(Ordering::Relaxed),
        t.beliefs_ran_out.load(Ordering::Relaxed),
        t.told_too_late.load(Ordering::Relaxed),
        t.errors.lock().unwrap(),
        dynamo_proxy.as_ref().map(|p| p.counts()),
        shared.len(),
        if sh.missing_safe_for.load(Ordering::Relaxed) { " (fallback belief: no safe_for_ms)" } else { "" },
    );
    assert!(
        most <= SEM_SLOTS as usize,
        "{most} holders believed they held one of {SEM_SLOTS} slots at {at} ms:\n{}",
        believers_at(&sh, at).join("\n")
    );
    assert!(shared.is_empty(), "grants shared a fence:\n{}", shared.join("\n"));
    assert_eq!(sh.revived.load(Ordering::Relaxed), 0, "a slot was renewed after its expiry");
    assert!(served.iter().all(|&s| s >= 1), "a holder was never served: {served:?}");
    // The run must have exercised what it claims to.
    assert!(late > 0, "no delayed duplicate landed late");
    assert!(sh.pauses.load(Ordering::Relaxed) > 0, "no holder was paused");
    assert!(most >= 3, "the slots were never shared: at most {most} at once");
    assert!(t.held.load(Ordering::Relaxed) > 0, "the semaphore was never full");
    drop((http_proxies, servers, dir));
}

leasehold_tests::variants!(async [
    embedded => SemStore::Embedded,
    dynamodb => SemStore::Dynamo,
]: short_semaphore_serve_safety_run);

async fn short_semaphore_serve_safety_run(store: SemStore) {
    semaphore_serve_safety_run(store, 16).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long run (>= 60 s per store): cargo test -p leasehold-tests --test safety_serve -- --ignored --nocapture"]
async fn long_semaphore_serve_safety_run() {
    let secs = std::env::var("LEASEHOLD_SAFETY_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(60);
    for store in [SemStore::Embedded, SemStore::Dynamo] {
        semaphore_serve_safety_run(store, secs).await;
    }
}
