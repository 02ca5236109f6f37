//! A fake card processor: an HTTP server that charges once per `Idempotency-Key` and replays
//! the charge like Stripe, counts effects per key, and fails on command — so tests (and the
//! `idem-fake-processor` binary) can prove a client's retries land exactly one charge.
//!
//! - `POST /v1/charges` with JSON `{"account": "...", "amount_cents": 1250}` and an
//!   `Idempotency-Key` answers `200 {"id": "ch_…", "account", "amount_cents"}`. The same key
//!   again answers the stored charge with `Idempotent-Replayed: true`; the same key with
//!   another body answers `422`; the same key while its first request is still running
//!   answers `409` with `Retry-After: 1`. A request without a key charges every time.
//! - Faults, consumed by the next call (`POST /v1/_faults`, [`FakeProcessor::fault_next`]) or
//!   set on one call by its `X-Fake-Fault` header ([`Fault`]'s text form): hang without
//!   answering, answer a status, be slow, or charge and then drop the connection unanswered.
//! - `GET /v1/_stats`: calls, effects per key and charges per account ([`Stats`]).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> std::io::Result<()> {
//! use idem_testkit::fake_processor::{FakeProcessor, Fault};
//!
//! let processor = FakeProcessor::start().await?;
//! processor.fault_next(Fault::ChargeThenDrop);
//! assert!(processor.charges_url().ends_with("/v1/charges"));
//! assert_eq!(processor.stats().total_effects(), 0);
//! # Ok(())
//! # }
//! ```

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::extract::{Extension, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header::RETRY_AFTER};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinSet;

/// The header that sets a fault for the one request that carries it.
pub const FAULT_HEADER: &str = "x-fake-fault";

/// What the processor does wrong on one call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Fault {
    /// Never answer, and charge nothing: the client's timeout decides. Text form `hang`.
    Hang,
    /// Answer `status` without charging, with `Retry-After: retry_after` if given (seconds or
    /// an HTTP date). Text form `status=503` or `status=503;retry-after=2`.
    Status {
        /// The status code to answer.
        status: u16,
        /// The `Retry-After` value to send.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        retry_after: Option<String>,
    },
    /// Wait `ms` milliseconds (holding the key in flight), then charge as usual. Text form
    /// `slow=250`.
    Slow {
        /// How long to wait, in milliseconds.
        ms: u64,
    },
    /// Charge, store the answer for replays, then close the connection without answering:
    /// the client sees a closed connection although the charge happened. Text form
    /// `charge-then-drop`.
    ChargeThenDrop,
}

impl FromStr for Fault {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let bad = || {
            format!(
                "unknown fault {s:?} (hang, status=N[;retry-after=V], slow=MS, charge-then-drop)"
            )
        };
        match s {
            "hang" => return Ok(Self::Hang),
            "charge-then-drop" => return Ok(Self::ChargeThenDrop),
            _ => {}
        }
        if let Some(ms) = s.strip_prefix("slow=") {
            return ms.parse().map(|ms| Self::Slow { ms }).map_err(|_| bad());
        }
        if let Some(rest) = s.strip_prefix("status=") {
            let (code, after) = match rest.split_once(';') {
                Some((code, opt)) => {
                    let after = opt.trim().strip_prefix("retry-after=").ok_or_else(bad)?;
                    (code, Some(after.trim().to_owned()))
                }
                None => (rest, None),
            };
            let status = code.trim().parse().map_err(|_| bad())?;
            return Ok(Self::Status {
                status,
                retry_after: after,
            });
        }
        Err(bad())
    }
}

/// A charge request, as the processor reads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChargeRequest {
    /// The account charged.
    pub account: String,
    /// The amount, in cents.
    pub amount_cents: i64,
}

/// A charge, as the processor answers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Charge {
    /// The processor's ID of the charge (`ch_000001`, …).
    pub id: String,
    /// The account charged.
    pub account: String,
    /// The amount, in cents.
    pub amount_cents: i64,
}

