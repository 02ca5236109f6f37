//! The outbox conformance suite against the real PostgreSQL server in
//! `IDEM_TEST_POSTGRES_URL`, on a deadpool pool and on plain clients. Each test gets its own
//! schema.

use idem_core::Migrate;
use idem_postgres::tokio_postgres::Client;
use idem_postgres::{PgStore, TableName};
use idem_testkit::OutboxFixture;
use idem_testkit::isolated::PgSchema;

use crate::common::{self, Conns};

/// `CLIENTS`: the store on 8 plain clients instead of a pool of 20.
struct PgFixture<const CLIENTS: bool> {
    store: PgStore,
    admin: Client,
    config: idem_postgres::tokio_postgres::Config,
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

impl<const CLIENTS: bool> OutboxFixture for PgFixture<CLIENTS> {
    type Store = PgStore;

    async fn setup(test: &str) -> Option<Self> {
        let schema = PgSchema::create("idem_pgoutbox", test).await?;
        let config = common::config(&schema);
        let conns = if CLIENTS {
            Conns::Clients(8)
        } else {
            Conns::Pool(20)
        };
        let store = common::store(&config, conns).await;
        store.migrate().await.expect("migrate");
        let admin = common::client(&config).await;
        Some(Self {
            store,
            admin,
            config,
            schema,
        })
    }

    fn store(&self) -> PgStore {
        self.store.clone()
    }

    fn unmigrated(&self) -> PgStore {
        self.store
            .clone()
            .with_outbox_table(TableName::new("never_migrated").expect("name"))
            .expect("name")
    }

    /// A client of its own inside `BEGIN`.
    type RowLock = Client;

    async fn lock_row(&self, id: &idem_core::MessageId) -> Option<Client> {
        let client = common::client(&self.config).await;
        client.batch_execute("BEGIN").await.expect("begin");
        client
            .execute(
                "SELECT 1 FROM idem_outbox WHERE message_id = $1 FOR UPDATE",
                &[&id.as_bytes()],
            )
            .await
            .expect("lock the row");
        Some(client)
    }

    async fn unlock_row(&self, lock: Client) {
        lock.batch_execute("ROLLBACK").await.expect("rollback");
    }

    async fn dead_letter_reason(&self, seq: i64) -> Option<String> {
        self.admin
            .query_opt(
                "SELECT reason FROM idem_outbox_dead_letters WHERE seq = $1",
                &[&seq],
            )
            .await
            .expect("read dead letter")
            .map(|r| r.get(0))
    }

    async fn teardown(self) {
        drop(self.store);
        drop(self.admin);
        self.schema.drop().await;
    }
}

mod pooled {
    use super::PgFixture;

    idem_testkit::outbox_conformance_tests!(PgFixture<false>);
}

mod clients {
    use super::PgFixture;

    idem_testkit::outbox_conformance_tests!(PgFixture<true>);
}
