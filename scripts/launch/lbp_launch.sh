# shellcheck shell=bash
# The launcher of megatron-lbp, sourced by the profiles (scripts/frontier_gpt20b.sh and
# scripts/frontier_gpt10b.sh through scripts/launch/frontier_body.sh, scripts/local_profile.sh),
# which export their values (set -a) and call
#     lbp_main "$@"        # [--dry-run] [--chain N] [--] [extra training flags...]
# The shell does what only a shell can: `module load`, the Python environment (and an sbcast
# copy of it), the site's exports, srun, and the chain's next sbatch. Every rule of a launch
# (defaults, what a preset implies, refusals, model flags, memory fit and choice, exit time,
# the srun and training commands) is Python's, once: python -m megatron_lbp.launch job
# (megatron_lbp/launch/job_cli.py); the variables it reads: docs/frontier.md, "Variables".
#
# Every stop prints "lbp_launch: error: ..." (or lbp_health / lbp_task) naming what to set
# or run, and returns: 2 bad input; 3 does not fit in GCD memory; 4 the job or its nodes
# cannot run it (torch build, devices, placement, slow links, too little wall time or disk
# space); 5 the chain stops because the previous job made no progress. "Training complete"
# is status 0 without launching.

# shellcheck source-path=SCRIPTDIR source=lbp_site.sh
. "$LBP_REPO/scripts/launch/lbp_site.sh"
# shellcheck source-path=SCRIPTDIR source=lbp_job.sh
. "$LBP_REPO/scripts/launch/lbp_job.sh"

lbp_die() {  # lbp_die STATUS MESSAGE...
  local status=$1
  shift
  echo "lbp_launch: error: $*" >&2
  return "$status"
}

lbp_log() { echo "[lbp] $*"; }

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

# A NUL-separated word list a Python command wrote, into an array.
lbp_words() { mapfile -d '' -t "$2" <"$LBP_TMP/$1"; }  # lbp_words FILE ARRAY

lbp_quote() {  # words as one shell line, quoting only those that need it
  local w out=""
  for w in "$@"; do
    if [[ "$w" =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]]; then out="$out $w"
    else out="$out $(printf '%q' "$w")"; fi
  done
  echo "${out# }"
}

lbp_main() {
  # What the chain's next job is submitted with, and whose values win over the site's
  # defaults: the environment this job started with, before modules.
  mapfile -d '' LBP_ENV0 < <(env -0)
  LBP_TMP=$(mktemp -d "${TMPDIR:-/tmp}/lbp_launch.XXXXXX") || { lbp_die 2 "cannot create a" \
    "temporary directory under ${TMPDIR:-/tmp}"; return; }
  # shellcheck disable=SC2064  # the path now
  trap "rm -rf '$LBP_TMP'" EXIT
  printf '%s\0' "${LBP_ENV0[@]}" >"$LBP_TMP/env0"
  lbp_load_modules || return
  lbp_setup_python || return
  lbp_py job resolve --state "$LBP_TMP" --script "$0" --env0 "$LBP_TMP/env0" -- "$@" || return
  [ -z "${LBP_SETTINGS_OUT:-}" ] || return 0   # scripts/launch/lbp_study.sh read the settings
  lbp_read_resolved "$LBP_TMP/job.env" LBP_DRY_RUN
  [ "$LBP_DRY_RUN" = 1 ] && return 0           # the dry run printed everything
  lbp_launch_job
}
