// attention_sm90a.cu: causal prefill attention on Hopper's wgmma tensor cores
// (kernel v3, sm_90a only), FlashAttention-3's design for a bf16 cache.
//
// attn_wgmma_d<D>_bf16_<out>(AttnWgmmaArgs), D = 64 or 128: the contract of
// attn_flash_* (kernels/attention.cu): query t of window s (position pos0 + t)
// of head h attends to the cached keys kp of KV head h / (n_heads / n_kv_heads)
// with kp <= pos0 + t and, when window > 0, pos0 + t - kp < window; the cache
// holds positions [0, pos0 + n_tokens) of every window (earlier passes plus this
// one); blockIdx.z = window of a batched pass; optional tanh soft-cap.
// Numerics: those of v2, so the default route's bounds hold unchanged: q (f32)
// rounded to bf16 (nearest even) when staged; S = Q·Kᵀ in f32; x = S * scale
// (or cap * tanh(S * scale / cap)) times log2(e), masked to -inf; online softmax
// in f32 (row max over the quad, exp2 by ex2.approx, l sums the unrounded f32
// probabilities); P rounded to bf16 for P·V; O in f32; output O / l. Only the
// order of the f32 sums inside the MMAs differs from v2.
//
// Algorithm: a block owns BM = 128 queries of one head and walks the key tiles
// of BN = 128 keys that any of them can see. Warp specialization (384 threads):
// warpgroup 0 is the producer (one thread; setmaxnreg gives its registers to
// the consumers): it fills ST = stages(D) stages of K and of V (4 at d 64, 2 at
// d 128), each BN rows x D
// bf16, by TMA (cp.async.bulk.tensor.3d over the cache seen as (d_head,
// kv_len, n_seqs * n_kv_heads): 128-byte swizzle, one box of 64 columns x BN
// rows per 64 columns of d_head, rows at or past kv_len = pos0 + n_tokens
// zero-filled by the TMA unit, so nothing past the cached positions is read),
// completing on the stage's full_k / full_v mbarriers, after waiting on the
// stage's empty_k / empty_v mbarrier (K and V released apart, so the next K
// streams in while this V is still read). Warpgroups 1 and 2 are consumers of 64 query rows
// each: Q is staged once into shared memory by the consumers (f32 -> bf16, laid
// out in the same 128-byte swizzle, then fence.proxy.async); per tile
//   S (64 x 128 f32, registers) = Q · Kᵀ: wgmma m64n128k16, Q and K from
//        shared memory (K-major descriptors), D / 16 k-steps, one commit group;
//   the softmax update in registers (rows g and g + 8 of each warp's 16, the
//        quad of 4 lanes holding a row);
//   O (64 x D f32, registers) += P · V: wgmma m64nDk16 with P as the register
//        A operand (the S accumulator layout is the A fragment layout, as with
//        mma.sync) and V as B from shared memory, MN-major (transpose bit):
//        leading byte offset = the distance between the 64-column boxes (BN *
//        128 bytes), stride byte offset = 1024 (8 keys);
// software-pipelined as in FlashAttention-3 (intra-warpgroup overlap): tile i's
// S is issued, then tile i - 1's P·V, and tile i's softmax runs on the CUDA
// cores while that P·V runs on the tensor cores (wait_group 1, then 0 before O
// is rescaled and P repacked); one arrival per consumer warp releases the K
// stage once S is done, the V stage once P·V is. Both warpgroups compute
// every tile of the block (masking decides what counts). Query tiles run in
// reverse order (the longest causal rows start first).
// Not covered here (the launcher sends them to v2): quantized caches, d_head 96
// and 256, misaligned q / out.
// Launch: grid (ceil(n_tokens / 128), n_heads, n_seqs), block 384, dynamic
// shared memory 1024 (alignment slack) + 128 * D * 2 (Q) + 2 * ST * 128 * D * 2
// (K, V) + 4 * ST * 8 (barriers): d 128 164928 bytes, d 64 148608.
// The launcher (ops::attention_v3) mirrors BM, BN and stages(D).
// CPU twin: backend::cpu::attention::attention on the same bf16-rounded q, k, v
// (tests/gpu_ops.rs attention_case).
#include "sm90a.cuh"

namespace attn3 {
constexpr int THREADS = 384;
constexpr int BM = 128;     // queries per block (2 consumer warpgroups of 64)
constexpr int BN = 128;     // keys per tile
constexpr int BOX = 64;     // columns per TMA box (128 bytes: the swizzle span)

// D(64 x 128, f32) += A(64 x 16, bf16, K-major, smem) * B(128 x 16, bf16, K-major, smem)ᵀ.
__device__ __forceinline__ void wgmma_ss_m64n128k16(float d[64], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(1)
        : "memory");
}

