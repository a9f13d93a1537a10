//! `leasehold run`, end to end: the command's environment and exit status, mutual exclusion
//! between racing runs, --skip-if-held / --wait, a lost lease stopping the whole command tree
//! (before another host can take the key when renewals fail), signal forwarding to the
//! command's process group, and a terminal's Ctrl-C and input reaching the command. On the
//! embedded store and on DynamoDB Local.

mod cli_support;

use std::path::Path;
use std::time::Duration;

use cli_support::{alive, clean_command, descendants, dynamo_env, eventually, pids_in, spawn, Target};
use leasehold_tests::{dynamo_local, proxied_table, proxy::ProxyFault, TempDir};

const LIMIT: Duration = Duration::from_secs(60);

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

fn sh(script: &str) -> Vec<String> {
    vec!["--".into(), "sh".into(), "-c".into(), script.into()]
}

fn run_args<'a>(key: &'a str, opts: &[&'a str], cmd: &'a [String]) -> Vec<&'a str> {
    let mut v = vec!["run", key];
    v.extend_from_slice(opts);
    v.extend(cmd.iter().map(String::as_str));
    v
}

/// The command sees the key, fence and expiry; its exit status comes back; the lease is
/// released afterwards.
fn environment_and_exit_status(t: &Target) {
    let envfile = t.dir.path().join("env");
    let cmd = sh(&format!(
        "echo \"$LEASEHOLD_KEY $LEASEHOLD_FENCE $LEASEHOLD_EXPIRES_AT ${{LEASEHOLD_LEASE_ID:-none}}\" > '{}'; exit 7",
        envfile.display()
    ));
    let before = leasehold_now_ms();
    let out = t.run(&run_args("env/k", &["--duration", "20s", "--holder", "runner"], &cmd)).code(7);
    assert!(out.stderr.is_empty(), "{out:?}");
    let env = read(&envfile);
    let parts: Vec<&str> = env.split_whitespace().collect();
    assert_eq!(parts.len(), 4, "{env:?}");
    assert_eq!(parts[0], "env/k");
    let fence: u64 = parts[1].parse().unwrap();
    let expires: u64 = parts[2].parse().unwrap();
    // Written with the coordinator's clock moved back to what the store's answers prove (a new
    // process's `Date` evidence is about a second wide: DESIGN.md, "Clocks"), never ahead.
    assert!(expires + EVIDENCE_WIDTH_MS >= before + 20_000 && expires <= leasehold_now_ms() + 20_000, "{expires}");
    assert_eq!(parts[3], "none", "the lease_id is not handed to the command");
    let state = t.run(&["get", "env/k", "--json"]).ok().json();
    assert_eq!(state["fence"].as_u64(), Some(fence));
    assert_eq!(state["holder"], "runner");
    assert_eq!(state["held"], false, "released when the command exits");

    t.run(&run_args("env/k", &[], &sh("exit 0"))).ok();
    t.run(&run_args("env/k", &[], &sh("kill -9 $$"))).code(137);
    t.run(&["run", "env/k", "--", "/definitely/not/a/command"]).code(127);
    assert_eq!(t.run(&["get", "env/k", "--json"]).ok().json()["held"], false);
}

/// How far behind this machine's clock a new process's corrected clock may be: the `Date`
/// header's second, the allowance for a late stamp and a round trip.
const EVIDENCE_WIDTH_MS: u64 = 1_500;

fn leasehold_now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

