//! The pull consumer: configuration, start-up checks, fetching and recovery.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::Client;
use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream::consumer::pull::{self, Batch};
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::context::GetStreamByNameErrorKind;
use async_nats::jetstream::{self, Context};
use futures_util::{FutureExt, StreamExt};
use idem_consumer::{IdSource, Source};
use idem_core::{Error, ErrorKind};

use crate::delivery::{JetStreamDelivery, Target};
use crate::error;

/// Default [`JetStreamSourceBuilder::ack_wait`].
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);
/// Default [`JetStreamSourceBuilder::pull_expires`].
pub const DEFAULT_PULL_EXPIRES: Duration = Duration::from_secs(10);
/// A pull request that ends sooner than this without a message did not really wait (the
/// connection closed under it); going straight back would spin.
const MIN_PULL: Duration = Duration::from_millis(50);

/// How often a waiting `next` checks whether the client reconnected (and the server therefore
/// forgot the open pull request).
const RECONNECT_CHECK: Duration = Duration::from_millis(250);

/// Configures a [`JetStreamSource`]; created by [`JetStreamSource::builder`].
#[derive(Debug, Clone)]
pub struct JetStreamSourceBuilder {
    stream: String,
    durable: String,
    filter_subject: Option<String>,
    ack_wait: Duration,
    max_deliver: Option<u32>,
    dead_letter_subject: Option<String>,
    pull_expires: Duration,
}

impl JetStreamSourceBuilder {
    /// Only messages whose subject matches `subject` (wildcards allowed) are consumed; by
    /// default every subject of the stream.
    pub fn filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.filter_subject = Some(subject.into());
        self
    }

    /// How long the server waits for an acknowledgement before redelivering (default 30 s).
    ///
    /// Make it longer than a message's processing time including the runner's retries,
    /// otherwise a slow message is redelivered while it is still being processed. That is safe
    /// (the claim turns the second copy into a duplicate) but wasted work.
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// Lets JetStream stop redelivering a message after `n` deliveries. Unlimited by default,
    /// and best left so: the runner dead-letters a message that keeps failing, with a reason,
    /// whereas JetStream's limit leaves it in the stream unacknowledged and silently
    /// undelivered.
    pub fn max_deliver(mut self, n: u32) -> Self {
        self.max_deliver = Some(n);
        self
    }

    /// Where dead letters are published (default `<stream>.dead-letter`).
    ///
    /// A NATS subject keeps nothing by itself: some stream must capture it, or every
    /// dead-lettering fails and the poison message is redelivered over and over instead. It
    /// must also not be consumed by this same consumer, or dead letters would come straight
    /// back. Both are checked when the source is built; typically a separate stream (say
    /// `ORDERS_DLQ` with subject `ORDERS.dead-letter`) holds them.
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter_subject = Some(subject.into());
        self
    }

    /// How long one pull request waits on the server for messages before it is renewed
    /// (default 10 s); longer sends fewer requests to an idle stream. A request the server
    /// lost in a restart is re-sent as soon as the client has reconnected, whatever this is.
    pub fn pull_expires(mut self, expires: Duration) -> Self {
        self.pull_expires = expires;
        self
    }

    /// Connects to the server at `url` (`nats://host:4222`) and builds the source on that
    /// connection.
    ///
    /// # Errors
    /// See [`JetStreamSourceBuilder::build_with_context`].
    pub async fn connect(self, url: &str) -> Result<JetStreamSource, Error> {
        let client = async_nats::connect(url).await.map_err(|e| {
            error::unavailable(&format!("connecting to {}", idem_core::redact_url(url)), e)
        })?;
        self.build(client).await
    }

    /// Builds the source on an existing client (its credentials, TLS, reconnect policy).
    ///
    /// # Errors
    /// See [`JetStreamSourceBuilder::build_with_context`].
    pub async fn build(self, client: Client) -> Result<JetStreamSource, Error> {
        self.build_with_context(jetstream::new(client)).await
    }

    /// Builds the source on an existing JetStream context (a domain or API prefix).
    ///
    /// Checks that the stream exists and that the dead-letter subject is captured by a stream
    /// but not by this consumer, then creates the durable consumer, or updates it to this
    /// configuration.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] for a missing stream, a dead-letter subject that would be
    /// lost or consumed again, or a consumer configuration the server refuses;
    /// [`ErrorKind::Unavailable`] when the server cannot be reached.
    pub async fn build_with_context(self, js: Context) -> Result<JetStreamSource, Error> {
        if self.ack_wait.is_zero() || self.pull_expires.is_zero() {
            return Err(error::invalid_config(
                "the ack wait and the pull expiry must be longer than zero".to_owned(),
            ));
        }
        let dead_letter_subject = self
            .dead_letter_subject
            .clone()
            .unwrap_or_else(|| format!("{}.dead-letter", self.stream));
        let stream = js
            .get_stream(&self.stream)
            .await
            .map_err(|e| error::api(&format!("looking up stream {}", self.stream), e))?;
        check_dead_letter_subject(
            &js,
            &self.stream,
            self.filter_subject.as_deref(),
            &dead_letter_subject,
        )
        .await?;
        let config = pull::Config {
            durable_name: Some(self.durable.clone()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: self.ack_wait,
            max_deliver: self.max_deliver.map_or(-1, i64::from),
            filter_subject: self.filter_subject.clone().unwrap_or_default(),
            ..Default::default()
        };
        let consumer = stream.create_consumer(config.clone()).await.map_err(|e| {
            error::api(
                &format!(
                    "creating consumer {} on stream {}",
                    self.durable, self.stream
                ),
                e,
            )
        })?;
        Ok(JetStreamSource {
            target: Arc::new(Target {
                stream: self.stream,
                durable: self.durable,
                dead_letter_subject: dead_letter_subject.into(),
            }),
            js,
            config,
            consumer: Some(consumer),
            pull: None,
            pull_expires: self.pull_expires,
        })
    }
}

