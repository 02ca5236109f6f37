//! `Idempotency-Key` for HTTP APIs: a tower [`Layer`](tower_layer::Layer) that runs a
//! `POST`/`PATCH` once per client key and answers every retry with the stored response.
//!
//! A client whose `POST /charges` timed out cannot tell whether the charge happened, so it
//! retries with the same `Idempotency-Key` (IETF `draft-ietf-httpapi-idempotency-key-header`).
//! [`IdempotencyLayer`] makes that retry safe: the first request takes a record for (principal,
//! method, path, key) under a lease, runs the handler and stores its response; a retry gets
//! that response back byte for byte, marked `Idempotent-Replayed: true`. It sits on the
//! [`idem_request::Idempotency`] engine, so it works on every store of idem — and on the SQL
//! stores **the handler's writes through the [`IdemTx`] extractor and the stored response
//! commit in one transaction**: either both happened or neither did. (On Redis, and for
//! anything written elsewhere, see [what is rolled back](#what-is-rolled-back-per-store).)
//!
//! It is a plain [`Layer`](tower_layer::Layer)/[`Service`](tower_service::Service) over
//! `http::Request<B>`, so it fits axum (`Router::layer`, `MethodRouter::layer`), hyper and
//! any tower stack.
//!
//! ```
//! use axum::response::{IntoResponse, Response};
//! use axum::{Json, Router, routing::post};
//! use http::StatusCode;
//! use idem_http::{IdemTx, IdempotencyLayer};
//! use idem_request::Idempotency;
//! use idem_sql::{SqliteOptions, SqliteStore};
//! use tower::ServiceExt;
//!
//! # #[cfg(not(feature = "axum"))] fn main() {} // the extractor needs the `axum` feature
//! # #[cfg(feature = "axum")]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! # let dir = tempfile::tempdir()?;
//! let store = SqliteStore::open(dir.path().join("app.db"), SqliteOptions::default()).await?;
//! idem_core::Migrate::migrate(&store).await?;
//! sqlx::query("CREATE TABLE charges (id INTEGER PRIMARY KEY, cents INTEGER CHECK (cents > 0))")
//!     .execute(store.pool())
//!     .await?;
//!
//! // The handler's error renders a 5xx: the layer does not store it, the charge's writes roll
//! // back with it, and the client's retry runs again. (A `Result<_, String>` would render its
//! // `Err` as `200 OK`, stored and replayed as a success.)
//! struct DbError(sqlx::Error);
//!
//! impl From<sqlx::Error> for DbError {
//!     fn from(e: sqlx::Error) -> Self {
//!         Self(e)
//!     }
//! }
//!
//! impl IntoResponse for DbError {
//!     fn into_response(self) -> Response {
//!         let _cause = self.0; // log it
//!         (StatusCode::INTERNAL_SERVER_ERROR, "the charge could not be written").into_response()
//!     }
//! }
//!
//! // The handler writes through the execution's transaction: the charge and the stored
//! // response commit together.
//! async fn create_charge(
//!     mut tx: IdemTx<SqliteStore>,
//!     Json(cents): Json<i64>,
//! ) -> Result<(StatusCode, String), DbError> {
//!     let id: i64 = sqlx::query_scalar("INSERT INTO charges (cents) VALUES (?) RETURNING id")
//!         .bind(cents)
//!         .fetch_one(&mut **tx)
//!         .await?;
//!     Ok((StatusCode::CREATED, format!("charge {id}")))
//! }
//!
//! #[derive(Clone)]
//! struct Account(String); // your authentication middleware inserts it
//!
//! let idem = Idempotency::builder(store.clone()).build()?; // 24 h TTL, 30 s lease
//! let layer = IdempotencyLayer::per_principal(idem, |parts: &http::request::Parts| {
//!     parts.extensions.get::<Account>().map(|a| a.0.clone())
//! })
//! .require_key();
//! let app = Router::new()
//!     .route("/charges", post(create_charge))
//!     .layer(layer)
//!     .layer(axum::Extension(Account("acct_1".into()))); // stands in for authentication
//!
//! let request = |key: &str, content_type: &str, cents: &str| {
//!     http::Request::post("/charges")
//!         .header("content-type", content_type)
//!         .header("idempotency-key", key)
//!         .body(axum::body::Body::from(cents.to_owned()))
//! };
//! let key = "\"8e03978e-40d5-43e8-bc93-6894a57f9324\"";
//!
//! // `Json` refuses a `text/plain` body before the handler runs: not stored, the key stays
//! // free, and the corrected request runs.
//! let refused = app.clone().oneshot(request(key, "text/plain", "1250")?).await?;
//! assert_eq!(refused.status(), 415);
//! let first = app.clone().oneshot(request(key, "application/json", "1250")?).await?;
//! assert_eq!(first.status(), 201);
//! assert!(first.headers().get("idempotent-replayed").is_none());
//!
//! let retry = app.clone().oneshot(request(key, "application/json", "1250")?).await?;
//! assert_eq!(retry.status(), 201);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//!
//! // A database error is a 500: not stored, rolled back; the retry runs again.
//! for _ in 0..2 {
//!     let failed = app.clone().oneshot(request("charge-2", "application/json", "-5")?).await?;
//!     assert_eq!(failed.status(), 500);
//!     assert!(failed.headers().get("idempotent-replayed").is_none());
//! }
//!
//! let charges: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
//!     .fetch_one(store.pool())
//!     .await?;
//! assert_eq!(charges, 1);
//! # Ok(()) }
//! ```
//!
//! # Without axum
//!
//! In hyper or a plain tower stack the inner service receives `http::Request<RequestBody<B>>`
//! and takes the transaction from the extensions with [`IdemTx::take`]:
//!
//! ```
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::Full;
//! use idem_core::BoxError;
//! use idem_http::{IdemTx, IdempotencyLayer, RequestBody};
//! use idem_request::Idempotency;
//! use idem_sql::{SqliteOptions, SqliteStore};
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), BoxError> {
//! # let dir = tempfile::tempdir()?;
//! let store = SqliteStore::open(dir.path().join("jobs.db"), SqliteOptions::default()).await?;
//! idem_core::Migrate::migrate(&store).await?;
//! sqlx::query("CREATE TABLE jobs (body BLOB)").execute(store.pool()).await?;
//!
//! let handler = service_fn(|req: Request<RequestBody<Full<Bytes>>>| async move {
//!     let mut tx = IdemTx::<SqliteStore>::take(req.extensions())?;
//!     let body = http_body_util::BodyExt::collect(req.into_body()).await?.to_bytes();
//!     sqlx::query("INSERT INTO jobs VALUES (?)").bind(body.to_vec()).execute(&mut **tx).await?;
//!     drop(tx); // back to the layer, which commits it with the stored response
//!     Ok::<_, BoxError>(Response::new(Full::new(Bytes::from_static(b"queued"))))
//! });
//! // One trusted caller (an internal job runner): a shared scope is acceptable here.
//! let idem = Idempotency::builder(store.clone()).build()?;
//! let svc = ServiceBuilder::new()
//!     .layer(IdempotencyLayer::shared_scope(idem).require_key())
//!     .service(handler);
//!
//! for _ in 0..2 {
//!     let req = Request::post("/jobs")
//!         .header("Idempotency-Key", "job-2024-06-01")
//!         .body(Full::new(Bytes::from_static(b"{\"report\":\"daily\"}")))?;
//!     let res = svc.clone().oneshot(req).await?;
//!     assert_eq!(res.status(), 200);
//! }
//! let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs").fetch_one(store.pool()).await?;
//! assert_eq!(jobs, 1);
//! # Ok(()) }
//! ```
//!
//! # The key
//!
//! The `Idempotency-Key` header (the name is case-insensitive, and configurable with
//! [`key_header`](IdempotencyLayer::key_header)) carries one of:
//!
//! - an RFC 8941 **sf-string**, as the draft specifies: `Idempotency-Key: "8e03978e-40d5"`,
//!   with `\"` and `\\` as its only escapes; parameters after it (`"…";v=1`) are allowed and
//!   ignored. Its content is the key: **1 to 255 bytes of printable ASCII**, spaces included
//!   (`"order 42"`), not spaces only;
//! - a **bare key**, as Stripe-style clients send it: `Idempotency-Key: 8e03978e-40d5` — any
//!   value that does not start with `"` is the key itself: **1 to 255 bytes of visible ASCII**
//!   (`!` to `~`: no spaces, no control characters, nothing outside ASCII).
//!
//! The limit is [`max_key_len`](IdempotencyLayer::max_key_len), and the store's own limit
//! applies too. Anything else — an empty value, `""`, 256 bytes, a byte outside ASCII, an
//! unterminated or badly escaped sf-string, text after the string — is `400 invalid-key`, and
//! so is a request with two `Idempotency-Key` headers. A list on one line is refused too:
//! `"a", "b"` has text after the string, and `a, b` (two bare keys as a proxy joins repeated
//! headers) has a space; a bare value without spaces such as `a,b` is the one key `a,b`. A
//! huge value (64 KiB, say) is `400 invalid-key` like any key over the limit, as long as the
//! request head fits the HTTP server's own limit (hyper answers `431` for a larger head before
//! the layer sees it). Use a fresh UUID per operation and send it again on every retry of that
//! operation.
//!
//! # What the layer does
//!
//! - **Methods**: `POST` and `PATCH` ([`methods`](IdempotencyLayer::methods)). Other methods
//!   pass through; a key on `GET`, `HEAD` or `OPTIONS` is ignored and nothing is recorded.
//! - **Per route**: a key is [`Required`](KeyRequirement::Required) (no key → 400, the handler
//!   does not run), [`Optional`](KeyRequirement::Optional) (no key → the request runs without
//!   idempotency; the default) or [`Off`](KeyRequirement::Off); in axum, put layers configured
//!   differently on different routes, or use
//!   [`key_requirement_by`](IdempotencyLayer::key_requirement_by).
//! - **Scope**: records are looked up by (principal, method, path, key), the path as the
//!   client sent it (axum's `OriginalUri`: under `Router::nest`, `/v1/charges` and
//!   `/v2/charges` are two scopes). The principal comes from your function of the request head
//!   ([`per_principal`](IdempotencyLayer::per_principal)); one principal can never see, replay
//!   or block another's record. Without one, the layer must be built with
//!   [`shared_scope`](IdempotencyLayer::shared_scope) — unsafe for multi-tenant APIs.
//! - **Fingerprint**: SHA-256 over the method, the path with its query, the `Content-Type`
//!   and the body ([`default_fingerprint`]); your own with
//!   [`fingerprint_with`](IdempotencyLayer::fingerprint_with). The same key with another
//!   fingerprint is `422`, and the original record stays as it was.
//! - **First request**: the record is taken (in progress, with a lease and a fencing token;
//!   a heartbeat renews the lease while the handler runs), the handler runs with the
//!   transaction in the request's extensions, and a response the [policy](StorePolicy) stores
//!   is committed with the record: the status, the allow-listed headers (never `Set-Cookie`,
//!   never hop-by-hop headers: see [`record`]), the body and the trailers. The first response
//!   never carries the replay marker.
//! - **External calls**: the handler finds its [`IdemRequest`] in the request's extensions
//!   (an axum extractor) and derives the idempotency key of every call to a third party from
//!   it ([`IdemRequest::derive_key`]): distinct per principal and route, the same on every
//!   retry and takeover. Never pass the client's key on: two tenants may both have chosen
//!   `order-42`.
//! - **Outgoing messages**: the handler enqueues them through the store's
//!   [`OutboxStore`](idem_core::outbox::OutboxStore) on [`IdemTx`], their IDs from
//!   [`IdemRequest::emitter`] (derived from the scoped key, the same on every retry and
//!   takeover), so they commit with the stored response or roll back with one that is not
//!   stored. The SQL stores have an outbox; Redis's store has none (it shares no transaction
//!   with the request). [`Principal::emitter`] recomputes a request's IDs outside it.
//! - **Retry**: the stored response byte for byte (status, kept headers, body, trailers), plus
//!   `Idempotent-Replayed: true` ([`replay_header`](IdempotencyLayer::replay_header)).
//! - **In flight**: a retry while the first still runs is `409 conflict` at once, with
//!   `Retry-After` a hint of 1 s ([`retry_after`](IdempotencyLayer::retry_after), never more
//!   than the holder's lease has left) — never blocked until the first finishes. A record
//!   whose lease ran out (its server crashed) is taken over by the next retry; the old
//!   holder's late completion is refused by the fencing token (`409 lease-lost`).
//! - **Only what the handler started is stored** (Stripe: "results are only saved if an API
//!   endpoint started executing"): a 4xx produced before the handler started — an axum
//!   extractor's rejection, such as `Json`'s `415` for a `text/plain` body or `422` for a
//!   missing field — is sent but not stored, and the key is free for the corrected retry. The
//!   handler has started once it used [`IdemTx`] or derived a key from [`IdemRequest`], or
//!   said so ([`IdemRequest::mark_started`], the [`Executed`] response marker); see
//!   [`execution`]. 2xx and 3xx responses are stored either way.
//! - **Not stored**: 5xx, 408, 409, 425, 429 and panics, by default, and a gRPC reply whose
//!   `grpc-status` maps to one of those. The response still goes to the client and the key is
//!   free, so the retry runs again. What is undone depends on where the handler wrote (see
//!   below): only writes through [`IdemTx`] on a SQL store roll back.
//! - **Bodies**: a request body over [`request_body_limit`](IdempotencyLayer::request_body_limit)
//!   (1 MiB) is `413` before any record is written; so is one whose `Content-Length` says so,
//!   before a byte of it is read. A body that ends before its `Content-Length` (the client
//!   stopped sending) is `400 invalid-body`, also before any record is written, so the key
//!   stays free. A response body over
//!   [`response_storage_limit`](IdempotencyLayer::response_storage_limit) (1 MiB) still
//!   completes the record with its status and headers, so a retry never executes again; the
//!   replay has an empty body, no trailers and `Idempotent-Body-Omitted: true`.
//! - **Client gone**: a client that disconnects makes the server drop the request (hyper
//!   drops its future), at whatever point it is — taking the record, running the handler,
//!   storing the response — and the key is freed at once, in the background: the execution is
//!   abandoned as after a panic (or, dropped while its commit was under way, completed). The
//!   client's retry then runs the handler again (or gets the stored response); only in the
//!   moment before the key is free is it `409 conflict` with `Retry-After`.
//! - **Expiry**: records live for the engine's TTL (24 h by default,
//!   [`IdempotencyBuilder::ttl`](idem_request::IdempotencyBuilder::ttl)); after it the key
//!   executes again, and the store's reaper deletes the record in bounded batches.
//! - **Logs**: a key is a bearer-like secret in a shared scope; the layer and the engine name
//!   it by a digest ([`KeyDigest`](idem_request::KeyDigest)) at info and above.
//!
//! # SQLite: one writer at a time
//!
//! SQLite has one write lock for the whole database. The handler's transaction begins
//! deferred: it takes the lock at the handler's first write through [`IdemTx`] (or, for a
//! handler that wrote nothing, for the moment the response is stored), so a slow handler that
//! reads, calls another service or waits holds up no other key's request. Every wait for the
//! lock is bounded by the store's busy timeout
//! (`idem_sql::SqliteOptions::busy_timeout`, 10 s by default; give an HTTP API's store one its
//! clients can wait for): a request whose record cannot be taken or whose
//! response cannot be stored within it is `503 store-unavailable` with `Retry-After`, and its
//! key is free — the next request with the key runs, never `409` because of it. A handler's own
//! write that waits past it fails with `SQLITE_BUSY`, which the store's
//! [`classify`](idem_core::TransactionalStore::classify) calls
//! [`Transient`](idem_core::ErrorKind::Transient): answer `503` with `Retry-After` there too.
//! A write after a read in the same transaction does not wait: SQLite refuses it at once while
//! another request holds the lock (or has committed since the read), so a handler that reads
//! before it writes should write first, or take the lock first with a write that changes
//! nothing (`UPDATE accounts SET id = id WHERE 0`). The heartbeat renews the lease whenever the
//! lock is free, and while any transaction holds it no one can take the record over.
//!
//! # What is rolled back, per store
//!
//! When a response is not stored (5xx, a refusal before the handler started, a panic, a
//! client gone, a lost lease, a failed commit):
//!
//! | the handler's effect | SQLite, PostgreSQL, MySQL (`idem-sql`, `idem-postgres`) | Redis (`idem-redis`) |
//! |---|---|---|
//! | writes through [`IdemTx`] | rolled back: they commit only with the stored response | not rolled back: `IdemTx` carries no database transaction |
//! | writes on your own pool or connection | not rolled back | not rolled back |
//! | calls to third parties | not undone: give each a key from [`IdemRequest::derive_key`] so the retry's call is deduplicated | the same |
//! | the record | freed: the retry runs | freed: the retry runs |
//!
//! So "a 500 means nothing happened" holds only for writes through `IdemTx` on a SQL store.
//! Elsewhere make the handler safe to run again: write under IDs derived from the request
//! ([`IdemRequest::derive_key`]) so a second execution finds the first one's work.
//!
//! # gRPC
//!
//! A tonic service is a tower service over `http::Request`, so the layer goes in front of it
//! like any other; the client sends the key as `idempotency-key` metadata. A unary method's
//! reply is stored and replayed whole — message, `grpc-status` and `grpc-message`, in the
//! trailers or (for an error `Status`) in the head — and the policy judges the `grpc-status`
//! (`UNAVAILABLE` is judged as 503, not stored; `NOT_FOUND` as 404, stored once the method
//! started). Streaming methods must not be buffered: switch the layer off for them.
//!
//! ```no_run
//! # fn doc<S: idem_core::store::RequestStore + Clone + 'static>(idem: idem_request::Idempotency<S>) {
//! use idem_http::{IdempotencyLayer, KeyRequirement};
//!
//! let layer = IdempotencyLayer::per_principal(idem, |parts: &http::request::Parts| {
//!     parts.headers.get("x-account").map(|v| v.as_bytes().to_vec()) // your interceptor's
//! })
//! .key_requirement_by(|parts: &http::request::Parts| match parts.uri.path() {
//!     "/payments.v1.Payments/Charge" => KeyRequirement::Required,
//!     _ => KeyRequirement::Off, // streaming and read methods pass through untouched
//! });
//! // tonic::transport::Server::builder().layer(layer).add_service(PaymentsServer::new(svc))
//! # let _ = layer;
//! # }
//! ```
//!
//! # Status codes
//!
//! Every response the layer makes itself is `application/problem+json` (RFC 9457) with `type`,
//! `title`, `status`, `detail` and `code` ([`problem`]):
//!
//! | status | `code` | when | the handler |
//! |---|---|---|---|
//! | handler's | — | first execution (stored, or not stored by the policy) | ran once |
//! | stored | — | retry of a completed request: the stored response + `Idempotent-Replayed: true` | not run |
//! | 400 | `missing-key` | a route with a required key, no `Idempotency-Key` | not run |
//! | 400 | `invalid-key` | a key outside the format above, or two `Idempotency-Key` headers | not run |
//! | 400 | `invalid-body` | the request body could not be read (shorter than its `Content-Length`, the client gone) | not run |
//! | 401 | `missing-principal` | a key, but the principal function found no principal; with `WWW-Authenticate` | not run |
//! | 409 | `conflict` | the same key is in flight, with `Retry-After` | not run |
//! | 409 | `lease-lost` | this request ran past its lease and a retry took the key over; its response was not stored | ran; not stored (see the table above for what was undone) |
//! | 413 | `body-too-large` | request body over the limit; nothing recorded | not run |
//! | 422 | `fingerprint-mismatch` | the key was used, on this method and path, for a request with another query, `Content-Type` or body; the original record is untouched | not run |
//! | 500 | `internal-error` | a stored response the layer cannot read, a handler that kept the transaction, a response body that failed | ran; not stored |
//! | 503 | `store-unavailable` | the store is down, refusing work, or busy past its bound (SQLite's write lock, see below); with `Retry-After`; the key is free | not run, or ran and not stored |
//! | 503 | `phase-failed` | a phase of a request run as [recovery points](phases) failed, with `Retry-After`; the record keeps its last point and the retry resumes there | ran up to that phase; not stored (that phase rolled back, earlier phases stand) |
//!
//! # Recovery points
//!
//! A handler that calls a third party (a card processor) cannot commit everything in one
//! transaction. It runs its request as phases in the layer's own execution with
//! [`IdemPhases`] (an axum extractor; [`IdemPhases::take`] elsewhere): each phase boundary
//! commits the phase's writes and the record's new recovery point, a retry, a takeover or the
//! completer resumes at the last point (a committed phase never runs again), and the last
//! phase's writes commit together with the stored response, replayed with
//! `Idempotent-Replayed: true`. A failed phase answers `503 phase-failed` and the record keeps
//! its point. The phases are a type implementing [`Phases`] (its `step` future is `Send`, so a
//! plain axum handler runs them), answering a [`PhaseResponse`]; the completer finishes a stuck
//! request with the same type ([`phases::resume`]), storing the response the layer replays. See
//! [`phases`] for the rules and a worked example.
//!
//! # Other frameworks
//!
//! Everything above is decided by a framework-free [`Exchange`] over
//! `http` types — request head and body bytes in, decision and stored response out — that
//! [`IdempotencyService`] drives for tower and `idem-actix` drives for actix-web; another
//! framework drives it the same way (see [`exchange`]), configured by this crate's
//! [`IdempotencyLayer`] builder ([`IdempotencyLayer::exchange`]).
//!
//! # Placement
//!
//! Put authentication *in front of* (outside) this layer so the principal function finds the
//! account; put the layer in front of anything whose effect must happen once. Handlers must
//! not keep [`IdemTx`] beyond their response (a spawned task holding it makes the request
//! fail with `500 internal-error` and roll back). On Redis, which shares no transaction with
//! your database, the handler's writes are not rolled back with an unstored response — see
//! the table above and the Redis store's documentation.

mod body;
pub mod exchange;
pub mod execution;
#[cfg(feature = "axum")]
mod extract;
mod future;
mod key;
mod layer;
pub mod phases;
pub mod policy;
mod principal;
pub mod problem;
pub mod record;
mod run;
mod service;
mod tx;

pub use body::{RequestBody, ResponseBody};
pub use exchange::Exchange;
pub use execution::{Executed, IdemRequest};
pub use future::ResponseFuture;
pub use key::{IDEMPOTENCY_KEY, KeyError, parse_key, parse_key_header};
pub use layer::{
    DEFAULT_BODY_LIMIT, DEFAULT_RETRY_AFTER, IDEMPOTENT_BODY_OMITTED, IDEMPOTENT_REPLAYED,
    IdempotencyLayer, KeyRequirement, default_fingerprint,
};
pub use phases::{IdemPhases, PhaseResponse, Phases, PhasesError};
pub use policy::{StorePolicy, stored_by_default};
pub use principal::{MakePrincipal, Principal, PrincipalFn, SharedScope};
pub use service::IdempotencyService;
pub use tx::{IdemTx, TxError};

pub use idem_core::IdempotencyKey;
