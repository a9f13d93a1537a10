//! The libraries compared, behind one acquire/release interface: leasehold, the raw aws-sdk
//! floor (a bare conditional PutItem + DeleteItem) and, with `--features compare`, the
//! dynamodb-lease crate.

use std::sync::Arc;
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::types::AttributeValue;
use leasehold::store::DynamoStore;
use leasehold::{AcquireOptions, Coordinator};
use leasehold_tests::sdk_config_for;

use crate::harness::{config, LEASE};

/// One library behind a uniform acquire/release interface.
pub enum Lib {
    Leasehold(Coordinator),
    /// leasehold with a lease other than `LEASE` (M4).
    LeaseholdShort(Coordinator, Duration),
    Raw(aws_sdk_dynamodb::Client, String),
    /// dynamodb-lease; with `true`, leases are released by dropping them (the crate then
    /// deletes the item in a spawned task) instead of awaiting `Lease::release`.
    #[cfg(feature = "compare")]
    DynamodbLease(dynamodb_lease::Client, bool),
}

/// A held lease of any library.
pub enum Held {
    Leasehold(String, leasehold::LeaseId),
    Raw(String, String),
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
        match name {
            "leasehold" | "leasehold+index" => {
                Lib::Leasehold(Coordinator::new(Arc::new(DynamoStore::new(client, table)), config()))
            }
            "raw" => Lib::Raw(client, table.to_string()),
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
            Lib::Raw(..) => {
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
