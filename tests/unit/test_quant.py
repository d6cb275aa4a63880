"""Tests of megatron_lbp.quant: blockwise int8 quantization (torch and Triton).

The torch implementation is checked against the contract in
megatron_lbp/quant/blockwise.py; the Triton kernels run under Triton's CPU
interpreter in a subprocess (TRITON_INTERPRET must be set before triton is
imported) and must equal torch bit for bit. A second subprocess compiles the
kernels for an NVIDIA and an AMD target without a GPU and checks the division
they use. Everything here takes a few seconds.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

import megatron_lbp.quant as quant
from megatron_lbp.quant import (
    DEFAULT_BLOCK_SIZE,
    KERNEL_ALIGN,
    QuantError,
    check_block_size,
    dequantize,
    find_nonfinite,
    num_blocks,
    packed_views,
    quantize,
    quantized_nbytes,
)

REPO = Path(__file__).resolve().parents[2]
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 2, 63, 64, 65, 255, 256, 257, 1000, 4096 + 3]
BLOCKS = [64, 192, 256, 1024]
# The documented bound: half a step, plus the rounding of the fp32 quotient x/scale
# (<= 2**-18 of a step below 128), plus half an ulp of the fp32 product q*scale.
REL_SLACK = 2.0 ** -18


def _steps(scale: torch.Tensor, block: int, numel: int) -> torch.Tensor:
    return scale.repeat_interleave(block)[:numel]


def _assert_half_step(x: torch.Tensor, q, scale, block: int) -> None:
    d = dequantize(q, scale, block).double()  # checked in fp64: no rounding in the check
    err = (x.double() - d).abs()
    step = _steps(scale, block, x.numel()).double()
    bound = step * (0.5 + REL_SLACK) + d.abs() * 2.0 ** -24
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (
        f"element {worst}: x={x[worst].item()!r} deq={d[worst].item()!r} "
        f"step={step[worst].item()!r}")


def _rand(n: int, dtype, seed: int = 0, std: float = 0.02) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * std).to(dtype)


def _run(code: str, env_extra: dict, timeout: int = 120, argv: list[str] = ()
         ) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **env_extra}
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=timeout)


# ----------------------------------------------------------------- sizes and arguments


def test_defaults_are_consistent():
    assert check_block_size(DEFAULT_BLOCK_SIZE) == DEFAULT_BLOCK_SIZE
    assert KERNEL_ALIGN in (32, 64) and DEFAULT_BLOCK_SIZE % KERNEL_ALIGN == 0


@pytest.mark.parametrize("bad", [0, -64, 63, 100, 64 + 32, 64.0, True, "256", None])
def test_bad_block_size_is_a_one_line_error_naming_block_size(bad):
    for call in (lambda: check_block_size(bad),
                 lambda: quantize(torch.ones(10), bad),
                 lambda: dequantize(torch.zeros(10, dtype=torch.int8), torch.ones(1), bad),
                 lambda: num_blocks(10, bad)):
        with pytest.raises(QuantError, match="block_size") as info:
            call()
        assert "\n" not in str(info.value)
    assert issubclass(QuantError, ValueError)


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1000, 4096])
@pytest.mark.parametrize("block", [64, 192, 256])
def test_quantized_nbytes_is_exactly_the_tensors_bytes(n, block):
    q, s = quantize(_rand(n, torch.float32), block)
    assert num_blocks(n, block) == s.numel() == -(-n // block)
    assert quantized_nbytes(n, block) == q.numel() * q.element_size() + s.numel() * s.element_size()
    assert quantized_nbytes(n, block) == n + 4 * s.numel()


@pytest.mark.parametrize("x,match", [
    (torch.ones(4, 4), "1-D"),
    (torch.ones(20)[::2], "contiguous"),
    (torch.ones(8, dtype=torch.int32), "dtype"),
    ([1.0, 2.0], "torch.Tensor"),
])
def test_bad_input_is_a_one_line_error(x, match):
    with pytest.raises(QuantError, match=match) as info:
        quantize(x, 64)
    assert "\n" not in str(info.value)


def test_bad_outputs_are_errors():
    x = _rand(100, torch.float32)
    with pytest.raises(QuantError, match="out_q dtype"):
        quantize(x, 64, out_q=torch.empty(100, dtype=torch.uint8))
    with pytest.raises(QuantError, match="out_q must have 100"):
        quantize(x, 64, out_q=torch.empty(99, dtype=torch.int8))
    with pytest.raises(QuantError, match="out_scale must have 2"):
        quantize(x, 64, out_scale=torch.empty(3))
    q, s = quantize(x, 64)
    with pytest.raises(QuantError, match="scale must have num_blocks"):
        dequantize(q, s[:1], 64)
    with pytest.raises(QuantError, match="out dtype"):
        dequantize(q, s, 64, dtype=torch.float32, out=torch.empty(100, dtype=torch.bfloat16))


# ----------------------------------------------------------------- the error bound


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("block", BLOCKS)
def test_error_is_at_most_half_a_step(dtype, block):
    for seed, n in enumerate(SIZES):
        x = _rand(n, dtype, seed)
        q, s = quantize(x, block)
        assert q.dtype == torch.int8 and q.shape == (n,)
        assert s.dtype == torch.float32 and s.shape == (num_blocks(n, block),)
        assert int(q.abs().max()) == 127  # the max of every block hits the grid's end
        _assert_half_step(x, q, s, block)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), block_units=st.integers(1, 16),
       dtype=st.sampled_from(FLOATS), log_std=st.integers(-20, 10), seed=st.integers(0, 2**16))
def test_error_bound_property(n, block_units, dtype, log_std, seed):
    block = block_units * KERNEL_ALIGN
    std = 2.0 ** log_std if dtype != torch.float16 else 2.0 ** max(min(log_std, 8), -8)
    x = _rand(n, dtype, seed, std)
    q, s = quantize(x, block)
    assert int(q.abs().max()) <= 127
    _assert_half_step(x, q, s, block)


def test_scale_is_amax_over_127_per_block():
    x = _rand(1000, torch.bfloat16, 3)
    q, s = quantize(x, 256)
    amax = torch.stack([b.float().abs().max() for b in x.split(256)])
    assert torch.equal(s, amax / 127)


# ----------------------------------------------------------------- exact values


@pytest.mark.parametrize("dtype", FLOATS)
def test_round_trip_is_exact_for_representable_values(dtype):
    block, nblk = 64, 7
    gen = torch.Generator().manual_seed(1)
    k = torch.randint(-127, 128, (nblk, block), generator=gen)
    k[torch.arange(nblk), torch.randint(0, block, (nblk,), generator=gen)] = 127
    k[2, 5] = -127
    k[3] = -k[3]  # a block whose max |x| is negative
    # scales with few mantissa bits so that k*s is exact in every input dtype
    e = torch.tensor([-20, -7, -1, 0, 3, 9, 12])
    s = torch.pow(2.0, e.float())
    if dtype == torch.float32:
        s = s * torch.tensor([1, 3, 5, 1, 7, 1, 3]).float()  # non-power-of-two scales too
    if dtype == torch.float16:
        s = torch.pow(2.0, torch.tensor([-14, -7, -1, 0, 3, 5, 7]).float())
    x = (k.float() * s[:, None]).reshape(-1).to(dtype)
    q, scale = quantize(x, block)
    assert torch.equal(scale, s)
    assert torch.equal(q.long(), k.reshape(-1))
    for out_dtype in FLOATS:
        if out_dtype == dtype or out_dtype == torch.float32:
            assert torch.equal(dequantize(q, scale, block, dtype=out_dtype), x.to(out_dtype))


def test_rounding_is_half_to_even():
    x = torch.zeros(64)
    x[:9] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5])
    q, s = quantize(x, 64)
    assert s.item() == 1.0
    assert q[:9].tolist() == [127, 0, 2, 2, 0, -2, -2, 126, -126]


def test_zeros_give_zero_scale_and_exact_zeros():
    x = torch.zeros(300, dtype=torch.bfloat16)
    q, s = quantize(x, 64)
    assert torch.equal(s, torch.zeros(5)) and torch.equal(q, torch.zeros(300, dtype=torch.int8))
    assert torch.equal(dequantize(q, s, 64), torch.zeros(300))
    x = _rand(300, torch.float32)
    x[64:128] = 0  # one zero block among non-zero ones
    q, s = quantize(x, 64)
    assert s[1] == 0 and (s[[0, 2, 3, 4]] > 0).all()
    assert torch.equal(dequantize(q, s, 64)[64:128], torch.zeros(64))


@pytest.mark.parametrize("dtype,huge", [(torch.float32, 3.0e38), (torch.float32, 1e30),
                                        (torch.bfloat16, 3.0e38), (torch.float16, 65504.0)])
def test_one_huge_value_only_coarsens_its_own_block(dtype, huge):
    x = _rand(256, dtype, 4)
    x[70] = huge
    q, s = quantize(x, 64)
    assert s[1] == torch.tensor(huge, dtype=dtype).float() / 127 and q[70] == 127
    assert (q[64:128].abs() <= 1).sum() == 63  # the rest of that block collapses to ~0
    ref_q, ref_s = quantize(torch.cat([x[:64], x[128:]]), 64)  # other blocks are untouched
    assert torch.equal(ref_s, s[[0, 2, 3]])
    _assert_half_step(x, q, s, 64)


def test_negation_is_symmetric():
    x = _rand(777, torch.float32, 5)
    q, s = quantize(x, 128)
    nq, ns = quantize(-x, 128)
    assert torch.equal(ns, s) and torch.equal(nq, -q)
    neg = -x.abs()
    q, s = quantize(neg, 128)
    assert int(q.max()) <= 0 and int(q.min()) == -127


def test_tiny_blocks_keep_the_bound():
    # amax < 127 * 2**-126: the scale floor keeps codes in range; error stays <= a half step
    x = torch.zeros(128)
    x[:4] = torch.tensor([1e-37, 3e-39, -1e-45, 7e-38])
    x[64:68] = torch.tensor([1e-44, -3e-44, 0.0, 2e-45])
    q, s = quantize(x, 64)
    assert (s == 2.0 ** -126).all()
    assert int(q.abs().max()) <= 127
    _assert_half_step(x, q, s, 64)


@pytest.mark.parametrize("in_dtype", FLOATS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_output_is_the_rounded_fp32_output(in_dtype, out_dtype):
    x = _rand(1000, in_dtype, 6)
    q, s = quantize(x, 256)
    d32 = dequantize(q, s, 256)
    assert torch.equal(dequantize(q, s, 256, dtype=out_dtype), d32.to(out_dtype))
    out = torch.empty(1000, dtype=out_dtype)
    assert dequantize(q, s, 256, out=out) is out and torch.equal(out, d32.to(out_dtype))


# ----------------------------------------------------------------- non-finite input


@pytest.mark.parametrize("dtype", FLOATS)
def test_nonfinite_input_raises_naming_count_and_first_index(dtype):
    x = _rand(300, dtype)
    x[[70, 71, 250]] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype)
    assert find_nonfinite(x) == (3, 70)
    assert find_nonfinite(_rand(300, dtype)) is None
    message = r"3 non-finite value\(s\) \(first at index 70: nan\)"
    with pytest.raises(QuantError, match=message) as info:
        quantize(x, 64)
    assert "\n" not in str(info.value)


def test_nonfinite_blocks_are_poisoned_when_not_checked():
    x = _rand(300, torch.float32)
    x[70], x[250] = float("nan"), float("-inf")
    q, s = quantize(x, 64, check_finite=False)
    poisoned = torch.tensor([False, True, False, True, False])
    assert torch.equal(quant.poisoned_blocks(s), poisoned)
    assert torch.isinf(s[poisoned]).all() and (s[poisoned] > 0).all()
    assert (q[64:128] == 0).all() and (q[192:256] == 0).all()
    d = dequantize(q, s, 64)
    assert torch.isnan(d[64:128]).all() and torch.isnan(d[192:256]).all()
    ref_q, ref_s = quantize(torch.cat([x[:64], x[128:192], x[256:]]), 64)  # finite blocks as usual
    assert torch.equal(ref_s, s[~poisoned])
    assert torch.equal(ref_q, torch.cat([q[:64], q[128:192], q[256:]]))


# ----------------------------------------------------------------- preallocated outputs


def test_outputs_into_slices_of_persistent_buffers():
    S, shard, block = 4, 512, 256
    bucket = _rand(S * shard, torch.bfloat16, 7)
    q_buf = torch.empty(S * shard, dtype=torch.int8)
    s_buf = torch.empty(S * num_blocks(shard, block))
    nb = num_blocks(shard, block)
    for r in range(S):
        x = bucket[r * shard:(r + 1) * shard]
        oq, os_ = q_buf[r * shard:(r + 1) * shard], s_buf[r * nb:(r + 1) * nb]
        q, s = quantize(x, block, out_q=oq, out_scale=os_)
        assert q is oq and s is os_
    # slices a multiple of the block: the gathered slices are the whole bucket's quantization
    whole_q, whole_s = quantize(bucket, block)
    assert torch.equal(q_buf, whole_q) and torch.equal(s_buf, whole_s)
    out = torch.empty(S * shard, dtype=torch.bfloat16)
    for r in range(S):
        dequantize(q_buf[r * shard:(r + 1) * shard], s_buf[r * nb:(r + 1) * nb], block,
                   out=out[r * shard:(r + 1) * shard])
    assert torch.equal(out, dequantize(whole_q, whole_s, block, dtype=torch.bfloat16))


@pytest.mark.parametrize("n", [1, 100, 640, 1001])
def test_packed_views_hold_one_wire_buffer(n):
    block, S = 64, 3
    per = quantized_nbytes(n, block)
    if per % 4:
        with pytest.raises(QuantError, match="storage offset"):
            packed_views(torch.empty(S * per, dtype=torch.uint8)[per:2 * per], n, block)
        return
    wire = torch.empty(S * per, dtype=torch.uint8)
    xs = [_rand(n, torch.float32, r) for r in range(S)]
    for r, x in enumerate(xs):
        q, s = packed_views(wire[r * per:(r + 1) * per], n, block)
        quantize(x, block, out_q=q, out_scale=s)
    for r, x in enumerate(xs):
        q, s = packed_views(wire[r * per:(r + 1) * per], n, block)
        ref_q, ref_s = quantize(x, block)
        assert torch.equal(q, ref_q) and torch.equal(s, ref_s)


def test_packed_views_rejects_a_wrong_size():
    with pytest.raises(QuantError, match="quantized_nbytes=108"):
        packed_views(torch.empty(100, dtype=torch.uint8), 100, 64)


# ----------------------------------------------------------------- dispatch


def test_auto_dispatch_uses_torch_for_cpu_tensors(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("Triton must not run for CPU tensors")
    monkeypatch.setattr(quant, "quantize_triton", boom)
    monkeypatch.setattr(quant, "dequantize_triton", boom)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # even with the interpreter on
    x = _rand(300, torch.bfloat16)
    q, s = quant.quantize_auto(x, 64)
    ref_q, ref_s = quantize(x, 64)
    assert torch.equal(q, ref_q) and torch.equal(s, ref_s)
    assert torch.equal(quant.dequantize_auto(q, s, 64, dtype=torch.bfloat16),
                       dequantize(q, s, 64, dtype=torch.bfloat16))
    assert not quant.use_triton(x)


def test_triton_available_is_false_for_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert quant.triton_available("cpu") is False
    if not torch.cuda.is_available():
        assert quant.triton_available("cuda") is False
        with pytest.raises(QuantError, match="cannot run on device cpu"):
            quant.quantize_triton(torch.ones(64), 64)


def test_package_works_without_triton():
    code = """
