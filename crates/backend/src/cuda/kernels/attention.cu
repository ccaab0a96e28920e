// Paged causal attention, flash-decoding style: every (query row, kv head, key split) block
// runs an online softmax over its key range for the `g = n_heads / n_kv` query heads that
// share the kv head and writes unnormalised partials (max, sum, acc); the last block of each
// (row, kv head) to finish merges the splits (`attn_merge_last`), so one launch does it all.
// Prefill rows and decode rows of many sequences of different lengths share one launch: each
// row finds its sequence, position and block table through the token metadata (see
// write_kv.cu). A row at position p sees keys 0..=p, or with a sliding window (`window` > 0,
// the 16-bit kernels' last parameter; 0: none) keys p-window+1..=p: each row's key range
// then starts at its window's first key, so keys before it are never read (a ring layer's
// table maps them to slots newer tokens have overwritten, see model/src/arch/ring.rs).
//
// Pool layout of each of K and V: `[num_blocks, kv_heads, block_size, head_dim]`.
#define TILE 32
#define NT 128
#define MAXE 16

// attn_partial_{64,128,256,any}: grid = (rows, n_kv, n_splits), block = NT threads; requires
// g * d <= NT * MAXE, d % 4 == 0, d <= 256.
// dynamic smem: max(floats g*d + TILE*(d+4) + TILE*d + g*TILE + 3*g, merge's g*(n_splits+1)).
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
    u16* k_cache, u16* v_cache, int block_size, int is_bf16, \
    int n_splits, float* __restrict__ part_ml, float* __restrict__ part_acc, \
    u32* __restrict__ counters, float* __restrict__ out, u16* __restrict__ out_bf16, int prefetch, \
    const float* __restrict__ sinks
#define ATTN_ARGS qkv, width, n_heads, n_kv, d_rt, scale, tok_pos, tok_seq, seq_tbl, tables, \
    k_cache, v_cache, block_size, is_bf16, n_splits, part_ml, part_acc, counters, out, out_bf16, \
    prefetch, sinks

// The first key a query at position `pos` sees: 0, or its sliding window's first key.
__device__ __forceinline__ int window_lo(int pos, int window) {
    return window > 0 ? max(0, pos + 1 - window) : 0;
}

// 16 bytes / 4 bytes from L2, bypassing L1: partials written by other blocks of the launch.
__device__ __forceinline__ float4 ld_cg4(const float* p) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 ld_cg_u4(const void* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ float2 ld_cg2(const float* p) {
    float2 v;
    asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p));
    return v;
}

// The split merge, fused into the attention launch. Called by every block after it stored its
// partials (and after its last use of `sh`): the block counts itself in `counters[r, kh]`;
// the last of the n_splits blocks of (row r, kv head kh) resets the counter to zero (so the
// buffer is ready for the next launch: CUDA graphs replay the same one) and writes, for the g
// query heads of kh, out = Σ_s w_s acc_s / Σ_s w_s l_s with w_s = exp(m_s - max m), and
// bf16(out) into out_bf16 (the output projection's input). With `sinks` (gpt-oss: a learned
// logit per query head, null for none) each head's denominator also holds exp(sink - max m):
// a softmax entry with no value. Saves a second launch and its
// ramp: at batch 1 the separate merge kernel cost a third of the attention time.
// smem: g * (2 * n_splits + 1) floats.
__device__ __forceinline__ void attn_merge_last(float* sh, int g, int d, int n_heads, int n_kv, int kh,
    int n_splits, u32* counters, const float* part_ml, const float* part_acc, float* out,
    u16* out_bf16, const float* sinks, u32 arrivals = 1)
{
    const int r = blockIdx.x, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    __threadfence();   // this block's partials reach L2 before the count says they are there
    __syncthreads();
    int last = 0;
    if (tid == 0) {
        u32* c = counters + (u64)r * n_kv + kh;
        last = atomicAdd(c, arrivals) == (u32)n_splits - arrivals;
        if (last) *c = 0u;
    }
    // (No static shared memory: the kernels opt into the whole dynamic limit.)
    if (!__syncthreads_or(last)) return;
    __threadfence();
    pdl_trigger();  // the output projection may start streaming its weights (measured: a
                    // trigger at the start of the attention cost 0.5 ms per llama3-8b step)
    // Every (m, l) of the g·n_splits partials in one round of loads, then the weights.
    float* w = sh;                      // [g][n_splits]: m, then the split weights
    float* lsh = sh + g * n_splits;     // [g][n_splits]: l
    float* inv = lsh + g * n_splits;    // [g]: 1 / Σ w l
    const float* ml = part_ml + 2 * ((u64)r * n_heads + kh * g) * n_splits;
    for (int i = tid; i < g * n_splits; i += blockDim.x) {
        const float2 v = ld_cg2(ml + 2 * i);
        w[i] = v.x;
        lsh[i] = v.y;
    }
    __syncthreads();
    for (int h = warp; h < g; h += blockDim.x >> 5) {
        float* wh = w + h * n_splits;
        float mx = -INFINITY;
        for (int s = lane; s < n_splits; s += 32) mx = fmaxf(mx, wh[s]);
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float tot = 0.0f;
        for (int s = lane; s < n_splits; s += 32) {
            const float m = wh[s];
            const float ws = m == -INFINITY ? 0.0f : expf(m - mx);
            wh[s] = ws;
            tot = fmaf(ws, lsh[h * n_splits + s], tot);
        }
        for (int o = 16; o > 0; o >>= 1) tot += __shfl_xor_sync(0xffffffffu, tot, o);
        if (sinks) tot += expf(sinks[kh * g + h] - mx);
        if (lane == 0) inv[h] = tot > 0.0f ? 1.0f / tot : 0.0f;
    }
    __syncthreads();
    const int d4 = d >> 2;
    for (int e = tid; e < g * d4; e += blockDim.x) {
        const int h = e / d4, c = e - h * d4;
        const float* acc = part_acc + ((u64)r * n_heads + kh * g + h) * n_splits * d + 4 * c;
        const float* wh = w + h * n_splits;
        // Up to 16 independent 16-byte loads in flight: the partials come from L2.
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        auto add = [&](float x, float4 v) {
            a.x = fmaf(x, v.x, a.x); a.y = fmaf(x, v.y, a.y);
            a.z = fmaf(x, v.z, a.z); a.w = fmaf(x, v.w, a.w);
        };
        int s = 0;
        for (; s + 16 <= n_splits; s += 16) {
            float4 v[16];
#pragma unroll
            for (int j = 0; j < 16; j++) v[j] = ld_cg4(acc + (u64)(s + j) * d);
#pragma unroll
            for (int j = 0; j < 16; j++) add(wh[s + j], v[j]);
        }
        for (; s + 4 <= n_splits; s += 4) {
            float4 v[4];
#pragma unroll
            for (int j = 0; j < 4; j++) v[j] = ld_cg4(acc + (u64)(s + j) * d);
#pragma unroll
            for (int j = 0; j < 4; j++) add(wh[s + j], v[j]);
        }
        for (; s < n_splits; s++) add(wh[s], ld_cg4(acc + (u64)s * d));
        const float iv = inv[h];
        const float4 o = make_float4(a.x * iv, a.y * iv, a.z * iv, a.w * iv);
        const u64 at = (u64)r * n_heads * d + (u64)(kh * g + h) * d + 4 * c;
        *(float4*)(out + at) = o;
        const u32 lo = (u32)f32_to_bf16(o.x) | ((u32)f32_to_bf16(o.y) << 16);
        const u32 hi = (u32)f32_to_bf16(o.z) | ((u32)f32_to_bf16(o.w) << 16);
        *(uint2*)(out_bf16 + at) = make_uint2(lo, hi);
    }
}

// The partial of split `sp` for the g query heads of (row r, kv head kh), from NP states in
// shared memory, state i at sh + i·hs·(D + 2): m[hs], l[hs], acc[hs][D] (log2 units; hs ≥ g
// heads per state). Merges them as the split's own online softmax would have, then stores
// max (natural log), sum and the unnormalised acc for `attn_merge_last`.
template <int D, int NP>
__device__ __forceinline__ void store_split_partial(const float* sh, int hs, int g, int r, int kh,
    int sp, int n_heads, int n_splits, float* part_ml, float* part_acc, int tid, int nth)
{
    for (int e = tid; e < g * D; e += nth) {
        const int h = e / D, c = e - h * D;
        float mx = -1e30f;
#pragma unroll
        for (int i = 0; i < NP; i++) mx = fmaxf(mx, sh[(u64)i * hs * (D + 2) + h]);
        float lt = 0.0f, at = 0.0f;
#pragma unroll
        for (int i = 0; i < NP; i++) {
            const float* st = sh + (u64)i * hs * (D + 2);
            const float wt = exp2f(st[h] - mx);
            lt = fmaf(st[hs + h], wt, lt);
            at = fmaf(st[2 * hs + h * D + c], wt, at);
        }
        const u64 b = ((u64)r * n_heads + kh * g + h) * n_splits + sp;
        part_acc[b * D + c] = at;
        if (c == 0) {
            part_ml[2 * b] = lt > 0.0f ? mx * 0.6931471805599453f : -INFINITY;
            part_ml[2 * b + 1] = lt;
        }
    }
}

// D > 0: head_dim fixed at compile time (fewer registers for the prefetch); D == 0: any d.
template <int D>
__device__ __forceinline__ void attn_partial_impl(float* sh, ATTN_PARAMS, int window)
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

    pdl_wait();  // (never launched as a dependent; kept correct if it is)
    const u32 pos = tok_pos[r];
    const int kend = (int)pos + 1;
    const int lo = window_lo((int)pos, window);
    // Each row splits its own key range into n_splits chunks of whole tiles (so the launch
    // does not depend on the step's lengths: CUDA graphs replay it as positions advance).
    const int chunk = ((kend - lo + n_splits - 1) / n_splits + TILE - 1) / TILE * TILE;
    const int k0 = lo + sp * chunk;
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
    attn_merge_last(sh, g, d, n_heads, n_kv, kh, n_splits, counters, part_ml, part_acc, out, out_bf16, sinks);
}

extern "C" __global__ void __launch_bounds__(NT) attn_partial_64(ATTN_PARAMS, int window) {
    extern __shared__ float sh[];
    attn_partial_impl<64>(sh, ATTN_ARGS, window);
}
extern "C" __global__ void __launch_bounds__(NT) attn_partial_128(ATTN_PARAMS, int window) {
    extern __shared__ float sh[];
    attn_partial_impl<128>(sh, ATTN_ARGS, window);
}
extern "C" __global__ void __launch_bounds__(NT) attn_partial_256(ATTN_PARAMS, int window) {
    extern __shared__ float sh[];
    attn_partial_impl<256>(sh, ATTN_ARGS, window);
}
extern "C" __global__ void __launch_bounds__(NT) attn_partial_any(ATTN_PARAMS, int window) {
    extern __shared__ float sh[];
    attn_partial_impl<0>(sh, ATTN_ARGS, window);
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}
// 16-byte global->shared copy, bypassing L1; `bytes` 0 zero-fills the destination.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

// The paged rows of one kv head in the K and V pools (`[num_blocks, kv_heads, block_size,
// head_dim]`): position p lives in physical block tbl[p / block_size] at slot
// p % block_size, mapped with shifts for power-of-two block sizes (the usual 16).
struct PagedKv {
    const u32* tbl;
    int n_kv, kh, block_size, bs_log;
    bool bs_pow2;
    __device__ __forceinline__ PagedKv(const u32* t, int nkv, int h, int bs)
        : tbl(t), n_kv(nkv), kh(h), block_size(bs), bs_log(0) {
        while ((1 << bs_log) < block_size) bs_log++;
        bs_pow2 = (1 << bs_log) == block_size;
    }
    // Element offset of position p's row of d values (the same in both pools).
    __device__ __forceinline__ u64 row(int p, int d) const {
        const int lb = bs_pow2 ? p >> bs_log : p / block_size;
        const int slot = p - lb * block_size;
        return (((u64)tbl[lb] * n_kv + kh) * block_size + slot) * d;
    }
    // Index of the (physical block, kv head) block that holds position p, and p's slot in it
    // (byte pools of coded formats: one block of every token's codes, then their scales).
    __device__ __forceinline__ u64 head_block(int p, int& slot) const {
        const int lb = bs_pow2 ? p >> bs_log : p / block_size;
        slot = p - lb * block_size;
        return (u64)tbl[lb] * n_kv + kh;
    }
};

// Requests (cp.async, 16-byte chunks, NTH threads) the K and V rows of positions
// t0 .. t0+TK-1 into shared memory, chunk c of tile row j at byte dst(j, c) of ks and vs:
// zeros from k1 on, nothing for position `skip` (its row is filled later, after the PDL wait).
// Every chunk's source offset is computed first (the block-table reads issued together), then
// the copies, so no copy waits on its own table read. The caller commits the group.
// `kv` maps a position to its row (`row(p, d)`): PagedKv, or the coded prefill's scratch and
// exact blocks (ScratchRows, ExactRows).
template <int D, int TK, int NTH, class Dst, class Rows>
__device__ __forceinline__ void stage_rows(unsigned char* ks, unsigned char* vs, int t0, int k1,
    int skip, const Rows& kv, const u16* k_cache, const u16* v_cache, int tid, Dst dst)
{
    constexpr int CH = D / 8, N = (TK * CH + NTH - 1) / NTH;
    u64 off[N];
    int bytes[N];
#pragma unroll
    for (int n = 0; n < N; n++) {
        const int i = tid + n * NTH, j = i / CH, c = i - j * CH, p = t0 + j;
        const bool live = i < TK * CH && p < k1;
        off[n] = live ? kv.row(p, D) + c * 8 : 0;
        bytes[n] = i < TK * CH && p != skip ? (live ? 16 : 0) : -1;
    }
#pragma unroll
    for (int n = 0; n < N; n++) {
        if (bytes[n] < 0) continue;
        const int i = tid + n * NTH, j = i / CH, c = i - j * CH;
        const int at = dst(j, c);
        cp_async16(smem_addr(ks + at), k_cache + off[n], bytes[n]);
        cp_async16(smem_addr(vs + at), v_cache + off[n], bytes[n]);
    }
}

// stage_rows into rows of RS halves at ks and vs (row-major, no swizzle).
template <int D, int TK, int RS, int NTH = NT, class Rows = PagedKv>
__device__ __forceinline__ void stage_kv_tile(u16* ks, u16* vs, int t0, int k1, int skip,
    const Rows& kv, const u16* k_cache, const u16* v_cache, int tid)
{
    stage_rows<D, TK, NTH>((unsigned char*)ks, (unsigned char*)vs, t0, k1, skip, kv, k_cache,
                           v_cache, tid, [](int j, int c) { return (j * RS + c * 8) * 2; });
}

// Copies position p's K and V rows into shared rows at ks and vs with L2 loads (the row was
// written by the kernel ahead, after `griddepcontrol.wait`).
template <int D, int NTH = NT>
__device__ __forceinline__ void copy_kv_row(u16* ks, u16* vs, int p, const PagedKv& kv,
    const u16* k_cache, const u16* v_cache, int tid)
{
    const u64 off = kv.row(p, D);
    for (int c = tid; c < D / 8; c += NTH) {
        *(uint4*)(ks + c * 8) = ld_cg_u4(k_cache + off + c * 8);
        *(uint4*)(vs + c * 8) = ld_cg_u4(v_cache + off + c * 8);
    }
}

