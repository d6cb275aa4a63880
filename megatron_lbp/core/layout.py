"""Nested layout of one flat bucket over a hierarchical data-parallel world.

Pure arithmetic, no torch: which elements each rank owns and in which order a
collective must see its chunks. Group sizes P | G | O | W, R = W / O replicas,
secondary S (0 = off, S | W); a bucket is padded so that every level divides it
and every shard is a multiple of ``align``. Invariant: a rank's optimizer slice
lies inside its gradient slice, which lies inside its primary slice. Every
collective is contiguous over its sorted group except the G reduce-scatter, whose
communicator lists its members in chunk order (:func:`grad_reduce_order`).
The formulas, the reasoning and a worked example: docs/design.md §2.1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, TypeVar

__all__ = [
    "LEVELS",
    "LayoutError",
    "Range",
    "BucketLayout",
    "plan_bucket",
    "group_ranks",
    "all_groups",
    "permute_chunks",
    "inverse_order",
    "grad_reduce_order",
]

LEVELS = ("param", "grad", "optim", "inter", "grad_to_param", "secondary", "replica")

T = TypeVar("T")


class LayoutError(ValueError):
    """A bad group size, bucket size or rank; the message is one line."""


@dataclass(frozen=True)
class Range:
    """Half-open element range [start, stop) of a bucket."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop:
            raise LayoutError(f"Range({self.start}, {self.stop}) must satisfy 0 <= start <= stop")

    @property
    def size(self) -> int:
        return self.stop - self.start

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def slice(self) -> slice:
        return slice(self.start, self.stop)

    def contains(self, other: "Range") -> bool:
        return self.start <= other.start and other.stop <= self.stop

    def __repr__(self) -> str:
        return f"[{self.start}, {self.stop})"


# ----------------------------------------------------------------- validation

def _check_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; True as a group size is always a caller bug.
    if not isinstance(value, int) or isinstance(value, bool):
        raise LayoutError(f"{name}={value!r} must be an int")
    if value < minimum:
        raise LayoutError(f"{name}={value} must be >= {minimum}")


def _check_divides(small_name: str, small: int, big_name: str, big: int) -> None:
    if big % small:
        raise LayoutError(f"{big_name}={big} must be a multiple of {small_name}={small}")


def _check_sizes(world_size, param_group_size, grad_group_size, optim_group_size,
                 secondary_group_size) -> None:
    _check_int("world_size", world_size, 1)
    _check_int("param_group_size", param_group_size, 1)
    _check_int("grad_group_size", grad_group_size, 1)
    _check_int("optim_group_size", optim_group_size, 1)
    _check_int("secondary_group_size", secondary_group_size, 0)
    _check_divides("param_group_size", param_group_size, "grad_group_size", grad_group_size)
    _check_divides("grad_group_size", grad_group_size, "optim_group_size", optim_group_size)
    _check_divides("optim_group_size", optim_group_size, "world_size", world_size)
    if secondary_group_size:
        _check_divides("secondary_group_size", secondary_group_size, "world_size", world_size)


def _check_rank(rank: object, world_size: int) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise LayoutError(f"rank={rank!r} must be an int")
    if not 0 <= rank < world_size:
        raise LayoutError(f"rank={rank} must be in [0, world_size={world_size})")


def _check_level(level: object, secondary_group_size: int) -> None:
    if level not in LEVELS:
        raise LayoutError(f"level={level!r} must be one of {', '.join(LEVELS)}")
    if level == "secondary" and not secondary_group_size:
        raise LayoutError("secondary_group_size=0 has no 'secondary' level (secondary copy is off)")


# --------------------------------------------------------------------- groups

def _group_index(level: str, rank: int, P: int, G: int, O: int, S: int) -> int:
    if level == "param":
        return rank % P
    if level == "grad":
        return rank % G
    if level == "optim":
        return rank % O
    if level == "inter":
        return (rank % O) // G
    if level == "grad_to_param":
        return (rank % G) // P
    if level == "secondary":
        return rank % S
    return rank // O  # replica


