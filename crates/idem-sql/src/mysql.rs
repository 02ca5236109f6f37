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

use idem_core::{ConsumerName, Error, ErrorKind, Fingerprint, MessageId, Stamp};
use sqlx::QueryBuilder;
use sqlx::error::DatabaseError;
use sqlx::mysql::MySql;

use crate::common::{server_stamp, stored_fingerprint};
use crate::engine::{Driver, Engine};
use crate::errors::store_error;
use crate::requests::{MAX_REQUEST_KEY_LEN, RequestStatements};
use crate::store::{ClaimStatements, SqlStore};
use crate::tx::Tx;
use idem_core::TableName;

/// The server's clock in `processed_at` units: microseconds since the Unix epoch, computed on
/// UTC so the session's time zone (and its daylight-saving jumps) cannot shift it.
const SERVER_NOW: &str = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))";

/// Longest message ID the `VARBINARY(1024)` column holds.
pub const MAX_MESSAGE_ID_LEN: usize = 1024;

/// Rows per multi-row INSERT.
const CHUNK: usize = 1000;

/// Claims stored in a MySQL or MariaDB table (default `idem_processed`).
pub type MySqlStore = SqlStore<MySql>;

impl crate::engine::sealed::Sealed for MySql {}

impl Engine for MySql {
    const MAX_MESSAGE_ID_LEN: usize = MAX_MESSAGE_ID_LEN;
    const BEGIN: &'static str = "BEGIN";
    const SERVER: bool = true;

    fn claim_statements(t: &TableName, _partitioned: bool) -> ClaimStatements {
        ClaimStatements {
            claim_many: format!(
                "INSERT INTO {t} (consumer, message_id, fingerprint, processed_at) "
            ),
            read_fingerprints: format!(
                "SELECT message_id, fingerprint FROM {t} WHERE duplicates > 0 AND consumer = "
            ),
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
                "SELECT CAST(consumer AS CHAR), CAST(count(*) AS SIGNED), min(processed_at), max(processed_at) \
                 FROM {t} GROUP BY consumer ORDER BY consumer"
            ),
        }
    }

    /// On the server's clock (`UTC_TIMESTAMP(6)` is fixed for the whole statement). MySQL
    /// binds `?` in the order they appear, which is the order listed on [`RequestStatements`].
    fn request_statements(t: &TableName) -> RequestStatements {
        let now = SERVER_NOW;
        RequestStatements {
            read: format!(
                "SELECT r.fingerprint, r.state, r.fence, r.lease_until, r.expires_at, n.now, \
             CASE WHEN r.fingerprint = ? AND r.state = 1 THEN r.result END \
             FROM (SELECT {now} AS now) n LEFT JOIN {t} r ON r.scope = ? AND r.idem_key = ?"
            ),
            insert: format!(
                "INSERT INTO {t} (scope, idem_key, fingerprint, state, fence, lease_until, expires_at) \
             VALUES (?, ?, ?, 0, ?, {now} + ?, {now} + ?)"
            ),
            reset: format!(
                "UPDATE {t} SET fingerprint = ?, state = 0, fence = fence + 1, \
             lease_until = {now} + ?, expires_at = {now} + ?, result = NULL \
             WHERE scope = ? AND idem_key = ? AND fence = ? \
             AND expires_at <= {now} AND (state = 1 OR lease_until <= {now})"
            ),
            take_over: format!(
                "UPDATE {t} SET fence = fence + 1, lease_until = {now} + ? \
             WHERE scope = ? AND idem_key = ? AND fence = ? AND state = 0 \
             AND lease_until <= {now}"
            ),
            complete: format!(
                "UPDATE {t} SET state = 1, result = ?, expires_at = {now} + ? \
             WHERE scope = ? AND idem_key = ? AND fence = ? AND state = 0"
            ),
            release: format!(
                "DELETE FROM {t} WHERE scope = ? AND idem_key = ? AND fence = ? AND state = 0"
            ),
            extend: format!(
                "UPDATE {t} SET lease_until = {now} + ? \
             WHERE scope = ? AND idem_key = ? AND fence = ? AND state = 0"
            ),
            reap: format!(
                "DELETE FROM {t} WHERE expires_at < {now} AND (state = 1 OR lease_until < {now}) \
             LIMIT ?"
            ),
        }
    }

    fn stamp(stamp: Stamp) -> Option<i64> {
        server_stamp(stamp)
    }

    fn database_kind(db: &dyn DatabaseError) -> ErrorKind {
        match db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
            Some(my) => crate::errors::mysql_kind(my.number()),
            None => ErrorKind::Store,
        }
    }

    /// 1290 running with `--read-only` (`super_read_only`), 1792 a read-only transaction,
    /// 1836 read-only mode.
    fn read_only(db: &dyn DatabaseError) -> bool {
        db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some_and(|my| matches!(my.number(), 1290 | 1792 | 1836))
    }

    fn connection_lost(db: &dyn DatabaseError) -> bool {
        db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some_and(|my| crate::errors::mysql_connection_lost(my.number()))
    }

    async fn claim_many(
        store: &SqlStore<Self>,
        tx: &mut Tx<Self>,
        consumer: &ConsumerName,
        items: &[(&MessageId, Fingerprint)],
        at: Stamp,
    ) -> Result<Vec<Option<Fingerprint>>, Error> {
        claim_many(store, tx, consumer, items, at).await
    }

    async fn migrate(store: &SqlStore<Self>) -> Result<(), Error> {
        migrate(store).await
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
                None => row.push(SERVER_NOW),
            };
        });
        q.push(" ON DUPLICATE KEY UPDATE duplicates = duplicates + 1");
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

/// Both tables; MySQL commits DDL implicitly, so each statement stands alone.
async fn migrate(store: &MySqlStore) -> Result<(), Error> {
    let t = store.table();
    let name = t.table();
    let (r, rname) = (store.requests_table(), store.requests_table().table());
    // MySQL DDL commits implicitly, so there is no transaction to hold; CREATE … IF NOT
    // EXISTS is atomic per statement, which is enough for concurrent starts.
    let sql = format!(
        "CREATE TABLE IF NOT EXISTS {t} (
            consumer     VARCHAR(100) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
            message_id   VARBINARY({MAX_MESSAGE_ID_LEN}) NOT NULL,
            fingerprint  BINARY(32)   NOT NULL,
            processed_at BIGINT       NOT NULL COMMENT 'microseconds since the Unix epoch',
            duplicates   INT UNSIGNED NOT NULL DEFAULT 0,
            PRIMARY KEY (consumer, message_id),
            KEY {name}_processed_at (processed_at)
        ) ENGINE = InnoDB"
    );
    let requests = format!(
        "CREATE TABLE IF NOT EXISTS {r} (
            scope       BINARY(32) NOT NULL,
            idem_key    VARBINARY({MAX_REQUEST_KEY_LEN}) NOT NULL,
            fingerprint BINARY(32) NOT NULL,
            state       SMALLINT   NOT NULL COMMENT '0 in progress, 1 completed',
            fence       BIGINT     NOT NULL,
            lease_until BIGINT     NOT NULL COMMENT 'microseconds since the Unix epoch',
            expires_at  BIGINT     NOT NULL COMMENT 'microseconds since the Unix epoch',
            result      LONGBLOB   NULL,
            PRIMARY KEY (scope, idem_key),
            KEY {rname}_expires_at (expires_at)
        ) ENGINE = InnoDB"
    );
    for sql in [sql, requests] {
        MySql::execute_pool(store.pool(), &sql, &[])
            .await
            .map_err(|e| store_error::<MySql>("migrate", e))?;
    }
    Ok(())
}
