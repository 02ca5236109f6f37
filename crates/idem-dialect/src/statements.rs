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
    /// expires_at (all NULL when there is no record), now, result (only for a completed record
    /// with this fingerprint).
    pub read: String,
    /// scope, key, fingerprint, fence, lease, ttl: a new record in progress; no row on a
    /// conflict (or a unique violation, which counts the same).
    pub insert: String,
    /// fingerprint, lease, ttl, scope, key, fence: an expired record started afresh.
    pub reset: String,
    /// lease, scope, key, fence: a lapsed lease taken over.
    pub take_over: String,
    /// result, ttl, scope, key, fence.
    pub complete: String,
    /// scope, key, fence (no `now`).
    pub release: String,
    /// lease, scope, key, fence.
    pub extend: String,
    /// limit.
    pub reap: String,
}
