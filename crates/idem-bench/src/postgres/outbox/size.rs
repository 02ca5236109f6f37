//! The outbox table's size under a constant rate (`--outbox-parts size`): writers enqueue at a
//! steady total rate through the store, in transactions as a set-batch handler does, while the
//! library [`Relay`] (its defaults, woken by `LISTEN`/`NOTIFY`) relays to a Redis stream of its
//! own; the table's size on disk is sampled all along. A table that only holds what the relay
//! has not yet published and purged should settle at a flat size; one whose dead rows are not
//! reclaimed (autovacuum off) keeps growing.
//!
//! The Redis stream is trimmed at every sample and deleted at the end, so the shared Redis does
//! not keep a million entries.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use idem_any::{Broker, BrokerUrl};
use idem_core::outbox::{Emitter, OutboxStore as _, RelayStore as _};
use idem_core::{ConsumerName, TransactionalStore as _};
use idem_relay::{BrokerPublisher, CancellationToken, Relay};

use super::{Outbox, payload};
use crate::postgres::Bench;
use crate::workload::CONSUMER;

/// Concurrent writers.
const WRITERS: u64 = 8;

/// Messages per writer transaction: one set batch's worth of events, as a handler of small
/// batches enqueues them (one multi-row INSERT and one NOTIFY per commit).
const PER_COMMIT: u64 = 10;

/// Stream entries kept at each trim.
const KEEP_ENTRIES: u64 = 1000;

/// The options of the size part, flattened into `idem-bench`'s own.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct Args {
    /// Outbox size part: messages enqueued in all.
    #[arg(
        long = "outbox-size-messages",
        default_value_t = 1_000_000,
        value_name = "N"
    )]
    messages: u64,
    /// Outbox size part: messages per second, all writers together.
    #[arg(long = "outbox-size-rate", default_value_t = 2500, value_name = "MSGS")]
    rate: u32,
    /// Outbox size part: the relay's purge interval [default: the relay's default].
    #[arg(long = "outbox-size-purge", value_name = "SECONDS")]
    purge: Option<f64>,
    /// Outbox size part: seconds between two samples of the table's size.
    #[arg(
        long = "outbox-size-sample",
        default_value_t = 5.0,
        value_name = "SECONDS"
    )]
    sample: f64,
}

impl Args {
    /// The checked options.
    pub(crate) fn options(&self) -> anyhow::Result<Options> {
        if self.messages < WRITERS * PER_COMMIT || self.messages > 100_000_000 {
            bail!(
                "--outbox-size-messages must be between {} and 100000000",
                WRITERS * PER_COMMIT
            );
        }
        if self.rate == 0 || self.rate > 100_000 {
            bail!("--outbox-size-rate must be between 1 and 100000 messages per second");
        }
        let seconds = |s: f64, flag: &str| {
            if (0.1..=3600.0).contains(&s) {
                Ok(Duration::from_secs_f64(s))
            } else {
                bail!("{flag} must be between 0.1 and 3600 seconds")
            }
        };
        Ok(Options {
            messages: self.messages,
            rate: self.rate,
            purge: self
                .purge
                .map(|s| seconds(s, "--outbox-size-purge"))
                .transpose()?,
            sample: seconds(self.sample, "--outbox-size-sample")?,
        })
    }
}

/// What the size part runs.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    messages: u64,
    rate: u32,
    purge: Option<Duration>,
    sample: Duration,
}

/// One reading of the table.
#[derive(Debug, Clone, Copy)]
struct Reading {
    /// Seconds since the writers started.
    at: f64,
    /// Messages committed by then.
    committed: u64,
    /// `pg_total_relation_size`: heap, indexes, TOAST, free space and visibility maps.
    total: i64,
    heap: i64,
    indexes: i64,
    live: i64,
    dead: i64,
    autovacuums: i64,
    unsent: u64,
    sent: u64,
}

const MIB: f64 = 1024.0 * 1024.0;

fn mib(bytes: i64) -> f64 {
    bytes as f64 / MIB
}

