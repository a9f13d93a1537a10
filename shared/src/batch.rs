//! Work items and batch leases (DESIGN.md, "Work items and batch leases"): a key can be in a
//! work state; `put` puts a key into a state without leasing it, `release_to` moves it on in
//! the release's own write, and `acquire_next` leases up to `limit` free keys of one state,
//! the longest-free first. A batch is a set of independent single-key acquires, each the
//! ordinary acquire write with its fence rules, made under the state visit the index showed.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::backoff::{jitter, uniform};
use crate::error::{Error, Result};
use crate::model::{Lease, LeaseState, Record};
use crate::protocol::{AcquireOptions, Coordinator};
use crate::store::{Condition, Mutation, ScanKind, Visit, WorkCondition, WorkMutation, Write};
use crate::validate::{check_state, MAX_BATCH};

/// When each state last saw a collision, in this process: takers of a contended state spread
/// over more of its oldest free keys (see `take`).
fn contention() -> &'static Mutex<HashMap<String, Instant>> {
    static C: OnceLock<Mutex<HashMap<String, Instant>>> = OnceLock::new();
    C.get_or_init(Mutex::default)
}

/// A state counts as contended this long after its last collision.
const CONTENDED_FOR: Duration = Duration::from_secs(2);

/// A contended taker picks at random among the oldest `limit * SPREAD` free keys (at most
/// [`MAX_CANDIDATES`]).
const SPREAD: usize = 48;
const MAX_CANDIDATES: usize = 1000;

/// A contended taker takes at most 1/TAIL_SHARE of the free keys it sees.
const TAIL_SHARE: usize = 16;

fn contended(state: &str, now: Instant) -> bool {
    let c = contention().lock().unwrap_or_else(|p| p.into_inner());
    c.get(state).is_some_and(|t| now.saturating_duration_since(*t) < CONTENDED_FOR)
}

fn collided(state: &str, now: Instant) {
    let mut c = contention().lock().unwrap_or_else(|p| p.into_inner());
    if c.len() > 4096 {
        c.retain(|_, t| now.saturating_duration_since(*t) < CONTENDED_FOR);
    }
    c.insert(state.to_string(), now);
}

/// How many candidates a taker that wants `want` more keys reads: `want * SPREAD` (at most
/// [`MAX_CANDIDATES`]) on a contended state, to choose among; twice what it wants otherwise
/// (the oldest first, and room for keys that turn out held).
fn candidates_to_read(spread: bool, want: usize) -> usize {
    if spread {
        (want * SPREAD).min(MAX_CANDIDATES)
    } else {
        2 * want
    }
}

fn random_below(n: usize) -> usize {
    if n <= 1 {
        return 0;
    }
    uniform(Duration::ZERO, Duration::from_nanos(n as u64 - 1)).as_nanos() as usize
}

/// A contended state: a random choice among the oldest free keys (`candidates`, oldest
/// first), so that takers that read the index at the same moment mostly try different keys.
/// Near the end of a backlog, when the free keys are few, a taker takes only its share of them
/// (other takers are reading the same few). Leaves the chosen ones, oldest first.
fn spread_pick(candidates: &mut Vec<Record>, want: usize) {
    let take = want.min((candidates.len() / TAIL_SHARE).max(1)).min(candidates.len());
    for j in 0..take {
        let k = j + random_below(candidates.len() - j);
        candidates.swap(j, k);
    }
    candidates.truncate(take);
    candidates.sort_by_key(|r| r.expires_at_ms);
}

/// One batch's request, as its takers share it.
struct Batch<'a> {
    state: &'a str,
    shard: &'a str,
    holder: &'a str,
    duration: Duration,
    opts: &'a AcquireOptions,
}

/// What one batch round got.
struct Round {
    leases: Vec<Lease>,
    error: Option<Error>,
    /// `(key, lease_id)` of the candidates whose acquire ended `OutcomeUnknown`: taken, maybe.
    unknown: Vec<(String, String)>,
}

