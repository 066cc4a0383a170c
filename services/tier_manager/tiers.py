"""The node's tiers and the parts over them, built once per process by its entry point.

`open_tiers` measures the machine once (the pools' caps: stated sizes checked against it,
'auto' ones from its default budgets), opens the durable copies first (a manifest that
cannot be trusted stops the start before any CPU-pool file exists), then the CPU pool,
the records the manifest lists, and the parts the registry coordinates: spill (eviction,
send-out, room), leases (fetch pins) and the jobs' accounts. Nothing above reaches into a
part for another: each gets what it uses here.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierstack.budgets import PoolCaps, measure, pool_caps
from tierstack.config import TierManagerConfig
from tierstack.services.tier_manager.accounts import JobAccounts
from tierstack.services.tier_manager.cpu_pool import CpuPool
from tierstack.services.tier_manager.durable import DurableCopies
from tierstack.services.tier_manager.leases import Leases
from tierstack.services.tier_manager.nvme_pool import held_bytes
from tierstack.services.tier_manager.lifecycle import TensorRecord
from tierstack.services.tier_manager.records import Records
from tierstack.services.tier_manager.spill import Spill


@dataclass
class NodeTiers:
    """The pools of one node and the parts that keep their records."""

    caps: PoolCaps
    durable: DurableCopies
    cpu_pool: CpuPool
    records: Records
    spill: Spill
    leases: Leases
    accounts: JobAccounts

    def close(self) -> None:
        self.spill.close()
        self.cpu_pool.close()
        self.durable.close()


def open_tiers(config: TierManagerConfig, recover: bool = False) -> NodeTiers:
    """The node's pools (nothing allocated yet) and parts; with `recover`, the manifest is
    first rebuilt from the NVMe data (durable.py)."""
    config.validate()
    nvme = config.nvme_pool
    caps = pool_caps(config.cpu_pool.size, nvme.size,
                     measure(nvme.paths, device="cpu", nvme_held=held_bytes(nvme.paths)))
    durable = DurableCopies(config, capacity=caps.nvme, rebuild=recover)
    try:
        entries = durable.recover()
        cpu_pool = CpuPool(config.cpu_pool, capacity=caps.cpu)
    except BaseException:
        durable.close(failed_start=True)
        raise

    def free(record: TensorRecord) -> None:
        """A retired record's bytes, in every tier, once its last pin is gone."""
        if record.cpu is not None:
            cpu_pool.free(record.cpu)
            record.cpu = None
        durable.free(record.nvme)
        record.nvme = None

    records = Records(free)
    accounts = JobAccounts()
    for entry in entries:
        records.swap(records.new(entry.key, entry.dtype, entry.shape, entry.nbytes, entry.version,
                                 nvme=entry.extent, checksums=entry.checksums, durable=True))
        accounts.count(entry.key, entry.nbytes, +1)
    spill = Spill(records, cpu_pool, durable)
    return NodeTiers(caps, durable, cpu_pool, records, spill,
                     Leases(records, spill, durable, cpu_pool), accounts)
