# shellcheck shell=bash
# The shared launcher logic of megatron-lbp: sourced by the Frontier profiles' body
# (scripts/launch/frontier_body.sh, which scripts/frontier_gpt20b.sh and
# scripts/frontier_gpt10b.sh source) and by scripts/local_profile.sh, so that the
# Frontier scripts and the locally tested path are the same code.
#
# A profile script sets its defaults (model shape, batch, site environment)
# as `: "${VAR:=value}"`, sources this file and calls
#     lbp_main "$@"
# lbp_main validates the inputs; loads the modules and the Python environment;
# estimates memory per GCD for each recomputation / micro-batch choice (and picks one
# for RECOMPUTE/MICRO_BATCH_SIZE=auto), the step time, the save interval and the
# checkpoint size (python -m megatron_lbp.launch estimate); prints the srun and training
# commands and, for the job's wall time, when training stops to save; and refuses what
# does not fit. A dry run stops there. In a job it then checks the torch build, decides
# the job chain, prunes old checkpoints and checks the free space, runs the health check
# as its own srun step, submits the chain's next job, and runs srun, one task per GCD,
# each through scripts/launch/lbp_task.sh, with a checkpoint pruner beside it.
#
# Arguments of lbp_main: --dry-run (same as LBP_DRY_RUN=1); --chain N (this job and N-1
# more, each submitted by the previous one); anything else, optionally after `--`, is
# appended to the training command line.
#
# Every stop prints "lbp_launch: error: ..." (or lbp_health / lbp_task) naming what to
# set or run, and returns: 2 bad input; 3 does not fit in GCD memory; 4 the job or its
# nodes cannot run it (torch build, devices, placement, slow links, too little wall time
# or disk space); 5 the chain stops because the previous job made no progress.
# "Training complete" is status 0 without launching.
#
# Variables read (profile scripts document their defaults):
#   LBP_REPO            megatron-lbp checkout (set by the profile script)
#   LBP_PROFILE         name printed in the summary; LBP_PROFILE_SCRIPT the script itself
#   LBP_SITE            frontier (RCCL/libfabric/ROCm environment) or local (CPU, gloo)
#   LBP_DRY_RUN         1: print everything, launch nothing
#   LBP_ACTIVATE        file sourced to get the Python env (venv/conda-pack activate);
#                       default $LBP_REPO/.venv/bin/activate when it exists
#   LBP_CONDA_ENV       a conda environment to `conda activate` instead
#   LBP_PYTHON          interpreter (default: python)
#   LBP_MODULES         modules to `module load` (skipped when `module` is missing)
#   LBP_SBCAST_ENV      a packed Python environment (conda-pack .tar.gz) to sbcast to
#                       every node's LBP_SBCAST_DIR [/mnt/bb/$USER] and activate there
#                       (needs sbatch -C nvme on Frontier)
#   LBP_NODE_LOCAL_ROOT node-local directory for the MIOpen/Triton caches [/tmp]
#   MEGATRON_LM_DIR     a Megatron-LM tree patched by scripts/apply_patches.sh:
#                       run its pretrain_gpt.py instead of python -m megatron_lbp.pretrain_gpt
#   NNODES              node count (default: the allocation's, else the script's #SBATCH -N)
#   TASKS_PER_NODE      ranks per node, one per GCD (Frontier: 8)
#   GCDS_PER_PACKAGE    GCDs per package (MI250X: 2)
#   CPUS_PER_TASK       srun -c (Frontier: 7 = 56 usable cores / 8)
#   GPUS_PER_TASK       1: --gpus-per-task=1 --gpu-bind=$GPU_BIND; 0: CPU ranks
#   GPU_BIND            srun --gpu-bind value (Frontier: closest)
#   LBP_REQUIRE_GPU     rocm | cuda | any | none: the torch build a GPU profile needs
#                       [rocm on Frontier, any elsewhere when GPUS_PER_TASK > 0, else none]
#   SRUN_EXTRA_ARGS     more srun options (word-split)
#   MASTER_ADDR, MASTER_PORT  rendezvous (default: this host's IP, 3442)
#   DATA_PATH           Megatron data prefix(es) (<prefix>.bin/.idx), or MOCK_DATA=1
#   DATA_CACHE_PATH     Megatron's index cache (--data-cache-path) [$CHECKPOINT_DIR/data_cache]
#   TENSORBOARD_DIR     --tensorboard-dir [$CHECKPOINT_DIR/tensorboard; empty: off]
#   TOKENIZER_TYPE      GPT2BPETokenizer (needs VOCAB_FILE, MERGE_FILE),
#                       SentencePieceTokenizer / HuggingFaceTokenizer (need TOKENIZER_MODEL:
#                       a .model file / a local save_pretrained directory), NullTokenizer;
#                       all built offline (megatron_lbp/integration/tokenizer_check.py says what each needs)
#   VOCAB_SIZE_PADDED   Megatron's padded vocabulary (for the parameter count and memory)
#   CHECKPOINT_DIR      --save and --load (resume from the latest checkpoint there)
#   START_FROM          a directory made by `python -m megatron_lbp.hf import <HF dir> DIR`:
#                       the run starts from its weights (--pretrained-checkpoint DIR: Megatron
#                       loads them, weights only, at iteration 0 with a fresh optimizer, only
#                       while CHECKPOINT_DIR holds no checkpoint, so later jobs resume there);
#                       DIR/megatron_args.txt (architecture, tokenizer) follows the profile's
#                       flags, and NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS FFN_HIDDEN_SIZE
#                       VOCAB_SIZE_PADDED and the TOKENIZER_* variables are taken from it
#   NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS SEQ_LENGTH FFN_HIDDEN_SIZE
#                       the estimate's model also takes Megatron's model flags where the
#                       training command does (START_FROM's flags, EXTRA_ARGS, the extras after
#                       the script's name; the last wins): --swiglu, --group-query-attention
#                       --num-query-groups, --kv-channels, --normalization, --disable-bias-linear,
#                       --add-qkv-bias, --untie-embeddings-and-output-weights,
#                       --position-embedding-type, --max-position-embeddings and the four
#                       shape flags (lbp_model_flags);
#                       the dry run prints the model it counted in one line
#   MICRO_BATCH_SIZE    an integer, or auto: the largest that fits
#   RECOMPUTE           full | selective | none | auto (the least that fits)
#   GLOBAL_BATCH_SIZE TRAIN_ITERS LR MIN_LR LR_WARMUP_ITERS
#   WEIGHT_DECAY CLIP_GRAD LOG_INTERVAL EVAL_INTERVAL EVAL_ITERS
#   SAVE_INTERVAL       iterations, or auto: about LBP_SAVE_MINUTES [45] of training at the
#                       estimated step time (LBP_STEP_SECONDS replaces the cost model's)
#   EXIT_DURATION_MINS  auto: the job's remaining wall time minus one save, one step and
#                       LBP_EXIT_SLACK_S; minutes; 0: off. The save is estimated from the
#                       checkpoint's bytes at LBP_WRITE_GBPS per node + LBP_SAVE_FIXED_S.
#                       Dry runs plan for LBP_WALLTIME (default: the script's #SBATCH -t).
#                       The margin is at least LBP_SIGNAL_S + 60 s + one step, so that training
#                       stops before the job's --signal can arrive (Slurm may send it 60 s early)
#   LBP_SIGNAL_S        seconds of sbatch's --signal lead [SBATCH_SIGNAL's, else the script's
#                       #SBATCH --signal=TERM@N; 0: none]; set it when you give sbatch another --signal
#   LBP_KEEP_LAST LBP_MILESTONE_EVERY  retention: the newest K complete checkpoints and
#                       the first at or after every N iterations (0: none); the tracker's
#                       and the newest complete one are never deleted; LBP_PRUNE_EVERY_S
#   LBP_CHAIN_SBATCH_ARGS  more sbatch options for the chain's next jobs (word-split)
#   LBP_HEALTH_CHECK    1: time the links before training; 0: device checks only; none: no check
#                       (scripts/launch/lbp_study.sh: a later run on nodes an earlier run checked)
#   LBP_HEALTH_EXPECT_GBPS  "package=200,node=50,network=12.5" (GB/s per GCD) [the cost model's]
#   LBP_HEALTH_MIN_FRACTION [0.25]  LBP_HEALTH_MB [64]  LBP_GCD_BUS_IDS [Frontier's]
#   LBP_LINK_SURVEY     [0]; 1 with LBP_HEALTH_CHECK=1: the health check also runs the link survey
#                       (every collective by dtype, size 1 MiB-1 GiB and group shape, and the
#                       overlap probe; megatron_lbp/launch/link_survey.py), at most
#                       LBP_SURVEY_MAX_S [300] seconds of timed cases, into
#                       $CHECKPOINT_DIR/lbp_survey.json
#   LBP_SURVEY          a link survey file: step times and their bands from it instead of the
#                       public figures (projection/collectives.py)
#   PRECISION           bf16 (default) or fp32
#   HIER_PRESET HIER_SECONDARY_GROUP_SIZE HIER_SECONDARY_DTYPE  the hierarchy (a preset implies
#                       its secondary group size: the node for lbp and zeropp, 0 otherwise;
#                       HIER_PRESET=distopt: stock Megatron's --use-distributed-optimizer instead,
#                       the study's baseline; HIER_PRESET=ds-zero3|ds-hpz|ds-zeropp: DeepSpeed's
#                       schemes by megatron_lbp/deepspeed_baseline's runner, scripts/launch/lbp_deepspeed.sh)
#   HIER_GRAD_REDUCE_DTYPE  fp32 (default) or bf16: the gradient shard and its reductions, in
#                       training (--hier-grad-reduce-dtype) and in the memory estimate alike
#   HIER_PREFETCH_UNITS HIER_MAX_PENDING_REDUCES  the engine's transient knobs: units gathered
#                       ahead (--hier-prefetch-units) and gradient reduce-scatters in flight
#                       (--hier-max-pending-reduces). [auto]: the estimate takes the engine's
#                       defaults (1, 2) where they fit, else 1 in flight, else no prefetch as
#                       well, and costs the exposed time (projection/knobs.py); a number is kept
#   HIER_EMBEDDING_BACKWARD_GATHER  [auto], gather or skip: with skip the embedding is not
#                       gathered for its own backward (a lookup's backward reads no weights) and a
#                       tied embedding is freed after the output layer's backward
#                       (--hier-embedding-backward-gather; bit for bit the same training); auto:
#                       gather, and skip with each knob setting where gather does not fit
#   HIER_LAYER_UNIT     [auto], whole or split: split makes each layer's attention and MLP two
#                       gather units, half a layer's weights and gradient in memory at a time
#                       (--hier-layer-unit), never with RECOMPUTE=full; auto: whole layers, and
#                       split where whole ones do not fit (after one reduce-scatter in flight,
#                       before no prefetch), with what it leaves exposed (projection/knobs.py)
#   LBP_SETTINGS_OUT    a file: write the resolved settings there and stop (scripts/launch/lbp_study.sh)
#   GCD_MEMORY_GB       device memory for the fit check (Frontier GCD: 64)
#   LBP_MEMORY_RESERVE_GB  of it kept for HIP/RCCL buffers and fragmentation [4 on GPUs]
#   LBP_CHOOSE          [1]: the estimate ranks scheme x recomputation x micro-batch at
#                       GLOBAL_BATCH_SIZE by projected step time (the committed trace replayed
#                       where one matches, the cost model otherwise), drops what does not fit,
#                       takes the fastest the explicit RECOMPUTE / MICRO_BATCH_SIZE (and, unless
#                       the profile sets LBP_CHOOSE_SCHEME=1, HIER_PRESET) allow, prints the top
#                       rows, the best zeropp and zero3 rows with their ratios, and one line when
#                       another scheme is faster (megatron_lbp/launch/choose.py); 0: the old rule
#                       (least recomputation, largest micro-batch), no ranking
#   LBP_LINKS           a measured link file (the health check writes $CHECKPOINT_DIR/lbp_links.json
#                       at every job start): step times from it instead of the Frontier figures
#   LBP_CHECK_CONTENTS  [1]: before anything is submitted, the tokenizer builds and every DATA_PATH
#                       prefix is a readable indexed dataset whose token ids fit the vocabulary
#                       (a sample of 2^20 tokens each; python -m megatron_lbp.launch contents);
#                       0: paths only
#   LBP_COMPARE_SCHEMES [0]; 1 with LBP_CHOOSE=0: the ranking as advice only
#   LBP_VERBOSE         [0]; 1: the estimate in full (every candidate's memory, the ranking)
#                       after its summary, which a dry run prints first
#   EXTRA_ARGS          more training flags (word-split)

