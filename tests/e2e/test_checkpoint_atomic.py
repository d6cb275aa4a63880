"""A job killed (SIGKILL to every process, as a node failure or scancel) while it writes a checkpoint.

Megatron writes a torch_dist checkpoint into iter_NNNNNNN/ (shards, DCP's
.metadata, then metadata.json), waits on a barrier, and only then has rank 0
rewrite latest_checkpointed_iteration.txt, the tracker a restart loads from.
A checkpoint is only ever found through the tracker, so a torn iter_ dir is
harmless as long as the tracker write itself cannot tear: stock Megatron
truncates and rewrites it in place; megatron-lbp's hook (training_hooks,
``checkpoint_guard.AtomicTrackerFile``) writes a temporary file, fsyncs it and the checkpoint's
metadata, and renames it over the old one.

The test-only hook LBP_TEST_STALL_SAVE=ITER:POINT holds rank 0 inside the save
(``shards``: shards written, metadata.json not; ``tracker``: checkpoint complete,
new tracker written to a temporary file, not yet renamed) so the kill lands in
the window every time. Losses come from LBP_LOSS_LOG at full precision:
Megatron's printed loss is rounded and, after a resume, averaged over two
iterations (its accumulator is not reset), so it cannot show bit-identity.
"""
import pytest

from tests.helpers import reliability_helpers as rh
from tests.helpers.pretrain_runner import TINY

SAVE_EVERY, ITERS, KILL_AT = 2, 6, 4


@pytest.fixture(scope="module")
def data(demo_dataset):
    return demo_dataset


def _args(data, save, *extra, gbs=4):
    # --load of the same directory: a resubmitted job resumes from whatever the tracker names.
    return TINY + ["--data-path", data, "--train-iters", str(ITERS), "--global-batch-size", str(gbs),
                   "--hier-partition", "--ckpt-format", "torch_dist", "--save", str(save),
                   "--load", str(save), "--save-interval", str(SAVE_EVERY), *extra]


def _kill_during_save(nproc, args, point, tmp):
    """Run until rank 0 stalls at POINT of iteration KILL_AT's save, then kill the whole job."""
    log = tmp / f"killed_{point}.log"
    proc = rh.start(nproc, args, log, env={"LBP_LOSS_LOG": str(tmp / f"killed_{point}.loss"),
                                           "LBP_TEST_STALL_SAVE": f"{KILL_AT}:{point}"})
    rh.wait_for(proc, log, f"test stall: {point} of iteration {KILL_AT}", timeout=900)
    rh.kill_tree(proc)
    return rh.losses(tmp / f"killed_{point}.loss")


def _check_left_behind(save, point):
    """The tracker still names the previous checkpoint, which is complete; the torn one is not named."""
    assert rh.tracker(save) == str(KILL_AT - SAVE_EVERY), \
        f"tracker reads {rh.tracker(save)!r} after a kill during iteration {KILL_AT}'s save"
    previous = save / f"iter_{KILL_AT - SAVE_EVERY:07d}"
    assert (previous / "metadata.json").is_file() and (previous / ".metadata").is_file(), \
        sorted(p.name for p in previous.iterdir())
    torn = save / f"iter_{KILL_AT:07d}"
    has_meta = (torn / "metadata.json").is_file()
    assert has_meta == (point == "tracker"), \
        f"{point}: metadata.json of iteration {KILL_AT} {'exists' if has_meta else 'missing'}"
    if point == "tracker":
        assert any(p.name.startswith(rh.TRACKER + ".tmp.") for p in save.iterdir()), \
            "the kill did not land between the temporary tracker and its rename"


def _resume(nproc, args, tmp, point):
    log = tmp / f"resumed_{point}.log"
    text = rh.finish(rh.start(nproc, args, log, env={"LBP_LOSS_LOG": str(tmp / f"resumed_{point}.loss")}),
                     log)
    assert f"loading distributed checkpoint from" in text and f"at iteration {KILL_AT - SAVE_EVERY}" in text, \
        "\n".join(l for l in text.splitlines() if "checkpoint" in l)
    return rh.losses(tmp / f"resumed_{point}.loss")


