//! Scans and index queries: the operator listing (a Scan), and a Query of one partition of the
//! sparse keep-alive, work-state or queue index. Page tokens carry DynamoDB's
//! `LastEvaluatedKey`.

use std::collections::HashMap;

use aws_sdk_dynamodb::operation::query::builders::QueryFluentBuilder;
use aws_sdk_dynamodb::types::{AttributeValue, Select};

use super::item::{get_s, key_map, need, num, record_from_item, str_, Item};
use super::{map_err, DynamoStore};
use crate::error::{Error, Result};
use crate::model::Record;
use crate::store::table::{attr, KEEPALIVE_INDEX, QUEUE_INDEX, STATE_INDEX, STATE_INDEX_ATTRIBUTES};
use crate::store::{Page, ScanKind};

/// One page of items as DynamoDB returned it, and where the next starts.
struct Raw {
    items: Vec<Item>,
    last: Option<Item>,
}

impl Raw {
    fn page(self) -> Result<Page> {
        Ok(Page {
            items: self.items.iter().map(record_from_item).collect::<Result<_>>()?,
            next: self.last.as_ref().map(encode_token),
        })
    }
}

impl DynamoStore {
    /// [`crate::store::Store::scan`].
    pub(super) async fn scan_page(&self, kind: &ScanKind, start: Option<&str>, limit: u32) -> Result<Page> {
        let start = start.map(decode_token).transpose()?;
        let limit = limit.max(1) as i32;
        match kind {
            ScanKind::All => self.scan_all(start, limit).await?.page(),
            ScanKind::Keepalive { shard, after_ms } => {
                self.keepalive_query(*shard, *after_ms, start, limit).await?.page()
            }
            ScanKind::Queue { shard } => self.queue_query(*shard, start, limit).await,
            ScanKind::State { shard, free_at_ms: Some(now), .. } => {
                self.state_page(shard, Some(*now), start, limit).await?.page()
            }
            // A listing: the index projects only what a candidate needs, so the items
            // themselves are read.
            ScanKind::State { shard, free_at_ms: None, .. } => {
                let raw = self.state_page(shard, None, start, limit).await?;
                self.whole_items(raw, shard).await?.page()
            }
        }
    }

    /// Every item, strongly consistent (operator listing).
    async fn scan_all(&self, start: Option<Item>, limit: i32) -> Result<Raw> {
        let out = self
            .client
            .scan()
            .table_name(&self.table)
            .consistent_read(true)
            .limit(limit)
            .set_exclusive_start_key(start)
            .send()
            .await
            .map_err(map_err)?;
        Ok(Raw { items: out.items().to_vec(), last: out.last_evaluated_key().cloned() })
    }

    /// The keep-alives of one shard whose deadline is after `after_ms`.
    async fn keepalive_query(&self, shard: u32, after_ms: u64, start: Option<Item>, limit: i32) -> Result<Raw> {
        let out = self
            .client
            .query()
            .table_name(&self.table)
            .index_name(KEEPALIVE_INDEX)
            .key_condition_expression("#s = :s AND #u > :after")
            .expression_attribute_names("#s", attr::KA_SHARD)
            .expression_attribute_names("#u", attr::KA_UNTIL)
            .expression_attribute_values(":s", num(shard as u64))
            .expression_attribute_values(":after", num(after_ms))
            .limit(limit)
            .set_exclusive_start_key(start)
            .send()
            .await
            .map_err(map_err)?;
        Ok(Raw { items: out.items().to_vec(), last: out.last_evaluated_key().cloned() })
    }

    /// The keys of one queue shard with waiters or an undelivered grant. Keys only: the reader
    /// gets each item it serves.
    async fn queue_query(&self, shard: u32, start: Option<Item>, limit: i32) -> Result<Page> {
        let out = self
            .client
            .query()
            .table_name(&self.table)
            .index_name(QUEUE_INDEX)
            .key_condition_expression("#s = :s")
            .expression_attribute_names("#s", attr::Q_SHARD)
            .expression_attribute_values(":s", num(shard as u64))
            .limit(limit)
            .set_exclusive_start_key(start)
            .send()
            .await
            .map_err(map_err)?;
        let items = out
            .items()
            .iter()
            .map(|i| Ok(Record::key_only(need(get_s(i, attr::KEY)?, attr::KEY)?)))
            .collect::<Result<_>>()?;
        Ok(Page { items, next: out.last_evaluated_key().map(encode_token) })
    }

    /// One page of a work state's partition, as the index holds it (an `INCLUDE` projection:
    /// [`STATE_INDEX_ATTRIBUTES`]). A batch's candidates (`free_at_ms`; up to 1,000 per Query
    /// when contended) ask for exactly those attributes, so a table whose index projects more
    /// (`ALL`) sends no more (`#s`, `#e`: the query's own aliases of state_shard and
    /// expires_at_ms).
    async fn state_page(&self, shard: &str, free_at_ms: Option<u64>, start: Option<Item>, limit: i32) -> Result<Raw> {
        let mut q = self.state_query(shard, free_at_ms);
        if free_at_ms.is_some() {
            q = q
                .projection_expression(format!("#k, #e, #s, {}", STATE_INDEX_ATTRIBUTES.join(", ")))
                .expression_attribute_names("#k", attr::KEY);
        }
        let out = q.limit(limit).set_exclusive_start_key(start).send().await.map_err(map_err)?;
        Ok(Raw { items: out.items().to_vec(), last: out.last_evaluated_key().cloned() })
    }

