// attention.cu: KV-cache store and causal prefill attention (GQA, optional
// sliding window), flash-attention style, in two kernels kept side by side:
// v1 (attn_prefill_*, f32 on the CUDA cores, bf16 or f32 cache: the FP32
// route's exact path) and v2 (attn_flash_*, below: tensor cores, bf16 or
// quantized cache, the default route). ops::AttnKernel selects one; the report names it.
//
// Cache layout, per layer: (n_seqs, n_kv_heads, n_ctx, d_head), BF16
// (default route) or f32 (FP32 route); a head's keys are contiguous so a key
// tile is one contiguous read. A pass batches n_seqs windows: their rows are
// window-major in src, q and out (row s * n_tokens + t is window s's token
// t), and window s owns cache slot s.
//
// kv_store_<kv>: cache[s, h, pos0 + t, :] = src[s * n_tokens + t, h*d_head : (h+1)*d_head]
// (f32 -> cache type, round to nearest even). Grid (n_tokens, n_kv_heads, n_seqs), block 128.
//
// attn_prefill_d<D>_<kv>_<out>: query t (position pos0 + t) of head h attends
// to the cached keys kp of kv head h / (n_heads / n_kv_heads) with
// kp <= pos0 + t and, when window > 0, pos0 + t - kp < window. The cache must
// hold positions [0, pos0 + n_tokens) (earlier passes of the same window plus
// this one), so a window can be prefilled in several passes.
// Algorithm: online softmax over key tiles of 32. A block takes 16 queries of
// one head (4 warps, 4 queries each) and walks the key tiles that any of its
// queries can see; K and V tiles are staged in shared memory (K rows padded
// to an odd word stride, so lane j reading key j is conflict-free). Scores:
// lane j computes q·k_j for its warp's 4 queries (f32 FMA over d_head),
// applies the optional tanh soft-cap (softcap > 0: s = softcap * tanh(s /
// softcap) on the scaled logits, gemma2-style), masks, then (max, sum) are updated with warp shuffles; each lane owns
// d_head/32 output dimensions and accumulates p_j * v_j[dim] in f32.
// Output = acc / l. The math is f32 on the CUDA cores (kernel v1).
//
// Windows of a batched pass are independent: blockIdx.z picks the window and
// offsets q, out and the caches to it.
//
// Launch: grid (ceil(n_tokens/16), n_heads, n_seqs), block 128, dynamic shared memory
// 16*D*4 + 32*(D+pad)*sizeof(kv) + 32*D*sizeof(kv) bytes (above 48 KiB for
// D = 256 with an f32 cache: the launcher raises the function's limit).
#include "common.cuh"

#define ATT_BQ 16
#define ATT_BK 32

#define KV_STORE(name, T)                                                                        \
    extern "C" __global__ void __launch_bounds__(128)                                            \
        kv_store_##name(const float* src, T* cache, int d_head, int n_ctx, int pos0,             \
                        long long src_stride) {                                                  \
        const int t = blockIdx.x, h = blockIdx.y, seq = blockIdx.z;                              \
        const float* s = src + ((long long)seq * gridDim.x + t) * src_stride + (long long)h * d_head; \
        T* d = cache + (((long long)seq * gridDim.y + h) * n_ctx + pos0 + t) * d_head;            \
        for (int i = threadIdx.x; i < d_head; i += blockDim.x) d[i] = from_f32<T>(s[i]);         \
    }
KV_STORE(bf16, bf16)
KV_STORE(f32, float)

// Padding (in elements) of a shared K row: the row stride in 32-bit words becomes odd.
template <typename KV>
struct KPad;
template <>
struct KPad<bf16> { static constexpr int v = 2; };
template <>
struct KPad<float> { static constexpr int v = 1; };

