"""GGUF header walking shared by the small GGUF tools (tools/gguf_tiled_twin.py,
scripts/cluster/gguf_tokenizer_only.py): metadata value sizes, skipping a
value, and the header's layout (end of the key-values, tensor infos, where the
tensor data starts). Plain struct, no numpy, so it runs anywhere python3 does."""

import struct

# GGUF metadata value types of fixed size (8 = string and 9 = array are variable).
SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def skip_value(b, at, t):
    """Offset just past a metadata value of type `t` starting at `at`."""
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


def read_header(b):
    """(n_kv, kv_end, n_tensors, infos, data_start) of a GGUF file's bytes; infos
    are (name, dims, ggml type, offset from data_start). Raises ValueError,
    struct.error or UnicodeDecodeError on a malformed header."""
    magic, _version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", b, 0)
    if magic != b"GGUF":
        raise ValueError(f"magic {magic!r}, not a GGUF file")
    at, align = 24, 32
    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", b, at)
        key = bytes(b[at + 8 : at + 8 + n]).decode()
        at += 8 + n
        (t,) = struct.unpack_from("<I", b, at)
        if key == "general.alignment":
            (align,) = struct.unpack_from("<I", b, at + 4)
        at = skip_value(b, at + 4, t)
    kv_end = at
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
    return n_kv, kv_end, n_tensors, infos, at + (-at) % align
