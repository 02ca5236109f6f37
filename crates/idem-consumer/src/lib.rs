//! The broker-independent consumer runner of idem.
//!
//! A broker adapter (`idem-nats`, `idem-amqp`, `idem-kafka`, `idem-redis-streams`, `idem-mqtt`)
//! implements [`Source`] and [`Delivery`]; [`Consumer`] does the rest, the same way on every
//! broker:
//!
//! | what happened | what the runner does |
//! |---|---|
//! | handler ran, transaction committed | ack — only now |
//! | already processed ([`Outcome::Duplicate`](idem_core::Outcome)) | ack, nothing else |
//! | same ID, different payload ([`Outcome::Conflict`](idem_core::Outcome)) | dead-letter, reason `conflict` |
//! | no ID / empty ID / ID over the store's limit | dead-letter, reason `missing-id` / `invalid-id` |
//! | payload does not decode | dead-letter, reason `undecodable` |
//! | handler [`Error::reject`](idem_core::Error::reject) | dead-letter, reason `rejected` |
//! | retryable error (handler `Error::retry`, deadlock, a handler panic, a statement of the handler the database refuses: a table or privilege it lacks, a row-level-security check) | retry with exponential backoff and jitter; after the last attempt dead-letter, reason `retries-exhausted` |
//! | database unreachable or refusing work for now (connection refused, read-only, disk full, out of connections), or refusing `BEGIN` or the claim | keep retrying in place with capped backoff, without spending the message's attempts: an outage must neither empty the queue into the dead letters nor spin on instant redeliveries (table below). The wait is bounded by [`RetryPolicy::with_outage_limit`] (default 5 min, [`RetryPolicy::outage_limit`]): past it, one `warn` line and `idem_store_outage_limit_exceeded_total`; a message that never ran keeps waiting |
//! | connection lost while the message ran (under its handler, or at its commit: outcome unknown) | probe the store on another connection. It does not answer: an outage, as above. It answers: the message ends its own session (a crash, an out-of-memory kill), so the retry spends an attempt, and after the last it is dead-lettered, reason `connection-lost`. Past the outage limit a lost connection spends attempts even when the probe fails: a message that crashes the database (which restarts) looks like an outage every time it runs |
//! | database misconfigured under idem's own statements (claims table missing or dropped, no privilege on it) | stop the consumer: `run` returns the `Misconfigured` error; nothing is dead-lettered, the messages stay with the broker |
//! | SIGINT/SIGTERM or a cancelled token (shutdown) | stop fetching, finish in-flight messages, ack what committed, give the rest back (nack where the broker has one) |
//! | batch mode (`.batch(n)`, then `run`) | one transaction and one claim statement per fetched batch, the handler per new message; a message whose handler fails is left out (the batch is redone without it, so nothing of it commits) and retried on its own; what committed is acked first; a batch that fails as a whole (deadlock, lost connection, outage) costs no message an attempt: each is processed again alone |
//! | set-batch mode (`.batch(n)`, then `run_set`) | the same claim, then one `SetHandler` call with the batch's new messages (e.g. one `unnest` insert); if it fails, the batch rolls back whole and each message is processed again as a batch of one, so a poison message is isolated and dead-lettered alone |
//! | broker connection lost | back off, the adapter reconnects, fetch again; the database side is unaffected |
//! | a redelivery of a message this process committed, with [`Consumer::local_cache`] on | ack as a duplicate without a round trip to the store (batch modes: left out of the batch's claim); another payload under a cached ID goes to the store, so it is still a `conflict` |
//! | phased mode (feature `phases`, `run_phased`): a handler that calls a third party | each message an operation of recovery points keyed by its ID (module `phased`): a redelivery after a crash resumes at the last point; one while another consumer holds the record waits in place without spending attempts, never dead-lettered; the same ID with another payload is dead-lettered `conflict` |
//!
//! Nothing is acknowledged that did not commit, and nothing is acknowledged silently: every
//! dead letter carries its reason in headers ([`DeadLetter::headers`]).
//!
//! `InMemoryBroker` (feature `test-util`) is an in-memory fake for unit tests of handlers and for
//! the demo; real adapters are tested against real brokers.
//!
//! # When the database is up but refusing
//!
//! A message that never ran is never dead-lettered for the database's state. idem classifies the
//! driver's code (never its message text, except SQLite's `no such table`, which has no code of
//! its own) into an [`ErrorKind`](idem_core::ErrorKind), by who ran the statement — idem (begin,
//! claim, commit, migrate, prune on its own tables) or the handler — and the runner acts on the
//! kind:
//!
//! | database state | PostgreSQL | MySQL / MariaDB | SQLite | kind | what the consumer does |
//! |---|---|---|---|---|---|
//! | unreachable, connection lost, server shutting down | I/O errors, class `08`, `57P01`–`57P03` | 2006, 2013, 1927, 1053, 1158–1161 | — | `Unavailable` | waits in place (capped backoff), spends no attempts; one `info` line when the outage begins and one when it ends, one `warn` line if it outlasts the outage limit; gauge `idem_store_unavailable` = 1 meanwhile, `idem_store_outages_total` counts outages, `idem_store_outage_limit_exceeded_total` the messages that waited past the limit |
//! | connection lost under the handler's statement | I/O errors, `57P01`, `57P02`, class `08` (not `08001`/`08004`) | 2006, 2013, 1927, 1053, 1158–1161 | — | `ConnectionLost` | probes the store: no answer, the same as above; an answer, an attempt spent (`idem_connections_lost_total`), then a `connection-lost` dead letter |
//! | read-only (failover onto a standby, `--read-only`) | `25006` | 1290, 1792, 1836 | `SQLITE_READONLY` (8) | `Unavailable` | the same |
//! | disk or table full | `53100` (class `53`) | 1021, 1114 | `SQLITE_FULL` (13), `SQLITE_IOERR` (10) | `Unavailable` | the same |
//! | too many connections, out of memory | `53300`, `53200` | 1040, 1203, 1226, 1037, 1038, 1041 | `SQLITE_CANTOPEN` (14) | `Unavailable` | the same |
//! | I/O error on the server | class `58` | — | — | `Unavailable` | the same |
//! | connection lost during `COMMIT` | I/O error at commit | 2006/2013 at commit | — | `OutcomeUnknown` | probed like a connection lost under the handler; the retry finds the claim if the commit happened |
//! | missing table (migrate never ran), missing column, wrong schema — under idem's statements | `42P01`, `42703`, `3F000`, `3D000` (class `42`) | 1146, 1054, 1109, 1049, 1046, 1064 | `no such table` / `no such column` | `Misconfigured` | stops the consumer with the error; in-flight messages are given back, none dead-lettered |
//! | no privilege, bad credentials — under idem's statements | `42501`, class `28` | 1044, 1045, 1142, 1143, 1227, 1370 | `SQLITE_PERM`, `SQLITE_AUTH`, `SQLITE_CORRUPT`, `SQLITE_NOTADB` | `Misconfigured` | the same |
//! | the same two rows under the handler's own statements (a row-level-security `WITH CHECK` is `42501`; an application migration that swapped the handler's table, `42P01`) | as above | as above | as above | `Store` | retried with backoff, spending attempts; `retries-exhausted` dead letter after the last; the consumer goes on with the next message |
//! | the handler's own pool exhausted (`PoolTimedOut`, a deadpool timeout) | — | — | — | `Transient` | the same |
//! | deadlock, serialization failure, lock or statement timeout | `40001`, `40P01`, `55P03`, `57014` | 1213, 1205, 1020, 3024, 1969 | `SQLITE_BUSY`, `SQLITE_LOCKED` | `Transient` | retried with backoff, spending attempts; `retries-exhausted` dead letter after the last |
//! | anything else (a constraint the handler's write violates, a value out of range) | e.g. `23505` | e.g. 1062 | e.g. `SQLITE_CONSTRAINT` | `Store` | the same as `Transient` |
//!
//! Each row is tested against the real server: the states a test can put the server in for real
//! (read-only sessions, a role without privileges or without a connection slot, an unmigrated
//! table, a read-only or full SQLite file, a PostgreSQL failover from a read-only role to a
//! writable one under a running consumer) and the rest through `RAISE … USING ERRCODE` /
//! `SIGNAL … SET MYSQL_ERRNO`, which make the server answer with exactly that code
//! (`crates/idem-sql/tests/sql/states_*.rs`,
//! `crates/idem-consumer/tests/idem_consumer/store_states.rs`).

