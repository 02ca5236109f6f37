//! Where a source's dead letters go on each broker: named here once, so the service that
//! creates them and the tools that read them (idem-chaos, tests) agree.

use crate::Broker;

/// The destination `source`'s dead letters are published to: the NATS subject
/// `NAME.dead-letter` (captured by the stream [`nats_dead_letter_stream`]), the AMQP queue
/// `NAME.dead` (through the exchange `NAME.dlx`), the Kafka topic `NAME.dead-letter`, the Redis
/// stream `NAME:dead-letter`, the MQTT topic `NAME/dead-letter`.
///
/// ```
/// use idem_any::{Broker, dead_letters};
///
/// assert_eq!(dead_letters(Broker::Kafka, "payments"), "payments.dead-letter");
/// assert_eq!(dead_letters(Broker::Mqtt, "payments"), "payments/dead-letter");
/// ```
pub fn dead_letters(broker: Broker, source: &str) -> String {
    match broker {
        Broker::Nats | Broker::Kafka => format!("{source}.dead-letter"),
        Broker::Amqp => format!("{source}.dead"),
        Broker::RedisStreams => format!("{source}:dead-letter"),
        Broker::Mqtt => format!("{source}/dead-letter"),
    }
}

/// The JetStream stream that keeps `source`'s dead letters (`NAME-dead-letter`: stream names
/// cannot hold `.`).
pub fn nats_dead_letter_stream(source: &str) -> String {
    format!("{source}-dead-letter")
}

/// The client ID of the MQTT session that keeps `consumer`'s dead letters: a broker keeps
/// nothing for a topic nobody subscribes to.
pub fn mqtt_dead_letter_keeper(consumer: &str) -> String {
    format!("{consumer}-dead-letters")
}

#[cfg(all(test, feature = "amqp", feature = "redis-streams"))]
mod tests {
    use super::*;

    /// The names above are the adapters' own defaults where they have one.
    #[test]
    fn agree_with_the_adapters_defaults() {
        assert_eq!(
            dead_letters(Broker::Amqp, "pay"),
            idem_amqp::Topology::new("pay").dead_letter_queue_name()
        );
        assert_eq!(
            dead_letters(Broker::RedisStreams, "pay"),
            format!("pay{}", idem_redis_streams::DEAD_LETTER_SUFFIX)
        );
    }
}
