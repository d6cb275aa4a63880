# shellcheck shell=bash
# The shared launcher logic of megatron-lbp: sourced by scripts/frontier_gpt20b.sh,
# scripts/frontier_gpt10b.sh and scripts/local_profile.sh, so that the Frontier
# scripts and the locally tested path are the same code.
#
# A profile script sets its defaults (model shape, batch, site environment)
# as `: "${VAR:=value}"`, sources this file and calls
#     lbp_main "$@"
# lbp_main validates the inputs, prints the resolved srun and training
# commands, the parameter count and the per-GCD memory of the plan tool for the
# node count, refuses to launch when it does not fit, and otherwise (not a dry
# run) runs srun, one task per GCD, each through scripts/launch/lbp_task.sh.
#
# Arguments of lbp_main: --dry-run (same as LBP_DRY_RUN=1); anything else,
# optionally after `--`, is appended to the training command line.
#
# Every stop before srun prints "lbp_launch: error: ..." naming what to set or
# run, and returns 2 (bad input) or 3 (does not fit in GCD memory).
#
# Variables read (profile scripts document their defaults):
#   LBP_REPO            megatron-lbp checkout (set by the profile script)
#   LBP_PROFILE         name printed in the summary
#   LBP_SITE            frontier (RCCL/libfabric/MIOpen environment) or local (CPU, gloo)
#   LBP_DRY_RUN         1: print everything, launch nothing
#   LBP_ACTIVATE        file sourced to get the Python env (venv/conda activate);
#                       default $LBP_REPO/.venv/bin/activate when it exists
#   LBP_PYTHON          interpreter (default: python)
#   LBP_MODULES         modules to `module load` (skipped when `module` is missing)
#   MEGATRON_LM_DIR     a Megatron-LM tree patched by scripts/apply_patches.sh:
#                       run its pretrain_gpt.py instead of python -m megatron_lbp.pretrain_gpt
#   NNODES              node count (default: the allocation's SLURM_JOB_NUM_NODES)
#   TASKS_PER_NODE      ranks per node, one per GCD (Frontier: 8)
#   GCDS_PER_PACKAGE    GCDs per package (MI250X: 2)
#   CPUS_PER_TASK       srun -c (Frontier: 7 = 56 usable cores / 8)
#   GPUS_PER_TASK       1: --gpus-per-task=1 --gpu-bind=$GPU_BIND; 0: CPU ranks
#   GPU_BIND            srun --gpu-bind value (Frontier: closest)
#   SRUN_EXTRA_ARGS     more srun options (word-split)
#   MASTER_ADDR, MASTER_PORT  rendezvous (default: this host's IP, 3442)
#   DATA_PATH           Megatron data prefix(es) (<prefix>.bin/.idx), or MOCK_DATA=1
#   TOKENIZER_TYPE      GPT2BPETokenizer (needs VOCAB_FILE, MERGE_FILE),
#                       SentencePieceTokenizer / HuggingFaceTokenizer (need TOKENIZER_MODEL:
#                       a .model file / a local save_pretrained directory), NullTokenizer;
#                       all built offline (megatron_lbp/tokenizer_check.py says what each needs)
#   VOCAB_SIZE_PADDED   Megatron's padded vocabulary (for the parameter count and memory)
#   CHECKPOINT_DIR      --save and --load (resume from the latest checkpoint there)
#   NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS SEQ_LENGTH FFN_HIDDEN_SIZE
#   MICRO_BATCH_SIZE GLOBAL_BATCH_SIZE TRAIN_ITERS LR MIN_LR LR_WARMUP_ITERS
#   WEIGHT_DECAY CLIP_GRAD SAVE_INTERVAL LOG_INTERVAL EVAL_INTERVAL EVAL_ITERS
#   EXIT_DURATION_MINS  save and exit before the wall-clock limit (0: off)
#   RECOMPUTE           full (default) or none: activation recomputation
#   PRECISION           bf16 (default) or fp32
#   HIER_PRESET HIER_SECONDARY_GROUP_SIZE HIER_SECONDARY_DTYPE  the hierarchy
#   GCD_MEMORY_GB       device memory limit for the fit check (Frontier GCD: 64)
#   EXTRA_ARGS          more training flags (word-split)

