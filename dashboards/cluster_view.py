"""The cluster view: every node's snapshot and history, and their totals.

A `ClusterView` is given a function that lists the nodes to read (`NodeSource`s). The
scheduler's lists every node that registered (`RemoteNode`, read over HTTP); a tier
manager's lists itself (`LocalNode`) and the URLs in `tier_manager.metrics.cluster_nodes`.
A node that does not answer is listed as unreachable; the others still add up.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Protocol, Sequence

from tierstack import metric_catalog as mc
from tierstack.dashboards.snapshots import (ClusterHistory, ClusterSnapshot,
                                                           History, HistorySample, LinkFigures,
                                                           NodeError, NodeSnapshot, TierFigures)


class NodeSource(Protocol):
    """A node the cluster view reads."""

    name: str

    def snapshot(self) -> NodeSnapshot: ...

    def history(self, window_seconds: float) -> History: ...


class LocalNode:
    """The node this process serves (its NodeMetrics), read without HTTP."""

    def __init__(self, metrics) -> None:
        self.metrics = metrics
        self.name = metrics.node

    def snapshot(self) -> NodeSnapshot:
        return self.metrics.snapshot()

    def history(self, window_seconds: float) -> History:
        return self.metrics.history(window_seconds)


class RemoteNode:
    """Another node's HTTP API (its /api/v1/node and /api/v1/node/history)."""

    def __init__(self, url: str, timeout: float = 2.0) -> None:
        self.url = url.rstrip("/")
        self.name = self.url
        self.timeout = timeout

    def _get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=self.timeout) as response:
            return json.loads(response.read())

    def snapshot(self) -> NodeSnapshot:
        from pydantic import TypeAdapter  # comes with FastAPI, which serves this view
        return TypeAdapter(NodeSnapshot).validate_python(self._get("/api/v1/node"))

    def history(self, window_seconds: float) -> History:
        from pydantic import TypeAdapter
        return TypeAdapter(History).validate_python(
            self._get(f"/api/v1/node/history?window_seconds={window_seconds:g}"))


class ClusterView:
    """Reads the nodes `nodes()` lists, in parallel, and adds their figures up."""

    def __init__(self, nodes: Callable[[], Sequence[NodeSource]]) -> None:
        self.nodes = nodes
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="tierstack-cluster-view")

    def _gather(self, read: Callable[[NodeSource], object]):
        sources = list(self.nodes())
        futures = [self._pool.submit(read, source) for source in sources]
        results, errors = [], []
        for source, future in zip(sources, futures):
            try:
                results.append(future.result())
            except Exception as e:  # noqa: BLE001 - one dead node must not blank the view
                errors.append(NodeError(source.name, f"{type(e).__name__}: {e}"))
        return results, errors

    def history(self, window_seconds: float) -> ClusterHistory:
        histories, errors = self._gather(lambda n: n.history(window_seconds))
        return ClusterHistory(total=sum_histories(histories), nodes=histories, unreachable=errors)

    def snapshot(self, window_seconds: float = 900.0) -> ClusterSnapshot:
        snapshots, errors = self._gather(lambda n: n.snapshot())
        # A summed history is needed for the peaks only when there is more than one node.
        total_peaks = self.history(window_seconds).total.peaks if len(snapshots) > 1 else {}
        links = {}
        for link in mc.LINKS:
            links[link] = LinkFigures(
                bytes_total=sum(s.links[link].bytes_total for s in snapshots),
                bandwidth_bytes_per_second=sum(s.links[link].bandwidth_bytes_per_second for s in snapshots),
                # The summed history's peak, and never below a single node's own peak
                # (kept since that node started, longer than the history window).
                peak_bytes_per_second=max([total_peaks.get(link, 0.0)] +
                                          [s.links[link].peak_bytes_per_second for s in snapshots]))
        tiers = {tier: TierFigures(
            used_bytes=sum(s.tiers[tier].used_bytes for s in snapshots),
            capacity_bytes=sum(s.tiers[tier].capacity_bytes for s in snapshots),
            bandwidth_bytes_per_second=sum(s.tiers[tier].bandwidth_bytes_per_second for s in snapshots))
            for tier in mc.TIERS}
        return ClusterSnapshot(
            timestamp=max((s.timestamp for s in snapshots), default=0.0), links=links, tiers=tiers,
            stall_seconds_total=sum(s.stall_seconds_total for s in snapshots),
            workers=sum(len(s.workers) for s in snapshots), nodes=snapshots, unreachable=errors)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def sum_histories(histories: Sequence[History]) -> History:
    """The cluster total: samples of all nodes summed per sample interval.

    Nodes sample on their own clocks; samples are matched by the interval their
    timestamp falls in. The peaks are the highest summed rates in the window.
    """
    interval = histories[0].interval_seconds if histories else 1.0
    slots: dict[int, HistorySample] = {}
    for history in histories:
        for s in history.samples:
            slot = round(s.timestamp / interval)
            total = slots.get(slot)
            if total is None:
                total = slots[slot] = HistorySample(slot * interval, {link: 0.0 for link in mc.LINKS},
                                                    {tier: 0 for tier in mc.TIERS}, 0.0)
            for link in mc.LINKS:
                total.links[link] += s.links.get(link, 0.0)
            for tier in mc.TIERS:
                total.tiers_used[tier] += s.tiers_used.get(tier, 0)
            total.stall_seconds_per_second += s.stall_seconds_per_second
    samples = [slots[k] for k in sorted(slots)]
    peaks = {link: max((s.links[link] for s in samples), default=0.0) for link in mc.LINKS}
    return History("cluster", interval, peaks, samples)
