#!/usr/bin/env bash
# long-context.sh: issue 11's long-context and rotation measurements on one GPU
# (docs/kv-formats.md, "Long context" and "Rotation"):
#   (b) Gemma-3-270M, `--context 65536 --stride 32768 --rope-yarn-factor 2` over every
#       window of the full corpus (eval/corpora/ppl-v1/manifest.json), bf16 then fp8
#       (fp8 with --kl-reference against the bf16 run): tok/s, report.json's device pool
#       peak and the nvidia-smi peak (memory.used, whole device, sampled every 100 ms).
#   (c) Gemma-3-270M, the --quick corpus, sliding 4096/2048: fp8 rotated (the table's
#       choice) and fp8 unrotated (a local build whose fp8 entry of KvFormat::k / v in
#       src/kv/mod.rs has rotate = false, never committed) against bf16 KV
#       (--save-top-tokens, then --kl-reference).
#   (d) the 8B-class synthetic body (`ninfer-convert TOK.gguf --synthetic llama-8b
#       --format Q4_0 --context-length 65536`), `--context 65536` bf16 and fp8 over the
#       first D8_CHUNKS windows of the corpus's wiki-test stream (wiki.test.raw): tok/s
#       and device memory (its random weights make PPL and KL meaningless).
#
# Inputs (environment): BIN (folder with infernix-perplexity, ninfer-convert and, for
# (c), infernix-unrot), GEMMA (gemma-3-270m-q4_k_m.ninfer), TOK (a GGUF with the
# SmolLM2 tokenizer, e.g. SmolLM2-135M-Instruct.Q4_1.gguf), K (scratch folder, default
# /tmp/long6), OUT (where summary.txt, table.txt and logs.tgz go), LIMIT (seconds the
# step may take, default 560), D8_CHUNKS (default 1; `all`: every window of the full corpus, no KL), CORES (taskset list, default 0-7);
# for plumbing checks only: SYNTH (the geometry of (d), default llama-8b), D_LIMIT (the
# background (d)'s LIMIT, default 400), D_CORES (its cores, default 8-15).
#
#   bash scripts/long-context.sh all     (b), (c) and (d) on a machine that has the models
#   bash scripts/long-context.sh b|c|d   one of them
#   bash scripts/long-context.sh 0       plumbing check on the CPU (tiny windows, SmolLM2
#                                        as GEMMA, --backend cpu), no GPU needed
#   ROOT=CHECKOUT bash scripts/long-context.sh pack   here: the five calls' folders below
#
# On the lent H200 (64 MiB per call with the tree, the machine kept only 30 s between
# calls) the inputs arrive in five consecutive calls from .devcarry/long6/ (ignored by
# git): s/ (this script as long.sh, gemma.sha256), c0/ (infernix-perplexity.xz,
# infernix-unrot.xz, ninfer-convert.xz, smollm2-tok.gguf, part: the first bytes of the
# Gemma-3 .ninfer), c1/ .. c4/ (part: the rest, in order). Each call runs
#   bash .devcarry/long6/s/long.sh carry N    (N = 0..4, carrying s and cN)
# carry 0 unpacks the binaries and starts (d) in its own session (setsid) on cores 8-15,
# so the 8B body is written and scored while the Gemma parts travel; carry 4 joins the
# parts, checks their SHA-256, waits for (d) to end and runs (c) then (b).
set -u
STEP=${1:?usage: long-context.sh all|b|c|d|0|carry N}
K=${K:-/tmp/long6}; W=$K/w; mkdir -p $K $W
BIN=${BIN:-$K/bin}; B=$BIN/infernix-perplexity; UNROT=$BIN/infernix-unrot
GEMMA=${GEMMA:-$K/gemma.ninfer}; TOK=${TOK:-$K/smollm2-tok.gguf}; SY=$K/synth8b.ninfer
OUT=${OUT:-$K/out}; mkdir -p $OUT
LIMIT=${LIMIT:-560}; T0=$SECONDS; CORES=${CORES:-0-7}; D8_CHUNKS=${D8_CHUNKS:-1}
MAN=eval/corpora/ppl-v1/manifest.json; WIKI=eval/corpora/ppl-v1/wikitext-2-raw/wiki.test.raw
D=.devcarry/long6
SUM=$W/summary.txt
export CUDA_CACHE_MAXSIZE=4294967296
left() { echo $((LIMIT - (SECONDS - T0))); }
log() { echo "$*" | tee -a $SUM; }

