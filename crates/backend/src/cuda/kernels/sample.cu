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
// picks (may be null): row r's best id, or 0 for a row with no eligible logit (the next
// step's embedding input in chained greedy decoding, which must never read out of range).
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) topk_rows(const float* x, u32* out, int cols, int k,
                                                                     u32* picks) {
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

    // Pass 1: argmax, eligible count, max and log-sum-exp (online, finite values only).
    TopkStats t = {0ull, -INFINITY, 0.0f, 0u, 0};
    for (u32 c = tid; c < ucols; c += TOPK_THREADS) {
        const float v = xr[c];
        const u32 key = topk_key(v);
        if (!key) continue;
        t.count++;
        const u64 comp = topk_comp(key, c);
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
            if (picks) picks[blockIdx.x] = w.best ? 0xFFFFFFFFu - (u32)w.best : 0u;
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
