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
// Launch: one warp per row, R = blockDim.x / 32 rows a block (kv_rows: the rows in
// (window, token, KV head) order, so a block's warps read neighbouring heads of one
// token row; grid.x = ceil(n_seqs * n_tokens * n_kv_heads / R)), dynamic shared memory
// R * (d + d/16) * 4 bytes (each warp's row y, then its group scales or nvfp4's eff_b).
// The rotation's butterflies run with d a compile-time constant at d 64, 128 and 256
// (hadamard_rows_d: shifts where a run-time d costs integer divisions per butterfly;
// the same pairs in the same order, so the same bits). Unrotated int8 and fp8 rows of
// 64, 128 or 256 (the default route's fp8 cache) skip the shared memory: each lane keeps
// d / 32 consecutive elements in registers and stores their codes as one word
// (encode_row_regs, the same bytes).
//
// kv_roundtrip_<codec>(KvEncodeArgs), codec = the six above | bf16 | fp16: the
// `--reference` route's store (CPU twin: src/backend/cpu/mod.rs CpuBackend::kv_store,
// decode_row(encode_row(x))). The same rows, but a.cache is the f32 cache
// (n_seqs, n_kv_heads, n_ctx, d) and row (s, h, pos0 + t) receives the f32 decode of
// the row's encode: encode_row (the code above, unchanged) writes the encoded row into
// shared memory, then each element is decoded as kv::codec decodes it (one f32
// multiply; nvfp4 (e2m1 * e4m3) * S; int2 (q - 1.5) * s; vq2 codeword * s) and, when
// the codec rotates, the inverse rotation: the same butterflies, then * (1/n) (n the
// rotation block, a power of two). A poisoned row decodes to NaN 0x7FC00000 in every
// element (the CPU's NaN scale times the zero codes, kept by the butterflies). So the
// stored f32 row is the CPU's decoded row bit for bit (NaN payloads aside where finite
// inputs overflow the inverse rotation: IEEE leaves those bits to the machine).
// bf16 / fp16 round each element and back (kv_roundtrip_half). a.row_bytes is the
// codec's encoded row (the shared scratch). Launch as kv_encode, shared memory
// R * ((d + d/16) * 4 + row_bytes) bytes; non-finite counts as kv_encode.
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

// y = H y (one row of d in shared memory, the calling warp): hadamard_rows with d a
// compile-time constant where the model's head sizes are (the same butterflies).
__device__ __forceinline__ void rotate_row(float* y, int d, int lane) {
    auto warp_sync = [] { __syncwarp(); };
    switch (d) {
    case 64: hadamard_rows_d<64>(y, 1, lane, 32, warp_sync); break;
    case 128: hadamard_rows_d<128>(y, 1, lane, 32, warp_sync); break;
    case 256: hadamard_rows_d<256>(y, 1, lane, 32, warp_sync); break;
    default: hadamard_rows(y, 1, d, lane, 32, warp_sync);
    }
}

// The row of the calling warp (see the header's launch): its window s, token t and KV
// head h, its shared scratch of `smem_floats` f32; false past the last row.
struct KvRow {
    const float* x;
    long long slot;  // (s * n_kv_heads + h) * n_ctx + pos0 + t: the cache row
    float* sm;
};
__device__ __forceinline__ bool kv_row(const KvEncodeArgs& a, int smem_floats, KvRow& r) {
    extern __shared__ float sm_rows[];
    const int warp = threadIdx.x / 32;
    const long long i = (long long)blockIdx.x * (blockDim.x / 32) + warp;
    const long long tr = i / a.n_kv_heads;  // s * n_tokens + t
    if (tr >= (long long)a.n_seqs * a.n_tokens) return false;
    const int h = (int)(i - tr * a.n_kv_heads);
    const int s = (int)(tr / a.n_tokens), t = (int)(tr - (long long)s * a.n_tokens);
    r.x = a.src + tr * a.src_stride + (long long)h * a.d;
    r.slot = ((long long)s * a.n_kv_heads + h) * a.n_ctx + a.pos0 + t;
    r.sm = sm_rows + warp * smem_floats;
    return true;
}

