"""A base install (`pip install .`, no extras): its commands run, and one that needs an extra
says in one line which `pip install` brings it. The extras' modules are hidden from a real
`tierstack` process here, as if they had never been installed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tierstack.extras import EXTRAS

ROOT = Path(__file__).resolve().parent.parent

# Run as `python -c HIDE_EXTRAS args...`: the CLI with every extra's module not importable.
HIDE_EXTRAS = f"""
import importlib.abc, importlib.util, sys
HIDDEN = {sorted({m for modules in EXTRAS.values() for m in modules} | {"yaml"})!r}
class Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: (
    None if name.split(".")[0] in HIDDEN else find_spec(name, package))
sys.meta_path.insert(0, Hidden())
if sys.argv[1] == "import":
    import tierstack.worker.hf_trainer
else:
    from tierstack.cli import main
    sys.exit(main(sys.argv[1:]))
"""


def _base_install(tmp_path, *argv):
    return subprocess.run([sys.executable, "-c", HIDE_EXTRAS, *argv], capture_output=True,
                          text=True, timeout=180, cwd=tmp_path,
                          env={**os.environ, "TIERSTACK_TIER_MANAGER": f"unix:{tmp_path}/none.sock"})


def test_each_extra_is_the_packages_that_bring_its_modules():
    """pyproject.toml's extras and tierstack/extras.py name the same packages."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        packages = [re.split(r"[<>=!~\[ ]", requirement)[0] for requirement in extras[extra]]
        assert packages == list(modules), extra
    assert "tierstack[hf,cluster]" in extras["test"]


@pytest.mark.parametrize("argv, extra", [
    (["train", "--ranks", "2", "--steps", "1", "--layers", "1", "--dim", "16", "--heads", "2",
      "--seq-len", "8"], "cluster"),
    (["ray-node", "--make-secrets", "secrets"], "cluster"),
    (["local-cluster", "up"], "cluster"),
    (["import"], "hf"),
])
def test_a_command_that_needs_a_missing_extra_names_it_in_one_line(tmp_path, argv, extra):
    out = _base_install(tmp_path, *argv)
    assert out.returncode != 0
    assert f"pip install 'tierstack[{extra}]'" in out.stderr, out.stderr[-3000:]
    if argv != ["import"]:  # the CLI: its one line, no traceback
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert out.stderr.strip().splitlines()[-1].startswith("tierstack: ")
    assert not (tmp_path / "secrets").exists()


def test_the_base_install_runs_its_own_commands(tmp_path):
    for argv in (["--help"], ["launch", "--help"], ["jobs"]):
        out = _base_install(tmp_path, *argv)
        assert out.returncode == 0, (argv, out.stderr[-3000:])
