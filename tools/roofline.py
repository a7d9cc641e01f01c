#!/usr/bin/env python3
"""Roofline account of one evaluator run (docs/performance.md): reads its report.json
and the PROFILE lines of the same plan run with INFERNIX_CUDA_PROFILE=1, and prints per
op family the GPU time, its share, and the rate achieved against the measured H200
ceilings (bf16 dense ~790 TFLOP/s, device copy ~4.3 TB/s).

Usage: roofline.py GEOMETRY REPORT.json PROFILE.txt
GEOMETRY: smollm2-135m | gemma3-270m | llama-8b (the body's shapes, below).

Counts (the ones docs/performance.md has used since gemm6):
- matmul: q, k, v, o and down, 2 x M x N x K per token; gated_ffn: gate and up;
  lm_head: the scored rows only (report.json tokens_scored).
- attention: FlashAttention's count, 4 x n_heads x d_head per (query, visible key),
  the visible keys summed over every window of the report (causal, sliding window
  for the local layers of gemma3).
- rms_norm (llama bodies since e2e7): the f32 row read and the bf16 norm written,
  6 bytes an element, 2 norms a layer and token; rope: q and k f32 read and written.
  No byte count for gemma3's norm families (post norms and q/k norms mix row widths).
"""
import json
import re
import sys

PEAK_TFLOPS, COPY_TBS = 790.0, 4.3
G = {
    #              d     layers heads kv  d_head ffn    vocab   local window (every 6th layer global)
    "smollm2-135m": (576, 30, 9, 3, 64, 1536, 49152, None),
    "gemma3-270m": (640, 18, 4, 1, 256, 2048, 262144, 512),
    "llama-8b": (4096, 32, 32, 8, 128, 14336, 49152, None),
}


def visible_keys(n, window):
    """Sum over the n queries of a window of the keys each sees (causal, optional sliding window)."""
    if window is None or window >= n:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in G:
        sys.exit(__doc__)
    d, n_layers, nh, nkv, dh, ffn, vocab, window = G[sys.argv[1]]
    r = json.load(open(sys.argv[2]))
    prof = {m[1]: (float(m[2]), int(m[3])) for m in re.finditer(r"^PROFILE (\w+)\s+([\d.]+) ms\s+(\d+) calls", open(sys.argv[3]).read(), re.M)}
    t = r["timing"]
    n_tok, n_scored = t["tokens_processed"], t["tokens_scored"]
    lengths = [w["input_tokens"] for s in r["results"]["streams"] for w in s["windows"]]
    if window is None:
        keys = n_layers * sum(visible_keys(n, None) for n in lengths)
    else:
        n_global = n_layers // 6
        keys = sum(n_global * visible_keys(n, None) + (n_layers - n_global) * visible_keys(n, window) for n in lengths)
    flops = {
        "matmul": 2 * n_tok * n_layers * (d * nh * dh + 2 * d * nkv * dh + nh * dh * d + ffn * d),
        "gated_ffn": 2 * n_tok * n_layers * 2 * d * ffn,
        "lm_head": 2 * n_scored * d * vocab,
        "attention": 4 * nh * dh * keys,
    }
    bytes_ = {"rope": n_tok * n_layers * (nh + nkv) * dh * 8}
    if window is None:
        bytes_["rms_norm"] = n_tok * (2 * n_layers + 1) * d * 6
    total = sum(ms for ms, _ in prof.values())
    print(f"{sys.argv[1]}: {n_tok} tokens processed, {n_scored} scored, {len(lengths)} windows; "
          f"{total:.1f} ms GPU (profile), scoring {t['scoring_seconds'] * 1e3:.1f} ms wall (timed run)")
    for fam, (ms, calls) in sorted(prof.items(), key=lambda kv: -kv[1][0]):
        line = f"  {fam:<13} {ms:9.1f} ms {100 * ms / total:5.1f} % {calls:6d} calls"
        if fam in flops:
            rate = flops[fam] / (ms * 1e-3) / 1e12
            line += f"  {rate:7.1f} TFLOP/s  {100 * rate / PEAK_TFLOPS:5.1f} % of {PEAK_TFLOPS:.0f}"
        elif fam in bytes_:
            rate = bytes_[fam] / (ms * 1e-3) / 1e12
            line += f"  {rate:7.2f} TB/s     {100 * rate / COPY_TBS:5.1f} % of {COPY_TBS}"
        print(line)


if __name__ == "__main__":
    main()
