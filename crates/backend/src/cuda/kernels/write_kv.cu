// The fused KV write path: optional per-head RMSNorm of q and k, RoPE of q and k in place in
// the f32 `qkv` rows `[q heads | k heads | v heads]`, then k and v stored into the paged pool.
//
// Pool layout of each of K and V: `[num_blocks, kv_heads, block_size, head_dim]` 16-bit values.
// Token metadata: `tok_pos[t]` position, `tok_seq[t]` sequence, `seq_tbl[s]` offset of the
// sequence's block table in `tables` (logical block -> physical block).
//
// grid = (tokens, n_heads + 2 * n_kv), blockDim a multiple of 32; dynamic smem (d + 32) floats.
extern "C" __global__ void write_kv(
    float* qkv, int width, int n_heads, int n_kv, int d,
    const u32* tok_pos, const u32* tok_seq, const u32* seq_tbl, const u32* tables,
    const float* inv_freq, int n_pairs, int half_split,
    const float* q_norm, const float* k_norm, float eps, int has_norm,
    u16* k_cache, u16* v_cache, int block_size, int is_bf16)
{
    extern __shared__ float sh[];
    float* hv = sh;
    float* red = sh + d;
    int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    float* x = qkv + (u64)t * width + (u64)h * d;
    bool is_v = h >= n_heads + n_kv;
    u32 pos = tok_pos[t];
    // A decode attention behind this kernel may start fetching the older keys (attention.cu).
    // (Launching this kernel itself as a dependent of the qkv matmul measured no better.)
    pdl_trigger();
    for (int i = tid; i < d; i += blockDim.x) hv[i] = x[i];
    __syncthreads();
    if (!is_v) {
        norm_rope(hv, red, d, h < n_heads, pos, inv_freq, n_pairs, half_split, q_norm, k_norm,
                  eps, has_norm);
        for (int i = tid; i < d; i += blockDim.x) x[i] = hv[i];
    }
    if (h >= n_heads) {
        int kh = is_v ? h - n_heads - n_kv : h - n_heads;
        u32 blk = tables[seq_tbl[tok_seq[t]] + pos / block_size];
        u64 off = (((u64)blk * n_kv + kh) * block_size + pos % block_size) * d;
        u16* dst = (is_v ? v_cache : k_cache) + off;
        for (int i = tid; i < d; i += blockDim.x) dst[i] = kv_store(hv[i], is_bf16);
    }
}

// ---- Coded pools (int8, fp8, TurboQuant-MSE): the codec's encoder, bit for bit ---------
// Format descriptor (CODE_DESC_WORDS u32 words per role, keys then values; built by cuda/codes.rs):
// [0] kind (0 int8, 1 TurboQuant, 2 fp8), [1] bits, [2] code bytes per token, [3] bytes per
// (block, kv head), [4] offset of the scales in it, [5] the record layout, [6] σ, [7] 1/σ
// (f32 bits), [8..23) the boundaries, [24..32) the centroid byte tables (attention.cu; the 8
// positive centroids for sign-magnitude records), [32..32+d) the
// rotation's sign masks, [288..293) the int8 key codebook (attention.cu `INT8_TABLE_WORD`),
// [293..296) the int8 value codebook (`INT8_VALUE_WORD`), [296..300) 4-bit records' one-sided
// key tables (`INT8_PAIR_WORD`), [300] 1 for corrected norms (`CODE_CORRECTED_WORD`) and
// [301..317) the f32 centroids then, [319] the head table of a layer with per-head formats
// (`CODE_HEAD_TABLE_WORD`, the first group's key descriptor only). Every f32 operation below is the codec's (crates/codec/src/tq.rs,
// plain.rs, kernels/mod.rs), in its order and without FMA contraction, so the codes equal
// the CPU's.