/// A durable JetStream pull consumer as an idem [`Source`].
///
/// Messages are acknowledged explicitly, one by one, only after their transaction committed
/// (or they turned out to be duplicates). Each call to [`Source::next`] keeps at most one pull
/// request open for at most the `max` messages the runner asked for, so nothing is fetched
/// ahead that would sit in memory while its ack wait runs out.
///
/// Connection loss is handled by async-nats, which reconnects by itself; a fetch that fails
/// returns [`ErrorKind::Unavailable`], and the next call issues a fresh pull request and
/// re-creates the durable consumer (same configuration) in case the server lost it.
/// Re-creating means that a consumer deleted by an operator while the source runs comes back
/// and starts from the beginning of the stream: reprocessing that the claims turn into
/// duplicates.
pub struct JetStreamSource {
    js: Context,
    config: pull::Config,
    /// `None` after an error that may mean the server no longer has the consumer.
    consumer: Option<PullConsumer>,
    /// The open pull request, kept across calls so that a `next` dropped by the runner loses
    /// nothing: what arrives later is returned by the following call.
    pull: Option<Pull>,
    pull_expires: Duration,
    target: Arc<Target>,
}

/// One open pull request.
struct Pull {
    batch: Batch,
    opened: Instant,
    received: usize,
    /// The client's connection count when the request was sent: a reconnect since then means
    /// the server has forgotten the request.
    connects: u64,
}

impl std::fmt::Debug for JetStreamSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JetStreamSource")
            .field("stream", &self.target.stream)
            .field("durable", &self.target.durable)
            .field("filter_subject", &self.config.filter_subject)
            .field("ack_wait", &self.config.ack_wait)
            .field("dead_letter_subject", &self.target.dead_letter_subject)
            .field("pull_open", &self.pull.is_some())
            .finish_non_exhaustive()
    }
}

impl JetStreamSource {
    /// Configures a source consuming `stream` through the durable consumer `durable`. Sources
    /// sharing a durable name share its messages: each message goes to one of them.
    pub fn builder(
        stream: impl Into<String>,
        durable: impl Into<String>,
    ) -> JetStreamSourceBuilder {
        JetStreamSourceBuilder {
            stream: stream.into(),
            durable: durable.into(),
            filter_subject: None,
            ack_wait: DEFAULT_ACK_WAIT,
            max_deliver: None,
            dead_letter_subject: None,
            pull_expires: DEFAULT_PULL_EXPIRES,
        }
    }

