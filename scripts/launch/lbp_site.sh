# shellcheck shell=bash
# The site side of the launcher (sourced by lbp_launch.sh): `module load`, the Python
# environment, an sbcast'd copy of it, and the site's exports (their values and the order
# user > defaults > modules: megatron_lbp/launch/site.py).

# `module load`. Missing `module` is not an error (laptops, CI).
lbp_load_modules() {
  if [ -n "${LBP_MODULES:-}" ]; then
    if command -v module >/dev/null 2>&1 || declare -F module >/dev/null; then
      # shellcheck disable=SC2086  # a list of module names
      module load $LBP_MODULES || { lbp_die 2 "module load $LBP_MODULES failed: set LBP_MODULES"; return; }
      lbp_log "modules: loaded $LBP_MODULES"
    else
      lbp_log "no 'module' command here: not loading LBP_MODULES=$LBP_MODULES"
    fi
  fi
  # OLCF "PyTorch on Frontier", "Because using a non-default CPE": Cray's libraries first,
  # as the modules left them.
  if [ -n "${CRAY_LD_LIBRARY_PATH:-}" ]; then
    export LD_LIBRARY_PATH=$CRAY_LD_LIBRARY_PATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
}

# The Python environment (after the modules: conda/ROCm come from them). A missing
# LBP_ACTIVATE file is an error.
lbp_setup_python() {
  if [ -n "${LBP_CONDA_ENV:-}" ]; then
    command -v conda >/dev/null 2>&1 || { lbp_die 2 "LBP_CONDA_ENV=$LBP_CONDA_ENV but no conda" \
      "command (load the miniforge3 module in LBP_MODULES)"; return; }
    set +u
    eval "$(conda shell.bash hook)" && conda activate "$LBP_CONDA_ENV"
    local rc=$?
    set -u
    [ "$rc" = 0 ] || { lbp_die 2 "conda activate $LBP_CONDA_ENV failed: set LBP_CONDA_ENV"; return; }
  else
    if [ -z "${LBP_ACTIVATE+x}" ] && [ -f "$LBP_REPO/.venv/bin/activate" ]; then
      LBP_ACTIVATE=$LBP_REPO/.venv/bin/activate
    fi
    if [ -n "${LBP_ACTIVATE:-}" ]; then
      [ -f "$LBP_ACTIVATE" ] || { lbp_die 2 "LBP_ACTIVATE=$LBP_ACTIVATE does not exist: set it to" \
        "your venv/conda-pack activate script, or to an empty string to use the current python"; return; }
      set +u
      # shellcheck disable=SC1090
      . "$LBP_ACTIVATE"
      set -u
    fi
  fi
  LBP_PYTHON=${LBP_PYTHON:-python}
  command -v "$LBP_PYTHON" >/dev/null 2>&1 || { lbp_die 2 "LBP_PYTHON=$LBP_PYTHON not found:" \
    "set LBP_ACTIVATE or LBP_PYTHON"; return; }
  # megatron_lbp importable even when it is not installed into the environment
  case ":${PYTHONPATH:-}:" in *":$LBP_REPO:"*) ;; *) export PYTHONPATH=$LBP_REPO${PYTHONPATH:+:$PYTHONPATH} ;; esac
}

# sbcast a packed environment to every node's local storage and unpack it there (OLCF
# "Sbcast Conda Environments", docs.olcf.ornl.gov/software/python/sbcast_conda.html);
# the batch shell then activates the copy on its node, which the tasks inherit.
lbp_sbcast_env() {
  [ -n "${LBP_SBCAST_ENV:-}" ] || return 0
  local dir=${LBP_SBCAST_DIR:-/mnt/bb/${USER:-$(id -un)}} n=$NNODES_RESOLVED
  local dest=$dir/lbp_env
  lbp_log "sbcast: $LBP_SBCAST_ENV -> $dest on $n node(s)"
  sbcast -pf "$LBP_SBCAST_ENV" "$dest.tar.gz" || { lbp_die 4 "sbcast of LBP_SBCAST_ENV=$LBP_SBCAST_ENV" \
    "to $dir failed (on Frontier, submit with -C nvme; partial files may be left there)"; return; }
  # shellcheck disable=SC2016  # expanded by the per-node shell
  srun -N "$n" --ntasks-per-node=1 bash -c 'rm -rf "$1" && mkdir -p "$1" && tar -xzf "$1.tar.gz" -C "$1" \
    && if [ -x "$1/bin/conda-unpack" ]; then "$1/bin/conda-unpack"; fi' _ "$dest" \
    || { lbp_die 4 "unpacking $dest.tar.gz on the nodes failed"; return; }
  [ -f "$dest/bin/activate" ] || { lbp_die 4 "LBP_SBCAST_ENV=$LBP_SBCAST_ENV has no bin/activate" \
    "(pack it with conda pack --format tar.gz)"; return; }
  LBP_ACTIVATE=$dest/bin/activate
  unset LBP_CONDA_ENV
}

# What python -m megatron_lbp.launch job resolved for the job's environment (the site's
# variables, the rendezvous, a patched tree's PYTHONPATH), exported.
lbp_export() {  # lbp_export FILE
  local kv words=()
  lbp_words "$1" words
  for kv in "${words[@]}"; do export "${kv?}"; done
}
