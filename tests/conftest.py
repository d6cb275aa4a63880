import os

import pytest

# Ranks and the main process share 2 cores in CI: one thread each keeps them from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def demo_dataset(tmp_path_factory) -> str:
    """--data-path of the shipped corpus, tokenized once per session (~7 s) for every test that trains on it.

    Tests only read it; Megatron's index cache next to it is keyed by each run's settings.
    """
    from tests.pretrain_runner import demo_data

    return demo_data(tmp_path_factory.mktemp("demo-data"))
