//! Idempotent requests: run an operation once per client key, replay its stored result to
//! every retry.
//!
//! [`Idempotency`] is the engine, with no HTTP in it: [`Idempotency::start`] looks the
//! record up and either hands back the stored result, reports an execution in flight or a
//! reused key, or takes the record under a lease and returns an [`Execution`] holding the
//! store's transaction. The operation writes through that transaction;
//! [`Execution::complete`] stores its result **in the same transaction** and commits, so on a
//! SQL store the effect and the stored result are one commit. [`Execution::abandon`] (an
//! outcome not worth storing, such as a 5xx) rolls the writes back and frees the key. A
//! heartbeat keeps the lease alive while the operation runs; a crashed executor's lease runs
//! out and the next retry takes the record over with a larger fencing token, so the old
//! executor's late completion is refused and its writes through the transaction roll back
//! (on a store whose transaction carries them: the SQL stores, not Redis).
//!
//! [`Idempotency::call`] is the function-level API on top: any async function, keyed,
//! whose result is serialized with serde and replayed on a repeat. Its input is fingerprinted
//! by its canonical JSON (every map's entries sorted by key), so an equal `HashMap` rebuilt in
//! another iteration order is the same input.
//!
//! ```
//! use idem_core::{IdempotencyKey, RequestScope};
//! use idem_request::Idempotency;
//! use idem_sql::{SqliteOptions, SqliteStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! # let dir = tempfile::tempdir()?;
//! let store = SqliteStore::open(dir.path().join("app.db"), SqliteOptions::default()).await?;
//! idem_core::Migrate::migrate(&store).await?;
//! sqlx::query("CREATE TABLE charges (account TEXT, cents INTEGER)").execute(store.pool()).await?;
//! let idem = Idempotency::builder(store.clone()).build()?;
//!
//! #[derive(serde::Serialize)]
//! struct Charge<'a> { account: &'a str, cents: i64 }
//! let input = Charge { account: "alice", cents: 1250 };
//! let scope = RequestScope::new(["create_charge", "tenant-7"]);
//! let key = IdempotencyKey::new("7f7b5c1e-charge-1")?;
//! for _ in 0..3 {
//!     let id: i64 = idem
//!         .call(scope, &key, &input, async |tx| {
//!             sqlx::query("INSERT INTO charges VALUES (?, ?) RETURNING rowid")
//!                 .bind(input.account)
//!                 .bind(input.cents)
//!                 .fetch_one(&mut **tx)
//!                 .await
//!                 .map(|row| sqlx::Row::get::<i64, _>(&row, 0))
//!         })
//!         .await?;
//!     assert_eq!(id, 1); // the first call's result, replayed
//! }
//! let n: i64 = sqlx::query_scalar("SELECT count(*) FROM charges").fetch_one(store.pool()).await?;
//! assert_eq!(n, 1);
//! # Ok(()) }
//! ```

mod call;
mod engine;
mod phases;

pub use engine::{Execution, Idempotency, IdempotencyBuilder, KeyDigest, Start};
pub use phases::{PhaseCtx, Step};