template <int D, typename KV, typename OUT>
__device__ void attn_prefill_impl(const float* __restrict__ q, const KV* __restrict__ k_cache,
                                  const KV* __restrict__ v_cache, OUT* __restrict__ out, int n_tokens,
                                  int n_heads, int n_kv_heads, int n_ctx, int pos0, int window,
                                  float scale, float softcap, long long q_stride,
                                  long long out_stride) {
    // q: (n_tokens, q_stride), head h at h*D; k/v_cache: (n_kv_heads, n_ctx, D);
    // out: (n_tokens, out_stride), head h at h*D.
    constexpr int DPL = D / 32;  // output dims per lane
    constexpr int KLD = D + KPad<KV>::v;
    extern __shared__ __align__(16) unsigned char smem[];
    float* sq = reinterpret_cast<float*>(smem);                        // (ATT_BQ, D)
    KV* sk = reinterpret_cast<KV*>(smem + ATT_BQ * D * sizeof(float)); // (ATT_BK, KLD)
    KV* sv = sk + ATT_BK * KLD;                                        // (ATT_BK, D)

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int t0 = blockIdx.x * ATT_BQ, h = blockIdx.y;
    const int kvh = h / (n_heads / n_kv_heads);
    const int kv_len = pos0 + n_tokens;
    const int t_last = min(t0 + ATT_BQ, n_tokens) - 1;

    for (int i = threadIdx.x; i < ATT_BQ * D; i += blockDim.x) {
        const int r = i / D, c = i % D;
        sq[i] = t0 + r < n_tokens ? q[(long long)(t0 + r) * q_stride + (long long)h * D + c] : 0.0f;
    }

    float m[4], l[4], acc[4][DPL];
#pragma unroll
    for (int qi = 0; qi < 4; ++qi) {
        m[qi] = -INFINITY;
        l[qi] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[qi][i] = 0.0f;
    }

    const int k_hi = pos0 + t_last;  // last key any query of the block sees
    int k_lo = window > 0 ? pos0 + t0 - window + 1 : 0;
    k_lo = max(k_lo, 0) / ATT_BK * ATT_BK;
    const KV* kh = k_cache + (long long)kvh * n_ctx * D;
    const KV* vh = v_cache + (long long)kvh * n_ctx * D;

    for (int kt = k_lo; kt <= k_hi; kt += ATT_BK) {
        __syncthreads();  // previous tile consumed (and sq written, first time)
        // Stage K and V rows kt .. kt+31; rows at or past kv_len are zero.
        for (int i = threadIdx.x; i < ATT_BK * D; i += blockDim.x) {
            const int r = i / D, c = i % D;
            const bool ok = kt + r < kv_len;
            KV kv0 = from_f32<KV>(0.0f), vv0 = kv0;
            if (ok) {
                kv0 = kh[(long long)(kt + r) * D + c];
                vv0 = vh[(long long)(kt + r) * D + c];
            }
            sk[r * KLD + c] = kv0;
            sv[r * D + c] = vv0;
        }
        __syncthreads();

        // Scores of key kt + lane against the warp's 4 queries.
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const KV* krow = sk + lane * KLD;
        const float* qw = sq + warp * 4 * D;
#pragma unroll 8
        for (int d = 0; d < D; ++d) {
            const float kd = to_f32(krow[d]);
#pragma unroll
            for (int qi = 0; qi < 4; ++qi) s[qi] = fmaf(qw[qi * D + d], kd, s[qi]);
        }
        const int kp = kt + lane;
        float p[4];
#pragma unroll
        for (int qi = 0; qi < 4; ++qi) {
            const int t = t0 + warp * 4 + qi;
            const int qp = pos0 + t;
            const bool vis = t < n_tokens && kp <= qp && kp < kv_len && (window <= 0 || qp - kp < window);
            float sc = s[qi] * scale;
            if (softcap > 0.0f) sc = softcap * tanhf(sc / softcap);
            sc = vis ? sc : -INFINITY;
            const float m_new = fmaxf(m[qi], warp_max(sc));
            if (m_new == -INFINITY) {  // nothing visible yet for this query
                p[qi] = 0.0f;
                continue;
            }
            const float corr = expf(m[qi] - m_new);  // 0 when m was -inf
            p[qi] = vis ? expf(sc - m_new) : 0.0f;
            l[qi] = l[qi] * corr + warp_sum(p[qi]);
            m[qi] = m_new;
#pragma unroll
            for (int i = 0; i < DPL; ++i) acc[qi][i] *= corr;
        }
#pragma unroll 4
        for (int j = 0; j < ATT_BK; ++j) {
            float pj[4];
#pragma unroll
            for (int qi = 0; qi < 4; ++qi) pj[qi] = __shfl_sync(0xffffffffu, p[qi], j);
#pragma unroll
            for (int i = 0; i < DPL; ++i) {
                const float vd = to_f32(sv[j * D + lane + 32 * i]);
#pragma unroll
                for (int qi = 0; qi < 4; ++qi) acc[qi][i] = fmaf(pj[qi], vd, acc[qi][i]);
            }
        }
    }

#pragma unroll
    for (int qi = 0; qi < 4; ++qi) {
        const int t = t0 + warp * 4 + qi;
        if (t >= n_tokens) continue;
        const float inv = 1.0f / l[qi];
        OUT* o = out + (long long)t * out_stride + (long long)h * D;
#pragma unroll
        for (int i = 0; i < DPL; ++i) o[lane + 32 * i] = from_f32<OUT>(acc[qi][i] * inv);
    }
}

#define ATTN(D, kvn, KV, outn, OUT)                                                              \
    extern "C" __global__ void __launch_bounds__(128) attn_prefill_d##D##_##kvn##_##outn(         \
        const float* q, const KV* k_cache, const KV* v_cache, OUT* out, int n_tokens, int n_heads, \
        int n_kv_heads, int n_ctx, int pos0, int window, float scale, float softcap,              \
        long long q_stride, long long out_stride) {                                              \
        const long long seq = blockIdx.z, cache_off = seq * n_kv_heads * n_ctx * D;               \
        attn_prefill_impl<D, KV, OUT>(q + seq * n_tokens * q_stride, k_cache + cache_off,         \
                                      v_cache + cache_off, out + seq * n_tokens * out_stride,     \
                                      n_tokens, n_heads, n_kv_heads, n_ctx, pos0, window, scale,  \
                                      softcap, q_stride, out_stride);                             \
    }
#define ATTN_D(D)                       \
    ATTN(D, bf16, bf16, f32, float)     \
    ATTN(D, bf16, bf16, bf16, bf16)     \
    ATTN(D, f32, float, f32, float)     \
    ATTN(D, f32, float, bf16, bf16)
ATTN_D(64)
ATTN_D(96)
ATTN_D(128)
ATTN_D(256)

