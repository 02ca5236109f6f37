//! PostgreSQL: the statements, migration and error table both PostgreSQL stores run — `idem-sql`
//! on sqlx and `idem-postgres` on tokio-postgres — so that they share tables, index names,
//! locks and semantics: a table migrated by either serves the other, and a claim written by
//! one is a duplicate to the other.
//!
//! Claims: `INSERT … ON CONFLICT (consumer, message_id) DO NOTHING`, one statement that cannot
//! race; a concurrent transaction's uncommitted claim of the same key makes it wait, and then
//! it inserts (that one rolled back) or affects no row (a duplicate). The duplicate's
//! fingerprint is read by a separate statement, which under READ COMMITTED sees the row whose
//! commit the insert waited for. `processed_at` is stamped by the server's clock (`now()`, the
//! transaction's start) unless the processor has a clock of its own; its index is BRIN: claims
//! arrive in time order, so it costs almost nothing per insert and still lets pruning find old
//! rows.
//!
//! Request records live in their own table, `result` a `bytea`. A lookup's `SELECT` is an MVCC
//! read that never waits for the row lock a completing executor holds; their `expires_at`
//! index is a btree, as completion moves a row's expiry.

pub mod maintenance;
mod outbox;
pub mod partition;
pub mod sqlstate;

use idem_core::TableName;

use crate::{ClaimStatements, RecoveryMigration, RequestStatements};
pub use outbox::{FILLFACTOR, outbox_channel, outbox_migration, outbox_statements};
use partition::Partitioning;

/// The server's clock in `processed_at` units: the transaction's start, in microseconds since
/// the Unix epoch (`now()` is fixed for the whole transaction, so a batch shares one stamp).
pub const SERVER_NOW: &str = "(extract(epoch from now()) * 1000000)::bigint";

/// The server's clock for request records: the start of the current statement, so that a
/// completion inside a long transaction expires a TTL after it completed, not after the
/// transaction began.
pub const STATEMENT_NOW: &str = "(extract(epoch from statement_timestamp()) * 1000000)::bigint";

/// Reads [`SERVER_NOW`]: the clock claims are stamped and partitions maintained by.
pub const READ_CLOCK: &str = "SELECT (extract(epoch from now()) * 1000000)::bigint";

/// Longest message ID the schema holds: well inside the btree tuple limit.
pub const MAX_MESSAGE_ID_LEN: usize = 1024;

/// Begins a transaction.
pub const BEGIN: &str = "BEGIN";

/// How the outbox relay's own transactions begin (the lease, the mark, a dead letter): `BEGIN`
/// and, for that transaction only, `synchronous_commit = off` — its `COMMIT` returns once the
/// commit is in the WAL buffers, not on disk (the WAL writer flushes it within a few hundred
/// ms). On a disk whose flush takes milliseconds that is most of a lease's time.
///
/// Safe because losing such a commit (a server crash in that window, or a failover to a
/// replica it had not reached) only repeats work, never loses a message or a claim:
/// - a lost lease leaves its rows unleased (or leased as before), so another relay — or the
///   same one — publishes them again under the same message IDs, which idem's consumers
///   deduplicate (their claims commit durably, as the server is configured);
/// - a lost mark leaves its rows leased and unsent, so they are published again under the
///   same IDs once the lease lapses;
/// - a lost dead-letter move leaves the row leased until its lease lapses, when it is
///   published, refused and moved again.
///
/// The enqueue never uses it: it runs in the caller's transaction, whose durability is the
/// caller's.
pub const RELAY_BEGIN: &str = "BEGIN; SET LOCAL synchronous_commit = off";

/// Commits, as one simple query: in a transaction a failed statement aborted, the `SELECT`
/// fails with 25P02 ([`sqlstate::IN_FAILED_SQL_TRANSACTION`]) and the `COMMIT` never runs (a
/// bare `COMMIT` would roll back *and report success*). Both travel in one round trip.
pub const COMMIT: &str = "SELECT 1; COMMIT";

/// [`COMMIT`] followed by `BEGIN`, leaving an empty transaction open: for a driver whose own
/// transaction manager sends a `ROLLBACK` afterwards (sqlx).
pub const COMMIT_THEN_BEGIN: &str = "SELECT 1; COMMIT; BEGIN";

