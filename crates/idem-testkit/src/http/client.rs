//! The suite's client side: the server under test, a reqwest client for it, and the requests
//! and replies of the checks.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::HeaderValue;
use idem_request::{Idempotency, IdempotencyBuilder};
use serde_json::{Value, json};

use super::{HttpFixture, HttpFramework, Running, SuiteApp};

/// A running server of framework `A` and a client for it; stopped when dropped.
pub struct Server<F> {
    /// `http://127.0.0.1:port`.
    pub base: String,
    /// The handlers' state: what they counted.
    pub state: Arc<SuiteApp<F>>,
    /// A client with a connection pool of its own.
    pub client: reqwest::Client,
    running: Running,
}

impl<F> std::fmt::Debug for Server<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("running", &self.running)
            .finish_non_exhaustive()
    }
}

/// Serves the suite's routes with framework `A` on `store`, its engine configured by
/// `configure`.
pub async fn serve<A: HttpFramework, F: HttpFixture>(
    fx: Arc<F>,
    store: F::Store,
    configure: impl FnOnce(IdempotencyBuilder<F::Store>) -> IdempotencyBuilder<F::Store>,
) -> Server<F> {
    let idem = configure(Idempotency::builder(store))
        .build()
        .expect("engine configuration");
    let state = Arc::new(SuiteApp::new(fx));
    let running = A::serve(Arc::clone(&state), idem).await;
    let client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(64)
        .build()
        .expect("client");
    Server {
        base: running.base().to_owned(),
        state,
        client,
        running,
    }
}

/// One response, read whole.
#[derive(Debug, Clone)]
pub struct Reply {
    /// The status code.
    pub status: u16,
    /// The response headers.
    pub headers: reqwest::header::HeaderMap,
    /// The whole body.
    pub body: Bytes,
}

impl Reply {
    /// Whether it carries `Idempotent-Replayed: true` (any other value fails the check).
    pub fn replayed(&self) -> bool {
        match self.headers.get("idempotent-replayed") {
            None => false,
            Some(v) if v == "true" => true,
            Some(v) => panic!("replay marker with value {v:?}"),
        }
    }

    /// The body as JSON (`null` when it is not).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    /// The problem code, checking the RFC 9457 shape on the way.
    pub fn code(&self) -> String {
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

    /// The message IDs `POST /emit` named in its body.
    pub fn emitted(&self) -> Vec<String> {
        self.json()["ids"]
            .as_array()
            .expect("the emitted IDs")
            .iter()
            .map(|v| v.as_str().expect("an ID").to_owned())
            .collect()
    }

    /// The `execution` number of a handler's body.
    pub fn execution(&self) -> u64 {
        self.json()["execution"]
            .as_u64()
            .expect("an execution number")
    }
}

/// A `POST /charges` (or another path).
#[derive(Debug)]
pub struct Post {
    /// The path.
    pub path: &'static str,
    /// The `x-principal` header.
    pub principal: Option<&'static str>,
    /// The `Idempotency-Key` headers, in order.
    pub keys: Vec<HeaderValue>,
    /// The body.
    pub body: Vec<u8>,
    /// Other headers.
    pub headers: Vec<(&'static str, String)>,
}

impl Post {
    /// As `alice`, with `key` as an sf-string, for `effect`.
    pub fn new(key: &str, effect: &str) -> Self {
        Self {
            path: "/charges",
            principal: Some("alice"),
            keys: vec![HeaderValue::from_str(&format!("\"{key}\"")).expect("key header")],
            body: json!({ "effect": effect }).to_string().into_bytes(),
            headers: Vec::new(),
        }
    }

    /// `POST /emit` for this effect, enqueueing `n` messages.
    pub fn emitting(self, n: u64) -> Self {
        let effect = serde_json::from_slice::<Value>(&self.body).unwrap_or(Value::Null)["effect"]
            .as_str()
            .unwrap_or("none")
            .to_owned();
        self.path("/emit")
            .body(json!({ "effect": effect, "emit": n }))
    }

    /// Another path.
    pub fn path(mut self, path: &'static str) -> Self {
        self.path = path;
        self
    }

    /// Replaces the request's `Content-Type` (`application/json` by default).
    pub fn content_type(self, value: &str) -> Self {
        self.header("content-type", value)
    }

    /// Another JSON body.
    pub fn body(mut self, body: Value) -> Self {
        self.body = body.to_string().into_bytes();
        self
    }

    /// Another body, as bytes.
    pub fn raw_body(mut self, body: Vec<u8>) -> Self {
        self.body = body;
        self
    }

    /// Another principal, or none.
    pub fn principal(mut self, principal: Option<&'static str>) -> Self {
        self.principal = principal;
        self
    }

    /// Other key headers (none, several).
    pub fn keys(mut self, keys: Vec<HeaderValue>) -> Self {
        self.keys = keys;
        self
    }

    /// One more header.
    pub fn header(mut self, name: &'static str, value: impl ToString) -> Self {
        self.headers.push((name, value.to_string()));
        self
    }

    /// The status the handler answers with (`x-status`).
    pub fn status(self, status: u16) -> Self {
        self.header("x-status", status)
    }

    /// How long the handler sleeps with its transaction open (`x-sleep-ms`).
    pub fn sleep_ms(self, ms: u64) -> Self {
        self.header("x-sleep-ms", ms)
    }
}

impl<F> Server<F> {
    /// Handler executions so far.
    pub fn executions(&self) -> u64 {
        self.state.executions.load(Ordering::SeqCst)
    }

    /// Sends `post`; a transport error is returned.
    pub async fn send(&self, post: Post) -> Result<Reply, reqwest::Error> {
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

    /// Sends `post`; a transport error fails the check.
    pub async fn post(&self, post: Post) -> Reply {
        self.send(post).await.expect("a response")
    }

    /// `GET /charges` as alice with `key`.
    pub async fn get(&self, key: &str) -> Reply {
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

/// Sends `request` on a fresh connection to `base` and reads the answer until the server closes
/// it (or 5 s pass, or nothing more comes for 500 ms after something came).
pub async fn raw_http(base: &str, request: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let addr = base.trim_start_matches("http://");
    let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
    // The server may answer and close before it read all of it: a broken pipe is fine.
    let _ = conn.write_all(request).await;
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_millis(500), conn.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => answer.extend_from_slice(&buf[..n]),
            // Nothing more for a while: the whole answer is in (the server may keep the
            // connection open, waiting for the body it will never read).
            Err(_) if !answer.is_empty() => break,
            Err(_) => {}
        }
    }
    String::from_utf8_lossy(&answer).into_owned()
}
