//! Claims partitioned by the time inside the message ID (opt-in with
//! [`PgStore::partitioned`]): running the maintenance `idem_dialect::postgres::maintenance`
//! plans and writes — create day partitions ahead, drop them past the table's retention — on
//! tokio-postgres. Why deduplication survives it is [`crate::partition`]'s module docs; why it
//! is safe beside running consumers, `maintenance`'s. `idem-sql`'s `PostgresStore` executes the
//! same text under the same locks, so either store maintains a table the other claims in
//! (`tests/postgres/interop.rs` runs each store's maintenance under the other's claims).

use std::sync::Arc;

use idem_core::{ConsumerName, Error, ErrorKind, Stamp, TableName, Timestamp};
use idem_dialect::postgres::maintenance::{self, Plan, Relation, Step};
use idem_dialect::postgres::partition::{
    Day, PartitionInfo, PartitionReport, Partitioning, check_table_name,
};
use idem_dialect::postgres::{READ_CLOCK, claim_statements, sqlstate};
use tokio_postgres::SimpleQueryMessage;

use crate::errors::{commit_error, store_error};
use crate::store::PgStore;
use crate::tx::PgTx;

/// A table's kind and comment, as [`maintenance::SHAPE`] reads it.
type Shape = Option<(String, Option<String>)>;

fn shape_ref(shape: &Shape) -> Option<(&str, Option<&str>)> {
    shape.as_ref().map(|(k, c)| (k.as_str(), c.as_deref()))
}

impl PgStore {
    /// Partitions the claims table by the time inside each message ID (`p` reads it: UUIDv7,
    /// ULID, your own), one partition per UTC day, so that retention drops whole partitions
    /// instead of deleting rows. `migrate` creates the table partitioned; an existing plain
    /// table is refused, not converted. The table's retention (`p`'s, not a consumer's)
    /// decides when a day is dropped; IDs without a readable time, or outside the days
    /// created, are kept in a default partition pruned row by row (see [`crate::partition`]).
    /// The same schema as `idem_sql::PostgresStore::partitioned`: the two stores share a
    /// partitioned table as they share a plain one.
    pub fn partitioned(mut self, p: Partitioning) -> Result<Self, Error> {
        check_table_name(self.table().table())?;
        self.sql = Arc::new(claim_statements(self.table(), true));
        self.partitioning = Some(p);
        Ok(self)
    }

    /// The partitioning, if the table is partitioned.
    pub fn partitioning(&self) -> Option<&Partitioning> {
        self.partitioning.as_ref()
    }

    /// Creates today's partition and those `ahead` of it, then takes out the days wholly past
    /// the table's retention (a claim in them younger than the retention first moves to the
    /// default partition). Idempotent; replicas running it at once — on this store or on
    /// `idem-sql`'s — take turns. Runs with every prune of a partitioned store, so a
    /// consumer's pruning loop keeps the table in shape.
    ///
    /// On a table in the bounded layout (every table `migrate` creates) nothing it does makes
    /// a claim wait: days are attached and detached concurrently
    /// (`idem_dialect::postgres::maintenance::round`), and a round cut short is finished by the
    /// next. On a table made before (with PostgreSQL's DEFAULT partition) each day is created
    /// and dropped under a short exclusive lock, as before, until
    /// [`bound_partitions`](Self::bound_partitions) converts it.
    pub async fn maintain_partitions(&self) -> Result<PartitionReport, Error> {
        let p = self.require_partitioning()?;
        // Checks the table's record against the store's extractor, whatever its layout.
        let existing = self.day_partitions(p).await?;
        if let Some(report) = self.bounded_round(p, None, true).await? {
            return Ok(report);
        }
        let now = self.server_now().await?;
        // One catalog read decides both: it runs with every prune batch, and opening a locked
        // transaction per day ahead only to find it exists would cost three each time.
        // `create_day` still checks again under the lock.
        let Plan {
            create,
            drop,
            cutoff,
            ..
        } = maintenance::plan(&existing, now, p);
        let mut report = self.create_legacy(create).await?;
        for day in drop {
            let (rows, moved) = self.drop_day(day, cutoff).await?;
            report.dropped.push((day, rows));
            report.moved += moved;
        }
        Ok(report)
    }

