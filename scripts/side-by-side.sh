#!/usr/bin/env bash
# side-by-side.sh: one session on a lent H200 that measures infernix-perplexity
# next to its peers (llama.cpp and transformers bf16, through scripts/peers.sh)
# on the same GGUF weights and windows, the 8B-class synthetic twins included,
# and the KL divergence of each of our routes and KV types against a float64
# truth (tools/fp64_reference.py). docs/performance.md lists the calls in order.
#
# Here (repository root, after `scripts/peers.sh prepare`, nvcc needed):
#   scripts/side-by-side.sh prepare
#       Builds the evaluator and ninfer-convert (release, stripped, xz) into
#       .devcarry/sbs/ with this script, tools/fp64_reference.py, the
#       --save-tokens files of the KL slices (both models: the first 40 chunks
#       c=512 and the first 4 sliding windows 4096/2048 of wiki.test.raw) and
#       the SHA-256 of the .ninfer files converted here. SBS_TESTS=1 also builds the
#       release executables of tests/gpu_ops.rs and tests/gpu_e2e.rs (stripped, xz)
#       into .devcarry/sbs/tests/ for `parity`.
# On the GPU machine (repository root; /tmp/peers is scripts/peers.sh's folder):
#   bash .devcarry/sbs/side-by-side.sh stash   (later: bash /tmp/sbs/bin/side-by-side.sh stash)
#       peers.sh stash, then our files into /tmp/sbs; converts each newly
#       reassembled GGUF to .ninfer (its SHA-256 must equal the one converted
#       here: conversion is deterministic) and starts that model's float64
#       references in the background (GPU, fp64).
#   side-by-side.sh synth
#       Generates the 8B-class synthetic twins (llama-8b geometry, SmolLM2's
#       tokenizer, Q4_0 and Q8_0: .ninfer for us, .gguf for the peers) in the background.
#   side-by-side.sh ours real | ours twin FORMAT | ours speed STEM
#       Evaluator runs over all of wiki.test.raw, timed, one at a time, default
#       route. real: waits for the float64 references, runs both real models
#       (chunks c=512, chunks c=4096, sliding 4096/2048), then the KL runs (four
#       route/KV settings per slice). twin: waits for that twin, chunks c=512
#       and c=4096. speed: one real model's three window sets, no KL runs.
#       Reports into $OUT/ours-*.json. SBS_PROFILE=1 adds, after each timed run,
#       one more with INFERNIX_CUDA_PROFILE=1 (GPU time per op family, CUDA
#       events; its PROFILE lines into $OUT/profile-NAME.txt; not the timed run).
#   side-by-side.sh ours big
#       The 70B-class row: the llama-70b body (Q4_0, about 37 GiB, from the twins'
#       tokenizer) written on the device, scored at chunks c=512 over all of
#       wiki.test.raw (SBS_BIG_CHUNKS=N: the first N chunks), its report into
#       $OUT/ours-llama-70b-Q4_0.chunks512.json (device pool peak under memory), the
#       .ninfer removed. Ours alone: bf16 (about 140 GB) does not fit the GPU, and a
#       GGUF twin beside it would not fit the 64 GiB disk. one-call runs it last with
#       SBS_BIG=1 (about 2 more minutes).
#   side-by-side.sh llama real|twins | transformers | transformers-twin
#       The peers' runs over the same models (peers.sh llama / transformers;
#       transformers on the real models; transformers-twin: a random-weight bf16
#       Llama-3-8B body with SmolLM2's vocabulary, tools/transformers_peer.py
#       --random-body llama-8b, on SmolLM2's c=512 and c=4096 windows, the dense
#       speed peer of the twins). SBS_MODELS and SBS_TWIN_FORMATS (space-separated)
#       narrow the models and twin formats of every subcommand; SBS_NO_FP64=1 makes
#       stash start no float64 references (speed-only sessions).
#   side-by-side.sh parity [E2E_FILTER...]
#       The carried parity executables: every gpu_ops test, then the gpu_e2e tests
#       matching the filters (the real-model ones read /tmp/sbs/models); logs
#       $OUT/gpu_ops.log and $OUT/gpu_e2e.log, PARITY/E2E/GATED lines printed
#       (SBS_SKIP_OPS=1: the gpu_e2e tests only).
#   side-by-side.sh summary
#       One line per report and peer summary in $OUT.
#   side-by-side.sh one-call [SECONDS]
#       The twins' side by side in ONE device command (default limit 560 s): stash,
#       the llama.cpp CUDA build started detached (nice 19, so our timed runs keep
#       their CPU), the 8B twins written (from the tokenizer-only GGUF when prepare
#       ran with SBS_TOKENIZER_ONLY=1: no real model travels), parity when the test
#       executables were carried (SBS_TESTS=1), `ours twin` for each format,
#       transformers-twin, then SBS_SMALL (a command, e.g. the small twins'
#       `... small-speed.sh run`, run after our 8B runs, so it overlaps the build),
#       the wait for the build, `llama twins`, then SBS_SMALL_LLAMA (a command, e.g.
#       `small-speed.sh llama`: llama.cpp on the small twins), the summary. Our runs, transformers' and llama.cpp's thus share one machine
#       and one command.
set -euo pipefail

