//! P2: batches in one transaction — set-based and per-message forms, and the two ways of
//! isolating a failing message in the per-message form (redo the batch without it, as
//! `process_batch` does, or a savepoint per message) with and without a failure per batch.

use std::sync::Arc;

use anyhow::bail;
use idem_core::{BoxError, Claim, Handler, Identified, Message, Savepoints, TransactionalStore};
use idem_sql::PostgresTx;
use sqlx::postgres::PgConnection;

use super::{Bench, Ctx, charge, charge_set, expect_processed, now_micros};
use crate::measure::Op;
use crate::workload::{CONSUMER, Delivery, Ids};
use crate::{Group, Target, Variant, plural};

/// `PostgresStore::claim_many`'s statement.
const CLAIM_SET: &str = "INSERT INTO idem_bench_claims \
     (consumer, message_id, fingerprint, processed_at) \
     SELECT $1, m, f, $4 FROM unnest($2::bytea[], $3::bytea[]) AS u(m, f) \
     ON CONFLICT (consumer, message_id) DO NOTHING RETURNING message_id";
/// The same without RETURNING: when the row count equals the batch size, every claim is new
/// and there is nothing to read back.
const CLAIM_SET_COUNT: &str = "INSERT INTO idem_bench_claims \
     (consumer, message_id, fingerprint, processed_at) \
     SELECT $1, m, f, $4 FROM unnest($2::bytea[], $3::bytea[]) AS u(m, f) \
     ON CONFLICT (consumer, message_id) DO NOTHING";
const NARROW_CLAIM_SET: &str = "INSERT INTO idem_bench_narrow_claims (message_id) \
     SELECT * FROM unnest($1::bytea[]) ON CONFLICT DO NOTHING";

impl Bench {
    /// P2: batches of `--batch` messages per transaction.
    pub(crate) async fn p2(&self, worker_counts: &[usize]) -> anyhow::Result<Vec<Group>> {
        let mut variants = vec![
            P2::BareSet,
            P2::IdemSet,
            P2::IdemSetHeld,
            P2::BareLoop,
            P2::IdemBatch,
            P2::Savepoints,
            P2::IdemBatchFailing,
            P2::SavepointsFailing,
        ];
        if self.settings.experimental {
            variants.extend([P2::HandSet, P2::HandSetCount, P2::NarrowSet]);
        }
        let mut groups = Vec::new();
        for &workers in worker_counts {
            let title = format!(
                "P2 batched ({} messages per transaction), PostgreSQL, {}",
                self.settings.batch,
                plural(workers, "worker")
            );
            let group = Group::measure(title, &variants, &self.settings, async |v| {
                let ctx = self.context(workers, false).await?;
                let op = P2Op {
                    ctx: Arc::clone(&ctx),
                    variant: v,
                    ids: self.settings.ids(),
                };
                let sample = self.sample(op, workers, &ctx.cpu).await;
                ctx.close().await;
                sample
            })
            .await?
            .targets([
                Target::Rate {
                    of: "idem-set",
                    at_least: 100_000.0,
                },
                Target::at_least("idem-set", "bare-set", 0.85),
                Target::at_least("idem-set-held", "bare-set", 0.85),
                Target::compare("idem-batch", "bare-loop"),
                Target::compare("idem-batch", "savepoints"),
                Target::compare("idem-batch-failing", "savepoints-failing"),
            ]);
            let group = if self.settings.experimental {
                group.targets([
                    Target::compare("idem-set", "hand-set"),
                    Target::compare("hand-set-count", "hand-set"),
                    Target::compare("narrow-set", "hand-set-count"),
                ])
            } else {
                group
            };
            let group = group.note(
                "set form: one unnest INSERT of all charges + one UPDATE of the balances summed \
                 per account, which first locks its accounts in key order (without that, the \
                 hash join's physical-order locking deadlocks concurrent batches); \
                 loop forms run the per-message statements in account order for the same reason; \
                 N = messages per batch",
            );
            groups.push(group);
        }
        Ok(groups)
    }
}

