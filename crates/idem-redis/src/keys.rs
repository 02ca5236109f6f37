//! The key names of one record, and the rules for the configurable prefix.
//!
//! One record is three keys, `<prefix>:{<scope hex>:<key>}:<part>`:
//!
//! | part | type | holds | expires |
//! |---|---|---|---|
//! | `rec` | hash | `fp` (fingerprint), `state` (`run` / `done`), `fence` (the holder's), `result` | in progress: `max(lease, TTL)` after the take, pushed out by lease extensions; completed: the TTL after completion |
//! | `lease` | string | the holder's fence | `PX` the lease; deleted on completion and release |
//! | `fence` | string | the last fence handed out (a counter) | never before `rec` |
//!
//! The braces are a Redis Cluster hash tag: the three keys of a record hash to one slot, so
//! one script can touch all of them. A key containing `}` ends the tag early, at the same byte
//! in all three names, so they still share a slot.

use idem_core::{Error, ErrorKind, RequestKey};

/// The key prefix unless configured otherwise.
pub const DEFAULT_KEY_PREFIX: &str = "idem:req";

/// The three key names of one record.
#[derive(Debug)]
pub(crate) struct RecordKeys {
    pub(crate) record: String,
    pub(crate) lease: String,
    pub(crate) fence: String,
}

impl RecordKeys {
    pub(crate) fn new(prefix: &str, key: &RequestKey) -> Self {
        let k = key.key.as_str();
        // Into the key's own buffer: this runs on every request.
        let mut base = String::with_capacity(prefix.len() + k.len() + 72);
        base.push_str(prefix);
        base.push_str(":{");
        idem_core::hex::push(&mut base, key.scope.as_bytes());
        base.push(':');
        base.push_str(k);
        base.push_str("}:");
        Self {
            record: format!("{base}rec"),
            lease: format!("{base}lease"),
            fence: format!("{base}fence"),
        }
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
            assert_eq!(hash_tag(&k.lease), tag, "{key}");
            assert_eq!(hash_tag(&k.fence), tag, "{key}");
            assert!(tag.starts_with(&RequestScope::new(["alice", "POST", "/charges"]).to_hex()));
        }
        let k = keys("k-1");
        let scope = RequestScope::new(["alice", "POST", "/charges"]).to_hex();
        assert_eq!(k.record, format!("idem:req:{{{scope}:k-1}}:rec"));
        assert_eq!(k.lease, format!("idem:req:{{{scope}:k-1}}:lease"));
        assert_eq!(k.fence, format!("idem:req:{{{scope}:k-1}}:fence"));
    }

    #[test]
    fn names_of_different_records_never_collide() {
        // A key that spells another record's suffix still gets names of its own.
        let a = keys("x");
        let b = keys("x}:lease");
        for name in [&b.record, &b.lease, &b.fence] {
            assert!(![&a.record, &a.lease, &a.fence].contains(&name), "{name}");
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
