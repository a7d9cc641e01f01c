// sm90a.cuh: Hopper (sm_90a) primitives shared by the *_sm90a.cu modules:
// shared-memory addresses, mbarriers, TMA 2-D tile loads, the 128-byte-swizzle
// K-major shared-memory matrix descriptor and the wgmma fence / commit / wait.
// Include only from *_sm90a.cu (build.rs compiles those for compute_90a).
// The descriptor layout is documented in gemm_sm90a.cu's header.
#pragma once
#include "common.cuh"

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Waits until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_LOOP:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_LOOP;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// One 2-D tile of a tensor map into shared memory; c0 is the inner (K) coordinate.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const TmaDesc* map, uint32_t bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
        : "memory");
}

__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// --- moe4 ---
// D(64 x 256, f32) += A(64 x 16, bf16, K-major, smem) * B(256 x 16, bf16, K-major, smem)ᵀ,
// both operands from 128-byte-swizzled shared memory (sw128_desc). The operand list is
// written out by a macro. The dense GEMM (gemm_sm90a.cu) and the expert GEMMs (moe_sm90a.cu)
// both issue it.
#define SM90A_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define SM90A_D32(i) SM90A_D8(i), SM90A_D8(i + 8), SM90A_D8(i + 16), SM90A_D8(i + 24)
__device__ __forceinline__ void wgmma_bf16_m64n256k16(float d[128], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, 0, 0;\n"
        "}\n"
        : SM90A_D32(0), SM90A_D32(32), SM90A_D32(64), SM90A_D32(96)
        : "l"(desc_a), "l"(desc_b), "r"(1)
        : "memory");
}
#undef SM90A_D32
#undef SM90A_D8

// Keeps the compiler from moving accumulator accesses across an asynchronous wgmma.
template <int N>
__device__ __forceinline__ void wgmma_fence_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// --- end moe4 ---

// --- wgmma GEMM pipeline (gemm_sm90a.cu, moe_sm90a.cu) ---
// Generic-proxy shared-memory writes made visible to the async proxy (the TMA, wgmma); each
// writing thread, before the barrier that precedes the copy.
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Named barrier `id` (1..15; 0 is __syncthreads) over `n_threads` threads (a multiple of 32).
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t n_threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n_threads) : "memory");
}

// The warp-specialized main loop of both GEMM families. Block tile GEMM_BM x
// GEMM_BN x GEMM_BK (common.cuh), GEMM_STAGES shared-memory stages of (A
// GEMM_BM x GEMM_BK + B GEMM_BN x GEMM_BK) bf16 from 1024-byte-aligned dynamic
// shared memory (the launcher adds 1 KiB of slack), then a "full" mbarrier (the
// producer's expect_tx) and an "empty" one (one arrival per consumer
// warpgroup) per stage. Block of 384 threads: warpgroup 0 produces (thread 0
// issues the stage's TMA copies through `load`, after the stage's "empty"
// phase), warpgroups 1 and 2 consume, consumer c owning rows 64c..64c+63 of the
// tile x 256 columns (128 f32 accumulators a thread), issuing
// wgmma.mma_async.m64n256k16 from the swizzled stages (GEMM_BK / 16 a K tile),
// one wgmma group in flight, releasing a stage once the group that read it has
// retired; setmaxnreg moves registers from the producer to the consumers.
// Persistent over work items: block b takes items b, b + gridDim.x, ...; `it`
// counts the block's K tiles over all its items (stage it % GEMM_STAGES, phase
// (it / GEMM_STAGES) & 1), so the producer runs ahead into the next item while
// the consumers store this one.
//   load(item, kt, a_stage, b_stage, full): the TMA copies of K tile kt of item
//     into the stage at a_stage / b_stage, completing on `full`
//     (GEMM_STAGE_BYTES in all; with RAW > 0 the A tile alone, GEMM_A_STAGE_BYTES);
//   epilogue(item, c, warp, lane, d): stores consumer c's accumulators `d` of
//     the item (the m64nNk16 layout: warp w holds rows 16w..16w+15; lane (g =
//     lane/4, t = lane%4) rows g and g+8, columns 8j+2t, 8j+2t+1 for j < 32).
// RAW > 0 (gemm6: the weight's stored blocks dequantized by the producer): the B
// tile is not copied but written by the producer warpgroup. A ring of RAW raw
// buffers of GEMM_RAW_STAGE_BYTES (after the mbarrier block, at
// GEMM_RAW_OFFSET) holds the stored bytes of the B rows of K tiles it .. it +
// RAW - 1, each completing on its own "raw" mbarrier (after full and empty);
// thread 0 issues load_raw(item, kt, raw, raw_full) RAW tiles ahead and the A
// copy of the tile; then all 128 producer threads wait on the tile's raw
// buffer, call convert(item, kt, raw, b_stage, tid) (each writes its share of
// the 128B-swizzled bf16 B tile with generic stores), fence those stores for the
// async proxy (wgmma reads them) and arrive on "full" (1 + 128 arrivals); a
// named barrier (id 3) among them frees the raw buffer for the next copy.
#define GEMM_A_STAGE_BYTES (GEMM_BM * GEMM_BK * 2)
#define GEMM_B_STAGE_BYTES (GEMM_BN * GEMM_BK * 2)
#define GEMM_STAGE_BYTES (GEMM_A_STAGE_BYTES + GEMM_B_STAGE_BYTES)
static_assert(GEMM_A_STAGE_BYTES == 16384, "A stage is 16 KiB");
static_assert(GEMM_B_STAGE_BYTES == 32768, "B stage is 32 KiB");

