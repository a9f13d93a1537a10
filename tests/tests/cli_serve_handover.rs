//! `leasehold serve` processes sharing one store (DESIGN.md, "In-process waiters" and
//! "Cancellation"): the in-process hand-over does not starve a waiter of another process, and
//! an acquire whose client disconnects leaves no lease behind. On the embedded store and on
//! DynamoDB Local.

mod cli_support;

use std::io::Write;
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cli_support::{eventually, http, Server, Target};
use leasehold_tests::variants;
use serde_json::Value;

variants!(sync [embedded => &Target::embedded(), dynamodb => &Target::dynamo()]:
    a_waiter_in_another_serve_process_gets_its_turn,
    acquires_whose_client_disconnects_leave_no_lease,
);

fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"))
}

fn post(addr: &str, path: &str, body: &str) -> (u16, Value) {
    let (s, _, b) = http(addr, "POST", path, &[("content-type", "application/json")], body.as_bytes());
    (s, json(&b))
}

/// A turn on the key: who, its fence, when it was granted.
type Turns = Arc<Mutex<Vec<(String, u64, Instant)>>>;

/// Two clients of one server alternate on a key (acquire waiting, hold 1 s, release); one
/// acquire waits on a second server over the same store. The in-process hand-over of the first
/// server must not keep the key from it: it is served within 3 turns of starting to wait, and
/// the first server's clients still alternate.
fn a_waiter_in_another_serve_process_gets_its_turn(t: &Target) {
    let one = Server::start(&t.args, &t.env);
    let two = Server::start(&t.args, &t.env);
    let turns: Turns = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let hold = Duration::from_secs(1);
    let mut locals = Vec::new();
    for name in ["a", "b"] {
        let (addr, turns, stop) = (one.addr.clone(), turns.clone(), stop.clone());
        locals.push(std::thread::spawn(move || {
            let body = format!(r#"{{"holder":"{name}","duration_ms":30000,"wait_ms":25000}}"#);
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let (s, l) = post(&addr, "/leases/acquire/hot", &body);
                assert_eq!(s, 200, "{l}");
                turns.lock().unwrap().push((name.to_string(), l["fence"].as_u64().unwrap(), Instant::now()));
                std::thread::sleep(hold);
                let release = format!(r#"{{"lease_id":"{}"}}"#, l["lease_id"].as_str().unwrap());
                let (s, r) = post(&addr, "/leases/release/hot", &release);
                assert_eq!(s, 200, "{r}");
            }
        }));
        // The first client holds before the second lines up behind it.
        std::thread::sleep(Duration::from_millis(300));
    }
    // Both local clients took turns: the hand-over is running.
    eventually(Duration::from_secs(20), "two local turns", || turns.lock().unwrap().len() >= 2);
    let started = Instant::now();
    let (s, l) = post(&two.addr, "/leases/acquire/hot", r#"{"holder":"r","duration_ms":30000,"wait_ms":25000}"#);
    let served = Instant::now();
    assert_eq!(s, 200, "the other process's waiter was never served: {l}");
    let fence = l["fence"].as_u64().unwrap();
    turns.lock().unwrap().push(("r".into(), fence, served));
    std::thread::sleep(hold);
    let (s, r) =
        post(&two.addr, "/leases/release/hot", &format!(r#"{{"lease_id":"{}"}}"#, l["lease_id"].as_str().unwrap()));
    assert_eq!(s, 200, "{r}");
    // Two more local turns after it, then stop.
    let n = turns.lock().unwrap().len();
    eventually(Duration::from_secs(20), "local turns after the other process's", || {
        turns.lock().unwrap().len() >= n + 2
    });
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for l in locals {
        l.join().unwrap();
    }
    let mut turns = turns.lock().unwrap().clone();
    turns.sort_by_key(|t| t.1);
    let order: Vec<&str> = turns.iter().map(|t| t.0.as_str()).collect();
    // Local turns granted after it started waiting and before its own.
    let before = turns.iter().filter(|t| t.0 != "r" && t.2 > started && t.1 < fence).count();
    assert!(before <= 3, "the other process's waiter waited {before} turns: {order:?} (waited {:?})", served - started);
    eprintln!("turns: {order:?}; the other process waited {before} turns ({:?})", served - started);
    let locals: Vec<&&str> = order.iter().filter(|w| **w != "r").collect();
    assert!(locals.windows(2).all(|w| w[0] != w[1]), "the local clients do not alternate: {order:?}");
}

/// Acquires whose clients close the connection right after sending them: whatever each was
/// granted is released (the acquire's future is dropped, or its answer cannot be written), so
/// no key stays held by a lease nobody has.
fn acquires_whose_client_disconnects_leave_no_lease(t: &Target) {
    let server = Server::start(&t.args, &t.env);
    let n = 30;
    // Every key is held first and its acquire waits: each client leaves in the middle of a
    // wait (at once, or after a moment), and the key is released only after it left, so the
    // grant a release would hand it finds nobody. (A client that leaves a request for a free
    // key may leave after its answer was written, which no server can tell from a delivered
    // one: such a lease is stranded as any lost answer's is, so this test makes none.)
    let mut blockers = Vec::new();
    for i in 0..n {
        let (s, l) =
            post(&server.addr, &format!("/leases/acquire/cut{i}"), r#"{"holder":"blocker","duration_ms":60000}"#);
        assert_eq!(s, 200, "{l}");
        blockers.push((i, l["lease_id"].as_str().unwrap().to_string()));
    }
    for i in 0..n {
        let body = r#"{"holder":"gone","duration_ms":60000,"wait_ms":20000}"#;
        let req = format!(
            "POST /leases/acquire/cut{i} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let mut s = TcpStream::connect(&server.addr).unwrap();
        s.write_all(req.as_bytes()).unwrap();
        // Gone at once for some, after a moment for others.
        if i % 3 == 1 {
            std::thread::sleep(Duration::from_micros(300 * i as u64));
        }
        let _ = s.shutdown(Shutdown::Both);
    }
    // The waiting clients have left; now their keys are released.
    std::thread::sleep(Duration::from_millis(500));
    for (i, id) in blockers {
        let (s, r) = post(&server.addr, &format!("/leases/release/cut{i}"), &format!(r#"{{"lease_id":"{id}"}}"#));
        assert_eq!(s, 200, "{r}");
    }
    for i in 0..n {
        eventually(Duration::from_secs(15), &format!("cut{i} free"), || {
            let (s, _, b) = http(&server.addr, "GET", &format!("/leases/cut{i}"), &[], b"");
            s == 404 || (s == 200 && json(&b)["held"] == false)
        });
    }
    // And a later acquire takes each at once.
    for i in 0..n {
        let (s, l) = post(&server.addr, &format!("/leases/acquire/cut{i}"), r#"{"holder":"next","duration_ms":30000}"#);
        assert_eq!(s, 200, "cut{i}: {l}");
    }
}
