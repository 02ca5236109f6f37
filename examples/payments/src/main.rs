//! `payments`: charges accounts from `PaymentRequested` messages, exactly once per message, on
//! any broker idem supports and any of its SQL databases. A service to copy.
//!
//! ```text
//! payments --broker nats://127.0.0.1:4222 --source payments --database sqlite:payments.db --metrics 127.0.0.1:9464
//! payments publish --broker nats://127.0.0.1:4222 --source payments --id pay-1 '{"account":"alice","amount_cents":1250}'
//! ```
//!
//! Each message `{"account": "...", "amount_cents": N}` carries a producer-set ID in the
//! broker's ID slot; the charge row, the balance update and the claim commit together. A
//! redelivery is acknowledged as a duplicate; a conflicting, undecodable or ID-less message goes
//! to the dead-letter destination with its reason. SIGTERM stops gracefully.

mod bench;
mod brokers;
mod charge_batch;
mod ledger;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use idem_consumer::{CancellationToken, Consumer, Handler, Json, RunStats, SetHandler, Source};
use idem_core::{BatchClaimStore, ErrorKind, Migrate, Processor, TransactionalStore};
use idem_sql::{AnyStore, MySqlStore, PostgresStore, SqliteStore, TableName};

use crate::brokers::BrokerUrl;
use crate::charge_batch::ChargeBatch;
use crate::ledger::{Charge, PaymentRequested};

#[derive(Debug, Parser)]
#[command(
    name = "payments",
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
    /// Publish one PaymentRequested message with a stable ID (for trying the service out).
    Publish(PublishArgs),
    /// Delete the broker-side objects for --source (streams, queues, topics, sessions): for
    /// tests and benches on shared brokers.
    #[command(hide = true)]
    Teardown(TeardownArgs),
    /// Measure broker-to-committed-effect throughput next to the broker's own consume-and-ack
    /// rate, in one run.
    Bench(BenchArgs),
}

#[derive(Debug, Args)]
struct TeardownArgs {
    #[command(flatten)]
    endpoint: Endpoint,
    #[arg(long, default_value = "payments")]
    consumer: String,
    #[arg(long)]
    instance: Option<String>,
}

#[derive(Debug, Args)]
struct BenchArgs {
    #[command(flatten)]
    endpoint: Endpoint,
    /// Database URL for the idem leg.
    #[arg(long, value_name = "URL", default_value = "sqlite:payments-bench.db")]
    database: String,
    /// Backlog size per leg.
    #[arg(long, default_value_t = 20_000)]
    messages: usize,
    /// Messages processed at once in the idem leg.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Messages per transaction in the idem leg.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Charge each batch with the set handler (two statements per batch).
    #[arg(long)]
    set: bool,
    /// Print one Markdown table row.
    #[arg(long)]
    markdown: bool,
}

#[derive(Debug, Args)]
struct Endpoint {
    /// Broker URL: nats://, amqp://, kafka://host:port, redis://, mqtt://
    #[arg(long, value_name = "URL")]
    broker: Option<String>,
    /// Stream (NATS, Redis), queue (RabbitMQ) or topic (Kafka, MQTT) to consume from.
    #[arg(long, value_name = "NAME", default_value = "payments")]
    source: String,
}

#[derive(Debug, Args)]
struct ServeArgs {
    #[command(flatten)]
    endpoint: Endpoint,
    /// Database URL: sqlite:PATH, postgres://…, mysql://…
    #[arg(long, value_name = "URL", default_value = "sqlite:payments.db")]
    database: String,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
    /// Consumer name: the claim namespace, consumer group and durable name.
    #[arg(long, default_value = "payments")]
    consumer: String,
    /// This instance's name, where the broker needs one per process (Redis Streams consumer,
    /// MQTT client ID): unique per replica, the same across restarts of one replica (a
    /// StatefulSet pod name, say). Defaults to the host name.
    #[arg(long)]
    instance: Option<String>,
    /// Keep claims this long (e.g. 7d, 36h); must outlast the broker's redelivery window.
    #[arg(long, value_name = "DURATION", default_value = "7d", value_parser = parse_duration)]
    keep_claims_for: std::time::Duration,
    /// The broker's longest redelivery window: how late a redelivery can arrive.
    #[arg(long, value_name = "DURATION", default_value = "7d", value_parser = parse_duration)]
    redelivery_window: std::time::Duration,
    /// Messages processed at once.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Messages per transaction, where the broker hands out batches (1 = one per transaction).
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Charge each batch with the set handler: every charge row in one insert and every
    /// balance in one upsert, instead of two statements per message. A batch that fails is
    /// processed again message by message, so one bad payment is dead-lettered alone.
    #[arg(long)]
    set: bool,
    /// How soon a message a dead consumer held goes to another one: NATS's ack wait, the idle
    /// time after which Redis Streams entries are claimed, Kafka's session timeout. RabbitMQ
    /// and MQTT redeliver as soon as the connection drops. Unset: the broker's default.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    redeliver_after: Option<std::time::Duration>,
}

