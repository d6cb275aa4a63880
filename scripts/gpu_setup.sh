#!/usr/bin/env bash
# Sets up a bare NVIDIA GPU machine for `python -m megatron_lbp.gpu_check`, in .venv at the
# repository root, from the package index only (nothing carried by hand).
#
#   bash scripts/gpu_setup.sh        then   .venv/bin/python -m megatron_lbp.gpu_check --require-gpu
#
# What it installs is scripts/install.sh's: torch==2.13.0 from the package index (on Linux
# x86_64 PyPI's torch wheel is the CUDA build, with its own CUDA libraries and Triton),
# megatron-core 0.19.2 with --no-deps plus its real dependencies from requirements.txt, and
# this package. This script adds what a GPU needs on top: a GPU the driver lists, a torch that
# can use it (a CPU build already in .venv is replaced by the index's CUDA wheel), and the
# check's own stack test (megatron_lbp/gpucheck/stack.py), which refuses with one line.
#
# Idempotent: install.sh returns at once when its stamp matches, the CUDA wheel is fetched
# only when torch cannot see the GPU, and a second run only re-checks.
#
# Without the package index: where the system Python already has a torch that can use the GPU,
# .venv reads that Python's site-packages after its own, and that torch, its CUDA libraries and
# Triton are used as they are; LBP_WHEELHOUSE=DIR installs everything else from DIR alone (pip's
# --no-index --find-links), a folder made by scripts/gpu_wheelhouse.sh on a machine with the index.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py="$repo/.venv/bin/python"
TORCH_VERSION=${LBP_TORCH_VERSION:-2.13.0}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_setup: refused: nvidia-smi lists no GPU on this machine (a GPU machine is needed)" >&2
  exit 2
fi
nvidia-smi -L

if [ -n "${LBP_WHEELHOUSE:-}" ]; then
  if ! ls "$LBP_WHEELHOUSE"/megatron_core-*.whl >/dev/null 2>&1; then
    echo "gpu_setup: refused: LBP_WHEELHOUSE=$LBP_WHEELHOUSE holds no megatron_core wheel (make it with scripts/gpu_wheelhouse.sh)" >&2
    exit 2
  fi
  PIP_FIND_LINKS=$(cd "$LBP_WHEELHOUSE" && pwd)
  export PIP_NO_INDEX=1 PIP_FIND_LINKS
  echo "[gpu_setup] installing from $PIP_FIND_LINKS only (no package index)"
fi
sys_py=${LBP_PYTHON:-python3}
if [ ! -x "$py" ] && "$sys_py" -c 'import sys, torch; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "[gpu_setup] $sys_py has torch $("$sys_py" -c 'import torch; print(torch.__version__)') with the GPU: .venv reads its site-packages after its own"
  # A .pth file rather than --system-site-packages: where $sys_py is itself a venv's, the
  # latter would show the base interpreter's packages, not the ones torch is among.
  "$sys_py" -m venv "$repo/.venv"
  "$sys_py" -c 'import site; print("\n".join(site.getsitepackages()))' \
    >"$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/lbp-system-packages.pth"
fi

bash "$repo/scripts/install.sh"

cuda_torch() { "$py" -c 'import sys, torch; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)' 2>/dev/null; }
if ! cuda_torch; then
  echo "[gpu_setup] torch in .venv cannot use the GPU ($("$py" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')): installing torch==$TORCH_VERSION from the package index"
  "$py" -m pip --disable-pip-version-check -q install --force-reinstall "torch==$TORCH_VERSION"
  # the index's CUDA wheel brings its own Triton; install.sh put one in only if none imported
  if ! cuda_torch; then
    echo "gpu_setup: refused: torch $("$py" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)') still sees no GPU (driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1))" >&2
    exit 2
  fi
fi

"$py" - <<'EOF'
import sys
from megatron_lbp.gpucheck import stack
info = stack.describe()
line = stack.refusal(info, require_gpu=True)
if line:
    print(line, file=sys.stderr)
    sys.exit(2)
print(f"[gpu_setup] ready: {info['device']}, NCCL {info['nccl']}, Triton {info['triton']}, "
      f"megatron-core {info['megatron_core']}")
EOF
