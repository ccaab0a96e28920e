//! The decoder-only transformer forward pass over a batch of sequences and a paged KV cache.

use std::sync::atomic::{AtomicBool, Ordering};

use turbokv_backend::{
    AttnGeometry, Backend, QkNorm, QkvProjection, Rope, SeqSpan, TopK, VariantNeeds,
};
use turbokv_cache::{BlockAllocator, KvLayout, KvPolicy, SeqId};
use turbokv_codec::KvDtype;

use crate::ModelError;
use crate::arch::conv::ConvStates;
use crate::config::ModelConfig;
pub use crate::kv_cache::KvCache;
use crate::loader::{LayerWeights, Weights};

/// A model's weights and geometry on a backend.
pub struct Transformer<B: Backend> {
    pub(crate) backend: B,
    pub(crate) config: ModelConfig,
    pub(crate) geometry: AttnGeometry,
    pub(crate) rope: Rope,
    /// RoPE of sliding-window layers when their base differs (Gemma 3).
    pub(crate) local_rope: Option<Rope>,
    pub(crate) weights: Weights<B>,
    /// Whether single-token decode steps go through [`Backend::run_step`] (CUDA graphs).
    step_graphs: AtomicBool,
    /// Whether new caches keep sliding-window layers in rings (see [`crate::arch::ring`]).
    pub(crate) sliding_rings: AtomicBool,
}

/// A callback given `(layer, rows)` after each layer's KV write; see
/// [`Transformer::forward_observed`].
pub type KvObserver<'a> = &'a mut dyn FnMut(usize, &[f32]);

/// Which positions of a step produce logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsFor {
    /// The last new token of each sequence (generation).
    LastToken,
    /// Every new token (perplexity evaluation).
    AllTokens,
}

/// Where a step's logits go: its last op.
#[derive(Debug)]
pub enum StepOutput<'a> {
    /// The full rows, row-major `[rows, vocab]` ([`Backend::to_host`]).
    Logits(&'a mut Vec<f32>),
    /// Each row's `k` best logits, max and log-sum-exp ([`Backend::to_host_top_k`]): what
    /// sampling needs, without copying the vocabulary back.
    TopK {
        /// Candidates per row.
        k: usize,
        /// The result.
        out: &'a mut TopK,
    },
}

/// The input tokens of a [`Transformer::forward_pick`] step.
#[derive(Clone, Copy, Debug)]
pub enum StepTokens<'a> {
    /// Tokens from the host, per sequence.
    Host(&'a [SeqInput<'a>]),
    /// One token per sequence: the picks of the step before (in its row order, which must be
    /// these sequences'), still where the backend keeps them.
    Picked(&'a [SeqId]),
}

/// The placeholder token of a [`StepTokens::Picked`] row (its real id is on the device).
static PICKED: [u32; 1] = [0];

/// How a step ends.
pub(crate) enum Ending<'a, 'o, B: Backend> {
    /// Its logits go to the host, in full or as top-k.
    Output(&'a mut StepOutput<'o>),
    /// A greedy pick; `chained`: the step's input is the pick before.
    Pick {
        picks: &'a mut B::Picks,
        chained: bool,
    },
}

impl<'o, B: Backend> Ending<'_, 'o, B> {
    fn reborrow(&mut self) -> Ending<'_, 'o, B> {
        match self {
            Ending::Output(o) => Ending::Output(o),
            Ending::Pick { picks, chained } => Ending::Pick {
                picks,
                chained: *chained,
            },
        }
    }
}

/// New tokens of one sequence for a step.
#[derive(Clone, Copy, Debug)]
pub struct SeqInput<'a> {
    /// The sequence (registered with [`KvCache::add_sequence`]).
    pub seq: SeqId,
    /// Tokens appended this step.
    pub tokens: &'a [u32],
}

/// Reusable activation buffers of a step.
pub struct Scratch<B: Backend> {
    pub(crate) x: B::Tensor,
    pub(crate) xn: B::Tensor,
    pub(crate) qkv: B::Tensor,
    pub(crate) attn: B::Tensor,
    pub(crate) proj: B::Tensor,
    pub(crate) gate_up: B::Tensor,
    pub(crate) act: B::Tensor,
    /// Conv layers' `[b | c | x]` rows and their gated convolution (LFM2).
    pub(crate) bcx: B::Tensor,
    pub(crate) mixed: B::Tensor,
    picked: B::Tensor,
    picked_n: B::Tensor,
    logits: B::Tensor,
}

