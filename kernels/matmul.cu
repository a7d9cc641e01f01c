// matmul.cu: y = x · Wᵀ for a weight matrix W stored in any kept format.
//
// x: (M, K) activations, W: (N, row_bytes) rows of K quantized elements,
// y: (M, N) f32 with row stride ldy. K % 32 == 0. The matmul kernels here
// never expand W in device memory: each block dequantizes the (BN x 32) tile of W it needs next
// (dequant8, 8 elements per thread and step) straight into shared memory, so
// the only full-precision copy of a weight is one 32-column strip of one tile.
//
// matmul_bf16_<fmt> (the default route): x in bf16; the W tile is rounded to
// bf16 in shared memory; products on the tensor cores with
// mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32 (f32 accumulation). Block tile
// 64 (M) x 64 (N) x 32 (K), 4 warps in 2 x 2, each warp 32 x 32 = 2 x 4 mma
// tiles. The next K-tile is fetched (and dequantized) into registers while
// the tensor cores work on the current one. Shared rows are padded to 40
// bf16 (20 words), which makes the fragment loads conflict-free. Plain sm_90
// PTX: mma.sync runs on Hopper's tensor cores at a fraction of wgmma's rate;
// wgmma (sm_90a) is the next step, with the same tiling contract.
//
// matmul_f32_<fmt> (the FP32 route, for the lossless path): x in f32, W
// dequantized to f32, FFMA with f32 accumulation in K order. Block tile
// 64 x 64 x 32, 256 threads, 4 x 4 outputs per thread, both tiles stored
// K-major in shared memory (rows padded to 68 floats).
//
// Launch (both): grid (ceil(N/64), ceil(M/64)); bf16: block 128, f32: block 256.
// On sm_90 the launcher sends larger bf16 products to gemm_bf16_wgmma
// (gemm_sm90a.cu) instead, after dequant_bf16_<fmt> (below) has expanded a
// block-quantized W into a bf16 scratch; matmul_bf16_<fmt> keeps the small
// shapes and GPUs without sm_90a.
//
// MXFP4 (17-byte blocks, not in FOR_EACH_FORMAT: the embedding kernels do not
// read it) gets matmul_bf16_mxfp4, matmul_f32_mxfp4 and dequant_bf16_mxfp4
// from the same templates, with the dequant8<FMT_MXFP4> of common.cuh.
#include "common.cuh"

#define MM_BM 64
#define MM_BN 64
#define MM_BK 32
#define MM_LDS 40  // bf16 per shared row (32 + 8 padding)

__device__ __forceinline__ void mma_bf16_16816(float c[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Fetches this thread's two x items and two W items of K-tile k0 into registers.
// Item it (0..255): tile row it / 4, 8-element group it % 4.
template <int FMT>
__device__ __forceinline__ void mm_bf16_fetch(const bf16* __restrict__ x, const uint8_t* __restrict__ w,
                                              int M, int N, int K, long long row_bytes, int m0, int n0,
                                              int k0, uint4 xr[2], uint4 wr[2]) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        const int it = threadIdx.x + s * 128;
        const int r = it >> 2, grp = it & 3;
        const int m = m0 + r, n = n0 + r;
        xr[s] = m < M ? *reinterpret_cast<const uint4*>(x + (long long)m * K + k0 + grp * 8)
                      : make_uint4(0, 0, 0, 0);
        if (n < N) {
            float v[8];
            dequant8<FMT>(w + (long long)n * row_bytes, (k0 >> 3) + grp, v);
            wr[s] = pack_bf16x8(v);
        } else {
            wr[s] = make_uint4(0, 0, 0, 0);
        }
    }
}

template <int FMT>
__device__ void matmul_bf16_impl(const bf16* __restrict__ x, const uint8_t* __restrict__ w,
                                 float* __restrict__ y, int M, int N, int K, long long row_bytes,
                                 long long ldy) {
    __shared__ __align__(16) bf16 sx[MM_BM * MM_LDS];
    __shared__ __align__(16) bf16 sw[MM_BN * MM_LDS];
    const int m0 = blockIdx.y * MM_BM, n0 = blockIdx.x * MM_BN;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;

    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.0f;

    uint4 xr[2], wr[2];
    mm_bf16_fetch<FMT>(x, w, M, N, K, row_bytes, m0, n0, 0, xr, wr);
    for (int k0 = 0; k0 < K; k0 += MM_BK) {
        __syncthreads();  // the previous tile's fragment loads are done
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            const int it = threadIdx.x + s * 128;
            const int r = it >> 2, grp = it & 3;
            *reinterpret_cast<uint4*>(sx + r * MM_LDS + grp * 8) = xr[s];
            *reinterpret_cast<uint4*>(sw + r * MM_LDS + grp * 8) = wr[s];
        }
        __syncthreads();
        if (k0 + MM_BK < K) mm_bf16_fetch<FMT>(x, w, M, N, K, row_bytes, m0, n0, k0 + MM_BK, xr, wr);
#pragma unroll
        for (int kk = 0; kk < MM_BK; kk += 16) {
            uint32_t a[2][4], b[4][2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const bf16* p = sx + (wm + i * 16 + g) * MM_LDS + kk + t * 2;
                a[i][0] = *reinterpret_cast<const uint32_t*>(p);
                a[i][1] = *reinterpret_cast<const uint32_t*>(p + 8 * MM_LDS);
                a[i][2] = *reinterpret_cast<const uint32_t*>(p + 8);
                a[i][3] = *reinterpret_cast<const uint32_t*>(p + 8 * MM_LDS + 8);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const bf16* p = sw + (wn + j * 8 + g) * MM_LDS + kk + t * 2;
                b[j][0] = *reinterpret_cast<const uint32_t*>(p);
                b[j][1] = *reinterpret_cast<const uint32_t*>(p + 8);
            }
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) mma_bf16_16816(acc[i][j], a[i], b[j]);
        }
    }

    // Accumulator layout of m16n8: c0,c1 at (g, 2t..2t+1), c2,c3 at (g+8, 2t..2t+1).
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int m = m0 + wm + i * 16 + g + (c >> 1) * 8;
                const int n = n0 + wn + j * 8 + t * 2 + (c & 1);
                if (m < M && n < N) y[(long long)m * ldy + n] = acc[i][j][c];
            }
}

