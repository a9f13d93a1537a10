//! `leasehold run KEY -- CMD ARGS...`: runs a command while holding the lease on KEY.
//!
//! The lease is taken with [`leasehold::Coordinator::hold`] and renewed in the background
//! (every third of its duration). The command gets `LEASEHOLD_KEY`, `LEASEHOLD_FENCE` and
//! `LEASEHOLD_EXPIRES_AT` (epoch ms, as of the start) in its environment.
//!
//! The command runs in its own process group, and every signal `run` sends goes to the whole
//! group, so a command tree (`make`, `sh -c 'a && b'`) stops as one. When `run` is the
//! foreground job of a terminal, the terminal is handed to the command's group (Ctrl-C and
//! keyboard input reach the command directly) and taken back afterwards. SIGINT, SIGTERM,
//! SIGHUP and SIGQUIT that reach `run` are forwarded to the group.
//!
//! Stopping before the safe time ends: with `safe_until` the holder's deadline of the last
//! renewal (see DESIGN.md, "Clocks"), SIGKILL is scheduled at `safe_until - lead` and
//! SIGTERM `grace` before it, `grace` being `--grace` clamped to half of what a lease leaves
//! after one renewal interval, `(2/3 duration - margin) / 2` with the coordinator's safe
//! margin (9.9 s with the defaults),
//! and `lead` = min(100 ms, duration / 20). Every renewal moves both; when renewals
//! fail, the command is stopped before another host can take the key. A loss reported by the
//! store (taken over, force-released) sends SIGTERM at once and SIGKILL `grace` later (or at
//! `safe_until - lead`, whichever is first). When the command exits, whatever it left running
//! in its group is killed before the lease is released, and the group is killed as well when
//! `run` exits any other way.
//!
//! Exit codes:
//!
//! | code  | meaning |
//! |-------|---------|
//! | N     | the command's own exit status |
//! | 128+N | the command was killed by signal N (also when `run` itself is interrupted while waiting) |
//! | 2     | usage error (bad flag, bad duration, invalid request) |
//! | 75    | the lease is held: not acquired within `--wait`, or held at once with `--skip-if-held` |
//! | 76    | the lease was lost (or about to be) while the command ran; the command was stopped |
//! | 77    | the store could not be reached |
//! | 126   | the command could not be executed |
//! | 127   | the command was not found |

use std::io::{IsTerminal, Write};
use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use leasehold::{AcquireOptions, Coordinator, Error, HeldLease, HoldState};
use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::duration::{self, human};
use crate::output::{failure, now_ms};
use crate::target::{choose, coordinator, Either, Failure};
use crate::{default_holder, exit, Global};

pub const HELP: &str = "\
Without --wait or --skip-if-held, run waits until the lease is free. While it waits on a
terminal, a status line shows the current holder, its expiry and the time waited.

The command's environment gets LEASEHOLD_KEY, LEASEHOLD_FENCE (pass it with every write to
the guarded resource) and LEASEHOLD_EXPIRES_AT (epoch ms, as of the start; renewed in the
background every third of --duration).

The command runs in its own process group; every signal goes to the whole group. On a
terminal, the command's group gets the terminal (Ctrl-C reaches it directly). SIGINT, SIGTERM,
SIGHUP and SIGQUIT sent to run are forwarded to the group.