// ================================================================ v2: flash attention on the tensor cores
//
// attn_flash_d<D>_<kv>_<out>(AttnArgs): the same contract as attn_prefill_*
// (causal, optional sliding window, GQA, soft-cap, a cache filled by earlier
// passes, blockIdx.z = window of a batched pass), for a bf16 cache (kv = bf16)
// or a cache of a quantized KV format (kv = fp8 | int8 | nvfp4 | k8v4 | k4v2 |
// vq2: rows of src/kv's layout of the format's K and V codecs, written by
// kv_encode_<codec> in kv_codec.cu).
// Algorithm (FlashAttention-2's forward): a block owns BQ = 16 * MT * W queries of
// one head, W = warps(D, raw) warps of 16 * MT query rows each (MT = m_tiles(D), 1
// today; W = 4 for a bf16 cache, 8 for a coded one up to d_head 128, see there), and walks the key tiles of BK = key_tile(D, raw) keys that any of its
// queries can see. Per tile:
//   S = Q·Kᵀ      mma.sync m16n8k16 bf16 -> f32; Q is the f32 input rounded to
//                 bf16 (round to nearest even) once, when the block stages it;
//   x = S * scale, optional cap * tanh(x / cap), masked to -inf, times log2(e);
//   online softmax in f32 (row max over the quad with shuffles, ex2.approx);
//   O += P·V      P rounded to bf16 (the A operand), V from ldmatrix.trans,
//                 f32 accumulation; l sums the unrounded f32 probabilities.
// Output = O / l. Q's bf16 mma fragments are held in registers up to d_head 128
// (q_in_regs), else Q lives in shared memory and is read with ldmatrix. K and V have
// two bf16 stages each in shared memory, rows padded by 8 elements (16 B), which
// makes every ldmatrix phase conflict-free; one barrier per tile. bf16 cache: tile
// n + 1 is fetched with cp.async (16 B, zero-filled past the cached positions) into
// the free stage while tile n's MMAs run. Quantized cache: the tile's rows as stored
// (codes and scales) are fetched the same way into two raw stages, two tiles ahead;
// during tile n, tile n + 1 is decoded from its raw stage into the free bf16 stage,
// its K chunks placed between the k-steps of S = Q·Kᵀ and its V chunks between those
// of P·V, so the decode's ALU work overlaps the tensor-core work (software
// pipelining; one decoder per codec, flash::Dec*, the template's K and V parameters,
// so K and V may differ: k8v4, k4v2): each 8-element chunk of a row is decoded as
// kv::codec decodes it (code value * scale, one f32 multiply) and rounded to bf16
// (nearest even) into shared memory: the operand rounding a bf16 cache gets when it is
// stored, applied here to the decoded value; formats of one scale per row (fp8, int8,
// k8v4's K), up to d_head 128, instead store the exact code values (E4M3 through the exact
// cvt.rn.f16x2.e4m3x2, int8 through an exact byte-permute-and-subtract; both exact in
// bf16) and their row scales, which multiply the key's column of S (K: folded into
// scale * log2 e) or of P before its bf16 rounding (V): q·(c s) = (q·c) s and
// Σ p (c s) = Σ (p s) c, no rounding of the decoded element (DecByte). No dequantized copy of the
// cache exists; a poisoned row (NaN scale) decodes to NaN as on the CPU. Rotated rows
// (AttnArgs::rot; src/kv/hadamard.rs, y = H x stored) stay in the rotated basis:
// a rotated K is met by staging q as (H q) / n (f32, the exact power-of-two 1/n,
// then the bf16 rounding), so q·k = ((H q) / n)·y; a rotated V by rotating the
// output back, O = (H O') / n with O' = Σ p y / l (f32). For a coded cache up to
// d_head 128 both rotations run in registers on the mma fragments (hadamard_frag, common.cuh: a quad holds
// a row whole; shuffles for two of the index bits, no shared memory, no barrier); at
// d_head 256 through hadamard_rows_d over an f32 scratch in the K and V stages (before
// the first tile, after the last). Both compute the same butterflies in the same order
// (the same bits). Query tiles run in reverse order (the longest causal rows start first).
// Launch: grid (ceil(n_tokens/BQ), n_heads, n_seqs), block 32 * W (threads(D, raw)),
// dynamic shared memory [BQ * (D + 8) * 2 when D > 128] + 4 * BK * (D + 8) * 2, plus
// 2 * BK * (k_row_bytes + v_row_bytes) + 16 * BK (the K and V factor stages) for a
// quantized cache (BK = key_tile: 64, 32 for a quantized cache at D = 256): bf16 d 128
// 69632 bytes (BQ 64, block 128), fp8 d 128 107520 (BQ 128, block 256), bf16 d 256
// 168960, fp8 d 256 136704 (BQ 64, block 128).
// The launcher (ops::attention, ops::attn_flash_tiles) mirrors m_tiles, warps and key_tile.
// CPU twin: backend::cpu::attention::attention on the same bf16-rounded q, k, v
// (a quantized format: on the CPU backend's cache of that format, kv::codec
// decode; the bf16 roundings of the decoded K/V and of (H q) / n are the
// differences the parity test's tolerance covers, tests/gpu_ops.rs).

