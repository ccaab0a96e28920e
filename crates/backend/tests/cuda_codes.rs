//! Coded KV pools on the GPU (int8, fp8, TurboQuant-MSE; fractional widths, prod keys, 1-bit
//! codes) against the CPU backend: the encoder's codes, attention on the codes, and blocks
//! moved between the backends.
//!
//! Skips (with a message) when no GPU or driver is present.
//!
//! What must hold, and why that tolerance:
//! - **codes**: values reach the encoders as the same f32 bits, so their codes and scales are
//!   identical. Keys are roped first, and the two backends' sin/cos differ in the last bits,
//!   so a key coordinate within that distance of a codebook boundary (or an int8 / fp8
//!   rounding tie) may land one code away: ≥ 99.9% of key codes identical, every other one
//!   adjacent in value (fp8: ±0 count as one value), scales within one f16 ulp.
//! - **attention**: the GPU rounds queries, centroids and softmax weights × scales to f16
//!   (2⁻¹¹ relative) for its MMAs and sums in another order; the CPU reference
//!   (`cpu_reference`) uses f32 throughout. The kernel with int8 key products (TurboQuant keys
//!   and values, groups up to 8, the default) reads key centroids rounded to int8 instead,
//!   each within 0.5% of the largest (`int8_table`), and queries as 16-bit integers; with int8
//!   value products (2- and 3-bit values, the default) values are looked up in an int8 table of
//!   the centroids (the CPU backend's int8 value table) and weights rounded to u8 per 32-key
//!   tile and head (each within 0.5/255 of the tile's largest). Outputs of size ≈ rms(V): 1e-2
//!   absolute + 2e-2 relative (the bf16 tolerance of the 16-bit tests), and on the same bytes
//!   (a block moved between backends) the same; prefill rows on the decode kernels, whose
//!   first rows attend a few keys and so keep the tables' rounding, 2.5e-2 absolute
//!   (`FEW_KEY_ROWS_ATOL`); and windows of int8 copies, which each backend rounds itself, the
//!   same (`Q8_WINDOW_ATOL`).

use std::sync::{Arc, OnceLock};

use turbokv_backend::cpu::{CodeProducts, CpuBackend, CpuOptions, CpuTensor};
use turbokv_backend::cuda::{CudaBackend, CudaOptions, CudaTensor};
use turbokv_backend::{AttnGeometry, Backend, Error, Rope, RopeStyle, SeqSpan};
use turbokv_cache::{KvCenters, KvLayout, KvWindow, WindowCopies};
use turbokv_codec::{KeyMode, KvDtype, LayerCodec, NormMode, OutlierChannels, bitpack};

fn gpu() -> Option<&'static CudaBackend> {
    static B: OnceLock<Option<CudaBackend>> = OnceLock::new();
    B.get_or_init(|| match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e @ Error::CudaUnavailable { .. }) => {
            eprintln!("skipping CUDA tests: {e}");
            None
        }
        Err(e) => panic!("the CUDA backend failed to start: {e}"),
    })
    .as_ref()
}

/// A backend whose prefill spans over coded pools run the coded decode kernels row by row
/// (`CudaOptions::coded_prefill_tiles` off), not the tensor-core tiles.
fn gpu_rows() -> Option<&'static CudaBackend> {
    static B: OnceLock<Option<CudaBackend>> = OnceLock::new();
    second_backend(&B, || CudaOptions {
        coded_prefill_tiles: false,
        ..CudaOptions::default()
    })
}

/// A second backend with other options, kept in `cell` (none where [`gpu`] has no GPU).
fn second_backend(
    cell: &'static OnceLock<Option<CudaBackend>>,
    opts: impl FnOnce() -> CudaOptions,
) -> Option<&'static CudaBackend> {
    gpu()?;
    cell.get_or_init(|| Some(CudaBackend::with_options(0, &opts()).expect("a second CUDA backend")))
        .as_ref()
}

/// A backend whose TurboQuant pools decode on the f16 keys-as-M kernels
/// (`CudaOptions::coded_int8_keys` off) instead of the ones with int8 key products.
fn gpu_f16() -> Option<&'static CudaBackend> {
    static B: OnceLock<Option<CudaBackend>> = OnceLock::new();
    second_backend(&B, || CudaOptions {
        coded_int8_keys: false,
        ..CudaOptions::default()
    })
}

/// A backend whose 2- and 3-bit TurboQuant values are summed as f16
/// (`CudaOptions::coded_int8_values` off) where the default sums them through int8 MMAs.
fn gpu_f16_values() -> Option<&'static CudaBackend> {
    static B: OnceLock<Option<CudaBackend>> = OnceLock::new();
    second_backend(&B, || CudaOptions {
        coded_int8_values: false,
        ..CudaOptions::default()
    })
}

/// A backend whose windowed coded pools cut their exact keys into splits of four 64-key chunks
/// (`CudaOptions::exact_split_keys`), where the default's splits hold one.
fn gpu_long_exact_splits() -> Option<&'static CudaBackend> {
    static B: OnceLock<Option<CudaBackend>> = OnceLock::new();
    second_backend(&B, || CudaOptions {
        exact_split_keys: Some(256),
        ..CudaOptions::default()
    })
}

/// Backends whose windowed coded pools run their exact splits inside the coded blocks
/// (`CudaOptions::fold_exact_splits`): with the models' split counts, and with one and three
/// coded splits forced.
fn gpu_folded() -> Option<[&'static CudaBackend; 3]> {
    static CELLS: [OnceLock<Option<CudaBackend>>; 3] = [const { OnceLock::new() }; 3];
    let folded = |i: usize, coded_splits| {
        second_backend(&CELLS[i], move || CudaOptions {
            fold_exact_splits: true,
            coded_splits,
            ..CudaOptions::default()
        })
    };
    Some([folded(0, None)?, folded(1, Some(1))?, folded(2, Some(3))?])
}

/// The CPU backend in f32 on the decoded codes (`CodeProducts::F32`): attention exactly over
/// the vectors the codes decode to, on every host. Its default int8 products run only where
/// the CPU has AVX-512 VBMI and VNNI and round queries and weights on their own, so against
/// them a GPU path's error would depend on the machine the test runs on.
fn cpu_reference() -> CpuBackend {
    CpuBackend::with_options(CpuOptions {
        code_products: CodeProducts::F32,
        ..CpuOptions::default()
    })
}

