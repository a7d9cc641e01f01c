#!/usr/bin/env python3
"""Check a copy of a corpus against its manifest, or fetch missing streams
from their canonical URLs.

    scripts/download-corpus.py --verify-only                     # the repository copy, eval/corpora/ppl-v1
    scripts/download-corpus.py --verify-only --data-root DIR     # another copy, no network
    scripts/download-corpus.py --manifest M.json --data-root DIR # fetch what is missing or wrong

Not needed to use the tool: the ppl-v1 corpus is in the repository
(eval/corpora/ppl-v1) and compiled into infernix-perplexity. Fetching is for
other manifests or for re-checking the pinned sources: the URLs are GitHub
raw files at pinned commits, which machines that reach only the package
registries cannot download (there every stream fails with a network error;
--verify-only works everywhere).

Each stream is written to DATA_ROOT/<path> through a temporary file in the
same folder and a rename, only after its SHA-256 matches the manifest. A file
already present with the right size and SHA-256 is kept (no download). A
stream with "source_encoding": "ISO-8859-1" is served in that encoding: its
downloaded bytes are checked against "source_sha256" (when given) and
converted to UTF-8 (the same as `iconv -f ISO-8859-1 -t UTF-8`: every byte
becomes the code point of the same value; line ends and everything else kept)
before the stream's own checks. Exit status 0 when every stream is in place,
1 when any failed (each failure is printed), 2 for a bad manifest or usage.

Standard library only.
"""

import argparse
import hashlib
import json
import os
import sys
import tempfile
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MANIFEST = os.path.join(HERE, "..", "eval", "corpora", "ppl-v1", "manifest.json")
REQUIRED = ("id", "domain", "path", "bytes", "sha256", "url", "license", "source")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_manifest(path: str) -> dict:
    with open(path, "rb") as f:
        manifest = json.loads(f.read())
    if manifest.get("version") != 1:
        raise ValueError(f"{path}: version is {manifest.get('version')!r}, this script reads version 1")
    seen = set()
    for i, s in enumerate(manifest.get("streams", [])):
        for field in REQUIRED:
            if field not in s:
                raise ValueError(f"{path}: streams[{i}] lacks field {field!r}")
        if s["id"] in seen:
            raise ValueError(f"{path}: duplicate stream id {s['id']!r}")
        seen.add(s["id"])
        norm = os.path.normpath(s["path"])
        if os.path.isabs(norm) or norm.startswith(".."):
            raise ValueError(f"{path}: stream {s['id']}: path {s['path']!r} leaves the data root")
        enc = s.get("source_encoding")
        if enc not in (None, "ISO-8859-1"):
            raise ValueError(f"{path}: stream {s['id']}: source_encoding {enc!r} is not supported")
    return manifest


def resolve_data_root(cli, manifest_path: str) -> str:
    """--data-root, else $INFERNIX_DATA, else the manifest's folder (as the evaluator does)."""
    if cli:
        return cli
    env = os.environ.get("INFERNIX_DATA")
    if env:
        return env
    return os.path.dirname(os.path.abspath(manifest_path))


def check(stream: dict, data: bytes) -> str:
    """Returns an error message, or '' when data is the stream's content."""
    if len(data) != stream["bytes"]:
        return f"{len(data)} bytes, the manifest says {stream['bytes']}"
    digest = sha256(data)
    if digest != stream["sha256"]:
        return f"SHA-256 {digest}, the manifest says {stream['sha256']}"
    return ""


def fetch(url: str, timeout: float) -> bytes:
    req = urllib.request.Request(url, headers={"User-Agent": "infernix-perplexity download-corpus"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def convert(stream: dict, raw: bytes) -> bytes:
    """Applies the manifest's source_encoding conversion (ISO-8859-1 -> UTF-8)."""
    enc = stream.get("source_encoding")
    if enc is None:
        return raw
    want = stream.get("source_sha256")
    if want is not None and sha256(raw) != want:
        raise ValueError(f"downloaded source has SHA-256 {sha256(raw)}, the manifest's source_sha256 is {want}")
    return raw.decode("iso-8859-1").encode("utf-8")


def write_atomic(target: str, data: bytes) -> None:
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".download-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--manifest", default=DEFAULT_MANIFEST, help="corpus manifest (default: %(default)s)")
    ap.add_argument("--data-root", help="where streams go (default: $INFERNIX_DATA, else the manifest's folder)")
    ap.add_argument("--verify-only", action="store_true", help="check the files in place, download nothing")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per HTTP request")
    args = ap.parse_args(argv)

    try:
        manifest = load_manifest(args.manifest)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    root = resolve_data_root(args.data_root, args.manifest)
    print(f"corpus {manifest['name']}: {len(manifest['streams'])} streams into {root}", file=sys.stderr)

    n_failed = 0
    for s in manifest["streams"]:
        target = os.path.join(root, s["path"])
        if os.path.exists(target):
            with open(target, "rb") as f:
                problem = check(s, f.read())
            if not problem:
                print(f"  ok        {s['id']}  {s['path']}", file=sys.stderr)
                continue
            if args.verify_only:
                print(f"  MISMATCH  {s['id']}  {target}: {problem}", file=sys.stderr)
                n_failed += 1
                continue
        elif args.verify_only:
            print(f"  MISSING   {s['id']}  {target}", file=sys.stderr)
            n_failed += 1
            continue
        try:
            data = convert(s, fetch(s["url"], args.timeout))
            problem = check(s, data)
            if problem:
                raise ValueError(f"downloaded stream has {problem}")
            write_atomic(target, data)
            print(f"  fetched   {s['id']}  {s['path']}", file=sys.stderr)
        except Exception as e:  # report every stream, then fail
            print(f"  FAILED    {s['id']}  {s['url']}: {e}", file=sys.stderr)
            n_failed += 1
    if n_failed:
        print(f"{n_failed} stream(s) not in place", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