namespace flash {
// Warps per block: 4 for a bf16 cache; 8 for a coded cache up to d_head 128, so each
// decoded K/V tile is shared by 128 query rows instead of 64 and every thread decodes
// half as many chunks per tile (the decode is ALU work issued beside the MMAs: with 4
// warps it nearly doubled the instructions per tile; the rows each warp computes and
// their arithmetic are unchanged, so the outputs are bit-identical). At d_head 256 the
// (BQ, D) f32 scratch of the rotations would not fit over the K and V stages: 4.
__host__ __device__ constexpr int warps(int d, bool raw) { return !raw && d <= 128 ? 8 : 4; }
__host__ __device__ constexpr int threads(int d, bool raw) { return 32 * warps(d, raw); }
// 16-row query tiles per warp (BQ = 64 * MT) and keys per tile. Measured on the
// H200 (benches/attention.rs, causal, ctx 4096): MT = 2 (each K/V fragment feeding
// two MMAs; BK = 32 at d_head 96/128 to stay within 255 registers) ran at 201.7
// TFLOP/s for d 128 and 170.4 for d 64, against 205.6 and 181.1 with MT = 1,
// BK = 64: shared-memory bandwidth is not what bounds this kernel, so MT = 1.
__host__ __device__ constexpr int m_tiles(int) { return 1; }
// Keys per tile: 64, but 32 for a coded cache at d_head 256 (its two bf16 stages of K
// and V plus two raw stages would not fit in shared memory at 64).
__host__ __device__ constexpr int key_tile(int d, bool raw) { return raw || d <= 128 ? 64 : 32; }
// Q's fragments live in registers (D / 16 * 4 per thread) up to d_head 128; at 256 they
// would not fit beside O, so Q stays in shared memory and is read with ldmatrix.
__host__ __device__ constexpr bool q_in_regs(int d) { return d <= 128; }

// exp2_approx, LOG2E and store2 (shared with attention_sm90a.cu): common.cuh, block "attn".

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldsm_x4(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
// c += a · b, one m16n8k16 bf16 tile with f32 accumulation.
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// 16 bytes global -> shared; src_bytes = 0 writes zeros without reading.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// hadamard_frag (the rotation on mma fragments), CodeE4m3 and CodeInt8 (one-byte
// codes to f32), CodeNvfp4 (nvfp4's decode): common.cuh, block "attnq5" (shared
// with attention_sm90a.cu).

// K/V row decoders of the tile loads, one per src/kv codec: `load8(row, c, book)`
// gives elements 8c .. 8c+7 of one encoded cache row as eight bf16: each element
// decoded exactly as kv::codec's decode_row before its inverse rotation (one f32
// multiply: code value * scale; nvfp4 (e2m1 * e4m3 block scale, exact) * row
// scale), then rounded to nearest even bf16 for the mma; or, FOLD (a single scale per
// row: fp8, int8), the code values alone, exactly, with `scale(row)` applied by the
// kernel to the key's column of S or P. RAW (bf16 rows) is fetched with cp.async
// instead. A poisoned row (NaN scales) decodes to NaN (FOLD: makes its S or P column NaN).
struct DecBf16 {
    static constexpr bool RAW = true;
    static constexpr bool FOLD = false;
};
// One-byte codes with their row scale folded out of the tile (FOLD; fp8, int8, up to
// d_head 128): load8 gives the eight code values themselves as bf16 (every E4M3
// value, NaN included, and every int8 is a bf16: exact), `scale` the row's f32 scale, which the kernel applies to
// the key's column of S (K: x = (q·c) * (s * scale * log2 e)) or of P (V: P' = bf16(p *
// s), then P'·c): q·(c s) and Σ p (c s) of the definition, with no bf16 rounding of the
// decoded element (where c * s was rounded to bf16 before) and one rounding of p * s
// (where p alone was rounded); no multiply per element in the decode.
// Up to d_head 128 (8-warp blocks); at 256 (4 warps, key tiles of 32) the column
// factors and P's scaling cost more than the multiplies they save (measured on the
// H200, attnq4: fp8 68.3 TFLOP/s folded against 79.4 unfolded at ctx 4096), so there
// load8 multiplies as the other decoders do.
template <int D, typename CODE>
struct DecByte {  // D one-byte codes (CODE: E4M3 or int8), f32 row scale at D
    static constexpr bool RAW = false;
    static constexpr bool FOLD = D <= 128;
    static __device__ __forceinline__ uint4 load8(const unsigned char* row, int c, const float*) {
        const uint2 q = *reinterpret_cast<const uint2*>(row + c * 8);
        if constexpr (FOLD) {
            float v[8];
            CODE::cvt4(q.x, v);
            CODE::cvt4(q.y, v + 4);
            return pack_bf16x8(v);
        } else {
            const float s = *reinterpret_cast<const float*>(row + D);
            float v[8];
            CODE::cvt4(q.x, v);
            CODE::cvt4(q.y, v + 4);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = __fmul_rn(v[j], s);
            return pack_bf16x8(v);
        }
    }
    static __device__ __forceinline__ float scale(const unsigned char* row) { return *reinterpret_cast<const float*>(row + D); }
};
template <int D>
using DecFp8 = DecByte<D, CodeE4m3>;
template <int D>
using DecInt8 = DecByte<D, CodeInt8>;
template <int D>
struct DecNvfp4 {  // D/2 bytes of E2M1 nibbles, f32 row scale at D/2, D/16 E4M3 block scales at D/2 + 4
    static constexpr bool RAW = false;
    static constexpr bool FOLD = false;
    static __device__ __forceinline__ uint4 load8(const unsigned char* row, int c, const float*) {
        const uint32_t q = *reinterpret_cast<const uint32_t*>(row + c * 4);
        const float S = *reinterpret_cast<const float*>(row + D / 2);
        float v[8];
        CodeNvfp4::dec8(q, row[D / 2 + 4 + c / 2], S, v);  // (e2m1 * e4m3) * S, the inner product exact
        return pack_bf16x8(v);
    }
};
template <int D>
struct DecInt4G32 {  // D/2 bytes of nibbles q + 8, D/32 f32 scales at D/2
    static constexpr bool RAW = false;
    static constexpr bool FOLD = false;
    static __device__ __forceinline__ uint4 load8(const unsigned char* row, int c, const float*) {
        const uint32_t q = *reinterpret_cast<const uint32_t*>(row + c * 4);
        const float s = reinterpret_cast<const float*>(row + D / 2)[c / 4];
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = __fmul_rn((float)((int)((q >> (4 * j)) & 0xFu) - 8), s);
        return pack_bf16x8(v);
    }
};
template <int D>
struct DecInt2G32 {  // D/4 bytes of 2-bit codes, D/32 f32 scales at D/4; value (q - 1.5) * s
    static constexpr bool RAW = false;
    static constexpr bool FOLD = false;
    static __device__ __forceinline__ uint4 load8(const unsigned char* row, int c, const float*) {
        const uint32_t q = *reinterpret_cast<const uint16_t*>(row + c * 2);
        const float s = reinterpret_cast<const float*>(row + D / 4)[c / 4];
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = __fmul_rn((float)((q >> (2 * j)) & 3u) - 1.5f, s);
        return pack_bf16x8(v);
    }
};
template <int D>
struct DecVq2 {  // D/4 codeword indices (4 elements each), f32 RMS at D/4; value codeword_j * s
    static constexpr bool RAW = false;
    static constexpr bool FOLD = false;
    static __device__ __forceinline__ uint4 load8(const unsigned char* row, int c, const float* book) {
        const uint32_t q = *reinterpret_cast<const uint16_t*>(row + c * 2);
        const float s = *reinterpret_cast<const float*>(row + D / 4);
        const float4 c0 = __ldg(reinterpret_cast<const float4*>(book) + (q & 0xFFu));
        const float4 c1 = __ldg(reinterpret_cast<const float4*>(book) + (q >> 8));
        const float v[8] = {__fmul_rn(c0.x, s), __fmul_rn(c0.y, s), __fmul_rn(c0.z, s), __fmul_rn(c0.w, s),
                            __fmul_rn(c1.x, s), __fmul_rn(c1.y, s), __fmul_rn(c1.z, s), __fmul_rn(c1.w, s)};
        return pack_bf16x8(v);
    }
};

}  // namespace flash

template <int D, typename OUT, typename KD, typename VD>
__device__ __forceinline__ void attn_flash_impl(const AttnArgs& a) {
    using namespace flash;
    constexpr bool RAW = KD::RAW;        // bf16 rows: cp.async; coded rows: decoded in the load
    constexpr int MT = m_tiles(D);       // 16-row query tiles per warp
    constexpr int THREADS = threads(D, RAW); // 32 * warps(D, RAW)
    constexpr int BQ = warps(D, RAW) * 16 * MT; // queries per block
    constexpr int BK = key_tile(D, RAW); // keys per tile
    constexpr bool QREG = q_in_regs(D);  // Q's mma fragments held in registers
    constexpr int LDS = D + 8;           // shared row stride (elements)
    constexpr int CH = D / 8;            // 16-byte chunks per bf16 row
    constexpr int NT = BK / 8;           // 8-key column tiles of S
    constexpr int DT = D / 8;            // 8-dim column tiles of O
    constexpr int KS = D / 16;           // k-steps of Q·Kᵀ
    constexpr int VS = BK / 16;          // k-steps of P·V
    constexpr int NC = BK * CH / THREADS; // decoded 8-element chunks per thread per tile, of K and of V
    constexpr bool KF = KD::FOLD, VF = VD::FOLD; // row scales folded into S's / P's columns
    static_assert(KD::RAW == VD::RAW, "K and V are both bf16 or both coded");
    static_assert(D % 16 == 0 && DT % 2 == 0, "head dims are multiples of 16");
    static_assert(BK * CH % THREADS == 0, "a tile's chunks split evenly over the block");
    // The rotations in registers (hadamard_frag) for a coded cache with Q in registers;
    // else through the (BQ, D) f32 scratch: d_head 256, and a bf16 cache, which never
    // rotates (that instantiation stays the kernel it was before the register path).
    constexpr bool ROT_REGS = QREG && !RAW;
    static_assert(ROT_REGS || 4 * BK * LDS * 2 >= BQ * D * 4, "the K and V stages hold a (BQ, D) f32 scratch");
    extern __shared__ __align__(16) unsigned char smem[];
    // Q (unless QREG), then 2 stages of K and 2 of V, each (BK, LDS) bf16: for bf16 rows
    // filled by cp.async, for coded rows decoded from the 2 raw stages that follow
    // (BK * k_row_bytes of K each, then BK * v_row_bytes of V each), filled by cp.async.
    bf16* sq = reinterpret_cast<bf16*>(smem);        // (BQ, LDS) unless QREG
    bf16* sk = sq + (QREG ? 0 : BQ * LDS);           // 2 stages of (BK, LDS)
    bf16* sv = sk + 2 * BK * LDS;                    // 2 stages of (BK, LDS)
    unsigned char* raw = reinterpret_cast<unsigned char*>(sv + 2 * BK * LDS);
    // Coded rows: 2 stages of BK K factors, then 2 of BK V factors (f32), after the raw
    // stages; a FOLD decoder's row scales (K: times scale * log2 e unless soft-capped).
    float* kfac = reinterpret_cast<float*>(raw + 2 * BK * ((long long)a.k_row_bytes + a.v_row_bytes));
    float* vfac = kfac + 2 * BK;
    float* scratch = reinterpret_cast<float*>(sk);  // (BQ, D) f32 over the K and V stages while no tile lives there
    auto block_sync = [] { __syncthreads(); };

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int seq = blockIdx.z, h = blockIdx.y;
    const int t0 = (gridDim.x - 1 - blockIdx.x) * BQ;
    const int n_tokens = a.n_tokens, pos0 = a.pos0, window = a.window;
    const int kvh = h / (a.n_heads / a.n_kv_heads);
    const int kv_len = pos0 + n_tokens;
    const int t_last = min(t0 + BQ, n_tokens) - 1;
    const int k_hi = pos0 + t_last;
    const int k_lo = window > 0 ? max(pos0 + t0 - window + 1, 0) : 0;
    const int tile_first = k_lo / BK, tile_last = k_hi / BK;
    const bool rot_k = (a.rot & 1) != 0, rot_v = (a.rot & 2) != 0;
    const float inv_n = 1.0f / (float)(D & -D);  // 1 / rotation block, a power of two

    // This (window, KV head)'s rows: n_ctx rows of k_row_bytes / v_row_bytes (2 * D for bf16).
    const long long head_rows = ((long long)seq * a.n_kv_heads + kvh) * a.n_ctx;
    const long long krb = a.k_row_bytes, vrb = a.v_row_bytes;
    const unsigned char* kh = static_cast<const unsigned char*>(a.k) + head_rows * krb;
    const unsigned char* vh = static_cast<const unsigned char*>(a.v) + head_rows * vrb;
    const float* qb = a.q + (long long)seq * n_tokens * a.q_stride + (long long)h * D;
    OUT* ob = reinterpret_cast<OUT*>(a.out) + (long long)seq * n_tokens * a.out_stride + (long long)h * D;

    // bf16 rows: tile -> bf16 stage `stage`, 16 bytes per cp.async; rows at or past
    // kv_len are zero-filled.
    auto load_bf16 = [&](int tile, int stage) {
        const int kbase = tile * BK;
        bf16* dk = sk + stage * BK * LDS;
        bf16* dv = sv + stage * BK * LDS;
        for (int i = tid; i < BK * CH; i += THREADS) {
            const int r = i / CH, c = i % CH;
            const int kp = kbase + r;
            const bool ok = kp < kv_len;
            const long long row = ok ? kp : 0;
            cp_async16(smem_addr(dk + r * LDS + c * 8), kh + row * krb + c * 16, ok ? 16 : 0);
            cp_async16(smem_addr(dv + r * LDS + c * 8), vh + row * vrb + c * 16, ok ? 16 : 0);
        }
    };
    // Coded rows: the tile's rows as stored -> raw stage `stage`, 16 bytes per cp.async
    // (rows are multiples of 16 bytes); rows at or past kv_len are zero-filled (they
    // decode to zeros).
    unsigned char* raw_k = raw;
    unsigned char* raw_v = raw + 2 * BK * krb;
    auto load_raw = [&](int tile, int stage) {
        const int kbase = tile * BK;
        const int kch = (int)(krb / 16), vch = (int)(vrb / 16);
        unsigned char* dk = raw_k + stage * BK * krb;
        unsigned char* dv = raw_v + stage * BK * vrb;
        for (int i = tid; i < BK * kch; i += THREADS) {
            const int r = i / kch, c = i % kch;
            const bool ok = kbase + r < kv_len;
            cp_async16(smem_addr(dk + r * krb + c * 16), kh + (ok ? kbase + r : 0) * krb + c * 16, ok ? 16 : 0);
        }
        for (int i = tid; i < BK * vch; i += THREADS) {
            const int r = i / vch, c = i % vch;
            const bool ok = kbase + r < kv_len;
            cp_async16(smem_addr(dv + r * vrb + c * 16), vh + (ok ? kbase + r : 0) * vrb + c * 16, ok ? 16 : 0);
        }
    };
    // Coded rows: chunk j (of NC) of this thread, raw stage `stage` -> bf16 stage `stage`
    // (kv::codec's decode, still in the rotated basis, rounded to bf16 nearest even).
    const float kmul = a.softcap > 0.f ? 1.0f : a.scale * LOG2E;  // folded into K's factors unless capped
    auto decode_k = [&](int stage, int j) {
        if constexpr (!RAW) {
            const int i = tid + j * THREADS, r = i / CH, c = i % CH;
            const unsigned char* row = raw_k + (stage * BK + r) * krb;
            *reinterpret_cast<uint4*>(sk + stage * BK * LDS + r * LDS + c * 8) = KD::load8(row, c, a.book);
            if constexpr (KF) {
                if (c == 0) kfac[stage * BK + r] = KD::scale(row) * kmul;
            }
        }
    };
    auto decode_v = [&](int stage, int j) {
        if constexpr (!RAW) {
            const int i = tid + j * THREADS, r = i / CH, c = i % CH;
            const unsigned char* row = raw_v + (stage * BK + r) * vrb;
            *reinterpret_cast<uint4*>(sv + stage * BK * LDS + r * LDS + c * 8) = VD::load8(row, c, a.book);
            if constexpr (VF) {
                if (c == 0) vfac[stage * BK + r] = VD::scale(row);
            }
        }
    };

    // The warp's rows (tokens) within the window; this thread holds rows g and g + 8 of each m-tile.
    const int row_w = t0 + warp * 16 * MT;
    const int g = lane >> 2, cq = 2 * (lane & 3);
    // Q: f32 -> bf16 (nearest even), rows past n_tokens zero: QREG as this thread's mma
    // A fragments (rows g, g + 8; columns cq, cq + 1, cq + 8, cq + 9 of each k-step),
    // else into shared memory for ldmatrix. `src(r, c)` gives the f32 pair at block row
    // r, column c (c even).
    uint32_t qf[MT][QREG ? KS : 1][4];
    auto stage_q = [&](auto src) {
        if constexpr (QREG) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int r0 = warp * 16 * MT + mt * 16 + g;
#pragma unroll
                for (int kk = 0; kk < KS; ++kk) {
                    const float2 x00 = src(r0, kk * 16 + cq), x10 = src(r0 + 8, kk * 16 + cq);
                    const float2 x01 = src(r0, kk * 16 + cq + 8), x11 = src(r0 + 8, kk * 16 + cq + 8);
                    qf[mt][kk][0] = pack_bf16x2(x00.x, x00.y);
                    qf[mt][kk][1] = pack_bf16x2(x10.x, x10.y);
                    qf[mt][kk][2] = pack_bf16x2(x01.x, x01.y);
                    qf[mt][kk][3] = pack_bf16x2(x11.x, x11.y);
                }
            }
        } else {
            for (int i = tid; i < BQ * (D / 2); i += THREADS) {
                const int r = i / (D / 2), c = (i % (D / 2)) * 2;
                const float2 x = src(r, c);
                *reinterpret_cast<uint32_t*>(sq + r * LDS + c) = pack_bf16x2(x.x, x.y);
            }
        }
    };
    auto q_global = [&](int r, int c) {
        return t0 + r < n_tokens ? *reinterpret_cast<const float2*>(qb + (long long)(t0 + r) * a.q_stride + c)
                                 : make_float2(0.f, 0.f);
    };

    // Prologue. Coded rows: raw tiles first and first + 1 in flight (two commit groups).
    if constexpr (!RAW) {
        load_raw(tile_first, 0);
        cp_async_commit();
        if (tile_first < tile_last) load_raw(tile_first + 1, 1);
        cp_async_commit();
    }
    // K rotated (k = H⁻¹ y, y the stored rotated row): q·k = ((H q) / n)·y, so the
    // queries are rotated the same way (hadamard_rows_d in f32, exact 1/n) before the
    // rounding; the K and V stages are the f32 scratch, so this runs before the first
    // tile lands there.
    if constexpr (ROT_REGS) {
        if (rot_k) {
            // In registers: each quad holds its rows whole (hadamard_frag), the f32 q
            // rotated, times the exact 1/n, then rounded to bf16 into qf.
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int r0 = warp * 16 * MT + mt * 16 + g;
                float x[2][D / 4];
#pragma unroll
                for (int r = 0; r < 2; ++r) {
#pragma unroll
                    for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
                        for (int hi = 0; hi < 2; ++hi) {
                            const float2 y = q_global(r0 + 8 * r, kk * 16 + hi * 8 + cq);
                            x[r][kk * 4 + hi * 2] = y.x;
                            x[r][kk * 4 + hi * 2 + 1] = y.y;
                        }
                    }
                    hadamard_frag<D>(x[r], lane);
                }
#pragma unroll
                for (int kk = 0; kk < KS; ++kk) {
                    qf[mt][kk][0] = pack_bf16x2(x[0][kk * 4] * inv_n, x[0][kk * 4 + 1] * inv_n);
                    qf[mt][kk][1] = pack_bf16x2(x[1][kk * 4] * inv_n, x[1][kk * 4 + 1] * inv_n);
                    qf[mt][kk][2] = pack_bf16x2(x[0][kk * 4 + 2] * inv_n, x[0][kk * 4 + 3] * inv_n);
                    qf[mt][kk][3] = pack_bf16x2(x[1][kk * 4 + 2] * inv_n, x[1][kk * 4 + 3] * inv_n);
                }
            }
        } else {
            stage_q(q_global);
        }
    } else if (rot_k) {
        for (int i = tid; i < BQ * (D / 4); i += THREADS) {
            const int r = i / (D / 4), c = (i % (D / 4)) * 4;
            float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
            if (t0 + r < n_tokens) x = *reinterpret_cast<const float4*>(qb + (long long)(t0 + r) * a.q_stride + c);
            *reinterpret_cast<float4*>(scratch + r * D + c) = x;
        }
        hadamard_rows_d<D>(scratch, BQ, tid, THREADS, block_sync);
        stage_q([&](int r, int c) { return make_float2(scratch[r * D + c] * inv_n, scratch[r * D + c + 1] * inv_n); });
        __syncthreads();  // the scratch read before a tile is written over it
    } else {
        stage_q(q_global);
    }
    if constexpr (RAW) {
        load_bf16(tile_first, 0);
        cp_async_commit();
    } else {
        cp_async_wait<1>();
        __syncthreads();  // raw tile_first visible
#pragma unroll
        for (int j = 0; j < NC; ++j) {
            decode_k(0, j);
            decode_v(0, j);
        }
    }

    float o[MT][DT][4];
    float m_run[MT][2], l_run[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < DT; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
        m_run[mt][0] = m_run[mt][1] = -INFINITY;
        l_run[mt][0] = l_run[mt][1] = 0.f;
    }
    const float scale = a.scale, cap = a.softcap;
    const float scale_l2 = scale * LOG2E;
    const int qp0 = pos0 + row_w + g;
    const int qp_min = pos0 + row_w, qp_max = pos0 + row_w + 16 * MT - 1;
    const uint32_t q_addr = smem_addr(sq + (warp * 16 * MT + (lane & 15)) * LDS + (lane >> 4) * 8);

    // One barrier per tile. At the top of tile n: bf16 stage n % 2 (landed by cp.async,
    // or decoded during tile n - 1) is visible, and the other stage, read during tile
    // n - 1, is free. bf16 rows: tile n + 1 is fetched into it while tile n's MMAs run.
    // Coded rows: raw tile n + 2 is fetched into the raw stage tile n was decoded from,
    // and raw tile n + 1 is decoded into the free bf16 stage between tile n's MMAs
    // (K chunks among the Q·Kᵀ k-steps, V chunks among the P·V k-steps), so the decode
    // overlaps the tensor-core work. (At the last tile that decode reads a raw stage
    // holding no tile; it writes a stage nothing reads again.)
    for (int tile = tile_first; tile <= tile_last; ++tile) {
        const int st = (tile - tile_first) & 1;
        cp_async_wait<0>();
        __syncthreads();
        if constexpr (RAW) {
            if (tile < tile_last) load_bf16(tile + 1, st ^ 1);
        } else {
            if (tile + 2 <= tile_last) load_raw(tile + 2, st);
        }
        cp_async_commit();

        const bf16* kb = sk + st * BK * LDS;
        const bf16* vb = sv + st * BK * LDS;
        float s[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < NT; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
        const uint32_t k_addr = smem_addr(kb + ((lane & 7) + (lane >> 4) * 8) * LDS + ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            uint32_t qa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if constexpr (QREG) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) qa[mt][e] = qf[mt][kk][e];
                } else {
                    ldsm_x4(qa[mt], q_addr + (mt * 16 * LDS + kk * 16) * 2);
                }
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt += 2) {
                uint32_t b[4];
                ldsm_x4(b, k_addr + (nt * 8 * LDS + kk * 16) * 2);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(s[mt][nt], qa[mt], b[0], b[1]);
                    mma_bf16(s[mt][nt + 1], qa[mt], b[2], b[3]);
                }
            }
