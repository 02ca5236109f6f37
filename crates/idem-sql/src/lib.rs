//! SQL claim stores for idem, on sqlx 0.8: SQLite (the embedded default), PostgreSQL and
//! MySQL/MariaDB, each behind a cargo feature of the same name.
//!
//! One store, [`SqlStore<E>`](SqlStore), generic over a sealed [`Engine`](engine::Engine)
//! (`sqlx::Sqlite`, `sqlx::Postgres`, `sqlx::MySql`), with the aliases [`SqliteStore`],
//! [`PostgresStore`] and [`MySqlStore`]. It implements the capabilities of
//! [`idem_core::store`] on the *same* database as your data, so a claim and the handler's writes
//! commit in one transaction. Handlers receive a [`Tx<E>`](Tx) and run their queries on
//! `&mut **tx`. [`AnyStore`] picks the engine from a URL at run time.
//!
//! The same stores keep idempotent-request records ([`RequestStore`], [`ReapRequests`]) for
//! `idem-request` and `idem-http`, in their own table (`idem_requests`, see
//! `with_requests_table`) created by the same `migrate`: a request's stored result completes in
//! the transaction carrying the operation's writes. Leases and expiry run on the database
//! server's clock (SQLite: this host's); a lookup never waits for a running operation.
//!
//! And the transactional outbox ([`OutboxStore`], [`RelayStore`]): a handler enqueues its
//! outgoing messages in the transaction of its claim (table `idem_outbox`, see
//! `with_outbox_table`), and a relay leases, publishes and marks them; `migrate` creates it
//! and its dead-letter table.
//!
//! [`OutboxStore`]: idem_core::outbox::OutboxStore
//! [`RelayStore`]: idem_core::outbox::RelayStore
//!
//! [`RequestStore`]: idem_core::store::RequestStore
//! [`ReapRequests`]: idem_core::store::ReapRequests
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use idem_core::{Message, MessageId, Migrate, Outcome, Processor};
//! use idem_sql::{SqliteOptions, SqliteStore};
//!
//! let dir = std::env::temp_dir().join(format!("idem-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir)?;
//! let store = SqliteStore::open(dir.join("app.db"), SqliteOptions::default()).await?;
//! store.migrate().await?;
//! sqlx::query("CREATE TABLE IF NOT EXISTS charges (message_id BLOB, amount INTEGER)")
//!     .execute(store.pool()).await?;
//!
//! let processor = Processor::builder(store, "billing").build()?;
//! let msg = Message::new(MessageId::new("payment-42")?, b"100".to_vec());
//!
//! for _delivery in 0..2 {
//!     // The broker delivers twice; the charge happens once.
//!     let outcome = processor
//!         .process(&msg, async |tx| {
//!             sqlx::query("INSERT INTO charges VALUES (?, 100)")
//!                 .bind(b"payment-42".as_slice())
//!                 .execute(&mut **tx)
//!                 .await
//!         })
//!         .await?;
//!     assert!(matches!(outcome, Outcome::Processed(_) | Outcome::Duplicate));
//! }
//! let charges: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
//!     .fetch_one(processor.store().pool()).await?;
//! assert_eq!(charges, 1);
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok(()) }
//! ```
//!
//! # Stores
//!
//! | store | feature | claim statement | concurrent duplicate | batch claim |
//! |---|---|---|---|---|
//! | SQLite (embedded default) | `sqlite` | `INSERT … ON CONFLICT DO NOTHING` | `BEGIN IMMEDIATE` serialises writers; the second sees the committed claim (busy timeout 10 s, WAL) | multi-row `INSERT … RETURNING` |
//! | PostgreSQL | `postgres` | `INSERT … ON CONFLICT (consumer, message_id) DO NOTHING` | waits on the first transaction's uncommitted row | `INSERT … SELECT FROM unnest(…) … RETURNING` |
//! | MySQL / MariaDB (InnoDB) | `mysql` | `INSERT … ON DUPLICATE KEY UPDATE duplicates = duplicates + 1` (not `INSERT IGNORE`) | waits on the record lock | multi-row `INSERT … ON DUPLICATE KEY UPDATE` |
//! | PostgreSQL on tokio-postgres (crate `idem-postgres`) | `deadpool` (default; plain clients without it) | the same `INSERT … ON CONFLICT … DO NOTHING`, prepared, **sent with `BEGIN` in one flight** | waits on the first transaction's uncommitted row | the same `unnest` statement, pipelined with `BEGIN` |
//! | either PostgreSQL store, partitioned | `.partitioned(Partitioning::uuid_v7())` | the same, with the ID's time as partition key | the same, inside the ID's day partition | the same, with the keys |
//! | the outbox (every store above: `OutboxStore`, `RelayStore`) | — (table `idem_outbox`, `with_outbox_table`) | enqueue in the handler's transaction: `INSERT … ON CONFLICT (message_id) DO NOTHING` (MySQL: `ON DUPLICATE KEY UPDATE message_id = message_id`) | a relay's lease: `SELECT … FOR UPDATE SKIP LOCKED` then `UPDATE` in a short transaction (SQLite: under `BEGIN IMMEDIATE`); one relay at a time per ordering key | one multi-row insert per 100 messages |
//!
//! The rows after the engines are `idem-postgres`'s store, the opt-in partitioned layout
//! (`PostgresStore::partitioned`) and the transactional outbox; the README's *Stores* section
//! tells how partitioning keeps deduplication exact, and `idem_dialect::outbox` the outbox
//! table, its header encoding and the lease rule.
//!
//! # Pruning
//!
//! How claims are pruned depends on the table's shape, and `idem prune` reads the shape from the
//! catalog:
//!
//! | table | `processor.prune()`, `prune_periodically` | `idem prune` |
//! |---|---|---|
//! | plain (every engine) | deletes rows whose `processed_at` is older than the prune age, in batches | the same, with `--older-than` |
//! | PostgreSQL, partitioned by the ID's time | a store configured `.partitioned(..)`: creates the days ahead, drops the days wholly past the **table's** retention (younger claims in them moved out first), then deletes rows of the default and undated partitions older than the prune age; a store not configured for it refuses (`Misconfigured`) | configures itself as the table's record says and does the same: days by the recorded retention, rows of the default and undated partitions by `--older-than`; refused when the recorded retention is inside the redelivery window plus clock margin, or when the table has no record yet (migrate it once with its store) |

