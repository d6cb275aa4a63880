# shellcheck shell=bash
# The site environment of the launchers (sourced by lbp_launch.sh): the Frontier (or
# local) defaults, `module load`, the Python environment, an sbcast'd environment.
# Order: the user's exported values are remembered, the modules are loaded, then the
# defaults are applied and the user's values put back over them (lbp_site_env).

# The Frontier environment, in the order OLCF documents it. A variable the user exported
# wins over these defaults, and the defaults win over what `module load` set (the defaults
# are applied after the modules: lbp_site_env).
#   [P] OLCF "PyTorch on Frontier" (docs.olcf.ornl.gov/software/analytics/pytorch_frontier.html),
#       "Manual RCCL Network Plugin Configuration": the variables "strongly recommended by
#       HPE and AMD on Frontier"; its "Alternative Rendezvous Protocol" (FI_CXI_RDZV_PROTO
#       with #SBATCH --network=disable_rdzv_get) and "Master Address and Sockets" (port 3442).
#       NCCL_NET: OFI forces the plugin on multi-node jobs, Socket on one node (the plugin
#       does not initialise there), same section. NCCL_SOCKET_IFNAME: the page lists
#       hsn0,hsn1,hsn2,hsn3 and advises hsn0 alone "if you happen to encounter hangs".
#   [U] OLCF Frontier User Guide (docs.olcf.ornl.gov/systems/frontier_user_guide.html):
#       -c 7 per GCD with core specialisation (56 usable cores / 8 GCDs), OMP_NUM_THREADS.
# CUDA_DEVICE_MAX_CONNECTIONS is not set: Megatron needs it = 1 only with tensor/context
# parallelism, and these runs are data-parallel only (an exported value still wins).
# FI_CXI_ATS=0 is no longer on OLCF's list and is not set.
lbp_frontier_defaults() {
  local net=OFI
  [ "${NNODES_RESOLVED:-2}" -gt 1 ] || net=Socket
  LBP_SITE_DEFAULTS=(
    "NCCL_NET=$net"                        # [P]
    "NCCL_CROSS_NIC=1"                     # [P]
    "NCCL_NET_GDR_LEVEL=PHB"               # [P]
    "NCCL_SOCKET_IFNAME=hsn0,hsn1,hsn2,hsn3"  # [P]
    "HSA_FORCE_FINE_GRAIN_PCIE=1"          # [P]
    "FI_MR_CACHE_MONITOR=kdreg2"           # [P] (never memhooks: deadlocks with the plugin)
    "FI_CXI_DISABLE_HOST_REGISTER=1"       # [P]
    "FI_CXI_DEFAULT_CQ_SIZE=131072"        # [P]
    "FI_CXI_RDZV_PROTO=alt_read"           # [P] with #SBATCH --network=disable_rdzv_get
    "FI_CXI_RDZV_EAGER_SIZE=0"             # [P]
    "FI_CXI_RDZV_THRESHOLD=0"              # [P]
    "FI_CXI_RDZV_GET_MIN=0"                # [P]
    "FI_CXI_DEFAULT_TX_SIZE=2048"          # [P]
    "FI_CXI_RX_MATCH_MODE=hybrid"          # [P]
    "OMP_NUM_THREADS=${CPUS_PER_TASK:-7}"  # [U]
  )
  # [P] "Preferred": NCCL_NET_PLUGIN names the plugin library (else the rccl-net-plugin
  # module or LD_LIBRARY_PATH provide it).
  if [ -n "${RCCL_NET_PLUGIN_DIR:-}" ]; then
    LBP_SITE_DEFAULTS+=("NCCL_NET_PLUGIN=$RCCL_NET_PLUGIN_DIR/librccl-net.so")
  fi
}

lbp_local_defaults() {
  LBP_SITE_DEFAULTS=("OMP_NUM_THREADS=1" "PYTHONWARNINGS=ignore")
}

# Modules first, then the launcher's defaults, and what the user exported over both.
lbp_site_env() {
  case "${LBP_SITE:-frontier}" in
    frontier) lbp_frontier_defaults ;;
    local) lbp_local_defaults ;;
    *) lbp_die 2 "LBP_SITE=$LBP_SITE: use frontier or local"; return ;;
  esac
  local kv name user=()
  for kv in "${LBP_SITE_DEFAULTS[@]}"; do
    name=${kv%%=*}
    [ -n "${!name+x}" ] && user+=("$name=${!name}")
  done
  lbp_load_modules || return
  for kv in "${LBP_SITE_DEFAULTS[@]}" "${user[@]}"; do  # the user's values last: they win
    export "${kv%%=*}=${kv#*=}"
  done
  LBP_ENV_SHOWN=""
  for kv in "${LBP_SITE_DEFAULTS[@]}"; do LBP_ENV_SHOWN="$LBP_ENV_SHOWN ${kv%%=*}"; done
  LBP_ENV_USER=""
  for kv in "${user[@]}"; do LBP_ENV_USER="$LBP_ENV_USER ${kv%%=*}"; done
  # [P] "Because using a non-default CPE": Cray's libraries first, as the modules left them.
  if [ -n "${CRAY_LD_LIBRARY_PATH:-}" ]; then
    export LD_LIBRARY_PATH=$CRAY_LD_LIBRARY_PATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
}

# `module load`. Missing `module` is not an error (laptops, CI).
lbp_load_modules() {
  [ -n "${LBP_MODULES:-}" ] || return 0
  if command -v module >/dev/null 2>&1 || declare -F module >/dev/null; then
    # shellcheck disable=SC2086  # a list of module names
    module load $LBP_MODULES || { lbp_die 2 "module load $LBP_MODULES failed: set LBP_MODULES"; return; }
    lbp_log "modules: loaded $LBP_MODULES"
  else
    lbp_log "no 'module' command here: not loading LBP_MODULES=$LBP_MODULES"
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

