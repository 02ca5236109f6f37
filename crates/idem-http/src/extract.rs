//! The axum extractor (feature `axum`) for the execution's transaction: [`IdemTx`].
//!
//! `IdemTx<S>` fails with `500 internal-error` outside an idempotent execution; take
//! `Option<IdemTx<S>>` on routes where the key is optional, to run without it. The parsed key
//! itself is in the request's extensions: `Extension<IdempotencyKey>`.

use axum_core::extract::{FromRequestParts, OptionalFromRequestParts};
use axum_core::response::{IntoResponse, Response};
use http::request::Parts;
use idem_core::TransactionalStore;

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
