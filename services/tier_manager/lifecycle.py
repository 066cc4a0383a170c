"""A tensor record's one lifecycle: a phase at a time, every move asserted.

A record is one version of one key: where its bytes are (a CPU-pool buffer, an NVMe
extent, or both), how many readers pin it, and its `Phase`. Each move is one method that
asserts the phases it may come from, as PyTorch FSDP2's `FSDPParam._assert_in_states`
does: a race shows up as a `LifecycleError` at its cause, not as lost bytes three calls
later. Every move and every pin change is reported to the record's observer (the map it
lives in, records.py, which notifies its one condition there), so whoever waits for a
record (a fetch for a load, an allocation for room) re-checks.

    IDLE      the current version, at rest; readers may pin it
    LOADING   a fetch reads its NVMe bytes into a CPU-pool buffer (the loader pins it)
    CLAIMED   held for an update in place that has not begun (an optimizer step claims
              every tensor it changes before it changes any): readers are refused
    UPDATING  changed in place by its one updater, whose pin is the only one
    LEAVING   its CPU copy is being written out and dropped (an eviction); a reader that
              pins it meanwhile keeps the copy
    RETIRED   replaced or deleted: its bytes are freed when the last pin goes (terminal)

    start_loading  IDLE -> LOADING          end_loading   LOADING -> IDLE
    claim          IDLE -> CLAIMED          drop_claim    CLAIMED -> IDLE
    start_update   CLAIMED -> UPDATING      end_update    UPDATING -> IDLE
    start_leaving  IDLE -> LEAVING          end_leaving   LEAVING -> IDLE
    retire         any phase but RETIRED -> RETIRED
    The four moves back to IDLE leave a record that was retired meanwhile RETIRED.

Pins: `pin` in IDLE or LEAVING; `claim` needs exactly one pin (the updater's, which it
keeps until the update ends) and `start_leaving` none; `unpin` in any phase while pinned.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

from tierstack.services.tier_manager.cpu_pool import CpuBuffer
from tierstack.services.tier_manager.nvme_pool import NvmeExtent
from tierstack.services.tier_manager.types import TensorInfo
from tierstack.tiers import Placement


class Phase(enum.Enum):
    IDLE = "idle"
    LOADING = "loading"
    CLAIMED = "claimed"
    UPDATING = "updating"
    LEAVING = "leaving"
    RETIRED = "retired"


class LifecycleError(AssertionError):
    """A record was moved from a phase the move does not come from: a bug in the daemon."""


@dataclass(eq=False)
class TensorRecord:
    """One version of one key. Moved only under its map's lock (records.py)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    version: int
    cpu: CpuBuffer | None = None
    nvme: NvmeExtent | None = None
    checksums: tuple[int, ...] = ()
    placement: Placement = "auto"
    durable: bool = False  # its NVMe copy was committed by its writer, not by an eviction
    read_ahead: bool = False  # loaded by a prefetch hint and not used since: it stays
    phase: Phase = Phase.IDLE
    pins: int = 0
    observer: "Observer | None" = field(default=None, repr=False)  # told of every move

    def info(self) -> TensorInfo:
        return TensorInfo(self.key, self.dtype, self.shape, self.nbytes, self.version,
                          self.cpu is not None, self.nvme is not None)

    # ---- moves --------------------------------------------------------------------------

    def start_loading(self) -> None:
        self._assert_pinned(at_least=1)
        self._move(Phase.LOADING, Phase.IDLE)

    def end_loading(self) -> None:
        self._end(Phase.LOADING)

    def claim(self) -> None:
        self._assert_pinned(at_least=1, at_most=1)  # the updater's own pin, nobody else's
        self._move(Phase.CLAIMED, Phase.IDLE)

    def drop_claim(self) -> None:
        self._end(Phase.CLAIMED)

    def start_update(self) -> None:
        self._move(Phase.UPDATING, Phase.CLAIMED)

    def end_update(self) -> None:
        self._end(Phase.UPDATING)

    def start_leaving(self) -> None:
        self._assert_pinned(at_most=0)
        self._move(Phase.LEAVING, Phase.IDLE)

    def end_leaving(self) -> None:
        self._end(Phase.LEAVING)

    def retire(self) -> None:
        self._move(Phase.RETIRED, *(p for p in Phase if p is not Phase.RETIRED))

    def pin(self) -> None:
        self._assert_in(Phase.IDLE, Phase.LEAVING)
        self.pins += 1
        self._moved()

    def unpin(self) -> None:
        self._assert_pinned(at_least=1)
        self.pins -= 1
        self._moved()

    # ---- what the moves check -------------------------------------------------------------

    @property
    def at_rest(self) -> bool:
        """Current, and no load, update or eviction under way."""
        return self.phase is Phase.IDLE

    def _end(self, phase: Phase) -> None:
        if self.phase is Phase.RETIRED:  # replaced or deleted meanwhile: it stays retired
            self._moved()
            return
        self._move(Phase.IDLE, phase)

    def _move(self, to: Phase, *allowed: Phase) -> None:
        self._assert_in(*allowed)
        old, self.phase = self.phase, to
        if self.observer is not None:
            self.observer(self, old, to)

    def _assert_in(self, *phases: Phase) -> None:
        if self.phase not in phases:
            raise LifecycleError(f"{self.key!r} v{self.version} is {self.phase.value}; this move "
                                 f"comes only from {', '.join(p.value for p in phases)}")

    def _assert_pinned(self, at_least: int = 0, at_most: int | None = None) -> None:
        if self.pins < at_least or (at_most is not None and self.pins > at_most):
            raise LifecycleError(f"{self.key!r} v{self.version} has {self.pins} pins; this move "
                                 f"needs {at_least}..{'' if at_most is None else at_most}")

    def _moved(self) -> None:
        if self.observer is not None:
            self.observer(self, self.phase, self.phase)


Observer = Callable[[TensorRecord, Phase, Phase], None]  # (record, from, to)
