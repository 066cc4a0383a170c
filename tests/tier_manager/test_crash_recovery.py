"""Nothing lost: SIGKILLs in the middle of durable writes, corrupt and lost manifests, two
daemons on one pool. Real daemons, real files, real kills.

The kill loop is time-bounded (TIERSTACK_KILL_SECONDS, default 8, at least 5 kills; longer runs:
bench/hardening.py) and prints what it covered.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import tier_manager_process
from tierstack.errors import KeyNotFoundError, TierstackError
from tierstack.services.tier_manager.client import TierManagerClient
from tierstack.worker.store.arenas import ArenaMap

KILL_SECONDS = float(os.environ.get("TIERSTACK_KILL_SECONDS") or 8.0)
DELETED = -1  # the state of a key whose delete was acknowledged


def content(key: str, generation: int) -> torch.Tensor:
    """The bytes of `key` at `generation`: its size and bytes follow from both."""
    seed = int.from_bytes(hashlib.sha256(f"{key}:{generation}".encode()).digest()[:8], "little")
    g = torch.Generator().manual_seed(seed)
    size = int(torch.randint(1, 6, (1,), generator=g)) * 4096 * int(torch.randint(1, 60, (1,), generator=g))
    size -= int(torch.randint(0, 4096, (1,), generator=g))  # not always whole pages
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)


class Writer:
    """Writes durable generations of its own keys (and deletes some) until the daemon
    dies under it; remembers what was acknowledged and what was in flight."""

    def __init__(self, address: str, keys: list[str], acked: dict[str, int], seed: int) -> None:
        self.address, self.keys, self.acked = address, keys, acked
        self.pending: tuple[str, int] | None = None
        self.rng = random.Random(seed)
        self.writes = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        client = TierManagerClient(self.address, reconnect_timeout=2)
        arenas = None
        try:
            arenas = ArenaMap(client.node(), pin_for_cuda=False, describe=client.node)
            while True:
                key = self.rng.choice(self.keys)
                current = self.acked.get(key, 0)
                if current > 0 and self.rng.random() < 0.1:
                    self.pending = (key, DELETED)
                    client.delete([key])
                else:
                    generation = abs(current) + 1
                    self.pending = (key, generation)
                    data = content(key, generation)
                    lease = client.allocate(data.numel())
                    arenas.sync(lease.arenas_epoch)
                    arenas.view(lease.arena, lease.offset, data.numel()).copy_(data)
                    client.commit(key, lease.lease_id, "uint8", (data.numel(),), durable=True)
                    self.writes += 1
                self.acked[key] = self.pending[1] if self.pending[1] != DELETED else -abs(current)
                self.pending = None
        except TierstackError:
            return  # the daemon died under us: `pending` is what was in flight
        finally:
            if arenas is not None:
                arenas.close()
            client.close()


def observe(client: TierManagerClient, arenas: ArenaMap, key: str) -> torch.Tensor | None:
    try:
        result = client.fetch([key])
    except KeyNotFoundError:
        return None
    (res,) = result.tensors
    try:
        if not res.info.nbytes:
            return torch.empty(0, dtype=torch.uint8)
        arenas.sync(result.arenas_epoch)
        return arenas.view(res.arena, res.offset, res.info.nbytes).clone()
    finally:
        client.release(key, res.info.version)


def verify(address: str, acked: dict[str, int], pending: dict[str, int]) -> dict[str, str]:
    """Every key holds its acknowledged state, or the state that was in flight when the
    daemon died; the state found becomes the acknowledged one. Returns the keys whose
    in-flight write landed."""
    client = TierManagerClient(address, reconnect_timeout=30)
    arenas = ArenaMap(client.node(), pin_for_cuda=False, describe=client.node)
    landed = {}
    try:
        for key in sorted(set(acked) | set(pending)):
            got = observe(client, arenas, key)
            allowed = {acked.get(key, 0)} | ({pending[key]} if key in pending else set())
            found = None
            for state in allowed:
                if state <= 0 and got is None:  # never written, or deleted
                    found = state
                elif state > 0 and got is not None and torch.equal(got, content(key, state)):
                    found = state
            assert found is not None, (f"{key}: found {None if got is None else got.numel()} "
                                       f"bytes, expected one of the states {allowed}")
            if key in pending and found == pending[key] != acked.get(key, 0):
                landed[key] = "written" if found > 0 else "deleted"
            acked[key] = found if found != DELETED else -abs(acked.get(key, 0))
    finally:
        arenas.close()
        client.close()
    return landed


@pytest.fixture
def crash_config(tmp_path: Path, shm_dir: Path) -> Path:
    path = tmp_path / "tier-manager.json"
    path.write_text(json.dumps({"tier_manager": {
        "cpu_pool": {"size": "16MiB", "shm_dir": str(shm_dir)},
        "nvme_pool": {"paths": [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")], "size": "512MiB",
                      "aio": {"block_size": "256KiB", "queue_depth": 4}},
        "manifest_path": str(tmp_path / "nvme0" / "manifest.sqlite"),
        "shutdown_grace_seconds": 10, "metrics": {"enabled": False}}}))
    return path


def test_sigkill_during_durable_writes_loses_no_acknowledged_tensor_and_recover_agrees(
        crash_config, tmp_path):
    daemon = tier_manager_process(crash_config, tmp_path / "tm.sock").start()
    acked: dict[str, int] = {}
    rng = random.Random(14)
    rounds = writes = landed = 0
    start = time.monotonic()
    try:
        while time.monotonic() - start < KILL_SECONDS or rounds < 5:
            writers = [Writer(daemon.address, [f"w{w}/k{i}" for i in range(12)], acked, rng.random())
                       for w in range(2)]
            for w in writers:
                w.thread.start()
            time.sleep(rng.uniform(0.3, 1.5))
            daemon.kill()  # SIGKILL, mid-write
            for w in writers:
                w.thread.join(timeout=30)
                assert not w.thread.is_alive()
            pending = {w.pending[0]: w.pending[1] for w in writers if w.pending is not None}
            daemon.start()
            landed += len(verify(daemon.address, acked, pending))
            rounds += 1
            writes += sum(w.writes for w in writers)
        # The same state comes back from the NVMe data alone: the manifest set aside and
        # rebuilt from the extents' headers by --recover.
        assert daemon.stop(timeout=30) == 0
        manifest = tmp_path / "nvme0" / "manifest.sqlite"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{manifest}{suffix}").unlink(missing_ok=True)
        with pytest.raises(Exception, match="manifest .* is missing"):
            daemon.start()
        daemon.args = ["--recover"]
        daemon.start()
        daemon.args = []
        verify(daemon.address, acked, {})
    finally:
        daemon.kill()
    live = sum(1 for state in acked.values() if state > 0)
    print("kill figures:", json.dumps({"kill_rounds": rounds, "acknowledged_writes": writes,
                                       "keys_checked_each_round": len(acked),
                                       "live_tensors_at_end": live,
                                       "in_flight_writes_that_landed": landed,
                                       "lost": 0, "seconds": round(time.monotonic() - start, 1)}))
    assert rounds >= 3 and writes > 0


def _write(client: TierManagerClient, key: str, data: torch.Tensor) -> None:
    arenas = ArenaMap(client.node(), pin_for_cuda=False, describe=client.node)
    try:
        lease = client.allocate(data.numel())
        if data.numel():  # an empty tensor gets no buffer
            arenas.sync(lease.arenas_epoch)
            arenas.view(lease.arena, lease.offset, data.numel()).copy_(data)
        client.commit(key, lease.lease_id, "uint8", (data.numel(),), durable=True)
    finally:
        arenas.close()


def _populate(daemon) -> dict[str, torch.Tensor]:
    client = TierManagerClient(daemon.address, reconnect_timeout=30)
    stored = {}
    try:
        for i, size in enumerate([0, 100, 4096, 300_000, 1_000_000]):
            stored[f"job/t{i}"] = content(f"job/t{i}", 1)[:size].clone()
            _write(client, f"job/t{i}", stored[f"job/t{i}"])
        _write(client, "job/t1", content("job/t1", 2))  # a second version; the first is freed
        stored["job/t1"] = content("job/t1", 2)
        client.delete(["job/t2"])
        del stored["job/t2"]
    finally:
        client.close()
    return stored


def _check(daemon, stored: dict[str, torch.Tensor]) -> None:
    client = TierManagerClient(daemon.address, reconnect_timeout=30)
    arenas = ArenaMap(client.node(), pin_for_cuda=False, describe=client.node)
    try:
        for key, data in stored.items():
            got = observe(client, arenas, key)
            assert got is not None and torch.equal(got, data), key
        assert observe(client, arenas, "job/t2") is None  # deleted stays deleted
    finally:
        arenas.close()
        client.close()


def _shm_files(config: Path) -> list[str]:
    shm = json.loads(config.read_text())["tier_manager"]["cpu_pool"]["shm_dir"]
    return sorted(os.listdir(shm))


def _corrupt_header(manifest: Path) -> None:
    with open(manifest, "r+b") as f:
        f.write(b"this is no sqlite database" * 4)


def _corrupt_row(manifest: Path) -> None:
    with sqlite3.connect(manifest) as db:
        db.execute("UPDATE tensors SET extent='[1, 2' WHERE key='job/t3'")


def _two_rows_one_extent(manifest: Path) -> None:
    with sqlite3.connect(manifest) as db:  # t4's row becomes a copy of t3's, key aside
        row = db.execute("SELECT dtype, shape, nbytes, extent, checksums FROM tensors "
                         "WHERE key='job/t3'").fetchone()
        db.execute("UPDATE tensors SET dtype=?, shape=?, nbytes=?, extent=?, checksums=? "
                   "WHERE key='job/t4'", row)


def _delete(manifest: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{manifest}{suffix}").unlink(missing_ok=True)


@pytest.mark.parametrize("damage, said", [
    (_corrupt_header, "cannot be trusted"),
    (_corrupt_row, "row for key 'job/t3' is malformed"),
    (_two_rows_one_extent, "overlaps another row"),
    (_delete, "is missing"),
])
def test_a_damaged_manifest_stops_the_start_in_one_line_and_recover_rebuilds_it(
        crash_config, tmp_path, damage, said):
    daemon = tier_manager_process(crash_config, tmp_path / "tm.sock").start()
    try:
        stored = _populate(daemon)
        assert daemon.stop(timeout=30) == 0
        manifest = tmp_path / "nvme0" / "manifest.sqlite"
        damage(manifest)
        before = _shm_files(crash_config)
        out = subprocess.run([sys.executable, "-m", "tierstack.cli", "tier-manager", "--config",
                              str(crash_config), "--listen", f"unix:{tmp_path / 'x.sock'}"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr[-2000:]
        message = out.stderr.strip().splitlines()[-1]
        assert said in message and "--recover" in message and "Traceback" not in out.stderr
        assert _shm_files(crash_config) == before  # no CPU-pool file left behind
        daemon.args = ["--recover"]
        daemon.start()
        assert "recovered 4 tensors" in daemon.log_text()
        _check(daemon, stored)
        kept = [p.name for p in manifest.parent.iterdir() if ".before-recover-" in p.name]
        assert kept or damage is _delete  # the damaged manifest is kept for inspection
        daemon.args = []
        assert daemon.stop(timeout=30) == 0
        daemon.start()  # and the rebuilt manifest is an ordinary one from now on
        _check(daemon, stored)
    finally:
        daemon.kill()


def test_recover_skips_an_extent_whose_data_was_damaged_and_names_it(crash_config, tmp_path):
    daemon = tier_manager_process(crash_config, tmp_path / "tm.sock").start()
    try:
        stored = _populate(daemon)
        assert daemon.stop(timeout=30) == 0
        # Flip a byte of t4's data on disk: with the manifest lost, its headers still
        # describe it, but its data no longer matches their checksums.
        with sqlite3.connect(tmp_path / "nvme0" / "manifest.sqlite") as db:
            extent = json.loads(db.execute("SELECT extent FROM tensors WHERE key='job/t4'").fetchone()[0])
        nbytes, block_size, stripes, header = extent
        drive, offset, _ = stripes[0]
        data_file = tmp_path / f"nvme{drive}" / "tierstack-nvme.data"
        with open(data_file, "r+b") as f:
            f.seek(offset + header + 10)
            byte = f.read(1)
            f.seek(offset + header + 10)
            f.write(bytes([byte[0] ^ 0xFF]))
        _delete(tmp_path / "nvme0" / "manifest.sqlite")
        daemon.args = ["--recover"]
        daemon.start()
        log = daemon.log_text()
        assert "recovered 3 tensors" in log and "'job/t4'" in log and "checksums" in log
        del stored["job/t4"]
        _check(daemon, stored)
    finally:
        daemon.kill()


def test_a_second_daemon_on_the_same_pool_is_refused_and_the_first_keeps_its_tensors(
        crash_config, tmp_path):
    first = tier_manager_process(crash_config, tmp_path / "first.sock").start()
    try:
        stored = _populate(first)
        out = subprocess.run([sys.executable, "-m", "tierstack.cli", "tier-manager", "--config",
                              str(crash_config), "--listen", f"unix:{tmp_path / 'second.sock'}"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2
        message = out.stderr.strip().splitlines()[-1]
        assert "is in use by another process" in message and f"pid {first.proc.pid}" in message
        assert "Traceback" not in out.stderr
        _check(first, stored)
        first.kill()  # and it restarts over its own pool
        first.start()
        _check(first, stored)
    finally:
        first.kill()
