// norm.cu: RMSNorm over rows (the layer norms, gemma3's post norms and the
// final norm) and, with rows of d_head, the per-head QK norm.
//
// Algorithm: one block per row; sum of squares in f32 (each thread over its share
// of the row, then warp shuffles and one shared-memory step), then
// out[i] = (x[i] * (1 / sqrt(mean + eps))) * w[i], the order of ggml's
// rms_norm followed by its mul. Weights are f32 (norm weights are stored F32).
// In place (out == x) is allowed: every element is read by the thread that
// writes it, after the reduction.
// A thread's share, the order of its sum (one fmaf chain) and so the bits are
// the same in every kernel here (RowShare): with 4 | n_cols, both strides multiples
// of 4 and every row pointer 16-byte aligned (8 for bf16), thread t takes the groups
// of 4 consecutive columns t, t + blockDim, ... by 16-byte loads and stores (norm4,
// 2026-12-02: the single-column version moved 6 bytes an element at 2.2-2.4 TB/s on
// the 8B shapes, every load and store 4 bytes a lane); otherwise the single columns t,
// t + blockDim, ... A misaligned call sums in the other order, so its bits can
// differ from an aligned call's by the sum's rounding.
//
// Launch: grid (n_rows), block 128. Strides are in elements between rows.
// rmsnorm_f32 / rmsnorm_bf16 keep a row of up to 32 * 128 columns in registers
// (rmsnorm_row_cached: one read of the row, the loop's bits; a tier of 64 * 128, as
// before norm4, would take 145 registers a thread with 16-byte loads, 3 blocks an SM).
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

__device__ __forceinline__ bool aligned_to(const void* p, unsigned n) { return ((unsigned long long)p & (n - 1)) == 0; }

// Four f32 or bf16 at p (16- or 8-byte aligned).
__device__ __forceinline__ void store4(float* p, const float v[4]) { *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]); }
__device__ __forceinline__ void store4(bf16* p, const float v[4]) {
    const __nv_bfloat162 a = __floats2bfloat162_rn(v[0], v[1]), b = __floats2bfloat162_rn(v[2], v[3]);
    uint2 u;
    u.x = *reinterpret_cast<const uint32_t*>(&a);
    u.y = *reinterpret_cast<const uint32_t*>(&b);
    *reinterpret_cast<uint2*>(p) = u;
}

// A thread's share of a row (header): V = 4 columns a group (16-byte accesses) or 1.
// Item k of thread t is column col(k): group t + (k / V) blockDim, element k % V.
template <int V>
struct RowShare {
    __device__ __forceinline__ static int col(int k) { return V * ((int)threadIdx.x + (k / V) * (int)blockDim.x) + k % V; }
    // Items of a row of n_cols (the thread's count; n_cols a multiple of V).
    __device__ __forceinline__ static int count(int n_cols) {
        const int n_groups = n_cols / V, t = (int)threadIdx.x, nb = (int)blockDim.x;
        return t < n_groups ? V * ((n_groups - 1 - t) / nb + 1) : 0;
    }
};

// Whether a row call takes 4-column groups: every stride a multiple of 4 and every
// row base aligned (the pointers given with their element sizes).
__device__ __forceinline__ bool rows_by4(int n_cols, long long s0, long long s1, const void* p0, const void* p1,
                                         const void* p2 = nullptr, unsigned a2 = 16, const void* p3 = nullptr, unsigned a3 = 16) {
    return n_cols % 4 == 0 && s0 % 4 == 0 && s1 % 4 == 0 && aligned_to(p0, 16) && aligned_to(p1, 16) &&
           aligned_to(p2, a2) && aligned_to(p3, a3);
}

