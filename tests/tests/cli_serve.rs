//! `leasehold serve`, end to end: its banner, the HTTP API on the wire (including bad input),
//! bounded request bodies, and a clean exit on SIGTERM/SIGINT.

mod cli_support;

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use cli_support::{http, read_response, Server, Target};
use serde_json::Value;

fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"))
}

fn header<'a>(h: &'a [(String, String)], name: &str) -> Option<&'a str> {
    h.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

fn embedded_server() -> (Server, Target) {
    let store = Target::embedded();
    (Server::start(&store.args, &[]), store)
}

#[test]
fn banner_names_the_address_and_a_working_curl_example() {
    let (server, _store) = embedded_server();
    assert!(server.banner[0].contains(&format!("http://{}", server.addr)), "{:?}", server.banner);
    assert!(server.banner[0].contains("embedded store"), "{:?}", server.banner);
    let ex = &server.banner[1];
    assert!(ex.starts_with("try: curl "), "{ex}");
    let post = format!("-X POST {}/leases/acquire/jobs/demo", server.url);
    assert!(ex.contains(&post), "{ex} lacks {post}");
    // Send exactly the example's body to the example's route: it takes the lease.
    let body = ex.split_once("-d '").map(|(_, b)| b.trim_end_matches('\'')).expect("a -d body");
    let (status, headers, answer) = http(
        &server.addr,
        "POST",
        "/leases/acquire/jobs/demo",
        &[("content-type", "application/json")],
        body.as_bytes(),
    );
    assert_eq!(status, 200, "{answer}");
    assert_eq!(header(&headers, "content-type"), Some("application/json"));
    let lease = json(&answer);
    assert_eq!(lease["key"], "jobs/demo");
    assert!(lease["fence"].as_u64().is_some() && lease["lease_id"].as_str().is_some());
}