/// While one run holds the key, --skip-if-held exits 75 at once and --wait D exits 75 after
/// D, both without running their command; a lost lease stops the command and exits 76.
fn held_skipped_and_lost(t: &Target) {
    let dir = t.dir.path();
    let started = dir.join("started");
    let termed = dir.join("termed");
    let first = sh(&format!(
        "trap 'echo term > \"{}\"; exit 0' TERM; echo $$ > '{}'; while :; do sleep 0.05; done",
        termed.display(),
        started.display()
    ));
    // 6 s: renewals (every 2 s) have 1.8 s to land before run would stop the command (see
    // StopPlan), room on a loaded machine.
    let mut holder = t.spawn(&run_args("busy", &["--duration", "6s", "--holder", "first"], &first));
    eventually(LIMIT, "the first command to start", || started.exists());

    let ran = dir.join("ran");
    let second = sh(&format!("touch '{}'", ran.display()));
    let skip = t.run(&run_args("busy", &["--skip-if-held"], &second)).code(75);
    assert!(skip.stderr.contains("held by first"), "{skip:?}");
    let waited = t.run(&run_args("busy", &["--wait", "300ms"], &second)).code(75);
    assert!(waited.stderr.contains("after waiting"), "{waited:?}");
    assert!(!ran.exists(), "a run that did not get the lease ran its command");

    // Another process force-releases the key: the run notices at its next renewal, sends
    // SIGTERM (the command records it and exits 0) and exits 76 anyway.
    t.run(&["force-release", "busy"]).ok();
    let out = holder.wait(LIMIT);
    assert_eq!(out.code, 76, "{out:?}");
    assert!(out.stderr.contains("lease lost"), "{out:?}");
    assert_eq!(read(&termed).trim(), "term");
}

leasehold_tests::variants!(sync [embedded => &Target::embedded(), dynamodb => &Target::dynamo()]:
    environment_and_exit_status, held_skipped_and_lost);

/// Two runs race for one key, several times over: both commands run, never at the same time
/// (a mkdir-based critical section would fail with 99 on overlap), and the later fence wins.
fn racing_runs(t: &Target) {
    let dir = t.dir.path();
    let inside = dir.join("inside");
    let log = dir.join("log");
    let cmd = sh(&format!(
        "mkdir '{inside}' || exit 99; echo \"$LEASEHOLD_FENCE\" >> '{log}'; sleep 0.3; rmdir '{inside}'",
        inside = inside.display(),
        log = log.display()
    ));
    for round in 0..3 {
        let mut a = t.spawn(&run_args("race", &["--duration", "5s", "--holder", "a"], &cmd));
        let mut b = t.spawn(&run_args("race", &["--duration", "5s", "--holder", "b"], &cmd));
        let (oa, ob) = (a.wait(LIMIT), b.wait(LIMIT));
        assert_eq!((oa.code, ob.code), (0, 0), "round {round}: {oa:?} {ob:?}");
    }
    let fences: Vec<u64> = read(&log).lines().map(|l| l.parse().unwrap()).collect();
    assert_eq!(fences.len(), 6, "{fences:?}");
    assert!(fences.windows(2).all(|w| w[0] < w[1]), "fences must strictly increase: {fences:?}");
}

leasehold_tests::variants!(sync [embedded => &Target::embedded(), dynamodb => &Target::dynamo()]: racing_runs);

/// `run --slots 2`: two commands hold the semaphore at once, each with a fence of its own; a
/// third run is skipped (75) while both run, without running its command; both slots are free
/// once the commands exit.
fn runs_share_the_slots_of_a_semaphore(t: &Target) {
    let dir = t.dir.path();
    let (a, b, c, go) = (dir.join("a"), dir.join("b"), dir.join("c"), dir.join("go"));
    let cmd = |f: &Path| {
        sh(&format!(
            "echo \"$LEASEHOLD_FENCE\" > '{}'; while [ ! -e '{}' ]; do sleep 0.05; done",
            f.display(),
            go.display()
        ))
    };
    let (ca, cb) = (cmd(&a), cmd(&b));
    let opts = |h: &'static str| ["--slots", "2", "--duration", "20s", "--holder", h];
    let mut first = t.spawn(&run_args("sem/run", &opts("a"), &ca));
    let mut second = t.spawn(&run_args("sem/run", &opts("b"), &cb));
    eventually(LIMIT, "both commands to run at once", || !read(&a).trim().is_empty() && !read(&b).trim().is_empty());
    let third = sh(&format!("touch '{}'", c.display()));
    let out = t.run(&run_args("sem/run", &["--slots", "2", "--skip-if-held"], &third)).code(75);
    assert!(out.stderr.contains("held"), "{out:?}");
    assert!(!c.exists(), "the third command ran");
    let state = t.run(&["get", "sem/run", "--json"]).ok().json();
    assert_eq!((state["slots"].as_u64(), state["slots_taken"].as_u64()), (Some(2), Some(2)), "{state}");
    std::fs::write(&go, "").unwrap();
    for run in [&mut first, &mut second] {
        let out = run.wait(LIMIT);
        assert_eq!(out.code, 0, "{out:?}");
    }
    let (fa, fb): (u64, u64) = (read(&a).trim().parse().unwrap(), read(&b).trim().parse().unwrap());
    assert_ne!(fa, fb, "each slot has a fence of its own");
    let state = t.run(&["get", "sem/run", "--json"]).ok().json();
    assert_eq!((state["held"].as_bool(), state["slots_taken"].as_u64()), (Some(false), Some(0)), "{state}");
    // Free again: the third run gets a slot.
    t.run(&run_args("sem/run", &["--slots", "2", "--skip-if-held"], &third)).ok();
    assert!(c.exists());
}

