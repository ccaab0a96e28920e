//! Prototype, not part of the build: 3-bit key scores through int8 products (AVX-512 VBMI +
//! VNNI) against the AVX2 decode-and-FMA shape of `crates/backend/src/cpu/direct_avx2.rs`,
//! for the GQA group of three query rows of the demo model, on random codes.
//!
//! ```text
//! rustc -O --edition 2024 bench/prototypes/vnni_scores.rs -o /tmp/vnni_scores && /tmp/vnni_scores
//! ```
//!
//! The int8 path keeps the codec's records (64 codes of 3 bits LSB-first, an f32 scale per key
//! here): per key, `vpermb` places each 3-byte group of 8 codes in a qword, `vpmultishiftqb`
//! (shifts 0, 3, …, 21) puts code i in the low bits of byte i, and `vpermb` through the codebook
//! (as u8, offset 128, repeated to 64 entries so the bits above a code do not matter) gives 64
//! centroid bytes; one `vpdpbusd` per query row (the row quantised to int8) makes 64 products;
//! `128 · Σq` undoes the offset; horizontal sums four keys at a time. Needs a CPU with
//! avx512vbmi and avx512vnni (checked at the start). Results: BENCHMARKS.md, "Integer scores:
//! a prototype".

use std::arch::x86_64::*;
use std::hint::black_box;
use std::time::Instant;

const W: usize = 64;
const STRIDE: usize = 24; // 64 3-bit codes

fn rng(s: &mut u64) -> f32 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    (*s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
}

fn code(rec: &[u8], i: usize) -> usize {
    let mut c = 0;
    for k in 0..3 {
        let at = 3 * i + k;
        c |= usize::from((rec[at / 8] >> (at % 8)) & 1) << k;
    }
    c
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum4(v: [__m256; 4]) -> __m128 {
    let a = _mm256_hadd_ps(v[0], v[1]);
    let b = _mm256_hadd_ps(v[2], v[3]);
    let c = _mm256_hadd_ps(a, b);
    _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps::<1>(c))
}

/// Baseline: AVX2 decode (broadcast, srlv, permps) + FMA, 3 rows × 2 keys per pass.
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_avx2(
    recs: &[u8],
    n: usize,
    table: &[f32; 8],
    scales: &[f32],
    q: &[f32],
    out: &mut [f32],
) {
    let t = unsafe { _mm256_loadu_ps(table.as_ptr()) };
    let shifts = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21);
    let mut j = 0;
    while j + 2 <= n {
        let mut acc = [[_mm256_setzero_ps(); 2]; 3];
        for c in 0..W / 8 {
            for k in 0..2 {
                unsafe {
                    let word = recs
                        .as_ptr()
                        .add((j + k) * STRIDE + 3 * c)
                        .cast::<i32>()
                        .read_unaligned();
                    let idx = _mm256_srlv_epi32(_mm256_set1_epi32(word), shifts);
                    let x = _mm256_permutevar8x32_ps(t, idx);
                    for r in 0..3 {
                        acc[r][k] = _mm256_fmadd_ps(
                            _mm256_loadu_ps(q.as_ptr().add(r * W + 8 * c)),
                            x,
                            acc[r][k],
                        );
                    }
                }
            }
        }
        let h0 = hsum4([acc[0][0], acc[0][1], acc[1][0], acc[1][1]]);
        let h1 = hsum4([
            acc[2][0],
            acc[2][1],
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
        ]);
        let mut s = [0f32; 8];
        unsafe {
            _mm_storeu_ps(s.as_mut_ptr(), h0);
            _mm_storeu_ps(s.as_mut_ptr().add(4), h1);
        }
        for r in 0..3 {
            for k in 0..2 {
                out[r * n + j + k] = s[r * 2 + k] * scales[j + k];
            }
        }
        j += 2;
    }
}