lbp_die() {  # lbp_die STATUS MESSAGE...
  local status=$1
  shift
  echo "lbp_launch: error: $*" >&2
  return "$status"
}

lbp_log() { echo "[lbp] $*"; }

lbp_is_uint() { [[ "${1:-}" =~ ^[0-9]+$ ]]; }

# Load modules, activate the Python environment. Missing `module` is not an
# error (laptops, CI); a missing LBP_ACTIVATE file is.
lbp_setup_python() {
  if [ -n "${LBP_MODULES:-}" ]; then
    if command -v module >/dev/null 2>&1 || declare -F module >/dev/null; then
      # shellcheck disable=SC2086  # a list of module names
      module load $LBP_MODULES || lbp_die 2 "module load $LBP_MODULES failed: set LBP_MODULES" || return
    else
      lbp_log "no 'module' command here: not loading LBP_MODULES=$LBP_MODULES"
    fi
  fi
  if [ -z "${LBP_ACTIVATE+x}" ] && [ -f "$LBP_REPO/.venv/bin/activate" ]; then
    LBP_ACTIVATE=$LBP_REPO/.venv/bin/activate
  fi
  if [ -n "${LBP_ACTIVATE:-}" ]; then
    [ -f "$LBP_ACTIVATE" ] || { lbp_die 2 "LBP_ACTIVATE=$LBP_ACTIVATE does not exist: set it to" \
      "your venv/conda activate script, or to an empty string to use the current python"; return; }
    set +u
    # shellcheck disable=SC1090
    . "$LBP_ACTIVATE"
    set -u
  fi
  LBP_PYTHON=${LBP_PYTHON:-python}
  command -v "$LBP_PYTHON" >/dev/null 2>&1 || lbp_die 2 "LBP_PYTHON=$LBP_PYTHON not found:" \
    "set LBP_ACTIVATE or LBP_PYTHON"
}

# Frontier's RCCL / libfabric / ROCm environment (frontier.md). Every value is
# a default: a variable already set in the environment wins.
lbp_frontier_env() {
  if [ "${NNODES_RESOLVED:-${NNODES:-2}}" -gt 1 ]; then
    # aws-ofi-rccl over Slingshot; the plugin does not initialise single-node.
    : "${NCCL_NET:=OFI}"
    export NCCL_NET
  fi
  : "${NCCL_SOCKET_IFNAME:=hsn0}" "${NCCL_CROSS_NIC:=1}" "${NCCL_NET_GDR_LEVEL:=3}"
  : "${FI_CXI_ATS:=0}" "${FI_MR_CACHE_MONITOR:=kdreg2}" "${FI_CXI_DISABLE_HOST_REGISTER:=1}"
  : "${FI_CXI_DEFAULT_CQ_SIZE:=131072}" "${FI_CXI_DEFAULT_TX_SIZE:=2048}"
  : "${FI_CXI_RX_MATCH_MODE:=hybrid}" "${FI_CXI_RDZV_PROTO:=alt_read}"
  : "${HSA_FORCE_FINE_GRAIN_PCIE:=1}" "${CUDA_DEVICE_MAX_CONNECTIONS:=1}"
  : "${OMP_NUM_THREADS:=${CPUS_PER_TASK:-7}}" "${LBP_MIOPEN_CACHE_ROOT:=/tmp}"
  export NCCL_SOCKET_IFNAME NCCL_CROSS_NIC NCCL_NET_GDR_LEVEL FI_CXI_ATS FI_MR_CACHE_MONITOR \
    FI_CXI_DISABLE_HOST_REGISTER FI_CXI_DEFAULT_CQ_SIZE FI_CXI_DEFAULT_TX_SIZE \
    FI_CXI_RX_MATCH_MODE FI_CXI_RDZV_PROTO HSA_FORCE_FINE_GRAIN_PCIE \
    CUDA_DEVICE_MAX_CONNECTIONS OMP_NUM_THREADS LBP_MIOPEN_CACHE_ROOT
  # Cray's libraries first; the RCCL network plugin if given as a directory.
  if [ -n "${CRAY_LD_LIBRARY_PATH:-}" ]; then
    export LD_LIBRARY_PATH=$CRAY_LD_LIBRARY_PATH:${LD_LIBRARY_PATH:-}
  fi
  if [ -n "${RCCL_NET_PLUGIN_DIR:-}" ]; then
    export LD_LIBRARY_PATH=$RCCL_NET_PLUGIN_DIR:${LD_LIBRARY_PATH:-}
  fi
  LBP_ENV_SHOWN="NCCL_NET NCCL_SOCKET_IFNAME NCCL_CROSS_NIC NCCL_NET_GDR_LEVEL FI_CXI_ATS
    FI_MR_CACHE_MONITOR FI_CXI_DISABLE_HOST_REGISTER FI_CXI_DEFAULT_CQ_SIZE
    FI_CXI_DEFAULT_TX_SIZE FI_CXI_RX_MATCH_MODE FI_CXI_RDZV_PROTO HSA_FORCE_FINE_GRAIN_PCIE
    CUDA_DEVICE_MAX_CONNECTIONS OMP_NUM_THREADS LBP_MIOPEN_CACHE_ROOT"
}