#pragma unroll
            for (int j = kk * NC / KS; j < (kk + 1) * NC / KS; ++j) decode_k(st ^ 1, j);
        }

        // Scale, soft-cap, mask; then the online softmax update, per m-tile.
        const int kbase = tile * BK;
        const bool full = kbase + BK - 1 <= qp_min && kbase + BK <= kv_len && (window <= 0 || qp_max - kbase < window);
        // A FOLD K: this thread's columns' factors (key kbase + nt * 8 + cq + e).
        float kf[KF ? NT : 1][2];
        if constexpr (KF) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const float2 f = *reinterpret_cast<const float2*>(kfac + st * BK + nt * 8 + cq);
                kf[nt][0] = f.x;
                kf[nt][1] = f.y;
            }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float mx[2] = {m_run[mt][0], m_run[mt][1]};
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x;
                    if constexpr (KF) {
                        // kf = s (capped) or s * scale * log2 e: q·(c s) = (q·c) s.
                        if (cap > 0.f) x = cap * tanhf(s[mt][nt][e] * kf[nt][e & 1] * scale / cap) * LOG2E;
                        else x = s[mt][nt][e] * kf[nt][e & 1];
                    } else if (cap > 0.f) {
                        x = cap * tanhf(s[mt][nt][e] * scale / cap) * LOG2E;
                    } else {
                        x = s[mt][nt][e] * scale_l2;
                    }
                    if (!full) {
                        const int kp = kbase + nt * 8 + cq + (e & 1);
                        const int qp = qp0 + mt * 16 + 8 * (e >> 1);
                        const bool vis = kp <= qp && kp < kv_len && (window <= 0 || qp - kp < window);
                        x = vis ? x : -INFINITY;
                    }
                    s[mt][nt][e] = x;
                    mx[e >> 1] = fmaxf(mx[e >> 1], x);
                }
            }
            float base[2], corr[2], rs[2] = {0.f, 0.f};
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                base[r] = mx[r] == -INFINITY ? 0.f : mx[r];  // a row with nothing visible yet
                corr[r] = exp2_approx(m_run[mt][r] - base[r]);  // 0 while m_run is -inf
                m_run[mt][r] = mx[r];
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float p = exp2_approx(s[mt][nt][e] - base[e >> 1]);
                    s[mt][nt][e] = p;
                    rs[e >> 1] += p;
                }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) l_run[mt][r] = l_run[mt][r] * corr[r] + rs[r];