The command is stopped before the lease's safe time ends: SIGKILL just before it (100 ms, or
a twentieth of --duration if less) and SIGTERM --grace earlier, --grace being clamped to
half of (2/3 of --duration - the safe margin): 9.9 s with the defaults. (The safe margin is
the skew margin, or more on DynamoDB while its answers leave this machine's clock uncertain.)
Every renewal pushes
both back, so they only fire when renewals fail.
If the store reports the lease lost (taken over, force-released), the command gets SIGTERM at
once and SIGKILL --grace later. Either way run exits 76. Processes the command leaves in its
group are killed when it exits, before the lease is released.

Exit codes:
  N      the command's exit status (128+N if it was killed by signal N)
  2      usage error (bad flag, bad duration, invalid request)
  75     lease held: not acquired within --wait, or held at once with --skip-if-held
  76     lease lost (or its safe time ending) while the command ran; the command was stopped
  77     store unreachable
  126    command cannot be executed; 127 command not found
  130/143 interrupted (SIGINT/SIGTERM) while waiting for the lease

With --next STATE instead of KEY, run leases the longest-waiting free key of a work state (see
`leasehold next`), exports it as LEASEHOLD_KEY, and when the command exits 0 moves the key into
--done (default DONE); otherwise the key stays in its state, its attempt counted. Exit 75 when
no key of the state is free within --wait (or at once with --skip-if-held). When the command
exits 0 but the key cannot be moved into --done, the key stays in its state and will be worked
on again (work items are at least once): run exits 76 if the lease was no longer its own
(expired and taken, force-released), 77 if the store could not be reached.

With --slots N, KEY is a semaphore of N slots (DESIGN.md, \"Semaphores\"): run takes one of
them, so at most N commands hold KEY at once; each gets a fence of its own, and a full
semaphore is waited for (or skipped) like a held lease.

Examples:
  leasehold run jobs/nightly -- ./nightly.sh --full
  leasehold run partner-api --slots 4 -- ./call-partner.sh      # at most 4 at once, on any host
  while leasehold run --next PENDING --skip-if-held -- ./process.sh; do :; done   # drain a state
  leasehold run jobs/nightly --skip-if-held -- ./nightly.sh      # cron: skip if another host runs it
  leasehold run db/migrate --wait 5m --duration 1m -- make migrate
  leasehold --table leases run reports --holder \"$HOSTNAME\" -- sh -c 'report --fence \"$LEASEHOLD_FENCE\"'";

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The lease key (with --next: none, the key comes from the state)
    #[arg(required_unless_present = "next", conflicts_with = "next", default_value = "")]
    pub key: String,
    /// Instead of KEY: lease the longest-waiting free key of this work state, export it as
    /// LEASEHOLD_KEY, and when the command succeeds move the key into --done
    #[arg(long, value_name = "STATE")]
    pub next: Option<String>,
    /// With --next: the state a key moves into when the command exits 0 (otherwise the key
    /// stays in its state, its attempt counted)
    #[arg(long, value_name = "STATE", default_value = "DONE", requires = "next")]
    pub done: String,
    /// Lease duration (renewed every third of it while the command runs)
    #[arg(long, default_value = "30s", value_parser = duration::parse, value_name = "D")]
    pub duration: Duration,
    /// Give up (exit 75) if the lease is not free within this time [default: wait until free]
    #[arg(long, value_parser = duration::parse, value_name = "D", conflicts_with = "skip_if_held")]
    pub wait: Option<Duration>,
    /// Exit 75 at once if the lease is held
    #[arg(long = "skip-if-held")]
    pub skip_if_held: bool,
    /// A release never frees the key before this much time after the acquire
    #[arg(long = "min-hold", value_parser = duration::parse, value_name = "D")]
    pub min_hold: Option<Duration>,
    /// Who holds the lease (shown to others) [default: user@hostname]
    #[arg(long, env = "LEASEHOLD_HOLDER")]
    pub holder: Option<String>,
    /// Hold one of N slots of KEY, a semaphore: at most N commands run at once (1..=640; 1 is
    /// a plain lease)
    #[arg(long, value_name = "N", conflicts_with_all = ["next", "min_hold"])]
    pub slots: Option<u32>,
    /// Time between SIGTERM and SIGKILL when the command must stop (at most (2/3 --duration - safe margin) / 2)
    #[arg(long, default_value = "10s", value_parser = duration::parse, value_name = "D")]
    pub grace: Duration,
    /// The command and its arguments, after `--`
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// When the command must be stopped, relative to the holder's safe time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopPlan {
    /// SIGTERM to SIGKILL: `--grace`, at most half of `2/3 duration - margin`.
    pub grace: Duration,
    /// SIGKILL goes this long before the safe time ends.
    pub lead: Duration,
}

impl StopPlan {
    /// After a renewal sent at `t`, the next is due at `t + d/3` and the safe time ends at
    /// `t + d - margin` (the coordinator's safe margin): between the two lie `2d/3 - margin`.
    /// The grace takes at most half of it, so a renewal (with its retries) always has the other
    /// half, less `lead`, to land before the SIGTERM, and healthy renewals never stop the
    /// command.
    pub fn new(grace: Duration, duration: Duration, margin: Duration) -> StopPlan {
        let between = (duration * 2 / 3).saturating_sub(margin);
        StopPlan { grace: grace.min(between / 2), lead: Duration::from_millis(100).min(duration / 20) }
    }

    /// When the command is killed: `lead` before the safe time (`safe`, already shortened by
    /// the time the machine spent suspended since it was learned), or `grace` after it was
    /// told to stop (`termed`), whichever comes first; far away without either.
    fn kill_at(&self, safe: Option<Instant>, termed: Option<Instant>) -> Instant {
        let by_safe = safe.map(|s| s.checked_sub(self.lead).unwrap_or(s));
        let by_term = termed.map(|t| t + self.grace);
        match (by_safe, by_term) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b).unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400 * 365)),
        }
    }
}

