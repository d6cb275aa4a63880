# shellcheck shell=bash
# What the launcher does inside a job, with the job python -m megatron_lbp.launch job resolved
# (sourced by lbp_launch.sh): the torch-build check, the chain's decision and its next job,
# checkpoint retention and the free-space check, the health-check step, the training step
# with a pruner beside it.

# The job chain: stop when training is complete or the previous job made no progress.
lbp_chain_decide() {
  local args=(checkpoints chain "$CHECKPOINT_DIR" --train-iters "$TRAIN_ITERS"
              --resolved "$LBP_TMP/chain")
  if [ -n "${LBP_CHAIN_PREVIOUS_ITERATION:-}" ]; then
    args+=(--previous-iteration "$LBP_CHAIN_PREVIOUS_ITERATION"
           --previous-job "${LBP_CHAIN_PREVIOUS_JOB:-?}")
  fi
  lbp_py "${args[@]}" | sed 's/^/[lbp] /'
  local status=${PIPESTATUS[0]}
  [ "$status" = 0 ] || return "$status"
  lbp_read_resolved "$LBP_TMP/chain" CHAIN_STATE TRACKER_ITERATION
}

# Submit the chain's next job: it starts when this one ends, however it ends. The
# environment is the one this job started with (before modules and defaults).
lbp_chain_submit() {
  LBP_NEXT_JOB=""
  [ "${LBP_CHAIN:-1}" -gt 1 ] || return 0
  local script=${LBP_PROFILE_SCRIPT:-}
  [ -f "$script" ] || { lbp_die 2 "--chain: the profile script is unknown (LBP_PROFILE_SCRIPT)"; return; }
  local opts=(--parsable --dependency="afterany:$SLURM_JOB_ID" --chdir "${SLURM_SUBMIT_DIR:-$PWD}")
  local rec acct part qos limit feat name
  rec=$(squeue -h -j "$SLURM_JOB_ID" -o '%a|%P|%q|%l|%f|%j' 2>/dev/null | head -n1)
  IFS='|' read -r acct part qos limit feat name <<<"$rec"
  [ -n "$name" ] && opts+=(-J "$name")
  local kv
  for kv in "-A=$acct" "-p=$part" "-q=$qos" "-t=$limit" "-C=$feat"; do
    case "${kv#*=}" in ""|"(null)"|"N/A"|normal) ;; *) opts+=("${kv%%=*}" "${kv#*=}") ;; esac
  done
  opts+=(-N "$NNODES_RESOLVED")
  if [ -n "${LBP_CHAIN_SBATCH_ARGS:-}" ]; then
    # shellcheck disable=SC2206  # a list of sbatch options
    opts+=($LBP_CHAIN_SBATCH_ARGS)
  fi
  local envs=() e
  for e in "${LBP_ENV0[@]}"; do
    case "$e" in SLURM_CONF=*) envs+=("$e") ;; SLURM_*|SLURMD_*|LBP_CHAIN_PREVIOUS_*) ;; *) envs+=("$e") ;; esac
  done
  envs+=("LBP_CHAIN_PREVIOUS_ITERATION=${TRACKER_ITERATION:-0}" "LBP_CHAIN_PREVIOUS_JOB=$SLURM_JOB_ID")
  local out args0=()
  lbp_words args0 args0
  out=$(env -i "${envs[@]}" sbatch "${opts[@]}" "$script" --chain "$((LBP_CHAIN - 1))" \
        "${args0[@]}") || { lbp_die 4 "--chain: sbatch of the next job failed: $out"; return; }
  LBP_NEXT_JOB=${out%%;*}
  lbp_log "chain: submitted job $LBP_NEXT_JOB (--dependency=afterany:$SLURM_JOB_ID, chain of" \
    "$((LBP_CHAIN - 1)) more): $(lbp_quote sbatch "${opts[@]}" "$script" --chain "$((LBP_CHAIN - 1))" "${args0[@]}")"
}

lbp_health_step() {
  if [ -n "$LBP_HEALTH_NOTE" ]; then lbp_log "$LBP_HEALTH_NOTE"; return 0; fi
  local args=()
  lbp_words health args
  lbp_log "health check: $(lbp_quote "${SRUN[@]}" "$LBP_PYTHON" -m megatron_lbp.launch "${args[@]}")"
  # Its own rendezvous port: the training step's may still be in TIME_WAIT after it.
  local status=0
  MASTER_PORT=$((MASTER_PORT + 1)) "${SRUN[@]}" "$LBP_PYTHON" -m megatron_lbp.launch "${args[@]}" \
    || status=$?
  [ "$status" = 0 ] || { echo "lbp_launch: error: the health check failed (status $status, its" \
    "reason above); not training" >&2; return 4; }
}

