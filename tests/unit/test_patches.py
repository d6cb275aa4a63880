"""The patch set applies to the wheel's megatron/ (identical to core_v0.19.0's) and the patched path trains."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import megatron

from tests.helpers.pretrain_runner import TINY, run_pretrain, why

REPO = Path(__file__).resolve().parents[2]
APPLY = str(REPO / "scripts" / "apply_patches.sh")
WHEEL_ROOT = Path(megatron.__path__[0]).parent


def apply(*args):
    return subprocess.run(["bash", APPLY, *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron-copy")
    # With the wheel's bytecode (copytree keeps mtimes, so it stays valid for every file
    # the patches leave alone): otherwise each rank compiles all of megatron/ again.
    shutil.copytree(WHEEL_ROOT / "megatron", root / "megatron")
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


def test_patched_megatron_trains_with_hier_partition_and_unpatched_refuses(tree, demo_dataset):
    assert apply(tree).returncode == 0
    # Megatron's default position embeddings (learned absolute), not the tests' RoPE: its
    # embedding initialises the position table after attaching it (issue 25)
    tiny = [a for a in TINY if a not in ("--position-embedding-type", "rope")]
    assert "--position-embedding-type" not in tiny
    args = tiny + ["--data-path", demo_dataset, "--train-iters", "3", "--global-batch-size", "8",
                   "--hier-partition", "--hier-gpus-per-node", "2"]
    hooks_off = {"LBP_RUNTIME_HOOKS": "0"}
    # torchrun: a fresh interpreter per rank, importing the patched tree on PYTHONPATH.
    code, log, losses = run_pretrain(2, args, env={**hooks_off, "PYTHONPATH": str(tree)},
                                     launcher="torchrun")
    assert code == 0, why(log)
    assert "megatron-lbp hierarchy (lbp): W=2 P=2" in log and sorted(losses) == [1, 2, 3], why(log)
    assert "embedding.position_embeddings.weight" in log and "LanguageModelEmbedding.__init__" in log, (
        "the late-initialised position table was not named:\n" + why(log))
    code, log, _ = run_pretrain(1, args, env=hooks_off)
    assert code == 2 and "LBP_RUNTIME_HOOKS=0 but the Megatron-LM tree" in log and "is not patched" in log, why(log)


PARSE_IN_PATCHED_TREE = """
import json, sys
import megatron_lbp  # the Python 3.11 shim, as the patch's import does
from megatron.training import arguments
assert arguments.__file__.startswith(sys.argv[1]), arguments.__file__
base = ["prog"] + sys.argv[2:]
sys.argv = list(base)
args = arguments.parse_args()  # what Megatron-LM's pretrain_gpt.py reaches through pretrain()
print(json.dumps({k: getattr(args, k) for k in ("transformer_impl", "gradient_accumulation_fusion",
                                                 "distributed_backend", "masked_softmax_fusion")}))
sys.argv = base + ["--hier-partition", "--cuda-graph-impl", "local"]
try:
    arguments.parse_args()
except SystemExit as e:
    print("exit", e.code)
"""


def test_patched_tree_parses_with_the_capability_resolved_flags(tree):
    """A patched tree's own entry gets the same resolution as python -m megatron_lbp.pretrain_gpt:
    the parse_args hook adds the flags this environment needs and refuses what cannot work."""
    assert apply(tree).returncode == 0
    r = subprocess.run([sys.executable, "-c", PARSE_IN_PATCHED_TREE, str(tree), "--num-layers", "2"],
                       capture_output=True, text=True, timeout=600, cwd=tree,
                       env={**os.environ, "PYTHONPATH": str(tree),
                            "PYTHONWARNINGS": "ignore", "RANK": "0"})
    out = r.stdout.splitlines()
    added = [l for l in out if l.startswith("[megatron-lbp] adding ")]
    assert any("--transformer-impl local" in l for l in added), r.stdout + r.stderr
    parsed = json.loads(next(l for l in out if l.startswith("{")))
    assert parsed == {"transformer_impl": "local", "gradient_accumulation_fusion": False,
                      "distributed_backend": "gloo", "masked_softmax_fusion": False}, parsed
    assert out[-1] == "exit 2", r.stdout + r.stderr
    errors = [l for l in r.stderr.splitlines() if ": error: " in l]
    assert len(errors) == 1 and errors[0].startswith(
        "prog: error: --hier-partition cannot run CUDA graphs (--cuda-graph-impl local)"), r.stderr
