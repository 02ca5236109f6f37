//! Configuring a [`JetStreamSource`] and the start-up checks it passes before its first fetch.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::AckPolicy;
use async_nats::jetstream::consumer::pull;
use async_nats::jetstream::context::GetStreamByNameErrorKind;
use async_nats::jetstream::{self, Context};
use idem_core::Error;

use crate::delivery::Target;
use crate::error;
use crate::source::JetStreamSource;

/// Default [`JetStreamSourceBuilder::ack_wait`].
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);
/// Default [`JetStreamSourceBuilder::pull_expires`].
pub const DEFAULT_PULL_EXPIRES: Duration = Duration::from_secs(10);

/// Configures a [`JetStreamSource`]; created by [`JetStreamSource::builder`], finished by
/// [`connect`](Self::connect) or [`connect_with`](Self::connect_with).
#[derive(Debug, Clone)]
#[must_use]
pub struct JetStreamSourceBuilder {
    stream: String,
    durable: String,
    filter_subject: Option<String>,
    ack_wait: Duration,
    max_deliver: Option<u32>,
    dead_letter_subject: Option<String>,
    pull_expires: Duration,
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
    /// back. Both are checked when the source connects; typically a separate stream (say
    /// `ORDERS_DLQ` with subject `ORDERS.dead-letter`, see [`ensure_stream`
    /// ](crate::ensure_stream)) holds them.
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

    /// Connects to the server at `url` (`nats://host:4222`) and starts the source on that
    /// connection.
    ///
    /// # Errors
    /// See [`connect_with`](Self::connect_with).
    pub async fn connect(self, url: &str) -> Result<JetStreamSource, Error> {
        let client = async_nats::connect(url).await.map_err(|e| {
            error::unavailable(
                &format!("connecting to {}", idem_redact::redact_url(url)),
                e,
            )
        })?;
        self.connect_with(jetstream::new(client)).await
    }

    /// Starts the source on a JetStream context the caller made (`jetstream::new(client)` on
    /// a client with its own credentials, TLS and reconnect policy, or a context with a
    /// domain or API prefix).
    ///
    /// Checks that the stream exists and that the dead-letter subject is captured by a stream
    /// but not by this consumer, then creates the durable consumer, or updates it to this
    /// configuration.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`](idem_core::ErrorKind::InvalidConfig) for a missing stream,
    /// a dead-letter subject that would be lost or consumed again, or a consumer configuration
    /// the server refuses; [`ErrorKind::Unavailable`](idem_core::ErrorKind::Unavailable) when
    /// the server cannot be reached.
    pub async fn connect_with(self, js: Context) -> Result<JetStreamSource, Error> {
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
        let target = Arc::new(Target {
            stream: self.stream,
            durable: self.durable,
            dead_letter_subject: dead_letter_subject.into(),
        });
        Ok(JetStreamSource::new(
            js,
            config,
            consumer,
            self.pull_expires,
            target,
        ))
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
