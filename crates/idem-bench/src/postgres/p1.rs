//! P1: one message per transaction — bare, hand-written claim, idem, naive, the same bare
//! handler and idem on tokio-postgres (`idem-postgres`), and the experimental variants that
//! take the per-message cost apart.

use std::sync::Arc;

use anyhow::{Context, bail};
use idem_core::store::ClaimRequest;
use idem_core::{ConsumerName, Identified, Processor, Stamp};
use idem_sql::PostgresStore;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::{Connection, Postgres};

use super::{Bench, CLAIMS, Ctx, charge, expect_processed, now_micros};
use crate::measure::Op;
use crate::workload::{CONSUMER, Delivery, Ids};
use crate::{Group, Target, Variant, plural};

/// The claim as a user would write it by hand: the same statement `PostgresStore` runs.
const CLAIM: &str = "INSERT INTO idem_bench_claims (consumer, message_id, fingerprint, processed_at) \
     VALUES ($1, $2, $3, $4) ON CONFLICT (consumer, message_id) DO NOTHING";
const NAIVE_SEEN: &str =
    "SELECT EXISTS (SELECT 1 FROM idem_bench_claims WHERE consumer = $1 AND message_id = $2)";
const NAIVE_RECORD: &str = "INSERT INTO idem_bench_claims \
     (consumer, message_id, fingerprint, processed_at) VALUES ($1, $2, $3, $4)";
const NARROW_CLAIM: &str =
    "INSERT INTO idem_bench_narrow_claims (message_id) VALUES ($1) ON CONFLICT DO NOTHING";

impl Bench {
    /// P1: one message per transaction.
    pub(crate) async fn p1(&self, worker_counts: &[usize]) -> anyhow::Result<Vec<Group>> {
        let mut variants = vec![
            P1::Bare,
            P1::Hand,
            P1::Idem,
            P1::Naive,
            P1::BareHeld,
            P1::IdemHeld,
            P1::BareTokioPg,
            P1::IdemTokioPg,
            P1::IdemHeldPart,
            P1::IdemTokioPgPart,
        ];
        if self.settings.experimental {
            variants.extend([
                P1::ClaimOnHeld,
                P1::BareLean,
                P1::IdemLean,
                P1::Pipelined,
                P1::PipelinedHeld,
                P1::Narrow,
            ]);
        }
        let mut groups = Vec::new();
        for &workers in worker_counts {
            let title = format!("P1 per message, PostgreSQL, {}", plural(workers, "worker"));
            let group = Group::measure(title, &variants, &self.settings, async |v: P1| {
                let ctx = self
                    .context_with(
                        workers,
                        matches!(v, P1::BareLean | P1::IdemLean),
                        matches!(v, P1::BareTokioPg | P1::IdemTokioPg | P1::IdemTokioPgPart),
                    )
                    .await?;
                let op = P1Op {
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
                Target::at_least("idem", "bare", 0.90),
                Target::at_least("idem", "hand", 0.95),
                Target::at_least("idem-held", "bare", 1.0),
                Target::at_least("idem-held", "bare-held", 0.9),
                Target::Ratio {
                    of: "idem",
                    to: "naive",
                    at_least: 1.0,
                    strict: true,
                },
                Target::at_least("idem-tp", "bare-tp", 0.95),
                Target::compare("idem-tp", "idem"),
                Target::compare("idem-tp", "idem-held"),
                Target::at_least("idem-held-part", "idem-held", 0.95),
                Target::at_least("idem-tp-part", "idem-tp", 0.95),
            ]);
            let group = if self.settings.experimental {
                group
                    .targets([
                        Target::compare("claim_on-held", "bare-held"),
                        Target::compare("idem-lean", "bare-lean"),
                        Target::compare("pipelined", "idem"),
                        Target::compare("pipelined", "bare"),
                        Target::compare("pipelined-held", "bare-held"),
                        Target::compare("narrow", "hand"),
                    ])
                    .note(
                        "exp variants are prototypes for the store, not idem's API: \
                         `held` = the worker keeps one connection (no pool pings); `lean` = \
                         pool with test_before_acquire(false); `one flight` = BEGIN and the \
                         claim sent as one simple-protocol query (literal values), so the claim \
                         costs no round trip of its own",
                    )
            } else {
                group
            };
            groups.push(
                group
                    .note(
                        "each message: charge row + balance UPDATE on one of 1,000 accounts; \
                         sqlx's pool pings a connection when acquired and when returned",
                    )
                    .note(
                        "`tp` rows: tokio-postgres on a deadpool-postgres pool of one \
                         connection per worker (RecyclingMethod::Fast: no ping), statements \
                         prepared once per connection; idem-postgres sends BEGIN and the \
                         claim in one flight",
                    )
                    .note(
                        "`-part` rows: the same store on a claims table partitioned by the \
                         ID's time (every claim in today's partition, as a live stream's)",
                    ),
            );
        }
        Ok(groups)
    }
}

#[derive(Debug, Clone, Copy)]
enum P1 {
    Bare,
    Hand,
    Idem,
    Naive,
    BareHeld,
    IdemHeld,
    ClaimOnHeld,
    BareLean,
    IdemLean,
    Pipelined,
    PipelinedHeld,
    Narrow,
    BareTokioPg,
    IdemTokioPg,
    IdemHeldPart,
    IdemTokioPgPart,
}

impl Variant for P1 {
    fn key(self) -> &'static str {
        match self {
            P1::Bare => "bare",
            P1::Hand => "hand",
            P1::Idem => "idem",
            P1::Naive => "naive",
            P1::BareHeld => "bare-held",
            P1::IdemHeld => "idem-held",
            P1::ClaimOnHeld => "claim_on-held",
            P1::BareLean => "bare-lean",
            P1::IdemLean => "idem-lean",
            P1::Pipelined => "pipelined",
            P1::PipelinedHeld => "pipelined-held",
            P1::Narrow => "narrow",
            P1::BareTokioPg => "bare-tp",
            P1::IdemTokioPg => "idem-tp",
            P1::IdemHeldPart => "idem-held-part",
            P1::IdemTokioPgPart => "idem-tp-part",
        }
    }

