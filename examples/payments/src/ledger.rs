//! The service's own tables and its one side effect: a charge row plus a balance update, written
//! through the transaction that also records the message's claim.

use idem_consumer::Handler;
use idem_core::outbox::{Emitter, OutboxStore, Outgoing};
use idem_core::{BoxError, ConsumerName, Error, Identified, Message};
use idem_sql::{MySqlStore, PostgresStore, PostgresTx, SqliteStore, Tx};
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
    pub(crate) fn validate(&self) -> Result<(), Error> {
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
        charged_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP,
        processor_charge_id TEXT)",
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
        charged_at TIMESTAMPTZ NOT NULL DEFAULT now(),
        processor_charge_id TEXT)",
    // `--card-processor`'s column, on a table made before it.
    "ALTER TABLE charges ADD COLUMN IF NOT EXISTS processor_charge_id TEXT",
    "CREATE INDEX IF NOT EXISTS charges_message_id ON charges (message_id)",
    "CREATE TABLE IF NOT EXISTS accounts (
        account TEXT PRIMARY KEY,
        balance_cents BIGINT NOT NULL)",
];

/// Identifiers are `VARBINARY`, compared byte for byte as SQLite's and PostgreSQL's `TEXT`
/// are: under the server's default collation (`utf8mb4_general_ci`, `utf8mb4_0900_ai_ci`)
/// `"ALICE "` would be the same key as `"alice"` and be credited to it, and even `utf8mb4_bin`
/// pads trailing spaces. `CREATE TABLE IF NOT EXISTS` leaves tables made by an earlier version
/// as they are; convert them with `ALTER TABLE accounts MODIFY account VARBINARY(255) NOT NULL`
/// and `ALTER TABLE charges MODIFY account VARBINARY(255) NOT NULL`.
const MYSQL_SCHEMA: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS charges (
        id BIGINT AUTO_INCREMENT PRIMARY KEY,
        message_id VARBINARY(255) NOT NULL,
        account VARBINARY(255) NOT NULL,
        amount_cents BIGINT NOT NULL,
        charged_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
        processor_charge_id VARBINARY(255) NULL,
        INDEX charges_message_id (message_id))",
    "CREATE TABLE IF NOT EXISTS accounts (
        account VARBINARY(255) PRIMARY KEY,
        balance_cents BIGINT NOT NULL)",
];

/// Creates the service's tables if missing.
pub(crate) async fn create_sqlite(pool: &sqlx::SqlitePool) -> Result<(), sqlx::Error> {
    for ddl in SQLITE_SCHEMA.iter().chain(crate::receipts::SQLITE_SCHEMA) {
        sqlx::query(ddl).execute(pool).await?;
    }
    // `--card-processor`'s column, on a table made before it (SQLite has no `ADD COLUMN IF
    // NOT EXISTS`).
    let has: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pragma_table_info('charges') WHERE name = 'processor_charge_id'",
    )
    .fetch_one(pool)
    .await?;
    if has == 0 {
        sqlx::query("ALTER TABLE charges ADD COLUMN processor_charge_id TEXT")
            .execute(pool)
            .await?;
    }
    Ok(())
}

/// Creates the service's tables if missing.
///
/// Replicas starting together race on PostgreSQL's catalog even with `IF NOT EXISTS` (a
/// unique violation on `pg_type`), so the DDL runs under an advisory lock, as idem's own
/// `migrate` does.
pub(crate) async fn create_postgres(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('payments-migrate'))")
        .execute(&mut *tx)
        .await?;
    for ddl in POSTGRES_SCHEMA
        .iter()
        .chain(crate::receipts::POSTGRES_SCHEMA)
    {
        sqlx::query(ddl).execute(&mut *tx).await?;
    }
    tx.commit().await
}

