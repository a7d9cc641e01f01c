#!/usr/bin/env bash
# One shard of an infernix-perplexity run, as one task of a Slurm job array
# (docs/cluster.md). Submit with scripts/cluster/slurm-submit.sh, or:
#   sbatch --array=0-$((N-1)) --export=ALL,MODEL=...,RESULTS=...,N_SHARDS=N slurm-shard.sh [FLAGS...]
# Array task K scores shard K/N of the plan into $RESULTS/shard-K; FLAGS are
# passed to infernix-perplexity as they are (the same for every task).
#SBATCH --job-name=infernix-shard
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus-per-task=1
set -euo pipefail
: "${SLURM_ARRAY_TASK_ID:?run as a task of a Slurm job array (sbatch --array=0-N)}"
: "${MODEL:?set MODEL to the .ninfer artifact}"
: "${RESULTS:?set RESULTS to a folder every node sees}"
n_shards="${N_SHARDS:-${SLURM_ARRAY_TASK_COUNT:?set N_SHARDS}}"
exec "${INFERNIX_BIN:-infernix-perplexity}" "$MODEL" "$@" \
  --shard "$SLURM_ARRAY_TASK_ID/$n_shards" --output "$RESULTS/shard-$SLURM_ARRAY_TASK_ID"
