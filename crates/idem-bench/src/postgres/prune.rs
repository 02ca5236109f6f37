//! Prune under load (issue 12): a claims table holding `--claims` synthetic claims spread over
//! the last 14 days, a consumer running at full speed, and the older half pruned while it
//! runs — row by row on a plain table ([`prune_all`]'s loop), by dropping day partitions on a
//! partitioned one ([`PostgresStore::maintain_partitions`]): in the legacy layout (a DEFAULT
//! partition; each drop locks the table) and in the bounded one (days detached concurrently),
//! side by side in one run. It reports the consumer's
//! throughput and latency before, during and after pruning, the table's size before and
//! after, how long pruning took, and checks that pruning removed exactly what it should.
//!
//! This module owns the scenario's schema (its own, dropped afterwards, so it runs beside
//! anything else on the server), the fill, the consumer and its latency log, the pruning and
//! the checks; [`Report`] is what it prints.
//!
//! The fill is SQL (`INSERT … SELECT … FROM generate_series`), in time order as claims arrive,
//! then `VACUUM ANALYZE` and a `CHECKPOINT`: a table that has been live for two weeks has been
//! vacuumed (hint bits set, visibility map current), and a vacuum or checkpoint of the fresh
//! fill must not land inside a measured window.
//!
//! [`prune_all`]: idem_core::store::prune_all

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail, ensure};
use idem_core::{
    Fingerprint, Identified, Migrate as _, Outcome, Processor, Prune as _, Retention, Stamp,
    Timestamp,
};
use idem_sql::partition::{Day, PartitionKind, PartitionReport, Partitioning};
use idem_sql::{PostgresStore, TableName};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use super::{Bench, charge, expect_processed};
use crate::workload::{ACCOUNTS, CONSUMER, Ids};
use crate::{plural, thousands};

/// Days of ID time the fill spreads over.
const FILL_DAYS: u64 = 14;
/// The table's retention (and the declared redelivery window): half the fill is older.
const KEEP_DAYS: u64 = 7;
/// Rows per fill statement: big enough that statement overhead vanishes, small enough that a
/// statement's WAL and memory stay modest.
const FILL_CHUNK: u64 = 1_000_000;
/// A filled claim's `processed_at` is its ID's time plus this (microseconds): processed a few
/// seconds after the producer made it.
const PROCESSED_AFTER_US: i64 = 3_000_000;
/// The fill ends this long before the run starts, so no filled ID is as new as the consumer's.
const FILL_ENDS_BEFORE_MS: i64 = 60_000;
const DAY_MS: i64 = 86_400_000;
/// The server's clock in the store's unit.
const SERVER_NOW: &str = "SELECT (extract(epoch from clock_timestamp()) * 1000000)::bigint";

/// The three ways to remove the old half.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Layout {
    /// One table; old claims deleted row by row in bounded batches.
    Plain,
    /// Daily partitions by the ID's time with PostgreSQL's DEFAULT partition, as versions
    /// before the bounded layout made them: each day past the retention dropped under an
    /// ACCESS EXCLUSIVE lock on the table.
    Legacy,
    /// Daily partitions by the ID's time in the bounded layout (what `migrate` creates): each
    /// day past the retention detached concurrently, then dropped.
    Partitioned,
}

impl Layout {
    fn name(self) -> &'static str {
        match self {
            Layout::Plain => "plain",
            Layout::Legacy => "legacy",
            Layout::Partitioned => "partitioned",
        }
    }

    /// Whether the table is partitioned by the ID's time.
    fn by_day(self) -> bool {
        self != Layout::Plain
    }
}

/// What `--only prune` runs.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    /// Synthetic claims in the table before the consumer starts.
    pub(crate) claims: u64,
    /// The consumer's concurrent workers.
    pub(crate) workers: usize,
    /// Counted before pruning starts, after a warm-up.
    pub(crate) before: Duration,
    /// Counted after pruning ends.
    pub(crate) after: Duration,
    /// Row-wise pruning stops after this long (between batches), and the report says so.
    pub(crate) cap: Duration,
    /// Rows per row-wise prune batch.
    pub(crate) batch: u32,
    /// The tables to run, in order.
    pub(crate) layouts: Vec<Layout>,
}

impl Options {
    fn warmup(&self) -> Duration {
        (self.before / 5).clamp(Duration::from_millis(200), Duration::from_secs(2))
    }

    fn retention(&self) -> anyhow::Result<Retention> {
        let keep = Duration::from_secs(KEEP_DAYS * 86_400);
        Ok(Retention::new(keep, keep)?)
    }
}

/// The synthetic claims: claim `i` of `n` has ID time `start_ms + i * span_ms / n`, a UUIDv7
/// of that time with random bits from `md5(i)`, fingerprint `sha256(i)`, and `processed_at`
/// [`PROCESSED_AFTER_US`] later. The same formula, in SQL, fills the table and names the
/// sampled claims the checks look for; [`Fill::ms`] is it in Rust, for the expected counts.
#[derive(Debug, Clone, Copy)]
struct Fill {
    n: u64,
    start_ms: i64,
    span_ms: i64,
}

/// Columns `i` (the claim's number), `ms` (its ID time) and `r` (its random hex) for the `i`
/// of the `FROM` that follows; `$1` start, `$2` span, `$3` count.
const FILL_ROWS: &str = "SELECT i, $1::bigint + (i * $2::bigint) / $3::bigint AS ms, \
     md5(i::text) AS r";

/// Claim `i`'s ID as UUIDv7 text: 48 bits of milliseconds, version 7, 12 random bits, the
/// RFC variant (`10`) with 14 random bits, 48 random bits.
const FILL_ID: &str = "convert_to(substr(lpad(to_hex(ms), 12, '0'), 1, 8) || '-' \
     || substr(lpad(to_hex(ms), 12, '0'), 9, 4) || '-7' || substr(r, 1, 3) || '-' \
     || substr('89ab', (i % 4)::int + 1, 1) || substr(r, 4, 3) || '-' || substr(r, 7, 12), \
     'UTF8')";