lbp_prune() {  # lbp_prune [--at-start] [--dry-run] [--every S]
  lbp_py checkpoints prune "$CHECKPOINT_DIR" --keep-last "$LBP_KEEP_LAST" \
    --milestone-every "$LBP_MILESTONE_EVERY" --prefix "[lbp] " "$@"
}

lbp_launch_job() {
  lbp_read_resolved "$LBP_TMP/job.env" NNODES_RESOLVED CHECKPOINT_DIR DATA_CACHE_PATH \
    TENSORBOARD_DIR TRAIN_ITERS LBP_KEEP_LAST LBP_MILESTONE_EVERY LBP_PRUNE_EVERY_S LBP_RETAIN_BY \
    LBP_CKPT_BYTES LBP_CHAIN LBP_HEALTH_NOTE
  lbp_export exports
  if [ -n "${LBP_SBCAST_ENV:-}" ]; then   # the tasks' Python from each node's own copy
    lbp_sbcast_env && lbp_setup_python || return
  fi
  local check=()
  SRUN=()
  lbp_words srun SRUN
  lbp_words build_check check
  if [ ${#check[@]} -gt 0 ]; then lbp_py "${check[@]}" || return 4; fi
  lbp_chain_decide || return
  if [ "$CHAIN_STATE" = complete ]; then return 0; fi
  lbp_py job exit-time --state "$LBP_TMP" || return  # too little time left: refuse now
  lbp_prune --at-start || return
  lbp_py checkpoints space "$CHECKPOINT_DIR" --checkpoint-bytes "$LBP_CKPT_BYTES" \
    | sed 's/^/[lbp] /'
  [ "${PIPESTATUS[0]}" = 0 ] || return 4
  mkdir -p "$CHECKPOINT_DIR" ${DATA_CACHE_PATH:+"$DATA_CACHE_PATH"} ${TENSORBOARD_DIR:+"$TENSORBOARD_DIR"} \
    || { lbp_die 4 "cannot create CHECKPOINT_DIR=$CHECKPOINT_DIR (or its data_cache/tensorboard)"; return; }
  lbp_export task_exports  # what lbp_task.sh needs to check each task's place
  lbp_health_step || return
  # After the health check, just before training; a refusal submits nothing.
  lbp_py job exit-time --state "$LBP_TMP" || return
  lbp_chain_submit || return
  lbp_py job commands --state "$LBP_TMP" || return
  local train=()
  lbp_words train train
  lbp_read_resolved "$LBP_TMP/job.env" LBP_RUN_DEVICE LBP_EXIT_MEASURED_AT
  # The tasks resolve for the same device, and refuse if they do not have it.
  [ "$LBP_RUN_DEVICE" = gpu ] && export LBP_DEVICE=gpu
  local pruner=""
  if [ "$LBP_RETAIN_BY" = launcher ] && [ "$LBP_PRUNE_EVERY_S" -gt 0 ]; then
    # A plain command in the background: $! is the pruner itself, ended by PID below.
    "$LBP_PYTHON" -m megatron_lbp.launch checkpoints prune "$CHECKPOINT_DIR" \
      --keep-last "$LBP_KEEP_LAST" --milestone-every "$LBP_MILESTONE_EVERY" --prefix "[lbp] " \
      --every "$LBP_PRUNE_EVERY_S" &
    pruner=$!
  fi
  lbp_log "launching at $(date -u +%FT%TZ)"
  # Megatron's clock for --exit-duration-in-mins starts when the time left was measured,
  # not after the imports (megatron_lbp.integration.training_hooks.start_clock_at_launch).
  export LBP_LAUNCH_TIME=$LBP_EXIT_MEASURED_AT
  local status=0
  "${SRUN[@]}" "${train[@]}" || status=$?
  lbp_log "training step ended at $(date -u +%FT%TZ) with status $status"
  if [ -n "$pruner" ]; then kill "$pruner" 2>/dev/null || true; wait "$pruner" 2>/dev/null || true; fi
  lbp_prune || true
  if [ -n "$LBP_NEXT_JOB" ]; then
    local state
    state=$(lbp_py checkpoints chain "$CHECKPOINT_DIR" --train-iters "$TRAIN_ITERS" 2>/dev/null) || true
    if [[ "$state" == *"training complete"* ]]; then
      scancel "$LBP_NEXT_JOB" && lbp_log "chain: training complete: cancelled the next job $LBP_NEXT_JOB"
    fi
  fi
  return "$status"
}
