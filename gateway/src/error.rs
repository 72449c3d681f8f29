//! The one error type a handler returns, and how E2B's SDK expects to see it: a status and a
//! JSON body `{"code": <status>, "message": ...}` (the control plane reads both, envd and the
//! code interpreter read `message`). Whether to retry is in the status: 5xx and 429 may be
//! retried, 4xx not.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// An answer other than success.
#[derive(Debug, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    /// The HTTP status (the SDK maps 401, 404, 429, 502 and 503 to its own exceptions).
    pub status: StatusCode,
    /// Safe to show to the caller.
    pub message: String,
    /// Answered before the request's body was read ([`ApiError::before_body`]): the connection
    /// is closed after the answer, and says so.
    pub closes: bool,
}

impl ApiError {
    /// An error with this status and message.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), closes: false }
    }

    /// The same error, answered before the request's body was read (an extractor of the
    /// headers refused it). The server then closes the connection unless the body happens to
    /// be buffered already; a client that reused it for its next request would see it close
    /// without an answer (E2B's SDK, under load). `Connection: close` tells it not to.
    pub fn before_body(self) -> Self {
        ApiError { closes: true, ..self }
    }

    /// 400: the request cannot be served as sent.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// 401: no key, or not a live one.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, message)
    }

    /// 404: no such sandbox for this key (whether it never existed or is another tenant's).
    pub fn sandbox_not_found(id: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, format!("sandbox {id} not found"))
    }

    /// 502: the sandbox is not running (killed or expired) — what E2B answers on the sandbox's
    /// own ports, which its SDK reports as a timeout of the sandbox.
    pub fn not_running(id: &str) -> Self {
        // "was not found" is what E2B's SDK looks for to raise SandboxNotRunningException.
        Self::new(StatusCode::BAD_GATEWAY, format!("sandbox {id} was not found: it was killed or its timeout passed"))
    }

    /// 501: a call of E2B's API that sandcell does not offer (see docs/e2b-compatibility.md).
    pub fn unsupported(what: &str) -> Self {
        Self::new(StatusCode::NOT_IMPLEMENTED, format!("{what} is not supported by sandcell's E2B gateway (docs/e2b-compatibility.md)"))
    }

    /// 500 or 503 from a failure of sandcell itself, logged here with its whole chain; the
    /// caller sees only that it may retry.
    pub fn internal(context: &str, e: &anyhow::Error) -> Self {
        tracing::error!(error = format!("{e:#}"), "{context}");
        Self::new(StatusCode::SERVICE_UNAVAILABLE, format!("{context}: sandcell is unavailable, retry later"))
    }
}

/// How a job sandcell refused is answered: the session gone → the sandbox not running (502,
/// what the SDK expects of a killed sandbox); over a quota → 429; the request's own content
/// refused (too many or too large files, a bad path) → 400, with sandcell's reason.
pub fn refusal(sandbox_id: &str, reason: Option<&sandcell_protocol::Reason>) -> ApiError {
    use sandcell_protocol::ErrorCode;
    let message = reason.map(|r| format!("{}: {}", r.code.as_str(), r.message)).unwrap_or_else(|| "refused".into());
    match reason.map(|r| r.code) {
        Some(ErrorCode::SessionNotFound | ErrorCode::SessionExpired | ErrorCode::SessionClosed | ErrorCode::SessionLost | ErrorCode::SessionNotReady) => {
            ApiError::not_running(sandbox_id)
        }
        Some(ErrorCode::QuotaExceeded) => ApiError::new(StatusCode::TOO_MANY_REQUESTS, message),
        Some(ErrorCode::OversizeFile | ErrorCode::OversizeMessage | ErrorCode::OversizeCode) => ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, message),
        _ => ApiError::bad_request(message),
    }
}

impl From<anyhow::Error> for ApiError {
    fn from(e: anyhow::Error) -> Self {
        ApiError::internal("internal error", &e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({"code": self.status.as_u16(), "message": self.message});
        if self.closes {
            return (self.status, [(axum::http::header::CONNECTION, "close")], axum::Json(body)).into_response();
        }
        (self.status, axum::Json(body)).into_response()
    }
}
