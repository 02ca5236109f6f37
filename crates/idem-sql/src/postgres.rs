//! The PostgreSQL engine.
//!
//! The claim is `INSERT … ON CONFLICT (consumer, message_id) DO NOTHING`: one statement that
//! cannot race. A concurrent transaction holding an uncommitted claim for the same key makes it
//! wait; if that one commits, this insert affects no row (a duplicate), if it rolls back, this
//! insert proceeds. The duplicate's fingerprint is then read by a new statement, which under
//! READ COMMITTED sees the row whose commit the insert waited for. The `processed_at` index is BRIN: claims arrive in time order, so a BRIN
//! index costs almost nothing per insert and still lets pruning find old rows.
//!
//! Request records (see [`crate::requests`]) live in their own table, `result` a `bytea`. A
//! lookup's `SELECT` is an MVCC read that never waits for the row lock a completing executor
//! holds; their `expires_at` index is a btree, as completion moves a row's expiry.

use idem_core::{ConsumerName, Error, ErrorKind, Fingerprint, MessageId, Stamp};
use sqlx::Postgres;
use sqlx::error::DatabaseError;

use crate::common::{server_stamp, stored_fingerprint};
use crate::engine::{CheckedCommit, Driver, Engine};
use crate::errors::{commit_error, store_error};
use crate::requests::RequestStatements;
use crate::store::{ClaimStatements, SqlStore};
use crate::tx::Tx;
use idem_core::TableName;

/// The server's clock in `processed_at` units: the transaction's start, in microseconds since
/// the Unix epoch (`now()` is fixed for the whole transaction, so a batch shares one stamp).
const SERVER_NOW: &str = "(extract(epoch from now()) * 1000000)::bigint";

/// The server's clock for request records: the start of the current statement, so that a
/// completion inside a long transaction expires a TTL after it completed, not after the
/// transaction began.
const STATEMENT_NOW: &str = "(extract(epoch from statement_timestamp()) * 1000000)::bigint";

/// Longest message ID this schema holds: well inside the btree tuple limit.
pub const MAX_MESSAGE_ID_LEN: usize = 1024;

/// Claims stored in a PostgreSQL table (default `idem_processed`).
pub type PostgresStore = SqlStore<Postgres>;

impl crate::engine::sealed::Sealed for Postgres {}

impl Engine for Postgres {
    const MAX_MESSAGE_ID_LEN: usize = MAX_MESSAGE_ID_LEN;
    const BEGIN: &'static str = "BEGIN";
    // In an aborted transaction the SELECT fails with 25P02 and the COMMIT never runs; all
    // travel in one simple-query round trip.
    const CHECKED_COMMIT: Option<CheckedCommit> = Some(CheckedCommit {
        alone: "SELECT 1; COMMIT",
        then_begin: "SELECT 1; COMMIT; BEGIN",
    });
    const SERVER: bool = true;

