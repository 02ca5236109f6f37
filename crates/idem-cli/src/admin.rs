//! `idem migrate`, `idem prune`, `idem stats`, `idem reap-requests`: operators' commands on
//! any SQL store.
//!
//! On PostgreSQL a claims table partitioned by the ID's time is used as it records itself
//! (`AnyStore::connect` reads the record `migrate` writes): `idem prune` drops its days past
//! the table's own retention and deletes rows of its default and undated partitions only,
//! as the consumers' pruning does; a plain table is pruned row by row.

use std::time::Duration;

use anyhow::Context;
use idem_core::{ConsumerName, Retention, format_duration, parse_duration};
use idem_sql::{AnyStore, TableName};

/// Where the claims live.
#[derive(clap::Args)]
pub(crate) struct StoreArgs {
    /// Store URL: sqlite:PATH, postgres://…, mysql://…
    #[arg(long, value_name = "URL")]
    store: String,
    /// Claims table name.
    #[arg(long, default_value = idem_sql::DEFAULT_TABLE)]
    table: String,
}

/// The store URL may hold a password: shown through [`idem_redact::redact_url`].
impl std::fmt::Debug for StoreArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreArgs")
            .field("store", &idem_redact::redact_url(&self.store))
            .field("table", &self.table)
            .finish()
    }
}

/// The store URL may hold a password: shown through [`idem_redact::redact_url`].
impl std::fmt::Debug for ReapRequestsArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReapRequestsArgs")
            .field("store", &idem_redact::redact_url(&self.store))
            .field("table", &self.table)
            .field("batch", &self.batch)
            .finish()
    }
}

impl StoreArgs {
    async fn connect(&self, create: bool) -> anyhow::Result<AnyStore> {
        let table = TableName::new(&self.table)?;
        let store = if create {
            AnyStore::connect_or_create(&self.store, table).await?
        } else {
            AnyStore::connect(&self.store, table).await?
        };
        Ok(store)
    }
}

/// Options of `idem migrate`.
#[derive(Debug, clap::Args)]
pub(crate) struct MigrateArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Idempotent-request records table name.
    #[arg(long, value_name = "NAME", default_value = idem_sql::DEFAULT_REQUESTS_TABLE)]
    requests_table: String,
}

/// Options of `idem reap-requests`.
#[derive(clap::Args)]
pub(crate) struct ReapRequestsArgs {
    /// Store URL: sqlite:PATH, postgres://…, mysql://…
    #[arg(long, value_name = "URL")]
    store: String,
    /// Idempotent-request records table name.
    #[arg(long, value_name = "NAME", default_value = idem_sql::DEFAULT_REQUESTS_TABLE)]
    table: String,
    /// Rows deleted per statement.
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    batch: u32,
}

/// Options of `idem prune`.
#[derive(Debug, clap::Args)]
pub(crate) struct PruneArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Delete claims processed longer ago than this (7d, 36h, 90m).
    #[arg(long, value_name = "DURATION", value_parser = parse_arg_duration)]
    older_than: Duration,
    /// The broker's longest redelivery window. Defaults to the processor's (7d); an
    /// --older-than inside it is refused, and no claim younger than the window plus
    /// --clock-margin is ever deleted.
    #[arg(long, value_name = "DURATION", value_parser = parse_arg_duration)]
    redelivery_window: Option<Duration>,
    /// Kept beyond the redelivery window, against clocks that disagree.
    #[arg(long, value_name = "DURATION", value_parser = parse_arg_duration, default_value = "1h")]
    clock_margin: Duration,
    /// Only this consumer's claims.
    #[arg(long)]
    consumer: Option<String>,
    /// Rows deleted per transaction.
    #[arg(long, default_value_t = 10_000)]
    batch: u32,
}

/// Options of `idem stats`.
#[derive(Debug, clap::Args)]
pub(crate) struct StatsArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub(crate) fn parse_arg_duration(s: &str) -> Result<Duration, String> {
    parse_duration(s).map_err(|e| e.to_string())
}

pub(crate) async fn migrate(args: MigrateArgs) -> anyhow::Result<()> {
    let requests = TableName::new(&args.requests_table)?;
    let store = args
        .store
        .connect(true)
        .await?
        .with_requests_table(requests)?;
    store.migrate().await?;
    println!(
        "claims table {} and requests table {} are ready",
        args.store.table, args.requests_table
    );
    Ok(())
}

pub(crate) async fn reap_requests(args: ReapRequestsArgs) -> anyhow::Result<()> {
    if args.batch == 0 {
        anyhow::bail!("--batch must be at least 1");
    }
    let table = TableName::new(&args.table)?;
    let store = AnyStore::connect(&args.store, TableName::default())
        .await?
        .with_requests_table(table)?;
    let deleted = store
        .reap_requests(args.batch)
        .await
        .context("reaping expired requests")?;
    println!(
        "deleted {deleted} expired request records from {} by the store's clock",
        args.table
    );
    Ok(())
}

