//! Creating the streams a source reads from and keeps its dead letters in.

use async_nats::jetstream::{self, Context};
use idem_core::Error;

use crate::error;

/// Creates stream `name` capturing `subjects` (file storage, limits retention, the server's
/// defaults otherwise) unless a stream of that name exists; an existing stream is left as it
/// is, whatever its subjects. For full control use async-nats's
/// [`Context::get_or_create_stream`] with a [`jetstream::stream::Config`].
///
/// # Errors
/// [`idem_core::ErrorKind::InvalidConfig`] when the server refuses the stream (bad name,
/// subjects overlapping another stream); [`idem_core::ErrorKind::Unavailable`] when it cannot
/// be reached.
pub async fn ensure_stream(js: &Context, name: &str, subjects: &[&str]) -> Result<(), Error> {
    let config = jetstream::stream::Config {
        name: name.to_owned(),
        subjects: subjects.iter().map(|s| (*s).to_owned()).collect(),
        ..Default::default()
    };
    js.get_or_create_stream(config)
        .await
        .map_err(|e| error::api(&format!("creating stream {name}"), e))?;
    Ok(())
}
