//! `leasehold table create|check`: the DynamoDB lease table as template.yaml declares it
//! (`leasehold::store::table::LEASE_TABLE`), made or checked from the command line, and the
//! check every command on `--table` runs once before its first request.

use std::time::Duration;

use clap::{Args, Subcommand};
use leasehold::store::table::{self, Mismatch};
use leasehold::store::DynamoStore;
use leasehold::ErrorName;
use serde_json::json;

use crate::target::Failure;
use crate::{exit, output, Global};

pub const HELP: &str = "\
Examples:
  AWS_ENDPOINT_URL_DYNAMODB=http://localhost:8000 leasehold table create --table leases
  leasehold table check --table leases
  leasehold serve --table leases

create makes the table exactly as template.yaml's LeaseTable: partition key `key` (S), the
indexes `keepalive` (ka_shard N, ka_until_ms N) and `state` (state_shard S, expires_at_ms N),
both projecting ALL, TTL on `ttl`, on-demand billing, and a NEW_AND_OLD_IMAGES stream (the
lease history's input on AWS). It waits until the table is active; an existing table is left
as it is and checked. check names every difference that makes an operation fail (exit 1).
The table comes from --table or LEASEHOLD_TABLE. Exit codes: 0 fine, 1 the table differs,
2 no table named, 77 DynamoDB unreachable.";

#[derive(Args, Debug)]
pub struct TableArgs {
    #[command(subcommand)]
    pub cmd: TableCmd,
}

#[derive(Subcommand, Debug)]
pub enum TableCmd {
    /// Create the lease table (idempotent) and wait until it is active
    Create {
        /// Give up waiting for the table to become active after this long
        #[arg(long, default_value = "5m", value_parser = crate::duration::parse, value_name = "D")]
        timeout: Duration,
    },
    /// Compare the table with what leasehold needs and name what is missing or different
    Check,
}

fn table_name(g: &Global) -> Result<String, Failure> {
    g.table
        .clone()
        .or_else(|| std::env::var("LEASEHOLD_TABLE").ok())
        .filter(|t| !t.trim().is_empty())
        .ok_or_else(|| Failure::usage("name the table: --table NAME or LEASEHOLD_TABLE"))
}

fn mismatch(table: &str, m: &Mismatch) -> Failure {
    let mut f = Failure::new(ErrorName::StoreUnavailable, m.message(table));
    f.json["problems"] = json!(m.0);
    f.code = exit::FAILED;
    f
}

pub fn main(g: &Global, args: TableArgs) -> i32 {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    rt.block_on(async {
        let table = match table_name(g) {
            Ok(t) => t,
            Err(f) => return output::failure(g, &f),
        };
        let store = DynamoStore::from_env(table.clone(), Duration::from_secs(10)).await;
        let created = match args.cmd {
            TableCmd::Create { timeout } => match table::create(store.client(), &table, timeout).await {
                Ok(c) => Some(c),
                Err(e) => return output::failure(g, &Failure::from(e)),
            },
            TableCmd::Check => None,
        };
        match table::check(store.client(), &table).await {
            Err(e) => output::failure(g, &Failure::from(e)),
            Ok(Err(m)) => output::failure(g, &mismatch(&table, &m)),
            Ok(Ok(warnings)) => {
                if g.json {
                    let mut v = json!({ "table": table, "ok": true, "warnings": warnings });
                    if let Some(c) = created {
                        v["created"] = json!(c);
                    }
                    println!("{v}");
                } else {
                    for w in &warnings {
                        eprintln!("leasehold: warning: {w}");
                    }
                    match created {
                        Some(true) => println!("created table {table}: active, with what leasehold needs"),
                        Some(false) => println!("table {table} exists and has what leasehold needs"),
                        None => println!("table {table} has what leasehold needs"),
                    }
                }
                exit::OK
            }
        }
    })
}

/// The check a command on `--table` runs once before its first request: a table that lacks
/// what the code needs fails the command with the mismatch's message (exit 77); warnings go to
/// stderr.
pub async fn check_at_start(store: &DynamoStore) -> Result<(), Failure> {
    match table::check(store.client(), store.table()).await {
        Ok(Ok(warnings)) => {
            for w in warnings {
                tracing::warn!("{w}");
            }
            Ok(())
        }
        Ok(Err(m)) => Err(Failure::unreachable(m.message(store.table()))),
        Err(e) => Err(Failure::from(e)),
    }
}
