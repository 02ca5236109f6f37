//! What a failed publish means for its row: try again later, or never (a dead letter).

use idem_core::{Error, ErrorKind};

/// The relay's reading of a publish error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The broker may take it later (down, busy, no subscriber yet, no confirm in time).
    Retry,
    /// The broker can never take it: dead-letter with this reason code.
    DeadLetter(&'static str),
}

/// The reason a row that failed `max_attempts` times is dead-lettered with.
pub(crate) const RETRIES_EXHAUSTED: &str = "retries-exhausted";

impl Verdict {
    /// Refusals that say something about the message itself end in a dead letter; everything
    /// else (an outage, a timeout, a kind a publisher should not return) is retried, because a
    /// dead letter taken for a passing outage is a message an operator has to put back.
    pub(crate) fn of(err: &Error) -> Self {
        match err.kind() {
            ErrorKind::Rejected => Self::DeadLetter("rejected"),
            ErrorKind::InvalidMessageId => Self::DeadLetter("invalid-id"),
            ErrorKind::InvalidConfig => Self::DeadLetter("invalid-destination"),
            _ => Self::Retry,
        }
    }
}

/// Whether a store error stops the relay instead of pausing it: a missing outbox table or
/// missing privileges fail every lease the same way until an operator acts, as a consumer
/// stops on its claims table.
pub(crate) fn stops_the_relay(err: &Error) -> bool {
    matches!(
        err.kind(),
        ErrorKind::Misconfigured | ErrorKind::InvalidConfig
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permanent_refusals_dead_letter_and_everything_else_retries() {
        let e = |k| Error::new(k, "x");
        assert_eq!(
            Verdict::of(&e(ErrorKind::Rejected)),
            Verdict::DeadLetter("rejected")
        );
        assert_eq!(
            Verdict::of(&e(ErrorKind::InvalidMessageId)),
            Verdict::DeadLetter("invalid-id")
        );
        assert_eq!(
            Verdict::of(&e(ErrorKind::InvalidConfig)),
            Verdict::DeadLetter("invalid-destination")
        );
        for k in [
            ErrorKind::Unavailable,
            ErrorKind::Transient,
            ErrorKind::ConnectionLost,
            ErrorKind::OutcomeUnknown,
            ErrorKind::Misconfigured,
        ] {
            assert_eq!(Verdict::of(&e(k)), Verdict::Retry, "{k:?}");
        }
        assert!(stops_the_relay(&e(ErrorKind::Misconfigured)));
        assert!(!stops_the_relay(&e(ErrorKind::Unavailable)));
    }
}