// Paged attention, one query row per block: grid = (rows, n_kv, n_splits), NT threads
// (4 warps). Tiles of TILE keys of K and V are streamed into shared memory with cp.async,
// STAGES - 1 tiles in flight, so loads never wait for the math (3 stages; 5 for splits of
// at most 4 tiles, which then load everything up front: decode of one or two sequences).
// `prefetch` (a decode launch, one new row per sequence, launched as a programmatic
// dependent of the kernel that produces its input): the first tiles are requested before
// `griddepcontrol.wait`, so the cache streams in while that kernel finishes; the newest key
// (the one written this step) is never fetched with the others but put into its stage row
// after the wait, and q is read after the wait.
// In a tile, warp w takes keys
// 8w .. 8w+7; a group of LPK = D/DPL lanes owns one key at a time and DPL of its dims
// (chunks of 8 dims interleaved across the group, so shared reads are conflict-free); a
// warp covers KPW = 32/LPK keys per pass, U = 8/KPW passes per tile. Every lane keeps the
// online-softmax state (log2 units) of the g <= MAXG query heads of its kv head for its
// dims, rescaled once per tile; the NW*KPW partial states are merged through shared
// memory at the end.
// dynamic smem: max(STAGES*2*TILE*D halves, NW*KPW*g*(D+2)
// floats, merge's g*(2*n_splits+1) floats).
// Requires 16-bit KV, d == D, g <= MAXG.
template <int D, int MAXG, int DPL, bool BF16, int STAGES>
__device__ __forceinline__ void attn_rows_impl(float* sh, ATTN_PARAMS, int window)
{
    constexpr int LPK = D / DPL, KPW = 32 / LPK, NW = NT / 32, NP = NW * KPW;
    constexpr int LD = DPL / 8, U = 8 / KPW;
    static_assert(NW * KPW * U == TILE, "a tile is one pass of every warp");
    const int g = n_heads / n_kv;
    const int r = blockIdx.x, kh = blockIdx.y, sp = blockIdx.z, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, sub = lane % LPK, kslot = lane / LPK;
    const u32 pos = tok_pos[r];
    const int kend = (int)pos + 1;
    const int lo = window_lo((int)pos, window);
    const int chunk = ((kend - lo + n_splits - 1) / n_splits + TILE - 1) / TILE * TILE;
    const int k0 = lo + sp * chunk;
    const int k1 = min(k0 + chunk, kend);
    const int ntiles = k1 > k0 ? (k1 - k0 + TILE - 1) / TILE : 0;
    const PagedKv kv(tables + seq_tbl[tok_seq[r]], n_kv, kh, block_size);
    u16* stage = (u16*)sh;   // [STAGES][2][TILE][D]
    const float qs = scale * 1.4426950408889634f;
    // The newest key is left out of the fetches when the kernel ahead is writing it
    // (`fill_newest` puts it into its stage row).
    const bool skip_newest = prefetch;
    auto issue = [&](int t, bool early) {
        if (t < ntiles) {
            u16* ks = stage + (u64)(t % STAGES) * 2 * TILE * D;
            stage_kv_tile<D, TILE, D>(ks, ks + TILE * D, k0 + t * TILE, k1, early ? (int)pos : -1,
                                      kv, k_cache, v_cache, tid);
        }
        cp_async_commit();
    };
    auto el = [&](const uint4* w, int i) -> float {
        const uint4 x = w[i >> 3];
        const int k = (i & 7) >> 1;
        const u32 word = k == 0 ? x.x : k == 1 ? x.y : k == 2 ? x.z : x.w;
        if constexpr (BF16) return __uint_as_float((i & 1) ? (word & 0xffff0000u) : (word << 16));
        else return f16_to_f32((u16)((i & 1) ? (word >> 16) : (word & 0xffffu)));
    };
    const bool holds_newest = (int)pos >= k0 && (int)pos < k1;
    const int tn = ((int)pos - k0) / TILE;   // the tile of the newest key (if held)
    // Writes the newest key's K and V into the stage row of tile t (if t holds it).
    auto fill_newest = [&](int t) {
        if (!skip_newest || !holds_newest || t != tn || t >= ntiles) return;
        u16* ks = stage + (u64)(t % STAGES) * 2 * TILE * D + ((int)pos - k0 - t * TILE) * D;
        copy_kv_row<D>(ks, ks + TILE * D, (int)pos, kv, k_cache, v_cache, tid);
    };
    if (!prefetch) pdl_wait();
#pragma unroll
    for (int t = 0; t < STAGES - 1; t++) issue(t, skip_newest);
    if (prefetch) pdl_wait();   // the kernel ahead is complete and its writes visible
#pragma unroll
    for (int t = 0; t < STAGES - 1; t++) fill_newest(t);
    float q[MAXG][DPL], acc[MAXG][DPL], m[MAXG], l[MAXG];
    const float* qrow = qkv + (u64)r * width + (u64)kh * g * D;
#pragma unroll
    for (int h = 0; h < MAXG; h++) {
#pragma unroll
        for (int j = 0; j < LD; j++) {
#pragma unroll
            for (int k = 0; k < 2; k++) {
                float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
                if (h < g) a = *(const float4*)(qrow + h * D + (j * LPK + sub) * 8 + 4 * k);
                q[h][8 * j + 4 * k] = a.x * qs; q[h][8 * j + 4 * k + 1] = a.y * qs;
                q[h][8 * j + 4 * k + 2] = a.z * qs; q[h][8 * j + 4 * k + 3] = a.w * qs;
            }
        }
        m[h] = -1e30f; l[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[h][i] = 0.0f;
    }
    for (int t = 0; t < ntiles; t++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();          // tile t landed for all; tile t-1's stage is free
        issue(t + STAGES - 1, skip_newest);
        fill_newest(t + STAGES - 1);
        const int t0 = k0 + t * TILE;
        const u16* ks = stage + (u64)(t % STAGES) * 2 * TILE * D;
        const u16* vs = ks + TILE * D;
        float s[U][MAXG];
        bool ok[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int j = warp * 8 + u * KPW + kslot;
            ok[u] = t0 + j < k1;
            uint4 kr[LD];
#pragma unroll
            for (int jj = 0; jj < LD; jj++) kr[jj] = *(const uint4*)(ks + j * D + (jj * LPK + sub) * 8);
#pragma unroll
            for (int h = 0; h < MAXG; h++) s[u][h] = 0.0f;
#pragma unroll
            for (int i = 0; i < DPL; i++) {
                const float kf = el(kr, i);
#pragma unroll
                for (int h = 0; h < MAXG; h++) s[u][h] = fmaf(q[h][i], kf, s[u][h]);
            }
#pragma unroll
            for (int h = 0; h < MAXG; h++) {
#pragma unroll
                for (int o = LPK / 2; o > 0; o >>= 1) s[u][h] += __shfl_xor_sync(0xffffffffu, s[u][h], o);
                if (!ok[u]) s[u][h] = -INFINITY;
            }
        }
#pragma unroll
        for (int h = 0; h < MAXG; h++) {
            if (h < g) {
                float mn = m[h];
#pragma unroll
                for (int u = 0; u < U; u++) mn = fmaxf(mn, s[u][h]);
                const float c = exp2f(m[h] - mn);
                l[h] *= c;
#pragma unroll
                for (int i = 0; i < DPL; i++) acc[h][i] *= c;
                m[h] = mn;
#pragma unroll
                for (int u = 0; u < U; u++) s[u][h] = exp2f(s[u][h] - mn);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int j = warp * 8 + u * KPW + kslot;
            uint4 vr[LD];
#pragma unroll
            for (int jj = 0; jj < LD; jj++) vr[jj] = *(const uint4*)(vs + j * D + (jj * LPK + sub) * 8);
#pragma unroll
            for (int i = 0; i < DPL; i++) {
                const float vf = el(vr, i);
#pragma unroll
                for (int h = 0; h < MAXG; h++) {
                    if (h < g) acc[h][i] = fmaf(s[u][h], vf, acc[h][i]);
                }
            }
#pragma unroll
            for (int h = 0; h < MAXG; h++) {
                if (h < g) l[h] += s[u][h];
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();              // stages are reused for the partial states
    // Merge the NP partial states: layout per partial: m[g], l[g], acc[g][D].
    const int pidx = warp * KPW + kslot;
    float* part = sh + (u64)pidx * g * (D + 2);
#pragma unroll
    for (int h = 0; h < MAXG; h++) {
        if (h < g) {
            if (sub == 0) { part[h] = m[h]; part[g + h] = l[h]; }
#pragma unroll
            for (int j = 0; j < LD; j++) {
                float* a = part + 2 * g + h * D + (j * LPK + sub) * 8;
#pragma unroll
                for (int i = 0; i < 8; i++) a[i] = acc[h][8 * j + i];
            }
        }
    }
    __syncthreads();
    store_split_partial<D, NP>(sh, g, g, r, kh, sp, n_heads, n_splits, part_ml, part_acc, tid, NT);
    attn_merge_last(sh, g, D, n_heads, n_kv, kh, n_splits, counters, part_ml, part_acc, out, out_bf16, sinks);
}

#define ATTN_ROWS_STAGES(NAME, D, G, DPL, STAGES) \
    extern "C" __global__ void __launch_bounds__(NT) NAME(ATTN_PARAMS, int window) { \
        extern __shared__ float sh[]; \
        if (is_bf16) attn_rows_impl<D, G, DPL, true, STAGES>(sh, ATTN_ARGS, window); \
        else attn_rows_impl<D, G, DPL, false, STAGES>(sh, ATTN_ARGS, window); \
    }
#define ATTN_ROWS(D, G, DPL) \
    ATTN_ROWS_STAGES(attn_rows_##D##_##G, D, G, DPL, 3) \
    ATTN_ROWS_STAGES(attn_rows_##D##_##G##_deep, D, G, DPL, 5)
ATTN_ROWS(64, 4, 16)
ATTN_ROWS(64, 8, 8)
ATTN_ROWS(128, 4, 16)
ATTN_ROWS(128, 8, 8)
ATTN_ROWS(256, 4, 16)
ATTN_ROWS(256, 8, 8)

// ---- Tensor-core attention for prefill tiles (bf16 KV) ----------------------------------
// D = m16n8k16 with bf16 inputs and f32 accumulate: c += a·b.
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two floats as bf16x2, `lo` in the low half.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
__device__ __forceinline__ void ldmatrix_x2_trans(u32& r0, u32& r1, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r0), "=r"(r1) : "r"(addr));
}

// m16n8k16 with f16 inputs and f32 accumulate: c += a·b.
__device__ __forceinline__ void mma_f16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two floats as f16x2, `lo` in the low half.
__device__ __forceinline__ u32 pack_f16(float lo, float hi) {
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
template <bool BF16> __device__ __forceinline__ u32 pack16(float lo, float hi) {
    return BF16 ? pack_bf16(lo, hi) : pack_f16(lo, hi);
}
template <bool BF16> __device__ __forceinline__ void mma16(float* c, const u32* a, u32 b0, u32 b1) {
    if (BF16) mma_bf16(c, a, b0, b1);
    else mma_f16(c, a, b0, b1);
}


// One warp's 16 query vectors in tensor-core flash attention: MMA rows lane/4 and lane/4 + 8
// of each lane quad. Queries are held as A fragments (pre-scaled, in the KV cache's 16-bit
// type), the output as D/8 C fragments, the online softmax in log2 units. K and V tiles are
// read from shared memory rows of D + 8 halves (conflict-free fragment reads). A tile of
// 8·NK keys: `scores` (S = Q·Kᵀ), the caller masks S with -inf, `softmax` (rescale, P as A
// fragments), `accumulate` (O += P·V, V by ldmatrix.trans).
template <int D, bool BF16>
struct MmaRows {
    static constexpr int KS = D / 16, NTD = D / 8, RS = D + 8;
    u32 qa[KS][4];
    float o[NTD][4];
    float m0, m1, l0, l1;

    // q0 / q1: the f32 query vectors of this lane's two rows (null: a zero row); qs: the
    // score scale (scale·log2 e).
    __device__ __forceinline__ void init(const float* q0, const float* q1, float qs, int lane) {
#pragma unroll
        for (int kk = 0; kk < KS; kk++) {
            const int c = kk * 16 + (lane & 3) * 2;
            float2 x00 = make_float2(0.f, 0.f), x01 = x00, x10 = x00, x11 = x00;
            if (q0) { x00 = *(const float2*)(q0 + c); x01 = *(const float2*)(q0 + c + 8); }
            if (q1) { x10 = *(const float2*)(q1 + c); x11 = *(const float2*)(q1 + c + 8); }
            qa[kk][0] = pack16<BF16>(x00.x * qs, x00.y * qs);
            qa[kk][1] = pack16<BF16>(x10.x * qs, x10.y * qs);
            qa[kk][2] = pack16<BF16>(x01.x * qs, x01.y * qs);
            qa[kk][3] = pack16<BF16>(x11.x * qs, x11.y * qs);
        }
#pragma unroll
        for (int nd = 0; nd < NTD; nd++) { o[nd][0] = 0.f; o[nd][1] = 0.f; o[nd][2] = 0.f; o[nd][3] = 0.f; }
        m0 = -1e30f; m1 = -1e30f; l0 = 0.f; l1 = 0.f;
    }

    // s[nt] = the scores of keys 8nt .. 8nt+7 of the K rows at `ks`: s[nt][e] for row lane/4
    // and key 8nt + 2(lane % 4) + e, s[nt][2 + e] for row lane/4 + 8.
    template <int NK>
    __device__ __forceinline__ void scores(float (&s)[NK][4], const u16* ks, int lane) const {
#pragma unroll
        for (int nt = 0; nt < NK; nt++) {
            s[nt][0] = 0.f; s[nt][1] = 0.f; s[nt][2] = 0.f; s[nt][3] = 0.f;
            const u16* kp = ks + (nt * 8 + (lane >> 2)) * RS + (lane & 3) * 2;
#pragma unroll
            for (int kk = 0; kk < KS; kk++) {
                const u32 b0 = *(const u32*)(kp + kk * 16), b1 = *(const u32*)(kp + kk * 16 + 8);
                mma16<BF16>(s[nt], qa[kk], b0, b1);
            }
        }
    }

    // The online-softmax update by the (masked) scores; pa: their weights as A fragments of
    // NK / 2 16-key steps.
    template <int NK>
    __device__ __forceinline__ void softmax(const float (&s)[NK][4], u32 (&pa)[NK / 2][4]) {
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int nt = 0; nt < NK; nt++) {
            mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
            mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float c0 = exp2f(m0 - mx0), c1 = exp2f(m1 - mx1);
        m0 = mx0; m1 = mx1;
        l0 *= c0; l1 *= c1;
#pragma unroll
        for (int nd = 0; nd < NTD; nd++) { o[nd][0] *= c0; o[nd][1] *= c0; o[nd][2] *= c1; o[nd][3] *= c1; }
#pragma unroll
        for (int nt = 0; nt < NK; nt++) {
            const float e0 = exp2f(s[nt][0] - m0), e1 = exp2f(s[nt][1] - m0);
            const float e2 = exp2f(s[nt][2] - m1), e3 = exp2f(s[nt][3] - m1);
            l0 += e0 + e1;
            l1 += e2 + e3;
            pa[nt >> 1][(nt & 1) * 2] = pack16<BF16>(e0, e1);
            pa[nt >> 1][(nt & 1) * 2 + 1] = pack16<BF16>(e2, e3);
        }
    }

    // O += P·V over the V rows at `vs` (NK / 2 steps of 16 keys).
    template <int NK>
    __device__ __forceinline__ void accumulate(const u32 (&pa)[NK / 2][4], const u16* vs, int lane) {
#pragma unroll
        for (int ks = 0; ks < NK / 2; ks++) {
            const u16* vp = vs + (ks * 16 + (lane & 15)) * RS;
#pragma unroll
            for (int nd = 0; nd < NTD; nd++) {
                u32 b0, b1;
                ldmatrix_x2_trans(b0, b1, smem_addr(vp + nd * 8));
                mma16<BF16>(o[nd], pa[ks], b0, b1);
            }
        }
    }

    // Sums each row's l over its lane quad (once, after the last tile).
    __device__ __forceinline__ void reduce_l() {
        l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
        l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    }
};

#define MMA_TK 32
// One block per (tile of consecutive query rows of one sequence, kv head): the tile's
// 16·NW query vectors (16·NW/g rows × the g query heads of the kv head; vector v = row·g +
// head) are split over NW warps, 16 each, held as MMA fragments in the cache's 16-bit type (bf16 or
// f16; pre-scaled by scale·log2 e). K/V tiles of MMA_TK keys stream through shared memory (2 stages, cp.async,
// rows padded to D + 8 halves so fragment reads are conflict-free); per tile each warp
// computes S = Q·Kᵀ (m16n8k16 MMAs), masks causally, updates its online softmax (rows live
// in lane quads), and accumulates O += P·V with P re-packed as A fragments and V read
// by ldmatrix.trans (see `MmaRows`). Writes the normalised rows straight to `out` (and their bf16 copy).
// More warps per block share each K/V tile among more query vectors (fewer L2 reads per FLOP).
// tiles[2i] = first row, tiles[2i+1] = rows (≤ 16·NW/g). grid = (tiles, n_kv), 32·NW threads.
// A sliding window (`window` > 0): the key tiles start at the first row's first key (the
// earliest any row of the tile sees), and each row masks the keys before its own. `sinks`
// (null: none): a logit per query head that joins each row's denominator.
// dynamic smem: 2 * 2 * MMA_TK * (D + 8) halves. Requires 16·NW % g == 0.
template <int D, bool BF16, int NW>
__device__ __forceinline__ void attn_mma_impl(u16* sh,
    const float* __restrict__ qkv, int width, int n_heads, int n_kv, float scale,
    const u32* __restrict__ tok_pos, const u32* __restrict__ tok_seq, const u32* __restrict__ seq_tbl,
    const u32* __restrict__ tables, const u16* __restrict__ k_cache, const u16* __restrict__ v_cache,
    int block_size, const u32* __restrict__ tiles, float* __restrict__ out, u16* __restrict__ out_bf16,
    int window, const float* __restrict__ sinks)
{
    constexpr int NTD = D / 8, RS = D + 8;
    const int g = n_heads / n_kv;
    const int kh = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 first_row = tiles[2 * blockIdx.x], n_rows = tiles[2 * blockIdx.x + 1];
    const int pos0 = (int)tok_pos[first_row];
    const PagedKv kv(tables + seq_tbl[tok_seq[first_row]], n_kv, kh, block_size);
    const int kmax = pos0 + (int)n_rows;
    const int klo = window_lo(pos0, window);
    const int ntiles = (kmax - klo + MMA_TK - 1) / MMA_TK;
    const int v0 = 16 * warp + (lane >> 2), v1 = v0 + 8;
    const int r0 = v0 / g, h0 = v0 - r0 * g, r1 = v1 / g, h1 = v1 - r1 * g;
    const bool ok0 = r0 < (int)n_rows, ok1 = r1 < (int)n_rows;
    // Each row's last and first keys relative to the first staged key `klo` (the first is
    // never above the row's own position, and ≤ 0 without a window).
    const int p0 = pos0 + r0 - klo, p1 = pos0 + r1 - klo;
    const int lo0 = window > 0 ? p0 + 1 - window : 0, lo1 = window > 0 ? p1 + 1 - window : 0;
    const float qs = scale * 1.4426950408889634f;
    MmaRows<D, BF16> w;
    w.init(ok0 ? qkv + (u64)(first_row + r0) * width + (u64)(kh * g + h0) * D : nullptr,
           ok1 ? qkv + (u64)(first_row + r1) * width + (u64)(kh * g + h1) * D : nullptr, qs, lane);
    auto issue = [&](int t) {
        if (t < ntiles) {
            u16* kst = sh + (t & 1) * 2 * MMA_TK * RS;
            stage_kv_tile<D, MMA_TK, RS, 32 * NW>(kst, kst + MMA_TK * RS, klo + t * MMA_TK, kmax, -1,
                                                  kv, k_cache, v_cache, tid);
        }
        cp_async_commit();
    };
    issue(0);
    for (int t = 0; t < ntiles; t++) {
        issue(t + 1);
        cp_async_wait<1>();
        __syncthreads();
        const u16* kst = sh + (t & 1) * 2 * MMA_TK * RS;
        const u16* vst = kst + MMA_TK * RS;
        float s[4][4];
        w.template scores<4>(s, kst, lane);
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int key = t * MMA_TK + nt * 8 + (lane & 3) * 2 + e;
                if (!ok0 || key > p0 || key < lo0) s[nt][e] = -INFINITY;
                if (!ok1 || key > p1 || key < lo1) s[nt][2 + e] = -INFINITY;
            }
        }
        u32 pa[2][4];
        w.template softmax<4>(s, pa);
        w.template accumulate<4>(pa, vst, lane);
        __syncthreads();
    }
    cp_async_wait<0>();
    w.reduce_l();
    if (sinks) {   // the sink's softmax term, in the scores' log2 units
        if (ok0) w.l0 += exp2f(sinks[kh * g + h0] * 1.4426950408889634f - w.m0);
        if (ok1) w.l1 += exp2f(sinks[kh * g + h1] * 1.4426950408889634f - w.m1);
    }
    const float i0 = w.l0 > 0.f ? 1.0f / w.l0 : 0.f, i1 = w.l1 > 0.f ? 1.0f / w.l1 : 0.f;
    const u64 ow = (u64)n_heads * D;
#pragma unroll
    for (int nd = 0; nd < NTD; nd++) {
        const int dim = nd * 8 + (lane & 3) * 2;
        if (ok0) {
            const u64 at = (u64)(first_row + r0) * ow + (u64)(kh * g + h0) * D + dim;
            const float a = w.o[nd][0] * i0, b = w.o[nd][1] * i0;
            *(float2*)(out + at) = make_float2(a, b);
            *(u32*)(out_bf16 + at) = pack_bf16(a, b);
        }
        if (ok1) {
            const u64 at = (u64)(first_row + r1) * ow + (u64)(kh * g + h1) * D + dim;
            const float a = w.o[nd][2] * i1, b = w.o[nd][3] * i1;
            *(float2*)(out + at) = make_float2(a, b);
            *(u32*)(out_bf16 + at) = pack_bf16(a, b);
        }
    }
}

// attn_mma_{D} (4 warps, 64 query vectors) and attn_mma8_{D} (8 warps, 128).
#define ATTN_MMA(NAME, D, NW) \
    extern "C" __global__ void __launch_bounds__(32 * NW) NAME( \
        const float* qkv, int width, int n_heads, int n_kv, float scale, const u32* tok_pos, \
        const u32* tok_seq, const u32* seq_tbl, const u32* tables, const u16* k_cache, \
        const u16* v_cache, int block_size, const u32* tiles, float* out, u16* out_bf16, \
        int is_bf16, int window, const float* sinks) { \
        extern __shared__ float shf[]; \
        if (is_bf16) \
            attn_mma_impl<D, true, NW>((u16*)shf, qkv, width, n_heads, n_kv, scale, tok_pos, \
                tok_seq, seq_tbl, tables, k_cache, v_cache, block_size, tiles, out, out_bf16, \
                window, sinks); \
        else \
            attn_mma_impl<D, false, NW>((u16*)shf, qkv, width, n_heads, n_kv, scale, tok_pos, \
                tok_seq, seq_tbl, tables, k_cache, v_cache, block_size, tiles, out, out_bf16, \
                window, sinks); \
    }
ATTN_MMA(attn_mma_64, 64, 4)
ATTN_MMA(attn_mma_128, 128, 4)
ATTN_MMA(attn_mma8_64, 64, 8)
ATTN_MMA(attn_mma8_128, 128, 8)

// ---- The exact split of a windowed coded pool ------------------------------------------
// A coded pool with a full-precision window (cuda/exact.rs) keeps f16 copies of each query's
// sinks (keys 0 .. sinks-1) and recent keys (the last `recent`, the query's own included) in
// exact blocks, in the basis the codes are read in (with a sliding window, those before its
// first key masked, as the codes before it are). The coded kernels then run
// `exact_splits` splits more: the first ones read the codes of keys sinks .. kend-recent-1,
// the last ones (`attn_exact_split`) the exact keys, 64 each; the fused merge treats them as
// any other split. The copies are f16 rows, or int8 rows with a step each (`q8`; codec.cuh
// `exact_q8_row`): the decode splits read those as bytes, the prefill tiles widen them to f16
// as they are staged.
struct ExactArgs {
    const u16* k;      // exact K blocks, [slot, n_kv, block_size, D] f16 (null: no window)
    const u16* v;
    const u32* tbl;    // the step's exact table
    int sinks, recent;
    int q8;            // int8 copies
    int per_split;     // exact keys a split, a multiple of EXACT_CHUNK (CudaOptions::exact_split_keys)
};

// Stages 8 values (16 bytes of f16) of exact row t (a position in exact block `slot`) of K and V
// at piece `piece` of the row into shared memory at ks / vs: cp.async of f16 copies, or int8
// copies loaded and widened (the caller commits and waits either way).
template <int D>
__device__ __forceinline__ void stage_exact_piece(const ExactArgs& x, int slot, int n_kv, int kh,
    int block_size, int t, int piece, void* ks, void* vs)
{
    if (!x.q8) {
        const u64 at = (((u64)slot * n_kv + kh) * block_size + t) * D + piece * 8;
        cp_async16(smem_addr(ks), x.k + at, 16);
        cp_async16(smem_addr(vs), x.v + at, 16);
        return;
    }
    const ExactQ8Row kr = exact_q8_row(x.k, slot, n_kv, kh, block_size, t, D);
    const ExactQ8Row vr = exact_q8_row(x.v, slot, n_kv, kh, block_size, t, D);
    *(uint4*)ks = widen_q8(*(const uint2*)(kr.codes + piece * 8), f16_to_f32(*kr.step));
    *(uint4*)vs = widen_q8(*(const uint2*)(vr.codes + piece * 8), f16_to_f32(*vr.step));
}

// The exact keys (sinks, then the recent window) are split into runs of `x.per_split`, one
// split each, read in chunks of EXACT_CHUNK keys (one chunk a split by default, so that a long
// window is read by many blocks); `attention.rs` sizes the grid with the same count.
constexpr int EXACT_CHUNK = 64;
__device__ __forceinline__ int exact_splits(const ExactArgs& x) {
    return x.tbl ? (x.sinks + x.recent + x.per_split - 1) / x.per_split : 0;
}

// The coded keys of a query whose keys are 0 .. kend-1: [lo, hi).
struct CodedRange { int lo, hi; };
__device__ __forceinline__ CodedRange coded_range(const ExactArgs& x, int kend) {
    if (!x.tbl) return {0, kend};
    return {x.sinks, min(kend, max(x.sinks, kend - x.recent))};
}

// One 32-key chunk's online-softmax step of an exact split for one query head: lane j holds
// key j's score `s` (log2 units; `live` false where masked), `m` and `l` the head's running
// max and sum (the same in every lane), `acc` the lane's sums, rescaled here. Returns key j's
// weight exp2(s − m), 0 where masked.
template <int N>
__device__ __forceinline__ float exact_softmax_step(float s, bool live, float& m, float& l,
                                                    float (&acc)[N])
{
    float cm = s;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, o));
    const float mn = fmaxf(m, cm);
    const float corr = exp2f(m - mn);
    const float p = live ? exp2f(s - mn) : 0.f;
    float ps = p;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
    l = l * corr + ps;
    m = mn;
#pragma unroll
    for (int i = 0; i < N; i++) acc[i] *= corr;
    return p;
}

// attn_exact_split's keys lo .. n-1 (at most EXACT_CHUNK) from int8 copies: every
// key's K and V rows (D bytes each) requested at once into ks / vs (16-byte cp.async, rows past
// the list zero-filled), each lane's keys' steps loaded while they come; then, per 32 keys,
// lane j scores key j from its row's bytes (its own starting word, as the f16 rows) and every
// lane adds its two dims of each value, the value's step folded into the key's weight.
template <int D, int NW, int HPW>
__device__ __forceinline__ void exact_chunk_q8(const ExactArgs& x, const float* qs, unsigned char* ks,
    unsigned char* vs, int g, int kh, int n_kv, u32 seq, int lo, int n, int ns, int rlo, int wlo,
    int block_size, float (&m)[HPW], float (&l)[HPW], float (&acc)[HPW][D / 32])
{
    constexpr int NTH = NW * 32, K = EXACT_CHUNK, PIECES = D / 16, WQ = D / 4, E = D / 64;
    // Rows of 16 words put lanes j and j + 16 on one bank; a shift by lane / 16 parts them.
    constexpr int SKEW = WQ < 32 ? 1 : 0;
    static_assert(K == 64 && WQ % 16 == 0, "64 int8 rows fill the f16 path's 32-row tile");
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    auto list_key = [&](int i) { return i < ns ? i : rlo + (i - ns); };
    for (int idx = tid; idx < K * PIECES; idx += NTH) {
        const int j = idx / PIECES, piece = idx % PIECES;
        unsigned char *kd = ks + j * D + piece * 16, *vd = vs + j * D + piece * 16;
        if (lo + j < n) {
            const int t = list_key(lo + j);
            const int slot = exact_slot(x.tbl, seq, t / block_size), at = t % block_size;
            cp_async16(smem_addr(kd), exact_q8_row(x.k, slot, n_kv, kh, block_size, at, D).codes + piece * 16, 16);
            cp_async16(smem_addr(vd), exact_q8_row(x.v, slot, n_kv, kh, block_size, at, D).codes + piece * 16, 16);
        } else {
            *(uint4*)kd = make_uint4(0u, 0u, 0u, 0u);
            *(uint4*)vd = make_uint4(0u, 0u, 0u, 0u);
        }
    }
    cp_async_commit();
    float kst[2], vst[2];
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        kst[hf] = vst[hf] = 0.f;
        const int i = lo + 32 * hf + lane;
        if (i < n) {
            const int t = list_key(i);
            const int slot = exact_slot(x.tbl, seq, t / block_size), at = t % block_size;
            kst[hf] = f16_to_f32(*exact_q8_row(x.k, slot, n_kv, kh, block_size, at, D).step);
            vst[hf] = f16_to_f32(*exact_q8_row(x.v, slot, n_kv, kh, block_size, at, D).step);
        }
    }
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int c0 = lo + 32 * hf;
        if (c0 >= n) break;   // uniform in the block
        const int i = c0 + lane;
        const bool live = i < n && list_key(i) >= wlo;   // keys before a sliding window are masked
#pragma unroll
        for (int hh = 0; hh < HPW; hh++) {
            const int h = warp + hh * NW;
            if (h >= g) break;   // uniform in the warp
            const float* qh = qs + h * D;
            float s = -INFINITY;
            if (live) {
                const u32* kr = (const u32*)(ks + (32 * hf + lane) * D);
                float a = 0.f;
#pragma unroll 8
                for (int w0 = 0; w0 < WQ; w0++) {
                    const int w = (w0 + lane + SKEW * (lane >> 4)) & (WQ - 1);
                    const u32 kw = kr[w];
                    const float4 qv = *(const float4*)(qh + 4 * w);
                    a = fmaf(qv.x, (float)(signed char)(kw & 0xffu), a);
                    a = fmaf(qv.y, (float)(signed char)((kw >> 8) & 0xffu), a);
                    a = fmaf(qv.z, (float)(signed char)((kw >> 16) & 0xffu), a);
                    a = fmaf(qv.w, (float)(signed char)(kw >> 24), a);
                }
                s = a * kst[hf];
            }
            const float p = exact_softmax_step(s, live, m[hh], l[hh], acc[hh]);
            const float pv = p * vst[hf];   // rows past the list are zeros, their weights 0
#pragma unroll 8
            for (int j = 0; j < 32; j++) {
                const float pj = __shfl_sync(0xffffffffu, pv, j);
                const unsigned short* vr = (const unsigned short*)(vs + (32 * hf + j) * D);
#pragma unroll
                for (int e2 = 0; e2 < E; e2++) {
                    const u32 vw = vr[lane + 32 * e2];
                    acc[hh][2 * e2] = fmaf(pj, (float)(signed char)(vw & 0xffu), acc[hh][2 * e2]);
                    acc[hh][2 * e2 + 1] = fmaf(pj, (float)(signed char)(vw >> 8), acc[hh][2 * e2 + 1]);
                }
            }
        }
    }
    __syncthreads();   // the merge reuses the shared memory
}

