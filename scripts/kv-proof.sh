#!/usr/bin/env bash
# kv-proof.sh: the device measurements of issue 11's proof and issue 15 item 4
# (docs/kv-formats.md, docs/report-extras.md), as run on the H200 on 2026-12-01.
#
# Prepared here (repository root of the checkout the device tool sends), in
# .devcarry/kvm/ (ignored by git; one folder per call, each under 64 MiB with the tree):
#   s/   this script as kvm.sh, scripts/kv-proof-table.py as table.py, and
#        models.sha256 (sha256sum of the SmolLM2 and the Gemma-3 .ninfer, in that order)
#   c1/  infernix-perplexity.xz (release build of this tree), infernix-old.xz (a build
#        from before fp8 rotated, for the rotation comparison), ninfer-convert.xz,
#        smollm2-tok.gguf (tokenizer-only GGUF for --synthetic), part.a (the first
#        43,000,000 bytes of SmolLM2-135M-Instruct.Q4_1.ninfer)
#   c2/  part.b (the rest of the SmolLM2 artifact)
#   g0/ .. g4/  part (gemma-3-270m-q4_k_m.ninfer in 5 parts: split -n 5 -d -a 1)
#   t/   gpu_ops.xz, gpu_e2e.xz (release test executables of this tree)
# On the device, step N carries s/ and the step's folder:
#   bash .devcarry/kvm/s/kvm.sh 1   (c1)  binaries and SmolLM2 part a; starts the 8B synthetic conversion
#   bash .devcarry/kvm/s/kvm.sh 2   (c2)  SmolLM2: fp8 rotated vs unrotated, prefill-chunk sweep,
#                                         invariance; starts the CPU --reference runs
#   bash .devcarry/kvm/s/kvm.sh 3-6 (g0-g3) Gemma parts; --reference on CUDA; 8B synthetic runs;
#                                         CUDA against the CPU --reference
#   bash .devcarry/kvm/s/kvm.sh 7 [full|lite] (g4) Gemma: per-format table, invariance, 65536 context
#   bash .devcarry/kvm/s/kvm.sh t   (t)   the parity tests (gpu_ops KV/attention subset, gpu_e2e tiny models)
#   bash .devcarry/kvm/s/kvm.sh 8         Gemma, every window of the corpus at 65536 (not run: device time)
# Consecutive calls must follow within the machine's 30 s idle release: /tmp/kvm2
# holds the binaries, parts and results between them. Step 0 checks the plumbing
# locally on the CPU (KVM_TMP=/tmp/x GPU_CORES=0-1 OUT=/tmp/y SMOL=MODEL bash kvm.sh 0).
set -u
STEP=$1
K=${KVM_TMP:-/tmp/kvm2}; W=$K/w; BIN=$K/bin; D=.devcarry/kvm
mkdir -p $K $W $BIN
B=$BIN/infernix-perplexity; OLD=$BIN/infernix-old
SM=$K/smollm2.ninfer; GM=$K/gemma.ninfer; SY=$K/synth8b.ninfer
MAN=eval/corpora/ppl-v1/manifest.json
SUM=$W/summary.txt
log() { echo "$*" | tee -a $SUM; }
# run NAME BINARY MODEL ARGS...: one scoring run on GPU-side cores 0-3; wall seconds and exit code to summary.
run() {
  local name=$1 bin=$2 model=$3; shift 3
  rm -rf $W/$name
  local t0; t0=$(date +%s.%N)
  local corpus=(--corpus $MAN); [[ " $* " == *" --text "* ]] && corpus=()
  taskset -c ${GPU_CORES:-0-3} $bin $model "${corpus[@]}" "$@" --output $W/$name > $W/$name.table 2> $W/$name.log
  local rc=$?
  log "run $name rc=$rc wall=$(python3 -c "print(f'{$(date +%s.%N)-$t0:.1f}')")s args: $*"
  [ $rc -eq 0 ] || tail -3 $W/$name.log | tee -a $SUM
}
# memrun NAME ...: run with nvidia-smi sampling device memory every 100 ms; peak to summary.
memrun() {
  local name=$1
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > $W/$name.mem 2>/dev/null &
  local smi=$!
  run "$@"
  kill $smi 2>/dev/null; wait $smi 2>/dev/null
  log "mem $name peak device memory used $(sort -n $W/$name.mem | tail -1) MiB (nvidia-smi, whole device, before: $(head -1 $W/$name.mem) MiB)"
}
# (d) the 8B-class body, once its conversion (started in step 1) is done: trained context 8192 in the
# synthetic geometry, so 65536 is refused (recorded); 32768 with YaRN 4, first 2 windows of wiki.test.raw.
synth_runs() {
  [ -f $W/synth-convert.rc ] && [ ! -d $W/synth-bf16 ] || { log "synth: convert rc=$(cat $W/synth-convert.rc 2>/dev/null || echo running)"; return; }
  log "synth convert rc=$(cat $W/synth-convert.rc) $(tail -1 $W/synth-convert.log) $(ls -la $SY 2>&1)"
  local T=eval/corpora/ppl-v1/wikitext-2-raw/wiki.test.raw
  rm -rf $W/synth-65536
  taskset -c ${GPU_CORES:-0-3} $B $SY --text $T --context 65536 --stride 32768 --rope-yarn-factor 4 --kv-dtype bf16 --output $W/synth-65536 > /dev/null 2> $W/synth-65536.log
  log "synth-65536 rc=$? $(tail -1 $W/synth-65536.log)"
  memrun synth-bf16 $B $SY --text $T --chunks 2 --context 32768 --stride 16384 --rope-yarn-factor 4 --kv-dtype bf16 --save-top-tokens $W/synth-bf16.top
  memrun synth-fp8 $B $SY --text $T --chunks 2 --context 32768 --stride 16384 --rope-yarn-factor 4 --kv-dtype fp8 --kl-reference $W/synth-bf16.top
}
finish() {
  log "step $STEP end $(date -u +%T)"
  (cd $W && tar czf $OUT/step$STEP.tgz --exclude='*.top' --exclude='*.ninfer' . 2>/dev/null)
  cp $SUM $OUT/summary.txt
  python3 $D/s/table.py $W > $OUT/table.txt 2>&1; cat $OUT/table.txt | tail -60
}
log "step $STEP start $(date -u +%T) $(nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader)"
case $STEP in
0)
  # Local check of the plumbing (GPU_CORES=0-1 OUT=... SM=model bash kvm.sh 0): two tiny CPU runs.
  SM=${SMOL:-$SM}
  run t-bf16 $B $SM --quick --chunks 1 --context 256 --stride 128 --backend cpu --kv-dtype bf16 --save-top-tokens $W/t.top
  memrun t-fp8 $B $SM --quick --chunks 1 --context 256 --stride 128 --backend cpu --kv-dtype fp8 --kl-reference $W/t.top
  run t-text $B $SM --text eval/corpora/ppl-v1/wikitext-2-raw/wiki.test.raw --chunks 1 --context 256 --backend cpu --kv-dtype fp8
  ;;
