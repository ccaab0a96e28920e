//! OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use turbokv_engine::EngineError;

/// An error answered to the client with its status and an OpenAI-style body.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status (4xx for the client's mistakes).
    pub status: StatusCode,
    /// What went wrong and what to do.
    pub message: String,
    /// OpenAI's error type, e.g. `invalid_request_error`.
    pub kind: &'static str,
    /// The offending parameter, if one.
    pub param: Option<String>,
    /// A machine-readable code, e.g. `model_not_found`.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 for parameter `param`.
    pub fn bad_param(param: &str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_string()),
            code: None,
        }
    }

    /// 400 for the request as a whole.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// 404 for a model this server does not serve.
    pub fn unknown_model(asked: &str, served: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{asked}` does not exist. This server serves `{served}`."),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    /// 401.
    pub fn unauthorized() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: "Invalid or missing API key: send `Authorization: Bearer <key>`.".into(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// The status and body of an engine refusal.
    pub fn from_engine(e: EngineError) -> Self {
        let (status, code, param) = match &e {
            EngineError::ContextOverflow { .. } => (
                StatusCode::BAD_REQUEST,
                Some("context_length_exceeded"),
                Some("messages"),
            ),
            EngineError::TooLargeForCache { .. } => (
                StatusCode::BAD_REQUEST,
                Some("context_length_exceeded"),
                None,
            ),
            EngineError::EmptyPrompt => (StatusCode::BAD_REQUEST, None, Some("prompt")),
            EngineError::InvalidParam(_) => (StatusCode::BAD_REQUEST, None, None),
            EngineError::ShuttingDown => (StatusCode::SERVICE_UNAVAILABLE, None, None),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, None, None),
        };
        Self {
            status,
            message: e.to_string(),
            kind: if status.is_client_error() {
                "invalid_request_error"
            } else {
                "server_error"
            },
            param: param.map(str::to_string),
            code,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}
