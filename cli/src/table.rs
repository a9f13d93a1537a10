//! `leasehold table create|check`: the DynamoDB lease table as template.yaml declares it
//! (`leasehold::store::table::LEASE_TABLE`), made or checked from the command line, and the
//! check a command on `--table` runs before its first request: only of the parts of the table
//! it uses, at most once an hour per table (the answer is kept on disk), never failing on a
//! throttled control plane, and skipped with `--skip-table-check`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};
use leasehold::store::dynamo::STATE_INDEX;
use leasehold::store::table::{self, Findings, Inspection, Mismatch, Part, Problem};
use leasehold::store::DynamoStore;
use leasehold::ErrorName;
use serde_json::{json, Value};

use crate::output::{self, Failure};
use crate::{exit, Global};

pub const HELP: &str = "\
Examples:
  AWS_ENDPOINT_URL_DYNAMODB=http://localhost:8000 leasehold table create --table leases
  leasehold table check --table leases
  leasehold serve --table leases

create makes the table as template.yaml's LeaseTable (with StateIndexProjection=INCLUDE):
partition key `key` (S); the indexes `keepalive` (ka_shard N, ka_until_ms N; ALL), `state`
(state_shard S, expires_at_ms N; INCLUDE of what a batch's candidate needs) and `queue`
(q_shard N; KEYS_ONLY); TTL on `ttl`; on-demand billing; a NEW_AND_OLD_IMAGES stream (the
lease history's input on AWS); deletion protection and point-in-time recovery (turn them off
with --no-deletion-protection, --no-point-in-time-recovery). It waits until the table and its
indexes are active; an existing table is left as it is and checked.

check names every difference that makes an operation fail (exit 1), the warnings (no stream:
no history on AWS) and notes (an index projecting more than needed, deletion protection or
point-in-time recovery off). Other commands on --table check only the parts they use (the key;
the `state` index for put, next, count, list --state, run --next; `serve` also the `keepalive`
index), at most once an hour per table (kept under $XDG_CACHE_HOME/leasehold, or
LEASEHOLD_CACHE_DIR); --skip-table-check (LEASEHOLD_SKIP_TABLE_CHECK=1) skips it.

The table comes from --table or LEASEHOLD_TABLE. Exit codes: 0 fine, 1 the table differs,
2 no table named, 77 DynamoDB unreachable (or its control plane throttled check).";

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
        /// Create it without deletion protection (a throwaway table)
        #[arg(long = "no-deletion-protection")]
        no_deletion_protection: bool,
        /// Create it without point-in-time recovery (continuous backups)
        #[arg(long = "no-point-in-time-recovery")]
        no_point_in_time_recovery: bool,
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
            TableCmd::Create { timeout, no_deletion_protection, no_point_in_time_recovery } => {
                let spec = table::TableSpec {
                    deletion_protection: !no_deletion_protection,
                    point_in_time_recovery: !no_point_in_time_recovery,
                    ..table::LEASE_TABLE
                };
                match table::create_as(store.client(), &table, &spec, timeout).await {
                    Ok(true) if spec.point_in_time_recovery => {
                        if let Err(e) = table::enable_point_in_time_recovery(store.client(), &table).await {
                            warn(&format!("{e} (the table works without it)"));
                        }
                        Some(true)
                    }
                    Ok(c) => Some(c),
                    Err(e) => return output::failure(g, &Failure::from(e)),
                }
            }
            TableCmd::Check => None,
        };
        let findings = match table::inspect(store.client(), &table).await {
            Err(e) => return output::failure(g, &Failure::from(e)),
            Ok(Inspection::Missing(m)) => return output::failure(g, &mismatch(&table, &Mismatch(vec![m]))),
            Ok(Inspection::Unchecked(why)) => return output::failure(g, &Failure::unreachable(why)),
            Ok(Inspection::Compared(f)) => f,
        };
        Cache::of(&store).save(&findings);
        if !findings.problems.is_empty() {
            return output::failure(g, &mismatch(&table, &Mismatch(findings.problem_messages())));
        }
        let mut notes = findings.notes.clone();
        if table::point_in_time_recovery(store.client(), &table).await == Some(false) {
            notes.push("point-in-time recovery is off: the table cannot be restored to an earlier time".into());
        }
        report_fine(g, &table, created, &findings.warnings, &notes);
        exit::OK
    })
}

fn report_fine(g: &Global, table: &str, created: Option<bool>, warnings: &[String], notes: &[String]) {
    if g.json {
        let mut v = json!({ "table": table, "ok": true, "warnings": warnings, "notes": notes });
        if let Some(c) = created {
            v["created"] = json!(c);
        }
        println!("{v}");
        return;
    }
    for w in warnings {
        eprintln!("leasehold: warning: {w}");
    }
    for n in notes {
        eprintln!("leasehold: note: {n}");
    }
    match created {
        Some(true) => println!("created table {table}: active, with what leasehold needs"),
        Some(false) => println!("table {table} exists and has what leasehold needs"),
        None => println!("table {table} has what leasehold needs"),
    }
}

