// gemm_sm90a.cu: y = x · Wᵀ on Hopper's wgmma tensor cores (sm_90a only).
//
// x: (M, K) bf16 row-major, W: (N, K) bf16 row-major (a stored BF16 weight,
// or the per-matmul bf16 scratch that `dequant_bf16_<fmt>` in matmul.cu
// writes from a block-quantized one), y: (M, N) f32 with row stride ldy.
// bf16 operands, f32 accumulation: the numerics of matmul_bf16_<fmt>, with a
// different summation order only. CPU twin: tests/gpu_ops/twin.rs matmul_f64
// over the same bf16-rounded operands.
//
// Algorithm (the main loop is sm90a.cuh's wgmma_pipeline, shared with
// moe_sm90a.cu; this file gives it the tile order, the loads and the
// epilogues): block tile 128 (M) x 256 (N) x 64 (K), GEMM_STAGES = 4 shared-
// memory stages of (A 128x64 + B 256x64) bf16 = 48 KiB each. Both tiles are
// brought in by the tensor-memory accelerator (cp.async.bulk.tensor.2d, tensor
// maps built on the host with cuTensorMapEncodeTiled, 128-byte swizzle, zero
// fill outside the matrix, so M, N and K need not be tile multiples; K % 8 ==
// 0 for the 16-byte row stride) completing on a per-stage "full" mbarrier.
// Warp specialization: warpgroup 0 is the producer (one thread issues the
// copies after waiting on the stage's "empty" mbarrier), warpgroups 1 and 2
// are consumers, each owning 64 rows x 256 columns of the tile (128 f32
// accumulators per thread) and issuing wgmma.mma_async.m64n256k16 from the
// swizzled shared tiles (4 per K tile), keeping one wgmma group in flight
// and releasing a stage once the group that read it has retired. setmaxnreg
// moves registers from the producer to the consumers. The accumulators are
// in the m64nNk16 layout (warp w of the warpgroup holds rows 16w..16w+15;
// lane (g = lane/4, t = lane%4) holds rows g and g+8, columns 8j+2t, 8j+2t+1
// for j < 32). Two epilogues, the same values (store_tma):
//   - TMA stores (the f32-output GEMMs' default where y is 16-byte aligned
//     with rows a multiple of 16 bytes, ops::gemm_tma_store_fits; the gated
//     GEMM defaults to direct stores, measured faster): each consumer writes its 64 rows into its own 16 KiB
//     128-byte-swizzled shared buffer (after the stages and the mbarriers),
//     fences it for the async proxy, and one thread hands it to
//     cp.async.bulk.tensor stores (cp.reduce.async.bulk.tensor .add for
//     `accumulate`, the residual add: one correctly rounded f32 add in L2), which
//     clip at M and N; the consumers go back to the next tile's MMAs while the
//     copies drain. f32: eight 64 x 32 boxes through two 8 KiB halves (a half
//     is rewritten once the copy issued from it two boxes earlier has read it);
//     gated bf16: two 64 x 64 boxes, the whole block at once, so only the next
//     tile's epilogue waits on it.
//   - Direct: each thread stores its accumulators to y (or adds them to y,
//     `accumulate`) with bounds checks (pairs as float2 when y_pairs: ldy even
//     and y 8-byte aligned); the tensor cores idle until the stores are issued.
//
// RoPE in the epilogue (GemmParams' rope_*, ops::matmul_rope_bf16: the q and k
// projections of a layer without QK norm): before either store path, each consumer
// thread rotates its accumulators as rope_tabled_f32 would rotate y afterwards (the
// same (cos, sin) table entry, rope.cu's expression with fmul / fsub / fadd, so the
// same bits), and y is written once. A tile's 256 columns are whole heads (d_head a
// power of two <= 256); a normal pair (2i, 2i + 1) is a thread's two adjacent columns,
// a neox pair (i, i + n_rot/2) its columns 8j + e and 8(j + n_rot/16) + e (n_rot a
// power of two >= 16: gemm_rope_fits; anything else runs matmul then rope_tabled).
//
// Shared-memory matrix descriptors (K-major, 128-byte swizzle): start address
// >> 4 in bits 0-13, leading byte offset (unused for this layout, 1) in bits
// 16-29, stride byte offset 1024 >> 4 (8 rows of 128 bytes) in bits 32-45,
// layout type 1 (128B swizzle) in bits 62-63; every tile starts 1024-byte
// aligned; the k-th 16-element slice of a 64-element row starts 32 k bytes in.
//
// Gated variants (gemm_bf16_wgmma_gated_{silu,gelu}): the FFN's gate and up
// products in one GEMM with act(gate) * up in the epilogue, written as bf16
// (the down projection's input): each 256-row B stage is 128 rows of Wg and
// the same 128 rows of Wu (two TMA loads), so the tile covers 128 output
// columns and each consumer thread holds gate and up of the same columns; the
// epilogue computes exactly what gated_<act>_bf16 computes from the two f32
// products (common.cuh's act, fmul, round to nearest even), then stores it
// through shared memory and TMA (out_map) or directly. CPU twin:
// tests/gpu_ops/twin.rs matmul_f64 twice, then silu_f64 / gelu_tanh_f64.
//
// QKV variant (gemm_bf16_wgmma_qkv, GemmQkvParams): the plain GEMM over the q, k
// and v weights stacked into one (n_q + n_k + n_v, K) bf16 operand (the scratch
// the three dequant_bf16_<fmt> write one after another), the epilogue sending each
// column to its projection's own (M, width) f32 matrix (no split copy) and adding
// that projection's bias when it has one (qwen2). Per output element the same K
// order as gemm_bf16_wgmma, so the same bits as three separate GEMMs (then
// add_bias). CPU twin: tests/gpu_ops/twin.rs matmul_f64 per projection, plus the bias.
//
// LM-head variant (gemm_bf16_wgmma_lmhead, GemmLmParams; the fast path lm-head-fused,
// ops::lm_head_fused): the plain tile loop over h (M, K) and the bf16 head (n_vocab, K),
// whose epilogue reduces each row's 256 logits of the tile instead of storing them: the
// max m over the columns below n_vocab (fmaxf: a NaN logit does not enter it), then s =
// sum of 2^((x - m) log2 e) (ex2.approx; m taken as 0 when every logit is -inf, so s = 0;
// a NaN logit makes s NaN), each thread over its 64 columns of a row in column order,
// then across the quad by two xor shuffles; lane 0 of the quad writes (m, s) to part[r,
// tile]; the thread holding column targets[r] writes that logit, the very accumulator the
// tiled head would have stored. lmhead_merge (lmhead.cu) then combines a row's parts in
// f64. No logit leaves the registers: the tiled head's (rows, n_vocab) f32 tile, written
// and read back, is gone.
//
// Producer-dequant Q4_0 variants (gemm_q4_0_wgmma, gemm_q4_0_wgmma_gated_{silu,gelu};
// ops::GemmDequant::Producer, INFERNIX_GEMM_DEQUANT=producer, off by default: not yet
// run on a GPU): the same tile loop with W's stored Q4_0 blocks instead of a bf16
// scratch (wgmma_pipeline<RAW = 2>). Per K tile the producer's thread 0 copies the A
// tile and, two K tiles ahead, the tile's raw bytes (36 bytes a row, in a 48-byte
// box from the 16-byte unit that holds them: two 128-row boxes of a uint8 tensor map
// over the blocks, K % 256 == 0 so rows are 16-byte multiples) into one of two 12 KiB
// raw buffers; all 128 producer threads then write the 256 x 64 bf16 B tile, thread t
// rows t and t + 128, each 8-element group by dequant8<FMT_Q4_0> + pack_bf16x8 (the
// very code of dequant_bf16_q4_0, so the operands are the scratch path's bits) as a
// 16-byte store at its 128B-swizzle place (sw128_offset), fence them for the async
// proxy and arrive on the stage's full barrier (count 1 + 128). No bf16 scratch in
// device memory and no dequant pass: 0.56 bytes of weight read a weight element
// instead of 0.56 + 2 written + 2 read. Direct stores only (the raw buffers take the
// epilogue buffers' shared memory: ops::GEMM_RAW_SMEM_BYTES). ptxas (nvcc 13.0.88,
// sm_90a): 168 registers, no spills; the producer branch after setmaxnreg 40 uses
// registers up to R35; per K tile a producer thread issues 144 shared byte loads,
// 128 I2F + 128 FMUL and 16 16-byte stores (SASS), against the ~1,400 cycles a stage
// takes at 790 TFLOP/s.
//
// Launch: persistent, grid min(tiles, SMs) with tiles = ceil(M/128) * ceil(N/256)
// (gated: ceil(M/128) * ceil(n_ffn/128)),
// block 384, dynamic shared memory ops::GEMM_EPI_SMEM_BYTES (the stages, the
// mbarriers, the epilogue buffers; the QKV and LM-head kernels GEMM_SMEM_BYTES, no epilogue
// buffers) (one block per SM); block b
// takes tiles b, b + grid, ... in an order of groups of GEMM_GROUP_M row tiles,
// so that the tiles in flight share their A and B tiles through L2; the
// producer loads the next tile's first stages during this tile's epilogue.
#include "sm90a.cuh"

