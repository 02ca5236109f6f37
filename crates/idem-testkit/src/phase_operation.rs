//! The operation of phases the phases and completer conformance checks run: a local
//! reservation, a charge at a fake card processor (a foreign call), a local record. It logs
//! every phase it runs and every call the processor gets, so a check counts runs and calls
//! instead of trusting the engine's word.
//!
//! How an operation behaves is written in its idempotency key, so the caller's `run_phases`
//! and the completer's `resume_phases` run the same `step` without sharing a script: the key
//! is dot-separated words ending in a name (`f1.h2.order`); a word `f<n>` fails the charge on
//! attempt `n` after the processor answered (the answer was lost), `h<n>` hangs it there on
//! attempt `n` (the executor "crashes": its future is dropped), `fail` fails it on every
//! attempt, and `decline` makes the processor decline (the operation abandons with a
//! release of its reservation).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idem_core::{BoxError, IdempotencyKey, RequestScope};
use idem_request::{Idempotency, PhaseCtx, Step};
use serde::{Deserialize, Serialize};

use crate::recovery_fixture::RecoveryFixture;

/// Long enough never to run out during a check.
pub(crate) const LONG: Duration = Duration::from_secs(30);
/// A lease that runs out within a check.
pub(crate) const SHORT: Duration = Duration::from_millis(500);
/// Long enough for a [`SHORT`] lease to have run out on the store's clock.
pub(crate) const PAST_SHORT: Duration = Duration::from_millis(800);

/// The response of a declined charge, stored as abandoned.
pub(crate) const DECLINED: &str = "declined";
/// The response the completer stores when it gives an operation up.
pub(crate) const REFUNDED: &str = "refunded";

/// The operation's phases.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Phase {
    /// Local: effect `<key>/reserve`.
    Reserve,
    /// Foreign: a charge at the processor with the phase's derived key.
    Charge {
        /// The amount charged.
        cents: i64,
    },
    /// Local: effect `<key>/record`; the response is the processor's charge id.
    Record {
        /// The processor's charge id.
        charge: String,
    },
}

/// What the key of an operation tells it to do in `Charge`.
#[derive(Debug, Default)]
struct Plan {
    fail_on: Vec<u32>,
    hang_on: Vec<u32>,
    fail_always: bool,
    decline: bool,
}

impl Plan {
    fn of(key: &str) -> Self {
        let mut plan = Plan::default();
        for word in key.split('.') {
            match word {
                "fail" => plan.fail_always = true,
                "decline" => plan.decline = true,
                _ => {
                    let attempt = |w: &str| w.get(1..).and_then(|n| n.parse::<u32>().ok());
                    match (word.get(..1), attempt(word)) {
                        (Some("f"), Some(n)) => plan.fail_on.push(n),
                        (Some("h"), Some(n)) => plan.hang_on.push(n),
                        _ => {}
                    }
                }
            }
        }
        plan
    }
}

/// One phase the operation ran: the record's client key, the phase's name, the attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Ran {
    key: String,
    point: String,
    attempt: u32,
}

/// The fake card processor: deduplicates charges by the idempotency key it is sent, as a
/// real one does, and counts every call per key.
#[derive(Debug, Default)]
struct Processor {
    /// Derived key → (calls, charge id).
    charges: HashMap<String, (u32, String)>,
}

/// The operation and everything it saw, shared by the caller's runs and the completer's
/// resumes (clones share the logs).
#[derive(Debug)]
pub(crate) struct Op<F> {
    pub(crate) fx: Arc<F>,
    ran: Arc<Mutex<Vec<Ran>>>,
    processor: Arc<Mutex<Processor>>,
    gave_up: Arc<Mutex<Vec<String>>>,
}

impl<F> Clone for Op<F> {
    fn clone(&self) -> Self {
        Self {
            fx: Arc::clone(&self.fx),
            ran: Arc::clone(&self.ran),
            processor: Arc::clone(&self.processor),
            gave_up: Arc::clone(&self.gave_up),
        }
    }
}

