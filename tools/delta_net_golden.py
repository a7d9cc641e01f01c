#!/usr/bin/env python3
"""Golden outputs of Qwen3-Next's Gated DeltaNet ops from Hugging Face transformers, in float64.

Runs transformers' `torch_recurrent_gated_delta_rule` (the exact per-token
recurrence of modeling_qwen3_next.py, with `use_qk_l2norm_in_kernel=True` as
Qwen3NextGatedDeltaNet calls it) and the layer's depthwise causal convolution
(`F.silu(conv1d(x, groups=channels, padding=width-1)[..., :n])`, what the layer
runs without the causal-conv1d kernel) on seeded inputs, and writes
tests/data/delta_net_golden.json. `tests/delta_net_golden.rs` regenerates the
inputs with the Rust twin of the generator (tools/qwen_golden.py) and compares
`backend::cpu::delta_net` in one call and in several calls carrying the state.

transformers casts the recurrence's inputs to float32 ("make sure all tensors
are fp32"); the golden keeps them in float64 by handing the function a `torch`
whose `float32` is `float64` (every other attribute is torch's own), and
records how far the stock float32 run is from it.

Usage: /work/torchenv/bin/python tools/delta_net_golden.py --golden tests/data/delta_net_golden.json
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qwen_golden import generate  # noqa: E402

N, N_K_HEADS, N_V_HEADS, D_K, D_V = 20, 2, 4, 8, 6
CONV_CHANNELS, CONV_WIDTH = 10, 4

# name, shape (row-major, token-major), scale, offset
INPUTS = [
    ("dn.q", [N, N_K_HEADS, D_K], 1.0, 0.0),
    ("dn.k", [N, N_K_HEADS, D_K], 1.0, 0.0),
    ("dn.v", [N, N_V_HEADS, D_V], 1.0, 0.0),
    ("dn.g", [N, N_V_HEADS], 0.5, -0.6),      # log decay in [-1.1, -0.1]
    ("dn.beta", [N, N_V_HEADS], 0.4, 0.5),    # in [0.1, 0.9]
    ("conv.x", [N, CONV_CHANNELS], 1.0, 0.0),
    ("conv.w", [CONV_CHANNELS, CONV_WIDTH], 0.5, 0.0),
]


class Float64Torch:
    """`torch`, except that `float32` is `float64`."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        return self._torch.float64 if name == "float32" else getattr(self._torch, name)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--golden", required=True)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    import transformers
    from transformers.models.qwen3_next import modeling_qwen3_next as mod

    x = {name: generate(name, shape, scale, offset) for name, shape, scale, offset in INPUTS}
    t = {k: torch.from_numpy(v.astype(np.float64)) for k, v in x.items()}
    q, k, v = t["dn.q"][None], t["dn.k"][None], t["dn.v"][None]
    g, beta = t["dn.g"][None], t["dn.beta"][None]

    stock_torch = mod.torch
    mod.torch = Float64Torch(torch)
    try:
        out, state = mod.torch_recurrent_gated_delta_rule(
            q, k, v, g, beta, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert out.dtype == torch.float64 and state.dtype == torch.float64
        # Two calls, the second from the first's final state: transformers' own carry.
        a, sa = mod.torch_recurrent_gated_delta_rule(
            q[:, :7], k[:, :7], v[:, :7], g[:, :7], beta[:, :7], output_final_state=True, use_qk_l2norm_in_kernel=True)
        b, _ = mod.torch_recurrent_gated_delta_rule(
            q[:, 7:], k[:, 7:], v[:, 7:], g[:, 7:], beta[:, 7:], initial_state=sa, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        carry_diff = (torch.cat([a, b], dim=1) - out).abs().max().item()
    finally:
        mod.torch = stock_torch
    out32, _ = mod.torch_recurrent_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    stock_diff = (out32.to(torch.float64) - out).abs().max().item()

    # (1, channels, n) through the depthwise conv, as Qwen3NextGatedDeltaNet does without the kernel.
    xc = t["conv.x"].T[None]
    w = t["conv.w"][:, None, :]
    conv = F.silu(F.conv1d(xc, w, bias=None, padding=CONV_WIDTH - 1, groups=CONV_CHANNELS)[..., :N])[0].T

    golden = {
        "about": "transformers' torch_recurrent_gated_delta_rule (use_qk_l2norm_in_kernel) and Qwen3-Next's depthwise "
                 "causal conv + SiLU, in float64, on seeded inputs. Made by tools/delta_net_golden.py; checked by "
                 "tests/delta_net_golden.rs.",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "numpy": np.__version__},
        "generator": "tools/qwen_golden.py generate(name, shape, scale, offset)",
        "inputs": [{"name": n, "shape": s, "scale": sc, "offset": o} for n, s, sc, o in INPUTS],
        "shape": {"n": N, "n_k_heads": N_K_HEADS, "n_v_heads": N_V_HEADS, "d_k": D_K, "d_v": D_V,
                  "conv_channels": CONV_CHANNELS, "conv_width": CONV_WIDTH},
        "delta_out": out[0].reshape(N, N_V_HEADS * D_V).flatten().tolist(),
        "delta_final_state": state[0].flatten().tolist(),
        "conv_out": conv.flatten().tolist(),
        "max_abs_diff_two_calls_with_initial_state": carry_diff,
        "max_abs_diff_stock_float32": stock_diff,
    }
    print(f"carry diff {carry_diff:.3e}, stock float32 diff {stock_diff:.3e}", file=sys.stderr)
    with open(args.golden, "w") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
