//! One face over rumqttc's two clients (v5 and 3.1.1), reduced to what the adapter needs, so
//! the connection driver, the delivery and the publisher are written once.

use std::borrow::Cow;

use bytes::Bytes;
use idem_core::{Error, ErrorKind};
use rumqttc::v5;
use rumqttc::v5::mqttbytes::QoS as Qos5;
use rumqttc::v5::mqttbytes::v5 as p5;
use rumqttc::{Outgoing, QoS};

use crate::config::{Config, Protocol};
use crate::error::unavailable;

/// A received PUBLISH packet.
#[derive(Debug, Clone)]
pub(crate) enum Msg {
    V5(p5::Publish),
    V311(rumqttc::Publish),
}

impl Msg {
    pub(crate) fn payload(&self) -> &[u8] {
        match self {
            Msg::V5(p) => &p.payload,
            Msg::V311(p) => &p.payload,
        }
    }

    pub(crate) fn topic(&self) -> String {
        self.topic_str().into_owned()
    }

    /// The topic without a copy (a v5 topic is bytes; one that is not UTF-8 shows lossily).
    pub(crate) fn topic_str(&self) -> Cow<'_, str> {
        match self {
            Msg::V5(p) => String::from_utf8_lossy(&p.topic),
            Msg::V311(p) => Cow::Borrowed(&p.topic),
        }
    }

    pub(crate) fn pkid(&self) -> u16 {
        match self {
            Msg::V5(p) => p.pkid,
            Msg::V311(p) => p.pkid,
        }
    }

    pub(crate) fn dup(&self) -> bool {
        match self {
            Msg::V5(p) => p.dup,
            Msg::V311(p) => p.dup,
        }
    }

    pub(crate) fn user_properties(&self) -> &[(String, String)] {
        match self {
            Msg::V5(p) => p.properties.as_ref().map_or(&[], |p| &p.user_properties),
            Msg::V311(_) => &[],
        }
    }

    /// The properties worth keeping on a dead-lettered copy: not the topic alias or
    /// subscription identifiers (meaningless elsewhere), not the expiry (a dead letter must not
    /// vanish on its own).
    pub(crate) fn forwarded_properties(&self) -> p5::PublishProperties {
        match self {
            Msg::V5(p) => match &p.properties {
                Some(props) => p5::PublishProperties {
                    payload_format_indicator: props.payload_format_indicator,
                    response_topic: props.response_topic.clone(),
                    correlation_data: props.correlation_data.clone(),
                    user_properties: props.user_properties.clone(),
                    content_type: props.content_type.clone(),
                    ..Default::default()
                },
                None => p5::PublishProperties::default(),
            },
            Msg::V311(_) => p5::PublishProperties::default(),
        }
    }
}

/// The request side of a connection (cheap to clone).
#[derive(Debug, Clone)]
pub(crate) enum Client {
    V5(v5::AsyncClient),
    V311(rumqttc::AsyncClient),
}

/// The polled side of a connection.
pub(crate) enum Loop {
    V5(Box<v5::EventLoop>),
    V311(Box<rumqttc::EventLoop>),
}

impl std::fmt::Debug for Loop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Loop::V5(_) => "Loop::V5",
            Loop::V311(_) => "Loop::V311",
        })
    }
}

/// A connection's client and event loop; `persistent` picks a resumable session.
pub(crate) fn open(config: &Config, client_id: &str, persistent: bool) -> (Client, Loop) {
    let cap = usize::from(config.options.max_in_flight) + 16;
    match config.options.protocol {
        Protocol::V5 => {
            let (c, l) = v5::AsyncClient::new(config.v5_options(client_id, persistent), cap);
            (Client::V5(c), Loop::V5(Box::new(l)))
        }
        Protocol::V311 => {
            let (c, l) = rumqttc::AsyncClient::new(config.v311_options(client_id, persistent), cap);
            (Client::V311(c), Loop::V311(Box::new(l)))
        }
    }
}

/// How the broker answered a QoS 1 publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PubAckOutcome {
    Accepted,
    /// v5 only: accepted, but nobody subscribes to the topic, so the broker dropped it.
    NoSubscribers,
    Refused(String),
}

/// An event of interest, translated from either protocol.
#[derive(Debug)]
pub(crate) enum Polled {
    ConnAck {
        session_present: bool,
    },
    /// `Err` names the refusal.
    SubAck(Result<(), String>),
    Publish(Msg),
    /// Our publish went out with this packet ID.
    Sent(u16),
    PubAck {
        pkid: u16,
        outcome: PubAckOutcome,
    },
    /// Our DISCONNECT went out: the connection is closed on purpose.
    Disconnected,
    Other,
}

