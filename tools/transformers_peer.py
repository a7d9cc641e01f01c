#!/usr/bin/env python3
"""The transformers peer: perplexity and speed of Hugging Face transformers on
exactly the windows infernix-perplexity scores.

Reads a `--save-tokens` file (docs/top-tokens.md: every window's input ids
after BOS replacement, and where its scored targets begin), loads a GGUF model
with transformers (weights dequantized by the `gguf` package, then cast to
--dtype, bfloat16 by default), runs the windows in batches of equal length
with SDPA attention under torch.inference_mode, takes the float32 log-softmax
of the logits at the scored positions only, and writes a JSON summary: NLL sum,
mean, perplexity over all scored targets, per-window NLL sums, load time and
the scoring time (one untimed warm-up batch first; then every batch, timed
between two CUDA synchronizations, model load excluded) with tokens/s.

    infernix-perplexity MODEL.ninfer --text wiki.test.raw --method chunks --context 512 \\
        --save-tokens tokens.json --dry-run --output /tmp/dry
    python3 tools/transformers_peer.py --gguf MODEL.gguf --tokens tokens.json \\
        --output peer.json [--device cuda] [--dtype bfloat16] [--batch 16]

--tokens/--output pairs may repeat: the model loads once and scores each file
in turn (each with its own warm-up batch and timing).

`--random-body llama-8b --vocab N` (in place of --gguf) builds a random-weight
LlamaForCausalLM of Llama-3-8B's body (d_model 4096, 32 layers, 32/8 heads of
128, ffn 14336; RoPE base left at transformers' default) and a vocabulary of N in --dtype, directly on
the device: the dense-speed peer of our 8B-class synthetic twins (dense speed
does not depend on weight values; its perplexity means nothing and is marked
so; transformers' GGUF loader would take a quarter of an hour per twin).
`--random-body qwen3moe-30b-a3b` does the same with a Qwen3MoeForCausalLM of
Qwen3-30B-A3B's body (48 layers, d_model 2048, 32/4 heads of 128, 128 experts
of 768, top 8, norm_topk_prob, QK norm), the peer of our qwen3moe-30b-a3b twin
(MoE speed depends on the routing, hence on the weights: ours and this one
route random weights differently, both spread tokens over the experts; the
summary records the experts implementation transformers used).

A window of L tokens with targets from `first_target` on: the logits at rows
first_target-begin-1 .. L-2 predict ids first_target-begin .. L-1 of the window.
The model's own forward makes the logits (with `logits_to_keep` when the model
takes it, so the LM head only runs on the rows needed), including whatever it
applies at the end (Gemma's final soft-cap when its config sets one).
Batches hold windows of one length only (no padding); by default as many as
fit --batch-tokens tokens (16 windows of 512, 2 of 4096).

Needs torch, transformers, gguf, numpy. Token files may be .json, .json.gz or
.json.xz. Exit status 2 with one line on stderr when a file or a window cannot
be handled.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import inspect
import json
import lzma
import math
import os
import platform
import struct
import sys
import time
from pathlib import Path

TOKENS_FORMAT = "infernix-tokens"
TOKENS_VERSION = 1


def fail(msg: str):
    """Prints one error line and exits with status 2."""
    print(f"transformers_peer.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def log(msg: str) -> None:
    print(f"transformers_peer.py: {msg}", file=sys.stderr, flush=True)


def sha256_of(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def open_maybe_compressed(path: Path):
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


class Window:
    """One window: its ids and the rows whose logits are scored."""

    __slots__ = ("stream", "stream_name", "index", "ids", "first_row", "n_targets")

    def __init__(self, stream, stream_name, index, ids, first_row, n_targets):
        self.stream = stream
        self.stream_name = stream_name
        self.index = index
        self.ids = ids
        self.first_row = first_row  # row whose logits predict the first target
        self.n_targets = n_targets  # rows first_row .. first_row + n_targets - 1

    @property
    def length(self) -> int:
        return len(self.ids)


def read_windows(path: Path) -> tuple[dict, list[Window]]:
    """Reads and checks a --save-tokens file; returns its fingerprint and windows."""
    try:
        with open_maybe_compressed(path) as f:
            saved = json.load(f)
    except (OSError, EOFError, lzma.LZMAError, json.JSONDecodeError, UnicodeDecodeError) as e:
        fail(f"{path}: cannot read a --save-tokens JSON file: {e}")
    if not isinstance(saved, dict) or saved.get("format") != TOKENS_FORMAT or saved.get("version") != TOKENS_VERSION:
        got = (saved.get("format"), saved.get("version")) if isinstance(saved, dict) else type(saved).__name__
        fail(f"{path}: not a --save-tokens file ({got}; expected format {TOKENS_FORMAT!r} version {TOKENS_VERSION})")
    try:
        fp = saved["fingerprint"]
        streams = fp["streams"]
        token_lists = saved["tokens"]
        n_vocab = int(fp["n_vocab"])
    except (KeyError, TypeError, ValueError) as e:
        fail(f"{path}: missing field {e}")
    if len(token_lists) != len(streams):
        fail(f"{path}: {len(token_lists)} token lists for {len(streams)} streams")
    windows: list[Window] = []
    for si, (s, toks) in enumerate(zip(streams, token_lists)):
        if not isinstance(s, dict) or not isinstance(s.get("windows"), list) or not isinstance(toks, list):
            fail(f"{path}: stream {si}: malformed")
        name = s.get("name", str(si))
        if len(toks) != len(s["windows"]):
            fail(f"{path}: stream {name}: {len(toks)} token lists for {len(s['windows'])} windows")
        for w, ids in zip(s["windows"], toks):
            where = f"{path}: stream {name} window {w.get('index')}"
            try:
                begin, end, first = int(w["begin"]), int(w["end"]), int(w["first_target"])
                expected_sha = w["tokens_sha256"]
                index = int(w["index"])
            except (KeyError, TypeError, ValueError) as e:
                fail(f"{where}: bad or missing field {e}")
            if len(ids) != end - begin:
                fail(f"{where}: {len(ids)} ids for begin {begin}, end {end}")
            if not begin < first <= end:
                fail(f"{where}: first_target {first} outside ({begin}, {end}]: its first target has no preceding token")
            if first == end:
                fail(f"{where}: no scored target (first_target == end); this tool cannot score an empty window")
            if any((not isinstance(t, int)) or t < 0 or t >= n_vocab for t in ids):
                fail(f"{where}: an id outside the vocabulary [0, {n_vocab})")
            digest = hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids)).hexdigest()
            if digest != expected_sha:
                fail(f"{where}: ids do not match the fingerprint's tokens_sha256")
            windows.append(Window(si, name, index, ids, first - begin - 1, end - first))
    if not windows:
        fail(f"{path}: no windows")
    return fp, windows


def plan_batches(windows: list[Window], batch: int | None, batch_tokens: int) -> list[list[Window]]:
    """Groups windows of equal length (file order kept within a length) into batches."""
    by_len: dict[int, list[Window]] = {}
    for w in windows:
        by_len.setdefault(w.length, []).append(w)
    batches = []
    for length, group in by_len.items():
        n = batch if batch else max(1, batch_tokens // length)
        batches.extend(group[i : i + n] for i in range(0, len(group), n))
    return batches


def load_model(gguf: Path, dtype_name: str, device: str, torch):
    """Loads the GGUF through transformers, dense weights of `dtype_name`, SDPA attention."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, dtype_name)
    kw = dict(gguf_file=gguf.name, attn_implementation="sdpa")
    try:  # transformers that can keep GGUF weights packed: ask for dense weights
        from transformers import GgufConfig

        kw["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass  # older transformers always dequantize GGUF weights
    # `dtype` is the keyword since transformers 4.56 (`torch_dtype` before, now a
    # deprecated alias); the dtype check below catches a version that ignores it.
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=dtype, **kw)
    model.eval().to(device)
    # Every matrix (linear layers, embeddings) must be in `dtype`; other parameters
    # (norm weights) in another dtype are reported in the summary, not refused.
    wrong, others = set(), {}
    for name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if not p.is_floating_point() or p.dtype == dtype:
                continue
            if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
                wrong.add(f"{name}.{pname}: {p.dtype}")
            else:
                others[str(p.dtype)] = others.get(str(p.dtype), 0) + 1
    if wrong:
        fail(f"{gguf}: matrices not in {dtype_name} after loading: {sorted(wrong)[:5]}")
    model.params_not_in_dtype = others
    packed = sorted({type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()})
    if packed:
        fail(f"{gguf}: weights still packed in GGUF modules {packed}; this tool wants dense {dtype_name} weights")
    attn = getattr(model.config, "_attn_implementation", None)
    if attn != "sdpa":
        log(f"warning: attention implementation {attn!r}, asked for 'sdpa' (recorded in the summary)")
    return model


