#!/usr/bin/env python3
"""A speed twin of a GGUF model, small enough to carry to the device once xz'd.

The twin keeps the source file's header byte for byte (metadata, tokenizer,
tensor names, shapes, block formats, offsets); only the data of each tensor
larger than two periods changes: its first whole rows covering at least 16 KiB
(the period) are repeated to the tensor's full length. Every block stays a
real block of the source (finite scales), every format and shape stays, so a
forward pass does exactly the work of the real model, while xz packs the
repeats away (SmolLM2-135M Q4_1: 98 MB to 3.9 MB; Gemma-3-270M Q4_K_M: 253 MB
to 3.7 MB). Dense speed does not depend on weight values; the twin's
perplexity means nothing (rows repeat, so logits are far from the model's).
The tokenizer is the real one, so `--text` gives the real model's windows.

    python3 tools/gguf_tiled_twin.py MODEL.gguf TWIN.gguf && xz -6 -T2 TWIN.gguf

Used by scripts/small-speed.sh (docs/performance.md, "Issue 12: the small
models (small4)"). Exit status 2 with one line on stderr on bad input; the
output is written to a temporary file and renamed only when complete.
"""

import os
import struct
import sys

from gguf_header import read_header

# ggml tensor type: (elements per block, bytes per block).
BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 36),
          10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 30: (1, 2)}
PERIOD_BYTES = 16384


def fail(msg):
    print(f"gguf_tiled_twin.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def main():
    if len(sys.argv) != 3:
        fail("usage: gguf_tiled_twin.py IN.gguf OUT.gguf")
    src, dst = sys.argv[1], sys.argv[2]
    try:
        b = bytearray(open(src, "rb").read())
    except OSError as e:
        fail(f"{src}: {e}")
    try:
        _n_kv, _kv_end, n_tensors, infos, data = read_header(b)
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        fail(f"{src}: malformed GGUF header: {e}")
    tiled = kept = 0
    for name, dims, t, off in infos:
        if t not in BLOCKS:
            fail(f"{src}: tensor {name}: ggml type {t} not handled (known: {sorted(BLOCKS)})")
        per, block_bytes = BLOCKS[t]
        if dims[0] % per:
            fail(f"{src}: tensor {name}: row of {dims[0]} elements is not whole blocks of {per}")
        row = dims[0] // per * block_bytes  # bytes of one row
        n_rows = 1
        for d in dims[1:]:
            n_rows *= d
        size = row * n_rows
        start = data + off
        if start + size > len(b):
            fail(f"{src}: tensor {name}: data ends at byte {start + size}, the file has {len(b)}")
        period = row * max(1, -(-PERIOD_BYTES // row))  # whole rows, at least PERIOD_BYTES
        if size <= 2 * period:
            kept += size
            continue
        head = bytes(b[start : start + period])
        full, rest = divmod(size, period)
        b[start : start + size] = head * full + head[:rest]
        tiled += size
    tmp = dst + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(b)
        os.replace(tmp, dst)
    except OSError as e:
        fail(f"{dst}: {e}")
    print(f"{dst}: {n_tensors} tensors, {tiled} bytes tiled, {kept} bytes kept as they were, {len(b)} bytes")


if __name__ == "__main__":
    main()
