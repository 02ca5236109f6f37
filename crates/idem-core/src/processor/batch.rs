//! Batches: N messages, one transaction, one commit.
//!
//! Two forms. [`Processor::process_batch`] runs a per-message [`Handler`] under a savepoint
//! per message, so one failing or conflicting message rolls back only itself. [`Processor::
//! process_batch_set`] claims the whole batch in one statement and hands the new messages to a
//! set-based handler at once: the fast path for high-volume consumers.

use std::collections::HashMap;

use crate::clock::Clock;
use crate::error::{BoxError, Error};
use crate::fingerprint::Fingerprint;
use crate::handler::Handler;
use crate::id::MessageId;
use crate::message::{Identified, Message};
use crate::outcome::{Claim, Outcome};
use crate::store::{BatchClaimStore, ClaimStore, Savepoints};

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

impl<S: ClaimStore, C: Clock> Processor<S, C> {
    /// Processes `msgs` in one transaction with a savepoint per message.
    ///
    /// Returns one result per message, in input order. A message whose handler fails is rolled
    /// back to its savepoint (its claim too) and reported as `Err` with its kind; the others
    /// commit together. The outer `Err` means nothing committed (e.g. the commit failed).
    ///
    /// This is the batch path the runner takes (`Consumer::batch`): its future is `Send`
    /// whenever the store's transaction and the payload are, because [`Handler`]'s is.
    pub async fn process_batch<P, H>(
        &self,
        msgs: &[Message<P>],
        handler: &H,
    ) -> Result<Vec<Result<Outcome<H::Output>, Error>>, Error>
    where
        S: Savepoints,
        H: Handler<S::Tx, P> + ?Sized,
    {
        let mut results = Vec::with_capacity(msgs.len());
        if msgs.is_empty() {
            return Ok(results);
        }
        let mut tx = self.store.begin().await?;
        for msg in msgs {
            if let Err(e) = self.check_id(msg.message_id()) {
                results.push(Err(e));
                continue;
            }
            if let Err(e) = self.store.savepoint(&mut tx).await {
                let _ = self.store.rollback(tx).await;
                return Err(e);
            }
            // A later duplicate of an ID earlier in this batch finds that claim: same transaction.
            let claim = match self.claim_checked(&mut tx, msg).await {
                Ok(claim) => claim,
                Err(e) => {
                    // As below: if the engine aborted the whole transaction (InnoDB deadlock),
                    // the savepoint is gone and the claim's own error is the one to report.
                    if self.store.rollback_to_savepoint(&mut tx).await.is_err() {
                        let _ = self.store.rollback(tx).await;
                        return Err(e);
                    }
                    results.push(Err(e));
                    continue;
                }
            };
            if let Some(skipped) = claim.skipped() {
                self.store.release_savepoint(&mut tx).await?;
                results.push(Ok(skipped));
                continue;
            }
            match handler.handle(&mut tx, msg).await {
                Ok(value) => {
                    self.store.release_savepoint(&mut tx).await?;
                    results.push(Ok(Outcome::Processed(value)));
                }
                Err(e) => {
                    let err = self.handler_error(e);
                    // Some engines (InnoDB on deadlock) abort the whole transaction, savepoint
                    // included; then nothing in the batch can commit and the caller retries it.
                    if let Err(undo) = self.store.rollback_to_savepoint(&mut tx).await {
                        let _ = self.store.rollback(tx).await;
                        return Err(if err.is_retryable() { err } else { undo });
                    }
                    results.push(Err(err));
                }
            }
        }
        self.store.commit(tx).await?;
        Ok(results)
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
        let mut outcomes: Vec<Option<Result<Outcome<()>, Error>>> =
            (0..msgs.len()).map(|_| None).collect();
        // The first occurrence of each ID goes to the store; repeats inside the batch are
        // decided here against it, because one statement cannot see its own rows.
        let mut first: HashMap<&MessageId, usize> = HashMap::new();
        let mut to_claim: Vec<usize> = Vec::with_capacity(msgs.len());
        let mut repeats: Vec<(usize, usize)> = Vec::new(); // (repeat, its first occurrence)
        for (i, msg) in msgs.iter().enumerate() {
            if let Err(e) = self.check_id(msg.message_id()) {
                outcomes[i] = Some(Err(e));
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
        let fingerprints: Vec<Fingerprint> = msgs.iter().map(Identified::fingerprint).collect();
        // Per message index: the fingerprint of a claim that existed before this batch.
        let mut stored: Vec<Option<Fingerprint>> = vec![None; msgs.len()];
        let mut tx = self.store.begin().await?;
        if self.mode == ClaimMode::Claim && !to_claim.is_empty() {
            // Claims go in ID order so two batches sharing IDs lock rows in the same order and
            // wait for each other instead of deadlocking.
            let mut order = to_claim.clone();
            order.sort_by(|&a, &b| msgs[a].message_id().cmp(msgs[b].message_id()));
            let items: Vec<(&MessageId, Fingerprint)> = order
                .iter()
                .map(|&i| (msgs[i].message_id(), fingerprints[i]))
                .collect();
            let found = match self
                .store
                .claim_many(&mut tx, &self.consumer, &items, self.clock.stamp())
                .await
            {
                Ok(found) => found,
                Err(e) => {
                    let _ = self.store.rollback(tx).await;
                    return Err(e);
                }
            };
            if found.len() != order.len() {
                let _ = self.store.rollback(tx).await;
                return Err(Error::new(
                    crate::error::ErrorKind::Store,
                    format!(
                        "store returned {} claim results for {} messages",
                        found.len(),
                        order.len()
                    ),
                ));
            }
            for (&i, fp) in order.iter().zip(found) {
                stored[i] = fp;
            }
        }
        let mut fresh: Vec<&M> = Vec::with_capacity(to_claim.len());
        for &i in &to_claim {
            let claim = Claim::from_stored(stored[i], fingerprints[i]);
            outcomes[i] = Some(Ok(match claim.skipped() {
                Some(skipped) => skipped,
                None => {
                    fresh.push(&msgs[i]);
                    Outcome::Processed(())
                }
            }));
        }
        for (i, j) in repeats {
            outcomes[i] = Some(Ok(if self.mode == ClaimMode::Skip {
                fresh.push(&msgs[i]);
                Outcome::Processed(())
            } else {
                // What the store holds for this ID once the batch commits: the earlier claim,
                // else the first occurrence's own fingerprint — never another unclaimed copy.
                let holds = stored[j].unwrap_or(fingerprints[j]);
                Claim::from_stored(Some(holds), fingerprints[i])
                    .skipped()
                    .unwrap_or(Outcome::Duplicate)
            }));
        }
        let output = if fresh.is_empty() {
            let _ = self.store.rollback(tx).await;
            None
        } else {
            match handler(&mut tx, &fresh).await {
                Ok(v) => {
                    self.store.commit(tx).await?;
                    Some(v)
                }
                Err(e) => {
                    let _ = self.store.rollback(tx).await;
                    return Err(self.handler_error(e.into()));
                }
            }
        };
        let outcomes = outcomes
            .into_iter()
            .map(|o| o.unwrap_or(Ok(Outcome::Duplicate)))
            .collect();
        Ok(SetBatch { outcomes, output })
    }
}
