//! The MySQL / MariaDB engine (InnoDB).
//!
//! The claim is `INSERT … ON DUPLICATE KEY UPDATE duplicates = duplicates + 1`: one statement
//! that cannot race, and — unlike `INSERT IGNORE` — it does not turn truncation or other errors
//! into warnings. The counter is what makes the result readable: sqlx connects with
//! `CLIENT_FOUND_ROWS`, under which a no-op update reports 1 affected row, the same as an
//! insert; a real increment reports 2. (The increment persists only when a batch containing the
//! duplicate commits; a lone duplicate rolls back, so the column is not a redelivery count.)
//! A concurrent duplicate waits on the first transaction's record lock; the increment then locks
//! the existing row and makes it visible to the fingerprint read that follows.
//!
//! Request records (see [`crate::requests`]) live in their own table, all binary columns
//! (`BINARY`/`VARBINARY`/`LONGBLOB`, never a collated text column, whose comparison would fold
//! case). A lookup's `SELECT` is a consistent non-locking read, so it never waits for the row
//! lock a completing executor holds. Their insert is a plain `INSERT` whose duplicate-key
//! error means a lost race (no `ON DUPLICATE KEY UPDATE` no-op: under `CLIENT_FOUND_ROWS` it
//! reports one row, like an insert). Every guarded `UPDATE` counts matched rows under
//! `CLIENT_FOUND_ROWS` and changes a column anyway (the state, the fence or the lease), so its
//! count is right under either flag. A stored result is bounded by the server's
//! `max_allowed_packet` (16 MiB by default on MariaDB, 64 MiB on MySQL 8).

use std::time::Duration;

use idem_core::{
    BatchClaimStore, ConsumerName, Error, ErrorKind, Fingerprint, MessageId, Migrate, Prune, Stamp,
};
use idem_dialect::mysql as dialect;
use sqlx::QueryBuilder;
use sqlx::error::DatabaseError;
use sqlx::mysql::MySql;

use crate::common::{server_stamp, stored_fingerprint};
use crate::engine::{ClaimStatements, Engine, OutboxStatements, RequestStatements};
use crate::errors::store_error;
use crate::store::SqlStore;
use crate::tx::Tx;
use idem_core::TableName;

/// Longest message ID the `VARBINARY(1024)` column holds.
pub const MAX_MESSAGE_ID_LEN: usize = dialect::MAX_MESSAGE_ID_LEN;

/// Rows per multi-row INSERT.
const CHUNK: usize = 1000;

/// Claims stored in a MySQL or MariaDB table (default `idem_processed`).
pub type MySqlStore = SqlStore<MySql>;

impl crate::engine::sealed::Sealed for MySql {}

impl Engine for MySql {
    const MAX_MESSAGE_ID_LEN: usize = MAX_MESSAGE_ID_LEN;
    const BEGIN: &'static str = dialect::BEGIN;
    const SERVER: bool = true;
    const TRANSACTIONAL_DDL: bool = false;
    type Layout = ();

    fn claim_statements(t: &TableName, _: &()) -> ClaimStatements {
        dialect::claim_statements(t)
    }

    /// On the server's clock (`UTC_TIMESTAMP(6)` is fixed for the whole statement).
    fn request_statements(t: &TableName) -> RequestStatements {
        dialect::request_statements(t)
    }

    fn migration(claims: &TableName, requests: &TableName, _: &()) -> Vec<String> {
        dialect::migration(claims, requests)
    }

    fn recovery_migration(requests: &TableName) -> Option<idem_dialect::RecoveryMigration> {
        Some(dialect::recovery_migration(requests))
    }

    fn outbox_statements(t: &TableName) -> OutboxStatements {
        dialect::outbox_statements(t)
    }

    fn outbox_migration(t: &TableName) -> Vec<String> {
        dialect::outbox_migration(t)
    }

    fn stamp(stamp: Stamp) -> Option<i64> {
        server_stamp(stamp)
    }

    fn database_kind(db: &dyn DatabaseError) -> ErrorKind {
        match db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
            Some(my) => dialect::kind(my.number()),
            None => ErrorKind::Store,
        }
    }

    const ONE_TRANSACTION: bool = true;

    fn lock_not_granted(db: &dyn DatabaseError) -> bool {
        // 1205: the lock-wait timeout (zero for the take statements); 3572: MySQL's NOWAIT.
        db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some_and(|my| matches!(my.number(), 1205 | 3572))
    }

    fn plain_take<'s>(db: &dyn DatabaseError, sql: &'s str) -> Option<&'s str> {
        // 1064: a syntax error, which only the no-wait prefix can cause in a take statement.
        let parse_error = db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some_and(|my| my.number() == 1064);
        parse_error
            .then(|| sql.strip_prefix(dialect::NOWAIT))
            .flatten()
    }

    fn read_only(db: &dyn DatabaseError) -> bool {
        db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some_and(|my| dialect::read_only(my.number()))
    }

    fn connection_lost(db: &dyn DatabaseError) -> bool {
        db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some_and(|my| dialect::connection_lost(my.number()))
    }
}

