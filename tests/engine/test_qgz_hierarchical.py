"""ZeRO++'s two-hop int4 qgZ by value, against an fp32 reduce-scatter of the same gradients.

8 gloo ranks as 2 emulated nodes of 4: S-groups (the node, "secondary") {0..3}
and {4..7}, cross groups ("grad_cross") {r, r+4}. Every rank feeds
engine.quantized.reduce_scatter_hierarchical 8 chunks of 1000 elements (blocks
of 256, the last one partial) whose magnitudes differ by block, chunk and rank;
rank r must end with chunk r summed over all 8 ranks. Each rank's result must:

1. lie within the int4 bound of the exact (float64) sum: half a step
   (block amax / 7 / 2) for each of the 3 in-node peers' chunks quantized in
   hop 1, plus half a step of the other node's partial sum quantized in hop 2
   (its block amax bounded by the exact partial's plus hop 1's error), plus fp32
   rounding of the additions;
2. agree with torch.distributed's fp32 reduce-scatter of the same input (through
   the engine's Collectives) within that bound plus the fp32 sum's rounding, and
   not equal it exactly (int4 moved the values: nothing quantized would pass 1);
3. be charged as int4: (S-1)*X = 6 chunks of q4(1000) = 500 + 4*4 bytes on the
   node link and X-1 = 1 on the network.

The bound is computed here in float64 from every rank's input; it shares no
routing code with the engine. The test of the test swaps the ranks' S-group
positions (chunks summed for the wrong rank) and expects the bound to catch it.

On the engine's streams (both hops issued at once, hop 1 on the secondary reduce
stream, hop 2 on the grad_cross one after hop 1's partial sum) the result is the
host path's bit for bit, and with hop 1's stream held back by a task submitted
before it, the gradient sent and the result are refused to a free
(``streams.check_free``) until the result has been waited for.
"""
import pytest

from megatron_lbp.testing.multirank import run_on_ranks

WORLD, S, X, CHUNK, BLOCK = 8, 4, 2, 1000, 256
G = S * X


def rank_input(rank: int):
    """G chunks of CHUNK fp32 values; block magnitudes from 1e-3 to 1e2 differing per rank and chunk."""
    import torch

    g = torch.Generator().manual_seed(2000 + rank)
    x = torch.randn(G * CHUNK, generator=g)
    block = torch.arange(x.numel()) // BLOCK
    chunk = torch.arange(x.numel()) // CHUNK
    exponent = (block * 7 + chunk * 3 + rank * 5) % 6 - 3
    return x * torch.pow(10.0, exponent.float())


def half_steps(values):
    """Per element, half an int4 step of its block (values: float64 block amax source)."""
    import torch

    n = values.numel()
    out = torch.empty(n, dtype=torch.float64)
    for lo in range(0, n, BLOCK):
        out[lo:lo + BLOCK] = values[lo:lo + BLOCK].abs().max() / 7 / 2 * (1 + 1e-5)
    return out


def bound_of(rank: int):
    """(exact sum of chunk ``rank`` over every rank, allowed gap per element), float64."""
    import torch

    def chunk(r, j):
        return rank_input(r)[j * CHUNK:(j + 1) * CHUNK].double()

    x, s = divmod(rank, S)
    exact = sum(chunk(r, rank) for r in range(WORLD))
    allowed = torch.zeros(CHUNK, dtype=torch.float64)
    for node in range(X):
        partial = sum(chunk(node * S + t, rank) for t in range(S))
        hop1 = sum(half_steps(chunk(node * S + t, rank)) for t in range(S) if t != s)
        allowed += hop1
        if node != x:   # the other node's partial sum crosses the network quantized
            allowed += half_steps(partial.abs() + hop1)
    magnitude = sum(chunk(r, rank).abs() for r in range(WORLD))
    return exact, allowed + magnitude * 2 * G * 2.0 ** -24


