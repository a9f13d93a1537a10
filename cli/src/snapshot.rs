//! What `leasehold serve`'s operator views (the page's listing and counts, `/summary`, the
//! gauges of `/metrics`) read instead of the store: one snapshot of the table, refreshed by a
//! bounded scan (at most [`SCRAPE_ITEMS`] items, eventually consistent on
//! DynamoDB) only when a view asks and the snapshot is older than `--scan-every`, one scan at
//! a time however many pages and scrapers ask; between scans, the writes this server makes
//! itself (every write its store answers) are applied to it as they land. Other writers' changes
//! (the Lambda functions, other servers) appear at the next scan. DESIGN.md, "Observability of
//! `leasehold serve`".

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold::store::{ScanKind, Store};
use leasehold::Record;

/// Most items one scan of the operator views' snapshot reads.
pub const SCRAPE_ITEMS: usize = 10_000;

/// A snapshot of the table, as the views read it.
#[derive(Clone)]
pub struct View {
    pub items: Arc<BTreeMap<String, Record>>,
    /// The scan read every item (not cut at [`SCRAPE_ITEMS`]).
    pub complete: bool,
    /// How old the scan is (this server's own writes since are in `items`).
    pub age: Duration,
    /// Scans this server has made for its views so far.
    pub scans: u64,
}

struct Taken {
    /// Shared with the views handed out; a write copies it only while one holds it.
    items: Arc<BTreeMap<String, Record>>,
    complete: bool,
    at: Instant,
}

/// The snapshot: taken by [`Snapshot::view`], kept current with this server's writes by
/// [`Snapshot::wrote`].
pub struct Snapshot {
    store: Arc<dyn Store>,
    every: Duration,
    taken: Mutex<Option<Taken>>,
    /// Held while a scan runs: the views that ask meanwhile wait for it instead of scanning.
    scanning: tokio::sync::Mutex<()>,
    scans: std::sync::atomic::AtomicU64,
}

impl Snapshot {
    /// A snapshot of `store` (its scans are not applied again as writes), refreshed when older
    /// than `every`.
    pub fn new(store: Arc<dyn Store>, every: Duration) -> Snapshot {
        Snapshot {
            store,
            every,
            taken: Mutex::new(None),
            scanning: tokio::sync::Mutex::new(()),
            scans: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn scans(&self) -> u64 {
        self.scans.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn fresh(&self) -> Option<View> {
        let t = self.taken.lock().unwrap();
        let t = t.as_ref()?;
        let age = t.at.elapsed();
        (age < self.every).then(|| View { items: t.items.clone(), complete: t.complete, age, scans: self.scans() })
    }

    /// The snapshot, scanned again first if it is older than `--scan-every` (one scan at a
    /// time: whoever asks while one runs gets its result).
    pub async fn view(&self) -> leasehold::Result<View> {
        if let Some(v) = self.fresh() {
            return Ok(v);
        }
        let _one = self.scanning.lock().await;
        if let Some(v) = self.fresh() {
            return Ok(v);
        }
        let (items, complete) = self.scan().await?;
        self.scans.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let items: Arc<BTreeMap<String, Record>> = Arc::new(items.into_iter().map(|r| (r.key.clone(), r)).collect());
        let view = View { items: items.clone(), complete, age: Duration::ZERO, scans: self.scans() };
        *self.taken.lock().unwrap() = Some(Taken { items, complete, at: Instant::now() });
        Ok(view)
    }

    /// At most [`SCRAPE_ITEMS`] items; `true` when that was all of them.
    async fn scan(&self) -> leasehold::Result<(Vec<Record>, bool)> {
        let (mut items, mut start) = (Vec::new(), None::<String>);
        loop {
            let page = self.store.scan(&ScanKind::Snapshot, start.as_deref(), 1000).await?;
            items.extend(page.items);
            match page.next {
                Some(s) if items.len() < SCRAPE_ITEMS => start = Some(s),
                Some(_) => return Ok((items, false)),
                None => return Ok((items, true)),
            }
        }
    }

    /// A write of this server landed: `record` is the item as written, `None` when it was
    /// deleted. (A snapshot not taken yet has nothing to keep current.)
    pub fn wrote(&self, key: &str, record: Option<&Record>) {
        if let Some(t) = self.taken.lock().unwrap().as_mut() {
            let items = Arc::make_mut(&mut t.items);
            match record {
                Some(r) => {
                    items.insert(key.to_string(), r.clone());
                }
                None => {
                    items.remove(key);
                }
            }
        }
    }
}
