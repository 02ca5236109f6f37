//! idem adapter (in progress).