pub(crate) async fn prune(args: PruneArgs) -> anyhow::Result<()> {
    // Without a declared window, assume the processor's default rather than none: a claim
    // pruned inside the window turns its redelivery into a second effect.
    let window = args
        .redelivery_window
        .unwrap_or_else(|| Retention::default().redelivery_window());
    let retention = Retention::new(args.older_than, window)?.with_clock_margin(args.clock_margin);
    let consumer = args
        .consumer
        .as_deref()
        .map(ConsumerName::new)
        .transpose()?;
    let store = args.store.connect(false).await?;
    // A partitioned table drops whole days by its own retention, whatever --older-than says;
    // one inside the declared window is refused as --older-than is.
    if let Some(kept) = store.kept_for() {
        let needed = window.saturating_add(args.clock_margin);
        if kept < needed {
            anyhow::bail!(
                "the claims table {} drops claims after {} (the retention it records), shorter \
                 than the redelivery window of {} plus the clock margin of {}: a message \
                 redelivered after its claim was dropped would be processed twice; migrate the \
                 table with a retention of at least {}",
                args.store.table,
                format_duration(kept),
                format_duration(window),
                format_duration(args.clock_margin),
                format_duration(needed)
            );
        }
    }
    let maintained = store
        .maintain_partitions()
        .await
        .context("maintaining partitions")?;
    if let (Some(report), Some(kept)) = (&maintained, store.kept_for()) {
        print_maintenance(report, kept);
    }
    let deleted = store
        .prune(consumer.as_ref(), retention, args.batch)
        .await
        .context("pruning")?;
    let from = if maintained.is_some() {
        "from the default and undated partitions "
    } else {
        ""
    };
    println!(
        "deleted {deleted} claims {from}processed more than {} ago by the store's clock \
         (--older-than {}, redelivery window {} + clock margin {})",
        format_duration(retention.prune_age()),
        format_duration(args.older_than),
        format_duration(window),
        format_duration(args.clock_margin)
    );
    Ok(())
}

pub(crate) async fn stats(args: StatsArgs) -> anyhow::Result<()> {
    let store = args.store.connect(false).await?;
    let rows = store.stats().await?;
    if args.json {
        let rows: Vec<_> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "consumer": r.consumer,
                    "claims": r.claims,
                    "oldest": r.oldest.to_string(),
                    "newest": r.newest.to_string(),
                })
            })
            .collect();
        println!("{}", serde_json::Value::Array(rows));
        return Ok(());
    }
    let partitions = store.partitions().await?;
    if rows.is_empty() {
        println!("no claims in {}", args.store.table);
    } else {
        print_consumers(&rows);
    }
    if !partitions.is_empty() {
        print_partitions(&partitions);
    }
    Ok(())
}

/// What a round of partition maintenance did: days created ahead, days dropped past the
/// table's retention (claims by the planner's estimate: counting would read them all).
fn print_maintenance(report: &idem_sql::partition::PartitionReport, kept: Duration) {
    let plural = |n: usize| if n == 1 { "" } else { "s" };
    if !report.created.is_empty() {
        let days: Vec<String> = report.created.iter().map(ToString::to_string).collect();
        println!(
            "created {} day partition{} ahead: {}",
            days.len(),
            plural(days.len()),
            days.join(", ")
        );
    }
    if !report.dropped.is_empty() {
        let days: Vec<String> = report.dropped.iter().map(|(d, _)| d.to_string()).collect();
        let estimate: u64 = report.dropped.iter().map(|(_, n)| n).sum();
        println!(
            "dropped {} day partition{} past the table's retention of {}: {} \
             (~{} claims by the planner's estimate)",
            days.len(),
            plural(days.len()),
            format_duration(kept),
            days.join(", "),
            crate::format::group_digits(estimate)
        );
    }
    if report.moved > 0 {
        println!(
            "moved {} claims between partitions (out of the default one into their new day, \
             or out of a dropped day, younger than the retention, into the default one)",
            report.moved
        );
    }
}

fn print_consumers(rows: &[idem_core::ConsumerStats]) {
    let width = rows
        .iter()
        .map(|r| r.consumer.len())
        .max()
        .unwrap_or(8)
        .max(8);
    println!(
        "{:<width$}  {:>10}  {:<27}  {:<27}",
        "consumer", "claims", "oldest", "newest"
    );
    for r in rows {
        println!(
            "{:<width$}  {:>10}  {:<27}  {:<27}",
            r.consumer,
            r.claims,
            r.oldest.to_string(),
            r.newest.to_string()
        );
    }
}

/// A table partitioned by the ID's time: each partition with what it holds. Claims are the
/// planner's estimate (counting would read every partition).
fn print_partitions(parts: &[idem_sql::partition::PartitionInfo]) {
    use idem_sql::partition::PartitionKind;
    let width = parts.iter().map(|p| p.name.len()).max().unwrap_or(9).max(9);
    println!();
    println!(
        "{:<width$}  {:<28}  {:>12}  {:>10}",
        "partition", "holds", "~claims", "size"
    );
    for p in parts {
        let holds = match p.kind {
            PartitionKind::Day(d) => format!("IDs made {d} (UTC)"),
            PartitionKind::Default => "IDs outside the days".to_owned(),
            PartitionKind::Undated => "IDs without a time".to_owned(),
            _ => "?".to_owned(),
        };
        println!(
            "{:<width$}  {:<28}  {:>12}  {:>10}",
            p.name,
            holds,
            crate::format::group_digits(p.claims_estimate),
            format!("{:.1} MiB", p.bytes as f64 / 1_048_576.0)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_hides_the_store_password() {
        let store = "postgres://app:hunter2@db/pay".to_owned();
        let args = StoreArgs {
            store: store.clone(),
            table: "t".into(),
        };
        assert!(!format!("{args:?}").contains("hunter2"), "{args:?}");
        let args = ReapRequestsArgs {
            store,
            table: "t".into(),
            batch: 1,
        };
        assert!(!format!("{args:?}").contains("hunter2"), "{args:?}");
    }
}
