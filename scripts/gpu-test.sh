#!/usr/bin/env bash
# gpu-test.sh: build the GPU parity tests here, run them on the lent GPU machine.
#
#   scripts/gpu-test.sh build   (here, no GPU needed)
#       From the repository root: compiles the kernels (nvcc from $NVCC,
#       $CUDA_HOME/bin, or PATH) and the test executable tests/gpu_ops.rs in
#       release mode, strips it and copies it with this script into
#       .devcarry/gpu-test/ (git-ignored), ready to be carried.
#   bash .devcarry/gpu-test/gpu-test.sh run    (on the GPU machine, repository root)
#       Runs the carried gpu_ops single-threaded with output shown, tees the log
#       to $OUT/gpu_ops.log (or ./gpu_ops.log without $OUT) and prints the
#       PARITY / TIMING summary last. Exit status is the test executable's.
#
# With the device tool: `run` sends the main checkout, so build there (or copy
# .devcarry/gpu-test/ into it), then call run with carry [".devcarry/gpu-test"]
# and the command `bash .devcarry/gpu-test/gpu-test.sh run`. See docs/gpu-testing.md.
set -euo pipefail

cmd="${1:-}"
root="$(pwd)"
script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
carry_dir="${root}/.devcarry/gpu-test"

case "$cmd" in
build)
    if [[ -z "${NVCC:-}" ]] && ! command -v nvcc >/dev/null && [[ -z "${CUDA_HOME:-}${CUDA_PATH:-}" ]]; then
        echo "gpu-test.sh: no nvcc (set NVCC=/path/to/nvcc or CUDA_HOME); the kernels would not be built" >&2
        exit 2
    fi
    exe="$(cargo test --release --test gpu_ops --no-run --message-format=json 2>/dev/null \
        | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "gpu_ops" and m.get("executable"):
        print(m["executable"])')"
    if [[ -z "$exe" ]]; then
        echo "gpu-test.sh: building tests/gpu_ops.rs failed; rerun: cargo test --release --test gpu_ops --no-run" >&2
        exit 1
    fi
    mkdir -p "$carry_dir"
    cp "$exe" "$carry_dir/gpu_ops"
    strip "$carry_dir/gpu_ops" 2>/dev/null || true
    cp "${BASH_SOURCE[0]}" "$carry_dir/gpu-test.sh"
    echo "built $exe"
    ls -la "$carry_dir"
    ;;
run)
    # The executable next to this script (a carried copy), else .devcarry/gpu-test/.
    exe="${script_dir}/gpu_ops"
    [[ -x "$exe" ]] || exe="${carry_dir}/gpu_ops"
    [[ -x "$exe" ]] || { echo "gpu-test.sh: $exe missing; run 'scripts/gpu-test.sh build' first and carry .devcarry/gpu-test" >&2; exit 2; }
    log="${OUT:-.}/gpu_ops.log"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv 2>&1 | tee "$log" || true
    set +e
    "$exe" --test-threads=1 --nocapture 2>&1 | tee -a "$log"
    status=${PIPESTATUS[0]}
    set -e
    echo "===== summary (exit ${status}) ====="
    grep -E '^(DEVICE|KERNELS|KERNEL_FILE|PARITY|TIMING|BENCH|test result|test .* FAILED|failures:)' "$log" || true
    exit "$status"
    ;;
*)
    echo "usage: scripts/gpu-test.sh build|run" >&2
    exit 2
    ;;
esac
