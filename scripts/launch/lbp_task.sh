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
set -euo pipefail
: "${SLURM_PROCID:?lbp_task.sh runs under srun (SLURM_PROCID is not set)}"
export RANK=$SLURM_PROCID
export WORLD_SIZE=${SLURM_NTASKS:-${SLURM_NPROCS:?SLURM_NTASKS is not set}}
if [ "${LBP_EXPORT_LOCAL_RANK:-0}" = 1 ]; then
  export LOCAL_RANK=${SLURM_LOCALID:-0}
else
  unset LOCAL_RANK
fi
# MIOpen's kernel cache and user database on node-local storage, fresh per job
# and per task (one SQLite database per process avoids lock contention and
# stale entries from the shared home file system).
if [ -n "${LBP_MIOPEN_CACHE_ROOT:-}" ]; then
  dir="$LBP_MIOPEN_CACHE_ROOT/miopen-${SLURM_JOB_ID:-nojob}-${SLURM_PROCID}"
  rm -rf "$dir" && mkdir -p "$dir"
  export MIOPEN_USER_DB_PATH=$dir MIOPEN_CUSTOM_CACHE_DIR=$dir
fi
if [ "$RANK" = 0 ]; then
  echo "[lbp_task] rank 0 of $WORLD_SIZE on ${SLURMD_NODENAME:-$(hostname)}" \
       "(node ${SLURM_NODEID:-0}, local ${SLURM_LOCALID:-0}," \
       "visible GPUs ${ROCR_VISIBLE_DEVICES:-${CUDA_VISIBLE_DEVICES:-none}})," \
       "master ${MASTER_ADDR:-?}:${MASTER_PORT:-?}"
fi
exec "$@"