struct Rng(u64);
impl Rng {
    fn f(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
    fn below(&mut self, n: usize) -> usize {
        ((self.f() + 1.0) * 0.5 * n as f32) as usize % n
    }
}

const BS: usize = 16;

/// Absolute tolerance of attention outputs (beside 2e-2 relative): outputs of size ≈ rms(V)
/// that average many keys' values (see the module docs).
const ATTN_ATOL: f32 = 1e-2;

/// The same where prefill rows run on the decode kernels with int8 products: a row attending
/// a handful of keys (a sequence's first positions) outputs nearly one key's value as it is,
/// and the int8 centroid tables' rounding (each centroid within 0.5% of the largest) is not
/// averaged away. The CPU backend's own int8 products, with the same value table, differ from
/// its f32 reference by up to 1.8e-2 on such rows of random tq3/tq4/k4v3/k4v2 caches (≤ 4
/// keys; head dims 64 and 128, values of rms 0.9 as here), and by up to 1.0e-2 from 64 keys.
const FEW_KEY_ROWS_ATOL: f32 = 2.5e-2;

/// The same for windows of int8 copies (`q8`): each backend rounds its own copies, a step
/// (max|x| / 127, about 1.2e-2 for these values) apart where they round differently, and a row
/// whose weight sits on a few window keys (a span's first positions) keeps that difference.
/// Measured on an H100 (session 45): over int8 and fp8 pools worst 1.2–1.5e-2, with session
/// 44's kernels and the ones that read copies as bytes alike, where f16 copies of the same
/// cases stay within 4.6e-4; over TurboQuant pools (rotated copies, smaller steps) 9.2e-3.
const Q8_WINDOW_ATOL: f32 = 2.5e-2;

struct Case {
    dtype: &'static str,
    d: usize,
    group: usize,
    centered: bool,
    /// Sinks and recent tokens attended at f16.
    window: KvWindow,
    /// A sliding window (Gemma 3's and gpt-oss's local layers over a coded cache).
    sliding: Option<usize>,
    /// Scores of keys from position `RISE_AT` on lifted by `RISE_LOG2` (`lift_late_scores`).
    rising_keys: bool,
    /// Each kv head's dtype (a layer with per-head formats of the layer's `dtype`), or two
    /// kv heads of `dtype`.
    heads: Option<&'static [&'static str]>,
}

impl Case {
    /// A case without a preset's window or a sliding window.
    fn plain(dtype: &'static str, d: usize, group: usize, centered: bool) -> Case {
        Case {
            dtype,
            d,
            group,
            centered,
            window: NO_WINDOW,
            sliding: None,
            rising_keys: false,
            heads: None,
        }
    }
}

/// Where `Case::rising_keys` lifts the scores (inside the 1,100-token history), and by how
/// much: the running maxima of a split that spans it leap by far more than a kernel lets
/// them lag, after a run of sums that must then be rescaled by 2^-12.
const RISE_AT: usize = 550;
const RISE_LOG2: f32 = 12.0;

/// Every query and the keys from position `RISE_AT` on get the same large component in the
/// lowest-frequency rotary pair, so those keys' scores rise by about `RISE_LOG2` (log2
/// units) over the earlier ones' while their spread among themselves stays as it was: a
/// leap in the running maxima without a peaked softmax (whose outputs would hang on the
/// few keys at the top and on the GPU's int8 rounding of their centroids). The pair turns
/// by under 0.15 rad over 1,100 positions, so the lift varies by about 1%.
fn lift_late_scores(qkv: &mut [f32], geo: &AttnGeometry, spans: &[SeqSpan]) {
    let (d, w) = (geo.head_dim, geo.qkv_width());
    // Two coordinates of γ in both: γ²·2·scale·log2(e) = RISE_LOG2.
    let gamma = (RISE_LOG2 * (d as f32).sqrt() / (2.0 * std::f32::consts::LOG2_E)).sqrt();
    for s in spans {
        for j in 0..s.n_tokens {
            let row = &mut qkv[(s.first_row + j) * w..][..w];
            let key = if s.first_pos + j >= RISE_AT {
                gamma
            } else {
                0.0
            };
            for h in 0..geo.n_heads + geo.n_kv_heads {
                let x = if h < geo.n_heads { gamma } else { key };
                row[h * d + d / 2 - 1] = x;
                row[h * d + d - 1] = x;
            }
        }
    }
}

const NO_WINDOW: KvWindow = KvWindow {
    recent: 0,
    sinks: 0,
    copies: WindowCopies::F16,
};

/// `dtype` may end in `/prod` (QJL keys), `/corrected` (corrected norms) or `/calibrated`
/// (outlier channels other than the leading ones).
fn layout(case: &Case, kv_heads: usize, r: &mut Rng) -> KvLayout {
    let (name, mode) = case.dtype.split_once('/').unwrap_or((case.dtype, ""));
    let dtype: KvDtype = name.parse().unwrap();
    let mut l = KvLayout::uniform(1, kv_heads, case.d, dtype, BS, 8192).unwrap();
    match mode {
        "prod" => l.codec.key_mode = KeyMode::Prod,
        "corrected" => l.codec.norm = NormMode::Corrected,
        // Calibrated outlier channels (what `--kv tq3.5` gets at load): every third channel,
        // then the next ones up to half, for keys; the odd channels for values.
        "calibrated" => {
            let d = case.d as u16;
            let mut keys: Vec<u16> = (0..d).filter(|c| c % 3 == 0).collect();
            keys.extend((0..d).filter(|c| c % 3 != 0).take(case.d / 2 - keys.len()));
            let values: Vec<u16> = (0..d).filter(|c| c % 2 == 1).collect();
            l.codec.key_outliers = Some(OutlierChannels::new(case.d, &keys).unwrap());
            l.codec.value_outliers = Some(OutlierChannels::new(case.d, &values).unwrap());
        }
        _ => {}
    }
    l.window = case.window;
    if let Some(heads) = case.heads {
        l.layers[0].head_dtypes = heads.iter().map(|d| d.parse().unwrap()).collect();
    }
    if case.centered {
        l.centers = Some(Arc::new(KvCenters {
            kv_heads,
            head_dim: case.d,
            key: r.vec(kv_heads * case.d, 0.8),
            value: r.vec(kv_heads * case.d, 0.5),
        }));
    }
    l
}

/// A run of codes in a token's record: byte offset, bits per code, codes; `signs` for QJL
/// sign bits, which follow the codes they are the residual of.
struct Field {
    offset: usize,
    bits: u8,
    n: usize,
    signs: bool,
}

/// The code fields of a codec's records and whether its codes rank by value as unsigned
/// numbers (TurboQuant), as int8 or as fp8.
fn fields(codec: &turbokv_codec::VectorCodec) -> Vec<Field> {
    let d = codec.head_dim();
    if let Some(p) = codec.device_parts() {
        return p
            .parts
            .iter()
            .flat_map(|p| {
                let m = p.channels.len();
                let codes = Field {
                    offset: p.code_offset,
                    bits: p.bits,
                    n: m,
                    signs: false,
                };
                let signs = p.qjl.as_ref().map(|q| Field {
                    offset: q.sign_offset,
                    bits: 1,
                    n: m,
                    signs: true,
                });
                std::iter::once(codes).chain(signs)
            })
            .collect();
    }
    vec![Field {
        offset: 0,
        bits: 8,
        n: d,
        signs: false,
    }]
}

