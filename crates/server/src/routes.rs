//! The endpoints.

use std::convert::Infallible;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::stream::{self, Stream};
use serde_json::{Map, Value, json};
use subtle::ConstantTimeEq;
use turbokv_engine::{Event, RequestStream, TokenLogprob, Usage};
use turbokv_model::chat::ChatMessage;

use crate::AppState;
use crate::error::ApiError;
use crate::params::{self, Common, Fields};

type Shared = Arc<AppState>;

pub(crate) fn router(state: Shared) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .merge(v1)
        .route(
            "/health",
            get(|| async { axum::Json(json!({"status": "ok"})) }),
        )
        .route("/metrics", get(metrics))
        .fallback(|| async {
            ApiError {
                status: StatusCode::NOT_FOUND,
                message: "no such endpoint".into(),
                kind: "invalid_request_error",
                param: None,
                code: None,
            }
        })
        .layer(DefaultBodyLimit::max(state.opts.max_body_bytes))
        .with_state(state)
}

async fn auth(State(s): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.opts.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if !bool::from(given.as_bytes().ct_eq(key.as_bytes())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

async fn metrics(State(s): State<Shared>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.engine.metrics().render(),
    )
}

async fn models(State(s): State<Shared>) -> impl IntoResponse {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": s.opts.model_name,
            "object": "model",
            "created": s.created,
            "owned_by": "turbokv",
            "max_model_len": s.engine.info().max_model_len,
        }],
    }))
}

/// The body as a JSON object, with the model checked.
fn parse_body(
    s: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Map<String, Value>, ApiError> {
    let bytes = body.map_err(|e| {
        let status = e.status();
        ApiError {
            status,
            message: if status == StatusCode::PAYLOAD_TOO_LARGE {
                format!(
                    "request body exceeds the limit of {} bytes",
                    s.opts.max_body_bytes
                )
            } else {
                e.body_text()
            },
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    })?;
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    let Value::Object(map) = v else {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    };
    match map.get("model") {
        Some(Value::String(m)) if *m == s.opts.model_name => Ok(map),
        Some(Value::String(m)) => Err(ApiError::unknown_model(m, &s.opts.model_name)),
        None => Err(ApiError::bad_param("model", "`model` is required")),
        Some(_) => Err(ApiError::bad_param("model", "`model` must be a string")),
    }
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Text,
}

async fn chat(State(s): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    match chat_inner(&s, body) {
        Ok((c, stream, top)) => respond(s, Kind::Chat, c, stream, top).await,
        Err(e) => e.into_response(),
    }
}

fn chat_inner(
    s: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<(Common, RequestStream, Option<usize>), ApiError> {
    let map = parse_body(s, body)?;
    let f = Fields(&map);
    let c = params::common(&f, &["max_tokens", "max_completion_tokens"])?;
    let Some(Value::Array(msgs)) = map.get("messages") else {
        return Err(ApiError::bad_param(
            "messages",
            "`messages` must be a non-empty array",
        ));
    };
    if msgs.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "`messages` must be a non-empty array",
        ));
    }
    let mut messages = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        let param = format!("messages[{i}]");
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .filter(|r| matches!(*r, "system" | "developer" | "user" | "assistant" | "tool"))
            .ok_or_else(|| {
                ApiError::bad_param(
                    &param,
                    "`role` must be system, developer, user, assistant or tool",
                )
            })?;
        let content = match m.get("content") {
            Some(Value::String(t)) => t.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .map(|p| {
                    match (
                        p.get("type").and_then(Value::as_str),
                        p.get("text").and_then(Value::as_str),
                    ) {
                        (Some("text"), Some(t)) => Ok(t),
                        _ => Err(ApiError::bad_param(
                            &param,
                            "only text content parts are supported",
                        )),
                    }
                })
                .collect::<Result<Vec<_>, _>>()?
                .concat(),
            None | Some(Value::Null) if role == "assistant" => String::new(),
            _ => {
                return Err(ApiError::bad_param(
                    &param,
                    "`content` must be a string or an array of text parts",
                ));
            }
        };
        let role = if role == "developer" { "system" } else { role };
        messages.push(ChatMessage::new(role, content));
    }
    let top = match (f.bool("logprobs")?, f.uint("top_logprobs")?) {
        (false, Some(_)) => {
            return Err(ApiError::bad_param(
                "top_logprobs",
                "`top_logprobs` needs `logprobs`: true",
            ));
        }
        (true, n) => Some(n.unwrap_or(0) as usize),
        (false, None) => None,
    };
    if top.is_some_and(|n| n > 20) {
        return Err(ApiError::bad_param(
            "top_logprobs",
            "`top_logprobs` must be at most 20",
        ));
    }
    let text = s
        .template
        .render(&messages, true)
        .map_err(|e| ApiError::bad_param("messages", format!("the chat template failed: {e}")))?;
    let prompt = s
        .engine
        .tokenizer()
        .encode(&text, true, true)
        .map_err(|e| ApiError::bad_param("messages", e.to_string()))?;
    let req = params::request(&c, prompt, top, s.engine.info().max_model_len);
    let stream = s.engine.submit(req).map_err(ApiError::from_engine)?;
    Ok((c, stream, top))
}

