//! Creating (and, for tests, deleting) the topics a source reads from and keeps its dead
//! letters in, through librdkafka's admin API.

use std::time::Duration;

use idem_core::{Error, ErrorKind};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::types::RDKafkaErrorCode;

use crate::error;

/// How long the cluster may take to create or delete topics.
const OPERATION_TIMEOUT: Duration = Duration::from_secs(10);

fn admin(brokers: &str) -> Result<AdminClient<DefaultClientContext>, Error> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .map_err(|e| error::invalid_config("creating the admin client", e))
}

/// Creates each of `topics` that does not exist on the cluster at `brokers`
/// (`host:port[,host:port…]`) with `partitions` partitions and `replication` replicas;
/// existing topics are left as they are, whatever their layout. For other settings
/// (retention, compaction, a secured cluster) use rdkafka's
/// [`AdminClient`](rdkafka::admin::AdminClient).
///
/// ```no_run
/// # async fn demo() -> Result<(), idem_core::Error> {
/// // A topic and its dead-letter topic (the source's default name), one partition each.
/// idem_kafka::ensure_topics("localhost:9092", &["payments", "payments.dead-letter"], 1, 1).await?;
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] when the cluster refuses a topic (bad name, more replicas than
/// brokers); [`ErrorKind::Unavailable`] when it cannot be reached in time.
pub async fn ensure_topics(
    brokers: &str,
    topics: &[&str],
    partitions: i32,
    replication: i32,
) -> Result<(), Error> {
    let admin = admin(brokers)?;
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|t| NewTopic::new(t, partitions, TopicReplication::Fixed(replication)))
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(OPERATION_TIMEOUT));
    let results = admin
        .create_topics(&new, &options)
        .await
        .map_err(|e| error::unavailable("creating topics", e))?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => {
                return Err(refused(format_args!("creating topic {topic}"), code));
            }
        }
    }
    Ok(())
}

/// Deletes `topics`, with their records, from the cluster at `brokers`; a topic that does not
/// exist is fine. For tests and teardown scripts, never part of a service's life.
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] when the cluster refuses (topic deletion disabled);
/// [`ErrorKind::Unavailable`] when it cannot be reached in time.
pub async fn delete_topics(brokers: &str, topics: &[&str]) -> Result<(), Error> {
    let admin = admin(brokers)?;
    let options = AdminOptions::new().operation_timeout(Some(OPERATION_TIMEOUT));
    let results = admin
        .delete_topics(topics, &options)
        .await
        .map_err(|e| error::unavailable("deleting topics", e))?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::UnknownTopicOrPartition)) => {}
            Err((topic, code)) => {
                return Err(refused(format_args!("deleting topic {topic}"), code));
            }
        }
    }
    Ok(())
}

/// A per-topic answer of the cluster: a timeout or a cluster without a controller may pass,
/// anything else is the request itself.
fn refused(what: std::fmt::Arguments<'_>, code: RDKafkaErrorCode) -> Error {
    let kind = match code {
        RDKafkaErrorCode::RequestTimedOut
        | RDKafkaErrorCode::OperationTimedOut
        | RDKafkaErrorCode::NotController
        | RDKafkaErrorCode::BrokerNotAvailable
        | RDKafkaErrorCode::LeaderNotAvailable => ErrorKind::Unavailable,
        _ => ErrorKind::InvalidConfig,
    };
    Error::from_system(kind, "Kafka", what, code)
}
