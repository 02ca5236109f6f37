//! Configuring a [`RedisStreamSource`]: which stream, as which group member, and how.

use std::time::Duration;

use idem_core::{Error, ErrorKind};

use crate::error;
use crate::source::RedisStreamSource;

/// The stream field holding the producer-set message ID unless configured otherwise.
pub const DEFAULT_ID_FIELD: &str = "message_id";
/// The stream field holding the message body unless configured otherwise.
pub const DEFAULT_PAYLOAD_FIELD: &str = "payload";
/// Suffix appended to the stream key to name the dead-letter stream unless configured otherwise.
pub const DEAD_LETTER_SUFFIX: &str = ":dead-letter";

/// Where a consumer group that does not exist yet starts reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum StartFrom {
    /// Every entry already in the stream (`XGROUP CREATE … 0`). The default: messages
    /// published before the first consumer started are processed, not lost, and re-reading
    /// old ones is harmless because the claim turns them into duplicates.
    #[default]
    Beginning,
    /// Only entries added after the group was created (`XGROUP CREATE … $`).
    NewOnly,
}

impl StartFrom {
    pub(crate) fn as_id(self) -> &'static str {
        match self {
            StartFrom::Beginning => "0",
            StartFrom::NewOnly => "$",
        }
    }
}

/// Configures a [`RedisStreamSource`]; created by [`RedisStreamSource::builder`], finished by
/// [`connect`](Self::connect) or [`connect_with`](Self::connect_with).
///
/// ```
/// use std::time::Duration;
/// use idem_redis_streams::{RedisStreamSource, StartFrom};
///
/// let builder = RedisStreamSource::builder("orders", "billing", "billing-pod-7")
///     .start_from(StartFrom::NewOnly)
///     .min_idle(Duration::from_secs(60))
///     .dead_letter_stream("orders:poison");
/// assert_eq!(builder.dead_letter_stream_key(), "orders:poison");
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct RedisStreamSourceBuilder {
    pub(crate) stream: String,
    pub(crate) group: String,
    pub(crate) consumer: String,
    pub(crate) start: StartFrom,
    pub(crate) min_idle: Duration,
    pub(crate) block: Duration,
    pub(crate) id_field: String,
    pub(crate) payload_field: String,
    pub(crate) dead_letter_stream: Option<String>,
}

impl RedisStreamSource {
    /// Configures a source consuming `stream` in consumer group `group` as member `consumer`.
    ///
    /// The consumer name must be stable for one process instance (pod name, hostname plus
    /// a slot number) and unique among live members: a restarted process with the same name
    /// resumes its own unacknowledged entries at once, while entries of a name that never
    /// comes back are reclaimed by the others after [`min_idle`
    /// ](RedisStreamSourceBuilder::min_idle).
    pub fn builder(
        stream: impl Into<String>,
        group: impl Into<String>,
        consumer: impl Into<String>,
    ) -> RedisStreamSourceBuilder {
        RedisStreamSourceBuilder {
            stream: stream.into(),
            group: group.into(),
            consumer: consumer.into(),
            start: StartFrom::default(),
            min_idle: Duration::from_secs(30),
            block: Duration::from_secs(5),
            id_field: DEFAULT_ID_FIELD.to_owned(),
            payload_field: DEFAULT_PAYLOAD_FIELD.to_owned(),
            dead_letter_stream: None,
        }
    }
}

impl RedisStreamSourceBuilder {
    /// Where a newly created group starts (default [`StartFrom::Beginning`]). Ignored when the
    /// group exists.
    pub fn start_from(mut self, start: StartFrom) -> Self {
        self.start = start;
        self
    }

    /// How long an entry must have been pending without an ack before another consumer takes
    /// it over with `XAUTOCLAIM` (default 30 s). Keep it well above the slowest handler: a
    /// slower one is reprocessed concurrently (safe, the claim makes it a duplicate, but wasted).
    pub fn min_idle(mut self, min_idle: Duration) -> Self {
        self.min_idle = min_idle;
        self
    }

    /// How long one `XREADGROUP` waits for new entries (default 5 s). Also how often, at the
    /// latest, stale entries of dead consumers are looked for while the stream is quiet.
    pub fn block(mut self, block: Duration) -> Self {
        self.block = block;
        self
    }

    /// The field holding the message ID (default `message_id`); this is the adapter's
    /// default [`IdSource`](idem_consumer::IdSource).
    pub fn id_field(mut self, field: impl Into<String>) -> Self {
        self.id_field = field.into();
        self
    }

    /// The field holding the message body (default `payload`). Entries without it are
    /// dead-lettered.
    pub fn payload_field(mut self, field: impl Into<String>) -> Self {
        self.payload_field = field.into();
        self
    }

    /// The stream receiving dead letters (default `<stream>:dead-letter`).
    pub fn dead_letter_stream(mut self, stream: impl Into<String>) -> Self {
        self.dead_letter_stream = Some(stream.into());
        self
    }

    /// The dead-letter stream key in effect.
    pub fn dead_letter_stream_key(&self) -> String {
        self.dead_letter_stream
            .clone()
            .unwrap_or_else(|| format!("{}{DEAD_LETTER_SUFFIX}", self.stream))
    }

    /// Connects to the Redis server at `url` (`redis://host:6379`, `rediss://` for TLS) and
    /// creates the consumer group (and the stream) if missing (see [`ensure_group`
    /// ](crate::ensure_group)).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] for a malformed URL or settings [`connect_with`
    /// ](Self::connect_with) refuses; [`ErrorKind::Unavailable`] when the server cannot be
    /// reached.
    pub async fn connect(self, url: &str) -> Result<RedisStreamSource, Error> {
        let client = redis::Client::open(url).map_err(|e| error::invalid_url(url, e))?;
        self.connect_with(client).await
    }

    /// Like [`connect`](Self::connect), with a client configured by the caller (TLS, RESP3,
    /// credentials).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] for an empty name, a dead-letter stream equal to the
    /// consumed one, or a zero `block`; [`ErrorKind::Unavailable`] when the server cannot be
    /// reached.
    pub async fn connect_with(self, client: redis::Client) -> Result<RedisStreamSource, Error> {
        self.validate()?;
        RedisStreamSource::start(client, self).await
    }

    fn validate(&self) -> Result<(), Error> {
        let named = [
            ("stream", &self.stream),
            ("group", &self.group),
            ("consumer", &self.consumer),
            ("payload field", &self.payload_field),
            ("ID field", &self.id_field),
        ];
        for (what, value) in named {
            if value.is_empty() {
                return Err(Error::new(
                    ErrorKind::InvalidConfig,
                    format!("the Redis stream {what} name must not be empty"),
                ));
            }
        }
        if self.dead_letter_stream_key() == self.stream {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                "the Redis dead-letter stream must differ from the consumed stream",
            ));
        }
        if self.block.is_zero() {
            // BLOCK 0 means "forever": the reclaim loop would never run on a quiet stream.
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                "the Redis stream block time must be above zero",
            ));
        }
        Ok(())
    }
}
