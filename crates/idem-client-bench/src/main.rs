//! `idem-client-bench`: what idem-client adds to a request that needs no retry.
//!
//! Two scenarios, each timing the same request three ways, interleaved in rounds so drift
//! (CPU frequency, other load) hits every column alike:
//!
//! - `loopback`: `POST` with a small JSON body to an axum server on 127.0.0.1, through plain
//!   reqwest, through reqwest-middleware with an empty chain, and through
//!   [`IdempotencyMiddleware`] (a fresh UUID key per request, an outcome recorded).
//! - `in-process`: the same chains ending in a middleware that answers at once, so the
//!   figure is the middleware's own cost without a socket's noise.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use http::Extensions;
use idem_client::{IdempotencyMiddleware, RetryPolicy};
use reqwest::{Request, Response};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};

#[derive(Debug, Parser)]
#[command(about = "idem-client's per-request overhead against plain reqwest")]
struct Args {
    /// Requests timed per column and scenario.
    #[arg(long, default_value_t = 20_000)]
    requests: usize,
    /// Requests per column per round (columns alternate every round).
    #[arg(long, default_value_t = 500)]
    round: usize,
}

const BODY: &str = r#"{"account":"acct_1","amount_cents":1250}"#;

/// Answers every request itself: the end of the in-process chains.
#[derive(Debug)]
struct Answer;

#[async_trait::async_trait]
impl Middleware for Answer {
    async fn handle(
        &self,
        _req: Request,
        _ext: &mut Extensions,
        _next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        Ok(Response::from(http::Response::new(reqwest::Body::from(
            r#"{"id":"ch_1"}"#,
        ))))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Column {
    Plain,
    EmptyChain,
    Idem,
}

const COLUMNS: [Column; 3] = [Column::Plain, Column::EmptyChain, Column::Idem];

impl Column {
    fn name(self) -> &'static str {
        match self {
            Column::Plain => "reqwest",
            Column::EmptyChain => "reqwest-middleware, empty chain",
            Column::Idem => "idem-client",
        }
    }
}

struct Clients {
    plain: reqwest::Client,
    empty: ClientWithMiddleware,
    idem: ClientWithMiddleware,
}

async fn one(clients: &Clients, column: Column, url: &str) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let status = match column {
        Column::Plain => {
            let r = clients
                .plain
                .post(url)
                .header("content-type", "application/json")
                .body(BODY)
                .send()
                .await?;
            let s = r.status();
            r.bytes().await?;
            s
        }
        Column::EmptyChain | Column::Idem => {
            let c = if column == Column::Idem {
                &clients.idem
            } else {
                &clients.empty
            };
            let r = c
                .post(url)
                .header("content-type", "application/json")
                .body(BODY)
                .send()
                .await?;
            let s = r.status();
            r.bytes().await?;
            s
        }
    };
    let took = started.elapsed();
    anyhow::ensure!(status.is_success(), "{column:?} answered {status}");
    Ok(took)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).copied().unwrap_or_default()
}

async fn scenario(
    name: &str,
    clients: &Clients,
    columns: &[Column],
    url: &str,
    args: &Args,
) -> anyhow::Result<()> {
    let mut samples: Vec<Vec<Duration>> = vec![Vec::with_capacity(args.requests); columns.len()];
    // Warm the pools and caches.
    for &column in columns {
        for _ in 0..200 {
            one(clients, column, url).await?;
        }
    }
    let rounds = args.requests.div_ceil(args.round.max(1));
    for _ in 0..rounds {
        for (i, &column) in columns.iter().enumerate() {
            for _ in 0..args.round {
                samples[i].push(one(clients, column, url).await?);
            }
        }
    }
    println!("\n{name}: {} requests per column", samples[0].len());
    println!("{:<34} {:>10} {:>10}", "column", "p50 µs", "p99 µs");
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let mut p50s = Vec::new();
    for (i, &column) in columns.iter().enumerate() {
        samples[i].sort_unstable();
        let (p50, p99) = (percentile(&samples[i], 0.50), percentile(&samples[i], 0.99));
        p50s.push((column, p50));
        println!("{:<34} {:>10.2} {:>10.2}", column.name(), us(p50), us(p99));
    }
    if let Some(&(_, idem)) = p50s.iter().find(|(c, _)| *c == Column::Idem) {
        for &(column, p50) in p50s.iter().filter(|(c, _)| *c != Column::Idem) {
            println!(
                "idem-client at p50: {:+.2} µs over {}",
                us(idem) - us(p50),
                column.name()
            );
        }
    }
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new().route(
        "/v1/charges",
        axum::routing::post(|| async { r#"{"id":"ch_1"}"# }),
    );
    // The server runs on its own runtime and thread so it does not share the client's.
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("server runtime")?;
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener.into_std()?)?;
            axum::serve(listener, app).await
        })
        .context("server")
    });
    let http = reqwest::Client::new();
    let loopback = Clients {
        plain: http.clone(),
        empty: ClientBuilder::new(http.clone()).build(),
        idem: ClientBuilder::new(http.clone())
            .with(IdempotencyMiddleware::new(RetryPolicy::default()))
            .build(),
    };
    let url = format!("http://{addr}/v1/charges");
    println!(
        "idem-client-bench: {} requests per column, rounds of {}",
        args.requests, args.round
    );
    let loopback_name = "loopback (axum on 127.0.0.1, HTTP/1.1 keep-alive)";
    scenario(loopback_name, &loopback, &COLUMNS, &url, &args).await?;

    // reqwest alone cannot answer without a socket: this one compares chain with chain.
    let in_process = Clients {
        plain: http.clone(),
        empty: ClientBuilder::new(http.clone()).with(Answer).build(),
        idem: ClientBuilder::new(http)
            .with(IdempotencyMiddleware::new(RetryPolicy::default()))
            .with(Answer)
            .build(),
    };
    let in_process_name = "in-process (the chain answers itself, no socket)";
    let chains = [Column::EmptyChain, Column::Idem];
    scenario(in_process_name, &in_process, &chains, &url, &args).await
}