#pragma unroll
            for (int i = 0; i < DT; ++i) {
                o[mt][i][0] *= corr[0];
                o[mt][i][1] *= corr[0];
                o[mt][i][2] *= corr[1];
                o[mt][i][3] *= corr[1];
            }
        }

        // O += P · V: the S accumulators of key tiles 2kk, 2kk+1 are the A fragment.
        const uint32_t v_addr = smem_addr(vb + ((lane & 7) + ((lane >> 3) & 1) * 8) * LDS + (lane >> 4) * 8);
        // A FOLD V: p of key k times k's row scale before the bf16 rounding (P'·c = Σ p c s).
        if constexpr (VF) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const float2 f = *reinterpret_cast<const float2*>(vfac + st * BK + nt * 8 + cq);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    s[mt][nt][0] *= f.x;
                    s[mt][nt][1] *= f.y;
                    s[mt][nt][2] *= f.x;
                    s[mt][nt][3] *= f.y;
                }
            }
        }
#pragma unroll
        for (int kk = 0; kk < VS; ++kk) {
            uint32_t pa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                pa[mt][0] = pack_bf16x2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                pa[mt][1] = pack_bf16x2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                pa[mt][2] = pack_bf16x2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                pa[mt][3] = pack_bf16x2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int dt = 0; dt < DT; dt += 2) {
                uint32_t b[4];
                ldsm_x4_trans(b, v_addr + (kk * 16 * LDS + dt * 8) * 2);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(o[mt][dt], pa[mt], b[0], b[1]);
                    mma_bf16(o[mt][dt + 1], pa[mt], b[2], b[3]);
                }
            }
