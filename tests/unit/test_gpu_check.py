"""python -m megatron_lbp.gpu_check: its result on this CPU-only machine, its refusals, and
each part's comparison logic run where CPU can run it (tiny shapes, gloo, the Triton
interpreter), so a device run does not spend its minutes on the logic's bugs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lbp.gpucheck import runner, stack
from megatron_lbp.testing.multirank import run_on_ranks, run_single

REPO = Path(__file__).resolve().parents[2]
PART_KEYS = {"part", "title", "status", "reason", "limit_s", "wall_s", "checks", "figures"}


def _command(*argv, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "megatron_lbp.gpu_check", *argv],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout)


def _check_schema(result: dict, parts: list[str]) -> None:
    assert result["schema"] == runner.SCHEMA
    assert set(result) >= {"command", "started_utc", "device", "stack", "wall_s", "parts", "ok"}
    assert [p["part"] for p in result["parts"]] == parts, result["parts"]
    for p in result["parts"]:
        assert set(p) == PART_KEYS, (p["part"], set(p) ^ PART_KEYS)
        assert p["status"] in runner.STATUSES, p
        for c in p["checks"]:
            assert set(c) == {"name", "ok", "detail"} and isinstance(c["ok"], bool), c


def test_cpu_run_reports_the_gpu_parts_in_one_line_each(tmp_path):
    done = _command("--parts", "A,B,C,E", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "result.json").read_text())
    _check_schema(result, ["A", "B", "C", "E"])
    assert result["device"].startswith("CPU only: "), result["device"]
    for p in result["parts"]:
        assert p["status"] == "needs-gpu" and p["checks"] == [], p
        assert p["reason"].startswith("needs a GPU: ") and "\n" not in p["reason"], p["reason"]
        assert f"[gpu_check] {p['part']} needs-gpu (0.0 s): {p['reason']}" in done.stdout
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith(f"# gpu_check on {result['device']}\n"), summary[:200]
    assert summary.count("needs a GPU: ") == 4, summary


@pytest.mark.parametrize("argv, message", [
    (["--parts", "A,F"], "--parts=A,F: parts are A, B, C, D, E"),
    (["--parts", ","], "--parts=,: parts are A, B, C, D, E"),
    (["--d-layers", "0"], "--d-layers=0: must be >= 1"),
])
def test_bad_arguments_are_one_line_before_any_work(argv, message, tmp_path):
    done = _command(*argv, "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"{runner.PROG}: error: {message}"], done.stderr
    assert not (tmp_path / "out").exists()


def test_require_gpu_refuses_here_with_one_line(tmp_path):
    done = _command("--require-gpu", "--out", str(tmp_path / "out"))
    assert done.returncode == 2, done.stdout
    assert done.stderr.strip() == ("gpu_check: refused: --require-gpu and torch sees no CUDA "
                                   "device; run bash scripts/gpu_setup.sh"), done.stderr
    assert not (tmp_path / "out").exists()


def _info(**over):
    info = {"torch": "2.13.0", "torch_cuda": "12.8", "driver_gpus": ["GPU 0: NVIDIA H100"],
            "cuda_available": True, "megatron_core": stack.MEGATRON_CORE, "triton": "3.7.1",
            "nccl": "2.27.5"}
    return {**info, **over}


@pytest.mark.parametrize("over, require, expected", [
    ({}, True, None),
    (dict(driver_gpus=[], cuda_available=False, torch_cuda=None, triton=None, nccl=None), False,
     None),
    (dict(cuda_available=False, torch_cuda=None), False,
     "the driver lists 1 GPU(s) but torch 2.13.0 (a CPU build) cannot use them"),
    (dict(cuda_available=False), False,
     "the driver lists 1 GPU(s) but torch 2.13.0 (built for CUDA 12.8) cannot use them"),
    (dict(driver_gpus=[], cuda_available=False), True, "--require-gpu and torch sees no CUDA device"),
    (dict(megatron_core="0.14.0"), False, "megatron-core 0.14.0 installed, 0.19.2 needed"),
    (dict(megatron_core=None), False, "megatron-core None installed, 0.19.2 needed"),
    (dict(triton=None), False, "a CUDA device but no triton in this torch install"),
    (dict(triton=None, nccl=None), False,
     "a CUDA device but no triton and no nccl in this torch install"),
])
def test_stack_refusals_are_one_line_naming_what_is_missing(over, require, expected):
    line = stack.refusal(_info(**over), require)
    if expected is None:
        assert line is None, line
    else:
        assert line == f"gpu_check: refused: {expected}; run {stack.SETUP}", line


def test_a_part_that_needs_a_gpu_says_why_and_which_device():
    info = _info(driver_gpus=[], cuda_available=False, torch_cuda=None, triton=None, nccl=None,
                 device="CPU only: AMD EPYC (2 cores), torch 2.13.0")
    lines = {p.key: runner.missing(p, info) for p in runner.PARTS}
    assert lines["D"] is None, lines
    for key in "ABCE":
        assert lines[key] == ("needs a GPU: torch 2.13.0 sees no CUDA device here "
                              "(CPU only: AMD EPYC (2 cores), torch 2.13.0)"), lines[key]
    assert runner.missing(runner.PARTS[0], _info(triton=None)) == \
        "needs triton with the GPU: not in this torch install"


def test_gpu_time_limits_add_up_to_under_eight_minutes():
    total = sum(p.gpu_limit_s * (len(runner.D_VARIANTS) if p.key == "D" else 1)
                for p in runner.PARTS)
    assert total < 8 * 60, total


# ------------------------------------------------------------------ each part's logic on CPU


_PART_A_ON_THE_INTERPRETER = """
import json, torch
from megatron_lbp.gpucheck import part_a
rows = part_a.agreement_cases(torch.device("cpu"), lengths=(1000, 1, 4099), blocks=(64, 256),
                              huge=None)
