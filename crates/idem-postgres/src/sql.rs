//! The SQL this store runs: the statements of `idem-sql`'s PostgreSQL engine, text for text
//! where they are prepared, so the two stores share tables, index names and semantics — a
//! table migrated by either works with the other, and a claim written by one is a duplicate
//! to the other (`tests/interop.rs` proves it both ways).
//!
//! Claims: `INSERT … ON CONFLICT (consumer, message_id) DO NOTHING`, one statement that cannot
//! race; a concurrent transaction's uncommitted claim of the same key makes it wait, and then
//! it inserts (that one rolled back) or affects no row (a duplicate). The duplicate's
//! fingerprint is read by a separate statement, which under READ COMMITTED sees the row whose
//! commit the insert waited for. `processed_at` is stamped by the server's clock (`now()`, the
//! transaction's start) unless the processor has a clock of its own.

use idem_core::TableName;
use idem_core::partition::Partitioning;

/// The server's clock in `processed_at` units: the transaction's start, in microseconds since
/// the Unix epoch (`now()` is fixed for the whole transaction, so a batch shares one stamp).
const SERVER_NOW: &str = "(extract(epoch from now()) * 1000000)::bigint";

/// The server's clock for request records: the start of the current statement, so that a
/// completion inside a long transaction expires a TTL after it completed, not after the
/// transaction began.
const STATEMENT_NOW: &str = "(extract(epoch from statement_timestamp()) * 1000000)::bigint";

/// Begins a transaction.
pub(crate) const BEGIN: &str = "BEGIN";

/// Commits, as one simple query: in a transaction a failed statement aborted, the `SELECT`
/// fails with 25P02 and the `COMMIT` never runs (a bare `COMMIT` would roll back and report
/// success). Both travel in one round trip.
pub(crate) const COMMIT: &str = "SELECT 1; COMMIT";

/// Rolls back.
pub(crate) const ROLLBACK: &str = "ROLLBACK";

/// Fails the transaction, with the server's own error, when a savepoint of it was dropped
/// without release or rollback (`PgTx::commit`).
pub(crate) const ABANDONED_SAVEPOINT: &str = "DO $$ BEGIN RAISE EXCEPTION 'idem: a savepoint \
     of this transaction was dropped without release() or rollback(), so nothing was \
     committed'; END $$";

/// The claim statements of one claims table. Parameters are bound in the order listed; a
/// `now`/`processed_at` parameter is `NULL` for the server's clock. On a partitioned table the
/// claim, the batch claim and the fingerprint reads take the partition key (`id_time`, the
/// batch's as an array) last.
#[derive(Debug)]
pub(crate) struct ClaimSql {
    /// consumer, message_id, fingerprint, processed_at[, id_time]: one row affected when
    /// inserted.
    pub(crate) claim: String,
    /// consumer, message_id[, id_time] → the stored fingerprint.
    pub(crate) read_fingerprint: String,
    /// consumer, message_ids, fingerprints, processed_at[, id_times] → the message IDs it
    /// inserted.
    pub(crate) claim_many: String,
    /// consumer, message_ids[, id_times] → (message_id, fingerprint) of those stored.
    pub(crate) read_fingerprints: String,
    /// now, older-than, limit (on a partitioned table: up to `limit` from each of its default
    /// and undated partitions).
    pub(crate) prune_all: String,
    /// now, older-than, consumer, limit.
    pub(crate) prune_consumer: String,
    /// (consumer, count, oldest, newest) per consumer.
    pub(crate) stats: String,
}

impl ClaimSql {
    /// `partitioned`: for a table partitioned by the ID's time (see [`crate::partitioned`]).
    pub(crate) fn new(t: &TableName, partitioned: bool) -> Self {
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
        Self {
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
}

/// The request-record statements of one requests table, on the server's clock (see
/// [`crate::requests`] for what each does). Parameters are bound in the order listed.
#[derive(Debug)]
pub(crate) struct RequestSql {
    /// fingerprint, scope, key → always one row: fingerprint, state, fence, lease_until,
    /// expires_at (all NULL when there is no record), now, result (only for a completed record
    /// with this fingerprint).
    pub(crate) read: String,
    /// scope, key, fingerprint, fence, lease, ttl: a new record in progress; no row on a
    /// conflict.
    pub(crate) insert: String,
    /// fingerprint, lease, ttl, scope, key, fence: an expired record started afresh.
    pub(crate) reset: String,
    /// lease, scope, key, fence: a lapsed lease taken over.
    pub(crate) take_over: String,
    /// result, ttl, scope, key, fence.
    pub(crate) complete: String,
    /// scope, key, fence.
    pub(crate) release: String,
    /// lease, scope, key, fence.
    pub(crate) extend: String,
    /// limit.
    pub(crate) reap: String,
}

impl RequestSql {
    pub(crate) fn new(t: &TableName) -> Self {
        let now = STATEMENT_NOW;
        Self {
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
}

/// What `migrate` runs inside its transaction, after taking the advisory lock and checking the
/// claims table's shape: the schemas, both tables (the claims table partitioned as
/// `partitioning` says, which its comment records), their indexes and comments, exactly as
/// `idem-sql` creates them.
pub(crate) fn migration(
    t: &TableName,
    r: &TableName,
    partitioning: Option<&Partitioning>,
) -> Vec<String> {
    let (name, rname) = (t.table(), r.table());
    let mut sql: Vec<String> = t
        .schema()
        .into_iter()
        .chain(r.schema())
        .map(|schema| format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
        .collect();
    if let Some(p) = partitioning {
        sql.extend(crate::partitioned::create_statements(t, p));
    } else {
        sql.extend([
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
        ]);
    }
    sql.extend([
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
    ]);
    sql
}

/// Serialises migrations across replicas that start at once: `CREATE … IF NOT EXISTS` alone
/// can still race on the catalog. The same lock `idem-sql` takes, so the two stores' migrations
/// serialise against each other too.
pub(crate) const MIGRATE_LOCK: &str = "SELECT pg_advisory_xact_lock(hashtext('idem-migrate'))";