pub fn main(g: &Global, args: RunArgs) -> i32 {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    rt.block_on(run(g, args))
}

async fn run(g: &Global, mut args: RunArgs) -> i32 {
    let (coord, mut sigint, mut sigterm) = match start(g, &args).await {
        Ok(started) => started,
        Err(code) => return code,
    };
    let holder = args.holder.clone().filter(|h| !h.is_empty()).unwrap_or_else(default_holder);

    // Take the lease, showing a status line while waiting on a terminal.
    let taken = match &args.next {
        Some(state) => acquire_next(&coord, &args, state, &holder, &mut sigint, &mut sigterm).await,
        None => acquire(&coord, &args, &holder, &mut sigint, &mut sigterm).await,
    };
    let held = match taken {
        Ok(h) => h,
        Err(code) => return code,
    };
    args.key = held.key().to_string();
    // From here on a hangup or quit must not end `run` without stopping the command.
    let (Ok(mut sighup), Ok(mut sigquit)) = (signal(SignalKind::hangup()), signal(SignalKind::quit())) else {
        eprintln!("leasehold: error: cannot install signal handlers");
        release(held, &args.key, false).await;
        return exit::STORE;
    };
    // The margin the lease's safe time is counted with: the skew margin, or more while the
    // store's answers leave this clock less certain (DESIGN.md, "Clocks").
    let plan = StopPlan::new(args.grace, args.duration, coord.safe_margin_now());

    let foreground = terminal_foreground();
    let mut child = match command(&args, &held, foreground).spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("leasehold: error: cannot run {:?}: {e}", args.command[0]);
            release(held, &args.key, false).await;
            return if e.kind() == std::io::ErrorKind::NotFound { 127 } else { 126 };
        }
    };
    let Some(pid) = child.id().map(|p| p as libc::pid_t) else {
        eprintln!("leasehold: error: the command has no process id");
        release(held, &args.key, false).await;
        return exit::STORE;
    };
    let group = Group::new(pid, foreground);

    let outcome =
        supervise(&mut child, &group, &held, &args, plan, [&mut sigint, &mut sigterm, &mut sighup, &mut sigquit]).await;
    // Nothing of the command may outlive it while `run` still holds the lease, nor after.
    group.kill_rest().await;
    drop(group);
    finish(held, &args, outcome).await
}

/// The store's coordinator and the handlers for the signals that may end the wait for the
/// lease; or the exit code of why there are none.
async fn start(g: &Global, args: &RunArgs) -> Result<(Coordinator, Signal, Signal), i32> {
    let choice = match choose(g, false) {
        Ok(Either::Store(c)) => c,
        Ok(Either::Http(_)) => unreachable!("choose refuses URLs here"),
        Err(f) => return Err(failure(g, &f)),
    };
    let coord = match coordinator(g, &choice, crate::table::uses(args.next.is_some())).await {
        Ok((c, _)) => c,
        Err(f) => return Err(failure(g, &f)),
    };
    let (Ok(sigint), Ok(sigterm)) = (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) else {
        eprintln!("leasehold: error: cannot install signal handlers");
        return Err(exit::STORE);
    };
    Ok((coord, sigint, sigterm))
}