import sys
sys.modules["triton"] = None  # import triton now raises ImportError
import torch
import megatron_lbp.quant as quant
assert not quant.triton_available("cpu") and not quant.triton_available("cuda")
q, s = quant.quantize_auto(torch.randn(300), 64)
quant.dequantize_auto(q, s, 64)
try:
    quant.quantize_triton(torch.randn(300), 64)
except quant.QuantError as e:
    assert "Triton is not importable" in str(e), e
else:
    raise AssertionError("no QuantError")
print("ok")
"""
    out = _run(code, {"TRITON_INTERPRET": "1"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


# ----------------------------------------------------------------- Triton under the interpreter

_INTERPRETER_CHECK = r"""
import json, warnings
import numpy as np
import torch
warnings.simplefilter("ignore")          # numpy warns about NaN casts in poisoned blocks
np.seterr(all="ignore")
from megatron_lbp.quant import (quantize, dequantize, quantize_triton, dequantize_triton,
                                triton_available)
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
def bits(t):
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])
def same(a, b):                           # bit-equal, NaNs equal whatever their payload
    nan = torch.isnan(a.float())
    return bool(torch.equal(nan, torch.isnan(b.float()))
                and torch.equal(bits(a)[~nan], bits(b)[~nan]))
fails, cases = [], 0
def check(name, x, block):
    global cases
    q1, s1 = quantize(x, block, check_finite=False)
    q2, s2 = quantize_triton(x, block, check_finite=False)
    ok = same(q1, q2) and same(s1, s2)
    for od in FLOATS:
        ok = ok and same(dequantize(q1, s1, block, dtype=od),
                         dequantize_triton(q1, s1, block, dtype=od))
    cases += 1
    if not ok:
        fails.append(f"{name} n={x.numel()} block={block} dtype={x.dtype}")
