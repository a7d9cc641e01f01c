#!/usr/bin/env python3
"""Golden scores of two tiny seeded qwen2 / qwen3 checkpoints from Hugging Face transformers.

Builds two Hugging Face folders (config.json, model.safetensors in F32, a
WordLevel tokenizer.json, tokenizer_config.json) whose weights come from a
counter-based formula, runs each with transformers in float64 (eager attention)
on a fixed token sequence, and writes tests/data/qwen_golden.json: per scored
position the log-sum-exp of the logits, the logit of the next token and the NLL.
`tests/qwen_golden.rs` rebuilds the same folders with its Rust twin of the
generator, checks every tensor's SHA-256 against this file, converts them to
artifacts and compares our CPU backend's scores.

Weight generator (the same in tests/qwen_golden.rs):
  h     = FNV-1a-64 of the UTF-8 Hugging Face tensor name
  bits  = splitmix64 output number i (i = 0, 1, ...) of the stream seeded with h,
          i.e. mix(h + (i + 1) * 0x9E3779B97F4A7C15), wrapping u64
  u     = (bits >> 11) * 2^-53                      in [0, 1)
  value = f32(scale * (2u - 1) + offset)            computed in f64, rounded once
Element i is in row-major order of the tensor's shape.

Precision: transformers' Qwen2/Qwen3 RMSNorm casts its input to float32 even
in a float64 model. The golden numbers come from the float64 model with every
RMSNorm kept in float64 (`--stock-norms` keeps transformers' own); the file
also records how far the stock float32 norms move the NLL. RoPE's cos/sin are
computed in float32 by transformers in both cases (our CPU backend does the same).

Usage: python3 tools/qwen_golden.py --golden tests/data/qwen_golden.json
       python3 tools/qwen_golden.py --build-only DIR   (folders only; no torch needed)
Needs numpy and safetensors; for scoring also torch and transformers.
"""

import argparse
import hashlib
import json
import os
import sys
import tempfile

import numpy as np

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15

# The scored sequence: token j of N_TOKENS.
N_TOKENS = 48
TOKEN_FORMULA = "(31*j*j + 17*j + 3) % 256"


def tokens():
    return [(31 * j * j + 17 * j + 3) % 256 for j in range(N_TOKENS)]


def fnv1a64(name):
    h = 0xCBF29CE484222325
    for b in name.encode("utf-8"):
        h = ((h ^ b) * 0x100000001B3) & MASK64
    return h


def generate(name, shape, scale, offset):
    """The tensor `name` as float32, by the formula in the module docstring."""
    n = int(np.prod(shape))
    h = np.uint64(fnv1a64(name))
    with np.errstate(over="ignore"):
        z = h + (np.arange(n, dtype=np.uint64) + np.uint64(1)) * np.uint64(GAMMA)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u = (z >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return (scale * (2.0 * u - 1.0) + offset).astype(np.float32).reshape(shape)


# Shared geometry of both models.
VOCAB, HIDDEN, N_LAYERS, N_HEADS, N_KV_HEADS, FFN = 256, 64, 2, 4, 2, 128

MODELS = {
    # QKV bias, tied head, head_dim = hidden / heads.
    "qwen2": dict(head_dim=16, rope_theta=1e6, tied=True, qkv_bias=True, qk_norm=False, embed_scale=0.5),
    # QK norm, separate lm_head, head_dim 32 != hidden / heads.
    "qwen3": dict(head_dim=32, rope_theta=1e4, tied=False, qkv_bias=False, qk_norm=True, embed_scale=1.0),
}


def config_json(model_type, m):
    arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]
    cfg = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": N_LAYERS,
        "num_attention_heads": N_HEADS,
        "num_key_value_heads": N_KV_HEADS,
        "head_dim": m["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": m["rope_theta"],
        "rope_scaling": None,
        "tie_word_embeddings": m["tied"],
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
    }
    if model_type == "qwen3":
        cfg["attention_bias"] = False
    return cfg


