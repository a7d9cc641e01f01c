#!/usr/bin/env bash
# Joins the shards of scripts/cluster/slurm-shard.sh into $RESULTS/merged
# (docs/cluster.md): run after the whole array, e.g.
#   sbatch --dependency=afterok:$ARRAY_JOB_ID --export=ALL,RESULTS=... slurm-merge.sh
# merge refuses a missing, repeated or foreign shard, naming it.
#SBATCH --job-name=infernix-merge
#SBATCH --nodes=1
#SBATCH --ntasks=1
set -euo pipefail
: "${RESULTS:?set RESULTS to the folder of the shards}"
exec "${INFERNIX_BIN:-infernix-perplexity}" merge "$RESULTS/merged" "$RESULTS"/shard-*
