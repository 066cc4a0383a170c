"""Shared fixtures: real directories on the ext4 disk, real /dev/shm arenas."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tierstack.config import KiB, MiB, CpuPoolConfig, NvmePoolConfig, TierManagerConfig, AioConfig


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
        cpu_pool=CpuPoolConfig(size=8 * MiB, arena_size=2 * MiB, shm_dir=str(shm_dir)),
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


class DaemonProcess:
    """A real `tierstack tier-manager` process on a unix socket, restartable."""

    def __init__(self, config_path: Path, socket_path: Path) -> None:
        self.config_path = config_path
        self.address = f"unix:{socket_path}"
        self.proc: subprocess.Popen | None = None
        self.log = config_path.parent / "daemon.log"

    def start(self, timeout: float = 60.0) -> "DaemonProcess":
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        import sys
        import time
        log = open(self.log, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierstack.cli", "tier-manager", "--config", str(self.config_path),
             "--listen", self.address], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.time() + timeout
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"tier manager exited: {self.log.read_text()[-3000:]}")
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1, wait_for_ready=True)
                    if status.status == health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass
                if time.time() > deadline:
                    raise TimeoutError(f"tier manager not serving after {timeout}s")

    def kill(self) -> None:
        """SIGKILL: a crash, no cleanup."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> int:
        """SIGTERM: a graceful shutdown; returns the exit code."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            return self.proc.wait(timeout=60)
        return self.proc.returncode if self.proc else 0


@pytest.fixture
def daemon_config(tmp_path: Path, shm_dir: Path) -> Path:
    """A node config: 16 MiB CPU pool, 256 MiB NVMe pool on the real disk."""
    import json
    path = tmp_path / "tier-manager.json"
    path.write_text(json.dumps({"tier_manager": {
        "cpu_pool": {"size": "16MiB", "arena_size": "8MiB", "shm_dir": str(shm_dir)},
        "nvme_pool": {"paths": [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")], "size": "256MiB",
                      "aio": {"block_size": "256KiB", "queue_depth": 4}},
        "manifest_path": str(tmp_path / "manifest.sqlite"),
        "shutdown_grace_seconds": 10}}))
    return path


@pytest.fixture
def daemon(daemon_config: Path, tmp_path: Path):
    """A running tier-manager daemon; killed at the end of the test."""
    proc = DaemonProcess(daemon_config, tmp_path / "tm.sock").start()
    yield proc
    proc.kill()
