// TurboQuant formats of any shape on the GPU: fractional widths (an outlier part and a regular
// part, each with its own rotation, codebook and norm), prod keys (MSE codes plus QJL sign
// bits), 1-bit codes and corrected norms. The records stay in the codec's layout (LSB-first
// codes, byte-aligned parts), so block I/O copies them unchanged.
//
// A launch with a prefill span at head_dim 64 or 128 dequantizes the keys it reads into f16
// rows (`codes_dequant_parts_*`, here) for the tile kernel over a coded pool's scratch
// (attention.cu `attn_mma_codes_*`); the others take attention.cu `attn_parts_*`, which reads
// the codes. The basis of
// the rows, of the exact (window) copies and of the rotated query is the parts' rotated
// coordinates back to back, `[R₀·x[ch₀] ; R₁·x[ch₁]]`: a block-diagonal orthogonal map of a
// permutation, so scores are unchanged and the output is mapped back per part
// (`attn_unrotate_parts_*`).
//
// Descriptor (PARTS_DESC_WORDS u32 words per role, keys then values; cuda/codes.rs
// `parts_descriptor`): [0] parts, [1] code bytes per token, [2] bytes per (block, kv head),
// [3] offset of the scalars in it, [4] f16 scalars per token, [5] corrected norms; part p at
// PARTS_HEADER + p·PART_WORDS: [0] m (channels), [1] code bits, [2] code offset in the record,
// [3] scale index, [4] QJL, [5] sign-bit offset, [6] first coordinate in the attention basis,
// [7] σ, [8] 1/σ, [9] κ (f32 bits); [16..31) boundaries, [32..48) centroids (f32 bits),
// [48..304) the rotation's sign masks, [304..560) and [560..816) the QJL rotations' (D₂, D₃),
// [816..1072) the channels.

// R·q of one part (gathered from hv) into the attention basis at x.
template <int E>
__device__ __forceinline__ void rotate_part(const float* hv, const u32* pd, float* x, int lane) {
    float v[E];
#pragma unroll
    for (int j = 0; j < E; j++)
        v[j] = __uint_as_float(__float_as_uint(hv[pd[P_CHANNELS + lane + 32 * j]]) ^
                               pd[P_MASKS + lane + 32 * j]);
    warp_fwht(v, lane);
#pragma unroll
    for (int j = 0; j < E; j++) x[pd[6] + lane + 32 * j] = __fmul_rn(v[j], word_f32(pd[8]));
}

