"""The node's bandwidth history: a ring of fixed size, allocated once.

The dashboard shows `history_seconds` of one-per-interval samples (15 minutes by
default). Kept as objects in a deque, those samples made the daemon's heap creep for the
whole window after every start (~0.7 KB a sample); here they are rows of one preallocated
float array, so the daemon's memory is the same at minute 1 and minute 100. Samples are
made back into `HistorySample`s only when someone asks for the history.
"""

from __future__ import annotations

from array import array

from tierstack import metric_catalog as mc
from tierstack.dashboards.snapshots import HistorySample

_COLUMNS = ("timestamp", *mc.LINKS, *mc.TIERS, "stall")


class HistoryRing:
    """The last `size` samples, oldest overwritten first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._rows = array("d", bytes(8 * size * len(_COLUMNS)))
        self._next = 0  # the row the next sample goes to
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def append(self, sample: HistorySample) -> None:
        values = (sample.timestamp, *(sample.links.get(link, 0.0) for link in mc.LINKS),
                  *(sample.tiers_used.get(tier, 0) for tier in mc.TIERS),
                  sample.stall_seconds_per_second)
        start = self._next * len(_COLUMNS)
        self._rows[start:start + len(_COLUMNS)] = array("d", values)
        self._next = (self._next + 1) % self.size
        self._count = min(self._count + 1, self.size)

    def since(self, cutoff: float) -> list[HistorySample]:
        """The samples taken at or after `cutoff`, oldest first."""
        width, links, tiers = len(_COLUMNS), len(mc.LINKS), len(mc.TIERS)
        out = []
        for i in range(self._count):
            row = (self._next - self._count + i) % self.size * width
            if self._rows[row] < cutoff:
                continue
            values = self._rows[row:row + width]
            out.append(HistorySample(
                timestamp=values[0], links=dict(zip(mc.LINKS, values[1:1 + links])),
                tiers_used={tier: int(v) for tier, v in zip(mc.TIERS, values[1 + links:1 + links + tiers])},
                stall_seconds_per_second=values[-1]))
        return out