#[derive(Debug, Args)]
struct PublishArgs {
    #[command(flatten)]
    endpoint: Endpoint,
    /// The message ID. Publishing the same ID twice is a redelivery, not a second charge.
    #[arg(long)]
    id: String,
    /// The JSON body, e.g. '{"account":"alice","amount_cents":1250}'.
    payload: String,
}

fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    idem_core::parse_duration(s).map_err(|e| e.to_string())
}

/// The host name, the default instance name.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "payments-1".to_owned())
}

/// How often the service prunes claims older than the retention.
const PRUNE_EVERY: std::time::Duration = std::time::Duration::from_secs(3600);

/// What a serve run needs besides the broker and the store.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) source: String,
    pub(crate) consumer: String,
    pub(crate) instance: String,
    concurrency: usize,
    batch: usize,
    /// `--set`: the set handler per batch.
    set: bool,
    /// How long claims are kept, checked against the redelivery window.
    retention: idem_core::Retention,
    /// `--redeliver-after`.
    pub(crate) redeliver_after: Option<std::time::Duration>,
    shutdown: CancellationToken,
}

fn main() {
    let cli = Cli::parse();
    // The service logs one line per outcome; the bench would mostly measure that logging.
    let default_level = if matches!(cli.command, Some(Command::Bench(_))) {
        "warn"
    } else {
        "info,sqlx=warn,lapin=warn,async_nats=warn,rdkafka=warn"
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
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => exit_with(anyhow::Error::from(e).context("cannot start the async runtime")),
    };
    if let Err(e) = runtime.block_on(run(cli)) {
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

async fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Some(Command::Publish(p)) => {
            let broker = BrokerUrl::parse(p.endpoint.broker.as_deref())?;
            let note =
                brokers::publish(&broker, &p.endpoint.source, &p.id, p.payload.as_bytes()).await?;
            println!(
                "published {} to {} {}",
                p.id,
                broker.redacted(),
                p.endpoint.source
            );
            if let Some(note) = note {
                println!("note: {note}");
            }
            Ok(())
        }
        Some(Command::Teardown(t)) => {
            let broker = BrokerUrl::parse(t.endpoint.broker.as_deref())?;
            let settings = Settings {
                source: t.endpoint.source,
                consumer: t.consumer,
                instance: t.instance.unwrap_or_else(host_name),
                concurrency: 1,
                batch: 1,
                set: false,
                retention: idem_core::Retention::default(),
                redeliver_after: None,
                shutdown: CancellationToken::new(),
            };
            brokers::teardown(&broker, &settings).await
        }
        Some(Command::Bench(b)) => {
            let broker = BrokerUrl::parse(b.endpoint.broker.as_deref())?;
            let settings = Settings {
                source: b.endpoint.source,
                consumer: "payments-bench".to_owned(),
                instance: format!("bench-{}", std::process::id()),
                concurrency: b.concurrency,
                batch: b.batch,
                set: b.set,
                retention: idem_core::Retention::default(),
                redeliver_after: None,
                shutdown: CancellationToken::new(),
            };
            let r = bench::run(&broker, &settings, &b.database, b.messages).await?;
            let scheme = broker.redacted();
            let scheme = scheme.split("://").next().unwrap_or_default();
            let db = b.database.split(':').next().unwrap_or_default();
            if b.markdown {
                println!(
                    "| {scheme} | {db} | {} | {} | {}{} | {:.0} | {:.0} | {:.0} | {:.0} | {:.3} | {:.2} | {:.2} |",
                    b.messages,
                    b.concurrency,
                    b.batch,
                    if b.set { " set" } else { "" },
                    r.raw,
                    r.idem,
                    r.ceiling,
                    r.bare,
                    r.idem / r.raw,
                    r.idem / r.ceiling,
                    r.idem / r.bare
                );
            } else {
                println!(
                    "{scheme}: broker consume+ack {:.0} msg/s; idem + {db} {:.0} msg/s end to end ({:.3}× the broker), {:.0} msg/s from the in-memory fake ({:.2}× of that), bare handler without claim {:.0} msg/s ({:.2}× of that DB ceiling); {} messages, concurrency {}, batch {}{}",
                    r.raw,
                    r.idem,
                    r.idem / r.raw,
                    r.ceiling,
                    r.idem / r.ceiling,
                    r.bare,
                    r.idem / r.bare,
                    b.messages,
                    b.concurrency,
                    b.batch,
                    if b.set { ", set handler" } else { "" }
                );
            }
            Ok(())
        }
        None => serve(cli.serve).await,
    }
}

