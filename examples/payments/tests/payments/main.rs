//! The payments example's integration tests as one binary: the service as its README runs it,
//! against each real broker (`payments`), and `--card-processor` against the fake card
//! processor (`card`), and the bench's bare consumer (`bench`).

mod bench;
mod card;
mod payments;
