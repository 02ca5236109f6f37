//! MySQL / MariaDB (InnoDB): the statements, migration and error-number table `idem-sql`'s
//! MySQL store runs.
//!
//! The claim is `INSERT … ON DUPLICATE KEY UPDATE duplicates = duplicates + 1`: one statement
//! that cannot race, and — unlike `INSERT IGNORE` — it does not turn truncation or other errors
//! into warnings. The counter is what makes the result readable: connected with
//! `CLIENT_FOUND_ROWS`, a no-op update reports 1 affected row, the same as an insert; a real
//! increment reports 2. (The increment persists only when a batch containing the duplicate
//! commits; a lone duplicate rolls back, so the column is not a redelivery count.) A
//! concurrent duplicate waits on the first transaction's record lock; the increment then locks
//! the existing row and makes it visible to the fingerprint read that follows.
//!
//! Request records are all binary columns (`BINARY`/`VARBINARY`/`LONGBLOB`, never a collated
//! text column, whose comparison would fold case). Their insert is a plain `INSERT` whose
//! duplicate-key error means a lost race (no `ON DUPLICATE KEY UPDATE` no-op: under
//! `CLIENT_FOUND_ROWS` it reports one row, like an insert). Every guarded `UPDATE` changes a
//! column anyway (the state, the fence or the lease), so its count is right under either flag.

use idem_core::request_record::MAX_REQUEST_KEY_LEN;
use idem_core::{ErrorKind, TableName};

use crate::outbox::{COLUMNS, dead_letter_table};
use crate::statements::{EnqueueStatement, OutboxParam as P, OutboxStatement, Placeholder};
use crate::{ClaimStatements, OutboxStatements, RecoveryMigration, RequestStatements};

/// The server's clock in `processed_at` units: microseconds since the Unix epoch, computed on
/// UTC so the session's time zone (and its daylight-saving jumps) cannot shift it.
/// `UTC_TIMESTAMP(6)` is fixed for the whole statement.
pub const SERVER_NOW: &str = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))";

/// Longest message ID the `VARBINARY(1024)` column holds.
pub const MAX_MESSAGE_ID_LEN: usize = 1024;

/// Begins a transaction.
pub const BEGIN: &str = "BEGIN";

/// The claim statements for `t`. Parameters are `?`, bound in the order they appear.
pub fn claim_statements(t: &TableName) -> ClaimStatements {
    ClaimStatements {
        claim: format!(
            "INSERT INTO {t} (consumer, message_id, fingerprint, processed_at) \
             VALUES (?, ?, ?, COALESCE(?, {SERVER_NOW})) \
             ON DUPLICATE KEY UPDATE duplicates = duplicates + 1"
        ),
        read_fingerprint: format!(
            "SELECT fingerprint FROM {t} WHERE consumer = ? AND message_id = ?"
        ),
        prune_all: format!(
            "DELETE FROM {t} WHERE processed_at < COALESCE(?, {SERVER_NOW}) - ? LIMIT ?"
        ),
        prune_consumer: format!(
            "DELETE FROM {t} WHERE processed_at < COALESCE(?, {SERVER_NOW}) - ? \
             AND consumer = ? LIMIT ?"
        ),
        stats: format!(
            "SELECT CAST(consumer AS CHAR), CAST(count(*) AS SIGNED), min(processed_at), \
             max(processed_at) FROM {t} GROUP BY consumer ORDER BY consumer"
        ),
        claim_many: format!("INSERT INTO {t} (consumer, message_id, fingerprint, processed_at) "),
        claim_many_tail: " ON DUPLICATE KEY UPDATE duplicates = duplicates + 1".to_owned(),
        // Every row of a batch is locked by its transaction once claimed: inserted ones still
        // have duplicates = 0, pre-existing ones were just incremented.
        read_fingerprints: format!(
            "SELECT message_id, fingerprint FROM {t} WHERE duplicates > 0 AND consumer = "
        ),
    }
}

