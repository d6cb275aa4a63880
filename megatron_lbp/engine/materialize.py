"""Sharded initialization: build a model without ever holding all of its weights.

The model's own constructor runs, unchanged, twice; each parameter is
generated in full only while the module that registered it is being built,
so at most one module's weights are ever resident (on top of this rank's
slices), and every initializer draws from the generators exactly as in a plain
build, which is what makes the values equal the stock path's for the same seed.

1. Build time (:func:`build_sharded`): the constructor runs for real. As soon
   as a module is attached to its parent, the parameters it registered lose
   their values: ``param.data`` becomes a *placeholder*, one element broadcast
   to the parameter's shape, already in the dtype and on the device the
   model's wrappers will give it (``.cuda()`` and a cast to the same dtype
   return it unchanged and allocate nothing). Buffers and every other
   attribute are the real ones, so the model is the stock model minus weights.
   Parameters stay the same objects (their Megatron attributes included).
2. Wrap time (:meth:`ShardedConstruction.materialize`): when the engine has
   laid out its buckets, the constructor runs again from the generator state
   the first run started from; each parameter, once its module is attached,
   is handed to ``write`` (the engine copies this rank's slices of it, see
   :meth:`HierDataParallel.write_weights`) and dropped. That second model is
   discarded and the generators are put back where they were.

The two runs are matched parameter by parameter in registration order (name,
shape and dtype checked). A constructor that reads a parameter's values after
its module was attached would read the placeholder: the stock-equality tests
(tests/test_sharded_init.py) guard the constructors the project supports.
"""
from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

ATTRIBUTE = "_lbp_sharded_construction"


class ShardedInitError(RuntimeError):
    """The model cannot be materialized slice by slice as built (one line naming why)."""


