// The codec's f32 steps shared by the kernels that encode and decode TurboQuant codes
// (write_kv.cu, parts.cu): each in the codec's operation order (crates/codec/src/kernels),
// without FMA contraction, so that a GPU encoder produces the CPU's codes.

// The optional per-head RMSNorm and RoPE of one q or k head vector `hv` (d floats in shared
// memory) of the token at `pos`; `red` is 32 floats of scratch. Ends with a barrier.
__device__ __forceinline__ void norm_rope(float* hv, float* red, int d, bool is_q, u32 pos,
    const float* inv_freq, int n_pairs, int half_split, const float* q_norm, const float* k_norm,
    float eps, int has_norm)
{
    const int tid = threadIdx.x;
    if (has_norm) {
        float s = 0.0f;
        for (int i = tid; i < d; i += blockDim.x) s += hv[i] * hv[i];
        s = block_sum(s, red);
        float inv = 1.0f / sqrtf(s / (float)d + eps);
        const float* w = is_q ? q_norm : k_norm;
        for (int i = tid; i < d; i += blockDim.x) hv[i] *= inv * w[i];
        __syncthreads();
    }
    float p = (float)pos;
    for (int i = tid; i < n_pairs; i += blockDim.x) {
        float sn, cs;
        sincosf(p * inv_freq[i], &sn, &cs);
        int a = half_split ? i : 2 * i;
        int b = half_split ? i + n_pairs : 2 * i + 1;
        float x0 = hv[a], x1 = hv[b];
        hv[a] = x0 * cs - x1 * sn;
        hv[b] = x0 * sn + x1 * cs;
    }
    __syncthreads();
}

// The coded write kernels' first steps for head h of token t (one warp per block): its row of
// qkv into hv (D floats of shared memory), then q/k norm and RoPE for a q or k head (`red`: 32
// floats of scratch). Returns the row in qkv.
__device__ __forceinline__ float* load_head_rope(float* hv, float* red, int D, float* qkv,
    int width, int n_heads, int n_kv, u32 pos, const float* inv_freq, int n_pairs,
    int half_split, const float* q_norm, const float* k_norm, float eps, int has_norm)
{
    const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    float* x = qkv + (u64)t * width + (u64)h * D;
    pdl_trigger();
    for (int i = lane; i < D; i += 32) hv[i] = x[i];
    __syncthreads();
    if (h < n_heads + n_kv) norm_rope(hv, red, D, h < n_heads, pos, inv_freq, n_pairs,
                                      half_split, q_norm, k_norm, eps, has_norm);
    return x;
}

// In-place unnormalised FWHT of the d values a warp holds, lane l owning v[m] = x[l + 32m]:
// stages h = 1, 2, 4, … with butterflies (a + b, a − b), as kernels::fwht_scalar.
template <int E>
__device__ __forceinline__ void warp_fwht(float (&v)[E], int lane) {
#pragma unroll
    for (int h = 1; h < 32; h <<= 1) {
#pragma unroll
        for (int m = 0; m < E; m++) {
            const float o = __shfl_xor_sync(0xffffffffu, v[m], h);
            v[m] = (lane & h) ? __fsub_rn(o, v[m]) : __fadd_rn(v[m], o);
        }
    }
#pragma unroll
    for (int hm = 1; hm < E; hm <<= 1) {
#pragma unroll
        for (int m = 0; m < E; m++) {
            if (m & hm) continue;
            const float a = v[m], b = v[m + hm];
            v[m] = __fadd_rn(a, b);
            v[m + hm] = __fsub_rn(a, b);
        }
    }
}

// kernels::sum_squares of the warp's d values (lane l accumulates x[l + 32m] in increasing m,
// then the fixed 32 → 8 → 1 tree); every lane gets the sum.
template <int E>
__device__ __forceinline__ float warp_sum_squares(const float (&v)[E]) {
    float a = 0.0f;
#pragma unroll
    for (int m = 0; m < E; m++) a = __fadd_rn(a, __fmul_rn(v[m], v[m]));
    a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, 8));
    a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, 16));
    a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, 4));
    a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, 2));
    a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, 1));
    return __shfl_sync(0xffffffffu, a, 0);
}

// tq::stored_f16: round to nearest even, every NaN as 0x7E00.
__device__ __forceinline__ u16 stored_f16(float v) { return v != v ? (u16)0x7e00u : f32_to_f16(v); }

