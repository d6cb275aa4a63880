"""Plain torch, no Megatron: gloo's coalesced collectives overlapping one another break.

Each iteration issues an asynchronous coalesced all-gather (three buckets), then a
coalesced reduce-scatter while the gather is still in flight, then waits for the
gather: the pattern of Megatron-FSDP's prefetching parameter gathers beside its
gradient reduce-scatters. With ``--sequential`` the gather is waited for before
the reduce-scatter is issued. Run it as

    torchrun --nproc-per-node 2 tests/helpers/gloo_coalesced_repro.py 3000 [--sequential]

Runs of 3000 iterations on a 2-core machine, two side by side: overlapping, 2 of
18 runs ended in "malloc(): unaligned tcache chunk detected" (SIGABRT) or hung;
with ``--sequential``, 10 of 10 finished (a rare fault: few runs prove little
alone; the Megatron-FSDP counts in megatron_lbp/integration/compat.py part 4 are the
larger sample). megatron_lbp.integration.compat.megatron_fsdp_on_gloo keeps
the benchmarks' Megatron-FSDP on the sequential pattern.
"""
import sys

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager


def main(iterations: int, sequential: bool) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)  # same sizes on every rank
    for it in range(iterations):
        sizes = [int(torch.randint(1, 3000, (1,), generator=gen)) * world for _ in range(3)]
        gathered = [torch.empty(s) for s in sizes]
        with _coalescing_manager(None, async_ops=True) as gather:
            for out in gathered:
                n = out.numel() // world
                dist.all_gather_into_tensor(out, out[rank * n:(rank + 1) * n].clone())
        if sequential:
            gather.wait()
        grads = [torch.randn(s) for s in sizes]
        shards = [torch.empty(s // world) for s in sizes]
        with _coalescing_manager(None):
            for grad, shard in zip(grads, shards):
                dist.reduce_scatter_tensor(shard, grad)
        gather.wait()
        if rank == 0 and it % 500 == 0:
            print(f"iteration {it}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), "--sequential" in sys.argv[2:])
