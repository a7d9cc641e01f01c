#!/usr/bin/env python3
"""Writes the hand-made fuzz seeds: a tiny GGUF v3 and a tiny consistent
.ninfer (v4 and v3). The other seeds are copies: manifest (the shipped
corpus manifest), report and top_tokens (a SmolLM2 CPU run, see
docs/reliability.md), tokens (a literal)."""
import hashlib
import json
import struct
from pathlib import Path

seeds = Path(__file__).resolve().parent / "seeds"


def gguf_string(x: str) -> bytes:
    b = x.encode()
    return struct.pack("<Q", len(b)) + b


def tiny_gguf() -> bytes:
    kv = [
        (b"general.architecture", 8, gguf_string("llama")),
        (b"llama.block_count", 4, struct.pack("<I", 1)),
        (b"general.alignment", 4, struct.pack("<I", 32)),
        (b"tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2) + gguf_string("a") + gguf_string("b")),
    ]
    tensors = [("token_embd.weight", [32, 4], 8, 34 * 4), ("output_norm.weight", [32], 0, 128)]
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
    for k, t, v in kv:
        out += struct.pack("<Q", len(k)) + k + struct.pack("<I", t) + v
    off, offs = 0, []
    for name, dims, ty, nb in tensors:
        out += gguf_string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", x) for x in dims)
        out += struct.pack("<IQ", ty, off)
        offs.append(off)
        off = (off + nb + 31) // 32 * 32
    out += b"\0" * ((-len(out)) % 32)
    data = b""
    for (_, _, _, nb), o in zip(tensors, offs):
        data += b"\0" * (o - len(data)) + bytes([1]) * nb
    return out + data


def tiny_ninfer() -> tuple[bytes, bytes]:
    d, f, v = 4, 8, 4
    block = [("attn_norm", [d]), ("ffn_norm", [d]), ("attn_q", [d, d]), ("attn_k", [d, d]), ("attn_v", [d, d]),
             ("attn_output", [d, d]), ("ffn_gate", [f, d]), ("ffn_up", [f, d]), ("ffn_down", [d, f])]
    shapes = [("token_embd.weight", [v, d]), ("output_norm.weight", [d])] + [(f"blk.0.{n}.weight", s) for n, s in block]
    tok = b"{}"
    data_offset = 4096
    pos = data_offset
    blob = {"offset": pos, "n_bytes": len(tok), "sha256": hashlib.sha256(tok).hexdigest()}
    pos = (pos + len(tok) + 255) // 256 * 256
    entries = []
    for name, shape in shapes:
        nb = 4
        for x in shape:
            nb *= x
        entries.append({"name": name, "component": "text", "format": "F32", "shape": shape, "offset": pos,
                        "n_bytes": nb, "sha256": hashlib.sha256(b"\0" * nb).hexdigest()})
        pos = (pos + nb + 255) // 256 * 256
    hp = {"n_layers": 1, "d_model": d, "n_heads": 1, "n_kv_heads": 1, "d_head": d, "d_head_v": d, "d_ffn": f,
          "n_vocab": v, "rms_eps": 1e-5, "rope_base": 10000.0, "rope_base_local": 10000.0, "rope_scale": 1.0,
          "rope_dim": d, "rope_style": "neox", "sliding_window": [None], "context_length": 64, "embed_scale": 1.0,
          "attn_scale": 0.5, "attn_softcap": None, "final_softcap": None, "activation": "silu", "qkv_bias": False,
          "qk_norm": False, "post_norms": False, "tied_embeddings": True}
    meta = {"architecture": "llama", "public_name": "tiny", "hparams": hp, "components": ["text"],
            "tokenizer": {"kind": "test", "pre": None, "bos_id": None, "eos_id": None, "add_bos": False,
                          "add_eos": False, "blob": blob},
            "provenance": {"sources": [], "converter": "seed", "converter_version": "0", "source_layers": None,
                           "synthetic": None, "source_metadata": {}},
            "tensors": entries}
    j = json.dumps(meta, separators=(",", ":")).encode()
    assert 64 + len(j) <= data_offset
    v4 = bytearray(pos)
    v4[:64] = b"NINFER\0\0" + struct.pack("<IIQQ", 4, 0, len(j), data_offset) + hashlib.sha256(j).digest()
    v4[64:64 + len(j)] = j
    v4[blob["offset"]:blob["offset"] + len(tok)] = tok
    v3 = bytearray(v4)
    v3[:64 + len(j)] = b"\0" * (64 + len(j))
    v3[:32] = b"NINFER\0\0" + struct.pack("<IIQQ", 3, 0, len(j), data_offset)
    v3[32:32 + len(j)] = j
    return bytes(v4), bytes(v3)


if __name__ == "__main__":
    (seeds / "gguf").mkdir(parents=True, exist_ok=True)
    (seeds / "ninfer").mkdir(parents=True, exist_ok=True)
    (seeds / "gguf" / "tiny.gguf").write_bytes(tiny_gguf())
    v4, v3 = tiny_ninfer()
    (seeds / "ninfer" / "tiny-v4.ninfer").write_bytes(v4)
    (seeds / "ninfer" / "tiny-v3.ninfer").write_bytes(v3)
