// attention.cu: KV-cache store and causal prefill attention (GQA, optional
// sliding window), flash-attention style.
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
// Output = acc / l. The math is f32 on the CUDA cores: exact enough for both
// routes; moving QKᵀ and PV onto mma.sync (bf16) is the speed step after this.
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
