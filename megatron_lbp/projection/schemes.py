"""The engine's schemes as the benchmarks and the projection name them, with their training flags.

One table for ``benchmarks traffic``, ``benchmarks overhead``, ``benchmarks network`` and the
projection (its plans and its recorded traces): a scheme added here is one every one of them
can run.
"""
from __future__ import annotations

# GCDs per MI250X package: the emulated node's package tier in every benchmark.
GCDS_PER_PACKAGE = 2

# Megatron flags of each engine scheme (the launcher's presets, int8 secondaries spelled out).
ENGINE_SCHEMES: dict[str, list[str]] = {
    "lbp": ["--hier-preset", "lbp"],
    "lbp-int8-S2": ["--hier-preset", "lbp", "--hier-secondary-group-size", "2",
                    "--hier-secondary-dtype", "int8"],
    "lbp-int8-S8": ["--hier-preset", "lbp", "--hier-secondary-group-size", "8",
                    "--hier-secondary-dtype", "int8"],
    "zeropp": ["--hier-preset", "zeropp"],
    "zero3": ["--hier-preset", "zero3"],
    "zero2": ["--hier-preset", "zero2"],
    "hsdp": ["--hier-preset", "hsdp"],
}
