"""python -m megatron_lbp.launch job STAGE --state DIR: the launch environment resolved into a job.

The shell launchers keep what only a shell can do (#SBATCH, modules, srun, the
chain's sbatch); every rule of a launch is Python's, once (rules.py, :func:`plan_job`,
commands.py). Stages ``resolve``, ``exit-time``, ``commands``, ``implied-secondary``
each read the environment and ``DIR/job.json``; the shell reads back ``DIR/job.env``
and NUL-separated word lists.
Exit status: 0; 2 bad input; 3 does not fit in GCD memory; 4 the job cannot run it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from megatron_lbp.launch import commands as cmds
from megatron_lbp.launch import site
from megatron_lbp.launch._cli import PROG, write_resolved
from megatron_lbp.launch.rules import (Refusal, SETTINGS, check_deepspeed, check_hierarchy,
                                       check_paths, estimate_as, is_ds,
                                       parse_launcher_args, resolve_nodes, retention, settings,
                                       sbatch_directive, start_from, implied_secondary, uint)

REPO = Path(__file__).resolve().parents[2]


class Stop(Exception):
    """A stage ends with ``status`` after its own message (a command it ran said why)."""

    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


@dataclass
class Screen:
    """What a stage says, shown once it ends (refused or not): a dry run's summary first, by
    construction, then every line in the order the stage made it."""
    lines: list[str] = field(default_factory=list)
    summary: list[str] | None = None   # a dry run's, from the estimate on

    def log(self, text: str) -> None:
        self.lines.append(f"[lbp] {text}")

    def lead(self, text: str) -> None:
        """A line the dry run's summary repeats (the exit time, what a job would refuse)."""
        self.log(text)
        if self.summary is not None:
            self.summary.append(f"  {text}")

    def show(self) -> None:
        lines = [f"[lbp] {line}" for line in self.summary or []] + self.lines
        if lines:
            print("\n".join(lines), flush=True)
        self.lines, self.summary = [], None


