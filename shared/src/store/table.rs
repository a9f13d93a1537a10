//! The lease table's definition, written once: its attribute and index names (the item schema
//! every part of the DynamoDB store names), what `leasehold table create` creates, what
//! `leasehold table check` (and the check of a CLI command or `serve` on `--table`)
//! compares an existing table with, and what a test keeps equal to template.yaml's `LeaseTable`.
//!
//! The comparison ([`compare`]) is a pure function of the definition and the table's
//! `DescribeTable` / `DescribeTimeToLive` answers, so it is tested without a server; each
//! problem names the [`Part`] of the table it is about, so that a command fails only on the
//! parts it uses ([`Findings::for_parts`]). [`create`] and [`inspect`] are the requests around
//! it.

use std::time::Duration;

use aws_sdk_dynamodb::error::ProvideErrorMetadata;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, GlobalSecondaryIndex, IndexStatus, KeySchemaElement, KeyType,
    PointInTimeRecoverySpecification, PointInTimeRecoveryStatus, Projection, ProjectionType, ScalarAttributeType,
    StreamSpecification, StreamViewType, TableDescription, TableStatus, TimeToLiveDescription, TimeToLiveSpecification,
    TimeToLiveStatus,
};
use aws_sdk_dynamodb::Client;

use crate::clock::{Clock, SystemClock};
use crate::error::{Error, Result};

/// Attribute names of the lease table (see DESIGN.md, "Item schema").
pub mod attr {
    pub const KEY: &str = "key";
    pub(crate) const FENCE: &str = "fence";
    pub(crate) const HOLDER: &str = "holder";
    pub(crate) const LEASE_ID: &str = "lease_id";
    pub(crate) const ACQUIRED_AT: &str = "acquired_at_ms";
    pub const EXPIRES_AT: &str = "expires_at_ms";
    pub(crate) const DURATION: &str = "duration_ms";
    pub(crate) const MIN_HOLD_UNTIL: &str = "min_hold_until_ms";
    pub(crate) const RELEASED_AT: &str = "released_at_ms";
    pub(crate) const METADATA: &str = "metadata";
    pub const KA_SHARD: &str = "ka_shard";
    pub const KA_UNTIL: &str = "ka_until_ms";
    pub(crate) const KA_EXECUTION_ARN: &str = "ka_execution_arn";
    pub const TTL: &str = "ttl";
    pub(crate) const POLL: &str = "poll_ms";
    pub(crate) const HANDED_IN: &str = "handed_in";
    pub(crate) const AWAITED_BY: &str = "awaited_by";
    pub(crate) const RENEWED_AT: &str = "renewed_at_ms";
    pub(crate) const QUEUE_HEAD: &str = "queue_head";
    pub(crate) const QUEUE_TAIL: &str = "queue_tail";
    pub(crate) const QUEUE_TAIL_AT: &str = "queue_tail_at_ms";
    pub(crate) const FREED_AT: &str = "freed_at_ms";
    pub(crate) const PENDING_TOKEN: &str = "pending_token";
    pub(crate) const WAITER: &str = "waiter";
    pub(crate) const QUEUE_TAIL_LEASE_ID: &str = "queue_tail_lease_id";
    pub(crate) const RELEASED_LEASE_ID: &str = "released_lease_id";
    pub(crate) const RELEASED_FENCE: &str = "released_fence";
    /// Present only on lease items with queued waiters or an undelivered grant: the sparse
    /// `queue` index (one entry per such key).
    pub const Q_SHARD: &str = "q_shard";
    /// `STATE#n`: the work state and the index partition (present only on keys in a state).
    pub const STATE_SHARD: &str = "state_shard";
    pub(crate) const STATE_SINCE: &str = "state_since_ms";
    pub(crate) const ATTEMPTS: &str = "attempts";
    /// A semaphore (DESIGN.md, "Semaphores"): N, holders counted, revision, the holders' map.
    pub(crate) const SEM_SLOTS: &str = "sem_slots";
    pub(crate) const SEM_TAKEN: &str = "sem_taken";
    pub(crate) const SEM_REV: &str = "sem_rev";
    pub(crate) const SEM_HOLDERS: &str = "sem_holders";
    /// The clock of the last write that cleaned away a holder still counted.
    pub(crate) const SEM_CLEANED_AT: &str = "sem_cleaned_at_ms";

