//! Creating the consumer group a source reads through.

use idem_core::Error;
use redis::aio::ConnectionLike;

use crate::builder::StartFrom;
use crate::error;

/// Creates consumer group `group` on `stream` (and the stream, if missing: `XGROUP CREATE …
/// MKSTREAM`), reading from `start`; an existing group is left as it is. A source does this
/// itself when it connects, and again when Redis forgot the group (a restart without
/// persistence); call it to create the group before anything is published with
/// [`StartFrom::NewOnly`].
///
/// # Errors
/// [`ErrorKind::Unavailable`](idem_core::ErrorKind::Unavailable) when the command fails (the
/// server is out of reach, or `stream` holds another type).
pub async fn ensure_group<C>(
    conn: &mut C,
    stream: &str,
    group: &str,
    start: StartFrom,
) -> Result<(), Error>
where
    C: ConnectionLike + Send,
{
    let created: Result<(), redis::RedisError> = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(stream)
        .arg(group)
        .arg(start.as_id())
        .arg("MKSTREAM")
        .query_async(conn)
        .await;
    match created {
        Ok(()) => {
            tracing::info!(stream, group, "consumer group created");
            Ok(())
        }
        Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
        Err(e) => Err(error::unavailable("XGROUP CREATE", e)),
    }
}
