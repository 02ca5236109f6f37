//! The bare consumer of `payments bench`: the pipeline idem's end-to-end rate is compared with.
//!
//! What a service without idem writes with its broker's own client (async-nats, lapin, redis,
//! rdkafka) and sqlx: fetch, the same effect in one transaction per message or per batch (the
//! very statements of `Charge`, or of `ChargeBatch` with `--set`), commit, then acknowledge.
//! No claim, and none of idem's decoder, runner or adapters: the difference to the idem leg is
//! exactly what idem costs. Same backlog size, concurrency and batch size as the idem leg, and
//! like it, the connections are kept (no ping before each transaction).
//!
//! Without a claim a redelivery charges twice: that is what idem's share of the cost buys.
//! PostgreSQL only, the database of the committed end-to-end table.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use futures_util::{FutureExt, Stream, StreamExt};
use idem_any::{Broker, BrokerUrl};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use crate::charge_batch::charge_set_postgres;
use crate::ledger::{PaymentRequested, charge_postgres};

/// How long the bare consumer waits for a message before it calls the leg stalled.
const STALL: Duration = Duration::from_secs(30);
/// The AMQP prefetch floor, as idem-any sets it for the idem leg (idem-amqp's default).
const MIN_PREFETCH: usize = 64;

/// The idem leg's shape, for the bare leg.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Plan {
    /// The backlog already published: the leg ends when all of it is committed and acked.
    pub(crate) messages: usize,
    /// Transactions in flight at once.
    pub(crate) concurrency: usize,
    /// Messages per transaction; 1 is per-message mode.
    pub(crate) batch: usize,
    /// `--set`: the set-based statements per batch, else the per-message ones.
    pub(crate) set: bool,
}

impl Plan {
    /// Messages held unacknowledged at once, at most: what the broker may push ahead.
    fn in_flight(&self) -> usize {
        self.batch.max(1) * self.concurrency.max(1)
    }
}

/// Times the bare consumer over the backlog in `name` (a JetStream stream, an AMQP queue, a
/// Redis stream or a Kafka topic) into the PostgreSQL database `database`, as `group` (its
/// durable consumer, queue consumer tag or consumer group: one per run, never shared with
/// another leg). `None` on MQTT, where the bench has no bare consumer.
pub(crate) async fn run(
    broker: &BrokerUrl,
    name: &str,
    group: &str,
    database: &str,
    plan: Plan,
) -> Result<Option<Duration>> {
    let address = broker.address();
    let took = match broker.broker() {
        Broker::Nats => {
            let nats = Nats::connect(address, name, group, plan).await?;
            drive(nats, database, plan).await?
        }
        Broker::Amqp => {
            let amqp = Amqp::connect(address, name, group, plan).await?;
            drive(amqp, database, plan).await?
        }
        Broker::RedisStreams => {
            let redis = Redis::connect(address, name, group).await?;
            drive(redis, database, plan).await?
        }
        Broker::Kafka => drive(Kafka::connect(address, name, group)?, database, plan).await?,
        // MQTT, and any family a later idem-any adds.
        _ => return Ok(None),
    };
    Ok(Some(took))
}

/// One message as the bare consumer reads it.
struct Row {
    id: String,
    payment: PaymentRequested,
}

impl Row {
    fn decode(id: Option<&[u8]>, payload: &[u8]) -> Result<Row> {
        let id = id.context("a bench message without an ID")?;
        Ok(Row {
            id: String::from_utf8(id.to_vec())?,
            payment: serde_json::from_slice(payload)?,
        })
    }
}

/// A broker as the bare consumer uses it: fetch, read, acknowledge.
trait Fetch {
    /// A fetched message, with what acknowledges it.
    type Item: Send + 'static;

    /// Up to `max` messages; waits for the first, takes the others only if already there.
    async fn fetch(&mut self, max: usize) -> Result<Vec<Self::Item>>;

    /// The message's ID and payload.
    fn row(item: &Self::Item) -> Result<Row>;

    /// Acknowledges `items` (after their transaction committed).
    fn ack(&self, items: Vec<Self::Item>) -> impl Future<Output = Result<()>> + Send + 'static;
}

