//! The Connect protocol (connectrpc.com), as much of it as E2B's SDK speaks to envd, with the
//! JSON codec: unary errors, and server streaming's envelopes — a flag byte, a 4-byte big-endian
//! length, a JSON message; the last envelope has flag `0x02` and carries the stream's end.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{json, Value};

/// The flag of the envelope that ends a stream.
const END_STREAM: u8 = 0x02;

/// One envelope.
pub fn envelope(flags: u8, message: &[u8]) -> Bytes {
    let mut b = Vec::with_capacity(5 + message.len());
    b.push(flags);
    b.extend_from_slice(&(message.len() as u32).to_be_bytes());
    b.extend_from_slice(message);
    Bytes::from(b)
}

/// A message envelope.
pub fn frame(message: &Value) -> Bytes {
    envelope(0, &serde_json::to_vec(message).unwrap_or_default())
}

/// The end-of-stream envelope, with an error (Connect code, message) or without.
pub fn end_frame(error: Option<(&str, &str)>) -> Bytes {
    let body = match error {
        Some((code, message)) => json!({"error": {"code": code, "message": message}}),
        None => json!({}),
    };
    envelope(END_STREAM, &serde_json::to_vec(&body).unwrap_or_default())
}

/// The message of a streaming request's first envelope (a server-streaming call sends one).
pub fn first_message(body: &[u8]) -> Result<&[u8], String> {
    let (head, rest) = body.split_at_checked(5).ok_or("the request is shorter than an envelope's header")?;
    if head[0] & 0x01 != 0 {
        return Err("compressed envelopes are not supported".into());
    }
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    rest.get(..len).ok_or_else(|| format!("the envelope announces {len} bytes, the request has {}", rest.len()))
}

/// A streaming call that fails before it starts: status 200 and only the end envelope.
pub fn stream_error(code: &str, message: &str) -> Response {
    ([(header::CONTENT_TYPE, "application/connect+json")], end_frame(Some((code, message)))).into_response()
}

/// The HTTP status of a Connect error code (for unary calls).
fn status_of(code: &str) -> StatusCode {
    match code {
        "invalid_argument" => StatusCode::BAD_REQUEST,
        "not_found" => StatusCode::NOT_FOUND,
        "unauthenticated" => StatusCode::UNAUTHORIZED,
        "permission_denied" => StatusCode::FORBIDDEN,
        "unimplemented" => StatusCode::NOT_IMPLEMENTED,
        "unavailable" => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// The Connect code of an HTTP status (for errors made as [`crate::error::ApiError`]).
pub fn code_of(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 => "invalid_argument",
        401 => "unauthenticated",
        403 => "permission_denied",
        404 => "not_found",
        501 => "unimplemented",
        502 | 503 => "unavailable",
        _ => "internal",
    }
}

/// A unary call's error: its status and `{"code", "message"}`.
pub fn unary_error(code: &str, message: &str) -> Response {
    (status_of(code), axum::Json(json!({"code": code, "message": message}))).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_envelope_round_trips_and_a_short_or_compressed_one_is_refused() {
        let f = frame(&json!({"a": 1}));
        assert_eq!(f[0], 0);
        assert_eq!(first_message(&f), Ok(&b"{\"a\":1}"[..]));
        assert!(first_message(&f[..6]).is_err());
        assert!(first_message(&envelope(1, b"{}")).is_err());
        let end = end_frame(Some(("unavailable", "x")));
        assert_eq!(end[0], END_STREAM);
        assert_eq!(u32::from_be_bytes([end[1], end[2], end[3], end[4]]) as usize, end.len() - 5);
    }
}