    /// Every attribute above.
    pub const ALL: &[&str] = &[
        KEY,
        FENCE,
        HOLDER,
        LEASE_ID,
        ACQUIRED_AT,
        EXPIRES_AT,
        DURATION,
        MIN_HOLD_UNTIL,
        RELEASED_AT,
        METADATA,
        KA_SHARD,
        KA_UNTIL,
        KA_EXECUTION_ARN,
        TTL,
        POLL,
        HANDED_IN,
        AWAITED_BY,
        RENEWED_AT,
        QUEUE_HEAD,
        QUEUE_TAIL,
        QUEUE_TAIL_AT,
        FREED_AT,
        PENDING_TOKEN,
        WAITER,
        QUEUE_TAIL_LEASE_ID,
        RELEASED_LEASE_ID,
        RELEASED_FENCE,
        Q_SHARD,
        STATE_SHARD,
        STATE_SINCE,
        ATTEMPTS,
        SEM_SLOTS,
        SEM_TAKEN,
        SEM_REV,
        SEM_HOLDERS,
        SEM_CLEANED_AT,
    ];

    /// The attributes that are DynamoDB reserved words, so an expression must name them through
    /// an `ExpressionAttributeNames` alias. The others are written as they are: every alias is
    /// work for the server on every request (DESIGN.md has the figure), and a test checks this
    /// list against DynamoDB Local.
    pub const RESERVED: &[&str] = &[KEY, TTL];
}

/// Name of the sparse keep-alive index (partition `ka_shard`, sort `ka_until_ms`).
pub const KEEPALIVE_INDEX: &str = "keepalive";

/// Name of the sparse work-state index (partition `state_shard`, sort `expires_at_ms`).
pub const STATE_INDEX: &str = "state";

/// What the work-state index projects besides its keys and the table's (`key`, `state_shard`,
/// `expires_at_ms`): what a batch's candidate is judged and taken by, nothing more (an
/// `INCLUDE` projection; DESIGN.md, "How one state scales"). `count` reads nothing but the
/// keys; `list --state` reads the items themselves.
pub const STATE_INDEX_ATTRIBUTES: &[&str] = &[
    attr::FENCE,
    attr::HOLDER,
    attr::LEASE_ID,
    attr::ACQUIRED_AT,
    attr::MIN_HOLD_UNTIL,
    attr::RELEASED_AT,
    attr::STATE_SINCE,
    attr::ATTEMPTS,
];

/// Name of the sparse queue index (partition `q_shard`, keys only): one entry per key with
/// queued waiters or an undelivered grant.
pub const QUEUE_INDEX: &str = "queue";

/// A global secondary index the code queries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexSpec {
    pub name: &'static str,
    /// Partition key: (attribute, DynamoDB scalar type "S" | "N").
    pub hash: (&'static str, &'static str),
    /// Sort key, if the index has one.
    pub range: Option<(&'static str, &'static str)>,
    /// "ALL": the code reads whole items from the index; "KEYS_ONLY": only the keys;
    /// "INCLUDE": the keys and [`IndexSpec::non_key`].
    pub projection: &'static str,
    /// The non-key attributes an "INCLUDE" projection projects (empty for the others).
    pub non_key: &'static [&'static str],
    /// What fails without the index (named by `table check`).
    pub used_by: &'static str,
}

/// The lease table as the code needs it (and as template.yaml declares it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableSpec {
    /// Partition key (string); the table has no sort key.
    pub key: &'static str,
    pub indexes: &'static [IndexSpec],
    /// The TTL attribute (epoch seconds).
    pub ttl: &'static str,
    /// "PAY_PER_REQUEST" (on-demand).
    pub billing: &'static str,
    /// The stream the history function reads: "NEW_AND_OLD_IMAGES" (DESIGN.md, "Lease history");
    /// empty: none ([`create_as`] of a table for DynamoDB Local).
    pub stream: &'static str,
    /// Deletion protection (the table holds every key's last fence: deleting it lets fences
    /// restart from the clock and drops every lease held).
    pub deletion_protection: bool,
    /// Point-in-time recovery (continuous backups), as template.yaml enables it (the CLI's
    /// `table create` turns it on after [`create_as`]: [`enable_point_in_time_recovery`]).
    pub point_in_time_recovery: bool,
}

/// The lease table.
pub const LEASE_TABLE: TableSpec = TableSpec {
    key: attr::KEY,
    indexes: &[
        IndexSpec {
            name: KEEPALIVE_INDEX,
            hash: (attr::KA_SHARD, "N"),
            range: Some((attr::KA_UNTIL, "N")),
            projection: "ALL",
            non_key: &[],
            used_by: "the keep-alive sweep (acquires with a keepalive are never renewed) and queued acquires \
                      (waiters are never found: POST /leases/acquire with a task_token)",
        },
        IndexSpec {
            name: STATE_INDEX,
            hash: (attr::STATE_SHARD, "S"),
            range: Some((attr::EXPIRES_AT, "N")),
            projection: "INCLUDE",
            non_key: STATE_INDEX_ATTRIBUTES,
            used_by: "work items: `next` (batch leases, POST /leases/next), `count` (POST /leases/count) \
                      and `list --state` fail",
        },
        IndexSpec {
            name: QUEUE_INDEX,
            hash: (attr::Q_SHARD, "N"),
            range: None,
            projection: "KEYS_ONLY",
            non_key: &[],
            used_by: "the queue sweep (a queued key whose holder crashed, or whose grant was not delivered, \
                      is never served by the scheduled run)",
        },
    ],
    ttl: attr::TTL,
    billing: "PAY_PER_REQUEST",
    stream: "NEW_AND_OLD_IMAGES",
    deletion_protection: true,
    point_in_time_recovery: true,
};

