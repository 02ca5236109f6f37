//! Small helpers every SQL store shares.

use idem_core::{ConsumerStats, Error, ErrorKind, Fingerprint, Stamp, Timestamp};
use sqlx::Row;

/// Turns the stored column into a fingerprint; a missing row means the claim vanished between
/// the insert and the read (pruned concurrently), which a retry resolves.
pub(crate) fn stored_fingerprint(bytes: Option<Vec<u8>>) -> Result<Option<Fingerprint>, Error> {
    match bytes {
        Some(b) => Fingerprint::from_slice(&b).map(Some).ok_or_else(|| {
            Error::new(
                ErrorKind::Store,
                format!("stored fingerprint is {} bytes, expected 32", b.len()),
            )
        }),
        None => Err(Error::new(
            ErrorKind::Transient,
            "claim existed at insert but was gone when read back (pruned concurrently?); retry",
        )),
    }
}

/// `processed_at` for a store whose statements read the database server's clock when given
/// NULL (`COALESCE(?, <server now>)`): every host then stamps and prunes on one clock.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn server_stamp(stamp: Stamp) -> Option<i64> {
    match stamp {
        Stamp::StoreClock => None,
        Stamp::At(t) => Some(t.as_micros()),
    }
}

/// `processed_at` for an embedded store: its clock is this host's, the only host writing it.
#[cfg(feature = "sqlite")]
pub(crate) fn host_stamp(stamp: Stamp) -> Option<i64> {
    use idem_core::{Clock, SystemClock};
    match stamp {
        Stamp::StoreClock => Some(SystemClock.now().as_micros()),
        Stamp::At(t) => Some(t.as_micros()),
    }
}

/// Reads one `(consumer, count, oldest, newest)` row of a stats query.
pub(crate) fn stats_row<R>(r: &R) -> Result<ConsumerStats, sqlx::Error>
where
    R: Row,
    usize: sqlx::ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    Ok(ConsumerStats {
        consumer: r.try_get(0)?,
        claims: u64::try_from(r.try_get::<i64, _>(1)?).unwrap_or(0),
        oldest: Timestamp::from_micros(r.try_get(2)?),
        newest: Timestamp::from_micros(r.try_get(3)?),
    })
}

/// How long `connect` waits for the first connection before reporting the server unreachable.
#[cfg(any(feature = "postgres", feature = "mysql"))]
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Opens a pool on `url`, failing fast with the real cause.
///
/// A pool retries failed connections until its acquire timeout and then reports only "pool
/// timed out"; one direct connection first surfaces "connection refused" or "database does not
/// exist" at once, which is what an operator needs to see.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) async fn connect_pool<E: crate::engine::Engine>(
    url: &str,
    max_connections: u32,
) -> Result<sqlx::Pool<E>, Error> {
    use sqlx::ConnectOptions;
    use sqlx::Connection;
    type Opts<E> = <<E as sqlx::Database>::Connection as Connection>::Options;

    let shown = idem_redact::redact_url(url);
    let options: Opts<E> = url.parse().map_err(|e: sqlx::Error| {
        Error::new(
            ErrorKind::InvalidConfig,
            format!("invalid {} URL {shown}: {e}", <E as sqlx::Database>::NAME),
        )
        .with_source(e)
    })?;
    let probe = tokio::time::timeout(CONNECT_TIMEOUT, options.connect()).await;
    match probe {
        Err(_) => {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!(
                    "{}: connecting to {shown} timed out after {}s",
                    <E as sqlx::Database>::NAME,
                    CONNECT_TIMEOUT.as_secs()
                ),
            ));
        }
        Ok(Err(e)) => {
            return Err(crate::errors::store_error::<E>(
                &format!("connecting to {shown}"),
                e,
            ));
        }
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
        }
    }
    sqlx::pool::PoolOptions::<E>::new()
        .max_connections(max_connections)
        .connect_with(options)
        .await
        .map_err(|e| crate::errors::store_error::<E>(&format!("connecting to {shown}"), e))
}
