//! The libraries compared, behind one acquire/release interface: leasehold, the raw aws-sdk
//! floor (a bare conditional PutItem + DeleteItem) and, with `--features compare`, the
//! dynamodb-lease crate.

use std::sync::Arc;
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::types::AttributeValue;
use leasehold::store::{DynamoStore, LeaseCondition, LeaseMutation};
use leasehold::{AcquireOptions, Config, Coordinator};
use leasehold_tests::sdk_config_for;

use crate::harness::{config, LEASE};

/// One library behind a uniform acquire/release interface.
pub enum Lib {
    Leasehold(Coordinator),
    /// leasehold with a lease other than `LEASE` (M4).
    LeaseholdShort(Coordinator, Duration),
    Raw(aws_sdk_dynamodb::Client, String),
    /// The bare SDK client sending leasehold's own two requests (`raw-shaped`, with
    /// `LEASEHOLD_BENCH_SHAPED`): the acquire's PutItem of the whole lease under the free-key
    /// condition, and the release's UpdateItem answering `ALL_NEW`, with the texts leasehold
    /// renders, but no coordinator (no clock check, no record, no lease). What it costs above
    /// `raw` is the requests' shape; what leasehold costs above it is the protocol's own code.
    RawShaped(aws_sdk_dynamodb::Client, String, Box<Shaped>),
    /// dynamodb-lease; with `true`, leases are released by dropping them (the crate then
    /// deletes the item in a spawned task) instead of awaiting `Lease::release`.
    #[cfg(feature = "compare")]
    DynamodbLease(dynamodb_lease::Client, bool),
}

/// A held lease of any library.
pub enum Held {
    Leasehold(String, leasehold::LeaseId),
    Raw(String, String),
    Shaped(String, String),
    #[cfg(feature = "compare")]
    DynamodbLease(dynamodb_lease::Lease),
}

impl Lib {
    pub fn coord(&self) -> &Coordinator {
        match self {
            Lib::Leasehold(c) | Lib::LeaseholdShort(c, _) => c,
            _ => unreachable!("not leasehold"),
        }
    }

    pub fn lease(&self) -> Duration {
        match self {
            Lib::LeaseholdShort(_, d) => *d,
            _ => LEASE,
        }
    }

    pub async fn new(name: &str, endpoint: &str, table: &str) -> Lib {
        let conf = sdk_config_for(endpoint).await;
        let client = aws_sdk_dynamodb::Client::new(&conf);
        let leasehold = |c| Lib::Leasehold(Coordinator::new(Arc::new(DynamoStore::new(client.clone(), table)), c));
        match name {
            "leasehold" | "leasehold+index" => leasehold(config()),
            // `leasehold/poll=X`: leasehold with `Config::poll_attempts` X (M3 with
            // `LEASEHOLD_BENCH_POLL_ATTEMPTS`).
            n if n.starts_with("leasehold/poll=") => {
                let poll_attempts = n["leasehold/poll=".len()..].parse().expect("poll attempts");
                leasehold(Config { poll_attempts, ..config() })
            }
            "raw" => Lib::Raw(client, table.to_string()),
            "raw-shaped" => Lib::RawShaped(client, table.to_string(), Box::new(Shaped::new(Part::Whole))),
            "shaped-bare-condition" => {
                Lib::RawShaped(client, table.to_string(), Box::new(Shaped::new(Part::BareCondition)))
            }
            "shaped-delete" => Lib::RawShaped(client, table.to_string(), Box::new(Shaped::new(Part::Delete))),
            "shaped-two-attributes" => {
                Lib::RawShaped(client, table.to_string(), Box::new(Shaped::new(Part::TwoAttributes)))
            }
            #[cfg(feature = "compare")]
            "dynamodb-lease" | "dynamodb-lease/drop" => Lib::DynamodbLease(
                dynamodb_lease::Client::builder()
                    .table_name(table)
                    .lease_ttl_seconds(LEASE.as_secs() as u32)
                    .build_and_check_db(client)
                    .await
                    .expect("dynamodb-lease client"),
                name.ends_with("/drop"),
            ),
            other => panic!("unknown library {other}"),
        }
    }

