//! Attention on compressed codes equals exact attention over the decoded vectors.
//!
//! For every KV dtype the CPU backend writes random keys/values through `write_kv` and
//! attends with `attention`. The reference encodes and decodes the same vectors with the
//! codec (encoding is deterministic, so these are the vectors the pool holds) and runs plain
//! float64 causal attention. Shapes cover GQA ratios 1/3/8, head dims 64/128/256, contexts
//! crossing block boundaries, prefill in chunks, and split-K decode (context > 1024).

mod common;

use std::sync::Arc;
use turbokv_backend::cpu::{CodeProducts, CpuBackend, CpuOptions, CpuTensor};
use turbokv_backend::{AttnGeometry, Backend, Rope, RopeStyle, SeqSpan};

use common::{BLOCK, Rng, f16_round, roundtrip, window_copy};
use turbokv_cache::{KvCenters, KvLayout, KvWindow, WindowCopies};
use turbokv_codec::{KeyMode, KvDtype, LayerCodec};

/// Runs `chunks` (token counts) of one sequence through write_kv + attention; returns the
/// worst |error| / max |reference| over every output row.
fn check(
    dtype: KvDtype,
    n_heads: usize,
    n_kv: usize,
    d: usize,
    chunks: &[usize],
    seed: u64,
) -> f64 {
    check_windowed(dtype, KvWindow::default(), n_heads, n_kv, d, chunks, seed)
}

/// What an int8-copy window holds for `x`, back in the original basis: `x` rounded to f16
/// and brought into the working basis as for [`window_copy`], then rounded to int8 steps of
/// `max|w| / 127` (the step itself rounded to f16 first, as stored).
fn window_copy_int8(codec: &turbokv_codec::VectorCodec, x: &[f32]) -> Vec<f32> {
    let mut work = vec![0f32; codec.work_dim()];
    codec.exact_to_work(&f16_round(x), &mut work).unwrap();
    let max = work.iter().fold(0f32, |m, v| m.max(v.abs()));
    let step = half::f16::from_f32(max / 127.0).to_f32();
    let q: Vec<f32> = work
        .iter()
        .map(|&v| {
            if step > 0.0 {
                (v / step).round().clamp(-127.0, 127.0) * step
            } else {
                0.0
            }
        })
        .collect();
    let mut out = vec![0f32; x.len()];
    codec.work_to_output(&q, &mut out).unwrap();
    out
}

/// Key mode, centering and code products of a [`check_with`] run.
#[derive(Clone, Copy, Default)]
struct Variant {
    prod_keys: bool,
    centered: bool,
    /// Decode through int8 products of table codes ([`CodeProducts::Int8`]); the default
    /// f32 products attend exactly over the decoded vectors.
    int8_products: bool,
    /// Also measure against exact attention over the vectors before encoding.
    exact_reference: bool,
    /// Each kv head's dtype ([`turbokv_cache::LayerKv::head_dtypes`]); `None` = the layer's.
    heads: Option<&'static [&'static str]>,
}

/// [`check`] with sink and recent-window tokens: the reference reads those positions from
/// their [`window_copy`] and every other position from the codec's decoded vectors.
fn check_windowed(
    dtype: KvDtype,
    window: KvWindow,
    n_heads: usize,
    n_kv: usize,
    d: usize,
    chunks: &[usize],
    seed: u64,
) -> f64 {
    let v = Variant::default();
    check_with(dtype, window, v, n_heads, n_kv, d, chunks, seed).0
}

/// Float64 softmax attention of the query row `q` over positions `0..=p`.
fn exact_attention<'a>(
    q: &[f32],
    p: usize,
    scale: f32,
    key: impl Fn(usize) -> &'a [f32],
    val: impl Fn(usize) -> &'a [f32],
) -> Vec<f64> {
    let scores: Vec<f64> = (0..=p)
        .map(|j| {
            q.iter()
                .zip(key(j))
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>()
                * scale as f64
        })
        .collect();
    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
    let mut out = vec![0f64; q.len()];
    for (j, s) in scores.iter().enumerate() {
        let w = (s - m).exp() / z;
        for (o, x) in out.iter_mut().zip(val(j)) {
            *o += w * *x as f64;
        }
    }
    out
}

