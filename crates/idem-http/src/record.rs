//! The stored response: what the engine keeps as a completed record's opaque result, and how
//! it is written (a small versioned binary format) and read back for a replay.
//!
//! Kept: the status, the headers of the allow-list ([`DEFAULT_STORED_HEADERS`], configurable
//! with [`stored_headers`](crate::IdempotencyLayer::stored_headers)), the body (or a mark that
//! it was over the storage limit and omitted) and the trailers — all of them, since a gRPC
//! reply's outcome (`grpc-status`, `grpc-message`) travels in them. Never kept, whatever the
//! allow-list says: `Set-Cookie` (a replay must not hand one client's session to a retry
//! through a shared proxy, nor resurrect a cookie the server since revoked), the hop-by-hop
//! headers of RFC 9110 §7.6.1 and any header the response's `Connection` names, and the
//! framing headers `Content-Length` and `Transfer-Encoding`, which the server derives from the
//! body again.
//!
//! Format, integers big-endian; version 1 when there are no trailers (what earlier versions
//! of this crate read), version 2 when there are:
//!
//! ```text
//! "IH" 0x01 | status u16 | flags u8 (bit 0: body omitted) | header count u16
//! | per header: name length u16, name, value length u32, value | body (the rest)
//!
//! "IH" 0x02 | status u16 | flags u8 | header count u16 | headers (as above)
//! | trailer count u16 | trailers (as headers) | body (the rest)
//! ```

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, StatusCode};

const MAGIC: &[u8; 2] = b"IH";
/// The newest format version this crate writes (and the newest it reads); a response without
/// trailers is written as version 1.
pub const RECORD_VERSION: u8 = 2;
const OMITTED: u8 = 1;

/// Response headers stored by default: those that describe the representation or point at
/// the created resource, and gRPC's status headers (a Trailers-Only reply, such as an error
/// `Status`, carries its outcome in the head).
pub const DEFAULT_STORED_HEADERS: [HeaderName; 15] = [
    header::CONTENT_TYPE,
    header::CONTENT_ENCODING,
    header::CONTENT_LANGUAGE,
    header::CONTENT_LOCATION,
    header::CONTENT_DISPOSITION,
    header::LOCATION,
    header::ETAG,
    header::LAST_MODIFIED,
    header::LINK,
    header::CACHE_CONTROL,
    header::EXPIRES,
    header::VARY,
    HeaderName::from_static("grpc-status"),
    HeaderName::from_static("grpc-message"),
    HeaderName::from_static("grpc-status-details-bin"),
];

/// Headers that are never stored, even when allow-listed.
pub const NEVER_STORED: [HeaderName; 11] = [
    header::SET_COOKIE,
    HeaderName::from_static("set-cookie2"),
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TRANSFER_ENCODING,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
    header::PROXY_AUTHENTICATE,
    header::CONTENT_LENGTH,
];

/// Whether `name` may be stored: allow-listed, not in [`NEVER_STORED`], not one the response's
/// `Connection` header names.
pub(crate) fn storable(name: &HeaderName, allow: &[HeaderName], response: &HeaderMap) -> bool {
    if !allow.contains(name) || NEVER_STORED.contains(name) {
        return false;
    }
    !response
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|token| token.trim().eq_ignore_ascii_case(name.as_str()))
}

/// A response as stored with its record, and as replayed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoredResponse {
    /// The handler's status.
    pub status: StatusCode,
    /// The kept headers, in the handler's order.
    pub headers: HeaderMap,
    /// The body; `None` when it was over the storage limit and omitted.
    pub body: Option<Bytes>,
    /// The trailers (empty when there were none, and when the body was omitted).
    pub trailers: HeaderMap,
}

/// A stored result this crate cannot read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// Not written by this crate (no `IH` magic): another API's record under the same key?
    #[error("the stored result is not an idem-http response record")]
    NotARecord,
    /// Written by a newer version of this crate.
    #[error("the stored response has format version {0}; this version reads {RECORD_VERSION}")]
    Version(u8),
    /// Cut short or inconsistent.
    #[error("the stored response is damaged: {0}")]
    Damaged(&'static str),
}

impl StoredResponse {
    /// A response with no trailers.
    pub fn new(status: StatusCode, headers: HeaderMap, body: Option<Bytes>) -> Self {
        Self {
            status,
            headers,
            body,
            trailers: HeaderMap::new(),
        }
    }

