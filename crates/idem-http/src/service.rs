//! [`IdempotencyService`]: the request's way through the layer.
//!
//! Cheap checks first, answered without touching the store (method, route, key, principal,
//! declared body size); then the body is buffered and fingerprinted, and the engine either
//! replays, refuses (409, 422) or hands over an execution. The execution's transaction and
//! its [`IdemRequest`] go into the request's extensions for the handler; afterwards the layer
//! takes the transaction back and completes the record in it with the stored response, or
//! abandons it (rolling back what was written through it, freeing the key) when the response
//! is not stored: the policy refuses its status (a gRPC reply's `grpc-status`), or it is a
//! client error from before the handler started.

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::FutureExt;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE, HeaderName, HeaderValue, WWW_AUTHENTICATE};
use http::request::Parts;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idem_core::store::RequestStore;
use idem_core::{BoxError, ErrorKind, IdempotencyKey, RequestKey, RequestScope};
use idem_request::{Execution, Idempotency, KeyDigest, Start};
use tower_service::Service;

use crate::body::{Read, RequestBody, ResponseBody, read_up_to};
use crate::execution::{Executed, IdemRequest, StartMark};
use crate::future::ResponseFuture;
use crate::key::parse_key_header;
use crate::layer::{Config, KeyRequirement, client_uri};
use crate::principal::MakePrincipal;
use crate::problem::{Problem, ProblemCode};
use crate::record::{NEVER_STORED, StoredResponse, storable};
use crate::tx::TxSlot;

const TRUE: HeaderValue = HeaderValue::from_static("true");

/// The middleware of [`IdempotencyLayer`](crate::IdempotencyLayer).
pub struct IdempotencyService<Inner, S, P> {
    inner: Inner,
    idem: Idempotency<S>,
    principal: P,
    config: Arc<Config>,
}

impl<Inner, S, P> IdempotencyService<Inner, S, P> {
    pub(crate) fn new(
        inner: Inner,
        idem: Idempotency<S>,
        principal: P,
        config: Arc<Config>,
    ) -> Self {
        Self {
            inner,
            idem,
            principal,
            config,
        }
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
            idem: self.idem.clone(),
            principal: self.principal.clone(),
            config: Arc::clone(&self.config),
        }
    }
}

impl<Inner: fmt::Debug, S, P: fmt::Debug> fmt::Debug for IdempotencyService<Inner, S, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .field("principal", &self.principal)
            .field("config", &self.config)
            .finish_non_exhaustive()
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
        let config = &*self.config;
        if !config.methods.contains(req.method()) {
            return ResponseFuture::passthrough(self.inner.call(req.map(RequestBody::streaming)));
        }
        let (parts, body) = req.into_parts();
        let requirement = config.requirement.of(&parts);
        let pass = |inner: &mut Inner, parts, body| {
            ResponseFuture::passthrough(
                inner.call(Request::from_parts(parts, RequestBody::streaming(body))),
            )
        };
        if requirement == KeyRequirement::Off {
            return pass(&mut self.inner, parts, body);
        }
        let key = match parse_key_header(&parts.headers, &config.key_header, config.max_key_len) {
            Ok(Some(key)) => key,
            Ok(None) if requirement == KeyRequirement::Required => {
                return self.refuse(Problem::new(
                    ProblemCode::MissingKey,
                    format!("this endpoint requires an {} header", config.key_header),
                ));
            }
            Ok(None) => return pass(&mut self.inner, parts, body),
            Err(e) => return self.refuse(Problem::new(ProblemCode::InvalidKey, e.to_string())),
        };
        let Some(principal) = self.principal.make_principal(&parts) else {
            let mut response = render(
                config,
                Problem::new(
                    ProblemCode::MissingPrincipal,
                    "the request carries an idempotency key but no credentials to scope it to",
                ),
            );
            response
                .headers_mut()
                .insert(WWW_AUTHENTICATE, config.www_authenticate.clone());
            return ResponseFuture::ready(response);
        };
        let declared = declared_len(&parts.headers).max(body.size_hint().lower());
        if declared > config.request_body_limit as u64 {
            return self.refuse(too_large(config.request_body_limit));
        }
        // The path the client sent: under `Router::nest` the request's own URI has lost its
        // prefix, and `/v1/charges` and `/v2/charges` must not share records.
        let scope = principal.scope(&parts.method, client_uri(&parts).path());
        // The instance `poll_ready` readied goes with this request; the clone stays.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let run = Run {
            inner,
            idem: self.idem.clone(),
            config: Arc::clone(&self.config),
            scope,
            key,
        };
        ResponseFuture::execute(Box::pin(run.execute(parts, body)))
    }
}

