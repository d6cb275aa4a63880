"""Cutting a model into gather units, and which module's forward needs which unit.

The model declares its units (:class:`UnitSpec`, from
megatron_lbp.integration.megatron_adapter.gather_units): a GPT's embedding, each
layer and the output layer. Undeclared parameters form "other" units cut at
``bucket_size``. Invariants: a declared unit is never split (one gather per
unit) and holds one dtype; its declared modules' hooks gather it, ``held_by``
modules free it; a module's *home* unit is where prefetching counts from.
See docs/engine.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

from megatron_lbp.core.vocabulary import UNIT_KINDS


@dataclass(frozen=True)
class UnitSpec:
    """A unit the model declares: its kind, the modules whose forward uses it, the layer number."""

    kind: str
    modules: tuple[torch.nn.Module, ...]
    layer: int | None = None
    held_by: tuple[torch.nn.Module, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in UNIT_KINDS:
            raise ValueError(f"unit kind {self.kind!r}: must be one of {UNIT_KINDS}")


@dataclass
class UnitPlan:
    """One unit as it will be built: its parameters in model order and the modules using it."""

    kind: str
    layer: int | None
    params: list[tuple[str, torch.nn.Parameter]]
    users: list[torch.nn.Module] = field(default_factory=list)
    holders: list[torch.nn.Module] = field(default_factory=list)   # see UnitSpec.held_by


@dataclass
class UnitMap:
    units: list[UnitPlan]
    uses: dict[torch.nn.Module, list[int]]     # module -> units its forward needs gathered
    home: dict[torch.nn.Module, int]           # module -> the unit its compute belongs to
    held: dict[torch.nn.Module, list[int]] = field(default_factory=dict)  # module -> units it holds


def split_into_buckets(named_params: list[tuple[str, torch.nn.Parameter]],
                       bucket_size: int) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """Consecutive parameters, at most ``bucket_size`` elements per bucket; a larger one alone."""
    buckets, current, filled = [], [], 0
    for name, p in named_params:
        if current and filled + p.numel() > bucket_size:
            buckets.append(current)
            current, filled = [], 0
        current.append((name, p))
        filled += p.numel()
    if current:
        buckets.append(current)
    return buckets


def same_dtype_runs(named_params):
    """Consecutive runs of parameters with one dtype (a flat bucket holds one dtype)."""
    runs, current = [], []
    for name, p in named_params:
        if current and current[-1][1].dtype != p.dtype:
            runs.append(current)
            current = []
        current.append((name, p))
    if current:
        runs.append(current)
    return runs


def group_into_units(root: torch.nn.Module, specs: Iterable[UnitSpec], bucket_size: int,
                     extra_weight_users: Mapping[torch.nn.Module,
                                                 Iterable[torch.nn.Parameter]] | None = None
                     ) -> UnitMap:
    """Units of ``root``'s trainable parameters, ordered by their first parameter."""
    named = [(n, p) for n, p in root.named_parameters() if p.requires_grad]
    position = {id(p): i for i, (_, p) in enumerate(named)}
    specs = list(specs)
    claimed: dict[int, int] = {}            # id(param) -> spec index
    for i, spec in enumerate(specs):
        for m in spec.modules:
            for p in m.parameters():
                if id(p) in position:
                    claimed.setdefault(id(p), i)

    # Declared units: their parameters in model order; the rest in consecutive runs.
    groups: list[tuple[int, str, int | None, list, list[torch.nn.Module], list]] = []
    declared: dict[int, list] = {}
    run: list = []

    def close_run() -> None:
        if run:
            groups.append((position[id(run[0][1])], "other", None, list(run), [], []))
            run.clear()

    for name, p in named:
        i = claimed.get(id(p))
        if i is None:
            run.append((name, p))
            continue
        close_run()
        if i not in declared:
            declared[i] = []
            groups.append((position[id(p)], specs[i].kind, specs[i].layer, declared[i],
                           list(specs[i].modules), list(specs[i].held_by)))
        declared[i].append((name, p))
    close_run()
    groups.sort(key=lambda g: g[0])

    owner = _registering_modules(root)
    units: list[UnitPlan] = []
    for _, kind, layer, params, modules, holders in groups:
        pieces = (split_into_buckets(params, bucket_size) if kind == "other" else [params])
        for piece in pieces:
            for same in same_dtype_runs(piece):
                users = list(modules) if modules else _unique(owner[id(p)] for _, p in same)
                units.append(UnitPlan(kind, layer, same, users, list(holders)))

    unit_of = {id(p): u for u, plan in enumerate(units) for _, p in plan.params}
    uses: dict[torch.nn.Module, list[int]] = {}
    home: dict[torch.nn.Module, int] = {}
    held: dict[torch.nn.Module, list[int]] = {}
    for u, plan in enumerate(units):
        for m in plan.users:
            uses.setdefault(m, [])
            if u not in uses[m]:
                uses[m].append(u)
            home.setdefault(m, u)
        for m in plan.holders:
            held.setdefault(m, []).append(u)
    for m, params in (extra_weight_users or {}).items():
        for p in params:
            u = unit_of[id(p)]
            if m not in units[u].users:
                units[u].users.append(m)
            uses.setdefault(m, [])
            if u not in uses[m]:
                uses[m].append(u)
    return UnitMap(units, uses, home, held)


def _registering_modules(root: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """id(param) -> the first module (in module order) that registers it directly."""
    owner: dict[int, torch.nn.Module] = {}
    for m in root.modules():
        for p in m.parameters(recurse=False):
            owner.setdefault(id(p), m)
    return owner


def _unique(modules):
    out = []
    for m in modules:
        if m not in out:
            out.append(m)
    return out
