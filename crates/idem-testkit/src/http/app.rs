//! The suite's handlers, framework-free: a framework adapter extracts what they take and turns
//! their `http::Response<Bytes>` into its own response.
//!
//! `charge` writes one effect row named by the body's `effect` through the execution's
//! transaction, then answers with the status in `x-status` (201 by default; headers are not
//! part of the fingerprint, so a retry may ask for another outcome), after sleeping
//! `x-sleep-ms` with the transaction open, or panics on `x-panic`. The body names the
//! execution, so a replay is told apart from a second execution.
//!
//! `emit` is `charge` with messages: before its effect row it enqueues `emit` (3 by default)
//! messages for [`EMIT_DESTINATION`] through the store's outbox in the same transaction, their
//! IDs from the request's [`IdemRequest::emitter`], and names those IDs in its body.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Response, StatusCode};
use idem_core::outbox::Outgoing;
use idem_http::{Executed, IdemRequest, IdempotencyLayer, MakePrincipal};
use idem_request::Idempotency;
use serde_json::{Value, json};

use super::HttpFixture;
use super::outbox::Enqueue;
use crate::RequestTxOf;

/// The request body limit of [`layer`].
pub const REQUEST_LIMIT: usize = 64 * 1024;
/// The response storage limit of [`layer`].
pub const STORAGE_LIMIT: usize = 16 * 1024;
/// A header the handlers set that [`layer`] adds to the stored ones.
pub const X_STORED: HeaderName = HeaderName::from_static("x-stored");

/// The middleware configuration of every route: per principal (the `x-principal` header stands
/// in for authentication), key required, small limits, `x-stored` kept. Routes that take the
/// key optionally or not at all change only that.
pub fn layer<S>(idem: Idempotency<S>) -> IdempotencyLayer<S, impl MakePrincipal>
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

/// Where `POST /emit` sends its messages.
pub const EMIT_DESTINATION: &str = "suite.charged";
/// How many messages `POST /emit` enqueues when its body does not say (`"emit": n`).
pub const EMIT_DEFAULT: u64 = 3;

/// The body `POST /json` deserializes through the framework's JSON extractor: `effect` is
/// required.
#[derive(Debug, serde::Deserialize)]
pub struct Order {
    /// The effect row to write.
    pub effect: String,
}

