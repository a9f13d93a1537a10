//! Retries: reads sent again until the request's deadline, writes re-sent with the same
//! lease_id so that an ambiguous failure is recognised from the item that comes back, and
//! writes run in a task of their own so that a caller dropped mid-flight strands no grant
//! (DESIGN.md, "Failure cases", and "Cancellation" under "In-process waiters").

use super::*;

impl Coordinator {
    /// Runs one read, retrying throttled/unavailable answers with jittered backoff until
    /// `deadline`: a read is always safe to send again, and one lost answer must not fail the
    /// request that needed it.
    pub(crate) async fn read<T, F, Fut>(&self, deadline: Instant, mut read: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let mut backoff = Backoff::new(self.config.retry_base, self.config.retry_max);
        loop {
            match read().await {
                Err(e) if e.is_transient() => {
                    let pause = backoff.next_pause();
                    if self.monotonic() + pause >= deadline {
                        return Err(e);
                    }
                    tracing::debug!(error = e.name(), pause_ms = pause.as_millis() as u64, "retrying store read");
                    tokio::time::sleep(pause).await;
                }
                r => return r,
            }
        }
    }

    /// Runs one conditional write, retrying throttled/unavailable answers with jittered
    /// backoff until `deadline`. Every try checks the clock first (DESIGN.md, "Clocks": it may
    /// have been stepped during the backoff, or a read before), reads it and sends the same
    /// lease_id, so a retry after an ambiguous failure (the write landed, the answer was lost)
    /// is recognised by the caller from the item that comes back. `attempt` may refuse to
    /// write (a bound it checks before anything is sent).
    pub(crate) async fn write(
        &self,
        key: &str,
        deadline: Instant,
        attempt: impl FnMut(u64) -> Result<(Condition, Mutation)>,
    ) -> std::result::Result<(Write, Instant, u64), Failed> {
        self.write_noting(key, deadline, None, attempt, &mut false, None).await
    }

    /// [`Coordinator::write`] without the clock check: for the writes that judge no expiry
    /// and set none (a plain release, a force-release), which a coordinator with a wrong clock
    /// may still send (DESIGN.md, "Clocks").
    pub(crate) async fn write_unchecked(
        &self,
        key: &str,
        deadline: Instant,
        attempt: impl FnMut(u64) -> Result<(Condition, Mutation)>,
    ) -> std::result::Result<(Write, Instant, u64), Failed> {
        self.write_tries(key, deadline, None, attempt, &mut false, None, false).await
    }

    /// [`Coordinator::write`], also setting `landed` when an attempt may have landed although
    /// a later one answered (an acquire carries that across its attempts). With `grants` (the
    /// lease_id the write may grant), each request runs in a task of its own, so that if the
    /// caller's future is dropped while it is in flight (a timeout, a disconnected HTTP client)
    /// the request still gets its answer, and a grant that lands for the departed caller is
    /// released at once (DESIGN.md, "Cancellation").
    pub(crate) async fn write_noting(
        &self,
        key: &str,
        deadline: Instant,
        grants: Option<&LeaseId>,
        attempt: impl FnMut(u64) -> Result<(Condition, Mutation)>,
        landed: &mut bool,
        lapse: Option<&mut Lapse>,
    ) -> std::result::Result<(Write, Instant, u64), Failed> {
        self.write_tries(key, deadline, grants, attempt, landed, lapse, true).await
    }