    /// Creates the partitions of `days` that do not exist yet, moving their claims out of the
    /// default partition: for backfills, and what
    /// [`maintain_partitions`](Self::maintain_partitions) does for the days ahead. In the
    /// bounded layout a day below the default partition's bound is carved out of it with every
    /// day up to the bound (it holds one range).
    pub async fn create_partitions(
        &self,
        days: impl IntoIterator<Item = Day>,
    ) -> Result<PartitionReport, Error> {
        let p = self.require_partitioning()?;
        let days: Vec<Day> = days.into_iter().collect();
        if let Some(report) = self.bounded_round(p, Some(&days), false).await? {
            return Ok(report);
        }
        self.create_legacy(days).await
    }

    /// Converts a claims table made before the bounded layout (its `<table>_default` is
    /// PostgreSQL's DEFAULT partition, under which every dropped day locks the claims out) to
    /// the bounded layout, in one transaction
    /// (`idem_dialect::postgres::maintenance::bound_legacy`): it holds ACCESS EXCLUSIVE on the
    /// table while it moves the default partition's claims of days ahead of the first day
    /// partition (a producer's clock that was ahead; usually none) into partitions of their
    /// own. `Ok(false)` when the table is bounded already. Run it once, where a short pause of
    /// the consumers is acceptable; `migrate` does not.
    pub async fn bound_partitions(&self) -> Result<bool, Error> {
        self.require_partitioning()?;
        let t = self.table();
        let err = |e| store_error("converting to the bounded layout", e);
        let rels = {
            let lease = self.lease().await?;
            relations(lease.client(), t).await?
        };
        if !maintenance::is_legacy(t, &rels) {
            return Ok(false);
        }
        let Some(upper) = maintenance::first_day_start(t, &rels) else {
            return Err(Error::new(
                ErrorKind::Misconfigured,
                format!(
                    "the claims table {t} has no day partition to bound its default partition \
                     below: run maintain_partitions first"
                ),
            ));
        };
        let tx = self.maintenance_tx().await?;
        let days = tx
            .simple_query(&maintenance::legacy_days_above(t, upper))
            .await
            .map_err(err)?;
        let days: Vec<Day> = days
            .iter()
            .filter_map(|m| match m {
                SimpleQueryMessage::Row(r) => r.get(0).and_then(|d| d.parse().ok()),
                _ => None,
            })
            .map(Day::from_number)
            .collect();
        tx.batch_execute(&maintenance::bound_legacy(t, &days, upper))
            .await
            .map_err(err)?;
        tx.commit().await.map_err(commit_error)?;
        Ok(true)
    }

    /// A legacy table's days created one by one ([`create_day`](Self::create_day)).
    async fn create_legacy(&self, days: Vec<Day>) -> Result<PartitionReport, Error> {
        let mut report = PartitionReport::default();
        for day in days {
            if let Some(moved) = self.create_day(day).await? {
                report.created.push(day);
                report.moved += moved;
            }
        }
        Ok(report)
    }

    /// One bounded round (`maintenance::round`) on a connection of its own, holding the
    /// maintenance lock for the session: `None` when the table is in the legacy layout.
    /// `want`: the days to create (`None`: today and those ahead).
    async fn bounded_round(
        &self,
        p: &Partitioning,
        want: Option<&[Day]>,
        drop_due: bool,
    ) -> Result<Option<PartitionReport>, Error> {
        let t = self.table();
        let lease = self.lease().await?;
        let result = run_round(lease.client(), t, p, want, drop_due).await;
        // The session's lock and timeout must not go back to the pool with the connection:
        // one that cannot shed them is closed (the server then releases the lock).
        if lease
            .client()
            .batch_execute(&maintenance::session_end(t))
            .await
            .is_err()
        {
            lease.discard();
        }
        result
    }