// The raw ring of RAW > 0 (see above): after the stages and the 1 KiB mbarrier block.
#define GEMM_RAW_OFFSET (GEMM_STAGES * GEMM_STAGE_BYTES + 1024)
#define GEMM_RAW_STAGE_BYTES 12288

// The load_raw / convert of a pipeline without a producer dequant (RAW == 0): never called.
struct NoRawLoad {
    __device__ void operator()(int, int, uint32_t, uint32_t) const {}
    __device__ void operator()(int, int, uint32_t, uint32_t, int) const {}
};

template <int RAW = 0, class Load, class Epilogue, class LoadRaw = NoRawLoad, class Convert = NoRawLoad>
__device__ __forceinline__ void wgmma_pipeline(uint8_t* smem_raw, int n_items, int k_tiles, Load load, Epilogue epilogue,
                                               LoadRaw load_raw = {}, Convert convert = {}) {
    static_assert(RAW == 0 || 2 * GEMM_STAGES * 8 + RAW * 8 <= 1024, "the raw mbarriers fit in the mbarrier block");
    const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const uint32_t a_base = base;
    const uint32_t b_base = base + GEMM_STAGES * GEMM_A_STAGE_BYTES;
    const uint32_t bar_base = base + GEMM_STAGES * GEMM_STAGE_BYTES;  // full[s] then empty[s], 8 bytes each
    const int warpgroup = threadIdx.x / 128;
    const int tid_wg = threadIdx.x % 128;

    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < GEMM_STAGES; ++s) {
            mbar_init(bar_base + 8 * s, RAW > 0 ? 1 + 128 : 1);
            mbar_init(bar_base + 8 * (GEMM_STAGES + s), 2);
        }
