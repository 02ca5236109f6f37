//! The stream-reply decoders, for the fuzz targets in `fuzz/` only (the `fuzzing` feature):
//! not a stable API.

use idem_core::Error;
use redis::Value;

/// A decoded stream entry: its ID, and its fields in order (`None`: deleted from the stream).
pub type Entry = (String, Option<Vec<(Vec<u8>, Vec<u8>)>>);

fn plain(entries: Vec<crate::reply::Entry>) -> Vec<Entry> {
    entries.into_iter().map(|e| (e.id, e.fields)).collect()
}

/// What the source makes of an `XREADGROUP` reply.
pub fn read_group(value: Value) -> Result<Vec<Entry>, Error> {
    crate::reply::read_group(value).map(plain)
}

/// What the source makes of an `XAUTOCLAIM` reply: cursor, claimed entries, deleted IDs.
pub fn auto_claim(value: Value) -> Result<(String, Vec<Entry>, Vec<String>), Error> {
    crate::reply::auto_claim(value).map(|c| (c.cursor, plain(c.claimed), c.deleted))
}

/// What the source makes of an `XPENDING key group id id 1` reply.
pub fn times_delivered(value: Value) -> Result<Option<u64>, Error> {
    crate::reply::times_delivered(value)
}