// The exact split `es` of a windowed pool: for the g query heads of kv head kh of row r
// (span `seq`, keys 0 .. kend-1), online softmax over the exact keys es·P .. es·P + P - 1 of
// the row's list (sinks, then recent; P = x.per_split). The keys come in chunks of 32 whose
// f16 K and V rows all threads stage in shared memory at once (16-byte cp.async; rows past
// the list zero-filled), so a chunk's reads are in flight together; then warp w takes query
// heads w, w + NW, …: lane j scores key j (reading its row's words from lane j's own starting
// word, so the 32 lanes hit 32 banks), and every lane adds its dims of the chunk's values.
// Int8 copies (`q8`, exact_chunk_q8) are staged as they are stored, 64 keys at once (their
// rows take the bytes of 32 f16 ones), and read as bytes: each key's step scales its score,
// each value's step its weight. Writes the partial of split `sp` as the coded splits do (max
// in natural-log units, sum, unnormalised acc; an empty run writes an empty partial). smem:
// `exact_split_smem_bytes` in codes.rs.
template <int D, int NW>
__device__ __noinline__ void attn_exact_split(float* sh, const ExactArgs& x, const float* qrow,
    float qscale, int g, int r, int kh, int sp, int es, int n_heads, int n_kv, int n_splits,
    u32 seq, int kend, int wlo, int block_size, float* part_ml, float* part_acc)
{
    constexpr int NTH = NW * 32, W = D / 2, E = D / 64, C = 32, PIECES = D / 8;
    constexpr int HPW = (D <= 128 ? 16 : 8) / NW;   // query heads per warp, at most
    static_assert(W % 32 == 0, "rows of whole 32-word bank rounds");
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ns = min(x.sinks, kend);
    const int rlo = coded_range(x, kend).hi;
    const int lo = es * x.per_split;
    const int n = min(ns + (kend - rlo), lo + x.per_split);
    float* qs = sh;                        // [g][D], pre-scaled
    u32* ks = (u32*)(sh + g * D);          // [C][W] f16 pairs (16-byte aligned: D >= 64)
    u32* vs = ks + C * W;
    for (int e = tid; e < g * D; e += NTH) qs[e] = qrow[e] * qscale;
    float m[HPW], l[HPW], acc[HPW][2 * E];
#pragma unroll
    for (int hh = 0; hh < HPW; hh++) {
        m[hh] = -1e30f;
        l[hh] = 0.f;
#pragma unroll
        for (int i = 0; i < 2 * E; i++) acc[hh][i] = 0.f;
    }
    if (x.q8) {
        for (int c0 = lo; c0 < n; c0 += EXACT_CHUNK)
            exact_chunk_q8<D, NW, HPW>(x, qs, (unsigned char*)ks, (unsigned char*)vs, g, kh, n_kv,
                                       seq, c0, min(n, c0 + EXACT_CHUNK), ns, rlo, wlo, block_size,
                                       m, l, acc);
    } else
    for (int c0 = lo; c0 < n; c0 += C) {
        const int cn = min(C, n - c0);
        for (int idx = tid; idx < C * PIECES; idx += NTH) {
            const int j = idx / PIECES, piece = idx % PIECES;
            u32 *kd = ks + j * W + piece * 4, *vd = vs + j * W + piece * 4;
            if (j < cn) {
                const int i = c0 + j, t = i < ns ? i : rlo + (i - ns);
                const int slot = exact_slot(x.tbl, seq, t / block_size);
                stage_exact_piece<D>(x, slot, n_kv, kh, block_size, t % block_size, piece, kd, vd);
            } else {
                *(uint4*)kd = make_uint4(0u, 0u, 0u, 0u);
                *(uint4*)vd = make_uint4(0u, 0u, 0u, 0u);
            }
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        const int i = c0 + lane, t = i < ns ? i : rlo + (i - ns);
        const bool live = lane < cn && t >= wlo;   // keys before a sliding window are masked
#pragma unroll
        for (int hh = 0; hh < HPW; hh++) {
            const int h = warp + hh * NW;
            if (h >= g) break;   // uniform in the warp
            const float* qh = qs + h * D;
            float s = -INFINITY;
            if (live) {
                const u32* kr = ks + lane * W;
                float a = 0.f;
#pragma unroll 8
                for (int w0 = 0; w0 < W; w0++) {
                    const int w = (w0 + lane) & (W - 1);
                    const u32 kw = kr[w];
                    const float2 qv = *(const float2*)(qh + 2 * w);
                    a = fmaf(qv.x, f16_to_f32((u16)(kw & 0xffffu)), a);
                    a = fmaf(qv.y, f16_to_f32((u16)(kw >> 16)), a);
                }
                s = a;
            }
            const float p = exact_softmax_step(s, live, m[hh], l[hh], acc[hh]);
            // Rows past the list are zeros and their weights 0: no bound needed.
#pragma unroll 8
            for (int j = 0; j < C; j++) {
                const float pj = __shfl_sync(0xffffffffu, p, j);
                const u32* vr = vs + j * W;
#pragma unroll
                for (int e2 = 0; e2 < E; e2++) {
                    const u32 vw = vr[lane + 32 * e2];
                    acc[hh][2 * e2] = fmaf(pj, f16_to_f32((u16)(vw & 0xffffu)), acc[hh][2 * e2]);
                    acc[hh][2 * e2 + 1] = fmaf(pj, f16_to_f32((u16)(vw >> 16)), acc[hh][2 * e2 + 1]);
                }
            }
        }
        __syncthreads();   // the next chunk overwrites the staged rows
    }
#pragma unroll
    for (int hh = 0; hh < HPW; hh++) {
        const int h = warp + hh * NW;
        if (h >= g) break;
        const u64 b = ((u64)r * n_heads + kh * g + h) * n_splits + sp;
#pragma unroll
        for (int e2 = 0; e2 < E; e2++)
            *(float2*)(part_acc + b * D + 2 * (lane + 32 * e2)) = make_float2(acc[hh][2 * e2], acc[hh][2 * e2 + 1]);
        if (lane == 0) {
            part_ml[2 * b] = l[hh] > 0.f ? m[hh] * 0.6931471805599453f : -INFINITY;
            part_ml[2 * b + 1] = l[hh];
        }
    }
    __syncthreads();   // the merge reuses sh
}

// The exact splits sp, sp + n_coded, … of a windowed pool, run by coded block (r, kh, sp) after
// its own partial when they are folded into the coded blocks; returns how many. Not inlined: the
// coded kernels keep their registers for their own loop.
template <int D, int NW>
__device__ __noinline__ u32 folded_exact_splits(float* sh, const ExactArgs& xa, const float* qrow,
    float qscale, int g, int r, int kh, int sp, int n_coded, int n_heads, int n_kv, int n_splits,
    u32 seq, int pos, int window, int block_size, float* part_ml, float* part_acc)
{
    u32 n = 0;
    for (int es = sp; es < n_splits - n_coded; es += n_coded, n++) {
        __syncthreads();   // the shared memory of the partial before is read
        attn_exact_split<D, NW>(sh, xa, qrow, qscale, g, r, kh, n_coded + es, es, n_heads, n_kv,
                                n_splits, seq, pos + 1, window_lo(pos, window), block_size, part_ml,
                                part_acc);
    }
    return n;
}

// The end of a coded decode block (r, kh, sp), after it stored its own partial. With the exact
// splits folded into the coded blocks (the grid's z is n_coded, not n_splits:
// CudaOptions::fold_exact_splits), the block also runs exact splits sp, sp + n_coded, … — so a
// launch has no short exact blocks beside its long coded ones — and counts every partial it
// wrote in the fused merge.
template <int D, int NW>
__device__ __forceinline__ void coded_block_end(float* sh, ATTN_PARAMS, const ExactArgs& xa,
                                                int window, int n_coded, int kh)
{
    const int g = n_heads / n_kv;
    const int r = blockIdx.x, sp = blockIdx.z;
    u32 arrivals = 1;
    if ((int)gridDim.z < n_splits)
        arrivals += folded_exact_splits<D, NW>(sh, xa, qkv + (u64)r * width + (u64)kh * g * D,
                                               scale * 1.4426950408889634f, g, r, kh, sp, n_coded,
                                               n_heads, n_kv, n_splits, tok_seq[r], (int)tok_pos[r],
                                               window, block_size, part_ml, part_acc);
    attn_merge_last(sh, g, D, n_heads, n_kv, kh, n_splits, counters, part_ml, part_acc, out, out_bf16, sinks,
                    arrivals);
}

// ---- Decode attention: one kernel template, KV number formats as hooks -------------------
// grid = (rows, n_kv, n_splits), NW warps; one block attends the g <= 16 query
// heads of one decode row's kv head over one split of the row's keys (each row splits its own
// range 0..=pos into n_splits chunks of whole tiles, so a replayed graph stays valid as
// positions advance), and the last split block to finish merges (`attn_merge_last`). The g
// heads are the M = 16 rows of m16n8k16 MMAs (rows g..15 zero), so a kv head's bytes are read
// once for its whole GQA group. Tiles of TK keys stream through shared memory, STAGES - 1 in
// flight; warp w takes keys w·TK/NW .. of every tile: scores, its own online softmax (log2
// units; rows in lane quads), O += P·V. At the end the NW warps' states are merged through
// shared memory into the split's partial.
//
// A KV format F enters only through these hooks (the fattn-vec idea, with MMA fragments as the
// interface):
//   F::ROW_BYTES          bytes of one staged K row and one V row in shared memory (a warp's
//                         rows start at a multiple of 16 within the tile)
//   F::stage<TK, NTH>(ks, vs, t0, k1, skip, kv, kc, vc, tid)
//                         request (cp.async) the K and V rows of keys t0 .. t0+TK-1 (< k1,
//                         zeros past it, nothing for `skip`) of one kv head into shared memory
//   F::fill_row<NTH>(ks, vs, row, p, kv, kc, vc, tid)
//                         copy key p's rows (row `row` of its tile) in after the PDL wait
//                         (the newest key)
//   F::Query, f.init_query(q, q0, q1, qs, lane)
//                         the query heads of this lane's two MMA rows, prepared once
//   f.scores<TK, NK>(s, q, ks, key0, lane)
//                         S = Q·Kᵀ for the 8·NK staged keys key0.. of the K tile at ks, in
//                         C-fragment layout: s[nt][e] is row lane/4, key key0 + 8nt +
//                         2(lane%4) + e; s[nt][2+e] row lane/4 + 8
//   f.accumulate<TK, NK>(o, p, vs, key0, lane)
//                         O += P·V over the same keys of the V tile at vs, P (the softmax
//                         weights, f32) in the layout of s; O in C-fragment layout, row as
//                         above, column 2(lane%4) + e of MMA nd holding dim F::out_dim(nd,
//                         lane%4, e)
//   F::k_tile_bytes<TK>(), F::v_tile_bytes<TK>()
//                         shared bytes of one staged K / V tile; F::PREFETCH: whether it
//                         supports `prefetch` (fill_row); F::DIMS_IN_ORDER: out_dim is
//                         8nd + 2(lane%4) + e
// A format is built once per block from the launch's format words (`F f(fmt)`). The 16-bit
// formats are the first; the coded ones (KvCodes) stage code bytes and scales and unpack the
// codes in registers inside `scores` / `accumulate`.
// `prefetch`: launched as a programmatic dependent of the kernel that writes this step's keys
// and q; older keys are requested before `griddepcontrol.wait`, the newest key and q after.
// dynamic smem: max(STAGES · 2 · TK · F::ROW_BYTES, NW · 16 · (D + 2) floats, merge's
// g · (2 · n_splits + 1) floats). Requires d == D, g <= 16.

// bf16 / f16: rows of D values, their 16-byte chunks XOR-swizzled by the row (chunk c of row j
// at c ^ (j & 7)), so fragment reads and ldmatrix rows of 8 consecutive rows hit 8 different
// bank groups without padding (padding cost a block per SM at some tile sizes). MMAs in the
// cache's own type (queries pre-scaled and rounded to it).
template <int D, bool BF16>
struct Kv16 {
    static constexpr bool PREFETCH = true;
    static constexpr bool DIMS_IN_ORDER = true;
    static constexpr int ROW_BYTES = D * 2;
    static constexpr int CH = D / 8;   // 16-byte chunks per row
    template <int TK> static constexpr int k_tile_bytes() { return TK * ROW_BYTES; }
    template <int TK> static constexpr int v_tile_bytes() { return TK * ROW_BYTES; }
    struct Query { u32 qa[D / 16][4]; };
    __device__ __forceinline__ explicit Kv16(const u32*) {}
    __device__ static __forceinline__ int out_dim(int nd, int c, int e) { return nd * 8 + 2 * c + e; }

    template <int TK, int NTH>
    __device__ __forceinline__ void stage(unsigned char* ks, unsigned char* vs, int t0,
        int k1, int skip, const PagedKv& kv, const void* kc, const void* vc, int tid) const {
        stage_rows<D, TK, NTH>(ks, vs, t0, k1, skip, kv, (const u16*)kc, (const u16*)vc, tid,
                               [](int j, int c) { return j * ROW_BYTES + ((c ^ (j & 7)) << 4); });
    }
    // ks / vs: the staged rows of key p (row `row` of its tile).
    template <int NTH>
    __device__ __forceinline__ void fill_row(unsigned char* ks, unsigned char* vs, int row,
        int p, const PagedKv& kv, const void* kc, const void* vc, int tid) const {
        const u64 off = kv.row(p, D);
        for (int c = tid; c < CH; c += NTH) {
            const int at = (c ^ (row & 7)) << 4;
            *(uint4*)(ks + at) = ld_cg_u4((const u16*)kc + off + c * 8);
            *(uint4*)(vs + at) = ld_cg_u4((const u16*)vc + off + c * 8);
        }
    }
    __device__ __forceinline__ void init_query(Query& q, const float* q0, const float* q1,
                                               float qs, int lane) const {
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            const int c = kk * 16 + (lane & 3) * 2;
            float2 x00 = make_float2(0.f, 0.f), x01 = x00, x10 = x00, x11 = x00;
            if (q0) { x00 = *(const float2*)(q0 + c); x01 = *(const float2*)(q0 + c + 8); }
            if (q1) { x10 = *(const float2*)(q1 + c); x11 = *(const float2*)(q1 + c + 8); }
            q.qa[kk][0] = pack16<BF16>(x00.x * qs, x00.y * qs);
            q.qa[kk][1] = pack16<BF16>(x10.x * qs, x10.y * qs);
            q.qa[kk][2] = pack16<BF16>(x01.x * qs, x01.y * qs);
            q.qa[kk][3] = pack16<BF16>(x11.x * qs, x11.y * qs);
        }
    }
    template <int TK, int NK>
    __device__ __forceinline__ void scores(float (&s)[NK][4], const Query& q,
                                           const unsigned char* tile, int key0, int lane) const {
        const u16* ks = (const u16*)(tile + key0 * ROW_BYTES);
#pragma unroll
        for (int nt = 0; nt < NK; nt++) {
            s[nt][0] = 0.f; s[nt][1] = 0.f; s[nt][2] = 0.f; s[nt][3] = 0.f;
            const int row = nt * 8 + (lane >> 2), sw = row & 7;
            const u16* kr = ks + row * D + (lane & 3) * 2;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                const u32 b0 = *(const u32*)(kr + (((2 * kk) ^ sw) << 3));
                const u32 b1 = *(const u32*)(kr + (((2 * kk + 1) ^ sw) << 3));
                mma16<BF16>(s[nt], q.qa[kk], b0, b1);
            }
        }
    }
    template <int TK, int NK>
    __device__ __forceinline__ void accumulate(float (&o)[D / 8][4], const float (&p)[NK][4],
                                               const unsigned char* tile, int key0, int lane) const {
        const u16* vs = (const u16*)(tile + key0 * ROW_BYTES);
        u32 pa[NK / 2][4];
#pragma unroll
        for (int nt = 0; nt < NK; nt++) {
            pa[nt >> 1][(nt & 1) * 2] = pack16<BF16>(p[nt][0], p[nt][1]);
            pa[nt >> 1][(nt & 1) * 2 + 1] = pack16<BF16>(p[nt][2], p[nt][3]);
        }
#pragma unroll
        for (int k = 0; k < NK / 2; k++) {
            const int row = k * 16 + (lane & 15), sw = row & 7;
            const u16* vr = vs + row * D;
#pragma unroll
            for (int nd = 0; nd < D / 8; nd++) {
                u32 b0, b1;
                ldmatrix_x2_trans(b0, b1, smem_addr(vr + ((nd ^ sw) << 3)));
                mma16<BF16>(o[nd], pa[k], b0, b1);
            }
        }
    }
};

// Whether format F stages tiles from any key (the 16-bit rows); the coded formats stage whole
// runs of 16 keys, so a window's range starts at the run holding its first key, the keys
// before it masked.
template <class F> struct StagesFromAnyKey { static constexpr bool value = false; };
template <int D, bool BF16> struct StagesFromAnyKey<Kv16<D, BF16>> { static constexpr bool value = true; };

// `window` > 0: a sliding window (each row's range starts at its window's first key).
template <class F, int D, int TK, int STAGES, int NW>
__device__ __forceinline__ void attn_decode_impl(float* sh, ATTN_PARAMS, const u32* fmt,
                                                 const ExactArgs& xa, int window = 0)
{
    constexpr int NTH = NW * 32;
    constexpr int KPW = TK / NW, NK = KPW / 8;   // keys per warp per tile, 8-key MMA columns
    static_assert(KPW % 16 == 0, "a warp's keys are whole 16-key MMA steps");
    const int g = n_heads / n_kv;
    const int r = blockIdx.x, sp = blockIdx.z, tid = threadIdx.x;
    const int kh = fmt ? coded_kv_head(fmt, n_kv) : (int)blockIdx.y;
    const int lane = tid & 31, warp = tid >> 5;
    const u32 pos = tok_pos[r];
    const int n_coded = n_splits - exact_splits(xa);
    if (sp >= n_coded) {   // an exact split of a windowed pool
        pdl_wait();
        attn_exact_split<D, NW>(sh, xa, qkv + (u64)r * width + (u64)kh * g * D, scale * 1.4426950408889634f,
                                g, r, kh, sp, sp - n_coded, n_heads, n_kv, n_splits, tok_seq[r], (int)pos + 1,
                                window_lo((int)pos, window), block_size, part_ml, part_acc);
        attn_merge_last(sh, g, D, n_heads, n_kv, kh, n_splits, counters, part_ml, part_acc, out, out_bf16, sinks);
        return;
    }
    const CodedRange cr = coded_range(xa, (int)pos + 1);
    const int kend = cr.hi;
    const int wlo = window_lo((int)pos, window);
    const int base = StagesFromAnyKey<F>::value ? wlo : wlo & ~15;
    const int klo = max(cr.lo, wlo);   // keys below are masked
    const int chunk = ((kend - base + n_coded - 1) / n_coded + TK - 1) / TK * TK;
    const int k0 = base + sp * chunk;
    const int k1 = min(k0 + chunk, kend);
    const int ntiles = k1 > k0 ? (k1 - k0 + TK - 1) / TK : 0;
    const PagedKv kv(tables + seq_tbl[tok_seq[r]], n_kv, kh, block_size);
    const F f(fmt);
    constexpr int KT = F::template k_tile_bytes<TK>(), VT = F::template v_tile_bytes<TK>();
    constexpr int STAGE_BYTES = KT + VT;
    unsigned char* stage = (unsigned char*)sh;   // [STAGES][K tile, V tile]
    auto issue = [&](int t) {
        if (t < ntiles) {
            unsigned char* ks = stage + (u64)(t % STAGES) * STAGE_BYTES;
            f.template stage<TK, NTH>(ks, ks + KT, k0 + t * TK, k1, prefetch ? (int)pos : -1,
                                      kv, k_cache, v_cache, tid);
        }
        cp_async_commit();
    };
    const bool holds_newest = (int)pos >= k0 && (int)pos < k1;
    const int tn = ((int)pos - k0) / TK;
    auto fill_newest = [&](int t) {
        if constexpr (F::PREFETCH) {
            if (!prefetch || !holds_newest || t != tn || t >= ntiles) return;
            const int row = (int)pos - k0 - t * TK;
            unsigned char* ks = stage + (u64)(t % STAGES) * STAGE_BYTES + row * F::ROW_BYTES;
            f.template fill_row<NTH>(ks, ks + KT, row, (int)pos, kv, k_cache, v_cache, tid);
        }
    };
    if (!prefetch) pdl_wait();
#pragma unroll
    for (int t = 0; t < STAGES - 1; t++) issue(t);
    if (prefetch) pdl_wait();   // the kernel ahead is complete and its writes visible
#pragma unroll
    for (int t = 0; t < STAGES - 1; t++) fill_newest(t);

    // MMA row v = lane / 4 (+ 8) is query head v of the kv head.
    const int v0 = lane >> 2, v1 = v0 + 8;
    const float* qrow = qkv + (u64)r * width + (u64)kh * g * D;
    typename F::Query q;
    f.init_query(q, v0 < g ? qrow + v0 * D : nullptr, v1 < g ? qrow + v1 * D : nullptr,
                  scale * 1.4426950408889634f, lane);
    float o[D / 8][4];
#pragma unroll
    for (int nd = 0; nd < D / 8; nd++) { o[nd][0] = 0.f; o[nd][1] = 0.f; o[nd][2] = 0.f; o[nd][3] = 0.f; }
    float m0 = -1e30f, m1 = -1e30f, l0 = 0.f, l1 = 0.f;
    for (int t = 0; t < ntiles; t++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();          // tile t landed for all; tile t-1's stage is free
        issue(t + STAGES - 1);
        fill_newest(t + STAGES - 1);
        const unsigned char* ks = stage + (u64)(t % STAGES) * STAGE_BYTES;
        const unsigned char* vs = ks + KT;
        const int key0 = k0 + t * TK + warp * KPW;
        float s[NK][4];
        f.template scores<TK, NK>(s, q, ks, warp * KPW, lane);
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int nt = 0; nt < NK; nt++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int key = key0 + nt * 8 + (lane & 3) * 2 + e;
                if (key >= k1 || key < klo) {
                    s[nt][e] = -INFINITY;
                    s[nt][2 + e] = -INFINITY;
                }
            }
            mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
            mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float c0 = exp2f(m0 - mx0), c1 = exp2f(m1 - mx1);
        m0 = mx0; m1 = mx1;
        l0 *= c0; l1 *= c1;
#pragma unroll
        for (int nd = 0; nd < D / 8; nd++) { o[nd][0] *= c0; o[nd][1] *= c0; o[nd][2] *= c1; o[nd][3] *= c1; }
#pragma unroll
        for (int nt = 0; nt < NK; nt++) {
            s[nt][0] = exp2f(s[nt][0] - m0); s[nt][1] = exp2f(s[nt][1] - m0);
            s[nt][2] = exp2f(s[nt][2] - m1); s[nt][3] = exp2f(s[nt][3] - m1);
            l0 += s[nt][0] + s[nt][1];
            l1 += s[nt][2] + s[nt][3];
        }
        f.template accumulate<TK, NK>(o, s, vs, warp * KPW, lane);
    }
    cp_async_wait<0>();
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    __syncthreads();              // stages are reused for the warps' states
    // Per warp: m[16], l[16], acc[16][D] (log2 units).
    float* ws = sh + (u64)warp * 16 * (D + 2);
    if ((lane & 3) == 0) { ws[v0] = m0; ws[16 + v0] = l0; ws[v1] = m1; ws[16 + v1] = l1; }