impl Bench {
    /// The table's size while writers enqueue at a constant rate and the relay publishes to
    /// `broker` (Redis Streams only: the stream is trimmed as it goes).
    pub(super) async fn table_size(
        &self,
        outbox: &Outbox,
        broker: &BrokerUrl,
        options: &Options,
    ) -> anyhow::Result<(String, Vec<String>)> {
        if broker.broker() != Broker::RedisStreams {
            bail!(
                "--outbox-parts size relays to Redis Streams only (it trims the stream as it \
                 goes); {} is not a redis:// URL",
                broker.redacted()
            );
        }
        let stream = format!("idem_bench_size_{}", std::process::id());
        let redis = redis::Client::open(broker.as_str())
            .context("the Redis URL")?
            .get_multiplexed_async_connection()
            .await
            .with_context(|| format!("connecting to {}", broker.redacted()))?;
        let result = self
            .table_size_on(outbox, broker, options, &stream, redis.clone())
            .await;
        let mut redis = redis;
        if let Err(e) = redis::cmd("DEL")
            .arg(&stream)
            .query_async::<i64>(&mut redis)
            .await
        {
            eprintln!("warning: deleting the Redis stream {stream}: {e}");
        }
        result
    }

    async fn table_size_on(
        &self,
        outbox: &Outbox,
        broker: &BrokerUrl,
        options: &Options,
        stream: &str,
        redis: redis::aio::MultiplexedConnection,
    ) -> anyhow::Result<(String, Vec<String>)> {
        let title = format!(
            "Outbox table size at a constant {} msg/s, {} messages, relayed to Redis Streams",
            options.rate, options.messages
        );
        eprintln!("{title}");
        sqlx::raw_sql(&outbox.truncate).execute(&self.admin).await?;
        sqlx::raw_sql(&format!("VACUUM {}", outbox.table))
            .execute(&self.admin)
            .await?;
        let autovacuum: String = sqlx::query_scalar("SHOW autovacuum")
            .fetch_one(&self.admin)
            .await?;
        let (pool, store) = self.outbox_store(outbox, WRITERS as u32 + 4).await?;

        let mut builder = Relay::builder("idem-bench-size");
        if let Some(every) = options.purge {
            builder = builder.purge_interval(every);
        }
        let publisher = BrokerPublisher::new(broker.clone(), "idem-bench-size");
        publisher.connect().await?;
        let relay = builder
            .build(store.clone(), publisher)?
            .wake_on(store.outbox_wakeups());
        let relay_settings = format!("{:?}", relay.settings());
        let stop = CancellationToken::new();
        let running = tokio::spawn(relay.run(stop.clone()));
        // The listener connects in the background: give it time before the first commit.
        tokio::time::sleep(Duration::from_millis(500)).await;

        let sql = format!(
            "SELECT pg_total_relation_size(c.oid), pg_relation_size(c.oid), \
             pg_indexes_size(c.oid), s.n_live_tup, s.n_dead_tup, s.autovacuum_count \
             FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid \
             WHERE c.oid = '{}'::regclass",
            outbox.table
        );
        let ids = self.settings.ids();
        let consumer = ConsumerName::new(CONSUMER)?;
        let committed = Arc::new(AtomicU64::new(0));
        let commits_per_writer = options.messages.div_ceil(WRITERS * PER_COMMIT);
        let period =
            Duration::from_secs_f64((WRITERS * PER_COMMIT) as f64 / f64::from(options.rate.max(1)));
        let start = Instant::now();
        let mut writers = tokio::task::JoinSet::new();
        for w in 0..WRITERS as usize {
            let (store, committed, consumer) =
                (store.clone(), Arc::clone(&committed), consumer.clone());
            let stream = stream.to_owned();
            writers.spawn(async move {
                // Burst (the default): a writer held up by a slow commit catches up, so the
                // average rate stays the one asked for while the database keeps up.
                let mut tick = tokio::time::interval(period);
                for c in 0..commits_per_writer {
                    tick.tick().await;
                    let msgs = (0..PER_COMMIT)
                        .map(|i| {
                            let d = ids.delivery(w, c * PER_COMMIT + i)?;
                            Ok(Emitter::for_message(&consumer, &d.id)
                                .message(stream.as_str(), payload(&d))?)
                        })
                        .collect::<anyhow::Result<Vec<_>>>()?;
                    let mut tx = store.begin().await?;
                    store.enqueue(&mut tx, &msgs).await?;
                    store.commit(tx).await?;
                    committed.fetch_add(PER_COMMIT, Ordering::Relaxed);
                }
                anyhow::Ok(())
            });
        }

        let read = async |at: Instant| -> anyhow::Result<Reading> {
            let (total, heap, indexes, live, dead, autovacuums): (i64, i64, i64, i64, i64, i64) =
                sqlx::query_as(&sql).fetch_one(&self.admin).await?;
            let backlog = store.backlog().await?;
            let mut conn = redis.clone();
            redis::cmd("XTRIM")
                .arg(stream)
                .arg("MAXLEN")
                .arg("~")
                .arg(KEEP_ENTRIES)
                .query_async::<i64>(&mut conn)
                .await
                .context("trimming the Redis stream")?;
            Ok(Reading {
                at: at.duration_since(start).as_secs_f64(),
                committed: committed.load(Ordering::Relaxed),
                total,
                heap,
                indexes,
                live,
                dead,
                autovacuums,
                unsent: backlog.unsent,
                sent: backlog.sent,
            })
        };
        let show = |r: &Reading| {
            eprintln!(
                "  {:>6.0} s {:>8} committed  {:>7.1} MiB (heap {:.1}, indexes {:.1})  \
                 live {} dead {}  unsent {} sent {}  autovacuums {}",
                r.at,
                r.committed,
                mib(r.total),
                mib(r.heap),
                mib(r.indexes),
                r.live,
                r.dead,
                r.unsent,
                r.sent,
                r.autovacuums
            );
        };

        let mut readings = Vec::new();
        let mut tick = tokio::time::interval(options.sample);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let writing = loop {
            tokio::select! {
                done = writers.join_next() => match done {
                    Some(result) => result??,
                    None => break start.elapsed(),
                },
                _ = tick.tick() => {
                    let r = read(Instant::now()).await?;
                    show(&r);
                    readings.push(r);
                    if running.is_finished() {
                        bail!("the relay stopped while the writers wrote: {:?}", running.await?);
                    }
                }
            }
        };
        let written = committed.load(Ordering::Relaxed);
        // The relay publishes what is left; its size is no longer the steady state's.
        let drain_deadline = Instant::now() + Duration::from_secs(300);
        let mut after = read(Instant::now()).await?;
        while after.unsent > 0 && Instant::now() < drain_deadline {
            tick.tick().await;
            after = read(Instant::now()).await?;
            show(&after);
        }
        let drained = start.elapsed();
        stop.cancel();
        let stats = running.await??;
        pool.close().await;

        let drained = if after.unsent == 0 {
            format!(
                "the last unsent row published {:.0} s after the start",
                drained.as_secs_f64()
            )
        } else {
            format!(
                "**{} rows still unsent when the bench stopped waiting, {:.0} s after the start**",
                after.unsent,
                drained.as_secs_f64()
            )
        };
        let mut lines = vec![
            format!(
                "{written} messages committed by {WRITERS} writers ({PER_COMMIT} per \
                 transaction: one `OutboxStore::enqueue` of {PER_COMMIT}, then commit, as a \
                 set-batch handler does) in {:.0} s = {:.0} msg/s (asked: {}); {drained}",
                writing.as_secs_f64(),
                written as f64 / writing.as_secs_f64(),
                options.rate,
            ),
            format!(
                "relay: the library `Relay`, woken by `LISTEN`/`NOTIFY` and polling, publishing \
                 through `BrokerPublisher` to one Redis stream (trimmed to ~{KEEP_ENTRIES} \
                 entries at each sample): {relay_settings}"
            ),
            format!(
                "cluster autovacuum = {autovacuum}; run: {} rounds, {} published, {} purged, {} \
                 failed, {} store errors",
                stats.rounds, stats.published, stats.purged, stats.failed, stats.store_errors
            ),
        ];
        lines.extend(summary(&readings, writing, written, options));
        lines.push(format!(
            "after the drain: {:.1} MiB (heap {:.1}, indexes {:.1}), {} unsent, {} sent not yet \
             purged",
            mib(after.total),
            mib(after.heap),
            mib(after.indexes),
            after.unsent,
            after.sent
        ));
        lines.push(series(&readings));
        if stats.published != written {
            lines.push(format!(
                "**the relay published {} of {written} messages: see above**",
                stats.published
            ));
        }
        Ok((title, lines))
    }
}

