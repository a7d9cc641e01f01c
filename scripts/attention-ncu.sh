#!/usr/bin/env bash
# attention-ncu.sh: Nsight Compute on kernel v3 (kernels/attention_sm90a.cu) at the bench's
# ctx 4096 d 128 shape, one launch after 3 warm-ups of each kernel (docs/performance.md,
# "Why the quantized kernels trail bf16").
#
#   scripts/attention-ncu.sh prepare [TARGET_DIR]   (here; NVCC and INFERNIX_CUDA_ARCH=90a set)
#       Builds benches/attention.rs in release and packs it, stripped and xz'd, with this
#       script into .devcarry/ncu/ (git-ignored, about 4 MB).
#   bash .devcarry/ncu/attention-ncu.sh run        (on the GPU machine; carry [".devcarry/ncu"])
#       For bf16, fp8, fp8-qk, int8-qk and int8 (or the kernels INFERNIX_NCU_KERNELS
#       names, "FORMAT KERNEL;..."): ncu --clock-control none with the sections
#       SpeedOfLight, ComputeWorkloadAnalysis, SchedulerStats and WarpStateStats, then the
#       stall reasons (smsp__warp_issue_stalled_*_per_warp_active.pct). Reports in $OUT.
set -u
cmd="${1:-}"
D="$(pwd)/.devcarry/ncu"
die() { echo "attention-ncu.sh: error: $*" >&2; exit 2; }
case "$cmd" in
prepare)
    exe="$(cargo bench --bench attention --no-run --message-format=json 2>/dev/null | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "attention" and m.get("executable"):
        print(m["executable"])')"
    [[ -n "$exe" ]] || die "building benches/attention.rs failed (cargo bench --bench attention --no-run)"
    rm -rf "$D" && mkdir -p "$D"
    strip -o "$D/attention" "$exe" && xz -9 "$D/attention" || die "packing $exe"
    cp "${BASH_SOURCE[0]}" "$D/attention-ncu.sh"
    du -sh "$D"
    ;;
run)
    [[ -n "${OUT:-}" ]] || die "run on the device machine (\$OUT unset)"
    NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
    [[ -x "$NCU" ]] || die "no ncu"
    xz -dc "$D/attention.xz" > /tmp/attention && chmod +x /tmp/attention
    stalls=""
    for r in barrier long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle sleeping membar dispatch_stall \
        no_instruction not_selected selected lg_throttle tex_throttle branch_resolving drain misc imc_miss; do
        stalls="$stalls${stalls:+,}smsp__warp_issue_stalled_${r}_per_warp_active.pct"
    done
    specs=("bf16 attn_wgmma_d128_bf16_f32" "fp8 attn_wgmma_d128_fp8_f32" "fp8 attn_wgmma_d128_fp8qk_f32"
        "int8 attn_wgmma_d128_int8qk_f32" "int8 attn_wgmma_d128_int8_f32")
    # INFERNIX_NCU_KERNELS="FORMAT KERNEL;FORMAT KERNEL;...": other kernels instead.
    if [[ -n "${INFERNIX_NCU_KERNELS:-}" ]]; then IFS=';' read -r -a specs <<< "$INFERNIX_NCU_KERNELS"; fi
    for spec in "${specs[@]}"; do
        set -- $spec
        for what in sections stalls; do
            if [[ $what == sections ]]; then
                args=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats)
            else
                args=(--metrics "$stalls")
            fi
            INFERNIX_BENCH_SHAPES=0 INFERNIX_BENCH_FORMATS=$1 INFERNIX_BENCH_V3_ONLY=1 timeout 120 "$NCU" --clock-control none \
                -k "$2" --launch-skip 3 --launch-count 1 "${args[@]}" /tmp/attention --bench > "$OUT/ncu-$2-$what.txt" 2>&1 \
                || echo "$2 $what: exit $?"
        done
        echo "=== $2"
        grep -E "Duration|Issue Slots Busy|No Eligible|highest-utilized" "$OUT/ncu-$2-sections.txt"
        grep -E "stalled" "$OUT/ncu-$2-stalls.txt" | awk '{print $1, $NF}' | sed 's/smsp__warp_issue_stalled_//; s/_per_warp_active.pct//'
    done
    ;;
*) die "usage: scripts/attention-ncu.sh prepare | bash .devcarry/ncu/attention-ncu.sh run" ;;
esac
