//! Configuration from the environment, store selection and logging set-up, shared by the
//! Lambda functions, the local server and the CLI.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::protocol::Config;
use crate::store::{DynamoStore, SqliteStore, Store};

/// The value of environment variable `name` as a `T` (`None`: unset or blank); `what` names
/// the kind of value in the error of one that does not parse.
fn env_parse<T: std::str::FromStr>(name: &str, what: &str) -> Result<Option<T>> {
    match std::env::var(name) {
        Err(_) => Ok(None),
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => v
            .trim()
            .parse::<T>()
            .map(Some)
            .map_err(|_| Error::invalid(format!("environment variable {name}={v:?} is not {what}"))),
    }
}

fn env_u64(name: &str) -> Result<Option<u64>> {
    env_parse(name, "a whole number")
}

/// The decimal number in environment variable `name`, if set (`NaN` and `inf` parse: the
/// caller's range refuses them).
fn env_f64(name: &str) -> Result<Option<f64>> {
    env_parse(name, "a number")
}

/// [`Config`] with overrides from the environment:
/// `LEASEHOLD_DEFAULT_DURATION_MS`, `LEASEHOLD_MIN_DURATION_MS`, `LEASEHOLD_MAX_DURATION_MS`,
/// `LEASEHOLD_MAX_WAIT_MS`, `LEASEHOLD_SKEW_MARGIN_MS`, `LEASEHOLD_TTL_GRACE_S`,
/// `LEASEHOLD_RETRY_BUDGET_MS`, `LEASEHOLD_POLL_MAX_MS` (longest pause between a waiting
/// acquire's attempts; see DESIGN.md, "Contention"), `LEASEHOLD_POLL_ATTEMPTS` (the attempts
/// per acquisition waiters aim at on a key that changes hands quickly, 1.1 to 10, default 2.5;
/// the same place), `LEASEHOLD_SWEEP_PERIOD_MS` (period of
/// the scheduled keep-alive sweep: keep-alive leases must last 3 periods; 0 = no sweep),
/// `LEASEHOLD_DATE_LAG_MS` (allowance for a late store `Date` header in the clock check, 0..=5000;
/// see DESIGN.md, "Clocks"), `LEASEHOLD_STATE_SHARDS` (partitions of the work-state index per state, 1..=64; see
/// DESIGN.md, "Work items and batch leases"), `LEASEHOLD_TERMINAL_STATES` (comma-separated work
/// states whose keys get a TTL, e.g. `DONE,FAILED`) and `LEASEHOLD_TERMINAL_RETENTION_S` (how
/// long they stay; see DESIGN.md, "Terminal states").
pub fn config_from_env() -> Result<Config> {
    let mut c = Config::default();
    let ms = Duration::from_millis;
    if let Some(v) = env_u64("LEASEHOLD_DEFAULT_DURATION_MS")? {
        c.default_duration = ms(v);
    }
    if let Some(v) = env_u64("LEASEHOLD_MIN_DURATION_MS")? {
        c.limits.min_duration = ms(v);
    }
    if let Some(v) = env_u64("LEASEHOLD_MAX_DURATION_MS")? {
        c.limits.max_duration = ms(v);
    }
    if let Some(v) = env_u64("LEASEHOLD_MAX_WAIT_MS")? {
        c.limits.max_wait = ms(v);
    }
    if let Some(v) = env_u64("LEASEHOLD_SKEW_MARGIN_MS")? {
        c.skew_margin = ms(v);
    }
    if let Some(v) = env_u64("LEASEHOLD_TTL_GRACE_S")? {
        c.ttl_grace = Duration::from_secs(v);
    }
    if let Some(v) = env_u64("LEASEHOLD_RETRY_BUDGET_MS")? {
        c.retry_budget = ms(v);
    }
    if let Some(v) = env_u64("LEASEHOLD_POLL_MAX_MS")? {
        if v < 10 {
            return Err(Error::invalid("LEASEHOLD_POLL_MAX_MS must be at least 10"));
        }
        c.poll_max = ms(v);
    }
    if let Some(v) = env_f64("LEASEHOLD_POLL_ATTEMPTS")? {
        if !crate::POLL_ATTEMPTS.contains(&v) {
            return Err(Error::invalid("LEASEHOLD_POLL_ATTEMPTS must be 1.1 to 10"));
        }
        c.poll_attempts = v;
    }
    if let Some(v) = env_u64("LEASEHOLD_SWEEP_PERIOD_MS")? {
        c.limits.keepalive_sweep_period = ms(v);
    }
    if let Some(v) = env_u64("LEASEHOLD_DATE_LAG_MS")? {
        if v > 5_000 {
            return Err(Error::invalid("LEASEHOLD_DATE_LAG_MS must be at most 5000"));
        }
        c.date_lag = ms(v);
    }
    if let Some(v) = env_u64("LEASEHOLD_STATE_SHARDS")? {
        if !(1..=64).contains(&v) {
            return Err(Error::invalid("LEASEHOLD_STATE_SHARDS must be 1 to 64"));
        }
        c.state_shards = v as u32;
    }
    if let Ok(v) = std::env::var("LEASEHOLD_TERMINAL_STATES") {
        let states: Vec<String> = v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_string).collect();
        for s in &states {
            crate::validate::check_state(s)
                .map_err(|e| Error::invalid(format!("LEASEHOLD_TERMINAL_STATES: {s:?}: {e}")))?;
        }
        c.terminal_states = states;
    }
    if let Some(v) = env_u64("LEASEHOLD_TERMINAL_RETENTION_S")? {
        c.terminal_retention = Duration::from_secs(v);
    }
    if c.limits.min_duration > c.limits.max_duration {
        return Err(Error::invalid("LEASEHOLD_MIN_DURATION_MS exceeds LEASEHOLD_MAX_DURATION_MS"));
    }
    if c.default_duration < c.limits.min_duration || c.default_duration > c.limits.max_duration {
        return Err(Error::invalid("LEASEHOLD_DEFAULT_DURATION_MS is outside the duration bounds"));
    }
    Ok(c)
}

