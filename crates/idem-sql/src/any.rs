//! A store chosen at run time from a URL: the one place that maps URL schemes to engines, for
//! operators' tools (`idem migrate/prune/stats/reap-requests`) and for services that take a
//! `--database` URL ([`AnyStore::visit`] hands the typed [`SqlStore`](crate::SqlStore) a
//! `Processor` needs to a [`StoreVisitor`], one method per engine, without a `match`).
//!
//! The enum forwards the administrative capabilities and the relay's ([`RelayStore`], for
//! `idem relay`); processing code names its engine.

use idem_core::{ConsumerName, ConsumerStats, Error, ErrorKind, Migrate, Retention, Stamp, Stats};

use idem_core::TableName;
use idem_core::outbox::{Backlog, OutboxRow, RelayStore};
use std::time::Duration;

/// One of the compiled-in SQL stores.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum AnyStore {
    /// SQLite.
    #[cfg(feature = "sqlite")]
    Sqlite(crate::SqliteStore),
    /// PostgreSQL.
    #[cfg(feature = "postgres")]
    Postgres(crate::PostgresStore),
    /// MySQL / MariaDB.
    #[cfg(feature = "mysql")]
    MySql(crate::MySqlStore),
}

/// What to do with the typed store inside an [`AnyStore`], one method per compiled-in engine:
/// [`AnyStore::visit`] calls the one for its engine. An application that needs the typed store
/// (a `Processor` over it, its pool for the application's own tables) implements this instead
/// of matching on the variants, and so needs no arm for engines it has not compiled in.
///
/// ```no_run
/// # #[cfg(all(feature = "sqlite", feature = "postgres", feature = "mysql"))]
/// # mod example {
/// use idem_sql::{AnyStore, MySqlStore, PostgresStore, SqliteStore, StoreVisitor};
///
/// /// The engine's pool size, whichever engine the URL chose.
/// struct PoolSize;
///
/// impl StoreVisitor for PoolSize {
///     type Output = u32;
///     async fn sqlite(self, store: SqliteStore) -> u32 {
///         store.pool().size()
///     }
///     async fn postgres(self, store: PostgresStore) -> u32 {
///         store.pool().size()
///     }
///     async fn mysql(self, store: MySqlStore) -> u32 {
///         store.pool().size()
///     }
/// }
///
/// async fn demo() -> Result<(), idem_core::Error> {
///     let store = AnyStore::connect("sqlite:payments.db", Default::default()).await?;
///     let connections = store.visit(PoolSize).await;
///     # let _ = connections;
///     Ok(())
/// }
/// # }
/// # fn main() {}
/// ```
pub trait StoreVisitor {
    /// What the visit returns.
    type Output;

    /// Called with a SQLite store.
    #[cfg(feature = "sqlite")]
    fn sqlite(self, store: crate::SqliteStore) -> impl Future<Output = Self::Output> + Send;

    /// Called with a PostgreSQL store.
    #[cfg(feature = "postgres")]
    fn postgres(self, store: crate::PostgresStore) -> impl Future<Output = Self::Output> + Send;

    /// Called with a MySQL / MariaDB store.
    #[cfg(feature = "mysql")]
    fn mysql(self, store: crate::MySqlStore) -> impl Future<Output = Self::Output> + Send;
}

/// The URL schemes [`AnyStore::connect`] understands.
pub const SCHEMES: &str = "sqlite:, postgres://, postgresql://, mysql://, mariadb://";

