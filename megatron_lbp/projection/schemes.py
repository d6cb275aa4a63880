"""The schemes the benchmarks and the projection compare, by name: one table for all of them.

``python -m benchmarks traffic``, ``overhead`` and ``network`` and the
projection (its plans and its recorded traces) each run a subset (their own
``SCHEMES``, a tuple of names from here); a scheme added here is one that every
one of them can be given, with the same flags. The DeepSpeed schemes are
megatron_lbp/deepspeed_baseline's (they do not run through the engine).
"""
from __future__ import annotations

from typing import Iterable

# GCDs per MI250X package: the emulated node's package tier in every benchmark.
GCDS_PER_PACKAGE = 2

# Each engine scheme's preset and secondary copy (size, dtype; None: the preset's): what the
# planner is asked (core/plan.PlanRequest) and, as Megatron flags, what training is given.
ENGINE_SCHEME_SETTINGS: dict[str, tuple[str, int | None, str | None]] = {
    "lbp": ("lbp", None, None),
    "lbp-int8-S2": ("lbp", 2, "int8"),
    "lbp-int8-S8": ("lbp", 8, "int8"),
    "zeropp": ("zeropp", None, None),
    "zero3": ("zero3", None, None),
    "zero2": ("zero2", None, None),
    "hsdp": ("hsdp", None, None),
}


def _flags(preset: str, secondary: int | None, dtype: str | None) -> list[str]:
    return ["--hier-preset", preset] + ([] if secondary is None else [
        "--hier-secondary-group-size", str(secondary), "--hier-secondary-dtype", dtype])


# Megatron flags of each engine scheme (the launcher's presets, int8 secondaries spelled out).
ENGINE_SCHEMES: dict[str, list[str]] = {name: _flags(*v) for name, v in
                                        ENGINE_SCHEME_SETTINGS.items()}
# Stock megatron-core, through its own DDP: the distributed optimizer and Megatron-FSDP.
DISTOPT, FSDP = "megatron-distopt", "megatron-fsdp"
STOCK_SCHEMES = (DISTOPT, FSDP)
# The engine preset whose sharding (and so, on the cost model, whose traffic) each stock
# scheme has: bench traffic at K=1 counts megatron-distopt 609,120 vs zero2's 610,560 bytes,
# megatron-fsdp 850,560 vs zero3's 814,080 on the network.
# DeepSpeed's schemes (megatron_lbp/deepspeed_baseline/: ZeRO-3, hpZ, ZeRO++ = hpZ + qwZ + qgZ), modelled
# as the presets that gather as they do (docs/deepspeed-baseline.md: ds-zero3 sends 1.4 % less
# than the plan tool's zero3 with bf16 gradients; zeropp is ZeRO++ itself, its bytes within 15 %
# of ds-zeropp's on both links; ds-hpz, hpZ without quantization, is modelled as zeropp too).
DS_SCHEMES = ("ds-zero3", "ds-hpz", "ds-zeropp")
MODELLED_AS = {DISTOPT: "zero2", FSDP: "zero3",
               "ds-zero3": "zero3", "ds-hpz": "zeropp", "ds-zeropp": "zeropp"}


def engine_argv(scheme: str, gpus_per_node: int, *extra: str) -> list[str]:
    """The training flags of engine scheme ``scheme`` on nodes of ``gpus_per_node`` GCDs."""
    return ENGINE_SCHEMES[scheme] + ["--hier-gpus-per-node", str(gpus_per_node),
                                     "--hier-gcds-per-package", str(GCDS_PER_PACKAGE), *extra]


def schemes_from(parser, text: str, known: Iterable[str]) -> list[str]:
    """The comma-separated ``--schemes`` value as a list; a name not in ``known`` is a usage error."""
    known = tuple(known)
    schemes = [s for s in text.split(",") if s]
    bad = [s for s in schemes if s not in known]
    if bad or not schemes:
        parser.error(f"--schemes: {','.join(bad) or '(empty)'} not in {','.join(known)}")
    return schemes
