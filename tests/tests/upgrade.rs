//! Upgrading a deployed stack: template.yaml compared with the template of every released
//! version (each release's template, kept in tests/releases/), refusing every change
//! CloudFormation (or DynamoDB under it) refuses in a stack update, so that `sam deploy` of this
//! version onto a stack of an earlier one, by the path README's "Upgrading an existing stack"
//! gives, does not fail and roll back.
//!
//! The rules, and where they are written:
//! - AWS::DynamoDB::Table (CloudFormation resource reference, "GlobalSecondaryIndexes",
//!   "AttributeDefinitions", "KeySchema", "LocalSecondaryIndexes"; the registry schema cfn-lint
//!   ships; DynamoDB API reference, UpdateTable, UpdateTimeToLive, and its quotas):
//!   - a GSI kept under its name keeps its key schema and projection ("Updates are not
//!     supported" but for throughput and contributor insights);
//!   - at most one GSI is added or deleted in one update, not one of each ("If you do both in
//!     the same update (for example, by changing the index's logical ID), the update fails");
//!   - the table's key schema, name and local secondary indexes, and the type of an existing
//!     attribute definition, change only by replacing the table;
//!   - TTL cannot move to another attribute in one update (UpdateTimeToLive: one change per
//!     hour, and a move is a disable and an enable);
//!   - at most 20 GSIs, and at most 100 projected non-key attributes over all indexes.
//! - Any resource: a resource keeps its type; a change of a create-only property (the registry
//!   schemas' createOnlyProperties) replaces the resource, which CloudFormation refuses for a
//!   resource with a custom name kept as it was ("CloudFormation cannot update a stack when a
//!   custom-named resource requires replacing").
//! - This project's own rule: the lease table is never replaced or removed (a replacement is a
//!   new, empty table, its predecessor retained with every lease held in it).

use std::collections::{BTreeMap, BTreeSet};

use leasehold_tests::cfn::{self, Resolver};
use leasehold_tests::{repo_root, TempDir};
use serde_json::{json, Value};

/// One change CloudFormation would refuse.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Refusal {
    resource: String,
    rule: &'static str,
    detail: String,
}

fn refusal(resource: &str, rule: &'static str, detail: String) -> Refusal {
    Refusal { resource: resource.to_string(), rule, detail }
}

const GSI_IN_PLACE: &str = "a global secondary index's key schema or projection changed in place";
const ONE_GSI: &str = "more than one global secondary index added or deleted in one update";
const TABLE_REPLACED: &str = "a table's key schema, name, local indexes or an attribute's type changed (replacement)";
const TTL_MOVED: &str = "TTL moved to another attribute in one update";
const QUOTA: &str = "a DynamoDB index quota exceeded";
const TYPE_CHANGED: &str = "a resource's type changed";
const NAMED_REPLACED: &str = "a resource with a custom name kept as it was needs replacing";
const LEASE_TABLE: &str = "the lease table replaced or removed";

fn list(v: &Value) -> Vec<Value> {
    v.as_array().cloned().unwrap_or_default()
}

/// An index's projection as compared: its type and the set of its non-key attributes.
fn projection(g: &Value) -> (String, BTreeSet<String>) {
    let p = &g["Projection"];
    let names = list(&p["NonKeyAttributes"]).iter().filter_map(|a| a.as_str().map(str::to_string)).collect();
    (p["ProjectionType"].as_str().unwrap_or("KEYS_ONLY").to_string(), names)
}

fn by_name(indexes: &Value) -> BTreeMap<String, Value> {
    list(indexes).into_iter().map(|g| (g["IndexName"].as_str().unwrap_or_default().to_string(), g)).collect()
}