#pragma unroll
    for (int nd = 0; nd < D / 8; nd++) {
        if constexpr (F::DIMS_IN_ORDER) {   // pairs of adjacent dims
            const int dim = nd * 8 + (lane & 3) * 2;
            *(float2*)(ws + 32 + v0 * D + dim) = make_float2(o[nd][0], o[nd][1]);
            *(float2*)(ws + 32 + v1 * D + dim) = make_float2(o[nd][2], o[nd][3]);
        } else {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int dim = F::out_dim(nd, lane & 3, e);
                ws[32 + v0 * D + dim] = o[nd][e];
                ws[32 + v1 * D + dim] = o[nd][2 + e];
            }
        }
    }
    __syncthreads();
    store_split_partial<D, NW>(sh, 16, g, r, kh, sp, n_heads, n_splits, part_ml, part_acc, tid, NTH);
    if constexpr (StagesFromAnyKey<F>::value)   // 16-bit pools have no exact window
        attn_merge_last(sh, g, D, n_heads, n_kv, kh, n_splits, counters, part_ml, part_acc, out, out_bf16, sinks);
    else
        coded_block_end<D, NW>(sh, ATTN_ARGS, xa, window, n_coded, kh);
}

// attn_dec_{D}_{TK}_{STAGES}_{NW}: the template for the 16-bit formats (is_bf16 picks the
// type). The list must match DECODE_VARIANTS in kernels.rs.
#define ATTN_DEC16(D, TK, ST, NW) \
    extern "C" __global__ void __launch_bounds__(NW * 32) attn_dec_##D##_##TK##_##ST##_##NW(ATTN_PARAMS, \
                                                                                      int window) { \
        extern __shared__ float sh[]; \
        const ExactArgs none{nullptr, nullptr, nullptr, 0, 0}; \
        if (is_bf16) attn_decode_impl<Kv16<D, true>, D, TK, ST, NW>(sh, ATTN_ARGS, nullptr, none, window); \
        else attn_decode_impl<Kv16<D, false>, D, TK, ST, NW>(sh, ATTN_ARGS, nullptr, none, window); \
    }
ATTN_DEC16(64, 64, 2, 4)
ATTN_DEC16(64, 64, 3, 4)
ATTN_DEC16(128, 64, 2, 4)
ATTN_DEC16(128, 64, 3, 4)
ATTN_DEC16(128, 32, 2, 2)

// ---- Coded formats: int8, fp8 and TurboQuant-MSE, attended over on their codes ---------
// Pool layout (the codec's block layout, crates/codec/src/layout.rs): per (physical block,
// kv head) one block of `total` bytes, the code records of its tokens back to back (ROW bytes
// each, bits arranged per cuda/code_layout.rs), then at `soff` one f16 scale per token. Format words `fmt` (one CODE_DESC_WORDS-word descriptor
// for keys, then one for values; see CodeDesc in cuda/codes.rs): [3] total bytes, [4] scale
// offset, [24..28) / [28..32) the low / high bytes of the centroids as f16 (TurboQuant; the 8
// magnitudes for 4-bit sign-magnitude records).
//
// A tile stages whole runs of 16 keys (block sizes are multiples of 16): their code records,
// then their scales, so keys past the end of a sequence inside a live run hold stale but
// finite codes (masked by the template) and possibly non-finite scales (never multiplied into
// a live weight: see `accumulate`).
//
// MMAs are m16n8k16 in f16 (queries and weights rounded to f16). The dims of an MMA's k (for
// scores) and n (for values) are permuted so that each lane's codes are one contiguous run:
// for scores lane c = lane%4 owns the D/4 dims from c·D/4, for values lane g = lane/4 the D/8
// dims from g·D/8; Codes<B, R>::dim(group, j) is the dim of slot j of a run's group of 4 codes,
// and the query (init_query) and the output (out_dim) use the same map. Codes become f16
// pairs with byte permutes: a TurboQuant code selects the low and the high byte of its
// centroid from tables held in registers (`prmt`, 8 entries per pair of registers); an int8
// code c becomes the f16 1024 + (c + 128) by placing it under the exponent byte 0x64, then 1152
// is subtracted (exact). fp8 (E4M3) codes convert to f16 pairs in hardware on sm_89+ (exact:
// every finite E4M3 value is an f16); before that, a code's bits become an f16's — sign on
// top, exponent and mantissa shifted under it — whose value is the code's / 256 (the biases
// differ by 8; E4M3 subnormals land on f16 subnormals), the 256 joining the f32 scale
// (`code_scale`).

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}
__device__ __forceinline__ u32 sub_f16x2(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ u32 shf_r(u32 lo, u32 hi, u32 n) {
    u32 d;
    asm("shf.r.clamp.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(lo), "r"(hi), "r"(n));
    return d;
}

// The RB bytes of a lane's run of codes at p (2- or 4-byte aligned when RB is even / a multiple
// of 4) as little-endian 32-bit words.
template <int RB>
__device__ __forceinline__ void load_run(const unsigned char* p, u32 (&w)[(RB + 3) / 4]) {
    if constexpr (RB % 4 == 0) {
#pragma unroll
        for (int i = 0; i < RB / 4; i++) w[i] = ((const u32*)p)[i];
    } else if constexpr (RB % 2 == 0) {
#pragma unroll
        for (int i = 0; i < (RB + 3) / 4; i++) w[i] = 0u;
#pragma unroll
        for (int i = 0; i < RB / 2; i++) w[i >> 1] |= (u32)((const u16*)p)[i] << (16 * (i & 1));
    } else {
#pragma unroll
        for (int i = 0; i < (RB + 3) / 4; i++) w[i] = 0u;
#pragma unroll
        for (int i = 0; i < RB; i++) w[i >> 2] |= (u32)p[i] << (8 * (i & 3));
    }
}

// Group `g` (4 codes) of a lane's run of R codes as two f16 pairs (slots 0-1, 2-3); `lo` /
// `hi`: the centroid byte tables (TurboQuant). The runs are in the pool's record layout
// (cuda/code_layout.rs), chosen so that a prmt selector (one 3-bit index per nibble, bit 3
// clear) costs about one mask.
// The template's code-width argument: 2-4 TurboQuant bits, 8 int8, `f8` fp8 (a tag; one
// byte per code as int8). `f8` is also the kernels' name token (attn_codes_64_f8_f8).
constexpr int f8 = 9;
#if __CUDA_ARCH__ >= 890
#define FP8_CVT 1   // cvt.rn.f16x2.e4m3x2
#else
#define FP8_CVT 0
#endif
__host__ __device__ constexpr int code_bits(int b) { return b == f8 ? 8 : b; }
__host__ __device__ constexpr float code_scale(int b) { return b == f8 && !FP8_CVT ? 256.0f : 1.0f; }

template <int B, int R> struct Codes;
template <int R> struct Codes<f8, R> {   // fp8 E4M3 (/ code_scale(f8))
    __device__ static constexpr int dim(int g, int j) { return 4 * g + j; }
    __device__ static __forceinline__ void group(const u32* w, int g, const u32*, const u32*,
                                                 u32& a, u32& b) {
#if FP8_CVT
        asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\n"
            "cvt.rn.f16x2.e4m3x2 %1, h;\n}" : "=r"(a), "=r"(b) : "r"(w[g]));
#else
        // Bytes 0, 1 (2, 3) as the high bytes of two halfwords, then bit 7 stays the sign
        // and bits 0-6 move under it.
        const u32 h0 = prmt(w[g], 0u, 0x1404u), h1 = prmt(w[g], 0u, 0x3424u);
        a = (h0 & 0x80008000u) | ((h0 >> 1) & 0x3f803f80u);
        b = (h1 & 0x80008000u) | ((h1 >> 1) & 0x3f803f80u);
#endif
    }
};
template <int R> struct Codes<8, R> {   // int8
    __device__ static constexpr int dim(int g, int j) { return 4 * g + j; }
    __device__ static __forceinline__ void group(const u32* w, int g, const u32*, const u32*,
                                                 u32& a, u32& b) {
        const u32 x = w[g] ^ 0x80808080u;
        a = sub_f16x2(prmt(x, 0x64646464u, 0x5140u), 0x64806480u);
        b = sub_f16x2(prmt(x, 0x64646464u, 0x7362u), 0x64806480u);
    }
};
// The f16 pairs of the 4 codes of a 16-bit selector, from 8-entry byte tables.
__device__ __forceinline__ void lookup8(u32 sel, const u32* lo, const u32* hi, u32& a, u32& b) {
    const u32 l = prmt(lo[0], lo[1], sel), h = prmt(hi[0], hi[1], sel);
    a = prmt(l, h, 0x5140u);
    b = prmt(l, h, 0x7362u);
}
// Sign-magnitude nibbles (the complement of a nibble is 8·neg | m): magnitude tables, then
// the sign bit of each high byte flipped where the nibble's bit 3 is clear (prmt's
// sign-replicate mode reads bit 3 of each nibble as the top bit of a byte of sel << 4 or sel).
template <int R> struct Codes<4, R> {
    __device__ static constexpr int dim(int g, int j) { return 4 * g + j; }
    __device__ static __forceinline__ void group(const u32* w, int g, const u32* lo, const u32* hi,
                                                 u32& a, u32& b) {
        const u32 sel = w[g >> 1] >> (16 * (g & 1));
        const u32 mags = ~sel & 0x7777u;
        const u32 l = prmt(lo[0], lo[1], mags);
        const u32 pos = prmt(sel << 4, sel, 0xd9c8u);
        const u32 h = prmt(hi[0], hi[1], mags) ^ (~pos & 0x80808080u);
        a = prmt(l, h, 0x5140u);
        b = prmt(l, h, 0x7362u);
    }
    // As two int8 operands whose sum is the signed centroid, each one prmt: the stored nibble
    // is its own selector, and a set bit 3 (a positive code) asks prmt for the sign of the
    // selected byte instead of the byte. `neg` = tab[0..2) by the stored nibbles: byte 7 - m
    // holds -|c_m|, so a negative code gets -|c_m| and a positive one -1 (0 where |c_m| is 0);
    // `pos` = tab[2..4) by the complemented nibbles: byte m holds |c_m| + 1 (|c_m| where that
    // is 0), so a positive code gets it and a negative one 0 (codes.rs `int8_pair_words`).
    __device__ static __forceinline__ void int8_pair(const u32* w, int g, const u32* tab, u32& neg,
                                                     u32& pos) {
        const u32 sel = w[g >> 1] >> (16 * (g & 1));
        neg = prmt(tab[0], tab[1], sel);
        pos = prmt(tab[2], tab[3], ~sel);
    }
};
// 3-bit nibble units (R a multiple of 16: U = R / 16 units of three halfwords, halfword
// U·j + u): group g is j = g / U, unit u = g % U; j < 3 is the halfword's nibbles, j = 3 the
// unit's spare codes gathered from bit 3 of its three halfwords.
template <int R> struct Codes3Units {
    static constexpr int U = R / 16;
    static_assert(U == 1 || U == 2 || U == 4, "runs of 16, 32 or 64 codes");
    __device__ static constexpr int dim(int g, int j) { return 16 * (g % U) + 4 * (g / U) + j; }
    // The prmt selector of group g: one 3-bit index per nibble of the low 16 bits.
    __device__ static __forceinline__ u32 sel(const u32* w, int g) {
        if constexpr (U == 4) {   // halfword 4j + u is half u & 1 of word 2j + u / 2
            const int j = g >> 2, u = g & 3;
            auto hw = [&](int jj) { return w[2 * jj + (u >> 1)] >> (16 * (u & 1)); };
            return j < 3 ? hw(j) & 0x7777u
                         : ((hw(0) >> 3) & 0x1111u) | ((hw(1) >> 2) & 0x2222u) | ((hw(2) >> 1) & 0x4444u);
        } else if constexpr (U == 2) {
            const int j = g >> 1;
            const u32 s = j < 3 ? w[j] & 0x77777777u
                                : ((w[0] >> 3) & 0x11111111u) | ((w[1] >> 2) & 0x22222222u) |
                                      ((w[2] >> 1) & 0x44444444u);
            return (g & 1) ? s >> 16 : s;
        } else {
            return g == 0 ? w[0] & 0x7777u
                 : g == 1 ? (w[0] >> 16) & 0x7777u
                 : g == 2 ? w[1] & 0x7777u
                          : ((w[0] >> 3) & 0x1111u) | ((w[0] >> 18) & 0x2222u) | ((w[1] >> 1) & 0x4444u);
        }
    }
    __device__ static __forceinline__ void group(const u32* w, int g, const u32* lo, const u32* hi,
                                                 u32& a, u32& b) {
        lookup8(sel(w, g), lo, hi, a, b);
    }
    // Group g as 4 bytes (byte j: slot j) from the 8-entry byte table `tab` (int8 centroids).
    __device__ static __forceinline__ u32 int8(const u32* w, int g, const u32* tab) {
        return prmt(tab[0], tab[1], sel(w, g));
    }
};
// 3-bit codes in the codec's packing (runs of 8): 3-bit fields spread into nibbles.
struct Codes3Packed {
    __device__ static constexpr int dim(int g, int j) { return 4 * g + j; }
    __device__ static __forceinline__ u32 sel(const u32* w, int g) {
        const int bit = 12 * g, wi = bit >> 5, sh = bit & 31;
        const u32 f = sh <= 20 ? w[wi] >> sh : shf_r(w[wi], w[wi + 1], sh);
        return (f & 7u) | ((f << 1) & 0x70u) | ((f << 2) & 0x700u) | ((f << 3) & 0x7000u);
    }
    __device__ static __forceinline__ void group(const u32* w, int g, const u32* lo, const u32* hi,
                                                 u32& a, u32& b) {
        lookup8(sel(w, g), lo, hi, a, b);
    }
    __device__ static __forceinline__ u32 int8(const u32* w, int g, const u32* tab) {
        return prmt(tab[0], tab[1], sel(w, g));
    }
};
template <bool C, class A, class B> struct Pick { using type = A; };
template <class A, class B> struct Pick<false, A, B> { using type = B; };
template <int R> struct Codes<3, R> : Pick<R % 16 == 0, Codes3Units<R>, Codes3Packed>::type {};
template <int R> struct Codes<2, R> {   // 4 centroids; a word's even codes, then its odd ones
    __device__ static constexpr int dim(int g, int j) {
        return 16 * (g >> 2) + 8 * ((g & 3) >> 1) + (g & 1) + 2 * j;
    }
    __device__ static __forceinline__ void group(const u32* w, int g, const u32* lo, const u32* hi,
                                                 u32& a, u32& b) {
        const int sub = g & 3;
        const u32 sel = ((w[g >> 2] >> (2 * (sub & 1))) >> (16 * (sub >> 1))) & 0x3333u;
        const u32 l = prmt(lo[0], hi[0], sel), h = prmt(lo[0], hi[0], sel | 0x4444u);
        a = prmt(l, h, 0x5140u);
        b = prmt(l, h, 0x7362u);
    }
    __device__ static __forceinline__ u32 int8(const u32* w, int g, const u32* tab) {
        const int sub = g & 3;
        return prmt(tab[0], tab[1], ((w[g >> 2] >> (2 * (sub & 1))) >> (16 * (sub >> 1))) & 0x3333u);
    }
};

// The 16-byte chunks of one run of 16 keys' records (ROW bytes each, so ROW chunks, contiguous
// in the pool and in the tile) split among TPR threads: thread u copies chunks u, u + TPR, ...,
// each at a fixed offset from `dst` / `src`, which the copies take as immediates.
template <int ROW, int TPR>
__device__ __forceinline__ void copy_run(u32 dst, const unsigned char* src, int u, int bytes) {
#pragma unroll
    for (int m = 0; m < (ROW + TPR - 1) / TPR; m++)
        if (ROW % TPR == 0 || u + m * TPR < ROW) cp_async16(dst + 16 * TPR * m, src + 16 * TPR * m, bytes);
}

// The keys-as-M kernels' staged code records of 128 bytes a key (int8 and fp8 at head_dim 128,
// 4-bit codes at 256), K (VALUES false) or V: the 16-byte chunks of each 128-byte unit are
// permuted (an XOR of the chunk's slot with bits of the unit's index), so that the lanes of
// one 16-byte shared-memory load meet distinct banks. Unpermuted, the four lanes c = 0..3 of
// a value load's phase (run q of keys 2c) all meet the same banks, and the two keys of a key
// load's phase (lanes q = 2p, 2p + 1, run c) meet the same banks. Permuted: K, odd keys swap
// chunk pairs; V, slot ^ 2·((key / 2) mod 4), which puts keys 2c of c = 0..3 on four
// different chunk pairs. Narrower records are stored as they are: the same permutation of
// 32- and 64-byte value records (two- and four-way conflicts, 8-byte loads) made k4v2, tq2 and
// k2v4 0–6% slower and tq4 no faster (BENCHMARKS.md, session 37).
// `o`: a byte offset from the start of a tile's K or V records; the result is where it lies.
template <int ROW, bool VALUES>
__device__ __forceinline__ int swizzled(int o) {
    if constexpr (ROW != 128) return o;
    else if constexpr (VALUES) return o ^ (((o >> 8) & 3) << 5);
    else return o ^ (((o >> 7) & 1) << 4);
}

// A lane's run of RB bytes at offset `o` of a tile's K or V records staged by
// stage_code_runs<..., true>: 16-byte chunks found through `swizzled` one by one (a run's
// chunks may be permuted).
template <int ROW, int RB, bool VALUES>
__device__ __forceinline__ void load_code_run(const unsigned char* tile, int o, u32 (&w)[(RB + 3) / 4]) {
    if constexpr (ROW == 128 && RB % 16 == 0) {
#pragma unroll
        for (int i = 0; i < RB / 16; i++) {
            const uint4 v = *(const uint4*)(tile + swizzled<ROW, VALUES>(o + 16 * i));
            w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
        }
    } else {
        load_run<RB>(tile + swizzled<ROW, VALUES>(o), w);
    }
}

// copy_run of chunk u + TPR·m of run j's records into a tile's K or V region, with the
// destination chunks permuted as `swizzled` says where SWZ asks for it (the keys-as-M kernels).
template <int ROW, int TPR, bool VALUES, bool SWZ>
__device__ __forceinline__ void copy_records(u32 region, int j, const unsigned char* src, int u, int bytes) {
    if constexpr (!SWZ || ROW != 128) {
        copy_run<ROW, TPR>(region + 16 * (j * ROW + u), src, u, bytes);
    } else {
#pragma unroll
        for (int m = 0; m < (ROW + TPR - 1) / TPR; m++)
            if (ROW % TPR == 0 || u + m * TPR < ROW)
                cp_async16(region + swizzled<ROW, VALUES>(16 * (j * ROW + u + TPR * m)), src + 16 * TPR * m, bytes);
    }
}

// The run of 16 keys thread `tid` stages in a tile of G runs from t0 (NTH / G threads a run),
// and the position whose block it is read from: the run's first key, or t0 where the run
// starts at or past k1 (a dead run copies zero bytes from a live address).
template <int G, int NTH>
struct CodeRun {
    static_assert(NTH % G == 0 && NTH / G >= 4, "whole threads per run, two for each pool's scales");
    static constexpr int TPR = NTH / G;
    int j, u, pc;
    bool live;
    __device__ __forceinline__ CodeRun(int t0, int k1, int tid)
        : j(tid / TPR), u(tid % TPR), pc(t0 + 16 * (tid / TPR)), live(t0 + 16 * (tid / TPR) < k1) {
        if (!live) pc = t0;
    }
    // The physical block of the run's keys (both pools share the block table).
    __device__ __forceinline__ u32 block(const PagedKv& kv) const { return kv.tbl[pc >> kv.bs_log]; }
};

// Requests a tile's K and V code records and scales, the G runs of 16 keys from t0 (< k1), into
// ks and vs: codes of run j at 16·j·ROW, the scales from G·16·ROW (2 bytes per key); runs from
// k1 on are zeros. Each run has NTH / G threads, so a thread reads one block-table entry per
// tile for both pools (`blk`, CodeRun::block: a caller may read it a tile ahead) and issues
// its copies at immediate offsets, where splitting the tile chunk by chunk paid a division, a
// table read and 64-bit address math for every copy (BENCHMARKS.md, session 36).
template <int G, int KROW, int VROW, int NTH, bool SWZ = false>
__device__ __forceinline__ void stage_code_runs(unsigned char* ks, unsigned char* vs, int t0, int k1,
    u32 blk, const PagedKv& kv, const unsigned char* kpool, int ktotal, int ksoff,
    const unsigned char* vpool, int vtotal, int vsoff, int tid)
{
    const CodeRun<G, NTH> r(t0, k1, tid);
    constexpr int TPR = CodeRun<G, NTH>::TPR;
    const int j = r.j, u = r.u, bytes = r.live ? 16 : 0;
    // Coded pools have power-of-two block sizes of 16 or more (checked by the host), so a run
    // of 16 keys from a multiple of 16 lies in one block, at slot pc & (block_size - 1). Byte
    // offsets within a pool fit 32 bits per block index (the host checks the total).
    const u32 slot = (u32)(r.pc & (kv.block_size - 1));
    const unsigned char* kb = kpool + (u64)blk * (u64)(kv.n_kv * ktotal) + (u32)(kv.kh * ktotal);
    const unsigned char* vb = vpool + (u64)blk * (u64)(kv.n_kv * vtotal) + (u32)(kv.kh * vtotal);
    const u32 kd = smem_addr(ks), vd = smem_addr(vs);
    copy_records<KROW, TPR, false, SWZ>(kd, j, kb + slot * KROW + 16 * u, u, bytes);
    copy_records<VROW, TPR, true, SWZ>(vd, j, vb + slot * VROW + 16 * u, u, bytes);
    if (u < 2)   // 32 bytes of scales per run and pool
        cp_async16(kd + G * 16 * KROW + 32 * j + 16 * u, kb + ksoff + slot * 2 + 16 * u, bytes);
    else if (u < 4)
        cp_async16(vd + G * 16 * VROW + 32 * j + 16 * (u - 2), vb + vsoff + slot * 2 + 16 * (u - 2), bytes);
}

template <int D, int KB, int VB>
struct KvCodes {
    static constexpr bool PREFETCH = false;
    static constexpr bool DIMS_IN_ORDER = false;
    static constexpr int KROW = D * code_bits(KB) / 8, VROW = D * code_bits(VB) / 8;   // code bytes per key
    static constexpr int KR = D / 4, VR = D / 8;                 // codes per lane run
    static constexpr int KRB = KR * code_bits(KB) / 8, VRB = VR * code_bits(VB) / 8;   // bytes per lane run
    static constexpr float KS = code_scale(KB), VS = code_scale(VB);   // scale factors
    static_assert(D % 64 == 0, "runs of whole 4-code groups and 2-byte alignment");
    template <int TK> static constexpr int k_tile_bytes() { return TK * (KROW + 2); }
    template <int TK> static constexpr int v_tile_bytes() { return TK * (VROW + 2); }
    struct Query { u32 qa[D / 16][4]; };
    u32 klo[4], khi[4], vlo[4], vhi[4];
    int ktot, ksoff, vtot, vsoff;

    __device__ __forceinline__ explicit KvCodes(const u32* fmt) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            klo[i] = fmt[24 + i]; khi[i] = fmt[28 + i];
            vlo[i] = fmt[CODE_DESC_WORDS + 24 + i]; vhi[i] = fmt[CODE_DESC_WORDS + 28 + i];
        }
        ktot = (int)fmt[3]; ksoff = (int)fmt[4];
        vtot = (int)fmt[CODE_DESC_WORDS + 3]; vsoff = (int)fmt[CODE_DESC_WORDS + 4];
    }
    __device__ static __forceinline__ int out_dim(int nd, int c, int e) {
        return (2 * c + e) * VR + Codes<VB, VR>::dim(nd >> 2, nd & 3);
    }

    template <int TK, int NTH>
    __device__ __forceinline__ void stage(unsigned char* ks, unsigned char* vs, int t0, int k1,
        int, const PagedKv& kv, const void* kc, const void* vc, int tid) const {
        stage_with<TK, NTH>(ks, vs, t0, k1, CodeRun<TK / 16, NTH>(t0, k1, tid).block(kv), kv, kc, vc, tid);
    }
    // `stage` with this thread's block-table entry read already (CodeRun::block); SWZ: the
    // records' chunks permuted for the keys-as-M kernels (`swizzled`).
    template <int TK, int NTH, bool SWZ = false>
    __device__ __forceinline__ void stage_with(unsigned char* ks, unsigned char* vs, int t0, int k1,
        u32 blk, const PagedKv& kv, const void* kc, const void* vc, int tid) const {
        stage_code_runs<TK / 16, KROW, VROW, NTH, SWZ>(ks, vs, t0, k1, blk, kv, (const unsigned char*)kc,
                                                  ktot, ksoff, (const unsigned char*)vc, vtot, vsoff, tid);
    }
    template <int NTH>
    __device__ __forceinline__ void fill_row(unsigned char*, unsigned char*, int, int,
        const PagedKv&, const void*, const void*, int) const {}

    // q0 / q1: the (rotated, for TurboQuant keys) f32 queries of this lane's two MMA rows.
    __device__ __forceinline__ void init_query(Query& q, const float* q0, const float* q1,
                                               float qs, int lane) const {
        const int c = lane & 3;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            float x0[4], x1[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int dim = c * KR + Codes<KB, KR>::dim(kk, j);
                x0[j] = q0 ? q0[dim] * qs : 0.f;
                x1[j] = q1 ? q1[dim] * qs : 0.f;
            }
            q.qa[kk][0] = pack_f16(x0[0], x0[1]);
            q.qa[kk][1] = pack_f16(x1[0], x1[1]);
            q.qa[kk][2] = pack_f16(x0[2], x0[3]);
            q.qa[kk][3] = pack_f16(x1[2], x1[3]);
        }
    }

    template <int TK, int NK>
    __device__ __forceinline__ void scores(float (&s)[NK][4], const Query& q,
                                           const unsigned char* tile, int key0, int lane) const {
        const int c = lane & 3;
#pragma unroll
        for (int nt = 0; nt < NK; nt++) {
            s[nt][0] = 0.f; s[nt][1] = 0.f; s[nt][2] = 0.f; s[nt][3] = 0.f;
            u32 w[(KRB + 3) / 4];
            load_run<KRB>(tile + (key0 + nt * 8 + (lane >> 2)) * KROW + c * KRB, w);
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                u32 b0, b1;
                Codes<KB, KR>::group(w, kk, klo, khi, b0, b1);
                mma_f16(s[nt], q.qa[kk], b0, b1);
            }
            const u32 sc = *(const u32*)(tile + TK * KROW + (key0 + nt * 8 + 2 * c) * 2);
            const float s0 = KS * f16_to_f32((u16)(sc & 0xffffu)), s1 = KS * f16_to_f32((u16)(sc >> 16));
            s[nt][0] *= s0; s[nt][1] *= s1; s[nt][2] *= s0; s[nt][3] *= s1;
        }
    }

    template <int TK, int NK>
    __device__ __forceinline__ void accumulate(float (&o)[D / 8][4], const float (&p)[NK][4],
                                               const unsigned char* tile, int key0, int lane) const {
        const int c = lane & 3, g = lane >> 2;
        const unsigned char* scales = tile + TK * VROW;
#pragma unroll
        for (int k = 0; k < NK / 2; k++) {
            // Weights × the keys' value scales, as A fragments (a weight of exactly 0 — a
            // masked key — stays 0 whatever its stale scale).
            u32 pa[4];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int nt = 2 * k + h;
                const u32 sc = *(const u32*)(scales + (key0 + nt * 8 + 2 * c) * 2);
                const float s0 = VS * f16_to_f32((u16)(sc & 0xffffu)), s1 = VS * f16_to_f32((u16)(sc >> 16));
                auto w = [](float pv, float sv) { return pv > 0.f ? pv * sv : 0.f; };
                pa[2 * h] = pack_f16(w(p[nt][0], s0), w(p[nt][1], s1));
                pa[2 * h + 1] = pack_f16(w(p[nt][2], s0), w(p[nt][3], s1));
            }
            // The runs of this lane's value dims of keys 2c, 2c+1, 2c+8, 2c+9 of the step.
            u32 w[4][(VRB + 3) / 4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int key = key0 + 16 * k + 2 * c + (i & 1) + 8 * (i >> 1);
                load_run<VRB>(tile + key * VROW + g * VRB, w[i]);
            }
#pragma unroll
            for (int vg = 0; vg < VR / 4; vg++) {
                u32 x[4][2];
#pragma unroll
                for (int i = 0; i < 4; i++) Codes<VB, VR>::group(w[i], vg, vlo, vhi, x[i][0], x[i][1]);
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const u32 sel = (j & 1) ? 0x7632u : 0x5410u;
                    const u32 b0 = prmt(x[0][j >> 1], x[1][j >> 1], sel);
                    const u32 b1 = prmt(x[2][j >> 1], x[3][j >> 1], sel);
                    mma_f16(o[4 * vg + j], pa, b0, b1);
                }
            }
        }
    }
};

