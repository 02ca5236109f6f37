//! A PostgreSQL store for idem on tokio-postgres, whose claim costs no round trip of its own.
//!
//! idem makes a consumer's side effect happen once per producer-set message ID by recording the
//! ID as a claim in the same transaction as the effect. `idem-sql`'s `PostgresStore` runs on
//! sqlx, which waits for each answer before it sends the next statement, so the claim is one
//! more round trip before the handler runs. [`PgStore`] runs on tokio-postgres, which
//! pipelines: `BEGIN` and the (prepared) claim are sent together, and a new message costs the
//! round trips of the bare handler — `BEGIN`, its statements, `COMMIT` — and nothing more. It
//! is the store for applications whose code already speaks tokio-postgres: handlers get a
//! `tokio_postgres::Client`, and [`PgStore::claim_on`] claims inside a transaction on any
//! tokio-postgres connection the application owns (a bb8-postgres one included).
//!
//! - **Connections:** a deadpool-postgres pool ([`PgStore::from_pool`], [`PgStore::connect`];
//!   cargo feature `deadpool`, on by default) or plain `tokio_postgres::Client`s
//!   ([`PgStore::from_clients`]); statements are prepared once per connection. Pooled
//!   connections are retired past a lifetime or idle timeout, after a `BEGIN` that got no
//!   answer, and after repeated read-only answers ([`PgStore::max_lifetime`] and the options
//!   after it), so that a failover behind a DNS name does not leave the store on the old
//!   primary.
//! - **Handlers** receive a [`PgTx`], which derefs to `tokio_postgres::Client`: run
//!   `tx.execute(..)` / `tx.query(..)`, and [`PgTx::prepare_cached`] for the handler's own
//!   statements, and [`PgTx::savepoint`] for a nested unit of work (`Client::transaction`
//!   needs `&mut Client`, which a transaction does not hand out). A transaction dropped while
//!   open never leaves its connection inside it.
//! - **Same tables as `idem-sql`:** `idem_processed`, `idem_requests` and `idem_outbox`, the same columns,
//!   statements, migration (under the same advisory lock) and server-clock stamps — the text
//!   is `idem_dialect::postgres`'s, which both stores execute — so the two stores can share a
//!   database and take over from each other.
//! - **Capabilities:** every one `idem-sql`'s PostgreSQL store has — transactions, the claim,
//!   the batch claim (one `unnest` statement), savepoints, pruning, statistics, migration, and
//!   idempotent-request records ([`RequestStore`](idem_core::store::RequestStore),
//!   [`ReapRequests`](idem_core::store::ReapRequests)), and the transactional outbox
//!   ([`OutboxStore`](idem_core::outbox::OutboxStore) in the handler's transaction,
//!   [`RelayStore`](idem_core::outbox::RelayStore) for a relay; [`PgStore::with_outbox_table`]);
//!   it passes the same conformance suites.
//! - **Partitioned claims** (opt-in, [`PgStore::partitioned`]): the claims table partitioned
//!   by the time inside each message ID, one partition per UTC day, so that retention drops
//!   whole days instead of deleting rows — the same schema, statements and maintenance as
//!   `idem-sql`'s `PostgresStore::partitioned`, so either store maintains a table the other
//!   claims in (why deduplication survives it: [`partition`]).
//! - **Errors** are classified by SQLSTATE (`idem_dialect::postgres::sqlstate`, the table
//!   `idem-sql` uses),
//!   never by message text: a closed connection is `Unavailable` under idem's statements and
//!   `ConnectionLost` under a handler's (the consumer then probes the store with `SELECT 1`
//!   to tell an outage from a message that ends its own session), a connection lost at
//!   `COMMIT` is `OutcomeUnknown`, a missing table or privilege is `Misconfigured` (which stops
//!   a consumer) only under idem's own statements, and a transaction a swallowed error aborted
//!   fails its commit (`SELECT 1; COMMIT`) instead of reporting `Processed`.
//!
//! ```no_run
//! use idem_core::{BoxError, Message, MessageId, Migrate, Outcome, Processor};
//! use idem_postgres::PgStore;
//!
//! # async fn run() -> Result<(), BoxError> {
//! let store = PgStore::connect("postgres://postgres@127.0.0.1/app").await?;
//! store.migrate().await?; // creates idem_processed and idem_requests; safe on every start
//!
//! let processor = Processor::builder(store, "billing").build()?;
//! let msg = Message::new(MessageId::new("payment-42")?, br#"{"amount_cents":1250}"#.to_vec());
//! let outcome = processor
//!     .process(&msg, async |tx| {
//!         // Inside the claim's transaction: both commit, or neither does.
//!         let insert = tx
//!             .prepare_cached("INSERT INTO charges (message_id, amount_cents) VALUES ($1, $2)")
//!             .await?;
//!         tx.execute(&insert, &[&"payment-42", &1250_i64]).await
//!     })
//!     .await?;
//! match outcome {
//!     Outcome::Processed(_rows) => { /* ack */ }
//!     Outcome::Duplicate => { /* ack; the charge already happened */ }
//!     Outcome::Conflict { .. } => { /* dead-letter: same ID, different payload */ }
//! }
//! # Ok(()) }
//! ```
//!
//! On plain clients, spawn each connection's task and hand the clients over:
//!
//! ```no_run
//! # async fn run() -> Result<(), idem_core::BoxError> {
//! let mut clients = Vec::new();
//! for _ in 0..4 {
//!     let (client, connection) =
//!         tokio_postgres::connect("postgres://postgres@127.0.0.1/app", tokio_postgres::NoTls)
//!             .await?;
//!     tokio::spawn(connection);
//!     clients.push(client);
//! }
//! let store = idem_postgres::PgStore::from_clients(clients);
//! # let _ = store; Ok(()) }
//! ```

mod conn;
mod errors;
mod outbox;
mod partitioned;
mod requests;
mod store;

mod tx;

/// Table names are idem-core's, shared with idem-sql.
pub use idem_core::{DEFAULT_OUTBOX_TABLE, DEFAULT_REQUESTS_TABLE, DEFAULT_TABLE, TableName};
/// Claims partitioned by the ID's time ([`PgStore::partitioned`]): `Partitioning`, the
/// extractors, days and the maintenance reports, shared with `idem-sql` through
/// `idem_dialect`.
pub use idem_dialect::postgres::partition;
pub use requests::MAX_REQUEST_KEY_LEN;
pub use store::{MAX_MESSAGE_ID_LEN, PgStore};
pub use tx::{PgSavepoint, PgTx};

/// The pool crate this store runs on, re-exported so its version matches.
#[cfg(feature = "deadpool")]
pub use deadpool_postgres;
/// The driver this store runs on, re-exported so its version matches.
pub use tokio_postgres;
