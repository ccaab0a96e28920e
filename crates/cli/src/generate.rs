//! `turbokv run` and `turbokv chat`: load, render the prompt, prefill, stream tokens.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result, bail};
use turbokv_backend::Backend;
use turbokv_backend::cpu::CpuBackend;
use turbokv_backend::cuda::CudaBackend;
use turbokv_codec::KvDtype;
use turbokv_model::sampling::StopChecker;
use turbokv_model::tokenizer::{DecodeStream, Tokenizer};
use turbokv_model::{LoadOptions, Model, Session};

use crate::args::{CacheArgs, ChatArgs, ModelArgs, RunArgs};

/// A loaded model with its tokenizer.
pub struct Loaded<B: Backend> {
    pub model: Model<B>,
    pub tokenizer: Tokenizer,
    pub kv: KvDtype,
    /// Window, sinks, per-layer overrides, key mode and centers of the cache.
    pub policy: turbokv_cache::KvPolicy,
    /// How `--kv` is shown in stats lines.
    pub kv_label: String,
    pub ctx: usize,
}

/// The backend `--device` asked for.
pub enum Device {
    /// The CPU.
    Cpu(CpuBackend),
    /// An NVIDIA GPU.
    Cuda(Box<CudaBackend>),
}

/// Opens `--device` (`cpu`, `cuda`, `cuda:N`); a GPU that cannot be opened falls back to the
/// CPU with a one-line explanation.
pub fn select_device(spec: &str) -> Result<Device> {
    let opts = crate::env_options::from_env()?;
    let cpu = || CpuBackend::with_options(opts.cpu);
    if spec == "cpu" {
        return Ok(Device::Cpu(cpu()));
    }
    let Some(ordinal) = turbokv_backend::cuda::parse_device(spec) else {
        bail!("unknown --device {spec:?}; use cpu, cuda or cuda:N");
    };
    match CudaBackend::with_options(ordinal, &opts.cuda) {
        Ok(b) => Ok(Device::Cuda(Box::new(b))),
        Err(e) => {
            eprintln!("turbokv: {e}; falling back to the CPU");
            Ok(Device::Cpu(cpu()))
        }
    }
}

/// Runs `$body` with `$b` bound to the selected backend (one monomorphised copy per backend).
#[macro_export]
macro_rules! with_device {
    ($spec:expr, $b:ident => $body:expr) => {
        match $crate::generate::select_device($spec)? {
            $crate::generate::Device::Cpu($b) => $body,
            $crate::generate::Device::Cuda($b) => {
                let $b = *$b;
                $body
            }
        }
    };
}

/// Loads the model and tokenizer onto `backend`, validates the KV spec (`--kv`,
/// `--kv-layers`, `--key-mode`) against the model and calibrates the cache when `--kv-center`
/// (or a `+c` spec) or a fractional width asks for it.
pub fn load<B: Backend>(backend: B, args: &ModelArgs, cache: &CacheArgs) -> Result<Loaded<B>> {
    let path = args.model_path()?;
    let model = Model::load(&path, backend, &LoadOptions { progress: true })
        .with_context(|| format!("loading {}", path.display()))?;
    let tokenizer = load_tokenizer(&path, &model)?;
    prepare(model, tokenizer, cache)
}

/// [`load`]'s part after the model and tokenizer are in hand: step graphs as the environment
/// says, the KV spec checked against the model and calibrated where it asks.
pub fn prepare<B: Backend>(
    model: Model<B>,
    tokenizer: Tokenizer,
    cache: &CacheArgs,
) -> Result<Loaded<B>> {
    use crate::kvspec::{KvDefaults, KvSpec, build_policy};
    let defaults = KvDefaults::from_args(&cache.kv_opts, turbokv_cache::KvWindow::default());
    let spec = KvSpec::parse(&cache.kv, defaults)?;
    let kv_label = spec.label(&cache.kv);
    let layers = turbokv_cache::KvPolicy::parse_layers(&cache.kv_layers).context("--kv-layers")?;
    model
        .transformer
        .set_step_graphs(crate::env_options::from_env()?.step_graphs);
    let ctx = cache
        .ctx
        .unwrap_or(8192)
        .min(model.transformer.config().max_context);
    let policy = build_policy(
        &model.transformer,
        &tokenizer,
        &spec,
        &kv_label,
        (ctx, &layers),
        &mut None,
    )?;
    Ok(Loaded {
        model,
        tokenizer,
        kv: spec.dtype,
        policy,
        kv_label,
        ctx,
    })
}

fn load_tokenizer<B: Backend>(path: &Path, model: &Model<B>) -> Result<Tokenizer> {
    let tok = match &model.gguf {
        Some(g) => Tokenizer::from_gguf(&g.metadata),
        None => Tokenizer::from_hf_dir(path),
    };
    tok.with_context(|| format!("loading the tokenizer of {}", path.display()))
}

