//! Command-line arguments. Only this crate reads environment variables.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use turbokv_codec::KeyMode;

/// turbokv: LLM inference with a compressed, paged KV cache.
#[derive(Parser, Debug)]
#[command(version, about)]
pub struct Cli {
    /// More logging (-v info, -vv debug); TURBOKV_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    #[command(subcommand)]
    pub command: Command,
}

#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate a completion for one prompt, streaming tokens to stdout.
    Run(RunArgs),
    /// Interactive chat using the model's chat template.
    Chat(ChatArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Quality evaluations.
    #[command(subcommand)]
    Eval(EvalCommand),
    /// An OpenAI-compatible HTTP server (continuous batching, prefix cache).
    Serve(ServeArgs),
}

/// `turbokv serve`.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cache: CacheArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the URL is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Most requests generating at once.
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Most prompt tokens prefilled per step.
    #[arg(long, default_value_t = 512)]
    pub max_batched_tokens: usize,
    /// KV cache memory over all requests, e.g. 512MiB, 2GiB.
    #[arg(long, default_value = "1GiB")]
    pub kv_memory: String,
    /// Keep prefix-cache blocks in this directory across restarts.
    #[arg(long)]
    pub prefix_cache_dir: Option<PathBuf>,
    /// Size bound of --prefix-cache-dir (least recently used blocks go first).
    #[arg(long, default_value = "4GiB")]
    pub prefix_cache_disk: String,
    /// Require `Authorization: Bearer KEY` on /v1/*.
    #[arg(long, env = "TURBOKV_API_KEY")]
    pub api_key: Option<String>,
    /// The model id clients send (default: the model file's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Turn the prefix cache off.
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// Room admission keeps for the running requests' growth: tokens of lookahead per
    /// request, `full` (up to each request's max_tokens: never preempts) or `none`.
    #[arg(long, default_value = "64")]
    pub growth_reserve: turbokv_engine::GrowthReserve,
    /// KV blocks admission keeps free beyond every need, as a fraction of the pool.
    #[arg(long, default_value_t = 0.01)]
    pub kv_watermark: f32,
    /// Batch sizes decode steps are padded to so that their CUDA graphs replay: `auto` (the
    /// default ladder for --max-num-seqs where steps replay as graphs, none on the CPU),
    /// `none`, or sizes like 1,2,4,8,16,32,64.
    #[arg(long, default_value = "auto")]
    pub decode_buckets: String,
    /// How logits come back for sampling: `candidates` (each row's best few, selected on the
    /// device, wherever the request's sampling parameters allow) or `full` (whole rows).
    #[arg(long, value_enum, default_value_t = LogitsArg::Candidates)]
    pub logits: LogitsArg,
    /// Serve a model of this shape (llama3-8b, qwen3-8b, smollm2-135m) with random weights
    /// and a built-in byte-level tokenizer instead of --model: a benchmarking aid for load
    /// tests without model files (its output is noise; send token ids for exact prompts).
    #[arg(long)]
    pub random_shape: Option<String>,
}

/// `serve --logits`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsArg {
    /// Each row's best candidates where they suffice, else whole rows.
    Candidates,
    /// Whole rows, always.
    Full,
}

#[derive(Subcommand, Debug)]
pub enum EvalCommand {
    /// Perplexity, KL vs a bf16 KV cache and top-1 agreement, per KV dtype.
    Ppl(EvalPplArgs),
    /// Layer sensitivity of a KV spec on calibration text: KL from bf16 when one layer's keys
    /// or values get a bit more or less, and a per-layer bit allocation within a budget.
    Sensitivity(EvalSensitivityArgs),
}

/// `turbokv eval sensitivity`.
#[derive(Args, Debug, Clone)]
pub struct EvalSensitivityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The KV spec to probe (a dtype, preset or windowed dtype, with its own overrides).
    #[arg(long, default_value = "compact")]
    pub kv: String,
    /// Most tokens per probe text (each text is one window from its start).
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Width changes tried on one layer's keys, then its values, in bits (widths stay within
    /// 1..=4 bits in half-bit steps), comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "-1,1",
        allow_hyphen_values = true
    )]
    pub steps: Vec<f64>,
    /// Calibration texts to probe on instead of the built-in ones (prose, code, dialogue),
    /// comma-separated; a file that shares a passage with the evaluation set
    /// (`data/eval` in the cache) is refused.
    #[arg(long, value_delimiter = ',')]
    pub text: Vec<PathBuf>,
    /// Propose per-layer overrides that keep the cache within this many bits per element at
    /// `--budget-ctx` tokens (greedy on measured KL per bit).
    #[arg(long)]
    pub budget: Option<f64>,
    /// Context at which `--budget` counts the window's and centers' bits.
    #[arg(long, default_value_t = 1024)]
    pub budget_ctx: usize,
    /// Also write every probe as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Probe each kv head of each layer instead of whole layers (whole widths only; ranked
    /// by ΔKL per bit; `--budget` then refused). From a near-lossless spec with a negative
    /// step (`--kv tq4@w2.9%s1q8+cn --steps -2`), the heads whose coarse keys hurt most: the
    /// candidates for `[LAYER.HEAD:DTYPE]` overrides.
    #[arg(long)]
    pub heads: bool,
}

