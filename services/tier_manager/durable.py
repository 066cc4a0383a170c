"""Durable copies on NVMe: the bytes first, then the manifest row that points at them.

`DurableCopies` owns the node's `NvmePool` and `Manifest`. A durable write goes to a
fresh extent, its blocks and then its self-describing headers (extent_header.py), and is
fdatasync'ed before its row may be committed (`record`), so a row always points at
durable bytes and a crash mid-write leaves the old version intact. It also hands out
versions: one counter for the whole registry, reserved in the manifest in batches, so
that a restarted daemon never hands the same (key, version) out twice; the same counter
numbers the writes in the headers, so the newest copy of a key is the highest.
It knows nothing of CPU copies, pins or eviction: the registry decides what to write.

Rows now, or rows in groups. A durable write (a put to NVMe, a durable commit) is
synced and its row committed before the call returns (`write` + `record`). A copy nobody
asked to be durable at once (an eviction, a non-durable optimizer step's new version)
is written without a sync and its row waits for the next group (`record_later`): a thread
syncs every waiting copy's drives once and commits their rows in one transaction. Each
fdatasync flushes the drive's cache (measured ~6 ms after a 4 MiB write on the dev
machine's virtio disk, as long as the write itself), and a streamed AdamW step made four
of them per block, plus a sqlite commit with its own fsync per tensor, all on the step's
path. The rule that keeps rows honest either way: an extent a committed or committing row
points at is not freed (`free` defers it) until the key's row points elsewhere, so a crash
before a group finds every key at its last committed version, intact; a copy whose
version is replaced or deleted before its group never gets a row.

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

    def __init__(self, config: TierManagerConfig, capacity: int, rebuild: bool = False,
                 make_room: MakeRoom | None = None) -> None:
        self._make_room: MakeRoom = make_room or (lambda nbytes: False)
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
        self._rows = threading.Condition()  # guards the row bookkeeping below
        self._row_extent: dict[str, NvmeExtent] = {}  # key -> the extent its committed row names
        self._named: set[NvmeExtent] = set()  # extents named by committed rows
        self._freed_named: set[NvmeExtent] = set()  # freed by the registry while still named
        self._waiting: dict[str, ManifestEntry] = {}  # rows for the next group, the newest per key
        self._committing: dict[str, NvmeExtent] = {}  # the group being committed: key -> extent
        self._commit_lock = threading.Lock()  # one manifest writer at a time: rows stay in order
        self._committer: threading.Thread | None = None
        self._stopping = False

    def make_room_with(self, make_room: MakeRoom) -> None:
        """Who drops NVMe copies it can rebuild when the pool is full (the spill part)."""
        self._make_room = make_room

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
        for entry in entries:
            self._row_extent[entry.key] = entry.extent
            self._named.add(entry.extent)
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
        """A fresh extent for `nbytes` of the tensor `meta` (nothing written yet). A full
        pool first commits the waiting rows (the old versions they replace are freed),
        then asks `make_room` once (the registry drops copies it can rebuild)."""
        try:
            return self.pool.allocate(nbytes, meta)
        except NvmePoolFullError:
            if self.drain():
                try:
                    return self.pool.allocate(nbytes, meta)
                except NvmePoolFullError:
                    pass
            if not self._make_room(nbytes):
                raise
            return self.pool.allocate(nbytes, meta)

    def write(self, meta: ExtentMeta, data: memoryview,
              sync: bool = True) -> tuple[NvmeExtent, tuple[int, ...]]:
        """Write a tensor's bytes and headers to a fresh extent and (`sync`) fdatasync; the
        caller records (or, not synced, records later) or frees it."""
        extent = self.allocate(len(data), meta)
        try:
            checksums = tuple(self.pool.write(extent, data, label=f"tensor {meta.key!r}")) \
                if len(data) else ()
            self.seal(extent, meta, checksums, sync)
        except BaseException:
            self.pool.free(extent)
            raise
        return extent, checksums

    def seal(self, extent: NvmeExtent, meta: ExtentMeta, checksums: tuple[int, ...],
             sync: bool = True) -> None:
        """After an extent's blocks are written: its headers, then (`sync`) fdatasync."""
        self.pool.write_headers(extent, meta, self.next_version(), checksums)
        if sync:
            self.pool.sync([extent])

    def record(self, entry: ManifestEntry) -> None:
        """Commit the row of a copy `write` made durable (it survives a crash from now on)."""
        with self._commit_lock:
            with self._rows:
                self._waiting.pop(entry.key, None)  # an older copy's: it never gets a row
            self.manifest.commit(entry)
            self._renamed(entry.key, entry.extent)

    def record_later(self, entry: ManifestEntry) -> None:
        """Commit the row of a copy written without a sync in the next group, after a sync
        of its drives (see the module docstring). Until then a restart finds the key's
        previous committed version, or none."""
        with self._rows:
            self._waiting[entry.key] = entry
            if self._committer is None:
                self._committer = threading.Thread(target=self._commit_groups, daemon=True,
                                                   name="tierstack-manifest-groups")
                self._committer.start()
            self._rows.notify_all()

    def forget(self, key: str) -> None:
        """Delete `key`'s row (and any row waiting for it): after a restart it is not
        recovered."""
        with self._rows:
            if key not in self._row_extent and key not in self._waiting \
                    and key not in self._committing:
                return  # no row to delete: no transaction (one per tensor of every step)
        with self._commit_lock:
            with self._rows:
                self._waiting.pop(key, None)
                named = key in self._row_extent
            if named:
                self.manifest.delete(key)
                self._renamed(key, None)

    def free(self, extent: NvmeExtent | None) -> None:
        """Give an extent back, once no committed or committing row names it (then when the
        key's row moves on); a row still waiting for it is dropped."""
        if extent is None or not extent.stripes:
            return
        with self._rows:
            if extent in self._named or extent in self._committing.values():
                self._freed_named.add(extent)
                return
            for key in [k for k, e in self._waiting.items() if e.extent == extent]:
                del self._waiting[key]
        self.pool.free(extent)

    def drain(self) -> bool:
        """Commit every waiting row now; whether there were any."""
        with self._rows:
            if not self._waiting and not self._committing:
                return False
            self._rows.wait_for(lambda: not self._waiting and not self._committing)
        return True

    def _renamed(self, key: str, extent: NvmeExtent | None) -> None:
        """`key`'s committed row now names `extent` (None: it has none); the extent it named
        before is freed if the registry let go of it meanwhile (commit lock held)."""
        with self._rows:
            old = self._row_extent.pop(key, None)
            if extent is not None:
                self._row_extent[key] = extent
                self._named.add(extent)
            release = old is not None and old != extent and old in self._freed_named
            if old is not None and old != extent:
                self._named.discard(old)
                self._freed_named.discard(old)
        if release:
            self.pool.free(old)

    def _commit_groups(self) -> None:
        while True:
            with self._rows:
                self._rows.wait_for(lambda: self._waiting or self._stopping)
                if not self._waiting:
                    return  # stopping, and every row committed
            # The commit lock before the group is taken: a `forget` or `record` runs wholly
            # before it (and drops its key's waiting row) or after it (and sees its row).
            with self._commit_lock:
                with self._rows:
                    group = list(self._waiting.values())
                    self._waiting.clear()
                    self._committing = {e.key: e.extent for e in group}
                try:
                    if group:
                        self.pool.sync([e.extent for e in group])
                        self.manifest.commit_many(group)
                except Exception as e:  # noqa: BLE001 - the copies stay readable; rows stay older
                    log.error("could not make %d NVMe copies durable (%s): they are readable now "
                              "but a restart finds their keys' previous versions; check the disk "
                              "under the NVMe pool", len(group), e)
                    self._release_unnamed([entry.extent for entry in group])
                else:
                    for entry in group:
                        self._renamed(entry.key, entry.extent)
                finally:
                    with self._rows:
                        self._committing = {}
                        self._rows.notify_all()

    def _release_unnamed(self, extents: list[NvmeExtent]) -> None:
        """Free those of `extents` the registry let go of and no row names (a group that
        could not be committed)."""
        with self._rows:
            release = [e for e in extents if e in self._freed_named and e not in self._named]
            self._freed_named.difference_update(release)
        for extent in release:
            self.pool.free(extent)

    def read(self, extent: NvmeExtent, dst: memoryview, checksums: tuple[int, ...], label: str) -> None:
        """Fill `dst` from `extent`, every block's checksum verified."""
        if extent.nbytes:
            self.pool.read(extent, dst, list(checksums), label=label)

    def close(self, failed_start: bool = False) -> None:
        with self._rows:
            self._stopping = True
            self._rows.notify_all()
        if self._committer is not None:
            self._committer.join()  # the waiting rows are committed first
        if not failed_start:
            try:
                self.pool.fit_files()  # the free tail back to the disk: a clean stop leaves no slack
                self.manifest.mark_clean()  # every write finished: no orphan headers to sweep
            except Exception as e:  # noqa: BLE001 - closing must go on
                log.warning("could not shrink the NVMe files or mark the stop clean: %s", e)
        self.pool.close(failed_start=failed_start)
        if getattr(self, "manifest", None) is not None:
            self.manifest.close()