// The cp.async pipeline of a keys-as-M coded kernel (KC = KvCodes): tile t of `ntiles` (TK keys
// from k0) into stage t % STAGES (K tile at its start, V tile kt bytes in), one commit group
// per tile. Each thread's block-table entry is read a tile ahead of its copies: read just
// before them, its latency stalled every warp once a tile.
template <class KC, int TK, int STAGES, int NTH>
struct CodeTiles {
    const KC& f;
    unsigned char* stage;
    int kt, stage_bytes, k0, k1, ntiles;
    const PagedKv& kv;
    const void* kc;
    const void* vc;
    int tid;
    u32 blk = 0;   // the entry of the next tile to request

    __device__ __forceinline__ void lookup(int t) {
        if (t < ntiles) blk = CodeRun<TK / 16, NTH>(k0 + t * TK, k1, tid).block(kv);
    }
    __device__ __forceinline__ void issue(int t) {
        if (t < ntiles) {
            unsigned char* ks = stage + (u64)(t % STAGES) * stage_bytes;
            f.template stage_with<TK, NTH, true>(ks, ks + kt, k0 + t * TK, k1, blk, kv, kc, vc, tid);
        }
        cp_async_commit();
    }
    // Tiles 0 .. STAGES - 2 requested, the next one's entry read.
    __device__ __forceinline__ void start() {
#pragma unroll
        for (int t = 0; t < STAGES - 1; t++) {
            lookup(t);
            issue(t);
        }
        lookup(STAGES - 1);
    }
    // After the barrier that frees tile t - 1's stage: tile t + STAGES - 1 requested, the
    // entry of the one after it read.
    __device__ __forceinline__ void advance(int t) {
        issue(t + STAGES - 1);
        lookup(t + STAGES);
    }
};

// 2^x in one MUFU instruction (exp2f adds a range check and two multiplies for results
// below 2^-126, which here are softmax weights that round away in f16 anyway).
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ---- Coded decode attention with the keys as the MMAs' M (GQA groups of at most 8) -------
// The template above puts the g query heads in the 16 rows of every MMA, so for g = 4 three
// quarters of the score fragments, softmax work and accumulator rescales are padding. Here the
// 16 keys of a step are the rows instead: scores are Sᵀ = K·Qᵀ (K codes as the A fragment,
// the queries as an 8-column B), and the output is Oᵀ = Vᵀ·Pᵀ (value codes as the A
// fragment, the weights transposed into a B fragment with `movmatrix`). Per 16 keys that is
// D/16 + D/16 MMAs instead of D/8 + D/8, and each lane's softmax state covers two heads.
//
// Lane (c = lane % 4, q = lane / 4): scores of keys q and q + 8 of each step for heads 2c and
// 2c + 1; it unpacks run c (D/4 dims) of those keys' key records — the k columns 2c, 2c + 1,
// 2c + 8, 2c + 9 of each MMA — and run q (D/8 dims) of keys 2c, 2c + 1, 2c + 8, 2c + 9's value
// records, which are the M rows q and q + 8 of the value MMAs. Its B fragment holds head q's
// query at the dims of run c. Same grid, tiles, splits and merge as the template; requires
// g <= 8.
__device__ __forceinline__ u32 movmatrix_trans(u32 x) {
    u32 d;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(x));
    return d;
}

// The end of a keys-as-M block: each warp's state (o[nd]: Oᵀ rows q, q + 8 of value MMA nd, at
// dims q·VR + Codes<VB, VR>::dim(nd / 2, 2(nd % 2)) and the next slot, columns heads 2c,
// 2c + 1; log2 units) merged through shared memory into the split's partial (the caller then
// ends the block: coded_block_end).
template <int D, int VB, int NW>
__device__ __forceinline__ void keys_as_m_finish(float* sh, const float (&o)[D / 16][4], float m0,
    float m1, float l0, float l1, int g, int r, int kh, int sp, int n_heads, int n_splits,
    float* __restrict__ part_ml, float* __restrict__ part_acc)
{
    constexpr int NTH = NW * 32, VR = D / 8;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, c = lane & 3, q = lane >> 2;
#pragma unroll
    for (int x = 4; x < 32; x <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, x);
        l1 += __shfl_xor_sync(0xffffffffu, l1, x);
    }
    __syncthreads();              // stages are reused for the warps' states
    // Per warp: m[8], l[8], acc[8][D] (log2 units).
    float* ws = sh + (u64)warp * 8 * (D + 2);
    if (q == 0) { ws[2 * c] = m0; ws[2 * c + 1] = m1; ws[8 + 2 * c] = l0; ws[8 + 2 * c + 1] = l1; }
#pragma unroll
    for (int nd = 0; nd < D / 16; nd++) {
        const int vg = nd >> 1, h = nd & 1;
        const int dx = q * VR + Codes<VB, VR>::dim(vg, 2 * h);
        const int dy = q * VR + Codes<VB, VR>::dim(vg, 2 * h + 1);
        ws[16 + (2 * c) * D + dx] = o[nd][0];
        ws[16 + (2 * c + 1) * D + dx] = o[nd][1];
        ws[16 + (2 * c) * D + dy] = o[nd][2];
        ws[16 + (2 * c + 1) * D + dy] = o[nd][3];
    }
    __syncthreads();
    store_split_partial<D, NW>(sh, 8, g, r, kh, sp, n_heads, n_splits, part_ml, part_acc, tid, NTH);
}

// The keys of coded split `sp` (of n_coded) of a decode row at `pos`, for the keys-as-M
// kernels: tiles of TK keys from k0 (runs of 16 keys are staged whole, so a sliding window
// starts at its first key's run), keys below klo and from k1 on masked.
struct CodedKeys { int k0, k1, klo, ntiles; };
template <int TK>
__device__ __forceinline__ CodedKeys coded_keys(const ExactArgs& xa, int pos, int window, int sp,
                                                int n_coded)
{
    const CodedRange cr = coded_range(xa, pos + 1);
    const int wlo = window_lo(pos, window);
    const int base = wlo & ~15;
    const int chunk = ((cr.hi - base + n_coded - 1) / n_coded + TK - 1) / TK * TK;
    const int k0 = base + sp * chunk;
    const int k1 = min(k0 + chunk, cr.hi);
    return {k0, k1, max(cr.lo, wlo), k1 > k0 ? (k1 - k0 + TK - 1) / TK : 0};
}

// A windowed pool's exact split, when block (r, kh, sp) is one (sp >= n_coded): run whole, merge
// included; true if it was (the caller returns).
template <int D, int NW>
__device__ __forceinline__ bool exact_split_block(float* sh, ATTN_PARAMS, const ExactArgs& xa,
                                                  int window, int n_coded, int kh)
{
    const int g = n_heads / n_kv;
    const int r = blockIdx.x, sp = blockIdx.z;
    if (sp < n_coded) return false;
    const u32 pos = tok_pos[r];
    pdl_wait();
    attn_exact_split<D, NW>(sh, xa, qkv + (u64)r * width + (u64)kh * g * D, scale * 1.4426950408889634f,
                            g, r, kh, sp, sp - n_coded, n_heads, n_kv, n_splits, tok_seq[r], (int)pos + 1,
                            window_lo((int)pos, window), block_size, part_ml, part_acc);
    attn_merge_last(sh, g, D, n_heads, n_kv, kh, n_splits, counters, part_ml, part_acc, out, out_bf16, sinks);
    return true;
}


// The online softmax of a keys-as-M tile's scores s (Sᵀ fragments of the warp's NS steps of
// 16 keys, heads 2c, 2c + 1; masked keys -inf, log2 units), then s holds the weights
// exp2(s − m), added into l. The running maxima m move only when a score passes them by more
// than LAZY: the test is one vote on each lane's own scores, and the cross-lane reduction and
// the rescale of l and o run only then (after the first tiles, rarely). A weight is therefore
// at most 2^LAZY, which the sums in f32 and the weights' f16 or u8 forms take as they take 1
// (f16 holds a weight × value scale for scales up to 65504 / 2^LAZY).
template <int D, int NS, int LAZY>
__device__ __forceinline__ void keys_as_m_softmax(float (&o)[D / 16][4], float (&s)[NS][4], float& m0,
    float& m1, float& l0, float& l1)
{
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int st = 0; st < NS; st++) {
        mx0 = fmaxf(mx0, fmaxf(s[st][0], s[st][2]));
        mx1 = fmaxf(mx1, fmaxf(s[st][1], s[st][3]));
    }
    if (__any_sync(0xffffffffu, mx0 > m0 + LAZY || mx1 > m1 + LAZY)) {
#pragma unroll
        for (int x = 4; x < 32; x <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
        }
        mx0 = fmaxf(mx0, m0);
        mx1 = fmaxf(mx1, m1);
        const float c0 = exp2_ftz(m0 - mx0), c1 = exp2_ftz(m1 - mx1);
        m0 = mx0; m1 = mx1;
        l0 *= c0; l1 *= c1;
#pragma unroll
        for (int nd = 0; nd < D / 16; nd++) {
            o[nd][0] *= c0; o[nd][1] *= c1; o[nd][2] *= c0; o[nd][3] *= c1;
        }
    }
#pragma unroll
    for (int st = 0; st < NS; st++) {
        s[st][0] = exp2_ftz(s[st][0] - m0); s[st][1] = exp2_ftz(s[st][1] - m1);
        s[st][2] = exp2_ftz(s[st][2] - m0); s[st][3] = exp2_ftz(s[st][3] - m1);
        l0 += s[st][0] + s[st][2];
        l1 += s[st][1] + s[st][3];
    }
}

// The weights p of a keys-as-M tile (keys_as_m_softmax) × `mul` × the keys' value scales (at
// vsc, one per tile row): heads 2c, 2c + 1 of keys q, q + 8 of each step. A masked key's weight
// is exactly 0 and stays 0 whatever its stale scale.
template <int NS>
__device__ __forceinline__ void scaled_weights(float (&w)[NS][4], const float (&p)[NS][4],
                                               const u16* vsc, float mul, int kw, int lane)
{
    const int q = lane >> 2;
#pragma unroll
    for (int st = 0; st < NS; st++) {
        const int ka = kw + 16 * st + q, kb = ka + 8;
        const float va = mul * f16_to_f32(vsc[ka]), vb = mul * f16_to_f32(vsc[kb]);
        w[st][0] = p[st][0] > 0.f ? p[st][0] * va : 0.f;
        w[st][1] = p[st][1] > 0.f ? p[st][1] * va : 0.f;
        w[st][2] = p[st][2] > 0.f ? p[st][2] * vb : 0.f;
        w[st][3] = p[st][3] > 0.f ? p[st][3] * vb : 0.f;
    }
}

// O += W·V for a keys-as-M tile: the scaled weights w (scaled_weights) as f16 B fragments, the
// staged value codes at vs (tile records) looked up as f16 centroids.
template <int D, int VB, int NS>
__device__ __forceinline__ void values_f16(float (&o)[D / 16][4], const float (&w)[NS][4],
    const unsigned char* vs, const u32* vlo, const u32* vhi, int kw, int lane)
{
    constexpr int VROW = D * code_bits(VB) / 8, VR = D / 8, VRB = VR * code_bits(VB) / 8;
    const int c = lane & 3, q = lane >> 2;
#pragma unroll
    for (int st = 0; st < NS; st++) {
        const u32 pb0 = movmatrix_trans(pack_f16(w[st][0], w[st][1]));
        const u32 pb1 = movmatrix_trans(pack_f16(w[st][2], w[st][3]));
        // Value runs q of keys 2c, 2c + 1, 2c + 8, 2c + 9 of the step.
        u32 vw[4][(VRB + 3) / 4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int key = kw + 16 * st + 2 * c + (i & 1) + 8 * (i >> 1);
            load_code_run<VROW, VRB, true>(vs, key * VROW + q * VRB, vw[i]);
        }
#pragma unroll
        for (int vg = 0; vg < VR / 4; vg++) {
            u32 x[4][2];
#pragma unroll
            for (int i = 0; i < 4; i++) Codes<VB, VR>::group(vw[i], vg, vlo, vhi, x[i][0], x[i][1]);
#pragma unroll
            for (int h = 0; h < 2; h++) {   // value MMA 2vg + h: slots 2h (row q), 2h + 1 (row q + 8)
                u32 a[4];
                a[0] = prmt(x[0][h], x[1][h], 0x5410u);
                a[1] = prmt(x[0][h], x[1][h], 0x7632u);
                a[2] = prmt(x[2][h], x[3][h], 0x5410u);
                a[3] = prmt(x[2][h], x[3][h], 0x7632u);
                mma_f16(o[2 * vg + h], a, pb0, pb1);
            }
        }
    }
}

// The rest of a keys-as-M tile after the scores s: the online softmax update and O += P·V
// over the staged value codes at vs (records of the tile, scales at vs + vsc_at) as f16.
template <int D, int VB, int NS>
__device__ __forceinline__ void keys_as_m_values(float (&o)[D / 16][4], float (&s)[NS][4], float& m0,
    float& m1, float& l0, float& l1, const unsigned char* vs, int vsc_at, const u32* vlo, const u32* vhi,
    int kw, int lane)
{
    keys_as_m_softmax<D, NS, 4>(o, s, m0, m1, l0, l1);
    float w[NS][4];
    scaled_weights<NS>(w, s, (const u16*)(vs + vsc_at), code_scale(VB), kw, lane);
    values_f16<D, VB, NS>(o, w, vs, vlo, vhi, kw, lane);
}

template <int D, int KB, int VB, int TK, int STAGES, int NW>
__device__ __forceinline__ void attn_codes_m_impl(float* sh, ATTN_PARAMS, const u32* fmt,
                                                  const ExactArgs& xa, int window)
{
    constexpr int NTH = NW * 32, KPW = TK / NW, NS = KPW / 16;   // 16-key steps per warp
    static_assert(KPW % 16 == 0, "a warp's keys are whole 16-key steps");
    using KC = KvCodes<D, KB, VB>;
    constexpr int KROW = KC::KROW, VROW = KC::VROW, KR = KC::KR, KRB = KC::KRB;
    constexpr int KT = KC::template k_tile_bytes<TK>(), VT = KC::template v_tile_bytes<TK>();
    constexpr int STAGE_BYTES = KT + VT;
    const int n_coded = n_splits - exact_splits(xa);
    const int kh = coded_kv_head(fmt, n_kv);
    if (exact_split_block<D, NW>(sh, ATTN_ARGS, xa, window, n_coded, kh)) return;
    const int g = n_heads / n_kv;
    const int r = blockIdx.x, sp = blockIdx.z, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, c = lane & 3, q = lane >> 2;
    const CodedKeys ck = coded_keys<TK>(xa, (int)tok_pos[r], window, sp, n_coded);
    const int k0 = ck.k0, k1 = ck.k1, klo = ck.klo, ntiles = ck.ntiles;
    const PagedKv kv(tables + seq_tbl[tok_seq[r]], n_kv, kh, block_size);
    const KC f(fmt);
    unsigned char* stage = (unsigned char*)sh;   // [STAGES][K tile, V tile]
    CodeTiles<KC, TK, STAGES, NTH> tiles{f, stage, KT, STAGE_BYTES, k0, k1, ntiles, kv, k_cache, v_cache, tid};
    pdl_wait();
    tiles.start();

    // Head q's query at run c's dims, as B fragments (zero for heads past g).
    u32 qb[D / 16][2];
    {
        const float* qh = q < g ? qkv + (u64)r * width + (u64)(kh * g + q) * D : nullptr;
        const float qs = scale * 1.4426950408889634f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            float x[4];
#pragma unroll
            for (int j = 0; j < 4; j++) x[j] = qh ? qh[c * KR + Codes<KB, KR>::dim(kk, j)] * qs : 0.f;
            qb[kk][0] = pack_f16(x[0], x[1]);
            qb[kk][1] = pack_f16(x[2], x[3]);
        }
    }
    // o[nd]: Oᵀ rows q, q + 8 of value MMA nd (dims out_dim(nd, 0 / 1)), heads 2c, 2c + 1.
    float o[D / 16][4];
#pragma unroll
    for (int nd = 0; nd < D / 16; nd++) { o[nd][0] = 0.f; o[nd][1] = 0.f; o[nd][2] = 0.f; o[nd][3] = 0.f; }
    float m0 = -1e30f, m1 = -1e30f, l0 = 0.f, l1 = 0.f;   // heads 2c, 2c + 1 (log2 units)
    for (int t = 0; t < ntiles; t++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();          // tile t landed for all; tile t-1's stage is free
        tiles.advance(t);
        const unsigned char* ks = stage + (u64)(t % STAGES) * STAGE_BYTES;
        const unsigned char* vs = ks + KT;
        const int kw = warp * KPW;                 // the warp's first key in the tile
        const int key0 = k0 + t * TK + kw;
        const bool interior = key0 >= klo && key0 + KPW <= k1;   // no key of the warp's masked
        float s[NS][4];
#pragma unroll
        for (int st = 0; st < NS; st++) {
            const int ka = kw + 16 * st + q, kb = ka + 8;   // this lane's two keys (tile rows)
            u32 wa[(KRB + 3) / 4], wb[(KRB + 3) / 4];
            load_code_run<KROW, KRB, false>(ks, ka * KROW + c * KRB, wa);
            load_code_run<KROW, KRB, false>(ks, kb * KROW + c * KRB, wb);
            s[st][0] = 0.f; s[st][1] = 0.f; s[st][2] = 0.f; s[st][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                u32 a[4];
                Codes<KB, KR>::group(wa, kk, f.klo, f.khi, a[0], a[2]);
                Codes<KB, KR>::group(wb, kk, f.klo, f.khi, a[1], a[3]);
                mma_f16(s[st], a, qb[kk][0], qb[kk][1]);
            }
            const u16* ksc = (const u16*)(ks + TK * KROW);
            const float sa = KC::KS * f16_to_f32(ksc[ka]), sb = KC::KS * f16_to_f32(ksc[kb]);
            s[st][0] *= sa; s[st][1] *= sa; s[st][2] *= sb; s[st][3] *= sb;
            if (!interior) {
                const int pa = key0 + 16 * st + q, pb = pa + 8;
                const bool la = pa < k1 && pa >= klo, lb = pb < k1 && pb >= klo;
                if (!la) { s[st][0] = -INFINITY; s[st][1] = -INFINITY; }
                if (!lb) { s[st][2] = -INFINITY; s[st][3] = -INFINITY; }
            }
        }
        keys_as_m_values<D, VB, NS>(o, s, m0, m1, l0, l1, vs, TK * VROW, f.vlo, f.vhi, kw, lane);
    }
    cp_async_wait<0>();
    keys_as_m_finish<D, VB, NW>(sh, o, m0, m1, l0, l1, g, r, kh, sp, n_heads, n_splits, part_ml,
                                part_acc);
    coded_block_end<D, NW>(sh, ATTN_ARGS, xa, window, n_coded, kh);
}

