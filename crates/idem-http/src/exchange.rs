//! [`Exchange`]: everything the layer decides, over `http` types and without a framework —
//! key, scope, fingerprint, start / replay / conflict / mismatch, the storage policy, the
//! stored response and the problem bodies. The tower [`IdempotencyService`](crate::IdempotencyService)
//! drives it, and so does any other framework (`idem-actix` for actix-web): the framework
//! reads the body, runs its handler and converts its own types; the exchange decides.
//!
//! One request goes through it in four steps:
//!
//! 1. [`Exchange::begin`] with the request head: [`Begin::Pass`] (not an idempotent request:
//!    run the handler as if the exchange were not there), [`Begin::Respond`] (a refusal: the
//!    handler does not run) or [`Begin::Keyed`];
//! 2. [`Keyed::read_body`] reads the body under the request body limit (a framework with its
//!    own body type may read it itself, up to [`Keyed::body_limit`]);
//! 3. [`Keyed::start`] fingerprints the request and asks the engine: [`Decision::Respond`]
//!    (a replay, `409 conflict`, `422 fingerprint-mismatch`, `503`) or [`Decision::Execute`];
//! 4. the framework puts the execution in the request ([`Execution::attach`]: the transaction
//!    for [`IdemTx`](crate::IdemTx), the execution for [`IdemPhases`](crate::IdemPhases), the
//!    [`IdemRequest`]), runs its handler, and hands the
//!    response's head and body to [`Execution::finish`], which stores it (or not) and returns
//!    what goes to the client; a handler that failed or panicked gets
//!    [`Execution::abandon`] instead.
//!
//! ```
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::{BodyExt, Full};
//! use idem_http::exchange::{Begin, Decision};
//! use idem_http::{IdempotencyLayer, ResponseBody};
//! use idem_request::Idempotency;
//! use idem_sql::{SqliteOptions, SqliteStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), idem_core::BoxError> {
//! # let dir = tempfile::tempdir()?;
//! let store = SqliteStore::open(dir.path().join("x.db"), SqliteOptions::default()).await?;
//! idem_core::Migrate::migrate(&store).await?;
//! let exchange = IdempotencyLayer::shared_scope(Idempotency::builder(store).build()?)
//!     .require_key()
//!     .exchange();
//!
//! // Reads a response whole (a framework converts it to its own type instead).
//! async fn collect<B>(response: Response<B>) -> Response<Bytes>
//! where
//!     B: http_body::Body<Data = Bytes>,
//!     B::Error: std::fmt::Debug,
//! {
//!     let (head, body) = response.into_parts();
//!     Response::from_parts(head, body.collect().await.expect("a body").to_bytes())
//! }
//!
//! // A framework's request, as `http` parts and a body; its handler answers `charged`.
//! let handle = async |req: Request<Full<Bytes>>| -> Response<Bytes> {
//!     let (parts, body) = req.into_parts();
//!     let keyed = match exchange.begin::<Full<Bytes>>(&parts, 0) {
//!         Begin::Keyed(keyed) => keyed,
//!         Begin::Respond(refusal) => return collect(refusal).await,
//!         _ => return Response::new(Bytes::from("ran without a record")),
//!     };
//!     let (data, _trailers) = match keyed.read_body(body).await {
//!         Ok(read) => read,
//!         Err(refusal) => return collect::<ResponseBody<Full<Bytes>>>(refusal).await,
//!     };
//!     let execution = match keyed.start::<Full<Bytes>>(&parts, &data).await {
//!         Decision::Execute(execution) => execution,
//!         Decision::Respond(answer) => return collect(answer).await,
//!         _ => unreachable!("a decision this framework does not know"),
//!     };
//!     // The handler would find the transaction in these extensions.
//!     let mut extensions = http::Extensions::new();
//!     execution.attach(&mut extensions);
//!     let (head, body) = Response::new(Full::from("charged")).into_parts();
//!     collect(execution.finish(head, body).await).await
//! };
//! let post = || Request::post("/jobs").header("idempotency-key", "job-1").body(Full::from("{}"));
//! let first = handle(post()?).await;
//! let retry = handle(post()?).await;
//! assert!(first.headers().get("idempotent-replayed").is_none());
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! assert_eq!(retry.into_body(), "charged");
//! # Ok(()) }
//! ```

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE, HeaderName, HeaderValue, WWW_AUTHENTICATE};
use http::request::Parts;
use http::{Extensions, HeaderMap, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idem_core::store::RequestStore;
use idem_core::{
    BoxError, ErrorKind, IdempotencyKey, RequestAction, RequestErrorKind, RequestKey, RequestScope,
};
use idem_request::{Idempotency, KeyDigest, Start};

use crate::body::{Read, ResponseBody, read_up_to};
use crate::execution::{Executed, IdemRequest, StartMark};
use crate::key::parse_key_header;
use crate::layer::{Config, KeyRequirement, client_uri};
use crate::principal::{MakePrincipal, Principal};
use crate::problem::{Problem, ProblemCode};
use crate::record::{NEVER_STORED, StoredResponse, storable};
use crate::run::{RunSlot, RunState};
use crate::tx::TxSlot;

const TRUE: HeaderValue = HeaderValue::from_static("true");

/// The framework-free decision of an [`IdempotencyLayer`](crate::IdempotencyLayer)'s
/// configuration: see the [module docs](self). Cheap to clone; made with
/// [`IdempotencyLayer::exchange`](crate::IdempotencyLayer::exchange).
pub struct Exchange<S, P> {
    idem: Idempotency<S>,
    principal: P,
    config: Arc<Config>,
}

impl<S, P: Clone> Clone for Exchange<S, P> {
    fn clone(&self) -> Self {
        Self {
            idem: self.idem.clone(),
            principal: self.principal.clone(),
            config: Arc::clone(&self.config),
        }
    }
}

impl<S, P: fmt::Debug> fmt::Debug for Exchange<S, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Exchange")
            .field("principal", &self.principal)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// What [`Exchange::begin`] makes of a request head.
#[derive(Debug)]
#[non_exhaustive]
pub enum Begin<S, B> {
    /// Not an idempotent request (a method or route the exchange leaves alone, an optional key
    /// not sent): run the handler as if the exchange were not there.
    Pass,
    /// A refusal (`400`, `401`, `413`): send it; the handler does not run.
    Respond(Response<ResponseBody<B>>),
    /// An idempotent request: read its body and [`start`](Keyed::start) it.
    Keyed(Keyed<S>),
}

/// What [`Keyed::start`] decided.
#[derive(Debug)]
#[non_exhaustive]
pub enum Decision<S: RequestStore + Clone + 'static, B> {
    /// A replay of the stored response, or a refusal (`409`, `422`, `503`): send it; the
    /// handler does not run.
    Respond(Response<ResponseBody<B>>),
    /// The first execution (or a takeover): run the handler with it.
    Execute(Execution<S>),
}

