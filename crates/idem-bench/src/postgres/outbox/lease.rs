//! The relay's lease alone, side by side on the same backlog: the store's PostgreSQL lease (one
//! statement, in a transaction with `synchronous_commit = off`), the same statement with a
//! durable commit, and the select + update it replaced (kept here only to compare) on the
//! table's fillfactor 50 and on full pages (fillfactor 100, what tables had before).
//!
//! Each measurement commits the backlog (untimed), runs `ANALYZE` on the table (without
//! statistics the planner may read every unsent row before the `LIMIT`), then leases
//! [`BATCH`] rows at a time until none is left, marking each batch sent between leases
//! (untimed, as a relay does); the rate is leased rows over the time spent in leases.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::bail;
use idem_core::outbox::{OutboxStore as _, RelayStore as _};
use idem_core::{TableName, TransactionalStore as _};
use idem_dialect::outbox::{Candidate, admit};
use idem_dialect::postgres::{FILLFACTOR, STATEMENT_NOW, outbox_statements};
use sqlx::Row as _;
use sqlx::postgres::PgPool;

use super::{FILL_CHUNK, Outbox, lock, messages, sample};
use crate::measure::Sample;
use crate::postgres::Bench;
use crate::{Group, Target, Variant};

/// Rows per lease: the relay's largest batch in the drain part.
const BATCH: usize = 500;

/// The lease's duration (long: nothing lapses during a measurement).
const LEASE: Duration = Duration::from_secs(60);

/// The relay name every lease uses.
const RELAY: &str = "idem-bench-lease";

/// The lease variants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lease {
    /// `RelayStore::lease`: the dialect's one statement, its commit not waiting for the disk.
    Store,
    /// The one statement by hand, with a durable commit.
    OneDurable,
    /// The select + update of the listed rows that the one statement replaced.
    Two,
    /// [`Self::Two`] on full pages: the lease as it was.
    TwoFull,
}

impl Lease {
    fn fillfactor(self) -> u32 {
        match self {
            Self::TwoFull => 100,
            _ => FILLFACTOR,
        }
    }
}

impl Variant for Lease {
    fn key(self) -> &'static str {
        match self {
            Self::Store => "lease-store",
            Self::OneDurable => "lease-one-durable",
            Self::Two => "lease-two",
            Self::TwoFull => "lease-two-ff100",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::Store => "the store's lease: one statement, `synchronous_commit = off`",
            Self::OneDurable => "one statement, durable commit",
            Self::Two => "select + update, durable commit",
            Self::TwoFull => "select + update, durable commit, fillfactor 100 (as before)",
        }
    }

    fn round_trips(self) -> &'static str {
        match self {
            Self::Store | Self::OneDurable => "3 per lease (begin, lease, commit)",
            Self::Two | Self::TwoFull => "4 per lease (begin, select, update, commit)",
        }
    }
}

/// The lease as it was before the one statement: its select (the same selection, all columns,
/// each row's count of earlier rows of its key) and its update of the listed rows.
fn old_select(o: &TableName) -> String {
    let now = STATEMENT_NOW;
    let same_key = "e.destination = o.destination AND e.ordering_key = o.ordering_key \
                    AND e.sent_at IS NULL AND e.seq < o.seq";
    format!(
        "SELECT o.seq, o.message_id, o.destination, o.ordering_key, o.payload, o.headers, \
         o.attempts, o.created_at, (SELECT count(*) FROM {o} e WHERE {same_key}) \
         FROM {o} o WHERE o.sent_at IS NULL AND o.available_at <= {now} \
         AND (o.leased_until IS NULL OR o.leased_until <= {now} OR o.leased_by = $1) \
         AND (o.ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM {o} e WHERE {same_key} \
         AND (e.available_at > {now} OR (e.leased_until > {now} AND e.leased_by <> $1)))) \
         ORDER BY o.seq LIMIT $2 FOR UPDATE OF o SKIP LOCKED"
    )
}

fn old_update(o: &TableName, rows: usize) -> String {
    let list: Vec<String> = (0..rows).map(|i| format!("${}", i + 3)).collect();
    format!(
        "UPDATE {o} SET leased_by = $1, leased_until = {STATEMENT_NOW} + $2 WHERE seq IN ({})",
        list.join(", ")
    )
}

