"""Where a profiled step's time goes, per scheme: cProfile of rank 0 during ``bench overhead --profile``.

cProfile measures wall time, so a rank blocked in a collective waiting for
its peers counts there. Self time (``tottime``) of every function is put in
one category by where the function lives:

- ``collectives and waits``: torch.distributed's C++ calls (all-gather,
  reduce-scatter, ``Work.wait``, ...), i.e. moving bytes and waiting for peers;
- ``torch compute``: every other C++ call (operators, autograd's engine);
- ``engine Python`` (megatron_lbp/engine/), ``megatron-core Python``
  (megatron/core/), ``shims + loop Python`` (the rest of megatron_lbp: the CPU
  shims of compat.py that every scheme calls, the training loop of
  testing/tiny_gpt.py), ``torch Python`` (torch/*.py: nn.Module calls,
  autograd glue, c10d wrappers) and ``other Python``.

The categories add up to the profiled time; divided by the profiled steps they
are seconds per step (slower than unprofiled steps by the profiler's own cost,
which falls on Python calls). Everything here turns a profile into plain
dicts (JSON) and text.
"""
from __future__ import annotations

import pstats
from typing import Any

CATEGORIES = ("collectives and waits", "torch compute", "engine Python", "megatron-core Python",
              "shims + loop Python", "torch Python", "other Python")
TOP = 12


def category(key: tuple) -> str:
    filename, _, name = key
    if filename == "~":
        return "collectives and waits" if "_distributed_c10d" in name else "torch compute"
    path = filename.replace("\\", "/")
    if "/megatron_lbp/engine/" in path:
        return "engine Python"
    if "/megatron_lbp/" in path:
        return "shims + loop Python"
    if "/megatron/core/" in path:
        return "megatron-core Python"
    if "/torch/" in path:
        return "torch Python"
    return "other Python"


def _label(key: tuple) -> str:
    filename, line, name = key
    if filename == "~":
        return name
    parts = filename.replace("\\", "/").split("/")
    return f"{'/'.join(parts[-2:])}:{line} {name}"


def summarize(profile, steps: int) -> dict[str, Any]:
    """A cProfile.Profile of ``steps`` steps as {breakdown, top_self, engine_cumulative}."""
    stats = pstats.Stats(profile).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    breakdown = dict.fromkeys(CATEGORIES, 0.0)
    for key, (_, _, tt, _, _) in stats.items():
        breakdown[category(key)] += tt / steps
    breakdown["total"] = sum(breakdown[c] for c in CATEGORIES)

    def rows(items, by):
        items = sorted(items, key=lambda kv: kv[1][by], reverse=True)[:TOP]
        return [{"function": _label(k), "s_per_step": v[by] / steps,
                 "calls_per_step": v[1] / steps} for k, v in items]

    engine = [(k, v) for k, v in stats.items()
              if "/megatron_lbp/engine/" in k[0].replace("\\", "/")]
    compute = [(k, v) for k, v in stats.items() if category(k) == "torch compute"]
    return {"steps": steps, "breakdown_s_per_step": breakdown,
            "top_self": rows(stats.items(), 2), "top_compute": rows(compute, 2),
            "engine_cumulative": rows(engine, 3)}


def render(profiles: dict[str, dict], pairs: dict[str, dict]) -> str:
    """Side by side for each pair: the categories, each side's top functions, the engine's."""
    if not profiles:
        return ""
    steps = next(iter(profiles.values()))["steps"]
    lines = [f"cProfile of rank 0, {steps} step(s) per scheme in a run of its own (wall time, "
             f"waits included; profiled steps are slower than timed ones). Seconds per step."]
    for key, p in pairs.items():
        a, b = p["a"], p["b"]
        if a not in profiles or b not in profiles:
            continue
        ba, bb = profiles[a]["breakdown_s_per_step"], profiles[b]["breakdown_s_per_step"]
        lines += ["", f"== {key} (unprofiled ratio {p['ratio']:.3f}; {p['measures']})",
                  f"  {'where the time goes':<24}{a:>10}{b:>18}{'difference':>12}"]
        for c in (*CATEGORIES, "total"):
            lines.append(f"  {c:<24}{ba[c]:>10.4f}{bb[c]:>18.4f}{ba[c] - bb[c]:>+12.4f}")
        for side in (a, b):
            for key_, what in (("top_self", "top functions by self time"),
                               ("top_compute", "top torch compute calls")):
                lines.append(f"  {side}: {what} (s/step, calls/step)")
                lines += [f"    {r['s_per_step']:>8.4f} {r['calls_per_step']:>7.1f}  "
                          f"{r['function']}" for r in profiles[side].get(key_, [])]
        total = ba["total"]
        lines.append(f"  {a}: engine functions by cumulative time (s/step, share of the step)")
        lines += [f"    {r['s_per_step']:>8.4f} {r['s_per_step'] / total:>6.1%}  {r['function']}"
                  for r in profiles[a]["engine_cumulative"][:10]]
    return "\n".join(lines) + "\n"
