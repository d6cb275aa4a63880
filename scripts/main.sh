#!/usr/bin/env bash
# The main job (README's first command). Sets up .venv on first use.
#
# For now it plans the paper's setting: a 20B GPT on 384 Frontier GCDs with the
# lbp preset and an int8 secondary copy over one node, and prints what each GCD
# holds and sends per optimizer step. Extra arguments go to the plan tool,
# e.g. `bash scripts/main.sh --json` or `--world-size 96`.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$repo/scripts/install.sh"
exec "$repo/.venv/bin/python" -m megatron_lbp.plan \
  --world-size 384 --params 20e9 --preset lbp --hier-secondary-group-size 8 "$@"
