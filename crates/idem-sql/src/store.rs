//! The one SQL store, generic over its [`Engine`]: claims and request records in the same
//! database as the application's data, so a claim commits with the handler's writes.
//!
//! Everything here is the same on every engine — transactions, the single claim and its
//! fingerprint read-back, savepoints, bounded pruning, statistics, running the migration;
//! what differs (the SQL, the table's layout, the clock, error codes, the schema) is data the
//! engine answers with. The batch claim, pruning and migration are each engine's capability
//! impls (in its module), over the helpers here: they differ in how a batch binds, and a
//! partitioned PostgreSQL table is maintained rather than pruned row by row.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    ClaimRequest, ClaimStore, ConsumerName, ConsumerStats, Error, ErrorKind, Fingerprint,
    Savepoints, Stamp, Stats, TransactionalStore,
};
use idem_dialect::micros;

use crate::common::stored_fingerprint;
use crate::engine::{ClaimStatements, Engine, OutboxStatements, Param, RequestStatements};
use crate::errors::{commit_error, store_error};
use crate::held::{HeldConnections, PoolStrikes, Recycling};
use crate::tx::{Lent, Tx, bounded};
use idem_core::TableName;
use idem_core::request_record::RecordRow;

/// Claims (and idempotent-request records) in an SQL database, on engine `E`: use the aliases
/// [`SqliteStore`](crate::SqliteStore), [`PostgresStore`](crate::PostgresStore) and
/// [`MySqlStore`](crate::MySqlStore).
///
/// Cloning is cheap and shares the pool (and held connections).
pub struct SqlStore<E: Engine> {
    pub(crate) pool: sqlx::Pool<E>,
    /// Set by [`SqlStore::hold_connections`]: transactions run on these instead.
    held: Option<Arc<HeldConnections<E>>>,
    /// When a connection is given up (lifetime, idle time, `BEGIN` timeout, read-only).
    recycling: Recycling,
    /// Read-only refusals in a row of the transactions on the pool.
    strikes: Arc<PoolStrikes>,
    table: TableName,
    // The statements behind `Arc`s: an HTTP layer clones the store per request.
    pub(crate) sql: Arc<ClaimStatements>,
    requests: TableName,
    pub(crate) rsql: Arc<RequestStatements>,
    outbox: TableName,
    pub(crate) osql: Arc<OutboxStatements>,
    /// The claims table's layout beyond its name: `()` but on PostgreSQL, where
    /// `PostgresStore::partitioned` sets its partitioning.
    pub(crate) layout: E::Layout,
}

impl<E: Engine> Clone for SqlStore<E> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            held: self.held.clone(),
            recycling: self.recycling,
            strikes: self.strikes.clone(),
            table: self.table.clone(),
            sql: self.sql.clone(),
            requests: self.requests.clone(),
            rsql: self.rsql.clone(),
            outbox: self.outbox.clone(),
            osql: self.osql.clone(),
            layout: self.layout.clone(),
        }
    }
}

impl<E: Engine> std::fmt::Debug for SqlStore<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlStore")
            .field("engine", &<E as sqlx::Database>::NAME)
            .field("table", &self.table)
            .field("requests", &self.requests)
            .field("outbox", &self.outbox)
            .field("held", &self.held)
            .field("recycling", &self.recycling)
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

impl<E: Engine> SqlStore<E> {
    /// Uses an existing pool, with the default tables (`idem_processed`, `idem_requests`,
    /// `idem_outbox`):
    /// claims then share connections with the application's own queries. On SQLite the pool
    /// should use WAL and a busy timeout, as [`SqliteStore::open`](crate::SqliteStore::open)
    /// configures.
    pub fn from_pool(pool: sqlx::Pool<E>) -> Self {
        let (table, requests) = (TableName::default(), TableName::default_requests());
        let outbox = TableName::default_outbox();
        let recycling = Recycling::of_pool(&pool);
        let layout = E::Layout::default();
        Self {
            sql: Arc::new(E::claim_statements(&table, &layout)),
            rsql: Arc::new(E::request_statements(&requests)),
            osql: Arc::new(E::outbox_statements(&outbox)),
            outbox,
            pool,
            held: None,
            recycling,
            strikes: PoolStrikes::new(recycling),
            table,
            requests,
            layout,
        }
    }