/// The command to run under `held`: in a process group of its own (in the terminal's
/// foreground when `run` is), told the key, fence and expiry, never the lease_id.
fn command(args: &RunArgs, held: &HeldLease, foreground: bool) -> tokio::process::Command {
    let expires = held.lease().as_ref().and_then(|l| l.expires_at_ms).unwrap_or(0);
    let mut cmd = tokio::process::Command::new(&args.command[0]);
    cmd.args(&args.command[1..])
        .env("LEASEHOLD_KEY", &args.key)
        .env("LEASEHOLD_FENCE", held.fence().to_string())
        .env("LEASEHOLD_EXPIRES_AT", expires.to_string())
        .env_remove("LEASEHOLD_LEASE_ID");
    // SAFETY: the hook only calls async-signal-safe functions (setpgid, sigprocmask,
    // tcsetpgrp, getpid) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if foreground {
                // Take the terminal before exec, so the command never reads it from the
                // background (the parent does the same: whichever runs first wins the race).
                hand_terminal_to(libc::getpid());
            }
            Ok(())
        });
    }
    cmd
}

/// Releases the lease after the command ended (moving the key on with `--next` when it
/// succeeded) and answers `run`'s exit code.
async fn finish(held: HeldLease, args: &RunArgs, outcome: Outcome) -> i32 {
    let code = match &outcome.status {
        Ok(st) => st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0)),
        Err(e) => {
            eprintln!("leasehold: error: waiting for the command failed: {e}");
            exit::STORE
        }
    };
    // With --next, a command that succeeded moves the key on; otherwise it stays in its state.
    let done = args.next.as_ref().filter(|_| code == 0 && !outcome.stopped).map(|_| args.done.as_str());
    let moved = release_to(held, &args.key, outcome.stopped, done).await;
    if outcome.stopped {
        exit::LOST
    } else if let (Some(state), Err((status, why))) = (done, moved) {
        // The work succeeded but the key did not move on: it stays in its state and will be
        // leased (and worked on) again. Work items are at least once; say so in the exit code.
        eprintln!("leasehold: error: the command succeeded but {:?} was not moved into {state}: {why}", args.key);
        status
    } else {
        code
    }
}

/// Releases the lease; after a loss the release only frees what a late renewal may still
/// hold (it is conditional on the lease_id), so its refusal is expected and not reported.
async fn release(held: HeldLease, key: &str, lost: bool) {
    // Without a state every failure is reported as a warning inside: nothing to return.
    let _ = release_to(held, key, lost, None).await;
}

/// [`release`], moving the key into work state `state`. A failed move into a state is the
/// caller's to report, with the exit code it calls for (76: the lease was no longer this
/// run's, e.g. force-released; 77: the store); any other failure is a warning.
async fn release_to(held: HeldLease, key: &str, lost: bool, state: Option<&str>) -> Result<(), (i32, String)> {
    match held.release_to(state).await {
        // A lease released by someone else (force-release) answers `already_released` and
        // leaves the key where it was: not moved.
        Ok(r) if state.is_some() && r.state.as_deref() != state => {
            Err((exit::LOST, "the lease had already been released by someone else".into()))
        }
        Ok(_) => Ok(()),
        Err(Error::NotHolder { .. }) if lost => Ok(()),
        Err(e) if state.is_some() => {
            Err((if matches!(e, Error::NotHolder { .. }) { exit::LOST } else { exit::STORE }, e.to_string()))
        }
        Err(e) => {
            eprintln!("leasehold: warning: release of {key:?} failed: {e}");
            Ok(())
        }
    }
}

struct Outcome {
    status: std::io::Result<std::process::ExitStatus>,
    /// The command was stopped because the lease was lost or its safe time was ending.
    stopped: bool,
}

