#!/usr/bin/env python3
"""The float64 truth for --kl-reference.

Reads a `--save-tokens` file (every window's input ids after BOS
replacement, plus the run fingerprint), runs each window through a Hugging
Face transformers model in float64 with PyTorch, and writes a top-tokens file
(docs/top-tokens.md) for exactly those windows: per scored position the 64
most probable ids with their float64 log-softmax rounded to f32, the target's
log-probability and ln(1 - sum of the 64 probabilities).

The model is either a GGUF file (dequantized by transformers through the
`gguf` package: `from_pretrained(folder, gguf_file=name)`) or a Hugging Face
folder. Nothing is downloaded.

    infernix-perplexity MODEL.ninfer --text wiki.test.raw --method chunks \\
        --context 512 --chunks 4 --save-tokens tokens.json --dry-run --output /tmp/r
    python3 tools/fp64_reference.py --tokens tokens.json \\
        --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf --output smollm2-fp64.topk
    infernix-perplexity MODEL.ninfer ... --kl-reference smollm2-fp64.topk

Needs: torch, transformers, gguf, numpy (pip install torch transformers gguf).

Numerics: transformers computes a few things in float32 even in a float64
model (RMSNorm and the eager attention softmax upcast "to float32", RoPE
builds its inverse frequencies and angles in float32), and loads a GGUF with
its weights packed and float32 matmuls unless told to dequantize. This tool
loads with `GgufConfig(dequantize=True)`, rebuilds the rotary modules and
runs every forward pass under a torch function mode ([`Float64Mode`]) that
turns every request for float32/float16/bfloat16 into float64, and refuses
to write anything if a single op still returns a low-precision tensor. So
weights (dequantized by `gguf`), activations, norms, RoPE, attention,
logits and log_softmax are float64 end to end. The rest mass is summed
directly over the ids outside the top 64 (a log-sum-exp, so no cancellation
even when the top 64 hold almost all the mass). Ties in the top-64 order go
to the smaller id (a stable sort), as in the Rust writer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np

MAGIC = b"INFXTOPK"
TRAILER_MAGIC = b"INFXTEND"
VERSION = 1
FORMAT = "infernix-top-tokens"
TOKENS_FORMAT = "infernix-tokens"


def token_ids_sha256(ids) -> str:
    return hashlib.sha256(np.asarray(ids, dtype="<u4").tobytes()).hexdigest()


def load_saved_tokens(path: Path) -> dict:
    saved = json.loads(path.read_text())
    if saved.get("format") != TOKENS_FORMAT or saved.get("version") != 1:
        sys.exit(f"{path}: not a --save-tokens file (format {saved.get('format')!r}, version {saved.get('version')!r})")
    fp = saved["fingerprint"]
    if len(saved["tokens"]) != len(fp["streams"]):
        sys.exit(f"{path}: {len(saved['tokens'])} token lists for {len(fp['streams'])} streams")
    for s, toks in zip(fp["streams"], saved["tokens"]):
        if len(toks) != len(s["windows"]):
            sys.exit(f"{path}: stream {s['name']}: {len(toks)} token lists for {len(s['windows'])} windows")
        for w, t in zip(s["windows"], toks):
            if len(t) != w["end"] - w["begin"] or token_ids_sha256(t) != w["tokens_sha256"]:
                sys.exit(f"{path}: stream {s['name']} window {w['index']}: tokens do not match the fingerprint")
    return saved


def float64_mode(torch):
    """A torch function mode that keeps every computation in float64.

    Any dtype=float32/float16/bfloat16 argument, `.float()`, `.half()`,
    `.bfloat16()` and `.to(<low dtype>)` become float64; ops that still
    return a low-precision tensor are counted in `low_outputs`.
    """
    import collections

    from torch.overrides import TorchFunctionMode

    low = (torch.float32, torch.float16, torch.bfloat16)

    class Float64Mode(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.low_outputs = collections.Counter()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if kwargs.get("dtype") in low:
                kwargs["dtype"] = torch.float64
            if func in (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16):
                func, args = torch.Tensor.to, (args[0], torch.float64)
            elif func in (torch.Tensor.to, torch.Tensor.type):
                args = tuple(torch.float64 if a in low else a for a in args)
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.dtype in low:
                self.low_outputs[getattr(func, "__name__", str(func))] += 1
            return out

    return Float64Mode()


def load_model(args, torch, mode):
    from transformers import AutoModelForCausalLM

    kw = dict(dtype=torch.float64, attn_implementation="eager")
    if args.gguf:
        from transformers import GgufConfig

        gguf = Path(args.gguf).resolve()
        kw["quantization_config"] = GgufConfig(dequantize=True)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, **kw)
        with gguf.open("rb") as f:
            source = {"gguf": str(gguf), "sha256": hashlib.file_digest(f, "sha256").hexdigest()}
    else:
        model = AutoModelForCausalLM.from_pretrained(args.hf, **kw)
        source = {"hf": str(Path(args.hf).resolve())}
    # Rotary modules compute their inverse frequencies at construction, in
    # float32: build them again under the float64 mode.
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            with mode:
                rebuilt = type(module)(module.config)
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, rebuilt)
    model.eval().to(args.device)
    bad = {n: p.dtype for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_floating_point() and p.dtype != torch.float64}
    if bad:
        sys.exit(f"not float64 after loading: {bad}")
    packed = [type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()]
    if packed:
        sys.exit(f"weights still packed in GGUF modules: {sorted(set(packed))}")
    return model, source


def window_records(model, torch, mode, ids, first_row, targets, k, device):
    """Records of one window: rows first_row.. predict `targets` in order."""
    x = torch.tensor([ids], dtype=torch.long, device=device)
    with torch.no_grad(), mode:
        logits = model(input_ids=x).logits[0]  # (n_tokens, n_vocab), float64
    if mode.low_outputs:
        sys.exit(f"ops returned float32/16 tensors despite the float64 mode: {dict(mode.low_outputs)}")
    assert logits.dtype == torch.float64, logits.dtype
    rows = logits[first_row : first_row + len(targets)].to(torch.float64)
    lp = torch.log_softmax(rows, dim=-1)  # (n_targets, n_vocab)
    n_vocab = lp.shape[1]
    # Stable sort: equal log-probabilities keep id order (smaller id first).
    order = torch.sort(lp, dim=-1, descending=True, stable=True).indices
    top_ids = order[:, :k]
    top_lp = torch.gather(lp, 1, top_ids)
    if k == n_vocab:
        log_rest = torch.full((lp.shape[0],), -math.inf, dtype=torch.float64, device=lp.device)
    else:
        rest_lp = torch.gather(lp, 1, order[:, k:])
        log_rest = torch.logsumexp(rest_lp, dim=-1)
    tgt = torch.tensor(targets, dtype=torch.long, device=lp.device).unsqueeze(1)
    target_lp = torch.gather(lp, 1, tgt).squeeze(1)
    n = lp.shape[0]
    rec = np.zeros((n, 2 + 2 * k), dtype="<u4")
    rec[:, 0] = target_lp.cpu().numpy().astype("<f4").view("<u4")
    rec[:, 1] = log_rest.cpu().numpy().astype("<f4").view("<u4")
    rec[:, 2 : 2 + k] = top_ids.cpu().numpy().astype("<u4")
    rec[:, 2 + k :] = top_lp.cpu().numpy().astype("<f4").view("<u4")
    nll = -target_lp.cpu().numpy()
    return rec.tobytes(), nll


def write_reference(model, torch, mode, saved: dict, output: Path, producer: dict) -> None:
    """Writes the top-tokens file of one --save-tokens file's windows (temp file, then rename)."""
    fp = saved["fingerprint"]
    k = int(saved["top_k"])
    n_positions = sum(w["end"] - w["first_target"] for s in fp["streams"] for w in s["windows"])
    header = {"format": FORMAT, "producer": producer, "n_positions": n_positions, "fingerprint": fp}
    hjson = json.dumps(header, separators=(",", ":")).encode()
    tmp = output.with_name(output.name + f".tmp-{os.getpid()}")
    h = hashlib.sha256()
    n_written = 0
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<IIQ", VERSION, k, len(hjson)) + hjson)
            for si, (s, toks) in enumerate(zip(fp["streams"], saved["tokens"])):
                for w, ids in zip(s["windows"], toks):
                    t = time.time()
                    first_row = w["first_target"] - w["begin"] - 1
                    targets = ids[first_row + 1 :]
                    rec, nll = window_records(model, torch, mode, ids, first_row, targets, k, producer["device"])
                    h.update(rec)
                    f.write(rec)
                    n_written += len(targets)
                    print(
                        f"stream {si} ({s['name']}) window {w['index']}: {len(targets)} targets, "
                        f"NLL sum {nll.sum():.10f}, mean {nll.mean():.10f} ({time.time() - t:.1f} s)",
                        file=sys.stderr,
                    )
            assert n_written == n_positions, (n_written, n_positions)
            f.write(TRAILER_MAGIC + struct.pack("<Q", n_written) + h.digest())
        os.replace(tmp, output)
    finally:
        if tmp.exists():
            tmp.unlink()
    print(f"wrote {output}: {n_positions} positions, top-{k}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", required=True, type=Path, action="append",
                    help="a --save-tokens file (repeat with --output: one model load for several files)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="GGUF model file (dequantized by transformers/gguf)")
    src.add_argument("--hf", help="Hugging Face model folder")
    ap.add_argument("--output", required=True, type=Path, action="append", help="top-tokens file to write, one per --tokens, same order")
    ap.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args()
    if len(args.tokens) != len(args.output):
        sys.exit(f"{len(args.tokens)} --tokens for {len(args.output)} --output")

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    # Every input is checked before the model loads.
    saved = [load_saved_tokens(p) for p in args.tokens]
    t0 = time.time()
    mode = float64_mode(torch)
    model, source = load_model(args, torch, mode)
    n_vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else model.config.vocab_size
    out_vocab = model.get_output_embeddings().weight.shape[0]
    for path, sv in zip(args.tokens, saved):
        if out_vocab != sv["fingerprint"]["n_vocab"]:
            sys.exit(f"{args.gguf or args.hf}: {out_vocab} output logits (config vocab_size {n_vocab}), "
                     f"{path} was written for a vocabulary of {sv['fingerprint']['n_vocab']}")
    print(f"model loaded in {time.time() - t0:.1f} s ({source}), vocabulary {out_vocab}", file=sys.stderr)
    producer = {
        "tool": "tools/fp64_reference.py",
        "dtype": "float64 (every op, checked)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": args.device,
        "model": source,
    }
    for sv, output in zip(saved, args.output):
        write_reference(model, torch, mode, sv, output, producer)


if __name__ == "__main__":
    main()
