"""The durable manifest of NVMe-resident tensors: key -> extent, metadata, checksums, version.

An embedded sqlite3 database in WAL mode with synchronous=FULL, so a committed
transaction survives a crash of the daemon or the machine. The registry writes a
tensor's data, fdatasyncs it, and only then commits its row here: a row always points
at durable bytes. The manifest also records the pool layout it was written for and
refuses to open under a different one (the extents would point at the wrong bytes).

The manifest is trusted only once it reads back whole: sqlite's own check passes and
every row parses (a key, a dtype, a shape whose bytes are the row's, an extent, one
checksum per block). Anything else is a `ManifestError` that names
`tierstack tier-manager --recover`, which rebuilds it from the data (recovery.py).
It is created 0600 in a directory of ours, and locked while a daemon uses it.
"""

from __future__ import annotations

import array
import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tierstack.dtypes import check_dtype_name, nbytes_of
from tierstack.errors import (ConfigError, ManifestError, NvmePoolFullError, StorageIOError,
                              TierstackError)
from tierstack.private_paths import ensure_private_dir, hold_lock, open_private_file
from tierstack.services.tier_manager.nvme_pool import NvmeExtent, unusable

SCHEMA_VERSION = 1
SIDE_FILES = ("-wal", "-shm")  # sqlite's own files beside the database


