import os

import pytest

# Ranks and the main process share 2 cores in CI: one thread each keeps them from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def demo_dataset(tmp_path_factory) -> str:
    """--data-path of the shipped corpus, tokenized once per session (~7 s) for every test that trains on it.

    Tests only read it; Megatron's index cache next to it is keyed by each run's settings.
    """
    from tests.helpers.pretrain_runner import demo_data

    return demo_data(tmp_path_factory.mktemp("demo-data"))


@pytest.fixture(scope="session")
def local_slurm(tmp_path_factory):
    """The local two-node Slurm (scripts/launch/local_slurm.sh) and the GPT-2 data its jobs train
    on, started once for every real-Slurm test of the session (test_local_slurm_job,
    test_local_slurm_study: `-k local_slurm` runs both on one cluster) and stopped by PID at the
    end whatever the outcome. Yields {"env": the environment for sbatch/squeue (SLURM_CONF set;
    the session's SLURM_*, LBP_* and OMP_NUM_THREADS removed), "paths": VOCAB_FILE, MERGE_FILE,
    DATA_PATH}. Skips without root and Debian's slurm packages (or apt-get)."""
    import shutil
    import subprocess

    from tests.launch.test_launchers import LOCAL_SLURM, _gpt2_data

    if os.geteuid() != 0 or (shutil.which("apt-get") is None and shutil.which("slurmctld") is None):
        pytest.skip("needs root and Debian's slurm packages (or apt-get)")
    subprocess.run(["bash", str(LOCAL_SLURM), "install"], check=True)
    root = tmp_path_factory.mktemp("local-slurm")
    cluster = root / "slurm"
    # OMP_NUM_THREADS: this file's default for the test process, not a value the user exported
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("SLURM_") or k.startswith("LBP_") or k == "OMP_NUM_THREADS")}
    env["SLURM_CONF"] = str(cluster / "etc" / "slurm.conf")
    paths = _gpt2_data(root, {**env, "PYTHONWARNINGS": "ignore"})
    try:
        subprocess.run(["bash", str(LOCAL_SLURM), "start", str(cluster)], check=True, env=env)
        yield {"env": env, "paths": paths}
    finally:
        subprocess.run(["bash", str(LOCAL_SLURM), "stop", str(cluster)], env=env)