#define GEMM_THREADS 384
// The producer-dequant kernels (gemm_q4_0_wgmma*): GEMM_RAW_STAGES raw buffers of
// 256 rows x 48 bytes (sm90a.cuh GEMM_RAW_*), a K tile of Q4_0 being 36 bytes of a row.
#define GEMM_RAW_STAGES 2
#define GEMM_Q4_0_TILE_BYTES 36
#define GEMM_Q4_0_RAW_ROW_BYTES 48
static_assert(256 * GEMM_Q4_0_RAW_ROW_BYTES == GEMM_RAW_STAGE_BYTES, "a raw buffer holds 256 rows of 48 bytes");
static_assert(12 + GEMM_Q4_0_TILE_BYTES <= GEMM_Q4_0_RAW_ROW_BYTES, "a tile's bytes lie inside the 48-byte box (offset 0, 4, 8 or 12)");
// The epilogue's shared buffers (store_tma): after the stages and a 1 KiB block holding
// the mbarriers, 16 KiB per consumer warpgroup, 1024-byte aligned (128B swizzle).
#define GEMM_EPI_OFFSET (GEMM_STAGES * GEMM_STAGE_BYTES + 1024)
#define GEMM_EPI_CONSUMER_BYTES 16384
static_assert(2 * GEMM_STAGES * 8 <= 1024, "the mbarriers fit before the epilogue buffers");