#pragma unroll
            for (int j = kk * NC / VS; j < (kk + 1) * NC / VS; ++j) decode_v(st ^ 1, j);
        }
    }
    cp_async_wait<0>();

    // O / l per row. V rotated (v = H⁻¹ y): Σ p v = (H Σ p y) / n, so the rows go
    // through the f32 scratch (the K and V stages, free once every warp is past the
    // last tile: the barrier below), are rotated there and scaled by the exact 1/n on
    // the way out.
    constexpr bool ROT_SMEM = !ROT_REGS;  // the output rotation through the scratch, else in registers
    if (ROT_SMEM && rot_v) __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = l_run[mt][r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const float inv = 1.0f / l;
            const int rb = warp * 16 * MT + mt * 16 + g + 8 * r;  // row in the block
            const int t = t0 + rb;
            if (!ROT_SMEM && rot_v) {
                float x[D / 4];
#pragma unroll
                for (int i = 0; i < DT; ++i) {
                    x[2 * i] = o[mt][i][2 * r] * inv;
                    x[2 * i + 1] = o[mt][i][2 * r + 1] * inv;
                }
                hadamard_frag<D>(x, lane);
                if (t >= n_tokens) continue;
                OUT* orow = ob + (long long)t * a.out_stride + cq;
#pragma unroll
                for (int i = 0; i < DT; ++i) store2<OUT>(orow + i * 8, x[2 * i] * inv_n, x[2 * i + 1] * inv_n);
                continue;
            }
            if (rot_v) {
                float* srow = scratch + rb * D + cq;
#pragma unroll
                for (int i = 0; i < DT; ++i) {
                    srow[i * 8] = o[mt][i][2 * r] * inv;
                    srow[i * 8 + 1] = o[mt][i][2 * r + 1] * inv;
                }
                continue;
            }
            if (t >= n_tokens) continue;
            OUT* orow = ob + (long long)t * a.out_stride + cq;
#pragma unroll
            for (int i = 0; i < DT; ++i) store2<OUT>(orow + i * 8, o[mt][i][2 * r] * inv, o[mt][i][2 * r + 1] * inv);
        }
    }
    if (ROT_SMEM && rot_v) {
        hadamard_rows_d<D>(scratch, BQ, tid, THREADS, block_sync);
        for (int i = tid; i < BQ * (D / 2); i += THREADS) {
            const int r = i / (D / 2), c = (i % (D / 2)) * 2;
            if (t0 + r >= n_tokens) continue;
            store2<OUT>(ob + (long long)(t0 + r) * a.out_stride + c, scratch[r * D + c] * inv_n, scratch[r * D + c + 1] * inv_n);
        }
    }
}

