//! The lease subcommands of the built `leasehold` binary, end to end, on the embedded store,
//! on DynamoDB Local (`--table`) and over the HTTP API of a `leasehold serve` (`--url`).

mod cli_support;

use cli_support::{clean_command, output, Target};
use serde_json::Value;
use std::process::Command;

const LEASE_FIELDS: &[&str] =
    &["key", "holder", "lease_id", "fence", "acquired_at_ms", "expires_at_ms", "duration_ms", "min_hold_until_ms"];

fn u(v: &Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("{k} is not a number in {v}"))
}

/// Every subcommand against one store, checking exit codes, `--json` vocabulary and text.
fn every_subcommand(t: &Target) {
    // acquire --json: the API's Lease, with the holder's lease_id.
    let a = t.run(&["acquire", "jobs/nightly", "--holder", "w1", "--duration", "30s", "--json"]).ok().json();
    for f in LEASE_FIELDS {
        assert!(a.get(*f).is_some(), "acquire --json lacks {f}: {a}");
    }
    assert_eq!(a["key"], "jobs/nightly");
    assert_eq!(a["holder"], "w1");
    assert_eq!(u(&a, "duration_ms"), 30_000);
    assert_eq!(u(&a, "expires_at_ms"), u(&a, "acquired_at_ms") + 30_000);
    let id = a["lease_id"].as_str().unwrap().to_string();
    let fence = u(&a, "fence");

    // Held: another acquire exits 75 with the LeaseHeld error naming the holder.
    let held = t.run(&["acquire", "jobs/nightly", "--holder", "w2", "--json"]).code(75).json();
    assert_eq!(held["error"], "LeaseHeld");
    assert_eq!(held["holder"], "w1");
    assert_eq!(u(&held, "expires_at_ms"), u(&a, "expires_at_ms"));
    assert!(held["message"].as_str().unwrap().contains("w1"));
    let text = t.run(&["acquire", "jobs/nightly", "--holder", "w2"]).code(75);
    assert!(text.stderr.contains("held by \"w1\""), "{text:?}");
    assert!(text.stdout.is_empty());

    // get: public state, never the lease_id.
    let g = t.run(&["get", "jobs/nightly", "--json"]).ok().json();
    assert_eq!(g["held"], true);
    assert_eq!(g["holder"], "w1");
    assert_eq!(u(&g, "fence"), fence);
    assert!(g.get("lease_id").is_none(), "get must not reveal the lease_id: {g}");
    let text = t.run(&["get", "jobs/nightly"]).ok();
    assert!(text.stdout.contains("is held by w1") && text.stdout.contains(&fence.to_string()), "{text:?}");
    assert!(!text.stdout.contains(&id));

    // heartbeat: same fence, later or equal expiry; the lease_id is not echoed.
    let h = t.run(&["heartbeat", "jobs/nightly", "--lease-id", &id, "--duration", "1m", "--json"]).ok().json();
    assert_eq!(u(&h, "fence"), fence);
    assert_eq!(u(&h, "duration_ms"), 60_000);
    assert!(u(&h, "expires_at_ms") >= u(&a, "expires_at_ms") + 29_000);
    assert!(h.get("lease_id").is_none(), "heartbeat output must not repeat the lease_id: {h}");
    let text = t.run(&["heartbeat", "jobs/nightly", "--lease-id", &id]).ok();
    assert!(text.stdout.contains("renewed \"jobs/nightly\"") && !text.stdout.contains(&id), "{text:?}");
    // The lease_id may come from the environment instead of the command line.
    let mut c = t.cmd(&["heartbeat", "jobs/nightly", "--json"]);
    c.env("LEASEHOLD_LEASE_ID", &id);
    assert_eq!(u(&output(c).ok().json(), "fence"), fence);

    // A wrong lease_id changes nothing: NotHolder, exit 1.
    let wrong = "x".repeat(32);
    let nh = t.run(&["heartbeat", "jobs/nightly", "--lease-id", &wrong, "--json"]).code(1).json();
    assert_eq!(nh["error"], "NotHolder");
    assert_eq!(nh["reason"], "wrong_lease_id");
    t.run(&["release", "jobs/nightly", "--lease-id", &wrong]).code(1);
    assert_eq!(t.run(&["get", "jobs/nightly", "--json"]).ok().json()["held"], true);

    // release, then again (idempotent).
    let r = t.run(&["release", "jobs/nightly", "--lease-id", &id, "--json"]).ok().json();
    assert_eq!(r["key"], "jobs/nightly");
    assert_eq!(u(&r, "fence"), fence);
    assert!(u(&r, "free_at_ms") >= u(&r, "released_at_ms"));
    let text = t.run(&["release", "jobs/nightly", "--lease-id", &id]).ok();
    assert!(text.stdout.contains("released \"jobs/nightly\""), "{text:?}");
    let g = t.run(&["get", "jobs/nightly", "--json"]).ok().json();
    assert_eq!(g["held"], false);
    assert!(t.run(&["get", "jobs/nightly"]).ok().stdout.contains("is free"));
    // A released lease cannot be renewed.
    assert_eq!(t.run(&["heartbeat", "jobs/nightly", "--lease-id", &id, "--json"]).code(1).json()["reason"], "released");

    // Text acquire prints the lease_id the holder needs; the fence moved up.
    let text = t.run(&["acquire", "jobs/nightly", "--holder", "w2", "--duration", "30s"]).ok();
    let id2 = text
        .stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("lease_id"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| panic!("no lease_id line: {text:?}"));
    assert_eq!(id2.len(), 32);
    let g = t.run(&["get", "jobs/nightly", "--json"]).ok().json();
    assert!(u(&g, "fence") > fence);
    assert_eq!(g["holder"], "w2");

    // Options: caller-chosen lease_id (a retried acquire gets the same lease), metadata,
    // min-hold, fail-closed.
    let mine = "retry-safe-id-0123456789";
    let m1 = t
        .run(&["acquire", "cfg/a", "--lease-id", mine, "--metadata", r#"{"run":42}"#, "--min-hold", "2s", "--json"])
        .ok()
        .json();
    let m2 = t.run(&["acquire", "cfg/a", "--lease-id", mine, "--metadata", r#"{"run":42}"#, "--json"]).ok().json();
    assert_eq!(m1["lease_id"], mine);
    assert_eq!(u(&m1, "fence"), u(&m2, "fence"));
    assert_eq!(u(&m1, "min_hold_until_ms"), u(&m1, "acquired_at_ms") + 2000);
    assert_eq!(m1["holder"], "tester", "LEASEHOLD_HOLDER is the default holder");
    assert_eq!(t.run(&["get", "cfg/a", "--json"]).ok().json()["metadata"]["run"], 42);
    let fc = t.run(&["acquire", "cfg/closed", "--fail-closed", "--json"]).ok().json();
    assert!(fc["expires_at_ms"].is_null() && fc["duration_ms"].is_null(), "{fc}");
    assert!(t.run(&["get", "cfg/closed"]).ok().stdout.contains("never (fail-closed"));

    // --wait: a 4 s lease expires and the waiting acquire takes the key. (4 s: a new process's
    // safe margin on DynamoDB is up to about 1.3 s, and a loaded machine can answer a grant
    // later than a 2 s lease's remaining safe time; CI saw it.)
    t.run(&["acquire", "wait/k", "--holder", "short", "--duration", "4s"]).ok();
    let w = t.run(&["acquire", "wait/k", "--holder", "patient", "--wait", "15s", "--json"]).ok().json();
    assert_eq!(w["holder"], "patient");
    // ... and without enough wait, LeaseHeld.
    t.run(&["acquire", "wait/k", "--holder", "hasty", "--wait", "200ms"]).code(75);

    // get of a key never taken: NotFound, exit 1.
    let nf = t.run(&["get", "never/taken", "--json"]).code(1).json();
    assert_eq!(nf["error"], "NotFound");

    // Invalid requests found by the coordinator: exit 2, InvalidRequest.
    let inv = t.run(&["acquire", "bad", "--duration", "10ms", "--json"]).code(2).json();
    assert_eq!(inv["error"], "InvalidRequest");
    assert!(inv["message"].as_str().unwrap().contains("duration"), "{inv}");
    assert_eq!(t.run(&["acquire", "bad", "--lease-id", "short", "--json"]).code(2).json()["error"], "InvalidRequest");

    // list and force-release work on every target, `leasehold serve` included (its operator
    // routes GET /leases and POST /leases/force-release/{key}).
    // list: the held keys, not the released or expired ones.
    let l = t.run(&["list", "--json"]).ok().json();
    let keys: Vec<&str> = l["leases"].as_array().unwrap().iter().map(|s| s["key"].as_str().unwrap()).collect();
    for k in ["jobs/nightly", "cfg/a", "cfg/closed", "wait/k"] {
        assert!(keys.contains(&k), "{k} missing from {keys:?}");
    }
    assert!(l["leases"].as_array().unwrap().iter().all(|s| s["held"] == true && s.get("lease_id").is_none()));
    assert_eq!(t.run(&["list", "--limit", "2", "--json"]).ok().json()["leases"].as_array().unwrap().len(), 2);
    let text = t.run(&["list"]).ok();
    assert!(
        text.stdout.starts_with("KEY") && text.stdout.contains("jobs/nightly") && text.stdout.contains("w2"),
        "{text:?}"
    );
    // An aligned table: every column starts where its header does.
    let lines: Vec<&str> = text.stdout.lines().collect();
    let head = lines[0];
    assert!(head.split_whitespace().eq(["KEY", "HOLDER", "FENCE", "EXPIRES", "IN", "STATE"]), "{head}");
    for line in &lines[1..] {
        assert_eq!(
            line.chars().count() - line.split_whitespace().last().unwrap().chars().count(),
            head.find("STATE").unwrap(),
            "STATE column of {line:?} in\n{}",
            text.stdout
        );
        assert_eq!(line.find(' '), Some(line.split_whitespace().next().unwrap().len()), "{line}");
    }
    let row = |k: &str| {
        lines.iter().find(|l| l.starts_with(&format!("{k} "))).unwrap_or_else(|| panic!("{k} in {lines:?}")).to_string()
    };
    assert!(row("cfg/closed").ends_with(" never  fail-closed"), "{}", row("cfg/closed"));
    assert!(row("jobs/nightly").ends_with("  held"), "{}", row("jobs/nightly"));
    let fence = u(&t.run(&["get", "jobs/nightly", "--json"]).ok().json(), "fence").to_string();
    assert!(row("jobs/nightly").split_whitespace().any(|c| c == fence), "{} lacks {fence}", row("jobs/nightly"));
    let only_cfg = t.run(&["list", "--prefix", "cfg/", "--json"]).ok().json();
    assert!(only_cfg["leases"].as_array().unwrap().iter().all(|l| l["key"].as_str().unwrap().starts_with("cfg/")));
    assert!(only_cfg["leases"].as_array().unwrap().len() >= 2, "{only_cfg}");

    // force-release: frees the key at once, advances the fence; the evicted holder is out.
    let before = u(&t.run(&["get", "jobs/nightly", "--json"]).ok().json(), "fence");
    let f = t.run(&["force-release", "jobs/nightly", "--json"]).ok().json();
    assert_eq!(f["held"], false);
    assert!(u(&f, "fence") > before);
    assert_eq!(
        t.run(&["heartbeat", "jobs/nightly", "--lease-id", &id2, "--json"]).code(1).json()["error"],
        "NotHolder"
    );
    let n = t.run(&["acquire", "jobs/nightly", "--holder", "w3", "--json"]).ok().json();
    assert!(u(&n, "fence") > u(&f, "fence"));
    assert!(t.run(&["force-release", "cfg/closed"]).ok().stdout.contains("force-released \"cfg/closed\""));
    assert_eq!(t.run(&["force-release", "never/taken", "--json"]).code(1).json()["error"], "NotFound");
    let keys = t.run(&["list", "--json"]).ok().json();
    assert!(!keys["leases"].as_array().unwrap().iter().any(|s| s["key"] == "cfg/closed"));
}

leasehold_tests::variants!(sync [
    embedded => &Target::embedded(),
    dynamodb => &Target::dynamo(),
    served => &Target::served(),
]: every_subcommand);

/// `acquire --slots N`: a semaphore of N holders (DESIGN.md, "Semaphores"), each released on
/// its own; `force-release --fence` evicts one holder.
fn semaphore_subcommands(t: &Target) {
    let acquire =
        |h: &str| t.run(&["acquire", "sem/cli", "--holder", h, "--duration", "30s", "--slots", "2", "--json"]);
    let s1 = acquire("s1").ok().json();
    let s2 = acquire("s2").ok().json();
    assert_eq!(u(&s1, "slots"), 2);
    assert!(u(&s2, "fence") > u(&s1, "fence"), "fences increase across slots");
    let full = acquire("s3").code(75).json();
    assert_eq!(full["error"], "LeaseHeld");
    // The earliest expiry of a live holder (DESIGN.md, "Semaphores"): each CLI call is a new
    // process, whose clock is corrected by its own evidence, so the later take may expire first.
    assert_eq!(u(&full, "expires_at_ms"), u(&s1, "expires_at_ms").min(u(&s2, "expires_at_ms")));
    let g = t.run(&["get", "sem/cli", "--json"]).ok().json();
    assert_eq!((u(&g, "slots"), g["holders"].as_array().unwrap().len()), (2, 2), "{g}");
    assert!(!g.to_string().contains(s1["lease_id"].as_str().unwrap()));
    let id1 = s1["lease_id"].as_str().unwrap();
    t.run(&["heartbeat", "sem/cli", "--lease-id", id1, "--json"]).ok();
    t.run(&["release", "sem/cli", "--lease-id", id1, "--json"]).ok();
    assert_eq!(t.run(&["release", "sem/cli", "--lease-id", id1, "--json"]).ok().json()["already_released"], true);
    let s3 = acquire("s3").ok().json();
    let one = t.run(&["force-release", "sem/cli", "--fence", &u(&s3, "fence").to_string(), "--json"]);
    assert_eq!(one.ok().json()["holders"].as_array().unwrap().len(), 1);
    acquire("s4").ok();
    // A fence no unreleased holder has: NotFound; a key that is no semaphore: InvalidRequest.
    let gone = t.run(&["force-release", "sem/cli", "--fence", &u(&s3, "fence").to_string(), "--json"]);
    assert_eq!(gone.code(1).json()["error"], "NotFound");
    t.run(&["acquire", "plain/cli", "--holder", "p", "--json"]).ok();
    let plain = t.run(&["force-release", "plain/cli", "--fence", "1", "--json"]).code(2).json();
    assert_eq!(plain["error"], "InvalidRequest");
    let bad = t.run(&["acquire", "sem/cli", "--holder", "x", "--slots", "0", "--json"]).code(2).json();
    assert_eq!(bad["error"], "InvalidRequest");
}

/// Operators see a semaphore as one (DESIGN.md, "Semaphores": Interfaces): `list` and `get`
/// show its slots taken of N and each live holder with its fence and time left, not the first
/// holder alone; `force-release --fence` says what it evicted.
fn operators_see_a_semaphore_as_one(t: &Target) {
    let take = |h: &str| {
        let a = ["acquire", "pool/x", "--holder", h, "--duration", "30s", "--slots", "4", "--json"];
        t.run(&a).ok().json()
    };
    let held: Vec<Value> = ["a", "b", "c"].iter().map(|h| take(h)).collect();
    let listed = t.run(&["list", "--json"]).ok().json();
    let item = listed["leases"].as_array().unwrap().iter().find(|l| l["key"] == "pool/x").cloned().unwrap();
    assert_eq!((u(&item, "slots"), u(&item, "slots_taken")), (4, 3), "{item}");
    let text = t.run(&["list"]).ok().stdout;
    let row = text.lines().find(|l| l.starts_with("pool/x")).unwrap_or_else(|| panic!("{text}"));
    assert!(row.contains("3 of 4 slots") && row.contains("held"), "{text}");
    for (h, l) in ["a", "b", "c"].iter().zip(&held) {
        let line = text.lines().find(|x| x.contains(&format!("- {h} "))).unwrap_or_else(|| panic!("{h}: {text}"));
        assert!(line.contains(&u(l, "fence").to_string()) && line.contains('s'), "{line}");
    }
    let got = t.run(&["get", "pool/x"]).ok().stdout;
    assert!(got.contains("is a semaphore: 3 of 4 slots taken"), "{got}");
    for (h, l) in ["a", "b", "c"].iter().zip(&held) {
        let line = got.lines().find(|x| x.contains(&format!("holder    {h} "))).unwrap_or_else(|| panic!("{got}"));
        assert!(line.contains(&format!("fence {}", u(l, "fence"))) && line.ends_with(" left"), "{line}");
    }
    let fence = u(&held[1], "fence").to_string();
    let out = t.run(&["force-release", "pool/x", "--fence", &fence]).ok().stdout;
    assert!(out.contains(&format!("the holder with fence {fence} evicted; 2 of 4 slots taken now")), "{out}");
    let text = t.run(&["list"]).ok().stdout;
    assert!(text.contains("2 of 4 slots") && !text.contains("- b "), "{text}");
}

/// `acquire --keepalive D` asks the keep-alive sweep to renew the lease, or the slot, until D
/// from now: the lease carries `keepalive.until_ms`, `get` and `list` mark what is kept alive,
/// and a duration shorter than 3 sweep periods is refused before anything is written.
fn kept_alive_leases_and_slots_are_marked(t: &Target) {
    let now_ms = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let before = now_ms();
    let a = t.run(&["acquire", "kept/plain", "--duration", "3m", "--keepalive", "1h", "--json"]).ok().json();
    let until = u(&a["keepalive"], "until_ms");
    assert!(until >= before + 3_600_000 && until <= now_ms() + 3_600_000, "{a}");
    let got = t.run(&["get", "kept/plain"]).ok().stdout;
    assert!(got.lines().any(|l| l.trim_start().starts_with("keepalive until 20")), "{got}");
    let take = |h: &str, keep: bool| {
        let mut a = vec!["acquire", "kept/pool", "--holder", h, "--duration", "3m", "--slots", "3", "--json"];
        if keep {
            a.extend(["--keepalive", "2h"]);
        }
        t.run(&a).ok().json()
    };
    let kept = take("k", true);
    assert!(u(&kept["keepalive"], "until_ms") >= before + 7_200_000, "{kept}");
    take("p", false);
    let got = t.run(&["get", "kept/pool"]).ok().stdout;
    let line =
        |who: &str| got.lines().find(|l| l.contains(&format!("holder    {who} "))).unwrap_or_else(|| panic!("{got}"));
    assert!(line("k").contains("kept alive until 20") && !line("p").contains("kept alive"), "{got}");
    let listed = t.run(&["list"]).ok().stdout;
    let row =
        |who: &str| listed.lines().find(|l| l.contains(&format!("- {who} "))).unwrap_or_else(|| panic!("{listed}"));
    assert!(row("k").ends_with("kept alive") && !row("p").contains("kept alive"), "{listed}");
    let shown = t.run(&["get", "kept/pool", "--json"]).ok().json();
    let holders = shown["holders"].as_array().unwrap();
    assert!(holders.iter().any(|h| h["holder"] == "k" && h["keepalive"]["until_ms"].is_u64()), "{shown}");
    // Too short to outlive a late sweep: refused, nothing written.
    let r = t.run(&["acquire", "kept/short", "--duration", "60s", "--keepalive", "1h", "--json"]).code(2).json();
    assert_eq!(r["error"], "InvalidRequest", "{r}");
    assert_eq!(t.run(&["get", "kept/short", "--json"]).code(1).json()["error"], "NotFound");
}

leasehold_tests::variants!(sync [
    embedded => &Target::embedded(),
    dynamodb => &Target::dynamo(),
    served => &Target::served(),
]: semaphore_subcommands, operators_see_a_semaphore_as_one, kept_alive_leases_and_slots_are_marked);

#[test]
fn over_http_api_on_dynamodb() {
    let ddb = Target::dynamo();
    let server = cli_support::Server::start(&ddb.args, &ddb.env);
    let dir = leasehold_tests::TempDir::new("cli-http-ddb");
    let t = Target { args: vec!["--url".into(), server.url.clone()], env: vec![], server: Some(server), dir };
    let a = t.run(&["acquire", "ddb/http", "--holder", "h", "--json"]).ok().json();
    let id = a["lease_id"].as_str().unwrap();
    assert_eq!(t.run(&["get", "ddb/http", "--json"]).ok().json()["holder"], "h");
    t.run(&["heartbeat", "ddb/http", "--lease-id", id]).ok();
    t.run(&["release", "ddb/http", "--lease-id", id]).ok();
    assert_eq!(t.run(&["get", "ddb/http", "--json"]).ok().json()["held"], false);
    // The same table seen directly agrees with the server.
    assert_eq!(ddb.run(&["get", "ddb/http", "--json"]).ok().json()["holder"], "h");
}

#[test]
fn store_flags_environment_and_precedence() {
    let t = Target::embedded();
    let db = t.args[1].clone();
    // LEASEHOLD_DB selects the store when no flag does.
    let mut c = clean_command();
    c.env("LEASEHOLD_DB", &db).args(["acquire", "env/k", "--json"]);
    assert_eq!(output(c).ok().json()["holder"], "tester");
    assert_eq!(t.run(&["get", "env/k", "--json"]).ok().json()["held"], true);
    // A flag beats the environment: --db wins over a LEASEHOLD_URL nobody listens on.
    let mut c = clean_command();
    c.env("LEASEHOLD_URL", "http://127.0.0.1:9").args(["get", "env/k", "--db", &db, "--json"]);
    assert_eq!(output(c).ok().json()["key"], "env/k");
    // ... and LEASEHOLD_URL is used when no flag is given: nobody listens, exit 77.
    let mut c = clean_command();
    c.env("LEASEHOLD_URL", "http://127.0.0.1:9").args(["get", "env/k", "--json"]);
    let o = output(c).code(77);
    assert_eq!(o.json()["error"], "StoreUnavailable");
    // The holder flag beats LEASEHOLD_HOLDER.
    assert_eq!(t.run(&["acquire", "env/h", "--holder", "flag", "--json"]).ok().json()["holder"], "flag");
    // Without LEASEHOLD_HOLDER the holder is user@hostname.
    let mut c = clean_command();
    c.env_remove("LEASEHOLD_HOLDER").env("USER", "alice").args(["--db", &db, "acquire", "env/u", "--json"]);
    let holder = output(c).ok().json()["holder"].as_str().unwrap().to_string();
    assert!(holder.starts_with("alice@") && holder.len() > "alice@".len(), "{holder}");
}

#[test]
fn usage_errors_exit_2_with_a_clear_message() {
    let t = Target::embedded();
    let cases: &[(&[&str], &str)] = &[
        (&["acquire", "k", "--duration", "5q"], "invalid duration \"5q\""),
        (&["acquire", "k", "--wait", "1.5s"], "invalid duration"),
        (&["heartbeat", "k", "--lease-id", "x", "--duration", "1d"], "invalid duration \"1d\""),
        (&["run", "k", "--grace", "soon", "--", "true"], "invalid duration"),
        (&["acquire"], "<KEY>"),
        (&["acquire", "k", "--bogus"], "--bogus"),
        (&["frobnicate"], "frobnicate"),
        (&["heartbeat", "k"], "--lease-id"),
        (&["acquire", "k", "--metadata", "[1]"], "JSON object"),
        (&["acquire", "k", "--metadata", "{nope"], "not valid JSON"),
        (&["acquire", "k", "--fail-closed", "--duration", "1m"], "cannot be used with"),
        (&["run", "k", "--wait", "1s", "--skip-if-held", "--", "true"], "cannot be used with"),
        (&["run", "k"], "<CMD>"),
        (&["list", "--limit", "0"], "--limit"),
        (&["serve", "--addr", "nowhere"], "--addr"),
    ];
    for (args, needle) in cases {
        let o = t.run(args).code(2);
        assert!(o.stderr.contains(needle), "{args:?}: expected {needle:?} in {:?}", o.stderr);
        assert!(o.stderr.contains("error"), "{args:?}: {:?}", o.stderr);
    }
    // Conflicting stores and unusable URLs.
    let mut c = clean_command();
    c.args(["--url", "http://127.0.0.1:1", "--db", "/tmp/x.db", "get", "k"]);
    assert!(output(c).code(2).stderr.contains("at most one"));
    let mut c = clean_command();
    c.args(["--url", "https://example.com", "get", "k"]);
    assert!(output(c).code(2).stderr.contains("plain http://"));
    let mut c = clean_command();
    c.args(["--url", "http://127.0.0.1:1", "run", "k", "--", "true"]);
    assert!(output(c).code(2).stderr.contains("not over --url"));
    // A key that could not travel unchanged in an HTTP path is refused before anything is
    // sent (nothing listens on port 1: an attempt would fail as unreachable instead).
    for key in ["jobs/../admin", "a//b", "report?month=11"] {
        let mut c = clean_command();
        c.args(["--url", "http://127.0.0.1:1", "get", key]);
        let o = output(c).code(2);
        assert!(o.stderr.contains("key must not"), "{key}: {:?}", o.stderr);
    }
}

#[test]
fn help_has_examples_and_exit_codes() {
    let t = Target::embedded();
    let main = t.run(&["--help"]).ok().stdout;
    assert!(main.contains("Examples:") && main.contains("LEASEHOLD_URL") && main.contains("75"), "{main}");
    for sub in ["acquire", "heartbeat", "release", "get", "list", "force-release", "serve"] {
        let h = t.run(&[sub, "--help"]).ok().stdout;
        assert!(h.contains("Examples:"), "{sub} --help has no examples: {h}");
    }
    let run = t.run(&["run", "--help"]).ok().stdout;
    for needle in ["75", "76", "77", "--skip-if-held", "LEASEHOLD_FENCE", "Examples:"] {
        assert!(run.contains(needle), "run --help lacks {needle}: {run}");
    }
}

#[test]
fn json_errors_for_an_unreachable_store() {
    // DynamoDB endpoint where nothing listens: StoreUnavailable, exit 77.
    let t = Target {
        args: vec!["--table".into(), "nowhere".into()],
        env: cli_support::dynamo_env("http://127.0.0.1:9"),
        server: None,
        dir: leasehold_tests::TempDir::new("cli-unreach"),
    };
    let mut c = t.cmd(&["get", "k", "--json"]);
    c.env("LEASEHOLD_RETRY_BUDGET_MS", "200");
    let o = output(c).code(77);
    assert_eq!(o.json()["error"], "StoreUnavailable");
}

#[test]
fn configuration_from_the_environment_is_validated() {
    let t = Target::embedded();
    let mut c = t.cmd(&["acquire", "cfg/poll", "--json"]);
    c.env("LEASEHOLD_POLL_MAX_MS", "5");
    let o = output(c).code(2);
    assert_eq!(o.json()["error"], "InvalidRequest");
    assert!(o.json()["message"].as_str().unwrap().contains("LEASEHOLD_POLL_MAX_MS"), "{}", o.json());
    let mut c = t.cmd(&["acquire", "cfg/poll", "--json"]);
    c.env("LEASEHOLD_POLL_MAX_MS", "often");
    assert_eq!(output(c).code(2).json()["error"], "InvalidRequest");
    for bad in ["1", "11", "NaN", "many"] {
        let mut c = t.cmd(&["acquire", "cfg/poll", "--json"]);
        c.env("LEASEHOLD_POLL_ATTEMPTS", bad);
        let o = output(c).code(2);
        assert_eq!(o.json()["error"], "InvalidRequest", "{bad}");
        assert!(o.json()["message"].as_str().unwrap().contains("LEASEHOLD_POLL_ATTEMPTS"), "{bad}: {}", o.json());
    }
    // A valid value is taken: the acquire goes through.
    let mut c = t.cmd(&["acquire", "cfg/poll", "--json"]);
    c.env("LEASEHOLD_POLL_MAX_MS", "50");
    c.env("LEASEHOLD_POLL_ATTEMPTS", "1.2");
    assert_eq!(output(c).code(0).json()["key"], "cfg/poll");
}

/// `get --watch` redraws until interrupted: the refreshes follow the key live, and SIGINT
/// (Ctrl-C) or SIGTERM ends it with exit 0.
fn watch_follows_the_key(t: &Target) {
    use std::io::{BufRead, BufReader};
    let lease = t.run(&["acquire", "watch/k", "--duration", "30s", "--json"]).ok().json();
    let id = lease["lease_id"].as_str().unwrap().to_string();

    let mut c = t.cmd(&["get", "watch/k", "--watch", "--every", "200ms", "--json"]);
    c.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut next = || -> Value { serde_json::from_str(&lines.next().expect("a refresh").unwrap()).unwrap() };
    let started = std::time::Instant::now();
    for _ in 0..2 {
        let v = next();
        assert_eq!((v["held"].as_bool(), v["holder"].as_str()), (Some(true), Some("tester")), "{v}");
        assert!(v.get("lease_id").is_none());
    }
    assert!(started.elapsed() >= std::time::Duration::from_millis(150), "refreshes are --every apart");
    t.run(&["release", "watch/k", "--lease-id", &id]).ok();
    let mut seen_free = false;
    for _ in 0..25 {
        if next()["held"] == false {
            seen_free = true;
            break;
        }
    }
    assert!(seen_free, "the watch never showed the release");
    let kill = |sig: &str, pid: u32| {
        assert!(Command::new("kill").arg(format!("-{sig}")).arg(pid.to_string()).status().unwrap().success())
    };
    kill("INT", child.id());
    let st = child.wait().unwrap();
    assert_eq!(st.code(), Some(0), "Ctrl-C ends a watch with exit 0: {st:?}");

    // Text: a header per refresh, the state under it; SIGTERM ends it too.
    let mut c = t.cmd(&["get", "watch/k", "--watch", "--every", "200ms"]);
    c.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut headers = 0;
    while headers < 2 {
        let line = lines.next().expect("output").unwrap();
        if line.starts_with("every 200ms · ") && line.ends_with("Ctrl-C to stop") {
            headers += 1;
            let state = lines.next().unwrap().unwrap();
            assert!(state.starts_with("\"watch/k\" is free (last holder tester"), "{state}");
        }
    }
    kill("TERM", child.id());
    assert_eq!(child.wait().unwrap().code(), Some(0));

    // --every only goes with --watch.
    assert!(t.run(&["get", "watch/k", "--every", "1s"]).code(2).stderr.contains("--watch"));
}

leasehold_tests::variants!(sync [embedded => &Target::embedded(), served => &Target::served()]: watch_follows_the_key);
