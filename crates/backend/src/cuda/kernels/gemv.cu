// Skinny matmuls for decode: y[m, n] (+)= Σ_k W[n, k] · x[m, k] for M ≤ 8 activation rows,
// bound by the read of W.
//
// W is up to 4 bf16 matrices [rows_i, K] stacked along n (a fused projection such as q|k|v):
// row n belongs to matrix i with end[i-1] ≤ n < end[i]. x is bf16 [M, K] (row stride K), y is
// f32 with row stride ldy. K % 8 == 0 (16-byte loads; the caller checks).
//
// One block of GEMV_THREADS threads owns R consecutive output rows over the whole of K: its
// threads stride over the 16-byte chunks of the rows (U chunks of each of the R rows in flight
// per thread before any arithmetic; for K = 4096 that is all of K in one round trip), x is read
// through L1 (it is small and shared by every block) while W streams past L1, and the partial
// sums are reduced with shuffles, then across the warps in shared memory. Short blocks keep
// the tail of the launch short. There is no split over blocks, so each output is written by
// one thread: `accumulate` = 1 adds into y (a residual add fused into the matmul).
//
// Gated variant (the FFN input, `silu(g) · u` with [g | u] = x · Wᵀ): n_total = 2F stacked rows
// whose first half are the gate rows and second half the up rows; a block owns R/2 output
// columns j and reads gate row j and up row F + j, and writes y[m, j] = silu(g) · u (f32, row
// stride ldy = F) and its bf16 copy into yb (the next matmul's input).
//
// Normed variant (RMSNorm fused in front): x is instead the f32 residual xf [M, K] with the
// norm weights gw [K]; the block, whose threads cover all of K, accumulates Σ w·(x·g) and Σ x²
// and scales the result by 1 / sqrt(Σ x² / K + eps), so the normalised input is never written.
//
// Rope-write variant (a decode step's attention input, replacing the `write_kv` launch): W is
// [Wq; Wk; Wv], each x row a token; the epilogue adds the optional bias, applies RoPE to the q
// and k rows and stores k and v into the paged pool (write_kv.cu's arithmetic, same order), and
// y gets the roped rows. A RoPE pair must be one block's two consecutive rows: for the
// half-split style the block reads rows permuted so (i, i + n_pairs) of a head are adjacent.

// Threads per block of every instantiation; the host sizes the grid from R alone.
#define GEMV_THREADS 128
#define GEMV_WARPS (GEMV_THREADS / 32)

// 16 bytes of a weight row, streamed: not kept in L1, 256-byte L2 prefetch.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// acc + the dot product of two pairs of bf16 packed in 32 bits.
__device__ __forceinline__ float dot2(u32 a, u32 b, float acc) {
    acc = fmaf(__uint_as_float(a << 16), __uint_as_float(b << 16), acc);
    return fmaf(__uint_as_float(a & 0xffff0000u), __uint_as_float(b & 0xffff0000u), acc);
}

// acc + Σ w[i]·v[i] for 8 bf16 weights and 8 floats.
__device__ __forceinline__ float dot8f(uint4 w, const float* v, float acc) {
    acc = fmaf(__uint_as_float(w.x << 16), v[0], acc);
    acc = fmaf(__uint_as_float(w.x & 0xffff0000u), v[1], acc);
    acc = fmaf(__uint_as_float(w.y << 16), v[2], acc);
    acc = fmaf(__uint_as_float(w.y & 0xffff0000u), v[3], acc);
    acc = fmaf(__uint_as_float(w.z << 16), v[4], acc);
    acc = fmaf(__uint_as_float(w.z & 0xffff0000u), v[5], acc);
    acc = fmaf(__uint_as_float(w.w << 16), v[6], acc);
    return fmaf(__uint_as_float(w.w & 0xffff0000u), v[7], acc);
}

