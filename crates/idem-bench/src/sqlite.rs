//! P3: the embedded store, SQLite in WAL mode with `synchronous = FULL` (the store's default).
//!
//! Bare and idem share the store's own pool and both begin with `BEGIN IMMEDIATE`, as the
//! store does: SQLite has one writer, so the bare variant must take the write lock up front
//! too, or it would be measuring a different (and, under concurrency, failing) locking scheme.
//! Tables are emptied and the WAL checkpointed before every measurement, for the same reason
//! as on PostgreSQL: equal starting conditions for every variant.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use anyhow::{Context, bail};
use idem_core::{Identified as _, Migrate as _, Outcome, Processor, Timestamp};
use idem_sql::{SqliteOptions, SqliteStore, TableName};
use sqlx::sqlite::SqliteConnection;
use sqlx::{QueryBuilder, Sqlite};

use super::measure::{self, CpuProbe, Op, Sample};
use super::workload::{ACCOUNTS, CONSUMER, Delivery, Ids, account_name, per_account};
use super::{Group, Settings, Target, Variant, plural};

const CHARGE: &str = "INSERT INTO idem_bench_charges (account, amount) VALUES (?1, ?2)";
const CREDIT: &str = "UPDATE idem_bench_accounts SET balance = balance + ?2 WHERE id = ?1";

/// An open benchmark database.
#[derive(Debug)]
pub(crate) struct Bench {
    path: PathBuf,
    temporary: bool,
    store: SqliteStore,
    settings: Settings,
    describe: String,
}

impl Bench {
    /// Opens `path` (default: a new temporary file) with the store's default options and
    /// creates the bench's tables.
    pub(crate) async fn open(path: Option<PathBuf>, settings: &Settings) -> anyhow::Result<Self> {
        let temporary = path.is_none();
        let path = path.unwrap_or_else(|| {
            std::env::temp_dir().join(format!("idem-bench-{}.sqlite", std::process::id()))
        });
        let store = SqliteStore::open(&path, SqliteOptions::default())
            .await?
            .with_table(TableName::new("idem_bench_claims")?)?;
        let version: String = sqlx::query_scalar("SELECT sqlite_version()")
            .fetch_one(store.pool())
            .await?;
        let bench = Self {
            describe: format!(
                "{version}, WAL, synchronous=FULL, file {}{}",
                path.display(),
                if temporary { " (temporary)" } else { "" }
            ),
            path,
            temporary,
            store,
            settings: settings.clone(),
        };
        bench.create_tables().await?;
        Ok(bench)
    }

    /// The library and file, for the report header.
    pub(crate) fn describe(&self) -> &str {
        &self.describe
    }

    async fn create_tables(&self) -> anyhow::Result<()> {
        sqlx::raw_sql(
            "DROP TABLE IF EXISTS idem_bench_accounts;
             DROP TABLE IF EXISTS idem_bench_charges;
             DROP TABLE IF EXISTS idem_bench_claims;
             DROP TABLE IF EXISTS idem_bench_claims_wr;
             DROP TABLE IF EXISTS idem_bench_claims_lean;
             CREATE TABLE idem_bench_claims_wr (
                 consumer TEXT NOT NULL, message_id BLOB NOT NULL, fingerprint BLOB NOT NULL,
                 processed_at INTEGER NOT NULL, PRIMARY KEY (consumer, message_id)) WITHOUT ROWID;
             CREATE INDEX idem_bench_claims_wr_processed_at ON idem_bench_claims_wr (processed_at);
             CREATE TABLE idem_bench_claims_lean (
                 consumer TEXT NOT NULL, message_id BLOB NOT NULL, fingerprint BLOB NOT NULL,
                 processed_at INTEGER NOT NULL, PRIMARY KEY (consumer, message_id)) WITHOUT ROWID;
             CREATE TABLE idem_bench_accounts (id TEXT PRIMARY KEY, balance INTEGER NOT NULL);
             CREATE TABLE idem_bench_charges (
                 id INTEGER PRIMARY KEY,
                 account TEXT NOT NULL,
                 amount INTEGER NOT NULL);",
        )
        .execute(self.store.pool())
        .await
        .context("creating the SQLite benchmark tables")?;
        self.store.migrate().await?;
        Ok(())
    }