async fn serve(args: ServeArgs) -> Result<()> {
    let broker = BrokerUrl::parse(args.endpoint.broker.as_deref())?;
    // A fault-injection run (idem-chaos) arms a crash point; a typo must not go unnoticed.
    if let Some(at) = idem_consumer::crash::from_env().map_err(anyhow::Error::msg)? {
        tracing::info!(crash_at = %at, "crash point armed: this process aborts there");
    }
    if let Some(addr) = args.metrics {
        idem_consumer::metrics::serve_prometheus(addr)?;
        tracing::info!(%addr, "serving Prometheus metrics at /metrics");
    }
    let settings = Settings {
        source: args.endpoint.source,
        consumer: args.consumer,
        instance: args.instance.unwrap_or_else(host_name),
        concurrency: args.concurrency,
        batch: args.batch,
        set: args.set,
        retention: idem_core::Retention::new(args.keep_claims_for, args.redelivery_window)?,
        redeliver_after: args.redeliver_after,
        shutdown: idem_consumer::shutdown::on_signal(),
    };
    let Some(db) = Database::open_when_up(&args.database, &settings.shutdown).await? else {
        tracing::info!("stopped before the database came up");
        return Ok(());
    };
    tracing::info!(broker = %broker.redacted(), source = %settings.source, database = %idem_core::redact_url(&args.database), "starting");
    let stats = brokers::serve(&broker, &settings, db).await?;
    tracing::info!(
        processed = stats.processed,
        duplicates = stats.duplicates,
        dead_lettered = stats.dead_lettered,
        "stopped"
    );
    Ok(())
}

/// Whether opening the database failed for want of it (unreachable, restarting, read-only,
/// a connection cut mid-statement) rather than from a mistake that waiting cannot mend.
fn outage(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<idem_core::Error>()
            .is_some_and(idem_core::Error::is_outage)
    })
}

/// The service's own DDL failed: classified by the store like any statement on it, so an
/// outage at start is told apart from a schema the database refuses.
fn ddl_error<S: TransactionalStore>(store: &S, e: sqlx::Error) -> anyhow::Error {
    let kind = store.classify(&e).unwrap_or(ErrorKind::InvalidConfig);
    idem_core::Error::new(kind, format!("creating the service's tables: {e}"))
        .with_source(e)
        .into()
}

/// The database, opened and migrated: claims table plus the service's own tables. Which
/// engine a `--database` URL means is `AnyStore`'s decision, the one place idem maps schemes;
/// this keeps the typed store each engine's `Processor` needs.
#[derive(Debug, Clone)]
pub(crate) enum Database {
    Sqlite(SqliteStore),
    Postgres(PostgresStore),
    MySql(MySqlStore),
}

