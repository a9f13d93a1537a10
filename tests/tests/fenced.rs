//! Fenced writes on DynamoDB Local: the fence guard on PutItem, UpdateItem, DeleteItem and
//! transaction items (stale fences refused with the fence seen, equal and higher accepted and
//! recorded), the caller's own condition, names and values kept through the merge, and the
//! lease-live commit refused once the lease expired, was released or was taken over.

use std::time::Duration;

use aws_sdk_dynamodb::types::{AttributeValue, ConditionCheck, Delete, Put, TransactWriteItem, Update};
use aws_sdk_dynamodb::Client;
use leasehold::fenced::{recorded_fence, FenceGuard, FencedError, Item, DEFAULT_ATTRIBUTE};
use leasehold::store::DynamoStore;
use leasehold::{AcquireOptions, Coordinator};
use leasehold_tests::{dynamo_local, guarded_table, test_config};

struct Env {
    client: Client,
    /// The guarded resource: a table keyed by `id`.
    table: String,
    /// The lease table.
    leases: String,
    coord: Coordinator,
}

async fn env() -> Env {
    let local = tokio::task::spawn_blocking(dynamo_local).await.expect("dynamo local");
    let store = local.store().await;
    let client = local.client().await;
    let table = guarded_table(&client).await;
    let leases = store.table().to_string();
    let coord = Coordinator::new(std::sync::Arc::new(DynamoStore::new(client.clone(), leases.clone())), test_config());
    Env { client, table, leases, coord }
}

fn s(v: &str) -> AttributeValue {
    AttributeValue::S(v.to_string())
}

fn n(v: u64) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

async fn get(e: &Env, id: &str) -> Option<Item> {
    e.client.get_item().table_name(&e.table).key("id", s(id)).consistent_read(true).send().await.unwrap().item
}

fn num(item: &Item, attr: &str) -> u64 {
    match item.get(attr) {
        Some(AttributeValue::N(v)) => v.parse().unwrap(),
        other => panic!("{attr}: {other:?} in {item:?}"),
    }
}