/// [`check_windowed`] with prod-mode keys and/or per-head centering: a centered pool stores
/// `k − μ_k` and `v − μ_v`; the reference attends over those keys (a shared shift leaves
/// softmax unchanged) and over `μ_v +` the stored values.
///
/// Returns the worst error against the decoded vectors and, with
/// [`Variant::exact_reference`], the worst against exact attention over the vectors before
/// encoding (the same measure: |error| / max |reference| per output row; else NaN).
#[allow(clippy::too_many_arguments)]
fn check_with(
    dtype: KvDtype,
    window: KvWindow,
    variant: Variant,
    n_heads: usize,
    n_kv: usize,
    d: usize,
    chunks: &[usize],
    seed: u64,
) -> (f64, f64) {
    let b = CpuBackend::with_options(CpuOptions {
        code_products: if variant.int8_products {
            CodeProducts::Int8
        } else {
            CodeProducts::F32
        },
        ..CpuOptions::default()
    });
    let g = AttnGeometry {
        n_heads,
        n_kv_heads: n_kv,
        head_dim: d,
        scale: 1.0 / (d as f32).sqrt(),
    };
    let total: usize = chunks.iter().sum();
    let mut layout = KvLayout::uniform(1, n_kv, d, dtype, BLOCK, total).unwrap();
    layout.window = window;
    if variant.prod_keys {
        layout.codec.key_mode = KeyMode::Prod;
    }
    let mut crng = Rng(seed.wrapping_mul(31) | 1);
    let centers = KvCenters {
        kv_heads: n_kv,
        head_dim: d,
        key: (0..n_kv * d).map(|_| 0.5 + crng.next()).collect(),
        value: (0..n_kv * d).map(|_| 2.0 * crng.next()).collect(),
    };
    let (mu_k, mu_v) = if variant.centered {
        layout.centers = Some(Arc::new(centers.clone()));
        (centers.key.clone(), centers.value.clone())
    } else {
        (vec![0.0; n_kv * d], vec![0.0; n_kv * d])
    };
    let head_dtypes: Vec<KvDtype> = match variant.heads {
        Some(hs) => hs.iter().map(|h| h.parse().unwrap()).collect(),
        None => vec![dtype; n_kv],
    };
    if variant.heads.is_some() {
        layout.layers[0].head_dtypes = head_dtypes.clone();
    }
    let mut pool = b.kv_pool(&layout, 0).unwrap();
    // The reference codes each head with its own dtype.
    let codecs: Vec<LayerCodec> = head_dtypes
        .iter()
        .map(|&hd| LayerCodec::new(hd, d, 0, &layout.codec).unwrap())
        .collect();
    // Scatter logical blocks over the pool to exercise the block table.
    let nb = total.div_ceil(BLOCK);
    let blocks: Vec<u32> = (0..nb as u32).map(|i| (i * 7) % nb as u32).collect();
    let no_rope = Rope {
        inv_freq: Vec::new(),
        style: RopeStyle::HalfSplit,
    };
    let mut rng = Rng(seed | 1);
    let (mut ks, mut vs) = (Vec::new(), Vec::new()); // decoded [pos][kv head] vectors
    let (mut kx, mut vx) = (Vec::new(), Vec::new()); // window copies [pos][kv head]
    let (mut kt, mut vt) = (Vec::new(), Vec::new()); // vectors before encoding
    let (mut worst, mut worst_true) = (0f64, 0f64);
    let mut pos = 0;
    for &n in chunks {
        let mut data: Vec<f32> = (0..n * g.qkv_width()).map(|_| rng.next()).collect();
        // Keys with a shared offset, as real keys have (exercises large-norm codes).
        for row in data.chunks_mut(g.qkv_width()) {
            for x in &mut row[n_heads * d..(n_heads + n_kv) * d] {
                *x = *x * 2.0 + 0.5;
            }
        }
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
        b.attention(&qkv, &g, &spans, &pool, &mut out).unwrap();
        for (t, row) in data.chunks(g.qkv_width()).enumerate() {
            // What the pool encodes: the vectors minus their head's mean (16-bit pools never
            // center).
            let codec_16 = matches!(dtype, KvDtype::F16 | KvDtype::Bf16);
            let center = |x: &[f32], mu: &[f32]| -> Vec<f32> {
                if codec_16 {
                    return x.to_vec();
                }
                x.iter().zip(mu).map(|(a, m)| a - m).collect()
            };
            let k = center(&row[n_heads * d..(n_heads + n_kv) * d], &mu_k);
            let v = center(&row[(n_heads + n_kv) * d..(n_heads + 2 * n_kv) * d], &mu_v);
            let uncenter = |h: usize, x: Vec<f32>| -> Vec<f32> {
                if codec_16 {
                    return x;
                }
                x.iter().zip(&mu_v[h * d..]).map(|(a, m)| a + m).collect()
            };
            ks.push(
                (0..n_kv)
                    .map(|h| roundtrip(&codecs[h].key, &k[h * d..(h + 1) * d]))
                    .collect::<Vec<_>>(),
            );
            vs.push(
                (0..n_kv)
                    .map(|h| uncenter(h, roundtrip(&codecs[h].value, &v[h * d..(h + 1) * d])))
                    .collect::<Vec<_>>(),
            );
            let copy = match window.copies {
                WindowCopies::F16 => window_copy,
                WindowCopies::Int8 => window_copy_int8,
            };
            kx.push(
                (0..n_kv)
                    .map(|h| copy(&codecs[h].key, &k[h * d..(h + 1) * d]))
                    .collect::<Vec<_>>(),
            );
            vx.push(
                (0..n_kv)
                    .map(|h| uncenter(h, copy(&codecs[h].value, &v[h * d..(h + 1) * d])))
                    .collect::<Vec<_>>(),
            );
            if variant.exact_reference {
                kt.push(
                    (0..n_kv)
                        .map(|h| k[h * d..(h + 1) * d].to_vec())
                        .collect::<Vec<_>>(),
                );
                vt.push(
                    (0..n_kv)
                        .map(|h| uncenter(h, v[h * d..(h + 1) * d].to_vec()))
                        .collect::<Vec<_>>(),
                );
            }
            let p = pos + t;
            let key = |j: usize, h: usize| {
                if !codec_16 && window.is_exact(p, j) {
                    &kx[j][h]
                } else {
                    &ks[j][h]
                }
            };
            let val = |j: usize, h: usize| {
                if !codec_16 && window.is_exact(p, j) {
                    &vx[j][h]
                } else {
                    &vs[j][h]
                }
            };
            for h in 0..n_heads {
                let kvh = h / (n_heads / n_kv);
                let q = &row[h * d..(h + 1) * d];
                let got = &out.row(t)[h * d..(h + 1) * d];
                let error = |want: Vec<f64>| {
                    let scale = want.iter().map(|x| x.abs()).fold(1e-6, f64::max);
                    got.iter()
                        .zip(&want)
                        .map(|(a, w)| {
                            assert!(a.is_finite(), "{dtype}: non-finite output");
                            (*a as f64 - w).abs() / scale
                        })
                        .fold(0f64, f64::max)
                };
                let decoded = exact_attention(q, p, g.scale, |j| key(j, kvh), |j| val(j, kvh));
                worst = worst.max(error(decoded));
                if variant.exact_reference {
                    let exact =
                        exact_attention(q, p, g.scale, |j| &kt[j][kvh][..], |j| &vt[j][kvh][..]);
                    worst_true = worst_true.max(error(exact));
                }
            }
        }
        pos += n;
    }
    let exact = if variant.exact_reference {
        worst_true
    } else {
        f64::NAN
    };
    (worst, exact)
}

