"""The engine's runtime vocabulary: its communication phases, unit kinds and reduce bound.

Pure (no torch import): the cost model (costs.py) and the trace replay price
what the engine does with the same names, and tests/unit/test_layout.py checks that
importing them pulls in no torch.
"""
from __future__ import annotations

# The collectives of one step, by when they run: the first three once per micro-batch,
# the step's two once per optimizer step (core/costs.py:PER_MICRO_BATCH_PHASES).
PHASES = ("forward_gather", "backward_gather", "grad_reduce", "step_reduce", "step_gather")

# What a gather unit is (engine/grouping.py:UnitSpec.kind; core/costs.py:gpt_units counts them).
UNIT_KINDS = ("embedding", "layer", "output", "other")

# Gradient reduce-scatters kept in flight before the oldest is waited for, by default (the
# engine's bound on full gradient buffers alive at once during backward;
# --hier-max-pending-reduces sets it, engine/schedule.py applies it,
# core/costs.py:transient_bytes prices it). Each one more keeps one more full gradient unit
# alive; each one less leaves a reduce-scatter less compute to hide behind.
MAX_PENDING_REDUCES = 2

# What the embedding unit's backward does (--hier-embedding-backward-gather; engine/schedule.py
# applies it, core/costs.py:transient_bytes and traffic_bytes price it). An embedding lookup's
# backward reads the indices and the weight's shape, never its values, so "skip" gathers
# nothing for the embedding's own backward and frees a tied embedding's gathered weights as
# soon as the output layer's backward is done; "gather" (the default, and every recorded
# trace's) regathers it like any unit and keeps a tied one until its last gradient.
EMBEDDING_BACKWARD_GATHERS = ("gather", "skip")
DEFAULT_EMBEDDING_BACKWARD_GATHER = "gather"