// 16 bytes to shared memory (a producer-dequant B tile's chunk).
__device__ __forceinline__ void st_shared_b128(uint32_t addr, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// Tile `tile` of the grouped order: groups of GEMM_GROUP_M row tiles, column tiles
// (of tile_n output columns) within a group.
__device__ __forceinline__ void tile_origin(int tile, int m_tiles, int n_tiles, int tile_n, int& m0, int& n0) {
    const int per_group = GEMM_GROUP_M * n_tiles;
    const int group = tile / per_group, first_m = group * GEMM_GROUP_M;
    const int group_rows = min(m_tiles - first_m, GEMM_GROUP_M);
    const int in_group = tile % per_group;
    m0 = (first_m + in_group % group_rows) * GEMM_BM;
    n0 = (in_group / group_rows) * tile_n;
}

// RoPE on a consumer thread's accumulators (GemmParams' rope_*): what rope_tabled_f32
// does to y afterwards (rope.cu: the same table entry and rope_rotate's expression,
// fmul / fsub / fadd, so the same bits). The thread holds rows `row` and row + 8, columns
// col + 8j and col + 8j + 1 (j < 32); the tile's first column is a multiple of 256, so
// of d_head (256 % d_head == 0: the launcher's rule), and a column's place in its head
// is (col + 8j) % d_head. Normal pairs (2i, 2i + 1) are a thread's two adjacent
// columns; neox pairs (i, i + n_rot/2) are columns 8j + e and 8(j + HJ) + e of the same
// thread with HJ = n_rot/16 (n_rot % 16 == 0), a compile-time register offset. Columns
// past n_rot, past N, and rows past M are left as they are.
template <int HJ>
__device__ __forceinline__ void gemm_rope_acc(const GemmParams& p, float (&d)[128], int row, int col) {
    const int half_rot = p.rope_n_rot / 2, head_mask = p.rope_d_head - 1;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row + 8 * h;
        if (r >= p.m) continue;
        const float2* tr = p.rope_table + (long long)p.rope_pos[r % p.rope_n_per_seq] * half_rot;
        if constexpr (HJ == 0) {
#pragma unroll
            for (int j = 0; j < 32; ++j) {
                const int n = col + 8 * j, c = n & head_mask;
                if (n < p.n && c < p.rope_n_rot) {
                    const float2 cs = tr[c / 2];
                    const float x0 = d[4 * j + 2 * h], x1 = d[4 * j + 2 * h + 1];
                    d[4 * j + 2 * h] = fsub(fmul(x0, cs.x), fmul(x1, cs.y));
                    d[4 * j + 2 * h + 1] = fadd(fmul(x0, cs.y), fmul(x1, cs.x));
                }
            }
        } else {
            // A column below n_rot/2 has j % (d_head/8) < HJ <= (d_head/8)/2, so its
            // partner j + HJ < 32 and is not itself below n_rot/2 (rotated once).
#pragma unroll
            for (int j = 0; j + HJ < 32; ++j) {
                const int n = col + 8 * j, c = n & head_mask;
                if (n < p.n && c < half_rot) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float2 cs = tr[c + e];
                        const float x0 = d[4 * j + 2 * h + e], x1 = d[4 * (j + HJ) + 2 * h + e];
                        d[4 * j + 2 * h + e] = fsub(fmul(x0, cs.x), fmul(x1, cs.y));
                        d[4 * (j + HJ) + 2 * h + e] = fadd(fmul(x0, cs.y), fmul(x1, cs.x));
                    }
                }
            }
        }
    }
}

