//! The idempotent-request conformance suite against the real PostgreSQL server in
//! `IDEM_TEST_POSTGRES_URL`. Each test gets its own schema (first on the pool's `search_path`),
//! so tests run in parallel.

use idem_core::{BoxError, Migrate};
use idem_sql::PostgresStore;
use idem_testkit::isolated::PgSchema;
use idem_testkit::{RequestFixture, RequestTxOf};

/// `HELD`: the store holds its connections ([`PostgresStore::hold_connections`]), where request
/// lookups and the one-transaction mode's transactions run without pool pings.
#[derive(Debug)]
struct PgFixture<const HELD: bool = false> {
    store: PostgresStore,
    schema: PgSchema,
}

impl<const HELD: bool> RequestFixture for PgFixture<HELD> {
    type Store = PostgresStore;
    const SHARED_TRANSACTION: bool = true;
    const ONE_TRANSACTION: bool = true;

    async fn setup(test: &str) -> Option<Self> {
        let schema = PgSchema::create("idem_req", test).await?;
        let pool = schema.pool(20).await;
        let store = PostgresStore::from_pool(pool);
        let store = if HELD {
            store.hold_connections(8)
        } else {
            store
        };
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE effects (key text NOT NULL)")
            .execute(store.pool())
            .await
            .expect("effects table");
        Some(Self { store, schema })
    }

    fn store(&self) -> PostgresStore {
        self.store.clone()
    }

    async fn record_effect(&self, tx: &mut RequestTxOf<Self>, key: &str) -> Result<(), BoxError> {
        sqlx::query("INSERT INTO effects (key) VALUES ($1)")
            .bind(key)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn count_effects(&self, key: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE key = $1")
            .bind(key)
            .fetch_one(self.store.pool())
            .await
            .expect("count effects")
    }

    async fn teardown(self) {
        self.store.pool().close().await;
        self.schema.drop().await;
    }
}

idem_testkit::request_conformance_tests!(PgFixture);
crate::request_extras::request_extras!(PgFixture);

/// The same suite on held connections: the record read on one of them, and the
/// one-transaction mode's transaction begun on the connection the read ran on.
mod held {
    use super::PgFixture;

    idem_testkit::request_conformance_tests!(PgFixture<true>);
}

impl idem_testkit::RecoveryFixture for PgFixture {
    async fn legacy_store(
        &self,
        table: &str,
        completed: &idem_core::RequestKey,
        fingerprint: &idem_core::Fingerprint,
    ) -> PostgresStore {
        let pool = self.store.pool();
        sqlx::query(&format!(
            "CREATE TABLE {table} (scope bytea NOT NULL, idem_key bytea NOT NULL, \
             fingerprint bytea NOT NULL, state smallint NOT NULL, fence bigint NOT NULL, \
             lease_until bigint NOT NULL, expires_at bigint NOT NULL, result bytea, \
             PRIMARY KEY (scope, idem_key))"
        ))
        .execute(pool)
        .await
        .expect("legacy table");
        sqlx::query(&format!(
            "INSERT INTO {table} VALUES ($1, $2, $3, 1, 1, 0, \
             (extract(epoch from now()) * 1000000)::bigint + 86400000000, 'old')"
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

idem_testkit::recovery_conformance_tests!(PgFixture);
idem_testkit::phases_conformance_tests!(PgFixture);

impl idem_testkit::CompleterFixture for PgFixture {
    fn refusing_store(&self) -> PostgresStore {
        self.store
            .clone()
            .with_requests_table(idem_sql::TableName::new("no_such_requests").expect("valid"))
            .expect("plain table")
    }
}

idem_testkit::completer_conformance_tests!(PgFixture);
