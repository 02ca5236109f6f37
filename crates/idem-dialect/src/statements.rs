//! The statement sets every engine fills in: what a store binds to each, in which order.

/// An engine's claim statements for one claims table. Parameters are bound in the order
/// given; a `now`/`processed_at` parameter is the stamp (`NULL` on a server: its own clock).
/// On a partitioned PostgreSQL table the claim and the fingerprint reads take the partition
/// key (`id_time`, a batch's as an array) last, after the parameters listed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClaimStatements {
    /// consumer, message_id, fingerprint, processed_at: one row affected when inserted,
    /// none (or, on MySQL, the no-op update's count) when the claim exists.
    pub claim: String,
    /// consumer, message_id → the stored fingerprint.
    pub read_fingerprint: String,
    /// now, older-than, limit: deletes up to `limit` claims of every consumer (on a
    /// partitioned table: up to `limit` from each of its default and undated partitions).
    pub prune_all: String,
    /// now, older-than, consumer, limit.
    pub prune_consumer: String,
    /// (consumer, count, oldest, newest) per consumer.
    pub stats: String,
    /// The batch claim: a whole statement where a batch binds arrays (PostgreSQL's `unnest`:
    /// consumer, message_ids, fingerprints, processed_at → the message IDs inserted), else
    /// the `INSERT … ` head each batch appends its rows of (consumer, message_id,
    /// fingerprint, processed_at) to, then [`claim_many_tail`](Self::claim_many_tail).
    pub claim_many: String,
    /// What follows a multi-row batch claim's rows (its conflict clause); empty where
    /// [`claim_many`](Self::claim_many) is whole.
    pub claim_many_tail: String,
    /// The batch's fingerprint read-back: a whole statement (PostgreSQL: consumer,
    /// message_ids → (message_id, fingerprint)), or the head a batch appends the consumer and
    /// an `IN (…)` list to (MySQL); empty where the engine reads each one with
    /// [`read_fingerprint`](Self::read_fingerprint) (SQLite: no round trips to save).
    pub read_fingerprints: String,
}

/// The request-record statements of one requests table. Parameters are bound in the order
/// listed, then — on an engine that stamps on the host (SQLite) — `now` last, which the
/// statement may use several times; on the servers the statements read the server's clock.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RequestStatements {
    /// fingerprint, scope, key → always one row: fingerprint, state, fence, lease_until,
    /// expires_at (all NULL when there is no record), now, result (only for a completed or
    /// abandoned record with this fingerprint), and 1 when the record has a recovery point
    /// (else 0).
    pub read: String,
    /// scope, key, fingerprint, fence, lease, ttl: a new record in progress; no row on a
    /// conflict (or a unique violation, which counts the same).
    pub insert: String,
    /// fingerprint, lease, ttl, scope, key, fence: an expired record without a recovery point
    /// started afresh (attempts back to 1).
    pub reset: String,
    /// scope, key, fingerprint, fence, lease, ttl, point, state: [`insert`](Self::insert) of
    /// a record born at its first recovery point (an operation of phases: the point commits
    /// with the take, not on its own).
    pub insert_at: String,
    /// fingerprint, lease, ttl, point, state, scope, key, fence: [`reset`](Self::reset) to a
    /// first recovery point.
    pub reset_at: String,
    /// lease, scope, key, fence: a lapsed lease taken over (one more attempt).
    pub take_over: String,
    /// result, ttl, scope, key, fence.
    pub complete: String,
    /// scope, key, fence (no `now`): deletes a record without a recovery point.
    pub release: String,
    /// scope, key, fence: ends the lease of a record with a recovery point (what a release
    /// does to one: its committed phases stand).
    pub end_lease: String,
    /// scope, key, fence (no `now`) → at most one [`RecoveryRow`](idem_core::request_record::RecoveryRow)
    /// (scope, key, fence, recovery_point, phase_state, attempts) of the record the fence
    /// holds in progress.
    pub recovery: String,
    /// point, state, scope, key, fence (no `now`): the record's new recovery point.
    pub advance: String,
    /// result, ttl, scope, key, fence: the record ended as abandoned (state 2).
    pub abandon: String,
    /// limit → [`RecoveryRow`](idem_core::request_record::RecoveryRow)s of records in progress
    /// past their lease with a recovery point, oldest lease first; on a server locked, skipping
    /// rows another transaction holds (`FOR UPDATE SKIP LOCKED`). The store runs it in a
    /// transaction and takes each over with [`take_over`](Self::take_over).
    pub stuck: String,
    /// lease, scope, key, fence.
    pub extend: String,
    /// limit: expired records (never one in progress with a recovery point).
    pub reap: String,
}

/// What `migrate` runs to give a requests table made before recovery points its columns
/// (`recovery_point`, `phase_state`, `attempts`) and the index the completer reads: the
/// statements in [`add`](Self::add) when [`probe`](Self::probe) counts fewer than
/// [`COLUMNS`](Self::COLUMNS) of them.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecoveryMigration {
    /// One row, one integer: how many of the three columns the table has.
    pub probe: String,
    /// The statements adding the columns and the index.
    pub add: Vec<String>,
}

