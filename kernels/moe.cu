// moe.cu: the routed experts of a mixture-of-experts layer, grouped by expert.
//
// The host (src/backend/cuda/moe.rs) routes every row exactly as the CPU oracle
// does (the (n_rows, n_experts) router logits are brought to the host and
// routed by src/backend/cpu/moe.rs::route itself: f64 softmax, top-k with the
// lower expert index winning ties, norm_topk_prob), then lays the (row, expert)
// pairs out as slots, expert-major with rows ascending inside an expert (expert
// e owns slots seg[e]..seg[e+1]), and cuts each expert's slots into tiles of
// 64. Three launches follow, each covering every expert at once:
//
// moe_gemm_gated_{silu,gelu}_<fmt>: h[s] = bf16(act(x[row(s)] · Wg[e]ᵀ) * (x[row(s)] · Wu[e]ᵀ))
//   for every slot s of expert e: both products of one tile in one block, the
//   activation and the one bf16 rounding in the epilogue (the numbers of
//   matmul_gated_bf16: f32 products, act in f32, act(g) * u rounded once).
// moe_gemm_<fmt>: y[s] = h[s] · Wd[e]ᵀ, f32.
//   Both are mma.sync.m16n8k16 bf16 GEMMs with f32 accumulation on the tiling of
//   matmul_bf16_<fmt> (matmul.cu): block tile 64 slots x 64 outputs x 32 K, 4
//   warps in 2 x 2 (32 x 32 each), shared rows padded to 40 bf16, the next K
//   tile fetched into registers while the tensor cores work. Grid (ceil(N / 64),
//   n_tiles), block 128: block (bx, t) reads tile t = (expert, first slot, end
//   slot) from a device table, the expert's weight through a device table of
//   base pointers (expert e's (N, K) rows, one contiguous byte range of its
//   expert-major bank, in its stored block format, dequantized by dequant8 in the
//   loader), and the rows of x through the slot -> row list (a gather in the
//   loader; none for the down product, whose input is already slot-ordered).
// moe_combine: out[r] = sum over r's top_k experts in ascending expert index of
//   w * y[slot], in f64 with separately rounded products and sums (no FMA),
//   exactly the CPU oracle's sum, then rounded to f32 once; one thread per
//   output element, grid ceil(n_rows * d / 256), block 256. The result does not
//   depend on scheduling: each slot is one tile row, each sum has a fixed order.
//
// CPU twin: src/backend/cpu/moe.rs (CpuBackend::moe_ffn_cpu).
#include "common.cuh"

#define MOE_BM 64
#define MOE_BN 64
#define MOE_BK 32
#define MOE_LDS 40  // bf16 per shared row (32 + 8 padding)
#define MOE_PLAIN -1  // MODE of the plain (down) product; ACT_SILU / ACT_GELU: gated

__device__ __forceinline__ void moe_mma_16816(float c[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// This thread's two x items and two items of each weight for K-tile k0.
// Item it (0..255): tile row it / 4, 8-element group it % 4; xrow[s] < 0: no slot.
template <int FMT, int NW>
__device__ __forceinline__ void moe_fetch(const bf16* __restrict__ x, const uint8_t* const w[NW], const int xrow[2],
                                          int N, int K, long long row_bytes, int n0, int k0, uint4 xr[2],
                                          uint4 wr[NW][2]) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        const int it = threadIdx.x + s * 128;
        const int r = it >> 2, grp = it & 3;
        xr[s] = xrow[s] >= 0 ? *reinterpret_cast<const uint4*>(x + (long long)xrow[s] * K + k0 + grp * 8)
                             : make_uint4(0, 0, 0, 0);
        const int n = n0 + r;
#pragma unroll
        for (int j = 0; j < NW; ++j) {
            if (n < N) {
                float v[8];
                dequant8<FMT>(w[j] + (long long)n * row_bytes, (k0 >> 3) + grp, v);
                wr[j][s] = pack_bf16x8(v);
            } else {
                wr[j][s] = make_uint4(0, 0, 0, 0);
            }
        }
    }
}

