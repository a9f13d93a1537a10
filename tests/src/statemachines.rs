//! The state machines' definitions: `statemachines/NAME.asl.json`, which template.yaml names in
//! each `AWS::Serverless::StateMachine`'s `DefinitionUri` and fills in through its
//! `DefinitionSubstitutions`. Every test that inspects or runs a definition loads it here:
//! [`rule`] checks the rule every one keeps (its work inside its lease), [`for_moto`] is a
//! definition as moto can run it, and [`resumed_at`] what a redrive runs.

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde_json::Value;

use crate::repo_root;

pub mod rule;

/// The file of the definition `name` (e.g. `single_flight`).
pub fn path(name: &str) -> PathBuf {
    repo_root().join("statemachines").join(format!("{name}.asl.json"))
}

/// The definition's name in a template `DefinitionUri` (`statemachines/NAME.asl.json`).
pub fn name_of_uri(uri: &str) -> &str {
    uri.strip_prefix("statemachines/")
        .and_then(|rest| rest.strip_suffix(".asl.json"))
        .unwrap_or_else(|| panic!("DefinitionUri {uri} is not statemachines/NAME.asl.json"))
}

/// The definition as written, `${Var}` references left in.
pub fn text(name: &str) -> String {
    let p = path(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

/// The definition as written, parsed (`${Var}` references stay in its strings).
pub fn parsed(name: &str) -> Value {
    serde_json::from_str(&text(name)).unwrap_or_else(|e| panic!("{name}.asl.json: {e}"))
}

/// The `${Var}` names the definition refers to (what `DefinitionSubstitutions` must supply).
pub fn references(text: &str) -> BTreeSet<String> {
    text.split("${").skip(1).filter_map(|rest| rest.split_once('}')).map(|(name, _)| name.to_string()).collect()
}

/// The definition with each `${Var}` replaced by its substitution, as CloudFormation does with
/// `DefinitionSubstitutions`; panics if a reference is left unsubstituted.
pub fn definition(name: &str, substitutions: &[(&str, &str)]) -> String {
    let mut text = text(name);
    for (var, value) in substitutions {
        text = text.replace(&format!("${{{var}}}"), value);
    }
    let left = references(&text);
    assert!(left.is_empty(), "{name}: unsubstituted references {left:?}");
    text
}

/// Every definition file in statemachines/: (name, definition as written).
pub fn all() -> Vec<(String, Value)> {
    let dir = repo_root().join("statemachines");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_suffix(".asl.json").map(str::to_string))
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let def = parsed(&n);
            (n, def)
        })
        .collect()
}

/// The definition `text` (substitutions done) as moto can run it in the run `run` of an
/// execution: moto 5.2.1 implements no redrive (no `RedriveExecution`, and its context object has
/// no `Execution.RedriveCount`: a path to it fails the execution), so every reference to
/// `$$.Execution.RedriveCount` becomes the number `run` (0: an execution never redriven, as Step
/// Functions gives it), in a payload template's field (`"run.$": ...` becomes `"run": run`) and
/// inside an intrinsic function's arguments alike. And moto 5.2.1 drops a `lambda:invoke`
/// task's `InvocationType` (Step Functions passes it to Lambda): it is carried in the task's
/// `Qualifier` instead, which moto passes on (`?Qualifier=` on the Invoke request), and the tests'
/// adapters answer a `DryRun` there as Lambda does (sfn_quotas::invocation_type). Everything
/// else stays as written.
pub fn for_moto(text: &str, run: u64) -> String {
    fn visit(v: &mut Value, run: u64) {
        match v {
            Value::Object(o) => {
                let lambda = o.get("Resource").and_then(Value::as_str).is_some_and(|r| r.contains(":lambda:invoke"));
                if let Some(p) = o.get_mut("Parameters").and_then(Value::as_object_mut).filter(|_| lambda) {
                    for (from, to) in [("InvocationType.$", "Qualifier.$"), ("InvocationType", "Qualifier")] {
                        if let Some(t) = p.remove(from) {
                            assert!(!p.contains_key("Qualifier") && !p.contains_key("Qualifier.$"), "{p:?}");
                            p.insert(to.to_string(), t);
                        }
                    }
                }
                let keys: Vec<String> = o.keys().cloned().collect();
                for k in keys {
                    let whole = o[&k] == rule::REDRIVE_COUNT;
                    match k.strip_suffix(".$") {
                        Some(plain) if whole => {
                            o.remove(&k);
                            o.insert(plain.to_string(), Value::from(run));
                        }
                        _ => {
                            assert!(
                                !(k == "Variable" && whole),
                                "a Choice on {} (moto cannot run it)",
                                rule::REDRIVE_COUNT
                            );
                            visit(o.get_mut(&k).expect("key"), run);
                        }
                    }
                }
            }
            Value::Array(a) => a.iter_mut().for_each(|v| visit(v, run)),
            Value::String(s) if s.contains(rule::REDRIVE_COUNT) => {
                *s = s.replace(rule::REDRIVE_COUNT, &run.to_string());
            }
            _ => {}
        }
    }
    let mut def: Value = serde_json::from_str(text).expect("a definition is JSON");
    visit(&mut def, run);
    def.to_string()
}

/// What Step Functions runs when `RedriveExecution` resumes an execution of `text` (a top-level
/// state `state` failed or was stopped): the same definition from `state`, in run `run` (the
/// execution's `RedriveCount` after the redrive), as moto can run it ([`for_moto`]). Started with
/// the input `state` had, it is the redriven execution, but for its ARN (a new execution's).
pub fn resumed_at(text: &str, state: &str, run: u64) -> String {
    let mut def: Value = serde_json::from_str(&for_moto(text, run)).expect("JSON");
    assert!(def["States"].get(state).is_some(), "no top-level state {state}");
    def["StartAt"] = Value::from(state);
    def.to_string()
}
