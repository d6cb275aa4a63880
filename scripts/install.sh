#!/usr/bin/env bash
# Sets up megatron-lbp in .venv at the repository root, from nothing.
#
#   bash scripts/install.sh          runtime requirements + the package (editable)
#   bash scripts/install.sh --test   the same plus the test requirements
#
# Idempotent: a stamp in .venv records a hash of every file that decides what
# is installed; when it matches, the script returns at once.
#
# The one Python 3.11 workaround lives here (and its runtime half in
# megatron_lbp/integration/compat.py): megatron-core 0.19.2 declares Requires-Python >= 3.12
# but ships cp311 wheels, so on 3.11 it is installed with --no-deps
# --ignore-requires-python and its real dependencies come from requirements.txt.
# On Python >= 3.12 (Frontier's miniforge) the plain `pip install -r` path runs.
#
# torch is never upgraded by a dependency: whatever torch is installed first
# (torch==2.13.0 here, ROCm's build on Frontier) is pinned by a constraint file
# for every later pip call. Triton is installed only if `import triton` fails,
# because ROCm/CUDA torch bring their own triton build and PyPI's would shadow it.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$repo/.venv"
want_test=0
for arg in "$@"; do
  case "$arg" in
    --test) want_test=1 ;;
    *) echo "install.sh: unknown argument '$arg' (accepted: --test)" >&2; exit 2 ;;
  esac
done

python_bin=${LBP_PYTHON:-python3}
TORCH_VERSION=${LBP_TORCH_VERSION:-2.13.0}
MEGATRON_CORE_VERSION=0.19.2

# One stamp per mode; a --test install also satisfies a plain one.
stamp_of() { cat "$repo/scripts/install.sh" "$repo/requirements.txt" "$repo/pyproject.toml" "$@" \
  | sha256sum | cut -d' ' -f1; }
runtime_stamp="$venv/.lbp-stamp-runtime"
test_stamp="$venv/.lbp-stamp-test"
runtime_hash=$(stamp_of)
test_hash=$(stamp_of "$repo/requirements-test.txt")
if [ "$want_test" = 1 ]; then
  [ "$(cat "$test_stamp" 2>/dev/null)" = "$test_hash" ] && exit 0
else
  [ "$(cat "$runtime_stamp" 2>/dev/null)" = "$runtime_hash" ] && exit 0
  [ "$(cat "$test_stamp" 2>/dev/null)" = "$test_hash" ] && exit 0
fi

echo "[install] setting up $venv"
[ -x "$venv/bin/python" ] || "$python_bin" -m venv "$venv"
py="$venv/bin/python"
pip=("$py" -m pip --disable-pip-version-check -q)

if ! "$py" -c 'import torch' 2>/dev/null; then
  echo "[install] torch==$TORCH_VERSION"
  "${pip[@]}" install "torch==$TORCH_VERSION"
fi
installed_torch=$("$py" -c 'import torch; print(torch.__version__.split("+")[0])')
constraints=$(mktemp)
trap 'rm -f "$constraints" "${reqs:-}"' EXIT
echo "torch==$installed_torch" >"$constraints"

py_minor=$("$py" -c 'import sys; print(sys.version_info[1])')
reqs=$(mktemp)
if [ "$py_minor" -lt 12 ]; then
  echo "[install] Python 3.$py_minor: megatron-core $MEGATRON_CORE_VERSION from its cp3$py_minor wheel (--no-deps --ignore-requires-python)"
  "${pip[@]}" install --no-deps --ignore-requires-python "megatron-core==$MEGATRON_CORE_VERSION"
  grep -v '^megatron-core' "$repo/requirements.txt" >"$reqs"
else
  cp "$repo/requirements.txt" "$reqs"
fi
[ "$want_test" = 1 ] && cat "$repo/requirements-test.txt" >>"$reqs"
echo "[install] requirements"
"${pip[@]}" install -c "$constraints" -r "$reqs" "torch==$installed_torch"

hf_pid=
if [ "$want_test" = 1 ]; then
  # The Hugging Face tests build their models with transformers, kept out of the venv's
  # site-packages: megatron-core imports it whenever it builds a tokenizer, ~3 s of CPU per
  # training process (megatron_lbp/testing/hf_env.py). Only those tests put this on sys.path,
  # last, so the venv's own packages win: .venv/hf-test gets transformers and only the
  # requirements the venv lacks (pip's resolution against the venv, a dry run), not a
  # second numpy, tokenizers, huggingface_hub... that would never be imported (a plain
  # --target install copies all of them: 25-35 s of the set-up, against 10-13 s).
  # It runs beside the triton and editable installs and the import check below, which
  # change nothing it resolves against (transformers needs neither triton nor
  # megatron-lbp): each pip is one process on one core, and this machine has two.
  echo "[install] transformers into .venv/hf-test (tests only, in the background)"
  hf_report=$(mktemp)
  # On any exit before the wait below, the background install is ended with the script.
  trap 'rm -f "$constraints" "${reqs:-}" "$hf_report"; [ -z "$hf_pid" ] || kill "$hf_pid" 2>/dev/null || true' EXIT
  (
    "${pip[@]}" install -c "$constraints" --dry-run --report "$hf_report" "transformers>=5,<6" "safetensors>=0.4"
    pins=$("$py" -c 'import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    print(item["metadata"]["name"] + "==" + item["metadata"]["version"])' "$hf_report")
    rm -rf "$venv/hf-test"
    if [ -n "$pins" ]; then
      mapfile -t hf_pins <<<"$pins"
      "${pip[@]}" install --no-deps --target "$venv/hf-test" "${hf_pins[@]}"
    fi
  ) &
  hf_pid=$!
fi

if ! "$py" -c 'import triton' 2>/dev/null; then
  echo "[install] triton (megatron-core imports it unconditionally)"
  "${pip[@]}" install -c "$constraints" "triton==3.7.1"
fi

"${pip[@]}" install --no-deps -e "$repo"
check_log=$(mktemp)
if ! "$py" -W ignore -c 'import megatron_lbp.integration.compat as c; c.enable(); import megatron.core, megatron.training.training' \
    >"$check_log" 2>&1; then
  cat "$check_log" >&2
  echo "[install] import check failed (output above)" >&2
  exit 1
fi
rm -f "$check_log"
if [ -n "$hf_pid" ]; then
  hf_status=0
  wait "$hf_pid" || hf_status=$?
  hf_pid=
  if [ "$hf_status" != 0 ]; then
    echo "[install] installing transformers into $venv/hf-test failed (output above)" >&2
    exit 1
  fi
fi
echo "$runtime_hash" >"$runtime_stamp"
[ "$want_test" = 1 ] && echo "$test_hash" >"$test_stamp"
echo "[install] done: torch $installed_torch, megatron-core $MEGATRON_CORE_VERSION, Python 3.$py_minor"
