//! Recovery points behind the layer: a handler runs its request as a sequence of phases
//! (brandur.org's *atomic phases*) in the layer's own execution, with [`IdemPhases`].
//!
//! A request that calls a third party cannot do everything in one transaction: the card
//! processor's charge cannot roll back with the database. So it runs as phases, each
//! boundary one commit of the phase's writes and the record's new recovery point, and the
//! last phase's writes commit together with the stored HTTP response (the layer completes
//! the record as for any handler):
//!
//! - on a first execution the first recovery point is committed before the first phase runs;
//! - a retry of the same key after a phase failed, a takeover after the server died, or the
//!   completer ([`resume`]) resumes at the last point: a committed phase never runs again;
//! - a phase's error rolls back that phase's writes only; the record keeps its last point and
//!   its lease ends (it is not freed: phases committed), and the handler's answer is sent but
//!   not stored (`503 phase-failed` when it returns the [`PhasesError`]);
//! - [`Step::Done`] stores the response as completed, [`Step::Abandon`] as abandoned; every
//!   retry gets it back with `Idempotent-Replayed: true`.
//!
//! A phase's external call sends [`PhaseCtx::foreign_key`], the same on every attempt, so the
//! third party deduplicates a repeat. Everything a phase needs goes into the phase's state
//! (the variant's fields of your serde enum): the completer resumes a stuck request without
//! its HTTP request, from the stored state alone.
//!
//! The phases are a type of yours implementing [`Phases`], whose [`step`](Phases::step)
//! returns a `Send` future: so a plain axum handler, whose future must be `Send`, can run
//! them (an `async` closure handed to a generic driver is not provably `Send`).
//!
//! ```
//! use axum::{Json, Router, routing::post};
//! use http::StatusCode;
//! use idem_core::BoxError;
//! use idem_http::phases::{IdemPhases, PhaseResponse, Phases, PhasesError};
//! use idem_http::IdempotencyLayer;
//! use idem_request::{Idempotency, PhaseCtx, Step};
//! use idem_sql::{SqliteOptions, SqliteStore};
//! use tower::ServiceExt;
//!
//! /// The recovery points of a charge; each variant holds what its phase needs.
//! #[derive(serde::Serialize, serde::Deserialize)]
//! enum Charge {
//!     /// Call the processor (foreign).
//!     Authorize { cents: i64 },
//!     /// Write the row (local) with what the processor answered.
//!     Record { cents: i64, processor_id: String },
//! }
//!
//! /// What the phases share: clients, configuration (not the request: the completer has none).
//! struct Charging;
//!
//! impl Phases<SqliteStore> for Charging {
//!     type Phase = Charge;
//!     type Error = BoxError;
//!
//!     async fn step(
//!         &self,
//!         phase: Charge,
//!         ctx: &mut PhaseCtx<SqliteStore>,
//!     ) -> Result<Step<Charge, PhaseResponse>, BoxError> {
//!         Ok(match phase {
//!             Charge::Authorize { cents } => {
//!                 // processor.charge(cents).idempotency_key(ctx.foreign_key("charge")) …
//!                 let processor_id = format!("ch_{}", ctx.foreign_key("charge").to_uuid_string());
//!                 Step::Next(Charge::Record { cents, processor_id })
//!             }
//!             Charge::Record { cents, processor_id } => {
//!                 sqlx::query("INSERT INTO charges (cents, processor_id) VALUES (?, ?)")
//!                     .bind(cents)
//!                     .bind(&processor_id)
//!                     .execute(&mut **ctx.tx())
//!                     .await?;
//!                 let body = serde_json::json!({ "id": processor_id, "cents": cents });
//!                 Step::Done(PhaseResponse::json(StatusCode::CREATED, &body)?)
//!             }
//!         })
//!     }
//! }
//!
//! // A plain axum handler: its future is `Send`.
//! async fn create_charge(
//!     phases: IdemPhases<SqliteStore>,
//!     Json(cents): Json<i64>,
//! ) -> Result<PhaseResponse, PhasesError> {
//!     phases.run(Charge::Authorize { cents }, Charging).await
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), BoxError> {
//! # let dir = tempfile::tempdir()?;
//! let store = SqliteStore::open(dir.path().join("app.db"), SqliteOptions::default()).await?;
//! idem_core::Migrate::migrate(&store).await?;
//! sqlx::query("CREATE TABLE charges (cents INTEGER, processor_id TEXT)")
//!     .execute(store.pool())
//!     .await?;
//! let idem = Idempotency::builder(store.clone()).build()?;
//! let app = Router::new()
//!     .route("/charges", post(create_charge))
//!     .layer(IdempotencyLayer::shared_scope(idem).require_key());
//!
//! let post = || {
//!     http::Request::post("/charges")
//!         .header("content-type", "application/json")
//!         .header("idempotency-key", "charge-1")
//!         .body(axum::body::Body::from("1250"))
//! };
//! let first = app.clone().oneshot(post()?).await?;
//! assert_eq!(first.status(), 201);
//! let retry = app.clone().oneshot(post()?).await?;
//! assert_eq!(retry.status(), 201);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM charges").fetch_one(store.pool()).await?;
//! assert_eq!(rows, 1);
//! # Ok(()) }
//! ```
//!
//! Without axum, take the phases from the request's extensions with [`IdemPhases::take`]
//! (as [`IdemTx::take`](crate::IdemTx::take)); in actix-web, `idem-actix` has the extractor.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderName, HeaderValue};
use http::{Extensions, HeaderMap, Response, StatusCode};
use idem_core::store::RecoveryStore;
use idem_core::{BoxError, Error, ErrorKind, RequestErrorKind, Stuck};
use idem_request::{Execution, Finish, Idempotency, KeyDigest, PhaseCtx, Step};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::execution::StartMark;
use crate::layer::Config;
use crate::problem::{DEFAULT_TYPE_BASE, Problem, ProblemCode};
use crate::record::{DEFAULT_STORED_HEADERS, StoredResponse, storable};
use crate::run::{Ender, RunSlot};
use crate::tx::{TxError, TxSlot};

/// An operation's phases: the type whose [`step`](Self::step) runs one phase. The same value
/// (or an equal one) serves the handler ([`IdemPhases::run`]) and the completer ([`resume`]).
///
/// Keep request data out of it: what a phase needs is in the phase's state, which the
/// completer reads back from the record.
pub trait Phases<S: RecoveryStore>: Send + Sync + 'static {
    /// The recovery points: a serde enum, one variant per phase, its fields the phase's state.
    /// The variant's name is the point's name.
    type Phase: Serialize + DeserializeOwned + Send + 'static;
    /// A phase's failure: rolls back that phase's writes; the record keeps its last point.
    type Error: Into<BoxError> + Send + 'static;

    /// Runs `phase`: writes through [`PhaseCtx::tx`] (committed with the next point, or with
    /// the response), external calls with [`PhaseCtx::foreign_key`]. Returns the next phase,
    /// or the response ([`Step::Done`], [`Step::Abandon`]). The future must be `Send`: an
    /// `async fn` in the impl is, when what it holds across `.await` is.
    fn step(
        &self,
        phase: Self::Phase,
        ctx: &mut PhaseCtx<S>,
    ) -> impl Future<Output = Result<Step<Self::Phase, PhaseResponse>, Self::Error>> + Send;
}