# shellcheck source-path=SCRIPTDIR source=lbp_site.sh
. "$LBP_REPO/scripts/launch/lbp_site.sh"
# shellcheck source-path=SCRIPTDIR source=lbp_job.sh
. "$LBP_REPO/scripts/launch/lbp_job.sh"
# shellcheck source-path=SCRIPTDIR source=lbp_deepspeed.sh
. "$LBP_REPO/scripts/launch/lbp_deepspeed.sh"

lbp_die() {  # lbp_die STATUS MESSAGE...
  local status=$1
  shift
  echo "lbp_launch: error: $*" >&2
  return "$status"
}

lbp_log() { echo "[lbp] $*"; }

lbp_is_uint() { [[ "${1:-}" =~ ^[0-9]+$ ]]; }

# The Python side of the launcher: python -m megatron_lbp.launch COMMAND ...
lbp_py() { "$LBP_PYTHON" -m megatron_lbp.launch "$@"; }

# KEY=VALUE lines a Python command wrote (no eval: only names we expect are read).
lbp_read_resolved() {  # lbp_read_resolved FILE NAME...
  local file=$1 key value want
  shift
  while IFS='=' read -r key value; do
    for want in "$@"; do
      [ "$key" = "$want" ] && printf -v "$key" '%s' "$value"
    done
  done <"$file"
  return 0
}

