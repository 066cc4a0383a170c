"""A job's own directory under a base path (its NVMe pool's files, its manifest): made
fresh for the run and removed after it, with the parents the run had to create, so a job
at a default path (/var/tmp/tierstack/...) leaves nothing behind on the user's disk.

Runs at once under one base (the ranks of a partitioned job on one machine) share the
parents: the run that made them leaves a marker in the base naming the topmost one it
made, and whichever run ends last, finding the base empty but for the marker, removes
them. A base that was there before, or holds anything else, stays."""

from __future__ import annotations

import contextlib
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from tierstack.errors import ConfigError

MARKER = ".made-by-tierstack"
"""In a base a run made: the topmost directory it made (the base or one of its parents)."""


@contextlib.contextmanager
def run_directory(base: str | Path, name: str = "", setting: str = "--nvme-path") -> Iterator[str]:
    """`base`/`name` (a fresh random name by default), created and checked writable, for
    the `with` block; `setting` is what the user set `base` with, for the error."""
    base = Path(base)
    if base.exists() and not base.is_dir():
        raise ConfigError(f"{setting} {base} is a file, not a directory; give a directory "
                          f"(on an NVMe drive for speed), created if missing")
    made = [p for p in (base, *base.parents) if not p.exists()]  # the deepest first
    run_dir = base / (name or uuid.uuid4().hex[:8])
    try:
        run_dir.mkdir(parents=True)
        if made:
            (base / MARKER).write_text(str(made[-1]))
        probe = run_dir / ".write-test"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        _remove(run_dir, base)
        raise ConfigError(f"{setting} {base}: cannot create and write a directory there "
                          f"({e.strerror}); give a writable directory (on an NVMe drive for speed)") from None
    try:
        yield str(run_dir)
    finally:
        _remove(run_dir, base)


def _remove(run_dir: Path, base: Path) -> None:
    """The run's directory, then the parents a run made once no other run uses them."""
    shutil.rmtree(run_dir, ignore_errors=True)
    marker = base / MARKER
    try:
        if {p.name for p in base.iterdir()} != {MARKER}:
            return  # another run's directory is in it, or the user's files, or no marker
        top = Path(marker.read_text())
        marker.unlink()
    except OSError:
        return  # another run that ended at the same moment is removing them
    if top != base and top not in base.parents:
        return  # not a marker this module wrote for this base
    for parent in (base, *base.parents):
        try:
            parent.rmdir()
        except OSError:
            return  # not empty: another run started in it meanwhile, or the user's files
        if parent == top:
            return
