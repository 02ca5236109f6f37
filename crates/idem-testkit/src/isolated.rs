//! A namespace of its own on a shared server, per test: a PostgreSQL schema (first on the
//! pool's `search_path`) or a MySQL database, created from the service URL and dropped at the
//! end, so tests run in parallel on one server without seeing each other's tables.

use std::str::FromStr;

use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

use crate::services::{self, service_url, unique_name};

/// A schema named after the test on the server in `IDEM_TEST_POSTGRES_URL`.
#[derive(Clone)]
pub struct PgSchema {
    url: String,
    name: String,
}

/// The service URL may hold a password: shown through [`idem_redact::redact_url`].
impl std::fmt::Debug for PgSchema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgSchema")
            .field("url", &idem_redact::redact_url(&self.url))
            .field("name", &self.name)
            .finish()
    }
}

impl PgSchema {
    /// Creates it; `None` (after printing `SKIPPING`) when the service is not configured.
    pub async fn create(prefix: &str, test: &str) -> Option<Self> {
        let url = service_url(services::POSTGRES, test)?;
        let name = unique_name(prefix, test);
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect(&url)
            .await
            .expect("connect to IDEM_TEST_POSTGRES_URL");
        sqlx::query(&format!("CREATE SCHEMA {name}"))
            .execute(&admin)
            .await
            .expect("create schema");
        admin.close().await;
        Some(Self { url, name })
    }

    /// The schema's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The server's URL, as configured.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Connection options with the schema first on `search_path`.
    pub fn options(&self) -> PgConnectOptions {
        PgConnectOptions::from_str(&self.url)
            .expect("valid IDEM_TEST_POSTGRES_URL")
            .options([("search_path", self.name.as_str())])
    }

    /// A pool of up to `max` connections into the schema.
    pub async fn pool(&self, max: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(max)
            .connect_with(self.options())
            .await
            .expect("connect to the test schema")
    }

    /// Drops the schema and everything in it.
    pub async fn drop(&self) {
        if let Ok(admin) = PgPoolOptions::new()
            .max_connections(1)
            .connect(&self.url)
            .await
        {
            let _ = sqlx::query(&format!("DROP SCHEMA {} CASCADE", self.name))
                .execute(&admin)
                .await;
            admin.close().await;
        }
    }
}

/// A database named after the test on the server in `IDEM_TEST_MYSQL_URL`.
#[derive(Clone)]
pub struct MySqlDatabase {
    url: String,
    name: String,
}

/// The service URL may hold a password: shown through [`idem_redact::redact_url`].
impl std::fmt::Debug for MySqlDatabase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlDatabase")
            .field("url", &idem_redact::redact_url(&self.url))
            .field("name", &self.name)
            .finish()
    }
}

impl MySqlDatabase {
    /// Creates it; `None` (after printing `SKIPPING`) when the service is not configured.
    pub async fn create(prefix: &str, test: &str) -> Option<Self> {
        let url = service_url(services::MYSQL, test)?;
        let name = unique_name(prefix, test);
        let admin = MySqlPoolOptions::new()
            .max_connections(1)
            .connect(&url)
            .await
            .expect("connect to IDEM_TEST_MYSQL_URL");
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&admin)
            .await
            .expect("create database");
        admin.close().await;
        Some(Self { url, name })
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The server's URL, as configured.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Connection options selecting the database.
    pub fn options(&self) -> MySqlConnectOptions {
        MySqlConnectOptions::from_str(&self.url)
            .expect("valid IDEM_TEST_MYSQL_URL")
            .database(&self.name)
    }

    /// A pool of up to `max` connections into the database.
    pub async fn pool(&self, max: u32) -> MySqlPool {
        MySqlPoolOptions::new()
            .max_connections(max)
            .connect_with(self.options())
            .await
            .expect("connect to the test database")
    }

    /// Drops the database and everything in it.
    pub async fn drop(&self) {
        if let Ok(admin) = MySqlPoolOptions::new()
            .max_connections(1)
            .connect(&self.url)
            .await
        {
            let _ = sqlx::query(&format!("DROP DATABASE {}", self.name))
                .execute(&admin)
                .await;
            admin.close().await;
        }
    }
}
