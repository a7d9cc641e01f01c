#!/usr/bin/env bash
# The test suite: fetches and converts the two real models when missing
# (scripts/fetch-models.sh, converting with the same build profile the tests
# use, so dependencies compile once), then runs every test. The corpora and
# reference figures are the repository's own (eval/corpora/ppl-v1, tests/data/reference;
# INFERNIX_DATA / INFERNIX_REFERENCE override them).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cargo build --bin ninfer-convert
target=${CARGO_TARGET_DIR:-$root/target}
NINFER_CONVERT=$target/debug/ninfer-convert bash scripts/fetch-models.sh
export INFERNIX_MODELS=${INFERNIX_MODELS:-$root/models}
cargo test "$@"
