// kv_codec.cu: the KV-cache row encoders of the quantized formats (fp8 today),
// bit-identical to the CPU reference encode. CPU twin: src/kv/codec.rs
// (RowCodec::encode_row; src/kv/mod.rs states the arithmetic step by step).
//
// kv_encode_fp8(KvEncodeArgs): for each (window s, token t, KV head h) the row
// x = src[s * n_tokens + t, h*d .. (h+1)*d] is encoded into
// cache[s, h, pos0 + t, 0 .. row_bytes] as src/kv lays an fp8 row out: d E4M3
// codes at byte 0, the f32 scale at byte d, zeros up to row_bytes (a multiple
// of 16). Algorithm, per row (all f32, round to nearest even, no FMA, no flush:
// this module is built without fast math):
//   n_bad = count of non-finite x; amax = max |x| over the finite ones (exact
//   in any order, so the warp-shuffle max equals the CPU's fold);
//   s = __fdiv_rn(amax, 448);
//   poisoned when n_bad > 0, or when __fmul_rn(s, 448) is not finite (then
//   n_bad = d): all codes 0, scale field NaN 0x7FC00000;
//   else c_i = e4m3(__fdiv_rn(x_i, s)) (0 when s == 0): cvt.rn.satfinite of |t|
//   (round to nearest even from the exact f32 value, saturating at 448) with
//   the sign bit of t put back, as kv::scalar::e4m3_from_f32 (-0 and negative
//   values that round to zero code as 0x80).
// A row's n_bad is added to the cache's device counter (*n_bad, u64 atomics),
// which the backend keeps per cache, as the CPU backend's cache counts what its
// codecs report.
// Launch: grid (n_tokens, n_kv_heads, n_seqs), block 32 (one warp per row; lane
// l codes elements 4l.. of each 128-element stretch, four codes per 32-bit store).
#include "common.cuh"

namespace kvc {
constexpr float E4M3_MAX = 448.0f;

// E4M3 code of finite t (see the header). Both halves of the x2 conversion get
// |t|, so the byte order of cvt's result does not matter.
__device__ __forceinline__ uint32_t e4m3_code(float t) {
    const float a = fabsf(t);
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(a), "f"(a));
    return (r & 0x7Fu) | (signbit(t) ? 0x80u : 0u);
}

}  // namespace kvc

extern "C" __global__ void __launch_bounds__(32) kv_encode_fp8(const KvEncodeArgs a) {
    using namespace kvc;
    const int t = blockIdx.x, h = blockIdx.y, seq = blockIdx.z, lane = threadIdx.x;
    const int d = a.d;
    const float* x = a.src + ((long long)seq * gridDim.x + t) * a.src_stride + (long long)h * d;
    unsigned char* row = a.cache + (((long long)seq * a.n_kv_heads + h) * a.n_ctx + a.pos0 + t) * a.row_bytes;

    int n_bad = 0;
    float amax = 0.0f;
    for (int i = lane; i < d; i += 32) {
        const float v = x[i];
        if (isfinite(v)) amax = fmaxf(amax, fabsf(v));
        else ++n_bad;
    }
    n_bad = warp_sum(n_bad);
    amax = warp_max(amax);  // exact: fmaxf in any order
    const float s = __fdiv_rn(amax, E4M3_MAX);
    bool poison = n_bad > 0;
    if (!poison && !isfinite(__fmul_rn(s, E4M3_MAX))) {
        poison = true;
        n_bad = d;
    }
    const bool zero = poison || s == 0.0f;
    // Codes: d % 32 == 0 (checked by the launcher), four per 32-bit store.
    for (int i = 4 * lane; i < d; i += 128) {
        uint32_t w = 0;
        if (!zero) {
#pragma unroll
            for (int j = 0; j < 4; ++j) w |= e4m3_code(__fdiv_rn(x[i + j], s)) << (8 * j);
        }
        *reinterpret_cast<uint32_t*>(row + i) = w;
    }
    // The scale at byte d (4-aligned: d % 32 == 0), then zeros to row_bytes.
    if (lane == 0) *reinterpret_cast<float*>(row + d) = poison ? __uint_as_float(0x7FC00000u) : s;
    for (int i = d + 4 + lane; i < a.row_bytes; i += 32) row[i] = 0;
    if (lane == 0 && n_bad > 0) atomicAdd(a.n_bad, (unsigned long long)n_bad);
}