#[test]
fn routes_and_errors_on_the_wire() {
    let (server, store) = embedded_server();
    let a = &server.addr;
    let (s, _, b) = http(a, "GET", "/health", &[], b"");
    assert_eq!((s, json(&b)["status"].as_str()), (200, Some("ok")));
    let (s, _, b) = http(a, "GET", "/openapi.json", &[], b"");
    assert_eq!(s, 200);
    assert!(json(&b)["openapi"].as_str().is_some_and(|v| v.starts_with('3')));

    // Full cycle with a key containing '/': sent as is or as %2F, the path is decoded once.
    let (s, _, b) = http(a, "POST", "/leases/acquire/a/b", &[], br#"{"holder":"h1","duration_ms":30000}"#);
    assert_eq!(s, 200, "{b}");
    let lease = json(&b);
    assert_eq!(lease["key"], "a/b");
    let id = lease["lease_id"].as_str().unwrap().to_string();
    let (s, h, b) = http(a, "POST", "/leases/acquire/a%2Fb", &[], br#"{"holder":"h2"}"#);
    assert_eq!(s, 409);
    assert_eq!(json(&b)["error"], "LeaseHeld");
    assert!(header(&h, "retry-after").is_some_and(|v| v.parse::<u64>().is_ok()));
    let (s, _, b) = http(a, "GET", "/leases/a/b", &[], b"");
    assert_eq!((s, json(&b)["holder"].as_str()), (200, Some("h1")));
    let hb = format!(r#"{{"lease_id":"{id}"}}"#);
    assert_eq!(http(a, "POST", "/leases/heartbeat/a/b", &[], hb.as_bytes()).0, 200);
    assert_eq!(http(a, "POST", "/leases/release/a%2Fb", &[], hb.as_bytes()).0, 200);
    // Released lease: heartbeat answers 410 NotHolder.
    let (s, _, b) = http(a, "POST", "/leases/heartbeat/a/b", &[], hb.as_bytes());
    assert_eq!((s, json(&b)["error"].as_str()), (410, Some("NotHolder")));
    // The CLI on the same store sees what the server wrote.
    assert_eq!(store.run(&["get", "a/b", "--json"]).ok().json()["held"], false);

    // Malformed JSON and bad fields: 400 with a JSON error body, never a 500.
    let bad: &[&[u8]] = &[
        b"{bad",
        b"",
        b"[]",
        b"null",
        b"\xff\xfe",
        br#"{"holder":""}"#,
        br#"{"holder":"h","duration_ms":"30s"}"#,
        br#"{"holder":"h","duration_ms":-1}"#,
        br#"{"holder":"h","duration_ms":10}"#,
        br#"{"holder":"h","surprise":1}"#,
        br#"{"duration_ms":30000}"#,
        br#"{"holder":"h","key":"other"}"#,
        br#"{"holder":"h","lease_id":"short"}"#,
        br#"{"holder":"h","metadata":[1]}"#,
        br#"{"holder":"h","fail_closed":true,"duration_ms":30000}"#,
        br#"{"holder":"h","wait_ms":99999999999999}"#,
    ];
    for body in bad {
        let (s, h, b) = http(a, "POST", "/leases/acquire/k", &[("content-type", "application/json")], body);
        assert_eq!(s, 400, "body {:?} answered {s} {b}", String::from_utf8_lossy(body));
        assert_eq!(header(&h, "content-type"), Some("application/json"));
        let e = json(&b);
        assert_eq!(e["error"], "InvalidRequest", "{b}");
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    for (body, path) in [(&br#"{"lease_id":"nope"}"#[..], "/leases/heartbeat/k"), (b"{}", "/leases/release/k")] {
        let (s, _, b) = http(a, "POST", path, &[], body);
        assert_eq!((s, json(&b)["error"].as_str()), (400, Some("InvalidRequest")), "{path}: {b}");
    }
    // Unknown routes, wrong methods, undecodable keys, a missing key.
    let (s, _, b) = http(a, "GET", "/nothing/here", &[], b"");
    assert_eq!((s, json(&b)["error"].as_str()), (404, Some("UnknownRoute")));
    let (s, h, b) = http(a, "PUT", "/leases/acquire/k", &[], b"");
    assert_eq!((s, json(&b)["error"].as_str(), header(&h, "allow")), (405, Some("MethodNotAllowed"), Some("POST")));
    let (s, h, b) = http(a, "POST", "/leases/k", &[], b"{}");
    assert_eq!((s, json(&b)["error"].as_str(), header(&h, "allow")), (405, Some("MethodNotAllowed"), Some("GET")));
    // GET takes the whole rest of the path as the key: this is the key "acquire/k".
    let (s, _, b) = http(a, "GET", "/leases/acquire/k", &[], b"");
    assert_eq!((s, json(&b)["error"].as_str()), (404, Some("NotFound")));
    let (s, _, b) = http(a, "DELETE", "/leases/k", &[], b"");
    assert_eq!((s, json(&b)["error"].as_str()), (405, Some("MethodNotAllowed")));
    let (s, _, b) = http(a, "GET", "/leases/%FF%FE", &[], b"");
    assert_eq!((s, json(&b)["error"].as_str()), (400, Some("InvalidRequest")));
    // Keys that could not travel through API Gateway unchanged are refused here too, and a
    // percent sign decoded once stays a percent sign (no second decoding).
    for path in
        ["/leases/a//b", "/leases/a/./b", "/leases/a/%2E%2E/b", "/leases/trailing/", "/leases/a%3Fb", "/leases/a%23b"]
    {
        let (s, _, b) = http(a, "GET", path, &[], b"");
        assert_eq!((s, json(&b)["error"].as_str()), (400, Some("InvalidRequest")), "{path}: {b}");
    }
    let (s, _, b) = http(a, "POST", "/leases/acquire/a%2541", &[], br#"{"holder":"h"}"#);
    assert_eq!((s, json(&b)["key"].as_str()), (200, Some("a%41")), "{b}");
    let (s, _, b) = http(a, "GET", "/leases/aA", &[], b"");
    assert_eq!((s, json(&b)["error"].as_str()), (404, Some("NotFound")), "a%41 is not aA: {b}");
    let (s, _, b) = http(a, "GET", "/leases/never-taken", &[], b"");
    assert_eq!((s, json(&b)["error"].as_str()), (404, Some("NotFound")));
    let long_key = "k".repeat(2000);
    let (s, _, b) = http(a, "GET", &format!("/leases/{long_key}"), &[], b"");
    assert_eq!((s, json(&b)["error"].as_str()), (400, Some("InvalidRequest")));

    // The server is still healthy after all of it.
    assert_eq!(http(a, "GET", "/health", &[], b"").0, 200);
}

#[test]
fn oversized_bodies_are_refused_without_reading_them() {
    let (server, _store) = embedded_server();
    let a = &server.addr;
    let limit = leasehold::api::MAX_BODY_BYTES;

    // A declared length over the limit is answered from the headers alone: the test sends
    // no body at all and still gets its answer.
    let mut s = TcpStream::connect(a).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "POST /leases/acquire/k HTTP/1.1\r\nhost: x\r\ncontent-length: 1073741824\r\n\r\n").unwrap();
    let (status, headers, body) = read_response(&mut s);
    assert_eq!(status, 413, "{body}");
    assert_eq!(json(&body)["error"], "InvalidRequest");
    assert_eq!(header(&headers, "connection"), Some("close"));

    // A chunked body is cut off at the limit.
    let mut s = TcpStream::connect(a).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "POST /leases/acquire/k HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n").unwrap();
    // Written from another thread: the server may answer (and close) mid-body.
    let mut w = s.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        let chunk = vec![b'a'; 16 * 1024];
        for _ in 0..(limit / chunk.len() + 2) {
            if write!(w, "{:x}\r\n", chunk.len()).is_err()
                || w.write_all(&chunk).is_err()
                || w.write_all(b"\r\n").is_err()
            {
                return;
            }
        }
    });
    let (status, _, body) = read_response(&mut s);
    writer.join().unwrap();
    assert_eq!(status, 413, "{body}");

    // Exactly at the limit is read (and then judged on its content).
    let mut big = br#"{"holder":"h","metadata":{"pad":""#.to_vec();
    big.resize(limit - 3, b'x');
    big.extend_from_slice(br#""}}"#);
    assert_eq!(big.len(), limit);
    let (status, _, body) = http(a, "POST", "/leases/acquire/k", &[], &big);
    assert_eq!((status, json(&body)["error"].as_str()), (400, Some("InvalidRequest")), "{body}");
    assert_eq!(http(a, "GET", "/health", &[], b"").0, 200);
}

#[test]
fn keep_alive_connections_serve_many_requests() {
    let (server, _store) = embedded_server();
    let mut s = TcpStream::connect(&server.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let body = br#"{"holder":"ka","duration_ms":30000}"#;
    // Pipelined on one connection: three requests, the last one closing it.
    let mut req = Vec::new();
    for (i, close) in [(0, false), (1, false), (2, true)] {
        let head = format!(
            "POST /leases/acquire/ka{i} HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n{}\r\n",
            body.len(),
            if close { "connection: close\r\n" } else { "" }
        );
        req.extend_from_slice(head.as_bytes());
        req.extend_from_slice(body);
    }
    s.write_all(&req).unwrap();
    let mut raw = String::new();
    std::io::Read::read_to_string(&mut s, &mut raw).unwrap();
    assert_eq!(raw.matches("HTTP/1.1 200 OK").count(), 3, "{raw}");
    for i in 0..3 {
        assert!(raw.contains(&format!("\"key\":\"ka{i}\"")), "{raw}");
    }
}

#[test]
fn sigterm_and_sigint_stop_the_server_with_exit_0() {
    for sig in ["TERM", "INT"] {
        let (mut server, _store) = embedded_server();
        assert_eq!(http(&server.addr, "GET", "/health", &[], b"").0, 200);
        server.proc.signal(sig);
        let out = server.proc.wait(Duration::from_secs(20));
        assert_eq!(out.code, 0, "SIG{sig}: {out:?}");
        assert!(TcpStream::connect(&server.addr).is_err(), "still listening after SIG{sig}");
    }
}

#[test]
fn serve_on_dynamodb_local() {
    let ddb = Target::dynamo();
    let server = Server::start(&ddb.args, &ddb.env);
    assert!(server.banner[0].contains("DynamoDB table"), "{:?}", server.banner);
    let (s, _, b) = http(&server.addr, "POST", "/leases/acquire/ddb", &[], br#"{"holder":"srv","duration_ms":30000}"#);
    assert_eq!(s, 200, "{b}");
    let (s, _, b) = http(&server.addr, "POST", "/leases/acquire/ddb", &[], br#"{"holder":"srv2"}"#);
    assert_eq!((s, json(&b)["error"].as_str()), (409, Some("LeaseHeld")));
    let (s, _, b) = http(&server.addr, "POST", "/leases/acquire/ddb", &[], b"{not json");
    assert_eq!((s, json(&b)["error"].as_str()), (400, Some("InvalidRequest")));
    assert_eq!(ddb.run(&["get", "ddb", "--json"]).ok().json()["holder"], "srv");
}

#[test]
fn listening_twice_on_one_address_fails_clearly() {
    let (server, store) = embedded_server();
    let o = store.run(&["serve", "--addr", &server.addr]).code(1);
    assert!(o.stderr.contains("cannot listen on"), "{o:?}");
}

#[test]
fn operator_routes_list_force_release_and_the_page() {
    let (server, _store) = embedded_server();
    let a = &server.addr;
    let take = |key: &str, holder: &str| {
        let body = format!(r#"{{"holder":"{holder}","duration_ms":30000}}"#);
        let (s, _, b) = http(a, "POST", &format!("/leases/acquire/{key}"), &[], body.as_bytes());
        assert_eq!(s, 200, "{b}");
        json(&b)
    };
    let first = take("jobs/a", "w1");
    take("jobs/b%20b", "w2");
    take("other/c", "w3");
    let keys = |query: &str| -> Vec<String> {
        let (s, _, b) = http(a, "GET", &format!("/leases{query}"), &[], b"");
        assert_eq!(s, 200, "{b}");
        assert!(!b.contains("lease_id"), "a listing never carries a lease_id: {b}");
        let mut k: Vec<String> =
            json(&b)["leases"].as_array().unwrap().iter().map(|l| l["key"].as_str().unwrap().to_string()).collect();
        k.sort();
        k
    };
    assert_eq!(keys(""), ["jobs/a", "jobs/b b", "other/c"]);
    assert_eq!(keys("?prefix=jobs%2F"), ["jobs/a", "jobs/b b"]);
    assert_eq!(keys("?prefix=jobs/b+b"), ["jobs/b b"]);
    assert_eq!(keys("?prefix=jobs/&limit=1").len(), 1);
    for bad in ["?limit=0", "?limit=x", "?prefix=a&prefix=b", "?lease_id=1"] {
        let (s, _, b) = http(a, "GET", &format!("/leases{bad}"), &[], b"");
        assert_eq!((s, json(&b)["error"].as_str()), (400, Some("InvalidRequest")), "{bad}: {b}");
    }
    let (s, h, _) = http(a, "DELETE", "/leases", &[], b"");
    assert_eq!((s, header(&h, "allow")), (405, Some("GET")));

    // Force-release needs application/json: a cross-site form post cannot send it.
    let (s, _, b) = http(a, "POST", "/leases/force-release/jobs/a", &[("content-type", "text/plain")], b"{}");
    assert_eq!((s, json(&b)["error"].as_str()), (415, Some("InvalidRequest")));
    let ct = [("content-type", "application/json")];
    // At most a fence (one holder of a semaphore), a non-negative integer; a plain lease has none.
    for bad in [&br#"{"x":1}"#[..], br#"{"fence":"7"}"#, br#"{"fence":-1}"#, br#"{"fence":1,"x":1}"#, br#"{"fence":1}"#]
    {
        let (s, _, b) = http(a, "POST", "/leases/force-release/jobs/a", &ct, bad);
        assert_eq!((s, json(&b)["error"].as_str()), (400, Some("InvalidRequest")), "{b}");
    }
    let (s, _, b) = http(a, "POST", "/leases/force-release/jobs/a", &ct, b"{}");
    assert_eq!(s, 200, "{b}");
    let freed = json(&b);
    assert_eq!((freed["held"].as_bool(), freed["holder"].as_str()), (Some(false), Some("w1")));
    assert!(freed["fence"].as_u64() > first["fence"].as_u64());
    assert!(freed.get("lease_id").is_none());
    assert_eq!(keys(""), ["jobs/b b", "other/c"]);
    let (s, _, b) = http(a, "POST", "/leases/force-release/never/taken", &ct, b"");
    assert_eq!((s, json(&b)["error"].as_str()), (404, Some("NotFound")));
    let (s, h, _) = http(a, "PUT", "/leases/force-release/jobs/a", &ct, b"");
    assert_eq!((s, header(&h, "allow")), (405, Some("POST")));
    // GET is still a read: the key "force-release/jobs/a" was never taken.
    assert_eq!(http(a, "GET", "/leases/force-release/jobs/a", &[], b"").0, 404);

    // The page: static HTML over these routes.
    let (s, h, b) = http(a, "GET", "/", &[], b"");
    assert_eq!((s, header(&h, "content-type")), (200, Some("text/html; charset=utf-8")));
    assert!(header(&h, "content-security-policy").is_some_and(|c| c.contains("frame-ancestors 'none'")));
    // Its listing reads the server's snapshot (/summary), not a scan per poll (/leases).
    assert!(b.contains("fetch(\"/summary?") && b.contains("/leases/force-release/") && !b.contains("lease_id"));
    assert!(!b.contains("fetch(\"/leases?"), "the page does not scan the store on a timer");
    let (s, h, _) = http(a, "POST", "/", &[], b"");
    assert_eq!((s, header(&h, "allow")), (405, Some("GET")));
}

/// A release that handed the key to a waiting acquire in its own write, retried (its answer
/// lost), answers `already_released` with the released lease's fence, not 409
/// `wrong_lease_id`: over HTTP on `leasehold serve`, both stores. (A waiter caught between two
/// polls when the release comes takes the key by its own acquire instead, after which a stale
/// release is `wrong_lease_id` as documented: such a round is run again, on a new key.)
#[test]
fn a_retried_release_after_a_hand_over_is_already_released() {
    for target in [Target::embedded(), Target::dynamo()] {
        let server = Server::start(&target.args, &target.env);
        let mut handed_over = false;
        for round in 0..4 {
            let (acquire, release) =
                (format!("/leases/acquire/handover/{round}"), format!("/leases/release/handover/{round}"));
            let (s, _, b) = http(&server.addr, "POST", &acquire, &[], br#"{"holder":"a","duration_ms":30000}"#);
            assert_eq!(s, 200, "{b}");
            let (id, fence) = (json(&b)["lease_id"].as_str().unwrap().to_string(), json(&b)["fence"].as_u64().unwrap());
            let (addr, path) = (server.addr.clone(), acquire.clone());
            let waiter = std::thread::spawn(move || {
                http(&addr, "POST", &path, &[], br#"{"holder":"b","duration_ms":30000,"wait_ms":25000}"#)
            });
            // The waiter has tried once and sleeps in the server's line, offering its lease.
            std::thread::sleep(Duration::from_secs(2));
            let body = format!(r#"{{"lease_id":"{id}"}}"#);
            let (s, _, b) = http(&server.addr, "POST", &release, &[], body.as_bytes());
            assert_eq!(s, 200, "{b}");
            let released_at = json(&b)["released_at_ms"].as_u64();
            let (s, _, b) = waiter.join().unwrap();
            assert_eq!((s, json(&b)["holder"].as_str()), (200, Some("b")), "{b}");
            if json(&b)["acquired_at_ms"].as_u64() != released_at {
                continue;
            }
            handed_over = true;
            let (s, _, b) = http(&server.addr, "POST", &release, &[], body.as_bytes());
            assert_eq!(s, 200, "a retried release after the hand-over ({:?}): {b}", target.args);
            assert_eq!((json(&b)["already_released"].as_bool(), json(&b)["fence"].as_u64()), (Some(true), Some(fence)));
            let (s, _, b) = http(&server.addr, "GET", &format!("/leases/handover/{round}"), &[], b"");
            assert_eq!((s, json(&b)["holder"].as_str(), json(&b)["held"].as_bool()), (200, Some("b"), Some(true)));
            break;
        }
        assert!(handed_over, "no round handed the key over in the release's write ({:?})", target.args);
    }
}
