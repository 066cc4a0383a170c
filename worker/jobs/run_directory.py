"""A job's own directory under a base path (its NVMe pool's files, its manifest): made
fresh for the run and removed after it, with the parents the run had to create, so a job
at a default path (/var/tmp/tierstack/...) leaves nothing behind on the user's disk.

Runs at once (the ranks of a partitioned job on one machine, or jobs under different
bases in one parent) share the parents: each directory a run makes gets a marker, and
whichever run ends last, finding a marked directory empty but for its marker, removes
it and goes on up. A directory that was there before, or holds anything else, stays."""

from __future__ import annotations

import contextlib
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from tierstack.errors import ConfigError

MARKER = ".made-by-tierstack"
"""In each directory a run made (the base and the parents it had to create)."""


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
        for directory in made:
            (directory / MARKER).touch()
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
    """The run's directory, then each marked parent no other run or file uses any more."""
    shutil.rmtree(run_dir, ignore_errors=True)
    for directory in (base, *base.parents):
        try:
            if {p.name for p in directory.iterdir()} != {MARKER}:
                return  # another run's directory is in it, or the user's files, or no marker
            (directory / MARKER).unlink()
            directory.rmdir()
        except OSError:
            return  # another run ending at the same moment removes it, or started in it