    /// The claims table's partitions, with the planner's row estimates and their sizes; none
    /// for a plain table. Reads the catalog, so it works on a store not configured
    /// `partitioned` too.
    pub async fn partitions(&self) -> Result<Vec<PartitionInfo>, Error> {
        let t = self.table();
        let err = |e| store_error("listing partitions", e);
        let lease = self.lease().await?;
        let list = lease.prepare(maintenance::LIST).await.map_err(err)?;
        let rows = lease
            .client()
            .query(&list, &[&t.to_string()])
            .await
            .map_err(err)?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let name: String = r.try_get(0).map_err(err)?;
            let kind = match maintenance::kind_of(t, &name) {
                Some(k) => k,
                None => continue, // someone else's table attached to ours: not ours to show
            };
            let estimate = u64::try_from(r.try_get::<_, i64>(1).map_err(err)?).unwrap_or(0);
            let bytes = u64::try_from(r.try_get::<_, i64>(2).map_err(err)?).unwrap_or(0);
            out.push(PartitionInfo::new(name, kind, estimate, bytes));
        }
        Ok(out)
    }

    fn require_partitioning(&self) -> Result<&Partitioning, Error> {
        self.partitioning.as_ref().ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidConfig,
                "the store is not partitioned: configure it with .partitioned(..)",
            )
        })
    }

    async fn server_now(&self) -> Result<Timestamp, Error> {
        let err = |e| store_error("reading the clock", e);
        let lease = self.lease().await?;
        let now = lease.prepare(READ_CLOCK).await.map_err(err)?;
        let row = lease.client().query_one(&now, &[]).await.map_err(err)?;
        Ok(Timestamp::from_micros(row.try_get(0).map_err(err)?))
    }

    /// The day partitions that exist, oldest first, once the table's record says it is read
    /// as `p` reads IDs (a table without a record passes: migrate writes it).
    async fn day_partitions(&self, p: &Partitioning) -> Result<Vec<Day>, Error> {
        let t = self.table();
        let err = |e| store_error("listing partitions", e);
        let lease = self.lease().await?;
        let days = lease.prepare(maintenance::DAYS).await.map_err(err)?;
        let row = lease
            .client()
            .query_one(&days, &[&t.to_string()])
            .await
            .map_err(err)?;
        let comment: Option<String> = row.try_get(0).map_err(err)?;
        maintenance::check_record(t, comment.as_deref(), p)?;
        let names: Vec<String> = row.try_get(1).map_err(err)?;
        Ok(maintenance::days_of(t, names))
    }

    /// One maintenance transaction: serialised with other replicas' maintenance (this
    /// store's and `idem-sql`'s: the same lock), and never waiting long for the claims
    /// table's lock.
    async fn maintenance_tx(&self) -> Result<PgTx, Error> {
        let tx = self.begin_tx().await?;
        tx.batch_execute(&maintenance::maintenance_lock(self.table()))
            .await
            .map_err(|e| store_error("partition maintenance lock", e))?;
        Ok(tx)
    }

    /// Creates `day`'s partition if missing: `Some(claims moved in from the default
    /// partition)`, `None` if it existed.
    async fn create_day(&self, day: Day) -> Result<Option<u64>, Error> {
        let t = self.table();
        let part = maintenance::day_name(t, day);
        let err = |e| store_error(&format!("creating partition {part}"), e);
        let tx = self.maintenance_tx().await?;
        if exists(&tx, &part).await.map_err(err)? {
            tx.rollback().await.map_err(err)?;
            return Ok(None);
        }
        let moved = execute_simple(&tx, &maintenance::create_day(t, day))
            .await
            .map_err(err)?;
        tx.commit().await.map_err(commit_error)?;
        // The DELETE and the INSERT each count the moved claims once.
        Ok(Some(moved / 2))
    }

    /// Drops `day`'s partition; claims in it processed at `cutoff` or later (an old ID
    /// processed late, still inside the retention) move to the default partition first.
    /// Returns (the planner's estimate of the claims dropped, claims moved).
    async fn drop_day(&self, day: Day, cutoff: i64) -> Result<(u64, u64), Error> {
        let t = self.table();
        let part = maintenance::day_name(t, day);
        let err = |e| store_error(&format!("dropping partition {part}"), e);
        let tx = self.maintenance_tx().await?;
        if !exists(&tx, &part).await.map_err(err)? {
            tx.rollback().await.map_err(err)?;
            return Ok((0, 0));
        }
        let estimate = tx
            .prepare_cached(maintenance::ESTIMATE)
            .await
            .map_err(err)?;
        let estimate: i64 = tx
            .query_one(&estimate, &[&part])
            .await
            .map_err(err)?
            .try_get(0)
            .map_err(err)?;
        let look = maintenance::look_before_drop(t, day, cutoff);
        let young = execute_simple(&tx, &look).await.map_err(err)?;
        tx.batch_execute(&maintenance::drop_day(t, day, young))
            .await
            .map_err(err)?;
        tx.commit().await.map_err(commit_error)?;
        Ok((u64::try_from(estimate).unwrap_or(0), young))
    }
}

