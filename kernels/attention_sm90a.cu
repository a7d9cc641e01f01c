// attention_sm90a.cu: causal prefill attention on Hopper's wgmma tensor cores
// (kernel v3, sm_90a only), FlashAttention-3's design, for a bf16 cache and for
// every quantized cache of src/kv (fp8, int8, k8v4, nvfp4, k4v2, vq2).
//
// attn_wgmma_d<D>_bf16_<out>(AttnWgmmaArgs), D = 64 or 128, and
// attn_wgmma_d<D>_<fmt>_<out>(AttnWgmmaCodedArgs), fmt = fp8 (out f32, bf16),
// int8, k8v4, nvfp4, k4v2 or vq2 (out f32), K and V rows of src/kv's layout (the row
// structs RowBytes, RowInt4G32, RowInt2G32, RowNvfp4, RowVq2 below; bytes per row at
// d 64 / 128: one-byte codes and an f32 row scale (fp8, int8, K of k8v4) 80 / 144,
// int4-g32 (V of k8v4, K of k4v2) 48 / 80, int2-g32 (V of k4v2) 32 / 48, nvfp4 48 /
// 80, vq2 32 / 48), Hadamard-rotated or not as AttnWgmmaCodedArgs::rot says
// (vq2's codebook in AttnWgmmaCodedArgs::book): the contract of
// attn_flash_* (kernels/attention.cu): query t of window s (position pos0 + t)
// of head h attends to the cached keys kp of KV head h / (n_heads / n_kv_heads)
// with kp <= pos0 + t and, when window > 0, pos0 + t - kp < window; the cache
// holds positions [0, pos0 + n_tokens) of every window (earlier passes plus this
// one); a batched pass holds n_seqs windows; optional tanh soft-cap.
// Numerics: those of v2, so the default route's bounds hold unchanged: q (f32)
// rounded to bf16 (nearest even) when staged; S = Q·Kᵀ in f32; x = S * scale
// (or cap * tanh(S * scale / cap)) times log2(e), masked to -inf; online softmax
// in f32 (row max over the quad, exp2 by ex2.approx, l sums the unrounded f32
// probabilities); P rounded to bf16 for P·V; O in f32; output O / l. Only the
// order of f32 sums differs from v2: inside the MMAs, and each thread's share
// of a row sum l, added in 4 partial sums. A coded cache: K and V decoded (code
// value * row scale in f32) and rounded to bf16, the rounding a bf16 cache gets
// (v2 folds fp8 / int8 scales into S's and P's columns instead: there v3's operands
// differ); K's fold is built behind FOLD_K, off (below).
//
// Algorithm: a work item is BM = 128 queries of one head of one window; it
// walks the key tiles of BN = 128 keys that any of its queries can see. The
// grid is persistent: min(n_items, n_SMs) blocks, block b taking items b,
// b + gridDim.x, ... of the list ordered longest causal rows first (query tile
// n_qt - 1 of every head and window, then n_qt - 2, ...; heads of one KV head
// adjacent). Warp specialization (384 threads):
// warpgroup 0 is the producer (one thread; setmaxnreg gives its registers to
// the consumers): it fills ST = stages(D) stages of K and of V (4 at d 64, 2 at
// d 128), each BN rows x D bf16, item after item (the stage ring runs on across
// items, so the next item's first tiles load while this one ends), by TMA
// (cp.async.bulk.tensor.3d over the cache seen as (d_head,
// kv_len, n_seqs * n_kv_heads): 128-byte swizzle, one box of 64 columns x BN
// rows per 64 columns of d_head, rows at or past kv_len = pos0 + n_tokens
// zero-filled by the TMA unit, so nothing past the cached positions is read),
// completing on the stage's full_k / full_v mbarriers, after waiting on the
// stage's empty_k / empty_v mbarrier (K and V released apart, so the next K
// streams in while this V is still read). Warpgroups 1 and 2 are consumers of 64 query rows
// each: per item, Q is staged into shared memory by the consumers (f32 -> bf16,
// all loads issued before the first store, laid out in the same 128-byte
// swizzle, then fence.proxy.async); per tile
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
// every tile of the item (masking decides what counts). Ping-pong (FA3's
// inter-warpgroup scheduling; pp, 2026-12-04): from an item's second tile on, a
// warpgroup issues its S and P·V wgmmas only in its turn (named barrier 4 + c, 256
// threads) and hands the turn to the other (bar.arrive 5 - c) once they are issued,
// so one warpgroup's softmax runs while the other's products hold the tensor cores;
// warpgroup 0 takes the first turn once per launch, and the two walk the same tiles,
// so the turns pair up across items. H200, ctx 4096, TFLOP/s, against no ping-pong in
// the same call (docs/performance.md, pp): bf16 d 128 455.5 / 423.8, 8B 32/8 501.8 /
// 458.7, d 64 307.2 / 301.1; every coded kernel 0.5-4.6 % faster at d 128, the d 64
// attn-int8-qk, attn-fp8-qk and attn-f16 kernels 3.6-12.1 %. Not for the d 64
// decoding kernels of fp8, int8 and k8v4 (PINGPONG below), 0.8-1.8 % slower with it.
// The softmax is straight-line code: the consumer's walk is compiled twice
// (without and with the soft-cap, chosen once per launch) and each holds two
// softmax bodies, one for tiles every key of which each row of the warp sees (no
// compare) and one masked (two compares per score against per-row bounds). The
// first version of v3 inlined both the tanh path and the mask test behind
// branches for each of its 64 scores per thread: about 3100 instructions per
// tile loop (SASS of nvcc 13.0's ptxas), and Nsight Compute on the H200 showed warps stalled on instruction
// fetch ("no instruction", 5.2 of 12.6 cycles per issued instruction) with the
// tensor pipe 19 % busy; in this version the softmax of a tile is about 355
// instructions unmasked and 570 masked (plus about 100 for the rescale of O and
// the packing of P), and the no-instruction stalls are gone (0.04 cycles, tensor
// pipe 50 % busy at d 128; docs/performance.md, "Prefill attention kernels", attn4).
// A coded cache (every quantized format): the producer warpgroup is 128 decoding threads
// (setmaxnreg 56 for them, 224 for the consumers, against 24 / 240 for a bf16 cache;
// 40 / 232 under attn-fp8-qk and attn-int8-qk, and for every coded cache until prod56,
// 2026-12-03: docs/performance.md). wg2 (2026-12-04): vq2's decoding and attn-f16
// kernels and the d 64 decoding kernels of int8 and k8v4 have a second producer
// warpgroup, warpgroup 3 (512 threads, NPW = 2 in CacheCoded, the last argument of
// ATTN_WGMMA_CODED / ATTN_WGMMA_QF, mirrored by ops::ATTN_V3_TWO_PRODUCERS): the 256
// decoding threads split each tile's rows (decode_tile with NT = 256: a thread's chunks
// of a tile, 8 at d 128 and 4 at d 64, all loaded before the first is converted), at
// setmaxnreg 32 against the consumers' 224 (2 x 128 x 32 + 2 x 128 x 224 = 65,536, the
// 128 x 512 a block launches with); their arrivals count 256 and their named barrier 256
// threads; thread 0 of warpgroup 0 alone issues the TMA copies. H200, ctx 4096, TFLOP/s,
// against one producer warpgroup in the same call: vq2 d 128 attn-f16 325.9 / 314.1 with
// 4 chunks in flight, then 335.6 with 8 against those 4's 325.4 (ctx 512: 142.9 / 147.9),
// decoding 311.4 / 300.2; d 64 decoding int8 263.9 / 254.8, k8v4 255.1 / 246.1, vq2 263.2
// / 259.8. The others keep one: fp8's decoding kernel and k4v2's
// attn-f16 ran slower with two (351.8 / 358.5, 307.9 / 316.1 at d 128), nvfp4's kernels
// within 1 % either way, and at ctx 512 d 128 every decoding kernel 3-5 % slower.
// Thread 0 brings the stored K rows and V rows of the tiles, as stored, by
// TMA (a 3-D byte map over the rows, box (row bytes, BN, 1), no swizzle, rows past
// kv_len zero-filled) into raw stages: two for K (tile g in stage g % 2, so tile
// g + 1's rows land while tile g decodes) and one for V (raw_k[2] / raw_v
// mbarriers); all NT decoding threads (128, or 256 under wg2) wait for bf16 stage g %
// ST to be released (empty_k), decode tile g into it (decode_tile, written in the same
// 128-byte swizzle the TMA gives a bf16 tile, so the consumers read it unchanged; each
// thread keeps one column unit of RC::UNIT 8-column chunks that share their scale
// fields (2 for nvfp4's 16-element blocks, else 1; unit, 2026-12-04) and issues the shared loads of 8 chunks back to
// back before it converts and stores them, since its loads and stores are volatile asm
// that the compiler keeps in order), issue fence.proxy.async.shared::cta (their
// st.shared made visible to wgmma's async proxy) and arrive on full_k (count NT);
// after a named barrier among the NT (the raw stage read) thread 0 fetches tile g + 2's K
// rows into it; the same for V (tile g + 1). The decode of each format is kernel
// v2's (attention.cu flash::Dec*: code value * scale in f32, nvfp4 (e2m1 * e4m3) * S,
// vq2 codeword * rms), rounded to bf16; vq2's codebook is copied into shared
// memory by the producer before its first decode and read there, one copy per lane of
// those a load serves together (BOOK_BYTES: no bank conflicts whatever the indices).
// With FOLD_K (off: attn7 measured it no faster, 310-314 against 314-316 TFLOP/s
// for fp8 at d 128, docs/performance.md), K (one-byte codes) is folded as kernel
// v2 folds it (attention.cu DecByte): the
// bf16 K tile holds the exact code values (every E4M3 value and every int8 is a
// bf16), and beside it the producer stores the tile's 128 column factors kfac =
// row scale * (scale * log2 e) (the row scale alone under a soft-cap), in the order
// the consumer lanes read them (store_kfac); a consumer multiplies S's column by its
// factor where a bf16 cache multiplies by scale * log2 e (no extra multiply: 8
// 16-byte shared loads per thread per tile, issued while S's wgmmas run, before the
// K stage is released), q·(c s) = (q·c) s. This drops the decode's
// multiply and scale load for K (attn6 measured the multiply of K and V together at
// 13 % of the fp8 kernel's time: no multiply at all ran at 361 against 323.5
// TFLOP/s). Without it (the build), K is decoded as V is: code value * scale in
// f32 (__fmul_rn), rounded to bf16 nearest even: src/kv's decode, then the rounding
// a bf16 cache gets. Folding V too
// would move 64 multiplies per tile onto each consumer thread (P's columns, before
// P's rounding): per SM sub-partition two consumer warps would pay for what one
// producer warp saves, so it is not done. No dequantized copy of the cache exists; a
// poisoned row (NaN scale, or a NaN code) gives NaN as on the CPU. Rotated rows
// stay in the rotated basis, as in v2: a rotated K is met by staging q as (H q) / n (n = D; the f32 butterflies of hadamard_frag in its order: column
// bits 0-2 in a thread's 8-element chunk, the higher ones across the lanes of a
// row by shuffles; times the exact 1/n, then the bf16 rounding), a rotated V by
// rotating the output back, O = (H O') / n with O' = Σ p y / l in f32
// (hadamard_frag on the accumulator layout, v2's code).
// The named fast path attn-fp8-qk (attn_wgmma_d<D>_fp8qk_<out>, AttnWgmmaQkArgs; an
// fp8 cache at d 64 / 128; ops::attention_coded_fp8_qk): S = Q·Kᵀ on K's stored E4M3
// codes, so the producer does nothing for K but copies. Thread 0 brings each tile's
// codes by TMA straight into the K stage (kc: a map of the D code bytes of each row,
// row stride the row bytes, box (D, BN, 1), 128-byte swizzle at D 128, 64-byte at D 64:
// the K-major layout wgmma reads, rows of D bytes = one swizzle span), completing on
// full_k with its arrival (after its column factor); the raw K stages hold only the 16
// bytes from byte D of each row (a.k: box (16, BN, 1), the f32 scale first), from which
// the 128 threads store K's column factors kfac = row scale * (scale * log2 e) (the row
// scale alone under a soft-cap) as FOLD_K does (store_kfac), into a ring of 2 ST slots
// the consumers read during the softmax (not into registers ahead of it). V as the fp8
// kernel. The
// consumers stage Q as two e4m3 tiles (each 64 rows x D bytes per warpgroup, the same
// swizzle): per row a power of two sq = 2^(7 - floor(log2 max|q|)) (max |q sq| in [128,
// 256), inside E4M3's ±448; a power of two, so q sq is exact), hi = e4m3(q sq), lo =
// e4m3(q sq - hi) (the difference exact in f32), each rounded to nearest even; and 1 /
// sq per row in shared memory (qfac). S = hi·Kᵀ + lo·Kᵀ: wgmma m64n128k32 e4m3 x e4m3
// into one f32 accumulator, 2 D / 32 instructions (as many as D / 16 bf16 k-steps).
// Scores: y = S * kfac (the column's factor, one multiply as a bf16 cache's
// `scale * log2 e`), masked, the row max taken over y (1 / sq > 0 keeps the order), p =
// exp2(y / sq - m / sq) as one FFMA (y, 1 / sq, -m / sq) where v3 has one FADD, corr =
// exp2((m_old - m) / sq); under a soft-cap x = cap tanh(S kfac (scale / sq) / cap) log2 e
// as v3. Numerics against v3's fp8 kernel: q carried to about 2^-8 relative per element
// (hi's 4 significant bits, then lo's 4; elements below 2^-9 of the row's largest lose
// lo to E4M3's subnormal step) where v3 rounds it to bf16 (2^-9); K exact where v3
// rounds code * scale to bf16; the e4m3 MMA's f32 accumulation (its internal
// alignment of products is not IEEE f32); P, V and O as v3. A NaN in q or a code gives
// NaN; an infinite q saturates to ±448 (v3: NaN or inf), a rotated K as v3 (q rotated
// before the split).
// The named fast path attn-int8-qk (attn_wgmma_d<D>_<int8|k8v4>qk_f32,
// AttnWgmmaCodedArgs as the decoding kernels; an int8 or k8v4 cache, whose K rows are
// alike: D int8 codes, the f32 scale at byte D; ops::attention_coded_int8_qk), since
// qh (2026-12-03): S = Q·Kᵀ on K's codes in f16. The producer decodes each K tile into
// the K stage as the code values themselves, exact in f16 (decode_tile DEC_HCODES: a
// byte permute into the f16 1024's mantissa and one HSUB2 per pair, CodeInt8::h4), and
// stores K's column factors kfac = row scale * (scale * log2 e) (the row scale alone
// under a soft-cap) into attn-fp8-qk's ring of 2 ST slots. The consumers stage Q in
// f16, per row times a power of two sq with max |q sq| in [2^14, 2^15) (f16's largest
// finite is 65504; exact), rounded to nearest even, 1 / sq in qfac; S by f16 wgmma
// m64n128k16 (as bf16's k-steps) into f32; then as attn-fp8-qk: y = S kfac, p =
// exp2(y / sq - m / sq). Against qk10/qk11's kernel (S by s8 wgmma on the codes as
// TMA'd, q as int8 hi + lo / 256, an s32 shift between the two halves), the consumers
// lose the shift, the FADD that read S back and the wait between lo and hi; the
// producer gains about 1 instruction an element of K. H200 (docs/performance.md, qh),
// TFLOP/s, f16 / s8 kernel: ctx 4096 d 128 int8 336.4 / 332.3, k8v4 327.9 / 322.9; 8B
// 32/8 ctx 4096 int8 359.0 / 344.2; faster at every shape measured. Numerics against
// v3's int8 kernel: q to 2^-11 relative (f16; rows whose largest |q| is below 2^-112
// are not scaled) where v3 rounds it to bf16 (2^-9); K exact where v3 rounds code *
// scale to bf16; the f16 products exact in the f32 accumulation (the MMA's internal
// alignment as bf16's). A NaN or infinite q carries into its row's scores (sq = 1); a
// rotated K as v3 (q rotated before the scaling).
// P·V under attn-int8-qk (FV; pv16, 2026-12-03): V's codes in f16 and P in f16 (the
// f16 wgmma), where the other kernels use bf16. Per tile the producer takes the largest
// scale field of the tile's BN V rows (tile_vexp: each warp reads all BN rows'), its
// exponent e (clamped to [1, 253]; 127 for a zero tile or a non-finite scale), and
// writes each element as code * r, r = f16(scale * 2^(127 - e)) < 4, rounded to f16
// (decode_tile DEC_F16: the code exact in f16 by a byte permute and one HSUB2 (int8), one
// cvt per pair (E4M3), a permute, one LOP3 and one HADD2 per pair (int4, since hadd); then
// one HMUL2 per pair), and e per stage. The consumers keep O in units of 2^(e - 127) of
// the last tile added: before tile i's P·V, O is rescaled by corr times 2^(e(i - 1) -
// e(i)) (exact), and the output is O 2^(e - 127) / l. This moves V's decode from about
// 3.4 (E4M3) and 4.1 (int8) instructions an element (f32 convert, f32 multiply, bf16
// pack) to about 1 to 2.4, on the producer warps that share the SM sub-partitions' issue
// slots with the consumers. H200, ctx 4096 d 128 (docs/performance.md, pv16): int8 321.2 -> 328.9
// TFLOP/s, k8v4 308.4 -> 322.8; the same P·V under attn-fp8-qk measured 363.8 against
// 370.5 (its E4M3 decode was cheaper to begin with), so attn-fp8-qk keeps bf16. Numerics against v3's bf16 P·V: P to 2^-12 relative (f16, down to 2^-14;
// then 2^-25 absolute) where v3 has 2^-9; V to 2^-11 + 2^-12 relative of each element
// (r's rounding, then the product's) where v3 rounds code * scale to 2^-9; a row whose
// scale is 2^14 or more below its tile's largest has its elements in f16's subnormal
// range (absolute error 2^-25 of the tile's unit, a bf16 rounding's worth at 2^24 below),
// and rows about 2^25 below the largest vanish (r rounds to 0).
// The named fast path attn-f16 (attn_wgmma_d<D>_<nvfp4|k4v2|vq2>f16_f32,
// AttnWgmmaCodedArgs as the decoding kernels; ops::attention_coded_f16; 2026-12-03): the
// decoding kernels computing in f16 where they round to bf16. The producer writes K and
// V in f16 as pv16 writes attn-int8-qk's V (decode_tile DEC_F16, tile_vexp): each element
// code value * f16(scale * 2^(127 - e)), e the exponent of the tile's largest scale
// field, with nvfp4's e2m1 / 64 exact in f16 (CodeNvfp4::codes8) times f16(e4m3 * f16(S *
// 64 * 2^(127 - e))) (one HMUL2 a block, one a pair; c2, 2026-12-03), int2's 2 (code -
// 1.5) exact by a shift, one LOP3 and one HADD2 a pair (hadd) times f16(scale * 2^(126 -
// e)), vq2's codewords from f16 copies of the codebook (each value rounded to f16, written at
// the kernel's start) times f16(rms * 2^(127 - e)); an nvfp4 K chunk in the order 0, 2,
// 4, 6, 1, 3, 5, 7 (DEC_F16K: the E4M3 bytes of the even and the odd nibbles straight
// from q, no byte permute), q's chunk staged alike. K's 2^(e - 127) times kmul is every
// column's factor, one float per tile in attn-int8-qk's ring (the consumers multiply S by
// it as a bf16 cache's by scale * log2 e); q in f16 times a power of two per row, S by
// f16 wgmma, the softmax, P in f16, P·V by f16 wgmma and O's units as attn-int8-qk's.
// Numerics against the decoding kernel: each element through f16 roundings of at most
// 2^-11 relative each, two for int4 and int2 (r's, then the product's), three for nvfp4
// (r's, e4m3 * r's, the product's; e4m3 * r < 448 * 128, inside f16's range) and for vq2
// (the codeword's, r's, the product's), where that kernel rounds code * scale to bf16
// (2^-9 once), except in rows whose scales lie 2^14 or more below the tile's largest
// (f16's subnormals, as pv16's V). H200, ctx 4096 d 128, TFLOP/s, this / decoding kernel
// (docs/performance.md, attn-f16): nvfp4 264.0 / 259.1, k4v2 286.6 / 287.6, vq2 264.3 /
// 248.1; a second raw V stage measured no faster at ctx 4096 and 4-9 % slower at ctx 512;
// nvfp4's K in DEC_F16K's order: 268.4 (the decoding kernel 252.1 in that call); after
// prod56 (setmaxnreg 56): nvfp4 294.8, k4v2 306.5, vq2 283.5; c2: nvfp4 +1.2 % at d 128,
// +3.1 % at d 64.
// Not covered here (the launcher sends them to v2): d_head 96 and 256, misaligned q /
// out.
// attn-fp8-qk: raw K stages of BN * 16 bytes, 2 ST slots of K's factors (not ST), plus BM
// f32 (qfac), plus 32 bytes (unused; attn-int8-qk: V's exponent per stage): d 128 190080 bytes, d 64 167616. attn-int8-qk: the coded cache's size
// below plus ST * 128 * 4 (the second ST slots of K's factors), BM f32 and those 32
// bytes: int8 d 128 222848, d 64 184000; k8v4 d 128 214656, d 64 179904.
// Launch: grid (min(n_items, n_SMs), 1, 1), n_items = ceil(n_tokens / 128) *
// n_heads * n_seqs; block 384 (512 with two producer warpgroups), dynamic
// shared memory 1024 (alignment slack) + 128 * D * 2 (Q) + 2 * ST * 128 * D * 2
// (K, V) + 4 * ST * 8 (barriers): d 128 164928 bytes, d 64 148608; a coded
// cache adds 128 * (2 * K row bytes + V row bytes) (raw K x 2, V) + 32 (their
// barriers) + ST * 128 * 4 (K's column factors): fp8 / int8 d 128 221280 bytes, d 64
// 181408; k8v4 d 128 213088, d 64 177312; nvfp4 d 128 196704, d 64 169120; k4v2 d 128
// 192608, d 64 167072; vq2 (the codebook's BOOK_BYTES included) d 128 217184, d 64 195744.
// The launcher (ops::attention_v3) mirrors BM, BN and stages(D).
// CPU twin: backend::cpu::attention::attention on the same bf16-rounded q, k, v
// (tests/gpu_ops.rs attention_case); a coded cache: the CPU backend's attention op
// with the same format, and the CPU attention on v3's own operands (K: the exact
// decoded values, the row scale in f32 as v2; V: decoded elements rounded to bf16;
// (H q) / n rounded; tests/gpu_ops.rs attention_coded_case, V2Operands for V3).
#include "sm90a.cuh"

