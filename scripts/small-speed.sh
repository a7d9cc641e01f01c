#!/usr/bin/env bash
# small-speed.sh: the two real small models' speed beside transformers bf16 in one
# device call that carries no model (issue 12, docs/performance.md "Issue 12: the
# small models (small4)"). The models travel as speed twins
# (tools/gguf_tiled_twin.py: the real GGUF header, tokenizer and block formats,
# weight rows tiled so that xz packs 351 MB into 7.5 MB); perplexities of the
# twins mean nothing, tokens per second are the real models'.
#
# Here (repository root; models/*.gguf and .ninfer from scripts/fetch-models.sh):
#   BINS="before=PATH after=PATH ..." scripts/small-speed.sh prepare [TESTS_DIR]
#       Writes .devcarry/small4/: the twins (xz), the --save-tokens files of
#       both models' three window sets (chunks 512, chunks 4096, sliding
#       4096/2048 over wiki.test.raw, written by the first binary with
#       --dry-run), each evaluator binary as infernix-perplexity.NAME.xz, a
#       ninfer-convert (NINFER_CONVERT, default target/release/ninfer-convert),
#       the gguf wheel (GGUF_WHEEL, default .devcarry/peers/whl/gguf-*.whl) and
#       this script; TESTS_DIR/{gpu_ops,gpu_e2e} (release test executables) as
#       gpu_ops.xz, gpu_e2e.xz when given.
# On the GPU machine (repository root, carry .devcarry/small4):
#   BINS="before after" [PROF=1] [TF=1] [PARITY=1 OPS_FILTER=...] [SMALL_MODELS=...] bash .devcarry/small4/small-speed.sh run
#       Converts the twins to .ninfer with the carried converter; for each
#       binary in BINS each model's three window sets over all of
#       wiki.test.raw, default route, one timed run each (PROF=1: then one
#       more with INFERNIX_CUDA_PROFILE=1, not timed); PARITY=1: the gpu_ops
#       tests matching OPS_FILTER and gpu_e2e tiny_models; TF=1: transformers
#       bf16 (tools/transformers_peer.py) on each twin over the same windows.
#       SMALL_MODELS narrows the models (space-separated stems). All logs in
#       $OUT/logs.tgz; one OURS/TF line per run and the profiles last.
#   bash .devcarry/small4/small-speed.sh llama   (after run, same machine)
#       llama.cpp's llama-perplexity (scripts/peers.sh llama: -ngl 99 -fa on, the
#       binary of peers.sh build-llama) on the same twin GGUFs, chunks c=512 and
#       c=4096 over the same text: one PEER line each, logs in $OUT/logs-llama.tgz.
set -u
cmd="${1:-}"
root="$(pwd)"
D="$root/.devcarry/small4"
MODELS="${SMALL_MODELS:-SmolLM2-135M-Instruct.Q4_1 gemma-3-270m-q4_k_m}"
TEXT=eval/corpora/ppl-v1/wikitext-2-raw/wiki.test.raw
PLANS=("chunks512:--method chunks --context 512" "chunks4096:--method chunks --context 4096" "sliding4096:--method sliding --context 4096 --stride 2048")
die() { echo "small-speed.sh: error: $*" >&2; exit 2; }

prepare() {
    local mdir="${INFERNIX_MODELS:-$root/models}" first="" spec name path m p n tmp
    local -a a
    [[ -f "$root/Cargo.toml" ]] || die "run prepare from the repository root"
    [[ -n "${BINS:-}" ]] || die "BINS is empty (NAME=PATH pairs)"
    rm -rf "$D" && mkdir -p "$D"
    for spec in $BINS; do
        name="${spec%%=*}" path="${spec#*=}"
        [[ -x "$path" ]] || die "BINS: $path is not an executable"
        strip -o "$D/infernix-perplexity.$name" "$path" && xz -9 -T2 "$D/infernix-perplexity.$name" || die "packing $path"
        [[ -n "$first" ]] || first="$path"
    done
    cp "${NINFER_CONVERT:-$root/target/release/ninfer-convert}" "$D/ninfer-convert" || die "no ninfer-convert (NINFER_CONVERT)"
    cp ${GGUF_WHEEL:-$root/.devcarry/peers/whl/gguf-*.whl} "$D/" || die "no gguf wheel (GGUF_WHEEL; scripts/peers.sh prepare downloads one)"
    for m in $MODELS; do
        python3 "$root/tools/gguf_tiled_twin.py" "$mdir/$m.gguf" "$D/$m.tiled.gguf" && xz -6 -T2 "$D/$m.tiled.gguf" || die "twin of $m"
        for p in "${PLANS[@]}"; do
            n=${p%%:*}; read -r -a a <<<"${p#*:}"
            tmp="$(mktemp -d)"
            "$first" "$mdir/$m.ninfer" --text "$root/$TEXT" "${a[@]}" --backend cpu --dry-run \
                --save-tokens "$D/$m.$n.json" --output "$tmp/dry" --log-level error || die "--save-tokens $m $n"
            rm -rf "$tmp"
            xz -T2 "$D/$m.$n.json"
        done
    done
    if [[ -n "${2:-}" ]]; then
        for t in gpu_ops gpu_e2e; do strip -o "$D/$t" "$2/$t" && xz -9 -T2 "$D/$t" || die "packing $2/$t"; done
    fi
    cp "${BASH_SOURCE[0]}" "$D/small-speed.sh"
    du -sh "$D"
}