# The local profile: CPU ranks, gloo (megatron_lbp.pretrain_gpt adds the CPU flags).
lbp_local_env() {
  : "${OMP_NUM_THREADS:=1}" "${PYTHONWARNINGS:=ignore}"
  export OMP_NUM_THREADS PYTHONWARNINGS
  LBP_ENV_SHOWN="OMP_NUM_THREADS PYTHONWARNINGS"
}

lbp_resolve_nodes() {
  local n=${NNODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}}
  [ -n "$n" ] || { lbp_die 2 "node count unknown: submit with sbatch -N <nodes>, or set NNODES" \
    "(e.g. NNODES=48 LBP_DRY_RUN=1 bash $0)"; return; }
  if ! lbp_is_uint "$n" || [ "$n" -lt 1 ]; then
    lbp_die 2 "NNODES=$n is not a node count >= 1"
    return
  fi
  if [ -n "${SLURM_JOB_NUM_NODES:-}" ] && [ "$n" -gt "$SLURM_JOB_NUM_NODES" ]; then
    lbp_die 2 "NNODES=$n but this allocation has $SLURM_JOB_NUM_NODES node(s):" \
      "unset NNODES or submit with sbatch -N $n"
    return
  fi
  NNODES_RESOLVED=$n
}

# Node counts / batch sizes / group sizes that fit the hierarchy.
lbp_check_hierarchy() {
  local n=$NNODES_RESOLVED t=$TASKS_PER_NODE pk=$GCDS_PER_PACKAGE s=$HIER_SECONDARY_GROUP_SIZE
  local v
  for v in TASKS_PER_NODE GCDS_PER_PACKAGE MICRO_BATCH_SIZE GLOBAL_BATCH_SIZE; do
    if ! lbp_is_uint "${!v}" || [ "${!v}" -lt 1 ]; then
      lbp_die 2 "$v=${!v} must be an integer >= 1"
      return
    fi
  done
  lbp_is_uint "$s" || { lbp_die 2 "HIER_SECONDARY_GROUP_SIZE=$s must be 0 (off) or a group size"; return; }
  if [ $((t % pk)) -ne 0 ]; then
    lbp_die 2 "GCDS_PER_PACKAGE=$pk must divide TASKS_PER_NODE=$t (a node holds whole packages)"
    return
  fi
  if [ "$s" -gt 0 ] && { [ $((t % s)) -ne 0 ] || [ $((s % pk)) -ne 0 ]; }; then
    lbp_die 2 "HIER_SECONDARY_GROUP_SIZE=$s must be a multiple of GCDS_PER_PACKAGE=$pk that" \
      "divides TASKS_PER_NODE=$t (the secondary copy is gathered inside one node): set it to" \
      "$t (node) or $pk (package), or 0 (off)"
    return
  fi
  WORLD=$((n * t))
  local per_step=$((MICRO_BATCH_SIZE * WORLD))
  if [ $((GLOBAL_BATCH_SIZE % per_step)) -ne 0 ]; then
    local ok="" k
    for k in $(seq 1 512); do
      [ $((GLOBAL_BATCH_SIZE % (MICRO_BATCH_SIZE * t * k))) -eq 0 ] && ok="$ok $k"
    done
    lbp_die 2 "$n node(s) x $t tasks = $WORLD data-parallel ranks do not fit" \
      "GLOBAL_BATCH_SIZE=$GLOBAL_BATCH_SIZE with MICRO_BATCH_SIZE=$MICRO_BATCH_SIZE (needs a" \
      "multiple of $per_step): use NNODES in {${ok# }} or set GLOBAL_BATCH_SIZE to a multiple" \
      "of $per_step"
    return
  fi
}

