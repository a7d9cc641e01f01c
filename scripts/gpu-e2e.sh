#!/usr/bin/env bash
# gpu-e2e.sh: end-to-end GPU tests and whole-corpus runs of both real models,
# built here and run on a lent GPU machine (see docs/gpu-testing.md).
#
#   scripts/gpu-e2e.sh build [PART_MIB]      (here, repository root, nvcc needed)
#       Builds the evaluator (release), tests/gpu_e2e.rs and tests/gpu_ops.rs
#       (release), strips and xz-compresses them and puts them, with wiki.test.raw, the reference
#       files, the CPU golden file and this script, into .devcarry/gpu-e2e/.
#       The two .ninfer artifacts ($INFERNIX_MODELS) are split into parts of
#       PART_MIB MiB (default 48) under .devcarry/gpu-e2e-p<N>/, one folder per
#       device call (a call carries at most 64 MiB), with their SHA-256 sums.
#   On the GPU machine, from the repository root, every call starts with
#       bash .devcarry/gpu-e2e/gpu-e2e.sh stash
#   which copies whatever the call carried into /tmp/ix (kept while the machine
#   stays warm) and reassembles each model once all its parts have arrived.
#   Then, in the call that has what it needs:
#       bash .devcarry/gpu-e2e/gpu-e2e.sh test [FILTER]   gpu_e2e tests ($OUT/e2e[-FILTER].log)
#       bash .devcarry/gpu-e2e/gpu-e2e.sh ops             gpu_ops parity tests ($OUT/gpu_ops.log)
#       bash .devcarry/gpu-e2e/gpu-e2e.sh wiki STEM [ARGS] whole wiki.test.raw, chunks c=512 and
#                                                     sliding 4096/2048, with the evaluator binary
#                                                     (STEM: artifact file name without .ninfer;
#                                                     ARGS go to the evaluator, e.g. --lossless);
#                                                     reports in $OUT/<stem>-<method>.json
set -euo pipefail

cmd="${1:-}"
root="$(pwd)"
carry="${root}/.devcarry/gpu-e2e"
ix=/tmp/ix
models=(SmolLM2-135M-Instruct.Q4_1 gemma-3-270m-q4_k_m)

test_exe() {
    # The release executable of integration test $1.
    cargo test --release --no-run --test "$1" --message-format=json 2>/dev/null | python3 -c 'import json,sys
name = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == name and m.get("executable"):
        print(m["executable"])' "$1"
}