const DTYPES: [&str; 9] = [
    "f16", "bf16", "int8", "fp8", "tq4", "tq3", "tq2", "tq2.5", "k4v3",
];

#[test]
fn prefill_in_chunks_matches_decoded_reference_for_every_dtype() {
    for (i, name) in DTYPES.iter().enumerate() {
        let dtype: KvDtype = name.parse().unwrap();
        for (n_heads, n_kv, d) in [(3, 1, 64), (8, 8, 128), (8, 1, 256)] {
            let err = check(dtype, n_heads, n_kv, d, &[21, 1, 30], 100 + i as u64);
            assert!(
                err < 2e-4,
                "{name} heads {n_heads}/{n_kv} d {d}: relative error {err}"
            );
        }
    }
}

#[test]
fn long_context_split_k_decode_matches_decoded_reference() {
    for name in ["f16", "fp8", "tq3", "k4v3"] {
        let dtype: KvDtype = name.parse().unwrap();
        // 1100 prefilled tokens, then single-token steps whose context splits into chunks.
        let err = check(dtype, 6, 2, 64, &[600, 500, 1, 1, 1], 7);
        assert!(err < 2e-4, "{name}: relative error {err}");
    }
}

#[test]
fn unsupported_dtype_and_head_dim_are_refused_with_the_accepted_list() {
    let b = CpuBackend::new();
    // TurboQuant needs an even split for fractional widths; head dim 3 cannot be encoded.
    let err = b
        .check_kv_dtype("tq2.5".parse().unwrap(), 3)
        .unwrap_err()
        .to_string();
    assert!(err.contains("tq2.5") && err.contains("accepted"), "{err}");
    assert!(b.check_kv_dtype(KvDtype::F16, 3).is_ok());
}

