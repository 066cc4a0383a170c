"""Shared fixtures: real directories on the ext4 disk, real /dev/shm arenas."""

from __future__ import annotations

import os

# Before anything loads OpenMP (torch does), for this process and every daemon, rank and
# CLI run it starts: OpenMP threads that wait for work sleep instead of spinning. Tests run
# a worker, its daemon and often two ranks on the 2 cores of a CI machine; with spinning
# waiters a torch op that shares its cores with another busy process ran 4-12x slower
# (the fp32 GPT of test_offload: 28 s for 20 plain PyTorch steps beside one busy core,
# 3 s with sleeping waiters). The thread count and the arithmetic stay the same.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tierstack.config import KiB, MiB, CpuPoolConfig, NvmePoolConfig, TierManagerConfig, AioConfig
from tierstack.addresses import user_dir
from tierstack.service_process import ServiceProcess

_USER_DIR_BEFORE: set[str] | None = None


# Tests that time what they run (a plan's predicted step, latencies against the same test's
# baseline, a long run's memory sampled every 100 ms) or start Ray clusters, whose daemons
# want the machine's cores: `make test` runs them alone, after the rest has run on every
# core (pytest-xdist). The marker is `serial`.
SERIAL = ("tests/deploy/test_ray_up.py", "tests/deploy/test_ray_auth.py",
          "tests/deploy/test_two_clusters.py", "tests/worker/test_ray_workers.py",
          "tests/worker/test_plan_band.py", "tests/worker/test_plan_keeper.py",
          "tests/tier_manager/test_no_waiting.py", "tests/test_host_budget.py",
          # the machine's MemTotal - MemAvailable: the other worker's tests freeing memory
          # meanwhile hid 340 MiB of the child's 512 (CI, 172 MiB seen)
          "tests/bench/test_footprint.py::test_the_cross_check_sees_a_childs_allocation")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "serial: runs alone, after the parallel part of make test")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.nodeid.startswith(SERIAL):
            item.add_marker(pytest.mark.serial)


def _xdist_worker(session) -> bool:
    """Whether this process is one of pytest-xdist's workers (the controller cleans up)."""
    return hasattr(session.config, "workerinput")


def pytest_sessionstart(session) -> None:
    """What the per-user directory (/tmp/tierstack-<uid>: sockets, token, Ray nodes' state
    and logs) held before the tests: they start real services there."""
    global _USER_DIR_BEFORE
    if _xdist_worker(session):
        return  # a worker ending first would remove what the other one still uses
    d = user_dir()
    _USER_DIR_BEFORE = {p.name for p in d.iterdir()} if d.is_dir() else None


def pytest_sessionfinish(session, exitstatus) -> None:
    """Remove what the tests added to the per-user directory, and the directory if they
    made it; what was there before (a user's own token, running services) stays."""
    if _xdist_worker(session):
        return
    d = user_dir()
    if not d.is_dir():
        return
    if _USER_DIR_BEFORE is None:
        shutil.rmtree(d, ignore_errors=True)
        return
    for entry in d.iterdir():
        if entry.name not in _USER_DIR_BEFORE:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    """A directory on the real disk (ext4 here), where O_DIRECT works."""
    d = tmp_path / "nvme"
    d.mkdir()
    return d


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    """A private directory inside /dev/shm, removed afterwards."""
    d = Path("/dev/shm") / f"tierstack-test-{uuid.uuid4().hex[:10]}"
    d.mkdir(mode=0o700)
    yield d
    shutil.rmtree(d)


@pytest.fixture
def tier_config(tmp_path: Path, shm_dir: Path) -> TierManagerConfig:
    """A small node: 8 MiB CPU pool in 2 MiB arenas, 64 MiB NVMe over two directories."""
    drives = [tmp_path / "drive0", tmp_path / "drive1"]
    return TierManagerConfig(
        cpu_pool=CpuPoolConfig(size=8 * MiB, shm_dir=str(shm_dir)),
        nvme_pool=NvmePoolConfig(
            paths=[str(d) for d in drives], size=64 * MiB,
            aio=AioConfig(block_size=256 * KiB, queue_depth=4, thread_count=2)),
        manifest_path=str(tmp_path / "manifest.sqlite"),
    )


def shm_bytes_used(shm_dir: Path) -> int:
    """Bytes of memory the arena files in `shm_dir` really occupy (allocated blocks)."""
    return sum(os.stat(f).st_blocks * 512 for f in shm_dir.iterdir())


@pytest.fixture
def mounted(tmp_path: Path):
    """Mount a small real filesystem for a test (root only): mounted(fstype, size) -> path."""
    mounts: list[Path] = []

    def mount(fstype: str, options: str = "") -> Path:
        target = tmp_path / f"mnt-{fstype}-{len(mounts)}"
        target.mkdir()
        cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, str(target)]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            pytest.skip(f"cannot mount {fstype} here (needs root)")
        mounts.append(target)
        return target

    yield mount
    for target in mounts:
        subprocess.run(["umount", "-l", str(target)], check=False)