__device__ __forceinline__ float dot8(uint4 a, uint4 b, float acc) {
    acc = dot2(a.x, b.x, acc);
    acc = dot2(a.y, b.y, acc);
    acc = dot2(a.z, b.z, acc);
    return dot2(a.w, b.w, acc);
}

// The rope-write epilogue's arguments (one kernel parameter). Pool layout and token metadata
// as in write_kv.cu; the activation rows are the tokens.
struct RopeKv {
    const float* inv_freq;  // n_pairs RoPE frequencies
    const float* bias;      // n_total, or null
    const u32* tok_pos;
    const u32* tok_seq;
    const u32* seq_tbl;
    const u32* tables;
    u16* k_cache;
    u16* v_cache;
    int n_pairs, half_split, head_dim, q_rows, k_rows, block_size, is_bf16;
};

// The weight row that logical row n of the rope-write variant reads: the identity except for
// half-split RoPE pairs, whose two rows (i, i + n_pairs) of a q or k head become rows 2i, 2i + 1.
__device__ __forceinline__ int rope_row(int n, const RopeKv& rk) {
    if (!rk.half_split || n >= rk.q_rows + rk.k_rows) return n;
    const int d = n % rk.head_dim, p = d >> 1;
    if (p >= rk.n_pairs) return n;
    return n - d + ((d & 1) ? p + rk.n_pairs : p);
}

// Logical rows n, n + 1 (n even) of token m, values x0, x1 (bias added): RoPE for q and k,
// then y[m] (row pointer y) gets both, and k / v rows go to the token's slot in the pool.
__device__ __forceinline__ void rope_write(float x0, float x1, int n, int m, float* y,
                                           const RopeKv& rk) {
    const int d = rk.head_dim, qk = rk.q_rows + rk.k_rows;
    const u32 pos = rk.tok_pos[m];
    const int a = rope_row(n, rk), b = rope_row(n + 1, rk), p = (n % d) >> 1;
    if (n < qk && p < rk.n_pairs) {
        float sn, cs;
        sincosf((float)pos * rk.inv_freq[p], &sn, &cs);
        const float r0 = x0 * cs - x1 * sn, r1 = x0 * sn + x1 * cs;
        x0 = r0;
        x1 = r1;
    }
    y[a] = x0;
    y[b] = x1;
    if (n >= rk.q_rows) {
        const bool is_v = n >= qk;
        const int kh = (n - (is_v ? qk : rk.q_rows)) / d, n_kv = rk.k_rows / d;
        const u32 blk = rk.tables[rk.seq_tbl[rk.tok_seq[m]] + pos / rk.block_size];
        u16* dst = (is_v ? rk.v_cache : rk.k_cache) +
                   (((u64)blk * n_kv + kh) * rk.block_size + pos % rk.block_size) * d;
        dst[a % d] = kv_store(x0, rk.is_bf16);
        dst[b % d] = kv_store(x1, rk.is_bf16);
    }
}

template <int M, int R, int U, bool GATED, bool NORM, bool ROPE>
__device__ __forceinline__ void gemv_impl(const u16* w0, const u16* w1, const u16* w2, const u16* w3,
                                          int e0, int e1, int e2, int n_total, const u16* x, int K,
                                          float* y, int ldy, int accumulate, u16* yb,
                                          const float* xf, const float* gw, float eps,
                                          const RopeKv& rk) {
    // Per-warp partial sums; row R holds Σ x² (normed variant).
    __shared__ float red[GEMV_WARPS][R + 1][M];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // Output rows (columns of y) of this block: R, or R/2 gated ones.
    const int RO = GATED ? R / 2 : R;
    const int n_out = GATED ? n_total / 2 : n_total;
    const int n0 = blockIdx.x * RO;
    const int C = K >> 3;  // 16-byte chunks per row
    const uint4* wr[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        int n = GATED ? min(n0 + r % RO, n_out - 1) + (r < RO ? 0 : n_out)
                      : min(n0 + r, n_total - 1);
        if (ROPE) n = rope_row(n, rk);
        const u16* base = n < e0 ? w0 + (u64)n * K
                        : n < e1 ? w1 + (u64)(n - e0) * K
                        : n < e2 ? w2 + (u64)(n - e1) * K
                                 : w3 + (u64)(n - e2) * K;
        wr[r] = (const uint4*)base;
    }
    const uint4* xr = (const uint4*)x;
    float acc[R][M];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int m = 0; m < M; m++) acc[r][m] = 0.0f;
    float ss[M];
