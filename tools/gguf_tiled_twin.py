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

# GGUF metadata value types: fixed sizes (8 = string and 9 = array are variable).
SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# ggml tensor type: (elements per block, bytes per block).
BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 36),
          10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 30: (1, 2)}
PERIOD_BYTES = 16384


def fail(msg):
    print(f"gguf_tiled_twin.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def skip_value(b, at, t):
    if t in SIZES:
        return at + SIZES[t]
    if t == 8:
        (n,) = struct.unpack_from("<Q", b, at)
        return at + 8 + n
    if t == 9:
        (it, n) = struct.unpack_from("<IQ", b, at)
        at += 12
        if it in SIZES:
            return at + n * SIZES[it]
        for _ in range(n):
            at = skip_value(b, at, it)
        return at
    raise ValueError(f"metadata value type {t}")


def main():
    if len(sys.argv) != 3:
        fail("usage: gguf_tiled_twin.py IN.gguf OUT.gguf")
    src, dst = sys.argv[1], sys.argv[2]
    try:
        b = bytearray(open(src, "rb").read())
    except OSError as e:
        fail(f"{src}: {e}")
    try:
        magic, _version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", b, 0)
        if magic != b"GGUF":
            fail(f"{src}: magic {magic!r}, not a GGUF file")
        at, align = 24, 32
        for _ in range(n_kv):
            (n,) = struct.unpack_from("<Q", b, at)
            key = bytes(b[at + 8 : at + 8 + n]).decode()
            at += 8 + n
            (t,) = struct.unpack_from("<I", b, at)
            if key == "general.alignment":
                (align,) = struct.unpack_from("<I", b, at + 4)
            at = skip_value(b, at + 4, t)
        infos = []
        for _ in range(n_tensors):
            (n,) = struct.unpack_from("<Q", b, at)
            name = bytes(b[at + 8 : at + 8 + n]).decode()
            at += 8 + n
            (nd,) = struct.unpack_from("<I", b, at)
            dims = struct.unpack_from(f"<{nd}Q", b, at + 4)
            at += 4 + 8 * nd
            t, off = struct.unpack_from("<IQ", b, at)
            at += 12
            infos.append((name, dims, t, off))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        fail(f"{src}: malformed GGUF header: {e}")
    data = at + (-at) % align
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
