//! [`PgStore`]: claims in PostgreSQL over tokio-postgres, every claim capability of
//! `idem_core::store`, with `BEGIN` and the claim in one flight.
//!
//! # Why `BEGIN` and the claim cost one round trip
//!
//! A tokio-postgres `Client` is a handle on a connection task: each request (`execute`,
//! `batch_execute`, …) is encoded and queued to that task the first time its future is polled,
//! and only then does the future wait for its answers, which come back in request order. Two
//! requests polled together are therefore both on the wire before either answer is read: the
//! connection task writes everything queued before it flushes. [`begin_and_claim`] polls
//! `BEGIN` and the prepared claim together with `futures_util::future::join`, which polls its
//! first future before its second, so `BEGIN` is always queued first and the claim runs inside
//! the transaction. The claim's statement is prepared before, once per connection (a cached
//! statement costs nothing), so nothing waits in between. A new message thus costs what the
//! bare handler does — `BEGIN`, the handler's statements, `COMMIT` — and a duplicate one
//! round trip more, to read the stored fingerprint. `tests/postgres/pipelining.rs` counts the
//! round trips through a proxy that holds the server's answers back.
//!
//! `BEGIN` cannot fail while the claim succeeds (it fails only on a broken connection or an
//! aborted transaction, and so does the claim), which is what makes sending the claim before
//! `BEGIN` is confirmed safe; a failed `BEGIN` still abandons the connection whatever the claim
//! did.
//!
//! [`begin_and_claim`]: idem_core::ClaimStore::begin_and_claim

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join;
use idem_core::{
    BatchClaimStore, ClaimRequest, ClaimStore, ConsumerName, ConsumerStats, Error, ErrorKind,
    Fingerprint, MessageId, Migrate, Prune, Savepoints, Stamp, Stats, Timestamp,
    TransactionalStore,
};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, GenericClient, Row};

use crate::conn::{CLIENT_WAIT, Clients, Lease, Limits, Source, begin_error};
use crate::errors::{commit_error, store_error};
use crate::tx::PgTx;
use idem_core::TableName;
use idem_dialect::postgres as sql;
use idem_dialect::postgres::partition::{Partitioning, check_table_name};
use idem_dialect::{ClaimStatements, OutboxStatements, RequestStatements, micros};

/// Longest message ID the schema holds (the same limit as `idem-sql`'s PostgreSQL store): well
/// inside the btree tuple limit.
pub const MAX_MESSAGE_ID_LEN: usize = 1024;

/// Claims (and idempotent-request records) in PostgreSQL, on tokio-postgres: a
/// deadpool-postgres pool ([`from_pool`](Self::from_pool), [`connect`](Self::connect)) or plain
/// clients ([`from_clients`](Self::from_clients)).
///
/// Same tables, statements and semantics as `idem_sql::PostgresStore`; what differs is the
/// driver: statements are prepared once per connection, and `BEGIN` and the claim go out in
/// one flight (see the module docs), so the claim costs no round trip of its own. Handlers
/// receive a [`PgTx`].
///
/// Cloning is cheap and shares the connections.
#[derive(Clone)]
pub struct PgStore {
    pub(crate) source: Source,
    /// When a connection is given up (lifetime, idle time, `BEGIN` timeout, read-only).
    limits: Arc<Limits>,
    table: TableName,
    pub(crate) sql: Arc<ClaimStatements>,
    requests: TableName,
    pub(crate) rsql: Arc<RequestStatements>,
    outbox: TableName,
    pub(crate) osql: Arc<OutboxStatements>,
    /// Set by [`partitioned`](Self::partitioned): claims carry the ID's time as partition key.
    pub(crate) partitioning: Option<Partitioning>,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("source", &self.source)
            .field("limits", &self.limits)
            .field("table", &self.table)
            .field("requests", &self.requests)
            .field("outbox", &self.outbox)
            .field("partitioning", &self.partitioning)
            .finish()
    }
}

impl PgStore {
    fn new(source: Source, wait: Duration) -> Self {
        let (table, requests) = (TableName::default(), TableName::default_requests());
        let outbox = TableName::default_outbox();
        Self {
            source,
            limits: Arc::new(Limits::new(wait)),
            sql: Arc::new(sql::claim_statements(&table, false)),
            rsql: Arc::new(sql::request_statements(&requests)),
            osql: Arc::new(sql::outbox_statements(&outbox)),
            outbox,
            table,
            requests,
            partitioning: None,
        }
    }

