# shellcheck shell=bash
# The values both Frontier profiles share (scripts/frontier_gpt20b.sh, frontier_gpt10b.sh
# source this file after their model's own values); every variable, its default and what
# the launcher does with it: docs/frontier.md. Environment variables win over these.
# None of this has been run on Frontier by the authors: the module names and the #SBATCH
# options are the conventions of OLCF's documentation and of ORNL's public launch scripts.
set -a   # every value reaches python -m megatron_lbp.launch job
: "${LBP_SITE:=frontier}"
: "${LBP_MODULES=PrgEnv-gnu/8.7.0 cpe/26.03 miniforge3/23.11.0-0 rocm/7.1.1 rccl-net-plugin craype-accel-amd-gfx90a}"
: "${SEQ_LENGTH:=2048}" "${VOCAB_SIZE_PADDED:=50304}" "${GLOBAL_BATCH_SIZE:=1536}"
: "${TRAIN_ITERS:=150000}" "${LR_WARMUP_ITERS:=1500}" "${RECOMPUTE:=auto}"
set +a

# shellcheck source-path=SCRIPTDIR source=lbp_launch.sh
. "$LBP_REPO/scripts/launch/lbp_launch.sh"
lbp_main "$@"
