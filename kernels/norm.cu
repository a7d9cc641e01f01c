// norm.cu: RMSNorm over rows (the layer norms, gemma3's post norms and the
// final norm) and, with rows of d_head, the per-head QK norm.
//
// Algorithm: one block per row; sum of squares in f32 (each thread strided
// over the row, then warp shuffles and one shared-memory step), then
// out[i] = (x[i] * (1 / sqrt(mean + eps))) * w[i], the order of ggml's
// rms_norm followed by its mul. Weights are f32 (norm weights are stored F32).
// In place (out == x) is allowed: every element is read by the thread that
// writes it, after the reduction.
//
// Launch: grid (n_rows), block 128. Strides are in elements between rows.
// rmsnorm_f32 / rmsnorm_bf16 keep a row of up to 64 * 128 columns in registers
// (rmsnorm_row_cached: one read of the row, the loop's bits).
// Variants: rmsnorm_f32 writes f32, rmsnorm_bf16 writes bf16 (the default
// route's matmul input), rmsnorm_dual writes both from the same f32 value (the
// default route: f32 for a residual add after a post norm, its bf16 rounding
// for the matmuls that read the row, so no separate cast pass).
#include "common.cuh"

// 1 / sqrt(mean of squares + eps) from each thread's partial sum of squares.
__device__ __forceinline__ float rms_scale(float ss, int n_cols, float eps, float* scratch) {
    ss = block_sum(ss, scratch);
    return 1.0f / sqrtf(ss / (float)n_cols + eps);
}

// out[i] = (x[i] * scale) * w[i] as f32 and its bf16 rounding (nearest even), each
// thread over the strided elements it summed.
__device__ __forceinline__ void normalize_dual(const float* xr, const float* __restrict__ w, float* out, bf16* out_bf16,
                                               int n_cols, float scale) {
    for (int i = threadIdx.x; i < n_cols; i += blockDim.x) {
        const float v = fmul(fmul(xr[i], scale), w[i]);
        out[i] = v;
        out_bf16[i] = __float2bfloat16_rn(v);
    }
}

// A row of at most PER * blockDim.x columns held in registers (e2e7): thread t keeps
// elements t + j * blockDim.x, j < PER, loaded all at once (PER loads in flight, the
// row read once), then sums and scales them in the loop version's order: the same
// fmaf chain (a padding zero adds +0 to a sum of squares, which leaves it as it is),
// the same block_sum, the same two products, so the same bits. Before, the loop
// read each element twice with one load in flight at a time: 1.7-2.0 TB/s on the 8B
// shapes (docs/performance.md, e2e7).
template <typename OUT, int PER>
__device__ __forceinline__ void rmsnorm_row_cached(const float* xr, const float* __restrict__ w, OUT* yr, int n_cols,
                                                   float eps) {
    __shared__ float scratch[32];
    float v[PER];
#pragma unroll
    for (int j = 0; j < PER; j++) {
        const int i = threadIdx.x + j * blockDim.x;
        v[j] = i < n_cols ? xr[i] : 0.0f;
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < PER; j++) ss = fmaf(v[j], v[j], ss);
    const float scale = rms_scale(ss, n_cols, eps, scratch);
#pragma unroll
    for (int j = 0; j < PER; j++) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < n_cols) yr[i] = from_f32<OUT>(fmul(fmul(v[j], scale), w[i]));
    }
}

template <typename OUT>
__device__ void rmsnorm_rows(const float* x, const float* __restrict__ w, OUT* out,
                             int n_cols, long long x_stride, long long out_stride, float eps) {
    // x: (n_rows, x_stride); w: (n_cols); out: (n_rows, out_stride); out may be x (in place).
    const float* xr = x + blockIdx.x * x_stride;
    OUT* yr = out + blockIdx.x * out_stride;
    const int n_block = (int)blockDim.x;
    if (n_cols <= 8 * n_block) return rmsnorm_row_cached<OUT, 8>(xr, w, yr, n_cols, eps);
    if (n_cols <= 32 * n_block) return rmsnorm_row_cached<OUT, 32>(xr, w, yr, n_cols, eps);
    if (n_cols <= 64 * n_block) return rmsnorm_row_cached<OUT, 64>(xr, w, yr, n_cols, eps);
    __shared__ float scratch[32];
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n_cols; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    const float scale = rms_scale(ss, n_cols, eps, scratch);
    for (int i = threadIdx.x; i < n_cols; i += blockDim.x) yr[i] = from_f32<OUT>(fmul(fmul(xr[i], scale), w[i]));
}

// out and out_bf16 share out_stride; out_bf16[i] = bf16(out[i]) (round to nearest even).
__device__ void rmsnorm_rows_dual(const float* __restrict__ x, const float* __restrict__ w, float* out, bf16* out_bf16,
                                  int n_cols, long long x_stride, long long out_stride, float eps) {
    __shared__ float scratch[32];
    const float* xr = x + blockIdx.x * x_stride;
    float* yr = out + blockIdx.x * out_stride;
    bf16* br = out_bf16 + blockIdx.x * out_stride;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n_cols; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    normalize_dual(xr, w, yr, br, n_cols, rms_scale(ss, n_cols, eps, scratch));
}

// x: (n_rows, stride) updated in place; y: (n_rows, stride); out, out_bf16: (n_rows, stride).
// Each thread adds, squares and normalizes the same strided elements, in the
// order rmsnorm_rows_dual reads them, so the sum of squares is the same.
__device__ void add_rmsnorm_rows_dual(float* x, const float* __restrict__ y, const float* __restrict__ w, float* out,
                                      bf16* out_bf16, int n_cols, long long stride, float eps) {
    __shared__ float scratch[32];
    float* xr = x + blockIdx.x * stride;
    const float* yr = y + blockIdx.x * stride;
    float* orow = out + blockIdx.x * stride;
    bf16* br = out_bf16 + blockIdx.x * stride;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n_cols; i += blockDim.x) {
        const float v = fadd(xr[i], yr[i]);
        xr[i] = v;
        ss = fmaf(v, v, ss);
    }
    normalize_dual(xr, w, orow, br, n_cols, rms_scale(ss, n_cols, eps, scratch));
}

extern "C" __global__ void __launch_bounds__(128)
    rmsnorm_f32(const float* x, const float* w, float* out, int n_cols, long long x_stride,
                long long out_stride, float eps) {
    rmsnorm_rows<float>(x, w, out, n_cols, x_stride, out_stride, eps);
}

extern "C" __global__ void __launch_bounds__(128)
    rmsnorm_bf16(const float* x, const float* w, bf16* out, int n_cols, long long x_stride,
                 long long out_stride, float eps) {
    rmsnorm_rows<bf16>(x, w, out, n_cols, x_stride, out_stride, eps);
}

extern "C" __global__ void __launch_bounds__(128)
    rmsnorm_dual(const float* x, const float* w, float* out, bf16* out_bf16, int n_cols, long long x_stride,
                 long long out_stride, float eps) {
    rmsnorm_rows_dual(x, w, out, out_bf16, n_cols, x_stride, out_stride, eps);
}

extern "C" __global__ void __launch_bounds__(128)
    add_rmsnorm_dual(float* x, const float* y, const float* w, float* out, bf16* out_bf16, int n_cols, long long stride,
                     float eps) {
    add_rmsnorm_rows_dual(x, y, w, out, out_bf16, n_cols, stride, eps);
}
