#!/usr/bin/env bash
# Apply megatron-lbp's hooks to a Megatron-LM tree at core_v0.19.0, or to the
# megatron/ package of the megatron-core 0.19.x wheel (the same three files).
#
#   scripts/apply_patches.sh <dir>           patch <dir>/megatron/training/... (idempotent)
#   scripts/apply_patches.sh --check <dir>   exit 0 if patched, 1 if not yet, 2 if not patchable
#
# <dir> is the Megatron-LM checkout (the directory holding pretrain_gpt.py) or a
# site-packages directory holding megatron/. Each file is identified by its
# SHA-256 (patches/SHA256SUMS): original -> patch it, patched -> nothing to do,
# anything else -> refuse, since the hunks were written for that version only.
# After patching, Megatron-LM's own pretrain_gpt.py accepts --hier-partition and
# the other --hier-* flags; megatron-lbp must be importable (pip install -e .).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
patch_file="$repo/patches/megatron-lbp-hooks.patch"
sums="$repo/patches/SHA256SUMS"
me="scripts/apply_patches.sh"

check_only=0
if [ "${1:-}" = "--check" ]; then check_only=1; shift; fi
if [ $# -ne 1 ]; then
  echo "usage: $me [--check] <megatron-lm-dir | site-packages dir containing megatron/>" >&2
  exit 2
fi
target=$1
if [ ! -f "$target/megatron/training/arguments.py" ]; then
  echo "$me: $target/megatron/training/arguments.py not found: give the Megatron-LM checkout" \
       "(the directory with pretrain_gpt.py) or the site-packages directory holding megatron/" >&2
  exit 2
fi

state_of() {  # prints original | patched | other
  local file=$1 sum
  sum=$(sha256sum "$target/$file" | cut -d' ' -f1)
  if grep -q "^$sum  original  $file\$" "$sums"; then echo original
  elif grep -q "^$sum  patched  $file\$" "$sums"; then echo patched
  else echo other; fi
}

originals=0 patched=0
for file in $(awk '{print $3}' "$sums" | sort -u); do
  case $(state_of "$file") in
    original) originals=$((originals + 1)) ;;
    patched) patched=$((patched + 1)) ;;
    other)
      version=$(sed -n 's/^\(MAJOR\|MINOR\|PATCH\) = \([0-9]*\)/\2/p' \
                "$target/megatron/core/package_info.py" 2>/dev/null | paste -sd. -)
      echo "$me: $target/$file is not the core_v0.19.0 / megatron-core 0.19.x version these" \
           "patches were written for (found megatron-core ${version:-unknown}, or the file was" \
           "edited); refusing to patch" >&2
      exit 2 ;;
  esac
done

if [ "$patched" -gt 0 ] && [ "$originals" -gt 0 ]; then
  echo "$me: $target is partly patched ($patched of $((patched + originals)) files); restore" \
       "the originals (git checkout megatron/) and run again" >&2
  exit 2
fi
if [ "$originals" -eq 0 ]; then
  echo "$me: $target is already patched"
  exit 0
fi
if [ "$check_only" = 1 ]; then
  echo "$me: $target is not patched: run $me $target" >&2
  exit 1
fi
patch -p1 -d "$target" --forward --silent <"$patch_file"
echo "$me: patched $target ($originals files); its pretrain_gpt.py now accepts --hier-partition"