impl Fill {
    fn ms(&self, i: u64) -> i64 {
        self.start_ms + (i as i64 * self.span_ms) / self.n as i64
    }

    fn processed_at(&self, i: u64) -> i64 {
        self.ms(i) * 1000 + PROCESSED_AFTER_US
    }

    /// The newest filled `processed_at`: anything newer is the consumer's.
    fn last_processed_at(&self) -> i64 {
        self.processed_at(self.n - 1)
    }

    /// How many filled claims satisfy `pred`, which must be false, then true, along `0..n`
    /// (every test here is "at least this new", and the fill is in time order).
    fn count_from(&self, pred: impl Fn(u64) -> bool) -> u64 {
        let (mut lo, mut hi) = (0, self.n);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if pred(mid) { hi = mid } else { lo = mid + 1 }
        }
        self.n - lo
    }

    /// Claim numbers spread evenly over the fill.
    fn sample(&self, k: u64) -> Vec<i64> {
        let k = k.min(self.n).max(1);
        let mut v: Vec<i64> = (0..k)
            .map(|j| (j * (self.n - 1) / k.saturating_sub(1).max(1)) as i64)
            .collect();
        v.dedup();
        v
    }
}

/// One table's run.
#[derive(Debug)]
struct Leg {
    layout: Layout,
    fill_took: Duration,
    vacuum_took: Duration,
    pruned_by: String,
    removed: String,
    prune_took: Duration,
    capped: bool,
    size_before: u64,
    size_after: u64,
    /// Before, during, after, and as long as before from the start of pruning.
    windows: [WindowStats; 4],
    retries: u64,
    checks: Vec<String>,
}

/// The consumer in one window.
#[derive(Debug, Clone, Copy)]
struct WindowStats {
    seconds: f64,
    messages: u64,
    p50_us: u32,
    p99_us: u32,
    max_us: u32,
}

impl WindowStats {
    fn rate(&self) -> f64 {
        if self.seconds > 0.0 {
            self.messages as f64 / self.seconds
        } else {
            0.0
        }
    }
}

/// What `--only prune` found, ready to print.
#[derive(Debug)]
pub(crate) struct Report {
    options: Options,
    legs: Vec<Leg>,
}

/// One message the consumer completed: when (since the consumer started) and how long
/// `Processor::process` took, end to end.
#[derive(Debug, Clone, Copy)]
struct Done {
    at_ns: u64,
    latency_us: u32,
}

#[derive(Debug, Default)]
struct Log {
    done: Vec<Done>,
    retries: u64,
}

/// Instants of one leg's timeline, from the consumer's start.
#[derive(Debug)]
struct Timeline {
    before: (Duration, Duration),
    during: (Duration, Duration),
    after: (Duration, Duration),
}

impl Timeline {
    /// The windows the report shows, in its order. The last is as long as `before` and
    /// starts with pruning: a drop that lasts a fraction of a second is then also seen on the
    /// same time scale as the baseline it is compared with.
    fn windows(&self) -> [(Duration, Duration); 4] {
        let same_as_before = self.before.1 - self.before.0;
        [
            self.before,
            self.during,
            self.after,
            (self.during.0, self.during.0 + same_as_before),
        ]
    }
}

/// What pruning did, and the server's cutoff (now − prune age, microseconds) as it started
/// and as it ended.
#[derive(Debug)]
struct Pruned {
    how: PruneResult,
    cutoff_start: i64,
    cutoff_end: i64,
}

#[derive(Debug)]
enum PruneResult {
    RowWise {
        deleted: u64,
        batches: u64,
        capped: bool,
    },
    Dropped(PartitionReport),
}

impl Bench {
    /// Runs the prune scenario on each table of `options`, in a schema of its own.
    pub(crate) async fn prune(&self, options: &Options) -> anyhow::Result<Report> {
        ensure!(options.claims >= 1000, "--claims must be at least 1000");
        ensure!(
            options.claims <= 1_000_000_000,
            "--claims must be at most 1000000000"
        );
        let schema = format!("idem_bench_prune_{}", std::process::id());
        let result = self.prune_in(&schema, options).await;
        if let Err(e) = sqlx::raw_sql(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
            .execute(&self.admin)
            .await
        {
            eprintln!("warning: dropping schema {schema}: {e:#}");
        }
        result
    }

    async fn prune_in(&self, schema: &str, options: &Options) -> anyhow::Result<Report> {
        sqlx::raw_sql(&format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE;
             CREATE SCHEMA {schema};
             CREATE TABLE {schema}.idem_bench_accounts (id text PRIMARY KEY, balance bigint NOT NULL);
             CREATE TABLE {schema}.idem_bench_charges (
                 id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                 account text NOT NULL,
                 amount bigint NOT NULL);"
        ))
        .execute(&self.admin)
        .await
        .context("creating the prune scenario's schema")?;
        let mut legs = Vec::new();
        for &layout in &options.layouts {
            sqlx::raw_sql(&format!(
                "TRUNCATE {schema}.idem_bench_charges, {schema}.idem_bench_accounts;
                 INSERT INTO {schema}.idem_bench_accounts (id, balance)
                     SELECT 'acc-' || lpad(i::text, 4, '0'), 0 FROM generate_series(0, {}) AS i;
                 ANALYZE {schema}.idem_bench_accounts;",
                ACCOUNTS - 1
            ))
            .execute(&self.admin)
            .await
            .context("seeding the accounts")?;
            legs.push(self.prune_leg(schema, layout, options).await?);
        }
        Ok(Report {
            options: options.clone(),
            legs,
        })
    }

    /// The store on `layout`'s table, on a small pool whose connections (and held ones) find
    /// the handler's tables in `schema`.
    async fn prune_store(
        &self,
        schema: &str,
        layout: Layout,
        options: &Options,
    ) -> anyhow::Result<PostgresStore> {
        let connect = self
            .url
            .parse::<PgConnectOptions>()?
            .options([("search_path", schema)]);
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(connect)
            .await?;
        let table = TableName::new(&format!("{schema}.{}_claims", layout.name()))?;
        let store = PostgresStore::from_pool(pool)
            .with_table(table)?
            .with_requests_table(TableName::new(&format!("{schema}.requests"))?)?;
        Ok(match layout {
            Layout::Plain => store,
            Layout::Legacy | Layout::Partitioned => store.partitioned(
                Partitioning::uuid_v7()
                    .retention(options.retention()?)
                    .ahead(Duration::from_secs(2 * 86_400)),
            )?,
        })
    }

