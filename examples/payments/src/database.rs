//! The service's database: opened (waiting out an outage at start), migrated, and consumed
//! into with the processor, the periodic pruner and the mode `--batch`/`--set` choose.

use std::sync::Arc;

use anyhow::Result;
use idem_consumer::{CancellationToken, Consumer, Handler, Json, RunStats, SetHandler, Source};
use idem_core::outbox::{OutboxStore, RelayStore};
use idem_core::{
    BatchClaimStore, ClaimStore, ConsumerName, ErrorKind, Processor, TransactionalStore,
};
use idem_sql::{AnyStore, MySqlStore, PostgresStore, SqliteStore, StoreVisitor, TableName};

use idem_consumer::phased::Phased;
use idem_core::store::RecoveryStore;
use idem_request::{Completer, Idempotency};

use crate::card::{CardCharge, CardProcessor, RecordCharge};
use crate::charge_batch::ChargeBatch;
use crate::ledger::{self, Charge, Emit, PaymentRequested};
use crate::receipts::{PaymentCharged, Receipt};
use crate::{CardSettings, Settings};

/// How often the service prunes claims older than the retention.
const PRUNE_EVERY: std::time::Duration = std::time::Duration::from_secs(3600);

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
/// its visitor hands over the typed store each engine's `Processor` needs, kept here.
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
    pub(crate) async fn open_when_up(
        url: &str,
        shutdown: &CancellationToken,
    ) -> Result<Option<Self>> {
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
                tracing::warn!(error = %format!("{e:#}"), database = %idem_redact::redact_url(url), "database unavailable at start; waiting for it");
                waiting = true;
            }
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(None),
                _ = tokio::time::sleep(wait) => {}
            }
            wait = (wait * 2).min(std::time::Duration::from_secs(5));
        }
    }

    pub(crate) async fn open(url: &str) -> Result<Self> {
        let store = AnyStore::connect_or_create(url, TableName::default()).await?;
        store.migrate().await?;
        store.visit(CreateLedger).await
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

/// The service's own tables next to the claims table, on whichever engine the URL chose.
struct CreateLedger;

impl StoreVisitor for CreateLedger {
    type Output = Result<Database>;

    async fn sqlite(self, s: SqliteStore) -> Result<Database> {
        ledger::create_sqlite(s.pool())
            .await
            .map_err(|e| ddl_error(&s, e))?;
        Ok(Database::Sqlite(s))
    }

    async fn postgres(self, s: PostgresStore) -> Result<Database> {
        ledger::create_postgres(s.pool())
            .await
            .map_err(|e| ddl_error(&s, e))?;
        Ok(Database::Postgres(s))
    }

    async fn mysql(self, s: MySqlStore) -> Result<Database> {
        ledger::create_mysql(s.pool())
            .await
            .map_err(|e| ddl_error(&s, e))?;
        Ok(Database::MySql(s))
    }
}

async fn consume<S, Src>(store: S, source: Src, settings: &Settings) -> Result<RunStats>
where
    S: BatchClaimStore
        + OutboxStore
        + RelayStore
        + idem_core::Prune
        + Clone
        + Send
        + Sync
        + 'static,
    S::Tx: Send,
    Src: Source,
    S: RecoveryStore,
    S::Tx: RecordCharge,
    Charge<S>: Handler<S::Tx, PaymentRequested>,
    ChargeBatch<S>: SetHandler<S::Tx, PaymentRequested>,
    Receipt: Handler<S::Tx, PaymentCharged>,
{
    if settings.receipts {
        return receipts(store, source, settings).await;
    }
    if let Some(card) = &settings.card {
        return card_charges(store, source, settings, card).await;
    }
    let emit = match &settings.emit {
        Some(to) => Some(Emit {
            store: store.clone(),
            consumer: ConsumerName::new(settings.consumer.as_str())?,
            destination: to.destination.clone(),
        }),
        None => None,
    };
    // `--emit`: the relay runs in this process, woken after each commit, and stops after the
    // consumer (rows committed before the stop are published first; any left wait in the
    // outbox for the next start or another replica's relay). `--no-relay`: `idem relay`
    // processes of their own do it.
    let relay_stop = CancellationToken::new();
    let relay = match &settings.emit {
        Some(to) if !to.relay => {
            tracing::info!(destination = %to.destination, "writing PaymentCharged events to the outbox; relayed elsewhere");
            None
        }
        Some(to) => {
            let name = format!("{}-relay-{}", settings.consumer, settings.instance);
            let publisher = idem_relay::BrokerPublisher::new(to.broker.clone(), name.as_str());
            let relay = idem_relay::Relay::builder(name).build(store.clone(), publisher)?;
            let waker = relay.waker();
            tracing::info!(destination = %to.destination, "relaying PaymentCharged events");
            Some((waker, tokio::spawn(relay.run(relay_stop.clone()))))
        }
        None => None,
    };
    let (processor, pruner) = processor_and_pruner(store, settings)?;
    let mut consumer = Consumer::new(processor, source).concurrency(settings.concurrency);
    if let Some(entries) = settings.local_cache {
        consumer = consumer.local_cache(idem_consumer::LocalCache::new(entries));
    }
    if let Some((waker, _)) = &relay {
        let waker = waker.clone();
        consumer = consumer.after_commit(move || waker.wake());
    }
    let stats = run_consumer(
        consumer,
        Handlers {
            one: Charge { emit: emit.clone() },
            set: ChargeBatch { emit },
        },
        settings.batch,
        settings.set,
        settings.shutdown.clone(),
    )
    .await;
    pruner.abort();
    if let Some((_, task)) = relay {
        relay_stop.cancel();
        match task.await {
            Ok(Ok(_)) => {} // the relay logs its own stop, with its counts
            Ok(Err(e)) => tracing::error!(error = %e, "the relay stopped on an error"),
            Err(e) => tracing::error!(error = %e, "the relay task failed"),
        }
    }
    Ok(stats?)
}

/// The consumer's processor, and the task pruning its claims hourly until shutdown.
fn processor_and_pruner<S>(
    store: S,
    settings: &Settings,
) -> Result<(Arc<Processor<S>>, tokio::task::JoinHandle<()>)>
where
    S: ClaimStore + idem_core::Prune + Send + Sync + 'static,
    S::Tx: Send,
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
    Ok((processor, pruner))
}

