// kv_codec.cu: the KV-cache row encoders of the quantized formats, bit-identical to
// the CPU reference encode. CPU twin: src/kv/codec.rs (RowCodec::encode_row;
// src/kv/mod.rs states the arithmetic step by step, src/kv/hadamard.rs the rotation).
//
// kv_encode_<codec>(KvEncodeArgs), codec = int8 | fp8 | nvfp4 | int4g32 | int2g32 |
// vq2 (one template, kv_encode<C>): for each (window s, token t, KV head h) the row
// x = src[s * n_tokens + t, h*d .. (h+1)*d] is encoded into
// cache[s, h, pos0 + t, 0 .. row_bytes] in src/kv's layout of that codec: the element
// codes at byte 0 (bytes; nibbles, element 2i low; 2-bit codes, element 4i+j at bits
// 2j; vq2 one codeword index per 4 elements), the f32 scale fields at data_bytes, the
// E4M3 block scales of nvfp4 after its f32 row scale, zeros up to row_bytes (a
// multiple of 16). Algorithm, per row (all f32, round to nearest even, no FMA, no
// flush: this module is built without fast math; every product that meets an add is
// written __fmul_rn / __fadd_rn):
//   n_bad = count of non-finite x: when > 0 the row is poisoned (below);
//   rotate (args.rotate): y = H x per block (hadamard_rows, common.cuh: the same
//   butterflies as kv::hadamard::forward); a non-finite y poisons with n_bad = d;
//   scales: amax = max |y| (exact in any order, so the warp-shuffle max equals the
//   CPU's fold); per row (int8, fp8: s = amax / QMAX; nvfp4: S = amax / 2688, block
//   b = e4m3(amax_b / (S * 6)), eff_b = e4m3_value(b) * S), per group of 32 (int4:
//   s = amax_g / 7, int2: s = amax_g / 1.5) or the RMS (vq2: s = sqrt(sum_sq / d),
//   sum_sq in kv::codec::sum_sq_lanes' lane order and shuffle tree); a non-finite
//   QMAX * s (vq2: a non-finite s) poisons with n_bad = d;
//   codes: int8 clamp(rint(y / s), -127, 127); fp8 e4m3(y / s) (cvt.rn.satfinite with
//   the sign put back, as kv::scalar::e4m3_from_f32); nvfp4 e2m1(y / eff) (the CPU's
//   midpoint rule: sm_90 has no e2m1 cvt); int4 clamp(rint(y / s), -7, 7) + 8; int2
//   clamp(rint(y / s + 1.5), 0, 3); vq2 the nearest codeword of z = y / s in
//   kv::vq::nearest's distance order (ties to the lowest index), over args.book;
//   a zero scale codes every element as zero (int4: 8, int2: 2);
//   poisoned row: all codes 0, every f32 scale field NaN 0x7FC00000, block scales 0.
// A row's n_bad is added to the cache's device counter (*n_bad, u64 atomics), which
// the backend keeps per cache, as the CPU backend's cache counts what its codecs report.
// Launch: grid (n_tokens, n_kv_heads, n_seqs), block 32 (one warp per row), dynamic
// shared memory (d + d/16) * 4 bytes (the row y, then group scales or nvfp4's eff_b).
#include "common.cuh"

namespace kvc {
constexpr int INT8 = 0, FP8 = 1, NVFP4 = 2, INT4G32 = 3, INT2G32 = 4, VQ2 = 5;
constexpr float E4M3_MAX = 448.0f;
constexpr float NVFP4_MAX = 2688.0f;  // 448 * 6: E4M3_MAX * E2M1_MAX

template <int C>
__device__ constexpr int elem_bits() { return C == INT8 || C == FP8 ? 8 : (C == NVFP4 || C == INT4G32 ? 4 : 2); }
// The largest decoded code (the QMAX of `QMAX * s`'s overflow check).
template <int C>
__device__ constexpr float qmax() {
    return C == INT8 ? 127.0f : C == FP8 ? E4M3_MAX : C == NVFP4 ? NVFP4_MAX : C == INT4G32 ? 7.0f : 1.5f;
}
template <int C>
__device__ constexpr bool group32() { return C == INT4G32 || C == INT2G32; }

// E4M3 code of finite t (see the header). Both halves of the x2 conversion get
// |t|, so the byte order of cvt's result does not matter.
__device__ __forceinline__ uint32_t e4m3_code(float t) {
    const float a = fabsf(t);
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(a), "f"(a));
    return (r & 0x7Fu) | (signbit(t) ? 0x80u : 0u);
}