/// Median, spread and trend over the second half of the writing, and the verdict.
fn summary(
    readings: &[Reading],
    writing: Duration,
    written: u64,
    options: &Options,
) -> Vec<String> {
    let half = writing.as_secs_f64() / 2.0;
    let late: Vec<&Reading> = readings.iter().filter(|r| r.at >= half).collect();
    if late.len() < 3 {
        return vec![format!(
            "only {} samples in the second half: run longer or sample more often",
            late.len()
        )];
    }
    let median = |f: &dyn Fn(&Reading) -> i64| {
        let mut v: Vec<f64> = late.iter().map(|r| mib(f(r))).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let total = median(&|r| r.total);
    let (heap, indexes) = (median(&|r| r.heap), median(&|r| r.indexes));
    let min = late
        .iter()
        .map(|r| mib(r.total))
        .fold(f64::INFINITY, f64::min);
    let max = late.iter().map(|r| mib(r.total)).fold(0.0, f64::max);
    let peak = readings.iter().map(|r| mib(r.total)).fold(0.0, f64::max);
    let per_100k = |f: &dyn Fn(&Reading) -> i64| {
        let pts: Vec<(f64, f64)> = late
            .iter()
            .map(|r| (r.committed as f64, mib(f(r))))
            .collect();
        slope(&pts) * 100_000.0
    };
    let trend = per_100k(&|r| r.total);
    // Flat: at this trend, a run as long as this one again would add at most a tenth of the
    // median size. Only growth counts: a table cannot shrink for long, and a falling trend is
    // vacuum truncating the heap's empty end within the window.
    let growth = trend * written as f64 / 100_000.0;
    let flat = is_flat(growth, total);
    vec![
        format!(
            "second half of the writing ({} samples, every {:.0} s, from {:.0} s): median {:.1} \
             MiB (heap {:.1}, indexes {:.1}); min {:.2}×, max {:.2}× the median; peak over the \
             whole run {:.1} MiB",
            late.len(),
            options.sample.as_secs_f64(),
            half,
            total,
            heap,
            indexes,
            min / total.max(1e-9),
            max / total.max(1e-9),
            peak
        ),
        format!(
            "trend (least squares of size on messages committed, second half): {trend:+.2} \
             MiB per 100 000 messages (heap {:+.2}, indexes {:+.2}) = {growth:+.1} MiB per \
             {written} messages",
            per_100k(&|r| r.heap),
            per_100k(&|r| r.indexes)
        ),
        format!(
            "flat (the trend adds at most 10 % of the median over another {written} \
             messages; a falling trend counts as flat): {}",
            if flat { "yes" } else { "**NO**" }
        ),
    ]
}

/// Whether `growth` (MiB over a run) is at most a tenth of the `median` size; shrinking is flat.
fn is_flat(growth: f64, median: f64) -> bool {
    growth <= 0.1 * median
}

/// The least-squares slope of `y` on `x`.
fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    let (mx, my) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x / n, b + y / n));
    let (sxy, sxx) = points.iter().fold((0.0, 0.0), |(a, b), (x, y)| {
        (a + (x - mx) * (y - my), b + (x - mx) * (x - mx))
    });
    if sxx > 0.0 { sxy / sxx } else { 0.0 }
}