#pragma unroll
    for (int m = 0; m < M; m++) ss[m] = 0.0f;
    pdl_trigger();
    // The first U chunks of each row are loaded before waiting for the kernel ahead (which
    // wrote x, and y when accumulating): with programmatic dependent launch they stream in
    // while that kernel finishes. The weights are never written by the kernel ahead.
    uint4 wv[U][R];
    for (int base = tid; base < C; base += GEMV_THREADS * U) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = base + GEMV_THREADS * u;
#pragma unroll
            for (int r = 0; r < R; r++)
                wv[u][r] = c < C ? ld_stream(wr[r] + c) : make_uint4(0, 0, 0, 0);
        }
        if (base == tid) pdl_wait();
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = base + GEMV_THREADS * u;
            if (c < C && NORM) {
                const float4 ga = ((const float4*)gw)[2 * c], gb = ((const float4*)gw)[2 * c + 1];
#pragma unroll
                for (int m = 0; m < M; m++) {
                    const float4* xm = (const float4*)(xf + (u64)m * K);
                    const float4 a = xm[2 * c], b = xm[2 * c + 1];
                    ss[m] += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w + b.x * b.x +
                             b.y * b.y + b.z * b.z + b.w * b.w;
                    const float xv[8] = {a.x * ga.x, a.y * ga.y, a.z * ga.z, a.w * ga.w,
                                         b.x * gb.x, b.y * gb.y, b.z * gb.z, b.w * gb.w};
#pragma unroll
                    for (int r = 0; r < R; r++) acc[r][m] = dot8f(wv[u][r], xv, acc[r][m]);
                }
            } else if (c < C) {
#pragma unroll
                for (int m = 0; m < M; m++) {
                    const uint4 xv = xr[(u64)m * C + c];
#pragma unroll
                    for (int r = 0; r < R; r++) acc[r][m] = dot8(wv[u][r], xv, acc[r][m]);
                }
            }
        }
    }
    if (tid >= C) pdl_wait();  // threads with no chunk (K < 8 · GEMV_THREADS)
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int m = 0; m < M; m++) {
            float v = acc[r][m];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) red[warp][r][m] = v;
        }
    if (NORM) {
#pragma unroll
        for (int m = 0; m < M; m++) {
            float v = ss[m];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) red[warp][R][m] = v;
        }
    }
    __syncthreads();
    if (ROPE) {
        __shared__ float out[R][M];
        if (tid < R * M) {
            const int r = tid / M, m = tid % M;
            float v = 0.0f, sq = 0.0f;
#pragma unroll
            for (int w = 0; w < GEMV_WARPS; w++) {
                v += red[w][r][m];
                if (NORM) sq += red[w][R][m];
            }
            if (NORM) v *= 1.0f / sqrtf(sq / (float)K + eps);
            if (rk.bias) v += rk.bias[rope_row(min(n0 + r, n_total - 1), rk)];
            out[r][m] = v;
        }
        __syncthreads();
        if (tid < R / 2 * M) {
            const int j = tid / M, m = tid % M, n = n0 + 2 * j;
            if (n < n_total) rope_write(out[2 * j][m], out[2 * j + 1][m], n, m, y + (u64)m * ldy, rk);
        }
        return;
    }
    if (tid < RO * M) {
        const int r = tid / M, m = tid % M;
        float v = 0.0f, u = 0.0f, sq = 0.0f;
#pragma unroll
        for (int w = 0; w < GEMV_WARPS; w++) {
            v += red[w][r][m];
            if (GATED) u += red[w][r + RO][m];
            if (NORM) sq += red[w][R][m];
        }
        if (NORM) {
            const float inv = 1.0f / sqrtf(sq / (float)K + eps);
            v *= inv;
            u *= inv;
        }
        if (n0 + r < n_out) {
            float* p = y + (u64)m * ldy + n0 + r;
            if (GATED) {
                v = v / (1.0f + expf(-v)) * u;
                *p = v;
                yb[(u64)m * ldy + n0 + r] = f32_to_bf16(v);
            } else {
                *p = accumulate ? *p + v : v;
            }
        }
    }
}

