"""Durable copies on NVMe: the bytes first, then the manifest row that points at them.

`DurableCopies` owns the node's `NvmePool` and `Manifest`. A durable write goes to a
fresh extent, its blocks and then its self-describing headers (extent_header.py), and is
fdatasync'ed before its row may be committed (`record`), so a row always points at
durable bytes and a crash mid-write leaves the old version intact. It also hands out
versions: one counter for the whole registry, reserved in the manifest in batches, so
that a restarted daemon never hands the same (key, version) out twice; the same counter
numbers the writes in the headers, so the newest copy of a key is the highest.
It knows nothing of CPU copies, pins or eviction: the registry decides what to write.

At start it trusts the manifest only if it reads back whole, and never starts empty over
data files whose manifest is gone: both are errors naming `--recover`, which rebuilds the
manifest from the headers (recovery.py) after setting the old file aside.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from tierstack.config import TierManagerConfig
from tierstack.errors import ManifestError, NvmePoolFullError
from tierstack.services.tier_manager.extent_header import ExtentMeta
from tierstack.services.tier_manager.manifest import Manifest, ManifestEntry, corrupt, set_aside
from tierstack.services.tier_manager.nvme_pool import NvmeExtent, NvmePool

log = logging.getLogger(__name__)

VERSION_RESERVATION = 100_000  # versions reserved per durable manifest write

# Called with the bytes wanted when the NVMe pool is full; True if it freed something.
MakeRoom = Callable[[int], bool]


class DurableCopies:
    """The NVMe pool and its manifest, written in the order that keeps rows honest."""

    def __init__(self, config: TierManagerConfig, make_room: MakeRoom, capacity: int,
                 rebuild: bool = False) -> None:
        self.make_room = make_room
        self.rebuild = rebuild
        self.pool = NvmePool(config.nvme_pool, capacity)
        try:
            nvme = config.nvme_pool
            path = config.resolved_manifest_path()
            if rebuild:
                aside = set_aside(path)
                if aside is not None:
                    log.warning("--recover: the old manifest is kept at %s", aside)
            elif not (path.exists() and path.stat().st_size) and self.pool.file_bytes:
                raise ManifestError(
                    f"the NVMe pool holds {self.pool.file_bytes} bytes of data in "
                    f"{', '.join(f.path for f in self.pool.files)} but its manifest {path} is "
                    f"missing; the tier manager will not start empty over it. Run "
                    f"`tierstack tier-manager --recover` with the same config to rebuild the "
                    f"manifest from the data, or remove those files to start empty")
            # Not the size: it is a cap that may change between starts ('auto' follows the
            # disk's free space); recovery checks every extent against the new one.
            layout = {"paths": [str(p) for p in nvme.paths], "block_size": nvme.aio.block_size}
            self.manifest = Manifest(path, layout)
        except BaseException:
            self.pool.close(failed_start=True)
            raise
        self._version_lock = threading.Lock()
        self._last_version = 0
        self._version_limit = 0

    def recover(self) -> list[ManifestEntry]:
        """The committed copies of an earlier instance, their extents marked used: from the
        manifest, or (rebuild) from the data's headers, written into a fresh manifest."""
        if self.rebuild:
            from tierstack.services.tier_manager.recovery import rebuild_entries

            entries, report = rebuild_entries(self.pool)
            self.manifest.commit_many(entries)
            log.warning("--recover: %s", report.summary())
            self.report = report
        else:
            entries = self.manifest.entries()
            for entry in entries:
                try:
                    self.pool.reserve(entry.extent)
                except ValueError as e:  # two rows on one extent, or an extent out of bounds
                    raise corrupt(self.manifest.path, f"the extent of key {entry.key!r:.80} "
                                  f"overlaps another row's or the file's bounds: {e}") from None
        clean = self.manifest.take_clean_mark()
        if self.rebuild or not clean:
            from tierstack.services.tier_manager.recovery import clear_orphan_headers

            start = time.monotonic()
            cleared = clear_orphan_headers(self.pool)
            log.info("after %s: cleared %d extent headers left in free space (writes in flight "
                     "at the crash, copies superseded) in %.1f s",
                     "the rebuild" if self.rebuild else "an unclean stop", cleared,
                     time.monotonic() - start)
        self._last_version = max((e.version for e in entries), default=0)
        self.pool.fit_files()  # a crashed instance's free tail goes back to the disk
        # Volatile (CPU-only) versions are not in the manifest; the reserved high-water
        # mark keeps a restarted daemon from handing any (key, version) out twice.
        self._last_version = max(self._last_version, self.manifest.version_high_water())
        self._version_limit = self._last_version
        if entries and not self.rebuild:
            log.info("recovered %d NVMe-resident tensors from %s", len(entries), self.manifest.path)
        return entries

    def next_version(self) -> int:
        """A version never handed out before, by this or any earlier instance."""
        with self._version_lock:
            self._last_version += 1
            if self._last_version > self._version_limit:
                self._version_limit = self._last_version + VERSION_RESERVATION
                self.manifest.reserve_versions(self._version_limit)
            return self._last_version

    def allocate(self, nbytes: int, meta: ExtentMeta) -> NvmeExtent:
        """A fresh extent for `nbytes` of the tensor `meta` (nothing written yet); a full
        pool asks `make_room` once (the registry drops copies it can rebuild)."""
        try:
            return self.pool.allocate(nbytes, meta)
        except NvmePoolFullError:
            if not self.make_room(nbytes):
                raise
            return self.pool.allocate(nbytes, meta)

    def write(self, meta: ExtentMeta, data: memoryview) -> tuple[NvmeExtent, tuple[int, ...]]:
        """Write a tensor's bytes and headers to a fresh extent and fdatasync; the caller
        records or frees it."""
        extent = self.allocate(len(data), meta)
        try:
            checksums = tuple(self.pool.write(extent, data, label=f"tensor {meta.key!r}")) \
                if len(data) else ()
            self.seal(extent, meta, checksums)
        except BaseException:
            self.pool.free(extent)
            raise
        return extent, checksums

    def seal(self, extent: NvmeExtent, meta: ExtentMeta, checksums: tuple[int, ...]) -> None:
        """After an extent's blocks are written: its headers, then fdatasync."""
        self.pool.write_headers(extent, meta, self.next_version(), checksums)
        self.pool.sync([extent])

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
        if extent.nbytes:
            self.pool.read(extent, dst, list(checksums), label=label)

    def close(self, failed_start: bool = False) -> None:
        if not failed_start:
            try:
                self.pool.fit_files()  # the free tail back to the disk: a clean stop leaves no slack
                self.manifest.mark_clean()  # every write finished: no orphan headers to sweep
            except Exception as e:  # noqa: BLE001 - closing must go on
                log.warning("could not shrink the NVMe files or mark the stop clean: %s", e)
        self.pool.close(failed_start=failed_start)
        if getattr(self, "manifest", None) is not None:
            self.manifest.close()