#[test]
fn window_and_sink_tokens_are_attended_at_f16_and_the_rest_on_codes() {
    for name in ["int8", "fp8", "tq3", "k4v3", "tq2"] {
        let dtype: KvDtype = name.parse().unwrap();
        for window in [
            KvWindow {
                recent: 20,
                sinks: 1,
                ..Default::default()
            },
            KvWindow {
                recent: 0,
                sinks: 17,
                ..Default::default()
            },
            KvWindow {
                recent: 5,
                sinks: 0,
                ..Default::default()
            },
        ] {
            // Chunked prefill, then decode steps: windows slide across block edges, and
            // shadows of blocks behind the window are dropped while later steps still run.
            let err = check_windowed(dtype, window, 6, 2, 64, &[40, 30, 1, 1, 1, 1], 11);
            assert!(err < 2e-4, "{name} {window:?}: relative error {err}");
        }
    }
}

#[test]
fn a_window_covering_the_context_gives_the_output_of_its_f16_copies() {
    // Every token in the window: a tq2 pool must match its f16 copies (an f16 pool's values,
    // rounded once more in the working basis), not its own codes.
    let window = KvWindow {
        recent: 64,
        sinks: 0,
        ..Default::default()
    };
    let err = check_windowed("tq2".parse().unwrap(), window, 4, 2, 64, &[30, 20, 1], 5);
    assert!(err < 2e-4, "relative error vs the f16 copies {err}");
}

#[test]
fn int8_window_copies_match_the_reference_in_prefill_and_decode() {
    // A window and sinks that end mid-block, chunked prefill (the tiled path) and decode steps
    // (the direct kernels, whose copies are then int8 pages with a step each), over formats of
    // one run, several runs (a fractional width) and an int8 pool.
    let window = KvWindow {
        recent: 37,
        sinks: 3,
        copies: WindowCopies::Int8,
    };
    for name in ["k4v2", "tq3", "tq3.5", "int8"] {
        let dtype: KvDtype = name.parse().unwrap();
        for (n_heads, n_kv, d) in [(6, 2, 64), (8, 1, 128)] {
            let err = check_windowed(dtype, window, n_heads, n_kv, d, &[70, 60, 1, 1, 1], 31);
            assert!(
                err < 2e-4,
                "{name} heads {n_heads}/{n_kv} d {d}: relative error {err}"
            );
        }
    }
    // Centered values and prod keys read the same copies.
    let v = Variant {
        prod_keys: true,
        centered: true,
        ..Variant::default()
    };
    let err = check_with("tq3".parse().unwrap(), window, v, 6, 2, 64, &[90, 1, 1], 32).0;
    assert!(err < 2e-4, "tq3/prod centered: relative error {err}");
}

