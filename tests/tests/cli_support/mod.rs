//! Helpers for the end-to-end tests of the built `leasehold` binary: where it is, running it
//! against each store, a `leasehold serve` owned by a test, and a raw HTTP/1.1 client.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use leasehold_tests::{dynamo_local, repo_root, set_local_credentials, TempDir};
use serde_json::Value;

/// `<target>/debug/leasehold`, built by `cargo build -p leasehold-cli` (scripts/test.sh builds
/// the whole workspace first). Panics with a clear message when it is missing or older than
/// the sources of the cli crate.
pub fn bin() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| repo_root().join("target"));
    let bin = target.join("debug").join("leasehold");
    let built = std::fs::metadata(&bin).and_then(|m| m.modified()).unwrap_or_else(|_| {
        panic!("{} is missing: run `cargo build -p leasehold-cli` before these tests", bin.display())
    });
    let newest = newest_source(&repo_root().join("cli/src")).max(newest_source(&repo_root().join("shared/src")));
    assert!(
        built >= newest,
        "{} is older than the sources: run `cargo build -p leasehold-cli` before these tests",
        bin.display()
    );
    bin
}

fn newest_source(dir: &Path) -> SystemTime {
    let mut newest = SystemTime::UNIX_EPOCH;
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            let t = if p.is_dir() {
                newest_source(&p)
            } else {
                e.metadata().and_then(|m| m.modified()).unwrap_or(SystemTime::UNIX_EPOCH)
            };
            newest = newest.max(t);
        }
    }
    newest
}

/// What a finished command left.
#[derive(Debug)]
pub struct Out {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Out {
    pub fn json(&self) -> Value {
        serde_json::from_str(self.stdout.trim())
            .unwrap_or_else(|e| panic!("stdout is not one JSON document ({e}): {self:?}"))
    }

    #[track_caller]
    pub fn ok(self) -> Out {
        assert_eq!(self.code, 0, "command failed: {self:?}");
        self
    }

    #[track_caller]
    pub fn code(self, code: i32) -> Out {
        assert_eq!(self.code, code, "unexpected exit code: {self:?}");
        self
    }
}

/// A child process killed when the test ends (even by a panic). Its stdout and stderr are
/// drained by threads, so that a process the command left behind holding the pipes cannot
/// make [`Proc::wait`] hang.
pub struct Proc(pub Option<Child>, Option<Drains>);

struct Drains {
    out: std::thread::JoinHandle<String>,
    err: std::thread::JoinHandle<String>,
}

fn drain(r: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut r) = r {
            let _ = r.read_to_end(&mut buf);
        }
        String::from_utf8_lossy(&buf).into_owned()
    })
}

/// What a drain thread read, once the pipe closed; empty if something still holds it open
/// after `limit` (a process left behind: the test says so itself).
fn join_within(h: std::thread::JoinHandle<String>, limit: Duration) -> String {
    let deadline = Instant::now() + limit;
    while !h.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    if h.is_finished() {
        h.join().unwrap_or_default()
    } else {
        "<pipe still held open by a process left behind>".into()
    }
}

impl Proc {
    pub fn new(mut child: Child) -> Proc {
        let drains = Drains { out: drain(child.stdout.take()), err: drain(child.stderr.take()) };
        Proc(Some(child), Some(drains))
    }

    pub fn pid(&self) -> u32 {
        self.0.as_ref().expect("running").id()
    }

    pub fn signal(&self, sig: &str) {
        let st = Command::new("kill").arg(format!("-{sig}")).arg(self.pid().to_string()).status().expect("kill");
        assert!(st.success(), "kill -{sig} failed");
    }