    fn label(self) -> &'static str {
        match self {
            P1::Bare => "bare (no claim)",
            P1::Hand => "hand-written claim",
            P1::Idem => "idem `Processor::process`",
            P1::Naive => "naive check-then-act (3 transactions)",
            P1::BareHeld => "bare, connection held by the worker",
            P1::IdemHeld => "idem `process`, store with `hold_connections`",
            P1::ClaimOnHeld => "exp: idem `claim_on`, held connection",
            P1::BareLean => "exp: bare, lean pool",
            P1::IdemLean => "exp: idem `process`, lean pool",
            P1::Pipelined => "exp: BEGIN + claim in one flight",
            P1::PipelinedHeld => "exp: BEGIN + claim in one flight, held",
            P1::Narrow => "exp: hand-written claim, id-only row",
            P1::BareTokioPg => "bare, tokio-postgres + deadpool",
            P1::IdemTokioPg => "idem-postgres `process`, deadpool",
            P1::IdemHeldPart => "idem-held, partitioned claims table",
            P1::IdemTokioPgPart => "idem-tp, partitioned claims table",
        }
    }

    fn round_trips(self) -> &'static str {
        match self {
            P1::Bare => "6 = 4 + 2 pings",
            P1::Hand | P1::Idem | P1::Narrow => "7 = 5 + 2 pings",
            P1::Naive => "12 = 6 + 6 pings, 2 commits",
            P1::BareHeld | P1::PipelinedHeld | P1::BareTokioPg => "4",
            P1::IdemTokioPg | P1::IdemTokioPgPart => "4 (BEGIN + claim in one)",
            P1::ClaimOnHeld | P1::IdemHeld | P1::IdemHeldPart => "5",
            P1::BareLean => "5 = 4 + 1 ping",
            P1::IdemLean => "6 = 5 + 1 ping",
            P1::Pipelined => "6 = 4 + 2 pings",
        }
    }
}

impl P1 {
    fn holds_connection(self) -> bool {
        matches!(self, P1::BareHeld | P1::ClaimOnHeld | P1::PipelinedHeld)
    }
}

#[derive(Debug)]
struct P1Op {
    ctx: Arc<Ctx>,
    variant: P1,
    ids: Ids,
}

impl Op for P1Op {
    type State = Option<PoolConnection<Postgres>>;

    async fn open(&self, _worker: usize) -> anyhow::Result<Self::State> {
        if self.variant.holds_connection() {
            Ok(Some(self.ctx.pool.acquire().await?))
        } else {
            Ok(None)
        }
    }

    async fn run(&self, held: &mut Self::State, worker: usize, seq: u64) -> anyhow::Result<u64> {
        let d = self.ids.delivery(worker, seq)?;
        let ctx = &*self.ctx;
        match self.variant {
            P1::Bare => bare(&ctx.pool, &d).await?,
            P1::Hand => hand_claim(&ctx.pool, &d, false).await?,
            P1::Narrow => hand_claim(&ctx.pool, &d, true).await?,
            P1::Idem => idem(&ctx.processor, &d).await?,
            P1::IdemHeld => idem(&ctx.held, &d).await?,
            P1::Naive => naive(&ctx.pool, &d).await?,
            P1::BareLean => bare(&ctx.lean()?.0, &d).await?,
            P1::IdemLean => idem(&ctx.lean()?.1, &d).await?,
            P1::BareHeld | P1::ClaimOnHeld => {
                let conn = held.as_mut().context("held connection missing")?;
                held_conn(ctx, conn, &d, matches!(self.variant, P1::ClaimOnHeld)).await?;
            }
            P1::Pipelined => {
                let mut conn = ctx.pool.acquire().await?;
                pipelined(&mut conn, &ctx.consumer, &d).await?;
            }
            P1::PipelinedHeld => {
                let conn = held.as_mut().context("held connection missing")?;
                pipelined(conn, &ctx.consumer, &d).await?;
            }
            P1::BareTokioPg => ctx.tokio_pg()?.bare(&d).await?,
            P1::IdemTokioPg => ctx.tokio_pg()?.idem(&d, false).await?,
            P1::IdemHeldPart => idem(&ctx.held_part, &d).await?,
            P1::IdemTokioPgPart => ctx.tokio_pg()?.idem(&d, true).await?,
        }
        Ok(1)
    }
}

