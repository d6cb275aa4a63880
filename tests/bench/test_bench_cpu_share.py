"""bench/cpu_share: other processes' CPU time told from this process tree's, on real processes."""
import subprocess
import sys
import time

import pytest

from benchmarks import cpu_share
from megatron_lbp.testing.multirank import forkserver_context

# Spins for an amount of CPU time, not of wall time: on a busy machine a wall-time spin gets
# only its share of the cores, and the assertions below would measure the machine's load.
BUSY = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\n"


def _spin(seconds: float) -> None:
    exec(BUSY.format(s=seconds))


def _share_while(run_busy) -> dict:
    """others_between around ``run_busy()``, which returns once every busy process has ended."""
    before = cpu_share.snapshot()
    run_busy()
    return cpu_share.others_between(before, cpu_share.snapshot(), cpus=1)


def _ended(pid: int) -> bool:
    """Gone, or a zombie: under a subreaper (python -m megatron_lbp.testing.cpu_time) an orphan
    stays one until the subreaper's command ends, but it has used all the CPU it will."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not _ended(pid):
        assert time.monotonic() < deadline, f"the busy process {pid} still runs after {timeout} s"
        time.sleep(0.05)


pytestmark = pytest.mark.skipif(cpu_share.snapshot() is None, reason="needs Linux /proc")


def test_a_process_outside_the_tree_is_counted_as_others():
    # sh starts python in the background and exits: the busy process is no descendant of ours.
    code = BUSY.format(s=1.4)

    def run():
        out = subprocess.run(["sh", "-c", f"{sys.executable} -c '{code}' >/dev/null 2>&1 & echo $!"],
                             check=True, capture_output=True, text=True)
        _wait_gone(int(out.stdout))

    share = _share_while(run)
    # Whatever else the machine runs only adds to others_cpu_s.
    assert share["others_cpu_s"] > 1.2, (
        f"a process outside this tree spun 1.4 CPU-s, but others_cpu_s is "
        f"{share['others_cpu_s']:.2f} (own {share['own_cpu_s']:.2f})")


@pytest.mark.slow
def test_forkserver_ranks_and_reaped_children_count_as_the_runs_own():
    # Ranks come from a forkserver, which reaps them itself (megatron_lbp.testing.multirank).
    # The harness's own context: a bare mp.get_context("forkserver") started first would
    # start the process's one server without the preload, and every later rank cold.
    ctx = forkserver_context()

    def run():
        proc = ctx.Process(target=_spin, args=(1.4,))
        proc.start()
        subprocess.run([sys.executable, "-c", BUSY.format(s=0.5)], check=True)  # reaped by us
        proc.join()

    share = _share_while(run)
    # Only the run's own share is asserted: others_cpu_s is whatever the rest of the machine
    # did meanwhile (a test must not need an idle machine), and without the descendant walk
    # the 1.9 CPU-s spun here would land there and own_cpu_s would stay near 0.
    assert share["own_cpu_s"] > 1.6, (
        f"the run's own processes used only {share['own_cpu_s']:.2f} CPU-s of the 1.9 its "
        f"forkserver rank and reaped child spun (others {share['others_cpu_s']:.2f})")


def test_warning_only_above_the_share_and_says_how_much():
    quiet = {"others_cpu_s": 1.0, "own_cpu_s": 100.0, "wall_s": 100.0, "cpus": 2,
             "others_share": 0.005}
    assert cpu_share.warning(quiet) is None and cpu_share.warning(None) is None
    busy = dict(quiet, others_cpu_s=60.0, others_share=0.30)
    text = cpu_share.warning(busy)
    assert "30% of the 2 CPUs" in text and "60 CPU-s in 100 s" in text
    assert cpu_share.clause(busy) == "; other processes used 30% of the 2 CPUs during the run"
    assert cpu_share.clause(None) == ""
    assert cpu_share.others_between(None, cpu_share.snapshot(), 2) is None
    result = {}
    cpu_share.record(result, cpu_share.snapshot(), 2)
    # An instant's share is whatever ticked meanwhile: the warning follows it, either way.
    assert result["other_cpu"]["cpus"] == 2, result
    assert result.get("load_warning") == cpu_share.warning(result["other_cpu"]), result
