// delta_net.cu: Qwen3-Next's Gated DeltaNet mixing step (Backend::delta_net),
// the exact per-token recurrence, and the sigmoid gates of its gated attention
// and shared expert (Backend::sigmoid_mul).
// CPU twin: src/backend/cpu/delta_net.rs::delta_net_layer (and
// src/backend/cpu/mod.rs sigmoid_mul); launcher: src/backend/cuda/delta_net.rs.
//
// delta_net_conv: the depthwise causal convolution of the qkv channels plus
// SiLU, `out[t, c] = silu(sum_j w[c, j] * x[t - width + 1 + j, c])`, the rows
// before this pass read from the carried history `(n_seqs, width - 1, C)`,
// which is updated in place to the pass's last width - 1 inputs. One thread per
// (window, channel) walks the window's tokens in order with the taps and the
// sliding inputs in registers. f64 sum and SiLU, one f32 rounding: the CPU's.
// Launch: grid (ceil(C / 128), n_seqs), block 128.
//
// delta_net_scan: per (value head h, window s) one block of d_v threads
// (rounded up to a warp); thread j owns column j of the head's state S
// `(d_k, d_v)`, held in shared memory in f64 (the CPU oracle's precision, the
// precision of the host-side RecurrentState it is loaded from and stored
// back to: so the state is carried across passes exactly, and a window run in
// several passes gives the same bits as one pass). Per token, the key head
// `h / (n_v_heads / n_k_heads)`'s q and k go to shared memory, every thread
// computes the same L2 norms and gates in the CPU's order (no reduction
// tree), then over its column:
//     S[:, j] *= exp(g);  m = sum_i S[i, j] k_i;  d = v_j - m;
//     S[i, j] += (k_i * d) * beta;  o_j = sum_i (S[i, j] * q_i) * d_k^-1/2
// (i in order, no FMA contraction: __dadd_rn / __dmul_rn), o_j rounded to f32,
// then the gated RMSNorm over the head's d_v outputs:
//     out_j = ((norm_j * o_j) * rsqrt(mean(o^2) + eps)) * silu(z_j)
// with beta = sigmoid(b) and g = A * softplus(alpha + dt_bias) rounded to f32
// as the CPU does. Two block barriers per token. This is the exact form the
// oracle defines, latency-bound by design (one token after another): the
// FP32 route's (--lossless) and --reproducible's scan. The default route runs
// the chunked tensor-core form below (delta_net_chunk_3xtf32, 5.5-9x faster on
// a Qwen3-Next-80B-like layer, H200: docs/performance.md, delta5).
// Shared memory: d_k * d_v doubles + 2 * d_k + d_v floats (dynamic; 128 x 128
// heads take 130 KiB, raised by the launcher).
// Launch: grid (n_v_heads, n_seqs), block round_up(d_v, 32).
//
// sigmoid_mul_{f32,bf16}: out[r, c] = x[r, c] * sigmoid(gate[r, gcol]) in f64,
// one f32 rounding (gcol = c, or 0 for a one-column gate); x in f32 (in place:
// out == x) or bf16 (the default route's bf16-only attention output, written
// to a new f32 buffer). Launch: 1-D grid over elements, block 256.
#include "common.cuh"

__device__ __forceinline__ double d_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double d_mul(double a, double b) { return __dmul_rn(a, b); }

// The CPU's `x / (1 + e^-x)` and `1 / (1 + e^-x)` in f64.
__device__ __forceinline__ double silu_f64(double x) { return __ddiv_rn(x, d_add(1.0, exp(-x))); }
__device__ __forceinline__ double sigmoid_f64(double x) { return __ddiv_rn(1.0, d_add(1.0, exp(-x))); }
// torch's softplus (beta 1, linear above 20), as the CPU's.
__device__ __forceinline__ double softplus_f64(double x) { return x > 20.0 ? x : log1p(exp(x)); }

