//! Recovery points (atomic phases): an operation run as a sequence of named phases, each
//! boundary one commit of the phase's writes and the record's new recovery point, resumed at
//! the last point by a retry, a takeover or the completer.

use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;
use idem_core::crash::{self, CrashPoint};
use idem_core::store::RecoveryStore;
use idem_core::{
    BoxError, DerivedKey, Error, ErrorKind, IdempotencyKey, Recovery, RequestErrorKind, RequestKey,
    RequestScope, Stuck,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::call::{fingerprint_of, run_or_not};
use crate::engine::{Execution, Idempotency, KeyDigest};

/// What a phase of [`Idempotency::run_phases`] leads to.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Step<P, R> {
    /// Commit this phase's writes with `P` as the new recovery point, then run `P`.
    Next(P),
    /// The operation is over: store the response with this phase's writes (one commit) and
    /// return it; every retry gets it back.
    Done(R),
    /// Give the operation up: store the response as **abandoned** with this phase's writes
    /// (say, a compensation's), and return it; every retry gets it back.
    Abandon(R),
}

/// How an operation's last phase ended it, as [`Idempotency::drive_phases`] hands it back
/// with the execution, whose transaction still holds that phase's writes.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Finish<R> {
    /// [`Step::Done`]: store the response as completed, with the last phase's writes.
    Done(R),
    /// [`Step::Abandon`]: store the response as abandoned
    /// ([`Execution::give_up`]), with the last phase's writes.
    Abandon(R),
}

/// What a phase sees: the transaction its local writes go through, the derived key of each
/// foreign call, and which attempt this is.
#[derive(Debug)]
pub struct PhaseCtx<S: RecoveryStore> {
    tx: Option<S::Tx>,
    key: RequestKey,
    point: String,
    attempt: u32,
}

impl<S: RecoveryStore> PhaseCtx<S> {
    /// The transaction this phase's local writes go through: it commits with the next
    /// recovery point (or the response), and rolls back if the phase fails.
    ///
    /// # Panics
    /// Never in practice: the context holds its transaction for the whole phase.
    pub fn tx(&mut self) -> &mut S::Tx {
        match self.tx.as_mut() {
            Some(tx) => tx,
            None => panic!("PhaseCtx::tx outside a phase"),
        }
    }

    /// The idempotency key to send with the external call named `call` in this phase:
    /// derived from the record's scope and key, the phase's name and `call`
    /// ([`DerivedKey::for_phase`]), so every attempt of the phase sends the same one.
    pub fn foreign_key(&self, call: &str) -> DerivedKey {
        DerivedKey::for_phase(&self.key, &self.point, call)
    }

    /// Executions of this record so far, this one included (1 on the first; each takeover,
    /// the completer's too, adds one).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The name of the phase running (its recovery point).
    pub fn point(&self) -> &str {
        &self.point
    }

    /// The record's key.
    pub fn key(&self) -> &RequestKey {
        &self.key
    }
}

/// A phase's name and stored state: the variant's name of a serde enum (`"Charge"` for both
/// `Phase::Charge` and `Phase::Charge { .. }`), and its JSON.
fn encode_phase<P: Serialize>(phase: &P) -> Result<(String, Vec<u8>), Error> {
    let bad = |why: String| Error::new(ErrorKind::InvalidConfig, why);
    let value =
        serde_json::to_value(phase).map_err(|e| bad(format!("a phase does not serialize: {e}")))?;
    let name = match &value {
        serde_json::Value::String(name) => name.clone(),
        serde_json::Value::Object(map) if map.len() == 1 => {
            map.keys().next().cloned().unwrap_or_default()
        }
        _ => {
            return Err(bad(
                "a phase must serialize as an externally tagged enum variant (its name, or \
                 an object of one entry)"
                    .into(),
            ));
        }
    };
    let state =
        serde_json::to_vec(&value).map_err(|e| bad(format!("a phase does not serialize: {e}")))?;
    Ok((name, state))
}