/// The part of the table a problem is about, and so which operations fail with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Part {
    /// The table itself and its key: every operation.
    Key,
    /// One of the indexes ([`LEASE_TABLE`]'s `indexes`, by name).
    Index(&'static str),
    /// TTL on the `ttl` attribute: nothing fails without it, but nothing is ever deleted.
    Ttl,
}

impl Part {
    /// "key", "ttl" or "index:NAME" (the CLI's cache of a check writes it).
    pub fn as_text(self) -> String {
        match self {
            Part::Key => "key".into(),
            Part::Ttl => "ttl".into(),
            Part::Index(n) => format!("index:{n}"),
        }
    }

    /// [`Part::as_text`] read back; an index [`LEASE_TABLE`] does not have is `None`.
    pub fn parse(s: &str) -> Option<Part> {
        match s {
            "key" => Some(Part::Key),
            "ttl" => Some(Part::Ttl),
            _ => {
                let name = s.strip_prefix("index:")?;
                LEASE_TABLE.indexes.iter().find(|i| i.name == name).map(|i| Part::Index(i.name))
            }
        }
    }
}

/// One difference that makes operations fail: the part it is about and the message naming
/// what fails.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub part: Part,
    pub message: String,
}

impl TableSpec {
    /// Every attribute a key schema names, with its type: the table's `AttributeDefinitions`.
    pub fn attributes(&self) -> Vec<(&'static str, &'static str)> {
        let mut v = vec![(self.key, "S")];
        for i in self.indexes {
            for a in std::iter::once(i.hash).chain(i.range) {
                if !v.contains(&a) {
                    v.push(a);
                }
            }
        }
        v
    }
}

/// ", sort NAME TYPE" for an index with a sort key, nothing for one without.
fn sort_text(i: &IndexSpec) -> String {
    i.range.map(|(n, t)| format!(", sort {n} {t}")).unwrap_or_default()
}

fn scalar(t: &str) -> ScalarAttributeType {
    if t == "N" {
        ScalarAttributeType::N
    } else {
        ScalarAttributeType::S
    }
}

/// The index's `Projection`: its type, and for "INCLUDE" its non-key attributes.
pub fn projection(i: &IndexSpec) -> Projection {
    let non_key = (!i.non_key.is_empty()).then(|| i.non_key.iter().map(|a| a.to_string()).collect());
    Projection::builder().projection_type(ProjectionType::from(i.projection)).set_non_key_attributes(non_key).build()
}

fn built<T>(r: std::result::Result<T, aws_sdk_dynamodb::error::BuildError>) -> Result<T> {
    r.map_err(|e| Error::StoreUnavailable(format!("table definition: {e}")))
}

fn sdk_err<E: ProvideErrorMetadata + std::error::Error + 'static>(what: &str, table: &str, e: &E) -> Error {
    match e.code() {
        Some(code) => Error::StoreUnavailable(format!("{what} {table}: {code}: {}", e.message().unwrap_or(""))),
        None => Error::StoreUnavailable(format!(
            "{what} {table}: {}",
            aws_smithy_types::error::display::DisplayErrorContext(e)
        )),
    }
}

/// Creates `table` as [`LEASE_TABLE`] says (on-demand, key schema, the indexes, the stream),
/// waits until it and its indexes are active (at most `wait`), and enables TTL. Idempotent: an
/// existing table is left as it is (check it with [`inspect`]). Returns whether it created it.
pub async fn create(client: &Client, table: &str, wait: Duration) -> Result<bool> {
    create_as(client, table, &LEASE_TABLE, wait).await
}

