//! [`RedisRequestStore`]: the request-store capabilities on Redis, its builder, and the no-op
//! transaction.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use idem_core::store::{ReapRequests, RequestStore};
use idem_core::{
    Begin, Error, ErrorKind, Fence, Fingerprint, RequestKey, TransactionalStore, redact_url,
};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{FromRedisValue, Script};

use crate::error::{SYSTEM, kind_of, redis_error};
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
/// `C` is the connection: a [`ConnectionManager`] (reconnecting by itself) when built from a
/// URL, or any [`ConnectionLike`] given to [`with_connection`](Self::with_connection), such as
/// a cluster connection of the `redis` crate's `cluster-async` feature (the key layout is
/// cluster-safe; this crate's own tests run on a single server).
pub struct RedisRequestStore<C = ConnectionManager> {
    conn: C,
    prefix: Arc<str>,
    /// The server's URL with its secrets masked, for `Debug`; `None` for a caller's connection.
    server: Option<Arc<str>>,
}

impl<C: Clone> Clone for RedisRequestStore<C> {
    fn clone(&self) -> Self {
        Self {
            conn: self.conn.clone(),
            prefix: Arc::clone(&self.prefix),
            server: self.server.clone(),
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
}

impl fmt::Debug for RedisRequestStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisRequestStoreBuilder")
            .field("url", &redact_url(&self.url))
            .field("key_prefix", &self.prefix)
            .field("response_timeout", &self.response_timeout)
            .field("connection_timeout", &self.connection_timeout)
            .field("connection_retries", &self.connection_retries)
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

    /// Validates the configuration and connects.
    ///
    /// [`ErrorKind::InvalidConfig`] for a URL that does not parse or a bad prefix;
    /// [`ErrorKind::Unavailable`] when the server cannot be reached. Error messages show the
    /// URL with its password masked.
    pub async fn connect(self) -> Result<RedisRequestStore, Error> {
        validate_prefix(&self.prefix)?;
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
        Ok(RedisRequestStore {
            conn,
            prefix: self.prefix.into(),
            server: Some(shown.into()),
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
        }
    }

    /// Connects to `url` with the defaults (prefix `idem:req`).
    pub async fn connect(url: &str) -> Result<Self, Error> {
        Self::builder(url).connect().await
    }
}

impl<C> RedisRequestStore<C> {
    /// A store on a connection the caller set up (TLS, RESP3, credentials, a cluster), with
    /// keys under `prefix`. [`ErrorKind::InvalidConfig`] for a bad prefix.
    pub fn with_connection(conn: C, prefix: impl Into<String>) -> Result<Self, Error> {
        let prefix = prefix.into();
        validate_prefix(&prefix)?;
        Ok(Self {
            conn,
            prefix: prefix.into(),
            server: None,
        })
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
    /// Runs `script` on the record's keys with `args`: one `EVALSHA`, or on `NOSCRIPT`
    /// `SCRIPT LOAD` and the `EVALSHA` again.
    async fn run<T: FromRedisValue>(
        &self,
        what: &str,
        script: &Script,
        keys: &RecordKeys,
        args: &[&[u8]],
    ) -> Result<T, Error> {
        let mut call = script.prepare_invoke();
        call.key(&keys.record).key(&keys.lease).key(&keys.fence);
        for arg in args {
            call.arg(*arg);
        }
        call.invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| redis_error(what, e))
    }

    fn keys(&self, key: &RequestKey) -> Result<RecordKeys, Error> {
        let len = key.key.as_str().len();
        if len > MAX_KEY_LEN {
            return Err(Error::new(
                ErrorKind::InvalidKey,
                format!("idempotency key is {len} bytes, over this store's limit of {MAX_KEY_LEN}"),
            ));
        }
        Ok(RecordKeys::new(&self.prefix, key))
    }
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
        let reply = self
            .run(
                "begin request",
                &scripts::BEGIN,
                &keys,
                &[
                    fingerprint.as_bytes(),
                    lease_ms.to_string().as_bytes(),
                    keep_ms.to_string().as_bytes(),
                ],
            )
            .await?;
        scripts::decode_begin(reply)
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
        let done: i64 = self
            .run(
                "complete request",
                &scripts::COMPLETE,
                &keys,
                &[
                    fence.0.to_string().as_bytes(),
                    result,
                    millis(ttl).to_string().as_bytes(),
                ],
            )
            .await?;
        if done == 1 {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::LeaseLost,
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
                &keys,
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
                &keys,
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