impl<S, P> Exchange<S, P> {
    pub(crate) fn new(idem: Idempotency<S>, principal: P, config: Arc<Config>) -> Self {
        Self {
            idem,
            principal,
            config,
        }
    }

    /// The engine.
    pub fn idempotency(&self) -> &Idempotency<S> {
        &self.idem
    }

    /// A problem response of `code`, rendered as the exchange renders its own (its `type`
    /// under the configured [`problem_type_base`](crate::IdempotencyLayer::problem_type_base)).
    pub fn problem<B>(
        &self,
        code: ProblemCode,
        detail: impl Into<String>,
    ) -> Response<ResponseBody<B>> {
        render(&self.config, Problem::new(code, detail))
    }

    /// Renders a problem the exchange answers with.
    fn refuse<B>(&self, problem: Problem) -> Response<ResponseBody<B>> {
        render(&self.config, problem)
    }
}

impl<S, P> Exchange<S, P>
where
    S: RequestStore + Clone + 'static,
    P: MakePrincipal,
{
    /// The cheap checks on the request head, answered without touching the store: method,
    /// route, key, principal (from the configured [`MakePrincipal`]) and declared body size
    /// (`Content-Length`, or `body_size_hint`: the least the body is known to hold).
    pub fn begin<B>(&self, parts: &Parts, body_size_hint: u64) -> Begin<S, B> {
        self.begin_inner(parts, body_size_hint, |parts| {
            self.principal.make_principal(parts)
        })
    }

    /// [`begin`](Self::begin) with a principal the framework found itself (in its own request
    /// extensions, say): the configured [`MakePrincipal`] is not asked.
    pub fn begin_with_principal<B>(
        &self,
        parts: &Parts,
        body_size_hint: u64,
        principal: Option<Principal>,
    ) -> Begin<S, B> {
        self.begin_inner(parts, body_size_hint, |_| principal)
    }

    fn begin_inner<B>(
        &self,
        parts: &Parts,
        body_size_hint: u64,
        principal: impl FnOnce(&Parts) -> Option<Principal>,
    ) -> Begin<S, B> {
        let config = &*self.config;
        if !config.methods.contains(&parts.method) {
            return Begin::Pass;
        }
        let requirement = config.requirement.of(parts);
        if requirement == KeyRequirement::Off {
            return Begin::Pass;
        }
        let key = match parse_key_header(&parts.headers, &config.key_header, config.max_key_len) {
            Ok(Some(key)) => key,
            Ok(None) if requirement == KeyRequirement::Required => {
                return Begin::Respond(self.refuse(Problem::new(
                    ProblemCode::MissingKey,
                    format!("this endpoint requires an {} header", config.key_header),
                )));
            }
            Ok(None) => return Begin::Pass,
            Err(e) => {
                return Begin::Respond(
                    self.refuse(Problem::new(ProblemCode::InvalidKey, e.to_string())),
                );
            }
        };
        let Some(principal) = principal(parts) else {
            let mut response = self.refuse(Problem::new(
                ProblemCode::MissingPrincipal,
                "the request carries an idempotency key but no credentials to scope it to",
            ));
            response
                .headers_mut()
                .insert(WWW_AUTHENTICATE, config.www_authenticate.clone());
            return Begin::Respond(response);
        };
        let declared = declared_len(&parts.headers).max(body_size_hint);
        if declared > config.request_body_limit as u64 {
            return Begin::Respond(self.refuse(too_large(config.request_body_limit)));
        }
        // The path the client sent: under `Router::nest` the request's own URI has lost its
        // prefix, and `/v1/charges` and `/v2/charges` must not share records.
        let scope = principal.scope(&parts.method, client_uri(parts).path());
        Begin::Keyed(Keyed {
            idem: self.idem.clone(),
            config: Arc::clone(&self.config),
            scope,
            key,
        })
    }
}