// Encodes one part of the centered vector hv (tq.rs `encode_part`, operation for operation):
// codes into the record `rec`, scale (and γ) into the token's scalars, with `xrow` (shared) its
// copy in the attention basis, for store_exact_row. `idx` is m bytes of shared scratch.
template <int E>
__device__ __forceinline__ void encode_part(const float* hv, const u32* desc, const u32* pd,
                                            unsigned char* rec, u16* scalars,
                                            unsigned char* idx, float* xrow, int lane)
{
    float v[E];
#pragma unroll
    for (int j = 0; j < E; j++) v[j] = hv[pd[P_CHANNELS + lane + 32 * j]];
    const float nsq = warp_sum_squares(v);
#pragma unroll
    for (int j = 0; j < E; j++) v[j] = __uint_as_float(__float_as_uint(v[j]) ^ pd[P_MASKS + lane + 32 * j]);
    warp_fwht(v, lane);
    if (xrow) {
#pragma unroll
        for (int j = 0; j < E; j++) xrow[pd[6] + lane + 32 * j] = __fmul_rn(v[j], word_f32(pd[8]));
    }
    const float n = __fsqrt_rn(nsq);
    const float t = __fmul_rn(n, word_f32(pd[7]));
    const int bits = (int)pd[1], nb = (1 << bits) - 1;
    int c[E];
#pragma unroll
    for (int j = 0; j < E; j++) {
        int k = 0;
        for (int b = 0; b < nb; b++) k += v[j] > __fmul_rn(word_f32(pd[P_BOUNDS + b]), t);
        c[j] = k;
        idx[lane + 32 * j] = (unsigned char)k;
    }
    __syncwarp();
    unsigned char* codes = rec + pd[2];
    for (int b = lane; b < 32 * E * bits / 8; b += 32) {
        u32 byte = 0;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const int p = 8 * b + k;
            byte |= ((u32)(idx[p / bits] >> (p % bits)) & 1u) << k;
        }
        codes[b] = (unsigned char)byte;
    }
    float scale = n;
    if (desc[5]) {   // corrected: n / ‖c[idx]‖
        float cv[E];
#pragma unroll
        for (int j = 0; j < E; j++) cv[j] = word_f32(pd[P_CENTS + c[j]]);
        const float cn = __fsqrt_rn(warp_sum_squares(cv));
        if (cn > 0.0f) scale = __fdiv_rn(n, cn);
    }
    const u16 s16 = stored_f16(scale);
    if (lane == 0) scalars[pd[3]] = s16;
    if (pd[4]) {
        // The residual in raw rotated units, γ = ‖r‖ / σ, and the signs of S·r.
        const float a = __fmul_rn(f16_to_f32(s16), word_f32(pd[7]));
#pragma unroll
        for (int j = 0; j < E; j++) v[j] = __fsub_rn(v[j], __fmul_rn(a, word_f32(pd[P_CENTS + c[j]])));
        const float gamma = __fdiv_rn(__fsqrt_rn(warp_sum_squares(v)), word_f32(pd[7]));
        if (lane == 0) scalars[pd[3] + 1] = stored_f16(gamma);
#pragma unroll
        for (int j = 0; j < E; j++) v[j] = __uint_as_float(__float_as_uint(v[j]) ^ pd[P_QJL0 + lane + 32 * j]);
        warp_fwht(v, lane);
#pragma unroll
        for (int j = 0; j < E; j++) v[j] = __uint_as_float(__float_as_uint(v[j]) ^ pd[P_QJL1 + lane + 32 * j]);
        warp_fwht(v, lane);
        // Bit l of ballot j is coordinate 32j + l: the codec's LSB-first bytes, little-endian.
#pragma unroll
        for (int j = 0; j < E; j++) {
            const u32 w = __ballot_sync(0xffffffffu, v[j] >= 0.0f);
            if (lane < 4) rec[pd[5] + 4 * j + lane] = (unsigned char)(w >> (8 * lane));
        }
    }
    __syncwarp();   // idx is the next part's
}

// write_kv_codes (write_kv.cu) for a parts pool: the same arguments, norm and RoPE; q rotated
// per part into the attention basis in place; k and v centered, encoded part by part, and
// copied to their exact blocks (f16, or int8 with `x_q8`) where the table gives one.
// grid = (tokens, n_heads + 2 n_kv), one warp; dynamic smem: (D + 32) floats + D bytes + D floats.
template <int D>
__device__ __forceinline__ void write_kv_parts_impl(float* sh, CODED_WRITE_PARAMS)
{
    float* hv = sh;
    float* red = sh + D;
    unsigned char* idx = (unsigned char*)(sh + D + 32);
    const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const bool is_q = h < n_heads, is_v = h >= n_heads + n_kv;
    const u32 pos = tok_pos[t];
    float* x = load_head_rope(hv, red, D, qkv, width, n_heads, n_kv, pos, inv_freq, n_pairs,
                              half_split, q_norm, k_norm, eps, has_norm);
    if (is_q) {
        for (int p = 0; p < (int)fmt[0]; p++) {
            const u32* pd = fmt + PARTS_HEADER + p * PART_WORDS;
            BY_PART_WIDTH(pd[0], rotate_part, hv, pd, x, lane)
        }
        return;
    }
    const int kh = is_v ? h - n_heads - n_kv : h - n_heads;
    const float* c = is_v ? vc : kc;
    for (int i = lane; i < D; i += 32) {
        if (!is_v) x[i] = hv[i];
        if (c) hv[i] = __fsub_rn(hv[i], c[(u64)kh * D + i]);
    }
    __syncwarp();
    const u32* desc = fmt + (is_v ? PARTS_DESC_WORDS : 0);
    const u32 blk = tables[seq_tbl[tok_seq[t]] + pos / block_size];
    const u32 slot = pos % block_size;
    unsigned char* base = (is_v ? v_pool : k_pool) + ((u64)blk * n_kv + kh) * desc[2];
    unsigned char* rec = base + (u64)slot * desc[1];
    u16* scalars = (u16*)(base + desc[3]) + (u64)slot * desc[4];
    const int xs = xtbl ? exact_slot(xtbl, tok_seq[t], (int)(pos / block_size)) : -1;
    float* xrow = xs >= 0 ? (float*)(idx + D) : nullptr;
    for (int p = 0; p < (int)desc[0]; p++) {
        const u32* pd = desc + PARTS_HEADER + p * PART_WORDS;
        BY_PART_WIDTH(pd[0], encode_part, hv, desc, pd, rec, scalars, idx, xrow, lane)
    }
    if (xrow) store_exact_row<D>(xrow, is_v ? xv : xk, xs, n_kv, kh, block_size, (int)slot, x_q8, lane);
}