/// int8: 64 codes → 64 centroid bytes (vpermb, vpmultishiftqb, vpermb), one vpdpbusd per
/// row, horizontal sums of four keys at a time.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
unsafe fn scores_vnni(
    recs: &[u8],
    n: usize,
    table_u8: &[u8; 64],
    scales: &[f32],
    qi: &[i8],
    qscale: &[f32; 3],
    qsum: &[i32; 3],
    out: &mut [f32],
) {
    let tab = unsafe { _mm512_loadu_si512(table_u8.as_ptr().cast()) };
    let mut place = [0u8; 64];
    for l in 0..8 {
        for i in 0..8 {
            place[8 * l + i] = (3 * l + i) as u8;
        }
    }
    let place = unsafe { _mm512_loadu_si512(place.as_ptr().cast()) };
    let ctl = _mm512_set1_epi64(i64::from_le_bytes([0, 3, 6, 9, 12, 15, 18, 21]));
    let qv: [__m512i; 3] =
        core::array::from_fn(|r| unsafe { _mm512_loadu_si512(qi.as_ptr().add(r * W).cast()) });
    let corr: [i32; 3] = core::array::from_fn(|r| 128 * qsum[r]);
    let mut j = 0;
    while j + 4 <= n {
        let mut acc = [[_mm512_setzero_si512(); 4]; 3];
        for k in 0..4 {
            unsafe {
                let raw = _mm512_castsi256_si512(_mm256_loadu_si256(
                    recs.as_ptr().add((j + k) * STRIDE).cast(),
                ));
                let q8 = _mm512_permutexvar_epi8(place, raw);
                let codes = _mm512_multishift_epi64_epi8(ctl, q8);
                let cent = _mm512_permutexvar_epi8(codes, tab);
                for r in 0..3 {
                    acc[r][k] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), cent, qv[r]);
                }
            }
        }
        for r in 0..3 {
            // Sum the 16 lanes of each of four keys: pairwise adds of 256-bit halves, then a
            // 4×4 transpose-add of the 128-bit parts.
            let h: [__m256i; 4] = core::array::from_fn(|k| {
                _mm256_add_epi32(
                    _mm512_castsi512_si256(acc[r][k]),
                    _mm512_extracti64x4_epi64::<1>(acc[r][k]),
                )
            });
            let a = _mm256_hadd_epi32(h[0], h[1]);
            let b = _mm256_hadd_epi32(h[2], h[3]);
            let c = _mm256_hadd_epi32(a, b);
            let s = _mm_add_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256::<1>(c));
            let s = _mm_sub_epi32(s, _mm_set1_epi32(corr[r]));
            let f = _mm_mul_ps(
                _mm_cvtepi32_ps(s),
                _mm_mul_ps(_mm_set1_ps(qscale[r]), unsafe {
                    _mm_loadu_ps(scales.as_ptr().add(j))
                }),
            );
            unsafe { _mm_storeu_ps(out.as_mut_ptr().add(r * n + j), f) };
        }
        j += 4;
    }
}

fn main() {
    if !(std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("avx512vbmi")
        && std::arch::is_x86_feature_detected!("avx512vnni")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512bw"))
    {
        return eprintln!("needs AVX2, FMA and AVX-512 VBMI, VNNI, VL and BW");
    }
    let n = 8192;
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let recs: Vec<u8> = (0..n * STRIDE + 64)
        .map(|_| (rng(&mut s).to_bits() >> 7) as u8)
        .collect();
    let table: [f32; 8] = [-2.152, -1.344, -0.756, -0.245, 0.245, 0.756, 1.344, 2.152];
    let scales: Vec<f32> = (0..n).map(|_| 0.5 + rng(&mut s).abs()).collect();
    let q: Vec<f32> = (0..3 * W).map(|_| rng(&mut s)).collect();
    // int8 codebook and queries.
    let cmax = 2.152f32;
    let csc = cmax / 127.0;
    let mut table_u8 = [0u8; 64];
    for (i, t) in table_u8.iter_mut().enumerate() {
        *t = ((table[i % 8] / csc).round() as i32 + 128) as u8;
    }
    let mut qi = vec![0i8; 3 * W];
    let mut qscale = [0f32; 3];
    let mut qsum = [0i32; 3];
    for r in 0..3 {
        let m = q[r * W..(r + 1) * W]
            .iter()
            .fold(0f32, |a, &b| a.max(b.abs()));
        qscale[r] = m / 127.0 * csc;
        for d in 0..W {
            let v = (q[r * W + d] / (m / 127.0)).round() as i32;
            qi[r * W + d] = v as i8;
            qsum[r] += v;
        }
    }
    // Reference in f64.
    let mut want = vec![0f64; 3 * n];
    for j in 0..n {
        let rec = &recs[j * STRIDE..];
        for r in 0..3 {
            let mut acc = 0f64;
            for d in 0..W {
                acc += q[r * W + d] as f64 * table[code(rec, d)] as f64;
            }
            want[r * n + j] = acc * scales[j] as f64;
        }
    }
    let mut a = vec![0f32; 3 * n];
    let mut b = vec![0f32; 3 * n];
    let reps = 400;
    let (mut ta, mut tb) = (f64::MAX, f64::MAX);
    // SAFETY (both kernels): the features were detected above; `recs` holds n records and 64
    // bytes of slack for the 32-byte loads, `out`s hold 3n floats.
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..reps {
            unsafe { scores_avx2(black_box(&recs), n, &table, &scales, &q, &mut a) };
        }
        ta = ta.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        for _ in 0..reps {
            unsafe {
                scores_vnni(
                    black_box(&recs),
                    n,
                    &table_u8,
                    &scales,
                    &qi,
                    &qscale,
                    &qsum,
                    &mut b,
                )
            };
        }
        tb = tb.min(t.elapsed().as_secs_f64());
    }
    let err = |x: &[f32]| {
        let (mut e2, mut w2) = (0f64, 0f64);
        for (g, w) in x.iter().zip(&want) {
            e2 += (*g as f64 - w).powi(2);
            w2 += w * w;
        }
        (e2 / w2).sqrt()
    };
    let per = |t: f64| t / (reps * n) as f64 * 1e9;
    println!(
        "avx2 fma: {:.2} ns/key (3 rows), rel rms err {:.2e}",
        per(ta),
        err(&a)
    );
    println!(
        "vnni int8: {:.2} ns/key (3 rows), rel rms err {:.2e}",
        per(tb),
        err(&b)
    );
    // The error of 3-bit codes themselves, for scale: the scores' spread.
    println!("speedup {:.2}x", ta / tb);
}