/// Creates the service's tables if missing.
pub(crate) async fn create_mysql(pool: &sqlx::MySqlPool) -> Result<(), sqlx::Error> {
    for ddl in MYSQL_SCHEMA.iter().chain(crate::receipts::MYSQL_SCHEMA) {
        sqlx::query(ddl).execute(pool).await?;
    }
    // `--card-processor`'s column, on a table made before it (MySQL has no `ADD COLUMN IF
    // NOT EXISTS`). Replicas starting together may both add it: the loser's duplicate-column
    // error (1060) means it is there.
    let has: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.columns
         WHERE table_schema = DATABASE() AND table_name = 'charges' AND column_name = 'processor_charge_id'",
    )
    .fetch_one(pool)
    .await?;
    if has == 0 {
        let added =
            sqlx::query("ALTER TABLE charges ADD COLUMN processor_charge_id VARBINARY(255) NULL")
                .execute(pool)
                .await;
        match added {
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42S21") => {}
            other => {
                other?;
            }
        }
    }
    Ok(())
}

/// `--emit NAME`: each charge also enqueues a `PaymentCharged` event for destination `NAME` in
/// the outbox, in the claim's transaction, for the relay to publish.
#[derive(Debug, Clone)]
pub(crate) struct Emit<S> {
    /// The store whose outbox the events go to (the one whose transaction the handler has).
    pub(crate) store: S,
    /// The consumer the events' IDs derive from, with the incoming ID and the position.
    pub(crate) consumer: ConsumerName,
    pub(crate) destination: String,
}

/// The event `--emit` publishes: the incoming message's ID is the payment's ID, so a
/// downstream service can tie the event to the request; the event's own message ID is derived
/// from it (see [`Emitter`]).
pub(crate) fn payment_charged(msg: &Message<PaymentRequested>) -> Vec<u8> {
    serde_json::json!({
        "payment_id": msg.message_id().to_string(),
        "account": msg.payload().account,
        "amount_cents": msg.payload().amount_cents,
    })
    .to_string()
    .into_bytes()
}

impl<S: OutboxStore> Emit<S> {
    /// Enqueues one `PaymentCharged` per message in `tx`.
    pub(crate) async fn charged(
        &self,
        tx: &mut S::Tx,
        msgs: &[&Message<PaymentRequested>],
    ) -> Result<(), BoxError> {
        let events = msgs
            .iter()
            .map(|m| {
                // A new emitter per message and run: a re-run derives the same IDs.
                Emitter::for_message(&self.consumer, m.message_id())
                    .message(self.destination.as_str(), payment_charged(m))?
                    .header("type", "PaymentCharged")
            })
            .collect::<Result<Vec<Outgoing>, Error>>()?;
        self.store.enqueue(tx, &events).await?;
        Ok(())
    }
}

/// Enqueues `msgs`' events when `--emit` is on.
pub(crate) async fn emit_all<S: OutboxStore>(
    emit: &Option<Emit<S>>,
    tx: &mut S::Tx,
    msgs: &[&Message<PaymentRequested>],
) -> Result<(), BoxError> {
    match emit {
        Some(e) => e.charged(tx, msgs).await,
        None => Ok(()),
    }
}

/// Charges the account: one `charges` row and the balance, in the claim's transaction; with
/// `--emit`, a `PaymentCharged` event in the outbox too.
#[derive(Debug, Clone)]
pub(crate) struct Charge<S> {
    pub(crate) emit: Option<Emit<S>>,
}

impl<S> Charge<S> {
    /// Charges only.
    pub(crate) fn plain() -> Self {
        Self { emit: None }
    }
}

impl Handler<Tx<Sqlite>, PaymentRequested> for Charge<SqliteStore> {
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
        emit_all(&self.emit, tx, &[msg]).await
    }
}

impl Handler<PostgresTx, PaymentRequested> for Charge<PostgresStore> {
    type Output = ();
    async fn handle(
        &self,
        tx: &mut PostgresTx,
        msg: &Message<PaymentRequested>,
    ) -> Result<(), BoxError> {
        charge_postgres(tx, msg.message_id().to_string(), msg.payload()).await?;
        emit_all(&self.emit, tx, &[msg]).await
    }
}

