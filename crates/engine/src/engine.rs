//! The step loop: admit, schedule, run one batched forward step, sample, stream.
//!
//! Scheduling is first come, first served. Every step gives each running sequence that
//! decodes its one token, then gives a per-step token budget to prefill chunks of running
//! sequences in arrival order, then admits waiting requests while sequences, budget and KV
//! blocks remain, keeping room for the running requests' growth (`admission.rs`): a long
//! prompt is prefilled a chunk per step while the short ones around it keep decoding. When
//! the step's tokens still need more KV blocks than are free, the most recently admitted
//! sequences are preempted: their blocks are released (the full ones stay in the prefix
//! cache) and they go back to the front of the queue, to be recomputed from their prompt and
//! the tokens generated so far.
//!
//! A request's output does not depend on what it runs with. The CPU kernels compute every
//! row the same way whatever else the step holds, but a prompt row's attention is computed
//! one way in a one-token span and another in a longer chunk. So each token is fed as it
//! would be with the request alone: prompts in chunks that end at fixed multiples of the
//! chunk size (also after a prefix-cache hit, which may end up sharing one block less to
//! keep that true), generated tokens one per step (also when they are recomputed after a
//! preemption).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::mpsc::{Receiver, TryRecvError};

use prometheus::IntCounter;
use turbokv_backend::cuda::GraphStats;
use turbokv_backend::{Backend, TopK, select_top_k};
use turbokv_cache::{CacheIdentity, KvPolicy, block_hashes};
use turbokv_codec::KvDtype;
use turbokv_model::tokenizer::Tokenizer;
use turbokv_model::{KvCache, Scratch, SeqInput, StepOutput, Transformer};

use crate::EngineError;
use crate::admission::{AdmissionOptions, Need, Verdict, decide};
use crate::batching::{DecodeBatching, LogitsTransfer};
use crate::emit::{Scores, candidates_needed, emit_next, step_candidates};
use crate::handle::{Command, EngineHandle, EngineInfo};
use crate::metrics::Metrics;
use crate::request::{Event, FinishReason, RequestId, Usage};
use crate::sequence::Sequence;
use crate::snapshots::Snapshots;

/// How the engine sizes its cache and batches.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Most tokens (decode rows plus prefill chunks) in one step.
    pub max_batched_tokens: usize,
    /// Most tokens one sequence may hold (prompt plus output); at most the model's context.
    pub max_model_len: usize,
    /// KV cache capacity in tokens, over all sequences.
    pub kv_tokens: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Share full prompt blocks between requests.
    pub prefix_caching: bool,
    /// Identifies the model's weights in the cache identity (e.g. a hash of the file).
    pub model_fingerprint: [u8; 32],
    /// When a waiting request may start: the room kept for the running ones' growth.
    pub admission: AdmissionOptions,
    /// Whether decode steps are padded to a few batch sizes (for graph replay on CUDA).
    pub decode_batching: DecodeBatching,
    /// How the logits come back for sampling: the rows' best candidates where they suffice,
    /// or always the full rows.
    pub logits: LogitsTransfer,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            max_num_seqs: 64,
            max_batched_tokens: 512,
            max_model_len: 2048,
            kv_tokens: 16384,
            block_size: 16,
            prefix_caching: true,
            model_fingerprint: [0; 32],
            admission: AdmissionOptions::default(),
            decode_batching: DecodeBatching::Exact,
            logits: LogitsTransfer::Candidates,
        }
    }
}

/// The engine: owns the model, the cache and every request's state.
pub struct Engine<B: Backend> {
    model: Transformer<B>,
    tokenizer: Arc<Tokenizer>,
    cache: KvCache<B>,
    scratch: Scratch<B>,
    opts: EngineOptions,
    identity: CacheIdentity,
    rx: Receiver<Command>,
    metrics: Arc<Metrics>,
    waiting: VecDeque<Box<Sequence>>,
    running: Vec<Sequence>,
    /// Full logits rows of a step that copies them back.
    logits: Vec<f32>,
    /// Candidates of a step that copies only those back.
    top: TopK,
    /// One row's candidates selected on the host (a full-rows step).
    host_top: TopK,
    /// The penalised copy of a row the sampler draws from.
    work: Vec<f32>,
    /// Per decode bucket, its steps counter (labels formatted once, here).
    bucket_steps: Vec<IntCounter>,
    /// The backend's graph counters at the last step.
    graphs_seen: GraphStats,
    snapshots: Option<Snapshots>,
    shutting_down: bool,
}