// ---- Coded decode attention with the key products in int8 (TurboQuant keys, g <= 8) -----
// The keys-as-M kernel above spends about as many instructions making f16 MMA operands of key
// codes (four prmt per four codes: the centroids' low and high bytes, then interleaved) as of
// value codes. Here a key code becomes one int8 byte, four per prmt from an 8-byte table of
// the centroids × α rounded to integers (`codes::int8_table`: α puts the largest centroid
// near 127, so a centroid moves by at most 0.4% of the largest), and the score MMAs are
// m16n8k32 in int8 with int32 sums — native on sm_80+ (e4m3 MMAs, tried first, are emulated
// on sm_90 by conversions to f16). The query is two int8 terms (hi·256 + lo: 16 bits), so the
// scores are as close as the f16 kernel's apart from the centroids' rounding. Values are
// summed as in the f16 kernel. In the kernels with int8 value products (V8) a 4-bit
// sign-magnitude key code takes two one-sided lookups whose bytes sum to the centroid
// (Codes<4>::int8_pair): two MMAs per operand, but one prmt and no select per four codes for
// each.
//
// Lane (q, c) reads run c of keys q and q + 8 as there; the lookups' bytes are its A registers
// (k slots 4c .. 4c + 3 of MMA kk: group 2kk of the run, slots 16 + 4c ..: group 2kk + 1), and
// head q's query at the same dims its B column.
__device__ __forceinline__ void mma_s8(int* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Descriptor words of the int8 key codebook (cuda/codes.rs `INT8_TABLE_WORD`): two words of
// table bytes (entry j in byte j; 4-bit records: the 8 magnitudes, then two words of their
// negatives), then 1/α as f32 bits. 4-bit records also have the two tables of
// Codes<4>::int8_pair from `INT8_PAIR_WORD`.
constexpr int INT8_TABLE_WORD = 288;
constexpr int INT8_PAIR_WORD = 296;

// m16n8k32 with s8 A, u8 B and int32 sums: d = a·b + c (c not overwritten).
__device__ __forceinline__ void mma_s8u8(int* d, const u32* a, u32 b0, u32 b1, int c) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c), "r"(c),
                   "r"(c), "r"(c));
}
// The same with d's own sums as c: d += a·b.
__device__ __forceinline__ void mma_s8u8_acc(int* d, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Descriptor words of a role's int8 value codebook (cuda/codes.rs `INT8_VALUE_WORD`): two
// words of table bytes, round(c[j] / step) with step = max|c| / 127 (the CPU backend's int8
// value table), then step as f32 bits.
constexpr int INT8_VALUE_WORD = 293;
// 1.5 · 2^23: an int32 x with |x| < 2^22 added to its bits reads as the float MAGIC + x, so
// the MMAs' sums start from it and become floats with one subtraction, and a float y in
// [0, 2^22) plus MAGIC holds round(y) in its low bits.
constexpr float MAGIC = 12582912.0f;

// keys_as_m_values with the value products in int8 (2- and 3-bit value codes): per warp tile
// of 32 or 64 keys (NS = 2 or 4 steps), each head's weights × value scales are rounded to u8
// against the tile's largest (so a weight moves by at most 0.5/255 of it), the codes are
// looked up as int8 centroids (four per prmt, then a 4×4 byte transpose gives each A register
// one dim of four keys), and one s8×u8 MMA per 16 dims and 32 keys sums the tile into int32
// (|sum| < 64·255·127 < 2^22), which is scaled into the f32 accumulators once per tile: the
// softmax's reductions, the scale and that epilogue are paid once per 64 keys. Each 32 keys in
// k order: slots 4c .. 4c + 3 are keys 2c, 2c + 1, 2c + 8, 2c + 9 of its first step (what
// `movmatrix` hands lane c), 16 + 4c .. of its second.
template <int D, int VB, int NS>
__device__ __forceinline__ void keys_as_m_values_s8(float (&o)[D / 16][4], float (&s)[NS][4], float& m0,
    float& m1, float& l0, float& l1, const unsigned char* vs, int vsc_at, const u32* vtab, float vstep,
    const u32* vlo, const u32* vhi, int kw, int lane)
{
    static_assert((NS == 2 || NS == 4) && (VB == 2 || VB == 3), "32- or 64-key tiles of 2- or 3-bit value codes");
    constexpr int VROW = D * VB / 8, VR = D / 8, VRB = VR * VB / 8;
    const int c = lane & 3, q = lane >> 2;
    keys_as_m_softmax<D, NS, 8>(o, s, m0, m1, l0, l1);
    float w[NS][4];
    scaled_weights<NS>(w, s, (const u16*)(vs + vsc_at), 1.f, kw, lane);
    // Scales are norms, so weights × scales are finite and non-negative in any cache the
    // encoders wrote; a tile holding another (a corrupt or hand-made block) would wrap in the
    // u8 rounding, and takes the f16 sums instead, as the CPU backend's spans take its f32 pass.
    u32 top = 0;   // the largest bit pattern: below +inf's iff every weight is in [+0, +inf)
#pragma unroll
    for (int st = 0; st < NS; st++)
#pragma unroll
        for (int j = 0; j < 4; j++) top = max(top, __float_as_uint(w[st][j]));
    if (!__all_sync(0xffffffffu, top < 0x7f800000u)) {
        values_f16<D, VB, NS>(o, w, vs, vlo, vhi, kw, lane);
        return;
    }
    // Each head's largest over the tile.
    float w0 = 0.f, w1 = 0.f;
#pragma unroll
    for (int st = 0; st < NS; st++) {
        w0 = fmaxf(w0, fmaxf(w[st][0], w[st][2]));
        w1 = fmaxf(w1, fmaxf(w[st][1], w[st][3]));
    }
#pragma unroll
    for (int x = 4; x < 32; x <<= 1) {
        w0 = fmaxf(w0, __shfl_xor_sync(0xffffffffu, w0, x));
        w1 = fmaxf(w1, __shfl_xor_sync(0xffffffffu, w1, x));
    }
    // (w0 is a weight times a norm, far below __fdividef's 2^126; its error is ulps.)
    const float u0 = w0 > 0.f ? __fdividef(255.f, w0) : 0.f, u1 = w1 > 0.f ? __fdividef(255.f, w1) : 0.f;
    const float k0 = w0 * (1.f / 255.f) * vstep, k1 = w1 * (1.f / 255.f) * vstep;
    // The u8 weights as B fragments: per step, the rounded weights' bits (round(w·u) in the
    // low half of MAGIC + w·u) paired by key, transposed to head q's keys 2c, 2c + 1 (and
    // 2c + 8, 2c + 9), then the four keys' low bytes.
    u32 wb[NS];
#pragma unroll
    for (int st = 0; st < NS; st++) {
        auto bits = [](float x, float u) { return __float_as_uint(fmaf(x, u, MAGIC)); };
        const u32 ka = movmatrix_trans(prmt(bits(w[st][0], u0), bits(w[st][1], u1), 0x5410u));
        const u32 kb = movmatrix_trans(prmt(bits(w[st][2], u0), bits(w[st][3], u1), 0x5410u));
        wb[st] = prmt(ka, kb, 0x6420u);
    }
    // Value runs q of keys 2c, 2c + 1, 2c + 8, 2c + 9 of every step.
    u32 vw[NS][4][(VRB + 3) / 4];
#pragma unroll
    for (int st = 0; st < NS; st++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int key = kw + 16 * st + 2 * c + (i & 1) + 8 * (i >> 1);
            load_code_run<VROW, VRB, true>(vs, key * VROW + q * VRB, vw[st][i]);
        }
    const int magic = __float_as_int(MAGIC);
#pragma unroll
    for (int vg = 0; vg < VR / 4; vg++) {
        // r[st][j]: dim slot j of group vg for the four keys of step st, one byte each.
        u32 r[NS][4];
#pragma unroll
        for (int st = 0; st < NS; st++) {
            u32 t[4];
#pragma unroll
            for (int i = 0; i < 4; i++) t[i] = Codes<VB, VR>::int8(vw[st][i], vg, vtab);
            const u32 e0 = prmt(t[0], t[1], 0x5140u), e1 = prmt(t[0], t[1], 0x7362u);
            const u32 f0 = prmt(t[2], t[3], 0x5140u), f1 = prmt(t[2], t[3], 0x7362u);
            r[st][0] = prmt(e0, f0, 0x5410u);
            r[st][1] = prmt(e0, f0, 0x7632u);
            r[st][2] = prmt(e1, f1, 0x5410u);
            r[st][3] = prmt(e1, f1, 0x7632u);
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {   // value MMA 2vg + h: slots 2h (row q), 2h + 1 (row q + 8)
            int d[4];
#pragma unroll
            for (int p = 0; p < NS; p += 2) {   // 32 keys per MMA
                const u32 a[4] = {r[p][2 * h], r[p][2 * h + 1], r[p + 1][2 * h], r[p + 1][2 * h + 1]};
                if (p == 0)
                    mma_s8u8(d, a, wb[0], wb[1], magic);
                else
                    mma_s8u8_acc(d, a, wb[p], wb[p + 1]);
            }
            float* on = o[2 * vg + h];
            on[0] = fmaf(__int_as_float(d[0]) - MAGIC, k0, on[0]);
            on[1] = fmaf(__int_as_float(d[1]) - MAGIC, k1, on[1]);
            on[2] = fmaf(__int_as_float(d[2]) - MAGIC, k0, on[2]);
            on[3] = fmaf(__int_as_float(d[3]) - MAGIC, k1, on[3]);
        }
    }
}

// V8: values through keys_as_m_values_s8 (2- and 3-bit value codes), else as f16. 4-bit keys
// are Codes<4>::int8_pair in both: two MMAs more than one signed lookup per four codes, but
// no select (tq4 measured faster so: BENCHMARKS.md, session 48).
template <int D, int KB, int VB, int TK, int STAGES, int NW, bool V8 = false>
__device__ __forceinline__ void attn_codes_k8_impl(float* sh, ATTN_PARAMS, const u32* fmt,
                                                   const ExactArgs& xa, int window)
{
    constexpr int NTH = NW * 32, KPW = TK / NW, NS = KPW / 16;   // 16-key steps per warp
    static_assert(KPW % 16 == 0, "a warp's keys are whole 16-key steps");
    using KC = KvCodes<D, KB, VB>;
    constexpr int KROW = KC::KROW, VROW = KC::VROW, KR = KC::KR, KRB = KC::KRB;
    constexpr int KT = KC::template k_tile_bytes<TK>(), VT = KC::template v_tile_bytes<TK>();
    constexpr int STAGE_BYTES = KT + VT;
    const int n_coded = n_splits - exact_splits(xa);
    const int kh = coded_kv_head(fmt, n_kv);
    if (exact_split_block<D, NW>(sh, ATTN_ARGS, xa, window, n_coded, kh)) return;
    const int g = n_heads / n_kv;
    const int r = blockIdx.x, sp = blockIdx.z, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, c = lane & 3, q = lane >> 2;
    const CodedKeys ck = coded_keys<TK>(xa, (int)tok_pos[r], window, sp, n_coded);
    const int k0 = ck.k0, k1 = ck.k1, klo = ck.klo, ntiles = ck.ntiles;
    const PagedKv kv(tables + seq_tbl[tok_seq[r]], n_kv, kh, block_size);
    const KC f(fmt);
    u32 ktab[4];
#pragma unroll
    for (int i = 0; i < 4; i++) ktab[i] = fmt[INT8_TABLE_WORD + i];
    u32 ptab[4];   // 4-bit keys' one-sided tables
#pragma unroll
    for (int i = 0; i < 4; i++) ptab[i] = fmt[INT8_PAIR_WORD + i];
    const u32 vtab[2] = {fmt[CODE_DESC_WORDS + INT8_VALUE_WORD], fmt[CODE_DESC_WORDS + INT8_VALUE_WORD + 1]};
    const float vstep = __uint_as_float(fmt[CODE_DESC_WORDS + INT8_VALUE_WORD + 2]);
    unsigned char* stage = (unsigned char*)sh;   // [STAGES][K tile, V tile]
    CodeTiles<KC, TK, STAGES, NTH> tiles{f, stage, KT, STAGE_BYTES, k0, k1, ntiles, kv, k_cache, v_cache, tid};
    pdl_wait();
    tiles.start();

    // Head q's query at run c's dims × `up` (largest |element| near 2^15) as hi·256 + lo with
    // hi, lo in [-128, 127], as B fragments (zero past g), kept in shared memory after the
    // stages ({hi, lo} of MMA kk at qf[32 kk]): in registers they would be 16 more live across
    // the whole loop. Warp 0 writes them; the loop's first barrier publishes them.
    const uint4* qf = (const uint4*)(stage + (u64)STAGES * STAGE_BYTES) + lane;
    float qn0, qn1;   // what the scores of heads 2c, 2c + 1 are multiplied by (with the key scale)
    {
        const float* qh = q < g ? qkv + (u64)r * width + (u64)(kh * g + q) * D : nullptr;
        float x[D / 16][4], amax = 0.f;
#pragma unroll
        for (int gi = 0; gi < D / 16; gi++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                x[gi][j] = qh ? qh[c * KR + Codes<KB, KR>::dim(gi, j)] : 0.f;
                amax = fmaxf(amax, fabsf(x[gi][j]));
            }
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        const float up = amax > 0.f ? 32512.f / amax : 1.f;
        if (warp == 0) {
#pragma unroll
            for (int kk = 0; kk < D / 32; kk++) {
                u32 hb[2] = {0, 0}, lb[2] = {0, 0};
#pragma unroll
                for (int h = 0; h < 2; h++)
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        const int v = __float2int_rn(x[2 * kk + h][j] * up);
                        const int hi = (v + 128) >> 8, lo = v - 256 * hi;
                        hb[h] |= (u32)(hi & 0xff) << (8 * j);
                        lb[h] |= (u32)(lo & 0xff) << (8 * j);
                    }
                ((uint4*)qf)[32 * kk] = make_uint4(hb[0], hb[1], lb[0], lb[1]);
            }
        }
        const float qn = scale * 1.4426950408889634f * __uint_as_float(fmt[INT8_TABLE_WORD + 4]) / up;
        qn0 = __shfl_sync(0xffffffffu, qn, 8 * c);
        qn1 = __shfl_sync(0xffffffffu, qn, 8 * c + 4);
    }
    // o[nd]: Oᵀ rows q, q + 8 of value MMA nd (dims out_dim(nd, 0 / 1)), heads 2c, 2c + 1.
    float o[D / 16][4];
#pragma unroll
    for (int nd = 0; nd < D / 16; nd++) { o[nd][0] = 0.f; o[nd][1] = 0.f; o[nd][2] = 0.f; o[nd][3] = 0.f; }
    float m0 = -1e30f, m1 = -1e30f, l0 = 0.f, l1 = 0.f;   // heads 2c, 2c + 1 (log2 units)
    for (int t = 0; t < ntiles; t++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();          // tile t landed for all; tile t-1's stage is free
        tiles.advance(t);
        const unsigned char* ks = stage + (u64)(t % STAGES) * STAGE_BYTES;
        const unsigned char* vs = ks + KT;
        const int kw = warp * KPW;                 // the warp's first key in the tile
        const int key0 = k0 + t * TK + kw;
        const bool interior = key0 >= klo && key0 + KPW <= k1;   // no key of the warp's masked
        float s[NS][4];
#pragma unroll
        for (int st = 0; st < NS; st++) {
            const int ka = kw + 16 * st + q, kb = ka + 8;   // this lane's two keys (tile rows)
            u32 wa[(KRB + 3) / 4], wb[(KRB + 3) / 4];
            load_code_run<KROW, KRB, false>(ks, ka * KROW + c * KRB, wa);
            load_code_run<KROW, KRB, false>(ks, kb * KROW + c * KRB, wb);
            // The high and low query terms' sums in separate chains.
            int acc[4] = {0, 0, 0, 0}, lo[4] = {0, 0, 0, 0};
#pragma unroll
            for (int kk = 0; kk < D / 32; kk++) {
                const uint4 qk = qf[32 * kk];
                if constexpr (KB == 4) {
                    // Two operands per four codes (Codes<4>::int8_pair), each multiplied by
                    // both query terms.
                    u32 n[4], p[4];
                    Codes<4, KR>::int8_pair(wa, 2 * kk, ptab, n[0], p[0]);
                    Codes<4, KR>::int8_pair(wb, 2 * kk, ptab, n[1], p[1]);
                    Codes<4, KR>::int8_pair(wa, 2 * kk + 1, ptab, n[2], p[2]);
                    Codes<4, KR>::int8_pair(wb, 2 * kk + 1, ptab, n[3], p[3]);
                    mma_s8(acc, n, qk.x, qk.y);
                    mma_s8(lo, n, qk.z, qk.w);
                    mma_s8(acc, p, qk.x, qk.y);
                    mma_s8(lo, p, qk.z, qk.w);
                } else {
                    const u32 a[4] = {Codes<KB, KR>::int8(wa, 2 * kk, ktab), Codes<KB, KR>::int8(wb, 2 * kk, ktab),
                                      Codes<KB, KR>::int8(wa, 2 * kk + 1, ktab),
                                      Codes<KB, KR>::int8(wb, 2 * kk + 1, ktab)};
                    mma_s8(acc, a, qk.x, qk.y);
                    mma_s8(lo, a, qk.z, qk.w);
                }
            }
#pragma unroll
            for (int e = 0; e < 4; e++) acc[e] = acc[e] * 256 + lo[e];
            const u16* ksc = (const u16*)(ks + TK * KROW);
            const float sa = f16_to_f32(ksc[ka]), sb = f16_to_f32(ksc[kb]);
            s[st][0] = (float)acc[0] * (sa * qn0); s[st][1] = (float)acc[1] * (sa * qn1);
            s[st][2] = (float)acc[2] * (sb * qn0); s[st][3] = (float)acc[3] * (sb * qn1);
            if (!interior) {
                const int pa = key0 + 16 * st + q, pb = pa + 8;
                const bool la = pa < k1 && pa >= klo, lb = pb < k1 && pb >= klo;
                if (!la) { s[st][0] = -INFINITY; s[st][1] = -INFINITY; }
                if (!lb) { s[st][2] = -INFINITY; s[st][3] = -INFINITY; }
            }
        }
        if constexpr (V8)   // (the f16 fallback's centroid tables straight from the descriptor)
            keys_as_m_values_s8<D, VB, NS>(o, s, m0, m1, l0, l1, vs, TK * VROW, vtab, vstep,
                                           fmt + CODE_DESC_WORDS + 24, fmt + CODE_DESC_WORDS + 28, kw, lane);
        else
            keys_as_m_values<D, VB, NS>(o, s, m0, m1, l0, l1, vs, TK * VROW, f.vlo, f.vhi, kw, lane);
    }
    cp_async_wait<0>();
    keys_as_m_finish<D, VB, NW>(sh, o, m0, m1, l0, l1, g, r, kh, sp, n_heads, n_splits, part_ml,
                                part_acc);
    coded_block_end<D, NW>(sh, ATTN_ARGS, xa, window, n_coded, kh);
}

// Bytes of a tile of tk keys: K and V code records and their f16 scales.
constexpr int code_tile_bytes(int d, int kb, int vb, int tk) {
    return tk * (d * code_bits(kb) / 8 + 2 + d * code_bits(vb) / 8 + 2);
}
// Pipeline stages of a coded kernel: enough that about 48 KiB of tiles are in flight per
// block (a tile of compressed keys is small, and the bytes in flight bound the bandwidth),
// 2 to 6. Must match `code_stages` in cuda/codes.rs.
constexpr int code_stages(int d, int kb, int vb, int tk) {
    const int tile = code_tile_bytes(d, kb, vb, tk);
    const int s = (49152 + tile - 1) / tile;
    return s < 2 ? 2 : (s > 6 ? 6 : s);
}
// The int8-value kernels' tiling (cuda/codes.rs `CodeVariant::int8_values_tiling`): four
// blocks per SM (a quarter of 228 KiB, less the 1 KiB a block reserves) hold the stages and
// the query fragments; 256-key tiles where two stages fit, else 128; stages as code_stages
// but no more than fit.
constexpr int V8_BLOCK_SMEM = 57344;
constexpr int v8_fit(int d, int kb, int vb, int tk) {
    return (V8_BLOCK_SMEM - d * 16) / code_tile_bytes(d, kb, vb, tk);
}
constexpr int v8_tile(int d, int kb, int vb) { return v8_fit(d, kb, vb, 256) >= 2 ? 256 : 128; }
constexpr int v8_stages(int d, int kb, int vb) {
    const int tk = v8_tile(d, kb, vb), s = code_stages(d, kb, vb, tk), f = v8_fit(d, kb, vb, tk);
    return s < f ? s : f;
}

// The exact window's kernel parameters (ExactArgs; xtbl null: no window).
#define ATTN_EXACT_PARAMS const u16* __restrict__ xk, const u16* __restrict__ xv, \
    const u32* __restrict__ xtbl, int x_sinks, int x_recent, int x_q8, int x_per_split
// attn_codes_{D}_{KB}_{VB}: the template on coded K / V of KB / VB bits (8: int8, f8: fp8), 128-key
// tiles, 4 warps; `window` > 0: a sliding window. The list must match CODE_FORMS and
// CodeVariant::has_template in cuda/codes.rs.
#define ATTN_CODES(D, KB, VB) \
    extern "C" __global__ void __launch_bounds__(128, 3) attn_codes_##D##_##KB##_##VB(ATTN_PARAMS, \
        const u32* __restrict__ fmt, ATTN_EXACT_PARAMS, int window) { \
        extern __shared__ float sh[]; \
        const ExactArgs xa{xk, xv, xtbl, x_sinks, x_recent, x_q8, x_per_split}; \
        attn_decode_impl<KvCodes<D, KB, VB>, D, 128, code_stages(D, KB, VB, 128), 4>(sh, ATTN_ARGS, fmt, xa, \
                                                                                   window); \
    }
// attn_codes_m_{D}_{KB}_{VB}: the keys-as-M kernel (g <= 8), same tiles, MB blocks per SM (4;
// 2 at head_dim 256, whose query and accumulator fragments alone are 96 registers).
#define ATTN_CODES_M(D, KB, VB, MB) \
    extern "C" __global__ void __launch_bounds__(128, MB) attn_codes_m_##D##_##KB##_##VB(ATTN_PARAMS, \
        const u32* __restrict__ fmt, ATTN_EXACT_PARAMS, int window) { \
        extern __shared__ float sh[]; \
        const ExactArgs xa{xk, xv, xtbl, x_sinks, x_recent, x_q8, x_per_split}; \
        attn_codes_m_impl<D, KB, VB, 128, code_stages(D, KB, VB, 128), 4>(sh, ATTN_ARGS, fmt, xa, window); \
    }
#define ATTN_CODES_BOTH(D, KB, VB) ATTN_CODES(D, KB, VB) ATTN_CODES_M(D, KB, VB, 4)
#define ATTN_CODES_FORMS(X, ...) \
    X(__VA_ARGS__, 8, 8) X(__VA_ARGS__, f8, f8) \
    X(__VA_ARGS__, 4, 4) X(__VA_ARGS__, 4, 3) X(__VA_ARGS__, 4, 2) \
    X(__VA_ARGS__, 3, 4) X(__VA_ARGS__, 3, 3) X(__VA_ARGS__, 3, 2) \
    X(__VA_ARGS__, 2, 4) X(__VA_ARGS__, 2, 3) X(__VA_ARGS__, 2, 2)
ATTN_CODES_FORMS(ATTN_CODES_BOTH, 64)
ATTN_CODES_FORMS(ATTN_CODES_BOTH, 128)
// attn_codes_k8_{D}_{KB}_{VB}: the keys-as-M kernel with int8 key products, for TurboQuant keys
// and values (g <= 8), head dims 64 and 128. The list must match CodeVariant::has_int8_keys in
// cuda/codes.rs.
#define ATTN_CODES_K8(D, KB, VB) \
    extern "C" __global__ void __launch_bounds__(128, 4) attn_codes_k8_##D##_##KB##_##VB(ATTN_PARAMS, \
        const u32* __restrict__ fmt, ATTN_EXACT_PARAMS, int window) { \
        extern __shared__ float sh[]; \
        const ExactArgs xa{xk, xv, xtbl, x_sinks, x_recent, x_q8, x_per_split}; \
        attn_codes_k8_impl<D, KB, VB, 128, code_stages(D, KB, VB, 128), 4>(sh, ATTN_ARGS, fmt, xa, window); \
    }
