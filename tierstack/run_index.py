"""The user's run index: every directory a run made, until the run removes it.

A run (`tierstack train`, `tierstack.initialize`) makes directories for its NVMe pool
(worker/node/run_directory.py) and removes them when it ends. One that cannot (SIGKILL, an
OOM kill, a lost machine) leaves them, and they can be large: each run is recorded here,
one small JSON file per run (job, pid, host, start, directories) under `runs_dir()`, so
`tierstack doctor` reports what dead runs left (path, size, age) and `tierstack jobs
--clean` removes it. No torch, no room imported: the doctor and the CLI read it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from tierstack.errors import ConfigError

MARKER = ".made-by-tierstack"
"""In each directory a run made (the base and the parents it had to create)."""


def remove_run_directory(run_dir: Path, base: Path) -> None:
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

    def describe(self, now: float) -> str:
        """One line for a person: job, pid, age, directories and the bytes they hold."""
        return (f"job {self.job} (pid {self.pid}, {_age(now - self.started)} ago): "
                f"{', '.join(self.directories)}, {self.nbytes() / (1 << 30):.2f} GiB")

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


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def runs_dir() -> Path:
    """The user's run index: $XDG_STATE_HOME/tierstack/runs (~/.local/state/... by default),
    which outlives /tmp's cleaning, as the runs' NVMe directories do."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(state) / "tierstack" / "runs"


def new_index_file(record: RunRecord) -> Path:
    return runs_dir() / f"{record.job}-{record.pid}-{uuid.uuid4().hex[:6]}.json"


def write_record(path: Path, record: RunRecord) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_suffix(".writing")
    staged.write_text(json.dumps(asdict(record)))
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
        remove_run_directory(Path(directory), Path(directory).parent)
    index.unlink(missing_ok=True)
