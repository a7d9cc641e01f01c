// moe.cu: the routed experts of a mixture-of-experts layer, grouped by expert.
//
// Routing (bottom of this file): moe_route routes every row exactly as the CPU
// oracle does (src/backend/cpu/moe.rs::route: f64 softmax, top-k with the lower
// expert index winning ties, norm_topk_prob), moe_count counts the rows of each
// expert, moe_plan_tiles turns the counts into the slot layout (expert-major,
// rows ascending inside an expert: expert e owns slots seg[e]..seg[e+1]) and the
// tile table (each expert's slots cut into tiles of 64 here, 128 for
// moe_sm90a.cu, rows past the real tiles sentinels (-1, n_real, n_real)), adds
// the counts to the layer's device-resident expert-usage counters and clears the
// bank pointers of experts without rows; moe_plan_slots places every (row,
// expert) pair. Nothing comes to the host (src/backend/cuda/moe.rs can also
// route on the host and upload the same tables). Three launches follow, each
// covering every expert at once:
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
//   table rows), block 128: block (bx, t) reads tile t = (expert, first slot, end
//   slot) from the device table (a sentinel row: the block returns), the
//   expert's weight through a device table of
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
    if (e < 0) return;  // a sentinel row: past the layer call's real tiles
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
// (n_experts, n_rows, K), each expert read through the base-pointer table (a null
// entry, an expert that took no rows, is skipped: its part of out stays unwritten); the
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
        if (w == nullptr) return;                                                                    \
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

// ---------------------------------------------------------------- routing on the device

// moe_exp_f64: e^x by the fixed operation sequence of src/backend/cpu/moe.rs::exp_f64
// (its CPU twin, bit for bit): k = floor(x / ln 2 + 1/2), r by Cody-Waite, the Taylor
// series to r^13 / 13! in Horner form, times 2^k in two exact power-of-two steps.
// Every operation is an explicitly rounded one (no FMA contraction).
__device__ __forceinline__ double moe_exp_f64(double x) {
    if (isnan(x)) return x;
    if (x > 709.782712893384) return __longlong_as_double(0x7FF0000000000000LL);
    if (x < -745.1332191019412) return 0.0;
    const double C[14] = {1.0,
                          1.0,
                          0.5,
                          0.16666666666666666,
                          0.041666666666666664,
                          0.008333333333333333,
                          0.001388888888888889,
                          0.0001984126984126984,
                          2.48015873015873e-05,
                          2.7557319223985893e-06,
                          2.755731922398589e-07,
                          2.505210838544172e-08,
                          2.08767569878681e-09,
                          1.6059043836821613e-10};
    const double k = floor(__dadd_rn(__dmul_rn(x, 1.4426950408889634), 0.5));
    const double r = __dsub_rn(__dsub_rn(x, __dmul_rn(k, 6.93147180369123816490e-01)), __dmul_rn(k, 1.90821492927058770002e-10));
    double p = C[13];
#pragma unroll
    for (int i = 12; i >= 0; --i) p = __dadd_rn(__dmul_rn(p, r), C[i]);
    const long long ki = (long long)k;
    const long long k1 = ki < -1022 ? -1022 : (ki > 1023 ? 1023 : ki);
    double y = __dmul_rn(p, __longlong_as_double((k1 + 1023) << 52));
    if (ki != k1) y = __dmul_rn(y, __longlong_as_double((ki - k1 + 1023) << 52));
    return y;
}

// Rust's f64::total_cmp order as a signed integer key.
__device__ __forceinline__ long long moe_total_key(double p) {
    const long long b = __double_as_longlong(p);
    return b ^ (long long)(((unsigned long long)(b >> 63)) >> 1);
}

