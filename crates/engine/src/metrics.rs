//! Prometheus metrics of the engine, named as vLLM names them so that dashboards and
//! routers that read vLLM's `/metrics` read these too.

use prometheus::{Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts};
use prometheus::{Gauge, Registry, TextEncoder};

/// The engine's counters, gauges and histograms, registered in their own registry.
pub struct Metrics {
    registry: Registry,
    /// Requests being generated (admitted).
    pub running: IntGauge,
    /// Requests waiting for admission (preempted ones included).
    pub waiting: IntGauge,
    /// The most requests that ran in one forward step since the engine started.
    pub running_peak: IntGauge,
    /// Forward steps run.
    pub steps: IntCounter,
    /// Sequences over all forward steps (divided by `steps`: the mean batch).
    pub step_sequences: IntCounter,
    /// Fraction of KV blocks held by requests (0..1).
    pub kv_usage: Gauge,
    /// The same, under vLLM v0's name.
    pub gpu_cache_usage: Gauge,
    /// KV blocks held by requests.
    pub kv_blocks_used: IntGauge,
    /// KV blocks in the pool.
    pub kv_blocks_total: IntGauge,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queries: IntCounter,
    /// Prompt tokens found there.
    pub prefix_hits: IntCounter,
    /// Seconds from arrival to the first token.
    pub ttft: Histogram,
    /// Seconds between consecutive tokens of a request.
    pub itl: Histogram,
    /// The same, under vLLM's older name.
    pub tpot: Histogram,
    /// Seconds from arrival to the end.
    pub e2e: Histogram,
    /// Prompt tokens of finished and running requests (prefilled or cached).
    pub prompt_tokens: IntCounter,
    /// Generated tokens.
    pub generation_tokens: IntCounter,
    /// Requests preempted (their KV dropped, to be recomputed).
    pub preemptions: IntCounter,
    /// KV blocks admission keeps free at the last round beyond that round's own tokens: the
    /// running requests' growth reserve plus the watermark.
    pub kv_blocks_reserved: IntGauge,
    /// Requests whose start the growth reserve delayed (each counted once): they would have
    /// fit beside the round's own tokens. With no growth reserve, the running requests'
    /// unfed prompt tokens are what is kept.
    pub admissions_deferred: IntCounter,
    /// Requests finished, by `finished_reason` (stop, length, abort, error).
    pub request_success: IntCounterVec,
    /// Prefix blocks written to the snapshot store.
    pub snapshots_written: IntCounter,
    /// Prefix blocks restored from it.
    pub snapshots_restored: IntCounter,
    /// Snapshot files refused (corrupt, truncated, another model or cache format).
    pub snapshots_rejected: IntCounter,
    /// Padded decode steps by `bucket` (the batch size they ran at).
    pub decode_bucket_steps: IntCounterVec,
    /// Placeholder rows run in padded decode steps.
    pub decode_padding_rows: IntCounter,
    /// Steps whose logits came back as each row's best candidates.
    pub step_logits_top_k: IntCounter,
    /// Steps whose logits came back as full rows.
    pub step_logits_full: IntCounter,
    /// Decode steps the backend replayed as a captured graph.
    pub graph_steps_replayed: IntCounter,
    /// Decode steps the backend captured as a new graph.
    pub graph_steps_captured: IntCounter,
    /// Decode steps the backend ran eagerly (the first of a shape, or after a mismatch).
    pub graph_steps_eager: IntCounter,
}

fn latency_buckets() -> Vec<f64> {
    vec![
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0,
    ]
}

