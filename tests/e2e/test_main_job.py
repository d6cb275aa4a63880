"""The README's main job, end to end: data, lbp and stock Megatron training, preset bytes, summary, PNG.

CI runs the whole job at a reduced size (4 ranks = 2 emulated nodes of one
package each, a few iterations, fp32 so the loss comparison has one
expectation on every CPU); the default-size job is the slow case.
"""
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lbp.integration import cpu_bf16
from megatron_lbp.demo import cli as demo

REPO = Path(__file__).resolve().parents[2]


def run_demo(tmp_path, *args, data_dir=None, timeout=1500):
    out = subprocess.run(
        [sys.executable, "-m", "megatron_lbp.demo", *args, "--out", str(tmp_path / "runs"),
         "--data-dir", str(data_dir or tmp_path / "data")],
        capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run_dir,) = list((tmp_path / "runs").iterdir())
    return out.stdout, run_dir, json.loads((run_dir / "summary.json").read_text())


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


# Uniform guessing over the 4096-token vocabulary is ln(4096) = 8.32.
FULL_LOSS = 6.0
# fp32 on both sides, same data and seed: only the order of the gradient sums
# differs (lbp reduces in the node, then across nodes), so the losses agree to
# rounding (4e-6 over 20 iterations). In bf16 a last-bit difference of an fp32
# master weight can round its bf16 copy the other way, and the runs drift
# apart by up to 5e-2 (0.9%) over the 100 iterations of the default job.
FP32_LOSS_AGREEMENT = 1e-3
BF16_LOSS_AGREEMENT = 0.1


def check_run(stdout, run_dir, summary, iters, log_interval, *, loss_below=None, agreement=None):
    assert summary["loss_start"] > 8.0, summary["loss_start"]
    assert summary["loss_end"] < summary["loss_start"] - 0.3, (
        f"loss {summary['loss_start']:.3f} -> {summary['loss_end']:.3f} did not fall")
    if loss_below is not None:
        assert summary["loss_end"] < loss_below, (summary["loss_end"], loss_below)
    # Both runs logged every iteration, and the summary's largest difference is
    # what their curves give.
    lbp, stock = dict(map(tuple, summary["loss_curve"])), dict(map(tuple, summary["stock_loss_curve"]))
    assert sorted(lbp) == sorted(stock) == list(range(1, iters + 1)), (sorted(lbp), sorted(stock))
    worst = max(lbp, key=lambda i: abs(lbp[i] - stock[i]))
    d = summary["max_loss_difference_vs_stock"]
    assert d["iteration"] == worst and d["value"] == pytest.approx(abs(lbp[worst] - stock[worst]))
    assert d["iterations_compared"] == iters
    if agreement is not None:
        assert d["value"] < agreement, f"lbp and stock losses differ by {d['value']:.3e}: {d}"
    assert "largest loss difference lbp vs stock" in stdout

    # Bytes per link class: the lbp row is the lbp run's own report; zero3 sends the most
    # over the network (ZeRO++, with its int8 gathers and int4 gradients, may send less
    # than lbp: on this 2-node run it does).
    by = summary["bytes_sent_per_rank_per_step_by_scheme"]
    assert set(by) == {"lbp", "zero3", "zeropp"}
    assert by["lbp"] == summary["bytes_sent_per_rank_per_step"]
    assert 0 < by["lbp"]["network"] < by["zero3"]["network"], by
    assert 0 < by["zeropp"]["network"] < by["zero3"]["network"], by
    assert by["zero3"]["package"] == by["zero3"]["node"] == 0, by["zero3"]
    assert summary["bytes_held_per_rank"]["primary"] > 0 and summary["tokens_per_second"] > 0

    width, height = png_size(run_dir / "loss_curve.png")
    assert width >= 1000 and height >= 450, (width, height)
    assert (run_dir / "loss_curve.png").stat().st_size > 30_000
    assert (run_dir / "checkpoint" / "latest_checkpointed_iteration.txt").exists()
    for name in ("lbp", "stock"):
        assert (run_dir / name / "train.log").exists(), name
    for part in ("data", "lbp", "stock", "preset_bytes", "summary_and_plot", "total"):
        assert summary["timings_s"][part] >= 0, (part, summary["timings_s"])
    # One progress line per logging interval, with the ETA.
    progress = [ln for ln in stdout.splitlines() if ln.startswith("[main 1/2] lbp (hierarchy)")
                and "ETA" in ln]
    # Megatron logs iteration 1, then every interval.
    assert len(progress) == 1 + iters // log_interval, stdout
    assert "s/iteration" in progress[-1] and f"iteration {iters:>4}/{iters}" in progress[-1]
    assert any(ln.startswith("[main 2/2] stock Megatron distopt") for ln in stdout.splitlines())


