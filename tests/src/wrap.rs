//! One wrapper store for every test that changes what a real store does: a test writes the
//! one behaviour it changes as an [`Intercept`] (each method defaults to the store's own) and
//! wraps a real store in it with [`wrap`]. The wrapper derefs to the intercept, so a test
//! reads its counters and gates through the store it gave the coordinator.

use std::ops::Deref;
use std::sync::Arc;

use async_trait::async_trait;
use leasehold::store::{Condition, Mutation, Page, ScanKind, Store, Write};
use leasehold::{ClockSamples, Record, Result};

/// What a test changes of a store's behaviour. Every method gets the real store and, unless
/// overridden, passes the call to it unchanged.
#[async_trait]
pub trait Intercept: Send + Sync + 'static {
    async fn get(&self, store: &Arc<dyn Store>, key: &str) -> Result<Option<Record>> {
        store.get(key).await
    }
    async fn update(&self, store: &Arc<dyn Store>, key: &str, c: &Condition, m: &Mutation) -> Result<Write> {
        store.update(key, c, m).await
    }
    async fn delete(&self, store: &Arc<dyn Store>, key: &str, c: &Condition) -> Result<Write> {
        store.delete(key, c).await
    }
    async fn scan(&self, store: &Arc<dyn Store>, k: &ScanKind, start: Option<&str>, limit: u32) -> Result<Page> {
        store.scan(k, start, limit).await
    }
    /// Whether the coordinator sees the store's clock evidence (DynamoDB's `Date` samples)
    /// through the wrapper. `false`: it sees none and judges by its own clock, as over the
    /// embedded store.
    fn passes_clock(&self) -> bool {
        false
    }
}

/// A real store with one test's [`Intercept`] in front of it.
pub struct Wrapped<I> {
    pub inner: Arc<dyn Store>,
    pub with: I,
}

/// Wraps `inner` in `with`.
pub fn wrap<I: Intercept>(inner: Arc<dyn Store>, with: I) -> Arc<Wrapped<I>> {
    Arc::new(Wrapped { inner, with })
}

impl<I> Deref for Wrapped<I> {
    type Target = I;
    fn deref(&self) -> &I {
        &self.with
    }
}

#[async_trait]
impl<I: Intercept> Store for Wrapped<I> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    async fn get(&self, key: &str) -> Result<Option<Record>> {
        self.with.get(&self.inner, key).await
    }
    async fn update(&self, key: &str, c: &Condition, m: &Mutation) -> Result<Write> {
        self.with.update(&self.inner, key, c, m).await
    }
    async fn delete(&self, key: &str, c: &Condition) -> Result<Write> {
        self.with.delete(&self.inner, key, c).await
    }
    async fn scan(&self, k: &ScanKind, start: Option<&str>, limit: u32) -> Result<Page> {
        self.with.scan(&self.inner, k, start, limit).await
    }
    fn clock(&self) -> Option<&ClockSamples> {
        if self.with.passes_clock() {
            self.inner.clock()
        } else {
            None
        }
    }
}
