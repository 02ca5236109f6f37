//! Broker conformance suite (being written).
