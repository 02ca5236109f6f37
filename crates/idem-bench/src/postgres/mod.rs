//! P1 (one message per transaction, [`p1`]) and P2 (batches, [`p2`]) on PostgreSQL; this
//! module owns the tables, the pools and the handler under test. P1 also measures
//! `idem-postgres` on tokio-postgres ([`tokio_pg`]) beside the sqlx store. [`prune`] runs the
//! same handler as a consumer while a large claims table is pruned, in a schema of its own;
//! [`outbox`] measures the transactional outbox and its relay, in another.
//!
//! Every variant goes through `pool.begin()` on a pool of exactly `workers` connections, as
//! `PostgresStore` does, so the pool's own costs (sqlx pings a connection when it is acquired
//! and again when it is returned) weigh on every variant alike; the experimental variants take
//! those costs apart. Each measurement gets fresh connections (see [`Bench::context`]).
//!
//! Tables are truncated (and the accounts reseeded, then a CHECKPOINT taken) before every
//! measurement rather than given one table per variant: every variant then starts from the
//! same empty indexes, the same cached accounts and the same distance to the next checkpoint,
//! and a variant measured late in the run does not pay for a claims index the earlier ones grew.

mod outbox;
mod p1;
mod p2;
mod prune;
mod tokio_pg;

pub(crate) use outbox::{Options as OutboxOptions, Part as OutboxPart, SizeArgs as OutboxSizeArgs};
pub(crate) use prune::{Layout as PruneLayout, Options as PruneOptions};

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::{Context, bail};
use idem_core::{ConsumerName, Outcome, Processor, Timestamp};
use idem_sql::{PostgresStore, TableName};
use sqlx::Connection as _;
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions};

use super::Settings;
use super::measure::{self, CpuProbe, Op, Sample};
use super::workload::{ACCOUNTS, CONSUMER, Delivery, per_account};

const CLAIMS: &str = "idem_bench_claims";
/// The same claims, in a table partitioned by the ID's time (P1's `-part` rows).
const CLAIMS_PART: &str = "idem_bench_claims_part";

/// The partitioning of [`CLAIMS_PART`]: the bench's IDs carry no time, so every ID is read as
/// made at the start of today (UTC), as a live stream of UUIDv7 IDs lands in today's
/// partition; the default partition and the undated one stay empty.
fn bench_partitioning() -> Result<idem_sql::partition::Partitioning, idem_core::Error> {
    use idem_sql::partition::{Day, Partitioning};
    let today = Day::of(idem_core::Timestamp::from(std::time::SystemTime::now()));
    let at = idem_core::Timestamp::from_micros(today.start() + 1);
    // A fixed name: the extractor is the same function on every run (the day it returns is
    // not part of what it is).
    Partitioning::by("idem-bench-today", move |_: &idem_core::MessageId| Some(at))
}

const CHARGE: &str = "INSERT INTO idem_bench_charges (account, amount) VALUES ($1, $2)";
const CREDIT: &str = "UPDATE idem_bench_accounts SET balance = balance + $2 WHERE id = $1";
const CHARGE_SET: &str = "INSERT INTO idem_bench_charges (account, amount) \
     SELECT * FROM unnest($1::text[], $2::bigint[])";
/// The balances of a batch in one statement. The plain `UPDATE … FROM unnest(…)` deadlocks
/// under concurrent batches: PostgreSQL plans it as a hash join over a sequential scan, which
/// locks rows in physical order, and updated rows move. The InitPlan first locks the batch's
/// accounts in key order (`ORDER BY … FOR UPDATE`), so concurrent batches queue instead.
const CREDIT_SET: &str = "UPDATE idem_bench_accounts a SET balance = a.balance + d.s \
     FROM (SELECT unnest($1::text[]) AS acc, unnest($2::bigint[]) AS s) d \
     WHERE a.id = d.acc AND (SELECT count(*) FROM (SELECT FROM idem_bench_accounts \
     WHERE id = ANY($1) ORDER BY id FOR UPDATE) l) >= 0";

/// A connected benchmark database with the bench's tables created.
pub(crate) struct Bench {
    url: String,
    admin: PgPool,
    settings: Settings,
    describe: String,
}

/// The URL may hold a password: shown through [`idem_redact::redact_url`].
impl std::fmt::Debug for Bench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bench")
            .field("url", &idem_redact::redact_url(&self.url))
            .field("admin", &self.admin)
            .field("settings", &self.settings)
            .field("describe", &self.describe)
            .finish()
    }
}