/// The prefix of every statement that takes a request record (insert, reset, take-over):
/// MariaDB's per-statement lock-wait timeout of zero, so that a record another transaction
/// holds uncommitted — a one-transaction execution's insert or update, which a plain
/// statement would wait for up to `innodb_lock_wait_timeout` — fails the statement at once
/// with error 1205 (read as "in progress") instead. MariaDB only (10.3+): MySQL has no
/// `SET STATEMENT`.
pub const NOWAIT: &str = "SET STATEMENT innodb_lock_wait_timeout = 0 FOR ";

/// The request-record statements for `t`, on the server's clock. `?` are bound in the order
/// they appear, which is the order listed on [`RequestStatements`].
pub fn request_statements(t: &TableName) -> RequestStatements {
    let now = SERVER_NOW;
    let recovery_cols = "scope, idem_key, fence, recovery_point, phase_state, attempts";
    RequestStatements {
        read: format!(
            "SELECT r.fingerprint, r.state, r.fence, r.lease_until, r.expires_at, n.now, \
             CASE WHEN r.fingerprint = ? AND r.state <> 0 THEN r.result END, \
             CAST(CASE WHEN r.recovery_point IS NULL THEN 0 ELSE 1 END AS SIGNED) \
             FROM (SELECT {now} AS now) n LEFT JOIN {t} r ON r.scope = ? AND r.idem_key = ?"
        ),
        insert: format!(
            "{NOWAIT}INSERT INTO {t} (scope, idem_key, fingerprint, state, fence, lease_until, expires_at, attempts) \
             VALUES (?, ?, ?, 0, ?, {now} + ?, {now} + ?, 1)"
        ),
        reset: format!(
            "{NOWAIT}UPDATE {t} SET fingerprint = ?, state = 0, fence = fence + 1, \
             lease_until = {now} + ?, expires_at = {now} + ?, result = NULL, \
             recovery_point = NULL, phase_state = NULL, attempts = 1 \
             WHERE scope = ? AND idem_key = ? AND fence = ? AND expires_at <= {now} \
             AND (state <> 0 OR (lease_until <= {now} AND recovery_point IS NULL))"
        ),
        insert_at: format!(
            "{NOWAIT}INSERT INTO {t} (scope, idem_key, fingerprint, state, fence, lease_until, expires_at, \
             attempts, recovery_point, phase_state) \
             VALUES (?, ?, ?, 0, ?, {now} + ?, {now} + ?, 1, ?, ?)"
        ),
        reset_at: format!(
            "{NOWAIT}UPDATE {t} SET fingerprint = ?, state = 0, fence = fence + 1, \
             lease_until = {now} + ?, expires_at = {now} + ?, result = NULL, \
             recovery_point = ?, phase_state = ?, attempts = 1 \
             WHERE scope = ? AND idem_key = ? AND fence = ? AND expires_at <= {now} \
             AND (state <> 0 OR (lease_until <= {now} AND recovery_point IS NULL))"
        ),
        take_over: format!(
            "{NOWAIT}UPDATE {t} SET fence = fence + 1, lease_until = {now} + ?, attempts = attempts + 1 \
             WHERE scope = ? AND idem_key = ? AND fence = ? AND state = 0 \
             AND lease_until <= {now}"
        ),
        complete: format!(
            "UPDATE {t} SET state = 1, result = ?, expires_at = {now} + ? \
             WHERE scope = ? AND idem_key = ? AND fence = ? AND state = 0"
        ),
        release: format!(
            "DELETE FROM {t} WHERE scope = ? AND idem_key = ? AND fence = ? AND state = 0 \
             AND recovery_point IS NULL"
        ),
        end_lease: format!(
            "UPDATE {t} SET lease_until = {now} \
             WHERE scope = ? AND idem_key = ? AND fence = ? AND state = 0 \
             AND recovery_point IS NOT NULL"
        ),
        recovery: format!(
            "SELECT {recovery_cols} FROM {t} \
             WHERE scope = ? AND idem_key = ? AND fence = ? AND state = 0"
        ),
        advance: format!(
            "UPDATE {t} SET recovery_point = ?, phase_state = ? \
             WHERE scope = ? AND idem_key = ? AND fence = ? AND state = 0"
        ),
        abandon: format!(
            "UPDATE {t} SET state = 2, result = ?, expires_at = {now} + ? \
             WHERE scope = ? AND idem_key = ? AND fence = ? AND state = 0"
        ),
        stuck: format!(
            "SELECT {recovery_cols} FROM {t} \
             WHERE state = 0 AND recovery_point IS NOT NULL AND lease_until <= {now} \
             ORDER BY lease_until LIMIT ? FOR UPDATE SKIP LOCKED"
        ),
        extend: format!(
            "UPDATE {t} SET lease_until = {now} + ? \
             WHERE scope = ? AND idem_key = ? AND fence = ? AND state = 0"
        ),
        reap: format!(
            "DELETE FROM {t} WHERE expires_at < {now} \
             AND (state <> 0 OR (lease_until < {now} AND recovery_point IS NULL)) LIMIT ?"
        ),
    }
}