/// The claims table's [`Relation`]s ([`maintenance::RELATIONS`]).
async fn relations(client: &tokio_postgres::Client, t: &TableName) -> Result<Vec<Relation>, Error> {
    let err = |e| store_error("listing partitions", e);
    let rows = client
        .query(maintenance::RELATIONS, &[&t.to_string()])
        .await
        .map_err(err)?;
    rows.iter()
        .map(|r| {
            Ok(Relation::new(
                r.try_get(0)?,
                r.try_get(1)?,
                r.try_get(2)?,
                r.try_get(3)?,
                r.try_get(4)?,
            ))
        })
        .collect::<Result<_, tokio_postgres::Error>>()
        .map_err(err)
}

/// The body of [`PgStore::bounded_round`] on its connection: the session's lock, the catalog
/// and the clock read under it, the round planned and its steps run in order.
async fn run_round(
    client: &tokio_postgres::Client,
    t: &TableName,
    p: &Partitioning,
    want: Option<&[Day]>,
    drop_due: bool,
) -> Result<Option<PartitionReport>, Error> {
    client
        .batch_execute(&maintenance::session_start(t))
        .await
        .map_err(|e| store_error("partition maintenance lock", e))?;
    let now: i64 = client
        .query_one(READ_CLOCK, &[])
        .await
        .and_then(|r| r.try_get(0))
        .map_err(|e| store_error("reading the clock", e))?;
    let rels = relations(client, t).await?;
    if maintenance::is_legacy(t, &rels) {
        return Ok(None);
    }
    let now = Timestamp::from_micros(now);
    let want: Vec<Day> = match want {
        Some(days) => days.to_vec(),
        None => p.days_to_create(now).collect(),
    };
    let round = maintenance::round(t, &rels, now, p, &want, drop_due)?;
    let mut report = PartitionReport::default();
    for step in &round.steps {
        match step {
            Step::Alone(sql) => {
                client
                    .batch_execute(sql)
                    .await
                    .map_err(|e| store_error(sql, e))?;
            }
            Step::Tx(sql) => match client.simple_query(&format!("BEGIN; {sql}; COMMIT")).await {
                Ok(messages) => report.moved += rows_affected(&messages),
                Err(e) => {
                    // The script stopped at the failing statement, inside its transaction.
                    let _ = client.batch_execute("ROLLBACK").await;
                    return Err(store_error("partition maintenance", e));
                }
            },
        }
    }
    report.created = round.created;
    report.dropped = round.dropped;
    Ok(Some(report))
}

/// Whether the relation `name` exists, seen from inside `tx`.
async fn exists(tx: &PgTx, name: &str) -> Result<bool, tokio_postgres::Error> {
    let exists = tx.prepare_cached(maintenance::EXISTS).await?;
    tx.query_one(&exists, &[&name]).await?.try_get(0)
}

