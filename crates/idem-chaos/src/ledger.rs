//! The database side of a run: a database of its own on the PostgreSQL server, and the check
//! of what the consumers committed there against what was sent.

use std::collections::{HashMap, HashSet};

use anyhow::{Context, Result};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Executor, PgPool};

/// A database created for one run and dropped after it.
#[derive(Debug)]
pub(crate) struct RunDatabase {
    /// The server, connected to its maintenance database (never the run's own).
    admin: PgPool,
    name: String,
    options: PgConnectOptions,
}

impl RunDatabase {
    /// Creates database `name` on the server of `url`.
    pub(crate) async fn create(url: &str, name: &str) -> Result<Self> {
        let options: PgConnectOptions = url
            .parse()
            .with_context(|| format!("--database {}", idem_redact::redact_url(url)))?;
        let admin = PgPoolOptions::new()
            .max_connections(2)
            .connect_with(options.clone().database("postgres"))
            .await
            .with_context(|| format!("connecting to {}", idem_redact::redact_url(url)))?;
        admin
            .execute(format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)").as_str())
            .await?;
        admin
            .execute(format!("CREATE DATABASE \"{name}\"").as_str())
            .await
            .context("creating the run's database")?;
        Ok(Self {
            admin,
            name: name.to_owned(),
            options: options.database(name),
        })
    }

    /// The run database's URL at `host:port` (the server's, or a proxy's in front of it).
    pub(crate) fn url_via(&self, host: &str, port: u16) -> String {
        let mut url = self.options.to_url_lossy();
        let _ = url.set_host(Some(host));
        let _ = url.set_port(Some(port));
        // The cut proxy reads the protocol in clear; TLS would hide COMMIT from it.
        url.query_pairs_mut().append_pair("sslmode", "disable");
        url.to_string()
    }

    pub(crate) fn host_port(&self) -> (String, u16) {
        (self.options.get_host().to_owned(), self.options.get_port())
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn admin(&self) -> &PgPool {
        &self.admin
    }

    /// A short-lived connection to the run's database for reading the ledger; read-only work,
    /// so it works during a read-only failover too.
    async fn reader(&self) -> Result<sqlx::PgConnection> {
        Ok(self.options.connect().await?)
    }

    /// Distinct message IDs with a charge so far (0 before the service created its tables).
    pub(crate) async fn charged_ids(&self) -> Result<u64> {
        self.distinct("charges", "message_id").await
    }

    /// Distinct values of `column` in `table` (the harness's own names), 0 while the table
    /// does not exist yet.
    async fn distinct(&self, table: &str, column: &str) -> Result<u64> {
        let mut conn = self.reader().await?;
        let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(table)
            .fetch_one(&mut conn)
            .await?;
        if !exists {
            return Ok(0);
        }
        let n: i64 = sqlx::query_scalar(&format!("SELECT count(DISTINCT {column}) FROM {table}"))
            .fetch_one(&mut conn)
            .await?;
        Ok(n.max(0) as u64)
    }

    /// Compares the ledger with what was sent.
    pub(crate) async fn check(&self, sent: &Sent) -> Result<LedgerCheck> {
        let mut conn = self.reader().await?;
        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT message_id, count(*) FROM charges GROUP BY message_id")
                .fetch_all(&mut conn)
                .await
                .context("reading charges")?;
        let balance: i64 =
            sqlx::query_scalar("SELECT coalesce(sum(balance_cents), 0)::bigint FROM accounts")
                .fetch_one(&mut conn)
                .await
                .context("reading balances")?;
        let counts: HashMap<String, i64> = rows.into_iter().collect();
        let mut check = LedgerCheck {
            effects: counts.values().map(|n| *n as u64).sum(),
            ..Default::default()
        };
        let mut expected_balance = 0i64;
        for (id, amount) in &sent.unique {
            match counts.get(id).copied().unwrap_or(0) {
                0 => {
                    check.lost += 1;
                    if check.lost_ids.len() < 20 {
                        check.lost_ids.push(id.clone());
                    }
                }
                1 => expected_balance += amount,
                n => {
                    check.duplicated += (n - 1) as u64;
                    expected_balance += amount * n;
                    if check.duplicated_ids.len() < 20 {
                        check.duplicated_ids.push(id.clone());
                    }
                }
            }
        }
        let known: HashSet<&String> = sent.unique.iter().map(|(id, _)| id).collect();
        check.unexpected = counts
            .iter()
            .filter(|(id, _)| !known.contains(id))
            .map(|(_, n)| *n as u64)
            .sum();
        // The balance moves in the same transaction as the charge row: any difference from
        // the charges means an effect committed half.
        check.balance_matches = balance == expected_balance;
        Ok(check)
    }

    /// Distinct payments with a receipt so far (`--two-hop`; 0 before the table exists).
    pub(crate) async fn receipted_ids(&self) -> Result<u64> {
        self.distinct("receipts", "payment_id").await
    }

    /// `--two-hop`: the second hop's receipts against what was sent: one per payment.
    pub(crate) async fn check_receipts(&self, sent: &Sent) -> Result<ReceiptCheck> {
        let mut conn = self.reader().await?;
        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT payment_id, count(*) FROM receipts GROUP BY payment_id")
                .fetch_all(&mut conn)
                .await
                .context("reading receipts")?;
        let counts: HashMap<String, i64> = rows.into_iter().collect();
        let mut check = ReceiptCheck {
            receipts: counts.values().map(|n| *n as u64).sum(),
            ..Default::default()
        };
        for (id, _) in &sent.unique {
            match counts.get(id).copied().unwrap_or(0) {
                0 => check.lost += 1,
                1 => {}
                n => check.duplicated += (n - 1) as u64,
            }
        }
        let known: HashSet<&String> = sent.unique.iter().map(|(id, _)| id).collect();
        check.unexpected = counts
            .iter()
            .filter(|(id, _)| !known.contains(id))
            .map(|(_, n)| *n as u64)
            .sum();
        Ok(check)
    }

    /// Drops the run's database.
    pub(crate) async fn drop_database(self) -> Result<()> {
        self.admin
            .execute(format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.name).as_str())
            .await?;
        Ok(())
    }
}

/// What the run published.
#[derive(Debug, Default)]
pub(crate) struct Sent {
    /// Each distinct message ID once, with its amount.
    pub(crate) unique: Vec<(String, i64)>,
    /// Every publish, repeats included, in publishing order.
    pub(crate) publishes: Vec<(String, Vec<u8>)>,
}

/// The receipts compared with what was sent.
#[derive(Debug, Default)]
pub(crate) struct ReceiptCheck {
    pub(crate) receipts: u64,
    pub(crate) lost: u64,
    pub(crate) duplicated: u64,
    pub(crate) unexpected: u64,
}

/// The ledger compared with what was sent.
#[derive(Debug, Default)]
pub(crate) struct LedgerCheck {
    pub(crate) effects: u64,
    pub(crate) lost: u64,
    pub(crate) duplicated: u64,
    pub(crate) unexpected: u64,
    pub(crate) balance_matches: bool,
    pub(crate) lost_ids: Vec<String>,
    pub(crate) duplicated_ids: Vec<String>,
}
