//! The P1 rows on tokio-postgres: `idem-postgres` against the same handler without it, both on
//! a deadpool-postgres pool of exactly `workers` connections, opened before timing starts.
//!
//! The pool recycles with `RecyclingMethod::Fast` (no ping when a connection is handed out),
//! and every statement is prepared once per connection (`prepare_cached`): the bare handler
//! costs `BEGIN`, its two statements and `COMMIT`, four round trips, and so does idem, whose
//! claim is pipelined with the `BEGIN`.

use anyhow::{Context as _, bail};
use idem_core::{Outcome, Processor};
use idem_postgres::deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use idem_postgres::tokio_postgres::{self, Client, NoTls};
use idem_postgres::{PgStore, PgTx, TableName};

use super::{CHARGE, CLAIMS, CLAIMS_PART, CREDIT, bench_partitioning};
use crate::measure::CpuProbe;
use crate::workload::{CONSUMER, Delivery};

/// A pool and the processor on it.
#[derive(Debug)]
pub(super) struct TokioPg {
    pool: Pool,
    processor: Processor<PgStore>,
    /// The same on the partitioned claims table.
    partitioned: Processor<PgStore>,
}

impl TokioPg {
    /// A pool of exactly `workers` connections to `url`, all open, and their backends' process
    /// IDs when the server runs on this machine.
    pub(super) async fn open(url: &str, workers: usize) -> anyhow::Result<(Self, Vec<u32>)> {
        let config: tokio_postgres::Config = url.parse().context("PostgreSQL URL")?;
        let manager = Manager::from_config(
            config,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager).max_size(workers).build()?;
        // Hold every connection at once, so the pool opens all of them now.
        let mut open = Vec::with_capacity(workers);
        let mut pids = Vec::with_capacity(workers);
        for _ in 0..workers {
            let client = pool.get().await?;
            let pid: i32 = client
                .query_one("SELECT pg_backend_pid()", &[])
                .await?
                .get(0);
            pids.extend(u32::try_from(pid).ok());
            open.push(client);
        }
        drop(open);
        if !pids.iter().all(|&pid| CpuProbe::is_local_postgres(pid)) {
            pids.clear();
        }
        let store = PgStore::from_pool(pool.clone()).with_table(TableName::new(CLAIMS)?)?;
        let processor = Processor::builder(store, CONSUMER).build()?;
        let store = PgStore::from_pool(pool.clone())
            .with_table(TableName::new(CLAIMS_PART)?)?
            .partitioned(bench_partitioning()?)?;
        let partitioned = Processor::builder(store, CONSUMER).build()?;
        Ok((
            Self {
                pool,
                processor,
                partitioned,
            },
            pids,
        ))
    }

    pub(super) fn close(&self) {
        self.pool.close();
    }

    /// The bare handler in a tokio-postgres transaction on a pooled connection.
    pub(super) async fn bare(&self, d: &Delivery) -> anyhow::Result<()> {
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let (charge, credit) = (
            tx.prepare_cached(CHARGE).await?,
            tx.prepare_cached(CREDIT).await?,
        );
        tx.execute(&charge, &[&d.account, &d.amount]).await?;
        tx.execute(&credit, &[&d.account, &d.amount]).await?;
        tx.commit().await?;
        Ok(())
    }

    /// The same handler through `Processor::process` on `idem-postgres` (on the partitioned
    /// claims table with `partitioned`).
    pub(super) async fn idem(&self, d: &Delivery, partitioned: bool) -> anyhow::Result<()> {
        let processor = if partitioned {
            &self.partitioned
        } else {
            &self.processor
        };
        let outcome = processor.process(d, async |tx| charge(tx, d).await).await?;
        match outcome {
            Outcome::Processed(()) => Ok(()),
            other => bail!("fresh message {:?} was not new: {other:?}", d.id),
        }
    }
}

/// The handler under test, on idem's transaction: its two statements, prepared once per
/// connection as the bare variant's are.
async fn charge(tx: &PgTx, d: &Delivery) -> Result<(), tokio_postgres::Error> {
    let (charge, credit) = (
        tx.prepare_cached(CHARGE).await?,
        tx.prepare_cached(CREDIT).await?,
    );
    let client: &Client = tx;
    client.execute(&charge, &[&d.account, &d.amount]).await?;
    client.execute(&credit, &[&d.account, &d.amount]).await?;
    Ok(())
}
