//! The extractors: the execution's transaction ([`IdemTx`]), request ([`IdemRequest`]) and
//! phases ([`IdemPhases`]),
//! read from the slot the middleware put in the request's extensions (the actix-session
//! pattern). Both are taken at once, never across an `.await`.

use std::fmt;
use std::future::{Ready, ready};
use std::ops::{Deref, DerefMut};

use actix_web::dev::Payload;
use actix_web::http::StatusCode;
use actix_web::{FromRequest, HttpMessage, HttpRequest, HttpResponse, ResponseError};
use idem_core::TransactionalStore;
use idem_core::store::RecoveryStore;
use idem_http::TxError;
use idem_http::phases::{PhaseResponse, Phases, PhasesError};
use idem_http::problem::{DEFAULT_TYPE_BASE, ProblemCode, problem_response};

use crate::convert;

/// What the middleware hands the handler: the execution's transaction, request and key, in
/// `http` 1 extensions (the exchange's), kept in actix-web's.
pub(crate) struct Attached(pub(crate) http::Extensions);

/// The transaction of an idempotent execution, for an actix-web handler: its writes commit
/// together with the stored response, or roll back with a response that is not stored. The
/// same as [`idem_http::IdemTx`] (which it dereferences through): see it for the rules per
/// store. Using it (the first dereference) marks the execution started.
///
/// Outside an idempotent execution it fails with `500 internal-error`; take
/// `Option<IdemTx<S>>` where the key is optional (actix-web's `Option` extractor gives `None`
/// on any failure, so a transaction already taken by another extractor is `None` too).
pub struct IdemTx<S: TransactionalStore>(idem_http::IdemTx<S>);

impl<S: TransactionalStore> Deref for IdemTx<S> {
    type Target = S::Tx;

    fn deref(&self) -> &S::Tx {
        &self.0
    }
}

impl<S: TransactionalStore> DerefMut for IdemTx<S> {
    fn deref_mut(&mut self) -> &mut S::Tx {
        &mut self.0
    }
}

impl<S: TransactionalStore> fmt::Debug for IdemTx<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdemTx").field(&self.0).finish()
    }
}

impl<S> IdemTx<S>
where
    S: TransactionalStore + 'static,
    S::Tx: 'static,
{
    /// Takes the transaction the middleware left in `req`'s extensions.
    pub fn take(req: &HttpRequest) -> Result<Self, TxRejection> {
        let extensions = req.extensions();
        let attached = extensions
            .get::<Attached>()
            .ok_or(TxRejection(TxError::NotIdempotent))?;
        idem_http::IdemTx::take(&attached.0)
            .map(Self)
            .map_err(TxRejection)
    }

    /// The transaction as idem-http's type.
    pub fn into_inner(self) -> idem_http::IdemTx<S> {
        self.0
    }
}

impl<S> FromRequest for IdemTx<S>
where
    S: TransactionalStore + 'static,
    S::Tx: 'static,
{
    type Error = TxRejection;
    type Future = Ready<Result<Self, TxRejection>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(Self::take(req))
    }
}

/// The idempotent request a handler is executing (its record's scope and the client's key),
/// to derive the keys of external calls from: [`idem_http::IdemRequest`], which it
/// dereferences to. Outside an idempotent execution it fails with `500 internal-error`; take
/// `Option<IdemRequest>` where the key is optional.
#[derive(Debug, Clone)]
pub struct IdemRequest(idem_http::IdemRequest);

impl Deref for IdemRequest {
    type Target = idem_http::IdemRequest;

    fn deref(&self) -> &idem_http::IdemRequest {
        &self.0
    }
}

impl IdemRequest {
    /// The request of the idempotent execution `req` belongs to, if any.
    pub fn of(req: &HttpRequest) -> Option<Self> {
        let extensions = req.extensions();
        let attached = extensions.get::<Attached>()?;
        idem_http::IdemRequest::from_extensions(&attached.0).map(Self)
    }
}

impl FromRequest for IdemRequest {
    type Error = TxRejection;
    type Future = Ready<Result<Self, TxRejection>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(Self::of(req).ok_or(TxRejection(TxError::NotIdempotent)))
    }
}

