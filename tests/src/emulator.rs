//! The real Lambda runtime emulator (`cargo lambda watch`, installed into .tools/venv by
//! scripts/install-test-deps.sh) running this workspace's functions, and moto's Step
//! Functions server whose Lambda tasks reach the emulator.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::Value;

use crate::{free_port, http, repo_root, tools_dir, wait_for_port, Guarded};

/// The answer of one invocation through the emulator's Invoke API.
#[derive(Debug, Clone)]
pub struct Invocation {
    /// The function's result, or for a function error the `{errorType, errorMessage}` object.
    pub body: Value,
    /// `Some(errorType)` when the function returned an error.
    pub error_type: Option<String>,
}

impl Invocation {
    /// The JSON error body carried in `errorMessage` of a function error.
    pub fn error_body(&self) -> Value {
        let msg = self.body.get("errorMessage").and_then(Value::as_str).unwrap_or("null");
        serde_json::from_str(msg).unwrap_or(Value::Null)
    }
}

/// `cargo lambda watch` on a free port, serving the functions of this workspace.
pub struct Emulator {
    pub port: u16,
    pub server: Guarded,
}

impl Emulator {
    /// Starts the emulator with extra environment for the functions (LEASEHOLD_TABLE,
    /// AWS_ENDPOINT_URL_DYNAMODB, ...). Functions are compiled on first invoke (debug).
    pub fn start(env: &[(String, String)]) -> Emulator {
        Self::start_on(free_port(), env)
    }

    pub fn start_on(port: u16, env: &[(String, String)]) -> Emulator {
        Self::start_with(port, env, &[])
    }

    /// Like [`Emulator::start_on`] with extra `cargo lambda watch` flags (e.g.
    /// `--concurrency 2` for more than one instance per function).
    pub fn start_with(port: u16, env: &[(String, String)], extra_args: &[&str]) -> Emulator {
        let venv_bin = tools_dir().join("venv/bin");
        assert!(
            venv_bin.join("cargo-lambda").exists(),
            "cargo-lambda is not installed in {}: run scripts/install-test-deps.sh",
            venv_bin.display()
        );
        let mut env = env.to_vec();
        let path = format!("{}:{}", venv_bin.display(), std::env::var("PATH").unwrap_or_default());
        env.push(("PATH".into(), path));
        env.push(("RUST_LOG".into(), std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into())));
        // Not `--only-lambda-apis`: with it the emulator never starts the functions and every
        // invoke waits forever for a runtime to poll.
        let cmd = format!("exec cargo lambda watch -A 127.0.0.1 -P {port} --ignore-changes {}", extra_args.join(" "));
        let server = Guarded::spawn("lambda-emulator", &cmd, &repo_root(), &env);
        wait_for_port(port, Duration::from_secs(120), "cargo lambda watch");
        Emulator { port, server }
    }

    pub fn invoke_url(&self, function: &str) -> String {
        format!("http://127.0.0.1:{}/2015-03-31/functions/{function}/invocations", self.port)
    }

    /// Invokes `function` with a raw payload (bytes, so malformed JSON can be sent too).
    pub async fn invoke_raw(&self, function: &str, payload: &[u8]) -> Invocation {
        let resp = http::request("POST", &self.invoke_url(function), Some(payload))
            .await
            .unwrap_or_else(|e| panic!("invoke {function}: {e}\nemulator log:\n{}", self.server.log_text()));
        let body: Value = serde_json::from_slice(&resp.body).unwrap_or_else(|_| Value::String(resp.text()));
        let error_type = if resp.status >= 400 || resp.header("x-amz-function-error").is_some() {
            Some(body.get("errorType").and_then(Value::as_str).unwrap_or("<none>").to_string())
        } else {
            None
        };
        Invocation { body, error_type }
    }

    pub async fn invoke(&self, function: &str, payload: &Value) -> Invocation {
        self.invoke_raw(function, payload.to_string().as_bytes()).await
    }
}

/// moto's server with its Step Functions interpreter switched on. `lambda_port`: where the
/// state machines' Lambda tasks go (moto sends them to `localhost:$MOTO_PORT`).
pub struct Moto {
    pub port: u16,
    pub server: Guarded,
}