leasehold_tests::variants!(sync [embedded => &Target::embedded(), dynamodb => &Target::dynamo()]:
    runs_share_the_slots_of_a_semaphore);

#[test]
fn a_command_ignoring_sigterm_is_killed_after_the_grace_period() {
    let t = Target::embedded();
    let pidfile = t.dir.path().join("pid");
    let cmd = sh(&format!("trap '' TERM; echo $$ > '{}'; while :; do sleep 0.05; done", pidfile.display()));
    let mut run = t.spawn(&run_args("stubborn", &["--duration", "2s", "--grace", "500ms"], &cmd));
    eventually(LIMIT, "the command to start", || !read(&pidfile).trim().is_empty());
    let pid = read(&pidfile).trim().to_string();
    t.run(&["force-release", "stubborn"]).ok();
    let out = run.wait(LIMIT);
    assert_eq!(out.code, 76, "{out:?}");
    assert!(out.stderr.contains("SIGKILL"), "{out:?}");
    assert!(!Path::new(&format!("/proc/{pid}")).exists(), "the command {pid} still exists");
}

#[test]
fn sigterm_and_sigint_are_forwarded_and_the_lease_released() {
    let t = Target::embedded();
    for (sig, status) in [("TERM", 5), ("INT", 6)] {
        let started = t.dir.path().join(format!("started-{sig}"));
        let cmd =
            sh(&format!("trap 'exit {status}' {sig}; touch '{}'; while :; do sleep 0.05; done", started.display()));
        let mut run = t.spawn(&run_args("fwd", &["--duration", "30s"], &cmd));
        eventually(LIMIT, "the command to start", || started.exists());
        run.signal(sig);
        let out = run.wait(LIMIT);
        assert_eq!(out.code, status, "SIG{sig}: {out:?}");
        assert_eq!(t.run(&["get", "fwd", "--json"]).ok().json()["held"], false, "released after SIG{sig}");
    }
}

#[test]
fn waiting_run_takes_the_key_when_it_frees_and_can_be_interrupted() {
    let t = Target::embedded();
    // Held by a plain acquire for 2 s: a waiting run gets it after the expiry. (2 s: a loaded
    // machine can answer a grant later than a shorter lease's safe time.)
    t.run(&["acquire", "later", "--holder", "other", "--duration", "2s"]).ok();
    let marker = t.dir.path().join("ran");
    t.run(&run_args("later", &["--wait", "20s"], &sh(&format!("touch '{}'", marker.display())))).ok();
    assert!(marker.exists());

    // A run waiting without limit exits 143 on SIGTERM, without running its command.
    t.run(&["acquire", "forever", "--holder", "other", "--fail-closed"]).ok();
    let never = t.dir.path().join("never");
    let mut run = t.spawn(&run_args("forever", &[], &sh(&format!("touch '{}'", never.display()))));
    // Give it time to start waiting (were the signal earlier, the exit would be 143 too).
    std::thread::sleep(Duration::from_millis(300));
    assert!(!never.exists());
    run.signal("TERM");
    let out = run.wait(LIMIT);
    assert_eq!(out.code, 143, "{out:?}");
    assert!(!never.exists());
    assert_eq!(t.run(&["get", "forever", "--json"]).ok().json()["holder"], "other");
}

fn still_alive(pids: &[u32]) -> Vec<u32> {
    pids.iter().copied().filter(|p| alive(*p)).collect()
}

