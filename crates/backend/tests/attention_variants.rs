//! Sliding-window and attention-sink attention ([`Backend::attention_variant`]) on the CPU
//! against a float64 reference over the vectors the pool holds, for 16-bit, int8 and
//! TurboQuant pools (with and without a policy's full-precision tokens), prefill chunks and
//! decode steps, GQA, and a block table that scatters blocks over the pool.

mod common;

use common::{BLOCK, Rng, roundtrip, window_copy};
use turbokv_backend::cpu::{CpuBackend, CpuTensor};
use turbokv_backend::{AttnGeometry, AttnVariant, Backend, Rope, RopeStyle, SeqSpan};
use turbokv_cache::{KvLayout, KvWindow};
use turbokv_codec::{KvDtype, LayerCodec};

/// Worst |error| / max |reference| over every output row of `chunks` (token counts).
fn check(
    dtype: KvDtype,
    exact: KvWindow,
    window: Option<usize>,
    sinks: bool,
    chunks: &[usize],
) -> f64 {
    let (n_heads, n_kv, d) = (6, 2, 64);
    let b = CpuBackend::new();
    let g = AttnGeometry {
        n_heads,
        n_kv_heads: n_kv,
        head_dim: d,
        scale: 1.0 / (d as f32).sqrt(),
    };
    let total: usize = chunks.iter().sum();
    let mut layout = KvLayout::uniform(1, n_kv, d, dtype, BLOCK, total).unwrap();
    layout.window = exact;
    let mut pool = b.kv_pool(&layout, 0).unwrap();
    let codec = LayerCodec::new(dtype, d, 0, &layout.codec).unwrap();
    let nb = total.div_ceil(BLOCK);
    let blocks: Vec<u32> = (0..nb as u32).rev().collect();
    let no_rope = Rope {
        inv_freq: Vec::new(),
        style: RopeStyle::HalfSplit,
    };
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let sink_logits: Vec<f32> = (0..n_heads).map(|_| 2.0 * rng.next() + 1.0).collect();
    let variant = AttnVariant {
        window,
        sinks: sinks.then_some(&sink_logits),
    };
    let is16 = matches!(dtype, KvDtype::F16 | KvDtype::Bf16);
    let (mut ks, mut vs, mut kx, mut vx) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut worst = 0f64;
    let mut pos = 0;
    for &n in chunks {
        let data: Vec<f32> = (0..n * g.qkv_width()).map(|_| 2.0 * rng.next()).collect();
        let mut qkv = CpuTensor::from_vec(data.clone(), n, g.qkv_width()).unwrap();
        let spans = [SeqSpan {
            first_row: 0,
            n_tokens: n,
            first_pos: pos,
            blocks: &blocks,
        }];
        b.write_kv(&mut qkv, &g, &no_rope, None, &spans, &mut pool)
            .unwrap();
        let mut out = b.tensor(n, n_heads * d).unwrap();
        out.as_mut_slice().fill(f32::NAN);
        b.attention_variant(&qkv, &g, &spans, &pool, &variant, &mut out)
            .unwrap();
        for (t, row) in data.chunks(g.qkv_width()).enumerate() {
            let k = &row[n_heads * d..(n_heads + n_kv) * d];
            let v = &row[(n_heads + n_kv) * d..];
            let per_head = |f: &dyn Fn(&[f32]) -> Vec<f32>, x: &[f32]| -> Vec<Vec<f32>> {
                x.chunks(d).map(f).collect()
            };
            ks.push(per_head(&|x| roundtrip(&codec.key, x), k));
            vs.push(per_head(&|x| roundtrip(&codec.value, x), v));
            kx.push(per_head(&|x| window_copy(&codec.key, x), k));
            vx.push(per_head(&|x| window_copy(&codec.value, x), v));
            let p = pos + t;
            let lo = window.map_or(0, |w| (p + 1).saturating_sub(w));
            let exact_at = |j: usize| !is16 && exact.is_exact(p, j);
            for h in 0..n_heads {
                let kvh = h / (n_heads / n_kv);
                let q = &row[h * d..(h + 1) * d];
                let key = |j: usize| {
                    if exact_at(j) {
                        &kx[j][kvh]
                    } else {
                        &ks[j][kvh]
                    }
                };
                let val = |j: usize| {
                    if exact_at(j) {
                        &vx[j][kvh]
                    } else {
                        &vs[j][kvh]
                    }
                };
                let scores: Vec<f64> = (lo..=p)
                    .map(|j| {
                        q.iter()
                            .zip(key(j))
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            * g.scale as f64
                    })
                    .collect();
                let mut m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                if sinks {
                    m = m.max(sink_logits[h] as f64);
                }
                let mut z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                if sinks {
                    z += (sink_logits[h] as f64 - m).exp();
                }
                let got = &out.row(t)[h * d..(h + 1) * d];
                let want: Vec<f64> = (0..d)
                    .map(|c| {
                        (lo..=p)
                            .map(|j| (scores[j - lo] - m).exp() / z * val(j)[c] as f64)
                            .sum()
                    })
                    .collect();
                let scale = want.iter().map(|x| x.abs()).fold(1e-3, f64::max);
                for (a, w) in got.iter().zip(&want) {
                    assert!(a.is_finite(), "{dtype}: non-finite output");
                    worst = worst.max((*a as f64 - w).abs() / scale);
                }
            }
        }
        pos += n;
    }
    worst
}