// One row x (d values) encoded into `row` (row_bytes bytes, 4-byte aligned) by the
// calling warp; y (d f32) and gsc (d/16 f32) are its shared scratch. Returns the row's
// non-finite count (the same on every lane); `poison` tells whether the row was poisoned.
template <int C>
__device__ __forceinline__ int encode_row(const float* x, unsigned char* row, int d, int row_bytes, bool rotate,
                                          const float* __restrict__ book, float* y, float* gsc, int lane, bool& poison) {
    auto warp_sync = [] { __syncwarp(); };

    int n_bad = 0;
    for (int i = lane; i < d; i += 32) {
        const float v = x[i];
        if (!isfinite(v)) ++n_bad;
        y[i] = v;
    }
    n_bad = warp_sum(n_bad);
    poison = n_bad > 0;
    if (!poison && rotate) {
        rotate_row(y, d, lane);
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
                    w = vq_nearest(z, book);
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
    for (int i = data_bytes + 4 * n_f32 + n_u8 + lane; i < row_bytes; i += 32) row[i] = 0;
    return n_bad;
}

// encode_row for an unrotated int8 or fp8 row held in registers (kvenc8): lane l keeps
// elements [E l, E l + E), E = d / 32 (2, 4 or 8), read as one or two vectors; then
// encode_row's arithmetic: the count of non-finite x (poison), amax exact in any order
// (the same warp_max), s = amax / QMAX, the overflow check, each code elem_code<C>(x,
// s) (zero_code for s == 0); the lane's E code bytes stored as one word, lane 0 the f32
// scale (NaN when poisoned), zeros to row_bytes. So the same bytes and count, without
// encode_row's shared-memory copy of the row and its byte-wide code stores (enc7's
// kernel moved K and V at about 1.5 TB/s on the 8B shapes).
template <int C, int E>
__device__ __forceinline__ int encode_row_regs(const float* x, unsigned char* row, int row_bytes, int lane) {
    constexpr int d = 32 * E;
    float v[E];
    if constexpr (E == 2) {
        const float2 f = reinterpret_cast<const float2*>(x)[lane];
        v[0] = f.x, v[1] = f.y;
    } else {
#pragma unroll
        for (int k = 0; k < E / 4; ++k) {
            const float4 f = reinterpret_cast<const float4*>(x)[lane * (E / 4) + k];
            v[4 * k] = f.x, v[4 * k + 1] = f.y, v[4 * k + 2] = f.z, v[4 * k + 3] = f.w;
        }
    }
    int nf = 0;
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        nf += isfinite(v[e]) ? 0 : 1;
        amax = fmaxf(amax, fabsf(v[e]));
    }
    int n_bad = warp_sum(nf);
    bool poison = n_bad > 0;
    float s = 0.0f;
    if (!poison) {
        s = __fdiv_rn(warp_max(amax), qmax<C>());
        if (!isfinite(__fmul_rn(s, qmax<C>()))) {
            poison = true;
            n_bad = d;
        }
    }
    uint32_t w[(E + 3) / 4] = {};
    if (!poison) {
#pragma unroll
        for (int e = 0; e < E; ++e) w[e / 4] |= (s != 0.0f ? elem_code<C>(v[e], s) : zero_code<C>()) << (8 * (e % 4));
    }
    if constexpr (E == 2) reinterpret_cast<unsigned short*>(row)[lane] = (unsigned short)w[0];
    else if constexpr (E == 4) reinterpret_cast<uint32_t*>(row)[lane] = w[0];
    else reinterpret_cast<uint2*>(row)[lane] = make_uint2(w[0], w[1]);
    if (lane == 0) *reinterpret_cast<float*>(row + d) = poison ? __uint_as_float(0x7FC00000u) : s;
    for (int i = d + 4 + lane; i < row_bytes; i += 32) row[i] = 0;
    return n_bad;
}