/// Code coordinates of one (block, head) record pair: (identical, total) after asserting that
/// every differing code is adjacent and every scale within one f16 ulp. QJL sign bits are
/// counted; γ must be within one ulp where the record's codes and scales are identical (a key
/// a code away has another residual). With `exact` (values: the same input bits) all equal.
fn compare_block(
    what: &str,
    got: &[u8],
    want: &[u8],
    codec: &turbokv_codec::VectorCodec,
    exact: bool,
) -> (usize, usize) {
    let layout = codec.block_layout(BS).unwrap();
    let format = codec.device_format();
    // A code's rank in value order: int8 two's complement, fp8 sign-magnitude (±0 alike).
    let rank = |c: u8| -> i32 {
        match format {
            Some(turbokv_codec::DeviceFormat::Int8) => i32::from(c as i8),
            Some(turbokv_codec::DeviceFormat::Fp8) if c & 0x80 != 0 => -i32::from(c & 0x7f),
            _ => i32::from(c),
        }
    };
    let fields = fields(codec);
    // The scalars that are scales (the others are QJL γ).
    let scales: Vec<usize> = match codec.device_parts() {
        Some(p) => p.parts.iter().map(|p| p.scalar_index).collect(),
        None => vec![0],
    };
    let (mut same, mut total) = (0, 0);
    for slot in 0..BS {
        let (g, w) = (
            &got[layout.codes_range(slot)],
            &want[layout.codes_range(slot)],
        );
        let mut record_same = true;
        for f in &fields {
            let (mut gi, mut wi) = (vec![0u8; f.n], vec![0u8; f.n]);
            let bytes = (f.n * usize::from(f.bits)).div_ceil(8);
            let range = f.offset..f.offset + bytes;
            bitpack::unpack(&g[range.clone()], f.bits, &mut gi).unwrap();
            bitpack::unpack(&w[range], f.bits, &mut wi).unwrap();
            for (i, (&a, &b)) in gi.iter().zip(&wi).enumerate() {
                total += 1;
                if a == b {
                    same += 1;
                    continue;
                }
                if f.signs {
                    // Roped keys differ in their last bits: a sign of S·r near 0 may flip.
                    assert!(!exact, "{what}: slot {slot} sign bit {i}");
                    continue;
                }
                record_same = false;
                let (a, b) = (rank(a), rank(b));
                assert!(
                    !exact && (a - b).abs() <= 1,
                    "{what}: slot {slot} coordinate {i}: code {a} vs {b}"
                );
            }
        }
        let (gs, ws) = (
            &got[layout.scalars_range(slot)],
            &want[layout.scalars_range(slot)],
        );
        let scalar = |b: &[u8], i: usize| u16::from_le_bytes([b[2 * i], b[2 * i + 1]]);
        for i in 0..layout.scalars_per_token {
            let (gs, ws) = (scalar(gs, i), scalar(ws, i));
            if scales.contains(&i) {
                assert!(
                    gs == ws || (!exact && gs.abs_diff(ws) == 1),
                    "{what}: slot {slot} scale {gs:#06x} vs {ws:#06x}"
                );
                record_same &= gs == ws;
            } else if record_same {
                assert!(
                    gs == ws || (!exact && gs.abs_diff(ws) == 1),
                    "{what}: slot {slot} γ {gs:#06x} vs {ws:#06x}"
                );
            }
        }
    }
    (same, total)
}

/// Compares every block the step's spans touched, for every kv head, GPU against CPU
/// (`compare_block`: values equal, key codes equal but at rounding ties), and returns the
/// key codes equal and compared. Where a tie put a key a code apart, the CPU pool takes the
/// GPU's block, so that the attention checks that follow compare the kernels on the same
/// bytes: one key a code apart can move a sharp softmax's output past any tolerance that
/// still catches a wrong kernel (at 2-bit keys a code step is a third of the key's range).
fn compare_touched_blocks(
    (c, g): (&CpuBackend, &CudaBackend),
    (cpool, gpool): (
        &mut <CpuBackend as Backend>::KvPool,
        &<CudaBackend as Backend>::KvPool,
    ),
    spans: &[SeqSpan<'_>],
    codec: &LayerCodec,
    what: &str,
    step: usize,
) -> (usize, usize) {
    let mut blocks: Vec<u32> = spans
        .iter()
        .flat_map(|s| {
            (s.first_pos / BS..(s.first_pos + s.n_tokens).div_ceil(BS)).map(|b| s.blocks[b])
        })
        .collect();
    blocks.sort_unstable();
    blocks.dedup();
    let (kb, vb) = (
        codec.key.block_layout(BS).unwrap().total_bytes,
        codec.value.block_layout(BS).unwrap().total_bytes,
    );
    let (mut same, mut total, mut synced) = (0, 0, 0);
    let (mut gb, mut cb) = (Vec::new(), Vec::new());
    for &b in &blocks {
        g.read_kv_block(gpool, b, &mut gb).unwrap();
        c.read_kv_block(cpool, b, &mut cb).unwrap();
        assert_eq!(gb.len(), cb.len(), "{what}: block bytes");
        let mut block_same = true;
        for (h, (gh, ch)) in gb
            .chunks_exact(kb + vb)
            .zip(cb.chunks_exact(kb + vb))
            .enumerate()
        {
            let at = format!("{what} step {step} block {b} head {h}");
            let (s, t) = compare_block(&format!("{at} K"), &gh[..kb], &ch[..kb], &codec.key, false);
            same += s;
            total += t;
            block_same &= gh[..kb] == ch[..kb];
            compare_block(&format!("{at} V"), &gh[kb..], &ch[kb..], &codec.value, true);
        }
        if !block_same {
            c.write_kv_block(cpool, b, &gb).unwrap();
            synced += 1;
        }
    }
    if synced > 0 {
        eprintln!(
            "{what} step {step}: {} of {total} key codes at a tie; the CPU attends over the \
             GPU's copy of those {synced} blocks",
            total - same
        );
    }
    (same, total)
}

fn close(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = 0f32;
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        let err = (a - b).abs();
        assert!(
            err <= atol + rtol * b.abs(),
            "{what}: element {i}: got {a}, want {b}"
        );
        worst = worst.max(err);
    }
    worst
}

fn host(g: &CudaBackend, t: &CudaTensor) -> Vec<f32> {
    let mut v = Vec::new();
    g.to_host(t, &mut v).unwrap();
    v
}

/// The attention shape of `kv_heads` heads of `group` queries each at head dim `d`, and its
/// RoPE (half-split, base 10000).
fn geometry(kv_heads: usize, group: usize, d: usize) -> (AttnGeometry, Rope) {
    let geo = AttnGeometry {
        n_heads: kv_heads * group,
        n_kv_heads: kv_heads,
        head_dim: d,
        scale: 1.0 / (d as f32).sqrt(),
    };
    let rope = Rope {
        inv_freq: (0..d / 2)
            .map(|i| 10000f32.powf(-(2.0 * i as f32) / d as f32))
            .collect(),
        style: RopeStyle::HalfSplit,
    };
    (geo, rope)
}

/// Three steps over four sequences (prefill of histories up to 1100 tokens, a mixed step,
/// a decode step), each: write on both backends, compare the pools' blocks (the CPU taking
/// the GPU's where keys sit a code apart at a tie), attend on both and compare; after the
/// last step, the GPU's blocks imported into a fresh CPU pool and the CPU's into a fresh GPU
/// pool attend like the originals.
fn run_case(g: &CudaBackend, case: &Case, seed: u64) -> (usize, usize) {
    run_case_within(g, case, seed, ATTN_ATOL)
}

