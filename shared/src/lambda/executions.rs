//! How one keep-alive sweep learns which executions have ended, at any number of them: a
//! state machine's RUNNING executions are listed once per run (Step Functions ListExecutions,
//! 1,000 to a page) and an execution found there is running; DescribeExecution is the fallback,
//! for an execution missing from its list (ended, or started after the list was read: the list
//! is eventually consistent), for the first leases of a state machine in a run (a state machine
//! with few keep-alive leases and many executions is cheaper to describe) and when listing
//! fails. DescribeExecution's quota (a bucket of 300, refilled at 15 per second per account and
//! Region, 250 and 10 outside the largest Regions) otherwise caps a sweep at a few hundred
//! leases a minute; ListExecutions' (200 and 5, or 100 and 2) covers a thousand executions a
//! call (DESIGN.md, "Keep-alive on the holder's behalf").

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use tokio::sync::OnceCell;

use crate::keepalive::{ExecutionState, Executions};

/// Leases of one state machine a run describes one by one before it lists the machine's
/// running executions instead.
pub const DESCRIBE_BEFORE_LISTING: u32 = 20;

/// Pages (of up to 1,000 executions) a run lists at most per state machine: an execution beyond
/// them is described.
pub const MAX_LIST_PAGES: u32 = 100;

/// Lists the RUNNING executions of a state machine, a page at a time.
#[async_trait]
pub trait RunningExecutions: Send + Sync {
    /// One page of `state_machine_arn`'s RUNNING executions, from `next` (`None`: the first):
    /// their ARNs and the token of the next page. `Err`: why it could not be listed.
    async fn running_page(
        &self,
        state_machine_arn: &str,
        next: Option<String>,
    ) -> Result<(Vec<String>, Option<String>), String>;
}

/// The state machine of a standard execution's ARN
/// (`arn:PARTITION:states:REGION:ACCOUNT:execution:MACHINE:NAME`); `None` for anything else (an
/// express execution, a distributed map's child `MACHINE/RUN`), which is described.
pub fn state_machine_of(execution_arn: &str) -> Option<String> {
    let p: Vec<&str> = execution_arn.splitn(8, ':').collect();
    let standard = p.len() == 8 && p[0] == "arn" && p[2] == "states" && p[5] == "execution";
    (standard && !p[6].is_empty() && !p[6].contains('/') && !p[7].is_empty())
        .then(|| format!("{}:{}:{}:{}:{}:stateMachine:{}", p[0], p[1], p[2], p[3], p[4], p[6]))
}

/// One state machine as a run has met it: how many of its leases, and its running executions
/// once listed (`None` inside: the listing failed).
#[derive(Default)]
struct Machine {
    seen: u32,
    running: Arc<OnceCell<Option<HashSet<String>>>>,
}

/// The executions of one sweep run: listed per state machine, described as the fallback. Make a
/// new one for every run (its lists are that run's).
pub struct ListedRun {
    lister: Arc<dyn RunningExecutions>,
    describe: Arc<dyn Executions>,
    machines: Mutex<HashMap<String, Machine>>,
    pages: AtomicU32,
    described: AtomicU32,
}

impl ListedRun {
    pub fn new(lister: Arc<dyn RunningExecutions>, describe: Arc<dyn Executions>) -> ListedRun {
        ListedRun {
            lister,
            describe,
            machines: Mutex::new(HashMap::new()),
            pages: AtomicU32::new(0),
            described: AtomicU32::new(0),
        }
    }

    /// ListExecutions pages read and DescribeExecution calls made so far.
    pub fn calls(&self) -> (u32, u32) {
        (self.pages.load(Ordering::Relaxed), self.described.load(Ordering::Relaxed))
    }

    async fn describe(&self, arn: &str) -> ExecutionState {
        self.described.fetch_add(1, Ordering::Relaxed);
        self.describe.state(arn).await
    }

    /// Every RUNNING execution of `machine` (at most [`MAX_LIST_PAGES`] pages); `None` when
    /// the first page cannot be read. A later page that fails leaves the list short: what is
    /// missing is described.
    async fn list(&self, machine: &str) -> Option<HashSet<String>> {
        let mut running = HashSet::new();
        let mut next = None;
        for page in 0..MAX_LIST_PAGES {
            self.pages.fetch_add(1, Ordering::Relaxed);
            match self.lister.running_page(machine, next).await {
                Ok((arns, token)) => {
                    running.extend(arns);
                    match token {
                        Some(t) => next = Some(t),
                        None => break,
                    }
                }
                Err(e) => {
                    tracing::warn!(state_machine = machine, error = %e, "ListExecutions failed: describing instead");
                    if page == 0 {
                        return None;
                    }
                    break;
                }
            }
        }
        Some(running)
    }
}