/// One phase's run, boxed: its type names no lifetime of the driver, so every future over it
/// is provably `Send`.
type StepFuture<'a, P, E> =
    Pin<Box<dyn Future<Output = Result<Step<P, PhaseResponse>, E>> + Send + 'a>>;

/// Pins a step closure's signature (the future borrows the phase's context), which makes it
/// an `AsyncFnMut` for idem-request's driver.
fn pin_step<S, P, E, F>(f: F) -> F
where
    S: RecoveryStore,
    F: for<'a> FnMut(P, &'a mut PhaseCtx<S>) -> StepFuture<'a, P, E> + Send,
{
    f
}

/// `op` as the step function of idem-request's driver: each call runs `op.step`, boxed.
macro_rules! stepper {
    ($op:expr) => {{
        let op = Arc::new($op);
        pin_step(move |phase, ctx| {
            let op = Arc::clone(&op);
            Box::pin(async move { op.step(phase, ctx).await })
        })
    }};
}

/// The response of an operation of phases: what its last phase answers, what the layer
/// stores and replays, and what the completer stores when it finishes the operation — the
/// same status, headers and body either way.
///
/// The layer stores the handler's response: return this one as it is. The completer keeps
/// the headers of [`DEFAULT_STORED_HEADERS`] (the layer's default allow-list).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PhaseResponse {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl PhaseResponse {
    /// A response of `status` with `body` and no headers.
    pub fn new(status: StatusCode, body: impl Into<Bytes>) -> Self {
        Self {
            status,
            headers: HeaderMap::new(),
            body: body.into(),
        }
    }

    /// `value` as JSON (`Content-Type: application/json`).
    pub fn json<T: Serialize + ?Sized>(
        status: StatusCode,
        value: &T,
    ) -> Result<Self, serde_json::Error> {
        let body = serde_json::to_vec(value)?;
        Ok(Self::new(status, body).header(CONTENT_TYPE, HeaderValue::from_static(JSON)))
    }

    /// Adds a header (`Location`, `Content-Type`, …).
    pub fn header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.headers.append(name, value);
        self
    }

    /// The status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The headers.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The body.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// As an `http` response (for a framework without this crate's integration).
    pub fn into_http(self) -> Response<Bytes> {
        let mut response = Response::new(self.body);
        *response.status_mut() = self.status;
        *response.headers_mut() = self.headers;
        response
    }

    /// The record the completer stores: as the layer would store this response with its
    /// default allow-list of headers.
    pub fn to_stored(&self) -> StoredResponse {
        let mut kept = HeaderMap::new();
        for (name, value) in &self.headers {
            if storable(name, &DEFAULT_STORED_HEADERS, &self.headers) {
                kept.append(name.clone(), value.clone());
            }
        }
        StoredResponse::new(self.status, kept, Some(self.body.clone()))
    }
}

