//! The real server on a loopback port, driven over HTTP by reqwest: chat and completions,
//! streamed and not, logprobs, the documented 4xx errors, a client that disconnects
//! mid-stream (its blocks are freed: /metrics shows it), concurrency, and prefix-cache hits
//! in `usage.prompt_tokens_details.cached_tokens`.

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{Value, json};
use turbokv_backend::cpu::CpuBackend;
use turbokv_cache::KvPolicy;
use turbokv_engine::{DecodeBatching, DecodeBuckets, Engine, EngineOptions};
use turbokv_model::tokenizer::Tokenizer;
use turbokv_model::{LoadOptions, Model};
use turbokv_server::ServerOptions;

fn demo_model() -> Option<PathBuf> {
    let path = std::env::var_os("TURBOKV_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/turbokv/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI must have the demo model: run scripts/fetch-assets.sh"
    );
    eprintln!("SKIPPED: demo model not found at {}", path.display());
    None
}

const MODEL: &str = "demo";

struct Server {
    base: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
    engine: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    async fn start(api_key: Option<&str>, opts: EngineOptions) -> Option<Self> {
        let path = demo_model()?;
        let model = Model::load(&path, CpuBackend::new(), &LoadOptions::default()).unwrap();
        let tokenizer = Tokenizer::from_gguf(&model.gguf.as_ref().unwrap().metadata).unwrap();
        let (engine, handle) = Engine::new(
            model.transformer,
            Arc::new(tokenizer),
            "int8".parse().unwrap(),
            &KvPolicy::default(),
            opts,
        )
        .unwrap();
        let engine = std::thread::spawn(move || engine.run());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let sopts = ServerOptions {
            model_name: MODEL.into(),
            api_key: api_key.map(str::to_string),
            max_body_bytes: 64 * 1024,
        };
        let task = tokio::spawn(async move {
            turbokv_server::serve(listener, handle, sopts, async {
                let _ = rx.await;
            })
            .await
            .unwrap();
        });
        Some(Self {
            base,
            stop: Some(stop),
            task: Some(task),
            engine: Some(engine),
        })
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.take().unwrap().await.unwrap();
        let engine = self.engine.take().unwrap();
        tokio::task::spawn_blocking(move || engine.join().unwrap())
            .await
            .unwrap();
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = reqwest::Client::new()
            .post(format!("{}{path}", self.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap())
    }

    /// A streamed request's `data:` payloads, in order.
    async fn post_stream(&self, path: &str, body: Value) -> Vec<String> {
        let r = reqwest::Client::new()
            .post(format!("{}{path}", self.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        assert!(
            r.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/event-stream")
        );
        let text = r.text().await.unwrap();
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }

    async fn metric(&self, name: &str) -> f64 {
        let text = reqwest::get(format!("{}/metrics", self.base))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} not in /metrics:\n{text}"))
    }
}

fn chat_body(content: &str, extra: Value) -> Value {
    let mut b = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "temperature": 0,
    });
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_completions_streamed_and_not() {
    let Some(s) = Server::start(None, EngineOptions::default()).await else {
        return;
    };
    let (status, full) = s
        .post(
            "/v1/chat/completions",
            chat_body("Name a colour.", json!({})),
        )
        .await;
    assert_eq!(status, 200, "{full}");
    assert_eq!(full["object"], "chat.completion");
    let content = full["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!content.is_empty());
    assert_eq!(full["choices"][0]["message"]["role"], "assistant");
    let usage = &full["usage"];
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
    );

    // The same request streamed: role first, the same text, finish reason, usage, [DONE].
    let events = s
        .post_stream(
            "/v1/chat/completions",
            chat_body(
                "Name a colour.",
                json!({"stream": true, "stream_options": {"include_usage": true}}),
            ),
        )
        .await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .filter_map(|c| c["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, content);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"].as_array().unwrap().len(), 0);
    assert_eq!(
        last["usage"]["completion_tokens"],
        usage["completion_tokens"]
    );
    let finish = &chunks[chunks.len() - 2]["choices"][0]["finish_reason"];
    assert_eq!(finish, &full["choices"][0]["finish_reason"]);

    // Completions with logprobs, then streamed.
    let body = json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "logprobs": 2});
    let (status, c) = s.post("/v1/completions", body.clone()).await;
    assert_eq!(status, 200, "{c}");
    assert_eq!(c["object"], "text_completion");
    let text = c["choices"][0]["text"].as_str().unwrap().to_string();
    let lp = &c["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 4);
    assert_eq!(lp["tokens"].as_array().unwrap().concat_strings(), text);
    for (l, top) in lp["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .zip(lp["top_logprobs"].as_array().unwrap())
    {
        let l = l.as_f64().unwrap();
        assert!(l <= 0.0);
        let best = top
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!(
            (best - l).abs() < 1e-5,
            "greedy picks the most likely token"
        );
    }
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb.as_object_mut().unwrap().remove("logprobs");
    let events = s.post_stream("/v1/completions", sb).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let streamed: String = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(streamed, text);

    // Chat logprobs, and a stop string that cuts the text.
    let (_, lc) = s
        .post(
            "/v1/chat/completions",
            chat_body(
                "Name a colour.",
                json!({"logprobs": true, "top_logprobs": 3}),
            ),
        )
        .await;
    let content_lp = lc["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content_lp.len() as u64,
        lc["usage"]["completion_tokens"].as_u64().unwrap()
    );
    assert_eq!(content_lp[0]["top_logprobs"].as_array().unwrap().len(), 3);
    let (_, models) = s.post_models().await;
    assert_eq!(models["data"][0]["id"], MODEL);
    s.stop().await;
}

trait ConcatStrings {
    fn concat_strings(&self) -> String;
}
impl ConcatStrings for Vec<Value> {
    fn concat_strings(&self) -> String {
        self.iter().filter_map(Value::as_str).collect()
    }
}

impl Server {
    async fn post_models(&self) -> (u16, Value) {
        let r = reqwest::get(format!("{}/v1/models", self.base))
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_their_documented_errors() {
    let Some(s) = Server::start(
        Some("sekrit"),
        EngineOptions {
            max_model_len: 256,
            ..Default::default()
        },
    )
    .await
    else {
        return;
    };
    let client = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", s.base);
    let send = |auth: Option<&'static str>, body: String| {
        let mut r = client
            .post(&url)
            .header("content-type", "application/json")
            .body(body);
        if let Some(a) = auth {
            r = r.header("authorization", a);
        }
        r.send()
    };
    let ok = chat_body("hi", json!({})).to_string();
    let r = send(None, ok.clone()).await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["type"], "authentication_error");
    assert_eq!(
        send(Some("Bearer wrong"), ok.clone())
            .await
            .unwrap()
            .status()
            .as_u16(),
        401
    );
    assert_eq!(
        send(Some("Bearer sekrit"), ok)
            .await
            .unwrap()
            .status()
            .as_u16(),
        200
    );
    // Health and metrics stay open.
    assert_eq!(
        reqwest::get(format!("{}/health", s.base))
            .await
            .unwrap()
            .status()
            .as_u16(),
        200
    );

    let cases: Vec<(String, u16, Option<&str>, Option<&str>)> = vec![
        ("{not json".into(), 400, None, None),
        ("[1, 2]".into(), 400, None, None),
        (
            json!({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}).to_string(),
            404,
            Some("model"),
            Some("model_not_found"),
        ),
        (
            json!({"messages": [{"role": "user", "content": "hi"}]}).to_string(),
            400,
            Some("model"),
            None,
        ),
        (
            json!({"model": MODEL, "messages": []}).to_string(),
            400,
            Some("messages"),
            None,
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}).to_string(),
            400,
            Some("messages[0]"),
            None,
        ),
        (
            chat_body("hi", json!({"temperature": 5})).to_string(),
            400,
            Some("temperature"),
            None,
        ),
        (
            chat_body("hi", json!({"temperature": "hot"})).to_string(),
            400,
            Some("temperature"),
            None,
        ),
        (
            chat_body("hi", json!({"max_tokens": 0})).to_string(),
            400,
            Some("max_tokens"),
            None,
        ),
        (
            chat_body("hi", json!({"top_p": 0})).to_string(),
            400,
            Some("top_p"),
            None,
        ),
        (
            chat_body("hi", json!({"n": 2})).to_string(),
            400,
            Some("n"),
            None,
        ),
        (
            chat_body("hi", json!({"stop": ["a", "b", "c", "d", "e"]})).to_string(),
            400,
            Some("stop"),
            None,
        ),
        (
            chat_body("hi", json!({"top_logprobs": 3})).to_string(),
            400,
            Some("top_logprobs"),
            None,
        ),
        (
            chat_body("hi", json!({"frequency_penalty": 3})).to_string(),
            400,
            Some("frequency_penalty"),
            None,
        ),
        (
            chat_body("hi", json!({"stream_options": {"include_usage": true}})).to_string(),
            400,
            Some("stream_options"),
            None,
        ),
        (
            chat_body("hi", json!({"max_tokens": 1000})).to_string(),
            400,
            None,
            Some("context_length_exceeded"),
        ),
        (
            chat_body(&"word ".repeat(20_000), json!({})).to_string(),
            413,
            None,
            None,
        ),
    ];
    for (body, status, param, code) in cases {
        let r = send(Some("Bearer sekrit"), body.clone()).await.unwrap();
        let got = r.status().as_u16();
        let e: Value = r.json().await.unwrap_or(Value::Null);
        let short = &body[..body.len().min(80)];
        assert_eq!(got, status, "{short}: {e}");
        assert!(
            e["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{short}: {e}"
        );
        if let Some(p) = param {
            assert_eq!(e["error"]["param"], p, "{short}: {e}");
        }
        if let Some(c) = code {
            assert_eq!(e["error"]["code"], c, "{short}: {e}");
        }
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_stream_frees_its_blocks() {
    let Some(s) = Server::start(None, EngineOptions::default()).await else {
        return;
    };
    let body = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": true, "stream": true});
    let mut r = reqwest::Client::new()
        .post(format!("{}/v1/completions", s.base))
        .json(&body)
        .send()
        .await
        .unwrap();
    for _ in 0..3 {
        r.chunk().await.unwrap().unwrap();
    }
    assert!(s.metric("turbokv:kv_blocks_used").await > 0.0);
    assert_eq!(s.metric("vllm:num_requests_running").await, 1.0);
    drop(r);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while s.metric("turbokv:kv_blocks_used").await > 0.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "blocks still held after the client left"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(s.metric("vllm:num_requests_running").await, 0.0);
    assert_eq!(
        s.metric("vllm:request_success_total{finished_reason=\"abort\"}")
            .await,
        1.0
    );
    s.stop().await;
}

/// 32 greedy chat requests at once, all sharing a cached system prompt: each completes, each
/// starts from the prefix cache, and each equals the same request run alone on a server of
/// its own without prefix caching, token for token and log-probability for log-probability.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_equal_each_alone_and_shared_prefixes_hit_the_cache() {
    let system = "You are a helpful assistant who answers questions about geography, history and science in one short sentence, without lists.";
    let ask = |q: String| {
        json!({"model": MODEL, "temperature": 0, "max_tokens": 8,
               "logprobs": true, "top_logprobs": 2,
               "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]})
    };
    let topics = [
        "ocean", "desert", "mountain", "river", "lake", "island", "forest", "city",
    ];
    let questions: Vec<String> = (0..32)
        .map(|i| format!("Question {i}: what is the largest {}?", topics[i % 8]))
        .collect();
    let alone_opts = EngineOptions {
        prefix_caching: false,
        ..EngineOptions::default()
    };
    let Some(solo) = Server::start(None, alone_opts).await else {
        return;
    };
    let mut alone = Vec::new();
    for q in &questions {
        let (status, v) = solo.post("/v1/chat/completions", ask(q.clone())).await;
        assert_eq!(status, 200, "{v}");
        alone.push(v);
    }
    solo.stop().await;

    // Decode steps padded to batch-size buckets (what CUDA serving runs): the placeholder
    // rows must change no request's output.
    let padded = EngineOptions {
        decode_batching: DecodeBatching::Buckets(DecodeBuckets::for_max_seqs(64)),
        ..EngineOptions::default()
    };
    let s = Arc::new(Server::start(None, padded).await.unwrap());
    let (_, first) = s
        .post(
            "/v1/chat/completions",
            ask("What is the largest ocean?".into()),
        )
        .await;
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let tasks: Vec<_> = questions
        .iter()
        .map(|q| {
            let s = s.clone();
            let body = ask(q.clone());
            tokio::spawn(async move { s.post("/v1/chat/completions", body).await })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        let (status, v) = t.await.unwrap();
        assert_eq!(status, 200, "{v}");
        let u = &v["usage"];
        assert!(u["completion_tokens"].as_u64().unwrap() >= 1);
        assert!(
            u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
                >= 16,
            "{u}"
        );
        let (got, want) = (&v["choices"][0], &alone[i]["choices"][0]);
        assert_eq!(got["message"], want["message"], "request {i}");
        assert_eq!(got["logprobs"], want["logprobs"], "request {i}");
        assert_eq!(
            u["completion_tokens"],
            alone[i]["usage"]["completion_tokens"]
        );
    }
    assert!(
        s.metric("turbokv:num_requests_running_peak").await >= 16.0,
        "the requests must have run together"
    );
    assert!(
        s.metric("turbokv:decode_padding_rows_total").await > 0.0,
        "some decode steps must have been padded"
    );
    let (_, again) = s
        .post(
            "/v1/chat/completions",
            ask("What is the largest ocean?".into()),
        )
        .await;
    assert_eq!(
        again["choices"][0]["message"]["content"],
        first["choices"][0]["message"]["content"]
    );
    let prompt = again["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        (prompt - 1) / 16 * 16
    );
    assert!(s.metric("vllm:prefix_cache_hits_total").await > 0.0);
    Arc::into_inner(s).unwrap().stop().await;
}
