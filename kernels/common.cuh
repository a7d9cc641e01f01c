// common.cuh: shared device code for every kernel module.
//
// Owns: the storage-format ids (GGML's type numbers, the same as
// `artifact::format::TensorFormat`), the per-format dequantizer `dequant8`
// (8 consecutive elements of one row into f32, bit-for-bit the arithmetic of
// ggml's `dequantize_row_*`, with products and sums rounded separately so no
// FMA contraction changes a value), warp reductions and bf16 packing.
//
// Block layouts (ggml-common.h), bytes per block / elements per block:
//   Q4_0 18/32 {f16 d; u8 qs[16]}           Q4_1 20/32 {f16 d, m; u8 qs[16]}
//   Q5_0 22/32 {f16 d; u8 qh[4]; u8 qs[16]} Q5_1 24/32 {f16 d, m; u8 qh[4]; u8 qs[16]}
//   Q8_0 34/32 {f16 d; i8 qs[32]}           IQ4_NL 18/32 {f16 d; u8 qs[16]}
//   Q2_K 84/256 {u8 scales[16]; u8 qs[64]; f16 d, dmin}
//   Q3_K 110/256 {u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d}
//   Q4_K 144/256 {f16 d, dmin; u8 scales[12]; u8 qs[128]}
//   Q5_K 176/256 {f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}
//   Q6_K 210/256 {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}
//
// Contract of every weight-reading kernel: rows hold n_cols elements with
// n_cols % 32 == 0, rows start 16-byte aligned for F32/F16/BF16 (row_bytes is
// then a multiple of 16) and 2-byte aligned for the block formats (every
// block size is even). The Rust launchers check these before launching.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define FMT_F32 0
#define FMT_F16 1
#define FMT_Q4_0 2
#define FMT_Q4_1 3
#define FMT_Q5_0 6
#define FMT_Q5_1 7
#define FMT_Q8_0 8
#define FMT_Q2_K 10
#define FMT_Q3_K 11
#define FMT_Q4_K 12
#define FMT_Q5_K 13
#define FMT_Q6_K 14
#define FMT_IQ4_NL 20
#define FMT_BF16 30

// X(name, id): one line per format; kernels are instantiated as `<op>_<name>`.
#define FOR_EACH_FORMAT(X) \
    X(f32, FMT_F32)        \
    X(f16, FMT_F16)        \
    X(bf16, FMT_BF16)      \
    X(q4_0, FMT_Q4_0)      \
    X(q4_1, FMT_Q4_1)      \
    X(q5_0, FMT_Q5_0)      \
    X(q5_1, FMT_Q5_1)      \
    X(q8_0, FMT_Q8_0)      \
    X(q2_k, FMT_Q2_K)      \
    X(q3_k, FMT_Q3_K)      \
    X(q4_k, FMT_Q4_K)      \
    X(q5_k, FMT_Q5_K)      \
    X(q6_k, FMT_Q6_K)      \
    X(iq4_nl, FMT_IQ4_NL)

typedef __nv_bfloat16 bf16;

// ggml's kvalues_iq4nl (ggml-common.h).
__device__ __constant__ int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                     1,    13,   25,  38,  53,  69,  89,  113};

__device__ __forceinline__ float f16_at(const uint8_t* p) {
    return __half2float(__ushort_as_half(*reinterpret_cast<const uint16_t*>(p)));
}

__device__ __forceinline__ float bf16_bits_to_f32(uint32_t bits16) {
    return __uint_as_float(bits16 << 16);
}

