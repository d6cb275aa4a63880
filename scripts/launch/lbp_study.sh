#!/bin/bash
# The adoption study in one command: node counts x schemes (lbp, zeropp, zero3, stock Megatron's
# distributed optimizer), the same model, data, tokenizer and settings (a profile script's),
# a fixed number of iterations each, all in ONE sbatch of the largest node count, each run a
# fresh `bash PROFILE` (its own srun, health check and result file), one after another.
#
#   STUDY_NODES=1,2,4,8 STUDY_SCALING=weak bash scripts/launch/lbp_study.sh scripts/frontier_gpt20b.sh --dry-run
#   STUDY_NODES=1,2,4,8 STUDY_SCALING=weak STUDY_SBATCH_ARGS="-A PROJ" bash scripts/launch/lbp_study.sh scripts/frontier_gpt20b.sh
#
# The dry run prints the runs, their order and the cost in node-hours (python -m
# megatron_lbp.study plan) and the sbatch command; without --dry-run that command is
# submitted. In the job, a run that exits non-zero without a result file is recorded as
# failed with its exit status and last error line (python -m megatron_lbp.study
# record-failure) and the study goes on; at the end python -m megatron_lbp.study report
# writes STUDY_DIR/report.md and its PNGs.
#
# Variables (the profile's own variables apply to every run, as for a single job):
#   STUDY_NODES          node counts [1,2,4,8,16,32,48]
#   STUDY_SCHEMES        [lbp,zeropp,zero3,distopt]; zeropp gathers its secondary copy in the node,
#                        zero3 and distopt have none, lbp keeps the profile's; the DeepSpeed
#                        schemes ds-zero3, ds-hpz, ds-zeropp (HIER_PRESET=ds-*: the launcher runs
#                        megatron_lbp/deepspeed_baseline's runner on the same model and data; ds-hpz and
#                        ds-zeropp from 2 nodes) write the same result file
#   STUDY_SCALING        weak (fixed micro-batches per GCD: STUDY_MICRO_BATCHES [1]) or strong
#                        (fixed global batch: STUDY_GLOBAL_BATCH [the profile's GLOBAL_BATCH_SIZE])
#   STUDY_MICRO_BATCH_SIZE  [the profile's MICRO_BATCH_SIZE; 1 where that is auto]
#   STUDY_ITERS          iterations per run [30]; STUDY_SEEDS [1234]: all at the smallest node count
#   STUDY_WARMUP_ITERS   learning-rate warm-up of every run [STUDY_ITERS / 10]: the profile's
#                        (1500 for 20B) is longer than a study run, and Megatron's scheduler
#                        refuses a warm-up that is not shorter than the decay
#   STUDY_STARTUP_S      assumed seconds per run before its first step, for the cost [300]
#   STUDY_STEP_SECONDS   replaces the cost model's step time in the cost
#   STUDY_DIR            where runs/, runs.tsv and report.md go [$PWD/study-<date>]
#   STUDY_KEEP_CHECKPOINTS  1: keep each run's checkpoint (default: deleted after the run)
#   STUDY_SBATCH_ARGS    more sbatch options (-A, -p, -C nvme, ...; word-split)
#   STUDY_HEALTH_CHECK   first (the launcher's health check, devices and links, in the first run at
#                        each node count only: the runs share one allocation, so later runs on as
#                        many nodes would check the same nodes again; they run with
#                        LBP_HEALTH_CHECK=none) or every [first]; LBP_HEALTH_CHECK=0 applies to all
#   LBP_NET_IFACES       interfaces whose byte counters each run reads (Frontier: hsn0,hsn1,hsn2,hsn3)
set -euo pipefail

study_die() { echo "lbp_study: error: $*" >&2; exit "${STUDY_STATUS:-2}"; }

[ $# -ge 1 ] || study_die "usage: bash scripts/launch/lbp_study.sh PROFILE_SCRIPT [--dry-run]"
PROFILE=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
shift
[ -f "$PROFILE" ] || study_die "$PROFILE: no such profile script"
DRY=0
for a in "$@"; do
  case "$a" in --dry-run) DRY=1 ;; *) study_die "$a: unknown argument (only --dry-run)" ;; esac
