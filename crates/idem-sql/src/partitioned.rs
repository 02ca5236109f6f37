//! Claims partitioned by the time inside the message ID (PostgreSQL, opt-in with
//! [`PostgresStore::partitioned`]): the schema, and the maintenance that creates day
//! partitions ahead and drops them past the table's retention. Why deduplication survives it
//! is `idem_core::partition`'s module docs.
//!
//! pg_partman could do the create-ahead and drop-behind, but it is an extension a managed
//! PostgreSQL may not offer, wants a background worker or cron for its maintenance, and knows
//! nothing of the two moves correctness needs here (claims of a day out of the default
//! partition when that day's partition is created; claims younger than the retention out of a
//! day's partition before it is dropped). The few statements below do exactly that, under one
//! advisory lock, from the consumer's own pruning loop.
//!
//! Three rules keep maintenance safe beside running consumers. It locks the parent table
//! before a partition, in the mode its DDL needs, as a claim locks the parent before the
//! partition its key routes to (the other order deadlocks with such a claim). Its waits are
//! bounded (`lock_timeout`, the advisory lock included): a busy round fails and the next one
//! tries again, and `migrate` goes on without it. And the table records how it is partitioned
//! (`idem_core::partition::PartitionRecord`, in its comment): a store reading IDs with another
//! extractor is refused, and a store not configured partitioned never prunes the table.

use idem_core::partition::{
    Day, PartitionInfo, PartitionKind, PartitionRecord, PartitionReport, Partitioning,
    check_table_name,
};
use idem_core::{ConsumerName, Error, ErrorKind, Stamp};
use sqlx::{Postgres, Row};

use crate::engine::{Driver, Engine};
use crate::errors::{commit_error, store_error};
use crate::store::SqlStore;
use crate::tx::Tx;
use idem_core::TableName;

/// Claims stored in a PostgreSQL table (default `idem_processed`).
type PostgresStore = SqlStore<Postgres>;

/// How long maintenance waits for a lock before giving up until the next round: for the
/// claims table (creating or dropping a partition takes an exclusive lock on the parent for a
/// moment, and a queue of claims behind a waiting DDL would stall the consumer longer than
/// skipping), and for the maintenance lock itself (another replica holding it is doing the
/// same work).
const LOCK_TIMEOUT: &str = "SET LOCAL lock_timeout = '2s'";

/// A table's kind (`r` plain, `p` partitioned) and comment (where a partitioned table records
/// its partitioning), by its (possibly qualified) name; no row when it does not exist.
const SHAPE: &str = "SELECT relkind::text, obj_description(oid, 'pg_class') FROM pg_class WHERE oid = to_regclass($1)";

/// A table's comment and the names of the partitions attached to it, in one catalog read.
const DAYS: &str = "SELECT obj_description(to_regclass($1), 'pg_class'), \
     ARRAY(SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
     WHERE i.inhparent = to_regclass($1))";

/// The name of one of `t`'s partitions: `<table>_<suffix>`, in `t`'s schema.
pub(crate) fn name(t: &TableName, suffix: &str) -> String {
    match t.schema() {
        Some(s) => format!("{s}.{}_{suffix}", t.table()),
        None => format!("{}_{suffix}", t.table()),
    }
}

fn day_name(t: &TableName, day: Day) -> String {
    name(t, &format!("p{}", day.suffix()))
}

/// Takes the maintenance lock of `t`, which every replica's maintenance of the table (on
/// either PostgreSQL store) takes turns on. Its key is the table as the catalog names it,
/// `idem-partitions:<schema>.<table>`, however the store spells it (`Claims`, `claims`,
/// `public.claims` are one table, so one lock); the name as given while the table is missing.
fn lock_statement(t: &TableName) -> String {
    format!(
        "SELECT pg_advisory_xact_lock(hashtext('idem-partitions:' || COALESCE(\
         (SELECT n.nspname || '.' || c.relname FROM pg_class c \
         JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass('{t}')), \
         '{t}')))"
    )
}

