//! Claims partitioned by the time inside the message ID (opt-in with
//! [`PgStore::partitioned`]): the schema, and the maintenance that creates day partitions
//! ahead and drops them past the table's retention. Why deduplication survives it is
//! `idem_core::partition`'s module docs.
//!
//! The same schema, statements and maintenance transactions as `idem-sql`'s
//! `PostgresStore::partitioned`, text for text, so either store maintains a table the other
//! claims in, and both take the same advisory lock to take turns (`tests/interop.rs` compares
//! the catalogs the two migrations make and runs each store's maintenance under the other's
//! claims). This copy exists because the text lives in `idem-sql` beside its sqlx code, which
//! this crate does not depend on.
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
use idem_core::{ConsumerName, Error, ErrorKind, Stamp, Timestamp};
use tokio_postgres::SimpleQueryMessage;

use crate::errors::{commit_error, store_error};
use crate::sql::ClaimSql;
use crate::store::{PgStore, micros};
use crate::tx::PgTx;
use idem_core::TableName;

/// How long maintenance waits for a lock before giving up until the next round: for the
/// claims table (creating or dropping a partition takes an exclusive lock on the parent for a
/// moment, and a queue of claims behind a waiting DDL would stall the consumer longer than
/// skipping), and for the maintenance lock itself (another replica holding it is doing the
/// same work).
const LOCK_TIMEOUT: &str = "SET LOCAL lock_timeout = '2s'";

/// The server's clock in `processed_at` units (the same reading as the claim's stamp).
const READ_CLOCK: &str = "SELECT (extract(epoch from now()) * 1000000)::bigint";

/// The partitions attached to a table, by its (possibly qualified) name.
const LIST: &str = "SELECT c.relname::text, c.reltuples::bigint, pg_total_relation_size(c.oid) \
     FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
     WHERE i.inhparent = to_regclass($1) ORDER BY c.relname";

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

impl PgStore {
    /// Partitions the claims table by the time inside each message ID (`p` reads it: UUIDv7,
    /// ULID, your own), one partition per UTC day, so that retention drops whole partitions
    /// instead of deleting rows. `migrate` creates the table partitioned; an existing plain
    /// table is refused, not converted. The table's retention (`p`'s, not a consumer's)
    /// decides when a day is dropped; IDs without a readable time, or outside the days
    /// created, are kept in a default partition pruned row by row (see
    /// `idem_core::partition`). The same schema as `idem_sql::PostgresStore::partitioned`:
    /// the two stores share a partitioned table as they share a plain one.
    pub fn partitioned(mut self, p: Partitioning) -> Result<Self, Error> {
        check_table_name(self.table().table())?;
        self.sql = std::sync::Arc::new(ClaimSql::new(self.table(), true));
        self.partitioning = Some(p);
        Ok(self)
    }

    /// The partitioning, if the table is partitioned.
    pub fn partitioning(&self) -> Option<&Partitioning> {
        self.partitioning.as_ref()
    }