namespace attn3 {
constexpr int THREADS = 384;  // a producer and two consumer warpgroups; 128 * (2 + NPW) in general
constexpr int BM = 128;     // queries per block (2 consumer warpgroups of 64)
constexpr int BN = 128;     // keys per tile
constexpr int BOX = 64;     // columns per TMA box (128 bytes: the swizzle span)

// Eight accumulator registers' constraints (d[i] .. d[i + 7]).
#define ATTN3_O64(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
// D(64 x 128, f32) += A(64 x 16, TY, K-major, smem) * B(128 x 16, TY, K-major, smem)ᵀ, TY =
// bf16 (wgmma_ss_m64n128k16) or f16 (..._f16: attn-int8-qk's Q·Kᵀ on K's codes in f16).
#define ATTN3_WGMMA_SS_N128(NAME, TY)                                                                                  \
    __device__ __forceinline__ void NAME(float d[64], uint64_t desc_a, uint64_t desc_b) {                              \
        asm volatile(                                                                                                  \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                               \
            "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "                                               \
            "{"                                                                                                        \
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                   \
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                         \
            "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                         \
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"                           \
            "}, %64, %65, p, 1, 1, 0, 0;\n}\n"                                                                        \
            : ATTN3_O64(0), ATTN3_O64(8), ATTN3_O64(16), ATTN3_O64(24), ATTN3_O64(32), ATTN3_O64(40), ATTN3_O64(48),   \
              ATTN3_O64(56)                                                                                            \
            : "l"(desc_a), "l"(desc_b), "r"(1)                                                                         \
            : "memory");                                                                                               \
    }
// P·V: D(64 x N, f32) += A(64 x 16, TY, registers) * B(16 x N, TY, MN-major smem: rows of N
// contiguous), N = 128 (wgmma_rs_m64n128k16_tb) or 64 (..._n64...), TY = bf16 (the plain
// and coded kernels) or f16 (attn-int8-qk's P·V on V's codes, ..._f16).
#define ATTN3_WGMMA_RS_N128(NAME, TY)                                                                                  \
    __device__ __forceinline__ void NAME(float d[64], const uint32_t a[4], uint64_t desc_b) {                          \
        asm volatile(                                                                                                  \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                               \
            "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "                                               \
            "{"                                                                                                        \
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                   \
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                         \
            "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                         \
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"                           \
            "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                                           \
            : ATTN3_O64(0), ATTN3_O64(8), ATTN3_O64(16), ATTN3_O64(24), ATTN3_O64(32), ATTN3_O64(40), ATTN3_O64(48),   \
              ATTN3_O64(56)                                                                                            \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1)                                         \
            : "memory");                                                                                               \
    }
#define ATTN3_WGMMA_RS_N64(NAME, TY)                                                                                   \
    __device__ __forceinline__ void NAME(float d[32], const uint32_t a[4], uint64_t desc_b) {                          \
        asm volatile(                                                                                                  \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                               \
            "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                                                \
            "{"                                                                                                        \
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                   \
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"                           \
            "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"                                                           \
            : ATTN3_O64(0), ATTN3_O64(8), ATTN3_O64(16), ATTN3_O64(24)                                                 \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1)                                         \
            : "memory");                                                                                               \
    }
ATTN3_WGMMA_RS_N128(wgmma_rs_m64n128k16_tb, "bf16")
ATTN3_WGMMA_RS_N128(wgmma_rs_m64n128k16_tb_f16, "f16")
ATTN3_WGMMA_RS_N64(wgmma_rs_m64n64k16_tb, "bf16")
ATTN3_WGMMA_RS_N64(wgmma_rs_m64n64k16_tb_f16, "f16")
ATTN3_WGMMA_SS_N128(wgmma_ss_m64n128k16, "bf16")
ATTN3_WGMMA_SS_N128(wgmma_ss_m64n128k16_f16, "f16")

// attn-fp8-qk: D(64 x 128, f32) += A(64 x 32, e4m3, K-major, smem) * B(128 x 32, e4m3,
// K-major, smem)ᵀ (fp8 operands are K-major only: no transpose immediates).
__device__ __forceinline__ void wgmma_ss_m64n128k32_e4m3(float d[64], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1;\n}\n"
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

// attn-fp8-qk: the descriptor of a K-major e4m3 tile whose rows are D bytes (one
// swizzle span: 128-byte swizzle at D 128, 64-byte at D 64), 8-row groups 8 D bytes
// apart (stride byte offset), leading byte offset unused (1). The tile base is aligned
// to 8 D bytes, so a k-step of 32 bytes is the start address plus 32 (the swizzle
// applies to the address bits, as with a bf16 tile's k-steps).
template <int D>
__device__ __forceinline__ uint64_t qk_desc(uint32_t addr) {
    static_assert(D == 64 || D == 128, "qk_desc: rows of 64 or 128 bytes");
    constexpr uint64_t layout = D == 128 ? 1 : 2;  // 128B or 64B swizzle
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)((8 * D) >> 4) << 32) | (layout << 62);
}
// Byte offset of 16-byte chunk j of row r in such a tile (the TMA unit's swizzle:
// 128B: chunk j ^ (r % 8); 64B: chunk j ^ ((r / 2) % 4)).
template <int D>
__device__ __forceinline__ uint32_t qk_chunk(int r, int j) {
    const int x = D == 128 ? (r & 7) : ((r >> 1) & 3);
    return r * D + ((j ^ x) << 4);
}
// Two f32 as e4m3 (round to nearest even, saturating to ±448; NaN stays NaN): lo into
// the low byte; and back to f32 (exact).
__device__ __forceinline__ uint32_t e4m3x2_of(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float2 f32x2_of_e4m3x2(uint32_t w) {
    uint32_t h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h) : "h"((unsigned short)(w & 0xFFFFu)));
    return __half22float2(*reinterpret_cast<const __half2*>(&h));
}
__device__ __forceinline__ void st_shared_v2(uint32_t addr, uint32_t x, uint32_t y) {
    asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" ::"r"(addr), "r"(x), "r"(y) : "memory");
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

__device__ __forceinline__ uint2 ld_shared_v2(uint32_t addr) {
    uint2 v;
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void st_shared_f32(uint32_t addr, float v) {
    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
    uint32_t v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
// N = 1, 2 or 4 consecutive 32-bit words from `addr` (aligned to 4 N bytes), one shared load.
template <int N>
__device__ __forceinline__ void ld_shared_words(uint32_t addr, uint32_t w[N]) {
    static_assert(N == 1 || N == 2 || N == 4, "ld_shared_words: 1, 2 or 4 words");
    if constexpr (N == 1) {
        w[0] = ld_shared_u32(addr);
    } else if constexpr (N == 2) {
        const uint2 v = ld_shared_v2(addr);
        w[0] = v.x, w[1] = v.y;
    } else {
        const uint4 v = ld_shared_v4(addr);
        w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    }
}

__device__ __forceinline__ __half2 as_h2(uint32_t x) { return *reinterpret_cast<const __half2*>(&x); }
__device__ __forceinline__ uint32_t h2_bits(__half2 v) { return *reinterpret_cast<const uint32_t*>(&v); }
// Eight f16 code values (four f16x2 words) times the f16 pair r2, each product rounded
// to f16 (HMUL2); the float overload rounds r to f16 first: attn-int8-qk's V elements
// (decode_tile's DEC_F16).
__device__ __forceinline__ uint4 mul_h8(const uint32_t h[4], __half2 r2) {
    return make_uint4(h2_bits(__hmul2(as_h2(h[0]), r2)), h2_bits(__hmul2(as_h2(h[1]), r2)), h2_bits(__hmul2(as_h2(h[2]), r2)),
                      h2_bits(__hmul2(as_h2(h[3]), r2)));
}
__device__ __forceinline__ uint4 mul_h8(const uint32_t h[4], float r) { return mul_h8(h, __float2half2_rn(r)); }

// The f16 pair (1024, 1024) as bits, 0x64006400, from a volatile asm move: ptxas keeps it
// in a register, so that and_or below is one LOP3 (given the constant itself, it split
// the mask and the OR into two LOP3s with one immediate each; hadd, 2026-12-04).
__device__ __forceinline__ uint32_t f16_exp_pair() {
    uint32_t c;
    asm volatile("mov.b32 %0, 0x64006400;\n" : "=r"(c));
    return c;
}
// (a & M) | c, one LOP3.
template <uint32_t M>
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t c) {
    uint32_t x;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(x) : "r"(a), "n"(M), "r"(c));
    return x;
}
// Bytes of one row of one-byte codes (src/kv: D codes, the f32 scale, zeros to a multiple of 16).
__host__ __device__ constexpr int coded_row_bytes(int d) { return (d + 4 + 15) / 16 * 16; }

// The stored rows the producer decodes (src/kv/codec.rs), one struct per row codec
// (kernel v2's flash::Dec* arithmetic, kernels/attention.cu): bytes(D) per row;
// `load<U>(row, c0, q)` the codes of elements 8c0 .. 8(c0 + U) - 1, chunk i (8 elements)
// in q[i] (row = the row's shared address; c0 a multiple of U);
// `scale<D>(row, c)` the scale fields they need, loaded as stored; `dec8(q, s, v, book)`
// their decoded values, src/kv's decode (code value times scale, one __fmul_rn; nvfp4
// (e2m1 * e4m3) * S, the inner product exact; vq2 codeword * rms, the codeword from the
// block's shared copy of the codebook at `book`). ONE_SCALE: one f32 scale per row, the
// code values exact in bf16 (`cvt8`, for FOLD_K); BOOK: the codebook is read; UNIT:
// decode_tile's unit, consecutive chunks from a multiple of UNIT that share all their
// scale fields (loaded, and their factor formed, once per unit).
__device__ __forceinline__ uint32_t ld_shared_u16(uint32_t addr) {
    unsigned short v;
    asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ uint32_t ld_shared_u8(uint32_t addr) {
    uint32_t v;
    asm volatile("ld.shared.u8 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
// vq2's codebook in shared memory, replicated so that the lookups of a warp never meet
// in a bank (random codeword indices put about 3 lanes of 16 on one bank pair, a 3-way
// conflict, when every lane read one copy): 128 bytes per codeword, codeword i's copy j
// at 128 i + W j, W = 16 bytes (f32, 8 copies: a 16-byte load is served 8 lanes at a
// time) or 8 (attn-f16's f16, 16 copies: 16 lanes at a time); lane l reads copy l % (128
// / W), so the lanes served together read 8 or 16 different bank groups whatever their
// indices. 256 x 128 bytes (vqbook, 2026-12-03).
constexpr int BOOK_BYTES = 256 * 128;
// A codeword of the shared codebook: not volatile (the book is written once, before the
// producer's first decode, behind a barrier), so the compiler may issue the lookups of
// several chunks together; the address depends on the (volatile) index load.
__device__ __forceinline__ float4 ld_book(uint32_t addr) {
    float4 v;
    asm("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr));
    return v;
}

// The largest |scale| bits of N f32 scale fields at `addr` (tile_vexp's per-row input:
// nonnegative floats order as their bits).
template <int N>
__device__ __forceinline__ uint32_t smax_f32s(uint32_t addr) {
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) m = max(m, __float_as_uint(ld_shared_f32(addr + 4 * i)) & 0x7FFFFFFFu);
    return m;
}

// D one-byte codes (fp8: CodeE4m3, int8: CodeInt8), the f32 row scale at byte D.
template <typename CODE>
struct RowBytes {
    static constexpr bool ONE_SCALE = true, BOOK = false, K_PERMUTED = false;
    static constexpr int UNIT = 1;  // 2 measured 1.3-1.4 % slower (attn-int8-qk d 128, fp8 d 64)
    static __host__ __device__ constexpr int bytes(int d) { return coded_row_bytes(d); }
    using Raw = uint2;
    using Scale = float;
    template <int U>
    static __device__ __forceinline__ void load(uint32_t row, int c0, Raw q[U]) {
        uint32_t w[2 * U];
        ld_shared_words<2 * U>(row + 8 * c0, w);
#pragma unroll
        for (int i = 0; i < U; ++i) q[i] = make_uint2(w[2 * i], w[2 * i + 1]);
    }
    template <int D>
    static __device__ __forceinline__ Scale scale(uint32_t row, int) { return ld_shared_f32(row + D); }
    static __device__ __forceinline__ void cvt8(Raw q, float v[8]) {
        CODE::cvt4(q.x, v);
        CODE::cvt4(q.y, v + 4);
    }
    static __device__ __forceinline__ void dec8(Raw q, Scale s, float v[8], uint32_t) {
        cvt8(q, v);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = __fmul_rn(v[j], s);
    }
    template <int D>
    static __device__ __forceinline__ uint32_t smax_bits(uint32_t row) { return __float_as_uint(ld_shared_f32(row + D)) & 0x7FFFFFFFu; }
    static __device__ __forceinline__ uint4 dech8(Raw q, Scale s, float rmul, uint32_t) {
        uint32_t h[4];
        CODE::h4(q.x, h);
        CODE::h4(q.y, h + 2);
        return mul_h8(h, s * rmul);
    }
    // The eight code values themselves in f16, exact (decode_tile DEC_HCODES).
    static __device__ __forceinline__ uint4 hcodes8(Raw q) {
        uint32_t h[4];
        CODE::h4(q.x, h);
        CODE::h4(q.y, h + 2);
        return make_uint4(h[0], h[1], h[2], h[3]);
    }
};
// int4-g32 (V of k8v4, K of k4v2): D/2 bytes of nibbles q + 8 (element i in byte i / 2,
// the low nibble first), D/32 f32 group scales at byte D/2, zeros to a multiple of 16;
// value (q - 8) * s (DecInt4G32). The nibble as the low mantissa bits of 2^23 is the
// float 2^23 + q exactly; subtracting 2^23 + 8 (exact) leaves q - 8.
struct RowInt4G32 {
    static constexpr bool ONE_SCALE = false, BOOK = false, K_PERMUTED = false;
    static constexpr int UNIT = 1;  // 4 (with int2-g32 at 4): k4v2 attn-f16 d 128 1.5 % slower, k8v4 +0.5-1 %
    static __host__ __device__ constexpr int bytes(int d) { return (d / 2 + 4 * (d / 32) + 15) / 16 * 16; }
    using Raw = uint32_t;
    using Scale = float;
    template <int U>
    static __device__ __forceinline__ void load(uint32_t row, int c0, Raw q[U]) { ld_shared_words<U>(row + 4 * c0, q); }
    template <int D>
    static __device__ __forceinline__ Scale scale(uint32_t row, int c) { return ld_shared_f32(row + D / 2 + 4 * (c / 4)); }
    static __device__ __forceinline__ void dec8(Raw q, Scale s, float v[8], uint32_t) {
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = __fmul_rn(__fsub_rn(__uint_as_float(0x4B000000u | ((q >> (4 * j)) & 0xFu)), 8388616.0f), s);
    }
    template <int D>
    static __device__ __forceinline__ uint32_t smax_bits(uint32_t row) { return smax_f32s<D / 32>(row + D / 2); }
    // Byte i of q (elements 2i, 2i + 1) into the halves of an f16x2 under the exponent
    // byte 0x64 (f16 1024, ulp 1): byte i of q to the low half, byte i of q >> 4 to the
    // high (one permute), each masked to its low nibble n: 1024 + n; one HADD2 of -1032
    // leaves n - 8 exactly. (hadd, 2026-12-04: before, an HFMA2 by (1, 1/16) with the high
    // nibble kept in place, whose constants ptxas reloaded by a MOV per pair at the
    // producer's 56 registers; with this and RowInt2G32's, k4v2's attn-f16 at ctx 4096 d 128
    // 336.6 TFLOP/s against 320.0, 8B 32/8 357.2 / 341.1, k8v4's attn-int8-qk 340.7 / 336.8:
    // docs/performance.md, "hadd".)
    static __device__ __forceinline__ uint4 dech8(Raw q, Scale s, float rmul, uint32_t) {
        const uint32_t t = q >> 4, c = f16_exp_pair();
        uint32_t h[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t x = and_or<0x000F000Fu>(__byte_perm(q, t, 0x4400u + 0x1111u * i), c);
            h[i] = h2_bits(__hadd2(as_h2(x), as_h2(0xE408E408u)));
        }
        return mul_h8(h, s * rmul);
    }
};
// int2-g32 (V of k4v2): D/4 bytes of 2-bit codes (element 4i + j in bits 2j .. 2j + 1 of
// byte i), D/32 f32 group scales at byte D/4; value (q - 1.5) * s (DecInt2G32). 2q in
// the low mantissa bits of 2^22 (ulp 0.5) is the float 2^22 + q exactly; subtracting
// 2^22 + 1.5 (exact) leaves q - 1.5.
struct RowInt2G32 {
    static constexpr bool ONE_SCALE = false, BOOK = false, K_PERMUTED = false;
    static constexpr int UNIT = 1;  // 4: see RowInt4G32
    static __host__ __device__ constexpr int bytes(int d) { return (d / 4 + 4 * (d / 32) + 15) / 16 * 16; }
    using Raw = uint32_t;
    using Scale = float;
    template <int U>
    static __device__ __forceinline__ void load(uint32_t row, int c0, Raw q[U]) {
#pragma unroll
        for (int i = 0; i < U; ++i) q[i] = ld_shared_u16(row + 2 * (c0 + i));
    }
    template <int D>
    static __device__ __forceinline__ Scale scale(uint32_t row, int c) { return ld_shared_f32(row + D / 4 + 4 * (c / 4)); }
    static __device__ __forceinline__ void dec8(Raw q, Scale s, float v[8], uint32_t) {
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = __fmul_rn(__fsub_rn(__uint_as_float(0x4A800000u | (((q >> (2 * j)) & 3u) << 1)), 4194305.5f), s);
    }
    template <int D>
    static __device__ __forceinline__ uint32_t smax_bits(uint32_t row) { return smax_f32s<D / 32>(row + D / 4); }
    // attn-f16: 2 (code - 1.5), exact in f16, times r = f16(scale * rmul / 2). w holds
    // each code c_j (bits 2j, 2j + 1 of the 16-bit q) twice, at bit 2j + 1 (q << 1) and at
    // bit 2j + 15 (q << 15); pair i (elements 2i, 2i + 1) is w >> 4i masked to bits 1-2
    // (c_2i from q << 1; q << 15 is zero there) and 17-18 (c_2i+1 from q << 15; q << 1
    // is zero there, q having 16 bits) under the exponent byte 0x64 (f16 1024, ulp 1):
    // 1024 + 2c; one HADD2 of -1027 leaves 2c - 3 exactly (checked for every 16-bit q, and
    // RowInt4G32's for every byte).
    // (Before hadd, 2026-12-04: a permute per pair and an HFMA2 whose constants were
    // reloaded by MOVs.)
    static __device__ __forceinline__ uint4 dech8(Raw q, Scale s, float rmul, uint32_t) {
        const uint32_t w = (q << 1) | (q << 15), c = f16_exp_pair();
        uint32_t h[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t x = and_or<0x00060006u>(w >> (4 * i), c);
            h[i] = h2_bits(__hadd2(as_h2(x), as_h2(0xE403E403u)));
        }
        return mul_h8(h, s * (rmul * 0.5f));
    }
};
// nvfp4 (K and V of nvfp4): D/2 bytes of E2M1 nibbles (element 2i low), the f32 row
// scale S at byte D/2, D/16 E4M3 block scales at byte D/2 + 4; value (e2m1 * e4m3) * S
// (common.cuh CodeNvfp4, as kernel v2's DecNvfp4).
struct RowNvfp4 {
    static constexpr bool ONE_SCALE = false, BOOK = false, K_PERMUTED = true;
    static constexpr int UNIT = 2;  // one 16-element block: attn-f16 d 128 +2.1 %
    static __host__ __device__ constexpr int bytes(int d) { return (d / 2 + 4 + d / 16 + 15) / 16 * 16; }
    using Raw = uint32_t;
    struct Scale {
        uint32_t block;  // the E4M3 block scale's byte
        float row;       // S
    };
    template <int U>
    static __device__ __forceinline__ void load(uint32_t row, int c0, Raw q[U]) { ld_shared_words<U>(row + 4 * c0, q); }
    template <int D>
    static __device__ __forceinline__ Scale scale(uint32_t row, int c) {
        return Scale{ld_shared_u8(row + D / 2 + 4 + c / 2), ld_shared_f32(row + D / 2)};
    }
    static __device__ __forceinline__ void dec8(Raw q, Scale s, float v[8], uint32_t) { CodeNvfp4::dec8(q, s.block, s.row, v); }
    // attn-f16: the tile's power of two from the row scales S.
    template <int D>
    static __device__ __forceinline__ uint32_t smax_bits(uint32_t row) { return smax_f32s<1>(row + D / 2); }
    // e2m1 / 64 exact in f16 (CodeNvfp4::codes8) times f16(e4m3 * r), r = f16(S * 64 *
    // rmul): one HMUL2 for the block's factor, one per pair of elements; ORDERED false: the
    // elements in K_ORDER (attn-f16's K).
    template <bool ORDERED = true>
    static __device__ __forceinline__ uint4 dech8(Raw q, Scale s, float rmul, uint32_t) {
        uint32_t h[4];
        CodeNvfp4::codes8<ORDERED>(q, h);
        return mul_h8(h, __hmul2(CodeNvfp4::block_h2(s.block), __float2half2_rn(s.row * (64.0f * rmul))));
    }

};
// vq2 (K and V of vq2): D/4 one-byte codeword indices (elements 4i .. 4i + 3), the f32
// RMS at byte D/4; value codeword * rms (DecVq2), each of the 4 elements one __fmul_rn.
struct RowVq2 {
    static constexpr bool ONE_SCALE = false, BOOK = true, K_PERMUTED = false;
    static constexpr int UNIT = 1;  // 2: within 1 % either way
    static __host__ __device__ constexpr int bytes(int d) { return (d / 4 + 4 + 15) / 16 * 16; }
    using Raw = uint32_t;
    using Scale = float;
    template <int U>
    static __device__ __forceinline__ void load(uint32_t row, int c0, Raw q[U]) {
#pragma unroll
        for (int i = 0; i < U; ++i) q[i] = ld_shared_u16(row + 2 * (c0 + i));
    }
    template <int D>
    static __device__ __forceinline__ Scale scale(uint32_t row, int) { return ld_shared_f32(row + D / 4); }
    // `book`: this lane's copy of the codebook (BOOK_BYTES), codeword i at book + 128 i.
    static __device__ __forceinline__ void dec8(Raw q, Scale s, float v[8], uint32_t book) {
        const float4 c0 = ld_book(book + 128 * (q & 0xFFu)), c1 = ld_book(book + 128 * (q >> 8));
        const float w[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = __fmul_rn(w[j], s);
    }
    template <int D>
    static __device__ __forceinline__ uint32_t smax_bits(uint32_t row) { return smax_f32s<1>(row + D / 4); }
    // attn-f16: the codewords from the lane's f16 copy of the codebook (8 bytes each,
    // written at the kernel's start: each codeword value rounded to f16), times r =
    // f16(rms * rmul).
    static __device__ __forceinline__ uint4 dech8(Raw q, Scale s, float rmul, uint32_t book) {
        uint32_t h[4];
        asm("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(h[0]), "=r"(h[1]) : "r"(book + 128 * (q & 0xFFu)));
        asm("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(h[2]), "=r"(h[3]) : "r"(book + 128 * (q >> 8)));
        return mul_h8(h, s * rmul);
    }
};

// The cache's element type: a bf16 cache (TMA straight into the swizzled stages), or
// coded rows decoded by the producer warpgroup: K rows of KROW, V rows of VROW (the row
// structs above; fp8, int8: RowBytes; k8v4: RowBytes<CodeInt8>, RowInt4G32; nvfp4:
// RowNvfp4 both; k4v2: RowInt4G32, RowInt2G32; vq2: RowVq2 both).
struct CacheBf16 {
    static constexpr bool CODED = false, BOOK = false, QK = false, QH = false, QF = false;
    static constexpr int NPW = 1;
    using KRow = RowBytes<CodeE4m3>;  // unused
    using VRow = RowBytes<CodeE4m3>;
};
// QK_ (0: off): S = Q·Kᵀ on K's stored codes (see the kernel's comment at the top of
// this file): 1 attn-fp8-qk (E4M3 rows, e4m3 wgmma, the codes by TMA; QK), 2
// attn-int8-qk (int8 K rows of int8 and k8v4, the producer writes the codes in f16,
// f16 wgmma; QH), 3 attn-f16 (nvfp4, k4v2, vq2: K decoded to f16 times a power of two
// per tile, S by f16 wgmma; QF).
// NPW_: producer warpgroups, 1 or 2 (wg2; attn-fp8-qk and attn-int8-qk: 1).
template <typename KROW, typename VROW, int QK_ = 0, int NPW_ = 1>
struct CacheCoded {
    static constexpr bool CODED = true, BOOK = KROW::BOOK || VROW::BOOK, QK = QK_ == 1, QH = QK_ == 2, QF = QK_ == 3;
    static constexpr int NPW = NPW_;
    static_assert(NPW == 1 || (NPW == 2 && !QK && !QH), "CacheCoded: two producer warpgroups for the decoding kernels and attn-f16 only");
    using KRow = KROW;
    using VRow = VROW;
};

// What decode_tile writes for each element: DEC_CODES, the code value itself, exact in
// bf16 (K of a ONE_SCALE row under FOLD_K: every E4M3 value, NaN included, and every
// int8; the row scale folded into S's column by the consumers: kfac, store_kfac);
// DEC_BF16, RC::dec8 (src/kv's decode) rounded to bf16 nearest even, the rounding a bf16
// cache gets; DEC_F16 (V under attn-int8-qk, RC::dech8): the code value (exact in f16)
// times r = f16(scale * rmul), rounded to f16, where rmul = 2^-e is the tile's power of
// two (tile_vexp), so r < 4 whatever the scales' magnitude; DEC_HCODES (K under
// attn-int8-qk, RC::hcodes8): the code value in f16, exact; DEC_F16K (K under attn-f16
// where RC::K_PERMUTED): DEC_F16 with each chunk's elements in the order 0, 2, 4, 6, 1,
// 3, 5, 7 (no byte permute), q staged alike.
constexpr int DEC_CODES = 0, DEC_BF16 = 1, DEC_F16 = 2, DEC_HCODES = 3, DEC_F16K = 4;

// One tile of BN coded rows (raw stage at `raw`, rows of RC::bytes(D), as the TMA box
// lands them) into the 16-bit stage at `dst` in the layout the consumers read (the
// 128-byte swizzle of a TMA box: box c / 8 of BN rows x 128 bytes, 16-byte chunk c % 8
// of row r at ((c % 8) ^ (r % 8)) * 16), each element as MODE says. `book`: the shared
// codebook (vq2); `rmul`: DEC_F16's power of two. NT threads (128, or 256 under wg2).
// A thread decodes units of U consecutive chunks of a row (8 elements each; U =
// RC::UNIT where elements are scaled, else 1), loading the unit's codes and scale fields
// once (unit, 2026-12-04: nvfp4's 16-element block, its attn-f16 kernel 2.1 % faster at
// ctx 4096 d 128), always the same column unit, in rows r0 + RPI k, up to 8 chunks
// loaded before the first is converted (under wg2 4 measured 3.1 % slower for vq2's
// attn-f16 at ctx 4096 d 128, 3.4 % faster at ctx 512). With U = 1 thread tid takes
// chunk tid % CH of rows tid / CH + RPI k (consecutive threads along a row); with U > 1
// eight consecutive threads take the 8 / U units of one 64-column box in U consecutive
// rows from a multiple of U, so that one store instruction's 16-byte stores (every
// unit's i-th chunk) fall in 8 different bank groups: in each row their offsets c % 8
// are i + U x (x < 8 / U), and the U rows' XOR with r % 8 (U consecutive values from a
// multiple of U) maps them onto disjoint sets.
// Rows past the cached positions arrive as zeros (TMA's fill; scales 0): they decode
// to (signed) 0, never NaN.
template <int D, typename RC, int MODE, int NT = 128>
__device__ __forceinline__ void decode_tile(uint32_t raw, uint32_t dst, int tid, uint32_t book, float rmul = 1.0f) {
    constexpr bool SCALED = MODE == DEC_BF16 || MODE == DEC_F16 || MODE == DEC_F16K;
    // U: chunks per unit; UP: units per box row (8 threads' worth); CU: units per row;
    // IT: units per thread; B: units whose loads go out together (8 chunks).
    constexpr int CH = D / 8, RB = RC::bytes(D);
    constexpr int U = SCALED ? RC::UNIT : 1;
    constexpr int UP = 8 / U, CU = CH / U, RPI = NT / CU, IT = BN / RPI;
    constexpr int B = IT < 8 / U ? IT : 8 / U;
    static_assert(D % 64 == 0 && 8 % U == 0 && NT % CH == 0 && RPI % 8 == 0 && RPI % U == 0 && IT % B == 0, "decode_tile: a thread keeps one column unit");
    const int g = tid / 8, w = tid % 8;
    const int r0 = U == 1 ? tid / CH : (g / (CH / 8)) * U + w / UP;  // rows r0 + RPI k
    const int c0 = U == 1 ? tid % CH : 8 * (g % (CH / 8)) + U * (w % UP);  // the unit's first chunk
    const uint32_t src = raw + r0 * RB;
    // Chunk c0 + i of row r = r0 + RPI k (r % 8 = r0 % 8) at 16 ((c0 + i) % 8 ^ r % 8) = 16
    // ((c0 ^ r0) % 8 ^ i) in its 128-byte row (c0 % U = 0, i < U): one base per i.
    uint32_t out[U];
#pragma unroll
    for (int i = 0; i < U; ++i) out[i] = dst + (c0 / 8) * (BN * 128) + r0 * 128 + ((((c0 ^ r0) & 7) ^ i) * 16);
    // B units at a time: their shared loads issued back to back (the loads and stores
    // are volatile asm, so the compiler keeps their order: one chunk at a time would
    // wait out a load's latency per chunk), then converted and stored.
#pragma unroll 1
    for (int k0 = 0; k0 < IT; k0 += B) {
        typename RC::Raw q[B][U];
        typename RC::Scale sc[B];
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const uint32_t row = src + (k0 + b) * RPI * RB;
            RC::template load<U>(row, c0, q[b]);
            if constexpr (SCALED) sc[b] = RC::template scale<D>(row, c0);
        }
#pragma unroll
        for (int b = 0; b < B; ++b) {
#pragma unroll
            for (int i = 0; i < U; ++i) {
                const uint32_t at = out[i] + (k0 + b) * RPI * 128;
                // (A unit's chunks share sc[b]: the compiler forms their factor once.)
                if constexpr (MODE == DEC_F16K) {
                    st_shared_v4(at, RC::template dech8<false>(q[b][i], sc[b], rmul, book));
                } else if constexpr (MODE == DEC_F16) {
                    st_shared_v4(at, RC::dech8(q[b][i], sc[b], rmul, book));
                } else if constexpr (MODE == DEC_HCODES) {
                    st_shared_v4(at, RC::hcodes8(q[b][i]));
                } else {
                    float v[8];
                    if constexpr (MODE == DEC_BF16) RC::dec8(q[b][i], sc[b], v, book);
                    else RC::cvt8(q[b][i], v);
                    st_shared_v4(at, pack_bf16x8(v));
                }
            }
        }
    }
}

// DEC_F16's power of two for one tile of rows (raw stage at `raw`), computed by each
// decoding warp on its own, no barrier among the four (vexpw, 2026-12-03; before, each
// warp took the maximum of 32 rows and the four met at a named barrier): lane l takes the
// largest scale field of rows l, l + 32, l + 64 and l + 96, the warp the largest of its
// lanes' (a warp max of the bits, nonnegative floats ordering as integers), so every warp
// has the tile's largest; its exponent field e, taken as 127 when it is 0 (a zero or
// f32-subnormal tile) or 255 (an infinite or NaN scale, which the decode then carries into
// NaN as src/kv does) and at most 253. The tile's elements are code * scale * 2^(127 - e)
// (decode_tile DEC_F16's rmul), below 4 in magnitude times the code, the P·V sums in units
// of 2^(e - 127).
template <int D, typename RC>
__device__ __forceinline__ int tile_vexp(uint32_t raw, int tid) {
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < BN / 32; ++i) m = max(m, RC::template smax_bits<D>(raw + ((tid & 31) + 32 * i) * RC::bytes(D)));
    m = __reduce_max_sync(0xffffffffu, m);
    const int e = (int)(m >> 23);
    return (e == 0 || e == 255) ? 127 : min(e, 253);
}

// K's column factors of one tile (kernel v2's folding, kernels/attention.cu DecByte):
// row r's f32 scale (raw stage, byte D of the row) times kmul (scale * log2 e, or 1
// under a soft-cap), one __fmul_rn, as v2's kfac. Stored where the consumer lane that
// multiplies key column r = 8 j + 2 q + e (j = 0..15 the 8-column chunk, q = lane % 4,
// e = 0, 1) reads it with one 16-byte load per chunk pair: float 16 (j / 2) + 4 q +
// 2 (j % 2) + e, so the four lanes of a quad read 64 consecutive bytes per load (no
// bank conflict; a layout of 128 bytes per q put all four in banks 0-3) and the 128
// threads' stores are conflict-free. Thread tid (of 128) takes row tid.
// attn-fp8-qk (SCALES): the raw stage holds only the 16 bytes from byte D of each row
// (the scale first), so row tid's scale is at 16 tid.
template <int D, bool SCALES = false>
__device__ __forceinline__ void store_kfac(uint32_t raw, uint32_t kf, int tid, float kmul) {
    const float s = SCALES ? ld_shared_f32(raw + tid * 16) : ld_shared_f32(raw + tid * coded_row_bytes(D) + D);
    const int j = tid / 8, q = (tid % 8) / 2, e = tid % 2;
    st_shared_f32(kf + 4 * (16 * (j / 2) + 4 * q + 2 * (j % 2) + e), __fmul_rn(s, kmul));
}

// Whether K's row scale of a coded cache is folded into S's columns (kfac) rather than
// multiplied into the decoded K elements; mirrored by ops::ATTN_V3_FOLDS_K.
constexpr bool FOLD_K = false;

// K/V stages: 4 at d_head 64, 2 at 128 (shared memory: Q 32 KiB plus four 32 KiB
// stages at d 128 fill the 227 KiB a block may have).
__host__ __device__ constexpr int stages(int d) { return d <= 64 ? 4 : 2; }

// A compile-time flag for the generic lambdas below (soft-cap on, tile masked).
template <bool B>
struct Flag {
    static constexpr bool value = B;
};

// The block's w-th work item, longest causal rows first: query tile qt (of n_qt),
// head h, window seq; consecutive items share a query tile and, for GQA, a KV head.
struct Item {
    int qt, h, seq;
};
__device__ __forceinline__ Item item_of(int w, int n_qt, int n_heads, int n_seqs) {
    const int per_qt = n_heads * n_seqs;
    const int r = w % per_qt;
    return Item{n_qt - 1 - w / per_qt, r % n_heads, r / n_heads};
}

template <int D, typename OUT, typename CACHE>
__device__ __forceinline__ void attn_wgmma_impl(const AttnWgmmaArgs& a, const int rot, const float* book_src, const TmaDesc* kc_map) {
    constexpr bool CODED = CACHE::CODED;
    // attn-fp8-qk: K's codes by TMA into an e4m3 stage (kc_map), the scales (a.k: 16
    // bytes per row from byte D) into the raw K stages, Q as e4m3 hi and lo tiles.
    constexpr bool QK = CACHE::QK;
    // attn-int8-qk: K's codes decoded to f16 (exact), q in f16 times a power of two per
    // row, S by f16 wgmma; K's row scales folded into S's columns, as attn-fp8-qk's.
    constexpr bool QH = CACHE::QH;
    // attn-f16: K decoded to f16 (code * scale times the tile's power of two, decode_tile
    // DEC_F16), the power of two folded into S's columns (every column of the tile the
    // same factor), q in f16 and S by f16 wgmma as attn-int8-qk.
    constexpr bool QF = CACHE::QF;
    constexpr bool HS = QH || QF;  // q in f16 times a power of two per row, S by f16 wgmma
    static_assert(!(QK || QH) || (CODED && CACHE::KRow::ONE_SCALE), "attn-fp8-qk / attn-int8-qk: rows of one-byte codes and one scale");
    static_assert(D % BOX == 0 && (D == 64 || D == 128), "attn_wgmma: d_head 64 or 128");
    constexpr int ST = stages(D);
    constexpr int NB = D / BOX;           // 64-column boxes per row
    constexpr int KS = D / 16;            // k-steps of Q·Kᵀ
    constexpr int VS = BN / 16;           // k-steps of P·V
    constexpr int NS = BN / 8;            // 8-column accumulator chunks of S
    constexpr int NO = D / 8;             // of O
    constexpr bool KF = CODED && ((FOLD_K && CACHE::KRow::ONE_SCALE) || QK || HS);  // K's row scale folded into S's columns
    // Ping-pong between the consumer warpgroups (see the top of this file): every kernel
    // but the d 64 decoding kernels of one-byte codes (fp8, int8, k8v4), where it measured slower.
    constexpr bool PINGPONG = !(D == 64 && CODED && !QK && !HS && CACHE::KRow::ONE_SCALE);
    constexpr int KQ = KF ? BN / 16 : 1;  // float4s of K factors per consumer lane and tile
    constexpr uint32_t Q_BYTES = BM * D * 2;
    constexpr uint32_t KV_BYTES = BN * D * 2;  // one stage of K (or of V)
    extern __shared__ uint8_t attn3_smem[];
    // 1024-byte alignment for the 128-byte swizzle (the launcher adds 1 KiB of slack).
    const uint32_t base = (smem_addr(attn3_smem) + 1023u) & ~1023u;
    const uint32_t sq = base;                 // (NB boxes, BM rows, 64) bf16, swizzled
    const uint32_t sk = sq + Q_BYTES;         // (ST, NB, BN, 64) bf16, swizzled
    const uint32_t sv = sk + ST * KV_BYTES;   // (ST, NB, BN, 64) bf16, swizzled
    // A coded cache: two raw stages of K rows and one of V rows (the TMA boxes as stored).
    constexpr uint32_t RAW_K_BYTES = QK ? BN * 16 : CODED ? BN * CACHE::KRow::bytes(D) : 0;
    constexpr uint32_t RAW_V_BYTES = CODED ? BN * CACHE::VRow::bytes(D) : 0;
    const uint32_t rk = sv + ST * KV_BYTES, rv = rk + 2 * RAW_K_BYTES;
    // full_k[ST], full_v[ST], empty_k[ST], empty_v[ST]; coded: raw_k[2], raw_v, one spare.
    const uint32_t bars = rv + RAW_V_BYTES;
    const uint32_t raw_full_k = bars + 8 * 4 * ST, raw_full_v = raw_full_k + 16;
    // Coded: K's column factors of each bf16 K stage (BN f32, store_kfac's order), read
    // by the consumers before they release the stage (empty_k).
    const uint32_t kfac = bars + 8 * 4 * ST + 32;
    // vq2: the block's copies of the codebook (BOOK_BYTES), written by the producer
    // before its first decode.
    // attn-fp8-qk, attn-int8-qk: 2 ST slots of factors (tile g in slot g % 2 ST), read
    // during the softmax after the K stage is released (see the producer).
    constexpr int KFS = (QK || HS) ? 2 * ST : ST;
    const uint32_t book = kfac + KFS * BN * 4;
    // attn-fp8-qk, attn-int8-qk: each query row's 1 / sq (BM f32), written when Q is staged.
    const uint32_t qfac = book + (CACHE::BOOK ? BOOK_BYTES : 0);
    // attn-int8-qk (FV: P·V in f16 on V's codes, decode_tile DEC_F16): each V stage's
    // exponent e (ST ints, written with the stage; 32 bytes reserved).
    constexpr bool FV = HS;
    const uint32_t vexp = qfac + ((QK || HS) ? BM * 4 : 0);
    auto full_k = [&](int s) { return bars + 8 * s; };
    auto full_v = [&](int s) { return bars + 8 * (ST + s); };
    auto empty_k = [&](int s) { return bars + 8 * (2 * ST + s); };
    auto empty_v = [&](int s) { return bars + 8 * (3 * ST + s); };

    const int n_tokens = a.n_tokens, pos0 = a.pos0, window = a.window;
    const int kv_len = pos0 + n_tokens;
    const int n_qt = (n_tokens + BM - 1) / BM;
    const int n_items = n_qt * a.n_heads * a.n_seqs;
    const int group = a.n_heads / a.n_kv_heads;
    // The key tiles item `it` walks: [first, first + n).
    auto tiles_of = [&](const Item& it, int& first, int& n) {
        const int t0 = it.qt * BM;
        const int t_last = min(t0 + BM, n_tokens) - 1;
        const int last = (pos0 + t_last) / BN;
        first = window > 0 ? max(pos0 + t0 - window + 1, 0) / BN : 0;
        n = last - first + 1;
    };
    const int warpgroup = threadIdx.x / 128, tid = threadIdx.x % 128;
    // Producer warpgroups: 0, and 3 under wg2 (NPW 2); ptid numbers their threads 0 .. NT - 1.
    constexpr int NPW = CACHE::NPW, NT = 128 * NPW;
    const bool producer = warpgroup == 0 || warpgroup == 3;
    const int ptid = warpgroup == 3 ? 128 + tid : tid;

    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < ST; ++s) {
            // bf16: the producer thread's expect_tx; coded: each of the NT decoding threads.
            const uint32_t n_arrive = CODED ? NT : 1;
            mbar_init(full_k(s), n_arrive);
            mbar_init(full_v(s), n_arrive);
            mbar_init(empty_k(s), 8);  // one arrival per consumer warp
            mbar_init(empty_v(s), 8);
        }
        if (CODED) {
            mbar_init(raw_full_k, 1);
            mbar_init(raw_full_k + 8, 1);
            mbar_init(raw_full_v, 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if constexpr (CODED) {
        if (producer) {
            // Producer of a coded cache: thread 0 brings tile g's stored K rows and V rows by
            // TMA (a 3-D box of the rows' bytes, zeros past kv_len) into the raw stages; all
            // NT threads decode them into bf16 stage g % ST once the consumers released it,
            // make their st.shared visible to wgmma (fence.proxy.async) and arrive on full_k /
            // full_v; after a named barrier (every thread done reading the raw stage) thread 0
            // fetches tile g + 1's rows into it, so that copy runs while the consumers work.
            if constexpr (QK || QH) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
            else if constexpr (NPW == 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 32;\n");
            else asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
            if constexpr (CACHE::BOOK) {
                // The codebook into shared memory (BOOK_BYTES, 16 bytes per thread and step,
                // consecutive threads at consecutive addresses: 16-byte chunk x holds copy x %
                // 8 of codeword x / 8 in f32, or copies 2 (x % 8) and 2 (x % 8) + 1 in f16);
                // the named barrier before the first decode makes it visible to the NT
                // decoding threads. attn-f16: in f16 (each value rounded to nearest even).
                const float4* src = reinterpret_cast<const float4*>(book_src);
#pragma unroll 4
                for (int x = ptid; x < BOOK_BYTES / 16; x += NT) {
                    const float4 w = src[x / 8];
                    if constexpr (QF) {
                        const uint32_t lo = h2_bits(__floats2half2_rn(w.x, w.y)), hi = h2_bits(__floats2half2_rn(w.z, w.w));
                        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(book + 16 * x), "r"(lo), "r"(hi), "r"(lo), "r"(hi) : "memory");
                    } else {
                        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(book + 16 * x), "f"(w.x), "f"(w.y), "f"(w.z), "f"(w.w)
                                     : "memory");
                    }
                }
                asm volatile("bar.sync 3, %0;\n" ::"n"(NT) : "memory");
            }
            // vq2: this lane's copy of the codebook (BOOK_BYTES).
            const uint32_t lbook = book + (QF ? 8 * (tid % 16) : 16 * (tid % 8));
            using KRow = typename CACHE::KRow;
            using VRow = typename CACHE::VRow;
            struct Cursor {
                int w, i, first, n, slab;
            };
            auto seek = [&](Cursor& cur) {  // cur.w set: the first tile of item cur.w
                cur.i = 0;
                if (cur.w >= n_items) return;
                const Item it = item_of(cur.w, n_qt, a.n_heads, a.n_seqs);
                cur.slab = it.seq * a.n_kv_heads + it.h / group;
                tiles_of(it, cur.first, cur.n);
            };
            auto advance = [&](Cursor& cur) {
                if (++cur.i == cur.n) {
                    cur.w += gridDim.x;
                    seek(cur);
                }
            };
            auto fetch = [&](Cursor& cur, const TmaDesc* map, uint32_t bytes, uint32_t dst, uint32_t bar) {  // then cur moves on
                mbar_arrive_expect_tx(bar, bytes);
                tma_load_3d(dst, map, bar, 0, (cur.first + cur.i) * BN, cur.slab);
                advance(cur);
            };
            // K's column factor multiplier (kernel v2's kmul): scale * log2 e, or 1 under a
            // soft-cap (the consumers then multiply by scale inside the tanh).
            const float kmul = a.softcap > 0.f ? 1.0f : a.scale * LOG2E;
            // The block's tiles in all (the decode loop's length).
            int n_g = 0;
            for (int w = blockIdx.x; w < n_items; w += gridDim.x) {
                int first, n;
                tiles_of(item_of(w, n_qt, a.n_heads, a.n_seqs), first, n);
                n_g += n;
            }
            // Thread 0's cursors run the raw stages ahead of the decode: tiles 0 and 1 of K
            // (tile g in raw K stage g % 2), tile 0 of V.
            Cursor fk{(int)blockIdx.x, 0, 0, 0, 0};
            seek(fk);
            Cursor fv = fk;
            Cursor fc = fk;  // attn-fp8-qk: the tile whose codes go into the next e4m3 K stage
            if (ptid == 0) {
#pragma unroll
                for (int r = 0; r < 2; ++r)
                    if (fk.w < n_items) fetch(fk, &a.k, RAW_K_BYTES, rk + r * RAW_K_BYTES, raw_full_k + 8 * r);
                if (fv.w < n_items) fetch(fv, &a.v, RAW_V_BYTES, rv, raw_full_v);
            }
            for (int g = 0; g < n_g; ++g) {
                const int s = g % ST;
                const uint32_t ph = ((g / ST) & 1) ^ 1;
                const int slot = g & 1;
                mbar_wait(raw_full_k + 8 * slot, (g / 2) & 1);
                mbar_wait(empty_k(s), ph);
                if constexpr (QK) {
                    // The factors from the scales, then thread 0's arrival carries the
                    // codes' copy (its bytes complete full_k), the others arrive. The
                    // consumers read tile g's factors in its softmax, after releasing its K
                    // stage, so they live in slot g % 2 ST: empty_k(s) for tile g means
                    // every consumer warp finished S of tile g - ST, so its softmax of
                    // tile g - 2 ST (the slot's last user) is done too. (Read ahead into
                    // registers, as FOLD_K does, the 32 factors a lane needs made ptxas
                    // spill at the 168 registers of the launch bound.)
                    store_kfac<D, true>(rk + slot * RAW_K_BYTES, kfac + (g % KFS) * BN * 4, tid, kmul);
                    if (tid == 0) fetch(fc, kc_map, BN * D, sk + s * KV_BYTES, full_k(s));
                    else mbar_arrive(full_k(s));
                } else if constexpr (QF) {
                    // attn-f16: the tile's power of two (tile_vexp over K's scales), K as
                    // code * scale * 2^(127 - e) in f16, and the factor of all its columns,
                    // kmul * 2^(e - 127), at the start of slot g % 2 ST (attn-int8-qk's ring:
                    // one float, read by the consumers as one scalar per tile).
                    const int e = tile_vexp<D, KRow>(rk + slot * RAW_K_BYTES, tid);
                    decode_tile<D, KRow, KRow::K_PERMUTED ? DEC_F16K : DEC_F16, NT>(rk + slot * RAW_K_BYTES, sk + s * KV_BYTES, ptid, lbook,
                                                                                        __uint_as_float((uint32_t)(254 - e) << 23));
                    if (ptid == 0) st_shared_f32(kfac + (g % KFS) * BN * 4, __fmul_rn(kmul, __uint_as_float((uint32_t)e << 23)));
                    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                    mbar_arrive(full_k(s));
                } else {
                    decode_tile<D, KRow, QH ? DEC_HCODES : KF ? DEC_CODES : DEC_BF16, NT>(rk + slot * RAW_K_BYTES, sk + s * KV_BYTES, ptid, lbook);
                    // QH: tile g's factors in slot g % 2 ST, as attn-fp8-qk's (above).
                    if constexpr (KF) {
                        if (ptid < 128) store_kfac<D>(rk + slot * RAW_K_BYTES, kfac + (QH ? g % KFS : s) * BN * 4, tid, kmul);
                    }
                    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                    mbar_arrive(full_k(s));
                }
                asm volatile("bar.sync 3, %0;\n" ::"n"(NT) : "memory");
                if (ptid == 0 && fk.w < n_items) fetch(fk, &a.k, RAW_K_BYTES, rk + slot * RAW_K_BYTES, raw_full_k + 8 * slot);
                mbar_wait(raw_full_v, g & 1);
                mbar_wait(empty_v(s), ph);
                if constexpr (FV) {
                    const int e = tile_vexp<D, VRow>(rv, tid);
                    decode_tile<D, VRow, DEC_F16, NT>(rv, sv + s * KV_BYTES, ptid, lbook, __uint_as_float((uint32_t)(254 - e) << 23));
                    if (ptid == 0) asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(vexp + 4 * s), "r"(e) : "memory");
                } else {
                    decode_tile<D, VRow, DEC_BF16, NT>(rv, sv + s * KV_BYTES, ptid, lbook);
                }
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                mbar_arrive(full_v(s));
                asm volatile("bar.sync 3, %0;\n" ::"n"(NT) : "memory");
                if (ptid == 0 && fv.w < n_items) fetch(fv, &a.v, RAW_V_BYTES, rv, raw_full_v);
            }
            return;
        }
    } else if (warpgroup == 0) {
        // Producer: one thread issues every copy, item after item (the stage ring runs
        // on across items, so the next item's first tiles load during this one's end);
        // a K (V) stage is reused once all 8 consumer warps arrived on its empty_k (empty_v).
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (tid == 0) {
            int g = 0;  // tiles issued so far by this block
            for (int w = blockIdx.x; w < n_items; w += gridDim.x) {
                const Item it = item_of(w, n_qt, a.n_heads, a.n_seqs);
                const int slab = it.seq * a.n_kv_heads + it.h / group;  // the tensor maps' outer coordinate
                int first, n;
                tiles_of(it, first, n);
                for (int i = 0; i < n; ++i, ++g) {
                    const int s = g % ST, tile = first + i;
                    const uint32_t ph = ((g / ST) & 1) ^ 1;
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
        }
        return;
    }

    // Per thread, x 128: 24 + 2 x 240 (bf16); coded, 56 + 2 x 224 (the decoders' registers:
    // 8 chunks in flight in decode_tile), or 40 + 2 x 232 under attn-fp8-qk and
    // attn-int8-qk (their consumers measured 1-4 % slower at 224).
    if constexpr (QK || QH) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    else if constexpr (CODED) asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n");
    else asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    const int c = warpgroup - 1;  // consumer: rows 64c .. 64c + 63 of each item's query tile
    const int warp = tid / 32, lane = tid % 32;
    const int g = lane >> 2, cq = 2 * (lane & 3);
    const float scale = a.scale, cap = a.softcap;
    const float scale_l2 = scale * LOG2E;
    const uint64_t dq = sw128_desc(sq + c * 64 * 128);
    // Rotated rows (src/kv/hadamard.rs; coded caches only): K rotated -> q staged as
    // (H q) / n; V rotated -> the output rotated back, (H O') / n. n = D (a power of two).
    const bool rot_k = CODED && (rot & 1), rot_v = CODED && (rot & 2);
    constexpr float inv_n = 1.0f / D;

    // The consumer's whole walk, compiled once without and once with the soft-cap (a
    // uniform branch per launch, so the tile loop holds no tanh path it does not take).
    if constexpr (PINGPONG) {
        if (c == 0) asm volatile("bar.arrive 4, 256;\n" ::: "memory");  // warpgroup 0 takes the first turn
    }
    auto consume = [&](auto cap_flag) {
        constexpr bool CAP = decltype(cap_flag)::value;
        float o[D / 2];
        float m_run[2], l_run[2];
        float sc[BN / 2];     // S of the tile being scored, then its probabilities
        uint32_t pa[VS][4];   // P of the previous tile, bf16, as the A fragments of its P·V
        float4 kq[KQ];        // a folded K: its column factors of the tile being scored (load_kf)
        (void)kq;
        const float4* kfq = nullptr;  // attn-fp8-qk: this lane's factors of the tile being scored
        (void)kfq;
        float kfs = 1.0f;  // attn-f16: the factor of every column of the tile being scored
        (void)kfs;
        int gt = 0;           // tiles consumed so far by this block (the producer's g)
        for (int w = blockIdx.x; w < n_items; w += gridDim.x) {
            const Item it = item_of(w, n_qt, a.n_heads, a.n_seqs);
            const int t0 = it.qt * BM;
            int tile_first, n_tiles;
            tiles_of(it, tile_first, n_tiles);

            // Q: this warpgroup's 64 rows, f32 -> bf16 (nearest even), rows past n_tokens
            // zero, into the 128-byte swizzle: box b holds columns 64b .. 64b + 63, row r
            // at r * 128 bytes, its 16-byte chunk j at (j ^ (r % 8)) * 16. All loads first
            // (one round trip), then the stores. The previous item's S wgmmas are complete
            // (waited for), so sq is free.
            const float* qb = a.q + (long long)it.seq * n_tokens * a.q_stride + (long long)it.h * D;
            constexpr int QI = 64 * (D / 8) / 128;  // 16-byte output chunks per thread
            float4 qv[QI][2];
#pragma unroll
            for (int k = 0; k < QI; ++k) {
                const int i = tid + 128 * k;
                const int r = c * 64 + i / (D / 8), ch = i % (D / 8);
                const int t = t0 + r;
                if (t < n_tokens) {
                    const float4* src = reinterpret_cast<const float4*>(qb + (long long)t * a.q_stride + ch * 8);
                    qv[k][0] = src[0];
                    qv[k][1] = src[1];
                } else {
                    qv[k][0] = make_float4(0.f, 0.f, 0.f, 0.f);
                    qv[k][1] = qv[k][0];
                }
            }
#pragma unroll
            for (int k = 0; k < QI; ++k) {
                const int i = tid + 128 * k;
                const int r = c * 64 + i / (D / 8), ch = i % (D / 8);
                float v[8] = {qv[k][0].x, qv[k][0].y, qv[k][0].z, qv[k][0].w, qv[k][1].x, qv[k][1].y, qv[k][1].z, qv[k][1].w};
                if (rot_k) {
                    // hadamard_frag's butterflies in its order (column bit 0 first), on
                    // this layout: column bits 0-2 are the chunk's 8 registers, bits 3..
                    // the chunk index = lane bits 0.. (ch = tid % (D / 8)), so shuffles.
#pragma unroll
                    for (int b = 0; b < 3; ++b)
#pragma unroll
                        for (int e = 0; e < 8; ++e) {
                            if (e & (1 << b)) continue;
                            const float x = v[e], y = v[e | (1 << b)];
                            v[e] = __fadd_rn(x, y);
                            v[e | (1 << b)] = __fsub_rn(x, y);
                        }
#pragma unroll
                    for (int m = 1; m < D / 8; m <<= 1) {
                        const bool hi = (lane & m) != 0;
#pragma unroll
                        for (int e = 0; e < 8; ++e) {
                            const float o = __shfl_xor_sync(0xffffffffu, v[e], m);
                            v[e] = hi ? __fsub_rn(o, v[e]) : __fadd_rn(v[e], o);
                        }
                    }
#pragma unroll
                    for (int e = 0; e < 8; ++e) v[e] *= inv_n;
                }
                if constexpr (QK) {
                    // The row's largest |q| over its D / 8 lanes (consecutive), its power of
                    // two sq (amax sq in [128, 256): e4m3's range is ±448, and the scaling
                    // is exact), hi = e4m3(q sq), lo = e4m3(q sq - hi) (the difference exact
                    // in f32), 1 / sq for the row's scores (qfac).
                    float amax = 0.f;
#pragma unroll
                    for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[e]));
#pragma unroll
                    for (int m = 1; m < D / 8; m <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
                    const uint32_t eb = (__float_as_uint(amax) >> 23) & 0xFFu;
                    const bool ok = eb >= 8u && eb <= 254u;  // else (0, tiny, inf): sq = 1
                    const float sqf = ok ? __uint_as_float((261u - eb) << 23) : 1.0f;
                    const float rqf = ok ? __uint_as_float((eb - 7u) << 23) : 1.0f;
                    uint32_t hw[2], lw[2];
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        uint32_t hb[2], lb[2];
#pragma unroll
                        for (int p2 = 0; p2 < 2; ++p2) {
                            const float x0 = v[4 * h + 2 * p2] * sqf, x1 = v[4 * h + 2 * p2 + 1] * sqf;
                            hb[p2] = e4m3x2_of(x0, x1);
                            const float2 hf = f32x2_of_e4m3x2(hb[p2]);
                            lb[p2] = e4m3x2_of(x0 - hf.x, x1 - hf.y);
                        }
                        hw[h] = hb[0] | (hb[1] << 16);
                        lw[h] = lb[0] | (lb[1] << 16);
                    }
                    const uint32_t off = qk_chunk<D>(r, ch >> 1) + (ch & 1) * 8;
                    st_shared_v2(sq + off, hw[0], hw[1]);
                    st_shared_v2(sq + BM * D + off, lw[0], lw[1]);
                    if (ch == 0) st_shared_f32(qfac + 4 * r, rqf);
                } else if constexpr (HS) {
                    // attn-int8-qk: the row's largest |q| over its D / 8 lanes,
                    // its power of two sq (amax sq in [2^14, 2^15): f16's largest finite is
                    // 65504; the scaling is exact), q sq rounded to f16 (nearest even) in
                    // the bf16 kernel's layout, 1 / sq for the row's scores (qfac). amax
                    // below 2^-112, or not finite: sq = 1 (inf and NaN carry into S).
                    float amax = 0.f;
#pragma unroll
                    for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[e]));
#pragma unroll
                    for (int m = 1; m < D / 8; m <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
                    const uint32_t eb = (__float_as_uint(amax) >> 23) & 0xFFu;
                    const bool ok = eb >= 15u && eb <= 254u;
                    const float sqf = ok ? __uint_as_float((268u - eb) << 23) : 1.0f;
                    const float rqf = ok ? __uint_as_float((eb - 14u) << 23) : 1.0f;
                    // attn-f16 over K rows decoded in DEC_F16K's order: q's chunk in that
                    // order too (q·k is unchanged by a common permutation of the index).
                    constexpr bool PERM = QF && CACHE::KRow::K_PERMUTED;
                    uint32_t hw[4];
#pragma unroll
                    for (int p2 = 0; p2 < 4; ++p2) {
                        const int i0 = PERM ? (p2 & 1) * 4 + (p2 >> 1) : 2 * p2, i1 = PERM ? i0 + 2 : 2 * p2 + 1;
                        hw[p2] = h2_bits(__floats2half2_rn(v[i0] * sqf, v[i1] * sqf));
                    }
                    st_shared_v4(sq + (ch / 8) * (BM * 128) + r * 128 + (((ch % 8) ^ (r & 7)) * 16), make_uint4(hw[0], hw[1], hw[2], hw[3]));
                    if (ch == 0) st_shared_f32(qfac + 4 * r, rqf);
                } else {
                    st_shared_v4(sq + (ch / 8) * (BM * 128) + r * 128 + (((ch % 8) ^ (r & 7)) * 16), pack_bf16x8(v));
                }
            }
            // The generic-proxy writes made visible to wgmma (the async proxy), then the warpgroup's barrier.
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");

#pragma unroll
            for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
            m_run[0] = m_run[1] = -INFINITY;
            l_run[0] = l_run[1] = 0.f;
            const int row_w = t0 + c * 64 + warp * 16;  // the warp's first row (token)
            const int qp0 = pos0 + row_w + g;           // this thread's rows: positions qp0 and qp0 + 8
            const int qp_min = pos0 + row_w, qp_max = qp_min + 15;
            // attn-fp8-qk: 1 / sq of this thread's rows (g and g + 8 of the warp's 16).
            float rq[2] = {1.0f, 1.0f};
            if constexpr (QK || HS) {
                rq[0] = ld_shared_f32(qfac + 4 * (c * 64 + warp * 16 + g));
                rq[1] = ld_shared_f32(qfac + 4 * (c * 64 + warp * 16 + g + 8));
            }

            // S = Q·Kᵀ of block tile j (stage j % ST) issued as one commit group (not waited for).
            auto issue_s = [&](int j) {
#pragma unroll
                for (int e = 0; e < BN / 2; ++e) sc[e] = 0.f;
                if constexpr (QK) {
                    // hi and lo into the same accumulator: 2 D / 32 e4m3 k-steps.
                    const uint64_t dk8 = qk_desc<D>(sk + (j % ST) * KV_BYTES);
                    const uint64_t dh = qk_desc<D>(sq + c * 64 * D), dl = qk_desc<D>(sq + BM * D + c * 64 * D);
                    wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < D / 32; ++kk) {
                        wgmma_ss_m64n128k32_e4m3(sc, dh + 2 * kk, dk8 + 2 * kk);
                        wgmma_ss_m64n128k32_e4m3(sc, dl + 2 * kk, dk8 + 2 * kk);
                    }
                    wgmma_commit();
                    return;
                }
                const uint64_t dk = sw128_desc(sk + (j % ST) * KV_BYTES);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < KS; ++kk) {
                    const uint32_t qoff = (kk / 4) * (BM * 128) + (kk % 4) * 32;
                    const uint32_t koff = (kk / 4) * (BN * 128) + (kk % 4) * 32;
                    if constexpr (HS) wgmma_ss_m64n128k16_f16(sc, dq + (qoff >> 4), dk + (koff >> 4));
                    else wgmma_ss_m64n128k16(sc, dq + (qoff >> 4), dk + (koff >> 4));
                }
                wgmma_commit();
            };
            // O += P·V of block tile j (stage j % ST, P in pa), issued as one commit group.
            auto issue_pv = [&](int j) {
                const uint32_t vs = sv + (j % ST) * KV_BYTES;
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < VS; ++kk) {
                    const uint64_t dv = sw128_mn_desc(vs + kk * 16 * 128, BN * 128);
                    if constexpr (D == 128 && FV) wgmma_rs_m64n128k16_tb_f16(o, pa[kk], dv);
                    else if constexpr (D == 128) wgmma_rs_m64n128k16_tb(o, pa[kk], dv);
                    else if constexpr (FV) wgmma_rs_m64n64k16_tb_f16(o, pa[kk], dv);
                    else wgmma_rs_m64n64k16_tb(o, pa[kk], dv);
                }
                wgmma_commit();
            };
            // One arrival per consumer warp on a stage's empty barrier.
            auto release = [&](uint32_t bar) {
                __syncwarp();
                if (lane == 0) mbar_arrive(bar);
            };
            // Scale, soft-cap, mask S of key tile `tile` (v2's arithmetic); the online
            // softmax update of m and l; the probabilities left in sc; corr = the factor
            // O needs. MASK false: every key of the tile is visible to every row of the
            // warp (no compare at all). Straight-line code: no branch per element. A coded
            // cache: S's columns times K's factors (kq, load_kf: row scale * scale * log2 e,
            // or the row scale under a soft-cap, as kernel v2).
            auto softmax = [&](auto mask_flag, int tile, float corr[2]) {
                constexpr bool MASK = decltype(mask_flag)::value;
                const int kbase = tile * BN;
                // Visible keys of row r: kp in [lo, hi] (causal: kp <= qp; cached: kp < kv_len;
                // window: qp - kp < window), kept relative to this lane's first column so
                // that each element compares its compile-time column offset 8j + (e & 1).
                int lo[2], hi[2];
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int qp = qp0 + 8 * r;
                    hi[r] = min(qp, kv_len - 1) - kbase - cq;
                    lo[r] = window > 0 ? qp - window + 1 - kbase - cq : -(1 << 30);
                }
                // Row maxima in 4 independent chains per row (max is exact in any order).
                float mx[2][4];
#pragma unroll
                for (int r = 0; r < 2; ++r)
#pragma unroll
                    for (int q = 0; q < 4; ++q) mx[r][q] = m_run[r];
#pragma unroll
                for (int j = 0; j < NS; ++j) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float x;
                        if constexpr (KF) {
                            float kf = kfs;
                            if constexpr (!QF) {
                                float4 k4;
                                if constexpr (QK || HS) k4 = kfq[4 * (j / 2)];
                                else k4 = kq[KF ? j / 2 : 0];
                                kf = (j % 2 == 0) ? ((e & 1) ? k4.y : k4.x) : ((e & 1) ? k4.w : k4.z);
                            }
                            // q·(c s) = (q·c) s: kernel v2's expressions (attention.cu, KF).
                            // attn-fp8-qk: x = S kf / sq, the row's 1 / sq applied in the
                            // exponent below (y = S kf here, its row max the same key's).
                            if constexpr (CAP && (QK || HS)) x = cap * tanhf(sc[4 * j + e] * kf * (rq[e >> 1] * scale) / cap) * LOG2E;
                            else if constexpr (CAP) x = cap * tanhf(sc[4 * j + e] * kf * scale / cap) * LOG2E;
                            else x = sc[4 * j + e] * kf;
                        } else if constexpr (CAP) {
                            x = cap * tanhf(sc[4 * j + e] * scale / cap) * LOG2E;
                        } else {
                            x = sc[4 * j + e] * scale_l2;
                        }
                        if constexpr (MASK) {
                            const int k = 8 * j + (e & 1);
                            x = (k >= lo[e >> 1] && k <= hi[e >> 1]) ? x : -INFINITY;
                        }
                        sc[4 * j + e] = x;
                        float& m = mx[e >> 1][(j & 1) * 2 + (e & 1)];
                        m = fmaxf(m, x);
                    }
                }
                float base_r[2];
                // attn-fp8-qk without a soft-cap: m and the scores in units of 1 / sq
                // (sq > 0 keeps the order), the exponent rq (y - m), one FFMA as the FADD.
                constexpr bool RQ = (QK || HS) && !CAP;
                float nb[2];
                (void)nb;
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    float m = fmaxf(fmaxf(mx[r][0], mx[r][1]), fmaxf(mx[r][2], mx[r][3]));
                    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
                    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
                    base_r[r] = m == -INFINITY ? 0.f : m;  // a row with nothing visible yet
                    if constexpr (RQ) {
                        corr[r] = exp2_approx((m_run[r] - base_r[r]) * rq[r]);  // 0 while m_run is -inf
                        nb[r] = -base_r[r] * rq[r];
                    } else {
                        corr[r] = exp2_approx(m_run[r] - base_r[r]);    // 0 while m_run is -inf
                    }
                    m_run[r] = m;
                }
                // Row sums in 4 chains per row, added pairwise at the end.
                float rs[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
                for (int j = 0; j < NS; ++j) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float p;
                        if constexpr (RQ) p = exp2_approx(fmaf(sc[4 * j + e], rq[e >> 1], nb[e >> 1]));
                        else p = exp2_approx(sc[4 * j + e] - base_r[e >> 1]);
                        sc[4 * j + e] = p;
                        rs[e >> 1][(j & 1) * 2 + (e & 1)] += p;
                    }
                }