#define GEMV_KERNEL(NAME, M, R, U, GATED, NORM)                                                    \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                    \
        NAME(const u16* w0, const u16* w1, const u16* w2, const u16* w3, int e0, int e1, int e2,   \
             int n_total, const u16* x, int K, float* y, int ldy, int accumulate, u16* yb,         \
             const float* xf, const float* gw, float eps) {                                        \
        gemv_impl<M, R, U, GATED, NORM, false>(w0, w1, w2, w3, e0, e1, e2, n_total, x, K, y, ldy,  \
                                               accumulate, yb, xf, gw, eps, RopeKv{});             \
    }
#define GEMV_ROPE_KERNEL(NAME, M, R, U, NORM)                                                      \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                    \
        NAME(const u16* w0, const u16* w1, const u16* w2, const u16* w3, int e0, int e1, int e2,   \
             int n_total, const u16* x, int K, float* y, int ldy, int accumulate, u16* yb,         \
             const float* xf, const float* gw, float eps, RopeKv rk) {                             \
        gemv_impl<M, R, U, false, NORM, true>(w0, w1, w2, w3, e0, e1, e2, n_total, x, K, y, ldy,   \
                                              accumulate, yb, xf, gw, eps, rk);                    \
    }
#define GEMV_SET(M, R, U, SUF)                                                                     \
    GEMV_KERNEL(gemv_##M##SUF, M, R, U, false, false)                                              \
    GEMV_KERNEL(gemv_silu_##M##SUF, M, R, U, true, false)                                          \
    GEMV_KERNEL(gemv_norm_##M##SUF, M, R, U, false, true)                                          \
    GEMV_KERNEL(gemv_norm_silu_##M##SUF, M, R, U, true, true)                                      \
    GEMV_ROPE_KERNEL(gemv_rope_##M##SUF, M, R, U, false)                                           \
    GEMV_ROPE_KERNEL(gemv_norm_rope_##M##SUF, M, R, U, true)
#define GEMV(M, R, U) GEMV_SET(M, R, U, )

// Rows per block R (weight rows read; even, for the gated variant) and chunks in flight U per
// M: R·U 16-byte weight loads in flight per thread; larger M shares each x chunk between more
// weight rows (fewer L1 reads per weight byte).
GEMV(1, 2, 4)
GEMV(2, 2, 4)
GEMV(3, 2, 4)
GEMV(4, 2, 4)
GEMV(5, 4, 2)
GEMV(6, 4, 2)
GEMV(7, 4, 2)
GEMV(8, 4, 2)
// One- and two-row alternatives, chosen by shape (`gemv_config` in kernels.rs; measured, see
// there).
// R = 8, U = 1 (four rounds of K = 4096): the qkv and wo projections as one wave of long
// blocks (8 blocks of 64-register threads fit on an SM) instead of 2–3 waves of one-round
// blocks; our reading (not profiled): the first wave, which loaded its only round before
// `griddepcontrol.wait`, ends all at once and DRAM idles while the next wave starts.
// R = 2, U = 2: rows of K ≥ 8192 (the down projection) in more, shorter rounds.
GEMV_SET(1, 8, 1, _r8u1)
GEMV_SET(1, 2, 2, _r2u2)
GEMV_SET(2, 8, 1, _r8u1)
GEMV_SET(2, 2, 2, _r2u2)