// gemm_rope_acc with its register offset: mode 0 (normal), or neox with n_rot 16-256.
__device__ __forceinline__ void gemm_rope(const GemmParams& p, float (&d)[128], int row, int col) {
    if (p.rope_mode == 0) {
        gemm_rope_acc<0>(p, d, row, col);
        return;
    }
    switch (p.rope_n_rot / 16) {
        case 1: gemm_rope_acc<1>(p, d, row, col); break;
        case 2: gemm_rope_acc<2>(p, d, row, col); break;
        case 4: gemm_rope_acc<4>(p, d, row, col); break;
        case 8: gemm_rope_acc<8>(p, d, row, col); break;
        case 16: gemm_rope_acc<16>(p, d, row, col); break;
        default: break;  // not launched (ops::gemm_rope_fits)
    }
}

// The tile loop, shared by the plain GEMM (GATED false: y = x · Wᵀ or y += it,
// P = GemmParams) and the gated one (GATED true, P = GemmGatedParams: each B
// stage is 128 rows of Wg then the same 128 rows of Wu, so a consumer holds
// gate columns in d[0..64) and the matching up columns in d[64..128), and the
// epilogue writes bf16(act(gate) * up) for 128 output columns a tile), and the
// QKV one (QKV true, P = GemmQkvParams: the plain tile loop, each column stored
// to its projection's matrix, plus its bias).
template <bool GATED, int ACT, bool QKV, typename P, bool DQ = false>
__device__ __forceinline__ void gemm_tiles(const P& p) {
    extern __shared__ uint8_t gemm_smem_raw[];
    // Output columns a tile covers: 256, or 128 when gated (256 B rows: gate and up halves).
    constexpr int TILE_N = GATED ? GEMM_BN / 2 : GEMM_BN;
    int n_out;
    if constexpr (GATED) {
        n_out = p.n_ffn;
    } else {
        n_out = p.n;
    }
    const int m_tiles = (p.m + GEMM_BM - 1) / GEMM_BM, n_tiles = (n_out + TILE_N - 1) / TILE_N;
    const int k_tiles = (p.k + GEMM_BK - 1) / GEMM_BK;
    // Work item = tile of the grouped order (tile_origin).
    auto load = [&](int tile, int kt, uint32_t a_stage, uint32_t b_stage, uint32_t full) {
        int m0, n0;
        tile_origin(tile, m_tiles, n_tiles, TILE_N, m0, n0);
        tma_load_2d(a_stage, &p.a, full, kt * GEMM_BK, m0);
        if constexpr (DQ) {
            // The B tile is the producer's (load_raw, convert).
        } else if constexpr (GATED) {
            tma_load_2d(b_stage, &p.b_gate, full, kt * GEMM_BK, n0);
            tma_load_2d(b_stage + GEMM_B_STAGE_BYTES / 2, &p.b_up, full, kt * GEMM_BK, n0);
        } else {
            tma_load_2d(b_stage, &p.b, full, kt * GEMM_BK, n0);
        }
    };
    auto epilogue = [&](int tile, int c, int warp, int lane, float (&d)[128]) {
        int m0, n0;
        tile_origin(tile, m_tiles, n_tiles, TILE_N, m0, n0);
        const int row = m0 + c * 64 + warp * 16 + lane / 4;
        const int col = n0 + 2 * (lane % 4);
        // store_tma: consumer c's 64 rows through its 16 KiB shared buffer (row r of
        // the consumer's block is warp * 16 + lane / 4 + 8 h).
        if constexpr (!GATED && !QKV) {
            if (p.rope_n_rot > 0) gemm_rope(p, d, row, col);
        }
        const uint32_t epi = ((smem_addr(gemm_smem_raw) + 1023u) & ~1023u) + GEMM_EPI_OFFSET + c * GEMM_EPI_CONSUMER_BYTES;
        const bool leader = warp == 0 && lane == 0;
        const uint32_t r_lo = warp * 16 + lane / 4, t2 = 2 * (lane % 4);
        const int row0 = m0 + c * 64;
        if constexpr (!QKV && !DQ) {
            if (p.store_tma) {
                if constexpr (GATED) {
                    // Two 64 x 64 bf16 boxes (128-byte rows); the buffer's last copy
                    // (the previous tile's) has long been read.
                    if (leader) bulk_wait_group_read<0>();
                    named_barrier_sync(1 + c, 128);
#pragma unroll
                    for (int j = 0; j < 16; ++j) {
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const float o0 = fmul(act<ACT>(d[4 * j + 2 * h]), d[4 * (j + 16) + 2 * h]);
                            const float o1 = fmul(act<ACT>(d[4 * j + 2 * h + 1]), d[4 * (j + 16) + 2 * h + 1]);
                            const uint32_t off = (j / 8) * 8192u + sw128_offset(r_lo + 8 * h, ((j % 8) * 8 + t2) * 2);
                            st_shared_u32(epi + off, pack_bf16x2(o0, o1));
                        }
                    }
                    fence_proxy_async_shared();
                    named_barrier_sync(1 + c, 128);
                    if (leader) {
                        if (row0 < p.m) {
                            tma_store_2d(&p.out_map, epi, n0, row0);
                            if (n0 + 64 < p.n_ffn) tma_store_2d(&p.out_map, epi + 8192, n0 + 64, row0);
                        }
                        bulk_commit_group();
                    }
                } else {
                    // Eight 64 x 32 f32 boxes (128-byte rows) through two 8 KiB halves:
                    // before writing a half, the copy issued from it two boxes ago
                    // has read it (at most one group, the other half's, in flight).
#pragma unroll
                    for (int q = 0; q < 8; ++q) {
                        const uint32_t buf = epi + (q & 1) * 8192u;
                        if (leader) bulk_wait_group_read<1>();
                        named_barrier_sync(1 + c, 128);
#pragma unroll
                        for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
                            for (int h = 0; h < 2; ++h) {
                                const int j = 4 * q + jj;
                                st_shared_f32x2(buf + sw128_offset(r_lo + 8 * h, (jj * 8 + t2) * 4), d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
                            }
                        }
                        fence_proxy_async_shared();
                        named_barrier_sync(1 + c, 128);
                        if (leader) {
                            if (row0 < p.m && n0 + 32 * q < p.n) {
                                if (p.accumulate) {
                                    tma_reduce_add_2d(&p.y_map, buf, n0 + 32 * q, row0);
                                } else {
                                    tma_store_2d(&p.y_map, buf, n0 + 32 * q, row0);
                                }
                            }
                            bulk_commit_group();
                        }
                    }
                }
                return;
            }
        }
        if constexpr (GATED) {
            // Column block j < 16 of the accumulators is gate, j + 16 the same columns of up.
#pragma unroll
            for (int j = 0; j < 16; ++j) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = row + 8 * h;
                    const int n = col + 8 * j;
                    if (r < p.m && n < p.n_ffn) {
                        const float o0 = fmul(act<ACT>(d[4 * j + 2 * h]), d[4 * (j + 16) + 2 * h]);
                        const float o1 = fmul(act<ACT>(d[4 * j + 2 * h + 1]), d[4 * (j + 16) + 2 * h + 1]);
                        // n_ffn even: n + 1 < n_ffn whenever n < n_ffn.
                        *reinterpret_cast<__nv_bfloat162*>(p.out + (long long)r * p.ldo + n) = __floats2bfloat162_rn(o0, o1);
                    }
                }
            }
        } else if constexpr (QKV) {
            // Columns come in even pairs and every segment boundary is even: a pair
            // never straddles two projections.
#pragma unroll
            for (int j = 0; j < 32; ++j) {
                const int n = col + 8 * j;
                if (n >= p.n) continue;
                const int s = n >= p.col2 ? 2 : (n >= p.col1 ? 1 : 0);
                const int c0 = s == 2 ? p.col2 : (s == 1 ? p.col1 : 0);
                const int width = (s == 2 ? p.n : (s == 1 ? p.col2 : p.col1)) - c0;
                float* ys = p.y[s];
                const float* bs = p.bias[s];
                const float b0 = bs ? bs[n - c0] : 0.0f, b1 = bs ? bs[n - c0 + 1] : 0.0f;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = row + 8 * h;
                    if (r < p.m) {
                        float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
                        if (bs) {
                            v0 = fadd(v0, b0);
                            v1 = fadd(v1, b1);
                        }
                        *reinterpret_cast<float2*>(ys + (long long)r * width + (n - c0)) = make_float2(v0, v1);
                    }
                }
            }
        } else {
#pragma unroll
            for (int j = 0; j < 32; ++j) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = row + 8 * h;
                    const int n = col + 8 * j;
                    if (r < p.m && n < p.n) {
                        float* yr = p.y + (long long)r * p.ldy + n;
                        float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
                        if (p.y_pairs && n + 1 < p.n) {
                            if (p.accumulate) {
                                const float2 old = *reinterpret_cast<const float2*>(yr);
                                v0 = __fadd_rn(old.x, v0);
                                v1 = __fadd_rn(old.y, v1);
                            }
                            *reinterpret_cast<float2*>(yr) = make_float2(v0, v1);
                        } else {
                            yr[0] = p.accumulate ? __fadd_rn(yr[0], v0) : v0;
                            if (n + 1 < p.n) yr[1] = p.accumulate ? __fadd_rn(yr[1], v1) : v1;
                        }
                    }
                }
            }
        }
    };
    if constexpr (DQ) {
        // Q4_0 raw rows: K tile kt is blocks 2kt, 2kt + 1 of a row, bytes [36 kt, 36 kt + 36),
        // fetched as the 48-byte box from the 16-byte unit that holds byte 36 kt (the box's
        // inner size must be a multiple of 16 bytes), B rows 0-127 then 128-255 (gated: Wg
        // then Wu rows), each raw row at 48 r.
        auto load_raw = [&](int tile, int kt, uint32_t raw, uint32_t bar) {
            int m0, n0;
            tile_origin(tile, m_tiles, n_tiles, TILE_N, m0, n0);
            const int c0 = (kt * GEMM_Q4_0_TILE_BYTES) & ~15;
            if constexpr (GATED) {
                tma_load_2d(raw, &p.b_gate, bar, c0, n0);
                tma_load_2d(raw + GEMM_RAW_STAGE_BYTES / 2, &p.b_up, bar, c0, n0);
            } else {
                tma_load_2d(raw, &p.b, bar, c0, n0);
                tma_load_2d(raw + GEMM_RAW_STAGE_BYTES / 2, &p.b, bar, c0, n0 + GEMM_BN / 2);
            }
        };
        // Producer thread t writes B rows t and t + 128: its 8 groups of 8 elements
        // dequantized by dequant8 from the raw row (the same code and rounding as
        // dequant_bf16_q4_0), as 16-byte chunks at their 128B-swizzle place.
        const uint32_t smem_base = smem_addr(gemm_smem_raw);
        auto convert = [&](int, int kt, uint32_t raw, uint32_t b_stage, int tid) {
            const uint32_t o = (uint32_t)(kt * GEMM_Q4_0_TILE_BYTES) & 15u;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint32_t r = (uint32_t)tid + 128u * h;
                const uint8_t* row = gemm_smem_raw + (raw - smem_base) + r * GEMM_Q4_0_RAW_ROW_BYTES + o;
#pragma unroll
                for (int g = 0; g < GEMM_BK / 8; ++g) {
                    float v[8];
                    dequant8<FMT_Q4_0>(row, g, v);
                    const uint4 q = pack_bf16x8(v);
                    st_shared_b128(b_stage + sw128_offset(r, 16u * g), q);
                }
            }
        };
        wgmma_pipeline<GEMM_RAW_STAGES>(gemm_smem_raw, m_tiles * n_tiles, k_tiles, load, epilogue, load_raw, convert);
    } else {
        wgmma_pipeline(gemm_smem_raw, m_tiles * n_tiles, k_tiles, load, epilogue);
    }
    if constexpr (!QKV && !DQ) {
        // Each consumer's leader: its last copies have written global memory (and read
        // shared memory) before the block exits.
        if (p.store_tma && threadIdx.x >= 128 && threadIdx.x % 128 == 0) bulk_wait_group<0>();
    }
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1) gemm_bf16_wgmma(const __grid_constant__ GemmParams p) {
    gemm_tiles<false, 0, false>(p);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
    gemm_bf16_wgmma_gated_silu(const __grid_constant__ GemmGatedParams p) {
    gemm_tiles<true, ACT_SILU, false>(p);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
    gemm_bf16_wgmma_gated_gelu(const __grid_constant__ GemmGatedParams p) {
    gemm_tiles<true, ACT_GELU, false>(p);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1) gemm_bf16_wgmma_qkv(const __grid_constant__ GemmQkvParams p) {
    gemm_tiles<false, 0, true>(p);
}

// One row's share of an LM-head tile (gemm_bf16_wgmma_lmhead): the thread's 64 columns
// col + 8j + e of accumulator row H (0: rows g, 1: g + 8), the quad's max m over those
// below n (FULL: all are) and the sum of 2^((x - m) log2 e), both the same in the 4 lanes.
template <bool FULL, int H>
__device__ __forceinline__ float2 lmhead_row(const float (&d)[128], int col, int n) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            if (FULL || col + 8 * j + e < n) mx = fmaxf(mx, d[4 * j + 2 * H + e]);
        }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float base = mx == -INFINITY ? 0.0f : mx;
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            if (FULL || col + 8 * j + e < n) s += exp2_approx(__fmul_rn(__fsub_rn(d[4 * j + 2 * H + e], base), LOG2E));
        }
    }
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    return make_float2(mx, s);
}

