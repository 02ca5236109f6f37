//! SQLite: the statements, migration and result-code table `idem-sql`'s SQLite store runs.
//! Times are bound by the store (this host's clock, the only host writing the file), so no
//! statement reads a clock of its own.

use idem_core::{ErrorKind, TableName};

use crate::outbox::{COLUMNS, SELECTED, dead_letter_table};
use crate::statements::{EnqueueStatement, OutboxParam as P, OutboxStatement, Placeholder};
use crate::{ClaimStatements, OutboxStatements, RecoveryMigration, RequestStatements};

/// SQLite has no practical limit; this bound keeps rows and the index reasonable.
pub const MAX_MESSAGE_ID_LEN: usize = 4096;

/// Begins a consumer's transaction, taking the write lock up front, so a concurrent duplicate
/// waits (up to the busy timeout) for the first claim instead of failing on a refused upgrade.
pub const BEGIN: &str = "BEGIN IMMEDIATE";

/// Begins an idempotent request's transaction: the write lock is taken by the handler's first
/// write, never held while the handler does anything else.
pub const REQUEST_BEGIN: &str = "BEGIN DEFERRED";

/// The claim statements for `t`, parameters numbered (`?1`…).
pub fn claim_statements(t: &TableName) -> ClaimStatements {
    ClaimStatements {
        claim: format!(
            "INSERT INTO {t} (consumer, message_id, fingerprint, processed_at) \
             VALUES (?1, ?2, ?3, ?4) ON CONFLICT (consumer, message_id) DO NOTHING"
        ),
        read_fingerprint: format!(
            "SELECT fingerprint FROM {t} WHERE consumer = ?1 AND message_id = ?2"
        ),
        prune_all: format!(
            "DELETE FROM {t} WHERE rowid IN \
             (SELECT rowid FROM {t} WHERE processed_at < ?1 - ?2 LIMIT ?3)"
        ),
        prune_consumer: format!(
            "DELETE FROM {t} WHERE rowid IN \
             (SELECT rowid FROM {t} WHERE processed_at < ?1 - ?2 AND consumer = ?3 LIMIT ?4)"
        ),
        stats: format!(
            "SELECT consumer, count(*), min(processed_at), max(processed_at) \
             FROM {t} GROUP BY consumer ORDER BY consumer"
        ),
        claim_many: format!("INSERT INTO {t} (consumer, message_id, fingerprint, processed_at) "),
        claim_many_tail: " ON CONFLICT (consumer, message_id) DO NOTHING RETURNING message_id"
            .to_owned(),
        read_fingerprints: String::new(),
    }
}

