//! Connection settings, the broker URL, and how they become rumqttc options.

use std::time::Duration;

use idem_core::Error;
use rumqttc::v5;

use crate::error;

/// The MQTT protocol version spoken to the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Protocol {
    /// MQTT 5: user properties carry the message ID and the dead-letter reason.
    #[default]
    V5,
    /// MQTT 3.1.1: no properties, so the ID is read from the JSON payload and dead letters are
    /// JSON envelopes.
    V311,
}

/// Connection settings shared by a source, its dead-letter publisher and a producer.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    pub(crate) protocol: Protocol,
    pub(crate) session_expiry: Duration,
    pub(crate) max_in_flight: u16,
    pub(crate) keep_alive: Duration,
    pub(crate) publish_timeout: Duration,
    /// Whether a v5 PUBACK saying "no matching subscribers" fails a publish.
    pub(crate) require_subscriber: bool,
    pub(crate) max_packet_size: usize,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            protocol: Protocol::V5,
            session_expiry: Duration::from_secs(7 * 24 * 3600),
            max_in_flight: 64,
            keep_alive: Duration::from_secs(30),
            publish_timeout: Duration::from_secs(10),
            require_subscriber: true,
            max_packet_size: 16 * 1024 * 1024,
        }
    }
}

/// Where to connect, and how: what rumqttc's options are made from.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) endpoint: Endpoint,
    pub(crate) options: Options,
}

impl Config {
    /// The broker at `url` (`mqtt://[user[:password]@]host[:port]`, also `tcp://`).
    pub(crate) fn new(url: &str, options: Options) -> Result<Self, Error> {
        let endpoint = Endpoint::parse(url).map_err(|e| error::invalid(e.to_string()))?;
        Ok(Self { endpoint, options })
    }

    pub(crate) fn v5_options(&self, client_id: &str, persistent: bool) -> v5::MqttOptions {
        let options = &self.options;
        let mut o = v5::MqttOptions::new(client_id, &self.endpoint.host, self.endpoint.port);
        o.set_keep_alive(options.keep_alive)
            .set_manual_acks(true)
            .set_clean_start(!persistent)
            .set_max_packet_size(Some(
                u32::try_from(options.max_packet_size).unwrap_or(u32::MAX),
            ))
            // rumqttc preallocates one slot per possible outgoing packet ID; a consumer publishes
            // nothing and the publisher one message at a time.
            .set_outgoing_inflight_upper_limit(16)
            .set_request_channel_capacity(usize::from(options.max_in_flight) + 16);
        if persistent {
            let secs = u32::try_from(options.session_expiry.as_secs()).unwrap_or(u32::MAX);
            o.set_session_expiry_interval(Some(secs.max(1)))
                .set_receive_maximum(Some(options.max_in_flight));
        }
        if let Some((u, p)) = &self.endpoint.credentials {
            o.set_credentials(u, p);
        }
        o
    }

    pub(crate) fn v311_options(&self, client_id: &str, persistent: bool) -> rumqttc::MqttOptions {
        let options = &self.options;
        let mut o = rumqttc::MqttOptions::new(client_id, &self.endpoint.host, self.endpoint.port);
        o.set_keep_alive(options.keep_alive)
            .set_manual_acks(true)
            .set_clean_session(!persistent)
            .set_max_packet_size(options.max_packet_size, options.max_packet_size)
            .set_inflight(16)
            .set_request_channel_capacity(usize::from(options.max_in_flight) + 16);
        if let Some((u, p)) = &self.endpoint.credentials {
            o.set_credentials(u, p);
        }
        o
    }
}

/// Host, port and credentials from an `mqtt://` URL.
#[derive(Clone)]
pub(crate) struct Endpoint {
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) credentials: Option<(String, String)>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Configs get logged; the password must not be.
        f.debug_struct("Endpoint")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("username", &self.credentials.as_ref().map(|(u, _)| u))
            .finish()
    }
}

/// Why an MQTT URL was refused. Its message quotes the URL through
/// [`idem_redact::redact_url`], so it never shows the password.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum UrlError {
    /// Not a URL at all (or a port out of range).
    #[error("invalid MQTT URL {url:?}: {reason}")]
    Malformed {
        url: String,
        reason: url::ParseError,
    },
    /// A scheme other than `mqtt://` or `tcp://`.
    #[error(
        "unsupported MQTT URL {url:?}: expected mqtt://[user[:password]@]host[:port] (TLS, mqtts://, is not supported yet)"
    )]
    Scheme { url: String },
    /// `mqtt://:1883`, `mqtt:host`.
    #[error("no host in MQTT URL {url:?}")]
    NoHost { url: String },
    /// A path, query or fragment: an MQTT URL names a broker, nothing in it.
    #[error("MQTT URL {url:?} has a path, query or fragment; topics are set on the builder")]
    Extra { url: String },
    /// A user name or password whose percent-encoding is not UTF-8.
    #[error("the user name or password in MQTT URL {url:?} is not UTF-8 once percent-decoded")]
    Encoding { url: String },
}