/// The DynamoDB table rules, on the properties of one table as deployed before (`old`) and
/// after (`new`), parameters and conditions resolved.
fn table_refusals(name: &str, old: &Value, new: &Value) -> Vec<Refusal> {
    let mut out = Vec::new();
    let replaced = |what: &str| refusal(name, TABLE_REPLACED, what.to_string());
    if old["TableName"] != new["TableName"] {
        out.push(replaced("TableName"));
    }
    if old["KeySchema"] != new["KeySchema"] {
        out.push(replaced("KeySchema"));
    }
    if list(&old["LocalSecondaryIndexes"]) != list(&new["LocalSecondaryIndexes"]) {
        out.push(replaced("LocalSecondaryIndexes"));
    }
    let types = |t: &Value| -> BTreeMap<String, Value> {
        list(&t["AttributeDefinitions"])
            .into_iter()
            .map(|d| (d["AttributeName"].as_str().unwrap_or_default().to_string(), d["AttributeType"].clone()))
            .collect()
    };
    let (old_types, new_types) = (types(old), types(new));
    for (attr, ty) in &old_types {
        if new_types.get(attr).is_some_and(|t| t != ty) {
            out.push(replaced(&format!("AttributeDefinitions: {attr} from {ty} to {}", new_types[attr])));
        }
    }
    out.extend(gsi_refusals(name, old, new));
    let ttl = |t: &Value| {
        let s = &t["TimeToLiveSpecification"];
        (s["Enabled"] == json!(true)).then(|| s["AttributeName"].clone())
    };
    if let (Some(a), Some(b)) = (ttl(old), ttl(new)) {
        if a != b {
            out.push(refusal(name, TTL_MOVED, format!("from {a} to {b}")));
        }
    }
    out.extend(quota_refusals(name, new));
    out
}

/// GSIs: kept ones unchanged but for throughput, at most one added or deleted.
fn gsi_refusals(name: &str, old: &Value, new: &Value) -> Vec<Refusal> {
    let (before, after) = (by_name(&old["GlobalSecondaryIndexes"]), by_name(&new["GlobalSecondaryIndexes"]));
    let mut out = Vec::new();
    for (index, g) in &before {
        let Some(h) = after.get(index) else { continue };
        if g["KeySchema"] != h["KeySchema"] {
            out.push(refusal(
                name,
                GSI_IN_PLACE,
                format!("index `{index}`: key schema {} -> {}", g["KeySchema"], h["KeySchema"]),
            ));
        }
        if projection(g) != projection(h) {
            out.push(refusal(
                name,
                GSI_IN_PLACE,
                format!("index `{index}`: projection {:?} -> {:?}", projection(g), projection(h)),
            ));
        }
    }
    let added: Vec<&String> = after.keys().filter(|k| !before.contains_key(*k)).collect();
    let deleted: Vec<&String> = before.keys().filter(|k| !after.contains_key(*k)).collect();
    if added.len() + deleted.len() > 1 {
        out.push(refusal(name, ONE_GSI, format!("added {added:?}, deleted {deleted:?}")));
    }
    out
}

fn quota_refusals(name: &str, t: &Value) -> Vec<Refusal> {
    let gsis = list(&t["GlobalSecondaryIndexes"]);
    let mut out = Vec::new();
    if gsis.len() > 20 {
        out.push(refusal(name, QUOTA, format!("{} global secondary indexes (at most 20)", gsis.len())));
    }
    let projected: usize = gsis
        .iter()
        .chain(list(&t["LocalSecondaryIndexes"]).iter())
        .filter(|g| g["Projection"]["ProjectionType"] == "INCLUDE")
        .map(|g| projection(g).1.len())
        .sum();
    if projected > 100 {
        out.push(refusal(name, QUOTA, format!("{projected} projected non-key attributes (at most 100)")));
    }
    out
}

/// A JSON pointer ("/properties/TableName") into a resource.
fn at<'a>(resource: &'a Value, pointer: &str) -> &'a Value {
    let p = pointer.replacen("/properties", "/Properties", 1);
    resource.pointer(&p).unwrap_or(&Value::Null)
}

/// The rules of any resource, on two whole templates (resolved); `create_only`: per type, the
/// properties whose change replaces a resource.
fn resource_refusals(old: &Value, new: &Value, create_only: &Value) -> Vec<Refusal> {
    let mut out = Vec::new();
    let (before, after) = (old["Resources"].as_object().cloned().unwrap_or_default(), &new["Resources"]);
    if before.contains_key("LeaseTable") && after.get("LeaseTable").is_none() {
        out.push(refusal("LeaseTable", LEASE_TABLE, "removed from the template".into()));
    }
    for (name, r) in &before {
        let Some(s) = after.get(name) else { continue };
        let ty = r["Type"].as_str().unwrap_or_default();
        if r["Type"] != s["Type"] {
            out.push(refusal(name, TYPE_CHANGED, format!("{} -> {}", r["Type"], s["Type"])));
            continue;
        }
        let paths: Vec<String> = list(&create_only[ty]).iter().filter_map(|p| p.as_str().map(str::to_string)).collect();
        let changed: Vec<&String> = paths.iter().filter(|p| at(r, p) != at(s, p)).collect();
        if changed.is_empty() {
            continue;
        }
        if name == "LeaseTable" {
            out.push(refusal(name, LEASE_TABLE, format!("replaced: {changed:?} changed")));
        }
        // The resource's own name: `<Type>Name` (TableName, StateMachineName, LogGroupName) or
        // `Name` (not a reference to another resource, as a permission's FunctionName is).
        let own =
            [format!("/properties/{}Name", ty.rsplit("::").next().unwrap_or_default()), "/properties/Name".into()];
        let named = paths.iter().find(|p| own.contains(p) && !at(s, p).is_null() && at(r, p) == at(s, p));
        if let Some(p) = named {
            out.push(refusal(name, NAMED_REPLACED, format!("{changed:?} changed, {p} = {} kept", at(s, p))));
        }
    }
    out
}