impl Moto {
    pub fn start(port: u16, lambda_port: u16) -> Moto {
        let bin = tools_dir().join("venv/bin/moto_server");
        assert!(bin.exists(), "moto is not installed at {}: run scripts/install-test-deps.sh", bin.display());
        let cmd = format!("exec '{}' -H 127.0.0.1 -p {port}", bin.display());
        let env = vec![("MOTO_PORT".to_string(), lambda_port.to_string())];
        let server = Guarded::spawn("moto", &cmd, &repo_root(), &env);
        wait_for_port(port, Duration::from_secs(60), "moto_server");
        Moto { port, server }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Turns on execution of state machine definitions.
    pub async fn enable_execution(&self) {
        let body = serde_json::json!({"stepfunctions": {"execute_state_machine": true}});
        let r = http::post_json(&format!("{}/moto-api/config", self.endpoint()), &body).await.expect("moto config");
        assert!(r.status < 300, "moto config: {} {}", r.status, r.text());
    }
}

/// Regions for Step Functions executions on moto: moto 5.2 cannot start a second execution in
/// a region that already ran one (it deep-copies the backend, locks included), so every
/// execution of a test process gets a region of its own.
pub const MOTO_REGIONS: [&str; 34] = [
    "us-east-1",
    "eu-west-1",
    "eu-west-2",
    "eu-west-3",
    "eu-central-1",
    "eu-north-1",
    "ap-south-1",
    "ap-southeast-1",
    "ap-southeast-2",
    "ap-northeast-1",
    "ap-northeast-2",
    "ap-northeast-3",
    "ca-central-1",
    "sa-east-1",
    "us-east-2",
    "us-west-1",
    "us-west-2",
    "af-south-1",
    "ap-east-1",
    "eu-south-1",
    "me-south-1",
    "ap-southeast-3",
    "ap-east-2",
    "ap-south-2",
    "ap-southeast-4",
    "ap-southeast-5",
    "ap-southeast-6",
    "ap-southeast-7",
    "ca-west-1",
    "eu-central-2",
    "eu-south-2",
    "il-central-1",
    "me-central-1",
    "mx-central-1",
];

/// The next unused region of [`MOTO_REGIONS`] in this process, never `skip` (the functions'
/// own region, kept for executions they must find).
pub fn next_execution_region(skip: &str) -> &'static str {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    loop {
        let i = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let r = MOTO_REGIONS.get(i).copied().expect("more executions than regions: add regions to MOTO_REGIONS");
        if r != skip {
            return r;
        }
    }
}

/// Serves HTTP/1 on 127.0.0.1:`port` from a thread of its own, for the life of the process:
/// `answer` answers every request. Returns once the port listens. (The tests' stand-ins for
/// AWS endpoints in front of moto and the emulator.)
pub fn serve_forever<F, Fut>(port: u16, answer: F)
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port))).await.expect("bind");
            ready_tx.send(()).unwrap();
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let answer = answer.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let answer = answer.clone();
                        async move { Ok::<_, std::convert::Infallible>(answer(req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
    });
    ready_rx.recv().expect("server started");
}

/// A request id for a Lambda or AWS answer made up by a test's stand-in, unique in the process.
pub fn request_id() -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!("leasehold-test-{}-{}", std::process::id(), N.fetch_add(1, Ordering::SeqCst))
}

/// A Lambda Invoke (`method`, `path`, `body`) forwarded to the emulator on `emulator_port`,
/// answered as Lambda answers it: the emulator's HTTP 500 function errors become 200,
/// `X-Amz-Function-Error: Unhandled` and the `{errorType, errorMessage}` body.
pub async fn forward_invoke(emulator_port: u16, method: &str, path: &str, body: &[u8]) -> Response<Full<Bytes>> {
    let builder = Response::builder().header("x-amzn-requestid", request_id());
    let url = format!("http://127.0.0.1:{emulator_port}{path}");
    let resp = match http::request(method, &url, Some(body)).await {
        Ok(r) => {
            let function_error =
                r.status >= 400 && serde_json::from_slice::<Value>(&r.body).is_ok_and(|v| v.get("errorType").is_some());
            let builder = if function_error {
                builder.status(200).header("x-amz-function-error", "Unhandled")
            } else {
                builder.status(r.status)
            };
            builder.header("content-type", "application/json").body(Full::new(Bytes::from(r.body)))
        }
        Err(e) => builder.status(502).body(Full::new(Bytes::from(format!("emulator: {e}")))),
    };
    resp.expect("response")
}