impl Loop {
    /// Polls once; rumqttc reconnects on the poll after an error.
    pub(crate) async fn poll(&mut self) -> Result<Polled, Error> {
        match self {
            Loop::V5(l) => {
                use v5::Event;
                use v5::mqttbytes::v5::Packet;
                Ok(
                    match l.poll().await.map_err(|e| unavailable("connection", e))? {
                        Event::Incoming(Packet::ConnAck(a)) => Polled::ConnAck {
                            session_present: a.session_present,
                        },
                        Event::Incoming(Packet::SubAck(a)) => Polled::SubAck(
                            match a
                                .return_codes
                                .iter()
                                .find(|c| !matches!(c, p5::SubscribeReasonCode::Success(_)))
                            {
                                None => Ok(()),
                                Some(code) => Err(format!("{code:?}")),
                            },
                        ),
                        Event::Incoming(Packet::Publish(p)) => Polled::Publish(Msg::V5(p)),
                        Event::Incoming(Packet::PubAck(a)) => Polled::PubAck {
                            pkid: a.pkid,
                            outcome: match a.reason {
                                p5::PubAckReason::Success => PubAckOutcome::Accepted,
                                p5::PubAckReason::NoMatchingSubscribers => {
                                    PubAckOutcome::NoSubscribers
                                }
                                other => PubAckOutcome::Refused(format!(
                                    "{other:?}{}",
                                    a.properties
                                        .and_then(|p| p.reason_string)
                                        .map(|r| format!(": {r}"))
                                        .unwrap_or_default()
                                )),
                            },
                        },
                        Event::Outgoing(Outgoing::Publish(pkid)) => Polled::Sent(pkid),
                        Event::Outgoing(Outgoing::Disconnect) => Polled::Disconnected,
                        _ => Polled::Other,
                    },
                )
            }
            Loop::V311(l) => {
                use rumqttc::{Event, Packet};
                Ok(
                    match l.poll().await.map_err(|e| unavailable("connection", e))? {
                        Event::Incoming(Packet::ConnAck(a)) => Polled::ConnAck {
                            session_present: a.session_present,
                        },
                        Event::Incoming(Packet::SubAck(a)) => Polled::SubAck(
                            if a.return_codes
                                .iter()
                                .all(|c| matches!(c, rumqttc::SubscribeReasonCode::Success(_)))
                            {
                                Ok(())
                            } else {
                                Err("Failure".to_owned())
                            },
                        ),
                        Event::Incoming(Packet::Publish(p)) => Polled::Publish(Msg::V311(p)),
                        Event::Incoming(Packet::PubAck(a)) => Polled::PubAck {
                            pkid: a.pkid,
                            outcome: PubAckOutcome::Accepted,
                        },
                        Event::Outgoing(Outgoing::Publish(pkid)) => Polled::Sent(pkid),
                        Event::Outgoing(Outgoing::Disconnect) => Polled::Disconnected,
                        _ => Polled::Other,
                    },
                )
            }
        }
    }

    /// Drops the network connection; the next poll reconnects and, the session being
    /// persistent, the broker resends every unacknowledged message.
    pub(crate) fn drop_connection(&mut self) {
        match self {
            Loop::V5(l) => l.clean(),
            Loop::V311(l) => l.clean(),
        }
    }
}

impl Client {
    pub(crate) async fn subscribe(&self, filter: &str) -> Result<(), Error> {
        let what = "subscribing";
        match self {
            Client::V5(c) => c
                .subscribe(filter, Qos5::AtLeastOnce)
                .await
                .map_err(|e| unavailable(what, e)),
            Client::V311(c) => c
                .subscribe(filter, QoS::AtLeastOnce)
                .await
                .map_err(|e| unavailable(what, e)),
        }
    }

    /// Sends the PUBACK for `msg` (nothing for QoS 0, which has none).
    pub(crate) async fn ack(&self, msg: &Msg) -> Result<(), Error> {
        let what = "acknowledging (the connection is gone; the broker redelivers)";
        match (self, msg) {
            (Client::V5(c), Msg::V5(p)) => c.ack(p).await.map_err(|e| unavailable(what, e)),
            (Client::V311(c), Msg::V311(p)) => c.ack(p).await.map_err(|e| unavailable(what, e)),
            _ => Err(Error::new(
                ErrorKind::InvalidConfig,
                "protocol mismatch between the MQTT client and the message",
            )),
        }
    }

    /// Queues a QoS 1 publish; `properties` are dropped on 3.1.1, which has none.
    pub(crate) async fn publish(
        &self,
        topic: &str,
        payload: Bytes,
        properties: p5::PublishProperties,
    ) -> Result<(), Error> {
        let what = "publishing";
        match self {
            Client::V5(c) => c
                .publish_with_properties(topic, Qos5::AtLeastOnce, false, payload, properties)
                .await
                .map_err(|e| unavailable(what, e)),
            Client::V311(c) => c
                .publish(topic, QoS::AtLeastOnce, false, payload.to_vec())
                .await
                .map_err(|e| unavailable(what, e)),
        }
    }

    pub(crate) async fn disconnect(&self) -> Result<(), Error> {
        let what = "disconnecting";
        match self {
            Client::V5(c) => c.disconnect().await.map_err(|e| unavailable(what, e)),
            Client::V311(c) => c.disconnect().await.map_err(|e| unavailable(what, e)),
        }
    }
}