/// Every refusal of an update from `old` (raw and transformed) to `new`, each resolved with its
/// parameters.
fn upgrade_refusals(old: &Templates, new: &Templates, create_only: &Value) -> Vec<Refusal> {
    let mut out = Vec::new();
    for (name, r) in old.raw["Resources"].as_object().into_iter().flatten() {
        let s = &new.raw["Resources"][name];
        if r["Type"] == "AWS::DynamoDB::Table" && s["Type"] == "AWS::DynamoDB::Table" {
            out.extend(table_refusals(name, &old.resolved(&r["Properties"]), &new.resolved(&s["Properties"])));
        }
    }
    out.extend(resource_refusals(&old.resolved_transformed(), &new.resolved_transformed(), create_only));
    out
}

/// One version's template, raw and through the SAM transform, with its parameter values.
struct Templates {
    raw: Value,
    transformed: Value,
    overrides: Vec<(&'static str, &'static str)>,
}

impl Templates {
    fn load(path: &std::path::Path, overrides: &[(&'static str, &'static str)]) -> Templates {
        let p = path.to_str().unwrap();
        Templates {
            raw: cfn::template_json(&["raw", p]),
            transformed: cfn::template_json(&["transformed", p]),
            overrides: overrides.to_vec(),
        }
    }

    fn with(&self, overrides: &[(&'static str, &'static str)]) -> Templates {
        Templates { raw: self.raw.clone(), transformed: self.transformed.clone(), overrides: overrides.to_vec() }
    }

    fn resolved(&self, v: &Value) -> Value {
        Resolver::new(&self.raw, &self.overrides).resolve(v)
    }

    fn resolved_transformed(&self) -> Value {
        let r = Resolver::new(&self.transformed, &self.overrides);
        let mut t = self.transformed.clone();
        t["Resources"] = r.resolve(&self.transformed["Resources"]);
        t
    }
}

/// The create-only properties of every type in `templates` (one cfn-lint run per set of types).
fn create_only_of(templates: &[&Templates]) -> Value {
    static KNOWN: std::sync::Mutex<BTreeMap<BTreeSet<String>, Value>> = std::sync::Mutex::new(BTreeMap::new());
    let mut types = BTreeSet::new();
    for t in templates {
        for r in t.transformed["Resources"].as_object().into_iter().flatten().map(|(_, r)| r) {
            types.insert(r["Type"].as_str().unwrap_or_default().to_string());
        }
    }
    if let Some(v) = KNOWN.lock().unwrap().get(&types) {
        return v.clone();
    }
    let mut args = vec!["create-only"];
    args.extend(types.iter().map(String::as_str));
    let v = cfn::template_json(&args);
    KNOWN.lock().unwrap().insert(types, v.clone());
    v
}

/// A version's template (a git ref, or `None`: this one's template.yaml).
/// Each version is read once per test process (the SAM transform takes seconds).
fn load(version: Option<&str>, overrides: &[(&'static str, &'static str)]) -> Templates {
    static LOADED: std::sync::Mutex<BTreeMap<String, (Value, Value)>> = std::sync::Mutex::new(BTreeMap::new());
    let id = version.unwrap_or("").to_string();
    if let Some((raw, transformed)) = LOADED.lock().unwrap().get(&id) {
        return Templates { raw: raw.clone(), transformed: transformed.clone(), overrides: overrides.to_vec() };
    }
    let t = match version {
        None => Templates::load(&repo_root().join("template.yaml"), overrides),
        Some(v) => {
            let dir = TempDir::new("upgrade");
            Templates::load(&cfn::template_at(v, dir.path()), overrides)
        }
    };
    LOADED.lock().unwrap().insert(id, (t.raw.clone(), t.transformed.clone()));
    t
}