template <int FMT, int MODE>
__device__ void moe_gemm_impl(const MoeGemmArgs& a) {
    constexpr int NW = MODE == MOE_PLAIN ? 1 : 2;
    __shared__ __align__(16) bf16 sx[MOE_BM * MOE_LDS];
    __shared__ __align__(16) bf16 sw[NW][MOE_BN * MOE_LDS];
    const int* tile = a.tiles + 3 * blockIdx.y;
    const int e = tile[0], s0 = tile[1], s1 = tile[2];
    const int n0 = blockIdx.x * MOE_BN;
    const int N = a.n, K = a.k;
    const uint8_t* w[NW];
    w[0] = reinterpret_cast<const uint8_t*>(a.w[e]);
    if constexpr (NW == 2) w[1] = reinterpret_cast<const uint8_t*>(a.w_up[e]);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;

    int xrow[2];
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        const int slot = s0 + ((threadIdx.x + s * 128) >> 2);
        xrow[s] = slot < s1 ? (a.x_rows ? a.x_rows[slot] : slot) : -1;
    }

    float acc[NW][2][4][4];
#pragma unroll
    for (int q = 0; q < NW; ++q)
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[q][i][j][c] = 0.0f;

    uint4 xr[2], wr[NW][2];
    moe_fetch<FMT, NW>(a.x, w, xrow, N, K, a.row_bytes, n0, 0, xr, wr);
    for (int k0 = 0; k0 < K; k0 += MOE_BK) {
        __syncthreads();  // the previous tile's fragment loads are done
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            const int it = threadIdx.x + s * 128;
            const int r = it >> 2, grp = it & 3;
            *reinterpret_cast<uint4*>(sx + r * MOE_LDS + grp * 8) = xr[s];
#pragma unroll
            for (int q = 0; q < NW; ++q) *reinterpret_cast<uint4*>(sw[q] + r * MOE_LDS + grp * 8) = wr[q][s];
        }
        __syncthreads();
        if (k0 + MOE_BK < K) moe_fetch<FMT, NW>(a.x, w, xrow, N, K, a.row_bytes, n0, k0 + MOE_BK, xr, wr);
#pragma unroll
        for (int kk = 0; kk < MOE_BK; kk += 16) {
            uint32_t af[2][4];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const bf16* p = sx + (wm + i * 16 + g) * MOE_LDS + kk + t * 2;
                af[i][0] = *reinterpret_cast<const uint32_t*>(p);
                af[i][1] = *reinterpret_cast<const uint32_t*>(p + 8 * MOE_LDS);
                af[i][2] = *reinterpret_cast<const uint32_t*>(p + 8);
                af[i][3] = *reinterpret_cast<const uint32_t*>(p + 8 * MOE_LDS + 8);
            }
#pragma unroll
            for (int q = 0; q < NW; ++q) {
                uint32_t bfr[4][2];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const bf16* p = sw[q] + (wn + j * 8 + g) * MOE_LDS + kk + t * 2;
                    bfr[j][0] = *reinterpret_cast<const uint32_t*>(p);
                    bfr[j][1] = *reinterpret_cast<const uint32_t*>(p + 8);
                }
#pragma unroll
                for (int i = 0; i < 2; ++i)
#pragma unroll
                    for (int j = 0; j < 4; ++j) moe_mma_16816(acc[q][i][j], af[i], bfr[j]);
            }
        }
    }

    // Accumulator layout of m16n8: c0,c1 at (g, 2t..2t+1), c2,c3 at (g+8, 2t..2t+1).
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int m = s0 + wm + i * 16 + g + (c >> 1) * 8;
                const int n = n0 + wn + j * 8 + t * 2 + (c & 1);
                if (m < s1 && n < N) {
                    if constexpr (MODE == MOE_PLAIN) {
                        static_cast<float*>(a.y)[(long long)m * a.ldy + n] = acc[0][i][j][c];
                    } else {
                        const float h = fmul(act<MODE>(acc[0][i][j][c]), acc[NW - 1][i][j][c]);
                        static_cast<bf16*>(a.y)[(long long)m * a.ldy + n] = from_f32<bf16>(h);
                    }
                }
            }
}