/// `turbokv eval ppl`.
#[derive(Args, Debug, Clone)]
pub struct EvalPplArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Evaluation texts, comma-separated: files, or directories whose `*.txt` files are each
    /// one text (default: the evaluation set of scripts/fetch-assets.sh, `data/eval` in the
    /// cache: Wikipedia prose, Python source, dialogue). Each text is reported on its own
    /// and the worst case over all of them after.
    #[arg(long, value_delimiter = ',')]
    pub text: Vec<PathBuf>,
    /// Tokens per window.
    #[arg(long, default_value_t = 1024)]
    pub ctx: usize,
    /// Windows (consecutive, non-overlapping).
    #[arg(long, default_value_t = 4)]
    pub windows: usize,
    /// Score the last N tokens of each window through one-token decode steps (the kernels
    /// that generation runs) instead of the prefill's; 0 prefills the whole window.
    #[arg(long, default_value_t = 0)]
    pub decode_last: usize,
    /// KV caches to compare with bf16, comma-separated: dtypes (f16,int8,fp8,tq4,tq3,k4v3),
    /// presets (balanced, compact, tiny), or a dtype with its own full-precision window,
    /// `k4v3@w16s1` (16 most recent tokens and 1 sink token exact); `/prod` or `/mse` after the
    /// dtype sets the key mode of that entry (`tq4/prod`), a trailing `+c` centers it (`tq3+c`).
    /// A list may hold head overrides whose own commas sit inside brackets
    /// (`tiny,tq2[18.2,23.0:k3v2]`).
    #[arg(long, default_value = "f16")]
    pub kv: Vec<String>,
    #[command(flatten)]
    pub kv_opts: KvOptArgs,
    /// Most recent tokens kept at f16 for compressed entries without their own `@w…`.
    #[arg(long, default_value_t = 0)]
    pub kv_window: usize,
    /// First ("sink") tokens kept at f16 for compressed entries without their own `@…s…`.
    #[arg(long, default_value_t = 0)]
    pub kv_sinks: usize,
    /// Per-layer dtype overrides for every compared cache, e.g. `0:bf16,-1:bf16`.
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    pub kv_layers: String,
    /// Also write the rows as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Also draw perplexity and KL against bits per element as an SVG (one colour per text,
    /// every KV cache a labelled point).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Also report, per text and KV cache, which tokens carry the loss: KL and ΔNLL by the
    /// kind of token predicted, by quarter of the window and at positions that repeat an
    /// earlier bigram, how concentrated the KL is, and the N positions with the most KL (0:
    /// no report).
    #[arg(long, default_value_t = 0)]
    pub token_report: usize,
    /// Evaluate nothing: report the texts of earlier runs' `--json` files side by side
    /// (tables, worst case, `--json`, `--plot`), e.g. of one run per text.
    #[arg(long, value_delimiter = ',')]
    pub from_json: Vec<PathBuf>,
}

// Parsed once per process; boxing the large variant would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Codec distortion vs the paper, encode and scoring throughput.
    Codec {
        /// Also write the rows as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Prefill and decode speed of a model on the CPU.
    Model(BenchModelArgs),
    /// Decode (and prefill) speed of a real-shaped model against the memory roofline.
    Decode(BenchDecodeArgs),
    /// Decode attention alone on the GPU against the copy bandwidth and PyTorch SDPA.
    Attention(BenchAttentionArgs),
}

/// Where the model is and how to run it.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A .gguf file or a Hugging Face model directory. Default: $TURBOKV_MODEL, else the demo
    /// model fetched by scripts/fetch-assets.sh.
    #[arg(long, env = "TURBOKV_MODEL")]
    pub model: Option<PathBuf>,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Device: cpu, cuda or cuda:N (falls back to the CPU when no GPU can be opened).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// The KV cache's number format.