impl<Inner, S, P> IdempotencyService<Inner, S, P> {
    fn refuse<F, B, E>(&self, problem: Problem) -> ResponseFuture<F, B, E> {
        ResponseFuture::ready(render(&self.config, problem))
    }
}

fn render<B>(config: &Config, problem: Problem) -> Response<ResponseBody<B>> {
    tracing::debug!(code = problem.code.as_str(), detail = %problem.detail, "idempotency layer refused the request");
    problem
        .render(&config.problem_type_base)
        .map(|b| ResponseBody::buffered(b, None))
}

fn too_large(limit: usize) -> Problem {
    Problem::new(
        ProblemCode::BodyTooLarge,
        format!("the request body is over the limit of {limit} bytes"),
    )
}

fn declared_len(headers: &HeaderMap) -> u64 {
    headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// One idempotent request, past the cheap checks.
struct Run<Inner, S> {
    inner: Inner,
    idem: Idempotency<S>,
    config: Arc<Config>,
    scope: RequestScope,
    key: IdempotencyKey,
}

impl<Inner, S> Run<Inner, S> {
    async fn execute<ReqB, ResB>(
        mut self,
        parts: Parts,
        body: ReqB,
    ) -> Result<Response<ResponseBody<ResB>>, Inner::Error>
    where
        Inner: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
        S: RequestStore + Clone + 'static,
        S::Tx: 'static,
        ReqB: Body<Data = Bytes>,
        ReqB::Error: Into<BoxError>,
        ResB: Body<Data = Bytes>,
        ResB::Error: Into<BoxError>,
    {
        let config = Arc::clone(&self.config);
        let refuse = |problem| Ok(render(&config, problem));
        let collected = match Limited::new(body, config.request_body_limit)
            .collect()
            .await
        {
            Ok(collected) => collected,
            Err(e) if e.is::<LengthLimitError>() => {
                return refuse(too_large(config.request_body_limit));
            }
            Err(e) => {
                return refuse(Problem::new(
                    ProblemCode::InvalidBody,
                    format!("the request body could not be read: {e}"),
                ));
            }
        };
        let trailers = collected.trailers().cloned();
        let data = collected.to_bytes();
        let fingerprint = config.fingerprint(&parts, &data);
        let request = RequestKey::new(self.scope, self.key.clone());
        let mut execution = match self.idem.start(request.clone(), fingerprint).await {
            Ok(Start::Run(execution)) => execution,
            Ok(Start::Replay(stored)) => return Ok(replay(&config, stored)),
            Ok(Start::InProgress { retry_after }) => {
                let secs = config.retry_after_secs(retry_after);
                return refuse(
                    Problem::new(
                        ProblemCode::Conflict,
                        format!("a request with this idempotency key is still being processed; retry after {secs} s"),
                    )
                    .retry_after(secs),
                );
            }
            Ok(Start::Mismatch) => {
                return refuse(Problem::new(
                    ProblemCode::FingerprintMismatch,
                    if config.fingerprint.is_some() {
                        "this idempotency key was already used by this principal on this method and path for a request with another fingerprint (as this service computes it); the original request's record is unchanged"
                    } else {
                        "this idempotency key was already used by this principal on this method and path for a request with another query string, Content-Type or body; the original request's record is unchanged"
                    },
                ));
            }
            Ok(_) => {
                return refuse(Problem::new(
                    ProblemCode::InternalError,
                    "the idempotency engine answered with a state this layer does not know",
                ));
            }
            Err(e) if e.kind() == ErrorKind::InvalidKey => {
                return refuse(Problem::new(ProblemCode::InvalidKey, e.to_string()));
            }
            Err(e) => {
                // The client can only retry either way; an operator must fix a misconfiguration.
                if e.kind() == ErrorKind::Misconfigured {
                    tracing::error!(error = %e, "idempotency store misconfigured; the request was not run");
                } else {
                    tracing::warn!(error = %e, kind = ?e.kind(), "idempotency store unavailable; the request was not run");
                }
                let secs = config.retry_after_secs(config.retry_after);
                let detail = if e.kind() == ErrorKind::Transient {
                    format!(
                        "the idempotency store is busy (a lock it needs was not free in time); the request was not run, retry after {secs} s with the same key"
                    )
                } else {
                    format!(
                        "the idempotency store is unavailable; the request was not run, retry after {secs} s with the same key"
                    )
                };
                return refuse(
                    Problem::new(ProblemCode::StoreUnavailable, detail).retry_after(secs),
                );
            }
        };

        let started = StartMark::default();
        let slot = TxSlot::new(execution.take_tx(), started.clone());
        let mut req = Request::from_parts(parts, RequestBody::buffered(data, trailers));
        req.extensions_mut().insert(slot.clone());
        req.extensions_mut()
            .insert(IdemRequest::new(request.clone(), started.clone()));
        req.extensions_mut().insert(self.key.clone());
        let response = match AssertUnwindSafe(self.inner.call(req)).catch_unwind().await {
            Ok(Ok(response)) => response,
            Ok(Err(e)) => {
                abandon(execution, &slot).await;
                return Err(e);
            }
            Err(panic) => {
                abandon(execution, &slot).await;
                std::panic::resume_unwind(panic);
            }
        };

        let (mut head, body) = response.into_parts();
        // Whatever the handler did, a first execution never looks like a replay.
        head.headers.remove(&config.replay_header);
        head.headers.remove(&config.omitted_header);
        let started = head.extensions.remove::<Executed>().is_some() || started.is_marked();
        // What the policy judges: the status, or a gRPC reply's `grpc-status` — in the head of
        // a Trailers-Only reply, else in the trailers, known once the body is read.
        let grpc = is_grpc(&head.headers);
        let outcome = if grpc {
            head.headers.get(GRPC_STATUS).map(grpc_outcome)
        } else {
            Some(head.status)
        };
        if let Some(status) = outcome
            && !config.stores(status, started)
        {
            abandon(execution, &slot).await;
            return Ok(Response::from_parts(head, ResponseBody::streaming(body)));
        }
        let Some(tx) = slot.take() else {
            abandon(execution, &slot).await;
            return refuse(Problem::new(
                ProblemCode::InternalError,
                "the handler kept the idempotent transaction past its response; the response was not stored (writes through the transaction were rolled back on a SQL store)",
            ));
        };
        execution.put_tx(tx);
        // Into a `BoxError` before the next await: the body's own error need not be `Send`.
        let read = read_up_to(body, config.response_storage_limit)
            .await
            .map_err(Into::<BoxError>::into);
        let (stored_body, body, trailers) = match read {
            Ok(Read::Whole(data, trailers)) => {
                let kept = trailers.as_ref().map(storable_trailers).unwrap_or_default();
                (
                    Some(data.clone()),
                    ResponseBody::buffered(data, trailers),
                    kept,
                )
            }
            // Over the limit, a gRPC reply's trailers are not read yet: stored as omitted.
            Ok(Read::Over(prefix, rest)) => {
                (None, ResponseBody::prefixed(prefix, rest), HeaderMap::new())
            }
            Err(e) => {
                tracing::error!(error = %e, "the handler's response body failed; not stored, the key freed");
                abandon(execution, &slot).await;
                return refuse(Problem::new(
                    ProblemCode::InternalError,
                    "the response body failed while it was being stored; the response was not stored (writes through the idempotent transaction were rolled back on a SQL store)",
                ));
            }
        };
        if outcome.is_none() && stored_body.is_some() {
            // No `grpc-status` in the trailers either: not a reply that says it succeeded.
            let status = trailers
                .get(GRPC_STATUS)
                .map_or(StatusCode::INTERNAL_SERVER_ERROR, grpc_outcome);
            if !config.stores(status, started) {
                abandon(execution, &slot).await;
                return Ok(Response::from_parts(head, body));
            }
        }
        let mut kept = HeaderMap::new();
        for (name, value) in &head.headers {
            if storable(name, &config.stored_headers, &head.headers) {
                kept.append(name.clone(), value.clone());
            }
        }
        let mut record = StoredResponse::new(head.status, kept, stored_body);
        record.trailers = trailers;
        match execution.complete(&record.encode()).await {
            Ok(()) => Ok(Response::from_parts(head, body)),
            Err(e) if e.kind() == ErrorKind::LeaseLost => {
                tracing::warn!(key = %KeyDigest(&request), "lease lost to a retry while the handler ran; its response was not stored");
                refuse(
                    Problem::new(
                        ProblemCode::LeaseLost,
                        "this request ran past its lease and a retry took the key over, so this response was not stored; writes through the idempotent transaction were rolled back on a SQL store (on Redis, and for anything done outside that transaction, nothing was undone); retry to get the stored response",
                    )
                    .retry_after(1),
                )
            }
            Err(e) => {
                tracing::warn!(error = %e, kind = ?e.kind(), "completing the idempotent request failed; its response was not stored");
                let secs = config.retry_after_secs(config.retry_after);
                let what = if e.kind() == ErrorKind::Transient {
                    "the idempotency store was busy (a lock it needs was not free in time)"
                } else {
                    "the idempotency store failed"
                };
                refuse(
                    Problem::new(
                        ProblemCode::StoreUnavailable,
                        format!("{what} while storing the response, so it was not stored (writes through the idempotent transaction were rolled back on a SQL store); retry after {secs} s with the same key"),
                    )
                    .retry_after(secs),
                )
            }
        }
    }
}

const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");

/// A gRPC reply (`application/grpc`, `application/grpc+proto`, …; not gRPC-Web, whose
/// trailers are in the body).
fn is_grpc(headers: &HeaderMap) -> bool {
    headers.get(CONTENT_TYPE).is_some_and(|v| {
        let v = v.as_bytes();
        v.starts_with(b"application/grpc") && matches!(v.get(16), None | Some(b'+' | b';'))
    })
}

/// The HTTP status the policy judges a `grpc-status` as: the mapping of Google's API design
/// guide (`NOT_FOUND` 404, `UNAVAILABLE` 503, …), with `CANCELLED` as 408, not stored.
fn grpc_outcome(code: &HeaderValue) -> StatusCode {
    let status = match code.as_bytes() {
        b"0" => 200,
        b"1" => 408,
        b"3" | b"9" | b"11" => 400,
        b"4" => 504,
        b"5" => 404,
        b"6" | b"10" => 409,
        b"7" => 403,
        b"8" => 429,
        b"12" => 501,
        b"14" => 503,
        b"16" => 401,
        _ => 500,
    };
    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

/// The trailers a record keeps: all but those never stored.
fn storable_trailers(trailers: &HeaderMap) -> HeaderMap {
    let mut kept = HeaderMap::new();
    for (name, value) in trailers {
        if !NEVER_STORED.contains(name) {
            kept.append(name.clone(), value.clone());
        }
    }
    kept
}

/// Gives the transaction back to the execution (unless the handler kept it) and abandons it:
/// writes rolled back, key freed.
async fn abandon<S: RequestStore + Clone + 'static>(
    mut execution: Execution<S>,
    slot: &TxSlot<S::Tx>,
) {
    if let Some(tx) = slot.take() {
        execution.put_tx(tx);
    }
    if let Err(e) = execution.abandon().await {
        tracing::warn!(error = %e, "could not free the idempotency key yet; freeing it in the background (a retry with the key frees it first)");
    }
}

fn replay<B>(config: &Config, stored: Vec<u8>) -> Response<ResponseBody<B>> {
    match StoredResponse::decode(Bytes::from(stored)) {
        Ok(stored) => {
            let omitted = stored.body.is_none();
            let trailers = (!stored.trailers.is_empty()).then_some(stored.trailers);
            let mut response = Response::new(ResponseBody::buffered(
                stored.body.unwrap_or_default(),
                trailers,
            ));
            *response.status_mut() = stored.status;
            *response.headers_mut() = stored.headers;
            response
                .headers_mut()
                .insert(config.replay_header.clone(), TRUE);
            if omitted {
                response
                    .headers_mut()
                    .insert(config.omitted_header.clone(), TRUE);
            }
            response
        }
        Err(e) => {
            tracing::error!(error = %e, "a stored response cannot be replayed");
            render(
                config,
                Problem::new(
                    ProblemCode::InternalError,
                    format!("the stored response cannot be replayed: {e}"),
                ),
            )
        }
    }
}