extern "C" __global__ void __launch_bounds__(128) delta_net_conv(DeltaConvArgs a) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int s = blockIdx.y;
    if (c >= a.n_channels) return;
    const int W = a.width;
    const long long C = a.n_channels;
    double w[DELTA_CONV_MAX_WIDTH];
    float buf[DELTA_CONV_MAX_WIDTH];  // buf[0 .. W-1): the previous W - 1 inputs, oldest first
    float* hist = a.history + (long long)s * (W - 1) * C + c;
#pragma unroll
    for (int j = 0; j < DELTA_CONV_MAX_WIDTH; ++j) {
        w[j] = j < W ? (double)a.w[c * W + j] : 0.0;
        buf[j] = j < W - 1 ? hist[j * C] : 0.0f;
    }
    const long long row0 = (long long)s * a.n_tokens;
    for (int t = 0; t < a.n_tokens; ++t) {
        const float xt = a.x[(row0 + t) * C + c];
#pragma unroll
        for (int j = 0; j < DELTA_CONV_MAX_WIDTH; ++j)
            if (j == W - 1) buf[j] = xt;
        double acc = 0.0;
#pragma unroll
        for (int j = 0; j < DELTA_CONV_MAX_WIDTH; ++j)
            if (j < W) acc = d_add(acc, d_mul(w[j], (double)buf[j]));
        a.out[(row0 + t) * C + c] = (float)silu_f64(acc);
#pragma unroll
        for (int j = 0; j + 1 < DELTA_CONV_MAX_WIDTH; ++j)
            if (j < W - 1) buf[j] = buf[j + 1];
    }
#pragma unroll
    for (int j = 0; j < DELTA_CONV_MAX_WIDTH; ++j)
        if (j < W - 1) hist[j * C] = buf[j];
}

extern "C" __global__ void __launch_bounds__(1024) delta_net_scan(DeltaScanArgs a) {
    extern __shared__ double smem_state[];
    const int h = blockIdx.x, s = blockIdx.y, j = threadIdx.x;
    const int dk = a.d_k, dv = a.d_v, nv = a.n_v_heads;
    const int group = nv / a.n_k_heads;
    const int kh = h / group, gi = h % group;
    const long long C = 2LL * a.n_k_heads * dk + (long long)nv * dv;
    const long long kd = (long long)a.n_k_heads * dk, vd = (long long)nv * dv;
    double* S = smem_state;                       // (d_k, d_v)
    float* qs = (float*)(smem_state + dk * dv);   // (d_k)
    float* ks = qs + dk;                          // (d_k)
    float* os = ks + dk;                          // (d_v)
    double* state = a.state + ((long long)s * nv + h) * dk * dv;
    for (int e = j; e < dk * dv; e += blockDim.x) S[e] = state[e];
    const double scale = __ddiv_rn(1.0, __dsqrt_rn((double)dk));
    const double A = (double)a.a[h], dt_bias = (double)a.dt_bias[h];
    const double wn = j < dv ? (double)a.norm[j] : 0.0;
    for (int t = 0; t < a.n_tokens; ++t) {
        const long long row = (long long)s * a.n_tokens + t;
        const float* mixed = a.mixed + row * C;
        for (int i = j; i < dk; i += blockDim.x) {
            qs[i] = mixed[kh * dk + i];
            ks[i] = mixed[kd + kh * dk + i];
        }
        __syncthreads();  // A: q and k of this token (and, at t = 0, the state) are in place
        double sq = 0.0, sk = 0.0;
        for (int i = 0; i < dk; ++i) {
            sq = d_add(sq, d_mul((double)qs[i], (double)qs[i]));
            sk = d_add(sk, d_mul((double)ks[i], (double)ks[i]));
        }
        const double inv_q = __ddiv_rn(1.0, __dsqrt_rn(d_add(sq, 1e-6)));
        const double inv_k = __ddiv_rn(1.0, __dsqrt_rn(d_add(sk, 1e-6)));
        const float* bar = a.ba + row * 2 * nv + kh * 2 * group;
        const double beta = (double)(float)sigmoid_f64((double)bar[gi]);
        const double g = (double)(float)d_mul(A, softplus_f64(d_add((double)bar[group + gi], dt_bias)));
        const double decay = exp(g);
        if (j < dv) {
            double m = 0.0;
            for (int i = 0; i < dk; ++i) {
                const double x = d_mul(S[i * dv + j], decay);
                S[i * dv + j] = x;
                m = d_add(m, d_mul(x, d_mul((double)ks[i], inv_k)));
            }
            const double d = __dsub_rn((double)mixed[2 * kd + h * dv + j], m);
            double o = 0.0;
            for (int i = 0; i < dk; ++i) {
                const double x = d_add(S[i * dv + j], d_mul(d_mul(d_mul((double)ks[i], inv_k), d), beta));
                S[i * dv + j] = x;
                o = d_add(o, d_mul(d_mul(x, d_mul((double)qs[i], inv_q)), scale));
            }
            os[j] = (float)o;
        }
        __syncthreads();  // B: every o_j of this token is in place
        if (j < dv) {
            double ms = 0.0;
            for (int i = 0; i < dv; ++i) ms = d_add(ms, d_mul((double)os[i], (double)os[i]));
            const double inv = __ddiv_rn(1.0, __dsqrt_rn(d_add(__ddiv_rn(ms, (double)dv), a.eps)));
            const double zj = (double)a.z[row * vd + h * dv + j];
            a.out[row * vd + h * dv + j] = (float)d_mul(d_mul(d_mul(wn, (double)os[j]), inv), silu_f64(zj));
        }
    }
    __syncthreads();
    for (int e = j; e < dk * dv; e += blockDim.x) state[e] = S[e];
}