1)
  cp $D/c1/part.a $K/smol.a
  for f in infernix-perplexity infernix-old ninfer-convert; do xz -dc $D/c1/$f.xz > $BIN/$f && chmod +x $BIN/$f; done
  cp $D/c1/smollm2-tok.gguf $K/
  log "new: $($B --version) old: $($OLD --version)"
  # The 8B-class synthetic body, generated on cores 8-15 while later steps run (own session: it outlives this call).
  setsid nohup bash -c "taskset -c 8-15 $BIN/ninfer-convert $K/smollm2-tok.gguf --synthetic llama-8b --format Q4_0 --out $SY > $W/synth-convert.log 2>&1; echo \$? > $W/synth-convert.rc" > /dev/null 2>&1 < /dev/null &
  ;;
2)
  cat $K/smol.a $D/c2/part.b > $SM
  echo "$(head -1 $D/s/models.sha256 | cut -d' ' -f1)  $SM" | sha256sum -c 2>&1 | tee -a $SUM | grep -q OK || { log "SmolLM2 sha256 FAILED"; finish; exit 1; }
  # (b) the lossless route with each codec applied exactly, on the CPU backend (cores 4-15, its own session):
  # first window of each --quick stream; top tokens saved for the CUDA default route to compare against.
  for X in fp8 int8 nvfp4; do
    setsid nohup bash -c "taskset -c 4-15 $B $SM --corpus $MAN --quick --chunks 1 --backend cpu --threads 4 --reference --kv-dtype $X --save-top-tokens $W/smol-cpuref-$X.top --output $W/smol-cpuref-$X > $W/smol-cpuref-$X.table 2> $W/smol-cpuref-$X.log; echo \$? > $W/smol-cpuref-$X.rc" > /dev/null 2>&1 < /dev/null &
  done
  # 1. fp8 rotated (this branch) against unrotated (ef2cffb), KL against bf16 KV, full --quick, sliding 4096/2048.
  run smol-bf16 $B $SM --quick --kv-dtype bf16 --save-top-tokens $W/smol-bf16.top
  run smol-fp8rot $B $SM --quick --kv-dtype fp8 --kl-reference $W/smol-bf16.top
  run smol-fp8unrot $OLD $SM --quick --kv-dtype fp8 --kl-reference $W/smol-bf16.top
  # (c) prefill-chunk sensitivity, first 8 windows of each --quick stream, against one pass per window (4096).
  for X in bf16 fp8; do
    run smol-pc-$X-4096 $B $SM --quick --chunks 8 --kv-dtype $X --prefill-chunk 4096 --save-top-tokens $W/smol-pc-$X-4096.top
    for P in 256 512 2048; do run smol-pc-$X-$P $B $SM --quick --chunks 8 --kv-dtype $X --prefill-chunk $P --kl-reference $W/smol-pc-$X-4096.top; done
    # 1024 is the default chunk; (f) the batch-invariance self-check rides on it.
    run smol-pc-$X-1024 $B $SM --quick --chunks 8 --kv-dtype $X --prefill-chunk 1024 --verify-invariance 8 --kl-reference $W/smol-pc-$X-4096.top
  done
  ;;
