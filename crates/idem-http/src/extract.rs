//! The axum side (feature `axum`): the extractors for the execution's transaction
//! ([`IdemTx`]), its request ([`IdemRequest`]) and its phases ([`IdemPhases`]), the
//! [`Executed`] response marker, and the phases' response and error as responses.
//!
//! `IdemTx<S>` and `IdemRequest` fail with `500 internal-error` outside an idempotent
//! execution; take `Option<…>` of them on routes where the key is optional, to run without it.

use std::convert::Infallible;

use axum_core::extract::{FromRequestParts, OptionalFromRequestParts};
use axum_core::response::{IntoResponse, IntoResponseParts, Response, ResponseParts};
use http::request::Parts;
use idem_core::TransactionalStore;
use idem_core::store::RecoveryStore;

use crate::execution::{Executed, IdemRequest};
use crate::phases::{IdemPhases, PhaseResponse, PhasesError};
use crate::problem::{DEFAULT_TYPE_BASE, Problem, ProblemCode};
use crate::tx::{IdemTx, TxError};

impl IntoResponse for TxError {
    fn into_response(self) -> Response {
        tracing::error!(error = %self, "a handler asked for the idempotent transaction");
        Problem::new(ProblemCode::InternalError, self.to_string())
            .render(DEFAULT_TYPE_BASE)
            .map(axum_core::body::Body::from)
    }
}

impl<S, St> FromRequestParts<St> for IdemTx<S>
where
    S: TransactionalStore + 'static,
    S::Tx: 'static,
    St: Send + Sync,
{
    type Rejection = TxError;

    async fn from_request_parts(parts: &mut Parts, _: &St) -> Result<Self, TxError> {
        IdemTx::take(&parts.extensions)
    }
}

impl<S, St> OptionalFromRequestParts<St> for IdemTx<S>
where
    S: TransactionalStore + 'static,
    S::Tx: 'static,
    St: Send + Sync,
{
    type Rejection = TxError;

    async fn from_request_parts(parts: &mut Parts, _: &St) -> Result<Option<Self>, TxError> {
        match IdemTx::take(&parts.extensions) {
            Ok(tx) => Ok(Some(tx)),
            Err(TxError::NotIdempotent) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

impl<St: Send + Sync> FromRequestParts<St> for IdemRequest {
    type Rejection = TxError;

    async fn from_request_parts(parts: &mut Parts, _: &St) -> Result<Self, TxError> {
        IdemRequest::from_extensions(&parts.extensions).ok_or(TxError::NotIdempotent)
    }
}

impl<St: Send + Sync> OptionalFromRequestParts<St> for IdemRequest {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &St) -> Result<Option<Self>, Infallible> {
        Ok(IdemRequest::from_extensions(&parts.extensions))
    }
}

impl IntoResponseParts for Executed {
    type Error = Infallible;

    fn into_response_parts(self, mut res: ResponseParts) -> Result<ResponseParts, Infallible> {
        res.extensions_mut().insert(self);
        Ok(res)
    }
}

impl<S, St> FromRequestParts<St> for IdemPhases<S>
where
    S: RecoveryStore + Clone + 'static,
    S::Tx: 'static,
    St: Send + Sync,
{
    type Rejection = TxError;

    async fn from_request_parts(parts: &mut Parts, _: &St) -> Result<Self, TxError> {
        IdemPhases::take(&parts.extensions)
    }
}

impl<S, St> OptionalFromRequestParts<St> for IdemPhases<S>
where
    S: RecoveryStore + Clone + 'static,
    S::Tx: 'static,
    St: Send + Sync,
{
    type Rejection = TxError;

    async fn from_request_parts(parts: &mut Parts, _: &St) -> Result<Option<Self>, TxError> {
        match IdemPhases::take(&parts.extensions) {
            Ok(phases) => Ok(Some(phases)),
            Err(TxError::NotIdempotent) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// Built from its parts: no header is added (axum would add `Content-Type` to a bare body),
/// so the layer stores what the completer would.
impl IntoResponse for PhaseResponse {
    fn into_response(self) -> Response {
        self.into_http().map(axum_core::body::Body::from)
    }
}

impl IntoResponse for PhasesError {
    fn into_response(self) -> Response {
        self.to_response().map(axum_core::body::Body::from)
    }
}
