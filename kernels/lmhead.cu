// lmhead.cu: per-row reduction of a tile of FP32 logits, so that nothing
// vocabulary-sized leaves the GPU.
//
// The LM head runs in tiles of rows (positions): matmul_{bf16,f32}_<fmt>
// writes a (n_rows_tile, n_vocab) f32 logits tile into a scratch buffer on the
// device, then lmhead_reduce turns each row into:
//   row_max[r]      max_v logits[r, v]
//   row_sumexp[r]   sum_v exp(logits[r, v] - row_max[r])   (f64: exp and sum in double)
//   target_logit[r] logits[r, targets[r]] (NaN when targets[r] is outside [0, n_vocab))
//   topk_ids[r, :k], topk_logits[r, :k]: the k largest logits, ordered by
//                   (logit descending, id ascending); k <= 64 (0 skips it).
// The host forms log p(target) = target_logit - row_max - ln(row_sumexp) in f64.
// lmhead_merge (at the end) fills the same row_max, row_sumexp and target_logit from
// the per-tile pairs of gemm_bf16_wgmma_lmhead, the fast path that never writes logits.
//
// Algorithm: one block of 512 threads per row. One pass gives max and sum of
// exp (online: per-thread running max and f64 sum, rescaled as the max grows,
// float4 loads; block reductions; the row is read once, where the two-pass
// version, max then sum, read it twice). Top-k: radix select of the
// k-th largest key (floats mapped to order-preserving u32) in 4 passes of 8
// bits with a 256-bin shared histogram; then one ordered pass collects every
// key above the threshold and the lowest-id keys equal to it (block-wide
// ballot prefix sums keep id order, so ties are deterministic); the <= 64
// candidates are ranked in shared memory.
//
// Launch: grid (n_rows), block 512, static shared memory ~2.6 KiB.
#include "common.cuh"

#define LMH_THREADS 512
#define LMH_WARPS (LMH_THREADS / 32)
#define LMH_MAX_K 64

