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
//!
//! With `--card-processor URL` each payment is charged at a card processor (a foreign phase,
//! its derived key as `Idempotency-Key`) and then recorded with the processor's charge ID (a
//! local phase): recovery points resumed by the redelivery or the in-process completer after
//! a crash (see `card`).

mod bench;
mod brokers;
mod card;
mod charge_batch;
mod cli;
mod database;
mod ledger;
mod receipts;

use anyhow::Result;
use clap::Parser;
use idem_consumer::CancellationToken;

use crate::cli::{Cli, Command, ServeArgs, host_name};
pub(crate) use crate::database::{Database, run_consumer, workers};

/// `--emit NAME`: the destination, on the broker the service consumes from.
#[derive(Debug, Clone)]
pub(crate) struct Emitting {
    pub(crate) destination: String,
    pub(crate) broker: idem_any::BrokerUrl,
    /// Relay the outbox in this process (not with `--no-relay`).
    pub(crate) relay: bool,
}

/// What a serve run needs besides the broker and the store.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) source: String,
    pub(crate) consumer: String,
    pub(crate) instance: String,
    pub(crate) concurrency: usize,
    pub(crate) batch: usize,
    /// `--set`: the set handler per batch.
    pub(crate) set: bool,
    /// How long claims are kept, checked against the redelivery window.
    pub(crate) retention: idem_core::Retention,
    /// `--local-cache`: entries of the consumer's local cache of committed claims.
    pub(crate) local_cache: Option<u64>,
    /// `--redeliver-after`.
    pub(crate) redeliver_after: Option<std::time::Duration>,
    /// Kafka: join as the static member `instance` (not `--dynamic-membership`).
    pub(crate) static_membership: bool,
    /// `--emit`: where each charge's `PaymentCharged` event goes.
    pub(crate) emit: Option<Emitting>,
    /// `--receipts`: record `PaymentCharged` events instead of charging.
    pub(crate) receipts: bool,
    /// `--card-processor`: charge through a card processor, as recovery points.
    pub(crate) card: Option<CardSettings>,
    pub(crate) shutdown: CancellationToken,
}

/// `--card-processor URL` and its options.
#[derive(Debug, Clone)]
pub(crate) struct CardSettings {
    /// The processor's base URL (may hold credentials; logged only redacted).
    pub(crate) url: String,
    /// `--phase-lease`.
    pub(crate) lease: std::time::Duration,
    /// `--test-pause-after-charge`.
    pub(crate) pause_after_charge: Option<std::time::Duration>,
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
            let broker = brokers::parse(p.endpoint.broker.as_deref())?;
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
            let broker = brokers::parse(t.endpoint.broker.as_deref())?;
            let settings = Settings {
                source: t.endpoint.source,
                consumer: t.consumer,
                instance: t.instance.unwrap_or_else(host_name),
                concurrency: 1,
                batch: 1,
                set: false,
                retention: idem_core::Retention::default(),
                local_cache: None,
                redeliver_after: None,
                static_membership: true,
                emit: None,
                receipts: false,
                card: None,
                shutdown: CancellationToken::new(),
            };
            brokers::teardown(&broker, &settings).await
        }
        Some(Command::Bench(b)) => {
            let broker = brokers::parse(b.endpoint.broker.as_deref())?;
            let settings = Settings {
                source: b.endpoint.source,
                consumer: "payments-bench".to_owned(),
                instance: format!("bench-{}", std::process::id()),
                concurrency: b.concurrency,
                batch: b.batch,
                set: b.set,
                retention: idem_core::Retention::default(),
                local_cache: None,
                redeliver_after: None,
                // Each leg joins once and leaves for good, as the bare consumer does: a static
                // member's join waits for the group's rebalance delay, and on close it keeps
                // its partitions for the session timeout.
                static_membership: false,
                emit: None,
                receipts: false,
                card: None,
                shutdown: CancellationToken::new(),
            };
            let r = bench::run(&broker, &settings, &b.database, b.messages, b.cpu_split).await?;
            let scheme = broker.redacted();
            let scheme = scheme.split("://").next().unwrap_or_default();
            let db = b.database.split(':').next().unwrap_or_default();
            // The bare consumer's column, or why it is empty.
            let consumer = r
                .consumer
                .map_or_else(|| "n/a".to_owned(), |c| format!("{c:.0}"));
            let vs_consumer = r
                .consumer
                .map_or_else(|| "n/a".to_owned(), |c| format!("{:.2}", r.idem / c));
            if b.markdown {
                println!(
                    "| {scheme} | {db} | {} | {} | {}{} | {:.0} | {consumer} | {:.0} | {:.0} | {:.0} | {vs_consumer} | {:.3} | {:.2} | {:.2} |",
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
                    "{scheme}: broker consume+ack {:.0} msg/s; bare consumer (no claim) {consumer} msg/s; idem + {db} {:.0} msg/s end to end ({vs_consumer}× the bare consumer, {:.3}× the broker), {:.0} msg/s from the in-memory fake ({:.2}× of that), bare handler without claim or broker {:.0} msg/s ({:.2}× of that DB ceiling); {} messages, concurrency {}, batch {}{}",
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
            if b.cpu_split {
                println!("{}", bench::cpu::HEADER);
                let mode = format!("{}{}", b.batch, if b.set { " set" } else { "" });
                for (leg, split) in &r.cpu {
                    println!(
                        "{}",
                        split.row(&format!("{leg} ({mode})"), scheme, b.messages)
                    );
                }
            }
            Ok(())
        }
        None => serve(cli.serve).await,
    }
}

async fn serve(args: ServeArgs) -> Result<()> {
    let broker = brokers::parse(args.endpoint.broker.as_deref())?;
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
        local_cache: args.local_cache,
        redeliver_after: args.redeliver_after,
        static_membership: !args.dynamic_membership,
        emit: args.emit.map(|destination| Emitting {
            destination,
            broker: broker.clone(),
            relay: !args.no_relay,
        }),
        receipts: args.receipts,
        card: args.card_processor.map(|url| CardSettings {
            url,
            lease: args.phase_lease,
            pause_after_charge: args.test_pause_after_charge,
        }),
        shutdown: idem_consumer::shutdown::on_signal(),
    };
    let Some(db) = Database::open_when_up(&args.database, &settings.shutdown).await? else {
        tracing::info!("stopped before the database came up");
        return Ok(());
    };
    tracing::info!(broker = %broker.redacted(), source = %settings.source, database = %idem_redact::redact_url(&args.database), "starting");
    let stats = brokers::serve(&broker, &settings, db).await?;
    tracing::info!(
        processed = stats.processed,
        duplicates = stats.duplicates,
        dead_lettered = stats.dead_lettered,
        "stopped"
    );
    Ok(())
}