/// Waits for the command, forwarding signals and stopping it when the lease is lost or its
/// safe time is about to end.
async fn supervise(
    child: &mut tokio::process::Child,
    group: &Group,
    held: &HeldLease,
    args: &RunArgs,
    plan: StopPlan,
    signals: [&mut Signal; 4],
) -> Outcome {
    let [sigint, sigterm, sighup, sigquit] = signals;
    let mut state = held.watch();
    let mut safe_until = held.safe_until();
    // The suspended time already behind the safe time last learned (see `Suspend`).
    let suspend = Suspend::new();
    let mut learned = suspend.gap();
    let mut renewals_open = true;
    // Set once the command was told to stop: when, and the latest time for SIGKILL.
    let mut termed: Option<Instant> = None;
    let mut killed = false;
    loop {
        let kill_at = plan.kill_at(safe_until.map(|s| suspend.shorten(s, learned)), termed);
        let term_at = kill_at.checked_sub(plan.grace).unwrap_or(kill_at);
        tokio::select! {
            st = child.wait() => return Outcome { status: st, stopped: termed.is_some() },
            _ = sigint.recv() => group.signal(libc::SIGINT),
            _ = sigterm.recv() => group.signal(libc::SIGTERM),
            _ = sighup.recv() => group.signal(libc::SIGHUP),
            _ = sigquit.recv() => group.signal(libc::SIGQUIT),
            changed = state.changed(), if renewals_open && termed.is_none() => {
                if changed.is_err() {
                    // The renewal task ended: the last safe time stands.
                    renewals_open = false;
                    continue;
                }
                let now_state = state.borrow_and_update().clone();
                match now_state {
                    HoldState::Held(l) => {
                        safe_until = l.safe_until;
                        learned = suspend.gap();
                    }
                    HoldState::Lost(l) => {
                        eprintln!(
                            "leasehold: {l} on {:?}; stopping the command (SIGTERM, then SIGKILL after {})",
                            args.key,
                            human(plan.grace)
                        );
                        group.signal(libc::SIGTERM);
                        termed = Some(Instant::now());
                    }
                }
            }
            _ = tokio::time::sleep_until(term_at.into()), if termed.is_none() => {
                eprintln!(
                    "leasehold: lease lost: no renewal of {:?} within its safe time, which ends in {}; stopping the command (SIGTERM, then SIGKILL after {})",
                    args.key,
                    human(safe_until.map(|s| s.saturating_duration_since(Instant::now())).unwrap_or_default()),
                    human(plan.grace)
                );
                group.signal(libc::SIGTERM);
                termed = Some(Instant::now());
            }
            // The monotonic clock stops while the machine is suspended: look again every second,
            // so that a resumed `run` acts on the time that really passed.
            _ = tokio::time::sleep(SUSPEND_CHECK), if suspend.detects() => {}
            _ = tokio::time::sleep_until(kill_at.into()), if termed.is_some() && !killed => {
                eprintln!("leasehold: the command did not stop in time; sending SIGKILL to its process group");
                group.signal(libc::SIGKILL);
                killed = true;
            }
        }
    }
}

/// After this long, leftovers that survive SIGKILL are reported (and signalled again).
const LEFTOVER_WARNING: Duration = Duration::from_secs(2);

/// How often a supervising `run` looks for time the machine spent suspended.
const SUSPEND_CHECK: Duration = Duration::from_secs(1);

/// The processes of group `pgid` that are not zombies, from /proc.
#[cfg(target_os = "linux")]
fn live_in_group(pgid: libc::pid_t) -> usize {
    let Ok(dir) = std::fs::read_dir("/proc") else { return 0 };
    dir.filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()))
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter(|stat| {
            // pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
            let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else { return false };
            let mut fields = rest.split_whitespace();
            let state = fields.next();
            let pgrp = fields.nth(1).and_then(|p| p.parse::<libc::pid_t>().ok());
            pgrp == Some(pgid) && state != Some("Z") && state != Some("X")
        })
        .count()
}