#pragma unroll
        for (int r = 0; r < RAW; ++r) mbar_init(bar_base + 8 * (2 * GEMM_STAGES + r), 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if constexpr (RAW > 0) {
            const uint32_t raw_base = base + GEMM_RAW_OFFSET;
            const uint32_t raw_bar = bar_base + 8 * 2 * GEMM_STAGES;
            // This block's items are blockIdx.x + i * gridDim.x; its K tiles are numbered over all of them.
            const int n_mine = (int)blockIdx.x < n_items ? (n_items - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
            const uint32_t total = (uint32_t)n_mine * (uint32_t)k_tiles;
            auto issue_raw = [&](uint32_t j) {
                const uint32_t r = j % RAW;
                mbar_arrive_expect_tx(raw_bar + 8 * r, GEMM_RAW_STAGE_BYTES);
                load_raw((int)blockIdx.x + (int)(j / k_tiles) * (int)gridDim.x, (int)(j % k_tiles), raw_base + r * GEMM_RAW_STAGE_BYTES,
                         raw_bar + 8 * r);
            };
            if (tid_wg == 0) {
                for (uint32_t j = 0; j < (uint32_t)RAW && j < total; ++j) issue_raw(j);
            }
            for (uint32_t it = 0; it < total; ++it) {
                const int item = (int)blockIdx.x + (int)(it / k_tiles) * (int)gridDim.x, kt = (int)(it % k_tiles);
                const uint32_t s = it % GEMM_STAGES, r = it % RAW;
                mbar_wait(bar_base + 8 * (GEMM_STAGES + s), ((it / GEMM_STAGES) & 1) ^ 1);
                const uint32_t full = bar_base + 8 * s;
                if (tid_wg == 0) {
                    mbar_arrive_expect_tx(full, GEMM_A_STAGE_BYTES);
                    load(item, kt, a_base + s * GEMM_A_STAGE_BYTES, b_base + s * GEMM_B_STAGE_BYTES, full);
                }
                mbar_wait(raw_bar + 8 * r, (it / RAW) & 1);
                convert(item, kt, raw_base + r * GEMM_RAW_STAGE_BYTES, b_base + s * GEMM_B_STAGE_BYTES, tid_wg);
                fence_proxy_async_shared();
                mbar_arrive(full);
                named_barrier_sync(3, 128);  // every producer thread has read raw buffer r
                if (tid_wg == 0 && it + RAW < total) issue_raw(it + RAW);
            }
        } else if (tid_wg == 0) {
            uint32_t it = 0;
            for (int item = blockIdx.x; item < n_items; item += gridDim.x) {
                for (int kt = 0; kt < k_tiles; ++kt, ++it) {
                    const uint32_t s = it % GEMM_STAGES;
                    mbar_wait(bar_base + 8 * (GEMM_STAGES + s), ((it / GEMM_STAGES) & 1) ^ 1);
                    const uint32_t full = bar_base + 8 * s;
                    mbar_arrive_expect_tx(full, GEMM_STAGE_BYTES);
                    load(item, kt, a_base + s * GEMM_A_STAGE_BYTES, b_base + s * GEMM_B_STAGE_BYTES, full);
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
        const int c = warpgroup - 1;
        const int warp = tid_wg / 32, lane = tid_wg % 32;
        uint32_t it = 0;
        for (int item = blockIdx.x; item < n_items; item += gridDim.x) {
            float d[128];
#pragma unroll
            for (int i = 0; i < 128; ++i) d[i] = 0.0f;
            for (int kt = 0; kt < k_tiles; ++kt, ++it) {
                const uint32_t s = it % GEMM_STAGES;
                mbar_wait(bar_base + 8 * s, (it / GEMM_STAGES) & 1);
                const uint64_t da = sw128_desc(a_base + s * GEMM_A_STAGE_BYTES + c * 64 * 128);
                const uint64_t db = sw128_desc(b_base + s * GEMM_B_STAGE_BYTES);
                wgmma_fence_regs(d);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < GEMM_BK / 16; ++kk) wgmma_bf16_m64n256k16(d, da + 2 * kk, db + 2 * kk);
                wgmma_commit();
                wgmma_wait<1>();  // the group of K tile it-1 has retired: its stage is free
                wgmma_fence_regs(d);
                if (kt > 0 && tid_wg == 0) mbar_arrive(bar_base + 8 * (GEMM_STAGES + (it - 1) % GEMM_STAGES));
            }
            wgmma_wait<0>();
            wgmma_fence_regs(d);
            if (tid_wg == 0) mbar_arrive(bar_base + 8 * (GEMM_STAGES + (it - 1) % GEMM_STAGES));
            epilogue(item, c, warp, lane, d);
        }
    }
}
// --- end wgmma GEMM pipeline ---

// --- gemm5 ---
// Epilogues through shared memory and the tensor-memory accelerator: the
// consumer threads write a tile into a 128-byte-swizzled shared buffer
// (sw128_offset: the layout a SWIZZLE_128B tensor map expects, buffer
// 1024-byte aligned, rows of 128 bytes), fence it for the async proxy, and one
// thread hands it to the TMA (a store, or an f32 add into global memory), then
// waits on the bulk group only before it writes that buffer again.

// Byte offset of byte `byte_in_row` (< 128) of row `row` in a 128B-swizzled tile:
// the 16-byte chunk index XOR row % 8.
__device__ __forceinline__ uint32_t sw128_offset(uint32_t row, uint32_t byte_in_row) {
    return row * 128u + (byte_in_row ^ ((row & 7u) << 4));
}

__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ void st_shared_f32x2(uint32_t addr, float a, float b) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(a), "f"(b) : "memory");
}


// The box of a 2-D tensor map at (c0 inner, c1) from shared memory at `src`; elements
// outside the tensor are not written.
__device__ __forceinline__ void tma_store_2d(const TmaDesc* map, uint32_t src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
                 "r"(src), "r"(c0), "r"(c1)
                 : "memory");
}

// global[box] += shared (element-wise, the map's type; f32: one correctly rounded add).
__device__ __forceinline__ void tma_reduce_add_2d(const TmaDesc* map, uint32_t src, int c0, int c1) {
    asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(src), "r"(c0), "r"(c1)
                 : "memory");
}

__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// Until at most N of this thread's bulk groups still read their shared source.
template <int N>
__device__ __forceinline__ void bulk_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

// Until at most N of this thread's bulk groups are incomplete (writes done).
template <int N>
__device__ __forceinline__ void bulk_wait_group() {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
// --- end gemm5 ---
