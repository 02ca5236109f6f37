//! `payments bench`: broker-to-committed-effect throughput, next to the same broker's own
//! consume-and-ack rate, measured in one run on one backlog size.
//!
//! The broker and idem legs consume a pre-published backlog of `--messages` messages through the
//! same adapter source, so the difference is exactly what idem and the database add: decode,
//! claim, charge row, balance update and commit per message. The bare consumer ([`bare`])
//! drains a backlog of its own with the broker's client and sqlx, the same writes and no claim:
//! the pipeline idem is compared with. Publishing is not timed.

mod bare;
pub(crate) mod cpu;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use idem_consumer::{CancellationToken, Consumer, Delivery, Handler, SetHandler, Source};
use idem_core::{BatchClaimStore, Fingerprint, Message, MessageId, Processor, TransactionalStore};

use idem_any::{Broker, BrokerUrl, WithSource};

use crate::brokers;
use crate::charge_batch::ChargeBatch;
use crate::ledger::{Charge, PaymentRequested};
use crate::{Database, Settings};

/// What one bench run measured.
#[derive(Debug, Clone)]
pub(crate) struct Rates {
    /// The broker's own consume-and-ack rate through the adapter, nothing else.
    pub(crate) raw: f64,
    /// Broker to committed effect without idem ([`bare`]): the broker's own client, the same
    /// writes in the same transactions, acked after commit, no claim. `None` where the bench
    /// has none (MQTT, or a database other than PostgreSQL).
    pub(crate) consumer: Option<f64>,
    /// Broker to committed effect through idem.
    pub(crate) idem: f64,
    /// The same consumer over the in-memory fake broker: what the database allows idem when
    /// the broker costs nothing.
    pub(crate) ceiling: f64,
    /// The DB ceiling: the same handler in the same transactions (per message, or per batch
    /// with `--batch`, set-based with `--set`) and the same number of workers, with no claim
    /// and no broker — what a hand-written consumer could at best reach.
    pub(crate) bare: f64,
    /// With `--cpu-split`: each leg's CPU per process.
    pub(crate) cpu: Vec<(&'static str, cpu::Split)>,
}

/// How often the bare legs run a transaction a deadlock rolled back.
const DEADLOCK_ATTEMPTS: u32 = 5;

/// Runs `unit` (one transaction of a bare leg) until it commits: again after a deadlock rolled
/// it back, at most [`DEADLOCK_ATTEMPTS`] times in all, as idem's runner retries it.
async fn until_committed<F, Fut>(mut unit: F) -> Result<(), idem_core::BoxError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), idem_core::BoxError>>,
{
    let mut attempt = 1;
    loop {
        match unit().await {
            Err(e) if attempt < DEADLOCK_ATTEMPTS && deadlocked(e.as_ref()) => attempt += 1,
            done => return done,
        }
    }
}

/// Whether `e` (or an error it wraps) is PostgreSQL's or MySQL's deadlock or serialization
/// failure: the bare legs retry those, as idem's runner does (`ErrorKind::Transient`).
fn deadlocked(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(e) = cause {
        if let Some(sqlx::Error::Database(db)) = e.downcast_ref::<sqlx::Error>() {
            return matches!(
                db.code().as_deref(),
                Some("40P01" | "40001" | "1213" | "1205")
            );
        }
        if let Some(idem) = e.downcast_ref::<idem_core::Error>() {
            return idem.is_retryable();
        }
        cause = e.source();
    }
    false
}

fn backlog(prefix: &str, n: usize) -> Vec<(String, Vec<u8>)> {
    (0..n)
        .map(|i| {
            (
                format!("{prefix}-{i}"),
                format!(
                    r#"{{"account":"acct-{}","amount_cents":{}}}"#,
                    i % 1000,
                    100 + i % 50
                )
                .into_bytes(),
            )
        })
        .collect()
}

/// Opens the source once and closes it, so the subscription exists before the backlog is
/// published (an MQTT broker keeps nothing for a topic nobody subscribes to).
struct Subscribe;