case "$cmd" in
build)
    part_mib="${2:-48}"
    if [[ -z "${NVCC:-}" ]] && ! command -v nvcc >/dev/null && [[ -z "${CUDA_HOME:-}${CUDA_PATH:-}" ]]; then
        echo "gpu-e2e.sh: no nvcc (set NVCC=/path/to/nvcc or CUDA_HOME); the kernels would not be built" >&2
        exit 2
    fi
    data="${INFERNIX_DATA:-${root}/eval/corpora/ppl-v1}"
    reference="${INFERNIX_REFERENCE:-${root}/tests/data/reference}"
    model_dir="${INFERNIX_MODELS:-${root}/models}"
    cargo build --release --bins
    rm -rf "$carry" "${carry}"-p*
    mkdir -p "$carry"
    for t in gpu_e2e gpu_ops; do
        exe="$(test_exe "$t")"
        [[ -n "$exe" ]] || { echo "gpu-e2e.sh: building tests/$t.rs failed" >&2; exit 1; }
        cp "$exe" "$carry/$t"
    done
    target="${CARGO_TARGET_DIR:-${root}/target}"
    cp "$target/release/infernix-perplexity" "$carry/"
    # Stripped and xz-compressed (about 70 MB each with symbols, 3-5 MB so), so the
    # binaries travel with a model part in one call.
    for b in gpu_e2e gpu_ops infernix-perplexity; do
        strip "$carry/$b" && xz -6 -T2 "$carry/$b"
    done
    cp "${BASH_SOURCE[0]}" "$carry/gpu-e2e.sh"
    cp "$data/wikitext-2-raw/wiki.test.raw" "$reference"/*.txt "$carry/"
    cp tests/data/gpu_e2e_cpu_golden.json "$carry/golden.json"
    # shellcheck source=scripts/lib/parts.sh
    source "${root}/scripts/lib/parts.sh"
    n=0
    for m in "${models[@]}"; do
        f="$model_dir/$m.ninfer"
        [[ -f "$f" ]] || { echo "gpu-e2e.sh: $f missing (scripts/fetch-models.sh)" >&2; exit 2; }
        (cd "$model_dir" && sha256sum "$m.ninfer") >"$carry/$m.sha256"
        n=$((n + $(split_into_folders "$f" "$part_mib" "${carry}-p" "$n")))
    done
    du -sh "$carry" "${carry}"-p*
    ;;
stash)
    mkdir -p "$ix/bin" "$ix/models" "$ix/runs" "$ix/corpora/wikitext-2-raw" "$ix/reference" "$ix/parts"
    if [[ -d "$carry" ]]; then
        for b in gpu_e2e gpu_ops infernix-perplexity; do
            xz -dc "$carry/$b.xz" >"$ix/bin/$b" && chmod +x "$ix/bin/$b"
        done
        cp "$carry"/gpu-e2e.sh "$ix/bin/"
        cp "$carry"/wiki.test.raw "$ix/corpora/wikitext-2-raw/"
        cp "$carry"/*.txt "$ix/reference/"
        cp "$carry"/golden.json "$carry"/*.sha256 "$ix/"
    fi
    for d in "${carry}"-p*; do
        [[ -d "$d" ]] && cp "$d"/* "$ix/parts/"
    done
    for m in "${models[@]}"; do
        [[ -f "$ix/models/$m.ninfer" || ! -f "$ix/$m.sha256" ]] && continue
        parts=("$ix/parts/$m.ninfer.part"*)
        [[ -f "${parts[0]}" ]] || continue
        cat "${parts[@]}" >"$ix/models/$m.ninfer.tmp"
        if (cd "$ix/models" && mv "$m.ninfer.tmp" "$m.ninfer" && sha256sum -c --quiet "$ix/$m.sha256" 2>/dev/null); then
            echo "stash: $m.ninfer reassembled and verified"
            rm -f "${parts[@]}"
        else
            rm -f "$ix/models/$m.ninfer"
            echo "stash: $m: ${#parts[@]} part(s) so far"
        fi
    done
    ls -la "$ix/models" "$ix/parts"
    ;;
test)
    export INFERNIX_MODELS="$ix/models" INFERNIX_DATA="$ix/corpora" INFERNIX_REFERENCE="$ix/reference"
    export INFERNIX_E2E_GOLDEN="$ix/golden.json"
    log="${OUT:-.}/e2e${2:+-$2}.log"
    set +e
    "$ix/bin/gpu_e2e" --test-threads=1 --nocapture ${2:+"$2"} 2>&1 | tee "$log"
    status=${PIPESTATUS[0]}
    set -e
    echo "===== e2e summary (exit ${status}) ====="
    grep -E '^(E2E|skipped|test result|test .* FAILED|thread .* panicked)' "$log" || true
    exit "$status"
    ;;
ops)
    log="${OUT:-.}/gpu_ops.log"
    set +e
    "$ix/bin/gpu_ops" --test-threads=1 --nocapture >"$log" 2>&1
    status=$?
    set -e
    echo "===== gpu_ops summary (exit ${status}) ====="
    grep -E '^(DEVICE|PARITY attention|test result|test .* FAILED)' "$log" || true
    exit "$status"
    ;;
wiki)
    stem="${2:?usage: gpu-e2e.sh wiki STEM [evaluator args]}"
    shift 2
    for method in chunks sliding; do
        if [[ "$method" == chunks ]]; then margs=(--method chunks --context 512); else margs=(--method sliding --context 4096 --stride 2048); fi
        out="$ix/runs/$stem-$method-$RANDOM"
        set -x
        "$ix/bin/infernix-perplexity" "$ix/models/$stem.ninfer" --text "$ix/corpora/wikitext-2-raw/wiki.test.raw" \
            "${margs[@]}" --backend cuda "$@" --output "$out" 2>"$out.log" >/dev/null || { set +x; cat "$out.log"; exit 1; }
        set +x
        cp "$out/report.json" "${OUT:-.}/$stem-$method${*:+-x}.json"
        python3 - "$out/report.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
o, t, w = r["results"]["overall"], r["timing"], r["workload"]
print(f"WIKI {w['method']} ctx {w['context']}: PPL {o['perplexity']:.4f} over {o['scored_tokens']} targets; "
      f"{t['tokens_per_second_processed']:.0f} tok/s processed, {t['tokens_per_second_scored']:.0f} scored "
      f"({t['scoring_seconds']:.1f} s); {r['execution']['device']} route {r['execution']['details'].get('route')}")
EOF
    done
    ;;
*)
    echo "usage: scripts/gpu-e2e.sh build [PART_MIB] | stash | test [FILTER] | ops | wiki STEM [ARGS]" >&2
    exit 2
    ;;
esac
