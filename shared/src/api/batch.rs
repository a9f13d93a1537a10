//! The work-item operations on every remote interface (DESIGN.md, "Work items and batch
//! leases"): `next` (batch lease) and `put` on the acquire function, `count` on the heartbeat
//! function; over HTTP `POST /leases/next/{state}`, `POST /leases/put/{key+}` and
//! `POST /leases/count/{state}`; by direct invoke the same bodies with `"op"` naming the
//! operation. Release into a state is the release operation's `state` field.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::{parse, Operation, INVOKE_SAFETY_MARGIN};
use crate::error::{Error, Result};
use crate::model::Keepalive;
use crate::protocol::{AcquireOptions, Coordinator};

/// Body of a batch lease (`op: "next"`; over HTTP the state comes from the path).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NextRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    pub holder: String,
    /// Most leases to take, 1..=100 (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_hold_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Map<String, Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keepalive: Option<Keepalive>,
}

/// Body of a put (`op: "put"`; over HTTP the key comes from the path).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PutRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    pub state: String,
    pub holder: String,
}

/// Body of a count (`op: "count"`; over HTTP the state comes from the path).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CountRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
}

/// The `op` of a direct invoke, removed from the payload: `None` when absent (the function's
/// own operation).
pub fn take_op(payload: &mut Value) -> Result<Option<Operation>> {
    let Some(op) = payload.as_object_mut().and_then(|o| o.remove("op")) else { return Ok(None) };
    Ok(Some(match op.as_str() {
        Some("next") => Operation::Next,
        Some("put") => Operation::Put,
        Some("count") => Operation::Count,
        Some("acquire") => Operation::Acquire,
        Some("heartbeat") => Operation::Heartbeat,
        Some("release") => Operation::Release,
        Some("get") => Operation::Get,
        _ => return Err(Error::invalid(format!("unknown op {op}: use next, put or count"))),
    }))
}

/// The HTTP action of each work operation (`POST /leases/{action}/...`).
pub fn operation_of(action: &str) -> Option<Operation> {
    match action {
        "next" => Some(Operation::Next),
        "put" => Some(Operation::Put),
        "count" => Some(Operation::Count),
        _ => None,
    }
}

fn from_path(path: Option<&str>, body: Option<String>, field: &str) -> Result<String> {
    match (path, body) {
        (Some(p), Some(b)) if p != b => {
            Err(Error::invalid(format!("the {field} in the body ({b:?}) differs from the {field} in the path ({p:?})")))
        }
        (Some(p), _) => Ok(p.to_string()),
        (None, Some(b)) => Ok(b),
        (None, None) => Err(Error::invalid(format!("missing field `{field}`"))),
    }
}

/// Runs one work operation (`path`: the state or key from an HTTP path).
pub async fn run(
    coord: &Coordinator,
    op: Operation,
    path: Option<&str>,
    payload: Value,
    remaining: Option<Duration>,
    received: Instant,
) -> Result<Value> {
    match op {
        Operation::Next => {
            let mut payload = payload;
            super::fill_keepalive_until(&mut payload, coord.now_ms());
            let r: NextRequest = parse(payload)?;
            let state = from_path(path, r.state, "state")?;
            let mut wait = r.wait_ms.map(Duration::from_millis);
            if let (Some(w), Some(rem)) = (wait, remaining) {
                coord.config().limits.wait(w)?;
                wait = Some(w.min(rem.saturating_sub(INVOKE_SAFETY_MARGIN)));
            }
            let opts = AcquireOptions {
                wait,
                min_hold: r.min_hold_ms.map(Duration::from_millis),
                metadata: r.metadata,
                keepalive: r.keepalive,
                lease_id: None,
                deadline: super::invoke_deadline(received, remaining),
                slots: None,
            };
            let duration = Some(r.duration_ms.map(Duration::from_millis).unwrap_or(coord.config().default_duration));
            // Fewer keys than asked when `limit` leases of this size could make an answer that a
            // Step Functions task cannot take (checked before anything is leased).
            let limit = r.limit.unwrap_or(1);
            let fit = answer_fits(coord, &state, &r.holder, opts.metadata.as_ref(), opts.keepalive.as_ref());
            let limit = if (1..=crate::validate::MAX_BATCH).contains(&limit) { limit.min(fit) } else { limit };
            let leases = coord.acquire_next(&state, limit, &r.holder, duration, opts).await?;
            let leases: Vec<_> = leases.into_iter().map(|l| l.with_safe_for(received)).collect();
            Ok(json!({ "state": state, "leases": leases }))
        }
        Operation::Put => {
            let r: PutRequest = parse(payload)?;
            let key = from_path(path, r.key, "key")?;
            Ok(serde_json::to_value(coord.put(&key, &r.state, &r.holder).await?).expect("state serialises"))
        }
        Operation::Count => {
            let r: CountRequest = parse(payload)?;
            let state = from_path(path, r.state, "state")?;
            // A deadline: a state too large to count before the caller gives up is answered
            // with an error, not cut off by API Gateway or the function's timeout.
            let count = match remaining.map(|r| r.saturating_sub(INVOKE_SAFETY_MARGIN)) {
                None => coord.count_in_state(&state).await?,
                Some(budget) if budget.is_zero() => return Err(count_deadline(&state)),
                Some(budget) => tokio::time::timeout(budget, coord.count_in_state(&state))
                    .await
                    .map_err(|_| count_deadline(&state))??,
            };
            Ok(json!({ "state": state, "count": count }))
        }
        _ => unreachable!("not a work operation"),
    }
}