impl SqlStore<Postgres> {
    /// Partitions the claims table by the time inside each message ID (`p` reads it: UUIDv7,
    /// ULID, your own), one partition per UTC day, so that retention drops whole partitions
    /// instead of deleting rows. `migrate` creates the table partitioned; an existing plain
    /// table is refused, not converted. The table's retention (`p`'s, not a consumer's)
    /// decides when a day is dropped; IDs without a readable time, or outside the days
    /// created, are kept in a default partition pruned row by row (see `idem_core::partition`).
    pub fn partitioned(mut self, p: Partitioning) -> Result<Self, Error> {
        check_table_name(self.table().table())?;
        self.sql = Postgres::claim_statements(self.table(), true);
        self.partitioning = Some(p);
        Ok(self)
    }

    /// The partitioning, if the table is partitioned.
    pub fn partitioning(&self) -> Option<&Partitioning> {
        self.partitioning.as_ref()
    }

    /// Configures the store as its claims table is: partitioned as the table records it
    /// ([`PartitionRecord`], written by `migrate`), for a tool that maintains a table it did
    /// not create (`idem prune`). Unchanged for a plain or missing table, for a partitioned one
    /// made before tables recorded their partitioning (its prune and migrate then refuse it),
    /// and for a store configured `partitioned` already. A table partitioned by a custom
    /// extractor gets a partitioning that maintains it but claims nothing
    /// ([`PartitionRecord::partitioning`]).
    pub async fn with_table_partitioning(self) -> Result<Self, Error> {
        if self.partitioning.is_some() {
            return Ok(self);
        }
        let record = match table_shape(self.pool(), self.table()).await? {
            Some((kind, Some(comment))) if kind == "p" => {
                PartitionRecord::from_comment(self.table(), &comment)?
            }
            _ => None,
        };
        match record {
            Some(r) => self.partitioned(r.partitioning()),
            None => Ok(self),
        }
    }

    /// Creates today's partition and those `ahead` of it, then drops the days wholly past the
    /// table's retention (a claim in them younger than the retention first moves to the
    /// default partition). Idempotent; replicas running it at once take turns. Runs with every
    /// prune of a partitioned store, so a consumer's pruning loop keeps the table in shape.
    pub async fn maintain_partitions(&self) -> Result<PartitionReport, Error> {
        let p = self.require_partitioning()?;
        let now = self.server_now().await?;
        // One catalog read decides both: it runs with every prune batch, and opening a locked
        // transaction per day ahead only to find it exists would cost three each time.
        // `create_day` still checks again under the lock.
        let existing: Vec<Day> = self
            .day_partitions(p)
            .await?
            .into_iter()
            .map(|(d, _)| d)
            .collect();
        let missing = p.days_to_create(now).filter(|d| !existing.contains(d));
        let mut report = self.create_partitions(missing).await?;
        let cutoff = now.as_micros() - crate::common::micros(p.table_retention().prune_age());
        for day in existing {
            if p.droppable(day, now) {
                let (rows, moved) = self.drop_day(day, cutoff).await?;
                report.dropped.push((day, rows));
                report.moved += moved;
            }
        }
        Ok(report)
    }

    /// Creates the partitions of `days` that do not exist yet, moving their claims out of the
    /// default partition: for backfills, and what [`maintain_partitions`](Self::maintain_partitions)
    /// does for the days ahead.
    pub async fn create_partitions(
        &self,
        days: impl IntoIterator<Item = Day>,
    ) -> Result<PartitionReport, Error> {
        self.require_partitioning()?;
        let mut report = PartitionReport::default();
        for day in days {
            if let Some(moved) = self.create_day(day).await? {
                report.created.push(day);
                report.moved += moved;
            }
        }
        Ok(report)
    }