/// Why [`IdemTx`] or [`IdemRequest`] could not be extracted; answered `500 internal-error`
/// (a handler behind no middleware, or a request without a record).
#[derive(Debug)]
pub struct TxRejection(pub TxError);

impl fmt::Display for TxRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl ResponseError for TxRejection {
    fn status_code(&self) -> StatusCode {
        StatusCode::INTERNAL_SERVER_ERROR
    }

    fn error_response(&self) -> HttpResponse {
        tracing::error!(error = %self.0, "a handler asked for the idempotent transaction");
        let problem = problem_response(
            ProblemCode::InternalError,
            self.0.to_string(),
            DEFAULT_TYPE_BASE,
        );
        convert::response(problem.map(http_body_util::Full::new))
    }
}

/// The phases of the execution, for an actix-web handler: runs the request as recovery
/// points in the middleware's own execution — the same as [`idem_http::IdemPhases`] (see it,
/// and [`idem_http::phases`], for the rules): the first point commits before the first
/// phase, a retry, a takeover or the completer resumes at the last point, and the last
/// phase's writes commit with the stored response.
///
/// Taken from the slot the middleware put in the request's extensions, at once (never held
/// across an `.await`). Outside an idempotent execution it fails with `500 internal-error`.
pub struct IdemPhases<S: RecoveryStore + Clone + 'static>(idem_http::IdemPhases<S>);

impl<S: RecoveryStore + Clone + 'static> fmt::Debug for IdemPhases<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdemPhases").field(&self.0).finish()
    }
}

impl<S> IdemPhases<S>
where
    S: RecoveryStore + Clone + 'static,
    S::Tx: 'static,
{
    /// Takes the phases of the execution the middleware left in `req`'s extensions.
    pub fn take(req: &HttpRequest) -> Result<Self, TxRejection> {
        let extensions = req.extensions();
        let attached = extensions
            .get::<Attached>()
            .ok_or(TxRejection(TxError::NotIdempotent))?;
        idem_http::IdemPhases::take(&attached.0)
            .map(Self)
            .map_err(TxRejection)
    }

    /// Runs the phases ([`idem_http::IdemPhases::run`]) and answers the last phase's response
    /// as actix-web's, for the handler to return as it is (the middleware stores it with the
    /// last phase's writes); or the [`PhasesRejection`] (`503 phase-failed`, `409 lease-lost`,
    /// …), sent but not stored — the record keeps its last point.
    pub async fn run<O>(self, first: O::Phase, op: O) -> Result<HttpResponse, PhasesRejection>
    where
        O: Phases<S>,
    {
        match self.0.run(first, op).await {
            Ok(response) => Ok(phase_response(response)),
            Err(e) => Err(PhasesRejection(e)),
        }
    }

    /// The phases as idem-http's type.
    pub fn into_inner(self) -> idem_http::IdemPhases<S> {
        self.0
    }
}

impl<S> FromRequest for IdemPhases<S>
where
    S: RecoveryStore + Clone + 'static,
    S::Tx: 'static,
{
    type Error = TxRejection;
    type Future = Ready<Result<Self, TxRejection>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(Self::take(req))
    }
}

/// A [`PhaseResponse`] as actix-web's response: its status, headers and body, nothing added.
pub fn phase_response(response: PhaseResponse) -> HttpResponse {
    convert::response(response.into_http().map(http_body_util::Full::new))
}

/// Why [`IdemPhases::run`] ended without a response ([`PhasesError`]): answered with the
/// layer's problem (`503 phase-failed`, `409 lease-lost`, `503 store-unavailable`, `500`).
#[derive(Debug)]
pub struct PhasesRejection(pub PhasesError);

impl fmt::Display for PhasesRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl ResponseError for PhasesRejection {
    fn status_code(&self) -> StatusCode {
        StatusCode::from_u16(self.0.to_response().status().as_u16())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    fn error_response(&self) -> HttpResponse {
        tracing::debug!(error = %self.0, "the request's phases ended without a response");
        convert::response(self.0.to_response().map(http_body_util::Full::new))
    }
}
