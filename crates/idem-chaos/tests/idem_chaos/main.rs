//! idem-chaos's integration tests as one binary: the bounded chaos runs CI makes (`chaos`).

mod chaos;
