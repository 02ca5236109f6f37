//! Derived keys for external side effects.
//!
//! A database rollback cannot unsend an email or un-charge a card: a call made before a crash
//! still happened. So each external call gets its own idempotency key, derived from
//! (consumer, message ID, step). A reprocessed message derives the same keys and the
//! third party (Stripe, a mailer, a downstream topic) deduplicates the retry.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::id::{ConsumerName, MessageId};
use crate::request::RequestKey;

/// A deterministic key for one step of one message's processing by one consumer.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DerivedKey([u8; 32]);

impl DerivedKey {
    /// Derives the key for `step` (e.g. `"send-receipt"`, `"publish:PaymentCompleted"`).
    pub fn new(consumer: &ConsumerName, id: &MessageId, step: &str) -> Self {
        let mut h = Sha256::new();
        // Domain tag + length prefixes make the encoding injective across all three parts.
        h.update(b"idem/derived-key/v1\0");
        for part in [consumer.as_str().as_bytes(), id.as_bytes(), step.as_bytes()] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part);
        }
        Self(h.finalize().into())
    }

    /// Derives the key of the external call named `call` (e.g. `"card-charge"`) made while
    /// executing the idempotent request recorded under `request`. Distinct per scope (for
    /// HTTP: principal, method and path) and client key, and the same for every execution of
    /// that record — a retry after a 5xx, a takeover after a crash — so the third party
    /// deduplicates them. Two tenants sending the same `Idempotency-Key` derive different keys.
    pub fn for_request(request: &RequestKey, call: &str) -> Self {
        let mut h = Sha256::new();
        h.update(b"idem/derived-key/request/v1\0");
        for part in [
            request.scope.as_bytes().as_slice(),
            request.key.as_str().as_bytes(),
            call.as_bytes(),
        ] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part);
        }
        Self(h.finalize().into())
    }

    /// Derives the key of the external call named `call` made in the phase named `phase` of
    /// the operation recorded under `request` (see `idem-request`'s phases). Distinct per
    /// scope (tenant, principal), client key, phase and call, and the same for every execution
    /// of that record — a retry, a takeover after a crash, the completer — so a foreign call
    /// repeated after a crash lands on the first one at the third party.
    ///
    /// It does not change between two lives of a key: a completed record that expired and a
    /// new operation under the same client key derive the same keys again. Clients use a new
    /// key per logical operation, and third parties keep their keys for a day or so (Stripe:
    /// 24 h), which a request TTL at least as long covers.
    pub fn for_phase(request: &RequestKey, phase: &str, call: &str) -> Self {
        let mut h = Sha256::new();
        h.update(b"idem/derived-key/phase/v1\0");
        for part in [
            request.scope.as_bytes().as_slice(),
            request.key.as_str().as_bytes(),
            phase.as_bytes(),
            call.as_bytes(),
        ] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part);
        }
        Self(h.finalize().into())
    }

    /// The raw 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The key as an RFC 9562 version-8 UUID string: the shape most third-party idempotency
    /// headers accept.
    pub fn to_uuid_string(&self) -> String {
        let mut b: [u8; 16] = [0; 16];
        b.copy_from_slice(&self.0[..16]);
        b[6] = (b[6] & 0x0f) | 0x80; // version 8
        b[8] = (b[8] & 0x3f) | 0x80; // RFC 9562 variant
        let hex = crate::hex::encode(&b);
        format!(
            "{}-{}-{}-{}-{}",
            &hex[0..8],
            &hex[8..12],
            &hex[12..16],
            &hex[16..20],
            &hex[20..32]
        )
    }

    /// The key as the ID of a message the handler publishes, so that a reprocessed message
    /// publishes with the same ID and downstream consumers see a duplicate.
    pub fn to_message_id(&self) -> MessageId {
        MessageId::from_trusted(self.to_uuid_string().into_bytes())
    }
}

impl fmt::Display for DerivedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_uuid_string())
    }
}

impl fmt::Debug for DerivedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DerivedKey({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(c: &str, id: &str, step: &str) -> DerivedKey {
        DerivedKey::new(
            &ConsumerName::new(c).unwrap(),
            &MessageId::new(id).unwrap(),
            step,
        )
    }

    #[test]
    fn same_inputs_same_key_any_change_a_new_one() {
        let k = key("billing", "m-1", "charge");
        assert_eq!(k, key("billing", "m-1", "charge"));
        assert_ne!(k, key("billing", "m-1", "email"));
        assert_ne!(k, key("billing", "m-2", "charge"));
        assert_ne!(k, key("shipping", "m-1", "charge"));
        // Length prefixes: moving bytes between parts changes the key.
        assert_ne!(key("ab", "c", "x"), key("a", "bc", "x"));
    }

    #[test]
    fn request_keys_differ_per_scope_key_and_call() {
        use crate::{IdempotencyKey, RequestScope};
        let req = |scope: &str, key: &str| {
            RequestKey::new(
                RequestScope::new([scope]),
                IdempotencyKey::new(key).unwrap(),
            )
        };
        let k = DerivedKey::for_request(&req("alice", "order-42"), "charge");
        assert_eq!(
            k,
            DerivedKey::for_request(&req("alice", "order-42"), "charge")
        );
        assert_ne!(
            k,
            DerivedKey::for_request(&req("bob", "order-42"), "charge")
        );
        assert_ne!(
            k,
            DerivedKey::for_request(&req("alice", "order-43"), "charge")
        );
        assert_ne!(
            k,
            DerivedKey::for_request(&req("alice", "order-42"), "email")
        );
    }

    #[test]
    fn phase_keys_differ_per_scope_key_phase_and_call() {
        use crate::{IdempotencyKey, RequestScope};
        let req = |scope: &str, key: &str| {
            RequestKey::new(
                RequestScope::new([scope]),
                IdempotencyKey::new(key).unwrap(),
            )
        };
        let alice = req("alice", "order-42");
        let k = DerivedKey::for_phase(&alice, "charge", "card");
        assert_eq!(k, DerivedKey::for_phase(&alice, "charge", "card"));
        assert_ne!(
            k,
            DerivedKey::for_phase(&req("bob", "order-42"), "charge", "card")
        );
        assert_ne!(
            k,
            DerivedKey::for_phase(&req("alice", "order-43"), "charge", "card")
        );
        assert_ne!(k, DerivedKey::for_phase(&alice, "refund", "card"));
        assert_ne!(k, DerivedKey::for_phase(&alice, "charge", "email"));
        assert_ne!(k, DerivedKey::for_phase(&alice, "ch", "argecard"));
        assert_ne!(k, DerivedKey::for_request(&alice, "card"));
    }

    #[test]
    fn uuid_form_has_version_8_and_rfc_variant() {
        let s = key("billing", "m-1", "charge").to_uuid_string();
        assert_eq!(s.len(), 36);
        assert_eq!(&s[14..15], "8");
        assert!(matches!(&s[19..20], "8" | "9" | "a" | "b"), "{s}");
        assert_eq!(
            key("billing", "m-1", "charge").to_message_id().as_bytes(),
            s.as_bytes()
        );
    }
}