    /// The tries of a write; `checked`: each checks the clock first; `lapse`: none is sent once
    /// the first earlier try that may have landed has expired ([`Lapse`]).
    #[allow(clippy::too_many_arguments)]
    async fn write_tries(
        &self,
        key: &str,
        deadline: Instant,
        grants: Option<&LeaseId>,
        mut attempt: impl FnMut(u64) -> Result<(Condition, Mutation)>,
        landed: &mut bool,
        mut lapse: Option<&mut Lapse>,
        checked: bool,
    ) -> std::result::Result<(Write, Instant, u64), Failed> {
        let mut backoff = Backoff::new(self.config.retry_base, self.config.retry_max);
        let mut maybe_landed = false;
        loop {
            // Every try is sent with the clock as it is now, checked now: a step during whatever
            // was awaited before (a read, a delivery, the backoff) must not be written.
            if checked {
                self.check_clock_by(key, deadline).await.map_err(|error| Failed::new(error, maybe_landed))?;
            }
            let sent = self.monotonic();
            let now = self.now_ms();
            if lapse.as_ref().is_some_and(|l| l.lapsed(now)) {
                return Err(Failed { lapsed: true, ..Failed::new(Error::not_sent("lapsed"), maybe_landed) });
            }
            let (cond, m) = attempt(now).map_err(|error| Failed::new(error, maybe_landed))?;
            let answer = match grants {
                None => self.store.update(key, &cond, &m).await,
                Some(id) => self.update_detached(key, cond, m, id.clone()).await,
            };
            match answer {
                Ok(w) => return Ok((w, sent, now)),
                Err(e) if e.is_transient() => {
                    if let Some(l) = lapse.as_mut().filter(|_| e.may_have_landed()) {
                        l.note(now);
                    }
                    maybe_landed |= e.may_have_landed();
                    *landed |= maybe_landed;
                    let pause = backoff.next_pause();
                    if self.monotonic() + pause >= deadline {
                        return Err(Failed::new(e, maybe_landed));
                    }
                    tracing::debug!(
                        key,
                        error = e.name(),
                        pause_ms = pause.as_millis() as u64,
                        "retrying store request"
                    );
                    tokio::time::sleep(pause).await;
                }
                Err(error) => return Err(Failed::new(error, maybe_landed)),
            }
        }
    }

    /// One store write that outlives its caller: it runs in the caller's task while the caller
    /// waits for it, and when the caller's future is dropped with the request in flight (a
    /// timeout, a disconnected HTTP client), the request moves into a task of its own, which
    /// takes the answer and, if the write granted (or may have granted) the lease `lease_id`,
    /// releases that lease at once (DESIGN.md, "Cancellation"). An answer is read in the same
    /// poll that produces it, so no answer is left sent but unread. No task is spawned while the
    /// caller stays: a task per acquire cost a wake-up of another worker thread.
    pub(crate) async fn update_detached(
        &self,
        key: &str,
        cond: Condition,
        m: Mutation,
        lease_id: LeaseId,
    ) -> Result<Write> {
        let (coord, task_key) = (self.clone(), key.to_string());
        let request = Box::pin(async move { coord.store.update(&task_key, &cond, &m).await });
        InFlight { request: Some(request), coord: self.clone(), key: key.to_string(), lease_id }.await
    }

    /// Releases the lease `lease_id` granted to an acquire that left before it could be told
    /// (its future was dropped). Nothing to do when it did not land or already ended.
    pub(crate) fn release_departed<'a>(
        &'a self,
        key: &'a str,
        lease_id: &'a LeaseId,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'a>> {
        Box::pin(self.release_departed_now(key, lease_id))
    }

    pub(crate) async fn release_departed_now(&self, key: &str, lease_id: &LeaseId) {
        // A semaphore's slot: the holder's own release.
        if self.known_semaphore(key) {
            return self.release_departed_slot(key, lease_id).await;
        }
        // The ordinary release, without a hand-over of its own (that would make this recursive):
        // the next waiter is woken and tries.
        let deadline = self.monotonic() + self.config.retry_budget;
        let max = self.max_duration_ms();
        let w = self
            .write(key, deadline, |now| {
                let cond = Condition::Lease(LeaseCondition::Unreleased { lease_id: lease_id.clone() });
                Ok((cond, Mutation::Lease(LeaseMutation::Release { now_ms: now, ttl: self.ttl_after(now + max) })))
            })
            .await;
        match w {
            Ok((Write::Applied(r), _, _)) => {
                tracing::debug!(key, "released a grant whose acquire had left");
                self.keep_queued(key, &r).await;
                self.freed(key, &r);
                self.after_free(key, &r).await;
            }
            // The item is a semaphore: the grant was a slot.
            Ok((Write::Rejected(Some(r)), _, _)) if r.semaphore.slots.is_some() => {
                self.release_departed_slot(key, lease_id).await
            }
            Ok(_) => {}
            Err(f) => tracing::warn!(
                key,
                error = f.into_error(key).name(),
                "could not release a grant whose acquire had left; it expires on its own"
            ),
        }
    }
}
impl Coordinator {
    /// Releases the slot of the semaphore `key` granted to a take that left before it could be
    /// told. Nothing to do when it did not land or already ended.
    async fn release_departed_slot(&self, key: &str, lease_id: &LeaseId) {
        match self.free_slot(key, lease_id).await {
            Ok(Ok(_)) => tracing::debug!(key, "released a slot whose take had left"),
            Ok(Err(_)) => {}
            Err(e) => tracing::warn!(
                key,
                error = e.name(),
                "could not release a slot whose take had left; it expires on its own"
            ),
        }
    }
}

