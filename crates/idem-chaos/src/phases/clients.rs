//! `--phases http`'s clients: each operation is sent with its own Idempotency-Key through
//! idem-client's middleware (which retries lost answers, `409` in progress, `5xx` with that
//! same key), and again on another server, with the same key, until it is answered — or,
//! for an operation drawn to give up, not at all after its first failed attempt.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use idem_client::{IdempotencyMiddleware, IdempotentRequestExt, Jitter, Outcome, RetryPolicy};
use rand::Rng;
use reqwest_middleware::ClientWithMiddleware;
use serde::Deserialize;
use tokio::task::JoinSet;

use super::Op;

/// The bearer token every client sends: one principal, so one scope for every key.
const TOKEN: &str = "Bearer tok_idem_chaos";

/// How long one attempt may take before the client gives up on its connection.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(20);

/// What the clients saw.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    /// Answered operations: account → the processor's charge ID in the answer.
    pub(crate) answered: HashMap<String, Option<String>>,
    /// Operations whose client gave up after a failed first attempt.
    pub(crate) given_up: HashSet<String>,
    /// Operations answered that the service gave them up (http-payments' `charge-abandoned`
    /// problem: its completer ran out of attempts): a final answer, no charge row.
    pub(crate) abandoned: HashSet<String>,
    /// Operations still unanswered when the run stopped the clients.
    pub(crate) unanswered: u64,
    /// HTTP requests sent, retries by the middleware included.
    pub(crate) requests: u64,
    /// Answers the service marked as replays (`Idempotent-Replayed`).
    pub(crate) replays: u64,
    /// Logical requests sent again by the client after the middleware gave up on one (to
    /// another server, with the same key).
    pub(crate) resends: u64,
    /// Answers no retry can change (`4xx` but `408`, `409`, `425`, `429`): findings.
    pub(crate) refused: Vec<String>,
}

/// The clients of a run, working through the operations in the background.
#[derive(Debug)]
pub(crate) struct Clients {
    tasks: JoinSet<()>,
    tally: Arc<Mutex<Tally>>,
    finished: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    total: usize,
}

