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
# (what each line is for: scripts/launch/frontier_body.sh)
#
# GPT 20B (GPT-NeoX-20B shape: 44 layers, hidden 6144, 64 heads, seq 2048,
# vocabulary 50257 padded to 50304; 20.24 B parameters) pretrained with
# megatron-lbp's three-level hierarchy on Frontier, one task per GCD.
# This file holds what is this model's: the #SBATCH header above (sbatch reads it from
# the script it is given), the model shape, the learning rate and why S = 8. Every
# other setting, the campaign (--chain) and every variable with its default are the
# body both Frontier profiles share: scripts/launch/frontier_body.sh.
#
#   mkdir -p logs    # Slurm does not create the -o/-e directory
#   export DATA_PATH=/lustre/orion/<proj>/proj-shared/data/pile_text_document
#   export VOCAB_FILE=.../gpt2-vocab.json MERGE_FILE=.../gpt2-merges.txt
#   export CHECKPOINT_DIR=/lustre/orion/<proj>/scratch/$USER/gpt20b
#   NNODES=48 bash scripts/frontier_gpt20b.sh --dry-run   # check, on a login node
#   sbatch -A <proj> scripts/frontier_gpt20b.sh          # -N/-t/-q on the command line win
#   sbatch -A <proj> scripts/frontier_gpt20b.sh --chain 20   # a campaign: this job and 19 more
#
# This model's defaults (environment variables win):
#   NUM_LAYERS [44] HIDDEN_SIZE [6144] NUM_ATTENTION_HEADS [64] LR [9.7e-5] MIN_LR [9.7e-6]
#
# Why the int8 secondary copy over S = 8 (the node) and not S = 2 (the package),
# from python -m megatron_lbp.plan for this model (GB per GCD, weights + int8
# secondary + fp32 gradient shard + fp32 Adam state, before activations):
#                 2 nodes (W=16)   8 nodes (W=64)   48 nodes (W=384)
#   S = 2             55.83            44.44             41.28
#   S = 8             48.12            36.73             33.57
# The package-sized copy holds half of the bf16 weights again (10.3 GB); the
# node-sized one 1/8 in int8 (2.6 GB). The dry run adds the plan's transient peak
# (the engine's gathered units, gradient units and reductions in flight: 8.5 GB on
# 48 nodes, 11.8 GB on 3, where the step's 1/O gradients are larger), the
# activations (full recomputation, micro-batch 1: 4.5 GB) and the 4 GB allocator
# margin: with S = 8 the smallest job is 3 nodes (63.4 GB), with S = 2 about 21.
# Both keep the backward gather inside the node (Infinity Fabric); S = 8 sends less
# per step on the package link (20.2 vs 30.5 GB) and more on the node links (104 vs
# 86 GB), the paper's trade for the memory.
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
