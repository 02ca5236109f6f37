//! Connection URLs and client settings without their secrets: what every idem crate and binary
//! calls before a database or broker URL ([`redact_url`]) or a client setting such as
//! librdkafka's `sasl.password` ([`redact_setting`]) reaches a log line, an error message or a
//! `Debug` output. One list of secret names serves both.
//!
//! Apart from `idem-core` so that the pattern's vocabulary keeps no URL parser: only what
//! connects to something (stores, broker adapters, the binaries) depends on this crate.
//!
//! ```
//! use idem_redact::redact_url;
//!
//! assert_eq!(redact_url("amqp://app:hunter2@mq:5672/%2f"), "amqp://app:***@mq:5672/%2f");
//! ```

mod redact;
mod setting;

pub use redact::redact_url;
pub use setting::redact_setting;