/// The time the machine spent suspended since `run` started: `CLOCK_BOOTTIME` counts it,
/// the monotonic clock (what deadlines and `safe_until` are measured in) does not. Linux only;
/// elsewhere no suspend is seen.
struct Suspend {
    boot: Option<Duration>,
    mono: Instant,
}

impl Suspend {
    fn new() -> Suspend {
        Suspend { boot: boottime(), mono: Instant::now() }
    }

    /// Whether suspends can be seen here.
    fn detects(&self) -> bool {
        self.boot.is_some()
    }

    /// Suspended time since `new`.
    fn gap(&self) -> Duration {
        match (self.boot, boottime()) {
            (Some(b0), Some(b1)) => b1.saturating_sub(b0).saturating_sub(self.mono.elapsed()),
            _ => Duration::ZERO,
        }
    }

    /// `safe_until`, learned when the gap was `learned`, less the suspended time since.
    fn shorten(&self, safe_until: Instant, learned: Duration) -> Instant {
        shorten(safe_until, learned, self.gap())
    }
}

/// `safe_until`, learned when the suspended time was `learned`, now that it is `now`: the
/// monotonic clock did not count the difference, the lease's expiry did.
fn shorten(safe_until: Instant, learned: Duration, now: Duration) -> Instant {
    let lost = now.saturating_sub(learned);
    safe_until.checked_sub(lost).unwrap_or(safe_until)
}

#[cfg(target_os = "linux")]
fn boottime() -> Option<Duration> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given.
    (unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) } == 0)
        .then(|| Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
}

#[cfg(not(target_os = "linux"))]
fn boottime() -> Option<Duration> {
    None
}

/// The command's process group. Dropped, it kills whatever is left of the group and gives the
/// terminal back to `run`'s own group.
struct Group {
    pgid: libc::pid_t,
    foreground: bool,
}

