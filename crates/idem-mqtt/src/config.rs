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
        let endpoint = Endpoint::parse(url).map_err(error::invalid)?;
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

impl Endpoint {
    pub(crate) fn parse(url: &str) -> Result<Self, String> {
        // Errors quote the URL, which may hold the password.
        let shown = || idem_core::redact_url(url);
        let rest = url
            .strip_prefix("mqtt://")
            .or_else(|| url.strip_prefix("tcp://"))
            .ok_or_else(|| {
                format!("unsupported MQTT URL {:?}: expected mqtt://[user[:password]@]host[:port] (TLS, mqtts://, is not supported yet)", shown())
            })?;
        let rest = rest.trim_end_matches('/');
        let (credentials, hostport) = match rest.rsplit_once('@') {
            Some((cred, hp)) => {
                let (u, p) = cred.split_once(':').unwrap_or((cred, ""));
                (Some((u.to_owned(), p.to_owned())), hp)
            }
            None => (None, rest),
        };
        let (host, port) = match hostport.strip_prefix('[') {
            // [IPv6]:port
            Some(v6) => {
                let (h, after) = v6
                    .split_once(']')
                    .ok_or_else(|| format!("unclosed [ in MQTT URL {:?}", shown()))?;
                (h, after.strip_prefix(':'))
            }
            None => match hostport.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (hostport, None),
            },
        };
        let port = match port {
            Some(p) => p
                .parse::<u16>()
                .map_err(|_| format!("invalid port in MQTT URL {:?}", shown()))?,
            None => 1883,
        };
        if host.is_empty() {
            return Err(format!("no host in MQTT URL {:?}", shown()));
        }
        Ok(Self {
            host: host.to_owned(),
            port,
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
}
