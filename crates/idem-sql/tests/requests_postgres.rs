//! The idempotent-request conformance suite against the real PostgreSQL server in
//! `IDEM_TEST_POSTGRES_URL`. Each test gets its own schema (first on the pool's `search_path`),
//! so tests run in parallel.

mod request_extras;

use std::str::FromStr;

use idem_core::{BoxError, Migrate};
use idem_sql::PostgresStore;
use idem_testkit::{RequestFixture, RequestTxOf, service_url, services, unique_name};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[derive(Debug)]
struct PgFixture {
    store: PostgresStore,
    schema: String,
    url: String,
}

impl RequestFixture for PgFixture {
    type Store = PostgresStore;
    const SHARED_TRANSACTION: bool = true;

    async fn setup(test: &str) -> Option<Self> {
        let url = service_url(services::POSTGRES, test)?;
        let schema = unique_name("idem_req", test);
        let admin = PgPoolOptions::new().max_connections(1).connect(&url).await;
        let admin = admin.expect("connect to IDEM_TEST_POSTGRES_URL");
        sqlx::query(&format!("CREATE SCHEMA {schema}"))
            .execute(&admin)
            .await
            .expect("create schema");
        admin.close().await;
        let options = PgConnectOptions::from_str(&url)
            .expect("valid URL")
            .options([("search_path", schema.as_str())]);
        let pool = PgPoolOptions::new()
            .max_connections(20)
            .connect_with(options)
            .await
            .expect("connect");
        let store = PostgresStore::from_pool(pool);
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE effects (key text NOT NULL)")
            .execute(store.pool())
            .await
            .expect("effects table");
        Some(Self { store, schema, url })
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
        if let Ok(admin) = PgPoolOptions::new()
            .max_connections(1)
            .connect(&self.url)
            .await
        {
            let _ = sqlx::query(&format!("DROP SCHEMA {} CASCADE", self.schema))
                .execute(&admin)
                .await;
        }
    }
}

idem_testkit::request_conformance_tests!(PgFixture);
request_extras::request_extras!(PgFixture);