impl Database {
    /// [`Database::open`], waiting out an outage: a replica started while the database
    /// restarts, fails over or drops connections waits for it (as the runner waits for a
    /// broker) instead of exiting into its supervisor's crash-loop back-off. A
    /// misconfiguration (bad URL, no such database, refused credentials) still exits at once.
    /// `None` when `shutdown` came first: a stop while waiting is a clean stop.
    async fn open_when_up(url: &str, shutdown: &CancellationToken) -> Result<Option<Self>> {
        let mut wait = std::time::Duration::from_millis(100);
        let mut waiting = false;
        loop {
            let e = match Self::open(url).await {
                Ok(db) => {
                    if waiting {
                        tracing::info!("database reachable again");
                    }
                    return Ok(Some(db));
                }
                Err(e) if outage(&e) => e,
                Err(e) => return Err(e),
            };
            if waiting {
                tracing::debug!(error = %format!("{e:#}"), retry_in = ?wait, "database still unavailable");
            } else {
                tracing::warn!(error = %format!("{e:#}"), database = %idem_core::redact_url(url), "database unavailable at start; waiting for it");
                waiting = true;
            }
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(None),
                _ = tokio::time::sleep(wait) => {}
            }
            wait = (wait * 2).min(std::time::Duration::from_secs(5));
        }
    }

    async fn open(url: &str) -> Result<Self> {
        let store = AnyStore::connect_or_create(url, TableName::default()).await?;
        store.migrate().await?;
        Ok(match store {
            AnyStore::Sqlite(s) => {
                ledger::create_sqlite(s.pool())
                    .await
                    .map_err(|e| ddl_error(&s, e))?;
                Database::Sqlite(s)
            }
            AnyStore::Postgres(s) => {
                ledger::create_postgres(s.pool())
                    .await
                    .map_err(|e| ddl_error(&s, e))?;
                Database::Postgres(s)
            }
            AnyStore::MySql(s) => {
                ledger::create_mysql(s.pool())
                    .await
                    .map_err(|e| ddl_error(&s, e))?;
                Database::MySql(s)
            }
            other => anyhow::bail!("this build of payments has no {} support", other.engine()),
        })
    }

    /// Consumes `source` into this database until shutdown.
    pub(crate) async fn consume<Src: Source>(
        self,
        source: Src,
        settings: &Settings,
    ) -> Result<RunStats> {
        match self {
            Database::Sqlite(store) => consume(store, source, settings).await,
            Database::Postgres(store) => {
                // Connections held for the consumer's transactions: no pool pings per message.
                let store = store.hold_connections(workers(settings));
                consume(store, source, settings).await
            }
            Database::MySql(store) => consume(store, source, settings).await,
        }
    }
}

async fn consume<S, Src>(store: S, source: Src, settings: &Settings) -> Result<RunStats>
where
    S: BatchClaimStore + idem_core::Prune + Send + Sync + 'static,
    S::Tx: Send,
    Src: Source,
    Charge: Handler<S::Tx, PaymentRequested>,
    ChargeBatch: SetHandler<S::Tx, PaymentRequested>,
{
    let processor = Processor::builder(store, settings.consumer.as_str())
        .retention(settings.retention)
        .build()?;
    let processor = Arc::new(processor);
    let pruner = tokio::spawn(idem_consumer::prune_periodically(
        processor.clone(),
        PRUNE_EVERY,
        settings.shutdown.clone(),
    ));
    let consumer = Consumer::new(processor, source).concurrency(settings.concurrency);
    let stats = run_consumer(
        consumer,
        settings.batch,
        settings.set,
        settings.shutdown.clone(),
    )
    .await;
    pruner.abort();
    Ok(stats?)
}

/// Connections a PostgreSQL consumer holds for its transactions (`hold_connections`): one
/// per message or batch in flight, so no transaction waits for one or pays sqlx's pool pings.
pub(crate) fn workers(settings: &Settings) -> u32 {
    u32::try_from(settings.concurrency).unwrap_or(u32::MAX)
}

/// Runs `consumer` in the mode `--batch` and `--set` choose: per message, batches with
/// `Charge` per message, or batches with `ChargeBatch` per batch.
pub(crate) async fn run_consumer<S, Src>(
    consumer: Consumer<S, Src>,
    batch: usize,
    set: bool,
    shutdown: CancellationToken,
) -> Result<RunStats, idem_core::Error>
where
    S: BatchClaimStore + Send + Sync + 'static,
    S::Tx: Send,
    Src: Source,
    Charge: Handler<S::Tx, PaymentRequested>,
    ChargeBatch: SetHandler<S::Tx, PaymentRequested>,
{
    let json = Json::<PaymentRequested>::new();
    if set {
        consumer
            .batch(batch)
            .run_set(json, ChargeBatch, shutdown)
            .await
    } else if batch > 1 {
        consumer.batch(batch).run(json, Charge, shutdown).await
    } else {
        consumer.run(json, Charge, shutdown).await
    }
}