assert triton_available("cpu")
g = torch.Generator().manual_seed(0)
for n in (1, 63, 200, 1017):
    for block in (64, 192):
        for dt in FLOATS:
            check("randn", (torch.randn(n, generator=g) * 0.02).to(dt), block)
t = torch.zeros(192)
t[:9] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5])
t[64:68] = torch.tensor([1e-37, 3e-39, -1e-45, 7e-38])
t[128:131] = torch.tensor([3.0e38, -3.0e38, 1.0])
check("ties+tiny+huge", t, 64)
check("zeros", torch.zeros(130, dtype=torch.bfloat16), 64)
p = torch.randn(300, generator=g)
p[70], p[250] = float("nan"), float("-inf")
check("poisoned", p, 64)
# bf16 outputs at exact ties of the fp32 product
check("bf16 ties", torch.arange(-127, 129, dtype=torch.float32) * (1 + 2 ** -8), 256)
# preallocated views and the raise on non-finite input
buf_q, buf_s = torch.empty(400, dtype=torch.int8), torch.empty(8)
q, s = quantize_triton(p[:200].nan_to_num(), 64, out_q=buf_q[200:], out_scale=buf_s[4:])
rq, rs = quantize(p[:200].nan_to_num(), 64)
if not (q.data_ptr() == buf_q[200:].data_ptr() and torch.equal(q, rq) and torch.equal(s, rs)):
    fails.append("out views")