/// An idempotent request past the cheap checks, before its body is read.
pub struct Keyed<S> {
    idem: Idempotency<S>,
    config: Arc<Config>,
    scope: RequestScope,
    key: IdempotencyKey,
}

impl<S> fmt::Debug for Keyed<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Keyed")
            .field(
                "key",
                &KeyDigest(&RequestKey::new(self.scope, self.key.clone())),
            )
            .finish_non_exhaustive()
    }
}

impl<S: RequestStore + Clone + 'static> Keyed<S> {
    /// The most body bytes the request may have: a framework that reads the body itself
    /// answers a longer one with [`too_large`](Self::too_large).
    pub fn body_limit(&self) -> usize {
        self.config.request_body_limit
    }

    /// `413 body-too-large`, for a framework that read the body itself.
    pub fn too_large<B>(&self) -> Response<ResponseBody<B>> {
        render(&self.config, too_large(self.config.request_body_limit))
    }

    /// `400 invalid-body`, for a framework that read the body itself and could not finish.
    pub fn unreadable<B>(&self, error: &dyn fmt::Display) -> Response<ResponseBody<B>> {
        render(
            &self.config,
            Problem::new(
                ProblemCode::InvalidBody,
                format!("the request body could not be read: {error}"),
            ),
        )
    }

    /// Reads `body` whole, under the limit: its bytes and trailers, or the refusal to send
    /// (`413 body-too-large`, `400 invalid-body`).
    pub async fn read_body<ReqB, B>(
        &self,
        body: ReqB,
    ) -> Result<(Bytes, Option<HeaderMap>), Response<ResponseBody<B>>>
    where
        ReqB: Body<Data = Bytes>,
        ReqB::Error: Into<BoxError>,
    {
        match Limited::new(body, self.config.request_body_limit)
            .collect()
            .await
        {
            Ok(collected) => {
                let trailers = collected.trailers().cloned();
                Ok((collected.to_bytes(), trailers))
            }
            Err(e) if e.is::<LengthLimitError>() => Err(self.too_large()),
            Err(e) => Err(self.unreadable(&e)),
        }
    }

    /// Fingerprints the request (its head and whole body) and asks the engine.
    pub async fn start<B>(self, parts: &Parts, body: &Bytes) -> Decision<S, B> {
        let config = self.config;
        let refuse = |problem| Decision::Respond(render(&config, problem));
        let fingerprint = config.fingerprint(parts, body);
        let request = RequestKey::new(self.scope, self.key.clone());
        let mut execution = match self.idem.start(request.clone(), fingerprint).await {
            Ok(Start::Run(execution)) => execution,
            Ok(Start::Replay(stored)) => return Decision::Respond(replay(&config, stored)),
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
            Err(e) => return refuse(start_failed(&config, &e)),
        };
        let started = StartMark::default();
        let slot = TxSlot::new(execution.take_tx(), started.clone());
        Decision::Execute(Execution {
            run: RunSlot::new(execution, self.idem, Arc::clone(&config)),
            slot,
            request,
            key: self.key,
            started,
            config,
        })
    }
}