    /// The JetStream context this source uses (to publish from the same connection).
    pub fn context(&self) -> &Context {
        &self.js
    }

    /// Where this source publishes dead letters.
    pub fn dead_letter_subject(&self) -> &str {
        self.target.dead_letter_subject.as_str()
    }

    /// Opens a pull request for up to `max` messages, re-creating the consumer if needed.
    async fn open_pull(&mut self, max: usize) -> Result<Pull, Error> {
        let consumer = match &self.consumer {
            Some(c) => c,
            None => {
                let c = self
                    .js
                    .create_consumer_on_stream(self.config.clone(), &self.target.stream)
                    .await
                    .map_err(|e| {
                        let e = error::api("re-creating the consumer", e);
                        // Whatever the server said, the runner only backs off and retries.
                        Error::new(ErrorKind::Unavailable, e.to_string()).with_source(e)
                    })?;
                self.consumer.insert(c)
            }
        };
        // No idle heartbeat: async-nats 0.51's `Batch` returns `Pending` after consuming one
        // without registering for the next message, which would stall delivery until the
        // request's timer fires. A pull request lost in a reconnect is detected instead by
        // watching the client's connection count (`next_or_reconnected`).
        let batch = consumer
            .batch()
            .max_messages(max)
            .expires(self.pull_expires)
            .messages()
            .await
            .map_err(|e| error::unavailable("requesting messages", e))?;
        Ok(Pull {
            batch,
            opened: Instant::now(),
            received: 0,
            connects: self.connects(),
        })
    }

    fn connects(&self) -> u64 {
        self.js
            .client()
            .statistics()
            .connects
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Waits for the next item of the open pull request, or `None` after a reconnect: a pull
    /// request lives on the server, so one sent before a server restart is gone, and waiting
    /// for its client-side timer would stall delivery for `pull_expires` + 5 s.
    async fn next_or_reconnected(
        &mut self,
    ) -> Option<Option<Result<jetstream::Message, async_nats::Error>>> {
        let pull = self.pull.as_mut()?;
        // Fast path without a timer: a timer that fires "now" still waits for the runtime's
        // next millisecond tick, which halved per-message throughput when it was always armed.
        if let Some(item) = pull.batch.next().now_or_never() {
            return Some(item);
        }
        let before = pull.connects;
        loop {
            let pull = self.pull.as_mut()?;
            tokio::select! {
                item = pull.batch.next() => return Some(item),
                _ = tokio::time::sleep(RECONNECT_CHECK) => {
                    if self.connects() != before {
                        return None;
                    }
                }
            }
        }
    }

    /// Forgets the pull request and the consumer handle after an error.
    fn reset(&mut self) {
        self.pull = None;
        self.consumer = None;
    }
}

impl Source for JetStreamSource {
    type Delivery = JetStreamDelivery;

    fn broker(&self) -> &'static str {
        "nats"
    }

    /// The `Nats-Msg-Id` header.
    ///
    /// It is also JetStream's publish de-duplication header, but JetStream only drops a
    /// re-publish inside the stream's duplicate window (two minutes by default) and never
    /// stops a consumer from receiving a message twice (redelivery after a crash or an ack
    /// timeout). The consumer's claim is what makes processing idempotent.
    fn default_id_source(&self) -> IdSource {
        IdSource::header(NATS_MESSAGE_ID.to_string())
    }

