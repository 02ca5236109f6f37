//! The black-box HTTP suite (feature `http`): every check talks to a real server over TCP
//! (reqwest, or raw HTTP/1.1 where a client must misbehave), so the same checks prove every
//! web integration of idem — the tower layer under axum, the actix-web middleware — on every
//! store (SQLite, PostgreSQL, MySQL/MariaDB, Redis).
//!
//! A framework plugs in by implementing [`HttpFramework`] — start a server with the suite's
//! routes (below) on 127.0.0.1, each calling the [`SuiteApp`] handler of the same name behind
//! the framework's idempotency middleware configured by [`layer`] — and invoking
//! [`http_suite_tests!`](crate::http_suite_tests) once:
//!
//! ```ignore
//! struct MyFramework;
//! impl idem_testkit::http::HttpFramework for MyFramework { /* serve … */ }
//! idem_testkit::http_suite_tests!(MyFramework);
//! ```
//!
//! # The routes
//!
//! Each behind the middleware built from [`layer`] (per principal: the `x-principal` header
//! stands in for authentication; key required; small limits; `x-stored` kept):
//!
//! | route | handler | key |
//! |---|---|---|
//! | `POST /charges` | [`SuiteApp::charge`] with the execution's transaction (`Option`) | required |
//! | `GET /charges` | [`SuiteApp::list`] | (a safe method: ignored) |
//! | `POST /optional` | [`SuiteApp::charge`] | [`optional_key`](idem_http::IdempotencyLayer::optional_key) |
//! | `POST /off` | [`SuiteApp::charge`] | [`KeyRequirement::Off`](idem_http::KeyRequirement::Off) |
//! | `POST /json` | [`SuiteApp::json_charge`], the body through the framework's JSON extractor | required |
//! | `POST /plain` | [`SuiteApp::plain`], no idem extractor at all | required |
//! | `POST /derive` | [`SuiteApp::derive`] with the execution's [`IdemRequest`](idem_http::IdemRequest) | required |
//! | `POST /emit` | [`SuiteApp::emit`] with the execution's `IdemRequest` and transaction (not `Option`) | required |
//! | `POST /v1/charges`, `/v1/derive`, `/v1/emit`, `/v2/…` the same | the same, nested under a prefix (`Router::nest`, `web::scope`) | required |
//!
//! The JSON extractor must reject before the handler runs: `415` for a body that is not
//! `application/json`, `422` for JSON without the `effect` field, `400` for a body that is not
//! JSON (axum's `Json` does so; other frameworks map their rejections to these statuses).
//! A response the handler marked [`Executed`](idem_http::Executed) carries the marker to the
//! middleware (an extension of the framework's response).
//!
//! # The outbox
//!
//! `POST /emit` enqueues messages through the request's
//! [`emitter`](idem_http::IdemRequest::emitter) in the request's transaction, through the
//! store's own `OutboxStore` ([`outbox`]). On the SQL stores the suite reads them back as a
//! relay leases them and recomputes every ID through
//! [`Principal::emitter`](idem_http::Principal::emitter): one request enqueues exactly its
//! messages under those IDs, a replay or a `422` none more, a 5xx or a panic none (and the
//! retry that succeeds exactly once), 16 concurrent requests with one key once, an execution
//! fenced out by a takeover none (the takeover's messages are the ones that commit), and two
//! principals or two paths with one key enqueue under distinct IDs. Redis's store implements
//! no `OutboxStore` (it shares no transaction with the request): there the suite asserts
//! that the handler's enqueue is refused, `501 no-outbox`, and nothing is stored.

mod app;
pub mod checks;
mod client;
pub mod fixtures;
pub mod outbox;

use std::future::Future;

pub use app::{
    EMIT_DEFAULT, EMIT_DESTINATION, Order, REQUEST_LIMIT, STORAGE_LIMIT, SuiteApp, X_STORED, layer,
};
pub use client::{Post, Reply, Server, raw_http, serve};
pub use fixtures::HttpFixture;