// attn_flash_d<D>_<kv>_<out>: kv names the KV format (kv::KvFormat::name), whose K
// and V decoders the tile loads use; the quantized formats have f32 outputs only
// (the backend's attention output), bf16 and fp8 both.
#define ATTN_FLASH(D, kvn, KD, VD, outn, OUT)                                                       \
    extern "C" __global__ void __launch_bounds__(flash::threads(D, KD::RAW)) attn_flash_d##D##_##kvn##_##outn( \
        const AttnArgs a) {                                                                         \
        attn_flash_impl<D, OUT, KD, VD>(a);                                                         \
    }
#define ATTN_FLASH_D(D)                                                              \
    ATTN_FLASH(D, bf16, flash::DecBf16, flash::DecBf16, f32, float)                  \
    ATTN_FLASH(D, bf16, flash::DecBf16, flash::DecBf16, bf16, bf16)                  \
    ATTN_FLASH(D, fp8, flash::DecFp8<D>, flash::DecFp8<D>, f32, float)               \
    ATTN_FLASH(D, fp8, flash::DecFp8<D>, flash::DecFp8<D>, bf16, bf16)               \
    ATTN_FLASH(D, int8, flash::DecInt8<D>, flash::DecInt8<D>, f32, float)            \
    ATTN_FLASH(D, nvfp4, flash::DecNvfp4<D>, flash::DecNvfp4<D>, f32, float)         \
    ATTN_FLASH(D, k8v4, flash::DecInt8<D>, flash::DecInt4G32<D>, f32, float)         \
    ATTN_FLASH(D, k4v2, flash::DecInt4G32<D>, flash::DecInt2G32<D>, f32, float)      \
    ATTN_FLASH(D, vq2, flash::DecVq2<D>, flash::DecVq2<D>, f32, float)
ATTN_FLASH_D(64)
ATTN_FLASH_D(96)
ATTN_FLASH_D(128)
ATTN_FLASH_D(256)