/// Crash points, kept in idem-core (the phase driver of idem-request reaches them too) and
/// re-exported here at their old path.
pub use idem_core::crash;
mod cache;
mod dead_letter;
mod decode;
mod id_source;
#[cfg(feature = "test-util")]
mod in_memory;
pub mod metrics;
#[cfg(feature = "phases")]
pub mod phased;
mod prune;
mod retry;
mod runner;
pub mod shutdown;
mod source;

pub use cache::LocalCache;
pub use dead_letter::{
    ATTEMPTS_HEADER, CONSUMER_HEADER, DETAIL_HEADER, DeadLetter, DeadLetterReason, REASON_HEADER,
};
pub use decode::{Decode, Json, Raw};
pub use id_source::IdSource;
/// The handler shape, defined in idem-core and re-exported where consumers are written.
pub use idem_core::{Handler, SetHandler};
#[cfg(feature = "test-util")]
pub use in_memory::{InMemoryBroker, InMemoryDelivery, InMemorySource, InMemoryStats, Settled};
pub use metrics::RunStats;
pub use prune::prune_periodically;
pub use retry::{ReconnectBackoff, RetryPolicy};
pub use runner::{Batch, Consumer, Observer, PerMessage};
pub use source::{Delivery, Origin, Source};
pub use tokio_util::sync::CancellationToken;
