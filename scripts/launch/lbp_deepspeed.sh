# shellcheck shell=bash disable=SC2034  # sets the launcher's ENTRY, ENTRY_DESC and LBP_EST_*
# The DeepSpeed baseline in the launcher (sourced by lbp_launch.sh): HIER_PRESET=ds-zero3,
# ds-hpz or ds-zeropp runs megatron_lbp/deepspeed_baseline's pretrain runner (python -m
# megatron_lbp.deepspeed_baseline.pretrain, docs/deepspeed-baseline.md) on the same model, data,
# tokenizer and batch as the profile's pretrain_gpt job, so that the comparison with lbp is
# one variable away. Everything else (site environment, srun line, health check, the
# per-task wrapper) is the profile's own.
#
# What does not apply to a DeepSpeed run is refused before any work, not ignored: the
# engine's hierarchy variables (HIER_SECONDARY_GROUP_SIZE other than 0: hpZ's partition is
# the node, set by the scheme; HIER_GRAD_REDUCE_DTYPE other than fp32; HIER_PREFETCH_UNITS
# or HIER_MAX_PENDING_REDUCES other than auto; --hier-* flags in
# EXTRA_ARGS or on the command line), MEGATRON_LM_DIR, START_FROM and --chain > 1 (the
# runner neither loads nor saves checkpoints), and ds-hpz / ds-zeropp on one node (hpZ's
# node-sized partition would be the whole job). The runner is given no --save/--load/
# --exit-duration-in-mins: a DeepSpeed job runs TRAIN_ITERS iterations and keeps nothing.

LBP_DS_SCHEMES="ds-zero3 ds-hpz ds-zeropp"

lbp_is_ds() { [[ "${HIER_PRESET:-}" == ds-* ]]; }

# The engine preset the estimate (memory, step time) costs a DeepSpeed scheme as: the cost
# model has no DeepSpeed scheme; these are the nearest (ds-zero3 = zero3; hpZ = the
# node-sized secondary copy, in bf16 for ds-hpz and in int8 with qwZ for ds-zeropp).
lbp_ds_estimate_as() {  # sets LBP_EST_PRESET LBP_EST_SECONDARY LBP_EST_SECONDARY_DTYPE
  LBP_EST_PRESET=${HIER_PRESET/#distopt/zero2} LBP_EST_SECONDARY=$HIER_SECONDARY_GROUP_SIZE
  LBP_EST_SECONDARY_DTYPE=$HIER_SECONDARY_DTYPE
  case "${HIER_PRESET:-}" in
    ds-zero3) LBP_EST_PRESET=zero3 LBP_EST_SECONDARY=0 ;;
    ds-hpz) LBP_EST_PRESET=zeropp LBP_EST_SECONDARY=$TASKS_PER_NODE LBP_EST_SECONDARY_DTYPE=bf16 ;;
    ds-zeropp) LBP_EST_PRESET=zeropp LBP_EST_SECONDARY=$TASKS_PER_NODE LBP_EST_SECONDARY_DTYPE=int8 ;;
  esac
  return 0
}

# Inputs a DeepSpeed run cannot honour (after lbp_defaults; before anything runs).
lbp_ds_check() {
  lbp_is_ds || return 0
  case " $LBP_DS_SCHEMES " in *" $HIER_PRESET "*) ;; *)
    lbp_die 2 "HIER_PRESET=$HIER_PRESET: the DeepSpeed schemes are ${LBP_DS_SCHEMES// /, }"; return ;;
  esac
  [ "$HIER_SECONDARY_GROUP_SIZE" = 0 ] || { lbp_die 2 "HIER_SECONDARY_GROUP_SIZE=$HIER_SECONDARY_GROUP_SIZE" \
    "does not apply to HIER_PRESET=$HIER_PRESET (DeepSpeed's hpZ partition is the node, set by the" \
    "scheme): unset it"; return; }
  [ "$HIER_GRAD_REDUCE_DTYPE" = fp32 ] || { lbp_die 2 "HIER_GRAD_REDUCE_DTYPE=$HIER_GRAD_REDUCE_DTYPE" \
    "does not apply to HIER_PRESET=$HIER_PRESET (DeepSpeed reduces gradients in the training dtype):" \
    "unset it"; return; }
  local knob
  case "${HIER_EMBEDDING_BACKWARD_GATHER:-auto}" in auto|gather) ;; *) lbp_die 2 \
    "HIER_EMBEDDING_BACKWARD_GATHER=$HIER_EMBEDDING_BACKWARD_GATHER does not apply to" \
    "HIER_PRESET=$HIER_PRESET (a setting of the engine's schedule): unset it"; return ;; esac
  case "${HIER_LAYER_UNIT:-auto}" in auto|whole) ;; *) lbp_die 2 \
    "HIER_LAYER_UNIT=$HIER_LAYER_UNIT does not apply to HIER_PRESET=$HIER_PRESET (the engine's" \
    "gather units; DeepSpeed fetches by its own config): unset it"; return ;; esac
  for knob in HIER_PREFETCH_UNITS HIER_MAX_PENDING_REDUCES; do
    [ "${!knob:-auto}" = auto ] || { lbp_die 2 "$knob=${!knob} does not apply to" \
      "HIER_PRESET=$HIER_PRESET (a transient knob of the engine's schedule; DeepSpeed prefetches" \
      "and reduces by its own config): unset it"; return; }
  done
  [ -z "${MEGATRON_LM_DIR:-}" ] || { lbp_die 2 "MEGATRON_LM_DIR does not apply to HIER_PRESET=$HIER_PRESET" \
    "(the DeepSpeed runner builds the model from the megatron-core in the Python env): unset it"; return; }
  [ -z "${START_FROM:-}" ] || { lbp_die 2 "START_FROM does not apply to HIER_PRESET=$HIER_PRESET (the" \
    "DeepSpeed runner loads no checkpoint): unset it"; return; }
  [ "$LBP_CHAIN" = 1 ] || { lbp_die 2 "--chain $LBP_CHAIN does not apply to HIER_PRESET=$HIER_PRESET" \
    "(the DeepSpeed runner saves no checkpoint to resume from): run one job"; return; }
  local w
  # shellcheck disable=SC2086  # EXTRA_ARGS is a list of flags
  for w in ${EXTRA_ARGS:-} "${LBP_CLI_EXTRA[@]}"; do
    case "$w" in --hier-*|--use-distributed-optimizer)
      lbp_die 2 "$w does not apply to HIER_PRESET=$HIER_PRESET (DeepSpeed partitions by its scheme):" \
        "drop it from EXTRA_ARGS / the command line"; return ;;
    esac
  done
}