impl Bench {
    /// Connects; P1 and P2 then need [`Self::create_tables`].
    pub(crate) async fn connect(url: &str, settings: &Settings) -> anyhow::Result<Self> {
        // One plain connection first: a pool reports a refused connection only as "timed out".
        let probe = tokio::time::timeout(Duration::from_secs(5), PgConnection::connect(url))
            .await
            .context("no answer within 5 s")??;
        let _ = probe.close().await;
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(5))
            .connect(url)
            .await?;
        let version: String = sqlx::query_scalar("SHOW server_version")
            .fetch_one(&admin)
            .await?;
        let mut settings_text = Vec::new();
        for name in [
            "fsync",
            "synchronous_commit",
            "shared_buffers",
            "max_wal_size",
            "autovacuum",
        ] {
            let value: String = sqlx::query_scalar(&format!("SHOW {name}"))
                .fetch_one(&admin)
                .await?;
            settings_text.push(format!("{name}={value}"));
        }
        let bench = Self {
            url: url.to_string(),
            admin,
            settings: settings.clone(),
            describe: format!(
                "{} ({}), over TCP",
                version.split_whitespace().next().unwrap_or("?"),
                settings_text.join(", ")
            ),
        };
        Ok(bench)
    }

    /// The server, for the report header.
    pub(crate) fn describe(&self) -> &str {
        &self.describe
    }

    /// (Re)creates P1's and P2's idem_bench_* tables; [`Self::cleanup`] drops them.
    pub(crate) async fn create_tables(&self) -> anyhow::Result<()> {
        self.drop_tables().await?;
        sqlx::raw_sql(
            "CREATE TABLE idem_bench_accounts (id text PRIMARY KEY, balance bigint NOT NULL);
             CREATE TABLE idem_bench_charges (
                 id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                 account text NOT NULL,
                 amount bigint NOT NULL);
             CREATE TABLE idem_bench_narrow_claims (message_id bytea PRIMARY KEY);",
        )
        .execute(&self.admin)
        .await
        .context("creating the benchmark tables")?;
        use idem_core::Migrate as _;
        PostgresStore::from_pool(self.admin.clone())
            .with_table(TableName::new(CLAIMS)?)?
            .migrate()
            .await?;
        PostgresStore::from_pool(self.admin.clone())
            .with_table(TableName::new(CLAIMS_PART)?)?
            .partitioned(bench_partitioning()?)?
            .migrate()
            .await?;
        Ok(())
    }

    async fn drop_tables(&self) -> anyhow::Result<()> {
        sqlx::raw_sql(
            "DROP TABLE IF EXISTS idem_bench_accounts, idem_bench_charges, \
             idem_bench_claims, idem_bench_claims_part, idem_bench_narrow_claims",
        )
        .execute(&self.admin)
        .await
        .context("dropping the benchmark tables")?;
        Ok(())
    }

    /// Drops the bench's tables; a failure here only leaves tables behind.
    pub(crate) async fn cleanup(&self) {
        if let Err(e) = self.drop_tables().await {
            eprintln!("warning: {e:#}");
        }
    }

    /// Empties every table and reseeds the accounts, then checkpoints so that every
    /// measurement starts equally far from the next checkpoint's burst of writes.
    async fn reset(&self) -> anyhow::Result<()> {
        sqlx::raw_sql(&format!(
            "TRUNCATE idem_bench_charges, idem_bench_claims, idem_bench_claims_part, \
                 idem_bench_narrow_claims, idem_bench_accounts RESTART IDENTITY;
             INSERT INTO idem_bench_accounts (id, balance)
                 SELECT 'acc-' || lpad(i::text, 4, '0'), 0 FROM generate_series(0, {}) AS i;
             ANALYZE idem_bench_accounts;",
            ACCOUNTS - 1
        ))
        .execute(&self.admin)
        .await
        .context("resetting the benchmark tables")?;
        // Needs superuser or pg_checkpoint; without it the rounds' interleaving still spreads
        // checkpoints over all variants.
        let _ = sqlx::query("CHECKPOINT").execute(&self.admin).await;
        Ok(())
    }

    /// A pool of exactly `workers` connections, all opened before timing starts, and the
    /// process IDs of their backends when the server runs on this machine.
    async fn pool(
        &self,
        workers: usize,
        ping_on_acquire: bool,
    ) -> anyhow::Result<(PgPool, Vec<u32>)> {
        let n = u32::try_from(workers).context("too many workers")?;
        let pool = PgPoolOptions::new()
            .max_connections(n)
            .min_connections(n)
            .test_before_acquire(ping_on_acquire)
            .acquire_timeout(Duration::from_secs(30))
            .connect(&self.url)
            .await?;
        let mut open = Vec::with_capacity(workers);
        let mut pids = Vec::with_capacity(workers);
        for _ in 0..workers {
            let mut conn = pool.acquire().await?;
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut *conn)
                .await?;
            pids.extend(u32::try_from(pid).ok());
            open.push(conn);
        }
        drop(open);
        if !pids.iter().all(|&pid| CpuProbe::is_local_postgres(pid)) {
            pids.clear();
        }
        Ok((pool, pids))
    }

    /// Fresh pools for one measurement. New connections every time, because a backend's
    /// statement and plan caches carry state from one measurement to the next: after the
    /// first TRUNCATE the plan cache re-plans, and on this workload its later generic plans
    /// ran the set-based batch at half the speed of the first, fresh measurement. Fresh
    /// backends give every measurement the same start.
    async fn context(&self, workers: usize, lean: bool) -> anyhow::Result<Arc<Ctx>> {
        self.context_with(workers, lean, false).await
    }

    /// [`Self::context`], and with `tokio_pg` a deadpool-postgres pool of `workers`
    /// connections for the tokio-postgres variants.
    async fn context_with(
        &self,
        workers: usize,
        lean: bool,
        tokio_pg: bool,
    ) -> anyhow::Result<Arc<Ctx>> {
        let (pool, mut pids) = self.pool(workers, true).await?;
        let tokio_pg = if tokio_pg {
            let (tp, tp_pids) = tokio_pg::TokioPg::open(&self.url, workers).await?;
            pids.extend(tp_pids);
            Some(tp)
        } else {
            None
        };
        let processor = processor_on(&pool)?;
        let held = Processor::builder(
            processor
                .store()
                .clone()
                .hold_connections(u32::try_from(workers)?),
            CONSUMER,
        )
        .build()?;
        let held_part = Processor::builder(
            PostgresStore::from_pool(pool.clone())
                .with_table(TableName::new(CLAIMS_PART)?)?
                .partitioned(bench_partitioning()?)?
                .hold_connections(u32::try_from(workers)?),
            CONSUMER,
        )
        .build()?;
        let lean = if lean {
            let (pool, lean_pids) = self.pool(workers, false).await?;
            pids.extend(lean_pids);
            let processor = processor_on(&pool)?;
            Some((pool, processor))
        } else {
            None
        };
        Ok(Arc::new(Ctx {
            pool,
            processor,
            held,
            held_part,
            lean,
            tokio_pg,
            cpu: CpuProbe::new(pids),
            consumer: ConsumerName::new(CONSUMER)?,
            batch: self.settings.batch,
        }))
    }

    async fn sample<O: Op>(&self, op: O, workers: usize, cpu: &CpuProbe) -> anyhow::Result<Sample> {
        self.reset().await?;
        measure::throughput(op, workers, self.settings.window, cpu).await
    }
}

