//! [`IdempotencyService`]: the tower side of the [`Exchange`](crate::exchange::Exchange).
//!
//! The exchange decides; this service hands it the request head, the body (read under the
//! limit), runs the inner service with the execution in the request's extensions, catches a
//! panic to abandon the execution, and hands the response back to be stored or not.

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::FutureExt;
use http::{Request, Response};
use http_body::Body;
use idem_core::BoxError;
use idem_core::store::RequestStore;
use tower_service::Service;

use crate::body::{RequestBody, ResponseBody};
use crate::exchange::{Begin, Decision, Exchange};
use crate::future::ResponseFuture;
use crate::principal::MakePrincipal;

/// The middleware of [`IdempotencyLayer`](crate::IdempotencyLayer).
pub struct IdempotencyService<Inner, S, P> {
    inner: Inner,
    exchange: Exchange<S, P>,
}

impl<Inner, S, P> IdempotencyService<Inner, S, P> {
    pub(crate) fn new(inner: Inner, exchange: Exchange<S, P>) -> Self {
        Self { inner, exchange }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &Inner {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut Inner {
        &mut self.inner
    }

    /// Unwraps the wrapped service.
    pub fn into_inner(self) -> Inner {
        self.inner
    }
}

impl<Inner: Clone, S, P: Clone> Clone for IdempotencyService<Inner, S, P> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            exchange: self.exchange.clone(),
        }
    }
}

impl<Inner: fmt::Debug, S, P: fmt::Debug> fmt::Debug for IdempotencyService<Inner, S, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .field("exchange", &self.exchange)
            .finish()
    }
}

impl<Inner, S, P, ReqB, ResB> Service<Request<ReqB>> for IdempotencyService<Inner, S, P>
where
    Inner: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Clone + Send + 'static,
    Inner::Future: Send + 'static,
    Inner::Error: Send + 'static,
    S: RequestStore + Clone + 'static,
    S::Tx: 'static,
    P: MakePrincipal,
    ReqB: Body<Data = Bytes> + Send + 'static,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = Inner::Error;
    type Future = ResponseFuture<Inner::Future, ResB, Inner::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let (parts, body) = req.into_parts();
        let keyed = match self.exchange.begin(&parts, body.size_hint().lower()) {
            Begin::Keyed(keyed) => keyed,
            Begin::Respond(refusal) => return ResponseFuture::ready(refusal),
            Begin::Pass => {
                let req = Request::from_parts(parts, RequestBody::streaming(body));
                return ResponseFuture::passthrough(self.inner.call(req));
            }
        };
        // The instance `poll_ready` readied goes with this request; the clone stays.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::execute(Box::pin(async move {
            let (data, trailers) = match keyed.read_body(body).await {
                Ok(read) => read,
                Err(refusal) => return Ok(refusal),
            };
            let execution = match keyed.start(&parts, &data).await {
                Decision::Execute(execution) => execution,
                Decision::Respond(answer) => return Ok(answer),
            };
            let mut req = Request::from_parts(parts, RequestBody::buffered(data, trailers));
            execution.attach(req.extensions_mut());
            match AssertUnwindSafe(inner.call(req)).catch_unwind().await {
                Ok(Ok(response)) => {
                    let (head, body) = response.into_parts();
                    Ok(execution.finish(head, body).await)
                }
                Ok(Err(e)) => {
                    execution.abandon().await;
                    Err(e)
                }
                Err(panic) => {
                    execution.abandon().await;
                    std::panic::resume_unwind(panic);
                }
            }
        }))
    }
}