cmd="${1:-}"
root="$(pwd)"
carry="$root/.devcarry/sbs"
sbs=/tmp/sbs
peers=/tmp/peers
out="${OUT:-$sbs/out}"
read -r -a MODELS <<<"${SBS_MODELS:-SmolLM2-135M-Instruct.Q4_1 gemma-3-270m-q4_k_m}"
read -r -a TWIN_FORMATS <<<"${SBS_TWIN_FORMATS:-Q4_0 Q8_0}"
# one-call's gpu_e2e arguments (filters, --skip NAME), e.g. "--skip on_wiki" without the real models.
read -r -a E2E_FILTER <<<"${SBS_E2E_FILTER:-}"
TWIN_TOKENIZER=SmolLM2-135M-Instruct.Q4_1
# A GGUF with SmolLM2's tokenizer and no tensors (scripts/cluster/gguf_tokenizer_only.py),
# carried when prepare ran with SBS_TOKENIZER_ONLY=1; synth prefers it to the real model.
TOK_ONLY="$sbs/tokenizer-only.gguf"
# KL slices: name, window arguments (the same for --save-tokens here and --kl-reference there).
SLICES=("kl-chunks512:--method chunks --context 512 --chunks 40"
        "kl-sliding4096:--method sliding --context 4096 --stride 2048 --chunks 4")
# Route and KV settings measured against the float64 truth: name, evaluator arguments.
KL_SETTINGS=("lossless:--lossless" "default:" "default-kv-f32:--kv-dtype f32" "lossless-kv-bf16:--lossless --kv-dtype bf16")

die() { echo "side-by-side.sh: error: $*" >&2; exit 2; }
note() { echo "side-by-side.sh: $*" >&2; }
text() { echo "$peers/text/wiki.test.raw"; }
twin() { echo "llama-8b-$1"; }

# --- background jobs: $sbs/jobs/NAME.{pid,log,done} ------------------------------

bg_job() {
    # bg_job NAME COMMAND...: runs detached (outlives the call), exit status into NAME.done.
    local name="$1"
    shift
    mkdir -p "$sbs/jobs"
    rm -f "$sbs/jobs/$name.done"
    setsid nohup bash -c '"${@:2}"; echo $? >"$1.done"' _ "$sbs/jobs/$name" "$@" >"$sbs/jobs/$name.log" 2>&1 </dev/null &
    echo $! >"$sbs/jobs/$name.pid"
    note "started $name in the background (log $sbs/jobs/$name.log)"
}

