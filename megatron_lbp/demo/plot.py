"""The main job's PNG: lbp's loss beside stock Megatron's, and each scheme's bytes per link class.

Left: the loss of every iteration of both runs overlaid (top) and their
difference lbp - stock (bottom), so equivalence is visible at two scales.
Right: bytes each rank sent per optimizer step on each link class, lbp beside
the zero3 and zeropp presets on the same model, ranks and topology.
"""
from __future__ import annotations

import math
from pathlib import Path

from megatron_lbp.core.costs import LINK_CLASS_ORDER

COLORS = {"lbp": "tab:blue", "stock": "tab:orange", "zero3": "tab:red", "zeropp": "tab:purple"}


def draw(path: Path, losses: dict[str, dict[int, float]], bytes_per_scheme: dict[str, dict],
         *, title: str, note: str, scheme_labels: dict[str, str] | None = None) -> None:
    """``losses``: {"lbp": {it: loss}, "stock": {...}}; ``bytes_per_scheme``: {scheme: {link: B}}."""
    scheme_labels = scheme_labels or {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(12, 5.2), dpi=110)
    grid = fig.add_gridspec(2, 2, height_ratios=(3, 1.2), width_ratios=(1.25, 1), hspace=0.08,
                            wspace=0.22)
    ax_loss = fig.add_subplot(grid[0, 0])
    ax_diff = fig.add_subplot(grid[1, 0], sharex=ax_loss)
    ax_bytes = fig.add_subplot(grid[:, 1])

    styles = {"lbp": dict(lw=2.2), "stock": dict(lw=1.2, ls="--")}
    labels = {"lbp": "lbp (megatron-lbp, --hier-preset lbp)",
              "stock": "stock Megatron (distributed optimizer)"}
    for name in ("lbp", "stock"):
        curve = losses.get(name) or {}
        its = sorted(curve)
        ax_loss.plot(its, [curve[i] for i in its], color=COLORS[name], label=labels[name],
                     **styles[name])
    ax_loss.set_ylabel("lm loss")
    ax_loss.set_title("loss per iteration: same model, seed and data")
    ax_loss.legend(loc="upper right")
    ax_loss.grid(alpha=0.3)
    ax_loss.tick_params(labelbottom=False)

    common = sorted(set(losses.get("lbp", {})) & set(losses.get("stock", {})))
    diff = [losses["lbp"][i] - losses["stock"][i] for i in common]
    span = max((abs(d) for d in diff), default=0.0) or 1e-12
    # The difference in units of a power of ten named in the label: fp32 runs
    # differ by ~1e-6, bf16 runs by ~1e-2, and an axis offset label would sit on
    # the loss panel above.
    exp = math.floor(math.log10(span))
    scale = 10.0 ** exp
    ax_diff.axhline(0.0, color="0.6", lw=0.8)
    ax_diff.plot(common, [d / scale for d in diff], color="tab:green", lw=1.2)
    ax_diff.set_ylabel(f"lbp - stock\n(x 1e{exp})")
    ax_diff.set_xlabel("iteration")
    ax_diff.grid(alpha=0.3)
    if diff:
        worst = max(range(len(diff)), key=lambda k: abs(diff[k]))
        ax_diff.plot([common[worst]], [diff[worst] / scale], "o", color="tab:green")
        ax_diff.annotate(f"largest |difference| {abs(diff[worst]):.2e} at iteration "
                         f"{common[worst]}", (0.01, 0.92), xycoords="axes fraction", va="top",
                         fontsize=8.5)
        ax_diff.set_ylim(-1.4 * span / scale, 2.0 * span / scale)  # room for the note

    schemes = list(bytes_per_scheme)
    width = 0.8 / max(1, len(schemes))
    top = max((b[c] for b in bytes_per_scheme.values() for c in LINK_CLASS_ORDER), default=1)
    for k, scheme in enumerate(schemes):
        xs = [j + (k - (len(schemes) - 1) / 2) * width for j in range(len(LINK_CLASS_ORDER))]
        vals = [bytes_per_scheme[scheme][c] / 1e6 for c in LINK_CLASS_ORDER]
        ax_bytes.bar(xs, vals, width, label=scheme_labels.get(scheme, scheme),
                     color=COLORS.get(scheme))
        for x, v in zip(xs, vals):
            ax_bytes.text(x, v + top / 1e6 * 0.01, f"{v:.2f}", ha="center", va="bottom",
                          fontsize=7.5, rotation=90)
    ax_bytes.set_xticks(range(len(LINK_CLASS_ORDER)), [f"{c} link" for c in LINK_CLASS_ORDER])
    ax_bytes.set_ylim(0, top / 1e6 * 1.22)
    ax_bytes.set_ylabel("MB sent per rank per optimizer step")
    ax_bytes.set_title("bytes per link class, one optimizer step (engine ledger)")
    ax_bytes.legend(loc="upper left")
    net = {s: b["network"] for s, b in bytes_per_scheme.items()}
    if net.get("lbp"):
        ratios = [f"1/{net[s] / net['lbp']:.1f} of {s}" for s in net if s != "lbp" and net[s]]
        if ratios:
            ax_bytes.text(0.03, 0.70, "lbp's network bytes:\n" + "\n".join(ratios),
                          transform=ax_bytes.transAxes, ha="left", va="top", fontsize=9)
    ax_bytes.grid(axis="y", alpha=0.3)

    fig.suptitle(title, fontsize=11)
    fig.text(0.5, 0.005, note, ha="center", va="bottom", fontsize=8, color="0.3",
             wrap=True)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.88, bottom=0.18)
    fig.savefig(path)
    plt.close(fig)