impl Coordinator {
    /// Puts `key` into work state `state` without leasing it (`holder`: who put it; kept as the
    /// holder of a new item). Refused with `LeaseHeld` while the key is held; a key already in
    /// `state` is left as it is (idempotent).
    pub async fn put(&self, key: &str, state: &str, holder: &str) -> Result<LeaseState> {
        let limits = &self.config().limits;
        limits.key(key)?;
        limits.holder(holder)?;
        check_state(state)?;
        // The clock is checked by the write itself, right before it is sent (`write`).
        let deadline = self.monotonic() + self.config().retry_budget;
        let shard = self.state_shard(key, state);
        let (w, _, now) = self
            .write(key, deadline, |now| {
                Ok((
                    Condition::Work(WorkCondition::Enterable {
                        now_ms: now,
                        state: state.to_string(),
                        shard: shard.clone(),
                    }),
                    Mutation::Work(WorkMutation::Enter {
                        now_ms: now,
                        holder: holder.to_string(),
                        state: state.to_string(),
                        shard: shard.clone(),
                        ttl: self.state_ttl(state, now),
                    }),
                ))
            })
            .await
            .map_err(|f| f.into_error(key))?;
        match w {
            Write::Applied(r) => Ok(r.state(now)),
            Write::Rejected(Some(r)) if r.is_held(now) => {
                Err(Error::LeaseHeld { key: key.to_string(), holder: r.holder, expires_at_ms: r.expires_at_ms })
            }
            // Free and already in `state`.
            Write::Rejected(Some(r)) => Ok(r.state(now)),
            Write::Rejected(None) => Err(Error::StoreUnavailable("store rejected a write on a missing item".into())),
        }
    }

    /// Leases up to `limit` (1..=[`validate::MAX_BATCH`](crate::validate::MAX_BATCH)) free keys in work state `state`, the longest
    /// free first, each with its own lease_id and fence. Fewer (or none) when fewer are free;
    /// with `opts.wait`, waits (paced) until at least one is. A batch lease always has a
    /// duration (a lost answer must free its keys by expiry) and generated lease_ids.
    pub async fn acquire_next(
        &self,
        state: &str,
        limit: u32,
        holder: &str,
        duration: Option<Duration>,
        opts: AcquireOptions,
    ) -> Result<Vec<Lease>> {
        let start = self.monotonic();
        check_state(state)?;
        if !(1..=MAX_BATCH).contains(&limit) {
            return Err(Error::invalid(format!("limit must be 1 to {MAX_BATCH}")));
        }
        if opts.lease_id.is_some() {
            return Err(Error::invalid(
                "each lease of a batch gets its own generated lease_id; lease_id is not accepted",
            ));
        }
        let Some(duration) = duration else {
            return Err(Error::invalid(
                "acquire_next needs a duration: if its answer is lost, its leases must end by themselves",
            ));
        };
        // Every other field is checked as a single acquire checks it (a state name is a valid key).
        self.check_acquire(state, holder, Some(duration), &opts)?;
        let wait_deadline = start + opts.wait.unwrap_or_default();
        // As for a single acquire: the wait, or the retry budget when it is longer, and never
        // past the caller's own deadline. Every round's reads and writes end by then, so the
        // last round cannot run past the wait (or a Lambda invocation's end).
        let mut deadline = wait_deadline.max(start + self.config().retry_budget);
        if let Some(d) = opts.deadline {
            deadline = deadline.min(d);
        }
        let item_opts = AcquireOptions { wait: None, deadline: Some(deadline), ..opts };
        loop {
            self.check_clock(state).await?;
            let mut round = self.take(state, limit, holder, duration, &item_opts).await;
            if !round.leases.is_empty() {
                // The leases taken are the answer, even if the store failed on other
                // candidates: an error would strand them until they expire.
                self.release_unknown(&round.unknown).await;
                self.drop_late_leases(&mut round.leases);
                if !round.leases.is_empty() {
                    return Ok(round.leases);
                }
            }
            if let Some(e) = round.error {
                if round.unknown.is_empty() {
                    return Err(e);
                }
                return Err(Error::OutcomeUnknown {
                    key: state.to_string(),
                    message: format!(
                        "{e}; the acquires of {} candidate(s) may have landed: release each with its lease_id \
                         (leases)",
                        round.unknown.len()
                    ),
                    lease_id: None,
                    leases: round.unknown,
                });
            }
            let now = self.monotonic();
            if now >= wait_deadline.min(deadline) {
                return Ok(Vec::new());
            }
            tokio::time::sleep(jitter(self.config().poll_max).min(wait_deadline - now)).await;
        }
    }