// moe_route: per row, the CPU oracle's route (src/backend/cpu/moe.rs::route) bit for
// bit: the max of the logits in f64 (NaN ignored), e = exp_f64(v - max), their sum in
// expert order, p = e / sum; the top_k largest p under total_cmp (equal ones: the lower
// expert first); with norm_topk_prob each divided by their sum taken in selection
// order; written in ascending expert order. One warp per row: grid n_rows, block 32,
// dynamic shared memory n_experts doubles (the probabilities).
extern "C" __global__ void __launch_bounds__(32) moe_route(const MoeRouteArgs a) {
    extern __shared__ double moe_p[];
    const int lane = threadIdx.x, n_e = a.n_experts, top_k = a.top_k;
    const long long r = blockIdx.x;
    const float* l = a.logits + r * n_e;
    double m = -__longlong_as_double(0x7FF0000000000000LL);
    for (int e = lane; e < n_e; e += 32) m = fmax(m, (double)l[e]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmax(m, __shfl_xor_sync(0xffffffffu, m, o));
    for (int e = lane; e < n_e; e += 32) moe_p[e] = moe_exp_f64(__dsub_rn((double)l[e], m));
    __syncwarp();
    double sum = -0.0;
    if (lane == 0)
        for (int e = 0; e < n_e; ++e) sum = __dadd_rn(sum, moe_p[e]);
    sum = __shfl_sync(0xffffffffu, sum, 0);
    __syncwarp();
    for (int e = lane; e < n_e; e += 32) moe_p[e] = __ddiv_rn(moe_p[e], sum);
    __syncwarp();
    int sel[MOE_MAX_TOP_K];
    for (int q = 0; q < top_k; ++q) {
        long long best_key = 0;
        int best = -1;
        for (int e = lane; e < n_e; e += 32) {
            bool taken = false;
            for (int j = 0; j < q; ++j) taken |= sel[j] == e;
            if (taken) continue;
            const long long key = moe_total_key(moe_p[e]);
            if (best < 0 || key > best_key) {  // e ascending within a lane: ties keep the lower
                best_key = key;
                best = e;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const long long ok = __shfl_xor_sync(0xffffffffu, best_key, o);
            const int oi = __shfl_xor_sync(0xffffffffu, best, o);
            if (oi >= 0 && (best < 0 || ok > best_key || (ok == best_key && oi < best))) {
                best_key = ok;
                best = oi;
            }
        }
        sel[q] = best;
    }
    if (lane != 0) return;
    double total = -0.0;
    for (int q = 0; q < top_k; ++q) total = __dadd_rn(total, moe_p[sel[q]]);
    double w[MOE_MAX_TOP_K];
    for (int q = 0; q < top_k; ++q) w[q] = a.norm_topk_prob ? __ddiv_rn(moe_p[sel[q]], total) : moe_p[sel[q]];
    // Ascending expert order (insertion sort of at most MOE_MAX_TOP_K pairs).
    for (int q = 1; q < top_k; ++q) {
        const int e = sel[q];
        const double v = w[q];
        int j = q - 1;
        while (j >= 0 && sel[j] > e) {
            sel[j + 1] = sel[j];
            w[j + 1] = w[j];
            --j;
        }
        sel[j + 1] = e;
        w[j + 1] = v;
    }
    for (int q = 0; q < top_k; ++q) {
        a.experts[r * top_k + q] = sel[q];
        a.weights[r * top_k + q] = w[q];
    }
}

// moe_count: counts[e] += the rows routed to e (atomics; the sum does not depend on
// their order). Grid ceil(n_rows * top_k / 256), block 256.
extern "C" __global__ void __launch_bounds__(256) moe_count(const int* __restrict__ experts, int* __restrict__ counts, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(counts + experts[i], 1);
}

// moe_plan_slots: the slots of expert e, rows ascending: the (row, expert) pair of row r
// gets slot seg[e] + (rows before r routed to e), as MoePlan::new lays them out on the
// host; slot_rows[slot] = r and combine_slots[r * top_k + q] = slot (q: e's place in
// r's list). One block per expert (grid n_experts, block 256), the rows in chunks of
// 256 with a block-wide count (warp ballots) of the rows before each.
extern "C" __global__ void __launch_bounds__(256) moe_plan_slots(const MoePlanArgs a) {
    __shared__ int warp_counts[8];
    const int e = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int first = a.seg[e];
    if (a.seg[e + 1] == first) return;
    int done = 0;
    for (int base = 0; base < a.n_rows; base += 256) {
        const int r = base + threadIdx.x;
        int q_hit = -1;
        if (r < a.n_rows)
            for (int q = 0; q < a.top_k; ++q)
                if (a.experts[(long long)r * a.top_k + q] == e) q_hit = q;
        const unsigned ballot = __ballot_sync(0xffffffffu, q_hit >= 0);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        int before = done;
        for (int w = 0; w < warp; ++w) before += warp_counts[w];
        int chunk = 0;
        for (int w = 0; w < 8; ++w) chunk += warp_counts[w];
        if (q_hit >= 0) {
            const int s = first + before + __popc(ballot & ((1u << lane) - 1u));
            a.slot_rows[s] = r;
            a.combine_slots[(long long)r * a.top_k + q_hit] = s;
        }
        done += chunk;
        __syncthreads();
    }
}

// moe_plan_tiles: one layer call's slot layout and tile table from its per-expert
// counts, on the device (MoeTilesArgs of common.cuh says what it writes); the host
// twin is tiles_of in src/backend/cuda/moe.rs (the same rows, in the same order).
// Thread 0 takes the two prefix sums (slots, then tiles: ceil(count /
// slots_per_tile) per expert) in expert order into shared memory; then the block
// writes each expert's tiles at its tile offset, the sentinel rows after the
// last real tile, usage += counts and the cleared bank pointers. The table's
// n_table_rows (the host's worst case + 1) bounds every write: a table too short
// would lose tiles, never write past its end. One block of 256 threads, dynamic
// shared memory 2 * (n_experts + 1) i32.
extern "C" __global__ void __launch_bounds__(256) moe_plan_tiles(const MoeTilesArgs a) {
    extern __shared__ int moe_plan_sh[];
    const int n_e = a.n_experts, per = a.slots_per_tile;
    int* seg = moe_plan_sh;              // (n_e + 1)
    int* tile_off = moe_plan_sh + n_e + 1;  // (n_e + 1)
    if (threadIdx.x == 0) {
        int s = 0, t = 0;
        for (int e = 0; e < n_e; ++e) {
            seg[e] = s;
            tile_off[e] = t;
            const int c = a.counts[e];
            s += c;
            t += (c + per - 1) / per;
        }
        seg[n_e] = s;
        tile_off[n_e] = t;
    }
    __syncthreads();
    const int n_real = min(tile_off[n_e], a.n_table_rows - 1);
    for (int e = threadIdx.x; e <= n_e; e += blockDim.x) a.seg[e] = seg[e];
    for (int e = threadIdx.x; e < n_e; e += blockDim.x) {
        const int s0 = seg[e], s1 = seg[e + 1];
        for (int j = 0; s0 + j * per < s1; ++j) {
            const int row = tile_off[e] + j;
            if (row >= n_real) break;
            a.tiles[3 * row] = e;
            a.tiles[3 * row + 1] = s0 + j * per;
            a.tiles[3 * row + 2] = min(s0 + (j + 1) * per, s1);
        }
        if (a.usage) a.usage[e] += (unsigned long long)(s1 - s0);
        if (s1 == s0)
            for (int b = 0; b < a.n_banks; ++b) a.banks[(long long)b * n_e + e] = 0ull;
    }
    for (int row = n_real + threadIdx.x; row < a.n_table_rows; row += blockDim.x) {
        a.tiles[3 * row] = -1;
        a.tiles[3 * row + 1] = n_real;
        a.tiles[3 * row + 2] = n_real;
    }
}