impl RecoveryMigration {
    /// The columns recovery points add.
    pub const COLUMNS: i64 = 3;
}

/// What an outbox statement binds at one of its parameters: the store supplies the value.
/// Listing them per statement (rather than documenting one order) lets an engine with
/// positional `?` parameters (MySQL) bind a value twice and one with numbered parameters
/// (SQLite) bind the host's clock once for several uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OutboxParam {
    /// The outgoing message's ID (bytes).
    MessageId,
    /// Its destination (text).
    Destination,
    /// Its ordering key (text, or NULL).
    OrderingKey,
    /// Its payload (bytes).
    Payload,
    /// Its headers, encoded by [`crate::outbox::encode_headers`] (text).
    Headers,
    /// The relay's name (text).
    Relay,
    /// A row count (integer).
    Limit,
    /// How long a lease lasts, in microseconds (integer).
    Lease,
    /// How long a released row waits, in microseconds (integer).
    RetryIn,
    /// A failed publish's error (text, bounded by [`crate::outbox::bounded`]).
    Error,
    /// A dead letter's reason (text, bounded by [`crate::outbox::bounded`]).
    Reason,
    /// One row's sequence number (integer).
    Seq,
    /// Every sequence number of the list the statement takes, one parameter each, in the
    /// placeholders [`OutboxStatement::text`] wrote for them: always the last.
    Seqs,
    /// This host's clock in microseconds since the Unix epoch (integer): only on an engine
    /// that stamps on the host (SQLite); a server's statements read the server's clock.
    Now,
}

/// How an engine writes its parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placeholder {
    /// PostgreSQL: `$1`, `$2`, …
    Dollar,
    /// SQLite: `?1`, `?2`, …
    Numbered,
    /// MySQL: `?` each, bound in order of appearance.
    Positional,
}

/// One outbox statement: its text and what it binds, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxStatement {
    /// The text; for a statement over a list of sequence numbers, the part before the list.
    pub sql: String,
    /// What is bound, in order ([`OutboxParam::Seqs`] stands for the whole list).
    pub binds: Vec<OutboxParam>,
    /// After the list, for a statement that takes one.
    tail: Option<String>,
    /// How the list's placeholders are written, and the first one's number.
    list: Option<(Placeholder, usize)>,
}

impl OutboxStatement {
    pub(crate) fn new(sql: String, binds: &[OutboxParam]) -> Self {
        Self {
            sql,
            binds: binds.to_vec(),
            tail: None,
            list: None,
        }
    }

    /// A statement whose text continues with a list of sequence numbers (`IN (…)`), then
    /// `tail`; the list's first placeholder is number `first`.
    pub(crate) fn with_list(
        sql: String,
        binds: &[OutboxParam],
        style: Placeholder,
        first: usize,
        tail: &str,
    ) -> Self {
        Self {
            sql,
            binds: binds.to_vec(),
            tail: Some(tail.to_owned()),
            list: Some((style, first)),
        }
    }

    /// The text to send with a list of `seqs` sequence numbers (ignored by a statement that
    /// takes no list). A list of n rows is a text of its own; a relay's batches are mostly
    /// full, so few distinct texts are prepared.
    pub fn text(&self, seqs: usize) -> std::borrow::Cow<'_, str> {
        let Some((style, first)) = self.list else {
            return self.sql.as_str().into();
        };
        let mut sql = String::with_capacity(self.sql.len() + seqs * 5 + 8);
        sql.push_str(&self.sql);
        for i in 0..seqs {
            if i > 0 {
                sql.push_str(", ");
            }
            match style {
                Placeholder::Dollar => sql.push_str(&format!("${}", first + i)),
                Placeholder::Numbered => sql.push_str(&format!("?{}", first + i)),
                Placeholder::Positional => sql.push('?'),
            }
        }
        sql.push_str(self.tail.as_deref().unwrap_or(""));
        sql.into()
    }
}

/// The enqueue: one multi-row `INSERT` for up to [`MAX_ROWS`](Self::MAX_ROWS) messages, so a
/// handler that emits one message per message of a batch pays one round trip per batch rather
/// than one per message. Each row binds [`ENQUEUE_ROW`]'s values in order; an engine that
/// stamps on the host (SQLite) binds its clock once, first, and every row reuses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnqueueStatement {
    /// Up to `VALUES `.
    head: String,
    /// Inside each row's parentheses, after its placeholders: the clock, twice.
    clock: String,
    /// After the rows: the conflict clause.
    tail: String,
    style: Placeholder,
    /// Bound once, before every row ([`OutboxParam::Now`] on SQLite).
    leading: Vec<OutboxParam>,
}

/// What each row of an [`EnqueueStatement`] binds, in order.
pub const ENQUEUE_ROW: [OutboxParam; 5] = [
    OutboxParam::MessageId,
    OutboxParam::Destination,
    OutboxParam::OrderingKey,
    OutboxParam::Payload,
    OutboxParam::Headers,
];

