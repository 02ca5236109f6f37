//! The vocabulary and rules of the Idempotent Consumer pattern, with no database or network
//! dependency.
//!
//! Brokers deliver at least once. idem makes handling the same message twice have exactly the
//! effect of handling it once: the consumer records the producer-set [`MessageId`] as a claim
//! **in the same database transaction as the side effect**, under a unique constraint. A
//! redelivery finds the claim and becomes an [`Outcome::Duplicate`]; the same ID with a
//! different payload [`Fingerprint`] is an [`Outcome::Conflict`] to dead-letter.
//!
//! This crate holds the types, the store traits ([`store`]) and the [`Processor`]; stores live
//! in `idem-sql` (SQLite, PostgreSQL, MySQL/MariaDB).
//!
//! ```
//! use idem_core::{ConsumerName, DerivedKey, Fingerprint, MessageId, parse_duration, Retention};
//!
//! let id = MessageId::new("payment-42")?;
//! assert!(MessageId::new("").is_err()); // the producer must set an ID
//!
//! // Same payload, same fingerprint: a redelivery. Different payload: a producer bug.
//! assert_eq!(Fingerprint::of(b"{\"amount\":100}"), Fingerprint::of(b"{\"amount\":100}"));
//!
//! // Keys for external calls, stable across reprocessing of the same message.
//! let billing = ConsumerName::new("billing")?;
//! let key = DerivedKey::new(&billing, &id, "stripe-charge");
//! assert_eq!(key, DerivedKey::new(&billing, &id, "stripe-charge"));
//!
//! // Retention must outlast the broker's redelivery window.
//! assert!(Retention::new(parse_duration("1d")?, parse_duration("7d")?).is_err());
//! # Ok::<(), idem_core::Error>(())
//! ```
//!
//! # What else is there
//!
//! | need | API |
//! |---|---|
//! | claim inside a transaction you already own | `processor.claim_in(&mut tx, &msg)` → `Claim::{New, Duplicate, Conflict}` |
//! | one commit and one claim statement for N messages, a `Handler` per new message | `processor.process_batch(&msgs, &handler)` — a message whose handler fails is left out and the batch redone without it |
//! | one commit, one claim statement and **one handler call** for N messages | `processor.process_batch_set(&msgs, async \|tx, fresh\| …)`, or a `SetHandler` with `process_batch_set_with` — lock shared rows in key order inside it, or concurrent batches can deadlock |
//! | naturally idempotent handler ("set status = shipped") | `.naturally_idempotent()` on the builder: same API, no claim row |
//! | custom fingerprint (selected fields) | `Fingerprint::hasher().field(..).finish()` + `Message::with_fingerprint` |
//! | publish an event with the effect, exactly once across the hop | enqueue [`outbox::Outgoing`] messages (IDs from an [`outbox::Emitter`]) with [`outbox::OutboxStore::enqueue`] on the handler's transaction; `idem-relay` publishes them after the commit |
//! | pruning | `processor.prune()` (its consumer); beside a running consumer `tokio::spawn(idem_consumer::prune_periodically(processor.clone(), every, shutdown.clone()))`; or `idem prune --store URL --older-than 14d --redelivery-window 7d`; never inside the window plus a 1 h clock margin; a partitioned PostgreSQL table drops whole days instead (see `idem-sql`'s crate docs, *Pruning*) |
//!
//! # Where things are in the workspace
//!
//! Every crate depends on this one, so the workspace's map is kept here.
//!
//! ```text
//! crates/
//!   idem-core/      vocabulary and rules; no database or network dependency
//!     src/id.rs           MessageId (non-empty, ≤ 255 bytes by default), ConsumerName
//!     src/fingerprint.rs  Fingerprint (SHA-256 of the payload, or your own)
//!     src/message.rs      Identified trait, Message
//!     src/handler.rs      Handler: the side effect, for one message and in batches
//!     src/outcome.rs      Outcome (Processed / Duplicate / Conflict), Claim
//!     src/error.rs        Error = ErrorKind + message + source; Disposition (retry / dead-letter / fatal)
//!     src/store.rs        capability traits: TransactionalStore, ClaimStore, BatchClaimStore,
//!                         Savepoints, Migrate, Prune, Stats, RequestStore, ReapRequests
//!     src/processor/      begin → claim → handler → commit (mod.rs); batch.rs batches;
//!                         builder.rs the builder with its retention check
//!     src/request/        idempotent-request vocabulary: keys, scopes, records, the store's errors
//!     src/retention.rs    Retention, duration parsing
//!     src/derived.rs      DerivedKey for external side effects
//!     src/outbox.rs       Outgoing messages enqueued in the handler's transaction, the Emitter of
//!                         their derived IDs, OutboxStore (enqueue) and RelayStore (lease, mark sent)
//!     src/clock.rs        injected Clock, Timestamp
//!     src/table.rs        TableName: the claims and requests tables' names, validated once
//!     src/hex.rs          the one lowercase hex encoder
//!   idem-dialect/   the SQL once per engine, as data (no driver): statements, migrations, error-code tables
//!     src/statements.rs   ClaimStatements, RequestStatements: what a store binds to each, in which order
//!     src/postgres/       the statements and migration both PostgreSQL stores run (mod.rs);
//!                         partition.rs claims partitioned by the ID's own time (uuid_v7/ulid, days, the
//!                         table's record); maintenance.rs partition names, DDL scripts and the pure
//!                         plan of what to create and drop; sqlstate.rs SQLSTATE → ErrorKind
//!     src/{mysql,sqlite}.rs  the other engines' statements, migrations and error codes
//!   idem-sql/       one store on sqlx 0.8, SqlStore<E>, generic over a sealed Engine; a module per engine
//!     src/store.rs        SqlStore<E>: every claim capability, written once (aliases SqliteStore,
//!                         PostgresStore, MySqlStore)
//!     src/engine.rs       Engine: what differs, as data — statements, table layout (PostgreSQL's
//!                         partitioning), clock, BEGIN/COMMIT (PostgreSQL's aborted-transaction check),
//!                         error kinds, the migration; Driver: sqlx glue
//!     src/{sqlite,postgres,mysql}.rs  the three engines (each behind its feature), with each store's
//!                         batch claim, prune and migrate
//!     src/requests.rs     idempotent-request records on every engine; src/errors.rs code → ErrorKind
//!     src/tx.rs           Tx<E>, the handler's transaction, counted by sqlx (nested begin() = savepoint)
//!     src/held.rs         connections held without pool pings; closed past their lifetime or idle
//!                         time, on a BEGIN timeout, after repeated read-only answers
//!     src/any.rs          AnyStore: the one URL-scheme → engine switch (CLI, payments, http-payments)
//!     src/partitioned.rs  PostgreSQL claims partitioned by the ID's time: runs idem-dialect's maintenance
//!     src/common.rs       small helpers every engine shares
//!     tests/sql/          the one test binary (main.rs; an engine's modules behind its feature):
//!                         conformance_{sqlite,postgres,mysql}.rs the suite, pooled and held, against the
//!                         real servers; states_*.rs the database states; partitions_postgres.rs,
//!                         requests_*.rs, store_clock.rs; transactions/ nested transactions, round
//!                         trips per transaction, held-connection recycling
//!   idem-consumer/  the broker-independent runner
//!     src/source.rs       Source / Delivery: what an adapter implements (fetch; ack, dead-letter, abandon)
//!     src/runner/         Consumer: fetch loop with bounded concurrency; settle.rs decides ack / retry / dead letter;
//!                         work.rs each mode's transactions (per message, batch, set batch);
//!                         instrumented.rs wraps the handler (panics, timing, crash points)
//!     src/id_source.rs    IdSource (header, JSON pointer, broker's own slot)
//!     src/decode.rs       Decode: payload bytes → the handler's type (Json, Raw)
//!     src/dead_letter.rs  DeadLetter reasons and headers
//!     src/retry.rs        RetryPolicy (exponential, jittered), reconnect backoff
//!     src/prune.rs        prune_periodically: retention beside a running consumer
//!     src/metrics.rs      metrics names, RunStats; metrics/prometheus.rs the endpoint (feature `prometheus`)
//!     src/shutdown.rs     SIGINT/SIGTERM → CancellationToken
//!     src/in_memory.rs    InMemoryBroker (feature `test-util`): a fake for tests and the demo, not a broker;
//!                         visibility timeout, lost acks (a crash between commit and ack)
//!     src/crash.rs        crash points for fault injection (feature `crash-points`, IDEM_CRASH_AT)
//!     tests/idem_consumer/  the one test binary: runner, metrics, prune, store_states.rs
//!   idem-nats/ idem-amqp/ idem-kafka/ idem-redis-streams/ idem-mqtt/
//!                   one adapter per broker family, the same modules in each: builder.rs (XSourceBuilder
//!                   → connect), source.rs, delivery.rs, producer.rs (XProducer), topology.rs (ensure_*),
//!                   error.rs (Kafka adds offsets.rs, the offset tracker); tests/<crate>/main.rs, the
//!                   one test binary, with conformance.rs running the broker suite against the real broker
//!   idem-any/       a broker chosen at run time from a URL (as idem-sql's AnyStore is for stores):
//!                   url.rs the one scheme → adapter table (BrokerUrl), source.rs the source for a
//!                   SourceSpec handed to a WithSource job, producer.rs AnyProducer, names.rs where dead
//!                   letters go, nats.rs NATS URL lists, headers.rs outgoing headers in each family's
//!                   header slot; a cargo feature per adapter
//!   idem-relay/     the outbox relay: relay.rs the loop (wake-ups, poll, outages, housekeeping, settling
//!                   each row), round.rs one round's units (FIFO per destination and ordering key),
//!                   verdict.rs publish error → retry or dead letter, publish.rs Publish (+ AnyProducer),
//!                   settings.rs RelayBuilder, waker.rs RelayWaker and wake streams, metrics.rs RelayStats,
//!                   testing.rs FakeRelayStore (feature `test-util`, a fake); tests/idem_relay/ real brokers
//!   idem-redact/    redact_url (redact.rs) and redact_setting (setting.rs): the one place that decides
//!                   what in a URL or a client setting is secret, for every log line, error and Debug output
//!   idem-postgres/  the PostgreSQL store on tokio-postgres (deadpool or plain clients): BEGIN and the claim
//!                   pipelined in one flight; the same tables and SQL (idem-dialect's) as idem-sql's,
//!                   partitioned or not; tests/postgres/ its one test binary
//!   idem-testkit/   (publish = false) the store and broker conformance suites + macros, IDEM_TEST_* rules
//!     src/conformance/    the store suite, a module per capability (claim, transaction, batch,
//!                         set_batch, retention, operations); conformance_tests! in mod.rs
//!     src/request_conformance.rs, src/broker_conformance.rs  the request-store and broker suites
//!     src/http/           (feature `http`) the black-box HTTP suite: fixtures per store, the
//!                         suite's handlers, checks.rs; http_suite_tests! + HttpFramework in mod.rs
//!     src/fake_processor.rs  (feature `fake-processor`) the fake card processor: a charge per
//!                         key, Stripe-like replays, faults (hang, status, slow, charge-then-drop);
//!                         src/bin/idem-fake-processor.rs the same as a process
//!   idem-request/   the idempotent-request engine (engine.rs: lease, heartbeat, takeover, complete in
//!                   the operation's transaction) and the function-level `call` (call.rs)
//!   idem-redis/     the Redis request store: SET NX PX lease, fenced Lua scripts (scripts.rs),
//!                   one-round-trip replay; durability.rs the maxmemory check and WAIT;
//!                   tests/idem_redis/ (conformance.rs, redis_store.rs and
//!                   redis_store/durability.rs on redis-servers of the tests' own)
//!   idem-http/      tower Layer/Service for Idempotency-Key, on idem-request's engine
//!     src/layer.rs (config, builder) service.rs future.rs body.rs · key.rs (sf-string / bare)
//!     policy.rs (stored statuses) problem.rs (RFC 9457) record.rs (stored response, v1/v2 with
//!     trailers) principal.rs (scope) execution.rs (IdemRequest, derived keys, when the handler
//!     started) tx.rs + extract.rs (IdemTx, IdemRequest, Executed; axum behind `axum`)
//!     src/exchange.rs  the framework-free exchange (begin, read_body, start, attach, finish)
//!     tests/idem_http/  main.rs: the test kit's black-box suite on axum (support/app.rs), and
//!                    per store the tower-level checks: support/grpc.rs (a hand-written tonic
//!                    service), support/hang.rs (a store held at its n-th await),
//!                    support/write_lock.rs
//!   idem-actix/     actix-web 4 middleware + IdemTx/IdemRequest extractors on idem-http's exchange:
//!     src/middleware.rs extract.rs body.rs (actix bodies <-> http_body) convert.rs (http 0.2 <-> 1)
//!     tests/idem_actix/main.rs  the black-box suite on actix-web
//!   idem-client/    reqwest-middleware middleware for calling idempotent APIs: middleware.rs (the key,
//!                   the retry loop, the Outcome), policy.rs (what is retried, backoff, Retry-After),
//!                   key.rs (KeyChoice, IdempotentRequestExt), outcome.rs, error.rs; tests/client/ (main.rs
//!                   against the test kit's fake card processor, idem_http.rs against idem-http's layer)
//!   idem-cli/       the `idem` binary: demo/, admin.rs (migrate, prune, stats, reap-requests),
//!                   relay.rs (`idem relay`), format.rs (numbers for people)
//!   idem-client-bench/ (publish = false) `idem-client-bench`: idem-client's per-request cost vs reqwest
//!   idem-bench/     (publish = false) `idem-bench`: P1/P2/P3, the claim's cost next to the bare handler
//!   idem-chaos/     (publish = false) the fault-injection harness: run.rs (one run), fleet.rs (consumer
//!                   processes), broker.rs (publish, backlog, dead letters), ledger.rs (the check),
//!                   faults/ (postgres.rs restart + failover, proxy.rs cuts at COMMIT, nats_cluster.rs),
//!                   tests/idem_chaos/chaos.rs (the CI runs)
//! examples/
//!   payments/       the broker consumer service: cli.rs (flags), database.rs (AnyStore → the typed
//!                   store, the consumer in its mode), ledger.rs (tables, handler per engine),
//!                   charge_batch.rs (the set handler per engine), brokers.rs (flags → idem-any), bench.rs
//!   http-payments/  the HTTP service: app.rs (routes, auth), stores.rs (--database URL → store, ledger,
//!                   router; the server loop), layer.rs (idem-http per store), ledger.rs, bench/;
//!                   tests/http_payments/ (flows.rs, crash.rs, util/) against the real binary
//! fuzz/             cargo-fuzz targets (own workspace, nightly): IDs, keys, URLs, headers
//! scripts/          test (the test command), install-build-deps, install-tansu, chaos-soak, fuzz
//! ```
//!
//! A new request store implements `idem_core::store::{RequestStore, ReapRequests}` and passes
//! `idem_testkit::request_conformance_tests!(MyFixture)`; the test kit has one conformance macro
//! per capability, so a store without savepoints or batch claims (Redis) runs only the suites for
//! what it has.
//!
//! A new SQL engine implements `idem_sql::engine::Engine` and passes
//! `idem_testkit::conformance_tests!(MyFixture)`; any other store implements the capability traits
//! of `idem_core::store` and passes the macro of each; a new broker implements `Source` and
//! `Delivery` and passes `idem_testkit::broker_conformance_tests!(MyFixture)`.
//! `CONTRIBUTING.md` at the repository's root gives the steps. Adapters and the runner sit on
//! `Processor`; nothing above the stores writes claim SQL. Departures from the team layout: one
//! `idem-sql` crate with a feature per engine instead of a crate per driver — the engines share
//! one store, its transactions and connection handling, and differ only in an `Engine` impl —
//! and a separate `idem-consumer` crate for the runner, so that `idem-core` keeps no
//! async-runtime dependency.
//! There is one handler shape per unit of work, `idem_core::Handler` for a message and
//! `idem_core::SetHandler` for a batch (both re-exported by `idem-consumer`), and one path per
//! mode: the runner calls `Processor::process_with`, `Processor::process_batch` and
//! `Processor::process_batch_set_with` with the user's handler wrapped in a decorator of its own
//! (`runner/instrumented.rs`: panics caught, handler time measured, crash points), so the code the tests and benchmarks run is the code
//! that runs in production. `Processor::process` also takes a closure, as sugar for one message;
//! batches take the trait, whose future is known to be `Send` (rustc cannot yet prove that of an
//! `AsyncFnMut` closure's future, rust-lang/rust#151398).

