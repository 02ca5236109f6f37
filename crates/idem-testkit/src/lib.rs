//! Test support for idem (not published): the store conformance suite every backend must pass
//! against its real server, and the real-service URL rules.
//!
//! A new store passes the suite by implementing [`StoreFixture`] (how to make an isolated,
//! migrated store and how a handler writes a side effect in its transaction) and invoking
//! [`conformance_tests!`] once:
//!
//! ```ignore
//! struct PgFixture { /* store, table names */ }
//! impl idem_testkit::StoreFixture for PgFixture { /* … */ }
//! idem_testkit::conformance_tests!(PgFixture);
//! ```

pub mod broker_conformance;
mod broker_fixture;
pub mod completer_conformance;
mod completer_fixture;
pub mod conformance;
#[cfg(feature = "fake-processor")]
pub mod fake_processor;
#[cfg(feature = "fault-proxy")]
pub mod fault_proxy;
mod fixture;
#[cfg(feature = "http")]
pub mod http;
pub mod isolated;
pub mod outbox_conformance;
mod outbox_fixture;
mod phase_operation;
pub mod phases_conformance;
pub mod recovery_conformance;
mod recovery_fixture;
pub mod request_conformance;
mod request_fixture;
pub mod services;

pub use broker_fixture::{BrokerFixture, DeadLettered};
pub use completer_fixture::CompleterFixture;
pub use fixture::{StoreFixture, TxOf};
pub use outbox_fixture::OutboxFixture;
pub use recovery_fixture::RecoveryFixture;
pub use request_fixture::{RequestFixture, RequestTxOf};

/// Expands to one `#[tokio::test]` per recovery-point conformance check for a
/// [`RecoveryFixture`] (the [`RecoveryStore`](idem_core::store::RecoveryStore) capability and
/// `idem_request`'s phases on it), each on a fresh fixture. A store runs it beside
/// [`request_conformance_tests!`].
#[macro_export]
macro_rules! recovery_conformance_tests {
    ($fixture:ty) => {
        $crate::recovery_conformance_tests!(@tests $fixture;
            a_crash_between_phases_resumes_at_the_last_point,
            a_committed_local_phase_never_runs_again,
            a_foreign_call_repeats_with_the_same_derived_key,
            a_stale_fence_cannot_advance,
            an_abandoned_operation_replays_its_result,
            stuck_records_are_found_past_their_lease_bounded,
            two_completers_skip_each_others_records,
            expiry_never_resets_a_record_with_a_recovery_point,
            migration_adds_recovery_columns_to_an_old_table,
            a_phased_take_writes_the_first_point_and_returns_it,
        );
    };
    (@tests $fixture:ty; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                $crate::recovery_conformance::$name::<$fixture>(stringify!($name)).await;
            }
        )*
    };
}

/// Expands to one `#[tokio::test]` per phases conformance check for a [`RecoveryFixture`]:
/// operations of phases run end to end through `idem_request`'s public API
/// ([`run_phases`](idem_request::Idempotency::run_phases),
/// [`take_stuck`](idem_request::Idempotency::take_stuck),
/// [`resume_phases`](idem_request::Idempotency::resume_phases)), counting the phases run and
/// the calls a fake processor got, each on a fresh fixture. A store that runs
/// [`recovery_conformance_tests!`] runs this beside it, with the same fixture:
///
/// ```ignore
/// idem_testkit::recovery_conformance_tests!(PgFixture);
/// idem_testkit::phases_conformance_tests!(PgFixture);
/// ```
#[macro_export]
macro_rules! phases_conformance_tests {
    ($fixture:ty) => {
        $crate::phases_conformance_tests!(@tests $fixture;
            a_committed_local_phase_never_runs_again_after_a_failure_or_a_takeover,
            a_foreign_call_repeats_only_with_the_same_derived_key,
            the_first_point_commits_before_the_first_phase,
            abandon_stores_a_response_replayed_to_retries,
            a_fingerprint_conflict_is_refused,
        );
    };
    (@tests $fixture:ty; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                $crate::phases_conformance::$name::<$fixture>(stringify!($name)).await;
            }
        )*
    };
}

/// Expands to one `#[tokio::test]` per completer conformance check for a
/// [`CompleterFixture`]: `idem_request`'s [`Completer`](idem_request::Completer) (`pass`,
/// `run`, `stats` and its metrics) finishing stuck operations of phases on the real store,
/// each on a fresh fixture. A store adopts it by implementing [`CompleterFixture`] (one
/// method beyond [`RecoveryFixture`]: a store the server refuses) and invoking it beside
/// [`recovery_conformance_tests!`] and [`phases_conformance_tests!`]:
///
/// ```ignore
/// impl idem_testkit::CompleterFixture for PgFixture {
///     fn refusing_store(&self) -> PostgresStore {
///         let missing = TableName::new("no_such_requests").expect("valid");
///         self.store().with_requests_table(missing).expect("plain table")
///     }
/// }
/// idem_testkit::completer_conformance_tests!(PgFixture);
/// ```
#[macro_export]
macro_rules! completer_conformance_tests {
    ($fixture:ty) => {
        $crate::completer_conformance_tests!(@tests $fixture;
            a_stuck_record_is_resumed_and_a_retry_gets_its_response,
            two_completers_resume_each_record_exactly_once,
            after_max_attempts_it_gives_up_with_the_compensation_in_the_same_commit,
            a_record_whose_lease_is_live_is_not_taken,
            passes_take_bounded_batches,
            stats_and_metrics_count_stuck_resumed_failed_and_abandoned,
            run_resumes_stuck_records_until_shutdown,
            a_refusing_store_is_an_outage_not_a_failure,
            a_store_failing_under_an_operation_stops_the_pass_as_an_outage,
            an_unknown_operation_is_left_alone,
        );
    };
    (@tests $fixture:ty; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                $crate::completer_conformance::$name::<$fixture>(stringify!($name)).await;
            }
        )*
    };
}