#[derive(Args, Debug, Clone)]
pub struct CacheArgs {
    /// KV cache: f16, bf16, int8, fp8 (e4m3), tq4/tq3/tq2, tq3.5/tq2.5, k{b}v{b}, a preset
    /// (balanced, compact, tiny), or a compressed format with a full-precision window
    /// (`k4v3@w32s1`: the 32 most recent and the first token kept at f16); `tq4/prod` sets the
    /// key mode, a trailing `+c` centers the cache (`tq3+c`).
    #[arg(long, default_value = "f16")]
    pub kv: String,
    /// Maximum context (prompt + generated tokens); default: the model's, capped at 8192.
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Per-layer dtype overrides, e.g. `0:bf16,-1:bf16` (negative = from the last layer).
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    pub kv_layers: String,
    #[command(flatten)]
    pub kv_opts: KvOptArgs,
}

impl CacheArgs {
    /// `--kv KV` with every other cache option at its default.
    pub fn plain(kv: &str, ctx: Option<usize>) -> Self {
        Self {
            kv: kv.into(),
            ctx,
            kv_layers: String::new(),
            kv_opts: KvOptArgs::default(),
        }
    }
}

/// Key mode and centering of compressed KV caches (every command that takes `--kv`).
#[derive(Args, Debug, Clone, Default)]
pub struct KvOptArgs {
    /// How TurboQuant keys are coded: `mse` (Lloyd–Max codes) or `prod` (one bit fewer plus a
    /// 1-bit QJL sketch of the residual: unbiased scores, more variance). A `/mse` or `/prod`
    /// in a `--kv` spec overrides it.
    #[arg(long, value_enum, default_value_t = KeyModeArg::Mse)]
    pub key_mode: KeyModeArg,
    /// Center keys and values per (layer, kv head) by means from a short calibration pass at
    /// load (exact; frees the codes from the keys' common direction); keeps the first token
    /// exact, since its key lies far from the mean. Same as a `+c` suffix.
    #[arg(long)]
    pub kv_center: bool,
}

/// `--key-mode`.
#[derive(ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KeyModeArg {
    /// TurboQuant-MSE keys.
    #[default]
    Mse,
    /// TurboQuant-prod keys (MSE codes one bit narrower plus a QJL residual sketch).
    Prod,
}

impl From<KeyModeArg> for KeyMode {
    fn from(m: KeyModeArg) -> Self {
        match m {
            KeyModeArg::Mse => KeyMode::Mse,
            KeyModeArg::Prod => KeyMode::Prod,
        }
    }
}

/// `turbokv chat`.
#[derive(Args, Debug, Clone)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cache: CacheArgs,
}

/// Sampling controls.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Maximum tokens to generate.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens below this fraction of the top probability (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Repetition penalty (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop when this string is generated (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
}

/// `turbokv run`.
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cache: CacheArgs,
    /// The prompt.
    #[arg(long)]
    pub prompt: String,
    /// Send the prompt raw, without the model's chat template.
    #[arg(long)]
    pub raw: bool,
    /// System prompt for the chat template.
    #[arg(long)]
    pub system: Option<String>,
}

/// `turbokv bench model`.
#[derive(Args, Debug, Clone)]
pub struct BenchModelArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cache: CacheArgs,
    /// Prompt lengths to measure (tokens of the evaluation text, or synthetic).
    #[arg(long, value_delimiter = ',', default_value = "128,1024")]
    pub prompt_tokens: Vec<usize>,
    /// Tokens to decode after each prompt.
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Repeats; the median is reported. With `--interleave`: rounds of decode segments.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// More KV caches (comma-separated specs, as `--kv`) measured in the same process
    /// against `--kv`'s: every cache prefills each of `--repeats` parts of the prompt in
    /// turn, then decodes `--gen-tokens` tokens in turn, `--repeats` rounds, the order
    /// reversed every other round, so the machine's drift falls on every cache alike (after
    /// one untimed warm-up prefill). The caches keep their tokens, so round r decodes from
    /// depth prompt + r·gen.
    #[arg(long)]
    pub interleave: Vec<String>,
    /// Text to take prompts from (default: the cleaned Wikipedia text, if fetched).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Also write the results as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// `turbokv bench decode`.
