# shellcheck shell=bash
# The body of the Frontier profiles (scripts/frontier_gpt20b.sh, scripts/frontier_gpt10b.sh):
# each profile holds what is its model's own (the #SBATCH header, which sbatch reads from
# the profile itself, the model shape and learning rate) and sources this file, which sets
# the site's defaults and runs the launcher (scripts/launch/lbp_launch.sh). <profile> below
# stands for either script.
#
# The #SBATCH header of a profile (-A, -J, -N, -t, -p batch, -o/-e logs/, --network, --signal):
# -q debug for a <= 2 h test job; -p extended for <= 64 nodes and 24 h; -C nvme with
# LBP_SBCAST_ENV. --signal: Megatron's --exit-signal-handler saves and stops on it, the
# backstop of the computed exit time, which comes before it: Slurm may send it up to 60 s
# early, and the exit margin covers that (LBP_SIGNAL_S, read from the profile's line).
#
# Resubmitting the same profile resumes from the latest checkpoint in
# CHECKPOINT_DIR (--save and --load are the same directory, torch_dist format,
# resharded on load when the node count changes). A campaign of many jobs:
#   sbatch -A <proj> <profile> --chain 20
# runs this job and 19 more, each submitted by the previous one at its start
# (--dependency=afterany, the same account/partition/QOS/nodes/time limit); a job
# that finds training complete, or no progress since the previous job started (the
# tracker's iteration unchanged), does not train or resubmit and says why. Each job
# stops to save at its remaining wall time minus one save, one step and a slack
# (EXIT_DURATION_MINS=auto: a 30-minute debug job and a 24-hour extended one both end
# with a checkpoint); SAVE_INTERVAL=auto saves about every 45 minutes of training;
# the newest 2 complete checkpoints and the first after every 10000 iterations are
# kept, the rest deleted (LBP_KEEP_LAST, LBP_MILESTONE_EVERY), and a job refuses to
# start with less free space than two checkpoints. Before training, a health check
# (its own srun step) times one all-gather per link class against the cost model's
# bandwidth and refuses named slow nodes. Keep TRAIN_ITERS and the LR settings across
# resubmissions (Megatron checks the checkpoint's LR schedule;
# EXTRA_ARGS=--override-opt_param-scheduler to change it on purpose). Extra
# arguments (or EXTRA_ARGS) are appended to the training command line; the model flags
# among them (e.g. a Llama-style --swiglu --group-query-attention --num-query-groups 8
# --normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights)
# reach the memory and step-time estimate too (lbp_launch.sh: lbp_model_flags).
#
# At small size on CPU ranks (a one-machine Slurm, the tests): scripts/frontier_small.env
# holds the only values that differ (model and batch size, node and task counts, the
# device); every other setting stays the profile's.
#
# None of this has been run on Frontier by the authors: the module names, the
# RCCL/libfabric settings and the #SBATCH options are the conventions of OLCF's
# documentation and of ORNL's public launch scripts; every site value below is
# an environment variable, so override instead of editing.
#
# Environment variables (default in brackets):
#   Site
#     SBATCH_ACCOUNT   project (or sbatch -A); the profile's CHANGEME must be overridden
#     LBP_MODULES      [PrgEnv-gnu/8.7.0 cpe/26.03 miniforge3/23.11.0-0 rocm/7.1.1
#                       rccl-net-plugin craype-accel-amd-gfx90a]
#     LBP_ACTIVATE     script sourced for Python (conda/venv activate)
#                      [$LBP_REPO/.venv/bin/activate if present]
#     LBP_REPO         megatron-lbp checkout [the profile's repo, or $SLURM_SUBMIT_DIR]
#     MEGATRON_LM_DIR  patched Megatron-LM tree (scripts/apply_patches.sh <dir>); unset:
#                      python -m megatron_lbp.pretrain_gpt   [unset]
#     RCCL_NET_PLUGIN_DIR  aws-ofi-rccl lib dir: NCCL_NET_PLUGIN=<dir>/librccl-net.so
#                      [unset: the rccl-net-plugin module provides it]
#     RCCL/libfabric, as OLCF's "PyTorch on Frontier" page lists them (the page and
#     section of each value: scripts/launch/lbp_launch.sh, lbp_frontier_defaults):
#       NCCL_NET [OFI; Socket on one node] NCCL_CROSS_NIC [1] NCCL_NET_GDR_LEVEL [PHB]
#       NCCL_SOCKET_IFNAME [hsn0,hsn1,hsn2,hsn3; hsn0 if you see hangs]
#       HSA_FORCE_FINE_GRAIN_PCIE [1] FI_MR_CACHE_MONITOR [kdreg2]
#       FI_CXI_DISABLE_HOST_REGISTER [1] FI_CXI_DEFAULT_CQ_SIZE [131072]
#       FI_CXI_RDZV_PROTO [alt_read] FI_CXI_RDZV_EAGER_SIZE [0] FI_CXI_RDZV_THRESHOLD [0]
#       FI_CXI_RDZV_GET_MIN [0] FI_CXI_DEFAULT_TX_SIZE [2048] FI_CXI_RX_MATCH_MODE [hybrid]
#       OMP_NUM_THREADS [7]
#     Order: LBP_MODULES are loaded first, then these defaults are applied, and a
#     variable you exported wins over both; LD_LIBRARY_PATH gets the loaded
#     modules' CRAY_LD_LIBRARY_PATH first. CUDA_DEVICE_MAX_CONNECTIONS is not set
#     (data parallelism only; Megatron needs 1 only with tensor parallelism).
#     LBP_NODE_LOCAL_ROOT  node-local dir for the MIOpen and Triton caches, fresh per
#                      job and task [/tmp; /mnt/bb/$USER with -C nvme]
#     LBP_SBCAST_ENV   a conda-pack'd environment (.tar.gz) to sbcast to every node's
#                      NVMe (LBP_SBCAST_DIR [/mnt/bb/$USER]) and activate there [unset]
#     LBP_REQUIRE_GPU  [rocm]: the job refuses to start when torch is not a ROCm build
#                      (torch.version.hip) or sees no GCDs, instead of running on CPU
#     MASTER_ADDR [this node's IP]  MASTER_PORT [3442]
#   Paths (required)
#     DATA_PATH        data prefix(es) of .bin/.idx (a blend "w1 p1 w2 p2" works)
#     VOCAB_FILE MERGE_FILE  GPT-2 BPE files (TOKENIZER_TYPE [GPT2BPETokenizer]; for
#                      SentencePieceTokenizer/HuggingFaceTokenizer set TOKENIZER_MODEL)
#     CHECKPOINT_DIR   --save and --load
#   Job shape
#     NNODES [allocation's node count; dry run: the profile's #SBATCH -N]  TASKS_PER_NODE [8]  CPUS_PER_TASK [7]
#     GPUS_PER_TASK [1]  GPU_BIND [closest]  SRUN_EXTRA_ARGS []  GCD_MEMORY_GB [64]
#   Model and training
#     NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS [the profile's] SEQ_LENGTH [2048]
#     VOCAB_SIZE_PADDED [50304] GLOBAL_BATCH_SIZE [1536 = 3.1 M tokens]
#     MICRO_BATCH_SIZE [auto]  RECOMPUTE [auto; full, selective, none]: with HIER_PRESET,
#                    chosen by projected step time among what fits (see LBP_DRY_RUN below)
#     TRAIN_ITERS [150000] LR MIN_LR [the profile's] LR_WARMUP_ITERS [1500]
#     WEIGHT_DECAY [0.01] CLIP_GRAD [1.0] PRECISION [bf16]
#     LOG_INTERVAL [10] EVAL_INTERVAL [1000] EVAL_ITERS [10]
#     DATA_CACHE_PATH [$CHECKPOINT_DIR/data_cache] TENSORBOARD_DIR [$CHECKPOINT_DIR/tensorboard]
#   Campaign (the dry run prints every figure)
#     SAVE_INTERVAL [auto: ~LBP_SAVE_MINUTES=45 of training at the estimated step time,
#                    a divisor of LBP_MILESTONE_EVERY; LBP_STEP_SECONDS replaces the estimate]
#     EXIT_DURATION_MINS [auto: the job's time left (SLURM_JOB_END_TIME or squeue %L)
#                    minus one save (14 B/param at LBP_WRITE_GBPS=1 per node, x2, +
#                    LBP_SAVE_FIXED_S=60), one step and LBP_EXIT_SLACK_S=120, and at
#                    least the --signal lead (LBP_SIGNAL_S [150]) + 60 s + one step]
#     LBP_KEEP_LAST [2] LBP_MILESTONE_EVERY [10000] LBP_PRUNE_EVERY_S [600]
#     LBP_CHAIN_SBATCH_ARGS [] more sbatch options for the chain's next jobs
#     LBP_HEALTH_CHECK [1; 0: device checks only] LBP_HEALTH_MIN_FRACTION [0.25]
#     LBP_HEALTH_EXPECT_GBPS [package=200,node=50,network=12.5: the cost model's]
#     LBP_HEALTH_MB [64] GCD_MEMORY_GB [64] LBP_MEMORY_RESERVE_GB [4]
#   Hierarchy (--hier-partition --hier-preset HIER_PRESET)
#     HIER_PRESET [auto when neither it nor HIER_SECONDARY_GROUP_SIZE is given: the
#                 fastest fitting by projected step time of lbp (S = node, package, 0), zeropp,
#                 zero3, zero2. lbp: P = 2 (package), G = 8 (node), O = all; zeropp: P = G = O = all
#                 with the node's secondary copy (hpZ) and int8 weight gathers (qwZ); zero3, zero2,
#                 hsdp: no secondary copy]. Each preset implies its own defaults below.
#     HIER_SECONDARY_GROUP_SIZE [lbp, zeropp: TASKS_PER_NODE = 8, the node; zero3, zero2,
#                 hsdp: 0]  HIER_SECONDARY_DTYPE [int8]
#     HIER_PRESET=ds-zero3 | ds-hpz | ds-zeropp: DeepSpeed's ZeRO-3 / hpZ / ZeRO++ (hpZ + qwZ +
#                 qgZ) on the same model, data, tokenizer and batch: each task runs python -m
#                 megatron_lbp.deepspeed_baseline.pretrain (docs/deepspeed-baseline.md) instead of
#                 pretrain_gpt; the dry run prints its DeepSpeed config. Needs DeepSpeed in the
#                 Python env (bash scripts/install.sh --test); saves no checkpoint (no --chain,
#                 START_FROM, MEGATRON_LM_DIR); refuses HIER_SECONDARY_GROUP_SIZE /
#                 HIER_GRAD_REDUCE_DTYPE and --hier-* flags; ds-hpz, ds-zeropp need >= 2 nodes.
#   LBP_DRY_RUN=1 or --dry-run: print the srun and training commands, the parameter
#     count, the per-GCD memory of each recomputation/micro-batch choice, the step time,
#     save interval, checkpoint size, exit time for the #SBATCH -t (LBP_WALLTIME), the
#     retention and the free space, launch nothing. Every run ranks the candidates
#     (scheme x recomputation x micro-batch size at GLOBAL_BATCH_SIZE) by projected step
#     time — the engine's committed schedule trace replayed where one matches, the cost
#     model otherwise, each row says which — drops those that do not fit, takes the
#     fastest that the explicit HIER_PRESET / MICRO_BATCH_SIZE / RECOMPUTE allow, and
#     prints the top rows and the best zeropp and zero3 rows with their ratios
#     (megatron_lbp/launch/choose.py; LBP_CHOOSE=0: the old rule, no ranking).
#     LBP_LINKS=FILE: the step times from measured links (a job's health check writes
#     them to $CHECKPOINT_DIR/lbp_links.json; docs/frontier.md, "Measure, then choose").

