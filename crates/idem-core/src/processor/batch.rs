//! Batches: N messages, one claim statement, one transaction, one commit.
//!
//! Both forms claim the whole batch at once ([`BatchClaimStore::claim_many`]) and run the
//! handler for the new messages only. [`Processor::process_batch`] runs a per-message
//! [`Handler`]; a message whose handler fails is isolated optimistically: the batch rolls back
//! and is redone without it (failures are rare; `BENCHMARKS.md` measures this against a
//! savepoint per message). [`Processor::process_batch_set`] hands all new messages to one
//! set-based handler: the fast path for high-volume consumers.

use std::collections::HashMap;

use crate::clock::Clock;
use crate::error::{BoxError, Disposition, Error, ErrorKind};
use crate::fingerprint::Fingerprint;
use crate::handler::{Handler, SetHandler};
use crate::id::MessageId;
use crate::message::{Identified, Message};
use crate::outcome::{Claim, Outcome};
use crate::store::{BatchClaimStore, ClaimStore};

use super::{ClaimMode, Processor};

/// What [`Processor::process_batch_set`] reports.
#[derive(Debug)]
pub struct SetBatch<T> {
    /// Per input message, in input order: `Processed(())` for those the handler received,
    /// `Duplicate`/`Conflict` for those it did not, or the message's own error (an invalid ID).
    pub outcomes: Vec<Result<Outcome<()>, Error>>,
    /// The handler's value; `None` when no message was new and the handler did not run.
    pub output: Option<T>,
}

/// One message's place in a claimed batch.
enum Slot {
    /// Claimed by this transaction: the handler runs for it.
    Fresh,
    /// Not run: the claim found a duplicate or a conflict (never `Claim::New`).
    Skipped(Claim),
    /// Left out of this pass: an invalid ID, or a handler failure in an earlier pass.
    Out,
}

/// Whether a handler's error belongs to its message, so the batch can be redone without it.
/// A deadlock, a lost connection or a store outage says nothing about any one message (and
/// may have aborted the transaction for all of them); a misconfiguration stops the consumer.
fn belongs_to_message(e: &Error) -> bool {
    !e.is_outage() && e.kind() != ErrorKind::Transient && e.disposition() != Disposition::Fatal
}

/// What one pass over a batch claims: the messages to claim in ID order, and the repeats of
/// an ID inside the batch, decided against its first occurrence.
struct Plan<'m> {
    /// Indexes of the first occurrence of each ID not left out, in input order.
    to_claim: Vec<usize>,
    /// (repeat, its first occurrence).
    repeats: Vec<(usize, usize)>,
    /// `to_claim` in ID order: the order the claims are sent in.
    order: Vec<usize>,
    /// The claims, in `order`.
    items: Vec<(&'m MessageId, Fingerprint)>,
}

