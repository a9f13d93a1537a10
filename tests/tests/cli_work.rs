//! The work-item subcommands of the built `leasehold` binary (`put`, `next`, `count`,
//! `release --state`, `list --state`, `get`), end to end on the embedded store, on DynamoDB
//! Local (`--table`) and over the HTTP API of a `leasehold serve` (`--url`).

mod cli_support;

use cli_support::Target;
use serde_json::Value;

fn work_items(t: &Target) {
    for k in ["orders/1", "orders/2", "orders/3"] {
        let p = t.run(&["put", k, "--state", "PENDING", "--json"]).ok().json();
        assert_eq!(
            (p["key"].as_str(), p["state"].as_str(), p["attempts"].as_u64()),
            (Some(k), Some("PENDING"), Some(0))
        );
        // Each `put` is a new process, whose clock readings are moved back to what the store's
        // answers prove, up to about a second and a half behind (DESIGN.md, "Clocks"): the
        // order of entry is the order of those readings, so the puts are that far apart.
        std::thread::sleep(std::time::Duration::from_millis(1_500));
    }
    let text = t.run(&["put", "orders/1", "--state", "PENDING"]).ok();
    assert!(text.stdout.contains("\"orders/1\" is in state PENDING"), "{text:?}");
    let c = t.run(&["count", "PENDING", "--json"]).ok().json();
    assert_eq!(c["count"], 3);
    assert!(t.run(&["count", "PENDING"]).ok().stdout.contains("3 keys in state PENDING"));

    // next: the two longest waiting, each its own lease_id and fence.
    let n = t.run(&["next", "PENDING", "--limit", "2", "--duration", "30s", "--holder", "w1", "--json"]).ok().json();
    let leases = n["leases"].as_array().unwrap().clone();
    let keys: Vec<&str> = leases.iter().map(|l| l["key"].as_str().unwrap()).collect();
    assert_eq!(keys, ["orders/1", "orders/2"]);
    assert_ne!(leases[0]["lease_id"], leases[1]["lease_id"]);
    assert!(leases.iter().all(|l| l["attempts"] == 1 && l["state"] == "PENDING" && l["fence"].is_u64()));
    // Text: one line per lease.
    let text = t.run(&["next", "PENDING", "--limit", "5", "--duration", "30s"]).ok();
    assert!(text.stdout.starts_with("orders/3  fence "), "{text:?}");
    assert_eq!(t.run(&["next", "PENDING", "--json"]).ok().json()["leases"], Value::Array(vec![]));
    assert!(t.run(&["put", "orders/1", "--state", "OTHER"]).code(75).stderr.contains("held"));

    // release --state: moved on by its holder; a stranger's release changes nothing.
    let id = leases[0]["lease_id"].as_str().unwrap();
    let stranger = leasehold::LeaseId::generate();
    t.run(&["release", "orders/1", "--lease-id", stranger.expose(), "--state", "DONE"]).code(1);
    let r = t.run(&["release", "orders/1", "--lease-id", id, "--state", "DONE", "--json"]).ok().json();
    assert_eq!(r["state"], "DONE");
    let g = t.run(&["get", "orders/1", "--json"]).ok().json();
    assert_eq!(
        (g["state"].as_str(), g["attempts"].as_u64(), g["held"].as_bool()),
        (Some("DONE"), Some(0), Some(false))
    );
    assert!(t.run(&["get", "orders/1"]).ok().stdout.contains("state     DONE since"));
    // A release without --state keeps the state.
    let id2 = leases[1]["lease_id"].as_str().unwrap();
    let r = t.run(&["release", "orders/2", "--lease-id", id2, "--json"]).ok().json();
    assert_eq!(r["state"], "PENDING");

    // Bad input: exit 2, nothing changed.
    for args in [
        &["next", "BAD STATE"][..],
        &["next", "PENDING", "--limit", "0"],
        &["next", "PENDING", "--limit", "101"],
        &["put", "orders/9", "--state", "A#1"],
    ] {
        t.run(args).code(2);
    }
    assert_eq!(t.run(&["count", "PENDING", "--json"]).ok().json()["count"], 2);
    // list --state: on a store (the HTTP API has no such listing).
    if t.is_http() {
        t.run(&["list", "--state", "PENDING"]).code(2);
    } else {
        let l = t.run(&["list", "--state", "PENDING", "--json"]).ok().json();
        let keys: Vec<&str> = l["leases"].as_array().unwrap().iter().map(|s| s["key"].as_str().unwrap()).collect();
        assert_eq!(keys.len(), 2, "{l}");
    }
}