async fn put(e: &Env, fence: u64, id: &str, value: &str) -> Result<(), FencedError> {
    let b = e.client.put_item().table_name(&e.table).item("id", s(id)).item("value", s(value));
    FenceGuard::new(fence).send_put(b).await.map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_is_refused_below_the_recorded_fence_and_records_the_fence() {
    let e = env().await;
    put(&e, 10, "a", "ten").await.expect("first write, no fence recorded");
    assert_eq!(recorded_fence(&get(&e, "a").await.unwrap(), DEFAULT_ATTRIBUTE), Some(10));
    put(&e, 10, "a", "ten again").await.expect("an equal fence is accepted");
    put(&e, 12, "a", "twelve").await.expect("a higher fence is accepted");
    match put(&e, 11, "a", "stale").await {
        Err(FencedError::Fenced { seen: 12, index: None }) => {}
        other => panic!("a stale put must be Fenced {{ seen: 12 }}: {other:?}"),
    }
    let item = get(&e, "a").await.unwrap();
    assert_eq!(item.get("value"), Some(&s("twelve")), "the stale write did not land");
    assert_eq!(num(&item, DEFAULT_ATTRIBUTE), 12);

    // A configured attribute name, and a caller's own condition on a put.
    let guard = FenceGuard::new(3).with_attribute("gen");
    let b = e.client.put_item().table_name(&e.table).item("id", s("b")).item("v", n(1));
    guard.send_put(b).await.expect("put with gen");
    assert_eq!(num(&get(&e, "b").await.unwrap(), "gen"), 3);
    let b = e
        .client
        .put_item()
        .table_name(&e.table)
        .item("id", s("b"))
        .item("v", n(2))
        .condition_expression("attribute_not_exists(id)");
    match FenceGuard::new(4).with_attribute("gen").send_put(b).await {
        Err(FencedError::ConditionFailed { index: None, item: Some(item) }) => assert_eq!(item.get("v"), Some(&n(1))),
        other => panic!("the caller's failing condition must be ConditionFailed with the item: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_keeps_the_callers_condition_names_and_values() {
    let e = env().await;
    let update = |fence: u64, amount: u64| {
        let b = e
            .client
            .update_item()
            .table_name(&e.table)
            .key("id", s("acct"))
            .update_expression("REMOVE note SET #balance = if_not_exists(#balance, :zero) + :amount ADD #count :one")
            .condition_expression("attribute_not_exists(#balance) OR #balance < :cap")
            .expression_attribute_names("#balance", "balance")
            .expression_attribute_names("#count", "count")
            .expression_attribute_values(":amount", n(amount))
            .expression_attribute_values(":zero", n(0))
            .expression_attribute_values(":one", n(1))
            .expression_attribute_values(":cap", n(100));
        async move { FenceGuard::new(fence).send_update(b).await }
    };
    update(5, 60).await.expect("first update");
    let item = get(&e, "acct").await.unwrap();
    assert_eq!((num(&item, "balance"), num(&item, "count"), num(&item, DEFAULT_ATTRIBUTE)), (60, 1, 5));

    match update(4, 1).await {
        Err(FencedError::Fenced { seen: 5, index: None }) => {}
        other => panic!("a stale update must be Fenced {{ seen: 5 }}: {other:?}"),
    }
    update(7, 50).await.expect("a higher fence, the caller's condition holds (60 < 100)");
    let item = get(&e, "acct").await.unwrap();
    assert_eq!((num(&item, "balance"), num(&item, "count"), num(&item, DEFAULT_ATTRIBUTE)), (110, 2, 7));

    // The caller's condition now fails (110 >= 100) although the fence passes.
    match update(8, 1).await {
        Err(FencedError::ConditionFailed { index: None, item: Some(item) }) => {
            assert_eq!(num(&item, "balance"), 110);
            assert_eq!(num(&item, DEFAULT_ATTRIBUTE), 7);
        }
        other => panic!("the caller's failing condition must be ConditionFailed, not Fenced: {other:?}"),
    }
    // Both fail: the stale fence is what is reported.
    assert!(matches!(update(6, 1).await, Err(FencedError::Fenced { seen: 7, .. })));
    let item = get(&e, "acct").await.unwrap();
    assert_eq!((num(&item, "balance"), num(&item, DEFAULT_ATTRIBUTE)), (110, 7), "no refused update landed");

    // An update without a SET clause gains one.
    let b = e
        .client
        .update_item()
        .table_name(&e.table)
        .key("id", s("acct"))
        .update_expression("ADD #count :one")
        .expression_attribute_names("#count", "count")
        .expression_attribute_values(":one", n(1));
    FenceGuard::new(9).send_update(b).await.expect("ADD-only update");
    let item = get(&e, "acct").await.unwrap();
    assert_eq!((num(&item, "count"), num(&item, DEFAULT_ATTRIBUTE)), (3, 9));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placeholders_that_collide_are_refused() {
    let e = env().await;
    let g = FenceGuard::new(1);
    let b = e.client.update_item().table_name(&e.table).key("id", s("x")).update_expression("SET #lh_fence = :v");
    let b = b.expression_attribute_names("#lh_fence", "other").expression_attribute_values(":v", n(1));
    assert!(matches!(g.send_update(b).await, Err(FencedError::Invalid(m)) if m.contains("#lh_fence")));
    let b = e.client.put_item().table_name(&e.table).item("id", s("x")).condition_expression("v <> :lh_fence");
    let b = b.expression_attribute_values(":lh_fence", n(1));
    assert!(matches!(g.send_put(b).await, Err(FencedError::Invalid(m)) if m.contains(":lh_fence")));
    assert!(get(&e, "x").await.is_none(), "nothing was written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_is_fenced_but_leaves_no_fence_behind() {
    let e = env().await;
    put(&e, 5, "d", "five").await.unwrap();
    let del = |fence: u64| {
        let b = e.client.delete_item().table_name(&e.table).key("id", s("d"));
        async move { FenceGuard::new(fence).send_delete(b).await }
    };
    assert!(matches!(del(4).await, Err(FencedError::Fenced { seen: 5, index: None })));
    assert!(get(&e, "d").await.is_some(), "the stale delete did not land");
    del(5).await.expect("an equal fence deletes");
    assert!(get(&e, "d").await.is_none());
    // Documented: the deleted item kept no fence, so a stale write to it is accepted.
    put(&e, 4, "d", "stale after delete").await.expect("accepted: a delete records no fence");
}

fn update_item(table: &str, id: &str, value: &str) -> TransactWriteItem {
    let u = Update::builder()
        .table_name(table)
        .key("id", s(id))
        .update_expression("SET #v = :v")
        .expression_attribute_names("#v", "value")
        .expression_attribute_values(":v", s(value))
        .build()
        .unwrap();
    TransactWriteItem::builder().update(u).build()
}

fn put_item(table: &str, id: &str, value: &str, condition: Option<&str>) -> TransactWriteItem {
    let p = Put::builder()
        .table_name(table)
        .item("id", s(id))
        .item("value", s(value))
        .set_condition_expression(condition.map(str::to_string));
    TransactWriteItem::builder().put(p.build().unwrap()).build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_items_are_fenced_one_by_one() {
    let e = env().await;
    let tx = |fence: u64, items: Vec<TransactWriteItem>| {
        let b = e.client.transact_write_items().set_transact_items(Some(items));
        async move { FenceGuard::new(fence).send_transaction(b).await }
    };
    tx(3, vec![update_item(&e.table, "t1", "a"), put_item(&e.table, "t2", "b", None)]).await.expect("first");
    put(&e, 9, "t3", "nine").await.unwrap();
    let check = ConditionCheck::builder()
        .table_name(&e.table)
        .key("id", s("t2"))
        .condition_expression("attribute_exists(id)")
        .build()
        .unwrap();
    let del = Delete::builder().table_name(&e.table).key("id", s("t3")).build().unwrap();
    match tx(
        4,
        vec![
            update_item(&e.table, "t1", "c"),
            TransactWriteItem::builder().condition_check(check.clone()).build(),
            TransactWriteItem::builder().delete(del.clone()).build(),
        ],
    )
    .await
    {
        Err(FencedError::Fenced { seen: 9, index: Some(2) }) => {}
        other => panic!("the delete of an item fenced at 9 must be Fenced at index 2: {other:?}"),
    }
    assert_eq!(get(&e, "t1").await.unwrap().get("value"), Some(&s("a")), "nothing of the transaction landed");

    // The caller's own condition fails on item 1: ConditionFailed { index: 1 }.
    match tx(5, vec![update_item(&e.table, "t1", "c"), put_item(&e.table, "t2", "d", Some("attribute_not_exists(id)"))])
        .await
    {
        Err(FencedError::ConditionFailed { index: Some(1), item: Some(item) }) => {
            assert_eq!(item.get("value"), Some(&s("b")))
        }
        other => panic!("the caller's failing condition must be ConditionFailed at index 1: {other:?}"),
    }
    tx(9, vec![update_item(&e.table, "t1", "e"), TransactWriteItem::builder().condition_check(check).build()])
        .await
        .expect("fence 9 commits");
    let t1 = get(&e, "t1").await.unwrap();
    assert_eq!((t1.get("value"), num(&t1, DEFAULT_ATTRIBUTE)), (Some(&s("e")), 9));
    assert_eq!(num(&get(&e, "t2").await.unwrap(), DEFAULT_ATTRIBUTE), 3);
}

// ---- commit only while the lease is live ----------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_live_commit_is_refused_after_expiry_release_and_takeover() {
    let e = env().await;
    let c = &e.coord;
    let write =
        |id: &str, value: &str| e.client.transact_write_items().transact_items(put_item(&e.table, id, value, None));
    let refused = |r: Result<_, FencedError>, what: &str| match r {
        Err(FencedError::LeaseLost { lease: Some(l) }) => l,
        other => panic!("{what}: must be LeaseLost with the lease item: {other:?}"),
    };

    // Live: commits.
    // 3 s: the commit must land while the lease is live, on a loaded machine too.
    let lease = c.acquire("k-expiry", "a", Some(Duration::from_secs(3)), AcquireOptions::default()).await.unwrap();
    c.commit_while_live(&e.leases, &lease.key, &lease.lease_id, lease.fence, write("x1", "live"))
        .await
        .expect("commit while live");
    // Expired (the holder was paused past its expiry; nobody took over).
    let left = lease.expires_at_ms.unwrap().saturating_sub(c.now_ms());
    tokio::time::sleep(Duration::from_millis(left + 100)).await;
    let r = c.commit_while_live(&e.leases, &lease.key, &lease.lease_id, lease.fence, write("x2", "expired")).await;
    refused(r, "after expiry");
    assert!(get(&e, "x2").await.is_none());

    // Within the skew margin of expiry: refused although not yet expired.
    let lease =
        c.acquire("k-margin", "a", Some(Duration::from_millis(1_000)), AcquireOptions::default()).await.unwrap();
    let mut wide = test_config();
    wide.skew_margin = Duration::from_millis(5_000);
    let wide = Coordinator::new(c.store().clone(), wide);
    let r = wide.commit_while_live(&e.leases, &lease.key, &lease.lease_id, lease.fence, write("x3", "margin")).await;
    refused(r, "within the skew margin");

    // Released.
    let lease = c.acquire("k-release", "a", Some(Duration::from_secs(30)), AcquireOptions::default()).await.unwrap();
    c.release(&lease.key, &lease.lease_id).await.unwrap();
    let r = c.commit_while_live(&e.leases, &lease.key, &lease.lease_id, lease.fence, write("x4", "released")).await;
    refused(r, "after release");

    // Taken over after expiry: the new holder commits, the old one cannot.
    let old = c.acquire("k-takeover", "a", Some(Duration::from_secs(2)), AcquireOptions::default()).await.unwrap();
    let left = old.expires_at_ms.unwrap().saturating_sub(c.now_ms());
    tokio::time::sleep(Duration::from_millis(left + 100)).await;
    let new = c.acquire("k-takeover", "b", Some(Duration::from_secs(30)), AcquireOptions::default()).await.unwrap();
    c.commit_while_live(&e.leases, &new.key, &new.lease_id, new.fence, write("x5", "new")).await.expect("new holder");
    let r = c.commit_while_live(&e.leases, &old.key, &old.lease_id, old.fence, write("x5", "old")).await;
    let l = refused(r, "after takeover");
    assert_eq!(l.get("lease_id"), Some(&s(new.lease_id.expose())), "the lease item reported is the new holder's");
    assert_eq!(get(&e, "x5").await.unwrap().get("value"), Some(&s("new")));
    for id in ["x3", "x4"] {
        assert!(get(&e, id).await.is_none(), "{id}: a refused commit wrote");
    }

    // The caller's own condition fails on item 1 while the lease is live.
    let tx = e
        .client
        .transact_write_items()
        .transact_items(put_item(&e.table, "x6", "ok", None))
        .transact_items(put_item(&e.table, "x1", "again", Some("attribute_not_exists(id)")));
    match c.commit_while_live(&e.leases, &new.key, &new.lease_id, new.fence, tx).await {
        Err(FencedError::ConditionFailed { index: Some(1), .. }) => {}
        other => panic!("the caller's failing condition must be ConditionFailed at index 1: {other:?}"),
    }
    assert!(get(&e, "x6").await.is_none(), "nothing of the refused transaction landed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_lease_offers_both() {
    let e = env().await;
    // 3 s (renewed every second): each renewal has almost two seconds to land on a loaded machine.
    let held = e.coord.hold("k-held", "h", Duration::from_secs(3), AcquireOptions::default()).await.unwrap();
    let guard = held.fence_guard();
    assert_eq!(guard.fence(), held.fence());
    // Fenced items inside a lease-live commit: both checks in one transaction.
    let item = guard.transact_item(update_item(&e.table, "h1", "held")).unwrap();
    held.commit_while_live(&e.leases, e.client.transact_write_items().transact_items(item)).await.expect("commit");
    assert_eq!(num(&get(&e, "h1").await.unwrap(), DEFAULT_ATTRIBUTE), held.fence());
    // Renewed in the background: still live after twice its duration.
    tokio::time::sleep(Duration::from_millis(6_200)).await;
    let tx = e.client.transact_write_items().transact_items(put_item(&e.table, "h2", "renewed", None));
    held.commit_while_live(&e.leases, tx).await.expect("commit after renewals");
    // A stale fence inside the commit is reported as Fenced with its index.
    put(&e, held.fence() + 1, "h3", "newer").await.unwrap();
    let item = guard.transact_item(update_item(&e.table, "h3", "stale")).unwrap();
    let tx = e.client.transact_write_items().transact_items(put_item(&e.table, "h4", "x", None)).transact_items(item);
    match held.commit_while_live(&e.leases, tx).await {
        Err(FencedError::Fenced { seen, index: Some(1) }) => assert_eq!(seen, held.fence() + 1),
        other => panic!("must be Fenced at index 1: {other:?}"),
    }
    // Taken from it (an operator's force release): LeaseLost.
    e.coord.force_release(held.key()).await.unwrap();
    let tx = e.client.transact_write_items().transact_items(put_item(&e.table, "h5", "lost", None));
    assert!(matches!(held.commit_while_live(&e.leases, tx).await, Err(FencedError::LeaseLost { .. })));
    assert!(get(&e, "h5").await.is_none());
}

/// A semaphore's holder commits while its slot is live, like a lease's holder: the lease-live
/// check finds its entry in the holders' map (the item's own `lease_id` is `-`). Refused once
/// the slot is released, expired or force-released, while another holder of the same key
/// still commits. Before, every commit of a slot's holder was `LeaseLost`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_holder_commits_while_its_slot_is_live() {
    let e = env().await;
    let c = &e.coord;
    let write =
        |id: &str, value: &str| e.client.transact_write_items().transact_items(put_item(&e.table, id, value, None));
    let slots = || AcquireOptions { slots: Some(3), ..Default::default() };
    let lost = |r: Result<_, FencedError>, what: &str| {
        assert!(matches!(r, Err(FencedError::LeaseLost { lease: Some(_) })), "{what}: must be LeaseLost: {r:?}")
    };
    let k = "k-sem";
    let a = c.acquire(k, "a", Some(Duration::from_secs(30)), slots()).await.unwrap();
    let b = c.acquire(k, "b", Some(Duration::from_secs(30)), slots()).await.unwrap();
    // 2 s: the commit must land while the slot is live, on a loaded machine too.
    let short = c.acquire(k, "short", Some(Duration::from_secs(2)), slots()).await.unwrap();
    for (l, id) in [(&a, "s1"), (&b, "s2"), (&short, "s3")] {
        c.commit_while_live(&e.leases, k, &l.lease_id, l.fence, write(id, "live")).await.expect("a live slot commits");
    }
    // Released: refused; the other holder still commits.
    c.release(k, &a.lease_id).await.unwrap();
    lost(c.commit_while_live(&e.leases, k, &a.lease_id, a.fence, write("s4", "released")).await, "released");
    c.commit_while_live(&e.leases, k, &b.lease_id, b.fence, write("s5", "b")).await.expect("b is live");
    // Expired.
    let left = short.expires_at_ms.unwrap().saturating_sub(c.now_ms());
    tokio::time::sleep(Duration::from_millis(left + 100)).await;
    lost(c.commit_while_live(&e.leases, k, &short.lease_id, short.fence, write("s6", "expired")).await, "expired");
    // Force-released (the one holder).
    c.force_release_slot(k, b.fence).await.unwrap();
    lost(c.commit_while_live(&e.leases, k, &b.lease_id, b.fence, write("s7", "evicted")).await, "force-released");
    // A lease_id that never held a slot.
    let never = leasehold::LeaseId::generate();
    lost(c.commit_while_live(&e.leases, k, &never, b.fence, write("s8", "never")).await, "never a holder");
    for id in ["s4", "s6", "s7", "s8"] {
        assert!(get(&e, id).await.is_none(), "{id}: a refused commit wrote");
    }
}