/// Adds the recovery columns and the completer's index to a requests table made before them,
/// in one `ALTER TABLE` (MySQL has no `ADD COLUMN IF NOT EXISTS`, and its DDL commits on its
/// own: one statement leaves no half-migrated table).
pub fn recovery_migration(r: &TableName) -> RecoveryMigration {
    let rname = r.table();
    let schema = r
        .schema()
        .map_or_else(|| "DATABASE()".to_owned(), |s| format!("'{s}'"));
    RecoveryMigration {
        probe: format!(
            "SELECT count(*) FROM information_schema.columns \
             WHERE table_schema = {schema} AND table_name = '{rname}' \
             AND column_name IN ('recovery_point', 'phase_state', 'attempts')"
        ),
        add: vec![format!(
            "ALTER TABLE {r} ADD COLUMN recovery_point VARCHAR(255) NULL \
             COMMENT 'the last committed phase boundary', \
             ADD COLUMN phase_state LONGBLOB NULL, \
             ADD COLUMN attempts BIGINT NOT NULL DEFAULT 1, \
             ADD KEY {rname}_stuck (state, lease_until)"
        )],
    }
}

/// Both tables. MySQL DDL commits implicitly, so there is no transaction to hold: each
/// statement runs alone, and `CREATE … IF NOT EXISTS` is atomic per statement, which is enough
/// for concurrent starts.
pub fn migration(t: &TableName, r: &TableName) -> Vec<String> {
    let (name, rname) = (t.table(), r.table());
    vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (
            consumer     VARCHAR(100) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
            message_id   VARBINARY({MAX_MESSAGE_ID_LEN}) NOT NULL,
            fingerprint  BINARY(32)   NOT NULL,
            processed_at BIGINT       NOT NULL COMMENT 'microseconds since the Unix epoch',
            duplicates   INT UNSIGNED NOT NULL DEFAULT 0,
            PRIMARY KEY (consumer, message_id),
            KEY {name}_processed_at (processed_at)
        ) ENGINE = InnoDB"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {r} (
            scope       BINARY(32) NOT NULL,
            idem_key    VARBINARY({MAX_REQUEST_KEY_LEN}) NOT NULL,
            fingerprint BINARY(32) NOT NULL,
            state       SMALLINT   NOT NULL COMMENT '0 in progress, 1 completed, 2 abandoned',
            fence       BIGINT     NOT NULL,
            lease_until BIGINT     NOT NULL COMMENT 'microseconds since the Unix epoch',
            expires_at  BIGINT     NOT NULL COMMENT 'microseconds since the Unix epoch',
            result      LONGBLOB   NULL,
            PRIMARY KEY (scope, idem_key),
            KEY {rname}_expires_at (expires_at)
        ) ENGINE = InnoDB"
        ),
    ]
}