/// What every client task shares.
#[derive(Debug)]
struct Shared {
    queue: Mutex<VecDeque<(Op, Instant)>>,
    servers: Vec<String>,
    patient: ClientWithMiddleware,
    impatient: ClientWithMiddleware,
    tally: Arc<Mutex<Tally>>,
    finished: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl Shared {
    fn tally(&self) -> std::sync::MutexGuard<'_, Tally> {
        self.tally.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The answer's body, as far as the check reads it: a charge, or a problem.
#[derive(Debug, Deserialize)]
struct Answer {
    #[serde(default)]
    processor_charge_id: Option<String>,
    /// A problem's code (`charge-abandoned`).
    #[serde(default)]
    code: Option<String>,
}

/// The problem code of an operation the service gave up: stored, so every retry gets it.
const ABANDONED: &str = "charge-abandoned";

impl Clients {
    /// Starts `concurrency` clients over `servers` (base URLs); operation `i` of `n` is
    /// released at `i / n × over`, so the operations spread over the fault phase.
    pub(crate) fn start(
        ops: Vec<Op>,
        servers: Vec<String>,
        concurrency: usize,
        over: Duration,
    ) -> Result<Self> {
        let client = |policy: RetryPolicy| -> Result<ClientWithMiddleware> {
            let http = reqwest::Client::builder()
                .timeout(ATTEMPT_TIMEOUT)
                .build()
                .context("building the clients' HTTP client")?;
            Ok(reqwest_middleware::ClientBuilder::new(http)
                .with(IdempotencyMiddleware::new(policy))
                .build())
        };
        let patient = client(
            RetryPolicy::default()
                .max_attempts(5)
                .max_elapsed(Duration::from_secs(10))
                .backoff(Duration::from_millis(50), Duration::from_secs(1))
                .jitter(Jitter::Full),
        )?;
        let impatient = client(RetryPolicy::never())?;
        let total = ops.len();
        let start = Instant::now();
        let queue = ops
            .into_iter()
            .map(|op| {
                let at = start + over.mul_f64(op.index as f64 / total.max(1) as f64);
                (op, at)
            })
            .collect();
        let tally = Arc::new(Mutex::new(Tally::default()));
        let finished = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared {
            queue: Mutex::new(queue),
            servers,
            patient,
            impatient,
            tally: tally.clone(),
            finished: finished.clone(),
            stop: stop.clone(),
        });
        let mut tasks = JoinSet::new();
        for _ in 0..concurrency.max(1) {
            tasks.spawn(work(shared.clone()));
        }
        Ok(Self {
            tasks,
            tally,
            finished,
            stop,
            total,
        })
    }

    /// Operations answered or given up so far.
    pub(crate) fn finished(&self) -> usize {
        self.finished.load(Ordering::SeqCst)
    }

    /// Whether every operation is answered or given up.
    pub(crate) fn done(&self) -> bool {
        self.finished() >= self.total
    }

    /// Stops the clients (those still retrying count their operation unanswered) and
    /// returns what they saw.
    pub(crate) async fn stop(mut self) -> Tally {
        self.stop.store(true, Ordering::SeqCst);
        while self.tasks.join_next().await.is_some() {}
        std::mem::take(&mut *self.tally.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// One client: takes the next operation, waits for its release, runs it to its end.
async fn work(shared: Arc<Shared>) {
    loop {
        let next = shared
            .queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop_front();
        let Some((op, at)) = next else { return };
        tokio::time::sleep_until(at.into()).await;
        run(&shared, &op).await;
        shared.finished.fetch_add(1, Ordering::SeqCst);
    }
}

/// Sends `op` until it is answered, the client gives up, or the run stops the clients.
async fn run(shared: &Shared, op: &Op) {
    let client = if op.give_up {
        &shared.impatient
    } else {
        &shared.patient
    };
    for attempt in 0usize.. {
        if shared.stop.load(Ordering::SeqCst) {
            shared.tally().unanswered += 1;
            return;
        }
        if attempt > 0 {
            shared.tally().resends += 1;
        }
        let server = &shared.servers[(op.index + attempt) % shared.servers.len()];
        let sent = client
            .post(format!("{server}/charges"))
            .idempotency_key(op.key.clone())
            .header(reqwest::header::AUTHORIZATION, TOKEN)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(op.body())
            .send()
            .await;
        match sent {
            Ok(response) => {
                let outcome = Outcome::of(&response).cloned();
                let status = response.status();
                let body = response.bytes().await;
                let mut tally = shared.tally();
                if let Some(o) = &outcome {
                    tally.requests += u64::from(o.attempts);
                    tally.replays += u64::from(o.replayed);
                } else {
                    tally.requests += 1;
                }
                let answer = body
                    .as_ref()
                    .ok()
                    .and_then(|b| serde_json::from_slice::<Answer>(b).ok());
                if answer.as_ref().and_then(|a| a.code.as_deref()) == Some(ABANDONED) {
                    tally.abandoned.insert(op.account.clone());
                    return;
                }
                if status.is_success() {
                    if let Ok(body) = body {
                        let id = serde_json::from_slice::<Answer>(&body)
                            .ok()
                            .and_then(|a| a.processor_charge_id);
                        tally.answered.insert(op.account.clone(), id);
                        return;
                    }
                    // The body was lost on the way: as good as no answer; send again.
                } else if status.is_client_error()
                    && !matches!(status.as_u16(), 408 | 409 | 425 | 429)
                {
                    let text = body
                        .map(|b| String::from_utf8_lossy(&b).into_owned())
                        .unwrap_or_default();
                    tally
                        .refused
                        .push(format!("{}: {status} {}", op.key, text.trim()));
                    return;
                }
            }
            Err(_) => shared.tally().requests += 1,
        }
        if op.give_up {
            shared.tally().given_up.insert(op.account.clone());
            return;
        }
        let pause = rand::thread_rng().gen_range(100..400);
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
}