    /// Writes the record.
    pub fn encode(&self) -> Vec<u8> {
        let body = self.body.as_deref().unwrap_or_default();
        let size = |map: &HeaderMap| -> usize {
            map.iter()
                .map(|(n, v)| 6 + n.as_str().len() + v.len())
                .sum()
        };
        let version = if self.trailers.is_empty() { 1 } else { 2 };
        let mut out =
            Vec::with_capacity(10 + size(&self.headers) + size(&self.trailers) + body.len());
        out.extend_from_slice(MAGIC);
        out.push(version);
        out.extend_from_slice(&self.status.as_u16().to_be_bytes());
        out.push(if self.body.is_none() { OMITTED } else { 0 });
        write_fields(&mut out, &self.headers);
        if version == 2 {
            write_fields(&mut out, &self.trailers);
        }
        out.extend_from_slice(body);
        out
    }

    /// Reads a record back; the body shares `bytes`' buffer.
    pub fn decode(bytes: Bytes) -> Result<Self, RecordError> {
        let mut r = Reader { b: &bytes, i: 0 };
        if r.take(2) != Some(MAGIC.as_slice()) {
            return Err(RecordError::NotARecord);
        }
        let version = r.u8()?;
        if !(1..=RECORD_VERSION).contains(&version) {
            return Err(RecordError::Version(version));
        }
        let status = StatusCode::from_u16(r.u16()?)
            .map_err(|_| RecordError::Damaged("the status is out of range"))?;
        let flags = r.u8()?;
        let headers = r.fields()?;
        let trailers = if version >= 2 {
            r.fields()?
        } else {
            HeaderMap::new()
        };
        let rest = bytes.slice(r.i..);
        let body = if flags & OMITTED != 0 {
            if !rest.is_empty() {
                return Err(RecordError::Damaged("an omitted body has bytes"));
            }
            None
        } else {
            Some(rest)
        };
        Ok(Self {
            status,
            headers,
            body,
            trailers,
        })
    }
}

/// Writes a count and the fields of `map`. Header names are at most 64 KiB and values far
/// below 4 GiB in every HTTP stack; anything beyond is dropped rather than wrapped around.
fn write_fields(out: &mut Vec<u8>, map: &HeaderMap) {
    let kept: Vec<_> = map
        .iter()
        .filter(|(n, v)| n.as_str().len() <= usize::from(u16::MAX) && v.len() <= u32::MAX as usize)
        .take(usize::from(u16::MAX))
        .collect();
    out.extend_from_slice(&(kept.len() as u16).to_be_bytes());
    for (name, value) in kept {
        out.extend_from_slice(&(name.as_str().len() as u16).to_be_bytes());
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(&(value.len() as u32).to_be_bytes());
        out.extend_from_slice(value.as_bytes());
    }
}

