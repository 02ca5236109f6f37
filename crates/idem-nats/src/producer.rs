//! The producer side: publishing with a stable `Nats-Msg-Id`.

use async_nats::HeaderMap;
use async_nats::header::{HeaderValue, NATS_MESSAGE_ID};
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::{self, Context};
use async_nats::subject::ToSubject;
use bytes::Bytes;
use idem_core::{Error, ErrorKind};

use crate::error;

/// Publishes JetStream messages with a stable `Nats-Msg-Id` (where [`JetStreamSource`
/// ](crate::JetStreamSource) reads the ID by default) and waits until the stream has stored
/// each one (the PubAck).
///
/// `id` is anything that is bytes: a `&str`, a [`MessageId`](idem_core::MessageId), or, for a
/// message a handler publishes as a side effect, a derived key's
/// [`to_message_id`](idem_core::DerivedKey::to_message_id), so that reprocessing publishes the
/// same ID again and the downstream consumer sees a duplicate:
///
/// ```no_run
/// # async fn demo(consumer: idem_core::ConsumerName, id: idem_core::MessageId) -> Result<(), idem_core::Error> {
/// use idem_core::DerivedKey;
/// use idem_nats::NatsProducer;
///
/// let producer = NatsProducer::connect("nats://127.0.0.1:4222").await?;
/// let key = DerivedKey::new(&consumer, &id, "publish:PaymentCompleted");
/// let ack = producer.publish("payments.completed", &key.to_message_id(), "{}").await?;
/// if ack.duplicate {
///     // JetStream's duplicate window caught a re-publish; nothing new was stored.
/// }
/// # Ok(()) }
/// ```
///
/// `ack.duplicate` is JetStream's own publish-time de-duplication: it only covers the stream's
/// duplicate window (two minutes by default) and says nothing about whether a consumer already
/// processed the message. That is what the consumer's claim is for.
#[derive(Debug, Clone)]
pub struct NatsProducer {
    js: Context,
}

impl NatsProducer {
    /// Connects to the server at `url` (`nats://host:4222`).
    ///
    /// # Errors
    /// [`ErrorKind::Unavailable`] when the server cannot be reached.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let client = async_nats::connect(url).await.map_err(|e| {
            error::unavailable(
                &format!("connecting to {}", idem_redact::redact_url(url)),
                e,
            )
        })?;
        Ok(Self::new(jetstream::new(client)))
    }

    /// Publishes through a JetStream context the caller made (its client's credentials, TLS,
    /// domain), e.g. the one a [`JetStreamSource`](crate::JetStreamSource) uses
    /// ([`context`](crate::JetStreamSource::context)).
    pub fn new(js: Context) -> Self {
        Self { js }
    }

    /// The JetStream context this producer publishes through.
    pub fn context(&self) -> &Context {
        &self.js
    }

    /// Publishes `payload` to `subject` with `id` in the `Nats-Msg-Id` header and waits until
    /// the stream has stored it.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidMessageId`] when `id` is empty, not UTF-8, contains control
    /// characters (NUL included) or starts or ends with whitespace (NATS headers cannot carry
    /// it unchanged); [`ErrorKind::Rejected`] when the message is too large: headers and
    /// payload together over the server's `max_payload` (1 MiB unless configured), headers
    /// over JetStream's 64 KiB (the ID is a header, so an ID of nearly 64 KiB is the longest a
    /// stream takes), or over the stream's `max_msg_size`; [`ErrorKind::InvalidConfig`] when
    /// no stream captures `subject`; otherwise [`ErrorKind::Unavailable`].
    pub async fn publish(
        &self,
        subject: impl ToSubject,
        id: impl AsRef<[u8]>,
        payload: impl Into<Bytes>,
    ) -> Result<PublishAck, Error> {
        self.publish_with_headers(subject, id, HeaderMap::new(), payload)
            .await
    }

    /// [`publish`](Self::publish) with extra headers; `Nats-Msg-Id` in `headers` is replaced
    /// by `id`.
    ///
    /// # Errors
    /// As [`publish`](Self::publish).
    pub async fn publish_with_headers(
        &self,
        subject: impl ToSubject,
        id: impl AsRef<[u8]>,
        mut headers: HeaderMap,
        payload: impl Into<Bytes>,
    ) -> Result<PublishAck, Error> {
        headers.insert(NATS_MESSAGE_ID, id_header_value(id.as_ref())?);
        let pending = self
            .js
            .publish_with_headers(subject, headers, payload.into())
            .await
            .map_err(|e| error::publish("publishing", e))?;
        pending
            .await
            .map_err(|e| error::publish("waiting for the publish acknowledgement", e))
    }
}

/// The ID as a header value that reaches the consumer byte for byte.
fn id_header_value(id: &[u8]) -> Result<HeaderValue, Error> {
    let invalid = |why: &str| {
        Error::new(
            ErrorKind::InvalidMessageId,
            format!("a Nats-Msg-Id must be {why}"),
        )
    };
    let s = std::str::from_utf8(id).map_err(|_| invalid("valid UTF-8"))?;
    if s.is_empty() {
        return Err(invalid("non-empty"));
    }
    if s.chars().any(char::is_control) {
        return Err(invalid("free of control characters"));
    }
    // The header parser trims values, so surrounding whitespace would not survive the trip.
    if s.trim() != s {
        return Err(invalid("free of leading and trailing whitespace"));
    }
    s.parse().map_err(|_| invalid("a valid NATS header value"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_that_would_not_survive_a_header_are_refused() {
        for bad in [&b""[..], b"a\r\nb", b"\xff\xfe", b" padded", b"tab\t"] {
            let err = id_header_value(bad).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidMessageId, "{bad:?}");
        }
        assert_eq!(id_header_value(b"order-42").unwrap().as_str(), "order-42");
    }

    /// A NATS token is the URL's user name: neither the error nor the producer shows it.
    #[tokio::test]
    async fn connect_errors_hide_the_token() {
        let err = NatsProducer::connect("nats://hunter2-token@127.0.0.1:1")
            .await
            .expect_err("nothing listens on port 1");
        for shown in [err.to_string(), format!("{err:?}")] {
            assert!(!shown.contains("hunter2"), "{shown}");
        }
    }
}