template <int C>
__device__ __forceinline__ void kv_encode(const KvEncodeArgs& a) {
    const int d = a.d, lane = threadIdx.x % 32;
    KvRow r;
    if (!kv_row(a, d + d / 16, r)) return;
    unsigned char* row = a.cache + r.slot * a.row_bytes;
    if constexpr (C == INT8 || C == FP8) {
        // Unrotated rows of 64, 128 or 256 with every row's start aligned for the vector
        // loads (the source and its stride) go through registers (same bytes).
        const int e = d / 32;
        const bool fits = !a.rotate && (d == 64 || d == 128 || d == 256) && a.src_stride % e == 0 &&
                          ((unsigned long long)a.src & (unsigned long long)(4 * (e < 4 ? e : 4) - 1)) == 0;
        if (fits) {
            int n_bad;
            if (d == 64) n_bad = encode_row_regs<C, 2>(r.x, row, a.row_bytes, lane);
            else if (d == 128) n_bad = encode_row_regs<C, 4>(r.x, row, a.row_bytes, lane);
            else n_bad = encode_row_regs<C, 8>(r.x, row, a.row_bytes, lane);
            if (lane == 0 && n_bad > 0) atomicAdd(a.n_bad, (unsigned long long)n_bad);
            return;
        }
    }
    float* y = r.sm;        // (d) the row, rotated in place
    float* gsc = r.sm + d;  // (d / 16) group scales (int4, int2) or nvfp4's eff per block
    bool poison;
    const int n_bad = encode_row<C>(r.x, row, d, a.row_bytes, a.rotate != 0, a.book, y, gsc, lane, poison);
    if (lane == 0 && n_bad > 0) atomicAdd(a.n_bad, (unsigned long long)n_bad);
}

// --- route ---
// The value of element i of an encoded row (src/kv/codec.rs RowCodec::decode_row
// before its inverse rotation): one f32 multiply per element, nvfp4's inner product
// first (exact).
template <int C>
__device__ __forceinline__ float decode_elem(const unsigned char* row, int d, int i, const float* __restrict__ book) {
    constexpr int BITS = elem_bits<C>();
    const int data_bytes = d * BITS / 8;
    const float* sf = reinterpret_cast<const float*>(row + data_bytes);
    if constexpr (C == INT8) return __fmul_rn((float)(signed char)row[i], sf[0]);
    else if constexpr (C == FP8) return __fmul_rn(e4m3_value(row[i]), sf[0]);
    else if constexpr (C == NVFP4) {
        const uint32_t nib = (row[i / 2] >> (4 * (i & 1))) & 0xFu;
        const float bs = e4m3_value(row[data_bytes + 4 + i / 16]);
        return __fmul_rn(__fmul_rn(e2m1_value(nib), bs), sf[0]);
    } else if constexpr (C == INT4G32) {
        const int nib = (row[i / 2] >> (4 * (i & 1))) & 0xF;
        return __fmul_rn((float)(nib - 8), sf[i / 32]);
    } else if constexpr (C == INT2G32) {
        const int q = (row[i / 4] >> (2 * (i & 3))) & 3;
        return __fmul_rn(__fsub_rn((float)q, 1.5f), sf[i / 32]);
    } else {
        return __fmul_rn(__ldg(book + 4 * row[i / 4] + (i & 3)), sf[0]);
    }
}