/// `run --next STATE`: one free key of the state per run, exported to the command; moved into
/// --done when the command succeeds, left in its state (attempt counted) when it fails.
fn run_next(t: &Target) {
    t.run(&["put", "jobs/a", "--state", "TODO"]).ok();
    let out = t.run(&[
        "run",
        "--next",
        "TODO",
        "--skip-if-held",
        "--",
        "sh",
        "-c",
        "echo \"$LEASEHOLD_KEY $LEASEHOLD_FENCE\"",
    ]);
    let out = out.ok();
    let (key, fence) = out.stdout.trim().split_once(' ').expect("key and fence");
    assert_eq!(key, "jobs/a");
    assert!(fence.parse::<u64>().unwrap() > 0);
    let g = t.run(&["get", "jobs/a", "--json"]).ok().json();
    assert_eq!((g["state"].as_str(), g["held"].as_bool()), (Some("DONE"), Some(false)));
    // A failing command leaves the key in its state, its attempt counted.
    t.run(&["put", "jobs/b", "--state", "TODO"]).ok();
    t.run(&["run", "--next", "TODO", "--skip-if-held", "--done", "SHIPPED", "--", "sh", "-c", "exit 3"]).code(3);
    let g = t.run(&["get", "jobs/b", "--json"]).ok().json();
    assert_eq!(
        (g["state"].as_str(), g["attempts"].as_u64(), g["held"].as_bool()),
        (Some("TODO"), Some(1), Some(false))
    );
    t.run(&["run", "--next", "TODO", "--skip-if-held", "--done", "SHIPPED", "--", "true"]).ok();
    assert_eq!(t.run(&["get", "jobs/b", "--json"]).ok().json()["state"], "SHIPPED");
    // Nothing free: exit 75, the command does not run.
    let none = t.run(&["run", "--next", "TODO", "--skip-if-held", "--", "sh", "-c", "echo ran"]).code(75);
    assert!(none.stdout.is_empty() && none.stderr.contains("no key of state TODO is free"), "{none:?}");
    // A key and --next together: a usage error.
    t.run(&["run", "jobs/a", "--next", "TODO", "--", "true"]).code(2);
    // The command succeeds but its lease is taken from it (here: it force-releases its own
    // key): the key cannot move into --done, stays in its state, and run says so (exit 76),
    // never 0 for work that will be done again.
    t.run(&["put", "jobs/c", "--state", "TODO"]).ok();
    let bin = cli_support::bin().display().to_string();
    let mut argv = vec!["run", "--next", "TODO", "--skip-if-held", "--", "sh", "-c"];
    argv.extend([r#"bin="$1"; shift; "$bin" "$@" force-release "$LEASEHOLD_KEY" >/dev/null"#, "sh", bin.as_str()]);
    argv.extend(t.args.iter().map(String::as_str));
    let lost = t.run(&argv).code(76);
    assert!(lost.stderr.contains("was not moved into DONE"), "{lost:?}");
    let g = t.run(&["get", "jobs/c", "--json"]).ok().json();
    assert_eq!((g["state"].as_str(), g["held"].as_bool()), (Some("TODO"), Some(false)), "{g}");
}

#[test]
fn run_next_on_the_embedded_store() {
    run_next(&Target::embedded());
}

#[test]
fn run_next_on_dynamodb_local() {
    run_next(&Target::dynamo());
}

#[test]
fn embedded_store() {
    work_items(&Target::embedded());
}

#[test]
fn dynamodb_local() {
    work_items(&Target::dynamo());
}

#[test]
fn over_http_api() {
    work_items(&Target::served());
}
