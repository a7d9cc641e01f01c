#!/usr/bin/env bash
# batch-sweep.sh: the --batch-tokens sweep of docs/performance.md ("Issue 12: larger
# passes") in one device call that carries no model: the 8B-class Q4_0 twin (written on
# the device from SmolLM2's tokenizer-only GGUF) and the two small speed twins
# (tools/gguf_tiled_twin.py), all of wiki.test.raw, default route, one timed run each.
#
# Here (repository root; models/*.gguf from scripts/fetch-models.sh; release build with
# NVCC and INFERNIX_CUDA_ARCH=90a):
#   scripts/batch-sweep.sh prepare [TARGET_DIR] [OLD_EVALUATOR]
#       Packs .devcarry/bt/ (git-ignored, about 17 MB, 24 with OLD_EVALUATOR): the stripped
#       evaluator and converter from TARGET_DIR/release (default target/release), xz; the
#       tokenizer-only GGUF; the two tiled twins, xz; this script; with OLD_EVALUATOR (an
#       earlier build's infernix-perplexity) that one too, for `ab`.
# On the GPU machine (repository root, carry [".devcarry/bt"]):
#   bash .devcarry/bt/batch-sweep.sh sweep
#       --batch-tokens 16384, 32768 and 65536 on each workload (8B chunks c=512 and c=4096;
#       SmolLM2 and Gemma-3 chunks c=512 and sliding 4096/2048), then 16384 again for the
#       spread, and one INFERNIX_CUDA_PROFILE=1 run of the 8B at c=512 and 65536 rows.
#   bash .devcarry/bt/batch-sweep.sh slices
#       Passes of more than 65535 rows (the RoPE and gated launches in slices,
#       ops::row_slices): Gemma-3 at 65536 rows and --lossless at 73,728 rows against
#       16384; each pair must print the same nll_sum. Then the default --batch-tokens on
#       every twin.
#   bash .devcarry/bt/batch-sweep.sh ab [OLD_ARGS]
#       This build against OLD_EVALUATOR on each twin, chunks c=512, --batch-tokens 32768:
#       new, old, new again, then new and old with INFERNIX_CUDA_PROFILE=1 (GPU time per
#       op family, the PROFILE lines). With OLD_ARGS (one word list, e.g. "--no-fast-path
#       lm-head-fused"), "old" is this build with those arguments (no OLD_EVALUATOR needed).
# One OURS line a run (tok/s processed, PPL and nll_sum to the last bit, batch, device pool
# peak); logs and reports in $OUT/bt-logs.tgz, nvidia-smi power and clocks every 250 ms in it.
set -u
cmd="${1:-}"
root="$(pwd)"
D="$root/.devcarry/bt"
W=/tmp/bt
TEXT=eval/corpora/ppl-v1/wikitext-2-raw/wiki.test.raw
G=gemma-3-270m-q4_k_m
S=SmolLM2-135M-Instruct.Q4_1
die() { echo "batch-sweep.sh: error: $*" >&2; exit 2; }

prepare() {
    local t="${1:-$root/target}/release" mdir="${INFERNIX_MODELS:-$root/models}" m
    [[ -f "$root/Cargo.toml" ]] || die "run prepare from the repository root"
    rm -rf "$D" && mkdir -p "$D"
    strip -o "$D/ip" "$t/infernix-perplexity" && xz -9 -T2 "$D/ip" || die "no evaluator in $t"
    strip -o "$D/conv" "$t/ninfer-convert" && xz -9 -T2 "$D/conv" || die "no ninfer-convert in $t"
    python3 "$root/scripts/cluster/gguf_tokenizer_only.py" "$mdir/$S.gguf" "$D/tokenizer-only.gguf" >&2 || die "tokenizer-only GGUF"
    for m in $S $G; do
        python3 "$root/tools/gguf_tiled_twin.py" "$mdir/$m.gguf" "$D/$m.tiled.gguf" >&2 && xz -6 -T2 "$D/$m.tiled.gguf" || die "twin of $m"
    done
    if [[ -n "${2:-}" ]]; then
        strip -o "$D/ip_old" "$2" && xz -9 -T2 "$D/ip_old" || die "no evaluator at $2"
    fi
    cp "${BASH_SOURCE[0]}" "$D/batch-sweep.sh"
    du -sh "$D"
}

setup() {
    T0=$SECONDS
    mkdir -p $W/m $W/r $W/log
    nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee $W/log/device.txt
    xz -dc $D/ip.xz > $W/ip && xz -dc $D/conv.xz > $W/conv && chmod +x $W/ip $W/conv
    nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,clocks_event_reasons.active --format=csv,noheader -lms 250 \
        > $W/log/power-$cmd.csv 2>&1 &
    SMI=$!
    $W/conv $D/tokenizer-only.gguf --synthetic llama-8b --format Q4_0 --out $W/m/8b.ninfer > $W/log/conv-8b.log 2>&1 || echo "8b convert failed"
    for m in $S $G; do
        xz -dc -T4 $D/$m.tiled.gguf.xz > $W/m/$m.gguf && $W/conv $W/m/$m.gguf --out $W/m/$m.ninfer > $W/log/conv-$m.log 2>&1 || echo "convert $m failed"
    done
    echo "models at $((SECONDS - T0)) s"
}