#pragma unroll
                for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * corr[r] + ((rs[r][0] + rs[r][1]) + (rs[r][2] + rs[r][3]));
            };
            // Whether key tile `tile` needs no mask for any row of this warp.
            auto full_tile = [&](int tile) {
                const int kbase = tile * BN;
                return kbase + BN - 1 <= qp_min && kbase + BN <= kv_len && (window <= 0 || qp_max - kbase < window);
            };
            auto softmax_tile = [&](int tile, float corr[2]) {
                if (full_tile(tile)) softmax(Flag<false>{}, tile, corr);
                else softmax(Flag<true>{}, tile, corr);
            };
            // A coded cache: this lane's K factors of stage `st` (columns 8 j + cq + e, j =
            // 0..15, store_kfac's order) into registers, loaded while S's wgmmas run (the
            // stage is full: full_k was waited for), before the K stage is released.
            auto load_kf = [&](int st) {
                if constexpr (QK || HS) {
                    (void)st;
                } else if constexpr (KF) {
                    const float4* kfp = reinterpret_cast<const float4*>(attn3_smem + (kfac + st * BN * 4 - smem_addr(attn3_smem))) + (lane & 3);
#pragma unroll
                    for (int i = 0; i < KQ; ++i) kq[i] = kfp[4 * i];
                }
            };
            // P of the scored tile as the A fragments of the 16-key steps: chunks 2kk and 2kk
            // + 1; bf16, or f16 under FV (p in [0, 1]: 11 significant bits down to 2^-14).
            auto pack_p = [&]() {
                auto pk = [](float lo, float hi) { return FV ? h2_bits(__floats2half2_rn(lo, hi)) : pack_bf16x2(lo, hi); };
#pragma unroll
                for (int kk = 0; kk < VS; ++kk) {
                    pa[kk][0] = pk(sc[8 * kk], sc[8 * kk + 1]);
                    pa[kk][1] = pk(sc[8 * kk + 2], sc[8 * kk + 3]);
                    pa[kk][2] = pk(sc[8 * kk + 4], sc[8 * kk + 5]);
                    pa[kk][3] = pk(sc[8 * kk + 6], sc[8 * kk + 7]);
                }
            };
            // FV: V stage st's exponent e (tile_vexp; the stage is full); O is kept in units
            // of 2^(e - 127) of the last tile whose P·V was added.
            auto vexp_of = [&](int st) {
                int e = 127;
                if constexpr (FV) asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(e) : "r"(vexp + 4 * st) : "memory");
                return e;
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

            // Software pipeline (FlashAttention-3's intra-warpgroup overlap): while tile i's
            // softmax runs on the CUDA cores, tile i - 1's P·V runs on the tensor cores.
            // Tile 0: S, its softmax (O is zero: no rescale).
            float corr[2];
            // FV: O's units are 2^(e_o - 127); before a tile's P·V is issued, O moves to that
            // tile's e (times 2^(e_o - e), exact), only when e differs (a warp-uniform branch:
            // tiles of one item mostly share their largest scale's binade). Done there, after
            // the V stage's wait, rather than in the rescale by corr, so that the consumers
            // never wait for a V stage before they need it (an early wait measured 3 %
            // slower for fp8 at ctx 4096 d 128).
            int e_o = -1;  // unset: O is zero
            auto to_units = [&](int e) {
                if constexpr (FV) {
                    if (e != e_o) {
                        if (e_o >= 0) {
                            const int d = min(max(e_o - e, -126), 127);
                            const float f = __uint_as_float((uint32_t)(127 + d) << 23);
#pragma unroll
                            for (int i = 0; i < D / 2; ++i) o[i] *= f;
                        }
                        e_o = e;
                    }
                } else {
                    e_o = e;
                }
            };
            mbar_wait(full_k(gt % ST), (gt / ST) & 1);
            issue_s(gt);
            load_kf(gt % ST);
            wgmma_wait<0>();
            fence_regs(sc);
            release(empty_k(gt % ST));
            if constexpr (QF) kfs = ld_shared_f32(kfac + (gt % KFS) * BN * 4);
            else if constexpr (QK || HS) kfq = reinterpret_cast<const float4*>(attn3_smem + (kfac + (gt % KFS) * BN * 4 - smem_addr(attn3_smem))) + (lane & 3);
            softmax_tile(tile_first, corr);
            pack_p();
            for (int i = 1; i < n_tiles; ++i) {
                const int j = gt + i;
                const int s = j % ST, sp = (j - 1) % ST;
                mbar_wait(full_k(s), (j / ST) & 1);
                if constexpr (PINGPONG) asm volatile("bar.sync %0, 256;\n" ::"r"(4 + c) : "memory");  // our turn
                issue_s(j);
                mbar_wait(full_v(sp), ((j - 1) / ST) & 1);
                to_units(vexp_of(sp));
                issue_pv(j - 1);
                if constexpr (PINGPONG) asm volatile("bar.arrive %0, 256;\n" ::"r"(5 - c) : "memory");  // the other's turn
                load_kf(s);
                wgmma_wait<1>();  // S of tile i done (groups retire in order); P·V of i - 1 may run
                fence_regs(sc);
                release(empty_k(s));
                if constexpr (QF) kfs = ld_shared_f32(kfac + (j % KFS) * BN * 4);
                else if constexpr (QK || HS) kfq = reinterpret_cast<const float4*>(attn3_smem + (kfac + (j % KFS) * BN * 4 - smem_addr(attn3_smem))) + (lane & 3);
                softmax_tile(tile_first + i, corr);
                wgmma_wait<0>();  // P·V of tile i - 1 done: pa and o are free
                fence_regs(o);
                release(empty_v(sp));
                rescale_o(corr);
                pack_p();
            }
            {
                const int j = gt + n_tiles - 1;
                const int sp = j % ST;
                mbar_wait(full_v(sp), (j / ST) & 1);
                to_units(vexp_of(sp));
                issue_pv(j);
                wgmma_wait<0>();
                fence_regs(o);
                release(empty_v(sp));
            }
            gt += n_tiles;
            // FV: O's units, 2^(e - 127) (e in [1, 253]: a normal f32); 1 otherwise.
            const float units = __uint_as_float((uint32_t)e_o << 23);

            // O / l per row.
            OUT* ob = reinterpret_cast<OUT*>(a.out) + (long long)it.seq * n_tokens * a.out_stride + (long long)it.h * D;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float l = l_run[r];
                l += __shfl_xor_sync(0xffffffffu, l, 1);
                l += __shfl_xor_sync(0xffffffffu, l, 2);
                const float inv = (1.0f / l) * units;
                const int t = row_w + g + 8 * r;
                if (rot_v) {
                    // O = (H O') / n, O' = Σ p y / l in f32 (the accumulators' layout is
                    // hadamard_frag's: columns 8j + cq + e of rows g and g + 8).
                    float x[D / 4];
#pragma unroll
                    for (int j = 0; j < NO; ++j) {
                        x[2 * j] = o[4 * j + 2 * r] * inv;
                        x[2 * j + 1] = o[4 * j + 2 * r + 1] * inv;
                    }
                    hadamard_frag<D>(x, lane);
                    if (t >= n_tokens) continue;
                    OUT* orow = ob + (long long)t * a.out_stride + cq;
#pragma unroll
                    for (int j = 0; j < NO; ++j) store2<OUT>(orow + 8 * j, x[2 * j] * inv_n, x[2 * j + 1] * inv_n);
                    continue;
                }
                if (t >= n_tokens) continue;
                OUT* orow = ob + (long long)t * a.out_stride + cq;
