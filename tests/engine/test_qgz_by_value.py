"""qgZ by value: the engine's quantized reduce-scatter sums the right chunks, within the int8 bound.

8 gloo ranks in two interleaved groups of 4 ({0,2,4,6} and {1,3,5,7}, as the
cross-node "inter" groups of an lbp hierarchy with G=2 interleave), so a
rank's index in its group is not its global rank. Every rank feeds
engine.quantized.reduce_scatter_quantized 4 chunks of 1000 elements (blocks of
256, the last one partial) whose magnitudes differ by block, by chunk and by
rank, through a real Collectives object. Each rank's result must be:

1. the sum, over its group in group order, of chunk ``my_index`` of every
   member's input, the peers' chunks int8-quantized and dequantized, its own
   chunk as it is (never quantized: it never leaves the rank), up to fp32
   rounding of the four additions;
2. within the quantization bound of the exact sum of the unquantized chunks:
   half a quantization step (block amax / 127 / 2, plus fp32 rounding) per
   peer chunk, the blockwise bound of megatron_lbp.quant.blockwise;
3. charged on the ledger as 3 int8 chunks with their scales.

The reference quantizes with megatron_lbp.quant.blockwise (the torch reference,
exactly tested in test_quant.py) and sums in float64; it shares no routing or
summation code with the engine. A test of the test runs the same checks
against deliberately broken reductions (injected here only): the own chunk
dropped, the own chunk quantized, chunks routed to the wrong peer, the wrong
group index, and the plain fp32 reduce-scatter (nothing quantized).
"""
import pytest

from megatron_lbp.testing.multirank import run_on_ranks

WORLD, N, CHUNK, BLOCK = 8, 4, 1000, 256
FAULTS = ("own_chunk_dropped", "own_chunk_quantized", "chunks_permuted", "wrong_group_index",
          "not_quantized")


def rank_input(rank: int):
    """N chunks of CHUNK fp32 values; block magnitudes from 1e-3 to 1e2 differing per rank and chunk."""
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(N * CHUNK, generator=g)
    per_block = torch.arange(x.numel()) // BLOCK
    chunk = torch.arange(x.numel()) // CHUNK
    exponent = (per_block * 7 + chunk * 3 + rank * 5) % 6 - 3   # 10^-3 .. 10^2
    x = x * torch.pow(10.0, exponent.float())
    x[CHUNK + 5:CHUNK + 5 + BLOCK] = 0.0    # an all-zero stretch (scale 0 blocks on a block grid)
    return x


def _groups():
    import torch.distributed as dist

    members = [tuple(range(s, WORLD, 2)) for s in (0, 1)]
    handles = [dist.new_group(list(m)) for m in members]   # every rank creates both, same order
    me = dist.get_rank()
    g = next(i for i, m in enumerate(members) if me in m)
    return members[g], handles[g]


def expected(members, index):
    """(dequantized sum, exact sum, allowed gap) of chunk ``index`` over ``members``, in float64."""
    import torch

    from megatron_lbp.quant import blockwise

    lo, hi = index * CHUNK, (index + 1) * CHUNK
    dequantized = torch.zeros(CHUNK, dtype=torch.float64)
    exact = torch.zeros(CHUNK, dtype=torch.float64)
    magnitude = torch.zeros(CHUNK, dtype=torch.float64)
    bound = torch.zeros(CHUNK, dtype=torch.float64)
    for pos, peer in enumerate(members):
        chunk = rank_input(peer)[lo:hi]
        exact += chunk.double()
        if pos == index:
            term = chunk
        else:
            q, scale = blockwise.quantize(chunk, BLOCK)
            term = blockwise.dequantize(q, scale, BLOCK)
            step = scale.double().repeat_interleave(BLOCK)[:CHUNK]
            bound += step * (0.5 + 2.0 ** -18) + term.double().abs() * 2.0 ** -24
        dequantized += term.double()
        magnitude += term.double().abs()
    # fp32 accumulation of N terms: at most N roundings of a partial sum <= magnitude.
    rounding = magnitude * N * 2.0 ** -24
    return dequantized, exact, bound + rounding, rounding