3|4|5|6)
  cp $D/g$((STEP-3))/part $K/gemma.$((STEP-3))
  if [ $STEP -eq 3 ]; then
    # Does --reference run on CUDA? (expected: a one-line error, exit 2)
    run smol-ref-cuda $B $SM --quick --chunks 1 --backend cuda --reference --kv-dtype fp8
  fi
  synth_runs
  if [ $STEP -ge 4 ]; then
    for X in fp8 int8 nvfp4; do
      [ -f $W/smol-cpuref-$X.rc ] && [ ! -d $W/smol-cudavsref-$X ] && \
        run smol-cudavsref-$X $B $SM --quick --chunks 1 --kv-dtype $X --kl-reference $W/smol-cpuref-$X.top
    done
    log "cpu refs: $(for X in fp8 int8 nvfp4; do echo -n "$X=$(cat $W/smol-cpuref-$X.rc 2>/dev/null || echo running) "; done)"
  fi
  ;;
7)
  cat $K/gemma.0 $K/gemma.1 $K/gemma.2 $K/gemma.3 $D/g4/part > $GM
  echo "$(sed -n 2p $D/s/models.sha256 | cut -d' ' -f1)  $GM" | sha256sum -c 2>&1 | tee -a $SUM | grep -q OK || { log "Gemma sha256 FAILED"; finish; exit 1; }
  # (a) Gemma-3 per format, first 8 windows of each --quick stream, sliding 4096/2048.
  run gem-bf16 $B $GM --quick --chunks 8 --kv-dtype bf16 --save-top-tokens $W/gem-bf16.top
  for X in fp8 int8 nvfp4 k8v4 k4v2 vq2; do run gem-$X $B $GM --quick --chunks 8 --kv-dtype $X --kl-reference $W/gem-bf16.top; done
  run gem-lossless $B $GM --quick --chunks 8 --lossless --kl-reference $W/gem-bf16.top
  # (f) batch invariance on Gemma (default route, fp8).
  run gem-inv $B $GM --quick --chunks 8 --verify-invariance 8
  # (d) long context, YaRN 2: the full corpus (first window of each of the 21 streams), bf16 and fp8.
  memrun gem-long-bf16 $B $GM --chunks 1 --context 65536 --stride 32768 --rope-yarn-factor 2 --kv-dtype bf16 --save-top-tokens $W/gem-long-bf16.top
  memrun gem-long-fp8 $B $GM --chunks 1 --context 65536 --stride 32768 --rope-yarn-factor 2 --kv-dtype fp8 --kl-reference $W/gem-long-bf16.top
  if [ "${2:-full}" = full ]; then
    for X in int8 nvfp4 k8v4 k4v2 vq2; do
      memrun gem-long-$X $B $GM --chunks 1 --context 65536 --stride 32768 --rope-yarn-factor 2 --kv-dtype $X --kl-reference $W/gem-long-bf16.top
    done
  fi
  for X in fp8 int8 nvfp4; do
    [ -f $W/smol-cpuref-$X.rc ] && [ ! -d $W/smol-cudavsref-$X ] && \
      run smol-cudavsref-$X $B $SM --quick --chunks 1 --kv-dtype $X --kl-reference $W/smol-cpuref-$X.top
  done
  synth_runs
  ;;