impl Endpoint {
    /// Parses `mqtt://[user[:password]@]host[:port]` with the `url` crate, percent-decoding the
    /// user name and password (`p%40ss` is the password `p@ss`).
    pub(crate) fn parse(input: &str) -> Result<Self, UrlError> {
        // Errors quote the URL, which may hold the password.
        let url = || idem_redact::redact_url(input);
        let parsed =
            url::Url::parse(input).map_err(|reason| UrlError::Malformed { url: url(), reason })?;
        if !matches!(parsed.scheme(), "mqtt" | "tcp") {
            return Err(UrlError::Scheme { url: url() });
        }
        let host = match parsed.host() {
            // `Host`'s Display brackets an IPv6 address; rumqttc wants it bare.
            Some(url::Host::Ipv6(ip)) => ip.to_string(),
            Some(url::Host::Ipv4(ip)) => ip.to_string(),
            Some(url::Host::Domain(d)) if !d.is_empty() => d.to_owned(),
            _ => return Err(UrlError::NoHost { url: url() }),
        };
        if !matches!(parsed.path(), "" | "/")
            || parsed.query().is_some()
            || parsed.fragment().is_some()
        {
            return Err(UrlError::Extra { url: url() });
        }
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8()
                .map(|s| s.into_owned())
                .map_err(|_| UrlError::Encoding { url: url() })
        };
        let credentials = if parsed.username().is_empty() && parsed.password().is_none() {
            None
        } else {
            let user = decode(parsed.username())?;
            let password = decode(parsed.password().unwrap_or(""))?;
            Some((user, password))
        };
        Ok(Self {
            host,
            port: parsed.port().unwrap_or(1883),
            credentials,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let e = Endpoint::parse("mqtt://u:p@broker:1884").unwrap();
        assert_eq!((e.host.as_str(), e.port), ("broker", 1884));
        assert_eq!(e.credentials, Some(("u".to_owned(), "p".to_owned())));
        let e = Endpoint::parse("tcp://127.0.0.1").unwrap();
        assert_eq!((e.host.as_str(), e.port), ("127.0.0.1", 1883));
        let e = Endpoint::parse("mqtt://[::1]:1884").unwrap();
        assert_eq!((e.host.as_str(), e.port), ("::1", 1884));
        assert!(!format!("{:?}", Endpoint::parse("mqtt://u:secret@h").unwrap()).contains("secret"));
        assert!(Endpoint::parse("http://x").is_err());
        assert!(Endpoint::parse("mqtt://x:notaport").is_err());
    }

    #[test]
    fn credentials_are_percent_decoded() {
        let e = Endpoint::parse("mqtt://user:p%40ss@host:1883").unwrap();
        assert_eq!((e.host.as_str(), e.port), ("host", 1883));
        assert_eq!(e.credentials, Some(("user".to_owned(), "p@ss".to_owned())));
        let e = Endpoint::parse("mqtt://us%3Aer:a%2Fb%3Ac@host/").unwrap();
        assert_eq!(
            e.credentials,
            Some(("us:er".to_owned(), "a/b:c".to_owned()))
        );
        let e = Endpoint::parse("mqtt://user@host").unwrap();
        assert_eq!(e.credentials, Some(("user".to_owned(), String::new())));
        assert_eq!(Endpoint::parse("mqtt://host").unwrap().credentials, None);
    }

    #[test]
    fn bad_urls_are_typed_errors_without_the_password() {
        let err = |u: &str| Endpoint::parse(u).unwrap_err();
        assert!(matches!(
            err("mqtt://u:secret@host:99999"),
            UrlError::Malformed {
                reason: url::ParseError::InvalidPort,
                ..
            }
        ));
        assert!(matches!(
            err("mqtts://u:secret@host"),
            UrlError::Scheme { .. }
        ));
        assert!(matches!(err("host:1883"), UrlError::Scheme { .. }));
        assert!(matches!(err("not a url"), UrlError::Malformed { .. }));
        assert!(matches!(
            err("mqtt://u:secret@:1883"),
            UrlError::Malformed { .. } | UrlError::NoHost { .. }
        ));
        assert!(matches!(err("mqtt:host"), UrlError::NoHost { .. }));
        assert!(matches!(
            err("mqtt://u:secret@host/topic"),
            UrlError::Extra { .. }
        ));
        assert!(matches!(
            err("mqtt://u:%FF@host"),
            UrlError::Encoding { .. }
        ));
        for bad in [
            "mqtt://u:secret@host:99999",
            "mqtts://u:secret@host",
            "mqtt://u:secret@host/t",
        ] {
            let shown = err(bad).to_string();
            assert!(!shown.contains("secret"), "{shown}");
            assert!(shown.contains("MQTT URL"), "{shown}");
        }
        // Through the public path: a configuration error the runner treats as fatal.
        let e = Config::new("mqtts://u:secret@host", Options::default()).unwrap_err();
        assert_eq!(e.kind(), idem_core::ErrorKind::InvalidConfig);
        assert!(!e.to_string().contains("secret"), "{e}");
    }

    #[test]
    fn rustls_finds_ring_for_rumqttc_tls() {
        // rumqttc is built without a crypto provider (no aws-lc-sys); rustls's `ring` feature
        // must make `builder()` find one, or rumqttc's TLS would panic when it is first used.
        let config = rumqttc::tokio_rustls::rustls::ClientConfig::builder()
            .with_root_certificates(rumqttc::tokio_rustls::rustls::RootCertStore::empty())
            .with_no_client_auth();
        assert!(!config.crypto_provider().cipher_suites.is_empty());
    }
}
