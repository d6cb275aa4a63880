"""Module-level functions that the multi-rank tests run on their ranks (ranks import them by name)."""
import os
import time

import torch
import torch.distributed as dist


def rank_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), os.environ.get("LBP_TEST_TAG")


def fail_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    # The others wait for data the failed rank never sends: a real hang. (Not a barrier: the
    # harness's exit barrier on the failed rank would match it and let them finish.)
    dist.recv(torch.zeros(1), src=bad_rank)
    return dist.get_rank()


def hang_forever_in_sleep():
    while True:
        time.sleep(0.1)


def exit_hard_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        os._exit(3)
    dist.barrier()
    return dist.get_rank()


def abort_in_native_code_on_rank(bad_rank: int):
    """A C++-style abort (SIGABRT), as a failed assertion or terminate() in a library does."""
    if dist.get_rank() == bad_rank:
        os.abort()
    dist.barrier()


def started_warm():
    """Whether this rank's forkserver had megatron imported before the rank began (nothing in
    this module or the harness imports it)."""
    import sys

    return "megatron.training.training" in sys.modules
