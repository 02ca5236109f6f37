//! The idempotent-request conformance suite against the real MySQL/MariaDB server in
//! `IDEM_TEST_MYSQL_URL`. Each test gets its own database, so tests run in parallel.

mod request_extras;

use std::str::FromStr;

use idem_core::{BoxError, Migrate};
use idem_sql::MySqlStore;
use idem_testkit::{RequestFixture, RequestTxOf, service_url, services, unique_name};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};

#[derive(Debug)]
struct MySqlFixture {
    store: MySqlStore,
    database: String,
    url: String,
}

impl RequestFixture for MySqlFixture {
    type Store = MySqlStore;
    const SHARED_TRANSACTION: bool = true;

    async fn setup(test: &str) -> Option<Self> {
        let url = service_url(services::MYSQL, test)?;
        let database = unique_name("idem_req", test);
        let admin = MySqlPoolOptions::new()
            .max_connections(1)
            .connect(&url)
            .await;
        let admin = admin.expect("connect to IDEM_TEST_MYSQL_URL");
        sqlx::query(&format!("CREATE DATABASE {database}"))
            .execute(&admin)
            .await
            .expect("create database");
        admin.close().await;
        let options = MySqlConnectOptions::from_str(&url)
            .expect("valid URL")
            .database(&database);
        let pool = MySqlPoolOptions::new()
            .max_connections(20)
            .connect_with(options)
            .await
            .expect("connect");
        let store = MySqlStore::from_pool(pool);
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE effects (k VARCHAR(255) NOT NULL) ENGINE = InnoDB")
            .execute(store.pool())
            .await
            .expect("effects table");
        Some(Self {
            store,
            database,
            url,
        })
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
        if let Ok(admin) = MySqlPoolOptions::new()
            .max_connections(1)
            .connect(&self.url)
            .await
        {
            let _ = sqlx::query(&format!("DROP DATABASE {}", self.database))
                .execute(&admin)
                .await;
        }
    }
}

idem_testkit::request_conformance_tests!(MySqlFixture);
request_extras::request_extras!(MySqlFixture);