def group_ranks(level: str, rank: int, world_size: int, param_group_size: int,
                grad_group_size: int, optim_group_size: int,
                secondary_group_size: int = 0) -> tuple[int, ...]:
    """DP ranks of ``rank``'s group at ``level``, in collective (group-rank) order."""
    W, P, G, O, S = (world_size, param_group_size, grad_group_size, optim_group_size,
                     secondary_group_size)
    _check_sizes(W, P, G, O, S)
    _check_level(level, S)
    _check_rank(rank, W)
    if level == "inter":
        base, j = rank - rank % O, rank % G
        return tuple(base + G * a + j for a in range(O // G))
    if level == "grad_to_param":
        base, p = rank - rank % G, rank % P
        return tuple(base + P * q + p for q in range(G // P))
    if level == "replica":
        o = rank % O
        return tuple(o + O * b for b in range(W // O))
    size = {"param": P, "grad": G, "optim": O, "secondary": S}[level]
    base = rank - rank % size
    return tuple(range(base, base + size))


def grad_reduce_order(param_group_size: int, grad_group_size: int) -> tuple[int, ...]:
    """The G-group's members in chunk order, as indices into the sorted group.

    Entry c is the position in the sorted G-group of the rank that owns bucket
    chunk c (units of N/G): the rank (q, p) = (c % (G/P), c // (G/P)), i.e.
    sorted index P*q + p. A communicator with its members in this order needs
    no permutation for the G reduce-scatter. It is the inverse of
    :attr:`BucketLayout.grad_scatter_chunk_order`; the identity when P == 1 or P == G.
    """
    P, G = param_group_size, grad_group_size
    _check_int("param_group_size", P, 1)
    _check_int("grad_group_size", G, 1)
    _check_divides("param_group_size", P, "grad_group_size", G)
    Q = G // P
    return tuple(P * (c % Q) + c // Q for c in range(G))


def all_groups(level: str, world_size: int, param_group_size: int, grad_group_size: int,
               optim_group_size: int, secondary_group_size: int = 0) -> list[tuple[int, ...]]:
    """Every group of ``level``, each in collective order, ordered by lowest member.

    Together they cover every rank exactly once, which is what
    torch.distributed.new_group needs: every rank must create every group in
    the same order.
    """
    args = (world_size, param_group_size, grad_group_size, optim_group_size,
            secondary_group_size)
    _check_sizes(*args)
    _check_level(level, secondary_group_size)
    groups, seen = [], set()
    for r in range(world_size):
        if r not in seen:
            g = group_ranks(level, r, *args)
            seen.update(g)
            groups.append(g)
    return groups


# ---------------------------------------------------------------- permutation

def permute_chunks(items: Sequence[T], order: Sequence[int]) -> list[T]:
    """Split ``items`` into len(order) equal chunks; output chunk i = input chunk order[i]."""
    n = len(order)
    if n == 0 or len(items) % n:
        raise LayoutError(f"len(items)={len(items)} must be a multiple of len(order)={n} >= 1")
    if sorted(order) != list(range(n)):
        raise LayoutError(f"order={tuple(order)} must be a permutation of range({n})")
    c = len(items) // n
    out: list[T] = []
    for k in order:
        out.extend(items[k * c:(k + 1) * c])
    return out


def inverse_order(order: Sequence[int]) -> tuple[int, ...]:
    """The order that undoes ``order`` under permute_chunks."""
    n = len(order)
    if sorted(order) != list(range(n)):
        raise LayoutError(f"order={tuple(order)} must be a permutation of range({n})")
    inv = [0] * n
    for i, k in enumerate(order):
        inv[k] = i
    return tuple(inv)


# --------------------------------------------------------------------- bucket

@dataclass(frozen=True)
class BucketLayout:
    """Where every rank's primary / grad / optimizer / secondary slice of one bucket lies.

    Build it with :func:`plan_bucket`; direct construction is validated too.
    """

    numel: int
    padded_numel: int
    world_size: int
    param_group_size: int
    grad_group_size: int
    optim_group_size: int
    secondary_group_size: int
    align: int

    def __post_init__(self) -> None:
        _check_sizes(self.world_size, self.param_group_size, self.grad_group_size,
                     self.optim_group_size, self.secondary_group_size)
        _check_int("numel", self.numel, 1)
        _check_int("align", self.align, 1)
        _check_int("padded_numel", self.padded_numel, self.numel)
        _check_divides("optim_group_size*align", self.optim_group_size * self.align,
                       "padded_numel", self.padded_numel)
        if self.secondary_group_size:
            _check_divides("secondary_group_size*align", self.secondary_group_size * self.align,
                           "padded_numel", self.padded_numel)

    # sizes
    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    @property
    def replicas(self) -> int:
        return self.world_size // self.optim_group_size

    @property
    def primary_size(self) -> int:
        return self.padded_numel // self.param_group_size

    @property
    def grad_size(self) -> int:
        return self.padded_numel // self.grad_group_size

    @property
    def optim_size(self) -> int:
        return self.padded_numel // self.optim_group_size

    @property
    def secondary_size(self) -> int:
        S = self.secondary_group_size
        return self.padded_numel // S if S else 0

    # indices
    def group_index(self, level: str, rank: int) -> int:
        """Position of ``rank`` inside its ``level`` group (== its index in group_ranks)."""
        _check_level(level, self.secondary_group_size)
        _check_rank(rank, self.world_size)
        return _group_index(level, rank, self.param_group_size, self.grad_group_size,
                            self.optim_group_size, self.secondary_group_size)

    def _pqa(self, rank: int) -> tuple[int, int, int]:
        _check_rank(rank, self.world_size)
        P, G, O = self.param_group_size, self.grad_group_size, self.optim_group_size
        return rank % P, (rank % G) // P, (rank % O) // G

    # slices in bucket order
    def primary_range(self, rank: int) -> Range:
        p, _, _ = self._pqa(rank)
        return Range(p * self.primary_size, (p + 1) * self.primary_size)

    def grad_range(self, rank: int) -> Range:
        return self._shift(self.grad_in_primary(rank), self.primary_range(rank).start)

    def optim_range(self, rank: int) -> Range:
        return self._shift(self.optim_in_primary(rank), self.primary_range(rank).start)

    def secondary_range(self, rank: int) -> Range | None:
        _check_rank(rank, self.world_size)
        if not self.secondary_group_size:
            return None
        s = rank % self.secondary_group_size
        return Range(s * self.secondary_size, (s + 1) * self.secondary_size)

    # slices relative to the enclosing shard, for indexing a rank's local buffers
    def grad_in_primary(self, rank: int) -> Range:
        _, q, _ = self._pqa(rank)
        return Range(q * self.grad_size, (q + 1) * self.grad_size)

    def optim_in_grad(self, rank: int) -> Range:
        _, _, a = self._pqa(rank)
        return Range(a * self.optim_size, (a + 1) * self.optim_size)

    def optim_in_primary(self, rank: int) -> Range:
        return self._shift(self.optim_in_grad(rank), self.grad_in_primary(rank).start)

    @staticmethod
    def _shift(r: Range, offset: int) -> Range:
        return Range(r.start + offset, r.stop + offset)

    # collective order
    @property
    def grad_scatter_chunk_order(self) -> tuple[int, ...]:
        """Entry i = bucket chunk (units of N/G) that a G reduce-scatter over the *sorted*
        G-group sends to its rank i (the communicator in :func:`grad_reduce_order` needs none)."""
        P, Q = self.param_group_size, self.grad_group_size // self.param_group_size
        # group rank i = P*q + p owns bucket chunk p*Q + q
        return tuple((i % P) * Q + i // P for i in range(self.grad_group_size))

    @property
    def grad_scatter_is_identity(self) -> bool:
        return self.param_group_size in (1, self.grad_group_size)


def plan_bucket(numel: int, world_size: int, param_group_size: int, grad_group_size: int,
                optim_group_size: int, secondary_group_size: int = 0,
                align: int = 128) -> BucketLayout:
    """Validate the group sizes and pad ``numel`` so that every level divides it evenly."""
    _check_sizes(world_size, param_group_size, grad_group_size, optim_group_size,
                 secondary_group_size)
    # An empty bucket would pad to 0 and give every rank an empty shard; the
    # caller should not have built the bucket at all.
    _check_int("numel", numel, 1)
    _check_int("align", align, 1)
    unit = optim_group_size * align
    if secondary_group_size:
        unit = math.lcm(unit, secondary_group_size * align)
    padded = -(-numel // unit) * unit
    return BucketLayout(numel, padded, world_size, param_group_size, grad_group_size,
                        optim_group_size, secondary_group_size, align)