// E2M1 code of finite t, kv::scalar::e2m1_from_f32: round to nearest, ties to the
// even code, saturating at 6; the sign bit of t as bit 3.
__device__ __forceinline__ uint32_t e2m1_code(float t) {
    const float a = fabsf(t);
    const uint32_t c = a <= 0.25f ? 0u : a < 0.75f ? 1u : a <= 1.25f ? 2u : a < 1.75f ? 3u
                     : a <= 2.5f ? 4u : a < 3.5f ? 5u : a <= 5.0f ? 6u : 7u;
    return c | (signbit(t) ? 8u : 0u);
}

// kv::scalar::round_clamp: clamp in f32, then round to nearest even.
__device__ __forceinline__ int round_clamp(float t, float lo, float hi) {
    return __float2int_rn(fminf(fmaxf(t, lo), hi));
}

// kv::vq::nearest: the index of the codeword nearest to z (squared distance
// ((e0*e0 + e1*e1) + e2*e2) + e3*e3, e_j = z_j - c_j); a later codeword wins only
// when strictly nearer.
__device__ __forceinline__ uint32_t vq_nearest(const float z[4], const float* __restrict__ book) {
    uint32_t best = 0;
    float best_d = INFINITY;
    for (int i = 0; i < 256; ++i) {
        const float4 c = __ldg(reinterpret_cast<const float4*>(book) + i);
        const float e0 = __fsub_rn(z[0], c.x), e1 = __fsub_rn(z[1], c.y);
        const float e2 = __fsub_rn(z[2], c.z), e3 = __fsub_rn(z[3], c.w);
        float dd = __fadd_rn(__fmul_rn(e0, e0), __fmul_rn(e1, e1));
        dd = __fadd_rn(dd, __fmul_rn(e2, e2));
        dd = __fadd_rn(dd, __fmul_rn(e3, e3));
        if (dd < best_d) {
            best_d = dd;
            best = (uint32_t)i;
        }
    }
    return best;
}

// The code of element i (not poisoned, its scale non-zero): s is the row or group
// scale (nvfp4: eff of its block of 16).
template <int C>
__device__ __forceinline__ uint32_t elem_code(float y, float s) {
    const float t = __fdiv_rn(y, s);
    if constexpr (C == INT8) return (uint32_t)(round_clamp(t, -127.0f, 127.0f) & 0xFF);
    else if constexpr (C == FP8) return e4m3_code(t);
    else if constexpr (C == NVFP4) return e2m1_code(t);
    else if constexpr (C == INT4G32) return (uint32_t)(round_clamp(t, -7.0f, 7.0f) + 8);
    else return (uint32_t)round_clamp(__fadd_rn(t, 1.5f), 0.0f, 3.0f);
}

// The code of an element whose scale is zero.
template <int C>
__device__ constexpr uint32_t zero_code() { return C == INT4G32 ? 8u : C == INT2G32 ? 2u : 0u; }

