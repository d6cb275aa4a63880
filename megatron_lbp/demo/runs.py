"""The main job's training runs: their commands, one launch with a progress line, their logs.

Every run is ``torchrun -m megatron_lbp.pretrain_gpt`` (megatron.training's
``pretrain()``) of the same GPT on the same data and seed; only the data-parallel
scheme differs: the lbp hierarchy, stock Megatron's distributed optimizer, or
another engine preset. Megatron's full output goes to the run's ``train.log``;
the terminal gets one progress line per logging interval (iteration, loss,
seconds per iteration, ETA of this run and of the whole job).
"""
from __future__ import annotations

import os
import re
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL = {"num-layers": 2, "hidden-size": 128, "num-attention-heads": 4, "seq-length": 128,
         "max-position-embeddings": 128}
MICRO_BATCH = 2
SAMPLES_PER_RANK = 4          # global batch = 4 x ranks: 2 micro-batches of 2 per rank
ITERATION_LINE = re.compile(
    r"iteration\s+(\d+)/\s*(\d+) \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|"
    r".*?lm loss: ([\dE+\-.]+) \|")
ERROR_WORDS = ("error", "traceback")


@dataclass(frozen=True)
class RunSpec:
    """One training launch of the main job."""

    name: str                  # directory under the job's run directory
    title: str                 # what the progress line calls it
    iters: int
    scheme_args: tuple[str, ...]   # --hier-* flags, or stock Megatron's own
    comm_report: bool = False
    save: bool = False


@dataclass
class RunResult:
    spec: RunSpec
    dir: Path
    wall_s: float = 0.0
    cpu_s: float = 0.0         # user + system CPU of the launch and all its ranks
    startup_s: float = 0.0     # launch to the first iteration line
    rows: list[dict] = field(default_factory=list)   # Megatron's interval lines
    losses: dict[int, float] = field(default_factory=dict)  # every iteration, full precision


