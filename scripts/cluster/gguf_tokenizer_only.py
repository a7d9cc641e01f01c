#!/usr/bin/env python3
"""Copies a GGUF file's header key-values (tokenizer included) into a GGUF with
no tensors: the tokenizer source `ninfer-convert --synthetic` needs, small
enough to carry. Usage: gguf_tokenizer_only.py IN.gguf OUT.gguf"""
import struct, sys

SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

def skip_value(b, at, t):
    if t in SIZES:
        return at + SIZES[t]
    if t == 8:  # string
        (n,) = struct.unpack_from("<Q", b, at)
        return at + 8 + n
    if t == 9:  # array
        (it, n) = struct.unpack_from("<IQ", b, at)
        at += 12
        if it in SIZES:
            return at + n * SIZES[it]
        for _ in range(n):
            at = skip_value(b, at, it)
        return at
    raise ValueError(f"GGUF value type {t}")

b = open(sys.argv[1], "rb").read()
magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", b, 0)
assert magic == b"GGUF", magic
at = 24
for _ in range(n_kv):
    (n,) = struct.unpack_from("<Q", b, at)
    at += 8 + n
    (t,) = struct.unpack_from("<I", b, at)
    at = skip_value(b, at + 4, t)
out = bytearray(b[:at])
struct.pack_into("<Q", out, 8, 0)  # no tensors
out += b"\0" * ((-len(out)) % 32)
open(sys.argv[2], "wb").write(out)
print(f"{sys.argv[2]}: {n_kv} key-values, {len(out)} bytes (from {len(b)})")
