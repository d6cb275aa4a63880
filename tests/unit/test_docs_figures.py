"""The figures the docs state equal what the commands they name print.

Each check reads a figure from a docs page, runs the command the page names (the
plan tool, `python -m megatron_lbp.plan ... --json`, pure Python, under a second
each) and compares. A check first asserts that the page names the command, so a
page cannot quote a figure without saying where it comes from. gpu.md's part D
table is checked against the committed result of the run it reports. BENCHMARKS.md's
figures are checked against their results.json, and the README's quotes against
BENCHMARKS.md, by tests/bench/test_bench_report.py.
"""
import functools
import json
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
PLAN = "python -m megatron_lbp.plan"


def _flat(text: str) -> str:
    """Text with line continuations, backticks and runs of white space folded, so that a
    command wrapped over lines or code spans reads as one line."""
    return re.sub(r"\s+", " ", text.replace("\\\n", " ").replace("`", ""))


def page_text(page: str) -> str:
    return (REPO / page).read_text()


def assert_names_command(page: str, command: str) -> None:
    assert _flat(command) in _flat(page_text(page)), \
        f"{page} does not name the command its figures come from: `{command}`"


@functools.lru_cache(maxsize=None)
def plan_json(args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "megatron_lbp.plan", *shlex.split(args), "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"`{PLAN} {args} --json` failed: {out.stderr[-2000:]}"
    return json.loads(out.stdout)


def differ(page: str, figure: str, on_page: str, printed: str, command: str) -> str | None:
    """A line naming the figure, the page and both values, or None when they agree."""
    if on_page == printed:
        return None
    return f"{page}: {figure}: the page says {on_page}, `{command}` prints {printed}"


def gb(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.3f}"


def number(cell: str) -> float:
    """A table cell's figure: '+3.637' -> 3.637, '0 (as given)' -> 0, '1,272,320' -> 1272320."""
    found = re.search(r"[-+]?\d[\d,]*(?:\.\d+)?", cell)
    assert found, f"no figure in table cell {cell!r}"
    return float(found.group().replace(",", ""))


def table_after(text: str, marker: str) -> list[dict[str, str]]:
    """The first markdown table after ``marker`` as rows of {header: cell}."""
    rest = text[text.index(marker):]
    lines = [ln for ln in rest.splitlines() if ln.startswith("|")]
    start = rest.splitlines().index(lines[0])
    block = []
    for ln in rest.splitlines()[start:]:
        if not ln.startswith("|"):
            break
        block.append([c.strip() for c in ln.strip().strip("|").split("|")])
    header, rows = block[0], block[2:]
    return [dict(zip(header, row)) for row in rows]


# ---------------------------------------------------------------- design.md §2.4

DESIGN = "docs/design.md"
LBP_20B = f"{PLAN} --world-size 384 --params 20e9 --preset lbp --hier-secondary-group-size 8"
ZERO3_20B = f"{PLAN} --world-size 384 --params 20e9 --preset zero3"
GPT_20B = (f"{PLAN} --world-size 384 --num-layers 44 --hidden-size 6144 --num-attention-heads 64 "
           "--vocab-size 50304 --seq-length 2048 --hier-secondary-group-size 8")


def design_memory_mismatches(text: str) -> list[str]:
    sums = re.search(r"that is ([\d.]+) \+ ([\d.]+) \+ ([\d.]+) \+ ([\d.]+) = ([\d.]+) GB per GCD",
                     _flat(text))
    zero3 = re.search(r"zero3 holds ([\d.]+) GB", _flat(text))
    assert sums and zero3, f"{DESIGN} §2.4 no longer states the 20B memory sum and zero3's figure"
    mem = plan_json(LBP_20B.removeprefix(PLAN))["memory_bytes"]
    bad = [differ(DESIGN, f"§2.4 20B lbp {state} GB per GCD", sums.group(i + 1), gb(mem[state]), LBP_20B)
           for i, state in enumerate(("primary", "secondary", "grad", "optimizer", "total"))]
    total = plan_json(ZERO3_20B.removeprefix(PLAN))["memory_bytes"]["total"]
    bad.append(differ(DESIGN, "§2.4 20B zero3 total GB per GCD", zero3.group(1), gb(total), ZERO3_20B))
    return [b for b in bad if b]


def test_design_memory_per_rank_is_the_plans():
    text = page_text(DESIGN)
    for command in (LBP_20B, ZERO3_20B):
        assert_names_command(DESIGN, command)
    bad = design_memory_mismatches(text)
    assert not bad, "\n".join(bad)


def test_design_transient_bounds_are_the_plans():
    assert_names_command(DESIGN, GPT_20B)
    found = re.search(r"forward / backward / step at ([\d.]+) / ([\d.]+) / ([\d.]+) GB",
                      _flat(page_text(DESIGN)))
    assert found, f"{DESIGN} no longer states the 20B transient bounds"
    transient = plan_json(GPT_20B.removeprefix(PLAN))["transient_bytes"]
    bad = [differ(DESIGN, f"20B transient {phase} GB", found.group(i + 1), gb(transient[phase]), GPT_20B)
           for i, phase in enumerate(("forward", "backward", "step"))]
    bad = [b for b in bad if b]
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------- planning.md's knobs

PLANNING = "docs/planning.md"
KNOBS_20B = GPT_20B + " --micro-batches 2 --micro-batch-size 2 --recompute selective"
KNOB_KEYS = {"prefetch": "prefetch_units", "in flight": "max_pending_reduces",
             "gradients": "grad_reduce_dtype", "embedding backward": "embedding_backward_gather",
             "layers": "layer_unit"}
KNOB_FIGURES = {"peak (GB)": lambda k: k["transient_peak"] / 1e9,
                "saves (GB)": lambda k: k["saves_bytes"] / 1e9,
                "exposed (s)": lambda k: k["exposed_s"], "costs (s)": lambda k: k["cost_s"]}


def knob_mismatches(rows: list[dict[str, str]], knobs: list[dict]) -> list[str]:
    printed = {tuple(str(k[key]) for key in KNOB_KEYS.values()): k for k in knobs}
    bad = []
    for row in rows:
        key = tuple(row[col] for col in KNOB_KEYS)
        label = ", ".join(f"{col} {row[col]}" for col in KNOB_KEYS)
        if key not in printed:
            bad.append(f"{PLANNING}: knob row ({label}) is not a row `{KNOBS_20B}` prints")
            continue
        for col, value in KNOB_FIGURES.items():
            theirs = round(value(printed[key]), 3)
            if number(row[col]) != theirs:
                bad.append(differ(PLANNING, f"knob row ({label}) {col}", row[col], f"{theirs:.3f}",
                                  KNOBS_20B))
    missing = set(printed) - {tuple(r[c] for c in KNOB_KEYS) for r in rows}
    bad += [f"{PLANNING}: `{KNOBS_20B}` prints knob row {m}, which the page's table lacks"
            for m in sorted(missing)]
    return bad


def test_planning_knob_table_is_what_the_plan_prints():
    assert_names_command(PLANNING, KNOBS_20B)
    rows = table_after(page_text(PLANNING), "| prefetch | in flight |")
    assert len(rows) >= 5, f"{PLANNING}'s knob table has {len(rows)} rows"
    bad = knob_mismatches(rows, plan_json(KNOBS_20B.removeprefix(PLAN))["transient_knobs"])
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------- int8.md's byte table

INT8 = "docs/int8.md"
TINY = (f"{PLAN} --world-size 8 --gpus-per-node 4 --num-layers 2 --hidden-size 64 "
        "--vocab-size 4096 --params-dtype bf16")


def int8_mismatches(rows: list[dict[str, str]]) -> list[str]:
    bad = []
    for row in rows:
        flags = row["flags"].strip("`")
        command = f"{TINY} {flags}".strip()
        plan = plan_json(command.removeprefix(PLAN))
        printed = dict(plan["traffic_bytes"], **{"secondary held": plan["memory_bytes"]["secondary"]})
        for col in ("package", "node", "network", "secondary held"):
            bad.append(differ(INT8, f"{row['mode']} {col} bytes", row[col], f"{printed[col]:,}", command))
    return [b for b in bad if b]


def test_int8_byte_table_is_what_the_plan_prints():
    assert_names_command(INT8, TINY)
    rows = table_after(page_text(INT8), "| mode | flags |")
    assert len(rows) >= 5, f"{INT8}'s byte table has {len(rows)} rows"
    bad = int8_mismatches(rows)
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------- gpu.md's part D table

GPU = "docs/gpu.md"
GPU_RESULT = "docs/gpu-check/cpu/result.json"
GPU_VARIANTS = {"int8 secondary (S=8)": "int8-secondary", "no secondary": "no-secondary"}
GPU_COLUMNS = {"primary": "primary", "secondary": "secondary", "grad": "grad",
               "optimizer": "optimizer", "total": "total", "engine's transient peak": "peak_transient"}


def gpu_mismatches(rows: list[dict[str, str]], text: str, result: dict) -> list[str]:
    part = next(p for p in result["parts"] if p["part"] == "D")
    source = f"{GPU_RESULT} (python -m megatron_lbp.gpu_check --out DIR)"
    bad = []
    wall = re.search(r"ran part D in (\d+) s", _flat(text))
    assert wall, f"{GPU} no longer states part D's wall time"
    bad.append(differ(GPU, "part D wall seconds", wall.group(1), f"{part['wall_s']:.0f}", source))
    for row in rows:
        variant = part["figures"]["variants"][GPU_VARIANTS[row["variant"]]]
        for col, key in GPU_COLUMNS.items():
            measured = variant["bytes"][key]["measured"] / 2 ** 30
            if number(row[col]) != round(measured, 3):
                bad.append(differ(GPU, f"part D {row['variant']} {col} GiB", row[col],
                                  f"{measured:.3f}", source))
    return [b for b in bad if b]


def test_gpu_part_d_table_is_the_committed_result():
    text = page_text(GPU)
    assert GPU_RESULT in text, f"{GPU} does not name {GPU_RESULT}, where its part D figures come from"
    rows = table_after(text, "| variant | primary |")
    assert {r["variant"] for r in rows} == set(GPU_VARIANTS), rows
    bad = gpu_mismatches(rows, text, json.loads((REPO / GPU_RESULT).read_text()))
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------- frontier.md's chooser table

FRONTIER = "docs/frontier.md"
CHOOSE = (f"{PLAN} --choose --world-size W --num-layers L --hidden-size H --num-attention-heads A "
          "--seq-length 2048 --vocab-size 50304 --global-batch-size 1536 --reserve-gb 4")
SHAPES = {"20B": "--num-layers 44 --hidden-size 6144 --num-attention-heads 64",
          "10B": "--num-layers 32 --hidden-size 5120 --num-attention-heads 40"}


def figures(text: str) -> list[str]:
    return re.findall(r"\d+\.\d+", text)


def choose_row_mismatches(row: dict[str, str], out: str, command: str) -> list[str]:
    """A table row against what the chooser prints: the fastest row's step and band, the
    chosen's step, band and total, and the chosen/best zeropp and zero3 ratios with bands
    (a band of one value is written as the value alone)."""
    ranking = [ln for ln in out.splitlines() if re.match(r"  \S.* step [\d.]+ s \[", ln)]
    chosen = next(ln for ln in ranking if ln.endswith("<- chosen"))

    def step(line):
        return figures(re.search(r"step ([\d.]+) s \[([\d.]+), ([\d.]+)\]", line).group())

    def ratio(name):
        found = re.search(rf"chosen/{name} step-time ratio ([\d.]+) \[([\d.]+), ([\d.]+)\]", out)
        point, low, high = found.groups()
        return [point] if low == high == point else [point, low, high]

    printed = {"fastest (step s, band)": step(ranking[0]), "step (s) [band]": step(chosen),
               "memory (GB)": re.findall(r"total ([\d.]+) GB", chosen),
               "chosen/best zeropp [band]": ratio("zeropp"),
               "chosen/best zero3 [band]": ratio("zero3")}
    cells = dict(row, **{"fastest (step s, band)": row["fastest (step s, band)"].split(":")[-1]})
    bad = [differ(FRONTIER, f"{row['model, nodes']} {col}", " ".join(figures(cells[col])),
                  " ".join(fig), command) for col, fig in printed.items()]
    return [b for b in bad if b]


@pytest.mark.slow   # four chooser runs at 128 and 384 ranks
def test_frontier_chooser_table_is_what_the_chooser_prints():
    assert_names_command(FRONTIER, CHOOSE)
    rows = table_after(page_text(FRONTIER), "| model, nodes | fastest")
    assert len(rows) == 4, f"{FRONTIER}'s chooser table has {len(rows)} rows"
    bad = []
    for row in rows:
        model, nodes = [c.strip() for c in row["model, nodes"].split(",")]
        command = (CHOOSE.replace("W", str(8 * int(nodes))).replace(
            "--num-layers L --hidden-size H --num-attention-heads A", SHAPES[model]) + " --verbose")
        out = subprocess.run([sys.executable, "-m", "megatron_lbp.plan", *shlex.split(
            command.removeprefix(PLAN))], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, f"`{command}` failed: {out.stderr[-2000:]}"
        bad += choose_row_mismatches(row, out.stdout, command)
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------- the checks can fail

def test_a_changed_figure_is_named_with_the_page_and_both_values():
    text = page_text(DESIGN).replace("= 33.164 GB per GCD", "= 33.999 GB per GCD")
    assert design_memory_mismatches(text) == [
        f"{DESIGN}: §2.4 20B lbp total GB per GCD: the page says 33.999, `{LBP_20B}` prints 33.164"]

    rows = table_after(page_text(INT8), "| mode | flags |")
    rows[0] = dict(rows[0], network="272,641")
    assert int8_mismatches(rows) == [
        f"{INT8}: lbp network bytes: the page says 272,641, `{TINY}` prints 272,640"]

    rows = table_after(page_text(PLANNING), "| prefetch | in flight |")
    knobs = plan_json(KNOBS_20B.removeprefix(PLAN))["transient_knobs"]
    changed = [dict(rows[1], **{"peak (GB)": "7.000"}), *rows[2:]]
    bad = knob_mismatches(changed, knobs)
    assert bad[0].endswith("peak (GB): the page says 7.000, "
                           f"`{KNOBS_20B}` prints 6.940"), bad
    assert "which the page's table lacks" in bad[-1], bad

    text = page_text(GPU)
    rows = table_after(text, "| variant | primary |")
    rows[1] = dict(rows[1], total="1.100")
    assert gpu_mismatches(rows, text, json.loads((REPO / GPU_RESULT).read_text())) == [
        f"{GPU}: part D no secondary total GiB: the page says 1.100, "
        f"`{GPU_RESULT} (python -m megatron_lbp.gpu_check --out DIR)` prints 1.087"]