    /// The whole items of a page of the work-state index, in its order, each read strongly
    /// consistent (GetItem, up to 16 at once): the index holds only what a batch's candidate
    /// needs. An item deleted or moved out of `shard` since the index was read is left out.
    async fn whole_items(&self, raw: Raw, shard: &str) -> Result<Raw> {
        let keys = raw.items.iter().map(|i| need(get_s(i, attr::KEY)?, attr::KEY)).collect::<Result<Vec<_>>>()?;
        let mut items = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(16) {
            let mut set = tokio::task::JoinSet::new();
            for (i, key) in chunk.iter().enumerate() {
                let (client, table, key) = (self.client.clone(), self.table.clone(), key.clone());
                set.spawn(async move {
                    let out = client
                        .get_item()
                        .table_name(table)
                        .set_key(Some(key_map(&key)))
                        .consistent_read(true)
                        .send()
                        .await;
                    (i, out.map(|o| o.item).map_err(map_err))
                });
            }
            let mut got: Vec<(usize, Option<Item>)> = Vec::with_capacity(chunk.len());
            while let Some(joined) = set.join_next().await {
                let (i, out) = joined.map_err(|e| Error::StoreUnavailable(format!("read an item: {e}")))?;
                got.push((i, out?));
            }
            got.sort_by_key(|(i, _)| *i);
            let here = |item: &Item| get_s(item, attr::STATE_SHARD).ok().flatten().as_deref() == Some(shard);
            items.extend(got.into_iter().filter_map(|(_, item)| item).filter(|item| here(item)));
        }
        Ok(Raw { items, last: raw.last })
    }

    /// A Query of one partition of the work-state index, oldest expiry first: the items free at
    /// `free_at_ms` (`expires_at_ms <= :now`), or all of them.
    fn state_query(&self, shard: &str, free_at_ms: Option<u64>) -> QueryFluentBuilder {
        let q = self
            .client
            .query()
            .table_name(&self.table)
            .index_name(STATE_INDEX)
            .expression_attribute_names("#s", attr::STATE_SHARD)
            .expression_attribute_values(":s", str_(shard))
            .scan_index_forward(true);
        match free_at_ms {
            Some(now) => q
                .key_condition_expression("#s = :s AND #e <= :now")
                .expression_attribute_names("#e", attr::EXPIRES_AT)
                .expression_attribute_values(":now", num(now)),
            None => q.key_condition_expression("#s = :s"),
        }
    }

    /// [`crate::store::Store::count`]: a work state's partition is counted by DynamoDB
    /// (`Select = COUNT`), anything else by reading its pages.
    pub(super) async fn count_items(&self, kind: &ScanKind) -> Result<u64> {
        let ScanKind::State { shard, free_at_ms, .. } = kind else {
            return crate::store::count_pages(self, kind).await;
        };
        let (mut n, mut start) = (0u64, None);
        loop {
            let out = self
                .state_query(shard, *free_at_ms)
                .select(Select::Count)
                .set_exclusive_start_key(start)
                .send()
                .await
                .map_err(map_err)?;
            n += out.count().max(0) as u64;
            match out.last_evaluated_key() {
                Some(k) => start = Some(k.clone()),
                None => return Ok(n),
            }
        }
    }
}

/// Page tokens are DynamoDB's LastEvaluatedKey as a JSON object of attribute -> ["S"|"N", value].
pub(super) fn encode_token(k: &HashMap<String, AttributeValue>) -> String {
    let mut m = serde_json::Map::new();
    for (name, v) in k {
        let enc = match v {
            AttributeValue::S(s) => serde_json::json!(["S", s]),
            AttributeValue::N(n) => serde_json::json!(["N", n]),
            _ => continue,
        };
        m.insert(name.clone(), enc);
    }
    serde_json::Value::Object(m).to_string()
}

pub(super) fn decode_token(token: &str) -> Result<HashMap<String, AttributeValue>> {
    let bad = || Error::invalid("invalid page token");
    let v: serde_json::Value = serde_json::from_str(token).map_err(|_| bad())?;
    let mut out = HashMap::new();
    for (name, enc) in v.as_object().ok_or_else(bad)? {
        let pair = enc.as_array().filter(|a| a.len() == 2).ok_or_else(bad)?;
        let val = pair[1].as_str().ok_or_else(bad)?.to_string();
        let av = match pair[0].as_str() {
            Some("S") => AttributeValue::S(val),
            Some("N") => AttributeValue::N(val),
            _ => return Err(bad()),
        };
        out.insert(name.clone(), av);
    }
    Ok(out)
}