/// About a dozen readings spread over the run, for the eye.
fn series(readings: &[Reading]) -> String {
    let step = readings.len().div_ceil(12).max(1);
    let points: Vec<String> = readings
        .iter()
        .enumerate()
        .filter(|(i, _)| i % step == 0 || *i + 1 == readings.len())
        .map(|(_, r)| {
            format!(
                "{:.0} s {:.0} k: {:.1} MiB ({:.0} k live, {:.0} k dead, {} av)",
                r.at,
                r.committed as f64 / 1000.0,
                mib(r.total),
                r.live as f64 / 1000.0,
                r.dead as f64 / 1000.0,
                r.autovacuums
            )
        })
        .collect();
    format!(
        "series (time, committed: size, live/dead tuples, autovacuums so far): {}",
        points.join("; ")
    )
}

#[cfg(test)]
mod tests {
    use super::{is_flat, slope};

    #[test]
    fn flat_is_growth_within_a_tenth_of_the_median() {
        assert!(is_flat(16.0, 163.8));
        assert!(!is_flat(17.0, 163.8));
        assert!(is_flat(-40.0, 163.8));
    }

    #[test]
    fn slope_of_a_line_and_of_a_constant() {
        let line: Vec<(f64, f64)> = (0..10)
            .map(|x| (f64::from(x), 3.0 * f64::from(x) + 1.0))
            .collect();
        assert!((slope(&line) - 3.0).abs() < 1e-9);
        let flat: Vec<(f64, f64)> = (0..10).map(|x| (f64::from(x), 5.0)).collect();
        assert_eq!(slope(&flat), 0.0);
        assert_eq!(slope(&[(1.0, 2.0)]), 0.0);
    }
}