RANDOM_BODIES = {
    "llama-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=14336, max_position_embeddings=8192, rms_norm_eps=1e-5),
    # Qwen3-30B-A3B's config.json body (Qwen3MoeForCausalLM): every layer MoE, no shared expert.
    "qwen3moe-30b-a3b": dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                             head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                             num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                             max_position_embeddings=40960, rms_norm_eps=1e-6),
}
# The transformers classes of each random body: (config class, model class).
RANDOM_CLASSES = {"llama-8b": ("LlamaConfig", "LlamaForCausalLM"), "qwen3moe-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}


def random_model(body: str, n_vocab: int, dtype_name: str, device, torch):
    """A random-weight model of `body` (RANDOM_CLASSES) in `dtype_name`, built on `device` (seed 0)."""
    import transformers

    config_class, model_class = (getattr(transformers, c) for c in RANDOM_CLASSES[body])
    dtype = getattr(torch, dtype_name)
    cfg = config_class(vocab_size=n_vocab, tie_word_embeddings=False, attn_implementation="sdpa", **RANDOM_BODIES[body])
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.eval()
    model.params_not_in_dtype = {}
    return model


def check_fits(model, fp: dict, windows: list[Window], gguf: Path, tokens: Path) -> None:
    """Refuses windows this model cannot score: vocabulary or length mismatch."""
    n_out = model.get_output_embeddings().weight.shape[0]
    if n_out != int(fp["n_vocab"]):
        fail(f"{tokens}: written for a vocabulary of {fp['n_vocab']}, {gguf} has {n_out} output logits")
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    max_pos = getattr(cfg, "max_position_embeddings", None)
    longest = max(w.length for w in windows)
    if max_pos and longest > max_pos:
        fail(f"{tokens}: windows of {longest} tokens, {gguf} has max_position_embeddings {max_pos}")


def score_file(model, torch, transformers, gguf_version, args, tokens: Path, output: Path, loaded, load_s: float) -> None:
    """Scores every window of one --save-tokens file and writes its JSON summary."""
    fp, windows = loaded
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    batches = plan_batches(windows, args.batch, args.batch_tokens)
    n_processed = sum(w.length for w in windows)
    n_scored = sum(w.n_targets for w in windows)
    takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    log(f"{tokens}: {len(windows)} windows, {n_processed} tokens processed, {n_scored} scored, {len(batches)} batches")

    # Everything a batch needs goes to the device before timing: input ids, and for
    # each scored target its (window in batch, row) and id.
    prepared = []
    for b in batches:
        length = b[0].length
        lo = min(w.first_row for w in b)
        keep = length - lo  # rows lo .. length-1 come back (the last one is not used)
        bi, ri, tg = [], [], []
        for j, w in enumerate(b):
            rows = range(w.first_row, w.first_row + w.n_targets)
            bi.extend([j] * w.n_targets)
            ri.extend(r - lo for r in rows)
            tg.extend(w.ids[r + 1] for r in rows)
        prepared.append(
            (
                torch.tensor([w.ids for w in b], dtype=torch.long, device=device),
                keep,
                torch.tensor(bi, dtype=torch.long, device=device),
                torch.tensor(ri, dtype=torch.long, device=device),
                torch.tensor(tg, dtype=torch.long, device=device),
                [w.n_targets for w in b],
            )
        )

    row_chunk = 2048  # rows per float32 log-softmax, to bound its memory

    def run_batch(p):
        x, keep, bi, ri, tg, counts = p
        if takes_keep:
            logits = model(input_ids=x, use_cache=False, logits_to_keep=keep).logits
        else:
            logits = model(input_ids=x, use_cache=False).logits[:, -keep:]
        rows = logits[bi, ri]  # (targets, vocab) in the model's dtype
        nll = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
        for s in range(0, rows.shape[0], row_chunk):
            lp = torch.log_softmax(rows[s : s + row_chunk].float(), dim=-1)
            nll[s : s + row_chunk] = -lp.gather(1, tg[s : s + row_chunk, None]).squeeze(1)
        # Per-window sums in float64 (one window's targets are contiguous).
        return torch.stack([t.double().sum() for t in torch.split(nll, counts)])

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    with torch.inference_mode():
        warm_s = None
        if not args.no_warmup:
            sync()
            t = time.perf_counter()
            run_batch(prepared[0])
            sync()
            warm_s = time.perf_counter() - t
            log(f"warm-up batch ({len(batches[0])} x {batches[0][0].length}): {warm_s:.2f} s")
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        sync()
        t = time.perf_counter()
        sums = [run_batch(p) for p in prepared]
        sync()
        score_s = time.perf_counter() - t
    per_window = torch.cat(sums).cpu().tolist()
    peak_mib = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
    del prepared, sums

    ordered = [w for b in batches for w in b]
    nonfinite = sum(1 for v in per_window if not math.isfinite(v))
    nll_sum = math.fsum(per_window)
    mean = nll_sum / n_scored
    ppl = math.exp(mean) if math.isfinite(mean) else float("nan")
    if cuda:
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    batch_windows = {}
    for b in batches:
        batch_windows[str(b[0].length)] = max(batch_windows.get(str(b[0].length), 0), len(b))
    out = {
        "tool": "transformers",
        "producer": "tools/transformers_peer.py",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "gguf": gguf_version, "python": platform.python_version()},
        "device": str(device),
        "device_name": device_name,
        "model": {"path": str(args.gguf), "file": args.model_name, "sha256": args.gguf_sha256, "class": type(model).__name__,
                  "random_body": args.random_body},
        "perplexity_meaning": "none: random weights (speed only)" if args.random_body else "the model's",
        "dtype": args.dtype,
        "logits": f"the model's own forward in {args.dtype} ({'logits_to_keep' if takes_keep else 'full logits'}), "
                  "log-softmax in float32, sums in float64",
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "params_not_in_dtype": getattr(model, "params_not_in_dtype", {}),
        "tokens_file": {"path": str(tokens), "sha256": sha256_of(tokens)},
        "method": fp.get("method"),
        "context": fp.get("context"),
        "stride": fp.get("stride"),
        "chunks_limit": fp.get("chunks_limit"),
        "n_vocab": fp.get("n_vocab"),
        "n_windows": len(windows),
        "n_batches": len(batches),
        "batch_windows": batch_windows,
        "tokens_processed": n_processed,
        "tokens_scored": n_scored,
        "nll_sum": nll_sum,
        "mean_nll": mean,
        "perplexity": ppl,
        "n_nonfinite_windows": nonfinite,
        "load_seconds": load_s,
        "warmup_seconds": warm_s,
        "scoring_seconds": score_s,
        "tokens_per_second_processed": n_processed / score_s,
        "tokens_per_second_scored": n_scored / score_s,
        "timing": "scoring_seconds: wall time of all batches (forward, float32 log-softmax of the scored rows, "
                  "per-window sums), between two device synchronizations, after one untimed warm-up batch; "
                  "model load and moving the ids to the device excluded",
        "peak_memory_mib": peak_mib,
        "windows": [
            {"stream": w.stream, "index": w.index, "n_targets": w.n_targets, "nll_sum": v}
            for w, v in sorted(zip(ordered, per_window), key=lambda p: (p[0].stream, p[0].index))
        ],
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + f".tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    os.replace(tmp, output)
    print(
        f"PEER transformers {args.model_name} {fp.get('method')} ctx {fp.get('context')}"
        f"{'' if fp.get('method') != 'sliding' else ' stride ' + str(fp.get('stride'))}: PPL {ppl:.4f} "
        f"over {n_scored} targets ({len(windows)} windows); {n_processed / score_s:,.0f} tok/s processed, "
        f"{n_scored / score_s:,.0f} scored ({score_s:.2f} s, load {load_s:.1f} s); {args.dtype} on {device_name}",
        flush=True,
    )
    if nonfinite:
        fail(f"{nonfinite} window(s) with a non-finite NLL sum (summary written to {output})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, help="GGUF model file")
    ap.add_argument("--random-body", choices=sorted(RANDOM_BODIES), help="instead of --gguf: random weights of this body (speed only)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary of --random-body (default: the token files')")
    ap.add_argument("--tokens", required=True, type=Path, action="append",
                    help="a --save-tokens file (.json, .json.gz, .json.xz); repeat to score several with one model load")
    ap.add_argument("--output", required=True, type=Path, action="append", help="JSON summary to write, one per --tokens, same order")
    ap.add_argument("--device", default="cuda", help="torch device: cuda, cuda:N, cpu (default cuda)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="weights and activations (default bfloat16)")
    ap.add_argument("--batch", type=int, default=None, help="windows per forward pass (default: as many as fit --batch-tokens)")
    ap.add_argument("--batch-tokens", type=int, default=8192, help="tokens per forward pass when --batch is not given (default 8192)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up batch")
    args = ap.parse_args()
    if len(args.tokens) != len(args.output):
        fail(f"{len(args.tokens)} --tokens for {len(args.output)} --output: give one --output per --tokens")
    if len(set(args.output)) != len(args.output):
        fail("the same --output twice")
    if args.batch is not None and args.batch < 1:
        fail("--batch must be at least 1")
    if args.batch_tokens < 1:
        fail("--batch-tokens must be at least 1")
    if (args.gguf is None) == (args.random_body is None):
        fail("give exactly one of --gguf and --random-body")
    if args.gguf is not None and not args.gguf.is_file():
        fail(f"{args.gguf}: no such file")
    args.model_name = args.gguf.name if args.gguf else f"random-{args.random_body}"

    import torch
    import transformers

    try:  # progress bars only clutter the log
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:
        pass

    gguf_version = None  # --random-body reads no GGUF file, so it needs no gguf package
    if args.gguf is not None:
        try:
            import gguf as gguf_pkg
        except ImportError:
            fail("the `gguf` package is missing (transformers reads GGUF files through it): pip install gguf")
        gguf_version = getattr(gguf_pkg, "__version__", None)
        if gguf_version is None:
            try:
                from importlib.metadata import version

                gguf_version = version("gguf")
            except Exception:  # noqa: BLE001 - only a label in the summary
                gguf_version = "unknown"
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        fail(f"--device {args.device}: torch sees no CUDA device")

    # Every token file is read and checked before the (slow) model load.
    loaded = [read_windows(t) for t in args.tokens]
    args.gguf_sha256 = sha256_of(args.gguf) if args.gguf else None

    log(f"loading {args.model_name} with transformers {transformers.__version__}, torch {torch.__version__} ({args.dtype}, {args.device})")
    t0 = time.perf_counter()
    if args.random_body:
        vocabs = {int(fp["n_vocab"]) for fp, _ in loaded}
        n_vocab = args.vocab or (vocabs.pop() if len(vocabs) == 1 else fail(f"token files of vocabularies {sorted(vocabs)}: give --vocab"))
        model = random_model(args.random_body, n_vocab, args.dtype, device, torch)
    else:
        try:
            model = load_model(args.gguf.resolve(), args.dtype, device, torch)
        except (ValueError, KeyError, NotImplementedError, OSError, RuntimeError) as e:
            fail(f"{args.gguf}: transformers {transformers.__version__} cannot load this GGUF file: {type(e).__name__}: {e}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    load_s = time.perf_counter() - t0
    takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    log(f"model loaded in {load_s:.1f} s: {type(model).__name__}, {args.dtype}, sdpa, "
        f"logits_to_keep {'yes' if takes_keep else 'no (full logits)'}")
    for (fp, windows), tokens in zip(loaded, args.tokens):
        check_fits(model, fp, windows, args.gguf or args.model_name, tokens)
    for tokens, output, one in zip(args.tokens, args.output, loaded):
        score_file(model, torch, transformers, gguf_version, args, tokens, output, one, load_s)


if __name__ == "__main__":
    main()
