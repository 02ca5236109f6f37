//! Redis store for idem's idempotent requests: the record of each (scope, idempotency key)
//! under a lease with fencing tokens, its stored result replayed to every retry **in one
//! round trip**.
//!
//! [`RedisRequestStore`] implements [`RequestStore`](idem_core::store::RequestStore) and
//! [`ReapRequests`](idem_core::store::ReapRequests), so the engine of `idem-request`
//! (`Idempotency::start` / `call`) and the HTTP layer run on it as on the SQL stores.
//!
//! ```no_run
//! use idem_core::{IdempotencyKey, RequestScope};
//! use idem_redis::RedisRequestStore;
//! use idem_request::Idempotency;
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let store = RedisRequestStore::builder("redis://127.0.0.1:6379")
//!     .key_prefix("billing:idem")
//!     .connect()
//!     .await?;
//! let idem = Idempotency::builder(store).build()?;
//!
//! let scope = RequestScope::new(["create_charge", "tenant-7"]);
//! let key = IdempotencyKey::new("7f7b5c1e-charge-1")?;
//! let input = ("alice", 1250);
//! for _ in 0..3 {
//!     // Runs once; the two repeats get the first result back from Redis.
//!     let charge_id: u64 = idem
//!         .call(scope, &key, &input, async |_tx| {
//!             // Write to your database here, with your own transaction: Redis cannot
//!             // share one. External calls take a key derived from `key`.
//!             Ok::<_, std::io::Error>(42)
//!         })
//!         .await?;
//!     assert_eq!(charge_id, 42);
//! }
//! # Ok(()) }
//! ```
//!
//! # No shared transaction
//!
//! A SQL store commits the operation's writes and the stored result in one transaction.
//! Redis cannot take part in your database's transaction, so here
//! [`TransactionalStore::Tx`](idem_core::TransactionalStore::Tx) is [`RedisTx`], which does
//! nothing, and completing a record takes effect at once. What that means:
//!
//! - **A crash after the effect and before the completion runs the operation again**: the
//!   record stays in progress until its lease runs out, then the next retry takes it over and
//!   executes. Make the operation safe to repeat: its database writes idempotent on their own
//!   (a unique key derived from the idempotency key), and every external call (a payment
//!   provider, a mailer) made with a derived key ([`idem_core::DerivedKey`]) that the third
//!   party deduplicates.
//! - A refused completion (the lease was taken over) does not undo what the operation already
//!   did; the record keeps the new holder's result.
//! - An abandoned execution (a 5xx) frees the key, but its writes are whatever the operation
//!   left behind.
//!
//! Choose a SQL store when the operation's effect lives in that database and "both or
//! neither" matters; choose Redis for a replay in one round trip in front of effects that are
//! idempotent by themselves.
//!
//! # Records
//!
//! Three keys per record, `<prefix>:{<scope hex>:<key>}:rec | lease | fence`. The braces are
//! a Redis Cluster hash tag, so the keys of one record share a slot and one script changes
//! them together.
//!
//! | key | holds | expires |
//! |---|---|---|
//! | `…:rec` (hash) | fingerprint, state (`run` / `done`), the holder's fence, the result | in progress: `max(lease, TTL)` after the take, never before the lease; completed: the TTL after completion |
//! | `…:lease` (string) | the holder's fence, written with `SET … NX PX <lease>` | with the lease; deleted on completion and release |
//! | `…:fence` (string) | the last fence handed out, a counter | never before the record |
//!
//! Every operation is one Lua script sent as `EVALSHA` (`SCRIPT LOAD` and a second `EVALSHA`
//! only after the server lost its script cache), so each is **one round trip**:
//!
//! | operation | what the script does |
//! |---|---|
//! | `begin_request` | same fingerprint and completed → the stored result; different fingerprint → mismatch (nothing changes); lease alive → in progress with its `PTTL`, rounded up to whole seconds ([`idem_core::retry_after`]); otherwise takes the record: new, or a takeover of a lapsed lease with fence + 1 |
//! | `complete_in` | if the record is in progress under this fence: stores the result, `PEXPIRE` TTL, deletes the lease; else [`LeaseLost`](idem_core::ErrorKind::LeaseLost) |
//! | `extend_lease` | if this fence holds the record: the lease `PX` the new length, the record kept at least as long |
//! | `release` | if this fence holds the record: deletes it and the lease; the counter stays, so the next holder's fence is larger |
//!
//! Every time is the Redis server's (`PX`, `PTTL`, `TIME`), never a client's clock. A fence
//! counter that expired with its record restarts at the server's clock in microseconds, so an
//! executor stalled past its record's expiry cannot hold the fence of the record's successor.
//!
//! # Expiry
//!
//! Records expire by themselves: every key carries a Redis expiry from the script that wrote
//! it. [`ReapRequests::reap_batch`](idem_core::store::ReapRequests::reap_batch) therefore has
//! nothing to do and returns 0 without contacting the server, so a reaper (`reap_all`, a
//! scheduled job) is a harmless no-op on this store.
//!
//! Needs Redis 5 or later (the begin script writes after calling `TIME`); tested on Redis 7.0.

mod error;
mod keys;
mod scripts;
mod store;

pub use keys::DEFAULT_KEY_PREFIX;
pub use store::{MAX_KEY_LEN, RedisRequestStore, RedisRequestStoreBuilder, RedisTx};