    /// Closes the pool; removes the database if it was a temporary file, else drops the
    /// bench's tables.
    pub(crate) async fn cleanup(&self) {
        if self.temporary {
            self.store.pool().close().await;
            for suffix in ["", "-wal", "-shm"] {
                let mut p = self.path.clone().into_os_string();
                p.push(suffix);
                let _ = std::fs::remove_file(p);
            }
        } else {
            let dropped = sqlx::raw_sql(
                "DROP TABLE IF EXISTS idem_bench_accounts;
                 DROP TABLE IF EXISTS idem_bench_charges;
                 DROP TABLE IF EXISTS idem_bench_claims;
                 DROP TABLE IF EXISTS idem_bench_claims_wr;
                 DROP TABLE IF EXISTS idem_bench_claims_lean;",
            )
            .execute(self.store.pool())
            .await;
            if let Err(e) = dropped {
                eprintln!("warning: dropping the SQLite benchmark tables: {e}");
            }
            self.store.pool().close().await;
        }
    }

    /// Empties the tables, reseeds the accounts and truncates the WAL.
    async fn reset(&self) -> anyhow::Result<()> {
        let mut tx = self.store.begin_tx().await?;
        sqlx::raw_sql(
            "DELETE FROM idem_bench_charges;
             DELETE FROM idem_bench_claims;
             DELETE FROM idem_bench_claims_wr;
             DELETE FROM idem_bench_claims_lean;
             DELETE FROM idem_bench_accounts;",
        )
        .execute(&mut *tx)
        .await?;
        let mut q = QueryBuilder::<Sqlite>::new("INSERT INTO idem_bench_accounts (id, balance) ");
        q.push_values(0..ACCOUNTS, |mut row, i| {
            row.push_bind(account_name(i)).push_bind(0i64);
        });
        q.build().execute(&mut *tx).await?;
        tx.commit().await?;
        sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
            .execute(self.store.pool())
            .await
            .context("checkpointing the WAL")?;
        Ok(())
    }

    /// SQLite runs inside this process (on sqlx's worker threads), so all its CPU time is
    /// the client's.
    async fn sample<O: Op>(&self, op: O, workers: usize) -> anyhow::Result<Sample> {
        self.reset().await?;
        measure::throughput(op, workers, self.settings.window, &CpuProbe::default()).await
    }

    /// P3: per message and batched, bare against idem.
    pub(crate) async fn p3(&self, worker_counts: &[usize]) -> anyhow::Result<Vec<Group>> {
        let ctx = Arc::new(Ctx {
            store: self.store.clone(),
            processor: Processor::builder(self.store.clone(), CONSUMER).build()?,
            batch: self.settings.batch,
        });
        let mut groups = Vec::new();
        for &workers in worker_counts {
            let exp = self.settings.experimental;
            for (title, mut variants, experiments) in [
                (
                    format!("P3 per message, SQLite, {}", plural(workers, "worker")),
                    vec![P3::Bare, P3::Idem],
                    [P3::Hand, P3::HandWithoutRowid, P3::HandLean],
                ),
                (
                    format!(
                        "P3 batched ({} messages per transaction), SQLite, {}",
                        self.settings.batch,
                        plural(workers, "worker")
                    ),
                    vec![P3::BareSet, P3::IdemSet],
                    [P3::HandSet, P3::HandSetCount, P3::HandSetLean],
                ),
            ] {
                if exp {
                    variants.extend(experiments);
                }
                let group = Group::measure(title, &variants, &self.settings, async |v| {
                    let op = P3Op {
                        ctx: Arc::clone(&ctx),
                        variant: v,
                        ids: self.settings.ids(),
                    };
                    self.sample(op, workers).await
                })
                .await?
                .targets([Target::Ratio {
                    of: variants[1].key(),
                    to: variants[0].key(),
                    at_least: 0.8,
                    strict: false,
                }]);
                let group = if exp {
                    let base = variants[0].key();
                    group
                        .targets(experiments.map(|e| Target::compare(e.key(), base)))
                        .targets([Target::compare(variants[1].key(), experiments[0].key())])
                        .note(
                            "exp variants write the claim by hand: `WITHOUT ROWID` stores the \
                             claims in their primary-key b-tree instead of a rowid table plus an \
                             index; `lean` also drops the processed_at index. Each b-tree a \
                             transaction touches is one more 4 KiB page in the WAL at commit",
                        )
                } else {
                    group
                };
                groups.push(group);
            }
        }
        Ok(groups)
    }
}