def training_command(spec: RunSpec, *, ranks: int, gpus_per_node: int, data_prefix: str,
                     run_dir: Path, bf16: bool, log_interval: int, port: int) -> list[str]:
    # --standalone: torchrun binds its own free port for the rendezvous store; a
    # port picked here and bound later can be taken in between on a busy machine.
    rendezvous = ["--master-port", str(port)] if port else ["--standalone"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           *rendezvous, "-m", "megatron_lbp.pretrain_gpt"]
    for k, v in MODEL.items():
        cmd += [f"--{k}", str(v)]
    cmd += [
        "--micro-batch-size", str(MICRO_BATCH),
        "--global-batch-size", str(SAMPLES_PER_RANK * ranks),
        "--train-iters", str(spec.iters), "--lr", "3e-3", "--min-lr", "3e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", str(max(1, spec.iters // 20)),
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "1234",
        "--position-embedding-type", "rope",
        "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", str(REPO / "tokenizer" / "lbp_bpe.model"),
        "--data-path", data_prefix, "--split", "98,2,0",
        "--log-interval", str(log_interval), "--log-throughput",
        "--eval-iters", "0", "--eval-interval", str(10 * spec.iters),
        *(["--bf16"] if bf16 else []),
        *spec.scheme_args,
    ]
    if spec.scheme_args and spec.scheme_args[0] == "--hier-partition":
        cmd += ["--hier-gpus-per-node", str(gpus_per_node)]
        if spec.comm_report:
            cmd += ["--hier-comm-report", str(run_dir / "comm.jsonl")]
    if spec.save:
        cmd += ["--save", str(run_dir.parent / "checkpoint"), "--save-interval", str(spec.iters),
                "--ckpt-format", "torch_dist"]
    return cmd


def children_cpu_s() -> float:
    """CPU seconds of every finished child process (torchrun counts its ranks in its own)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def parse_log(text: str) -> list[dict]:
    return [{"iteration": int(m.group(1)), "ms": float(m.group(3)), "loss": float(m.group(4))}
            for m in ITERATION_LINE.finditer(text)]


def read_loss_log(path: Path) -> dict[int, float]:
    """{iteration: lm loss} from LBP_LOSS_LOG (training_hooks._record_losses)."""
    out: dict[int, float] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        iteration, key, value = line.split("\t")
        if key == "lm loss":
            out[int(iteration)] = float(value)
    return out


def _clock(seconds: float) -> str:
    s = max(0, int(round(seconds)))
    return f"{s // 60}:{s % 60:02d}"


class Progress:
    """Prints one line per logging interval; estimates the rest of the job from what it saw.

    Runs not started yet are estimated with the cost of a launch beyond its
    iterations (start-up, checkpoint, exit: from the last finished launch, at
    first from the start-up alone) and the seconds per iteration seen last (the
    schemes' step times are within ~30% of each other on this model), so the
    job ETA is a guess until the last run.
    """

    def __init__(self, plan: list[RunSpec], out=sys.stdout):
        self.plan = plan
        self.out = out
        self.launch_s: float | None = None   # a launch's cost beyond its iterations
        self.s_per_iter: float | None = None

    def remaining_after(self, index: int) -> float:
        """The launches after ``index``, then the bytes step (taken as one more start-up)."""
        if self.launch_s is None or self.s_per_iter is None:
            return float("nan")
        return sum(self.launch_s + s.iters * self.s_per_iter
                   for s in self.plan[index + 1:]) + self.launch_s

    def finished(self, result: "RunResult") -> None:
        """A launch's start-up and teardown (checkpoint, exit): its wall time less its iterations."""
        iters = [r["ms"] / 1000.0 for r in result.rows]
        if iters:
            self.launch_s = max(0.0, result.wall_s - result.spec.iters * statistics.mean(iters))

    def line(self, index: int, row: dict, total: int) -> str:
        spec = self.plan[index]
        s_it = row["ms"] / 1000.0
        # Megatron logs iteration 1 on its own; its time holds the first gathers and
        # allocations, so the job's estimate waits for a full interval.
        first = row["iteration"] == 1
        if not first or self.s_per_iter is None:
            self.s_per_iter = s_it
        run_eta = (total - row["iteration"]) * s_it
        job = "?" if first and index == 0 else f"~{_clock(run_eta + self.remaining_after(index))}"
        return (f"[main {index + 1}/{len(self.plan)}] {spec.title:<24} iteration "
                f"{row['iteration']:>4}/{total} | loss {row['loss']:.4f} | {s_it:.3f} s/iteration "
                f"| ETA {_clock(run_eta)} this run, {job} job")

    def show(self, text: str) -> None:
        print(text, file=self.out, flush=True)


def launch(index: int, spec: RunSpec, cmd: list[str], run_dir: Path, progress: Progress,
           env_extra: dict[str, str] | None = None) -> tuple[int, RunResult]:
    """Run one training command; (exit code, what it produced). Errors are echoed as they come."""
    run_dir.mkdir(parents=True, exist_ok=True)
    result = RunResult(spec, run_dir)
    loss_log = run_dir / "losses.tsv"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               LBP_LOSS_LOG=str(loss_log), **(env_extra or {}))
    (run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
    t0, cpu0 = time.perf_counter(), children_cpu_s()
    with open(run_dir / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=REPO)
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            row = parse_log(line)
            if row:
                if not result.rows:
                    result.startup_s = time.perf_counter() - t0 - row[0]["ms"] / 1000.0
                    if progress.launch_s is None:
                        progress.launch_s = result.startup_s
                result.rows.append(row[0])
                m = ITERATION_LINE.search(line)
                progress.show(progress.line(index, row[0], int(m.group(2))))
            elif any(w in line.lower() for w in ERROR_WORDS) and "error_injection" not in line \
                    and "logits_load" not in line and " ...." not in line:
                progress.show(line.rstrip())
        code = proc.wait()
    result.wall_s = time.perf_counter() - t0
    result.cpu_s = children_cpu_s() - cpu0
    result.losses = read_loss_log(loss_log)
    progress.finished(result)
    return code, result