# --------------------------------------------------------------------------- inputs

# The script's own #SBATCH value of an option (dry runs outside an allocation).
lbp_sbatch_directive() {  # lbp_sbatch_directive -N|-t|--signal
  local script=${LBP_PROFILE_SCRIPT:-} opt=$1 line
  [ -f "$script" ] || return 0
  while IFS= read -r line; do
    case "$line" in
      "#SBATCH $opt "*) echo "${line#"#SBATCH $opt "}"; return ;;
      "#SBATCH $opt="*) echo "${line#"#SBATCH $opt="}"; return ;;
      "#SBATCH "*) ;;
      "#"*|"") ;;
      *) return ;;
    esac
  done <"$script"
}

lbp_resolve_nodes() {
  local n=${NNODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}} from=""
  if [ -z "$n" ] && [ -z "${SLURM_JOB_ID:-}" ]; then
    n=$(lbp_sbatch_directive -N)
    [ -n "$n" ] && from=" (the script's #SBATCH -N)"
  fi
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
  NNODES_FROM=$from
}

# Node counts / batch sizes / group sizes that fit the hierarchy.
lbp_check_hierarchy() {
  local n=$NNODES_RESOLVED t=$TASKS_PER_NODE pk=$GCDS_PER_PACKAGE s=$HIER_SECONDARY_GROUP_SIZE
  local v mbs=$MICRO_BATCH_SIZE
  [ "$mbs" = auto ] && mbs=1
  for v in TASKS_PER_NODE GCDS_PER_PACKAGE GLOBAL_BATCH_SIZE; do
    if ! lbp_is_uint "${!v}" || [ "${!v}" -lt 1 ]; then
      lbp_die 2 "$v=${!v} must be an integer >= 1"
      return
    fi
  done
  if ! lbp_is_uint "$mbs" || [ "$mbs" -lt 1 ]; then
    lbp_die 2 "MICRO_BATCH_SIZE=$MICRO_BATCH_SIZE must be auto or an integer >= 1"
    return
  fi
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
  local per_step=$((mbs * WORLD))
  if [ $((GLOBAL_BATCH_SIZE % per_step)) -ne 0 ]; then
    local ok="" k
    for k in $(seq 1 512); do
      [ $((GLOBAL_BATCH_SIZE % (mbs * t * k))) -eq 0 ] && ok="$ok $k"
    done
    lbp_die 2 "$n node(s) x $t tasks = $WORLD data-parallel ranks do not fit" \
      "GLOBAL_BATCH_SIZE=$GLOBAL_BATCH_SIZE with MICRO_BATCH_SIZE=$mbs (needs a" \
      "multiple of $per_step): use NNODES in {${ok# }} or set GLOBAL_BATCH_SIZE to a multiple" \
      "of $per_step"
    return
  fi
}

# Required paths exist (stops before srun with what to set).
lbp_check_paths() {
  if [ "${MOCK_DATA:-0}" != 1 ]; then
    [ -n "${DATA_PATH:-}" ] || { lbp_die 2 "DATA_PATH is not set: export DATA_PATH=<prefix of" \
      "the .bin/.idx files made by python -m megatron_lbp.preprocess_data> (or MOCK_DATA=1 for synthetic data)"; return; }
    local w
    for w in $DATA_PATH; do
      [[ "$w" =~ ^[0-9.eE+-]+$ ]] && continue  # a blend weight
      if [ ! -f "$w.bin" ] || [ ! -f "$w.idx" ]; then
        lbp_die 2 "DATA_PATH: $w.bin / $w.idx not found: set DATA_PATH to an existing data" \
          "prefix (python -m megatron_lbp.preprocess_data makes them)"
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
  if [ -n "${LBP_SBCAST_ENV:-}" ] && [ ! -f "$LBP_SBCAST_ENV" ]; then
    lbp_die 2 "LBP_SBCAST_ENV=$LBP_SBCAST_ENV does not exist: set it to a conda-pack'd" \
      ".tar.gz (conda pack --format tar.gz), or unset it"
    return
  fi
  : "${DATA_CACHE_PATH=$CHECKPOINT_DIR/data_cache}" "${TENSORBOARD_DIR=$CHECKPOINT_DIR/tensorboard}"
}

# The inputs' contents, before anything is submitted: the tokenizer builds here, the data is a
# readable indexed dataset whose token ids fit the vocabulary (megatron_lbp/launch/contents.py).
lbp_check_contents() {
  [ "${LBP_CHECK_CONTENTS:-1}" = 1 ] || { lbp_log "contents: not checked (LBP_CHECK_CONTENTS=0)"; return 0; }
  local args=(--tokenizer-type "$TOKENIZER_TYPE" --vocab-size-padded "$VOCAB_SIZE_PADDED")
  case "$TOKENIZER_TYPE" in
    GPT2BPETokenizer) args+=(--vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE") ;;
    NullTokenizer) ;;
    *) args+=(--tokenizer-model "$TOKENIZER_MODEL") ;;
  esac
  if [ "${MOCK_DATA:-0}" = 1 ]; then args+=(--mock-data)
  else
    # shellcheck disable=SC2206  # DATA_PATH may be a blend "w1 p1 w2 p2"
    args+=(--data-path $DATA_PATH)
  fi
  lbp_py contents "${args[@]}" | sed 's/^/[lbp] /'
  return "${PIPESTATUS[0]}"
}

# START_FROM: the imported model's flags, and the model variables the estimate reads from them.
lbp_start_from() {
  LBP_START_FLAGS=()
  [ -n "${START_FROM:-}" ] || return 0
  local file="$START_FROM/megatron_args.txt"
  if [ ! -f "$file" ] || [ ! -f "$START_FROM/latest_checkpointed_iteration.txt" ]; then
    lbp_die 2 "START_FROM=$START_FROM is not an imported model (no megatron_args.txt or" \
      "checkpoint tracker): make it with python -m megatron_lbp.hf import <HF model dir> $START_FROM"
    return
  fi
  read -r -a LBP_START_FLAGS < "$file"
  local i f v
  for ((i = 0; i < ${#LBP_START_FLAGS[@]}; i++)); do
    f=${LBP_START_FLAGS[i]} v=${LBP_START_FLAGS[i + 1]:-}
    case "$f" in
      --num-layers) NUM_LAYERS=$v ;;
      --hidden-size) HIDDEN_SIZE=$v ;;
      --num-attention-heads) NUM_ATTENTION_HEADS=$v ;;
      --ffn-hidden-size) FFN_HIDDEN_SIZE=$v ;;
      --make-vocab-size-divisible-by) VOCAB_SIZE_PADDED=$v ;;  # the import pads to exactly this
      --tokenizer-type) TOKENIZER_TYPE=$v ;;
      --tokenizer-model) TOKENIZER_MODEL=$v ;;
      --vocab-file) VOCAB_FILE=$v ;;
      --merge-file) MERGE_FILE=$v ;;
    esac
  done
  lbp_log "start: the weights of $START_FROM (--pretrained-checkpoint; flags from $file)"
}