// One part of a record as f16 rows in the attention basis: s·c[idx], plus for prod keys
// γ·κ·Sᵀ·sign = γ·κ·√m·R_{D₂}ᵀ·R_{D₃}ᵀ·sign (tq.rs `decode_part` before its Rᵀ).
template <int E>
__device__ __forceinline__ void dequant_part(const unsigned char* rec, const u16* scalars,
                                             const u32* pd, u16* out, int lane)
{
    const int bits = (int)pd[1];
    const float s = f16_to_f32(scalars[pd[3]]);
    float v[E];
#pragma unroll
    for (int j = 0; j < E; j++) {
        const int at = (lane + 32 * j) * bits;
        const unsigned char* p = rec + pd[2] + (at >> 3);
        u32 w = p[0];
        if ((at & 7) + bits > 8) w |= (u32)p[1] << 8;
        v[j] = s * word_f32(pd[P_CENTS + ((w >> (at & 7)) & ((1u << bits) - 1))]);
    }
    if (pd[4]) {
        const float inv_sigma = word_f32(pd[8]);
        float w[E];
#pragma unroll
        for (int j = 0; j < E; j++) {
            const int i = lane + 32 * j;
            w[j] = (rec[pd[5] + (i >> 3)] >> (i & 7)) & 1 ? 1.0f : -1.0f;
        }
        warp_fwht(w, lane);
#pragma unroll
        for (int j = 0; j < E; j++)
            w[j] = __uint_as_float(__float_as_uint(w[j] * inv_sigma) ^ pd[P_QJL1 + lane + 32 * j]);
        warp_fwht(w, lane);
#pragma unroll
        for (int j = 0; j < E; j++)
            w[j] = __uint_as_float(__float_as_uint(w[j] * inv_sigma) ^ pd[P_QJL0 + lane + 32 * j]);
        const float k = f16_to_f32(scalars[pd[3] + 1]) * word_f32(pd[9]) * word_f32(pd[7]);
#pragma unroll
        for (int j = 0; j < E; j++) v[j] += k * w[j];
    }
#pragma unroll
    for (int j = 0; j < E; j++) out[pd[6] + lane + 32 * j] = f32_to_f16(v[j]);
}

// codes_dequant_* (attention.cu) for a parts pool, with its arguments: one block per (run of
// 16 keys, kv head), 4 warps, each dequantizing one key's K or V record at a time into the
// scratch row base[span] + key.
template <int D>
__device__ __forceinline__ void codes_dequant_parts_impl(const u32* __restrict__ runs,
    const int* __restrict__ base, const u32* __restrict__ seq_tbl, const u32* __restrict__ tables,
    const unsigned char* __restrict__ k_pool, const unsigned char* __restrict__ v_pool,
    int block_size, int n_kv, const u32* __restrict__ fmt, u16* __restrict__ dk, u16* __restrict__ dv)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, kh = blockIdx.y;
    const u32 s = runs[2 * blockIdx.x];
    const int key0 = (int)runs[2 * blockIdx.x + 1];
    const u32* tbl = tables + seq_tbl[s];
    const long long row0 = (long long)base[s] + key0;
    for (int j = warp; j < 32; j += 4) {
        const int key = key0 + (j >> 1), is_v = j & 1;
        const u32* desc = fmt + (is_v ? PARTS_DESC_WORDS : 0);
        const u32 blk = tbl[key / block_size];
        const int slot = key % block_size;
        const unsigned char* b = (is_v ? v_pool : k_pool) + ((u64)blk * n_kv + kh) * desc[2];
        const unsigned char* rec = b + (u64)slot * desc[1];
        const u16* scalars = (const u16*)(b + desc[3]) + (u64)slot * desc[4];
        u16* out = (is_v ? dv : dk) + ((u64)(row0 + (j >> 1)) * n_kv + kh) * D;
        for (int p = 0; p < (int)desc[0]; p++) {
            const u32* pd = desc + PARTS_HEADER + p * PART_WORDS;
            BY_PART_WIDTH(pd[0], dequant_part, rec, scalars, pd, out, lane)
        }
    }
}