/// The problem for an engine that could not start a request: what the client should do is
/// the request API's one answer ([`RequestAction`]).
fn start_failed(config: &Config, e: &idem_core::Error) -> Problem {
    let secs = config.retry_after_secs(config.retry_after);
    match RequestAction::of(e) {
        _ if e.request_kind() == Some(RequestErrorKind::InvalidKey) => {
            Problem::new(ProblemCode::InvalidKey, e.to_string())
        }
        RequestAction::Wait(hint) => {
            let secs = config.retry_after_secs(hint.unwrap_or(config.retry_after));
            Problem::new(
                ProblemCode::Conflict,
                format!("a request with this idempotency key is still being processed; retry after {secs} s"),
            )
            .retry_after(secs)
        }
        action => {
            // The client can only retry either way; an operator must fix a misconfiguration.
            if action == RequestAction::GiveUp {
                tracing::error!(error = %e, "idempotency store misconfigured; the request was not run");
            } else {
                tracing::warn!(error = %e, kind = ?e.kind(), "idempotency store unavailable; the request was not run");
            }
            let detail = if e.kind() == ErrorKind::Transient {
                format!(
                    "the idempotency store is busy (a lock it needs was not free in time); the request was not run, retry after {secs} s with the same key"
                )
            } else {
                format!(
                    "the idempotency store is unavailable; the request was not run, retry after {secs} s with the same key"
                )
            };
            Problem::new(ProblemCode::StoreUnavailable, detail).retry_after(secs)
        }
    }
}

/// One execution the handler runs: its transaction, its [`IdemRequest`], and what
/// [`finish`](Self::finish) needs to store the response.
pub struct Execution<S: RequestStore + Clone + 'static> {
    /// The engine's execution; the handler's phases borrow it ([`IdemPhases`](crate::IdemPhases)).
    run: RunSlot<S>,
    slot: TxSlot<S::Tx>,
    request: RequestKey,
    key: IdempotencyKey,
    started: StartMark,
    config: Arc<Config>,
}

impl<S: RequestStore + Clone + 'static> fmt::Debug for Execution<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Execution")
            .field("key", &KeyDigest(&self.request))
            .field("started", &self.started.is_marked())
            .finish_non_exhaustive()
    }
}

