"""Rank function of tests/engine/test_embedding_backward.py: trainings with the embedding's
backward gather on and off, and what each unit's gathers were in the last step."""
from __future__ import annotations

import contextlib

from megatron_lbp.testing.tiny_gpt import setup_hier
from tests.helpers import broken_engine


def train_and_watch_gathers(runs: dict, train) -> dict:
    """{name: result} for runs {name: (TinyGPTSpec, --hier-* argv, fault)}: losses, grad norms,
    final weights, the last step's report, and per unit kind the phases of its gathers in
    the last step (every GatherUnit.unshard call, recorded as it is made), and how many layer
    gradient reduce-scatters of that step started while the embedding's weights were
    gathered (a layer's backward is done then). ``fault``: None, or
    the name of a tests/helpers/broken_engine.py function the run trains under."""
    out = {}
    for name, (spec, argv, fault) in runs.items():
        with getattr(broken_engine, fault)() if fault else contextlib.nullcontext():
            out[name] = _train(spec, argv, train)
    return out


def _train(spec, argv, train) -> dict:
    trainer = setup_hier(spec, train, argv)
    model = trainer.model
    gathers: list[tuple[str, str]] = []
    held = [0]
    embedding = next(u for u in model.units if u.kind == "embedding")
    for u in model.units:
        def unshard(phase, async_op, u=u, real=u.unshard):
            gathers.append((u.kind, phase))
            return real(phase, async_op)
        u.unshard = unshard
        if u.kind == "layer":
            def start_reduce(*a, real=u.start_reduce, **kw):
                held[0] += embedding.bucket.is_resident()
                return real(*a, **kw)
            u.start_reduce = start_reduce
    result = trainer.run(range(train.steps - 1))
    gathers.clear()
    held[0] = 0
    trainer.run([train.steps - 1], result=result)
    return {"losses": result.losses, "grad_norms": result.grad_norms,
            "params": trainer.final_params(), "report": result.step_reports[-1],
            "gathers": sorted(set(gathers)),
            "backward_gathers": sum(1 for _, ph in gathers if ph == "backward_gather"),
            "embedding_held_at_layer_reduces": held[0],
            "numels": model.bucket_numels(),
            "kinds": [u.kind for u in model.units],
            "config": trainer.hier.config.as_dict(),
            "links": dict(trainer.hier.link_classes)}