    /// Stores claims in `table` instead of `idem_processed` (`schema.table` selects a schema,
    /// or a database on MySQL; SQLite refuses a qualified name). PostgreSQL spells it in lower
    /// case from here on ([`TableName::folded`]), as it resolves the unquoted name.
    pub fn with_table(mut self, table: TableName) -> Result<Self, Error> {
        let table = E::resolved_table(table);
        E::check_table(&table, &self.layout)?;
        self.sql = Arc::new(E::claim_statements(&table, &self.layout));
        self.table = table;
        Ok(self)
    }

    /// Lays the claims table out as `layout` says (PostgreSQL: partitioned), with the
    /// statements that fit it.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn with_layout(mut self, layout: E::Layout) -> Result<Self, Error> {
        E::check_table(&self.table, &layout)?;
        self.sql = Arc::new(E::claim_statements(&self.table, &layout));
        self.layout = layout;
        Ok(self)
    }

    /// Stores idempotent-request records in `table` instead of `idem_requests`.
    pub fn with_requests_table(mut self, table: TableName) -> Result<Self, Error> {
        let table = E::resolved_table(table);
        E::check_table(&table, &E::Layout::default())?;
        self.rsql = Arc::new(E::request_statements(&table));
        self.requests = table;
        Ok(self)
    }

    /// Writes outgoing messages to `table` instead of `idem_outbox`, and its dead letters to
    /// `<table>_dead_letters` (see [`OutboxStore`](idem_core::outbox::OutboxStore)).
    pub fn with_outbox_table(mut self, table: TableName) -> Result<Self, Error> {
        let table = E::resolved_table(table);
        E::check_table(&table, &E::Layout::default())?;
        self.osql = Arc::new(E::outbox_statements(&table));
        self.outbox = table;
        Ok(self)
    }

    /// Runs transactions on up to `max` connections the store keeps for them, instead of on
    /// the pool: a finished transaction's connection goes straight to the next one, without
    /// the two pings (acquire and return) sqlx's pool sends, which are a third of a
    /// one-message PostgreSQL transaction's round trips. Give a consumer as many as it has
    /// messages in flight, an HTTP service as many as it has keyed requests in flight.
    ///
    /// An idempotent request's record read runs on one of them too, and in the
    /// one-transaction mode its execution's transaction begins on the same connection: a
    /// replay costs one round trip, and a first execution no pings. The pool still serves
    /// pruning, statistics, lease renewals and releases, recovery points and migrations.
    ///
    /// The connections are opened on demand with the pool's connect options and wait up to
    /// its acquire timeout. A connection is closed, and the next transaction opens a new one
    /// (which resolves the server's name again: after a failover behind DNS it reaches the
    /// new primary):
    ///
    /// - when one of its transactions failed in a way that leaves it in doubt;
    /// - when its `BEGIN` fails (a stale idle connection after a server restart or a
    ///   terminated backend) or does not answer within [`begin_timeout`](Self::begin_timeout)
    ///   (a peer that vanished): the transaction is retried at once on a new connection;
    /// - past [`held_max_lifetime`](Self::held_max_lifetime) or
    ///   [`held_idle_timeout`](Self::held_idle_timeout) (by default the pool's
    ///   `max_lifetime` and `idle_timeout`, sqlx's defaults 30 and 10 minutes), checked when a
    ///   transaction begins;
    /// - after [`read_only_limit`](Self::read_only_limit) transactions in a row on it were
    ///   refused as read-only (a replica, a read-only session).
    ///
    /// Set those options before cloning the store.
    pub fn hold_connections(mut self, max: u32) -> Self {
        let options = (*self.pool.connect_options()).clone();
        let wait = self.pool.options().get_acquire_timeout();
        self.held = Some(HeldConnections::new(options, max, wait, self.recycling));
        self
    }

    /// How long a held connection is used after it was opened (`None`: for ever); default:
    /// the pool's `max_lifetime`. Checked when a transaction begins.
    pub fn held_max_lifetime(mut self, lifetime: Option<Duration>) -> Self {
        self.recycling.max_lifetime = lifetime;
        self.recycled()
    }

    /// How long a held connection may stay unused and still be used (`None`: for ever);
    /// default: the pool's `idle_timeout`. Checked when a transaction begins.
    pub fn held_idle_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.recycling.idle_timeout = timeout;
        self.recycled()
    }

    /// How long a transaction's `BEGIN` may take (`None`: as long as the network does) before
    /// it fails as [`ErrorKind::Unavailable`] and its connection is closed; a held
    /// connection's is first retried on a new connection. Default: the pool's acquire
    /// timeout (30 s unless set) on PostgreSQL and MySQL, none on SQLite (its `BEGIN
    /// IMMEDIATE` waits for the write lock, which the busy timeout bounds).
    pub fn begin_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.recycling.begin_timeout = timeout;
        self.recycled()
    }

    /// After how many transactions in a row whose claim or commit the database refused as
    /// read-only (PostgreSQL 25006, MySQL 1290 / 1792 / 1836) a connection is closed, so that
    /// the next one opens afresh (0: never); default 2. On held connections the count is each
    /// connection's; on the pool, which does not tell its connections apart, it is the
    /// store's, and once reached every connection refused as read-only is closed until a
    /// write succeeds. The transaction itself fails as before (`Unavailable`, retried).
    pub fn read_only_limit(mut self, limit: u32) -> Self {
        self.recycling.read_only_limit = limit;
        self.recycled()
    }

    /// Applies changed limits to the pool's count and the held connections.
    fn recycled(mut self) -> Self {
        self.strikes = PoolStrikes::new(self.recycling);
        self.held = self.held.map(|h| h.with_limits(self.recycling));
        self
    }

    /// The pool.
    pub fn pool(&self) -> &sqlx::Pool<E> {
        &self.pool
    }

    /// The claims table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// The idempotent-request records table.
    pub fn requests_table(&self) -> &TableName {
        &self.requests
    }

    /// The outbox table.
    pub fn outbox_table(&self) -> &TableName {
        &self.outbox
    }

    /// Begins a transaction (SQLite: `BEGIN IMMEDIATE`, holding the write lock) for a caller
    /// that claims with [`claim_on`](Self::claim_on) inside its own unit of work.
    pub async fn begin_tx(&self) -> Result<Tx<E>, Error> {
        self.begin_with(E::BEGIN).await
    }

    /// A transaction on the held connections or the pool, begun with `begin`.
    pub(crate) async fn begin_with(&self, begin: &'static str) -> Result<Tx<E>, Error> {
        match &self.held {
            Some(held) => Tx::begin_held(held, begin).await,
            None => {
                let strikes = Some(self.strikes.clone());
                Tx::begin_pooled(&self.pool, begin, self.recycling.begin_timeout, strikes).await
            }
        }
        .map_err(|e| store_error::<E>(begin, e))
    }

    /// Reads an idempotent request's record with `sql` on a connection that is then lent to
    /// the caller ([`Lent`]), to begin the transaction that takes the record on: one of the
    /// held connections if the store holds them (no pings; an idle one that fails is replaced
    /// by a fresh one, as for a `BEGIN`), else the pool's. Bounded by the `BEGIN` timeout: it
    /// is the first statement on the connection.
    pub(crate) async fn read_record(
        &self,
        sql: &str,
        params: &[Param<'_>],
    ) -> Result<(RecordRow, Lent<E>), sqlx::Error> {
        let limit = self.recycling.begin_timeout;
        let Some(held) = &self.held else {
            let mut conn = self.pool.acquire().await?;
            return match bounded(limit, "a read", E::fetch_record(&mut conn, sql, params)).await {
                Ok(row) => Ok((row, Lent::pooled(conn, self.strikes.clone()))),
                Err(e) => {
                    if !matches!(e, sqlx::Error::Database(_)) {
                        conn.close_on_drop();
                    }
                    Err(e)
                }
            };
        };
        let mut lent = held.lend().await?;
        if let Some(conn) = lent.idle_conn() {
            match bounded(limit, "a read", E::fetch_record(conn, sql, params)).await {
                Ok(row) => {
                    lent.ready();
                    return Ok((row, Lent::held(lent)));
                }
                // The server answered: the connection is sound, the statement is not.
                Err(e @ sqlx::Error::Database(_)) => {
                    lent.ready();
                    return Err(e);
                }
                // Went stale while idle: a fresh connection below.
                Err(_) => {}
            }
        }
        let conn = lent.open().await?;
        let row = bounded(limit, "a read", E::fetch_record(conn, sql, params)).await?;
        lent.ready();
        Ok((row, Lent::held(lent)))
    }

    /// The transaction of an idempotent request's execution (the engine's `REQUEST_BEGIN`) on
    /// the connection its record was just read on.
    pub(crate) async fn begin_execution_on(&self, lent: Lent<E>) -> Result<Tx<E>, Error> {
        Tx::begin_lent(lent, E::REQUEST_BEGIN, self.recycling.begin_timeout)
            .await
            .map_err(|e| store_error::<E>(E::REQUEST_BEGIN, e))
    }

    /// The claim on a connection inside a transaction the caller began (see
    /// [`begin_tx`](Self::begin_tx)). `None`: inserted now; `Some(fp)`: already claimed with
    /// fingerprint `fp`.
    ///
    /// One insert that cannot race; it reports exactly one affected row when this transaction
    /// inserted the claim (see each engine's module docs for its statement).
    pub async fn claim_on(
        &self,
        conn: &mut E::Connection,
        claim: ClaimRequest<'_>,
    ) -> Result<Option<Fingerprint>, Error> {
        let (consumer, id) = (claim.consumer.as_str(), claim.id.as_bytes());
        let key = E::partition_key(&self.layout, claim.id)?;
        let fingerprint = claim.fingerprint.as_bytes();
        let params = Keyed::new(
            [
                Param::Text(consumer),
                Param::Bytes(id),
                Param::Bytes(&fingerprint[..]),
                Param::OptInt(E::stamp(claim.at)),
            ],
            key,
        );
        let inserted = E::execute(conn, &self.sql.claim, params.bound())
            .await
            .map_err(|e| store_error::<E>("claim", e))?;
        if inserted == 1 {
            return Ok(None);
        }
        let params = Keyed::new([Param::Text(consumer), Param::Bytes(id)], key);
        let row = E::fetch_bytes(conn, &self.sql.read_fingerprint, params.bound())
            .await
            .map_err(|e| store_error::<E>("reading the stored fingerprint", e))?;
        stored_fingerprint(row)
    }

    /// Creates the tables with the engine's migration: in one transaction where the engine's
    /// DDL is transactional (SQLite's `BEGIN IMMEDIATE`: concurrent starts take turns), else
    /// statement by statement (MySQL, where `CREATE … IF NOT EXISTS` is atomic on its own).
    #[cfg_attr(not(any(feature = "sqlite", feature = "mysql")), allow(dead_code))]
    pub(crate) async fn migrate_tables(&self) -> Result<(), Error> {
        TableName::check_distinct(&self.table, &self.requests)?;
        idem_dialect::outbox::check_tables(&self.table, &self.requests, &self.outbox)?;
        let mut statements = E::migration(&self.table, &self.requests, &self.layout);
        statements.extend(E::outbox_migration(&self.outbox));
        let recovery = E::recovery_migration(&self.requests);
        let err = |e| store_error::<E>("migrate", e);
        if !E::TRANSACTIONAL_DDL {
            for sql in &statements {
                E::execute_pool(&self.pool, sql, &[]).await.map_err(err)?;
            }
            if let Some(m) = recovery {
                let mut conn = self.pool.acquire().await.map_err(err)?;
                let complete = idem_dialect::RecoveryMigration::COLUMNS;
                if E::fetch_int(&mut conn, &m.probe, &[]).await.map_err(err)? < complete {
                    for sql in &m.add {
                        if let Err(e) = E::execute(&mut conn, sql, &[]).await {
                            // Another replica's migration added them first (one statement:
                            // all of them or none).
                            if E::fetch_int(&mut conn, &m.probe, &[]).await.map_err(err)? < complete
                            {
                                return Err(err(e));
                            }
                        }
                    }
                }
            }
            return Ok(());
        }
        let mut tx = self.begin_tx().await?;
        for sql in &statements {
            E::execute(&mut tx, sql, &[]).await.map_err(err)?;
        }
        if let Some(m) = recovery
            && E::fetch_int(&mut tx, &m.probe, &[]).await.map_err(err)?
                < idem_dialect::RecoveryMigration::COLUMNS
        {
            for sql in &m.add {
                E::execute(&mut tx, sql, &[]).await.map_err(err)?;
            }
        }
        tx.commit().await.map_err(commit_error::<E>)
    }

    /// A transaction of the relay's own (a lease, a dead letter) on the pool, with the
    /// store's `BEGIN` timeout: never on the held connections, which are the consumer's.
    pub(crate) async fn begin_relay(&self) -> Result<Tx<E>, Error> {
        let begin = self.osql.relay_begin.unwrap_or(E::BEGIN);
        Tx::begin_pooled(&self.pool, begin, self.recycling.begin_timeout, None)
            .await
            .map_err(|e| store_error::<E>(begin, e))
    }

    /// Runs a fixed statement inside `tx`.
    async fn exec(tx: &mut Tx<E>, sql: &'static str) -> Result<(), Error> {
        E::execute_simple(tx, sql)
            .await
            .map(drop)
            .map_err(|e| store_error::<E>(sql, e))
    }
}

