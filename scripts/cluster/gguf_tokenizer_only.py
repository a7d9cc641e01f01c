#!/usr/bin/env python3
"""Copies a GGUF file's header key-values (tokenizer included) into a GGUF with
no tensors: the tokenizer source `ninfer-convert --synthetic` needs, small
enough to carry. Usage: gguf_tokenizer_only.py IN.gguf OUT.gguf"""
import struct, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from gguf_header import read_header  # noqa: E402

b = open(sys.argv[1], "rb").read()
n_kv, at, _n_tensors, _infos, _data = read_header(b)
out = bytearray(b[:at])
struct.pack_into("<Q", out, 8, 0)  # no tensors
out += b"\0" * ((-len(out)) % 32)
open(sys.argv[2], "wb").write(out)
print(f"{sys.argv[2]}: {n_kv} key-values, {len(out)} bytes (from {len(b)})")