#pragma unroll
                for (int j = 0; j < NO; ++j) store2<OUT>(orow + 8 * j, o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
            }
        }
    };
    if (cap > 0.f) consume(Flag<true>{});
    else consume(Flag<false>{});
}
}  // namespace attn3

// attn_wgmma_d<D>_bf16_<out>: a bf16 cache, f32 or bf16 output.
#define ATTN_WGMMA(D, outn, OUT)                                                                                 \
    extern "C" __global__ void __launch_bounds__(attn3::THREADS, 1) attn_wgmma_d##D##_bf16_##outn(              \
        const __grid_constant__ AttnWgmmaArgs a) {                                                               \
        attn3::attn_wgmma_impl<D, OUT, attn3::CacheBf16>(a, 0, nullptr, nullptr);                                         \
    }
ATTN_WGMMA(64, f32, float)
ATTN_WGMMA(64, bf16, bf16)
ATTN_WGMMA(128, f32, float)
ATTN_WGMMA(128, bf16, bf16)

// attn_wgmma_d<D>_<fmt>_<out>: a coded cache (fmt = kv::KvFormat::name; K rows of KROW,
// V rows of VROW): fp8 and int8 (K and V rows of one-byte codes and a row scale), k8v4
// (K int8, V int4-g32), nvfp4, k4v2 (K int4-g32, V int2-g32), vq2 (the codebook in
// a.book).
#define ATTN_WGMMA_CODED(D, fmt, KROW, VROW, outn, OUT, NPW)                                                     \
    extern "C" __global__ void __launch_bounds__(128 * (2 + NPW), 1) attn_wgmma_d##D##_##fmt##_##outn(           \
        const __grid_constant__ AttnWgmmaCodedArgs a) {                                                          \
        attn3::attn_wgmma_impl<D, OUT, attn3::CacheCoded<KROW, VROW, 0, NPW>>(a.a, a.rot, a.book, nullptr);      \
    }
