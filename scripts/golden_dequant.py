#!/usr/bin/env python3
"""Writes tests/data/dequant_golden.json: independent dequantization figures
from the `gguf` Python package (gguf-py, llama.cpp's own numpy implementation)
for tests/dequant_real.rs to compare with src/backend/cpu/dequant.rs.

Two sections:
  real    -- tensors of the two real models (SmolLM2-135M-Instruct.Q4_1.gguf:
             Q4_1, Q8_0, F32; gemma-3-270m-q4_k_m.gguf: Q5_0, Q4_K, Q6_K, Q8_0,
             F32): for rows 0, 1, 2 and the last row, float64 sums, sums of
             absolute values, sums of squares and sampled values; and the same
             three sums over the whole tensor.
  blocks  -- for every format we keep, a few blocks of seeded random bytes
             (f16 scale fields drawn finite) and, where gguf-py can quantize
             that type, blocks quantized from seeded N(0, 1) data, with
             gguf-py's dequantized f32 values (little-endian, hex) so the test
             can compare bit for bit.

Usage: scripts/golden_dequant.py [MODELS_DIR] (default $INFERNIX_MODELS or models/).
Requires: numpy, gguf (pip install gguf). Deterministic: rerunning gives the
same file for the same model files and gguf-py version.
"""

import json
import os
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "dequant_golden.json"

REAL = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": [
        "token_embd.weight",         # Q8_0
        "blk.0.ffn_down.weight",     # Q4_1
        "blk.0.attn_k.weight",       # Q4_1
        "blk.29.ffn_gate.weight",    # Q4_1
        "blk.0.attn_norm.weight",    # F32
        "output_norm.weight",        # F32
    ],
    "gemma-3-270m-q4_k_m.gguf": [
        "token_embd.weight",         # Q8_0
        "blk.0.attn_v.weight",       # Q8_0
        "blk.0.attn_k.weight",       # Q5_0
        "blk.0.ffn_gate.weight",     # Q5_0
        "blk.0.attn_output.weight",  # Q4_K
        "blk.2.ffn_down.weight",     # Q4_K
        "blk.0.ffn_down.weight",     # Q6_K
        "blk.0.attn_norm.weight",    # F32
    ],
}

# Our names (TensorFormat::name) -> (gguf-py type, byte offsets of the f16 fields in a block).
FORMATS = {
    "F32": (T.F32, []),
    "F16": (T.F16, []),
    "BF16": (T.BF16, []),
    "Q4_0": (T.Q4_0, [0]),
    "Q4_1": (T.Q4_1, [0, 2]),
    "Q5_0": (T.Q5_0, [0]),
    "Q5_1": (T.Q5_1, [0, 2]),
    "Q8_0": (T.Q8_0, [0]),
    "Q2_K": (T.Q2_K, [80, 82]),
    "Q3_K": (T.Q3_K, [108]),
    "Q4_K": (T.Q4_K, [0, 2]),
    "Q5_K": (T.Q5_K, [0, 2]),
    "Q6_K": (T.Q6_K, [208]),
    "IQ4_NL": (T.IQ4_NL, [0]),
}


def deq_rows(raw_rows: np.ndarray, qtype) -> np.ndarray:
    """Dequantizes (n, row_bytes) uint8 rows to (n, n_cols) float32 with gguf-py."""
    if qtype == T.F32:
        return raw_rows.view(np.float32)
    out = dequantize(raw_rows, qtype)
    assert out.dtype == np.float32, out.dtype
    return out


def sums(x: np.ndarray) -> dict:
    x = x.astype(np.float64)
    return {"sum": float(x.sum()), "sum_abs": float(np.abs(x).sum()), "sum_sq": float((x * x).sum())}


def real_section(models_dir: Path) -> list:
    entries = []
    for model, names in REAL.items():
        reader = gguf.GGUFReader(str(models_dir / model))
        tensors = {t.name: t for t in reader.tensors}
        for name in names:
            t = tensors[name]
            dims = [int(d) for d in t.shape]  # GGUF order: dims[0] is contiguous
            n_cols = dims[0]
            n_rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
            raw = np.asarray(t.data).view(np.uint8).reshape(n_rows, -1)
            total = {"sum": 0.0, "sum_abs": 0.0, "sum_sq": 0.0}
            chunk = 8192
            for r0 in range(0, n_rows, chunk):
                s = sums(deq_rows(raw[r0:r0 + chunk], t.tensor_type))
                for k in total:
                    total[k] += s[k]
            row_ids = sorted({0, 1, 2, n_rows - 1} & set(range(n_rows)))
            rng = np.random.default_rng(len(name) * 1000 + n_cols)
            cols = sorted({0, 1, 17, 31, 32, n_cols // 2 + 5, n_cols - 1}
                          | {int(c) for c in rng.integers(0, n_cols, 3)})
            rows = []
            for r in row_ids:
                y = deq_rows(raw[r:r + 1], t.tensor_type).reshape(-1)
                assert y.shape[0] == n_cols
                rows.append({"row": r, **sums(y), "samples": [[c, float(y[c])] for c in cols]})
            entries.append({
                "model": model, "tensor": name, "format": t.tensor_type.name,
                "n_rows": n_rows, "n_cols": n_cols, "total": total, "rows": rows,
            })
            print(f"{model} {name} {t.tensor_type.name} {n_rows}x{n_cols}", file=sys.stderr)
    return entries


def finite_f16_bits(rng, n: int) -> np.ndarray:
    """Random f16 bit patterns that are not inf/NaN (subnormals and both signs included)."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    bad = (bits & 0x7C00) == 0x7C00
    while bad.any():
        bits[bad] = rng.integers(0, 1 << 16, int(bad.sum()), dtype=np.uint32).astype(np.uint16)
        bad = (bits & 0x7C00) == 0x7C00
    return bits


def block_case(fmt: str, origin: str, raw: np.ndarray) -> dict:
    qtype, _ = FORMATS[fmt]
    values = dequantize(raw.copy(), qtype).astype(np.float32, copy=False).reshape(-1)
    return {
        "format": fmt, "origin": origin, "n_elems": int(values.shape[0]),
        "bytes_hex": raw.tobytes().hex(),
        "values_f32_le_hex": values.astype("<f4").tobytes().hex(),
    }


def blocks_section() -> list:
    cases = []
    for i, (fmt, (qtype, f16_fields)) in enumerate(FORMATS.items()):
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        n_blocks = 64 if block_elems == 1 else (4 if block_elems == 32 else 2)
        rng = np.random.default_rng(1000 + i)
        raw = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint32).astype(np.uint8)
        for off in f16_fields:
            raw[:, off:off + 2] = finite_f16_bits(rng, n_blocks).astype("<u2").view(np.uint8).reshape(n_blocks, 2)
        cases.append(block_case(fmt, "seeded random bytes, f16 fields finite", raw.reshape(-1)))
        try:
            data = rng.standard_normal(n_blocks * block_elems).astype(np.float32)
            q = np.asarray(quantize(data, qtype)).view(np.uint8).reshape(-1)
        except NotImplementedError:
            continue
        cases.append(block_case(fmt, "gguf.quants.quantize of seeded N(0,1) data", q))
    return cases


def main():
    models_dir = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("INFERNIX_MODELS", ROOT / "models"))
    golden = {
        "about": "Dequantized figures from gguf-py for tests/dequant_real.rs; generated by "
                 "scripts/golden_dequant.py (see its docstring). Sums are float64 over float32 values.",
        "gguf_py_version": version("gguf"),
        "numpy_version": np.__version__,
        "real": real_section(models_dir),
        "blocks": blocks_section(),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