impl EnqueueStatement {
    /// The most rows one statement inserts: 5 parameters each stays far below every engine's
    /// limit (SQLite's oldest, 999), and a handler's batch of 100 is one statement.
    pub const MAX_ROWS: usize = 100;

    pub(crate) fn new(
        head: String,
        clock: String,
        tail: String,
        style: Placeholder,
        leading: &[OutboxParam],
    ) -> Self {
        Self {
            head,
            clock,
            tail,
            style,
            leading: leading.to_vec(),
        }
    }

    /// The text inserting `rows` messages (at least one). Each count is a text of its own;
    /// a consumer's batches are mostly full, so few distinct texts are prepared.
    pub fn text(&self, rows: usize) -> String {
        let rows = rows.max(1);
        let mut sql = String::with_capacity(self.head.len() + self.tail.len() + rows * 48);
        sql.push_str(&self.head);
        let mut n = self.leading.len();
        for r in 0..rows {
            if r > 0 {
                sql.push_str(", ");
            }
            sql.push('(');
            for i in 0..ENQUEUE_ROW.len() {
                if i > 0 {
                    sql.push_str(", ");
                }
                n += 1;
                match self.style {
                    Placeholder::Dollar => sql.push_str(&format!("${n}")),
                    Placeholder::Numbered => sql.push_str(&format!("?{n}")),
                    Placeholder::Positional => sql.push('?'),
                }
            }
            sql.push_str(&self.clock);
            sql.push(')');
        }
        sql.push_str(&self.tail);
        sql
    }

    /// What [`text`](Self::text)`(rows.len())` binds, in order: the leading values (from the
    /// first row's [`Values`](crate::outbox::Values)), then each row's.
    pub fn bind<'a>(&self, rows: &[crate::outbox::Values<'a>]) -> Vec<crate::outbox::Value<'a>> {
        let mut out = Vec::with_capacity(self.leading.len() + rows.len() * ENQUEUE_ROW.len());
        if let Some(first) = rows.first() {
            out.extend(first.bind_params(&self.leading));
        }
        for row in rows {
            out.extend(row.bind_params(&ENQUEUE_ROW));
        }
        out
    }
}

/// The outbox statements of one outbox table (and its dead-letter table,
/// `<outbox>_dead_letters`). Times are microseconds since the Unix epoch on the store's clock.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxStatements {
    /// Inserts messages, in the caller's transaction, up to
    /// [`EnqueueStatement::MAX_ROWS`] in one statement; a message ID already in the table
    /// inserts nothing (and is no error).
    pub enqueue: EnqueueStatement,
    /// Inside the relay's lease transaction: the rows a relay may lease, oldest first, locked
    /// (skipping rows another transaction holds) — columns seq, message_id, destination,
    /// ordering_key, payload, headers, attempts, created_at, and the number of unsent rows
    /// of the same destination and ordering key before it (0 without a key), which
    /// [`crate::outbox::admit`] checks. Where [`lease_update`](Self::lease_update) is `None`
    /// (PostgreSQL) the statement leases the rows itself and returns only those the per-key
    /// rule admits; elsewhere it only selects.
    pub lease: OutboxStatement,
    /// In the same transaction, after [`lease`](Self::lease) and the per-key check: leases
    /// the listed rows to the relay. `None` where the lease statement leases by itself.
    pub lease_update: Option<OutboxStatement>,
    /// Where set (PostgreSQL), how the relay's own transactions — the lease, the mark (which
    /// then runs in a transaction rather than on its own), a dead letter — begin, in place of
    /// the engine's `BEGIN`: one simple query that also sets what holds for that transaction
    /// only (PostgreSQL: not waiting for the commit to reach the disk; see
    /// [`crate::postgres::RELAY_BEGIN`] for why that is safe). Never for the enqueue, which
    /// runs in the caller's transaction.
    pub relay_begin: Option<&'static str>,
    /// Marks the listed rows sent, only those still leased to the relay.
    pub mark_sent: OutboxStatement,
    /// Gives a row leased to the relay back: attempts + 1, the error kept, available again
    /// after the delay, the lease cleared.
    pub release: OutboxStatement,
    /// In the dead-letter transaction: copies a row leased to the relay (and unsent) into the
    /// dead-letter table with the reason.
    pub dead_letter_copy: OutboxStatement,
    /// Then deletes it, with the same guard; the store commits only if both touched one row.
    pub dead_letter_delete: OutboxStatement,
    /// Deletes up to a limit of sent rows.
    pub purge_sent: OutboxStatement,
    /// One row: unsent rows, the oldest unsent `created_at` (NULL without any), sent rows,
    /// dead letters, the clock.
    pub backlog: OutboxStatement,
    /// After an enqueue, in the same transaction: tells listening relays, on commit only, that
    /// rows are waiting (PostgreSQL's `NOTIFY`; `None` on engines without one). Binds nothing.
    pub notify: Option<OutboxStatement>,
}
