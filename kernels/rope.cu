// rope.cu: rotary position embedding, in place on q or k.
//
// Algorithm: for token t at position pos[t % n_per_seq] (a batched pass
// holds n_tokens / n_per_seq windows at the same positions) and pair i < n_rot/2, the angle
// is (pos * freq_scale) * base^(-2i/n_rot) (linear scaling: freq_scale =
// 1/factor), computed with sin/cos in f64 so the only f32 rounding is the
// rotation itself: (x0*cos - x1*sin, x0*sin + x1*cos). Pairing mode 0
// ("normal", llama/GPT-J) rotates (2i, 2i+1); mode 2 ("neox", gemma/HF)
// rotates (i, i + n_rot/2). Dimensions >= n_rot pass through unchanged. The
// base is per call, so gemma3's local (10k) and global (1M) layers use the
// same kernel.
//
// YaRN (--rope-yarn-factor; yarn_factor == 1 is native RoPE and takes the
// expression above unchanged): the inverse frequency f = freq_scale *
// base^(-2i/n_rot) becomes f / yarn_factor * r + f * (1 - r) with the ramp
// r = clamp((i - yarn_low) / (yarn_high - yarn_low), 0, 1), and cos and sin
// are multiplied by attn_factor (f64) before the f32 rounding.
// CPU twin: src/backend/cpu/ops.rs::rope_cos_sin with RopeParams::inv_freq
// (src/backend/mod.rs), which owns the ramp and the factor.
//
// Launch: grid (ceil(n_heads*n_rot/2 / 128), n_tokens), block 128; one
// thread per (token, head, pair). x: (n_tokens, token_stride) with heads of
// d_head contiguous inside a token's row.
//
// Two versions, the same bits (gpu_ops `rope_table_bit_identical_to_direct`):
// - rope_f32 (v1, the reference) evaluates pow and sincos in f64 per (token,
//   head, pair): compute bound, about 20 % of copy bandwidth on the 8B shape.
// - rope_table_f32 builds (cos, sin) once per (position, pair) for one set of
//   parameters (rope_angle below, the same f64 expression, rounded to f32 as
//   v1 rounds it) and rope_tabled_f32 reads it: one table per base and scale,
//   shared by every layer and every pass (the backend keeps it), so the
//   rotation pass only streams x.
// The default route's q and k projections rotate in the GEMM's epilogue instead
// (gemm_sm90a.cu, gemm_rope_acc: this table and rope_rotate's expression, the same
// bits, gpu_ops `rope_in_the_gemm_epilogue_bit_identical`); rope_tabled_f32 stays for
// the rest (QK norm, biases, shapes gemm_rope_fits refuses, the mma.sync route).
#include "common.cuh"

// (cos, sin) * attn_factor of pair i at position p, rounded to f32: the one
// definition both versions use.
__device__ __forceinline__ float2 rope_angle(int p, int i, int n_rot, double freq_base, double freq_scale, double yarn_factor,
                                             double yarn_low, double yarn_high, double attn_factor) {
    double theta;
    if (yarn_factor == 1.0) {
        theta = (double)p * freq_scale * pow(freq_base, -2.0 * (double)i / (double)n_rot);
    } else {
        const double f = freq_scale * pow(freq_base, -2.0 * (double)i / (double)n_rot);
        const double r = fmin(fmax(((double)i - yarn_low) / (yarn_high - yarn_low), 0.0), 1.0);
        theta = (double)p * (f / yarn_factor * r + f * (1.0 - r));
    }
    double s, c;
    sincos(theta, &s, &c);
    return make_float2((float)(c * attn_factor), (float)(s * attn_factor));
}

// Rotates pair i of the head at `row` by (cs, sn).
__device__ __forceinline__ void rope_rotate(float* row, int i, int half_rot, int mode, float cs, float sn) {
    const int i0 = mode == 2 ? i : 2 * i;
    const int i1 = mode == 2 ? i + half_rot : 2 * i + 1;
    const float x0 = row[i0], x1 = row[i1];
    row[i0] = fsub(fmul(x0, cs), fmul(x1, sn));
    row[i1] = fadd(fmul(x0, sn), fmul(x1, cs));
}

extern "C" __global__ void __launch_bounds__(128)
    rope_f32(float* x, const int32_t* pos, int n_per_seq, int n_heads, int d_head, int n_rot,
             long long token_stride, int mode, double freq_base, double freq_scale, double yarn_factor,
             double yarn_low, double yarn_high, double attn_factor) {
    const int t = blockIdx.y;
    const int half_rot = n_rot / 2;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_heads * half_rot) return;
    const int h = idx / half_rot, i = idx % half_rot;
    const float2 cs = rope_angle(pos[t % n_per_seq], i, n_rot, freq_base, freq_scale, yarn_factor, yarn_low, yarn_high,
                                 attn_factor);
    rope_rotate(x + (long long)t * token_stride + (long long)h * d_head, i, half_rot, mode, cs.x, cs.y);
}

// table: (n_pos, n_rot/2) of (cos, sin) for positions 0..n_pos.
// Launch: grid (n_pos, ceil(n_rot/2 / 128)), block 128 (positions on x: more than 65535 of them).
extern "C" __global__ void __launch_bounds__(128)
    rope_table_f32(float2* table, int n_rot, double freq_base, double freq_scale, double yarn_factor, double yarn_low,
                   double yarn_high, double attn_factor) {
    const int p = blockIdx.x, half_rot = n_rot / 2;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= half_rot) return;
    table[(long long)p * half_rot + i] =
        rope_angle(p, i, n_rot, freq_base, freq_scale, yarn_factor, yarn_low, yarn_high, attn_factor);
}

// rope_f32's rotation with (cos, sin) read from `table` (n_pos, n_rot/2), built by
// rope_table_f32 for the same parameters; every pos[] must be < n_pos (the launcher
// checks the table's length against the largest position it was built for).
extern "C" __global__ void __launch_bounds__(128)
    rope_tabled_f32(float* x, const int32_t* pos, int n_per_seq, int n_heads, int d_head, int n_rot,
                    long long token_stride, int mode, const float2* __restrict__ table) {
    const int t = blockIdx.y;
    const int half_rot = n_rot / 2;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_heads * half_rot) return;
    const int h = idx / half_rot, i = idx % half_rot;
    const float2 cs = table[(long long)pos[t % n_per_seq] * half_rot + i];
    rope_rotate(x + (long long)t * token_stride + (long long)h * d_head, i, half_rot, mode, cs.x, cs.y);
}
