//! One JetStream message as a [`Delivery`]: read, then settled exactly once.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use async_nats::header::{HeaderName, HeaderValue, NATS_MESSAGE_ID};
use async_nats::jetstream::{self, AckKind};
use async_nats::{HeaderMap, Subject};
use idem_consumer::{DeadLetter, Delivery};
use idem_core::Error;

use crate::error;

/// Prefix under which a dead letter keeps the original's `Nats-*` headers.
///
/// JetStream interprets `Nats-*` headers when a message is published (`Nats-Msg-Id` de-duplicates,
/// `Nats-Expected-*` make the publish conditional, `Nats-Rollup` purges the subject). Copied
/// verbatim onto the dead letter they would act on the dead-letter stream instead, so they are
/// kept under this prefix: the producer's ID is in `idem-original-Nats-Msg-Id`. A replay tool
/// restores them by dropping the prefix.
pub const ORIGINAL_HEADER_PREFIX: &str = "idem-original-";
/// Dead-letter header: the stream the message was consumed from.
pub const ORIGINAL_STREAM_HEADER: &str = "idem-original-stream";
/// Dead-letter header: the message's sequence in that stream.
pub const ORIGINAL_SEQUENCE_HEADER: &str = "idem-original-sequence";
/// Dead-letter header: the subject the message was published to.
pub const ORIGINAL_SUBJECT_HEADER: &str = "idem-original-subject";

/// Where this source's dead letters go, shared by its deliveries.
#[derive(Debug)]
pub(crate) struct Target {
    pub(crate) stream: String,
    pub(crate) durable: String,
    pub(crate) dead_letter_subject: Subject,
}

/// A message fetched by a [`JetStreamSource`](crate::JetStreamSource).
///
/// Acknowledgements are double acks: [`Delivery::ack`] returns only once the server confirmed
/// it, so an `Ok` means the message will not come back — unless the server crashes before it
/// persisted the consumer's ack state (nats-server writes it asynchronously), in which case
/// the redelivery is a duplicate for the claim.
#[derive(Debug)]
pub struct JetStreamDelivery {
    msg: jetstream::Message,
    /// Stream sequence and delivery count from the ack subject; `None` if the server sent one
    /// this client cannot parse (then the message is still delivered and settled normally).
    meta: Option<(u64, i64)>,
    target: Arc<Target>,
}

impl JetStreamDelivery {
    pub(crate) fn new(msg: jetstream::Message, target: Arc<Target>) -> Self {
        let meta = msg
            .info()
            .ok()
            .map(|info| (info.stream_sequence, info.delivered));
        if meta.is_none() {
            tracing::warn!(stream = %target.stream, subject = %msg.subject, "JetStream message without a parsable ack subject; delivery count unknown");
        }
        Self { msg, meta, target }
    }

    /// The subject the message was published to.
    pub fn subject(&self) -> &str {
        self.msg.subject.as_str()
    }

    /// The message's sequence in its stream, when the server reported it.
    pub fn stream_sequence(&self) -> Option<u64> {
        self.meta.map(|(seq, _)| seq)
    }

    /// The underlying async-nats message (for headers or metadata idem does not expose).
    pub fn message(&self) -> &jetstream::Message {
        &self.msg
    }

    /// The dead letter: original payload, original headers (`Nats-*` ones renamed, see
    /// [`ORIGINAL_HEADER_PREFIX`]; on an `invalid-id` dead letter a value over 1 KiB cut short,
    /// see [`DeadLetter::forward`]), where it came from, and why.
    fn dead_letter_headers(&self, reason: &DeadLetter) -> Result<HeaderMap, Error> {
        let mut out = HeaderMap::new();
        let mut cut = Vec::new();
        if let Some(original) = &self.msg.headers {
            for (name, values) in original.iter() {
                let name_str: &str = name.as_ref();
                let name = if is_jetstream_directive(name_str) {
                    header_name(format!("{ORIGINAL_HEADER_PREFIX}{name_str}"))?
                } else {
                    name.clone()
                };
                for value in values {
                    let text = value.as_str();
                    if reason.cuts(text.len()) {
                        cut.push((name_str.to_owned(), text.len()));
                        out.append(name.clone(), header_value(&reason.forward_str(text))?);
                    } else {
                        out.append(name.clone(), value.clone());
                    }
                }
            }
        }
        if let Some((name, value)) = DeadLetter::truncation_note(&cut) {
            out.insert(name, header_value(&value)?);
        }
        out.insert(ORIGINAL_STREAM_HEADER, header_value(&self.target.stream)?);
        out.insert(
            ORIGINAL_SUBJECT_HEADER,
            header_value(self.msg.subject.as_str())?,
        );
        if let Some((seq, _)) = self.meta {
            out.insert(ORIGINAL_SEQUENCE_HEADER, HeaderValue::from(seq));
            // One dead letter per (stream message, consumer): a dead letter re-sent because
            // the ack after it was lost is de-duplicated, while two messages that share a
            // producer ID (a conflict) or one message rejected by two consumers all land.
            let key = format!("{}/{}/{seq}", self.target.stream, self.target.durable);
            out.insert(NATS_MESSAGE_ID, header_value(&key)?);
        }
        for (name, value) in reason.headers() {
            out.insert(name, header_value(&value)?);
        }
        Ok(out)
    }
}