/// The suite's application state: the fixture (for effects) and what the checks count.
#[derive(Debug)]
pub struct SuiteApp<F> {
    /// The store fixture the handlers write effects through.
    pub fx: Arc<F>,
    /// Handler executions (every route but `GET /charges`).
    pub executions: AtomicU64,
    /// `GET /charges` calls.
    pub gets: AtomicU64,
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

fn status(headers: &HeaderMap) -> StatusCode {
    header(headers, "x-status")
        .and_then(|v| v.parse().ok())
        .and_then(|v| StatusCode::from_u16(v).ok())
        .unwrap_or(StatusCode::CREATED)
}

/// `x-sleep-ms` with the transaction open, then a panic on `x-panic`.
async fn hold_or_panic(headers: &HeaderMap) {
    if let Some(ms) = header(headers, "x-sleep-ms").and_then(|v| v.parse().ok()) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if headers.contains_key("x-panic") {
        panic!("the handler panics on purpose (x-panic)");
    }
}

fn json_response(status: StatusCode, body: &Value) -> Response<Bytes> {
    let mut response = Response::new(Bytes::from(body.to_string()));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

impl<F: HttpFixture> SuiteApp<F> {
    /// A fresh state for `fx`.
    pub fn new(fx: Arc<F>) -> Self {
        Self {
            fx,
            executions: AtomicU64::new(0),
            gets: AtomicU64::new(0),
        }
    }

    fn next(&self) -> u64 {
        self.executions.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// `POST /charges`, `/optional`, `/off`: writes one effect row named by the body's
    /// `effect` through `tx` (the execution's transaction, `None` without a record), sleeps
    /// `x-sleep-ms` with it open or panics on `x-panic`, then answers the status in `x-status`
    /// (201 by default) with a body naming the execution, so a replay is told apart.
    pub async fn charge(
        &self,
        tx: Option<&mut RequestTxOf<F>>,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Response<Bytes> {
        let n = self.next();
        let order: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let effect = order["effect"].as_str().unwrap_or("none").to_owned();
        let pad = order["pad"].as_u64().unwrap_or(0) as usize;
        if let Some(tx) = tx {
            self.fx
                .record_effect(tx, &effect)
                .await
                .expect("effect written");
            hold_or_panic(headers).await;
        }
        let body = json!({ "execution": n, "effect": effect, "pad": "x".repeat(pad) });
        let mut response = json_response(status(headers), &body);
        for (name, value) in [
            ("location", format!("/charges/{n}")),
            ("set-cookie", format!("session=s{n}; HttpOnly")),
            ("x-not-stored", n.to_string()),
            ("x-stored", format!("kept-{n}")),
            ("cache-control", "no-store".to_owned()),
        ] {
            response.headers_mut().insert(
                HeaderName::from_static(name),
                HeaderValue::from_str(&value).expect("a header value"),
            );
        }
        if headers.contains_key("x-fake-replay") {
            // A handler that sets the marker itself must not make a first execution look
            // replayed.
            response
                .headers_mut()
                .insert("idempotent-replayed", HeaderValue::from_static("true"));
        }
        response
    }

    /// `POST /emit`: enqueues `emit` messages (the body's, [`EMIT_DEFAULT`] without) for
    /// [`EMIT_DESTINATION`] through the store's outbox in `tx`, the request's transaction,
    /// their IDs from `request`'s emitter (a new one per run, so a re-run derives the same
    /// IDs), then writes the effect row, sleeps `x-sleep-ms` or panics on `x-panic`, and
    /// answers the status in `x-status` with the IDs in its body. A store without an outbox is
    /// answered `501 no-outbox` (a problem, not stored: the key stays free).
    pub async fn emit(
        &self,
        tx: &mut RequestTxOf<F>,
        request: &IdemRequest,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Response<Bytes> {
        let n = self.next();
        let order: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let effect = order["effect"].as_str().unwrap_or("none").to_owned();
        let count = order["emit"].as_u64().unwrap_or(EMIT_DEFAULT);
        let mut emitter = request.emitter();
        let messages: Vec<Outgoing> = (0..count)
            .map(|position| {
                // The execution in the payload tells which run's rows committed.
                let payload = json!({ "effect": effect, "position": position, "execution": n });
                emitter
                    .message(EMIT_DESTINATION, payload.to_string())
                    .expect("a valid destination")
            })
            .collect();
        let ids: Vec<String> = messages
            .iter()
            .map(|m| String::from_utf8_lossy(m.id().as_bytes()).into_owned())
            .collect();
        if let Err(e) = self.fx.enqueue(tx, &messages).await {
            let (status, code) = match e {
                Enqueue::NoOutbox => (StatusCode::NOT_IMPLEMENTED, "no-outbox"),
                Enqueue::Store(_) => (StatusCode::INTERNAL_SERVER_ERROR, "outbox-error"),
            };
            let problem = json!({
                "type": "about:blank",
                "title": "The messages could not be enqueued",
                "status": status.as_u16(),
                "detail": e.to_string(),
                "code": code,
                "execution": n,
                "ids": ids,
            });
            let mut response = json_response(status, &problem);
            response.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("application/problem+json"),
            );
            return response;
        }
        self.fx
            .record_effect(tx, &effect)
            .await
            .expect("effect written");
        hold_or_panic(headers).await;
        json_response(
            status(headers),
            &json!({ "execution": n, "effect": effect, "ids": ids }),
        )
    }

    /// `POST /json`, after the framework's JSON extractor accepted `order`.
    pub async fn json_charge(
        &self,
        tx: Option<&mut RequestTxOf<F>>,
        headers: &HeaderMap,
        order: Order,
    ) -> Response<Bytes> {
        let n = self.next();
        if let Some(tx) = tx {
            self.fx
                .record_effect(tx, &order.effect)
                .await
                .expect("effect written");
        }
        json_response(
            status(headers),
            &json!({ "execution": n, "effect": order.effect }),
        )
    }

    /// `POST /plain`: no idem extractor, so the middleware cannot tell its 4xx from an
    /// extractor's unless it says so: marked [`Executed`] (in the response's extensions) on
    /// `x-executed`.
    pub fn plain(&self, headers: &HeaderMap) -> Response<Bytes> {
        let n = self.next();
        let mut response = json_response(status(headers), &json!({ "execution": n }));
        if headers.contains_key("x-executed") {
            response.extensions_mut().insert(Executed);
        }
        response
    }

    /// `POST /derive`: the key this execution would send to a card processor.
    pub fn derive(&self, request: &IdemRequest, headers: &HeaderMap) -> Response<Bytes> {
        let n = self.next();
        let derived = request.derive_key("card-processor/charge").to_uuid_string();
        json_response(
            status(headers),
            &json!({ "execution": n, "derived": derived }),
        )
    }

    /// `GET /charges`.
    pub fn list(&self) -> Response<Bytes> {
        self.gets.fetch_add(1, Ordering::SeqCst);
        Response::new(Bytes::from_static(b"[]"))
    }
}
