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
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(128)
    rope_f32(float* x, const int32_t* pos, int n_per_seq, int n_heads, int d_head, int n_rot,
             long long token_stride, int mode, double freq_base, double freq_scale, double yarn_factor,
             double yarn_low, double yarn_high, double attn_factor) {
    const int t = blockIdx.y;
    const int half_rot = n_rot / 2;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_heads * half_rot) return;
    const int h = idx / half_rot, i = idx % half_rot;
    double theta;
    if (yarn_factor == 1.0) {
        theta = (double)pos[t % n_per_seq] * freq_scale * pow(freq_base, -2.0 * (double)i / (double)n_rot);
    } else {
        const double f = freq_scale * pow(freq_base, -2.0 * (double)i / (double)n_rot);
        const double r = fmin(fmax(((double)i - yarn_low) / (yarn_high - yarn_low), 0.0), 1.0);
        theta = (double)pos[t % n_per_seq] * (f / yarn_factor * r + f * (1.0 - r));
    }
    double s, c;
    sincos(theta, &s, &c);
    const float cs = (float)(c * attn_factor), sn = (float)(s * attn_factor);
    float* row = x + (long long)t * token_stride + (long long)h * d_head;
    const int i0 = mode == 2 ? i : 2 * i;
    const int i1 = mode == 2 ? i + half_rot : 2 * i + 1;
    const float x0 = row[i0], x1 = row[i1];
    row[i0] = fsub(fmul(x0, cs), fmul(x1, sn));
    row[i1] = fadd(fmul(x0, sn), fmul(x1, cs));
}