impl Delivery for JetStreamDelivery {
    fn payload(&self) -> &[u8] {
        &self.msg.payload
    }

    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        // A name NATS could never carry is simply absent (the runner then reports a
        // missing ID), not a panic inside the client's header map.
        let name: HeaderName = name.parse().ok()?;
        let value = self.msg.headers.as_ref()?.get(name)?;
        Some(Cow::Borrowed(value.as_str().as_bytes()))
    }

    fn previous_deliveries(&self) -> u32 {
        self.meta.map_or(0, |(_, delivered)| {
            u32::try_from(delivered.saturating_sub(1).max(0)).unwrap_or(u32::MAX)
        })
    }

    fn fmt_origin(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.meta {
            Some((seq, _)) => write!(f, "stream {} seq {seq}", self.target.stream),
            None => write!(
                f,
                "stream {} subject {}",
                self.target.stream, self.msg.subject
            ),
        }
    }

    async fn ack(self) -> Result<(), Error> {
        self.msg
            .double_ack()
            .await
            .map_err(|e| error::unavailable("acknowledging", e))
    }

    async fn dead_letter(self, reason: &DeadLetter) -> Result<(), Error> {
        let headers = self.dead_letter_headers(reason)?;
        let subject = self.target.dead_letter_subject.clone();
        let pending = self
            .msg
            .context
            .publish_with_headers(subject, headers, self.msg.payload.clone())
            .await
            .map_err(|e| error::publish("publishing the dead letter", e))?;
        pending.await.map_err(|e| {
            error::publish(
                &format!(
                    "publishing the dead letter to {} (is it captured by a stream?)",
                    self.target.dead_letter_subject
                ),
                e,
            )
        })?;
        self.msg
            .double_ack()
            .await
            .map_err(|e| error::unavailable("acknowledging the dead-lettered original", e))
    }

    async fn abandon(self) {
        // Best effort: if the nak is lost, the ack wait expires and the server redelivers anyway.
        if let Err(e) = self.msg.ack_with(AckKind::Nak(None)).await {
            tracing::debug!(error = %e, origin = %self.origin(), "nak failed; the message comes back after the ack wait");
        }
    }
}

/// `Nats-*` headers are instructions to JetStream at publish time.
fn is_jetstream_directive(name: &str) -> bool {
    name.get(..5)
        .is_some_and(|prefix| prefix.eq_ignore_ascii_case("nats-"))
}

fn header_name(name: String) -> Result<HeaderName, Error> {
    HeaderName::try_from(name.clone())
        .map_err(|_| error::invalid_config(format!("{name:?} is not a valid NATS header name")))
}

/// Header values cannot contain line breaks; anything else passes through.
fn header_value(value: &str) -> Result<HeaderValue, Error> {
    let value = if value.contains(['\r', '\n']) {
        Cow::Owned(value.replace(['\r', '\n'], " "))
    } else {
        Cow::Borrowed(value)
    };
    value
        .parse()
        .map_err(|_| error::invalid_config(format!("{value:?} is not a valid NATS header value")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_nats_headers_are_treated_as_directives() {
        assert!(is_jetstream_directive("Nats-Msg-Id"));
        assert!(is_jetstream_directive("nats-rollup"));
        assert!(!is_jetstream_directive("Nats"));
        assert!(!is_jetstream_directive("traceparent"));
        assert!(!is_jetstream_directive("é"));
    }

    #[test]
    fn header_values_lose_line_breaks() {
        assert_eq!(header_value("a\r\nb").unwrap().as_str(), "a  b");
    }
}
