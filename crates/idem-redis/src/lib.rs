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
//! # Losing records
//!
//! A record protects a request only while Redis keeps it. Three things can remove one early,
//! and each has the effect of a record or lease that ran out too soon:
//!
//! - **Eviction.** Every key this store writes carries an expiry, so under `maxmemory` a
//!   `volatile-*` policy may evict any of them, and an `allkeys-*` policy may evict any key at
//!   all. An evicted completed record **runs its request again**; an evicted record in
//!   progress lets a retry take the key anew **while its executor still runs** (two
//!   executors; the first one's completion is refused by its fence, but what it did is
//!   done). So
//!   [`connect`](RedisRequestStoreBuilder::connect) reads `maxmemory-policy` (`CONFIG GET`, or
//!   the `maxmemory_policy` field of `INFO memory` where `CONFIG` is disabled or renamed, as
//!   on many managed services) and refuses with
//!   [`Misconfigured`](idem_core::ErrorKind::Misconfigured) unless it is `noeviction`, and
//!   also when neither command answers. Under `noeviction` a full Redis refuses writes
//!   (`OOM`), which fails requests as [`Unavailable`](idem_core::ErrorKind::Unavailable) and
//!   loses nothing. [`skip_maxmemory_policy_check`](RedisRequestStoreBuilder::skip_maxmemory_policy_check)
//!   opts out (a policy you verified yourself, or a risk you accept); a store made
//!   [`with_connection`](RedisRequestStore::with_connection) runs the check only when you
//!   call [`check_maxmemory_policy`](RedisRequestStore::check_maxmemory_policy).
//! - **Failover.** Replication is asynchronous: the primary answers before its replicas have
//!   the write. When a failover (Sentinel, Cluster, a managed service) promotes a replica that
//!   missed the latest writes, a **missing completed record runs its request again**, and a
//!   **missing take lets a second executor run** beside the first. With
//!   [`wait_for_replicas(n, timeout)`](RedisRequestStoreBuilder::wait_for_replicas) every take
//!   and completion is followed by `WAIT n timeout`, in one pipeline with its script (still
//!   one round trip); a write that fewer than `n` replicas acknowledged in time fails with a
//!   [`ReplicasNotConfirmed`] source:
//!
//!   | write | the store | the error's kind | the caller |
//!   |---|---|---|---|
//!   | take | releases the record again: nothing ran, the key is free | [`Unavailable`](idem_core::ErrorKind::Unavailable) | retries later (HTTP: 503) |
//!   | completion | keeps the result, stored on the primary | [`OutcomeUnknown`](idem_core::ErrorKind::OutcomeUnknown) | retries: the stored result replays, or after a failover that lost it the operation runs again |
//!
//!   `WAIT` puts a write on `n` replicas; it does not choose which replica a failover
//!   promotes. Sentinel and Cluster prefer the one with the most data (after any configured
//!   replica priority), so with `n` equal to the number of replicas every candidate has the
//!   record, and with fewer the promoted one may still lack it. Lease
//!   extensions and releases are not waited for: a failover may lose a heartbeat's
//!   extension, so the lease on the new primary ends earlier. `WAIT` blocks the connection
//!   it runs on, and the store's connection is shared by the whole process: each take and
//!   completion holds the others back for a round trip to the replicas, up to `timeout` when
//!   they lag.
//! - **A restart without persistence** loses every record, as a failover to an empty replica
//!   would. Run Redis with `appendonly yes` if a restart must not repeat requests
//!   (`appendfsync everysec` can lose the last second).
//!
//! # Records
//!
//! One string key per record, `<prefix>:{<scope hex>:<key>}:rec`, whose value holds the
//! state, the fingerprint, the lease deadline and the holder's fence, or, once completed, the
//! result (the layout is in the `scripts` module). The braces are a Redis Cluster hash tag.
//! It expires `max(lease, TTL)` after a take (never before the lease) and the TTL after its
//! completion. Records of earlier versions (a hash with `…:lease` and `…:fence` beside it)
//! are still replayed, answered "in progress", or taken over into the new form; the earlier
//! version's scripts fail on a new record instead of running it again.
//!
//! Every operation is one Lua script sent as `EVALSHA` (`SCRIPT LOAD` and a second `EVALSHA`
//! only after the server lost its script cache), so each is **one round trip**, and each
//! reads the record with one `GET` and writes it with at most one `SET … PX`:
//!
//! | operation | what the script does | commands Redis runs |
//! |---|---|---|
//! | `begin_request` | same fingerprint and completed → the stored result; different fingerprint → mismatch (nothing changes); lease alive → in progress with the time left, rounded up to whole seconds ([`idem_core::retry_after`]); otherwise takes the record: new, or a takeover of a lapsed lease with fence + 1 | replay, mismatch: `EVALSHA` + `GET`; take: + `TIME`, `SET` (4) |
//! | `complete_in` | if the record is in progress under this fence: stores the result with the TTL; else [`LeaseLost`](idem_core::RequestErrorKind::LeaseLost) | `EVALSHA`, `GET`, `SET` (3) |
//! | `extend_lease` | if this fence holds the record: the lease deadline the new length from now, the record kept at least as long | `EVALSHA`, `GET`, `TIME`, `PTTL`, `SET` |
//! | `release` | if this fence holds the record: deletes it | `EVALSHA`, `GET`, `DEL` |
//!
//! So a first call (`Idempotency::call`, the HTTP layer) costs Redis **2 round trips and 7
//! commands**, a replay **1 round trip and 2 commands** (`INFO commandstats` counts the
//! commands a script runs as well as the `EVALSHA`; this crate's tests hold both counts).
//!
//! Every time is the Redis server's (`TIME`, `PX`), never a client's clock. A new record's
//! fence starts at the server's clock in microseconds (a takeover's is the holder's + 1), so
//! an executor stalled past its record's expiry or release cannot hold the fence of the
//! record's successor.
//!
//! # Expiry
//!
//! Records expire by themselves: every key carries a Redis expiry from the script that wrote
//! it. [`ReapRequests::reap_batch`](idem_core::store::ReapRequests::reap_batch) therefore has
//! nothing to do and returns 0 without contacting the server, so a reaper (`reap_all`, a
//! scheduled job) is a harmless no-op on this store.
//!
//! Needs Redis 5 or later (the scripts write after calling `TIME`); tested on Redis 7.0.

mod durability;
mod error;
mod keys;
mod scripts;
mod store;

pub use error::{ReplicasNotConfirmed, UnconfirmedWrite};
pub use keys::DEFAULT_KEY_PREFIX;
pub use store::{MAX_KEY_LEN, RedisRequestStore, RedisRequestStoreBuilder, RedisTx};