/// The stop timers move with every renewal: a command running for several durations of a
/// short lease is not stopped while renewals succeed.
#[test]
fn renewals_keep_a_long_command_running() {
    let t = Target::embedded();
    let out = t.spawn(&run_args("long", &["--duration", "2s"], &sh("sleep 5; exit 4"))).wait(LIMIT);
    assert_eq!(out.code, 4, "{out:?}");
    assert!(out.stderr.is_empty(), "{out:?}");
}

/// The case of the issue: `sh -c 'sleep 300'` force-released leaves nothing behind, neither
/// the shell nor the `sleep` below it (dash runs it as a child or execs it: both are
/// covered by collecting every descendant of `run` while it runs).
#[test]
fn force_release_leaves_no_process_of_the_command_tree() {
    let t = Target::embedded();
    for script in ["sleep 300", "sleep 300; :", "sleep 300 & sh -c 'sleep 301; :' & wait"] {
        let mut run = t.spawn(&run_args("tree", &["--duration", "30s", "--grace", "2s"], &sh(script)));
        let pid = run.pid();
        let mut tree = Vec::new();
        eventually(LIMIT, "the command's sleep to start", || {
            tree = descendants(pid);
            let sleeps = tree.iter().filter(|p| read(Path::new(&format!("/proc/{p}/comm"))).trim() == "sleep").count();
            sleeps == if script.contains("301") { 2 } else { 1 }
        });
        t.run(&["force-release", "tree"]).ok();
        let out = run.wait(LIMIT);
        assert_eq!(out.code, 76, "{script}: {out:?}");
        assert_eq!(still_alive(&tree), Vec::<u32>::new(), "{script}: processes left behind ({tree:?}); {out:?}");
    }
}

/// A command that exits normally leaves no background process running without the lease:
/// the rest of its group is killed before the lease is released.
#[test]
fn background_processes_do_not_outlive_the_command() {
    let t = Target::embedded();
    let pidfile = t.dir.path().join("bg");
    let cmd = sh(&format!("sleep 300 & echo $! > '{}'; exit 3", pidfile.display()));
    t.spawn(&run_args("bg", &["--duration", "30s"], &cmd)).wait(LIMIT).code(3);
    let pids = pids_in(&pidfile);
    assert_eq!(pids.len(), 1, "{pids:?}");
    assert_eq!(still_alive(&pids), Vec::<u32>::new(), "the background sleep outlived the command");
    assert_eq!(t.run(&["get", "bg", "--json"]).ok().json()["held"], false);
}

/// SIGTERM sent to `run` reaches every process of the command's group, not only the shell.
#[test]
fn forwarded_sigterm_reaches_the_whole_group() {
    let t = Target::embedded();
    let pidfile = t.dir.path().join("pids");
    let cmd = sh(&format!("sleep 300 & echo $! > '{}'; wait", pidfile.display()));
    let mut run = t.spawn(&run_args("grp", &["--duration", "30s"], &cmd));
    eventually(LIMIT, "the command to start", || pids_in(&pidfile).len() == 1);
    let pids = [pids_in(&pidfile), descendants(run.pid())].concat();
    run.signal("TERM");
    let out = run.wait(LIMIT);
    assert_eq!(out.code, 143, "{out:?}");
    assert_eq!(still_alive(&pids), Vec::<u32>::new(), "{out:?}");
}