// fp8 at d 64: E4M3 pairs converted as before e4m3 halves (CodeE4m3T<false>), which made this
// kernel 1.5 % slower at ctx 4096 d 64 (273.1 / 277.3 TFLOP/s; e4m3d64, 2026-12-04).
ATTN_WGMMA_CODED(64, fp8, attn3::RowBytes<CodeE4m3T<false>>, attn3::RowBytes<CodeE4m3T<false>>, f32, float, 1)
ATTN_WGMMA_CODED(64, fp8, attn3::RowBytes<CodeE4m3T<false>>, attn3::RowBytes<CodeE4m3T<false>>, bf16, bf16, 1)
ATTN_WGMMA_CODED(128, fp8, attn3::RowBytes<CodeE4m3>, attn3::RowBytes<CodeE4m3>, f32, float, 1)
ATTN_WGMMA_CODED(128, fp8, attn3::RowBytes<CodeE4m3>, attn3::RowBytes<CodeE4m3>, bf16, bf16, 1)
ATTN_WGMMA_CODED(64, int8, attn3::RowBytes<CodeInt8>, attn3::RowBytes<CodeInt8>, f32, float, 2)
ATTN_WGMMA_CODED(128, int8, attn3::RowBytes<CodeInt8>, attn3::RowBytes<CodeInt8>, f32, float, 1)
ATTN_WGMMA_CODED(64, k8v4, attn3::RowBytes<CodeInt8>, attn3::RowInt4G32, f32, float, 2)
ATTN_WGMMA_CODED(128, k8v4, attn3::RowBytes<CodeInt8>, attn3::RowInt4G32, f32, float, 1)
ATTN_WGMMA_CODED(64, nvfp4, attn3::RowNvfp4, attn3::RowNvfp4, f32, float, 1)
ATTN_WGMMA_CODED(128, nvfp4, attn3::RowNvfp4, attn3::RowNvfp4, f32, float, 1)
ATTN_WGMMA_CODED(64, k4v2, attn3::RowInt4G32, attn3::RowInt2G32, f32, float, 1)
ATTN_WGMMA_CODED(128, k4v2, attn3::RowInt4G32, attn3::RowInt2G32, f32, float, 1)
ATTN_WGMMA_CODED(64, vq2, attn3::RowVq2, attn3::RowVq2, f32, float, 2)
ATTN_WGMMA_CODED(128, vq2, attn3::RowVq2, attn3::RowVq2, f32, float, 2)