/// `turbokv run`.
pub fn run(args: &RunArgs) -> Result<()> {
    with_device!(&args.model.device, b => run_on(b, args))
}

fn run_on<B: Backend>(backend: B, args: &RunArgs) -> Result<()> {
    let loaded = load(backend, &args.model, &args.cache)?;
    let prompt = if args.raw {
        args.prompt.clone()
    } else {
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(("system".to_string(), s.clone()));
        }
        messages.push(("user".to_string(), args.prompt.clone()));
        render_chat(&loaded.tokenizer, &messages)?
    };
    let mut session = Session::with_policy(
        &loaded.model.transformer,
        loaded.kv,
        &loaded.policy,
        loaded.ctx,
    )?;
    let mut out = std::io::stdout().lock();
    let stats = generate(
        &loaded,
        &mut session,
        &prompt,
        &args.model.sampling,
        &mut out,
    )?;
    writeln!(out)?;
    print_stats(&loaded, &session, &stats);
    Ok(())
}

/// `turbokv chat`: one line per user turn; the whole conversation is re-rendered with the
/// template and only the new suffix is prefilled (earlier turns stay cached).
pub fn chat(args: &ChatArgs) -> Result<()> {
    with_device!(&args.model.device, b => chat_on(b, args))
}

fn chat_on<B: Backend>(backend: B, args: &ChatArgs) -> Result<()> {
    let loaded = load(backend, &args.model, &args.cache)?;
    let mut session = Session::with_policy(
        &loaded.model.transformer,
        loaded.kv,
        &loaded.policy,
        loaded.ctx,
    )?;
    let mut messages: Vec<(String, String)> = Vec::new();
    let stdin = std::io::stdin();
    let mut cached: Vec<u32> = Vec::new();
    eprintln!(
        "turbokv chat — {} ({}); empty line or Ctrl-D to quit",
        loaded.model.name,
        loaded.model.transformer.backend().describe()
    );
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin.read_line(&mut line)? == 0 || line.trim().is_empty() {
            break;
        }
        messages.push(("user".into(), line.trim().to_string()));
        let prompt = render_chat(&loaded.tokenizer, &messages)?;
        let ids = loaded.tokenizer.encode(&prompt, true, true)?;
        let reuse = if ids.starts_with(&cached) {
            cached.len()
        } else {
            0
        };
        if reuse == 0 {
            session.reset()?;
        }
        let mut out = std::io::stdout().lock();
        let stats = generate_ids(
            &loaded,
            &mut session,
            &ids[reuse..],
            &args.model.sampling,
            &mut out,
        )?;
        writeln!(out)?;
        // What the session holds: a prefix of the prompt and the reply (a reply's last token
        // is not always fed back).
        cached = ids;
        cached.extend(&stats.generated);
        cached.truncate(session.len());
        messages.push(("assistant".into(), stats.text.clone()));
        print_stats(&loaded, &session, &stats);
    }
    Ok(())
}

fn render_chat(tok: &Tokenizer, messages: &[(String, String)]) -> Result<String> {
    use turbokv_model::chat::{ChatMessage, ChatTemplate};
    let template = ChatTemplate::from_tokenizer(tok)
        .context("pass --raw to send the prompt without a template")?;
    let msgs: Vec<ChatMessage> = messages
        .iter()
        .map(|(role, content)| ChatMessage::new(role.as_str(), content.as_str()))
        .collect();
    Ok(template.render(&msgs, true)?)
}

/// What a generation produced.
pub struct GenStats {
    pub prompt_tokens: usize,
    pub generated: Vec<u32>,
    pub text: String,
    pub stop: &'static str,
}

fn generate<B: Backend>(
    loaded: &Loaded<B>,
    session: &mut Session<'_, B>,
    prompt: &str,
    s: &crate::args::SamplingArgs,
    out: &mut dyn Write,
) -> Result<GenStats> {
    let ids = loaded.tokenizer.encode(prompt, true, true)?;
    generate_ids(loaded, session, &ids, s, out)
}

