//! `idem complete`: what an operator can do with operations of phases left stuck (in progress,
//! lease run out, a recovery point committed) without the application's code.
//!
//! Resuming one needs its `step` function — the application's phases — so only the
//! `idem_request::Completer` task, run inside the application's process, resumes. This command
//! lists stuck records (`--list`, read only) and gives up those that already had at least
//! `--abandon-after` executions (`--abandon-after N --result JSON`), storing `--result` as
//! the answer every retry replays (no compensation: that too is the application's).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use idem_core::format_duration;
use idem_core::store::RecoveryStore;
use idem_sql::{AnyStore, TableName};

/// Options of `idem complete`.
#[derive(clap::Args)]
pub(crate) struct CompleteArgs {
    /// Store URL: sqlite:PATH, postgres://…, mysql://… (`--database` is the same option:
    /// the records live in the application's database).
    #[arg(long, visible_alias = "database", value_name = "URL")]
    store: String,
    /// Idempotent-request records table name.
    #[arg(long, value_name = "NAME", default_value = idem_sql::DEFAULT_REQUESTS_TABLE)]
    table: String,
    /// List stuck operations (key, recovery point, attempts, time since the lease ran out);
    /// changes nothing.
    #[arg(long, conflicts_with = "abandon_after")]
    list: bool,
    /// Give up the stuck operations that already had at least this many executions. Taking
    /// a record over counts as one more attempt: the others are released at once, for the
    /// application's completer.
    #[arg(long, value_name = "ATTEMPTS", requires = "result")]
    abandon_after: Option<u32>,
    /// The answer stored for a given-up operation (JSON, in the shape the operation's
    /// response deserializes from), replayed to every retry.
    #[arg(long, value_name = "JSON")]
    result: Option<String>,
    /// Records looked at (or taken over) in this run.
    #[arg(long, value_name = "N", default_value_t = 100)]
    batch: u32,
    /// How long a given-up record's answer is kept.
    #[arg(long, value_name = "DURATION", default_value = "24h", value_parser = crate::admin::parse_arg_duration)]
    ttl: Duration,
}

/// The store URL may hold a password: shown through [`idem_redact::redact_url`].
impl std::fmt::Debug for CompleteArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompleteArgs")
            .field("store", &idem_redact::redact_url(&self.store))
            .field("table", &self.table)
            .field("list", &self.list)
            .field("abandon_after", &self.abandon_after)
            .finish()
    }
}

pub(crate) async fn complete(args: CompleteArgs) -> anyhow::Result<()> {
    if args.batch == 0 {
        anyhow::bail!("--batch must be at least 1");
    }
    let table = TableName::new(&args.table)?;
    let store = AnyStore::connect(&args.store, TableName::default())
        .await?
        .with_requests_table(table.clone())?;
    tracing::info!(store = %idem_redact::redact_url(&args.store), table = %args.table, "idem complete");
    if let Some(after) = args.abandon_after {
        let result = args.result.as_deref().unwrap_or("null");
        serde_json::from_str::<serde_json::Value>(result).context("--result is not JSON")?;
        let (given_up, released) = match &store {
            AnyStore::Sqlite(s) => abandon(s, after, result, &args).await?,
            AnyStore::Postgres(s) => abandon(s, after, result, &args).await?,
            AnyStore::MySql(s) => abandon(s, after, result, &args).await?,
            _ => anyhow::bail!("idem complete does not know this store engine"),
        };
        println!(
            "gave up {given_up} stuck operations after {after} attempts; released {released} \
             others for the application's completer"
        );
        return Ok(());
    }
    if !args.list {
        anyhow::bail!(
            "resuming an operation needs its phases: run idem_request::Completer in the \
             application; this command can --list stuck operations or --abandon-after ATTEMPTS"
        );
    }
    let sql = format!(
        "SELECT idem_key, recovery_point, attempts, lease_until FROM {table} \
         WHERE state = 0 AND recovery_point IS NOT NULL AND lease_until <= {now} \
         ORDER BY lease_until LIMIT {limit}",
        now = now_micros(),
        limit = args.batch,
    );
    let rows: Vec<(Vec<u8>, String, i64, i64)> = match &store {
        AnyStore::Sqlite(s) => sqlx::query_as(&sql).fetch_all(s.pool()).await,
        AnyStore::Postgres(s) => sqlx::query_as(&sql).fetch_all(s.pool()).await,
        AnyStore::MySql(s) => sqlx::query_as(&sql).fetch_all(s.pool()).await,
        _ => anyhow::bail!("idem complete does not know this store engine"),
    }
    .context("listing stuck operations")?;
    println!(
        "{:<40} {:<24} {:>8} {:>12}",
        "key", "point", "attempts", "stuck for"
    );
    let now = now_micros();
    for (key, point, attempts, lease_until) in &rows {
        let age = Duration::from_micros(now.saturating_sub(*lease_until).max(0) as u64);
        println!(
            "{:<40} {:<24} {:>8} {:>12}",
            String::from_utf8_lossy(key),
            point,
            attempts,
            format_duration(Duration::from_secs(age.as_secs()))
        );
    }
    println!("{} stuck operations", rows.len());
    Ok(())
}

fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

async fn abandon<S: RecoveryStore>(
    store: &S,
    after: u32,
    result: &str,
    args: &CompleteArgs,
) -> anyhow::Result<(u64, u64)> {
    let taken = store
        .take_stuck(args.batch, Duration::from_secs(30))
        .await
        .context("taking stuck operations over")?;
    let (mut given_up, mut released) = (0, 0);
    for stuck in taken {
        // This takeover is one of the attempts; the executions it follows are the others.
        if stuck.recovery.attempts.saturating_sub(1) < after {
            store
                .release(&stuck.key, stuck.fence)
                .await
                .context("releasing a record")?;
            released += 1;
            continue;
        }
        let mut tx = store.begin_execution().await.context("beginning")?;
        if let Err(e) = store
            .abandon_in(
                &mut tx,
                &stuck.key,
                stuck.fence,
                result.as_bytes(),
                args.ttl,
            )
            .await
        {
            let _ = store.rollback(tx).await;
            return Err(e).context("giving an operation up");
        }
        store.commit(tx).await.context("committing")?;
        tracing::debug!(point = ?stuck.recovery.resume.map(|r| r.point), "gave a stuck operation up");
        given_up += 1;
    }
    Ok((given_up, released))
}