    async fn next(&mut self, max: usize) -> Result<Vec<JetStreamDelivery>, Error> {
        let max = max.max(1);
        loop {
            if self.pull.is_none() {
                let pull = self.open_pull(max).await?;
                self.pull = Some(pull);
            }
            let Some(item) = self.next_or_reconnected().await else {
                // Reconnected: the server lost the request. Tell the runner (one broker error,
                // logged and counted) and send a fresh request on the next call.
                self.pull = None;
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    "NATS: reconnected to the server; re-sending the pull request",
                ));
            };
            let Some(pull) = self.pull.as_mut() else {
                continue;
            };
            match item {
                Some(Ok(first)) => {
                    pull.received += 1;
                    let mut out = Vec::with_capacity(max.min(16));
                    out.push(JetStreamDelivery::new(first, self.target.clone()));
                    // Take what has already arrived, without waiting for more.
                    while out.len() < max {
                        match pull.batch.next().now_or_never() {
                            Some(Some(Ok(m))) => {
                                pull.received += 1;
                                out.push(JetStreamDelivery::new(m, self.target.clone()));
                            }
                            Some(Some(Err(e))) => {
                                tracing::warn!(error = %e, stream = %self.target.stream, "pull request failed; returning what arrived before");
                                self.reset();
                                break;
                            }
                            Some(None) => {
                                self.pull = None;
                                break;
                            }
                            None => break,
                        }
                    }
                    return Ok(out);
                }
                Some(Err(e)) => {
                    self.reset();
                    return Err(error::unavailable("fetching messages", e));
                }
                None => {
                    let quick = pull.received == 0 && pull.opened.elapsed() < MIN_PULL;
                    self.pull = None;
                    if quick {
                        self.consumer = None;
                        return Err(Error::new(
                            ErrorKind::Unavailable,
                            "NATS: the pull request ended at once; is the connection closed?",
                        ));
                    }
                }
            }
        }
    }

    async fn close(mut self) -> Result<(), Error> {
        // Messages that arrived but were never handed out go back now rather than after
        // their ack wait.
        if let Some(mut pull) = self.pull.take() {
            while let Some(Some(Ok(m))) = pull.batch.next().now_or_never() {
                let _ = m.ack_with(jetstream::AckKind::Nak(None)).await;
            }
        }
        self.js
            .client()
            .flush()
            .await
            .map_err(|e| error::unavailable("flushing", e))
    }
}

/// Refuses a dead-letter subject no stream keeps, or one this consumer would read back.
async fn check_dead_letter_subject(
    js: &Context,
    stream: &str,
    filter: Option<&str>,
    subject: &str,
) -> Result<(), Error> {
    if subject.is_empty() || subject.contains(['*', '>', ' ', '\t', '\r', '\n']) {
        return Err(error::invalid_config(format!(
            "dead-letter subject {subject:?} must be a literal subject (no wildcards or spaces)"
        )));
    }
    let capturing = match js.stream_by_subject(subject).await {
        Ok(name) => name,
        Err(e) if matches!(e.kind(), GetStreamByNameErrorKind::NotFound) => {
            return Err(error::invalid_config(format!(
                "no stream captures the dead-letter subject {subject:?}: dead letters could not be \
                 stored and poison messages would be redelivered forever; create a stream for it"
            )));
        }
        Err(e) if matches!(e.kind(), GetStreamByNameErrorKind::InvalidSubject) => {
            return Err(error::invalid_config(format!(
                "dead-letter subject {subject:?} is not a valid NATS subject"
            )));
        }
        Err(e) => return Err(error::unavailable("looking up the dead-letter stream", e)),
    };
    let consumed_again = capturing == stream && filter.is_none_or(|f| subject_matches(f, subject));
    if consumed_again {
        return Err(error::invalid_config(format!(
            "dead-letter subject {subject:?} is in stream {stream} and matches this consumer's \
             filter: dead letters would be consumed again; use a subject outside the filter"
        )));
    }
    Ok(())
}

/// Whether NATS subject `filter` (with `*` and `>` wildcards) matches the literal `subject`.
fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut tokens = subject.split('.');
    for f in filter.split('.') {
        match (f, tokens.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (f, Some(t)) if f == t => {}
            _ => return false,
        }
    }
    tokens.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::subject_matches;

    #[test]
    fn subject_wildcards() {
        assert!(subject_matches("orders.>", "orders.dead-letter"));
        assert!(subject_matches("orders.*", "orders.dead-letter"));
        assert!(subject_matches("orders.dead-letter", "orders.dead-letter"));
        assert!(!subject_matches("orders.*", "orders.a.b"));
        assert!(subject_matches("orders.*.b", "orders.a.b"));
        assert!(!subject_matches("orders.created", "orders.dead-letter"));
        assert!(!subject_matches("orders.>", "orders"));
        assert!(!subject_matches("orders", "orders.x"));
    }
}