fn decode_phase<P: DeserializeOwned>(point: &str, state: &[u8]) -> Result<P, Error> {
    serde_json::from_slice(state).map_err(|e| {
        Error::new(
            ErrorKind::Store,
            format!("the stored state of recovery point {point} does not deserialize as this operation's phase: {e}"),
        )
        .with_source(e)
    })
}

fn encode_response<R: Serialize>(response: &R) -> Result<Vec<u8>, Error> {
    serde_json::to_vec(response).map_err(|e| {
        Error::new(
            ErrorKind::InvalidConfig,
            format!("the operation's response does not serialize: {e}"),
        )
        .with_source(e)
    })
}

impl<S: RecoveryStore + Clone + 'static> Execution<S> {
    /// Sets the record's recovery point to `point` with `state` in the operation's
    /// transaction, commits both, and begins the next phase's transaction: one commit per
    /// phase boundary. [`RequestErrorKind::LeaseLost`] when another executor took the record
    /// over: this phase's writes are rolled back and the execution is over.
    ///
    /// An execution in the one-transaction mode moves to the leased mode first
    /// ([`lease_record`](Self::lease_record)): a recovery point must outlive a crash.
    pub async fn advance(&mut self, point: &str, state: &[u8]) -> Result<(), Error> {
        self.lease_record().await?;
        let store = self.idem.store().clone();
        let Some(mut tx) = self.tx.take() else {
            return Err(Error::new(
                ErrorKind::Store,
                "the operation kept the transaction: no recovery point can be committed",
            ));
        };
        if let Err(e) = store
            .advance_in(&mut tx, &self.key, self.fence, point, state)
            .await
        {
            let _ = store.rollback(tx).await;
            return Err(e);
        }
        store.commit(tx).await?;
        self.tx = Some(store.begin_execution().await?);
        Ok(())
    }

    /// Ends the operation as **abandoned**: `compensate` runs in the operation's transaction
    /// (undo what the committed phases did: a refund's record, a released reservation), then
    /// `result` is stored as the record's answer, and both commit together. Every retry gets
    /// `result` back. [`RequestErrorKind::LeaseLost`] when another executor took the record
    /// over (nothing is committed).
    pub async fn give_up<E: Into<BoxError>>(
        mut self,
        result: &[u8],
        compensate: impl AsyncFnOnce(&mut S::Tx) -> Result<(), E>,
    ) -> Result<(), Error> {
        self.stop_heartbeat();
        let store = self.idem.store().clone();
        let ttl = self.idem.ttl();
        let Some(mut tx) = self.tx.take() else {
            let _ = self.free().await;
            self.settled = true;
            return Err(Error::new(
                ErrorKind::Store,
                "the operation kept the transaction: nothing was committed",
            ));
        };
        let ended = match compensate(&mut tx).await {
            Ok(()) => {
                store
                    .abandon_in(&mut tx, &self.key, self.fence, result, ttl)
                    .await
            }
            Err(e) => Err(idem_core::store::handler_error(&store, e.into())),
        };
        if let Err(e) = ended {
            let _ = store.rollback(tx).await;
            if e.request_kind() != Some(RequestErrorKind::LeaseLost) {
                let _ = self.free().await;
            }
            self.settled = true;
            return Err(e);
        }
        let committed = store.commit(tx).await;
        if committed.is_err() {
            let _ = self.free().await;
        }
        self.settled = true;
        if committed.is_ok() {
            crash::reached(CrashPoint::ResponseCommitted);
        }
        committed
    }
}