/// Experimental: the same transaction on a connection the worker keeps, so no pool pings.
async fn held_conn(
    ctx: &Ctx,
    conn: &mut PgConnection,
    d: &Delivery,
    claim: bool,
) -> anyhow::Result<()> {
    let mut tx = conn.begin().await?;
    if claim {
        let fp = d.fingerprint();
        let stored = ctx
            .processor
            .store()
            .claim_on(
                &mut tx,
                ClaimRequest {
                    consumer: &ctx.consumer,
                    id: &d.id,
                    fingerprint: &fp,
                    at: Stamp::StoreClock,
                },
            )
            .await?;
        if stored.is_some() {
            bail!("fresh message {:?} was already claimed", d.id);
        }
    }
    charge(&mut tx, d).await?;
    tx.commit().await?;
    Ok(())
}

async fn bare(pool: &PgPool, d: &Delivery) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    charge(&mut tx, d).await?;
    tx.commit().await?;
    Ok(())
}

async fn hand_claim(pool: &PgPool, d: &Delivery, narrow: bool) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    let q = if narrow {
        sqlx::query(NARROW_CLAIM).bind(d.id.as_bytes())
    } else {
        sqlx::query(CLAIM)
            .bind(CONSUMER)
            .bind(d.id.as_bytes())
            .bind(d.fingerprint().as_bytes().to_vec())
            .bind(now_micros())
    };
    if q.execute(&mut *tx).await?.rows_affected() != 1 {
        bail!("fresh message {:?} was already claimed", d.id);
    }
    charge(&mut tx, d).await?;
    tx.commit().await?;
    Ok(())
}

async fn idem(processor: &Processor<PostgresStore>, d: &Delivery) -> anyhow::Result<()> {
    let outcome = processor.process(d, async |tx| charge(tx, d).await).await?;
    expect_processed(d, outcome)
}

/// The classic mistake: check, act, record, in three transactions. Two deliveries of one
/// message can both pass the check; a crash between act and record reprocesses it.
async fn naive(pool: &PgPool, d: &Delivery) -> anyhow::Result<()> {
    let seen: bool = sqlx::query_scalar(NAIVE_SEEN)
        .bind(CONSUMER)
        .bind(d.id.as_bytes())
        .fetch_one(pool)
        .await?;
    if seen {
        bail!("fresh message {:?} was already recorded", d.id);
    }
    bare(pool, d).await?;
    sqlx::query(NAIVE_RECORD)
        .bind(CONSUMER)
        .bind(d.id.as_bytes())
        .bind(d.fingerprint().as_bytes().to_vec())
        .bind(now_micros())
        .execute(pool)
        .await?;
    Ok(())
}

/// Experimental: BEGIN and the claim in one simple-protocol query, so the claim rides on the
/// BEGIN's round trip. The simple protocol takes no bind parameters, so values go in as hex
/// (`decode(…, 'hex')` reads the same whatever `standard_conforming_strings` says), and the
/// statement is planned on every call. The claim is a plain INSERT: a duplicate surfaces as a
/// unique violation, since a simple query's row count is not visible through `begin_with`.
async fn pipelined(
    conn: &mut PgConnection,
    consumer: &ConsumerName,
    d: &Delivery,
) -> anyhow::Result<()> {
    let sql = format!(
        "BEGIN; INSERT INTO {CLAIMS} (consumer, message_id, fingerprint, processed_at) \
         VALUES (convert_from(decode('{}', 'hex'), 'UTF8'), decode('{}', 'hex'), \
         decode('{}', 'hex'), {})",
        idem_core::hex::encode(consumer.as_str().as_bytes()),
        idem_core::hex::encode(d.id.as_bytes()),
        idem_core::hex::encode(d.fingerprint().as_bytes()),
        now_micros()
    );
    let failed = match conn.begin_with(sql).await {
        Ok(mut tx) => {
            charge(&mut tx, d).await?;
            tx.commit().await?;
            return Ok(());
        }
        Err(e) => e,
    };
    // sqlx does not roll back a failed custom BEGIN: leave no aborted transaction on a
    // connection that goes back to the pool.
    let _ = sqlx::query("ROLLBACK").execute(conn).await;
    Err(failed.into())
}
