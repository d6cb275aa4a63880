"""Sharded init is robust by construction: constructors that touch a parameter after attaching it.

engine/materialize.py releases a parameter (drops its values) when its module
is attached to its parent. These small constructors, made for the test, touch
a child's parameter afterwards in each way a constructor can (megatron-core's
LanguageModelEmbedding does the first); each must build to the plain build's
values and leave the generator where the plain build leaves it, never crash
and never give a wrong value. One process, no Megatron: the watch is plain
PyTorch.
"""
import pytest
import torch

from megatron_lbp.engine import materialize


class Snapshot:
    def __init__(self):
        self.state = torch.get_rng_state()

    def restore(self):
        torch.set_rng_state(self.state)


class ReinitAfterAttach(torch.nn.Module):
    """LanguageModelEmbedding's shape: attach nn.Embedding, then initialise its weight again."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.emb = torch.nn.Embedding(16, 8)
        torch.nn.init.normal_(self.emb.weight, std=0.02)


class ReadAfterAttach(torch.nn.Module):
    """Reads a child's weight after attaching it: a buffer computed from the values."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("scale", self.lin.weight.detach().abs().sum(dim=1))
        self.after = torch.nn.Linear(8, 4)


class PartialWriteAfterAttach(torch.nn.Module):
    """Zeroes one row of a child's weight after attaching it (a padding index done late)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.emb.weight.data[3].zero_()
        self.lin = torch.nn.Linear(8, 8)


class ReplaceDataAfterAttach(torch.nn.Module):
    """Replaces a child's ``.data`` after attaching it (no operation on the old tensor)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.lin.weight.data = torch.randn(8, 8) * 0.5
        self.other = torch.nn.Linear(8, 2)


class Outer(torch.nn.Module):
    """A grandparent that re-initialises a grandchild after both were attached, and a builder that
    touches the finished model: held until the outer constructor / the build returns."""

    def __init__(self):
        super().__init__()
        self.inner = ReinitAfterAttach()
        self.head = torch.nn.Linear(8, 3)
        with torch.no_grad():
            self.inner.lin.weight.uniform_(-0.1, 0.1)


def build_outer_and_touch():
    model = Outer()
    with torch.no_grad():
        model.head.bias.fill_(0.5)
    return model


BUILDERS = {
    "reinit": ReinitAfterAttach,
    "read": ReadAfterAttach,
    "partial-write": PartialWriteAfterAttach,
    "replace-data": ReplaceDataAfterAttach,
    "grandparent-and-builder": build_outer_and_touch,
}


def sharded_values(builder, seed=7):
    """(values handed to the engine by name, buffers, rng state after, the construction)."""
    torch.manual_seed(seed)
    model = materialize.build_sharded(builder, cast_dtype=None, device="cpu", rng_snapshot=Snapshot)
    construction = materialize.construction_of(model)
    rng_after = torch.get_rng_state()
    for name, p in model.named_parameters():
        assert materialize.is_placeholder(p), f"{name} holds values after the first run"
    names = {p: n for n, p in model.named_parameters()}
    got = {}

    def write(param, values):
        got[names[param]] = values.clone()
        return True

    construction.materialize(write)
    assert torch.equal(torch.get_rng_state(), rng_after), "materialize moved the generator"
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return got, buffers, rng_after, construction


def plain_values(builder, seed=7):
    torch.manual_seed(seed)
    model = builder()
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: b.clone() for n, b in model.named_buffers()}, torch.get_rng_state())


def _differences(got: dict, want: dict) -> list[str]:
    out = [f"{n}: missing" for n in want if n not in got]
    out += [f"{n}: max |diff| {(got[n] - want[n]).abs().max().item():.3g}"
            for n in want if n in got and not torch.equal(got[n], want[n])]
    return out


@pytest.mark.parametrize("name", list(BUILDERS))
def test_a_late_touch_builds_the_plain_values(name):
    builder = BUILDERS[name]
    want_params, want_buffers, want_rng = plain_values(builder)
    got_params, got_buffers, got_rng, construction = sharded_values(builder)
    assert not _differences(got_params, want_params), (
        f"{name}: weights differ from a plain build: {_differences(got_params, want_params)}")
    assert not _differences(got_buffers, want_buffers), (
        f"{name}: buffers differ from a plain build: {_differences(got_buffers, want_buffers)}")
    assert torch.equal(got_rng, want_rng), f"{name}: the generator after the build differs"
    assert construction.late, f"{name}: no late parameter was recorded"


def test_what_is_held_and_why_is_named():
    *_, construction = sharded_values(build_outer_and_touch)
    late = {lp.name: lp for lp in construction.late}
    assert late["inner.emb.weight"].toucher == "ReinitAfterAttach.__init__", late
    assert late["inner.lin.weight"].toucher == "Outer.__init__", late
    assert late["head.bias"].toucher == "the model builder", late
    assert late["inner.emb.weight"].nbytes == 16 * 8 * 4
    assert construction.first_runs == 1, "initializers overwrite whole: no repeated first run"
    line = late["inner.emb.weight"].describe()
    assert "inner.emb.weight" in line and "ReinitAfterAttach.__init__" in line and "MiB" in line


def test_reads_repeat_the_first_run_with_the_parameter_held():
    *_, construction = sharded_values(ReadAfterAttach)
    assert construction.first_runs == 2
    assert [lp.name for lp in construction.late] == ["lin.weight"]


def test_a_second_run_that_touches_what_the_first_did_not_is_refused():
    calls = []

    def builder():
        calls.append(1)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        if len(calls) > 1:                      # only the second construction touches
            with torch.no_grad():
                model[0].weight.mul_(2)
        return model

    torch.manual_seed(0)
    model = materialize.build_sharded(builder, cast_dtype=None, device="cpu", rng_snapshot=Snapshot)
    with pytest.raises(materialize.ShardedInitError, match=r"second construction touched parameter"):
        materialize.construction_of(model).materialize(lambda p, v: True)


def test_the_test_catches_an_unwatched_build(monkeypatch):
    """The watch switched off (operations pass through untouched): the late writes crash on the
    stride-0 placeholder and the late read sees zeros, so the checks above fail."""
    monkeypatch.setattr(materialize._Watch, "__torch_dispatch__",
                        lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {})))
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        sharded_values(ReinitAfterAttach)
    want_params, want_buffers, _ = plain_values(ReadAfterAttach)
    _, got_buffers, _, _ = sharded_values(ReadAfterAttach)
    assert _differences(got_buffers, want_buffers), "the unwatched read went unnoticed"


def test_placeholders_are_distinct_and_recognised():
    a = materialize.placeholder((3, 4), torch.float32, "cpu")
    b = materialize.placeholder((3, 4), torch.float32, "cpu")
    assert materialize.is_placeholder(a) and materialize.is_placeholder(b)
    assert a.data_ptr() != b.data_ptr(), "two parameters share a placeholder element"
    assert not materialize.is_placeholder(torch.zeros(()).expand(3, 4))
    assert not materialize.is_placeholder(torch.zeros(3, 4))
