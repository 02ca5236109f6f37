//! A broker chosen at run time from a URL: the one place that maps `--broker` URL schemes to
//! idem's adapters, for services and tools that take a broker URL (the payments example,
//! idem-chaos), as `idem_sql::AnyStore` does for stores.
//!
//! - [`BrokerUrl::parse`] reads the scheme (`nats://`, `amqp://`, `kafka://host:port`,
//!   `redis://`, `mqtt://`; see [`SCHEMES`]) and refuses anything else with
//!   [`ErrorKind::InvalidConfig`](idem_core::ErrorKind::InvalidConfig), showing the URL only
//!   through [`idem_redact::redact_url`].
//! - [`BrokerUrl::with_source`] creates what a consumer needs on the broker and hands the
//!   family's [`Source`](idem_consumer::Source) to a [`WithSource`] job (`Source` is generic, so
//!   the job is called back rather than returned a boxed source).
//! - [`AnyProducer`] publishes with the message ID where that family's consumers read it,
//!   and headers where they read headers ([`AnyProducer::publish_with_headers`]).
//! - [`dead_letters`] names where a source's dead letters go, for the tools that read them.
//!
//! One cargo feature per adapter (`nats`, `amqp`, `kafka`, `redis-streams`, `mqtt`; all on by
//! default), so a build without Kafka does not compile librdkafka.
//!
//! ```no_run
//! use idem_any::{BrokerUrl, SourceSpec, WithSource};
//! use idem_consumer::Source;
//!
//! struct Name;
//! impl WithSource for Name {
//!     type Output = &'static str;
//!     async fn run<S: Source>(self, source: S) -> &'static str {
//!         source.broker()
//!     }
//! }
//!
//! # async fn demo() -> Result<(), idem_core::Error> {
//! let url = BrokerUrl::parse("nats://127.0.0.1:4222")?;
//! let spec = SourceSpec::new("payments", "billing", "billing-1");
//! assert_eq!(url.with_source(&spec, Name).await?, "nats");
//! # Ok(())
//! # }
//! ```

mod headers;
mod names;
#[cfg(feature = "nats")]
mod nats;
mod producer;
mod source;
mod url;

pub use names::{dead_letters, mqtt_dead_letter_keeper, nats_dead_letter_stream};
#[cfg(feature = "nats")]
pub use nats::connect as connect_nats;
pub use producer::{AnyProducer, Published};
pub use source::{SourceSpec, WithSource};
pub use url::{Broker, BrokerUrl, SCHEMES};

/// A family whose feature is off: [`BrokerUrl::parse`] refuses its URLs, so only a
/// hand-made value reaches this.
#[allow(dead_code)] // Used only when a feature is off.
fn not_compiled(broker: Broker) -> idem_core::Error {
    idem_core::Error::new(
        idem_core::ErrorKind::InvalidConfig,
        format!(
            "this build has no {} adapter (idem-any's `{}` feature)",
            broker.name(),
            broker.feature()
        ),
    )
}
