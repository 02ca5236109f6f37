//! Bodies across the border: an actix-web body read as an `http_body::Body` (what the exchange
//! stores), and what the exchange returns written as an actix-web body.

use std::error::Error as StdError;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use actix_web::body::{BodySize, MessageBody};
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use idem_core::BoxError;
use pin_project_lite::pin_project;

/// A body that failed while the middleware read or wrote it.
#[derive(Debug)]
pub struct BodyError(BoxError);

impl fmt::Display for BodyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl StdError for BodyError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.0.source()
    }
}

impl From<String> for BodyError {
    fn from(message: String) -> Self {
        Self(message.into())
    }
}

impl BodyError {
    /// An actix-web body's error is not `Send`: its message is kept.
    fn from_actix(e: Box<dyn StdError>) -> Self {
        Self(e.to_string().into())
    }
}

pin_project! {
    /// An actix-web response body, as an `http_body::Body`.
    pub(crate) struct FromActix<B> {
        #[pin]
        body: B,
    }
}

impl<B> FromActix<B> {
    pub(crate) fn new(body: B) -> Self {
        Self { body }
    }
}

impl<B: MessageBody> Body for FromActix<B> {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.project().body.poll_next(cx).map(|chunk| {
            chunk.map(|r| {
                r.map(Frame::data)
                    .map_err(|e| BodyError::from_actix(e.into()))
            })
        })
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.body.size(), BodySize::None | BodySize::Sized(0))
    }

    fn size_hint(&self) -> SizeHint {
        match self.body.size() {
            BodySize::None => SizeHint::with_exact(0),
            BodySize::Sized(n) => SizeHint::with_exact(n),
            BodySize::Stream => SizeHint::default(),
        }
    }
}

pin_project! {
    /// What the exchange returns, as an actix-web body. Trailers are dropped: actix-web does
    /// not send them.
    pub(crate) struct ToActix<B> {
        #[pin]
        body: B,
    }
}

impl<B> ToActix<B> {
    pub(crate) fn new(body: B) -> Self {
        Self { body }
    }
}

impl<B> MessageBody for ToActix<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Error = BodyError;

    fn size(&self) -> BodySize {
        match self.body.size_hint().exact() {
            Some(n) => BodySize::Sized(n),
            None => BodySize::Stream,
        }
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, BodyError>>> {
        let mut body = self.project().body;
        loop {
            let Some(frame) = ready!(body.as_mut().poll_frame(cx)) else {
                return Poll::Ready(None);
            };
            match frame.map_err(|e| BodyError(e.into()))?.into_data() {
                Ok(data) if !data.is_empty() => return Poll::Ready(Some(Ok(data))),
                // Empty data and trailers: nothing to write.
                Ok(_) | Err(_) => {}
            }
        }
    }
}
