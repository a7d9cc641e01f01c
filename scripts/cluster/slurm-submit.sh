#!/usr/bin/env bash
# Submits an N-shard run: the job array of slurm-shard.sh, then slurm-merge.sh
# once every array task succeeded (--dependency=afterok). Usage:
#   MODEL=/shared/m.ninfer RESULTS=/shared/run1 scripts/cluster/slurm-submit.sh N [FLAGS...]
set -euo pipefail
n="${1:?usage: slurm-submit.sh N [infernix-perplexity flags...]}"
shift
: "${MODEL:?set MODEL}" "${RESULTS:?set RESULTS}"
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$RESULTS"
array=$(sbatch --parsable --array="0-$((n - 1))" --export="ALL,N_SHARDS=$n" "$here/slurm-shard.sh" "$@")
sbatch --parsable --dependency="afterok:${array%%;*}" --export=ALL "$here/slurm-merge.sh"