done
: "${LBP_REPO:=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
export LBP_REPO
: "${STUDY_NODES:=1,2,4,8,16,32,48}" "${STUDY_SCHEMES:=lbp,zeropp,zero3,distopt}"
: "${STUDY_SCALING:=weak}" "${STUDY_ITERS:=30}" "${STUDY_SEEDS:=1234}" "${STUDY_STARTUP_S:=300}"
: "${STUDY_WARMUP_ITERS:=$((STUDY_ITERS / 10))}" "${STUDY_HEALTH_CHECK:=first}"
case "$STUDY_HEALTH_CHECK" in first|every) ;; *) study_die "STUDY_HEALTH_CHECK=$STUDY_HEALTH_CHECK: use first or every" ;; esac
: "${STUDY_DIR:=$PWD/study-$(date +%Y%m%d-%H%M%S)}"
PY=${LBP_PYTHON:-python}
[ -z "${LBP_PYTHON:-}" ] && [ -x "$LBP_REPO/.venv/bin/python" ] && PY=$LBP_REPO/.venv/bin/python

study_settings() {  # the profile's resolved values, without launching anything
  local out
  P_NUM_LAYERS="" P_HIDDEN_SIZE="" P_NUM_ATTENTION_HEADS="" P_SEQ_LENGTH="" P_VOCAB_SIZE_PADDED=""
  P_GLOBAL_BATCH_SIZE="" P_MICRO_BATCH_SIZE="" P_TASKS_PER_NODE="" P_GCDS_PER_PACKAGE=""
  P_HIER_SECONDARY_GROUP_SIZE="" P_LBP_PROFILE=""
  out=$(mktemp)
  LBP_SETTINGS_OUT=$out bash "$PROFILE" >/dev/null || study_die "$PROFILE could not resolve its settings"
  while IFS='=' read -r key value; do
    case "$key" in
      NUM_LAYERS|HIDDEN_SIZE|NUM_ATTENTION_HEADS|SEQ_LENGTH|VOCAB_SIZE_PADDED|GLOBAL_BATCH_SIZE|\
      MICRO_BATCH_SIZE|TASKS_PER_NODE|GCDS_PER_PACKAGE|HIER_SECONDARY_GROUP_SIZE|LBP_PROFILE)
        printf -v "P_$key" '%s' "$value" ;;
    esac
  done <"$out"
  rm -f "$out"
}

study_plan() {  # prints the plan; writes $STUDY_DIR/runs.tsv
  local mbs=${STUDY_MICRO_BATCH_SIZE:-$P_MICRO_BATCH_SIZE}
  [ "$mbs" = auto ] && mbs=1
  STUDY_MBS=$mbs
  local args=(--nodes "$STUDY_NODES" --schemes "$STUDY_SCHEMES" --scaling "$STUDY_SCALING"
              --tasks-per-node "$P_TASKS_PER_NODE" --gcds-per-package "$P_GCDS_PER_PACKAGE"
              --micro-batch-size "$mbs" --iters "$STUDY_ITERS" --seeds "$STUDY_SEEDS"
              --startup-s "$STUDY_STARTUP_S" --num-layers "$P_NUM_LAYERS" --hidden-size "$P_HIDDEN_SIZE"
              --num-attention-heads "$P_NUM_ATTENTION_HEADS" --seq-length "$P_SEQ_LENGTH"
              --vocab-size "$P_VOCAB_SIZE_PADDED" --runs-file "$STUDY_DIR/runs.tsv")
  if [ "$STUDY_SCALING" = weak ]; then args+=(--micro-batches "${STUDY_MICRO_BATCHES:-1}")
  else args+=(--global-batch "${STUDY_GLOBAL_BATCH:-$P_GLOBAL_BATCH_SIZE}"); fi
  [ -n "${STUDY_STEP_SECONDS:-}" ] && args+=(--step-seconds "$STUDY_STEP_SECONDS")
  echo "[study] profile $PROFILE ($P_LBP_PROFILE): ${P_NUM_LAYERS} layers, hidden $P_HIDDEN_SIZE," \
    "sequence $P_SEQ_LENGTH, micro-batch size $mbs, $P_TASKS_PER_NODE GCDs per node; results in $STUDY_DIR"
  "$PY" -m megatron_lbp.study plan "${args[@]}" || STUDY_STATUS=$? study_die "the plan was refused (above)"
}

