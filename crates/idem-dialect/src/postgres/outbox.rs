//! PostgreSQL's outbox: the statements and migration both PostgreSQL stores run, so that one
//! store's relay leases what the other's handlers enqueued.
//!
//! A lease is **one statement** (PostgreSQL 12 or later, for `WITH … AS MATERIALIZED`): it
//! selects its rows `FOR UPDATE OF o SKIP LOCKED`, applies the per-key rule, leases the rows
//! the rule admits and returns them — two relays never wait for each other and never take the
//! same row, and a row the rule turns away is not leased. One statement rather than a select
//! and an update of the listed rows saves a round trip and a second pass over the rows; the
//! lease's cost is mostly rewriting the rows, which the table's [`FILLFACTOR`] keeps in their
//! own pages (HOT updates).
//!
//! The lease walks the unsent rows by `seq` with `LIMIT`: with table statistics the planner
//! takes the partial index on unsent rows and stops after the limit. A table that was never
//! analysed (freshly created and filled in one go, or with autovacuum off) can get a plan that
//! reads and sorts every unsent row first: 15 ms rather than 3 ms for 500 of 20 000 rows
//! (`EXPLAIN ANALYZE`, BENCHMARKS.md), growing with the backlog. Autovacuum's analyse fixes it
//! on its own; after a bulk load, or with autovacuum off, run `ANALYZE` on the outbox table.
//!
//! Enqueue is `INSERT … ON CONFLICT (message_id) DO NOTHING`, which waits for a concurrent
//! uncommitted insert of the same ID and then inserts nothing if it committed. `created_at` is
//! the enqueuing transaction's start (`now()`), the relay's times the statement's.

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
        lease: OutboxStatement::new(lease(o), &[P::Relay, P::Limit, P::Lease]),
        lease_update: None,
        relay_begin: Some(super::RELAY_BEGIN),
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

/// The lease of table `o`: one statement that picks, checks and leases (see the module docs).
///
/// `picked` is the selection every engine's lease makes — unsent, due, not leased to another
/// relay with a live lease, no earlier row of its (destination, key) waiting or leased
/// elsewhere, oldest first, `FOR UPDATE OF o SKIP LOCKED` — with each row's count of earlier
/// unsent rows of its key. `AS MATERIALIZED` makes it run once, before the update, so the
/// `LIMIT` and the locks apply to one selection. `admitted` then applies the per-key rule of
/// [`crate::outbox::admit`] in SQL: a keyed row is taken only when every earlier unsent row of
/// its key was picked too (its count of earlier rows equals the picked rows of its key before
/// it), which turns away the rows behind an earlier one that another transaction holds locked
/// (skipped, so not picked). Only admitted rows are updated and returned, in `seq` order, each
/// with its count, so [`crate::outbox::admit`] run on them again admits every one. A picked
/// row that is turned away stays locked until the lease commits but is not leased.
fn lease(o: &TableName) -> String {
    let now = STATEMENT_NOW;
    let same_key = "e.destination = o.destination AND e.ordering_key = o.ordering_key \
                    AND e.sent_at IS NULL AND e.seq < o.seq";
    let returned = SELECTED.replace("o.", "l.");
    format!(
        "WITH picked AS MATERIALIZED ( \
           SELECT o.seq, o.destination, o.ordering_key, \
                  (SELECT count(*) FROM {o} e WHERE {same_key}) AS earlier \
           FROM {o} o WHERE o.sent_at IS NULL AND o.available_at <= {now} \
           AND (o.leased_until IS NULL OR o.leased_until <= {now} OR o.leased_by = $1) \
           AND (o.ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM {o} e WHERE {same_key} \
           AND (e.available_at > {now} OR (e.leased_until > {now} AND e.leased_by <> $1)))) \
           ORDER BY o.seq LIMIT $2 FOR UPDATE OF o SKIP LOCKED), \
         admitted AS ( \
           SELECT seq, earlier FROM ( \
             SELECT seq, ordering_key, earlier, row_number() OVER ( \
               PARTITION BY destination, ordering_key ORDER BY seq) - 1 AS before \
             FROM picked) p \
           WHERE ordering_key IS NULL OR earlier = before), \
         leased AS ( \
           UPDATE {o} o SET leased_by = $1, leased_until = {now} + $3 \
           FROM admitted a WHERE o.seq = a.seq \
           RETURNING {SELECTED}, a.earlier) \
         SELECT {returned}, l.earlier FROM leased l ORDER BY l.seq"
    )
}

/// How full PostgreSQL fills the outbox table's pages: half, so that a row's lease, mark and
/// release find room in its own page and are HOT updates (no new index entries, no tuple in
/// another page). With full pages the 500-row lease `UPDATE` took 6.4–9.4 ms; with half-full
/// ones 2.0–3.5 ms (BENCHMARKS.md). The cost is a table twice as sparse while rows wait.
pub const FILLFACTOR: u32 = 50;

/// The outbox table and its dead-letter table, their indexes and comments: run by `migrate`
/// in the same transaction, under the same advisory lock, as the claims tables.
///
/// The table is created `WITH (fillfactor = 50)` ([`FILLFACTOR`]); on a table that exists
/// without a fillfactor of its own (made by an earlier idem), `migrate` sets it. That only
/// affects pages written from then on: the rows already there stay on full pages until they
/// are sent and purged (or a `VACUUM FULL` rewrites the table, which locks it out).
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
            ) WITH (fillfactor = {FILLFACTOR})"
        ),
        // A table made before the fillfactor (or by hand) gets it unless it has its own.
        format!(
            "DO $$ BEGIN \
             IF NOT EXISTS (SELECT 1 FROM pg_class c, unnest(c.reloptions) r \
                            WHERE c.oid = '{o}'::regclass AND r LIKE 'fillfactor=%') THEN \
               ALTER TABLE {o} SET (fillfactor = {FILLFACTOR}); \
             END IF; END $$"
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
        assert!(s.lease_update.is_none(), "the lease is one statement");
        assert_eq!(s.lease.binds, vec![P::Relay, P::Limit, P::Lease]);
        assert!(s.lease.sql.contains("FOR UPDATE OF o SKIP LOCKED"));
        assert!(s.lease.sql.starts_with("WITH picked AS MATERIALIZED"));
        assert!(s.lease.sql.ends_with("ORDER BY l.seq"), "{}", s.lease.sql);
        assert!(s.mark_sent.text(1).ends_with("seq IN ($2)"));
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
        assert!(m[1].ends_with(") WITH (fillfactor = 50)"), "{}", m[1]);
        assert!(
            m[2].contains("'app.outbox'::regclass") && m[2].contains("SET (fillfactor = 50)"),
            "{}",
            m[2]
        );
    }
}
