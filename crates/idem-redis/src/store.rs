//! [`RedisRequestStore`]: the request-store capabilities on Redis, its builder, and the no-op
//! transaction.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use idem_core::store::{ReapRequests, RequestStore};
use idem_core::{
    Begin, Error, ErrorKind, Fence, Fingerprint, RequestErrorKind, RequestKey, TransactionalStore,
};
use idem_redact::redact_url;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{FromRedisValue, RedisResult, Script, ServerErrorKind};

use crate::durability::{self, ReplicaWait};
use crate::error::{ReplicasNotConfirmed, SYSTEM, UnconfirmedWrite, kind_of, redis_error};
use crate::keys::{DEFAULT_KEY_PREFIX, RecordKeys, validate_prefix};
use crate::scripts::{self, millis};

/// The longest idempotency key this store accepts, in bytes. Redis itself would take far
/// longer names; the bound keeps every record's key names short.
pub const MAX_KEY_LEN: usize = 1024;

/// Records of idempotent requests in Redis, under a lease with fencing tokens.
///
/// Implements [`RequestStore`] and [`ReapRequests`]; see the [crate docs](crate) for the key
/// layout, the scripts, and what a store without a shared transaction means for your
/// operation. Cheap to clone: clones share the connection.
///
/// It does not implement `RecoveryStore` (recovery points, `idem_request`'s phases): a
/// recovery point must commit in the same transaction as the phase's writes in your
/// database, and Redis shares no transaction with it — a point stored here could outlive
/// writes that rolled back, or the other way round. Use a SQL store for phases.
///
/// `C` is the connection: a [`ConnectionManager`] (reconnecting by itself) when built from a
/// URL, or any [`ConnectionLike`] given to [`with_connection`](Self::with_connection), such as
/// a cluster connection of the `redis` crate's `cluster-async` feature (the key layout is
/// cluster-safe; this crate's own tests run on a single server).
pub struct RedisRequestStore<C = ConnectionManager> {
    conn: C,
    prefix: Arc<str>,
    /// The server's URL with its secrets masked, for `Debug`; `None` for a caller's connection.
    server: Option<Arc<str>>,
    /// `WAIT` after a take and a completion, if configured.
    wait: Option<ReplicaWait>,
}

impl<C: Clone> Clone for RedisRequestStore<C> {
    fn clone(&self) -> Self {
        Self {
            conn: self.conn.clone(),
            prefix: Arc::clone(&self.prefix),
            server: self.server.clone(),
            wait: self.wait,
        }
    }
}

impl<C> fmt::Debug for RedisRequestStore<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisRequestStore")
            .field(
                "server",
                &self.server.as_deref().unwrap_or("(caller's connection)"),
            )
            .field("key_prefix", &&*self.prefix)
            .field("wait_for_replicas", &self.wait)
            .finish_non_exhaustive()
    }
}

/// Configures a [`RedisRequestStore`] on a `redis://` (or `rediss://`, `unix://`) URL
/// (consuming builder).
///
/// ```no_run
/// # async fn demo() -> Result<(), idem_core::Error> {
/// use std::time::Duration;
/// use idem_redis::RedisRequestStore;
///
/// let store = RedisRequestStore::builder("redis://127.0.0.1:6379/0")
///     .key_prefix("billing:idem")
///     .response_timeout(Duration::from_secs(2))
///     .connect()
///     .await?;
/// assert_eq!(store.key_prefix(), "billing:idem");
/// # Ok(()) }
/// ```
pub struct RedisRequestStoreBuilder {
    url: String,
    prefix: String,
    response_timeout: Duration,
    connection_timeout: Duration,
    connection_retries: usize,
    check_policy: bool,
    wait: Option<(usize, Duration)>,
}

