//! PostgreSQL's outbox: the statements and migration both PostgreSQL stores run, so that one
//! store's relay leases what the other's handlers enqueued.
//!
//! A lease selects its rows `FOR UPDATE OF o SKIP LOCKED` in a short transaction and leases
//! them there: two relays never wait for each other and never take the same row. Enqueue is
//! `INSERT … ON CONFLICT (message_id) DO NOTHING`, which waits for a concurrent uncommitted
//! insert of the same ID and then inserts nothing if it committed. `created_at` is the
//! enqueuing transaction's start (`now()`), the relay's times the statement's.

use idem_core::TableName;
use sha2::Digest as _;

use super::{SERVER_NOW, STATEMENT_NOW};
use crate::outbox::{COLUMNS, SELECTED, dead_letter_table};
use crate::statements::{
    EnqueueStatement, OutboxParam as P, OutboxStatement, OutboxStatements, Placeholder,
};

/// The `LISTEN` channel on which enqueuing transactions notify relays of table `o` at commit:
/// the table's name as the store spells it, or, past PostgreSQL's 63-byte identifier limit,
/// `idem_outbox_` and a digest of it. A transaction that enqueues several times notifies once
/// (PostgreSQL folds identical notifications of one transaction).
pub fn outbox_channel(o: &TableName) -> String {
    let name = o.to_string();
    if name.len() <= 63 {
        return name;
    }
    let digest = sha2::Sha256::digest(name.as_bytes());
    format!("idem_outbox_{}", &idem_core::hex::encode(&digest)[..32])
}

/// The outbox statements of table `o` (spelled as the store resolves it: lower case).
pub fn outbox_statements(o: &TableName) -> OutboxStatements {
    let now = STATEMENT_NOW;
    let dl = dead_letter_table(o);
    let same_key = "e.destination = o.destination AND e.ordering_key = o.ordering_key \
                    AND e.sent_at IS NULL AND e.seq < o.seq";
    let list = |sql: String, binds: &[P], first| {
        OutboxStatement::with_list(sql, binds, Placeholder::Dollar, first, ")")
    };
    OutboxStatements {
        enqueue: EnqueueStatement::new(
            format!(
                "INSERT INTO {o} (message_id, destination, ordering_key, payload, headers, \
                 created_at, available_at) VALUES "
            ),
            format!(", {SERVER_NOW}, {SERVER_NOW}"),
            " ON CONFLICT (message_id) DO NOTHING".to_owned(),
            Placeholder::Dollar,
            &[],
        ),
        lease_select: OutboxStatement::new(
            format!(
                "SELECT {SELECTED}, (SELECT count(*) FROM {o} e WHERE {same_key}) \
                 FROM {o} o WHERE o.sent_at IS NULL AND o.available_at <= {now} \
                 AND (o.leased_until IS NULL OR o.leased_until <= {now} OR o.leased_by = $1) \
                 AND (o.ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM {o} e WHERE {same_key} \
                 AND (e.available_at > {now} OR (e.leased_until > {now} AND e.leased_by <> $1)))) \
                 ORDER BY o.seq LIMIT $2 FOR UPDATE OF o SKIP LOCKED"
            ),
            &[P::Relay, P::Limit],
        ),
        lease_update: list(
            format!("UPDATE {o} SET leased_by = $1, leased_until = {now} + $2 WHERE seq IN ("),
            &[P::Relay, P::Lease, P::Seqs],
            3,
        ),
        mark_sent: list(
            format!(
                "UPDATE {o} SET sent_at = {now} WHERE leased_by = $1 AND sent_at IS NULL \
                 AND seq IN ("
            ),
            &[P::Relay, P::Seqs],
            2,
        ),
        release: OutboxStatement::new(
            format!(
                "UPDATE {o} SET attempts = attempts + 1, last_error = $1, \
                 available_at = {now} + $2, leased_by = NULL, leased_until = NULL \
                 WHERE seq = $3 AND leased_by = $4 AND sent_at IS NULL"
            ),
            &[P::Error, P::RetryIn, P::Seq, P::Relay],
        ),
        dead_letter_copy: OutboxStatement::new(
            format!(
                "INSERT INTO {dl} ({COLUMNS}, reason, dead_lettered_at) \
                 SELECT {COLUMNS}, $1, {now} FROM {o} \
                 WHERE seq = $2 AND leased_by = $3 AND sent_at IS NULL"
            ),
            &[P::Reason, P::Seq, P::Relay],
        ),
        dead_letter_delete: OutboxStatement::new(
            format!("DELETE FROM {o} WHERE seq = $1 AND leased_by = $2 AND sent_at IS NULL"),
            &[P::Seq, P::Relay],
        ),
        purge_sent: OutboxStatement::new(
            format!(
                "DELETE FROM {o} WHERE seq = ANY(ARRAY( \
                 SELECT seq FROM {o} WHERE sent_at IS NOT NULL ORDER BY seq LIMIT $1))"
            ),
            &[P::Limit],
        ),
        backlog: OutboxStatement::new(
            format!(
                "SELECT (SELECT count(*) FROM {o} WHERE sent_at IS NULL), \
                 (SELECT min(created_at) FROM {o} WHERE sent_at IS NULL), \
                 (SELECT count(*) FROM {o} WHERE sent_at IS NOT NULL), \
                 (SELECT count(*) FROM {dl}), {now}"
            ),
            &[],
        ),
        // pg_notify rather than NOTIFY: the channel is a string, any table name fits.
        notify: Some(OutboxStatement::new(
            format!("SELECT pg_notify('{}', '')", outbox_channel(o)),
            &[],
        )),
    }
}

