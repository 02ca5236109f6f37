//! The function-level API: any async function made idempotent by key, its result serialized
//! and replayed on a repeat.

use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;
use idem_core::store::RequestStore;
use idem_core::{
    BoxError, Error, ErrorKind, Fingerprint, IdempotencyKey, RequestErrorKind, RequestKey,
    RequestScope,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::engine::{Execution, Idempotency, Start};

mod canonical;

impl<S: RequestStore + Clone + 'static> Idempotency<S> {
    /// Runs `f` once per (`scope`, `key`) and returns its result; every repeat gets the first
    /// result back, deserialized, without running `f`.
    ///
    /// `input` is what the call is about: its JSON encoding is the fingerprint, so the same key
    /// with a different input is refused ([`RequestErrorKind::KeyReused`]) rather than replayed. The
    /// encoding is canonical: serde_json's compact JSON with the entries of every map (a
    /// `HashMap`, a `BTreeMap`, a `serde_json::Value` object, a struct with
    /// `#[serde(flatten)]`) sorted by key, so an equal input rebuilt in another iteration
    /// order is the same input; struct fields keep their declaration order. `f`
    /// writes through the store's transaction, which commits together with the stored
    /// result. An error from `f` (or a panic) is not stored: its writes roll back and a repeat
    /// runs `f` again. A repeat while the first call runs fails at once with
    /// [`RequestErrorKind::InProgress`] and a [`retry_after`](Error::retry_after).
    /// [`RequestAction::of`](idem_core::RequestAction::of) says what to do with any error it returns: retry, wait or give up.
    ///
    /// **Fingerprints from earlier versions.** Before maps were sorted the fingerprint hashed
    /// `serde_json::to_vec(input)`. The canonical encoding is byte for byte the same for every
    /// input without a map, and for maps whose serialization order already was sorted by key
    /// as a string (`BTreeMap<String, _>`, `serde_json::Value` without `preserve_order`), so
    /// their records still match. An input with a map in another order (a `HashMap`, a
    /// `BTreeMap` with integer keys, a flattened struct, a `preserve_order` object) gets a new
    /// fingerprint: a retry that straddles the upgrade is refused as [`RequestErrorKind::KeyReused`]
    /// until the earlier record expires (its TTL). A `HashMap` rarely had a repeatable
    /// fingerprint before, so this bites mainly integer-keyed `BTreeMap`s and flattened structs.
    pub async fn call<I, T, E, F>(
        &self,
        scope: RequestScope,
        key: &IdempotencyKey,
        input: &I,
        f: F,
    ) -> Result<T, Error>
    where
        I: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        E: Into<BoxError>,
        F: AsyncFnOnce(&mut S::Tx) -> Result<T, E>,
    {
        let request = RequestKey::new(scope, key.clone());
        let start = self.start(request, fingerprint_of(input)?).await?;
        let mut execution = match run_or_not(start, key) {
            Ok(execution) => execution,
            Err(not_run) => return not_run.into_result(key),
        };
        let outcome = AssertUnwindSafe(f(execution.tx())).catch_unwind().await;
        match outcome {
            Ok(Ok(value)) => {
                let stored = serde_json::to_vec(&value).map_err(|e| {
                    Error::new(
                        ErrorKind::InvalidConfig,
                        format!("the call's result does not serialize: {e}"),
                    )
                    .with_source(e)
                });
                match stored {
                    Ok(bytes) => {
                        execution.complete(&bytes).await?;
                        Ok(value)
                    }
                    Err(e) => {
                        let _ = execution.abandon().await;
                        Err(e)
                    }
                }
            }
            Ok(Err(e)) => {
                let _ = execution.abandon().await;
                // Not stored: a repeat runs `f` again.
                Err(idem_core::store::handler_error(self.store(), e.into()))
            }
            Err(panic) => {
                let _ = execution.abandon().await;
                std::panic::resume_unwind(panic)
            }
        }
    }
}

/// The fingerprint of a call's input: its canonical JSON.
pub(crate) fn fingerprint_of<I: Serialize + ?Sized>(input: &I) -> Result<Fingerprint, Error> {
    let encoded = canonical::to_vec(input).map_err(|e| {
        Error::new(
            ErrorKind::InvalidConfig,
            format!("the call's input does not serialize: {e}"),
        )
        .with_source(e)
    })?;
    Ok(Fingerprint::of(&encoded))
}

/// The execution a call's start took, or — when it found no record to run — the stored
/// result to replay or the error saying why not.
pub(crate) fn run_or_not<S: RequestStore + Clone + 'static>(
    start: Start<S>,
    key: &IdempotencyKey,
) -> Result<Execution<S>, NotRun> {
    match start {
        Start::Run(execution) => Ok(execution),
        Start::Replay(stored) => Err(NotRun::Replay(stored)),
        Start::InProgress { retry_after } => Err(NotRun::Err(
            Error::request(
                RequestErrorKind::InProgress,
                format!(
                    "a call with key {key} is still running; retry in {}s",
                    retry_after.as_secs()
                ),
            )
            .with_retry_after(retry_after),
        )),
        Start::Mismatch => Err(NotRun::Err(Error::request(
            RequestErrorKind::KeyReused,
            format!("key {key} was already used for a call with a different input"),
        ))),
    }
}

/// See [`run_or_not`].
pub(crate) enum NotRun {
    Replay(Vec<u8>),
    Err(Error),
}

impl NotRun {
    /// The replayed result deserialized, or the error.
    pub(crate) fn into_result<T: DeserializeOwned>(self, key: &IdempotencyKey) -> Result<T, Error> {
        match self {
            Self::Replay(stored) => serde_json::from_slice(&stored).map_err(|e| {
                Error::new(
                    ErrorKind::Store,
                    format!("the stored result of key {key} does not deserialize as this call's result type: {e}"),
                )
                .with_source(e)
            }),
            Self::Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests;