#[async_trait]
impl Executions for ListedRun {
    async fn state(&self, execution_arn: &str) -> ExecutionState {
        let Some(machine) = state_machine_of(execution_arn) else { return self.describe(execution_arn).await };
        let cell = {
            let mut machines = self.machines.lock().expect("machines");
            let m = machines.entry(machine.clone()).or_default();
            m.seen += 1;
            (m.seen > DESCRIBE_BEFORE_LISTING).then(|| m.running.clone())
        };
        let Some(cell) = cell else { return self.describe(execution_arn).await };
        match cell.get_or_init(|| self.list(&machine)).await {
            Some(running) if running.contains(execution_arn) => ExecutionState::Running,
            _ => self.describe(execution_arn).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_machine_of_an_execution() {
        assert_eq!(
            state_machine_of("arn:aws:states:us-east-1:123456789012:execution:single-flight:run-1").as_deref(),
            Some("arn:aws:states:us-east-1:123456789012:stateMachine:single-flight")
        );
        assert_eq!(
            state_machine_of("arn:aws-cn:states:cn-north-1:123456789012:execution:m:a:b").as_deref(),
            Some("arn:aws-cn:states:cn-north-1:123456789012:stateMachine:m"),
            "an execution name is everything after the machine's"
        );
        for other in [
            "arn:aws:states:us-east-1:123456789012:express:m:run:id",
            "arn:aws:states:us-east-1:123456789012:execution:m/map-run:child",
            "arn:aws:states:us-east-1:123456789012:execution:m",
            "arn:aws:lambda:us-east-1:123456789012:function:f",
            "not an arn",
        ] {
            assert_eq!(state_machine_of(other), None, "{other}");
        }
    }

    /// Two state machines' executions, listed in pages of 2: which are running, and what was
    /// asked.
    struct Fake {
        running: Vec<String>,
        fail: bool,
        described: Mutex<Vec<String>>,
    }

    #[async_trait]
    impl RunningExecutions for Fake {
        async fn running_page(
            &self,
            machine: &str,
            next: Option<String>,
        ) -> Result<(Vec<String>, Option<String>), String> {
            if self.fail {
                return Err("ThrottlingException".into());
            }
            let prefix = machine.replace(":stateMachine:", ":execution:") + ":";
            let mine: Vec<String> = self.running.iter().filter(|a| a.starts_with(&prefix)).cloned().collect();
            let from: usize = next.map_or(0, |t| t.parse().unwrap());
            let page = mine.iter().skip(from).take(2).cloned().collect();
            Ok((page, (from + 2 < mine.len()).then(|| (from + 2).to_string())))
        }
    }

    #[async_trait]
    impl Executions for Fake {
        async fn state(&self, arn: &str) -> ExecutionState {
            self.described.lock().unwrap().push(arn.to_string());
            if self.running.iter().any(|a| a == arn) {
                ExecutionState::Running
            } else {
                ExecutionState::Ended
            }
        }
    }

    fn arn(machine: &str, n: u32) -> String {
        format!("arn:aws:states:us-east-1:123456789012:execution:{machine}:run-{n}")
    }

    #[tokio::test]
    async fn a_run_lists_each_state_machine_once_and_describes_only_what_it_does_not_list() {
        let running: Vec<String> = (0..50).map(|n| arn("a", n)).chain((0..5).map(|n| arn("b", n))).collect();
        let fake = Arc::new(Fake { running, fail: false, described: Mutex::new(vec![]) });
        let run = ListedRun::new(fake.clone(), fake.clone());
        // 60 leases of `a` (10 of ended executions), 5 of `b`.
        for n in 0..60 {
            let want = if n < 50 { ExecutionState::Running } else { ExecutionState::Ended };
            assert_eq!(run.state(&arn("a", n)).await, want, "a/{n}");
        }
        for n in 0..5 {
            assert_eq!(run.state(&arn("b", n)).await, ExecutionState::Running);
        }
        let described = fake.described.lock().unwrap().clone();
        // The first DESCRIBE_BEFORE_LISTING of `a`, its 10 ended ones, and all 5 of `b`.
        assert_eq!(described.len() as u32, DESCRIBE_BEFORE_LISTING + 10 + 5, "{described:?}");
        assert!((20..50).all(|n| !described.contains(&arn("a", n))), "listed as running, not described");
        assert!((50..60).all(|n| described.contains(&arn("a", n))), "not listed: described");
        // `a` listed once: 25 pages of 2. `b` never listed.
        assert_eq!(run.calls(), (25, DESCRIBE_BEFORE_LISTING + 15));
    }

    #[tokio::test]
    async fn a_failed_listing_falls_back_to_describing() {
        let running: Vec<String> = (0..30).map(|n| arn("a", n)).collect();
        let fake = Arc::new(Fake { running, fail: true, described: Mutex::new(vec![]) });
        let run = ListedRun::new(fake.clone(), fake.clone());
        for n in 0..40 {
            let want = if n < 30 { ExecutionState::Running } else { ExecutionState::Ended };
            assert_eq!(run.state(&arn("a", n)).await, want);
        }
        assert_eq!(fake.described.lock().unwrap().len(), 40);
        assert_eq!(run.calls(), (1, 40), "one failed page, then no more listing in this run");
        // An ARN that names no standard execution is described.
        assert_eq!(run.state("arn:aws:states:us-east-1:1:express:m:x:y").await, ExecutionState::Ended);
    }
}