/// Renewals stall (every request of the run goes through a proxy that holds it): the run must
/// have killed the whole command tree, which ignores SIGTERM, before another host can acquire
/// the key. Ordering, not wall-clock slack: a second run, talking to DynamoDB Local directly,
/// gets the key only once the lease has expired, and its command checks then that no process
/// of the first command is left.
#[test]
fn stalled_renewals_stop_the_command_tree_before_the_lease_expires() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let (proxy, table, _) = rt.block_on(proxied_table());
    let local = dynamo_local();
    let dir = TempDir::new("cli-stall");
    let pidfile = dir.path().join("pids");
    let verdict = dir.path().join("verdict");
    // Both the shell and everything below it ignore SIGTERM: only SIGKILL stops them.
    let script = format!(
        "trap '' TERM; echo $$ > '{p}'; sleep 300 & echo $! >> '{p}'; sh -c 'while :; do sleep 0.05; done' & echo $! >> '{p}'; wait",
        p = pidfile.display()
    );
    let mut first = clean_command();
    first.args(["--table", &table]).args(run_args("stall", &["--duration", "3s", "--grace", "10s"], &sh(&script)));
    first.envs(dynamo_env(&proxy.endpoint()));
    let mut first = spawn(first);
    eventually(LIMIT, "the first command to start", || pids_in(&pidfile).len() == 3);
    // From now on every request of the first run hangs in the proxy.
    proxy.inject(&[ProxyFault::Stall(Duration::from_secs(120)); 1000]);

    let check = format!(
        "for p in $(cat '{p}'); do s=$(sed 's/.*) //' /proc/$p/stat 2>/dev/null | cut -d' ' -f1); \
         [ -n \"$s\" ] && [ \"$s\" != Z ] && echo \"$p $s\"; done > '{v}'; touch '{v}.done'",
        p = pidfile.display(),
        v = verdict.display()
    );
    let mut second = clean_command();
    second.args(["--table", &table]).args(run_args("stall", &["--wait", "60s", "--holder", "second"], &sh(&check)));
    second.envs(dynamo_env(&local.endpoint));
    let out2 = spawn(second).wait(LIMIT);
    assert_eq!(out2.code, 0, "{out2:?}");
    assert!(Path::new(&format!("{}.done", verdict.display())).exists());
    let out1 = first.wait(LIMIT);
    assert_eq!(
        read(&verdict),
        "",
        "processes of the first command were alive when the second run got the key; first run: {out1:?}"
    );
    assert_eq!(out1.code, 76, "{out1:?}");
    assert!(out1.stderr.contains("SIGKILL"), "{out1:?}");
    drop(proxy);
}

/// On a terminal the command's group gets the terminal: it reads keyboard input (a background
/// group would be stopped by SIGTTIN), Ctrl-C reaches it (and not `run`), and what the command
/// left in its group is killed when it exits. Driven through a pseudo-terminal.
#[test]
fn terminal_input_and_ctrl_c_reach_the_command() {
    let t = Target::embedded();
    let d = t.dir.path();
    let (pidfile, got, intr, ready) = (d.join("pid"), d.join("got"), d.join("int"), d.join("ready"));
    let script = format!(
        "trap 'echo int > \"{intr}\"; exit 6' INT; sleep 300 & echo $! > '{pid}'; read x; echo \"$x\" > '{got}'; \
         touch '{ready}'; while :; do sleep 0.05; done",
        intr = intr.display(),
        pid = pidfile.display(),
        got = got.display(),
        ready = ready.display()
    );
    let driver = r#"
import os, pty, select, sys, time
bin, db, script, pidfile, ready = sys.argv[1:6]
pid, fd = pty.fork()
if pid == 0:
    os.execv(bin, [bin, "--db", db, "run", "tty", "--duration", "30s", "--", "sh", "-c", script])
deadline = time.time() + 60
out = b""
def pump():
    global out
    r, _, _ = select.select([fd], [], [], 0.02)
    if r:
        try:
            out += os.read(fd, 4096)
        except OSError:
            pass
def wait_for(path):
    while not os.path.exists(path):
        if time.time() > deadline:
            sys.exit("timed out waiting for " + path + ": " + out.decode(errors="replace"))
        pump()
wait_for(pidfile)
os.write(fd, b"hello\n")
wait_for(ready)
os.write(fd, b"\x03")
while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    if time.time() > deadline:
        sys.exit("run did not exit: " + out.decode(errors="replace"))
    pump()
sys.stderr.write(out.decode(errors="replace"))
print(os.waitstatus_to_exitcode(status))
"#;
    let db = d.join("leases.db");
    let bin = cli_support::bin();
    let out = std::process::Command::new("python3")
        .args(["-c", driver])
        .arg(&bin)
        .arg(&db)
        .arg(&script)
        .arg(&pidfile)
        .arg(&ready)
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stdout.trim(), "6", "run's exit status; terminal output: {stderr}");
    assert_eq!(read(&got).trim(), "hello", "the command read the terminal");
    assert_eq!(read(&intr).trim(), "int", "Ctrl-C reached the command");
    let pids = pids_in(&pidfile);
    assert_eq!(still_alive(&pids), Vec::<u32>::new(), "the background sleep outlived the command");
}