# Required paths exist (stops before srun with what to set).
lbp_check_paths() {
  if [ "${MOCK_DATA:-0}" != 1 ]; then
    [ -n "${DATA_PATH:-}" ] || { lbp_die 2 "DATA_PATH is not set: export DATA_PATH=<prefix of" \
      "the .bin/.idx files made by tools/preprocess_data.py> (or MOCK_DATA=1 for synthetic data)"; return; }
    local w
    for w in $DATA_PATH; do
      [[ "$w" =~ ^[0-9.eE+-]+$ ]] && continue  # a blend weight
      if [ ! -f "$w.bin" ] || [ ! -f "$w.idx" ]; then
        lbp_die 2 "DATA_PATH: $w.bin / $w.idx not found: set DATA_PATH to an existing data" \
          "prefix (scripts/preprocess_data.py makes them)"
        return
      fi
    done
  fi
  case "$TOKENIZER_TYPE" in
    GPT2BPETokenizer)
      for w in VOCAB_FILE MERGE_FILE; do
        [ -n "${!w:-}" ] || { lbp_die 2 "$w is not set (TOKENIZER_TYPE=GPT2BPETokenizer needs" \
          "VOCAB_FILE=gpt2-vocab.json and MERGE_FILE=gpt2-merges.txt)"; return; }
        [ -f "${!w}" ] || { lbp_die 2 "$w=${!w} does not exist: set $w"; return; }
      done ;;
    NullTokenizer) ;;
    *)
      [ -n "${TOKENIZER_MODEL:-}" ] || { lbp_die 2 "TOKENIZER_MODEL is not set" \
        "(TOKENIZER_TYPE=$TOKENIZER_TYPE needs it)"; return; }
      if [ "$TOKENIZER_TYPE" = HuggingFaceTokenizer ] && [ ! -d "$TOKENIZER_MODEL" ]; then
        lbp_die 2 "TOKENIZER_MODEL=$TOKENIZER_MODEL is not a local directory: a hub name cannot be" \
          "fetched on compute nodes; save_pretrained the tokenizer to a directory where there is" \
          "network and set TOKENIZER_MODEL to it"
        return
      fi
      [ -e "$TOKENIZER_MODEL" ] || { lbp_die 2 "TOKENIZER_MODEL=$TOKENIZER_MODEL does not exist:" \
        "set TOKENIZER_MODEL"; return; } ;;
  esac
  [ -n "${CHECKPOINT_DIR:-}" ] || { lbp_die 2 "CHECKPOINT_DIR is not set: export" \
    "CHECKPOINT_DIR=<directory for --save/--load> (a rerun resumes from it)"; return; }
}

