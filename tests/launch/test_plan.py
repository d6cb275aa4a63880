"""`python -m megatron_lbp.plan` against an independent reading of docs/design.md §2.

The expectations below are written out again from the design text (memory per
rank; bytes each rank sends per optimizer step), with the link class of each
family derived here from "consecutive ranks share a package, consecutive
packages share a node" -- not by calling costs.py or topology.py. The only
additions to §2's table are the ones the design states elsewhere: the int8
secondary copy carries one fp32 scale per block (§2 "int8 + scales"), and with
R > 1 replicas the 1/O gradient shard is all-reduced across replicas (step 7),
charged as a ring all-reduce 2T(R-1)/R.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from megatron_lbp.launch import plan

REPO = Path(__file__).resolve().parents[2]
CLASSES = ("package", "node", "network")
PHASES = ("forward_gather", "backward_gather", "grad_reduce", "step_reduce", "step_gather")
PRESET_SIZES = {  # docs/design.md §3: preset -> (P, S, G, O) as functions of (W, node, package)
    "lbp": lambda W, n, p, S=0: (p, S, n, W),
    "zero3": lambda W, n, p, S=0: (W, 0, W, W),
    "zeropp": lambda W, n, p, S=0: (W, n, W, W),
    "zero2": lambda W, n, p, S=0: (1, 0, W, W),
    "hsdp": lambda W, n, p, S=0: (n, 0, n, n),
}


# --------------------------------------------------------------------------- the design, again


def slowest(groups, gpus_per_node, gcds_per_package):
    """Slowest link any of the groups crosses, or None when all are single ranks."""
    worst = None
    for g in groups:
        if len(g) < 2:
            continue
        if len({r // gpus_per_node for r in g}) > 1:
            cls = "network"
        elif len({r // gcds_per_package for r in g}) > 1:
            cls = "node"
        else:
            cls = "package"
        if worst is None or CLASSES.index(cls) > CLASSES.index(worst):
            worst = cls
    return worst


def design_classes(W, P, S, G, O, gpn, gpp):
    consecutive = lambda n: [range(b, b + n) for b in range(0, W, n)] if n else []
    return {
        "param": slowest(consecutive(P), gpn, gpp),
        "secondary": slowest(consecutive(S), gpn, gpp),
        "grad": slowest(consecutive(G), gpn, gpp),
        "optim": slowest(consecutive(O), gpn, gpp),
        # the O/G ranks of one O-block holding the same 1/G gradient slice
        "inter": slowest([[b + G * a + j for a in range(O // G)]
                          for b in range(0, W, O) for j in range(G)], gpn, gpp),
        # the G/P ranks of one G-block holding the same 1/P weight slice
        "grad_to_param": slowest([[b + P * q + j for q in range(G // P)]
                                  for b in range(0, W, G) for j in range(P)], gpn, gpp),
        "replica": slowest([[o + O * b for b in range(W // O)] for o in range(O)], gpn, gpp),
        # the G/S ranks of one G-block at the same position of their S-groups (zeropp's qgZ)
        "grad_cross": slowest([[b + s + S * x for x in range(G // S)]
                               for b in range(0, W, G) for s in range(S)], gpn, gpp)
        if S and G % S == 0 else None,
    }


def design(M, W, P, S, G, O, *, gpn=8, gpp=2, k=1, wbytes=2, gbytes=4, sdt="int8", block=256,
           qwz=False, zeropp=False):
    """Memory and traffic per rank from docs/design.md §2 (exact Fractions of M).

    ``qwz``: §3's zeropp "+ int8 forward all-gather": each rank sends its 1/P
    slice as int8 + scales to the P-1 others (also the backward regather when S = 0).
    ``zeropp``: §3's ZeRO++ as DeepSpeed ships it: qwZ; the secondary copy in the weights'
    dtype, gathered as int8 (qwZ) by every gather after the step's first forward; bf16
    gradients; and where G = W spans nodes qgZ's int4 all-to-all, (S-1)*X chunks of
    int4(M/G) in the node and X-1 across nodes (X = G/S).
    """
    M = Fraction(M)
    R = W // O
    cls = design_classes(W, P, S, G, O, gpn, gpp)
    int8 = lambda elems: elems * (1 + Fraction(4, block))  # 1 byte + a 4-byte scale per block
    int4 = lambda elems: elems * (Fraction(1, 2) + Fraction(4, block))  # half a byte + scales
    if zeropp:
        qwz, sdt, gbytes = True, "param", wbytes
    secondary = 0 if not S else (int8(M / S) if sdt == "int8" else
                                 wbytes * M / S if sdt == "param" else 2 * M / S)
    mem = {"primary": wbytes * M / P, "secondary": secondary, "grad": gbytes * M / G,
           "optimizer": (12 if wbytes == 2 else 8) * M / O}
    mem["total"] = sum(mem.values())

    phase = {ph: dict.fromkeys(CLASSES, Fraction(0)) for ph in PHASES}

    def add(ph, family, nbytes):
        if nbytes:
            phase[ph][cls[family]] += nbytes

    # package/node lines of §2
    weights = (P - 1) * int8(M / P) if qwz else wbytes * M * Fraction(P - 1, P)
    if zeropp:
        from_secondary = (S - 1) * int8(M / S)
        add("forward_gather", "param", weights)
        add("forward_gather", "secondary", (k - 1) * from_secondary)
        add("backward_gather", "secondary", k * from_secondary)
    else:
        add("forward_gather", "param", k * weights)
        if S:
            add("backward_gather", "secondary", k * (S - 1) * secondary)
        else:
            add("backward_gather", "param", k * weights)
    if zeropp and W > gpn:
        X = G // S
        add("grad_reduce", "secondary", k * (S - 1) * X * int4(M / G))
        add("grad_reduce", "grad_cross", k * (X - 1) * int4(M / G))
    else:
        add("grad_reduce", "grad", k * gbytes * M * Fraction(G - 1, G))
    add("step_gather", "grad_to_param", wbytes * (M / P) * Fraction(G // P - 1, G // P))
    # network lines of §2
    add("step_reduce", "inter", gbytes * (M / G) * Fraction(O // G - 1, O // G))
    add("step_gather", "inter", wbytes * (M / G) * Fraction(O // G - 1, O // G))
    # step 7: all-reduce of the 1/O shard across R replicas
    add("step_reduce", "replica", 2 * gbytes * (M / O) * Fraction(R - 1, R))
    traffic = {c: sum(phase[ph][c] for ph in PHASES) for c in CLASSES}
    return {"memory_bytes": mem, "traffic_bytes": traffic, "traffic_by_phase": phase,
            "link_classes": cls}


def run_plan(argv, capsys):
    rc = plan.main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, f"plan {' '.join(argv)} exited {rc}: {err}"
    assert err == "", f"unexpected stderr: {err}"
    return json.loads(out)


def compare(got, want, rel, what):
    """Every memory state, link class and phase within `rel`; report all differences."""
    bad = []
    for key in ("memory_bytes", "traffic_bytes"):
        for name, w in want[key].items():
            g = got[key][name]
            if not math.isclose(g, float(w), rel_tol=rel, abs_tol=1e-9):
                bad.append(f"{key}[{name}]: plan {g} vs design {float(w):.6g} "
                           f"(rel {abs(g - float(w)) / max(abs(float(w)), 1):.2e})")
    for ph in PHASES:
        for c in CLASSES:
            g, w = got["traffic_by_phase"][ph][c], float(want["traffic_by_phase"][ph][c])
            if not math.isclose(g, w, rel_tol=rel, abs_tol=1e-9):
                bad.append(f"traffic_by_phase[{ph}][{c}]: plan {g} vs design {w:.6g}")
    assert not bad, f"{what}: " + "; ".join(bad)


# --------------------------------------------------------------------------- presets vs design

CASES = [
    # (preset, S override, W, M, gpus_per_node, k)
    ("lbp", None, 384, 20e9, 8, 1),
    ("lbp", 2, 384, 20e9, 8, 4),
    ("lbp", 8, 384, 20e9, 8, 1),
    ("zero3", None, 384, 20e9, 8, 1),
    ("zeropp", None, 384, 20e9, 8, 2),
    ("zero2", None, 384, 20e9, 8, 1),
    ("hsdp", None, 384, 20e9, 8, 1),
    ("lbp", None, 16, 1.3e9, 8, 3),
    ("lbp", 8, 16, 1.3e9, 8, 1),
    ("zero3", None, 16, 1.3e9, 8, 1),
    ("zeropp", None, 16, 1.3e9, 8, 1),
    ("zero2", None, 16, 1.3e9, 8, 2),
    ("hsdp", None, 16, 1.3e9, 8, 1),
    ("lbp", None, 8, 7e8, 4, 1),
    ("lbp", 2, 8, 7e8, 4, 2),
    ("lbp", 4, 8, 7e8, 4, 1),
    ("zero3", None, 8, 7e8, 4, 1),
    ("zeropp", None, 8, 7e8, 4, 1),
    ("zero2", None, 8, 7e8, 4, 1),
    ("hsdp", None, 8, 7e8, 4, 1),
]


def _argv(preset, S, W, M, gpn, k, extra=()):
    argv = ["--world-size", str(W), "--params", repr(M), "--preset", preset,
            "--gpus-per-node", str(gpn), "--micro-batches", str(k), "--json", *extra]
    return argv + (["--hier-secondary-group-size", str(S)] if S is not None else [])


@pytest.mark.parametrize("preset,S,W,M,gpn,k", CASES,
                         ids=[f"{c[0]}-S{c[1]}-W{c[2]}-M{c[3]:g}-n{c[4]}-k{c[5]}" for c in CASES])
def test_plan_matches_design_formulas(preset, S, W, M, gpn, k, capsys):
    got = run_plan(_argv(preset, S, W, M, gpn, k), capsys)
    P, S_, G, O = PRESET_SIZES[preset](W, gpn, 2, S or 0)
    assert got["group_sizes"] == {"param": P, "grad": G, "optim": O, "secondary": S_,
                                  "replicas": W // O}, f"{preset}: resolved group sizes differ"
    assert got["params"] == int(M)
    unit = math.lcm(O * 128, S_ * 128 if S_ else 1)
    assert got["padded_params"] == -(-int(M) // unit) * unit, "padding is not the layout rule"

    zpp = preset == "zeropp"  # §3: zeropp = zero3 + hpZ + qwZ + qgZ
    assert got["quantize_weight_gather"] is zpp
    assert got["quantize_grad_reduce"] == (["grad"] if zpp and W > gpn else [])
    want_padded = design(got["padded_params"], W, P, S_, G, O, gpn=gpn, k=k, zeropp=zpp)
    compare(got, want_padded, 1e-6, f"{preset} W={W} at the padded size")
    # Against the unpadded model size: within the padding fraction.
    slack = (got["padded_params"] - got["params"]) / got["params"] + 1e-6
    compare(got, design(M, W, P, S_, G, O, gpn=gpn, k=k, zeropp=zpp), slack,
            f"{preset} W={W} unpadded")

    cls = {f: c for f, c in want_padded["link_classes"].items() if f in got["link_classes"]}
    assert got["link_classes"] == cls, f"link classes: plan {got['link_classes']} vs {cls}"


@pytest.mark.parametrize("preset,S,W,gpn", [("lbp", 8, 16, 8), ("lbp", 0, 16, 8),
                                            ("zero3", None, 16, 8), ("zeropp", None, 16, 8),
                                            ("zero2", None, 16, 8), ("hsdp", None, 16, 4),
                                            ("lbp", 2, 8, 4)])
def test_exact_when_no_padding(preset, S, W, gpn, capsys):
    M = 2048 * 4096 * 3  # a multiple of lcm(O*128, S*128) and of S*256 for all cases here
    got = run_plan(_argv(preset, S, W, M, gpn, 2), capsys)
    assert got["padded_params"] == got["params"] == M
    P, S_, G, O = PRESET_SIZES[preset](W, gpn, 2, S or 0)
    want = design(M, W, P, S_, G, O, gpn=gpn, k=2, zeropp=preset == "zeropp")
    for key in ("memory_bytes", "traffic_bytes"):
        for name, w in want[key].items():
            assert w.denominator == 1 and got[key][name] == int(w), \
                f"{preset} {key}[{name}]: plan {got[key][name]} != design {w}"
            assert isinstance(got[key][name], int)
    for ph in PHASES:
        assert got["traffic_by_phase"][ph] == {c: int(v) for c, v in
                                               want["traffic_by_phase"][ph].items()}, ph


def test_dtypes_follow_the_design(capsys):
    M = 2048 * 1000
    got = run_plan(["--world-size", "16", "--params", str(M), "--params-dtype", "fp32",
                    "--grad-dtype", "bf16", "--hier-secondary-group-size", "8",
                    "--hier-secondary-dtype", "bf16", "--json"], capsys)
    want = design(M, 16, 2, 8, 8, 16, wbytes=4, gbytes=2, sdt="bf16")
    compare(got, want, 1e-12, "fp32 weights, bf16 grads, bf16 secondary")
    assert got["memory_bytes"]["optimizer"] == 8 * M // 16


# --------------------------------------------------------------------------- acceptance command


ACCEPTANCE = ["--world-size", "384", "--params", "20e9", "--preset", "lbp",
              "--hier-secondary-group-size", "8", "--json"]


def test_acceptance_command_as_subprocess():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "megatron_lbp.plan", *ACCEPTANCE],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr}"
    assert proc.stderr == ""
    assert len(proc.stdout.strip().splitlines()) == 1, "--json must print ONE JSON object"
    got = json.loads(proc.stdout)
    for key in ("world_size", "group_sizes", "preset", "memory_bytes", "traffic_bytes",
                "traffic_by_phase", "params", "padded_params", "groups", "link_classes"):
        assert key in got, f"JSON lacks {key!r}"
    assert got["world_size"] == 384 and got["preset"] == "lbp"
    assert got["group_sizes"] == {"param": 2, "grad": 8, "optim": 384, "secondary": 8,
                                  "replicas": 1}
    mem = got["memory_bytes"]
    pad = 3e-6  # 20e9 pads to 20,000,047,104 (unit 384*128)
    expect_mem = {"primary": 20e9, "secondary": 2.5e9 + 4 * 2.5e9 / 256, "grad": 10e9,
                  "optimizer": 0.625e9}
    for state, w in expect_mem.items():
        assert math.isclose(mem[state], w, rel_tol=pad), f"memory {state}: {mem[state]} vs {w}"
    assert mem["total"] == sum(mem[s] for s in expect_mem)
    # Built bucket by bucket (the engine's 40M-element buckets): the optimizer slices outweigh
    # one bucket's fp32 gradient buffer, so the peak is the steady state, up to the padding
    # of 500 buckets instead of one (0.02%).
    assert math.isclose(got["construction_peak_bytes"], mem["total"], rel_tol=1e-3), (
        got["construction_peak_bytes"], mem["total"])
    # §2: network 4(M/G)(O/G-1)/(O/G) + 2(M/G)(O/G-1)/(O/G) with M/G = 2.5e9, O/G = 48.
    net = 6 * 2.5e9 * 47 / 48
    assert math.isclose(got["traffic_bytes"]["network"], net, rel_tol=pad), \
        f"network bytes {got['traffic_bytes']['network']} vs design {net}"
    pkg = 2 * 20e9 / 2
    node = 7 * (2.5e9 + 4 * 2.5e9 / 256) + 4 * 20e9 * 7 / 8 + 2 * 10e9 * 3 / 4
    assert math.isclose(got["traffic_bytes"]["package"], pkg, rel_tol=pad)
    assert math.isclose(got["traffic_bytes"]["node"], node, rel_tol=pad), \
        f"node bytes {got['traffic_bytes']['node']} vs design {node}"
    assert got["link_classes"] == {"param": "package", "secondary": "node", "grad": "node",
                                   "optim": "network", "inter": "network",
                                   "grad_to_param": "node", "replica": None}
    assert got["groups"]["param"] == [0, 1]
    assert got["groups"]["inter"] == list(range(0, 384, 8))


def test_acceptance_human_output(capsys):
    assert plan.main(ACCEPTANCE[:-1]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    for needle in ("P=2", "S=8 (int8)", "G=8", "O=384", "R=1", "20,000,000,000 parameters",
                   "padded to 20,000,047,104", "primary", "secondary", "optimizer", "total",
                   "construction peak",
                   "forward_gather", "network"):
        assert needle in out, f"human output lacks {needle!r}:\n{out}"


# --------------------------------------------------------------------------- link classes


def test_link_classes_zero3_w16_all_network(capsys):
    got = run_plan(["--world-size", "16", "--params", "1e9", "--preset", "zero3", "--json"],
                   capsys)
    lc = got["link_classes"]
    assert lc["param"] == lc["grad"] == lc["optim"] == "network", lc
    assert got["traffic_bytes"]["package"] == got["traffic_bytes"]["node"] == 0
    assert got["traffic_bytes"]["network"] > 0


def test_link_classes_lbp_w16(capsys):
    got = run_plan(["--world-size", "16", "--params", "1e9", "--preset", "lbp", "--json"],
                   capsys)
    lc = got["link_classes"]
    assert (lc["param"], lc["grad"], lc["inter"], lc["grad_to_param"]) == \
        ("package", "node", "network", "node"), lc
    assert got["group_sizes"]["param"] == 2 and got["group_sizes"]["grad"] == 8
    by_phase = got["traffic_by_phase"]
    assert by_phase["forward_gather"]["network"] == by_phase["grad_reduce"]["network"] == 0
    assert by_phase["step_reduce"]["network"] > 0


def test_link_classes_hsdp_replica_network(capsys):
    got = run_plan(["--world-size", "32", "--params", "1e9", "--preset", "hsdp", "--json"],
                   capsys)
    assert got["link_classes"]["replica"] == "network"
    assert got["link_classes"]["param"] == "node"
    assert got["group_sizes"]["replicas"] == 4
    assert got["traffic_by_phase"]["step_reduce"]["network"] > 0


# --------------------------------------------------------------------------- other inputs


def test_model_shape_and_units(capsys):
    shape = ["--num-layers", "4", "--hidden-size", "256", "--vocab-size", "1024"]
    got = run_plan(["--world-size", "8", *shape, "--bucket-size", "300000", "--json"], capsys)
    h, L, V = 256, 4, 1024
    assert got["params"] == L * (12 * h * h + 13 * h) + 2 * h + V * h
    # A GPT shape is cut as the engine cuts a GPT: one unit per layer, whatever the bucket size.
    assert got["buckets"] == L + 2, got["buckets"]
    assert got["units"] == {"embedding": 1, "layer": L, "output": 1, "other": 0}, got["units"]
    assert got["largest_unit"] == 12 * h * h + 13 * h
    by_params = run_plan(["--world-size", "8", "--params", str(got["params"]),
                          "--bucket-size", "300000", "--json"], capsys)
    assert by_params["buckets"] == -(-got["params"] // 300000)
    assert by_params["units"]["other"] == by_params["buckets"]
    got2 = run_plan(["--world-size", "8", *shape, "--seq-length", "128",
                     "--position-embedding-type", "learned_absolute", "--json"], capsys)
    assert got2["params"] == got["params"] + 128 * h


def test_prefetch_depth_costs_whole_units_of_transient_memory(capsys):
    shape = ["--world-size", "16", "--num-layers", "8", "--hidden-size", "512",
             "--vocab-size", "2048", "--json"]
    plans = {d: run_plan(shape + ["--hier-prefetch-units", str(d)], capsys) for d in (0, 1, 3)}
    assert run_plan(shape, capsys)["prefetch_units"] == 1, "the default depth is FSDP2's 1"
    layer = 12 * 512 * 512 + 13 * 512
    unit_bytes = 2 * -(-layer // (16 * 128)) * (16 * 128)   # bf16, padded to O*128
    for d, got in plans.items():
        t = got["transient_bytes"]
        assert got["prefetch_units"] == d and t["unit_gather"] == unit_bytes, (d, t)
        assert t["prefetch"] == d * unit_bytes
        assert t["peak"] == max(t["forward"], t["backward"], t["step"])
    for d in (1, 3):
        grew = {part: plans[d]["transient_bytes"][part] - plans[0]["transient_bytes"][part]
                for part in ("forward", "backward")}
        # The forward's peak has its window full: d more whole units. The backward's
        # moves to where the window and the reductions in flight hold most, which need
        # not be where d more units fit (near the end there is less left to prefetch).
        assert grew["forward"] == d * unit_bytes, (d, grew)
        assert 0 < grew["backward"] <= d * unit_bytes, (d, grew)
    off = run_plan(shape + ["--no-hier-overlap", "--hier-prefetch-units", "3"], capsys)
    assert off["prefetch_units"] == 0, "without overlap nothing is prefetched"


def test_both_spellings_agreeing_are_accepted(capsys):
    got = run_plan(["--world-size", "8", "--params", "1e9", "--gpus-per-node", "4",
                    "--hier-gpus-per-node", "4", "--hier-preset", "lbp", "--preset", "lbp",
                    "--json"], capsys)
    assert got["gpus_per_node"] == 4 and got["group_sizes"]["grad"] == 4


def test_non_colocated_groups_run_with_opt_out_and_warn(capsys):
    got = run_plan(["--world-size", "12", "--gpus-per-node", "4", "--params", "1e8",
                    "--hier-param-group-size", "3", "--hier-grad-group-size", "6",
                    "--hier-allow-non-colocated", "--json"], capsys)
    assert len(got["warnings"]) == 1 and "--hier-param-group-size=3" in got["warnings"][0]
    assert got["link_classes"]["param"] == "network"


def test_help_exits_zero(capsys):
    assert plan.main(["--help"]) == 0
    assert "--hier-grad-group-size" in capsys.readouterr().out


# Bad input to the plan tool: tests/e2e/test_bad_input_matrix.py (every entry point's table).


def test_grad_reduce_dtype_is_one_setting_with_two_spellings(capsys):
    shape = ["--world-size", "16", "--num-layers", "4", "--hidden-size", "256",
             "--vocab-size", "1024", "--json"]
    fp32 = run_plan(shape, capsys)
    long = run_plan(shape + ["--hier-grad-reduce-dtype", "bf16"], capsys)
    short = run_plan(shape + ["--grad-dtype", "bf16"], capsys)
    assert long == short, "--hier-grad-reduce-dtype and --grad-dtype plan the same step"
    assert long["grad_dtype"] == "bf16" and 2 * long["memory_bytes"]["grad"] == \
        fp32["memory_bytes"]["grad"], (long["memory_bytes"], fp32["memory_bytes"])
    assert long["transient_bytes"]["backward"] < fp32["transient_bytes"]["backward"]
    assert plan.main(shape + ["--grad-dtype", "bf16", "--hier-grad-reduce-dtype", "fp32"]) == 2
    assert "disagree" in capsys.readouterr().err
