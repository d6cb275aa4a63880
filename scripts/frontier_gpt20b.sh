#!/bin/bash
#SBATCH -A CHANGEME
#SBATCH -J lbp-gpt20b
#SBATCH -N 48
#SBATCH -t 02:00:00
#SBATCH -p batch
#SBATCH -o logs/%x-%j.out
#SBATCH -e logs/%x-%j.err
#SBATCH --network=disable_rdzv_get
#SBATCH --signal=TERM@150
# GPT 20B (GPT-NeoX-20B shape: 44 layers, hidden 6144, 64 heads, seq 2048, vocabulary
# 50257 padded to 50304; 20.24 B parameters) with megatron-lbp's three-level
# hierarchy on Frontier, one task per GCD: this model's values; the #SBATCH header, the
# values both profiles share (scripts/launch/frontier_body.sh), every variable and why
# S = 8: docs/frontier.md.
#
#   mkdir -p logs    # Slurm does not create the -o/-e directory
#   export DATA_PATH=... VOCAB_FILE=... MERGE_FILE=... CHECKPOINT_DIR=...
#   NNODES=48 bash scripts/frontier_gpt20b.sh --dry-run    # check, on a login node
#   sbatch -A <proj> scripts/frontier_gpt20b.sh [--chain 20] # -N/-t/-q on the command line win
set -euo pipefail
set -a   # every value below reaches the launcher (python -m megatron_lbp.launch job)
: "${LBP_REPO:=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
# sbatch runs a copy of this script: the checkout is then the directory it was submitted from
[ -f "$LBP_REPO/scripts/launch/lbp_launch.sh" ] || LBP_REPO=${SLURM_SUBMIT_DIR:-}
[ -f "$LBP_REPO/scripts/launch/lbp_launch.sh" ] || {
  echo "lbp_launch: error: cannot find the megatron-lbp checkout: set LBP_REPO" >&2; exit 2; }
: "${LBP_PROFILE:=frontier-gpt20b}" "${LBP_PROFILE_SCRIPT:=$LBP_REPO/scripts/frontier_gpt20b.sh}"
: "${NUM_LAYERS:=44}" "${HIDDEN_SIZE:=6144}" "${NUM_ATTENTION_HEADS:=64}"
: "${LR:=9.7e-5}" "${MIN_LR:=9.7e-6}"
set +a
# shellcheck source-path=SCRIPTDIR source=launch/frontier_body.sh
. "$LBP_REPO/scripts/launch/frontier_body.sh"
