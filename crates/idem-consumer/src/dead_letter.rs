//! Why a message was dead-lettered, in a form every adapter attaches the same way.

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
                _ => DeadLetterReason::Rejected,
            }
        };
        Self::new(reason, err.to_string())
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

    /// The headers an adapter attaches to the dead-lettered copy, besides the original
    /// headers: reason code, detail, consumer, attempts. Header values are kept to one line.
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut h = vec![
            (REASON_HEADER, self.reason.code().to_owned()),
            (DETAIL_HEADER, one_line(&self.detail)),
        ];
        if let Some(c) = &self.consumer {
            h.push((CONSUMER_HEADER, c.clone()));
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
}
