//! The transactional outbox on PostgreSQL, in a schema of its own (dropped afterwards):
//!
//! - **relay throughput**: a backlog of committed rows relayed by [`Relay`] through an
//!   [`AnyProducer`] until none is unsent, next to the same producer publishing the same
//!   number of messages itself ([`AnyProducer::publish_all`], each confirmed) at the same
//!   concurrency;
//! - **enqueue cost**: P2's set batch with and without one outgoing message per message
//!   enqueued in the batch's transaction;
//! - **commit → confirm latency**: paced writers commit one enqueue each while a relay woken
//!   only by `LISTEN`/`NOTIFY` publishes; per message, from the writer's commit returning to
//!   the broker's confirm returning to the relay.
//!
//! - **lease statements** ([`lease`]): the relay's lease alone, the store's one statement next
//!   to the select + update it replaced, on half-full and full pages.
//! - **table size** ([`size`]): the table's size on disk while writers enqueue at a constant
//!   rate and the relay keeps up.
//!
//! Every measurement gets fresh message IDs, so JetStream's duplicate window never drops a
//! message and every publish is a real one.

mod lease;
mod size;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use idem_any::{AnyProducer, BrokerUrl};
use idem_core::outbox::{Emitter, OutboxStore, Outgoing, RelayStore};
use idem_core::{
    BoxError, ConsumerName, Error, MessageId, Migrate as _, Processor, TransactionalStore,
};
use idem_relay::{CancellationToken, Publish, Relay};
use idem_sql::{PostgresStore, TableName};
use sqlx::postgres::{PgPool, PgPoolOptions};

use super::{Bench, CLAIMS, charge_set, expect_processed};
use crate::measure::{Op, Sample};
use crate::workload::{CONSUMER, Delivery, Ids};
use crate::{Group, Target, Variant, plural};

/// The subject (NATS, with a stream of the same name) or stream key (Redis) relayed to.
const DESTINATION: &str = "idem_bench_outbox";

/// Rows per pre-filling transaction.
const FILL_CHUNK: usize = 1000;

/// A part of the outbox scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Part {
    /// Relay throughput next to the broker's own.
    Drain,
    /// The cost of enqueuing in a set batch.
    Enqueue,
    /// Commit → confirm latency with NOTIFY.
    Latency,
    /// The lease statements side by side.
    Lease,
    /// The table's size at a constant rate (Redis Streams only).
    Size,
}

pub(crate) use size::Args as SizeArgs;

/// What the outbox scenario measures.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    /// Broker URLs to relay to, one table each.
    pub(crate) brokers: Vec<String>,
    /// The parts to run.
    pub(crate) parts: Vec<Part>,
    /// Rows in the backlog the relay drains.
    pub(crate) rows: usize,
    /// Worker counts for the enqueue-cost tables.
    pub(crate) workers: Vec<usize>,
    /// Commits per second in the latency run.
    pub(crate) rate: u32,
    /// How long the latency run's writers write.
    pub(crate) latency_window: Duration,
    /// The relay's rounds in flight in the drain part (its default when `None`).
    pub(crate) pipeline: Option<usize>,
    /// The size part's options.
    pub(crate) size: size::Options,
}

/// The latency runs' results, printed after the tables.
#[derive(Debug, Default)]
pub(crate) struct Report {
    sections: Vec<(String, Vec<String>)>,
}

impl Report {
    pub(crate) fn markdown(&self) -> String {
        let mut out = String::new();
        for (title, lines) in &self.sections {
            let _ = writeln!(out, "\n### {title}\n");
            for l in lines {
                let _ = writeln!(out, "- {l}");
            }
        }
        out
    }

    pub(crate) fn plain(&self) -> String {
        let mut out = String::new();
        for (title, lines) in &self.sections {
            let _ = writeln!(out, "\n{title}");
            for l in lines {
                let _ = writeln!(out, "  · {l}");
            }
        }
        out
    }
}

/// The relay-throughput variants: the broker alone, then the relay at two batch sizes and two
/// concurrencies, with rounds in flight (`--outbox-pipeline`) and one round at a time.
#[derive(Debug, Clone, Copy)]
enum Drain {
    Broker16,
    Broker64,
    Relay100x16,
    Relay500x16,
    Relay100x64,
    Relay500x64,
    Sequential500x16,
    Sequential500x64,
}

