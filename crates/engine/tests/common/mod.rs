//! Helpers shared by the engine tests: the demo model, an engine on a thread, requests run
//! to their end, metrics read back, and references run alone.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;

use turbokv_backend::cpu::CpuBackend;
use turbokv_cache::{DirStore, KvPolicy};
use turbokv_codec::KvDtype;
use turbokv_engine::snapshots::Snapshots;
use turbokv_engine::{
    Engine, EngineHandle, EngineOptions, Event, FinishReason, GenerateRequest, Usage,
};
use turbokv_model::tokenizer::Tokenizer;
use turbokv_model::{LoadOptions, Model};

pub fn demo_model() -> Option<PathBuf> {
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

pub struct Running {
    pub handle: EngineHandle,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.handle.shutdown();
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

pub fn start(
    path: &std::path::Path,
    dtype: KvDtype,
    opts: EngineOptions,
    snapshot_dir: Option<&std::path::Path>,
) -> Running {
    start_with_policy(path, dtype, &KvPolicy::default(), opts, snapshot_dir)
}

pub fn start_with_policy(
    path: &std::path::Path,
    dtype: KvDtype,
    policy: &KvPolicy,
    opts: EngineOptions,
    snapshot_dir: Option<&std::path::Path>,
) -> Running {
    let model = Model::load(path, CpuBackend::new(), &LoadOptions::default()).unwrap();
    let tokenizer = Tokenizer::from_gguf(&model.gguf.as_ref().unwrap().metadata).unwrap();
    let (mut engine, handle) =
        Engine::new(model.transformer, Arc::new(tokenizer), dtype, policy, opts).unwrap();
    if let Some(dir) = snapshot_dir {
        engine.set_snapshots(Snapshots::new(Box::new(
            DirStore::open(dir, 1 << 30).unwrap(),
        )));
    }
    let thread = std::thread::spawn(move || engine.run());
    Running {
        handle,
        thread: Some(thread),
    }
}

pub fn prompt(handle: &EngineHandle, text: &str) -> Vec<u32> {
    handle.tokenizer().encode(text, true, true).unwrap()
}

/// Runs a request to its end: (tokens, finish reason, usage).
pub fn collect(mut s: turbokv_engine::RequestStream) -> (Vec<u32>, FinishReason, Usage) {
    let mut ids = Vec::new();
    while let Some(ev) = s.next_blocking() {
        match ev {
            Event::Token { id, .. } => ids.push(id),
            Event::Finished { reason, usage, .. } => return (ids, reason, usage),
            Event::Failed(e) => panic!("request failed: {e}"),
        }
    }
    panic!("stream ended without Finished");
}

pub fn metric(handle: &EngineHandle, name: &str) -> f64 {
    let text = handle.metrics().render();
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} not in metrics:\n{text}"))
}

/// A request run alone: its tokens and, per token, the gap in log-probability between the
/// best and the second-best token.
pub struct Reference {
    pub ids: Vec<u32>,
    pub margins: Vec<f32>,
}

pub fn reference(h: &EngineHandle, prompt: Vec<u32>, max_tokens: usize) -> Reference {
    reference_of(h, GenerateRequest::greedy(prompt, max_tokens))
}

/// [`reference`] for any request (its `logprobs` set to 2).
pub fn reference_of(h: &EngineHandle, req: GenerateRequest) -> Reference {
    collect_reference(h.submit(with_margins(req)).unwrap())
}

/// `req` asking for the top-2 log-probabilities that [`collect_reference`] reads.
pub fn with_margins(req: GenerateRequest) -> GenerateRequest {
    GenerateRequest {
        logprobs: Some(2),
        ..req
    }
}

/// Runs a request submitted [`with_margins`] to its end.
pub fn collect_reference(mut s: turbokv_engine::RequestStream) -> Reference {
    let (mut ids, mut margins) = (Vec::new(), Vec::new());
    while let Some(ev) = s.next_blocking() {
        match ev {
            Event::Token { id, logprob, .. } => {
                let top = logprob.unwrap().top;
                ids.push(id);
                margins.push(top[0].1 - top[1].1);
            }
            Event::Finished { .. } => break,
            Event::Failed(e) => panic!("{e}"),
        }
    }
    Reference { ids, margins }
}

/// Asserts that `got` equals the reference, token for token.
pub fn assert_matches(got: &[u32], want: &Reference, what: &str) {
    if let Some(i) = got.iter().zip(&want.ids).position(|(a, b)| a != b) {
        panic!(
            "{what}: token {i} differs ({} vs {}; the reference led by {} nats)\n got {got:?}\nwant {:?}",
            got[i], want.ids[i], want.margins[i], want.ids
        );
    }
    assert_eq!(got.len(), want.ids.len(), "{what}: lengths differ");
}

pub const PROMPTS: [&str; 8] = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "My favourite fruit is the banana because",
    "In 1969, humans first",
    "A list of prime numbers: 2, 3, 5,",
];

/// Shared by half of the requests below: long enough for full blocks to be shared, so that
/// requests admitted after the first ones to carry it start from the prefix cache.
pub const PREAMBLE: &str = "You are a careful assistant. Answer in one short sentence, plainly, without lists, headings or any other formatting, and do not repeat the question. ";
