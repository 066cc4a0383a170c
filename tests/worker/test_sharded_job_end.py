"""A partitioned run leaves nothing on its nodes: each rank's shards are a job of their own
on the node's tier manager, held open by the rank and deleted once the run has ended (after
the daemon's grace period). Two gloo ranks sharing one real daemon (ranks of one node)."""

from __future__ import annotations

import threading
import time

from tierstack.config import load_config
from tierstack.services.tier_manager.client import TierManagerClient
from tierstack.services.tier_manager.embedded import EmbeddedTierManager
from tierstack.worker.jobs.gpt import GPTConfig
from tierstack.worker.jobs.partitioned_job import PartitionedSpec, launch_partitioned, small_embedded_node


def test_a_partitioned_runs_state_is_deleted_from_its_node_when_it_ends(tmp_path):
    node = small_embedded_node(size_mib=4)
    node["nvme_pool"]["paths"] = [str(tmp_path / "nvme")]
    node["manifest_path"] = str(tmp_path / "manifest.sqlite")
    node["jobs"] = {"grace_seconds": 0.5}
    with EmbeddedTierManager(load_config({"tier_manager": node}).tier_manager) as daemon:
        spec = PartitionedSpec(gpt=GPTConfig(vocab_size=128, seq_len=16, dim=32, heads=2, layers=2),
                               steps=2, global_batch=4, data="random", device="cpu", cpu_threads=1,
                               tier_manager=daemon.address, job="ending")
        client = TierManagerClient(daemon.address)
        seen: dict[str, int] = {}  # job -> most bytes seen while the run held it
        running = threading.Event()
        running.set()

        def watch() -> None:
            while running.is_set():
                for j in client.jobs():
                    if j.workers:
                        seen[j.job] = max(seen.get(j.job, 0), j.bytes)
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            launch_partitioned(spec, 2)
        finally:
            running.clear()
            watcher.join()
        assert set(seen) == {"ending.rank0of2", "ending.rank1of2"}, seen  # each rank's shards
        assert all(seen.values()), seen
        # Gone after the 0.5 s grace; left, a job stays (or goes after orphan_seconds, 600
        # s by default, once the daemon restarts): a tenth of that bounds the wait.
        ended = time.monotonic()
        while left := [j for j in client.jobs() if j.job.startswith("ending")]:
            assert time.monotonic() - ended < 60, f"state left on the node: {left}"
            time.sleep(0.1)
        stats = client.stats()
        assert stats.cpu_used == 0, stats
        client.close()