#define ATTN_CODES_TQ_FORMS(X, ...) \
    X(__VA_ARGS__, 4, 4) X(__VA_ARGS__, 4, 3) X(__VA_ARGS__, 4, 2) \
    X(__VA_ARGS__, 3, 4) X(__VA_ARGS__, 3, 3) X(__VA_ARGS__, 3, 2) \
    X(__VA_ARGS__, 2, 4) X(__VA_ARGS__, 2, 3) X(__VA_ARGS__, 2, 2)
ATTN_CODES_TQ_FORMS(ATTN_CODES_K8, 64)
ATTN_CODES_TQ_FORMS(ATTN_CODES_K8, 128)
// attn_codes_k8v_{D}_{KB}_{VB}: the same with the value products in int8 too, for 2- and
// 3-bit value codes, in tiles of 256 keys (64 per warp: keys_as_m_values_s8's per-tile work is
// paid once per 64 keys) where two stages of them fit with four blocks per SM, else 128 (see
// v8_tile, v8_stages). Registers are capped for three blocks per SM, not four: under 128 the
// compiler copied the centroid tables out of uniform registers before most lookups (about
// 100 moves per tile). At head_dim 128 all forms but k4v3 now take 133-158 registers and run
// three blocks (BENCHMARKS.md, session 36). The list must match
// CodeVariant::has_int8_values in cuda/codes.rs.
#define ATTN_CODES_K8V(D, KB, VB) \
    extern "C" __global__ void __launch_bounds__(128, 3) attn_codes_k8v_##D##_##KB##_##VB(ATTN_PARAMS, \
        const u32* __restrict__ fmt, ATTN_EXACT_PARAMS, int window) { \
        extern __shared__ float sh[]; \
        const ExactArgs xa{xk, xv, xtbl, x_sinks, x_recent, x_q8, x_per_split}; \
        attn_codes_k8_impl<D, KB, VB, v8_tile(D, KB, VB), v8_stages(D, KB, VB), 4, true>( \
            sh, ATTN_ARGS, fmt, xa, window); \
    }
#define ATTN_CODES_V8_FORMS(X, ...) \
    X(__VA_ARGS__, 4, 3) X(__VA_ARGS__, 4, 2) X(__VA_ARGS__, 3, 3) X(__VA_ARGS__, 3, 2) \
    X(__VA_ARGS__, 2, 3) X(__VA_ARGS__, 2, 2)
ATTN_CODES_V8_FORMS(ATTN_CODES_K8V, 64)
ATTN_CODES_V8_FORMS(ATTN_CODES_K8V, 128)
// Head dim 256 (Gemma 3): the keys-as-M kernels only (its GQA groups are at most 8; the
// template's accumulators would not fit in registers).
#define ATTN_CODES_M256(D, KB, VB) ATTN_CODES_M(D, KB, VB, 2)
ATTN_CODES_FORMS(ATTN_CODES_M256, 256)

// ---- Prefill over a coded pool: the codes dequantized once, then tensor-core tiles -----
// The coded decode kernels unpack every key once per query row: for a prefill chunk that is
// the whole cost (a 32k prompt took minutes). Here each key of a launch is unpacked once
// (`codes_dequant_*`, into f16 rows of a scratch `[key, n_kv, D]`, in the codes' basis:
// rotated and centred as the exact copies are, with the query rotated by the encoder launch)
// and the tile kernel's flash attention (`MmaRows`, 64 query vectors per block) reads the
// scratch. A windowed pool's rows read their sinks and recent keys from the exact blocks
// instead: the key tiles are the coded keys of any row of the block, then the exact ones
// (sinks, then the recent band), each row masking the keys it does not read from that source.
// The online softmax does not depend on the order of the tiles.

// Scratch row of position p: rows `base + p` (the span's base, `[key, n_kv, D]`).
struct ScratchRows {
    long long base;
    int n_kv, kh;
    __device__ __forceinline__ u64 row(int p, int d) const {
        return ((u64)(base + p) * n_kv + kh) * d;
    }
};
// Exact-block row of position p of span `seq` (every position a tile stages has a slot: the
// exact table holds each block some query of the span reads exactly).
struct ExactRows {
    const u32* tbl;
    u32 seq;
    int n_kv, kh, block_size;
    __device__ __forceinline__ u64 row(int p, int d) const {
        const int b = p / block_size, slot = max(exact_slot(tbl, seq, b), 0);
        return (((u64)slot * n_kv + kh) * block_size + (p - b * block_size)) * d;
    }
};

// An exact tile of int8 copies (xa.q8) widened into rows of RS halves at ks and vs: positions
// t0 .. t0+TK-1, zeros from k1 on. Plain loads and stores, ordered by the barriers that order
// the cp.async tiles.
template <int D, int TK, int RS, int NTH>
__device__ __forceinline__ void stage_exact_q8_tile(u16* ks, u16* vs, int t0, int k1,
    const ExactRows& ex, const ExactArgs& xa, int tid)
{
    constexpr int CH = D / 8;
    for (int i = tid; i < TK * CH; i += NTH) {
        const int j = i / CH, c = i - j * CH, p = t0 + j;
        u16 *kd = ks + j * RS + c * 8, *vd = vs + j * RS + c * 8;
        if (p < k1) {
            const int b = p / ex.block_size, slot = max(exact_slot(ex.tbl, ex.seq, b), 0);
            stage_exact_piece<D>(xa, slot, ex.n_kv, ex.kh, ex.block_size, p - b * ex.block_size, c,
                                 kd, vd);
        } else {
            *(uint4*)kd = make_uint4(0u, 0u, 0u, 0u);
            *(uint4*)vd = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

// Run `run` (R codes of B bits, RB bytes) of the record at `slot` of a pool block `blk`
// (records of `row_bytes`, then f16 scales at `soff`) as f16 code × scale at out[run·R + dim].
template <int B, int R, int RB>
__device__ __forceinline__ void dequant_run(const unsigned char* blk, int slot, int row_bytes,
    int run, int soff, float code_scale, const u32* lo, const u32* hi, u16* out)
{
    u32 w[(RB + 3) / 4];
    load_run<RB>(blk + slot * row_bytes + run * RB, w);
    const float sc = code_scale * f16_to_f32(((const u16*)(blk + soff))[slot]);
    out += run * R;
#pragma unroll
    for (int gi = 0; gi < R / 4; gi++) {
        u32 x[2];
        Codes<B, R>::group(w, gi, lo, hi, x[0], x[1]);
#pragma unroll
        for (int e = 0; e < 4; e++)
            out[Codes<B, R>::dim(gi, e)] = f32_to_f16(f16_to_f32((u16)(x[e >> 1] >> (16 * (e & 1)))) * sc);
    }
}

// One block per (run of 16 keys, kv head), 128 threads: runs[2i] = span, runs[2i + 1] = the
// run's first key (a multiple of 16: a run lies in one block of the pool); key p of span s
// goes to scratch row base[s] + p. Thread t < 64 unpacks key run t % 4 of the run's key t / 4,
// every thread value run t % 8 of key t / 8 (the record layouts of `KvCodes`). Values are
// code × scale rounded to f16, as the decode kernels' MMAs see the codes (up to that rounding).
template <int D, int KB, int VB>
__device__ __forceinline__ void codes_dequant_impl(const u32* __restrict__ runs,
    const int* __restrict__ base, const u32* __restrict__ seq_tbl, const u32* __restrict__ tables,
    const unsigned char* __restrict__ k_pool, const unsigned char* __restrict__ v_pool,
    int block_size, int n_kv, const u32* __restrict__ fmt, u16* __restrict__ dk, u16* __restrict__ dv)
{
    using KC = KvCodes<D, KB, VB>;
    const KC f(fmt);
    const int tid = threadIdx.x, kh = coded_kv_head(fmt, n_kv);
    const u32 s = runs[2 * blockIdx.x];
    const int key0 = (int)runs[2 * blockIdx.x + 1];
    const PagedKv kv(tables + seq_tbl[s], n_kv, kh, block_size);
    const long long row0 = (long long)base[s] + key0;
    auto out = [&](u16* d, int j) { return d + ((u64)(row0 + j) * n_kv + kh) * D; };
    int slot;
    if (tid < 64) {
        const int j = tid >> 2;
        const u64 hb = kv.head_block(key0 + j, slot);
        dequant_run<KB, KC::KR, KC::KRB>(k_pool + hb * (u64)f.ktot, slot, KC::KROW, tid & 3, f.ksoff,
                                         KC::KS, f.klo, f.khi, out(dk, j));
    }
    const int j = tid >> 3;
    const u64 hb = kv.head_block(key0 + j, slot);
    dequant_run<VB, KC::VR, KC::VRB>(v_pool + hb * (u64)f.vtot, slot, KC::VROW, tid & 7, f.vsoff,
                                     KC::VS, f.vlo, f.vhi, out(dv, j));
}

// One block per (tile of consecutive query rows of one span, kv head), as attn_mma_impl (f16
// MMAs, 4 warps, 64 query vectors), over the scratch rows (base[span] + key) and, for a
// windowed pool (xa.tbl not null), the exact blocks. Row p reads keys max(sinks, its window's
// first) .. p - recent from the scratch, and its window's keys below `sinks` and above
// p - recent from the exact blocks. dynamic smem: 2 * 2 * MMA_TK * (D + 8) halves.
template <int D, int NW>
__device__ __forceinline__ void attn_mma_codes_impl(u16* sh,
    const float* __restrict__ qkv, int width, int n_heads, int n_kv, float scale,
    const u32* __restrict__ tok_pos, const u32* __restrict__ tok_seq, const int* __restrict__ base,
    const u16* __restrict__ dk, const u16* __restrict__ dv, const ExactArgs& xa, int block_size,
    const u32* __restrict__ tiles, float* __restrict__ out, u16* __restrict__ out_bf16,
    int window, const float* __restrict__ sinks)
{
    constexpr int NTD = D / 8, RS = D + 8;
    const int g = n_heads / n_kv;
    const int kh = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 first_row = tiles[2 * blockIdx.x], n_rows = tiles[2 * blockIdx.x + 1];
    const int pos0 = (int)tok_pos[first_row];
    const u32 seq = tok_seq[first_row];
    const int kmax = pos0 + (int)n_rows;
    const int S = xa.tbl ? xa.sinks : 0, R = xa.tbl ? xa.recent : 0;
    const int wlo = window_lo(pos0, window);   // the earliest key of any row of the tile
    // Coded keys of some row: [clo, chi); exact: the sinks [wlo, shi), the recent band [rlo, kmax).
    const int clo = max(S, wlo), chi = kmax - R;
    const int shi = min(S, kmax), rlo = max(clo, pos0 + 1 - R);
    auto count = [](int lo, int hi) { return hi > lo ? (hi - lo + MMA_TK - 1) / MMA_TK : 0; };
    const int nc = count(clo, chi);
    const int ns = xa.tbl ? count(wlo, shi) : 0, nr = xa.tbl ? count(rlo, kmax) : 0;
    const int ntiles = nc + ns + nr;
    // Tile t's first key and end; true for an exact tile.
    auto tile_of = [&](int t, int& k0, int& k1) {
        if (t < nc) { k0 = clo + t * MMA_TK; k1 = chi; return false; }
        if (t < nc + ns) { k0 = wlo + (t - nc) * MMA_TK; k1 = shi; return true; }
        k0 = rlo + (t - nc - ns) * MMA_TK; k1 = kmax;
        return true;
    };
    const ScratchRows coded{(long long)base[seq], n_kv, kh};
    const ExactRows exact{xa.tbl, seq, n_kv, kh, block_size};
    const int v0 = 16 * warp + (lane >> 2), v1 = v0 + 8;
    const int r0 = v0 / g, h0 = v0 - r0 * g, r1 = v1 / g, h1 = v1 - r1 * g;
    const bool ok0 = r0 < (int)n_rows, ok1 = r1 < (int)n_rows;
    const int p0 = pos0 + r0, p1 = pos0 + r1;
    const int w0 = window_lo(p0, window), w1 = window_lo(p1, window);
    const float qs = scale * 1.4426950408889634f;
    MmaRows<D, false> w;
    w.init(ok0 ? qkv + (u64)(first_row + r0) * width + (u64)(kh * g + h0) * D : nullptr,
           ok1 ? qkv + (u64)(first_row + r1) * width + (u64)(kh * g + h1) * D : nullptr, qs, lane);
    auto issue = [&](int t) {
        if (t < ntiles) {
            u16* kst = sh + (t & 1) * 2 * MMA_TK * RS;
            int k0, k1;
            if (tile_of(t, k0, k1)) {
                if (xa.q8)
                    stage_exact_q8_tile<D, MMA_TK, RS, 32 * NW>(kst, kst + MMA_TK * RS, k0, k1, exact,
                                                                xa, tid);
                else
                    stage_kv_tile<D, MMA_TK, RS, 32 * NW>(kst, kst + MMA_TK * RS, k0, k1, -1, exact,
                                                          xa.k, xa.v, tid);
            } else
                stage_kv_tile<D, MMA_TK, RS, 32 * NW>(kst, kst + MMA_TK * RS, k0, k1, -1, coded,
                                                      dk, dv, tid);
        }
        cp_async_commit();
    };
    // Whether row p (window from wl) reads `key` of a tile ending at k1 from this tile's source.
    auto reads = [&](bool ex, int key, int k1, int p, int wl) {
        if (key >= k1 || key < wl || key > p) return false;
        return ex ? key < S || key > p - R : key >= S && key <= p - R;
    };
    issue(0);
    for (int t = 0; t < ntiles; t++) {
        issue(t + 1);
        cp_async_wait<1>();
        __syncthreads();
        int k0, k1;
        const bool ex = tile_of(t, k0, k1);
        const u16* kst = sh + (t & 1) * 2 * MMA_TK * RS;
        const u16* vst = kst + MMA_TK * RS;
        float s[4][4];
        w.template scores<4>(s, kst, lane);
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int key = k0 + nt * 8 + (lane & 3) * 2 + e;
                if (!ok0 || !reads(ex, key, k1, p0, w0)) s[nt][e] = -INFINITY;
                if (!ok1 || !reads(ex, key, k1, p1, w1)) s[nt][2 + e] = -INFINITY;
            }
        }
        u32 pa[2][4];
        w.template softmax<4>(s, pa);
        w.template accumulate<4>(pa, vst, lane);
        __syncthreads();
    }
    cp_async_wait<0>();
    w.reduce_l();
    if (sinks) {   // the sink's softmax term, in the scores' log2 units
        if (ok0) w.l0 += exp2f(sinks[kh * g + h0] * 1.4426950408889634f - w.m0);
        if (ok1) w.l1 += exp2f(sinks[kh * g + h1] * 1.4426950408889634f - w.m1);
    }
    const float i0 = w.l0 > 0.f ? 1.0f / w.l0 : 0.f, i1 = w.l1 > 0.f ? 1.0f / w.l1 : 0.f;
    const u64 ow = (u64)n_heads * D;
#pragma unroll
    for (int nd = 0; nd < NTD; nd++) {
        const int dim = nd * 8 + (lane & 3) * 2;
        if (ok0) {
            const u64 at = (u64)(first_row + r0) * ow + (u64)(kh * g + h0) * D + dim;
            const float a = w.o[nd][0] * i0, b = w.o[nd][1] * i0;
            *(float2*)(out + at) = make_float2(a, b);
            *(u32*)(out_bf16 + at) = pack_bf16(a, b);
        }
        if (ok1) {
            const u64 at = (u64)(first_row + r1) * ow + (u64)(kh * g + h1) * D + dim;
            const float a = w.o[nd][2] * i1, b = w.o[nd][3] * i1;
            *(float2*)(out + at) = make_float2(a, b);
            *(u32*)(out_bf16 + at) = pack_bf16(a, b);
        }
    }
}

// codes_dequant_{D}_{KB}_{VB} for every coded form at head_dim 64 and 128 (the tile kernel's);
// same order as attn_codes (CodeVariant::all, the first two head dims).
#define CODES_DEQUANT(D, KB, VB) \
    extern "C" __global__ void __launch_bounds__(128) codes_dequant_##D##_##KB##_##VB( \
        const u32* runs, const int* base, const u32* seq_tbl, const u32* tables, \
        const unsigned char* k_pool, const unsigned char* v_pool, int block_size, int n_kv, \
        const u32* fmt, u16* dk, u16* dv) { \
        codes_dequant_impl<D, KB, VB>(runs, base, seq_tbl, tables, k_pool, v_pool, block_size, \
                                      n_kv, fmt, dk, dv); \
    }
ATTN_CODES_FORMS(CODES_DEQUANT, 64)
ATTN_CODES_FORMS(CODES_DEQUANT, 128)

// attn_mma_codes_{64,128}: the tile kernel over a coded pool's scratch and exact blocks.
#define ATTN_MMA_CODES(D) \
    extern "C" __global__ void __launch_bounds__(128) attn_mma_codes_##D( \
        const float* qkv, int width, int n_heads, int n_kv, float scale, const u32* tok_pos, \
        const u32* tok_seq, const int* base, const u16* dk, const u16* dv, int block_size, \
        const u32* tiles, float* out, u16* out_bf16, const float* sinks, ATTN_EXACT_PARAMS, \
        int window) { \
        extern __shared__ float shf[]; \
        const ExactArgs xa{xk, xv, xtbl, x_sinks, x_recent, x_q8, x_per_split}; \
        attn_mma_codes_impl<D, 4>((u16*)shf, qkv, width, n_heads, n_kv, scale, tok_pos, tok_seq, \
                                  base, dk, dv, xa, block_size, tiles, out, out_bf16, window, sinks); \
    }
ATTN_MMA_CODES(64)
ATTN_MMA_CODES(128)

// ---- 16-bit decode with the keys as the MMAs' M (head_dim 256) -------------------------
// At head_dim 256 the template's fragments (16 query heads × 256 dims of accumulators per
// warp, and the queries) do not fit in registers, and the SIMT row kernel reads at half
// SDPA's speed. As the coded keys-as-M kernel: per 16 keys of a warp, Sᵀ = K·Qᵀ (K rows by
// ldmatrix from the staged tile, the g ≤ 8 query heads as the B fragment's 8 columns) and
// Oᵀ = Vᵀ·Pᵀ (V by ldmatrix.trans, Pᵀ from the scores by movmatrix), MMAs in the cache's
// 16-bit type, dims in order. Tiles, splits, `prefetch` and the merge as the template's
// (Kv16 staging: rows of D values, 16-byte chunks XOR-swizzled by the row).
// grid = (rows, n_kv, n_splits), NW warps. Requires d == D, g <= 8.
// dynamic smem: max(STAGES · 2 · TK · D halves, NW · 8 · (D + 2) floats, merge's).
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

template <int D, bool BF16, int TK, int STAGES, int NW>
__device__ __forceinline__ void attn_dec16_m_impl(float* sh, ATTN_PARAMS, int window)
{
    constexpr int NTH = NW * 32, KPW = TK / NW, NS = KPW / 16;   // 16-key steps per warp
    static_assert(KPW % 16 == 0, "a warp's keys are whole 16-key steps");
    using F = Kv16<D, BF16>;
    constexpr int KT = F::template k_tile_bytes<TK>(), STAGE_BYTES = 2 * KT;
    const int g = n_heads / n_kv;
    const int r = blockIdx.x, kh = blockIdx.y, sp = blockIdx.z, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, c = lane & 3, q = lane >> 2;
    const u32 pos = tok_pos[r];
    const int kend = (int)pos + 1;
    const int wlo = window_lo((int)pos, window);
    const int chunk = ((kend - wlo + n_splits - 1) / n_splits + TK - 1) / TK * TK;
    const int k0 = wlo + sp * chunk;
    const int k1 = min(k0 + chunk, kend);
    const int ntiles = k1 > k0 ? (k1 - k0 + TK - 1) / TK : 0;
    const PagedKv kv(tables + seq_tbl[tok_seq[r]], n_kv, kh, block_size);
    const F f(nullptr);
    unsigned char* stage = (unsigned char*)sh;   // [STAGES][K tile, V tile]
    auto issue = [&](int t) {
        if (t < ntiles) {
            unsigned char* ks = stage + (u64)(t % STAGES) * STAGE_BYTES;
            f.template stage<TK, NTH>(ks, ks + KT, k0 + t * TK, k1, prefetch ? (int)pos : -1, kv,
                                      k_cache, v_cache, tid);
        }
        cp_async_commit();
    };
    // With `prefetch`, the newest key (written by the kernel ahead) is copied in after the wait.
    const int tn = ((int)pos - k0) / TK;
    auto fill_newest = [&](int t) {
        if (!prefetch || (int)pos < k0 || (int)pos >= k1 || t != tn || t >= ntiles) return;
        const int row = (int)pos - k0 - t * TK;
        unsigned char* ks = stage + (u64)(t % STAGES) * STAGE_BYTES + row * F::ROW_BYTES;
        f.template fill_row<NTH>(ks, ks + KT, row, (int)pos, kv, k_cache, v_cache, tid);
    };
    if (!prefetch) pdl_wait();
#pragma unroll
    for (int t = 0; t < STAGES - 1; t++) issue(t);
    if (prefetch) pdl_wait();
#pragma unroll
    for (int t = 0; t < STAGES - 1; t++) fill_newest(t);

    // Head q's query (zero past g) as B fragments: dims 16kk + 2c, +1 and 16kk + 2c + 8, +9.
    u32 qb[D / 16][2];
    {
        const float* qh = q < g ? qkv + (u64)r * width + (u64)(kh * g + q) * D : nullptr;
        const float qs = scale * 1.4426950408889634f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            const int d0 = 16 * kk + 2 * c;
            float2 x = make_float2(0.f, 0.f), y = x;
            if (qh) { x = *(const float2*)(qh + d0); y = *(const float2*)(qh + d0 + 8); }
            qb[kk][0] = pack16<BF16>(x.x * qs, x.y * qs);
            qb[kk][1] = pack16<BF16>(y.x * qs, y.y * qs);
        }
    }
    // o[nd]: Oᵀ rows (dims) 16nd + q and 16nd + q + 8, columns (heads) 2c, 2c + 1.
    float o[D / 16][4];
#pragma unroll
    for (int nd = 0; nd < D / 16; nd++) { o[nd][0] = 0.f; o[nd][1] = 0.f; o[nd][2] = 0.f; o[nd][3] = 0.f; }
    float m0 = -1e30f, m1 = -1e30f, l0 = 0.f, l1 = 0.f;   // heads 2c, 2c + 1 (log2 units)
    // ldmatrix rows of this lane: K (A = 16 keys × 16 dims: matrices keys 0-7 / 8-15 × dims
    // 0-7, then × dims 8-15) and V (A = Vᵀ, 16 dims × 16 keys, from .trans of keys 0-7 × dims
    // 0-7 / 8-15, then keys 8-15).
    const int krow = (lane & 7) + 8 * ((lane >> 3) & 1), kch = lane >> 4;
    const int vrow = (lane & 7) + 8 * (lane >> 4), vch = (lane >> 3) & 1;
    for (int t = 0; t < ntiles; t++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();          // tile t landed for all; tile t-1's stage is free
        issue(t + STAGES - 1);
        fill_newest(t + STAGES - 1);
        const unsigned char* ks = stage + (u64)(t % STAGES) * STAGE_BYTES;
        const unsigned char* vs = ks + KT;
        const int kw = warp * KPW;                 // the warp's first key in the tile
        const int key0 = k0 + t * TK + kw;
        float s[NS][4];
#pragma unroll
        for (int st = 0; st < NS; st++) {
            s[st][0] = 0.f; s[st][1] = 0.f; s[st][2] = 0.f; s[st][3] = 0.f;
            const int row = kw + 16 * st + krow;
            const unsigned char* kr = ks + row * F::ROW_BYTES;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                u32 a[4];
                ldmatrix_x4(a, smem_addr(kr + (((2 * kk + kch) ^ (row & 7)) << 4)));
                mma16<BF16>(s[st], a, qb[kk][0], qb[kk][1]);
            }
            const int pa = key0 + 16 * st + q, pb = pa + 8;
            if (pa >= k1) { s[st][0] = -INFINITY; s[st][1] = -INFINITY; }
            if (pb >= k1) { s[st][2] = -INFINITY; s[st][3] = -INFINITY; }
        }
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int st = 0; st < NS; st++) {
            mx0 = fmaxf(mx0, fmaxf(s[st][0], s[st][2]));
            mx1 = fmaxf(mx1, fmaxf(s[st][1], s[st][3]));
        }