#define MOE_GEMM(name, id)                                                                           \
    extern "C" __global__ void __launch_bounds__(128) moe_gemm_##name(const MoeGemmArgs a) {         \
        moe_gemm_impl<id, MOE_PLAIN>(a);                                                             \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(128) moe_gemm_gated_silu_##name(const MoeGemmArgs a) { \
        moe_gemm_impl<id, ACT_SILU>(a);                                                              \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(128) moe_gemm_gated_gelu_##name(const MoeGemmArgs a) { \
        moe_gemm_impl<id, ACT_GELU>(a);                                                              \
    }
FOR_EACH_FORMAT(MOE_GEMM)
MOE_GEMM(mxfp4, FMT_MXFP4)

extern "C" __global__ void __launch_bounds__(256) moe_combine(const MoeCombineArgs a) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)a.n_rows * a.d) return;
    const long long r = i / a.d;
    const int j = (int)(i - r * a.d);
    double acc = 0.0;
    for (int q = 0; q < a.top_k; ++q) {
        const long long s = a.slot[r * a.top_k + q];
        acc = __dadd_rn(acc, __dmul_rn(a.weight[r * a.top_k + q], (double)a.y[s * a.d + j]));
    }
    a.out[i] = __double2float_rn(acc);
}

// moe_dequant_bank_<fmt>: the wgmma route's (kernels/moe_sm90a.cu) bf16 operand of
// one bank: out[e] = bf16(dequant(W[e])) for every expert, expert-major
// (n_experts, n_rows, K), each expert read through the base-pointer table; the
// same dequant8 + pack_bf16x8 rounding as moe_fetch above and dequant_bf16_<fmt>
// (matmul.cu), so every kernel multiplies identical operands. One thread per
// group of 8 elements: grid (ceil(n_rows * K / 8 / 256), n_experts), block 256.
#define MOE_DEQUANT(name, id)                                                                        \
    extern "C" __global__ void __launch_bounds__(256) moe_dequant_bank_##name(const MoeDequantArgs a) { \
        const long long per_expert = (long long)a.n_rows * a.groups_per_row;                        \
        const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;                       \
        if (i >= per_expert) return;                                                                 \
        const long long row = i / a.groups_per_row;                                                  \
        const int g = (int)(i - row * a.groups_per_row);                                             \
        const uint8_t* w = reinterpret_cast<const uint8_t*>(a.w[blockIdx.y]);                        \
        float v[8];                                                                                  \
        dequant8<id>(w + row * a.row_bytes, g, v);                                                   \
        reinterpret_cast<uint4*>(a.out)[blockIdx.y * per_expert + i] = pack_bf16x8(v);               \
    }
FOR_EACH_FORMAT(MOE_DEQUANT)
MOE_DEQUANT(mxfp4, FMT_MXFP4)

// moe_gather_bf16: out[s] = x[rows[s]], the rows of x in slot order (the wgmma
// route's A operand, one TMA-loadable matrix). One thread per 16 bytes: grid
// ceil(n_slots * groups_per_row / 256), block 256.
extern "C" __global__ void __launch_bounds__(256) moe_gather_bf16(const MoeGatherArgs a) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)a.n_slots * a.groups_per_row) return;
    const long long s = i / a.groups_per_row;
    const int g = (int)(i - s * a.groups_per_row);
    reinterpret_cast<uint4*>(a.out)[i] =
        reinterpret_cast<const uint4*>(a.x)[(long long)a.rows[s] * a.groups_per_row + g];
}
