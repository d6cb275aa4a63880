"""Blockwise int4 (megatron_lbp.quant.int4), the payload of ZeRO++'s qgZ: packing and bounds.

Checked against values written out here, not against the module's own helpers:
two codes per byte, low nibble first, each stored as code + 8; one fp32 scale
amax/7 per block; every element within half a step (amax/14) of its input; an
all-zero block exact; a block holding NaN/Inf dequantized to NaN everywhere.
"""
import pytest
import torch

from megatron_lbp.core import costs
from megatron_lbp.quant.int4 import (dequantize_int4_from, int4_nbytes, int4_views,
                                     pack_int4, quantize_int4_into, unpack_int4)


def test_pack_puts_the_first_code_in_the_low_nibble_biased_by_8():
    packed = pack_int4(torch.tensor([-7, 7, 0, -8, 3], dtype=torch.int8))
    # (-7+8) | (7+8)<<4 = 1 | 0xF0; (0+8) | (-8+8)<<4 = 8; (3+8) | (0+8)<<4 (odd count: code 0)
    assert packed.tolist() == [0xF1, 0x08, 0x8B], packed.tolist()


@pytest.mark.parametrize("n", [1, 2, 15, 16, 257])
def test_unpack_inverts_pack_for_every_code(n):
    codes = (torch.arange(n) % 16 - 8).to(torch.int8)
    got = unpack_int4(pack_int4(codes), n)
    assert torch.equal(got, codes), (got.tolist(), codes.tolist())


@pytest.mark.parametrize("n,block", [(1000, 256), (512, 64), (7, 256), (256, 256)])
def test_nbytes_are_half_a_byte_per_element_plus_a_scale_per_block(n, block):
    blocks = -(-n // block)
    assert int4_nbytes(n, block) == (n + 1) // 2 + 4 * blocks
    assert costs.int4_payload_bytes(n, block) == int4_nbytes(n, block)


def roundtrip(x, block):
    buf = torch.empty(int4_nbytes(x.numel(), block), dtype=torch.uint8)
    quantize_int4_into(x, buf, block)
    out = torch.empty(x.numel(), dtype=torch.float32)
    dequantize_int4_from(buf, out, block)
    return buf, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_element_within_half_a_step_of_its_block(dtype):
    block, n = 64, 1000
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(n, generator=g) * torch.logspace(-3, 2, n)).to(dtype)
    buf, out = roundtrip(x, block)
    _, scale = int4_views(buf, n, block)
    xf = x.float()
    for b in range(-(-n // block)):
        lo, hi = b * block, min(n, (b + 1) * block)
        amax = xf[lo:hi].abs().max()
        assert scale[b].item() == pytest.approx((amax / 7).item(), rel=1e-6), b
        gap = (out[lo:hi] - xf[lo:hi]).abs().max().item()
        assert gap <= (amax / 14).item() * (1 + 1e-5), (
            f"block {b}: error {gap:.4g} above half a step {(amax / 14).item():.4g}")
    # the grid is coarse: the error is not zero (a quantizer that copied would pass the bound)
    assert (out - xf).abs().max() > 0


def test_an_all_zero_block_is_exact_and_a_non_finite_block_is_poisoned():
    x = torch.randn(3 * 64)
    x[64:128] = 0.0
    x[130] = float("inf")
    _, out = roundtrip(x, 64)
    assert torch.equal(out[64:128], torch.zeros(64))
    assert torch.isnan(out[128:]).all(), "an Inf must poison its whole block"
    assert torch.isfinite(out[:64]).all()


def test_a_buffer_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="int4 buffer must be 1-D uint8"):
        quantize_int4_into(torch.zeros(100), torch.empty(10, dtype=torch.uint8), 64)