    /// The claims table's partitions, with the planner's row estimates and their sizes; none
    /// for a plain table. Reads the catalog, so it works on a store not configured
    /// `partitioned` too (`idem stats`).
    pub async fn partitions(&self) -> Result<Vec<PartitionInfo>, Error> {
        let t = self.table();
        let rows = sqlx::query(
            "SELECT c.relname::text, c.reltuples::bigint, pg_total_relation_size(c.oid) \
             FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
             WHERE i.inhparent = to_regclass($1) ORDER BY c.relname",
        )
        .bind(t.to_string())
        .fetch_all(self.pool())
        .await
        .map_err(|e| store_error::<Postgres>("listing partitions", e))?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let name: String = r.get(0);
            let kind = match kind_of(t, &name) {
                Some(k) => k,
                None => continue, // someone else's table attached to ours: not ours to show
            };
            let estimate = u64::try_from(r.get::<i64, _>(1)).unwrap_or(0);
            let bytes = u64::try_from(r.get::<i64, _>(2)).unwrap_or(0);
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

    async fn server_now(&self) -> Result<idem_core::Timestamp, Error> {
        let now: i64 = sqlx::query_scalar("SELECT (extract(epoch from now()) * 1000000)::bigint")
            .fetch_one(self.pool())
            .await
            .map_err(|e| store_error::<Postgres>("reading the clock", e))?;
        Ok(idem_core::Timestamp::from_micros(now))
    }

    /// The day partitions that exist, by name, once the table's record says it is read as `p`
    /// reads IDs (a table without a record passes: migrate writes it).
    async fn day_partitions(&self, p: &Partitioning) -> Result<Vec<(Day, String)>, Error> {
        let t = self.table();
        let (comment, names): (Option<String>, Vec<String>) = sqlx::query_as(DAYS)
            .bind(t.to_string())
            .fetch_one(self.pool())
            .await
            .map_err(|e| store_error::<Postgres>("listing partitions", e))?;
        if let Some(record) = PartitionRecord::from_comment(t, comment.as_deref().unwrap_or(""))? {
            record.check(t, p)?;
        }
        let mut days: Vec<_> = names
            .into_iter()
            .filter_map(|n| match kind_of(t, &n) {
                Some(PartitionKind::Day(d)) => Some((d, n)),
                _ => None,
            })
            .collect();
        days.sort();
        Ok(days)
    }

    /// One maintenance transaction: serialised with other replicas' maintenance, and never
    /// waiting long for the claims table's lock.
    async fn maintenance_tx(&self) -> Result<Tx<Postgres>, Error> {
        let mut tx = Tx::begin(self.pool())
            .await
            .map_err(|e| store_error::<Postgres>("partition maintenance", e))?;
        // The timeout first, so that it bounds the wait for the advisory lock too.
        let lock = format!("{LOCK_TIMEOUT}; {}", lock_statement(self.table()));
        Postgres::execute_simple(&mut tx, &lock)
            .await
            .map_err(|e| store_error::<Postgres>("partition maintenance lock", e))?;
        Ok(tx)
    }

    /// Creates `day`'s partition if missing: `Some(claims moved in from the default
    /// partition)`, `None` if it existed.
    async fn create_day(&self, day: Day) -> Result<Option<u64>, Error> {
        let t = self.table();
        let (part, default) = (day_name(t, day), name(t, "default"));
        let err = |e| store_error::<Postgres>(&format!("creating partition {part}"), e);
        let mut tx = self.maintenance_tx().await?;
        if exists(&mut tx, &part).await.map_err(err)? {
            tx.rollback().await.map_err(err)?;
            return Ok(None);
        }
        // No claim may land in the default partition while its day's claims move out, or the
        // new partition would not cover them; PostgreSQL then checks the default partition
        // holds none of the day, under the same lock. The parent is locked first, as a claim
        // locks it (the parent, then the partition its key routes to): the other order
        // deadlocks with a claim routed to the default partition by a transaction that holds
        // the parent already. ACCESS EXCLUSIVE is what CREATE TABLE … PARTITION OF takes on
        // the parent anyway; a weaker lock upgraded later would deadlock with a transaction
        // that read the table and then claims.
        let (start, end) = (day.start(), day.end());
        let script = format!(
            "LOCK TABLE ONLY {t} IN ACCESS EXCLUSIVE MODE; \
             LOCK TABLE {default} IN SHARE ROW EXCLUSIVE MODE; \
             CREATE TEMP TABLE idem_moving (LIKE {t}) ON COMMIT DROP; \
             WITH m AS (DELETE FROM {default} WHERE id_time >= {start} AND id_time < {end} \
             RETURNING *) INSERT INTO idem_moving SELECT * FROM m; \
             CREATE TABLE {part} PARTITION OF {t} FOR VALUES FROM ({start}) TO ({end}); \
             INSERT INTO {t} SELECT * FROM idem_moving"
        );
        let moved = Postgres::execute_simple(&mut tx, &script)
            .await
            .map_err(err)?;
        tx.commit().await.map_err(commit_error::<Postgres>)?;
        // rows_affected sums the statements: the DELETE and the INSERT each count the moved
        // claims once.
        Ok(Some(moved / 2))
    }

    /// Drops `day`'s partition; claims in it processed at `cutoff` or later (an old ID
    /// processed late, still inside the retention) move to the default partition first.
    /// Returns (the planner's estimate of the claims dropped, claims moved).
    async fn drop_day(&self, day: Day, cutoff: i64) -> Result<(u64, u64), Error> {
        let t = self.table();
        let part = day_name(t, day);
        let err = |e| store_error::<Postgres>(&format!("dropping partition {part}"), e);
        let mut tx = self.maintenance_tx().await?;
        if !exists(&mut tx, &part).await.map_err(err)? {
            tx.rollback().await.map_err(err)?;
            return Ok((0, 0));
        }
        let estimate: i64 = sqlx::query_scalar(
            "SELECT reltuples::bigint FROM pg_class WHERE oid = to_regclass($1)",
        )
        .bind(&part)
        .fetch_one(&mut *tx)
        .await
        .map_err(err)?;
        // Locked before the look so that no late claim lands in it between the look and the
        // drop; the parent first, in the mode DETACH and DROP take on it, as in `create_day`.
        let look = format!(
            "LOCK TABLE ONLY {t} IN ACCESS EXCLUSIVE MODE; \
             LOCK TABLE {part} IN SHARE ROW EXCLUSIVE MODE; \
             CREATE TEMP TABLE idem_moving ON COMMIT DROP AS \
             SELECT * FROM {part} WHERE processed_at >= {cutoff}"
        );
        let young = Postgres::execute_simple(&mut tx, &look)
            .await
            .map_err(err)?;
        let sql = if young == 0 {
            format!("DROP TABLE {part}")
        } else {
            // Detached, the day's range is no longer covered, so the parent routes its young
            // claims to the default partition, where their key still finds them.
            format!(
                "ALTER TABLE {t} DETACH PARTITION {part}; \
                 INSERT INTO {t} SELECT * FROM idem_moving; DROP TABLE {part}"
            )
        };
        Postgres::execute_simple(&mut tx, &sql).await.map_err(err)?;
        tx.commit().await.map_err(commit_error::<Postgres>)?;
        Ok((u64::try_from(estimate).unwrap_or(0), young))
    }
}

async fn exists(tx: &mut Tx<Postgres>, name: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(name)
        .fetch_one(&mut **tx)
        .await
}

/// Which of `t`'s partitions `relname` (unqualified) is.
fn kind_of(t: &TableName, relname: &str) -> Option<PartitionKind> {
    let rest = relname.strip_prefix(t.table())?.strip_prefix('_')?;
    match rest {
        "default" => Some(PartitionKind::Default),
        "undated" => Some(PartitionKind::Undated),
        _ => Day::parse_suffix(rest.strip_prefix('p')?).map(PartitionKind::Day),
    }
}

/// The partitioned schema's statements, after the requests table's (same transaction, same
/// advisory lock as the plain schema). The comment ends with `p`'s [`PartitionRecord`].
pub(crate) fn create_statements(t: &TableName, p: &Partitioning) -> Vec<String> {
    let name = t.table();
    let (undated, default) = (self::name(t, "undated"), self::name(t, "default"));
    vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (
                consumer     text   NOT NULL,
                message_id   bytea  NOT NULL,
                fingerprint  bytea  NOT NULL,
                processed_at bigint NOT NULL,
                id_time      bigint NOT NULL,
                PRIMARY KEY (consumer, message_id, id_time)
            ) PARTITION BY RANGE (id_time)"
        ),
        // Key 0 (idem_core::partition::UNDATED): IDs with no readable time.
        format!(
            "CREATE TABLE IF NOT EXISTS {undated} PARTITION OF {t} FOR VALUES FROM (MINVALUE) TO (1)"
        ),
        format!("CREATE TABLE IF NOT EXISTS {default} PARTITION OF {t} DEFAULT"),
        format!("CREATE INDEX IF NOT EXISTS {name}_processed_at ON {t} USING brin (processed_at)"),
        format!(
            "COMMENT ON TABLE {t} IS 'idem claims, partitioned by the time inside the message ID \
             (id_time, microseconds since the Unix epoch; 0 when the ID has none): one row per \
             (consumer, message_id) processed; processed_at in microseconds since the Unix \
             epoch. {}'",
            p.record()
        ),
    ]
}