#[test]
fn windowed_and_sink_attention_match_reference_for_every_pool_format() {
    let chunks = [7, 1, 29, 1, 1, 40, 1];
    for dtype in ["f16", "bf16", "int8", "fp8", "tq3", "k4v2"] {
        let dtype: KvDtype = dtype.parse().unwrap();
        for (window, sinks) in [(Some(5), false), (None, true), (Some(20), true)] {
            let err = check(dtype, KvWindow::default(), window, sinks, &chunks);
            // f32 accumulation over ≤ 80 keys of decoded vectors: float noise only.
            assert!(
                err < 1e-4,
                "{dtype} window {window:?} sinks {sinks}: relative error {err}"
            );
        }
    }
}

#[test]
fn windowed_attention_reads_a_policys_exact_tokens() {
    let exact = KvWindow {
        sinks: 3,
        recent: 9,
        ..Default::default()
    };
    for dtype in ["tq2", "int8", "fp8"] {
        let dtype: KvDtype = dtype.parse().unwrap();
        for window in [Some(6), Some(30), None] {
            let err = check(dtype, exact, window, true, &[20, 1, 1, 35, 1]);
            assert!(
                err < 1e-4,
                "{dtype} window {window:?}: relative error {err}"
            );
        }
    }
}

#[test]
fn plain_variant_is_plain_attention_and_bad_variants_are_refused() {
    let b = CpuBackend::new();
    let g = AttnGeometry {
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 64,
        scale: 0.125,
    };
    let layout = KvLayout::uniform(1, 1, 64, KvDtype::F16, BLOCK, 32).unwrap();
    let mut pool = b.kv_pool(&layout, 0).unwrap();
    let mut rng = Rng(7);
    let data: Vec<f32> = (0..5 * g.qkv_width()).map(|_| rng.next()).collect();
    let mut qkv = CpuTensor::from_vec(data, 5, g.qkv_width()).unwrap();
    let blocks = [1u32, 0];
    let spans = [SeqSpan {
        first_row: 0,
        n_tokens: 5,
        first_pos: 0,
        blocks: &blocks,
    }];
    let rope = Rope {
        inv_freq: Vec::new(),
        style: RopeStyle::HalfSplit,
    };
    b.write_kv(&mut qkv, &g, &rope, None, &spans, &mut pool)
        .unwrap();
    let mut a = b.tensor(5, 128).unwrap();
    let mut c = b.tensor(5, 128).unwrap();
    b.attention(&qkv, &g, &spans, &pool, &mut a).unwrap();
    let plain = AttnVariant {
        window: None,
        sinks: None,
    };
    b.attention_variant(&qkv, &g, &spans, &pool, &plain, &mut c)
        .unwrap();
    assert_eq!(a.as_slice(), c.as_slice());
    // A window as long as the context is plain attention too.
    let wide = AttnVariant {
        window: Some(5),
        sinks: None,
    };
    b.attention_variant(&qkv, &g, &spans, &pool, &wide, &mut c)
        .unwrap();
    let err = a
        .as_slice()
        .iter()
        .zip(c.as_slice())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(err < 1e-5, "{err}");

    let zero = AttnVariant {
        window: Some(0),
        sinks: None,
    };
    assert!(
        b.attention_variant(&qkv, &g, &spans, &pool, &zero, &mut c)
            .is_err()
    );
    let short = vec![0.0f32; 1];
    let bad_sinks = AttnVariant {
        window: None,
        sinks: Some(&short),
    };
    let err = b
        .attention_variant(&qkv, &g, &spans, &pool, &bad_sinks, &mut c)
        .unwrap_err();
    assert!(
        err.to_string().contains("1 sink logits for 2 heads"),
        "{err}"
    );
}