print(json.dumps(rows))
"""


def test_part_a_comparison_on_the_triton_interpreter():
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _PART_A_ON_THE_INTERPRETER], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    # 3 dtypes x 2 blocks x 3 lengths, and one NaN/Inf case per dtype
    assert len(rows) == 3 * 2 * 3 + 3, len(rows)
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    poisoned = [r for r in rows if r.get("case") == "nan-inf"]
    assert len(poisoned) == 3 and {r["dtype"] for r in poisoned} == {"float32", "bfloat16", "float16"}


def test_part_a_comparison_sees_a_wrong_code(monkeypatch):
    """compare() counts differences: a kernel whose one code is off must not pass."""
    import torch

    from megatron_lbp.gpucheck import part_a
    from megatron_lbp.quant import blockwise, triton_kernels

    def off_by_one(x, block, **kw):
        q, s = blockwise.quantize(x, block, **kw)
        q[7] += 1
        return q, s

    monkeypatch.setattr(triton_kernels, "quantize_triton", off_by_one)
    monkeypatch.setattr(triton_kernels, "dequantize_triton",
                        lambda q, s, b, dtype: blockwise.dequantize(q, s, b, dtype=dtype))
    row = part_a.compare(torch.randn(1000) * 0.02, 64)
    assert row["codes_differ"] == 1 and row["outputs_differ"] == 0 and not row["ok"], row


def _part_b_on_gloo():
    import torch

    from megatron_lbp.gpucheck import part_b

    rows = part_b.handles_behind_gemms(torch.device("cpu"), None)
    return rows, part_b.engine_streams(torch.device("cpu"), None)


def _part_b_codecs_on_cpu():
    import torch

    from megatron_lbp.gpucheck import part_b

    return part_b.codec_rates(torch.device("cpu"), elements=(1024, 4096), gemm_dim=32)


def test_part_b_times_the_codecs_as_the_survey_does():
    """The codec probe of the link survey, at world size 1: every codec and direction timed,
    set beside the step model's HBM assumption; the check names each figure."""
    from megatron_lbp.gpucheck import part_b

    codecs = run_single(_part_b_codecs_on_cpu, timeout=300)
    rows = codecs["rows"]
    assert [(r["codec"], r["direction"]) for r in rows] == [
        ("int8", "encode"), ("int8", "decode"), ("int4", "encode"), ("int4", "decode")], rows
    assert all(r["ns_per_element"] > 0 and r["assumed_ns_per_element"] > 0 for r in rows), rows
    assert codecs["probe"]["elements"] == [1024, 4096]
    (check,) = part_b.judge_codecs(codecs)
    assert check["ok"] and "int4 decode" in check["detail"], check
    assert not part_b.judge_codecs({"rows": rows[:3]})[0]["ok"]


def test_part_b_collectives_and_release_on_gloo():
    rows, engine = run_single(_part_b_on_gloo, timeout=300)
    # The engine's CPU streams: a two-hop chain, the second hop after the first's event.
    assert engine["streams"] == "WorkerStream" and engine["result_right"], engine
    assert engine["second_hop_done_after_sync"], engine
    assert [r["collective"] for r in rows] == ["all_gather", "reduce_scatter", "all_to_all"]
    for r in rows:
        assert r["result_right"], r
    # gloo has no device queue: all-gather's and all-to-all's handles are done once waited.
    # Its reduce_scatter_tensor handle (torch 2.13, one rank) still says False after wait():
    # the engine runs gloo's reduce-scatters as an all-to-all (engine/comm.py).
    done = {r["collective"]: r["is_completed_after_sync"] for r in rows}
    assert done["all_gather"] and done["all_to_all"], done
    checks = {c["name"]: c["ok"] for c in __import__("megatron_lbp.gpucheck.part_b",
                                                     fromlist=["judge"]).judge(rows, None)}
    # What only a device shows: on gloo the handle completes with wait(), so the check that the
    # host runs ahead of the device fails here, as it must.
    assert not checks["all_gather: is_completed() False while queued behind the GEMMs"], checks
    assert checks["all_gather: result right with its input released after wait()"], checks