template <typename IN>
__device__ void sigmoid_mul(const IN* x, const float* __restrict__ gate, float* out, long long n, int n_cols,
                            int gate_cols) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long r = i / n_cols;
    const int c = (int)(i % n_cols);
    const double g = (double)gate[r * gate_cols + (gate_cols == 1 ? 0 : c)];
    out[i] = (float)d_mul((double)to_f32(x[i]), sigmoid_f64(g));
}

extern "C" __global__ void __launch_bounds__(256)
    sigmoid_mul_f32(const float* x, const float* gate, float* out, long long n, int n_cols, int gate_cols) {
    sigmoid_mul<float>(x, gate, out, n, n_cols, gate_cols);
}

extern "C" __global__ void __launch_bounds__(256)
    sigmoid_mul_bf16(const bf16* x, const float* gate, float* out, long long n, int n_cols, int gate_cols) {
    sigmoid_mul<bf16>(x, gate, out, n, n_cols, gate_cols);
}

// ---------------------------------------------------------------- chunked scan (delta5)
//
// delta_net_chunk_{tf32,3xtf32}: the same recurrence in the chunked WY / UT
// form (Gated DeltaNet paper, flash-linear-attention's chunk_gated_delta_rule),
// a FAST PATH (`--fast-path delta-chunk-tf32` / `delta-chunk-3xtf32`): f32
// state, tensor-core products, so it rounds differently from the f64
// recurrence above. Per chunk of C = 64 tokens of one window and one value
// head (rows i, j < C; padded past the window's last token with q = k = v = 0,
// beta = g = 0, which leave the state unchanged), with G_i the inclusive sum
// of g over the chunk, gamma_i = exp(G_i), D_ij = exp(G_i - G_j) (<= 1, j <= i)
// and S the state at the chunk's start:
//     L  = strict_lower(beta_i (k_i . k_j) D_ij)        P = lower(scale (q_i . k_j) D_ij)
//     T  = (I + L)^-1   (unit lower triangular)
//     U  = T diag(beta) V  -  T diag(beta gamma) (K S)   (the corrected values)
//     O  = P U + diag(scale gamma) (Q S)
//     S' = gamma_{C-1} S + (diag(D_{C-1,j}) K)^T U
// (checked against the per-token recurrence to 1e-16 in f64 before it was
// written). Every product (K K^T, Q K^T, K S, Q S, T V, T (K S), P U, K^T U)
// is mma.sync m16n8k8 tf32 with f32 accumulation from shared memory; the
// 3xtf32 variant splits each operand into a tf32 head and a tf32 tail and
// adds the three leading products (about f32 accuracy at 3x the MMAs). The
// triangular inverse is forward substitution in f32 registers (thread c owns
// column c of T, four partial sums per row). q, k L2 norms and the gates in
// f64 as the exact kernel; the cumulative decay in f64. The raw outputs o go
// to `out`; delta_net_gated_norm then applies the gated RMSNorm in place.
// The state is read from the f64 buffer once per pass and written back once
// (f32 values), so a window run in several passes differs from one pass only
// by where its chunks start.
// Launch: grid (n_v_heads * (d_v / bv), n_seqs), block 256, one block per
// (value head, bv-wide slice of d_v, window), bv = d_v if d_v <= 64 else 64;
// dynamic shared memory delta_chunk_smem_bytes (203 KiB at d_k = 128, bv = 64).
// Needs d_k % 16 == 0, d_k <= 128, bv % 16 == 0 (the launcher checks).
// CPU twin: src/backend/cpu/delta_net.rs::gated_delta_rule (the oracle).
//
// delta_net_gated_norm: out_j = ((norm_j * o_j) * rsqrt(mean(o^2) + eps)) * silu(z_j)
// in f64 per (row, value head), in place on `out`; one warp per pair, the
// mean a warp reduction. Launch: grid ceil(n_rows * n_v_heads / 8), block 256.

