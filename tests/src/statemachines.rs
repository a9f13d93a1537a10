//! The state machines' definitions: `statemachines/NAME.asl.json`, which template.yaml names in
//! each `AWS::Serverless::StateMachine`'s `DefinitionUri` and fills in through its
//! `DefinitionSubstitutions`. Every test that inspects or runs a definition loads it here.

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde_json::Value;

use crate::repo_root;

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