    /// Acquire without waiting.
    pub async fn try_acquire(&self, key: &str, holder: &str) -> Option<Held> {
        match self {
            Lib::Leasehold(_) | Lib::LeaseholdShort(..) => {
                match self.coord().acquire(key, holder, Some(self.lease()), AcquireOptions::default()).await {
                    Ok(l) => Some(Held::Leasehold(key.into(), l.lease_id)),
                    Err(leasehold::Error::LeaseHeld { .. }) => None,
                    Err(e) => panic!("{e}"),
                }
            }
            Lib::Raw(c, t) => {
                let v = format!("{holder}-{}", Instant::now().elapsed().as_nanos());
                let r = c
                    .put_item()
                    .table_name(t)
                    .item("key", AttributeValue::S(key.into()))
                    .item("v", AttributeValue::S(v.clone()))
                    .condition_expression("attribute_not_exists(#k)")
                    .expression_attribute_names("#k", "key")
                    .send()
                    .await;
                match r {
                    Ok(_) => Some(Held::Raw(key.into(), v)),
                    Err(e) if e.as_service_error().is_some_and(|s| s.is_conditional_check_failed_exception()) => None,
                    Err(e) => panic!("{e:?}"),
                }
            }
            Lib::RawShaped(c, t, x) => x.acquire(c, t, key, holder).await,
            #[cfg(feature = "compare")]
            Lib::DynamodbLease(c, _) => c.try_acquire(key).await.expect("try_acquire").map(Held::DynamodbLease),
        }
    }

