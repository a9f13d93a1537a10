//! CloudFormation templates as the tests read them: template.yaml (or an earlier version of it,
//! from git) as JSON through tests/template_json.py, and the values CloudFormation would give
//! its parameters and conditions (`Ref` to a parameter, `Fn::If`, `Fn::Equals`, `Fn::Not`,
//! `Fn::And`, `Fn::Or`, `Fn::Join`, `AWS::NoValue`), so that a resource's properties can be
//! compared as deployed with given parameter values.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Map, Value};

use crate::{repo_root, tools_dir};

/// The release whose template a stack made before this version's table changes has (the
/// `state` index projecting ALL, no `queue` index, no stream): v0.2.0, commit cf5d284.
pub const BEFORE_TAGS: &str = "v0.2.0";

/// The released versions whose templates tests/releases/ keeps (`<tag>.template.yaml`, each
/// the tag's template.yaml as released), oldest first. Kept as files, not read from git: a
/// shallow or tagless clone (CI's) has the same releases to upgrade from.
pub fn releases() -> Vec<String> {
    let dir = repo_root().join("tests/releases");
    let mut tags: Vec<(Vec<u64>, String)> = std::fs::read_dir(&dir)
        .expect("tests/releases")
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_suffix(".template.yaml").map(str::to_string))
        .map(|t| (t.trim_start_matches('v').split('.').map(|n| n.parse().expect("a version number")).collect(), t))
        .collect();
    tags.sort();
    tags.into_iter().map(|(_, t)| t).collect()
}

/// Runs tests/template_json.py (`raw`, `transformed` or `create-only`) with the tools' Python.
pub fn template_json(args: &[&str]) -> Value {
    let python = tools_dir().join("venv/bin/python");
    assert!(python.exists(), "{} is not installed: run scripts/install-test-deps.sh", python.display());
    let out = Command::new(&python)
        .arg(repo_root().join("tests/template_json.py"))
        .args(args)
        .env("AWS_DEFAULT_REGION", "us-east-1")
        .current_dir(repo_root())
        .output()
        .expect("run template_json.py");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "template_json.py {args:?}:\n{text}{}", String::from_utf8_lossy(&out.stderr));
    let start = text.find('{').expect("JSON output");
    serde_json::from_str(&text[start..]).unwrap_or_else(|e| panic!("template_json.py {args:?}: {e}"))
}

/// A released version's template (`version` a tag kept in tests/releases/), copied into `dir`
/// as template.yaml (the SAM transform reads it there).
pub fn template_at(version: &str, dir: &Path) -> PathBuf {
    let kept = repo_root().join("tests/releases").join(format!("{version}.template.yaml"));
    let text = std::fs::read(&kept).unwrap_or_else(|e| panic!("{}: {e}", kept.display()));
    let file = dir.join("template.yaml");
    std::fs::write(&file, text).expect("write the earlier template");
    file
}

/// The parameter values a stack gets: each parameter's default, then `overrides`.
pub fn parameters(template: &Value, overrides: &[(&str, &str)]) -> BTreeMap<String, Value> {
    let mut p = BTreeMap::new();
    for (name, def) in template["Parameters"].as_object().into_iter().flatten() {
        let default = def.get("Default").cloned().unwrap_or(Value::String(String::new()));
        let v = match (def["Type"].as_str(), default) {
            (Some("CommaDelimitedList"), Value::String(s)) => {
                Value::Array(s.split(',').map(|x| Value::String(x.to_string())).collect())
            }
            (_, Value::Number(n)) => Value::String(n.to_string()),
            (_, d) => d,
        };
        p.insert(name.clone(), v);
    }
    for (k, v) in overrides {
        assert!(p.contains_key(*k), "no parameter {k}");
        p.insert(k.to_string(), Value::String(v.to_string()));
    }
    p
}

/// A template with its parameter values: resolves what CloudFormation resolves before it
/// compares a resource's properties.
pub struct Resolver<'a> {
    pub template: &'a Value,
    pub params: BTreeMap<String, Value>,
}

impl<'a> Resolver<'a> {
    pub fn new(template: &'a Value, overrides: &[(&str, &str)]) -> Resolver<'a> {
        Resolver { template, params: parameters(template, overrides) }
    }

    /// The value of condition `name`.
    pub fn condition(&self, name: &str) -> bool {
        let c = &self.template["Conditions"][name];
        assert!(!c.is_null(), "no condition {name}");
        self.truth(c)
    }

    fn truth(&self, v: &Value) -> bool {
        let args = |k: &str| v[k].as_array().cloned().unwrap_or_default();
        if let Some(name) = v.get("Condition").and_then(Value::as_str) {
            return self.condition(name);
        }
        if v.get("Fn::Equals").is_some() {
            let a = args("Fn::Equals");
            return self.resolve(&a[0]) == self.resolve(&a[1]);
        }
        if v.get("Fn::Not").is_some() {
            return !self.truth(&args("Fn::Not")[0]);
        }
        if v.get("Fn::And").is_some() {
            return args("Fn::And").iter().all(|c| self.truth(c));
        }
        if v.get("Fn::Or").is_some() {
            return args("Fn::Or").iter().any(|c| self.truth(c));
        }
        panic!("cannot evaluate the condition {v}")
    }

    /// `v` with parameters, conditions and `AWS::NoValue` resolved; every other intrinsic
    /// function is kept as written (its own arguments resolved).
    pub fn resolve(&self, v: &Value) -> Value {
        self.resolve_opt(v).unwrap_or(Value::Null)
    }

    fn resolve_opt(&self, v: &Value) -> Option<Value> {
        match v {
            Value::Array(a) => Some(Value::Array(a.iter().filter_map(|x| self.resolve_opt(x)).collect())),
            Value::Object(o) if o.len() == 1 => self.intrinsic(o),
            Value::Object(o) => {
                Some(Value::Object(o.iter().filter_map(|(k, x)| Some((k.clone(), self.resolve_opt(x)?))).collect()))
            }
            other => Some(other.clone()),
        }
    }

    fn intrinsic(&self, o: &Map<String, Value>) -> Option<Value> {
        let (k, arg) = o.iter().next().expect("one key");
        match k.as_str() {
            "Ref" if arg == "AWS::NoValue" => None,
            "Ref" => Some(self.params.get(arg.as_str().unwrap_or_default()).cloned().unwrap_or_else(|| {
                let mut m = Map::new();
                m.insert(k.clone(), arg.clone());
                Value::Object(m)
            })),
            "Fn::If" => {
                let a = arg.as_array().expect("Fn::If [condition, then, else]");
                let chosen = if self.condition(a[0].as_str().expect("condition name")) { &a[1] } else { &a[2] };
                self.resolve_opt(chosen)
            }
            "Fn::Join" => {
                let a = arg.as_array().expect("Fn::Join [sep, list]");
                let list = self.resolve(&a[1]);
                let parts: Option<Vec<String>> =
                    list.as_array().and_then(|l| l.iter().map(|x| x.as_str().map(str::to_string)).collect());
                match parts {
                    Some(p) => Some(Value::String(p.join(a[0].as_str().unwrap_or_default()))),
                    None => {
                        Some(Value::Object([(k.clone(), Value::Array(vec![a[0].clone(), list]))].into_iter().collect()))
                    }
                }
            }
            _ => {
                let mut m = Map::new();
                m.insert(k.clone(), self.resolve(arg));
                Some(Value::Object(m))
            }
        }
    }
}