fn processor_on(pool: &PgPool) -> anyhow::Result<Processor<PostgresStore>> {
    let store = PostgresStore::from_pool(pool.clone()).with_table(TableName::new(CLAIMS)?)?;
    Ok(Processor::builder(store, CONSUMER).build()?)
}

/// What the variants of one table share.
#[derive(Debug)]
struct Ctx {
    pool: PgPool,
    processor: Processor<PostgresStore>,
    /// The same store with `hold_connections(workers)`: transactions without pool pings.
    /// Its connections open on first use, so the CPU column does not see their backends.
    held: Processor<PostgresStore>,
    /// `held` on the partitioned claims table.
    held_part: Processor<PostgresStore>,
    /// Experimental: the same, on a pool that does not ping on acquire.
    lean: Option<(PgPool, Processor<PostgresStore>)>,
    /// The tokio-postgres variants' pool and idem-postgres processor.
    tokio_pg: Option<tokio_pg::TokioPg>,
    /// Every pool's backends (idle ones add nothing).
    cpu: CpuProbe,
    consumer: ConsumerName,
    batch: usize,
}

impl Ctx {
    async fn close(&self) {
        self.pool.close().await;
        if let Some((pool, _)) = &self.lean {
            pool.close().await;
        }
        if let Some(tp) = &self.tokio_pg {
            tp.close();
        }
    }

    fn tokio_pg(&self) -> anyhow::Result<&tokio_pg::TokioPg> {
        self.tokio_pg
            .as_ref()
            .context("the tokio-postgres pool exists only for its variants")
    }

    fn lean(&self) -> anyhow::Result<&(PgPool, Processor<PostgresStore>)> {
        self.lean
            .as_ref()
            .context("the lean pool exists only for the lean variants")
    }
}

fn now_micros() -> i64 {
    Timestamp::from(SystemTime::now()).as_micros()
}

/// The handler under test, per message.
async fn charge(conn: &mut PgConnection, d: &Delivery) -> Result<(), sqlx::Error> {
    sqlx::query(CHARGE)
        .bind(&d.account)
        .bind(d.amount)
        .execute(&mut *conn)
        .await?;
    sqlx::query(CREDIT)
        .bind(&d.account)
        .bind(d.amount)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// The handler under test, set-based: two statements per batch whatever its size.
async fn charge_set(conn: &mut PgConnection, ds: &[&Delivery]) -> Result<(), sqlx::Error> {
    let accounts: Vec<&str> = ds.iter().map(|d| d.account.as_str()).collect();
    let amounts: Vec<i64> = ds.iter().map(|d| d.amount).collect();
    sqlx::query(CHARGE_SET)
        .bind(&accounts)
        .bind(&amounts)
        .execute(&mut *conn)
        .await?;
    let (accounts, sums) = per_account(ds);
    sqlx::query(CREDIT_SET)
        .bind(&accounts)
        .bind(&sums)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

fn expect_processed<T: std::fmt::Debug>(d: &Delivery, outcome: Outcome<T>) -> anyhow::Result<()> {
    match outcome {
        Outcome::Processed(_) => Ok(()),
        other => bail!("fresh message {:?} was not new: {other:?}", d.id),
    }
}