/// A web framework under the suite.
pub trait HttpFramework: Send + Sync + 'static {
    /// Whether the server drops a request (its handler future) when the client disconnects
    /// mid-request, as hyper does. actix-web 4 runs the handler to its end instead, so the
    /// execution completes rather than being abandoned; the check of a client gone mid-request
    /// asserts what applies.
    const CANCELS_ON_DISCONNECT: bool = true;

    /// Serves the suite's routes (see the [module docs](self)) for `app` on 127.0.0.1 (a port
    /// the OS picks), behind middleware built from [`layer`]`(idem)`; the server stops when
    /// the returned [`Running`] is dropped.
    fn serve<F: HttpFixture>(
        app: std::sync::Arc<SuiteApp<F>>,
        idem: idem_request::Idempotency<F::Store>,
    ) -> impl Future<Output = Running> + Send;
}

/// A server the suite talks to: its base URL (`http://127.0.0.1:port`), and what stops it.
pub struct Running {
    base: String,
    stop: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl Running {
    /// A server at `base`, stopped by `stop` when dropped.
    pub fn new(base: String, stop: impl FnOnce() + Send + Sync + 'static) -> Self {
        Self {
            base,
            stop: Some(Box::new(stop)),
        }
    }

    /// `http://127.0.0.1:port`.
    pub fn base(&self) -> &str {
        &self.base
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            stop();
        }
    }
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running").field("base", &self.base).finish()
    }
}

/// Expands to one `#[tokio::test]` per black-box HTTP check ([`checks`]) for a
/// [`HttpFramework`], in the modules `sqlite`, `postgres`, `mysql` and `redis` (the real-service
/// stores skip, loudly, when their URL is not set): 23 checks on every store, then the six
/// outbox checks on the SQL stores and the outbox's refusal on Redis.
#[macro_export]
macro_rules! http_suite_tests {
    ($framework:ty) => {
        $crate::http_suite_tests!(@store sqlite, $framework, $crate::http::fixtures::SqliteFx; outbox);
        $crate::http_suite_tests!(@store postgres, $framework, $crate::http::fixtures::PgFx; outbox);
        $crate::http_suite_tests!(@store mysql, $framework, $crate::http::fixtures::MySqlFx; outbox);
        $crate::http_suite_tests!(@store redis, $framework, $crate::http::fixtures::RedisFx; no_outbox);
    };
    // The stores whose transaction is the request's: the outbox contract.
    (@outbox $framework:ty, $fixture:ty) => {
        $crate::http_suite_tests!(@tests $framework, $fixture;
            an_emitting_request_enqueues_its_messages_under_derived_ids_once,
            another_body_with_an_emitting_key_is_422_and_enqueues_nothing,
            a_failed_emitting_request_enqueues_nothing_and_its_retry_enqueues_once,
            concurrent_emitting_requests_with_one_key_enqueue_once,
            a_fenced_out_execution_enqueues_nothing_and_the_takeover_enqueues_once,
            two_principals_with_one_key_enqueue_under_distinct_ids,
        );
    };
    // Redis: no outbox, refused.
    (@no_outbox $framework:ty, $fixture:ty) => {
        $crate::http_suite_tests!(@tests $framework, $fixture;
            a_store_without_a_shared_transaction_refuses_the_outbox,
        );
    };
    (@store $module:ident, $framework:ty, $fixture:ty; $outbox:ident) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;

            $crate::http_suite_tests!(@tests $framework, $fixture;
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
            );
            $crate::http_suite_tests!(@$outbox $framework, $fixture);
        }
    };
    (@tests $framework:ty, $fixture:ty; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                $crate::http::checks::$name::<$framework, $fixture>(
                    concat!(module_path!(), "::", stringify!($name)),
                )
                .await;
            }
        )*
    };
}