const JSON: &str = "application/json";

/// Why [`IdemPhases::run`] ended without a response: a phase failed, the lease was lost, the
/// store failed. Nothing is stored; the record keeps its last recovery point, so the client's
/// retry with the same key resumes there.
///
/// In axum it is a response (feature `axum`): `503 phase-failed` for a phase's error, `409
/// lease-lost`, `503 store-unavailable`, else `500 internal-error`
/// ([`problem`](crate::problem)); elsewhere [`to_response`](Self::to_response).
pub struct PhasesError {
    error: Error,
    config: Option<Arc<Config>>,
}

impl PhasesError {
    fn new(error: Error, config: Option<Arc<Config>>) -> Self {
        Self { error, config }
    }

    /// The cause: [`ErrorKind::Handler`] for a phase's own error (its source is yours),
    /// [`RequestErrorKind::LeaseLost`], or the store's.
    pub fn error(&self) -> &Error {
        &self.error
    }

    /// The cause, owned.
    pub fn into_error(self) -> Error {
        self.error
    }

    /// The problem response, rendered as the layer renders its own.
    pub fn to_response(&self) -> Response<Bytes> {
        let e = &self.error;
        let problem = if e.request_kind() == Some(RequestErrorKind::LeaseLost) {
            Problem::new(
                ProblemCode::LeaseLost,
                "this request ran past its lease and a retry took the key over; this execution's uncommitted phase was rolled back; retry to get the stored response",
            )
            .retry_after(1)
        } else if e.kind() == ErrorKind::Handler {
            Problem::new(
                ProblemCode::PhaseFailed,
                "a phase of this request failed and was rolled back; the phases before it stand: retry with the same key to resume after them",
            )
            .retry_after(1)
        } else if e.is_outage() || e.kind() == ErrorKind::Transient {
            let secs = self
                .config
                .as_ref()
                .map_or(1, |c| c.retry_after_secs(c.retry_after));
            Problem::new(
                ProblemCode::StoreUnavailable,
                format!("the idempotency store failed between phases; the committed phases stand: retry after {secs} s with the same key to resume after them"),
            )
            .retry_after(secs)
        } else {
            Problem::new(
                ProblemCode::InternalError,
                "the request's phases could not run; nothing was stored",
            )
        };
        let base = self
            .config
            .as_ref()
            .map_or(DEFAULT_TYPE_BASE, |c| c.problem_type_base.as_str());
        problem.render(base)
    }
}

impl fmt::Debug for PhasesError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PhasesError")
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

impl fmt::Display for PhasesError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the request's phases ended without a response: {}",
            self.error
        )
    }
}

impl std::error::Error for PhasesError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// The phases of the layer's execution, for the handler: [`run`](Self::run) them. In axum an
/// extractor (feature `axum`; `Option<IdemPhases<S>>` where the key is optional); elsewhere
/// [`take`](Self::take) it from the request's extensions.
///
/// It holds the execution only while `run` runs; the handler must not keep it (or a task
/// running it) past its response: the layer then answers `500 internal-error` and stores
/// nothing.
pub struct IdemPhases<S: RecoveryStore + Clone + 'static> {
    run: RunSlot<S>,
    tx: TxSlot<S::Tx>,
    started: StartMark,
}

