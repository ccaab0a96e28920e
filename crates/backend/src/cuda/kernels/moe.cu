// The mixture-of-experts MLP (gpt-oss) on the device, in five launches and no host round trip
// (so a decode step stays one CUDA graph): `moe_route` picks each row's experts and weights,
// `moe_gemv` runs every expert over the (row, slot) pairs that chose it — once for gate_up,
// once for down —, `moe_act` is the clamped SwiGLU between them and `moe_combine` sums each
// row's weighted expert outputs. A pair p = row · k + slot. The experts' weights stay where
// they were loaded: `moe_gemv` reads them through a table of device addresses, one per expert.

#define MOE_THREADS 256
#define MOE_MAX_EXPERTS 256
#define MOE_MAX_K 16
// Output rows of one moe_gemv block (8 warps × 8).
#define MOE_ROWS_PER_BLOCK 64

// A total order for the router's choice: larger logit first, then the lower expert index;
// NaN counts as -inf. `NONE` loses to every candidate.
#define MOE_NONE 0x7fffffff
__device__ __forceinline__ bool moe_better(float v, int i, float best, int bi) {
    return bi == MOE_NONE || v > best || (v == best && i < bi);
}

// Per row: logits = router · x + bias, the `k` largest (ties to the lower index) into `sel`,
// the softmax over just those into `wt` (both [rows, k], in choice order). grid.x = rows,
// MOE_THREADS threads; n_exp ≤ MOE_MAX_EXPERTS, k ≤ MOE_MAX_K.
extern "C" __global__ void moe_route(const float* __restrict__ x, const u16* __restrict__ router,
                                     const float* __restrict__ bias, int n_exp, int hidden, int k,
                                     u32* __restrict__ sel, float* __restrict__ wt) {
    __shared__ float logit[MOE_MAX_EXPERTS];
    __shared__ int taken[MOE_MAX_EXPERTS];
    const int r = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* xr = x + (u64)r * hidden;
    for (int e = warp; e < n_exp; e += MOE_THREADS / 32) {
        const u16* w = router + (u64)e * hidden;
        float s = 0.f;
        for (int c = lane; c < hidden; c += 32) s = fmaf(bf16_to_f32(w[c]), xr[c], s);
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) {
            const float v = s + (bias ? bias[e] : 0.f);
            logit[e] = isnan(v) ? -INFINITY : v;
            taken[e] = 0;
        }
    }
    __syncthreads();
    if (warp != 0) return;
    float vals[MOE_MAX_K];
    int idx[MOE_MAX_K];
    for (int j = 0; j < k; j++) {
        float best = -INFINITY;
        int bi = MOE_NONE;
        for (int e = lane; e < n_exp; e += 32)
            if (!taken[e] && moe_better(logit[e], e, best, bi)) { best = logit[e]; bi = e; }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi != MOE_NONE && moe_better(ov, oi, best, bi)) { best = ov; bi = oi; }
        }
        vals[j] = best;
        idx[j] = bi;
        if (lane == 0) taken[bi] = 1;
        __syncwarp();
    }
    if (lane == 0) {
        float z = 0.f;
        for (int j = 0; j < k; j++) z += expf(vals[j] - vals[0]);
        for (int j = 0; j < k; j++) {
            sel[(u64)r * k + j] = (u32)idx[j];
            wt[(u64)r * k + j] = expf(vals[j] - vals[0]) / z;
        }
    }
}