/// The outbox statements of table `o`, on the server's clock. A lease selects `FOR UPDATE SKIP
/// LOCKED` (MySQL 8, MariaDB 10.6) in a short transaction and leases there; enqueue is
/// `INSERT … ON DUPLICATE KEY UPDATE message_id = message_id`, a no-op on an ID already there
/// that — unlike `INSERT IGNORE` — turns no other error into a warning. Positional `?`: a
/// value used twice is bound twice (see each statement's `binds`).
pub fn outbox_statements(o: &TableName) -> OutboxStatements {
    let now = SERVER_NOW;
    // The text columns converted to a collation without the binary flag, which `utf8mb4_bin`
    // carries on the wire and drivers (sqlx) then refuse to read as text; the values are
    // unchanged.
    let selected = "o.seq, o.message_id, CONVERT(o.destination USING utf8mb4), \
                    CONVERT(o.ordering_key USING utf8mb4), o.payload, \
                    CONVERT(o.headers USING utf8mb4), o.attempts, o.created_at";
    let dl = dead_letter_table(o);
    let same_key = "e.destination = o.destination AND e.ordering_key = o.ordering_key \
                    AND e.sent_at IS NULL AND e.seq < o.seq";
    let list = |sql: String, binds: &[P]| {
        OutboxStatement::with_list(sql, binds, Placeholder::Positional, 0, ")")
    };
    OutboxStatements {
        enqueue: EnqueueStatement::new(
            format!(
                "INSERT INTO {o} (message_id, destination, ordering_key, payload, headers, \
                 created_at, available_at) VALUES "
            ),
            format!(", {now}, {now}"),
            " ON DUPLICATE KEY UPDATE message_id = message_id".to_owned(),
            Placeholder::Positional,
            &[],
        ),
        lease: OutboxStatement::new(
            format!(
                "SELECT {selected}, CAST((SELECT count(*) FROM {o} e WHERE {same_key}) AS SIGNED) \
                 FROM {o} o WHERE o.sent_at IS NULL AND o.available_at <= {now} \
                 AND (o.leased_until IS NULL OR o.leased_until <= {now} OR o.leased_by = ?) \
                 AND (o.ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM {o} e WHERE {same_key} \
                 AND (e.available_at > {now} OR (e.leased_until > {now} AND e.leased_by <> ?)))) \
                 ORDER BY o.seq LIMIT ? FOR UPDATE SKIP LOCKED"
            ),
            &[P::Relay, P::Relay, P::Limit],
        ),
        lease_update: Some(list(
            format!("UPDATE {o} SET leased_by = ?, leased_until = {now} + ? WHERE seq IN ("),
            &[P::Relay, P::Lease, P::Seqs],
        )),
        relay_begin: None,
        mark_sent: list(
            format!(
                "UPDATE {o} SET sent_at = {now} WHERE leased_by = ? AND sent_at IS NULL \
                 AND seq IN ("
            ),
            &[P::Relay, P::Seqs],
        ),
        release: OutboxStatement::new(
            format!(
                "UPDATE {o} SET attempts = attempts + 1, last_error = ?, \
                 available_at = {now} + ?, leased_by = NULL, leased_until = NULL \
                 WHERE seq = ? AND leased_by = ? AND sent_at IS NULL"
            ),
            &[P::Error, P::RetryIn, P::Seq, P::Relay],
        ),
        dead_letter_copy: OutboxStatement::new(
            format!(
                "INSERT INTO {dl} ({COLUMNS}, reason, dead_lettered_at) \
                 SELECT {COLUMNS}, ?, {now} FROM {o} \
                 WHERE seq = ? AND leased_by = ? AND sent_at IS NULL"
            ),
            &[P::Reason, P::Seq, P::Relay],
        ),
        dead_letter_delete: OutboxStatement::new(
            format!("DELETE FROM {o} WHERE seq = ? AND leased_by = ? AND sent_at IS NULL"),
            &[P::Seq, P::Relay],
        ),
        // No ORDER BY: the (sent_at, seq) index finds sent rows; which ones go first does
        // not matter.
        purge_sent: OutboxStatement::new(
            format!("DELETE FROM {o} WHERE sent_at IS NOT NULL LIMIT ?"),
            &[P::Limit],
        ),
        backlog: OutboxStatement::new(
            format!(
                "SELECT CAST((SELECT count(*) FROM {o} WHERE sent_at IS NULL) AS SIGNED), \
                 (SELECT min(created_at) FROM {o} WHERE sent_at IS NULL), \
                 CAST((SELECT count(*) FROM {o} WHERE sent_at IS NOT NULL) AS SIGNED), \
                 CAST((SELECT count(*) FROM {dl}) AS SIGNED), {now}"
            ),
            &[],
        ),
        notify: None,
    }
}

