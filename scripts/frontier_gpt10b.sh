#!/bin/bash
#SBATCH -A CHANGEME
#SBATCH -J lbp-gpt10b
#SBATCH -N 16
#SBATCH -t 02:00:00
#SBATCH -p batch
#SBATCH -o logs/%x-%j.out
#SBATCH -e logs/%x-%j.err
#SBATCH --network=disable_rdzv_get
#SBATCH --signal=TERM@150
# GPT 10B (32 layers, hidden 5120, 40 heads, seq 2048, vocabulary 50257 padded to
# 50304; 10.33 B parameters) with megatron-lbp's three-level
# hierarchy on Frontier, one task per GCD: this model's values; the #SBATCH header, the
# values both profiles share (scripts/launch/frontier_body.sh), every variable and why
# S = 8: docs/frontier.md.
#
#   mkdir -p logs    # Slurm does not create the -o/-e directory
#   export DATA_PATH=... VOCAB_FILE=... MERGE_FILE=... CHECKPOINT_DIR=...
#   NNODES=16 bash scripts/frontier_gpt10b.sh --dry-run    # check, on a login node
#   sbatch -A <proj> scripts/frontier_gpt10b.sh [--chain 20] # -N/-t/-q on the command line win
set -euo pipefail
set -a   # every value below reaches the launcher (python -m megatron_lbp.launch job)
: "${LBP_REPO:=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
# sbatch runs a copy of this script: the checkout is then the directory it was submitted from
[ -f "$LBP_REPO/scripts/launch/lbp_launch.sh" ] || LBP_REPO=${SLURM_SUBMIT_DIR:-}
[ -f "$LBP_REPO/scripts/launch/lbp_launch.sh" ] || {
  echo "lbp_launch: error: cannot find the megatron-lbp checkout: set LBP_REPO" >&2; exit 2; }
: "${LBP_PROFILE:=frontier-gpt10b}" "${LBP_PROFILE_SCRIPT:=$LBP_REPO/scripts/frontier_gpt10b.sh}"
: "${NUM_LAYERS:=32}" "${HIDDEN_SIZE:=5120}" "${NUM_ATTENTION_HEADS:=40}"
: "${LR:=1.2e-4}" "${MIN_LR:=1.2e-5}"
set +a
# shellcheck source-path=SCRIPTDIR source=launch/frontier_body.sh
. "$LBP_REPO/scripts/launch/frontier_body.sh"
