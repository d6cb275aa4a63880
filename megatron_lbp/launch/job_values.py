"""The rules a job's values obey, once, for both edges that make a :class:`Job`: the estimate's
flags (estimate.py) and the launcher's environment (job_env.py). A bad value raises
EstimateError (exit 2) in one line naming the setting; the edge picks how its files are named.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from megatron_lbp.core.config import EMBEDDING_BACKWARD_GATHERS, GRAD_REDUCE_DTYPES, LAYER_UNITS
from megatron_lbp.core.plan import PlanError
from megatron_lbp.core.vocabulary import SPLIT_WITH_FULL_RECOMPUTE
from megatron_lbp.launch.candidates import (RECOMPUTE_ORDER, EstimateError, given_layer_unit,
                                            load_links, units)
from megatron_lbp.launch.job import Job

RECOMPUTES = ("auto",) + RECOMPUTE_ORDER
EMBEDDING_GATHERS = ("auto",) + EMBEDDING_BACKWARD_GATHERS
LAYER_UNIT_SETTINGS = ("auto",) + LAYER_UNITS
PARAMS_DTYPES = ("bf16", "fp16", "fp32")
NETWORK_MODELS = ("per_rank", "shared_uplink")

# How each edge names the link files in a refusal ("<prefix><path>: why").
FILES_AS_FLAGS = {"links": "--links ", "survey": "--survey "}
FILES_AS_ENV = {"links": "LBP_LINKS=", "survey": "LBP_SURVEY="}


def one_of(name: str, text: str, allowed: tuple[str, ...]) -> str:
    if text not in allowed:
        raise EstimateError(f"{name}={text}: use one of {', '.join(allowed)}")
    return text


def auto_or_int(name: str, text: str, minimum: int = 1):
    """``auto`` (the planner chooses) or an integer >= ``minimum``."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < minimum:
        raise EstimateError(f"{name}={text}: use auto or an integer >= {minimum}")
    return int(text)


def integer(name: str, text: str) -> int:
    """An integer as Python reads one (argparse's ``type=int`` on the flags' edge)."""
    try:
        return int(text)
    except ValueError:
        raise EstimateError(f"{name}={text} must be an integer") from None


def number(name: str, text: str) -> float:
    """A number as Python reads one (argparse's ``type=float`` on the flags' edge)."""
    try:
        return float(text)
    except ValueError:
        raise EstimateError(f"{name}={text} must be a number") from None


def layer_unit_fits(layer_unit: str, recompute: str) -> None:
    if layer_unit == "split" and recompute == "full":
        raise EstimateError(f"HIER_LAYER_UNIT=split with RECOMPUTE=full: "
                            f"{SPLIT_WITH_FULL_RECOMPUTE} (the engine refuses it); use "
                            "RECOMPUTE=selective, none or auto")


def checked(job: Job, links: str | None, survey: str | None,
            files: Mapping[str, str] = FILES_AS_FLAGS) -> Job:
    """``job`` checked whole (ranges, the model's architecture, knobs that cannot go together),
    with its measured links and link survey read from the files given; ``files`` names them
    in a refusal. A scheme left ``auto`` is chosen (``choose`` set)."""
    checks = {"NNODES": job.nodes, "TASKS_PER_NODE": job.tasks_per_node,
              "GLOBAL_BATCH_SIZE": job.global_batch_size, "TRAIN_ITERS": job.train_iters}
    bad = [f"{k}={v}" for k, v in checks.items() if v < 1]
    if bad:
        raise EstimateError(f"{bad[0]} must be >= 1")
    for name, value in (("LBP_WRITE_GBPS", job.write_gbps_per_node),
                        ("LBP_SAVE_MINUTES", job.save_minutes)):
        if not value > 0:
            raise EstimateError(f"{name}={value:g} must be > 0")
    if not 0 < job.mfu <= 1:
        raise EstimateError(f"--mfu={job.mfu:g} must be in (0, 1]")
    if job.peak_tflops is not None and not job.peak_tflops > 0:
        raise EstimateError(f"--peak-tflops={job.peak_tflops:g} must be > 0")
    layer_unit_fits(given_layer_unit(job), job.recompute)
    try:   # the architecture, before any plan is made (groups dividing the heads, ...)
        units(job)
    except (PlanError, ValueError) as exc:
        raise EstimateError(f"the model: {exc}") from None
    if job.network_model == "shared_uplink" and not links:
        raise EstimateError("--network-model shared_uplink needs --links FILE (the measured "
                            "per-GCD network figure gives the uplink)")
    try:
        measured = load_links(links) if links else None
    except (OSError, ValueError) as exc:
        raise EstimateError(f"{files['links']}{links}: {exc}") from None
    from megatron_lbp.projection import collectives, survey_file

    try:
        model = collectives.CollectiveModel.from_file(survey) if survey else None
    except survey_file.SurveyError as exc:   # its message starts with the path
        raise EstimateError(f"{files['survey']}{exc}") from None
    return replace(job, links=measured, survey=model, choose=job.choose or job.preset == "auto")
