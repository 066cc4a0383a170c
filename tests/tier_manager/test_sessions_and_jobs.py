"""A worker's holds end with its process, and a job's state with its last worker (issue 14):
a SIGKILLed worker's leases and pins are freed within seconds, not at the 600 s lease
timeout; its job's tensors go after the grace period unless the job asked to keep them;
a job's quota is enforced."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.conftest import tier_manager_process
from tierstack.errors import KeyNotFoundError, TierstackError
from tierstack.services.tier_manager.client import TierManagerClient

WORKER = """
import sys, time
from tierstack.services.tier_manager.client import TierManagerClient
c = TierManagerClient(sys.argv[1], reconnect_timeout=20)
c.open_job("run")
c.open_job("kept", keep=True)
for job in ("run", "kept"):
    lease = c.allocate(4096)
    c.commit(f"{job}/w", lease.lease_id, "uint8", (4096,), durable=False)
c.fetch(["run/w"])   # pinned until released
c.allocate(8192)     # leased, never committed
print("ready", flush=True)
time.sleep(600)
"""


def test_a_killed_workers_holds_and_its_jobs_state_go_with_it(tmp_path, shm_dir):
    config = tmp_path / "tm.json"
    config.write_text(json.dumps({"tier_manager": {
        "cpu_pool": {"size": "8MiB", "shm_dir": str(shm_dir)},
        "nvme_pool": {"paths": [str(tmp_path / "nvme")], "size": "16MiB",
                      "aio": {"block_size": "256KiB", "queue_depth": 2}},
        "manifest_path": str(tmp_path / "manifest.sqlite"),
        "jobs": {"grace_seconds": 0.5}, "metrics": {"enabled": False}}}))
    daemon = tier_manager_process(config, tmp_path / "tm.sock").start()
    worker = subprocess.Popen([sys.executable, "-c", WORKER, daemon.address],
                              stdout=subprocess.PIPE, text=True)
    client = TierManagerClient(daemon.address, reconnect_timeout=10)
    try:
        assert worker.stdout.readline().strip() == "ready"
        before = client.stats()
        assert before.leases >= 1 and before.pinned >= 1
        worker.kill()
        worker.wait()
        killed = time.monotonic()
        while (s := client.stats()).leases or s.pinned or "run" in {j.job for j in client.jobs()}:
            assert time.monotonic() - killed < 5, f"holds not freed: {s}, {client.jobs()}"
            time.sleep(0.05)
        with pytest.raises(KeyNotFoundError):
            client.describe("run/w")
        assert client.describe("kept/w").nbytes == 4096  # kept: outlives its workers
        client.open_job("small", quota_bytes=8192)
        lease = client.allocate(16384)
        with pytest.raises(TierstackError, match="quota"):
            client.commit("small/x", lease.lease_id, "uint8", (16384,), durable=False)
    finally:
        worker.kill()
        client.close()
        daemon.kill()