#[test]
fn int8_copies_change_a_window_covering_the_context_by_about_their_rounding() {
    // Every token in the window: the pool reads only copies. Against the f16 copies, int8
    // ones move each output row by about the int8 rounding (a step of max|x| / 127 per
    // vector); far more would mean a mis-scaled step, far less that they were not read.
    let f16_copies = KvWindow {
        recent: 64,
        sinks: 0,
        ..Default::default()
    };
    let int8_copies = KvWindow {
        copies: WindowCopies::Int8,
        ..f16_copies
    };
    let dtype: KvDtype = "tq2".parse().unwrap();
    let own = check_windowed(dtype, int8_copies, 4, 2, 64, &[30, 20, 1], 5);
    assert!(own < 2e-4, "relative error vs the int8 copies {own}");
    let d = 64;
    let codec = LayerCodec::new(dtype, d, 0, &Default::default()).unwrap();
    let mut rng = Rng(9);
    let x: Vec<f32> = (0..d).map(|_| rng.next()).collect();
    let (a, b) = (
        window_copy(&codec.key, &x),
        window_copy_int8(&codec.key, &x),
    );
    let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = a
        .iter()
        .zip(&b)
        .map(|(p, q)| (p - q).abs())
        .fold(0f32, f32::max);
    // A rotation spreads the rounding over every coordinate: ≤ √d · step / 2 in any one,
    // and a vector of uniform values cannot round to itself exactly.
    assert!(
        diff > 0.0 && diff < (d as f32).sqrt() * max / 127.0,
        "{diff}"
    );
}

#[test]
fn window_survives_split_k_decode() {
    // Context > one key chunk: the window lands in the last chunk, sinks in the first.
    let window = KvWindow {
        recent: 24,
        sinks: 2,
        ..Default::default()
    };
    let err = check_windowed(
        "tq3".parse().unwrap(),
        window,
        6,
        2,
        64,
        &[600, 500, 1, 1],
        7,
    );
    assert!(err < 2e-4, "relative error {err}");
}

#[test]
fn windowed_decode_matches_reference_for_wide_groups_and_multi_run_formats() {
    // A window and sinks that end mid-block, so a block is read partly from codes and partly
    // from copies.
    let window = KvWindow {
        recent: 37,
        sinks: 3,
        ..Default::default()
    };
    // Direct decode: groups of 8 and 9 query heads per kv head take more than one kernel
    // call of rows.
    for name in ["k4v2", "k4v3", "int8"] {
        let dtype: KvDtype = name.parse().unwrap();
        for (n_heads, n_kv, d) in [(8, 1, 128), (9, 1, 64), (18, 2, 64)] {
            let err = check_windowed(dtype, window, n_heads, n_kv, d, &[300, 1, 1, 1], 21);
            assert!(
                err < 2e-4,
                "{name} heads {n_heads}/{n_kv} d {d}: relative error {err}"
            );
        }
    }
    // The same window over formats of several runs per record: prod keys (MSE codes and QJL
    // signs) and a fractional width (two parts), each run scored and summed on its own.
    let prod = Variant {
        prod_keys: true,
        ..Variant::default()
    };
    let err = check_with(
        "tq3".parse().unwrap(),
        window,
        prod,
        9,
        1,
        64,
        &[300, 1, 1],
        22,
    )
    .0;
    assert!(err < 2e-4, "tq3/prod: relative error {err}");
    let err = check_windowed(
        "tq3.5".parse().unwrap(),
        window,
        8,
        2,
        128,
        &[300, 1, 1],
        23,
    );
    assert!(err < 2e-4, "tq3.5: relative error {err}");
}

