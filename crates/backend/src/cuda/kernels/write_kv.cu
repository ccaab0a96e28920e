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
        if (has_norm) {
            float s = 0.0f;
            for (int i = tid; i < d; i += blockDim.x) s += hv[i] * hv[i];
            s = block_sum(s, red);
            float inv = 1.0f / sqrtf(s / (float)d + eps);
            const float* w = h < n_heads ? q_norm : k_norm;
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