/// Which store to use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreChoice {
    /// A DynamoDB table (standard AWS configuration; endpoint from `AWS_ENDPOINT_URL_DYNAMODB`).
    Dynamo { table: String },
    /// The embedded store file.
    Embedded { path: PathBuf },
}

impl StoreChoice {
    /// `table` (a flag) over `LEASEHOLD_TABLE` over the embedded store (`db` over
    /// `LEASEHOLD_DB` over the default path).
    pub fn resolve(table: Option<String>, db: Option<PathBuf>) -> StoreChoice {
        let table = table.or_else(|| std::env::var("LEASEHOLD_TABLE").ok()).filter(|t| !t.trim().is_empty());
        match table {
            Some(table) => StoreChoice::Dynamo { table },
            None => StoreChoice::Embedded { path: db.unwrap_or_else(SqliteStore::default_path) },
        }
    }

    pub async fn open(&self) -> Result<Arc<dyn Store>> {
        match self {
            StoreChoice::Dynamo { table } => {
                Ok(Arc::new(DynamoStore::from_env(table.clone(), Duration::from_secs(3)).await))
            }
            StoreChoice::Embedded { path } => Ok(Arc::new(SqliteStore::open(path)?)),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            StoreChoice::Dynamo { table } => format!("DynamoDB table {table}"),
            StoreChoice::Embedded { path } => format!("embedded store {}", path.display()),
        }
    }
}

/// Log targets (prefixes) capped at `info` whatever `RUST_LOG` says, even a more specific
/// directive: the Lambda runtime logs raw events, the AWS SDK (smithy, hyper, h2) logs the
/// requests and responses on the wire, and both carry lease_ids.
pub(crate) const CAPPED_LOG_TARGETS: [&str; 6] =
    ["lambda_runtime", "aws_smithy", "aws_sdk", "aws_config", "hyper", "h2"];

/// Whether an event of `target` at `level` may be logged (see [`CAPPED_LOG_TARGETS`]).
pub(crate) fn log_allowed(target: &str, level: &tracing::Level) -> bool {
    *level <= tracing::Level::INFO
        || !CAPPED_LOG_TARGETS.iter().any(|p| {
            target
                .strip_prefix(p)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with("::") || rest.starts_with('_'))
        })
}

/// Logging: JSON lines (Lambda, `--log-format json`) or compact text, filtered by
/// `RUST_LOG` (default `info`), to stderr. lease_ids never reach a log line: `LeaseId`'s
/// `Debug` is redacted and no log statement records one.
pub fn init_tracing(json: bool) {
    let _ = tracing::subscriber::set_global_default(subscriber(json, std::io::stderr));
}

/// The subscriber [`init_tracing`] installs, writing to `writer` (tests capture it).
pub fn subscriber<W>(json: bool, writer: W) -> Box<dyn tracing::Subscriber + Send + Sync>
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // No RUST_LOG setting can put a lease_id in the logs: see CAPPED_LOG_TARGETS.
    let cap = tracing_subscriber::filter::filter_fn(|m| log_allowed(m.target(), m.level()));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(writer);
    if json {
        Box::new(
            builder
                .json()
                .with_current_span(true)
                .with_span_list(false)
                .flatten_event(true)
                .without_time()
                .finish()
                .with(cap),
        )
    } else {
        Box::new(builder.compact().with_target(false).finish().with(cap))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing::Level;

    #[test]
    fn wire_logging_is_capped_at_info() {
        for target in [
            "aws_smithy_runtime::client::orchestrator",
            "aws_smithy_http_client",
            "hyper_util::client",
            "h2::codec",
            "lambda_runtime_api_client",
            "aws_sdk_dynamodb::config",
        ] {
            assert!(!log_allowed(target, &Level::DEBUG), "{target}");
            assert!(!log_allowed(target, &Level::TRACE), "{target}");
            assert!(log_allowed(target, &Level::INFO), "{target}");
        }
        assert!(log_allowed("leasehold::protocol", &Level::TRACE));
        assert!(log_allowed("hyperion", &Level::TRACE), "a prefix of a word is not a match");
    }
}
