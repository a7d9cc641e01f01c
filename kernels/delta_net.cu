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
// oracle defines, latency-bound by design (one token after another); the
// chunked tensor-core form (WY / UT transform per chunk) is not implemented.
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