/// Refuses to run a partitioned store on a plain table or the reverse (the statements of one
/// do not fit the other, and converting a table of claims is an operator's decision), and a
/// partitioned store whose extractor is not the one the table records.
pub(crate) async fn check_shape(
    tx: &mut Tx<Postgres>,
    t: &TableName,
    partitioning: Option<&Partitioning>,
) -> Result<(), Error> {
    let shape: Option<(String, Option<String>)> = sqlx::query_as(SHAPE)
        .bind(t.to_string())
        .fetch_optional(&mut **tx)
        .await
        .map_err(|e| store_error::<Postgres>("migrate", e))?;
    let message = match (shape, partitioning) {
        (Some((kind, _)), Some(_)) if kind == "r" => format!(
            "the claims table {t} exists and is not partitioned; partitioning is chosen when the \
             table is created: migrate into a new table (with_table) or drop .partitioned(..)"
        ),
        (Some((kind, _)), None) if kind == "p" => format!(
            "the claims table {t} is partitioned by the ID's time; configure the store with \
             .partitioned(..) to use it"
        ),
        (Some((kind, Some(comment))), Some(p)) if kind == "p" => {
            if let Some(record) = PartitionRecord::from_comment(t, &comment)? {
                record.check(t, p)?;
            }
            return Ok(());
        }
        _ => return Ok(()),
    };
    Err(Error::new(ErrorKind::Misconfigured, message))
}

