"""worker/node/run_directory.py on a real filesystem: a run leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierstack.errors import ConfigError
from tierstack.worker.node.run_directory import MARKER, run_directory


def test_the_run_directory_and_the_parents_it_made_are_removed(tmp_path):
    base = tmp_path / "tierstack" / "train-nvme"
    with run_directory(base) as run_dir:
        (tmp_path / "tierstack" / "train-nvme" / run_dir.rsplit("/", 1)[1] / "pool.0").write_bytes(b"x")
        assert base.is_dir()
    assert list(tmp_path.iterdir()) == []


def test_a_parent_that_was_there_or_holds_another_run_stays(tmp_path):
    base = tmp_path / "shared"
    base.mkdir()
    with run_directory(base, "one"):
        pass
    assert base.is_dir() and list(base.iterdir()) == []

    fresh = tmp_path / "fresh" / "nvme"
    with run_directory(fresh, "first"):
        with run_directory(fresh, "second") as second:
            pass
        assert not (fresh / "second").exists()
        assert sorted(p.name for p in fresh.iterdir()) == [MARKER, "first"], second
    # The first run made the parents; the second found them: the first removes them.
    assert not (tmp_path / "fresh").exists()


def test_an_error_inside_still_removes_it(tmp_path):
    with pytest.raises(RuntimeError):
        with run_directory(tmp_path / "a", "run"):
            raise RuntimeError("the job failed")
    assert list(tmp_path.iterdir()) == []


def test_a_file_as_the_base_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"--nvme-path .*file is a file, not a directory"):
        with run_directory(tmp_path / "file"):
            pass
    with pytest.raises(ConfigError, match=r"tier_manager.nvme_pool.paths .*: cannot create"):
        with run_directory(tmp_path / "file" / "below", setting="tier_manager.nvme_pool.paths"):
            pass
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_runs_at_once_share_the_parents_and_the_last_one_out_removes_them(tmp_path):
    """The ranks of a partitioned job on one machine: rank 0 makes the parents and ends
    first; rank 1 found them there and ends last."""
    base = tmp_path / "tierstack" / "partitioned"
    first = run_directory(base, "rank0")
    first.__enter__()
    with run_directory(base, "rank1"):
        first.__exit__(None, None, None)
        assert sorted(p.name for p in base.iterdir()) == [MARKER, "rank1"]
    assert list(tmp_path.iterdir()) == []


def test_a_base_with_the_users_files_keeps_them(tmp_path):
    base = tmp_path / "made"
    with run_directory(base, "run"):
        (base / "notes.txt").write_text("mine")
    assert sorted(p.name for p in base.iterdir()) == [MARKER, "notes.txt"]


def test_runs_under_two_bases_in_one_new_parent_leave_nothing_whichever_ends_first(tmp_path):
    """`tierstack train --ranks` at /var/tmp/tierstack/train-nvme beside a rank's embedded
    node at /var/tmp/tierstack/partitioned: the first run made the shared parent."""
    parent = tmp_path / "tierstack"
    first = run_directory(parent / "train-nvme")
    first.__enter__()
    with run_directory(parent / "partitioned"):
        pass
    assert sorted(p.name for p in parent.iterdir()) == [MARKER, "train-nvme"]
    first.__exit__(None, None, None)
    assert list(tmp_path.iterdir()) == []


def test_a_killed_runs_directories_are_reported_by_doctor_and_removed_by_jobs_clean(tmp_path):
    """SIGKILL gives a run no chance to clean up: its directory stays, the run index names
    it, `tierstack doctor` reports it (path, size, age) and `tierstack jobs --clean`
    removes it; a live run's directory is never touched."""
    import json
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    # Python raises KeyboardInterrupt on SIGINT only where SIGINT was not ignored at its
    # start, and a background job of a non-interactive shell (nohup ... &) starts with it
    # ignored (POSIX): the child puts Python's handler back so the SIGINT below ends it.
    script = ("import signal, sys, time\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "from tierstack.worker.node.run_directory import job_directories\n"
              "with job_directories([sys.argv[1]], sys.argv[2]) as (d,):\n"
              "    open(d + '/data', 'wb').write(b'x' * 1048576)\n"
              "    print(d, flush=True)\n"
              "    time.sleep(600)\n")
    runs = {}
    for job in ("dead-job", "live-job"):
        proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "base"), job],
                                stdout=subprocess.PIPE, text=True, env=env)
        runs[job] = (proc, proc.stdout.readline().strip())
    dead, live = runs["dead-job"], runs["live-job"]
    try:
        os.kill(dead[0].pid, signal.SIGKILL)
        dead[0].wait()
        doctor = subprocess.run([sys.executable, "-m", "tierstack.cli", "doctor", "--quick"],
                                capture_output=True, text=True, env=env, timeout=120)
        line = next(l for l in doctor.stdout.splitlines() if "runs left behind" in l)
        assert "job dead-job" in line and dead[1] in line and "live-job" not in line
        assert "tierstack jobs --clean" in doctor.stdout
        clean = subprocess.run([sys.executable, "-m", "tierstack.cli", "jobs", "--clean"],
                               capture_output=True, text=True, env=env, timeout=60)
        assert clean.returncode == 0 and f"removed {dead[1]}" in clean.stdout, clean.stderr
        assert not Path(dead[1]).exists() and Path(live[1]).exists()
        index = list((tmp_path / "state" / "tierstack" / "runs").glob("*.json"))
        assert [json.loads(p.read_text())["job"] for p in index] == ["live-job"]
    finally:
        live[0].send_signal(signal.SIGINT)  # the with block ends: the live run cleans up
        live[0].wait(timeout=30)
    assert not Path(live[1]).exists()