/// What the processor has seen (`GET /v1/_stats`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Requests to `POST /v1/charges`, every attempt counted.
    pub calls: u64,
    /// Charges made per idempotency key: more than 1 is a double charge.
    pub effects: BTreeMap<String, u64>,
    /// Requests per idempotency key.
    pub calls_by_key: BTreeMap<String, u64>,
    /// Charges made by requests that had no key.
    pub without_key: u64,
    /// The IDs of the charges made per account, in the order made, keyed or not: a checker
    /// that gives each operation an account of its own counts the operation's effects here,
    /// whatever keys its attempts sent (a key that changed between attempts shows as a
    /// second charge).
    #[serde(default)]
    pub charges_by_account: BTreeMap<String, Vec<String>>,
}

impl Stats {
    /// Charges made under `key`.
    pub fn effects_for(&self, key: &str) -> u64 {
        self.effects.get(key).copied().unwrap_or(0)
    }

    /// Requests that carried `key`.
    pub fn calls_for(&self, key: &str) -> u64 {
        self.calls_by_key.get(key).copied().unwrap_or(0)
    }

    /// Every charge made, with a key or without.
    pub fn total_effects(&self) -> u64 {
        self.effects.values().sum::<u64>() + self.without_key
    }

    /// The IDs of the charges made to `account`.
    pub fn charges_to(&self, account: &str) -> &[String] {
        self.charges_by_account
            .get(account)
            .map(Vec::as_slice)
            .unwrap_or_default()
    }
}

#[derive(Debug)]
enum KeyState {
    InFlight,
    Done(ChargeRequest, Charge),
}

#[derive(Debug, Default)]
struct Inner {
    stats: Stats,
    keys: HashMap<String, KeyState>,
    faults: VecDeque<Fault>,
    next_id: u64,
}

#[derive(Debug, Default)]
struct Shared {
    inner: Mutex<Inner>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panicking test thread must not hide the counts from the others.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Closes the connection it was given to (the `charge-then-drop` fault).
#[derive(Debug, Clone)]
struct DropConnection(Arc<Notify>);

/// A running fake card processor; stops (with its connections) when dropped.
#[derive(Debug)]
pub struct FakeProcessor {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeProcessor {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeProcessor {
    /// Starts on a free loopback port.
    pub async fn start() -> std::io::Result<Self> {
        Self::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await
    }

    /// Starts on `addr`.
    pub async fn bind(addr: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::default());
        let task = tokio::spawn(serve(listener, shared.clone()));
        Ok(Self { addr, shared, task })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `http://ADDR/v1/charges`.
    pub fn charges_url(&self) -> String {
        format!("http://{}/v1/charges", self.addr)
    }

    /// Queues `fault` for the next call to `POST /v1/charges` that has no `X-Fake-Fault`.
    pub fn fault_next(&self, fault: Fault) {
        self.shared.lock().faults.push_back(fault);
    }

    /// What it has seen so far.
    pub fn stats(&self) -> Stats {
        self.shared.lock().stats.clone()
    }

    /// Serves until the listener fails; for the binary.
    pub async fn run(listener: TcpListener) {
        serve(listener, Arc::new(Shared::default())).await;
    }
}

async fn serve(listener: TcpListener, shared: Arc<Shared>) {
    let app = Router::new()
        .route("/v1/charges", post(charge))
        .route("/v1/_stats", get(stats))
        .route("/v1/_faults", post(set_faults))
        .with_state(shared);
    // Dropped with this task: aborts every connection, hung ones included.
    let mut connections = JoinSet::new();
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of descriptors and the like: keep serving the connections we have.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let drop_it = Arc::new(Notify::new());
        let service = hyper_util::service::TowerToHyperService::new(
            app.clone()
                .layer(Extension(DropConnection(drop_it.clone()))),
        );
        connections.spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            // Dropping the connection future closes the socket without an answer.
            tokio::select! {
                _ = conn => {}
                _ = drop_it.notified() => {}
            }
        });
    }
}

fn problem(status: StatusCode, detail: &str) -> Response {
    (status, Json(serde_json::json!({ "error": detail }))).into_response()
}

