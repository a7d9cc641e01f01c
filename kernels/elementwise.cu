// elementwise.cu: gated activations, residual add, f32 -> bf16 cast.
//
// gated_{silu,gelu}_{f32,bf16}: out[i] = act(gate[i]) * up[i] over n rows of
// n_cols (gate and up with their own row strides, so a fused gate|up matmul
// output can be read in place); `act` is common.cuh's (silu, tanh gelu, f32
// with expf/tanhf), the one the gated GEMM epilogue (gemm_sm90a.cu) uses too.
// add_f32: y[i] += x[i] (the residual stream stays f32).
// cast_bf16: out[i] = bf16(x[i]) (round to nearest even).
// add_bias_f32: x[r, c] += b[c] over rows of n_cols (qwen2's Q/K/V biases).
// softcap_f32: x[i] = cap * tanh(x[i] / cap), in place (an LM head's logits
// tile before its reduction; gemma2-style final soft-cap).
// gather_rows_f32: out[r, :] = x[rows[r], :] (the rows the LM head scores).
// gather_pairs_f32: out[i] = x[rows[i] * ld + cols[i]] (listed ids' logits
// out of an LM-head logits tile, for KL against a recorded reference).
//
// Launch: 1-D grid over elements, block 256 (gated: grid (ceil(n_cols/256), n_rows)).
#include "common.cuh"

template <int ACT, typename OUT>
__device__ void gated(const float* __restrict__ gate, const float* __restrict__ up, OUT* __restrict__ out,
                      int n_cols, long long gate_stride, long long up_stride, long long out_stride) {
    const int r = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n_cols) return;
    const float g = gate[r * gate_stride + c], u = up[r * up_stride + c];
    out[r * out_stride + c] = from_f32<OUT>(fmul(act<ACT>(g), u));
}

#define GATED(name, A, T)                                                                        \
    extern "C" __global__ void __launch_bounds__(256)                                            \
        gated_##name(const float* gate, const float* up, T* out, int n_cols, long long gate_stride, \
                     long long up_stride, long long out_stride) {                                \
        gated<A, T>(gate, up, out, n_cols, gate_stride, up_stride, out_stride);                  \
    }
GATED(silu_f32, ACT_SILU, float)
GATED(silu_bf16, ACT_SILU, bf16)
GATED(gelu_f32, ACT_GELU, float)
GATED(gelu_bf16, ACT_GELU, bf16)

extern "C" __global__ void __launch_bounds__(256) add_f32(float* y, const float* x, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = fadd(y[i], x[i]);
}

extern "C" __global__ void __launch_bounds__(256) cast_bf16(const float* x, bf16* out, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __float2bfloat16_rn(x[i]);
}

extern "C" __global__ void __launch_bounds__(256)
    add_bias_f32(float* x, const float* b, int n_cols, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = fadd(x[i], b[i % n_cols]);
}

extern "C" __global__ void __launch_bounds__(256) softcap_f32(float* x, long long n, float cap) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = fmul(cap, tanhf(x[i] / cap));
}

extern "C" __global__ void __launch_bounds__(256)
    gather_rows_f32(const float* x, const int32_t* rows, float* out, int n_cols, long long n) {
    // x: (*, n_cols); rows: (n / n_cols); out: (n / n_cols, n_cols)
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[(long long)rows[i / n_cols] * n_cols + i % n_cols];
}

extern "C" __global__ void __launch_bounds__(256)
    gather_pairs_f32(const float* x, long long ld, const int32_t* rows, const int32_t* cols, float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[(long long)rows[i] * ld + cols[i]];
}
