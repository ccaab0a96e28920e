// Paged causal attention, flash-decoding style: every (query row, kv head, key split) block
// runs an online softmax over its key range for the `g = n_heads / n_kv` query heads that
// share the kv head, and writes unnormalised partials (max, sum, acc); `attn_combine` merges
// the splits of each (row, head). Prefill rows and decode rows of many sequences of different
// lengths share one launch: each row finds its sequence, position and block table through the
// token metadata (see write_kv.cu). A row at position p sees keys 0..=p.
//
// Pool layout of each of K and V: `[num_blocks, kv_heads, block_size, head_dim]`.
#define TILE 32
#define NT 128
#define MAXE 16

// attn_partial_{64,128,256,any}: grid = (rows, n_kv, n_splits), block = NT threads; requires
// g * d <= NT * MAXE, d % 4 == 0, d <= 256.
// dynamic smem: floats g*d + TILE*(d+4) + TILE*d + g*TILE + 3*g.
// Shared tiles are read as float4: K rows are padded to d + 4 floats so the 16-byte reads of
// lanes holding different keys fall in different banks.
//
// Per tile of TILE keys: (a) K and V, loaded as 8-byte vectors into registers during the
// previous tile, are unpacked into f32 shared tiles and the next tile's loads are issued;
// (b) the g·TILE scores, each split over NT/(g·TILE) threads when there
// are fewer scores than threads; (c) one warp per query head updates the online softmax, lane
// j owning key j; (d) each thread updates its fixed accumulator elements.
#define ATTN_PARAMS \
    const float* __restrict__ qkv, int width, int n_heads, int n_kv, int d_rt, float scale, \
    const u32* __restrict__ tok_pos, const u32* __restrict__ tok_seq, const u32* __restrict__ seq_tbl, \
    const u32* __restrict__ tables, \
    const u16* __restrict__ k_cache, const u16* __restrict__ v_cache, int block_size, int is_bf16, \
    int chunk, int n_splits, float* __restrict__ part_ml, float* __restrict__ part_acc
#define ATTN_ARGS qkv, width, n_heads, n_kv, d_rt, scale, tok_pos, tok_seq, seq_tbl, tables, \
    k_cache, v_cache, block_size, is_bf16, chunk, n_splits, part_ml, part_acc

