//! `http-payments`: an HTTP charges API whose `POST /charges` runs exactly once per
//! `Idempotency-Key`, on SQLite, PostgreSQL, MySQL/MariaDB or Redis. A service to copy.
//!
//! ```text
//! http-payments --listen 127.0.0.1:8080 --database sqlite:http-payments.db
//! curl -si 127.0.0.1:8080/charges -H 'Authorization: Bearer tok_alice' \
//!      -H 'Idempotency-Key: "charge-1"' -H 'Content-Type: application/json' \
//!      -d '{"account":"alice","amount_cents":1250}'
//! ```
//!
//! The idempotency layer (`idem-http`) takes the key's record, hands the handler the store's
//! transaction, and stores the response in it: on the SQL stores the `charges` row and the
//! stored response commit together. With Redis the records live in Redis and the charges in
//! the SQL database given by `--ledger`. SIGTERM stops gracefully.
//!
//! With `--emit NAME --broker URL` (SQL stores only) each charge also writes a
//! `PaymentCharged` event into the outbox in the same transaction, and a relay in this process
//! publishes it to `NAME`.
//!
//! With `--card-processor URL` (SQL stores only) each charge first calls the card processor
//! (`POST URL/v1/charges`) with a key derived from the request's, as a recovery point behind
//! the layer (idem-http's `IdemPhases`), then writes the row with the processor's charge ID;
//! a completer in this process finishes charges whose client gave up.

mod app;
mod bench;
mod emit;
mod layer;
mod ledger;
mod processor;
mod stores;

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "http-payments",
    version,
    about,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Measure the idempotency layer's cost per request on every store next to the same
    /// service without it, and the function-level API on Redis next to AWS Powertools.
    Bench(bench::BenchArgs),
}

/// What the service is started with.
#[derive(Clone, Args)]
pub(crate) struct ServeArgs {
    /// Address to listen on (port 0 picks a free one; the log line `listening` shows it).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    pub(crate) listen: SocketAddr,
    /// Where idempotency records live: sqlite:PATH, postgres://…, mysql://…, redis://…
    #[arg(long, value_name = "URL", default_value = "sqlite:http-payments.db")]
    pub(crate) database: String,
    /// The SQL database holding the charges when --database is redis:// (sqlite:PATH,
    /// postgres://…, mysql://…). With a SQL --database the charges live there.
    #[arg(long, value_name = "URL")]
    pub(crate) ledger: Option<String>,
    /// Write a `PaymentCharged` event per charge into the outbox, in the request's transaction
    /// (with the charge and the stored response), and relay it in this process to destination
    /// NAME on --broker. SQL --database only: with redis://… the charges commit in the
    /// --ledger's transaction, not the request's, so --emit is refused.
    #[arg(long, value_name = "NAME", requires = "broker")]
    pub(crate) emit: Option<String>,
    /// The broker --emit relays to: nats://…, amqp://…, kafka://host:port, redis://… (Streams),
    /// mqtt://…
    #[arg(long, value_name = "URL", requires = "emit")]
    pub(crate) broker: Option<String>,
    /// The --emit relay's name: the lease owner of the outbox rows it publishes and its MQTT
    /// client ID (give each replica its own).
    #[arg(long, value_name = "NAME", default_value = "http-payments-relay")]
    pub(crate) relay_name: String,
    /// Charge through a card processor at URL (`POST URL/v1/charges` with an
    /// `Idempotency-Key`, as `idem-fake-processor` and Stripe take it) before writing the
    /// charge row. The request then runs as two recovery points behind the idempotency layer:
    /// the processor call, whose key is derived from the request's and is the same on every
    /// attempt, then the row with the processor's charge ID. SQL --database only; not with
    /// --emit.
    #[arg(long, value_name = "URL")]
    pub(crate) card_processor: Option<String>,
    /// With --card-processor: how often the in-process completer looks for charges left
    /// stuck mid-phase (their client gave up, their server died) once their lease ran out, and
    /// finishes them so a later retry gets the stored charge; `off` runs none (another
    /// process, or `idem complete`, must).
    #[arg(long, value_name = "DURATION|off", default_value = "5s", value_parser = parse_heartbeat)]
    pub(crate) completer_interval: Heartbeat,
    /// With --card-processor: executions a charge gets (the client's first included) before
    /// the completer gives it up, storing a `charge-abandoned` problem every retry gets.
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub(crate) completer_max_attempts: u32,
    /// With --card-processor: the status of the `charge-abandoned` problem a given-up charge
    /// answers.
    #[arg(long, value_name = "STATUS", default_value_t = 502, value_parser = clap::value_parser!(u16).range(400..600))]
    pub(crate) completer_abandon_status: u16,
    /// How long a request holds its key without renewing it. After a crash, a retry takes
    /// over once the lease ran out.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
    pub(crate) lease: Duration,
    /// Take every record in the leased mode (a committed take, a lease, a takeover after a
    /// crash), even on PostgreSQL and MariaDB, where a first execution is otherwise taken in
    /// its own transaction and a crash frees its key at once.
    #[arg(long)]
    pub(crate) leased_only: bool,
    /// How often a running request renews its lease (default: a third of the lease), or
    /// `off`: a request outliving its lease can then be taken over, and its late completion
    /// is refused.
    #[arg(long, value_name = "DURATION|off", value_parser = parse_heartbeat)]
    pub(crate) heartbeat: Option<Heartbeat>,
    /// How long a completed request is replayed.
    #[arg(long, value_name = "DURATION", default_value = "24h", value_parser = parse_duration)]
    pub(crate) ttl: Duration,
    /// SQLite only: how long a request waits for the database's write lock — to take its
    /// key's record, to write its charge, to store its response — before it is answered `503`
    /// with `Retry-After` (its key free for the retry).
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
    pub(crate) busy_timeout: Duration,
    /// SQLite only: connections in the pool. Every keyed request holds one for its
    /// transaction from the moment its record is taken until its response is stored, whether
    /// or not it writes; size it for the keyed requests in flight. (PostgreSQL and MySQL
    /// pools have 16.)
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub(crate) max_connections: u32,
    /// PostgreSQL and MySQL: connections the idempotency store keeps for keyed requests
    /// (their record reads and transactions), without the two pings sqlx's pool sends per
    /// use; size it for the keyed requests in flight. 0: every request on the pool (16).
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub(crate) held_connections: u32,
    /// Threads serving requests (default: one per core).
    #[arg(long, value_name = "N")]
    pub(crate) worker_threads: Option<usize>,
    /// Honour test-only request headers (`X-Test-Sleep-Ms`: sleep inside the transaction
    /// after writing the charge; `X-Test-Work-Ms`: sleep before writing it, as a call to
    /// another service would). Never in production.
    #[arg(long, hide = true)]
    pub(crate) test_hooks: bool,
    /// Benchmark baselines: `bare` serves the same routes without the idempotency layer (the
    /// handler commits its own transaction); `static` also skips the database and answers a
    /// fixed charge (the HTTP floor).
    #[arg(long, hide = true, value_enum, default_value_t = Mode::Idempotent)]
    pub(crate) mode: Mode,
}

