//! `idem demo`: a payments consumer on the embedded SQLite store, fed by an at-least-once broker
//! (idem-consumer's in-memory broker) that duplicates, redelivers after a visibility timeout and
//! loses acks as a consumer crashing between commit and ack would — and a ledger that shows,
//! afterwards, whether anybody was charged twice.
//!
//! The pieces: `producer` emits `PaymentRequested` messages; idem's `consumer` is the real
//! runner (`Consumer`) with the charge as its handler, exactly what a service runs on a real
//! broker; `naive` is the hand-written check / charge / mark consumer, with its own rules in
//! `worker`; `ledger` holds the SQL; `report` counts from the database. All randomness comes
//! from `--seed` (`faults`).

mod consumer;
mod faults;
mod ledger;
mod naive;
mod producer;
mod progress;
mod report;
mod worker;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use idem_consumer::{InMemoryBroker, REASON_HEADER, Settled};
use idem_core::{ConsumerName, Migrate, Processor};
use idem_sql::{SqliteOptions, SqliteStore};
use tokio::task::JoinSet;

use faults::CrashPlan;
use producer::Published;
use progress::Progress;
use report::{Counts, Report, RunConfig};
use worker::{Tally, WorkerContext};

/// How long a delivered, unacked message stays invisible. Short, so a crashed delivery comes
/// back within the run; long compared to one charge, so a healthy worker always acks in time.
const VISIBILITY_TIMEOUT: Duration = Duration::from_millis(250);

/// SQLite has one writer at a time; more connections than workers buys nothing.
const MAX_CONNECTIONS: u32 = 16;

/// Upper bounds that keep a typo from exhausting memory (the demo holds every message).
const MAX_WORKERS: usize = 1024;
const MAX_MESSAGES: usize = 10_000_000;

/// Options of `idem demo`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
A producer emits PaymentRequested messages with stable IDs into an in-process broker that
behaves at-least-once: some messages are published twice, unacked deliveries come back after a
visibility timeout, and some acks are lost, as when a consumer \"crashes\" after committing,
before acking. idem's real consumer (the runner services use on Kafka, NATS, RabbitMQ, Redis
or MQTT) charges accounts in an SQLite ledger; its processor commits the claim together with
the charge. --naive runs the same traffic through check / charge / mark in three
transactions, and shows the double charges that causes.

The report is counted from the database afterwards. Check it yourself:
  sqlite3 idem-demo.db \"SELECT message_id, count(*) FROM charges GROUP BY 1 HAVING count(*) > 1\"")]
pub(crate) struct DemoArgs {
    /// SQLite file for the ledger and the claims, kept after the run. Each run first recreates
    /// the demo's own tables and deletes its claims, so reruns start clean.
    ///
    /// Recreated: charges, accounts, payment_requests, dead_letters, naive_processed. Claims of
    /// other consumers in the same file are left alone.
    #[arg(long, value_name = "PATH", default_value = "idem-demo.db")]
    db: PathBuf,
    /// Messages the producer emits (1 to 10000000).
    #[arg(long, value_name = "N", default_value_t = 1000)]
    messages: usize,
    /// Concurrent workers (1 to 1024).
    #[arg(long, value_name = "N", default_value_t = 4)]
    workers: usize,
    /// Seed for every random choice (payments, duplicate publishes, crashes): same seed, same
    /// traffic and faults.
    #[arg(long, value_name = "N", default_value_t = 42)]
    seed: u64,
    /// Probability (0..=1) that the producer publishes a message twice.
    #[arg(long, value_name = "F", default_value_t = 0.2)]
    duplicate_rate: f64,
    /// Probability (0..=1) that a delivery's consumer crashes after its commit and before its
    /// ack (idem: the broker loses the ack; --naive: the worker stops after the charge).
    #[arg(long, value_name = "F", default_value_t = 0.05)]
    crash_rate: f64,
    /// Use the classic non-idempotent consumer instead: check, charge and mark processed in
    /// three separate transactions.
    #[arg(long)]
    naive: bool,
    /// Print one JSON object on stdout instead of the human report.
    #[arg(long)]
    json: bool,
}

impl DemoArgs {
    fn validate(&self) -> anyhow::Result<()> {
        for (flag, rate) in [
            ("--duplicate-rate", self.duplicate_rate),
            ("--crash-rate", self.crash_rate),
        ] {
            // Also refuses NaN, which `contains` never matches.
            if !(0.0..=1.0).contains(&rate) {
                bail!("{flag} must be a probability between 0 and 1, got {rate}");
            }
        }
        if !(1..=MAX_WORKERS).contains(&self.workers) {
            bail!(
                "--workers must be between 1 and {MAX_WORKERS}, got {}",
                self.workers
            );
        }
        if !(1..=MAX_MESSAGES).contains(&self.messages) {
            bail!(
                "--messages must be between 1 and {MAX_MESSAGES}, got {}",
                self.messages
            );
        }
        Ok(())
    }

    fn config(&self) -> RunConfig {
        RunConfig {
            naive: self.naive,
            seed: self.seed,
            workers: self.workers,
            messages: self.messages,
            duplicate_rate: self.duplicate_rate,
            crash_rate: self.crash_rate,
        }
    }
}

