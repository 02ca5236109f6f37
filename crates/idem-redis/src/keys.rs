//! The key names of one record, and the rules for the configurable prefix.
//!
//! A record is one string key, `<prefix>:{<scope hex>:<key>}:rec`, holding its state,
//! fingerprint, lease deadline, fence and result (see [`crate::scripts`] for the value), with
//! a Redis expiry: in progress `max(lease, TTL)` after the take, pushed out by lease
//! extensions; completed, the TTL after completion.
//!
//! Records written by earlier versions were a hash under the same name with two keys beside
//! it, `…:lease` (the holder's fence, `PX` the lease) and `…:fence` (the last fence handed
//! out). Their names are still built for the begin script, which reads and deletes them when
//! it meets such a record.
//!
//! The braces are a Redis Cluster hash tag: the names of a record hash to one slot, so one
//! script can touch all of them. A key containing `}` ends the tag early, at the same byte in
//! every name, so they still share a slot.

use idem_core::{Error, ErrorKind, RequestKey};

/// The key prefix unless configured otherwise.
pub const DEFAULT_KEY_PREFIX: &str = "idem:req";

/// The key names of one record: the record, and the side keys of an earlier version's.
#[derive(Debug)]
pub(crate) struct RecordKeys {
    pub(crate) record: String,
    base_len: usize,
}

impl RecordKeys {
    pub(crate) fn new(prefix: &str, key: &RequestKey) -> Self {
        let k = key.key.as_str();
        // Into the key's own buffer: this runs on every request.
        let mut record = String::with_capacity(prefix.len() + k.len() + 72);
        record.push_str(prefix);
        record.push_str(":{");
        idem_core::hex::push(&mut record, key.scope.as_bytes());
        record.push(':');
        record.push_str(k);
        record.push_str("}:");
        let base_len = record.len();
        record.push_str("rec");
        Self { record, base_len }
    }

    /// The lease key of an earlier version's record.
    pub(crate) fn legacy_lease(&self) -> String {
        format!("{}lease", &self.record[..self.base_len])
    }

    /// The fence counter of an earlier version's record.
    pub(crate) fn legacy_fence(&self) -> String {
        format!("{}fence", &self.record[..self.base_len])
    }
}

/// A prefix must be non-empty, and braces would move the hash tag into the prefix, putting
/// every record of the store into one cluster slot.
pub(crate) fn validate_prefix(prefix: &str) -> Result<(), Error> {
    if prefix.is_empty() {
        return Err(Error::new(
            ErrorKind::InvalidConfig,
            "the Redis request store's key prefix must not be empty",
        ));
    }
    if prefix.contains(['{', '}']) {
        return Err(Error::new(
            ErrorKind::InvalidConfig,
            format!(
                "the Redis request store's key prefix {prefix:?} contains a brace, which \
                 would become the Redis Cluster hash tag of every record"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::{IdempotencyKey, RequestScope};

    /// Redis Cluster's rule: the bytes between the first `{` and the first `}` after it, if
    /// any are there; otherwise the whole name.
    fn hash_tag(name: &str) -> &str {
        if let Some(open) = name.find('{')
            && let Some(len) = name[open + 1..].find('}')
            && len > 0
        {
            return &name[open + 1..open + 1 + len];
        }
        name
    }

    fn keys(key: &str) -> RecordKeys {
        let scope = RequestScope::new(["alice", "POST", "/charges"]);
        RecordKeys::new(
            DEFAULT_KEY_PREFIX,
            &RequestKey::new(scope, IdempotencyKey::new(key).unwrap()),
        )
    }

    #[test]
    fn the_keys_of_a_record_share_one_hash_tag() {
        for key in ["k-1", "a}b", "{x}", "}", "{", "a{b}c"] {
            let k = keys(key);
            let tag = hash_tag(&k.record);
            assert_eq!(hash_tag(&k.legacy_lease()), tag, "{key}");
            assert_eq!(hash_tag(&k.legacy_fence()), tag, "{key}");
            assert!(tag.starts_with(&RequestScope::new(["alice", "POST", "/charges"]).to_hex()));
        }
        let k = keys("k-1");
        let scope = RequestScope::new(["alice", "POST", "/charges"]).to_hex();
        assert_eq!(k.record, format!("idem:req:{{{scope}:k-1}}:rec"));
        assert_eq!(k.legacy_lease(), format!("idem:req:{{{scope}:k-1}}:lease"));
        assert_eq!(k.legacy_fence(), format!("idem:req:{{{scope}:k-1}}:fence"));
    }

    #[test]
    fn names_of_different_records_never_collide() {
        // A key that spells another record's suffix still gets names of its own.
        let a = keys("x");
        let b = keys("x}:lease");
        let names = |k: &RecordKeys| [k.record.clone(), k.legacy_lease(), k.legacy_fence()];
        for name in names(&b) {
            assert!(!names(&a).contains(&name), "{name}");
        }
    }

    #[test]
    fn prefixes_with_braces_or_empty_are_refused() {
        assert!(validate_prefix("idem:req").is_ok());
        for bad in ["", "{app}", "a}"] {
            let e = validate_prefix(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{bad:?}");
        }
    }
}
