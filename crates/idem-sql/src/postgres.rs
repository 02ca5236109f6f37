//! The PostgreSQL engine, on the statements of `idem_dialect::postgres` (the text
//! `idem-postgres` runs too, so the two stores share tables).
//!
//! The claim is `INSERT … ON CONFLICT (consumer, message_id) DO NOTHING`: one statement that
//! cannot race. A concurrent transaction holding an uncommitted claim for the same key makes it
//! wait; if that one commits, this insert affects no row (a duplicate), if it rolls back, this
//! insert proceeds. The duplicate's fingerprint is then read by a new statement, which under
//! READ COMMITTED sees the row whose commit the insert waited for.
//!
//! The store's layout is its partitioning, if any ([`PostgresStore::partitioned`], see
//! `partitioned.rs`): pruning and migration differ for a partitioned table, so they are
//! implemented here, on the PostgreSQL store, rather than for every engine.

use std::time::Duration;

use idem_core::{
    BatchClaimStore, ConsumerName, Error, ErrorKind, Fingerprint, MessageId, Migrate, Prune, Stamp,
    TableName,
};
use idem_dialect::postgres::partition::{Partitioning, check_table_name};
use idem_dialect::postgres::{self as dialect, sqlstate};
use sqlx::Postgres;
use sqlx::error::DatabaseError;

use crate::common::{server_stamp, stored_fingerprint};
use crate::engine::{
    CheckedCommit, ClaimStatements, Driver, Engine, OutboxStatements, RequestStatements,
};
use crate::errors::{commit_error, store_error};
use crate::store::SqlStore;
use crate::tx::Tx;

/// Longest message ID this schema holds: well inside the btree tuple limit.
pub const MAX_MESSAGE_ID_LEN: usize = dialect::MAX_MESSAGE_ID_LEN;

/// Claims stored in a PostgreSQL table (default `idem_processed`).
pub type PostgresStore = SqlStore<Postgres>;

impl crate::engine::sealed::Sealed for Postgres {}

impl Engine for Postgres {
    const MAX_MESSAGE_ID_LEN: usize = MAX_MESSAGE_ID_LEN;
    const BEGIN: &'static str = dialect::BEGIN;
    // In an aborted transaction the SELECT fails with 25P02 and the COMMIT never runs; all
    // travel in one simple-query round trip.
    const CHECKED_COMMIT: Option<CheckedCommit> = Some(CheckedCommit {
        alone: dialect::COMMIT,
        then_begin: dialect::COMMIT_THEN_BEGIN,
    });
    const SERVER: bool = true;
    const TRANSACTIONAL_DDL: bool = true;
    /// The claims table's partitioning by the ID's time, if it has one.
    type Layout = Option<Partitioning>;

    fn claim_statements(t: &TableName, partitioning: &Option<Partitioning>) -> ClaimStatements {
        dialect::claim_statements(t, partitioning.is_some())
    }

    /// On the server's clock.
    fn request_statements(t: &TableName) -> RequestStatements {
        dialect::request_statements(t)
    }

    fn migration(
        claims: &TableName,
        requests: &TableName,
        partitioning: &Option<Partitioning>,
    ) -> Vec<String> {
        dialect::migration(claims, requests, partitioning.as_ref())
    }

    /// The statements `idem-postgres` runs too.
    fn outbox_statements(t: &TableName) -> OutboxStatements {
        dialect::outbox_statements(t)
    }

    fn outbox_migration(t: &TableName) -> Vec<String> {
        dialect::outbox_migration(t)
    }

    /// A partitioned table's name must leave room for its partitions' suffixes.
    fn check_table(table: &TableName, partitioning: &Option<Partitioning>) -> Result<(), Error> {
        match partitioning {
            Some(_) => check_table_name(table.table()),
            None => Ok(()),
        }
    }

    /// Lower case: the statements name tables unquoted, which PostgreSQL folds, and the
    /// catalog lookups of partitions and the maintenance lock's key must spell them as it does.
    fn resolved_table(table: TableName) -> TableName {
        table.folded()
    }

    fn partition_key(
        partitioning: &Option<Partitioning>,
        id: &MessageId,
    ) -> Result<Option<i64>, Error> {
        partitioning.as_ref().map(|p| p.key_of(id)).transpose()
    }

    fn kept_for(partitioning: &Option<Partitioning>) -> Option<Duration> {
        partitioning.as_ref().map(Partitioning::kept_for)
    }

    fn stamp(stamp: Stamp) -> Option<i64> {
        server_stamp(stamp)
    }