impl<S: RecoveryStore + Clone + 'static> fmt::Debug for IdemPhases<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdemPhases").finish_non_exhaustive()
    }
}

impl<S> IdemPhases<S>
where
    S: RecoveryStore + Clone + 'static,
    S::Tx: 'static,
{
    /// The phases of the execution the layer left in `extensions`;
    /// [`TxError::NotIdempotent`] when the request is not an idempotent execution on store
    /// `S`.
    pub fn take(extensions: &Extensions) -> Result<Self, TxError> {
        let run = extensions
            .get::<RunSlot<S>>()
            .ok_or(TxError::NotIdempotent)?
            .clone();
        let tx = extensions
            .get::<TxSlot<S::Tx>>()
            .ok_or(TxError::NotIdempotent)?
            .clone();
        let started = extensions
            .get::<crate::IdemRequest>()
            .ok_or(TxError::NotIdempotent)?
            .started()
            .clone();
        Ok(Self { run, tx, started })
    }

    /// Whether `extensions` belong to an idempotent execution on store `S`.
    pub fn is_available(extensions: &Extensions) -> bool {
        extensions.get::<RunSlot<S>>().is_some()
    }

    /// Runs the operation's phases in the layer's execution: from the record's last recovery
    /// point, or — when it has none (a first execution) — from `first`, whose point commits
    /// before it runs. Returns the last phase's response, for the handler to return as it is:
    /// the layer stores it with the last phase's writes (whatever its status; as abandoned
    /// after [`Step::Abandon`]). A [`PhasesError`] when a phase failed (rolled back; the
    /// record keeps its last point, so the retry resumes there), the lease was lost or the
    /// store failed: the handler's answer is then sent but not stored.
    ///
    /// Marks the execution started. The handler must not hold an [`IdemTx`](crate::IdemTx)
    /// while it runs (the phases need the transaction: `500`).
    // Not an `async fn`: the `+ Send` bound is the point — checked here, for every `O`, so a
    // handler's future is `Send` without the user proving it.
    #[allow(clippy::manual_async_fn)]
    pub fn run<O>(
        self,
        first: O::Phase,
        op: O,
    ) -> impl Future<Output = Result<PhaseResponse, PhasesError>> + Send
    where
        O: Phases<S>,
    {
        async move {
            self.started.mark();
            let config = Some(Arc::clone(self.run.config()));
            let fail = |why: &str| {
                PhasesError::new(Error::new(ErrorKind::Store, why.to_owned()), config.clone())
            };
            let Some(mut execution) = self.run.lend() else {
                return Err(fail(
                    "the request's execution is not the layer's to lend (its phases ran already)",
                ));
            };
            let Some(tx) = self.tx.take() else {
                self.run.give_back(execution);
                return Err(fail(
                    "the idempotent transaction is held by an IdemTx: phases need it",
                ));
            };
            execution.put_tx(tx);
            // Phases commit at each boundary, so they need the record committed under a lease:
            // an execution the layer began in one transaction moves to the leased mode here
            // (committing what the handler wrote before, as the first boundary would).
            if let Err(e) = execution.lease_record().await {
                self.run.gone();
                return Err(PhasesError::new(e, config));
            }
            let idem = self.run.idempotency().clone();
            let store = idem.store().clone();
            let recovery = match store.recovery(execution.key(), execution.fence()).await {
                Ok(recovery) => recovery,
                Err(e) => {
                    let _ = execution.abandon().await;
                    self.run.gone();
                    return Err(PhasesError::new(e, config));
                }
            };
            let ended = idem
                .drive_phases(execution, recovery, Some(first), stepper!(op))
                .await;
            let (mut execution, finish) = match ended {
                Ok(ended) => ended,
                Err(e) => {
                    tracing::debug!(error = %e, kind = ?e.kind(), "the request's phases ended without a response; not stored, the record keeps its last point");
                    self.run.gone();
                    return Err(PhasesError::new(e, config));
                }
            };
            let (response, ender) = match finish {
                Finish::Done(response) => (response, None),
                Finish::Abandon(response) => (response, Some(abandoner::<S>())),
                _ => {
                    let _ = execution.abandon().await;
                    self.run.gone();
                    return Err(fail("the phases ended in a way this layer does not know"));
                }
            };
            if let Some(tx) = execution.take_tx() {
                self.tx.put(tx);
            }
            self.run.ended(execution, ender);
            Ok(response)
        }
    }
}

