//! The database side of a run: a database of its own (on the PostgreSQL or MySQL server, or
//! an SQLite file the processes share), and the check of what the consumers committed there
//! against what was sent.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode};
use sqlx::{ConnectOptions, Executor, MySqlPool, PgPool};

/// A database created for one run and dropped after it.
#[derive(Debug)]
pub(crate) struct RunDatabase {
    server: Server,
    name: String,
}

/// Where the run's database lives. The PostgreSQL and MySQL admin pools are connected to
/// the server's maintenance database (never the run's own).
#[derive(Debug)]
enum Server {
    Postgres {
        admin: PgPool,
        options: PgConnectOptions,
    },
    MySql {
        admin: MySqlPool,
        options: MySqlConnectOptions,
    },
    Sqlite {
        path: PathBuf,
    },
}

impl RunDatabase {
    /// Creates database `name` on the server of `url` (`postgres://…`, `mysql://…`), or, for
    /// `sqlite:`, the file `<name>.db` in `dir` (or in the folder the URL names after the
    /// scheme).
    pub(crate) async fn create(url: &str, name: &str, dir: &Path) -> Result<Self> {
        let shown = idem_redact::redact_url(url);
        let scheme = url
            .split(':')
            .next()
            .unwrap_or_default()
            .to_ascii_lowercase();
        let server = match scheme.as_str() {
            "postgres" | "postgresql" => {
                let options: PgConnectOptions =
                    url.parse().with_context(|| format!("--database {shown}"))?;
                let admin = PgPoolOptions::new()
                    .max_connections(2)
                    .connect_with(options.clone().database("postgres"))
                    .await
                    .with_context(|| format!("connecting to {shown}"))?;
                admin
                    .execute(format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)").as_str())
                    .await?;
                admin
                    .execute(format!("CREATE DATABASE \"{name}\"").as_str())
                    .await
                    .context("creating the run's database")?;
                Server::Postgres {
                    admin,
                    options: options.database(name),
                }
            }
            "mysql" | "mariadb" => {
                let url = url.replacen("mariadb:", "mysql:", 1);
                let options: MySqlConnectOptions =
                    url.parse().with_context(|| format!("--database {shown}"))?;
                let admin = MySqlPoolOptions::new()
                    .max_connections(2)
                    .connect_with(options.clone())
                    .await
                    .with_context(|| format!("connecting to {shown}"))?;
                admin
                    .execute(format!("DROP DATABASE IF EXISTS `{name}`").as_str())
                    .await?;
                admin
                    .execute(format!("CREATE DATABASE `{name}`").as_str())
                    .await
                    .context("creating the run's database")?;
                Server::MySql {
                    admin,
                    options: options.database(name),
                }
            }
            "sqlite" => {
                let folder = url["sqlite:".len()..].trim_start_matches("//");
                let folder = match folder {
                    "" => dir.to_owned(),
                    f => PathBuf::from(f),
                };
                std::fs::create_dir_all(&folder)
                    .with_context(|| format!("creating {}", folder.display()))?;
                let path = folder.join(format!("{name}.db"));
                let _ = std::fs::remove_file(&path);
                // Created here, in WAL mode, so the checker can read it before any service
                // has opened it, and the services find the journal mode they set anyway.
                SqliteConnectOptions::new()
                    .filename(&path)
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal)
                    .connect()
                    .await
                    .with_context(|| format!("creating {}", path.display()))?;
                Server::Sqlite { path }
            }
            _ => bail!("--database {shown}: expected postgres://…, mysql://… or sqlite:"),
        };
        Ok(Self {
            server,
            name: name.to_owned(),
        })
    }

    /// The engine, as a word for the report.
    pub(crate) fn engine(&self) -> &'static str {
        match self.server {
            Server::Postgres { .. } => "postgres",
            Server::MySql { .. } => "mysql",
            Server::Sqlite { .. } => "sqlite",
        }
    }

    /// The URL the services connect with: the run database on its server, or through a
    /// proxy at `127.0.0.1:proxy` (PostgreSQL only, checked by the run).
    pub(crate) fn service_url(&self, proxy: Option<u16>) -> String {
        match &self.server {
            Server::Postgres { options, .. } => {
                let mut url = options.to_url_lossy();
                if let Some(port) = proxy {
                    let _ = url.set_host(Some("127.0.0.1"));
                    let _ = url.set_port(Some(port));
                }
                // The cut proxy reads the protocol in clear; TLS would hide COMMIT from it.
                url.query_pairs_mut().append_pair("sslmode", "disable");
                url.to_string()
            }
            Server::MySql { options, .. } => options.to_url_lossy().to_string(),
            Server::Sqlite { path } => format!("sqlite:{}", path.display()),
        }
    }

    /// The PostgreSQL server's host and port (for the cut proxy).
    pub(crate) fn host_port(&self) -> Result<(String, u16)> {
        match &self.server {
            Server::Postgres { options, .. } => {
                Ok((options.get_host().to_owned(), options.get_port()))
            }
            _ => bail!("only a PostgreSQL database has connections to cut"),
        }
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The PostgreSQL server's admin pool, for the database faults (PostgreSQL only).
    pub(crate) fn admin(&self) -> Result<&PgPool> {
        match &self.server {
            Server::Postgres { admin, .. } => Ok(admin),
            _ => bail!("database faults are PostgreSQL's"),
        }
    }

    /// A short-lived connection to the run's database for reading the ledger; read-only work,
    /// so it works during a read-only failover too.
    async fn reader(&self) -> Result<Reader> {
        Ok(match &self.server {
            Server::Postgres { options, .. } => Reader::Postgres(options.connect().await?),
            Server::MySql { options, .. } => Reader::MySql(options.connect().await?),
            Server::Sqlite { path } => Reader::Sqlite(
                SqliteConnectOptions::new()
                    .filename(path)
                    .busy_timeout(Duration::from_secs(10))
                    .connect()
                    .await?,
            ),
        })
    }

    /// Distinct message IDs with a charge so far (0 before the service created its tables).
    pub(crate) async fn charged_ids(&self) -> Result<u64> {
        self.distinct("charges", "message_id").await
    }

    /// Whether the services have created `table` yet.
    pub(crate) async fn has_table(&self, table: &str) -> Result<bool> {
        self.reader().await?.table_exists(table).await
    }

    /// Distinct values of `column` in `table` (the harness's own names), 0 while the table
    /// does not exist yet.
    async fn distinct(&self, table: &str, column: &str) -> Result<u64> {
        let mut conn = self.reader().await?;
        if !conn.table_exists(table).await? {
            return Ok(0);
        }
        let n = conn
            .integers(&format!("SELECT count(DISTINCT {column}) FROM {table}"))
            .await?;
        Ok(n.first().copied().unwrap_or(0).max(0) as u64)
    }

    /// Compares the ledger with what was sent. An ID in `abandoned` (`--phases`: its
    /// operation was given up) has no charge by design: counted apart, not lost.
    pub(crate) async fn check(
        &self,
        sent: &Sent,
        abandoned: &HashSet<String>,
    ) -> Result<LedgerCheck> {
        let mut conn = self.reader().await?;
        let rows = conn
            .counts("SELECT message_id, count(*) FROM charges GROUP BY message_id")
            .await
            .context("reading charges")?;
        // Summed here: SUM's type differs between engines (MySQL's is DECIMAL).
        let balance: i64 = conn
            .integers("SELECT balance_cents FROM accounts")
            .await
            .context("reading balances")?
            .iter()
            .sum();
        let counts: HashMap<String, i64> = rows.into_iter().collect();
        let mut check = LedgerCheck {
            effects: counts.values().map(|n| *n as u64).sum(),
            ..Default::default()
        };
        let mut expected_balance = 0i64;
        for (id, amount) in &sent.unique {
            match counts.get(id).copied().unwrap_or(0) {
                0 if abandoned.contains(id) => check.abandoned += 1,
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

    /// `--two-hop`: outbox rows not marked sent yet (0 before the table exists). A row
    /// published and not yet marked is published again: the drain waits for none.
    pub(crate) async fn unsent_outbox_rows(&self, table: &str) -> Result<u64> {
        let mut conn = self.reader().await?;
        if !conn.table_exists(table).await? {
            return Ok(0);
        }
        let n = conn
            .integers(&format!(
                "SELECT count(*) FROM {table} WHERE sent_at IS NULL"
            ))
            .await?;
        Ok(n.first().copied().unwrap_or(0).max(0) as u64)
    }

    /// `--two-hop`: the second hop's receipts against what was sent: one per payment.
    pub(crate) async fn check_receipts(&self, sent: &Sent) -> Result<ReceiptCheck> {
        let mut conn = self.reader().await?;
        let rows = conn
            .counts("SELECT payment_id, count(*) FROM receipts GROUP BY payment_id")
            .await
            .context("reading receipts")?;
        let counts: HashMap<String, i64> = rows.into_iter().collect();
        let mut check = ReceiptCheck {
            receipts: counts.values().map(|n| *n as u64).sum(),
            ..Default::default()
        };
        for (id, _) in &sent.unique {
            match counts.get(id).copied().unwrap_or(0) {
                0 => {
                    check.lost += 1;
                    if check.lost_ids.len() < 20 {
                        check.lost_ids.push(id.clone());
                    }
                }
                1 => {}
                n => {
                    check.duplicated += (n - 1) as u64;
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
        Ok(check)
    }

    /// `--phases`: the charge rows, as (account, processor's charge ID), none before the
    /// services created the table.
    pub(crate) async fn processor_charge_rows(&self) -> Result<Vec<(String, Option<String>)>> {
        let mut conn = self.reader().await?;
        if !conn.table_exists("charges").await? {
            return Ok(Vec::new());
        }
        conn.account_and_processor_id()
            .await
            .context("reading charges")
    }

    /// `--phases`: the keys of the idempotency records of `table` by how they stand (empty
    /// before the services created the table). The run's operations are the only users of
    /// the run's database, and their keys are text.
    pub(crate) async fn request_keys(&self, table: &str) -> Result<RecordKeys> {
        let mut conn = self.reader().await?;
        let mut keys = RecordKeys::default();
        if !conn.table_exists(table).await? {
            return Ok(keys);
        }
        for (set, filter) in [
            (&mut keys.finished, "state = 1"),
            (&mut keys.abandoned, "state = 2"),
            (&mut keys.stuck, "state = 0 AND recovery_point IS NOT NULL"),
            (&mut keys.unstarted, "state = 0 AND recovery_point IS NULL"),
        ] {
            let sql = format!("SELECT idem_key FROM {table} WHERE {filter}");
            let rows = conn
                .bytes(&sql)
                .await
                .with_context(|| format!("reading {table}"))?;
            set.extend(
                rows.into_iter()
                    .map(|k| String::from_utf8_lossy(&k).into_owned()),
            );
        }
        Ok(keys)
    }

    /// Drops the run's database.
    pub(crate) async fn drop_database(self) -> Result<()> {
        match &self.server {
            Server::Postgres { admin, .. } => {
                admin
                    .execute(
                        format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.name).as_str(),
                    )
                    .await?;
            }
            Server::MySql { admin, .. } => {
                admin
                    .execute(format!("DROP DATABASE IF EXISTS `{}`", self.name).as_str())
                    .await?;
            }
            Server::Sqlite { path } => {
                for suffix in ["", "-wal", "-shm"] {
                    let mut file = path.clone().into_os_string();
                    file.push(suffix);
                    let _ = std::fs::remove_file(file);
                }
            }
        }
        Ok(())
    }
}

/// A connection to the run's database on any of the three engines, with the few reads the
/// checker makes. MySQL's identifiers are `VARBINARY` (see the payments schema), read as bytes.
enum Reader {
    Postgres(sqlx::PgConnection),
    MySql(sqlx::MySqlConnection),
    Sqlite(sqlx::SqliteConnection),
}

impl Reader {
    async fn table_exists(&mut self, table: &str) -> Result<bool> {
        let n: i64 = match self {
            Reader::Postgres(c) => {
                sqlx::query_scalar("SELECT count(*) FROM pg_tables WHERE tablename = $1 AND schemaname = current_schema()")
                    .bind(table)
                    .fetch_one(c)
                    .await?
            }
            Reader::MySql(c) => {
                sqlx::query_scalar("SELECT count(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?")
                    .bind(table)
                    .fetch_one(c)
                    .await?
            }
            Reader::Sqlite(c) => {
                sqlx::query_scalar("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?")
                    .bind(table)
                    .fetch_one(c)
                    .await?
            }
        };
        Ok(n > 0)
    }

    /// The first column of every row, an integer.
    async fn integers(&mut self, sql: &str) -> Result<Vec<i64>> {
        Ok(match self {
            Reader::Postgres(c) => sqlx::query_scalar(sql).fetch_all(c).await?,
            Reader::MySql(c) => sqlx::query_scalar(sql).fetch_all(c).await?,
            Reader::Sqlite(c) => sqlx::query_scalar(sql).fetch_all(c).await?,
        })
    }

    /// The first column of every row, as bytes (a `BLOB`, `bytea` or `VARBINARY` key).
    async fn bytes(&mut self, sql: &str) -> Result<Vec<Vec<u8>>> {
        Ok(match self {
            Reader::Postgres(c) => sqlx::query_scalar(sql).fetch_all(c).await?,
            Reader::MySql(c) => sqlx::query_scalar(sql).fetch_all(c).await?,
            Reader::Sqlite(c) => sqlx::query_scalar(sql).fetch_all(c).await?,
        })
    }

    /// The charge rows' (account, processor_charge_id); on MySQL the columns may be
    /// `VARBINARY` (payments') or `VARCHAR` (http-payments'), both read as bytes.
    async fn account_and_processor_id(&mut self) -> Result<Vec<(String, Option<String>)>> {
        const SQL: &str = "SELECT account, processor_charge_id FROM charges";
        Ok(match self {
            Reader::Postgres(c) => sqlx::query_as(SQL).fetch_all(c).await?,
            Reader::MySql(c) => {
                let rows: Vec<(Vec<u8>, Option<Vec<u8>>)> =
                    sqlx::query_as(SQL).fetch_all(c).await?;
                let text = |b: Vec<u8>| String::from_utf8_lossy(&b).into_owned();
                rows.into_iter()
                    .map(|(account, id)| (text(account), id.map(text)))
                    .collect()
            }
            Reader::Sqlite(c) => sqlx::query_as(SQL).fetch_all(c).await?,
        })
    }

    /// Rows of (identifier, count).
    async fn counts(&mut self, sql: &str) -> Result<Vec<(String, i64)>> {
        Ok(match self {
            Reader::Postgres(c) => sqlx::query_as(sql).fetch_all(c).await?,
            Reader::MySql(c) => {
                let rows: Vec<(Vec<u8>, i64)> = sqlx::query_as(sql).fetch_all(c).await?;
                rows.into_iter()
                    .map(|(id, n)| (String::from_utf8_lossy(&id).into_owned(), n))
                    .collect()
            }
            Reader::Sqlite(c) => sqlx::query_as(sql).fetch_all(c).await?,
        })
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

/// `--phases`: the records' keys by how they stand at the end of a run.
#[derive(Debug, Default)]
pub(crate) struct RecordKeys {
    pub(crate) finished: HashSet<String>,
    /// Given up (by the completer, or the handler), their answer stored.
    pub(crate) abandoned: HashSet<String>,
    /// In progress at a recovery point: the completer's to finish.
    pub(crate) stuck: HashSet<String>,
    /// In progress with no recovery point: taken, and no phase reached (its executor died
    /// before the first point committed); nothing happened, nothing can be resumed.
    pub(crate) unstarted: HashSet<String>,
}

/// The receipts compared with what was sent.
#[derive(Debug, Default)]
pub(crate) struct ReceiptCheck {
    pub(crate) receipts: u64,
    pub(crate) lost: u64,
    pub(crate) duplicated: u64,
    pub(crate) unexpected: u64,
    /// Up to 20 of each.
    pub(crate) lost_ids: Vec<String>,
    pub(crate) duplicated_ids: Vec<String>,
}

/// The ledger compared with what was sent.
#[derive(Debug, Default)]
pub(crate) struct LedgerCheck {
    pub(crate) effects: u64,
    pub(crate) lost: u64,
    /// IDs without a charge whose operation was given up.
    pub(crate) abandoned: u64,
    pub(crate) duplicated: u64,
    pub(crate) unexpected: u64,
    pub(crate) balance_matches: bool,
    pub(crate) lost_ids: Vec<String>,
    pub(crate) duplicated_ids: Vec<String>,
}
