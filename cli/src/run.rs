//! `leasehold run KEY -- CMD ARGS...`: runs a command while holding the lease on KEY.
//!
//! The lease is taken with [`leasehold::Coordinator::hold`] and renewed in the background
//! (every third of its duration). The command gets `LEASEHOLD_KEY`, `LEASEHOLD_FENCE` and
//! `LEASEHOLD_EXPIRES_AT` (epoch ms, as of the start) in its environment. SIGINT and SIGTERM
//! are forwarded to it. If the lease is lost while it runs (taken over, force-released, or
//! renewals failing until the safe time ran out), the command gets SIGTERM, then SIGKILL
//! after `--grace`. The lease is released when the command exits.
//!
//! Exit codes:
//!
//! | code  | meaning |
//! |-------|---------|
//! | N     | the command's own exit status |
//! | 128+N | the command was killed by signal N (also when `run` itself is interrupted while waiting) |
//! | 2     | usage error (bad flag, bad duration, invalid request) |
//! | 75    | the lease is held: not acquired within `--wait`, or held at once with `--skip-if-held` |
//! | 76    | the lease was lost while the command ran; the command was stopped |
//! | 77    | the store could not be reached |
//! | 126   | the command could not be executed |
//! | 127   | the command was not found |

use std::io::{IsTerminal, Write};
use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use leasehold::{AcquireOptions, Coordinator, Error, HeldLease};
use tokio::signal::unix::{signal, SignalKind};

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

SIGINT and SIGTERM are forwarded to the command (SIGINT only when it did not come from the
terminal, which already delivered it to the command). If the lease is lost while the
command runs, the command gets SIGTERM, then SIGKILL after --grace, and run exits 76.

Exit codes:
  N      the command's exit status (128+N if it was killed by signal N)
  2      usage error (bad flag, bad duration, invalid request)
  75     lease held: not acquired within --wait, or held at once with --skip-if-held
  76     lease lost while the command ran; the command was stopped
  77     store unreachable
  126    command cannot be executed; 127 command not found
  130/143 interrupted (SIGINT/SIGTERM) while waiting for the lease

Examples:
  leasehold run jobs/nightly -- ./nightly.sh --full
  leasehold run jobs/nightly --skip-if-held -- ./nightly.sh      # cron: skip if another host runs it
  leasehold run db/migrate --wait 5m --duration 1m -- make migrate
  leasehold --table leases run reports --holder \"$HOSTNAME\" -- sh -c 'report --fence \"$LEASEHOLD_FENCE\"'";

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The lease key
    pub key: String,
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
    /// After a lost lease, time between SIGTERM and SIGKILL to the command
    #[arg(long, default_value = "10s", value_parser = duration::parse, value_name = "D")]
    pub grace: Duration,
    /// The command and its arguments, after `--`
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

pub fn main(g: &Global, args: RunArgs) -> i32 {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    rt.block_on(run(g, args))
}

async fn run(g: &Global, args: RunArgs) -> i32 {
    let choice = match choose(g, false) {
        Ok(Either::Store(c)) => c,
        Ok(Either::Http(_)) => unreachable!("choose refuses URLs here"),
        Err(f) => return failure(g, &f),
    };
    let coord = match coordinator(&choice).await {
        Ok((c, _)) => c,
        Err(f) => return failure(g, &f),
    };
    let (Ok(mut sigint), Ok(mut sigterm)) = (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) else {
        eprintln!("leasehold: error: cannot install signal handlers");
        return exit::STORE;
    };
    let holder = args.holder.clone().filter(|h| !h.is_empty()).unwrap_or_else(default_holder);

    // Take the lease, showing a status line while waiting on a terminal.
    let held = match acquire(&coord, &args, &holder, &mut sigint, &mut sigterm).await {
        Ok(h) => h,
        Err(code) => return code,
    };
    let lease = held.lease();
    let (fence, expires) = (held.fence(), lease.as_ref().and_then(|l| l.expires_at_ms).unwrap_or(0));

    let mut cmd = tokio::process::Command::new(&args.command[0]);
    cmd.args(&args.command[1..])
        .env("LEASEHOLD_KEY", &args.key)
        .env("LEASEHOLD_FENCE", fence.to_string())
        .env("LEASEHOLD_EXPIRES_AT", expires.to_string())
        .env_remove("LEASEHOLD_LEASE_ID");
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("leasehold: error: cannot run {:?}: {e}", args.command[0]);
            if let Err(e) = held.release().await {
                eprintln!("leasehold: warning: release of {:?} failed: {e}", args.key);
            }
            return if e.kind() == std::io::ErrorKind::NotFound { 127 } else { 126 };
        }
    };
    let pid = child.id().map(|p| p as libc::pid_t);
    let send = |sig: libc::c_int| {
        if let Some(pid) = pid {
            // SAFETY: plain kill(2) on the child we spawned and have not reaped yet.
            unsafe { libc::kill(pid, sig) };
        }
    };

    let mut lost = None;
    let status = {
        let lost_fut = held.lost();
        tokio::pin!(lost_fut);
        let mut kill_at: Option<Instant> = None;
        loop {
            let kill_deadline = kill_at.unwrap_or_else(Instant::now);
            tokio::select! {
                st = child.wait() => break st,
                _ = sigint.recv() => {
                    if !terminal_delivered_sigint() {
                        send(libc::SIGINT);
                    }
                }
                _ = sigterm.recv() => send(libc::SIGTERM),
                l = &mut lost_fut, if lost.is_none() => {
                    eprintln!(
                        "leasehold: {l} on {:?}; stopping the command (SIGTERM, then SIGKILL after {})",
                        args.key,
                        human(args.grace)
                    );
                    send(libc::SIGTERM);
                    lost = Some(l);
                    kill_at = Some(Instant::now() + args.grace);
                }
                _ = tokio::time::sleep_until(kill_deadline.into()), if kill_at.is_some() => {
                    eprintln!("leasehold: the command did not stop within {}; sending SIGKILL", human(args.grace));
                    send(libc::SIGKILL);
                    kill_at = None;
                }
            }
        }
    };
    let code = match &status {
        Ok(st) => st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0)),
        Err(e) => {
            eprintln!("leasehold: error: waiting for the command failed: {e}");
            exit::STORE
        }
    };
    if lost.is_some() {
        drop(held);
        return exit::LOST;
    }
    if let Err(e) = held.release().await {
        eprintln!("leasehold: warning: release of {:?} failed: {e}", args.key);
    }
    code
}

/// True when this process is in the foreground process group of the terminal on stdin: a
/// SIGINT then came from the keyboard and reached the command already.
fn terminal_delivered_sigint() -> bool {
    // SAFETY: plain libc queries on fd 0 and on this process.
    unsafe { libc::isatty(0) == 1 && libc::tcgetpgrp(0) == libc::getpgrp() }
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
        let opts = AcquireOptions { wait: Some(wait), min_hold: args.min_hold, ..AcquireOptions::default() };
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