/// Fetch → a free worker's transaction → commit → ack, until the backlog is drained.
async fn drive<F: Fetch>(mut source: F, database: &str, plan: Plan) -> Result<Duration> {
    let mut workers = Workers::connect(database, plan).await?;
    // Per-message mode fetches what the free workers can take, and gives each message its own
    // transaction; batch mode fetches a batch per free worker.
    let (want, per_tx) = if plan.batch > 1 {
        (plan.batch, plan.batch)
    } else {
        (plan.concurrency.max(1), 1)
    };
    let started = Instant::now();
    let mut fetched = 0;
    while fetched < plan.messages {
        let mut permit = Some(workers.free().await?);
        let items = tokio::time::timeout(STALL, source.fetch(want.min(plan.messages - fetched)))
            .await
            .with_context(|| format!("the bare consumer stalled after {fetched} messages"))??;
        fetched += items.len();
        let mut items = items.into_iter().peekable();
        while items.peek().is_some() {
            let unit: Vec<F::Item> = items.by_ref().take(per_tx).collect();
            let permit = match permit.take() {
                Some(p) => p,
                None => workers.free().await?,
            };
            let rows = unit.iter().map(F::row).collect::<Result<Vec<_>>>()?;
            workers.spawn(permit, rows, source.ack(unit))?;
        }
    }
    workers.finish().await?;
    Ok(started.elapsed())
}

/// `concurrency` transactions at once on as many connections.
struct Workers {
    pool: PgPool,
    set: bool,
    permits: Arc<Semaphore>,
    tasks: JoinSet<Result<()>>,
}

impl Workers {
    async fn connect(database: &str, plan: Plan) -> Result<Workers> {
        let n = u32::try_from(plan.concurrency.max(1))?;
        // sqlx pings a pooled connection before handing it out by default: a round trip per
        // transaction that idem's held connections do not pay, so this pool does not either.
        let pool = PgPoolOptions::new()
            .max_connections(n)
            .min_connections(n)
            .test_before_acquire(false)
            .connect(database)
            .await
            .context("connecting the bare consumer to PostgreSQL")?;
        Ok(Workers {
            pool,
            set: plan.set,
            permits: Arc::new(Semaphore::new(plan.concurrency.max(1))),
            tasks: JoinSet::new(),
        })
    }

    /// Waits for a free worker.
    async fn free(&self) -> Result<OwnedSemaphorePermit> {
        Ok(self.permits.clone().acquire_owned().await?)
    }

    /// Commits `rows`' effect in one transaction, then runs `ack`, on the worker `permit` holds.
    fn spawn(
        &mut self,
        permit: OwnedSemaphorePermit,
        rows: Vec<Row>,
        ack: impl Future<Output = Result<()>> + Send + 'static,
    ) -> Result<()> {
        while let Some(done) = self.tasks.try_join_next() {
            done.context("bare consumer task")??;
        }
        let (pool, set) = (self.pool.clone(), self.set);
        self.tasks.spawn(async move {
            // A deadlock between two transactions' account updates rolls one back.
            super::until_committed(|| charge(&pool, set, &rows))
                .await
                .map_err(|e| anyhow!(e))?;
            ack.await?;
            drop(permit);
            Ok(())
        });
        Ok(())
    }

    /// Waits for every transaction and ack.
    async fn finish(mut self) -> Result<()> {
        while let Some(done) = self.tasks.join_next().await {
            done.context("bare consumer task")??;
        }
        Ok(())
    }
}

/// `rows`' effect, committed in one transaction.
async fn charge(pool: &PgPool, set: bool, rows: &[Row]) -> Result<(), idem_core::BoxError> {
    let mut tx = pool.begin().await?;
    if set {
        let ids = rows.iter().map(|r| r.id.clone()).collect();
        let payments: Vec<&PaymentRequested> = rows.iter().map(|r| &r.payment).collect();
        charge_set_postgres(&mut tx, ids, &payments).await?;
    } else {
        for r in rows {
            charge_postgres(&mut tx, r.id.clone(), &r.payment).await?;
        }
    }
    tx.commit().await?;
    Ok(())
}