impl WithSource for Subscribe {
    type Output = Result<()>;

    async fn run<Src: Source>(self, src: Src) -> Result<()> {
        src.close().await?;
        Ok(())
    }
}

/// Drains `n` deliveries and acknowledges each, no processing: the broker's own rate.
struct DrainAndAck {
    n: usize,
}

impl WithSource for DrainAndAck {
    type Output = Result<Duration>;

    async fn run<Src: Source>(self, mut src: Src) -> Result<Duration> {
        let started = Instant::now();
        let mut acked = 0;
        while acked < self.n {
            let batch = tokio::time::timeout(Duration::from_secs(30), src.next(256))
                .await
                .context("the raw leg stalled for 30 s")??;
            if batch.is_empty() {
                anyhow::bail!("the source ended after {acked} of {} messages", self.n);
            }
            acked += batch.len();
            // Acks in flight together, as the runner's concurrent tasks would send them.
            for r in futures_util::future::join_all(batch.into_iter().map(|d| d.ack())).await {
                r?;
            }
        }
        let elapsed = started.elapsed();
        src.close().await?;
        Ok(elapsed)
    }
}

/// Runs idem's consumer with the real `Charge` handler until `n` messages committed.
struct Idem<'a> {
    db: Database,
    settings: &'a Settings,
    n: u64,
}

impl WithSource for Idem<'_> {
    type Output = Result<Duration>;

    async fn run<Src: Source>(self, src: Src) -> Result<Duration> {
        match self.db {
            Database::Sqlite(s) => timed(s, src, self.settings, self.n).await,
            Database::Postgres(s) => {
                let s = s.hold_connections(crate::workers(self.settings));
                timed(s, src, self.settings, self.n).await
            }
            Database::MySql(s) => timed(s, src, self.settings, self.n).await,
        }
    }
}

