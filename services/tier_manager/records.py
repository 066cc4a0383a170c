"""The map of current tensor records, the one lock over every record, and the one
condition every move of a record notifies (lifecycle.py: the moves themselves)."""

from __future__ import annotations

import threading
from typing import Callable

from tierstack.errors import KeyNotFoundError
from tierstack.services.tier_manager.lifecycle import Phase, TensorRecord

FreeBytes = Callable[[TensorRecord], None]


class Records:
    """The map of current records, the one lock over every record, and the one condition
    every move notifies. Frees a retired record's bytes (with `free`) when its last pin
    goes, and never before."""

    def __init__(self, free: FreeBytes) -> None:
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self._free = free
        self._current: dict[str, TensorRecord] = {}
        # The records in a passing phase (few at a time): what room is on its way, and
        # whether anything is under way at all, without a walk over every record.
        self._passing: dict[Phase, set[TensorRecord]] = {
            p: set() for p in (Phase.LOADING, Phase.CLAIMED, Phase.UPDATING, Phase.LEAVING)}

    def moved(self, record: TensorRecord, old: Phase, new: Phase) -> None:
        """Every phase move ends here: the one place the condition is notified for it."""
        if old in self._passing:
            self._passing[old].discard(record)
        if new in self._passing:
            self._passing[new].add(record)
        self.changed.notify_all()

    def in_phase(self, phase: Phase) -> list[TensorRecord]:
        """The records in a passing phase now (any but IDLE and RETIRED; lock held)."""
        return list(self._passing[phase])

    def new(self, key: str, dtype: str, shape: tuple[int, ...], nbytes: int, version: int,
            **fields) -> TensorRecord:
        """A record bound to this map (not current until `swap`)."""
        return TensorRecord(key, dtype, shape, nbytes, version, observer=self.moved, **fields)

    def get(self, key: str) -> TensorRecord:
        """The current record of `key` (lock held); NOT_FOUND if there is none."""
        try:
            return self._current[key]
        except KeyError:
            raise KeyNotFoundError(f"no tensor is stored under key {key!r}") from None

    def find(self, key: str) -> TensorRecord | None:
        return self._current.get(key)

    def is_current(self, record: TensorRecord) -> bool:
        return self._current.get(record.key) is record

    def swap(self, record: TensorRecord) -> TensorRecord | None:
        """Make `record` current; the record it replaces (retired here), if any."""
        with self.lock:
            old = self._current.get(record.key)
            self._current[record.key] = record
            if old is not None:
                self._retire(old)
            return old

    def remove(self, record: TensorRecord) -> None:
        """`record` is current no more (deleted): retired here."""
        with self.lock:
            assert self._current.get(record.key) is record, f"{record.key!r} is not current"
            del self._current[record.key]
            self._retire(record)

    def _retire(self, record: TensorRecord) -> None:
        with self.lock:
            record.retire()
            if record.pins == 0:
                self._free(record)

    def unpin(self, record: TensorRecord) -> None:
        """Drop one pin; the last pin of a retired record frees its bytes."""
        with self.lock:
            record.unpin()
            if record.pins == 0 and record.phase is Phase.RETIRED:
                self._free(record)

    def keys(self) -> list[str]:
        with self.lock:
            return list(self._current)

    def values(self) -> list[TensorRecord]:
        with self.lock:
            return list(self._current.values())

    def under(self, prefix: str) -> list[tuple[str, int]]:
        """(key, version) of the current records whose keys start with `prefix`."""
        with self.lock:
            return [(k, r.version) for k, r in self._current.items() if k.startswith(prefix)]

    def __len__(self) -> int:
        return len(self._current)
