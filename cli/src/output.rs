//! What commands print: the API's JSON with `--json`, short text otherwise; and a failed
//! command's answer ([`Failure`]) with its exit code.

use std::io::Write;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use leasehold::{Error, ErrorName};
use serde_json::{json, Value};

use crate::duration::{human, rfc3339};
use crate::{exit, Cmd, Global};

/// A failed command: the error JSON printed by `--json` (`{"error": NAME, "message": ...}`) and
/// the exit code of its name.
#[derive(Debug, Clone)]
pub struct Failure {
    pub json: Value,
    pub code: i32,
}

impl Failure {
    pub fn new(name: ErrorName, message: impl Into<String>) -> Failure {
        Failure { json: json!({ "error": name.as_str(), "message": message.into() }), code: code_of(Some(name)) }
    }

    pub fn usage(message: impl Into<String>) -> Failure {
        Failure::new(ErrorName::InvalidRequest, message)
    }

    pub fn unreachable(message: impl Into<String>) -> Failure {
        Failure::new(ErrorName::StoreUnavailable, message)
    }

    /// The error name of the answer.
    pub fn name(&self) -> Option<ErrorName> {
        self.json.get("error").and_then(Value::as_str).and_then(ErrorName::parse)
    }

    pub fn message(&self) -> String {
        self.json.get("message").and_then(Value::as_str).unwrap_or("unknown error").to_string()
    }

    /// From the error body of an HTTP answer (`--url`): the only place a name is read from text.
    pub fn from_json(json: Value) -> Failure {
        let code = code_of(json.get("error").and_then(Value::as_str).and_then(ErrorName::parse));
        Failure { json, code }
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure { json: e.to_json(), code: code_of(Some(e.error_name())) }
    }
}

/// The exit code of an error.
pub fn code_of(name: Option<ErrorName>) -> i32 {
    use ErrorName::*;
    match name {
        Some(LeaseHeld) => exit::HELD,
        Some(NotHolder | NotFound) | None => exit::FAILED,
        Some(InvalidRequest | MethodNotAllowed | UnknownRoute) => exit::USAGE,
        Some(StoreUnavailable | Throttled | OutcomeUnknown | ClockSkew | StoreRefused) => exit::STORE,
    }
}

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn print(s: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{s}");
    let _ = out.flush();
}

/// Prints a failure (JSON on stdout with `--json`, a message on stderr otherwise); returns its exit code.
pub fn failure(g: &Global, f: &Failure) -> i32 {
    if g.json {
        print(&f.json.to_string());
    } else {
        eprintln!("leasehold: error: {}", f.message());
        // What may hold a key under this command's name: release it with this lease_id.
        if let Some(id) = f.json.get("lease_id").and_then(Value::as_str) {
            eprintln!("  lease_id  {id} (this acquire's: release with it if the acquire may have landed)");
        }
        for l in f.json.get("leases").and_then(Value::as_array).into_iter().flatten() {
            let (k, id) = (l.get("key").and_then(Value::as_str), l.get("lease_id").and_then(Value::as_str));
            if let (Some(k), Some(id)) = (k, id) {
                eprintln!("  may hold {k:?} with lease_id {id}");
            }
        }
    }
    f.code
}

/// `2026-01-02T03:04:05.678Z (in 29.9s)` / `(2.0s ago)` / `never (fail-closed)`.
pub fn when(expires_at_ms: Option<u64>) -> String {
    match expires_at_ms {
        None => "never (fail-closed: held until released)".to_string(),
        Some(e) => {
            let now = now_ms();
            if e >= now {
                format!("{} (in {})", rfc3339(e), human(Duration::from_millis(e - now)))
            } else {
                format!("{} ({} ago)", rfc3339(e), human(Duration::from_millis(now - e)))
            }
        }
    }
}

fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v.get(k).and_then(Value::as_str).unwrap_or("?")
}

fn n(v: &Value, k: &str) -> Option<u64> {
    v.get(k).and_then(Value::as_u64)
}

/// `safe_for_ms` as the holder should read it: work stops this long after the request was
/// sent (the coordinator already took off the skew margin and its own time).
fn safe_for(v: &Value) -> String {
    match n(v, "safe_for_ms") {
        Some(ms) => format!(
            "\n  safe for  {} after this command sent its request (stop working by then unless renewed)",
            crate::duration::human(std::time::Duration::from_millis(ms))
        ),
        None => String::new(),
    }
}