/// The claims table's kind and comment (see [`SHAPE`]), on the pool.
async fn table_shape(
    pool: &sqlx::PgPool,
    t: &TableName,
) -> Result<Option<(String, Option<String>)>, Error> {
    sqlx::query_as(SHAPE)
        .bind(t.to_string())
        .fetch_optional(pool)
        .await
        .map_err(|e| store_error::<Postgres>("reading the claims table's shape", e))
}

/// Refuses to prune a partitioned claims table from a store not configured `.partitioned(..)`:
/// its days must be dropped past the table's retention, which such a store does not know, and
/// its row-wise statement deletes nothing from a parent (`ONLY`, see the engine's prune).
pub(crate) async fn check_not_partitioned(store: &PostgresStore) -> Result<(), Error> {
    let t = store.table();
    match table_shape(store.pool(), t).await? {
        Some((kind, comment)) if kind == "p" => Err(PartitionRecord::refuse_unpartitioned_prune(
            t,
            comment.as_deref(),
        )),
        _ => Ok(()),
    }
}

/// Migrate's round of maintenance (today's partition and those ahead): a lock it cannot get in
/// time — another replica's maintenance at work, a long transaction on the claims table — is
/// logged and left to the next round instead of failing start-up; the table exists by then,
/// and claims of days not created yet wait correctly in the default partition.
pub(crate) async fn maintain_at_start_up(store: &PostgresStore) -> Result<(), Error> {
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
        if let Some(sqlx::Error::Database(db)) = c.downcast_ref::<sqlx::Error>() {
            return db.code().as_deref() == Some("55P03");
        }
        cause = c.source();
    }
    false
}

/// The engine's prune of a partitioned store: maintenance (whole days past the table's
/// retention), then up to `limit` rows of the default and undated partitions older than
/// `older_than`. Dropped partitions count by the planner's estimate.
pub(crate) async fn prune_batch(
    store: &PostgresStore,
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