/// Expands to one `#[tokio::test]` per idempotent-request conformance check for a
/// [`RequestFixture`] (the [`RequestStore`](idem_core::store::RequestStore) and
/// [`ReapRequests`](idem_core::store::ReapRequests) capabilities), each on a fresh fixture.
/// A store runs it beside [`conformance_tests!`] only if it also has the claim capabilities.
#[macro_export]
macro_rules! request_conformance_tests {
    ($fixture:ty) => {
        $crate::request_conformance_tests!(@tests $fixture;
            a_retry_while_the_first_runs_is_in_progress_at_once,
            a_completed_request_replays_its_result_byte_for_byte,
            another_fingerprint_is_a_mismatch_and_leaves_the_record,
            a_lapsed_lease_is_taken_over_and_the_late_completion_refused,
            release_frees_the_key_and_a_stale_fence_frees_nothing,
            a_renewed_lease_keeps_the_record_held,
            an_expired_record_executes_again_and_is_reaped,
            concurrent_first_requests_take_the_record_once,
            scopes_never_share_records,
            an_abandoned_execution_rolls_back_and_frees_the_key,
            function_calls_run_once_and_replay_their_result,
            in_one_transaction_a_duplicate_is_in_progress_at_once,
            in_one_transaction_a_lost_connection_frees_the_key,
            leased_and_one_transaction_executions_never_both_run,
            an_engine_execution_in_one_transaction_frees_its_key_when_dropped,
        );
    };
    (@tests $fixture:ty; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                $crate::request_conformance::$name::<$fixture>(stringify!($name)).await;
            }
        )*
    };
}
pub use services::{service_url, unique_name};

/// Expands to one `#[tokio::test]` per outbox conformance check for an [`OutboxFixture`] (the
/// [`OutboxStore`](idem_core::outbox::OutboxStore) and
/// [`RelayStore`](idem_core::outbox::RelayStore) capabilities), each on a fresh fixture.
#[macro_export]
macro_rules! outbox_conformance_tests {
    ($fixture:ty) => {
        $crate::outbox_conformance_tests!(@tests $fixture;
            committed_enqueue_is_leased_back_byte_exact,
            rolled_back_enqueue_never_appears,
            enqueue_of_committed_ids_adds_no_row,
            a_large_enqueue_keeps_its_order_and_skips_repeats,
            lease_order_is_seq_order,
            concurrent_relays_never_lease_the_same_row,
            concurrent_relays_publish_each_key_in_order,
            a_lapsed_lease_is_taken_over_and_the_late_mark_marks_nothing,
            one_relay_at_a_time_per_ordering_key,
            a_row_the_key_rule_turns_away_is_not_leased,
            release_delays_and_counts_attempts,
            dead_letter_moves_the_row_with_its_reason,
            purge_sent_deletes_at_most_limit,
            backlog_counts_and_oldest_age,
            migrate_twice_keeps_the_outbox,
            a_missing_outbox_table_is_misconfigured,
        );
    };
    (@tests $fixture:ty; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                $crate::outbox_conformance::$name::<$fixture>(stringify!($name)).await;
            }
        )*
    };
}

/// Expands to one `#[tokio::test]` per broker conformance check and consumer mode for a
/// [`BrokerFixture`], each on its own destination and effects database: the checks run in the
/// modules `per_message`, `batched` (a handler per message, batches of 8) and `set_batched`
/// (a set handler per batch of 8), so every adapter is proven on every processing path.
#[macro_export]
macro_rules! broker_conformance_tests {
    ($fixture:ty) => {
        $crate::broker_conformance_tests!(@mode per_message, $crate::broker_conformance::Mode::PerMessage, $fixture);
        $crate::broker_conformance_tests!(@mode batched, $crate::broker_conformance::Mode::Batch(8), $fixture);
        $crate::broker_conformance_tests!(@mode set_batched, $crate::broker_conformance::Mode::Set(8), $fixture);
    };
    (@mode $module:ident, $mode:expr, $fixture:ty) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;

            $crate::broker_conformance_tests!(@tests $fixture; $module; $mode;
                duplicate_publish_is_one_effect_and_one_duplicate,
                killed_after_commit_before_ack_redelivers_as_duplicate,
                two_consumers_with_overlapping_redeliveries_commit_each_message_once,
                poison_messages_are_dead_lettered_with_reason_and_intact_payload,
                graceful_shutdown_in_flight_loses_nothing_and_doubles_nothing,
                retries_then_dead_letter_when_exhausted,
                bad_input_corpus_is_dead_lettered_and_consuming_continues,
            );
        }
    };
    (@tests $fixture:ty; $module:ident; $mode:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                $crate::broker_conformance::$name::<$fixture>(
                    concat!(stringify!($module), "_", stringify!($name)),
                    $mode,
                )
                .await;
            }
        )*
    };
}