impl fmt::Debug for RedisRequestStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisRequestStoreBuilder")
            .field("url", &redact_url(&self.url))
            .field("key_prefix", &self.prefix)
            .field("response_timeout", &self.response_timeout)
            .field("connection_timeout", &self.connection_timeout)
            .field("connection_retries", &self.connection_retries)
            .field("check_maxmemory_policy", &self.check_policy)
            .field("wait_for_replicas", &self.wait)
            .finish()
    }
}

impl RedisRequestStoreBuilder {
    /// The prefix of every key the store writes (default `idem:req`). Give each application
    /// (or each environment sharing a server) its own. Must not be empty or contain braces,
    /// which are the Redis Cluster hash tag of each record.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long one command may take before it fails as [`ErrorKind::Unavailable`] (default
    /// 5 s). A request in front of an unresponsive Redis fails fast instead of hanging.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// How long one connection attempt may take (default 5 s).
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }

    /// How many times connecting is retried, with exponential backoff capped at 2 s, before
    /// [`connect`](Self::connect) or a command after a lost connection fails (default 6).
    pub fn connection_retries(mut self, retries: usize) -> Self {
        self.connection_retries = retries;
        self
    }

    /// Connects without checking the server's `maxmemory-policy`.
    ///
    /// By default [`connect`](Self::connect) refuses a server whose policy is not
    /// `noeviction`, because any other policy may evict idem's keys under memory pressure (see
    /// the [crate docs](crate#losing-records)). Use this when the check cannot run (a managed
    /// Redis that answers neither `CONFIG GET` nor `INFO`) and you have verified the policy
    /// yourself, or when you accept that a record may be evicted.
    pub fn skip_maxmemory_policy_check(mut self) -> Self {
        self.check_policy = false;
        self
    }

    /// After taking a record and after completing one, waits until at least `replicas`
    /// replicas have acknowledged the write (`WAIT replicas timeout`), at most `timeout`.
    ///
    /// Redis replicates asynchronously: without this, a failover can promote a replica that
    /// never received a record (see the [crate docs](crate#losing-records)). With it, fewer
    /// acknowledgements in time fail the operation with a [`ReplicasNotConfirmed`] source: a
    /// take is released again and fails as [`ErrorKind::Unavailable`] (nothing ran); a
    /// completion stays stored on the primary and fails as [`ErrorKind::OutcomeUnknown`]. The
    /// `WAIT` goes in one pipeline with the script, so each operation stays one round trip.
    ///
    /// `WAIT` blocks the connection it runs on, and the store's connection is shared by every
    /// request of the process: each take and completion holds the others back for about one
    /// round trip to the replicas, and for up to `timeout` when they lag. Keep `timeout`
    /// short. [`connect`](Self::connect) refuses `replicas == 0`, a zero `timeout`, and a
    /// `timeout` not shorter than the [response timeout](Self::response_timeout) (the client
    /// would give up on the `WAIT` first, not knowing whether the record was taken).
    pub fn wait_for_replicas(mut self, replicas: usize, timeout: Duration) -> Self {
        self.wait = Some((replicas, timeout));
        self
    }

    /// Validates the configuration, connects, and checks the server's `maxmemory-policy`.
    ///
    /// [`ErrorKind::InvalidConfig`] for a URL that does not parse, a bad prefix or replica
    /// wait; [`ErrorKind::Unavailable`] when the server cannot be reached;
    /// [`ErrorKind::Misconfigured`] when its `maxmemory-policy` is not `noeviction`, or cannot
    /// be read (neither `CONFIG GET` nor `INFO memory` answers), unless
    /// [`skip_maxmemory_policy_check`](Self::skip_maxmemory_policy_check). Error messages show
    /// the URL with its password masked.
    pub async fn connect(self) -> Result<RedisRequestStore, Error> {
        validate_prefix(&self.prefix)?;
        let wait = match self.wait {
            None => None,
            Some((replicas, timeout)) => {
                let wait = ReplicaWait::new(replicas, timeout)?;
                if timeout >= self.response_timeout {
                    return Err(Error::new(
                        ErrorKind::InvalidConfig,
                        format!(
                            "the replica wait of {timeout:?} must be shorter than the \
                             response timeout of {:?}, or the client gives up on WAIT first \
                             and cannot tell whether the record was taken",
                            self.response_timeout
                        ),
                    ));
                }
                Some(wait)
            }
        };
        let shown = redact_url(&self.url);
        let client = redis::Client::open(self.url.as_str()).map_err(|e| {
            Error::new(
                ErrorKind::InvalidConfig,
                format!("invalid Redis URL {shown}: {e}"),
            )
            .with_source(e)
        })?;
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(self.response_timeout))
            .set_connection_timeout(Some(self.connection_timeout))
            .set_number_of_retries(self.connection_retries)
            .set_max_delay(Duration::from_secs(2));
        let conn = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(|e| {
                let kind = match kind_of(&e) {
                    ErrorKind::Store => ErrorKind::Unavailable,
                    kind => kind,
                };
                Error::from_system(kind, SYSTEM, format_args!("connecting to {shown}"), e)
            })?;
        if self.check_policy {
            durability::check_maxmemory_policy(&mut conn.clone(), Some(&shown)).await?;
        }
        Ok(RedisRequestStore {
            conn,
            prefix: self.prefix.into(),
            server: Some(shown.into()),
            wait,
        })
    }
}