__device__ __forceinline__ float fmul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float fadd(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float fsub(float a, float b) { return __fsub_rn(a, b); }

// The gate nonlinearities of a gated FFN (elementwise.cu's gated_* and the
// gated epilogue of gemm_sm90a.cu, one definition): silu(x) = x / (1 + exp(-x));
// gelu is the tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
// (gemma's gelu_pytorch_tanh, ggml's gelu). f32 with expf/tanhf (no fast math).
#define ACT_SILU 0
#define ACT_GELU 1

template <int ACT>
__device__ __forceinline__ float act(float x) {
    if constexpr (ACT == ACT_SILU) {
        return x / (1.0f + expf(-x));
    } else {
        const float k = 0.7978845608028654f;  // sqrt(2/pi)
        return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
    }
}

// Q4_K / Q5_K 6-bit scale and min of sub-block j (ggml's get_scale_min_k4).
__device__ __forceinline__ void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Dequantizes elements [8*g, 8*g + 8) of one row starting at `row` into out.
template <int FMT>
__device__ __forceinline__ void dequant8(const uint8_t* __restrict__ row, int g, float out[8]) {
    if constexpr (FMT == FMT_F32) {
        const float4* p = reinterpret_cast<const float4*>(row) + 2 * g;
        float4 a = p[0], b = p[1];
        out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
        out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
    } else if constexpr (FMT == FMT_F16 || FMT == FMT_BF16) {
        uint4 v = reinterpret_cast<const uint4*>(row)[g];
        uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if constexpr (FMT == FMT_F16) {
                out[2 * i] = __half2float(__ushort_as_half((uint16_t)(w[i] & 0xFFFF)));
                out[2 * i + 1] = __half2float(__ushort_as_half((uint16_t)(w[i] >> 16)));
            } else {
                out[2 * i] = bf16_bits_to_f32(w[i] & 0xFFFF);
                out[2 * i + 1] = bf16_bits_to_f32(w[i] >> 16);
            }
        }
    } else if constexpr (FMT == FMT_Q4_0 || FMT == FMT_Q4_1 || FMT == FMT_IQ4_NL) {
        constexpr int BB = FMT == FMT_Q4_1 ? 20 : 18;
        const uint8_t* blk = row + (g >> 2) * BB;
        const int s = g & 3;
        const float d = f16_at(blk);
        const float m = FMT == FMT_Q4_1 ? f16_at(blk + 2) : 0.0f;
        const uint8_t* qs = blk + (FMT == FMT_Q4_1 ? 4 : 2) + (s & 1) * 8;
        const int shift = (s >> 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int v = (qs[i] >> shift) & 0xF;
            if constexpr (FMT == FMT_Q4_0) out[i] = fmul((float)(v - 8), d);
            else if constexpr (FMT == FMT_Q4_1) out[i] = fadd(fmul((float)v, d), m);
            else out[i] = fmul(d, (float)kvalues_iq4nl[v]);
        }
    } else if constexpr (FMT == FMT_Q5_0 || FMT == FMT_Q5_1) {
        constexpr bool HAS_M = FMT == FMT_Q5_1;
        constexpr int BB = HAS_M ? 24 : 22;
        const uint8_t* blk = row + (g >> 2) * BB;
        const int s = g & 3;
        const float d = f16_at(blk);
        const float m = HAS_M ? f16_at(blk + 2) : 0.0f;
        const uint8_t* qhp = blk + (HAS_M ? 4 : 2);
        const uint32_t qh = (uint32_t)qhp[0] | ((uint32_t)qhp[1] << 8) | ((uint32_t)qhp[2] << 16) |
                            ((uint32_t)qhp[3] << 24);
        const uint8_t* qs = qhp + 4 + (s & 1) * 8;
        const int shift = (s >> 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int e = s * 8 + i;  // element within the block; bit e of qh is its 5th bit
            const int v = ((qs[i] >> shift) & 0xF) | (((qh >> e) & 1) << 4);
            if constexpr (HAS_M) out[i] = fadd(fmul((float)v, d), m);
            else out[i] = fmul((float)(v - 16), d);
        }
    } else if constexpr (FMT == FMT_Q8_0) {
        const uint8_t* blk = row + (g >> 2) * 34;
        const float d = f16_at(blk);
        const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2) + (g & 3) * 8;
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = fmul((float)qs[i], d);
    } else if constexpr (FMT == FMT_Q2_K) {
        const uint8_t* blk = row + (g >> 5) * 84;
        const int e0 = (g & 31) * 8;
        const int n = e0 >> 7, j = (e0 & 127) >> 5, l0 = e0 & 31;
        const float d = f16_at(blk + 80), dmin = f16_at(blk + 82);
        const int sc = blk[e0 >> 4];
        const float dl = fmul(d, (float)(sc & 0xF)), ml = fmul(dmin, (float)(sc >> 4));
        const uint8_t* q = blk + 16 + n * 32 + l0;
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = fsub(fmul(dl, (float)((q[i] >> (2 * j)) & 3)), ml);
    } else if constexpr (FMT == FMT_Q3_K) {
        const uint8_t* blk = row + (g >> 5) * 110;
        const int e0 = (g & 31) * 8;
        const int n = e0 >> 7, j = (e0 & 127) >> 5, l0 = e0 & 31;
        const float d = f16_at(blk + 108);
        const uint8_t* sc = blk + 96;
        const int is = e0 >> 4;
        const int low = is < 8 ? (sc[is] & 0xF) : (sc[is - 8] >> 4);
        const int high = (sc[8 + (is & 3)] >> (2 * (is >> 2))) & 3;
        const float dl = fmul(d, (float)((low | (high << 4)) - 32));
        const uint8_t* q = blk + 32 + n * 32 + l0;
        const uint8_t* hm = blk + l0;
        const int mbit = n * 4 + j;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int v = ((q[i] >> (2 * j)) & 3) - (((hm[i] >> mbit) & 1) ? 0 : 4);
            out[i] = fmul(dl, (float)v);
        }
    } else if constexpr (FMT == FMT_Q4_K || FMT == FMT_Q5_K) {
        constexpr bool Q5 = FMT == FMT_Q5_K;
        const uint8_t* blk = row + (g >> 5) * (Q5 ? 176 : 144);
        const int e0 = (g & 31) * 8;
        const int c = e0 >> 5, l0 = e0 & 31;
        const float d = f16_at(blk), dmin = f16_at(blk + 2);
        int sc, m;
        scale_min_k4(c, blk + 4, sc, m);
        const float d1 = fmul(d, (float)sc), m1 = fmul(dmin, (float)m);
        const uint8_t* q = blk + (Q5 ? 48 : 16) + (c >> 1) * 32 + l0;
        const int shift = (c & 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            int v = (q[i] >> shift) & 0xF;
            if constexpr (Q5) v += ((blk[16 + l0 + i] >> c) & 1) << 4;
            out[i] = fsub(fmul(d1, (float)v), m1);
        }
    } else if constexpr (FMT == FMT_Q6_K) {
        const uint8_t* blk = row + (g >> 5) * 210;
        const int e0 = (g & 31) * 8;
        const int n = e0 >> 7, qq = (e0 & 127) >> 5, l0 = e0 & 31;
        const float d = f16_at(blk + 208);
        const int8_t sc = reinterpret_cast<const int8_t*>(blk + 192)[e0 >> 4];
        const float ds = fmul(d, (float)sc);
        const uint8_t* ql = blk + n * 64 + (qq & 1) * 32 + l0;
        const uint8_t* qh = blk + 128 + n * 32 + l0;
        const int shift = (qq >> 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int v = (((ql[i] >> shift) & 0xF) | (((qh[i] >> (2 * qq)) & 3) << 4)) - 32;
            out[i] = fmul(ds, (float)v);
        }
    }
}

// ---------------------------------------------------------------- reductions

// Sum over the warp (float, double, int); every lane gets the result.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` holds 32 values of T; the call begins and ends with a barrier.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    T r = lane < n_warps ? scratch[lane] : T(0);
    r = warp_sum(r);
    return r;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = lane < n_warps ? scratch[lane] : -INFINITY;
    return warp_max(r);
}

// ---------------------------------------------------------------- GEMM parameters (gemm_sm90a.cu)

// Block tile and pipeline of gemm_bf16_wgmma (mirrored in src/backend/cuda/ops.rs).
#define GEMM_BM 128
#define GEMM_BN 256
#define GEMM_BK 64
#define GEMM_STAGES 4
#define GEMM_GROUP_M 16