// D(64 x 128, f32) += A(64 x 16, bf16, registers) * B(16 x 128, bf16, MN-major smem: rows of 128 contiguous).
__device__ __forceinline__ void wgmma_rs_m64n128k16_tb(float d[64], const uint32_t a[4], uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1)
        : "memory");
}

// D(64 x 64, f32) += A(64 x 16, bf16, registers) * B(16 x 64, bf16, MN-major smem: rows of 64 contiguous).
__device__ __forceinline__ void wgmma_rs_m64n64k16_tb(float d[32], const uint32_t a[4], uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1)
        : "memory");
}

// Keeps the compiler from moving accumulator accesses across an asynchronous wgmma.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// One 3-D box of a tensor map into shared memory; c0 is the innermost coordinate.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const TmaDesc* map, uint32_t bar, int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}

// The 128-byte-swizzle descriptor of an MN-major operand (rows of 64 contiguous
// N-elements, 8-row swizzle atoms of 1024 bytes): leading byte offset = `lbo`,
// the distance between 64-element boxes along N; stride byte offset 1024, the
// distance between groups of 8 rows along K; layout type 1 (128B swizzle).
__device__ __forceinline__ uint64_t sw128_mn_desc(uint32_t addr, uint32_t lbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}

__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// K/V stages: 4 at d_head 64, 2 at 128 (shared memory: Q 32 KiB plus four 32 KiB
// stages at d 128 fill the 227 KiB a block may have).
__host__ __device__ constexpr int stages(int d) { return d <= 64 ? 4 : 2; }