/// The outbox table and its dead-letter table, their indexes and comments: run by `migrate`
/// in the same transaction, under the same advisory lock, as the claims tables.
pub fn outbox_migration(o: &TableName) -> Vec<String> {
    let (name, dl) = (o.table(), dead_letter_table(o));
    let mut sql: Vec<String> = o
        .schema()
        .map(|schema| format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
        .into_iter()
        .collect();
    sql.extend([
        format!(
            "CREATE TABLE IF NOT EXISTS {o} (
                seq          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                message_id   bytea  NOT NULL UNIQUE,
                destination  text   NOT NULL,
                ordering_key text,
                payload      bytea  NOT NULL,
                headers      text   NOT NULL,
                created_at   bigint NOT NULL,
                attempts     bigint NOT NULL DEFAULT 0,
                last_error   text,
                available_at bigint NOT NULL,
                leased_by    text,
                leased_until bigint,
                sent_at      bigint
            )"
        ),
        // The lease walks unsent rows by seq; the per-key check looks up a key's earlier
        // unsent rows; the purge finds sent rows. Partial, so each stays the size of what it
        // serves.
        format!("CREATE INDEX IF NOT EXISTS {name}_unsent ON {o} (seq) WHERE sent_at IS NULL"),
        format!(
            "CREATE INDEX IF NOT EXISTS {name}_key ON {o} (destination, ordering_key, seq) \
             WHERE sent_at IS NULL AND ordering_key IS NOT NULL"
        ),
        format!("CREATE INDEX IF NOT EXISTS {name}_sent ON {o} (seq) WHERE sent_at IS NOT NULL"),
        format!(
            "COMMENT ON TABLE {o} IS 'idem outbox: one row per outgoing message, published by a \
             relay; headers a JSON array of [name, value] pairs; times in microseconds since \
             the Unix epoch'"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {dl} (
                seq              bigint PRIMARY KEY,
                message_id       bytea  NOT NULL,
                destination      text   NOT NULL,
                ordering_key     text,
                payload          bytea  NOT NULL,
                headers          text   NOT NULL,
                created_at       bigint NOT NULL,
                attempts         bigint NOT NULL,
                last_error       text,
                available_at     bigint NOT NULL,
                leased_by        text,
                leased_until     bigint,
                sent_at          bigint,
                reason           text   NOT NULL,
                dead_lettered_at bigint NOT NULL
            )"
        ),
        format!(
            "COMMENT ON TABLE {dl} IS 'idem outbox dead letters: rows the broker refused for \
             good, with the reason; times in microseconds since the Unix epoch'"
        ),
    ]);
    sql
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_are_numbered_after_the_listed_parameters() {
        let s = outbox_statements(&TableName::new("app.outbox").expect("table"));
        assert_eq!(s.lease_update.binds, vec![P::Relay, P::Lease, P::Seqs]);
        assert!(
            s.lease_update
                .text(3)
                .ends_with("WHERE seq IN ($3, $4, $5)"),
            "{}",
            s.lease_update.text(3)
        );
        assert!(s.mark_sent.text(1).ends_with("seq IN ($2)"));
        assert!(s.lease_select.sql.contains("FOR UPDATE OF o SKIP LOCKED"));
        assert_eq!(s.release.text(9), s.release.sql, "no list, no change");
        let two = s.enqueue.text(2);
        assert!(
            two.contains("VALUES ($1, $2, $3, $4, $5, ")
                && two.contains("), ($6, $7, $8, $9, $10, ")
                && two.ends_with(") ON CONFLICT (message_id) DO NOTHING"),
            "{two}"
        );
        let m = outbox_migration(&TableName::new("app.outbox").expect("table"));
        assert_eq!(m[0], "CREATE SCHEMA IF NOT EXISTS app");
        assert!(m.iter().any(|s| s.contains("app.outbox_dead_letters (")));
    }
}
