//! Shared by the database-state tests: run one message through a processor and report how its
//! failure was classified, checking that nothing was claimed.

use idem_core::{
    BoxError, ClaimStore, Disposition, Error, ErrorKind, Message, MessageId, Processor,
};

/// One message, whose payload the handler may use.
pub(crate) fn msg(id: &str) -> Message<Vec<u8>> {
    Message::new(MessageId::new(id).expect("valid id"), b"{}".to_vec())
}

/// Processes `id` with `handler` and returns the error it must fail with.
pub(crate) async fn failure<S, F>(processor: &Processor<S>, id: &str, handler: F) -> Error
where
    S: ClaimStore,
    F: AsyncFnOnce(&mut S::Tx) -> Result<(), BoxError>,
{
    match processor.process(&msg(id), handler).await {
        Ok(outcome) => panic!("{id}: expected a failure, got {outcome:?}"),
        Err(e) => e,
    }
}

/// The kind a database state must map to, and what a consumer then does.
pub(crate) fn assert_state(what: &str, err: &Error, kind: ErrorKind) {
    assert_eq!(err.kind(), kind, "{what}: {err}");
    let expected = match kind {
        ErrorKind::Unavailable
        | ErrorKind::ConnectionLost
        | ErrorKind::Transient
        | ErrorKind::Store => Disposition::Retry,
        _ => Disposition::Fatal,
    };
    assert_eq!(err.disposition(), expected, "{what}: {err}");
}