# run NAME BINARY MODEL ARGS...: one scoring run with a timeout of what is left; wall time and exit code to the summary.
run() {
  local name=$1 bin=$2 model=$3; shift 3
  local budget=$(( $(left) - 15 ))
  if [ $budget -lt 15 ]; then log "run $name skipped: $(left) s left"; return 1; fi
  rm -rf $W/$name
  local corpus=(--corpus $MAN); [[ " $* " == *" --text "* ]] && corpus=()
  local t0; t0=$(date +%s.%N)
  timeout -k 10 $budget taskset -c ${RUN_CORES:-$CORES} $bin $model "${corpus[@]}" "$@" --output $W/$name > $W/$name.table 2> $W/$name.log
  local rc=$?
  log "run $name rc=$rc wall=$(python3 -c "print(f'{$(date +%s.%N)-$t0:.1f}')")s args: $*"
  [ $rc -eq 0 ] || tail -3 $W/$name.log | cut -c1-300 | tee -a $SUM
  return $rc
}
# memrun NAME ...: run while nvidia-smi samples the device's memory.used every 100 ms; the peak to the summary.
memrun() {
  local name=$1 smi=""
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > $W/$name.mem 2> /dev/null &
    smi=$!
  fi
  run "$@"; local rc=$?
  if [ -n "$smi" ]; then
    kill $smi 2> /dev/null; wait $smi 2> /dev/null
    log "mem $name nvidia-smi peak memory.used $(sort -n $W/$name.mem | tail -1) MiB (whole device; first sample $(head -1 $W/$name.mem) MiB, $(wc -l < $W/$name.mem) samples)"
  fi
  return $rc
}

# (b) Gemma-3 at 65536/32768 over every window of the corpus, bf16 (saving its top tokens) then fp8.
b_runs() {
  local t0=$SECONDS
  memrun gem-full-bf16 $B $GEMMA --context 65536 --stride 32768 --rope-yarn-factor 2 --kv-dtype bf16 --save-top-tokens $W/gem-full-bf16.top
  [ -f $W/gem-full-bf16/report.json ] || return
  # fp8 ran at 45 % of bf16's rate here before: start the whole corpus only if 2.5x bf16's wall time is left,
  # else its first window of each stream (--chunks 1), so the call still ends inside its limit.
  local need=$(( (SECONDS - t0) * 5 / 2 + 20 ))
  if [ $(left) -gt $need ]; then
    memrun gem-full-fp8 $B $GEMMA --context 65536 --stride 32768 --rope-yarn-factor 2 --kv-dtype fp8 --kl-reference $W/gem-full-bf16.top
  else
    log "b: $(left) s left, fp8 over the whole corpus needs about $need s: first window of each stream only"
    memrun gem-first-fp8 $B $GEMMA --chunks 1 --context 65536 --stride 32768 --rope-yarn-factor 2 --kv-dtype fp8
  fi
  rm -f $W/gem-full-bf16.top
}
# (c) Gemma-3, --quick, sliding 4096/2048 (the default method): fp8 rotated and unrotated against bf16 KV.
c_runs() {
  run gem-q-bf16 $B $GEMMA --quick --kv-dtype bf16 --save-top-tokens $W/gem-q-bf16.top || return
  run gem-q-fp8rot $B $GEMMA --quick --kv-dtype fp8 --kl-reference $W/gem-q-bf16.top
  if [ -x $UNROT ]; then
    run gem-q-fp8unrot $UNROT $GEMMA --quick --kv-dtype fp8 --kl-reference $W/gem-q-bf16.top
  else
    log "c: no $UNROT, the unrotated fp8 run is not made"
  fi
}
# (d) the 8B-class body with a trained context of 65536 (native RoPE: no YaRN needed at 65536).
d_runs() {
  # Warm the driver's JIT cache (a build without sm_90a cubins compiles every module's PTX at its
  # first device open, about a minute) with a tiny model on the other cores while the body is written.
  # (smollm2-135m: qwen3moe-tiny's d_head 32 has no CUDA attention kernel; it compiled the modules, then stopped.)
  ( $BIN/ninfer-convert $TOK --synthetic smollm2-135m --out $K/tiny.ninfer > $W/warm.log 2>&1 &&
    taskset -c ${WARM_CORES:-0-7} $B $K/tiny.ninfer --text $WIKI --method chunks --context 64 --chunks 1 --kv-dtype fp8 --output $W/warm >> $W/warm.log 2>&1
    echo "warm rc=$? at $((SECONDS - T0)) s" >> $SUM ) &
  local warm=$!
  if [ ! -f $SY ]; then
    local t0=$SECONDS
    taskset -c ${RUN_CORES:-$CORES} $BIN/ninfer-convert $TOK --synthetic ${SYNTH:-llama-8b} --format Q4_0 --context-length 65536 --out $SY > $W/d8-convert.log 2>&1
    log "d8 convert rc=$? $((SECONDS - t0)) s: $(tail -1 $W/d8-convert.log | cut -c1-200)"
  fi
  wait $warm
  [ -f $SY ] || return
  if [ "$D8_CHUNKS" = all ]; then
    # Every window of the full corpus (the issue's long-context profile): speed and memory only (random
    # weights: no top-tokens file, whose KL would mean nothing and whose size grows with the corpus).
    memrun d8-bf16 $B $SY --context 65536 --stride 32768 --kv-dtype bf16 || return
    memrun d8-fp8 $B $SY --context 65536 --stride 32768 --kv-dtype fp8
    return
  fi
  memrun d8-bf16 $B $SY --text $WIKI --chunks $D8_CHUNKS --context 65536 --stride 32768 --kv-dtype bf16 --save-top-tokens $W/d8-bf16.top || return
  memrun d8-fp8 $B $SY --text $WIKI --chunks $D8_CHUNKS --context 65536 --stride 32768 --kv-dtype fp8 --kl-reference $W/d8-bf16.top
  rm -f $W/d8-bf16.top
}

