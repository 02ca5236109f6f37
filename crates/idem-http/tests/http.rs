//! The HTTP layer over real TCP (axum on 127.0.0.1:0, reqwest) against every real store:
//! SQLite always, PostgreSQL, MySQL/MariaDB and Redis through `IDEM_TEST_POSTGRES_URL`,
//! `IDEM_TEST_MYSQL_URL` and `IDEM_TEST_REDIS_URL` (unset: `SKIPPING`, or a failure with
//! `IDEM_TEST_REQUIRE_SERVICES=1`). Each check runs on its own tables or key prefix.

mod support;

/// One `#[tokio::test]` per check of `support::suite`, on `$fixture`.
macro_rules! http_suite {
    ($fixture:ty) => {
        http_suite!(@tests $fixture;
            concurrent_requests_with_one_key_execute_once,
            a_replay_is_byte_identical_and_marked_and_the_first_is_not,
            another_body_with_the_same_key_is_422_and_the_original_still_replays,
            a_missing_key_on_a_required_route_is_400_and_nothing_runs,
            malformed_and_doubled_keys_are_400,
            two_principals_with_one_key_execute_twice,
            a_5xx_is_not_stored_its_writes_roll_back_and_the_retry_runs,
            a_panicking_handler_is_not_stored_and_rolls_back,
            a_4xx_is_stored_and_replayed,
            a_late_completion_with_a_stale_fence_is_rejected,
            a_heartbeat_keeps_a_long_request_in_progress,
            an_expired_record_executes_again_and_is_reaped,
            a_request_over_the_limit_is_413_and_records_nothing,
            a_response_over_the_storage_limit_replays_marked_omitted,
            a_key_on_get_is_ignored_and_records_nothing,
            a_store_outage_is_503_and_the_handler_does_not_run,
            optional_and_off_routes_run_without_a_record,
            malformed_lists_obs_text_and_huge_keys_are_400_and_serving_goes_on,
            a_truncated_body_is_400_records_nothing_and_serving_goes_on,
            a_client_gone_mid_request_abandons_the_execution_and_the_retry_runs,
            two_principals_with_one_key_derive_two_external_keys,
            an_extractor_rejection_is_not_stored_and_the_corrected_retry_runs,
            nested_routes_keep_their_prefix_in_the_scope,
            a_request_dropped_at_any_await_point_frees_its_key,
            a_grpc_unary_call_replays_its_message_and_status,
            a_slow_request_that_never_writes_does_not_delay_another_key,
        );
    };
    (@tests $fixture:ty; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                crate::support::suite::$name::<$fixture>(
                    concat!(module_path!(), "::", stringify!($name)),
                )
                .await;
            }
        )*
    };
}

mod sqlite {
    http_suite!(crate::support::fixtures::SqliteFx);
}

mod postgres {
    http_suite!(crate::support::fixtures::PgFx);
}

mod mysql {
    http_suite!(crate::support::fixtures::MySqlFx);
}

mod redis {
    http_suite!(crate::support::fixtures::RedisFx);
}

/// SQLite's one write lock and keyed requests (issue 19, point 4).
mod sqlite_write_lock {
    macro_rules! sqlite_tests {
        ($($name:ident),* $(,)?) => {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    crate::support::write_lock::$name(concat!(module_path!(), "::", stringify!($name)))
                        .await;
                }
            )*
        };
    }

    sqlite_tests!(
        a_take_that_waits_past_the_bound_is_503_with_retry_after,
        a_completion_that_waits_past_the_bound_is_503_and_frees_the_key,
        a_write_that_waits_past_the_bound_frees_the_key,
        a_request_longer_than_its_lease_keeps_it_by_heartbeat,
        the_heartbeat_does_not_queue_behind_its_own_write_lock,
    );
}
