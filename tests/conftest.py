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
from tierstack.service_process import ServiceProcess


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


@pytest.fixture
def daemon_config(tmp_path: Path, shm_dir: Path) -> Path:
    """A node config: 16 MiB CPU pool, 256 MiB NVMe pool on the real disk."""
    path = tmp_path / "tier-manager.json"
    path.write_text(json.dumps({"tier_manager": {
        "cpu_pool": {"size": "16MiB", "shm_dir": str(shm_dir)},
        "nvme_pool": {"paths": [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")], "size": "256MiB",
                      "aio": {"block_size": "256KiB", "queue_depth": 4}},
        "manifest_path": str(tmp_path / "manifest.sqlite"),
        "shutdown_grace_seconds": 10}}))
    return path


@pytest.fixture
def daemon(daemon_config: Path, tmp_path: Path):
    """A running tier-manager daemon; killed at the end of the test."""
    proc = tier_manager_process(daemon_config, tmp_path / "tm.sock").start()
    yield proc
    proc.kill()
