//! Why a message was dead-lettered, in a form every adapter attaches the same way.

use std::borrow::Cow;
use std::fmt;

use idem_core::{Error, ErrorKind, MessageId, Outcome};

/// Header carrying the [`DeadLetterReason`] code (`conflict`, `missing-id`, …).
pub const REASON_HEADER: &str = "idem-dead-letter-reason";
/// Header carrying the human-readable detail.
pub const DETAIL_HEADER: &str = "idem-dead-letter-detail";
/// Header carrying the consumer that gave up on the message.
pub const CONSUMER_HEADER: &str = "idem-consumer";
/// Header carrying how many processing attempts were made.
pub const ATTEMPTS_HEADER: &str = "idem-attempts";

/// The class of reason, stable for machines (alerts, replay tooling).
///
/// What the runner decides for malformed input, whatever the broker:
///
/// | input | reason |
/// |---|---|
/// | no ID where the [`IdSource`](crate::IdSource) reads it (header absent, JSON pointer not found or not a string/integer, payload not JSON for a pointer) | `missing-id` |
/// | an ID slot that is present but empty (empty header, empty AMQP `message_id`, a Kafka header with a null value) | `missing-id` |
/// | an ID longer than the processor's [`max_message_id_len`](idem_core::ProcessorBuilder::max_message_id_len) | `invalid-id` |
/// | an ID that is not UTF-8, or holds NUL or other control bytes | nothing: an ID is bytes ([`MessageId`]), so it is processed like any other, where the broker can carry it |
/// | a payload the decoder refuses (malformed JSON, not UTF-8, empty) | `undecodable` |
/// | the same ID with another payload | `conflict` |
/// | a huge payload that decodes | nothing: idem sets no payload limit of its own; the broker's applies at publish time |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeadLetterReason {
    /// No usable ID where the ID source says it should be.
    MissingId,
    /// An ID that the store refuses (over the length limit).
    InvalidId,
    /// The payload could not be decoded into the handler's type.
    Undecodable,
    /// The ID was already processed with a different payload: a producer bug.
    Conflict,
    /// The handler rejected the message as permanently unprocessable.
    Rejected,
    /// A retryable error persisted through every attempt.
    RetriesExhausted,
    /// The database connection was lost while the message ran, attempt after attempt, while
    /// the database itself answered (or stayed down past the outage limit each time): its own
    /// statements likely end their session (a crash, an out-of-memory kill). Replay with care.
    ConnectionLost,
}

impl DeadLetterReason {
    /// The code written to [`REASON_HEADER`].
    pub const fn code(self) -> &'static str {
        match self {
            DeadLetterReason::MissingId => "missing-id",
            DeadLetterReason::InvalidId => "invalid-id",
            DeadLetterReason::Undecodable => "undecodable",
            DeadLetterReason::Conflict => "conflict",
            DeadLetterReason::Rejected => "rejected",
            DeadLetterReason::RetriesExhausted => "retries-exhausted",
            DeadLetterReason::ConnectionLost => "connection-lost",
        }
    }
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

/// A dead-lettering decision: the reason class, a detail for humans, and context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    reason: DeadLetterReason,
    detail: String,
    consumer: Option<String>,
    attempts: u32,
}

impl DeadLetter {
    /// Header listing the original headers an `invalid-id` dead letter carries cut short, each
    /// as `name (N bytes)`, comma-separated (see [`forward`](Self::forward)).
    pub const TRUNCATED_HEADER: &'static str = "idem-dead-letter-truncated";

    /// The longest original header value an `invalid-id` dead letter carries whole, in bytes
    /// (see [`forward`](Self::forward)).
    pub const MAX_FORWARDED_ID_VALUE: usize = 1024;