    fn claim_statements(t: &TableName, partitioned: bool) -> ClaimStatements {
        // A partitioned table's unique key holds the partition key, which every statement
        // names so that PostgreSQL looks in one partition only.
        let (key, key_col, key_val, key_eq) = if partitioned {
            (", id_time", ", id_time", ", $5", " AND id_time = $3")
        } else {
            ("", "", "", "")
        };
        let (keys, key_arr, key_any) = if partitioned {
            (", k", ", $5::bigint[]", " AND id_time = ANY($3::bigint[])")
        } else {
            ("", "", "")
        };
        let unnest_as = if partitioned { "u(m, f, k)" } else { "u(m, f)" };
        // A ctid names a row within one table's own heap only: `ONLY` on both sides keeps the
        // positions and the delete in the one heap they came from. Without it, on a parent
        // with partitions (or inheritance children), each old row's position would delete the
        // rows at that position in every partition; with it, a parent deletes nothing (it has
        // no rows of its own), and the store refuses to prune such a table at all (see
        // `check_not_partitioned`). Row-wise pruning of a partitioned table covers only its
        // default and undated partitions, plain leaf tables (whole days are dropped).
        let prune = |target: &str, consumer: &str, limit: &str| {
            format!(
                "DELETE FROM ONLY {target} WHERE ctid = ANY(ARRAY( \
                 SELECT ctid FROM ONLY {target} WHERE processed_at < COALESCE($1, {SERVER_NOW}) - $2 \
                 {consumer} LIMIT {limit}))"
            )
        };
        let (prune_all, prune_consumer) = if partitioned {
            let (d, u) = (
                crate::partitioned::name(t, "default"),
                crate::partitioned::name(t, "undated"),
            );
            (
                // One statement over both; its row count is what both deleted.
                format!(
                    "WITH d AS ({} RETURNING 1), u AS ({} RETURNING 1) \
                     SELECT 1 FROM d UNION ALL SELECT 1 FROM u",
                    prune(&d, "", "$3"),
                    prune(&u, "", "$3")
                ),
                format!(
                    "WITH d AS ({} RETURNING 1), u AS ({} RETURNING 1) \
                     SELECT 1 FROM d UNION ALL SELECT 1 FROM u",
                    prune(&d, "AND consumer = $3", "$4"),
                    prune(&u, "AND consumer = $3", "$4")
                ),
            )
        } else {
            // `ctid = ANY(ARRAY(…))` plans as a TID scan; `ctid IN (…)` may scan the table.
            (
                prune(&t.to_string(), "", "$3"),
                prune(&t.to_string(), "AND consumer = $3", "$4"),
            )
        };
        ClaimStatements {
            claim: format!(
                "INSERT INTO {t} (consumer, message_id, fingerprint, processed_at{key}) \
                 VALUES ($1, $2, $3, COALESCE($4, {SERVER_NOW}){key_val}) \
                 ON CONFLICT (consumer, message_id{key_col}) DO NOTHING"
            ),
            read_fingerprint: format!(
                "SELECT fingerprint FROM {t} WHERE consumer = $1 AND message_id = $2{key_eq}"
            ),
            claim_many: format!(
                "INSERT INTO {t} (consumer, message_id, fingerprint, processed_at{key}) \
                 SELECT $1, m, f, COALESCE($4::bigint, {SERVER_NOW}){keys} \
                 FROM unnest($2::bytea[], $3::bytea[]{key_arr}) AS {unnest_as} \
                 ON CONFLICT (consumer, message_id{key_col}) DO NOTHING RETURNING message_id"
            ),
            read_fingerprints: format!(
                "SELECT message_id, fingerprint FROM {t} \
                 WHERE consumer = $1 AND message_id = ANY($2::bytea[]){key_any}"
            ),
            prune_all,
            prune_consumer,
            stats: format!(
                "SELECT consumer, count(*)::bigint, min(processed_at), max(processed_at) \
                 FROM {t} GROUP BY consumer ORDER BY consumer"
            ),
        }
    }

    /// On the server's clock.
    fn request_statements(t: &TableName) -> RequestStatements {
        let now = STATEMENT_NOW;
        RequestStatements {
            read: format!(
                "SELECT r.fingerprint, r.state, r.fence, r.lease_until, r.expires_at, n.now, \
             CASE WHEN r.fingerprint = $1 AND r.state = 1 THEN r.result END \
             FROM (SELECT {now} AS now) n LEFT JOIN {t} r ON r.scope = $2 AND r.idem_key = $3"
            ),
            insert: format!(
                "INSERT INTO {t} (scope, idem_key, fingerprint, state, fence, lease_until, expires_at) \
             VALUES ($1, $2, $3, 0, $4, {now} + $5, {now} + $6) \
             ON CONFLICT (scope, idem_key) DO NOTHING"
            ),
            reset: format!(
                "UPDATE {t} SET fingerprint = $1, state = 0, fence = fence + 1, \
             lease_until = {now} + $2, expires_at = {now} + $3, result = NULL \
             WHERE scope = $4 AND idem_key = $5 AND fence = $6 \
             AND expires_at <= {now} AND (state = 1 OR lease_until <= {now})"
            ),
            take_over: format!(
                "UPDATE {t} SET fence = fence + 1, lease_until = {now} + $1 \
             WHERE scope = $2 AND idem_key = $3 AND fence = $4 AND state = 0 \
             AND lease_until <= {now}"
            ),
            complete: format!(
                "UPDATE {t} SET state = 1, result = $1, expires_at = {now} + $2 \
             WHERE scope = $3 AND idem_key = $4 AND fence = $5 AND state = 0"
            ),
            release: format!(
                "DELETE FROM {t} WHERE scope = $1 AND idem_key = $2 AND fence = $3 AND state = 0"
            ),
            extend: format!(
                "UPDATE {t} SET lease_until = {now} + $1 \
             WHERE scope = $2 AND idem_key = $3 AND fence = $4 AND state = 0"
            ),
            // The outer condition is checked again on a row a lookup restarted meanwhile.
            // `ONLY`, as for the claims: migrate creates this table plain, where a ctid is one
            // row; on a table partitioned or inherited by hand it reaps nothing rather than the
            // rows at the same positions in other tables.
            reap: format!(
                "DELETE FROM ONLY {t} WHERE ctid = ANY(ARRAY( \
             SELECT ctid FROM ONLY {t} WHERE expires_at < {now} AND (state = 1 OR lease_until < {now}) \
             LIMIT $1)) AND expires_at < {now} AND (state = 1 OR lease_until < {now})"
            ),
        }
    }