/// The attention geometry of every layer of a model with `config`.
pub(crate) fn attn_geometry(config: &ModelConfig) -> AttnGeometry {
    AttnGeometry {
        n_heads: config.n_heads,
        n_kv_heads: config.n_kv_heads,
        head_dim: config.head_dim,
        // YaRN's attention factor scales cos and sin, so q and k: scores by its square.
        scale: config
            .arch
            .attn_scale
            .unwrap_or(1.0 / (config.head_dim as f32).sqrt())
            * config.rope_scaling.attention_factor().powi(2),
    }
}

impl<B: Backend> Transformer<B> {
    /// Assembles a model from loaded weights.
    pub fn new(backend: B, config: ModelConfig, weights: Weights<B>) -> Self {
        let geometry = attn_geometry(&config);
        let rope = Rope {
            inv_freq: config.rope_inv_freq(),
            style: config.rope_style,
        };
        let local_rope = crate::arch::forward::local_rope(&config);
        Self {
            backend,
            config,
            geometry,
            rope,
            local_rope,
            weights,
            step_graphs: AtomicBool::new(true),
            sliding_rings: AtomicBool::new(true),
        }
    }

    /// Hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Turns graph replay of decode steps ([`Backend::run_step`]) on or off (default on; off
    /// measures the eager path).
    pub fn set_step_graphs(&self, on: bool) {
        self.step_graphs.store(on, Ordering::Relaxed);
    }

    /// Whether caches made from now on keep sliding-window layers in bounded rings (default
    /// on); off, those layers keep every token and attention masks the window (to check one
    /// against the other).
    pub fn set_sliding_rings(&self, on: bool) {
        self.sliding_rings.store(on, Ordering::Relaxed);
    }

    /// A KV cache in `dtype` for up to `max_tokens` tokens in total (all sequences), with each
    /// sequence limited to `max_tokens_per_seq` (at most the model's trained context).
    pub fn new_cache(
        &self,
        dtype: KvDtype,
        block_size: usize,
        max_tokens: usize,
        max_tokens_per_seq: usize,
    ) -> Result<KvCache<B>, ModelError> {
        self.new_cache_with(
            dtype,
            &KvPolicy::default(),
            block_size,
            max_tokens,
            max_tokens_per_seq,
        )
    }

    /// [`Self::new_cache`] under `policy`: per-layer dtype overrides, and sink and
    /// recent-window tokens of compressed layers attended at full precision.
    pub fn new_cache_with(
        &self,
        dtype: KvDtype,
        policy: &KvPolicy,
        block_size: usize,
        max_tokens: usize,
        max_tokens_per_seq: usize,
    ) -> Result<KvCache<B>, ModelError> {
        self.backend.supports_attention(&self.geometry, dtype)?;
        // Conv layers have no KV: the layout's layers are the attention layers.
        let kv_layers = self.config.arch.kv_layers(self.config.n_layers);
        let mut layout = KvLayout::uniform(
            kv_layers.len(),
            self.config.n_kv_heads,
            self.config.head_dim,
            dtype,
            block_size,
            max_tokens,
        )?;
        policy.apply(&mut layout)?;
        for l in &layout.layers {
            for &d in std::iter::once(&l.dtype).chain(&l.head_dtypes) {
                self.backend.supports_attention(&self.geometry, d)?;
            }
        }
        let max_tokens_per_seq = max_tokens_per_seq.min(self.config.max_context);
        let rings = self.new_rings(block_size, max_tokens, max_tokens_per_seq);
        // Each layer's window and sinks, over the pool it will have: a ring is 16-bit.
        for (l, &model_layer) in layout.layers.iter().zip(&kv_layers) {
            let window = self.config.arch.window_of(model_layer).is_some();
            let needs = VariantNeeds {
                window,
                sinks: self.config.arch.sinks,
            };
            let dtype = if window && rings.is_some() {
                KvDtype::F16
            } else {
                l.dtype
            };
            self.backend
                .supports_attention_variant(&self.geometry, dtype, needs)?;
        }
        let ring_layout = match &rings {
            Some(r) => Some(KvLayout::uniform(
                kv_layers.len(),
                self.config.n_kv_heads,
                self.config.head_dim,
                KvDtype::F16,
                block_size,
                r.total_blocks() * block_size,
            )?),
            None => None,
        };
        // One block beyond the allocator's: the padding rows' (see `KvCache`).
        let pool_layout = KvLayout {
            num_blocks: layout.num_blocks + 1,
            ..layout.clone()
        };
        let pad_block = u32::try_from(layout.num_blocks)
            .map_err(|_| ModelError::InvalidConfig(format!("{} KV blocks", layout.num_blocks)))?;
        let pools = kv_layers
            .iter()
            .enumerate()
            .map(
                |(i, &l)| match (&ring_layout, self.config.arch.window_of(l)) {
                    (Some(ring), Some(_)) => self.backend.kv_pool(ring, i),
                    _ => self.backend.kv_pool(&pool_layout, i),
                },
            )
            .collect::<Result<_, _>>()?;
        let a = &self.config.arch;
        let n_conv = self.config.n_layers - kv_layers.len();
        let conv = (n_conv > 0).then(|| ConvStates::new(n_conv, self.config.hidden, a.conv_kernel));
        Ok(KvCache {
            alloc: BlockAllocator::new(layout.num_blocks, block_size),
            layout,
            pools,
            pad_block,
            max_tokens_per_seq,
            rings,
            conv,
        })
    }