# Training entry: megatron_lbp (default) or a patched Megatron-LM tree.
lbp_resolve_entry() {
  if [ -z "${MEGATRON_LM_DIR:-}" ]; then
    ENTRY=("$LBP_PYTHON" -u -m megatron_lbp.pretrain_gpt)
    ENTRY_DESC="python -m megatron_lbp.pretrain_gpt (megatron-core from the Python env)"
    return
  fi
  [ -f "$MEGATRON_LM_DIR/pretrain_gpt.py" ] || { lbp_die 2 "MEGATRON_LM_DIR=$MEGATRON_LM_DIR has" \
    "no pretrain_gpt.py: set it to a Megatron-LM checkout (core_v0.19.0), or unset it to use" \
    "python -m megatron_lbp.pretrain_gpt"; return; }
  local patched=0
  if [ -f "$LBP_REPO/scripts/apply_patches.sh" ]; then
    bash "$LBP_REPO/scripts/apply_patches.sh" --check "$MEGATRON_LM_DIR" >/dev/null 2>&1 && patched=1
  else
    # Fallback while scripts/apply_patches.sh is absent: the patched tree names megatron_lbp.
    grep -q megatron_lbp "$MEGATRON_LM_DIR/megatron/training/arguments.py" 2>/dev/null && patched=1
  fi
  [ "$patched" = 1 ] || { lbp_die 2 "MEGATRON_LM_DIR=$MEGATRON_LM_DIR is not patched for" \
    "megatron-lbp: run bash $LBP_REPO/scripts/apply_patches.sh $MEGATRON_LM_DIR" \
    "(or unset MEGATRON_LM_DIR to use python -m megatron_lbp.pretrain_gpt)"; return; }
  export PYTHONPATH=$MEGATRON_LM_DIR:$LBP_REPO${PYTHONPATH:+:$PYTHONPATH}
  ENTRY=("$LBP_PYTHON" -u "$MEGATRON_LM_DIR/pretrain_gpt.py")
  ENTRY_DESC="$MEGATRON_LM_DIR/pretrain_gpt.py (patched Megatron-LM tree)"
}

lbp_build_commands() {
  local tok=(--tokenizer-type "$TOKENIZER_TYPE")
  case "$TOKENIZER_TYPE" in
    GPT2BPETokenizer) tok+=(--vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE") ;;
    NullTokenizer) tok+=(--vocab-size "$VOCAB_SIZE_PADDED") ;;
    *) tok+=(--tokenizer-model "$TOKENIZER_MODEL") ;;
  esac
  local data
  if [ "${MOCK_DATA:-0}" = 1 ]; then data=(--mock-data)
  else
    # shellcheck disable=SC2206  # DATA_PATH may be a blend "w1 p1 w2 p2"
    data=(--data-path $DATA_PATH --split "$SPLIT")
  fi
  TRAIN_ARGS=(
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE"
    --num-attention-heads "$NUM_ATTENTION_HEADS"
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type rope
    --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
    --train-iters "$TRAIN_ITERS"
    --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-iters "$LR_WARMUP_ITERS"
    --weight-decay "$WEIGHT_DECAY" --clip-grad "$CLIP_GRAD"
    --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std "$INIT_METHOD_STD"
    --attention-dropout 0.0 --hidden-dropout 0.0
    "${data[@]}" "${tok[@]}"
    --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --ckpt-format torch_dist
    --save-interval "$SAVE_INTERVAL"
    --log-interval "$LOG_INTERVAL" --log-throughput
    --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
    --distributed-timeout-minutes "$DIST_TIMEOUT_MINS"
    --hier-partition --hier-preset "$HIER_PRESET"
    --hier-gpus-per-node "$TASKS_PER_NODE" --hier-gcds-per-package "$GCDS_PER_PACKAGE"
    --hier-secondary-group-size "$HIER_SECONDARY_GROUP_SIZE"
  )
  [ "$HIER_SECONDARY_GROUP_SIZE" -gt 0 ] && TRAIN_ARGS+=(--hier-secondary-dtype "$HIER_SECONDARY_DTYPE")
  [ "$PRECISION" = bf16 ] && TRAIN_ARGS+=(--bf16)
  [ "$RECOMPUTE" = full ] && TRAIN_ARGS+=(--recompute-granularity full --recompute-method uniform
                                          --recompute-num-layers 1)
  [ -n "$FFN_HIDDEN_SIZE" ] && TRAIN_ARGS+=(--ffn-hidden-size "$FFN_HIDDEN_SIZE")
  [ "${EXIT_DURATION_MINS:-0}" != 0 ] && TRAIN_ARGS+=(--exit-duration-in-mins "$EXIT_DURATION_MINS")
  if [ -n "${EXTRA_ARGS:-}" ]; then
    # shellcheck disable=SC2206  # a list of flags
    TRAIN_ARGS+=($EXTRA_ARGS)
  fi
  TRAIN_ARGS+=("${LBP_CLI_EXTRA[@]}")

  SRUN=(srun -N "$NNODES_RESOLVED" -n "$WORLD" --ntasks-per-node="$TASKS_PER_NODE"
        -c "$CPUS_PER_TASK" --kill-on-bad-exit=1 --export=ALL)
  if [ "$GPUS_PER_TASK" -gt 0 ]; then
    SRUN+=(--gpus-per-task="$GPUS_PER_TASK" --gpu-bind="$GPU_BIND")
  fi
  if [ -n "${SRUN_EXTRA_ARGS:-}" ]; then
    # shellcheck disable=SC2206  # a list of srun options
    SRUN+=($SRUN_EXTRA_ARGS)
  fi
  SRUN+=(bash "$LBP_REPO/scripts/launch/lbp_task.sh")
}