#[derive(Debug)]
struct Ctx {
    store: SqliteStore,
    processor: Processor<SqliteStore>,
    batch: usize,
}

async fn charge(conn: &mut SqliteConnection, d: &Delivery) -> Result<(), sqlx::Error> {
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

/// Two statements per batch: a multi-row INSERT and an UPDATE … FROM (VALUES …) of the sums.
async fn charge_set(conn: &mut SqliteConnection, ds: &[&Delivery]) -> Result<(), sqlx::Error> {
    let mut insert =
        QueryBuilder::<Sqlite>::new("INSERT INTO idem_bench_charges (account, amount) ");
    insert.push_values(ds, |mut row, d| {
        row.push_bind(d.account.as_str()).push_bind(d.amount);
    });
    insert.build().execute(&mut *conn).await?;
    let (accounts, sums) = per_account(ds);
    let mut update = QueryBuilder::<Sqlite>::new(
        "UPDATE idem_bench_accounts SET balance = balance + d.column2 FROM (",
    );
    update.push_values(accounts.into_iter().zip(sums), |mut row, (a, s)| {
        row.push_bind(a).push_bind(s);
    });
    update.push(") AS d WHERE idem_bench_accounts.id = d.column1");
    update.build().execute(&mut *conn).await?;
    Ok(())
}

fn claims_table(form: P3) -> &'static str {
    match form {
        P3::HandWithoutRowid => "idem_bench_claims_wr",
        P3::HandLean | P3::HandSetLean => "idem_bench_claims_lean",
        _ => "idem_bench_claims",
    }
}

fn now_micros() -> i64 {
    Timestamp::from(SystemTime::now()).as_micros()
}

/// Experimental: the batch claim by hand, as the store writes it (`RETURNING` the inserted IDs)
/// or reading only the row count, which says "all new" in the common case.
async fn claim_set(
    conn: &mut SqliteConnection,
    form: P3,
    ds: &[&Delivery],
) -> anyhow::Result<usize> {
    let fps: Vec<_> = ds.iter().map(|d| d.fingerprint()).collect();
    let at = now_micros();
    let mut q = QueryBuilder::<Sqlite>::new(format!(
        "INSERT INTO {} (consumer, message_id, fingerprint, processed_at) ",
        claims_table(form)
    ));
    q.push_values(ds.iter().zip(&fps), |mut row, (d, fp)| {
        row.push_bind(CONSUMER)
            .push_bind(d.id.as_bytes())
            .push_bind(&fp.as_bytes()[..])
            .push_bind(at);
    });
    q.push(" ON CONFLICT (consumer, message_id) DO NOTHING");
    if matches!(form, P3::HandSet) {
        q.push(" RETURNING message_id");
        let new: Vec<Vec<u8>> = q.build_query_scalar().fetch_all(&mut *conn).await?;
        return Ok(new.len());
    }
    let n = q.build().execute(&mut *conn).await?.rows_affected();
    Ok(usize::try_from(n)?)
}

#[derive(Debug, Clone, Copy)]
enum P3 {
    Bare,
    Idem,
    BareSet,
    IdemSet,
    Hand,
    HandWithoutRowid,
    HandLean,
    HandSet,
    HandSetCount,
    HandSetLean,
}

