//! An OpenAI-compatible HTTP server over a [`turbokv_engine::EngineHandle`]:
//! `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /health`
//! and `GET /metrics` (Prometheus, vLLM's metric names).
//!
//! Streaming answers are server-sent events in OpenAI's chunk format, ended by
//! `data: [DONE]`. A client that goes away cancels its request: the engine frees its KV blocks
//! at the next step. Bad requests get OpenAI-style error bodies with 4xx codes.
#![deny(missing_docs)]

mod error;
mod params;
mod routes;

use std::future::Future;
use std::sync::Arc;

pub use error::ApiError;
use turbokv_engine::EngineHandle;
use turbokv_model::chat::ChatTemplate;

/// How the server presents itself.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// The model id clients must name (`/v1/models` lists it).
    pub model_name: String,
    /// When set, `/v1/*` requires `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            model_name: "turbokv".into(),
            api_key: None,
            max_body_bytes: 4 << 20,
        }
    }
}

/// What every handler reads.
pub(crate) struct AppState {
    engine: EngineHandle,
    opts: ServerOptions,
    template: ChatTemplate,
    created: u64,
}

/// The router of every endpoint over `engine`.
pub fn router(engine: EngineHandle, opts: ServerOptions) -> axum::Router {
    let template = ChatTemplate::from_tokenizer_or_chatml(engine.tokenizer())
        .unwrap_or_else(|_| ChatTemplate::chatml());
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let state = Arc::new(AppState {
        engine,
        opts,
        template,
        created,
    });
    routes::router(state)
}

/// Serves `engine` on `listener` until `shutdown` resolves; then stops accepting, lets
/// in-flight responses finish, and stops the engine (which persists its prefix cache).
pub async fn serve(
    listener: tokio::net::TcpListener,
    engine: EngineHandle,
    opts: ServerOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(engine.clone(), opts);
    let result = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await;
    engine.shutdown();
    result
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down: no new requests; finishing the ones in flight");
}
