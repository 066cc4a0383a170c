"""Partitioned activation checkpoints: each rank's stashed block inputs spread over the
ranks' tier managers, in shares proportional to each node's room.

Why this and not DeepSpeed's scheme. DeepSpeed's `partition_activations` splits a
checkpoint over model-parallel ranks, which all hold the same activation: keeping 1/N on
each and all-gathering before the recompute removes N-1 copies (without a model-parallel
group DeepSpeed's split is of one part: nothing changes). tierstack's partitioned jobs are
data-parallel: every rank's block inputs are its own micro-batch's, no copy exists to
remove, and each device or pool holding 1/N of every rank's inputs holds as many bytes as
before. What splitting can do is choose *where* those bytes live. A block input that goes
to the tier manager ("cpu", "nvme", or "auto" where the placement sends it there) is cut
into one piece per rank, sized by that rank's daemon's room for the placement (CPU pool
capacity for "cpu", NVMe for "nvme", both for "auto"; ranks sharing a daemon share its
room), and rank s's piece is sent to rank s (an all-to-all) and written to its daemon.
So a node with a third of the cluster's pool holds a third of the job's stashed inputs,
not 1/N of them plus whatever its own ranks made; with equal nodes the bytes per node
are unchanged and only the all-to-alls are added. Before the block's backward every rank
reads back the pieces it holds (the one before it in the background, as the plain stash
does) and a second all-to-all returns each piece to its owner.

Every rank stores, takes and releases inputs in the same order (the same program on
every rank), so the collectives line up; they run on the store's communication thread
with all the others. Each rank's daemon keeps the pieces it holds under its own rank's
keys (`<job>.rank<r>of<N>/layer<i>/activation.<n>`), deleted as the block's backward ends.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from tierstack.tiers import AUTO, CPU, NVME
from tierstack.worker.engine.activation_stash import ActivationStash, StashedInput
from tierstack.worker.store.sharded_store import ShardedLayerStore


@dataclass(frozen=True)
class DaemonRoom:
    """One rank's tier manager: which daemon it is and what its pools hold."""

    daemon: int  # a digest of the daemon's instance id: equal for ranks sharing one
    cpu: int
    nvme: int

    def room(self, placement: str) -> int:
        return {CPU: self.cpu, NVME: self.nvme, AUTO: self.cpu + self.nvme}[placement]


def daemon_rooms(store: ShardedLayerStore) -> list[DaemonRoom]:
    """Every rank's DaemonRoom, in rank order (a collective)."""
    node = store.tiers.node()
    digest = int.from_bytes(hashlib.sha1(node.instance_id.encode()).digest()[:7], "big")
    return [DaemonRoom(*row) for row in
            store.collectives.all_gather_ints([digest, node.cpu_capacity, node.nvme_capacity])]


def shares(nbytes: int, weights: list[int]) -> list[int]:
    """`nbytes` cut in consecutive pieces proportional to `weights` (equal if all are 0)."""
    if sum(weights) == 0:
        weights = [1] * len(weights)
    total = sum(weights)
    bounds, running = [0], 0
    for w in weights:
        running += w
        bounds.append(nbytes * running // total)
    return [b - a for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class SpreadInput(StashedInput):
    """A block input spread over the ranks: `sent[s]` of its bytes went to rank s, and
    this rank holds `held[r]` bytes of rank r's input of the same block and call."""

    sent: tuple[int, ...] = ()
    held: tuple[int, ...] = ()


class PartitionedActivationStash(ActivationStash):
    """Block inputs kept by the ranks' tier managers, each holding its share of every rank's."""

    def __init__(self, store: ShardedLayerStore, rooms: list[DaemonRoom]) -> None:
        super().__init__(store)
        self.sharded = store
        sharing = {r.daemon: sum(o.daemon == r.daemon for o in rooms) for r in rooms}
        # A rank's weight: its daemon's room over the ranks that share that daemon, so each
        # node's share follows its pool whatever its count of ranks.
        self._weights = {placement: [r.room(placement) // sharing[r.daemon] for r in rooms]
                         for placement in (CPU, NVME, AUTO)}

    def put(self, index: int, x: torch.Tensor, placement: str) -> SpreadInput:
        """Spread block `index`'s input `x` over the ranks' tier managers (a collective)."""
        store, weights = self.sharded, self._weights[placement]
        flat = x.detach().contiguous().view(-1).view(torch.uint8)
        counts = [row[0] for row in store.collectives.all_gather_ints([flat.numel()])]
        sent = tuple(shares(flat.numel(), weights))
        held = tuple(shares(n, weights)[store.rank] for n in counts)
        pieces = store.collectives.all_to_all(flat, sent, held)
        entry = SpreadInput(self._next_key(index), tuple(x.shape), x.dtype, x.device,
                            x.requires_grad, sum(held), sent=sent, held=held)
        self._keep(entry, pieces, placement)
        return entry

    def take(self, entry: SpreadInput) -> torch.Tensor:
        """`entry`'s tensor back on its device, its pieces returned by every rank (a
        collective); starts reading this rank's pieces of the input stored before it."""
        pieces = super().take(entry)  # this daemon's pieces, from the reader thread
        if entry.device.type == "cuda":
            pieces = pieces.pin_memory().to(entry.device, non_blocking=True)
        flat = self.sharded.collectives.all_to_all(pieces, entry.held, entry.sent)
        return flat.view(entry.dtype).view(entry.shape)

    def _read(self, entry: SpreadInput) -> torch.Tensor:
        return self.store.tiers.read_bytes(entry.key)  # a CPU copy: the pin goes at once