/// Runs parameterless `sql` as one simple query (it may hold several statements): its rows
/// affected, summed over its statements (as sqlx reports them for `idem-sql`).
async fn execute_simple(tx: &PgTx, sql: &str) -> Result<u64, tokio_postgres::Error> {
    Ok(rows_affected(&tx.simple_query(sql).await?))
}

/// Rows affected, summed over a simple query's statements.
fn rows_affected(messages: &[SimpleQueryMessage]) -> u64 {
    messages
        .iter()
        .map(|m| match m {
            SimpleQueryMessage::CommandComplete(n) => *n,
            _ => 0,
        })
        .sum()
}

/// Refuses to run a partitioned store on a plain table or the reverse, and a partitioned
/// store whose extractor is not the one the table records ([`maintenance::shape_fits`]).
pub(crate) async fn check_shape(
    tx: &PgTx,
    t: &TableName,
    partitioning: Option<&Partitioning>,
) -> Result<(), Error> {
    let err = |e| store_error("migrate", e);
    let shape = tx.prepare_cached(maintenance::SHAPE).await.map_err(err)?;
    let shape: Shape = tx
        .query_opt(&shape, &[&t.to_string()])
        .await
        .map_err(err)?
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
        .transpose()
        .map_err(err)?;
    maintenance::shape_fits(t, shape_ref(&shape), partitioning)
}

/// Refuses to prune a partitioned claims table from a store not configured `.partitioned(..)`
/// ([`maintenance::refuse_unpartitioned_prune`]).
pub(crate) async fn check_not_partitioned(store: &PgStore) -> Result<(), Error> {
    let t = store.table();
    let err = |e| store_error("prune", e);
    let lease = store.lease().await?;
    let shape = lease.prepare(maintenance::SHAPE).await.map_err(err)?;
    let shape: Shape = lease
        .client()
        .query_opt(&shape, &[&t.to_string()])
        .await
        .map_err(err)?
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
        .transpose()
        .map_err(err)?;
    maintenance::refuse_unpartitioned_prune(t, shape_ref(&shape))
}

/// Migrate's round of maintenance (today's partition and those ahead): a lock it cannot get in
/// time — another replica's maintenance at work, a long transaction on the claims table — is
/// logged and left to the next round instead of failing start-up; the table exists by then,
/// and claims of days not created yet wait correctly in the default partition.
pub(crate) async fn maintain_at_start_up(store: &PgStore) -> Result<(), Error> {
    match store.maintain_partitions().await {
        Err(e) if lock_timed_out(&e) => {
            tracing::info!(
                table = %store.table(),
                error = %e,
                "partition maintenance left to the next prune round: a lock is busy"
            );
            Ok(())
        }
        r => r.map(drop),
    }
}

/// Whether `e` is PostgreSQL's lock timeout (55P03), from maintenance's `lock_timeout`.
fn lock_timed_out(e: &Error) -> bool {
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        if let Some(pg) = c.downcast_ref::<tokio_postgres::Error>() {
            return pg.code().map(|c| c.code()) == Some(sqlstate::LOCK_NOT_AVAILABLE);
        }
        cause = c.source();
    }
    false
}

/// The prune of a partitioned store: maintenance (whole days past the table's retention),
/// then up to `limit` rows of the default and undated partitions older than `older_than`.
/// Dropped partitions count by the planner's estimate.
pub(crate) async fn prune_batch(
    store: &PgStore,
    consumer: Option<&ConsumerName>,
    now: Stamp,
    older_than: std::time::Duration,
    limit: u32,
) -> Result<u64, Error> {
    let report = store.maintain_partitions().await?;
    let dropped: u64 = report.dropped.iter().map(|(_, n)| n).sum();
    let rows = store.prune_rows(consumer, now, older_than, limit).await?;
    Ok(dropped.saturating_add(rows))
}