# --- placeholders ------------------------------------------------------------------------
_PLACEHOLDERS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def placeholder(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A storage-free stand-in of ``shape``: one shared element broadcast (stride 0)."""
    device = torch.device(device)
    key = (dtype, device)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.zeros((), dtype=dtype, device=device)
    return _PLACEHOLDERS[key].expand(tuple(shape))


def is_placeholder(t: torch.Tensor) -> bool:
    base = _PLACEHOLDERS.get((t.dtype, t.device))
    return (base is not None and t.data_ptr() == base.data_ptr()
            and all(s == 0 for s in t.stride()))


# --- watching a constructor --------------------------------------------------------------
class _ParameterStream:
    """While open, calls ``ready(index, param)`` once per parameter when its module is attached.

    ``index`` counts parameter registrations (torch's global registration hooks)
    in order; ``finish(root)`` hands over what is left (the root's own
    parameters and any registered after their module was attached).
    """

    def __init__(self, ready: Callable[[int, torch.nn.Parameter], None]) -> None:
        self._ready = ready
        self._index = WeakIdKeyDictionary()
        self._handed = WeakIdKeyDictionary()
        self.registered: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self._handles: list[Any] = []

    def __enter__(self):
        from torch.nn.modules import module as nn_module

        self._handles = [
            nn_module.register_module_parameter_registration_hook(self._on_parameter),
            nn_module.register_module_module_registration_hook(self._on_module),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _on_parameter(self, module, name, param):
        if param is not None and param not in self._index:
            self._index[param] = len(self.registered)
            self.registered.append((name, tuple(param.shape), param.dtype))

    def _on_module(self, parent, name, child):
        if child is not None:
            for p in child.parameters(recurse=False):
                self._hand_over(p)

    def finish(self, root: torch.nn.Module) -> None:
        for p in root.parameters():
            self._hand_over(p)

    def _hand_over(self, p: torch.nn.Parameter) -> None:
        if p in self._index and p not in self._handed:
            self._handed[p] = True
            self._ready(self._index[p], p)


# --- the two runs ------------------------------------------------------------------------
@dataclass
class ShardedConstruction:
    """What a second run of the constructor needs, kept on the built model until it runs."""

    rebuild: Callable[[], torch.nn.Module]
    rng_at_start: Any                         # an object with .restore() (the adapter's snapshot)
    rng_snapshot: Callable[[], Any]
    cast_dtype: torch.dtype | None            # what the mixed-precision wrapper will cast to
    registered: list[tuple[str, tuple[int, ...], torch.dtype]] = field(default_factory=list)
    params: list[weakref.ref] = field(default_factory=list)

    def check_untouched(self, model: torch.nn.Module) -> None:
        """Every weight must still be its placeholder: something in between allocated or changed it."""
        for name, p in model.named_parameters():
            if not is_placeholder(p):
                raise ShardedInitError(
                    f"sharded initialization: parameter {name} was given storage between the "
                    f"model's construction and its wrapping ({p.dtype}, expected "
                    "a placeholder); build with --no-hier-sharded-init")

    def materialize(self, write: Callable[[torch.nn.Parameter, torch.Tensor], bool]) -> None:
        """Rerun the constructor; hand each parameter's values to ``write(param, values)``.

        ``write`` returns False for a parameter the engine does not keep in a
        bucket (one that needs no gradient): that parameter gets its full values.
        """
        now = self.rng_snapshot()
        seen: list[int] = []

        def ready(index: int, p: torch.nn.Parameter) -> None:
            if index >= len(self.registered) or stream.registered[index] != self.registered[index]:
                got = stream.registered[index] if index < len(stream.registered) else None
                want = self.registered[index] if index < len(self.registered) else None
                raise ShardedInitError(
                    f"sharded initialization: the second construction differs at parameter "
                    f"#{index} (got {got}, first run {want}); build with --no-hier-sharded-init")
            target = self.params[index]()
            if target is not None:
                values = p.detach()
                if not write(target, values):
                    target.data = values.to(device=target.device, dtype=target.dtype, copy=True)
                seen.append(index)
            p.data = placeholder(p.shape, p.dtype, p.device)

        start, self.rng_at_start = self.rng_at_start, None   # used once: let it go
        start.restore()
        del start
        # Everything alive before the rebuild is set aside from the collection below:
        # the garbage is the second model, and a full collection would also walk
        # every object of torch and Megatron (about 0.2 s of CPU per rank).
        gc.freeze()
        try:
            with _ParameterStream(ready) as stream:
                model = self.rebuild()
                stream.finish(model)
            del model
            gc.collect()  # the second model's buffers, now, not when a cycle collection runs
        finally:
            now.restore()
            gc.unfreeze()
        done = set(seen)
        missing = [i for i, ref in enumerate(self.params) if ref() is not None and i not in done]
        if missing:
            raise ShardedInitError(
                f"sharded initialization: {len(missing)} parameter(s) of the model were not built "
                f"again (first: {self.registered[missing[0]]}); build with --no-hier-sharded-init")


def build_sharded(builder: Callable[[], torch.nn.Module], *, cast_dtype: torch.dtype | None,
                  device, rng_snapshot: Callable[[], Any]) -> torch.nn.Module:
    """Run ``builder`` keeping no weights (step 1 of the module docstring); the result can be materialized.

    ``cast_dtype``: the dtype a mixed-precision wrapper will cast floating-point
    parameters to (None: none will); ``device``: where the model will live.
    """
    start = rng_snapshot()
    construction = ShardedConstruction(rebuild=builder, rng_at_start=start,
                                       rng_snapshot=rng_snapshot, cast_dtype=cast_dtype)
    slots: dict[int, weakref.ref] = {}

    def ready(index: int, p: torch.nn.Parameter) -> None:
        dtype = cast_dtype if cast_dtype is not None and p.is_floating_point() else p.dtype
        slots[index] = weakref.ref(p)
        p.data = placeholder(p.shape, dtype, device)

    with _ParameterStream(ready) as stream:
        model = builder()
        stream.finish(model)
    construction.registered = list(stream.registered)
    construction.params = [slots.get(i, _dead) for i in range(len(stream.registered))]
    setattr(model, ATTRIBUTE, construction)
    return model


def _dead():
    return None


def construction_of(model: torch.nn.Module) -> ShardedConstruction | None:
    """The pending construction of ``model`` or of the module a wrapper holds (``.module`` chain)."""
    m = model
    while m is not None:
        found = getattr(m, ATTRIBUTE, None)
        if found is not None:
            return found
        m = getattr(m, "module", None)
    return None


def forget(model: torch.nn.Module) -> None:
    """Drop the construction record (its builder closure) once the weights are materialized."""
    m = model
    while m is not None:
        if ATTRIBUTE in vars(m):
            delattr(m, ATTRIBUTE)
            return
        m = getattr(m, "module", None)
