"""Optimizer state survives resharding: lbp on 8 ranks -> zero2 on 4 -> lbp on 8, by value.

One uninterrupted lbp run (A) saves a distributed checkpoint after step 2 and
trains on to step 5. Run B (zero2, 4 ranks) loads it, saves it again under its
own hierarchy and trains steps 2-4; run C (lbp, 8 ranks) loads B's checkpoint
and trains steps 2-4 too. At each load, the
whole fp32 master weights, exp_avg and exp_avg_sq, gathered per parameter,
must equal the saved ones bit for bit; after three more steps the losses,
gradient norms and gathered state must match the uninterrupted run's to fp32
rounding (the world sizes sum in different orders). A last case loads with a
permuted Adam state and shows that both checks catch it.

The first loss after a load is a pure forward pass, so it sees the weights
only: it is the steps after it and the state comparison that see the moments.
"""
import pytest

from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
from megatron_lbp.testing.optimizer_state import gather_optimizer_state, state_differences
from megatron_lbp.testing.tiny_gpt import setup_hier
from tests.engine.test_engine_checkpoint import LBP8, SPEC, _state, _train

ZERO2 = ["--hier-preset", "zero2"]
TOPO8 = rank_location_env(4)
# Losses, gradient norms and state after 3 steps on another world size (the same
# global batch of 16 sequences, see _train), summation order only: measured, losses
# equal, gradient norms 1.4e-8 relative, master weights ~1e-7 absolute (the attention
# key bias, see state_differences). A permuted moment fails at once
# (test_a_permuted_adam_state_fails_both_checks).
AFTER_RESHARD_REL = 2e-6


def _permute_adam_state_after_load(checkpoint_module):
    """Test-only fault: the loaded moments land one element off (a shifted piece)."""
    original = checkpoint_module.load_optimizer_pieces

    def shifted(opt, state_dict):
        original(opt, state_dict)
        for st in opt.states:
            st.exp_avg.copy_(st.exp_avg.roll(1))
            st.exp_avg_sq.copy_(st.exp_avg_sq.roll(1))

    checkpoint_module.load_optimizer_pieces = shifted


def reshard_leg(argv, world, start, stop, load_from=None, save_to=None, save_at=None,
                record_at=(), fault=None):
    """Train steps [start, stop) under ``argv``; optionally load first and save after ``save_at`` steps.

    Returns (on rank 0) the losses and gradient norms per step and the gathered
    optimizer state right after the load ("loaded") and after each step count in
    ``record_at``, ``save_at`` and ``stop`` ("state").
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_lbp.engine import checkpoint

    if fault == "permuted_adam_state":
        _permute_adam_state_after_load(checkpoint)
    trainer = setup_hier(SPEC, _train(world), argv)
    out = {"state": {}}
    if load_from is not None:
        loaded = dist_checkpointing.load(_state(trainer, is_loading=True), load_from)
        trainer.model.load_state_dict(loaded["model"])
        trainer.optimizer.load_state_dict(loaded["optimizer"])
        out["loaded"] = gather_optimizer_state(trainer.optimizer)
    result, done = None, start
    for boundary in sorted({*record_at, *([save_at] if save_at else []), stop}):
        result = trainer.run(range(done, boundary), result=result)
        done = boundary
        out["state"][boundary] = gather_optimizer_state(trainer.optimizer)
        if boundary == save_at:
            dist_checkpointing.save(_state(trainer), save_to)
            dist.barrier()
    out.update(losses=dict(zip(range(start, stop), result.losses)),
               grad_norms=dict(zip(range(start, stop), result.grad_norms)))
    return out if dist.get_rank() == 0 else None


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def training_differences(got, want, steps, tol):
    """Lines naming each step whose loss or gradient norm differs from ``want`` by more than ``tol``."""
    lines = []
    for s in steps:
        for what in ("losses", "grad_norms"):
            a, b = got[what][s], want[what][s]
            if rel(a, b) > tol:
                lines.append(f"step {s}: {what[:-1]} {a!r} vs uninterrupted {b!r} "
                             f"({rel(a, b):.3g} relative > {tol:g})")
    return lines


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Run A: lbp on 8 ranks, checkpoint after step 2, on to step 5; state recorded at 2 and 5."""
    root = tmp_path_factory.mktemp("reshard")
    (root / "a").mkdir()
    a = run_on_ranks(reshard_leg, 8, LBP8, 8, 0, 5, save_to=str(root / "a"), save_at=2,
                     rank_env=TOPO8)[0]
    return root, a


@pytest.mark.slow
def test_optimizer_state_moves_between_hierarchies_and_world_sizes(uninterrupted):
    """B: zero2/4 loads A's checkpoint, saves it again at once, trains steps 2-4.
    C: lbp/8 loads B's checkpoint (two reshardings away from A's) and trains steps 2-4."""
    root, a = uninterrupted
    (root / "b").mkdir()
    b = run_on_ranks(reshard_leg, 4, ZERO2, 4, 2, 5, load_from=str(root / "a"),
                     save_to=str(root / "b"), save_at=2)[0]
    c = run_on_ranks(reshard_leg, 8, LBP8, 8, 2, 5, load_from=str(root / "b"), rank_env=TOPO8)[0]
    problems = [f"lbp/8 -> zero2/4, right after the load: {d}"
                for d in state_differences(b["loaded"], a["state"][2])]
    problems += [f"zero2/4, steps 2-4 after the load: {d}"
                 for d in training_differences(b, a, range(2, 5), AFTER_RESHARD_REL)]
    problems += [f"zero2/4 state after step 4: {d}"
                 for d in state_differences(b["state"][5], a["state"][5], AFTER_RESHARD_REL)]
    problems += [f"lbp/8 -> zero2/4 -> lbp/8, right after the load: {d}"
                 for d in state_differences(c["loaded"], a["state"][2])]
    problems += [f"lbp/8 again, steps 2-4 after the load: {d}"
                 for d in training_differences(c, a, range(2, 5), AFTER_RESHARD_REL)]
    problems += [f"lbp/8 again, state after step 4: {d}"
                 for d in state_differences(c["state"][5], a["state"][5], AFTER_RESHARD_REL)]
    assert not problems, "\n".join(problems)
    print("worst relative gap to the uninterrupted run:",
          {k: max(rel(leg[k][s], a[k][s]) for leg in (b, c) for s in range(2, 5))
           for k in ("losses", "grad_norms")})


def test_a_permuted_adam_state_fails_both_checks(uninterrupted):
    """Test of the test: moments loaded one element off are caught by the state check
    right after the load and by the losses / gradient norms of the steps after it."""
    root, a = uninterrupted
    b = run_on_ranks(reshard_leg, 4, ZERO2, 4, 2, 4, load_from=str(root / "a"),
                     fault="permuted_adam_state")[0]
    at_load = state_differences(b["loaded"], a["state"][2])
    assert any(d.startswith("exp_avg of") for d in at_load) and \
        any(d.startswith("exp_avg_sq of") for d in at_load), at_load
    assert not any(d.startswith("fp32_param") for d in at_load), at_load
    # Step 2's loss and gradient norm come before the first update from the moments.
    after = training_differences(b, a, range(3, 4), AFTER_RESHARD_REL)
    assert after, f"3 steps on a permuted Adam state trained like the real one: {b['losses']}"
