//! Turning payload bytes into the handler's type. A payload that does not decode is
//! dead-lettered at once: redelivering the same bytes cannot make them decode.

use std::fmt;
use std::marker::PhantomData;

use idem_core::BoxError;
use serde::de::DeserializeOwned;

/// Decodes a payload into `Self::Payload`.
pub trait Decode: Send + Sync + 'static {
    /// The decoded type the handler receives.
    type Payload: Send + Sync + 'static;
    /// Decodes `bytes`, or says why they are not a valid payload.
    fn decode(&self, bytes: &[u8]) -> Result<Self::Payload, BoxError>;
}

/// JSON via serde.
pub struct Json<P>(PhantomData<fn() -> P>);

impl<P> Json<P> {
    /// A JSON decoder for `P`.
    pub fn new() -> Self {
        Json(PhantomData)
    }
}

impl<P> Default for Json<P> {
    fn default() -> Self {
        Self::new()
    }
}

impl<P> Clone for Json<P> {
    fn clone(&self) -> Self {
        Self::new()
    }
}

impl<P> fmt::Debug for Json<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Json<{}>", std::any::type_name::<P>())
    }
}

impl<P: DeserializeOwned + Send + Sync + 'static> Decode for Json<P> {
    type Payload = P;
    fn decode(&self, bytes: &[u8]) -> Result<P, BoxError> {
        Ok(serde_json::from_slice(bytes)?)
    }
}

/// The raw bytes, undecoded.
#[derive(Debug, Clone, Copy, Default)]
pub struct Raw;

impl Decode for Raw {
    type Payload = Vec<u8>;
    fn decode(&self, bytes: &[u8]) -> Result<Vec<u8>, BoxError> {
        Ok(bytes.to_vec())
    }
}
