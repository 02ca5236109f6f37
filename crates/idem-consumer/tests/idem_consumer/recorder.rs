//! The process-wide Prometheus recorder, installed once for every test of this binary that
//! reads metrics. Tests run in parallel and all report to it: each reads only the lines of its
//! own consumer (a name no other test uses).

use std::sync::OnceLock;

use idem_consumer::metrics::{self, PrometheusHandle};

/// The recorder, installed by the first test that asks.
pub(crate) fn recorder() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| metrics::install_prometheus_recorder().expect("recorder"))
}