    /// A dead letter for `reason` with a human-readable `detail`.
    pub fn new(reason: DeadLetterReason, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
            consumer: None,
            attempts: 0,
        }
    }

    /// The dead letter for a fingerprint conflict.
    pub fn conflict<T>(id: &MessageId, outcome: &Outcome<T>) -> Self {
        let detail = match outcome {
            Outcome::Conflict { stored, received } => format!(
                "message ID {id} was already processed with a different payload (stored fingerprint {stored}, received {received})"
            ),
            _ => format!("message ID {id} conflicts with an earlier message"),
        };
        Self::new(DeadLetterReason::Conflict, detail)
    }

    /// The dead letter for a processing error whose disposition is not `Retry`, or a retryable
    /// one after the last attempt (`exhausted`).
    pub fn from_error(err: &Error, exhausted: bool) -> Self {
        let reason = if exhausted {
            DeadLetterReason::RetriesExhausted
        } else {
            match err.kind() {
                ErrorKind::InvalidMessageId => DeadLetterReason::InvalidId,
                // A phased message's record was written for another payload.
                ErrorKind::Request(idem_core::RequestErrorKind::KeyReused) => {
                    DeadLetterReason::Conflict
                }
                _ => DeadLetterReason::Rejected,
            }
        };
        Self::new(reason, err.to_string())
    }

    /// The dead letter for a message whose last attempt, like `lost` of them in all, lost its
    /// database connection while the database was up (or down past the outage limit).
    pub fn connection_lost(err: &Error, lost: u32) -> Self {
        let times = if lost == 1 { "once" } else { "repeatedly" };
        Self::new(
            DeadLetterReason::ConnectionLost,
            format!(
                "the database connection was lost while processing this message, {times} \
                 ({lost} of its attempts), each time with the database answering a probe \
                 right after (or down past the outage limit): the message's own statements \
                 likely end their session (a crash, an out-of-memory kill); last error: {err}"
            ),
        )
    }

    /// Records which consumer gave up and after how many attempts.
    pub fn with_context(mut self, consumer: &str, attempts: u32) -> Self {
        self.consumer = Some(consumer.to_owned());
        self.attempts = attempts;
        self
    }

    /// The reason class.
    pub fn reason(&self) -> DeadLetterReason {
        self.reason
    }

    /// The human-readable detail.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// How an adapter copies one original header value (header, property, field) onto the
    /// dead letter: unchanged, except on an `invalid-id` dead letter, where a value longer than
    /// [`MAX_FORWARDED_ID_VALUE`](Self::MAX_FORWARDED_ID_VALUE) bytes is cut to that many.
    ///
    /// An ID refused for its length is the one header that may be as large as the broker
    /// allows (a Nats-Msg-Id or Kafka header of nearly 1 MB); copied whole beside the reason
    /// headers, it would make the dead letter itself too large to publish, and the original
    /// would stay unacknowledged, redelivered and refused for ever. The cut copy keeps the
    /// message, its payload intact, the reason, and the ID's first bytes; the adapter names
    /// each cut header in [`TRUNCATED_HEADER`](Self::TRUNCATED_HEADER) (see [`truncation_note`](Self::truncation_note)).
    /// Such an ID could never be processed, so nothing a replay needs is lost.
    pub fn forward<'a>(&self, value: &'a [u8]) -> Cow<'a, [u8]> {
        match self.cut_at(value.len()) {
            Some(max) => Cow::Borrowed(&value[..max]),
            None => Cow::Borrowed(value),
        }
    }

    /// [`forward`](Self::forward) for text values, cut at a character boundary.
    pub fn forward_str<'a>(&self, value: &'a str) -> Cow<'a, str> {
        match self.cut_at(value.len()) {
            Some(mut max) => {
                while !value.is_char_boundary(max) {
                    max -= 1;
                }
                Cow::Borrowed(&value[..max])
            }
            None => Cow::Borrowed(value),
        }
    }

    /// Whether [`forward`](Self::forward) cuts a value of `len` bytes.
    pub fn cuts(&self, len: usize) -> bool {
        self.cut_at(len).is_some()
    }

    fn cut_at(&self, len: usize) -> Option<usize> {
        (self.reason == DeadLetterReason::InvalidId && len > Self::MAX_FORWARDED_ID_VALUE)
            .then_some(Self::MAX_FORWARDED_ID_VALUE)
    }

    /// The [`TRUNCATED_HEADER`](Self::TRUNCATED_HEADER) entry naming the headers [`forward`](Self::forward) cut, as
    /// `(name, original length)`; `None` when nothing was cut.
    pub fn truncation_note<S: AsRef<str>>(cut: &[(S, usize)]) -> Option<(&'static str, String)> {
        if cut.is_empty() {
            return None;
        }
        let note = cut
            .iter()
            .map(|(name, len)| format!("{} ({len} bytes)", name.as_ref()))
            .collect::<Vec<_>>()
            .join(", ");
        Some((Self::TRUNCATED_HEADER, one_line(&note)))
    }

    /// The headers an adapter attaches to the dead-lettered copy, besides the original
    /// headers (copied through [`forward`](Self::forward)): reason code, detail, consumer,
    /// attempts. Header values are kept to one line.
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut h = vec![
            (REASON_HEADER, self.reason.code().to_owned()),
            (DETAIL_HEADER, one_line(&self.detail)),
        ];
        if let Some(c) = &self.consumer {
            // `with_context` takes any text, not only a checked `ConsumerName` (found by
            // fuzz/id_source).
            h.push((CONSUMER_HEADER, one_line(c)));
        }
        h.push((ATTEMPTS_HEADER, self.attempts.to_string()));
        h
    }
}