impl<B: Backend> Engine<B> {
    /// An engine over `model` with a cache of `dtype` under `policy`, sized by `opts`.
    /// Prefix caching is turned off (with a warning) for caches with a full-precision window
    /// (their exact copies of recent tokens are not shared with the blocks), for models
    /// with sliding-window ring layers (a sequence's ring holds nothing for tokens it took
    /// from shared blocks) and for models with conv layers (LFM2: their per-sequence state
    /// is not stored at block boundaries, so a shared prefix would resume from none).
    pub fn new(
        model: Transformer<B>,
        tokenizer: Arc<Tokenizer>,
        dtype: KvDtype,
        policy: &KvPolicy,
        mut opts: EngineOptions,
    ) -> Result<(Self, EngineHandle), EngineError> {
        let internal = |e: turbokv_model::ModelError| EngineError::Internal(e.to_string());
        opts.admission.validate()?;
        opts.max_model_len = opts.max_model_len.min(model.config().max_context).max(1);
        opts.max_num_seqs = opts.max_num_seqs.max(1);
        opts.max_batched_tokens = opts.max_batched_tokens.max(opts.max_num_seqs);
        let cache = model
            .new_cache_with(
                dtype,
                policy,
                opts.block_size,
                opts.kv_tokens,
                opts.max_model_len,
            )
            .map_err(internal)?;
        if opts.prefix_caching && cache.layout().window.is_active() && dtype.is_compressed() {
            tracing::warn!(
                "prefix caching is off: this cache keeps recent tokens at full precision beside the blocks, which are not shared"
            );
            opts.prefix_caching = false;
        }
        if opts.prefix_caching && cache.ring_tokens_per_seq().is_some() {
            tracing::warn!(
                "prefix caching is off: this model's sliding-window layers keep a per-sequence ring that shared blocks do not carry"
            );
            opts.prefix_caching = false;
        }
        if opts.prefix_caching && cache.conv_state_bytes_per_seq().is_some() {
            tracing::warn!(
                "prefix caching is off: this model's conv layers keep a per-sequence state that shared blocks do not carry"
            );
            opts.prefix_caching = false;
        }
        if matches!(opts.decode_batching, DecodeBatching::Buckets(_)) && !model.supports_padding() {
            tracing::warn!(
                "decode steps are not padded: this model's family cannot take placeholder rows"
            );
            opts.decode_batching = DecodeBatching::Exact;
        }
        let identity = CacheIdentity::new(&opts.model_fingerprint, cache.layout());
        let scratch = model.new_scratch().map_err(internal)?;
        let metrics = Arc::new(Metrics::new());
        let bucket_steps = (opts.decode_batching.sizes().iter())
            .map(|s| {
                metrics
                    .decode_bucket_steps
                    .with_label_values(&[&s.to_string()])
            })
            .collect();
        let graphs_seen = model.backend().step_graph_stats().unwrap_or_default();
        let total = cache.allocator().total_blocks();
        metrics.kv_blocks_total.set(total as i64);
        let (tx, rx) = std::sync::mpsc::channel();
        let info = Arc::new(EngineInfo {
            max_model_len: opts.max_model_len,
            kv_tokens: total * opts.block_size,
            max_num_seqs: opts.max_num_seqs,
            prefix_caching: opts.prefix_caching,
            vocab_size: model.config().vocab_size,
            decode_buckets: opts.decode_batching.sizes().to_vec(),
        });
        let handle = EngineHandle {
            tx,
            next_id: Arc::new(AtomicU64::new(1)),
            metrics: metrics.clone(),
            info,
            tokenizer: tokenizer.clone(),
        };
        let engine = Self {
            model,
            tokenizer,
            cache,
            scratch,
            opts,
            identity,
            rx,
            metrics,
            waiting: VecDeque::new(),
            running: Vec::new(),
            logits: Vec::new(),
            top: TopK::default(),
            host_top: TopK::default(),
            work: Vec::new(),
            bucket_steps,
            graphs_seen,
            snapshots: None,
            shutting_down: false,
        };
        Ok((engine, handle))
    }

