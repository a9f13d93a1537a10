//! The toolkit each kind of lease renders its writes with (`store/kinds/`): a condition as
//! DESIGN.md prints it ([`Guard`]), and an expression under construction ([`Expr`]) whose
//! aliases and placeholders are bound once each. It knows no condition nor mutation: the kinds
//! render theirs with it, and `render` puts a write's two expressions together.

use std::collections::HashMap;

use aws_sdk_dynamodb::types::AttributeValue;

use super::item::{str_, Item};
use crate::model::{LeaseId, Record};
use crate::store::table::attr;

/// A condition as DESIGN.md prints it: attribute names as they are (the reserved words through
/// `#name` aliases, see `attr::RESERVED`), and `:name` placeholders with their values.
pub(in crate::store) struct Guard {
    text: &'static str,
    values: Vec<(&'static str, AttributeValue)>,
    /// Aliases whose name is not the alias itself: `#lease_id`, a semaphore holder's key in
    /// the `sem_holders` map.
    names: Vec<(&'static str, String)>,
}

/// The condition `text` with its placeholders' values.
pub(in crate::store) fn guard(
    text: &'static str,
    values: impl IntoIterator<Item = (&'static str, AttributeValue)>,
) -> Guard {
    Guard { text, values: values.into_iter().collect(), names: Vec::new() }
}

/// A guard on the semaphore holder `lease_id`'s entry (`sem_holders.#lease_id`).
pub(in crate::store) fn slot_guard(
    text: &'static str,
    lease_id: &LeaseId,
    values: impl IntoIterator<Item = (&'static str, AttributeValue)>,
) -> Guard {
    Guard { names: vec![("lease_id", lease_id.expose().to_string())], ..guard(text, values) }
}

/// A lease_id as a value.
pub(in crate::store) fn id(lease_id: &LeaseId) -> AttributeValue {
    str_(lease_id.expose())
}

/// How DynamoDB writes a mutation.
// Returned once per write and moved into its request: boxing the item would add an allocation
// to every acquire.
#[allow(clippy::large_enum_variant)]
pub(in crate::store) enum Request {
    /// A `PutItem` of this whole item, which is this record: nothing of the previous item
    /// survives.
    Put(Item, Record),
    /// An `UpdateItem` of the existing item, its `UpdateExpression` rendered into the [`Expr`].
    Update,
}

/// The `#name` aliases an expression's text uses, and its `:name` placeholders.
fn tokens(text: &str, sigil: char) -> impl Iterator<Item = &str> {
    text.match_indices(sigil).map(move |(i, _)| {
        let rest = &text[i + 1..];
        &rest[..rest.find(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_')).unwrap_or(rest.len())]
    })
}

/// An expression under construction: attribute names as they are, except the reserved words
/// (`attr::RESERVED`), which go through `#name` aliases; `:value` placeholders for every value.
#[derive(Default)]
pub(in crate::store) struct Expr {
    set: Vec<String>,
    remove: Vec<String>,
    names: HashMap<String, String>,
    values: HashMap<String, AttributeValue>,
}

impl Expr {
    /// The `ConditionExpression` of `g`, its aliases and values bound.
    pub(in crate::store) fn condition(&mut self, g: Guard) -> String {
        for a in tokens(g.text, '#') {
            let name = g.names.iter().find(|(n, _)| *n == a).map_or(a.to_string(), |(_, v)| v.clone());
            self.names.insert(format!("#{a}"), name);
        }
        for (name, value) in g.values {
            self.v(name, value);
        }
        debug_assert!(tokens(g.text, ':').all(|p| self.values.contains_key(&format!(":{p}"))), "{}", g.text);
        g.text.to_string()
    }

    /// The alias map, or none when no reserved word was used (an empty map is invalid).
    pub(in crate::store) fn names(&mut self) -> Option<HashMap<String, String>> {
        Some(std::mem::take(&mut self.names)).filter(|n| !n.is_empty())
    }

    /// The value map, or none when the expressions use no value (an empty map is invalid).
    pub(in crate::store) fn values(&mut self) -> Option<HashMap<String, AttributeValue>> {
        Some(std::mem::take(&mut self.values)).filter(|v| !v.is_empty())
    }

    /// `SET ...` and `REMOVE ...` of the mutations rendered.
    pub(in crate::store) fn update_expression(&self) -> String {
        let mut parts = Vec::new();
        if !self.set.is_empty() {
            parts.push(format!("SET {}", self.set.join(", ")));
        }
        if !self.remove.is_empty() {
            parts.push(format!("REMOVE {}", self.remove.join(", ")));
        }
        parts.join(" ")
    }

    /// The attribute's name in an expression: itself, or its `#name` alias (a reserved word).
    pub(in crate::store) fn n(&mut self, attribute: &str) -> String {
        if !attr::RESERVED.contains(&attribute) {
            return attribute.to_string();
        }
        let p = format!("#{attribute}");
        self.names.insert(p.clone(), attribute.to_string());
        p
    }

    /// The placeholder `:name`, bound to `value`.
    pub(in crate::store) fn v(&mut self, name: &str, value: AttributeValue) -> String {
        let p = format!(":{name}");
        // One placeholder, one value: a condition and an update naming the same placeholder for
        // two values would silently check the wrong one.
        match self.values.entry(p.clone()) {
            std::collections::hash_map::Entry::Occupied(old) => {
                assert_eq!(old.get(), &value, "placeholder {p} bound to two values")
            }
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(value);
            }
        }
        p
    }

    /// `attribute = rhs`.
    pub(in crate::store) fn set(&mut self, attribute: &str, rhs: String) {
        let a = self.n(attribute);
        self.set.push(format!("{a} = {rhs}"));
    }

    /// `attribute = :attribute`.
    pub(in crate::store) fn set_value(&mut self, attribute: &str, value: AttributeValue) {
        let v = self.v(attribute, value);
        self.set(attribute, v);
    }

    /// `attribute = :attribute`, or `REMOVE attribute` without a value.
    pub(in crate::store) fn set_or_remove(&mut self, attribute: &str, value: Option<AttributeValue>) {
        match value {
            Some(v) => self.set_value(attribute, v),
            None => self.remove(attribute),
        }
    }

    pub(in crate::store) fn remove(&mut self, attribute: &str) {
        let a = self.n(attribute);
        self.remove.push(a);
    }

    /// `REMOVE` of the keep-alive's attributes (the key leaves the keep-alive index).
    pub(in crate::store) fn remove_keepalive(&mut self) {
        for a in [attr::KA_SHARD, attr::KA_UNTIL, attr::KA_EXECUTION_ARN] {
            self.remove(a);
        }
    }

    /// `sem_holders.#alias`, the alias naming the holder's lease_id.
    pub(in crate::store) fn holder_path(&mut self, alias: &str, lease_id: &LeaseId) -> String {
        self.names.insert(format!("#{alias}"), lease_id.expose().to_string());
        format!("{}.#{alias}", attr::SEM_HOLDERS)
    }

    /// `lhs = rhs` for a document path.
    pub(in crate::store) fn set_path(&mut self, lhs: String, rhs: String) {
        self.set.push(format!("{lhs} = {rhs}"));
    }

    /// `REMOVE` of a document path.
    pub(in crate::store) fn remove_path(&mut self, path: String) {
        self.remove.push(path);
    }

    /// `attribute = attribute + :one` (`-` with `minus`).
    pub(in crate::store) fn bump(&mut self, attribute: &str, minus: bool) {
        let a = self.n(attribute);
        let one = self.v("one", super::item::num(1));
        self.set(attribute, format!("{a} {} {one}", if minus { "-" } else { "+" }));
    }
}