#define DC_C 64
#define DC_THREADS 256
#define DC_WARPS (DC_THREADS / 32)

// A matrix in shared memory: element (r, c) at p[r * rs + c * cs] (transposes by strides).
struct DcMat {
    const float* p;
    int rs, cs;
    __device__ __forceinline__ float at(int r, int c) const { return p[r * rs + c * cs]; }
};

__device__ __forceinline__ uint32_t tf32_bits(float x) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// d += a * b, m16n8k8, tf32 inputs, f32 accumulation.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// hi: x rounded to tf32; lo: the remainder rounded to tf32 (X3 only).
template <bool X3>
__device__ __forceinline__ void tf32_split(float x, uint32_t& hi, uint32_t& lo) {
    hi = tf32_bits(x) & 0xffffe000u;
    if (X3) lo = tf32_bits(x - __uint_as_float(hi));
}

// One warp: acc (16 x 8NT tile at (m0, n0)) += A[m0.., 0..K) * B[0..K, n0..), K % 8 == 0.
// Fragments (PTX m16n8k8 tf32): a_r = A(g + 8 (r % 2), t + 4 (r / 2)), b_r = B(t + 4 r, g),
// c_r = C(g + 8 (r / 2), 2 t + r % 2), g = lane / 4, t = lane % 4.
template <int NT, bool X3>
__device__ __forceinline__ void dc_warp_mma(float (&acc)[NT][4], DcMat A, DcMat B, int m0, int n0, int K) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int k0 = 0; k0 < K; k0 += 8) {
        uint32_t ah[4], al[4];
        tf32_split<X3>(A.at(m0 + g, k0 + t), ah[0], al[0]);
        tf32_split<X3>(A.at(m0 + g + 8, k0 + t), ah[1], al[1]);
        tf32_split<X3>(A.at(m0 + g, k0 + t + 4), ah[2], al[2]);
        tf32_split<X3>(A.at(m0 + g + 8, k0 + t + 4), ah[3], al[3]);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            uint32_t bh[2], bl[2];
            tf32_split<X3>(B.at(k0 + t, n0 + 8 * nt + g), bh[0], bl[0]);
            tf32_split<X3>(B.at(k0 + t + 4, n0 + 8 * nt + g), bh[1], bl[1]);
            if (X3) {
                mma_tf32(acc[nt], al, bh);
                mma_tf32(acc[nt], ah, bl);
            }
            mma_tf32(acc[nt], ah, bh);
        }
    }
}