// A CUtensorMap (cuda.h's opaque 128-byte object; CUDA 13 aligns it to 128 bytes,
// and so does cudarc's binding), built on the host.
struct alignas(128) TmaDesc {
    unsigned long long opaque[16];
};

// gemm_bf16_wgmma's one parameter (a __grid_constant__, so the tensor maps stay in
// parameter space). a: x (M, K) bf16, box (64 K, 128 rows); b: W (N, K) bf16, box
// (64 K, 256 rows); y: (M, ldy) f32; y_pairs: 1 when ldy is even and y 8-byte
// aligned (column pairs stored as float2); accumulate: 1 for y += x · Wᵀ (the
// residual add in the epilogue: y read, the f32 product added with one
// correctly rounded add, as add_f32 does), 0 for y = x · Wᵀ. store_tma: 1 for the
// epilogue through shared memory and y_map (y (M, N) f32, box (32 N, 64 rows),
// 128-byte swizzle; y 16-byte aligned, ldy % 4 == 0), 0 for stores from registers
// (y_map unused). rope_n_rot > 0 (with accumulate 0): RoPE in the epilogue, the
// rotation rope_tabled_f32 applies afterwards (kernels/rope.cu), on the accumulators:
// row r at position rope_pos[r % rope_n_per_seq], (cos, sin) from rope_table
// (n_pos, rope_n_rot/2), heads of rope_d_head (256 % rope_d_head == 0, N a multiple
// of it), rope_mode 0 (normal) or 2 (neox, rope_n_rot % 16 == 0); 0: no rotation
// (the other rope_ fields unused). Rust twin: ops::GemmParams.
struct GemmParams {
    TmaDesc a;
    TmaDesc b;
    TmaDesc y_map;
    float* y;
    long long ldy;
    int m, n, k, y_pairs;
    int accumulate, store_tma;
    const float2* rope_table;
    const int32_t* rope_pos;
    int rope_n_per_seq, rope_d_head, rope_n_rot, rope_mode;
};
static_assert(sizeof(GemmParams) == 512 && alignof(GemmParams) == 128, "GemmParams layout (ops::GemmParams)");

// gemm_bf16_wgmma_lmhead's one parameter: the LM head's logits x · Wᵀ reduced in the
// epilogue, never stored. a: h (M, K) bf16, box (64 K, 128 rows); b: the head (N =
// n_vocab, K) bf16, box (64 K, 256 rows); part: (M, n_parts) float2, n_parts = ceil(N /
// 256): for row r and column tile t, (max, sum of exp(logit - max)) over the tile's
// columns below N; targets: (M) token ids; target_logit: (M), written for the rows whose
// target lies in [0, N) (lmhead_merge writes the others). Rust twin: ops::GemmLmParams.
struct GemmLmParams {
    TmaDesc a;
    TmaDesc b;
    float2* part;
    const int32_t* targets;
    float* target_logit;
    int m, n, k, n_parts;
};
static_assert(sizeof(GemmLmParams) == 384 && alignof(GemmLmParams) == 128, "GemmLmParams layout (ops::GemmLmParams)");

// gemm_bf16_wgmma_gated_{silu,gelu}'s one parameter: out = act(x · Wgᵀ) * (x · Wuᵀ)
// rounded to bf16. a: x (M, K) bf16, box (64 K, 128 rows); b_gate, b_up: Wg and Wu
// (n_ffn, K) bf16, box (64 K, 128 rows) each (the two halves of one 256-row B
// stage); out: (M, ldo) bf16, ldo even and out 4-byte aligned (pairs stored as
// bf16x2); n_ffn even. store_tma: 1 for the epilogue through shared memory and
// out_map (out (M, n_ffn) bf16, box (64 columns, 64 rows), 128-byte swizzle; out
// 16-byte aligned, ldo % 8 == 0), 0 for stores from registers (out_map unused).
// Rust twin: ops::GemmGatedParams.
struct GemmGatedParams {
    TmaDesc a;
    TmaDesc b_gate;
    TmaDesc b_up;
    TmaDesc out_map;
    bf16* out;
    long long ldo;
    int m, n_ffn, k, store_tma;
};
static_assert(sizeof(GemmGatedParams) == 640 && alignof(GemmGatedParams) == 128, "GemmGatedParams layout (ops::GemmGatedParams)");

// ---------------------------------------------------------------- bf16 packing

// Two f32 into one 32-bit word of bf16 (round to nearest even), low half first.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&p);
}

__device__ __forceinline__ uint4 pack_bf16x8(const float v[8]) {
    return make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                      pack_bf16x2(v[6], v[7]));
}

// Output element conversion for kernels templated on their output type.
template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ bf16 from_f32<bf16>(float v) { return __float2bfloat16_rn(v); }

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(bf16 v) { return __bfloat162float(v); }

// ---------------------------------------------------------------- kernel parameter structs
// Each mirrors a #[repr(C)] struct of src/backend/cuda/ops.rs; both sides assert its size.

// Parameters of attn_flash_* (kernels/attention.cu), mirrored by `ops::AttnArgs`.
// q: (n_seqs * n_tokens, q_stride) f32; k, v: (n_seqs, n_kv_heads, n_ctx) rows of
// k_row_bytes / v_row_bytes: d_head bf16 (attn_flash_*_bf16_*, 2 * d_head bytes) or
// one encoded row of src/kv (attn_flash_*_<format>_*: the format's K and V codecs,
// codes at byte 0, then the scales, padded to 16 bytes); out: (n_seqs * n_tokens,
// out_stride) f32 or bf16. rot: bit 0 = K rows are Hadamard-rotated, bit 1 = V rows
// are (src/kv/hadamard.rs); book: the vq2 codebook (256 x 4 f32) or null.
struct AttnArgs {
    const float* q;
    const void* k;
    const void* v;
    void* out;
    int n_tokens;
    int n_heads;
    int n_kv_heads;
    int n_ctx;
    int pos0;
    int window;  // 0 = full causal
    float scale;
    float softcap;  // 0 = none
    long long q_stride;
    long long out_stride;
    int k_row_bytes;
    int v_row_bytes;
    int rot;
    int pad_;
    const float* book;
};
static_assert(sizeof(AttnArgs) == 104, "AttnArgs layout differs from ops::AttnArgs");

