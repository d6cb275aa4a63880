#!/usr/bin/env bash
# The main job (README's first command): a real GPT pretraining run with the
# lbp hierarchy on 8 CPU ranks emulating 2 nodes x 2 packages x 2 GCDs, beside
# stock Megatron on the same data, from a fresh machine. Sets up .venv on first
# use; builds the tokenizer and data from the shipped corpus if missing; writes
# runs/main/<timestamp>/ (lbp/ and stock/ with each run's train.log, losses and
# comm report; checkpoint/, summary.json, loss_curve.png).
# Options go to python -m megatron_lbp.demo (e.g. --iters 100).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$repo/scripts/install.sh"
cd "$repo"
exec "$repo/.venv/bin/python" -m megatron_lbp.demo "$@"
