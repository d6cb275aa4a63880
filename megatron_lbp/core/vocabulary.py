"""The engine's vocabulary: its communication phases, unit kinds, knobs and their defaults.

Pure (no torch import), so it sits in the core: the engine runs by these names
and the cost model (costs.py), the flags (config.py) and the planner price and
check the same ones (tests/unit/test_layers.py checks the core imports no torch).
"""
from __future__ import annotations

# The collectives of one step, by when they run: the first three once per micro-batch,
# the step's two once per optimizer step (core/costs.py:PER_MICRO_BATCH_PHASES).
PHASES = ("forward_gather", "backward_gather", "grad_reduce", "step_reduce", "step_gather")

# What a gather unit is (engine/grouping.py:UnitSpec.kind; core/costs.py:gpt_units counts them).
# "attention" and "mlp": a transformer layer's two halves with --hier-layer-unit split.
UNIT_KINDS = ("embedding", "layer", "attention", "mlp", "output", "other")
SPLIT_KINDS = ("attention", "mlp")

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

# What one transformer layer is to the engine (--hier-layer-unit; integration/megatron_adapter.py
# declares it, engine/schedule.py frees by it, core/costs.py:gpt_units and transient_bytes
# price it). "whole": one gather unit per layer. "split": its attention (input norm and
# self-attention) and its MLP (pre-MLP norm and MLP) are two units, so a layer's weights
# and its full gradient are in memory half at a time; the attention unit stays gathered
# into the MLP's norm, because the layer adds linear_proj's bias after self-attention
# returns. Each layer then costs one collective more per phase (a latency each).
LAYER_UNITS = ("whole", "split")
DEFAULT_LAYER_UNIT = "whole"
# Why split layers are refused with full recomputation (the engine, the plan and the launcher
# say it in their own flags' names).
SPLIT_WITH_FULL_RECOMPUTE = ("the recomputed layer needs both halves gathered at once, so "
                             "splitting saves nothing in the backward")
