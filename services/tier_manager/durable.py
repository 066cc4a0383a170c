"""Durable copies on NVMe: the bytes first, then the manifest row that points at them.

`DurableCopies` owns the node's `NvmePool` and `Manifest`. A durable write goes to a
fresh extent and is fdatasync'ed before its row may be committed (`record`), so a row
always points at durable bytes and a crash mid-write leaves the old version intact. It
also hands out versions: one counter for the whole registry, reserved in the manifest
in batches, so that a restarted daemon never hands the same (key, version) out twice.
It knows nothing of CPU copies, pins or eviction: the registry decides what to write.
"""

from __future__ import annotations

import logging
from typing import Callable

from tierstack.config import TierManagerConfig
from tierstack.errors import NvmePoolFullError
from tierstack.services.tier_manager.manifest import Manifest, ManifestEntry
from tierstack.services.tier_manager.nvme_pool import NvmeExtent, NvmePool

log = logging.getLogger(__name__)

VERSION_RESERVATION = 100_000  # versions reserved per durable manifest write

# Called with the bytes wanted when the NVMe pool is full; True if it freed something.
MakeRoom = Callable[[int], bool]


class DurableCopies:
    """The NVMe pool and its manifest, written in the order that keeps rows honest."""

    def __init__(self, config: TierManagerConfig, make_room: MakeRoom, capacity: int) -> None:
        self.make_room = make_room
        self.pool = NvmePool(config.nvme_pool, capacity)
        try:
            nvme = config.nvme_pool
            # Not the size: it is a cap that may change between starts ('auto' follows the
            # disk's free space); recovery checks every extent against the new one.
            layout = {"paths": [str(p) for p in nvme.paths], "block_size": nvme.aio.block_size}
            self.manifest = Manifest(config.resolved_manifest_path(), layout)
        except BaseException:
            self.pool.close()
            raise
        self._last_version = 0
        self._version_limit = 0

    def recover(self) -> list[ManifestEntry]:
        """The committed copies of an earlier instance, their extents marked used."""
        entries = self.manifest.entries()
        for entry in entries:
            try:
                self.pool.reserve(entry.extent)
            except ValueError as e:
                raise RuntimeError(
                    f"manifest {self.manifest.path} is inconsistent at key {entry.key!r}: {e}"
                ) from None
            self._last_version = max(self._last_version, entry.version)
        self.pool.fit_files()  # a crashed instance's free tail goes back to the disk
        # Volatile (CPU-only) versions are not in the manifest; the reserved high-water
        # mark keeps a restarted daemon from handing any (key, version) out twice.
        self._last_version = max(self._last_version, self.manifest.version_high_water())
        self._version_limit = self._last_version
        if entries:
            log.info("recovered %d NVMe-resident tensors from %s", len(entries), self.manifest.path)
        return entries

    def next_version(self) -> int:
        """A version never handed out before, by this or any earlier instance (the
        caller serialises calls)."""
        self._last_version += 1
        if self._last_version > self._version_limit:
            self._version_limit = self._last_version + VERSION_RESERVATION
            self.manifest.reserve_versions(self._version_limit)
        return self._last_version

    def allocate(self, nbytes: int) -> NvmeExtent:
        """A fresh extent of `nbytes` (nothing written yet); a full pool asks `make_room`
        once (the registry drops copies it can rebuild)."""
        if nbytes == 0:
            return NvmeExtent(0, self.pool.block_size, ())
        try:
            return self.pool.allocate(nbytes)
        except NvmePoolFullError:
            if not self.make_room(nbytes):
                raise
            return self.pool.allocate(nbytes)

    def write(self, label: str, data: memoryview) -> tuple[NvmeExtent, tuple[int, ...]]:
        """Write bytes to a fresh extent and fdatasync; the caller records or frees it."""
        if len(data) == 0:
            return NvmeExtent(0, self.pool.block_size, ()), ()
        extent = self.allocate(len(data))
        try:
            checksums = tuple(self.pool.write(extent, data, label=f"tensor {label!r}"))
            self.pool.sync([extent])
        except BaseException:
            self.pool.free(extent)
            raise
        return extent, checksums

    def record(self, entry: ManifestEntry) -> None:
        """Commit the row of a copy `write` made durable (it survives a crash from now on)."""
        self.manifest.commit(entry)

    def forget(self, key: str) -> None:
        """Delete `key`'s row: after a restart it is not recovered."""
        self.manifest.delete(key)

    def free(self, extent: NvmeExtent | None) -> None:
        if extent is not None and extent.stripes:
            self.pool.free(extent)

    def read(self, extent: NvmeExtent, dst: memoryview, checksums: tuple[int, ...], label: str) -> None:
        """Fill `dst` from `extent`, every block's checksum verified."""
        self.pool.read(extent, dst, list(checksums), label=label)

    def close(self) -> None:
        self.pool.close()
        self.manifest.close()
