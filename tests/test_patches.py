"""The patch set applies to the wheel's megatron/ (identical to core_v0.19.0's) and the patched path trains."""
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import megatron

from tests.pretrain_runner import TINY, demo_data, run_pretrain, why

REPO = Path(__file__).resolve().parents[1]
APPLY = str(REPO / "scripts" / "apply_patches.sh")
WHEEL_ROOT = Path(megatron.__path__[0]).parent


def apply(*args):
    return subprocess.run(["bash", APPLY, *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron-copy")
    shutil.copytree(WHEEL_ROOT / "megatron", root / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_pinned_originals_are_the_installed_wheels_files():
    for line in (REPO / "patches" / "SHA256SUMS").read_text().splitlines():
        digest, kind, path = line.split()
        if kind == "original":
            got = hashlib.sha256((WHEEL_ROOT / path).read_bytes()).hexdigest()
            assert got == digest, f"{path}: installed wheel has {got}, patches expect {digest}"


def test_apply_is_checked_idempotent_and_refuses_other_versions(tree, tmp_path):
    assert apply("--check", tree).returncode == 1
    first = apply(tree)
    assert first.returncode == 0 and "patched" in first.stdout, first.stderr
    again = apply(tree)
    assert again.returncode == 0 and "already patched" in again.stdout, again.stderr
    assert apply("--check", tree).returncode == 0

    other = tmp_path / "other"
    shutil.copytree(tree / "megatron" / "training", other / "megatron" / "training")
    shutil.copytree(tree / "megatron" / "core", other / "megatron" / "core",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    (other / "megatron" / "training" / "training.py").write_text("# another version\n")
    refused = apply(other)
    assert refused.returncode == 2 and "refusing to patch" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    missing = apply(tmp_path / "nowhere")
    assert missing.returncode == 2 and "not found" in missing.stderr, missing.stderr


def test_patched_megatron_trains_with_hier_partition_and_unpatched_refuses(tree, tmp_path):
    assert apply(tree).returncode == 0
    data = demo_data(tmp_path / "data")
    args = TINY + ["--data-path", data, "--train-iters", "3", "--global-batch-size", "8",
                   "--hier-partition", "--hier-gpus-per-node", "2"]
    hooks_off = {"LBP_RUNTIME_HOOKS": "0"}
    code, log, losses = run_pretrain(2, args, env={**hooks_off, "PYTHONPATH": str(tree)})
    assert code == 0, why(log)
    assert "megatron-lbp hierarchy (lbp): W=2 P=2" in log and sorted(losses) == [1, 2, 3], why(log)
    code, log, _ = run_pretrain(1, args, env=hooks_off)
    assert code == 2 and "LBP_RUNTIME_HOOKS=0 but the Megatron-LM tree" in log and "is not patched" in log, why(log)