    fn database_kind(db: &dyn DatabaseError) -> ErrorKind {
        sqlstate::kind_with(db.code().as_deref().unwrap_or(""), db.constraint())
    }

    const ONE_TRANSACTION: bool = true;

    fn read_only(db: &dyn DatabaseError) -> bool {
        db.code().as_deref() == Some(sqlstate::READ_ONLY_SQL_TRANSACTION)
    }

    fn connection_lost(db: &dyn DatabaseError) -> bool {
        sqlstate::connection_lost(db.code().as_deref().unwrap_or(""))
    }

    fn aborted(db: &dyn DatabaseError) -> bool {
        db.code().as_deref() == Some(sqlstate::IN_FAILED_SQL_TRANSACTION)
    }
}

impl SqlStore<Postgres> {
    /// Connects a pool to `url` (`postgres://user@host/db`) with the default tables.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let pool = crate::common::connect_pool::<Postgres>(url, 16).await?;
        Ok(Self::from_pool(pool))
    }
}

impl BatchClaimStore for PostgresStore {
    /// One `INSERT … SELECT FROM unnest(…) ON CONFLICT DO NOTHING RETURNING` for the whole
    /// batch, and one read of the stored fingerprints of the rest.
    async fn claim_many(
        &self,
        tx: &mut Tx<Postgres>,
        consumer: &ConsumerName,
        items: &[(&MessageId, Fingerprint)],
        at: Stamp,
    ) -> Result<Vec<Option<Fingerprint>>, Error> {
        let claimed = claim_many(self, tx, consumer, items, at).await;
        tx.saw(&claimed);
        claimed
    }
}

impl Prune for PostgresStore {
    /// Row by row; a partitioned store first maintains its table (whole days past the
    /// table's retention dropped) and then prunes only its default and undated partitions. A
    /// store not configured partitioned refuses a partitioned table as
    /// [`ErrorKind::Misconfigured`].
    async fn prune_batch(
        &self,
        consumer: Option<&ConsumerName>,
        now: Stamp,
        older_than: Duration,
        limit: u32,
    ) -> Result<u64, Error> {
        if self.partitioning().is_some() {
            return crate::partitioned::prune_batch(self, consumer, now, older_than, limit).await;
        }
        let deleted = self.prune_rows(consumer, now, older_than, limit).await?;
        // A short batch (the last one, or nothing at all: all a partitioned parent gives) looks
        // at the table once, so a store pointed at a partitioned table says so instead of
        // pruning nothing, round after round.
        if deleted < u64::from(limit) {
            crate::partitioned::check_not_partitioned(self).await?;
        }
        Ok(deleted)
    }
}

impl Migrate for PostgresStore {
    /// The tables (claims, requests, the outbox and its dead letters) in one transaction,
    /// serialised across replicas (and against
    /// `idem-postgres`'s migration of the same tables) by an advisory lock; a claims table of
    /// the other shape is refused. A partitioned store then runs a round of maintenance.
    async fn migrate(&self) -> Result<(), Error> {
        TableName::check_distinct(self.table(), self.requests_table())?;
        idem_dialect::outbox::check_tables(
            self.table(),
            self.requests_table(),
            self.outbox_table(),
        )?;
        let mut tx = Tx::begin(self.pool())
            .await
            .map_err(|e| store_error::<Postgres>("migrate", e))?;
        Postgres::execute_simple(&mut tx, dialect::MIGRATE_LOCK)
            .await
            .map_err(|e| store_error::<Postgres>("migrate lock", e))?;
        crate::partitioned::check_shape(&mut tx, self.table(), self.partitioning()).await?;
        let outbox = Postgres::outbox_migration(self.outbox_table());
        for sql in Postgres::migration(self.table(), self.requests_table(), &self.layout)
            .into_iter()
            .chain(outbox)
        {
            Postgres::execute_simple(&mut tx, &sql)
                .await
                .map_err(|e| store_error::<Postgres>("migrate", e))?;
        }
        let recovery = dialect::recovery_migration(self.requests_table());
        let err = |e| store_error::<Postgres>("migrate", e);
        if Postgres::fetch_int(&mut tx, &recovery.probe, &[])
            .await
            .map_err(err)?
            < idem_dialect::RecoveryMigration::COLUMNS
        {
            for sql in &recovery.add {
                Postgres::execute_simple(&mut tx, sql).await.map_err(err)?;
            }
        }
        tx.commit().await.map_err(commit_error::<Postgres>)?;
        if self.partitioning().is_some() {
            crate::partitioned::maintain_at_start_up(self).await?;
        }
        Ok(())
    }
}

/// The batch claim: the partition keys bound last where the table has them.
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
