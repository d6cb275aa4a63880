"""The installed package stands alone: preprocessing, tokenizer building and the DeepSpeed runner
are modules of it, and nothing reads code from the checkout's scripts/, tokenizer/ or
benchmarks/ by path.

Each run is ``python -I`` (no PYTHONPATH, no working directory on sys.path) from a temporary
directory: megatron_lbp comes from the environment's installation, and the checkout's root
is not on sys.path.
"""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Every loaded module's file: none from the checkout outside megatron_lbp/ (argv[1]: the checkout;
# the environment may live in it, .venv/).
CHECK = r"""
import sys
from pathlib import Path

repo = Path(sys.argv[1])
allowed = (repo / "megatron_lbp", Path(sys.prefix).resolve())  # the package; the environment
outside = sorted(str(m.__file__) for m in list(sys.modules.values())
                 if getattr(m, "__file__", None) and Path(m.__file__).resolve().is_relative_to(repo)
                 and not any(Path(m.__file__).resolve().is_relative_to(a) for a in allowed))
assert not outside, f"loaded from the checkout outside the package: {outside}"
print("ok", len([m for m in sys.modules if m.startswith("megatron_lbp.")]))
"""

# In one isolated interpreter: the tokenizer builders' and the DeepSpeed config's --help, the
# DeepSpeed runner imported, then the demo data built (tokenizer model checked, corpus
# preprocessed) through the package's own preprocessing (argv[2]: where). Preprocessing's
# --help would import Megatron a second way: building the data runs the same module.
RUN = r"""
import importlib, runpy, sys
from pathlib import Path

repo, out = Path(sys.argv[1]), sys.argv[2]
assert not any(Path(p or ".").resolve() == repo for p in sys.path), sys.path
for module in ("megatron_lbp.integration.build_tokenizer", "megatron_lbp.integration.build_gpt2_bpe",
               "megatron_lbp.deepspeed_baseline.schemes"):
    sys.argv = [module, "--help"]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        assert exit_.code in (0, None), (module, exit_.code)
importlib.import_module("megatron_lbp.deepspeed_baseline.pretrain")
sys.argv = ["-c", str(repo)]
from megatron_lbp.integration.data import build_demo_data

prefix = build_demo_data(out, quiet=True)
assert Path(prefix + ".bin").stat().st_size > 0, prefix
assert "megatron_lbp.integration.preprocess_data" in sys.modules
"""


def _isolated(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    work = tmp_path / "elsewhere"
    work.mkdir()
    return subprocess.run([sys.executable, "-I", "-c", code, str(REPO), str(tmp_path / "data")],
                          cwd=work, capture_output=True, text=True, timeout=900)


def test_commands_and_demo_data_run_from_the_installed_package_alone(tmp_path):
    proc = _isolated(RUN + CHECK, tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1].startswith("ok"), (
        proc.stdout[-2000:] + proc.stderr[-3000:])


def test_the_check_names_a_checkout_file_loaded_by_path(tmp_path):
    """A test of the test: what integration/data.py did before, loading scripts/ by path."""
    load = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('x', {str(REPO / 'scripts' / 'preprocess_data.py')!r})\n"
            "sys.modules['x'] = importlib.util.module_from_spec(spec)\n")
    proc = _isolated(load + CHECK, tmp_path)
    assert proc.returncode != 0 and "loaded from the checkout outside the package" in proc.stderr, (
        proc.stdout[-2000:] + proc.stderr[-2000:])