t)
  # The parity tests of this branch (release test executables): the KV codecs and attention v2 with
  # fp8 now rotated, and the tiny models against the CPU emulation of each route.
  for f in gpu_ops gpu_e2e; do xz -dc $D/t/$f.xz > $BIN/$f && chmod +x $BIN/$f; done
  t0=$SECONDS
  timeout 75 taskset -c 0-15 $BIN/gpu_ops --test-threads=1 device_opens kv_encode attention_v2 v2_operand prefill_wave attention_prefill > $OUT/gpu_ops.log 2>&1; log "gpu_ops rc=$? $((SECONDS-t0))s"; cp $OUT/gpu_ops.log $W/
  t0=$SECONDS
  INFERNIX_DATA=eval/corpora/ppl-v1 INFERNIX_REFERENCE=tests/data/reference INFERNIX_E2E_GOLDEN=tests/data/gpu_e2e_cpu_golden.json \
    timeout 50 taskset -c 0-15 $BIN/gpu_e2e --test-threads=1 --nocapture tiny_models unsupported_shapes > $OUT/gpu_e2e.log 2>&1; log "gpu_e2e rc=$? $((SECONDS-t0))s"; cp $OUT/gpu_e2e.log $W/
  grep -hE '^(test |test result|failures:|thread .* panicked|KERNEL_FILE|DEVICE)' $W/gpu_ops.log $W/gpu_e2e.log | tee -a $SUM
  grep -h '^E2E tiny ' $W/gpu_e2e.log | tee -a $SUM
  ;;
8)
  # (d) the whole corpus at 65536/32768 (every window), bf16 and fp8, if device time remains.
  memrun gem-full-bf16 $B $GM --context 65536 --stride 32768 --rope-yarn-factor 2 --kv-dtype bf16 --save-top-tokens $W/gem-full-bf16.top
  memrun gem-full-fp8 $B $GM --context 65536 --stride 32768 --rope-yarn-factor 2 --kv-dtype fp8 --kl-reference $W/gem-full-bf16.top
  ;;
esac
finish