impl RedisRequestStore {
    /// Starts configuring a store on the server at `url`.
    pub fn builder(url: impl Into<String>) -> RedisRequestStoreBuilder {
        RedisRequestStoreBuilder {
            url: url.into(),
            prefix: DEFAULT_KEY_PREFIX.to_owned(),
            response_timeout: Duration::from_secs(5),
            connection_timeout: Duration::from_secs(5),
            connection_retries: 6,
            check_policy: true,
            wait: None,
        }
    }

    /// Connects to `url` with the defaults (prefix `idem:req`, the `maxmemory-policy` checked,
    /// no waiting for replicas).
    pub async fn connect(url: &str) -> Result<Self, Error> {
        Self::builder(url).connect().await
    }
}

impl<C> RedisRequestStore<C> {
    /// A store on a connection the caller set up (TLS, RESP3, credentials, a cluster), with
    /// keys under `prefix`. [`ErrorKind::InvalidConfig`] for a bad prefix.
    ///
    /// Nothing is sent to the server here: the `maxmemory-policy` is not checked unless you
    /// call [`check_maxmemory_policy`](Self::check_maxmemory_policy).
    pub fn with_connection(conn: C, prefix: impl Into<String>) -> Result<Self, Error> {
        let prefix = prefix.into();
        validate_prefix(&prefix)?;
        Ok(Self {
            conn,
            prefix: prefix.into(),
            server: None,
            wait: None,
        })
    }

    /// Waits for `replicas` replicas after each take and completion, as
    /// [`RedisRequestStoreBuilder::wait_for_replicas`] does. [`ErrorKind::InvalidConfig`] for
    /// `replicas == 0` or a zero `timeout`; keep `timeout` shorter than your connection's
    /// response timeout. `WAIT` counts the writes of the connection it runs on, so `C` must
    /// send both commands of a pipeline over one connection to the record's primary (a plain
    /// or multiplexed connection, a connection manager; a cluster connection routes `WAIT`
    /// by its own rules).
    pub fn wait_for_replicas(mut self, replicas: usize, timeout: Duration) -> Result<Self, Error> {
        self.wait = Some(ReplicaWait::new(replicas, timeout)?);
        Ok(self)
    }

    /// The prefix of every key this store writes.
    pub fn key_prefix(&self) -> &str {
        &self.prefix
    }

    /// The connection the store runs its scripts on.
    pub fn connection(&self) -> &C {
        &self.conn
    }
}