async fn completions(State(s): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    match completions_inner(&s, body) {
        Ok((c, stream, top)) => respond(s, Kind::Text, c, stream, top).await,
        Err(e) => e.into_response(),
    }
}

fn completions_inner(
    s: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<(Common, RequestStream, Option<usize>), ApiError> {
    let map = parse_body(s, body)?;
    let f = Fields(&map);
    let c = params::common(&f, &["max_tokens"])?;
    if f.bool("echo")? {
        return Err(ApiError::bad_param("echo", "`echo` is not supported"));
    }
    if f.int("best_of")?.is_some_and(|b| b != 1) {
        return Err(ApiError::bad_param(
            "best_of",
            "only `best_of` = 1 is supported",
        ));
    }
    if f.string("suffix")?.is_some() {
        return Err(ApiError::bad_param("suffix", "`suffix` is not supported"));
    }
    let tok = s.engine.tokenizer();
    let bad = || {
        ApiError::bad_param(
            "prompt",
            "`prompt` must be a string, one string in an array, or an array of token ids",
        )
    };
    let prompt = match map.get("prompt") {
        Some(Value::String(t)) => tok.encode(t, true, false),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            tok.encode(a[0].as_str().unwrap_or_default(), true, false)
        }
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_u64) => Ok(a
            .iter()
            .filter_map(Value::as_u64)
            .map(|t| t as u32)
            .collect()),
        Some(Value::Array(a)) if a.len() > 1 && a.iter().all(Value::is_string) => {
            return Err(ApiError::bad_param(
                "prompt",
                "only one prompt per request is supported",
            ));
        }
        _ => return Err(bad()),
    }
    .map_err(|e| ApiError::bad_param("prompt", e.to_string()))?;
    let top = match f.uint("logprobs")? {
        Some(n) if n > 5 => {
            return Err(ApiError::bad_param(
                "logprobs",
                "`logprobs` must be at most 5",
            ));
        }
        n => n.map(|n| n as usize),
    };
    let req = params::request(&c, prompt, top, s.engine.info().max_model_len);
    let stream = s.engine.submit(req).map_err(ApiError::from_engine)?;
    Ok((c, stream, top))
}