@pytest.mark.slow
def test_main_job_reduced(tmp_path, demo_dataset):
    """On the session's demo data (conftest.demo_dataset, built by the same build_demo_data
    the job calls): the job finds it current and reuses it, as on its second run in a clone;
    the slow full-size job below builds its own."""
    iters = 6
    stdout, run_dir, summary = run_demo(
        tmp_path, "--ranks", "4", "--gpus-per-node", "2", "--iters", str(iters),
        "--log-interval", "3", "--fp32", data_dir=Path(demo_dataset).parent)
    assert summary["dtype"] == "fp32" and "[main] computing in fp32 (--fp32)" in stdout
    check_run(stdout, run_dir, summary, iters, 3, agreement=FP32_LOSS_AGREEMENT)


@pytest.mark.slow
def test_main_job_full(tmp_path):
    stdout, run_dir, summary = run_demo(tmp_path)
    iters = demo.DEFAULT_ITERS
    agreement = FP32_LOSS_AGREEMENT if summary["dtype"] == "fp32" else BF16_LOSS_AGREEMENT
    check_run(stdout, run_dir, summary, iters, 10, loss_below=FULL_LOSS, agreement=agreement)


# --- the dtype choice -------------------------------------------------------------------

X86_AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\nprocessor\t: 1\n"
X86_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize("text, flags", [(X86_AVX2, []), (X86_BF16, ["avx512_bf16"]),
                                         (ARM_BF16, ["bf16"]), ("", [])])
def test_bf16_flags(text, flags):
    assert cpu_bf16.bf16_flags(text) == flags


def test_native_bf16_reads_the_file(tmp_path):
    (tmp_path / "cpuinfo").write_text(X86_AVX2)
    native, why = cpu_bf16.native_bf16(tmp_path / "cpuinfo")
    assert not native and "emulated" in why
    (tmp_path / "cpuinfo").write_text(X86_BF16)
    assert cpu_bf16.native_bf16(tmp_path / "cpuinfo") == (
        True, "CPU flags avx512_bf16 present: native bf16")
    native, why = cpu_bf16.native_bf16(tmp_path / "missing")
    assert not native and "unknown" in why


@pytest.mark.parametrize("bf16, fp32, native, want, words", [
    (False, False, (False, "no bf16 flags"), False, "computing in fp32: no bf16 flags; --bf16 forces"),
    (False, False, (True, "flags present"), True, "computing in bf16: flags present"),
    (True, False, (False, "no bf16 flags"), True, "because --bf16 was given, but no bf16 flags"),
    (False, True, (True, "flags present"), False, "computing in fp32 (--fp32)"),
])
def test_choose_dtype(bf16, fp32, native, want, words):
    got, line = demo.choose_dtype(bf16, fp32, native)
    assert got == want and words in line and "\n" not in line, line


@pytest.mark.parametrize("argv, words", [
    (["--ranks", "4", "--gpus-per-node", "4"], "at least 2 nodes"),
    (["--ranks", "8", "--gpus-per-node", "3"], "must be even"),
    (["--iters", "0"], "--iters=0 must be >= 1"),
    (["--bf16", "--fp32"], "not allowed with argument"),
])
def test_demo_rejects_bad_arguments(argv, words):
    out = subprocess.run([sys.executable, "-m", "megatron_lbp.demo", *argv], capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    assert out.returncode == 2 and words in out.stderr, out.stderr


def test_progress_line_and_eta():
    import io

    from megatron_lbp.demo.runs import Progress, RunResult, RunSpec

    plan = [RunSpec("lbp", "lbp (hierarchy)", 100, ()), RunSpec("stock", "stock", 50, ())]
    p = Progress(plan, io.StringIO())
    p.launch_s = 20.0
    first = p.line(0, {"iteration": 1, "ms": 3000.0, "loss": 8.31}, 100)
    assert "iteration    1/100 | loss 8.3100 | 3.000 s/iteration | ETA 4:57 this run, ? job" in first
    # 90 more lbp iterations at 0.5 s, the stock launch (20 s + 50 x 0.5 s), the bytes step (20 s).
    line = p.line(0, {"iteration": 10, "ms": 500.0, "loss": 7.3}, 100)
    assert line.endswith("ETA 0:45 this run, ~1:50 job"), line
    # After a launch, its cost beyond the iterations is what the next estimate uses.
    p.finished(RunResult(plan[0], None, wall_s=100.0, rows=[{"ms": 500.0}]))
    assert p.launch_s == pytest.approx(50.0)
