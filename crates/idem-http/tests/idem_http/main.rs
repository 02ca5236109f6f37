//! The HTTP layer against every real store: SQLite always, PostgreSQL, MySQL/MariaDB and Redis
//! through `IDEM_TEST_POSTGRES_URL`, `IDEM_TEST_MYSQL_URL` and `IDEM_TEST_REDIS_URL` (unset:
//! `SKIPPING`, or a failure with `IDEM_TEST_REQUIRE_SERVICES=1`). Each check runs on its own
//! tables or key prefix.
//!
//! `black_box`: the test kit's black-box suite over real TCP (axum on 127.0.0.1:0, reqwest),
//! the same checks idem-actix runs. The modules per store below: the checks that drive the
//! layer as a tower service.
//!
//! This is the crate's one integration-test binary, shared by all of these checks. It needs
//! the `axum` feature (on by default): without it every module below is left out.

#[cfg(feature = "axum")]
mod support;

#[cfg(feature = "axum")]
mod black_box {
    idem_testkit::http_suite_tests!(crate::support::app::Axum);
}

/// One `#[tokio::test]` per check of `support::suite`, on `$fixture`.
#[cfg(feature = "axum")]
macro_rules! http_suite {
    ($fixture:ty) => {
        http_suite!(@tests $fixture;
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

#[cfg(feature = "axum")]
mod sqlite {
    http_suite!(idem_testkit::http::fixtures::SqliteFx);
}

#[cfg(feature = "axum")]
mod postgres {
    http_suite!(idem_testkit::http::fixtures::PgFx);
}

#[cfg(feature = "axum")]
mod mysql {
    http_suite!(idem_testkit::http::fixtures::MySqlFx);
}

#[cfg(feature = "axum")]
mod redis {
    http_suite!(idem_testkit::http::fixtures::RedisFx);
}

/// SQLite's one write lock and keyed requests (issue 19, point 4).
#[cfg(feature = "axum")]
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

/// Recovery points behind the layer (issue 22): the phases of `support::phases` on every SQL
/// store (Redis keeps no recovery points).
#[cfg(feature = "axum")]
mod phases {
    macro_rules! phases_tests {
        ($store:ident, $fixture:ty) => {
            mod $store {
                phases_tests!(@tests $fixture;
                    a_first_execution_runs_each_phase_once_and_replays,
                    a_retry_after_a_failed_phase_resumes_at_its_point,
                    a_takeover_after_the_lease_resumes_at_the_last_point,
                    the_completer_finishes_a_layer_record_and_the_retry_replays_it,
                    the_completer_gives_a_layer_record_up_with_a_replayed_response,
                    an_abandoned_operation_replays_its_response,
                );
            }
        };
        (@tests $fixture:ty; $($name:ident),* $(,)?) => {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    crate::support::phases::$name::<$fixture>(
                        concat!(module_path!(), "::", stringify!($name)),
                    )
                    .await;
                }
            )*
        };
    }

    phases_tests!(sqlite, idem_testkit::http::fixtures::SqliteFx);
    phases_tests!(postgres, idem_testkit::http::fixtures::PgFx);
    phases_tests!(mysql, idem_testkit::http::fixtures::MySqlFx);
}