    /// Lower case: the statements name tables unquoted, which PostgreSQL folds, and the
    /// catalog lookups of partitions and the maintenance lock's key must spell them as it does.
    fn resolved_table(table: TableName) -> TableName {
        table.folded()
    }

    fn stamp(stamp: Stamp) -> Option<i64> {
        server_stamp(stamp)
    }

    fn database_kind(db: &dyn DatabaseError) -> ErrorKind {
        idem_core::sqlstate::kind(db.code().as_deref().unwrap_or(""))
    }

    /// 25006 `read_only_sql_transaction`: a standby, or a session or role with
    /// `default_transaction_read_only`.
    fn read_only(db: &dyn DatabaseError) -> bool {
        db.code().as_deref() == Some("25006")
    }

    fn connection_lost(db: &dyn DatabaseError) -> bool {
        idem_core::sqlstate::connection_lost(db.code().as_deref().unwrap_or(""))
    }

    fn aborted(db: &dyn DatabaseError) -> bool {
        db.code().as_deref() == Some("25P02")
    }

    async fn claim_many(
        store: &SqlStore<Self>,
        tx: &mut Tx<Self>,
        consumer: &ConsumerName,
        items: &[(&MessageId, Fingerprint)],
        at: Stamp,
    ) -> Result<Vec<Option<Fingerprint>>, Error> {
        claim_many(store, tx, consumer, items, at).await
    }

    async fn migrate(store: &SqlStore<Self>) -> Result<(), Error> {
        migrate(store).await?;
        if store.partitioning().is_some() {
            crate::partitioned::maintain_at_start_up(store).await?;
        }
        Ok(())
    }

    async fn prune_batch<'e>(
        store: &'e SqlStore<Self>,
        consumer: Option<&'e ConsumerName>,
        now: Stamp,
        older_than: std::time::Duration,
        limit: u32,
    ) -> Result<u64, Error> {
        if store.partitioning().is_some() {
            return crate::partitioned::prune_batch(store, consumer, now, older_than, limit).await;
        }
        let deleted = store.prune_rows(consumer, now, older_than, limit).await?;
        // A short batch (the last one, or nothing at all: all a partitioned parent gives) looks
        // at the table once, so a store pointed at a partitioned table says so instead of
        // pruning nothing, round after round.
        if deleted < u64::from(limit) {
            crate::partitioned::check_not_partitioned(store).await?;
        }
        Ok(deleted)
    }
}

impl SqlStore<Postgres> {
    /// Connects a pool to `url` (`postgres://user@host/db`) with the default tables.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let pool = crate::common::connect_pool::<Postgres>(url, 16).await?;
        Ok(Self::from_pool(pool))
    }
}

