//! The store conformance suite: [`conformance_tests!`](crate::conformance_tests) expands to one
//! test per check here. Each check takes a fresh fixture, asserts one property of the pattern
//! against the real store, and tears the fixture down.
//!
//! Effects are counted from the database, never from the handler's own bookkeeping: the point
//! is what committed.
//!
//! The checks live in one module per store capability (the single claim, the shared
//! transaction, the two batch forms, retention, what operators run), so a store that gains or
//! changes one capability has one module to read.

use idem_core::{Message, MessageId, Processor};

use crate::fixture::StoreFixture;

type Msg = Message<Vec<u8>>;

fn msg(id: &str, payload: &str) -> Msg {
    Message::new(
        MessageId::new(id).expect("valid test id"),
        payload.as_bytes().to_vec(),
    )
}

fn processor<F: StoreFixture>(fx: &F, consumer: &str) -> Processor<F::Store> {
    Processor::builder(fx.store(), consumer)
        .build()
        .expect("valid processor")
}

// Before the `mod` lines: a `macro_rules!` is in scope only below its definition, and there in
// the child modules too.
macro_rules! fixture {
    ($test:expr) => {
        match F::setup($test).await {
            Some(fx) => fx,
            None => return,
        }
    };
}

mod batch;
mod claim;
mod operations;
mod retention;
mod set_batch;
mod transaction;

pub use batch::{
    batch_fails_whole_on_an_error_that_is_not_one_messages,
    batch_with_one_failing_message_rolls_back_only_that_message,
};
pub use claim::{
    concurrent_duplicates_commit_exactly_one_effect, duplicate_delivery_runs_the_handler_once,
    each_consumer_processes_a_message_once, fingerprint_conflict_is_reported_not_skipped,
    naturally_idempotent_mode_writes_no_claim, oversized_and_empty_ids_are_rejected,
};
pub use operations::migrate_is_idempotent_and_stats_report_per_consumer;
pub use retention::{
    prune_deletes_only_expired_claims_in_bounded_batches,
    retention_shorter_than_the_redelivery_window_is_refused,
};
pub use set_batch::{
    concurrent_set_batches_sharing_ids_commit_each_effect_once,
    set_batch_claims_in_one_statement_and_hands_over_only_new_messages,
    set_batch_handler_error_rolls_back_the_whole_batch,
};
pub use transaction::{
    a_swallowed_database_error_never_reports_an_uncommitted_message,
    handler_error_rolls_back_the_claim_and_the_effect,
    low_level_claim_composes_with_the_callers_transaction,
    rejected_message_is_dead_lettered_and_leaves_no_claim,
};

/// Expands to one `#[tokio::test]` per conformance check, each running against a fresh fixture
/// (its own tables), so the checks run in parallel and fail independently.
#[macro_export]
macro_rules! conformance_tests {
    ($fixture:ty) => {
        $crate::conformance_tests!(@tests $fixture;
            // claim
            duplicate_delivery_runs_the_handler_once,
            concurrent_duplicates_commit_exactly_one_effect,
            fingerprint_conflict_is_reported_not_skipped,
            each_consumer_processes_a_message_once,
            naturally_idempotent_mode_writes_no_claim,
            oversized_and_empty_ids_are_rejected,
            // transaction
            handler_error_rolls_back_the_claim_and_the_effect,
            a_swallowed_database_error_never_reports_an_uncommitted_message,
            rejected_message_is_dead_lettered_and_leaves_no_claim,
            low_level_claim_composes_with_the_callers_transaction,
            // batch
            batch_with_one_failing_message_rolls_back_only_that_message,
            batch_fails_whole_on_an_error_that_is_not_one_messages,
            // set_batch
            set_batch_claims_in_one_statement_and_hands_over_only_new_messages,
            set_batch_handler_error_rolls_back_the_whole_batch,
            concurrent_set_batches_sharing_ids_commit_each_effect_once,
            // retention
            prune_deletes_only_expired_claims_in_bounded_batches,
            retention_shorter_than_the_redelivery_window_is_refused,
            // operations
            migrate_is_idempotent_and_stats_report_per_consumer,
        );
    };
    (@tests $fixture:ty; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                $crate::conformance::$name::<$fixture>(stringify!($name)).await;
            }
        )*
    };
}
