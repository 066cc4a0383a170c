"""A CPU pool larger than its tmpfs (issue 53): the pool's room is the smaller of its cap
and what the tmpfs can still give. Past it the daemon evicts to NVMe as it does at its
cap; where nothing can go, an allocation is answered RESOURCE_EXHAUSTED on its first
call, naming the fix, not UNAVAILABLE "allocate again shortly" retried until the
client's deadline. The start (and `tierstack doctor`) say so up front.

The tmpfs is a real 8 MiB mount (root only), the daemon a real process, its cap 32 MiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import grpc
import pytest
import torch

from tests.conftest import shm_bytes_used, tier_manager_process
from tierstack.config import MiB, TierstackConfig, load_config
from tierstack.errors import PoolExhaustedError
from tierstack.proto import tier_manager_pb2 as pb
from tierstack.proto import tier_manager_pb2_grpc as pb_grpc
from tierstack.rpc import RETRY_PUSHBACK
from tierstack.services.tier_manager.client import TierManagerClient
from tierstack.worker.store.arenas import ArenaMap

TMPFS = 8 * MiB
CAP = 32 * MiB
TENSOR = MiB  # each buffer an arena of its own (only those <= 32 KiB share one here)


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """An 8 MiB tmpfs for the pool's arenas, unmounted on every exit path."""
    if os.geteuid() != 0:
        pytest.skip(f"a pool over a small tmpfs needs one mounted, which needs root (id -u is "
                    f"{os.geteuid()}); a directory's size cannot be bounded otherwise here")
    mount = tmp_path / "small-shm"
    mount.mkdir(mode=0o700)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS},mode=0700", "tmpfs",
                           str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"this machine does not let root mount a tmpfs: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def config_path(tmp_path: Path, small_tmpfs: Path) -> Path:
    path = tmp_path / "tier-manager.json"
    path.write_text(json.dumps({"tier_manager": {
        "cpu_pool": {"size": CAP, "shm_dir": str(small_tmpfs)},
        "nvme_pool": {"paths": [str(tmp_path / "nvme0")], "size": "256MiB",
                      "aio": {"block_size": "256KiB", "queue_depth": 4}},
        "manifest_path": str(tmp_path / "manifest.sqlite"), "shutdown_grace_seconds": 10}}))
    return path


@pytest.fixture
def daemon(config_path: Path, tmp_path: Path):
    proc = tier_manager_process(config_path, tmp_path / "tm.sock").start()
    try:
        yield proc
    finally:
        proc.kill()


def _write(client: TierManagerClient, arenas: ArenaMap, key: str, value: int) -> None:
    lease = client.allocate(TENSOR)
    arenas.sync(lease.arenas_epoch)  # unmap what the pool gave back: its pages go then
    arenas.view(lease.arena, lease.offset, TENSOR).fill_(value)
    client.commit(key, lease.lease_id, "uint8", (TENSOR,), durable=False)


def _read(client: TierManagerClient, arenas: ArenaMap, key: str) -> tuple[int, int]:
    """The tensor's first and last byte, read through a fetch (then released)."""
    result = client.fetch([key])
    (res,) = result.tensors
    arenas.sync(result.arenas_epoch)
    view = arenas.view(res.arena, res.offset, res.info.nbytes)
    first, last = int(view[0]), int(view[-1])
    client.release(key, res.info.version)
    return first, last


def test_writes_past_the_tmpfs_go_to_nvme_as_at_the_cap_and_nothing_is_lost(daemon, small_tmpfs):
    """20 MiB written into a pool whose tmpfs holds 8: the daemon evicts to NVMe as it
    goes (it used to answer every allocation past the tmpfs UNAVAILABLE, 'allocate again
    shortly', until the client gave up), and every tensor reads back."""
    client = TierManagerClient(daemon.address, reconnect_timeout=20)
    arenas = ArenaMap(client.node(), pin_for_cuda=False, describe=client.node)
    try:
        for i in range(20):
            _write(client, arenas, f"t/{i}", i + 1)
        stats = client.stats()
        assert stats.evictions >= 12 and stats.cpu_used <= TMPFS, stats
        assert shm_bytes_used(small_tmpfs) <= TMPFS
        for i in range(20):  # each read back evicts another to make room
            assert _read(client, arenas, f"t/{i}") == (i + 1, i + 1)
    finally:
        arenas.close()
        client.close()


def test_with_nothing_to_evict_an_allocation_is_refused_at_once_naming_the_fix(daemon, small_tmpfs):
    """Every tensor in the tmpfs is fetched (pinned) by a client: no eviction, and nothing
    on its way out, can make room. A raw call is answered RESOURCE_EXHAUSTED on its first
    try, without a retry hint; the SDK's allocate fails with that message (no retries
    until its 60 s deadline, which end in RetryLaterError); after a Release it is served."""
    owner = TierManagerClient(daemon.address, reconnect_timeout=20)
    arenas = ArenaMap(owner.node(), pin_for_cuda=False, describe=owner.node)
    try:
        for i in range(TMPFS // TENSOR):
            _write(owner, arenas, f"p/{i}", i + 1)
        pinned = owner.fetch([f"p/{i}" for i in range(TMPFS // TENSOR)]).tensors
        assert owner.stats().cpu_used == TMPFS
        with grpc.insecure_channel(daemon.address) as channel:  # one call, no client retries
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.TierManagerStub(channel).AllocateBuffer(
                    pb.AllocateBufferRequest(nbytes=TENSOR), timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert RETRY_PUSHBACK not in dict(err.value.trailing_metadata() or ())
        message = err.value.details()
        assert str(small_tmpfs) in message and "lower cpu_pool.size" in message, message
        assert "grow the tmpfs" in message and "nothing evictable" in message, message

        sdk = TierManagerClient(daemon.address, reconnect_timeout=60)
        start = time.monotonic()
        with pytest.raises(PoolExhaustedError, match="grow the tmpfs"):
            sdk.allocate(TENSOR)
        assert time.monotonic() - start < 30  # far from the deadline its retries would reach
        owner.release("p/0", pinned[0].info.version)  # the fix a client can make
        lease = sdk.allocate(TENSOR)  # p/0 goes to NVMe for it
        sdk.cancel(lease.lease_id)
        assert not owner.describe("p/0").in_cpu
        sdk.close()
    finally:
        arenas.close()
        owner.close()


def test_the_start_and_doctor_say_the_cap_is_past_the_tmpfs(daemon, config_path, small_tmpfs):
    from tierstack.doctor import WARN, checks

    log = daemon.log_text()
    assert f"CPU pool directory {small_tmpfs}" in log and "8.0 MiB free of 8.0 MiB" in log, log
    assert "lower tier_manager.cpu_pool.size to at most" in log
    config = load_config(str(config_path))
    found = {c.name: c for c in checks(config, measure=False, gpu=False)}
    shm = found[f"CPU pool directory {small_tmpfs}"]
    assert shm.status == WARN and "for a pool of up to 32.0 MiB" in shm.found, shm
    assert "grow the tmpfs" in shm.fix and f"at most {TMPFS} bytes" in shm.fix, shm
    roomy = checks(TierstackConfig(), measure=False, gpu=False)  # /dev/shm, 'auto' pool
    assert any(c.name.startswith("CPU pool directory") for c in roomy)
