//! `idem relay`: publishes the outbox of a SQL store through a broker until SIGINT/SIGTERM,
//! with idem-relay's defaults for everything the flags do not set.

use std::time::Duration;

use anyhow::Context;
use idem_any::BrokerUrl;
use idem_core::TableName;
use idem_relay::{BrokerPublisher, Relay, RelayStore};

use idem_core::DEFAULT_OUTBOX_TABLE;

/// Options of `idem relay`.
#[derive(clap::Args)]
pub(crate) struct RelayArgs {
    /// Store URL holding the outbox: sqlite:PATH, postgres://…, mysql://…
    #[arg(long, value_name = "URL")]
    database: String,
    /// Broker URL: nats://…, amqp://…, kafka://host:port, redis://…, mqtt://…
    #[arg(long, value_name = "URL")]
    broker: String,
    /// The relay's name: the lease owner in the outbox, the `relay` label of its metrics, its
    /// MQTT client ID.
    #[arg(long, default_value = "idem-relay")]
    name: String,
    /// Rows leased and published per round.
    #[arg(long, value_name = "N", default_value_t = 100)]
    batch: usize,
    /// Publishes in flight at once, across every round.
    #[arg(long, value_name = "N", default_value_t = 16)]
    concurrency: usize,
    /// Rounds in flight at once (1 to 16): the next batch is leased while earlier ones
    /// publish. Each round leases under an owner of its own (NAME, NAME#1, …); rows held by a
    /// slot a restarted relay with a smaller pipeline does not have wait out their lease.
    #[arg(long, value_name = "N", default_value_t = 2)]
    pipeline: usize,
    /// How often to look for rows at the latest. On PostgreSQL the relay also wakes on each
    /// commit that enqueued (LISTEN/NOTIFY); notifications are not durable, so this stays the
    /// floor.
    #[arg(long, value_name = "DURATION", value_parser = crate::admin::parse_arg_duration, default_value = "1s")]
    poll: Duration,
    /// Outbox table name.
    #[arg(long, value_name = "NAME", default_value = DEFAULT_OUTBOX_TABLE)]
    outbox_table: String,
}

/// Both URLs may hold a password: shown through [`idem_redact::redact_url`].
impl std::fmt::Debug for RelayArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayArgs")
            .field("database", &idem_redact::redact_url(&self.database))
            .field("broker", &idem_redact::redact_url(&self.broker))
            .field("name", &self.name)
            .field("batch", &self.batch)
            .field("concurrency", &self.concurrency)
            .field("pipeline", &self.pipeline)
            .field("poll", &self.poll)
            .field("outbox_table", &self.outbox_table)
            .finish()
    }
}

pub(crate) async fn relay(args: RelayArgs) -> anyhow::Result<()> {
    // Everything that can be refused without a connection is refused first.
    let settings = Relay::builder(&args.name)
        .batch(args.batch)
        .concurrency(args.concurrency)
        .pipeline(args.pipeline)
        .poll_interval(args.poll)
        .settings()?;
    let broker = BrokerUrl::parse(&args.broker)?;
    let outbox = TableName::new(&args.outbox_table)?;
    // A fault-injection run arms a relay crash point; a typo must not go unnoticed.
    let crash_at = idem_consumer::crash::from_env().map_err(anyhow::Error::msg)?;
    init_logs();
    if let Some(at) = crash_at {
        tracing::info!(crash_at = %at, "crash point armed: this process aborts there");
    }
    tracing::info!(
        relay = settings.name(),
        database = %idem_redact::redact_url(&args.database),
        broker = %broker.redacted(),
        outbox = %outbox,
        "connecting"
    );
    let shown = broker.redacted();
    let publisher = BrokerPublisher::new(broker, settings.name());
    publisher
        .connect()
        .await
        .with_context(|| format!("connecting to the broker {shown}"))?;
    let store = open_store(&args.database, &outbox).await?;
    // PostgreSQL: woken by each commit that enqueued (LISTEN/NOTIFY), polling as the floor.
    let wakeups = store.outbox_wakeups();
    run(store, wakeups, publisher, settings).await
}

/// Runs the relay over any store until a signal, then prints what it did.
async fn run<S: RelayStore + 'static>(
    store: S,
    wakeups: Option<futures_util::stream::BoxStream<'static, ()>>,
    publisher: BrokerPublisher,
    settings: idem_relay::RelaySettings,
) -> anyhow::Result<()> {
    let mut relay = Relay::new(store, publisher, settings);
    if let Some(wakeups) = wakeups {
        relay = relay.wake_on(wakeups);
    }
    let stats = relay.run(idem_consumer::shutdown::on_signal()).await?;
    println!(
        "{} published, {} dead-lettered, {} failed publishes retried, {} store errors waited out",
        stats.published, stats.dead_lettered, stats.failed, stats.store_errors
    );
    Ok(())
}

/// The store holding the outbox at `url`, reading the outbox in `outbox`. The claims table's
/// name does not matter to a relay.
async fn open_store(url: &str, outbox: &TableName) -> anyhow::Result<idem_sql::AnyStore> {
    let store = idem_sql::AnyStore::connect(url, TableName::default())
        .await
        .with_context(|| {
            format!(
                "connecting to the database {}",
                idem_redact::redact_url(url)
            )
        })?
        .with_outbox_table(outbox.clone())?;
    Ok(store)
}

/// `info` and above on stderr unless `RUST_LOG` says otherwise: the relay reports its outages
/// there.
fn init_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only on a terminal: a supervisor's log file gets plain text.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}