/// The outbox table and its dead-letter table, each statement atomic on its own (as
/// [`migration`]). Text columns are `utf8mb4_bin`: every string a message carries, compared
/// byte for byte; the message ID is the claims table's `VARBINARY`.
pub fn outbox_migration(o: &TableName) -> Vec<String> {
    let (name, dl) = (o.table(), dead_letter_table(o));
    let text = "CHARACTER SET utf8mb4 COLLATE utf8mb4_bin";
    let micros = "COMMENT 'microseconds since the Unix epoch'";
    vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {o} (
            seq          BIGINT NOT NULL AUTO_INCREMENT,
            message_id   VARBINARY({MAX_MESSAGE_ID_LEN}) NOT NULL,
            destination  VARCHAR(255) {text} NOT NULL,
            ordering_key VARCHAR(255) {text} NULL,
            payload      LONGBLOB NOT NULL,
            headers      LONGTEXT {text} NOT NULL COMMENT 'JSON array of [name, value] pairs',
            created_at   BIGINT NOT NULL {micros},
            attempts     BIGINT NOT NULL DEFAULT 0,
            last_error   TEXT {text} NULL,
            available_at BIGINT NOT NULL {micros},
            leased_by    VARCHAR(255) {text} NULL,
            leased_until BIGINT NULL {micros},
            sent_at      BIGINT NULL {micros},
            PRIMARY KEY (seq),
            UNIQUE KEY {name}_message_id (message_id),
            KEY {name}_sent_seq (sent_at, seq),
            KEY {name}_key (destination, ordering_key, seq)
        ) ENGINE = InnoDB COMMENT = 'idem outbox: one row per outgoing message'"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {dl} (
            seq              BIGINT NOT NULL,
            message_id       VARBINARY({MAX_MESSAGE_ID_LEN}) NOT NULL,
            destination      VARCHAR(255) {text} NOT NULL,
            ordering_key     VARCHAR(255) {text} NULL,
            payload          LONGBLOB NOT NULL,
            headers          LONGTEXT {text} NOT NULL,
            created_at       BIGINT NOT NULL {micros},
            attempts         BIGINT NOT NULL,
            last_error       TEXT {text} NULL,
            available_at     BIGINT NOT NULL,
            leased_by        VARCHAR(255) {text} NULL,
            leased_until     BIGINT NULL,
            sent_at          BIGINT NULL,
            reason           TEXT {text} NOT NULL,
            dead_lettered_at BIGINT NOT NULL {micros},
            PRIMARY KEY (seq)
        ) ENGINE = InnoDB COMMENT = 'idem outbox dead letters'"
        ),
    ]
}

