//! The service's own tables and its one side effect: a charge row plus a balance update, written
//! through the transaction that also records the message's claim.

use idem_consumer::Handler;
use idem_core::{BoxError, Error, Identified, Message};
use idem_sql::{PgTx, Tx};
use serde::Deserialize;
use sqlx::{MySql, Sqlite};

/// The message this service consumes.
/// Unknown fields are ignored, so producers can add fields without every consumer
/// dead-lettering their messages first.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct PaymentRequested {
    pub(crate) account: String,
    pub(crate) amount_cents: i64,
}

impl PaymentRequested {
    /// Checks what the JSON types cannot: a message that fails here can never succeed, so it is
    /// rejected (dead-lettered) instead of retried.
    fn validate(&self) -> Result<(), Error> {
        if self.account.trim().is_empty() || self.account.len() > 255 {
            return Err(Error::reject("account must be 1 to 255 bytes"));
        }
        if self.amount_cents <= 0 {
            return Err(Error::reject(format!(
                "amount_cents must be positive, got {}",
                self.amount_cents
            )));
        }
        Ok(())
    }
}

/// `charges.message_id` is deliberately not unique: exactly-once is idem's job here, and the
/// example's tests count rows to prove it. A production schema may add the constraint as a
/// second line of defence.
const SQLITE_SCHEMA: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS charges (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        message_id TEXT NOT NULL,
        account TEXT NOT NULL,
        amount_cents INTEGER NOT NULL,
        charged_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP)",
    "CREATE INDEX IF NOT EXISTS charges_message_id ON charges (message_id)",
    "CREATE TABLE IF NOT EXISTS accounts (
        account TEXT PRIMARY KEY,
        balance_cents INTEGER NOT NULL)",
];

const POSTGRES_SCHEMA: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS charges (
        id BIGSERIAL PRIMARY KEY,
        message_id TEXT NOT NULL,
        account TEXT NOT NULL,
        amount_cents BIGINT NOT NULL,
        charged_at TIMESTAMPTZ NOT NULL DEFAULT now())",
    "CREATE INDEX IF NOT EXISTS charges_message_id ON charges (message_id)",
    "CREATE TABLE IF NOT EXISTS accounts (
        account TEXT PRIMARY KEY,
        balance_cents BIGINT NOT NULL)",
];

const MYSQL_SCHEMA: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS charges (
        id BIGINT AUTO_INCREMENT PRIMARY KEY,
        message_id VARBINARY(255) NOT NULL,
        account VARCHAR(255) NOT NULL,
        amount_cents BIGINT NOT NULL,
        charged_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
        INDEX charges_message_id (message_id))",
    "CREATE TABLE IF NOT EXISTS accounts (
        account VARCHAR(255) PRIMARY KEY,
        balance_cents BIGINT NOT NULL)",
];

/// Creates the service's tables if missing.
pub(crate) async fn create_sqlite(pool: &sqlx::SqlitePool) -> Result<(), sqlx::Error> {
    for ddl in SQLITE_SCHEMA {
        sqlx::query(ddl).execute(pool).await?;
    }
    Ok(())
}

/// Creates the service's tables if missing.
pub(crate) async fn create_postgres(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
    for ddl in POSTGRES_SCHEMA {
        sqlx::query(ddl).execute(pool).await?;
    }
    Ok(())
}

/// Creates the service's tables if missing.
pub(crate) async fn create_mysql(pool: &sqlx::MySqlPool) -> Result<(), sqlx::Error> {
    for ddl in MYSQL_SCHEMA {
        sqlx::query(ddl).execute(pool).await?;
    }
    Ok(())
}

/// Charges the account: one `charges` row and the balance, in the claim's transaction.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Charge;

impl Handler<Tx<Sqlite>, PaymentRequested> for Charge {
    type Output = ();
    async fn handle(
        &self,
        tx: &mut Tx<Sqlite>,
        msg: &Message<PaymentRequested>,
    ) -> Result<(), BoxError> {
        let p = msg.payload();
        p.validate()?;
        sqlx::query("INSERT INTO charges (message_id, account, amount_cents) VALUES (?, ?, ?)")
            .bind(msg.message_id().to_string())
            .bind(&p.account)
            .bind(p.amount_cents)
            .execute(&mut **tx)
            .await?;
        sqlx::query(
            "INSERT INTO accounts (account, balance_cents) VALUES (?, ?)
             ON CONFLICT (account) DO UPDATE SET balance_cents = balance_cents + excluded.balance_cents",
        )
        .bind(&p.account)
        .bind(p.amount_cents)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

impl Handler<PgTx, PaymentRequested> for Charge {
    type Output = ();
    async fn handle(&self, tx: &mut PgTx, msg: &Message<PaymentRequested>) -> Result<(), BoxError> {
        let p = msg.payload();
        p.validate()?;
        sqlx::query("INSERT INTO charges (message_id, account, amount_cents) VALUES ($1, $2, $3)")
            .bind(msg.message_id().to_string())
            .bind(&p.account)
            .bind(p.amount_cents)
            .execute(&mut **tx)
            .await?;
        sqlx::query(
            "INSERT INTO accounts (account, balance_cents) VALUES ($1, $2)
             ON CONFLICT (account) DO UPDATE SET balance_cents = accounts.balance_cents + excluded.balance_cents",
        )
        .bind(&p.account)
        .bind(p.amount_cents)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

impl Handler<Tx<MySql>, PaymentRequested> for Charge {
    type Output = ();
    async fn handle(
        &self,
        tx: &mut Tx<MySql>,
        msg: &Message<PaymentRequested>,
    ) -> Result<(), BoxError> {
        let p = msg.payload();
        p.validate()?;
        sqlx::query("INSERT INTO charges (message_id, account, amount_cents) VALUES (?, ?, ?)")
            .bind(msg.message_id().as_bytes())
            .bind(&p.account)
            .bind(p.amount_cents)
            .execute(&mut **tx)
            .await?;
        sqlx::query(
            "INSERT INTO accounts (account, balance_cents) VALUES (?, ?)
             ON DUPLICATE KEY UPDATE balance_cents = balance_cents + VALUES(balance_cents)",
        )
        .bind(&p.account)
        .bind(p.amount_cents)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}