// kv_roundtrip<C>: the reference route's store (see the header): the row encoded
// by encode_row into shared memory, decoded, inverse-rotated ((H v) * (1/n)), written
// as f32 into the cache row.
template <int C>
__device__ __forceinline__ void kv_roundtrip(const KvEncodeArgs& a) {
    const int d = a.d, lane = threadIdx.x % 32;
    KvRow r;
    if (!kv_row(a, d + d / 16 + a.row_bytes / 4, r)) return;
    float* out = reinterpret_cast<float*>(a.cache) + r.slot * d;
    float* y = r.sm;                                                         // (d) the row, then its decode
    float* gsc = r.sm + d;                                                   // (d / 16) scales
    unsigned char* code = reinterpret_cast<unsigned char*>(r.sm + d + d / 16);  // (row_bytes) the encoded row
    bool poison;
    const int n_bad = encode_row<C>(r.x, code, d, a.row_bytes, a.rotate != 0, a.book, y, gsc, lane, poison);
    __syncwarp();
    if (poison) {
        // Codes 0 and NaN scales decode to the scale's NaN, and the rotation keeps it.
        for (int i = lane; i < d; i += 32) out[i] = __uint_as_float(0x7FC00000u);
    } else {
        for (int i = lane; i < d; i += 32) y[i] = decode_elem<C>(code, d, i, a.book);
        if (a.rotate) {
            rotate_row(y, d, lane);
            const float inv_n = 1.0f / (float)(d & -d);  // a power of two: exact
            for (int i = lane; i < d; i += 32) y[i] = __fmul_rn(y[i], inv_n);
        }
        __syncwarp();
        for (int i = lane; i < d; i += 32) out[i] = y[i];
    }
    if (lane == 0 && n_bad > 0) atomicAdd(a.n_bad, (unsigned long long)n_bad);
}

// kv_roundtrip_bf16 / _fp16: each element rounded to bf16 / IEEE binary16 (nearest
// even, overflow to ±Inf) and back, as kv::codec's Bf16 / Fp16 encode then decode; a
// NaN becomes the CPU's decoded 0x7FFF (bf16: 0x7FFF0000, fp16: 0x7FFFE000); the
// elements whose code has an all-ones exponent (±Inf, NaN) are counted.
template <bool FP16>
__device__ __forceinline__ void kv_roundtrip_half(const KvEncodeArgs& a) {
    const int d = a.d, lane = threadIdx.x % 32;
    KvRow r;
    if (!kv_row(a, 0, r)) return;
    float* out = reinterpret_cast<float*>(a.cache) + r.slot * d;
    int n_bad = 0;
    for (int i = lane; i < d; i += 32) {
        const float v = r.x[i];
        float r;
        if (isnan(v)) r = __uint_as_float(FP16 ? 0x7FFFE000u : 0x7FFF0000u);
        else if constexpr (FP16) r = __half2float(__float2half_rn(v));
        else r = __bfloat162float(__float2bfloat16_rn(v));
        n_bad += isfinite(r) ? 0 : 1;
        out[i] = r;
    }
    n_bad = warp_sum(n_bad);
    if (lane == 0 && n_bad > 0) atomicAdd(a.n_bad, (unsigned long long)n_bad);
}
}  // namespace kvc

#define KV_ENCODE(name, C) \
    extern "C" __global__ void __launch_bounds__(KV_ROWS_MAX_THREADS) kv_encode_##name(const KvEncodeArgs a) { kvc::kv_encode<C>(a); }
KV_ENCODE(int8, kvc::INT8)
KV_ENCODE(fp8, kvc::FP8)
KV_ENCODE(nvfp4, kvc::NVFP4)
KV_ENCODE(int4g32, kvc::INT4G32)
KV_ENCODE(int2g32, kvc::INT2G32)
KV_ENCODE(vq2, kvc::VQ2)
#define KV_ROUNDTRIP(name, C) \
    extern "C" __global__ void __launch_bounds__(KV_ROWS_MAX_THREADS) kv_roundtrip_##name(const KvEncodeArgs a) { kvc::kv_roundtrip<C>(a); }
KV_ROUNDTRIP(int8, kvc::INT8)
KV_ROUNDTRIP(fp8, kvc::FP8)
KV_ROUNDTRIP(nvfp4, kvc::NVFP4)
KV_ROUNDTRIP(int4g32, kvc::INT4G32)
KV_ROUNDTRIP(int2g32, kvc::INT2G32)
KV_ROUNDTRIP(vq2, kvc::VQ2)
extern "C" __global__ void __launch_bounds__(KV_ROWS_MAX_THREADS) kv_roundtrip_bf16(const KvEncodeArgs a) { kvc::kv_roundtrip_half<false>(a); }
extern "C" __global__ void __launch_bounds__(KV_ROWS_MAX_THREADS) kv_roundtrip_fp16(const KvEncodeArgs a) { kvc::kv_roundtrip_half<true>(a); }