    async fn prune_leg(
        &self,
        schema: &str,
        layout: Layout,
        options: &Options,
    ) -> anyhow::Result<Leg> {
        let name = layout.name();
        let store = self.prune_store(schema, layout, options).await?;
        let table = store.table().to_string();
        let now_us: i64 = sqlx::query_scalar(SERVER_NOW)
            .fetch_one(&self.admin)
            .await?;
        let end_ms = now_us / 1000 - FILL_ENDS_BEFORE_MS;
        let span_ms = FILL_DAYS as i64 * DAY_MS - FILL_ENDS_BEFORE_MS;
        let fill = Fill {
            n: options.claims,
            start_ms: end_ms - span_ms,
            span_ms,
        };
        let mut checks = Vec::new();
        if layout == Layout::Legacy {
            // The table as versions before the bounded layout made it; migrate keeps it.
            let p = store.partitioning().context("partitioned")?;
            for sql in
                idem_dialect::postgres::maintenance::legacy_create_statements(store.table(), p)
            {
                sqlx::raw_sql(&sql).execute(&self.admin).await?;
            }
        }
        store.migrate().await?;
        if layout.by_day() {
            // Today and the days ahead first (nothing to drop yet), then the fill's days.
            store.maintain_partitions().await?;
            let first = Day::of(Timestamp::from_micros(fill.start_ms * 1000));
            let last = Day::of(Timestamp::from_micros(end_ms * 1000));
            store
                .create_partitions((first.number()..=last.number()).map(Day::from_number))
                .await?;
        }

        eprintln!(
            "prune, {name} table: filling {} claims",
            thousands(fill.n as f64)
        );
        let fill_took = self.fill(&table, layout, &fill).await?;
        let started = Instant::now();
        sqlx::raw_sql(&format!("VACUUM ANALYZE {table}"))
            .execute(&self.admin)
            .await?;
        // Needs superuser or pg_checkpoint; without it a checkpoint may land in a window.
        let _ = sqlx::raw_sql("CHECKPOINT").execute(&self.admin).await;
        let vacuum_took = started.elapsed();
        checks.push(self.check_fill(&store, layout, &fill).await?);

        let processor = Arc::new(
            Processor::builder(
                store
                    .clone()
                    .hold_connections(u32::try_from(options.workers)?),
                CONSUMER,
            )
            .build()?,
        );
        eprintln!(
            "prune, {name} table: consumer with {}, pruning after {:.0} s",
            plural(options.workers, "worker"),
            (options.warmup() + options.before).as_secs_f64()
        );
        let (timeline, pruned, sizes, logs) =
            self.under_load(&store, &processor, layout, options).await?;
        let retries = logs.iter().map(|l| l.retries).sum();
        let mut done: Vec<Done> = logs.into_iter().flat_map(|l| l.done).collect();
        done.sort_by_key(|d| d.at_ns);
        let windows = timeline
            .windows()
            .map(|(from, to)| window_stats(&done, from, to));

        checks.extend(
            self.check_pruned(&store, layout, &fill, &pruned, done.len() as u64, retries)
                .await?,
        );
        checks.push(redelivered(&processor, &store, &fill, layout, &pruned).await?);

        let prune_took = timeline.during.1 - timeline.during.0;
        let (pruned_by, removed, capped) = match &pruned.how {
            PruneResult::RowWise {
                deleted,
                batches,
                capped,
            } => (
                format!(
                    "row-wise: `prune_all`'s loop, batches of {}",
                    thousands(f64::from(options.batch))
                ),
                format!(
                    "{} in {} batch{}",
                    thousands(*deleted as f64),
                    thousands(*batches as f64),
                    if *batches == 1 { "" } else { "es" }
                ),
                *capped,
            ),
            PruneResult::Dropped(report) => {
                let boundary = Day::of(Timestamp::from_micros(pruned.cutoff_start)).start();
                let exact = fill.n - fill.count_from(|i| fill.ms(i) * 1000 >= boundary);
                let estimate: u64 = report.dropped.iter().map(|(_, n)| n).sum();
                let mut removed = format!(
                    "{} in {} day partitions (planner's estimate {})",
                    thousands(exact as f64),
                    report.dropped.len(),
                    thousands(estimate as f64)
                );
                if report.moved > 0 {
                    let _ = write!(removed, "; {} moved", thousands(report.moved as f64));
                }
                let how = if layout == Layout::Legacy {
                    "partition drop under ACCESS EXCLUSIVE (DEFAULT-partition layout): \
                     `maintain_partitions`"
                } else {
                    "DETACH … CONCURRENTLY, then DROP (bounded layout): `maintain_partitions`"
                };
                (how.to_string(), removed, false)
            }
        };
        sqlx::raw_sql(&format!("DROP TABLE {table}"))
            .execute(&self.admin)
            .await?;
        store.pool().close().await;
        Ok(Leg {
            layout,
            fill_took,
            vacuum_took,
            pruned_by,
            removed,
            prune_took,
            capped,
            size_before: sizes.0,
            size_after: sizes.1,
            windows,
            retries,
            checks,
        })
    }

