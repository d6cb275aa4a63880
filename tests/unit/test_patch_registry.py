"""Every runtime patch is declared once, with an owner and a reason, on a target the pinned packages have."""
import os
import subprocess
import sys

from megatron_lbp.core import patching


def test_every_patch_target_exists_in_the_installed_megatron_core_and_torch():
    declared = patching.registry()
    owners = {p.owner for p in declared.values()} - {__name__}  # this file's probe below
    assert owners == set(patching.OWNERS), (
        f"owners declaring patches {sorted({p.owner for p in declared.values()})} "
        f"differ from patching.OWNERS {sorted(patching.OWNERS)}")
    missing = [f"{p.name}: {p.target}" for p in declared.values()
               if not p.missing_ok and not patching.target_exists(p)]
    assert not missing, f"patch targets absent from the installed packages: {missing}"
    for p in declared.values():
        assert p.when and p.why and ":" in p.target, f"patch {p.name} lacks when/why/target: {p}"


def test_nothing_outside_the_registry_replaces_a_megatron_or_torch_name():
    """The old idempotence idioms are gone: one marker, set only by patching.apply."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "megatron_lbp")
    old = ("__lbp_wrapped__", "_lbp_hooked", "_lbp_faults", "__lbp_gpt2_bpe__", "_replace_once")
    found = []
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                text = open(path).read()
                found += [f"{os.path.relpath(path, root)}: {o}" for o in old if o in text]
    assert not found, f"old patch idioms left: {found}"


def test_the_test_only_seam_loads_only_when_its_variable_is_set():
    code = ("import os, sys\n"
            "from megatron_lbp.integration import compat, training_hooks; from megatron_lbp.core import patching\n"
            "compat.enable(); compat.enable_training(); training_hooks.install()\n"
            "assert 'megatron_lbp.integration.save_stall' not in sys.modules, 'seam loaded without its variable'\n"
            "os.environ['LBP_TEST_STALL_SAVE'] = '3:tracker'\n"
            "from megatron.training import checkpointing\n"
            "training_hooks.hook_checkpointing_module(dict(vars(checkpointing)))\n"
            "from megatron_lbp.integration import save_stall\n"
            "assert patching.is_applied(save_stall.SAVE_CONFIG), 'seam not installed with its variable'\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "LBP_TEST_STALL_SAVE"}
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_applying_twice_changes_nothing_and_marks_the_replacement():
    calls = []

    def make(orig):
        calls.append(orig)
        return lambda: "patched " + orig()

    # A module namespace as a dict: what a patched Megatron-LM file hands over (its globals()).
    ns = {"f": lambda: "stock"}
    probe = patching.declare(__name__, "test: ns f", "probe:f", "tests", "a probe")
    assert not patching.is_applied(probe, where=ns)
    assert patching.apply(probe, make, where=ns) is True
    assert patching.apply(probe, make, where=ns) is False, "a second apply replaced the target again"
    assert ns["f"]() == "patched stock" and len(calls) == 1, (ns["f"](), calls)
    assert patching.is_applied(probe, where=ns)
