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
# (what each line is for: scripts/launch/frontier_body.sh)
#
# GPT 10B (32 layers, hidden 5120, 40 heads, seq 2048, vocabulary 50257
# padded to 50304; 10.33 B parameters) pretrained with megatron-lbp's
# three-level hierarchy on Frontier, one task per GCD.
# This file holds what is this model's: the #SBATCH header above (sbatch reads it from
# the script it is given), the model shape, the learning rate and why S = 8. Every
# other setting, the campaign (--chain) and every variable with its default are the
# body both Frontier profiles share: scripts/launch/frontier_body.sh.
#
#   mkdir -p logs    # Slurm does not create the -o/-e directory
#   export DATA_PATH=/lustre/orion/<proj>/proj-shared/data/pile_text_document
#   export VOCAB_FILE=.../gpt2-vocab.json MERGE_FILE=.../gpt2-merges.txt
#   export CHECKPOINT_DIR=/lustre/orion/<proj>/scratch/$USER/gpt10b
#   NNODES=16 bash scripts/frontier_gpt10b.sh --dry-run   # check, on a login node
#   sbatch -A <proj> scripts/frontier_gpt10b.sh          # -N/-t/-q on the command line win
#   sbatch -A <proj> scripts/frontier_gpt10b.sh --chain 20   # a campaign: this job and 19 more
#
# This model's defaults (environment variables win):
#   NUM_LAYERS [32] HIDDEN_SIZE [5120] NUM_ATTENTION_HEADS [40] LR [1.2e-4] MIN_LR [1.2e-5]
#
# Why the int8 secondary copy over S = 8 (the node), as for 20B: from
# python -m megatron_lbp.plan for this model (GB per GCD, weights + int8
# secondary + fp32 gradient shard + fp32 Adam state, before activations):
#                 2 nodes (W=16)   8 nodes (W=64)   48 nodes (W=384)
#   S = 2             28.48            22.67             21.06
#   S = 8             24.54            18.74             17.12
# Both fit on 2 nodes with the plan's transient peak (8.4 GB there), the activations
# (full recomputation, micro-batch 1: 3.4 GB) and the 4 GB margin (44.3 and 40.3 GB);
# S = 8 keeps 4 GB more free
# per GCD for a larger MICRO_BATCH_SIZE, keeps the backward gather inside the
# node, and sends less on the package link per step (10.3 vs 15.6 GB) for more
# on the node links (53 vs 44 GB).
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
