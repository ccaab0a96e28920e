//! Granite, Gemma 3, LFM2 and gpt-oss against Hugging Face transformers: tiny random models of each family
//! (committed fixtures from `scripts/make_family_fixtures.py`), loaded both from the
//! safetensors directory transformers saved and from the GGUF file with llama.cpp's
//! conventions, must give transformers' float64 logits and its greedy continuation.

mod common;
#[path = "families/gpt_oss.rs"]
mod gpt_oss;
#[path = "families/lfm2.rs"]
mod lfm2;

use std::path::{Path, PathBuf};

use turbokv_backend::GgmlType;
use turbokv_backend::cpu::CpuBackend;
use turbokv_codec::KvDtype;
use turbokv_model::gguf::{GgufFile, GgufWriter, MetaValue};
use turbokv_model::{LoadOptions, Model, ModelError, Session};

fn family_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/families")
        .join(name)
}

struct Reference {
    vocab: usize,
    prompt: Vec<u32>,
    logits: Vec<Vec<f64>>,
    greedy_prompt: Vec<u32>,
    greedy: Vec<u32>,
}

fn reference(name: &str) -> Reference {
    let v = common::fixture(&format!("families/{name}/reference.json"));
    let ids = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let logits: Vec<Vec<f64>> = v["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        })
        .collect();
    Reference {
        vocab: logits[0].len(),
        prompt: ids("prompt"),
        logits,
        greedy_prompt: ids("greedy_prompt"),
        greedy: ids("greedy"),
    }
}

fn load(path: &Path) -> Result<Model<CpuBackend>, ModelError> {
    Model::load(path, CpuBackend::new(), &LoadOptions::default())
}

/// Every prompt position's logits, fed in two chunks so the second attends over a cache
/// written by the first (and, for Gemma's 8-token window, over a window that has moved).
fn engine_logits(model: &Model<CpuBackend>, ids: &[u32], kv: KvDtype) -> Vec<f32> {
    let mut s = Session::new(&model.transformer, kv, 256).unwrap();
    let cut = ids.len() / 2 + 1;
    let mut all = s.prefill_all_logits(&ids[..cut]).unwrap();
    all.extend(s.prefill_all_logits(&ids[cut..]).unwrap());
    all
}

/// Largest |engine − reference| over every logit, and the largest |reference logit|.
fn max_error(got: &[f32], want: &Reference) -> (f64, f64) {
    let flat: Vec<f64> = want.logits.iter().flatten().copied().collect();
    assert_eq!(got.len(), flat.len());
    let scale = flat.iter().map(|x| x.abs()).fold(0.0, f64::max);
    let err = got
        .iter()
        .zip(&flat)
        .map(|(a, b)| (*a as f64 - b).abs())
        .fold(0.0, f64::max);
    (err, scale)
}

fn greedy(model: &Model<CpuBackend>, prompt: &[u32], n: usize, kv: KvDtype) -> Vec<u32> {
    let mut s = Session::new(&model.transformer, kv, 256).unwrap();
    s.generate_greedy(prompt, n, |_| true).unwrap()
}

fn check_family(name: &str) {
    let want = reference(name);
    let dir = family_dir(name);
    for path in [dir.join("hf"), dir.join("model.gguf")] {
        let model = load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(model.transformer.config().vocab_size, want.vocab);
        let got = engine_logits(&model, &want.prompt, KvDtype::F16);
        let (err, scale) = max_error(&got, &want);
        eprintln!(
            "{name} {}: max logit error {err:.2e} of scale {scale:.2}",
            path.display()
        );
        // The weights are f16 in both files and the reference ran on exactly those values
        // in float64; what is left is f32 arithmetic and the f16 KV cache (11-bit
        // mantissa: ~5e-4 relative per key/value), which bounds the error near 1e-3 of the
        // logit scale (observed: 2e-5 Granite, 2e-4 Gemma 3 from safetensors). Gemma's GGUF
        // stores each norm as f16(1 + w), which rounds w again (observed 6e-4). LFM2's conv
        // layers add only f32 sums of three taps per channel (observed 1.2e-4). gpt-oss's
        // experts are MXFP4 values, exact in both files; its routing is piecewise, but the
        // fixture's prompts keep every top-k choice clear of f32 noise (observed 9.5e-4,
        // the f16 cache through four layers of sinks and YaRN-scaled scores).
        assert!(
            err < 3e-3 * scale,
            "{name} {}: max logit error {err} (scale {scale})",
            path.display()
        );
        let got = greedy(&model, &want.greedy_prompt, want.greedy.len(), KvDtype::F16);
        assert_eq!(
            got,
            want.greedy,
            "{name} {}: greedy continuation",
            path.display()
        );
    }
}

#[test]
fn granite_matches_transformers_in_both_formats() {
    check_family("granite");
}

#[test]
fn gemma3_matches_transformers_in_both_formats() {
    check_family("gemma3");
}

#[test]
fn lfm2_matches_transformers_in_both_formats() {
    check_family("lfm2");
}

#[test]
fn gpt_oss_matches_transformers_in_both_formats() {
    check_family("gpt_oss");
}

/// Every KV dtype runs each family; logits stay near the 16-bit cache's, closer the more
/// bits the cache keeps.
#[test]
fn every_kv_dtype_runs_each_family() {
    for name in ["granite", "gemma3", "lfm2", "gpt_oss"] {
        let want = reference(name);
        let model = load(&family_dir(name).join("model.gguf")).unwrap();
        let base = engine_logits(&model, &want.prompt, KvDtype::F16);
        let mut last_kl = 0.0;
        for dtype in ["bf16", "int8", "fp8", "tq4", "tq3", "tq2"] {
            let kv: KvDtype = dtype.parse().unwrap();
            let got = engine_logits(&model, &want.prompt, kv);
            assert!(got.iter().all(|x| x.is_finite()), "{name} {dtype}");
            let kl = mean_kl(&base, &got, want.vocab);
            eprintln!("{name} {dtype}: mean KL {kl:.2e} from the f16 cache");
            assert!(kl < 0.5, "{name} {dtype}: mean KL {kl} from the f16 cache");
            // Fewer bits never come out much better than more (allowing noise).
            assert!(
                kl + 1e-3 >= last_kl * 0.5,
                "{name} {dtype}: KL {kl} vs {last_kl}"
            );
            last_kl = kl;
        }
    }
}

fn mean_kl(p_logits: &[f32], q_logits: &[f32], vocab: usize) -> f64 {
    let rows = p_logits.len() / vocab;
    let mut total = 0.0;
    for (p, q) in p_logits.chunks(vocab).zip(q_logits.chunks(vocab)) {
        let (lp, lq) = (common::logsumexp(p), common::logsumexp(q));
        total += p
            .iter()
            .zip(q)
            .map(|(&a, &b)| {
                let (a, b) = (a as f64 - lp, b as f64 - lq);
                a.exp() * (a - b)
            })
            .sum::<f64>();
    }
    total / rows as f64
}

/// Rewrites a GGUF fixture with `edit` applied to its tensor list.
fn rewrite_gguf(
    src: &Path,
    dst: &Path,
    edit: impl Fn(&str, Vec<usize>, Vec<u8>) -> Option<(Vec<usize>, Vec<u8>)>,
    meta: &[(&str, MetaValue)],
) {
    let file = GgufFile::open(src).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata.iter() {
        if !meta.iter().any(|(mk, _)| *mk == k) {
            w.meta(k, v.clone());
        }
    }
    for (k, v) in meta {
        w.meta(k, v.clone());
    }
    for t in file.mxfp4_tensors() {
        if let Some((dims, data)) = edit(&t.name, t.dims.clone(), file.mxfp4_bytes(t).to_vec()) {
            w.tensor(&t.name, &dims, 39, data);
        }
    }
    for t in file.tensors() {
        let bytes = file.tensor_bytes(t);
        if let Some((dims, data)) = edit(&t.name, t.dims.clone(), bytes.to_vec()) {
            let id = match t.ty {
                GgmlType::F32 => 0,
                GgmlType::F16 => 1,
                other => panic!("fixture tensor type {other:?}"),
            };
            w.tensor(&t.name, &dims, id, data);
        }
    }
    std::fs::write(dst, w.to_bytes()).unwrap();
}

fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("turbokv-fam-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn bad_family_files_give_typed_errors() {
    let dir = tempdir("bad");
    let gemma = family_dir("gemma3").join("model.gguf");

    // A Gemma 3 file without one of its post norms names the tensor.
    rewrite_gguf(
        &gemma,
        &dir.join("missing.gguf"),
        |n, d, b| (n != "blk.2.post_ffw_norm.weight").then_some((d, b)),
        &[],
    );
    let err = load(&dir.join("missing.gguf")).err().unwrap();
    assert!(
        matches!(&err, ModelError::MissingTensor(n) if n == "blk.2.post_ffw_norm.weight"),
        "{err}"
    );

    // A mis-shaped post norm (half its length) names the tensor and both lengths.
    rewrite_gguf(
        &gemma,
        &dir.join("shape.gguf"),
        |n, d, b| {
            if n == "blk.0.post_attention_norm.weight" {
                Some((vec![d[0] / 2], b[..b.len() / 2].to_vec()))
            } else {
                Some((d, b))
            }
        },
        &[],
    );
    let err = load(&dir.join("shape.gguf")).err().unwrap();
    assert!(
        matches!(&err, ModelError::TensorShape { name, .. } if name == "blk.0.post_attention_norm.weight"),
        "{err}"
    );

    // A Gemma 2-style soft-capping config is refused, not silently ignored.
    rewrite_gguf(
        &gemma,
        &dir.join("softcap.gguf"),
        |_, d, b| Some((d, b)),
        &[("gemma3.final_logit_softcapping", MetaValue::F64(30.0))],
    );
    let err = load(&dir.join("softcap.gguf")).err().unwrap();
    assert!(
        matches!(err, ModelError::InvalidConfig(ref m) if m.contains("final_logit_softcapping")),
        "{err}"
    );

    // Sub-variants this engine does not run name themselves and what is supported.
    for (arch, hint) in [
        ("gemma2", "Gemma 1/2"),
        ("granitemoe", "MoE"),
        ("gemma3n", "vision-language"),
    ] {
        rewrite_gguf(
            &gemma,
            &dir.join("arch.gguf"),
            |_, d, b| Some((d, b)),
            &[("general.architecture", MetaValue::Str(arch.into()))],
        );
        let err = load(&dir.join("arch.gguf")).err().unwrap();
        let msg = err.to_string();
        assert!(
            matches!(err, ModelError::UnknownArchitecture { .. })
                && msg.contains(hint)
                && msg.contains("gemma3"),
            "{msg}"
        );
    }

    // The same for a Hugging Face directory: the vision-language Gemma 3.
    let hf = dir.join("vlm");
    std::fs::create_dir_all(&hf).unwrap();
    let src = family_dir("gemma3").join("hf");
    std::fs::copy(src.join("model.safetensors"), hf.join("model.safetensors")).unwrap();
    let cfg = std::fs::read_to_string(src.join("config.json"))
        .unwrap()
        .replace("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration");
    std::fs::write(hf.join("config.json"), cfg).unwrap();
    let err = load(&hf).err().unwrap();
    assert!(
        err.to_string().contains("Gemma3ForCausalLM, is supported"),
        "{err}"
    );

    // A layer_types list that does not match the layer count.
    let cfg = std::fs::read_to_string(src.join("config.json"))
        .unwrap()
        .replacen(
            "\"full_attention\"",
            "\"full_attention\", \"full_attention\"",
            1,
        );
    std::fs::write(hf.join("config.json"), cfg).unwrap();
    let err = load(&hf).err().unwrap();
    assert!(
        matches!(err, ModelError::InvalidConfig(ref m) if m.contains("7 layer types for 6 layers")),
        "{err}"
    );
}

/// Gemma 3's sliding-window layers keep a ring of their window (rounded to blocks) however
/// long the context, and decoding far past the point where the ring wraps gives the logits of
/// full attention restricted to the window (the same model with every token kept).
#[test]
fn gemma3_ring_stays_bounded_and_equals_windowed_full_attention() {
    let path = family_dir("gemma3").join("model.gguf");
    let ring = load(&path).unwrap();
    let full = load(&path).unwrap();
    full.transformer.set_sliding_rings(false);
    let (tr, tf) = (&ring.transformer, &full.transformer);
    let window = tr.config().arch.sliding_window.unwrap();
    let ctx = 256;
    let mut a = Session::new(tr, KvDtype::F16, ctx).unwrap();
    let mut b = Session::new(tf, KvDtype::F16, ctx).unwrap();
    let ring_tokens = a.cache().ring_tokens_per_seq().expect("rings on");
    assert!(
        ring_tokens < 3 * window,
        "{ring_tokens} tokens for a window of {window}"
    );
    assert_eq!(b.cache().ring_tokens_per_seq(), None);
    // Only the global layer (one of six) counts per token; the rings are bounded.
    let (ba, bb) = (a.cache().bytes_per_token(), b.cache().bytes_per_token());
    assert!((ba * 6.0 - bb).abs() < 1e-9, "{ba} vs {bb} bytes per token");

    // A prompt longer than a ring step, so prefill is split into window-sized steps.
    let prompt: Vec<u32> = (0..37).map(|i| (i * 11 + 5) % 128).collect();
    let la = a.prefill_all_logits(&prompt).unwrap();
    let lb = b.prefill_all_logits(&prompt).unwrap();
    assert_eq!(la.len(), lb.len());
    assert_close(&la, &lb, "prefill");
    let mut next = common::argmax(&la[la.len() - 128..]);
    let steps = ctx - prompt.len();
    for step in 0..steps {
        let ra = a.step(next).unwrap().to_vec();
        let rb = b.step(next).unwrap().to_vec();
        assert_close(&ra, &rb, &format!("decode step {step}"));
        next = common::argmax(&ra);
        let blocks = a.cache().ring_blocks(0).unwrap_or(0);
        assert!(
            blocks * 16 <= ring_tokens,
            "{blocks} ring blocks at step {step}"
        );
    }
    assert_eq!(a.len(), ctx);
    assert!(ctx >= 8 * ring_tokens, "the ring wrapped many times");
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    // The same keys and values, but the ring splits long steps into window-sized ones, so
    // matmuls and the global layers' attention run over other row counts (other kernels and
    // summation orders) and a key's f16 rounding may land differently: float noise of
    // ~1e-5 of the logit scale (observed ≤ 4e-5). A wrong ring slot would be off by O(1).
    let scale = b.iter().map(|x| x.abs()).fold(0.0f32, f32::max);
    let err = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(
        err < 2e-4 * scale,
        "{what}: the two runs differ by {err} (scale {scale})"
    );
}

/// Several sequences in one step, some longer than a ring step (split and reassembled),
/// give the logits of the same step on a cache that keeps every token; a sequence cut back
/// further than its ring reaches is refused.
#[test]
fn gemma3_split_batched_steps_and_truncation_limits() {
    use turbokv_model::{LogitsFor, SeqInput};
    let path = family_dir("gemma3").join("model.gguf");
    let ring = load(&path).unwrap();
    let full = load(&path).unwrap();
    full.transformer.set_sliding_rings(false);
    let run = |m: &Model<CpuBackend>| {
        let t = &m.transformer;
        let mut cache = t.new_cache(KvDtype::F16, 16, 512, 128).unwrap();
        let mut scratch = t.new_scratch().unwrap();
        let (s1, s2): (Vec<u32>, Vec<u32>) = (
            (0..30).map(|i| (i * 3 + 1) % 128).collect(),
            (0..5).map(|i| (i * 7 + 2) % 128).collect(),
        );
        for id in [1, 2] {
            cache.add_sequence(id).unwrap();
        }
        let mut out = Vec::new();
        let inputs = [
            SeqInput {
                seq: 1,
                tokens: &s1,
            },
            SeqInput {
                seq: 2,
                tokens: &s2,
            },
        ];
        t.forward(
            &inputs,
            &mut cache,
            &mut scratch,
            LogitsFor::AllTokens,
            &mut out,
        )
        .unwrap();
        let mut last = Vec::new();
        t.forward(
            &inputs,
            &mut cache,
            &mut scratch,
            LogitsFor::LastToken,
            &mut last,
        )
        .unwrap();
        out.extend(last);
        (out, cache)
    };
    let (la, mut ca) = run(&ring);
    let (lb, _) = run(&full);
    assert_eq!(la.len(), (30 + 5 + 2) * 128);
    assert_close(&la, &lb, "batched split step");

    assert_eq!(ca.seq_len(1).unwrap(), 60);
    let err = ca.truncate(1, 20).unwrap_err();
    assert!(err.to_string().contains("sliding-window"), "{err}");
    assert_eq!(ca.seq_len(1).unwrap(), 60, "a refused cut changes nothing");
    ca.truncate(1, 58).unwrap();
    ca.truncate(2, 0).unwrap();
}

/// A backend with only the plain decoder's kernels (the trait's defaults for the family
/// ops): the CPU's kernels behind it.
struct PlainOnly(CpuBackend);

/// A backend with some of the family ops over the CPU's kernels (the CUDA backend's
/// capabilities before it took sinks and experts): the element-wise family ops and sliding
/// windows over 16-bit pools, but no sinks, no windows over coded pools, no short convolution
/// (LFM2) and no mixture of experts (gpt-oss).
struct NoShortConv(CpuBackend);

mod plain_only {
    use super::{NoShortConv, PlainOnly};
    use turbokv_backend::cpu::{CpuKvPool, CpuPicks, CpuTensor};
    use turbokv_backend::{
        AttnGeometry, AttnVariant, Backend, Error, QkNorm, Rope, SeqSpan, VariantNeeds,
        WeightMatrix,
    };
    use turbokv_cache::KvLayout;
    use turbokv_codec::KvDtype;

    type V = Vec<f32>;

    /// The plain decoder's ops, delegated to the CPU backend in `.0`.
    macro_rules! plain_ops {
        () => {
            fn describe(&self) -> String {
                "plain-only".into()
            }
            fn check_kv_dtype(&self, d: KvDtype, h: usize) -> Result<(), Error> {
                self.0.check_kv_dtype(d, h)
            }
            fn tensor(&self, r: usize, c: usize) -> Result<CpuTensor, Error> {
                self.0.tensor(r, c)
            }
            fn set_rows(&self, t: &mut CpuTensor, r: usize) -> Result<(), Error> {
                self.0.set_rows(t, r)
            }
            fn to_host(&self, t: &CpuTensor, o: &mut Vec<f32>) -> Result<(), Error> {
                self.0.to_host(t, o)
            }
            fn cols(&self, t: &CpuTensor) -> usize {
                self.0.cols(t)
            }
            fn matrix(&self, w: &WeightMatrix) -> Result<WeightMatrix, Error> {
                self.0.matrix(w)
            }
            fn vector(&self, v: &[f32]) -> Result<V, Error> {
                self.0.vector(v)
            }
            fn kv_pool(&self, l: &KvLayout, i: usize) -> Result<CpuKvPool, Error> {
                self.0.kv_pool(l, i)
            }
            fn embed(&self, t: &WeightMatrix, ids: &[u32], o: &mut CpuTensor) -> Result<(), Error> {
                self.0.embed(t, ids, o)
            }
            fn new_picks(&self) -> Result<CpuPicks, Error> {
                self.0.new_picks()
            }
            fn pick_greedy(&self, l: &CpuTensor, p: &mut CpuPicks) -> Result<(), Error> {
                self.0.pick_greedy(l, p)
            }
            fn wait_picks(&self, p: &mut CpuPicks, o: &mut Vec<u32>) -> Result<(), Error> {
                self.0.wait_picks(p, o)
            }
            fn embed_picks(
                &self,
                t: &WeightMatrix,
                p: &CpuPicks,
                r: usize,
                o: &mut CpuTensor,
            ) -> Result<(), Error> {
                self.0.embed_picks(t, p, r, o)
            }
            fn rms_norm(
                &self,
                x: &CpuTensor,
                w: &V,
                e: f32,
                o: &mut CpuTensor,
            ) -> Result<(), Error> {
                self.0.rms_norm(x, w, e, o)
            }
            fn matmul(
                &self,
                x: &CpuTensor,
                w: &WeightMatrix,
                o: &mut CpuTensor,
            ) -> Result<(), Error> {
                self.0.matmul(x, w, o)
            }
            fn matmul_cat(
                &self,
                x: &CpuTensor,
                ws: &[WeightMatrix],
                o: &mut CpuTensor,
            ) -> Result<(), Error> {
                self.0.matmul_cat(x, ws, o)
            }
            fn add_bias(&self, x: &mut CpuTensor, b: &V) -> Result<(), Error> {
                self.0.add_bias(x, b)
            }
            fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<(), Error> {
                self.0.add_assign(x, y)
            }
            fn silu_mul(&self, g: &CpuTensor, o: &mut CpuTensor) -> Result<(), Error> {
                self.0.silu_mul(g, o)
            }
            fn gather_rows(
                &self,
                x: &CpuTensor,
                r: &[usize],
                o: &mut CpuTensor,
            ) -> Result<(), Error> {
                self.0.gather_rows(x, r, o)
            }
            fn write_kv(
                &self,
                qkv: &mut CpuTensor,
                g: &AttnGeometry,
                rope: &Rope,
                n: Option<QkNorm<'_, V>>,
                s: &[SeqSpan<'_>],
                p: &mut CpuKvPool,
            ) -> Result<(), Error> {
                self.0.write_kv(qkv, g, rope, n, s, p)
            }
            fn attention(
                &self,
                qkv: &CpuTensor,
                g: &AttnGeometry,
                s: &[SeqSpan<'_>],
                p: &CpuKvPool,
                o: &mut CpuTensor,
            ) -> Result<(), Error> {
                self.0.attention(qkv, g, s, p, o)
            }
        };
    }

    impl Backend for PlainOnly {
        type Tensor = CpuTensor;
        type Matrix = WeightMatrix;
        type Vector = V;
        type KvPool = CpuKvPool;
        type Picks = CpuPicks;
        plain_ops!();
    }

    impl Backend for NoShortConv {
        type Tensor = CpuTensor;
        type Matrix = WeightMatrix;
        type Vector = V;
        type KvPool = CpuKvPool;
        type Picks = CpuPicks;
        plain_ops!();
        fn supports_family_ops(&self) -> bool {
            true
        }
        fn scale(&self, x: &mut CpuTensor, f: f32) -> Result<(), Error> {
            self.0.scale(x, f)
        }
        fn gelu_mul(&self, g: &CpuTensor, o: &mut CpuTensor) -> Result<(), Error> {
            self.0.gelu_mul(g, o)
        }
        fn supports_attention_variant(
            &self,
            g: &AttnGeometry,
            dtype: KvDtype,
            needs: VariantNeeds,
        ) -> Result<(), Error> {
            if needs.sinks || (needs.window && dtype.is_compressed()) {
                return Err(Error::UnsupportedAttention {
                    backend: "cuda-like",
                    detail: format!("{} over {dtype}", needs.describe()),
                    supported: "windows over 16-bit caches".into(),
                });
            }
            self.0.supports_attention_variant(g, dtype, needs)
        }
        fn attention_variant(
            &self,
            qkv: &CpuTensor,
            g: &AttnGeometry,
            s: &[SeqSpan<'_>],
            p: &CpuKvPool,
            v: &AttnVariant<'_, V>,
            o: &mut CpuTensor,
        ) -> Result<(), Error> {
            self.0.attention_variant(qkv, g, s, p, v, o)
        }
    }
}

/// A backend without the family ops refuses Granite, Gemma 3, LFM2 and gpt-oss when the model
/// is loaded, with an error naming the family and the backend; its default family ops (the
/// short convolution included) refuse rather than compute. One with some of them
/// (`NoShortConv`) loads Granite and Gemma 3 and refuses LFM2 and gpt-oss, naming what it
/// lacks; a Gemma 3 cache whose windowed layers would be coded (no rings) is refused when it
/// is made, and runs where the rings keep them 16-bit.
#[test]
fn a_backend_without_family_ops_refuses_them_at_load() {
    use turbokv_backend::Backend;
    for name in ["granite", "gemma3", "lfm2", "gpt_oss"] {
        for path in [
            family_dir(name).join("hf"),
            family_dir(name).join("model.gguf"),
        ] {
            let err = Model::load(&path, PlainOnly(CpuBackend::new()), &LoadOptions::default())
                .err()
                .unwrap();
            assert!(
                matches!(err, ModelError::FamilyUnsupported { .. })
                    && err.to_string().contains("plain-only"),
                "{name}: {err}"
            );
        }
    }
    // With windows but no sinks, experts or convolutions: Granite and Gemma 3 load, LFM2 and
    // gpt-oss do not.
    Model::load(
        &family_dir("granite").join("model.gguf"),
        NoShortConv(CpuBackend::new()),
        &LoadOptions::default(),
    )
    .unwrap();
    let gemma = Model::load(
        &family_dir("gemma3").join("model.gguf"),
        NoShortConv(CpuBackend::new()),
        &LoadOptions::default(),
    )
    .unwrap();
    // The fixture's window is 8: rings (16 tokens each) are made for a context of 64, not 16.
    let tq3: KvDtype = "tq3".parse().unwrap();
    let tm = &gemma.transformer;
    tm.new_cache(tq3, 16, 256, 64).unwrap();
    let err = tm.new_cache(tq3, 16, 256, 16).err().unwrap();
    assert!(
        matches!(
            err,
            ModelError::Backend(turbokv_backend::Error::UnsupportedAttention { .. })
        ) && err.to_string().contains("sliding window"),
        "{err}"
    );
    tm.set_sliding_rings(false);
    let err = tm.new_cache(tq3, 16, 256, 64).err().unwrap();
    assert!(err.to_string().contains("sliding window"), "{err}");
    tm.new_cache(KvDtype::Bf16, 16, 256, 64).unwrap();
    tm.set_sliding_rings(true);
    let err = Model::load(
        &family_dir("lfm2").join("model.gguf"),
        NoShortConv(CpuBackend::new()),
        &LoadOptions::default(),
    )
    .err()
    .unwrap();
    assert!(
        matches!(
            err,
            ModelError::FamilyUnsupported {
                family: turbokv_model::Family::Lfm2,
                ..
            }
        ) && err.to_string().contains("short convolution"),
        "{err}"
    );
    // gpt-oss needs a window (which the stand-in has) and sinks (which it lacks): the error
    // names only the sinks.
    let err = Model::load(
        &family_dir("gpt_oss").join("model.gguf"),
        NoShortConv(CpuBackend::new()),
        &LoadOptions::default(),
    )
    .err()
    .unwrap();
    let msg = err.to_string();
    assert!(
        matches!(err, ModelError::FamilyUnsupported { .. })
            && msg.contains("attention sinks")
            && !msg.contains("sliding window"),
        "{msg}"
    );

    let b = PlainOnly(CpuBackend::new());
    let mut t = b.tensor(2, 4).unwrap();
    let err = b.scale(&mut t, 2.0).unwrap_err();
    assert!(err.to_string().contains("scale"), "{err}");
    let gu = b.tensor(2, 8).unwrap();
    assert!(b.gelu_mul(&gu, &mut t).is_err());
    assert!(!b.supports_short_conv());
    let bcx = b.tensor(2, 12).unwrap();
    let err = b
        .short_conv(&bcx, &vec![0.0; 12], &[], &mut [], &mut t)
        .unwrap_err();
    assert!(err.to_string().contains("short_conv"), "{err}");
}