/// Stores the response as abandoned, with the last phase's writes (its compensation).
fn abandoner<S: RecoveryStore + Clone + 'static>() -> Ender<S> {
    Box::new(|execution: Execution<S>, bytes: Vec<u8>| {
        Box::pin(async move {
            execution
                .give_up(&bytes, |_: &mut S::Tx| {
                    std::future::ready(Ok::<(), Error>(()))
                })
                .await
        })
    })
}

/// Finishes an operation of phases a handler behind the layer began and left stuck (its
/// client gave up, its server died), for the [`Completer`](idem_request::Completer): resumes
/// the record [`take_stuck`](Idempotency::take_stuck) took over at its last point with the same
/// [`Phases`] the handler runs, and stores the last phase's response in the layer's format
/// ([`PhaseResponse::to_stored`]) with that phase's writes — so the client's later retry gets
/// it replayed, with `Idempotent-Replayed: true`, as if the handler had finished.
///
/// Register it as the completer's operation for the layer's records: the layer's scopes
/// are one per principal and route, so with
/// [`any_scope_operation`](idem_request::CompleterBuilder::any_scope_operation) —
/// `|idem, stuck| async move { idem_http::phases::resume(&idem, stuck, Charging).await.map(drop) }`
/// — and [`give_up`] as its give-up.
pub async fn resume<S, O>(
    idem: &Idempotency<S>,
    stuck: Stuck,
    op: O,
) -> Result<PhaseResponse, Error>
where
    S: RecoveryStore + Clone + 'static,
    O: Phases<S>,
{
    let key = stuck.key.clone();
    let (execution, recovery) = idem.resume(stuck).await?;
    let (execution, finish) = idem
        .drive_phases(execution, recovery, None, stepper!(op))
        .await?;
    match finish {
        Finish::Done(response) => {
            execution.complete(&response.to_stored().encode()).await?;
            tracing::debug!(key = %KeyDigest(&key), status = response.status().as_u16(), "a stuck request's phases finished; its response is stored");
            Ok(response)
        }
        Finish::Abandon(response) => {
            give_up(execution, &response).await?;
            Ok(response)
        }
        _ => {
            let _ = execution.abandon().await;
            Err(Error::new(
                ErrorKind::Store,
                "the phases ended in a way this layer does not know",
            ))
        }
    }
}

/// Ends a stuck record behind the layer as **abandoned**, storing `response` in the layer's
/// format: the completer's give-up after too many attempts. Every retry of the client gets
/// `response` replayed. Undo what the committed phases did first, in the execution's
/// transaction ([`Execution::tx`]): it commits with the response.
pub async fn give_up<S>(execution: Execution<S>, response: &PhaseResponse) -> Result<(), Error>
where
    S: RecoveryStore + Clone + 'static,
{
    let bytes = response.to_stored().encode();
    execution
        .give_up(&bytes, |_: &mut S::Tx| {
            std::future::ready(Ok::<(), Error>(()))
        })
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The completer's record is what the layer would store of the same response: the
    /// allow-listed headers kept, `Set-Cookie` and framing headers never, the body whole.
    #[test]
    fn the_completers_record_keeps_what_the_layer_keeps() {
        let response = PhaseResponse::json(StatusCode::CREATED, &serde_json::json!({ "id": 7 }))
            .expect("JSON")
            .header(
                http::header::LOCATION,
                HeaderValue::from_static("/charges/7"),
            )
            .header(http::header::SET_COOKIE, HeaderValue::from_static("s=1"))
            .header(http::header::CONTENT_LENGTH, HeaderValue::from_static("8"))
            .header(
                HeaderName::from_static("x-internal"),
                HeaderValue::from_static("1"),
            );
        let stored =
            StoredResponse::decode(Bytes::from(response.to_stored().encode())).expect("a record");
        assert_eq!(stored.status, StatusCode::CREATED);
        assert_eq!(stored.headers.len(), 2, "{:?}", stored.headers);
        assert_eq!(stored.headers[CONTENT_TYPE], "application/json");
        assert_eq!(stored.headers[http::header::LOCATION], "/charges/7");
        assert_eq!(stored.body.as_deref(), Some(&b"{\"id\":7}"[..]));
    }
}