def tensor_specs(m):
    """(Hugging Face name, shape, scale, offset) of every tensor, in file order."""
    d_q, d_kv = N_HEADS * m["head_dim"], N_KV_HEADS * m["head_dim"]
    specs = [("model.embed_tokens.weight", [VOCAB, HIDDEN], m["embed_scale"], 0.0)]
    norm = (0.2, 1.0)  # norm weights near 1
    for l in range(N_LAYERS):
        p = f"model.layers.{l}."
        specs += [
            (p + "input_layernorm.weight", [HIDDEN], *norm),
            (p + "self_attn.q_proj.weight", [d_q, HIDDEN], 0.25, 0.0),
            (p + "self_attn.k_proj.weight", [d_kv, HIDDEN], 0.25, 0.0),
            (p + "self_attn.v_proj.weight", [d_kv, HIDDEN], 0.2, 0.0),
            (p + "self_attn.o_proj.weight", [HIDDEN, d_q], 0.2, 0.0),
        ]
        if m["qkv_bias"]:
            specs += [
                (p + "self_attn.q_proj.bias", [d_q], 0.5, 0.0),
                (p + "self_attn.k_proj.bias", [d_kv], 0.5, 0.0),
                (p + "self_attn.v_proj.bias", [d_kv], 0.5, 0.0),
            ]
        if m["qk_norm"]:
            specs += [
                (p + "self_attn.q_norm.weight", [m["head_dim"]], *norm),
                (p + "self_attn.k_norm.weight", [m["head_dim"]], *norm),
            ]
        specs += [
            (p + "post_attention_layernorm.weight", [HIDDEN], *norm),
            (p + "mlp.gate_proj.weight", [FFN, HIDDEN], 0.25, 0.0),
            (p + "mlp.up_proj.weight", [FFN, HIDDEN], 0.25, 0.0),
            (p + "mlp.down_proj.weight", [HIDDEN, FFN], 0.15, 0.0),
        ]
    specs.append(("model.norm.weight", [HIDDEN], *norm))
    if not m["tied"]:
        specs.append(("lm_head.weight", [VOCAB, HIDDEN], 0.25, 0.0))
    return specs


def tokenizer_json():
    """A WordLevel vocabulary: "<unk>" is id 0, "t1".."t255" are ids 1..255."""
    vocab = {"<unk>": 0}
    vocab.update({f"t{i}": i for i in range(1, VOCAB)})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }


def write_folder(folder, specs, cfg):
    """Writes a Hugging Face folder of generated F32 tensors `specs` and `cfg`; returns the tensor records."""
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    tensors, records = {}, []
    for name, shape, scale, offset in specs:
        t = generate(name, shape, scale, offset)
        tensors[name] = t
        records.append({
            "name": name, "shape": shape, "scale": scale, "offset": offset,
            "sha256": hashlib.sha256(t.astype("<f4").tobytes()).hexdigest(),
        })
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    for fname, doc in [("config.json", cfg), ("tokenizer.json", tokenizer_json()),
                       ("tokenizer_config.json", {"add_bos_token": False, "add_eos_token": False})]:
        with open(os.path.join(folder, fname), "w") as f:
            json.dump(doc, f, indent=1)
    return records


def build_folder(model_type, folder):
    """Writes the Hugging Face folder; returns its config and tensor records for the golden file."""
    m = MODELS[model_type]
    cfg = config_json(model_type, m)
    return cfg, write_folder(folder, tensor_specs(m), cfg)


def keep_norms_in_float64(model):
    """Replaces every RMSNorm's forward with one that computes in the input dtype."""
    import torch

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))

    n = 0
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            mod.forward = forward.__get__(mod)
            n += 1
    return n


def score(folder, model_type, stock_norms):
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float64, attn_implementation="eager", output_loading_info=True)
    model.eval()
    missing = [k for k in info.get("missing_keys", []) if k != "lm_head.weight"]
    assert not missing and not info.get("unexpected_keys") and not info.get("mismatched_keys"), info
    m = MODELS[model_type]
    cfg = model.config
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    assert theta == m["rope_theta"], (theta, m["rope_theta"])
    attn = model.model.layers[0].self_attn
    assert tuple(attn.q_proj.weight.shape) == (N_HEADS * m["head_dim"], HIDDEN)
    assert (attn.q_proj.bias is not None) == m["qkv_bias"]
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == m["tied"], (tied, m["tied"])
    assert model.lm_head.weight.dtype == torch.float64
    n_norms = 0 if stock_norms else keep_norms_in_float64(model)

    out, _ = scored_forward(model)
    return {**out, "n_norms_patched": n_norms}