/// Rolls back.
pub const ROLLBACK: &str = "ROLLBACK";

/// Serialises migrations across replicas that start at once (`CREATE … IF NOT EXISTS` alone
/// can still race on the catalog), and the two stores' migrations against each other.
pub const MIGRATE_LOCK: &str = "SELECT pg_advisory_xact_lock(hashtext('idem-migrate'))";

/// The claim statements for `t`; `partitioned`: for a table partitioned by the ID's time
/// ([`partition`]), whose statements take the partition key last.
pub fn claim_statements(t: &TableName, partitioned: bool) -> ClaimStatements {
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
    // no rows of its own), and the stores refuse to prune such a table at all (see
    // `maintenance::refuse_unpartitioned_prune`). Row-wise pruning of a partitioned table
    // covers only its default and undated partitions, plain leaf tables (whole days are
    // dropped). `ctid = ANY(ARRAY(…))` plans as a TID scan; `ctid IN (…)` may scan the table.
    let prune = |target: &str, consumer: &str, limit: &str| {
        format!(
            "DELETE FROM ONLY {target} WHERE ctid = ANY(ARRAY( \
             SELECT ctid FROM ONLY {target} WHERE processed_at < COALESCE($1, {SERVER_NOW}) - $2 \
             {consumer} LIMIT {limit}))"
        )
    };
    let (prune_all, prune_consumer) = if partitioned {
        let (d, u) = (
            maintenance::partition_name(t, maintenance::DEFAULT),
            maintenance::partition_name(t, maintenance::UNDATED),
        );
        // One statement over both; its row count is what both deleted.
        let both = |consumer: &str, limit: &str| {
            format!(
                "WITH d AS ({} RETURNING 1), u AS ({} RETURNING 1) \
                 SELECT 1 FROM d UNION ALL SELECT 1 FROM u",
                prune(&d, consumer, limit),
                prune(&u, consumer, limit)
            )
        };
        (both("", "$3"), both("AND consumer = $3", "$4"))
    } else {
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
        claim_many_tail: String::new(),
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

/// The transaction-scoped advisory lock of one request record, taken without waiting: true
/// when this transaction holds it (now, or already). Every statement that takes a record —
/// insert, reset, take-over — takes it in the same statement, so a record held uncommitted by
/// a one-transaction execution (whose insert or update a plain statement would wait for) makes
/// the take affect no row at once instead; a statement run on its own (the leased mode)
/// releases it as it ends. Its key: 64 bits of `md5(scope || key || table)`, the same for
/// both PostgreSQL stores, with the table as the OID its name resolves to: advisory locks are
/// the database's, so two schemas' tables of the same name (one per tenant, one per test)
/// must not share a record's lock. `scope`, `key`: the statement's parameters holding them.
fn record_lock(t: &TableName, scope: &str, key: &str) -> String {
    format!(
        "pg_try_advisory_xact_lock(('x' || left(md5({scope}::bytea || {key}::bytea || \
         COALESCE(to_regclass('{t}')::oid::text, '{t}')::bytea), 16))::bit(64)::bigint)"
    )
}

/// The request-record statements for `t`, on the server's clock ([`STATEMENT_NOW`]).
pub fn request_statements(t: &TableName) -> RequestStatements {
    let now = STATEMENT_NOW;
    let recovery_cols = "scope, idem_key, fence, recovery_point, phase_state, attempts";
    RequestStatements {
        read: format!(
            "SELECT r.fingerprint, r.state, r.fence, r.lease_until, r.expires_at, n.now, \
             CASE WHEN r.fingerprint = $1 AND r.state <> 0 THEN r.result END, \
             CASE WHEN r.recovery_point IS NULL THEN 0 ELSE 1 END::bigint \
             FROM (SELECT {now} AS now) n LEFT JOIN {t} r ON r.scope = $2 AND r.idem_key = $3"
        ),
        insert: format!(
            "INSERT INTO {t} (scope, idem_key, fingerprint, state, fence, lease_until, expires_at, attempts) \
             SELECT $1::bytea, $2::bytea, $3::bytea, 0, $4::bigint, {now} + $5::bigint, {now} + $6::bigint, 1 \
             WHERE {} ON CONFLICT (scope, idem_key) DO NOTHING",
            record_lock(t, "$1", "$2")
        ),
        reset: format!(
            "UPDATE {t} SET fingerprint = $1, state = 0, fence = fence + 1, \
             lease_until = {now} + $2, expires_at = {now} + $3, result = NULL, \
             recovery_point = NULL, phase_state = NULL, attempts = 1 \
             WHERE scope = $4 AND idem_key = $5 AND fence = $6 AND expires_at <= {now} \
             AND (state <> 0 OR (lease_until <= {now} AND recovery_point IS NULL)) AND {}",
            record_lock(t, "$4", "$5")
        ),
        insert_at: format!(
            "INSERT INTO {t} (scope, idem_key, fingerprint, state, fence, lease_until, expires_at, \
             attempts, recovery_point, phase_state) \
             SELECT $1::bytea, $2::bytea, $3::bytea, 0, $4::bigint, {now} + $5::bigint, \
             {now} + $6::bigint, 1, $7::text, $8::bytea \
             WHERE {} ON CONFLICT (scope, idem_key) DO NOTHING",
            record_lock(t, "$1", "$2")
        ),
        reset_at: format!(
            "UPDATE {t} SET fingerprint = $1, state = 0, fence = fence + 1, \
             lease_until = {now} + $2, expires_at = {now} + $3, result = NULL, \
             recovery_point = $4, phase_state = $5, attempts = 1 \
             WHERE scope = $6 AND idem_key = $7 AND fence = $8 AND expires_at <= {now} \
             AND (state <> 0 OR (lease_until <= {now} AND recovery_point IS NULL)) AND {}",
            record_lock(t, "$6", "$7")
        ),
        take_over: format!(
            "UPDATE {t} SET fence = fence + 1, lease_until = {now} + $1, attempts = attempts + 1 \
             WHERE scope = $2 AND idem_key = $3 AND fence = $4 AND state = 0 \
             AND lease_until <= {now} AND {}",
            record_lock(t, "$2", "$3")
        ),
        complete: format!(
            "UPDATE {t} SET state = 1, result = $1, expires_at = {now} + $2 \
             WHERE scope = $3 AND idem_key = $4 AND fence = $5 AND state = 0"
        ),
        release: format!(
            "DELETE FROM {t} WHERE scope = $1 AND idem_key = $2 AND fence = $3 AND state = 0 \
             AND recovery_point IS NULL"
        ),
        end_lease: format!(
            "UPDATE {t} SET lease_until = {now} \
             WHERE scope = $1 AND idem_key = $2 AND fence = $3 AND state = 0 \
             AND recovery_point IS NOT NULL"
        ),
        recovery: format!(
            "SELECT {recovery_cols} FROM {t} \
             WHERE scope = $1 AND idem_key = $2 AND fence = $3 AND state = 0"
        ),
        advance: format!(
            "UPDATE {t} SET recovery_point = $1, phase_state = $2 \
             WHERE scope = $3 AND idem_key = $4 AND fence = $5 AND state = 0"
        ),
        abandon: format!(
            "UPDATE {t} SET state = 2, result = $1, expires_at = {now} + $2 \
             WHERE scope = $3 AND idem_key = $4 AND fence = $5 AND state = 0"
        ),
        stuck: format!(
            "SELECT {recovery_cols} FROM {t} \
             WHERE state = 0 AND recovery_point IS NOT NULL AND lease_until <= {now} \
             ORDER BY lease_until LIMIT $1 FOR UPDATE SKIP LOCKED"
        ),
        extend: format!(
            "UPDATE {t} SET lease_until = {now} + $1 \
             WHERE scope = $2 AND idem_key = $3 AND fence = $4 AND state = 0"
        ),
        // The outer condition is checked again on a row a lookup restarted meanwhile.
        // `ONLY`, as for the claims: migrate creates this table plain, where a ctid is one
        // row; on a table partitioned or inherited by hand it reaps nothing rather than the
        // rows at the same positions in other tables.
        reap: {
            let expired = format!(
                "expires_at < {now} AND (state <> 0 OR (lease_until < {now} AND recovery_point IS NULL))"
            );
            format!(
                "DELETE FROM ONLY {t} WHERE ctid = ANY(ARRAY( \
                 SELECT ctid FROM ONLY {t} WHERE {expired} LIMIT $1)) AND {expired}"
            )
        },
    }
}

/// Adds the recovery columns and the completer's index to a requests table made before them,
/// run by `migrate` after [`migration`] in its transaction only when the probe finds them
/// missing: an `ALTER TABLE` takes the table's strongest lock, which would queue every lookup
/// behind any transaction using the table, so a replica's start-up must not take it each time.
pub fn recovery_migration(r: &TableName) -> RecoveryMigration {
    let rname = r.table();
    RecoveryMigration {
        probe: format!(
            "SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass('{r}') \
             AND attname IN ('recovery_point', 'phase_state', 'attempts') AND NOT attisdropped"
        ),
        add: vec![
            format!(
                "ALTER TABLE {r} ADD COLUMN IF NOT EXISTS recovery_point text, \
                 ADD COLUMN IF NOT EXISTS phase_state bytea, \
                 ADD COLUMN IF NOT EXISTS attempts bigint NOT NULL DEFAULT 1"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {rname}_stuck ON {r} (lease_until) \
                 WHERE state = 0 AND recovery_point IS NOT NULL"
            ),
        ],
    }
}

/// What `migrate` runs inside one transaction, after taking [`MIGRATE_LOCK`] and checking the
/// claims table's shape ([`maintenance::shape_fits`]): the schemas, both tables (the claims
/// table partitioned as `partitioning` says, which its comment records), their indexes and
/// comments, one statement each.
pub fn migration(t: &TableName, r: &TableName, partitioning: Option<&Partitioning>) -> Vec<String> {
    let (name, rname) = (t.table(), r.table());
    let mut sql: Vec<String> = t
        .schema()
        .into_iter()
        .chain(r.schema())
        .map(|schema| format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
        .collect();
    match partitioning {
        Some(p) => sql.extend(maintenance::create_statements(t, p)),
        None => sql.extend([
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
        ]),
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
             state 0 in progress, 1 completed, 2 abandoned; lease_until and expires_at in \
             microseconds since the Unix epoch; recovery_point and phase_state: the last \
             committed phase boundary'"
        ),
    ]);
    sql
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(name: &str) -> TableName {
        TableName::new(name).expect("table")
    }

    #[test]
    fn partitioned_statements_name_the_key_and_prune_only_the_leaf_partitions() {
        let t = table("app.claims");
        let plain = claim_statements(&t, false);
        assert!(!plain.claim.contains("id_time"), "{}", plain.claim);
        assert!(plain.prune_all.starts_with("DELETE FROM ONLY app.claims "));
        let parted = claim_statements(&t, true);
        assert!(parted.claim.contains("$5") && parted.read_fingerprint.ends_with("id_time = $3"));
        assert!(
            parted
                .prune_all
                .contains("DELETE FROM ONLY app.claims_default ")
        );
        assert!(
            parted
                .prune_consumer
                .contains("DELETE FROM ONLY app.claims_undated ")
        );
        assert!(
            !parted.prune_all.contains("ONLY app.claims "),
            "{}",
            parted.prune_all
        );
    }

    #[test]
    fn the_migration_creates_schemas_once_per_table_and_records_the_partitioning() {
        let (t, r) = (table("a.claims"), table("b.requests"));
        let plain = migration(&t, &r, None);
        assert_eq!(plain[0], "CREATE SCHEMA IF NOT EXISTS a");
        assert_eq!(plain[1], "CREATE SCHEMA IF NOT EXISTS b");
        let p = Partitioning::uuid_v7();
        let parted = migration(&t, &r, Some(&p));
        assert!(
            parted
                .iter()
                .any(|s| s.contains("PARTITION BY RANGE (id_time)"))
        );
        let comment = parted
            .iter()
            .find(|s| s.starts_with("COMMENT ON TABLE a.claims"))
            .expect("comment");
        assert!(comment.contains(&p.record().to_string()), "{comment}");
    }
}