    /// Waits for the exit (at most `limit`, a guard against hangs, not a speed assertion).
    pub fn wait(&mut self, limit: Duration) -> Out {
        let mut child = self.0.take().expect("running");
        let deadline = Instant::now() + limit;
        loop {
            if let Some(st) = child.try_wait().expect("try_wait") {
                let (out, err) = match self.1.take() {
                    Some(d) => {
                        (join_within(d.out, Duration::from_secs(10)), join_within(d.err, Duration::from_secs(10)))
                    }
                    None => (String::new(), String::new()),
                };
                use std::os::unix::process::ExitStatusExt;
                let code = st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0));
                return Out { code, stdout: out, stderr: err };
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("process did not exit within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A store the binary is pointed at: the embedded store in a temporary directory, a DynamoDB
/// Local table, or a `leasehold serve` (over the embedded store) reached with `--url`.
pub struct Target {
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub server: Option<Server>,
    pub dir: TempDir,
}

impl Target {
    pub fn embedded() -> Target {
        let dir = TempDir::new("cli");
        let db = dir.path().join("leases.db").display().to_string();
        Target { args: vec!["--db".into(), db], env: vec![], server: None, dir }
    }

    /// A fresh table on the shared DynamoDB Local.
    pub fn dynamo() -> Target {
        let local = dynamo_local();
        set_local_credentials();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let store = rt.block_on(local.store());
        Target {
            args: vec!["--table".into(), store.table().to_string()],
            env: dynamo_env(&local.endpoint),
            server: None,
            dir: TempDir::new("cli-ddb"),
        }
    }

    /// A `leasehold serve` on the embedded store, and `--url` to it.
    pub fn served() -> Target {
        let store = Target::embedded();
        let server = Server::start(&store.args, &[]);
        Target { args: vec!["--url".into(), server.url.clone()], env: vec![], server: Some(server), dir: store.dir }
    }

    pub fn is_http(&self) -> bool {
        self.server.is_some()
    }

    /// The command with the store flags first (they are global, so they also work after it).
    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = clean_command();
        c.args(&self.args).args(args);
        for (k, v) in &self.env {
            c.env(k, v);
        }
        c
    }

    pub fn run(&self, args: &[&str]) -> Out {
        output(self.cmd(args))
    }

    pub fn spawn(&self, args: &[&str]) -> Proc {
        spawn(self.cmd(args))
    }
}

pub fn dynamo_env(endpoint: &str) -> Vec<(String, String)> {
    vec![
        ("AWS_ENDPOINT_URL_DYNAMODB".into(), endpoint.to_string()),
        ("AWS_ACCESS_KEY_ID".into(), "test".into()),
        ("AWS_SECRET_ACCESS_KEY".into(), "test".into()),
        ("AWS_REGION".into(), "us-east-1".into()),
        ("AWS_EC2_METADATA_DISABLED".into(), "true".into()),
    ]
}

/// The binary with no leasehold settings inherited from the environment.
pub fn clean_command() -> Command {
    clean(Command::new(bin()))
}

/// The binary, as [`clean_command`], with its wall clock shifted by `offset_s` seconds (Debian's
/// libfaketime, installed by scripts/install-test-deps.sh, preloaded into the binary itself, so
/// that the process a test stops is the server; the monotonic clock is left alone): a
/// coordinator on a machine whose clock is wrong.
pub fn command_with_clock(offset_s: f64) -> Command {
    let lib = std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .map(|d| d.path().join("faketime/libfaketimeMT.so.1"))
        .find(|p| p.exists())
        .expect("libfaketime is not installed: run scripts/install-test-deps.sh");
    let mut c = Command::new(bin());
    c.env("LD_PRELOAD", lib).env("FAKETIME", format!("{offset_s:+}")).env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
    clean(c)
}

fn clean(mut c: Command) -> Command {
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("LEASEHOLD_") || k == "RUST_LOG" {
            c.env_remove(k);
        }
    }
    c.env("LEASEHOLD_HOLDER", "tester");
    // The table check's answers are kept per test process, not in the user's cache.
    c.env("LEASEHOLD_CACHE_DIR", std::env::temp_dir().join(format!("leasehold-cli-cache-{}", std::process::id())));
    c.stdin(Stdio::null());
    c
}

pub fn output(mut c: Command) -> Out {
    let o = c.output().expect("run leasehold");
    use std::os::unix::process::ExitStatusExt;
    Out {
        code: o.status.code().unwrap_or_else(|| 128 + o.status.signal().unwrap_or(0)),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

pub fn spawn(mut c: Command) -> Proc {
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    Proc::new(c.spawn().expect("spawn leasehold"))
}

/// A `leasehold serve` owned by a test, on a free port it reports itself.
pub struct Server {
    pub proc: Proc,
    pub url: String,
    pub addr: String,
    /// The two lines it printed on start.
    pub banner: Vec<String>,
}

impl Server {
    pub fn start(store_args: &[String], env: &[(String, String)]) -> Server {
        Server::start_command(clean_command(), store_args, env)
    }

    /// [`Server::start`] of the binary as `c` runs it (e.g. [`command_with_clock`]).
    pub fn start_command(mut c: Command, store_args: &[String], env: &[(String, String)]) -> Server {
        c.args(store_args).args(["serve", "--addr", "127.0.0.1:0"]);
        for (k, v) in env {
            c.env(k, v);
        }
        c.stdout(Stdio::piped()).stderr(Stdio::inherit());
        let mut child = c.spawn().expect("spawn leasehold serve");
        let mut reader = BufReader::new(child.stdout.take().expect("stdout"));
        let mut banner = Vec::new();
        for _ in 0..2 {
            let mut line = String::new();
            reader.read_line(&mut line).expect("read banner");
            banner.push(line.trim_end().to_string());
        }
        let url = banner[0]
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("no URL in {:?}", banner[0]))
            .to_string();
        let addr = url.trim_start_matches("http://").to_string();
        // Keep draining stdout so the server never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut sink = String::new();
            let _ = reader.read_to_string(&mut sink);
        });
        Server { proc: Proc(Some(child), None), url, addr, banner }
    }
}