/// Runs the demo and prints its report.
pub(crate) async fn run(args: DemoArgs) -> anyhow::Result<()> {
    args.validate()?;
    let started = Instant::now();
    let connections = u32::try_from(args.workers.saturating_add(1))
        .unwrap_or(MAX_CONNECTIONS)
        .min(MAX_CONNECTIONS);
    let store = SqliteStore::open(
        &args.db,
        SqliteOptions::default().max_connections(connections),
    )
    .await
    .with_context(|| format!("opening the demo ledger {}", args.db.display()))?;
    store.migrate().await.context("creating the claims table")?;
    ledger::reset(&store, &ConsumerName::new(consumer::CONSUMER)?).await?;

    let requests = producer::payment_requests(args.messages, args.seed)?;
    ledger::record_requests(&store, &requests).await?;

    let crashes = CrashPlan::new(args.seed, args.crash_rate);
    let broker = InMemoryBroker::new().visibility_timeout(VISIBILITY_TIMEOUT);
    // idem's consumer is the real runner, so its crash between commit and ack is the broker
    // losing the ack; the naive consumer crashes at the same point of its own code.
    let broker = if args.naive {
        broker
    } else {
        broker.lose_acks(move |seq, attempt| {
            crashes.crashes_after_commit(usize::try_from(seq).unwrap_or(usize::MAX), attempt)
        })
    };
    let progress = Progress::start(broker.clone());

    let producer = tokio::spawn({
        let broker = broker.clone();
        let (rate, seed) = (args.duplicate_rate, args.seed);
        async move { producer::publish_all(&broker, &requests, rate, seed).await }
    });

    let counts = if args.naive {
        let tally = Arc::new(Tally::default());
        let ctx = WorkerContext {
            broker: broker.clone(),
            store: store.clone(),
            crashes,
            tally: Arc::clone(&tally),
        };
        let mut workers = JoinSet::new();
        for _ in 0..args.workers {
            workers.spawn(naive::run(ctx.clone()));
        }
        // The workers return once the broker is closed and every copy settled; the first
        // failure is what the run reports (the others then run out of work or fail alike).
        let mut failure: Option<anyhow::Error> = None;
        while let Some(joined) = workers.join_next().await {
            let result = joined
                .map_err(anyhow::Error::from)
                .and_then(|r| r)
                .context("a demo worker failed");
            if let Err(e) = result {
                workers.abort_all();
                failure.get_or_insert(e);
            }
        }
        if let Some(e) = failure {
            progress.finish();
            return Err(e);
        }
        Counts {
            simulated_crashes: Tally::get(&tally.crashes),
            duplicates_skipped: Tally::get(&tally.duplicates_skipped),
            retries: Tally::get(&tally.retries),
            ..Counts::default()
        }
    } else {
        let processor = Arc::new(Processor::builder(store.clone(), consumer::CONSUMER).build()?);
        let run = consumer::run(&broker, processor, args.workers).await;
        let stats = match run {
            Ok(stats) => stats,
            Err(e) => {
                progress.finish();
                return Err(e.context("idem's consumer stopped"));
            }
        };
        Counts {
            simulated_crashes: broker.stats().lost_acks,
            duplicates_skipped: stats.duplicates,
            conflicts: stats.conflicts,
            retries: stats.retries,
            ..Counts::default()
        }
    };
    // What the broker saw, the same for both consumers.
    let b = broker.stats();
    let counts = Counts {
        deliveries: b.published + b.redelivered,
        redeliveries: b.redelivered,
        visibility_timeouts: b.expired,
        late_acks: b.refused,
        ..counts
    };
    let published = producer.await.context("the demo producer failed")?;
    progress.finish();
    if !args.naive {
        record_dead_letters(&store, &broker, &published).await?;
    }

    let audit = ledger::audit(store.pool()).await?;
    let report = Report::new(
        args.config(),
        published.duplicates,
        counts,
        audit,
        started.elapsed(),
        &args.db,
    );
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.to_text());
    }
    store.pool().close().await;
    if !args.naive && !report.exactly_once {
        // The whole point of the toolkit failed: say so loudly, and fail the command.
        bail!(
            "idem's consumer did not charge every payment exactly once: {}",
            report.verdict()
        );
    }
    Ok(())
}

/// The runner dead-letters to the broker, as on a real one; the demo keeps them in its ledger's
/// `dead_letters` table too, so the report and `sqlite3` see them where the naive consumer's
/// go.
async fn record_dead_letters(
    store: &SqliteStore,
    broker: &InMemoryBroker,
    published: &Published,
) -> anyhow::Result<()> {
    for (seq, payload, how) in broker.settled() {
        let Settled::DeadLettered(headers) = how else {
            continue;
        };
        let field = |name: &str| {
            headers
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.as_str())
                .unwrap_or_default()
        };
        let reason = format!(
            "{}: {}",
            field(REASON_HEADER),
            field(idem_consumer::DETAIL_HEADER)
        );
        let id = published
            .copy(seq)
            .map(|e| e.id.as_str())
            .unwrap_or_default();
        ledger::dead_letter(store.pool(), id, &payload, &reason).await?;
    }
    Ok(())
}
