//! An outgoing message's headers in each family's own header slot, refused (never dropped)
//! when the family cannot carry them or when one would pose as the message ID.
#![allow(dead_code)] // Each function is used only when its family's feature is on.

use idem_core::{Error, ErrorKind};

fn refuse(family: &str, why: String) -> Error {
    Error::new(
        ErrorKind::InvalidConfig,
        format!("{family} cannot carry this message's headers: {why}"),
    )
}

/// NATS headers; `Nats-Msg-Id` is the ID's (header names are case-insensitive on the wire's
/// readers, so any casing is refused).
#[cfg(feature = "nats")]
pub(crate) fn nats(
    headers: &[(String, String)],
) -> Result<idem_nats::async_nats::HeaderMap, Error> {
    use idem_nats::async_nats::{HeaderMap, HeaderName, HeaderValue};
    let mut map = HeaderMap::new();
    for (name, value) in headers {
        if name.eq_ignore_ascii_case("Nats-Msg-Id") {
            return Err(refuse(
                "NATS",
                "a header named Nats-Msg-Id would replace the message ID".into(),
            ));
        }
        let n: HeaderName = name.parse().map_err(|_| {
            refuse(
                "NATS",
                format!("header name {name:?} must be printable ASCII without ':'"),
            )
        })?;
        let v: HeaderValue = value.parse().map_err(|_| {
            refuse(
                "NATS",
                format!("header {name:?}'s value holds a line break"),
            )
        })?;
        map.append(n, v);
    }
    Ok(map)
}

/// AMQP header-table entries, as long strings (the ID is the `message_id` property, apart).
#[cfg(feature = "amqp")]
pub(crate) fn amqp(
    headers: &[(String, String)],
) -> Result<idem_amqp::lapin::BasicProperties, Error> {
    use idem_amqp::lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
    let properties = idem_amqp::lapin::BasicProperties::default();
    if headers.is_empty() {
        return Ok(properties);
    }
    let mut table = FieldTable::default();
    for (name, value) in headers {
        let key = ShortString::try_new(name.as_str())
            .map_err(|_| refuse("AMQP", format!("header name {name:?} is over 255 bytes")))?;
        table.insert(
            key,
            AMQPValue::LongString(LongString::from(value.as_bytes())),
        );
    }
    Ok(properties.with_headers(table))
}

/// Redis Streams fields next to the `message_id` and `payload` fields (the producer's
/// defaults, which the source reads).
#[cfg(feature = "redis-streams")]
pub(crate) fn redis(headers: &[(String, String)]) -> Result<Vec<(&str, &[u8])>, Error> {
    headers
        .iter()
        .map(|(name, value)| {
            if name == "message_id" || name == "payload" {
                return Err(refuse(
                    "Redis Streams",
                    format!("a field named {name:?} would shadow the message's own"),
                ));
            }
            Ok((name.as_str(), value.as_bytes()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[cfg(feature = "nats")]
    #[test]
    fn nats_headers_keep_names_and_refuse_what_breaks_the_wire_or_the_id() {
        let map = nats(&h(&[("kind", "Created"), ("tenant", "acme")])).unwrap();
        assert_eq!(map.get("kind").map(|v| v.as_str()), Some("Created"));
        assert_eq!(map.get("tenant").map(|v| v.as_str()), Some("acme"));
        for bad in [
            h(&[("nats-msg-id", "x")]),
            h(&[("a:b", "x")]),
            h(&[("a b", "x")]),
            h(&[("kind", "a\r\nb")]),
        ] {
            let e = nats(&bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{bad:?}");
        }
    }

    #[cfg(feature = "amqp")]
    #[test]
    fn amqp_headers_are_long_strings_and_long_names_are_refused() {
        let props = amqp(&h(&[("kind", "Created")])).unwrap();
        let table = props.headers().clone().unwrap();
        let kind = table
            .inner()
            .iter()
            .find(|(k, _)| k.as_str() == "kind")
            .map(|(_, v)| v.clone());
        match kind {
            Some(idem_amqp::lapin::types::AMQPValue::LongString(v)) => {
                assert_eq!(v.as_bytes(), b"Created");
            }
            other => panic!("{other:?}"),
        }
        assert!(amqp(&[]).unwrap().headers().is_none());
        let long = "n".repeat(256);
        let e = amqp(&h(&[(long.as_str(), "x")])).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidConfig);
    }

    #[cfg(feature = "redis-streams")]
    #[test]
    fn redis_fields_may_not_shadow_the_id_or_the_payload() {
        let headers = h(&[("kind", "Created")]);
        assert_eq!(redis(&headers).unwrap(), [("kind", &b"Created"[..])]);
        for name in ["message_id", "payload"] {
            let e = redis(&h(&[(name, "x")])).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidConfig);
        }
    }
}