    /// Uses a deadpool-postgres pool, with the default tables (`idem_processed`,
    /// `idem_requests`): claims then share connections — and their statement caches — with the
    /// application's own queries. Its recycling method should be `RecyclingMethod::Fast` (the
    /// default), which hands a connection out without a round trip.
    ///
    /// The store retires the pool's connections past [`max_lifetime`](Self::max_lifetime) or
    /// [`idle_timeout`](Self::idle_timeout) before it takes one (deadpool has neither), bounds
    /// each `BEGIN` by [`begin_timeout`](Self::begin_timeout) (default: the pool's wait
    /// timeout, or 30 s), and closes connections refused as read-only
    /// ([`read_only_limit`](Self::read_only_limit)).
    #[cfg(feature = "deadpool")]
    pub fn from_pool(pool: deadpool_postgres::Pool) -> Self {
        let wait = pool.timeouts().wait.unwrap_or(CLIENT_WAIT);
        Self::new(Source::Pool(pool), wait)
    }

    /// Connects a pool of up to 16 connections to `url` (`postgres://user@host/db`, without
    /// TLS; build the pool yourself for TLS and use [`from_pool`](Self::from_pool)), with the
    /// default tables. One connection is opened first, so an unreachable server or a database
    /// that does not exist is reported at once with its cause.
    #[cfg(feature = "deadpool")]
    pub async fn connect(url: &str) -> Result<Self, Error> {
        use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};