// fp8::encode: the nearest E4M3 code (ties to even), saturating at ±448; NaN gives 0.
__device__ __forceinline__ unsigned char fp8_encode(float x) {
    if (x != x) return 0;
    const u32 sign = (__float_as_uint(x) >> 24) & 0x80u;
    const float a = fabsf(x);
    u32 mag;
    if (a >= 448.0f) {
        mag = 0x7eu;
    } else if (a < 0.015625f) {   // subnormals: steps of 2^-9, a·2^9 exact
        mag = (u32)rintf(__fmul_rn(a, 512.0f));
    } else {                      // the f32 mantissa rounded to 3 bits on the bit pattern
        const u32 b = __float_as_uint(a);
        mag = ((b + 0x7ffffu + ((b >> 20) & 1u)) >> 20) - (120u << 3);
    }
    return (unsigned char)(sign | mag);
}

// Encodes one head vector (v, centered) into its slot: codes at `codes`, scale at `scale`;
// with `xrow` (shared), also its copy in the basis the attention reads the codes in (rotated for
// TurboQuant: R·v), for store_exact_row.
template <int E>
__device__ __forceinline__ void encode_vector(float (&v)[E], const u32* desc, unsigned char* codes,
                                              u16* scale, unsigned char* idx, int lane, float* xrow)
{
    constexpr int D = 32 * E;
    const u32 kind = desc[0], bits = desc[1];
    // int8: s = f16(absmax / 127), q = clamp(round(x / s), ±127); fp8: s = f16(absmax / 448),
    // q = fp8::encode(x / s).
    if (kind != 1) {
        if (xrow) {
#pragma unroll
            for (int m = 0; m < E; m++) xrow[lane + 32 * m] = v[m];
        }
        float am = 0.0f;
#pragma unroll
        for (int m = 0; m < E; m++) am = fmaxf(am, fabsf(v[m]));
        for (int o = 16; o > 0; o >>= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, o));
        const u16 s16 = stored_f16(__fdiv_rn(am, kind == 0 ? 127.0f : 448.0f));
        const float sv = f16_to_f32(s16);
        const bool ok = sv > 0.0f && sv < INFINITY;
#pragma unroll
        for (int m = 0; m < E; m++) {
            const float x = __fdiv_rn(v[m], sv);
            if (kind == 2) {
                codes[lane + 32 * m] = ok ? fp8_encode(x) : (unsigned char)0;
                continue;
            }
            const float r = roundf(x);
            const float q = (!ok || r != r) ? 0.0f : fminf(fmaxf(r, -127.0f), 127.0f);
            codes[lane + 32 * m] = (unsigned char)(signed char)(int)q;
        }
        if (lane == 0) *scale = s16;
        return;
    }
    // TurboQuant-MSE: n = ‖g‖; y = FWHT(D·g); idx_i = #{k : y_i > b_k·(n·σ)}; scale n, or
    // n / ‖c[idx]‖ for corrected norms.
    const float nsq = warp_sum_squares(v);
#pragma unroll
    for (int m = 0; m < E; m++) v[m] = __uint_as_float(__float_as_uint(v[m]) ^ desc[32 + lane + 32 * m]);
    warp_fwht(v, lane);
    if (xrow) {
#pragma unroll
        for (int m = 0; m < E; m++) xrow[lane + 32 * m] = __fmul_rn(v[m], __uint_as_float(desc[7]));
    }
    const float n = __fsqrt_rn(nsq);
    const float t = __fmul_rn(n, __uint_as_float(desc[6]));
    const int nb = (1 << bits) - 1;
    // The record layout (desc[5], cuda/code_layout.rs): 0 the codec's, 1 | run << 8 3-bit
    // nibble units, 2 sign-magnitude 4-bit values (codes 8-15 stored reversed).
    const u32 lay = desc[5];
    const bool corrected = desc[CODE_CORRECTED_WORD] != 0u;
    float cv[E];   // the chosen centroids (corrected norms)
