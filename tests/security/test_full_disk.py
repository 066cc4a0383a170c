"""A full disk under the manifest: the commit is refused as RESOURCE_EXHAUSTED naming the
path and the fix, nothing already stored is lost, and commits work again once there is
room. The disk is a real 8 MiB tmpfs (root only), the daemon a real process."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tierstack.errors import PoolExhaustedError
from tierstack.services.tier_manager.client import TierManagerClient
from tierstack.worker.store.arenas import ArenaMap
from tests.conftest import tier_manager_process
from tests.tier_manager.test_daemon import write

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


@pytest.fixture
def small_disk(tmp_path: Path):
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("this machine does not let root mount a tmpfs")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(directory: Path) -> Path:
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    return filler


def test_a_full_disk_under_the_manifest_refuses_the_commit_and_loses_nothing(tmp_path, shm_dir, small_disk):
    config = tmp_path / "tm.json"
    manifest = small_disk / "manifest.sqlite"
    config.write_text(json.dumps({"tier_manager": {
        "cpu_pool": {"size": "16MiB", "shm_dir": str(shm_dir)},
        "nvme_pool": {"paths": [str(tmp_path / "nvme0")], "size": "64MiB"},
        "manifest_path": str(manifest), "shutdown_grace_seconds": 10}}))
    daemon = tier_manager_process(config, tmp_path / "tm.sock").start()
    try:
        client = TierManagerClient(daemon.address)
        arenas = ArenaMap(client.node(), pin_for_cuda=False, describe=client.node)
        kept = torch.arange(50_000, dtype=torch.int32)
        write(client, arenas, "kept", kept)
        filler = _fill(small_disk)
        refused = 0
        for i in range(64):  # the WAL may have room for a few rows still
            try:
                write(client, arenas, f"new-{i}", torch.full((1000,), i, dtype=torch.int32))
            except PoolExhaustedError as e:
                assert str(manifest) in str(e) and "full" in str(e) and "Free space" in str(e), e
                refused += 1
                break
        assert refused == 1, "no commit was refused on a full disk"
        (res,) = client.fetch(["kept"]).tensors
        assert torch.equal(arenas.view(res.arena, res.offset, res.info.nbytes).view(torch.int32), kept)
        client.release("kept", res.info.version)
        filler.unlink()
        write(client, arenas, "after", torch.ones(1000, dtype=torch.int32))  # room again: it works
    finally:
        daemon.kill()
