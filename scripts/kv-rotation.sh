#!/usr/bin/env bash
# kv-rotation.sh (.devcarry/rot8/s/rot8.sh on the device): issue 11's rotation choice per KV format, measured on the H200
# (docs/kv-formats.md, "Rotation per format (rot8)"). Both real models, the
# --quick corpus, sliding 4096/2048, the first CHUNKS windows of each stream:
# bf16 KV with --save-top-tokens, then every quantized format with
# --kv-rotation on and off, each with --kl-reference against the bf16 run.
#
# Inputs arrive over N consecutive calls (64 MiB a call): c0/ holds
# infernix-perplexity.xz and the first bytes of BLOB (SmolLM2 .ninfer.xz then the
# Gemma-3 .ninfer.xz, concatenated), c1/.. the rest of BLOB in order; s/sizes
# holds the first's xz size and both artifacts' SHA-256s (`pack` below fills them here). Each call,
# N = 0..5 in a row (the machine stays warm 30 s): bash .devcarry/rot8/s/rot8.sh N 5,
# carrying .devcarry/rot8/s and .devcarry/rot8/cN; the last with WAIT_MAX=90.
# Once SmolLM2 is whole, its 13 runs start in their own session (setsid) and go on
# while the Gemma-3 parts travel; the last call joins Gemma-3, checks its SHA-256,
# waits for SmolLM2's runs, then runs Gemma-3's and writes table.txt under $OUT.
set -u
K=/tmp/rot8; W=$K/w; mkdir -p $K $W
D=.devcarry/rot8; B=$K/infernix-perplexity
MAN=$K/ppl-v1/manifest.json
CHUNKS=${CHUNKS:-16}; RUN_LIMIT=${RUN_LIMIT:-30}
log() { echo "$(date -u +%H:%M:%S) $*" | tee -a $K/summary.txt; }
read SMOL_XZ_BYTES SMOL_SHA GEMMA_SHA < $D/s/sizes

# runs NAME MODEL: bf16 then every quantized format, rotation on and off.
runs() {
  local m=$1 model=$2 common
  common=(--corpus $MAN --quick --context 4096 --stride 2048 --chunks $CHUNKS --backend cuda --log-level warn)
  local t0=$SECONDS
  timeout $RUN_LIMIT $B $model "${common[@]}" --kv-dtype bf16 --save-top-tokens $W/$m-bf16.top --output $W/$m-bf16 > $W/$m-bf16.log 2>&1
  log "$m bf16 exit $? $((SECONDS - t0)) s"
  for x in int8 fp8 nvfp4 k8v4 k4v2 vq2; do
    for r in on off; do
      if [ -n "${DEADLINE:-}" ] && [ $SECONDS -gt $DEADLINE ]; then log "$m $x $r skipped (deadline)"; continue; fi
      t0=$SECONDS
      timeout $RUN_LIMIT $B $model "${common[@]}" --kv-dtype $x --kv-rotation $r --kl-reference $W/$m-bf16.top \
        --output $W/$m-$x-$r > $W/$m-$x-$r.log 2>&1
      log "$m $x $r exit $? $((SECONDS - t0)) s"
    done
  done
}