        const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
        let shown = idem_redact::redact_url(url);
        let config: tokio_postgres::Config = url.parse().map_err(|e: tokio_postgres::Error| {
            Error::new(
                ErrorKind::InvalidConfig,
                format!("invalid PostgreSQL URL {shown}: {e}"),
            )
            .with_source(e)
        })?;
        let what = format!("connecting to {shown}");
        match tokio::time::timeout(CONNECT_TIMEOUT, config.connect(tokio_postgres::NoTls)).await {
            Err(_) => {
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    format!(
                        "PostgreSQL: {what} timed out after {}s",
                        CONNECT_TIMEOUT.as_secs()
                    ),
                ));
            }
            Ok(Err(e)) => return Err(store_error(&what, e)),
            // The probe's connection task ends when its client is dropped.
            Ok(Ok(_probe)) => {}
        }
        let manager = Manager::from_config(
            config,
            tokio_postgres::NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(16)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(Duration::from_secs(30)))
            .create_timeout(Some(CONNECT_TIMEOUT))
            .build()
            .map_err(|e| {
                Error::new(
                    ErrorKind::InvalidConfig,
                    format!("PostgreSQL: building the pool for {shown}: {e}"),
                )
            })?;
        Ok(Self::from_pool(pool))
    }

    /// Uses plain tokio-postgres clients (each with its connection task already spawned), with
    /// the default tables: a transaction or statement takes one client for itself, waiting up
    /// to 30 s for one to come free, so give the store as many as it runs transactions at once
    /// (plus one for request lookups, which run beside the operation's transaction). Each
    /// client keeps the statements prepared on it. A client whose connection closed is
    /// dropped; the store cannot reopen it, so it works on with the others, and reports
    /// [`ErrorKind::Unavailable`] once none is left. The same for a client whose `BEGIN` gets
    /// no answer within [`begin_timeout`](Self::begin_timeout) (default 30 s). Plain clients
    /// are not recycled otherwise (no lifetime, idle timeout or read-only limit): the store
    /// has no configuration to open their replacements with.
    pub fn from_clients(clients: impl IntoIterator<Item = Client>) -> Self {
        Self::new(Source::Clients(Clients::new(clients)), CLIENT_WAIT)
    }

    /// [`from_clients`](Self::from_clients) with one client: every transaction and statement
    /// takes turns on it.
    pub fn from_client(client: Client) -> Self {
        Self::from_clients([client])
    }

    /// Stores claims in `table` instead of `idem_processed` (`schema.table` selects a schema).
    /// Spelled in lower case from here on ([`TableName::folded`]), as PostgreSQL resolves the
    /// unquoted name.
    pub fn with_table(mut self, table: TableName) -> Result<Self, Error> {
        let table = table.folded();
        let partitioned = self.partitioning.is_some();
        if partitioned {
            check_table_name(table.table())?;
        }
        self.sql = Arc::new(sql::claim_statements(&table, partitioned));
        self.table = table;
        Ok(self)
    }

    /// Stores idempotent-request records in `table` instead of `idem_requests` (spelled in
    /// lower case, as [`with_table`](Self::with_table)).
    pub fn with_requests_table(mut self, table: TableName) -> Result<Self, Error> {
        let table = table.folded();
        self.rsql = Arc::new(sql::request_statements(&table));
        self.requests = table;
        Ok(self)
    }

    /// Writes outgoing messages to `table` instead of `idem_outbox`, and its dead letters to
    /// `<table>_dead_letters` (spelled in lower case, as [`with_table`](Self::with_table)).
    pub fn with_outbox_table(mut self, table: TableName) -> Result<Self, Error> {
        let table = table.folded();
        self.osql = Arc::new(sql::outbox_statements(&table));
        self.outbox = table;
        Ok(self)
    }

    /// How long a pooled connection is used after it was opened (`None`: for ever); default
    /// 30 minutes, sqlx's. Checked before each lease, on the pool's idle connections.
    pub fn max_lifetime(mut self, lifetime: Option<Duration>) -> Self {
        self.limits = Arc::new(self.limits.with(|l| l.max_lifetime = lifetime));
        self
    }

    /// How long a pooled connection may go without being handed out and still be used
    /// (`None`: for ever); default 10 minutes, sqlx's. Checked before each lease.
    pub fn idle_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.limits = Arc::new(self.limits.with(|l| l.idle_timeout = timeout));
        self
    }

    /// How long a transaction's `BEGIN` may take (`None`: as long as the network does) before
    /// it fails as [`ErrorKind::Unavailable`] and its connection is closed — a peer that
    /// vanished answers nothing until TCP gives up. Pipelined with the claim, only the
    /// `BEGIN`'s answer is timed, not a claim waiting on a concurrent duplicate's lock.
    pub fn begin_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.limits = Arc::new(self.limits.with(|l| l.begin_timeout = timeout));
        self
    }

    /// After how many transactions in a row whose claim or commit the server refused as
    /// read-only (SQLSTATE 25006: a standby, a read-only session) each pooled connection
    /// refused so is closed instead of returned, until a write succeeds (0: never); default
    /// 2. After a failover behind a DNS name, the next connection reaches the new primary.
    pub fn read_only_limit(mut self, limit: u32) -> Self {
        self.limits = Arc::new(self.limits.with(|l| l.read_only_limit = limit));
        self
    }

    /// The pool, when the store runs on one.
    #[cfg(feature = "deadpool")]
    pub fn pool(&self) -> Option<&deadpool_postgres::Pool> {
        match &self.source {
            Source::Pool(pool) => Some(pool),
            Source::Clients(_) => None,
        }
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

    /// Begins a transaction, for a caller that claims inside its own unit of work (with
    /// [`claim`](ClaimStore::claim) or `Processor::claim_in`) and commits it with
    /// [`TransactionalStore::commit`] or [`PgTx::commit`].
    pub async fn begin_tx(&self) -> Result<PgTx, Error> {
        self.begin_with(sql::BEGIN).await
    }

    /// Begins a transaction with `begin` (a `BEGIN`, possibly followed by `SET LOCAL`s in the
    /// same simple query).
    pub(crate) async fn begin_with(&self, begin: &str) -> Result<PgTx, Error> {
        let mut tx = PgTx::begun(self.lease().await?, self.limits.clone());
        let limit = self.limits.begin_timeout;
        let begun = bounded(limit, tx.batch_execute(begin)).await;
        match begun {
            Some(begun) => begun.map_err(begin_error)?,
            None => return Err(begin_hung(&mut tx, limit)),
        }
        Ok(tx)
    }

    /// The claim on any tokio-postgres client or transaction the caller owns (a
    /// `tokio_postgres::Transaction`, a bb8 or deadpool connection inside `BEGIN`): `None` when
    /// inserted now, `Some(fp)` when already claimed with fingerprint `fp`. The store's
    /// statement caches belong to its own connections, so this one is not prepared: it goes
    /// out with its parameter types in one round trip (`execute_typed`) and is planned on every
    /// call.
    pub async fn claim_on<C>(
        &self,
        client: &C,
        claim: ClaimRequest<'_>,
    ) -> Result<Option<Fingerprint>, Error>
    where
        C: GenericClient + Sync + ?Sized,
    {
        let client = client.client();
        let p = self.params(&claim)?;
        let claim: [(&(dyn ToSql + Sync), Type); 5] = [
            (&p.consumer, Type::TEXT),
            (&p.id, Type::BYTEA),
            (&p.fingerprint, Type::BYTEA),
            (&p.at, Type::INT8),
            (&p.key, Type::INT8),
        ];
        let inserted = client
            .execute_typed(&self.sql.claim, p.bound(&claim))
            .await
            .map_err(|e| store_error("claim", e))?;
        if inserted == 1 {
            return Ok(None);
        }
        let read: [(&(dyn ToSql + Sync), Type); 3] = [
            (&p.consumer, Type::TEXT),
            (&p.id, Type::BYTEA),
            (&p.key, Type::INT8),
        ];
        let row = client
            .query_typed_opt(&self.sql.read_fingerprint, p.bound(&read))
            .await
            .map_err(|e| store_error("reading the stored fingerprint", e))?;
        stored_fingerprint(
            row.map(|r| r.try_get(0))
                .transpose()
                .map_err(|e| store_error("reading the stored fingerprint", e))?,
        )
        .map(Some)
    }

    /// The stored fingerprint of a claim that was there already, read inside `tx`.
    async fn read_fingerprint(&self, tx: &PgTx, p: &ClaimParams<'_>) -> Result<Fingerprint, Error> {
        let what = "reading the stored fingerprint";
        let read = tx
            .prepare_cached(&self.sql.read_fingerprint)
            .await
            .map_err(|e| store_error(what, e))?;
        let params: [&(dyn ToSql + Sync); 3] = [&p.consumer, &p.id, &p.key];
        let row = tx
            .query_opt(&read, p.bound(&params))
            .await
            .map_err(|e| store_error(what, e))?;
        stored_fingerprint(
            row.map(|r| r.try_get(0))
                .transpose()
                .map_err(|e| store_error(what, e))?,
        )
    }

    /// What the batch claim's `RETURNING` reports, in `ids` order: `None` for each inserted,
    /// the stored fingerprint (read inside `tx`) for the rest.
    async fn claimed_many(
        &self,
        tx: &PgTx,
        consumer: &str,
        batch: &Batch<'_>,
        inserted: Vec<Row>,
    ) -> Result<Vec<Option<Fingerprint>>, Error> {
        let ids = &batch.ids;
        if inserted.len() == ids.len() {
            return Ok(vec![None; ids.len()]);
        }
        let inserted: HashSet<Vec<u8>> = inserted
            .iter()
            .map(|r| r.try_get(0))
            .collect::<Result<_, _>>()
            .map_err(|e| store_error("batch claim", e))?;
        let existing: Vec<&[u8]> = ids
            .iter()
            .copied()
            .filter(|id| !inserted.contains(*id))
            .collect();
        let what = "reading stored fingerprints";
        let read = tx
            .prepare_cached(&self.sql.read_fingerprints)
            .await
            .map_err(|e| store_error(what, e))?;
        // A superset of the keys of `existing` is fine: (consumer, message_id) decides.
        let params: [&(dyn ToSql + Sync); 3] = [&consumer, &existing, &batch.keys];
        let rows = tx
            .query(&read, batch.bound(&params))
            .await
            .map_err(|e| store_error(what, e))?;
        let mut stored: HashMap<Vec<u8>, Vec<u8>> = rows
            .iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .collect::<Result<_, tokio_postgres::Error>>()
            .map_err(|e| store_error(what, e))?;
        ids.iter()
            .map(|id| {
                if inserted.contains(*id) {
                    Ok(None)
                } else {
                    stored_fingerprint(stored.remove(*id)).map(Some)
                }
            })
            .collect()
    }

    /// A statement outside any transaction, on a connection of its own.
    pub(crate) async fn execute_alone(
        &self,
        what: &str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, Error> {
        let lease = self.lease().await?;
        let statement = lease.prepare(sql).await.map_err(|e| store_error(what, e))?;
        lease
            .client()
            .execute(&statement, params)
            .await
            .map_err(|e| store_error(what, e))
    }

    /// A lease's connection, for the request store's lookups.
    pub(crate) async fn lease(&self) -> Result<Lease, Error> {
        self.source.get(&self.limits).await
    }

    /// Runs a fixed statement inside `tx`.
    async fn exec(tx: &PgTx, sql: &'static str) -> Result<(), Error> {
        tx.batch_execute(sql).await.map_err(|e| store_error(sql, e))
    }
}

/// A claim's parameters as bound.
struct ClaimParams<'a> {
    consumer: &'a str,
    id: &'a [u8],
    fingerprint: &'a [u8],
    at: Option<i64>,
    /// The partition key, on a partitioned table; its statements take it last.
    key: Option<i64>,
}

