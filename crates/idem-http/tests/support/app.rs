//! The service under test, served on 127.0.0.1:0 by axum, and a reqwest client for it.
//!
//! `POST /charges` (key required) writes one effect row named by the body's `effect` through
//! the execution's transaction, then answers with the status in `x-status` (201 by default;
//! headers are not part of the fingerprint, so a retry may ask for another outcome), after
//! sleeping `x-sleep-ms` with the transaction open, or panics on `x-panic`. The body names the
//! execution, so a replay is told apart from a second execution. `GET /charges` counts calls.
//! `POST /optional` and `POST /off` run the same handler with the key optional and off.
//! `POST /json` takes its order through axum's `Json` extractor (whose rejections must not be
//! stored); `POST /plain` takes no idem extractor at all and answers `x-status`, marked
//! [`Executed`] with `x-executed`; `POST /derive` answers the key it derives for an external
//! call. `/v1/…` and `/v2/…` nest `/charges` and `/derive` under `Router::nest`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use idem_http::{Executed, IdemRequest, IdemTx, IdempotencyLayer, KeyRequirement};
use idem_request::{Idempotency, IdempotencyBuilder};
use serde_json::{Value, json};

use super::fixtures::HttpFixture;

pub(crate) const REQUEST_LIMIT: usize = 64 * 1024;
pub(crate) const STORAGE_LIMIT: usize = 16 * 1024;
pub(crate) const X_STORED: HeaderName = HeaderName::from_static("x-stored");