def entry(v, exports: list[tuple[str, str]]) -> tuple[list[str], str]:
    """Each task's entry (megatron_lbp, a patched Megatron-LM tree, or the DeepSpeed runner)."""
    py = v["LBP_PYTHON"]
    if is_ds(v):
        r = subprocess.run([sys.executable, "-c",
                            "from megatron_lbp.deepspeed_baseline import environment\n"
                            "environment.prepare()\nimport deepspeed\nprint(deepspeed.__version__)"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            last = ([l for l in r.stderr.splitlines() if l.strip()] or ["no message"])[-1]
            raise Refusal(2, f"HIER_PRESET={v['HIER_PRESET']} needs DeepSpeed, which {py} cannot "
                             f"import ({last}): it is a benchmark dependency, installed by bash "
                             "scripts/install.sh --test (or pip install -r requirements-test.txt)")
        version = r.stdout.strip().splitlines()[-1]
        return ([py, "-u", "-m", "megatron_lbp.deepspeed_baseline.pretrain", "--ds-scheme",
                 v["HIER_PRESET"], "--ds-ranks-per-node", v["TASKS_PER_NODE"]],
                f"python -m megatron_lbp.deepspeed_baseline.pretrain (DeepSpeed {version}, "
                f"{v['HIER_PRESET']}; megatron-core from the Python env)")
    tree = v.get("MEGATRON_LM_DIR")
    if not tree:
        return ([py, "-u", "-m", "megatron_lbp.pretrain_gpt"],
                "python -m megatron_lbp.pretrain_gpt (megatron-core from the Python env)")
    if not os.path.isfile(f"{tree}/pretrain_gpt.py"):
        raise Refusal(2, f"MEGATRON_LM_DIR={tree} has no pretrain_gpt.py: set it to a Megatron-LM "
                         "checkout (core_v0.19.0), or unset it to use python -m "
                         "megatron_lbp.pretrain_gpt")
    check = subprocess.run(["bash", str(REPO / "scripts" / "apply_patches.sh"), "--check", tree],
                           capture_output=True)
    if check.returncode != 0:
        raise Refusal(2, f"MEGATRON_LM_DIR={tree} is not patched for megatron-lbp: run bash "
                         f"{REPO}/scripts/apply_patches.sh {tree} (or unset MEGATRON_LM_DIR to "
                         "use python -m megatron_lbp.pretrain_gpt)")
    path = os.environ.get("PYTHONPATH", "")
    exports.append(("PYTHONPATH", f"{tree}:{path}"))
    return [py, "-u", f"{tree}/pretrain_gpt.py"], f"{tree}/pretrain_gpt.py (patched Megatron-LM tree)"


def check_contents(v, out: Screen) -> None:
    """The tokenizer builds here and the data is a readable indexed dataset that fits it."""
    if v["LBP_CHECK_CONTENTS"] != "1":
        out.log("contents: not checked (LBP_CHECK_CONTENTS=0)")
        return
    from megatron_lbp.launch import contents

    if not uint(v["VOCAB_SIZE_PADDED"]):
        raise Refusal(2, f"VOCAB_SIZE_PADDED={v['VOCAB_SIZE_PADDED']} must be an integer")
    gpt2 = v["TOKENIZER_TYPE"] == "GPT2BPETokenizer"
    model = v["TOKENIZER_TYPE"] not in ("GPT2BPETokenizer", "NullTokenizer")
    mock = v["MOCK_DATA"] == "1"
    try:
        lines = contents.check(v["TOKENIZER_TYPE"], v["VOCAB_FILE"] if gpt2 else None,
                               v["MERGE_FILE"] if gpt2 else None,
                               v["TOKENIZER_MODEL"] if model else None,
                               int(v["VOCAB_SIZE_PADDED"]),
                               [] if mock else v["DATA_PATH"].split(), mock)
    except contents.ContentsError as exc:
        raise Refusal(2, str(exc)) from None
    out.lines += [f"[lbp] {line}" for line in lines]


def plan_job(v, words: list[str], out: Screen) -> dict[str, str]:
    """The one call into the planner: the job typed from the environment (job_env.py), then
    memory per choice, the choice, step time, save interval and checkpoint bytes
    (megatron_lbp.launch.estimate); its lines on ``out`` (a dry run's summary leads)."""
    from megatron_lbp.launch import estimate
    from megatron_lbp.launch.job_env import job_from_env

    try:
        job = job_from_env(v, words, out.log)
    except estimate.EstimateError as exc:
        raise Refusal(2, str(exc)) from None
    try:
        d = estimate.decide(job)
    except (estimate.PlanError, estimate.EstimateError) as exc:
        print(estimate.error_text(job, exc), file=sys.stderr)
        raise Stop(2) from None
    if v["LBP_DRY_RUN"] == "1":
        out.summary = list(d.summary)
        out.lines += [f"[lbp] {line}" for line in (d.lines if job.verbose else [])]
    else:
        out.lines += [f"[lbp] {line}" for line in estimate.shown(d, job.verbose)]
    if d.refusal:
        print(d.refusal, file=sys.stderr)
        raise Stop(3)
    return {k: str(x) for k, x in d.resolved().items()}


def exit_time(v, env: Mapping[str, str], out: Screen) -> None:
    """--exit-duration-in-mins from the job's remaining wall time (a dry run: LBP_WALLTIME or
    the script's #SBATCH -t), and when that was measured (Megatron's clock starts there)."""
    from megatron_lbp.launch import walltime

    v["LBP_EXIT_MEASURED_AT"] = str(int(time.time()))
    if v["LBP_EXIT_AUTO"] != "1":
        if not uint(v["EXIT_DURATION_MINS"]):
            raise Refusal(2, f"EXIT_DURATION_MINS={v['EXIT_DURATION_MINS']}: use auto, minutes, "
                             "or 0 (off)")
        out.lead(f"exit time: EXIT_DURATION_MINS={v['EXIT_DURATION_MINS']} as given")
        return
    wall = v.get("LBP_WALLTIME") or sbatch_directive(v.get("LBP_PROFILE_SCRIPT", ""), "-t")
    try:   # a dry run plans for the job length (no_job)
        minutes, line = walltime.exit_time(
            float(v["LBP_SAVE_S"]), float(v["LBP_STEP_S"]), float(v["LBP_EXIT_SLACK_S"]),
            float(v["LBP_SIGNAL_S"]), wall or None, v["LBP_DRY_RUN"] == "1", env)
    except walltime.ExitRefusal as exc:
        raise Refusal(exc.status, str(exc)) from None
    out.lead(line)
    v["EXIT_DURATION_MINS"] = str(minutes)


def master_addr(v) -> None:
    if v.get("MASTER_ADDR"):
        return
    # The batch script runs on the allocation's first node; its IP works for real and for
    # emulated (unresolvable) node names alike.
    try:
        out = subprocess.run(["hostname", "-i"], capture_output=True, text=True).stdout.split()
    except OSError:
        out = []
    v["MASTER_ADDR"] = out[0] if out else socket.gethostname()


def capabilities(v, args: list[str]) -> tuple[str, str, str]:
    """(device, the resolved training line, the flags' explanation) as the entry resolves them
    (python -m megatron_lbp.capabilities, for the device the profile runs on: LBP_DEVICE=gpu for
    a GPU profile, so that a login node without GPUs resolves for the compute nodes)."""
    device = v.get("LBP_DEVICE") or ("cpu" if v["LBP_REQUIRE_GPU"] == "none" else "gpu")
    r = subprocess.run([sys.executable, "-m", "megatron_lbp.capabilities", *args],
                       env={**os.environ, "LBP_DEVICE": device}, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stderr.replace("python -m megatron_lbp.capabilities: error: ",
                                          f"{PROG}: error: "))
        raise Stop(2)
    return device, r.stdout.strip(), r.stderr


def deepspeed_config(v, out: Screen) -> None:
    """The DeepSpeed config the runner will use for this job shape (the function it calls)."""
    if not is_ds(v):
        return
    args = ["--scheme", v["HIER_PRESET"], "--micro-batch-size", v["MICRO_BATCH_SIZE"],
            "--global-batch-size", v["GLOBAL_BATCH_SIZE"], "--world-size", v["WORLD"],
            "--ranks-per-node", v["TASKS_PER_NODE"], "--clip-grad", v["CLIP_GRAD"]]
    if v["PRECISION"] == "bf16":
        args.append("--bf16")
    r = subprocess.run([sys.executable, "-m", "megatron_lbp.deepspeed_baseline.schemes", *args],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stderr)
        raise Refusal(2, "no DeepSpeed config for this job shape (above)")
    out.log(f"DeepSpeed config ({v['HIER_PRESET']}, {v['WORLD']} ranks, {v['TASKS_PER_NODE']} per "
        f"node; python -m megatron_lbp.deepspeed_baseline.schemes {cmds.quote(args)}):")
    out.lines += [f"[lbp]   {line}" for line in r.stdout.splitlines()]
    preset, secondary, _ = estimate_as(v)
    out.log(f"checkpoints: none (the DeepSpeed runner runs TRAIN_ITERS={v['TRAIN_ITERS']} iterations "
        f"and saves nothing); memory and step time above are estimated as the engine's {preset} "
        f"(S={secondary}), the nearest scheme the cost model has")


def _write_words(path: Path, words: list[str]) -> None:
    path.write_bytes(b"".join(w.encode() + b"\0" for w in words))


def _save(state: Path, v: dict) -> None:
    (state / "job.json").write_text(json.dumps(v))
    keys = ("NNODES_RESOLVED", "WORLD", "CHECKPOINT_DIR", "DATA_CACHE_PATH", "TENSORBOARD_DIR",
            "TRAIN_ITERS", "LBP_KEEP_LAST", "LBP_MILESTONE_EVERY", "LBP_PRUNE_EVERY_S",
            "LBP_RETAIN_BY", "LBP_CKPT_BYTES", "LBP_CHAIN", "LBP_DRY_RUN", "LBP_REQUIRE_GPU",
            "TASKS_PER_NODE", "GPUS_PER_TASK", "LBP_HEALTH_NOTE", "LBP_RUN_DEVICE",
            "LBP_EXIT_MEASURED_AT", "LBP_PROFILE_SCRIPT")
    write_resolved(str(state / "job.env"), {k: v.get(k, "") for k in keys})


def _load(state: Path) -> dict:
    v = json.loads((state / "job.json").read_text())
    v["SITE_EXPORTS"] = [tuple(kv) for kv in v["SITE_EXPORTS"]]
    return v


def _before_modules(path: str | None) -> dict[str, str]:
    if not path:
        return dict(os.environ)
    out = {}
    for item in Path(path).read_bytes().split(b"\0"):
        k, sep, x = item.decode(errors="replace").partition("=")
        if sep:
            out[k] = x
    return out


def resolve(state: Path, argv: list[str], script_arg: str, env0: str | None, out: Screen) -> None:
    env = dict(os.environ)
    v = {k: x for k, x in env.items()}
    pre = {"LBP_DRY_RUN": env.get("LBP_DRY_RUN", ""), "LBP_CHAIN": env.get("LBP_CHAIN", "")}
    cli_extra, args0 = parse_launcher_args(argv, pre)
    v.update({k: x for k, x in pre.items() if x})
    v = settings(v)
    words_extra = v.get("EXTRA_ARGS", "").split() + cli_extra
    check_deepspeed(v, words_extra)
    start_flags = start_from(v, out.log)
    if v.get("LBP_SETTINGS_OUT"):   # scripts/launch/lbp_study.sh reads the profile's values
        write_resolved(v["LBP_SETTINGS_OUT"], {k: v.get(k, "") for k in SETTINGS})
        return
    resolve_nodes(v, env, script_arg)
    check_hierarchy(v)
    check_paths(v)
    if v["LBP_DRY_RUN"] != "1":
        if not env.get("SLURM_JOB_ID"):
            raise Refusal(2, f"not inside a Slurm allocation: submit with sbatch {script_arg} (or "
                             "run with --dry-run / LBP_DRY_RUN=1 to see the commands)")
        if shutil.which("srun") is None:
            raise Refusal(2, "srun not found in PATH")
    exports: list[tuple[str, str]] = []
    entry_words, v["ENTRY_DESC"] = entry(v, exports)
    check_contents(v, out)
    v.update(plan_job(v, start_flags + words_extra, out))
    check_hierarchy(v)
    retention(v, out.log)
    master_addr(v)
    site_exports, v["SITE_USER"] = site.exports(
        site.defaults(v["LBP_SITE"], int(v["NNODES_RESOLVED"]), v["CPUS_PER_TASK"],
                      v.get("RCCL_NET_PLUGIN_DIR", "")), _before_modules(env0))
    v["SITE_EXPORTS"] = site_exports
    exports = site_exports + exports + [("MASTER_ADDR", v["MASTER_ADDR"]),
                                        ("MASTER_PORT", v["MASTER_PORT"])]
    health, v["LBP_HEALTH_NOTE"] = cmds.health_words(v)
    build_check = ([] if v["LBP_REQUIRE_GPU"] == "none" else
                   ["health", "--build-only", "--require-gpu", v["LBP_REQUIRE_GPU"],
                    "--devices-per-node", str(int(v["TASKS_PER_NODE"]) * int(v["GPUS_PER_TASK"]))])
    v.update(ENTRY=entry_words, START_FLAGS=start_flags, CLI_EXTRA=cli_extra)
    for name, words in (("srun", cmds.srun_words(v)), ("health", health), ("build_check", build_check),
                        ("args0", args0), ("exports", [f"{k}={x}" for k, x in exports]),
                        ("task_exports", [f"LBP_TASKS_PER_NODE={v['TASKS_PER_NODE']}",
                                          f"LBP_GCDS_PER_PACKAGE={v['GCDS_PER_PACKAGE']}",
                                          f"LBP_GPUS_PER_TASK={v['GPUS_PER_TASK']}",
                                          f"LBP_PYTHON={v['LBP_PYTHON']}",
                                          f"LBP_NODE_LOCAL_ROOT={v['LBP_NODE_LOCAL_ROOT']}"])):
        _write_words(state / name, words)
    _save(state, v)
    if v["LBP_DRY_RUN"] == "1":
        dry_run(state, v, env, out)


def commands(state: Path, v: dict, out: Screen) -> None:
    args = cmds.train_args(v, v["START_FLAGS"], v["CLI_EXTRA"])
    device, line, notes = capabilities(v, args)
    v["LBP_RUN_DEVICE"] = device
    srun = (state / "srun").read_bytes().decode().split("\0")[:-1]
    out.lines += cmds.command_lines(v, srun, v["ENTRY"], args, device, line, notes)
    deepspeed_config(v, out)
    _write_words(state / "train", v["ENTRY"] + args)
    _save(state, v)


def dry_run(state: Path, v: dict, env: Mapping[str, str], out: Screen) -> None:
    from megatron_lbp.launch import checkpoints

    exit_time(v, env, out)
    commands(state, v, out)
    chain = int(v["LBP_CHAIN"])
    if chain > 1:
        out.log(f"chain: --chain {chain}: this job submits the next at its start "
                "(--dependency=afterany:<this job>, the same sbatch options), "
                f"{chain - 1} more; a job stops the chain when training is complete or the "
                "tracker has not moved")
    directory = Path(v["CHECKPOINT_DIR"])
    try:
        out.log(checkpoints.prune_line(argparse.Namespace(
            dir=directory, keep_last=int(v["LBP_KEEP_LAST"]),
            milestone_every=int(v["LBP_MILESTONE_EVERY"]), at_start=False, dry_run=True)))
    except (checkpoints.CheckpointError, OSError) as exc:
        print(f"{PROG}: error: {checkpoints.error_text(directory, exc)}", file=sys.stderr)
        raise Stop(2) from None
    try:
        ok, line = checkpoints.space(directory, int(v["LBP_CKPT_BYTES"]))
    except (checkpoints.CheckpointError, OSError) as exc:
        ok, line = False, checkpoints.error_text(directory, exc)
    if ok:
        out.log(line)
    else:
        out.lead(f"a job would refuse: {line}")
    out.log("dry run: not launching (unset LBP_DRY_RUN / drop --dry-run to run srun)")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["implied-secondary"] and len(argv) == 3:   # PRESET TASKS_PER_NODE
        print(implied_secondary(argv[1], argv[2]))
        return 0
    usage = ("usage: python -m megatron_lbp.launch job {resolve,exit-time,commands} --state DIR "
             "[--script PATH] [--env0 FILE] [-- launcher arguments] | implied-secondary PRESET "
             "TASKS_PER_NODE")
    if not argv or argv[0] not in ("resolve", "exit-time", "commands") or "--state" not in argv:
        print(usage, file=sys.stderr)
        return 2
    stage, rest = argv[0], argv[1:]
    launcher_args = rest[rest.index("--") + 1:] if "--" in rest else []
    opts = rest[:rest.index("--")] if "--" in rest else rest
    opt = dict(zip(opts[::2], opts[1::2]))
    state = Path(opt["--state"])
    out = Screen()
    try:
        try:
            if stage == "resolve":
                resolve(state, launcher_args, opt.get("--script", "<profile>"), opt.get("--env0"),
                        out)
            else:
                v = _load(state)
                if stage == "exit-time":
                    exit_time(v, os.environ, out)
                    _save(state, v)
                else:
                    commands(state, v, out)
        finally:   # what the stage said, before why it stopped
            out.show()
    except Refusal as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.status
    except Stop as exc:
        return exc.status
    return 0

