//! A TCP proxy in front of the real server that counts the client's *flights* (the times it
//! sent something after an answer reached it) and can stop forwarding altogether, as a peer
//! that vanished behind a network that drops its packets.
//!
//! With `hold`, every answer is held back that long: whatever the client sends without waiting
//! reaches the proxy long before any answer does, so it joins the flight before it, and the
//! count is exact (as in idem-postgres's `tests/postgres/pipelining.rs`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Debug)]
pub(crate) struct Proxy {
    addr: SocketAddr,
    flights: Arc<AtomicUsize>,
    frozen: Arc<AtomicBool>,
}

impl Proxy {
    /// A proxy to `upstream`, holding each answer back for `hold`.
    pub(crate) async fn start(upstream: SocketAddr, hold: Duration) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let flights = Arc::new(AtomicUsize::new(0));
        let frozen = Arc::new(AtomicBool::new(false));
        let (counted, stopped) = (flights.clone(), frozen.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (counted, stopped) = (counted.clone(), stopped.clone());
                tokio::spawn(async move {
                    if stopped.load(Ordering::SeqCst) {
                        // Accepted by the kernel, never answered.
                        swallow(client).await;
                        return;
                    }
                    match TcpStream::connect(upstream).await {
                        Ok(server) => relay(client, server, counted, stopped, hold).await,
                        Err(_) => drop(client),
                    }
                });
            }
        });
        Self {
            addr,
            flights,
            frozen,
        }
    }

    pub(crate) fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Flights since the last call.
    pub(crate) fn take(&self) -> usize {
        self.flights.swap(0, Ordering::SeqCst)
    }

    /// Stops forwarding anything, on open connections and new ones.
    pub(crate) fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }

    /// Forwards again, on new connections (open ones lost bytes meanwhile).
    pub(crate) fn thaw(&self) {
        self.frozen.store(false, Ordering::SeqCst);
    }
}

/// The upstream address of a PostgreSQL or MySQL URL: its host, resolved, and `port`.
pub(crate) async fn upstream(url: &str, default_port: u16) -> SocketAddr {
    let url = url::Url::parse(url).expect("a service URL");
    let host = url.host_str().expect("the service URL names a TCP host");
    let port = url.port().unwrap_or(default_port);
    tokio::net::lookup_host((host, port))
        .await
        .expect("resolve")
        .next()
        .expect("an address")
}

async fn swallow(mut client: TcpStream) {
    let mut buf = vec![0u8; 4096];
    while let Ok(n) = client.read(&mut buf).await {
        if n == 0 {
            break;
        }
    }
}

async fn relay(
    client: TcpStream,
    server: TcpStream,
    flights: Arc<AtomicUsize>,
    frozen: Arc<AtomicBool>,
    hold: Duration,
) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    // Whether an answer reached the client since it last sent something.
    let answered = Arc::new(AtomicBool::new(true));
    let (seen, frozen_up) = (answered.clone(), frozen.clone());
    let up = async move {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n) = client_read.read(&mut buf).await {
            if n == 0 {
                break;
            }
            if frozen_up.load(Ordering::SeqCst) {
                continue;
            }
            if seen.swap(false, Ordering::SeqCst) {
                flights.fetch_add(1, Ordering::SeqCst);
            }
            if server_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    };
    let down = async move {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n) = server_read.read(&mut buf).await {
            if n == 0 {
                break;
            }
            if !hold.is_zero() {
                tokio::time::sleep(hold).await;
            }
            if frozen.load(Ordering::SeqCst) {
                continue;
            }
            if client_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
            answered.store(true, Ordering::SeqCst);
        }
    };
    tokio::join!(up, down);
}
