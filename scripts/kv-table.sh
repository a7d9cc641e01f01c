#!/usr/bin/env bash
# kv-table.sh: issue 11's per-format table for one real model on the H200
# (docs/kv-formats.md, "Measured on the H200: SmolLM2, every format"): the
# whole `--quick` corpus, sliding 4096/2048, default CUDA route; bf16 KV with
# --save-top-tokens, then every quantized format (its default rotation) with
# --kl-reference against it, then the extra runs listed in s/extra (one
# "NAME|ARGS" a line, e.g. a fast path forced off).
#
# The artifact does not fit one call (64 MiB a call with the tree), so it
# travels in parts over consecutive calls (the machine stays warm 30 s between
# them; /tmp/kvt holds what arrived):
#   here:   ROOT=$PWD BIN=target/release/infernix-perplexity MODEL=models/X.ninfer \
#           PARTS=3 scripts/kv-table.sh pack
#           writes .devcarry/kvt/s (this script, the binary, sizes) and
#           .devcarry/kvt/c0 .. c{PARTS-1} (the artifact's xz in parts)
#   device: bash .devcarry/kvt/s/kv-table.sh N LAST   (carry .devcarry/kvt/s and .devcarry/kvt/cN),
#           N = 0 .. LAST in a row; the last call joins the parts, checks the
#           SHA-256, runs everything and writes table.txt and reports.tgz under $OUT.
set -u
K=/tmp/kvt; W=$K/w; D=.devcarry/kvt; B=$K/infernix-perplexity; M=$K/model.ninfer
FORMATS=${FORMATS:-"int8 fp8 nvfp4 k8v4 k4v2 vq2"}
log() { echo "$(date -u +%H:%M:%S) $*" | tee -a $K/summary.txt; }

if [ "${1:-}" = pack ]; then
  C=${ROOT:?ROOT}/$D; T=$(mktemp -d); rm -rf $C; mkdir -p $C/s
  cp "${BASH_SOURCE[0]}" $C/s/kv-table.sh
  [ -f "${EXTRA:-}" ] && cp "$EXTRA" $C/s/extra
  strip -o $T/bin ${BIN:?BIN} && xz -T2 -6 -c $T/bin > $C/s/infernix-perplexity.xz
  xz -1 -T2 -c ${MODEL:?MODEL} > $T/model.xz
  echo "$(sha256sum < $MODEL | cut -d' ' -f1) $(basename $MODEL)" > $C/s/sizes
  split -n ${PARTS:-3} -d -a 1 $T/model.xz $T/p.
  for f in $T/p.*; do n=${f##*.}; mkdir -p $C/c$n; mv $f $C/c$n/part; done
  cat $C/c*/part | cmp - $T/model.xz && rm -rf $T && du -sh $C/* && echo "pack: ${PARTS:-3} calls"
  exit
fi

N=${1:?N}; LAST=${2:?LAST}
mkdir -p $K $W
[ $N -eq 0 ] && rm -f $K/blob
cat $D/c$N/part >> $K/blob && log "carry $N: $(stat -c %s $K/blob) bytes"
[ $N -lt $LAST ] && exit 0

read SHA NAME < $D/s/sizes
xz -dc $K/blob > $M && xz -dc $D/s/infernix-perplexity.xz > $B && chmod +x $B
echo "$SHA  $M" | sha256sum -c 2>&1 | tee -a $K/summary.txt | grep -q OK || { log "$NAME sha256 FAILED"; exit 1; }
log "$NAME: $($B --version); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
MAN=$K/ppl-v1/manifest.json; [ -d $K/ppl-v1 ] || cp -a eval/corpora/ppl-v1 $K/ppl-v1
run() {
  local name=$1; shift; local t0=$SECONDS
  timeout ${RUN_LIMIT:-60} $B $M --corpus $MAN --quick --backend ${BACKEND:-cuda} --log-level warn ${RUN_ARGS:-} "$@" --output $W/$name > $W/$name.log 2>&1
  log "$name exit $? $((SECONDS - t0)) s: $*"
}
run bf16 --kv-dtype bf16 --save-top-tokens $W/bf16.top
for x in $FORMATS; do run $x --kv-dtype $x --kl-reference $W/bf16.top; done
if [ -f $D/s/extra ]; then
  while IFS='|' read -r name args; do
    [ -n "$name" ] && run "$name" $args --kl-reference $W/bf16.top
  done < $D/s/extra
fi
python3 - "$W" $FORMATS $( [ -f $D/s/extra ] && cut -d'|' -f1 $D/s/extra ) > $OUT/table.txt <<'PY'
import json, os, sys
w, names = sys.argv[1], ["bf16"] + sys.argv[2:]
print("| run | kv | rotation (K / V codec) | fast paths | PPL | vs bf16 | mean KL ± se(clust) | p99 KL | top-1 % | tok/s processed | windows | scored |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
base = None
for n in names:
    p = os.path.join(w, n, "report.json")
    if not os.path.exists(p):
        print(f"| {n} | missing |"); continue
    r = json.load(open(p)); e, o, t = r["execution"], r["results"]["overall"], r["timing"]
    kl = r["results"].get("kl_divergence") or {}; q = kl.get("quantiles") or {}
    base = base or o["perplexity"]
    f = lambda v, d=5: "" if v is None else f"{v:.{d}f}"
    top1 = f(100 * kl["top1_agreement"], 2) if "top1_agreement" in kl else ""
    print(f"| {n} | {e['kv_format']} | {e.get('kv_rotation')} ({e['details'].get('kv_k_codec')} / {e['details'].get('kv_v_codec')}) | "
          f"{','.join(e.get('fast_paths') or []) or '-'} | {o['perplexity']:.4f} | {100 * (o['perplexity'] / base - 1):+.2f} % | "
          f"{f(kl.get('mean'))} ± {f(kl.get('mean_se_clustered'))} | {f(q.get('p99'), 4)} | {top1} | "
          f"{t['tokens_per_second_processed']:.0f} | {o['n_windows']} | {o['scored_tokens']} |")
PY
cat $OUT/table.txt
cp $K/summary.txt $OUT/
(cd $W && tar czf $OUT/reports.tgz */report.json *.log 2>/dev/null)
