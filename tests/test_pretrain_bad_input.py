"""Bad input to python -m megatron_lbp.pretrain_gpt: one line naming it, exit 2, nothing written."""
import os

import numpy
import pytest

from tests.pretrain_runner import TINY, demo_data, run_pretrain, why


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return demo_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def foreign_data(tmp_path_factory):
    """A dataset whose token ids (up to 9999) do not fit the shipped 4096-token vocabulary."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path_factory.mktemp("foreign") / "foreign_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for start in range(0, 10000, 500):
        builder.add_document(torch.arange(start, start + 500), [500])
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, data):
    ckpt = tmp_path_factory.mktemp("ckpt")
    code, log, _ = run_pretrain(1, TINY + ["--data-path", data, "--train-iters", "2",
                                           "--global-batch-size", "2", "--save", str(ckpt),
                                           "--save-interval", "2", "--ckpt-format", "torch_dist"])
    assert code == 0, why(log)
    return ckpt


def _snapshot(path):
    return sorted((p, os.path.getmtime(os.path.join(r, p))) for r, _, files in os.walk(path)
                  for p in files)


def _fails_with(args, *needles, ckpt=None):
    before = _snapshot(ckpt) if ckpt else None
    code, log, losses = run_pretrain(1, args, timeout=300)
    errors = [l for l in log.splitlines() if "megatron_lbp.pretrain_gpt: error:" in l]
    assert code == 2, f"exit {code}, expected 2\n{why(log)}"
    assert len(errors) == 1, f"expected one error line, got {errors}\n{why(log)}"
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"
    assert not losses, "training started"
    if ckpt:
        assert _snapshot(ckpt) == before, "the checkpoint directory changed"


def base(data, *extra):
    return TINY + ["--data-path", data, "--train-iters", "2", "--global-batch-size", "2", *extra]


def test_missing_data_prefix(tmp_path):
    _fails_with(base(str(tmp_path / "nothing")), "--data-path", "nothing.bin does not exist")


def test_empty_data_files(tmp_path):
    for ext in (".bin", ".idx"):
        (tmp_path / f"empty{ext}").write_bytes(b"")
    _fails_with(base(str(tmp_path / "empty")), "--data-path", "is empty")


def test_data_tokenized_with_another_vocabulary(foreign_data):
    _fails_with(base(foreign_data), "--data-path", "token id 9999", "vocabulary of 4096")


def test_missing_tokenizer_model(data, tmp_path):
    args = base(data)
    args[args.index("--tokenizer-model") + 1] = str(tmp_path / "none.model")
    _fails_with(args, "--tokenizer-model", "does not exist")


def test_checkpoint_of_another_model_shape(data, checkpoint):
    args = base(data, "--load", str(checkpoint), "--save", str(checkpoint), "--save-interval", "1",
                "--ckpt-format", "torch_dist", "--train-iters", "3")
    args[args.index("--hidden-size") + 1] = "32"
    _fails_with(args, "--load", "another model shape", "hidden-size 64 (checkpoint) vs 32 (now)",
                ckpt=checkpoint)


def test_truncated_checkpoint(data, checkpoint, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    (step,) = [p for p in broken.iterdir() if p.name.startswith("iter_")]
    (step / "metadata.json").unlink()
    _fails_with(base(data, "--load", str(broken), "--ckpt-format", "torch_dist"),
                "--load", "no metadata.json", ckpt=broken)


@pytest.mark.parametrize("extra,needle", [
    (["--hier-partition", "--use-distributed-optimizer"], "--use-distributed-optimizer"),
    (["--hier-partition", "--hier-grad-group-size", "3"], "--hier-grad-group-size=3"),
    (["--hier-partition", "--hier-preset", "zero3", "--hier-param-group-size", "2"],
     "contradicts --hier-preset zero3"),
])
def test_hier_flags_it_cannot_serve(data, extra, needle):
    _fails_with(base(data, *extra), needle)