// The LM head reduced in the epilogue (see the header): one (max, sum of exp) pair per row
// and 256-column tile, and the target's logit.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1) gemm_bf16_wgmma_lmhead(const __grid_constant__ GemmLmParams p) {
    extern __shared__ uint8_t gemm_smem_raw[];
    const int m_tiles = (p.m + GEMM_BM - 1) / GEMM_BM, n_tiles = (p.n + GEMM_BN - 1) / GEMM_BN;
    const int k_tiles = (p.k + GEMM_BK - 1) / GEMM_BK;
    auto load = [&](int tile, int kt, uint32_t a_stage, uint32_t b_stage, uint32_t full) {
        int m0, n0;
        tile_origin(tile, m_tiles, n_tiles, GEMM_BN, m0, n0);
        tma_load_2d(a_stage, &p.a, full, kt * GEMM_BK, m0);
        tma_load_2d(b_stage, &p.b, full, kt * GEMM_BK, n0);
    };
    auto epilogue = [&](int tile, int c, int warp, int lane, float (&d)[128]) {
        int m0, n0;
        tile_origin(tile, m_tiles, n_tiles, GEMM_BN, m0, n0);
        const int row = m0 + c * 64 + warp * 16 + lane / 4;
        const int col = n0 + 2 * (lane % 4);
        const bool full = n0 + GEMM_BN <= p.n;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row + 8 * h;
            float2 ms;
            if (full) {
                ms = h == 0 ? lmhead_row<true, 0>(d, col, p.n) : lmhead_row<true, 1>(d, col, p.n);
            } else {
                ms = h == 0 ? lmhead_row<false, 0>(d, col, p.n) : lmhead_row<false, 1>(d, col, p.n);
            }
            if (r >= p.m) continue;
            if (lane % 4 == 0) p.part[(long long)r * p.n_parts + n0 / GEMM_BN] = ms;
            // The target's column is this thread's column col + 8 jt + et when off = t - col
            // is below 256, not negative, and off % 8 < 2; the select over the unrolled
            // j keeps the accumulators in registers (a run-time index would send them to
            // local memory). Rarely taken: one tile in n_parts holds a row's target.
            const int off = p.targets[r] - col;
            if (off >= 0 && off < GEMM_BN && (off & 6) == 0 && col + off < p.n) {
                const int jt = off >> 3, et = off & 1;
                float tl = 0.0f;
#pragma unroll
                for (int j = 0; j < 32; ++j) {
                    if (j == jt) tl = et ? d[4 * j + 2 * h + 1] : d[4 * j + 2 * h];
                }
                p.target_logit[r] = tl;
            }
        }
    };
    wgmma_pipeline(gemm_smem_raw, m_tiles * n_tiles, k_tiles, load, epilogue);
}

// The producer-dequant variants (Q4_0 weights: p.b, or p.b_gate / p.b_up, are tensor
// maps over the stored blocks, uint8 (row_bytes, N), box (48, 128), no swizzle).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1) gemm_q4_0_wgmma(const __grid_constant__ GemmParams p) {
    gemm_tiles<false, 0, false, GemmParams, true>(p);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
    gemm_q4_0_wgmma_gated_silu(const __grid_constant__ GemmGatedParams p) {
    gemm_tiles<true, ACT_SILU, false, GemmGatedParams, true>(p);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
    gemm_q4_0_wgmma_gated_gelu(const __grid_constant__ GemmGatedParams p) {
    gemm_tiles<true, ACT_GELU, false, GemmGatedParams, true>(p);
}