# Training entry: megatron_lbp (default) or a patched Megatron-LM tree.
lbp_resolve_entry() {
  if lbp_is_ds; then lbp_ds_entry; return; fi
  if [ -z "${MEGATRON_LM_DIR:-}" ]; then
    ENTRY=("$LBP_PYTHON" -u -m megatron_lbp.pretrain_gpt)
    ENTRY_DESC="python -m megatron_lbp.pretrain_gpt (megatron-core from the Python env)"
    return
  fi
  [ -f "$MEGATRON_LM_DIR/pretrain_gpt.py" ] || { lbp_die 2 "MEGATRON_LM_DIR=$MEGATRON_LM_DIR has" \
    "no pretrain_gpt.py: set it to a Megatron-LM checkout (core_v0.19.0), or unset it to use" \
    "python -m megatron_lbp.pretrain_gpt"; return; }
  local patched=0
  bash "$LBP_REPO/scripts/apply_patches.sh" --check "$MEGATRON_LM_DIR" >/dev/null 2>&1 && patched=1
  [ "$patched" = 1 ] || { lbp_die 2 "MEGATRON_LM_DIR=$MEGATRON_LM_DIR is not patched for" \
    "megatron-lbp: run bash $LBP_REPO/scripts/apply_patches.sh $MEGATRON_LM_DIR" \
    "(or unset MEGATRON_LM_DIR to use python -m megatron_lbp.pretrain_gpt)"; return; }
  export PYTHONPATH=$MEGATRON_LM_DIR:$PYTHONPATH
  ENTRY=("$LBP_PYTHON" -u "$MEGATRON_LM_DIR/pretrain_gpt.py")
  ENTRY_DESC="$MEGATRON_LM_DIR/pretrain_gpt.py (patched Megatron-LM tree)"
}

# --------------------------------------------------------------------------- estimates

# The model the training command builds, as the estimate's flags (LBP_MODEL_ARGS): the
# shape variables, then Megatron's model flags where the command gives them, in its order
# (START_FROM's megatron_args.txt, EXTRA_ARGS, the command line's extras; the last of a flag
# wins, as in Megatron's argparse). --num-query-groups counts only with
# --group-query-attention, as in Megatron. Model flags the estimate cannot count get a
# warning line.
lbp_model_flags() {
  local words=("${LBP_START_FLAGS[@]}")
  # shellcheck disable=SC2206  # EXTRA_ARGS is a list of flags
  [ -n "${EXTRA_ARGS:-}" ] && words+=($EXTRA_ARGS)
  words+=("${LBP_CLI_EXTRA[@]}")
  local -A val=([--num-layers]=$NUM_LAYERS [--hidden-size]=$HIDDEN_SIZE
                [--num-attention-heads]=$NUM_ATTENTION_HEADS
                [--ffn-hidden-size]=$FFN_HIDDEN_SIZE [--position-embedding-type]=rope
                [--max-position-embeddings]=$SEQ_LENGTH)
  local -A on=()
  local i f v
  for ((i = 0; i < ${#words[@]}; i++)); do
    f=${words[i]} v=${words[i + 1]:-}
    case "$f" in --*=*) v=${f#*=} f=${f%%=*} ;; esac
    case "$f" in
      --num-layers | --hidden-size | --num-attention-heads | --ffn-hidden-size | \
        --num-query-groups | --kv-channels | --normalization | --position-embedding-type | \
        --max-position-embeddings)
        val[$f]=$v ;;
      --swiglu | --group-query-attention | --disable-bias-linear | --add-qkv-bias | \
        --untie-embeddings-and-output-weights)
        on[$f]=1 ;;
      --num-experts | --qk-layernorm | --multi-latent-attention | --squared-relu | --quick-geglu)
        lbp_log "warning: $f: the estimate does not count it (parameters, memory and step" \
          "time are for the model without it)" ;;
    esac
  done
  LBP_MODEL_ARGS=()
  for f in --num-layers --hidden-size --num-attention-heads --ffn-hidden-size --kv-channels \
           --normalization --position-embedding-type --max-position-embeddings; do
    [ -n "${val[$f]:-}" ] && LBP_MODEL_ARGS+=("$f" "${val[$f]}")
  done
  for f in --swiglu --group-query-attention --disable-bias-linear --add-qkv-bias \
           --untie-embeddings-and-output-weights; do
    [ -n "${on[$f]:-}" ] && LBP_MODEL_ARGS+=("$f")
  done
  if [ -n "${on[--group-query-attention]:-}" ] && [ -n "${val[--num-query-groups]:-}" ]; then
    LBP_MODEL_ARGS+=(--num-query-groups "${val[--num-query-groups]}")
  fi
}