    /// Fills `table` with `fill`'s claims in chunks; returns how long it took.
    async fn fill(&self, table: &str, layout: Layout, fill: &Fill) -> anyhow::Result<Duration> {
        let (columns, values) = match layout {
            Layout::Plain => ("", ""),
            // The partition key is the ID's time in microseconds (Partitioning::key_of).
            Layout::Legacy | Layout::Partitioned => (", id_time", ", ms * 1000"),
        };
        let sql = format!(
            "INSERT INTO {table} (consumer, message_id, fingerprint, processed_at{columns}) \
             SELECT $4, {FILL_ID}, sha256(int8send(i)), ms * 1000 + {PROCESSED_AFTER_US}{values} \
             FROM ({FILL_ROWS} FROM generate_series($5::bigint, $6::bigint - 1) AS i) s"
        );
        let started = Instant::now();
        let mut lo = 0;
        while lo < fill.n {
            let hi = (lo + FILL_CHUNK).min(fill.n);
            sqlx::query(&sql)
                .bind(fill.start_ms)
                .bind(fill.span_ms)
                .bind(fill.n as i64)
                .bind(CONSUMER)
                .bind(lo as i64)
                .bind(hi as i64)
                .execute(&self.admin)
                .await
                .with_context(|| format!("filling claims {lo}..{hi}"))?;
            lo = hi;
            if fill.n > FILL_CHUNK {
                eprintln!(
                    "  {} / {} ({:.0} s)",
                    thousands(lo as f64),
                    thousands(fill.n as f64),
                    started.elapsed().as_secs_f64()
                );
            }
        }
        Ok(started.elapsed())
    }

    /// Claims `sample` of the fill, as the fill's SQL names them: `(i, message_id)`.
    async fn fill_ids(&self, fill: &Fill, sample: &[i64]) -> anyhow::Result<Vec<(i64, Vec<u8>)>> {
        let sql = format!(
            "SELECT i, {FILL_ID} FROM ({FILL_ROWS} FROM unnest($4::bigint[]) AS i) s ORDER BY i"
        );
        Ok(sqlx::query_as(&sql)
            .bind(fill.start_ms)
            .bind(fill.span_ms)
            .bind(fill.n as i64)
            .bind(sample)
            .fetch_all(&self.admin)
            .await?)
    }

    /// The filled IDs are UUIDv7 of the intended time, and on the partitioned table their
    /// `id_time` is the store's partition key and every claim sits in its day's partition.
    async fn check_fill(
        &self,
        store: &PostgresStore,
        layout: Layout,
        fill: &Fill,
    ) -> anyhow::Result<String> {
        let table = store.table();
        let count: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
            .fetch_one(&self.admin)
            .await?;
        ensure!(
            count as u64 == fill.n,
            "the fill left {count} claims, not {}",
            fill.n
        );
        let sample = self.fill_ids(fill, &fill.sample(16)).await?;
        let key = Partitioning::uuid_v7();
        for (i, id) in &sample {
            let id = idem_core::MessageId::new(id)?;
            let want = fill.ms(*i as u64) * 1000;
            let key_of = key.key_of(&id)?;
            ensure!(
                id.len() == 36 && key_of == want,
                "filled claim {i}: ID {id} does not read as UUIDv7 time {want} µs"
            );
            if layout.by_day() {
                let stored: i64 = sqlx::query_scalar(&format!(
                    "SELECT id_time FROM {table} WHERE consumer = $1 AND message_id = $2"
                ))
                .bind(CONSUMER)
                .bind(id.as_bytes())
                .fetch_one(&self.admin)
                .await
                .with_context(|| format!("filled claim {i} ({id}) is missing"))?;
                ensure!(
                    stored == key_of,
                    "filled claim {i}: id_time {stored} is not the partition key {key_of}"
                );
            }
        }
        if layout == Layout::Plain {
            return Ok(format!(
                "fill: {} claims; {} sampled IDs are UUIDv7 (36 characters) of the intended time",
                thousands(fill.n as f64),
                sample.len()
            ));
        }
        let partitions = store.partitions().await?;
        let days = partitions
            .iter()
            .filter(|p| matches!(p.kind, PartitionKind::Day(_)))
            .count();
        for p in &partitions {
            if matches!(p.kind, PartitionKind::Default | PartitionKind::Undated) {
                let n = self.exact_count(store, &p.name).await?;
                ensure!(n == 0, "{} holds {n} filled claims; expected none", p.name);
            }
        }
        Ok(format!(
            "fill: {} claims in {days} day partitions, none in the default or undated one; {} \
             sampled IDs are UUIDv7 of the intended time and their `id_time` is \
             `Partitioning::key_of`",
            thousands(fill.n as f64),
            sample.len()
        ))
    }

    /// `sql`, a `count(*)` with these parameters.
    async fn count(&self, sql: &str, params: &[i64]) -> anyhow::Result<u64> {
        let mut q = sqlx::query_scalar::<_, i64>(sql);
        for p in params {
            q = q.bind(*p);
        }
        Ok(q.fetch_one(&self.admin).await? as u64)
    }

    async fn exact_count(&self, store: &PostgresStore, partition: &str) -> anyhow::Result<u64> {
        let qualified = match store.table().schema() {
            Some(s) if !partition.contains('.') => format!("{s}.{partition}"),
            _ => partition.to_string(),
        };
        let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {qualified}"))
            .fetch_one(&self.admin)
            .await?;
        Ok(n as u64)
    }

    /// The table's size on disk, its partitions and indexes included.
    async fn table_bytes(&self, table: &str) -> anyhow::Result<u64> {
        let bytes: i64 = sqlx::query_scalar(
            "SELECT coalesce((SELECT sum(pg_total_relation_size(relid))::bigint \
             FROM pg_partition_tree($1::regclass)), pg_total_relation_size($1::regclass))",
        )
        .bind(table)
        .fetch_one(&self.admin)
        .await?;
        Ok(bytes as u64)
    }

    async fn server_cutoff(&self, options: &Options) -> anyhow::Result<i64> {
        let now: i64 = sqlx::query_scalar(SERVER_NOW)
            .fetch_one(&self.admin)
            .await?;
        let age = i64::try_from(options.retention()?.prune_age().as_micros())?;
        Ok(now - age)
    }