/// [`create`] of `spec` (`DynamoStore::create_table` leaves the stream, or also the indexes,
/// out of the tables it makes on DynamoDB Local). An empty `spec.stream`: no stream.
pub async fn create_as(client: &Client, table: &str, spec: &TableSpec, wait: Duration) -> Result<bool> {
    let ks = |n: &str, t: KeyType| KeySchemaElement::builder().attribute_name(n).key_type(t).build();
    let mut req = client
        .create_table()
        .table_name(table)
        .billing_mode(BillingMode::from(spec.billing))
        .deletion_protection_enabled(spec.deletion_protection)
        .key_schema(built(ks(spec.key, KeyType::Hash))?);
    if !spec.stream.is_empty() {
        req = req.stream_specification(built(
            StreamSpecification::builder()
                .stream_enabled(true)
                .stream_view_type(StreamViewType::from(spec.stream))
                .build(),
        )?);
    }
    for (name, ty) in spec.attributes() {
        req = req.attribute_definitions(built(
            AttributeDefinition::builder().attribute_name(name).attribute_type(scalar(ty)).build(),
        )?);
    }
    for i in spec.indexes {
        let mut gsi =
            GlobalSecondaryIndex::builder().index_name(i.name).key_schema(built(ks(i.hash.0, KeyType::Hash))?);
        if let Some(range) = i.range {
            gsi = gsi.key_schema(built(ks(range.0, KeyType::Range))?);
        }
        let gsi = gsi.projection(projection(i)).build();
        req = req.global_secondary_indexes(built(gsi)?);
    }
    let created = match req.send().await {
        Ok(_) => true,
        Err(e) if e.code() == Some("ResourceInUseException") => false,
        Err(e) => return Err(sdk_err("create table", table, &e)),
    };
    let deadline = SystemClock.now() + wait;
    loop {
        let d = client.describe_table().table_name(table).send().await.map_err(|e| sdk_err("describe", table, &e))?;
        let t = d.table().cloned().unwrap_or_else(|| TableDescription::builder().build());
        let active = t.table_status() == Some(&TableStatus::Active)
            && t.global_secondary_indexes().iter().all(|g| g.index_status() == Some(&IndexStatus::Active));
        if active {
            break;
        }
        if SystemClock.now() >= deadline {
            return Err(Error::StoreUnavailable(format!("table {table} did not become active within {wait:?}")));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let ttl = built(TimeToLiveSpecification::builder().attribute_name(spec.ttl).enabled(true).build())?;
    match client.update_time_to_live().table_name(table).time_to_live_specification(ttl).send().await {
        Ok(_) => {}
        // Already enabled (on this attribute: `check` says so if on another).
        Err(e) if e.code() == Some("ValidationException") => {}
        Err(e) => return Err(sdk_err("enable TTL on", table, &e)),
    }
    Ok(created)
}

/// Turns point-in-time recovery on (`UpdateContinuousBackups`), as `spec.point_in_time_recovery`
/// asks of a table [`create_as`] made. A failure is the caller's warning: the table works
/// without it (DynamoDB Local, for one, has no backups).
pub async fn enable_point_in_time_recovery(client: &Client, table: &str) -> std::result::Result<(), String> {
    let pitr = PointInTimeRecoverySpecification::builder()
        .point_in_time_recovery_enabled(true)
        .build()
        .map_err(|e| e.to_string())?;
    let res = client.update_continuous_backups().table_name(table).point_in_time_recovery_specification(pitr);
    res.send().await.map(|_| ()).map_err(|e| sdk_err("enable point-in-time recovery on", table, &e).to_string())
}

/// Whether point-in-time recovery is on (`DescribeContinuousBackups`; `table check` only: the
/// checks of commands leave it alone). `None`: it could not be read (no permission, or a server
/// without backups, such as DynamoDB Local).
pub async fn point_in_time_recovery(client: &Client, table: &str) -> Option<bool> {
    let d = client.describe_continuous_backups().table_name(table).send().await.ok()?;
    let pitr = d.continuous_backups_description()?.point_in_time_recovery_description()?;
    Some(pitr.point_in_time_recovery_status() == Some(&PointInTimeRecoveryStatus::Enabled))
}

/// What a check found wrong with a table ([`Findings::problems`], or no such table): one line per
/// difference, in the order an operator would fix them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch(pub Vec<String>);

impl Mismatch {
    /// The message `table check`, `serve --table` and the CLI print.
    pub fn message(&self, table: &str) -> String {
        format!(
            "table {table} is not the lease table leasehold needs ({} problem{}; `leasehold table create` makes a correct one):\n  - {}",
            self.0.len(),
            if self.0.len() == 1 { "" } else { "s" },
            self.0.join("\n  - ")
        )
    }
}

/// What [`compare`] found: problems (the operations using their part fail), warnings (it works,
/// something is lost) and notes (it works; worth knowing when checking the table by hand:
/// an index projecting more than needed, deletion protection off).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Findings {
    pub problems: Vec<Problem>,
    pub warnings: Vec<String>,
    pub notes: Vec<String>,
}

impl Findings {
    /// The problems' messages.
    pub fn problem_messages(&self) -> Vec<String> {
        self.problems.iter().map(|p| p.message.clone()).collect()
    }

    /// What a command that uses `parts` of the table makes of these findings: the messages it
    /// fails with (problems of those parts), and the warning it prints (a TTL problem: nothing
    /// fails without TTL, the table only grows). Problems of parts the command does not use,
    /// and [`Findings::warnings`] (the stream, which only the history on AWS reads), are none of
    /// its business.
    pub fn for_parts(&self, parts: &[Part]) -> (Vec<String>, Vec<String>) {
        let fatal = self.problems.iter().filter(|p| parts.contains(&p.part)).map(|p| p.message.clone()).collect();
        let warnings = self.problems.iter().filter(|p| p.part == Part::Ttl).map(|p| p.message.clone()).collect();
        (fatal, warnings)
    }
}

/// Compares a table (its `DescribeTable` and `DescribeTimeToLive` answers) with `spec`. Only
/// what the code depends on is a problem: key schema, attribute types of keys, the indexes'
/// keys and projections, TTL. A stream without both images is a warning (only the lease
/// history, fed by it on AWS, is lost). Billing mode is not compared (a provisioned table
/// works).
pub fn compare(spec: &TableSpec, t: &TableDescription, ttl: Option<&TimeToLiveDescription>) -> Findings {
    let types: Vec<(String, String)> = t
        .attribute_definitions()
        .iter()
        .map(|d| (d.attribute_name().to_string(), d.attribute_type().as_str().to_string()))
        .collect();
    let mut f = Findings { problems: key_problems(spec, t, &types), ..Default::default() };
    for i in spec.indexes {
        let one = index_findings(i, t, &types);
        f.problems.extend(one.problems);
        f.warnings.extend(one.warnings);
        f.notes.extend(one.notes);
    }
    f.problems.extend(ttl_problem(spec, ttl).map(|message| Problem { part: Part::Ttl, message }));
    f.warnings.extend(stream_warning(spec, t));
    if spec.deletion_protection && t.deletion_protection_enabled() != Some(true) {
        f.notes.push(
            "deletion protection is off: deleting the table drops every lease held and lets fences restart \
             from the clock (`aws dynamodb update-table --deletion-protection-enabled`)"
                .into(),
        );
    }
    f
}

/// A key schema as (attribute, "HASH" | "RANGE") pairs.
fn keys(ks: &[KeySchemaElement]) -> Vec<(String, String)> {
    ks.iter().map(|k| (k.attribute_name().to_string(), k.key_type().as_str().to_string())).collect()
}

/// The table's own key: `spec.key`, a string, partition key only.
fn key_problems(spec: &TableSpec, t: &TableDescription, types: &[(String, String)]) -> Vec<Problem> {
    let want_key = vec![(spec.key.to_string(), "HASH".to_string())];
    let have_key = keys(t.key_schema());
    if have_key != want_key || type_in(types, spec.key) != Some("S") {
        return vec![Problem {
            part: Part::Key,
            message: format!(
                "key schema is {} but must be `{}` (string, partition key only): no operation works",
                describe_keys(&have_key, types),
                spec.key
            ),
        }];
    }
    vec![]
}

/// One index: present, with the keys (and their types) and the projection the code queries.
/// An index that projects more than the code needs (`ALL` where `INCLUDE` is enough, or an
/// `INCLUDE` of more attributes) works and is a note: its reads cost more.
fn index_findings(i: &IndexSpec, t: &TableDescription, types: &[(String, String)]) -> Findings {
    let problem = |message: String| Problem { part: Part::Index(i.name), message };
    let Some(g) = t.global_secondary_indexes().iter().find(|g| g.index_name() == Some(i.name)) else {
        return Findings {
            problems: vec![problem(format!(
                "index `{}` is missing (partition {} {}{}, projection {}): {}",
                i.name,
                i.hash.0,
                i.hash.1,
                sort_text(i),
                projection_text(i.projection, i.non_key),
                i.used_by
            ))],
            ..Default::default()
        };
    };
    let mut out = Findings::default();
    let mut want = vec![(i.hash.0.to_string(), "HASH".to_string())];
    want.extend(i.range.map(|r| (r.0.to_string(), "RANGE".to_string())));
    let have = keys(g.key_schema());
    let type_of = |n: &str| type_in(types, n);
    let types_ok = type_of(i.hash.0) == Some(i.hash.1) && i.range.is_none_or(|r| type_of(r.0) == Some(r.1));
    if have != want || !types_ok {
        out.problems.push(problem(format!(
            "index `{}` has keys {} but needs partition {} {}{}: {}",
            i.name,
            describe_keys(&have, types),
            i.hash.0,
            i.hash.1,
            sort_text(i),
            i.used_by
        )));
    }
    let projection = g.projection().and_then(|p| p.projection_type()).map(|p| p.as_str()).unwrap_or("none");
    let included: Vec<&str> =
        g.projection().map(|p| p.non_key_attributes().iter().map(String::as_str).collect()).unwrap_or_default();
    let have_text = projection_text(projection, &included);
    let want_text = projection_text(i.projection, i.non_key);
    match (i.projection, projection) {
        (w, h) if w == h && w != "INCLUDE" => {}
        ("INCLUDE", "ALL") => out.notes.push(format!(
            "index `{}` projects ALL where {want_text} is enough: it works, but its Queries read whole items \
             (about four times the read units; DESIGN.md, \"How one state scales\"; template.yaml's \
             StateIndexProjection)",
            i.name
        )),
        ("INCLUDE", "INCLUDE") => {
            let missing: Vec<&str> = i.non_key.iter().copied().filter(|a| !included.contains(a)).collect();
            if !missing.is_empty() {
                out.problems.push(problem(format!(
                    "index `{}` projects {have_text} but needs {want_text} (missing {}): {}",
                    i.name,
                    missing.join(", "),
                    i.used_by
                )));
            } else if included.len() > i.non_key.len() {
                out.notes.push(format!(
                    "index `{}` projects {have_text} where {want_text} is enough: it works, its reads cost more",
                    i.name
                ));
            }
        }
        _ => out
            .problems
            .push(problem(format!("index `{}` projects {have_text} but needs {want_text}: {}", i.name, i.used_by))),
    }
    out
}

/// A projection as named in messages: its type, and an `INCLUDE`'s attributes.
fn projection_text(projection: &str, non_key: &[&str]) -> String {
    if projection == "INCLUDE" {
        format!("INCLUDE ({})", non_key.join(", "))
    } else {
        projection.to_string()
    }
}

/// TTL: enabled (or being enabled) on `spec.ttl`.
fn ttl_problem(spec: &TableSpec, ttl: Option<&TimeToLiveDescription>) -> Option<String> {
    match ttl {
        Some(d)
            if d.time_to_live_status() == Some(&TimeToLiveStatus::Enabled)
                || d.time_to_live_status() == Some(&TimeToLiveStatus::Enabling) =>
        {
            (d.attribute_name() != Some(spec.ttl)).then(|| {
                format!(
                    "TTL is on attribute `{}` but must be on `{}`: released and expired items are never deleted",
                    d.attribute_name().unwrap_or("?"),
                    spec.ttl
                )
            })
        }
        _ => Some(format!(
            "TTL is not enabled on `{}`: released and expired items are never deleted (the table only grows)",
            spec.ttl
        )),
    }
}

/// The stream: only the lease history (on AWS) is lost without both images, so a warning.
fn stream_warning(spec: &TableSpec, t: &TableDescription) -> Option<String> {
    let stream = t.stream_specification();
    let view = stream.filter(|s| s.stream_enabled()).and_then(|s| s.stream_view_type()).map(|v| v.as_str());
    (view != Some(spec.stream)).then(|| {
        format!(
            "stream is {} instead of {}: the lease history on AWS (the history function) receives nothing",
            view.unwrap_or("off"),
            spec.stream
        )
    })
}

fn type_in<'a>(types: &'a [(String, String)], n: &str) -> Option<&'a str> {
    types.iter().find(|(a, _)| a == n).map(|(_, t)| t.as_str())
}