table() {
  python3 - "$W" <<'PY'
import json, os, sys
w = sys.argv[1]
print("| model | kv | rotation | K codec | V codec | PPL | mean KL ± se(clust) | p99 KL | top-1 % | dNLL ± se(clust) | tok/s processed | windows | scored |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for m in ["smol", "gemma"]:
    for name in ["bf16"] + [f"{x}-{r}" for x in ["int8", "fp8", "nvfp4", "k8v4", "k4v2", "vq2"] for r in ["on", "off"]]:
        p = os.path.join(w, f"{m}-{name}", "report.json")
        if not os.path.exists(p):
            print(f"| {m} | {name} | missing |"); continue
        try:
          r = json.load(open(p))
          e, o, t = r["execution"], r["results"]["overall"], r["timing"]
          kl = r["results"].get("kl_divergence") or {}
          q = kl.get("quantiles") or {}
          f = lambda v, n=5: "" if v is None else f"{v:.{n}f}"
          print(f"| {m} | {e['kv_format']} | {e.get('kv_rotation')} | {e['details'].get('kv_k_codec')} | {e['details'].get('kv_v_codec')} | "
                f"{o['perplexity']:.4f} | {f(kl.get('mean'))} ± {f(kl.get('mean_se_clustered'))} | {f(q.get('p99'), 4)} | "
                f"{f(100 * kl['top1_agreement'], 2) if 'top1_agreement' in kl else ''} | {f(kl.get('mean_nll_delta'))} ± {f(kl.get('mean_nll_delta_se_clustered'))} | "
                f"{t['tokens_per_second_processed']:.0f} | {o['n_windows']} | {o['scored_tokens']} |")
        except Exception as ex:
          print(f"| {m} | {name} | error {ex!r} |")
PY
}

finish() {
  table > $OUT/table.txt 2>&1; cat $OUT/table.txt
  cp $K/summary.txt $OUT/ 2>/dev/null
  (cd $W && tar czf $OUT/reports.tgz */report.json *.log 2>/dev/null)
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
}

[ "${1:-}" = lib ] && return 0
if [ "${1:-}" = pack ]; then
  # Here, not on the device: ROOT (the checkout the device tool sends), BIN (a release
  # infernix-perplexity built with cubins), SMOL and GEMMA (the .ninfer artifacts); six calls'
  # folders of at most PER bytes each (with the 9.2 MB tree: under 64 MiB).
  C=${ROOT:?ROOT}/$D; T=$(mktemp -d); rm -rf $C/c*; mkdir -p $C/s; cp "${BASH_SOURCE[0]}" $C/s/rot8.sh
  strip -o $T/bin $BIN && xz -T2 -6 -c $T/bin > $T/bin.xz
  xz -1 -T2 -c $SMOL > $T/smol.xz; xz -1 -T2 -c $GEMMA > $T/gemma.xz; cat $T/smol.xz $T/gemma.xz > $T/blob
  echo "$(stat -c %s $T/smol.xz) $(sha256sum < $SMOL | cut -d' ' -f1) $(sha256sum < $GEMMA | cut -d' ' -f1)" > $C/s/sizes
  PER=$(( ($(stat -c %s $T/blob) + $(stat -c %s $T/bin.xz) + 5) / 6 )); FIRST=$(( PER - $(stat -c %s $T/bin.xz) ))
  mkdir -p $C/c0; cp $T/bin.xz $C/c0/infernix-perplexity.xz; head -c $FIRST $T/blob > $C/c0/part
  tail -c +$((FIRST + 1)) $T/blob | split -b $PER -d -a 1 - $T/p.
  for n in 1 2 3 4 5; do mkdir -p $C/c$n; mv $T/p.$((n - 1)) $C/c$n/part; done
  cat $C/c*/part | cmp - $T/blob && rm -rf $T && echo "pack: six calls of at most $PER bytes"; exit
fi
N=$1; LAST=$2
[ -d $K/ppl-v1 ] || cp -a eval/corpora/ppl-v1 $K/ppl-v1
T0=$SECONDS
cat $D/c$N/part >> $K/blob && log "carry $N: blob now $(stat -c %s $K/blob) bytes"
if [ $N -eq 0 ]; then
  xz -dc $D/c0/infernix-perplexity.xz > $B && chmod +x $B
  log "binary: $($B --version)"
fi
if [ ! -f $K/smol.ninfer ] && [ $(stat -c %s $K/blob) -ge $SMOL_XZ_BYTES ]; then
  head -c $SMOL_XZ_BYTES $K/blob | xz -dc > $K/smol.ninfer
  echo "$SMOL_SHA  $K/smol.ninfer" | sha256sum -c 2>&1 | tee -a $K/summary.txt | grep -q OK || { log "SmolLM2 sha256 FAILED"; exit 1; }
  setsid nohup bash -c "source $D/s/rot8.sh lib; runs smol $K/smol.ninfer; touch $K/smol.done" > $K/smol.out 2>&1 < /dev/null &
  log "SmolLM2 runs started in the background"
fi
if [ $N -eq $LAST ]; then
  tail -c +$((SMOL_XZ_BYTES + 1)) $K/blob | xz -dc > $K/gemma.ninfer
  echo "$GEMMA_SHA  $K/gemma.ninfer" | sha256sum -c 2>&1 | tee -a $K/summary.txt | grep -q OK || { log "Gemma sha256 FAILED"; finish; exit 1; }
  while [ ! -f $K/smol.done ] && [ $((SECONDS - T0)) -lt ${WAIT_MAX:-150} ]; do sleep 1; done
  log "SmolLM2 done: $([ -f $K/smol.done ] && echo yes || echo no)"
  DEADLINE=$((T0 + ${GEMMA_SECONDS:-130})) runs gemma $K/gemma.ninfer
  finish
fi