// The block's warps share the (M, N) output in 16 x 8NT tiles (M % 16 == 0, N % 8NT == 0):
// C = A1 B1 (K1) + A2 B2 (K2, may be 0), then epi(row, col, value) per element.
template <int NT, bool X3, typename Epi>
__device__ __forceinline__ void dc_gemm(DcMat A1, DcMat B1, int K1, DcMat A2, DcMat B2, int K2, int M, int N, Epi epi) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tn = N / (8 * NT), n_tiles = (M / 16) * tn;
    for (int tile = warp; tile < n_tiles; tile += DC_WARPS) {
        const int m0 = (tile / tn) * 16, n0 = (tile % tn) * 8 * NT;
        float acc[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
        dc_warp_mma<NT, X3>(acc, A1, B1, m0, n0, K1);
        if (K2 > 0) dc_warp_mma<NT, X3>(acc, A2, B2, m0, n0, K2);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) epi(m0 + g + 8 * (r >> 1), n0 + 8 * nt + 2 * t + (r & 1), acc[nt][r]);
    }
}

// The widest 16 x 8NT tiles an N-wide output takes (N % 16 == 0).
template <bool X3, typename Epi>
__device__ __forceinline__ void dc_gemm_n(DcMat A1, DcMat B1, int K1, DcMat A2, DcMat B2, int K2, int M, int N, Epi epi) {
    if (N % 32 == 0)
        dc_gemm<4, X3>(A1, B1, K1, A2, B2, K2, M, N, epi);
    else
        dc_gemm<2, X3>(A1, B1, K1, A2, B2, K2, M, N, epi);
}

