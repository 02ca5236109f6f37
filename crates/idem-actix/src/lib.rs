//! `Idempotency-Key` for actix-web 4: [`IdempotencyMiddleware`] runs a `POST`/`PATCH` once per
//! client key and answers every retry with the stored response, and the [`IdemTx`] and
//! [`IdemRequest`] extractors give the handler the execution's transaction and request.
//!
//! It drives idem-http's framework-free [`Exchange`](idem_http::exchange::Exchange), so it
//! decides exactly as the tower layer does — key format, scope per principal, fingerprint,
//! replay, `409`/`422`/`503` problems, what is stored and what rolls back — and it is
//! configured by the same builder, [`IdempotencyLayer`]. Read
//! [idem-http's documentation](idem_http) for the behaviour; this crate only adapts actix-web's
//! types. Both pass the same black-box suite on every store (`idem_testkit::http`).
//!
//! ```
//! use actix_web::{App, HttpResponse, test, web};
//! use idem_actix::{IdemTx, IdempotencyMiddleware};
//! use idem_http::IdempotencyLayer;
//! use idem_request::Idempotency;
//! use idem_sql::{SqliteOptions, SqliteStore};
//!
//! // The handler writes through the execution's transaction: the charge and the stored
//! // response commit together (a 5xx is not stored, and its writes roll back).
//! async fn create_charge(mut tx: IdemTx<SqliteStore>, cents: web::Json<i64>) -> HttpResponse {
//!     let written = sqlx::query_scalar::<_, i64>("INSERT INTO charges (cents) VALUES (?) RETURNING id")
//!         .bind(*cents)
//!         .fetch_one(&mut **tx)
//!         .await;
//!     match written {
//!         Ok(id) => HttpResponse::Created().body(format!("charge {id}")),
//!         Err(_) => HttpResponse::InternalServerError().finish(),
//!     }
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # actix_web::rt::System::new().block_on(async {
//! # let dir = tempfile::tempdir()?;
//! let store = SqliteStore::open(dir.path().join("app.db"), SqliteOptions::default()).await?;
//! idem_core::Migrate::migrate(&store).await?;
//! sqlx::query("CREATE TABLE charges (id INTEGER PRIMARY KEY, cents INTEGER)")
//!     .execute(store.pool())
//!     .await?;
//!
//! let idem = Idempotency::builder(store.clone()).build()?;
//! // Scoped per principal: here a header stands in for your authentication.
//! let config = IdempotencyLayer::per_principal(idem, |parts: &http::request::Parts| {
//!     parts.headers.get("x-account").map(|v| v.as_bytes().to_vec())
//! })
//! .require_key();
//! let app = test::init_service(
//!     App::new().service(
//!         web::resource("/charges")
//!             .wrap(IdempotencyMiddleware::new(config))
//!             .route(web::post().to(create_charge)),
//!     ),
//! )
//! .await;
//!
//! let charge = || {
//!     test::TestRequest::post()
//!         .uri("/charges")
//!         .insert_header(("x-account", "acct_1"))
//!         .insert_header(("idempotency-key", "\"8e03978e-40d5\""))
//!         .set_json(1250)
//!         .to_request()
//! };
//! let first = test::call_service(&app, charge()).await;
//! assert_eq!(first.status(), 201);
//! assert!(first.headers().get("idempotent-replayed").is_none());
//! let retry = test::call_service(&app, charge()).await;
//! assert_eq!(retry.status(), 201);
//! assert_eq!(retry.headers().get("idempotent-replayed").unwrap(), "true");
//! assert_eq!(test::read_body(retry).await, "charge 1");
//!
//! let charges: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
//!     .fetch_one(store.pool())
//!     .await?;
//! assert_eq!(charges, 1);
//! # Ok::<_, Box<dyn std::error::Error>>(())
//! # })
//! # }
//! ```
//!
//! # What differs from the tower layer
//!
//! - **The principal.** The configuration's principal function sees the request head as
//!   `http::request::Parts` (method, URI, headers); actix-web's extensions are not in it. For
//!   an account your authentication middleware put there, use
//!   [`principal_from_request`](IdempotencyMiddleware::principal_from_request).
//! - **Extractors.** [`IdemTx`] and [`IdemRequest`] fail with `500 internal-error` outside an
//!   idempotent execution; take `Option<…>` of them where the key is optional. (actix-web's
//!   `Option` extractor turns every failure into `None`.) A 4xx the handler answers without
//!   using either is stored only when it says it executed: insert
//!   [`Executed`] in the response's extensions
//!   (`response.extensions_mut().insert(Executed)`). An extractor's rejection (the `Json`
//!   extractor's `400`) is never stored, so the corrected retry runs.
//! - **Recovery points.** [`IdemPhases`] runs a request as phases in the middleware's
//!   execution, as [`idem_http::IdemPhases`] does under the tower layer (see
//!   [`idem_http::phases`]); its [`run`](IdemPhases::run) answers actix-web's response, or a
//!   [`PhasesRejection`]. actix-web handlers need not be `Send`; the [`Phases`](idem_http::Phases)
//!   trait is the same for both, so one implementation serves either framework and the
//!   completer ([`idem_http::phases::resume`]).
//! - **Trailers** are not sent by actix-web; a stored response keeps none.
//! - **Nested paths.** `web::scope` keeps the whole path in the request, so `/v1/charges`
//!   and `/v2/charges` are two scopes, as under axum's `Router::nest`.
//! - **Panics.** A panicking handler abandons the execution (writes through [`IdemTx`] roll
//!   back, the key is freed) and the panic goes on to actix-web, which drops the connection.

mod body;
mod convert;
mod extract;
mod middleware;

pub use body::BodyError;
pub use extract::{IdemPhases, IdemRequest, IdemTx, PhasesRejection, TxRejection, phase_response};
pub use idem_http::{Executed, IdempotencyLayer};
pub use middleware::{IdempotencyMiddleware, IdempotencyService};
