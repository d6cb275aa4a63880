"""Rank functions and a launcher for the fault tests (ranks import these by name).

The launcher is not run_on_ranks on purpose: that harness kills every rank a
few seconds after the first one fails, which would hide whether the engine
itself gets the survivors out. Here each rank is a plain process with the
variables a launcher sets (as under Slurm, where a dead task does not take
the others with it) and nobody is killed until the test's deadline.
"""
from __future__ import annotations

import functools
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_lbp.testing.entry import as_entry_process
from megatron_lbp.testing.multirank import (forkserver_context, host_store_in_this_rank,
                                            wait_for_store_port)
from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec, setup_hier

TOPOLOGY_ARGS = ["--hier-preset", "lbp", "--hier-param-group-size", "2",
                 "--hier-grad-group-size", "4", "--hier-optim-group-size", "8"]


@dataclass
class RankRun:
    rank: int
    exitcode: int | None      # None: still running at the deadline (then killed)
    ended_at: float | None    # seconds since launch
    output: str
    said_at: float | None = None  # when its first "[megatron-lbp] rank N" line appeared


def _watch(procs, logs, world, start, deadline_s, poll):
    """Wait until every process ended or the deadline; note when each ended and spoke."""
    ended: dict[int, float] = {}
    said: dict[int, float] = {}
    while len(ended) < world and time.monotonic() - start < deadline_s:
        for r in range(world):
            now = time.monotonic() - start
            if r not in said and os.path.exists(logs[r]):
                with open(logs[r], errors="replace") as f:
                    if f"[megatron-lbp] rank {r}" in f.read():
                        said[r] = now
            if r not in ended and poll(procs[r]) is not None:
                ended[r] = now
        time.sleep(0.05)
    return ended, said


def _child(fn, args, rank, env, log_path, port_box, init_pg=True):
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    os.environ.update(env)
    # As under srun, rank 0's process hosts the rendezvous store (the fault tests kill it).
    if rank == 0:
        host_store_in_this_rank(int(env["WORLD_SIZE"]), port_box)
    else:
        wait_for_store_port(port_box)
    env = {**env, "MASTER_PORT": os.environ["MASTER_PORT"]}
    if not init_pg:   # fn is the training entry: it sets torch.distributed up itself
        fn(*args, environ=env)
        return
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=int(env["WORLD_SIZE"]))
    fn(*args)
    print(f"rank {rank} finished", flush=True)
    dist.destroy_process_group()


