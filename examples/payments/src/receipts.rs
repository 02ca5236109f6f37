//! `--receipts`: the second hop of a two-hop run. Consumes the `PaymentCharged` events a
//! `payments --emit NAME` service relays to `NAME`, and records one receipt per event, exactly
//! once: the event's derived message ID is the claim, so a relay's resend (after a crash
//! between the broker's confirm and the mark) is a duplicate here.

use idem_consumer::Handler;
use idem_core::{BoxError, Error, Identified, Message};
use idem_sql::{PostgresTx, Tx};
use serde::Deserialize;
use sqlx::{MySql, Sqlite};

/// The event `payments --emit` publishes (see [`crate::ledger::payment_charged`]).
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct PaymentCharged {
    /// The incoming `PaymentRequested` message's ID.
    pub(crate) payment_id: String,
    pub(crate) account: String,
    pub(crate) amount_cents: i64,
}

impl PaymentCharged {
    fn validate(&self) -> Result<(), Error> {
        if self.payment_id.is_empty() || self.payment_id.len() > 255 {
            return Err(Error::reject("payment_id must be 1 to 255 bytes"));
        }
        if self.account.is_empty() || self.account.len() > 255 {
            return Err(Error::reject("account must be 1 to 255 bytes"));
        }
        Ok(())
    }
}

/// As for `charges`, `receipts.payment_id` is deliberately not unique: the tests count rows to
/// prove that each event is recorded once.
pub(crate) const SQLITE_SCHEMA: &[&str] = &["CREATE TABLE IF NOT EXISTS receipts (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        event_id TEXT NOT NULL,
        payment_id TEXT NOT NULL,
        account TEXT NOT NULL,
        amount_cents INTEGER NOT NULL)"];

pub(crate) const POSTGRES_SCHEMA: &[&str] = &["CREATE TABLE IF NOT EXISTS receipts (
        id BIGSERIAL PRIMARY KEY,
        event_id TEXT NOT NULL,
        payment_id TEXT NOT NULL,
        account TEXT NOT NULL,
        amount_cents BIGINT NOT NULL)"];

pub(crate) const MYSQL_SCHEMA: &[&str] = &["CREATE TABLE IF NOT EXISTS receipts (
        id BIGINT AUTO_INCREMENT PRIMARY KEY,
        event_id VARBINARY(255) NOT NULL,
        payment_id VARBINARY(255) NOT NULL,
        account VARBINARY(255) NOT NULL,
        amount_cents BIGINT NOT NULL)"];

/// Records the receipt in the claim's transaction.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Receipt;

impl Handler<Tx<Sqlite>, PaymentCharged> for Receipt {
    type Output = ();
    async fn handle(
        &self,
        tx: &mut Tx<Sqlite>,
        msg: &Message<PaymentCharged>,
    ) -> Result<(), BoxError> {
        let e = msg.payload();
        e.validate()?;
        sqlx::query(
            "INSERT INTO receipts (event_id, payment_id, account, amount_cents) VALUES (?, ?, ?, ?)",
        )
        .bind(msg.message_id().to_string())
        .bind(&e.payment_id)
        .bind(&e.account)
        .bind(e.amount_cents)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

impl Handler<PostgresTx, PaymentCharged> for Receipt {
    type Output = ();
    async fn handle(
        &self,
        tx: &mut PostgresTx,
        msg: &Message<PaymentCharged>,
    ) -> Result<(), BoxError> {
        let e = msg.payload();
        e.validate()?;
        sqlx::query(
            "INSERT INTO receipts (event_id, payment_id, account, amount_cents) VALUES ($1, $2, $3, $4)",
        )
        .bind(msg.message_id().to_string())
        .bind(&e.payment_id)
        .bind(&e.account)
        .bind(e.amount_cents)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

impl Handler<Tx<MySql>, PaymentCharged> for Receipt {
    type Output = ();
    async fn handle(
        &self,
        tx: &mut Tx<MySql>,
        msg: &Message<PaymentCharged>,
    ) -> Result<(), BoxError> {
        let e = msg.payload();
        e.validate()?;
        sqlx::query(
            "INSERT INTO receipts (event_id, payment_id, account, amount_cents) VALUES (?, ?, ?, ?)",
        )
        .bind(msg.message_id().as_bytes())
        .bind(e.payment_id.as_bytes())
        .bind(e.account.as_bytes())
        .bind(e.amount_cents)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}
