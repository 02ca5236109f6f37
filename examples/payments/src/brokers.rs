//! The service's broker side over idem-any, the one place idem maps broker URLs to adapters:
//! `--broker` parsing, the source the consume loop and the bench read, publishing, teardown.
//! `--source NAME` names the stream, queue or topic; what the service needs on the broker is
//! created by idem-any, idempotently, before consuming or publishing.

use anyhow::{Result, bail};
use idem_any::{AnyProducer, BrokerUrl, SourceSpec, WithSource};
use idem_consumer::{RunStats, Source};

use crate::{Database, Settings};

/// How many publishes are in flight at once in `publish_many` (bench backlogs).
const PUBLISH_CONCURRENCY: usize = 64;

/// Reads `--broker`.
pub(crate) fn parse(url: Option<&str>) -> Result<BrokerUrl> {
    let Some(url) = url else {
        bail!("--broker is required: one of {}", idem_any::SCHEMES);
    };
    Ok(BrokerUrl::parse(url)?)
}

/// The source `settings` describe.
fn spec(settings: &Settings) -> SourceSpec {
    // Room for every batch in flight: with AMQP's default prefetch (64) a `--batch 100`
    // consumer would never see a full batch.
    let in_flight = settings
        .batch
        .max(1)
        .saturating_mul(settings.concurrency.max(1));
    let spec = SourceSpec::new(
        settings.source.as_str(),
        settings.consumer.as_str(),
        settings.instance.as_str(),
    )
    .in_flight(in_flight)
    .static_membership(settings.static_membership);
    match settings.redeliver_after {
        Some(d) => spec.redeliver_after(d),
        None => spec,
    }
}

/// Creates what the service needs on `broker` and hands `job` a source for `settings.source`.
pub(crate) async fn with_source<T, J>(broker: &BrokerUrl, settings: &Settings, job: J) -> Result<T>
where
    J: WithSource<Output = Result<T>>,
{
    broker.with_source(&spec(settings), job).await?
}

/// The service: consume into the database until shutdown.
struct Serve<'a> {
    db: Database,
    settings: &'a Settings,
}

impl WithSource for Serve<'_> {
    type Output = Result<RunStats>;
    async fn run<Src: Source>(self, source: Src) -> Result<RunStats> {
        self.db.consume(source, self.settings).await
    }
}

pub(crate) async fn serve(
    broker: &BrokerUrl,
    settings: &Settings,
    db: Database,
) -> Result<RunStats> {
    with_source(broker, settings, Serve { db, settings }).await
}

/// A producer for `source`, after creating what publishing to it needs.
async fn producer(broker: &BrokerUrl, source: &str) -> Result<AnyProducer> {
    broker.ensure_destination(source).await?;
    let client_id = format!("payments-publisher-{}", std::process::id());
    // Refuse to publish into the void: on MQTT, with no subscriber (the service has not
    // started yet, so its session does not exist) the broker would drop the message.
    Ok(AnyProducer::connect(broker, &client_id)
        .await?
        .require_subscriber(true))
}

/// Publishes one message with `id` in the broker's ID slot. Returns a note when the broker
/// itself dropped it: JetStream discards a repeated `Nats-Msg-Id` inside the stream's
/// duplicate window (two minutes by default), before any consumer sees it.
pub(crate) async fn publish(
    broker: &BrokerUrl,
    source: &str,
    id: &str,
    payload: &[u8],
) -> Result<Option<&'static str>> {
    let published = producer(broker, source)
        .await?
        .publish(source, id, payload)
        .await?;
    Ok(published.duplicate.then_some(
        "JetStream dropped it: the same Nats-Msg-Id was published within the stream's duplicate window",
    ))
}

/// Publishes many messages over one connection, each confirmed by the broker.
pub(crate) async fn publish_many(
    broker: &BrokerUrl,
    source: &str,
    msgs: &[(String, Vec<u8>)],
) -> Result<()> {
    producer(broker, source)
        .await?
        .publish_all(source, msgs, PUBLISH_CONCURRENCY)
        .await?;
    Ok(())
}

/// Removes what `with_source` created for `settings.source`: streams, queues, topics, the
/// consumer's sessions and their messages, dead letters included. For tests and benches on
/// shared brokers (`payments teardown`), never part of a service's life.
pub(crate) async fn teardown(broker: &BrokerUrl, settings: &Settings) -> Result<()> {
    Ok(broker.teardown(&spec(settings)).await?)
}
