//! idem-bench's integration tests as one binary: the prune scenario, test-sized, against the
//! real PostgreSQL (`prune`).

mod prune;
