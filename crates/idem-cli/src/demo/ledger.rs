//! The demo's SQLite ledger: its schema, the charge itself, dead letters, and the audit that
//! the report is computed from.
//!
//! `charges` deliberately has no unique constraint on `message_id`: the ledger is ordinary
//! application data, and keeping it from double-charging is the consumer's job (the claim,
//! committed in the same transaction). That is what lets `--naive` show the damage, and lets
//! anyone check it afterwards with `sqlite3`.

use anyhow::Context;
use idem_core::store::prune_all;
use idem_core::{BoxError, ConsumerName, Error, Stamp, Timestamp};
use idem_sql::SqliteStore;
use sqlx::SqliteConnection;
use sqlx::sqlite::SqlitePool;
use std::time::Duration;

use super::producer::{ACCOUNTS, Envelope, PaymentRequested, account_name};

/// Every table the demo owns, children first so foreign keys never block the drop.
const DEMO_TABLES: [&str; 5] = [
    "charges",
    "dead_letters",
    "naive_processed",
    "payment_requests",
    "accounts",
];

const SCHEMA: [&str; 6] = [
    // What the producer sent: the reference the audit compares the ledger against.
    "CREATE TABLE payment_requests (
        message_id   TEXT    PRIMARY KEY,
        account      TEXT    NOT NULL,
        amount_cents INTEGER NOT NULL
    )",
    "CREATE TABLE accounts (
        account       TEXT    PRIMARY KEY,
        balance_cents INTEGER NOT NULL DEFAULT 0
    )",
    // One row per charge; no UNIQUE (message_id), see the module docs.
    "CREATE TABLE charges (
        id           INTEGER PRIMARY KEY,
        message_id   TEXT    NOT NULL,
        account      TEXT    NOT NULL REFERENCES accounts (account),
        amount_cents INTEGER NOT NULL
    )",
    "CREATE INDEX charges_message_id ON charges (message_id)",
    "CREATE TABLE dead_letters (
        id         INTEGER PRIMARY KEY,
        message_id TEXT    NOT NULL,
        reason     TEXT    NOT NULL,
        payload    TEXT    NOT NULL
    )",
    // The naive consumer's own "already processed?" table (`--naive` only).
    "CREATE TABLE naive_processed (
        message_id TEXT PRIMARY KEY
    )",
];

/// Drops and recreates the demo's tables and deletes the demo consumer's claims, so every run
/// starts from an empty ledger. Other consumers' claims in the same file are left alone.
pub(crate) async fn reset(store: &SqliteStore, consumer: &ConsumerName) -> anyhow::Result<()> {
    let mut tx = store.begin_tx().await?;
    for table in DEMO_TABLES {
        sqlx::query(&format!("DROP TABLE IF EXISTS {table}"))
            .execute(&mut *tx)
            .await
            .with_context(|| format!("SQLite: dropping the demo table {table}"))?;
    }
    for sql in SCHEMA {
        sqlx::query(sql)
            .execute(&mut *tx)
            .await
            .context("SQLite: creating the demo tables")?;
    }
    tx.commit()
        .await
        .context("SQLite: committing the demo schema")?;
    // A rerun uses the same message IDs: last run's claims would turn all of them into
    // duplicates. Pruning "everything older than the end of time" removes them.
    prune_all(
        store,
        Some(consumer),
        Stamp::At(Timestamp::from_micros(i64::MAX)),
        Duration::ZERO,
        10_000,
    )
    .await
    .context("deleting the previous run's claims")?;
    Ok(())
}

/// Opens the accounts at zero and records what the producer is about to send.
pub(crate) async fn record_requests(
    store: &SqliteStore,
    requests: &[std::sync::Arc<Envelope>],
) -> anyhow::Result<()> {
    let mut tx = store.begin_tx().await?;
    for i in 0..ACCOUNTS {
        sqlx::query("INSERT INTO accounts (account) VALUES (?1)")
            .bind(account_name(i))
            .execute(&mut *tx)
            .await
            .context("SQLite: opening the demo accounts")?;
    }
    for r in requests {
        sqlx::query(
            "INSERT INTO payment_requests (message_id, account, amount_cents) VALUES (?1, ?2, ?3)",
        )
        .bind(&r.id)
        .bind(&r.payment.account)
        .bind(r.payment.amount_cents)
        .execute(&mut *tx)
        .await
        .context("SQLite: recording the payment requests")?;
    }
    tx.commit()
        .await
        .context("SQLite: committing the payment requests")?;
    Ok(())
}

