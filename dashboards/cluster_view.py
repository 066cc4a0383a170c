"""The cluster view: every node's snapshot and history, and their totals.

A `ClusterView` is given a function that lists the nodes to read (`NodeSource`s). The
scheduler's lists every node that registered (`RemoteNode`, read over HTTP); a tier
manager's lists itself (`LocalNode`) and the URLs in `tier_manager.metrics.cluster_nodes`.
A node that does not answer is listed as unreachable; the others still add up.

A `RemoteNode` fetches only http(s) URLs (a registered URL is the caller's word: file://
would read the scheduler's own disk), follows no redirect, presents the cluster's token
and, over https, trusts only the cluster's CA; what a node answers is parsed, never
echoed in an error (a validation message would quote what it read).
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Protocol, Sequence

from tierstack import metric_catalog as mc
from tierstack.addresses import SECURITY_DIR_ENV
from tierstack.config import SecurityConfig
from tierstack.rpc import load_credentials
from tierstack.dashboards import training_view
from tierstack.dashboards.snapshots import (ClusterHistory, ClusterSnapshot,
                                                           History, HistorySample, JobTraining,
                                                           LinkFigures, NodeError, NodeSnapshot,
                                                           TierFigures)


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


MAX_ANSWER_BYTES = 32 << 20  # a node's snapshot or history is far smaller


class NodeAnswerError(Exception):
    """A node's answer could not be used; the message says why and quotes none of it."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, "redirects are not followed", headers, fp)


class RemoteNode:
    """Another node's HTTP API (its /api/v1/node and /api/v1/node/history)."""

    def __init__(self, url: str, timeout: float = 2.0, security: SecurityConfig | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"node URL {url!r:.100} is not an http(s) URL of a host")
        self.url = url.rstrip("/")
        self.name = self.url
        self.timeout = timeout
        # The configured token only: a loopback node serves HTTP without one, and the per-user
        # token of gRPC is not for whatever listens on a port someone registered.
        creds = load_credentials(security)
        self._headers = {"Authorization": f"Bearer {creds.token}"} if creds.token else {}
        context = None
        if parts.scheme == "https":
            context = ssl.create_default_context()
            if creds.root_certs:  # the cluster's own CA; nodes share a certificate, not names
                context = ssl.create_default_context(cadata=creds.root_certs.decode())
                context.check_hostname = False
        # Only http(s) handlers: no file://, ftp:// or data: behind a redirect or a typo.
        self._opener = urllib.request.OpenerDirector()
        for handler in (urllib.request.HTTPHandler(), urllib.request.HTTPSHandler(context=context),
                        _NoRedirect(), urllib.request.HTTPErrorProcessor()):
            self._opener.add_handler(handler)

    def _get(self, path: str) -> dict:
        request = urllib.request.Request(self.url + path, headers=self._headers)
        try:
            with self._opener.open(request, timeout=self.timeout) as response:
                body = response.read(MAX_ANSWER_BYTES + 1)
        except urllib.error.HTTPError as e:
            raise NodeAnswerError(f"HTTP {e.code} from {self.url}{path}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, ssl.SSLCertVerificationError):
                # The usual cause: this process does not trust the cluster's CA (a
                # self-signed certificate made by `tierstack ray-node --make-secrets`).
                raise NodeAnswerError(
                    f"{self.url}'s certificate is not signed by a CA this process trusts "
                    f"({str(reason.verify_message or reason)[:80]}): set {SECURITY_DIR_ENV} to "
                    f"the cluster's secrets directory (its ca.pem, deploy/secrets on the head) "
                    f"or security.ca_file to the CA file; check with `curl --cacert ca.pem "
                    f"{self.url}/healthz`") from None
            raise NodeAnswerError(f"{self.url} did not answer ({type(reason).__name__}: "
                                  f"{str(reason)[:120]})") from None
        if len(body) > MAX_ANSWER_BYTES:
            raise NodeAnswerError(f"{self.url}{path} answered more than {MAX_ANSWER_BYTES} bytes")
        try:
            return json.loads(body)
        except ValueError:
            raise NodeAnswerError(f"{self.url}{path} answered something that is not JSON") from None

    def _parse(self, kind, data: dict, what: str):
        from pydantic import TypeAdapter, ValidationError  # comes with FastAPI, which serves this view
        try:
            return TypeAdapter(kind).validate_python(data)
        except ValidationError as e:
            raise NodeAnswerError(f"{self.url} answered something that is not a tierstack "
                                  f"{what} ({e.error_count()} fields do not fit)") from None

    def snapshot(self) -> NodeSnapshot:
        return self._parse(NodeSnapshot, self._get("/api/v1/node"), "node snapshot")

    def history(self, window_seconds: float) -> History:
        return self._parse(History, self._get(
            f"/api/v1/node/history?window_seconds={window_seconds:g}"), "node history")


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
            except NodeAnswerError as e:  # says why, quoting nothing the node sent
                errors.append(NodeError(source.name, str(e)))
            except Exception as e:  # noqa: BLE001 - one dead node must not blank the view
                errors.append(NodeError(source.name, f"{type(e).__name__} reading it"))
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
        present = {link for s in snapshots for link in s.links_present}
        return ClusterSnapshot(
            timestamp=max((s.timestamp for s in snapshots), default=0.0), links=links, tiers=tiers,
            stall_seconds_total=sum(s.stall_seconds_total for s in snapshots),
            workers=sum(len(s.workers) for s in snapshots), nodes=snapshots, unreachable=errors,
            training=cluster_training(snapshots),
            links_present=[link for link in mc.LINKS if link in present])

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def cluster_training(snapshots: Sequence[NodeSnapshot]) -> list[JobTraining]:
    """Each job's training over every node's workers (one rule: training_view.combine);
    its loss history merged from the nodes' by step."""
    histories: dict[str, list] = {}
    for s in snapshots:
        for job in s.training:
            histories.setdefault(job.job, []).append(job.loss_history)
    points = max((len(h) for per_job in histories.values() for h in per_job), default=0)
    return training_view.combine(
        [w.training for s in snapshots for w in s.workers if w.training is not None],
        {job: training_view.merge_loss_histories(per_job, points)
         for job, per_job in histories.items()})


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