fn candidate(r: &sqlx::postgres::PgRow) -> Result<Candidate, sqlx::Error> {
    Ok(Candidate {
        seq: r.try_get(0)?,
        message_id: r.try_get(1)?,
        destination: r.try_get(2)?,
        ordering_key: r.try_get(3)?,
        payload: r.try_get(4)?,
        headers: r.try_get(5)?,
        attempts: r.try_get(6)?,
        created_at: r.try_get(7)?,
        earlier: r.try_get(8)?,
    })
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// The old lease: one transaction, select, the per-key check, update, commit; the leased seqs.
async fn two_statements(pool: &PgPool, o: &TableName) -> anyhow::Result<Vec<i64>> {
    let mut tx = pool.begin().await?;
    let rows = sqlx::query(&old_select(o))
        .bind(RELAY)
        .bind(BATCH as i64)
        .fetch_all(&mut *tx)
        .await?;
    let candidates = rows.iter().map(candidate).collect::<Result<Vec<_>, _>>()?;
    let seqs = admit(candidates).seqs();
    if !seqs.is_empty() {
        let update = old_update(o, seqs.len());
        let mut q = sqlx::query(&update).bind(RELAY).bind(micros(LEASE));
        for s in &seqs {
            q = q.bind(*s);
        }
        q.execute(&mut *tx).await?;
    }
    tx.commit().await?;
    Ok(seqs)
}

/// The dialect's one lease statement by hand, in a plain (durable) transaction.
async fn one_statement(pool: &PgPool, o: &TableName) -> anyhow::Result<Vec<i64>> {
    let lease = outbox_statements(o).lease;
    let mut tx = pool.begin().await?;
    let rows = sqlx::query(&lease.sql)
        .bind(RELAY)
        .bind(BATCH as i64)
        .bind(micros(LEASE))
        .fetch_all(&mut *tx)
        .await?;
    let seqs = rows
        .iter()
        .map(|r| r.try_get::<i64, _>(0))
        .collect::<Result<Vec<_>, _>>()?;
    tx.commit().await?;
    Ok(seqs)
}

/// Leases, leased rows and the time in leases, per variant over all rounds.
#[derive(Debug, Default, Clone, Copy)]
struct Spent {
    leases: u64,
    rows: u64,
    time: Duration,
}

impl Bench {
    /// The lease statements side by side on `outbox`, `rows` rows a measurement.
    pub(super) async fn lease_statements(
        &self,
        outbox: &Outbox,
        rows: usize,
    ) -> anyhow::Result<Group> {
        let variants = [Lease::Store, Lease::OneDurable, Lease::Two, Lease::TwoFull];
        let title = format!(
            "Outbox lease statements, PostgreSQL: {rows} committed rows leased {BATCH} at a time"
        );
        let spent: Mutex<HashMap<&'static str, Spent>> = Mutex::default();
        let group = Group::measure(title, &variants, &self.settings, async |v| {
            self.lease_all(outbox, rows, v, &spent).await
        })
        .await;
        // Leave the table as `migrate` made it for the other parts, measured or not.
        let reset = format!(
            "ALTER TABLE {} SET (fillfactor = {FILLFACTOR})",
            outbox.table
        );
        sqlx::raw_sql(&reset).execute(&self.admin).await?;
        let mut group = group?;
        for v in variants {
            if let Some(s) = lock(&spent).get(v.key()) {
                group = group.note(format!(
                    "{}: {} leases of {:.0} rows, {:.2} ms each",
                    v.key(),
                    s.leases,
                    s.rows as f64 / s.leases.max(1) as f64,
                    s.time.as_secs_f64() * 1e3 / s.leases.max(1) as f64
                ));
            }
        }
        Ok(group
            .targets([
                Target::compare("lease-store", "lease-two-ff100"),
                Target::compare("lease-one-durable", "lease-two"),
                Target::compare("lease-two", "lease-two-ff100"),
                Target::compare("lease-store", "lease-one-durable"),
            ])
            .note(format!(
                "msg/s = leased rows / the time spent in leases (from the call to its return, \
                 through the pool); each lease takes up to {BATCH} rows, and the relay's mark \
                 of those rows runs between leases, untimed; the {rows} rows (unkeyed, ~90-byte \
                 payload) are committed {FILL_CHUNK} per transaction beforehand, then \
                 `ANALYZE` and `CHECKPOINT`; fillfactor set before the rows were written \
                 (the table truncated first)"
            )))
    }

    /// One measurement: a fresh backlog of `rows` leased by variant `v` until none is left.
    async fn lease_all(
        &self,
        outbox: &Outbox,
        rows: usize,
        v: Lease,
        spent: &Mutex<HashMap<&'static str, Spent>>,
    ) -> anyhow::Result<Sample> {
        sqlx::raw_sql(&outbox.truncate).execute(&self.admin).await?;
        let table = &outbox.table;
        sqlx::raw_sql(&format!(
            "ALTER TABLE {table} SET (fillfactor = {})",
            v.fillfactor()
        ))
        .execute(&self.admin)
        .await?;
        let (pool, store) = self.outbox_store(outbox, 2).await?;
        let msgs = messages(self.settings.ids(), rows)?;
        for chunk in msgs.chunks(FILL_CHUNK) {
            let mut tx = store.begin().await?;
            store.enqueue(&mut tx, chunk).await?;
            store.commit(tx).await?;
        }
        sqlx::raw_sql(&format!("ANALYZE {table}"))
            .execute(&self.admin)
            .await?;
        let _ = sqlx::query("CHECKPOINT").execute(&self.admin).await;
        let mut total = Spent::default();
        loop {
            let start = Instant::now();
            let seqs: Vec<i64> = match v {
                Lease::Store => store
                    .lease(RELAY, BATCH, LEASE)
                    .await?
                    .iter()
                    .map(|r| r.seq)
                    .collect(),
                Lease::Two | Lease::TwoFull => two_statements(&pool, table).await?,
                Lease::OneDurable => one_statement(&pool, table).await?,
            };
            let took = start.elapsed();
            if seqs.is_empty() {
                break;
            }
            total.leases += 1;
            total.rows += seqs.len() as u64;
            total.time += took;
            store.mark_sent(RELAY, &seqs).await?;
        }
        pool.close().await;
        if total.rows != rows as u64 {
            bail!("{} leased {} of {rows} rows", v.key(), total.rows);
        }
        let mut all = lock(spent);
        let sum = all.entry(v.key()).or_default();
        sum.leases += total.leases;
        sum.rows += total.rows;
        sum.time += total.time;
        Ok(sample(rows, total.time))
    }
}
