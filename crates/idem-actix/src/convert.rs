//! actix-web 4 speaks `http` 0.2, the exchange `http` 1: heads are copied across, name by name
//! and byte for byte (both accept the same bytes).

use actix_web::HttpResponse;
use actix_web::body::BoxBody;
use actix_web::dev::ServiceRequest;
use actix_web::http::StatusCode as ActixStatus;
use actix_web::http::header::{
    HeaderMap as ActixHeaders, HeaderName as ActixName, HeaderValue as ActixValue,
};
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Response, StatusCode, Uri};
use http_body::Body;
use idem_core::BoxError;

use crate::body::ToActix;

/// The request's head as `http` 1 parts (method, the URI as the client sent it, headers);
/// `None` if one of them does not convert, which a request actix-web parsed cannot cause.
pub(crate) fn request_parts(req: &ServiceRequest) -> Option<http::request::Parts> {
    let (mut parts, ()) = http::Request::new(()).into_parts();
    parts.method = Method::from_bytes(req.method().as_str().as_bytes()).ok()?;
    parts.uri = Uri::try_from(req.uri().to_string()).ok()?;
    parts.headers = headers_from_actix(req.headers())?;
    Some(parts)
}

/// `http` 1 headers from actix-web's.
pub(crate) fn headers_from_actix(headers: &ActixHeaders) -> Option<HeaderMap> {
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers.iter() {
        out.append(
            HeaderName::from_bytes(name.as_str().as_bytes()).ok()?,
            HeaderValue::from_bytes(value.as_bytes()).ok()?,
        );
    }
    Some(out)
}

/// The head of an actix-web response as `http` 1 parts.
pub(crate) fn response_parts<B>(res: &HttpResponse<B>) -> Option<http::response::Parts> {
    let (mut parts, ()) = Response::new(()).into_parts();
    parts.status = StatusCode::from_u16(res.status().as_u16()).ok()?;
    parts.headers = headers_from_actix(res.headers())?;
    Some(parts)
}

/// An `http` 1 response as actix-web's.
pub(crate) fn response<B>(res: Response<B>) -> HttpResponse<BoxBody>
where
    B: Body<Data = Bytes> + 'static,
    B::Error: Into<BoxError>,
{
    let (parts, body) = res.into_parts();
    let status =
        ActixStatus::from_u16(parts.status.as_u16()).unwrap_or(ActixStatus::INTERNAL_SERVER_ERROR);
    let mut out = HttpResponse::with_body(status, BoxBody::new(ToActix::new(body)));
    for (name, value) in &parts.headers {
        if let (Ok(name), Ok(value)) = (
            ActixName::from_bytes(name.as_str().as_bytes()),
            ActixValue::from_bytes(value.as_bytes()),
        ) {
            out.headers_mut().append(name, value);
        }
    }
    out
}