template <bool X3>
__device__ void delta_net_chunk(const DeltaScanArgs& a) {
    extern __shared__ double dc_smem[];
    const int dk = a.d_k, dv = a.d_v, nv = a.n_v_heads;
    const int bv = dv <= 64 ? dv : 64, n_split = dv / bv;
    const int h = blockIdx.x / n_split, v0 = (blockIdx.x % n_split) * bv, s = blockIdx.y;
    const int group = nv / a.n_k_heads, kh = h / group, gi = h % group;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const long long C = 2LL * a.n_k_heads * dk + (long long)nv * dv;
    const long long kd = (long long)a.n_k_heads * dk, vd = (long long)nv * dv;
    const int ldk = dk + 4, lbv = bv + 4, lc = DC_C + 4, lqu = (dk > bv ? dk : bv) + 4;
    // Shared memory (f32 unless said): G (C) f64, then S (d_k, bv), Q and then U (C, .), K (C, d_k),
    // V (C, bv), K S (C, bv), Q S (C, bv), K K^T -> L -> T diag(beta) (C, C), -T diag(beta gamma)
    // (C, C), P (C, C), beta, gamma, g (C each). Rows padded by 4 floats.
    double* Gs = dc_smem;
    float* Ss = (float*)(dc_smem + DC_C);
    float* QUs = Ss + dk * lbv;
    float* Ks = QUs + DC_C * lqu;
    float* Vs = Ks + DC_C * ldk;
    float* KSs = Vs + DC_C * lbv;
    float* QSs = KSs + DC_C * lbv;
    float* Ls = QSs + DC_C * lbv;
    float* Tgs = Ls + DC_C * lc;
    float* Ps = Tgs + DC_C * lc;
    float* beta_s = Ps + DC_C * lc;
    float* gam_s = beta_s + DC_C;
    float* g_s = gam_s + DC_C;

    double* state = a.state + ((long long)s * nv + h) * dk * dv;
    for (int e = tid; e < dk * bv; e += DC_THREADS) Ss[(e / bv) * lbv + e % bv] = (float)state[(e / bv) * dv + v0 + e % bv];
    const double scale_d = __ddiv_rn(1.0, __dsqrt_rn((double)dk));
    const float scale = (float)scale_d;
    const double A = (double)a.a[h], dt_bias = (double)a.dt_bias[h];

    for (int c0 = 0; c0 < a.n_tokens; c0 += DC_C) {
        // Load: warp w takes tokens w, w + 8, ..; L2-normalized q, k (f64 norms), v, gates.
        for (int i = warp; i < DC_C; i += DC_WARPS) {
            const bool real = c0 + i < a.n_tokens;
            const long long row = (long long)s * a.n_tokens + c0 + i;
            const float* mixed = a.mixed + row * C;
            double sq = 0.0, sk = 0.0;
            if (real)
                for (int d = lane; d < dk; d += 32) {
                    const double q = mixed[kh * dk + d], k = mixed[kd + kh * dk + d];
                    sq += q * q;
                    sk += k * k;
                }
            sq = warp_sum(sq);
            sk = warp_sum(sk);
            const double inv_q = 1.0 / sqrt(sq + 1e-6), inv_k = 1.0 / sqrt(sk + 1e-6);
            for (int d = lane; d < dk; d += 32) {
                QUs[i * lqu + d] = real ? (float)(mixed[kh * dk + d] * inv_q) : 0.f;
                Ks[i * ldk + d] = real ? (float)(mixed[kd + kh * dk + d] * inv_k) : 0.f;
            }
            for (int e = lane; e < bv; e += 32) Vs[i * lbv + e] = real ? mixed[2 * kd + h * dv + v0 + e] : 0.f;
            if (lane == 0) {
                float beta = 0.f, g = 0.f;
                if (real) {
                    const float* bar = a.ba + row * 2 * nv + kh * 2 * group;
                    beta = (float)sigmoid_f64((double)bar[gi]);
                    g = (float)d_mul(A, softplus_f64(d_add((double)bar[group + gi], dt_bias)));
                }
                beta_s[i] = beta;
                g_s[i] = g;
            }
        }
        __syncthreads();
        if (warp == 0) {  // inclusive scan of g in f64: lane holds tokens lane and lane + 32
            double lo = (double)g_s[lane], hi = (double)g_s[lane + 32];
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const double l = __shfl_up_sync(0xffffffffu, lo, o), u = __shfl_up_sync(0xffffffffu, hi, o);
                if (lane >= o) {
                    lo += l;
                    hi += u;
                }
            }
            hi += __shfl_sync(0xffffffffu, lo, 31);
            Gs[lane] = lo;
            Gs[lane + 32] = hi;
            gam_s[lane] = (float)exp(lo);
            gam_s[lane + 32] = (float)exp(hi);
        }
        __syncthreads();
        // Stage 1: K K^T -> L, Q K^T -> P, K S, Q S.
        const DcMat Kr{Ks, ldk, 1}, KT{Ks, 1, ldk}, Qr{QUs, lqu, 1}, Sr{Ss, lbv, 1}, none{Ks, 0, 0};
        dc_gemm<4, X3>(Kr, KT, dk, none, none, 0, DC_C, DC_C, [&](int i, int j, float x) {
            Ls[i * lc + j] = j < i ? beta_s[i] * x * expf((float)(Gs[i] - Gs[j])) : 0.f;
        });
        dc_gemm<4, X3>(Qr, KT, dk, none, none, 0, DC_C, DC_C, [&](int i, int j, float x) {
            Ps[i * lc + j] = j <= i ? scale * x * expf((float)(Gs[i] - Gs[j])) : 0.f;
        });
        dc_gemm_n<X3>(Kr, Sr, dk, none, none, 0, DC_C, bv, [&](int i, int e, float x) { KSs[i * lbv + e] = x; });
        dc_gemm_n<X3>(Qr, Sr, dk, none, none, 0, DC_C, bv, [&](int i, int e, float x) { QSs[i * lbv + e] = x; });
        __syncthreads();
        // Stage 2: T = (I + L)^-1 by forward substitution (threads 0..63, column c each);
        // meanwhile the other warps scale K's rows by D_{C-1,j} for the state update.
        float tcol[DC_C];
        if (tid < DC_C) {
            const int c = tid;
#pragma unroll
            for (int i = 0; i < DC_C; ++i) {
                float p0 = 0.f, p1 = 0.f, p2 = 0.f, p3 = 0.f;
#pragma unroll
                for (int j = 0; j + 3 < i; j += 4) {
                    p0 = fmaf(Ls[i * lc + j], tcol[j], p0);
                    p1 = fmaf(Ls[i * lc + j + 1], tcol[j + 1], p1);
                    p2 = fmaf(Ls[i * lc + j + 2], tcol[j + 2], p2);
                    p3 = fmaf(Ls[i * lc + j + 3], tcol[j + 3], p3);
                }
#pragma unroll
                for (int j = i & ~3; j < i; ++j) p0 = fmaf(Ls[i * lc + j], tcol[j], p0);
                tcol[i] = i == c ? 1.f : (i > c ? -((p0 + p1) + (p2 + p3)) : 0.f);
            }
        } else {
            const double g_last = Gs[DC_C - 1];
            for (int e = tid - DC_C; e < DC_C * dk; e += DC_THREADS - DC_C) {
                const int j = e / dk, d = e % dk;
                Ks[j * ldk + d] *= expf((float)(g_last - Gs[j]));
            }
        }
        __syncthreads();
        if (tid < DC_C) {
            const int c = tid;
            const float bc = beta_s[c], bgc = beta_s[c] * gam_s[c];
#pragma unroll
            for (int i = 0; i < DC_C; ++i) {
                Ls[i * lc + c] = tcol[i] * bc;
                Tgs[i * lc + c] = -tcol[i] * bgc;
            }
        }
        __syncthreads();
        // Stage 3: U = T diag(beta) V - T diag(beta gamma) (K S), into Q's place.
        const DcMat Tb{Ls, lc, 1}, Tg{Tgs, lc, 1}, Vr{Vs, lbv, 1}, KSr{KSs, lbv, 1};
        dc_gemm_n<X3>(Tb, Vr, DC_C, Tg, KSr, DC_C, DC_C, bv, [&](int i, int e, float x) { QUs[i * lqu + e] = x; });
        __syncthreads();
        // Stage 4: O = P U + diag(scale gamma) Q S to `out`; S = gamma_last S + (D K)^T U.
        const DcMat Pr{Ps, lc, 1}, Ur{QUs, lqu, 1}, KdT{Ks, 1, ldk};
        dc_gemm_n<X3>(Pr, Ur, DC_C, none, none, 0, DC_C, bv, [&](int i, int e, float x) {
            if (c0 + i < a.n_tokens) {
                const long long row = (long long)s * a.n_tokens + c0 + i;
                a.out[row * vd + h * dv + v0 + e] = x + scale * gam_s[i] * QSs[i * lbv + e];
            }
        });
        const float gam_last = gam_s[DC_C - 1];
        dc_gemm_n<X3>(KdT, Ur, DC_C, none, none, 0, dk, bv, [&](int d, int e, float x) {
            Ss[d * lbv + e] = fmaf(gam_last, Ss[d * lbv + e], x);
        });
        __syncthreads();
    }
    for (int e = tid; e < dk * bv; e += DC_THREADS) state[(e / bv) * dv + v0 + e % bv] = (double)Ss[(e / bv) * lbv + e % bv];
}

extern "C" __global__ void __launch_bounds__(DC_THREADS, 1) delta_net_chunk_tf32(DeltaScanArgs a) {
    delta_net_chunk<false>(a);
}

extern "C" __global__ void __launch_bounds__(DC_THREADS, 1) delta_net_chunk_3xtf32(DeltaScanArgs a) {
    delta_net_chunk<true>(a);
}

extern "C" __global__ void __launch_bounds__(256) delta_net_gated_norm(DeltaScanArgs a, long long n_rows) {
    const long long pair = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31, nv = a.n_v_heads, dv = a.d_v;
    if (pair >= n_rows * nv) return;
    const long long row = pair / nv;
    const int h = (int)(pair % nv);
    float* o = a.out + row * nv * dv + (long long)h * dv;
    const float* z = a.z + row * nv * dv + (long long)h * dv;
    double ms = 0.0;
    for (int j = lane; j < dv; j += 32) ms += (double)o[j] * (double)o[j];
    ms = warp_sum(ms);
    const double inv = 1.0 / sqrt(ms / (double)dv + a.eps);
    for (int j = lane; j < dv; j += 32) o[j] = (float)((((double)a.norm[j] * (double)o[j]) * inv) * silu_f64((double)z[j]));
}