/// [`run_case`] with `atol` for the attention outputs in place of [`ATTN_ATOL`].
fn run_case_within(g: &CudaBackend, case: &Case, seed: u64, atol: f32) -> (usize, usize) {
    let c = cpu_reference();
    let mut r = Rng(seed);
    let kv_heads = case.heads.map_or(2, |h| h.len());
    let (geo, rope) = geometry(kv_heads, case.group, case.d);
    let layout = layout(case, kv_heads, &mut r);
    let codec =
        LayerCodec::new(layout.layers[0].dtype, case.d, 0, &layout.codec_options(0)).unwrap();
    let (mut cpool, mut gpool) = (
        c.kv_pool(&layout, 0).unwrap(),
        g.kv_pool(&layout, 0).unwrap(),
    );
    let mut perm: Vec<u32> = (0..layout.num_blocks as u32).collect();
    for i in (1..perm.len()).rev() {
        perm.swap(i, r.below(i + 1));
    }
    let tables: Vec<&[u32]> = perm.chunks(layout.num_blocks / 4).take(4).collect();
    let seqs = [(1100usize, 1usize), (37, 1), (20, 5), (0, 19)];
    let (mut same, mut total) = (0, 0);
    let windowed = case.window.is_active();
    // Block I/O is refused for windowed pools (their exact copies are not in the blocks) and
    // for per-head formats: only the attention is compared.
    let attention_only = windowed || case.heads.is_some();
    let what = format!(
        "{}{} d={} group {}{}{}{}",
        case.dtype,
        case.heads
            .map_or(String::new(), |h| format!(" heads {h:?}")),
        case.d,
        case.group,
        if case.centered { " centered" } else { "" },
        if windowed {
            format!(" window {}+{}", case.window.recent, case.window.sinks)
        } else {
            String::new()
        },
        case.sliding
            .map_or(String::new(), |w| format!(" sliding {w}"))
    );
    // A windowed pool decodes on until every window has crossed a block boundary.
    let steps = if windowed { 3 + 24 } else { 3 };
    for step in 0..steps {
        let mut spans = Vec::new();
        let mut row = 0;
        for (i, &(hist, new)) in seqs.iter().enumerate() {
            let (first_pos, n) = match step {
                0 => (0, hist),
                1 => (hist, new),
                _ => (hist + new + step - 2, 1),
            };
            if n > 0 {
                spans.push(SeqSpan {
                    first_row: row,
                    n_tokens: n,
                    first_pos,
                    blocks: tables[i],
                });
                row += n;
            }
        }
        let w = geo.qkv_width();
        let mut qkv = r.vec(row * w, 1.5);
        if case.rising_keys {
            lift_late_scores(&mut qkv, &geo, &spans);
        }
        let (cq, gq) = write_both(
            (&c, g),
            &qkv,
            row,
            (&geo, &rope),
            &spans,
            (&mut cpool, &mut gpool),
        );
        if !attention_only {
            let (s, t) =
                compare_touched_blocks((&c, g), (&mut cpool, &gpool), &spans, &codec, &what, step);
            same += s;
            total += t;
        }
        let cols = geo.n_heads * case.d;
        // gpt-oss's attention sinks (a logit per query head in each softmax's denominator),
        // of the size of the scores, on every other step.
        let sinks = (step % 2 == 1).then(|| {
            (0..geo.n_heads)
                .map(|_| 1.0 + 2.0 * r.f())
                .collect::<Vec<f32>>()
        });
        // Windowed and per-head pools: only the attention; plain pools: with sinks or a
        // sliding window here, plain below beside the blocks.
        if attention_only || sinks.is_some() || case.sliding.is_some() {
            let e = compare_attention(
                g,
                &c,
                &cq,
                &gq,
                &geo,
                &spans,
                (&cpool, &gpool),
                (case.sliding, sinks.as_deref()),
                &what,
                step,
                atol,
            );
            if !attention_only {
                eprintln!("{what} step {step}: attention with sinks max err {e:.2e}");
            } else {
                if step % 8 == 0 {
                    eprintln!("{what} step {step}: attention max err {e:.2e}");
                }
                continue;
            }
        }
        let mut co = c.tensor(row, cols).unwrap();
        c.attention(&cq, &geo, &spans, &cpool, &mut co).unwrap();
        let mut go = g
            .tensor_from_host(&vec![f32::NAN; row * cols], row, cols)
            .unwrap();
        g.attention(&gq, &geo, &spans, &gpool, &mut go).unwrap();
        // Both backends over the same key bytes (compare_touched_blocks gave the CPU the GPU's
        // blocks where a tie or a QJL sign set them apart).
        let e = close(
            &format!("{what} step {step} attention"),
            &host(g, &go),
            co.as_slice(),
            atol,
            2e-2,
        );
        eprintln!("{what} step {step}: attention max err {e:.2e}");
        if step == 2 {
            // Blocks across the backends: the GPU's bytes on the CPU, the CPU's on the GPU.
            let (mut cpool2, mut gpool2) = (
                c.kv_pool(&layout, 0).unwrap(),
                g.kv_pool(&layout, 0).unwrap(),
            );
            let mut bytes = Vec::new();
            for b in 0..layout.num_blocks as u32 {
                g.read_kv_block(&gpool, b, &mut bytes).unwrap();
                c.write_kv_block(&mut cpool2, b, &bytes).unwrap();
                c.read_kv_block(&cpool, b, &mut bytes).unwrap();
                g.write_kv_block(&mut gpool2, b, &bytes).unwrap();
            }
            let mut co2 = c.tensor(row, cols).unwrap();
            c.attention(&cq, &geo, &spans, &cpool2, &mut co2).unwrap();
            let mut go2 = g
                .tensor_from_host(&vec![f32::NAN; row * cols], row, cols)
                .unwrap();
            g.attention(&gq, &geo, &spans, &gpool2, &mut go2).unwrap();
            close(
                &format!("{what}: GPU blocks on the CPU"),
                co2.as_slice(),
                &host(g, &go),
                atol,
                2e-2,
            );
            close(
                &format!("{what}: CPU blocks on the GPU"),
                &host(g, &go2),
                co.as_slice(),
                atol,
                2e-2,
            );
        }
    }
    if windowed {
        // Sequence 1 ends and a new one takes its blocks: its exact copies start afresh.
        use turbokv_backend::KvPoolBlocks;
        cpool.release_blocks(tables[1]);
        gpool.release_blocks(tables[1]);
        let spans = [SeqSpan {
            first_row: 0,
            n_tokens: 40,
            first_pos: 0,
            blocks: tables[1],
        }];
        let w = geo.qkv_width();
        let qkv = r.vec(40 * w, 1.5);
        let (cq, gq) = write_both(
            (&c, g),
            &qkv,
            40,
            (&geo, &rope),
            &spans,
            (&mut cpool, &mut gpool),
        );
        compare_attention(
            g,
            &c,
            &cq,
            &gq,
            &geo,
            &spans,
            (&cpool, &gpool),
            (case.sliding, None),
            &what,
            steps,
            atol,
        );
        // The other three sequences' sink and window blocks (a window may straddle a block
        // more), and this one's 40 tokens: the released sequence's blocks were reused.
        let (sinks, recent) = (case.window.sinks, case.window.recent);
        let per_seq = sinks.div_ceil(BS) + recent.div_ceil(BS) + 2;
        let held = gpool.exact_blocks_used().unwrap();
        assert!(
            held <= 3 * per_seq + 40usize.div_ceil(BS) + 1,
            "{what}: {held} exact blocks held"
        );
    }
    (same, total)
}