# Memory per choice, the choice, step time, save interval, checkpoint bytes (estimate.py).
lbp_estimate() {
  lbp_ds_estimate_as
  lbp_model_flags
  # Schemes the engine does not run (DeepSpeed's, stock distopt) have no such knobs: the
  # estimate costs them with the engine's defaults.
  LBP_EST_PREFETCH=$HIER_PREFETCH_UNITS LBP_EST_PENDING=$HIER_MAX_PENDING_REDUCES
  LBP_EST_EMBEDDING=$HIER_EMBEDDING_BACKWARD_GATHER LBP_EST_LAYER_UNIT=$HIER_LAYER_UNIT
  if lbp_is_ds || [ "$HIER_PRESET" = distopt ]; then
    LBP_EST_PREFETCH=1 LBP_EST_PENDING=2 LBP_EST_EMBEDDING=gather LBP_EST_LAYER_UNIT=whole
  fi
  local args=(--nodes "$NNODES_RESOLVED" --tasks-per-node "$TASKS_PER_NODE"
              --gcds-per-package "$GCDS_PER_PACKAGE" --preset "$LBP_EST_PRESET"
              "${LBP_MODEL_ARGS[@]}" --seq-length "$SEQ_LENGTH"
              --vocab-size "$VOCAB_SIZE_PADDED" --global-batch-size "$GLOBAL_BATCH_SIZE"
              --micro-batch-size "$MICRO_BATCH_SIZE" --recompute "$RECOMPUTE"
              --hier-secondary-group-size "$LBP_EST_SECONDARY"
              --hier-secondary-dtype "$LBP_EST_SECONDARY_DTYPE" --params-dtype "$PRECISION"
              --hier-grad-reduce-dtype "$HIER_GRAD_REDUCE_DTYPE"
              --hier-prefetch-units "$LBP_EST_PREFETCH"
              --hier-max-pending-reduces "$LBP_EST_PENDING"
              --hier-embedding-backward-gather "$LBP_EST_EMBEDDING"
              --hier-layer-unit "$LBP_EST_LAYER_UNIT"
              --gcd-memory-gb "$GCD_MEMORY_GB" --reserve-gb "$LBP_MEMORY_RESERVE_GB"
              --train-iters "$TRAIN_ITERS" --save-interval "$SAVE_INTERVAL"
              --save-minutes "$LBP_SAVE_MINUTES" --milestone-every "$LBP_MILESTONE_EVERY"
              --write-gbps-per-node "$LBP_WRITE_GBPS" --save-fixed-s "$LBP_SAVE_FIXED_S"
              --resolved "$LBP_TMP/estimate")
  [ -n "${LBP_STEP_SECONDS:-}" ] && args+=(--step-seconds "$LBP_STEP_SECONDS")
  [ "${LBP_COMPARE_SCHEMES:-0}" = 1 ] && args+=(--compare)
  [ "${LBP_VERBOSE:-0}" = 1 ] && args+=(--verbose)
  [ -n "${LBP_SUMMARY_OUT:-}" ] && args+=(--summary "$LBP_SUMMARY_OUT")
  # The configuration by projected step time (megatron_lbp/launch/choose.py), the scheme
  # too when the profile left it open (LBP_CHOOSE_SCHEME=1).
  if [ "${LBP_CHOOSE:-1}" = 1 ]; then
    args+=(--choose)
    [ "${LBP_CHOOSE_SCHEME:-0}" = 1 ] && args+=(--preset auto)
  fi
  [ -n "${LBP_LINKS:-}" ] && args+=(--links "$LBP_LINKS")
  [ -n "${LBP_SURVEY:-}" ] && args+=(--survey "$LBP_SURVEY")
  lbp_py estimate "${args[@]}" | sed 's/^/[lbp] /'
  local status=${PIPESTATUS[0]}
  [ "$status" = 0 ] || return "$status"
  lbp_read_resolved "$LBP_TMP/estimate" MICRO_BATCH_SIZE RECOMPUTE SAVE_INTERVAL LBP_STEP_S \
    LBP_CKPT_BYTES LBP_SAVE_S HIER_PRESET HIER_SECONDARY_GROUP_SIZE HIER_PREFETCH_UNITS \
    HIER_MAX_PENDING_REDUCES HIER_LAYER_UNIT HIER_EMBEDDING_BACKWARD_GATHER
}

# Seconds before the end at which Slurm signals the job: sbatch's --signal=[R:|B:]SIG[@SECONDS]
# (60 without @) as SBATCH_SIGNAL or the script's #SBATCH --signal; 0 without one.
lbp_signal_lead() {
  local spec=${SBATCH_SIGNAL:-$(lbp_sbatch_directive --signal)}
  [ -n "$spec" ] || { echo 0; return; }
  case "$spec" in *@*) echo "${spec##*@}" ;; *) echo 60 ;; esac
}

# --exit-duration-in-mins from the job's remaining wall time (dry run: LBP_WALLTIME).
lbp_exit_time() {
  LBP_EXIT_MEASURED_AT=$(date +%s)  # when the time left is read (Megatron's clock starts there)
  if [ "$LBP_EXIT_AUTO" != 1 ]; then
    lbp_is_uint "$EXIT_DURATION_MINS" || { lbp_die 2 "EXIT_DURATION_MINS=$EXIT_DURATION_MINS:" \
      "use auto, minutes, or 0 (off)"; return; }
    lbp_log "exit time: EXIT_DURATION_MINS=$EXIT_DURATION_MINS as given"
    return
  fi
  local args=(--save-s "$LBP_SAVE_S" --step-s "$LBP_STEP_S" --slack-s "$LBP_EXIT_SLACK_S"
              --signal-s "$LBP_SIGNAL_S" --resolved "$LBP_TMP/exit")
  local walltime=${LBP_WALLTIME:-$(lbp_sbatch_directive -t)}
  [ -n "$walltime" ] && args+=(--walltime "$walltime")
  [ "$LBP_DRY_RUN" = 1 ] && args+=(--no-job)  # a dry run plans for the job length
  lbp_py exit-time "${args[@]}" | sed 's/^/[lbp] /'
  local status=${PIPESTATUS[0]}
  [ "$status" = 0 ] || return "$status"
  lbp_read_resolved "$LBP_TMP/exit" EXIT_DURATION_MINS
}

# --------------------------------------------------------------------------- commands

lbp_build_srun() {
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

lbp_build_train_args() {
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
  [ -n "$DATA_CACHE_PATH" ] && data+=(--data-cache-path "$DATA_CACHE_PATH")
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
    --log-interval "$LOG_INTERVAL" --log-throughput
    --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
    --distributed-timeout-minutes "$DIST_TIMEOUT_MINS"
  )
  lbp_is_ds || TRAIN_ARGS+=(--save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --ckpt-format torch_dist
                            --save-interval "$SAVE_INTERVAL" --exit-signal-handler)
  if lbp_is_ds; then
    :  # DeepSpeed partitions by its scheme (lbp_ds_entry's --ds-scheme)
  elif [ "$HIER_PRESET" = distopt ]; then
    # Stock Megatron's distributed optimizer, the study's baseline (the estimate sized it as zero2).
    TRAIN_ARGS+=(--use-distributed-optimizer)
  else
    TRAIN_ARGS+=(--hier-partition --hier-preset "$HIER_PRESET"
      --hier-gpus-per-node "$TASKS_PER_NODE" --hier-gcds-per-package "$GCDS_PER_PACKAGE"
      --hier-secondary-group-size "$HIER_SECONDARY_GROUP_SIZE")
    [ "$HIER_SECONDARY_GROUP_SIZE" -gt 0 ] && TRAIN_ARGS+=(--hier-secondary-dtype "$HIER_SECONDARY_DTYPE")
    [ "$HIER_GRAD_REDUCE_DTYPE" != fp32 ] && TRAIN_ARGS+=(--hier-grad-reduce-dtype "$HIER_GRAD_REDUCE_DTYPE")
    # The knobs the estimate resolved; the engine's defaults (1, 2) go unsaid.
    [ "${HIER_PREFETCH_UNITS:-auto}" != auto ] && [ "$HIER_PREFETCH_UNITS" != 1 ] &&
      TRAIN_ARGS+=(--hier-prefetch-units "$HIER_PREFETCH_UNITS")
    [ "${HIER_MAX_PENDING_REDUCES:-auto}" != auto ] && [ "$HIER_MAX_PENDING_REDUCES" != 2 ] &&
      TRAIN_ARGS+=(--hier-max-pending-reduces "$HIER_MAX_PENDING_REDUCES")
    [ "$HIER_EMBEDDING_BACKWARD_GATHER" = skip ] &&
      TRAIN_ARGS+=(--hier-embedding-backward-gather skip)
    [ "$HIER_LAYER_UNIT" = split ] && TRAIN_ARGS+=(--hier-layer-unit split)
  fi
  [ "$PRECISION" = bf16 ] && TRAIN_ARGS+=(--bf16)
  case "$RECOMPUTE" in
    full) TRAIN_ARGS+=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1) ;;
    selective) TRAIN_ARGS+=(--recompute-granularity selective) ;;
  esac
  [ -n "$FFN_HIDDEN_SIZE" ] && TRAIN_ARGS+=(--ffn-hidden-size "$FFN_HIDDEN_SIZE")
  [ -n "$TENSORBOARD_DIR" ] && TRAIN_ARGS+=(--tensorboard-dir "$TENSORBOARD_DIR")
  if ! lbp_is_ds; then
    [ "$LBP_RETAIN_BY" = megatron ] && TRAIN_ARGS+=(--save-retain-interval "$LBP_MILESTONE_EVERY")
    [ "$EXIT_DURATION_MINS" != 0 ] && TRAIN_ARGS+=(--exit-duration-in-mins "$EXIT_DURATION_MINS")
  fi
  [ -n "${START_FROM:-}" ] && TRAIN_ARGS+=(--pretrained-checkpoint "$START_FROM" "${LBP_START_FLAGS[@]}")
  if [ -n "${EXTRA_ARGS:-}" ]; then
    # shellcheck disable=SC2206  # a list of flags
    TRAIN_ARGS+=($EXTRA_ARGS)
  fi
  TRAIN_ARGS+=("${LBP_CLI_EXTRA[@]}")
}

