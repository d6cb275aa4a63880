"""One optimizer step's communication as a program: what is issued on which communicator, where.

A pure description (no torch) of what the engine does in one step: a list of
:class:`Op` in program order, each at a program point (a unit's hook, or the
optimizer step), with actions ``issue``, ``wait``, ``compute``, ``alloc``, ``free``.
Invariants: each communicator runs its collectives in program order; every
issue is at a hook, a micro-batch boundary or the step, so the program is the
same on every rank; a buffer is freed only after a ``wait`` for its collective.
The plan's transient bytes are this program's buffers walked in order (:func:`peaks`).
See docs/schedule-trace.md and docs/engine.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable, Mapping, Sequence

from megatron_lbp.core.config import hierarchical_grad_reduce
from megatron_lbp.core.vocabulary import (DEFAULT_EMBEDDING_BACKWARD_GATHER,
                                           EMBEDDING_BACKWARD_GATHERS, MAX_PENDING_REDUCES,
                                           SPLIT_KINDS)

FORWARD, BACKWARD, STEP = "forward", "backward", "step"
ACTIONS = ("issue", "wait", "compute", "alloc", "free")
BUFFERS = ("weights", "gather", "secondary_gather", "grad", "reduce", "finish", "step_grad",
           "step_network", "widened")


@dataclass(frozen=True)
class Op:
    index: int
    segment: str                 # forward | backward | step
    micro_batch: int | None      # None: the optimizer step
    at: int | None               # the unit whose hook this point is (None: the optimizer step)
    action: str                  # issue | wait | compute | alloc | free
    unit: int | None
    buffer: str = ""             # alloc / free
    phase: str = ""              # issue: the engine's phase (core/vocabulary.py PHASES, "control")
    family: str = ""             # issue: the group family
    collective: str = ""         # issue: all_gather | reduce_scatter | all_to_all | all_reduce
    comm: str = ""               # issue: the communicator, which is the stream it runs on
    waits: tuple[int, ...] = ()  # issue: cross-stream producers; wait: the collective

    def text(self) -> str:
        """One line of a listing (:meth:`StepProgram.listing`)."""
        if self.action == "issue":
            after = f" after #{', #'.join(map(str, self.waits))}" if self.waits else ""
            return (f"#{self.index} issue {self.phase} unit {self.unit} {self.collective} "
                    f"on {self.comm}{after}")
        if self.action == "wait":
            return f"#{self.index} wait #{self.waits[0]}"
        if self.action == "compute":
            return f"#{self.index} compute unit {self.unit}"
        return f"#{self.index} {self.action} {self.buffer} of unit {self.unit}"


@dataclass(frozen=True)
class ProgramSpec:
    """What the program is derived from. ``group_sizes``: family -> ranks in its group
    (param P, secondary S (0: no secondary copy), grad G, inter O/G, replica R,
    grad_to_param G/P, optim O, grad_cross G/S with the two-hop qgZ); a family of one
    rank issues nothing. ``secondary_serves_step``: the secondary copy's step scope
    (every forward gather after the step's first reads it)."""

    unit_kinds: tuple[str, ...]
    group_sizes: Mapping[str, int]
    tied_embedding: bool = False
    micro_batches: int = 1
    prefetch_units: int = 1
    max_pending_reduces: int = MAX_PENDING_REDUCES
    overlap: bool = True
    embedding_backward_gather: str = DEFAULT_EMBEDDING_BACKWARD_GATHER
    linear_biases: bool = True
    quantized_grad_families: tuple[str, ...] = ()
    secondary_serves_step: bool = False

    def __post_init__(self) -> None:
        if self.prefetch_units < 0:
            raise ValueError(f"prefetch_units={self.prefetch_units}: must be >= 0")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches={self.micro_batches}: must be >= 1")
        if self.max_pending_reduces < 1:
            raise ValueError(f"max_pending_reduces={self.max_pending_reduces}: must be >= 1")
        if self.embedding_backward_gather not in EMBEDDING_BACKWARD_GATHERS:
            raise ValueError(f"embedding_backward_gather={self.embedding_backward_gather!r}: "
                             f"must be one of {EMBEDDING_BACKWARD_GATHERS}")

    def size(self, family: str) -> int:
        return int(self.group_sizes.get(family, 1) or 0)


def group_sizes(cfg) -> dict[str, int]:
    """A HierConfig-like object's families and their group sizes (ProgramSpec.group_sizes)."""
    W, P, G, O = (int(cfg.world_size), int(cfg.param_group_size), int(cfg.grad_group_size),
                  int(cfg.optim_group_size))
    S = int(cfg.secondary_group_size or 0)
    return {"param": P, "secondary": S, "grad": G, "inter": O // G, "replica": W // O,
            "grad_to_param": G // P, "optim": O,
            "grad_cross": G // S if hierarchical_grad_reduce(cfg) else 1}


@dataclass
class StepProgram:
    spec: ProgramSpec
    ops: list[Op] = field(default_factory=list)

    def issues(self) -> list[Op]:
        return [op for op in self.ops if op.action == "issue"]

    def segments(self) -> list[tuple[str, int | None, list[Op]]]:
        """(segment, micro-batch, its ops) in program order."""
        out: list[tuple[str, int | None, list[Op]]] = []
        for op in self.ops:
            if not out or out[-1][:2] != (op.segment, op.micro_batch):
                out.append((op.segment, op.micro_batch, []))
            out[-1][2].append(op)
        return out

    def listing(self, unit: int, actions: Sequence[str] = ("issue", "wait")) -> str:
        """The program's ops of one unit (its collectives and the waits for them), one a line."""
        mine = {op.index for op in self.ops if op.action == "issue" and op.unit == unit}
        lines = []
        for op in self.ops:
            if op.action not in actions:
                continue
            if op.unit == unit or (op.action == "wait" and op.waits[0] in mine):
                where = ("optimizer step" if op.segment == STEP else
                         f"{op.segment} mb {op.micro_batch} " +
                         (f"at unit {op.at}" if op.at is not None else "end"))
                lines.append(f"{where:<26} {op.text()}")
        return "\n".join(lines)


class _Builder:
    def __init__(self, spec: ProgramSpec) -> None:
        self.spec = spec
        self.ops: list[Op] = []
        self.segment, self.micro_batch, self.at = FORWARD, 0, None

    def _add(self, **kw) -> int:
        op = Op(index=len(self.ops), segment=self.segment, micro_batch=self.micro_batch,
                at=self.at, **kw)
        self.ops.append(op)
        return op.index

    def alloc(self, buffer: str, unit: int) -> None:
        self._add(action="alloc", unit=unit, buffer=buffer)

    def free(self, buffer: str, unit: int) -> None:
        self._add(action="free", unit=unit, buffer=buffer)

    def issue(self, phase: str, unit: int | None, family: str, collective: str,
              channel: str, waits: Sequence[int | None] = ()) -> int | None:
        """The collective, or None where its family has one rank (nothing is issued)."""
        if self.spec.size(family) <= 1:
            return None
        return self._add(action="issue", unit=unit, phase=phase, family=family,
                         collective=collective, comm=f"{family}_{channel}",
                         waits=tuple(w for w in waits if w is not None))

    def wait(self, collective: int | None) -> None:
        if collective is not None:
            self._add(action="wait", unit=self.ops[collective].unit, waits=(collective,))


_BUILT: dict[tuple, StepProgram] = {}
_BUILT_LIMIT = 512


def step_program(spec: ProgramSpec) -> StepProgram:
    """The program of one optimizer step (module docstring). Built once per spec and shared
    (callers only read it): a launcher's choice asks for the same few specs hundreds of times."""
    key = tuple((f.name, tuple(sorted(v.items())) if isinstance(v, Mapping) else v)
                for f in fields(spec) for v in [getattr(spec, f.name)])
    built = _BUILT.get(key)
    if built is None:
        if len(_BUILT) >= _BUILT_LIMIT:
            _BUILT.clear()
        built = _BUILT[key] = _build(spec)
    return built


def _build(spec: ProgramSpec) -> StepProgram:
    b = _Builder(spec)
    n = len(spec.unit_kinds)
    d = spec.prefetch_units if spec.overlap else 0
    limit = spec.max_pending_reduces if spec.overlap else 0
    tied = spec.tied_embedding and n >= 2
    skip = spec.embedding_backward_gather == "skip"
    kinds = spec.unit_kinds
    secondary = int(spec.group_sizes.get("secondary") or 0) > 0   # absent: no secondary copy
    # Where the updated weights come from: the previous step's refresh, its last hop per unit.
    refreshed: dict[int, int] = {}

    # gathered: unit -> [its gather (None: a group of one), landed, its buffer]
    def gather(u: int, backward: bool, gathered: dict) -> None:
        if u in gathered:
            return
        phase = "backward_gather" if backward else "forward_gather"
        # the step scope: the step's first forward built the copy, every later gather reads it
        if secondary and (backward or (spec.secondary_serves_step and b.micro_batch > 0)):
            c = b.issue(phase, u, "secondary", "all_gather", "gather")
            buffer = "secondary_gather"
        else:
            c = b.issue(phase, u, "param", "all_gather", "gather", waits=[refreshed.get(u)])
            buffer = "gather"
        b.alloc("weights", u)
        b.alloc(buffer, u)
        gathered[u] = [c, False, buffer]

    def land(u: int, gathered: dict) -> None:
        if not gathered[u][1]:
            b.wait(gathered[u][0])
            b.free(gathered[u][2], u)
            gathered[u][1] = True

    def free_weights(u: int, gathered: dict) -> None:
        land(u, gathered)   # a buffer a gather writes is freed only once it has landed
        b.free("weights", u)
        gathered.pop(u)

    two_hop = "grad" in spec.quantized_grad_families and spec.size("grad_cross") > 1

    def grad_reduce(u: int) -> int | None:
        if two_hop:    # ZeRO++'s qgZ: in the S-group, then across them after its event
            hop1 = b.issue("grad_reduce", u, "secondary", "all_to_all", "reduce")
            b.alloc("finish", u)     # the partial sums and hop 2's buffers, from the issue
            return b.issue("grad_reduce", u, "grad_cross", "all_to_all", "reduce",
                           waits=[hop1])
        op = "all_to_all" if "grad" in spec.quantized_grad_families else "reduce_scatter"
        return b.issue("grad_reduce", u, "grad", op, "reduce")

    def step_reduce(u: int, after: int | None) -> int | None:
        """The 1/G shard -> this rank's 1/O slice; returns the collective that ends it."""
        op = "all_to_all" if "inter" in spec.quantized_grad_families else "reduce_scatter"
        b.alloc("step_grad", u)
        b.alloc("step_network", u)
        net = b.issue("step_reduce", u, "inter", op, "reduce", waits=[after])
        rep = b.issue("step_reduce", u, "replica", "all_reduce", "reduce",
                      waits=[net if net is not None else after])
        return rep if rep is not None else net if net is not None else after

    step_ends: dict[int, int | None] = {}

    def run_pass(backward: bool, mb: int, last: bool) -> None:
        b.segment, b.micro_batch = (BACKWARD if backward else FORWARD), mb
        order = list(reversed(range(n))) if backward else list(range(n))
        gathered: dict[int, list] = {}
        used: set[int] = set()
        done: set[int] = set()
        pending: list[tuple[int, int | None]] = []
        lives_on = {0} if tied else set()
        held_into_next = {u for u, kind in enumerate(kinds) if kind == "attention"}
        held: list[int] = []
        early_grad = ({u for u, kind in enumerate(kinds) if kind in SPLIT_KINDS}
                      if backward and spec.linear_biases else set())
        no_gather = {0} if backward and skip and n else set()

        def complete_oldest() -> None:
            u, c = pending.pop(0)
            b.wait(c)
            if not two_hop:
                b.alloc("finish", u)
            b.free("finish", u)
            b.free("grad", u)
            b.free("reduce", u)

        for pos, u in enumerate(order):
            b.at = u
            if u in early_grad:
                b.alloc("grad", u)     # the bias's gradient: before the half's need
            needs = ([] if u in no_gather else [u]) + ([0] if tied and u == n - 1 else [])
            for v in needs:
                used.add(v)
                gather(v, backward, gathered)
            ahead = 0
            for v in order[pos + 1:]:
                if ahead >= d:
                    break
                if v in used or v in done or v in no_gather:
                    continue
                gather(v, backward, gathered)
                ahead += 1
            for v in needs:
                land(v, gathered)
            b._add(action="compute", unit=u)
            while held:
                v = held.pop()
                free_weights(v, gathered)
                done.add(v)
            if backward and skip and tied and u == n - 1:
                free_weights(0, gathered)       # after the output layer's backward
            if not backward:
                if u in held_into_next:
                    held.append(u)
                elif u not in lives_on:
                    free_weights(u, gathered)
                    done.add(u)
                if tied and u == n - 1:
                    free_weights(0, gathered)
                    done.add(0)
                continue
            if u not in early_grad:
                b.alloc("grad", u)       # the unit's full gradient, from its first one
            if u in gathered:
                free_weights(u, gathered)
            b.alloc("reduce", u)
            done.add(u)
            c = grad_reduce(u)
            pending.append((u, c))
            if last:    # the shard is final once it lands: the network hop after its event
                step_ends[u] = step_reduce(u, c)
            while len(pending) > limit:
                complete_oldest()
        b.at = None
        while pending:
            complete_oldest()

    last_mb = spec.micro_batches - 1
    for mb in range(spec.micro_batches):
        run_pass(False, mb, False)
        run_pass(True, mb, spec.overlap and mb == last_mb)
    b.segment, b.micro_batch, b.at = STEP, None, None
    for u in range(n):
        if u not in step_ends:      # without overlap the reductions start in the step
            step_ends[u] = step_reduce(u, None)
    for u in range(n):               # the optimizer takes each unit's reduced gradient
        b.wait(step_ends[u])
        b.free("step_network", u)
        b.alloc("widened", u)
    b.issue("control", None, "optim", "all_reduce", "reduce")
    b.issue("control", None, "replica", "all_reduce", "reduce")
    for u in range(n):               # dropped after the optimizer's update
        b.free("widened", u)
        b.free("step_grad", u)
    for u in range(n):               # the updated weights, in the next forward's order
        net = b.issue("step_gather", u, "inter", "all_gather", "gather")
        node = b.issue("step_gather", u, "grad_to_param", "all_gather", "gather", waits=[net])
        last = node if node is not None else net
        if last is not None:
            refreshed[u] = last
    program = StepProgram(spec, b.ops)
    # The forward gathers wait for the previous step's refresh: known only now.
    program.ops = [_with_refresh(op, refreshed) for op in b.ops]
    return program


def _with_refresh(op: Op, refreshed: Mapping[int, int]) -> Op:
    if (op.action == "issue" and op.phase == "forward_gather" and op.unit in refreshed
            and op.micro_batch == 0 and not op.waits):
        return Op(**{**op.__dict__, "waits": (refreshed[op.unit],)})
    return op


def peaks(program: StepProgram, nbytes: Callable[[str, int, str, bool], int]) -> dict[str, int]:
    """The peak of the transient buffers alive in a forward (the first micro-batch's, and the
    second's, which reads the secondary copy with the step scope) and the last micro-batch's
    backward (``forward``, ``backward``), each walked from zero (every buffer of the passes
    before is freed by then). ``nbytes(buffer, unit, segment, fresh)``: a buffer's
    bytes (``fresh``: the backward writes the unit's 1/G shard directly, the step's only
    micro-batch)."""
    out = {FORWARD: 0, BACKWARD: 0}
    fresh = program.spec.micro_batches == 1
    wanted = {(FORWARD, 0): FORWARD, (BACKWARD, program.spec.micro_batches - 1): BACKWARD}
    if program.spec.secondary_serves_step and program.spec.micro_batches > 1:
        wanted[(FORWARD, 1)] = FORWARD
    for segment, mb, ops in program.segments():
        if (segment, mb) not in wanted:
            continue
        current = peak = 0
        for op in ops:
            if op.action == "alloc":
                current += nbytes(op.buffer, op.unit, segment, fresh)
                peak = max(peak, current)
            elif op.action == "free":
                current -= nbytes(op.buffer, op.unit, segment, fresh)
        out[segment] = max(out[segment], peak)
    return out
