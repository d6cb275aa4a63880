"""Does this CPU compute bf16 natively? Read from the CPU's own feature flags, nothing timed.

Without a bf16 dot-product instruction PyTorch's CPU matmul converts bf16 to fp32 and back
around every block, so a bf16 run there measures the conversion, not the training. Native:
x86 ``avx512_bf16`` or ``amx_bf16`` (/proc/cpuinfo ``flags``), Arm ``bf16`` (``Features``).
``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is not used: it answers True on any
AVX512 core, where oneDNN emulates bf16. Without /proc/cpuinfo the answer is "not native".
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