// y[p, o] = W_e[o, :] · x[src(p), :] + b_e[o] for every pair p with sel[p] = e = blockIdx.y and
// the block's output rows o (MOE_ROWS_PER_BLOCK from blockIdx.x · MOE_ROWS_PER_BLOCK).
// src(p) = p / k when `x_per_pair` is 0 (the MLP input: a row per token), else p (the
// activations: a row per pair). W_e = w_tab[e] (`[out, in]` bf16), b_e = b_tab[e] (`out` f32,
// or 0: none). Each block gathers its expert's pairs 256 at a time, stages each input row in
// shared memory and has every warp take 8 output rows; blocks of experts nobody chose exit
// after the scan. grid = (⌈out / 64⌉, experts), MOE_THREADS threads, dynamic smem `in` floats.
extern "C" __global__ void moe_gemv(const float* __restrict__ x, int x_per_pair,
                                    const u64* __restrict__ w_tab, const u64* __restrict__ b_tab,
                                    const u32* __restrict__ sel, int pairs, int k, int in, int out,
                                    float* __restrict__ y) {
    extern __shared__ float xs[];
    __shared__ int list[MOE_THREADS];
    __shared__ int count;
    const int e = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int o0 = blockIdx.x * MOE_ROWS_PER_BLOCK;
    const int o1 = min(out, o0 + MOE_ROWS_PER_BLOCK);
    const u16* W = (const u16*)w_tab[e];
    const float* B = (const float*)b_tab[e];
    // 16-byte weight loads when every row starts 16-byte aligned (allocations are 256-byte).
    const bool vec = (in & 7) == 0;
    for (int base = 0; base < pairs; base += MOE_THREADS) {
        if (tid == 0) count = 0;
        __syncthreads();
        const int p = base + tid;
        if (p < pairs && sel[p] == (u32)e) list[atomicAdd(&count, 1)] = p;
        __syncthreads();
        const int n = count;
        for (int i = 0; i < n; i++) {
            const int q = list[i];
            const float* xr = x + (u64)(x_per_pair ? q : q / k) * in;
            for (int c = tid; c < in; c += MOE_THREADS) xs[c] = xr[c];
            __syncthreads();
            for (int o = o0 + warp; o < o1; o += MOE_THREADS / 32) {
                const u16* w = W + (u64)o * in;
                float s = 0.f;
                if (vec) {
                    for (int c = lane * 8; c < in; c += 256) {
                        const uint4 v = *(const uint4*)(w + c);
                        const u32 h[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                        for (int j = 0; j < 4; j++) {
                            s = fmaf(__uint_as_float(h[j] << 16), xs[c + 2 * j], s);
                            s = fmaf(__uint_as_float(h[j] & 0xffff0000u), xs[c + 2 * j + 1], s);
                        }
                    }
                } else {
                    for (int c = lane; c < in; c += 32) s = fmaf(bf16_to_f32(w[c]), xs[c], s);
                }
                for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
                if (lane == 0) y[(u64)q * out + o] = s + (B ? B[o] : 0.f);
            }
            __syncthreads();   // xs is rewritten for the next pair
        }
        __syncthreads();       // every thread has read `count` before it is reset
    }
}

// act[p, c] = (clamp(u, ±limit) + 1) · g' · σ(alpha · g'), g' = min(g, limit), where
// [g | u] = gu[p, :] (gpt-oss's clamped SwiGLU; `2f` wide rows in, `f` wide out).
extern "C" __global__ void moe_act(const float* __restrict__ gu, float* __restrict__ act, u64 n,
                                   int f, float alpha, float limit) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 p = i / (u64)f, c = i % (u64)f;
        const float g = fminf(gu[p * 2 * f + c], limit);
        const float u = fminf(fmaxf(gu[p * 2 * f + f + c], -limit), limit);
        act[i] = (u + 1.0f) * g / (1.0f + expf(-alpha * g));
    }
}

// out[r, c] = Σ_j wt[r·k + j] · y[(r·k + j), c] over the row's k pairs; n = rows · cols.
extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ wt,
                                       int k, int cols, u64 n, float* __restrict__ out) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / (u64)cols, c = i % (u64)cols;
        float s = 0.f;
        for (int j = 0; j < k; j++) s = fmaf(wt[r * k + j], y[(r * k + j) * cols + c], s);
        out[i] = s;
    }
}