// Parameters of kv_encode_<codec> (kernels/kv_codec.cu), mirrored by `ops::KvEncodeArgs`.
// src: (n_seqs * n_tokens, src_stride) f32, head h of token row r at r * src_stride + h * d;
// cache: (n_seqs_cache, n_kv_heads, n_ctx) rows of row_bytes; n_bad: one u64 counter;
// rotate: 1 = Hadamard-rotate each row before coding; n_tokens, n_seqs: the rows
// (n_seqs * n_tokens token rows of n_kv_heads heads each); book: the vq2 codebook (256
// x 4 f32, kv::vq::codebook) or null. Blocks hold at most KV_ROWS_MAX_THREADS threads
// (a warp a row).
struct KvEncodeArgs {
    const float* src;
    unsigned char* cache;
    unsigned long long* n_bad;
    long long src_stride;
    int d;
    int n_kv_heads;
    int n_ctx;
    int pos0;
    int row_bytes;
    int rotate;
    int n_tokens;
    int n_seqs;
    const float* book;
};
static_assert(sizeof(KvEncodeArgs) == 72, "KvEncodeArgs layout differs from ops::KvEncodeArgs");
constexpr int KV_ROWS_MAX_THREADS = 256;

// ---------------------------------------------------------------- KV element codes (src/kv/scalar.rs)

// The value of E4M3 (OCP E4M3FN) code c: exact, as kv::scalar::e4m3_to_f32 (NaN for
// S.1111.111; subnormals m * 2^-9; normals (1 + m/8) * 2^(e-7), i.e. f32 exponent e + 120).
__device__ __forceinline__ float e4m3_value(uint32_t c) {
    const uint32_t e = (c >> 3) & 15u, m = c & 7u;
    if ((c & 0x7Fu) == 0x7Fu) return __uint_as_float(0x7FC00000u);
    const float mag = e == 0 ? __fmul_rn((float)m, 0.001953125f) : __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (c & 0x80u) ? -mag : mag;
}

// The value of E2M1 code c (low 4 bits; bit 3 the sign), as kv::scalar::e2m1_to_f32.
__device__ __forceinline__ float e2m1_value(uint32_t c) {
    const uint32_t m = c & 7u;
    // 0, 0.5, 1, 1.5, 2, 3, 4, 6: m * 0.5 up to 2 (m <= 4), then 3, 4, 6.
    const float mag = m <= 4u ? 0.5f * (float)m : (m == 5u ? 3.0f : (m == 6u ? 4.0f : 6.0f));
    return (c & 8u) ? -mag : mag;
}

// ---------------------------------------------------------------- Hadamard rotation (src/kv/hadamard.rs)

// In place, each of n_rows rows of d f32 (row stride d) <- H x per block of n = the
// largest power of two dividing d (unnormalized): stages h = 1, 2, .., n/2, each pair
// (j, j + h) with j % (2h) < h becoming (a + b, a - b), exactly kv::hadamard's
// butterflies and so its bits (each output is a fixed tree of adds). Threads `tid` of
// `n_threads` share the work; `sync()` orders the stages (__syncwarp for one warp,
// __syncthreads for a block) and is called before the first stage and after the last.
// D > 0 fixes the row length at compile time (attention.cu's query and output
// rotations: hadamard_rows_d): the stages unroll and the butterfly indices become
// shifts and masks instead of divisions by a run-time h; the same pairs in the same
// stage order, so the same bits. D == 0 takes d at run time (kv_codec.cu: hadamard_rows).
template <int D, typename Sync>
__device__ __forceinline__ void hadamard_rows_impl(float* x, int n_rows, int d_run, int tid, int n_threads, Sync sync) {
    const int d = D > 0 ? D : d_run;
    const int n = d & -d;
    const int half = d / 2;
    sync();
#pragma unroll
    for (int h = 1; h < n; h <<= 1) {
        for (int i = tid; i < n_rows * half; i += n_threads) {
            const int r = i / half, p = i % half;
            const int j = (p / h) * 2 * h + (p % h);
            float* row = x + (long long)r * d;
            const float a = row[j], b = row[j + h];
            row[j] = __fadd_rn(a, b);
            row[j + h] = __fsub_rn(a, b);
        }
        sync();
    }
}

template <typename Sync>
__device__ __forceinline__ void hadamard_rows(float* x, int n_rows, int d, int tid, int n_threads, Sync sync) {
    hadamard_rows_impl<0>(x, n_rows, d, tid, n_threads, sync);
}

template <int D, typename Sync>
__device__ __forceinline__ void hadamard_rows_d(float* x, int n_rows, int tid, int n_threads, Sync sync) {
    static_assert(D > 0, "hadamard_rows_d: a compile-time row length");
    hadamard_rows_impl<D>(x, n_rows, 0, tid, n_threads, sync);
}

// --- gemm ---
// gemm_bf16_wgmma_qkv's one parameter: y = x · Wᵀ over a fused weight of n = n_q +
// n_k + n_v rows (the q, k and v projections in one GEMM), each output column sent to
// its own projection's matrix. a: x (M, K) bf16, box (64 K, 128 rows); b: the fused W
// (n, K) bf16, box (64 K, 256 rows). Columns [0, col1) go to y[0] (M, col1), [col1,
// col2) to y[1] (M, col2 - col1), [col2, n) to y[2] (M, n - col2), each contiguous
// f32, 8-byte aligned, widths even (pairs stored as float2). bias[s]: the (width_s)
// f32 bias of segment s added to its f32 product with one correctly rounded add (the
// numbers of add_bias after the matmul), or null for none. Rust twin: ops::GemmQkvParams.
struct GemmQkvParams {
    TmaDesc a;
    TmaDesc b;
    float* y[3];
    const float* bias[3];
    int m, n, k, col1, col2, pad_;
};
static_assert(sizeof(GemmQkvParams) == 384 && alignof(GemmQkvParams) == 128, "GemmQkvParams layout (ops::GemmQkvParams)");
// --- moecuda ---
// MXFP4 (GGUF type 39, ggml's block_mxfp4, 17 bytes / 32 weights): byte 0 the
// E8M0 scale e, bytes 1..17 qs[16]; weight j (j < 16) is the low nibble of
// qs[j], weight j + 16 its high nibble; y = kvalues_mxfp4[nibble] * 2^(e - 128)
// (the E2M1 values doubled, times half the E8M0 scale; e < 2 the subnormal
// halves 2^-128, 2^-127; e = 255 gives 2^127 as in ggml). One f32 product per
// weight, correctly rounded, so every value is bit-exact against the CPU
// decoder (src/backend/cpu/dequant.rs::block_mxfp4). Blocks are 17 bytes, so a
// row may start at any byte: the loader reads bytes only.
#define FMT_MXFP4 39

