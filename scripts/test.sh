#!/usr/bin/env bash
# The test command (README, CI): sets up .venv if needed, then runs the suite.
#   bash scripts/test.sh            the CI suite (everything not marked slow), on 2 workers
#   bash scripts/test.sh --slow     the slow cases only, in one process
#   bash scripts/test.sh --all      both, in one process
# Any further arguments go to pytest (e.g. -k layout, -x; -n 0 runs the CI suite in one process).
#
# Why 2 workers (pytest-xdist): most of the suite's time is one process on one core (pytest
# itself, or one fresh interpreter importing torch and Megatron), so on CI's 2 cores the other
# one idles; a second worker fills it. Each test file runs whole on one worker (--dist
# loadfile), so a module's fixtures are built once. The slow cases stay in one process: the
# real-Slurm tests share one cluster per session and the emulated-network runs want the
# machine to themselves.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$repo/scripts/install.sh" --test
marker=(-m "not slow")
workers=(-n "${LBP_TEST_WORKERS:-2}" --dist loadfile)
case "${1:-}" in
  --slow) marker=(-m slow); workers=(); shift ;;
  --all) marker=(-m "slow or not slow"); workers=(); shift ;;
esac
cd "$repo"
exec "$repo/.venv/bin/python" -m pytest "${marker[@]}" "${workers[@]}" "$@"