# The training command as the entry will run it: python -m megatron_lbp.capabilities adds
# the flags this environment needs (what imports: Transformer Engine, Apex, Megatron's fused
# kernels; docs/design.md §4.1), resolved for the device the profile runs on (LBP_DEVICE=gpu for
# a GPU profile, so that a login node without GPUs resolves for the compute nodes), and
# refuses (one line) a flag that cannot work here.
lbp_resolve_capabilities() {
  LBP_RUN_DEVICE=${LBP_DEVICE:-cpu}
  [ -z "${LBP_DEVICE:-}" ] && [ "$LBP_REQUIRE_GPU" != none ] && LBP_RUN_DEVICE=gpu
  local out status=0
  out=$(LBP_DEVICE=$LBP_RUN_DEVICE "$LBP_PYTHON" -m megatron_lbp.capabilities "${TRAIN_ARGS[@]}" \
        2>"$LBP_TMP/capabilities") || status=$?
  if [ "$status" != 0 ]; then
    sed 's/^python -m megatron_lbp.capabilities: error: /lbp_launch: error: /' \
      "$LBP_TMP/capabilities" >&2
    return 2
  fi
  RESOLVED_TRAIN_LINE=$out
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
  local v line="" users=""
  lbp_log "profile: ${LBP_PROFILE:-custom}: $NNODES_RESOLVED node(s)${NNODES_FROM:-} x" \
    "$TASKS_PER_NODE tasks = $WORLD ranks (one per GCD), $GCDS_PER_PACKAGE GCDs per package"
  lbp_log "entry: $ENTRY_DESC; python: $(command -v "$LBP_PYTHON")"
  lbp_log "rendezvous: MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT (ranks from SLURM_PROCID" \
    "per task, scripts/launch/lbp_task.sh)"
  for v in ${LBP_ENV_SHOWN:-}; do
    [ -n "${!v+x}" ] && line="$line $v=${!v}"
  done
  for v in ${LBP_ENV_USER:-}; do users="$users $v"; done
  lbp_log "environment:${line}${users:+ (yours:$users)}"
  lbp_log "caches: MIOpen and Triton per task under ${LBP_NODE_LOCAL_ROOT} (node-local)," \
    "data index cache ${DATA_CACHE_PATH:-<next to the data>}, TensorBoard ${TENSORBOARD_DIR:-off}"
  echo "[lbp] srun command:"
  echo "  $(lbp_quote "${SRUN[@]}") \\"
  echo "    $(lbp_quote "${ENTRY[@]}" "${TRAIN_ARGS[@]}")"
  lbp_log "flags for a ${LBP_RUN_DEVICE^^} run (python -m megatron_lbp.capabilities," \
    "LBP_DEVICE=$LBP_RUN_DEVICE), as the entry adds them at start:"
  sed 's/^/[lbp]   /' "$LBP_TMP/capabilities"
  echo "[lbp] training command (each task):"
  echo "  $(lbp_quote "${ENTRY[@]}") $RESOLVED_TRAIN_LINE"
}