@dataclass(frozen=True)
class ManifestEntry:
    """One committed NVMe-resident tensor."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    version: int
    extent: NvmeExtent
    checksums: tuple[int, ...]


def corrupt(path: Path, detail: str) -> ManifestError:
    return ManifestError(
        f"the manifest {path} cannot be trusted ({detail}); the tier manager will not start "
        f"over it. Run `tierstack tier-manager --recover` with the same config: it rebuilds "
        f"the manifest from the NVMe data (every extent describes itself) and keeps this "
        f"file aside")


def set_aside(path: Path) -> Path | None:
    """Move a manifest (and sqlite's side files) out of the way before a rebuild; returns
    where it went (None if there was none)."""
    if not path.exists():
        return None
    aside = path.with_name(f"{path.name}.before-recover-{time.strftime('%Y%m%d-%H%M%S')}")
    for suffix in ("",) + SIDE_FILES:
        side = Path(str(path) + suffix)
        if side.exists():
            os.rename(side, str(aside) + suffix)
    return aside


class Manifest:
    """sqlite-backed map of committed tensors; every method is one durable transaction."""

    def __init__(self, path: Path, layout: dict) -> None:
        if path.is_dir():
            raise ConfigError(f"tier_manager.manifest_path {path} is a directory; give a file "
                              f"path (e.g. {path / 'manifest.sqlite'})")
        self.path = path
        self._lock = threading.Lock()
        try:
            ensure_private_dir(path.parent, "manifest directory", "tier_manager.manifest_path")
            self._lock_fd = hold_lock(Path(str(path) + ".lock"), f"the manifest {path}",
                                      "stop that tier manager first, or give this one another "
                                      "tier_manager.manifest_path")
        except OSError as e:
            if isinstance(e, TierstackError):
                raise
            raise unusable(path.parent, e, "manifest directory", "tier_manager.manifest_path") from None
        try:
            # Created here 0600 (sqlite would take the umask), never through a symlink; its
            # -wal and -shm files get the database's mode.
            os.close(open_private_file(path, os.O_RDWR | os.O_CREAT, "manifest"))
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            self._open(layout)
        except BaseException as e:
            if getattr(self, "_db", None) is not None:
                self._db.close()
            os.close(self._lock_fd)
            if isinstance(e, OSError) and not isinstance(e, TierstackError):
                raise unusable(path, e, "manifest", "tier_manager.manifest_path") from None
            raise

    def _open(self, layout: dict) -> None:
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            check = self._db.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise corrupt(self.path, f"sqlite's check says {check[0] if check else 'nothing'}")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS tensors (key TEXT PRIMARY KEY, dtype TEXT NOT NULL, "
                "shape TEXT NOT NULL, nbytes INTEGER NOT NULL, version INTEGER NOT NULL, "
                "extent TEXT NOT NULL, checksums BLOB NOT NULL)"
            )
            self._db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS jobs (job TEXT PRIMARY KEY, keep INTEGER "
                             "NOT NULL, quota INTEGER NOT NULL)")
            self._check_layout(layout)
        except sqlite3.DatabaseError as e:
            raise corrupt(self.path, f"sqlite: {e}") from None

    def _check_layout(self, layout: dict) -> None:
        wanted = json.dumps({"schema": SCHEMA_VERSION, **layout}, sort_keys=True)
        row = self._db.execute("SELECT value FROM meta WHERE name='layout'").fetchone()
        try:
            # Manifests written before pools were capped rather than sized recorded the size.
            same = row is not None and {k: v for k, v in json.loads(row[0]).items()
                                        if k != "size"} == json.loads(wanted)
        except (TypeError, ValueError, AttributeError):
            raise corrupt(self.path, "its layout row is not the JSON tierstack writes") from None
        if row is None:
            self._db.execute("INSERT INTO meta VALUES ('layout', ?)", (wanted,))
        elif not same and self.count():
            raise ConfigError(
                f"the manifest {self.path} was written for NVMe pool layout {row[0]}, but the "
                f"config now gives {wanted}; restore nvme_pool.paths/aio.block_size, or "
                f"point manifest_path and nvme_pool.paths at fresh directories"
            )
        elif row[0] != wanted:
            self._db.execute("UPDATE meta SET value=? WHERE name='layout'", (wanted,))

    def _write(self, what: str, sql: str, *args) -> None:
        """One statement (a transaction of its own), its failures in the project's terms."""
        with self._lock:
            try:
                self._db.execute(sql, *args)
            except sqlite3.OperationalError as e:
                if "full" in str(e):
                    raise NvmePoolFullError(
                        f"the disk under the manifest {self.path} is full ({e}) while {what}; "
                        f"nothing changed. Free space there, or move "
                        f"tier_manager.manifest_path to a disk with room") from None
                raise StorageIOError(f"the manifest {self.path} failed while {what}: {e}") from None
            except sqlite3.DatabaseError as e:
                raise StorageIOError(f"the manifest {self.path} failed while {what}: {e}; "
                                     f"restart with --recover if it persists") from None

    def commit(self, entry: ManifestEntry) -> None:
        """Insert or replace the row of `entry.key`, durably."""
        self._write(f"recording tensor {entry.key!r}", "INSERT OR REPLACE INTO tensors VALUES "
                    "(?, ?, ?, ?, ?, ?, ?)", _row(entry))

    def commit_many(self, entries: list[ManifestEntry]) -> None:
        """Insert rows in one transaction (a rebuild)."""
        with self._lock:
            try:
                self._db.execute("BEGIN")
                self._db.executemany("INSERT OR REPLACE INTO tensors VALUES (?, ?, ?, ?, ?, ?, ?)",
                                     [_row(e) for e in entries])
                self._db.execute("COMMIT")
            except sqlite3.DatabaseError as e:
                self._db.execute("ROLLBACK")
                raise StorageIOError(f"cannot write the rebuilt manifest {self.path}: {e}") from None

    def take_clean_mark(self) -> bool:
        """Whether the previous daemon closed the manifest cleanly; from now on it is not
        (until `mark_clean`), so that a crash is known at the next start."""
        row = self._db.execute("SELECT value FROM meta WHERE name='clean'").fetchone()
        self._write("marking the start", "INSERT OR REPLACE INTO meta VALUES ('clean', '0')")
        return row is None or row[0] == "1"

    def mark_clean(self) -> None:
        self._write("marking a clean stop", "INSERT OR REPLACE INTO meta VALUES ('clean', '1')")

    def version_high_water(self) -> int:
        """Versions up to this may have been handed out by an earlier daemon instance."""
        row = self._db.execute("SELECT value FROM meta WHERE name='version_hwm'").fetchone()
        try:
            return int(row[0]) if row else 0
        except (TypeError, ValueError):
            raise corrupt(self.path, f"its version mark {row[0]!r:.40} is not a number") from None

    def reserve_versions(self, upto: int) -> None:
        """Durably record that versions up to `upto` may be handed out."""
        self._write("reserving versions", "INSERT OR REPLACE INTO meta VALUES ('version_hwm', ?)",
                    (str(upto),))

    def delete(self, key: str) -> None:
        self._write(f"deleting tensor {key!r}", "DELETE FROM tensors WHERE key=?", (key,))

    def count(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM tensors").fetchone()[0]

    def entries(self) -> list[ManifestEntry]:
        """Every row, each checked; ManifestError at the first that does not parse."""
        with self._lock:
            try:
                rows = self._db.execute("SELECT * FROM tensors").fetchall()
            except sqlite3.DatabaseError as e:
                raise corrupt(self.path, f"sqlite: {e}") from None
        return [self._entry(row) for row in rows]

    def _entry(self, row: tuple) -> ManifestEntry:
        key = row[0]
        try:
            _, dtype, shape_text, nbytes, version, extent_text, crcs = row
            if not isinstance(key, str) or not isinstance(crcs, bytes) or len(crcs) % 4:
                raise ValueError("wrong column types")
            shape = tuple(json.loads(shape_text))
            if not all(type(d) is int and d >= 0 for d in shape):
                raise ValueError(f"shape {shape_text!r:.40}")
            check_dtype_name(dtype)
            if nbytes_of(dtype, shape) != nbytes or type(version) is not int or version < 0:
                raise ValueError(f"{dtype}{list(shape)} is not {nbytes} bytes, or a bad version")
            extent = NvmeExtent.from_json(json.loads(extent_text))
            checksums = array.array("I")
            checksums.frombytes(crcs)
            if extent.nbytes != nbytes or len(checksums) != extent.nblocks:
                raise ValueError(f"extent of {extent.nbytes} bytes with {len(checksums)} "
                                 f"checksums for {nbytes} bytes")
        except (TypeError, ValueError, TierstackError) as e:
            raise corrupt(self.path, f"its row for key {key!r:.80} is malformed: {e}") from None
        return ManifestEntry(key, dtype, shape, nbytes, version, extent, tuple(checksums))

    # ---- jobs (jobs.py) ---------------------------------------------------------------------

    def jobs(self) -> list[tuple[str, bool, int]]:
        """(job, keep, quota) of every job recorded."""
        with self._lock:
            rows = self._db.execute("SELECT job, keep, quota FROM jobs").fetchall()
        return [(job, bool(keep), int(quota)) for job, keep, quota in rows]

    def set_job(self, job: str, keep: bool, quota: int) -> None:
        self._write(f"recording job {job!r}", "INSERT OR REPLACE INTO jobs VALUES (?, ?, ?)",
                    (job, int(keep), quota))

    def forget_job(self, job: str) -> None:
        self._write(f"forgetting job {job!r}", "DELETE FROM jobs WHERE job=?", (job,))

    def close(self) -> None:
        with self._lock:
            self._db.close()
        os.close(self._lock_fd)


def _row(entry: ManifestEntry) -> tuple:
    crcs = array.array("I", entry.checksums).tobytes()
    return (entry.key, entry.dtype, json.dumps(list(entry.shape)), entry.nbytes, entry.version,
            json.dumps(entry.extent.to_json()), crcs)