// A windowed pool's exact blocks (cuda/exact.rs) hold each exact token's copy in one of two
// forms. f16 copies: rows of d halves, [slot, n_kv, block_size, d]. int8 copies (`q8`): per
// slot, the rows' d-byte codes [n_kv, block_size, d], then one f16 step per row
// [n_kv, block_size]; a value is code × step (cpu/kv.rs `CopySlot`).
struct ExactQ8Row { unsigned char* codes; u16* step; };
__device__ __forceinline__ ExactQ8Row exact_q8_row(const void* blocks, int slot, int n_kv, int kh,
                                                   int block_size, int t, int d)
{
    unsigned char* s = (unsigned char*)blocks + (u64)slot * n_kv * block_size * (d + 2);
    const int row = kh * block_size + t;
    return {s + (u64)row * d, (u16*)(s + (u64)n_kv * block_size * d) + row};
}

// Eight int8 codes (c.x: codes 0-3, c.y: 4-7) × step as four f16 pairs, the even code low.
__device__ __forceinline__ uint4 widen_q8(uint2 c, float step)
{
    u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u32 word = i < 2 ? c.x : c.y, sh = 16 * (i & 1);
        const float lo = (float)(signed char)(word >> sh), hi = (float)(signed char)(word >> (sh + 8));
        w[i] = (u32)f32_to_f16(lo * step) | ((u32)f32_to_f16(hi * step) << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// Stores the exact copy of a working vector, the d floats at `row` (shared memory, written by
// this warp), into exact row t of kv head kh in block `slot`: f16, or with `q8` int8 codes
// with an f16 step s = f16(absmax / 127), q = clamp(round(x / s), ±127), zero codes when s is
// 0 or not finite (cpu/kv.rs `CopySlot::write`). One warp.
template <int D>
__device__ __forceinline__ void store_exact_row(const float* row, u16* blocks, int slot, int n_kv,
                                                int kh, int block_size, int t, int q8, int lane)
{
    __syncwarp();
    if (!q8) {
        u16* dst = blocks + (((u64)slot * n_kv + kh) * block_size + t) * D;
        for (int i = lane; i < D; i += 32) dst[i] = f32_to_f16(row[i]);
        return;
    }
    float am = 0.0f;
    for (int i = lane; i < D; i += 32) am = fmaxf(am, fabsf(row[i]));
    for (int o = 16; o > 0; o >>= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, o));
    const u16 s16 = stored_f16(__fdiv_rn(am, 127.0f));
    const float sv = f16_to_f32(s16);
    const bool ok = sv > 0.0f && sv < INFINITY;
    const ExactQ8Row dst = exact_q8_row(blocks, slot, n_kv, kh, block_size, t, D);
    for (int i = lane; i < D; i += 32) {
        const float r = roundf(__fdiv_rn(row[i], sv));
        const float q = (!ok || r != r) ? 0.0f : fminf(fmaxf(r, -127.0f), 127.0f);
        dst.codes[i] = (unsigned char)(signed char)(int)q;
    }
    if (lane == 0) *dst.step = s16;
}


// The parameters of the coded write kernels (write_kv.cu `write_kv_codes_*`, parts.cu
// `write_kv_parts_*`: one launch signature for both, cuda/ops/kv_write.rs), and their names.
#define CODED_WRITE_PARAMS \
    float* qkv, int width, int n_heads, int n_kv, \
    const u32* tok_pos, const u32* tok_seq, const u32* seq_tbl, const u32* tables, \
    const float* inv_freq, int n_pairs, int half_split, \
    const float* q_norm, const float* k_norm, float eps, int has_norm, \
    unsigned char* k_pool, unsigned char* v_pool, int block_size, \
    const u32* fmt, const float* kc, const float* vc, u16* xk, u16* xv, const u32* xtbl, int x_q8
#define CODED_WRITE_ARGS qkv, width, n_heads, n_kv, tok_pos, tok_seq, seq_tbl, tables, \
    inv_freq, n_pairs, half_split, q_norm, k_norm, eps, has_norm, k_pool, v_pool, block_size, \
    fmt, kc, vc, xk, xv, xtbl, x_q8

// The parts descriptor's layout (parts.cu documents it; cuda/parts.rs builds it).
#define PARTS_HEADER 16
#define PART_WORDS 1088
#define PARTS_DESC_WORDS (PARTS_HEADER + 2 * PART_WORDS)
#define P_BOUNDS 16
#define P_CENTS 32
#define P_MASKS 48
#define P_QJL0 304
#define P_QJL1 560
#define P_CHANNELS 816

__device__ __forceinline__ float word_f32(u32 w) { return __uint_as_float(w); }

// Calls F<m / 32>(args...) for a part of m = 32, 64, 128 or 256 channels.
#define BY_PART_WIDTH(m, F, ...)                      \
    switch (m) {                                       \
    case 32: F<1>(__VA_ARGS__); break;                 \
    case 64: F<2>(__VA_ARGS__); break;                 \
    case 128: F<4>(__VA_ARGS__); break;                \
    default: F<8>(__VA_ARGS__); break;                 \
    }