__device__ __forceinline__ uint32_t order_key(float f) {
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Adds x to a running (max m, sum s of exp(v - m)); -inf adds nothing, NaN
// makes s NaN (as exp(NaN - max) does in the sum).
__device__ __forceinline__ void lmh_online(float& m, double& s, float x) {
    if (x > m) {
        s = s * exp((double)m - (double)x) + 1.0;
        m = x;
    } else if (x != -INFINITY) {
        s += exp((double)x - (double)m);
    }
}

extern "C" __global__ void __launch_bounds__(LMH_THREADS)
    lmhead_reduce(const float* __restrict__ logits, long long ld, int n_vocab,
                  const int32_t* __restrict__ targets, int k, float* __restrict__ row_max,
                  double* __restrict__ row_sumexp, float* __restrict__ target_logit,
                  int32_t* __restrict__ topk_ids, float* __restrict__ topk_logits) {
    // logits: (n_rows, ld); targets, row_max, row_sumexp, target_logit: (n_rows);
    // topk_ids, topk_logits: (n_rows, k)
    __shared__ float scratch_f[32];
    __shared__ double scratch_d[32];
    __shared__ uint32_t hist[256];
    __shared__ uint32_t s_sel, s_remaining;
    __shared__ int warp_gt[LMH_WARPS], warp_eq[LMH_WARPS];
    __shared__ uint32_t cand_key[LMH_MAX_K];
    __shared__ int cand_id[LMH_MAX_K];
    __shared__ float cand_val[LMH_MAX_K];

    const int r = blockIdx.x, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const float* row = logits + r * ld;

    // One pass over the row: each thread keeps a running max m and sum s of
    // exp(x - m) (f64), rescaled when m grows; float4 loads when the row is
    // 16-byte aligned. Then the block max M (exact, order-free) and the sum of
    // s * exp(m - M). Same max, sum within f64 rounding of the two-pass form.
    float m = -INFINITY;
    double s = 0.0;
    if ((reinterpret_cast<uintptr_t>(row) & 15) == 0) {
        const float4* row4 = reinterpret_cast<const float4*>(row);
        const int n4 = n_vocab >> 2;
        for (int i = tid; i < n4; i += LMH_THREADS) {
            const float4 v = row4[i];
            lmh_online(m, s, v.x);
            lmh_online(m, s, v.y);
            lmh_online(m, s, v.z);
            lmh_online(m, s, v.w);
        }
        for (int i = (n4 << 2) + tid; i < n_vocab; i += LMH_THREADS) lmh_online(m, s, row[i]);
    } else {
        for (int i = tid; i < n_vocab; i += LMH_THREADS) lmh_online(m, s, row[i]);
    }
    const float mx = block_max(m, scratch_f);
    const double se = block_sum(m == -INFINITY ? 0.0 : s * exp((double)m - (double)mx), scratch_d);

    if (tid == 0) {
        row_max[r] = mx;
        row_sumexp[r] = se;
        const int t = targets[r];
        target_logit[r] = (t >= 0 && t < n_vocab) ? row[t] : __int_as_float(0x7fc00000);
    }
    if (k <= 0) return;

    // Radix select: after the 4 passes, prefix is the key of the k-th largest
    // element and `remaining` how many elements equal to it belong to the top k.
    uint32_t prefix = 0, mask = 0, remaining = (uint32_t)k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        if (tid < 256) hist[tid] = 0;
        __syncthreads();
        for (int i = tid; i < n_vocab; i += LMH_THREADS) {
            const uint32_t key = order_key(row[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            uint32_t cum = 0, sel = 0;
            for (int b = 255; b >= 0; --b) {
                const uint32_t c = hist[b];
                if (cum + c >= remaining) {
                    sel = (uint32_t)b;
                    break;
                }
                cum += c;
            }
            s_sel = sel;
            s_remaining = remaining - cum;
        }
        __syncthreads();
        prefix |= s_sel << shift;
        mask |= 255u << shift;
        remaining = s_remaining;
    }
    const uint32_t thresh = prefix;
    const int n_gt = k - (int)remaining;  // elements strictly above the threshold
    const int n_eq = (int)remaining;      // threshold-equal elements to take, lowest ids first

    // Ordered collection.
    int base_gt = 0, base_eq = 0;
    const uint32_t lt_mask = (1u << lane) - 1u;
    for (int base = 0; base < n_vocab; base += LMH_THREADS) {
        const int i = base + tid;
        const uint32_t key = i < n_vocab ? order_key(row[i]) : 0u;
        const bool gt = i < n_vocab && key > thresh;
        const bool eq = i < n_vocab && key == thresh;
        const uint32_t bg = __ballot_sync(0xffffffffu, gt), be = __ballot_sync(0xffffffffu, eq);
        if (lane == 0) {
            warp_gt[warp] = __popc(bg);
            warp_eq[warp] = __popc(be);
        }
        __syncthreads();
        int off_gt = base_gt + __popc(bg & lt_mask), off_eq = base_eq + __popc(be & lt_mask);
        int tot_gt = 0, tot_eq = 0;
        for (int w = 0; w < LMH_WARPS; ++w) {
            if (w < warp) {
                off_gt += warp_gt[w];
                off_eq += warp_eq[w];
            }
            tot_gt += warp_gt[w];
            tot_eq += warp_eq[w];
        }
        if (gt && off_gt < n_gt) {
            cand_key[off_gt] = key;
            cand_id[off_gt] = i;
            cand_val[off_gt] = row[i];
        }
        if (eq && off_eq < n_eq) {
            cand_key[n_gt + off_eq] = key;
            cand_id[n_gt + off_eq] = i;
            cand_val[n_gt + off_eq] = row[i];
        }
        base_gt += tot_gt;
        base_eq += tot_eq;
        __syncthreads();  // warp_gt / warp_eq are rewritten next chunk
        if (base_gt >= n_gt && base_eq >= n_eq) break;  // uniform across the block
    }
    __syncthreads();

    if (tid < k) {
        const uint32_t key = cand_key[tid];
        const int id = cand_id[tid];
        int rank = 0;
        for (int j = 0; j < k; ++j) {
            const uint32_t kj = cand_key[j];
            rank += (kj > key || (kj == key && cand_id[j] < id)) ? 1 : 0;
        }
        topk_ids[(long long)r * k + rank] = id;
        topk_logits[(long long)r * k + rank] = cand_val[tid];
    }
}

// lmhead_merge: the rows of gemm_bf16_wgmma_lmhead (gemm_sm90a.cu; the fast path
// lm-head-fused): row r's n_parts pairs part[r, t] = (m_t, s_t), the max of a 256-column
// tile's logits and the f32 sum of exp(logit - m_t) over it, into lmhead_reduce's outputs:
// row_max = max_t m_t, row_sumexp = sum_t s_t exp(m_t - row_max) in f64 (parts with s_t
// == 0, the all -inf tiles, skipped; a NaN s_t makes the sum NaN), and target_logit NaN
// for a target outside [0, n_vocab) (the GEMM wrote the others). One warp per row, lane l
// over parts l, l + 32, ..., then xor shuffles: a fixed order, so the same bits whatever
// the pass. Launch: grid (ceil(n_rows / 8)), block 256.
extern "C" __global__ void __launch_bounds__(256)
    lmhead_merge(const float2* __restrict__ part, int n_parts, int n_rows, int n_vocab, const int32_t* __restrict__ targets,
                 float* __restrict__ row_max, double* __restrict__ row_sumexp, float* __restrict__ target_logit) {
    // part: (n_rows, n_parts); targets, row_max, row_sumexp, target_logit: (n_rows)
    const int r = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (r >= n_rows) return;  // the whole warp
    const float2* pr = part + (long long)r * n_parts;
    float m = -INFINITY;
    for (int i = lane; i < n_parts; i += 32) m = fmaxf(m, pr[i].x);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    double s = 0.0;
    for (int i = lane; i < n_parts; i += 32) {
        const float2 v = pr[i];
        if (v.y != 0.0f) s += (double)v.y * exp((double)v.x - (double)m);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) {
        row_max[r] = m;
        row_sumexp[r] = s;
        const int t = targets[r];
        if (t < 0 || t >= n_vocab) target_logit[r] = __int_as_float(0x7fc00000);
    }
}
