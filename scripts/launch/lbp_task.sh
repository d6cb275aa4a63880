#!/usr/bin/env bash
# Per-task wrapper: srun runs this once per task (one per GCD); it runs "$@".
#
# Ranks are read HERE, per task, from Slurm's own variables (SLURM_PROCID,
# SLURM_NTASKS): exporting RANK=$SLURM_PROCID in the batch script would give
# every task rank 0. LOCAL_RANK is deliberately NOT exported:
#  - with --gpus-per-task=1 --gpu-bind=closest each task sees its one GCD as
#    device 0, and Megatron calls torch.cuda.set_device(LOCAL_RANK or 0), so 0
#    is the right device index;
#  - megatron-lbp's topology then reads the node and package of this rank
#    from SLURM_LOCALID / SLURM_NODEID / SLURM_TASKS_PER_NODE (RANK without
#    LOCAL_RANK next to SLURM_PROCID -> Slurm's variables win).
# LBP_EXPORT_LOCAL_RANK=1 exports LOCAL_RANK=SLURM_LOCALID instead (for
# bindings where every task sees all GPUs of its node).
#
# Before "$@", the task's place is verified (python -m megatron_lbp.launch placement:
# ranks fill nodes in order, each package's ranks on one package's GCDs by
# ROCR_VISIBLE_DEVICES; exit 4 otherwise, a warning with --hier-allow-non-colocated in
# "$@"), and then the visibility variables other than ROCR_VISIBLE_DEVICES are unset
# (ROCm applies HIP_/CUDA_VISIBLE_DEVICES on top of it: Slurm's node-wide index 4 would
# select nothing among the one device ROCR leaves). The launcher exports the layout as
# LBP_TASKS_PER_NODE, LBP_GCDS_PER_PACKAGE, LBP_GPUS_PER_TASK; without them (a task not
# started by the launcher) the check is skipped.
set -euo pipefail
: "${SLURM_PROCID:?lbp_task.sh runs under srun (SLURM_PROCID is not set)}"
export RANK=$SLURM_PROCID
export WORLD_SIZE=${SLURM_NTASKS:-${SLURM_NPROCS:?SLURM_NTASKS is not set}}
if [ "${LBP_EXPORT_LOCAL_RANK:-0}" = 1 ]; then
  export LOCAL_RANK=${SLURM_LOCALID:-0}
else
  unset LOCAL_RANK
fi
root=${LBP_NODE_LOCAL_ROOT:-/tmp}
if [ -n "${LBP_TASKS_PER_NODE:-}" ]; then
  allow=()
  for a in "$@"; do [ "$a" = --hier-allow-non-colocated ] && allow=(--allow-non-colocated); done
  "${LBP_PYTHON:-python}" -m megatron_lbp.launch placement --tasks-per-node "$LBP_TASKS_PER_NODE" \
    --gcds-per-package "${LBP_GCDS_PER_PACKAGE:-2}" --gpus-per-task "${LBP_GPUS_PER_TASK:-1}" \
    --exchange-root "$root" "${allow[@]}"
  if [ -n "${ROCR_VISIBLE_DEVICES:-}" ]; then
    unset HIP_VISIBLE_DEVICES CUDA_VISIBLE_DEVICES GPU_DEVICE_ORDINAL
  else
    unset HIP_VISIBLE_DEVICES GPU_DEVICE_ORDINAL
  fi
fi
# MIOpen's kernel cache and user database, and Triton's kernel cache, on node-local
# storage, fresh per job and per task (one SQLite database per process avoids lock
# contention; the shared home file system is slow and stale across ROCm versions).
dir="$root/lbp-cache-${SLURM_JOB_ID:-nojob}-${SLURM_PROCID}"
rm -rf "$dir" && mkdir -p "$dir/miopen" "$dir/triton"
export MIOPEN_USER_DB_PATH=$dir/miopen MIOPEN_CUSTOM_CACHE_DIR=$dir/miopen TRITON_CACHE_DIR=$dir/triton
if [ "$RANK" = 0 ]; then
  echo "[lbp_task] rank 0 of $WORLD_SIZE on ${SLURMD_NODENAME:-$(hostname)}" \
       "(node ${SLURM_NODEID:-0}, local ${SLURM_LOCALID:-0}," \
       "visible GPUs ${ROCR_VISIBLE_DEVICES:-${CUDA_VISIBLE_DEVICES:-none}})," \
       "master ${MASTER_ADDR:-?}:${MASTER_PORT:-?}, caches in $dir"
fi
exec "$@"