lbp_defaults() {
  : "${LBP_DRY_RUN:=0}" "${TASKS_PER_NODE:=8}" "${GCDS_PER_PACKAGE:=2}" "${CPUS_PER_TASK:=7}"
  : "${GPUS_PER_TASK:=1}" "${GPU_BIND:=closest}" "${MASTER_PORT:=3442}"
  : "${TOKENIZER_TYPE:=GPT2BPETokenizer}" "${VOCAB_SIZE_PADDED:=50304}" "${SPLIT:=949,50,1}"
  : "${FFN_HIDDEN_SIZE:=}" "${MICRO_BATCH_SIZE:=auto}" "${TRAIN_ITERS:=150000}"
  : "${LR_WARMUP_ITERS:=1500}" "${WEIGHT_DECAY:=0.01}" "${CLIP_GRAD:=1.0}"
  : "${INIT_METHOD_STD:=0.01}" "${SAVE_INTERVAL:=auto}" "${LOG_INTERVAL:=10}"
  : "${EVAL_INTERVAL:=1000}" "${EVAL_ITERS:=10}" "${DIST_TIMEOUT_MINS:=30}"
  : "${EXIT_DURATION_MINS:=auto}" "${RECOMPUTE:=full}" "${PRECISION:=bf16}"
  : "${HIER_PRESET:=lbp}"
  # A preset implies its own secondary copy: the node's for lbp and zeropp, none otherwise.
  case "$HIER_PRESET" in
    lbp|zeropp) : "${HIER_SECONDARY_GROUP_SIZE:=$TASKS_PER_NODE}" ;;
    *) : "${HIER_SECONDARY_GROUP_SIZE:=0}" ;;
  esac
  : "${HIER_SECONDARY_DTYPE:=int8}" "${GCD_MEMORY_GB:=64}" "${HIER_GRAD_REDUCE_DTYPE:=fp32}"
  : "${HIER_PREFETCH_UNITS:=auto}" "${HIER_MAX_PENDING_REDUCES:=auto}"
  : "${HIER_EMBEDDING_BACKWARD_GATHER:=auto}" "${HIER_LAYER_UNIT:=auto}"
  : "${LBP_SAVE_MINUTES:=45}" "${LBP_WRITE_GBPS:=1}" "${LBP_SAVE_FIXED_S:=60}"
  : "${LBP_EXIT_SLACK_S:=120}" "${LBP_KEEP_LAST:=2}" "${LBP_MILESTONE_EVERY:=10000}"
  : "${LBP_PRUNE_EVERY_S:=600}" "${LBP_HEALTH_CHECK:=1}" "${LBP_HEALTH_MIN_FRACTION:=0.25}"
  : "${LBP_HEALTH_MB:=64}" "${LBP_HEALTH_EXPECT_GBPS:=}" "${LBP_NODE_LOCAL_ROOT:=/tmp}"
  : "${LBP_GCD_BUS_IDS:=c1,c6,c9,ce,d1,d6,d9,de}" "${LBP_LINK_SURVEY:=0}" "${LBP_SURVEY_MAX_S:=300}"
  [ -n "${LBP_SIGNAL_S:-}" ] || LBP_SIGNAL_S=$(lbp_signal_lead)
  LBP_EXIT_AUTO=0
  [ "$EXIT_DURATION_MINS" = auto ] && LBP_EXIT_AUTO=1
  local v
  for v in NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS SEQ_LENGTH GLOBAL_BATCH_SIZE LR MIN_LR; do
    [ -n "${!v:-}" ] || { lbp_die 2 "$v is not set (the profile script sets it)"; return; }
  done
  case "$RECOMPUTE" in full|selective|none|auto) ;; *)
    lbp_die 2 "RECOMPUTE=$RECOMPUTE: use full, selective, none or auto"; return ;; esac
  case "$PRECISION" in bf16|fp32) ;; *) lbp_die 2 "PRECISION=$PRECISION: use bf16 or fp32"; return ;; esac
  [ "$HIER_PREFETCH_UNITS" = auto ] || lbp_is_uint "$HIER_PREFETCH_UNITS" || {
    lbp_die 2 "HIER_PREFETCH_UNITS=$HIER_PREFETCH_UNITS: use auto or a number of units >= 0"; return; }
  [ "$HIER_MAX_PENDING_REDUCES" = auto ] || { lbp_is_uint "$HIER_MAX_PENDING_REDUCES" &&
    [ "$HIER_MAX_PENDING_REDUCES" -ge 1 ]; } || {
    lbp_die 2 "HIER_MAX_PENDING_REDUCES=$HIER_MAX_PENDING_REDUCES: use auto or a number >= 1"; return; }
  case "$HIER_EMBEDDING_BACKWARD_GATHER" in auto|gather|skip) ;; *)
    lbp_die 2 "HIER_EMBEDDING_BACKWARD_GATHER=$HIER_EMBEDDING_BACKWARD_GATHER: use auto, gather or skip"
    return ;; esac
  case "$HIER_LAYER_UNIT" in auto|whole|split) ;; *)
    lbp_die 2 "HIER_LAYER_UNIT=$HIER_LAYER_UNIT: use auto, whole or split"; return ;; esac
  if [ "$HIER_LAYER_UNIT" = split ] && [ "$RECOMPUTE" = full ]; then
    lbp_die 2 "HIER_LAYER_UNIT=split with RECOMPUTE=full: the recomputed layer needs both halves gathered at once; use RECOMPUTE=selective, none or auto"
    return
  fi
  lbp_is_uint "$GPUS_PER_TASK" || { lbp_die 2 "GPUS_PER_TASK=$GPUS_PER_TASK: use 1 (GCD) or 0 (CPU)"; return; }
  if [ -z "${LBP_REQUIRE_GPU:-}" ]; then
    LBP_REQUIRE_GPU=none
    [ "$GPUS_PER_TASK" -gt 0 ] && LBP_REQUIRE_GPU=any
    [ "$GPUS_PER_TASK" -gt 0 ] && [ "${LBP_SITE:-frontier}" = frontier ] && LBP_REQUIRE_GPU=rocm
  fi
  case "$LBP_REQUIRE_GPU" in rocm|cuda|any|none) ;; *)
    lbp_die 2 "LBP_REQUIRE_GPU=$LBP_REQUIRE_GPU: use rocm, cuda, any or none"; return ;; esac
  if [ -z "${LBP_MEMORY_RESERVE_GB:-}" ]; then
    LBP_MEMORY_RESERVE_GB=0
    [ "$GPUS_PER_TASK" -gt 0 ] && LBP_MEMORY_RESERVE_GB=4
  fi
  lbp_is_uint "$LBP_SIGNAL_S" || { lbp_die 2 "LBP_SIGNAL_S=$LBP_SIGNAL_S: the --signal lead (from" \
    "LBP_SIGNAL_S, SBATCH_SIGNAL or the script's #SBATCH --signal=SIG@SECONDS) must be seconds >= 0"; return; }
  for v in LBP_KEEP_LAST LBP_MILESTONE_EVERY LBP_PRUNE_EVERY_S LBP_EXIT_SLACK_S; do
    lbp_is_uint "${!v}" || { lbp_die 2 "$v=${!v} must be an integer >= 0"; return; }
  done
  [ "$LBP_KEEP_LAST" -ge 1 ] || { lbp_die 2 "LBP_KEEP_LAST=$LBP_KEEP_LAST: keep at least the newest" \
    "checkpoint (1)"; return; }
  case "$LBP_HEALTH_CHECK" in 0|1|none) ;; *) lbp_die 2 "LBP_HEALTH_CHECK=$LBP_HEALTH_CHECK: use 1, 0 or none"; return ;; esac
  local num='[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?'
  [[ "$LBP_HEALTH_EXPECT_GBPS" =~ ^((package|node|network)=$num,?)*$ ]] || { lbp_die 2 \
    "LBP_HEALTH_EXPECT_GBPS=$LBP_HEALTH_EXPECT_GBPS: give class=GB/s per GCD, e.g." \
    "package=200,node=50,network=12.5"; return; }
  case "$LBP_LINK_SURVEY" in 0|1) ;; *) lbp_die 2 "LBP_LINK_SURVEY=$LBP_LINK_SURVEY: use 1 (the" \
    "health check also runs the link survey) or 0"; return ;; esac
  for v in LBP_HEALTH_MIN_FRACTION LBP_HEALTH_MB LBP_SAVE_MINUTES LBP_WRITE_GBPS LBP_SAVE_FIXED_S \
           LBP_SURVEY_MAX_S; do
    [[ "${!v}" =~ ^$num$ ]] || { lbp_die 2 "$v=${!v} must be a number >= 0"; return; }
  done
  [ -z "${LBP_STEP_SECONDS:-}" ] || [[ "$LBP_STEP_SECONDS" =~ ^$num$ ]] || { lbp_die 2 \
    "LBP_STEP_SECONDS=$LBP_STEP_SECONDS must be seconds per iteration"; return; }
}