try:
    quantize_triton(p, 64)
    fails.append("no raise on NaN")
except ValueError as e:
    if "2 non-finite value(s) (first at index 70" not in str(e):
        fails.append("message: " + str(e))
print(json.dumps({"cases": cases, "fails": fails}))
"""


def test_triton_kernels_match_torch_bit_for_bit_under_the_interpreter():
    pytest.importorskip("triton")
    out = _run(_INTERPRETER_CHECK, {"TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["cases"] >= 25 and result["fails"] == [], result


_COMPILE_CHECK = r"""
import json, subprocess
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.errors import CompilationError
from megatron_lbp.quant import triton_kernels as tk
Q = {"x_ptr": "*bf16", "q_ptr": "*i8", "scale_ptr": "*fp32", "numel": "i64",
     "BLOCK_SIZE": "constexpr", "BLOCK_POW2": "constexpr"}
D = {"q_ptr": "*i8", "scale_ptr": "*fp32", "out_ptr": "*bf16", "numel": "i64",
     "BLOCK_SIZE": "constexpr", "BLOCK_POW2": "constexpr", "OUT_BF16": "constexpr"}
TOOLS = ("ptxas", "lld", "libdevice", "compatible backends for target")

def kind(e):
    # A kernel the frontend rejects is a bug in it; a missing binary or backend is the install's.
    if isinstance(e, CompilationError):
        return "kernel"
    if isinstance(e, (OSError, subprocess.CalledProcessError)) or any(t in str(e) for t in TOOLS):
        return "toolchain"
    return "unknown"