impl BatchClaimStore for MySqlStore {
    async fn claim_many(
        &self,
        tx: &mut Tx<MySql>,
        consumer: &ConsumerName,
        items: &[(&MessageId, Fingerprint)],
        at: Stamp,
    ) -> Result<Vec<Option<Fingerprint>>, Error> {
        let claimed = claim_many(self, tx, consumer, items, at).await;
        tx.saw(&claimed);
        claimed
    }
}

impl Prune for MySqlStore {
    async fn prune_batch(
        &self,
        consumer: Option<&ConsumerName>,
        now: Stamp,
        older_than: Duration,
        limit: u32,
    ) -> Result<u64, Error> {
        self.prune_rows(consumer, now, older_than, limit).await
    }
}

impl Migrate for MySqlStore {
    /// Both tables, statement by statement: MySQL commits DDL implicitly.
    async fn migrate(&self) -> Result<(), Error> {
        self.migrate_tables().await
    }
}

impl SqlStore<MySql> {
    /// Connects a pool to `url` (`mysql://user:pass@host/db`; `mariadb://` is read as
    /// `mysql://`) with the default tables.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let url = mysql_url(url);
        let pool = crate::common::connect_pool::<MySql>(&url, 16).await?;
        Ok(Self::from_pool(pool))
    }
}

/// sqlx knows only `mysql://`; MariaDB users write `mariadb://`.
fn mysql_url(url: &str) -> std::borrow::Cow<'_, str> {
    match url.get(..8) {
        Some(scheme) if scheme.eq_ignore_ascii_case("mariadb:") => {
            format!("mysql:{}", &url[8..]).into()
        }
        _ => url.into(),
    }
}

/// The batch claim: multi-row `INSERT … ON DUPLICATE KEY UPDATE`, then one read of the rows
/// the batch found already there.
async fn claim_many(
    store: &MySqlStore,
    tx: &mut Tx<MySql>,
    consumer: &ConsumerName,
    items: &[(&MessageId, Fingerprint)],
    at: Stamp,
) -> Result<Vec<Option<Fingerprint>>, Error> {
    let at = server_stamp(at);
    let mut affected = 0;
    for chunk in items.chunks(CHUNK) {
        let mut q = QueryBuilder::<MySql>::new(&store.sql.claim_many);
        q.push_values(chunk, |mut row, (id, fp)| {
            row.push_bind(consumer.as_str())
                .push_bind(id.as_bytes())
                .push_bind(&fp.as_bytes()[..]);
            match at {
                Some(micros) => row.push_bind(micros),
                None => row.push(dialect::SERVER_NOW),
            };
        });
        q.push(&store.sql.claim_many_tail);
        affected += q
            .build()
            .execute(&mut **tx)
            .await
            .map_err(|e| store_error::<MySql>("batch claim", e))?
            .rows_affected();
    }
    if affected == items.len() as u64 {
        return Ok(vec![None; items.len()]);
    }
    // Every row of the batch is now locked by this transaction: inserted ones still have
    // duplicates = 0, pre-existing ones were just incremented. No other writer can change
    // that before commit, so the split is exact.
    let mut existing = std::collections::HashMap::new();
    for chunk in items.chunks(CHUNK) {
        let mut q = QueryBuilder::<MySql>::new(&store.sql.read_fingerprints);
        q.push_bind(consumer.as_str()).push(" AND message_id IN (");
        let mut sep = q.separated(", ");
        for (id, _) in chunk {
            sep.push_bind(id.as_bytes());
        }
        q.push(")");
        let rows: Vec<(Vec<u8>, Vec<u8>)> = q
            .build_query_as()
            .fetch_all(&mut **tx)
            .await
            .map_err(|e| store_error::<MySql>("reading stored fingerprints", e))?;
        existing.extend(rows);
    }
    items
        .iter()
        .map(|(id, _)| match existing.remove(id.as_bytes()) {
            None => Ok(None),
            Some(fp) => stored_fingerprint(Some(fp)),
        })
        .collect()
}