impl Variant for P3 {
    fn key(self) -> &'static str {
        match self {
            P3::Bare => "bare",
            P3::Idem => "idem",
            P3::BareSet => "bare-set",
            P3::IdemSet => "idem-set",
            P3::Hand => "hand",
            P3::HandWithoutRowid => "hand-without-rowid",
            P3::HandLean => "hand-lean",
            P3::HandSet => "hand-set",
            P3::HandSetCount => "hand-set-count",
            P3::HandSetLean => "hand-set-lean",
        }
    }

    fn label(self) -> &'static str {
        match self {
            P3::Bare => "bare (BEGIN IMMEDIATE, no claim)",
            P3::Idem => "idem `Processor::process`",
            P3::BareSet => "bare set-based batch (no claim)",
            P3::IdemSet => "idem `process_batch_set`",
            P3::Hand => "exp: hand-written claim (the store's table)",
            P3::HandWithoutRowid => "exp: hand-written claim, WITHOUT ROWID",
            P3::HandLean => "exp: hand-written claim, WITHOUT ROWID, lean",
            P3::HandSet => "exp: hand-written set claim (the store's SQL)",
            P3::HandSetCount => "exp: hand-written set claim, no RETURNING",
            P3::HandSetLean => "exp: no RETURNING, WITHOUT ROWID, lean",
        }
    }

    fn round_trips(self) -> &'static str {
        match self {
            P3::Bare => "4 statements",
            P3::Idem | P3::Hand | P3::HandWithoutRowid | P3::HandLean => "5 statements",
            P3::BareSet => "4 statements per batch",
            P3::IdemSet | P3::HandSet | P3::HandSetCount | P3::HandSetLean => {
                "5 statements per batch"
            }
        }
    }
}

#[derive(Debug)]
struct P3Op {
    ctx: Arc<Ctx>,
    variant: P3,
    ids: Ids,
}

impl Op for P3Op {
    type State = ();

    async fn open(&self, _worker: usize) -> anyhow::Result<()> {
        Ok(())
    }

    async fn run(&self, _: &mut (), worker: usize, seq: u64) -> anyhow::Result<u64> {
        let ctx = &*self.ctx;
        match self.variant {
            P3::Bare => {
                let d = self.ids.delivery(worker, seq)?;
                let mut tx = ctx.store.begin_tx().await?;
                charge(&mut tx, &d).await?;
                tx.commit().await?;
                Ok(1)
            }
            P3::Idem => {
                let d = self.ids.delivery(worker, seq)?;
                match ctx
                    .processor
                    .process(&d, async |tx| charge(tx, &d).await)
                    .await?
                {
                    Outcome::Processed(()) => Ok(1),
                    other => bail!("fresh message {:?} was not new: {other:?}", d.id),
                }
            }
            P3::Hand | P3::HandWithoutRowid | P3::HandLean => {
                let d = self.ids.delivery(worker, seq)?;
                let table = claims_table(self.variant);
                let sql = format!(
                    "INSERT INTO {table} (consumer, message_id, fingerprint, processed_at) \
                     VALUES (?1, ?2, ?3, ?4) ON CONFLICT (consumer, message_id) DO NOTHING"
                );
                let mut tx = ctx.store.begin_tx().await?;
                let n = sqlx::query(&sql)
                    .bind(CONSUMER)
                    .bind(d.id.as_bytes())
                    .bind(d.fingerprint().as_bytes().to_vec())
                    .bind(now_micros())
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if n != 1 {
                    bail!("fresh message {:?} was already claimed", d.id);
                }
                charge(&mut tx, &d).await?;
                tx.commit().await?;
                Ok(1)
            }
            P3::HandSet | P3::HandSetCount | P3::HandSetLean => {
                let batch = self.ids.batch(worker, seq, ctx.batch)?;
                let refs: Vec<&Delivery> = batch.iter().collect();
                let mut tx = ctx.store.begin_tx().await?;
                let n = claim_set(&mut tx, self.variant, &refs).await?;
                if n != refs.len() {
                    bail!("{n} of {} fresh claims were new", refs.len());
                }
                charge_set(&mut tx, &refs).await?;
                tx.commit().await?;
                Ok(batch.len() as u64)
            }
            P3::BareSet => {
                let batch = self.ids.batch(worker, seq, ctx.batch)?;
                let refs: Vec<&Delivery> = batch.iter().collect();
                let mut tx = ctx.store.begin_tx().await?;
                charge_set(&mut tx, &refs).await?;
                tx.commit().await?;
                Ok(batch.len() as u64)
            }
            P3::IdemSet => {
                let batch = self.ids.batch(worker, seq, ctx.batch)?;
                let out = ctx
                    .processor
                    .process_batch_set(&batch, async |tx, fresh: &[&Delivery]| {
                        charge_set(tx, fresh).await
                    })
                    .await?;
                for (d, outcome) in batch.iter().zip(out.outcomes) {
                    if !matches!(outcome?, Outcome::Processed(())) {
                        bail!("fresh message {:?} was not new", d.id);
                    }
                }
                Ok(batch.len() as u64)
            }
        }
    }
}
