//! The Prometheus recorder and its `/metrics` endpoint (feature `prometheus`).

use std::net::SocketAddr;

use idem_core::{Error, ErrorKind};
/// What [`install_prometheus_recorder`] returns: `render()` gives the exposition text.
pub use metrics_exporter_prometheus::PrometheusHandle;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

/// Latency buckets for the `_seconds` histograms: 100 µs to 10 s.
const BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

fn builder() -> Result<PrometheusBuilder, Error> {
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), BUCKETS)
        .map_err(|e| {
            Error::new(
                ErrorKind::InvalidConfig,
                format!("invalid metrics buckets: {e}"),
            )
        })
}

/// Installs the process-wide Prometheus recorder and serves `GET /metrics` on `addr`.
///
/// Call once at start, inside the tokio runtime. Fails if the address cannot be bound or a
/// recorder is already installed.
pub fn serve_prometheus(addr: SocketAddr) -> Result<(), Error> {
    builder()?.with_http_listener(addr).install().map_err(|e| {
        Error::new(
            ErrorKind::InvalidConfig,
            format!("cannot serve metrics on {addr}: {e}"),
        )
    })
}

/// Installs the process-wide Prometheus recorder without a listener and returns a handle whose
/// `render()` produces the exposition text, for services that already run an HTTP server.
pub fn install_prometheus_recorder() -> Result<PrometheusHandle, Error> {
    builder()?.install_recorder().map_err(|e| {
        Error::new(
            ErrorKind::InvalidConfig,
            format!("cannot install the metrics recorder: {e}"),
        )
    })
}
