//! The command line: `payments [serve flags]`, `payments publish`, `payments bench` (and the
//! hidden `teardown` for tests).

use std::net::SocketAddr;

use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "payments",
    version,
    about,
    args_conflicts_with_subcommands = true
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Option<Command>,
    #[command(flatten)]
    pub(crate) serve: ServeArgs,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Publish one PaymentRequested message with a stable ID (for trying the service out).
    Publish(PublishArgs),
    /// Delete the broker-side objects for --source (streams, queues, topics, sessions): for
    /// tests and benches on shared brokers.
    #[command(hide = true)]
    Teardown(TeardownArgs),
    /// Measure broker-to-committed-effect throughput next to the broker's own consume-and-ack
    /// rate, in one run.
    Bench(BenchArgs),
}

#[derive(Debug, Args)]
pub(crate) struct TeardownArgs {
    #[command(flatten)]
    pub(crate) endpoint: Endpoint,
    #[arg(long, default_value = "payments")]
    pub(crate) consumer: String,
    #[arg(long)]
    pub(crate) instance: Option<String>,
}

#[derive(Args)]
pub(crate) struct BenchArgs {
    #[command(flatten)]
    pub(crate) endpoint: Endpoint,
    /// Database URL for the idem leg.
    #[arg(long, value_name = "URL", default_value = "sqlite:payments-bench.db")]
    pub(crate) database: String,
    /// Backlog size per leg.
    #[arg(long, default_value_t = 20_000)]
    pub(crate) messages: usize,
    /// Messages processed at once in the idem leg.
    #[arg(long, default_value_t = 8)]
    pub(crate) concurrency: usize,
    /// Messages per transaction in the idem leg.
    #[arg(long, default_value_t = 1)]
    pub(crate) batch: usize,
    /// Charge each batch with the set handler (two statements per batch).
    #[arg(long)]
    pub(crate) set: bool,
    /// Print one Markdown table row.
    #[arg(long)]
    pub(crate) markdown: bool,
    /// Also print each leg's CPU time per message of this process, the broker's server and
    /// this process's PostgreSQL backends (read from Linux's /proc), as Markdown rows.
    #[arg(long)]
    pub(crate) cpu_split: bool,
}

#[derive(Args)]
pub(crate) struct Endpoint {
    /// Broker URL: nats://, amqp://, kafka://host:port, redis://, mqtt://
    #[arg(long, value_name = "URL")]
    pub(crate) broker: Option<String>,
    /// Stream (NATS, Redis), queue (RabbitMQ) or topic (Kafka, MQTT) to consume from.
    #[arg(long, value_name = "NAME", default_value = "payments")]
    pub(crate) source: String,
}

#[derive(Args)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    pub(crate) endpoint: Endpoint,
    /// Database URL: sqlite:PATH, postgres://…, mysql://…
    #[arg(long, value_name = "URL", default_value = "sqlite:payments.db")]
    pub(crate) database: String,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long, value_name = "ADDR")]
    pub(crate) metrics: Option<SocketAddr>,
    /// Consumer name: the claim namespace, consumer group and durable name.
    #[arg(long, default_value = "payments")]
    pub(crate) consumer: String,
    /// This instance's name, where the broker needs one per process (Redis Streams consumer,
    /// MQTT client ID, Kafka static member ID): unique per replica, the same across restarts
    /// of one replica (a StatefulSet pod name, say). Defaults to the host name.
    #[arg(long)]
    pub(crate) instance: Option<String>,
    /// Kafka: join the consumer group as a dynamic member instead of the static member
    /// `--instance`. A static member restarted within the session timeout (`--redeliver-after`,
    /// else 45 s) takes its partitions back without rebalancing the others, but one that stops
    /// for good leaves its partitions idle that long. Use this where instance names are not
    /// unique per replica, or replicas come and go more often than they restart.
    #[arg(long)]
    pub(crate) dynamic_membership: bool,
    /// Keep claims this long (e.g. 7d, 36h); must outlast the broker's redelivery window.
    #[arg(long, value_name = "DURATION", default_value = "7d", value_parser = parse_duration)]
    pub(crate) keep_claims_for: std::time::Duration,
    /// The broker's longest redelivery window: how late a redelivery can arrive.
    #[arg(long, value_name = "DURATION", default_value = "7d", value_parser = parse_duration)]
    pub(crate) redelivery_window: std::time::Duration,
    /// Messages processed at once.
    #[arg(long, default_value_t = 4)]
    pub(crate) concurrency: usize,
    /// Messages per transaction, where the broker hands out batches (1 = one per transaction).
    #[arg(long, default_value_t = 1)]
    pub(crate) batch: usize,
    /// Charge each batch with the set handler: every charge row in one insert and every
    /// balance in one upsert, instead of two statements per message. A batch that fails is
    /// processed again message by message, so one bad payment is dead-lettered alone.
    #[arg(long)]
    pub(crate) set: bool,
    /// Answer redeliveries of payments this process committed from a local cache of up to N
    /// message IDs (with their fingerprints), without a round trip to the database; entries
    /// live as long as claims are kept at most. Only this process's commits are in it.
    #[arg(long, value_name = "N")]
    pub(crate) local_cache: Option<u64>,
    /// How soon a message a dead consumer held goes to another one: NATS's ack wait, the idle
    /// time after which Redis Streams entries are claimed, Kafka's session timeout. RabbitMQ
    /// and MQTT redeliver as soon as the connection drops. Unset: the broker's default.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub(crate) redeliver_after: Option<std::time::Duration>,
    /// With each charge, write a `PaymentCharged` event (`payment_id`, `account`,
    /// `amount_cents`) into the outbox, in the charge's transaction, and relay it to the
    /// destination NAME on the same broker (a NATS subject in a stream of that name, a RabbitMQ
    /// queue, a Kafka topic, a Redis stream, an MQTT topic).
    #[arg(long, value_name = "NAME", conflicts_with = "receipts")]
    pub(crate) emit: Option<String>,
    /// With --emit: write the events into the outbox only, and leave relaying them to
    /// separate `idem relay` processes over the same database.
    #[arg(long, requires = "emit")]
    pub(crate) no_relay: bool,
    /// Be the second hop instead: consume the `PaymentCharged` events a `--emit` service
    /// relays (name their destination with --source) and record one row per event in a
    /// `receipts` table, exactly once. Give it its own --consumer name.
    #[arg(long)]
    pub(crate) receipts: bool,
    /// Charge a card processor for each payment: `POST URL/v1/charges` with an
    /// `Idempotency-Key` derived from the message ID, as a foreign phase, then the charge row
    /// with the processor's `id`, as a local one (recovery points: a crash between them is
    /// resumed by the redelivery or the in-process completer, and the processor charges once).
    /// One message per operation: not with --batch above 1, --set, --emit or --receipts.
    #[arg(long, value_name = "URL", conflicts_with_all = ["set", "emit", "receipts"])]
    pub(crate) card_processor: Option<String>,
    /// With --card-processor: how long a running charge's record is held without renewal. A
    /// redelivery of a charge whose process died takes it over this long after the death; a
    /// live one renews it every third of this.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration, requires = "card_processor")]
    pub(crate) phase_lease: std::time::Duration,
    /// Tests only: with --card-processor, wait this long after the processor answered and
    /// before the charge's next recovery point commits, on a charge's first execution.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, requires = "card_processor", hide = true)]
    pub(crate) test_pause_after_charge: Option<std::time::Duration>,
}