/// A write that did not get an answer in time.
pub(crate) struct Failed {
    pub(crate) error: Error,
    /// Some attempt may have landed (its answer was lost or it timed out).
    pub(crate) maybe_landed: bool,
    /// Not sent again: the first try that may have landed has expired ([`Lapse`]).
    pub(crate) lapsed: bool,
}

/// A timed grant under a generated lease_id (DESIGN.md, "Acquire"): its duration, and when, by
/// this clock, the first try of it that may have landed has expired (its clock plus the
/// duration). Sent again after that, the lease_id could be granted a second time (the key taken
/// by another lease meanwhile and freed again) after a first grant nobody was told of; so it is
/// not, and a new lease_id is generated instead (a later try that may still land holds the key
/// for one duration at most, told to nobody).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lapse {
    pub(crate) duration_ms: u64,
    pub(crate) until_ms: Option<u64>,
}

impl Lapse {
    pub(crate) fn new(duration_ms: u64) -> Self {
        Lapse { duration_ms, until_ms: None }
    }

    /// Has the first try that may have landed expired by `now`?
    pub(crate) fn lapsed(&self, now: u64) -> bool {
        self.until_ms.is_some_and(|u| now > u)
    }

    /// A try sent at `now` may have landed.
    fn note(&mut self, now: u64) {
        self.until_ms.get_or_insert(now.saturating_add(self.duration_ms));
    }
}

impl Failed {
    fn new(error: Error, maybe_landed: bool) -> Self {
        Failed { error, maybe_landed, lapsed: false }
    }

    /// The error to report. A write that may have landed is `OutcomeUnknown`: the caller's
    /// lease_id reaches what it did (an acquire's retry returns the lease and a release frees
    /// it; a release's retry answers `already_released`).
    pub(crate) fn into_error(self, key: &str) -> Error {
        match self.error {
            // A throttled or refused end after an attempt that timed out is no less unknown.
            e @ (Error::StoreUnavailable(_) | Error::Throttled(_) | Error::StoreRefused(_)) if self.maybe_landed => {
                Error::outcome_unknown(
                    key,
                    format!(
                        "{e}; a write may have landed: send the same request again with the same lease_id (it is \
                     idempotent), or release with it"
                    ),
                )
            }
            e => e,
        }
    }
}

/// Did this answer grant, or may it have granted, the lease `lease_id`: the item's lease, or
/// an unreleased holder of the semaphore it is?
fn grants(answer: &Result<Write>, lease_id: &LeaseId) -> bool {
    match answer {
        Ok(Write::Applied(r) | Write::Rejected(Some(r))) => {
            &r.lease_id == lease_id || r.slot(lease_id).is_some_and(|h| h.released_at_ms.is_none())
        }
        Ok(Write::Rejected(None)) => false,
        // It may have landed: look.
        Err(e) => e.may_have_landed(),
    }
}

/// A detached write's request (see [`Coordinator::update_detached`]). Dropped before its answer
/// came, it hands the request over to a task that releases what the answer grants.
struct InFlight {
    request: Option<std::pin::Pin<Box<dyn std::future::Future<Output = Result<Write>> + Send>>>,
    coord: Coordinator,
    key: String,
    lease_id: LeaseId,
}

impl std::future::Future for InFlight {
    type Output = Result<Write>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<Write>> {
        let answer = std::task::ready!(self.request.as_mut().expect("polled after its answer").as_mut().poll(cx));
        self.request = None;
        std::task::Poll::Ready(answer)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let Some(request) = self.request.take() else { return };
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let (coord, key, id) = (self.coord.clone(), std::mem::take(&mut self.key), self.lease_id.clone());
        rt.spawn(async move {
            let answer = request.await;
            if grants(&answer, &id) {
                coord.release_departed(&key, &id).await;
            }
        });
    }
}
