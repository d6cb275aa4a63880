"""One process per Slurm task: the entry point turns SLURM_* into torch.distributed's env:// variables."""
from megatron_lbp.integration.pretrain_gpt import _env_rank_from_slurm


def test_slurm_task_variables_become_rank_world_local(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "13")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    monkeypatch.setenv("SLURM_LOCALID", "5")
    _env_rank_from_slurm()
    import os

    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("13", "16", "5")


def test_torchrun_variables_win_over_slurm(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    _env_rank_from_slurm()
    import os

    assert os.environ["RANK"] == "2" and os.environ["WORLD_SIZE"] == "4"