// attn_wgmma_d<D>_fp8qk_<out> (attn-fp8-qk): an fp8 cache with S = Q·Kᵀ on the stored
// E4M3 codes (AttnWgmmaQkArgs: c.a.k the map of the rows' scale bytes, kc the codes'
// swizzled map; V as the fp8 kernel).
#define ATTN_WGMMA_QK(D, outn, OUT)                                                                              \
    extern "C" __global__ void __launch_bounds__(attn3::THREADS, 1) attn_wgmma_d##D##_fp8qk_##outn(              \
        const __grid_constant__ AttnWgmmaQkArgs a) {                                                             \
        attn3::attn_wgmma_impl<D, OUT, attn3::CacheCoded<attn3::RowBytes<CodeE4m3>, attn3::RowBytes<CodeE4m3>, 1>>( \
            a.c.a, a.c.rot, a.c.book, &a.kc);                                                                    \
    }
ATTN_WGMMA_QK(64, f32, float)
ATTN_WGMMA_QK(64, bf16, bf16)
ATTN_WGMMA_QK(128, f32, float)
ATTN_WGMMA_QK(128, bf16, bf16)

// attn_wgmma_d<D>_<fmt>qk_f32 (attn-int8-qk): an int8 or k8v4 cache, K's codes decoded
// to f16 by the producer, S by f16 wgmma (AttnWgmmaCodedArgs, as the format's decoding
// kernel; V's codes in f16 for P·V).
#define ATTN_WGMMA_QKI(D, fmt, VROW)                                                                            \
    extern "C" __global__ void __launch_bounds__(attn3::THREADS, 1) attn_wgmma_d##D##_##fmt##qk_f32(             \
        const __grid_constant__ AttnWgmmaCodedArgs a) {                                                          \
        attn3::attn_wgmma_impl<D, float, attn3::CacheCoded<attn3::RowBytes<CodeInt8>, VROW, 2>>(a.a, a.rot, a.book, nullptr); \
    }