#[derive(Args, Debug, Clone)]
pub struct BenchDecodeArgs {
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Model shape with random bf16 weights: llama3-8b, qwen3-8b, smollm2-135m.
    #[arg(long, default_value = "llama3-8b")]
    pub shape: String,
    /// Load this model (GGUF or Hugging Face directory) instead of random weights.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Override the shape's layer count (quick runs).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Prompt tokens per sequence (prefilled before decoding).
    #[arg(long, default_value_t = 4096)]
    pub ctx: usize,
    /// KV cache format.
    #[arg(long, default_value = "bf16")]
    pub kv: String,
    /// Decode steps timed (median reported).
    #[arg(long, default_value_t = 32)]
    pub steps: usize,
    /// Worker threads on the CPU (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Also write the results as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Measure nothing: print how many sequences of `--ctx` tokens fit a KV budget of this
    /// many GB (10⁹ bytes) for the shape, per KV format and preset.
    #[arg(long)]
    pub kv_budget: Option<f64>,
    /// After the timings, run one more eager decode step between the CUDA profiler's start
    /// and stop, for `ncu --profile-from-start off` (one step's kernels, nothing else).
    #[arg(long)]
    pub profile_step: bool,
}

/// `turbokv bench attention`.
#[derive(Args, Debug, Clone)]
pub struct BenchAttentionArgs {
    /// Device: cuda, cuda:N or cpu.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Worker threads with --device cpu (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// KV cache formats, comma-separated.
    #[arg(long, default_value = "bf16")]
    pub kv: String,
    /// Sequences per launch, comma-separated.
    #[arg(long, default_value = "1,8,32")]
    pub batch: String,
    /// Cached tokens per sequence, comma-separated (8k = 8192).
    #[arg(long, default_value = "8k,32k,128k")]
    pub ctx: String,
    /// Query heads (Llama-3-8B: 32).
    #[arg(long, default_value_t = 32)]
    pub heads: usize,
    /// KV heads (Llama-3-8B: 8).
    #[arg(long, default_value_t = 8)]
    pub kv_heads: usize,
    /// Values per head.
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// Tokens per cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Timed rounds per point (median reported).
    #[arg(long, default_value_t = 9)]
    pub rounds: usize,
    /// Give each sequence consecutive cache blocks (default: a random permutation of the
    /// pool's blocks, as a long-running server's cache ends up).
    #[arg(long)]
    pub contiguous_blocks: bool,
    /// Also time every other instantiation of the 16-bit decode kernel, and the compressed
    /// formats on the f16 keys-as-M kernels where the default takes int8 key products, and
    /// with f16 value sums where the default takes int8 ones (`TURBOKV_CODED_INT8_VALUES=0`).
    #[arg(long)]
    pub compare_variants: bool,
    /// Also time the whole-width coded kernels at each of these key-split counts instead of
    /// the wave model's (comma-separated, e.g. `1,2,3,4,6`): a split's fixed cost against
    /// its share of the keys.
    #[arg(long, value_delimiter = ',')]
    pub coded_splits: Vec<usize>,
    /// Also time the int8-product TurboQuant kernels with their split count from the wave
    /// model alone (`TURBOKV_SM_LOAD_SPLITS=0`) beside the default per-SM model.
    #[arg(long)]
    pub wave_splits: bool,
    /// Also time windowed coded formats with their exact splits run inside the coded blocks
    /// (`TURBOKV_FOLD_EXACT_SPLITS=1`), beside the default, and at each `--coded-splits` count.
    #[arg(long)]
    pub fold_exact_splits: bool,
    /// Also time windowed coded formats with their exact splits at each of these key counts
    /// (comma-separated, rounded up to whole 64-key chunks; `TURBOKV_EXACT_SPLIT_KEYS`), beside
    /// the default.
    #[arg(long, value_delimiter = ',')]
    pub exact_split_keys: Vec<usize>,
    /// Skip the PyTorch SDPA peer.
    #[arg(long)]
    pub no_peer: bool,
    /// The peer script (default: bench/sdpa_peer.py under the working directory).
    #[arg(long)]
    pub peer_script: Option<PathBuf>,
    /// Python with torch for the peer.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Also write the results as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw time against context per KV format beside the SDPA peer, one panel per batch
    /// size, as SVG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Measure nothing: print and `--plot` the results of an earlier run's `--json` file.
    #[arg(long)]
    pub from_json: Option<PathBuf>,
}

impl ModelArgs {
    /// The model path, falling back to the demo model in the asset cache.
    pub fn model_path(&self) -> anyhow::Result<PathBuf> {
        if let Some(p) = &self.model {
            return Ok(p.clone());
        }
        let p = cache_dir().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
        if p.exists() {
            Ok(p)
        } else {
            anyhow::bail!(
                "no --model given and the demo model is not at {}; run scripts/fetch-assets.sh",
                p.display()
            )
        }
    }
}

/// `$TURBOKV_CACHE`, else `~/.cache/turbokv`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TURBOKV_CACHE") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache/turbokv")
}