/// The request-record statements for `t`; `now` (host microseconds) is the last parameter.
pub fn request_statements(t: &TableName) -> RequestStatements {
    let recovery_cols = "scope, idem_key, fence, recovery_point, phase_state, attempts";
    RequestStatements {
        read: format!(
            "SELECT r.fingerprint, r.state, r.fence, r.lease_until, r.expires_at, n.now, \
             CASE WHEN r.fingerprint = ?1 AND r.state <> 0 THEN r.result END, \
             CASE WHEN r.recovery_point IS NULL THEN 0 ELSE 1 END \
             FROM (SELECT ?4 AS now) n LEFT JOIN {t} r ON r.scope = ?2 AND r.idem_key = ?3"
        ),
        insert: format!(
            "INSERT INTO {t} (scope, idem_key, fingerprint, state, fence, lease_until, expires_at, attempts) \
             VALUES (?1, ?2, ?3, 0, ?4, ?7 + ?5, ?7 + ?6, 1) ON CONFLICT (scope, idem_key) DO NOTHING"
        ),
        reset: format!(
            "UPDATE {t} SET fingerprint = ?1, state = 0, fence = fence + 1, lease_until = ?7 + ?2, \
             expires_at = ?7 + ?3, result = NULL, recovery_point = NULL, phase_state = NULL, \
             attempts = 1 \
             WHERE scope = ?4 AND idem_key = ?5 AND fence = ?6 AND expires_at <= ?7 \
             AND (state <> 0 OR (lease_until <= ?7 AND recovery_point IS NULL))"
        ),
        insert_at: format!(
            "INSERT INTO {t} (scope, idem_key, fingerprint, state, fence, lease_until, expires_at, \
             attempts, recovery_point, phase_state) \
             VALUES (?1, ?2, ?3, 0, ?4, ?9 + ?5, ?9 + ?6, 1, ?7, ?8) \
             ON CONFLICT (scope, idem_key) DO NOTHING"
        ),
        reset_at: format!(
            "UPDATE {t} SET fingerprint = ?1, state = 0, fence = fence + 1, lease_until = ?9 + ?2, \
             expires_at = ?9 + ?3, result = NULL, recovery_point = ?4, phase_state = ?5, \
             attempts = 1 \
             WHERE scope = ?6 AND idem_key = ?7 AND fence = ?8 AND expires_at <= ?9 \
             AND (state <> 0 OR (lease_until <= ?9 AND recovery_point IS NULL))"
        ),
        take_over: format!(
            "UPDATE {t} SET fence = fence + 1, lease_until = ?5 + ?1, attempts = attempts + 1 \
             WHERE scope = ?2 AND idem_key = ?3 AND fence = ?4 AND state = 0 AND lease_until <= ?5"
        ),
        complete: format!(
            "UPDATE {t} SET state = 1, result = ?1, expires_at = ?6 + ?2 \
             WHERE scope = ?3 AND idem_key = ?4 AND fence = ?5 AND state = 0"
        ),
        release: format!(
            "DELETE FROM {t} WHERE scope = ?1 AND idem_key = ?2 AND fence = ?3 AND state = 0 \
             AND recovery_point IS NULL"
        ),
        end_lease: format!(
            "UPDATE {t} SET lease_until = ?4 \
             WHERE scope = ?1 AND idem_key = ?2 AND fence = ?3 AND state = 0 \
             AND recovery_point IS NOT NULL"
        ),
        recovery: format!(
            "SELECT {recovery_cols} FROM {t} \
             WHERE scope = ?1 AND idem_key = ?2 AND fence = ?3 AND state = 0"
        ),
        advance: format!(
            "UPDATE {t} SET recovery_point = ?1, phase_state = ?2 \
             WHERE scope = ?3 AND idem_key = ?4 AND fence = ?5 AND state = 0"
        ),
        abandon: format!(
            "UPDATE {t} SET state = 2, result = ?1, expires_at = ?6 + ?2 \
             WHERE scope = ?3 AND idem_key = ?4 AND fence = ?5 AND state = 0"
        ),
        // Under `BEGIN IMMEDIATE`: one writer at a time, no row locks to skip.
        stuck: format!(
            "SELECT {recovery_cols} FROM {t} \
             WHERE state = 0 AND recovery_point IS NOT NULL AND lease_until <= ?2 \
             ORDER BY lease_until LIMIT ?1"
        ),
        extend: format!(
            "UPDATE {t} SET lease_until = ?5 + ?1 \
             WHERE scope = ?2 AND idem_key = ?3 AND fence = ?4 AND state = 0"
        ),
        reap: format!(
            "DELETE FROM {t} WHERE rowid IN (SELECT rowid FROM {t} \
             WHERE expires_at < ?2 \
             AND (state <> 0 OR (lease_until < ?2 AND recovery_point IS NULL)) LIMIT ?1)"
        ),
    }
}

