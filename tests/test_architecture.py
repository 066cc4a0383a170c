"""The house's arrows, kept by a tool: import-linter's contracts in pyproject.toml.

import-linter reads a package from the file system, so the check runs on a mirror of
the package as it installs (tierstack/, with services/, worker/, ... inside it, as
pyproject.toml's package-dir maps them). Every module of a service must be named in
the contracts as face or internal, so a new module cannot slip past them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
FACES_CONTRACT = "A service's face imports none of its daemon code"
SHARED_CONTRACT = "The shared modules of tierstack/ import no room"
DEEPSPEED_CONTRACT = "The DeepSpeed-named modules of tierstack/ import only the worker's doors"
SERVICES = ("tier_manager", "scheduler")


def _contract(name: str) -> dict:
    (contract,) = [c for c in PYPROJECT["tool"]["importlinter"]["contracts"] if c["name"] == name]
    return contract


def _package_dirs() -> dict[str, Path]:
    """Each installed package -> the directory its modules come from."""
    setup = PYPROJECT["tool"]["setuptools"]
    dirs = setup["package-dir"]
    out = {}
    for package in setup["packages"]:
        parts = package.split(".")
        prefix = next(".".join(parts[:i]) for i in range(len(parts), 0, -1)
                      if ".".join(parts[:i]) in dirs)
        out[package] = ROOT / dirs[prefix] / Path(*parts[len(prefix.split(".")):])
    return out


def _mirror(out: Path) -> None:
    """Copy the package's modules into `out` in their installed layout."""
    for package, source in _package_dirs().items():
        target = out / Path(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for module in source.glob("*.py"):
            shutil.copy(module, target / module.name)


def _modules(directory: Path, package: str) -> set[str]:
    return {f"{package}.{p.stem}" for p in directory.glob("*.py") if p.stem != "__init__"}


def test_import_contracts_are_kept(tmp_path):
    _mirror(tmp_path)
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), str(ROOT / "pyproject.toml")], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("service", SERVICES)
def test_every_module_of_a_service_is_named_face_or_internal(service):
    package = f"tierstack.services.{service}"
    contract = _contract(FACES_CONTRACT)
    faces = {m for m in contract["source_modules"] if m.startswith(package + ".")}
    internals = {m for m in contract["forbidden_modules"] if m.startswith(package + ".")}
    assert not faces & internals
    assert faces | internals == _modules(ROOT / "services" / service, package), (
        f"list each module of services/{service}/ in pyproject.toml's contract "
        f"{FACES_CONTRACT!r}: as a source (face) or as forbidden (internal)")
    # The contract that keeps others out of the service forbids exactly its internals.
    (outside,) = [c for c in PYPROJECT["tool"]["importlinter"]["contracts"]
                  if c["name"].startswith("Outside the") and
                  all(m.startswith(package + ".") for m in c["forbidden_modules"])]
    assert set(outside["forbidden_modules"]) == internals


def _tierstack_modules() -> set[str]:
    """Every module of tierstack/ itself, its subpackages included (tierstack.ops,
    tierstack.utils: DeepSpeed's module paths), but not the package's own __init__
    (tierstack.initialize's lazy door)."""
    out = set()
    for path in (ROOT / "tierstack").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) > 1:
            out.add(".".join(parts))
    return out


def test_every_module_of_tierstack_is_shared_or_reaches_only_the_workers_doors():
    """Each module and subpackage of tierstack/ is in one contract: shared (it imports no
    room) or DeepSpeed-named (it may import the worker's doors, tierstack.worker.api)."""
    shared = set(_contract(SHARED_CONTRACT)["source_modules"])
    doors = set(_contract(DEEPSPEED_CONTRACT)["source_modules"])
    assert not shared & doors
    assert shared | doors == _tierstack_modules()
    # The worker's rooms other than the doors are all forbidden to the DeepSpeed-named ones.
    forbidden = set(_contract(DEEPSPEED_CONTRACT)["forbidden_modules"])
    rooms = {f"tierstack.worker.{p.stem}" for p in (ROOT / "worker").glob("*.py") if p.stem != "__init__"}
    rooms |= {f"tierstack.worker.{p.parent.name}" for p in (ROOT / "worker").glob("*/__init__.py")}
    assert forbidden >= rooms - {"tierstack.worker.api"}


def test_every_module_imports():
    """Modules that run only inside a daemon or on a Ray node import cleanly too."""
    import importlib

    names = [name for package, source in _package_dirs().items()
             for name in sorted(_modules(source, package)) if not name.endswith(("_pb2", "_pb2_grpc"))]
    failures = {}
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - every failure is listed below
            failures[name] = repr(e)
    assert len(names) > 50 and not failures, failures