#[test]
fn prod_keys_and_fractional_widths_match_decoded_reference() {
    // Prod keys carry sign coordinates in the working basis (twice the head dim).
    let prod = Variant {
        prod_keys: true,
        ..Variant::default()
    };
    for name in ["tq4", "tq3", "tq3.5", "k3v2"] {
        let dtype: KvDtype = name.parse().unwrap();
        for (n_heads, n_kv, d) in [(3, 1, 64), (8, 1, 128)] {
            let w = KvWindow::default();
            let err = check_with(dtype, w, prod, n_heads, n_kv, d, &[21, 1, 30], 3).0;
            assert!(err < 2e-4, "{name}/prod d {d}: relative error {err}");
        }
    }
    let err = check("tq3.5".parse().unwrap(), 8, 2, 128, &[40, 1], 4);
    assert!(err < 2e-4, "tq3.5: relative error {err}");
}

#[test]
fn centered_pools_match_the_uncentered_reference() {
    let centered = Variant {
        centered: true,
        ..Variant::default()
    };
    let windows = [
        KvWindow::default(),
        KvWindow {
            recent: 20,
            sinks: 1,
            ..Default::default()
        },
    ];
    for name in ["int8", "fp8", "tq3", "k4v3", "f16"] {
        let dtype: KvDtype = name.parse().unwrap();
        for w in windows {
            let err = check_with(dtype, w, centered, 6, 2, 64, &[40, 30, 1, 1], 9).0;
            assert!(err < 2e-4, "{name} {w:?} centered: relative error {err}");
        }
    }
    // Split-K decode: the value mean is added once after the chunks merge.
    let err = check_with(
        "tq3".parse().unwrap(),
        windows[1],
        centered,
        6,
        2,
        64,
        &[600, 500, 1],
        8,
    )
    .0;
    assert!(err < 2e-4, "split-K centered: relative error {err}");
}

/// Decode through int8 products (scores and value sums) stays close to exact attention over
/// the decoded vectors: the roundings of the query rows, the weights and the codebooks move a
/// score or a sum by well under a percent of its size (bounds in `direct`'s unit tests).
/// Random keys give near-flat attention whose output is an average that mostly cancels while
/// the roundings' errors do not; worse, where values share a large component that the centers
/// miss (the centered cases here, whose centers are random), the output is the difference of
/// two large numbers and the codebook's rounding, common to every key with the same code,
/// does not average out. So the worst coordinate over the largest of its row must stay within
/// 2.5%, or, where the codes themselves move the output further from exact attention over the
/// vectors before encoding, within a quarter of that departure (then the products add at most
/// a third of the codes' own error). In a model the change is within the run-to-run spread of
/// KL (`eval ppl --decode-last`, BENCHMARKS.md). Every table format and `int8` (whose scores
/// round only the query rows), GQA 1/3/8, head dims 64/128/256, prod keys, centering, windows
/// and split-K.
#[test]
fn int8_products_stay_close_to_the_decoded_reference() {
    let int8 = Variant {
        int8_products: true,
        exact_reference: true,
        ..Variant::default()
    };
    let cases = [
        (int8, KvWindow::default()),
        (
            Variant {
                prod_keys: true,
                ..int8
            },
            KvWindow::default(),
        ),
        (
            Variant {
                centered: true,
                ..int8
            },
            KvWindow {
                recent: 20,
                sinks: 1,
                ..Default::default()
            },
        ),
    ];
    let mut worst = 0f64;
    for (i, name) in [
        "tq4", "tq3", "tq2", "tq2.5", "tq3.5", "k4v3", "k4v2", "int8",
    ]
    .iter()
    .enumerate()
    {
        let dtype: KvDtype = name.parse().unwrap();
        for (v, window) in cases {
            let shapes: [(usize, usize, usize, &[usize]); 4] = [
                (3, 1, 64, &[21, 1, 30, 1]),
                (8, 8, 128, &[21, 1, 30, 1]),
                (8, 1, 256, &[21, 1, 30, 1]),
                (6, 2, 64, &[600, 500, 1, 1]),
            ];
            for (n_heads, n_kv, d, chunks) in shapes {
                let seed = if chunks[0] > 100 { 400 } else { 300 } + i as u64;
                let (err, codes) = check_with(dtype, window, v, n_heads, n_kv, d, chunks, seed);
                assert!(
                    err < 2.5e-2f64.max(0.25 * codes),
                    "{name} heads {n_heads}/{n_kv} d {d} keys {}: relative error {err} \
                     (against exact attention before encoding: {codes})",
                    chunks.iter().sum::<usize>()
                );
                worst = worst.max(err);
            }
        }
    }
    eprintln!("worst relative error {worst:.2e}");
}