__device__ __constant__ int8_t kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// ggml_e8m0_to_fp32_half: 2^(e - 128) built from its bits.
__device__ __forceinline__ float e8m0_to_f32_half(uint32_t e) {
    return __uint_as_float(e < 2u ? (0x00200000u << e) : ((e - 1u) << 23));
}

template <>
__device__ __forceinline__ void dequant8<FMT_MXFP4>(const uint8_t* __restrict__ row, int g, float out[8]) {
    const uint8_t* blk = row + (g >> 2) * 17;
    const int s = g & 3;  // elements 8s..8s+8 of the block: qs[(s & 1) * 8 ..], nibble s >> 1
    const float d = e8m0_to_f32_half(blk[0]);
    const uint8_t* qs = blk + 1 + (s & 1) * 8;
    const int shift = (s >> 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = fmul((float)kvalues_mxfp4[(qs[i] >> shift) & 0xF], d);
}
// Parameters of moe_gemm_* (kernels/moe.cu), mirrored by `moe::MoeGemmArgs`
// (src/backend/cuda/moe.rs). x: (n_x_rows, k) bf16, 16-byte aligned; x_rows:
// (n_slots) the row of x each slot reads, or null (slot s reads row s); w: per
// expert the base of its (n, k) weight rows of row_bytes (the gate weight of the
// gated kernels); w_up: the up weights (gated kernels) or null; tiles: (n_tiles,
// 3) expert, first slot, end slot (exclusive, at most 64 slots); y: (n_slots,
// ldy) f32 (plain) or bf16 (gated).
struct MoeGemmArgs {
    const bf16* x;
    const int* x_rows;
    const unsigned long long* w;
    const unsigned long long* w_up;
    const int* tiles;
    void* y;
    long long row_bytes;
    long long ldy;
    int n;
    int k;
};
static_assert(sizeof(MoeGemmArgs) == 72, "MoeGemmArgs layout differs from moe::MoeGemmArgs");

// Parameters of moe_combine (kernels/moe.cu), mirrored by `moe::MoeCombineArgs`.
// y: (n_slots, d) f32 expert outputs; slot, weight: (n_rows, top_k) per row its
// experts' slots and routing weights in ascending expert index; out: (n_rows, d) f32.
struct MoeCombineArgs {
    const float* y;
    const int* slot;
    const double* weight;
    float* out;
    int n_rows;
    int d;
    int top_k;
    int pad_;
};
static_assert(sizeof(MoeCombineArgs) == 48, "MoeCombineArgs layout differs from moe::MoeCombineArgs");
// --- end moecuda ---

// --- attn ---
// Shared by the flash-attention kernels v2 (attention.cu) and v3 (attention_sm90a.cu).

// 2^x (MUFU.EX2, flush-to-zero; 2^-inf = 0): the probabilities are rounded to
// bf16 next, far coarser than its ~2 ulp error.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
constexpr float LOG2E = 1.4426950408889634f;

// Two adjacent outputs (8-byte aligned f32 pair, or one 32-bit bf16 pair, nearest even).
template <typename OUT>
__device__ __forceinline__ void store2(OUT* p, float a, float b);
template <>
__device__ __forceinline__ void store2<float>(float* p, float a, float b) {
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
template <>
__device__ __forceinline__ void store2<bf16>(bf16* p, float a, float b) {
    *reinterpret_cast<uint32_t*>(p) = pack_bf16x2(a, b);
}

// attn_wgmma_*'s one parameter (kernels/attention_sm90a.cu, a __grid_constant__),
// mirrored by `ops::AttnWgmmaArgs`. k, v: 3-D bf16 tensor maps over one layer's
// cache seen as (d_head, kv_len = pos0 + n_tokens, n_seqs * n_kv_heads) (strides
// 2 * d_head and 2 * n_ctx * d_head bytes), box (64, 128, 1), 128-byte swizzle,
// zeros outside; q: (n_seqs * n_tokens, q_stride) f32, 16-byte aligned, q_stride %
// 4 == 0; out: (n_seqs * n_tokens, out_stride) f32 or bf16, pairs aligned.
struct AttnWgmmaArgs {
    TmaDesc k;
    TmaDesc v;
    const float* q;
    void* out;
    long long q_stride;
    long long out_stride;
    int n_tokens;
    int n_heads;
    int n_kv_heads;
    int pos0;
    int window;  // 0 = full causal
    float scale;
    float softcap;  // 0 = none
    int n_seqs;     // windows of the pass (the persistent grid walks n_qt * n_heads * n_seqs items)
};
static_assert(sizeof(AttnWgmmaArgs) == 384 && alignof(AttnWgmmaArgs) == 128, "AttnWgmmaArgs layout (ops::AttnWgmmaArgs)");
// --- end attn ---

// --- delta ---
// Parameters of delta_net_conv (kernels/delta_net.cu), mirrored by
// `delta_net::DeltaConvArgs` (src/backend/cuda/delta_net.rs). x, out: (n_seqs *
// n_tokens, n_channels) f32, window-major rows; w: (n_channels, width) taps;
// history: (n_seqs, width - 1, n_channels), read then overwritten.
#define DELTA_CONV_MAX_WIDTH 8
struct DeltaConvArgs {
    const float* x;
    const float* w;
    float* history;
    float* out;
    int n_seqs;
    int n_tokens;
    int n_channels;
    int width;
};
static_assert(sizeof(DeltaConvArgs) == 48, "DeltaConvArgs layout differs from delta_net::DeltaConvArgs");

// Parameters of delta_net_scan (kernels/delta_net.cu), mirrored by
// `delta_net::DeltaScanArgs`. mixed: (n_rows, 2 * n_k_heads * d_k + n_v_heads *
// d_v) the convolved q | k | v; z: (n_rows, n_v_heads * d_v); ba: (n_rows, 2 *
// n_v_heads) per key head its beta then alpha inputs; a, dt_bias: (n_v_heads);
// norm: (d_v); state: (n_seqs, n_v_heads, d_k, d_v) f64, read then overwritten;
// out: (n_rows, n_v_heads * d_v). Rows are window-major, n_tokens per window.
struct DeltaScanArgs {
    const float* mixed;
    const float* z;
    const float* ba;
    const float* a;
    const float* dt_bias;
    const float* norm;
    double* state;
    float* out;
    double eps;
    int n_tokens;
    int n_k_heads;
    int n_v_heads;
    int d_k;
    int d_v;
    int pad_;
};
static_assert(sizeof(DeltaScanArgs) == 96, "DeltaScanArgs layout differs from delta_net::DeltaScanArgs");
// --- end delta ---

// --- moe4 ---
// Parameters of moe_dequant_bank_<fmt> (kernels/moe.cu), mirrored by
// `moe::MoeDequantArgs`: out[e] = bf16(dequant(W[e])) for every expert e of a
// bank, expert-major (n_experts, n_rows, groups_per_row * 8) bf16; w: (n_experts)
// base pointers of the experts' (n_rows, K) weights of row_bytes.
struct MoeDequantArgs {
    const unsigned long long* w;
    bf16* out;
    long long row_bytes;
    int n_rows;
    int groups_per_row;
};
static_assert(sizeof(MoeDequantArgs) == 32, "MoeDequantArgs layout differs from moe::MoeDequantArgs");

// Parameters of moe_gather_bf16 (kernels/moe.cu), mirrored by `moe::MoeGatherArgs`:
// out[s] = x[rows[s]], x (n_x_rows, groups_per_row * 8) bf16, out (n_slots, same).
struct MoeGatherArgs {
    const bf16* x;
    const int* rows;
    bf16* out;
    int n_slots;
    int groups_per_row;
};
static_assert(sizeof(MoeGatherArgs) == 32, "MoeGatherArgs layout differs from moe::MoeGatherArgs");

// Parameters of moe_wgmma_{plain,gated_silu,gated_gelu} (kernels/moe_sm90a.cu),
// mirrored by `moe::MoeWgmmaParams` (a __grid_constant__). a: the slot-ordered
// rows (n_slots, K) bf16, box (64 K, 128 rows); b: the expert-major bf16 bank
// (n_experts * n, K), box (64 K, 256 rows) for the plain product, (64 K, 128
// rows) of the gate bank for the gated one; b_up: the up bank (gated), box (64
// K, 128 rows) (the plain kernel ignores it); tiles: (n_tiles, 3) expert, first
// slot, end slot (at most 128 slots); y: (n_slots, ldy) f32 (plain) or bf16
// (gated), ldy even, 8-byte aligned; n: output columns per expert (even).
struct MoeWgmmaParams {
    TmaDesc a;
    TmaDesc b;
    TmaDesc b_up;
    const int* tiles;
    void* y;
    long long ldy;
    int n, k, n_tiles, pad_;
};
static_assert(sizeof(MoeWgmmaParams) == 512 && alignof(MoeWgmmaParams) == 128, "MoeWgmmaParams layout (moe::MoeWgmmaParams)");
// Parameters of moe_route (kernels/moe.cu), mirrored by `moe::MoeRouteArgs`:
// logits (n_rows, n_experts) f32; experts (n_rows, top_k) i32 and weights
// (n_rows, top_k) f64, ascending expert per row; top_k <= MOE_MAX_TOP_K.
#define MOE_MAX_TOP_K 32
struct MoeRouteArgs {
    const float* logits;
    int* experts;
    double* weights;
    int n_experts;
    int top_k;
    int norm_topk_prob;
    int pad_;
};
static_assert(sizeof(MoeRouteArgs) == 40, "MoeRouteArgs layout differs from moe::MoeRouteArgs");

// Parameters of moe_plan_slots (kernels/moe.cu), mirrored by `moe::MoePlanArgs`:
// experts (n_rows, top_k) from moe_route; seg (n_experts + 1) slot offsets;
// slot_rows (n_slots) and combine_slots (n_rows, top_k) written.
struct MoePlanArgs {
    const int* experts;
    const int* seg;
    int* slot_rows;
    int* combine_slots;
    int n_rows;
    int top_k;
};
static_assert(sizeof(MoePlanArgs) == 40, "MoePlanArgs layout differs from moe::MoePlanArgs");
// --- end moe4 ---

// --- moe5 ---
// Parameters of moe_plan_tiles (kernels/moe.cu), mirrored by `moe::MoeTilesArgs`:
// from counts (n_experts) i32, the rows routed to each expert in this layer call,
// writes seg (n_experts + 1) i32 slot offsets and the tile table tiles
// (n_table_rows, 3) i32 (expert, first slot, end slot; at most slots_per_tile
// slots a tile, experts ascending), its rows past the real tiles sentinels (-1,
// n_real, n_real); usage (n_experts) u64 += counts (or null); banks (n_banks,
// n_experts) u64 pointer tables whose entries of experts without rows are set to 0.
struct MoeTilesArgs {
    const int* counts;
    int* seg;
    int* tiles;
    unsigned long long* usage;
    unsigned long long* banks;
    int n_experts;
    int slots_per_tile;
    int n_table_rows;
    int n_banks;
};
static_assert(sizeof(MoeTilesArgs) == 56, "MoeTilesArgs layout differs from moe::MoeTilesArgs");
// --- end moe5 ---

// --- attnq5 ---
// Shared by the flash-attention kernels v2 (attention.cu) and v3 (attention_sm90a.cu) on a
// quantized cache: the Hadamard rotation on mma / wgmma accumulator fragments, and the
// one-byte codes of fp8 and int8 rows (src/kv/codec.rs) to their exact f32 values.

// The rotation (kv::hadamard: blocks of n = D & -D, butterflies (a + b, a - b) over
// index bit 0, then 1, 2, ...: hadamard_rows_impl's pairs in its stage order) of one
// row held in mma fragment order across a quad: v[j] (N = D / 4 values) is column
// (j & 1) | (lane & 3) << 1 | (j >> 1) << 3, the layout of a thread's Q A-fragment
// values of one row (j = 4 kk + 2 hi + e) and of its O accumulators of one row
// (j = 2 dt + e). Column bits 1 and 2 pair lanes (shuffles), the others registers;
// the same additions in the same order as the shared-memory version, so the same bits,
// with no shared memory and no barrier.
template <int D>
__device__ __forceinline__ void hadamard_frag(float (&v)[D / 4], int lane) {
    constexpr int LOGN = __builtin_ctz(D & -D);
#pragma unroll
    for (int b = 0; b < LOGN; ++b) {
        if (b == 1 || b == 2) {
            const int m = 1 << (b - 1);
            const bool hi = (lane & m) != 0;
#pragma unroll
            for (int j = 0; j < D / 4; ++j) {
                const float o = __shfl_xor_sync(0xffffffffu, v[j], m);
                v[j] = hi ? __fsub_rn(o, v[j]) : __fadd_rn(v[j], o);
            }
        } else {
            const int m = b == 0 ? 1 : 1 << (b - 2);
#pragma unroll
            for (int j = 0; j < D / 4; ++j) {
                if (j & m) continue;
                const float x = v[j], y = v[j | m];
                v[j] = __fadd_rn(x, y);
                v[j | m] = __fsub_rn(x, y);
            }
        }
    }
}

// The four E4M3 bytes of w as two f16x2 words (bytes 0, 1 in lo, bytes 2, 3 in hi; byte
// 2i in the low half), exact: cvt.rn.f16x2.e4m3x2 (sm_89+) on the word's 16-bit halves.
// SPLIT: the halves split in PTX (mov.b32 {l, h}), so ptxas reads the high half in place
// (R.H1) where a shift by 16 cost an instruction per word (e4m3 halves, 2026-12-04);
// else the high half shifted down first (e4m3d64: CodeE4m3T).
template <bool SPLIT = true>
__device__ __forceinline__ void e4m3x4_f16(uint32_t w, uint32_t& lo, uint32_t& hi) {
    if constexpr (SPLIT) {
        asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
            : "=r"(lo), "=r"(hi)
            : "r"(w));
    } else {
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(lo) : "h"((unsigned short)(w & 0xFFFFu)));
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(hi) : "h"((unsigned short)(w >> 16)));
    }
}