/// The released versions, oldest first (tests/releases/).
fn releases() -> Vec<String> {
    cfn::releases()
}

/// The projection type of the `state` index of a version's lease table as deployed (`None`:
/// it has no such index).
fn state_projection(t: &Templates) -> Option<String> {
    let p = t.resolved(&t.raw["Resources"]["LeaseTable"]["Properties"]);
    by_name(&p["GlobalSecondaryIndexes"]).get("state").map(|g| projection(g).0)
}

/// The parameter a stack of a version with `state` projecting `projection` upgrades with
/// (README, "Upgrading an existing stack"): StateIndexProjection=INCLUDE if it projects
/// INCLUDE, the default (ALL) otherwise.
fn upgrade_overrides(projection: Option<&str>) -> Vec<(&'static str, &'static str)> {
    if projection == Some("INCLUDE") {
        vec![("StateIndexProjection", "INCLUDE")]
    } else {
        vec![]
    }
}

/// Versions that cannot reach this one in one update, and the release to deploy first (each
/// step one update; README, "Upgrading an existing stack"): v0.1.0 has no `state` index, and
/// this version would add both `state` and `queue`.
const VIA: &[(&str, &str)] = &[("v0.1.0", "v0.2.0")];

/// `sam deploy` of this version onto a stack of any released version, by the documented path
/// (directly, or through the release [`VIA`] names, each step one update, with the
/// StateIndexProjection its table needs): no rule refuses a step. From cf5d284 (v0.2.0) it is
/// one update with the default parameters: the lease table gains one index (`queue`) and its
/// stream; the `state` index keeps its projection, ALL.
#[test]
fn every_release_upgrades_to_this_version_by_its_documented_path() {
    let current = load(None, &[]);
    for version in releases() {
        let old = load(Some(&version), &[]);
        let via = VIA.iter().find(|(v, _)| *v == version).map(|(_, via)| *via);
        let mut steps = vec![];
        let next = match via {
            Some(v) => {
                let middle = load(Some(v), &[]);
                steps.push((format!("{version} -> {v}"), old.with(&[]), middle.with(&[])));
                middle
            }
            None => old,
        };
        let overrides = upgrade_overrides(state_projection(&next).as_deref());
        steps.push((format!("{version} -> this version {overrides:?}"), next.with(&[]), current.with(&overrides)));
        for (what, from, to) in steps {
            let create_only = create_only_of(&[&from, &to]);
            let refusals = upgrade_refusals(&from, &to, &create_only);
            assert!(refusals.is_empty(), "{what} would fail and roll back:\n{refusals:#?}");
        }
    }
    // From cf5d284: the default parameters, and the comparison sees what changes (so that no
    // refusal above means something).
    let old = load(Some(cfn::BEFORE_TAGS), &[]);
    assert_eq!(upgrade_overrides(state_projection(&old).as_deref()), vec![]);
    let (a, b) = (
        old.resolved(&old.raw["Resources"]["LeaseTable"]["Properties"]),
        current.resolved(&current.raw["Resources"]["LeaseTable"]["Properties"]),
    );
    let (before, after) = (by_name(&a["GlobalSecondaryIndexes"]), by_name(&b["GlobalSecondaryIndexes"]));
    let added: Vec<&String> = after.keys().filter(|k| !before.contains_key(*k)).collect();
    assert_eq!(added, vec!["queue"]);
    assert_eq!(projection(&before["state"]), projection(&after["state"]));
    assert_eq!(projection(&after["state"]).0, "ALL");
    assert!(a["StreamSpecification"].is_null() && !b["StreamSpecification"].is_null());
}