// Rᵀ of one part of the attention basis (FWHT, ×1/σ, the signs, as Rotation::inverse),
// scattered to its channels in o, plus the value mean vc (or null).
template <int E>
__device__ __forceinline__ void unrotate_part(const float* in, const u32* pd, const float* vc,
                                              float* o, int lane)
{
    float v[E];
#pragma unroll
    for (int j = 0; j < E; j++) v[j] = in[pd[6] + lane + 32 * j];
    warp_fwht(v, lane);
#pragma unroll
    for (int j = 0; j < E; j++) {
        const int ch = (int)pd[P_CHANNELS + lane + 32 * j];
        const float r = __uint_as_float(__float_as_uint(__fmul_rn(v[j], word_f32(pd[8]))) ^
                                        pd[P_MASKS + lane + 32 * j]);
        o[ch] = vc ? r + vc[ch] : r;
    }
}

// attn_unrotate (write_kv.cu) for a parts pool: grid = (rows, n_heads), one warp.
template <int D>
__device__ __forceinline__ void attn_unrotate_parts_impl(float* out, u16* out_bf16, int n_heads,
                                                         int n_kv, const u32* vdesc, const float* vc)
{
    __shared__ float o[D];
    pdl_wait();
    const int r = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const int kh = h / (n_heads / n_kv);
    float* row = out + ((u64)r * n_heads + h) * D;
    const float* c = vc ? vc + (u64)kh * D : nullptr;
    for (int p = 0; p < (int)vdesc[0]; p++) {
        const u32* pd = vdesc + PARTS_HEADER + p * PART_WORDS;
        BY_PART_WIDTH(pd[0], unrotate_part, row, pd, c, o, lane)
    }
    __syncwarp();
    for (int i = lane; i < D; i += 32) {
        row[i] = o[i];
        out_bf16[((u64)r * n_heads + h) * D + i] = f32_to_bf16(o[i]);
    }
}

#define PARTS_KERNELS(D) \
    extern "C" __global__ void __launch_bounds__(32) write_kv_parts_##D(CODED_WRITE_PARAMS) { \
        extern __shared__ float sh[]; \
        write_kv_parts_impl<D>(sh, CODED_WRITE_ARGS); \
    } \
    extern "C" __global__ void __launch_bounds__(32) attn_unrotate_parts_##D(float* out, \
        u16* out_bf16, int n_heads, int n_kv, const u32* vdesc, const float* vc) { \
        attn_unrotate_parts_impl<D>(out, out_bf16, n_heads, n_kv, vdesc, vc); \
    }
// The dequantization for the coded tile kernel, at its head dims (64, 128).
#define PARTS_DEQUANT(D) \
    extern "C" __global__ void __launch_bounds__(128) codes_dequant_parts_##D( \
        const u32* runs, const int* base, const u32* seq_tbl, const u32* tables, \
        const unsigned char* k_pool, const unsigned char* v_pool, int block_size, int n_kv, \
        const u32* fmt, u16* dk, u16* dv) { \
        codes_dequant_parts_impl<D>(runs, base, seq_tbl, tables, k_pool, v_pool, block_size, \
                                    n_kv, fmt, dk, dv); \
    }
PARTS_KERNELS(64)
PARTS_KERNELS(128)
PARTS_KERNELS(256)
PARTS_DEQUANT(64)
PARTS_DEQUANT(128)