/// A token's text for logprobs: its bytes, lossily as text.
fn token_piece(s: &AppState, id: u32) -> (String, Vec<u8>) {
    let bytes = s
        .engine
        .tokenizer()
        .token_to_piece(id)
        .map(<[u8]>::to_vec)
        .unwrap_or_default();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

fn chat_logprob(s: &AppState, lp: &TokenLogprob) -> Value {
    let entry = |id: u32, logprob: f32| {
        let (token, bytes) = token_piece(s, id);
        json!({"token": token, "logprob": logprob, "bytes": bytes})
    };
    let mut v = entry(lp.token, lp.logprob);
    v["top_logprobs"] = Value::Array(lp.top.iter().map(|&(t, l)| entry(t, l)).collect());
    v
}

/// Completions' logprobs object for `lps`, with text offsets from `offset`.
fn text_logprobs(s: &AppState, lps: &[(TokenLogprob, usize)]) -> Value {
    let tokens: Vec<String> = lps.iter().map(|(l, _)| token_piece(s, l.token).0).collect();
    let top: Vec<Value> = lps
        .iter()
        .map(|(l, _)| {
            let m: Map<String, Value> = l
                .top
                .iter()
                .map(|&(t, p)| (token_piece(s, t).0, json!(p)))
                .collect();
            Value::Object(m)
        })
        .collect();
    json!({
        "tokens": tokens,
        "token_logprobs": lps.iter().map(|(l, _)| l.logprob).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": lps.iter().map(|(_, o)| *o).collect::<Vec<_>>(),
    })
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

async fn respond(
    s: Shared,
    kind: Kind,
    c: Common,
    stream: RequestStream,
    top: Option<usize>,
) -> Response {
    let id = match kind {
        Kind::Chat => format!("chatcmpl-{}", stream.id),
        Kind::Text => format!("cmpl-{}", stream.id),
    };
    if c.stream {
        let events = sse_stream(s, kind, id, stream, c.include_usage, top.is_some());
        return Sse::new(events).into_response();
    }
    complete(s, kind, id, stream, top.is_some()).await
}

async fn complete(
    s: Shared,
    kind: Kind,
    id: String,
    mut stream: RequestStream,
    logprobs: bool,
) -> Response {
    let mut text = String::new();
    let mut lps: Vec<(TokenLogprob, usize)> = Vec::new();
    loop {
        match stream.next().await {
            Some(Event::Token {
                text: t, logprob, ..
            }) => {
                if let Some(l) = logprob {
                    lps.push((l, text.len()));
                }
                text.push_str(&t);
            }
            Some(Event::Finished {
                reason,
                usage,
                tail,
            }) => {
                text.push_str(&tail);
                let created = now();
                let model = &s.opts.model_name;
                let body = match kind {
                    Kind::Chat => json!({
                        "id": id, "object": "chat.completion", "created": created, "model": model,
                        "choices": [{
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "logprobs": if logprobs {
                                json!({"content": lps.iter().map(|(l, _)| chat_logprob(&s, l)).collect::<Vec<_>>()})
                            } else { Value::Null },
                            "finish_reason": reason.as_str(),
                        }],
                        "usage": usage_json(&usage),
                    }),
                    Kind::Text => json!({
                        "id": id, "object": "text_completion", "created": created, "model": model,
                        "choices": [{
                            "index": 0,
                            "text": text,
                            "logprobs": if logprobs { text_logprobs(&s, &lps) } else { Value::Null },
                            "finish_reason": reason.as_str(),
                        }],
                        "usage": usage_json(&usage),
                    }),
                };
                return axum::Json(body).into_response();
            }
            Some(Event::Failed(e)) => return ApiError::from_engine(e).into_response(),
            None => {
                return ApiError::from_engine(turbokv_engine::EngineError::ShuttingDown)
                    .into_response();
            }
        }
    }
}

struct SseState {
    s: Shared,
    kind: Kind,
    id: String,
    created: u64,
    stream: RequestStream,
    include_usage: bool,
    logprobs: bool,
    sent_role: bool,
    offset: usize,
    /// Chunks ready to send, then the end.
    queue: std::collections::VecDeque<String>,
    done: bool,
}

impl SseState {
    fn chunk(
        &self,
        delta_text: &str,
        logprob: Option<&TokenLogprob>,
        finish: Option<&str>,
    ) -> String {
        let s = &self.s;
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = json!({});
                if !self.sent_role {
                    delta["role"] = json!("assistant");
                }
                if !delta_text.is_empty() || finish.is_none() {
                    delta["content"] = json!(delta_text);
                }
                json!({
                    "index": 0,
                    "delta": delta,
                    "logprobs": match logprob {
                        Some(l) if self.logprobs => json!({"content": [chat_logprob(s, l)]}),
                        _ => Value::Null,
                    },
                    "finish_reason": finish,
                })
            }
            Kind::Text => json!({
                "index": 0,
                "text": delta_text,
                "logprobs": match logprob {
                    Some(l) if self.logprobs => text_logprobs(s, &[(l.clone(), self.offset)]),
                    _ => Value::Null,
                },
                "finish_reason": finish,
            }),
        };
        let object = match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Text => "text_completion",
        };
        let mut v = json!({
            "id": self.id, "object": object, "created": self.created,
            "model": s.opts.model_name, "choices": [choice],
        });
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v.to_string()
    }

    fn usage_chunk(&self, u: &Usage) -> String {
        let object = match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Text => "text_completion",
        };
        json!({
            "id": self.id, "object": object, "created": self.created,
            "model": self.s.opts.model_name, "choices": [], "usage": usage_json(u),
        })
        .to_string()
    }
}

fn sse_stream(
    s: Shared,
    kind: Kind,
    id: String,
    stream: RequestStream,
    include_usage: bool,
    logprobs: bool,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let state = SseState {
        s,
        kind,
        id,
        created: now(),
        stream,
        include_usage,
        logprobs,
        sent_role: false,
        offset: 0,
        queue: Default::default(),
        done: false,
    };
    stream::unfold(state, |mut st| async move {
        loop {
            if let Some(data) = st.queue.pop_front() {
                return Some((Ok(SseEvent::default().data(data)), st));
            }
            if st.done {
                return None;
            }
            match st.stream.next().await {
                Some(Event::Token { text, logprob, .. }) => {
                    let c = st.chunk(&text, logprob.as_ref(), None);
                    st.sent_role = true;
                    st.offset += text.len();
                    st.queue.push_back(c);
                }
                Some(Event::Finished {
                    reason,
                    usage,
                    tail,
                }) => {
                    let c = st.chunk(&tail, None, Some(reason.as_str()));
                    st.queue.push_back(c);
                    if st.include_usage {
                        let u = st.usage_chunk(&usage);
                        st.queue.push_back(u);
                    }
                    st.queue.push_back("[DONE]".into());
                    st.done = true;
                }
                Some(Event::Failed(e)) => {
                    // Headers are sent: the error travels as an event, then the end.
                    st.queue
                        .push_back(ApiError::from_engine(e).body().to_string());
                    st.queue.push_back("[DONE]".into());
                    st.done = true;
                }
                None => return None,
            }
        }
    })
}