# Megatron's --save-retain-interval keeps every Nth and deletes the previous save: that
# is LBP_KEEP_LAST=1 when the milestones land on saves; else the launcher prunes.
lbp_retention_mode() {
  LBP_RETAIN_BY=launcher
  if [ "$LBP_KEEP_LAST" = 1 ] && [ "$LBP_MILESTONE_EVERY" -gt 0 ] \
     && [ $((LBP_MILESTONE_EVERY % SAVE_INTERVAL)) = 0 ]; then
    LBP_RETAIN_BY=megatron
  fi
  local rule="newest $LBP_KEEP_LAST complete"
  [ "$LBP_MILESTONE_EVERY" -gt 0 ] && rule="$rule + the first at or after every $LBP_MILESTONE_EVERY iterations"
  if [ "$LBP_RETAIN_BY" = megatron ]; then
    lbp_log "retention: $rule, by Megatron (--save-retain-interval $LBP_MILESTONE_EVERY)"
  else
    lbp_log "retention: $rule, by the launcher (at job start and end, and every" \
      "${LBP_PRUNE_EVERY_S} s during training); the tracker's and the newest complete checkpoint are kept"
  fi
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

# The profile's resolved settings as KEY=VALUE lines (LBP_SETTINGS_OUT=FILE: nothing else runs).
lbp_write_settings() {  # lbp_write_settings FILE
  local v
  for v in NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS SEQ_LENGTH VOCAB_SIZE_PADDED GLOBAL_BATCH_SIZE \
           MICRO_BATCH_SIZE TASKS_PER_NODE GCDS_PER_PACKAGE HIER_SECONDARY_GROUP_SIZE LBP_PROFILE; do
    printf '%s=%s\n' "$v" "${!v:-}"
  done >"$1"
}

# A dry run leads with its summary (the estimate's, python -m megatron_lbp.launch estimate
# --summary, with the exit time and what the job would refuse), then the run's own lines.
lbp_dry_run_summarised() {
  local out status
  out=$(mktemp -d "${TMPDIR:-/tmp}/lbp_dry_run.XXXXXX") || { lbp_die 2 "cannot create a" \
    "temporary directory under ${TMPDIR:-/tmp}"; return; }
  # The run in a subshell with the caller's errexit (a `|| status=$?` would turn it off).
  local errexit=0
  if [[ $- == *e* ]]; then errexit=1; fi
  set +e
  ( if [ "$errexit" = 1 ]; then set -e; fi
    LBP_SUMMARY_OUT=$out/summary lbp_main "$@" ) >"$out/run"
  status=$?
  if [ "$errexit" = 1 ]; then set -e; fi
  if [ -s "$out/summary" ]; then
    sed 's/^/[lbp] /' "$out/summary"
    { grep -E '^\[lbp\] (exit time|a job would refuse):' "$out/run" || true; } \
      | sed 's/^\[lbp\] /[lbp]   /'
  fi
  cat "$out/run"
  rm -rf "$out"
  return "$status"
}

# lbp_main [--dry-run] [--chain N] [--] [extra training flags...]
lbp_main() {
  local argv=("$@")
  # What the chain's next job is submitted with: this job's arguments and environment.
  mapfile -d '' LBP_ENV0 < <(env -0)
  LBP_ARGS0=()
  LBP_CLI_EXTRA=()
  LBP_CHAIN=${LBP_CHAIN:-1}
  while [ $# -gt 0 ]; do
    case "$1" in
      --dry-run) LBP_DRY_RUN=1; LBP_ARGS0+=("$1") ;;
      --chain)
        if [ $# -lt 2 ] || ! lbp_is_uint "$2" || [ "$2" -lt 1 ]; then
          lbp_die 2 "--chain ${2:-}: give the number of jobs in the chain (>= 1)"
          return
        fi
        LBP_CHAIN=$2; shift ;;
      --) shift; LBP_CLI_EXTRA+=("$@"); LBP_ARGS0+=(-- "$@"); break ;;
      *) LBP_CLI_EXTRA+=("$1"); LBP_ARGS0+=("$1") ;;
    esac
    shift
  done
  if [ "${LBP_DRY_RUN:-0}" = 1 ] && [ -z "${LBP_SUMMARY_OUT:-}" ] && [ -z "${LBP_SETTINGS_OUT:-}" ]; then
    lbp_dry_run_summarised "${argv[@]}"
    return
  fi
  lbp_defaults || return
  lbp_ds_check || return
  lbp_start_from || return
  if [ -n "${LBP_SETTINGS_OUT:-}" ]; then  # the study (scripts/launch/lbp_study.sh) reads the profile's values
    lbp_write_settings "$LBP_SETTINGS_OUT"
    return
  fi
  lbp_resolve_nodes || return
  lbp_ds_check_nodes || return
  lbp_check_hierarchy || return
  lbp_check_paths || return
  LBP_TMP=$(mktemp -d "${TMPDIR:-/tmp}/lbp_launch.XXXXXX") || { lbp_die 2 "cannot create a" \
    "temporary directory under ${TMPDIR:-/tmp}"; return; }
  # shellcheck disable=SC2064  # the path now
  trap "rm -rf '$LBP_TMP'" EXIT
  lbp_site_env || return
  if [ "$LBP_DRY_RUN" != 1 ] && [ -n "${SLURM_JOB_ID:-}" ]; then
    lbp_sbcast_env || return
  fi
  lbp_setup_python || return
  lbp_resolve_entry || return
  lbp_check_contents || return
  lbp_estimate || return
  lbp_check_hierarchy || return
  lbp_retention_mode
  lbp_master_addr
  lbp_build_srun
  if [ "$LBP_DRY_RUN" != 1 ]; then
    lbp_launch_job || return
    return 0
  fi
  lbp_exit_time || return
  lbp_build_train_args
  lbp_resolve_capabilities || return
  lbp_print_commands
  lbp_ds_print_config || return
  if [ "$LBP_CHAIN" -gt 1 ]; then
    lbp_log "chain: --chain $LBP_CHAIN: this job submits the next at its start" \
      "(--dependency=afterany:<this job>, the same sbatch options), $((LBP_CHAIN - 1)) more;" \
      "a job stops the chain when training is complete or the tracker has not moved"
  fi
  lbp_prune --dry-run || return
  { lbp_py checkpoints space "$CHECKPOINT_DIR" --checkpoint-bytes "$LBP_CKPT_BYTES" 2>&1 || true; } \
    | sed 's/^lbp_launch: error: /a job would refuse: /; s/^/[lbp] /'
  lbp_log "dry run: not launching (unset LBP_DRY_RUN / drop --dry-run to run srun)"
}