# After the node count is known: hpZ needs more than one node.
lbp_ds_check_nodes() {
  lbp_is_ds || return 0
  if [ "$HIER_PRESET" != ds-zero3 ] && [ "$NNODES_RESOLVED" -lt 2 ]; then
    lbp_die 2 "HIER_PRESET=$HIER_PRESET needs at least 2 nodes (hpZ's node-sized secondary partition" \
      "would be the whole job on $NNODES_RESOLVED): use NNODES >= 2 or HIER_PRESET=ds-zero3"
    return
  fi
}

# The runner as each task's entry; DeepSpeed must import (a benchmark dependency:
# bash scripts/install.sh --test installs it).
lbp_ds_entry() {
  local version
  if ! version=$("$LBP_PYTHON" -c "from megatron_lbp.deepspeed_baseline import environment
environment.prepare()
import deepspeed
print(deepspeed.__version__)" 2>"$LBP_TMP/deepspeed-import"); then
    lbp_die 2 "HIER_PRESET=$HIER_PRESET needs DeepSpeed, which $LBP_PYTHON cannot import ($(grep -v '^\s*$' \
      "$LBP_TMP/deepspeed-import" | tail -1)): it is a benchmark dependency, installed by bash" \
      "scripts/install.sh --test (or pip install -r requirements-test.txt)"
    return
  fi
  version=$(tail -1 <<<"$version")
  ENTRY=("$LBP_PYTHON" -u -m megatron_lbp.deepspeed_baseline.pretrain --ds-scheme "$HIER_PRESET"
         --ds-ranks-per-node "$TASKS_PER_NODE")
  ENTRY_DESC="python -m megatron_lbp.deepspeed_baseline.pretrain (DeepSpeed $version, $HIER_PRESET; megatron-core from the Python env)"
}

# The DeepSpeed config the runner will use for this job shape: megatron_lbp.deepspeed_baseline.schemes
# builds it with the function the runner calls, from the same values (the runner prints the
# one it uses at its start, "[<scheme>] DeepSpeed config: ...").
lbp_ds_print_config() {
  lbp_is_ds || return 0
  local args=(--scheme "$HIER_PRESET" --micro-batch-size "$MICRO_BATCH_SIZE"
              --global-batch-size "$GLOBAL_BATCH_SIZE" --world-size "$WORLD"
              --ranks-per-node "$TASKS_PER_NODE" --clip-grad "$CLIP_GRAD")
  [ "$PRECISION" = bf16 ] && args+=(--bf16)
  local out
  out=$("$LBP_PYTHON" -m megatron_lbp.deepspeed_baseline.schemes "${args[@]}") || {
    lbp_die 2 "no DeepSpeed config for this job shape (above)"; return; }
  lbp_log "DeepSpeed config ($HIER_PRESET, $WORLD ranks, $TASKS_PER_NODE per node; python -m" \
    "megatron_lbp.deepspeed_baseline.schemes $(lbp_quote "${args[@]}")):"
  local line
  while IFS= read -r line; do echo "[lbp]   $line"; done <<<"$out"
  lbp_log "checkpoints: none (the DeepSpeed runner runs TRAIN_ITERS=$TRAIN_ITERS iterations and" \
    "saves nothing); memory and step time above are estimated as the engine's $LBP_EST_PRESET" \
    "(S=$LBP_EST_SECONDARY), the nearest scheme the cost model has"
}