async fn charge(
    State(shared): State<Arc<Shared>>,
    Extension(drop_connection): Extension<DropConnection>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let header_fault = match headers.get(FAULT_HEADER).map(|v| v.to_str()) {
        None => None,
        Some(Ok(text)) => match text.parse::<Fault>() {
            Ok(f) => Some(f),
            Err(e) => return problem(StatusCode::BAD_REQUEST, &e),
        },
        Some(Err(_)) => return problem(StatusCode::BAD_REQUEST, "X-Fake-Fault is not ASCII"),
    };
    let fault = {
        let mut inner = shared.lock();
        inner.stats.calls += 1;
        if let Some(k) = &key {
            *inner.stats.calls_by_key.entry(k.clone()).or_default() += 1;
        }
        header_fault.or_else(|| inner.faults.pop_front())
    };
    match &fault {
        Some(Fault::Hang) => std::future::pending::<()>().await,
        Some(Fault::Status {
            status,
            retry_after,
        }) => {
            let status = StatusCode::from_u16(*status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let mut resp = problem(status, "injected fault");
            if let Some(after) = retry_after
                .as_deref()
                .and_then(|a| HeaderValue::from_str(a).ok())
            {
                resp.headers_mut().insert(RETRY_AFTER, after);
            }
            return resp;
        }
        _ => {}
    }
    let request: ChargeRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return problem(StatusCode::BAD_REQUEST, &format!("invalid charge: {e}")),
    };
    if let Some(k) = &key {
        let mut inner = shared.lock();
        match inner.keys.get(k) {
            Some(KeyState::Done(first, charge)) if *first == request => {
                let mut resp = Json(charge.clone()).into_response();
                resp.headers_mut()
                    .insert("idempotent-replayed", HeaderValue::from_static("true"));
                return resp;
            }
            Some(KeyState::Done(..)) => {
                return problem(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "this idempotency key was used with other parameters",
                );
            }
            Some(KeyState::InFlight) => {
                let mut resp = problem(
                    StatusCode::CONFLICT,
                    "a request with this idempotency key is in progress",
                );
                resp.headers_mut()
                    .insert(RETRY_AFTER, HeaderValue::from_static("1"));
                return resp;
            }
            None => {
                inner.keys.insert(k.clone(), KeyState::InFlight);
            }
        }
    }
    if let Some(Fault::Slow { ms }) = fault {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let charge = {
        let mut inner = shared.lock();
        inner.next_id += 1;
        let charge = Charge {
            id: format!("ch_{:06}", inner.next_id),
            account: request.account.clone(),
            amount_cents: request.amount_cents,
        };
        inner
            .stats
            .charges_by_account
            .entry(charge.account.clone())
            .or_default()
            .push(charge.id.clone());
        match &key {
            Some(k) => {
                *inner.stats.effects.entry(k.clone()).or_default() += 1;
                inner
                    .keys
                    .insert(k.clone(), KeyState::Done(request, charge.clone()));
            }
            None => inner.stats.without_key += 1,
        }
        charge
    };
    if fault == Some(Fault::ChargeThenDrop) {
        drop_connection.0.notify_one();
        std::future::pending::<()>().await;
    }
    Json(charge).into_response()
}

async fn stats(State(shared): State<Arc<Shared>>) -> Json<Stats> {
    Json(shared.lock().stats.clone())
}

/// `POST /v1/_faults` body: faults queued for the next calls, in order.
#[derive(Debug, Deserialize)]
struct FaultsCommand {
    faults: Vec<Fault>,
}

async fn set_faults(
    State(shared): State<Arc<Shared>>,
    Json(command): Json<FaultsCommand>,
) -> StatusCode {
    shared.lock().faults.extend(command.faults);
    StatusCode::NO_CONTENT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_text_forms() {
        assert_eq!("hang".parse(), Ok(Fault::Hang));
        assert_eq!("charge-then-drop".parse(), Ok(Fault::ChargeThenDrop));
        assert_eq!("slow=25".parse(), Ok(Fault::Slow { ms: 25 }));
        assert_eq!(
            "status=503;retry-after=2".parse(),
            Ok(Fault::Status {
                status: 503,
                retry_after: Some("2".into())
            })
        );
        assert!("status=x".parse::<Fault>().is_err());
        assert!("explode".parse::<Fault>().is_err());
    }
}