# One line per report.json under $W (scripts/kv-proof-table.py's lines, plus device memory and the
# KV codecs): the figures docs/kv-formats.md quotes.
table() {
  python3 - $W/*/report.json << 'EOF'
import json, os, sys
for p in sys.argv[1:]:
    name = os.path.basename(os.path.dirname(p))
    try:
        r = json.load(open(p))
    except (OSError, ValueError) as e:  # a half-written report is worth a line
        print(f"{name:16} unreadable: {e}")
        continue
    res, t, e = r["results"], r["timing"], r["execution"]
    o = res["overall"] or {}
    kl = res.get("kl_divergence") or {}
    det = r.get("details") or e.get("details") or {}
    devs = (r.get("memory") or {}).get("devices") or []
    mem = " ".join(f"pool_peak={d.get('pool_used_peak_bytes', 0) / 2**20:.0f}MiB used_end={d.get('device_used_at_end_bytes', 0) / 2**20:.0f}MiB" for d in devs)
    ppl = o.get("perplexity")
    line = (f"{name:16} kv={e.get('kv_format')} yarn={e.get('rope_yarn_factor')} win={o.get('n_windows')} scored={o.get('scored_tokens')} "
            f"PPL={ppl if ppl is None else f'{ppl:.4f}'} nonfinite={o.get('n_nonfinite')} tok/s={t.get('tokens_per_second_processed') or 0:.0f} "
            f"proc={t.get('tokens_processed')} score_s={t.get('scoring_seconds') or 0:.1f} load_s={t.get('load_seconds') or 0:.1f} {mem}")
    codecs = [str(v) for k, v in sorted(det.items()) if "codec" in k] if isinstance(det, dict) else []
    if codecs:
        line += " codecs=" + ",".join(codecs)
    if isinstance(det, dict) and "kv_cache" in det:  # CUDA: "K (codec) stored by ..., V (codec) ..."
        line += " kv_cache=" + str(det["kv_cache"])[:60].replace(" ", "_")
    if kl:
        # The clustered standard errors are null for a single window.
        num = lambda v: float("nan") if v is None else v
        line += (f" KL={num(kl.get('mean')):.6f}+-{num(kl.get('mean_se_clustered')):.6f} p99={num((kl.get('quantiles') or {}).get('p99')):.4f} "
                 f"top1={100 * num(kl.get('top1_agreement')):.2f}% dNLL={num(kl.get('mean_nll_delta')):+.5f}"
                 f"+-{num(kl.get('mean_nll_delta_se_clustered')):.5f}")
    print(line)
EOF
}
finish() {
  log "step $STEP end $(date -u +%T) at $((SECONDS - T0)) s"
  table > $OUT/table.txt 2>&1
  cp $SUM $OUT/summary.txt
  (cd $W && tar czf $OUT/logs.tgz --exclude='*.top' --exclude='*.ninfer' --exclude='*.mem' . 2> /dev/null)
  tail -40 $OUT/table.txt
}

log "step $STEP ${2:-} start $(date -u +%T) $(nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader 2> /dev/null || echo no-gpu)"
case $STEP in
all) d_runs; c_runs; b_runs ;;
b) b_runs ;;
c) c_runs ;;
d) d_runs ;;
0)
  # Plumbing on the CPU: the same functions' commands, tiny windows, SmolLM2 standing in for Gemma.
  run t-bf16 $B $GEMMA --quick --chunks 1 --context 256 --stride 128 --backend cpu --kv-dtype bf16 --save-top-tokens $W/t.top
  memrun t-fp8 $B $GEMMA --quick --chunks 1 --context 256 --stride 128 --backend cpu --kv-dtype fp8 --kl-reference $W/t.top
  [ -x $UNROT ] && run t-fp8unrot $UNROT $GEMMA --quick --chunks 1 --context 256 --stride 128 --backend cpu --kv-dtype fp8 --kl-reference $W/t.top
  ;;
carry)
  N=${2:?carry N}
  cp $D/c$N/part $K/gemma.$N || log "carry $N: no part"
  if [ $N -eq 0 ]; then
    mkdir -p $BIN
    for f in infernix-perplexity infernix-unrot ninfer-convert; do xz -dc $D/c0/$f.xz > $BIN/$f && chmod +x $BIN/$f; done
    cp $D/c0/smollm2-tok.gguf $TOK
    log "binaries: $($B --version) / $($UNROT --version) / $($BIN/ninfer-convert --version)"
    # (d) in its own session on cores 8-15: it outlives this call, the machine stays warm between calls.
    setsid nohup env K=$K BIN=$BIN TOK=$TOK OUT=$K/out-d LIMIT=${D_LIMIT:-400} CORES=${D_CORES:-8-15} D8_CHUNKS=$D8_CHUNKS \
      bash $D/s/long.sh d > $K/d.out 2>&1 < /dev/null &
    echo $! > $K/d.pid
    log "d started in the background (pid $(cat $K/d.pid))"
  fi
  if [ $N -eq 4 ]; then
    cat $K/gemma.0 $K/gemma.1 $K/gemma.2 $K/gemma.3 $K/gemma.4 > $GEMMA && rm -f $K/gemma.[0-4]
    echo "$(cut -d' ' -f1 $D/s/gemma.sha256)  $GEMMA" | sha256sum -c 2>&1 | tee -a $SUM | grep -q OK || { log "Gemma sha256 FAILED"; finish; exit 1; }
    # (d) runs on this GPU too: wait for it so the timings below are alone.
    d_alive() { [ -f $K/d.pid ] && kill -0 $(cat $K/d.pid) 2> /dev/null; }
    while d_alive && [ $(left) -gt ${WAIT_FLOOR:-200} ]; do sleep 1; done
    log "d still running: $(d_alive && echo yes || echo no) at $((SECONDS - T0)) s"
    c_runs; b_runs
  fi
  ;;
pack)
  # Here, not on the device: fill ROOT/.devcarry/long6 (ROOT: the checkout the device tool sends) from
  # release builds in BIN (infernix-perplexity, infernix-unrot, ninfer-convert), TOK and GEMMA, each
  # call's folder (with s/) at most CALL_BYTES, the tree's own size left aside.
  ROOT=${ROOT:?ROOT}; C=$ROOT/$D; CALL_BYTES=${CALL_BYTES:-57000000}
  rm -rf $C; mkdir -p $C/s $C/c0 $C/c1 $C/c2 $C/c3 $C/c4
  cp "${BASH_SOURCE[0]}" $C/s/long.sh; sha256sum $GEMMA > $C/s/gemma.sha256
  for f in infernix-perplexity infernix-unrot ninfer-convert; do strip -o $K/$f.stripped $BIN/$f && xz -T2 -6 -c $K/$f.stripped > $C/c0/$f.xz; rm -f $K/$f.stripped; done
  cp $TOK $C/c0/smollm2-tok.gguf
  fixed=$(( $(du -cb $C/s $C/c0 | tail -1 | cut -f1) ))
  total=$(stat -c %s $GEMMA); first=$(( CALL_BYTES - fixed )); rest=$(( (total - first + 3) / 4 ))
  [ $rest -le $(( CALL_BYTES - $(du -cb $C/s | tail -1 | cut -f1) )) ] || { echo "pack: $GEMMA does not fit five calls" >&2; exit 2; }
  head -c $first $GEMMA > $C/c0/part
  tail -c +$(( first + 1 )) $GEMMA | split -b $rest -d -a 1 - $C/part.
  for n in 1 2 3 4; do mv $C/part.$((n - 1)) $C/c$n/part; done
  cat $C/c0/part $C/c1/part $C/c2/part $C/c3/part $C/c4/part | sha256sum | cut -d' ' -f1 | grep -q $(cut -d' ' -f1 $C/s/gemma.sha256) || { echo "pack: parts do not join to GEMMA" >&2; exit 2; }
  for n in 0 1 2 3 4; do echo "call $n: $(du -cb $C/s $C/c$n | tail -1 | cut -f1) bytes"; done
  exit 0
  ;;
*) echo "unknown step $STEP" >&2; exit 2 ;;
esac
finish