/// The batch claim: one `INSERT … SELECT FROM unnest(…) ON CONFLICT DO NOTHING RETURNING`
/// for the whole batch, and one read of the stored fingerprints of the rest.
async fn claim_many(
    store: &PostgresStore,
    tx: &mut Tx<Postgres>,
    consumer: &ConsumerName,
    items: &[(&MessageId, Fingerprint)],
    at: Stamp,
) -> Result<Vec<Option<Fingerprint>>, Error> {
    let ids: Vec<&[u8]> = items.iter().map(|(id, _)| id.as_bytes()).collect();
    let fps: Vec<&[u8]> = items.iter().map(|(_, fp)| &fp.as_bytes()[..]).collect();
    let keys: Option<Vec<i64>> = store
        .partitioning()
        .map(|p| items.iter().map(|(id, _)| p.key_of(id)).collect())
        .transpose()?;
    let mut claim = sqlx::query_scalar(&store.sql.claim_many)
        .bind(consumer.as_str())
        .bind(&ids)
        .bind(&fps)
        .bind(server_stamp(at));
    if let Some(keys) = &keys {
        claim = claim.bind(keys);
    }
    let inserted: Vec<Vec<u8>> = claim
        .fetch_all(&mut **tx)
        .await
        .map_err(|e| store_error::<Postgres>("batch claim", e))?;
    if inserted.len() == items.len() {
        return Ok(vec![None; items.len()]);
    }
    let inserted: std::collections::HashSet<Vec<u8>> = inserted.into_iter().collect();
    let existing: Vec<&[u8]> = ids
        .iter()
        .copied()
        .filter(|id| !inserted.contains(*id))
        .collect();
    let mut read = sqlx::query_as(&store.sql.read_fingerprints)
        .bind(consumer.as_str())
        .bind(&existing);
    if let Some(keys) = &keys {
        // A superset of the keys of `existing` is fine: (consumer, message_id) decides.
        read = read.bind(keys);
    }
    let rows: Vec<(Vec<u8>, Vec<u8>)> = read
        .fetch_all(&mut **tx)
        .await
        .map_err(|e| store_error::<Postgres>("reading stored fingerprints", e))?;
    let mut stored: std::collections::HashMap<Vec<u8>, Vec<u8>> = rows.into_iter().collect();
    ids.iter()
        .map(|id| {
            if inserted.contains(*id) {
                Ok(None)
            } else {
                stored_fingerprint(stored.remove(*id))
            }
        })
        .collect()
}

/// Both tables in one transaction, serialised across replicas by an advisory lock.
async fn migrate(store: &PostgresStore) -> Result<(), Error> {
    let t = store.table();
    let name = t.table();
    let (r, rname) = (store.requests_table(), store.requests_table().table());
    let mut tx = Tx::begin(store.pool())
        .await
        .map_err(|e| store_error::<Postgres>("migrate", e))?;
    // Several replicas may start at once; CREATE … IF NOT EXISTS alone can still race on
    // the catalog, so serialise migrations on an advisory lock.
    let lock = "SELECT pg_advisory_xact_lock(hashtext('idem-migrate'))";
    Postgres::execute_simple(&mut tx, lock)
        .await
        .map_err(|e| store_error::<Postgres>("migrate lock", e))?;
    for schema in t.schema().into_iter().chain(r.schema()) {
        let sql = format!("CREATE SCHEMA IF NOT EXISTS {schema}");
        Postgres::execute_simple(&mut tx, &sql)
            .await
            .map_err(|e| store_error::<Postgres>("migrate", e))?;
    }
    crate::partitioned::check_shape(&mut tx, t, store.partitioning()).await?;
    let claims = if let Some(p) = store.partitioning() {
        crate::partitioned::create_statements(t, p)
    } else {
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    consumer     text   NOT NULL,
                    message_id   bytea  NOT NULL,
                    fingerprint  bytea  NOT NULL,
                    processed_at bigint NOT NULL,
                    PRIMARY KEY (consumer, message_id)
                )"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {name}_processed_at ON {t} USING brin (processed_at)"
            ),
            format!(
                "COMMENT ON TABLE {t} IS 'idem claims: one row per (consumer, message_id) \
                 processed; processed_at in microseconds since the Unix epoch'"
            ),
        ]
    };
    for sql in claims.into_iter().chain([
        format!(
            "CREATE TABLE IF NOT EXISTS {r} (
                scope       bytea    NOT NULL,
                idem_key    bytea    NOT NULL,
                fingerprint bytea    NOT NULL,
                state       smallint NOT NULL,
                fence       bigint   NOT NULL,
                lease_until bigint   NOT NULL,
                expires_at  bigint   NOT NULL,
                result      bytea,
                PRIMARY KEY (scope, idem_key)
            )"
        ),
        format!("CREATE INDEX IF NOT EXISTS {rname}_expires_at ON {r} (expires_at)"),
        format!(
            "COMMENT ON TABLE {r} IS 'idem idempotent requests: one row per (scope, idem_key); \
             state 0 in progress, 1 completed; lease_until and expires_at in microseconds \
             since the Unix epoch'"
        ),
    ]) {
        Postgres::execute_simple(&mut tx, &sql)
            .await
            .map_err(|e| store_error::<Postgres>("migrate", e))?;
    }
    tx.commit().await.map_err(commit_error::<Postgres>)
}