    /// A lease whose safe time passed while the other candidates were settled is of no use to
    /// its holder: it is taken out of the answer and released (as a single acquire drops a
    /// late grant; best effort, off the answer's path).
    fn drop_late_leases(&self, leases: &mut Vec<Lease>) {
        let now = self.monotonic();
        let late: Vec<Lease> = leases.extract_if(.., |l| l.safe_until.is_some_and(|s| s <= now)).collect();
        if !late.is_empty() {
            let c = self.clone();
            tokio::spawn(async move {
                for l in late {
                    c.drop_late_grant(&l.key, &l.lease_id, c.monotonic() + c.config().retry_budget).await;
                }
            });
        }
    }

    /// Releases what a batch's candidates whose outcome is unknown may have taken, when the
    /// batch answers with other leases (its answer has no room for "maybe" leases): a write
    /// that landed is freed at once instead of at its expiry. Best effort.
    async fn release_unknown(&self, unknown: &[(String, String)]) {
        for (key, id) in unknown {
            let Ok(id) = crate::validate::lease_id(id) else { continue };
            if let Err(e) = self.release(key, &id).await.map_err(|e| e.error_name()) {
                // NotHolder: it never landed (or another taker has the key since).
                tracing::debug!(key, error = %e, "could not release a batch candidate whose outcome is unknown");
            }
        }
    }

    /// One batch: a Query of one index partition (the next ones only while the batch is short),
    /// then the candidates' acquires in parallel. Candidates another taker got first, or that
    /// moved on, are skipped (DESIGN.md, "Concurrent takers").
    /// Takes `candidates` concurrently, each its own single-key acquire, collecting the
    /// outcomes in `round`. Whether another taker got one of them first (a collision).
    async fn take_all(&self, b: &Batch<'_>, candidates: Vec<Record>, round: &mut Round) -> bool {
        let mut tasks = tokio::task::JoinSet::new();
        for r in candidates {
            let (c, state, shard, holder, opts) =
                (self.clone(), b.state.to_string(), b.shard.to_string(), b.holder.to_string(), b.opts.clone());
            let duration = b.duration;
            tasks.spawn(async move { c.take_one(&state, &shard, r, &holder, duration, &opts).await });
        }
        let mut hit = false;
        while let Some(res) = tasks.join_next().await {
            let got = res.unwrap_or_else(|e| Err(Error::StoreUnavailable(format!("batch task failed: {e}"))));
            hit |= matches!(got, Ok(None));
            self.collect(round, got);
        }
        hit
    }

    async fn take(&self, state: &str, limit: u32, holder: &str, duration: Duration, opts: &AcquireOptions) -> Round {
        let shards = self.config().state_shards.max(1);
        let first = random_below(shards as usize) as u32;
        let mut round = Round { leases: Vec::new(), error: None, unknown: Vec::new() };
        let mut i = 0;
        while i < shards {
            let want = limit as usize - round.leases.len();
            if want == 0 {
                break;
            }
            let shard = format!("{state}#{}", (first + i) % shards);
            // Contention is remembered per coordinator and state (by its id, not an address: a
            // process's allocations decide nothing it does, and a simulated seed replays).
            let memo = format!("{}/{state}", self.id());
            let spread = contended(&memo, self.monotonic());
            let page = candidates_to_read(spread, want);
            // Keys free by the store's clock as it may be now (`latest`): an item put or released
            // by a coordinator whose clock reading is ahead of this one's is free by its stamp,
            // and its take goes again with the clock raised to that stamp (`Record::freed_by_stamp`).
            let latest = self.now_ms() + self.safe_margin_now().as_millis() as u64;
            let kind = ScanKind::State { state: state.to_string(), shard: shard.clone(), free_at_ms: Some(latest) };
            // A read is retried within the budget of a request: one lost answer must not fail
            // the batch.
            let mut deadline = self.monotonic() + self.config().retry_budget;
            if let Some(d) = opts.deadline {
                deadline = deadline.min(d);
            }
            let items = match self.read(deadline, || self.store().scan(&kind, None, page as u32)).await {
                Ok(p) => p.items,
                Err(e) => {
                    round.error = Some(e);
                    i += 1;
                    continue;
                }
            };
            let mut candidates: Vec<Record> =
                items.into_iter().filter(|r| !r.is_held(latest) && r.work.state.as_deref() == Some(state)).collect();
            if spread {
                spread_pick(&mut candidates, want);
            } else if want > 1 && candidates.len() > 1 {
                // Uncontended so far: the oldest first, alone. If another taker got it, the
                // state is contended and this batch starts again spread out (one collision
                // instead of a whole batch of them when takers start together).
                let probe = candidates.remove(0);
                match self.take_one(state, &shard, probe, holder, duration, opts).await {
                    Ok(Some(l)) => round.leases.push(l),
                    Ok(None) => {
                        collided(&memo, self.monotonic());
                        continue;
                    }
                    // The store is in trouble: no more writes this round.
                    Err(e) => {
                        self.collect(&mut round, Err(e));
                        break;
                    }
                }
            }
            candidates.truncate(limit as usize - round.leases.len());
            let batch = Batch { state, shard: &shard, holder, duration, opts };
            if self.take_all(&batch, candidates, &mut round).await {
                collided(&memo, self.monotonic());
            }
            i += 1;
        }
        round.leases.sort_by_key(|l| l.acquired_at_ms);
        round
    }

