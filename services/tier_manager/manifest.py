"""The durable manifest of NVMe-resident tensors: key -> extent, metadata, checksums, version.

An embedded sqlite3 database in WAL mode with synchronous=FULL, so a committed
transaction survives a crash of the daemon or the machine. The registry writes a
tensor's data, fdatasyncs it, and only then commits its row here: a row always points
at durable bytes. The manifest also records the pool layout it was written for and
refuses to open under a different one (the extents would point at the wrong bytes).
"""

from __future__ import annotations

import array
import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

from tierstack.services.tier_manager.nvme_pool import NvmeExtent
from tierstack.errors import ConfigError

SCHEMA_VERSION = 1


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


class Manifest:
    """sqlite-backed map of committed tensors; every method is one durable transaction."""

    def __init__(self, path: Path, layout: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS tensors (key TEXT PRIMARY KEY, dtype TEXT NOT NULL, "
            "shape TEXT NOT NULL, nbytes INTEGER NOT NULL, version INTEGER NOT NULL, "
            "extent TEXT NOT NULL, checksums BLOB NOT NULL)"
        )
        self._db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
        self._check_layout(layout)

    def _check_layout(self, layout: dict) -> None:
        wanted = json.dumps({"schema": SCHEMA_VERSION, **layout}, sort_keys=True)
        row = self._db.execute("SELECT value FROM meta WHERE name='layout'").fetchone()
        # Manifests written before pools were capped rather than sized recorded the size.
        same = row is not None and {k: v for k, v in json.loads(row[0]).items()
                                    if k != "size"} == json.loads(wanted)
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

    def commit(self, entry: ManifestEntry) -> None:
        """Insert or replace the row of `entry.key`, durably."""
        crcs = array.array("I", entry.checksums).tobytes()
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO tensors VALUES (?, ?, ?, ?, ?, ?, ?)",
                (entry.key, entry.dtype, json.dumps(list(entry.shape)), entry.nbytes,
                 entry.version, json.dumps(entry.extent.to_json()), crcs),
            )

    def version_high_water(self) -> int:
        """Versions up to this may have been handed out by an earlier daemon instance."""
        row = self._db.execute("SELECT value FROM meta WHERE name='version_hwm'").fetchone()
        return int(row[0]) if row else 0

    def reserve_versions(self, upto: int) -> None:
        """Durably record that versions up to `upto` may be handed out."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('version_hwm', ?)", (str(upto),))

    def delete(self, key: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM tensors WHERE key=?", (key,))

    def count(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM tensors").fetchone()[0]

    def entries(self) -> list[ManifestEntry]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM tensors").fetchall()
        out = []
        for key, dtype, shape, nbytes, version, extent, crcs in rows:
            checksums = array.array("I")
            checksums.frombytes(crcs)
            out.append(ManifestEntry(key, dtype, tuple(json.loads(shape)), nbytes, version,
                                     NvmeExtent.from_json(json.loads(extent)), tuple(checksums)))
        return out

    def close(self) -> None:
        with self._lock:
            self._db.close()
