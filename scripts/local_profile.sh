#!/bin/bash
#SBATCH -J lbp-local
#SBATCH -N 2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=8
#SBATCH -t 00:15:00
#SBATCH -o logs/%x-%j.out
#SBATCH -e logs/%x-%j.err
#
# The local profile of the Frontier launchers: the same launcher code
# (scripts/launch/lbp_launch.sh) as scripts/frontier_gpt20b.sh and
# scripts/frontier_gpt10b.sh, with a tiny GPT (2 layers, hidden 128) on CPU
# ranks (gloo), 2 nodes x 4 tasks, on the shipped tokenizer and demo data.
# For a one-machine Slurm (docs/local-slurm.md) and for tests:
#
#   mkdir -p logs && sbatch scripts/local_profile.sh [--chain N]
#   bash scripts/local_profile.sh --dry-run
#
# The demo data is built by `bash scripts/main.sh`, or by
#   .venv/bin/python -c 'from megatron_lbp.integration.data import build_demo_data; build_demo_data("data")'
#
# Every variable of the Frontier profiles (scripts/launch/frontier_body.sh) applies.
# What differs from the Frontier profiles, and why:
#   the model and job size   NUM_LAYERS [2] HIDDEN_SIZE [128] NUM_ATTENTION_HEADS [4]
#     SEQ_LENGTH [128] VOCAB_SIZE_PADDED [4096] MICRO_BATCH_SIZE [2]
#     GLOBAL_BATCH_SIZE [16] TRAIN_ITERS [20] LR [3e-3] MIN_LR [3e-4] LR_WARMUP_ITERS [2]
#     WEIGHT_DECAY [0.1] INIT_METHOD_STD [0.02] RECOMPUTE [none] LOG_INTERVAL [5]
#     EVAL_ITERS [0] TASKS_PER_NODE [4] CPUS_PER_TASK [1] HIER_SECONDARY_GROUP_SIZE [4]
#   paths                    DATA_PATH [$LBP_REPO/data/lbp_demo_text_document]
#     TOKENIZER_TYPE [SentencePieceTokenizer] TOKENIZER_MODEL [$LBP_REPO/tokenizer/lbp_bpe.model]
#     CHECKPOINT_DIR [$LBP_REPO/runs/local_profile/checkpoint]
#   the site: CPU ranks on fake GPUs
#     LBP_SITE [local: no Frontier network environment] LBP_MODULES [none]
#     GPUS_PER_TASK [1] GPU_BIND [map_gpu:4,5,2,3]: each task is bound to one of the
#       node's 8 fake GPUs (/dev/null gres) in Frontier's closest-binding order, so the
#       placement check runs; LBP_REQUIRE_GPU [none]: torch computes on CPU (gloo)
#     GCD_MEMORY_GB [4: per CPU rank] LBP_MEMORY_RESERVE_GB [0] MASTER_PORT [29533]
#     DIST_TIMEOUT_MINS [5]
#     LBP_STEP_SECONDS [1]: the cost model describes MI250X GCDs, not CPU ranks (an
#       iteration of this model takes 0.3-1 s on the 2-core test machine)
#     LBP_WRITE_GBPS [0.1] LBP_SAVE_FIXED_S [5] LBP_EXIT_SLACK_S [60]: eight ranks on two
#       cores take 10-30 s to end after the save, and the batch script has its last steps
#     SAVE_INTERVAL [20] LBP_MILESTONE_EVERY [0] LBP_PRUNE_EVERY_S [20]
#     LBP_HEALTH_EXPECT_GBPS [package=0.05,node=0.05,network=0.05] LBP_HEALTH_MIN_FRACTION
#       [0.02] LBP_HEALTH_MB [2]: gloo over loopback on a shared CPU (10-60 MB/s measured
#       with eight ranks on two busy cores): a floor of 1 MB/s that only a stalled link misses, not a
#       model (the cost model's figures are Frontier's links)
set -euo pipefail
set -a   # every value below reaches the launcher (python -m megatron_lbp.launch job)
: "${LBP_REPO:=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
# sbatch runs a copy of this script: the checkout is then the directory it was submitted from
[ -f "$LBP_REPO/scripts/launch/lbp_launch.sh" ] || LBP_REPO=${SLURM_SUBMIT_DIR:-}
[ -f "$LBP_REPO/scripts/launch/lbp_launch.sh" ] || {
  echo "lbp_launch: error: cannot find the megatron-lbp checkout: set LBP_REPO" >&2; exit 2; }

: "${LBP_PROFILE:=local-tiny-cpu}" "${LBP_SITE:=local}" "${LBP_MODULES=}"
: "${LBP_PROFILE_SCRIPT:=$LBP_REPO/scripts/local_profile.sh}"
: "${TASKS_PER_NODE:=4}" "${CPUS_PER_TASK:=1}" "${GPUS_PER_TASK:=1}" "${GPU_BIND:=map_gpu:4,5,2,3}"
: "${LBP_REQUIRE_GPU:=none}" "${MASTER_PORT:=29533}"
: "${DATA_PATH=$LBP_REPO/data/lbp_demo_text_document}" "${SPLIT:=98,2,0}"
: "${TOKENIZER_TYPE:=SentencePieceTokenizer}" "${TOKENIZER_MODEL=$LBP_REPO/tokenizer/lbp_bpe.model}"
: "${CHECKPOINT_DIR=$LBP_REPO/runs/local_profile/checkpoint}"
: "${NUM_LAYERS:=2}" "${HIDDEN_SIZE:=128}" "${NUM_ATTENTION_HEADS:=4}" "${SEQ_LENGTH:=128}"
: "${VOCAB_SIZE_PADDED:=4096}" "${MICRO_BATCH_SIZE:=2}" "${GLOBAL_BATCH_SIZE:=16}"
: "${TRAIN_ITERS:=20}" "${LR:=3e-3}" "${MIN_LR:=3e-4}" "${LR_WARMUP_ITERS:=2}"
: "${WEIGHT_DECAY:=0.1}" "${INIT_METHOD_STD:=0.02}" "${SAVE_INTERVAL:=20}" "${LOG_INTERVAL:=5}"
: "${EVAL_INTERVAL:=1000}" "${EVAL_ITERS:=0}" "${DIST_TIMEOUT_MINS:=5}" "${RECOMPUTE:=none}"
: "${HIER_SECONDARY_GROUP_SIZE:=4}" "${GCD_MEMORY_GB:=4}" "${LBP_MEMORY_RESERVE_GB:=0}"
: "${LBP_STEP_SECONDS:=1}" "${LBP_WRITE_GBPS:=0.1}" "${LBP_SAVE_FIXED_S:=5}" "${LBP_EXIT_SLACK_S:=60}"
: "${LBP_MILESTONE_EVERY:=0}" "${LBP_PRUNE_EVERY_S:=20}"
: "${LBP_HEALTH_EXPECT_GBPS:=package=0.05,node=0.05,network=0.05}" "${LBP_HEALTH_MIN_FRACTION:=0.02}"
: "${LBP_HEALTH_MB:=2}"

set +a
# shellcheck source-path=SCRIPTDIR source=launch/lbp_launch.sh
. "$LBP_REPO/scripts/launch/lbp_launch.sh"
lbp_main "$@"