@triton.jit
def _broken_kernel(x_ptr, q_ptr, numel, BLOCK_SIZE: tl.constexpr):
    offs = tl.arange(0, BLOCK_SIZE)     # a block of 192 is no power of two: arange refuses
    tl.store(q_ptr + offs, tl.load(x_ptr + offs).to(tl.int8), mask=offs < numel)

def compile_all(kernels, targets):
    out = {}
    for name, target, key in targets:
        asm = {}
        for kern, sig, consts in kernels:
            try:
                k = triton.compile(ASTSource(fn=kern, signature=sig, constexprs=consts),
                                   target=target, options={"num_warps": 1})
                asm[kern.fn.__name__] = {"asm": k.asm[key]}
            except Exception as e:
                asm[kern.fn.__name__] = {"kind": kind(e),
                                         "error": type(e).__name__ + ": " + str(e)[:300]}
        out[name] = asm
    return out

TARGETS = [("cuda", GPUTarget("cuda", 90, 32), "ptx"), ("hip", GPUTarget("hip", "gfx90a", 64), "amdgcn")]
real = compile_all([(tk._quantize_kernel, Q, {"BLOCK_SIZE": 192, "BLOCK_POW2": 256}),
                    (tk._dequantize_kernel, D, {"BLOCK_SIZE": 256, "BLOCK_POW2": 256, "OUT_BF16": True})],
                   TARGETS)
