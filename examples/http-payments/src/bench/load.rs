//! The load generator: N keep-alive HTTP/1.1 clients (one hyper connection each), each sending
//! its next request when the previous answer is read, for a fixed time after a warm-up.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

/// What each request carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Keys {
    /// No `Idempotency-Key` (the service without the layer).
    None,
    /// A fresh key per request: every request is a first execution.
    Fresh,
    /// One key per client, used for every request: after its first, each is a replay.
    Repeated,
}

/// One measured cell.
#[derive(Debug, Clone)]
pub(crate) struct Sample {
    pub(crate) per_second: f64,
    /// Every request sent, the warm-up's included (for CPU per request).
    pub(crate) sent: u64,
    /// CPU time of the server process per request, and of Redis (when on Redis), in µs.
    pub(crate) server_cpu_us: f64,
    pub(crate) redis_cpu_us: f64,
    /// Commands Redis ran per request (when on Redis; `INFO commandstats`, server-wide).
    pub(crate) redis_commands: Option<f64>,
    pub(crate) p50_us: u32,
    pub(crate) p99_us: u32,
    /// Answers that were not what the variant expects (status, replay marker).
    pub(crate) unexpected: usize,
    /// The first unexpected answer, for the report.
    pub(crate) example: Option<String>,
}

/// CPU time (user + system) a process has used, in µs, from `/proc/PID/stat` (Linux; 0
/// elsewhere). Ticks are taken as 100 per second, the Linux default.
pub(crate) fn cpu_micros(pid: u32) -> u64 {
    cpu_micros_in(&format!("/proc/{pid}/stat"))
}

/// [`cpu_micros`] of the calling thread alone (`/proc/thread-self/stat`): the client's side
/// of a current-thread runtime that runs on it.
pub(crate) fn thread_cpu_micros() -> u64 {
    cpu_micros_in("/proc/thread-self/stat")
}

fn cpu_micros_in(path: &str) -> u64 {
    let Ok(stat) = std::fs::read_to_string(path) else {
        return 0;
    };
    // Fields after the command name, which is in parentheses and may hold spaces.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    (ticks(11) + ticks(12)) * 10_000
}

/// Runs `clients` clients against `addr` for `warmup + measure`; counts only `measure`.
/// `work_ms`: each request asks the handler to work that long before it writes
/// (`X-Test-Work-Ms`, honoured by a server with `--test-hooks`).
pub(crate) async fn run(
    addr: SocketAddr,
    clients: usize,
    keys: Keys,
    work_ms: Option<u64>,
    run_id: &str,
    warmup: Duration,
    measure: Duration,
) -> Result<Sample> {
    let start = Instant::now() + Duration::from_millis(50);
    let counted_from = start + warmup;
    let until = counted_from + measure;
    let mut tasks = Vec::with_capacity(clients);
    for client in 0..clients {
        let run_id = run_id.to_owned();
        tasks.push(tokio::spawn(async move {
            one_client(
                addr,
                client,
                keys,
                work_ms,
                run_id,
                start,
                counted_from,
                until,
            )
            .await
        }));
    }
    let mut latencies = Vec::new();
    let mut unexpected = 0;
    let mut example = None;
    let mut sent = 0;
    for t in tasks {
        let r = t.await.context("client task")??;
        sent += r.sent;
        latencies.extend(r.latencies);
        unexpected += r.unexpected;
        example = example.or(r.example);
    }
    latencies.sort_unstable();
    let pct = |p: f64| -> u32 {
        if latencies.is_empty() {
            return 0;
        }
        let i = ((latencies.len() as f64 * p).ceil() as usize).clamp(1, latencies.len()) - 1;
        latencies[i]
    };
    Ok(Sample {
        per_second: latencies.len() as f64 / measure.as_secs_f64(),
        sent,
        server_cpu_us: 0.0,
        redis_cpu_us: 0.0,
        redis_commands: None,
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        unexpected,
        example,
    })
}

struct ClientResult {
    sent: u64,
    latencies: Vec<u32>,
    unexpected: usize,
    example: Option<String>,
}

async fn connect(addr: SocketAddr) -> Result<SendRequest<Full<Bytes>>> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_nodelay(true)?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

#[allow(clippy::too_many_arguments)] // one call site, each argument named there
async fn one_client(
    addr: SocketAddr,
    client: usize,
    keys: Keys,
    work_ms: Option<u64>,
    run_id: String,
    start: Instant,
    counted_from: Instant,
    until: Instant,
) -> Result<ClientResult> {
    let mut sender = connect(addr).await?;
    let token = format!("bench-{run_id}-{client}");
    let authorization = format!("Bearer {token}");
    let body = Bytes::from(format!(
        r#"{{"account":"acct-{client}","amount_cents":1250}}"#
    ));
    let host = addr.to_string();
    let mut latencies = Vec::with_capacity(16_384);
    let mut unexpected = 0;
    let mut example = None;
    tokio::time::sleep_until(start.into()).await;
    let mut n: u64 = 0;
    loop {
        let now = Instant::now();
        if now >= until {
            break;
        }
        let mut req = Request::post("/charges")
            .header(hyper::header::HOST, &host)
            .header(hyper::header::AUTHORIZATION, &authorization)
            .header(hyper::header::CONTENT_TYPE, "application/json");
        let key = match keys {
            Keys::None => None,
            Keys::Fresh => Some(format!("\"{run_id}-{client}-{n}\"")),
            Keys::Repeated => Some(format!("\"{run_id}-{client}\"")),
        };
        if let Some(key) = &key {
            req = req.header("idempotency-key", key);
        }
        if let Some(ms) = work_ms {
            req = req.header("x-test-work-ms", ms);
        }
        let req = req.body(Full::new(body.clone()))?;
        if sender.ready().await.is_err() {
            // The server closed the connection (it should not): reconnect and count it.
            unexpected += 1;
            example.get_or_insert_with(|| "connection closed by the server".to_owned());
            sender = connect(addr).await?;
            continue;
        }
        let sent = Instant::now();
        let response = sender.send_request(req).await?;
        let status = response.status();
        let replayed = response.headers().contains_key("idempotent-replayed");
        let bytes = response.into_body().collect().await?.to_bytes();
        let elapsed = sent.elapsed();
        // The first request of a repeated key executes; every later one must be a replay.
        let expect_replay = keys == Keys::Repeated && n > 0;
        let ok = status == hyper::StatusCode::CREATED && replayed == expect_replay;
        if sent >= counted_from {
            latencies.push(u32::try_from(elapsed.as_micros()).unwrap_or(u32::MAX));
            if !ok {
                unexpected += 1;
                example.get_or_insert_with(|| {
                    format!(
                        "{status} replayed={replayed}: {}",
                        String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
                    )
                });
            }
        }
        n += 1;
    }
    Ok(ClientResult {
        sent: n,
        latencies,
        unexpected,
        example,
    })
}
