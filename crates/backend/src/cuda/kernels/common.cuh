// Shared helpers of the turbokv CUDA kernels. Prepended to every kernel source before NVRTC
// compiles it, so no CUDA header is needed at run time (16-bit conversions use PTX `cvt`).
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float bf16_to_f32(u16 x) { return __uint_as_float(((u32)x) << 16); }
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}
__device__ __forceinline__ float f16_to_f32(u16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}
// KV element codecs: `is_bf16` is uniform across a launch.
__device__ __forceinline__ float kv_load(u16 x, int is_bf16) { return is_bf16 ? bf16_to_f32(x) : f16_to_f32(x); }
__device__ __forceinline__ u16 kv_store(float f, int is_bf16) { return is_bf16 ? f32_to_bf16(f) : f32_to_f16(f); }

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
// `sh` holds 32 floats.
__device__ float block_sum(float v, float* sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    int nw = (blockDim.x + 31) >> 5;
    float t = (l < nw) ? sh[l] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}

// Programmatic dependent launch (Hopper+): `pdl_trigger` lets the next kernel on the stream,
// if it was launched with programmatic stream serialization, start its blocks once every block
// of this one has triggered; that kernel calls `pdl_wait` before it reads anything the kernels
// ahead of it wrote. Both are no-ops for ordinary launches and before sm_90.
__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A windowed coded pool's exact table (cuda/exact.rs): the exact block holding the f16
// copies of block j of span `seq`, or -1 when none does.
__device__ __forceinline__ int exact_slot(const u32* xtbl, u32 seq, int j) {
    const u32* e = xtbl + xtbl[seq];
    const int fb = (int)e[0], sb = (int)e[1], nr = (int)e[2];
    if (j < sb) return (int)e[3 + j];
    if (j >= fb && j < fb + nr) return (int)e[3 + sb + j - fb];
    return -1;
}

// u32 words of one role's coded-pool format descriptor (cuda/codes.rs `DESC_WORDS`; write_kv.cu
// lists them): the key descriptor, then the value one at this offset.
#define CODE_DESC_WORDS 320
// 1 when a TurboQuant role stores corrected norms (cuda/codes.rs `CORRECTED_WORD`); its 2^bits
// f32 centroids follow.
#define CODE_CORRECTED_WORD 300
// A layer with per-head formats (cuda/codes.rs `HEAD_TABLE_WORD`): in the first group's key
// descriptor, the word offset of the table that gives each kv head its group's record offset
// (0: one format for every head).
#define CODE_HEAD_TABLE_WORD 319

// The kv head of a coded block: blockIdx.y, or, in a launch over one group of a layer with
// per-head formats (fewer heads than n_kv), its entry of the group's head list, which follows
// the key and value descriptors (cuda/codes.rs `HeadGroups`). A launch over every head reads
// no list, so one-format pools pay nothing.
__device__ __forceinline__ int coded_kv_head(const u32* fmt, int n_kv) {
    return (int)gridDim.y == n_kv ? (int)blockIdx.y : (int)fmt[2 * CODE_DESC_WORDS + blockIdx.y];
}