/// StateIndexProjection must say what the stack's table has: INCLUDE on an upgrade of a stack
/// made with ALL (cf5d284), or the default on one made with INCLUDE, is the in-place projection
/// change CloudFormation refuses. And v0.1.0 in one step adds two indexes.
#[test]
fn a_state_index_projection_change_or_two_new_indexes_are_refused() {
    let current = load(None, &[]);
    let old = load(Some(cfn::BEFORE_TAGS), &[]);
    let include = current.with(&[("StateIndexProjection", "INCLUDE")]);
    let create_only = create_only_of(&[&old, &current]);
    let refusals = upgrade_refusals(&old, &include, &create_only);
    assert_eq!(refusals.len(), 1, "{refusals:#?}");
    assert_eq!((refusals[0].resource.as_str(), refusals[0].rule), ("LeaseTable", GSI_IN_PLACE), "{refusals:#?}");
    assert!(refusals[0].detail.contains("index `state`: projection"), "{refusals:#?}");
    let refusals = upgrade_refusals(&include, &current, &create_only);
    assert_eq!(refusals.iter().map(|r| r.rule).collect::<Vec<_>>(), [GSI_IN_PLACE], "{refusals:#?}");
    // A stack created with either setting upgrades to the same setting.
    assert!(upgrade_refusals(&include, &include, &create_only).is_empty());
    assert!(upgrade_refusals(&current, &current, &create_only).is_empty());
    if releases().iter().any(|r| r == "v0.1.0") {
        let first = load(Some("v0.1.0"), &[]);
        let refusals = upgrade_refusals(&first, &current, &create_only_of(&[&first, &current]));
        assert_eq!(refusals.iter().map(|r| r.rule).collect::<Vec<_>>(), [ONE_GSI], "{refusals:#?}");
    }
}

fn table(gsis: Value) -> Value {
    json!({
        "BillingMode": "PAY_PER_REQUEST",
        "KeySchema": [{"AttributeName": "key", "KeyType": "HASH"}],
        "AttributeDefinitions": [
            {"AttributeName": "key", "AttributeType": "S"},
            {"AttributeName": "a", "AttributeType": "N"},
            {"AttributeName": "b", "AttributeType": "S"}
        ],
        "GlobalSecondaryIndexes": gsis,
        "TimeToLiveSpecification": {"AttributeName": "ttl", "Enabled": true}
    })
}

fn gsi(name: &str, hash: &str, projection: Value) -> Value {
    json!({"IndexName": name, "KeySchema": [{"AttributeName": hash, "KeyType": "HASH"}], "Projection": projection})
}

fn rules_of(old: &Value, new: &Value) -> Vec<&'static str> {
    table_refusals("T", old, new).into_iter().map(|r| r.rule).collect()
}

/// Each rule refuses what CloudFormation refuses, and lets through what it applies in place.
#[test]
fn each_table_rule_refuses_what_cloudformation_refuses() {
    let all = json!({"ProjectionType": "ALL"});
    let keys = json!({"ProjectionType": "KEYS_ONLY"});
    let base = table(json!([gsi("one", "a", all.clone())]));
    // Allowed in place: nothing, one index added, one deleted, throughput or contributor
    // insights of an index, a new attribute definition, the stream, the same INCLUDE list in
    // another order.
    assert!(rules_of(&base, &base).is_empty());
    let mut one_more = table(json!([gsi("one", "a", all.clone()), gsi("two", "b", keys.clone())]));
    assert!(rules_of(&base, &one_more).is_empty());
    assert!(rules_of(&one_more, &base).is_empty());
    one_more["GlobalSecondaryIndexes"][0]["ContributorInsightsSpecification"] = json!({"Enabled": true});
    one_more["StreamSpecification"] = json!({"StreamViewType": "NEW_AND_OLD_IMAGES"});
    one_more["AttributeDefinitions"].as_array_mut().unwrap().push(json!({"AttributeName": "c", "AttributeType": "N"}));
    assert!(rules_of(&base, &one_more).is_empty());
    let inc = |a: &[&str]| json!({"ProjectionType": "INCLUDE", "NonKeyAttributes": a});
    assert!(rules_of(
        &table(json!([gsi("one", "a", inc(&["x", "y"]))])),
        &table(json!([gsi("one", "a", inc(&["y", "x"]))]))
    )
    .is_empty());

    // Refused: a projection or key schema changed in place, two indexes added, a rename (one
    // deleted and one added), the key schema, an attribute's type, LSIs, TTL moved, quotas.
    assert_eq!(rules_of(&base, &table(json!([gsi("one", "a", keys.clone())]))), [GSI_IN_PLACE]);
    assert_eq!(
        rules_of(&table(json!([gsi("one", "a", inc(&["x"]))])), &table(json!([gsi("one", "a", inc(&["x", "y"]))]))),
        [GSI_IN_PLACE]
    );
    assert_eq!(rules_of(&base, &table(json!([gsi("one", "b", all.clone())]))), [GSI_IN_PLACE]);
    let two_more =
        table(json!([gsi("one", "a", all.clone()), gsi("two", "b", keys.clone()), gsi("three", "b", keys.clone())]));
    assert_eq!(rules_of(&base, &two_more), [ONE_GSI]);
    assert_eq!(rules_of(&base, &table(json!([gsi("renamed", "a", all.clone())]))), [ONE_GSI]);
    let mut other_key = base.clone();
    other_key["KeySchema"] =
        json!([{"AttributeName": "key", "KeyType": "HASH"}, {"AttributeName": "b", "KeyType": "RANGE"}]);
    assert_eq!(rules_of(&base, &other_key), [TABLE_REPLACED]);
    let mut retyped = base.clone();
    retyped["AttributeDefinitions"][1]["AttributeType"] = json!("S");
    assert_eq!(rules_of(&base, &retyped), [TABLE_REPLACED]);
    let mut lsi = base.clone();
    lsi["LocalSecondaryIndexes"] = json!([gsi("local", "key", keys.clone())]);
    assert_eq!(rules_of(&base, &lsi), [TABLE_REPLACED]);
    let mut named = base.clone();
    named["TableName"] = json!("leases-2");
    assert_eq!(rules_of(&base, &named), [TABLE_REPLACED]);
    let mut ttl = base.clone();
    ttl["TimeToLiveSpecification"]["AttributeName"] = json!("expires");
    assert_eq!(rules_of(&base, &ttl), [TTL_MOVED]);
    let many: Vec<Value> = (0..21).map(|i| gsi(&format!("i{i}"), "a", keys.clone())).collect();
    let mut too_many = table(json!(many));
    assert!(rules_of(&too_many, &too_many).contains(&QUOTA));
    too_many["GlobalSecondaryIndexes"] = json!([gsi(
        "one",
        "a",
        inc(&(0..101).map(|i| format!("x{i}")).collect::<Vec<_>>().iter().map(String::as_str).collect::<Vec<_>>())
    )]);
    assert_eq!(rules_of(&too_many, &too_many), [QUOTA]);
}

