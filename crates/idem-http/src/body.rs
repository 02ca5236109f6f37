//! The bodies the layer hands on: the original body streamed through untouched, or bytes the
//! layer buffered (a request it fingerprinted, a response it stored, a replay, a problem).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

/// Buffered bytes and trailers, yielded as at most one data frame and one trailers frame.
#[derive(Debug, Default)]
struct Buffered {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl Buffered {
    fn new(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self {
            data: (!data.is_empty()).then_some(data),
            trailers,
        }
    }

    fn poll_frame(&mut self) -> Option<Frame<Bytes>> {
        if let Some(data) = self.data.take() {
            return Some(Frame::data(data));
        }
        self.trailers.take().map(Frame::trailers)
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.data.as_ref().map_or(0, |d| d.len() as u64))
    }
}

pin_project! {
    /// The request body the inner service receives: the original one for requests the layer
    /// passes through, or the copy it buffered to fingerprint an idempotent request.
    #[derive(Debug)]
    pub struct RequestBody<B> {
        #[pin]
        kind: ReqKind<B>,
    }
}

pin_project! {
    #[project = ReqKindProj]
    #[derive(Debug)]
    enum ReqKind<B> {
        Streaming { #[pin] body: B },
        Buffered { buffered: Buffered },
    }
}

impl<B> RequestBody<B> {
    pub(crate) fn streaming(body: B) -> Self {
        Self {
            kind: ReqKind::Streaming { body },
        }
    }

    pub(crate) fn buffered(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self {
            kind: ReqKind::Buffered {
                buffered: Buffered::new(data, trailers),
            },
        }
    }
}

impl<B: Body<Data = Bytes>> Body for RequestBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            ReqKindProj::Streaming { body } => body.poll_frame(cx),
            ReqKindProj::Buffered { buffered } => Poll::Ready(buffered.poll_frame().map(Ok)),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ReqKind::Streaming { body } => body.is_end_stream(),
            ReqKind::Buffered { buffered } => buffered.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ReqKind::Streaming { body } => body.size_hint(),
            ReqKind::Buffered { buffered } => buffered.size_hint(),
        }
    }
}

pin_project! {
    /// The response body the layer returns: the inner service's, streamed through (requests
    /// the layer passes through, responses it does not store), or bytes (stored responses,
    /// replays, problems), or a stored response's head followed by the rest of a body that
    /// was over the storage limit.
    #[derive(Debug)]
    pub struct ResponseBody<B> {
        #[pin]
        kind: ResKind<B>,
    }
}

pin_project! {
    #[project = ResKindProj]
    #[derive(Debug)]
    enum ResKind<B> {
        Streaming { #[pin] body: B },
        Buffered { buffered: Buffered },
        Prefixed { prefix: Option<Bytes>, rest: Pin<Box<B>> },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn streaming(body: B) -> Self {
        Self {
            kind: ResKind::Streaming { body },
        }
    }

    pub(crate) fn buffered(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self {
            kind: ResKind::Buffered {
                buffered: Buffered::new(data, trailers),
            },
        }
    }

    pub(crate) fn prefixed(prefix: Bytes, rest: Pin<Box<B>>) -> Self {
        Self {
            kind: ResKind::Prefixed {
                prefix: Some(prefix),
                rest,
            },
        }
    }
}

impl<B: Body<Data = Bytes>> Body for ResponseBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            ResKindProj::Streaming { body } => body.poll_frame(cx),
            ResKindProj::Buffered { buffered } => Poll::Ready(buffered.poll_frame().map(Ok)),
            ResKindProj::Prefixed { prefix, rest } => match prefix.take() {
                Some(data) => Poll::Ready(Some(Ok(Frame::data(data)))),
                None => rest.as_mut().poll_frame(cx),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ResKind::Streaming { body } => body.is_end_stream(),
            ResKind::Buffered { buffered } => buffered.is_end_stream(),
            ResKind::Prefixed { prefix, rest } => prefix.is_none() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ResKind::Streaming { body } => body.size_hint(),
            ResKind::Buffered { buffered } => buffered.size_hint(),
            ResKind::Prefixed { prefix, rest } => {
                let before = prefix.as_ref().map_or(0, |p| p.len() as u64);
                let hint = rest.size_hint();
                let mut out = SizeHint::new();
                out.set_lower(hint.lower() + before);
                if let Some(upper) = hint.upper() {
                    out.set_upper(upper + before);
                }
                out
            }
        }
    }
}