@pytest.fixture
def hugetlbfs(mounted):
    """A hugetlbfs mount with 32 MiB of huge pages reserved for the test (root only)."""
    path = Path("/proc/sys/vm/nr_hugepages")
    try:
        old = int(path.read_text())
        path.write_text(str(old + 16))
    except OSError:
        pytest.skip("cannot reserve huge pages here (needs root)")
    if int(path.read_text()) < old + 16:
        path.write_text(str(old))
        pytest.skip("the kernel could not reserve 16 huge pages")
    try:
        yield mounted("hugetlbfs")
    finally:
        path.write_text(str(old))


def tier_manager_process(config_path: Path, socket_path: Path) -> ServiceProcess:
    """A real `tierstack tier-manager` on a unix socket, from a config file's tier_manager
    section (not started yet); restartable; its log is kept beside the socket."""
    section = json.loads(config_path.read_text())["tier_manager"]
    return ServiceProcess("tier-manager", "tier_manager", section, name="tier manager",
                          listen=f"unix:{socket_path}",
                          workdir=socket_path.parent / f"{socket_path.stem}-daemon")


def write_daemon_config(directory: Path, shm_dir: Path) -> Path:
    """A node config in `directory`: 16 MiB CPU pool, 256 MiB NVMe pool on the real disk."""
    path = directory / "tier-manager.json"
    path.write_text(json.dumps({"tier_manager": {
        "cpu_pool": {"size": "16MiB", "shm_dir": str(shm_dir)},
        "nvme_pool": {"paths": [str(directory / "nvme0"), str(directory / "nvme1")], "size": "256MiB",
                      "aio": {"block_size": "256KiB", "queue_depth": 4}},
        "manifest_path": str(directory / "manifest.sqlite"),
        "shutdown_grace_seconds": 10}}))
    return path


@pytest.fixture
def daemon_config(tmp_path: Path, shm_dir: Path) -> Path:
    """A node config: 16 MiB CPU pool, 256 MiB NVMe pool on the real disk."""
    return write_daemon_config(tmp_path, shm_dir)


@pytest.fixture
def daemon(daemon_config: Path, tmp_path: Path):
    """A running tier-manager daemon; killed at the end of the test."""
    proc = tier_manager_process(daemon_config, tmp_path / "tm.sock").start()
    yield proc
    proc.kill()


class _ModuleDaemon:
    """The daemon `shared_daemon` hands out: started once per module (a start costs a
    Python with torch, ~2.5 s on 2 cores), replaced after a test that left it unclean."""

    def __init__(self, tmp_path_factory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.proc: ServiceProcess | None = None
        self.shm_dir: Path | None = None

    def start(self) -> ServiceProcess:
        directory = self.tmp_path_factory.mktemp("shared-daemon")
        self.shm_dir = Path("/dev/shm") / f"tierstack-test-{uuid.uuid4().hex[:10]}"
        self.shm_dir.mkdir(mode=0o700)
        config = write_daemon_config(directory, self.shm_dir)
        self.proc = tier_manager_process(config, directory / "tm.sock").start()
        return self.proc

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            shutil.rmtree(self.shm_dir, ignore_errors=True)
            self.proc = None


def _what_is_left(address: str) -> list[str]:
    """What the tests so far left on the daemon at `address`, after deleting the state of
    jobs no worker holds (what the daemon does itself after jobs.grace_seconds, 5 s):
    jobs still held, tensors outside any job, leases, pins."""
    from tierstack.errors import KeyNotFoundError
    from tierstack.services.tier_manager.client import TierManagerClient

    client = TierManagerClient(address, reconnect_timeout=10)
    try:
        deadline = time.monotonic() + 10  # a closed channel ends its session asynchronously
        while True:
            held = []
            for job in client.jobs():
                if job.workers:
                    held.append(f"job {job.job} held by {job.workers} worker(s)")
                else:
                    try:
                        client.delete_job(job.job)
                    except KeyNotFoundError:
                        pass  # the daemon's own reaper was first
            stats = client.stats()
            left = held + [f"{n} {what}" for n, what in ((stats.tensors, "tensors"),
                                                        (stats.leases, "leases"),
                                                        (stats.pinned, "pins")) if n]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)
    finally:
        client.close()


@pytest.fixture(scope="module")
def _module_daemon(tmp_path_factory):
    shared = _ModuleDaemon(tmp_path_factory)
    yield shared
    shared.stop()


@pytest.fixture
def shared_daemon(_module_daemon: _ModuleDaemon) -> ServiceProcess:
    """A running tier-manager daemon (the `daemon` fixture's config) shared by a module's
    tests, for tests that use only their own jobs' state and compare traffic counters
    (NVMe bytes read, ...) with their values before the test. Each test must leave it as
    it found it: no job held, no tensor, lease or pin; one that does not fails at teardown,
    and the next test gets a fresh daemon."""
    proc = _module_daemon.proc
    if proc is None or not proc.running():
        _module_daemon.stop()
        proc = _module_daemon.start()
    yield proc
    left = _what_is_left(proc.address) if proc.running() else ["the daemon is not running"]
    if left:
        _module_daemon.stop()
        pytest.fail(f"the test left the shared daemon unclean: {', '.join(left)}")
