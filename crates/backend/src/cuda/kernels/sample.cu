// Top-k candidates of logit rows, so that sampling on the host needs only a few values per
// sequence instead of the whole vocabulary.
//
// One block per row. A logit is eligible when it is neither NaN nor -inf (+inf is, as the host
// sampler clamps it). Candidates are ordered by descending value (-0.0 equal to +0.0, like `>`),
// then ascending id, which makes the first candidate `sampling::argmax`'s pick. Each eligible
// logit gets a 64-bit key `order(value) << 32 | ~id` that is larger exactly when it ranks
// better, so the selection is a selection of the k largest distinct integers.
//
// Output per row r, 32-bit words at out + r * (2k + 3):
//   [ids: k][logits as float bits: k][count][max][lse]
// where only the first `count = min(k, eligible)` ids/logits are written, best first; max is
// the largest eligible logit and lse the log-sum-exp over eligible logits (-inf for a row with
// none, +inf when one is +inf).

#define TOPK_THREADS 1024
#define TOPK_MAX 256
#define TOPK_WARPS (TOPK_THREADS / 32)
#define TOPK_UNROLL 8

// An order-preserving map of an eligible value to a nonzero u32 (-0 mapped as +0); 0 for NaN
// and -inf. The smallest eligible value, -FLT_MAX, maps to 0x00800000.
__device__ __forceinline__ u32 topk_key(float v) {
    if (!(v > -INFINITY)) return 0u;
    if (v == 0.0f) v = 0.0f;
    const u32 u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The composite rank of (key, id): larger is better; 0 for an ineligible value.
__device__ __forceinline__ u64 topk_comp(u32 key, u32 id) {
    return key ? (((u64)key << 32) | (u64)(0xFFFFFFFFu - id)) : 0ull;
}

// Merges the log-sum-exp partial (om, os) into (m, s): s is sum exp(v - m); (-inf, 0) is empty.
__device__ __forceinline__ void lse_merge(float& m, float& s, float om, float os) {
    const float nm = fmaxf(m, om);
    if (nm == -INFINITY) return;  // both empty
    s = s * expf(m - nm) + os * expf(om - nm);  // an empty side contributes 0 * exp(-inf) = 0
    m = nm;
}

// Per-thread statistics of its strided share of a row, reduced over warps.
struct TopkStats {
    u64 best;     // best composite (the argmax)
    float m, s;   // finite values: max and sum of exp(v - m)
    u32 count;    // eligible values
    int has_inf;  // some value is +inf
};

__device__ __forceinline__ void topk_stats_warp(TopkStats& t) {
    for (int o = 16; o > 0; o >>= 1) {
        const u64 ob = __shfl_xor_sync(0xffffffffu, t.best, o);
        const float om = __shfl_xor_sync(0xffffffffu, t.m, o);
        const float os = __shfl_xor_sync(0xffffffffu, t.s, o);
        t.count += __shfl_xor_sync(0xffffffffu, t.count, o);
        t.has_inf |= __shfl_xor_sync(0xffffffffu, t.has_inf, o);
        t.best = ob > t.best ? ob : t.best;
        lse_merge(t.m, t.s, om, os);
    }
}

// x: [rows, cols] f32; out: rows * (2k + 3) words; 1 <= k <= TOPK_MAX; blockDim.x = TOPK_THREADS.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) topk_rows(const float* x, u32* out, int cols,
                                                                     int k) {
    __shared__ u64 sh_best[TOPK_WARPS];
    __shared__ float sh_m[TOPK_WARPS], sh_s[TOPK_WARPS];
    __shared__ u32 sh_count[TOPK_WARPS];
    __shared__ int sh_inf[TOPK_WARPS];
    __shared__ u32 hist[256];
    __shared__ u64 cand[TOPK_MAX];
    __shared__ u32 s_count, s_prefix, s_remaining, s_ngt;
    __shared__ u32 s_warp[TOPK_WARPS];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 ucols = (u32)cols, uk = (u32)k;
    const float* xr = x + (u64)blockIdx.x * ucols;
    u32* o = out + (u64)blockIdx.x * (2u * uk + 3u);

    // Pass 1: argmax, eligible count, max and log-sum-exp (online, finite values only). Each
    // thread has TOPK_UNROLL loads in flight: one block alone reads the row, so its speed is
    // the loads in flight (one at a time took 51 us for a 128k vocabulary on an H200).
    TopkStats t = {0ull, -INFINITY, 0.0f, 0u, 0};
    for (u32 base = tid; base < ucols; base += TOPK_THREADS * TOPK_UNROLL) {
        float vs[TOPK_UNROLL];
#pragma unroll
        for (int u = 0; u < TOPK_UNROLL; u++) {
            const u32 c = base + u * TOPK_THREADS;
            vs[u] = c < ucols ? xr[c] : __int_as_float(0x7fffffff);  // NaN: ineligible
        }
#pragma unroll
        for (int u = 0; u < TOPK_UNROLL; u++) {
            const float v = vs[u];
            const u32 key = topk_key(v);
            if (!key) continue;
            t.count++;
            const u64 comp = topk_comp(key, base + u * TOPK_THREADS);
            if (comp > t.best) t.best = comp;
            if (v == INFINITY) {
                t.has_inf = 1;
            } else if (v > t.m) {
                t.s = t.s * expf(t.m - v) + 1.0f;  // expf(-inf) = 0 on the first value
                t.m = v;
            } else {
                t.s += expf(v - t.m);
            }
        }
    }
    topk_stats_warp(t);
    if (lane == 0) {
        sh_best[warp] = t.best; sh_m[warp] = t.m; sh_s[warp] = t.s;
        sh_count[warp] = t.count; sh_inf[warp] = t.has_inf;
    }
    __syncthreads();
    if (warp == 0) {
        TopkStats w = {0ull, -INFINITY, 0.0f, 0u, 0};
        if (lane < TOPK_WARPS) {
            w.best = sh_best[lane]; w.m = sh_m[lane]; w.s = sh_s[lane];
            w.count = sh_count[lane]; w.has_inf = sh_inf[lane];
        }
        topk_stats_warp(w);
        if (lane == 0) {
            s_count = w.count;
            const float mx = w.has_inf ? INFINITY : w.m;
            const float lse = w.has_inf ? INFINITY : (w.m == -INFINITY ? -INFINITY : w.m + logf(w.s));
            o[2u * uk] = w.count < uk ? w.count : uk;
            o[2u * uk + 1u] = __float_as_uint(mx);
            o[2u * uk + 2u] = __float_as_uint(lse);
            if (uk == 1u && w.best) {
                const u32 id = 0xFFFFFFFFu - (u32)w.best;
                o[0] = id;
                o[1] = __float_as_uint(xr[id]);
            }
        }
    }
    if (uk == 1u) return;  // greedy: the argmax is all
    __syncthreads();
    const u32 count = s_count;
    const u32 nsel = count < uk ? count : uk;

    // Pass 2 (only when more than k are eligible): radix-select the k-th best key T, 8 bits a
    // pass from the top; `remaining` ends as how many keys equal to T are taken (the lowest
    // ids among them), the other nsel - remaining candidates are the keys above T.
    u32 T = 0u, remaining = 0u;  // count <= k: every eligible key (> 0) is a candidate
    if (count > uk) {
        u32 prefix = 0u, mask = 0u;
        remaining = uk;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int i = tid; i < 256; i += TOPK_THREADS) hist[i] = 0u;
            __syncthreads();
            for (u32 c = tid; c < ucols; c += TOPK_THREADS) {
                const u32 key = topk_key(xr[c]);
                if (key && (key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
            }
            __syncthreads();
            if (warp == 0) {
                // Lane L owns digits 255 - 8L down to 248 - 8L; an inclusive scan from the top
                // digit finds the one lane whose digits hold the remaining-th best key.
                u32 own = 0u;
                for (int j = 0; j < 8; ++j) own += hist[255 - 8 * lane - j];
                u32 incl = own;
                for (int d = 1; d < 32; d <<= 1) {
                    const u32 up = __shfl_up_sync(0xffffffffu, incl, d);
                    if (lane >= d) incl += up;
                }
                u32 above = incl - own;
                if (above < remaining && remaining <= incl) {
                    for (int j = 0; j < 8; ++j) {
                        const u32 d = 255u - 8u * (u32)lane - (u32)j;
                        const u32 h = hist[d];
                        if (above + h >= remaining) {
                            s_prefix = prefix | (d << shift);
                            s_remaining = remaining - above;
                            break;
                        }
                        above += h;
                    }
                }
            }
            __syncthreads();
            prefix = s_prefix;
            remaining = s_remaining;
            mask |= 255u << shift;
        }
        T = prefix;
    }

    // Pass 3: collect keys above T (any order) and the first `remaining` keys equal to T in id
    // order (a block-wide ordered compaction, tile by tile), then sort.
    if (tid == 0) s_ngt = 0u;
    for (int i = tid; i < TOPK_MAX; i += TOPK_THREADS) cand[i] = 0ull;
    __syncthreads();
    const u32 n_above = nsel - remaining;
    u32 taken = 0u;  // ties taken so far; uniform across the block
    for (u32 start = 0; start < ucols; start += TOPK_THREADS) {
        const u32 c = start + (u32)tid;
        const u32 key = c < ucols ? topk_key(xr[c]) : 0u;
        if (key > T) cand[atomicAdd(&s_ngt, 1u)] = topk_comp(key, c);
        if (taken < remaining) {
            const bool tie = key != 0u && key == T;
            const u32 ballot = __ballot_sync(0xffffffffu, tie);
            if (lane == 0) s_warp[warp] = __popc(ballot);
            __syncthreads();
            u32 before = 0u, total = 0u;
            for (int w = 0; w < TOPK_WARPS; ++w) {
                const u32 n = s_warp[w];
                total += n;
                if (w < warp) before += n;
            }
            const u32 rank = taken + before + __popc(ballot & ((1u << lane) - 1u));
            if (tie && rank < remaining) cand[n_above + rank] = topk_comp(key, c);
            taken += total;
            __syncthreads();  // s_warp is rewritten by the next tile
        }
    }
    __syncthreads();

    // Bitonic sort, descending, of the first n (a power of two >= nsel) slots; empty slots
    // hold 0 and sink to the end.
    u32 n = 2u;
    while (n < nsel) n <<= 1;
    for (u32 size = 2u; size <= n; size <<= 1) {
        for (u32 stride = size >> 1; stride > 0u; stride >>= 1) {
            for (u32 i = tid; i < n; i += TOPK_THREADS) {
                const u32 j = i ^ stride;
                if (j > i) {
                    const u64 a = cand[i], b = cand[j];
                    const bool desc = (i & size) == 0u;
                    if (desc ? (a < b) : (a > b)) {
                        cand[i] = b;
                        cand[j] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (u32 i = tid; i < nsel; i += TOPK_THREADS) {
        const u32 id = 0xFFFFFFFFu - (u32)cand[i];
        o[i] = id;
        o[uk + i] = __float_as_uint(xr[id]);
    }
}

// Greedy picks (`pick_greedy`): each row's argmax as `topk_rows` ranks it for k = 1, over
// gridDim.y blocks per row so that the read of the row is spread over SMs (one block of
// `topk_rows` took 51 us for a 128k vocabulary on an H200, this a few). Block b takes the
// b-th slice of the row, ARGMAX_UNROLL loads in flight per thread, and leaves its best
// composite in partial[r, b]; the last block of the row to finish (counters[r], zero between
// launches: that block resets it) reduces them and writes picks[r] (the best id, 0 for a row
// with no eligible logit) and out[2r..2r+2] = [id, 1 if any logit was eligible].
#define ARGMAX_THREADS 256
#define ARGMAX_UNROLL 8

__device__ __forceinline__ u64 ld_cg_u64(const u64* p) {
    u64 v;
    asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}

// The largest u64 over the block (every thread gets it); `sh` holds ARGMAX_THREADS / 32.
__device__ __forceinline__ u64 block_max_u64(u64 v, u64* sh) {
    for (int o = 16; o > 0; o >>= 1) {
        const u64 w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = 0ull;
    for (int w = 0; w < ARGMAX_THREADS / 32; w++) v = sh[w] > v ? sh[w] : v;
    return v;
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS) argmax_rows(const float* x, int cols,
                                                                        u64* partial, u32* counters,
                                                                        u32* picks, u32* out) {
    __shared__ u64 sh[ARGMAX_THREADS / 32];
    __shared__ int is_last;
    const int r = blockIdx.x, b = blockIdx.y, nb = gridDim.y, tid = threadIdx.x;
    const u32 ucols = (u32)cols, span = (ucols + nb - 1) / nb;
    const u32 c0 = (u32)b * span, c1 = min(c0 + span, ucols);
    const float* xr = x + (u64)r * ucols;
    u64 best = 0ull;
    for (u32 base = c0 + tid; base < c1; base += ARGMAX_THREADS * ARGMAX_UNROLL) {
        float v[ARGMAX_UNROLL];
#pragma unroll
        for (int u = 0; u < ARGMAX_UNROLL; u++) {
            const u32 c = base + u * ARGMAX_THREADS;
            v[u] = c < c1 ? xr[c] : __int_as_float(0x7fffffff);  // NaN: ineligible
        }
#pragma unroll
        for (int u = 0; u < ARGMAX_UNROLL; u++) {
            const u64 comp = topk_comp(topk_key(v[u]), base + u * ARGMAX_THREADS);
            best = comp > best ? comp : best;
        }
    }
    best = block_max_u64(best, sh);
    if (tid == 0) {
        partial[(u64)r * nb + b] = best;
        __threadfence();  // the partial is visible before the count that announces it
        is_last = atomicAdd(&counters[r], 1u) == (u32)nb - 1u;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    u64 m = 0ull;
    for (int i = tid; i < nb; i += ARGMAX_THREADS) {
        const u64 p = ld_cg_u64(partial + (u64)r * nb + i);
        m = p > m ? p : m;
    }
    m = block_max_u64(m, sh);
    if (tid == 0) {
        const u32 id = m ? 0xFFFFFFFFu - (u32)m : 0u;
        picks[r] = id;
        out[2 * r] = id;
        out[2 * r + 1] = m ? 1u : 0u;
        counters[r] = 0u;
    }
}