impl Metrics {
    /// Fresh metrics; `model` labels nothing yet but is kept for the registry's help text.
    pub fn new() -> Self {
        let registry = Registry::new();
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("valid metric name");
            registry
                .register(Box::new(g.clone()))
                .expect("unique metric");
            g
        };
        let fgauge = |name: &str, help: &str| {
            let g = Gauge::new(name, help).expect("valid metric name");
            registry
                .register(Box::new(g.clone()))
                .expect("unique metric");
            g
        };
        let counter = |name: &str, help: &str| {
            let c = IntCounter::new(name, help).expect("valid metric name");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric");
            c
        };
        let hist = |name: &str, help: &str| {
            let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(latency_buckets()))
                .expect("valid metric name");
            registry
                .register(Box::new(h.clone()))
                .expect("unique metric");
            h
        };
        let counter_vec = |name: &str, help: &str, label: &str| {
            let c = IntCounterVec::new(Opts::new(name, help), &[label]).expect("valid metric name");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric");
            c
        };
        let request_success = counter_vec(
            "vllm:request_success_total",
            "Finished requests by reason.",
            "finished_reason",
        );
        let step_logits = counter_vec(
            "turbokv:step_logits_total",
            "Forward steps by how their logits came back (top_k: each row's best candidates; full: whole rows).",
            "transfer",
        );
        let graph_steps = counter_vec(
            "turbokv:step_graphs_total",
            "Decode steps by how the backend ran them (replayed, captured, eager); CUDA only.",
            "run",
        );
        Self {
            running: gauge("vllm:num_requests_running", "Requests being generated."),
            waiting: gauge(
                "vllm:num_requests_waiting",
                "Requests waiting to be admitted.",
            ),
            kv_usage: fgauge(
                "vllm:kv_cache_usage_perc",
                "Fraction of KV blocks in use (0-1).",
            ),
            gpu_cache_usage: fgauge(
                "vllm:gpu_cache_usage_perc",
                "Fraction of KV blocks in use (0-1), vLLM v0 name.",
            ),
            running_peak: gauge(
                "turbokv:num_requests_running_peak",
                "The most requests that ran in one forward step.",
            ),
            steps: counter("turbokv:engine_steps_total", "Forward steps run."),
            step_sequences: counter(
                "turbokv:engine_step_sequences_total",
                "Sequences summed over forward steps (over steps: the mean batch).",
            ),
            kv_blocks_used: gauge("turbokv:kv_blocks_used", "KV blocks held by requests."),
            kv_blocks_total: gauge("turbokv:kv_blocks_total", "KV blocks in the pool."),
            prefix_queries: counter(
                "vllm:prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache.",
            ),
            prefix_hits: counter(
                "vllm:prefix_cache_hits_total",
                "Prompt tokens found in the prefix cache.",
            ),
            ttft: hist("vllm:time_to_first_token_seconds", "Time to first token."),
            itl: hist("vllm:inter_token_latency_seconds", "Time between tokens."),
            tpot: hist(
                "vllm:time_per_output_token_seconds",
                "Time per output token.",
            ),
            e2e: hist("vllm:e2e_request_latency_seconds", "Request latency."),
            prompt_tokens: counter("vllm:prompt_tokens_total", "Prompt tokens."),
            generation_tokens: counter("vllm:generation_tokens_total", "Generated tokens."),
            preemptions: counter("vllm:num_preemptions_total", "Preempted requests."),
            kv_blocks_reserved: gauge(
                "turbokv:kv_blocks_reserved",
                "KV blocks kept free for the running requests' growth and the watermark.",
            ),
            admissions_deferred: counter(
                "turbokv:admissions_deferred_total",
                "Requests whose start the growth reserve delayed.",
            ),
            request_success,
            decode_bucket_steps: counter_vec(
                "turbokv:decode_bucket_steps_total",
                "Decode steps padded to a batch-size bucket, by bucket.",
                "bucket",
            ),
            decode_padding_rows: counter(
                "turbokv:decode_padding_rows_total",
                "Placeholder rows run to pad decode steps to their bucket.",
            ),
            step_logits_top_k: step_logits.with_label_values(&["top_k"]),
            step_logits_full: step_logits.with_label_values(&["full"]),
            graph_steps_replayed: graph_steps.with_label_values(&["replayed"]),
            graph_steps_captured: graph_steps.with_label_values(&["captured"]),
            graph_steps_eager: graph_steps.with_label_values(&["eager"]),
            snapshots_written: counter(
                "turbokv:prefix_snapshots_written_total",
                "Prefix blocks written to the snapshot store.",
            ),
            snapshots_restored: counter(
                "turbokv:prefix_snapshots_restored_total",
                "Prefix blocks restored from the snapshot store.",
            ),
            snapshots_rejected: counter(
                "turbokv:prefix_snapshots_rejected_total",
                "Snapshot files refused (corrupt, truncated, another model or format).",
            ),
            registry,
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        // Encoding into a Vec cannot fail for metrics this registry built.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8_lossy(&out).into_owned()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