impl Drain {
    fn batch(self) -> usize {
        match self {
            Self::Relay500x16
            | Self::Relay500x64
            | Self::Sequential500x16
            | Self::Sequential500x64 => 500,
            _ => 100,
        }
    }

    fn concurrency(self) -> usize {
        match self {
            Self::Broker16 | Self::Relay100x16 | Self::Relay500x16 | Self::Sequential500x16 => 16,
            _ => 64,
        }
    }

    /// One round at a time, whatever `--outbox-pipeline` says.
    fn sequential(self) -> bool {
        matches!(self, Self::Sequential500x16 | Self::Sequential500x64)
    }

    fn is_relay(self) -> bool {
        !matches!(self, Self::Broker16 | Self::Broker64)
    }
}

impl Variant for Drain {
    fn key(self) -> &'static str {
        match self {
            Self::Broker16 => "broker-c16",
            Self::Broker64 => "broker-c64",
            Self::Relay100x16 => "relay-b100-c16",
            Self::Relay500x16 => "relay-b500-c16",
            Self::Relay100x64 => "relay-b100-c64",
            Self::Relay500x64 => "relay-b500-c64",
            Self::Sequential500x16 => "relay-b500-c16-p1",
            Self::Sequential500x64 => "relay-b500-c64-p1",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::Broker16 => "broker alone, `publish_all`, 16 in flight",
            Self::Broker64 => "broker alone, `publish_all`, 64 in flight",
            Self::Relay100x16 => "`Relay`, batch 100, concurrency 16",
            Self::Relay500x16 => "`Relay`, batch 500, concurrency 16",
            Self::Relay100x64 => "`Relay`, batch 100, concurrency 64",
            Self::Relay500x64 => "`Relay`, batch 500, concurrency 64",
            Self::Sequential500x16 => "`Relay`, batch 500, concurrency 16, pipeline 1",
            Self::Sequential500x64 => "`Relay`, batch 500, concurrency 64, pipeline 1",
        }
    }

    fn round_trips(self) -> &'static str {
        if self.is_relay() {
            "1 publish + 1 lease per batch + 1 per mark chunk"
        } else {
            "1 publish"
        }
    }
}

/// The enqueue-cost variants.
#[derive(Debug, Clone, Copy)]
enum Enqueue {
    BareSet,
    IdemSet,
    IdemSetOutbox,
    /// Experimental: the store's enqueue statement run by hand, without the `pg_notify` the
    /// store adds, to tell the notify's cost from the rows'.
    IdemSetOutboxQuiet,
}

impl Variant for Enqueue {
    fn key(self) -> &'static str {
        match self {
            Self::BareSet => "bare-set",
            Self::IdemSet => "idem-set",
            Self::IdemSetOutbox => "idem-set-outbox",
            Self::IdemSetOutboxQuiet => "idem-set-outbox-quiet",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::BareSet => "bare set handler (no claim)",
            Self::IdemSet => "idem `process_batch_set`",
            Self::IdemSetOutbox => "idem `process_batch_set` + enqueue 1 per message",
            Self::IdemSetOutboxQuiet => "the same enqueue INSERT without pg_notify (experimental)",
        }
    }

    fn round_trips(self) -> &'static str {
        match self {
            Self::BareSet => "4 per batch + 2 pings",
            Self::IdemSet => "5 per batch + 2 pings",
            Self::IdemSetOutbox => "5 + 2 (insert, notify) per batch + 2 pings",
            Self::IdemSetOutboxQuiet => "5 + 1 (insert) per batch + 2 pings",
        }
    }
}