impl AnyStore {
    /// Connects by URL scheme: `sqlite:PATH`, `postgres://…`, `mysql://…`. On PostgreSQL, a
    /// claims table partitioned by the ID's time configures the store as the table records it
    /// ([`PostgresStore::with_table_partitioning`](crate::PostgresStore::with_table_partitioning)).
    pub async fn connect(url: &str, table: TableName) -> Result<Self, Error> {
        let scheme = url
            .split(':')
            .next()
            .unwrap_or_default()
            .to_ascii_lowercase();
        match scheme.as_str() {
            #[cfg(feature = "sqlite")]
            "sqlite" => Ok(Self::Sqlite(
                crate::SqliteStore::connect(url, crate::SqliteOptions::default().must_exist())
                    .await?
                    .with_table(table)?,
            )),
            #[cfg(feature = "postgres")]
            // Configured as the table is, so that a partitioned table is maintained (days
            // dropped past its recorded retention), never pruned row by row on its parent.
            "postgres" | "postgresql" => Ok(Self::Postgres(
                crate::PostgresStore::connect(url)
                    .await?
                    .with_table(table)?
                    .with_table_partitioning()
                    .await?,
            )),
            #[cfg(feature = "mysql")]
            "mysql" | "mariadb" => Ok(Self::MySql(
                crate::MySqlStore::connect(url).await?.with_table(table)?,
            )),
            _ => Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "unsupported store URL {:?}: expected one of {SCHEMES}",
                    idem_redact::redact_url(url)
                ),
            )),
        }
    }

    /// Like [`connect`](Self::connect), but creates a missing SQLite file (for `migrate`, and
    /// for a service that owns its embedded database).
    pub async fn connect_or_create(url: &str, table: TableName) -> Result<Self, Error> {
        #[cfg(feature = "sqlite")]
        if url.to_ascii_lowercase().starts_with("sqlite:") {
            return Ok(Self::Sqlite(
                crate::SqliteStore::connect(url, crate::SqliteOptions::default())
                    .await?
                    .with_table(table)?,
            ));
        }
        Self::connect(url, table).await
    }

    /// Hands the typed store to `visitor`'s method for its engine.
    pub async fn visit<V: StoreVisitor>(self, visitor: V) -> V::Output {
        match self {
            #[cfg(feature = "sqlite")]
            Self::Sqlite(s) => visitor.sqlite(s).await,
            #[cfg(feature = "postgres")]
            Self::Postgres(s) => visitor.postgres(s).await,
            #[cfg(feature = "mysql")]
            Self::MySql(s) => visitor.mysql(s).await,
        }
    }

    /// Keeps idempotent-request records in `table` instead of `idem_requests`.
    pub fn with_requests_table(self, table: TableName) -> Result<Self, Error> {
        Ok(match self {
            #[cfg(feature = "sqlite")]
            Self::Sqlite(s) => Self::Sqlite(s.with_requests_table(table)?),
            #[cfg(feature = "postgres")]
            Self::Postgres(s) => Self::Postgres(s.with_requests_table(table)?),
            #[cfg(feature = "mysql")]
            Self::MySql(s) => Self::MySql(s.with_requests_table(table)?),
        })
    }

    /// Keeps the outbox in `table` (and its dead letters in `<table>_dead_letters`) instead of
    /// `idem_outbox`.
    pub fn with_outbox_table(self, table: TableName) -> Result<Self, Error> {
        Ok(match self {
            #[cfg(feature = "sqlite")]
            Self::Sqlite(s) => Self::Sqlite(s.with_outbox_table(table)?),
            #[cfg(feature = "postgres")]
            Self::Postgres(s) => Self::Postgres(s.with_outbox_table(table)?),
            #[cfg(feature = "mysql")]
            Self::MySql(s) => Self::MySql(s.with_outbox_table(table)?),
        })
    }

    /// On PostgreSQL, [`PostgresStore::outbox_wakeups`](crate::PostgresStore::outbox_wakeups):
    /// a stream that yields after each commit that enqueued into the outbox, for a relay's
    /// `wake_on`. `None` on the other engines, where relays poll.
    pub fn outbox_wakeups(&self) -> Option<futures_util::stream::BoxStream<'static, ()>> {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres(s) => Some(Box::pin(s.outbox_wakeups())),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// The engine's name (`SQLite`, `PostgreSQL`, `MySQL`).
    pub fn engine(&self) -> &'static str {
        use sqlx::Database;
        match self {
            #[cfg(feature = "sqlite")]
            Self::Sqlite(_) => sqlx::Sqlite::NAME,
            #[cfg(feature = "postgres")]
            Self::Postgres(_) => sqlx::Postgres::NAME,
            #[cfg(feature = "mysql")]
            Self::MySql(_) => sqlx::MySql::NAME,
        }
    }

    /// Creates the claims table and the requests table (both idempotent).
    pub async fn migrate(&self) -> Result<(), Error> {
        match self {
            #[cfg(feature = "sqlite")]
            Self::Sqlite(s) => s.migrate().await,
            #[cfg(feature = "postgres")]
            Self::Postgres(s) => s.migrate().await,
            #[cfg(feature = "mysql")]
            Self::MySql(s) => s.migrate().await,
        }
    }

    /// Deletes claims older than `retention`'s [prune age](Retention::prune_age) — never less
    /// than its redelivery window plus clock margin — on the store's clock, `batch` rows per
    /// transaction. A partitioned table drops its days past the table's own retention first
    /// (see [`maintain_partitions`](Self::maintain_partitions)), then deletes rows of its
    /// default and undated partitions older than the prune age.
    pub async fn prune(
        &self,
        consumer: Option<&ConsumerName>,
        retention: Retention,
        batch: u32,
    ) -> Result<u64, Error> {
        let (now, age) = (Stamp::StoreClock, retention.prune_age());
        match self {
            #[cfg(feature = "sqlite")]
            Self::Sqlite(s) => idem_core::store::prune_all(s, consumer, now, age, batch).await,
            #[cfg(feature = "postgres")]
            Self::Postgres(s) => idem_core::store::prune_all(s, consumer, now, age, batch).await,
            #[cfg(feature = "mysql")]
            Self::MySql(s) => idem_core::store::prune_all(s, consumer, now, age, batch).await,
        }
    }

    /// Deletes expired idempotent-request records (completed ones past their TTL, in-progress
    /// ones past both their TTL and their lease) on the store's clock, `batch` rows per
    /// statement. Returns how many.
    pub async fn reap_requests(&self, batch: u32) -> Result<u64, Error> {
        match self {
            #[cfg(feature = "sqlite")]
            Self::Sqlite(s) => idem_core::store::reap_all(s, batch).await,
            #[cfg(feature = "postgres")]
            Self::Postgres(s) => idem_core::store::reap_all(s, batch).await,
            #[cfg(feature = "mysql")]
            Self::MySql(s) => idem_core::store::reap_all(s, batch).await,
        }
    }

    /// How long the claims table keeps every claim by itself: a partitioned table's recorded
    /// retention; `None` for a plain table, whose claims stay until pruned.
    pub fn kept_for(&self) -> Option<std::time::Duration> {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres(s) => idem_core::ClaimStore::kept_for(s),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// One round of partition maintenance on a partitioned claims table (days created ahead,
    /// days past the table's retention dropped); `None` for a plain table and on the other
    /// engines.
    pub async fn maintain_partitions(
        &self,
    ) -> Result<Option<crate::partition::PartitionReport>, Error> {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres(s) if s.partitioning().is_some() => {
                s.maintain_partitions().await.map(Some)
            }
            #[allow(unreachable_patterns)]
            _ => Ok(None),
        }
    }

    /// The claims table's partitions (PostgreSQL tables partitioned by the ID's time); empty
    /// for a plain table and on the other engines.
    pub async fn partitions(&self) -> Result<Vec<crate::partition::PartitionInfo>, Error> {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres(s) => s.partitions().await,
            #[allow(unreachable_patterns)]
            _ => Ok(Vec::new()),
        }
    }

    /// Claims per consumer.
    pub async fn stats(&self) -> Result<Vec<ConsumerStats>, Error> {
        match self {
            #[cfg(feature = "sqlite")]
            Self::Sqlite(s) => s.stats().await,
            #[cfg(feature = "postgres")]
            Self::Postgres(s) => s.stats().await,
            #[cfg(feature = "mysql")]
            Self::MySql(s) => s.stats().await,
        }
    }
}

