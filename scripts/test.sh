#!/usr/bin/env bash
# The test command (README, CI): sets up .venv if needed, then runs the suite.
#   bash scripts/test.sh            the CI suite (everything not marked slow)
#   bash scripts/test.sh --slow     the slow cases only (long multi-rank and end-to-end runs)
#   bash scripts/test.sh --all      both
# Any further arguments go to pytest (e.g. -k layout, -x).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$repo/scripts/install.sh" --test
marker=(-m "not slow")
case "${1:-}" in
  --slow) marker=(-m slow); shift ;;
  --all) marker=(-m "slow or not slow"); shift ;;
esac
cd "$repo"
exec "$repo/.venv/bin/python" -m pytest "${marker[@]}" "$@"