// A row of at most PER * blockDim.x columns held in registers (e2e7): the thread's
// items loaded all at once (PER loads in flight, 16-byte ones when V is 4, the row
// read once), then summed and scaled in the loop version's order: the same fmaf
// chain (a padding zero adds +0 to a sum of squares, which leaves it as it is), the
// same block_sum, the same two products, so the same bits. Before e2e7, the loop read
// each element twice with one load in flight at a time: 1.7-2.0 TB/s on the 8B
// shapes (docs/performance.md, e2e7).
template <typename OUT, int PER, int V>
__device__ __forceinline__ void rmsnorm_row_cached(const float* xr, const float* __restrict__ w, OUT* yr, int n_cols,
                                                   float eps) {
    __shared__ float scratch[32];
    float v[PER];
#pragma unroll
    for (int j = 0; j < PER; j += V) {
        const int i = RowShare<V>::col(j);
        if (i < n_cols) {
            if constexpr (V == 4) {
                const float4 f = *reinterpret_cast<const float4*>(xr + i);
                v[j] = f.x, v[j + 1] = f.y, v[j + 2] = f.z, v[j + 3] = f.w;
            } else {
                v[j] = xr[i];
            }
        } else {
#pragma unroll
            for (int e = 0; e < V; ++e) v[j + e] = 0.0f;
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < PER; j++) ss = fmaf(v[j], v[j], ss);
    const float scale = rms_scale(ss, n_cols, eps, scratch);
#pragma unroll
    for (int j = 0; j < PER; j += V) {
        const int i = RowShare<V>::col(j);
        if (i >= n_cols) continue;
        if constexpr (V == 4) {
            const float4 w4 = *reinterpret_cast<const float4*>(w + i);
            const float o[4] = {fmul(fmul(v[j], scale), w4.x), fmul(fmul(v[j + 1], scale), w4.y),
                                fmul(fmul(v[j + 2], scale), w4.z), fmul(fmul(v[j + 3], scale), w4.w)};
            store4(yr + i, o);
        } else {
            yr[i] = from_f32<OUT>(fmul(fmul(v[j], scale), w[i]));
        }
    }
}

// The loop version (rows past 32 * blockDim.x columns, the dual and add kernels): x
// (and y) read by the thread's items, x updated in place when y is given (x + y,
// add_f32's rounding), the sum of squares in the items' order, then each item
// normalized into the outputs given (f32 and / or bf16).
template <int V>
__device__ __forceinline__ void norm_row_loop(float* xw, const float* xr, const float* __restrict__ y,
                                              const float* __restrict__ w, float* out, bf16* out_bf16, int n_cols,
                                              float eps) {
    __shared__ float scratch[32];
    const int n = RowShare<V>::count(n_cols);
    float ss = 0.0f;
#pragma unroll 4
    for (int k = 0; k < n; k += V) {
        const int i = RowShare<V>::col(k);
        float v[V];
        if constexpr (V == 4) {
            const float4 f = *reinterpret_cast<const float4*>(xr + i);
            v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
            if (y) {
                const float4 g = *reinterpret_cast<const float4*>(y + i);
                v[0] = fadd(v[0], g.x), v[1] = fadd(v[1], g.y), v[2] = fadd(v[2], g.z), v[3] = fadd(v[3], g.w);
                *reinterpret_cast<float4*>(xw + i) = make_float4(v[0], v[1], v[2], v[3]);
            }
        } else {
            v[0] = xr[i];
            if (y) {
                v[0] = fadd(v[0], y[i]);
                xw[i] = v[0];
            }
        }
#pragma unroll
        for (int e = 0; e < V; ++e) ss = fmaf(v[e], v[e], ss);
    }
    const float scale = rms_scale(ss, n_cols, eps, scratch);
#pragma unroll 4
    for (int k = 0; k < n; k += V) {
        const int i = RowShare<V>::col(k);
        float o[V];
#pragma unroll
        for (int e = 0; e < V; ++e) o[e] = fmul(fmul(xr[i + e], scale), w[i + e]);
        if constexpr (V == 4) {
            if (out) store4(out + i, o);
            if (out_bf16) store4(out_bf16 + i, o);
        } else {
            if (out) out[i] = o[0];
            if (out_bf16) out_bf16[i] = __float2bfloat16_rn(o[0]);
        }
    }
}

template <typename OUT, int V>
__device__ __forceinline__ void rmsnorm_row(const float* xr, const float* __restrict__ w, OUT* yr, int n_cols, float eps) {
    const int n_block = (int)blockDim.x;
    if (n_cols <= 8 * n_block) return rmsnorm_row_cached<OUT, 8, V>(xr, w, yr, n_cols, eps);
    if (n_cols <= 32 * n_block) return rmsnorm_row_cached<OUT, 32, V>(xr, w, yr, n_cols, eps);
    float* of = nullptr;
    bf16* ob = nullptr;
    if constexpr (sizeof(OUT) == 4) of = reinterpret_cast<float*>(yr);
    else ob = reinterpret_cast<bf16*>(yr);
    norm_row_loop<V>(nullptr, xr, nullptr, w, of, ob, n_cols, eps);
}

template <typename OUT>
__device__ void rmsnorm_rows(const float* x, const float* __restrict__ w, OUT* out,
                             int n_cols, long long x_stride, long long out_stride, float eps) {
    // x: (n_rows, x_stride); w: (n_cols); out: (n_rows, out_stride); out may be x (in place).
    const float* xr = x + blockIdx.x * x_stride;
    OUT* yr = out + blockIdx.x * out_stride;
    if (rows_by4(n_cols, x_stride, out_stride, x, w, out, 4 * sizeof(OUT))) rmsnorm_row<OUT, 4>(xr, w, yr, n_cols, eps);
    else rmsnorm_row<OUT, 1>(xr, w, yr, n_cols, eps);
}

// out and out_bf16 share out_stride; out_bf16[i] = bf16(out[i]) (round to nearest even).
__device__ void rmsnorm_rows_dual(const float* __restrict__ x, const float* __restrict__ w, float* out, bf16* out_bf16,
                                  int n_cols, long long x_stride, long long out_stride, float eps) {
    const float* xr = x + blockIdx.x * x_stride;
    float* yr = out + blockIdx.x * out_stride;
    bf16* br = out_bf16 + blockIdx.x * out_stride;
    if (rows_by4(n_cols, x_stride, out_stride, x, w, out, 16, out_bf16, 8)) norm_row_loop<4>(nullptr, xr, nullptr, w, yr, br, n_cols, eps);
    else norm_row_loop<1>(nullptr, xr, nullptr, w, yr, br, n_cols, eps);
}

// x: (n_rows, stride) updated in place; y: (n_rows, stride); out, out_bf16: (n_rows, stride).
// Each thread adds, squares and normalizes the same items, in the order
// rmsnorm_rows_dual reads them, so the sum of squares is the same.
__device__ void add_rmsnorm_rows_dual(float* x, const float* __restrict__ y, const float* __restrict__ w, float* out,
                                      bf16* out_bf16, int n_cols, long long stride, float eps) {
    float* xr = x + blockIdx.x * stride;
    const float* yr = y + blockIdx.x * stride;
    float* orow = out + blockIdx.x * stride;
    bf16* br = out_bf16 + blockIdx.x * stride;
    if (rows_by4(n_cols, stride, stride, x, w, out, 16, out_bf16, 8) && aligned_to(y, 16))
        norm_row_loop<4>(xr, xr, yr, w, orow, br, n_cols, eps);
    else norm_row_loop<1>(xr, xr, yr, w, orow, br, n_cols, eps);
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