impl<C> RedisRequestStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Refuses a server whose `maxmemory-policy` is not `noeviction`, as
    /// [`RedisRequestStoreBuilder::connect`] does: [`ErrorKind::Misconfigured`] when it may
    /// evict idem's keys or cannot be read, [`ErrorKind::Unavailable`] when the server is out of
    /// reach. For stores made [`with_connection`](RedisRequestStore::with_connection).
    pub async fn check_maxmemory_policy(&self) -> Result<(), Error> {
        durability::check_maxmemory_policy(&mut self.conn.clone(), self.server.as_deref()).await
    }

    /// Runs `script` on `keys` with `args`: one `EVALSHA`, or on `NOSCRIPT` `SCRIPT LOAD`
    /// and the `EVALSHA` again.
    async fn run<T: FromRedisValue>(
        &self,
        what: &str,
        script: &Script,
        keys: &[&str],
        args: &[&[u8]],
    ) -> Result<T, Error> {
        let evalsha = evalsha(script, keys, args);
        let mut conn = self.conn.clone();
        let reply = match evalsha.query_async(&mut conn).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(ServerErrorKind::NoScript) => {
                script
                    .load_async(&mut conn)
                    .await
                    .map_err(|e| redis_error(what, e))?;
                evalsha.query_async(&mut conn).await
            }
            reply => reply,
        };
        reply.map_err(|e| redis_error(what, e))
    }

    /// [`run`](Self::run) followed by `WAIT`, as one pipeline on one connection, and how many
    /// replicas acknowledged (or why `WAIT` failed). `WAIT` counts the acknowledgements of its
    /// own connection's writes: sent separately, after a reconnect in between, it would report
    /// every replica without waiting for any. On `NOSCRIPT`: `SCRIPT LOAD`, the pipeline again.
    async fn run_and_wait<T: FromRedisValue>(
        &self,
        what: &str,
        script: &Script,
        keys: &[&str],
        args: &[&[u8]],
        wait: ReplicaWait,
    ) -> Result<(T, Result<usize, Error>), Error> {
        let mut pipe = redis::pipe();
        pipe.add_command(evalsha(script, keys, args))
            .cmd("WAIT")
            .arg(wait.replicas)
            .arg(millis(wait.timeout))
            .ignore_errors();
        let mut conn = self.conn.clone();
        let send = async |conn: &mut C| {
            pipe.query_async::<(RedisResult<T>, RedisResult<i64>)>(conn)
                .await
                .map_err(|e| redis_error(what, e))
        };
        let (mut reply, mut acked) = send(&mut conn).await?;
        if let Err(e) = &reply
            && e.kind() == redis::ErrorKind::Server(ServerErrorKind::NoScript)
        {
            script
                .load_async(&mut conn)
                .await
                .map_err(|e| redis_error(what, e))?;
            (reply, acked) = send(&mut conn).await?;
        }
        let reply = reply.map_err(|e| redis_error(what, e))?;
        let acked = acked
            .map(|n| usize::try_from(n).unwrap_or(0))
            .map_err(|e| redis_error(&format!("{what}: waiting for replicas"), e));
        Ok((reply, acked))
    }

    /// A take that `wait` did not see confirmed: released again (nothing has run yet), and
    /// the error that says so.
    async fn undo_unconfirmed_take(
        &self,
        key: &RequestKey,
        keys: &RecordKeys,
        fence: Fence,
        wait: ReplicaWait,
        acked: Result<usize, Error>,
    ) -> Error {
        let released = self
            .run::<i64>(
                "release request",
                &scripts::RELEASE,
                &[&keys.record],
                &[fence.0.to_string().as_bytes()],
            )
            .await;
        let undone = match &released {
            Ok(_) => "the record was released again and nothing ran; retry later".to_owned(),
            Err(e) => format!(
                "releasing the record failed too ({e}); nothing ran, and the key frees itself \
                 when its lease runs out"
            ),
        };
        match acked {
            Ok(acknowledged) => {
                let why = ReplicasNotConfirmed::new(
                    UnconfirmedWrite::Take,
                    wait.replicas,
                    acknowledged,
                    wait.timeout,
                );
                Error::new(
                    ErrorKind::Unavailable,
                    format!("key {}: only {why}; {undone}", key.key),
                )
                .with_source(why)
            }
            Err(e) => {
                Error::new(e.kind(), format!("key {}: {e}; {undone}", key.key)).with_source(e)
            }
        }
    }

    fn keys(&self, key: &RequestKey) -> Result<RecordKeys, Error> {
        let len = key.key.as_str().len();
        if len > MAX_KEY_LEN {
            return Err(Error::new(
                ErrorKind::Request(RequestErrorKind::InvalidKey),
                format!("idempotency key is {len} bytes, over this store's limit of {MAX_KEY_LEN}"),
            ));
        }
        Ok(RecordKeys::new(&self.prefix, key))
    }
}