impl<S: RecoveryStore + Clone + 'static> Idempotency<S> {
    /// Runs an operation of phases once per (`scope`, `key`) and returns its response; every
    /// repeat gets the first response back without running a phase.
    ///
    /// A phase is a value of the caller's serde enum `P` (its recovery point is the variant's
    /// name; the variant's fields are the state the phase needs). `step` runs one phase and
    /// returns [`Step::Next`] (the next phase), [`Step::Done`] (the response) or
    /// [`Step::Abandon`]. Each boundary is **one commit**: the phase's writes through
    /// [`PhaseCtx::tx`] and the record's new recovery point. So a phase that committed never
    /// runs again, and a phase that did not is run again from its start by the next attempt —
    /// a retry of the same key after this call failed, a takeover after a crash, or the
    /// completer ([`take_stuck`](Self::take_stuck)). An external call in a phase sends
    /// [`PhaseCtx::foreign_key`], the same on every attempt, so the third party deduplicates
    /// the repeat; what it answered goes into the next phase's state.
    ///
    /// The record is born at its first recovery point (`first`): the statement that takes the
    /// record writes it ([`RecoveryStore::begin_phases`]), so before the first phase runs the
    /// operation is resumable — by a retry, a takeover or the completer, which knows no
    /// `first` — whether that phase writes locally or calls a third party, and no commit is
    /// spent on the point alone. A boundary thus costs one commit, the take none beyond its
    /// own: an operation of n phases commits n times after its take.
    /// `input` is fingerprinted as in [`call`](Self::call). An error from `step` rolls the
    /// phase's writes back and is returned; the record keeps its last point and its lease
    /// ends, so the next attempt resumes there (it is not freed, as a plain
    /// [`call`](Self::call)'s would be: phases committed).
    pub async fn run_phases<I, P, R, E, F>(
        &self,
        scope: RequestScope,
        key: &IdempotencyKey,
        input: &I,
        first: P,
        step: F,
    ) -> Result<R, Error>
    where
        I: Serialize + ?Sized,
        P: Serialize + DeserializeOwned,
        R: Serialize + DeserializeOwned,
        E: Into<BoxError>,
        F: AsyncFnMut(P, &mut PhaseCtx<S>) -> Result<Step<P, R>, E>,
    {
        let request = RequestKey::new(scope, key.clone());
        let fingerprint = fingerprint_of(input)?;
        // The record is born at the first point (one statement with the take), and the take
        // tells where a record stands: no commit of the first point on its own, no read.
        let (point, state) = encode_phase(&first)?;
        let (lease, ttl) = (self.lease(), self.ttl());
        let lookup = move |store: S, key: RequestKey| async move {
            let taken = store.begin_phases(&key, &fingerprint, lease, ttl, &point, &state);
            taken.await.map(|(begin, recovery)| (begin, recovery, None))
        };
        let (start, taken) = self.take(request, lookup).await?;
        let execution = match run_or_not(start, key) {
            Ok(execution) => execution,
            Err(not_run) => return not_run.into_result(key),
        };
        let recovery = match taken {
            Some(recovery) => Ok(recovery),
            None => {
                (self.store())
                    .recovery(execution.key(), execution.fence())
                    .await
            }
        };
        let recovery = match recovery {
            Ok(recovery) => recovery,
            Err(e) => {
                let _ = execution.abandon().await;
                return Err(e);
            }
        };
        self.drive(execution, recovery, Some(first), step).await
    }

    /// Takes over at most `limit` records stuck in progress — their lease ran out (the client
    /// gave up, the executor crashed) and they have a recovery point — for the completer to
    /// [`resume_phases`](Self::resume_phases) (or [`give_up`](Execution::give_up) after too
    /// many attempts, see [`Recovery::attempts`]). Safe with several completers: a record
    /// another one holds is skipped.
    pub async fn take_stuck(&self, limit: u32) -> Result<Vec<Stuck>, Error> {
        self.store().take_stuck(limit, self.lease()).await
    }

    /// The execution of a record [`take_stuck`](Self::take_stuck) took over, with its
    /// transaction and heartbeat: to [`give_up`](Execution::give_up) or drive by hand.
    pub async fn resume(&self, stuck: Stuck) -> Result<(Execution<S>, Recovery), Error> {
        let execution = self.execution(stuck.key, stuck.fence, true).await?;
        Ok((execution, stuck.recovery))
    }

    /// Resumes a record [`take_stuck`](Self::take_stuck) took over at its last recovery
    /// point and runs its phases to the end, as [`run_phases`](Self::run_phases) would have.
    pub async fn resume_phases<P, R, E, F>(&self, stuck: Stuck, step: F) -> Result<R, Error>
    where
        P: Serialize + DeserializeOwned,
        R: Serialize + DeserializeOwned,
        E: Into<BoxError>,
        F: AsyncFnMut(P, &mut PhaseCtx<S>) -> Result<Step<P, R>, E>,
    {
        let (execution, recovery) = self.resume(stuck).await?;
        self.drive(execution, recovery, None, step).await
    }

    /// Runs the phases of `execution` (a record this caller holds, its recovery state
    /// `recovery`) from its last recovery point — or, when it has none, from `first`, whose
    /// point is committed before it runs — until a phase answers [`Step::Done`] or
    /// [`Step::Abandon`], and hands the execution back with that answer: the last phase's
    /// writes are still uncommitted in its transaction, for the caller to commit with the
    /// response it stores ([`Execution::complete`], or [`Execution::give_up`] for
    /// [`Finish::Abandon`]). This is the loop of [`run_phases`](Self::run_phases) for an
    /// integration that stores the response in its own format (idem-http's layer stores the
    /// HTTP response). A phase's error, a lost lease or a store failure ends the execution
    /// here, as in `run_phases`: the record keeps its last point.
    pub async fn drive_phases<P, R, E, F>(
        &self,
        mut execution: Execution<S>,
        recovery: Recovery,
        first: Option<P>,
        mut step: F,
    ) -> Result<(Execution<S>, Finish<R>), Error>
    where
        P: Serialize + DeserializeOwned,
        E: Into<BoxError>,
        F: AsyncFnMut(P, &mut PhaseCtx<S>) -> Result<Step<P, R>, E>,
    {
        // Phases commit at every boundary: they run in the leased mode.
        execution.lease_record().await?;
        let mut phase = match (recovery.resume, first) {
            (Some(resume), _) => {
                if recovery.attempts > 1 {
                    tracing::debug!(key = %KeyDigest(execution.key()), point = %resume.point, attempt = recovery.attempts, "resuming at the last recovery point");
                }
                match decode_phase(&resume.point, &resume.state) {
                    Ok(phase) => phase,
                    Err(e) => {
                        let _ = execution.abandon().await;
                        return Err(e);
                    }
                }
            }
            // A record taken without its first point (by a plain `start`, or one that never had
            // a point): the point commits on its own before the phase, which may call out.
            (None, Some(first)) => {
                let started = match encode_phase(&first) {
                    Ok((point, state)) => execution.advance(&point, &state).await,
                    Err(e) => Err(e),
                };
                if let Err(e) = started {
                    let _ = execution.abandon().await;
                    return Err(e);
                }
                first
            }
            (None, None) => {
                let _ = execution.abandon().await;
                return Err(Error::new(
                    ErrorKind::Store,
                    "the record has no recovery point to resume at",
                ));
            }
        };
        loop {
            let Some(tx) = execution.take_tx() else {
                let _ = execution.abandon().await;
                return Err(Error::new(
                    ErrorKind::Store,
                    "the execution lost its transaction",
                ));
            };
            let point = match encode_phase(&phase) {
                Ok((point, _)) => point,
                Err(e) => {
                    execution.put_tx(tx);
                    let _ = execution.abandon().await;
                    return Err(e);
                }
            };
            let mut ctx = PhaseCtx {
                tx: Some(tx),
                key: execution.key().clone(),
                point,
                attempt: recovery.attempts,
            };
            let outcome = AssertUnwindSafe(step(phase, &mut ctx)).catch_unwind().await;
            if let Some(tx) = ctx.tx.take() {
                execution.put_tx(tx);
            }
            if matches!(outcome, Ok(Ok(_))) {
                crash::reached(CrashPoint::PhaseReturned);
            }
            match outcome {
                Ok(Ok(Step::Next(next))) => {
                    let advanced = match encode_phase(&next) {
                        Ok((point, state)) => execution.advance(&point, &state).await,
                        Err(e) => Err(e),
                    };
                    if let Err(e) = advanced {
                        if e.request_kind() == Some(RequestErrorKind::LeaseLost) {
                            execution.settle();
                        } else {
                            let _ = execution.abandon().await;
                        }
                        return Err(e);
                    }
                    crash::reached(CrashPoint::PointCommitted);
                    phase = next;
                }
                Ok(Ok(Step::Done(response))) => return Ok((execution, Finish::Done(response))),
                Ok(Ok(Step::Abandon(response))) => {
                    return Ok((execution, Finish::Abandon(response)));
                }
                Ok(Err(e)) => {
                    // Rolled back; the record keeps its last point, its lease ends.
                    let _ = execution.abandon().await;
                    return Err(idem_core::store::handler_error(self.store(), e.into()));
                }
                Err(panic) => {
                    let _ = execution.abandon().await;
                    std::panic::resume_unwind(panic)
                }
            }
        }
    }
}