impl<S: RequestStore + Clone + 'static> Execution<S> {
    /// Puts what the handler takes into `extensions`: the transaction (for
    /// [`IdemTx::take`](crate::IdemTx::take)), the [`IdemRequest`] and the client's
    /// [`IdempotencyKey`].
    pub fn attach(&self, extensions: &mut Extensions) {
        extensions.insert(self.slot.clone());
        extensions.insert(self.run.clone());
        extensions.insert(IdemRequest::new(self.request.clone(), self.started.clone()));
        extensions.insert(self.key.clone());
    }

    /// The handler failed without a response, or panicked: its writes through the
    /// transaction roll back and the key is freed (a record whose phases committed a
    /// recovery point keeps it; only its lease ends).
    pub async fn abandon(self) {
        let Self { run, slot, .. } = self;
        match run.take_back() {
            RunState::Held(execution) | RunState::Ended(execution, _) => {
                abandon(execution, &slot).await;
            }
            // The phases' driver ended it, or the handler still holds it (its drop frees it).
            RunState::Gone | RunState::Lent => {}
        }
    }

    /// Judges the handler's response (status or `grpc-status`, whether the handler started,
    /// see [`execution`](crate::execution)), stores it with the record when the policy says
    /// so — the transaction commits with it — or abandons the execution, and returns what the
    /// client gets: the response itself (its body streamed through or buffered), or a problem
    /// when storing failed. An [`Executed`] marker in `head`'s extensions counts as a start.
    pub async fn finish<B>(
        self,
        mut head: http::response::Parts,
        body: B,
    ) -> Response<ResponseBody<B>>
    where
        B: Body<Data = Bytes>,
        B::Error: Into<BoxError>,
    {
        let Self {
            run,
            slot,
            request,
            started,
            config,
            ..
        } = self;
        let refuse = |problem| render(&config, problem);
        // Whatever the handler did, a first execution never looks like a replay.
        head.headers.remove(&config.replay_header);
        head.headers.remove(&config.omitted_header);
        let started = head.extensions.remove::<Executed>().is_some() || started.is_marked();
        // After phases ended the operation, its response is stored whatever its status: the
        // last phase's writes commit with it, as the completer would store it.
        let (mut run, ender, ended) = match run.take_back() {
            RunState::Held(execution) => (execution, None, false),
            RunState::Ended(execution, ender) => (execution, ender, true),
            RunState::Gone => {
                // A phase failed (or the lease was lost): the driver ended the execution and
                // the record keeps its last point; the handler's answer is not stored.
                return Response::from_parts(head, ResponseBody::streaming(body));
            }
            RunState::Lent => {
                return refuse(Problem::new(
                    ProblemCode::InternalError,
                    "the handler kept the request's phases running past its response; the response was not stored (the uncommitted phase rolls back; committed phases stand)",
                ));
            }
        };
        // What the policy judges: the status, or a gRPC reply's `grpc-status` — in the head of
        // a Trailers-Only reply, else in the trailers, known once the body is read.
        let grpc = is_grpc(&head.headers);
        let outcome = if grpc {
            head.headers.get(GRPC_STATUS).map(grpc_outcome)
        } else {
            Some(head.status)
        };
        if let Some(status) = outcome
            && !ended
            && !config.stores(status, started)
        {
            abandon(run, &slot).await;
            return Response::from_parts(head, ResponseBody::streaming(body));
        }
        let Some(tx) = slot.take() else {
            abandon(run, &slot).await;
            return refuse(Problem::new(
                ProblemCode::InternalError,
                "the handler kept the idempotent transaction past its response; the response was not stored (writes through the transaction were rolled back on a SQL store)",
            ));
        };
        run.put_tx(tx);
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
                abandon(run, &slot).await;
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
            if !ended && !config.stores(status, started) {
                abandon(run, &slot).await;
                return Response::from_parts(head, body);
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
        let stored = match ender {
            None => run.complete(&record.encode()).await,
            Some(give_up) => give_up(run, record.encode()).await,
        };
        match stored {
            Ok(()) => Response::from_parts(head, body),
            Err(e) if e.request_kind() == Some(RequestErrorKind::LeaseLost) => {
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
                let kind = e.kind();
                tracing::warn!(error = %e, ?kind, "completing the idempotent request failed; its response was not stored");
                let secs = config.retry_after_secs(config.retry_after);
                let what = if kind == ErrorKind::Transient {
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

pub(crate) fn render<B>(config: &Config, problem: Problem) -> Response<ResponseBody<B>> {
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
    mut execution: idem_request::Execution<S>,
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
