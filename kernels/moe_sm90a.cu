// moe_sm90a.cu: the routed experts' grouped products on Hopper's wgmma tensor
// cores (sm_90a only), every expert of a layer in one launch per product.
//
// Inputs (src/backend/cuda/moe.rs lays them out): the slots, expert-major with
// rows ascending inside an expert (expert e owns slots seg[e]..seg[e+1]), cut
// into tiles of at most 128 slots, each (expert, first slot, end slot) in a
// device table sized for the worst case (moe_plan_tiles of moe.cu writes it on
// the device; its last row is a sentinel (-1, n_real, n_real) that gives the
// real count, so the persistent loop stops there); A = the slot-ordered rows, one (n_slots, K) bf16 matrix (x
// gathered by moe_gather_bf16 for gate/up, h itself for down); B = an expert
// bank dequantized to bf16 once per layer call by moe_dequant_bank_<fmt>
// (moe.cu), expert-major (n_experts * N, K), so expert e's weight is rows
// e*N..e*N+N of one TMA-loadable matrix (the parts of experts without rows are
// left unwritten: no tile names them, and where a B tile runs past its expert's
// N into such a part, those columns are computed and not stored).
//
// moe_wgmma_gated_{silu,gelu}: h[s] = bf16(act(x[row(s)] · Wg[e]ᵀ) * (x[row(s)] · Wu[e]ᵀ));
// moe_wgmma_plain: y[s] = h[s] · Wd[e]ᵀ, f32.
// The numbers of moe.cu's mma.sync kernels (bf16 operands rounded the same way,
// f32 accumulation, act in f32 and one bf16 rounding of act(g) * u), with a
// different summation order inside each dot product only. Each output depends
// on its own slot's row and its expert's weight alone, never on the rows beside
// it in a tile.
//
// Algorithm: sm90a.cuh's wgmma_pipeline, the one gemm_sm90a.cu runs (block tile 128 slots x 256 B rows x
// 64 K, GEMM_STAGES = 4 shared stages of 48 KiB loaded by TMA with 128-byte
// swizzle, zero fill outside a matrix, a "full" and an "empty" mbarrier per
// stage; warpgroup 0 produces (one thread), warpgroups 1 and 2 consume, 64
// slots x 256 columns each, wgmma.mma_async.m64n256k16, one group in flight,
// setmaxnreg moving registers to the consumers), over work items instead of a
// dense tile grid: item i = (slot tile i / n_col_tiles, column tile i %
// n_col_tiles), so the column tiles of one slot tile run side by side and the
// blocks in flight share their expert's weight through L2. The A tile of a slot
// tile starts at its first slot and may run into the next expert's slots (or
// past the end: zeros); those rows are computed and not stored (slot >= end
// slot). The B tile starts at row e*N + column tile origin; rows past the
// expert's N are the next expert's, computed and not stored (column >= N). Gated:
// each 256-row B stage is 128 rows of the gate bank and the same 128 rows of the
// up bank (128 output columns a tile), the epilogue that of
// gemm_bf16_wgmma_gated_<act>.
//
// Launch: persistent, grid min(n_items, SMs), block 384, dynamic shared memory
// GEMM_SMEM_BYTES of ops.rs (one block per SM). Shared-memory descriptors: see
// gemm_sm90a.cu's header.
//
// CPU twin: src/backend/cpu/moe.rs (CpuBackend::moe_ffn_cpu), with bf16 inputs.
#include "sm90a.cuh"

#define MOE_WG_THREADS 384

template <bool GATED, int ACT>
__device__ __forceinline__ void moe_wgmma_items(const MoeWgmmaParams& p) {
    extern __shared__ uint8_t moe_smem_raw[];
    constexpr int TILE_N = GATED ? GEMM_BN / 2 : GEMM_BN;
    const int n_col_tiles = (p.n + TILE_N - 1) / TILE_N;
    const int k_tiles = (p.k + GEMM_BK - 1) / GEMM_BK;
    // Work item = (slot tile item / n_col_tiles, column tile item % n_col_tiles).
    auto load = [&](int item, int kt, uint32_t a_stage, uint32_t b_stage, uint32_t full) {
        const int* t = p.tiles + 3 * (item / n_col_tiles);
        const int b_row = t[0] * p.n + (item % n_col_tiles) * TILE_N;
        tma_load_2d(a_stage, &p.a, full, kt * GEMM_BK, t[1]);
        tma_load_2d(b_stage, &p.b, full, kt * GEMM_BK, b_row);
        if constexpr (GATED) tma_load_2d(b_stage + GEMM_B_STAGE_BYTES / 2, &p.b_up, full, kt * GEMM_BK, b_row);
    };
    auto epilogue = [&](int item, int c, int warp, int lane, float (&d)[128]) {
        const int* t = p.tiles + 3 * (item / n_col_tiles);
        const int s0 = t[1], s1 = t[2];
        const int n0 = (item % n_col_tiles) * TILE_N;
        // m64nNk16 layout: warp w holds rows 16w..16w+15; lane (g, t) rows g and g+8,
        // columns 8j + 2t, 8j + 2t + 1.
        const int slot = s0 + c * 64 + warp * 16 + lane / 4;
        const int col = n0 + 2 * (lane % 4);
        if constexpr (GATED) {
            bf16* out = static_cast<bf16*>(p.y);
#pragma unroll
            for (int j = 0; j < 16; ++j) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int m = slot + 8 * h;
                    const int n = col + 8 * j;
                    if (m < s1 && n < p.n) {
                        const float o0 = fmul(act<ACT>(d[4 * j + 2 * h]), d[4 * (j + 16) + 2 * h]);
                        const float o1 = fmul(act<ACT>(d[4 * j + 2 * h + 1]), d[4 * (j + 16) + 2 * h + 1]);
                        // n even and p.n even: n + 1 < p.n.
                        *reinterpret_cast<__nv_bfloat162*>(out + (long long)m * p.ldy + n) = __floats2bfloat162_rn(o0, o1);
                    }
                }
            }
        } else {
            float* y = static_cast<float*>(p.y);
#pragma unroll
            for (int j = 0; j < 32; ++j) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int m = slot + 8 * h;
                    const int n = col + 8 * j;
                    if (m < s1 && n < p.n) {
                        *reinterpret_cast<float2*>(y + (long long)m * p.ldy + n) = make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
                    }
                }
            }
        }
    };
    // The table's last row is a sentinel (-1, n_real, n_real) when the table was
    // sized for the worst case (moe_plan_tiles); items past the real tiles do not exist.
    const int* last = p.tiles + 3 * (p.n_tiles - 1);
    const int n_real = last[0] < 0 ? last[1] : p.n_tiles;
    wgmma_pipeline(moe_smem_raw, n_real * n_col_tiles, k_tiles, load, epilogue);
}

extern "C" __global__ void __launch_bounds__(MOE_WG_THREADS, 1) moe_wgmma_plain(const __grid_constant__ MoeWgmmaParams p) {
    moe_wgmma_items<false, 0>(p);
}

extern "C" __global__ void __launch_bounds__(MOE_WG_THREADS, 1) moe_wgmma_gated_silu(const __grid_constant__ MoeWgmmaParams p) {
    moe_wgmma_items<true, ACT_SILU>(p);
}

extern "C" __global__ void __launch_bounds__(MOE_WG_THREADS, 1) moe_wgmma_gated_gelu(const __grid_constant__ MoeWgmmaParams p) {
    moe_wgmma_items<true, ACT_GELU>(p);
}
