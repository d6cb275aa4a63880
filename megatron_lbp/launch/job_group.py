"""A job step's default process group, brought up once per rank as srun started it.

The launcher's rank-side commands (the health check, the link survey) each join the job the
same way: NCCL (RCCL names itself "nccl" too) bound to the task's one visible device, or gloo
on the CPU, with the env:// rendezvous the launcher's environment gives.
"""
from __future__ import annotations


def join_job(rank: int, world: int, use_gpu: bool):
    """Initialise the default process group for ``rank`` of ``world``; the device to use."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
    if use_gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if use_gpu else "gloo", rank=rank, world_size=world,
                            device_id=device if use_gpu else None)
    return device
