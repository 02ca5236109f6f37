//! The idem-amqp integration tests as one binary (one link, not one per file): the adapter
//! against a real RabbitMQ (`amqp`) and the broker conformance suite (`conformance`), over the
//! fixtures in `common`.

mod amqp;
mod common;
mod conformance;