/// A response body read up to a limit.
pub(crate) enum Read<B> {
    /// All of it, within the limit.
    Whole(Bytes, Option<HeaderMap>),
    /// Over the limit: what was read (more than the limit), and the unread rest.
    Over(Bytes, Pin<Box<B>>),
}

/// Reads `body` up to `limit` bytes, keeping the rest unread when it is over.
pub(crate) async fn read_up_to<B: Body<Data = Bytes>>(
    body: B,
    limit: usize,
) -> Result<Read<B>, B::Error> {
    use http_body_util::BodyExt;

    let mut body = Box::pin(body);
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut len = 0usize;
    let mut trailers: Option<HeaderMap> = None;
    while let Some(frame) = body.frame().await {
        let frame = frame?;
        match frame.into_data() {
            Ok(data) => {
                len += data.len();
                chunks.push(data);
                if len > limit {
                    return Ok(Read::Over(concat(chunks, len), body));
                }
            }
            Err(frame) => {
                if let Ok(t) = frame.into_trailers() {
                    match &mut trailers {
                        Some(all) => all.extend(t),
                        None => trailers = Some(t),
                    }
                }
            }
        }
    }
    Ok(Read::Whole(concat(chunks, len), trailers))
}

/// One buffer from many, copying only when there is more than one.
pub(crate) fn concat(mut chunks: Vec<Bytes>, len: usize) -> Bytes {
    if chunks.len() <= 1 {
        return chunks.pop().unwrap_or_default();
    }
    let mut out = bytes::BytesMut::with_capacity(len);
    for c in chunks {
        out.extend_from_slice(&c);
    }
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full, StreamBody};

    fn chunks(parts: &[&'static str]) -> impl Body<Data = Bytes, Error = std::convert::Infallible> {
        let frames: Vec<Result<Frame<Bytes>, std::convert::Infallible>> = parts
            .iter()
            .map(|p| Ok(Frame::data(Bytes::from_static(p.as_bytes()))))
            .collect();
        StreamBody::new(futures_util::stream::iter(frames))
    }

    #[tokio::test]
    async fn reads_within_the_limit_whole() {
        let Ok(Read::Whole(data, None)) = read_up_to(chunks(&["ab", "cd"]), 4).await else {
            panic!("expected the whole body");
        };
        assert_eq!(data, "abcd");
    }

    #[tokio::test]
    async fn over_the_limit_keeps_the_rest_and_replays_all_of_it() {
        let Ok(Read::Over(prefix, rest)) = read_up_to(chunks(&["ab", "cd", "ef"]), 3).await else {
            panic!("expected an over-limit body");
        };
        assert_eq!(prefix, "abcd");
        let all = ResponseBody::prefixed(prefix, rest)
            .collect()
            .await
            .unwrap();
        assert_eq!(all.to_bytes(), "abcdef");
    }

    #[tokio::test]
    async fn buffered_bodies_have_exact_size_and_trailers() {
        let mut t = HeaderMap::new();
        t.insert("x-sum", "1".parse().unwrap());
        let body = ResponseBody::<Full<Bytes>>::buffered(Bytes::from_static(b"hey"), Some(t));
        assert_eq!(body.size_hint().exact(), Some(3));
        let c = body.collect().await.unwrap();
        assert_eq!(c.trailers().unwrap()["x-sum"], "1");
        assert_eq!(c.to_bytes(), "hey");
        let empty = RequestBody::<Full<Bytes>>::buffered(Bytes::new(), None);
        assert!(empty.is_end_stream());
    }
}