def _rank_vars(rank: int, world: int, env, rank_env, **extra: str) -> dict:
    """The torch.distributed variables one rank gets (as srun would set them; MASTER_PORT
    comes from rank 0 once it hosts the store)."""
    rank_vars = {"MASTER_ADDR": "127.0.0.1", "RANK": str(rank),
                 "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                 "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1", **extra}
    rank_vars.update(env or {})
    if rank_env is not None:
        rank_vars.update(rank_env(rank))
    return rank_vars


def launch(fn, args, world: int, tmp_path, *, env=None, rank_env=None,
           deadline_s: float = 120.0, entry: bool = False) -> list[RankRun]:
    """Start ``fn(*args)`` on ``world`` gloo ranks; wait until all ended or the deadline.

    ``entry``: fn is the training entry (megatron_lbp.testing.entry.as_entry_process),
    which gets this process's whole environment plus the rank's variables and
    initializes torch.distributed itself.
    """
    ctx = forkserver_context()
    port_box = ctx.Value("i", 0)
    procs, logs = [], []
    start = time.monotonic()
    for rank in range(world):
        rank_vars = _rank_vars(rank, world, env, rank_env)
        if entry:
            rank_vars = {**os.environ, **rank_vars}
        log = os.path.join(str(tmp_path), f"rank{rank}.log")
        p = ctx.Process(target=_child, args=(fn, args, rank, rank_vars, log, port_box, not entry),
                        daemon=False)
        p.start()
        procs.append(p)
        logs.append(log)
    ended, said = _watch(procs, logs, world, start, deadline_s, lambda p: p.exitcode)
    for p in procs:
        if p.exitcode is None:
            p.kill()
        p.join(timeout=5)
    runs = []
    for r, p in enumerate(procs):
        with open(logs[r], errors="replace") as f:
            out = f.read()
        runs.append(RankRun(r, p.exitcode if r in ended else None, ended.get(r), out, said.get(r)))
    return runs


def launch_pretrain(argv: list[str], world: int, tmp_path, *, env=None, rank_env=None,
                    deadline_s: float = 300.0) -> list[RankRun]:
    """The training entry once per rank, each rank on its own (as srun starts tasks).

    Each rank is forked from the harness's server (megatron_lbp.testing.entry),
    not a fresh interpreter: the same ``megatron_lbp.integration.pretrain_gpt.main``.
    """
    from tests.helpers.pretrain_runner import REPO

    return launch(functools.partial(as_entry_process, cwd=str(REPO)), (argv,), world, tmp_path,
                  env={"PYTHONWARNINGS": "ignore", **(env or {})}, rank_env=rank_env,
                  deadline_s=deadline_s, entry=True)


# --- rank functions -------------------------------------------------------------------------
def train_tiny(steps: int, hier_argv: list[str]) -> None:
    """The tiny GPT through the engine for ``steps`` steps (faults come from LBP_FAULT_INJECT).

    Only the engine communicates here (no loss all-reduce), so every survivor
    meets the failure in one of the engine's collectives.
    """
    from megatron_lbp.testing.tiny_gpt import forward_loss

    spec, train = TinyGPTSpec(), TrainSpec(steps=steps, bucket_size=20000)
    trainer = setup_hier(spec, train, hier_argv)
    for step in range(steps):
        trainer.model.zero_grad_buffer()
        forward_loss(trainer.model, _tokens(spec, train, step, trainer)).backward()
        trainer.model.finish_grad_sync()
        trainer.optimizer.step()


def poisoned_step(poison_rank: int, poison_step: int, steps: int, hier_argv: list[str],
                  fp16: bool, check_nan: bool, value: float = math.inf):
    """Train with ``value`` written into one gradient of ``poison_rank`` at ``poison_step``.

    The poison enters through a real autograd hook on the word embedding, so
    it travels the engine's own path (bucket, reduce-scatter, step). Returns
    what this rank saw per step: (update applied, loss scale, non-finite ranks
    reported), or the error it raised.
    """
    from megatron_lbp.engine.optimizer import NonFiniteGradientError

    spec = TinyGPTSpec(params_dtype=torch.float16 if fp16 else torch.float32)
    train = TrainSpec(steps=steps, bucket_size=20000)
    trainer = setup_hier(spec, train, hier_argv)
    if fp16:
        trainer.optimizer = _fp16_optimizer(trainer, train)
    opt = trainer.optimizer
    opt.check_for_nan_in_grad = check_nan
    state = {"step": 0}
    weight = dict(trainer.inner.named_parameters())
    target = next(p for n, p in weight.items() if n.endswith("word_embeddings.weight"))

    def poison(grad):
        if dist.get_rank() == poison_rank and state["step"] == poison_step:
            grad = grad.clone()
            grad.view(-1)[7] = value
        return grad

    target.register_hook(poison)
    seen = []
    try:
        for step in range(steps):
            state["step"] = step
            trainer.model.zero_grad_buffer()
            tokens = _tokens(spec, train, step, trainer)
            from megatron_lbp.testing.tiny_gpt import forward_loss

            loss = forward_loss(trainer.model, tokens)
            scale = float(opt.get_loss_scale().item())
            (loss * scale).backward()
            trainer.model.finish_grad_sync()
            ok, _, _ = opt.step()
            seen.append({"step": step, "applied": bool(ok), "scale_before": scale,
                         "nonfinite_ranks": list(opt.last_step_report.get("nonfinite_ranks", []))})
    except NonFiniteGradientError as err:
        return {"steps": seen, "error": str(err), "ranks": err.ranks}
    return {"steps": seen, "error": None}


def _fp16_optimizer(trainer, train):
    """The engine's optimizer as megatron.training builds it for --fp16: dynamic loss scaling
    (hysteresis 1, so the first overflow already halves the scale)."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron_lbp.integration import megatron_adapter
    from megatron_lbp.core.config import EngineOptions

    config = OptimizerConfig(optimizer="adam", lr=train.lr, weight_decay=train.weight_decay,
                             clip_grad=train.clip_grad, fp16=True, params_dtype=torch.float16,
                             loss_scale=None, initial_loss_scale=4096.0, min_loss_scale=1.0,
                             loss_scale_window=1000, hysteresis=1,
                             use_distributed_optimizer=True)
    return megatron_adapter.build_optimizer(config, [trainer.model], EngineOptions())


def _tokens(spec, train, step, trainer):
    from megatron_lbp.testing.tiny_gpt import global_batch

    tokens = global_batch(step, 0, spec, train, trainer.dp_size)
    lo = trainer.dp_rank * train.micro_batch_size
    return tokens[lo:lo + train.micro_batch_size]


__all__ = ["RankRun", "launch", "launch_pretrain", "train_tiny", "poisoned_step", "TOPOLOGY_ARGS"]
