"""Does this CPU compute bf16 natively? Read from the CPU's own feature flags, nothing timed.

Without a bf16 dot-product instruction, PyTorch's CPU matmul converts bf16 to
fp32 and back around every block (measured 23x slower than fp32 for the main
job's output layer on an AVX2-only EPYC), so a bf16 demo on such a CPU measures
the conversion, not the training. The flags that mean real bf16 arithmetic:

- x86: ``avx512_bf16`` (AVX512-BF16: VDPBF16PS, Cooper Lake, Sapphire Rapids,
  Zen 4 and later) or ``amx_bf16`` (AMX tiles, Sapphire Rapids and later), from
  the ``flags`` line of /proc/cpuinfo;
- Arm: ``bf16`` (FEAT_BF16: BFDOT/BFMMLA, Neoverse V1/N2 and later) in the
  ``Features`` line.

``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is not used: it answers True
on any AVX512 core, where oneDNN emulates bf16. A machine without
/proc/cpuinfo (not Linux) is reported as unknown, i.e. not native.
"""
from __future__ import annotations

from pathlib import Path

X86_FLAGS = ("avx512_bf16", "amx_bf16")
ARM_FLAGS = ("bf16",)
CPUINFO = Path("/proc/cpuinfo")


def bf16_flags(cpuinfo_text: str) -> list[str]:
    """The native-bf16 flags of the first CPU described in ``cpuinfo_text`` (empty: none)."""
    for line in cpuinfo_text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("flags", "features"):
            have = set(value.split())
            wanted = X86_FLAGS if key == "flags" else ARM_FLAGS
            return [f for f in wanted if f in have]
    return []


def native_bf16(cpuinfo: Path = CPUINFO) -> tuple[bool, str]:
    """(native?, one-line reason naming the evidence)."""
    try:
        text = cpuinfo.read_text()
    except OSError as e:
        return False, f"cannot read {cpuinfo} ({e.strerror}): native bf16 unknown, taken as absent"
    flags = bf16_flags(text)
    if flags:
        return True, f"CPU flags {', '.join(flags)} present: native bf16"
    return False, (f"no {'/'.join(X86_FLAGS + ARM_FLAGS)} among the CPU flags of {cpuinfo}: "
                   f"bf16 matmuls are emulated through fp32 here (~20x slower)")
