"""A job's own directory under a base path (its NVMe pool's files, its manifest): made
fresh for the run, named after its job, and removed after it, with the parents the run
had to create, so a job at a default path (/var/tmp/tierstack/...) leaves nothing behind
on the user's disk.

A run that cannot clean up (SIGKILL, a lost machine) leaves its directory: each one is
recorded in the user's run index (`runs_dir()`, one small JSON file per run: job, pid,
host, start, directories) until it is removed, so `tierstack doctor` reports the state a
dead run left (path, size, age) and `tierstack jobs --clean` removes it.

Runs at once (the ranks of a partitioned job on one machine, or jobs under different
bases in one parent) share the parents: each directory a run makes gets a marker, and
whichever run ends last, finding a marked directory empty but for its marker, removes
it and goes on up. A directory that was there before, or holds anything else, stays."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tierstack.errors import ConfigError

MARKER = ".made-by-tierstack"
"""In each directory a run made (the base and the parents it had to create)."""


@contextlib.contextmanager
def run_directory(base: str | Path, name: str = "", setting: str = "--nvme-path") -> Iterator[str]:
    """`base`/`name` (the job's name; a fresh random one by default), created and checked
    writable and recorded in the run index, for the `with` block; `setting` is what the
    user set `base` with, for the error."""
    with job_directories([base], name, setting) as (run_dir,):
        yield run_dir


@contextlib.contextmanager
def job_directories(bases: list[str | Path], job: str = "", setting: str = "nvme_pool.paths"
                    ) -> Iterator[list[str]]:
    """One directory named `job` under each of `bases` (a job's NVMe pool striped over
    several drives), made and recorded as one run; all removed after the `with` block."""
    job = job or uuid.uuid4().hex[:8]
    record = RunRecord(job, os.getpid(), socket.gethostname(), time.time(), [])
    index = _index_file(record)
    try:
        with contextlib.ExitStack() as stack:
            for base in bases:
                record.directories.append(stack.enter_context(_one_directory(Path(base), job, setting)))
                _write_record(index, record)
            yield list(record.directories)
    finally:
        index.unlink(missing_ok=True)


@contextlib.contextmanager
def _one_directory(base: Path, name: str, setting: str) -> Iterator[str]:
    if base.exists() and not base.is_dir():
        raise ConfigError(f"{setting} {base} is a file, not a directory; give a directory "
                          f"(on an NVMe drive for speed), created if missing")
    run_dir = base / name
    if run_dir.exists():
        raise ConfigError(f"{setting} {base}: {run_dir} exists already (a run of job {name!r} is "
                          f"going on, or one was killed: `tierstack jobs --clean` removes what dead "
                          f"runs left); give the job another name")
    made = [p for p in (base, *base.parents) if not p.exists()]  # the deepest first
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


# ---- the run index: what each live (or dead) run made ---------------------------------


@dataclass
class RunRecord:
    """One run's directories, as the run index keeps them."""

    job: str
    pid: int
    host: str
    started: float
    """Unix seconds."""
    directories: list[str]

    def alive(self) -> bool:
        """Whether the run's process still runs (a run on another host counts as alive:
        it cannot be checked from here)."""
        if self.host != socket.gethostname():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def nbytes(self) -> int:
        """Bytes its directories hold now (what a dead run leaves on the disk)."""
        total = 0
        for directory in self.directories:
            for root, _, files in os.walk(directory):
                for name in files:
                    try:
                        total += os.lstat(os.path.join(root, name)).st_blocks * 512
                    except OSError:
                        pass
        return total


def runs_dir() -> Path:
    """The user's run index: $XDG_STATE_HOME/tierstack/runs (~/.local/state/... by default),
    which outlives /tmp's cleaning, as the runs' NVMe directories do."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(state) / "tierstack" / "runs"


def _index_file(record: RunRecord) -> Path:
    return runs_dir() / f"{record.job}-{record.pid}-{uuid.uuid4().hex[:6]}.json"


def _write_record(path: Path, record: RunRecord) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_suffix(".writing")
    staged.write_text(json.dumps(record.__dict__))
    staged.replace(path)


def recorded_runs() -> list[tuple[Path, RunRecord]]:
    """Every run in the index: (its index file, its record); unreadable files skipped."""
    runs = []
    for path in sorted(runs_dir().glob("*.json")):
        try:
            runs.append((path, RunRecord(**json.loads(path.read_text()))))
        except (OSError, ValueError, TypeError):
            continue
    return runs


def dead_runs() -> list[tuple[Path, RunRecord]]:
    """Runs whose process is gone but whose directories are not (SIGKILL, a crash)."""
    return [(path, r) for path, r in recorded_runs()
            if not r.alive() and any(Path(d).exists() for d in r.directories)]


def remove_dead_run(index: Path, record: RunRecord) -> None:
    """Remove what a dead run left: its directories (and the parents it made), its entry."""
    if record.alive():
        raise ConfigError(f"job {record.job!r} (pid {record.pid}) is still running; stop it first")
    for directory in record.directories:
        _remove(Path(directory), Path(directory).parent)
    index.unlink(missing_ok=True)
