//! [`IdempotencyLayer`]: the configuration, set with typed builder methods; it holds nothing
//! but configuration and the engine handle, and makes one [`IdempotencyService`] per wrapped
//! service.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Method, StatusCode, Uri};
use idem_core::store::RequestStore;
use idem_core::{Fingerprint, MAX_IDEMPOTENCY_KEY_LEN};
use idem_request::Idempotency;
use tower_layer::Layer;

use crate::exchange::Exchange;
use crate::key::IDEMPOTENCY_KEY;
use crate::policy::StorePolicy;
use crate::principal::{MakePrincipal, PrincipalFn, SharedScope};
use crate::problem::DEFAULT_TYPE_BASE;
use crate::record::DEFAULT_STORED_HEADERS;
use crate::service::IdempotencyService;

/// The replay marker's default name, Stripe's: `Idempotent-Replayed: true`.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The default name of the header a replay carries when the stored body was omitted (it was
/// over the storage limit): `Idempotent-Body-Omitted: true`.
pub const IDEMPOTENT_BODY_OMITTED: HeaderName = HeaderName::from_static("idempotent-body-omitted");

/// The default request body limit, and the default response storage limit: 1 MiB.
pub const DEFAULT_BODY_LIMIT: usize = 1024 * 1024;

/// Whether a route takes an `Idempotency-Key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyRequirement {
    /// No key: `400 missing-key`, and the handler does not run.
    Required,
    /// No key: the request runs as if the layer were not there (the default, Stripe's rule).
    #[default]
    Optional,
    /// The layer ignores the route, key or not.
    Off,
}

type RequirementFn = Arc<dyn Fn(&Parts) -> KeyRequirement + Send + Sync>;
type FingerprintFn = Arc<dyn Fn(&Parts, &Bytes) -> Fingerprint + Send + Sync>;

#[derive(Clone)]
pub(crate) enum Requirement {
    Fixed(KeyRequirement),
    By(RequirementFn),
}

impl Requirement {
    pub(crate) fn of(&self, parts: &Parts) -> KeyRequirement {
        match self {
            Requirement::Fixed(r) => *r,
            Requirement::By(f) => f(parts),
        }
    }
}

/// Everything the service needs besides the engine and the principal function; shared by
/// every clone of the service.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) key_header: HeaderName,
    pub(crate) replay_header: HeaderName,
    pub(crate) omitted_header: HeaderName,
    pub(crate) methods: Vec<Method>,
    pub(crate) requirement: Requirement,
    pub(crate) max_key_len: usize,
    pub(crate) request_body_limit: usize,
    pub(crate) response_storage_limit: usize,
    pub(crate) fingerprint: Option<FingerprintFn>,
    pub(crate) policy: StorePolicy,
    pub(crate) stored_headers: Vec<HeaderName>,
    pub(crate) problem_type_base: String,
    pub(crate) retry_after: Duration,
    pub(crate) www_authenticate: HeaderValue,
    pub(crate) client_errors_before_start: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            key_header: IDEMPOTENCY_KEY,
            replay_header: IDEMPOTENT_REPLAYED,
            omitted_header: IDEMPOTENT_BODY_OMITTED,
            methods: vec![Method::POST, Method::PATCH],
            requirement: Requirement::Fixed(KeyRequirement::Optional),
            max_key_len: MAX_IDEMPOTENCY_KEY_LEN,
            request_body_limit: DEFAULT_BODY_LIMIT,
            response_storage_limit: DEFAULT_BODY_LIMIT,
            fingerprint: None,
            policy: StorePolicy::default(),
            stored_headers: DEFAULT_STORED_HEADERS.to_vec(),
            problem_type_base: DEFAULT_TYPE_BASE.to_owned(),
            retry_after: DEFAULT_RETRY_AFTER,
            www_authenticate: HeaderValue::from_static("Bearer"),
            client_errors_before_start: false,
        }
    }
}

/// The default [`retry_after`](IdempotencyLayer::retry_after) hint: 1 s.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

impl Config {
    /// The default fingerprint: method, path with query, `Content-Type` and the body.
    pub(crate) fn fingerprint(&self, parts: &Parts, body: &Bytes) -> Fingerprint {
        match &self.fingerprint {
            Some(f) => f(parts, body),
            None => default_fingerprint(parts, body),
        }
    }