pub fn success(g: &Global, cmd: &Cmd, mut v: Value) {
    if matches!(cmd, Cmd::Heartbeat(_)) {
        // The lease_id is printed by acquire only; the holder already has it.
        if let Some(o) = v.as_object_mut() {
            o.remove("lease_id");
        }
    }
    if g.json {
        print(&v.to_string());
        return;
    }
    let text = match cmd {
        Cmd::Acquire(_) => format!(
            "acquired {:?} as {}\n  fence     {}\n  expires   {}{}\n  lease_id  {}\n(pass the lease_id to heartbeat and release; keep it secret)",
            s(&v, "key"),
            s(&v, "holder"),
            n(&v, "fence").unwrap_or(0),
            when(n(&v, "expires_at_ms")),
            safe_for(&v),
            s(&v, "lease_id"),
        ),
        Cmd::Heartbeat(_) => format!(
            "renewed {:?} (fence {})\n  expires   {}{}",
            s(&v, "key"),
            n(&v, "fence").unwrap_or(0),
            when(n(&v, "expires_at_ms")),
            safe_for(&v)
        ),
        Cmd::Release(_) => {
            let free = n(&v, "free_at_ms").unwrap_or(0);
            let released = n(&v, "released_at_ms").unwrap_or(0);
            let mut t = format!("released {:?} (fence {})", s(&v, "key"), n(&v, "fence").unwrap_or(0));
            if v.get("already_released").and_then(Value::as_bool) == Some(true) {
                t.push_str(" (it was already released: nothing changed)");
            }
            if free > released {
                t.push_str(&format!("\n  free at   {} (min-hold)", when(Some(free))));
            }
            t
        }
        Cmd::Get(_) => state(&v),
        Cmd::ForceRelease(a) => match n(&v, "slots") {
            Some(slots) => format!(
                "force-released {:?}: {} evicted; {} of {slots} slots taken now; fence is now {}",
                s(&v, "key"),
                a.fence.map_or_else(|| "every holder".to_string(), |f| format!("the holder with fence {f}")),
                n(&v, "slots_taken").unwrap_or(0),
                n(&v, "fence").unwrap_or(0)
            ),
            None => format!(
                "force-released {:?}: the lease of {} ended; fence is now {}",
                s(&v, "key"),
                s(&v, "holder"),
                n(&v, "fence").unwrap_or(0)
            ),
        },
        Cmd::List(_) => list(&v),
        Cmd::Serve(_) | Cmd::Run(_) | Cmd::Put(_) | Cmd::Next(_) | Cmd::Count(_) | Cmd::Table(_) | Cmd::History(_) => String::new(),
    };
    print(&text);
}

/// Time left until `expires_at_ms`: `12.3s`, `expired`, or `never`.
fn left(expires_at_ms: Option<u64>, now: u64) -> String {
    match expires_at_ms {
        Some(e) if e > now => human(Duration::from_millis(e - now)),
        Some(_) => "expired".into(),
        None => "never".into(),
    }
}

/// A semaphore's live holders, one line each: holder, fence, time left.
fn slot_holders(v: &Value, indent: &str) -> Vec<String> {
    let now = now_ms();
    let holders = v.get("holders").and_then(Value::as_array).cloned().unwrap_or_default();
    holders
        .iter()
        .map(|h| {
            let kept = kept_alive(h).map(|k| format!("  kept alive {k}")).unwrap_or_default();
            format!(
                "{indent}{}  fence {}  {} left{kept}",
                s(h, "holder"),
                n(h, "fence").unwrap_or(0),
                left(n(h, "expires_at_ms"), now)
            )
        })
        .collect()
}

/// What keeps a lease or a slot alive on its holder's behalf, from its `keepalive`: `while
/// EXECUTION runs` (the execution's name, the ARN's last part) and `until TIME` when that is
/// sooner than a year; `None` without a keep-alive.
fn kept_alive(v: &Value) -> Option<String> {
    let ka = v.get("keepalive").filter(|k| k.is_object())?;
    let until = n(ka, "until_ms");
    let execution = ka.get("execution_arn").and_then(Value::as_str).map(|a| a.rsplit(':').next().unwrap_or(a));
    const YEAR_MS: u64 = 365 * 24 * 3600 * 1000;
    let soon = until.filter(|u| u.saturating_sub(now_ms()) < YEAR_MS - 24 * 3600 * 1000);
    Some(match (execution, soon) {
        (Some(e), Some(u)) => format!("while {e} runs, until {}", rfc3339(u)),
        (Some(e), None) => format!("while {e} runs"),
        (None, _) => format!("until {}", until.map_or_else(|| "-".into(), rfc3339)),
    })
}

/// A semaphore's `get`: slots taken of N, then each live holder.
fn semaphore_state(v: &Value, slots: u64) -> String {
    let taken = n(v, "slots_taken").unwrap_or(0);
    let mut t = format!(
        "{:?} is a semaphore: {taken} of {slots} slots taken (last fence {})",
        s(v, "key"),
        n(v, "fence").unwrap_or(0)
    );
    for line in slot_holders(v, "  holder    ") {
        t.push('\n');
        t.push_str(&line);
    }
    if taken > 0 {
        t.push_str(&format!("\n  next free {}", when(n(v, "expires_at_ms"))));
    }
    t
}