# the test of the test: a kernel that cannot compile, and a backend that is not there
broken = compile_all([(_broken_kernel, {"x_ptr": "*bf16", "q_ptr": "*i8", "numel": "i64",
                                        "BLOCK_SIZE": "constexpr"}, {"BLOCK_SIZE": 192})],
                     TARGETS + [("absent", GPUTarget("no-such-backend", 1, 32), "asm")])
print(json.dumps({"real": real, "broken": broken}))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{"real"|"broken": {target: {kernel: {"asm"} or {"kind", "error"}}}}, in a fresh interpreter."""
    pytest.importorskip("triton")
    tmp = tmp_path_factory.mktemp("triton")
    script = tmp / "compile_check.py"      # a file: triton.jit reads the kernels' source
    script.write_text(_COMPILE_CHECK)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO,
                         timeout=180, env={**os.environ, "PYTHONPATH": str(REPO),
                                           "TRITON_CACHE_DIR": str(tmp / "cache")})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _usable_targets(asm):
    """Targets whose toolchain is here; raises naming any kernel that no longer compiles."""
    broken = [f"{t} {k}: {r['error']}" for t, ks in asm.items() for k, r in ks.items()
              if r.get("kind") in ("kernel", "unknown")]
    assert not broken, "kernels that do not compile:\n" + "\n".join(broken)
    return [t for t, ks in asm.items() if not any("error" in r for r in ks.values())]


def test_kernels_compile_for_nvidia_and_amd_with_ieee_division(compiled):
    """No GPU needed: Triton compiles for sm_90 and gfx90a (MI250X) from this machine.

    Only a missing toolchain (a backend not shipped, no ptxas) skips a target; a
    kernel Triton's frontend rejects fails the test.
    """
    asm = compiled["real"]
    usable = _usable_targets(asm)
    if not usable:
        pytest.skip("no Triton GPU backend can compile here: "
                    + "; ".join(r["error"] for ks in asm.values() for r in ks.values()))
    if "cuda" in usable:
        ptx = asm["cuda"]["_quantize_kernel"]["asm"]
        assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
        assert "div.rn.ftz" not in ptx  # subnormal quotients are kept, as in torch
    if "hip" in usable:
        gcn = asm["hip"]["_quantize_kernel"]["asm"]
        assert "v_div_fmas_f32" in gcn  # the IEEE-correct division sequence
        assert ".amdhsa_float_denorm_mode_32 3" in gcn  # fp32 denormals preserved


def test_compile_check_tells_a_broken_kernel_from_a_missing_toolchain(compiled):
    """The test of the test: a kernel the frontend rejects fails it, an absent backend only skips."""
    asm = compiled["broken"]
    kinds = {t: {r.get("kind") for r in ks.values()} for t, ks in asm.items()}
    assert kinds == {"cuda": {"kernel"}, "hip": {"kernel"}, "absent": {"toolchain"}}, asm
    with pytest.raises(AssertionError, match="kernels that do not compile"):
        _usable_targets(asm)
    assert _usable_targets({"absent": asm["absent"]}) == []


# ----------------------------------------------------------------- benchmark smoke


def test_bench_json_smoke():
    out = _run("from megatron_lbp.quant.bench import main; main()", {}, argv=[
        "--numel", "5000", "--repeats", "1", "--block-sizes", "64,256", "--json"])
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert {"machine", "numel", "repeats", "unit", "memcpy_gbps", "results", "error"} <= set(report)
    assert {"cpu_count", "torch", "torch_threads"} <= set(report["machine"])
    assert set(report["memcpy_gbps"]) == {"fp32", "bf16"}
    assert len(report["results"]) == 4  # (fp32, bf16) x (64, 256), torch only on CPU
    for r in report["results"]:
        assert {"impl", "dtype", "block_size", "quantize_gbps", "dequantize_gbps",
                "quantize_vs_memcpy", "dequantize_vs_memcpy"} <= set(r)
        assert r["quantize_gbps"] > 0 and r["dequantize_gbps"] > 0
    assert [e["block_size"] for e in report["error"]] == [64, 256]
    assert all(e["max_err_steps"] <= 0.5 + 1e-4 for e in report["error"])