#pragma unroll
        for (int x = 4; x < 32; x <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
        }
        const float c0 = exp2f(m0 - mx0), c1 = exp2f(m1 - mx1);
        m0 = mx0; m1 = mx1;
        l0 *= c0; l1 *= c1;
#pragma unroll
        for (int nd = 0; nd < D / 16; nd++) { o[nd][0] *= c0; o[nd][1] *= c1; o[nd][2] *= c0; o[nd][3] *= c1; }
#pragma unroll
        for (int st = 0; st < NS; st++) {
            s[st][0] = exp2f(s[st][0] - m0); s[st][1] = exp2f(s[st][1] - m1);
            s[st][2] = exp2f(s[st][2] - m0); s[st][3] = exp2f(s[st][3] - m1);
            l0 += s[st][0] + s[st][2];
            l1 += s[st][1] + s[st][3];
            const u32 pb0 = movmatrix_trans(pack16<BF16>(s[st][0], s[st][1]));
            const u32 pb1 = movmatrix_trans(pack16<BF16>(s[st][2], s[st][3]));
            const int row = kw + 16 * st + vrow;
            const unsigned char* vr = vs + row * F::ROW_BYTES;
#pragma unroll
            for (int nd = 0; nd < D / 16; nd++) {
                u32 a[4];
                ldmatrix_x4_trans(a, smem_addr(vr + (((2 * nd + vch) ^ (row & 7)) << 4)));
                mma16<BF16>(o[nd], a, pb0, pb1);
            }
        }
    }
    cp_async_wait<0>();
#pragma unroll
    for (int x = 4; x < 32; x <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, x);
        l1 += __shfl_xor_sync(0xffffffffu, l1, x);
    }
    __syncthreads();              // stages are reused for the warps' states
    // Per warp: m[8], l[8], acc[8][D] (log2 units).
    float* ws = sh + (u64)warp * 8 * (D + 2);
    if (q == 0) { ws[2 * c] = m0; ws[2 * c + 1] = m1; ws[8 + 2 * c] = l0; ws[8 + 2 * c + 1] = l1; }
#pragma unroll
    for (int nd = 0; nd < D / 16; nd++) {
        const int dx = 16 * nd + q, dy = dx + 8;
        ws[16 + (2 * c) * D + dx] = o[nd][0];
        ws[16 + (2 * c + 1) * D + dx] = o[nd][1];
        ws[16 + (2 * c) * D + dy] = o[nd][2];
        ws[16 + (2 * c + 1) * D + dy] = o[nd][3];
    }
    __syncthreads();
    store_split_partial<D, NW>(sh, 8, g, r, kh, sp, n_heads, n_splits, part_ml, part_acc, tid, NTH);
    attn_merge_last(sh, g, D, n_heads, n_kv, kh, n_splits, counters, part_ml, part_acc, out, out_bf16, sinks);
}

// attn_dec_256_{TK}_{ST}_{NW}: the keys-as-M 16-bit decode kernel (is_bf16 picks the type),
// named as the template's instantiations (DECODE_VARIANTS in kernels.rs).
#define ATTN_DEC16_M(D, TK, ST, NW) \
    extern "C" __global__ void __launch_bounds__(NW * 32) attn_dec_##D##_##TK##_##ST##_##NW(ATTN_PARAMS, \
                                                                                      int window) { \
        extern __shared__ float sh[]; \
        if (is_bf16) attn_dec16_m_impl<D, true, TK, ST, NW>(sh, ATTN_ARGS, window); \
        else attn_dec16_m_impl<D, false, TK, ST, NW>(sh, ATTN_ARGS, window); \
    }
ATTN_DEC16_M(256, 64, 2, 4)
ATTN_DEC16_M(256, 32, 2, 2)

// ---- Decode over a parts pool (fractional widths, prod keys) on CUDA cores -----------------
// The formats of parts.cu (records in the codec's layout, one or two parts, 1-4-bit codes,
// QJL sign bits for prod keys), read on their codes by rows that are not in a prefill tile.
// grid = (rows, n_kv, n_splits), 4 warps, split ranges, exact splits of a windowed pool and
// the fused merge as the coded template's. Keys come in chunks of 32, warp w taking chunks
// w, w + 4, … of the split: lane j scores key j (its record unpacked 32 codes per B words,
// each code's centroid times the G query heads, which sit in shared memory as [dim][G] so one
// 16-byte load serves 4 heads; per part s·Σ q·c[idx], plus γ·Σ ±(κ·S·q) over the sign bits of
// prod keys), the warp's online softmax per head, then every lane adds its D/32 contiguous
// dims of the chunk's values, decoded from the record all lanes read. Each lane requests its key's
// key and value records for the next chunk (cp.async into the warp's other buffer) before
// the current chunk computes. The warps' states merge
// through shared memory into the split's partial. G: the group rounded up to 2, 4, 8 or 16
// (8 at most at head_dim 256).
// dynamic smem: parts::decode_smem_bytes (cuda/parts.rs).

__device__ __forceinline__ void cp_async4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}

// One part of one role, as the loop reads it (from the descriptor, parts.cu).
struct PartLite {
    int m, bits, coff, sidx, qjl, sgn, first;
    float cent[16];
};
struct RoleLite {
    int n, code_bytes, total, soff, spt;
    PartLite p[2];
};

__device__ __forceinline__ void load_role(RoleLite* r, const u32* desc, int tid) {
    if (tid == 0) {
        r->n = (int)desc[0]; r->code_bytes = (int)desc[1]; r->total = (int)desc[2];
        r->soff = (int)desc[3]; r->spt = (int)desc[4];
    }
    if (tid < 2) {
        const u32* pd = desc + PARTS_HEADER + tid * PART_WORDS;
        PartLite& p = r->p[tid];
        p.m = (int)pd[0]; p.bits = (int)pd[1]; p.coff = (int)pd[2]; p.sidx = (int)pd[3];
        p.qjl = (int)pd[4]; p.sgn = (int)pd[5]; p.first = (int)pd[6];
    }
    if (tid < 32) r->p[tid >> 4].cent[tid & 15] = word_f32(desc[PARTS_HEADER + (tid >> 4) * PART_WORDS + P_CENTS + (tid & 15)]);
}

// a[h] += Σ_i q[first + i][h] · c[code_i] over the part's m codes of B bits at `codes`.
template <int B, int G>
__device__ __forceinline__ void score_codes(float (&a)[G], const u32* codes, const PartLite& p,
                                            const float* qs)
{
    for (int c = 0; c < p.m / 32; c++) {
        u32 w[B];
#pragma unroll
        for (int k = 0; k < B; k++) w[k] = codes[c * B + k];
        const float* qc = qs + (p.first + 32 * c) * G;
#pragma unroll
        for (int t = 0; t < 32; t++) {
            constexpr u32 MASK = (1u << B) - 1;
            const int bit = t * B, at = bit & 31;
            u32 code = w[bit >> 5] >> at;
            if (at + B > 32) code |= w[(bit >> 5) + 1] << (32 - at);
            const float cv = p.cent[code & MASK];
            if constexpr (G == 2) {
                const float2 q = *(const float2*)(qc + t * 2);
                a[0] = fmaf(q.x, cv, a[0]); a[1] = fmaf(q.y, cv, a[1]);
            } else {
#pragma unroll
                for (int h = 0; h < G; h += 4) {
                    const float4 q = *(const float4*)(qc + t * G + h);
                    a[h] = fmaf(q.x, cv, a[h]); a[h + 1] = fmaf(q.y, cv, a[h + 1]);
                    a[h + 2] = fmaf(q.z, cv, a[h + 2]); a[h + 3] = fmaf(q.w, cv, a[h + 3]);
                }
            }
        }
    }
}

// b[h] += Σ_i ±qj[first + i][h] over the part's m sign bits at `signs` (+ for a set bit).
template <int G>
__device__ __forceinline__ void score_signs(float (&b)[G], const u32* signs, const PartLite& p,
                                            const float* qj)
{
    for (int c = 0; c < p.m / 32; c++) {
        const u32 w = signs[c];
        const float* qc = qj + (p.first + 32 * c) * G;
#pragma unroll
        for (int t = 0; t < 32; t++) {
            const bool on = (w >> t) & 1u;
            if constexpr (G == 2) {
                const float2 q = *(const float2*)(qc + t * 2);
                b[0] += on ? q.x : -q.x; b[1] += on ? q.y : -q.y;
            } else {
#pragma unroll
                for (int h = 0; h < G; h += 4) {
                    const float4 q = *(const float4*)(qc + t * G + h);
                    b[h] += on ? q.x : -q.x; b[h + 1] += on ? q.y : -q.y;
                    b[h + 2] += on ? q.z : -q.z; b[h + 3] += on ? q.w : -q.w;
                }
            }
        }
    }
}

// qj ← κ·S·q of one part for head h (S·x = FWHT(D₃·FWHT(D₂·x)) / √m), from qs, one warp.
template <int E>
__device__ __forceinline__ void sketch_query(const u32* pd, const float* qs, float* qj, int h,
                                             int G, int lane)
{
    const int first = (int)pd[6];
    float v[E];
#pragma unroll
    for (int j = 0; j < E; j++)
        v[j] = __uint_as_float(__float_as_uint(qs[(first + lane + 32 * j) * G + h]) ^ pd[P_QJL0 + lane + 32 * j]);
    warp_fwht(v, lane);
#pragma unroll
    for (int j = 0; j < E; j++) v[j] = __uint_as_float(__float_as_uint(v[j]) ^ pd[P_QJL1 + lane + 32 * j]);
    warp_fwht(v, lane);
    const float k = word_f32(pd[9]) * word_f32(pd[8]);   // κ / √m
#pragma unroll
    for (int j = 0; j < E; j++) qj[(first + lane + 32 * j) * G + h] = v[j] * k;
}

template <int D, int G>
__device__ __forceinline__ void attn_parts_impl(float* sh, ATTN_PARAMS, const u32* fmt,
                                                const ExactArgs& xa, int window)
{
    constexpr int NW = 4, E = D / 32, TK = 32 * NW;
    const int g = n_heads / n_kv;
    const int r = blockIdx.x, kh = blockIdx.y, sp = blockIdx.z, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const u32 pos = tok_pos[r];
    const float qscale = scale * 1.4426950408889634f;
    const float* qrow = qkv + (u64)r * width + (u64)kh * g * D;
    pdl_wait();
    const int n_coded = n_splits - exact_splits(xa);
    if (sp >= n_coded) {   // an exact split of a windowed pool
        attn_exact_split<D, NW>(sh, xa, qrow, qscale, g, r, kh, sp, sp - n_coded, n_heads, n_kv,
                                n_splits, tok_seq[r], (int)pos + 1, window_lo((int)pos, window),
                                block_size, part_ml, part_acc);
        attn_merge_last(sh, g, D, n_heads, n_kv, kh, n_splits, counters, part_ml, part_acc, out, out_bf16, sinks);
        return;
    }
    const CodedRange cr = coded_range(xa, (int)pos + 1);
    const int kend = cr.hi, wlo = window_lo((int)pos, window);
    const int klo = max(cr.lo, wlo);
    const int chunk = ((kend - wlo + n_coded - 1) / n_coded + TK - 1) / TK * TK;
    const int k0 = wlo + sp * chunk, k1 = min(k0 + chunk, kend);
    float* qs = sh;                              // [D][G], pre-scaled
    float* qj = qs + D * G;                      // [D][G], κ·S·q of prod key parts
    float* pw = qj + D * G;                      // [NW][32][G] a chunk's weights
    RoleLite* roles = (RoleLite*)(pw + NW * 32 * G);
    // Per warp, two chunks (double-buffered through cp.async) of 32 staged value records, then
    // two of key records, rows sized to this pool's records (parts::decode_smem_bytes).
    u32* vstage = (u32*)(roles + 2);
    for (int e = tid; e < G * D; e += 32 * NW) {
        const int h = e / D, i = e - h * D;
        qs[i * G + h] = h < g ? qrow[h * D + i] * qscale : 0.f;
    }
    load_role(&roles[0], fmt, tid);
    load_role(&roles[1], fmt + PARTS_DESC_WORDS, tid);
    __syncthreads();
    const RoleLite& K = roles[0];
    const RoleLite& V = roles[1];
    for (int p = 0; p < K.n; p++) {
        if (!K.p[p].qjl) continue;
        const u32* pd = fmt + PARTS_HEADER + p * PART_WORDS;
        for (int h = warp; h < G; h += NW) BY_PART_WIDTH(K.p[p].m, sketch_query, pd, qs, qj, h, G, lane)
    }
    __syncthreads();
    const u32* tbl = tables + seq_tbl[tok_seq[r]];
    const unsigned char* kpool = (const unsigned char*)k_cache;
    const unsigned char* vpool = (const unsigned char*)v_cache;
    float m[G], l[G], acc[G][E];
#pragma unroll
    for (int h = 0; h < G; h++) {
        m[h] = -1e30f;
        l[h] = 0.f;
#pragma unroll
        for (int e = 0; e < E; e++) acc[h][e] = 0.f;
    }
    float* pwarp = pw + warp * 32 * G;
    // A chunk's records staged per warp: row `lane` of a buffer holds that key's value record
    // as VW words then its parts' two scales as f32 (through registers); the key rows follow,
    // each a record padded to an odd number of words so that lanes reading their own rows hit
    // distinct banks. At head_dim 256 the rows are sized to the pool's records: narrower
    // than the widest, they let a third or fourth block onto an SM. At 64 and 128 they are
    // sized for the widest (4-bit codes and a sign bit per dim): shared memory does not
    // limit those blocks as much, and strides known at compile time there spare registers
    // the loop otherwise spilled.
    const int VW = V.code_bytes / 4, KW = K.code_bytes / 4;
    const int VR = D > 128 ? VW + 2 : D / 8 + 2;
    const int KR = D > 128 ? (KW | 1) : (D / 8 + D / 32) | 1;
    u32* vbuf = vstage + warp * 2 * 32 * (VR + KR);   // [2][32][VR]
    u32* kbuf = vbuf + 2 * 32 * VR;                    // [2][32][KR]
    // This lane accumulates the E contiguous value dims lane·E … lane·E + E − 1. Parts are
    // whole multiples of 32 dims, so the E dims share one part, and their codes are E · bits ≤
    // 32 contiguous bits of a record: two word reads per key fetch all of them, where dims
    // strided by 32 took two reads each.
    const int vpart = V.n > 1 && lane * E >= V.p[1].first ? 1 : 0;
    const PartLite& vpp = V.p[vpart];
    const int vbit = (lane * E - vpp.first) * vpp.bits;
    const int vword = vpp.coff / 4 + (vbit >> 5), vat = vbit & 31, vbits = vpp.bits;
    const u32 vmask = (1u << vbits) - 1;
    const float* vcent = vpp.cent;
    // The key scalars (scales, γ) and value scales of this lane's key in the chunk being
    // staged, loaded into registers a chunk ahead; the block-table entry of its key in the
    // chunk after that, read a chunk ahead of the copies that need it (read just before them,
    // its latency stalled the warp once a chunk).
    u16 nks[4] = {0, 0, 0, 0}, nvs[2] = {0, 0};
    u32 nblk = 0;
    auto lookup = [&](int c0n) {
        if (c0n + lane < k1) nblk = tbl[(c0n + lane) / block_size];
    };
    auto issue = [&](int c0n, int buf) {
        const int keyn = c0n + lane;
        if (keyn < k1) {
            const u32 blk = nblk;
            const int slot = keyn % block_size;
            const unsigned char* vb = vpool + ((u64)blk * n_kv + kh) * V.total;
            const u32* vr = (const u32*)(vb + (u64)slot * V.code_bytes);
            const u32 vd = smem_addr(vbuf + (buf * 32 + lane) * VR);
            for (int w = 0; w < VW; w++) cp_async4(vd + 4 * w, vr + w);
            const unsigned char* kb = kpool + ((u64)blk * n_kv + kh) * K.total;
            const u32* kr = (const u32*)(kb + (u64)slot * K.code_bytes);
            const u32 kd = smem_addr(kbuf + (buf * 32 + lane) * KR);
            for (int w = 0; w < KW; w++) cp_async4(kd + 4 * w, kr + w);
            const u16* ksc = (const u16*)(kb + K.soff) + (u64)slot * K.spt;
            const u16* vsc = (const u16*)(vb + V.soff) + (u64)slot * V.spt;
#pragma unroll
            for (int i = 0; i < 4; i++) nks[i] = i < K.spt ? ksc[i] : (u16)0;
            nvs[0] = vsc[V.p[0].sidx];
            nvs[1] = V.n > 1 ? vsc[V.p[1].sidx] : (u16)0;
        }
        cp_async_commit();
    };
    int buf = 0;
    lookup(k0 + warp * 32);
    issue(k0 + warp * 32, 0);
    lookup(k0 + warp * 32 + TK);
    for (int c0 = k0 + warp * 32; c0 < k1; c0 += TK, buf ^= 1) {
        const int key = c0 + lane;
        const bool live = key < k1 && key >= klo;
        float ksv[4];
#pragma unroll
        for (int i = 0; i < 4; i++) ksv[i] = f16_to_f32(nks[i]);
        u32* vrow = vbuf + (buf * 32 + lane) * VR;
        vrow[VW] = __float_as_uint(f16_to_f32(nvs[0]));
        vrow[VW + 1] = __float_as_uint(f16_to_f32(nvs[1]));
        issue(c0 + TK, buf ^ 1);
        lookup(c0 + 2 * TK);
        cp_async_wait<1>();
        __syncwarp();   // every lane's records of this chunk have landed
        float s[G];
#pragma unroll
        for (int h = 0; h < G; h++) s[h] = 0.f;
        if (key < k1) {
            const u32* rec = kbuf + (buf * 32 + lane) * KR;
            for (int p = 0; p < K.n; p++) {
                const PartLite& pp = K.p[p];
                float a[G];
#pragma unroll
                for (int h = 0; h < G; h++) a[h] = 0.f;
                const u32* codes = rec + pp.coff / 4;
                switch (pp.bits) {
                case 1: score_codes<1, G>(a, codes, pp, qs); break;
                case 2: score_codes<2, G>(a, codes, pp, qs); break;
                case 3: score_codes<3, G>(a, codes, pp, qs); break;
                default: score_codes<4, G>(a, codes, pp, qs); break;
                }
                const float sv = ksv[pp.sidx];
#pragma unroll
                for (int h = 0; h < G; h++) s[h] = fmaf(sv, a[h], s[h]);
                if (pp.qjl) {
#pragma unroll
                    for (int h = 0; h < G; h++) a[h] = 0.f;
                    score_signs<G>(a, rec + pp.sgn / 4, pp, qj);
                    const float gamma = ksv[pp.sidx + 1];
#pragma unroll
                    for (int h = 0; h < G; h++) s[h] = fmaf(gamma, a[h], s[h]);
                }
            }
        }
#pragma unroll
        for (int h = 0; h < G; h++) {
            float cm = live ? s[h] : -INFINITY;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, o));
            const float mn = fmaxf(m[h], cm);
            const float corr = exp2f(m[h] - mn);
            const float p = live ? exp2f(s[h] - mn) : 0.f;
            float ps = p;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
            l[h] = l[h] * corr + ps;
            m[h] = mn;
#pragma unroll
            for (int e = 0; e < E; e++) acc[h][e] *= corr;
            pwarp[lane * G + h] = p;
        }
        __syncwarp();
        // Four keys per iteration, so that the loads of several keys' codes and centroids are
        // in flight at once: each key's chain (record words, centroid, products) is a few
        // dependent shared-memory loads long. At 256 with groups of 4 or 8 a key's eight dims
        // already overlap, and unrolling there spilled registers.
        const int nk = min(32, k1 - c0);
#pragma unroll (D > 128 && G > 2 ? 1 : 4)
        for (int j = 0; j < nk; j++) {
            const u32* rw = vbuf + (buf * 32 + j) * VR;
            float pj[G];
            const float vs = __uint_as_float(rw[VW + vpart]);
            if constexpr (G == 2) {   // the part scale on the two weights, not on E centroids
                const float2 q = *(const float2*)(pwarp + j * 2);
                pj[0] = q.x * vs; pj[1] = q.y * vs;
            } else {
#pragma unroll
                for (int h = 0; h < G; h += 4) {
                    const float4 q = *(const float4*)(pwarp + j * G + h);
                    pj[h] = q.x; pj[h + 1] = q.y; pj[h + 2] = q.z; pj[h + 3] = q.w;
                }
            }
            // (The word after a record's last is its first scale: read, never used.)
            u32 codes = __funnelshift_r(rw[vword], rw[vword + 1], vat);
#pragma unroll
            for (int e = 0; e < E; e++, codes >>= vbits) {
                const float v = G == 2 ? vcent[codes & vmask] : vs * vcent[codes & vmask];
#pragma unroll
                for (int h = 0; h < G; h++) acc[h][e] = fmaf(pj[h], v, acc[h][e]);
            }
        }
        __syncwarp();   // pwarp and this buffer are the next chunks'
    }
    cp_async_wait<0>();
    __syncthreads();    // the query and weights are done with: sh holds the warps' states
    float* ws = sh + warp * G * (D + 2);   // m[G], l[G], acc[G][D]
    if (lane == 0) {
#pragma unroll
        for (int h = 0; h < G; h++) { ws[h] = m[h]; ws[G + h] = l[h]; }
    }
#pragma unroll
    for (int h = 0; h < G; h++)
#pragma unroll
        for (int e = 0; e < E; e++) ws[2 * G + h * D + lane * E + e] = acc[h][e];
    __syncthreads();
    store_split_partial<D, NW>(sh, G, g, r, kh, sp, n_heads, n_splits, part_ml, part_acc, tid, 32 * NW);
    coded_block_end<D, NW>(sh, ATTN_ARGS, xa, window, n_coded, kh);
}

// attn_parts_{D}_{G}: the decode kernel over a parts pool for groups up to G; the list must
// match parts::DECODE_KERNELS in cuda/parts.rs.
#define ATTN_PARTS(D, G) \
    extern "C" __global__ void __launch_bounds__(128) attn_parts_##D##_##G(ATTN_PARAMS, \
        const u32* __restrict__ fmt, ATTN_EXACT_PARAMS, int window) { \
        extern __shared__ float sh[]; \
        const ExactArgs xa{xk, xv, xtbl, x_sinks, x_recent, x_q8, x_per_split}; \
        attn_parts_impl<D, G>(sh, ATTN_ARGS, fmt, xa, window); \
    }
ATTN_PARTS(64, 2)
ATTN_PARTS(64, 4)
ATTN_PARTS(64, 8)
ATTN_PARTS(64, 16)
ATTN_PARTS(128, 2)
ATTN_PARTS(128, 4)
ATTN_PARTS(128, 8)
ATTN_PARTS(128, 16)
ATTN_PARTS(256, 2)
ATTN_PARTS(256, 4)
ATTN_PARTS(256, 8)