    /// Whether a response judged as `status` is stored: the policy says so, and a client error
    /// also needs the handler to have started (see [`crate::execution`]).
    pub(crate) fn stores(&self, status: StatusCode, started: bool) -> bool {
        self.policy.stores(status)
            && (started || self.client_errors_before_start || !status.is_client_error())
    }

    /// `Retry-After` for a key in flight: the hint, but never past the holder's lease.
    pub(crate) fn retry_after_secs(&self, lease_left: Duration) -> u64 {
        let whole = |d: Duration| (d.as_secs() + u64::from(d.subsec_nanos() > 0)).max(1);
        whole(self.retry_after).min(whole(lease_left))
    }
}

/// The URI the client sent: axum's `OriginalUri` where a router put it in the extensions (a
/// nested router strips its prefix from the request's own URI), else the request's URI.
pub(crate) fn client_uri(parts: &Parts) -> &Uri {
    #[cfg(feature = "axum")]
    if let Some(axum::extract::OriginalUri(uri)) = parts.extensions.get() {
        return uri;
    }
    &parts.uri
}

/// The default request fingerprint: SHA-256 over the method, the path with its query (as the
/// client sent it: axum's `OriginalUri` under `Router::nest`), the `Content-Type` and the body
/// (each length-prefixed).
///
/// `Content-Type` is in it because the same bytes are another request in another media type:
/// a client that sent `text/plain` by mistake and corrects it to `application/json` must not
/// be answered with the record of the first.
pub fn default_fingerprint(parts: &Parts, body: &[u8]) -> Fingerprint {
    let uri = client_uri(parts);
    let target = uri.path_and_query().map_or(uri.path(), |pq| pq.as_str());
    let content_type = parts
        .headers
        .get(CONTENT_TYPE)
        .map_or(&b""[..], |v| v.as_bytes());
    Fingerprint::hasher()
        .field(b"idem-http/2")
        .field(parts.method.as_str())
        .field(target)
        .field(content_type)
        .field(body)
        .finish()
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let requirement = match &self.requirement {
            Requirement::Fixed(r) => format!("{r:?}"),
            Requirement::By(_) => "by route".to_owned(),
        };
        f.debug_struct("Config")
            .field("key_header", &self.key_header)
            .field("replay_header", &self.replay_header)
            .field("omitted_header", &self.omitted_header)
            .field("methods", &self.methods)
            .field("requirement", &requirement)
            .field("max_key_len", &self.max_key_len)
            .field("request_body_limit", &self.request_body_limit)
            .field("response_storage_limit", &self.response_storage_limit)
            .field("custom_fingerprint", &self.fingerprint.is_some())
            .field("policy", &self.policy)
            .field("stored_headers", &self.stored_headers)
            .field("problem_type_base", &self.problem_type_base)
            .field("retry_after", &self.retry_after)
            .field("www_authenticate", &self.www_authenticate)
            .field(
                "client_errors_before_start",
                &self.client_errors_before_start,
            )
            .finish()
    }
}

/// Makes `POST` and `PATCH` requests with an `Idempotency-Key` run once per (principal,
/// method, path, key) and replays the stored response to every retry.
///
/// The path is the one the client sent (axum's `OriginalUri` under `Router::nest`), so
/// `/v1/charges` and `/v2/charges` never share records.
///
/// Built on an [`Idempotency`] engine (its store, TTL, lease and heartbeat), with an explicit
/// choice of scope: [`per_principal`](Self::per_principal) (records per authenticated
/// principal) or [`shared_scope`](Self::shared_scope) (one scope for everybody, unsafe for
/// multi-tenant APIs). See the [crate docs](crate) for the behaviour and an example.
pub struct IdempotencyLayer<S, P> {
    idem: Idempotency<S>,
    principal: P,
    config: Arc<Config>,
}

impl<S, P: Clone> Clone for IdempotencyLayer<S, P> {
    fn clone(&self) -> Self {
        Self {
            idem: self.idem.clone(),
            principal: self.principal.clone(),
            config: Arc::clone(&self.config),
        }
    }
}