/// Calls `$method` on the typed store, whichever engine it is.
macro_rules! each_engine {
    ($self:ident, $s:ident => $call:expr) => {
        match $self {
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite($s) => $call,
            #[cfg(feature = "postgres")]
            AnyStore::Postgres($s) => $call,
            #[cfg(feature = "mysql")]
            AnyStore::MySql($s) => $call,
        }
    };
}

/// For `idem relay --database URL`: the relay needs only these, whatever the engine.
impl RelayStore for AnyStore {
    async fn lease(
        &self,
        relay: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<OutboxRow>, Error> {
        each_engine!(self, s => s.lease(relay, limit, lease).await)
    }

    async fn mark_sent(&self, relay: &str, seqs: &[i64]) -> Result<(), Error> {
        each_engine!(self, s => s.mark_sent(relay, seqs).await)
    }

    async fn release(
        &self,
        relay: &str,
        seq: i64,
        error: &str,
        retry_in: Duration,
    ) -> Result<(), Error> {
        each_engine!(self, s => s.release(relay, seq, error, retry_in).await)
    }

    async fn dead_letter(&self, relay: &str, seq: i64, reason: &str) -> Result<(), Error> {
        each_engine!(self, s => s.dead_letter(relay, seq, reason).await)
    }

    async fn purge_sent(&self, limit: usize) -> Result<u64, Error> {
        each_engine!(self, s => s.purge_sent(limit).await)
    }

    async fn backlog(&self) -> Result<Backlog, Error> {
        each_engine!(self, s => s.backlog().await)
    }
}
