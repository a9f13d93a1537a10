#!/usr/bin/env python3
"""Cold-start benchmark of the three Lambda functions (a benchmark, not a test: it prints
figures against targets and asserts nothing).

For each function and each run: spawns the release binary against a tiny Lambda Runtime API
served here, and measures
  - ready:      process spawn -> its first GET /2018-06-01/runtime/invocation/next
  - first:      first event handed over -> its response (cold: clients, connections)
  - warm:       a second event -> its response
  - peak RSS:   VmHWM from /proc/PID/status after both events
  - binary size of BIN_DIR/NAME
Events go to a real DynamoDB Local table (.tools/dynamodb-local, see
scripts/install-test-deps.sh): acquire takes a lease, heartbeat runs the scheduled keep-alive
sweep (events/scheduled.json), release releases a lease that is not there (a conditional
write that is rejected). Without DynamoDB Local (or with BENCH_STORE=embedded) the embedded
store is used instead.

Targets: ready <= 50 ms, peak RSS <= 30 MB, binary <= 10 MB.

Usage: bench_cold_start.py ROOT RUNS BIN_DIR [BIN_DIR ...]. scripts/bench-cold-start.sh builds
the release binaries and runs it. With more than one BIN_DIR (builds to compare), every run of
a function starts each build in turn, the order alternating from run to run, so a neighbour's
load falls on all of them alike; the table has a row per build and function.
"""
import json, os, queue, re, signal, socket, statistics, subprocess, sys, tempfile, threading, time, uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

root, runs, bin_dirs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
bin_dir = bin_dirs[0]
FUNCTIONS = ["acquire", "heartbeat", "release"]
TARGET_READY_MS, TARGET_RSS_MB, TARGET_BIN_MB = 50.0, 30.0, 10.0


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


# --- the store -----------------------------------------------------------------------------
ddb = None
store_env = {}
jar_dir = os.path.join(root, ".tools", "dynamodb-local")
table = "bench-cold-start"
try:
    import boto3  # installed in .tools/venv along with moto
    have_boto = True
except ImportError:
    have_boto = False
