//! What happened to a message, as a value the caller acts on.

use crate::fingerprint::Fingerprint;

/// The result of processing one message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a Conflict must be dead-lettered, not ignored"]
pub enum Outcome<T> {
    /// New message: the handler ran and its effects committed together with the claim.
    Processed(T),
    /// Already processed with the same fingerprint. Acknowledge it; nothing else happened.
    Duplicate,
    /// Already processed under the same ID but with a different payload: a producer bug.
    /// Nothing ran. Dead-letter it with this as the reason; never ack it silently.
    Conflict {
        /// Fingerprint recorded by the first processing.
        stored: Fingerprint,
        /// Fingerprint of this delivery.
        received: Fingerprint,
    },
}

impl<T> Outcome<T> {
    /// Whether the handler ran and committed.
    pub fn is_processed(&self) -> bool {
        matches!(self, Outcome::Processed(_))
    }

    /// Whether this was a duplicate delivery.
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Outcome::Duplicate)
    }

    /// Whether this was a fingerprint conflict.
    pub fn is_conflict(&self) -> bool {
        matches!(self, Outcome::Conflict { .. })
    }

    /// The handler's value, if it ran.
    pub fn processed(self) -> Option<T> {
        match self {
            Outcome::Processed(v) => Some(v),
            _ => None,
        }
    }

    /// Maps the handler's value.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Outcome<U> {
        match self {
            Outcome::Processed(v) => Outcome::Processed(f(v)),
            Outcome::Duplicate => Outcome::Duplicate,
            Outcome::Conflict { stored, received } => Outcome::Conflict { stored, received },
        }
    }
}

/// The result of the low-level claim inside a caller's own transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "only a New claim may run the side effect"]
pub enum Claim {
    /// The ID was recorded in this transaction: do the work, then commit.
    New,
    /// Already processed with the same fingerprint: do nothing.
    Duplicate,
    /// Already processed with a different fingerprint: do nothing, dead-letter.
    Conflict {
        /// Fingerprint recorded by the first processing.
        stored: Fingerprint,
        /// Fingerprint of this delivery.
        received: Fingerprint,
    },
}

impl Claim {
    /// Compares what the store found with what was offered.
    pub fn from_stored(stored: Option<Fingerprint>, received: Fingerprint) -> Self {
        match stored {
            None => Claim::New,
            Some(s) if s == received => Claim::Duplicate,
            Some(stored) => Claim::Conflict { stored, received },
        }
    }

    /// The outcome for a message whose handler must not run (`Duplicate`, `Conflict`), or
    /// `None` for a new claim: for callers driving the transaction with `claim_in` who report
    /// [`Outcome`]s like the processor does.
    pub fn skipped<T>(self) -> Option<Outcome<T>> {
        match self {
            Claim::New => None,
            Claim::Duplicate => Some(Outcome::Duplicate),
            Claim::Conflict { stored, received } => Some(Outcome::Conflict { stored, received }),
        }
    }
}