    /// Leases candidate `r` of `state` under the visit the index showed: `None` when another
    /// taker got it first or it moved on (skipped).
    async fn take_one(
        &self,
        state: &str,
        shard: &str,
        r: Record,
        holder: &str,
        duration: Duration,
        opts: &AcquireOptions,
    ) -> Result<Option<Lease>> {
        let visit = Visit {
            state: state.to_string(),
            shard: shard.to_string(),
            since_ms: r.work.state_since_ms.unwrap_or(0),
            attempts: r.work.attempts.unwrap_or(0),
        };
        match self.acquire_visit(&r.key, holder, Some(duration), opts.clone(), Some(visit)).await {
            Ok(l) => Ok(Some(l)),
            Err(Error::LeaseHeld { .. } | Error::NotFound { .. } | Error::NotHolder { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn collect(&self, round: &mut Round, got: Result<Option<Lease>>) {
        match got {
            Ok(Some(l)) => round.leases.push(l),
            Ok(None) => {}
            Err(e) => {
                round.unknown.extend(e.unknown_leases());
                round.error = Some(e);
            }
        }
    }

    /// How many keys are in work state `state` (those held fail-closed excepted): one counting
    /// Query per index partition on DynamoDB, one indexed count on the embedded store.
    pub async fn count_in_state(&self, state: &str) -> Result<u64> {
        check_state(state)?;
        let mut n = 0;
        for i in 0..self.config().state_shards.max(1) {
            let kind = ScanKind::State { state: state.to_string(), shard: format!("{state}#{i}"), free_at_ms: None };
            let deadline = self.monotonic() + self.config().retry_budget;
            n += self.read(deadline, || self.store().count(&kind)).await?;
        }
        Ok(n)
    }

    /// Up to `limit` keys in work state `state`, held or not (those held fail-closed excepted),
    /// in the order they became free, partition by partition.
    pub async fn list_in_state(&self, state: &str, limit: usize) -> Result<Vec<LeaseState>> {
        check_state(state)?;
        let mut out = Vec::new();
        for i in 0..self.config().state_shards.max(1) {
            let kind = ScanKind::State { state: state.to_string(), shard: format!("{state}#{i}"), free_at_ms: None };
            let mut start: Option<String> = None;
            loop {
                let deadline = self.monotonic() + self.config().retry_budget;
                let page = self.read(deadline, || self.store().scan(&kind, start.as_deref(), 100)).await?;
                let now = self.now_ms();
                out.extend(page.items.iter().map(|r| r.state(now)));
                if out.len() >= limit {
                    out.truncate(limit);
                    return Ok(out);
                }
                match page.next {
                    Some(n) => start = Some(n),
                    None => break,
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_contended_taker_reads_a_spread_of_candidates_within_bounds() {
        assert_eq!(candidates_to_read(false, 1), 2);
        assert_eq!(candidates_to_read(false, 10), 20);
        assert_eq!(candidates_to_read(true, 1), SPREAD);
        assert_eq!(candidates_to_read(true, 10), 480);
        assert_eq!(candidates_to_read(true, 100), MAX_CANDIDATES);
    }

    #[test]
    fn a_random_index_stays_below_its_bound_and_reaches_past_zero() {
        assert_eq!(random_below(0), 0);
        assert_eq!(random_below(1), 0);
        let seen: std::collections::BTreeSet<usize> = (0..200).map(|_| random_below(4)).collect();
        assert!(seen.iter().all(|&i| i < 4) && seen.len() > 1, "{seen:?}");
    }
}