mod any;
mod common;
pub mod engine;
mod errors;
mod held;
#[cfg(feature = "postgres")]
mod listen;
#[cfg(feature = "mysql")]
mod mysql;
mod outbox;
#[cfg(feature = "postgres")]
mod partitioned;
#[cfg(feature = "postgres")]
mod postgres;
mod requests;
#[cfg(feature = "sqlite")]
mod sqlite;
mod store;
mod tx;

pub use any::{AnyStore, SCHEMES, StoreVisitor};
/// Table names are idem-core's, shared by every SQL store.
pub use idem_core::{DEFAULT_OUTBOX_TABLE, DEFAULT_REQUESTS_TABLE, DEFAULT_TABLE, TableName};
/// PostgreSQL claims partitioned by the ID's time (`PostgresStore::partitioned`):
/// `Partitioning`, the extractors, days and the maintenance reports, from `idem_dialect`,
/// which `idem-postgres` shares. Pure data, so present without the `postgres` feature too
/// ([`AnyStore`] reports partitions whatever is compiled in).
pub use idem_dialect::postgres::partition;
/// Kept for callers of `idem_sql::redact_url`; the one implementation is idem-redact's.
pub use idem_redact::redact_url;
#[cfg(feature = "mysql")]
pub use mysql::{MAX_MESSAGE_ID_LEN as MYSQL_MAX_MESSAGE_ID_LEN, MySqlStore};
#[cfg(feature = "postgres")]
pub use postgres::{MAX_MESSAGE_ID_LEN as POSTGRES_MAX_MESSAGE_ID_LEN, PostgresStore};
pub use requests::MAX_REQUEST_KEY_LEN;
#[cfg(feature = "sqlite")]
pub use sqlite::{MAX_MESSAGE_ID_LEN as SQLITE_MAX_MESSAGE_ID_LEN, SqliteOptions, SqliteStore};
pub use store::SqlStore;
#[cfg(feature = "mysql")]
pub use tx::MySqlTx;
#[cfg(feature = "postgres")]
pub use tx::PostgresTx;
#[cfg(feature = "sqlite")]
pub use tx::SqliteTx;
pub use tx::Tx;

/// The README's library example, compiled and run as a doc test so it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