impl<S, P: fmt::Debug> fmt::Debug for IdempotencyLayer<S, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("principal", &self.principal)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<S: RequestStore + Clone + 'static> IdempotencyLayer<S, ()> {
    /// Records scoped per principal: `principal` finds it in the request head (e.g. the
    /// account your authentication layer put in the extensions); `None` answers
    /// `401 missing-principal`.
    ///
    /// ```
    /// # fn doc(idem: idem_request::Idempotency<idem_sql::SqliteStore>) {
    /// use idem_http::IdempotencyLayer;
    ///
    /// #[derive(Clone)]
    /// struct Account(String); // inserted by the authentication middleware
    ///
    /// let layer = IdempotencyLayer::per_principal(idem, |parts: &http::request::Parts| {
    ///     parts.extensions.get::<Account>().map(|a| a.0.clone())
    /// });
    /// # }
    /// ```
    pub fn per_principal<F, T>(
        idem: Idempotency<S>,
        principal: F,
    ) -> IdempotencyLayer<S, PrincipalFn<F>>
    where
        F: Fn(&Parts) -> Option<T> + Clone + Send + Sync + 'static,
        T: AsRef<[u8]>,
    {
        IdempotencyLayer::with_principal(idem, PrincipalFn(principal))
    }

    /// One scope for every request: **any client that sends another's key gets the other's
    /// response** (and blocks it while it runs). Unsafe for multi-tenant APIs; right only when
    /// every caller is trusted as one principal (an internal service, one tenant per
    /// deployment).
    pub fn shared_scope(idem: Idempotency<S>) -> IdempotencyLayer<S, SharedScope> {
        IdempotencyLayer::with_principal(idem, SharedScope)
    }

    /// Records scoped by a [`MakePrincipal`] of your own.
    pub fn with_principal<M: MakePrincipal>(
        idem: Idempotency<S>,
        principal: M,
    ) -> IdempotencyLayer<S, M> {
        IdempotencyLayer {
            idem,
            principal,
            config: Arc::new(Config::default()),
        }
    }
}

impl<S, P> IdempotencyLayer<S, P> {
    fn config(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// The engine.
    pub fn idempotency(&self) -> &Idempotency<S> {
        &self.idem
    }

    /// The framework-free [`Exchange`] of this configuration, for a framework other than
    /// tower's (see [`exchange`](crate::exchange)).
    pub fn exchange(&self) -> Exchange<S, P>
    where
        P: Clone,
    {
        Exchange::new(
            self.idem.clone(),
            self.principal.clone(),
            Arc::clone(&self.config),
        )
    }

    /// The header carrying the key (default `Idempotency-Key`; names are case-insensitive).
    pub fn key_header(self, name: HeaderName) -> Self {
        self.config(|c| c.key_header = name)
    }

    /// The replay marker's name (default `Idempotent-Replayed`); its value is `true`. A first
    /// execution never carries it: the layer removes it from the handler's response.
    pub fn replay_header(self, name: HeaderName) -> Self {
        self.config(|c| c.replay_header = name)
    }

    /// The name of the header that marks a replay whose body was omitted (default
    /// `Idempotent-Body-Omitted`); its value is `true`.
    pub fn omitted_body_header(self, name: HeaderName) -> Self {
        self.config(|c| c.omitted_header = name)
    }

    /// The methods made idempotent (default `POST` and `PATCH`; add `PUT` or `DELETE` if
    /// yours are not naturally idempotent). `GET`, `HEAD`, `OPTIONS` and `TRACE` are safe
    /// methods: they are dropped from the list, and a key on them is ignored.
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods: Vec<Method> = methods.into_iter().filter(|m| !m.is_safe()).collect();
        self.config(|c| c.methods = methods)
    }

    /// No key → `400 missing-key`; the handler does not run.
    pub fn require_key(self) -> Self {
        self.key_requirement(KeyRequirement::Required)
    }

    /// No key → the request runs without idempotency (the default).
    pub fn optional_key(self) -> Self {
        self.key_requirement(KeyRequirement::Optional)
    }

    /// The same requirement for every route the layer wraps (in axum, put differently
    /// configured layers on different routes with `MethodRouter::layer`).
    pub fn key_requirement(self, requirement: KeyRequirement) -> Self {
        self.config(|c| c.requirement = Requirement::Fixed(requirement))
    }

    /// A requirement per request, for one layer in front of many routes (hyper, a plain
    /// tower stack):
    ///
    /// ```
    /// # fn doc(layer: idem_http::IdempotencyLayer<idem_sql::SqliteStore, idem_http::SharedScope>) {
    /// use idem_http::KeyRequirement;
    ///
    /// let layer = layer.key_requirement_by(|parts: &http::request::Parts| match parts.uri.path() {
    ///     "/charges" | "/refunds" => KeyRequirement::Required,
    ///     "/login" => KeyRequirement::Off,
    ///     _ => KeyRequirement::Optional,
    /// });
    /// # }
    /// ```
    pub fn key_requirement_by(
        self,
        f: impl Fn(&Parts) -> KeyRequirement + Send + Sync + 'static,
    ) -> Self {
        self.config(|c| c.requirement = Requirement::By(Arc::new(f)))
    }