/// The scope every check's operation runs in.
pub(crate) fn scope() -> RequestScope {
    RequestScope::new(["conformance_order"])
}

/// A client's idempotency key.
pub(crate) fn key(k: &str) -> IdempotencyKey {
    IdempotencyKey::new(k).expect("valid key")
}

/// An engine on `store` with `lease` and no heartbeat (an operation that outlives its lease
/// can be taken over, as after a crash).
pub(crate) fn idem<S>(store: S, lease: Duration) -> Idempotency<S>
where
    S: idem_core::store::RecoveryStore + Clone + Send + Sync + 'static,
{
    Idempotency::builder(store)
        .lease(lease)
        .without_heartbeat()
        .build()
        .expect("idempotency")
}

impl<F: RecoveryFixture> Op<F> {
    pub(crate) fn new(fx: F) -> Self {
        Self {
            fx: Arc::new(fx),
            ran: Arc::default(),
            processor: Arc::default(),
            gave_up: Arc::default(),
        }
    }

    /// The store under test.
    pub(crate) fn store(&self) -> F::Store {
        self.fx.store()
    }

    /// Committed effects with `key`.
    pub(crate) async fn effects(&self, key: &str) -> i64 {
        self.fx.count_effects(key).await
    }

    /// Every phase run of the record with client key `k`, in order, as (point, attempt).
    pub(crate) fn ran(&self, k: &str) -> Vec<(String, u32)> {
        lock(&self.ran)
            .iter()
            .filter(|r| r.key == k)
            .map(|r| (r.point.clone(), r.attempt))
            .collect()
    }

    /// Calls the processor got, per derived key.
    pub(crate) fn calls(&self) -> HashMap<String, u32> {
        lock(&self.processor)
            .charges
            .iter()
            .map(|(k, (calls, _))| (k.clone(), *calls))
            .collect()
    }

    /// The charge id the processor answers for `derived`.
    pub(crate) fn charge_of(&self, derived: &str) -> Option<String> {
        lock(&self.processor)
            .charges
            .get(derived)
            .map(|(_, id)| id.clone())
    }

    /// Client keys of the records the completer gave up, once per compensation that ran.
    pub(crate) fn gave_up(&self) -> Vec<String> {
        lock(&self.gave_up).clone()
    }

    /// Runs the operation of client key `k` in [`scope`] with `input`, from `first`.
    pub(crate) async fn run(
        &self,
        idem: &Idempotency<F::Store>,
        k: &str,
        input: &str,
        first: Phase,
    ) -> Result<String, idem_core::Error> {
        self.run_in(idem, scope(), k, input, first).await
    }

    /// Runs the operation of client key `k` in `scope` with `input`, from `first`.
    pub(crate) async fn run_in(
        &self,
        idem: &Idempotency<F::Store>,
        scope: RequestScope,
        k: &str,
        input: &str,
        first: Phase,
    ) -> Result<String, idem_core::Error> {
        idem.run_phases(
            scope,
            &key(k),
            input,
            first,
            async |phase: Phase, ctx: &mut PhaseCtx<F::Store>| self.step(phase, ctx).await,
        )
        .await
    }

    /// Runs the operation of `k` in [`scope`] (on an engine with `lease`) until its charge
    /// hangs, then drops it there: a crash after the phases before it committed.
    pub(crate) async fn crash(&self, lease: Duration, k: &str, first: Phase) {
        self.crash_in(lease, scope(), k, first).await;
    }

    /// [`crash`](Self::crash) in `scope`.
    pub(crate) async fn crash_in(
        &self,
        lease: Duration,
        scope: RequestScope,
        k: &str,
        first: Phase,
    ) {
        let idem = idem(self.store(), lease);
        let run = self.run_in(&idem, scope, k, "input", first);
        tokio::select! {
            done = run => panic!("{k}: the operation was to hang in its charge, it ended: {done:?}"),
            () = self.hanging(k) => {}
        }
    }

