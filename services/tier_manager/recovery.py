"""Rebuilding the manifest from the NVMe data alone (`tierstack tier-manager --recover`).

Every stripe of every extent starts with a header (extent_header.py). A rebuild reads
each data file from end to end, keeps every intact header found at a page boundary that
is where it says it is, joins the stripes of one write, and reads each candidate's blocks
back against the checksums its headers carry. Then it decides:

- a header that lies inside the bytes of a verified extent is part of that extent's
  data (a tensor may hold any bytes, headers included), not a tensor of its own;
- of several verified copies of one key, the newest write (highest sequence number)
  wins: the older ones were superseded but not yet freed when the daemon stopped;
- an extent whose blocks do not match their checksums was being written when the daemon
  died (never acknowledged: its manifest row did not exist) or was damaged; it is left
  out and named in the report, and an older intact copy of its key, if any, is used.

A tensor deleted moments before a crash may come back (the page that clears its header
was not synced yet), and extents written before headers existed are not found. The
cost is one read of every data file plus one read of every candidate's data.
"""

from __future__ import annotations

import bisect
import logging
import os
from dataclasses import dataclass, field

from tierstack.errors import DataCorruptionError
from tierstack.services.tier_manager import extent_header
from tierstack.services.tier_manager.extent_header import StripeHeader
from tierstack.services.tier_manager.extents import Extent
from tierstack.services.tier_manager.io_engine import BlockRequest
from tierstack.services.tier_manager.manifest import ManifestEntry
from tierstack.services.tier_manager.nvme_pool import NvmeExtent, NvmePool

log = logging.getLogger(__name__)

SCAN_CHUNK = 8 << 20  # bytes read at a time while looking for headers
VERIFY_BLOCKS = 16  # blocks read back at a time while checking a candidate


@dataclass
class RecoveryReport:
    """What a rebuild found, for the log and the operator."""

    scanned_bytes: int = 0
    headers: int = 0
    recovered: int = 0
    recovered_bytes: int = 0
    superseded: int = 0
    inside_other_data: int = 0
    damaged: list[str] = field(default_factory=list)  # keys of extents that failed their checksums
    incomplete: int = 0  # writes missing a stripe's header (torn across drives)
    foreign: int = 0  # headers of another pool layout (block size, drive count)

    def summary(self) -> str:
        line = (f"recovered {self.recovered} tensors ({self.recovered_bytes} bytes) from "
                f"{self.headers} extent headers in {self.scanned_bytes} bytes of NVMe data; "
                f"{self.superseded} older copies superseded")
        if self.damaged:
            shown = ", ".join(repr(k) for k in self.damaged[:5])
            line += (f"; {len(self.damaged)} extents left out, their data not matching their "
                     f"checksums (writes cut by the crash, or damage): {shown}"
                     f"{' ...' if len(self.damaged) > 5 else ''}")
        if self.incomplete or self.foreign:
            line += f"; {self.incomplete} incomplete and {self.foreign} foreign headers ignored"
        return line


@dataclass
class _Candidate:
    headers: list[StripeHeader]
    extent: NvmeExtent
    checksums: tuple[int, ...]

    @property
    def first(self) -> StripeHeader:
        return self.headers[0]

    def regions(self) -> list[tuple[int, int, int]]:
        return [(d, e.offset, e.end) for d, e in self.extent.stripes]