    /// Acquire with the library's own waiting.
    pub async fn acquire_wait(&self, key: &str, holder: &str, wait: Duration) -> Option<Held> {
        match self {
            Lib::Leasehold(_) | Lib::LeaseholdShort(..) => {
                match self
                    .coord()
                    .acquire(key, holder, Some(self.lease()), AcquireOptions { wait: Some(wait), ..Default::default() })
                    .await
                {
                    Ok(l) => Some(Held::Leasehold(key.into(), l.lease_id)),
                    Err(leasehold::Error::LeaseHeld { .. }) => None,
                    Err(e) => panic!("{e}"),
                }
            }
            Lib::Raw(..) | Lib::RawShaped(..) => {
                let deadline = Instant::now() + wait;
                loop {
                    if let Some(h) = self.try_acquire(key, holder).await {
                        return Some(h);
                    }
                    if Instant::now() > deadline {
                        return None;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            #[cfg(feature = "compare")]
            Lib::DynamodbLease(c, _) => c.acquire_timeout(key, wait).await.ok().map(Held::DynamodbLease),
        }
    }

    pub async fn release(&self, held: Held) {
        match (self, held) {
            (Lib::Leasehold(_) | Lib::LeaseholdShort(..), Held::Leasehold(k, id)) => {
                self.coord().release(&k, &id).await.expect("release");
            }
            (Lib::Raw(c, t), Held::Raw(k, v)) => {
                c.delete_item()
                    .table_name(t)
                    .key("key", AttributeValue::S(k))
                    .condition_expression("#v = :v")
                    .expression_attribute_names("#v", "v")
                    .expression_attribute_values(":v", AttributeValue::S(v))
                    .send()
                    .await
                    .expect("delete");
            }
            (Lib::RawShaped(c, t, x), Held::Shaped(k, id)) => x.release(c, t, k, id).await,
            #[cfg(feature = "compare")]
            (Lib::DynamodbLease(_, false), Held::DynamodbLease(l)) => l.release().await.expect("release"),
            #[cfg(feature = "compare")]
            (Lib::DynamodbLease(_, true), Held::DynamodbLease(l)) => drop(l),
            _ => unreachable!("lease of another library"),
        }
    }
}

impl Lib {
    pub async fn new_with_lease(name: &str, endpoint: &str, table: &str, lease: Duration) -> Lib {
        match name {
            "leasehold" => {
                let conf = sdk_config_for(endpoint).await;
                let store = DynamoStore::new(aws_sdk_dynamodb::Client::new(&conf), table);
                Lib::LeaseholdShort(Coordinator::new(Arc::new(store), config()), lease)
            }
            #[cfg(feature = "compare")]
            "dynamodb-lease" => {
                let conf = sdk_config_for(endpoint).await;
                Lib::DynamodbLease(
                    dynamodb_lease::Client::builder()
                        .table_name(table)
                        .lease_ttl_seconds(lease.as_secs() as u32)
                        .build_and_check_db(aws_sdk_dynamodb::Client::new(&conf))
                        .await
                        .expect("client"),
                    false,
                )
            }
            _ => Lib::new(name, endpoint, table).await,
        }
    }
}

/// What a [`Shaped`] library sends: leasehold's two requests whole (`raw-shaped`), or one of
/// three variants that each leave one part out (`LEASEHOLD_BENCH_SHAPED=parts`), to tell what
/// each part costs the server. No variant is a safe protocol.
#[derive(Clone, Copy, PartialEq)]
pub enum Part {
    /// Both requests as leasehold sends them.
    Whole,
    /// The acquire's PutItem of the whole lease under the bare pair's `attribute_not_exists`
    /// instead of the free-key condition (no `ALL_OLD` either); the release whole.
    BareCondition,
    /// The acquire whole; the release a conditional DeleteItem, as the bare pair's (it drops
    /// the fence).
    Delete,
    /// The acquire's free-key condition on an item of two attributes (`key`, `lease_id`); the
    /// release a DeleteItem (the UpdateItem needs the lease's attributes). Against `Delete`:
    /// what the other eight attributes cost.
    TwoAttributes,
}

/// The texts of leasehold's acquire and release, rendered once (see [`Lib::RawShaped`]).
pub struct Shaped {
    part: Part,
    acquire_condition: String,
    release_condition: String,
    release_update: String,
}

impl Shaped {
    fn new(part: Part) -> Shaped {
        use leasehold::store::dynamo::expressions;
        use leasehold::store::{Condition, Mutation, NewLease};
        let id = leasehold::LeaseId::from_string("x");
        let lease = NewLease::new("w", id.clone(), 1, Some(1), 1);
        let (acquire_condition, _) = expressions(
            &Condition::Lease(LeaseCondition::Free { now_ms: 1, fence: 1, lease_id: id.clone() }),
            &Mutation::Lease(LeaseMutation::Acquire(lease)),
        );
        let (release_condition, release_update) = expressions(
            &Condition::Lease(LeaseCondition::Unreleased { lease_id: id }),
            &Mutation::Lease(LeaseMutation::Release { now_ms: 1, ttl: 1 }),
        );
        Shaped { part, acquire_condition, release_condition, release_update }
    }

    fn num(v: u64) -> AttributeValue {
        AttributeValue::N(v.to_string())
    }

    /// leasehold's PutItem of a 10 s lease: the same ten attributes and condition values (less,
    /// as `part` says).
    async fn acquire(&self, c: &aws_sdk_dynamodb::Client, t: &str, key: &str, holder: &str) -> Option<Held> {
        use aws_sdk_dynamodb::types::ReturnValuesOnConditionCheckFailure;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
        let (now_ms, fence) = (now.as_millis() as u64, now.as_micros() as u64);
        let id = leasehold::LeaseId::generate().expose().to_string();
        let d = LEASE.as_millis() as u64;
        let mut put = c
            .put_item()
            .table_name(t)
            .item("key", AttributeValue::S(key.into()))
            .item("lease_id", AttributeValue::S(id.clone()));
        if self.part != Part::TwoAttributes {
            put = put
                .item("fence", Self::num(fence))
                .item("holder", AttributeValue::S(holder.into()))
                .item("acquired_at_ms", Self::num(now_ms))
                .item("min_hold_until_ms", Self::num(now_ms))
                .item("renewed_at_ms", Self::num(now_ms))
                .item("expires_at_ms", Self::num(now_ms + d))
                .item("duration_ms", Self::num(d))
                .item("ttl", Self::num((now_ms + d + 60_000).div_ceil(1000) + 86_400));
        }
        put = if self.part == Part::BareCondition {
            put.condition_expression("attribute_not_exists(#k)").expression_attribute_names("#k", "key")
        } else {
            put.condition_expression(&self.acquire_condition)
                .expression_attribute_values(":now", Self::num(now_ms))
                .expression_attribute_values(":fence", Self::num(fence))
                .expression_attribute_values(":lease_id", AttributeValue::S(id.clone()))
                .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
        };
        let r = put.send().await;
        match r {
            Ok(_) => Some(Held::Shaped(key.into(), id)),
            Err(e) if e.as_service_error().is_some_and(|s| s.is_conditional_check_failed_exception()) => None,
            Err(e) => panic!("{e:?}"),
        }
    }

    /// leasehold's release: the UpdateItem answering the whole item (`ALL_NEW`); with
    /// `Part::Delete` or `Part::TwoAttributes` a DeleteItem.
    async fn release(&self, c: &aws_sdk_dynamodb::Client, t: &str, key: String, id: String) {
        use aws_sdk_dynamodb::types::{ReturnValue, ReturnValuesOnConditionCheckFailure};
        if matches!(self.part, Part::Delete | Part::TwoAttributes) {
            c.delete_item()
                .table_name(t)
                .key("key", AttributeValue::S(key))
                .condition_expression("lease_id = :lease_id")
                .expression_attribute_values(":lease_id", AttributeValue::S(id))
                .send()
                .await
                .expect("delete");
            return;
        }
        let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
        let out = c
            .update_item()
            .table_name(t)
            .key("key", AttributeValue::S(key))
            .update_expression(&self.release_update)
            .condition_expression(&self.release_condition)
            .expression_attribute_names("#ttl", "ttl")
            .expression_attribute_values(":lease_id", AttributeValue::S(id))
            .expression_attribute_values(":released_at_ms", Self::num(now_ms))
            .expression_attribute_values(":ttl", Self::num(now_ms / 1000 + 86_400))
            .return_values(ReturnValue::AllNew)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await
            .expect("release");
        assert!(out.attributes().is_some_and(|a| a.contains_key("released_at_ms")));
    }
}
