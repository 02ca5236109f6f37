//! A fault proxy: an HTTP/1.1 proxy that forwards every request to its upstream, waits for the
//! upstream's whole answer — so the server has acted and committed — and then, for a seeded
//! fraction of requests, closes the client's connection without answering. The client sees a
//! lost answer for an effect that happened: the case an idempotency key exists for.
//!
//! Counts what it did ([`FaultProxyStats`]): requests forwarded (upstream answered), answers
//! dropped, and upstream failures (answered `502`, never dropped). The drop decisions come
//! from a seeded generator, so a run's fraction is reproducible; which request gets which
//! decision depends on arrival order. Also runnable as the `idem-fault-proxy` binary.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> std::io::Result<()> {
//! use idem_testkit::fault_proxy::FaultProxy;
//!
//! let upstream = "127.0.0.1:9".parse().expect("an address");
//! let proxy = FaultProxy::start(upstream, 0.3, 42).await?;
//! assert!(proxy.url().starts_with("http://127.0.0.1:"));
//! assert_eq!(proxy.stats().dropped, 0);
//! # Ok(())
//! # }
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Mutex, Notify};
use tokio::task::JoinSet;

/// What the proxy has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultProxyStats {
    /// Requests the upstream answered in full (dropped ones included).
    pub forwarded: u64,
    /// Answers received from the upstream and not passed on: the client's connection was
    /// closed instead.
    pub dropped: u64,
    /// Requests the upstream did not answer (connection refused or lost); the client got
    /// `502`.
    pub upstream_errors: u64,
}

#[derive(Debug)]
struct Shared {
    upstream: SocketAddr,
    /// Drop when a draw (uniform in `0..2^53`) is below this.
    threshold: u64,
    rng: AtomicU64,
    forwarded: AtomicU64,
    dropped: AtomicU64,
    upstream_errors: AtomicU64,
}

impl Shared {
    /// splitmix64 on an atomic state: a seeded, lock-free stream of draws.
    fn drop_this_one(&self) -> bool {
        let mut z = self
            .rng
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) < self.threshold
    }

    fn stats(&self) -> FaultProxyStats {
        FaultProxyStats {
            forwarded: self.forwarded.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
            upstream_errors: self.upstream_errors.load(Ordering::Relaxed),
        }
    }
}

/// A running fault proxy; stops (with its connections) when dropped.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FaultProxy {
    /// Starts a proxy on a free loopback port in front of `upstream`, dropping the fraction
    /// `drop` (clamped to `0.0..=1.0`) of answers, drawn from `seed`.
    pub async fn start(upstream: SocketAddr, drop: f64, seed: u64) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        Ok(Self::serve(listener, upstream, drop, seed))
    }

    /// Serves on `listener` (already bound) in a background task.
    pub fn serve(listener: TcpListener, upstream: SocketAddr, drop: f64, seed: u64) -> Self {
        let shared = shared(upstream, drop, seed);
        let addr = listener
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0)));
        let task = tokio::spawn(run(listener, shared.clone()));
        Self { addr, shared, task }
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, the base URL to send requests to instead of the upstream's.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// What it has done so far.
    pub fn stats(&self) -> FaultProxyStats {
        self.shared.stats()
    }
}

fn shared(upstream: SocketAddr, drop: f64, seed: u64) -> Arc<Shared> {
    let fraction = if drop.is_nan() {
        0.0
    } else {
        drop.clamp(0.0, 1.0)
    };
    // 2^53 draws resolve any f64 fraction; 1.0 maps past the largest draw.
    let threshold = (fraction * (1u64 << 53) as f64) as u64;
    Arc::new(Shared {
        upstream,
        threshold,
        rng: AtomicU64::new(seed),
        forwarded: AtomicU64::new(0),
        dropped: AtomicU64::new(0),
        upstream_errors: AtomicU64::new(0),
    })
}

async fn run(listener: TcpListener, shared: Arc<Shared>) {
    // Dropped with this task: aborts every connection.
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
        let _ = stream.set_nodelay(true);
        connections.spawn(connection(stream, shared.clone()));
    }
}

/// One client connection, with one upstream connection of its own (opened on first use,
/// reopened after a failure): HTTP/1.1 answers in order on both sides.
async fn connection(stream: TcpStream, shared: Arc<Shared>) {
    let drop_it = Arc::new(Notify::new());
    let upstream: Arc<Mutex<Option<SendRequest<Incoming>>>> = Arc::new(Mutex::new(None));
    let service = {
        let drop_it = drop_it.clone();
        hyper::service::service_fn(move |req: Request<Incoming>| {
            let shared = shared.clone();
            let upstream = upstream.clone();
            let drop_it = drop_it.clone();
            async move {
                let answer = match forward(&shared, &upstream, req).await {
                    Ok(answer) => answer,
                    Err(_) => {
                        shared.upstream_errors.fetch_add(1, Ordering::Relaxed);
                        let mut bad = Response::new(Full::new(Bytes::from_static(
                            b"fault proxy: upstream did not answer",
                        )));
                        *bad.status_mut() = StatusCode::BAD_GATEWAY;
                        return Ok::<_, std::convert::Infallible>(bad);
                    }
                };
                shared.forwarded.fetch_add(1, Ordering::Relaxed);
                if shared.drop_this_one() {
                    shared.dropped.fetch_add(1, Ordering::Relaxed);
                    drop_it.notify_one();
                    // Never answered: the connection closes first.
                    std::future::pending::<()>().await;
                }
                Ok(answer)
            }
        })
    };
    let conn =
        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    // Dropping the connection future closes the socket without an answer.
    tokio::select! {
        _ = conn => {}
        _ = drop_it.notified() => {}
    }
}

/// Sends `req` upstream and reads the whole answer.
async fn forward(
    shared: &Shared,
    upstream: &Mutex<Option<SendRequest<Incoming>>>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Box<dyn std::error::Error + Send + Sync>> {
    let mut slot = upstream.lock().await;
    let ready = match slot.as_mut() {
        Some(sender) => sender.ready().await.is_ok(),
        None => false,
    };
    if !ready {
        let stream = TcpStream::connect(shared.upstream).await?;
        let _ = stream.set_nodelay(true);
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        *slot = Some(sender);
    }
    let sender = slot.as_mut().ok_or("no upstream connection")?;
    let response = match sender.send_request(req).await {
        Ok(r) => r,
        Err(e) => {
            *slot = None;
            return Err(e.into());
        }
    };
    let (parts, body) = response.into_parts();
    let body = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            *slot = None;
            return Err(e.into());
        }
    };
    Ok(Response::from_parts(parts, Full::new(body)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drops_the_seeded_fraction() {
        for (fraction, low, high) in [(0.0, 0, 0), (0.3, 2_800, 3_200), (1.0, 10_000, 10_000)] {
            let shared = shared("127.0.0.1:9".parse().expect("addr"), fraction, 7);
            let n = (0..10_000).filter(|_| shared.drop_this_one()).count();
            assert!((low..=high).contains(&n), "{fraction}: {n}");
        }
        let a = shared("127.0.0.1:9".parse().expect("addr"), 0.5, 1);
        let b = shared("127.0.0.1:9".parse().expect("addr"), 0.5, 1);
        let draws = |s: &Shared| (0..64).map(|_| s.drop_this_one()).collect::<Vec<_>>();
        assert_eq!(draws(&a), draws(&b), "same seed, same decisions");
    }
}