mod clock;
pub mod crash;
mod derived;
mod error;
mod fingerprint;
mod handler;
pub mod hex;
mod id;
mod message;
pub mod outbox;
mod outcome;
mod processor;
mod request;
mod retention;
pub mod store;
mod table;

pub use clock::{Clock, ManualClock, Stamp, StoreClock, SystemClock, Timestamp};
pub use derived::DerivedKey;
pub use error::{BoxError, Disposition, Error, ErrorKind};
pub use fingerprint::{Fingerprint, FingerprintHasher};
pub use handler::{Handler, SetHandler};
pub use id::{ConsumerName, DEFAULT_MAX_ID_LEN, MAX_CONSUMER_NAME_LEN, MessageId};
pub use message::{Identified, Message};
pub use outcome::{Claim, Outcome};
pub use processor::{Processor, ProcessorBuilder, SetBatch};
pub use request::record as request_record;
pub use request::{
    Begin, BeginIn, Fence, IdempotencyKey, MAX_IDEMPOTENCY_KEY_LEN, Recovery, RequestAction,
    RequestErrorKind, RequestKey, RequestScope, Resume, Stuck, retry_after,
};
pub use retention::{Retention, format_duration, parse_duration};
pub use store::{
    BatchClaimStore, ClaimRequest, ClaimStore, ConsumerStats, Migrate, Prune, Savepoints, Stats,
    TransactionalStore,
};
pub use table::{DEFAULT_OUTBOX_TABLE, DEFAULT_REQUESTS_TABLE, DEFAULT_TABLE, TableName};