impl<E: Engine> TransactionalStore for SqlStore<E> {
    type Tx = Tx<E>;

    async fn begin(&self) -> Result<Tx<E>, Error> {
        self.begin_tx().await
    }

    async fn commit(&self, tx: Tx<E>) -> Result<(), Error> {
        tx.commit().await.map_err(commit_error::<E>)
    }

    async fn rollback(&self, tx: Tx<E>) -> Result<(), Error> {
        tx.rollback()
            .await
            .map_err(|e| store_error::<E>("rollback", e))
    }

    fn classify(&self, error: &(dyn std::error::Error + 'static)) -> Option<ErrorKind> {
        crate::errors::classify::<E>(error)
    }

    /// `SELECT 1` on the pool (never on a held connection, which may be the one just lost).
    async fn probe(&self) -> Result<(), Error> {
        E::execute_pool(&self.pool, "SELECT 1", &[])
            .await
            .map(drop)
            .map_err(|e| store_error::<E>("probe", e))
    }
}

impl<E: Engine> ClaimStore for SqlStore<E> {
    fn max_message_id_len(&self) -> usize {
        E::MAX_MESSAGE_ID_LEN
    }

    /// A partitioned table's retention (PostgreSQL): its days are dropped past it.
    fn kept_for(&self) -> Option<Duration> {
        E::kept_for(&self.layout)
    }

