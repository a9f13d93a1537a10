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
