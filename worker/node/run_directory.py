"""A job's own directory under a base path (its NVMe pool's files, its manifest): made
fresh for the run, named after its job, and removed after it, with the parents the run
had to create, so a job at the default root (/var/tmp/tierstack-<uid>/nvme) leaves nothing behind
on the user's disk.

A run that cannot clean up (SIGKILL, a lost machine) leaves its directories: each run is
in the user's run index (tierstack/run_index.py) until they are removed, so `tierstack
doctor` reports what a dead run left and `tierstack jobs --clean` removes it.

Runs at once (the ranks of a partitioned job on one machine, or jobs under different
bases in one parent) share the parents: each directory a run makes gets a marker, and
whichever run ends last, finding a marked directory empty but for its marker, removes
it and goes on up. A directory that was there before, or holds anything else, stays."""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from tierstack.errors import ConfigError
from tierstack.run_index import (MARKER, RunRecord, new_index_file, remove_run_directory,
                                 write_record)


@contextlib.contextmanager
def run_directory(base: str | Path, name: str = "", setting: str = "--nvme-path") -> Iterator[str]:
    """`base`/`name` (the job's name; a fresh random one by default), created and checked
    writable and recorded in the run index, for the `with` block; `setting` is what the
    user set `base` with, for the error."""
    with job_directories([base], name, setting) as (run_dir,):
        yield run_dir


@contextlib.contextmanager
def job_directories(bases: list[str | Path], job: str = "",
                    setting: str | list[str] = "nvme_pool.paths") -> Iterator[list[str]]:
    """One directory named `job` under each of `bases` (a job's NVMe pool striped over
    several drives), made and recorded as one run; all removed after the `with` block.
    `setting`: how the user named the bases (one name, or one per base), for the error."""
    job = job or uuid.uuid4().hex[:8]
    settings = [setting] * len(bases) if isinstance(setting, str) else setting
    record = RunRecord(job, os.getpid(), socket.gethostname(), time.time(), [])
    index = new_index_file(record)
    try:
        with contextlib.ExitStack() as stack:
            for base, named in zip(bases, settings, strict=True):
                record.directories.append(stack.enter_context(_one_directory(Path(base), job, named)))
                write_record(index, record)
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
        remove_run_directory(run_dir, base)
        raise ConfigError(f"{setting} {base}: cannot create and write a directory there "
                          f"({e.strerror}); give a writable directory (on an NVMe drive for speed)") from None
    try:
        yield str(run_dir)
    finally:
        remove_run_directory(run_dir, base)