/// The side effect: one charge row and the balance update, on the caller's connection so they
/// commit or roll back with whatever else the caller's transaction holds (the claim, for idem).
pub(crate) async fn charge(
    conn: &mut SqliteConnection,
    message_id: &str,
    payment: &PaymentRequested,
) -> Result<(), BoxError> {
    sqlx::query("INSERT INTO charges (message_id, account, amount_cents) VALUES (?1, ?2, ?3)")
        .bind(message_id)
        .bind(&payment.account)
        .bind(payment.amount_cents)
        .execute(&mut *conn)
        .await?;
    let updated =
        sqlx::query("UPDATE accounts SET balance_cents = balance_cents + ?1 WHERE account = ?2")
            .bind(payment.amount_cents)
            .bind(&payment.account)
            .execute(&mut *conn)
            .await?;
    if updated.rows_affected() == 0 {
        // Retrying cannot create the account: dead-letter instead of looping.
        return Err(Error::reject(format!("unknown account {:?}", payment.account)).into());
    }
    Ok(())
}

/// Records a message the consumer gave up on, with the reason.
pub(crate) async fn dead_letter(
    pool: &SqlitePool,
    message_id: &str,
    payload: &[u8],
    reason: &str,
) -> anyhow::Result<()> {
    let payload = String::from_utf8_lossy(payload);
    sqlx::query("INSERT INTO dead_letters (message_id, reason, payload) VALUES (?1, ?2, ?3)")
        .bind(message_id)
        .bind(reason)
        .bind(payload.as_ref())
        .execute(pool)
        .await
        .with_context(|| format!("SQLite: recording dead letter {message_id}"))?;
    Ok(())
}

/// What the database says happened: the numbers of the report.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Audit {
    /// Rows in `charges`.
    pub(crate) charges: u64,
    /// Distinct message IDs in `charges`.
    pub(crate) charged_messages: u64,
    /// Extra charges: `charges - charged_messages`.
    pub(crate) double_charges: u64,
    /// Messages charged more than once.
    pub(crate) double_charged_messages: u64,
    /// Requested messages with no charge row at all.
    pub(crate) lost: u64,
    /// Rows in `dead_letters`.
    pub(crate) dead_letters: u64,
    /// Sum of all charges.
    pub(crate) charged_cents: i64,
    /// Charged minus requested, over the messages that were charged: money taken twice.
    pub(crate) overcharged_cents: i64,
    /// Whether the account balances add up to the sum of the charges.
    pub(crate) balances_match: bool,
}

/// Reads the ledger back and counts.
pub(crate) async fn audit(pool: &SqlitePool) -> anyhow::Result<Audit> {
    let (charges, charged_messages, charged_cents): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT message_id), coalesce(sum(amount_cents), 0) FROM charges",
    )
    .fetch_one(pool)
    .await
    .context("SQLite: counting charges")?;
    let double_charged_messages: i64 = scalar(
        pool,
        "SELECT count(*) FROM \
         (SELECT message_id FROM charges GROUP BY message_id HAVING count(*) > 1)",
    )
    .await?;
    let lost: i64 = scalar(
        pool,
        "SELECT count(*) FROM payment_requests p \
         WHERE NOT EXISTS (SELECT 1 FROM charges c WHERE c.message_id = p.message_id)",
    )
    .await?;
    let requested_cents_of_charged: i64 = scalar(
        pool,
        "SELECT coalesce(sum(amount_cents), 0) FROM payment_requests p \
         WHERE EXISTS (SELECT 1 FROM charges c WHERE c.message_id = p.message_id)",
    )
    .await?;
    let balances_cents: i64 =
        scalar(pool, "SELECT coalesce(sum(balance_cents), 0) FROM accounts").await?;
    let dead_letters: i64 = scalar(pool, "SELECT count(*) FROM dead_letters").await?;
    Ok(Audit {
        charges: count(charges),
        charged_messages: count(charged_messages),
        double_charges: count(charges - charged_messages),
        double_charged_messages: count(double_charged_messages),
        lost: count(lost),
        dead_letters: count(dead_letters),
        charged_cents,
        overcharged_cents: charged_cents - requested_cents_of_charged,
        balances_match: balances_cents == charged_cents,
    })
}

async fn scalar(pool: &SqlitePool, sql: &str) -> anyhow::Result<i64> {
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .with_context(|| format!("SQLite: auditing the ledger ({sql})"))
}

/// SQL counts are never negative; clamp rather than fail if one somehow were.
fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}