/// Experimental: the batch claim written by hand, to split `process_batch_set`'s cost into
/// the statement and the processor's bookkeeping. Returns how many claims were new.
async fn claim_set(conn: &mut PgConnection, form: P2, ds: &[&Delivery]) -> anyhow::Result<usize> {
    let ids: Vec<&[u8]> = ds.iter().map(|d| d.id.as_bytes()).collect();
    if matches!(form, P2::NarrowSet) {
        let n = sqlx::query(NARROW_CLAIM_SET)
            .bind(&ids)
            .execute(&mut *conn)
            .await?
            .rows_affected();
        return Ok(usize::try_from(n)?);
    }
    let fps: Vec<_> = ds.iter().map(|d| d.fingerprint()).collect();
    let fps: Vec<&[u8]> = fps.iter().map(|f| &f.as_bytes()[..]).collect();
    if matches!(form, P2::HandSetCount) {
        let n = sqlx::query(CLAIM_SET_COUNT)
            .bind(CONSUMER)
            .bind(&ids)
            .bind(&fps)
            .bind(now_micros())
            .execute(&mut *conn)
            .await?
            .rows_affected();
        return Ok(usize::try_from(n)?);
    }
    let new: Vec<Vec<u8>> = sqlx::query_scalar(CLAIM_SET)
        .bind(CONSUMER)
        .bind(&ids)
        .bind(&fps)
        .bind(now_micros())
        .fetch_all(&mut *conn)
        .await?;
    Ok(new.len())
}

#[derive(Debug, Clone, Copy)]
enum P2 {
    BareSet,
    IdemSet,
    IdemSetHeld,
    BareLoop,
    IdemBatch,
    Savepoints,
    IdemBatchFailing,
    SavepointsFailing,
    HandSet,
    HandSetCount,
    NarrowSet,
}

impl Variant for P2 {
    fn key(self) -> &'static str {
        match self {
            P2::BareSet => "bare-set",
            P2::IdemSet => "idem-set",
            P2::IdemSetHeld => "idem-set-held",
            P2::BareLoop => "bare-loop",
            P2::IdemBatch => "idem-batch",
            P2::Savepoints => "savepoints",
            P2::IdemBatchFailing => "idem-batch-failing",
            P2::SavepointsFailing => "savepoints-failing",
            P2::HandSet => "hand-set",
            P2::HandSetCount => "hand-set-count",
            P2::NarrowSet => "narrow-set",
        }
    }

    fn label(self) -> &'static str {
        match self {
            P2::BareSet => "bare set-based batch (no claim)",
            P2::IdemSet => "idem `process_batch_set`",
            P2::IdemSetHeld => "idem `process_batch_set`, `hold_connections`",
            P2::BareLoop => "bare per-message statements (no claim)",
            P2::IdemBatch => "idem `process_batch` (one claim statement, redo on failure)",
            P2::Savepoints => "alternative: claim + savepoint per message",
            P2::IdemBatchFailing => "idem `process_batch`, one message per batch fails",
            P2::SavepointsFailing => "alternative: savepoints, one message per batch fails",
            P2::HandSet => "exp: hand-written set claim (the store's SQL)",
            P2::HandSetCount => "exp: hand-written set claim, no RETURNING",
            P2::NarrowSet => "exp: hand-written set claim, id-only row",
        }
    }

    fn round_trips(self) -> &'static str {
        match self {
            P2::BareSet => "6 per batch = 4 + 2 pings",
            P2::IdemSet => "7 per batch = 5 + 2 pings",
            P2::IdemSetHeld => "5 per batch",
            P2::BareLoop => "2N + 4 per batch",
            P2::IdemBatch => "2N + 5 per batch",
            P2::Savepoints => "5N + 4 per batch",
            P2::IdemBatchFailing => "about 2 × (2N + 5) per batch",
            P2::SavepointsFailing => "5N + 4 per batch",
            P2::HandSet | P2::HandSetCount | P2::NarrowSet => "7 per batch = 5 + 2 pings",
        }
    }
}

#[derive(Debug)]
struct P2Op {
    ctx: Arc<Ctx>,
    variant: P2,
    ids: Ids,
}

impl Op for P2Op {
    type State = ();

    async fn open(&self, _worker: usize) -> anyhow::Result<()> {
        Ok(())
    }

