//! The idempotent-request conformance suite against the real MySQL/MariaDB server in
//! `IDEM_TEST_MYSQL_URL`. Each test gets its own database, so tests run in parallel.

use idem_core::{BoxError, Migrate};
use idem_sql::MySqlStore;
use idem_testkit::isolated::MySqlDatabase;
use idem_testkit::{RequestFixture, RequestTxOf};

/// `HELD`: the store holds its connections ([`MySqlStore::hold_connections`]), where request
/// lookups and the one-transaction mode's transactions run without pool pings.
#[derive(Debug)]
struct MySqlFixture<const HELD: bool = false> {
    store: MySqlStore,
    database: MySqlDatabase,
}

impl<const HELD: bool> RequestFixture for MySqlFixture<HELD> {
    type Store = MySqlStore;
    const SHARED_TRANSACTION: bool = true;
    const ONE_TRANSACTION: bool = true;

    async fn setup(test: &str) -> Option<Self> {
        let database = MySqlDatabase::create("idem_req", test).await?;
        let pool = database.pool(20).await;
        let store = MySqlStore::from_pool(pool);
        let store = if HELD {
            store.hold_connections(8)
        } else {
            store
        };
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE effects (k VARCHAR(255) NOT NULL) ENGINE = InnoDB")
            .execute(store.pool())
            .await
            .expect("effects table");
        Some(Self { store, database })
    }

    fn store(&self) -> MySqlStore {
        self.store.clone()
    }

    async fn record_effect(&self, tx: &mut RequestTxOf<Self>, key: &str) -> Result<(), BoxError> {
        sqlx::query("INSERT INTO effects (k) VALUES (?)")
            .bind(key)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn count_effects(&self, key: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE k = ?")
            .bind(key)
            .fetch_one(self.store.pool())
            .await
            .expect("count effects")
    }

    async fn teardown(self) {
        self.store.pool().close().await;
        self.database.drop().await;
    }
}

idem_testkit::request_conformance_tests!(MySqlFixture);
crate::request_extras::request_extras!(MySqlFixture);

/// The same suite on held connections: the record read on one of them, and the
/// one-transaction mode's transaction begun on the connection the read ran on.
mod held {
    use super::MySqlFixture;

    idem_testkit::request_conformance_tests!(MySqlFixture<true>);
}

impl idem_testkit::RecoveryFixture for MySqlFixture {
    async fn legacy_store(
        &self,
        table: &str,
        completed: &idem_core::RequestKey,
        fingerprint: &idem_core::Fingerprint,
    ) -> MySqlStore {
        let pool = self.store.pool();
        sqlx::query(&format!(
            "CREATE TABLE {table} (scope BINARY(32) NOT NULL, idem_key VARBINARY(1024) NOT NULL, \
             fingerprint BINARY(32) NOT NULL, state SMALLINT NOT NULL, fence BIGINT NOT NULL, \
             lease_until BIGINT NOT NULL, expires_at BIGINT NOT NULL, result LONGBLOB NULL, \
             PRIMARY KEY (scope, idem_key), KEY {table}_expires_at (expires_at)) ENGINE = InnoDB"
        ))
        .execute(pool)
        .await
        .expect("legacy table");
        sqlx::query(&format!(
            "INSERT INTO {table} VALUES (?, ?, ?, 1, 1, 0, \
             TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) + 86400000000, 'old')"
        ))
        .bind(&completed.scope.as_bytes()[..])
        .bind(completed.key.as_str().as_bytes())
        .bind(&fingerprint.as_bytes()[..])
        .execute(pool)
        .await
        .expect("legacy row");
        self.store
            .clone()
            .with_requests_table(idem_sql::TableName::new(table).expect("valid"))
            .expect("plain table")
    }
}

idem_testkit::recovery_conformance_tests!(MySqlFixture);
idem_testkit::phases_conformance_tests!(MySqlFixture);

impl idem_testkit::CompleterFixture for MySqlFixture {
    fn refusing_store(&self) -> MySqlStore {
        self.store
            .clone()
            .with_requests_table(idem_sql::TableName::new("no_such_requests").expect("valid"))
            .expect("plain table")
    }
}

idem_testkit::completer_conformance_tests!(MySqlFixture);
