//! What the processor needs to know about a message: its ID and its fingerprint.

use crate::fingerprint::Fingerprint;
use crate::id::MessageId;

/// Anything that carries a producer-set ID and a payload fingerprint.
///
/// Implement it for your own envelope type to pass it to the processor directly, or use
/// [`Message`].
pub trait Identified {
    /// The producer-set ID.
    fn message_id(&self) -> &MessageId;
    /// The fingerprint stored with the claim and compared on redelivery.
    fn fingerprint(&self) -> Fingerprint;
}

impl<T: Identified + ?Sized> Identified for &T {
    fn message_id(&self) -> &MessageId {
        (**self).message_id()
    }
    fn fingerprint(&self) -> Fingerprint {
        (**self).fingerprint()
    }
}

/// A message with its ID, fingerprint and payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message<P = Vec<u8>> {
    id: MessageId,
    fingerprint: Fingerprint,
    payload: P,
}

impl<P: AsRef<[u8]>> Message<P> {
    /// A message whose fingerprint is the SHA-256 of its payload bytes.
    pub fn new(id: MessageId, payload: P) -> Self {
        let fingerprint = Fingerprint::of(payload.as_ref());
        Self {
            id,
            fingerprint,
            payload,
        }
    }
}

impl<P> Message<P> {
    /// A message with a caller-computed fingerprint (e.g. over selected fields).
    pub fn with_fingerprint(id: MessageId, fingerprint: Fingerprint, payload: P) -> Self {
        Self {
            id,
            fingerprint,
            payload,
        }
    }

    /// The payload.
    pub fn payload(&self) -> &P {
        &self.payload
    }

    /// Takes the payload out.
    pub fn into_payload(self) -> P {
        self.payload
    }
}

impl<P> Identified for Message<P> {
    fn message_id(&self) -> &MessageId {
        &self.id
    }
    fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }
}