lbp_quote() {  # words as one shell line, quoting only those that need it
  local w out=""
  for w in "$@"; do
    if [[ "$w" =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]]; then out="$out $w"
    else out="$out $(printf '%q' "$w")"; fi
  done
  echo "${out# }"
}

lbp_print_commands() {
  local v line=""
  lbp_log "profile: ${LBP_PROFILE:-custom}: $NNODES_RESOLVED node(s) x $TASKS_PER_NODE tasks" \
    "= $WORLD ranks (one per GCD), $GCDS_PER_PACKAGE GCDs per package"
  lbp_log "entry: $ENTRY_DESC"
  lbp_log "rendezvous: MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT (ranks from SLURM_PROCID" \
    "per task, scripts/launch/lbp_task.sh)"
  for v in ${LBP_ENV_SHOWN:-}; do
    [ -n "${!v+x}" ] && line="$line $v=${!v}"
  done
  lbp_log "environment:${line}"
  echo "[lbp] srun command:"
  echo "  $(lbp_quote "${SRUN[@]}") \\"
  echo "    $(lbp_quote "${ENTRY[@]}" "${TRAIN_ARGS[@]}")"
  echo "[lbp] training command (each task):"
  echo "  $(lbp_quote "${ENTRY[@]}" "${TRAIN_ARGS[@]}")"
}

lbp_check_memory() {
  local args=(--nodes "$NNODES_RESOLVED" --tasks-per-node "$TASKS_PER_NODE"
              --gcds-per-package "$GCDS_PER_PACKAGE" --preset "$HIER_PRESET"
              --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE"
              --num-attention-heads "$NUM_ATTENTION_HEADS" --seq-length "$SEQ_LENGTH"
              --vocab-size "$VOCAB_SIZE_PADDED" --micro-batch-size "$MICRO_BATCH_SIZE"
              --hier-secondary-group-size "$HIER_SECONDARY_GROUP_SIZE"
              --hier-secondary-dtype "$HIER_SECONDARY_DTYPE" --recompute "$RECOMPUTE"
              --params-dtype "$PRECISION" --gcd-memory-gb "$GCD_MEMORY_GB")
  [ -n "$FFN_HIDDEN_SIZE" ] && args+=(--ffn-hidden-size "$FFN_HIDDEN_SIZE")
  "$LBP_PYTHON" "$LBP_REPO/scripts/launch/lbp_check.py" "${args[@]}" | sed 's/^/[lbp] /'
  local status=${PIPESTATUS[0]}
  [ "$status" = 0 ] || return "$status"
}