: "${LBP_SITE:=frontier}"
: "${LBP_MODULES=PrgEnv-gnu/8.7.0 cpe/26.03 miniforge3/23.11.0-0 rocm/7.1.1 rccl-net-plugin craype-accel-amd-gfx90a}"
: "${SEQ_LENGTH:=2048}" "${VOCAB_SIZE_PADDED:=50304}" "${GLOBAL_BATCH_SIZE:=1536}"
: "${TRAIN_ITERS:=150000}" "${LR_WARMUP_ITERS:=1500}"
# The int8 secondary copy spans the node, whatever the node holds (8 GCDs on Frontier);
# a preset without one (zero3, zero2, hsdp) implies none: its own default, not this one.
# Neither HIER_PRESET nor HIER_SECONDARY_GROUP_SIZE given: the launcher chooses the scheme
# (and with RECOMPUTE/MICRO_BATCH_SIZE=auto those too) by projected step time.
[ -n "${HIER_PRESET:-}${HIER_SECONDARY_GROUP_SIZE:-}" ] || : "${LBP_CHOOSE_SCHEME:=1}"
: "${RECOMPUTE:=auto}"
case "${HIER_PRESET:-lbp}" in
  lbp|zeropp) : "${HIER_SECONDARY_GROUP_SIZE:=${TASKS_PER_NODE:-8}}" ;;
  *) : "${HIER_SECONDARY_GROUP_SIZE:=0}" ;;
esac
: "${HIER_SECONDARY_DTYPE:=int8}"

# shellcheck source-path=SCRIPTDIR source=lbp_launch.sh
. "$LBP_REPO/scripts/launch/lbp_launch.sh"
lbp_main "$@"