def scored_forward(model, n_experts=None):
    """The model's float64 forward over tokens(): per-position log-sum-exp, target
    logit and NLL; with n_experts, also how often each layer's router picked each
    expert (forward hooks on every layer's mlp.gate, whose third output is the
    top-k indices), else None."""
    import torch

    counts = None
    hooks = []
    if n_experts is not None:
        counts = [[0] * n_experts for _ in model.model.layers]
        for l, layer in enumerate(model.model.layers):
            def hook(_m, _inp, out, l=l):
                for e in out[2].flatten().tolist():
                    counts[l][e] += 1
            hooks.append(layer.mlp.gate.register_forward_hook(hook))
    ids = torch.tensor([tokens()], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].to(torch.float64)  # (n_tokens, vocab)
    for h in hooks:
        h.remove()
    lse = torch.logsumexp(logits[:-1], dim=-1)
    target = logits[:-1].gather(1, ids[0, 1:, None])[:, 0]
    nll = lse - target
    return {"lse": lse.tolist(), "target_logit": target.tolist(), "nll": nll.tolist()}, counts


def write_golden(path, out):
    """Writes a golden file as every script here does: indented JSON, one final newline."""
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


def moe_golden(about, cfg, records, gguf, exact, drift, extra=None):
    """The golden document of a mixture-of-experts script (qwen_moe_golden.py,
    qwen_next_golden.py): provenance, tokens, the checkpoint's config and
    tensor records, llama.cpp's GGUF names, the float64 scores and routing
    counts (`exact`, from the script's score()), then `extra` sections, then
    the drift of transformers' stock float32 paths."""
    import torch
    import transformers

    out = {
        "about": about,
        "versions": {"python": sys.version.split()[0], "numpy": np.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "generator": "tools/qwen_golden.py generate(): value_i = f32(scale * (2u - 1) + offset), "
                     "u = (splitmix64_i(fnv1a64(name)) >> 11) * 2^-53",
        "tokens": tokens(),
        "token_formula": TOKEN_FORMULA,
        "n_tokens": N_TOKENS,
        "positions": "entry p scores token p + 1 given tokens 0..=p",
        "config": cfg,
        "tensors": records,
        "gguf": gguf,
        "lse": exact["lse"],
        "target_logit": exact["target_logit"],
        "nll": exact["nll"],
        "mean_nll": sum(exact["nll"]) / len(exact["nll"]),
        "expert_counts": exact["expert_counts"],
        "expert_counts_about": "per layer, per expert: positions of the one 48-token forward routed to it",
        "patched_to_float64": exact["patched"],
    }
    out.update(extra or {})
    out["max_abs_nll_change_with_stock_float32_paths"] = drift
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--golden", help="write the golden JSON here")
    ap.add_argument("--build-only", metavar="DIR", help="only write the two folders under DIR")
    ap.add_argument("--stock-norms", action="store_true", help="keep transformers' float32 RMSNorm")
    args = ap.parse_args()

    if args.build_only:
        for mt in MODELS:
            build_folder(mt, os.path.join(args.build_only, mt))
        return 0
    if not args.golden:
        ap.error("--golden or --build-only is required")

    import torch
    import transformers

    torch.use_deterministic_algorithms(True)
    out = {
        "about": "Tiny seeded qwen2/qwen3 checkpoints scored by Hugging Face transformers in float64 "
                 "(eager attention, RMSNorm kept in float64; RoPE cos/sin float32 as transformers computes them). "
                 "Made by tools/qwen_golden.py; checked by tests/qwen_golden.rs.",
        "versions": {"python": sys.version.split()[0], "numpy": np.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "generator": {
            "formula": "value_i = f32(scale * (2u - 1) + offset) in f64; u = (splitmix64_i(fnv1a64(name)) >> 11) * 2^-53; "
                       "splitmix64_i(h) = mix(h + (i + 1) * 0x9E3779B97F4A7C15); i in row-major order",
        },
        "tokens": tokens(),
        "token_formula": TOKEN_FORMULA,
        "positions": "entry p scores token p + 1 given tokens 0..=p",
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for mt in MODELS:
            folder = os.path.join(tmp, mt)
            cfg, records = build_folder(mt, folder)
            exact = score(folder, mt, stock_norms=args.stock_norms)
            stock = score(folder, mt, stock_norms=True)
            drift = max(abs(a - b) for a, b in zip(exact["nll"], stock["nll"]))
            out["models"][mt] = {
                "config": cfg,
                "tensors": records,
                "lse": exact["lse"],
                "target_logit": exact["target_logit"],
                "nll": exact["nll"],
                "mean_nll": sum(exact["nll"]) / len(exact["nll"]),
                "rms_norms_patched": exact["n_norms_patched"],
                "max_abs_nll_change_with_stock_float32_norms": drift,
            }
            print(f"{mt}: mean NLL {out['models'][mt]['mean_nll']:.12f}, {exact['n_norms_patched']} norms in f64, "
                  f"stock-norm drift {drift:.3e}", file=sys.stderr)
    write_golden(args.golden, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
