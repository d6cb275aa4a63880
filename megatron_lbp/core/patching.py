"""The one way megatron-lbp changes megatron-core, megatron.training, torch or the interpreter at run time.

Every runtime patch is a :class:`Patch` in one registry: its owner module, a short name,
the target it replaces (``module:attribute.path``), when it applies and why.
:func:`apply` is the only idiom: it replaces the target with ``make(original)`` and marks
the replacement, so applying again changes nothing. Declaring is pure and imports
neither torch nor megatron-core; tests/unit/test_patch_registry.py checks that every
target exists in the pinned versions. The owners: docs/design.md §4.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

MARK = "__lbp_patch__"

EVERY_DEVICE = "every device"
CPU_RUNTIME = "CPU runtime (no accelerator)"

# The modules that declare patches; importing them fills the registry (none applies anything on import).
OWNERS = (
    "megatron_lbp.integration.compat",
    "megatron_lbp.integration.cpu_runtime",
    "megatron_lbp.integration.training_hooks",
    "megatron_lbp.integration.megatron_adapter",
    "megatron_lbp.engine.faults",
    "megatron_lbp.integration.save_stall",
)


@dataclass(frozen=True)
class Patch:
    owner: str   # the module that declares and applies it
    name: str    # unique within the registry
    target: str  # "package.module:attribute.path" that is replaced
    when: str    # EVERY_DEVICE, CPU_RUNTIME, or a narrower condition in words
    why: str     # one line; the owner's docstring has the evidence
    missing_ok: bool = False  # the patch supplies an attribute the target may lack (typing.override)

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.target.partition(":")[2].split("."))


_REGISTRY: dict[str, Patch] = {}


def declare(owner: str, name: str, target: str, when: str, why: str, missing_ok: bool = False) -> Patch:
    """Register a patch (at its owner's import); the same declaration twice is the same patch."""
    patch = Patch(owner, name, target, when, why, missing_ok)
    known = _REGISTRY.setdefault(name, patch)
    if known != patch:
        raise ValueError(f"patch {name!r} declared twice differently: {known} and {patch}")
    return patch


def registry() -> dict[str, Patch]:
    """Every declared patch by name, after importing every owner module."""
    for owner in OWNERS:
        importlib.import_module(owner)
    return dict(_REGISTRY)


def resolve(patch: Patch, where: Any = None) -> tuple[Any, str]:
    """(the object holding the target's last attribute, that attribute's name).

    ``where``: the target module's namespace (a dict or module) when the caller
    already holds it: a patched Megatron-LM file hands over its own globals()
    while it is still being imported.
    """
    holder = where if where is not None else importlib.import_module(patch.module)
    *parents, last = patch.path
    for part in parents:
        holder = holder[part] if isinstance(holder, dict) else getattr(holder, part)
    return holder, last


def _get(holder: Any, name: str, default: Any) -> Any:
    return holder.get(name, default) if isinstance(holder, dict) else getattr(holder, name, default)


def _set(holder: Any, name: str, value: Any) -> None:
    if isinstance(holder, dict):
        holder[name] = value
    else:
        setattr(holder, name, value)


def target_exists(patch: Patch) -> bool:
    holder, name = resolve(patch)
    return _get(holder, name, _ABSENT) is not _ABSENT


_ABSENT = object()


def is_applied(patch: Patch, where: Any = None) -> bool:
    holder, name = resolve(patch, where)
    return getattr(_get(holder, name, None), MARK, None) == patch.name


def apply(patch: Patch, make: Callable[[Any], Any], where: Any = None) -> bool:
    """``target = make(original)`` unless this patch is already in place; True when it changed something.

    ``original`` is None when the target is absent (``missing_ok`` patches). The
    replacement carries the patch's name in ``__lbp_patch__``.
    """
    if patch.name not in _REGISTRY:
        raise KeyError(f"patch {patch.name!r} applied without being declared")
    holder, name = resolve(patch, where)
    original = _get(holder, name, None)
    if getattr(original, MARK, None) == patch.name:
        return False
    new = make(original)
    setattr(new, MARK, patch.name)
    _set(holder, name, new)
    return True
