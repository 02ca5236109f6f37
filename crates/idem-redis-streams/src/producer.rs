//! Publishing entries the way [`RedisStreamSource`](crate::RedisStreamSource) reads them: the
//! message ID and the payload in their own fields.

use std::borrow::Cow;
use std::time::Duration;

use idem_core::{DerivedKey, Error, ErrorKind, MessageId};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use crate::builder::{DEFAULT_ID_FIELD, DEFAULT_PAYLOAD_FIELD};
use crate::error;

/// Anything usable as the producer-set message ID of a published entry.
///
/// A [`DerivedKey`] is written as its UUID form ([`DerivedKey::to_message_id`]), so a
/// reprocessed message republishes under the same ID and downstream consumers see a duplicate.
pub trait AsMessageId {
    /// The ID bytes to write.
    fn message_id_bytes(&self) -> Cow<'_, [u8]>;
}

impl AsMessageId for MessageId {
    fn message_id_bytes(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.as_bytes())
    }
}

impl AsMessageId for DerivedKey {
    fn message_id_bytes(&self) -> Cow<'_, [u8]> {
        Cow::Owned(self.to_uuid_string().into_bytes())
    }
}

impl AsMessageId for str {
    fn message_id_bytes(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.as_bytes())
    }
}

impl AsMessageId for String {
    fn message_id_bytes(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.as_bytes())
    }
}

impl AsMessageId for [u8] {
    fn message_id_bytes(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self)
    }
}

impl<T: AsMessageId + ?Sized> AsMessageId for &T {
    fn message_id_bytes(&self) -> Cow<'_, [u8]> {
        (**self).message_id_bytes()
    }
}

/// Appends entries to streams with `XADD`, the message ID and the payload in their own fields
/// (where [`RedisStreamSource`](crate::RedisStreamSource) reads them by default).
///
/// ```no_run
/// # async fn demo() -> Result<(), idem_core::Error> {
/// use idem_redis_streams::RedisStreamProducer;
///
/// let producer = RedisStreamProducer::connect("redis://127.0.0.1:6379")
///     .await?
///     .max_len(1_000_000);
/// let entry = producer.publish("orders", "order-42/created", br#"{"order":42}"#).await?;
/// producer
///     .publish_with_fields("orders", "order-43/created", b"{}", &[("tenant", b"acme")])
///     .await?;
/// # let _ = entry; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct RedisStreamProducer {
    conn: ConnectionManager,
    id_field: String,
    payload_field: String,
    max_len: Option<usize>,
}

impl RedisStreamProducer {
    /// Connects to the Redis server at `url` (`redis://host:6379`, `rediss://` for TLS).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] for a malformed URL; [`ErrorKind::Unavailable`] when the
    /// server cannot be reached.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let client = redis::Client::open(url).map_err(|e| error::invalid_url(url, e))?;
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(Duration::from_secs(5)))
            .set_connection_timeout(Some(Duration::from_secs(5)));
        let conn = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(|e| error::unavailable("connecting", e))?;
        Ok(Self::new(conn))
    }

    /// Publishes over a connection the caller opened (its TLS, credentials, timeouts).
    pub fn new(conn: ConnectionManager) -> Self {
        Self {
            conn,
            id_field: DEFAULT_ID_FIELD.to_owned(),
            payload_field: DEFAULT_PAYLOAD_FIELD.to_owned(),
            max_len: None,
        }
    }

    /// The field the ID is written to (default `message_id`).
    pub fn id_field(mut self, field: impl Into<String>) -> Self {
        self.id_field = field.into();
        self
    }

    /// The field the payload is written to (default `payload`).
    pub fn payload_field(mut self, field: impl Into<String>) -> Self {
        self.payload_field = field.into();
        self
    }

    /// Trims the stream to about `n` entries on every publish (`MAXLEN ~ n`). Trimming
    /// drops old entries even if a group has not read them yet: size it well above the
    /// backlog consumers may build up.
    pub fn max_len(mut self, n: usize) -> Self {
        self.max_len = Some(n);
        self
    }

    /// Appends an entry with the ID and payload fields to `stream`; returns the entry ID once
    /// Redis has accepted it.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidMessageId`] when `id` is empty; [`ErrorKind::Unavailable`] when the
    /// command fails.
    pub async fn publish(
        &self,
        stream: &str,
        id: impl AsMessageId,
        payload: &[u8],
    ) -> Result<String, Error> {
        self.publish_with_fields(stream, id, payload, &[]).await
    }

    /// Like [`publish`](Self::publish), with extra fields (readable as headers).
    ///
    /// # Errors
    /// As [`publish`](Self::publish).
    pub async fn publish_with_fields(
        &self,
        stream: &str,
        id: impl AsMessageId,
        payload: &[u8],
        fields: &[(&str, &[u8])],
    ) -> Result<String, Error> {
        let id = id.message_id_bytes();
        if id.is_empty() {
            return Err(Error::new(
                ErrorKind::InvalidMessageId,
                "message ID is empty; the producer must set a stable ID",
            ));
        }
        let mut cmd = redis::cmd("XADD");
        cmd.arg(stream);
        if let Some(n) = self.max_len {
            cmd.arg("MAXLEN").arg("~").arg(n);
        }
        cmd.arg("*")
            .arg(&self.id_field)
            .arg(id.as_ref())
            .arg(&self.payload_field)
            .arg(payload);
        for (k, v) in fields {
            cmd.arg(*k).arg(*v);
        }
        cmd.query_async(&mut self.conn.clone())
            .await
            .map_err(|e| error::unavailable("XADD", e))
    }
}

#[cfg(test)]
mod tests {
    use super::RedisStreamProducer;

    /// Neither a URL redis-rs refuses nor a server out of reach shows the password.
    #[tokio::test]
    async fn connect_errors_hide_the_password() {
        for url in [
            "redis://:hunter2@127.0.0.1:1/0",
            "redis://app:hunter2@127.0.0.1:1/not-a-db",
        ] {
            let err = RedisStreamProducer::connect(url)
                .await
                .expect_err("nothing listens on port 1");
            for shown in [err.to_string(), format!("{err:?}")] {
                assert!(!shown.contains("hunter2"), "{url}: {shown}");
            }
        }
    }
}