// One-byte codes, four per 32-bit word (low byte first), to their exact f32 values.
// E4M3: cvt.rn.f16x2.e4m3x2 (e4m3x4_f16, two codes per instruction): every E4M3 value is
// an f16, so the conversion is exact and equals e4m3_value (0x7F / 0xFF give NaN).
// SPLIT as e4m3x4_f16's: the same values either way; false only for kernel v3's d 64
// decoding fp8 kernel, which measured 1.5 % slower with the split (e4m3d64, 2026-12-04).
template <bool SPLIT = true>
struct CodeE4m3T {
    static __device__ __forceinline__ void cvt4(uint32_t w, float v[4]) {
        uint32_t lo, hi;
        e4m3x4_f16<SPLIT>(w, lo, hi);
        const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo)), b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
        v[0] = a.x;
        v[1] = a.y;
        v[2] = b.x;
        v[3] = b.y;
    }
};
using CodeE4m3 = CodeE4m3T<>;
// int8: byte b ^ 0x80 as the low mantissa bits of 2^23 is the float 2^23 + 128 + b
// exactly; subtracting 2^23 + 128 (exact) leaves b (a byte permute and an add, no I2F).
struct CodeInt8 {
    static __device__ __forceinline__ void cvt4(uint32_t w, float v[4]) {
        const uint32_t u = w ^ 0x80808080u;
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = __fsub_rn(__uint_as_float(__byte_perm(u, 0x4B000000u, 0x7440u + j)), 8388736.0f);
    }
    // The four values as two f16x2 words: b ^ 0x80 as the low mantissa byte of the f16
    // 1024 (0x6400) is 1152 + b exactly; subtracting 1152 (one HSUB2 per pair) leaves b.
    static __device__ __forceinline__ void h4(uint32_t w, uint32_t h[2]) {
        const uint32_t u = w ^ 0x80808080u;
        const __half2 off = __floats2half2_rn(1152.0f, 1152.0f);
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            uint32_t x = __byte_perm(u, 0x64646464u, 0x4140u + 0x0202u * p);
            const __half2 v = __hsub2(*reinterpret_cast<const __half2*>(&x), off);
            h[p] = *reinterpret_cast<const uint32_t*>(&v);
        }
    }
};
// nvfp4's decode of eight elements (kv::codec, "nvfp4": value (e2m1 * e4m3) * S, the
// inner product exact, one f32 rounding by S), shared by attention.cu DecNvfp4 and
// attention_sm90a.cu RowNvfp4. q: eight E2M1 nibbles (element 0 in the low nibble);
// block: the E4M3 block scale's byte; S: the f32 row scale. Each nibble (s e1 e0 m)
// becomes the E4M3 byte (s 0 0 e1 e0 m 0 0), whose value is the E2M1 value / 64, and
// cvt.rn.f16x2.e4m3x2 (exact: every E4M3 value is an f16) gives it and the block scale
// as f16; their product in f16 (__hmul2) is exact: (v / 64) * b has at most 2 + 4
// significant bits and lies in [2^-16, 42] (its lowest bit at least 2^-16 against f16's
// 2^-24, no overflow), NaN for a NaN block scale. Then in f32 times S * 64 (exact: a power
// of two, S at most f32::MAX / 2688), which rounds the same real number v * b * S once as
// (v * b) * S does. Four f16 multiplies and eight f32 ones per 8 elements, where
// multiplying in f32 took sixteen f32 multiplies (and e4m3_value's branches).
struct CodeNvfp4 {
    // The eight values e2m1 / 64 as four f16x2 words, exact (the nibble (s e1 e0 m) as the
    // E4M3 byte (s 0 0 e1 e0 m 0 0)): ORDERED, element 2i in the low half of h[i], element
    // 2i + 1 in the high; else the elements in the order 0, 2, 4, 6, 1, 3, 5, 7 (h = (0, 2),
    // (4, 6), (1, 3), (5, 7): no byte permute; attn-f16's K, whose q is staged in the same
    // order), the E4M3 bytes straight from q: the even (low) nibbles' sign to bit 7 and
    // magnitude to bits 2-4, ((q << 4) & 0x80..) | ((q << 2) & 0x1C..); the odd (high)
    // nibbles' sign is already at bit 7, (q & 0x80..) | ((q >> 2) & 0x1C..). (The same
    // expressions in the ORDERED path measured 2 % slower in the decoding kernel on the
    // H200, so that path keeps `remap`.)
    template <bool ORDERED = true>
    static __device__ __forceinline__ void codes8(uint32_t q, uint32_t h[4]) {
        uint32_t w0, w1;
        if constexpr (ORDERED) {
            auto remap = [](uint32_t x) { return ((x & 0x08080808u) << 4) | ((x & 0x07070707u) << 2); };
            const uint32_t lo = remap(q & 0x0F0F0F0Fu), hi = remap((q >> 4) & 0x0F0F0F0Fu);
            w0 = __byte_perm(lo, hi, 0x5140u);  // nibbles 0-3
            w1 = __byte_perm(lo, hi, 0x7362u);  // nibbles 4-7
        } else {
            w0 = ((q << 4) & 0x80808080u) | ((q << 2) & 0x1C1C1C1Cu);  // elements 0, 2, 4, 6
            w1 = (q & 0x80808080u) | ((q >> 2) & 0x1C1C1C1Cu);         // elements 1, 3, 5, 7
        }
        e4m3x4_f16(w0, h[0], h[1]);
        e4m3x4_f16(w1, h[2], h[3]);
    }
    // The E4M3 block scale's byte as the f16 pair (b, b), exact.
    static __device__ __forceinline__ __half2 block_h2(uint32_t block) {
        uint32_t b;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(b) : "h"((unsigned short)((block & 0xFFu) * 0x101u)));
        return *reinterpret_cast<const __half2*>(&b);
    }
    // The eight products (e2m1 / 64) * e4m3 as four f16x2 words, exact, in codes8's order.
    template <bool ORDERED = true>
    static __device__ __forceinline__ void h8(uint32_t q, uint32_t block, uint32_t h[4]) {
        codes8<ORDERED>(q, h);
        const __half2 b2 = block_h2(block);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const __half2 p = __hmul2(*reinterpret_cast<const __half2*>(&h[i]), b2);
            h[i] = *reinterpret_cast<const uint32_t*>(&p);
        }
    }
    static __device__ __forceinline__ void dec8(uint32_t q, uint32_t block, float S, float v[8]) {
        uint32_t h[4];
        h8(q, block, h);
        const float S64 = __fmul_rn(S, 64.0f);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h[i]));
            v[2 * i] = __fmul_rn(f.x, S64);
            v[2 * i + 1] = __fmul_rn(f.y, S64);
        }
    }
};
// attn_wgmma_d<D>_<fmt>_<out>'s one parameter (fmt = kv::KvFormat::name of a quantized format; attention_sm90a.cu),
// mirrored by `ops::AttnWgmmaCodedArgs`: `a` as for a bf16 cache, except that its k and
// v are 3-D tensor maps of bytes over the coded rows (src/kv's rows of
// coded_row_bytes(d_head) = d_head codes, the f32 row scale, zeros to 16 bytes), seen
// as (row bytes, kv_len, n_seqs * n_kv_heads), box (row bytes, 128, 1), no swizzle,
// zeros outside; rot: bit 0 K rows Hadamard-rotated, bit 1 V rows (RowCodec::rotate);
// book: vq2's codebook (256 x 4 f32, 16-byte aligned), null for the other formats.
struct AttnWgmmaCodedArgs {
    AttnWgmmaArgs a;
    int rot;
    int pad_;
    const float* book;
};
static_assert(sizeof(AttnWgmmaCodedArgs) == 512, "AttnWgmmaCodedArgs layout (ops::AttnWgmmaCodedArgs)");
// --- end attnq5 ---

// --- qk9 ---
// Parameters of attn_wgmma_d<D>_fp8qk_<out> (kernels/attention_sm90a.cu, the named fast
// path attn-fp8-qk), mirrored by `ops::AttnWgmmaQkArgs`: `c` as for the fp8 kernel except
// that c.a.k maps the 16 bytes from byte d_head of each K row (the f32 scale first), seen
// as (16, kv_len, n_seqs * n_kv_heads), box (16, 128, 1), no swizzle; kc maps K's d_head
// code bytes per row, (d_head, kv_len, n_seqs * n_kv_heads), row stride the row bytes,
// box (d_head, 128, 1), 128-byte swizzle at d_head 128, 64-byte at 64.
struct AttnWgmmaQkArgs {
    AttnWgmmaCodedArgs c;
    TmaDesc kc;
};
static_assert(sizeof(AttnWgmmaQkArgs) == 640, "AttnWgmmaQkArgs layout (ops::AttnWgmmaQkArgs)");
// --- end qk9 ---