if have_boto and os.path.exists(os.path.join(jar_dir, "DynamoDBLocal.jar")) and os.environ.get("BENCH_STORE") != "embedded":
    port = free_port()
    work = tempfile.mkdtemp(prefix="leasehold-bench-ddb-")
    ddb = subprocess.Popen(
        ["java", f"-Djava.library.path={jar_dir}/DynamoDBLocal_lib", "-jar", f"{jar_dir}/DynamoDBLocal.jar",
         "-inMemory", "-port", str(port), "-disableTelemetry"],
        cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("dynamodb", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="bench", aws_secret_access_key="bench")
    deadline = time.time() + 60
    while True:
        try:
            client.list_tables()
            break
        except Exception:
            if time.time() > deadline:
                sys.exit("DynamoDB Local did not start")
            time.sleep(0.2)
    # The lease table as the functions expect it, made as template.yaml makes it.
    env = dict(os.environ, AWS_ENDPOINT_URL_DYNAMODB=endpoint, AWS_REGION="us-east-1",
               AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench")
    subprocess.run([os.path.join(bin_dir, "leasehold"), "--table", table, "table", "create"],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    store_env = {"LEASEHOLD_TABLE": table, "AWS_ENDPOINT_URL_DYNAMODB": endpoint}
    store_desc = f"DynamoDB Local table {table}"
else:
    dbdir = tempfile.mkdtemp(prefix="leasehold-bench-db-")
    store_env = {"LEASEHOLD_DB": os.path.join(dbdir, "leases.db")}
    store_desc = "embedded store (DynamoDB Local or boto3 not available)"


# --- a tiny Lambda Runtime API ---------------------------------------------------------------
class Instance:
    """One function process: the events it will be handed and what it answered."""

    def __init__(self):
        self.events = queue.Queue()
        self.first_next = threading.Event()
        self.t_first_next = None
        self.answered = threading.Event()
        self.t_sent = None
        self.t_answer = None
        self.answer = None
        self.closed = False


current = None


class RuntimeApi(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: without TCP_NODELAY, Nagle plus the
    # client's delayed ACK would add ~40 ms to every event handed over.
    disable_nagle_algorithm = True

    def log_message(self, *a):
        pass

    def setup(self):
        # A connection belongs to the process that opened it: a request a killed process
        # left in its socket must not take the next process's event.
        super().setup()
        self.inst = current

    def do_GET(self):
        inst = self.inst
        if self.path != "/2018-06-01/runtime/invocation/next" or inst is None:
            self.send_error(404)
            return
        if not inst.first_next.is_set():
            inst.t_first_next = time.perf_counter()
            inst.first_next.set()
        while True:
            try:
                payload = inst.events.get(timeout=0.2)
                break
            except queue.Empty:
                if inst.closed:
                    self.close_connection = True
                    return
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Lambda-Runtime-Aws-Request-Id", str(uuid.uuid4()))
        self.send_header("Lambda-Runtime-Deadline-Ms", str(int(time.time() * 1000) + 30000))
        self.send_header("Lambda-Runtime-Invoked-Function-Arn", "arn:aws:lambda:us-east-1:123456789012:function:bench")
        self.send_header("Lambda-Runtime-Trace-Id", "Root=1-00000000-000000000000000000000000;Sampled=0")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        inst.t_sent = time.perf_counter()
        self.wfile.write(body)

    def do_POST(self):
        inst = self.inst
        n = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(n) if n else b""
        if inst is not None and ("/response" in self.path or "/error" in self.path):
            inst.t_answer = time.perf_counter()
            inst.answer = (self.path.rsplit("/", 1)[-1], data)
            inst.answered.set()
        self.send_response(202)
        self.send_header("Content-Length", "0")
        self.end_headers()


class Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # a killed function resets its connection: expected


server = Server(("127.0.0.1", 0), RuntimeApi)
server.daemon_threads = True
threading.Thread(target=server.serve_forever, daemon=True).start()
api = f"127.0.0.1:{server.server_address[1]}"

with open(os.path.join(root, "events", "scheduled.json")) as f:
    scheduled = json.load(f)


def event_for(fn, i):
    if fn == "acquire":
        return {"key": f"bench/{i}", "holder": "bench", "duration_ms": 30000}
    if fn == "heartbeat":
        return scheduled
    return {"key": f"bench/none/{i}", "lease_id": uuid.uuid4().hex}


def proc_status(pid):
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS"):
                out[k] = int(v.split()[0]) / 1024.0  # kB -> MB
    return out


def one_run(bin_dir, fn, i):
    global current
    inst = Instance()
    current = inst
    env = {
        "PATH": "/usr/bin:/bin",
        "AWS_LAMBDA_RUNTIME_API": api,
        "AWS_LAMBDA_FUNCTION_NAME": fn,
        "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": "128",
        "AWS_LAMBDA_FUNCTION_VERSION": "$LATEST",
        "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_ENDPOINT_URL_SFN": f"http://127.0.0.1:{free_port()}",
        **store_env,
    }
    binary = os.path.join(bin_dir, fn)
    t0 = time.perf_counter()
    log = tempfile.TemporaryFile()
    p = subprocess.Popen([binary], env=env, stdout=log, stderr=log)
    try:
        if not inst.first_next.wait(10):
            raise RuntimeError(f"{fn} never polled for an event")
        ready = (inst.t_first_next - t0) * 1000
        lat = []
        for k in range(2):
            inst.answered.clear()
            inst.events.put(event_for(fn, f"{i}-{k}"))
            if not inst.answered.wait(10):
                log.seek(0)
                tail = log.read()[-3000:].decode(errors="replace")
                raise RuntimeError(f"{fn} did not answer event {k} of run {i} (alive: {p.poll() is None}):\n{tail}")
            lat.append((inst.t_answer - inst.t_sent) * 1000)
            kind, body = inst.answer
            if k == 0 and i == 0:
                sample = re.sub(r'"lease_id":"[^"]*"', '"lease_id":"<redacted>"', body.decode(errors="replace"))
                print(f"   {fn}: first answer ({kind}): {sample[:160]}", file=sys.stderr)
        st = proc_status(p.pid)
        return ready, lat[0], lat[1], st["VmHWM"], st["VmRSS"]
    finally:
        inst.closed = True
        p.kill()
        p.wait()
        current = None


def p90(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))]


print(f"== {runs} cold starts per function; store: {store_desc}", file=sys.stderr)
rows = []
try:
    for fn in FUNCTIONS:
        results = {d: [] for d in bin_dirs}
        for i in range(runs):
            order = bin_dirs if i % 2 == 0 else bin_dirs[::-1]
            for d in order:
                results[d].append(one_run(d, fn, i))
        for d in bin_dirs:
            ready = [r[0] for r in results[d]]
            first = [r[1] for r in results[d]]
            warm = [r[2] for r in results[d]]
            hwm = [r[3] for r in results[d]]
            both = [r[0] + r[1] for r in results[d]]
            size = os.path.getsize(os.path.join(d, fn)) / (1024 * 1024)
            rows.append((d, fn, size, statistics.median(ready), p90(ready), max(ready),
                         statistics.median(first), statistics.median(both), statistics.median(warm), max(hwm)))
finally:
    server.shutdown()
    if ddb is not None:
        os.killpg(ddb.pid, signal.SIGTERM)
        ddb.wait()

ok = lambda good: "ok" if good else "OVER"
print()
for d in bin_dirs:
    print(f"cold start, release build in {d}, {runs} runs per function ({store_desc})")
print(f"{'build':<6} {'function':<10} {'binary MB':>9} {'ready p50':>9} {'ready p90':>9} {'ready max':>9} "
      f"{'1st event':>9} {'ready+1st':>9} {'warm':>6} {'peak RSS MB':>11}   (times in ms, p50 unless named)")
for d, fn, size, r50, r90, rmax, f50, b50, w50, hwm in rows:
    print(f"{bin_dirs.index(d) + 1:<6} {fn:<10} {size:>9.2f} {r50:>9.2f} {r90:>9.2f} {rmax:>9.1f} {f50:>9.2f} {b50:>9.2f} {w50:>6.2f} {hwm:>11.1f}")
print(f"{'target':<17} {'<= 10':>9} {'':>9} {'':>9} {'<= 50':>9} {'':>9} {'':>9} {'':>6} {'<= 30':>11}")
verdict = [
    ("binary <= 10 MB", all(r[2] <= TARGET_BIN_MB for r in rows)),
    ("ready <= 50 ms (max)", all(r[5] <= TARGET_READY_MS for r in rows)),
    ("peak RSS <= 30 MB", all(r[9] <= TARGET_RSS_MB for r in rows)),
]
print("  ".join(f"{name}: {ok(good)}" for name, good in verdict))