/// The first item of `stream`, then up to `max` in all of what has already arrived.
async fn take_ready<S, T, E>(stream: &mut S, max: usize) -> Result<Vec<T>>
where
    S: Stream<Item = Result<T, E>> + Unpin,
    E: std::error::Error + Send + Sync + 'static,
{
    let first = stream
        .next()
        .await
        .context("the consumer's stream ended")??;
    let mut out = vec![first];
    while out.len() < max {
        match stream.next().now_or_never() {
            Some(Some(item)) => out.push(item?),
            Some(None) | None => break,
        }
    }
    Ok(out)
}

/// NATS JetStream: a durable pull consumer read as async-nats's stream of messages (it keeps
/// pull requests for `in_flight` messages open), single acks.
struct Nats {
    messages: async_nats::jetstream::consumer::pull::Stream,
}

impl Nats {
    async fn connect(url: &str, stream: &str, group: &str, plan: Plan) -> Result<Nats> {
        use async_nats::jetstream::consumer::{AckPolicy, pull};
        let js = async_nats::jetstream::new(async_nats::connect(url).await?);
        let consumer = js
            .create_consumer_on_stream(
                pull::Config {
                    durable_name: Some(group.to_owned()),
                    ack_policy: AckPolicy::Explicit,
                    ..Default::default()
                },
                stream,
            )
            .await?;
        let messages = consumer
            .stream()
            .max_messages_per_batch(plan.in_flight())
            .messages()
            .await?;
        Ok(Nats { messages })
    }
}

impl Fetch for Nats {
    type Item = async_nats::jetstream::Message;

    async fn fetch(&mut self, max: usize) -> Result<Vec<Self::Item>> {
        take_ready(&mut self.messages, max).await
    }

    fn row(m: &Self::Item) -> Result<Row> {
        let id = m
            .headers
            .as_ref()
            .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
            .map(|v| v.as_str().as_bytes());
        Row::decode(id, &m.payload)
    }

    // Not `async fn`: the future is spawned, so it must not borrow the source.
    #[allow(clippy::manual_async_fn)]
    fn ack(&self, items: Vec<Self::Item>) -> impl Future<Output = Result<()>> + Send + 'static {
        async move {
            for m in items {
                m.ack().await.map_err(|e| anyhow!(e))?;
            }
            Ok(())
        }
    }
}

/// RabbitMQ: one channel with a prefetch of `in_flight`, manual acks one by one.
struct Amqp {
    consumer: lapin::Consumer,
    /// Kept open for the consumer's life.
    _connection: lapin::Connection,
}

impl Amqp {
    async fn connect(url: &str, queue: &str, group: &str, plan: Plan) -> Result<Amqp> {
        use lapin::options::{BasicConsumeOptions, BasicQosOptions};
        use lapin::types::FieldTable;
        let connection = lapin::Connection::connect(url, Default::default()).await?;
        let channel = connection.create_channel().await?;
        let prefetch = u16::try_from(plan.in_flight().max(MIN_PREFETCH)).unwrap_or(u16::MAX);
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await?;
        let consumer = channel
            .basic_consume(
                queue.into(),
                group.into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok(Amqp {
            consumer,
            _connection: connection,
        })
    }
}

impl Fetch for Amqp {
    type Item = lapin::message::Delivery;

    async fn fetch(&mut self, max: usize) -> Result<Vec<Self::Item>> {
        take_ready(&mut self.consumer, max).await
    }

    fn row(d: &Self::Item) -> Result<Row> {
        let id = d
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str().as_bytes());
        Row::decode(id, &d.data)
    }

    // Not `async fn`: the future is spawned, so it must not borrow the source.
    #[allow(clippy::manual_async_fn)]
    fn ack(&self, items: Vec<Self::Item>) -> impl Future<Output = Result<()>> + Send + 'static {
        async move {
            for d in items {
                d.acker.ack(Default::default()).await?;
            }
            Ok(())
        }
    }
}

/// Redis Streams: `XREADGROUP` on a connection of its own (it blocks), one `XACK` for all of a
/// transaction's entries on another.
struct Redis {
    reader: redis::aio::MultiplexedConnection,
    acker: redis::aio::MultiplexedConnection,
    stream: Arc<str>,
    group: Arc<str>,
}