@pytest.mark.slow
def test_kill_before_the_tracker_rename_resumes_from_the_previous_checkpoint(data, tmp_path):
    """2 ranks (one node); the resumed run repeats iterations 3-4 bit for bit and completes the job.

    Covered in CI by the 4-rank tracker case, which checks this and more."""
    save = tmp_path / "ckpt"
    args = _args(data, save, "--hier-gpus-per-node", "2")
    killed = _kill_during_save(2, args, "tracker", tmp_path)
    assert sorted(killed) == list(range(1, KILL_AT + 1)), killed
    _check_left_behind(save, "tracker")
    resumed = _resume(2, args, tmp_path, "tracker")
    assert sorted(resumed) == list(range(KILL_AT - SAVE_EVERY + 1, ITERS + 1)), resumed
    redone = {i: (killed[i], resumed[i]) for i in range(KILL_AT - SAVE_EVERY + 1, KILL_AT + 1)}
    assert all(a == b for a, b in redone.values()), f"killed vs resumed losses: {redone}"
    assert rh.tracker(save) == str(ITERS)


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """The same job on 4 ranks (2 emulated nodes) without a kill: losses and checkpoints."""
    tmp = tmp_path_factory.mktemp("reference")
    save = tmp / "ckpt"
    log = tmp / "run.log"
    rh.finish(rh.start(4, _args(data, save, "--hier-gpus-per-node", "2", gbs=8), log,
                       env={"LBP_LOSS_LOG": str(tmp / "run.loss")}), log)
    return rh.losses(tmp / "run.loss"), save


@pytest.mark.parametrize("point", [pytest.param("shards", marks=pytest.mark.slow), "tracker"])
def test_kill_during_save_on_4_ranks_matches_an_uninterrupted_run(data, reference, point, tmp_path):
    """Resumed losses and the final (and rewritten) checkpoints equal the uninterrupted run's, bit for bit.

    CI form: the kill between the new tracker's temporary file and its rename,
    on 2 emulated nodes (P=2, G=2, O=4); the kill with shards written and no
    metadata is slow-only (its torn directory is never named by the tracker
    either, which the tracker case's left-behind check also shows).
    """
    straight, straight_save = reference
    assert sorted(straight) == list(range(1, ITERS + 1)), straight
    save = tmp_path / "ckpt"
    args = _args(data, save, "--hier-gpus-per-node", "2", gbs=8)
    killed = _kill_during_save(4, args, point, tmp_path)
    _check_left_behind(save, point)
    resumed = _resume(4, args, tmp_path, point)
    everything = {**killed, **resumed}
    differ = {i: (everything.get(i), straight[i]) for i in straight if everything.get(i) != straight[i]}
    assert not differ, f"iterations whose loss differs (killed/resumed, uninterrupted): {differ}"
    for step in (KILL_AT, ITERS):
        name = f"iter_{step:07d}"
        diffs = rh.tensor_differences(rh.checkpoint_tensors(save / name, tmp_path),
                                      rh.checkpoint_tensors(straight_save / name, tmp_path))
        assert not diffs, f"{name} differs from the uninterrupted run's:\n" + "\n".join(diffs[:20])
    assert rh.tracker(save) == str(ITERS)


@pytest.mark.slow
def test_resubmitting_a_finished_job_does_not_rewrite_its_checkpoint(data, tmp_path):
    """Megatron's end-of-training save would write the loaded iteration into its own directory again."""
    save = tmp_path / "ckpt"
    args = _args(data, save, "--hier-gpus-per-node", "2", "--save-interval", "4")  # saves 4, then 6 at the end
    first = tmp_path / "first.log"
    rh.finish(rh.start(2, args, first), first)
    assert rh.tracker(save) == str(ITERS)
    final = save / f"iter_{ITERS:07d}"
    before = {p.name: p.stat().st_mtime_ns for p in final.iterdir()}
    again = tmp_path / "again.log"
    # Were the save to happen, it would stall here and the run would time out.
    proc = rh.start(2, args, again, env={"LBP_TEST_STALL_SAVE": f"{ITERS}:shards"})
    text = rh.finish(proc, again, timeout=300)
    assert f"not saving iteration {ITERS} again" in text, "\n".join(text.splitlines()[-20:])
    assert {p.name: p.stat().st_mtime_ns for p in final.iterdir()} == before, "the checkpoint was rewritten"
    assert rh.tracker(save) == str(ITERS)