async fn timed<S, Src>(store: S, src: Src, settings: &Settings, n: u64) -> Result<Duration>
where
    S: BatchClaimStore + Send + Sync + 'static,
    S::Tx: Send,
    Src: Source,
    Charge<S>: Handler<S::Tx, PaymentRequested>,
    ChargeBatch<S>: SetHandler<S::Tx, PaymentRequested>,
{
    let processor = Arc::new(Processor::builder(store, settings.consumer.as_str()).build()?);
    let consumer = Consumer::new(processor, src).concurrency(settings.concurrency);
    let observer = consumer.observer();
    let stop = CancellationToken::new();
    let started = Instant::now();
    let run = tokio::spawn(crate::run_consumer(
        consumer,
        crate::database::Handlers::<S>::plain(),
        settings.batch,
        settings.set,
        stop.clone(),
    ));
    let mut last = (0, Instant::now());
    loop {
        let s = observer.snapshot();
        if s.processed >= n {
            break;
        }
        if s.processed + s.duplicates + s.dead_lettered != last.0 {
            last = (s.processed + s.duplicates + s.dead_lettered, Instant::now());
        } else if last.1.elapsed() > Duration::from_secs(30) {
            stop.cancel();
            anyhow::bail!("the idem leg stalled at {s:?}");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = started.elapsed();
    stop.cancel();
    let stats = run.await.context("consumer task")??;
    anyhow::ensure!(
        stats.dead_lettered == 0,
        "bench messages were dead-lettered: {stats:?}"
    );
    Ok(elapsed)
}

/// Publishes a backlog of `n` messages per broker leg and measures every leg; with `cpu`,
/// also which process spends each leg's CPU.
pub(crate) async fn run(
    broker: &BrokerUrl,
    settings: &Settings,
    database: &str,
    n: usize,
    cpu: bool,
) -> Result<Rates> {
    let pg_port = url::Url::parse(database)
        .ok()
        .and_then(|u| u.port())
        .unwrap_or(5432);
    let mut splits = Vec::new();
    let watch = || cpu.then(|| cpu::Watch::start(broker.broker(), pg_port));
    let mut record = |leg: &'static str, w: Option<cpu::Watch>| {
        if let Some(w) = w {
            splits.push((leg, w.stop()));
        }
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let tag = format!("{}-{nanos}", std::process::id());
    let raw_source = format!("{}-raw-{tag}", settings.source);
    let idem_source = format!("{}-idem-{tag}", settings.source);
    let bare_source = format!("{}-bare-{tag}", settings.source);

    // One instance name per leg: on MQTT the name is the client ID, hence the session. And
    // one consumer (group) per leg and run: a Kafka group the raw leg's static member just
    // left would hold the idem leg's join until that member's session timed out.
    let raw_settings = Settings {
        source: raw_source.clone(),
        consumer: format!("{}-raw-{tag}", settings.consumer),
        instance: format!("{}-raw", settings.instance),
        ..settings.clone()
    };
    let idem_settings = Settings {
        source: idem_source.clone(),
        consumer: format!("{}-idem-{tag}", settings.consumer),
        instance: format!("{}-idem", settings.instance),
        ..settings.clone()
    };
    let bare_settings = Settings {
        source: bare_source.clone(),
        consumer: format!("{}-bare-{tag}", settings.consumer),
        instance: format!("{}-bare", settings.instance),
        ..settings.clone()
    };
    // The bare consumer writes to PostgreSQL with sqlx directly, and reads no MQTT.
    let with_bare = database.starts_with("postgres") && broker.broker() != Broker::Mqtt;
    brokers::with_source(broker, &raw_settings, Subscribe).await?;
    brokers::with_source(broker, &idem_settings, Subscribe).await?;

    let backlogs = if with_bare { 3 } else { 2 };
    eprintln!(
        "bench: publishing {backlogs} × {n} messages to {}",
        broker.redacted()
    );
    // IDs unique to this run: claims from an earlier run must not turn these into duplicates.
    brokers::publish_many(broker, &raw_source, &backlog(&format!("raw-{tag}"), n)).await?;
    brokers::publish_many(broker, &idem_source, &backlog(&format!("idem-{tag}"), n)).await?;
    if with_bare {
        let msgs = backlog(&format!("consumer-{tag}"), n);
        brokers::publish_many(broker, &bare_source, &msgs).await?;
    }

    let w = watch();
    let raw = brokers::with_source(broker, &raw_settings, DrainAndAck { n }).await?;
    record("broker consume+ack", w);

    let db = Database::open(database).await?;
    let w = watch();
    let idem = brokers::with_source(
        broker,
        &idem_settings,
        Idem {
            db,
            settings: &idem_settings,
            n: n as u64,
        },
    )
    .await?;
    record("idem end to end", w);

    // Right after the idem leg, on the same tables: the two legs the verdict compares.
    let consumer = if with_bare {
        let plan = bare::Plan {
            messages: n,
            concurrency: settings.concurrency,
            batch: settings.batch,
            set: settings.set,
        };
        let w = watch();
        let group = bare_settings.consumer.as_str();
        let took = bare::run(broker, &bare_source, group, database, plan).await?;
        record("bare consumer", w);
        took
    } else {
        None
    };

    let fake = idem_consumer::InMemoryBroker::new();
    for (id, payload) in backlog(&format!("ceiling-{tag}"), n) {
        fake.publish(&[("message-id", id.as_bytes())], payload);
    }
    let db = Database::open(database).await?;
    let w = watch();
    let ceiling = Idem {
        db,
        settings: &idem_settings,
        n: n as u64,
    }
    .run(fake.source())
    .await?;
    record("idem from memory", w);

    let db = Database::open(database).await?;
    let msgs = backlog(&format!("bare-{tag}"), n);
    let w = watch();
    let bare = db.bare(&idem_settings, &msgs).await?;
    record("bare handler, no broker", w);

    brokers::teardown(broker, &raw_settings).await?;
    brokers::teardown(broker, &idem_settings).await?;
    if with_bare {
        brokers::teardown(broker, &bare_settings).await?;
    }

    let rates = Rates {
        raw: n as f64 / raw.as_secs_f64(),
        consumer: consumer.map(|d| n as f64 / d.as_secs_f64()),
        idem: n as f64 / idem.as_secs_f64(),
        ceiling: n as f64 / ceiling.as_secs_f64(),
        bare: n as f64 / bare.as_secs_f64(),
        cpu: splits,
    };
    Ok(rates)
}

impl Database {
    /// Times [`Rates::bare`] over `backlog`: decoded up front, then `concurrency` workers each
    /// taking the next message (or `--batch` of them) and committing its effects with
    /// `Charge` (or `ChargeBatch` with `--set`) in a transaction of the store's own, no claim.
    async fn bare(self, settings: &Settings, backlog: &[(String, Vec<u8>)]) -> Result<Duration> {
        let msgs = backlog
            .iter()
            .map(|(id, payload)| {
                let payment: PaymentRequested = serde_json::from_slice(payload)?;
                let id = MessageId::new(id.as_str())?;
                Ok(Message::with_fingerprint(
                    id,
                    Fingerprint::of(payload),
                    payment,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        match self {
            Database::Sqlite(s) => bare_leg(s, settings, msgs).await,
            Database::Postgres(s) => {
                let s = s.hold_connections(crate::workers(settings));
                bare_leg(s, settings, msgs).await
            }
            Database::MySql(s) => bare_leg(s, settings, msgs).await,
        }
    }
}

async fn bare_leg<S>(
    store: S,
    settings: &Settings,
    msgs: Vec<Message<PaymentRequested>>,
) -> Result<Duration>
where
    S: TransactionalStore + Clone + 'static,
    S::Tx: Send,
    Charge<S>: Handler<S::Tx, PaymentRequested, Output = ()>,
    ChargeBatch<S>: SetHandler<S::Tx, PaymentRequested, Output = ()>,
{
    let msgs = Arc::new(msgs);
    let next = Arc::new(AtomicUsize::new(0));
    let per_tx = settings.batch.max(1);
    let set = settings.set;
    let started = Instant::now();
    let workers: Vec<_> = (0..settings.concurrency.max(1))
        .map(|_| {
            let (store, msgs, next) = (store.clone(), msgs.clone(), next.clone());
            tokio::spawn(async move {
                loop {
                    let from = next.fetch_add(per_tx, Ordering::Relaxed);
                    if from >= msgs.len() {
                        return Ok::<_, anyhow::Error>(());
                    }
                    let chunk = &msgs[from..(from + per_tx).min(msgs.len())];
                    // A deadlock between two transactions' account updates rolls one back.
                    if let Err(e) = until_committed(|| charge_unit(&store, set, chunk)).await {
                        anyhow::bail!("the bare leg's handler failed: {e}");
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.await.context("bare worker")??;
    }
    Ok(started.elapsed())
}

/// `chunk`'s effect in one transaction of `store`'s, committed.
async fn charge_unit<S>(
    store: &S,
    set: bool,
    chunk: &[Message<PaymentRequested>],
) -> Result<(), idem_core::BoxError>
where
    S: TransactionalStore,
    Charge<S>: Handler<S::Tx, PaymentRequested, Output = ()>,
    ChargeBatch<S>: SetHandler<S::Tx, PaymentRequested, Output = ()>,
{
    let mut tx = store.begin().await?;
    let done = if set {
        let refs: Vec<&Message<PaymentRequested>> = chunk.iter().collect();
        ChargeBatch::<S>::plain().handle_set(&mut tx, &refs).await
    } else {
        let mut r = Ok(());
        for m in chunk {
            r = Charge::<S>::plain().handle(&mut tx, m).await;
            if r.is_err() {
                break;
            }
        }
        r
    };
    match done {
        Ok(()) => Ok(store.commit(tx).await?),
        Err(e) => {
            let _ = store.rollback(tx).await;
            Err(e)
        }
    }
}