fn generate_ids<B: Backend>(
    loaded: &Loaded<B>,
    session: &mut Session<'_, B>,
    ids: &[u32],
    s: &crate::args::SamplingArgs,
    out: &mut dyn Write,
) -> Result<GenStats> {
    use turbokv_model::sampling::{Sampler, SamplingParams};
    if ids.is_empty() {
        bail!("the prompt is empty");
    }
    let limit = loaded.ctx;
    if session.len() + ids.len() >= limit {
        bail!(
            "the prompt needs {} tokens but the context holds {limit}; shorten it or raise --ctx",
            session.len() + ids.len()
        );
    }
    let params = SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k,
        top_p: s.top_p,
        min_p: s.min_p,
        repetition_penalty: s.repeat_penalty,
        seed: Some(s.seed),
        max_tokens: s.max_tokens.max(1),
        stop: s.stop.clone(),
        ..SamplingParams::default()
    };
    let mut sampler = Sampler::new(params.clone())?;
    let mut emitted = Emitted {
        tokenizer: &loaded.tokenizer,
        decoder: loaded.tokenizer.decode_stream(true),
        stops: StopChecker::new(&params.stop),
        generated: Vec::new(),
        text: String::new(),
        stop: "max_tokens",
    };
    if params.is_greedy() {
        // The device runs a step ahead: each token is streamed while the next is computed.
        let mut write_err = None;
        session.generate_greedy(ids, s.max_tokens, |next| {
            emitted.push(next, out).unwrap_or_else(|e| {
                write_err = Some(e);
                false
            })
        })?;
        if let Some(e) = write_err {
            return Err(e.into());
        }
        if emitted.stop == "max_tokens" && emitted.generated.len() < s.max_tokens {
            emitted.stop = "context_full";
        }
    } else {
        let mut history: Vec<u32> = ids.to_vec();
        let mut logits = Vec::new();
        let mut next = step_and_sample(session, &mut sampler, &history, ids, true, &mut logits)?;
        while emitted.generated.len() < s.max_tokens && emitted.push(next, out)? {
            history.push(next);
            if session.len() + 1 >= limit {
                emitted.stop = "context_full";
                break;
            }
            next = step_and_sample(session, &mut sampler, &history, &[next], false, &mut logits)?;
        }
    }
    let Emitted {
        mut decoder,
        mut stops,
        generated,
        mut text,
        stop,
        ..
    } = emitted;
    if stop != "stop_string" {
        let tail = format!("{}{}", decoder.finish().unwrap_or(""), stops.finish());
        out.write_all(tail.as_bytes())?;
        text.push_str(&tail);
    }
    Ok(GenStats {
        prompt_tokens: ids.len(),
        generated,
        text,
        stop,
    })
}

/// The tokens generated so far, streamed as text, and why generation ended.
struct Emitted<'t> {
    tokenizer: &'t Tokenizer,
    decoder: DecodeStream,
    stops: StopChecker,
    generated: Vec<u32>,
    text: String,
    stop: &'static str,
}

impl Emitted<'_> {
    /// Takes the next token and writes the text it completes; false when generation ends
    /// with it: at EOS (not kept) or when the text reaches a stop string.
    fn push(&mut self, next: u32, out: &mut dyn Write) -> std::io::Result<bool> {
        if self.tokenizer.is_eos(next) {
            self.stop = "eos";
            return Ok(false);
        }
        self.generated.push(next);
        if let Some(piece) = self.decoder.step(self.tokenizer, next) {
            let step = self.stops.push(piece);
            out.write_all(step.text.as_bytes())?;
            out.flush()?;
            self.text.push_str(step.text);
            if step.stopped.is_some() {
                self.stop = "stop_string";
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// Feeds `tokens` (the prompt when `prefill`, else the last token) and draws the next token. When the
/// sampling parameters allow, the step copies back only the top candidates the draw needs
/// (`Sampler::candidates_needed`) instead of the vocabulary's logits; the token is the same
/// either way. `logits` is scratch for the full-logits path.
fn step_and_sample<B: Backend>(
    session: &mut Session<'_, B>,
    sampler: &mut turbokv_model::sampling::Sampler,
    history: &[u32],
    tokens: &[u32],
    prefill: bool,
    logits: &mut Vec<f32>,
) -> Result<u32> {
    if let Some(k) = sampler.candidates_needed(history) {
        let top = match tokens {
            [t] if !prefill => session.step_top_k(*t, k)?,
            _ => session.prefill_top_k(tokens, k)?,
        };
        let row = top.row(0).context("the step returned no logits")?;
        return Ok(sampler.sample_candidates(row, history)?);
    }
    let full = match tokens {
        [t] if !prefill => session.step(*t)?,
        _ => session.prefill(tokens)?,
    };
    logits.clear();
    logits.extend_from_slice(full);
    Ok(sampler.sample(logits, history)?)
}

fn print_stats<B: Backend>(loaded: &Loaded<B>, session: &Session<'_, B>, stats: &GenStats) {
    let t = session.times;
    let rate = |n: usize, d: std::time::Duration| {
        if d.as_secs_f64() > 0.0 {
            n as f64 / d.as_secs_f64()
        } else {
            0.0
        }
    };
    let per_token = session.cache().bytes_per_token();
    eprintln!(
        "[prompt {} tok, generated {} tok ({}), prefill {:.1} tok/s, decode {:.1} tok/s, KV {} {:.0} B/token, {:.2} MiB used]",
        stats.prompt_tokens,
        stats.generated.len(),
        stats.stop,
        rate(t.prefill_tokens, t.prefill),
        rate(t.decode_tokens, t.decode),
        loaded.kv_label,
        per_token,
        per_token * session.len() as f64 / (1024.0 * 1024.0),
    );
}