/// Adds the recovery columns and the completer's index to a requests table made before them
/// (SQLite has no `ADD COLUMN IF NOT EXISTS`: the probe says whether they are there). Runs in
/// the migration's transaction.
pub fn recovery_migration(r: &TableName) -> RecoveryMigration {
    let rname = r.table();
    RecoveryMigration {
        probe: format!(
            "SELECT count(*) FROM pragma_table_info('{rname}') \
             WHERE name IN ('recovery_point', 'phase_state', 'attempts')"
        ),
        add: vec![
            format!("ALTER TABLE {r} ADD COLUMN recovery_point TEXT"),
            format!("ALTER TABLE {r} ADD COLUMN phase_state BLOB"),
            format!("ALTER TABLE {r} ADD COLUMN attempts INTEGER NOT NULL DEFAULT 1"),
            format!(
                "CREATE INDEX IF NOT EXISTS {rname}_stuck ON {r} (lease_until) \
                 WHERE state = 0 AND recovery_point IS NOT NULL"
            ),
        ],
    }
}

/// Both tables, run in one `BEGIN IMMEDIATE` transaction: concurrent starts take turns.
pub fn migration(t: &TableName, r: &TableName) -> Vec<String> {
    let (name, rname) = (t.table(), r.table());
    vec![
        // processed_at: microseconds since the Unix epoch.
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (
                consumer     TEXT    NOT NULL,
                message_id   BLOB    NOT NULL,
                fingerprint  BLOB    NOT NULL,
                processed_at INTEGER NOT NULL,
                PRIMARY KEY (consumer, message_id)
            )"
        ),
        format!("CREATE INDEX IF NOT EXISTS {name}_processed_at ON {t} (processed_at)"),
        // Idempotent-request records: state 0 in progress, 1 completed; lease_until and
        // expires_at in microseconds since the Unix epoch; result NULL while in progress.
        format!(
            "CREATE TABLE IF NOT EXISTS {r} (
                scope       BLOB    NOT NULL,
                idem_key    BLOB    NOT NULL,
                fingerprint BLOB    NOT NULL,
                state       INTEGER NOT NULL,
                fence       INTEGER NOT NULL,
                lease_until INTEGER NOT NULL,
                expires_at  INTEGER NOT NULL,
                result      BLOB,
                PRIMARY KEY (scope, idem_key)
            )"
        ),
        format!("CREATE INDEX IF NOT EXISTS {rname}_expires_at ON {r} (expires_at)"),
    ]
}

