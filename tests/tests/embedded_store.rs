//! The embedded store's file, from the outside: many processes opening one new file at once
//! (cron jobs or timers firing the same minute on a new machine), and a server killed with
//! SIGKILL while many writes are in flight losing none it answered.

mod cli_support;

use std::process::Stdio;
use std::time::Duration;

use cli_support::{clean_command, Proc};
use leasehold_tests::TempDir;

const LIMIT: Duration = Duration::from_secs(120);

/// `n` `leasehold acquire` processes, each on its own key, started together on one fresh
/// `LEASEHOLD_DB` file, `rounds` times: every one must succeed (the schema is created and
/// migrated in one write transaction, the switch to WAL is retried while another process
/// holds the file) and every key must then be held.
fn processes_open_a_new_file_at_once(n: usize, rounds: usize) {
    let mut failures = Vec::new();
    for round in 0..rounds {
        let dir = TempDir::new("open-race");
        let db = dir.path().join("leases.db");
        let procs: Vec<Proc> = (0..n)
            .map(|i| {
                let mut c = clean_command();
                c.env("LEASEHOLD_DB", &db).args(["acquire", &format!("k{i}"), "--duration", "10m"]);
                c.stdout(Stdio::piped()).stderr(Stdio::piped());
                Proc::new(c.spawn().expect("spawn leasehold"))
            })
            .collect();
        for (i, mut p) in procs.into_iter().enumerate() {
            let out = p.wait(LIMIT);
            if out.code != 0 {
                failures.push(format!("round {round}, process {i}: exit {}: {}", out.code, out.stderr.trim()));
            }
        }
        if failures.is_empty() {
            let mut c = clean_command();
            c.env("LEASEHOLD_DB", &db).args(["list", "--json"]);
            let out = cli_support::output(c).ok();
            for i in 0..n {
                assert!(out.stdout.contains(&format!("\"k{i}\"")), "round {round}: k{i} is not held: {out:?}");
            }
        }
    }
    assert!(failures.is_empty(), "{} of {} processes failed:\n{}", failures.len(), n * rounds, failures.join("\n"));
}

#[test]
fn six_processes_open_a_new_file_at_once() {
    processes_open_a_new_file_at_once(6, 50);
}

#[test]
fn sixteen_processes_open_a_new_file_at_once() {
    processes_open_a_new_file_at_once(16, 50);
}

/// One acquire over a fresh connection: `Some(fence)` when granted, `None` when the server
/// did not answer a whole response (it was killed).
fn acquire_over_http(addr: &str, key: &str) -> Option<u64> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    let body = r#"{"holder":"crash","duration_ms":600000}"#;
    let req = format!(
        "POST /leases/acquire/{key} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n")?;
    assert!(head.starts_with("HTTP/1.1 200"), "{key}: {text}");
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    v["fence"].as_u64()
}

/// A `leasehold serve` on the embedded store, killed with SIGKILL while many acquires are in
/// flight (every commit holds a group of them), loses no grant it answered: each answered
/// key+fence is in the file when it is opened again. (An answer sent before its group's
/// commit returned would be lost with the process.)
#[test]
fn a_killed_server_loses_no_answered_write() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    for round in 0..3 {
        let dir = TempDir::new("crash");
        let db = dir.path().join("leases.db");
        let mut server = cli_support::Server::start(&["--db".into(), db.display().to_string()], &[]);
        let answered = Arc::new(Mutex::new(Vec::<(String, u64)>::new()));
        let dead = Arc::new(AtomicBool::new(false));
        let clients: Vec<_> = (0..24)
            .map(|t| {
                let (addr, answered, dead) = (server.addr.clone(), answered.clone(), dead.clone());
                std::thread::spawn(move || {
                    for i in 0.. {
                        let key = format!("crash-{t}-{i}");
                        match acquire_over_http(&addr, &key) {
                            Some(fence) => answered.lock().unwrap().push((key, fence)),
                            None if dead.load(Ordering::SeqCst) => return,
                            None => panic!("{key}: no answer from a live server"),
                        }
                    }
                })
            })
            .collect();
        // Kill it once a few hundred grants were answered: writes are in flight all along.
        let deadline = std::time::Instant::now() + LIMIT;
        while answered.lock().unwrap().len() < 300 + 100 * round {
            assert!(std::time::Instant::now() < deadline, "the server answered too few acquires");
            std::thread::sleep(Duration::from_millis(5));
        }
        dead.store(true, Ordering::SeqCst);
        server.proc.signal("KILL");
        let _ = server.proc.wait(LIMIT);
        for c in clients {
            c.join().expect("client thread");
        }
        let answered = answered.lock().unwrap().clone();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let store = leasehold::store::SqliteStore::open(&db).expect("reopen");
        let mut lost = Vec::new();
        for (key, fence) in &answered {
            let rec = rt.block_on(leasehold::store::Store::get(&store, key)).expect("read");
            if rec.as_ref().map(|r| r.fence) != Some(*fence) {
                lost.push(format!("{key} fence {fence}: {:?}", rec.map(|r| r.fence)));
            }
        }
        assert!(lost.is_empty(), "round {round}: {} of {} answered grants lost: {lost:?}", lost.len(), answered.len());
    }
}