/// `EVALSHA` of `script` on `keys` with `args`, built once (the `redis` crate's
/// `ScriptInvocation` copies keys and arguments twice on every call).
fn evalsha(script: &Script, keys: &[&str], args: &[&[u8]]) -> redis::Cmd {
    let mut evalsha = redis::cmd("EVALSHA");
    evalsha.arg(script.get_hash()).arg(keys.len());
    for key in keys {
        evalsha.arg(*key);
    }
    for arg in args {
        evalsha.arg(*arg);
    }
    evalsha
}

/// The transaction of a store that has none: Redis keeps no transaction open with your
/// business database, so [`commit`](TransactionalStore::commit) and
/// [`rollback`](TransactionalStore::rollback) do nothing and
/// [`complete_in`](RequestStore::complete_in) takes effect at once.
///
/// An operation's own writes go wherever it writes them, committed by the operation.
#[derive(Debug)]
#[non_exhaustive]
pub struct RedisTx;

impl<C> TransactionalStore for RedisRequestStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    type Tx = RedisTx;

    async fn begin(&self) -> Result<RedisTx, Error> {
        Ok(RedisTx)
    }

    async fn commit(&self, _tx: RedisTx) -> Result<(), Error> {
        Ok(())
    }

    async fn rollback(&self, _tx: RedisTx) -> Result<(), Error> {
        Ok(())
    }

    fn classify(&self, error: &(dyn std::error::Error + 'static)) -> Option<ErrorKind> {
        error.downcast_ref::<redis::RedisError>().map(kind_of)
    }
}