impl Bench {
    /// The outbox scenario; needs [`Self::create_tables`] (the enqueue-cost tables run P2's
    /// handler).
    pub(crate) async fn outbox(&self, options: &Options) -> anyhow::Result<(Vec<Group>, Report)> {
        let schema = format!("idem_bench_outbox_{}", std::process::id());
        let result = self.outbox_in(&schema, options).await;
        if let Err(e) = sqlx::raw_sql(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
            .execute(&self.admin)
            .await
        {
            eprintln!("warning: dropping schema {schema}: {e:#}");
        }
        result
    }

    async fn outbox_in(
        &self,
        schema: &str,
        options: &Options,
    ) -> anyhow::Result<(Vec<Group>, Report)> {
        sqlx::raw_sql(&format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
        ))
        .execute(&self.admin)
        .await
        .context("creating the outbox scenario's schema")?;
        let table = TableName::new(&format!("{schema}.outbox"))?;
        PostgresStore::from_pool(self.admin.clone())
            .with_table(TableName::new(&format!("{schema}.claims"))?)?
            .with_outbox_table(table.clone())?
            .migrate()
            .await?;
        let outbox = Outbox {
            table,
            truncate: format!(
                "TRUNCATE {schema}.outbox, {schema}.outbox_dead_letters RESTART IDENTITY"
            ),
        };
        let mut groups = Vec::new();
        let mut report = Report::default();
        let wants = |p| options.parts.contains(&p);
        if wants(Part::Lease) {
            groups.push(self.lease_statements(&outbox, options.rows).await?);
        }
        for url in options
            .brokers
            .iter()
            .filter(|_| wants(Part::Drain) || wants(Part::Latency) || wants(Part::Size))
        {
            let broker = BrokerUrl::parse(url)?;
            let producer = AnyProducer::connect(&broker, "idem-bench")
                .await
                .with_context(|| format!("connecting to {}", broker.redacted()))?;
            producer.ensure_destination(DESTINATION).await?;
            let producer = Arc::new(producer);
            if wants(Part::Drain) {
                groups.push(self.drain(&outbox, &broker, &producer, options).await?);
            }
            if wants(Part::Latency) {
                report
                    .sections
                    .push(self.latency(&outbox, &broker, &producer, options).await?);
            }
            if wants(Part::Size) {
                report
                    .sections
                    .push(self.table_size(&outbox, &broker, &options.size).await?);
            }
        }
        for &workers in options.workers.iter().filter(|_| wants(Part::Enqueue)) {
            groups.push(self.enqueue_cost(&outbox, workers).await?);
        }
        Ok((groups, report))
    }

    /// A store over a pool of `connections` with the scenario's outbox table.
    async fn outbox_store(
        &self,
        outbox: &Outbox,
        connections: u32,
    ) -> anyhow::Result<(PgPool, PostgresStore)> {
        let pool = PgPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(Duration::from_secs(30))
            .connect(&self.url)
            .await?;
        let store = PostgresStore::from_pool(pool.clone())
            .with_table(TableName::new(CLAIMS)?)?
            .with_outbox_table(outbox.table.clone())?;
        Ok((pool, store))
    }

    /// Relay throughput against the broker's own, on `broker`.
    async fn drain(
        &self,
        outbox: &Outbox,
        broker: &BrokerUrl,
        producer: &Arc<AnyProducer>,
        options: &Options,
    ) -> anyhow::Result<Group> {
        let rows = options.rows;
        let variants = [
            Drain::Broker16,
            Drain::Relay100x16,
            Drain::Relay500x16,
            Drain::Sequential500x16,
            Drain::Broker64,
            Drain::Relay100x64,
            Drain::Relay500x64,
            Drain::Sequential500x64,
        ];
        let pipeline = match options.pipeline {
            Some(n) => n,
            None => Relay::builder("idem-bench-drain").settings()?.pipeline(),
        };
        let title = format!(
            "Outbox relay throughput, PostgreSQL → {}: {rows} committed rows drained",
            broker.broker().name()
        );
        let profile = Mutex::new(HashMap::new());
        let group = Group::measure(title, &variants, &self.settings, async |v| {
            let msgs = messages(self.settings.ids(), rows)?;
            if v.is_relay() {
                let rounds = if v.sequential() { 1 } else { pipeline };
                self.drain_relay(outbox, producer, &msgs, v, rounds, &profile)
                    .await
            } else {
                let batch: Vec<(String, Vec<u8>)> = msgs
                    .iter()
                    .map(|m| {
                        let id = String::from_utf8_lossy(m.id().as_bytes()).into_owned();
                        (id, m.payload().to_vec())
                    })
                    .collect();
                let start = Instant::now();
                producer
                    .publish_all(DESTINATION, &batch, v.concurrency())
                    .await?;
                Ok(sample(rows, start.elapsed()))
            }
        })
        .await?;
        let mut group = group;
        for v in variants.iter().filter(|v| v.is_relay()) {
            if let Some(t) = lock(&profile).get(v.key()) {
                group = group.note(t.describe(v.key()));
            }
        }
        Ok(group
            .targets([
                Target::at_least("relay-b100-c16", "broker-c16", 0.8),
                Target::at_least("relay-b500-c16", "broker-c16", 0.8),
                Target::at_least("relay-b100-c64", "broker-c64", 0.8),
                Target::at_least("relay-b500-c64", "broker-c64", 0.8),
            ])
            .note(format!(
                "msg/s = {rows} / the time from the relay's start to the last row marked sent \
                 (the backlog read back as 0 unsent); the rows were committed beforehand, \
                 {FILL_CHUNK} per transaction, then `ANALYZE`, untimed; broker rows: the same number of \
                 messages (same size, fresh IDs) through the same connection's \
                 `AnyProducer::publish_all` (groups of N joined in turn), each confirmed"
            ))
            .note(format!(
                "the relay rows without `pipeline 1` keep up to {pipeline} rounds in flight \
                 (`RelayBuilder::pipeline`): the next lease (one transaction) while earlier \
                 batches publish, each round marking its confirmed rows in chunks (one UPDATE \
                 each) as they come; concurrency N bounds the publishes in flight across all \
                 rounds; `pipeline 1`: one round at a time, its marks still chunked"
            )))
    }