    /// Empty activation buffers (grown on demand).
    pub fn new_scratch(&self) -> Result<Scratch<B>, ModelError> {
        let c = &self.config;
        let b = &self.backend;
        Ok(Scratch {
            x: b.tensor(0, c.hidden)?,
            xn: b.tensor(0, c.hidden)?,
            qkv: b.tensor(0, self.geometry.qkv_width())?,
            attn: b.tensor(0, c.n_heads * c.head_dim)?,
            proj: b.tensor(0, c.hidden)?,
            gate_up: b.tensor(0, 2 * c.ffn)?,
            act: b.tensor(0, c.ffn)?,
            bcx: b.tensor(0, 3 * c.hidden)?,
            mixed: b.tensor(0, c.hidden)?,
            picked: b.tensor(0, c.hidden)?,
            picked_n: b.tensor(0, c.hidden)?,
            logits: b.tensor(0, c.vocab_size)?,
        })
    }

    /// Runs one step: appends each input's tokens to its sequence's cache and returns logits
    /// (`[rows, vocab]`, row-major) for the positions `want` asks for, sequences in input order.
    ///
    /// On error no sequence has grown (cache space is reserved for all inputs before any is
    /// written).
    pub fn forward(
        &self,
        inputs: &[SeqInput<'_>],
        cache: &mut KvCache<B>,
        scratch: &mut Scratch<B>,
        want: LogitsFor,
        logits_out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let mut out = StepOutput::Logits(logits_out);
        self.forward_inner(inputs, cache, scratch, want, Ending::Output(&mut out), None)
    }

    /// A step ending in [`Backend::pick_greedy`] (greedy decoding with the device ahead of
    /// the host): each sequence's next token is picked into `picks` and is read with
    /// [`Backend::wait_picks`], while [`StepTokens::Picked`] feeds it to the next step
    /// without waiting. Sequences in input order, their last token's logits only.
    ///
    /// On error no sequence has grown, as with [`Self::forward`].
    pub fn forward_pick(
        &self,
        tokens: StepTokens<'_>,
        cache: &mut KvCache<B>,
        scratch: &mut Scratch<B>,
        picks: &mut B::Picks,
    ) -> Result<(), ModelError> {
        match tokens {
            StepTokens::Host(inputs) => {
                let ending = Ending::Pick {
                    picks,
                    chained: false,
                };
                self.forward_inner(inputs, cache, scratch, LogitsFor::LastToken, ending, None)
            }
            StepTokens::Picked(seqs) => {
                let inputs: Vec<SeqInput<'_>> = seqs
                    .iter()
                    .map(|&seq| SeqInput {
                        seq,
                        tokens: &PICKED,
                    })
                    .collect();
                let ending = Ending::Pick {
                    picks,
                    chained: true,
                };
                self.forward_inner(&inputs, cache, scratch, LogitsFor::LastToken, ending, None)
            }
        }
    }

    /// [`Self::forward`] for the last token of each sequence, ending in
    /// [`Backend::to_host_top_k`]: `out` gets each sequence's `k` best logits (in input
    /// order) instead of its whole row. Decode steps still replay as graphs.
    pub fn forward_top_k(
        &self,
        inputs: &[SeqInput<'_>],
        cache: &mut KvCache<B>,
        scratch: &mut Scratch<B>,
        k: usize,
        out: &mut TopK,
    ) -> Result<(), ModelError> {
        let mut out = StepOutput::TopK { k, out };
        let ending = Ending::Output(&mut out);
        self.forward_inner(inputs, cache, scratch, LogitsFor::LastToken, ending, None)
    }

    /// Whether [`Self::forward_padded`] can add placeholder rows to this model's steps: a
    /// model without family extras (no rings, conv states or per-family layer loop).
    pub fn supports_padding(&self) -> bool {
        self.config.arch.is_plain()
    }

    /// A step for the last token of each input ([`Self::forward`] or [`Self::forward_top_k`],
    /// as `out` asks) run with `pad` placeholder rows after the inputs' rows, so that its batch
    /// has the size of a step that ran before: a backend replaying steps as graphs
    /// ([`Backend::run_step`]) then replays instead of capturing anew.
    ///
    /// Each placeholder row feeds token 0 at position 0 of the cache's padding block (a block
    /// outside the allocator, see [`KvCache`]): it writes only there and reads only that one
    /// key, and every op computes a row without the others, so the inputs' results are those
    /// of the unpadded step. `out` gets only the inputs' rows. With `pad > 0` every input must
    /// have one token (a decode step) and the model must [`Self::supports_padding`].
    ///
    /// On error no sequence has grown, as with [`Self::forward`].
    pub fn forward_padded(
        &self,
        inputs: &[SeqInput<'_>],
        pad: usize,
        cache: &mut KvCache<B>,
        scratch: &mut Scratch<B>,
        out: &mut StepOutput<'_>,
    ) -> Result<(), ModelError> {
        let ending = Ending::Output(out);
        if pad == 0 {
            return self.forward_inner(inputs, cache, scratch, LogitsFor::LastToken, ending, None);
        }
        if !self.supports_padding() {
            return Err(ModelError::PaddingUnsupported(
                "the model's family runs its own layer loop",
            ));
        }
        if inputs.iter().any(|i| i.tokens.len() != 1) {
            return Err(ModelError::PaddingUnsupported(
                "every input of a padded step must have one token",
            ));
        }
        self.step(
            inputs,
            pad,
            cache,
            scratch,
            LogitsFor::LastToken,
            ending,
            None,
        )
    }

    /// [`Self::forward`], calling `observe(layer, rows)` after each layer's KV write with the
    /// step's fused rows on the host (`[tokens, (n_heads + 2·n_kv_heads)·head_dim]`, each row
    /// `[q | k | v]`, sequences in input order): q and k after the optional q/k norm and
    /// RoPE, v as projected — the keys and values the cache was given, before its rounding.
    /// `layer` is the KV layout's layer: conv layers (LFM2) have no KV and are not observed.
    ///
    /// For calibration and debugging: every layer copies its rows to the host.
    pub fn forward_observed(
        &self,
        inputs: &[SeqInput<'_>],
        cache: &mut KvCache<B>,
        scratch: &mut Scratch<B>,
        want: LogitsFor,
        logits_out: &mut Vec<f32>,
        observe: KvObserver<'_>,
    ) -> Result<(), ModelError> {
        let mut out = StepOutput::Logits(logits_out);
        let ending = Ending::Output(&mut out);
        self.forward_inner(inputs, cache, scratch, want, ending, Some(observe))
    }

    pub(crate) fn forward_inner(
        &self,
        inputs: &[SeqInput<'_>],
        cache: &mut KvCache<B>,
        scratch: &mut Scratch<B>,
        want: LogitsFor,
        ending: Ending<'_, '_, B>,
        observe: Option<KvObserver<'_>>,
    ) -> Result<(), ModelError> {
        if let Some(max) = cache.rings.as_ref().map(|r| r.max_step)
            && inputs.iter().any(|i| i.tokens.len() > max)
        {
            return self.forward_split(inputs, cache, scratch, want, ending, observe);
        }
        self.step(inputs, 0, cache, scratch, want, ending, observe)
    }

    /// One step over `inputs` plus `pad` placeholder rows (see [`Self::forward_padded`]).
    #[allow(clippy::too_many_arguments)]
    fn step(
        &self,
        inputs: &[SeqInput<'_>],
        pad: usize,
        cache: &mut KvCache<B>,
        scratch: &mut Scratch<B>,
        want: LogitsFor,
        mut ending: Ending<'_, '_, B>,
        observe: Option<KvObserver<'_>>,
    ) -> Result<(), ModelError> {
        let (tables, starts) = reserve(inputs, cache)?;
        let rows = StepRows {
            inputs,
            tables: &tables,
            starts: &starts,
            pad,
        };
        // A decode step (one new token per sequence) is the same launches every time: the
        // backend may replay it as a graph. The rows are reserved above, outside the step, so
        // a rerun of the step writes the same slots again. Not for conv layers (LFM2): their
        // states are host memory that each step reads and writes.
        let decode_step = observe.is_none()
            && want == LogitsFor::LastToken
            && inputs.iter().all(|i| i.tokens.len() == 1)
            && !self.config.arch.conv_layers.contains(&true)
            && self.step_graphs.load(Ordering::Relaxed);
        let result = if decode_step {
            self.backend.run_step(|| {
                let e = ending.reborrow();
                self.run(&rows, cache, scratch, want, e, None)
            })
        } else {
            self.run(&rows, cache, scratch, want, ending, observe)
        };
        if result.is_err() {
            for (inp, &start) in inputs.iter().zip(&starts) {
                cache.alloc.truncate(inp.seq, start)?;
                if let Some(c) = &mut cache.conv {
                    c.roll_back(inp.seq, start);
                }
            }
        }
        result
    }

    fn run(
        &self,
        rows_in: &StepRows<'_, '_>,
        cache: &mut KvCache<B>,
        s: &mut Scratch<B>,
        want: LogitsFor,
        ending: Ending<'_, '_, B>,
        mut observe: Option<KvObserver<'_>>,
    ) -> Result<(), ModelError> {
        let StepRows {
            inputs,
            tables,
            starts,
            pad,
        } = *rows_in;
        let b = &self.backend;
        let mut host = Vec::new();
        let w = &self.weights;
        let eps = self.config.rms_eps;
        let mut spans = Vec::with_capacity(inputs.len() + pad);
        let mut ids = Vec::new();
        for ((inp, table), &start) in inputs.iter().zip(tables).zip(starts) {
            spans.push(SeqSpan {
                first_row: ids.len(),
                n_tokens: inp.tokens.len(),
                first_pos: start,
                blocks: table,
            });
            ids.extend_from_slice(inp.tokens);
        }
        let pad_table = [cache.pad_block];
        for _ in 0..pad {
            spans.push(SeqSpan {
                first_row: ids.len(),
                n_tokens: 1,
                first_pos: 0,
                blocks: &pad_table,
            });
            ids.push(0);
        }
        match &ending {
            Ending::Pick {
                picks,
                chained: true,
            } => b.embed_picks(&w.embed, picks, ids.len(), &mut s.x)?,
            _ => b.embed(&w.embed, &ids, &mut s.x)?,
        }
        // Families with extras run their own layer loop (`crate::arch::forward`).
        let plain_layers: &[LayerWeights<B>] = if self.config.arch.is_plain() {
            &w.layers
        } else {
            let ring_tables: Option<Vec<Vec<u32>>> = cache.rings.as_ref().map(|r| {
                inputs
                    .iter()
                    .zip(starts)
                    .map(|(i, &st)| r.virtual_table(i.seq, st + i.tokens.len()))
                    .collect()
            });
            let steps: Vec<(SeqId, usize)> =
                inputs.iter().map(|i| (i.seq, i.tokens.len())).collect();
            crate::arch::forward::layers(
                self,
                &spans,
                ring_tables.as_deref(),
                crate::arch::forward::LayerState {
                    pools: &mut cache.pools,
                    conv: cache.conv.as_mut().map(|c| (c, steps.as_slice())),
                },
                s,
                &mut observe,
            )?;
            &[]
        };
        for (l, (layer, pool)) in plain_layers.iter().zip(cache.pools.iter_mut()).enumerate() {
            // A plain model has attention in every layer (conv layers make a model non-plain).
            let Some(att) = layer.mixer.attention() else {
                return Err(ModelError::InvalidConfig(format!(
                    "layer {l} is a conv layer in a model without conv layers"
                )));
            };
            let proj = QkvProjection {
                norm: &layer.attn_norm,
                eps,
                weights: &att.wqkv,
                bias: att.bqkv.as_ref(),
                qk_norm: att.qk_norm.as_ref().map(|(q, k)| QkNorm { q, k, eps }),
            };
            b.project_qkv_write_kv(
                &s.x,
                proj,
                &self.geometry,
                &self.rope,
                &spans,
                pool,
                &mut s.xn,
                &mut s.qkv,
            )?;
            if let Some(f) = observe.as_mut() {
                // The observer sees the roped rows between the write and the attention.
                b.to_host(&s.qkv, &mut host)?;
                f(l, &host);
            }
            b.attention(&s.qkv, &self.geometry, &spans, pool, &mut s.attn)?;
            b.matmul_add(&s.attn, &att.wo, &mut s.x, &mut s.proj)?;
            let crate::loader::Mlp::Dense { gate_up, down } = &layer.mlp else {
                return Err(ModelError::InvalidConfig(format!(
                    "layer {l} has experts in a model without a mixture of experts"
                )));
            };
            b.rms_norm_matmul_silu(
                &s.x,
                &layer.ffn_norm,
                eps,
                gate_up,
                &mut s.xn,
                &mut s.gate_up,
                &mut s.act,
            )?;
            b.matmul_add(&s.act, down, &mut s.x, &mut s.proj)?;
        }
        let rows: Vec<usize> = match want {
            LogitsFor::AllTokens => (0..ids.len()).collect(),
            LogitsFor::LastToken => spans
                .iter()
                .map(|sp| sp.first_row + sp.n_tokens - 1)
                .collect(),
        };
        // Decode steps want every row, in order: no gather (one launch and upload less).
        let last = if rows.iter().copied().eq(0..ids.len()) {
            &s.x
        } else {
            b.gather_rows(&s.x, &rows, &mut s.picked)?;
            &s.picked
        };
        b.rms_norm_matmul_cat(
            last,
            &w.final_norm,
            eps,
            std::slice::from_ref(&w.lm_head),
            &mut s.picked_n,
            &mut s.logits,
        )?;
        if pad > 0 {
            // The placeholder rows are the last ones: the ending sees the inputs' rows only
            // (the graph, if any, was captured with all of them; endings run after it).
            b.set_rows(&mut s.logits, rows.len() - pad)?;
        }
        match ending {
            Ending::Output(StepOutput::Logits(v)) => b.to_host(&s.logits, v)?,
            Ending::Output(StepOutput::TopK { k, out }) => {
                b.to_host_top_k(&s.logits, *k, out)?;
            }
            Ending::Pick { picks, .. } => b.pick_greedy(&s.logits, picks)?,
        }
        Ok(())
    }
}

/// The rows of one step: the inputs with their block tables and lengths before the step,
/// then `pad` placeholder rows.
#[derive(Clone, Copy)]
struct StepRows<'a, 'i> {
    inputs: &'a [SeqInput<'i>],
    tables: &'a [Vec<u32>],
    starts: &'a [usize],
    pad: usize,
}

/// Grows every input's sequence by its tokens, all or nothing; returns the block tables and
/// each sequence's length before the step.
fn reserve<B: Backend>(
    inputs: &[SeqInput<'_>],
    cache: &mut KvCache<B>,
) -> Result<(Vec<Vec<u32>>, Vec<usize>), ModelError> {
    let mut starts = Vec::with_capacity(inputs.len());
    for inp in inputs {
        if inp.tokens.is_empty() {
            return Err(ModelError::EmptyInput(inp.seq));
        }
        let len = cache.alloc.table(inp.seq)?.len();
        let total = len + inp.tokens.len();
        if total > cache.max_tokens_per_seq {
            return Err(ModelError::ContextOverflow {
                tokens: total,
                limit: cache.max_tokens_per_seq,
            });
        }
        if let Some(c) = &cache.conv {
            c.check_step(inp.seq, len)?;
        }
        starts.push(len);
    }
    let needed: usize = inputs
        .iter()
        .map(|i| cache.alloc.blocks_needed(i.seq, i.tokens.len()))
        .sum::<Result<_, _>>()?;
    if needed > cache.alloc.free_blocks() {
        return Err(turbokv_cache::CacheError::OutOfBlocks {
            needed,
            free: cache.alloc.free_blocks(),
            total: cache.alloc.total_blocks(),
        }
        .into());
    }
    let grown: Vec<(SeqId, usize)> = inputs
        .iter()
        .zip(&starts)
        .map(|(i, &st)| (i.seq, st + i.tokens.len()))
        .collect();
    if let Some(r) = &cache.rings {
        r.check(&grown)?;
    }
    for inp in inputs {
        cache.alloc.grow(inp.seq, inp.tokens.len())?;
    }
    if let Some(r) = &mut cache.rings {
        for &(seq, len) in &grown {
            r.grow(seq, len);
        }
    }
    if let Some(c) = &mut cache.conv {
        for (inp, &start) in inputs.iter().zip(&starts) {
            c.begin_step(inp.seq, start);
        }
    }
    let tables = inputs
        .iter()
        .map(|i| cache.alloc.table(i.seq).map(|t| t.blocks().to_vec()))
        .collect::<Result<_, _>>()?;
    Ok((tables, starts))
}