template <int D, typename OUT>
__device__ __forceinline__ void attn_wgmma_impl(const AttnWgmmaArgs& a) {
    static_assert(D % BOX == 0 && (D == 64 || D == 128), "attn_wgmma: d_head 64 or 128");
    constexpr int ST = stages(D);
    constexpr int NB = D / BOX;           // 64-column boxes per row
    constexpr int KS = D / 16;            // k-steps of Q·Kᵀ
    constexpr int VS = BN / 16;           // k-steps of P·V
    constexpr int NS = BN / 8;            // 8-column accumulator chunks of S
    constexpr int NO = D / 8;             // of O
    constexpr uint32_t Q_BYTES = BM * D * 2;
    constexpr uint32_t KV_BYTES = BN * D * 2;  // one stage of K (or of V)
    extern __shared__ uint8_t attn3_smem[];
    // 1024-byte alignment for the 128-byte swizzle (the launcher adds 1 KiB of slack).
    const uint32_t base = (smem_addr(attn3_smem) + 1023u) & ~1023u;
    const uint32_t sq = base;                 // (NB boxes, BM rows, 64) bf16, swizzled
    const uint32_t sk = sq + Q_BYTES;         // (ST, NB, BN, 64) bf16, swizzled
    const uint32_t sv = sk + ST * KV_BYTES;   // (ST, NB, BN, 64) bf16, swizzled
    const uint32_t bars = sv + ST * KV_BYTES;  // full_k[ST], full_v[ST], empty_k[ST], empty_v[ST]
    auto full_k = [&](int s) { return bars + 8 * s; };
    auto full_v = [&](int s) { return bars + 8 * (ST + s); };
    auto empty_k = [&](int s) { return bars + 8 * (2 * ST + s); };
    auto empty_v = [&](int s) { return bars + 8 * (3 * ST + s); };

    const int t0 = (int)(gridDim.x - 1 - blockIdx.x) * BM;  // longest causal rows first
    const int h = blockIdx.y, seq = blockIdx.z;
    const int kvh = h / (a.n_heads / a.n_kv_heads);
    const int slab = seq * a.n_kv_heads + kvh;  // the tensor maps' outer coordinate
    const int n_tokens = a.n_tokens, pos0 = a.pos0, window = a.window;
    const int kv_len = pos0 + n_tokens;
    const int t_last = min(t0 + BM, n_tokens) - 1;
    const int tile_last = (pos0 + t_last) / BN;
    const int tile_first = window > 0 ? max(pos0 + t0 - window + 1, 0) / BN : 0;
    const int n_tiles = tile_last - tile_first + 1;
    const int warpgroup = threadIdx.x / 128, tid = threadIdx.x % 128;

    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < ST; ++s) {
            mbar_init(full_k(s), 1);  // the producer's expect_tx
            mbar_init(full_v(s), 1);
            mbar_init(empty_k(s), 8);  // one arrival per consumer warp
            mbar_init(empty_v(s), 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (warpgroup == 0) {
        // Producer: one thread issues every copy; a K (V) stage is reused once all 8
        // consumer warps have arrived on its empty_k (empty_v) barrier.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (tid == 0) {
            for (int i = 0; i < n_tiles; ++i) {
                const int s = i % ST, tile = tile_first + i;
                const uint32_t ph = ((i / ST) & 1) ^ 1;
                mbar_wait(empty_k(s), ph);
                mbar_arrive_expect_tx(full_k(s), KV_BYTES);
#pragma unroll
                for (int b = 0; b < NB; ++b) tma_load_3d(sk + s * KV_BYTES + b * BN * 128, &a.k, full_k(s), b * BOX, tile * BN, slab);
                mbar_wait(empty_v(s), ph);
                mbar_arrive_expect_tx(full_v(s), KV_BYTES);
#pragma unroll
                for (int b = 0; b < NB; ++b) tma_load_3d(sv + s * KV_BYTES + b * BN * 128, &a.v, full_v(s), b * BOX, tile * BN, slab);
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    const int c = warpgroup - 1;  // consumer: rows 64c .. 64c + 63 of the block
    const int warp = tid / 32, lane = tid % 32;
    const int g = lane >> 2, cq = 2 * (lane & 3);

    // Q: this warpgroup's 64 rows, f32 -> bf16 (nearest even), rows past n_tokens
    // zero, into the 128-byte swizzle: box b holds columns 64b .. 64b + 63, row r
    // at r * 128 bytes, its 16-byte chunk j at (j ^ (r % 8)) * 16.
    const float* qb = a.q + (long long)seq * n_tokens * a.q_stride + (long long)h * D;
    for (int i = tid; i < 64 * (D / 8); i += 128) {
        const int r = c * 64 + i / (D / 8), ch = i % (D / 8);
        const int t = t0 + r;
        float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (t < n_tokens) {
            const float4* src = reinterpret_cast<const float4*>(qb + (long long)t * a.q_stride + ch * 8);
            const float4 x0 = src[0], x1 = src[1];
            v[0] = x0.x, v[1] = x0.y, v[2] = x0.z, v[3] = x0.w;
            v[4] = x1.x, v[5] = x1.y, v[6] = x1.z, v[7] = x1.w;
        }
        st_shared_v4(sq + (ch / 8) * (BM * 128) + r * 128 + (((ch % 8) ^ (r & 7)) * 16), pack_bf16x8(v));
    }
    // The generic-proxy writes made visible to wgmma (the async proxy), then the warpgroup's barrier.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
    const float scale = a.scale, cap = a.softcap;
    const float scale_l2 = scale * LOG2E;
    const int row_w = t0 + c * 64 + warp * 16;  // the warp's first row (token)
    const int qp0 = pos0 + row_w + g;           // this thread's rows: positions qp0 and qp0 + 8
    const int qp_min = pos0 + row_w, qp_max = qp_min + 15;
    const uint64_t dq = sw128_desc(sq + c * 64 * 128);

    float sc[BN / 2];     // S of the tile being scored, then its probabilities
    uint32_t pa[VS][4];   // P of the previous tile, bf16, as the A fragments of its P·V
    // S = Q·Kᵀ of tile i (stage i % ST) issued as one commit group (not waited for).
    auto issue_s = [&](int i) {
#pragma unroll
        for (int j = 0; j < BN / 2; ++j) sc[j] = 0.f;
        const uint64_t dk = sw128_desc(sk + (i % ST) * KV_BYTES);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            const uint32_t qoff = (kk / 4) * (BM * 128) + (kk % 4) * 32;
            const uint32_t koff = (kk / 4) * (BN * 128) + (kk % 4) * 32;
            wgmma_ss_m64n128k16(sc, dq + (qoff >> 4), dk + (koff >> 4));
        }
        wgmma_commit();
    };
    // O += P·V of tile i (stage i % ST, P in pa) issued as one commit group.
    auto issue_pv = [&](int i) {
        const uint32_t vs = sv + (i % ST) * KV_BYTES;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < VS; ++kk) {
            const uint64_t dv = sw128_mn_desc(vs + kk * 16 * 128, BN * 128);
            if constexpr (D == 128) wgmma_rs_m64n128k16_tb(o, pa[kk], dv);
            else wgmma_rs_m64n64k16_tb(o, pa[kk], dv);
        }
        wgmma_commit();
    };
    // Scale, soft-cap, mask S of tile `tile` (v2's arithmetic); the online softmax
    // update of m and l; the probabilities left in sc; corr = the factor O needs.
    auto softmax = [&](int tile, float corr[2]) {
        const int kbase = tile * BN;
        const bool full = kbase + BN - 1 <= qp_min && kbase + BN <= kv_len && (window <= 0 || qp_max - kbase < window);
        float mx[2] = {m_run[0], m_run[1]};
#pragma unroll
        for (int j = 0; j < NS; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x;
                if (cap > 0.f) x = cap * tanhf(sc[4 * j + e] * scale / cap) * LOG2E;
                else x = sc[4 * j + e] * scale_l2;
                if (!full) {
                    const int kp = kbase + 8 * j + cq + (e & 1);
                    const int qp = qp0 + 8 * (e >> 1);
                    const bool vis = kp <= qp && kp < kv_len && (window <= 0 || qp - kp < window);
                    x = vis ? x : -INFINITY;
                }
                sc[4 * j + e] = x;
                mx[e >> 1] = fmaxf(mx[e >> 1], x);
            }
        }
        float base_r[2], rs[2] = {0.f, 0.f};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            base_r[r] = mx[r] == -INFINITY ? 0.f : mx[r];  // a row with nothing visible yet
            corr[r] = exp2_approx(m_run[r] - base_r[r]);    // 0 while m_run is -inf
            m_run[r] = mx[r];
        }
#pragma unroll
        for (int j = 0; j < NS; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = exp2_approx(sc[4 * j + e] - base_r[e >> 1]);
                sc[4 * j + e] = p;
                rs[e >> 1] += p;
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * corr[r] + rs[r];
    };
    // P of the scored tile as the A fragments of the 16-key steps: chunks 2kk and 2kk + 1.
    auto pack_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < VS; ++kk) {
            pa[kk][0] = pack_bf16x2(sc[8 * kk], sc[8 * kk + 1]);
            pa[kk][1] = pack_bf16x2(sc[8 * kk + 2], sc[8 * kk + 3]);
            pa[kk][2] = pack_bf16x2(sc[8 * kk + 4], sc[8 * kk + 5]);
            pa[kk][3] = pack_bf16x2(sc[8 * kk + 6], sc[8 * kk + 7]);
        }
    };
    auto rescale_o = [&](const float corr[2]) {
#pragma unroll
        for (int j = 0; j < NO; ++j) {
            o[4 * j] *= corr[0];
            o[4 * j + 1] *= corr[0];
            o[4 * j + 2] *= corr[1];
            o[4 * j + 3] *= corr[1];
        }
    };
    auto release = [&](uint32_t bar) {
        __syncwarp();
        if (lane == 0) mbar_arrive(bar);
    };

    // Software pipeline (FlashAttention-3's intra-warpgroup overlap): while tile i's
    // softmax runs on the CUDA cores, tile i - 1's P·V runs on the tensor cores.
    // Tile 0: S, its softmax (O is zero: no rescale).
    float corr[2];
    mbar_wait(full_k(0), 0);
    issue_s(0);
    wgmma_wait<0>();
    fence_regs(sc);
    release(empty_k(0));
    softmax(tile_first, corr);
    pack_p();
    for (int i = 1; i < n_tiles; ++i) {
        const int s = i % ST, sp = (i - 1) % ST;
        mbar_wait(full_k(s), (i / ST) & 1);
        issue_s(i);
        mbar_wait(full_v(sp), ((i - 1) / ST) & 1);
        issue_pv(i - 1);
        wgmma_wait<1>();  // S of tile i done (groups retire in order); P·V of i - 1 may run
        fence_regs(sc);
        release(empty_k(s));
        softmax(tile_first + i, corr);
        wgmma_wait<0>();  // P·V of tile i - 1 done: pa and o are free
        fence_regs(o);
        release(empty_v(sp));
        rescale_o(corr);
        pack_p();
    }
    {
        const int sp = (n_tiles - 1) % ST;
        mbar_wait(full_v(sp), ((n_tiles - 1) / ST) & 1);
        issue_pv(n_tiles - 1);
        wgmma_wait<0>();
        fence_regs(o);
        release(empty_v(sp));
    }

    // O / l per row.
    OUT* ob = reinterpret_cast<OUT*>(a.out) + (long long)seq * n_tokens * a.out_stride + (long long)h * D;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = l_run[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = 1.0f / l;
        const int t = row_w + g + 8 * r;
        if (t >= n_tokens) continue;
        OUT* orow = ob + (long long)t * a.out_stride + cq;
#pragma unroll
        for (int j = 0; j < NO; ++j) store2<OUT>(orow + 8 * j, o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
    }
}
}  // namespace attn3

// attn_wgmma_d<D>_bf16_<out>: a bf16 cache, f32 or bf16 output.
#define ATTN_WGMMA(D, outn, OUT)                                                                                 \
    extern "C" __global__ void __launch_bounds__(attn3::THREADS, 1) attn_wgmma_d##D##_bf16_##outn(              \
        const __grid_constant__ AttnWgmmaArgs a) {                                                               \
        attn3::attn_wgmma_impl<D, OUT>(a);                                                                       \
    }
ATTN_WGMMA(64, f32, float)
ATTN_WGMMA(64, bf16, bf16)
ATTN_WGMMA(128, f32, float)
ATTN_WGMMA(128, bf16, bf16)