// D > 0: head_dim fixed at compile time (fewer registers for the prefetch); D == 0: any d.
template <int D>
__device__ __forceinline__ void attn_partial_impl(float* sh, ATTN_PARAMS)
{
    const int d = D > 0 ? D : d_rt;
    constexpr int LOADS = D > 0 ? (TILE * D / 4 + NT - 1) / NT : TILE * 64 / NT;
    const int g = n_heads / n_kv;
    const int r = blockIdx.x, kh = blockIdx.y, sp = blockIdx.z, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int d4 = d >> 2, kp4 = d4 + 1;   // K row stride in float4s
    float* qs = sh;
    float* ks = qs + g * d;
    float* vs = ks + TILE * (d + 4);
    float* sc = vs + TILE * d;
    float* mst = sc + g * TILE;
    float* lst = mst + g;
    float* cst = lst + g;

    const u32 pos = tok_pos[r];
    const int kend = (int)pos + 1;
    const int k0 = sp * chunk;
    const int k1 = min(k0 + chunk, kend);
    const u32* tbl = tables + seq_tbl[tok_seq[r]];
    const float* qrow = qkv + (u64)r * width + (u64)kh * g * d;
    for (int i = tid; i < g * d; i += NT) qs[i] = qrow[i];
    if (tid < g) { mst[tid] = -INFINITY; lst[tid] = 0.0f; }
    const float4* qs4 = (const float4*)qs;
    const float4* ks4 = (const float4*)ks;
    const float4* vs4 = (const float4*)vs;
    float4 acc[MAXE / 4];
#pragma unroll
    for (int k = 0; k < MAXE / 4; k++) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    const int ne4 = g * d4;
    const int n_scores = g * TILE;
    const int tpd = n_scores >= NT ? 1 : NT / n_scores;   // threads per score: 1, 2 or 4
    __syncthreads();

    // K/V of the next tile are fetched into registers while the current one is computed.
    uint2 kreg[LOADS], vreg[LOADS];
    auto fetch = [&](int q0) {
        const int nn = min(TILE, k1 - q0);
#pragma unroll
        for (int it = 0; it < LOADS; it++) {
            const int i = tid + it * NT;
            kreg[it] = make_uint2(0u, 0u);
            vreg[it] = make_uint2(0u, 0u);
            if (i < TILE * d4) {
                const int j = i / d4, c = (i - j * d4) * 4;
                if (j < nn) {
                    const int p = q0 + j;
                    const u32 blk = tbl[p / block_size];
                    const u64 off = (((u64)blk * n_kv + kh) * block_size + p % block_size) * d + c;
                    kreg[it] = *(const uint2*)(k_cache + off);
                    vreg[it] = *(const uint2*)(v_cache + off);
                }
            }
        }
    };
    auto unpack = [&](u32 w0, u32 w1) {
        return make_float4(kv_load((u16)(w0 & 0xffffu), is_bf16), kv_load((u16)(w0 >> 16), is_bf16),
                           kv_load((u16)(w1 & 0xffffu), is_bf16), kv_load((u16)(w1 >> 16), is_bf16));
    };
    if (k0 < k1) fetch(k0);

    for (int p0 = k0; p0 < k1; p0 += TILE) {
        const int n = min(TILE, k1 - p0);
#pragma unroll
        for (int it = 0; it < LOADS; it++) {
            const int i = tid + it * NT;
            if (i < TILE * d4) {
                const int j = i / d4, c = (i - j * d4) * 4;
                *(float4*)(ks + j * (d + 4) + c) = unpack(kreg[it].x, kreg[it].y);
                *(float4*)(vs + j * d + c) = unpack(vreg[it].x, vreg[it].y);
            }
        }
        __syncthreads();
        if (p0 + TILE < k1) fetch(p0 + TILE);
        for (int base = 0; base < n_scores * tpd; base += NT) {
            int i = (base + tid) / tpd, sub = (base + tid) % tpd;
            int gh = i / TILE, j = i - gh * TILE;
            float a = 0.0f;
            if (i < n_scores && j < n) {
                const float4* q = qs4 + gh * d4;
                const float4* kr = ks4 + j * kp4;
                for (int c = sub; c < d4; c += tpd) {
                    float4 x = q[c], y = kr[c];
                    a = fmaf(x.x, y.x, fmaf(x.y, y.y, fmaf(x.z, y.z, fmaf(x.w, y.w, a))));
                }
            }
            for (int o = tpd >> 1; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
            if (i < n_scores && sub == 0) sc[i] = j < n ? a * scale : -INFINITY;
        }
        __syncthreads();
        for (int gh = warp; gh < g; gh += NT / 32) {
            float s = sc[gh * TILE + lane];
            float mx = s;
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            float m_old = mst[gh];
            mx = fmaxf(mx, m_old);
            float p = lane < n ? expf(s - mx) : 0.0f;
            sc[gh * TILE + lane] = p;
            float sum = p;
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            __syncwarp();
            if (lane == 0) {
                float corr = expf(m_old - mx);
                mst[gh] = mx;
                lst[gh] = lst[gh] * corr + sum;
                cst[gh] = corr;
            }
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < MAXE / 4; k++) {
            int e = tid + k * NT;
            if (e < ne4) {
                int gh = e / d4, c = e - gh * d4;
                float cr = cst[gh];
                float4 a = acc[k];
                a.x *= cr; a.y *= cr; a.z *= cr; a.w *= cr;
                const float* p = sc + gh * TILE;
                for (int j = 0; j < n; j++) {
                    float pj = p[j];
                    float4 v = vs4[j * d4 + c];
                    a.x = fmaf(pj, v.x, a.x); a.y = fmaf(pj, v.y, a.y);
                    a.z = fmaf(pj, v.z, a.z); a.w = fmaf(pj, v.w, a.w);
                }
                acc[k] = a;
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int k = 0; k < MAXE / 4; k++) {
        int e = tid + k * NT;
        if (e < ne4) {
            int gh = e / d4, c = e - gh * d4;
            u64 b = ((u64)r * n_heads + kh * g + gh) * n_splits + sp;
            *(float4*)(part_acc + b * d + 4 * c) = acc[k];
        }
    }
    if (tid < g) {
        u64 b = ((u64)r * n_heads + kh * g + tid) * n_splits + sp;
        part_ml[2 * b] = mst[tid];
        part_ml[2 * b + 1] = lst[tid];
    }
}

extern "C" __global__ void __launch_bounds__(NT) attn_partial_64(ATTN_PARAMS) {
    extern __shared__ float sh[];
    attn_partial_impl<64>(sh, ATTN_ARGS);
}
extern "C" __global__ void __launch_bounds__(NT) attn_partial_128(ATTN_PARAMS) {
    extern __shared__ float sh[];
    attn_partial_impl<128>(sh, ATTN_ARGS);
}
extern "C" __global__ void __launch_bounds__(NT) attn_partial_256(ATTN_PARAMS) {
    extern __shared__ float sh[];
    attn_partial_impl<256>(sh, ATTN_ARGS);
}
extern "C" __global__ void __launch_bounds__(NT) attn_partial_any(ATTN_PARAMS) {
    extern __shared__ float sh[];
    attn_partial_impl<0>(sh, ATTN_ARGS);
}

// out[r, h*d + c] = sum_s w_s acc_s[c] / sum_s w_s l_s, w_s = exp(m_s - max m).
// grid = (rows, n_heads), blockDim >= 32.
extern "C" __global__ void attn_combine(const float* part_ml, const float* part_acc, float* out,
                                        int n_heads, int d, int n_splits)
{
    const u64 b = (u64)blockIdx.x * n_heads + blockIdx.y;
    float big_m = -INFINITY;
    for (int s = 0; s < n_splits; s++) big_m = fmaxf(big_m, part_ml[2 * (b * n_splits + s)]);
    float total = 0.0f;
    for (int s = 0; s < n_splits; s++) {
        float m = part_ml[2 * (b * n_splits + s)];
        if (m != -INFINITY) total += part_ml[2 * (b * n_splits + s) + 1] * expf(m - big_m);
    }
    float inv = total > 0.0f ? 1.0f / total : 0.0f;
    float* o = out + (u64)blockIdx.x * n_heads * d + (u64)blockIdx.y * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < n_splits; s++) {
            float m = part_ml[2 * (b * n_splits + s)];
            if (m != -INFINITY) a += expf(m - big_m) * part_acc[(b * n_splits + s) * d + c];
        }
        o[c] = a * inv;
    }
}
