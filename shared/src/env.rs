//! Configuration from the environment, store selection and logging set-up, shared by the
//! Lambda functions, the local server and the CLI.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::protocol::Config;
use crate::store::{DynamoStore, SqliteStore, Store};

fn env_u64(name: &str) -> Result<Option<u64>> {
    match std::env::var(name) {
        Err(_) => Ok(None),
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => v
            .trim()
            .parse::<u64>()
            .map(Some)
            .map_err(|_| Error::invalid(format!("environment variable {name}={v:?} is not a whole number"))),
    }
}

/// [`Config`] with overrides from the environment:
/// `LEASEHOLD_DEFAULT_DURATION_MS`, `LEASEHOLD_MIN_DURATION_MS`, `LEASEHOLD_MAX_DURATION_MS`,
/// `LEASEHOLD_MAX_WAIT_MS`, `LEASEHOLD_SKEW_MARGIN_MS`, `LEASEHOLD_TTL_GRACE_S`,
/// `LEASEHOLD_RETRY_BUDGET_MS`, `LEASEHOLD_POLL_MAX_MS` (longest pause between a waiting
/// acquire's attempts; see DESIGN.md, "Contention").
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

/// Logging: JSON lines (Lambda, `--log-format json`) or compact text, filtered by
/// `RUST_LOG` (default `info`), to stderr. lease_ids never reach a log line: `LeaseId`'s
/// `Debug` is redacted and no log statement records one.
pub fn init_tracing(json: bool) {
    use tracing_subscriber::EnvFilter;
    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // The Lambda runtime logs raw events (which carry lease_ids) at debug/trace: cap it, so
    // no RUST_LOG setting can put a lease_id in the logs.
    for target in ["lambda_runtime=info", "lambda_runtime_api_client=info"] {
        filter = filter.add_directive(target.parse().expect("static directive"));
    }
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = if json {
        builder.json().with_current_span(true).with_span_list(false).flatten_event(true).without_time().try_init()
    } else {
        builder.compact().with_target(false).try_init()
    };
}