fn count_deadline(state: &str) -> Error {
    Error::StoreUnavailable(format!(
        "counting state {state:?} did not finish before the caller's deadline (too many keys to count in one request)"
    ))
}

/// The largest answer `next` gives: Step Functions refuses a task result over 256 KiB
/// (`States.DataLimitExceeded`, which no `Catch` catches), and the BatchProcessor keeps the
/// leases in its state beside its configuration (at most a few KiB). 224 KiB leaves room for
/// both and for the Invoke result's own envelope.
pub const MAX_NEXT_ANSWER_BYTES: usize = 224 * 1024;

/// Bytes of one serialised lease besides its key, holder, state, metadata and keep-alive:
/// field names, numbers and the generated lease_id (checked by a test against the largest).
pub(crate) const LEASE_FIXED_BYTES: usize = 384;

/// How many leases of this request fit in [`MAX_NEXT_ANSWER_BYTES`], at least 1: every key
/// counted at the longest a key may be, JSON-escaped (at most twice its bytes: keys hold no
/// control characters).
pub(crate) fn answer_fits(
    coord: &Coordinator,
    state: &str,
    holder: &str,
    metadata: Option<&Map<String, Value>>,
    keepalive: Option<&Keepalive>,
) -> u32 {
    let json_len = |v: &Value| v.to_string().len();
    let per_lease = LEASE_FIXED_BYTES
        + 2 * coord.config().limits.max_key_bytes
        + json_len(&json!(holder))
        + 2 * json_len(&json!(state))
        + metadata.map_or(0, |m| json_len(&Value::Object(m.clone())))
        + keepalive.map_or(0, |k| json_len(&serde_json::to_value(k).expect("keepalive serialises")));
    // The answer's own fields: {"state": ..., "leases": [...]}.
    let room = MAX_NEXT_ANSWER_BYTES.saturating_sub(64 + json_len(&json!(state)));
    u32::try_from(room / per_lease).unwrap_or(u32::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::SqliteStore;
    use crate::Config;
    use std::sync::Arc;

    fn coordinator(tag: &str) -> Coordinator {
        let dir = std::env::temp_dir().join(format!("leasehold-api-batch-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Coordinator::new(Arc::new(SqliteStore::open(dir.join("leases.db")).unwrap()), Config::default())
    }

    /// 100 keys with 4 KiB of metadata each would answer over 400 KiB, past what a Step
    /// Functions task takes: `next` takes fewer, its answer stays under the bound, and the
    /// keys it did not take stay free in their state.
    #[tokio::test]
    async fn next_answers_fit_a_step_functions_task_result() {
        let c = coordinator("fit");
        // Keys as long as keys may be, with characters JSON escapes.
        let keys: Vec<String> = (0..100).map(|i| format!("{i:03}/{}", "\"\\".repeat(510))).collect();
        for k in &keys {
            c.put(k, "BIG", "producer").await.unwrap();
        }
        let metadata = json!({"blob": "m".repeat(4000)});
        let body = json!({"holder": "h", "limit": 100, "duration_ms": 60000, "metadata": metadata});
        let answer = run(&c, Operation::Next, Some("BIG"), body, None, c.monotonic()).await.unwrap();
        let taken = answer["leases"].as_array().unwrap().len();
        let size = answer.to_string().len();
        assert!(size <= MAX_NEXT_ANSWER_BYTES, "{size} bytes for {taken} leases");
        assert!((10..100).contains(&taken), "{taken}");
        // The bound is not far above what the answer needed (it counts the longest keys).
        assert!(size * 10 > MAX_NEXT_ANSWER_BYTES * 8, "{size}");
        assert_eq!(c.count_in_state("BIG").await.unwrap(), 100, "every key stays in its state");
        let mut held = 0;
        for k in &keys {
            held += usize::from(c.get(k).await.unwrap().held);
        }
        assert_eq!(held, taken, "the keys not taken stay free");
        // Small leases are not cut: 100 of them fit.
        for i in 0..100 {
            c.put(&format!("small/{i}"), "SMALL", "producer").await.unwrap();
        }
        let body = json!({"holder": "h", "limit": 100, "duration_ms": 60000});
        let answer = run(&c, Operation::Next, Some("SMALL"), body, None, c.monotonic()).await.unwrap();
        let small = answer["leases"].as_array().unwrap().len();
        assert!(small >= 90, "{small}: only the longest possible keys are counted against the bound");
    }

    /// A count that cannot finish before the caller's deadline answers StoreUnavailable.
    #[tokio::test]
    async fn count_answers_within_the_callers_deadline() {
        let c = coordinator("count");
        c.put("k", "S", "producer").await.unwrap();
        let ok = run(&c, Operation::Count, Some("S"), json!({}), Some(Duration::from_secs(10)), c.monotonic());
        assert_eq!(ok.await.unwrap()["count"], 1);
        let late = run(&c, Operation::Count, Some("S"), json!({}), Some(INVOKE_SAFETY_MARGIN), c.monotonic()).await;
        assert!(matches!(late, Err(Error::StoreUnavailable(ref m)) if m.contains("deadline")), "{late:?}");
    }
}