    async fn drain_relay(
        &self,
        outbox: &Outbox,
        producer: &Arc<AnyProducer>,
        msgs: &[Outgoing],
        v: Drain,
        pipeline: usize,
        profile: &Mutex<HashMap<&'static str, StoreTime>>,
    ) -> anyhow::Result<Sample> {
        sqlx::raw_sql(&outbox.truncate).execute(&self.admin).await?;
        let (pool, store) = self.outbox_store(outbox, 4).await?;
        for chunk in msgs.chunks(FILL_CHUNK) {
            let mut tx = store.begin().await?;
            store.enqueue(&mut tx, chunk).await?;
            store.commit(tx).await?;
        }
        // Statistics, as autovacuum would gather (it is off on the shared server): without
        // them the lease's plan may read every unsent row before its LIMIT.
        sqlx::raw_sql(&format!("ANALYZE {}", outbox.table))
            .execute(&self.admin)
            .await?;
        let _ = sqlx::query("CHECKPOINT").execute(&self.admin).await;
        let published = Arc::new(AtomicU64::new(0));
        let publisher = Counting {
            inner: Arc::clone(producer),
            published: Arc::clone(&published),
        };
        let time = Arc::new(Mutex::new(StoreTime::default()));
        let relay = Relay::builder("idem-bench-drain")
            .batch(v.batch())
            .concurrency(v.concurrency())
            .pipeline(pipeline)
            .poll_interval(Duration::from_secs(5))
            .create_destinations(false)
            .build(
                Profiled {
                    inner: store.clone(),
                    time: Arc::clone(&time),
                },
                publisher,
            )?;
        let stop = CancellationToken::new();
        let start = Instant::now();
        let running = tokio::spawn(relay.run(stop.clone()));
        let rows = msgs.len() as u64;
        let deadline = start + Duration::from_secs(600);
        // Published first (an atomic, free to read), then marked: the backlog read only at
        // the end, so polling it does not load the database the relay works on.
        while published.load(Ordering::Relaxed) < rows || store.backlog().await?.unsent > 0 {
            if Instant::now() > deadline || running.is_finished() {
                stop.cancel();
                let stats = running.await?;
                bail!(
                    "the relay did not drain {rows} rows in time ({} published; run: {stats:?})",
                    published.load(Ordering::Relaxed)
                );
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let elapsed = start.elapsed();
        stop.cancel();
        let stats = running.await??;
        pool.close().await;
        {
            let t = *lock(&time);
            let mut all = lock(profile);
            let sum = all.entry(v.key()).or_default();
            sum.leases += t.leases;
            sum.leased_rows += t.leased_rows;
            sum.lease += t.lease;
            sum.marks += t.marks;
            sum.marked_rows += t.marked_rows;
            sum.mark += t.mark;
            sum.elapsed += elapsed;
        }
        if stats.published != rows {
            bail!("the relay published {} of {rows} rows", stats.published);
        }
        Ok(sample(msgs.len(), elapsed))
    }

    /// P2's set batch with and without one enqueue per message.
    async fn enqueue_cost(&self, outbox: &Outbox, workers: usize) -> anyhow::Result<Group> {
        let mut variants = vec![Enqueue::BareSet, Enqueue::IdemSet, Enqueue::IdemSetOutbox];
        if self.settings.experimental {
            variants.push(Enqueue::IdemSetOutboxQuiet);
        }
        let title = format!(
            "Outbox enqueue cost: set batch of {}, PostgreSQL, {}",
            self.settings.batch,
            plural(workers, "worker")
        );
        let group = Group::measure(title, &variants, &self.settings, async |v| {
            sqlx::raw_sql(&outbox.truncate).execute(&self.admin).await?;
            let ctx = self.context(workers, false).await?;
            let store = PostgresStore::from_pool(ctx.pool.clone())
                .with_table(TableName::new(CLAIMS)?)?
                .with_outbox_table(outbox.table.clone())?;
            let op = EnqueueOp {
                pool: ctx.pool.clone(),
                processor: Processor::builder(store, CONSUMER).build()?,
                enqueue: idem_dialect::postgres::outbox_statements(&outbox.table).enqueue,
                consumer: ConsumerName::new(CONSUMER)?,
                variant: v,
                ids: self.settings.ids(),
                batch: self.settings.batch,
            };
            let sample = self.sample(op, workers, &ctx.cpu).await;
            ctx.close().await;
            sample
        })
        .await?;
        Ok(group
            .targets([
                Target::at_least("idem-set-outbox", "idem-set", 0.85),
                Target::compare("idem-set", "bare-set"),
                Target::compare("idem-set-outbox-quiet", "idem-set"),
            ])
            .note(
                "P2's set handler (one unnest INSERT of the charges, one UPDATE of the \
                 balances); the outbox variant also enqueues one outgoing message per message \
                 (derived ID, ~90-byte JSON payload) with `OutboxStore::enqueue` on the same \
                 transaction: one multi-row INSERT per 100 messages, then one pg_notify",
            ))
    }

    /// Commit → broker-confirm latency with a relay woken by NOTIFY only.
    async fn latency(
        &self,
        outbox: &Outbox,
        broker: &BrokerUrl,
        producer: &Arc<AnyProducer>,
        options: &Options,
    ) -> anyhow::Result<(String, Vec<String>)> {
        const WRITERS: u32 = 4;
        let title = format!(
            "Outbox commit → {} confirm latency, relay woken by NOTIFY, ~{} msg/s",
            broker.broker().name(),
            options.rate
        );
        eprintln!("{title}");
        sqlx::raw_sql(&outbox.truncate).execute(&self.admin).await?;
        let size_sql = format!("SELECT pg_total_relation_size('{}')", outbox.table);
        let size_before: i64 = sqlx::query_scalar(&size_sql).fetch_one(&self.admin).await?;
        let (pool, store) = self.outbox_store(outbox, WRITERS + 4).await?;
        let published: Arc<Mutex<HashMap<MessageId, Instant>>> = Arc::default();
        let relay = Relay::builder("idem-bench-latency")
            .batch(100)
            .concurrency(16)
            .poll_interval(Duration::from_secs(5))
            .purge_interval(Duration::from_secs(1))
            .create_destinations(false)
            .build(
                store.clone(),
                Timed {
                    inner: Arc::clone(producer),
                    published: Arc::clone(&published),
                },
            )?
            .wake_on(store.outbox_wakeups());
        let stop = CancellationToken::new();
        let running = tokio::spawn(relay.run(stop.clone()));
        // The listener connects in the background: give it time before the first commit.
        tokio::time::sleep(Duration::from_millis(500)).await;

        let ids = self.settings.ids();
        let committed: Arc<Mutex<HashMap<MessageId, Instant>>> = Arc::default();
        let start = Instant::now();
        let end = start + options.latency_window;
        let period = Duration::from_secs_f64(f64::from(WRITERS) / f64::from(options.rate.max(1)));
        let mut writers = Vec::new();
        for w in 0..WRITERS as usize {
            let (store, committed) = (store.clone(), Arc::clone(&committed));
            writers.push(tokio::spawn(async move {
                let mut tick = tokio::time::interval(period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                let mut n = 0u64;
                while Instant::now() < end {
                    tick.tick().await;
                    let d = ids.delivery(w, n)?;
                    let msg = outgoing(&d)?;
                    let mut tx = store.begin().await?;
                    store.enqueue(&mut tx, std::slice::from_ref(&msg)).await?;
                    store.commit(tx).await?;
                    let at = Instant::now();
                    lock(&committed).insert(msg.id().clone(), at);
                    n += 1;
                }
                anyhow::Ok(n)
            }));
        }
        let mut written = 0;
        for w in writers {
            written += w.await??;
        }
        let wrote_for = start.elapsed();
        // Everything committed is published within the poll interval at worst.
        let drain_deadline = Instant::now() + Duration::from_secs(10);
        while store.backlog().await?.unsent > 0 && Instant::now() < drain_deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // One purge turn after the last mark, so the size below is the steady state's.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        stop.cancel();
        let stats = running.await??;
        let size_after: i64 = sqlx::query_scalar(&size_sql).fetch_one(&self.admin).await?;
        pool.close().await;

        let committed = std::mem::take(&mut *lock(&committed));
        let published = std::mem::take(&mut *lock(&published));
        // The first second warms the relay's statements and the broker connection.
        let counted_from = start + Duration::from_secs(1);
        let mut early = 0u64;
        let mut missing = 0u64;
        let mut lat: Vec<Duration> = Vec::new();
        for (id, at) in &committed {
            if *at < counted_from {
                continue;
            }
            match published.get(id) {
                Some(p) => {
                    // NOTIFY reaches the listener as the commit is acknowledged, so the relay
                    // can confirm before the writer's task has run again: latency 0.
                    if *p < *at {
                        early += 1;
                    }
                    lat.push(p.saturating_duration_since(*at));
                }
                None => missing += 1,
            }
        }
        lat.sort();
        let pct = |p: f64| {
            percentile(&lat, p).map_or("–".into(), |d| {
                format!("{:.2} ms", d.as_secs_f64() * 1000.0)
            })
        };
        let verdict = |p: f64, ms: u64| match percentile(&lat, p) {
            Some(d) if d <= Duration::from_millis(ms) => "met",
            _ => "MISSED",
        };
        let mut lines = vec![
            format!(
                "{written} commits by {WRITERS} paced writers (one enqueue of one message per \
                 transaction) in {:.1} s = {:.0} commits/s; relay batch 100, concurrency 16, \
                 poll 5 s, woken only by `wake_on(outbox_wakeups())`; purge every 1 s",
                wrote_for.as_secs_f64(),
                written as f64 / wrote_for.as_secs_f64()
            ),
            format!(
                "counted {} messages committed after the first second: p50 {}, p90 {}, p99 {}, \
                 p99.9 {}, max {}",
                lat.len(),
                pct(0.5),
                pct(0.9),
                pct(0.99),
                pct(0.999),
                pct(1.0)
            ),
            format!("p50 ≤ 5 ms: {}", verdict(0.5, 5)),
            format!("p99 ≤ 20 ms: {}", verdict(0.99, 20)),
            format!(
                "latency = the relay's publish returning (after the broker's confirm) − the \
                 writer's COMMIT returning, both `Instant`s in this process; {early} confirmed \
                 before the writer saw its commit return (counted as 0); {missing} not \
                 published by the end"
            ),
            format!(
                "relay run: {} rounds, {} published, {} purged; outbox table {} kB before, {} kB \
                 after (pg_total_relation_size)",
                stats.rounds,
                stats.published,
                stats.purged,
                size_before / 1024,
                size_after / 1024
            ),
        ];
        if missing > 0 {
            lines.push("**some rows were not published by the end: see above**".into());
        }
        Ok((title, lines))
    }
}

/// The scenario's outbox table.
#[derive(Debug)]
struct Outbox {
    table: TableName,
    truncate: String,
}

/// The nearest-rank percentile `p` (0 < p ≤ 1) of sorted `v`.
fn percentile(v: &[Duration], p: f64) -> Option<Duration> {
    let rank = (v.len() as f64 * p).ceil() as usize;
    v.get(rank.clamp(1, v.len().max(1)) - 1).copied()
}

fn sample(messages: usize, elapsed: Duration) -> Sample {
    Sample {
        rate: messages as f64 / elapsed.as_secs_f64().max(1e-9),
        retries: 0,
        client_us: None,
        server_us: None,
    }
}

/// The outgoing message a handler of `d` emits: its derived ID and a small JSON event.
fn outgoing(d: &Delivery) -> Result<Outgoing, Error> {
    let consumer = ConsumerName::new(CONSUMER)?;
    Emitter::for_message(&consumer, &d.id).message(DESTINATION, payload(d))
}

fn payload(d: &Delivery) -> Vec<u8> {
    format!(
        r#"{{"event":"charged","account":"{}","cents":{},"source":"{}"}}"#,
        d.account,
        d.amount,
        String::from_utf8_lossy(d.id.as_bytes())
    )
    .into_bytes()
}

/// `rows` outgoing messages with fresh IDs.
fn messages(ids: Ids, rows: usize) -> anyhow::Result<Vec<Outgoing>> {
    (0..rows as u64)
        .map(|n| Ok(outgoing(&ids.delivery(0, n)?)?))
        .collect()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The producer, counting confirmed publishes.
struct Counting {
    inner: Arc<AnyProducer>,
    published: Arc<AtomicU64>,
}

impl Publish for Counting {
    async fn publish(&self, msg: &Outgoing) -> Result<(), Error> {
        Publish::publish(self.inner.as_ref(), msg).await?;
        self.published.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// The producer, recording when each publish's confirm came back.
struct Timed {
    inner: Arc<AnyProducer>,
    published: Arc<Mutex<HashMap<MessageId, Instant>>>,
}

impl Publish for Timed {
    async fn publish(&self, msg: &Outgoing) -> Result<(), Error> {
        Publish::publish(self.inner.as_ref(), msg).await?;
        let at = Instant::now();
        lock(&self.published).insert(msg.id().clone(), at);
        Ok(())
    }
}

/// The store's enqueue INSERT (at most [`idem_dialect::EnqueueStatement::MAX_ROWS`] rows, as
/// a batch of 100 is), bound by hand, without the store's `pg_notify`.
async fn quiet_enqueue(
    conn: &mut sqlx::PgConnection,
    statement: &idem_dialect::EnqueueStatement,
    msgs: &[Outgoing],
) -> Result<(), BoxError> {
    use idem_dialect::outbox::{Value, Values, encode_headers};
    let headers: Vec<String> = msgs.iter().map(|m| encode_headers(m.headers())).collect();
    for (chunk, headers) in msgs
        .chunks(idem_dialect::EnqueueStatement::MAX_ROWS)
        .zip(headers.chunks(idem_dialect::EnqueueStatement::MAX_ROWS))
    {
        let rows: Vec<Values<'_>> = chunk
            .iter()
            .zip(headers)
            .map(|(m, headers)| Values {
                id: m.id().as_bytes(),
                destination: m.destination(),
                key: m.key(),
                payload: m.payload(),
                headers,
                ..Values::default()
            })
            .collect();
        let text = statement.text(chunk.len());
        let mut q = sqlx::query(&text);
        for v in statement.bind(&rows) {
            q = match v {
                Value::Bytes(b) => q.bind(b),
                Value::Text(t) => q.bind(t),
                Value::OptText(t) => q.bind(t),
                Value::Int(i) => q.bind(i),
                Value::OptInt(i) => q.bind(i),
            };
        }
        q.execute(&mut *conn).await?;
    }
    Ok(())
}

/// One batch of the enqueue-cost tables.
struct EnqueueOp {
    pool: PgPool,
    processor: Processor<PostgresStore>,
    /// The store's enqueue statement, for the experimental variant without the notify.
    enqueue: idem_dialect::EnqueueStatement,
    consumer: ConsumerName,
    variant: Enqueue,
    ids: Ids,
    batch: usize,
}

impl Op for EnqueueOp {
    type State = ();

    async fn open(&self, _worker: usize) -> anyhow::Result<()> {
        Ok(())
    }

    async fn run(&self, _: &mut (), worker: usize, seq: u64) -> anyhow::Result<u64> {
        let batch = self.ids.batch(worker, seq, self.batch)?;
        match self.variant {
            Enqueue::BareSet => {
                let refs: Vec<&Delivery> = batch.iter().collect();
                let mut tx = self.pool.begin().await?;
                charge_set(&mut tx, &refs).await?;
                tx.commit().await?;
            }
            Enqueue::IdemSet | Enqueue::IdemSetOutbox | Enqueue::IdemSetOutboxQuiet => {
                let emit = matches!(self.variant, Enqueue::IdemSetOutbox);
                let quiet = matches!(self.variant, Enqueue::IdemSetOutboxQuiet);
                let enqueue = &self.enqueue;
                let store = self.processor.store();
                let consumer = &self.consumer;
                let out = self
                    .processor
                    .process_batch_set(&batch, async |tx, fresh: &[&Delivery]| {
                        charge_set(tx, fresh).await?;
                        if emit {
                            let msgs = fresh
                                .iter()
                                .map(|d| {
                                    Emitter::for_message(consumer, &d.id)
                                        .message(DESTINATION, payload(d))
                                })
                                .collect::<Result<Vec<_>, _>>()?;
                            store.enqueue(tx, &msgs).await?;
                        }
                        if quiet {
                            let msgs = fresh
                                .iter()
                                .map(|d| {
                                    Emitter::for_message(consumer, &d.id)
                                        .message(DESTINATION, payload(d))
                                })
                                .collect::<Result<Vec<_>, _>>()?;
                            quiet_enqueue(tx, enqueue, &msgs).await?;
                        }
                        Ok::<(), BoxError>(())
                    })
                    .await?;
                if out.output.is_none() {
                    bail!("no message of a fresh batch was new");
                }
                for (d, outcome) in batch.iter().zip(out.outcomes) {
                    expect_processed(d, outcome?)?;
                }
            }
        }
        Ok(batch.len() as u64)
    }
}

/// Where a drain variant's time went on the database side, summed over its rounds.
#[derive(Debug, Default, Clone, Copy)]
struct StoreTime {
    leases: u64,
    leased_rows: u64,
    lease: Duration,
    marks: u64,
    marked_rows: u64,
    mark: Duration,
    /// Wall time of the measured drains.
    elapsed: Duration,
}

impl StoreTime {
    fn describe(&self, key: &str) -> String {
        let per = |d: Duration, n: u64| d.as_secs_f64() * 1e3 / n.max(1) as f64;
        let share = |d: Duration| 100.0 * d.as_secs_f64() / self.elapsed.as_secs_f64().max(1e-9);
        format!(
            "{key}, database side over all its rounds: {} leases of {:.0} rows, {:.1} ms each \
             ({:.0} % of the drains' wall time); {} mark statements of {:.0} rows, {:.1} ms each \
             ({:.0} %, overlapping the publishes)",
            self.leases,
            self.leased_rows as f64 / self.leases.max(1) as f64,
            per(self.lease, self.leases),
            share(self.lease),
            self.marks,
            self.marked_rows as f64 / self.marks.max(1) as f64,
            per(self.mark, self.marks),
            share(self.mark),
        )
    }
}

/// The outbox store, timing the relay's leases and marks into a [`StoreTime`].
struct Profiled {
    inner: PostgresStore,
    time: Arc<Mutex<StoreTime>>,
}

impl RelayStore for Profiled {
    async fn lease(
        &self,
        relay: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<idem_core::outbox::OutboxRow>, Error> {
        let start = Instant::now();
        let rows = self.inner.lease(relay, limit, lease).await?;
        let mut t = lock(&self.time);
        t.leases += 1;
        t.leased_rows += rows.len() as u64;
        t.lease += start.elapsed();
        Ok(rows)
    }

    async fn mark_sent(&self, relay: &str, seqs: &[i64]) -> Result<(), Error> {
        let start = Instant::now();
        self.inner.mark_sent(relay, seqs).await?;
        let mut t = lock(&self.time);
        t.marks += 1;
        t.marked_rows += seqs.len() as u64;
        t.mark += start.elapsed();
        Ok(())
    }

    async fn release(
        &self,
        relay: &str,
        seq: i64,
        error: &str,
        retry_in: Duration,
    ) -> Result<(), Error> {
        self.inner.release(relay, seq, error, retry_in).await
    }

    async fn dead_letter(&self, relay: &str, seq: i64, reason: &str) -> Result<(), Error> {
        self.inner.dead_letter(relay, seq, reason).await
    }

    async fn purge_sent(&self, limit: usize) -> Result<u64, Error> {
        self.inner.purge_sent(limit).await
    }

    async fn backlog(&self) -> Result<idem_core::outbox::Backlog, Error> {
        self.inner.backlog().await
    }
}
