//! The http-payments example's integration tests as one binary (one link, not one per file):
//! the README's session on every store (`flows`), crashes and takeovers (`crash`) and
//! `--emit`'s events through the outbox to a broker (`emit`), `--card-processor` against
//! the fake card processor (`processor`), idem-client's retries behind a proxy that loses
//! answers after the commit (`lost_answers`), each
//! against the real binary as a child process, over the helpers in `util`.
//!
//! The tests share this process: each has a database (or key prefix) of its own from
//! `idem_testkit::unique_name`, distinct within a process, and its own server on a free
//! loopback port, killed when the test ends; none sets anything process-wide.

mod crash;
mod emit;
mod flows;
mod lost_answers;
mod processor;
mod util;
