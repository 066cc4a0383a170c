"""Sentinel tensors: written before an attack, checked bit for bit after it.

Each sentinel is durable, of a size chosen to cover the pool's paths (one block, several
blocks, an empty tensor), filled with bytes derived from its name, so any later reader
can tell whether a byte changed.
"""

from __future__ import annotations

import hashlib

import torch

from tierstack.services.tier_manager.client import TierManagerClient
from tierstack.worker.store.arenas import ArenaMap

SENTINEL_JOB = "sentinel"
SIZES = (0, 4096, 300_000, 1_100_000)


def sentinel_bytes(name: str, nbytes: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def sentinel_keys() -> list[str]:
    return [f"{SENTINEL_JOB}/{i}" for i in range(len(SIZES))]


def write_sentinels(client: TierManagerClient) -> None:
    arenas = ArenaMap(client.node(), pin_for_cuda=False, describe=client.node)
    try:
        for key, size in zip(sentinel_keys(), SIZES):
            data = sentinel_bytes(key, size)
            lease = client.allocate(size)
            if size:
                arenas.sync(lease.arenas_epoch)
                arenas.view(lease.arena, lease.offset, size).copy_(data)
            client.commit(key, lease.lease_id, "uint8", (size,), durable=True)
    finally:
        arenas.close()


def check_sentinels(client: TierManagerClient) -> list[str]:
    """The sentinels whose bytes differ from what was written (or that are gone)."""
    bad = []
    arenas = ArenaMap(client.node(), pin_for_cuda=False, describe=client.node)
    try:
        for key, size in zip(sentinel_keys(), SIZES):
            try:
                result = client.fetch([key])
            except Exception as e:  # noqa: BLE001 - a missing sentinel is a finding
                bad.append(f"{key}: {type(e).__name__}: {e}")
                continue
            (res,) = result.tensors
            try:
                arenas.sync(result.arenas_epoch)
                got = arenas.view(res.arena, res.offset, res.info.nbytes).clone() if size else \
                    torch.empty(0, dtype=torch.uint8)
            finally:
                client.release(key, res.info.version)
            if res.info.nbytes != size or not torch.equal(got, sentinel_bytes(key, size)):
                bad.append(f"{key}: bytes differ")
    finally:
        arenas.close()
    return bad