#[test]
fn centers_of_the_wrong_shape_are_refused() {
    let b = CpuBackend::new();
    let mut layout = KvLayout::uniform(2, 2, 64, "tq3".parse().unwrap(), BLOCK, 64).unwrap();
    layout.centers = Some(Arc::new(KvCenters {
        kv_heads: 2,
        head_dim: 64,
        key: vec![0.0; 2 * 64],
        value: vec![0.0; 2 * 64],
    }));
    // One layer calibrated, two in the layout.
    assert!(b.kv_pool(&layout, 0).is_ok());
    let err = b.kv_pool(&layout, 1).unwrap_err().to_string();
    assert!(err.contains("layer 1"), "{err}");
}

#[test]
fn heads_of_other_widths_match_the_reference_in_prefill_split_decode_and_windows() {
    // A layer of tq2 whose kv heads take 3- and 4-bit keys: each head's output is attention
    // over its own dtype's codes, with the window copies, the centers and split-K decode
    // (ctx > 1024) of the layer, through the tiled prefill and the direct decode kernels.
    const HEADS: &[&str] = &["k3v2", "tq2", "tq4"];
    let window = KvWindow {
        recent: 37,
        sinks: 1,
        copies: WindowCopies::Int8,
    };
    for (seed, int8_products) in [(91, false), (92, true)] {
        let v = Variant {
            centered: true,
            int8_products,
            exact_reference: true,
            heads: Some(HEADS),
            ..Variant::default()
        };
        // 1,104 keys: 69 blocks, which the scattered block table (`i · 7 mod 69`) permutes.
        let chunks = [200, 1, 1, 900, 1, 1];
        let (err, codes) = check_with("tq2".parse().unwrap(), window, v, 9, 3, 64, &chunks, seed);
        // Int8 products round the scores by about a quarter of what the codes do (as in
        // `int8_products_stay_close_to_the_decoded_reference`).
        let bound = if int8_products {
            2.5e-2f64.max(0.25 * codes)
        } else {
            2e-4
        };
        assert!(
            err < bound,
            "int8 products {int8_products}: error {err} (codes against exact: {codes})"
        );
    }
}

#[test]
fn a_head_width_with_another_working_basis_is_refused() {
    let b = CpuBackend::new();
    let mut layout = KvLayout::uniform(1, 2, 64, "tq2".parse().unwrap(), BLOCK, 64).unwrap();
    // Set directly, past KvPolicy's check: fractional widths rotate in two parts.
    layout.layers[0].head_dtypes = vec!["tq2".parse().unwrap(), "tq2.5".parse().unwrap()];
    let Err(err) = b.kv_pool(&layout, 0) else {
        panic!("a tq2.5 head in a tq2 layer was accepted");
    };
    let err = err.to_string();
    assert!(
        err.contains("tq2.5") && err.contains("working basis"),
        "{err}"
    );
}
