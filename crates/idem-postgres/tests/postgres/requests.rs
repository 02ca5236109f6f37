//! The idempotent-request conformance suite against the real PostgreSQL server in
//! `IDEM_TEST_POSTGRES_URL`, on a deadpool pool and on plain clients, and the SQL stores'
//! extra request checks (byte-for-byte keys, results of several MiB, migrating twice), which
//! live with `idem-sql`'s tests and run here unchanged. Each test gets its own schema.

use idem_core::{BoxError, Migrate};
use idem_postgres::PgStore;
use idem_postgres::tokio_postgres::Client;
use idem_testkit::isolated::PgSchema;
use idem_testkit::{RequestFixture, RequestTxOf};

use crate::common::{self, Conns};

/// `CLIENTS`: the store on 4 plain clients instead of a pool of 20.
struct PgFixture<const CLIENTS: bool> {
    store: PgStore,
    admin: Client,
    schema: PgSchema,
}

impl<const CLIENTS: bool> std::fmt::Debug for PgFixture<CLIENTS> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgFixture")
            .field("store", &self.store)
            .field("schema", &self.schema)
            .finish()
    }
}

impl<const CLIENTS: bool> RequestFixture for PgFixture<CLIENTS> {
    type Store = PgStore;
    const SHARED_TRANSACTION: bool = true;

    async fn setup(test: &str) -> Option<Self> {
        let schema = PgSchema::create("idem_pgreq", test).await?;
        let config = common::config(&schema);
        let conns = if CLIENTS {
            Conns::Clients(4)
        } else {
            Conns::Pool(20)
        };
        let store = common::store(&config, conns).await;
        store.migrate().await.expect("migrate");
        let admin = common::client(&config).await;
        admin
            .batch_execute("CREATE TABLE effects (key text NOT NULL)")
            .await
            .expect("effects table");
        Some(Self {
            store,
            admin,
            schema,
        })
    }

    fn store(&self) -> PgStore {
        self.store.clone()
    }

    async fn record_effect(&self, tx: &mut RequestTxOf<Self>, key: &str) -> Result<(), BoxError> {
        tx.execute("INSERT INTO effects (key) VALUES ($1)", &[&key])
            .await?;
        Ok(())
    }

    async fn count_effects(&self, key: &str) -> i64 {
        common::count(
            &self.admin,
            "SELECT count(*) FROM effects WHERE key = $1",
            &[&key],
        )
        .await
    }

    async fn teardown(self) {
        drop(self.store);
        drop(self.admin);
        self.schema.drop().await;
    }
}

impl<const CLIENTS: bool> idem_testkit::RecoveryFixture for PgFixture<CLIENTS> {
    async fn legacy_store(
        &self,
        table: &str,
        completed: &idem_core::RequestKey,
        fingerprint: &idem_core::Fingerprint,
    ) -> PgStore {
        self.admin
            .batch_execute(&format!(
                "CREATE TABLE {table} (scope bytea NOT NULL, idem_key bytea NOT NULL, \
                 fingerprint bytea NOT NULL, state smallint NOT NULL, fence bigint NOT NULL, \
                 lease_until bigint NOT NULL, expires_at bigint NOT NULL, result bytea, \
                 PRIMARY KEY (scope, idem_key))"
            ))
            .await
            .expect("legacy table");
        self.admin
            .execute(
                &format!(
                    "INSERT INTO {table} VALUES ($1, $2, $3, 1, 1, 0, \
                     (extract(epoch from now()) * 1000000)::bigint + 86400000000, 'old')"
                ),
                &[
                    &&completed.scope.as_bytes()[..],
                    &completed.key.as_str().as_bytes(),
                    &&fingerprint.as_bytes()[..],
                ],
            )
            .await
            .expect("legacy row");
        self.store
            .clone()
            .with_requests_table(idem_core::TableName::new(table).expect("valid"))
            .expect("plain table")
    }
}

impl<const CLIENTS: bool> idem_testkit::CompleterFixture for PgFixture<CLIENTS> {
    fn refusing_store(&self) -> PgStore {
        self.store
            .clone()
            .with_requests_table(idem_core::TableName::new("no_such_requests").expect("valid"))
            .expect("plain table")
    }
}

mod pooled {
    use super::PgFixture;

    idem_testkit::request_conformance_tests!(PgFixture<false>);
    idem_testkit::recovery_conformance_tests!(PgFixture<false>);
    idem_testkit::phases_conformance_tests!(PgFixture<false>);
    idem_testkit::completer_conformance_tests!(PgFixture<false>);
    crate::request_extras::request_extras!(PgFixture<false>);
}

mod clients {
    use super::PgFixture;

    idem_testkit::request_conformance_tests!(PgFixture<true>);
    idem_testkit::recovery_conformance_tests!(PgFixture<true>);
    idem_testkit::phases_conformance_tests!(PgFixture<true>);
    idem_testkit::completer_conformance_tests!(PgFixture<true>);
    crate::request_extras::request_extras!(PgFixture<true>);
}