    async fn claim(
        &self,
        tx: &mut Tx<E>,
        claim: ClaimRequest<'_>,
    ) -> Result<Option<Fingerprint>, Error> {
        let claimed = self.claim_on(tx, claim).await;
        tx.saw(&claimed);
        claimed
    }
}

impl<E: Engine> Savepoints for SqlStore<E> {
    async fn savepoint(&self, tx: &mut Tx<E>) -> Result<(), Error> {
        Self::exec(tx, "SAVEPOINT idem_message").await
    }

    async fn release_savepoint(&self, tx: &mut Tx<E>) -> Result<(), Error> {
        Self::exec(tx, "RELEASE SAVEPOINT idem_message").await
    }

    async fn rollback_to_savepoint(&self, tx: &mut Tx<E>) -> Result<(), Error> {
        // ROLLBACK TO keeps the savepoint; release it so savepoints do not pile up.
        Self::exec(tx, "ROLLBACK TO SAVEPOINT idem_message").await?;
        Self::exec(tx, "RELEASE SAVEPOINT idem_message").await
    }
}

impl<E: Engine> SqlStore<E> {
    /// Deletes up to `limit` claims older than `older_than` row by row, with the engine's
    /// prune statements (on a partitioned table: from its default and undated partitions).
    pub(crate) async fn prune_rows(
        &self,
        consumer: Option<&ConsumerName>,
        now: Stamp,
        older_than: Duration,
        limit: u32,
    ) -> Result<u64, Error> {
        let (now, age, limit) = (
            Param::OptInt(E::stamp(now)),
            Param::Int(micros(older_than)),
            Param::Int(i64::from(limit)),
        );
        let result = match consumer {
            None => E::execute_pool(&self.pool, &self.sql.prune_all, &[now, age, limit]).await,
            Some(c) => {
                let params = [now, age, Param::Text(c.as_str()), limit];
                E::execute_pool(&self.pool, &self.sql.prune_consumer, &params).await
            }
        };
        result.map_err(|e| store_error::<E>("prune", e))
    }
}

impl<E: Engine> Stats for SqlStore<E> {
    async fn stats(&self) -> Result<Vec<ConsumerStats>, Error> {
        E::fetch_stats(&self.pool, &self.sql.stats)
            .await
            .map_err(|e| store_error::<E>("stats", e))
    }
}

/// A statement's listed parameters, then the partition key where the table has one (claim
/// statements take it last). On the stack: the claim is the hot path.
#[derive(Debug)]
struct Keyed<'a> {
    params: [Param<'a>; 5],
    len: usize,
}

impl<'a> Keyed<'a> {
    /// `listed` (at most four), then `key` if there is one.
    fn new<const N: usize>(listed: [Param<'a>; N], key: Option<i64>) -> Self {
        let mut params = [Param::Int(0); 5];
        params[..N].copy_from_slice(&listed);
        let mut len = N;
        if let Some(key) = key {
            params[len] = Param::Int(key);
            len += 1;
        }
        Self { params, len }
    }

    /// The parameters as bound.
    fn bound(&self) -> &[Param<'a>] {
        &self.params[..self.len]
    }
}