STUDY_CHECKED_NODES=" "   # node counts a run of this study has health-checked
study_run_one() {  # study_run_one NAME NODES SCHEME GLOBAL_BATCH SEED
  local name=$1 nodes=$2 scheme=$3 gbs=$4 seed=$5 dir=$STUDY_DIR/runs/$1 status=0 sec
  local health=${LBP_HEALTH_CHECK:-1} check="health check on"
  mkdir -p "$dir"
  if [ "$health" != 1 ]; then check="health check $health (LBP_HEALTH_CHECK=$health)"
  elif [ "$STUDY_HEALTH_CHECK" = first ]; then
    case "$STUDY_CHECKED_NODES" in
      *" $nodes "*) health=none check="health check none (an earlier run checked these $nodes node(s))" ;;
      *) STUDY_CHECKED_NODES+="$nodes " ;;
    esac
  fi
  # lbp keeps the profile's secondary copy; every other scheme the one its preset implies
  sec=$P_HIER_SECONDARY_GROUP_SIZE
  [ "$scheme" = lbp ] || sec=$("$PY" -m megatron_lbp.launch job implied-secondary "$scheme" "$P_TASKS_PER_NODE")
  echo "[study] $(date -u +%H:%M:%S) run $name: $nodes node(s), $scheme, global batch $gbs, seed $seed, $check"
  ( export NNODES=$nodes LBP_HEALTH_CHECK=$health HIER_PRESET=$scheme HIER_SECONDARY_GROUP_SIZE=$sec GLOBAL_BATCH_SIZE=$gbs \
      MICRO_BATCH_SIZE=$STUDY_MBS TRAIN_ITERS=$STUDY_ITERS LR_WARMUP_ITERS=$STUDY_WARMUP_ITERS LBP_CHAIN=1 CHECKPOINT_DIR=$dir/checkpoint \
      LBP_RESULT_FILE=$dir/result.json LBP_STUDY_SCALING=$STUDY_SCALING LBP_STUDY_RUN=$name \
      EXTRA_ARGS="${EXTRA_ARGS:-} --seed $seed"
    bash "$PROFILE" ) >"$dir/log" 2>&1 || status=$?
  if [ ! -f "$dir/result.json" ]; then
    local why
    why=$(grep -E 'error|Error|killed|CANCELLED' "$dir/log" | tail -1 | cut -c1-300)
    "$PY" -m megatron_lbp.study record-failure "$dir/result.json" \
      --reason "exit $status: ${why:-no error line; see $dir/log}" --field "scheme=$scheme" \
      --field "nodes=$nodes" --field "gcds=$((nodes * P_TASKS_PER_NODE))" --field "seed=$seed" \
      --field "global_batch=$gbs" --field "scaling=$STUDY_SCALING" --field "study_run=$name"
  fi
  # a study measures, it does not keep weights: a 20B checkpoint per run would fill the disk
  [ "${STUDY_KEEP_CHECKPOINTS:-0}" = 1 ] || rm -rf "$dir/checkpoint"
  echo "[study] $(date -u +%H:%M:%S) run $name: exit $status, $(grep -o '"status": "[a-z]*"' "$dir/result.json" || echo 'no result')"
}

study_settings
mkdir -p "$STUDY_DIR"
STUDY_DIR=$(cd "$STUDY_DIR" && pwd)
study_plan
walltime=$(awk -F'\t' '$1=="#walltime_minutes"{print $2}' "$STUDY_DIR/runs.tsv")
alloc=$(awk -F'\t' '$1=="#allocation_nodes"{print $2}' "$STUDY_DIR/runs.tsv")

if [ "${STUDY_IN_JOB:-0}" = 1 ]; then
  [ -n "${SLURM_JOB_ID:-}" ] || study_die "STUDY_IN_JOB=1 outside a Slurm job"
  while IFS=$'\t' read -r name nodes scheme gbs seed; do
    case "$name" in '#'*|'') continue ;; esac
    study_run_one "$name" "$nodes" "$scheme" "$gbs" "$seed" </dev/null
  done <"$STUDY_DIR/runs.tsv"
  "$PY" -m megatron_lbp.study report "$STUDY_DIR/runs" >/dev/null \
    && echo "[study] report: $STUDY_DIR/runs/report.md"
  exit 0
fi

# shellcheck disable=SC2206  # a list of sbatch options
SBATCH=(sbatch -N "$alloc" -t "$walltime" -J lbp-study -o "$STUDY_DIR/study-%j.out"
        "--export=ALL,STUDY_IN_JOB=1,STUDY_DIR=$STUDY_DIR,LBP_REPO=$LBP_REPO" ${STUDY_SBATCH_ARGS:-}
        "$LBP_REPO/scripts/launch/lbp_study.sh" "$PROFILE")
echo "[study] sbatch command: ${SBATCH[*]}"
if [ "$DRY" = 1 ]; then
  echo "[study] dry run: nothing submitted"
  exit 0
fi
"${SBATCH[@]}"
