//! What a store provides, beyond a [`RecoveryFixture`], to run the completer conformance
//! suite.

use crate::recovery_fixture::RecoveryFixture;

/// A [`RecoveryFixture`] that can also hand out a store the server refuses, for the checks
/// that a refusing store is an outage the completer waits out, never an operation's failure.
pub trait CompleterFixture: RecoveryFixture {
    /// A store on the fixture's server whose requests table does not exist (the SQL stores:
    /// the fixture's store `with_requests_table` of a name never migrated), so every
    /// statement on it fails.
    fn refusing_store(&self) -> Self::Store;
}