    /// Runs the consumer for the warm-up, the before window, the pruning and the after
    /// window; stops it whatever happens, and returns the timeline, what pruning did, the
    /// table's size before and after pruning, and each worker's log.
    async fn under_load(
        &self,
        store: &PostgresStore,
        processor: &Arc<Processor<PostgresStore>>,
        layout: Layout,
        options: &Options,
    ) -> anyhow::Result<(Timeline, Pruned, (u64, u64), Vec<Log>)> {
        let stop = Arc::new(AtomicBool::new(false));
        let ids = self.settings.ids();
        let start = Instant::now();
        let workers: Vec<_> = (0..options.workers)
            .map(|w| {
                let (processor, stop) = (Arc::clone(processor), Arc::clone(&stop));
                tokio::spawn(consume(processor, ids, w, start, stop))
            })
            .collect();
        let timed = async {
            tokio::time::sleep(options.warmup()).await;
            let table = store.table().to_string();
            let size_before = self.table_bytes(&table).await?;
            let before_from = start.elapsed();
            tokio::time::sleep(options.before).await;
            let cutoff_start = self.server_cutoff(options).await?;
            let during_from = start.elapsed();
            let how = prune(store, layout, options).await?;
            let during_to = start.elapsed();
            let cutoff_end = self.server_cutoff(options).await?;
            let size_after = self.table_bytes(&table).await?;
            eprintln!(
                "prune, {} table: pruned in {:.2} s; measuring after",
                layout.name(),
                (during_to - during_from).as_secs_f64()
            );
            let after_from = start.elapsed();
            tokio::time::sleep(options.after).await;
            let after_to = start.elapsed();
            anyhow::Ok((
                Timeline {
                    before: (before_from, during_from),
                    during: (during_from, during_to),
                    after: (after_from, after_to),
                },
                Pruned {
                    how,
                    cutoff_start,
                    cutoff_end,
                },
                (size_before, size_after),
            ))
        }
        .await;
        stop.store(true, Ordering::Relaxed);
        let mut logs = Vec::with_capacity(workers.len());
        let mut failed = None;
        for w in workers {
            match w.await.context("consumer worker panicked").and_then(|r| r) {
                Ok(log) => logs.push(log),
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        let (timeline, pruned, sizes) = timed?;
        if let Some(e) = failed {
            return Err(e);
        }
        Ok((timeline, pruned, sizes, logs))
    }

    /// Whatever pruning should have removed is gone, what it should have kept is there (every
    /// filled claim younger than the cutoff, and every claim the consumer made), counted
    /// exactly against the fill's formula.
    async fn check_pruned(
        &self,
        store: &PostgresStore,
        layout: Layout,
        fill: &Fill,
        pruned: &Pruned,
        consumed: u64,
        retries: u64,
    ) -> anyhow::Result<Vec<String>> {
        let table = store.table();
        let last = fill.last_processed_at();
        let mut out = Vec::new();
        let new_claims = self
            .count(
                &format!("SELECT count(*) FROM {table} WHERE processed_at > $1"),
                &[last],
            )
            .await?;
        // A retried COMMIT whose outcome was unknown may have committed: at least, then.
        ensure!(
            new_claims == consumed || (retries > 0 && new_claims >= consumed),
            "the consumer completed {consumed} messages but {new_claims} of its claims remain"
        );
        match (layout, &pruned.how) {
            (Layout::Plain, PruneResult::RowWise { capped, .. }) => {
                let old = self
                    .count(
                        &format!("SELECT count(*) FROM {table} WHERE processed_at < $1"),
                        &[pruned.cutoff_start],
                    )
                    .await?;
                if *capped {
                    out.push(format!(
                        "capped: {} claims older than the prune age were left",
                        thousands(old as f64)
                    ));
                } else {
                    ensure!(
                        old == 0,
                        "{old} claims older than the prune age survived row-wise pruning"
                    );
                }
                let cutoff = pruned.cutoff_end;
                let kept = self
                    .count(
                        &format!(
                            "SELECT count(*) FROM {table} WHERE processed_at >= $1 \
                             AND processed_at <= $2"
                        ),
                        &[cutoff, last],
                    )
                    .await?;
                let want = fill.count_from(|i| fill.processed_at(i) >= cutoff);
                ensure!(
                    kept == want,
                    "{kept} filled claims younger than the prune age remain, expected {want}"
                );
                out.push(format!(
                    "after: no claim older than the prune age{}; all {} filled claims younger \
                     than it and all {} the consumer made are there",
                    if *capped { " (capped: see above)" } else { "" },
                    thousands(kept as f64),
                    thousands(new_claims as f64)
                ));
            }
            (Layout::Legacy | Layout::Partitioned, PruneResult::Dropped(_)) => {
                let boundary = Day::of(Timestamp::from_micros(pruned.cutoff_start));
                let gone = self
                    .count(
                        &format!("SELECT count(*) FROM {table} WHERE id_time < $1"),
                        &[boundary.start()],
                    )
                    .await?;
                ensure!(
                    gone == 0,
                    "{gone} claims of days wholly past the retention survived the partition drop"
                );
                let partitions = store.partitions().await?;
                if let Some(p) = partitions
                    .iter()
                    .find(|p| matches!(p.kind, PartitionKind::Day(d) if d < boundary))
                {
                    bail!(
                        "partition {} is wholly past the retention but was not dropped",
                        p.name
                    );
                }
                let first_kept = Day::of(Timestamp::from_micros(pruned.cutoff_end)).start();
                let kept = self
                    .count(
                        &format!(
                            "SELECT count(*) FROM {table} WHERE id_time >= $1 \
                             AND processed_at <= $2"
                        ),
                        &[first_kept, last],
                    )
                    .await?;
                let want = fill.count_from(|i| fill.ms(i) * 1000 >= first_kept);
                ensure!(
                    kept == want,
                    "{kept} filled claims of the kept days remain, expected {want}"
                );
                let old_kept = self
                    .count(
                        &format!("SELECT count(*) FROM {table} WHERE processed_at < $1"),
                        &[pruned.cutoff_start],
                    )
                    .await?;
                let mut default = 0;
                for p in &partitions {
                    if matches!(p.kind, PartitionKind::Default) {
                        default += self.exact_count(store, &p.name).await?;
                    }
                }
                out.push(format!(
                    "after: no claim of a day wholly past the retention, and no such day's \
                     partition; all {} filled claims of the kept days and all {} the consumer \
                     made are there; {} of them older than the prune age wait in the boundary \
                     day {boundary}, dropped with it once the whole day is past; {default} in \
                     the default partition",
                    thousands(kept as f64),
                    thousands(new_claims as f64),
                    thousands(old_kept as f64),
                ));
            }
            _ => bail!("pruning did not match the table's layout"),
        }
        // Sampled claims by their own IDs: the old gone, the young there.
        let sample = self.fill_ids(fill, &fill.sample(64)).await?;
        let mut young = 0;
        for (i, id) in &sample {
            let i = *i as u64;
            let there: bool = sqlx::query_scalar(&format!(
                "SELECT EXISTS (SELECT 1 FROM {table} WHERE consumer = $1 AND message_id = $2)"
            ))
            .bind(CONSUMER)
            .bind(id)
            .fetch_one(&self.admin)
            .await?;
            let (should_be_gone, should_be_there) = expected_presence(fill, i, layout, pruned);
            if should_be_gone && there {
                bail!("sampled claim {i} is older than the prune age but still there");
            }
            if should_be_there && !there {
                bail!("sampled claim {i} is younger than the prune age but gone");
            }
            young += u32::from(should_be_there);
        }
        out.push(format!(
            "sample: {} of the fill's IDs looked up by ID: the {young} younger than the prune age \
             all there, the older ones gone",
            sample.len()
        ));
        Ok(out)
    }
}

/// Whether sampled claim `i` must be gone, and whether it must be there, after `pruned`.
fn expected_presence(fill: &Fill, i: u64, layout: Layout, pruned: &Pruned) -> (bool, bool) {
    match (layout, &pruned.how) {
        (Layout::Plain, PruneResult::RowWise { capped, .. }) => (
            !capped && fill.processed_at(i) < pruned.cutoff_start,
            fill.processed_at(i) >= pruned.cutoff_end,
        ),
        _ => {
            let gone_before = Day::of(Timestamp::from_micros(pruned.cutoff_start)).start();
            let kept_from = Day::of(Timestamp::from_micros(pruned.cutoff_end)).start();
            let t = fill.ms(i) * 1000;
            (t < gone_before, t >= kept_from)
        }
    }
}

/// Removes the old half: row by row on the plain table, by dropping whole days on the
/// partitioned one.
async fn prune(
    store: &PostgresStore,
    layout: Layout,
    options: &Options,
) -> anyhow::Result<PruneResult> {
    match layout {
        Layout::Plain => {
            // `prune_all`'s loop (batches until one comes back short), with a deadline
            // checked between batches so that a slow row-wise prune can be capped.
            let age = options.retention()?.prune_age();
            let started = Instant::now();
            let (mut deleted, mut batches, mut said) = (0u64, 0u64, Instant::now());
            loop {
                if started.elapsed() >= options.cap {
                    return Ok(PruneResult::RowWise {
                        deleted,
                        batches,
                        capped: true,
                    });
                }
                let n = store
                    .prune_batch(None, Stamp::StoreClock, age, options.batch)
                    .await?;
                deleted += n;
                batches += 1;
                if n < u64::from(options.batch) {
                    return Ok(PruneResult::RowWise {
                        deleted,
                        batches,
                        capped: false,
                    });
                }
                if said.elapsed() >= Duration::from_secs(10) {
                    said = Instant::now();
                    eprintln!(
                        "  {} deleted ({:.0} s)",
                        thousands(deleted as f64),
                        started.elapsed().as_secs_f64()
                    );
                }
            }
        }
        Layout::Legacy | Layout::Partitioned => {
            Ok(PruneResult::Dropped(store.maintain_partitions().await?))
        }
    }
}

/// One consumer worker: fresh UUIDv7 messages through `Processor::process` until `stop`.
async fn consume(
    processor: Arc<Processor<PostgresStore>>,
    ids: Ids,
    worker: usize,
    start: Instant,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<Log> {
    let mut log = Log {
        done: Vec::with_capacity(1 << 16),
        retries: 0,
    };
    let mut seq = 0;
    while !stop.load(Ordering::Relaxed) {
        let ms = Timestamp::from(SystemTime::now()).as_micros() / 1000;
        let d = ids.delivery_v7(worker, seq, u64::try_from(ms)?)?;
        seq += 1;
        let began = Instant::now();
        let result = processor.process(&d, async |tx| charge(tx, &d).await).await;
        let done = Instant::now();
        match result {
            Ok(outcome) => {
                if let Err(e) = expect_processed(&d, outcome) {
                    stop.store(true, Ordering::Relaxed);
                    return Err(e);
                }
                log.done.push(Done {
                    at_ns: u64::try_from((done - start).as_nanos())?,
                    latency_us: u32::try_from((done - began).as_micros()).unwrap_or(u32::MAX),
                });
            }
            Err(e) if e.is_retryable() => log.retries += 1,
            Err(e) => {
                stop.store(true, Ordering::Relaxed);
                return Err(anyhow::Error::new(e).context(format!("consumer worker {worker}")));
            }
        }
    }
    Ok(log)
}

/// A filled claim delivered again, carrying the fingerprint its first processing stored.
#[derive(Debug)]
struct Redelivery {
    id: idem_core::MessageId,
    fingerprint: Fingerprint,
}

impl Identified for Redelivery {
    fn message_id(&self) -> &idem_core::MessageId {
        &self.id
    }

    fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }
}

/// Filled claims younger than the prune age, delivered again through the consumer's
/// processor, are duplicates: the handler does not run. On the partitioned table this is the
/// test that a redelivery finds its claim by the partition key its ID carries.
async fn redelivered(
    processor: &Processor<PostgresStore>,
    store: &PostgresStore,
    fill: &Fill,
    layout: Layout,
    pruned: &Pruned,
) -> anyhow::Result<String> {
    let young: Vec<i64> = fill
        .sample(64)
        .into_iter()
        .filter(|&i| expected_presence(fill, i as u64, layout, pruned).1)
        .rev()
        .take(4)
        .collect();
    ensure!(
        !young.is_empty(),
        "no filled claim is younger than the prune age"
    );
    let table = store.table();
    let sql = format!(
        "SELECT {FILL_ID}, t.fingerprint FROM ({FILL_ROWS} FROM unnest($4::bigint[]) AS i) s \
         JOIN {table} t ON t.consumer = $5 AND t.message_id = {FILL_ID}"
    );
    let rows: Vec<(Vec<u8>, Vec<u8>)> = sqlx::query_as(&sql)
        .bind(fill.start_ms)
        .bind(fill.span_ms)
        .bind(fill.n as i64)
        .bind(&young)
        .bind(CONSUMER)
        .fetch_all(store.pool())
        .await?;
    ensure!(
        rows.len() == young.len(),
        "{} of {} sampled young claims found",
        rows.len(),
        young.len()
    );
    for (id, fp) in rows {
        let again = Redelivery {
            id: idem_core::MessageId::new(&id)?,
            fingerprint: Fingerprint::from_slice(&fp).context("a stored fingerprint")?,
        };
        let outcome = processor
            .process(&again, async |_tx| {
                Err::<(), _>(anyhow::anyhow!("the handler ran for a redelivery"))
            })
            .await?;
        ensure!(
            matches!(outcome, Outcome::Duplicate),
            "redelivered {} was {outcome:?}, not a duplicate",
            again.id
        );
    }
    Ok(format!(
        "redelivery: {} filled IDs younger than the prune age, processed again, are `Duplicate`",
        young.len()
    ))
}

/// Throughput and latency of the messages completed in `[from, to)`; `done` sorted by time.
fn window_stats(done: &[Done], from: Duration, to: Duration) -> WindowStats {
    let (a, b) = (from.as_nanos() as u64, to.as_nanos() as u64);
    let lo = done.partition_point(|d| d.at_ns < a);
    let hi = done.partition_point(|d| d.at_ns < b);
    let mut latencies: Vec<u32> = done[lo..hi].iter().map(|d| d.latency_us).collect();
    latencies.sort_unstable();
    let rank = |q: f64| -> u32 {
        if latencies.is_empty() {
            return 0;
        }
        // Nearest rank: the smallest latency at least a fraction `q` of messages reach.
        let k = ((q * latencies.len() as f64).ceil() as usize).clamp(1, latencies.len());
        latencies[k - 1]
    };
    WindowStats {
        seconds: (to - from).as_secs_f64(),
        messages: latencies.len() as u64,
        p50_us: rank(0.50),
        p99_us: rank(0.99),
        max_us: latencies.last().copied().unwrap_or(0),
    }
}

/// The target on the partition drop: p99 during pruning within 1.2× of before.
const P99_TARGET: f64 = 1.2;

impl Report {
    fn title(&self) -> String {
        format!(
            "Prune under load, PostgreSQL: {} claims over {FILL_DAYS} days, {}",
            thousands(self.options.claims as f64),
            plural(self.options.workers, "worker")
        )
    }

    /// How the scenario measures, one line each.
    pub(crate) fn method(&self) -> Vec<String> {
        let o = &self.options;
        let fills: Vec<String> = self
            .legs
            .iter()
            .map(|l| {
                format!(
                    "{} {:.0} s + VACUUM ANALYZE and CHECKPOINT {:.0} s",
                    l.layout.name(),
                    l.fill_took.as_secs_f64(),
                    l.vacuum_took.as_secs_f64()
                )
            })
            .collect();
        vec![
            format!(
                "fill: consumer `{CONSUMER}`, IDs UUIDv7 text (36 bytes) spread evenly over the \
                 {FILL_DAYS} days before the run, fingerprint 32 bytes, processed_at = ID time \
                 + 3 s; `INSERT … SELECT … FROM generate_series` in chunks of {}, in time order; \
                 the partitioned tables' day partitions created first (`create_partitions`); \
                 took {}",
                thousands(FILL_CHUNK as f64),
                fills.join(", ")
            ),
            format!(
                "consumer: {}, `Processor::process` on the store with `hold_connections({})`, \
                 P1's handler (a charge row + a balance UPDATE on one of 1,000 accounts), fresh \
                 UUIDv7 IDs; latency = one `process` call end to end (BEGIN + claim, handler, \
                 COMMIT), counted in the window it completes in",
                plural(o.workers, "worker"),
                o.workers
            ),
            format!(
                "retention: `Retention::new(7 d, 7 d)`, prune age 7 d 1 h (about half the fill \
                 older); row-wise: `prune_batch(None, Stamp::StoreClock, 7 d 1 h, {})` until a \
                 short batch, as `prune_all` does, stopped after {:.0} s; legacy and \
                 partitioned: `maintain_partitions()`, which takes out the days wholly older \
                 than the prune age (legacy: `DROP TABLE` of each under ACCESS EXCLUSIVE on the \
                 table; partitioned: `DETACH PARTITION … CONCURRENTLY` of each, then one \
                 transaction that drops them and re-bounds the default partition)",
                thousands(f64::from(o.batch)),
                o.cap.as_secs_f64()
            ),
            format!(
                "windows: before = {:.0} s after a {:.1} s warm-up; during = pruning, however \
                 long it takes; after = {:.0} s once pruning returned; and {} = as long as \
                 before, from the start of pruning (a short drop seen on the baseline's time \
                 scale); sizes: `pg_total_relation_size` over the table, its partitions and \
                 indexes, just before and just after pruning",
                o.before.as_secs_f64(),
                o.warmup().as_secs_f64(),
                o.after.as_secs_f64(),
                self.since_start()
            ),
        ]
    }

    fn rows(&self) -> (Vec<[String; 6]>, Vec<[String; 9]>) {
        let prunes = self
            .legs
            .iter()
            .map(|l| {
                [
                    l.layout.name().to_string(),
                    l.pruned_by.clone(),
                    format!(
                        "{}{}",
                        seconds(l.prune_took),
                        if l.capped { " (capped)" } else { "" }
                    ),
                    l.removed.clone(),
                    mib(l.size_before),
                    mib(l.size_after),
                ]
            })
            .collect();
        let mut windows = Vec::new();
        for l in &self.legs {
            let before = l.windows[0].p99_us;
            let names = ["before", "during", "after", &self.since_start()];
            for (name, w) in names.iter().zip(&l.windows) {
                windows.push([
                    l.layout.name().to_string(),
                    name.to_string(),
                    format!("{:.2}", w.seconds),
                    thousands(w.messages as f64),
                    thousands(w.rate()),
                    ms(w.p50_us),
                    ms(w.p99_us),
                    ms(w.max_us),
                    ratio(w.p99_us, before),
                ]);
            }
        }
        (prunes, windows)
    }

    /// The fourth window's name.
    fn since_start(&self) -> String {
        format!("{:.0} s from its start", self.options.before.as_secs_f64())
    }

    /// The ratio lines and the checks.
    fn lines(&self) -> Vec<String> {
        let mut out = Vec::new();
        for l in &self.legs {
            let before = l.windows[0].p99_us;
            let r = |w: &WindowStats| {
                if before > 0 {
                    f64::from(w.p99_us) / f64::from(before)
                } else {
                    0.0
                }
            };
            let (during, from_start) = (r(&l.windows[1]), r(&l.windows[3]));
            out.push(match l.layout {
                Layout::Legacy => format!(
                    "legacy: p99 during / before = {during:.2} (the DEFAULT-partition layout's \
                     drop, for comparison: no target); over the {} = {from_start:.2}",
                    self.since_start()
                ),
                Layout::Partitioned => format!(
                    "partitioned: p99 during / before = {during:.2} (target ≤ {P99_TARGET:.2}): \
                     {}; over the {} = {from_start:.2}",
                    crate::verdict(before > 0 && during <= P99_TARGET),
                    self.since_start()
                ),
                Layout::Plain => format!(
                    "plain: p99 during / before = {during:.2} (row-wise: reported, no target); \
                     over the {} = {from_start:.2}",
                    self.since_start()
                ),
            });
        }
        for l in &self.legs {
            for c in &l.checks {
                out.push(format!("{}: {c}", l.layout.name()));
            }
            if l.retries > 0 {
                out.push(format!(
                    "{}: {} retryable errors (deadlock/serialization), not counted",
                    l.layout.name(),
                    l.retries
                ));
            }
        }
        out
    }

    /// The report as Markdown, under a `###` heading.
    pub(crate) fn markdown(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "\n### {}\n", self.title());
        for m in self.method() {
            let _ = writeln!(out, "- {m}");
        }
        let (prunes, windows) = self.rows();
        let _ = writeln!(
            out,
            "\n| table | pruned by | took | claims removed | size before | size after |"
        );
        let _ = writeln!(out, "|---|---|---:|---|---:|---:|");
        for r in prunes {
            let _ = writeln!(out, "| {} |", r.join(" | "));
        }
        let _ = writeln!(
            out,
            "\n| table | window | seconds | messages | msg/s | p50 ms | p99 ms | max ms | p99 / before |"
        );
        let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|---:|");
        for r in windows {
            let _ = writeln!(out, "| {} |", r.join(" | "));
        }
        let _ = writeln!(out);
        for l in self.lines() {
            let _ = writeln!(out, "- {l}");
        }
        out
    }

    /// The report as plain text.
    pub(crate) fn plain(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "\n{}", self.title());
        for m in self.method() {
            let _ = writeln!(out, "  {m}");
        }
        let (prunes, windows) = self.rows();
        for r in prunes {
            let _ = writeln!(
                out,
                "  {:<12} {:<48} took {:>10}  removed {}; size {} -> {}",
                r[0], r[1], r[2], r[3], r[4], r[5]
            );
        }
        let _ = writeln!(
            out,
            "  {:<12} {:<7} {:>8} {:>9} {:>8} {:>7} {:>7} {:>8} {:>6}",
            "table",
            "window",
            "seconds",
            "messages",
            "msg/s",
            "p50 ms",
            "p99 ms",
            "max ms",
            "p99 ×"
        );
        for r in windows {
            let _ = writeln!(
                out,
                "  {:<12} {:<7} {:>8} {:>9} {:>8} {:>7} {:>7} {:>8} {:>6}",
                r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8]
            );
        }
        for l in self.lines() {
            let _ = writeln!(out, "  · {l}");
        }
        out
    }
}