#[derive(Debug, Args)]
pub(crate) struct PublishArgs {
    #[command(flatten)]
    pub(crate) endpoint: Endpoint,
    /// The message ID. Publishing the same ID twice is a redelivery, not a second charge.
    #[arg(long)]
    pub(crate) id: String,
    /// The JSON body, e.g. '{"account":"alice","amount_cents":1250}'.
    pub(crate) payload: String,
}

/// The broker URL may hold a password or a token: shown through [`idem_redact::redact_url`].
impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field(
                "broker",
                &self.broker.as_deref().map(idem_redact::redact_url),
            )
            .field("source", &self.source)
            .finish()
    }
}

/// The database URL may hold a password: shown through [`idem_redact::redact_url`].
impl std::fmt::Debug for BenchArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BenchArgs")
            .field("endpoint", &self.endpoint)
            .field("database", &idem_redact::redact_url(&self.database))
            .field("messages", &self.messages)
            .field("concurrency", &self.concurrency)
            .field("batch", &self.batch)
            .field("set", &self.set)
            .field("markdown", &self.markdown)
            .finish()
    }
}

/// The database URL may hold a password: shown through [`idem_redact::redact_url`].
impl std::fmt::Debug for ServeArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeArgs")
            .field("endpoint", &self.endpoint)
            .field("database", &idem_redact::redact_url(&self.database))
            .field("metrics", &self.metrics)
            .field("consumer", &self.consumer)
            .field("instance", &self.instance)
            .field("keep_claims_for", &self.keep_claims_for)
            .field("redelivery_window", &self.redelivery_window)
            .field("concurrency", &self.concurrency)
            .field("batch", &self.batch)
            .field("set", &self.set)
            .field("redeliver_after", &self.redeliver_after)
            .field("emit", &self.emit)
            .field("no_relay", &self.no_relay)
            .field("receipts", &self.receipts)
            .field(
                "card_processor",
                &self.card_processor.as_deref().map(idem_redact::redact_url),
            )
            .field("phase_lease", &self.phase_lease)
            .field("dynamic_membership", &self.dynamic_membership)
            .finish()
    }
}

pub(crate) fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    idem_core::parse_duration(s).map_err(|e| e.to_string())
}

/// The host name, the default instance name.
pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "payments-1".to_owned())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{Cli, Command};

    #[test]
    fn debug_hides_the_passwords_in_urls() {
        let cli = Cli::parse_from([
            "payments",
            "--broker",
            "amqp://app:hunter2-broker@mq:5672/%2f",
            "--database",
            "postgres://app:hunter2-db@db/pay",
        ]);
        let shown = format!("{cli:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("app:***@mq"), "{shown}");
        let cli = Cli::parse_from([
            "payments",
            "bench",
            "--broker",
            "nats://hunter2-token@127.0.0.1:4222",
            "--database",
            "mysql://root:hunter2-db@127.0.0.1/test",
        ]);
        assert!(matches!(cli.command, Some(Command::Bench(_))));
        let shown = format!("{cli:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
    }
}