impl Redis {
    async fn connect(url: &str, stream: &str, group: &str) -> Result<Redis> {
        let client = redis::Client::open(url)?;
        let config = redis::AsyncConnectionConfig::new()
            .set_response_timeout(Some(STALL + Duration::from_secs(5)));
        let mut reader = client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        let acker = client.get_multiplexed_async_connection().await?;
        let created: redis::RedisResult<()> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(stream)
            .arg(group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut reader)
            .await;
        if let Err(e) = created
            && e.code() != Some("BUSYGROUP")
        {
            return Err(e.into());
        }
        Ok(Redis {
            reader,
            acker,
            stream: stream.into(),
            group: group.into(),
        })
    }
}

impl Fetch for Redis {
    type Item = redis::streams::StreamId;

    async fn fetch(&mut self, max: usize) -> Result<Vec<Self::Item>> {
        loop {
            let reply: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg(&*self.group)
                .arg("bare-1")
                .arg("COUNT")
                .arg(max)
                .arg("BLOCK")
                .arg(1000)
                .arg("STREAMS")
                .arg(&*self.stream)
                .arg(">")
                .query_async(&mut self.reader)
                .await?;
            let entries: Vec<_> = reply.keys.into_iter().flat_map(|k| k.ids).collect();
            if !entries.is_empty() {
                return Ok(entries);
            }
        }
    }

    fn row(e: &Self::Item) -> Result<Row> {
        let id: Option<Vec<u8>> = e.get("message_id");
        let payload: Vec<u8> = e.get("payload").context("an entry without a payload")?;
        Row::decode(id.as_deref(), &payload)
    }

    fn ack(&self, items: Vec<Self::Item>) -> impl Future<Output = Result<()>> + Send + 'static {
        let (mut conn, stream) = (self.acker.clone(), self.stream.clone());
        let group = self.group.clone();
        async move {
            let mut xack = redis::cmd("XACK");
            xack.arg(&*stream).arg(&*group);
            for e in &items {
                xack.arg(&e.id);
            }
            let _: i64 = xack.query_async(&mut conn).await?;
            Ok(())
        }
    }
}

/// Kafka: a group member that stores each transaction's next offsets after its commit;
/// librdkafka commits what is stored every 5 s and on close.
///
/// With transactions in flight together a later batch may store its offset before an earlier
/// one commits, so a crash could skip the earlier one: one more thing idem's settled-offset
/// tracking handles. The bench never crashes, so the simple version is the baseline.
struct Kafka {
    consumer: Arc<rdkafka::consumer::StreamConsumer>,
}

impl Kafka {
    fn connect(brokers: &str, topic: &str, group: &str) -> Result<Kafka> {
        use rdkafka::consumer::Consumer;
        let consumer: rdkafka::consumer::StreamConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", group)
            .set("enable.auto.commit", "true")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .create()?;
        consumer.subscribe(&[topic])?;
        Ok(Kafka {
            consumer: Arc::new(consumer),
        })
    }
}

impl Fetch for Kafka {
    type Item = rdkafka::message::OwnedMessage;

    async fn fetch(&mut self, max: usize) -> Result<Vec<Self::Item>> {
        let first = self.consumer.recv().await?.detach();
        let mut out = vec![first];
        while out.len() < max {
            match self.consumer.recv().now_or_never() {
                Some(m) => out.push(m?.detach()),
                None => break,
            }
        }
        Ok(out)
    }

    fn row(m: &Self::Item) -> Result<Row> {
        use rdkafka::message::{Headers, Message};
        let id = m
            .headers()
            .and_then(|h| h.iter().find(|h| h.key == "message-id"))
            .and_then(|h| h.value);
        Row::decode(id, m.payload().unwrap_or_default())
    }

    fn ack(&self, items: Vec<Self::Item>) -> impl Future<Output = Result<()>> + Send + 'static {
        let consumer = self.consumer.clone();
        async move {
            use rdkafka::consumer::Consumer;
            use rdkafka::message::Message;
            let mut next = std::collections::BTreeMap::new();
            for m in &items {
                let at = next
                    .entry((m.topic().to_owned(), m.partition()))
                    .or_insert(0);
                *at = (m.offset() + 1).max(*at);
            }
            for ((topic, partition), offset) in next {
                consumer.store_offset(&topic, partition, offset)?;
            }
            Ok(())
        }
    }
}