impl ClaimParams<'_> {
    /// A statement's parameters without the partition key when the table is not partitioned
    /// (its statements take one parameter fewer).
    fn bound<'p, T>(&self, params: &'p [T]) -> &'p [T] {
        &params[..params.len() - usize::from(self.key.is_none())]
    }
}

/// A batch claim's parameters as bound: the arrays the statement unnests.
struct Batch<'a> {
    ids: Vec<&'a [u8]>,
    fps: Vec<&'a [u8]>,
    /// The partition keys, on a partitioned table; its statements take them last.
    keys: Option<Vec<i64>>,
}

impl Batch<'_> {
    /// As [`ClaimParams::bound`].
    fn bound<'p, T>(&self, params: &'p [T]) -> &'p [T] {
        &params[..params.len() - usize::from(self.keys.is_none())]
    }
}

impl PgStore {
    /// A claim's parameters; the partition key refused when the store's partitioning cannot
    /// read IDs (see `Partitioning::key_of`).
    fn params<'a>(&self, claim: &ClaimRequest<'a>) -> Result<ClaimParams<'a>, Error> {
        Ok(ClaimParams {
            consumer: claim.consumer.as_str(),
            id: claim.id.as_bytes(),
            fingerprint: &claim.fingerprint.as_bytes()[..],
            at: stamp(claim.at),
            key: self
                .partitioning
                .as_ref()
                .map(|p| p.key_of(claim.id))
                .transpose()?,
        })
    }

    fn batch<'a>(&self, items: &'a [(&'a MessageId, Fingerprint)]) -> Result<Batch<'a>, Error> {
        let (ids, fps) = items
            .iter()
            .map(|(id, fp)| (id.as_bytes(), &fp.as_bytes()[..]))
            .unzip();
        let keys = self
            .partitioning
            .as_ref()
            .map(|p| items.iter().map(|(id, _)| p.key_of(id)).collect())
            .transpose()?;
        Ok(Batch { ids, fps, keys })
    }
}

/// `processed_at` / `now` as bound: `NULL` makes the statement read the server's clock
/// (`COALESCE($n, <server now>)`), so every host stamps and prunes on one clock.
pub(crate) fn stamp(stamp: Stamp) -> Option<i64> {
    match stamp {
        Stamp::StoreClock => None,
        Stamp::At(t) => Some(t.as_micros()),
    }
}

/// The stored column as a fingerprint; a missing row means the claim vanished between the
/// insert and the read (pruned concurrently), which a retry resolves.
fn stored_fingerprint(bytes: Option<Vec<u8>>) -> Result<Fingerprint, Error> {
    match bytes {
        Some(b) => Fingerprint::from_slice(&b).ok_or_else(|| {
            Error::new(
                ErrorKind::Store,
                format!("stored fingerprint is {} bytes, expected 32", b.len()),
            )
        }),
        None => Err(Error::new(
            ErrorKind::Transient,
            "claim existed at insert but was gone when read back (pruned concurrently?); retry",
        )),
    }
}

/// `begin` within `limit`: `None` past it (the future, with its half-sent `BEGIN`, dropped).
async fn bounded<T>(limit: Option<Duration>, begin: impl Future<Output = T>) -> Option<T> {
    match limit {
        None => Some(begin.await),
        Some(limit) => tokio::time::timeout(limit, begin).await.ok(),
    }
}

/// `BEGIN` and the claim pipelined in one flight (`join` polls `begin` first, so it is queued
/// first): `None` if `BEGIN` has not answered within `limit`. Only `BEGIN` is timed: a claim
/// may rightly wait for a concurrent duplicate's transaction to end.
async fn begin_with<B, C>(
    limit: Option<Duration>,
    begin: impl Future<Output = B>,
    claim: impl Future<Output = C>,
) -> Option<(B, C)> {
    let Some(limit) = limit else {
        return Some(join(begin, claim).await);
    };
    let answered = std::sync::atomic::AtomicBool::new(false);
    let begin = async {
        let begun = begin.await;
        answered.store(true, std::sync::atomic::Ordering::Relaxed);
        begun
    };
    let flight = join(begin, claim);
    let deadline = tokio::time::sleep(limit);
    tokio::pin!(flight, deadline);
    loop {
        let unanswered = !answered.load(std::sync::atomic::Ordering::Relaxed);
        tokio::select! {
            biased;
            both = &mut flight => return Some(both),
            () = &mut deadline, if unanswered => {
                if !answered.load(std::sync::atomic::Ordering::Relaxed) {
                    return None;
                }
            }
        }
    }
}

/// A `BEGIN` that got no answer in time: its connection is closed, and the error says so.
fn begin_hung(tx: &mut PgTx, limit: Option<Duration>) -> Error {
    tx.discard();
    Error::new(
        ErrorKind::Unavailable,
        format!(
            "PostgreSQL: {}: no answer within {:?}; the connection was closed (a peer that \
             vanished, or a network path that stopped forwarding)",
            sql::BEGIN,
            limit.unwrap_or_default()
        ),
    )
}

/// Ends a transaction whose claim failed; a failed rollback abandons the connection, and the
/// claim's error is the one worth reporting.
async fn end(tx: PgTx) {
    let _ = tx.rollback().await;
}

impl TransactionalStore for PgStore {
    type Tx = PgTx;

    async fn begin(&self) -> Result<PgTx, Error> {
        self.begin_tx().await
    }

    async fn commit(&self, tx: PgTx) -> Result<(), Error> {
        tx.commit().await.map_err(commit_error)
    }

    async fn rollback(&self, tx: PgTx) -> Result<(), Error> {
        tx.rollback().await.map_err(|e| store_error("rollback", e))
    }

    fn classify(&self, error: &(dyn std::error::Error + 'static)) -> Option<ErrorKind> {
        crate::errors::classify(error)
    }

    /// `SELECT 1` on a connection of the pool (or a live plain client), outside any
    /// transaction.
    async fn probe(&self) -> Result<(), Error> {
        let lease = self.lease().await?;
        lease
            .client()
            .batch_execute("SELECT 1")
            .await
            .map_err(|e| store_error("probe", e))
    }
}

impl ClaimStore for PgStore {
    fn max_message_id_len(&self) -> usize {
        MAX_MESSAGE_ID_LEN
    }

    /// A partitioned table's retention: its days are dropped past it.
    fn kept_for(&self) -> Option<Duration> {
        self.partitioning.as_ref().map(|p| p.kept_for())
    }

    async fn claim(
        &self,
        tx: &mut PgTx,
        claim: ClaimRequest<'_>,
    ) -> Result<Option<Fingerprint>, Error> {
        let p = self.params(&claim)?;
        let insert = tx
            .prepare_cached(&self.sql.claim)
            .await
            .map_err(|e| store_error("claim", e))?;
        let params: [&(dyn ToSql + Sync); 5] = [&p.consumer, &p.id, &p.fingerprint, &p.at, &p.key];
        let inserted = tx.execute(&insert, p.bound(&params)).await;
        tx.saw(&inserted);
        if inserted.map_err(|e| store_error("claim", e))? == 1 {
            return Ok(None);
        }
        self.read_fingerprint(tx, &p).await.map(Some)
    }

    /// `BEGIN` and the prepared claim in one flight (see the module docs).
    async fn begin_and_claim(
        &self,
        claim: ClaimRequest<'_>,
    ) -> Result<(PgTx, Option<Fingerprint>), Error> {
        let p = self.params(&claim)?;
        let lease = self.lease().await?;
        let insert = lease
            .prepare(&self.sql.claim)
            .await
            .map_err(|e| store_error("claim", e))?;
        let mut tx = PgTx::begun(lease, self.limits.clone());
        let params: [&(dyn ToSql + Sync); 5] = [&p.consumer, &p.id, &p.fingerprint, &p.at, &p.key];
        let limit = self.limits.begin_timeout;
        let flight = begin_with(
            limit,
            tx.batch_execute(sql::BEGIN),
            tx.execute(&insert, p.bound(&params)),
        )
        .await;
        let Some((begun, inserted)) = flight else {
            return Err(begin_hung(&mut tx, limit));
        };
        // A failed BEGIN drops `tx` while open, which abandons the connection.
        begun.map_err(begin_error)?;
        tx.saw(&inserted);
        let inserted = match inserted {
            Ok(n) => n,
            Err(e) => {
                end(tx).await;
                return Err(store_error("claim", e));
            }
        };
        if inserted == 1 {
            return Ok((tx, None));
        }
        match self.read_fingerprint(&tx, &p).await {
            Ok(fp) => Ok((tx, Some(fp))),
            Err(e) => {
                end(tx).await;
                Err(e)
            }
        }
    }
}

impl BatchClaimStore for PgStore {
    /// One `INSERT … SELECT FROM unnest(…) ON CONFLICT DO NOTHING RETURNING` for the whole
    /// batch, and one read of the stored fingerprints of the rest.
    async fn claim_many(
        &self,
        tx: &mut PgTx,
        consumer: &ConsumerName,
        items: &[(&MessageId, Fingerprint)],
        at: Stamp,
    ) -> Result<Vec<Option<Fingerprint>>, Error> {
        let batch = self.batch(items)?;
        let (consumer, at) = (consumer.as_str(), stamp(at));
        let insert = tx
            .prepare_cached(&self.sql.claim_many)
            .await
            .map_err(|e| store_error("batch claim", e))?;
        let params: [&(dyn ToSql + Sync); 5] =
            [&consumer, &batch.ids, &batch.fps, &at, &batch.keys];
        let inserted = tx.query(&insert, batch.bound(&params)).await;
        tx.saw(&inserted);
        let inserted = inserted.map_err(|e| store_error("batch claim", e))?;
        self.claimed_many(tx, consumer, &batch, inserted).await
    }

    /// `BEGIN` and the batch claim in one flight, as [`ClaimStore::begin_and_claim`].
    async fn begin_and_claim_many(
        &self,
        consumer: &ConsumerName,
        items: &[(&MessageId, Fingerprint)],
        at: Stamp,
    ) -> Result<(PgTx, Vec<Option<Fingerprint>>), Error> {
        let batch = self.batch(items)?;
        let (consumer, at) = (consumer.as_str(), stamp(at));
        let lease = self.lease().await?;
        let insert = lease
            .prepare(&self.sql.claim_many)
            .await
            .map_err(|e| store_error("batch claim", e))?;
        let mut tx = PgTx::begun(lease, self.limits.clone());
        let params: [&(dyn ToSql + Sync); 5] =
            [&consumer, &batch.ids, &batch.fps, &at, &batch.keys];
        let limit = self.limits.begin_timeout;
        let flight = begin_with(
            limit,
            tx.batch_execute(sql::BEGIN),
            tx.query(&insert, batch.bound(&params)),
        )
        .await;
        let Some((begun, inserted)) = flight else {
            return Err(begin_hung(&mut tx, limit));
        };
        begun.map_err(begin_error)?;
        tx.saw(&inserted);
        let inserted = match inserted {
            Ok(rows) => rows,
            Err(e) => {
                end(tx).await;
                return Err(store_error("batch claim", e));
            }
        };
        match self.claimed_many(&tx, consumer, &batch, inserted).await {
            Ok(found) => Ok((tx, found)),
            Err(e) => {
                end(tx).await;
                Err(e)
            }
        }
    }
}

impl Savepoints for PgStore {
    async fn savepoint(&self, tx: &mut PgTx) -> Result<(), Error> {
        Self::exec(tx, "SAVEPOINT idem_message").await
    }

    async fn release_savepoint(&self, tx: &mut PgTx) -> Result<(), Error> {
        Self::exec(tx, "RELEASE SAVEPOINT idem_message").await
    }

    async fn rollback_to_savepoint(&self, tx: &mut PgTx) -> Result<(), Error> {
        // ROLLBACK TO keeps the savepoint; release it so savepoints do not pile up.
        Self::exec(
            tx,
            "ROLLBACK TO SAVEPOINT idem_message; RELEASE SAVEPOINT idem_message",
        )
        .await
    }
}

impl Prune for PgStore {
    /// Deletes up to `limit` claims row by row; a partitioned store first runs
    /// [`maintain_partitions`](PgStore::maintain_partitions), which drops whole days past the
    /// table's retention (counted by the planner's estimate), and then prunes only its default
    /// and undated partitions row by row. A store not configured partitioned refuses a
    /// partitioned table as [`ErrorKind::Misconfigured`].
    async fn prune_batch(
        &self,
        consumer: Option<&ConsumerName>,
        now: Stamp,
        older_than: Duration,
        limit: u32,
    ) -> Result<u64, Error> {
        if self.partitioning.is_some() {
            return crate::partitioned::prune_batch(self, consumer, now, older_than, limit).await;
        }
        let deleted = self.prune_rows(consumer, now, older_than, limit).await?;
        // A short batch (the last one, or nothing at all: all a partitioned parent gives) looks
        // at the table once, so a store pointed at a partitioned table says so instead of
        // pruning nothing, round after round.
        if deleted < u64::from(limit) {
            crate::partitioned::check_not_partitioned(self).await?;
        }
        Ok(deleted)
    }
}

impl PgStore {
    /// Deletes up to `limit` claims older than `older_than` row by row (on a partitioned
    /// table: from its default and undated partitions).
    pub(crate) async fn prune_rows(
        &self,
        consumer: Option<&ConsumerName>,
        now: Stamp,
        older_than: Duration,
        limit: u32,
    ) -> Result<u64, Error> {
        let (now, age, limit) = (stamp(now), micros(older_than), i64::from(limit));
        match consumer {
            None => {
                self.execute_alone("prune", &self.sql.prune_all, &[&now, &age, &limit])
                    .await
            }
            Some(c) => {
                let c = c.as_str();
                let params: [&(dyn ToSql + Sync); 4] = [&now, &age, &c, &limit];
                self.execute_alone("prune", &self.sql.prune_consumer, &params)
                    .await
            }
        }
    }
}

impl Stats for PgStore {
    async fn stats(&self) -> Result<Vec<ConsumerStats>, Error> {
        let err = |e| store_error("stats", e);
        let lease = self.lease().await?;
        let statement = lease.prepare(&self.sql.stats).await.map_err(err)?;
        let rows = lease.client().query(&statement, &[]).await.map_err(err)?;
        rows.iter()
            .map(|r| {
                Ok(ConsumerStats {
                    consumer: r.try_get(0)?,
                    claims: u64::try_from(r.try_get::<_, i64>(1)?).unwrap_or(0),
                    oldest: Timestamp::from_micros(r.try_get(2)?),
                    newest: Timestamp::from_micros(r.try_get(3)?),
                })
            })
            .collect::<Result<_, tokio_postgres::Error>>()
            .map_err(err)
    }
}

impl Migrate for PgStore {
    /// The tables (claims, requests, the outbox and its dead letters) in one transaction,
    /// serialised across replicas (and against `idem-sql`'s
    /// migration of the same tables) by an advisory lock. A claims table of the other shape
    /// (partitioned for a plain store, or the reverse) is refused as
    /// [`ErrorKind::Misconfigured`]; a partitioned store then creates today's partition and
    /// those ahead ([`maintain_partitions`](PgStore::maintain_partitions)), or leaves them to
    /// the next prune round when a lock is busy (logged at `info`): start-up does not wait for
    /// another replica's maintenance nor fail behind a long transaction.
    async fn migrate(&self) -> Result<(), Error> {
        TableName::check_distinct(&self.table, &self.requests)?;
        idem_dialect::outbox::check_tables(&self.table, &self.requests, &self.outbox)?;
        let tx = self.begin_tx().await?;
        tx.batch_execute(sql::MIGRATE_LOCK)
            .await
            .map_err(|e| store_error("migrate lock", e))?;
        let partitioned = self.partitioning.is_some();
        let partitioning = self.partitioning.as_ref();
        crate::partitioned::check_shape(&tx, &self.table, partitioning).await?;
        let outbox = sql::outbox_migration(&self.outbox);
        for statement in sql::migration(&self.table, &self.requests, partitioning)
            .into_iter()
            .chain(outbox)
        {
            tx.batch_execute(&statement)
                .await
                .map_err(|e| store_error("migrate", e))?;
        }
        let recovery = sql::recovery_migration(&self.requests);
        let columns: i64 = tx
            .query_one(&recovery.probe, &[])
            .await
            .and_then(|row| row.try_get(0))
            .map_err(|e| store_error("migrate", e))?;
        if columns < idem_dialect::RecoveryMigration::COLUMNS {
            for statement in &recovery.add {
                tx.batch_execute(statement)
                    .await
                    .map_err(|e| store_error("migrate", e))?;
            }
        }
        tx.commit().await.map_err(commit_error)?;
        if partitioned {
            crate::partitioned::maintain_at_start_up(self).await?;
        }
        Ok(())
    }
}
