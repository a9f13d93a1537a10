//! A Lambda function's cold start: the built `acquire` function asks the runtime for its first
//! event before it reads the platform's trust store, and reads it when its first request to
//! the store connects (BENCHMARKS.md, "Cold start": reading it was most of the time before
//! ready).
//!
//! The trust store is a FIFO named by `SSL_CERT_FILE`: opening it for writing without blocking
//! succeeds only while a reader has it open, which tells whether (and when) the function
//! opened it; a reader blocks in `open` until a writer comes, so a function that read the
//! trust store while starting would never ask for its first event.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use leasehold_tests::{free_port, repo_root, TempDir};

/// Linux's `O_NONBLOCK`.
const O_NONBLOCK: i32 = 0o4000;

/// `<target>/debug/acquire`, built by `cargo build -p acquire` (scripts/test.sh builds the
/// whole workspace first).
fn function_bin() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| repo_root().join("target"));
    let bin = target.join("debug").join("acquire");
    assert!(bin.exists(), "{} is missing: run `cargo build -p acquire` before this test", bin.display());
    bin
}

/// Whether some process has the FIFO open for reading (a writer's non-blocking open fails
/// with ENXIO otherwise).
fn fifo_has_reader(fifo: &Path) -> bool {
    match std::fs::OpenOptions::new().write(true).custom_flags(O_NONBLOCK).open(fifo) {
        Ok(_) => true,
        Err(e) if e.raw_os_error() == Some(6) => false, // ENXIO
        Err(e) => panic!("opening {} for writing: {e}", fifo.display()),
    }
}

/// The function's process, killed when the test ends (a failed one included).
struct Function(Child);

impl Drop for Function {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn accept_within(listener: &TcpListener, limit: Duration, what: &str, child: &mut Child) -> TcpStream {
    let start = Instant::now();
    loop {
        match listener.accept() {
            Ok((s, _)) => return s,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if let Some(status) = child.try_wait().unwrap() {
                    panic!("the function exited ({status}) before {what}");
                }
                assert!(start.elapsed() < limit, "no {what} within {limit:?}");
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("accept: {e}"),
        }
    }
}

/// Reads one HTTP request head and returns its request line.
fn request_line(s: &mut TcpStream) -> String {
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(s.read(&mut byte).unwrap(), 1, "the request head ended early");
        head.push(byte[0]);
    }
    String::from_utf8_lossy(&head).lines().next().unwrap_or_default().to_string()
}

#[test]
fn a_function_asks_for_its_first_event_before_it_reads_the_trust_store() {
    let dir = TempDir::new("cold-start");
    let fifo = dir.path().join("roots.pem");
    let certs = dir.path().join("certs");
    std::fs::create_dir(&certs).unwrap();
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo runs");
    assert!(made.success(), "mkfifo {}", fifo.display());
    let runtime = TcpListener::bind("127.0.0.1:0").unwrap();
    runtime.set_nonblocking(true).unwrap();
    let api = runtime.local_addr().unwrap().to_string();
    // Nothing listens on the store's port: the first request is refused once it connects.
    let store = format!("http://127.0.0.1:{}", free_port());
    let mut function = Function(
        Command::new(function_bin())
            .env_clear()
            .envs([
                ("PATH", "/usr/bin:/bin"),
                ("AWS_LAMBDA_RUNTIME_API", api.as_str()),
                ("AWS_LAMBDA_FUNCTION_NAME", "acquire"),
                ("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "128"),
                ("AWS_LAMBDA_FUNCTION_VERSION", "$LATEST"),
                ("AWS_ACCESS_KEY_ID", "test"),
                ("AWS_SECRET_ACCESS_KEY", "test"),
                ("AWS_REGION", "us-east-1"),
                ("AWS_EC2_METADATA_DISABLED", "true"),
                ("AWS_ENDPOINT_URL_DYNAMODB", store.as_str()),
                ("AWS_ENDPOINT_URL_SFN", store.as_str()),
                ("LEASEHOLD_TABLE", "cold-start"),
                ("SSL_CERT_FILE", fifo.to_str().unwrap()),
                ("SSL_CERT_DIR", certs.to_str().unwrap()),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the acquire function starts"),
    );
    let child = &mut function.0;

    let mut next = accept_within(&runtime, Duration::from_secs(60), "request for the first event", child);
    assert_eq!(request_line(&mut next), "GET /2018-06-01/runtime/invocation/next HTTP/1.1");
    assert!(!fifo_has_reader(&fifo), "the function opened the trust store before asking for its first event");

    // The first event: its acquire connects to the store, and the connection reads the roots.
    let body = br#"{"key":"cold/1","holder":"test","duration_ms":30000}"#;
    let deadline_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() + 30_000;
    let head = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nLambda-Runtime-Aws-Request-Id: cold-1\r\n\
         Lambda-Runtime-Deadline-Ms: {deadline_ms}\r\n\
         Lambda-Runtime-Invoked-Function-Arn: arn:aws:lambda:us-east-1:123456789012:function:acquire\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    next.write_all(head.as_bytes()).unwrap();
    next.write_all(body).unwrap();
    let start = Instant::now();
    while !fifo_has_reader(&fifo) {
        assert!(child.try_wait().unwrap().is_none(), "the function exited before reading the trust store");
        assert!(start.elapsed() < Duration::from_secs(60), "the first request did not read the trust store");
        std::thread::sleep(Duration::from_millis(20));
    }
}
