"""The report's PNG plots, drawn (Agg, no display) from the run records it saved.

One plot per measured section: bytes per link class per scheme (K=1 and K=4),
step time per scheme on the emulated network, the Frontier-shaped emulation's
compute, exposed and link time, projected TFLOPS per GCD against GCD count
(10B and 20B; idealised and replayed). A section that did not run gets no plot.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report_goals import result, traffic_bytes
from megatron_lbp.core.costs import LINK_CLASS_ORDER


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def traffic_plot(runs, path: Path) -> bool:
    ks = [k for k in (1, 4) if traffic_bytes(runs, k)]
    if not ks:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(ks), figsize=(6.5 * len(ks), 4.2), squeeze=False)
    for ax, k in zip(axes[0], ks):
        data = traffic_bytes(runs, k)
        schemes = list(data)
        width = 0.8 / len(LINK_CLASS_ORDER)
        for i, cls in enumerate(LINK_CLASS_ORDER):
            xs = [j + (i - 1) * width for j in range(len(schemes))]
            ax.bar(xs, [data[s][cls] / 1e3 for s in schemes], width, label=cls)
        ax.set_xticks(range(len(schemes)), schemes, rotation=35, ha="right")
        ax.set_ylabel("kB sent per rank per optimizer step")
        ax.set_title(f"K = {k} micro-batch(es)")
        ax.legend()
    fig.suptitle("Bytes per link class (tiny GPT, traffic bench)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def network_plot(runs, path: Path) -> bool:
    net = result(runs, "network")
    rows = (net or {}).get("schemes") or {}
    if not rows:
        return False
    plt = _pyplot()
    schemes = list(rows)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    bars = ax.bar(schemes, [rows[s]["median_s"] for s in schemes],
                  color=["tab:green" if s == "lbp" else "tab:gray" for s in schemes])
    for bar, s in zip(bars, schemes):
        ax.annotate(f"{rows[s]['ratio_to_lbp']:.2f}x", (bar.get_x() + bar.get_width() / 2,
                                                        bar.get_height()),
                    ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("median step time (s)")
    ax.set_title("Emulated network (network bench): step time, ratio to lbp")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def projection_plot(runs, path: Path) -> bool:
    proj = result(runs, "project")
    if not proj:
        return False
    plt = _pyplot()
    models = list(proj["results"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, name in zip(axes[0], models):
        for scheme, rows in proj["results"][name].items():
            gcds = sorted(int(g) for g in rows)
            # int8 variants overlap their bf16 line when the network is not their bottleneck.
            ax.plot(gcds, [rows[str(g)]["tflops_per_gcd"] for g in gcds], marker="o",
                    linestyle="--" if "int8" in scheme else "-", label=scheme)
        replayed = ((proj.get("replay") or {}).get("results") or {}).get(name, {})
        for scheme in ("lbp", "zeropp"):
            rows = replayed.get(scheme)
            if rows:
                gcds = sorted(int(g) for g in rows)
                ax.plot(gcds, [rows[str(g)]["tflops_per_gcd"] for g in gcds], marker="x",
                        linestyle=":", label=f"{scheme}, replayed schedule")
        ax.set_xscale("log", base=2)
        ax.set_xticks(gcds, [str(g) for g in gcds])
        ax.set_xlabel("GCDs")
        ax.set_ylabel("model TFLOPS per GCD")
        ax.set_title(f"{name} (cost model)")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle("Frontier projection (project bench)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def frontier_plot(runs, path: Path) -> bool:
    """Frontier-shaped emulation: each scheme's step as compute alone + exposed, its link time."""
    net = result(runs, "network_frontier")
    rows = {s: r for s, r in ((net or {}).get("schemes") or {}).items() if "compute_s" in r}
    if not rows:
        return False
    plt = _pyplot()
    schemes = list(rows)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    compute = [rows[s]["compute_s"] for s in schemes]
    exposed = [max(0.0, rows[s]["exposed_s"]) for s in schemes]
    ax.bar(schemes, compute, color="tab:blue", label="compute alone")
    ax.bar(schemes, exposed, bottom=compute, color="tab:red", label="exposed (step - compute)")
    ax.scatter(schemes, [rows[s]["link_s"] for s in schemes], marker="_", s=900, color="black",
               zorder=3, label="its collectives alone")
    ax.set_ylabel("seconds per step")
    ax.set_title("Frontier-shaped emulation (network bench)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


PLOTS = {"traffic.png": (traffic_plot, ("traffic_k1", "traffic_k4")),
         "network.png": (network_plot, ("network",)),
         "network_frontier.png": (frontier_plot, ("network_frontier",)),
         "projection.png": (projection_plot, ("project",))}


def draw(report: dict[str, Any], plots_dir: Path) -> dict[str, list[str]]:
    """{file name: run keys it was drawn from} for each plot drawn; stale ones removed."""
    drawn = {}
    for name, (fn, sources) in PLOTS.items():
        path = plots_dir / name
        if fn(report["runs"], path):
            drawn[name] = list(sources)
        elif path.exists():
            path.unlink()
    return drawn