/// The parts of the table a command uses: its key always; `state` for the work-state
/// commands.
pub fn uses(work_states: bool) -> &'static [Part] {
    if work_states {
        &[Part::Key, Part::Index(STATE_INDEX)]
    } else {
        &[Part::Key]
    }
}

/// How long a check's answer is used before the table is described again.
pub const CHECK_EVERY: Duration = Duration::from_secs(3600);

/// The check a command on `--table` runs before its first request, of the parts of the table
/// it `uses`: a table that lacks one fails the command with the mismatch's message (exit 77).
/// A fresh answer kept on disk ([`CHECK_EVERY`]) that names no problem of those parts skips
/// the requests; one that does is checked again (the table may have been fixed). Warnings
/// (TTL off, a check that could not be made: throttled, no permission) go to stderr; `serve`
/// (`all_warnings`) also logs the stream's.
pub async fn check_before(g: &Global, store: &DynamoStore, uses: &[Part], all_warnings: bool) -> Result<(), Failure> {
    if g.skip_table_check {
        return Ok(());
    }
    let cache = Cache::of(store);
    let now = output::now_ms();
    if let Some(problems) = cache.load(now) {
        if !problems.iter().any(|p| uses.contains(&p.part)) {
            return Ok(());
        }
    }
    let f = match table::inspect(store.client(), store.table()).await {
        Err(e) => return Err(Failure::from(e)),
        Ok(Inspection::Missing(m)) => return Err(Failure::unreachable(Mismatch(vec![m]).message(store.table()))),
        Ok(Inspection::Unchecked(why)) => {
            warn(&why);
            return Ok(());
        }
        Ok(Inspection::Compared(f)) => f,
    };
    cache.save(&f);
    let (fatal, warnings) = f.for_parts(uses);
    warnings.iter().for_each(|w| warn(w));
    if all_warnings {
        f.warnings.iter().for_each(|w| warn(w));
    }
    if fatal.is_empty() {
        Ok(())
    } else {
        Err(Failure::unreachable(Mismatch(fatal).message(store.table())))
    }
}

fn warn(w: &str) {
    eprintln!("leasehold: warning: {w}");
}

/// A check's answer kept on disk, one file per table (named by the endpoint, region, profile
/// and table name): the problems found and when.
struct Cache {
    path: Option<PathBuf>,
    id: Value,
}

impl Cache {
    fn of(store: &DynamoStore) -> Cache {
        let env = |n: &str| std::env::var(n).unwrap_or_default();
        let endpoint = [env("AWS_ENDPOINT_URL_DYNAMODB"), env("AWS_ENDPOINT_URL")].join("|");
        let region = store.client().config().region().map(|r| r.to_string()).unwrap_or_default();
        let id =
            json!({ "table": store.table(), "endpoint": endpoint, "region": region, "profile": env("AWS_PROFILE") });
        let dir = std::env::var_os("LEASEHOLD_CACHE_DIR")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("leasehold")))
            .or_else(|| std::env::var_os("HOME").map(|d| PathBuf::from(d).join(".cache/leasehold")));
        let path = dir.map(|d| d.join(format!("table-check-{:016x}.json", fnv1a(id.to_string().as_bytes()))));
        Cache { path, id }
    }

    /// The problems of a check made less than [`CHECK_EVERY`] before `now_ms` of this table.
    fn load(&self, now_ms: u64) -> Option<Vec<Problem>> {
        let v: Value = serde_json::from_slice(&std::fs::read(self.path.as_ref()?).ok()?).ok()?;
        let at = v["checked_at_ms"].as_u64()?;
        if v["id"] != self.id || at > now_ms || now_ms - at >= CHECK_EVERY.as_millis() as u64 {
            return None;
        }
        v["problems"]
            .as_array()?
            .iter()
            .map(|p| {
                let part = Part::parse(p["part"].as_str()?)?;
                Some(Problem { part, message: p["message"].as_str()?.to_string() })
            })
            .collect()
    }

    /// Keeps `f`'s problems (best effort: a cache that cannot be written only costs a check).
    fn save(&self, f: &Findings) {
        let Some(path) = &self.path else { return };
        let problems: Vec<Value> =
            f.problems.iter().map(|p| json!({ "part": p.part.as_text(), "message": p.message })).collect();
        let v = json!({ "id": self.id, "checked_at_ms": output::now_ms(), "problems": problems });
        let tmp = path.with_extension(format!("{}.tmp", std::process::id()));
        let written = path.parent().is_some_and(|d| std::fs::create_dir_all(d).is_ok())
            && std::fs::write(&tmp, v.to_string()).is_ok()
            && std::fs::rename(&tmp, path).is_ok();
        if !written {
            let _ = std::fs::remove_file(&tmp);
        }
    }
}

/// FNV-1a, 64 bits: a stable file name for a table's cache entry.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}