fn seconds(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 10.0 {
        format!("{s:.2} s")
    } else {
        format!("{s:.1} s")
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

fn ms(us: u32) -> String {
    format!("{:.2}", f64::from(us) / 1000.0)
}

fn ratio(x: u32, base: u32) -> String {
    if base > 0 {
        format!("{:.2}", f64::from(x) / f64::from(base))
    } else {
        "–".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill() -> Fill {
        Fill {
            n: 1000,
            start_ms: 1_700_000_000_000,
            span_ms: 14 * DAY_MS,
        }
    }

    #[test]
    fn the_fill_is_in_time_order_and_counts_from_a_cutoff() {
        let f = fill();
        assert_eq!(f.ms(0), f.start_ms);
        assert!(f.ms(999) < f.start_ms + f.span_ms);
        let cut = f.processed_at(400);
        assert_eq!(f.count_from(|i| f.processed_at(i) >= cut), 600);
        assert_eq!(f.count_from(|_| true), 1000);
        assert_eq!(f.count_from(|_| false), 0);
    }

    #[test]
    fn samples_cover_the_fill_once() {
        let s = fill().sample(64);
        assert_eq!(s.first(), Some(&0));
        assert_eq!(s.last(), Some(&999));
        assert!(s.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn windows_count_what_completes_inside_them() {
        let done: Vec<Done> = (0..100u64)
            .map(|k| Done {
                at_ns: k * 10_000_000,
                latency_us: if k == 57 { 9_000 } else { 1_000 + k as u32 },
            })
            .collect();
        let w = window_stats(
            &done,
            Duration::from_millis(500),
            Duration::from_millis(600),
        );
        assert_eq!(w.messages, 10);
        assert_eq!(w.max_us, 9_000);
        assert_eq!(w.p99_us, 9_000);
        assert_eq!(w.p50_us, 1_054);
        assert!((w.rate() - 100.0).abs() < 1e-9);
    }
}