def check_qgz(out, members, index, ledger_bytes):
    """Lines naming what the reduce-scatter result got wrong on this rank; empty when right."""
    from megatron_lbp.quant import quantized_nbytes

    dequantized, exact, allowed, rounding = expected(members, index)
    got = out.double()
    problems = []
    off = ~((got - dequantized).abs() <= rounding)     # NaN counts as off
    if off.any():
        i = int(off.nonzero()[0])
        problems.append(
            f"not the sum of the dequantized peer chunks plus the own chunk: {int(off.sum())} of "
            f"{CHUNK} elements differ, first at {i}: {got[i].item():.9g} vs {dequantized[i].item():.9g}")
    over = ~((got - exact).abs() <= allowed)
    if over.any():
        i = int(over.nonzero()[0])
        problems.append(
            f"outside the quantization bound of the exact sum at {int(over.sum())} elements, first "
            f"at {i}: |{got[i].item():.9g} - {exact[i].item():.9g}| > {allowed[i].item():.3g}")
    want_bytes = (N - 1) * quantized_nbytes(CHUNK, BLOCK)   # 3 * (1000 codes + 4 scales * 4 B)
    assert want_bytes == 3 * 1016
    if ledger_bytes != want_bytes:
        problems.append(f"ledger charged {ledger_bytes} bytes, {want_bytes} were sent")
    return problems


def qgz_on_ranks(cases):
    """Each case ("ok" or a fault name): one quantized reduce-scatter and this rank's check_qgz lines."""
    import torch
    import torch.distributed as dist

    from megatron_lbp.engine.comm import Collectives
    from megatron_lbp.engine.memory import TransientLedger
    from megatron_lbp.engine.quantized import reduce_scatter_quantized
    from megatron_lbp.quant import blockwise

    members, group = _groups()
    index = members.index(dist.get_rank())
    out = {}
    for case in cases:
        comm = Collectives(groups={"inter": {"gather": group, "reduce": group}},
                           sizes={"inter": N}, links={"inter": "network"})
        inp = rank_input(dist.get_rank())
        result = torch.empty(CHUNK)
        my_index = (index + 1) % N if case == "wrong_group_index" else index
        if case == "chunks_permuted":
            send_all = comm.all_to_all

            def rotated(o, i, *a, _send=send_all, **k):
                return _send(o, i.view(N, -1).roll(1, dims=0).reshape(-1), *a, **k)

            comm.all_to_all = rotated
        if case == "not_quantized":   # the plain fp32 reduce-scatter, as without qgZ
            pending = comm.reduce_scatter(result, inp, "inter", "step_reduce", async_op=True)
        else:
            pending = reduce_scatter_quantized(comm, result, inp, my_index, BLOCK, "inter",
                                               "step_reduce", TransientLedger(), async_op=True)
        own = inp[index * CHUNK:(index + 1) * CHUNK]
        if case == "own_chunk_dropped":
            own.zero_()          # the own chunk is read when the result lands
        elif case == "own_chunk_quantized":
            q, scale = blockwise.quantize(own.clone(), BLOCK)
            own.copy_(blockwise.dequantize(q, scale, BLOCK))
        pending.wait()
        out[case] = check_qgz(result, members, index,
                              comm.ledger.by_phase()["step_reduce"]["network"])
    return out


@pytest.fixture(scope="module")
def per_rank():
    return run_on_ranks(qgz_on_ranks, WORLD, ("ok",) + FAULTS)


def test_quantized_reduce_scatter_sums_the_right_chunks_within_the_int8_bound(per_rank):
    problems = [f"rank {r}: {p}" for r, res in enumerate(per_rank) for p in res["ok"]]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("fault", FAULTS)
def test_a_broken_quantized_reduce_scatter_fails_the_check(per_rank, fault):
    """Test of the test: each injected fault is caught on every rank, by the dequantized-sum check."""
    for r, res in enumerate(per_rank):
        assert any(p.startswith("not the sum of the dequantized") for p in res[fault]), (
            f"{fault}: rank {r}'s check passed: {res[fault]}")
    if fault not in ("own_chunk_quantized", "not_quantized"):   # inside the bound by construction
        assert any(p.startswith("outside the quantization bound") for res in per_rank
                   for p in res[fault]), f"{fault}: no rank out of bound"
