// embed.cu: token embedding gather with dequantization.
//
// Algorithm: out[t, :] = dequant(table[ids[t], :]) * scale for every stored
// format (F32, F16, BF16, Q4_0 ... IQ4_NL). `scale` is gemma's sqrt(d_model)
// (1 for llama); the product is one rounded f32 multiply. An id outside
// [0, n_vocab) writes NaN for the whole row (callers validate ids on the host;
// the NaN makes a missed check visible instead of reading out of bounds).
//
// Launch: grid (n_tokens), block 128; each thread dequantizes groups of 8
// consecutive elements (dequant8) and writes two float4. d_model % 32 == 0.
#include "common.cuh"

template <int FMT>
__device__ void embed_rows(const int32_t* __restrict__ ids, const uint8_t* __restrict__ table,
                           float* __restrict__ out, int n_vocab, int d_model, long long row_bytes,
                           float scale) {
    // ids: (n_tokens); table: (n_vocab, row_bytes); out: (n_tokens, d_model)
    const int t = blockIdx.x;
    const int id = ids[t];
    float4* dst = reinterpret_cast<float4*>(out + (long long)t * d_model);
    const int n_groups = d_model / 8;
    for (int g = threadIdx.x; g < n_groups; g += blockDim.x) {
        float v[8];
        if (id >= 0 && id < n_vocab) {
            dequant8<FMT>(table + (long long)id * row_bytes, g, v);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = fmul(v[i], scale);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = __int_as_float(0x7fc00000);
        }
        dst[2 * g] = make_float4(v[0], v[1], v[2], v[3]);
        dst[2 * g + 1] = make_float4(v[4], v[5], v[6], v[7]);
    }
}

#define EMBED(name, id)                                                                          \
    extern "C" __global__ void __launch_bounds__(128)                                            \
        embed_##name(const int32_t* ids, const uint8_t* table, float* out, int n_vocab,          \
                     int d_model, long long row_bytes, float scale) {                            \
        embed_rows<id>(ids, table, out, n_vocab, d_model, row_bytes, scale);                     \
    }
FOR_EACH_FORMAT(EMBED)