finish() {
    kill $SMI 2>/dev/null
    (cd $W/log && tar czf $OUT/bt-logs.tgz .)
    echo "all done at $((SECONDS - T0)) s"
}

summary() { # report.json
    python3 - "$1" <<'PY'
import json, os, sys
p = sys.argv[1]; r = json.load(open(p)); t = r["timing"]; o = r["results"]["overall"]; d = r["execution"]["details"]
dev = ((r.get("memory") or {}).get("devices") or [{}])[0]
print(f"OURS {os.path.basename(p)[2:-5]:<36} {t['tokens_per_second_processed']:>10,.0f} tok/s  PPL {o['perplexity']!r}  "
      f"nll_sum {o['nll_sum']!r}  {t['tokens_processed']} tok {t['scoring_seconds']:.3f} s  batch {d.get('batch_tokens')} "
      f"windows/pass {d.get('windows_per_pass')}  pool peak {dev.get('pool_used_peak_bytes')}", flush=True)
PY
}

one() { # id model args...: one timed run over wiki.test.raw
    local id=$1 m=$2
    shift 2
    timeout 90 ${bin_run:-$W/ip} $W/m/$m.ninfer --text $TEXT --backend cuda "$@" --output $W/r/$id > /dev/null 2> $W/log/$id.log \
        || { echo "$id exit $?"; tail -1 $W/log/$id.log; }
    cp $W/r/$id/report.json $W/log/r-$id.json 2>/dev/null && summary $W/log/r-$id.json
}

sweep() {
    local b m
    for b in 16384 32768 65536; do one 8b.c512.$b 8b --method chunks --context 512 --batch-tokens $b; done
    for b in 16384 32768 65536; do one 8b.c4096.$b 8b --method chunks --context 4096 --batch-tokens $b; done
    one 8b.c512.16384r 8b --method chunks --context 512 --batch-tokens 16384
    INFERNIX_CUDA_PROFILE=1 timeout 60 $W/ip $W/m/8b.ninfer --text $TEXT --backend cuda --method chunks --context 512 \
        --batch-tokens 65536 --output $W/r/prof > /dev/null 2> $W/log/prof65536.log
    grep "^PROFILE" $W/log/prof65536.log
    for m in $S $G; do
        for b in 16384 32768 65536; do
            one $m.c512.$b $m --method chunks --context 512 --batch-tokens $b
            one $m.sl.$b $m --method sliding --context 4096 --stride 2048 --batch-tokens $b
        done
        one $m.c512.16384r $m --method chunks --context 512 --batch-tokens 16384
    done
}

slices() {
    local m
    one g.c512.65536 $G --method chunks --context 512 --batch-tokens 65536
    one g.c512.16384 $G --method chunks --context 512 --batch-tokens 16384
    one g.sl.65536 $G --method sliding --context 4096 --stride 2048 --batch-tokens 65536
    one g.sl.16384 $G --method sliding --context 4096 --stride 2048 --batch-tokens 16384
    one g.lossless.73728 $G --method chunks --context 512 --chunks 144 --lossless --batch-tokens 73728
    one g.lossless.16384 $G --method chunks --context 512 --chunks 144 --lossless --batch-tokens 16384
    for m in 8b $S $G; do
        one $m.c512.default $m --method chunks --context 512
        [[ $m == 8b ]] && one $m.c4096.default $m --method chunks --context 4096 || one $m.sl.default $m --method sliding --context 4096 --stride 2048
    done
}

ab() { # [OLD_ARGS]
    local m b bin old_args=() args
    if [[ -n "${1:-}" ]]; then
        read -r -a old_args <<< "$1"
        cp $W/ip $W/ip_old
    else
        [[ -f $D/ip_old.xz ]] || die "no ip_old.xz: prepare with OLD_EVALUATOR, or give OLD_ARGS"
        xz -dc $D/ip_old.xz > $W/ip_old && chmod +x $W/ip_old
    fi
    for m in 8b $S $G; do
        for b in new old new2 new-prof old-prof; do
            bin=$W/ip
            args=()
            [[ $b == old* ]] && bin=$W/ip_old && args=("${old_args[@]}")
            if [[ $b == *prof ]]; then
                INFERNIX_CUDA_PROFILE=1 timeout 90 $bin $W/m/$m.ninfer --text $TEXT --backend cuda --method chunks --context 512 \
                    --batch-tokens 32768 "${args[@]}" --output $W/r/$m.$b > /dev/null 2> $W/log/$m.$b.log || echo "$m.$b exit $?"
                grep "^PROFILE" $W/log/$m.$b.log
                cp $W/r/$m.$b/report.json $W/log/r-$m.$b.json 2>/dev/null && summary $W/log/r-$m.$b.json
            else
                bin_run=$bin one $m.$b $m --method chunks --context 512 --batch-tokens 32768 "${args[@]}"
            fi
        done
    done
}

case "$cmd" in
prepare) prepare "${2:-}" "${3:-}" ;;
sweep | slices | ab)
    [[ -n "${OUT:-}" ]] || die "run on the device machine (\$OUT unset)"
    setup
    $cmd "${2:-}"
    finish
    ;;
*) die "usage: scripts/batch-sweep.sh prepare [TARGET_DIR] [OLD_EVALUATOR] | bash .devcarry/bt/batch-sweep.sh sweep|slices|ab [OLD_ARGS]" ;;
esac