/// The same q/k/v rows (`rows` × the geometry's qkv width) through both backends' `write_kv`:
/// roped and encoded into their pools; returns the two tensors the attention reads.
fn write_both(
    (c, g): (&CpuBackend, &CudaBackend),
    qkv: &[f32],
    rows: usize,
    (geo, rope): (&AttnGeometry, &Rope),
    spans: &[SeqSpan<'_>],
    (cpool, gpool): (
        &mut <CpuBackend as Backend>::KvPool,
        &mut <CudaBackend as Backend>::KvPool,
    ),
) -> (CpuTensor, CudaTensor) {
    let w = geo.qkv_width();
    let mut cq = CpuTensor::from_vec(qkv.to_vec(), rows, w).unwrap();
    let mut gq = g.tensor_from_host(qkv, rows, w).unwrap();
    c.write_kv(&mut cq, geo, rope, None, spans, cpool).unwrap();
    g.write_kv(&mut gq, geo, rope, None, spans, gpool).unwrap();
    (cq, gq)
}

/// Attention of both backends over their pools (`(cpu, gpu)`), with a sliding `window` and
/// `sinks` when some, compared; the largest error.
#[allow(clippy::too_many_arguments)]
fn compare_attention(
    g: &CudaBackend,
    c: &CpuBackend,
    cq: &CpuTensor,
    gq: &CudaTensor,
    geo: &AttnGeometry,
    spans: &[SeqSpan<'_>],
    (cpool, gpool): (
        &<CpuBackend as Backend>::KvPool,
        &<CudaBackend as Backend>::KvPool,
    ),
    (window, sinks): (Option<usize>, Option<&[f32]>),
    what: &str,
    step: usize,
    atol: f32,
) -> f32 {
    let rows: usize = spans.iter().map(|s| s.n_tokens).sum();
    let cols = geo.n_heads * geo.head_dim;
    let mut co = c.tensor(rows, cols).unwrap();
    let (cs, gs) = match sinks {
        Some(s) => (Some(c.vector(s).unwrap()), Some(g.vector(s).unwrap())),
        None => (None, None),
    };
    let variant = turbokv_backend::AttnVariant {
        window,
        sinks: cs.as_ref(),
    };
    c.attention_variant(cq, geo, spans, cpool, &variant, &mut co)
        .unwrap();
    let mut go = g
        .tensor_from_host(&vec![f32::NAN; rows * cols], rows, cols)
        .unwrap();
    let variant = turbokv_backend::AttnVariant {
        window,
        sinks: gs.as_ref(),
    };
    g.attention_variant(gq, geo, spans, gpool, &variant, &mut go)
        .unwrap();
    close(
        &format!(
            "{what} step {step} attention{}",
            if sinks.is_some() { " with sinks" } else { "" }
        ),
        &host(g, &go),
        co.as_slice(),
        atol,
        2e-2,
    )
}

#[test]
fn coded_pools_match_the_cpu_codec_and_attention() {
    let Some(g) = gpu() else { return };
    let (mut same, mut total) = (0, 0);
    let mut seed = 7;
    for d in [64, 128, 256] {
        for dtype in [
            "int8",
            "fp8",
            "tq4",
            "tq3",
            "tq2",
            "k4v3",
            "k4v2",
            "k3v2",
            "k2v4",
            // Corrected norms: only the write kernel's scale differs.
            "tq3/corrected",
            "k4v2/corrected",
            "tq2/corrected",
        ] {
            // Groups up to 8 take the keys-as-M kernels, 16 the template's (head_dim 256
            // has only the former).
            let groups: &[(usize, bool)] = if d == 256 {
                &[(1, true), (4, false), (8, true)]
            } else {
                &[(1, false), (4, true), (8, false), (16, true)]
            };
            for &(group, centered) in groups {
                seed += 1;
                let (s, t) = run_case(g, &Case::plain(dtype, d, group, centered), seed);
                same += s;
                total += t;
            }
        }
    }
    let frac = same as f64 / total as f64;
    eprintln!("key codes identical: {same} / {total} ({:.5})", frac);
    assert!(
        frac >= 0.999,
        "only {frac} of key codes equal the CPU codec's"
    );
}

/// Fractional widths (with corrected norms too), prod keys and 1-bit codes (the parts kernels: prefill
/// dequantized for the tile kernel at head_dim 64 and 128, decode on the codes) at head_dim 64
/// and 128 with GQA 1/4/8/16 and at 256 with GQA 1/4/8, centered or not, with a preset's window
/// and with a sliding window.
#[test]
fn parts_pools_match_the_cpu_codec_and_attention() {
    let Some(g) = gpu() else { return };
    let (mut same, mut total) = (0, 0);
    let mut seed = 901;
    for d in [64, 128] {
        for dtype in [
            "tq3.5",
            "tq2.5",
            "k3.5v2",
            "tq1.5",
            "tq1",
            "tq3/prod",
            "k4v2/prod",
            "tq3.5/prod",
            "tq3.5/corrected",
            "tq2.5/calibrated",
        ] {
            for (group, centered) in [(1, false), (2, true), (4, true), (8, false), (16, true)] {
                seed += 1;
                let (s, t) = run_case(g, &Case::plain(dtype, d, group, centered), seed);
                same += s;
                total += t;
            }
        }
        for (dtype, window, sliding) in [
            (
                "tq3.5",
                KvWindow {
                    recent: 32,
                    sinks: 1,
                    ..Default::default()
                },
                None,
            ),
            (
                "tq2.5/prod",
                KvWindow {
                    recent: 15,
                    sinks: 1,
                    ..Default::default()
                },
                None,
            ),
            ("k3.5v2", NO_WINDOW, Some(100)),
            (
                "tq3.5",
                KvWindow {
                    recent: 47,
                    sinks: 1,
                    copies: WindowCopies::Int8,
                },
                Some(300),
            ),
        ] {
            seed += 1;
            run_case(
                g,
                &Case {
                    window,
                    sliding,
                    ..Case::plain(dtype, d, 4, false)
                },
                seed,
            );
        }
    }
    // head_dim 256 (Gemma 3): every row on the decode kernel, groups 1, 2, 4 and 8.
    for dtype in ["tq3.5", "k2.5v3", "tq3/prod"] {
        for (group, centered) in [(1, true), (2, false), (4, false), (8, true)] {
            seed += 1;
            let (s, t) = run_case(g, &Case::plain(dtype, 256, group, centered), seed);
            same += s;
            total += t;
        }
    }
    seed += 1;
    run_case(
        g,
        &Case {
            dtype: "tq2.5",
            d: 256,
            group: 4,
            centered: false,
            window: KvWindow {
                recent: 32,
                sinks: 1,
                ..Default::default()
            },
            sliding: Some(200),
            rising_keys: false,
            heads: None,
        },
        seed,
    );
    let frac = same as f64 / total as f64;
    eprintln!("parts key codes identical: {same} / {total} ({frac:.5})");
    assert!(
        frac >= 0.999,
        "only {frac} of key codes equal the CPU codec's"
    );
}

#[test]
fn the_f16_keys_as_m_kernels_match_the_cpu_backend() {
    let Some(g) = gpu_f16() else { return };
    let mut seed = 61;
    for d in [64, 128] {
        for dtype in ["tq4", "tq3", "tq2", "k4v3", "k3v2", "k2v4"] {
            for (group, centered) in [(1, true), (4, false), (8, true)] {
                seed += 1;
                run_case(g, &Case::plain(dtype, d, group, centered), seed);
            }
        }
    }
}

/// Plain pools of every width pair the kernels with int8 value products serve, GQA 1/4/8,
/// centered or not, and a preset's exact window beside the codes.
fn value_sums_match_the_cpu_backend(g: &CudaBackend, mut seed: u64) {
    for d in [64, 128] {
        for dtype in ["tq3", "tq2", "k4v3", "k4v2", "k3v2", "k2v3"] {
            for (group, centered) in [(1, true), (4, false), (8, true)] {
                seed += 1;
                run_case(g, &Case::plain(dtype, d, group, centered), seed);
            }
        }
        for (dtype, recent) in [("k4v2", 40), ("k4v3", 130)] {
            seed += 1;
            run_case(
                g,
                &Case {
                    dtype,
                    d,
                    group: 4,
                    centered: false,
                    window: KvWindow {
                        recent,
                        sinks: 1,
                        ..Default::default()
                    },
                    sliding: None,
                    rising_keys: false,
                    heads: None,
                },
                seed,
            );
        }
    }
}

/// The default kernels' int8 value products: the CPU backend's int8 value table (the same
/// centroids as its own value sums where it has int8 products) and weights rounded to u8 per
/// 32-key tile and head, each within 0.5/255 of the tile's largest; the same tolerance as the
/// f16 value sums.
#[test]
fn int8_value_sums_match_the_cpu_backend() {
    let Some(g) = gpu() else { return };
    value_sums_match_the_cpu_backend(g, 201);
}

/// The same cases (the same seeds, so the same codes) with the f16 value sums. Keys are roped
/// on each backend and may land a code apart at a boundary (see the module docs); with few keys
/// in a softmax, one such key moves an output by more than the tolerance, which the seeds of
/// these cases do not hit.
#[test]
fn f16_value_sums_match_the_cpu_backend() {
    let Some(g) = gpu_f16_values() else { return };
    value_sums_match_the_cpu_backend(g, 201);
}

/// Scores that leap past the running maxima mid-context (`lift_late_scores`) on the
/// keys-as-M kernels: the lazily moved maxima rescale what was summed before, for f16 and
/// int8 value sums, 8-, 4- and 3-bit keys, groups 1 to 8 and head dims 64 to 256.
#[test]
fn rising_scores_rescale_the_sums_as_the_cpu_backend() {
    let Some(g) = gpu() else { return };
    let mut seed = 900;
    for (dtype, d, group) in [
        ("int8", 128, 4),
        ("tq4", 128, 8),
        ("tq3", 128, 4),
        ("k4v2", 64, 1),
        ("k4v3", 256, 8),
    ] {
        seed += 1;
        run_case(
            g,
            &Case {
                rising_keys: true,
                ..Case::plain(dtype, d, group, false)
            },
            seed,
        );
    }
}

/// Value scales are norms, so no encoder writes a negative one, but a block from outside (a
/// corrupt or hand-made snapshot) may hold some. The int8 value sums round weights × scales
/// to u8, where a negative one would wrap: a 32-key tile holding one takes the f16 sums, as
/// the CPU backend's spans take its f32 pass. Blocks written on the CPU, some value scales
/// negated, imported into both backends: the attention of the next token matches.
#[test]
fn negative_value_scales_match_the_cpu_backend() {
    let Some(g) = gpu() else { return };
    let c = cpu_reference();
    let mut r = Rng(401);
    for (dtype, d, group) in [("tq3", 128, 4), ("k4v2", 64, 8), ("k3v2", 128, 1)] {
        let kv_heads = 2;
        let (geo, rope) = geometry(kv_heads, group, d);
        let case = Case::plain(dtype, d, group, false);
        let layout = layout(&case, kv_heads, &mut r);
        let codec =
            LayerCodec::new(layout.layers[0].dtype, d, 0, &layout.codec_options(0)).unwrap();
        let (kb, v_layout) = (
            codec.key.block_layout(BS).unwrap().total_bytes,
            codec.value.block_layout(BS).unwrap(),
        );
        let (mut cpool, mut gpool) = (
            c.kv_pool(&layout, 0).unwrap(),
            g.kv_pool(&layout, 0).unwrap(),
        );
        let hist: usize = 300;
        let table: Vec<u32> = (0..(hist + 1).div_ceil(BS) as u32).collect();
        let w = geo.qkv_width();
        let span = |first_pos, n_tokens| SeqSpan {
            first_row: 0,
            n_tokens,
            first_pos,
            blocks: &table,
        };
        let mut cq = CpuTensor::from_vec(r.vec(hist * w, 1.5), hist, w).unwrap();
        c.write_kv(&mut cq, &geo, &rope, None, &[span(0, hist)], &mut cpool)
            .unwrap();
        // Tokens 64..160 (three to four 32-key tiles), every fifth: the value scale negated.
        let mut bytes = Vec::new();
        let mut negated = 0;
        for &b in &table {
            c.read_kv_block(&cpool, b, &mut bytes).unwrap();
            for head in bytes.chunks_exact_mut(kb + v_layout.total_bytes) {
                for slot in 0..BS {
                    let t = b as usize * BS + slot;
                    if (64..160).contains(&t) && t % 5 == 2 {
                        let at = kb + v_layout.scalars_range(slot).start;
                        head[at + 1] ^= 0x80;
                        negated += 1;
                    }
                }
            }
            c.write_kv_block(&mut cpool, b, &bytes).unwrap();
            g.write_kv_block(&mut gpool, b, &bytes).unwrap();
        }
        assert!(negated > 0);
        let qkv = r.vec(w, 1.5);
        let spans = [span(hist, 1)];
        let (cq, gq) = write_both(
            (&c, g),
            &qkv,
            1,
            (&geo, &rope),
            &spans,
            (&mut cpool, &mut gpool),
        );
        let e = compare_attention(
            g,
            &c,
            &cq,
            &gq,
            &geo,
            &spans,
            (&cpool, &gpool),
            (None, None),
            &format!("{dtype} d={d} group {group} negated value scales"),
            0,
            ATTN_ATOL,
        );
        eprintln!("{dtype} d={d} group {group}: negated value scales, max err {e:.2e}");
    }
}

#[test]
fn windowed_coded_pools_match_the_cpu_backend() {
    // Every case on the default exact splits (one 64-key chunk each) and on splits of four.
    let (Some(g), Some(long_splits)) = (gpu(), gpu_long_exact_splits()) else {
        return;
    };
    let mut seed = 101;
    let windows = [
        KvWindow {
            recent: 15,
            sinks: 1,
            ..Default::default()
        },
        KvWindow {
            recent: 47,
            sinks: 1,
            ..Default::default()
        },
        KvWindow {
            recent: 0,
            sinks: 4,
            ..Default::default()
        },
        KvWindow {
            recent: 40,
            sinks: 0,
            ..Default::default()
        },
        // More exact keys than one exact split holds (64): three splits, the last partial.
        KvWindow {
            recent: 130,
            sinks: 1,
            ..Default::default()
        },
        // Int8 copies (`q8`), read as bytes.
        KvWindow {
            recent: 47,
            sinks: 2,
            copies: WindowCopies::Int8,
        },
        KvWindow {
            recent: 130,
            sinks: 1,
            copies: WindowCopies::Int8,
        },
        // Several exact splits of one chunk, or one of four and one partial.
        KvWindow {
            recent: 300,
            sinks: 2,
            ..Default::default()
        },
        KvWindow {
            recent: 300,
            sinks: 1,
            copies: WindowCopies::Int8,
        },
    ];
    for d in [64, 128, 256] {
        for (i, dtype) in ["int8", "tq3", "k4v2", "k4v3", "fp8"]
            .into_iter()
            .enumerate()
        {
            // Groups 4 and 8 take the keys-as-M kernels, 16 the template's.
            for (j, (group, centered)) in
                [(4, true), (16, false), (8, false)].into_iter().enumerate()
            {
                if d == 256 && group > 8 {
                    continue;
                }
                let case = Case {
                    window: windows[(i + j + d / 64) % windows.len()],
                    ..Case::plain(dtype, d, group, centered)
                };
                let atol = match case.window.copies {
                    WindowCopies::Int8 => Q8_WINDOW_ATOL,
                    WindowCopies::F16 => ATTN_ATOL,
                };
                for backend in [g, long_splits] {
                    seed += 1;
                    run_case_within(backend, &case, seed, atol);
                }
            }
        }
    }
}

/// Exact splits folded into the coded blocks: with the models' split counts, and with one and
/// three coded splits forced, where one block runs several exact splits (a 130-token window
/// has three) or none. Every kernel family that reads a window: keys-as-M with int8 and f16
/// products, the template (int8, fp8; group 16), and the parts kernel (fractional widths, prod
/// keys), with sliding windows beside the exact tokens.
#[test]
fn folded_exact_splits_match_the_cpu_backend() {
    let Some(backends) = gpu_folded() else {
        return;
    };
    let mut seed = 1501;
    let window = |recent, sinks| KvWindow {
        recent,
        sinks,
        ..Default::default()
    };
    let q8 = |recent, sinks| KvWindow {
        copies: WindowCopies::Int8,
        ..window(recent, sinks)
    };
    let cases = [
        ("tq3", 128, 4, true, window(15, 1), None),
        ("k4v2", 128, 8, false, window(130, 1), None),
        ("k4v3", 64, 4, false, window(47, 4), Some(300)),
        ("int8", 128, 16, false, window(130, 2), None),
        ("fp8", 64, 4, true, window(40, 0), None),
        ("tq3.5", 128, 4, false, window(130, 1), Some(200)),
        ("tq3/prod", 64, 2, true, window(15, 1), None),
        ("k4v2", 256, 4, true, window(0, 4), None),
        ("k4v2", 128, 8, true, q8(130, 1), None),
        ("tq2.5", 64, 4, false, q8(47, 2), None),
    ];
    for g in backends {
        for (dtype, d, group, centered, window, sliding) in cases {
            seed += 1;
            run_case(
                g,
                &Case {
                    window,
                    sliding,
                    ..Case::plain(dtype, d, group, centered)
                },
                seed,
            );
        }
    }
}

/// Sliding windows over coded pools (the local layers of Gemma 3 and gpt-oss when a context
/// is too short for rings), alone and beside a preset's exact sinks and recent tokens: keys
/// before each row's window are masked in the coded splits and in the exact ones. Windows of
/// 37 keys (inside one split, not on a 16-key run boundary), 300 and one wider than every
/// sequence (the plain result).
#[test]
fn sliding_windows_over_coded_pools_match_the_cpu_backend() {
    let Some(g) = gpu() else { return };
    let mut seed = 301;
    let exact = [
        NO_WINDOW,
        KvWindow {
            recent: 15,
            sinks: 1,
            ..Default::default()
        },
        KvWindow {
            recent: 47,
            sinks: 4,
            ..Default::default()
        },
        KvWindow {
            recent: 200,
            sinks: 2,
            ..Default::default()
        },
    ];
    for d in [64, 128, 256] {
        for (i, dtype) in ["int8", "tq3", "k4v2"].into_iter().enumerate() {
            for (j, sliding) in [37usize, 300, 1 << 20].into_iter().enumerate() {
                // Keys-as-M (4), the template (16; not at head_dim 256), keys-as-M (2).
                let group = match (i + j) % 3 {
                    0 => 4,
                    1 if d < 256 => 16,
                    _ => 2,
                };
                seed += 1;
                run_case(
                    g,
                    &Case {
                        window: exact[(i + 2 * j) % exact.len()],
                        sliding: Some(sliding),
                        ..Case::plain(dtype, d, group, (i + j) % 2 == 0)
                    },
                    seed,
                );
            }
        }
    }
}

/// The prefill spans of the cases above (1,100, 37 and 20 tokens, then 19 beside a 5-token
/// continuation and decode rows) run through tensor cores over dequantized codes by default;
/// here the same on the decode kernels, row by row, for a few formats and windows, within
/// [`FEW_KEY_ROWS_ATOL`]: every span's first rows attend only a few keys.
#[test]
fn coded_prefill_on_the_decode_kernels_matches_the_cpu_backend() {
    let Some(g) = gpu_rows() else { return };
    let mut seed = 501;
    for d in [64, 128] {
        for (dtype, group, window, sliding) in [
            ("tq3", 4, NO_WINDOW, None),
            (
                "k4v2",
                8,
                KvWindow {
                    recent: 130,
                    sinks: 1,
                    ..Default::default()
                },
                None,
            ),
            (
                "int8",
                16,
                KvWindow {
                    recent: 15,
                    sinks: 1,
                    ..Default::default()
                },
                Some(300),
            ),
            (
                "k4v3",
                4,
                KvWindow {
                    recent: 40,
                    sinks: 2,
                    copies: WindowCopies::Int8,
                },
                None,
            ),
        ] {
            seed += 1;
            run_case_within(
                g,
                &Case {
                    window,
                    sliding,
                    ..Case::plain(dtype, d, group, true)
                },
                seed,
                FEW_KEY_ROWS_ATOL,
            );
        }
    }
}

/// Groups that do not divide the tile kernel's 64 query vectors (the demo model's 3 query
/// heads per kv head, and 6) take the tensor-core prefill too, the last vectors of each tile
/// idle.
#[test]
fn coded_prefill_tiles_take_groups_that_do_not_divide_64() {
    let Some(g) = gpu() else { return };
    for (seed, (dtype, d, group, window)) in [
        (
            "tq3",
            64,
            3,
            KvWindow {
                recent: 15,
                sinks: 1,
                ..Default::default()
            },
        ),
        ("k4v2", 128, 6, NO_WINDOW),
        (
            "int8",
            64,
            5,
            KvWindow {
                recent: 130,
                sinks: 1,
                ..Default::default()
            },
        ),
    ]
    .into_iter()
    .enumerate()
    {
        run_case(
            g,
            &Case {
                window,
                ..Case::plain(dtype, d, group, seed % 2 == 0)
            },
            601 + seed as u64,
        );
    }
}

/// Layers with per-head formats (tiny's kind: 3-bit keys on a few kv heads of a 2-bit layer):
/// each group of heads is its own launch of its format's kernels over the shared pool, whose
/// (block, head) slots are as wide as the widest format's; one write launch encodes each head
/// with its group's codebooks. Groups whose heads are not consecutive, centered or not, with a
/// window of int8 or f16 copies, head_dim 64/128/256, on every coded kernel family.
#[test]
fn per_head_formats_match_the_cpu_backend() {
    let (Some(g), Some(rows), Some(f16_keys), Some(f16_values), Some(folded)) =
        (gpu(), gpu_rows(), gpu_f16(), gpu_f16_values(), gpu_folded())
    else {
        return;
    };
    let mut seed = 901;
    let tiny_window = KvWindow {
        recent: 30,
        sinks: 1,
        copies: WindowCopies::Int8,
    };
    let f16_window = KvWindow {
        recent: 130,
        sinks: 1,
        ..Default::default()
    };
    // Groups of 1-8 query heads take the keys-as-M kernels (int8 key products; int8 value
    // sums for 2- and 3-bit values, f16 ones for 4-bit values), 16 the template's.
    let cases: [(&[&str], usize, KvWindow); 5] = [
        (&["tq2", "k3v2", "tq2", "k3v2"], 4, NO_WINDOW),
        (&["k3v2", "tq2", "tq2"], 3, tiny_window),
        (&["tq3", "tq2", "k4v2", "tq2"], 1, NO_WINDOW),
        (&["tq2", "tq2", "k2v4", "k3v2"], 8, f16_window),
        (&["tq2", "k3v2"], 16, tiny_window),
    ];
    for d in [64, 128, 256] {
        for (i, &(heads, group, window)) in cases.iter().enumerate() {
            if d == 256 && group > 8 {
                continue;
            }
            let case = Case {
                window,
                heads: Some(heads),
                ..Case::plain("tq2", d, group, i % 2 == 0)
            };
            let atol = match window.copies {
                WindowCopies::Int8 => Q8_WINDOW_ATOL,
                WindowCopies::F16 => ATTN_ATOL,
            };
            // The default kernels and the tensor-core prefill, the prefill on the decode
            // kernels, f16 key products, f16 value sums, and windows folded into the coded
            // blocks (the default split count, one and three coded splits forced).
            let extra: &[&CudaBackend] = if d == 128 {
                &[f16_keys, f16_values, folded[0], folded[1], folded[2]]
            } else {
                &[]
            };
            for &backend in [g, rows].iter().chain(extra) {
                seed += 1;
                // Prefill rows on the decode kernels: a sequence's first rows attend a few
                // keys (see FEW_KEY_ROWS_ATOL).
                let atol = if std::ptr::eq(backend, rows) {
                    atol.max(FEW_KEY_ROWS_ATOL)
                } else {
                    atol
                };
                run_case_within(backend, &case, seed, atol);
            }
        }
    }
    // Block I/O has no format for such a layer, on either backend.
    let layout = layout(
        &Case {
            heads: Some(&["tq2", "k3v2"]),
            ..Case::plain("tq2", 64, 4, false)
        },
        2,
        &mut Rng(3),
    );
    let pool = g.kv_pool(&layout, 0).unwrap();
    let err = g
        .read_kv_block(&pool, 0, &mut Vec::new())
        .err()
        .map(|e| e.to_string());
    assert!(
        err.as_deref().is_some_and(|e| e.contains("per-head")),
        "read_kv_block: {err:?}"
    );
}

#[test]
fn unsupported_coded_pools_are_refused() {
    let Some(g) = gpu() else { return };
    let refused = |l: KvLayout, why: &str| match g.kv_pool(&l, 0) {
        Err(Error::UnsupportedKvDtype { .. }) => {}
        other => panic!("{why}: {other:?}"),
    };
    let base =
        |dtype: &str, d| KvLayout::uniform(1, 2, d, dtype.parse().unwrap(), BS, 256).unwrap();
    refused(base("tq3", 96), "dense rotation");
    refused(base("tq2.5", 96), "an outlier split of dense rotations");
    // A windowed pool exists but refuses block I/O, as on the CPU (its exact copies are
    // not in the blocks).
    let mut windowed = base("tq3", 128);
    windowed.window = KvWindow {
        recent: 32,
        sinks: 1,
        ..Default::default()
    };
    let mut pool = g.kv_pool(&windowed, 0).unwrap();
    let mut bytes = Vec::new();
    assert!(matches!(
        g.read_kv_block(&pool, 0, &mut bytes),
        Err(Error::Unsupported { .. })
    ));
    assert!(matches!(
        g.write_kv_block(&mut pool, 0, &[]),
        Err(Error::Unsupported { .. })
    ));
    let mut gaussian = base("tq3", 128);
    gaussian.codec.key_mode = KeyMode::Prod;
    gaussian.codec.qjl = turbokv_codec::QjlSketch::Gaussian;
    refused(gaussian, "a Gaussian QJL matrix");
    // Per-head formats take the direct kernels only: prod keys (the parts kernels') are not.
    let mut prod_heads = base("tq2", 128);
    prod_heads.codec.key_mode = KeyMode::Prod;
    prod_heads.layers[0].head_dtypes = vec!["tq2".parse().unwrap(), "k3v2".parse().unwrap()];
    refused(prod_heads, "per-head formats of prod keys");
    assert!(g.check_kv_dtype("tq3.5".parse().unwrap(), 128).is_ok());
    assert!(g.check_kv_dtype("tq3.5".parse().unwrap(), 256).is_ok());
    assert!(g.check_kv_dtype("tq3.5".parse().unwrap(), 96).is_err());
    assert!(g.check_kv_dtype("k4v2".parse().unwrap(), 64).is_ok());
}