/// `--receipts`: one receipt per `PaymentCharged` event, one event per transaction.
async fn receipts<S, Src>(store: S, source: Src, settings: &Settings) -> Result<RunStats>
where
    S: BatchClaimStore + idem_core::Prune + Send + Sync + 'static,
    S::Tx: Send,
    Src: Source,
    Receipt: Handler<S::Tx, PaymentCharged>,
{
    let (processor, pruner) = processor_and_pruner(store, settings)?;
    let stats = Consumer::new(processor, source)
        .concurrency(settings.concurrency)
        .run(
            Json::<PaymentCharged>::new(),
            Receipt,
            settings.shutdown.clone(),
        )
        .await;
    pruner.abort();
    Ok(stats?)
}

/// `--card-processor`: each payment charged at the processor and recorded, as recovery
/// points keyed by its message ID, with a completer in this process for charges whose
/// redelivery never comes.
async fn card_charges<S, Src>(
    store: S,
    source: Src,
    settings: &Settings,
    card: &CardSettings,
) -> Result<RunStats>
where
    S: BatchClaimStore + RecoveryStore + idem_core::Prune + Clone + Send + Sync + 'static,
    S::Tx: Send + RecordCharge,
    Src: Source,
{
    if settings.batch > 1 {
        anyhow::bail!(
            "--card-processor charges one message per operation: --batch must be 1 (each phase boundary is its own commit)"
        );
    }
    let handler = CardCharge {
        processor: CardProcessor::new(&card.url)?,
        pause_after_charge: card.pause_after_charge,
    };
    // Records are replayed as long as claims are kept: a redelivery inside the broker's
    // window must find its charge's record, never charge again.
    let idem = Idempotency::builder(store.clone())
        .lease(card.lease)
        .ttl(settings.retention.keep_for())
        .build()?;
    let phased = Phased::new(idem.clone(), &settings.consumer, handler);
    let completer = phased
        .register(Completer::builder(idem).interval(card.lease))
        .build()?;
    let completer_stop = CancellationToken::new();
    let completer_task = tokio::spawn(completer.run(completer_stop.clone()));
    tracing::info!(card_processor = %idem_redact::redact_url(&card.url), lease = ?card.lease, "charging through the card processor, as recovery points");
    let (processor, pruner) = processor_and_pruner(store, settings)?;
    let stats = Consumer::new(processor, source)
        .concurrency(settings.concurrency)
        .run_phased(
            Json::<PaymentRequested>::new(),
            phased,
            settings.shutdown.clone(),
        )
        .await;
    pruner.abort();
    completer_stop.cancel();
    if let Err(e) = completer_task.await {
        tracing::error!(error = %e, "the completer task failed");
    }
    Ok(stats?)
}

/// The handlers a run uses: per message (and per message in batches) and per set.
pub(crate) struct Handlers<S> {
    pub(crate) one: Charge<S>,
    pub(crate) set: ChargeBatch<S>,
}

impl<S> Handlers<S> {
    /// Charges only, no events.
    pub(crate) fn plain() -> Self {
        Self {
            one: Charge::plain(),
            set: ChargeBatch::plain(),
        }
    }
}

/// Connections a PostgreSQL consumer holds for its transactions (`hold_connections`): one
/// per message or batch in flight, so no transaction waits for one or pays sqlx's pool pings.
pub(crate) fn workers(settings: &Settings) -> u32 {
    u32::try_from(settings.concurrency).unwrap_or(u32::MAX)
}

/// Runs `consumer` in the mode `--batch` and `--set` choose: per message, batches with
/// `Charge` per message, or batches with `ChargeBatch` per batch.
pub(crate) async fn run_consumer<S, Src, H: Send + Sync + 'static>(
    consumer: Consumer<S, Src>,
    handlers: Handlers<H>,
    batch: usize,
    set: bool,
    shutdown: CancellationToken,
) -> Result<RunStats, idem_core::Error>
where
    S: BatchClaimStore + Send + Sync + 'static,
    S::Tx: Send,
    Src: Source,
    Charge<H>: Handler<S::Tx, PaymentRequested>,
    ChargeBatch<H>: SetHandler<S::Tx, PaymentRequested>,
{
    let json = Json::<PaymentRequested>::new();
    if set {
        consumer
            .batch(batch)
            .run_set(json, handlers.set, shutdown)
            .await
    } else if batch > 1 {
        consumer
            .batch(batch)
            .run(json, handlers.one, shutdown)
            .await
    } else {
        consumer.run(json, handlers.one, shutdown).await
    }
}
