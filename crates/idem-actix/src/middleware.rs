//! [`IdempotencyMiddleware`]: the actix-web `Transform`/`Service` pair that drives idem-http's
//! [`Exchange`] — the same decisions as the tower layer, configured by the same builder.

use std::fmt;
use std::future::{Ready, ready};
use std::panic::AssertUnwindSafe;
use std::rc::Rc;
use std::sync::Arc;

use actix_web::body::{BoxBody, EitherBody, MessageBody};
use actix_web::dev::{Payload, Service, ServiceRequest, ServiceResponse, Transform, forward_ready};
use actix_web::{Error, HttpMessage, HttpRequest};
use bytes::Bytes;
use futures_util::future::LocalBoxFuture;
use futures_util::{FutureExt, StreamExt};
use http_body::Frame;
use http_body_util::StreamBody;
use idem_core::store::RequestStore;
use idem_http::exchange::{Begin, Decision, Exchange, Keyed};
use idem_http::problem::ProblemCode;
use idem_http::{Executed, IdempotencyLayer, MakePrincipal, Principal};

use crate::body::{BodyError, FromActix};
use crate::convert;
use crate::extract::Attached;

type PrincipalOf = Arc<dyn Fn(&HttpRequest) -> Option<Principal>>;

/// Makes `POST` and `PATCH` requests with an `Idempotency-Key` run once per (principal,
/// method, path, key) and replays the stored response to every retry: idem-http's
/// [`IdempotencyLayer`] configuration, as actix-web middleware (`App::wrap`,
/// `Resource::wrap`, `Scope::wrap`). See the [crate docs](crate).
pub struct IdempotencyMiddleware<S, P> {
    exchange: Exchange<S, P>,
    principal: Option<PrincipalOf>,
}

impl<S, P: Clone> Clone for IdempotencyMiddleware<S, P> {
    fn clone(&self) -> Self {
        Self {
            exchange: self.exchange.clone(),
            principal: self.principal.clone(),
        }
    }
}

impl<S, P: fmt::Debug> fmt::Debug for IdempotencyMiddleware<S, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyMiddleware")
            .field("exchange", &self.exchange)
            .field("principal_from_request", &self.principal.is_some())
            .finish()
    }
}

impl<S, P> IdempotencyMiddleware<S, P>
where
    S: RequestStore + Clone + 'static,
    P: MakePrincipal,
{
    /// The middleware of `config` (key header, methods, requirement, limits, policy, …). Its
    /// principal function sees the request head as `http::request::Parts`: method, URI and
    /// headers, but not actix-web's extensions; for a principal your authentication middleware
    /// put there, use [`principal_from_request`](Self::principal_from_request).
    pub fn new(config: IdempotencyLayer<S, P>) -> Self {
        Self {
            exchange: config.exchange(),
            principal: None,
        }
    }

    /// Finds the principal in the actix-web request instead (typically an extension your
    /// authentication middleware inserted); `None` answers `401 missing-principal`.
    pub fn principal_from_request<F, T>(mut self, principal: F) -> Self
    where
        F: Fn(&HttpRequest) -> Option<T> + 'static,
        T: AsRef<[u8]>,
    {
        self.principal = Some(Arc::new(move |req: &HttpRequest| {
            principal(req).map(Principal::new)
        }));
        self
    }
}

impl<Svc, B, S, P> Transform<Svc, ServiceRequest> for IdempotencyMiddleware<S, P>
where
    Svc: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
    S: RequestStore + Clone + 'static,
    P: MakePrincipal,
{
    type Response = ServiceResponse<EitherBody<B>>;
    type Error = Error;
    type Transform = IdempotencyService<Svc, S, P>;
    type InitError = ();
    type Future = Ready<Result<Self::Transform, ()>>;

    fn new_transform(&self, service: Svc) -> Self::Future {
        ready(Ok(IdempotencyService {
            service: Rc::new(service),
            exchange: self.exchange.clone(),
            principal: self.principal.clone(),
        }))
    }
}

/// The service [`IdempotencyMiddleware`] wraps around each actix-web service.
pub struct IdempotencyService<Svc, S, P> {
    service: Rc<Svc>,
    exchange: Exchange<S, P>,
    principal: Option<PrincipalOf>,
}

impl<Svc, S, P: fmt::Debug> fmt::Debug for IdempotencyService<Svc, S, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("exchange", &self.exchange)
            .finish_non_exhaustive()
    }
}

