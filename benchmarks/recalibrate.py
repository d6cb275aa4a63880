"""A stored emulated-network result's predictions made again with today's cost model.

``python -m benchmarks network`` measures for 15-45 minutes and predicts each
scheme's step once, with project.step_time as it stood that day. The report
reuses stored runs, so it re-derives their predictions here from what the run
fitted (``calibration.fit``: the links as the cost model takes them, the
compute model) and the run's topology (``config``), through the run's own
network.predict: the measured figures and the fit are kept, the predictions
(and the plans' figures beside them) are today's. Anything the prediction
needs that an old result lacks is refused by name, never filled in.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
from typing import Any

from benchmarks import network
from megatron_lbp.core.costs import LINK_CLASS_ORDER
from megatron_lbp.projection.project import ComputeModel

# network._plans and network._model read these args; config() wrote them at these paths.
CONFIG_ARGS = {"nodes": ("nodes",), "ranks_per_node": ("ranks_per_node",),
               "micro_batches": ("micro_batches",), "layers": ("model", "num_layers"),
               "hidden": ("model", "hidden_size"), "vocab": ("model", "vocab_size")}
PER_CLASS = ("model_links_MB_per_s", "model_latency_us")


class NotRederivable(ValueError):
    """The stored result lacks something the prediction needs; the message names it."""


class _ConfigArgs(argparse.Namespace):
    """The run's args as far as config() recorded them; reading any other one is an error,
    so a prediction that starts to need more cannot quietly run on a missing setting."""

    def __getattr__(self, name: str):
        raise AttributeError(f"the re-derivation has no args.{name}: network.predict now reads "
                             f"it, add it to benchmarks/recalibrate.py:CONFIG_ARGS")


def _get(obj: Any, path: tuple[str, ...], where: str = "") -> Any:
    """obj[path[0]][path[1]]...; a missing key is refused by its full name (``where``.path)."""
    for i, key in enumerate(path):
        if not isinstance(obj, dict) or key not in obj:
            name = ".".join(((where,) if where else ()) + path[:i + 1])
            raise NotRederivable(f"the network result has no {name}: cannot re-derive its "
                                 f"predictions (rerun it)")
        obj = obj[key]
    return obj


def plan_args(config: dict[str, Any]) -> argparse.Namespace:
    """The args network._plans and network._model need, from the run's recorded config."""
    return _ConfigArgs(**{arg: _get(config, path, "config") for arg, path in CONFIG_ARGS.items()})


def measured_steps(result: dict[str, Any]) -> dict[str, float]:
    """Each scheme's median step, the figure the run calibrated on."""
    schemes = _get(result, ("schemes",))
    return {s: _get(row, ("median_s",), f"schemes.{s}") for s, row in schemes.items()}


def stored_fit(result: dict[str, Any]) -> dict[str, Any]:
    """The run's fit, checked for every input of network.predict."""
    fit = _get(result, ("calibration", "fit"))
    for key in network.PREDICTED_FROM:
        _get(fit, (key,), "calibration.fit")
    for key in PER_CLASS:
        for cls in LINK_CLASS_ORDER:
            _get(fit, (key, cls), "calibration.fit")
    fields = {f.name for f in dataclasses.fields(ComputeModel)}
    for name in sorted(fields):
        _get(fit, ("compute_model", name), "calibration.fit")
    extra = sorted(set(fit["compute_model"]) - fields)
    if extra:
        raise NotRederivable(f"calibration.fit.compute_model has {', '.join(extra)}, which "
                             f"today's ComputeModel does not take: cannot re-derive")
    return fit


def recalibrate(result: dict[str, Any], predicted_with: str) -> dict[str, Any]:
    """A copy of ``result`` whose calibration is predicted by today's model from its stored fit.

    ``predicted_with`` is recorded as ``calibration.fit.predicted_with`` (which
    cost model made the predictions). Raises NotRederivable, naming the field,
    when the result lacks an input; ``result`` itself is never changed.
    """
    args = plan_args(_get(result, ("config",)))
    measured = measured_steps(result)
    fit = stored_fit(result)
    out = copy.deepcopy(result)
    out["calibration"] = network.predict(args, measured, copy.deepcopy(fit))
    out["calibration"]["fit"]["predicted_with"] = predicted_with
    return out