lbp_defaults() {
  : "${LBP_DRY_RUN:=0}" "${TASKS_PER_NODE:=8}" "${GCDS_PER_PACKAGE:=2}" "${CPUS_PER_TASK:=7}"
  : "${GPUS_PER_TASK:=1}" "${GPU_BIND:=closest}" "${MASTER_PORT:=3442}"
  : "${TOKENIZER_TYPE:=GPT2BPETokenizer}" "${VOCAB_SIZE_PADDED:=50304}" "${SPLIT:=949,50,1}"
  : "${FFN_HIDDEN_SIZE:=}" "${MICRO_BATCH_SIZE:=1}" "${TRAIN_ITERS:=150000}"
  : "${LR_WARMUP_ITERS:=1500}" "${WEIGHT_DECAY:=0.01}" "${CLIP_GRAD:=1.0}"
  : "${INIT_METHOD_STD:=0.01}" "${SAVE_INTERVAL:=500}" "${LOG_INTERVAL:=10}"
  : "${EVAL_INTERVAL:=1000}" "${EVAL_ITERS:=10}" "${DIST_TIMEOUT_MINS:=30}"
  : "${EXIT_DURATION_MINS:=0}" "${RECOMPUTE:=full}" "${PRECISION:=bf16}"
  : "${HIER_PRESET:=lbp}" "${HIER_SECONDARY_GROUP_SIZE:=$TASKS_PER_NODE}"
  : "${HIER_SECONDARY_DTYPE:=int8}" "${GCD_MEMORY_GB:=64}"
  local v
  for v in NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS SEQ_LENGTH GLOBAL_BATCH_SIZE LR MIN_LR; do
    [ -n "${!v:-}" ] || { lbp_die 2 "$v is not set (the profile script sets it)"; return; }
  done
  case "$RECOMPUTE" in full|none) ;; *) lbp_die 2 "RECOMPUTE=$RECOMPUTE: use full or none"; return ;; esac
  case "$PRECISION" in bf16|fp32) ;; *) lbp_die 2 "PRECISION=$PRECISION: use bf16 or fp32"; return ;; esac
  lbp_is_uint "$GPUS_PER_TASK" || { lbp_die 2 "GPUS_PER_TASK=$GPUS_PER_TASK: use 1 (GCD) or 0 (CPU)"; return; }
}

lbp_master_addr() {
  if [ -z "${MASTER_ADDR:-}" ]; then
    # The batch script runs on the allocation's first node; its IP works for
    # real and for emulated (unresolvable) node names alike.
    MASTER_ADDR=$(hostname -i 2>/dev/null | awk '{print $1}')
    [ -n "$MASTER_ADDR" ] || MASTER_ADDR=$(hostname)
  fi
  export MASTER_ADDR MASTER_PORT
}

# lbp_main [--dry-run] [--] [extra training flags...]
lbp_main() {
  LBP_CLI_EXTRA=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --dry-run) LBP_DRY_RUN=1 ;;
      --) shift; LBP_CLI_EXTRA+=("$@"); break ;;
      *) LBP_CLI_EXTRA+=("$1") ;;
    esac
    shift
  done
  lbp_defaults || return
  lbp_resolve_nodes || return
  lbp_check_hierarchy || return
  lbp_check_paths || return
  case "${LBP_SITE:-frontier}" in
    frontier) lbp_frontier_env ;;
    local) lbp_local_env ;;
    *) lbp_die 2 "LBP_SITE=$LBP_SITE: use frontier or local"; return ;;
  esac
  lbp_setup_python || return
  lbp_resolve_entry || return
  lbp_master_addr
  lbp_build_commands
  lbp_print_commands
  lbp_check_memory || return
  if [ "$LBP_DRY_RUN" = 1 ]; then
    lbp_log "dry run: not launching (unset LBP_DRY_RUN / drop --dry-run to run srun)"
    return 0
  fi
  [ -n "${SLURM_JOB_ID:-}" ] || { lbp_die 2 "not inside a Slurm allocation: submit with" \
    "sbatch $0 (or run with --dry-run / LBP_DRY_RUN=1 to see the commands)"; return; }
  command -v srun >/dev/null 2>&1 || { lbp_die 2 "srun not found in PATH"; return; }
  mkdir -p "$CHECKPOINT_DIR"
  lbp_log "launching at $(date -u +%FT%TZ)"
  "${SRUN[@]}" "${ENTRY[@]}" "${TRAIN_ARGS[@]}"
}
