//! NATS connections from a URL list, shared by the source, the producer and the topology.

use idem_core::{Error, ErrorKind};
use idem_nats::async_nats;
use idem_nats::async_nats::jetstream::Context;

use crate::{Broker, names};

/// Connects to NATS at `urls`: one URL or several, comma-separated (the seed servers of a
/// cluster, so a process starting while one node is down still connects; once connected the
/// client also learns the cluster's other servers from the server itself).
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] for a URL async-nats cannot read, [`ErrorKind::Unavailable`]
/// when no server can be reached; both show the URLs redacted.
pub async fn connect(urls: &str) -> Result<Context, Error> {
    let shown = || idem_redact::redact_url(urls);
    let servers = urls
        .split(',')
        .map(|u| u.trim().parse::<async_nats::ServerAddr>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            Error::from_system(
                ErrorKind::InvalidConfig,
                "NATS",
                format!("URL {}", shown()),
                e,
            )
        })?;
    let client = async_nats::connect(servers).await.map_err(|e| {
        Error::from_system(
            ErrorKind::Unavailable,
            "NATS",
            format!("connecting to {}", shown()),
            e,
        )
    })?;
    Ok(async_nats::jetstream::new(client))
}

/// The JetStream streams: `NAME` captures subject `NAME`; `NAME-dead-letter` keeps dead letters.
pub(crate) async fn topology(urls: &str, source: &str) -> Result<Context, Error> {
    let js = connect(urls).await?;
    ensure_topology(&js, source).await?;
    Ok(js)
}

/// [`topology`] on a connection already open (a producer's).
pub(crate) async fn ensure_topology(js: &Context, source: &str) -> Result<(), Error> {
    idem_nats::ensure_stream(js, source, &[source]).await?;
    let dead = names::dead_letters(Broker::Nats, source);
    idem_nats::ensure_stream(js, &names::nats_dead_letter_stream(source), &[&dead]).await
}