/// The charge's effect on PostgreSQL, `Charge`'s and the bench's bare consumer's (which has no
/// claim and no `Message`): one row, one balance upsert.
pub(crate) async fn charge_postgres(
    conn: &mut sqlx::PgConnection,
    message_id: String,
    p: &PaymentRequested,
) -> Result<(), BoxError> {
    p.validate()?;
    sqlx::query("INSERT INTO charges (message_id, account, amount_cents) VALUES ($1, $2, $3)")
        .bind(message_id)
        .bind(&p.account)
        .bind(p.amount_cents)
        .execute(&mut *conn)
        .await?;
    sqlx::query(
        "INSERT INTO accounts (account, balance_cents) VALUES ($1, $2)
         ON CONFLICT (account) DO UPDATE SET balance_cents = accounts.balance_cents + excluded.balance_cents",
    )
    .bind(&p.account)
    .bind(p.amount_cents)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

impl Handler<Tx<MySql>, PaymentRequested> for Charge<MySqlStore> {
    type Output = ();
    async fn handle(
        &self,
        tx: &mut Tx<MySql>,
        msg: &Message<PaymentRequested>,
    ) -> Result<(), BoxError> {
        let p = msg.payload();
        p.validate()?;
        // Bytes for the VARBINARY columns: no charset conversion between the message and the key.
        sqlx::query("INSERT INTO charges (message_id, account, amount_cents) VALUES (?, ?, ?)")
            .bind(msg.message_id().as_bytes())
            .bind(p.account.as_bytes())
            .bind(p.amount_cents)
            .execute(&mut **tx)
            .await?;
        sqlx::query(
            "INSERT INTO accounts (account, balance_cents) VALUES (?, ?)
             ON DUPLICATE KEY UPDATE balance_cents = balance_cents + VALUES(balance_cents)",
        )
        .bind(p.account.as_bytes())
        .bind(p.amount_cents)
        .execute(&mut **tx)
        .await?;
        emit_all(&self.emit, tx, &[msg]).await
    }
}

/// The service's consume path (decode, claim, `Charge`, commit) over the in-memory broker, on
/// each real database: accounts are kept apart exactly as producers spell them.
#[cfg(test)]
mod tests {
    use idem_consumer::{CancellationToken, InMemoryBroker};
    use idem_testkit::{service_url, services, unique_name};

    use crate::{Database, Settings};

    /// Account names a case- or pad-insensitive key would merge, with what each is charged.
    const PAYMENTS: &[(&str, i64)] = &[
        ("alice", 100),
        ("ALICE", 200),
        ("alice ", 400),
        ("alice", 1000),
    ];
    const EXPECTED: &[(&str, i64)] = &[("ALICE", 200), ("alice", 1100), ("alice ", 400)];

    /// Consumes `PAYMENTS` into the database at `url` in each mode in turn (per message,
    /// batches with `Charge`, batches with `ChargeBatch`; each its own consumer, so each
    /// processes them anew), then checks the balances and charges that `read` returns.
    async fn accounts_stay_distinct<F, Fut>(url: &str, read: F)
    where
        F: Fn(&'static str) -> Fut,
        Fut: std::future::Future<Output = Vec<(String, i64)>>,
    {
        let db = Database::open(url).await.expect("open the database");
        let sorted = |mut rows: Vec<(String, i64)>| {
            rows.sort();
            rows
        };
        let modes = [
            ("per-message", 1, false),
            ("batch", 4, false),
            ("set", 4, true),
        ];
        for (runs, (mode, batch, set)) in (1i64..).zip(modes) {
            let broker = InMemoryBroker::new();
            for (i, (account, amount)) in PAYMENTS.iter().enumerate() {
                let payload = serde_json::json!({ "account": account, "amount_cents": amount });
                let id = format!("pay-{i}");
                broker.publish(&[("message-id", id.as_bytes())], payload.to_string());
            }
            broker.close();
            let settings = Settings {
                source: "payments".to_owned(),
                consumer: format!("payments-{mode}"),
                instance: "test".to_owned(),
                concurrency: 1,
                batch,
                set,
                retention: idem_core::Retention::default(),
                local_cache: None,
                redeliver_after: None,
                static_membership: true,
                emit: None,
                receipts: false,
                card: None,
                shutdown: CancellationToken::new(),
            };
            let stats = db
                .clone()
                .consume(broker.source(), &settings)
                .await
                .expect("consume");
            assert_eq!(stats.processed, 4, "{mode}: {stats:?}");

            let expected: Vec<(String, i64)> = EXPECTED
                .iter()
                .map(|(a, n)| ((*a).to_owned(), *n * runs))
                .collect();
            assert_eq!(
                sorted(read("SELECT account, balance_cents FROM accounts").await),
                expected,
                "balances after {mode} on {}",
                idem_redact::redact_url(url)
            );
            let sent: Vec<(String, i64)> = (0..runs)
                .flat_map(|_| PAYMENTS.iter().map(|(a, n)| ((*a).to_owned(), *n)))
                .collect();
            assert_eq!(
                sorted(read("SELECT account, amount_cents FROM charges").await),
                sorted(sent),
                "{mode}: charges keep the account as sent"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_accounts_differing_in_case_or_trailing_space_are_distinct() {
        let dir = std::env::temp_dir().join(unique_name("payments", "ledger_sqlite"));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let url = format!("sqlite:{}", dir.join("payments.db").display());
        let pool = sqlx::SqlitePool::connect_lazy(&url).expect("pool");
        accounts_stay_distinct(&url, |sql| {
            let pool = pool.clone();
            async move { sqlx::query_as(sql).fetch_all(&pool).await.expect(sql) }
        })
        .await;
        pool.close().await;
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_accounts_differing_in_case_or_trailing_space_are_distinct() {
        let test = "postgres_accounts_differing_in_case_or_trailing_space_are_distinct";
        let Some(base) = service_url(services::POSTGRES, test) else {
            return;
        };
        // Its own schema: the example's tables have fixed names.
        let schema = unique_name("payments", "ledger");
        let admin = sqlx::PgPool::connect(&base).await.expect("connect");
        sqlx::query(&format!("CREATE SCHEMA {schema}"))
            .execute(&admin)
            .await
            .expect("create schema");
        let mut url = url::Url::parse(&base).expect("IDEM_TEST_POSTGRES_URL is a URL");
        url.query_pairs_mut()
            .append_pair("options", &format!("-c search_path={schema}"));
        let pool = sqlx::PgPool::connect(url.as_str()).await.expect("connect");
        accounts_stay_distinct(url.as_str(), |sql| {
            let pool = pool.clone();
            async move { sqlx::query_as(sql).fetch_all(&pool).await.expect(sql) }
        })
        .await;
        pool.close().await;
        sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
            .execute(&admin)
            .await
            .expect("drop schema");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_accounts_differing_in_case_or_trailing_space_are_distinct() {
        let test = "mysql_accounts_differing_in_case_or_trailing_space_are_distinct";
        let Some(base) = service_url(services::MYSQL, test) else {
            return;
        };
        // Its own database: the example's tables have fixed names.
        let name = unique_name("payments", "ledger");
        let admin = sqlx::MySqlPool::connect(&base).await.expect("connect");
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&admin)
            .await
            .expect("create database");
        let mut url = url::Url::parse(&base).expect("IDEM_TEST_MYSQL_URL is a URL");
        url.set_path(&name);
        let pool = sqlx::MySqlPool::connect(url.as_str())
            .await
            .expect("connect");
        accounts_stay_distinct(url.as_str(), |sql| {
            let pool = pool.clone();
            async move {
                // VARBINARY columns read as bytes.
                let rows: Vec<(Vec<u8>, i64)> =
                    sqlx::query_as(sql).fetch_all(&pool).await.expect(sql);
                rows.into_iter()
                    .map(|(a, n)| (String::from_utf8(a).expect("UTF-8 account"), n))
                    .collect()
            }
        })
        .await;
        pool.close().await;
        sqlx::query(&format!("DROP DATABASE {name}"))
            .execute(&admin)
            .await
            .expect("drop database");
    }
}