def hierarchical_on_ranks(cases):
    import torch
    import torch.distributed as dist

    from megatron_lbp.engine.comm import Collectives
    from megatron_lbp.engine.memory import TransientLedger
    from megatron_lbp.engine.quantized import reduce_scatter_hierarchical
    from megatron_lbp.engine.streams import BufferInFlight, CpuEvent, check_free

    nodes = [list(range(n * S, (n + 1) * S)) for n in range(X)]
    crosses = [[p + n * S for n in range(X)] for p in range(S)]
    node_groups = [dist.new_group(m) for m in nodes]       # every rank creates all, same order
    cross_groups = [dist.new_group(m) for m in crosses]
    world = dist.new_group(list(range(WORLD)))
    me = dist.get_rank()
    x, s = divmod(me, S)
    groups = {"secondary": {"reduce": node_groups[x]}, "grad_cross": {"reduce": cross_groups[s]},
              "grad": {"reduce": world}}
    sizes = {"secondary": S, "grad_cross": X, "grad": WORLD}
    links = {"secondary": "node", "grad_cross": "network", "grad": "network"}
    inp = rank_input(me)
    reference = torch.empty(CHUNK)
    Collectives(groups=groups, sizes=sizes, links=links).reduce_scatter(
        reference, inp.clone(), "grad", "grad_reduce")
    exact, allowed = bound_of(me)
    out = {}
    host_result = None
    for case in cases:
        comm = Collectives(groups=groups, sizes=sizes, links=links)
        result = torch.empty(CHUNK)
        ledger = TransientLedger()
        s_index = (s + 1) % S if case == "positions_swapped" else s
        problems = []
        sent = inp.clone()
        if case in ("streams", "held"):
            hops = (comm.stream("secondary", "reduce"), comm.stream("grad_cross", "reduce"))
            gate = CpuEvent()
            if case == "held":
                hops[0].submit(lambda: None, waits=[gate], what="a task before hop 1")
            else:
                gate.set()
            pending = reduce_scatter_hierarchical(comm, result, sent, s_index, x, BLOCK,
                                                  "grad_reduce", ledger, streams=hops)
            for buf, what in ((sent, "the gradient sent"), (result, "the result")):
                try:
                    check_free(buf, what)
                    if case == "held":
                        problems.append(f"{what} free to reuse while hop 1 had not run")
                except BufferInFlight:
                    pass
            gate.set()
            pending.wait()
            for buf, what in ((sent, "the gradient sent"), (result, "the result")):
                try:
                    check_free(buf, what)
                except BufferInFlight as e:
                    problems.append(f"after the wait: {e}")
            if host_result is not None and not torch.equal(result, host_result):
                problems.append("on the streams the result differs from the host path's")
        else:
            reduce_scatter_hierarchical(comm, result, sent, s_index, x, BLOCK, "grad_reduce",
                                        ledger, async_op=True).wait()
            if case == "ok":
                host_result = result.clone()
        got = result.double()
        over = ~((got - exact).abs() <= allowed)
        if over.any():
            i = int(over.nonzero()[0])
            problems.append(f"outside the int4 bound of the exact sum at {int(over.sum())} of "
                            f"{CHUNK} elements, first at {i}: |{got[i].item():.6g} - "
                            f"{exact[i].item():.6g}| > {allowed[i].item():.3g}")
        fp32 = reference.double()
        far = ~((got - fp32).abs() <= allowed + fp32.abs() * G * 2.0 ** -24)
        if far.any():
            i = int(far.nonzero()[0])
            problems.append(f"differs from the fp32 reduce-scatter at {int(far.sum())} elements, "
                            f"first at {i}: {got[i].item():.6g} vs {fp32[i].item():.6g}")
        if torch.equal(result, reference):
            problems.append("equal to the fp32 reduce-scatter: nothing was quantized")
        q4 = CHUNK // 2 + 4 * -(-CHUNK // BLOCK)
        sent = comm.ledger.by_phase()["grad_reduce"]
        want = {"node": (S - 1) * X * q4, "network": (X - 1) * q4}
        if {k: sent[k] for k in want} != want:
            problems.append(f"ledger charged {sent}, int4 sends {want}")
        if ledger.current != 0:
            problems.append(f"{ledger.current} transient bytes left allocated")
        out[case] = problems
    return out


@pytest.fixture(scope="module")
def per_rank():
    return run_on_ranks(hierarchical_on_ranks, WORLD, ("ok", "positions_swapped", "streams",
                                                       "held"))


def test_two_hop_int4_reduce_is_the_fp32_reduce_scatter_within_the_int4_bound(per_rank):
    problems = [f"rank {r}: {p}" for r, res in enumerate(per_rank) for p in res["ok"]]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("case", ["streams", "held"])
def test_on_streams_the_two_hops_give_the_same_result_and_hold_their_buffers(per_rank, case):
    problems = [f"rank {r}: {p}" for r, res in enumerate(per_rank) for p in res[case]]
    assert not problems, "\n".join(problems)


def test_wrong_routing_is_caught(per_rank):
    """Test of the test: each rank sums the chunks of its S-group neighbour's position."""
    caught = [any(p.startswith("outside the int4 bound") for p in res["positions_swapped"])
              for res in per_rank]
    assert all(caught), f"ranks whose check passed a wrong routing: " \
                        f"{[r for r, c in enumerate(caught) if not c]}"
