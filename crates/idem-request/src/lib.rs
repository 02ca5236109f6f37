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
//!
//! # Recovery points (atomic phases)
//!
//! An operation that calls a third party (a card processor, a mailer) cannot put that call in
//! its transaction. [`Idempotency::run_phases`] runs it as a sequence of phases — the
//! variants of your serde enum — and commits each boundary as **one** transaction: the
//! phase's local writes and the record's new recovery point. A retry, a takeover after a
//! crash or the [`Completer`] (built on [`Idempotency::take_stuck`], [`Idempotency::resume_phases`])
//! resumes at the last point, so a committed local phase never runs again, and an external
//! call repeats only with the same key ([`PhaseCtx::foreign_key`], derived from the record's
//! scope, key and the phase's name), which the third party deduplicates.
//!
//! ```
//! use std::collections::HashMap;
//! use std::sync::Mutex;
//!
//! use idem_core::{IdempotencyKey, RequestScope};
//! use idem_request::{Idempotency, PhaseCtx, Step};
//! use idem_sql::{SqliteOptions, SqliteStore};
//! use serde::{Deserialize, Serialize};
//!
//! /// A card processor that deduplicates by idempotency key, as Stripe does.
//! #[derive(Default)]
//! struct Processor(Mutex<HashMap<String, String>>);
//! impl Processor {
//!     fn charge(&self, key: &str, cents: i64) -> String {
//!         let mut charges = self.0.lock().unwrap();
//!         let n = charges.len();
//!         charges.entry(key.to_owned()).or_insert_with(|| format!("ch_{n}_{cents}")).clone()
//!     }
//! }
//!
//! #[derive(Serialize, Deserialize)]
//! enum Phase {
//!     /// Local: the order row.
//!     CreateOrder,
//!     /// Foreign: the charge at the processor.
//!     Charge { order: i64 },
//!     /// Local: the charge's ID on the order.
//!     RecordCharge { order: i64, charge: String },
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! # let dir = tempfile::tempdir()?;
//! let store = SqliteStore::open(dir.path().join("app.db"), SqliteOptions::default()).await?;
//! idem_core::Migrate::migrate(&store).await?;
//! sqlx::query("CREATE TABLE orders (cents INTEGER, charge TEXT)").execute(store.pool()).await?;
//! let idem = Idempotency::builder(store.clone()).build()?;
//! let processor = Processor::default();
//!
//! let cents = 1250_i64;
//! let scope = RequestScope::new(["create_order", "tenant-7"]);
//! let key = IdempotencyKey::new("order-7f7b5c1e")?;
//! for _ in 0..2 {
//!     let charge: String = idem
//!         .run_phases(scope, &key, &cents, Phase::CreateOrder, async |phase, ctx: &mut PhaseCtx<SqliteStore>| {
//!             Ok::<_, sqlx::Error>(match phase {
//!                 Phase::CreateOrder => {
//!                     let order: i64 = sqlx::query_scalar("INSERT INTO orders (cents) VALUES (?) RETURNING rowid")
//!                         .bind(cents)
//!                         .fetch_one(&mut **ctx.tx())
//!                         .await?;
//!                     Step::Next(Phase::Charge { order })
//!                 }
//!                 Phase::Charge { order } => {
//!                     // The same key on every attempt of this phase: a repeat is deduplicated.
//!                     let charge = processor.charge(&ctx.foreign_key("card").to_string(), cents);
//!                     Step::Next(Phase::RecordCharge { order, charge })
//!                 }
//!                 Phase::RecordCharge { order, charge } => {
//!                     sqlx::query("UPDATE orders SET charge = ? WHERE rowid = ?")
//!                         .bind(&charge)
//!                         .bind(order)
//!                         .execute(&mut **ctx.tx())
//!                         .await?;
//!                     Step::Done(charge)
//!                 }
//!             })
//!         })
//!         .await?;
//!     assert_eq!(charge, "ch_0_1250"); // the second call replays the first's response
//! }
//! let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders WHERE charge IS NOT NULL")
//!     .fetch_one(store.pool())
//!     .await?;
//! assert_eq!((orders, processor.0.lock().unwrap().len()), (1, 1));
//! # Ok(()) }
//! ```

mod cache;
mod call;
pub mod completer;
mod engine;
mod phases;

pub use cache::LocalCache;
pub use completer::{Completer, CompleterBuilder, CompleterStats};
pub use engine::{Execution, Idempotency, IdempotencyBuilder, KeyDigest, Start};
pub use phases::{Finish, PhaseCtx, Step};