#define MM_F_LDS 68  // floats per K-major shared row (64 + 4 padding)

template <int FMT>
__device__ void matmul_f32_impl(const float* __restrict__ x, const uint8_t* __restrict__ w,
                                float* __restrict__ y, int M, int N, int K, long long row_bytes,
                                long long ldy) {
    __shared__ __align__(16) float sx[MM_BK * MM_F_LDS];  // (k, m)
    __shared__ __align__(16) float sw[MM_BK * MM_F_LDS];  // (k, n)
    const int m0 = blockIdx.y * MM_BM, n0 = blockIdx.x * MM_BN;
    const int tid = threadIdx.x;
    const int lr = tid >> 2, grp = tid & 3;  // load: tile row, 8-element group
    const int ty = tid >> 4, tx = tid & 15;  // compute: rows ty*4.., cols tx*4..

    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

    for (int k0 = 0; k0 < K; k0 += MM_BK) {
        float xv[8], wv[8];
        const int m = m0 + lr, n = n0 + lr;
        if (m < M) {
            const float4* p = reinterpret_cast<const float4*>(x + (long long)m * K + k0 + grp * 8);
            const float4 a = p[0], b = p[1];
            xv[0] = a.x; xv[1] = a.y; xv[2] = a.z; xv[3] = a.w;
            xv[4] = b.x; xv[5] = b.y; xv[6] = b.z; xv[7] = b.w;
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) xv[i] = 0.0f;
        }
        if (n < N) {
            dequant8<FMT>(w + (long long)n * row_bytes, (k0 >> 3) + grp, wv);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) wv[i] = 0.0f;
        }
        __syncthreads();  // previous tile fully consumed
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            sx[(grp * 8 + i) * MM_F_LDS + lr] = xv[i];
            sw[(grp * 8 + i) * MM_F_LDS + lr] = wv[i];
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < MM_BK; ++k) {
            const float4 a = *reinterpret_cast<const float4*>(sx + k * MM_F_LDS + ty * 4);
            const float4 b = *reinterpret_cast<const float4*>(sw + k * MM_F_LDS + tx * 4);
            const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int m = m0 + ty * 4 + i, n = n0 + tx * 4 + j;
            if (m < M && n < N) y[(long long)m * ldy + n] = acc[i][j];
        }
}

#define MATMUL(name, id)                                                                         \
    extern "C" __global__ void __launch_bounds__(128)                                            \
        matmul_bf16_##name(const bf16* x, const uint8_t* w, float* y, int M, int N, int K,       \
                           long long row_bytes, long long ldy) {                                 \
        matmul_bf16_impl<id>(x, w, y, M, N, K, row_bytes, ldy);                                  \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                            \
        matmul_f32_##name(const float* x, const uint8_t* w, float* y, int M, int N, int K,       \
                          long long row_bytes, long long ldy) {                                  \
        matmul_f32_impl<id>(x, w, y, M, N, K, row_bytes, ldy);                                   \
    }
FOR_EACH_FORMAT(MATMUL)
MATMUL(mxfp4, FMT_MXFP4)

// dequant_bf16_<fmt>: out = bf16(dequant(W)), (n_rows, n_cols) row-major, the
// weight operand of gemm_bf16_wgmma (gemm_sm90a.cu) for block-quantized
// formats (Q4_0 can skip it: gemm_q4_0_wgmma* dequantize in their producer with
// the same dequant8, ops::GemmDequant::Producer); the same dequant8 + pack_bf16x8 rounding as matmul_bf16_<fmt>'s
// loader, so both kernels multiply identical operands. One thread per group
// of 8 elements: grid ceil(n_groups / 256), block 256.
#define DEQUANT_BF16(name, id)                                                                    \
    extern "C" __global__ void __launch_bounds__(256)                                             \
        dequant_bf16_##name(const uint8_t* __restrict__ w, bf16* __restrict__ out, long long n_groups, \
                            int groups_per_row, long long row_bytes) {                           \
        const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;                    \
        if (i >= n_groups) return;                                                                \
        const long long row = i / groups_per_row;                                                 \
        const int g = (int)(i - row * groups_per_row);                                            \
        float v[8];                                                                               \
        dequant8<id>(w + row * row_bytes, g, v);                                                  \
        reinterpret_cast<uint4*>(out)[i] = pack_bf16x8(v);                                        \
    }
FOR_EACH_FORMAT(DEQUANT_BF16)
DEQUANT_BF16(mxfp4, FMT_MXFP4)