impl<S: ClaimStore, C: Clock> Processor<S, C> {
    /// Which of the batch's messages not `out` to claim. Repeats of an ID inside the batch are
    /// decided against its first occurrence, because one statement cannot see its own rows;
    /// claims go in ID order so two batches sharing IDs lock rows in the same order and wait
    /// for each other instead of deadlocking.
    fn plan_claims<'m, M: Identified>(
        &self,
        msgs: &'m [M],
        fingerprints: &[Fingerprint],
        out: &[bool],
    ) -> Plan<'m> {
        let mut first: HashMap<&MessageId, usize> = HashMap::new();
        let mut to_claim: Vec<usize> = Vec::with_capacity(msgs.len());
        let mut repeats: Vec<(usize, usize)> = Vec::new();
        for (i, msg) in msgs.iter().enumerate() {
            if out[i] {
                continue;
            }
            match first.get(msg.message_id()) {
                Some(&j) => repeats.push((i, j)),
                None => {
                    first.insert(msg.message_id(), i);
                    to_claim.push(i);
                }
            }
        }
        let (order, items) = if self.mode == ClaimMode::Claim {
            let mut order = to_claim.clone();
            order.sort_by(|&a, &b| msgs[a].message_id().cmp(msgs[b].message_id()));
            let items = order
                .iter()
                .map(|&i| (msgs[i].message_id(), fingerprints[i]))
                .collect();
            (order, items)
        } else {
            (Vec::new(), Vec::new())
        };
        Plan {
            to_claim,
            repeats,
            order,
            items,
        }
    }

    /// Says which messages are new, from what the store held for the claims of `plan` (`found`,
    /// in `plan.order`).
    fn slots(
        &self,
        len: usize,
        fingerprints: &[Fingerprint],
        plan: &Plan<'_>,
        found: Vec<Option<Fingerprint>>,
    ) -> Result<Vec<Slot>, Error> {
        if found.len() != plan.order.len() {
            return Err(Error::new(
                ErrorKind::Store,
                format!(
                    "store returned {} claim results for {} messages",
                    found.len(),
                    plan.order.len()
                ),
            ));
        }
        // Per message index: the fingerprint of a claim that existed before this batch.
        let mut stored: Vec<Option<Fingerprint>> = vec![None; len];
        for (&i, fp) in plan.order.iter().zip(found) {
            stored[i] = fp;
        }
        let mut slots: Vec<Slot> = (0..len).map(|_| Slot::Out).collect();
        for &i in &plan.to_claim {
            slots[i] = match Claim::from_stored(stored[i], fingerprints[i]) {
                Claim::New => Slot::Fresh,
                found => Slot::Skipped(found),
            };
        }
        for &(i, j) in &plan.repeats {
            slots[i] = if self.mode == ClaimMode::Skip {
                Slot::Fresh
            } else {
                // What the store holds for this ID once the batch commits: the earlier claim,
                // else the first occurrence's own fingerprint — never another unclaimed copy.
                let holds = stored[j].unwrap_or(fingerprints[j]);
                Slot::Skipped(Claim::from_stored(Some(holds), fingerprints[i]))
            };
        }
        Ok(slots)
    }

    /// Validates every ID: the invalid ones get their error and are left out of the batch.
    fn check_batch<M: Identified>(&self, msgs: &[M]) -> (Vec<Option<Error>>, Vec<bool>) {
        let errors: Vec<Option<Error>> = msgs
            .iter()
            .map(|m| self.check_id(m.message_id()).err())
            .collect();
        let out = errors.iter().map(Option::is_some).collect();
        (errors, out)
    }

    /// Begins a transaction with the claims of the batch's messages not `out`, in one call
    /// ([`BatchClaimStore::begin_and_claim_many`]: one flight on a pipelining store), and says
    /// which messages are new. In naturally idempotent mode, or with nothing to claim, a plain
    /// `begin`. On an error no transaction is left open.
    async fn begin_claimed<M: Identified>(
        &self,
        msgs: &[M],
        fingerprints: &[Fingerprint],
        out: &[bool],
    ) -> Result<(S::Tx, Vec<Slot>), Error>
    where
        S: BatchClaimStore,
    {
        let plan = self.plan_claims(msgs, fingerprints, out);
        let (tx, found) = if plan.items.is_empty() {
            (self.store.begin().await?, Vec::new())
        } else {
            self.store
                .begin_and_claim_many(&self.consumer, &plan.items, self.clock.stamp())
                .await?
        };
        match self.slots(msgs.len(), fingerprints, &plan, found) {
            Ok(slots) => Ok((tx, slots)),
            Err(e) => {
                let _ = self.store.rollback(tx).await;
                Err(e)
            }
        }
    }

    /// Processes `msgs` in one transaction: one claim statement for the whole batch, then
    /// `handler` for each new message in input order, then one commit.
    ///
    /// Returns one result per message, in input order: `Processed` with the handler's value,
    /// `Duplicate` or `Conflict` (a repeat of an ID earlier in the batch is a duplicate of it),
    /// or the message's own error. A message whose handler fails is reported as `Err` with its
    /// kind and nothing of it commits: the batch is rolled back and redone without it, so one
    /// failure costs one more pass, and the others commit together. The outer `Err` means
    /// nothing committed: the claim or the commit failed, or a handler hit an error that is
    /// not its message's (a deadlock, a lost connection, a store outage, a misconfiguration).
    ///
    /// This is the batch path the runner takes (`Consumer::batch`): its future is `Send`
    /// whenever the store's transaction and the payload are, because [`Handler`]'s is.
    pub async fn process_batch<P, H>(
        &self,
        msgs: &[Message<P>],
        handler: &H,
    ) -> Result<Vec<Result<Outcome<H::Output>, Error>>, Error>
    where
        S: BatchClaimStore,
        H: Handler<S::Tx, P> + ?Sized,
    {
        let (mut errors, mut out) = self.check_batch(msgs);
        let fingerprints: Vec<Fingerprint> = msgs.iter().map(Identified::fingerprint).collect();
        'pass: loop {
            if out.iter().all(|&o| o) {
                break 'pass;
            }
            let (mut tx, slots) = self.begin_claimed(msgs, &fingerprints, &out).await?;
            let mut values: Vec<Option<H::Output>> = (0..msgs.len()).map(|_| None).collect();
            for (i, slot) in slots.iter().enumerate() {
                if !matches!(slot, Slot::Fresh) {
                    continue;
                }
                match handler.handle(&mut tx, &msgs[i]).await {
                    Ok(v) => values[i] = Some(v),
                    Err(e) => {
                        let _ = self.store.rollback(tx).await;
                        let e = self.handler_error(e);
                        if !belongs_to_message(&e) {
                            return Err(e);
                        }
                        // Everything this pass wrote is gone; redo it without this message.
                        errors[i] = Some(e);
                        out[i] = true;
                        continue 'pass;
                    }
                }
            }
            if slots.iter().any(|s| matches!(s, Slot::Fresh)) {
                self.store.commit(tx).await?;
            } else {
                // Nothing was written; end the transaction.
                let _ = self.store.rollback(tx).await;
            }
            let results = slots
                .into_iter()
                .zip(values)
                .zip(errors)
                .map(|((slot, value), error)| match (slot, value, error) {
                    (_, _, Some(e)) => Err(e),
                    (Slot::Fresh, Some(v), _) => Ok(Outcome::Processed(v)),
                    (Slot::Skipped(c), _, _) => Ok(c.skipped().unwrap_or(Outcome::Duplicate)),
                    // A fresh slot always has its value, and an out one its error.
                    _ => Err(lost_result()),
                })
                .collect();
            return Ok(results);
        }
        // Every message was left out: report each one's error.
        Ok(errors
            .into_iter()
            .map(|e| Err(e.unwrap_or_else(lost_result)))
            .collect())
    }

    /// Processes `msgs` in one transaction with one claim statement for all of them, then runs
    /// `handler` once with the new (not duplicate, not conflicting) messages.
    ///
    /// A handler error rolls back the whole batch, claims included, and is returned.
    ///
    /// Set handlers that update shared rows (balances) should lock them in key order first
    /// (e.g. `SELECT … WHERE id = ANY($1) ORDER BY id FOR UPDATE`): an `UPDATE … FROM
    /// unnest(…)` may lock rows in physical order and deadlock against a concurrent batch. A
    /// deadlock is reported as [`ErrorKind::Transient`](crate::ErrorKind::Transient) and the
    /// batch can be retried, but ordering avoids it.
    pub async fn process_batch_set<M, T, E, F>(
        &self,
        msgs: &[M],
        handler: F,
    ) -> Result<SetBatch<T>, Error>
    where
        S: BatchClaimStore,
        M: Identified,
        F: AsyncFnOnce(&mut S::Tx, &[&M]) -> Result<T, E>,
        E: Into<BoxError>,
    {
        let mut claimed = self.claim_set(msgs).await?;
        let output = match &mut claimed.tx {
            Some(tx) => Some(handler(tx, &claimed.fresh).await.map_err(Into::into)),
            None => None,
        };
        self.finish_set(claimed, output).await
    }

    /// [`Processor::process_batch_set`] with a [`SetHandler`]: the runner's set-batch path,
    /// whose future is `Send` whenever the store's transaction and the payload are.
    pub async fn process_batch_set_with<P, H>(
        &self,
        msgs: &[Message<P>],
        handler: &H,
    ) -> Result<SetBatch<H::Output>, Error>
    where
        S: BatchClaimStore,
        H: SetHandler<S::Tx, P> + ?Sized,
    {
        // The two halves around a direct call, not a closure over the handler: rustc cannot
        // prove such a closure's future `Send` (rust-lang/rust#151398).
        let mut claimed = self.claim_set(msgs).await?;
        let output = match &mut claimed.tx {
            Some(tx) => Some(handler.handle_set(tx, &claimed.fresh).await),
            None => None,
        };
        self.finish_set(claimed, output).await
    }

    /// The first half of a set batch: begin, claim, and the new messages for the handler.
    async fn claim_set<'m, M: Identified>(
        &self,
        msgs: &'m [M],
    ) -> Result<ClaimedSet<'m, M, S::Tx>, Error>
    where
        S: BatchClaimStore,
    {
        let (errors, out) = self.check_batch(msgs);
        let fingerprints: Vec<Fingerprint> = msgs.iter().map(Identified::fingerprint).collect();
        let (tx, slots) = self.begin_claimed(msgs, &fingerprints, &out).await?;
        let fresh: Vec<&M> = slots
            .iter()
            .zip(msgs)
            .filter(|(s, _)| matches!(s, Slot::Fresh))
            .map(|(_, m)| m)
            .collect();
        let tx = if fresh.is_empty() {
            // Nothing new: nothing to write, and the handler does not run.
            let _ = self.store.rollback(tx).await;
            None
        } else {
            Some(tx)
        };
        Ok(ClaimedSet {
            tx,
            fresh,
            slots,
            errors,
        })
    }

    /// The second half: commit or roll back on the handler's result, and report.
    async fn finish_set<M, T>(
        &self,
        claimed: ClaimedSet<'_, M, S::Tx>,
        output: Option<Result<T, BoxError>>,
    ) -> Result<SetBatch<T>, Error> {
        let ClaimedSet {
            tx, slots, errors, ..
        } = claimed;
        let output = match (tx, output) {
            (Some(tx), Some(Ok(v))) => {
                self.store.commit(tx).await?;
                Some(v)
            }
            (Some(tx), Some(Err(e))) => {
                let _ = self.store.rollback(tx).await;
                return Err(self.handler_error(e));
            }
            (Some(tx), None) => {
                let _ = self.store.rollback(tx).await;
                None
            }
            (None, _) => None,
        };
        let outcomes = slots
            .into_iter()
            .zip(errors)
            .map(|(slot, error)| match (slot, error) {
                (_, Some(e)) => Err(e),
                (Slot::Fresh, None) => Ok(Outcome::Processed(())),
                (Slot::Skipped(c), None) => Ok(c.skipped().unwrap_or(Outcome::Duplicate)),
                (Slot::Out, None) => Err(lost_result()),
            })
            .collect();
        Ok(SetBatch { outcomes, output })
    }
}

/// A set batch between its claim and its handler.
struct ClaimedSet<'m, M, Tx> {
    /// Open while there are new messages; `None` when the batch had none.
    tx: Option<Tx>,
    fresh: Vec<&'m M>,
    slots: Vec<Slot>,
    errors: Vec<Option<Error>>,
}

/// A result the batch bookkeeping should always have; reported rather than panicked on.
fn lost_result() -> Error {
    Error::new(
        ErrorKind::Store,
        "batch bookkeeping lost a message's result",
    )
}