ATTN_WGMMA_QKI(64, int8, attn3::RowBytes<CodeInt8>)
ATTN_WGMMA_QKI(128, int8, attn3::RowBytes<CodeInt8>)
ATTN_WGMMA_QKI(64, k8v4, attn3::RowInt4G32)
ATTN_WGMMA_QKI(128, k8v4, attn3::RowInt4G32)

// attn_wgmma_d<D>_<fmt>f16_f32 (attn-f16): an nvfp4, k4v2 or vq2 cache, K and V decoded
// to f16 times a power of two per tile, q and P in f16, S and P·V by f16 wgmma
// (AttnWgmmaCodedArgs, as the format's decoding kernel).
#define ATTN_WGMMA_QF(D, fmt, KROW, VROW, NPW)                                                                   \
    extern "C" __global__ void __launch_bounds__(128 * (2 + NPW), 1) attn_wgmma_d##D##_##fmt##f16_f32(           \
        const __grid_constant__ AttnWgmmaCodedArgs a) {                                                          \
        attn3::attn_wgmma_impl<D, float, attn3::CacheCoded<KROW, VROW, 3, NPW>>(a.a, a.rot, a.book, nullptr);    \
    }
ATTN_WGMMA_QF(64, nvfp4, attn3::RowNvfp4, attn3::RowNvfp4, 1)
ATTN_WGMMA_QF(128, nvfp4, attn3::RowNvfp4, attn3::RowNvfp4, 1)
ATTN_WGMMA_QF(64, k4v2, attn3::RowInt4G32, attn3::RowInt2G32, 1)
ATTN_WGMMA_QF(128, k4v2, attn3::RowInt4G32, attn3::RowInt2G32, 1)
ATTN_WGMMA_QF(64, vq2, attn3::RowVq2, attn3::RowVq2, 2)
ATTN_WGMMA_QF(128, vq2, attn3::RowVq2, attn3::RowVq2, 2)
