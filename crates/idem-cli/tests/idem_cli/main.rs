//! The `idem` binary's integration tests as one binary (one link, not one per file): the admin
//! commands on every SQL store (`admin`), the demo (`demo`) and URLs in its errors
//! (`redaction`), `idem relay` (`relay`), `idem complete` (`complete`).

mod admin;
mod complete;
mod demo;
mod redaction;
mod relay;