impl<S: RecoveryStore + Clone + 'static> Idempotency<S> {
    /// [`drive_phases`](Self::drive_phases), then stores the response as JSON with the last
    /// phase's writes: completed, or abandoned.
    async fn drive<P, R, E, F>(
        &self,
        execution: Execution<S>,
        recovery: Recovery,
        first: Option<P>,
        step: F,
    ) -> Result<R, Error>
    where
        P: Serialize + DeserializeOwned,
        R: Serialize + DeserializeOwned,
        E: Into<BoxError>,
        F: AsyncFnMut(P, &mut PhaseCtx<S>) -> Result<Step<P, R>, E>,
    {
        let (execution, finish) = self.drive_phases(execution, recovery, first, step).await?;
        let (response, abandoned) = match finish {
            Finish::Done(response) => (response, false),
            Finish::Abandon(response) => (response, true),
        };
        let bytes = match encode_response(&response) {
            Ok(bytes) => bytes,
            Err(e) => {
                let _ = execution.abandon().await;
                return Err(e);
            }
        };
        if abandoned {
            execution
                .give_up(&bytes, async |_: &mut S::Tx| Ok::<(), Error>(()))
                .await?;
        } else {
            execution.complete(&bytes).await?;
        }
        Ok(response)
    }
}

impl<S: RecoveryStore + Clone + 'static> Execution<S> {
    /// Marks the execution over without freeing the key (its fence lost the record).
    fn settle(mut self) {
        self.stop_heartbeat();
        self.tx = None;
        self.settled = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, serde::Deserialize)]
    enum Phase {
        Start,
        Charge { cents: i64 },
        Record(String),
    }

    #[test]
    fn a_phase_is_named_by_its_variant_and_round_trips() {
        for (phase, name) in [
            (Phase::Start, "Start"),
            (Phase::Charge { cents: 5 }, "Charge"),
            (Phase::Record("ch_1".into()), "Record"),
        ] {
            let (point, state) = encode_phase(&phase).unwrap();
            assert_eq!(point, name);
            assert_eq!(decode_phase::<Phase>(&point, &state).unwrap(), phase);
        }
    }

    #[test]
    fn a_phase_that_is_no_enum_variant_is_refused() {
        #[derive(Serialize)]
        struct NotAnEnum {
            a: i64,
            b: i64,
        }
        let err = encode_phase(&NotAnEnum { a: 1, b: 2 }).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidConfig);
        assert!(encode_phase(&7).is_err());
        let err = decode_phase::<Phase>("Start", b"\"Gone\"").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Store);
    }
}