/// The rules of any resource: a type kept, a custom-named resource never replaced under its
/// name, the lease table never replaced or removed; an unnamed resource may be replaced.
#[test]
fn resource_rules_refuse_type_changes_and_named_replacements() {
    let create_only = json!({
        "AWS::StepFunctions::StateMachine": ["/properties/StateMachineName", "/properties/StateMachineType"],
        "AWS::DynamoDB::Table": ["/properties/KeySchema", "/properties/TableName"],
        "AWS::SQS::Queue": ["/properties/FifoQueue", "/properties/QueueName"]
    });
    let t = |machine: Value, table: Value, queue: Value| json!({"Resources": {"M": machine, "LeaseTable": table, "Q": queue}});
    let sm = |name: Option<&str>, ty: &str| {
        let mut p = json!({"StateMachineType": ty});
        if let Some(n) = name {
            p["StateMachineName"] = json!(n);
        }
        json!({"Type": "AWS::StepFunctions::StateMachine", "Properties": p})
    };
    let lt = |key: &str| json!({"Type": "AWS::DynamoDB::Table", "Properties": {"KeySchema": [{"AttributeName": key, "KeyType": "HASH"}]}});
    let q = json!({"Type": "AWS::SQS::Queue", "Properties": {}});
    let base = t(sm(Some("m"), "STANDARD"), lt("key"), q.clone());
    let rules =
        |new: &Value| resource_refusals(&base, new, &create_only).into_iter().map(|r| r.rule).collect::<Vec<_>>();
    assert!(rules(&base).is_empty());
    // Unnamed: replaced, allowed. Named and renamed: replaced, allowed.
    assert!(resource_refusals(
        &t(sm(None, "STANDARD"), lt("key"), q.clone()),
        &t(sm(None, "EXPRESS"), lt("key"), q.clone()),
        &create_only
    )
    .is_empty());
    assert!(rules(&t(sm(Some("m2"), "EXPRESS"), lt("key"), q.clone())).is_empty());
    assert_eq!(rules(&t(sm(Some("m"), "EXPRESS"), lt("key"), q.clone())), [NAMED_REPLACED]);
    assert_eq!(rules(&t(sm(Some("m"), "STANDARD"), lt("id"), q.clone())), [LEASE_TABLE]);
    assert_eq!(rules(&t(sm(Some("m"), "STANDARD"), lt("key"), json!({"Type": "AWS::SNS::Topic"}))), [TYPE_CHANGED]);
    let mut gone = base.clone();
    gone["Resources"].as_object_mut().unwrap().remove("LeaseTable");
    assert_eq!(rules(&gone), [LEASE_TABLE]);
}