    /// Returns once an attempt of `k` hangs in its charge.
    pub(crate) async fn hanging(&self, k: &str) {
        let hangs = Plan::of(k).hang_on;
        while !lock(&self.ran)
            .iter()
            .any(|r| r.key == k && r.point == "Charge" && hangs.contains(&r.attempt))
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Resumes a record the completer took over with the operation's `step`.
    pub(crate) async fn resume(
        &self,
        idem: Idempotency<F::Store>,
        stuck: idem_core::Stuck,
    ) -> Result<String, idem_core::Error> {
        // Each call steps on an owned handle: a step borrowing the closure's capture would
        // leave Rust unable to prove the completer's resume future `Send` for every borrow.
        let op = self.clone();
        idem.resume_phases(
            stuck,
            async move |phase: Phase, ctx: &mut PhaseCtx<F::Store>| {
                let op = op.clone();
                op.step_owned(phase, ctx).await
            },
        )
        .await
    }

    /// Gives a record up: the compensation (effect `<key>/refund`) commits with the
    /// abandoned response [`REFUNDED`].
    pub(crate) async fn give_up(
        &self,
        execution: idem_request::Execution<F::Store>,
    ) -> Result<(), idem_core::Error> {
        let k = execution.key().key.as_str().to_owned();
        let refunded = serde_json::to_vec(REFUNDED).expect("json");
        let op = self.clone();
        execution
            .give_up(&refunded, async move |tx| {
                lock(&op.gave_up).push(k.clone());
                op.fx.record_effect(tx, &format!("{k}/refund")).await
            })
            .await
    }

    /// [`step`](Self::step) on an owned handle.
    async fn step_owned(
        self,
        phase: Phase,
        ctx: &mut PhaseCtx<F::Store>,
    ) -> Result<Step<Phase, String>, BoxError> {
        self.step(phase, ctx).await
    }

    /// The operation's one step function: the caller's and the completer's.
    pub(crate) async fn step(
        &self,
        phase: Phase,
        ctx: &mut PhaseCtx<F::Store>,
    ) -> Result<Step<Phase, String>, BoxError> {
        let k = ctx.key().key.as_str().to_owned();
        let attempt = ctx.attempt();
        lock(&self.ran).push(Ran {
            key: k.clone(),
            point: ctx.point().to_owned(),
            attempt,
        });
        let plan = Plan::of(&k);
        match phase {
            Phase::Reserve => {
                self.fx
                    .record_effect(ctx.tx(), &format!("{k}/reserve"))
                    .await?;
                Ok(Step::Next(Phase::Charge { cents: 1250 }))
            }
            Phase::Charge { cents } => {
                let derived = ctx.foreign_key("card").to_string();
                let charge = {
                    let mut processor = lock(&self.processor);
                    let n = processor.charges.len();
                    let entry = processor
                        .charges
                        .entry(derived)
                        .or_insert_with(|| (0, format!("ch_{n}_{cents}")));
                    entry.0 += 1;
                    entry.1.clone()
                };
                if plan.hang_on.contains(&attempt) {
                    std::future::pending::<()>().await;
                }
                if plan.fail_always || plan.fail_on.contains(&attempt) {
                    return Err("the processor's answer was lost".into());
                }
                if plan.decline {
                    self.fx
                        .record_effect(ctx.tx(), &format!("{k}/release"))
                        .await?;
                    return Ok(Step::Abandon(DECLINED.to_owned()));
                }
                Ok(Step::Next(Phase::Record { charge }))
            }
            Phase::Record { charge } => {
                self.fx
                    .record_effect(ctx.tx(), &format!("{k}/record"))
                    .await?;
                Ok(Step::Done(charge))
            }
        }
    }

    /// Tears the fixture down once nothing else holds it (a completer built on this
    /// operation must be dropped first).
    pub(crate) async fn teardown(self) {
        let Self { fx, .. } = self;
        match Arc::try_unwrap(fx) {
            Ok(fx) => fx.teardown().await,
            Err(_) => panic!("the fixture is still shared at teardown: drop the completers first"),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