    async fn run(&self, _: &mut (), worker: usize, seq: u64) -> anyhow::Result<u64> {
        let ctx = &*self.ctx;
        let mut batch = self.ids.batch(worker, seq, ctx.batch)?;
        match self.variant {
            P2::BareSet => {
                let refs: Vec<&Delivery> = batch.iter().collect();
                let mut tx = ctx.pool.begin().await?;
                charge_set(&mut tx, &refs).await?;
                tx.commit().await?;
            }
            P2::IdemSet | P2::IdemSetHeld => {
                let processor = if matches!(self.variant, P2::IdemSet) {
                    &ctx.processor
                } else {
                    &ctx.held
                };
                let out = processor
                    .process_batch_set(&batch, async |tx, fresh: &[&Delivery]| {
                        charge_set(tx, fresh).await
                    })
                    .await?;
                if out.output.is_none() {
                    bail!("no message of a fresh batch was new");
                }
                for (d, outcome) in batch.iter().zip(out.outcomes) {
                    expect_processed(d, outcome?)?;
                }
            }
            P2::HandSet | P2::HandSetCount | P2::NarrowSet => {
                let refs: Vec<&Delivery> = batch.iter().collect();
                let mut tx = ctx.pool.begin().await?;
                let claimed = claim_set(&mut tx, self.variant, &refs).await?;
                if claimed != refs.len() {
                    bail!("{claimed} of {} fresh claims were new", refs.len());
                }
                charge_set(&mut tx, &refs).await?;
                tx.commit().await?;
            }
            P2::BareLoop => {
                batch.sort_by(|a, b| a.account.cmp(&b.account));
                let mut tx = ctx.pool.begin().await?;
                for d in &batch {
                    charge(&mut tx, d).await?;
                }
                tx.commit().await?;
            }
            P2::IdemBatch | P2::IdemBatchFailing => {
                batch.sort_by(|a, b| a.account.cmp(&b.account));
                let failing = self.failing(&batch);
                let msgs = messages(batch);
                let handler = Charge {
                    failing: failing.clone(),
                };
                let results = ctx.processor.process_batch(&msgs, &handler).await?;
                let mut committed = 0;
                for (m, outcome) in msgs.iter().zip(results) {
                    match outcome {
                        Err(_) if Some(m.message_id()) == failing.as_ref() => {}
                        outcome => {
                            expect_processed(m.payload(), outcome?)?;
                            committed += 1;
                        }
                    }
                }
                return Ok(committed);
            }
            P2::Savepoints | P2::SavepointsFailing => {
                batch.sort_by(|a, b| a.account.cmp(&b.account));
                let failing = self.failing(&batch);
                return savepoints(ctx, &messages(batch), failing.as_ref()).await;
            }
        }
        Ok(batch.len() as u64)
    }
}

impl P2Op {
    /// The message of `batch` whose handler fails, in the failing variants: the middle one,
    /// after its statements ran, so undoing it costs what a real failure costs.
    fn failing(&self, batch: &[Delivery]) -> Option<idem_core::MessageId> {
        match self.variant {
            P2::IdemBatchFailing | P2::SavepointsFailing => {
                batch.get(batch.len() / 2).map(|d| d.id.clone())
            }
            _ => None,
        }
    }
}

fn messages(batch: Vec<Delivery>) -> Vec<Message<Delivery>> {
    batch
        .into_iter()
        .map(|d| Message::with_fingerprint(d.id.clone(), d.fingerprint(), d))
        .collect()
}

/// The per-message handler, as the runner runs it; fails for `failing` after its writes.
struct Charge {
    failing: Option<idem_core::MessageId>,
}

impl Handler<PostgresTx, Delivery> for Charge {
    type Output = ();

    async fn handle(&self, tx: &mut PostgresTx, msg: &Message<Delivery>) -> Result<(), BoxError> {
        charge(tx, msg.payload()).await?;
        if Some(msg.message_id()) == self.failing.as_ref() {
            return Err("declined (injected)".into());
        }
        Ok(())
    }
}

/// The isolation `process_batch` does not use, measured against it: per message a savepoint,
/// its own claim, the handler, then release (or roll back to the savepoint on failure); one
/// commit. Returns how many committed.
async fn savepoints(
    ctx: &Ctx,
    msgs: &[Message<Delivery>],
    failing: Option<&idem_core::MessageId>,
) -> anyhow::Result<u64> {
    let store = ctx.processor.store();
    let handler = Charge {
        failing: failing.cloned(),
    };
    let mut tx = store.begin().await?;
    let mut committed = 0;
    for m in msgs {
        store.savepoint(&mut tx).await?;
        if ctx.processor.claim_in(&mut tx, m).await? != Claim::New {
            bail!("fresh message {:?} was not new", m.message_id());
        }
        match handler.handle(&mut tx, m).await {
            Ok(()) => {
                store.release_savepoint(&mut tx).await?;
                committed += 1;
            }
            Err(_) if failing == Some(m.message_id()) => {
                store.rollback_to_savepoint(&mut tx).await?;
            }
            Err(e) => bail!("handler failed: {e}"),
        }
    }
    store.commit(tx).await?;
    Ok(committed)
}