/// The premise of the GPU's window tests (`cuda_ops.rs` `window_attention_matches_cpu`) on
/// the CPU reference: a query never reads a key before its window. Keys and values of the
/// positions a step's queries see are written through a ring-like table (logical block i in
/// ring block i mod n, n just large enough, as `model/src/arch/ring.rs` keeps them), every
/// other slot of the pool holding NaN; the output is bit-identical to the same contents
/// through a table of distinct blocks, zeros elsewhere.
#[test]
fn window_attention_reads_nothing_before_the_window() {
    let (n_heads, n_kv, d, bs) = (8, 2, 64, BLOCK);
    let b = CpuBackend::new();
    let g = AttnGeometry {
        n_heads,
        n_kv_heads: n_kv,
        head_dim: d,
        scale: 1.0 / (d as f32).sqrt(),
    };
    let mut r = Rng(0x5eed);
    let blocks = 96;
    for dtype in [KvDtype::Bf16, KvDtype::F16] {
        let enc = |x: f32| match dtype {
            KvDtype::Bf16 => half::bf16::from_f32(x).to_bits(),
            _ => half::f16::from_f32(x).to_bits(),
        };
        let nan = enc(f32::NAN);
        let layout = KvLayout::uniform(1, n_kv, d, dtype, bs, blocks * bs).unwrap();
        for window in [3usize, 20, 70] {
            // (first position, new tokens): a prefill chunk and decode rows.
            let step = [(200usize, 33usize), (90, 1), (0, 17)];
            let per_head = bs * d;
            let mut ring = (
                vec![nan; blocks * n_kv * per_head],
                vec![nan; blocks * n_kv * per_head],
            );
            let mut flat = (
                vec![0u16; blocks * n_kv * per_head],
                vec![0u16; blocks * n_kv * per_head],
            );
            let (mut ring_tables, mut flat_tables) = (Vec::new(), Vec::new());
            let (mut next_ring, mut next_flat) = (0u32, 0u32);
            for &(first, n) in &step {
                let end = first + n;
                let lo = (first + 1).saturating_sub(window);
                let len = (end - lo).div_ceil(bs) + 1;
                let own: Vec<u32> = (next_ring..next_ring + len as u32).collect();
                next_ring += len as u32;
                let rt: Vec<u32> = (0..end.div_ceil(bs)).map(|i| own[i % len]).collect();
                let ft: Vec<u32> = (next_flat..next_flat + end.div_ceil(bs) as u32).collect();
                next_flat += end.div_ceil(bs) as u32;
                for p in lo..end {
                    for h in 0..n_kv {
                        let at = |t: &[u32]| ((t[p / bs] as usize * n_kv + h) * bs + p % bs) * d;
                        let (ra, fa) = (at(&rt), at(&ft));
                        for j in 0..d {
                            let (k, v) = (enc(r.next()), enc(r.next()));
                            ring.0[ra + j] = k;
                            ring.1[ra + j] = v;
                            flat.0[fa + j] = k;
                            flat.1[fa + j] = v;
                        }
                    }
                }
                ring_tables.push(rt);
                flat_tables.push(ft);
            }
            let rows: usize = step.iter().map(|s| s.1).sum();
            let qkv = CpuTensor::from_vec(
                (0..rows * g.qkv_width()).map(|_| r.next()).collect(),
                rows,
                g.qkv_width(),
            )
            .unwrap();
            let mut outs = Vec::new();
            for ((k, v), tables) in [(&ring, &ring_tables), (&flat, &flat_tables)] {
                let mut pool = b.kv_pool(&layout, 0).unwrap();
                for blk in 0..blocks {
                    let mut bytes = Vec::new();
                    for h in 0..n_kv {
                        let at = (blk * n_kv + h) * per_head;
                        for x in k[at..at + per_head].iter().chain(&v[at..at + per_head]) {
                            bytes.extend_from_slice(&x.to_le_bytes());
                        }
                    }
                    b.write_kv_block(&mut pool, blk as u32, &bytes).unwrap();
                }
                let mut spans = Vec::new();
                let mut row = 0;
                for (&(first_pos, n), t) in step.iter().zip(tables) {
                    spans.push(SeqSpan {
                        first_row: row,
                        n_tokens: n,
                        first_pos,
                        blocks: t,
                    });
                    row += n;
                }
                let mut out = b.tensor(rows, n_heads * d).unwrap();
                let variant = AttnVariant::<Vec<f32>> {
                    window: Some(window),
                    sinks: None,
                };
                b.attention_variant(&qkv, &g, &spans, &pool, &variant, &mut out)
                    .unwrap();
                outs.push(out.as_slice().to_vec());
            }
            assert!(
                outs[0].iter().all(|x| x.is_finite()),
                "{dtype} window {window}"
            );
            assert_eq!(outs[0], outs[1], "{dtype} window {window}");
        }
    }
}