fn state(v: &Value) -> String {
    if let Some(slots) = n(v, "slots") {
        return semaphore_state(v, slots);
    }
    let held = v.get("held").and_then(Value::as_bool).unwrap_or(false);
    let mut t = if held {
        format!(
            "{:?} is held by {}\n  fence     {}\n  acquired  {}\n  expires   {}",
            s(v, "key"),
            s(v, "holder"),
            n(v, "fence").unwrap_or(0),
            rfc3339(n(v, "acquired_at_ms").unwrap_or(0)),
            when(n(v, "expires_at_ms"))
        )
    } else {
        let ended = match n(v, "released_at_ms") {
            Some(r) => format!("released {}", rfc3339(r)),
            None => format!("expired {}", when(n(v, "expires_at_ms"))),
        };
        format!(
            "{:?} is free (last holder {}, fence {}, {ended})",
            s(v, "key"),
            s(v, "holder"),
            n(v, "fence").unwrap_or(0)
        )
    };
    if let Some(k) = kept_alive(v).filter(|_| held) {
        t.push_str(&format!("\n  keepalive {k}"));
    }
    if let Some(m) = v.get("metadata").filter(|m| !m.is_null()) {
        t.push_str(&format!("\n  metadata  {m}"));
    }
    if let Some(st) = v.get("state").and_then(Value::as_str) {
        t.push_str(&format!(
            "\n  state     {st} since {}, leased {} times in it",
            rfc3339(n(v, "state_since_ms").unwrap_or(0)),
            n(v, "attempts").unwrap_or(0)
        ));
    }
    t
}

/// One refresh of `get --watch`: a JSON line with `--json`; otherwise the state under a
/// header, after clearing the screen when stdout is a terminal (a blank line between
/// refreshes when it is not).
pub fn watch_frame(g: &Global, key: &str, every: Duration, result: Result<Value, Failure>) {
    use std::io::IsTerminal;
    if g.json {
        match result {
            Ok(v) => print(&v.to_string()),
            Err(f) => print(&f.json.to_string()),
        }
        return;
    }
    let body = match result {
        Ok(v) => state(&v),
        Err(f) => format!("{key:?}: {}", f.message()),
    };
    let head = format!(
        "every {} · {} · Ctrl-C to stop",
        human(every),
        rfc3339(now_ms()).split('.').next().unwrap_or_default().replace('T', " ") + " UTC"
    );
    let clear = if std::io::stdout().is_terminal() { "\x1b[H\x1b[2J" } else { "" };
    print(&format!("{clear}{head}\n{body}\n"));
}

/// The STATE column: `held`, `fail-closed` (held until released) or `free` (it expired since
/// it was listed); a semaphore's `held`, or `full` when every slot is taken.
fn list_state(v: &Value) -> &'static str {
    let held = v.get("held").and_then(Value::as_bool).unwrap_or(false);
    if let Some(slots) = n(v, "slots").filter(|_| held) {
        return if n(v, "slots_taken").unwrap_or(0) >= slots { "full" } else { "held" };
    }
    match n(v, "expires_at_ms") {
        _ if !held => "free",
        None => "fail-closed",
        Some(e) if e <= now_ms() => "free",
        Some(_) => "held",
    }
}

fn list(v: &Value) -> String {
    let items = v.get("leases").and_then(Value::as_array).cloned().unwrap_or_default();
    if items.is_empty() {
        return "no keys are held".to_string();
    }
    let now = now_ms();
    let mut rows: Vec<[String; 5]> = Vec::new();
    for i in &items {
        let Some(slots) = n(i, "slots") else {
            rows.push([
                s(i, "key").to_string(),
                s(i, "holder").to_string(),
                n(i, "fence").unwrap_or(0).to_string(),
                left(n(i, "expires_at_ms"), now),
                list_state(i).to_string(),
            ]);
            continue;
        };
        // A semaphore: one row with its slots taken of N and when the next one frees, then one
        // row per live holder.
        let taken = n(i, "slots_taken").unwrap_or(0);
        rows.push([
            s(i, "key").to_string(),
            format!("{taken} of {slots} slots"),
            n(i, "fence").unwrap_or(0).to_string(),
            left(n(i, "expires_at_ms"), now),
            list_state(i).to_string(),
        ]);
        for h in i.get("holders").and_then(Value::as_array).into_iter().flatten() {
            rows.push([
                String::new(),
                format!("- {}", s(h, "holder")),
                n(h, "fence").unwrap_or(0).to_string(),
                left(n(h, "expires_at_ms"), now),
                if kept_alive(h).is_some() { "kept alive".into() } else { String::new() },
            ]);
        }
    }
    let head = ["KEY", "HOLDER", "FENCE", "EXPIRES IN", "STATE"];
    let mut width = head.map(|h| h.chars().count());
    for r in &rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    // Left-aligned text, right-aligned numbers; padding counts characters, not bytes.
    let pad = |c: &str, w: usize, right: bool| {
        let fill = " ".repeat(w.saturating_sub(c.chars().count()));
        if right {
            format!("{fill}{c}")
        } else {
            format!("{c}{fill}")
        }
    };
    let line = |r: [&str; 5]| {
        [
            pad(r[0], width[0], false),
            pad(r[1], width[1], false),
            pad(r[2], width[2], true),
            pad(r[3], width[3], true),
            r[4].to_string(),
        ]
        .join("  ")
        .trim_end()
        .to_string()
    };
    let mut out = vec![line(head)];
    out.extend(rows.iter().map(|r| line([&r[0], &r[1], &r[2], &r[3], &r[4]])));
    out.join("\n")
}