def scan_headers(pool: NvmePool, report: RecoveryReport) -> list[StripeHeader]:
    """Every intact header in the pool's data files, at the place it names."""
    found = []
    for drive, f in enumerate(pool.files):
        fd = os.open(f.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            report.scanned_bytes += size
            for base in range(0, size, SCAN_CHUNK):
                chunk = os.pread(fd, SCAN_CHUNK, base)
                at = chunk.find(extent_header.MAGIC)
                while at >= 0:
                    if at % extent_header.PAGE == 0:
                        header = _read_header(fd, base + at, chunk[at:at + extent_header.PAGE])
                        if header is not None and _placed(header, drive, base + at):
                            found.append(header)
                    at = chunk.find(extent_header.MAGIC, at + 1)
        finally:
            os.close(fd)
    report.headers = len(found)
    return found


def _read_header(fd: int, position: int, page: bytes) -> StripeHeader | None:
    length = extent_header.peek_length(page)
    if not length:
        return None
    return extent_header.decode(os.pread(fd, length, position))


def _placed(header: StripeHeader, drive: int, position: int) -> bool:
    """A header is real only where it says it is: its own stripe, on this drive, here."""
    d, offset, _ = header.stripes[header.slot]
    return header.drive == drive == d and offset == position


def _candidates(pool: NvmePool, headers: list[StripeHeader], report: RecoveryReport) -> list[_Candidate]:
    """Headers joined into whole writes (every stripe's header present and agreeing)."""
    writes: dict[tuple, list[StripeHeader]] = {}
    for h in headers:
        if h.block_size != pool.block_size or any(d >= len(pool.files) for d, _, _ in h.stripes):
            report.foreign += 1
            continue
        writes.setdefault((h.seq, h.meta, h.nbytes, h.stripes, h.header_len), []).append(h)
    out = []
    for (seq, meta, nbytes, stripes, header_len), parts in writes.items():
        parts.sort(key=lambda h: h.slot)
        if [h.slot for h in parts] != list(range(len(stripes))):
            report.incomplete += 1
            continue
        extent = NvmeExtent(nbytes, pool.block_size,
                            tuple((d, Extent(o, n)) for d, o, n in stripes), header_len)
        slots = len(stripes)
        checksums = tuple(parts[j % slots].checksums[j // slots] for j in range(extent.nblocks)) \
            if all(len(h.checksums) == len(range(h.slot, extent.nblocks, slots)) for h in parts) else None
        if checksums is None:
            report.incomplete += 1
            continue
        out.append(_Candidate(parts, extent, checksums))
    return out


def _verified(pool: NvmePool, candidate: _Candidate, scratch: bytearray) -> bool:
    """Whether every block of the candidate reads back with its checksum."""
    extent = candidate.extent
    for first in range(0, extent.nblocks, VERIFY_BLOCKS):
        end = min(extent.nblocks, first + VERIFY_BLOCKS)
        nbytes = min(extent.nbytes, end * extent.block_size) - first * extent.block_size
        try:
            pool.read(extent, memoryview(scratch)[:nbytes], list(candidate.checksums[first:end]),
                      label=f"recovery of {candidate.first.meta.key!r}", blocks=(first, end))
        except DataCorruptionError:
            return False
    return True


def rebuild_entries(pool: NvmePool) -> tuple[list[ManifestEntry], RecoveryReport]:
    """The manifest rows the data supports (versions are the writes' sequence numbers), and
    what was found; the pool's allocators are left holding the recovered extents."""
    report = RecoveryReport()
    candidates = _candidates(pool, scan_headers(pool, report), report)
    scratch = bytearray(VERIFY_BLOCKS * pool.block_size)
    verified, damaged = [], []
    for c in candidates:
        (verified if _verified(pool, c, scratch) else damaged).append(c)
    # A header inside the bytes of a verified extent is that extent's data.
    starts: dict[int, list[tuple[int, int]]] = {}  # drive -> sorted (offset, candidate index)
    for i, c in enumerate(candidates):
        for d, o, _ in c.regions():
            starts.setdefault(d, []).append((o, i))
    for d in starts:
        starts[d].sort()
    inside = set()
    for c in verified:
        for d, lo, hi in c.regions():
            on_drive = starts.get(d, [])
            at = bisect.bisect_right(on_drive, (lo, len(candidates)))
            while at < len(on_drive) and on_drive[at][0] < hi:
                inside.add(id(candidates[on_drive[at][1]]))
                at += 1
    report.inside_other_data = len(inside)
    report.damaged = [c.first.meta.key for c in damaged if id(c) not in inside]
    entries, seen = [], set()
    for c in sorted(verified, key=lambda c: -c.first.seq):
        meta = c.first.meta
        if id(c) in inside:
            continue
        if meta.key in seen:
            report.superseded += 1
            continue
        try:
            pool.reserve(c.extent)
        except ValueError:  # overlaps a newer write that reused its room: it is gone
            report.superseded += 1
            continue
        seen.add(meta.key)
        entries.append(ManifestEntry(meta.key, meta.dtype, meta.shape, c.extent.nbytes,
                                     c.first.seq, c.extent, c.checksums))
        report.recovered += 1
        report.recovered_bytes += c.extent.nbytes
    entries.sort(key=lambda e: e.version)
    return entries, report


def clear_orphan_headers(pool: NvmePool) -> int:
    """Zero every extent header lying in the pool's free space; returns how many.

    Run before serving, after a crash or a rebuild, with the allocators holding exactly
    the recorded extents. A header in free space belongs to no recorded tensor: a write
    that was in flight when the daemon died (never acknowledged), or a copy a rebuild left
    out. Left there, a later rebuild would bring it back. Costs one read of the free space
    inside the data files (only after a crash)."""
    cleared = 0
    zero = memoryview(bytes(extent_header.PAGE))
    for drive, f in enumerate(pool.files):
        fd = os.open(f.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        requests = []
        try:
            size = os.fstat(fd).st_size
            for free in pool.allocators[drive].free_ranges():
                for base in range(free.offset, min(free.end, size), SCAN_CHUNK):
                    chunk = os.pread(fd, min(SCAN_CHUNK, free.end - base, size - base), base)
                    at = chunk.find(extent_header.MAGIC)
                    while at >= 0:
                        if at % extent_header.PAGE == 0:
                            requests.append(BlockRequest(f.fd, base + at, extent_header.PAGE, zero,
                                                         label="orphan header clear"))
                        at = chunk.find(extent_header.MAGIC, at + 1)
        finally:
            os.close(fd)
        if requests:
            pool.engine.write(requests)
            f.sync()
            cleared += len(requests)
    return cleared