run() {
    W=/tmp/s4; mkdir -p $W/bin $W/m $W/r $W/log; T0=$SECONDS
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee $W/log/device.txt
    for b in $BINS; do xz -dc $D/infernix-perplexity.$b.xz > $W/bin/ip-$b && chmod +x $W/bin/ip-$b; done
    cp $D/ninfer-convert $W/bin/ && chmod +x $W/bin/ninfer-convert
    for m in $MODELS; do
      xz -dc -T4 $D/$m.tiled.gguf.xz > $W/m/$m.gguf && $W/bin/ninfer-convert $W/m/$m.gguf --out $W/m/$m.ninfer > $W/log/convert-$m.log 2>&1 || echo "convert $m failed"
    done
    sha256sum $W/m/*.gguf | tee -a $W/log/device.txt
    echo "models at $((SECONDS - T0)) s"
    for b in $BINS; do for m in $MODELS; do for p in "${PLANS[@]}"; do
      n=${p%%:*}; read -r -a a <<<"${p#*:}"; id=$b.$m.$n
      timeout 60 $W/bin/ip-$b $W/m/$m.ninfer --text $TEXT --backend cuda "${a[@]}" --output $W/r/$id > $W/log/$id.table 2> $W/log/$id.log || echo "$id exit $?"
      cp $W/r/$id/report.json $W/log/ours-$id.json 2>/dev/null
      if [ "${PROF:-0}" = 1 ]; then
        INFERNIX_CUDA_PROFILE=1 timeout 60 $W/bin/ip-$b $W/m/$m.ninfer --text $TEXT --backend cuda "${a[@]}" --output $W/r/$id.prof > /dev/null 2> $W/log/$id.prof.log || echo "$id prof exit $?"
        grep '^PROFILE' $W/log/$id.prof.log > $W/log/profile-$id.txt
      fi
    done; done; done
    echo "ours at $((SECONDS - T0)) s"
    if [ "${PARITY:-0}" = 1 ]; then
      for t in gpu_ops gpu_e2e; do xz -dc $D/$t.xz > $W/bin/$t && chmod +x $W/bin/$t; done
      timeout 100 $W/bin/gpu_ops --test-threads=1 --nocapture ${OPS_FILTER:-} > $W/log/gpu_ops.log 2>&1; echo "gpu_ops exit $?"
      INFERNIX_DATA=eval/corpora/ppl-v1 INFERNIX_REFERENCE=tests/data/reference INFERNIX_E2E_GOLDEN=tests/data/gpu_e2e_cpu_golden.json \
        timeout 80 $W/bin/gpu_e2e --test-threads=1 --nocapture tiny_models > $W/log/gpu_e2e.log 2>&1; echo "gpu_e2e exit $?"
      grep -hE '^(KERNEL_FILE|PARITY|test result|test .* FAILED|thread .* panicked)' $W/log/gpu_ops.log $W/log/gpu_e2e.log | cut -c1-200
      echo "parity at $((SECONDS - T0)) s"
    fi
    if [ "${TF:-0}" = 1 ]; then
      python3 -m pip install -q --no-deps --no-index --target /tmp/site $D/gguf-0.19.0-*.whl 2>&1 | tail -1
      for m in $MODELS; do
        PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 timeout 120 python3 tools/transformers_peer.py --gguf $W/m/$m.gguf --device cuda --dtype bfloat16 \
          --tokens $D/$m.chunks512.json.xz --output $W/log/tf-$m.chunks512.json --tokens $D/$m.chunks4096.json.xz --output $W/log/tf-$m.chunks4096.json \
          --tokens $D/$m.sliding4096.json.xz --output $W/log/tf-$m.sliding4096.json > $W/log/tf-$m.log 2>&1 || { echo "transformers $m exit $?"; tail -3 $W/log/tf-$m.log; }
      done
      echo "transformers at $((SECONDS - T0)) s"
    fi
    (cd $W/log && tar czf $OUT/logs.tgz .)
    python3 - $W/log <<'PY'
import glob, json, os, sys
d = sys.argv[1]
for p in sorted(glob.glob(f"{d}/ours-*.json")):
    r = json.load(open(p)); t = r["timing"]; o = r["results"]["overall"]
    print(f"OURS {os.path.basename(p)[5:-5]:<52} {t['tokens_per_second_processed']:>9,.0f} tok/s  PPL {o['perplexity']:.4f}  {t['tokens_processed']} tok {t['scoring_seconds']:.3f} s")
for p in sorted(glob.glob(f"{d}/tf-*.json")):
    r = json.load(open(p))
    keys = {k: r[k] for k in r if k in ("perplexity", "tokens_processed", "scoring_seconds") or "per_second" in k}
    print(f"TF {os.path.basename(p)[3:-5]:<40} {keys}")
for p in sorted(glob.glob(f"{d}/profile-*.txt")):
    print("==", os.path.basename(p)); print(open(p).read().strip()[:1500])
PY
    echo "all done at $((SECONDS - T0)) s"
}

llama_runs() {
    local W=/tmp/s4 p=/tmp/peers/bin/peers.sh m c
    for m in $MODELS; do
      [[ -f $W/m/$m.gguf ]] || { echo "llama: $W/m/$m.gguf missing (small-speed.sh run first)"; continue; }
      for c in 512 4096; do
        timeout 120 bash $p llama $W/m/$m.gguf "$root/$TEXT" $c $W/log/llama-$m.c$c.json > /dev/null 2>&1 || echo "llama $m c=$c exit $?"
      done
    done
    bash $p summary $W/log
    (cd $W/log && tar czf $OUT/logs-llama.tgz llama-*)
}

case "$cmd" in
    prepare) prepare "$@" ;;
    run) run ;;
    llama) llama_runs ;;
    *) sed -n '2,/^set -u/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; [[ -z "$cmd" ]] || die "unknown subcommand: $cmd" ;;
esac