    /// Creates today's partition and those `ahead` of it, then drops the days wholly past the
    /// table's retention (a claim in them younger than the retention first moves to the
    /// default partition). Idempotent; replicas running it at once — on this store or on
    /// `idem-sql`'s — take turns. Runs with every prune of a partitioned store, so a
    /// consumer's pruning loop keeps the table in shape.
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
        let cutoff = now.as_micros() - micros(p.table_retention().prune_age());
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
    /// default partition: for backfills, and what
    /// [`maintain_partitions`](Self::maintain_partitions) does for the days ahead.
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
    /// `partitioned` too.
    pub async fn partitions(&self) -> Result<Vec<PartitionInfo>, Error> {
        let t = self.table();
        let err = |e| store_error("listing partitions", e);
        let lease = self.lease().await?;
        let list = lease.prepare(LIST).await.map_err(err)?;
        let rows = lease
            .client()
            .query(&list, &[&t.to_string()])
            .await
            .map_err(err)?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let name: String = r.try_get(0).map_err(err)?;
            let kind = match kind_of(t, &name) {
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

    /// The day partitions that exist, by name, oldest first, once the table's record says it
    /// is read as `p` reads IDs (a table without a record passes: migrate writes it). Names
    /// only: sizing a partition would wait for the lock another replica's maintenance holds on
    /// it.
    async fn day_partitions(&self, p: &Partitioning) -> Result<Vec<(Day, String)>, Error> {
        let t = self.table();
        let err = |e| store_error("listing partitions", e);
        let lease = self.lease().await?;
        let days = lease.prepare(DAYS).await.map_err(err)?;
        let row = lease
            .client()
            .query_one(&days, &[&t.to_string()])
            .await
            .map_err(err)?;
        let comment: Option<String> = row.try_get(0).map_err(err)?;
        if let Some(record) = PartitionRecord::from_comment(t, comment.as_deref().unwrap_or(""))? {
            record.check(t, p)?;
        }
        let names: Vec<String> = row.try_get(1).map_err(err)?;
        let mut days = Vec::with_capacity(names.len());
        for name in names {
            if let Some(PartitionKind::Day(d)) = kind_of(t, &name) {
                days.push((d, name));
            }
        }
        days.sort();
        Ok(days)
    }

    /// One maintenance transaction: serialised with other replicas' maintenance (this
    /// store's and `idem-sql`'s: the same lock), and never waiting long for the claims
    /// table's lock.
    async fn maintenance_tx(&self) -> Result<PgTx, Error> {
        let tx = self.begin_tx().await?;
        // The timeout first, so that it bounds the wait for the advisory lock too.
        let lock = format!("{LOCK_TIMEOUT}; {}", lock_statement(self.table()));
        tx.batch_execute(&lock)
            .await
            .map_err(|e| store_error("partition maintenance lock", e))?;
        Ok(tx)
    }

    /// Creates `day`'s partition if missing: `Some(claims moved in from the default
    /// partition)`, `None` if it existed.
    async fn create_day(&self, day: Day) -> Result<Option<u64>, Error> {
        let t = self.table();
        let (part, default) = (day_name(t, day), name(t, "default"));
        let err = |e| store_error(&format!("creating partition {part}"), e);
        let tx = self.maintenance_tx().await?;
        if exists(&tx, &part).await.map_err(err)? {
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
        let moved = execute_simple(&tx, &script).await.map_err(err)?;
        tx.commit().await.map_err(commit_error)?;
        // The rows affected sum the statements: the DELETE and the INSERT each count the
        // moved claims once.
        Ok(Some(moved / 2))
    }

    /// Drops `day`'s partition; claims in it processed at `cutoff` or later (an old ID
    /// processed late, still inside the retention) move to the default partition first.
    /// Returns (the planner's estimate of the claims dropped, claims moved).
    async fn drop_day(&self, day: Day, cutoff: i64) -> Result<(u64, u64), Error> {
        let t = self.table();
        let part = day_name(t, day);
        let err = |e| store_error(&format!("dropping partition {part}"), e);
        let tx = self.maintenance_tx().await?;
        if !exists(&tx, &part).await.map_err(err)? {
            tx.rollback().await.map_err(err)?;
            return Ok((0, 0));
        }
        let estimate = tx
            .prepare_cached("SELECT reltuples::bigint FROM pg_class WHERE oid = to_regclass($1)")
            .await
            .map_err(err)?;
        let estimate: i64 = tx
            .query_one(&estimate, &[&part])
            .await
            .map_err(err)?
            .try_get(0)
            .map_err(err)?;
        // Locked before the look so that no late claim lands in it between the look and the
        // drop; the parent first, in the mode DETACH and DROP take on it, as in `create_day`.
        let look = format!(
            "LOCK TABLE ONLY {t} IN ACCESS EXCLUSIVE MODE; \
             LOCK TABLE {part} IN SHARE ROW EXCLUSIVE MODE; \
             CREATE TEMP TABLE idem_moving ON COMMIT DROP AS \
             SELECT * FROM {part} WHERE processed_at >= {cutoff}"
        );
        let young = execute_simple(&tx, &look).await.map_err(err)?;
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
        tx.batch_execute(&sql).await.map_err(err)?;
        tx.commit().await.map_err(commit_error)?;
        Ok((u64::try_from(estimate).unwrap_or(0), young))
    }
}

/// Whether the relation `name` exists, seen from inside `tx`.
async fn exists(tx: &PgTx, name: &str) -> Result<bool, tokio_postgres::Error> {
    let exists = tx
        .prepare_cached("SELECT to_regclass($1) IS NOT NULL")
        .await?;
    tx.query_one(&exists, &[&name]).await?.try_get(0)
}

/// Runs parameterless `sql` as one simple query (it may hold several statements): its rows
/// affected, summed over its statements (as sqlx reports them for `idem-sql`'s copy).
async fn execute_simple(tx: &PgTx, sql: &str) -> Result<u64, tokio_postgres::Error> {
    let messages = tx.simple_query(sql).await?;
    Ok(messages
        .iter()
        .map(|m| match m {
            SimpleQueryMessage::CommandComplete(n) => *n,
            _ => 0,
        })
        .sum())
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

/// The partitioned schema's claims-table statements, before the requests table's (same
/// transaction, same advisory lock as the plain schema). The comment ends with `p`'s
/// [`PartitionRecord`].
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
    tx: &PgTx,
    t: &TableName,
    partitioning: Option<&Partitioning>,
) -> Result<(), Error> {
    let err = |e| store_error("migrate", e);
    let shape = tx.prepare_cached(SHAPE).await.map_err(err)?;
    let shape = tx
        .query_opt(&shape, &[&t.to_string()])
        .await
        .map_err(err)?
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
        .transpose()
        .map_err(err)?;
    shape_fits(t, shape, partitioning)
}

/// [`check_shape`]'s verdict on the table's kind and comment.
fn shape_fits(
    t: &TableName,
    shape: Option<(String, Option<String>)>,
    partitioning: Option<&Partitioning>,
) -> Result<(), Error> {
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

/// Refuses to prune a partitioned claims table from a store not configured `.partitioned(..)`:
/// its days must be dropped past the table's retention, which such a store does not know, and
/// its row-wise statement deletes nothing from a parent (`ONLY`, see [`ClaimSql`]).
pub(crate) async fn check_not_partitioned(store: &PgStore) -> Result<(), Error> {
    let t = store.table();
    let err = |e| store_error("prune", e);
    let lease = store.lease().await?;
    let shape = lease.prepare(SHAPE).await.map_err(err)?;
    let shape: Option<(String, Option<String>)> = lease
        .client()
        .query_opt(&shape, &[&t.to_string()])
        .await
        .map_err(err)?
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
        .transpose()
        .map_err(err)?;
    match shape {
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
            return pg.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE);
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