/// The database and ledger URLs may hold passwords: shown through
/// [`idem_redact::redact_url`].
impl std::fmt::Debug for ServeArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeArgs")
            .field("listen", &self.listen)
            .field("database", &idem_redact::redact_url(&self.database))
            .field(
                "ledger",
                &self.ledger.as_deref().map(idem_redact::redact_url),
            )
            .field("emit", &self.emit)
            .field(
                "broker",
                &self.broker.as_deref().map(idem_redact::redact_url),
            )
            .field("relay_name", &self.relay_name)
            .field(
                "card_processor",
                &self.card_processor.as_deref().map(idem_redact::redact_url),
            )
            .field("completer_interval", &self.completer_interval)
            .field("completer_max_attempts", &self.completer_max_attempts)
            .field("completer_abandon_status", &self.completer_abandon_status)
            .field("lease", &self.lease)
            .field("heartbeat", &self.heartbeat)
            .field("ttl", &self.ttl)
            .field("busy_timeout", &self.busy_timeout)
            .field("max_connections", &self.max_connections)
            .field("held_connections", &self.held_connections)
            .field("worker_threads", &self.worker_threads)
            .field("test_hooks", &self.test_hooks)
            .field("mode", &self.mode)
            .finish()
    }
}

impl ServeArgs {
    /// The in-process completer's settings; `None` with `--completer-interval off`.
    pub(crate) fn completer(&self) -> Option<processor::CompleterArgs> {
        let Heartbeat::Every(interval) = self.completer_interval else {
            return None;
        };
        Some(processor::CompleterArgs {
            interval,
            max_attempts: self.completer_max_attempts.max(1),
            abandon_status: axum::http::StatusCode::from_u16(self.completer_abandon_status)
                .unwrap_or(axum::http::StatusCode::BAD_GATEWAY),
        })
    }
}

/// Whether requests go through the idempotency layer (benchmark baselines do not).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Mode {
    /// Through the layer: the service as shipped.
    Idempotent,
    /// Without the layer, same handler and database.
    Bare,
    /// Without the layer and without the database.
    Static,
}

/// The lease heartbeat setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Heartbeat {
    /// Renew every so often.
    Every(Duration),
    /// Never renew.
    Off,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    idem_core::parse_duration(s).map_err(|e| e.to_string())
}

fn parse_heartbeat(s: &str) -> Result<Heartbeat, String> {
    if s.eq_ignore_ascii_case("off") {
        Ok(Heartbeat::Off)
    } else {
        parse_duration(s).map(Heartbeat::Every)
    }
}

fn main() {
    let cli = Cli::parse();
    // One line per request is at debug; the bench would otherwise measure logging.
    let default_level = if matches!(cli.command, Some(Command::Bench(_))) {
        "warn"
    } else {
        "info,sqlx=warn"
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_level.into()),
        )
        .with_target(false)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .compact()
        .init();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    if let Some(n) = cli.serve.worker_threads.filter(|_| cli.command.is_none()) {
        runtime.worker_threads(n.max(1));
    }
    let runtime = match runtime.build() {
        Ok(rt) => rt,
        Err(e) => exit_with(anyhow::Error::from(e).context("cannot start the async runtime")),
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Some(Command::Bench(args)) => bench::run(args).await,
            None => stores::serve(cli.serve).await,
        }
    });
    if let Err(e) = result {
        exit_with(e);
    }
}

fn exit_with(e: anyhow::Error) -> ! {
    // Drivers often repeat their cause inside their own message; print each cause once.
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !line.contains(&text) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&text);
        }
    }
    eprintln!("error: {line}");
    std::process::exit(2);
}