fn describe_keys(ks: &[(String, String)], types: &[(String, String)]) -> String {
    if ks.is_empty() {
        return "none".into();
    }
    ks.iter()
        .map(|(n, k)| format!("{n} {} ({})", type_in(types, n).unwrap_or("?"), k.to_lowercase()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What [`inspect`] learned of a table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inspection {
    /// Described, and compared with [`LEASE_TABLE`].
    Compared(Findings),
    /// There is no such table: the message says how to make one.
    Missing(String),
    /// Not checked, and why (a warning, not a failure: the check is a help, not a gate): no
    /// permission to describe the table (a role may only read and write items), or the control
    /// plane throttled the describe calls past the client's retries (its quota is per account,
    /// shared with every other tool describing tables).
    Unchecked(String),
}

/// The error codes of a throttled control-plane call.
fn throttled(code: Option<&str>) -> bool {
    matches!(
        code,
        Some("ThrottlingException" | "LimitExceededException" | "RequestLimitExceeded" | "ThrottledException")
    )
}

/// Describes `table` (`DescribeTable`, `DescribeTimeToLive`: two control-plane calls) and
/// compares it with [`LEASE_TABLE`]. `Err` only when DynamoDB cannot be reached or answers an
/// error other than those [`Inspection`] names.
pub async fn inspect(client: &Client, table: &str) -> Result<Inspection> {
    let unchecked = |what: &str, code: Option<&str>| {
        let why = if throttled(code) { "the control plane throttled the request" } else { "no permission" };
        Inspection::Unchecked(format!("{what} {table}: {why}; its definition is not checked"))
    };
    let d = match client.describe_table().table_name(table).send().await {
        Ok(d) => d,
        Err(e) if e.code() == Some("ResourceNotFoundException") => {
            return Ok(Inspection::Missing(format!(
                "table {table} does not exist: create it with `leasehold table create --table {table}` \
                 (or deploy template.yaml)"
            )))
        }
        Err(e) if e.code() == Some("AccessDeniedException") || throttled(e.code()) => {
            return Ok(unchecked("could not describe table", e.code()));
        }
        Err(e) => return Err(sdk_err("describe", table, &e)),
    };
    let ttl = match client.describe_time_to_live().table_name(table).send().await {
        Ok(t) => t.time_to_live_description().cloned(),
        Err(e) if e.code() == Some("AccessDeniedException") || throttled(e.code()) => {
            return Ok(unchecked("could not describe the TTL of", e.code()));
        }
        Err(e) => return Err(sdk_err("describe TTL of", table, &e)),
    };
    let t = d.table().cloned().unwrap_or_else(|| TableDescription::builder().build());
    Ok(Inspection::Compared(compare(&LEASE_TABLE, &t, ttl.as_ref())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_dynamodb::types::{GlobalSecondaryIndexDescription, StreamSpecification};

    fn good() -> (TableDescription, TimeToLiveDescription) {
        let spec = &LEASE_TABLE;
        let ks = |n: &str, t: KeyType| KeySchemaElement::builder().attribute_name(n).key_type(t).build().unwrap();
        let mut t =
            TableDescription::builder().key_schema(ks(spec.key, KeyType::Hash)).deletion_protection_enabled(true);
        for (n, ty) in spec.attributes() {
            t = t.attribute_definitions(
                AttributeDefinition::builder().attribute_name(n).attribute_type(scalar(ty)).build().unwrap(),
            );
        }
        for i in spec.indexes {
            let mut g =
                GlobalSecondaryIndexDescription::builder().index_name(i.name).key_schema(ks(i.hash.0, KeyType::Hash));
            if let Some(range) = i.range {
                g = g.key_schema(ks(range.0, KeyType::Range));
            }
            t = t.global_secondary_indexes(g.projection(projection(i)).build());
        }
        t = t.stream_specification(
            StreamSpecification::builder()
                .stream_enabled(true)
                .stream_view_type(StreamViewType::NewAndOldImages)
                .build()
                .unwrap(),
        );
        let ttl = TimeToLiveDescription::builder()
            .attribute_name(spec.ttl)
            .time_to_live_status(TimeToLiveStatus::Enabled)
            .build();
        (t.build(), ttl)
    }

    #[test]
    fn the_definition_passes_its_own_check() {
        let (t, ttl) = good();
        assert_eq!(compare(&LEASE_TABLE, &t, Some(&ttl)), Findings::default());
    }

    #[test]
    fn a_missing_index_names_what_fails() {
        let (mut t, ttl) = good();
        t.global_secondary_indexes.as_mut().unwrap().retain(|g| g.index_name() != Some(STATE_INDEX));
        let f = compare(&LEASE_TABLE, &t, Some(&ttl));
        let p = f.problem_messages();
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].starts_with("index `state` is missing") && p[0].contains("next"), "{p:?}");
        assert_eq!(f.problems[0].part, Part::Index(STATE_INDEX));
    }

    #[test]
    fn ttl_stream_and_projection_differences_are_named() {
        let (mut t, _) = good();
        t.global_secondary_indexes.as_mut().unwrap()[0].projection =
            Some(Projection::builder().projection_type(ProjectionType::KeysOnly).build());
        t.stream_specification = None;
        let f = compare(&LEASE_TABLE, &t, None);
        let p = &f.problem_messages();
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(p[0].contains("`keepalive` projects KEYS_ONLY"), "{p:?}");
        assert!(p[1].contains("TTL is not enabled on `ttl`"), "{p:?}");
        assert_eq!(f.warnings.len(), 1);
        assert!(f.warnings[0].contains("stream is off"), "{f:?}");
    }

    /// A table as earlier versions made it (no `queue` index, TTL off here): a command that
    /// uses only the key or the `state` index runs; one that uses the `queue` index fails; the
    /// TTL problem is a warning to every command; deletion protection off is a note.
    #[test]
    fn a_command_fails_only_on_the_parts_it_uses() {
        let (mut t, _) = good();
        t.global_secondary_indexes.as_mut().unwrap().retain(|g| g.index_name() != Some(QUEUE_INDEX));
        t.deletion_protection_enabled = Some(false);
        let f = compare(&LEASE_TABLE, &t, None);
        let parts: Vec<Part> = f.problems.iter().map(|p| p.part).collect();
        assert_eq!(parts, vec![Part::Index(QUEUE_INDEX), Part::Ttl], "{f:?}");
        let (fatal, warnings) = f.for_parts(&[Part::Key, Part::Index(STATE_INDEX)]);
        assert!(fatal.is_empty(), "{fatal:?}");
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("TTL is not enabled"), "{warnings:?}");
        let (fatal, _) = f.for_parts(&[Part::Key, Part::Index(QUEUE_INDEX)]);
        assert_eq!(fatal.len(), 1, "{fatal:?}");
        assert!(fatal[0].starts_with("index `queue` is missing"), "{fatal:?}");
        assert_eq!(f.notes.len(), 1, "{f:?}");
        assert!(f.notes[0].contains("deletion protection is off"), "{f:?}");
        for p in
            [Part::Key, Part::Ttl, Part::Index(KEEPALIVE_INDEX), Part::Index(STATE_INDEX), Part::Index(QUEUE_INDEX)]
        {
            assert_eq!(Part::parse(&p.as_text()), Some(p));
        }
        assert_eq!(Part::parse("index:nope"), None);
    }

    fn with_state_projection(p: Projection) -> TableDescription {
        let (mut t, _) = good();
        let g = t.global_secondary_indexes.as_mut().unwrap().iter_mut().find(|g| g.index_name() == Some(STATE_INDEX));
        g.unwrap().projection = Some(p);
        t
    }

    /// The work-state index projects only what a batch's candidate is judged and taken by.
    #[test]
    fn the_state_index_projects_what_a_candidate_needs() {
        let spec = LEASE_TABLE.indexes.iter().find(|i| i.name == STATE_INDEX).unwrap();
        assert_eq!(spec.projection, "INCLUDE");
        let p = projection(spec);
        assert_eq!(p.projection_type(), Some(&ProjectionType::Include));
        let mut want: Vec<&str> = vec![
            attr::FENCE,
            attr::HOLDER,
            attr::LEASE_ID,
            attr::ACQUIRED_AT,
            attr::MIN_HOLD_UNTIL,
            attr::RELEASED_AT,
            attr::STATE_SINCE,
            attr::ATTEMPTS,
        ];
        let mut have: Vec<&str> = p.non_key_attributes().iter().map(String::as_str).collect();
        want.sort();
        have.sort();
        assert_eq!(have, want);
        // Neither the metadata (a listing reads the items) nor the index's or table's keys.
        assert!(!have.contains(&attr::METADATA) && !have.contains(&attr::KEY) && !have.contains(&attr::STATE_SHARD));
    }

    /// An existing table whose work-state index projects ALL (as tables made before the
    /// INCLUDE projection do: CloudFormation cannot change a GSI's projection in place) works:
    /// a warning. KEYS_ONLY, or an INCLUDE without an attribute the candidates need, does not.
    #[test]
    fn a_state_index_projecting_more_warns_and_less_fails() {
        let all = with_state_projection(Projection::builder().projection_type(ProjectionType::All).build());
        let f = compare(&LEASE_TABLE, &all, Some(&good().1));
        assert!(f.problems.is_empty() && f.warnings.is_empty(), "{f:?}");
        assert_eq!(f.notes.len(), 1, "{f:?}");
        assert!(f.notes[0].contains("`state` projects ALL") && f.notes[0].contains("INCLUDE ("), "{f:?}");

        let keys_only = with_state_projection(Projection::builder().projection_type(ProjectionType::KeysOnly).build());
        let p = compare(&LEASE_TABLE, &keys_only, Some(&good().1)).problem_messages();
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].contains("`state` projects KEYS_ONLY but needs INCLUDE"), "{p:?}");

        let short = with_state_projection(
            Projection::builder()
                .projection_type(ProjectionType::Include)
                .non_key_attributes(attr::FENCE)
                .non_key_attributes(attr::HOLDER)
                .build(),
        );
        let p = compare(&LEASE_TABLE, &short, Some(&good().1)).problem_messages();
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].contains("missing lease_id") && p[0].contains("attempts"), "{p:?}");

        let mut more = Projection::builder().projection_type(ProjectionType::Include);
        for a in STATE_INDEX_ATTRIBUTES.iter().chain([&attr::METADATA]) {
            more = more.non_key_attributes(*a);
        }
        let f = compare(&LEASE_TABLE, &with_state_projection(more.build()), Some(&good().1));
        assert!(f.problems.is_empty() && f.warnings.is_empty() && f.notes.len() == 1, "{f:?}");
    }
}
