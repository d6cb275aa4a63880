"""Sharded initialization: build a model without ever holding all of its weights.

The model's constructor runs twice: at build time (:func:`build_sharded`) each
parameter is released to a placeholder once its module is attached; at wrap
time (:meth:`ShardedConstruction.materialize`) it runs again from the same
generator state and each parameter is handed to ``write`` and dropped.
Invariants: the values equal a plain build's for the same seed; a constructor
touching a released parameter is seen by a dispatch watch (such parameters
are *late*); the two runs are matched parameter by parameter (name, shape,
dtype), and a mismatch raises :class:`ShardedInitError`. See docs/engine.md.
"""
from __future__ import annotations

import gc
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

ATTRIBUTE = "_lbp_sharded_construction"
END = -1             # release point of a late parameter: when the whole build returns
MAX_FIRST_RUNS = 3   # a first run repeated with late parameters held, at most this often


class ShardedInitError(RuntimeError):
    """The model cannot be materialized slice by slice as built (one line naming why)."""


# --- placeholders ------------------------------------------------------------------------
class _PlaceholderPool:
    """One zero element per placeholder, carved from a few chunks per (dtype, device).

    Each placeholder has its own element (so an operation on it names its
    parameter by ``data_ptr``) and all of them share a handful of storages (so
    ``is_placeholder`` is a set lookup and a build allocates almost nothing).
    Elements are never handed out twice: a placeholder's address stays its own.
    """

    CHUNK = 4096

    def __init__(self) -> None:
        self._chunks: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, int]] = {}
        self.storages: set[int] = set()
        self._keep: list[torch.Tensor] = []

    def take(self, shape, dtype: torch.dtype, device) -> torch.Tensor:
        key = (dtype, torch.device(device))
        chunk, used = self._chunks.get(key, (None, self.CHUNK))
        if used == self.CHUNK:
            chunk, used = torch.zeros(self.CHUNK, dtype=dtype, device=key[1]), 0
            self._keep.append(chunk)
            self.storages.add(chunk.untyped_storage().data_ptr())
        self._chunks[key] = (chunk, used + 1)
        return chunk[used].expand(tuple(shape))


_POOL = _PlaceholderPool()