def _part_c_tiny():
    from megatron_lbp.gpucheck import part_c
    from megatron_lbp.testing.tiny_gpt import TinyGPTSpec

    out = {}
    for recompute in (False, True):
        checks, figures = part_c.compare(TinyGPTSpec(recompute=recompute), steps=3)
        out[recompute] = (checks, figures)
    return out


def test_part_c_engine_against_stock_on_a_tiny_gpt():
    out = run_single(_part_c_tiny, timeout=600)
    for recompute, (checks, figures) in out.items():
        by_name = {c["name"].split(": ", 1)[1]: c for c in checks}
        assert by_name["losses agree with stock megatron-core"]["ok"], checks
        assert by_name["engine's persistent bytes as planned"]["ok"], checks
        assert figures["loss_rel_diff_max"] < 1e-5, figures  # fp32 on CPU: the same maths
        assert figures["engine"]["syncs_per_step"] is None and len(figures["engine"]["losses"]) == 3


def _part_d_tiny():
    import torch

    from megatron_lbp.gpucheck import part_d

    shape = part_d.Shape(num_layers=2, tokens=8, hidden_size=64, num_attention_heads=4,
                         vocab_size=128)
    part_d.fake_world(shape, torch.device("cpu"))
    return part_d.measure(shape, "int8-secondary", torch.device("cpu"))


def test_part_d_builds_384_ranks_over_the_fake_backend_and_matches_the_plan():
    record = run_single(_part_d_tiny, timeout=600, init_process_group=False)
    assert record["group_sizes"] == {"P": 2, "S": 8, "G": 8, "O": 384}, record
    assert record["link_classes"]["optim"] == "network" and \
        record["link_classes"]["grad"] == "node", record["link_classes"]
    assert record["units_match_plan"] and record["ok"], record
    for state, row in record["bytes"].items():
        assert row["measured"] == row["plan"] > 0 or state == "peak_transient", (state, row)
    assert record["bytes"]["peak_transient"]["within_tolerance"], record["bytes"]


def test_part_e_probe_on_gloo_cpu_ranks():
    probes = run_on_ranks(__import__("megatron_lbp.gpucheck.part_e",
                                     fromlist=["probe_collectives"]).probe_collectives, 4, "cpu",
                          timeout=300)
    assert all(p == {"all_gather": "ok", "all_to_all": "ok", "all_reduce": "ok",
                     "broadcast": "ok"} for p in probes), probes


@pytest.mark.slow
def test_cpu_run_measures_the_plan_at_384_ranks_within_five_percent(tmp_path):
    done = _command("--parts", "A,B,C,D,E", "--out", str(tmp_path), timeout=2 * 3600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    _check_schema(result, ["A", "B", "C", "D", "E"])
    d = result["parts"][3]
    assert d["status"] == "pass", d
    assert d["figures"]["layers"] == runner.CPU_LAYERS
    for variant in runner.D_VARIANTS:
        f = d["figures"]["variants"][variant]
        assert f["shape"]["hidden_size"] == 6144 and f["shape"]["world_size"] == 384, f["shape"]
        for state, row in f["bytes"].items():
            assert abs(row["ratio"] - 1) <= 0.05, (variant, state, row)
    assert d["figures"]["variants"]["int8-secondary"]["bytes"]["secondary"]["measured"] > 0


@pytest.mark.parametrize("args, message", [
    ([], "usage: bash scripts/gpu_wheelhouse.sh DIR [PYTHON_VERSION]"),
    (["wheels", "twelve"], "PYTHON_VERSION 'twelve' is not of the form 3.N"),
])
def test_wheelhouse_refuses_bad_arguments_in_one_line(args, message, tmp_path):
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_wheelhouse.sh"), *args],
                          capture_output=True, text=True, cwd=tmp_path, timeout=30)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        done.stderr.strip()] and message in done.stderr, (done.returncode, done.stderr)
    assert not any(tmp_path.iterdir()), "a refused call made files"


def test_gpu_setup_refuses_a_machine_without_a_gpu_before_installing(tmp_path):
    """No nvidia-smi on PATH: one line, and no .venv made (the check comes first)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("bash", "dirname", "python3"):
        (bindir / tool).symlink_to(subprocess.run(["which", tool], capture_output=True,
                                                  text=True).stdout.strip())
    copy = tmp_path / "repo"
    (copy / "scripts").mkdir(parents=True)
    (copy / "scripts" / "gpu_setup.sh").write_text(
        (REPO / "scripts" / "gpu_setup.sh").read_text())
    done = subprocess.run([str(bindir / "bash"), str(copy / "scripts" / "gpu_setup.sh")],
                          capture_output=True, text=True, timeout=30,
                          env={"PATH": str(bindir), "LBP_WHEELHOUSE": str(tmp_path)})
    assert done.returncode == 2 and "nvidia-smi lists no GPU" in done.stderr, done.stderr
    assert not (copy / ".venv").exists()