impl Group {
    fn new(pid: libc::pid_t, foreground: bool) -> Group {
        // SAFETY: plain libc calls on the child we spawned. setpgid may fail with EACCES once
        // the child has exec'd: it already did the same itself.
        unsafe {
            libc::setpgid(pid, pid);
            if foreground {
                // `run` is in the background from now on: writing to (or taking back) the
                // terminal must not stop it.
                libc::signal(libc::SIGTTOU, libc::SIG_IGN);
                libc::tcsetpgrp(0, pid);
            }
        }
        Group { pgid: pid, foreground }
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) on the negative process group id: every process of the group.
        unsafe { libc::kill(-self.pgid, sig) };
    }

    /// True while some process of the group exists (zombies included).
    fn exists(&self) -> bool {
        // SAFETY: signal 0 only checks for existence.
        unsafe { libc::kill(-self.pgid, 0) == 0 }
    }

    /// Processes of the group that can still act: every member but zombies. Linux reads
    /// /proc; elsewhere every member counts (zombies included).
    fn live(&self) -> usize {
        #[cfg(target_os = "linux")]
        {
            live_in_group(self.pgid)
        }
        #[cfg(not(target_os = "linux"))]
        {
            usize::from(self.exists())
        }
    }

    /// SIGKILL to whatever is left of the group, and waits until none of it can act. A process
    /// that survives SIGKILL for a while (in uninterruptible sleep on a hung disk or network
    /// mount) could still complete a write it had started: the lease is kept (and renewed)
    /// until it is gone, so that nobody else works on the key beside it. Zombies cannot act
    /// and are not waited for.
    async fn kill_rest(&self) {
        if self.live() == 0 {
            return;
        }
        self.signal(libc::SIGKILL);
        let started = Instant::now();
        let mut warned = false;
        while self.live() > 0 {
            if !warned && started.elapsed() >= LEFTOVER_WARNING {
                eprintln!(
                    "leasehold: {} process(es) of the command survived SIGKILL (uninterruptible sleep?); the lease is \
                     kept until they are gone",
                    self.live()
                );
                warned = true;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
            if started.elapsed() >= LEFTOVER_WARNING {
                self.signal(libc::SIGKILL);
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if self.exists() {
            self.signal(libc::SIGKILL);
        }
        if self.foreground {
            // SAFETY: give the terminal back to our own group (SIGTTOU is ignored).
            unsafe { libc::tcsetpgrp(0, libc::getpgrp()) };
        }
    }
}

/// True when stdin is a terminal and `run` is in its foreground process group: the command's
/// group is then given the terminal, and Ctrl-C reaches it without `run`.
fn terminal_foreground() -> bool {
    // SAFETY: plain libc queries on fd 0 and on this process.
    unsafe { libc::isatty(0) == 1 && libc::tcgetpgrp(0) == libc::getpgrp() }
}

/// In the child between fork and exec: make its (new) group the terminal's foreground group.
/// A background group calling tcsetpgrp gets SIGTTOU, so it is blocked around the call.
fn hand_terminal_to(pgid: libc::pid_t) {
    // SAFETY: async-signal-safe calls only; the mask is restored before returning.
    unsafe {
        let mut block: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut block);
        libc::sigaddset(&mut block, libc::SIGTTOU);
        libc::sigprocmask(libc::SIG_BLOCK, &block, &mut old);
        libc::tcsetpgrp(0, pgid);
        libc::sigprocmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
    }
}

async fn acquire(
    coord: &Coordinator,
    args: &RunArgs,
    holder: &str,
    sigint: &mut tokio::signal::unix::Signal,
    sigterm: &mut tokio::signal::unix::Signal,
) -> Result<HeldLease, i32> {
    let started = Instant::now();
    let limit = if args.skip_if_held { Some(Duration::ZERO) } else { args.wait };
    let mut status = std::io::stderr().is_terminal().then(StatusLine::default);
    let max_wait = coord.config().limits.max_wait;
    let result = loop {
        let wait = match limit {
            Some(w) => w.saturating_sub(started.elapsed()),
            None => max_wait,
        };
        let opts = AcquireOptions {
            wait: Some(wait),
            min_hold: args.min_hold,
            slots: args.slots,
            ..AcquireOptions::default()
        };
        let hold = coord.hold(&args.key, holder, args.duration, opts);
        tokio::pin!(hold);
        let every = Duration::from_millis(250);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let r = loop {
            tokio::select! {
                r = &mut hold => break r,
                _ = tick.tick(), if status.is_some() => {
                    let state = tokio::time::timeout(Duration::from_millis(500), coord.get(&args.key)).await;
                    if let (Some(s), Ok(state)) = (status.as_mut(), state) {
                        s.draw(&args.key, state.ok(), started.elapsed());
                    }
                }
                _ = sigint.recv() => {
                    status.as_mut().map(StatusLine::clear);
                    return Err(128 + libc::SIGINT);
                }
                _ = sigterm.recv() => {
                    status.as_mut().map(StatusLine::clear);
                    return Err(128 + libc::SIGTERM);
                }
            }
        };
        match r {
            Err(Error::LeaseHeld { .. }) if limit.is_none() => continue,
            r => break r,
        }
    };
    if let Some(s) = status.as_mut() {
        s.clear();
    }
    match result {
        Ok(h) => Ok(h),
        Err(Error::LeaseHeld { holder, expires_at_ms, .. }) => {
            let until = match expires_at_ms {
                Some(e) => format!("until {}", crate::output::when(Some(e))),
                None => "until released (fail-closed)".into(),
            };
            let after =
                if args.skip_if_held { String::new() } else { format!(" after waiting {}", human(started.elapsed())) };
            eprintln!("leasehold: {:?} is held by {holder} {until}{after}; not running the command", args.key);
            Err(exit::HELD)
        }
        Err(e) => {
            let f = Failure::from(e);
            eprintln!("leasehold: error: {}", f.message());
            Err(f.code)
        }
    }
}

/// `--next STATE`: one key of the state, leased and kept renewed. Without --wait or
/// --skip-if-held, waits until one is free.
async fn acquire_next(
    coord: &Coordinator,
    args: &RunArgs,
    state: &str,
    holder: &str,
    sigint: &mut tokio::signal::unix::Signal,
    sigterm: &mut tokio::signal::unix::Signal,
) -> Result<HeldLease, i32> {
    let started = Instant::now();
    let limit = if args.skip_if_held { Some(Duration::ZERO) } else { args.wait };
    loop {
        let wait = match limit {
            Some(w) => w.saturating_sub(started.elapsed()),
            None => Duration::from_secs(60),
        };
        let opts = AcquireOptions { wait: Some(wait), min_hold: args.min_hold, ..AcquireOptions::default() };
        let next = coord.acquire_next(state, 1, holder, Some(args.duration), opts);
        let got = tokio::select! {
            r = next => r,
            _ = sigint.recv() => return Err(128 + libc::SIGINT),
            _ = sigterm.recv() => return Err(128 + libc::SIGTERM),
        };
        match got {
            Ok(mut leases) if !leases.is_empty() => return Ok(coord.keep(leases.remove(0))),
            Ok(_) if limit.is_none() => continue,
            Ok(_) => {
                eprintln!("leasehold: no key of state {state} is free; not running the command");
                return Err(exit::HELD);
            }
            Err(e) => {
                let f = Failure::from(e);
                eprintln!("leasehold: error: {}", f.message());
                return Err(f.code);
            }
        }
    }
}

/// The live "waiting for ..." line on stderr.
#[derive(Default)]
struct StatusLine {
    drawn: bool,
}

impl StatusLine {
    fn draw(&mut self, key: &str, state: Option<leasehold::LeaseState>, waited: Duration) {
        let who = match state {
            Some(s) if s.held => match s.expires_at_ms {
                Some(e) => format!(
                    "held by {} (fence {}), expires in {}",
                    s.holder,
                    s.fence,
                    human(Duration::from_millis(e.saturating_sub(now_ms())))
                ),
                None => format!("held by {} (fence {}) until released", s.holder, s.fence),
            },
            _ => "free, acquiring".to_string(),
        };
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r\x1b[2Kleasehold: waiting for {key:?}: {who}; waited {}", human(waited));
        let _ = err.flush();
        self.drawn = true;
    }

    fn clear(&mut self) {
        if self.drawn {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[2K");
            let _ = err.flush();
            self.drawn = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suspended_time_since_a_safe_time_was_learned_shortens_it() {
        let now = Instant::now();
        let safe = now + Duration::from_secs(30);
        // No suspend since it was learned: unchanged.
        assert_eq!(shorten(safe, Duration::from_secs(5), Duration::from_secs(5)), safe);
        // 20 s suspended since: 20 s less of it.
        assert_eq!(shorten(safe, Duration::from_secs(5), Duration::from_secs(25)), safe - Duration::from_secs(20));
        // A suspend longer than what was left: already past.
        assert!(shorten(safe, Duration::ZERO, Duration::from_secs(40)) < now);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_boot_clock_runs_with_the_monotonic_one_while_awake() {
        let s = Suspend::new();
        assert!(s.detects());
        std::thread::sleep(Duration::from_millis(50));
        assert!(s.gap() < Duration::from_millis(20), "{:?}", s.gap());
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn zombies_of_the_group_do_not_count_as_live() {
        use std::os::unix::process::CommandExt;
        // A process in a group of its own, killed and not reaped: a zombie, which kill(2) with
        // signal 0 still finds.
        let mut child = std::process::Command::new("sleep").arg("30").process_group(0).spawn().unwrap();
        let pgid = child.id() as libc::pid_t;
        let group = Group { pgid, foreground: false };
        assert_eq!(live_in_group(pgid), 1);
        group.signal(libc::SIGKILL);
        let deadline = Instant::now() + Duration::from_secs(10);
        while live_in_group(pgid) > 0 {
            assert!(Instant::now() < deadline, "the killed process still counts as live");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(group.exists(), "unreaped, it is a zombie of the group");
        std::mem::forget(group);
        child.wait().unwrap();
    }
}