/// A raw HTTP/1.1 exchange on a fresh connection (`Connection: close`): status, headers
/// (lower-cased names), body.
pub fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, Vec<(String, String)>, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    let mut req = format!("{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n");
    let mut has_len = false;
    for (k, v) in headers {
        has_len |= k.eq_ignore_ascii_case("content-length") || k.eq_ignore_ascii_case("transfer-encoding");
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if !has_len {
        req.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).expect("write head");
    // The server may answer (and close) before reading a body it refuses.
    let _ = s.write_all(body);
    read_response(&mut s)
}

pub fn read_response(s: &mut TcpStream) -> (u16, Vec<(String, String)>, String) {
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no complete response: {text:?}"));
    let mut lines = head.lines();
    let status: u16 = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad status line in {head:?}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let chunked = headers.iter().any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked { dechunk(body) } else { body.to_string() };
    (status, headers, body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// Polls `f` until it returns true (at most `limit`, a guard against hangs).
pub fn eventually(limit: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// True while process `pid` exists and is not a zombie (a killed process whose parent has not
/// reaped it yet is gone for every purpose of these tests).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|s| s != "Z" && s != "X"),
        Err(_) => false,
    }
}

/// Every live process below `root` (children, grandchildren, ...), from /proc.
pub fn descendants(root: u32) -> Vec<u32> {
    let mut parent_of = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for e in entries.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
            let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
            if let Some(ppid) = ppid {
                parent_of.push((pid, ppid));
            }
        }
    }
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let p = found[i];
        found.extend(parent_of.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    found.remove(0);
    found.retain(|p| alive(*p));
    found
}

/// The pids listed (whitespace-separated) in a file the command wrote.
pub fn pids_in(p: &Path) -> Vec<u32> {
    std::fs::read_to_string(p).unwrap_or_default().split_whitespace().filter_map(|w| w.parse().ok()).collect()
}