/// What a MySQL / MariaDB server error number means for a consumer.
pub fn kind(number: u16) -> ErrorKind {
    match number {
        // 1213 deadlock, 1205 lock wait timeout, 1020 record changed (snapshot conflict),
        // 3024 / 1969 statement time limit (MySQL / MariaDB).
        1213 | 1205 | 1020 | 3024 | 1969 => ErrorKind::Transient,
        // 1290 running with --read-only, 1792 read-only transaction, 1836 read-only mode;
        // 1021 disk full, 1114 table full; 1040 too many connections, 1203 / 1226 per-user
        // connection limits; 1037 / 1038 / 1041 out of memory; 1053 server shutdown;
        // 1927 connection killed, 2006 server gone away, 2013 lost connection mid-query,
        // 1158–1161 network read/write errors.
        1290
        | 1792
        | 1836
        | 1021
        | 1114
        | 1040
        | 1203
        | 1226
        | 1037
        | 1038
        | 1041
        | 1053
        | 1927
        | 2006
        | 2013
        | 1158..=1161 => ErrorKind::Unavailable,
        // 1044 / 1045 / 1142 / 1143 / 1227 / 1370 access denied; 1046 no database selected,
        // 1049 unknown database, 1054 unknown column, 1064 SQL syntax, 1109 unknown table,
        // 1146 no such table, 1305 no such function or procedure.
        1044 | 1045 | 1142 | 1143 | 1227 | 1370 | 1046 | 1049 | 1054 | 1064 | 1109 | 1146
        | 1305 => ErrorKind::Misconfigured,
        _ => ErrorKind::Store,
    }
}

/// Error numbers that end the session under a running statement: 1927 connection killed
/// (`KILL`), 2006 server gone away, 2013 lost connection mid-query, 1158–1161 network
/// read/write errors, 1053 server shutdown. [`kind`] calls them outages; under a handler's
/// statement they are [`ErrorKind::ConnectionLost`].
pub fn connection_lost(number: u16) -> bool {
    matches!(number, 1927 | 2006 | 2013 | 1158..=1161 | 1053)
}

/// Error numbers that say the server takes no writes on this connection: 1290 running with
/// `--read-only` (`super_read_only`), 1792 a read-only transaction, 1836 read-only mode.
pub fn read_only(number: u16) -> bool {
    matches!(number, 1290 | 1792 | 1836)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::statements::ENQUEUE_ROW;

    #[test]
    fn lost_sessions_and_read_only_servers_are_outages() {
        for n in [1927, 2006, 2013, 1158, 1161, 1053, 1290, 1792, 1836] {
            assert_eq!(kind(n), ErrorKind::Unavailable, "{n}");
        }
        assert!(connection_lost(2013) && !connection_lost(1290) && !connection_lost(1213));
        assert!(read_only(1290) && !read_only(2013));
        assert_eq!(kind(1213), ErrorKind::Transient);
        assert_eq!(kind(1146), ErrorKind::Misconfigured);
        assert_eq!(kind(1062), ErrorKind::Store, "a duplicate key is no outage");
    }

    #[test]
    fn the_batch_claim_is_a_head_and_a_tail_around_the_rows() {
        let t = TableName::new("app.claims").expect("table");
        let sql = claim_statements(&t);
        assert!(
            sql.claim_many.ends_with("processed_at) "),
            "{}",
            sql.claim_many
        );
        assert_eq!(
            sql.claim_many_tail,
            " ON DUPLICATE KEY UPDATE duplicates = duplicates + 1"
        );
        assert!(sql.claim.ends_with(&sql.claim_many_tail), "{}", sql.claim);
        assert_eq!(migration(&t, &TableName::default_requests()).len(), 2);
    }

    #[test]
    fn outbox_statements_bind_a_repeated_value_twice() {
        let s = outbox_statements(&TableName::new("outbox").expect("table"));
        let marks = |sql: &str| sql.matches('?').count();
        assert_eq!(marks(&s.lease.sql), s.lease.binds.len());
        assert_eq!(marks(&s.release.sql), s.release.binds.len());
        assert!(s.mark_sent.text(2).ends_with("seq IN (?, ?)"));
        assert!(
            s.enqueue
                .text(2)
                .ends_with("ON DUPLICATE KEY UPDATE message_id = message_id")
        );
        assert_eq!(marks(&s.enqueue.text(3)), 3 * ENQUEUE_ROW.len());
        assert_eq!(
            outbox_migration(&TableName::new("outbox").expect("table")).len(),
            2
        );
    }
}