def placeholder(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A storage-free stand-in of ``shape``: one element of its own broadcast (stride 0)."""
    return _POOL.take(shape, dtype, device)


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - sparse, nested, meta, wrapper subclasses: no placeholder
        return None


def is_placeholder(t: torch.Tensor) -> bool:
    return _storage_ptr(t) in _POOL.storages and all(s == 0 for s in t.stride())


# --- what counts as overwriting a tensor -------------------------------------------------
# In-place operations that write every element without reading any: initializers.
_OVERWRITES = frozenset({
    "normal_", "uniform_", "fill_", "zero_", "copy_", "random_", "bernoulli_",
    "exponential_", "log_normal_", "cauchy_", "geometric_",
})


def _overwritten(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors ``func`` overwrites whole without reading them (args[0] of an initializer,
    the ``out=`` of an out variant)."""
    out = []
    if func.overloadpacket.__name__ in _OVERWRITES and args and isinstance(args[0], torch.Tensor):
        out.append(args[0])
    for arg in func._schema.arguments:
        if arg.kwarg_only and arg.alias_info is not None and arg.alias_info.is_write:
            value = kwargs.get(arg.name)
            if isinstance(value, torch.Tensor):
                out.append(value)
    return out


def _toucher() -> Any:
    """The innermost module whose constructor is running (None: the builder's own code)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module):
                return owner
        frame = frame.f_back
    return None


# --- watching a constructor --------------------------------------------------------------
@dataclass
class LateParameter:
    """A parameter a constructor touched after its module was attached (held whole until released)."""

    index: int
    name: str
    nbytes: int
    toucher: str          # "LanguageModelEmbedding.__init__", or "the model builder"
    release: int          # attach event that releases it, or END

    def describe(self) -> str:
        until = ("the build returns" if self.toucher == "the model builder"
                 else "that constructor returns")
        return (f"{self.name} ({self.nbytes / 2**20:.2f} MiB) is touched by {self.toucher} after "
                f"its module was attached: held whole until {until}")


class _Watch(TorchDispatchMode):
    """One run of the constructor: registrations, attach events, and every touch of a released
    parameter (see the module docstring).

    ``release(index, param)`` is called when a parameter is released (at its
    module's attach, or at its hold's release point, or at ``finish``); the
    caller turns it into a placeholder. ``hold`` maps indices to the attach
    event that releases them (``END``: ``finish``). ``second``: touching a
    released parameter is an error instead of a late materialization.
    """

    def __init__(self, release: Callable[[int, torch.nn.Parameter], None], *,
                 hold: dict[int, int], second: bool) -> None:
        super().__init__()
        self._release = release
        self._hold = hold
        self._second = second
        self._index = WeakIdKeyDictionary()
        self._released = WeakIdKeyDictionary()          # param -> its placeholder's element address
        self._by_address: dict[int, weakref.ref] = {}   # element address -> param
        self.registered: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self.origin: list[tuple[torch.dtype, torch.device]] = []
        self.events = 0
        self._waiting: dict[int, list[weakref.ref]] = {}   # attach event -> held params
        # first run only
        self.touched_by: dict[int, Any] = {}    # index -> weakref of the touching module, or None
        self.release_at: dict[int, int] = {}    # index -> attach event that released it again
        self.inexact: set[int] = set()          # late parameters whose dropped values were needed
        self._toucher_of: WeakIdKeyDictionary = WeakIdKeyDictionary()   # module -> [param refs]
        self._handles: list[Any] = []

    # registration hooks
    def __enter__(self):
        from torch.nn.modules import module as nn_module

        self._handles = [
            nn_module.register_module_parameter_registration_hook(self._on_parameter),
            nn_module.register_module_module_registration_hook(self._on_module),
        ]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        return super().__exit__(*exc)

    def _on_parameter(self, module, name, param):
        if param is not None and param not in self._index:
            self._index[param] = len(self.registered)
            self.registered.append((name, tuple(param.shape), param.dtype))
            self.origin.append((param.dtype, param.device))

    def _on_module(self, parent, name, child):
        if child is None:
            return
        self.events += 1
        for p in child.parameters(recurse=False):
            self._offer(p)
        for ref in self._toucher_of.pop(child, []):      # first run: its constructor returned
            p = ref()
            if p is not None and p in self._index:
                self.release_at[self._index[p]] = self.events
                self._do_release(p)
        for ref in self._waiting.pop(self.events, []):  # held parameters released here
            p = ref()
            if p is not None:
                self._do_release(p)

    def finish(self, root: torch.nn.Module) -> None:
        for refs in self._waiting.values():
            for ref in refs:
                p = ref()
                if p is not None:
                    self._do_release(p)
        self._waiting.clear()
        for refs in self._toucher_of.values():
            for ref in refs:
                p = ref()
                if p is not None and p in self._index:
                    self.release_at[self._index[p]] = END
                    self._do_release(p)
        for p in root.parameters():
            self._offer(p)
            if p in self._released and not is_placeholder(p) and not self._second:
                # .data replaced after release, without an operation the watch could see
                index = self._index[p]
                self.touched_by[index] = None
                self.release_at[index] = END
                self.inexact.add(index)
                self._do_release(p)

    def _offer(self, p: torch.nn.Parameter) -> None:
        """``p``'s module was attached: release it now, or hold it until its release point."""
        if p not in self._index or p in self._released:
            return
        index = self._index[p]
        if index in self._hold:
            at = self._hold.pop(index)
            if at != END and at <= self.events:
                self._do_release(p)
            else:
                self._waiting.setdefault(at, []).append(weakref.ref(p))
            return
        self._do_release(p)

    def _do_release(self, p: torch.nn.Parameter) -> None:
        self._release(self._index[p], p)
        self._released[p] = p.data_ptr()
        self._by_address[p.data_ptr()] = weakref.ref(p)

    # the dispatch watch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        touched = []
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and is_placeholder(t):
                ref = self._by_address.get(t.data_ptr())
                p = ref() if ref is not None else None
                if p is not None and self._released.get(p) == t.data_ptr():
                    touched.append((t, p))
        if touched:
            overwritten = {id(t) for t in _overwritten(func, args, kwargs)}
            for t, p in touched:
                self._late(t, p, whole=id(t) in overwritten and tuple(t.shape) == tuple(p.shape),
                           func=func)
        return func(*args, **kwargs)

    def _late(self, t: torch.Tensor, p: torch.nn.Parameter, *, whole: bool, func) -> None:
        index = self._index[p]
        name = self.registered[index][0]
        if self._second:
            raise ShardedInitError(
                f"sharded initialization: the second construction touched parameter #{index} "
                f"({name}, by {func}) after releasing it, which the first did not: the "
                "constructor differs between runs; build with --no-hier-sharded-init")
        dtype, device = self.origin[index]
        with torch.no_grad():
            p.data = torch.zeros(p.shape, dtype=dtype, device=device)
            if t is not p:
                t.data = p.data          # the alias the operation holds now sees the memory too
        del self._released[p]
        self._by_address.pop(t.data_ptr(), None)
        if not whole:
            self.inexact.add(index)
        toucher = _toucher()
        self.touched_by[index] = weakref.ref(toucher) if toucher is not None else None
        if toucher is not None:
            self._toucher_of.setdefault(toucher, []).append(weakref.ref(p))
        else:
            self.release_at[index] = END
            self._waiting.setdefault(END, []).append(weakref.ref(p))


def _run(builder, release, *, hold: dict[int, int], second: bool):
    with _Watch(release, hold=dict(hold), second=second) as watch:
        model = builder()
        watch.finish(model)
    return model, watch


def _late_parameters(model: torch.nn.Module, watch: _Watch, hold: dict[int, int],
                     touchers: dict[int, str]) -> list[LateParameter]:
    names = {}
    for name, p in model.named_parameters():
        index = watch._index.get(p)
        if index is not None:
            names[index] = name
    out = []
    for index, at in sorted(hold.items()):
        shape, (dtype, _) = watch.registered[index][1], watch.origin[index]
        numel = 1
        for s in shape:
            numel *= s
        out.append(LateParameter(index=index, name=names.get(index, watch.registered[index][0]),
                                 nbytes=numel * torch.empty((), dtype=dtype).element_size(),
                                 toucher=touchers[index], release=at))
    return out


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
    late: list[LateParameter] = field(default_factory=list)
    first_runs: int = 1                       # 2+: the first run was repeated with late holds

    @property
    def hold(self) -> dict[int, int]:
        return {lp.index: lp.release for lp in self.late}

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
        registered: list = []

        def release(index: int, p: torch.nn.Parameter) -> None:
            if index >= len(self.registered) or registered[index] != self.registered[index]:
                got = registered[index] if index < len(registered) else None
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
            watch = _Watch(release, hold=self.hold, second=True)
            registered = watch.registered
            with watch:
                model = self.rebuild()
                watch.finish(model)
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
    hold: dict[int, int] = {}
    touchers: dict[int, str] = {}
    for attempt in range(1, MAX_FIRST_RUNS + 1):
        slots: dict[int, weakref.ref] = {}

        def release(index: int, p: torch.nn.Parameter) -> None:
            dtype = cast_dtype if cast_dtype is not None and p.is_floating_point() else p.dtype
            slots[index] = weakref.ref(p)
            p.data = placeholder(p.shape, dtype, device)

        model, watch = _run(builder, release, hold=hold, second=False)
        for index, ref in watch.touched_by.items():
            module = ref() if ref is not None else None
            touchers[index] = (f"{type(module).__name__}.__init__" if module is not None
                               else "the model builder")
        new_hold = {**hold, **watch.release_at}
        if not watch.inexact:
            break
        # A late parameter's dropped values were needed: run again from the start with
        # every late parameter held until its release point, so nothing reads a zero.
        if attempt == MAX_FIRST_RUNS or new_hold == hold:
            first = sorted(watch.inexact)[0]
            raise ShardedInitError(
                f"sharded initialization: parameter #{first} ({watch.registered[first][0]}) is "
                f"still read after its release in run {attempt} with late parameters held; "
                "build with --no-hier-sharded-init")
        hold = new_hold
        del model, watch
        start.restore()
    hold = new_hold
    construction = ShardedConstruction(rebuild=builder, rng_at_start=start,
                                       rng_snapshot=rng_snapshot, cast_dtype=cast_dtype,
                                       first_runs=attempt)
    construction.registered = list(watch.registered)
    construction.params = [slots.get(i, _dead) for i in range(len(watch.registered))]
    construction.late = _late_parameters(model, watch, hold, touchers)
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