wait_jobs() {
    # wait_jobs PREFIX: waits for the background jobs named PREFIX*; fails with the
    # log tail of one that failed.
    local f name
    for f in "$sbs/jobs/$1"*.pid; do
        [[ -f "$f" ]] || continue
        name="$(basename "$f" .pid)"
        while [[ ! -f "$sbs/jobs/$name.done" ]]; do
            kill -0 "$(cat "$f")" 2>/dev/null || { sleep 1; [[ -f "$sbs/jobs/$name.done" ]] || die "job $name is gone without an exit status"; }
            sleep 2
        done
        [[ "$(cat "$sbs/jobs/$name.done")" == 0 ]] || { tail -n 30 "$sbs/jobs/$name.log" >&2; die "job $name failed"; }
        note "job $name done: $(tail -n 1 "$sbs/jobs/$name.log")"
    done
}

# --- here ----------------------------------------------------------------------------

prepare() {
    [[ -f "$root/Cargo.toml" ]] || die "run prepare from the repository root"
    [[ -f "$root/.devcarry/peers/MANIFEST" ]] || die "run scripts/peers.sh prepare first"
    local mdir="${INFERNIX_MODELS:-$root/models}" data="${INFERNIX_DATA:-$root/eval/corpora/ppl-v1}" target stem spec name tmp
    local -a args
    [[ -n "${NVCC:-}${CUDA_HOME:-}${CUDA_PATH:-}" ]] || command -v nvcc >/dev/null || die "no nvcc: the binary would carry no kernels"
    cargo build --release --bins
    target="${CARGO_TARGET_DIR:-$root/target}/release"
    local exe t
    rm -rf "$carry"
    mkdir -p "$carry/tokens"
    for b in infernix-perplexity ninfer-convert; do
        strip -o "$carry/$b" "$target/$b"
        xz -9 -T2 "$carry/$b"
    done
    if [[ "${SBS_TESTS:-0}" == 1 ]]; then
        mkdir -p "$carry/tests"
        for t in gpu_ops gpu_e2e; do
            exe="$(cargo test --release --no-run --test "$t" --message-format=json 2>/dev/null | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == sys.argv[1] and m.get("executable"):
        print(m["executable"])' "$t")"
            [[ -n "$exe" ]] || die "building tests/$t.rs failed (cargo test --release --no-run --test $t)"
            strip -o "$carry/tests/$t" "$exe"
            xz -9 -T2 "$carry/tests/$t"
        done
    fi
    cp "${BASH_SOURCE[0]}" "$carry/side-by-side.sh"
    cp "$root/tools/fp64_reference.py" "$carry/"
    if [[ "${SBS_TOKENIZER_ONLY:-0}" == 1 ]]; then
        python3 "$root/scripts/cluster/gguf_tokenizer_only.py" "$mdir/$TWIN_TOKENIZER.gguf" "$carry/tokenizer-only.gguf" >&2
    fi
    : >"$carry/ninfer.sha256"
    for stem in "${MODELS[@]}"; do
        [[ -f "$mdir/$stem.ninfer" ]] || die "$mdir/$stem.ninfer missing (scripts/fetch-models.sh)"
        (cd "$mdir" && sha256sum "$stem.ninfer") >>"$carry/ninfer.sha256"
        for spec in "${SLICES[@]}"; do
            name="${spec%%:*}"
            read -r -a args <<<"${spec#*:}"
            tmp="$(mktemp -d)"
            "$target/infernix-perplexity" "$mdir/$stem.ninfer" --text "$data/wikitext-2-raw/wiki.test.raw" "${args[@]}" \
                --backend cpu --dry-run --save-tokens "$carry/tokens/$stem.$name.json" --output "$tmp/dry" --log-level error
            rm -rf "$tmp"
        done
    done
    du -sh "$carry"
}

# --- the GPU machine --------------------------------------------------------------------