impl fmt::Display for DeadLetter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.reason, self.detail)
    }
}

/// Header values must not contain line breaks (NATS and HTTP-style headers reject them) and
/// stay bounded so a huge error cannot make the dead letter itself unpublishable.
fn one_line(s: &str) -> String {
    const MAX: usize = 1024;
    let mut out: String = s
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if out.len() > MAX {
        let mut cut = MAX;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_are_single_line_and_bounded() {
        let dl = DeadLetter::new(
            DeadLetterReason::Rejected,
            format!("a\nb{}", "x".repeat(5000)),
        )
        .with_context("billing", 3);
        let h = dl.headers();
        assert_eq!(h[0], (REASON_HEADER, "rejected".to_owned()));
        assert!(!h[1].1.contains('\n'));
        assert!(h[1].1.len() <= 1024 + '…'.len_utf8());
        assert!(h.contains(&(CONSUMER_HEADER, "billing".to_owned())));
        assert!(h.contains(&(ATTEMPTS_HEADER, "3".to_owned())));
    }

    #[test]
    fn the_consumer_header_is_one_line_too() {
        let dl = DeadLetter::new(DeadLetterReason::Rejected, "x").with_context("bill\ning\0", 1);
        assert!(
            dl.headers()
                .contains(&(CONSUMER_HEADER, "bill ing ".to_owned()))
        );
    }

    #[test]
    fn only_invalid_id_dead_letters_cut_long_values() {
        let long = "é".repeat(DeadLetter::MAX_FORWARDED_ID_VALUE);
        let invalid = DeadLetter::new(DeadLetterReason::InvalidId, "too long");
        let cut = invalid.forward_str(&long);
        assert!(cut.len() <= DeadLetter::MAX_FORWARDED_ID_VALUE && long.starts_with(&*cut));
        assert_eq!(
            invalid.forward(long.as_bytes()).len(),
            DeadLetter::MAX_FORWARDED_ID_VALUE
        );
        assert_eq!(invalid.forward(b"short").as_ref(), b"short");
        assert!(invalid.cuts(long.len()) && !invalid.cuts(5));
        let conflict = DeadLetter::new(DeadLetterReason::Conflict, "other payload");
        assert_eq!(conflict.forward_str(&long), long.as_str());
        assert!(!conflict.cuts(long.len()));
        assert_eq!(
            DeadLetter::truncation_note(&[("message-id", 5000)]),
            Some((
                DeadLetter::TRUNCATED_HEADER,
                "message-id (5000 bytes)".to_owned()
            ))
        );
        assert_eq!(DeadLetter::truncation_note::<&str>(&[]), None);
    }
}