pub(crate) struct AppState<F> {
    pub(crate) fx: Arc<F>,
    pub(crate) executions: AtomicU64,
    pub(crate) gets: AtomicU64,
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

async fn charge<F: HttpFixture>(
    State(app): State<Arc<AppState<F>>>,
    tx: Option<IdemTx<F::Store>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let n = app.executions.fetch_add(1, Ordering::SeqCst) + 1;
    let order: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let effect = order["effect"].as_str().unwrap_or("none").to_owned();
    let pad = order["pad"].as_u64().unwrap_or(0) as usize;
    if let Some(mut tx) = tx {
        app.fx
            .record_effect(&mut tx, &effect)
            .await
            .expect("effect written");
        if let Some(ms) = header(&headers, "x-sleep-ms").and_then(|v| v.parse().ok()) {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        if headers.contains_key("x-panic") {
            panic!("the handler panics on purpose (x-panic)");
        }
    }
    let status = header(&headers, "x-status")
        .and_then(|v| v.parse().ok())
        .unwrap_or(201u16);
    let body = json!({ "execution": n, "effect": effect, "pad": "x".repeat(pad) });
    let mut response = (
        http::StatusCode::from_u16(status).expect("status"),
        [
            ("content-type", "application/json".to_owned()),
            ("location", format!("/charges/{n}")),
            ("set-cookie", format!("session=s{n}; HttpOnly")),
            ("x-not-stored", n.to_string()),
            ("x-stored", format!("kept-{n}")),
            ("cache-control", "no-store".to_owned()),
        ],
        body.to_string(),
    )
        .into_response();
    if headers.contains_key("x-fake-replay") {
        // A handler that sets the marker itself must not make a first execution look replayed.
        response
            .headers_mut()
            .insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    response
}

/// The body `POST /json` deserializes: `effect` is required.
#[derive(serde::Deserialize)]
struct Order {
    effect: String,
}

async fn json_charge<F: HttpFixture>(
    State(app): State<Arc<AppState<F>>>,
    tx: Option<IdemTx<F::Store>>,
    headers: HeaderMap,
    Json(order): Json<Order>,
) -> Response {
    let n = app.executions.fetch_add(1, Ordering::SeqCst) + 1;
    if let Some(mut tx) = tx {
        app.fx
            .record_effect(&mut tx, &order.effect)
            .await
            .expect("effect written");
    }
    let status = header(&headers, "x-status")
        .and_then(|v| v.parse().ok())
        .unwrap_or(201u16);
    (
        http::StatusCode::from_u16(status).expect("status"),
        Json(json!({ "execution": n, "effect": order.effect })),
    )
        .into_response()
}

/// No idem extractor: the layer cannot tell its 4xx from an extractor's unless it says so.
async fn plain<F: HttpFixture>(
    State(app): State<Arc<AppState<F>>>,
    headers: HeaderMap,
) -> Response {
    let n = app.executions.fetch_add(1, Ordering::SeqCst) + 1;
    let status = header(&headers, "x-status")
        .and_then(|v| v.parse().ok())
        .unwrap_or(201u16);
    let status = http::StatusCode::from_u16(status).expect("status");
    let body = Json(json!({ "execution": n }));
    if headers.contains_key("x-executed") {
        (status, Executed, body).into_response()
    } else {
        (status, body).into_response()
    }
}

/// The key this execution would send to a card processor.
async fn derive<F: HttpFixture>(
    State(app): State<Arc<AppState<F>>>,
    req: IdemRequest,
    headers: HeaderMap,
) -> Response {
    let n = app.executions.fetch_add(1, Ordering::SeqCst) + 1;
    let derived = req.derive_key("card-processor/charge").to_uuid_string();
    let status = header(&headers, "x-status")
        .and_then(|v| v.parse().ok())
        .unwrap_or(201u16);
    (
        http::StatusCode::from_u16(status).expect("status"),
        Json(json!({ "execution": n, "derived": derived })),
    )
        .into_response()
}

async fn list<F: HttpFixture>(State(app): State<Arc<AppState<F>>>) -> &'static str {
    app.gets.fetch_add(1, Ordering::SeqCst);
    "[]"
}

/// A running server; aborted when dropped.
pub(crate) struct Server<F> {
    pub(crate) base: String,
    pub(crate) state: Arc<AppState<F>>,
    pub(crate) router: Router,
    pub(crate) client: reqwest::Client,
    task: tokio::task::JoinHandle<()>,
}

impl<F> Drop for Server<F> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The layer of every test: per principal (the `x-principal` header stands in for
/// authentication), key required, small limits.
pub(crate) fn layer<S>(idem: Idempotency<S>) -> IdempotencyLayer<S, impl idem_http::MakePrincipal>
where
    S: idem_core::store::RequestStore + Clone + 'static,
{
    IdempotencyLayer::per_principal(idem, |parts: &Parts| {
        parts
            .headers
            .get("x-principal")
            .map(|v| v.as_bytes().to_vec())
    })
    .require_key()
    .request_body_limit(REQUEST_LIMIT)
    .response_storage_limit(STORAGE_LIMIT)
    .store_header(X_STORED)
}

fn versioned<F: HttpFixture>(idem: &Idempotency<F::Store>) -> Router<Arc<AppState<F>>> {
    Router::new()
        .route("/charges", post(charge::<F>).layer(layer(idem.clone())))
        .route("/derive", post(derive::<F>).layer(layer(idem.clone())))
}

/// Serves the app on `store`, its engine configured by `configure`.
pub(crate) async fn serve<F: HttpFixture>(
    fx: Arc<F>,
    store: F::Store,
    configure: impl FnOnce(IdempotencyBuilder<F::Store>) -> IdempotencyBuilder<F::Store>,
) -> Server<F> {
    let idem = configure(Idempotency::builder(store))
        .build()
        .expect("engine configuration");
    let state = Arc::new(AppState {
        fx,
        executions: AtomicU64::new(0),
        gets: AtomicU64::new(0),
    });
    // One layer per route, configured per route (the whole-router form is in the crate docs).
    let router = Router::new()
        .route(
            "/charges",
            post(charge::<F>).get(list::<F>).layer(layer(idem.clone())),
        )
        .route(
            "/optional",
            post(charge::<F>).layer(layer(idem.clone()).optional_key()),
        )
        .route(
            "/off",
            post(charge::<F>).layer(layer(idem.clone()).key_requirement(KeyRequirement::Off)),
        )
        .route("/json", post(json_charge::<F>).layer(layer(idem.clone())))
        .route("/plain", post(plain::<F>).layer(layer(idem.clone())))
        .route("/derive", post(derive::<F>).layer(layer(idem.clone())))
        // The same routes under two prefixes: the layer sits inside the nested router, where
        // the request's URI has lost its prefix.
        .nest("/v1", versioned::<F>(&idem))
        .nest("/v2", versioned::<F>(&idem))
        .with_state(Arc::clone(&state));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1:0");
    let addr = listener.local_addr().expect("local addr");
    let app = router.clone();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(64)
        .build()
        .expect("client");
    Server {
        base: format!("http://{addr}"),
        state,
        router,
        client,
        task,
    }
}

/// One response, read whole.
#[derive(Debug, Clone)]
pub(crate) struct Reply {
    pub(crate) status: u16,
    pub(crate) headers: reqwest::header::HeaderMap,
    pub(crate) body: Bytes,
}

impl Reply {
    pub(crate) fn replayed(&self) -> bool {
        match self.headers.get("idempotent-replayed") {
            None => false,
            Some(v) if v == "true" => true,
            Some(v) => panic!("replay marker with value {v:?}"),
        }
    }

    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    /// The problem code, checking the RFC 9457 shape on the way.
    pub(crate) fn code(&self) -> String {
        assert_eq!(
            self.headers.get("content-type").map(|v| v.as_bytes()),
            Some(&b"application/problem+json"[..]),
            "not a problem response: {self:?}"
        );
        let v = self.json();
        assert_eq!(v["status"], self.status, "{v}");
        for member in ["type", "title", "detail", "code"] {
            assert!(v[member].is_string(), "problem without {member}: {v}");
        }
        v["code"].as_str().unwrap_or_default().to_owned()
    }

    pub(crate) fn execution(&self) -> u64 {
        self.json()["execution"]
            .as_u64()
            .expect("an execution number")
    }
}

/// A `POST /charges`.
pub(crate) struct Post {
    pub(crate) path: &'static str,
    pub(crate) principal: Option<&'static str>,
    pub(crate) keys: Vec<HeaderValue>,
    pub(crate) body: Vec<u8>,
    pub(crate) headers: Vec<(&'static str, String)>,
}

impl Post {
    /// As `alice`, with `key` as an sf-string, for `effect`.
    pub(crate) fn new(key: &str, effect: &str) -> Self {
        Self {
            path: "/charges",
            principal: Some("alice"),
            keys: vec![HeaderValue::from_str(&format!("\"{key}\"")).expect("key header")],
            body: json!({ "effect": effect }).to_string().into_bytes(),
            headers: Vec::new(),
        }
    }

    pub(crate) fn path(mut self, path: &'static str) -> Self {
        self.path = path;
        self
    }

    /// Replaces the request's `Content-Type` (`application/json` by default).
    pub(crate) fn content_type(self, value: &str) -> Self {
        self.header("content-type", value)
    }

    pub(crate) fn body(mut self, body: Value) -> Self {
        self.body = body.to_string().into_bytes();
        self
    }

    pub(crate) fn raw_body(mut self, body: Vec<u8>) -> Self {
        self.body = body;
        self
    }

    pub(crate) fn principal(mut self, principal: Option<&'static str>) -> Self {
        self.principal = principal;
        self
    }

    pub(crate) fn keys(mut self, keys: Vec<HeaderValue>) -> Self {
        self.keys = keys;
        self
    }

    pub(crate) fn header(mut self, name: &'static str, value: impl ToString) -> Self {
        self.headers.push((name, value.to_string()));
        self
    }

    pub(crate) fn status(self, status: u16) -> Self {
        self.header("x-status", status)
    }

    pub(crate) fn sleep_ms(self, ms: u64) -> Self {
        self.header("x-sleep-ms", ms)
    }
}

impl<F> Server<F> {
    pub(crate) fn executions(&self) -> u64 {
        self.state.executions.load(Ordering::SeqCst)
    }

    pub(crate) async fn send(&self, post: Post) -> Result<Reply, reqwest::Error> {
        let mut req = self
            .client
            .post(format!("{}{}", self.base, post.path))
            .body(post.body);
        if !post.headers.iter().any(|(n, _)| *n == "content-type") {
            req = req.header("content-type", "application/json");
        }
        if let Some(p) = post.principal {
            req = req.header("x-principal", p);
        }
        for key in post.keys {
            req = req.header("idempotency-key", key);
        }
        for (name, value) in post.headers {
            req = req.header(name, value);
        }
        let response = req.send().await?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.bytes().await?;
        Ok(Reply {
            status,
            headers,
            body,
        })
    }

    pub(crate) async fn post(&self, post: Post) -> Reply {
        self.send(post).await.expect("a response")
    }

    pub(crate) async fn get(&self, key: &str) -> Reply {
        let response = self
            .client
            .get(format!("{}/charges", self.base))
            .header("x-principal", "alice")
            .header("idempotency-key", format!("\"{key}\""))
            .send()
            .await
            .expect("a response");
        Reply {
            status: response.status().as_u16(),
            headers: response.headers().clone(),
            body: response.bytes().await.expect("body"),
        }
    }
}