#pragma unroll
    for (int m = 0; m < E; m++) {
        int c = 0;
        for (int k = 0; k < nb; k++) c += v[m] > __fmul_rn(__uint_as_float(desc[8 + k]), t);
        cv[m] = corrected ? __uint_as_float(desc[CODE_CORRECTED_WORD + 1 + c]) : 0.0f;
        if (lay == 2 && c >= 8) c = 23 - c;
        idx[lane + 32 * m] = (unsigned char)c;
    }
    __syncwarp();
    // Record bit p holds bit `bit` of code `code`: LSB-first (p / bits, p % bits), or in a
    // run of R 3-bit codes (U = R / 16 units of 3 halfwords), halfword U·j + u nibble i holds
    // code 16u + 4j + i in bits 0-2 and bit j of the spare code 16u + 12 + i in bit 3.
    const int run = (int)(lay >> 8), units = run / 16;
    const int nbytes = D * (int)bits / 8;
    for (int b = lane; b < nbytes; b += 32) {
        u32 byte = 0;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const int p = 8 * b + k;
            int code = p / bits, bit = p % bits;
            if ((lay & 0xffu) == 1) {
                const int r = p / (3 * run), q = p - r * 3 * run;
                const int hw = q >> 4, at = q & 15, j = hw / units, u = hw - j * units;
                const int i = at >> 2, bb = at & 3;
                code = r * run + 16 * u + (bb < 3 ? 4 * j + i : 12 + i);
                bit = bb < 3 ? bb : j;
            }
            byte |= ((u32)(idx[code] >> bit) & 1u) << k;
        }
        codes[b] = (unsigned char)byte;
    }
    float s = n;
    if (corrected) {
        const float cn = __fsqrt_rn(warp_sum_squares(cv));
        if (cn > 0.0f) s = __fdiv_rn(n, cn);
    }
    if (lane == 0) *scale = stored_f16(s);
}

// write_kv for coded pools: q/k norm and RoPE as write_kv (q and k rows of qkv rewritten);
// then q, when the keys are TurboQuant, rotated in place into the keys' basis (R·q: what the
// attention on codes scores against); k and v centered (kc / vc: `[n_kv, d]` means, or null)
// and encoded into their slots; with an exact table (`xtbl`, a windowed pool: cuda/exact.rs)
// also copied into their exact blocks (xk / xv; f16, or int8 with `x_q8`) where the table
// gives the block one. grid = (tokens, n_heads + 2 n_kv), one warp; d = 32·E.
// dynamic smem: (d + 32) floats + d bytes + d floats.
template <int E>
__device__ __forceinline__ void write_kv_codes_impl(float* sh, CODED_WRITE_PARAMS)
{
    constexpr int D = 32 * E;
    float* hv = sh;
    float* red = sh + D;
    unsigned char* idx = (unsigned char*)(sh + D + 32);
    const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const bool is_q = h < n_heads, is_v = h >= n_heads + n_kv;
    const u32 pos = tok_pos[t];
    float* x = load_head_rope(hv, red, D, qkv, width, n_heads, n_kv, pos, inv_freq, n_pairs,
                              half_split, q_norm, k_norm, eps, has_norm);
    float v[E];
#pragma unroll
    for (int m = 0; m < E; m++) v[m] = hv[lane + 32 * m];
    if (is_q) {
        if (fmt[0] == 1) {   // R·q = (1/σ)·FWHT(D·q), as Rotation::forward
#pragma unroll
            for (int m = 0; m < E; m++) v[m] = __uint_as_float(__float_as_uint(v[m]) ^ fmt[32 + lane + 32 * m]);
            warp_fwht(v, lane);
#pragma unroll
            for (int m = 0; m < E; m++) v[m] = __fmul_rn(v[m], __uint_as_float(fmt[7]));
        }
#pragma unroll
        for (int m = 0; m < E; m++) x[lane + 32 * m] = v[m];
        return;
    }
    const int kh = is_v ? h - n_heads - n_kv : h - n_heads;
    if (!is_v) {
#pragma unroll
        for (int m = 0; m < E; m++) x[lane + 32 * m] = v[m];
    }
    const float* c = is_v ? vc : kc;
    if (c) {
#pragma unroll
        for (int m = 0; m < E; m++) v[m] = __fsub_rn(v[m], c[(u64)kh * D + lane + 32 * m]);
    }
    // A layer with per-head formats: this head's group's descriptors (every group shares the
    // rotation, so the query's above is the first group's).
    const u32 heads = fmt[CODE_HEAD_TABLE_WORD];
    const u32* desc = fmt + (heads ? fmt[heads + kh] : 0u) + (is_v ? CODE_DESC_WORDS : 0);
    const u32 blk = tables[seq_tbl[tok_seq[t]] + pos / block_size];
    const u32 slot = pos % block_size;
    unsigned char* base = (is_v ? v_pool : k_pool) + ((u64)blk * n_kv + kh) * desc[3];
    const int xs = xtbl ? exact_slot(xtbl, tok_seq[t], (int)(pos / block_size)) : -1;
    float* xrow = xs >= 0 ? (float*)(idx + D) : nullptr;
    encode_vector(v, desc, base + (u64)slot * desc[2], (u16*)(base + desc[4]) + slot, idx, lane, xrow);
    if (xrow) store_exact_row<D>(xrow, is_v ? xv : xk, xs, n_kv, kh, block_size, (int)slot, x_q8, lane);
}