/// The outbox statements of table `o`, numbered (`?1`…) with this host's clock (`now`) bound
/// once where a statement uses it. The lease runs under `BEGIN IMMEDIATE`, one writer at a
/// time, so it needs no row locks.
pub fn outbox_statements(o: &TableName) -> OutboxStatements {
    let dl = dead_letter_table(o);
    let same_key = "e.destination = o.destination AND e.ordering_key = o.ordering_key \
                    AND e.sent_at IS NULL AND e.seq < o.seq";
    let list = |sql: String, binds: &[P], first| {
        OutboxStatement::with_list(sql, binds, Placeholder::Numbered, first, ")")
    };
    OutboxStatements {
        // The host's clock is ?1, bound once; the rows' placeholders follow it.
        enqueue: EnqueueStatement::new(
            format!(
                "INSERT INTO {o} (message_id, destination, ordering_key, payload, headers, \
                 created_at, available_at) VALUES "
            ),
            ", ?1, ?1".to_owned(),
            " ON CONFLICT (message_id) DO NOTHING".to_owned(),
            Placeholder::Numbered,
            &[P::Now],
        ),
        lease: OutboxStatement::new(
            format!(
                "SELECT {SELECTED}, (SELECT count(*) FROM {o} e WHERE {same_key}) \
                 FROM {o} o WHERE o.sent_at IS NULL AND o.available_at <= ?3 \
                 AND (o.leased_until IS NULL OR o.leased_until <= ?3 OR o.leased_by = ?1) \
                 AND (o.ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM {o} e WHERE {same_key} \
                 AND (e.available_at > ?3 OR (e.leased_until > ?3 AND e.leased_by <> ?1)))) \
                 ORDER BY o.seq LIMIT ?2"
            ),
            &[P::Relay, P::Limit, P::Now],
        ),
        lease_update: Some(list(
            format!("UPDATE {o} SET leased_by = ?1, leased_until = ?3 + ?2 WHERE seq IN ("),
            &[P::Relay, P::Lease, P::Now, P::Seqs],
            4,
        )),
        relay_begin: None,
        mark_sent: list(
            format!(
                "UPDATE {o} SET sent_at = ?2 WHERE leased_by = ?1 AND sent_at IS NULL \
                 AND seq IN ("
            ),
            &[P::Relay, P::Now, P::Seqs],
            3,
        ),
        release: OutboxStatement::new(
            format!(
                "UPDATE {o} SET attempts = attempts + 1, last_error = ?1, \
                 available_at = ?5 + ?2, leased_by = NULL, leased_until = NULL \
                 WHERE seq = ?3 AND leased_by = ?4 AND sent_at IS NULL"
            ),
            &[P::Error, P::RetryIn, P::Seq, P::Relay, P::Now],
        ),
        dead_letter_copy: OutboxStatement::new(
            format!(
                "INSERT INTO {dl} ({COLUMNS}, reason, dead_lettered_at) \
                 SELECT {COLUMNS}, ?1, ?4 FROM {o} \
                 WHERE seq = ?2 AND leased_by = ?3 AND sent_at IS NULL"
            ),
            &[P::Reason, P::Seq, P::Relay, P::Now],
        ),
        dead_letter_delete: OutboxStatement::new(
            format!("DELETE FROM {o} WHERE seq = ?1 AND leased_by = ?2 AND sent_at IS NULL"),
            &[P::Seq, P::Relay],
        ),
        purge_sent: OutboxStatement::new(
            format!(
                "DELETE FROM {o} WHERE seq IN \
                 (SELECT seq FROM {o} WHERE sent_at IS NOT NULL ORDER BY seq LIMIT ?1)"
            ),
            &[P::Limit],
        ),
        backlog: OutboxStatement::new(
            format!(
                "SELECT (SELECT count(*) FROM {o} WHERE sent_at IS NULL), \
                 (SELECT min(created_at) FROM {o} WHERE sent_at IS NULL), \
                 (SELECT count(*) FROM {o} WHERE sent_at IS NOT NULL), \
                 (SELECT count(*) FROM {dl}), ?1"
            ),
            &[P::Now],
        ),
        notify: None,
    }
}

/// The outbox table (`seq` an `AUTOINCREMENT` key, never reused after a purge, so a stale
/// relay's seq can never name a newer row) and its dead-letter table, with the partial
/// indexes the lease, the per-key check and the purge use.
pub fn outbox_migration(o: &TableName) -> Vec<String> {
    let (name, dl) = (o.table(), dead_letter_table(o));
    vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {o} (
                seq          INTEGER PRIMARY KEY AUTOINCREMENT,
                message_id   BLOB    NOT NULL UNIQUE,
                destination  TEXT    NOT NULL,
                ordering_key TEXT,
                payload      BLOB    NOT NULL,
                headers      TEXT    NOT NULL,
                created_at   INTEGER NOT NULL,
                attempts     INTEGER NOT NULL DEFAULT 0,
                last_error   TEXT,
                available_at INTEGER NOT NULL,
                leased_by    TEXT,
                leased_until INTEGER,
                sent_at      INTEGER
            )"
        ),
        format!("CREATE INDEX IF NOT EXISTS {name}_unsent ON {o} (seq) WHERE sent_at IS NULL"),
        format!(
            "CREATE INDEX IF NOT EXISTS {name}_key ON {o} (destination, ordering_key, seq) \
             WHERE sent_at IS NULL AND ordering_key IS NOT NULL"
        ),
        format!("CREATE INDEX IF NOT EXISTS {name}_sent ON {o} (seq) WHERE sent_at IS NOT NULL"),
        format!(
            "CREATE TABLE IF NOT EXISTS {dl} (
                seq              INTEGER PRIMARY KEY,
                message_id       BLOB    NOT NULL,
                destination      TEXT    NOT NULL,
                ordering_key     TEXT,
                payload          BLOB    NOT NULL,
                headers          TEXT    NOT NULL,
                created_at       INTEGER NOT NULL,
                attempts         INTEGER NOT NULL,
                last_error       TEXT,
                available_at     INTEGER NOT NULL,
                leased_by        TEXT,
                leased_until     INTEGER,
                sent_at          INTEGER,
                reason           TEXT    NOT NULL,
                dead_lettered_at INTEGER NOT NULL
            )"
        ),
    ]
}

