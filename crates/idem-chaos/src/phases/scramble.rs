//! `--scramble-foreign-keys`: a proxy in front of the card processor that replaces each
//! call's Idempotency-Key by a new random one, as a service would send that derived no key
//! from its operation (or kept none across attempts). Every repeated call then charges again:
//! the run that uses it shows that the checker catches doubled charges.

use std::net::SocketAddr;

use anyhow::{Context, Result};
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use rand::Rng;
use tokio::net::TcpListener;

/// The running proxy; stops when dropped.
#[derive(Debug)]
pub(crate) struct Scrambler {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Scrambler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Debug, Clone)]
struct Upstream {
    charges: String,
    client: reqwest::Client,
}

impl Scrambler {
    /// Starts on a free loopback port in front of the processor at `upstream` (its base URL).
    pub(crate) async fn start(upstream: &str) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the scrambling proxy")?;
        let addr = listener.local_addr()?;
        let state = Upstream {
            charges: format!("{}/v1/charges", upstream.trim_end_matches('/')),
            client: reqwest::Client::new(),
        };
        let app = Router::new()
            .route("/v1/charges", post(forward))
            .with_state(state);
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { addr, task })
    }

    /// `http://ADDR`, the base URL the services are given as their processor.
    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Forwards one charge with a random key (the caller's with a random suffix) and answers
/// what the processor answered; `502` when the processor could not be reached.
async fn forward(
    State(up): State<Upstream>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, Bytes) {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("none");
    let scrambled = format!("{key}-{:016x}", rand::thread_rng().r#gen::<u64>());
    let sent = up
        .client
        .post(&up.charges)
        .header("idempotency-key", scrambled)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await;
    let Ok(response) = sent else {
        return (StatusCode::BAD_GATEWAY, Bytes::new());
    };
    let status =
        StatusCode::from_u16(response.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    match response.bytes().await {
        Ok(bytes) => (status, bytes),
        Err(_) => (StatusCode::BAD_GATEWAY, Bytes::new()),
    }
}