struct Reader<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.b.get(self.i..self.i.checked_add(n)?)?;
        self.i += n;
        Some(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], RecordError> {
        self.take(N)
            .and_then(|s| s.try_into().ok())
            .ok_or(RecordError::Damaged("the record is cut short"))
    }

    fn u8(&mut self) -> Result<u8, RecordError> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, RecordError> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, RecordError> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    /// A count and that many fields.
    fn fields(&mut self) -> Result<HeaderMap, RecordError> {
        let count = self.u16()?;
        // The count comes from the store: it preallocates no more than the bytes left can
        // hold (a field takes at least 7), and a map that cannot grow is a damaged record,
        // not a panic (`HeaderMap::with_capacity` panics past 24,576; found by
        // fuzz/http_record).
        let room = usize::from(count).min((self.b.len() - self.i) / 7);
        let mut map = HeaderMap::try_with_capacity(room).unwrap_or_default();
        for _ in 0..count {
            let n = usize::from(self.u16()?);
            let name = self
                .take(n)
                .ok_or(RecordError::Damaged("a header name is cut short"))?;
            let name = HeaderName::from_bytes(name)
                .map_err(|_| RecordError::Damaged("a header name is invalid"))?;
            let n = self.u32()? as usize;
            let value = self
                .take(n)
                .ok_or(RecordError::Damaged("a header value is cut short"))?;
            let value = HeaderValue::from_bytes(value)
                .map_err(|_| RecordError::Damaged("a header value is invalid"))?;
            map.try_append(name, value)
                .map_err(|_| RecordError::Damaged("more headers than a header map holds"))?;
        }
        Ok(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(body: Option<&'static [u8]>) -> StoredResponse {
        let mut headers = HeaderMap::new();
        headers.append(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.append(header::LINK, HeaderValue::from_static("</a>; rel=a"));
        headers.append(header::LINK, HeaderValue::from_static("</b>; rel=b"));
        headers.append(
            HeaderName::from_static("x-binary"),
            HeaderValue::from_bytes(b"caf\xe9").unwrap(),
        );
        StoredResponse::new(StatusCode::CREATED, headers, body.map(Bytes::from_static))
    }

    #[test]
    fn round_trips_byte_for_byte() {
        for body in [Some(&b"{\"id\":1}"[..]), Some(&b""[..]), None] {
            let r = sample(body);
            let bytes = r.encode();
            assert_eq!(&bytes[..3], b"IH\x01");
            let back = StoredResponse::decode(Bytes::from(bytes)).unwrap();
            assert_eq!(back, r);
            let links: Vec<_> = back.headers.get_all(header::LINK).iter().collect();
            assert_eq!(links, ["</a>; rel=a", "</b>; rel=b"]);
        }
    }

    #[test]
    fn trailers_round_trip_as_version_2_and_version_1_still_reads() {
        let mut r = sample(Some(b"\x00\x00\x00\x00\x02\x08\x01"));
        r.trailers
            .append("grpc-status", HeaderValue::from_static("0"));
        r.trailers
            .append("grpc-message", HeaderValue::from_static("ok%20then"));
        let bytes = r.encode();
        assert_eq!(&bytes[..3], b"IH\x02");
        let back = StoredResponse::decode(Bytes::from(bytes.clone())).unwrap();
        assert_eq!(back, r);
        assert_eq!(back.trailers["grpc-status"], "0");
        assert_eq!(back.encode(), bytes);
        let v1 = sample(Some(b"x")).encode();
        assert_eq!(&v1[..3], b"IH\x01");
        assert!(
            StoredResponse::decode(Bytes::from(v1))
                .unwrap()
                .trailers
                .is_empty()
        );
        for cut in 3..bytes.len() - 7 {
            assert!(
                StoredResponse::decode(Bytes::copy_from_slice(&bytes[..cut])).is_err(),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn foreign_newer_and_damaged_records_are_refused() {
        assert_eq!(
            StoredResponse::decode(Bytes::from_static(b"{\"json\":1}")),
            Err(RecordError::NotARecord)
        );
        assert_eq!(
            StoredResponse::decode(Bytes::from_static(b"IH\x03\x00\xc8\x00\x00\x00")),
            Err(RecordError::Version(3))
        );
        let full = sample(Some(b"body")).encode();
        for cut in 3..full.len() - 4 {
            assert!(
                StoredResponse::decode(Bytes::copy_from_slice(&full[..cut])).is_err(),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn a_damaged_header_count_is_refused_not_a_panic() {
        // 28,672 headers declared, none there: once a panic in `HeaderMap::with_capacity`.
        assert_eq!(
            StoredResponse::decode(Bytes::from_static(b"IH\x01\x00\xc8\x00\x70\x00")),
            Err(RecordError::Damaged("the record is cut short"))
        );
        // More distinct names than a header map holds: refused, not a panic in `append`.
        let mut many = b"IH\x01\x00\xc8\x00\xff\xff".to_vec();
        for i in 0..u16::MAX {
            let name = format!("x{i}");
            many.extend_from_slice(&(name.len() as u16).to_be_bytes());
            many.extend_from_slice(name.as_bytes());
            many.extend_from_slice(&0u32.to_be_bytes());
        }
        assert_eq!(
            StoredResponse::decode(Bytes::from(many)),
            Err(RecordError::Damaged("more headers than a header map holds"))
        );
    }

    #[test]
    fn set_cookie_and_hop_by_hop_are_never_storable() {
        let mut response = HeaderMap::new();
        response.insert(
            header::CONNECTION,
            HeaderValue::from_static("close, X-Trace"),
        );
        let x_trace = HeaderName::from_static("x-trace");
        let mut allow = DEFAULT_STORED_HEADERS.to_vec();
        allow.extend(NEVER_STORED.iter().cloned());
        allow.push(x_trace.clone());
        for never in NEVER_STORED.iter().chain([&x_trace]) {
            assert!(!storable(never, &allow, &response), "{never}");
        }
        assert!(storable(&header::CONTENT_TYPE, &allow, &response));
        assert!(!storable(&header::DATE, &allow, &response));
    }
}
