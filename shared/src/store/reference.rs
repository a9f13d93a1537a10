//! The reference evaluation of a write, written once: read the item, check the [`Condition`]
//! ([`Condition::holds`]), apply the [`Mutation`] ([`Mutation::apply`]), write the result. A
//! store that evaluates writes itself runs it over its own [`Table`], atomically: the embedded
//! store inside its SQLite write transaction (`sqlite.rs`), the test store under its lock
//! (`testing::SimStore`). The DynamoDB store sends the same writes as expressions instead
//! (`dynamo/render.rs`), and the protocol suite checks that both agree.

use super::{Condition, Mutation, Write};
use crate::model::Record;

/// The items a reference evaluation reads and writes, inside whatever makes it atomic.
pub trait Table {
    /// A failure of the table itself (the evaluation stops, nothing more is written).
    type Error;

    /// The item of `key` (`None`: no item).
    fn read(&mut self, key: &str) -> Result<Option<Record>, Self::Error>;

    /// Writes `new` at `key`: the item `mutation` made of `old` (`None`: there was no item).
    fn put(&mut self, key: &str, old: Option<Record>, new: &Record, mutation: &Mutation) -> Result<(), Self::Error>;

    /// Deletes the item `old` at `key`.
    fn remove(&mut self, key: &str, old: &Record) -> Result<(), Self::Error>;
}

/// A conditional update of `key`: `mutation` applied and written if `condition` holds for the
/// item, else the item as it was (`ALL_OLD`).
pub fn update<T: Table>(
    table: &mut T,
    key: &str,
    condition: &Condition,
    mutation: &Mutation,
) -> Result<Write, T::Error> {
    let old = table.read(key)?;
    if !condition.holds(old.as_ref()) {
        return Ok(Write::Rejected(old));
    }
    let new = mutation.apply(key, old.as_ref());
    table.put(key, old, &new, mutation)?;
    Ok(Write::Applied(new))
}

/// A conditional delete of `key`: the item deleted (and answered) if `condition` holds for it.
/// No item: nothing to delete, whatever the condition (a waiter item two servers of one queue
/// both delete).
pub fn delete<T: Table>(table: &mut T, key: &str, condition: &Condition) -> Result<Write, T::Error> {
    match table.read(key)? {
        Some(item) if condition.holds(Some(&item)) => {
            table.remove(key, &item)?;
            Ok(Write::Applied(item))
        }
        old => Ok(Write::Rejected(old)),
    }
}
