//! API Gateway HTTP API routing, emulated from template.yaml: the routes are read from the
//! template's `HttpApi` events, and a client's request becomes the payload 2.0 event API
//! Gateway would send, or no event at all (API Gateway answers 404 itself). As AWS does it:
//! the path is percent-decoded before matching (a decoded `?` ends it), `{p}` matches one
//! non-empty segment, `{p+}` (last) matches the rest, routes with more literal segments win,
//! `rawPath` is the decoded path and `pathParameters` hold the decoded captures.

use serde_json::{json, Value};

use crate::{repo_root, tools_dir};

/// One route of the template: method, path template, and the function binary it invokes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub method: String,
    pub path: String,
    pub function: String,
}

/// template.yaml as JSON (tests/template_json.py, `raw`).
pub fn raw_template() -> Value {
    let out = std::process::Command::new(tools_dir().join("venv/bin/python"))
        .arg(repo_root().join("tests/template_json.py"))
        .arg("raw")
        .arg(repo_root().join("template.yaml"))
        .output()
        .expect("run tests/template_json.py (scripts/install-test-deps.sh installs its Python)");
    assert!(out.status.success(), "template_json.py: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("template JSON")
}

/// The HTTP API routes of the template.
pub fn routes(template: &Value) -> Vec<Route> {
    let mut routes = vec![];
    for (_, r) in template["Resources"].as_object().expect("Resources") {
        if r["Type"] != "AWS::Serverless::Function" {
            continue;
        }
        let binary = r["Metadata"]["BuildProperties"]["Binary"].as_str().expect("Binary").to_string();
        for (_, e) in r["Properties"]["Events"].as_object().into_iter().flatten() {
            if e["Type"] == "HttpApi" {
                let p = &e["Properties"];
                let path = p["Path"].as_str().expect("Path").to_string();
                let segments: Vec<&str> = path.split('/').collect();
                for (i, s) in segments.iter().enumerate() {
                    assert!(!s.ends_with("+}") || i == segments.len() - 1, "{path}: a greedy variable must be last");
                }
                routes.push(Route {
                    method: p["Method"].as_str().expect("Method").to_string(),
                    path,
                    function: binary.clone(),
                });
            }
        }
    }
    routes
}

/// Percent-decodes `s` once; `None` when the result is not UTF-8 (API Gateway answers 400).
pub fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8(out).ok()
}

/// Percent-encodes a key the way a client puts it in a path: everything but unreserved
/// characters, and `/` too when `slash` is set.
pub fn encode(key: &str, slash: bool) -> String {
    let mut out = String::new();
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') || (b == b'/' && !slash) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Matches a decoded path against a path template; the captures on success.
fn matches(template: &str, path: &str) -> Option<Vec<(String, String)>> {
    let t: Vec<&str> = template.trim_start_matches('/').split('/').collect();
    let p: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let mut captures = vec![];
    for (i, seg) in t.iter().enumerate() {
        if let Some(name) = seg.strip_prefix('{').and_then(|s| s.strip_suffix("+}")) {
            let rest = p.get(i..)?.join("/");
            if rest.is_empty() {
                return None;
            }
            captures.push((name.to_string(), rest));
            return Some(captures);
        }
        let got = p.get(i)?;
        if let Some(name) = seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
            if got.is_empty() {
                return None;
            }
            captures.push((name.to_string(), got.to_string()));
        } else if seg != got {
            return None;
        }
    }
    (t.len() == p.len()).then_some(captures)
}

/// What API Gateway does with a request: the function it invokes and the event, or `None`
/// when no route matches (API Gateway answers 404 without invoking anything).
/// `target`: the request target as the client sends it (percent-encoded path, query).
pub fn request(
    routes: &[Route],
    method: &str,
    target: &str,
    body: Option<&str>,
    time_epoch_ms: u64,
) -> Option<(String, Value)> {
    let (raw_path, query) = target.split_once('?').unwrap_or((target, ""));
    let decoded = percent_decode(raw_path)?;
    // A decoded '?' or '#' ends the path.
    let path = decoded.split(['?', '#']).next().unwrap_or("").to_string();
    let literal = |r: &Route| r.path.split('/').filter(|s| !s.starts_with('{')).count();
    let mut candidates: Vec<(&Route, Vec<(String, String)>)> =
        routes.iter().filter(|r| r.method == method).filter_map(|r| matches(&r.path, &path).map(|c| (r, c))).collect();
    candidates.sort_by_key(|(r, _)| std::cmp::Reverse(literal(r)));
    let (route, captures) = candidates.into_iter().next()?;
    let route_key = format!("{method} {}", route.path);
    let params: serde_json::Map<String, Value> = captures.into_iter().map(|(k, v)| (k, json!(v))).collect();
    let mut ev = json!({
        "version": "2.0",
        "routeKey": route_key,
        "rawPath": path,
        "rawQueryString": query,
        "headers": {"content-type": "application/json", "host": "k7x2m9q4r1.execute-api.us-east-1.amazonaws.com"},
        "requestContext": {
            "accountId": "123456789012", "apiId": "k7x2m9q4r1",
            "domainName": "k7x2m9q4r1.execute-api.us-east-1.amazonaws.com", "domainPrefix": "k7x2m9q4r1",
            "http": {"method": method, "path": path, "protocol": "HTTP/1.1", "sourceIp": "203.0.113.17", "userAgent": "test"},
            "requestId": format!("req-{time_epoch_ms}-{}", params.len()), "routeKey": route_key, "stage": "$default",
            "time": "23/Nov/2026:00:00:00 +0000", "timeEpoch": time_epoch_ms
        },
        "pathParameters": params,
        "isBase64Encoded": false
    });
    if let Some(b) = body {
        ev["body"] = json!(b);
    }
    Some((route.function.clone(), ev))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_like_api_gateway() {
        let routes = vec![
            Route { method: "POST".into(), path: "/leases/{key}/acquire".into(), function: "old".into() },
            Route { method: "POST".into(), path: "/leases/acquire/{key+}".into(), function: "acquire".into() },
            Route { method: "GET".into(), path: "/leases/{key+}".into(), function: "heartbeat".into() },
        ];
        let (f, ev) = request(&routes, "POST", "/leases/acquire/a%2Fb%2541", Some("{}"), 1).unwrap();
        assert_eq!((f.as_str(), ev["pathParameters"]["key"].as_str()), ("acquire", Some("a/b%41")));
        assert_eq!(ev["rawPath"], "/leases/acquire/a/b%41");
        // {key} is one segment: a decoded %2F no longer fits it.
        assert!(request(&routes[..1], "POST", "/leases/a%2Fb/acquire", None, 1).is_none());
        assert_eq!(request(&routes[..1], "POST", "/leases/ab/acquire", None, 1).unwrap().0, "old");
        // A decoded '?' ends the path.
        let (_, ev) = request(&routes, "GET", "/leases/a%3Fb", None, 1).unwrap();
        assert_eq!(ev["pathParameters"]["key"], "a");
        assert!(request(&routes, "DELETE", "/leases/x", None, 1).is_none());
        assert!(request(&routes, "GET", "/leases/", None, 1).is_none());
        assert!(percent_decode("%FF").is_none());
        assert_eq!(percent_decode("%zz%41%").unwrap(), "%zzA%");
    }
}