template <int C>
__device__ __forceinline__ void kv_encode(const KvEncodeArgs& a) {
    const int t = blockIdx.x, h = blockIdx.y, seq = blockIdx.z, lane = threadIdx.x;
    const int d = a.d;
    const float* x = a.src + ((long long)seq * gridDim.x + t) * a.src_stride + (long long)h * d;
    unsigned char* row = a.cache + (((long long)seq * a.n_kv_heads + h) * a.n_ctx + a.pos0 + t) * a.row_bytes;
    extern __shared__ float sm[];
    float* y = sm;           // (d) the row, rotated in place
    float* gsc = sm + d;     // (d / 16) group scales (int4, int2) or nvfp4's eff per block
    auto warp_sync = [] { __syncwarp(); };

    int n_bad = 0;
    for (int i = lane; i < d; i += 32) {
        const float v = x[i];
        if (!isfinite(v)) ++n_bad;
        y[i] = v;
    }
    n_bad = warp_sum(n_bad);
    bool poison = n_bad > 0;
    if (!poison && a.rotate) {
        hadamard_rows(y, 1, d, lane, 32, warp_sync);
        int nf = 0;
        for (int i = lane; i < d; i += 32) nf += isfinite(y[i]) ? 0 : 1;
        if (warp_sum(nf) > 0) {
            poison = true;
            n_bad = d;
        }
    }
    __syncwarp();

    // Scales.
    constexpr int BITS = elem_bits<C>();
    const int data_bytes = d * BITS / 8;
    const int n_f32 = group32<C>() ? d / 32 : 1;
    const int n_u8 = C == NVFP4 ? d / 16 : 0;
    float s = 0.0f;  // the row scale (int8, fp8, vq2) or nvfp4's S
    if (!poison) {
        if constexpr (group32<C>()) {
            for (int g = 0; g < d / 32; ++g) {
                const float sg = __fdiv_rn(warp_max(fabsf(y[g * 32 + lane])), qmax<C>());
                if (!isfinite(__fmul_rn(sg, qmax<C>()))) poison = true;
                if (lane == 0) gsc[g] = sg;
            }
        } else if constexpr (C == VQ2) {
            float p = 0.0f;
            for (int i = lane; i < d; i += 32) p = __fadd_rn(p, __fmul_rn(y[i], y[i]));
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) p = __fadd_rn(p, __shfl_down_sync(0xffffffffu, p, off));
            s = __fsqrt_rn(__fdiv_rn(__shfl_sync(0xffffffffu, p, 0), (float)d));
            if (!isfinite(s)) poison = true;
        } else {
            float amax = 0.0f;
            for (int i = lane; i < d; i += 32) amax = fmaxf(amax, fabsf(y[i]));
            s = __fdiv_rn(warp_max(amax), qmax<C>());
            if (!isfinite(__fmul_rn(s, qmax<C>()))) poison = true;
        }
        if (poison) n_bad = d;
    }
    unsigned char* scales = row + data_bytes;
    if constexpr (C == NVFP4) {
        // Block scales: b = e4m3(amax_b / (S * 6)) (0 when S == 0), eff_b = e4m3_value(b) * S.
        for (int b = lane; b < d / 16; b += 32) {
            uint32_t code = 0;
            float eff = 0.0f;
            if (!poison && s != 0.0f) {
                float am = 0.0f;
                for (int i = 0; i < 16; ++i) am = fmaxf(am, fabsf(y[b * 16 + i]));
                code = e4m3_code(__fdiv_rn(am, __fmul_rn(s, 6.0f)));
                eff = __fmul_rn(e4m3_value(code), s);
            }
            gsc[b] = eff;
            scales[4 + b] = (unsigned char)code;  // 0 in a poisoned row
        }
    }
    __syncwarp();

    // Codes, one byte per lane step.
    constexpr int EPB = 8 / BITS;  // elements per byte (vq2: 4 per codeword byte)
    for (int b = lane; b < data_bytes; b += 32) {
        uint32_t w = 0;
        if (!poison) {
            if constexpr (C == VQ2) {
                if (s != 0.0f) {
                    const float z[4] = {__fdiv_rn(y[4 * b], s), __fdiv_rn(y[4 * b + 1], s), __fdiv_rn(y[4 * b + 2], s),
                                        __fdiv_rn(y[4 * b + 3], s)};
                    w = vq_nearest(z, a.book);
                }
            } else {
#pragma unroll
                for (int j = 0; j < EPB; ++j) {
                    const int i = b * EPB + j;
                    const float sc = group32<C>() ? gsc[i / 32] : C == NVFP4 ? gsc[i / 16] : s;
                    const uint32_t c = sc != 0.0f ? elem_code<C>(y[i], sc) : zero_code<C>();
                    w |= c << (BITS * j);
                }
            }
        }
        row[b] = (unsigned char)w;
    }
    // f32 scale fields (4-aligned: data_bytes is a multiple of 8), then zeros to row_bytes.
    float* sf = reinterpret_cast<float*>(scales);
    for (int g = lane; g < n_f32; g += 32) sf[g] = poison ? __uint_as_float(0x7FC00000u) : (group32<C>() ? gsc[g] : s);
    for (int i = data_bytes + 4 * n_f32 + n_u8 + lane; i < a.row_bytes; i += 32) row[i] = 0;
    if (lane == 0 && n_bad > 0) atomicAdd(a.n_bad, (unsigned long long)n_bad);
}
}  // namespace kvc

#define KV_ENCODE(name, C) \
    extern "C" __global__ void __launch_bounds__(32) kv_encode_##name(const KvEncodeArgs a) { kvc::kv_encode<C>(a); }
KV_ENCODE(int8, kvc::INT8)
KV_ENCODE(fp8, kvc::FP8)
KV_ENCODE(nvfp4, kvc::NVFP4)
KV_ENCODE(int4g32, kvc::INT4G32)
KV_ENCODE(int2g32, kvc::INT2G32)
KV_ENCODE(vq2, kvc::VQ2)