impl<C> RequestStore for RedisRequestStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn max_key_len(&self) -> usize {
        MAX_KEY_LEN
    }

    /// One `EVALSHA` of the begin script, whatever the answer: a replay carries the stored
    /// result, an in-progress answer the lease's `PTTL`.
    async fn begin_request(
        &self,
        key: &RequestKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Begin, Error> {
        let keys = self.keys(key)?;
        let lease_ms = millis(lease);
        let keep_ms = lease_ms.max(millis(ttl));
        let (lease_ms, keep_ms) = (lease_ms.to_string(), keep_ms.to_string());
        let args: [&[u8]; 3] = [
            fingerprint.as_bytes(),
            lease_ms.as_bytes(),
            keep_ms.as_bytes(),
        ];
        let what = "begin request";
        let (lease_key, fence_key) = (keys.legacy_lease(), keys.legacy_fence());
        let names: [&str; 3] = [&keys.record, &lease_key, &fence_key];
        let Some(wait) = self.wait else {
            let reply = self.run(what, &scripts::BEGIN, &names, &args).await?;
            return scripts::decode_begin(reply);
        };
        let (reply, acked) = self
            .run_and_wait(what, &scripts::BEGIN, &names, &args, wait)
            .await?;
        let begin = scripts::decode_begin(reply)?;
        // Only a take wrote something worth confirming; a replay, a busy or a mismatch answer
        // stands whatever the replicas say.
        if let Begin::Acquired { fence, .. } = begin
            && !matches!(acked, Ok(n) if n >= wait.replicas)
        {
            return Err(self
                .undo_unconfirmed_take(key, &keys, fence, wait, acked)
                .await);
        }
        Ok(begin)
    }

    /// Takes effect at once (there is no transaction to wait for): the result is stored, the
    /// record expires `ttl` from now and the lease is deleted.
    async fn complete_in(
        &self,
        _tx: &mut RedisTx,
        key: &RequestKey,
        fence: Fence,
        result: &[u8],
        ttl: Duration,
    ) -> Result<(), Error> {
        let keys = self.keys(key)?;
        let (fence_arg, ttl_ms) = (fence.0.to_string(), millis(ttl).to_string());
        let args: [&[u8]; 3] = [fence_arg.as_bytes(), result, ttl_ms.as_bytes()];
        let what = "complete request";
        let (done, acked): (i64, _) = match self.wait {
            None => (
                self.run(what, &scripts::COMPLETE, &[&keys.record], &args)
                    .await?,
                None,
            ),
            Some(wait) => {
                let (done, acked) = self
                    .run_and_wait(what, &scripts::COMPLETE, &[&keys.record], &args, wait)
                    .await?;
                (done, Some((wait, acked)))
            }
        };
        if done == 1 {
            let stored = "the result is stored on the Redis primary, but";
            let then = "a retry replays it, unless a failover first promotes a replica \
                        without it, in which case the operation runs again";
            match acked {
                None => Ok(()),
                Some((wait, Ok(n))) if n >= wait.replicas => Ok(()),
                Some((wait, Ok(acknowledged))) => {
                    let why = ReplicasNotConfirmed::new(
                        UnconfirmedWrite::Complete,
                        wait.replicas,
                        acknowledged,
                        wait.timeout,
                    );
                    Err(Error::new(
                        ErrorKind::OutcomeUnknown,
                        format!("key {}: {stored} only {why}; {then}", key.key),
                    )
                    .with_source(why))
                }
                Some((_, Err(e))) => Err(Error::new(
                    ErrorKind::OutcomeUnknown,
                    format!(
                        "key {}: {stored} waiting for its replicas failed ({e}); {then}",
                        key.key
                    ),
                )
                .with_source(e)),
            }
        } else {
            Err(Error::new(
                ErrorKind::Request(RequestErrorKind::LeaseLost),
                format!(
                    "key {}: fence {} no longer holds the record (taken over after its lease \
                     ran out, released, or expired); the result was not stored",
                    key.key, fence.0
                ),
            ))
        }
    }

    async fn release(&self, key: &RequestKey, fence: Fence) -> Result<(), Error> {
        let keys = self.keys(key)?;
        let _released: i64 = self
            .run(
                "release request",
                &scripts::RELEASE,
                &[&keys.record],
                &[fence.0.to_string().as_bytes()],
            )
            .await?;
        Ok(())
    }

    async fn extend_lease(
        &self,
        key: &RequestKey,
        fence: Fence,
        lease: Duration,
    ) -> Result<bool, Error> {
        let keys = self.keys(key)?;
        let held: i64 = self
            .run(
                "extend lease",
                &scripts::EXTEND,
                &[&keys.record],
                &[
                    fence.0.to_string().as_bytes(),
                    millis(lease).to_string().as_bytes(),
                ],
            )
            .await?;
        Ok(held == 1)
    }
}

impl<C> ReapRequests for RedisRequestStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Always 0, without a round trip: every key of a record carries a Redis expiry
    /// (`PEXPIRE`/`PX`) set by the script that wrote it, so Redis deletes expired records
    /// itself and none is ever left for a reaper.
    async fn reap_batch(&self, _limit: u32) -> Result<u64, Error> {
        Ok(0)
    }
}