impl<Svc, B, S, P> Service<ServiceRequest> for IdempotencyService<Svc, S, P>
where
    Svc: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
    S: RequestStore + Clone + 'static,
    P: MakePrincipal,
{
    type Response = ServiceResponse<EitherBody<B>>;
    type Error = Error;
    type Future = LocalBoxFuture<'static, Result<Self::Response, Error>>;

    forward_ready!(service);

    fn call(&self, req: ServiceRequest) -> Self::Future {
        let Some(parts) = convert::request_parts(&req) else {
            let problem = self.exchange.problem(
                ProblemCode::InternalError,
                "the request head could not be read for the idempotency check",
            );
            return answer(req, problem);
        };
        let begin = match &self.principal {
            Some(principal) => {
                self.exchange
                    .begin_with_principal(&parts, 0, principal(req.request()))
            }
            None => self.exchange.begin(&parts, 0),
        };
        match begin {
            Begin::Keyed(keyed) => Box::pin(execute(Rc::clone(&self.service), keyed, parts, req)),
            Begin::Respond(refusal) => answer(req, refusal),
            Begin::Pass => {
                let future = self.service.call(req);
                Box::pin(async move { Ok(future.await?.map_into_left_body()) })
            }
            _ => {
                let problem = self.exchange.problem(
                    ProblemCode::InternalError,
                    "the idempotency exchange answered with a step this middleware does not know",
                );
                answer(req, problem)
            }
        }
    }
}

type Answer<B> = http::Response<idem_http::ResponseBody<FromActix<B>>>;

/// Sends the exchange's own response; the handler does not run.
fn answer<B: MessageBody + 'static>(
    req: ServiceRequest,
    response: Answer<B>,
) -> LocalBoxFuture<'static, Result<ServiceResponse<EitherBody<B>>, Error>> {
    let response = req.into_response(convert::response(response));
    Box::pin(ready(Ok(response.map_into_right_body())))
}

fn right<B>(req: HttpRequest, response: Answer<B>) -> ServiceResponse<EitherBody<B>>
where
    B: MessageBody + 'static,
{
    let response: ServiceResponse<BoxBody> = ServiceResponse::new(req, convert::response(response));
    response.map_into_right_body()
}

/// One idempotent request past the cheap checks: the body read under the limit and put back
/// for the handler's extractors, the engine asked, the handler run with the execution in the
/// request's extensions, its response handed back to the exchange.
async fn execute<Svc, B, S>(
    service: Rc<Svc>,
    keyed: Keyed<S>,
    parts: http::request::Parts,
    mut req: ServiceRequest,
) -> Result<ServiceResponse<EitherBody<B>>, Error>
where
    Svc: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
    S: RequestStore + Clone + 'static,
{
    let payload = req.take_payload();
    let body = StreamBody::new(payload.map(|chunk| {
        chunk
            .map(Frame::data)
            .map_err(|e| BodyError::from(e.to_string()))
    }));
    let (data, _trailers) = match keyed.read_body(body).await {
        Ok(read) => read,
        Err(refusal) => return Ok(right(req.request().clone(), refusal)),
    };
    let execution = match keyed.start(&parts, &data).await {
        Decision::Execute(execution) => execution,
        Decision::Respond(response) => return Ok(right(req.request().clone(), response)),
        _ => {
            tracing::error!(
                "the idempotency exchange decided something this middleware does not know"
            );
            let response =
                req.into_response(actix_web::HttpResponse::InternalServerError().finish());
            return Ok(response.map_into_right_body());
        }
    };
    req.set_payload(Payload::from(Bytes::clone(&data)));
    let mut attached = http::Extensions::new();
    execution.attach(&mut attached);
    req.extensions_mut().insert(Attached(attached));
    let response = match AssertUnwindSafe(service.call(req)).catch_unwind().await {
        Ok(Ok(response)) => response,
        Ok(Err(e)) => {
            execution.abandon().await;
            return Err(e);
        }
        Err(panic) => {
            execution.abandon().await;
            std::panic::resume_unwind(panic);
        }
    };
    let (req, response) = response.into_parts();
    let Some(mut head) = convert::response_parts(&response) else {
        execution.abandon().await;
        return Ok(ServiceResponse::new(req, response).map_into_left_body());
    };
    if response.extensions().contains::<Executed>() {
        head.extensions.insert(Executed);
    }
    let sent = execution
        .finish(head, FromActix::new(response.into_body()))
        .await;
    Ok(right(req, sent))
}