    /// The longest key accepted, in bytes (default 255). The store's own limit still applies.
    pub fn max_key_len(self, bytes: usize) -> Self {
        self.config(|c| c.max_key_len = bytes)
    }

    /// Request bodies over `bytes` are answered `413 body-too-large` before any record is
    /// written (default 1 MiB). The layer buffers idempotent requests' bodies to fingerprint
    /// them; requests it passes through are not limited by it.
    pub fn request_body_limit(self, bytes: usize) -> Self {
        self.config(|c| c.request_body_limit = bytes)
    }

    /// Responses with a body over `bytes` are stored without it (default 1 MiB): the record
    /// still completes, so a retry never executes again, and its replay carries the status,
    /// the kept headers, an empty body and the omitted-body header.
    pub fn response_storage_limit(self, bytes: usize) -> Self {
        self.config(|c| c.response_storage_limit = bytes)
    }

    /// A fingerprint of your own, e.g. over selected fields of the JSON body so that a client
    /// re-serialising the same request differently still replays. The default is
    /// [`default_fingerprint`].
    pub fn fingerprint_with(
        self,
        f: impl Fn(&Parts, &Bytes) -> Fingerprint + Send + Sync + 'static,
    ) -> Self {
        self.config(|c| c.fingerprint = Some(Arc::new(f)))
    }

    /// Which responses are stored (default [`StorePolicy::default`]). A client error is
    /// stored only when the handler started executing, unless
    /// [`store_client_errors_before_start`](Self::store_client_errors_before_start).
    pub fn store_policy(self, policy: StorePolicy) -> Self {
        self.config(|c| c.policy = policy)
    }

    /// Store a client error (4xx) the policy stores even when the handler never marked its
    /// start (default `false`; see [`execution`](crate::execution)). Right only where nothing
    /// answers before the handler — a plain tower service that validates nothing before it
    /// acts — since an axum extractor's rejection would be stored and replayed to the
    /// corrected retry.
    pub fn store_client_errors_before_start(self, store: bool) -> Self {
        self.config(|c| c.client_errors_before_start = store)
    }

    /// The `Retry-After` a retry gets while its key is in flight, in whole seconds (default
    /// [`DEFAULT_RETRY_AFTER`], 1 s), never more than what is left of the holder's lease. A
    /// hint for the client's next attempt, not the time the first request needs: a short one
    /// lets the client pick up the stored response soon after it is there.
    pub fn retry_after(self, hint: Duration) -> Self {
        self.config(|c| c.retry_after = hint)
    }

    /// The challenge of `401 missing-principal`'s `WWW-Authenticate` header (default
    /// `Bearer`), which RFC 9110 requires on every 401: your authentication's scheme.
    pub fn www_authenticate(self, challenge: HeaderValue) -> Self {
        self.config(|c| c.www_authenticate = challenge)
    }

    /// Replaces the allow-list of stored response headers (default
    /// [`DEFAULT_STORED_HEADERS`]). `Set-Cookie`, hop-by-hop and framing headers are never
    /// stored, even when listed ([`NEVER_STORED`](crate::record::NEVER_STORED)).
    pub fn stored_headers(self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        let names: Vec<HeaderName> = names.into_iter().collect();
        self.config(|c| c.stored_headers = names)
    }

    /// Adds one header to the allow-list of stored response headers.
    pub fn store_header(self, name: HeaderName) -> Self {
        self.config(|c| {
            if !c.stored_headers.contains(&name) {
                c.stored_headers.push(name);
            }
        })
    }

    /// The start of problem responses' `type` URI; the code is appended (default: this
    /// crate's [`problem`](crate::problem) documentation).
    pub fn problem_type_base(self, base: impl Into<String>) -> Self {
        let base = base.into();
        self.config(|c| c.problem_type_base = base)
    }
}

impl<S, P, Inner> Layer<Inner> for IdempotencyLayer<S, P>
where
    S: RequestStore + Clone + 'static,
    P: MakePrincipal,
{
    type Service = IdempotencyService<Inner, S, P>;

    fn layer(&self, inner: Inner) -> Self::Service {
        IdempotencyService::new(inner, self.exchange())
    }
}