#define WRITE_KV_CODES(D) \
    extern "C" __global__ void __launch_bounds__(32) write_kv_codes_##D(CODED_WRITE_PARAMS) { \
        extern __shared__ float sh[]; \
        write_kv_codes_impl<D / 32>(sh, CODED_WRITE_ARGS); \
    }
WRITE_KV_CODES(64)
WRITE_KV_CODES(128)
WRITE_KV_CODES(256)

// The attention output of coded values back in the original basis: out ← Rᵀ·out (TurboQuant
// values: FWHT, ×1/σ, then the signs, as Rotation::inverse) + the value mean of the head's
// kv head (vc, or null), and its bf16 copy (the output projection's input).
// grid = (rows, n_heads), one warp; d = 32·E.
template <int E>
__device__ __forceinline__ void attn_unrotate_impl(float* out, u16* out_bf16, int n_heads, int n_kv,
                                                   const u32* vdesc, const float* vc)
{
    constexpr int D = 32 * E;
    pdl_wait();
    const int r = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const int kh = h / (n_heads / n_kv);
    const u64 at = ((u64)r * n_heads + h) * D;
    float v[E];
#pragma unroll
    for (int m = 0; m < E; m++) v[m] = out[at + lane + 32 * m];
    if (vdesc[0] == 1) {
        warp_fwht(v, lane);
#pragma unroll
        for (int m = 0; m < E; m++)
            v[m] = __uint_as_float(__float_as_uint(__fmul_rn(v[m], __uint_as_float(vdesc[7]))) ^
                                   vdesc[32 + lane + 32 * m]);
    }
    if (vc) {
#pragma unroll
        for (int m = 0; m < E; m++) v[m] += vc[(u64)kh * D + lane + 32 * m];
    }
#pragma unroll
    for (int m = 0; m < E; m++) {
        out[at + lane + 32 * m] = v[m];
        out_bf16[at + lane + 32 * m] = f32_to_bf16(v[m]);
    }
}

#define ATTN_UNROTATE(D) \
    extern "C" __global__ void __launch_bounds__(32) attn_unrotate_##D(float* out, u16* out_bf16, \
        int n_heads, int n_kv, const u32* vdesc, const float* vc) { \
        attn_unrotate_impl<D / 32>(out, out_bf16, n_heads, n_kv, vdesc, vc); \
    }
ATTN_UNROTATE(64)
ATTN_UNROTATE(128)
ATTN_UNROTATE(256)
