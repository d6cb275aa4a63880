"""The install script is idempotent: once set up, it does nothing and says nothing."""
import pathlib
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_second_install_is_a_no_op():
    # The suite itself runs after scripts/install.sh --test, so the venv is complete.
    for mode in (["--test"], []):
        out = subprocess.run(["bash", str(REPO / "scripts" / "install.sh"), *mode],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout == "" and out.stderr == "", (
            f"install.sh {' '.join(mode)} did work on a complete .venv:\n{out.stdout}{out.stderr}")


def test_install_rejects_unknown_argument():
    out = subprocess.run(["bash", str(REPO / "scripts" / "install.sh"), "--tset"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown argument '--tset'" in out.stderr, out.stderr