stash() {
    local p=/tmp/peers/bin/peers.sh stem
    [[ -f "$root/.devcarry/peers/peers.sh" ]] && p="$root/.devcarry/peers/peers.sh"
    bash "$p" stash
    mkdir -p "$sbs/bin" "$sbs/models" "$sbs/tokens" "$sbs/kl" "$sbs/runs" "$out"
    if [[ -d "$carry" ]]; then
        # Through new files: a binary or script still running from an earlier call
        # (synth, fp64; bash reads a script as it goes) keeps its old file.
        for b in infernix-perplexity ninfer-convert; do
            xz -dc "$carry/$b.xz" >"$sbs/bin/$b.new" && chmod +x "$sbs/bin/$b.new" && mv -f "$sbs/bin/$b.new" "$sbs/bin/$b"
        done
        for b in side-by-side.sh fp64_reference.py; do
            cp "$carry/$b" "$sbs/bin/$b.new" && mv -f "$sbs/bin/$b.new" "$sbs/bin/$b"
        done
        cp "$carry/ninfer.sha256" "$sbs/"
        [[ -f "$carry/tokenizer-only.gguf" ]] && cp "$carry/tokenizer-only.gguf" "$TOK_ONLY"
        cp "$carry"/tokens/* "$sbs/tokens/"
        for b in "$carry"/tests/*.xz; do
            [[ -f "$b" ]] || continue
            xz -dc "$b" >"$sbs/bin/$(basename "$b" .xz)" && chmod +x "$sbs/bin/$(basename "$b" .xz)"
        done
    fi
    [[ -x "$sbs/bin/infernix-perplexity" ]] || die "nothing stashed yet: the first call must carry .devcarry/sbs"
    for stem in "${MODELS[@]}"; do
        [[ -f "$peers/models/$stem.gguf" && ! -f "$sbs/models/$stem.ninfer" ]] || continue
        "$sbs/bin/ninfer-convert" "$peers/models/$stem.gguf" --out "$sbs/models/$stem.ninfer.tmp"
        (cd "$sbs/models" && mv "$stem.ninfer.tmp" "$stem.ninfer" && grep " $stem.ninfer\$" "$sbs/ninfer.sha256" | sha256sum -c --quiet) ||
            die "$stem.ninfer converted on this machine differs from the one converted where it was prepared"
        note "$stem.ninfer converted, sha256 equal to the prepared one"
        [[ "${SBS_NO_FP64:-0}" == 1 ]] && continue
        bash /tmp/peers/bin/peers.sh gguf-site /tmp/site
        bg_job "fp64-$stem" bash "$sbs/bin/side-by-side.sh" fp64 "$stem"
    done
}

fp64() {
    # The float64 references of one model, one per KL slice, one model load (GPU).
    local stem="$1" spec name
    local -a pairs=()
    for spec in "${SLICES[@]}"; do
        name="${spec%%:*}"
        pairs+=(--tokens "$sbs/tokens/$stem.$name.json" --output "$sbs/kl/$stem.$name.fp64.topk")
    done
    PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 python3 "$sbs/bin/fp64_reference.py" \
        --gguf "$peers/models/$stem.gguf" "${pairs[@]}" --device cuda
}

synth() {
    local f tok="$peers/models/$TWIN_TOKENIZER.gguf"
    [[ -f "$TOK_ONLY" ]] && tok="$TOK_ONLY"
    [[ -f "$tok" ]] || die "$TWIN_TOKENIZER.gguf not stashed yet (its tokenizer is the twins')"
    for f in "${TWIN_FORMATS[@]}"; do
        bg_job "synth-$f" "$sbs/bin/ninfer-convert" "$tok" --synthetic llama-8b --format "$f" \
            --out "$sbs/models/$(twin "$f").ninfer" --gguf-twin "$peers/models/$(twin "$f").gguf"
    done
}

run_ours() {
    # run_ours NAME STEM ARGS...: one evaluator run over wiki.test.raw; report to $out/ours-NAME.json.
    local name="$1" stem="$2" dir="$sbs/runs/$1"
    shift 2
    rm -rf "$dir"
    "$sbs/bin/infernix-perplexity" "$sbs/models/$stem.ninfer" --text "$(text)" --backend cuda "$@" \
        --output "$dir" >"$dir.stdout" 2>"$dir.log" || { tail -n 20 "$dir.log" >&2; die "evaluator run $name failed"; }
    cp "$dir/report.json" "$out/ours-$name.json"
    if [[ "${SBS_PROFILE:-0}" == 1 ]]; then
        rm -rf "$dir.prof"
        # The child's peak resident set (VmHWM, ru_maxrss) too, from the parent's rusage.
        INFERNIX_CUDA_PROFILE=1 python3 -c 'import resource, subprocess, sys
r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL)
print(f"PROFILE host peak RSS {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20:.3f} GiB (ru_maxrss)", file=sys.stderr)
sys.exit(r.returncode)' "$sbs/bin/infernix-perplexity" "$sbs/models/$stem.ninfer" --text "$(text)" --backend cuda "$@" \
            --output "$dir.prof" 2>"$dir.prof.log" || { tail -n 20 "$dir.prof.log" >&2; die "profiled run $name failed"; }
        grep '^PROFILE' "$dir.prof.log" >"$out/profile-$name.txt" || die "profiled run $name printed no PROFILE lines"
    fi
}

ours() {
    # ours real: both real models, then the KL runs; ours twin FORMAT: one 8B twin.
    local stem f spec slice setting
    local -a sargs kargs
    case "${1:-}" in
    real)
        wait_jobs fp64-
        for stem in "${MODELS[@]}"; do
            run_ours "$stem.chunks512" "$stem" --method chunks --context 512
            run_ours "$stem.chunks4096" "$stem" --method chunks --context 4096
            run_ours "$stem.sliding4096" "$stem" --method sliding --context 4096 --stride 2048
        done
        for stem in "${MODELS[@]}"; do
            for spec in "${SLICES[@]}"; do
                slice="${spec%%:*}"
                read -r -a sargs <<<"${spec#*:}"
                for setting in "${KL_SETTINGS[@]}"; do
                    read -r -a kargs <<<"${setting#*:}"
                    run_ours "$stem.$slice.${setting%%:*}" "$stem" "${sargs[@]}" "${kargs[@]}" \
                        --kl-reference "$sbs/kl/$stem.$slice.fp64.topk"
                done
            done
        done
        ;;
    twin)
        f="${2:?usage: side-by-side.sh ours twin FORMAT}"
        wait_jobs "synth-$f"
        run_ours "$(twin "$f").chunks512" "$(twin "$f")" --method chunks --context 512
        run_ours "$(twin "$f").chunks4096" "$(twin "$f")" --method chunks --context 4096
        ;;
    speed)
        stem="${2:?usage: side-by-side.sh ours speed STEM}"
        run_ours "$stem.chunks512" "$stem" --method chunks --context 512
        run_ours "$stem.chunks4096" "$stem" --method chunks --context 4096
        run_ours "$stem.sliding4096" "$stem" --method sliding --context 4096 --stride 2048
        ;;
    big)
        # The 70B-class row (header: ours big); llama-70b: d_model 8192, 80 layers, 64/8
        # heads, ffn 28672.
        local tok="$peers/models/$TWIN_TOKENIZER.gguf" big=llama-70b-Q4_0
        [[ -f "$TOK_ONLY" ]] && tok="$TOK_ONLY"
        [[ -f "$tok" ]] || die "$TWIN_TOKENIZER.gguf not stashed yet (its tokenizer is the 70B body's)"
        mkdir -p "$sbs/models" "$sbs/runs"
        "$sbs/bin/ninfer-convert" "$tok" --synthetic llama-70b --format Q4_0 --out "$sbs/models/$big.ninfer" >"$sbs/runs/$big.convert.log" 2>&1 \
            || { tail -n 20 "$sbs/runs/$big.convert.log" >&2; die "writing the 70B-class body failed"; }
        run_ours "$big.chunks512" "$big" --method chunks --context 512 ${SBS_BIG_CHUNKS:+--chunks "$SBS_BIG_CHUNKS"}
        rm -f "$sbs/models/$big.ninfer"
        ;;
    *) die "usage: side-by-side.sh ours real | ours twin FORMAT | ours speed STEM | ours big" ;;
    esac
    summary
}

llama() {
    # llama real: the real models; llama twins: the 8B twins (c=512 and c=4096 each).
    local p="bash /tmp/peers/bin/peers.sh" m c
    local -a models
    case "${1:-}" in
    real) models=("${MODELS[@]}") ;;
    twins) for m in "${TWIN_FORMATS[@]}"; do models+=("$(twin "$m")"); done ;;
    *) die "usage: side-by-side.sh llama real|twins" ;;
    esac
    for m in "${models[@]}"; do
        for c in 512 4096; do
            $p llama "$m" wiki.test.raw "$c" "$out/llama-$m-c$c.json" >/dev/null
        done
    done
    summary
}

transformers() {
    # The real models on the three window sets of peers.sh prepare. Not the 8B
    # twins: transformers' GGUF loader dequantizes in numpy at ~20M weights/s, a
    # quarter of an hour per twin.
    local p="bash /tmp/peers/bin/peers.sh" m
    for m in "${MODELS[@]}"; do
        $p transformers "$m" "$m.chunks512,$m.chunks4096,$m.sliding4096" \
            "$out/tf-$m-chunks512.json,$out/tf-$m-chunks4096.json,$out/tf-$m-sliding4096.json"
    done
    summary
}

transformers_twin() {
    # A random-weight bf16 8B body (speed only) on SmolLM2's c=512 and c=4096 windows.
    local m=$TWIN_TOKENIZER
    PEERS_TRANSFORMERS_RANDOM=llama-8b bash /tmp/peers/bin/peers.sh transformers "$m" "$m.chunks512,$m.chunks4096" \
        "$out/tf-random-llama-8b-chunks512.json,$out/tf-random-llama-8b-chunks4096.json"
    summary
}

parity() {
    # Every gpu_ops test, then the gpu_e2e tests matching "$@" (none: all of them).
    local status=0 f
    [[ -x "$sbs/bin/gpu_ops" && -x "$sbs/bin/gpu_e2e" ]] || die "no parity executables stashed (prepare with SBS_TESTS=1)"
    if [[ "${SBS_SKIP_OPS:-0}" != 1 ]]; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv >"$out/gpu_ops.log" 2>&1 || true
        "$sbs/bin/gpu_ops" --test-threads=1 --nocapture >>"$out/gpu_ops.log" 2>&1 || status=1
    fi
    INFERNIX_MODELS="$sbs/models" INFERNIX_DATA="$root/eval/corpora/ppl-v1" INFERNIX_REFERENCE="$root/tests/data/reference" \
        INFERNIX_E2E_GOLDEN="$root/tests/data/gpu_e2e_cpu_golden.json" \
        "$sbs/bin/gpu_e2e" --test-threads=1 --nocapture "$@" >"$out/gpu_e2e.log" 2>&1 || status=1
    for f in gpu_ops gpu_e2e; do
        [[ -f "$out/$f.log" ]] || continue
        grep -E '^(DEVICE|KERNEL_FILE|PARITY|TIMING|GATED|E2E|test result|test .* FAILED|failures:|thread .* panicked)' "$out/$f.log" || true
    done
    return "$status"
}

one_call() {
    # The twins' three tools in one command (header: one-call).
    local limit="${1:-560}" t0=$SECONDS f status=0
    local p="bash /tmp/peers/bin/peers.sh"
    stash
    PEERS_JOBS="${PEERS_JOBS:-16}" $p build-llama
    synth
    if [[ -x "$sbs/bin/gpu_ops" && "${SBS_SKIP_PARITY:-0}" != 1 ]]; then
        parity "${E2E_FILTER[@]}" || status=1
        note "parity exit $status at $((SECONDS - t0)) s"
    fi
    for f in "${TWIN_FORMATS[@]}"; do ours twin "$f"; done
    note "ours at $((SECONDS - t0)) s"
    transformers_twin
    note "transformers at $((SECONDS - t0)) s"
    if [[ -n "${SBS_SMALL:-}" ]]; then
        bash -c "$SBS_SMALL" || note "SBS_SMALL exit $?"
        note "small at $((SECONDS - t0)) s"
    fi
    $p build-llama-wait $((limit - (SECONDS - t0) - 90)) || die "llama.cpp not built in time"
    note "llama.cpp built at $((SECONDS - t0)) s"
    llama twins
    if [[ -n "${SBS_SMALL_LLAMA:-}" ]]; then
        bash -c "$SBS_SMALL_LLAMA" || note "SBS_SMALL_LLAMA exit $?"
    fi
    if [[ "${SBS_BIG:-0}" == 1 ]]; then
        ours big
        note "70B-class body at $((SECONDS - t0)) s"
    fi
    note "one-call done at $((SECONDS - t0)) s (parity exit $status)"
    return "$status"
}

summary() {
    if [[ -f /tmp/peers/bin/peers.sh ]]; then
        bash /tmp/peers/bin/peers.sh summary "$out"
    else
        note "no peers stashed: our reports only"
    fi
    python3 - "$out" <<'EOF'
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "ours-*.json"))):
    r = json.load(open(path))
    o, t, w, e = r["results"]["overall"], r["timing"], r["workload"], r["execution"]
    line = (f"OURS {os.path.basename(path)[5:-5]:<58} PPL {o['perplexity']:>12.4f} targets {o['scored_tokens']:>7} "
            f"{t['tokens_per_second_processed']:>9,.0f} tok/s processed {t['tokens_per_second_scored']:>9,.0f} scored "
            f"({t['scoring_seconds']:.2f} s) route {e.get('route', e['details'].get('route'))} kv {e.get('kv_format', e.get('kv_dtype'))} "
            f"x{e['details'].get('windows_per_pass')}")
    dev = ((r.get("memory") or {}).get("devices") or [{}])[0]
    if dev.get("pool_used_peak_bytes") is not None:
        line += f" pool peak {dev['pool_used_peak_bytes'] / 1e9:.1f} GB"
    kl = r["results"].get("kl_divergence")
    if kl:
        q = kl.get("quantiles") or {}
        line += (f" | KL mean {kl['mean']:.3e} p99 {q.get('p99', float('nan')):.3e} max {q.get('max', float('nan')):.3e} "
                 f"top1 {kl['top1_agreement']:.6f} dNLL {kl['mean_nll_delta']:+.3e} +/- {kl['mean_nll_delta_se'] or 0:.1e} "
                 f"flips {kl['n_confident_flips']} ref NLL {kl['mean_nll_reference']:.6f}")
    print(line)
EOF
}

case "$cmd" in
    prepare) prepare ;;
    stash) stash ;;
    fp64) fp64 "$2" ;;
    synth) synth ;;
    ours) ours "${@:2}" ;;
    llama) llama "${@:2}" ;;
    transformers) transformers ;;
    transformers-twin) transformers_twin ;;
    parity) parity "${@:2}" ;;
    summary) summary ;;
    one-call) one_call "${@:2}" ;;
    *)
        sed -n '2,/^set -euo pipefail/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
        [[ -z "$cmd" || "$cmd" == -h || "$cmd" == --help ]] || die "unknown subcommand: $cmd"
        ;;
esac