    /// The identity that names this cache's blocks.
    pub fn identity(&self) -> &CacheIdentity {
        &self.identity
    }

    /// The cache (its layout, for snapshot identities).
    pub fn cache(&self) -> &KvCache<B> {
        &self.cache
    }

    /// Persists prefix blocks in `snapshots` (evicted ones and, at shutdown, every cached
    /// one) and restores them from it on prefix misses. Requires prefix caching.
    pub fn set_snapshots(&mut self, snapshots: Snapshots) {
        if !self.opts.prefix_caching {
            tracing::warn!("prefix snapshots need prefix caching, which is off for this cache");
        } else if self
            .cache
            .layout()
            .layers
            .iter()
            .any(|l| !l.head_dtypes.is_empty())
        {
            // A block snapshot holds one dtype a layer; the backends refuse to export others.
            tracing::warn!(
                "prefix snapshots are off: this cache's kv heads differ in dtype within a layer"
            );
        } else {
            self.snapshots = Some(snapshots);
        }
    }

    /// The step loop: runs until [`EngineHandle::shutdown`] or until every handle and stream
    /// is dropped.
    pub fn run(mut self) {
        tracing::info!(
            blocks = self.cache.allocator().total_blocks(),
            block_size = self.opts.block_size,
            max_num_seqs = self.opts.max_num_seqs,
            decode_buckets = ?self.opts.decode_batching.sizes(),
            logits = ?self.opts.logits,
            "engine started"
        );
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                if self.shutting_down {
                    break;
                }
                match self.rx.recv() {
                    Ok(c) => self.command(c),
                    Err(_) => break,
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(c) => self.command(c),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.shutting_down = true;
                        break;
                    }
                }
            }
            if self.shutting_down {
                self.abort_all();
                break;
            }
            self.drop_closed();
            if let Err(e) = self.step() {
                tracing::error!("engine step failed: {e}");
                self.fail_running(EngineError::Internal(e));
            }
            self.update_gauges();
        }
        if let Some(s) = self.snapshots.as_mut() {
            s.persist_all(
                &self.cache,
                self.model.backend(),
                &self.identity,
                &self.metrics,
            );
        }
        tracing::info!("engine stopped");
    }

    fn command(&mut self, c: Command) {
        match c {
            Command::Submit(seq) => {
                self.waiting.push_back(seq);
            }
            Command::Cancel(id) => self.cancel(id),
            Command::Shutdown => self.shutting_down = true,
        }
        self.update_gauges();
    }

    fn cancel(&mut self, id: RequestId) {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let seq = self.running.remove(i);
            self.release(&seq);
            self.metrics
                .request_success
                .with_label_values(&["abort"])
                .inc();
            tracing::debug!(id, "cancelled");
        } else if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            let seq = self.waiting.remove(i);
            if let Some(seq) = seq {
                self.release(&seq);
            }
        }
    }

    /// Cancels the requests whose client went away.
    fn drop_closed(&mut self) {
        let closed: Vec<RequestId> = self
            .running
            .iter()
            .chain(self.waiting.iter().map(|b| &**b))
            .filter(|s| s.tx.is_closed())
            .map(|s| s.id)
            .collect();
        for id in closed {
            self.cancel(id);
        }
    }

    fn release(&mut self, seq: &Sequence) {
        if seq.admitted {
            let _ = self.cache.remove_sequence(seq.id);
        }
    }

    fn abort_all(&mut self) {
        let all: Vec<Sequence> = self
            .running
            .drain(..)
            .chain(self.waiting.drain(..).map(|b| *b))
            .collect();
        for seq in all {
            self.release(&seq);
            let _ = seq.tx.send(Event::Failed(EngineError::ShuttingDown));
        }
    }

    fn fail_running(&mut self, err: EngineError) {
        for seq in std::mem::take(&mut self.running) {
            self.release(&seq);
            self.metrics
                .request_success
                .with_label_values(&["error"])
                .inc();
            let _ = seq.tx.send(Event::Failed(err.clone()));
        }
    }

    fn update_gauges(&self) {
        let m = &self.metrics;
        m.running.set(self.running.len() as i64);
        m.waiting.set(self.waiting.len() as i64);
        let pool = self.cache.allocator().pool();
        m.kv_blocks_used.set(pool.used() as i64);
        let usage = pool.used() as f64 / pool.total().max(1) as f64;
        m.kv_usage.set(usage);
        m.gpu_cache_usage.set(usage);
    }

    /// Blocks of a prompt that may be shared: full ones, leaving at least one token to run
    /// (its logits are the first output). One fewer where the first chunk after them would
    /// hold a single prompt token off a chunk boundary: alone, that token is computed in a
    /// longer chunk, which attention computes differently from a one-token span.
    fn shareable_blocks(&self, seq: &Sequence) -> usize {
        let bs = self.opts.block_size;
        let share = (seq.tokens.len() - 1) / bs;
        let start = share * bs;
        let unit = self.chunk_unit();
        let first_chunk = seq
            .prompt_len
            .saturating_sub(start)
            .min(unit - start % unit);
        if share > 0 && first_chunk == 1 && !start.is_multiple_of(unit) {
            share - 1
        } else {
            share
        }
    }

    /// Puts a waiting sequence into the cache, sharing its cached prefix.
    fn admit(&mut self, seq: &mut Sequence) -> Result<(), String> {
        let bs = self.opts.block_size;
        let share = if self.opts.prefix_caching {
            self.shareable_blocks(seq)
        } else {
            0
        };
        if seq.hashes.len() < share {
            seq.hashes = block_hashes(&seq.tokens, bs, &self.identity, share);
        }
        let hashes = &seq.hashes[..share];
        if let Some(s) = self.snapshots.as_mut() {
            let have = self.cache.allocator().cached_prefix(hashes);
            s.restore(
                hashes,
                have,
                &mut self.cache,
                self.model.backend(),
                &self.identity,
                &self.metrics,
            );
        }
        let cached = self
            .cache
            .allocator_mut()
            .add_sequence_with_prefix(seq.id, hashes)
            .map_err(|e| e.to_string())?;
        seq.admitted = true;
        seq.cached = cached;
        if seq.cached_tokens.is_none() {
            seq.cached_tokens = Some(cached);
            if self.opts.prefix_caching {
                self.metrics.prefix_queries.inc_by(seq.prompt_len as u64);
                self.metrics.prefix_hits.inc_by(cached as u64);
            }
            self.metrics.prompt_tokens.inc_by(seq.prompt_len as u64);
        }
        Ok(())
    }

    /// Admits waiting requests in arrival order while sequences, token budget and blocks
    /// remain, keeping room for the running requests' growth (`admission.rs`), and adds
    /// their first chunks to `plan`. Returns the blocks the round's plan needs.
    fn admit_waiting(
        &mut self,
        plan: &mut Vec<(usize, usize)>,
        budget: &mut usize,
    ) -> Result<usize, String> {
        let mut round = self.blocks_needed(plan);
        let mut committed = round.max(self.running_reserve()?);
        let total = self.cache.allocator().total_blocks();
        let watermark = self.opts.admission.watermark_blocks(total);
        while *budget > 0 && self.running.len() < self.opts.max_num_seqs {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            if let Err(e) = self.admit(&mut seq) {
                self.waiting.push_front(seq);
                return Err(e);
            }
            let n = self.next_chunk(&seq);
            let need = match self.need_of(&seq, n, round, committed, watermark) {
                Ok(need) => need,
                Err(e) => {
                    self.unadmit(&mut seq);
                    self.waiting.push_front(seq);
                    return Err(e);
                }
            };
            match decide(&need, self.running.is_empty(), n <= *budget) {
                Verdict::Admit => {
                    round += need.chunk;
                    committed += need.growth;
                    *budget -= n;
                    self.running.push(*seq);
                    plan.push((self.running.len() - 1, n));
                }
                Verdict::Defer { by_reserve } => {
                    self.unadmit(&mut seq);
                    if by_reserve && !seq.deferred {
                        seq.deferred = true;
                        self.metrics.admissions_deferred.inc();
                        tracing::debug!(
                            id = seq.id,
                            free = need.free,
                            reserved = committed + watermark - round,
                            needs = need.growth,
                            "admission deferred: the free blocks are kept for the running requests' growth"
                        );
                    }
                    self.waiting.push_front(seq);
                    break;
                }
                Verdict::Never => {
                    self.unadmit(&mut seq);
                    self.metrics
                        .request_success
                        .with_label_values(&["error"])
                        .inc();
                    let _ = seq.tx.send(Event::Failed(EngineError::TooLargeForCache {
                        needed_tokens: seq.tokens.len(),
                        capacity_tokens: total * self.opts.block_size,
                    }));
                }
            }
        }
        self.metrics
            .kv_blocks_reserved
            .set((committed + watermark - round) as i64);
        Ok(round)
    }

    /// The blocks behind admitting `seq` (just added to the cache, `n` tokens to feed first).
    fn need_of(
        &self,
        seq: &Sequence,
        n: usize,
        round: usize,
        committed: usize,
        watermark: usize,
    ) -> Result<Need, String> {
        let alloc = self.cache.allocator();
        let blocks = |extra| {
            alloc
                .blocks_needed(seq.id, extra)
                .map_err(|e| e.to_string())
        };
        Ok(Need {
            free: alloc.free_blocks(),
            round,
            committed,
            chunk: blocks(n)?,
            whole: blocks(seq.pending())?,
            growth: self.growth_blocks(seq)?,
            watermark,
        })
    }

    /// Blocks `seq` still needs to reach the tokens admission keeps room for.
    fn growth_blocks(&self, seq: &Sequence) -> Result<usize, String> {
        let limit = seq.limit(self.opts.max_model_len);
        let target = self.opts.admission.target_tokens(seq.tokens.len(), limit);
        self.cache
            .allocator()
            .blocks_needed(seq.id, target - seq.cached)
            .map_err(|e| e.to_string())
    }

    /// Blocks the running requests keep for their growth (this round's included).
    fn running_reserve(&self) -> Result<usize, String> {
        self.running.iter().map(|s| self.growth_blocks(s)).sum()
    }

    /// Undoes [`Self::admit`] for a request that does not start now (its shared blocks go
    /// back to the free queue).
    fn unadmit(&mut self, seq: &mut Sequence) {
        self.release(seq);
        seq.admitted = false;
        seq.cached = 0;
    }

    /// Drops a running sequence's KV and queues it again (recompute).
    fn preempt(&mut self, index: usize) {
        let mut seq = self.running.remove(index);
        self.unadmit(&mut seq);
        self.metrics.preemptions.inc();
        tracing::debug!(
            id = seq.id,
            tokens = seq.tokens.len(),
            free = self.cache.allocator().free_blocks(),
            running = self.running.len(),
            "preempted: the round's tokens need more KV blocks than are free"
        );
        self.waiting.push_front(Box::new(seq));
    }

    fn blocks_needed(&self, plan: &[(usize, usize)]) -> usize {
        plan.iter()
            .map(|&(i, n)| {
                self.cache
                    .allocator()
                    .blocks_needed(self.running[i].id, n)
                    .unwrap_or(usize::MAX / 4)
            })
            .sum()
    }

    /// Prompt chunks end at multiples of this many positions: the token budget, rounded down
    /// to whole blocks (so a prefix-cache hit, which ends on a block boundary, starts a chunk
    /// of more than one token or on a chunk boundary; see [`Self::shareable_blocks`]).
    fn chunk_unit(&self) -> usize {
        let (budget, bs) = (self.opts.max_batched_tokens, self.opts.block_size);
        if budget >= bs {
            budget / bs * bs
        } else {
            budget
        }
    }

    /// Tokens `seq` feeds next: the rest of its prompt up to the next chunk boundary, or one
    /// token once the prompt is in the cache (decoding, or recomputing generated tokens after
    /// a preemption as they were first computed).
    fn next_chunk(&self, seq: &Sequence) -> usize {
        if seq.cached >= seq.prompt_len {
            return 1;
        }
        let unit = self.chunk_unit();
        (seq.prompt_len - seq.cached).min(unit - seq.cached % unit)
    }

    /// One scheduling round and its forward step: the decode rows and the prefill chunks
    /// run together (each row's result is the same as in a step of its own).
    fn step(&mut self) -> Result<(), String> {
        let budget_total = self.opts.max_batched_tokens;
        // (index into running, tokens to feed)
        let mut plan: Vec<(usize, usize)>;
        let mut budget;
        loop {
            budget = budget_total;
            plan = Vec::new();
            for (i, s) in self.running.iter().enumerate() {
                if s.cached >= s.prompt_len {
                    plan.push((i, 1));
                }
            }
            // Prefill chunks in arrival order, each whole or not at all this step.
            for (i, s) in self.running.iter().enumerate() {
                let n = self.next_chunk(s);
                if s.cached < s.prompt_len && n <= budget {
                    plan.push((i, n));
                    budget -= n;
                }
            }
            let needed = self.blocks_needed(&plan);
            if needed <= self.cache.allocator().free_blocks() || self.running.len() <= 1 {
                break;
            }
            self.preempt(self.running.len() - 1);
        }
        let needed = self.admit_waiting(&mut plan, &mut budget)?;
        if plan.is_empty() {
            return Ok(());
        }
        if needed > self.cache.allocator().free_blocks() {
            // One sequence alone outgrew the cache: it cannot continue.
            let (i, _) = plan[0];
            let seq = self.running.remove(i);
            self.release(&seq);
            let _ = seq.tx.send(Event::Failed(EngineError::TooLargeForCache {
                needed_tokens: seq.tokens.len(),
                capacity_tokens: self.cache.allocator().total_blocks() * self.opts.block_size,
            }));
            return Ok(());
        }
        if let Some(s) = self.snapshots.as_mut() {
            // Blocks about to be evicted by this step's allocations: persist them first.
            let evicted = self.cache.allocator().pool().peek_evictions(needed);
            s.persist(
                &evicted,
                &self.cache,
                self.model.backend(),
                &self.identity,
                &self.metrics,
            );
        }
        let mut finished = Vec::new();
        self.forward(&plan, &mut finished)?;
        let m = &self.metrics;
        m.steps.inc();
        m.step_sequences.inc_by(plan.len() as u64);
        if plan.len() as i64 > m.running_peak.get() {
            m.running_peak.set(plan.len() as i64);
        }
        // Remove from the back so the indices stay valid.
        finished.sort_by_key(|f: &(usize, FinishReason)| std::cmp::Reverse(f.0));
        for (i, reason) in finished {
            let seq = self.running.remove(i);
            self.finish(seq, reason);
        }
        Ok(())
    }

    fn forward(
        &mut self,
        plan: &[(usize, usize)],
        finished: &mut Vec<(usize, FinishReason)>,
    ) -> Result<(), String> {
        let decode_shaped = plan.iter().all(|&(_, n)| n == 1);
        let (pad, bucket) = self.opts.decode_batching.padding(plan.len(), decode_shaped);
        let k = step_candidates(self.opts.logits, &self.running, plan);
        let inputs: Vec<SeqInput<'_>> = plan
            .iter()
            .map(|&(i, n)| {
                let s = &self.running[i];
                SeqInput {
                    seq: s.id,
                    tokens: &s.tokens[s.cached..s.cached + n],
                }
            })
            .collect();
        let mut out = match k {
            Some(k) => StepOutput::TopK {
                k,
                out: &mut self.top,
            },
            None => StepOutput::Logits(&mut self.logits),
        };
        self.model
            .forward_padded(&inputs, pad, &mut self.cache, &mut self.scratch, &mut out)
            .map_err(|e| e.to_string())?;
        drop(inputs);
        self.count_step(k.is_some(), pad, bucket);
        let vocab = self.model.config().vocab_size;
        for (r, &(i, n)) in plan.iter().enumerate() {
            let bs = self.opts.block_size;
            let prefix_caching = self.opts.prefix_caching;
            let seq = &mut self.running[i];
            seq.cached += n;
            if prefix_caching {
                let full = seq.cached / bs;
                if seq.hashes.len() < full {
                    seq.hashes = block_hashes(&seq.tokens, bs, &self.identity, full);
                }
                let _ = self
                    .cache
                    .allocator_mut()
                    .register_blocks(seq.id, &seq.hashes[..full]);
                if let Some(s) = self.snapshots.as_mut() {
                    s.note_blocks(&seq.hashes[..full], &seq.tokens, bs);
                }
            }
            if seq.pending() > 0 {
                continue; // a prefill chunk short of the prompt's end, or a recomputed token
            }
            let missing = || format!("no logits for row {r}");
            let scores = if k.is_some() {
                Scores::Top(self.top.row(r).ok_or_else(missing)?)
            } else {
                let logits = self
                    .logits
                    .get(r * vocab..(r + 1) * vocab)
                    .ok_or_else(missing)?;
                // A request that can draw from candidates draws from them here too, so its
                // tokens and log-probabilities are those it gets in a step of its own.
                match (self.opts.logits, candidates_needed(seq)) {
                    (LogitsTransfer::Candidates, Some(kr)) => {
                        select_top_k(logits, vocab, kr, &mut self.host_top)
                            .map_err(|e| e.to_string())?;
                        Scores::Top(self.host_top.row(0).ok_or_else(missing)?)
                    }
                    _ => Scores::Full {
                        logits,
                        work: &mut self.work,
                    },
                }
            };
            if let Some(reason) = emit_next(seq, scores, &self.tokenizer, &self.metrics)? {
                finished.push((i, reason));
            } else if seq.tokens.len() >= self.opts.max_model_len {
                finished.push((i, FinishReason::Length));
            }
        }
        Ok(())
    }

    /// Counts how a step ran: its logits transfer, its padding, and (on a backend with step
    /// graphs) whether it replayed, captured or ran eagerly.
    fn count_step(&mut self, candidates: bool, pad: usize, bucket: Option<usize>) {
        let m = &self.metrics;
        if candidates {
            m.step_logits_top_k.inc();
        } else {
            m.step_logits_full.inc();
        }
        if let Some(c) = bucket.and_then(|b| self.bucket_steps.get(b)) {
            c.inc();
            m.decode_padding_rows.inc_by(pad as u64);
        }
        if let Some(g) = self.model.backend().step_graph_stats() {
            let seen = &self.graphs_seen;
            m.graph_steps_replayed
                .inc_by(g.replayed.saturating_sub(seen.replayed));
            m.graph_steps_captured
                .inc_by(g.captured.saturating_sub(seen.captured));
            m.graph_steps_eager
                .inc_by(g.eager.saturating_sub(seen.eager));
            self.graphs_seen = g;
        }
    }

    fn finish(&mut self, mut seq: Sequence, reason: FinishReason) {
        self.release(&seq);
        // Before the client hears of the end, so what it reads next is current.
        self.update_gauges();
        let mut tail = String::new();
        if seq.stops.stopped().is_none() {
            tail.push_str(seq.decoder.finish().unwrap_or(""));
            tail.push_str(seq.stops.finish());
        }
        let usage = Usage {
            prompt_tokens: seq.prompt_len,
            completion_tokens: seq.generated(),
            cached_tokens: seq.cached_tokens.unwrap_or(0),
        };
        self.metrics
            .e2e
            .observe(seq.arrived.elapsed().as_secs_f64());
        self.metrics
            .request_success
            .with_label_values(&[reason.as_str()])
            .inc();
        let _ = seq.tx.send(Event::Finished {
            reason,
            usage,
            tail,
        });
    }
}