/// What an SQLite result code means for a consumer (extended codes carry the primary code in
/// their low byte); `message` only where SQLite has no code of its own.
pub fn kind(code: u32, message: &str) -> ErrorKind {
    match code & 0xff {
        // SQLITE_BUSY, SQLITE_LOCKED: another writer holds the lock.
        5 | 6 => ErrorKind::Transient,
        // SQLITE_READONLY (a read-only file or mount), SQLITE_IOERR, SQLITE_FULL (disk or
        // max_page_count), SQLITE_CANTOPEN: the database cannot take writes now.
        8 | 10 | 13 | 14 => ErrorKind::Unavailable,
        // SQLITE_PERM, SQLITE_AUTH; SQLITE_CORRUPT, SQLITE_NOTADB: a damaged file is for an
        // operator, not for retries.
        3 | 23 | 11 | 26 => ErrorKind::Misconfigured,
        // SQLITE_ERROR is every SQL error at once; SQLite has no separate code for a missing
        // table or column, so the prefix of its message is the only signal there is.
        1 if message.starts_with("no such table")
            || message.starts_with("no such column")
            || message.starts_with("no such function") =>
        {
            ErrorKind::Misconfigured
        }
        _ => ErrorKind::Store,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_map_by_their_primary_byte() {
        assert_eq!(kind(5, ""), ErrorKind::Transient);
        assert_eq!(kind(517, ""), ErrorKind::Transient, "SQLITE_BUSY_SNAPSHOT");
        assert_eq!(kind(13, ""), ErrorKind::Unavailable);
        assert_eq!(kind(1, "no such table: x"), ErrorKind::Misconfigured);
        assert_eq!(kind(1, "syntax error"), ErrorKind::Store);
        assert_eq!(
            kind(2067, ""),
            ErrorKind::Store,
            "a unique violation is no outage"
        );
    }

    #[test]
    fn outbox_lists_follow_the_numbered_parameters() {
        let s = outbox_statements(&TableName::new("outbox").expect("table"));
        let update = s.lease_update.as_ref().expect("two-statement lease");
        assert!(update.text(2).ends_with("seq IN (?4, ?5)"));
        assert!(s.mark_sent.text(1).ends_with("seq IN (?3)"));
        assert!(!s.lease.sql.contains("FOR UPDATE"));
        // The clock is ?1 for every row; the rows' values follow it.
        let two = s.enqueue.text(2);
        assert!(
            two.contains("VALUES (?2, ?3, ?4, ?5, ?6, ?1, ?1), (?7, ?8, ?9, ?10, ?11, ?1, ?1)"),
            "{two}"
        );
    }

    #[test]
    fn request_statements_bind_now_last() {
        let sql = request_statements(&TableName::default_requests());
        // read takes three parameters then now; insert six then now.
        assert!(sql.read.contains("?4 AS now"), "{}", sql.read);
        assert!(sql.insert.contains("?7 + ?5"), "{}", sql.insert);
        assert!(
            !sql.release.contains("?4"),
            "release takes no now: {}",
            sql.release
        );
    }
}
