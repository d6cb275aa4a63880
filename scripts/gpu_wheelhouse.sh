#!/usr/bin/env bash
# The wheels scripts/gpu_setup.sh needs on a GPU machine that cannot reach the package index
# (compute nodes often cannot), made on one that can:
#
#   bash scripts/gpu_wheelhouse.sh DIR [PYTHON_VERSION]      (default 3.12)
#   LBP_WHEELHOUSE=DIR bash scripts/gpu_setup.sh              (on the GPU machine)
#
# Such a machine is expected to have a CUDA (or ROCm) torch and the common scientific stack in
# its system Python; gpu_setup.sh's .venv then sees them, and what is left is megatron-core
# (its own requirements are torch, numpy and packaging) and the build backend of this package.
# Binary wheels only, for manylinux x86_64 and the given CPython, whatever this machine is.
set -euo pipefail
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: bash scripts/gpu_wheelhouse.sh DIR [PYTHON_VERSION]" >&2
  exit 2
fi
out=$1
pyver=${2:-3.12}
if ! [[ "$pyver" =~ ^3\.[0-9]+$ ]]; then
  echo "gpu_wheelhouse: refused: PYTHON_VERSION '$pyver' is not of the form 3.N" >&2
  exit 2
fi
mkdir -p "$out"
python3 -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
  --python-version "$pyver" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  -d "$out" "megatron-core==0.19.2" "setuptools>=61"
ls -1 "$out"
