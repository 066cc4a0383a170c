"""Every config key takes effect where the user expects it (issue 34, item 6).

`EFFECTS` is a table over the config schema (tierstack/config.py, its leaf keys enumerated
as the configuration reference enumerates them): each key has a non-default value and a
check that the value changed something observable on the path that uses the key, against
what its default gives. A key without an entry fails `test_every_config_key_has_an_effect`,
so a new field cannot be added without showing what it does.

Checks look where a user would: the services' answers (TierManagerClient, SchedulerClient,
their HTTP APIs and /metrics), the files they make, the processes' behaviour on SIGTERM,
and for `train.*` / `budgets.*` what `tierstack.initialize` trains (losses, the tensors the
daemon holds for the job and where, the DeepSpeed surface's figures). Keys that need a
running service are grouped so each service starts once: one config file holds every
non-default value of a group and the services start from it as a user starts them,
`tierstack <service> --config FILE` with no flag overriding it.

- NODE: a scheduler and a tier manager registered with it (tier_manager.*, scheduler.*);
- TRAIN_NODE: the tier manager the engine's runs use, sized by `budgets` (metrics off);
- SECURE: a scheduler on loopback TCP with its own TLS certificate and token (security.*);
- ENGINE: one `tierstack.initialize` per run, the key's value against its default, both
  on top of the settings the key acts under (`base`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import types
import typing
import urllib.error
import urllib.request
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from prometheus_client.parser import text_string_to_metric_families

import tierstack
from tests.metrics.conftest import wait_for
from tierstack import metric_catalog as mc
from tierstack.config import KiB, MiB, GiB, SecurityConfig, TierstackConfig, load_config
from tierstack.config_reference import _sections
from tierstack.errors import ConfigError, TierstackError
from tierstack.rpc import open_channel, write_secrets
from tierstack.service_process import ServiceProcess
from tierstack.services.scheduler.client import SchedulerClient
from tierstack.services.scheduler.model import Bandwidths, NodeSpec
from tierstack.services.tier_manager.client import TierManagerClient
from tierstack.services.tier_manager.types import WorkerReport
from tierstack.worker.node.distributed import free_port
from tierstack.worker.store.tier_session import TierSession

NODE, TRAIN_NODE, SECURE, ENGINE = "node", "train_node", "secure", "runs"
DEFAULTS = TierstackConfig()
"""Every setting as it is when not given. An effect in time is bound by the default where it
can be, not by the clock: a setting that is not honoured leaves the default in force, and
load only makes things later."""


# ---- the schema ---------------------------------------------------------------------------


def leaf_keys() -> list[str]:
    """Every key a config file may set, dotted (sections are not keys)."""
    keys = []
    for prefix, cls in _sections(TierstackConfig, ""):
        hints = typing.get_type_hints(cls)
        keys += [f"{prefix}.{f.name}" if prefix else f.name for f in dataclasses.fields(cls)
                 if not dataclasses.is_dataclass(hints[f.name])]
    return keys


def default_of(key: str) -> Any:
    """The schema's default for `key`."""
    value: Any = TierstackConfig()
    for part in key.split("."):
        value = getattr(value, part)
    return value


def nested(key: str, value: Any) -> dict:
    """{"a": {"b": value}} for key "a.b"."""
    *sections, name = key.split(".")
    out: dict = {name: value}
    for section in reversed(sections):
        out = {section: out}
    return out


def merged(*parts: dict) -> dict:
    """The config dicts merged, later ones winning key by key."""
    out: dict = {}
    for part in parts:
        for k, v in part.items():
            both = isinstance(v, dict) and isinstance(out.get(k), dict)
            out[k] = merged(out[k], v) if both else v
    return out


# ---- the table ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Effect:
    """A key's non-default value and the check that it takes effect."""

    key: str
    value: Any
    """The value set; a callable takes the group's environment (paths, ports)."""
    group: str
    check: Callable[..., None]
    base: dict = field(default_factory=dict)
    """ENGINE: the settings the key acts under, in both runs (e.g. precision fp16)."""

    def resolved(self, env: Any) -> Any:
        return self.value(env) if callable(self.value) else self.value

    def with_value(self) -> dict:
        return merged(self.base, nested(self.key, self.value))

    def with_default(self) -> dict:
        return copy.deepcopy(self.base)


EFFECTS: dict[str, Effect] = {}


def effect(key: str, value: Any, group: str, base: dict | None = None):
    """Register the decorated check as `key`'s entry in EFFECTS."""
    def register(check: Callable[..., None]) -> Callable[..., None]:
        assert key not in EFFECTS, f"{key} is in the table twice"
        EFFECTS[key] = Effect(key, value, group, check, base or {})
        return check
    return register


def group_config(group: str, env: Any) -> dict:
    """One config with every non-default value of `group`'s keys."""
    return merged(*(nested(e.key, e.resolved(env)) for e in EFFECTS.values() if e.group == group))


# ---- services started as a user starts them ----------------------------------------------


class ConfiguredService(ServiceProcess):
    """`tierstack <command> --config FILE` as a user runs it: no --listen, so the file says
    where it listens (`address`, to reach it), and every other setting is the file's."""

    def __init__(self, command: str, config_path: Path, address: str,
                 security: SecurityConfig | None = None) -> None:
        super().__init__(command, "", {}, listen=address, workdir=config_path.parent,
                         security=dataclasses.asdict(security) if security else None)
        self.config_path = config_path

    def start(self) -> "ConfiguredService":
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tierstack.cli", self.command, "--config",
                 str(self.config_path), "--exit-with-parent", str(os.getpid())],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.workdir, start_new_session=True)
        try:
            self.wait_ready(self.startup_timeout)
        except BaseException:
            self.kill()
            raise AssertionError(f"tierstack {self.command} did not start:\n"
                                 f"{self.log_text()[-3000:]}") from None
        return self

    def seconds_to_exit_on_sigterm(self, method: str | None) -> float:
        """SIGTERM while a call to `method` is in flight (its request still arriving, as
        from a slow client), or with none (None): seconds until the process exits."""
        if method is None:
            began = time.monotonic()
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
            return time.monotonic() - began
        channel, _ = open_channel(self.address, [])
        arrived = threading.Event()

        def request():
            arrived.wait()
            yield b""

        call = channel.stream_unary(method, request_serializer=bytes,
                                    response_deserializer=bytes).future(request())
        try:
            time.sleep(0.5)  # the call is in its handler, waiting for its request
            began = time.monotonic()
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
            return time.monotonic() - began
        finally:
            arrived.set()
            call.cancel()
            channel.close()


def http_get(url: str, path: str, host: str | None = None) -> tuple[int, str]:
    """(status, body) of GET url+path, with another Host header if given."""
    request = urllib.request.Request(url + path, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric_samples(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of url's /metrics."""
    status, text = http_get(url, "/metrics")
    assert status == 200, text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _worker_report() -> WorkerReport:
    return WorkerReport(worker_id=f"effects-{uuid.uuid4().hex[:6]}", job="effects", device="cpu",
                        timestamp=time.time(), cpu_to_device_bytes=0, device_to_cpu_bytes=0,
                        stall_seconds=0.0, wait_bucket_bounds=mc.WAIT_BUCKETS,
                        wait_bucket_counts=(0,) * (len(mc.WAIT_BUCKETS) + 1),
                        wait_seconds_sum=0.0, device_used_bytes=0, device_capacity_bytes=0,
                        loads_in_flight=0, prefetch_depth=0)


def group_fixture(name: str, group: type):
    """The module-scoped fixture `name`: `group`'s services started once, closed after."""
    @pytest.fixture(scope="module", name=name)
    def started(tmp_path_factory):
        services = group(tmp_path_factory.mktemp(name))
        try:
            yield services
        finally:
            services.close()
    return started


def private_shm_dir() -> Path:
    d = Path("/dev/shm") / f"tierstack-test-{uuid.uuid4().hex[:10]}"
    d.mkdir(mode=0o700)
    return d


# ---- NODE: a scheduler and a tier manager registered with it -------------------------------


class NodeGroup:
    """The NODE group's two services, from one config file (`config`)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.shm = private_shm_dir()
        self.http_port, self.scheduler_http_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.scheduler_url = f"http://127.0.0.1:{self.scheduler_http_port}"
        self.tm_address = f"unix:{directory / 'sockets' / 'tm.sock'}"
        self.scheduler_address = f"unix:{directory / 'sockets' / 'scheduler.sock'}"
        self.config = group_config(NODE, self)
        self.config_path = directory / "node.json"
        self.config_path.write_text(json.dumps(self.config))
        self.scheduler = ConfiguredService("scheduler", self.config_path, self.scheduler_address)
        self.tier_manager = ConfiguredService("tier-manager", self.config_path, self.tm_address)
        self.client: TierManagerClient | None = None
        self.scheduler_client = SchedulerClient(self.scheduler_address, timeout=10)

    def up(self) -> "NodeGroup":
        """Both services running (a check may have stopped one); `client` and
        `scheduler_client` talk to them."""
        if not self.scheduler.running():
            self.scheduler.start()
        if not self.tier_manager.running():
            self.crashed()
            self.tier_manager.start()
        if self.client is None:
            self.client = TierManagerClient(self.tier_manager.address, reconnect_timeout=10)
        return self

    def crashed(self) -> None:
        """The tier manager is gone (killed): its client goes too."""
        self.tier_manager.kill()
        if self.client is not None:
            self.client.close()
            self.client = None

    @contextlib.contextmanager
    def session(self, job: str, quota: int = 64 * MiB, reconnect_timeout: float = 10):
        """A worker's session holding `job` open (its tensors go `jobs.grace_seconds` after)."""
        session = TierSession(self.tier_manager.address, reconnect_timeout, pin_for_cuda=False,
                              job=job, quota=quota)
        try:
            yield session
        finally:
            session.close()

    def close(self) -> None:
        self.crashed()
        self.scheduler_client.close()
        self.scheduler.kill()
        shutil.rmtree(self.shm, ignore_errors=True)


node = group_fixture(NODE, NodeGroup)


@contextlib.contextmanager
def _durable_tensor(node: NodeGroup, blocks: int):
    """A durable tensor of `blocks` blocks of random bytes, held while in the block; yields
    its key and its blocks' bytes."""
    block = node.up().client.node().block_size
    data = torch.randint(0, 256, (blocks, block), dtype=torch.uint8)
    job = f"effects-{uuid.uuid4().hex[:6]}"
    with node.session(job) as session:
        session.write_block(f"{job}/t", data)
        yield f"{job}/t", [row.numpy().tobytes() for row in data]
        session.client.delete_job(job, force=True)


def _blocks_per_drive(node: NodeGroup, blocks: int) -> list[set[int]]:
    """For each NVMe path, which blocks of a new durable tensor its data file holds."""
    with _durable_tensor(node, blocks) as (_, data):
        return [{i for i, block in enumerate(data) if block in content}
                for content in ((Path(path) / "tierstack-nvme.data").read_bytes()
                                for path in node.config["tier_manager"]["nvme_pool"]["paths"])]


@effect("tier_manager.cpu_pool.size", "48MiB", NODE)
def reported_cpu_capacity(node):
    client = node.up().client
    assert client.node().cpu_capacity == client.stats().cpu_capacity == 48 * MiB  # not 'auto'


@effect("tier_manager.cpu_pool.shm_dir", lambda node: str(node.shm), NODE)
def arenas_in_shm_dir(node):
    client = node.up().client
    lease = client.allocate(1000)
    [arena] = [a for a in client.node().arenas if a.index == lease.arena]
    assert Path(arena.path).parent == node.shm and Path(arena.path).exists()  # default /dev/shm
    client.cancel(lease.lease_id)


@effect("tier_manager.cpu_pool.alignment", 65536, NODE)
def buffers_rounded_to_alignment(node):
    client = node.up().client
    used = client.stats().cpu_used
    leases = [client.allocate(100) for _ in range(2)]
    # Each buffer takes a whole 64 KiB granule (default: 4096), on a 64 KiB boundary.
    assert client.stats().cpu_used - used == 2 * 65536
    assert all(lease.offset % 65536 == 0 for lease in leases)
    for lease in leases:
        client.cancel(lease.lease_id)


@effect("tier_manager.cpu_pool.keep_empty_seconds", 0.5, NODE)
def empty_arena_returned_after_keep_empty_seconds(node):
    client = node.up().client
    lease = client.allocate(3 * 65536)  # a size no other check uses: a fresh arena
    client.cancel(lease.lease_id)
    emptied = time.monotonic()

    def listed() -> bool:
        return any(a.index == lease.arena for a in client.node().arenas)

    assert listed()  # kept, empty, for the next buffer of its size
    wait_for(lambda: not listed(), 10, "the empty arena to be returned")
    # Bound by the default, not the clock: a pool that kept its default keeps the arena at
    # least 5 s; this one returns it after 0.5 s and the reaper's tick (1 s).
    assert time.monotonic() - emptied < DEFAULTS.tier_manager.cpu_pool.keep_empty_seconds


@effect("tier_manager.nvme_pool.paths",
        lambda node: [str(node.dir / f"drive{i}") for i in range(3)], NODE)
def blocks_striped_over_every_path(node):
    found = _blocks_per_drive(node, 3)
    # Each drive holds one of the three blocks (default: one drive, all of them).
    assert sorted(len(f) for f in found) == [1, 1, 1] and set().union(*found) == {0, 1, 2}


@effect("tier_manager.nvme_pool.size", "96MiB", NODE)
def reported_nvme_capacity(node):
    client = node.up().client
    assert client.node().nvme_capacity == client.stats().nvme_capacity == 96 * MiB  # not 'auto'


@effect("tier_manager.nvme_pool.aio.block_size", "64KiB", NODE)
def tensors_cut_in_block_size_blocks(node):
    client = node.up().client
    assert client.node().block_size == 64 * KiB
    # Two 64 KiB blocks of one tensor land on two drives (default 1 MiB: one block).
    found = _blocks_per_drive(node, 2)
    assert sorted(len(f) for f in found) == [0, 1, 1]


def _io_limit(node) -> dict[str, float]:
    samples = metric_samples(node.up().url)
    return {dict(labels)["backend"]: v for (name, labels), v in samples.items()
            if name == mc.IO_MAX_IN_FLIGHT.name}


@effect("tier_manager.nvme_pool.aio.queue_depth", 3, NODE)
def requests_in_flight_per_thread(node):
    # thread_count 5 x queue_depth 3 (default 8 x 5 = 40 here, 8 x 1 = 8 with both defaults).
    assert list(_io_limit(node).values()) == [15]


@effect("tier_manager.nvme_pool.aio.thread_count", 5, NODE)
def io_threads(node):
    assert list(_io_limit(node).values()) == [15]  # 5 x 3; default 1 x 3 = 3


@effect("tier_manager.nvme_pool.aio.engine", "threads", NODE)
def io_backend(node):
    from tierstack.services.tier_manager.io_engine import load_native_blockio
    assert load_native_blockio() is not None, "the default ('auto') would be 'threads' too here"
    assert list(_io_limit(node)) == ["threads"]  # default 'auto': native, which is built


@effect("tier_manager.manifest_path", lambda node: str(node.dir / "manifests" / "node.sqlite"),
        NODE)
def manifest_file_there(node):
    import sqlite3
    with _durable_tensor(node, 1) as (key, _):  # recorded in the manifest
        manifest = node.dir / "manifests" / "node.sqlite"
        with contextlib.closing(sqlite3.connect(manifest)) as db:
            tables = [t for (t,) in db.execute("select name from sqlite_master where type='table'")]
            rows = [row for t in tables for row in db.execute(f"select * from {t}")]
        assert any(key in map(str, row) for row in rows)
    first_path = Path(node.config["tier_manager"]["nvme_pool"]["paths"][0])
    assert not (first_path / "manifest.sqlite").exists()  # the default place


@effect("tier_manager.listen", lambda node: node.tm_address, NODE)
def daemon_answers_there(node):
    node.up()  # started with no --listen
    assert (node.dir / "sockets" / "tm.sock").is_socket()  # default: the per-user socket
    with contextlib.closing(TierManagerClient(node.tm_address, reconnect_timeout=5)) as client:
        assert client.node().cpu_capacity == 48 * MiB


@effect("tier_manager.lease_timeout_seconds", 1.0, NODE)
def uncommitted_lease_freed(node):
    client = node.up().client
    lease = client.allocate(4096)  # and never committed, as by a worker that died
    # Gone within a tenth of the default (600 s): far above any load's delay.
    wait_for(lambda: client.stats().leases == 0, DEFAULTS.tier_manager.lease_timeout_seconds / 10,
             "the uncommitted lease to expire")
    with pytest.raises(TierstackError, match="expired"):
        client.commit("late", lease.lease_id, "uint8", (4096,), False)


@effect("tier_manager.scheduler_address", lambda node: node.scheduler_address, NODE)
def registered_with_scheduler(node):
    node.up()
    states = {s.node.node_id: s for s in node.scheduler_client.list_nodes()}
    state = states[node.config["tier_manager"]["node_id"]]
    assert state.node.cpu_bytes == 48 * MiB and state.metrics_url == node.url  # default: none
    status, body = http_get(node.url, "/api/v1/plan")
    assert json.loads(body)["scheduler"] == node.config["scheduler"]["listen"]


@effect("tier_manager.node_id", "effects-node", NODE)
def registered_under_node_id(node):
    node.up()
    names = set(node.scheduler_client.nodes())
    assert "effects-node" in names and socket.gethostname() not in names  # default: host name


@effect("tier_manager.metrics.http_listen", lambda node: f"127.0.0.1:{node.http_port}", NODE)
def http_api_there(node):
    assert node.up().client.http_endpoint() == node.url
    assert http_get(node.url, "/healthz")[0] == 200


@effect("tier_manager.metrics.node_name", "effects-metrics-node", NODE)
def node_name_in_metrics(node):
    samples = metric_samples(node.up().url)
    assert any(name == "tierstack_node_info" and dict(labels)["node"] == "effects-metrics-node"
               for name, labels in samples)
    assert json.loads(http_get(node.url, "/api/v1/node")[1])["node"] == "effects-metrics-node"


def _history(node) -> dict:
    return json.loads(http_get(node.url, "/api/v1/node/history?window_seconds=300")[1])


@effect("tier_manager.metrics.sample_interval_seconds", 0.2, NODE)
def samples_that_often(node):
    node.up()
    history = wait_for(lambda: (h := _history(node)) and len(h["samples"]) >= 4 and h, 10,
                    "four samples")
    assert history["interval_seconds"] == 0.2
    times = [s["timestamp"] for s in history["samples"]]
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    # The sampler sleeps its interval between samples: load lengthens gaps, never shortens
    # them, so the shortest is bound by the default (every gap at least 1 s).
    assert 0.1 < gaps[len(gaps) // 2] and gaps[0] < DEFAULTS.tier_manager.metrics.sample_interval_seconds / 2


@effect("tier_manager.metrics.history_seconds", 1.0, NODE)
def history_that_long(node):
    node.up()
    wait_for(lambda: json.loads(http_get(node.url, "/api/v1/node")[1])["uptime_seconds"] > 3.0, 10,
          "three seconds of samples")
    # 1 s / 0.2 s + 1 samples kept (default 900 s: every sample so far).
    assert len(_history(node)["samples"]) == 6


@effect("tier_manager.metrics.worker_stale_seconds", 1.0, NODE)
def silent_worker_retired(node):
    report = _worker_report()

    def workers() -> list[str]:
        snapshot = json.loads(http_get(node.url, "/api/v1/node")[1])
        return [w["worker_id"] for w in snapshot["workers"]]

    assert node.up().client.report_worker(report)
    assert report.worker_id in workers()
    # Retired within half the default (30 s): far above any load's delay.
    wait_for(lambda: report.worker_id not in workers(),
             DEFAULTS.tier_manager.metrics.worker_stale_seconds / 2, "the silent worker to be retired")


@effect("tier_manager.metrics.cluster_nodes", lambda node: [node.url], NODE)
def cluster_view_reads_the_listed_nodes(node):
    # The node lists itself as a peer: its cluster view reads it over HTTP too.
    cluster = json.loads(http_get(node.up().url, "/api/v1/cluster")[1])
    assert cluster["unreachable"] == [] and len(cluster["nodes"]) == 2  # default: itself alone


@effect("tier_manager.metrics.allowed_hosts", ["effects-alias.example"], NODE)
def http_answers_to_the_alias(node):
    assert http_get(node.up().url, "/healthz", host="effects-alias.example")[0] == 200
    assert http_get(node.url, "/healthz", host="other.example")[0] == 400  # as it is by default


@effect("tier_manager.jobs.default_quota", "1MiB", NODE)
def job_without_quota_gets_the_default(node):
    job = f"quota-{uuid.uuid4().hex[:6]}"
    with node.up().session(job, quota=0) as session:
        [info] = [j for j in session.client.jobs() if j.job == job]
        assert info.quota_bytes == MiB  # default: 0, no quota
        with pytest.raises(TierstackError, match="over its quota of 1048576"):
            session.write_block(f"{job}/big", torch.zeros(2 * MiB, dtype=torch.uint8))


@effect("tier_manager.jobs.grace_seconds", 0.5, NODE)
def closed_job_deleted_after_grace(node):
    job = f"grace-{uuid.uuid4().hex[:6]}"
    with node.up().session(job) as session:
        session.write_block(f"{job}/t", torch.zeros(4096, dtype=torch.uint8))
    closed = time.monotonic()
    wait_for(lambda: job not in {j.job for j in node.client.jobs()}, 10, "the job's deletion")
    # Bound by the default, not the clock: with it the job stays at least 5 s; with 0.5 s
    # it goes after that and the reaper's tick (1 s).
    assert time.monotonic() - closed < DEFAULTS.tier_manager.jobs.grace_seconds


@effect("tier_manager.jobs.orphan_seconds", 3.0, NODE)
def orphaned_job_deleted_after_restart(node):
    job = f"orphan-{uuid.uuid4().hex[:6]}"
    with node.up().session(job, reconnect_timeout=1) as session:
        session.write_block(f"{job}/t", torch.zeros(4096, dtype=torch.uint8))
        node.crashed()  # the node goes down with the job open; its worker does not come back
    client = node.up().client
    # Found again in the manifest, deleted unless a worker opens it within 3 s of the start
    # (which counts from before the daemon serves).
    [info] = [j for j in client.jobs() if j.job == job]
    assert info.delete_in_seconds <= 3.0  # default: 600 s for its workers to return
    wait_for(lambda: job not in {j.job for j in client.jobs()},
             DEFAULTS.tier_manager.jobs.orphan_seconds / 10, "the orphan's deletion")


@effect("scheduler.listen", lambda node: node.scheduler_address, NODE)
def scheduler_answers_there(node):
    node.up()  # started with no --listen
    assert (node.dir / "sockets" / "scheduler.sock").is_socket()  # default: the per-user socket
    assert "effects-node" in node.scheduler_client.nodes()


def _probe_node(node_id: str, disk_read: float) -> NodeSpec:
    return NodeSpec(node_id=node_id, gpu_bytes=0, cpu_bytes=GiB, nvme_bytes=10 * GiB,
                    bandwidth=Bandwidths(disk_read=disk_read, disk_write=1e9, h2d=1e10, d2h=1e10))


@effect("scheduler.report_interval_seconds", 0.5, NODE)
def nodes_told_to_report_that_often(node):
    client = node.up().scheduler_client
    assert client.register_node(_probe_node("effects-probe-interval", 1e9)) == 0.5  # default 2
    # The node's tier manager reports at that pace.

    def last() -> float:
        return {s.node.node_id: s.last_report for s in client.list_nodes()}["effects-node"]

    reports = [last()]
    for _ in range(3):
        reports.append(wait_for(lambda: (t := last()) > reports[-1] and t, 10, "the next report"))
    # The reporter sleeps its interval after each report: load lengthens gaps, never
    # shortens them, so the shortest of them is bound by the default's 2 s.
    gaps = [b - a for a, b in zip(reports, reports[1:])]
    assert 0.3 < min(gaps) < DEFAULTS.scheduler.report_interval_seconds / 2, gaps


def _adopted_after(client: SchedulerClient, node_id: str, measured: float) -> float:
    """Report `measured` disk-read bandwidth until the scheduler adopts it; seconds taken."""
    began = time.monotonic()

    def adopted() -> bool:
        client.report_bandwidth(node_id, Bandwidths(disk_read=measured))
        return client.node_bandwidths()[node_id].disk_read == pytest.approx(measured)

    wait_for(adopted, 10, f"{node_id}'s drift to be adopted")
    return time.monotonic() - began


@effect("scheduler.replan_threshold", 0.1, NODE)
def small_drift_counts(node):
    client = node.up().scheduler_client
    client.register_node(_probe_node("effects-probe-threshold", 1e9))
    for _ in range(4):  # 5% off, for longer than replan_after_seconds: within the threshold
        client.report_bandwidth("effects-probe-threshold", Bandwidths(disk_read=0.95e9))
        time.sleep(0.1)
    assert client.node_bandwidths()["effects-probe-threshold"].disk_read == 1e9
    _adopted_after(client, "effects-probe-threshold", 0.85e9)  # 15% off: within the default 25%


@effect("scheduler.replan_after_seconds", 0.3, NODE)
def drift_adopted_after(node):
    client = node.up().scheduler_client
    client.register_node(_probe_node("effects-probe-after", 1e9))
    # Half the default (10 s), which a scheduler that kept it could not beat.
    assert _adopted_after(client, "effects-probe-after", 0.5e9) < DEFAULTS.scheduler.replan_after_seconds / 2


@effect("scheduler.metrics_listen", lambda node: f"127.0.0.1:{node.scheduler_http_port}", NODE)
def scheduler_http_there(node):
    samples = metric_samples(node.up().scheduler_url)
    assert samples[(mc.SCHEDULER_NODES.name, ())] >= 1


@effect("scheduler.metrics_allowed_hosts", ["effects-sched-alias.example"], NODE)
def scheduler_http_answers_to_the_alias(node):
    alias = "effects-sched-alias.example"
    assert http_get(node.up().scheduler_url, "/healthz", host=alias)[0] == 200
    assert http_get(node.scheduler_url, "/healthz", host="other.example")[0] == 400


# ---- TRAIN_NODE: the tier manager the engine's runs use -----------------------------------


class TrainNodeGroup:
    """A tier manager started from a config whose `budgets` size its pools."""

    def __init__(self, directory: Path) -> None:
        self.shm = private_shm_dir()
        self.address = f"unix:{directory / 'tm.sock'}"
        where = {"tier_manager": {"listen": self.address, "cpu_pool": {"shm_dir": str(self.shm)},
                                  "nvme_pool": {"paths": [str(directory / "nvme")]},
                                  "manifest_path": str(directory / "manifest.sqlite")}}
        config_path = directory / "train-node.json"
        config_path.write_text(json.dumps(merged(where, group_config(TRAIN_NODE, self))))
        self.tier_manager = ConfiguredService("tier-manager", config_path, self.address).start()
        self.client = TierManagerClient(self.address, reconnect_timeout=10)

    def close(self) -> None:
        self.client.close()
        self.tier_manager.kill()
        shutil.rmtree(self.shm, ignore_errors=True)


train_node = group_fixture(TRAIN_NODE, TrainNodeGroup)


@effect("tier_manager.metrics.enabled", False, TRAIN_NODE)
def no_metrics_collected_or_served(train_node):
    assert train_node.client.http_endpoint() == ""  # default: the HTTP API's URL
    assert train_node.client.report_worker(_worker_report()) is False  # nothing collects it


@effect("budgets.host", "1120MiB", TRAIN_NODE)
def cpu_pool_gets_the_host_budgets_share(train_node):
    # 1120 MiB less the 1 GiB our processes keep besides the pool (budgets.HOST_OVERHEAD).
    assert train_node.client.node().cpu_capacity == 96 * MiB  # default: measured from the host


@effect("budgets.nvme", "256MiB", TRAIN_NODE)
def nvme_pool_gets_the_nvme_budget(train_node):
    assert train_node.client.node().nvme_capacity == 256 * MiB  # default: the drive's free space


# ---- SECURE: a scheduler on loopback TCP with its own certificate and token ---------------


class SecureGroup:
    """A scheduler on 127.0.0.1 serving TLS with the config's certificate and demanding its
    token; `client_security` is what a client of it configures (no certificate of its own)."""

    def __init__(self, directory: Path) -> None:
        self.secrets = write_secrets(directory / "secrets", server_name="effects-cluster")
        self.other = write_secrets(directory / "other-secrets", server_name="effects-cluster")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        config = merged({"scheduler": {"listen": self.address, "metrics_listen": ""}},
                        group_config(SECURE, self))
        config_path = directory / "secure.json"
        config_path.write_text(json.dumps(config))
        self.config = load_config(config).security
        self.client_security = SecurityConfig(token_file=self.config.token_file,
                                              ca_file=self.config.ca_file,
                                              server_name=self.config.server_name)
        self.scheduler = ConfiguredService("scheduler", config_path, self.address,
                                           self.client_security).start()

    def answers(self, **changes: str) -> bool:
        """Whether a client with `client_security` but `changes` gets an answer (one it
        should not trust or that the server should not trust fails; given 2 s to)."""
        security = dataclasses.replace(self.client_security, **changes)
        client = SchedulerClient(self.address, timeout=2 if changes else 30, security=security)
        try:
            client.list_nodes()
            return True
        except TierstackError:
            return False
        finally:
            client.close()

    def close(self) -> None:
        self.scheduler.kill()


secure = group_fixture(SECURE, SecureGroup)


@effect("security.token_file", lambda secure: str(secure.secrets / "token"), SECURE)
def calls_need_the_files_token(secure):
    assert secure.answers()
    assert not secure.answers(token_file=str(secure.other / "token"))  # default: the per-user token


@effect("security.cert_file", lambda secure: str(secure.secrets / "cert.pem"), SECURE)
def server_presents_the_certificate(secure):
    presented = ssl.get_server_certificate(("127.0.0.1", secure.port))
    mine = (secure.secrets / "cert.pem").read_text()
    assert ssl.PEM_cert_to_DER_cert(presented) == ssl.PEM_cert_to_DER_cert(mine)


@effect("security.key_file", lambda secure: str(secure.secrets / "key.pem"), SECURE)
def server_proves_the_key(secure):
    # A handshake that checks the certificate succeeds only if the server signs with its key.
    context = ssl.create_default_context(cafile=str(secure.secrets / "cert.pem"))
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", secure.port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="effects-cluster") as tls:
            assert tls.version() is not None


@effect("security.ca_file", lambda secure: str(secure.secrets / "ca.pem"), SECURE)
def client_trusts_the_ca(secure):
    assert secure.answers()
    assert not secure.answers(ca_file=str(secure.other / "ca.pem"))
    assert not secure.answers(ca_file="")  # default: the per-user CA, which never signed it


@effect("security.server_name", "effects-cluster", SECURE)
def client_checks_the_name(secure):
    assert secure.answers()
    assert not secure.answers(server_name="tierstack")  # the default: not the certificate's name


# ---- ENGINE: tierstack.initialize, the key's value against its default --------------------

VOCAB, DIM, LAYERS, ROWS, SEQ = 32, 16, 3, 4, 5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


BLOCK_NUMEL = sum(p.numel() for p in Block().parameters())


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (ROWS, SEQ), generator=g),
             torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)) for _ in range(count)]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class EngineRuns:
    """Engines made by tierstack.initialize on TRAIN_NODE's tier manager."""

    def __init__(self, node: TrainNodeGroup) -> None:
        self.address = node.address
        self.client = node.client

    @contextlib.contextmanager
    def engine(self, config: dict, **options):
        """tierstack.initialize(config=...) of a fresh Net (same seed every time), with its
        job's name (`.job`) and training loader (`.loader`); closed after."""
        torch.manual_seed(0)
        job = f"effects-{uuid.uuid4().hex[:8]}"
        engine, _, loader, _ = tierstack.initialize(model=Net(), config=config,
                                                    tier_manager=self.address, job=job, **options)
        engine.job, engine.loader = job, loader
        try:
            yield engine
        finally:
            engine.close()

    def train(self, engine, steps: int, overflow: tuple[int, ...] = (),
              after_step: Callable[[], None] = lambda: None) -> list[float]:
        """Micro steps on fixed batches (the loss x 1e8 on the `overflow` ones: fp16
        gradients overflow), as a DeepSpeed loop runs them; their losses."""
        losses = []
        for i, (ids, targets) in enumerate(_batches(steps)):
            loss = _loss(engine(ids), targets)
            engine.backward(loss * 1e8 if i in overflow else loss)
            engine.step()
            after_step()
            losses.append(loss.item())
        return losses

    def losses(self, config: dict, steps: int = 4) -> list[float]:
        with self.engine(config) as engine:
            return self.train(engine, steps)

    def describe(self, key: str):
        """What the daemon holds under `key` (None: nothing)."""
        try:
            return self.client.describe(key)
        except TierstackError:
            return None

    def state(self, engine, layer: int, kind: str):
        """The job's `layer` state of `kind` at the daemon, once the last step's updates are in."""
        engine.core.wait_for_optimizer()
        return self.describe(f"{engine.job}/layer{layer}/{kind}")

    def in_cpu_pool(self, engine, layer: int, kind: str, expected: bool) -> bool | None:
        """Whether that state is in the CPU pool, given up to 30 s to become as `expected`
        (a tensor placed 'nvme' leaves the pool in the background); None: not there."""
        deadline = time.monotonic() + 30
        while True:
            info = self.state(engine, layer, kind)
            if info is None or info.in_cpu == expected or time.monotonic() > deadline:
                return None if info is None else info.in_cpu
            time.sleep(0.05)


@pytest.fixture(scope="module")
def runs(train_node):
    return EngineRuns(train_node)


def torch_losses(config: dict, steps: int = 4) -> list[float]:
    """The same steps in plain PyTorch with the config's AdamW, clipping and accumulation 1."""
    train = load_config(config).train
    opt = train.optimizer
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=tuple(opt.betas),
                                  eps=opt.eps, weight_decay=opt.weight_decay)
    losses = []
    for ids, targets in _batches(steps):
        loss = _loss(model(ids), targets)
        loss.backward()
        if train.gradient_clipping:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.gradient_clipping)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def trains_as_torch_adamw(runs, e: Effect):
    """The engine's losses are plain PyTorch's with the value, and those differ from the
    default's (the value changed the trained weights)."""
    got, want = runs.losses(e.with_value(), steps=6), torch_losses(e.with_value(), steps=6)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    default = torch.tensor(torch_losses(e.with_default(), steps=6))
    assert not torch.allclose(torch.tensor(want), default, rtol=1e-4, atol=0), (want, default)


for _key, _value in (("train.optimizer.lr", 1e-2), ("train.optimizer.betas", [0.5, 0.9]),
                     ("train.optimizer.eps", 1e-2), ("train.optimizer.weight_decay", 2.0)):
    effect(_key, _value, ENGINE)(trains_as_torch_adamw)
# AdamW's step hardly changes with the gradients' scale: clipping shows at a larger lr.
effect("train.gradient_clipping", 1e-2, ENGINE,
       base={"train": {"optimizer": {"lr": 3e-2}}})(trains_as_torch_adamw)


@effect("train.optimizer.type", "sgd", ENGINE)
def only_adamw(runs, e):
    with pytest.raises(ConfigError, match=r"train\.optimizer\.type: 'sgd' is not supported"):
        runs.losses(e.with_value())
    # 'adam' is DeepSpeed's name for the same step (adam_w_mode)
    assert runs.losses({"train": {"optimizer": {"type": "adam"}}}) == runs.losses({})


@effect("train.micro_batch_size", 2, ENGINE)
def loader_batches(runs, e):
    data = [(torch.zeros(SEQ, dtype=torch.long), torch.zeros(SEQ, dtype=torch.long))] * 8
    for config, rows in ((e.with_value(), 2), (e.with_default(), 8)):
        with runs.engine(config, training_data=data) as engine:
            ids, _ = next(iter(engine.loader))
            assert ids.shape[0] == rows and engine.train_micro_batch_size_per_gpu() == rows


@effect("train.gradient_accumulation_steps", 2, ENGINE)
def optimizer_steps_at_boundaries(runs, e):
    for config, steps in ((e.with_value(), 2), (e.with_default(), 4)):
        with runs.engine(config) as engine:
            runs.train(engine, 4)
            assert engine.global_steps == steps and engine.micro_steps == 4


@effect("train.precision", "bf16", ENGINE)
def trains_in_bf16_with_fp32_masters(runs, e):
    for config, dtype in ((e.with_value(), torch.bfloat16), (e.with_default(), torch.float32)):
        with runs.engine(config) as engine:
            runs.train(engine, 1)
            assert engine.module.embed.weight.dtype == dtype
            has_masters = runs.state(engine, 0, "master") is not None  # with the daemon
            assert has_masters == (dtype == torch.bfloat16)


@effect("train.params.weights_from_masters", "on", ENGINE, base={"train": {"precision": "bf16"}})
def no_bf16_weights_kept_by_the_daemon(runs, e):
    # 'on': the daemon keeps the masters and no bf16 copy (each load rounds the masters);
    # the default 'auto' keeps the copy where the pool holds it, as this one does.
    losses = {}
    for config, stored in ((e.with_value(), False), (e.with_default(), True)):
        with runs.engine(config) as engine:
            losses[stored] = runs.train(engine, 3)
            assert (runs.state(engine, 0, "params") is not None) == stored
            assert runs.state(engine, 0, "master") is not None
    assert losses[False] == losses[True]  # the same rounding, on the way instead of in the daemon


@effect("train.device_budget", "64KiB", ENGINE)
def layers_on_the_device_within_budget(runs, e):
    with runs.engine(e.with_value()) as engine:
        assert engine.core.store.figures().device_capacity == 64 * KiB
    with runs.engine(e.with_default()) as engine:
        layer = engine.core.store.layouts[0].nbytes
        assert engine.core.store.figures().device_capacity == 3 * layer != 64 * KiB


def _moments_in_cpu(runs, config: dict, expected: list[bool]) -> None:
    """After a step, whether each layer's first moment is in the CPU pool is `expected`."""
    with runs.engine(config) as engine:
        runs.train(engine, 1)
        got = [runs.in_cpu_pool(engine, i, "exp_avg", want) for i, want in enumerate(expected)]
        assert got == expected


@effect("train.tier_overrides", {"blocks[0]": "nvme"}, ENGINE)
def overridden_module_state_out_of_the_cpu_pool(runs, e):
    # Block 0's AdamW moments leave the CPU pool after its step; the others' stay.
    _moments_in_cpu(runs, e.with_value(), [False, True, True])
    _moments_in_cpu(runs, e.with_default(), [True, True, True])


@effect("train.params.device", "none", ENGINE)
def blocks_stay_on_the_device(runs, e):
    for config, offloaded in ((e.with_value(), False), (e.with_default(), True)):
        with runs.engine(config) as engine:
            runs.train(engine, 1)
            assert (runs.state(engine, 0, "params") is not None) == offloaded


@effect("train.params.buffer_count", 3, ENGINE)
def prefetch_depth(runs, e):
    for config, depth in ((e.with_value(), 2), (e.with_default(), 4)):
        with runs.engine(config) as engine:
            assert engine.core.store.figures().prefetch_depth == depth


@effect("train.params.buffer_size", 100, ENGINE, base={"train": {"params": {"device": "cpu"}}})
def larger_tensors_refused(runs, e):
    with pytest.raises(ConfigError, match=r"more than train\.params\.buffer_size \(100"):
        runs.losses(e.with_value(), steps=1)
    runs.losses(e.with_default(), steps=1)  # default 0: no limit


@effect("train.params.max_in_cpu", BLOCK_NUMEL, ENGINE,
        base={"train": {"params": {"device": "nvme"}}})
def blocks_past_max_in_cpu_leave_the_pool(runs, e):
    # One block's parameters cached; the others' state goes with their parameters, to NVMe.
    _moments_in_cpu(runs, e.with_value(), [True, False, False])
    _moments_in_cpu(runs, e.with_default(), [True, True, True])


@effect("train.optimizer_state.device", "cpu", ENGINE,
        base={"train": {"params": {"device": "nvme", "max_in_cpu": 0}}})
def optimizer_state_kept_in_the_cpu_pool(runs, e):
    _moments_in_cpu(runs, e.with_value(), [True] * LAYERS)
    _moments_in_cpu(runs, e.with_default(), [False] * LAYERS)  # with the parameters


@effect("train.optimizer_state.max_in_cpu", 0, ENGINE,
        base={"train": {"optimizer_state": {"device": "nvme"}}})
def optimizer_state_sent_out(runs, e):
    _moments_in_cpu(runs, e.with_value(), [False] * LAYERS)
    _moments_in_cpu(runs, e.with_default(), [True] * LAYERS)  # the pool keeps what fits


@effect("train.activations.policy", "nvme", ENGINE)
def block_inputs_wait_on_nvme(runs, e):
    for config, stashed in ((e.with_value(), True), (e.with_default(), False)):
        with runs.engine(config) as engine:
            # The first step's inputs: block n's is activation.n, from its forward to its backward.
            keys = [f"{engine.job}/layer{n}/activation.{n}" for n in range(LAYERS)]
            seen = []

            def after_the_blocks(module, args, output):
                if stashed:  # written in the background: give the writes time
                    wait_for(lambda: all((i := runs.describe(k)) and i.on_nvme for k in keys), 5,
                          "the block inputs on NVMe")
                seen.extend(k for k in keys if runs.describe(k) is not None)

            hook = engine.module.head.register_forward_hook(after_the_blocks)
            runs.train(engine, 1)
            hook.remove()
            assert seen == (keys if stashed else [])  # default: kept on the device


@effect("train.lr_schedule.type", "WarmupLR", ENGINE)
def lr_warms_up(runs, e):
    with runs.engine(e.with_value()) as engine:
        lrs = [engine.get_lr()[0]]
        for _ in range(3):
            runs.train(engine, 1)
            lrs.append(engine.get_lr()[0])
    assert lrs == sorted(lrs) and lrs[0] < lrs[-1] < 1e-3  # DeepSpeed's log warm-up to lr
    with runs.engine(e.with_default()) as engine:
        runs.train(engine, 3)
        assert engine.get_lr() == [1e-3]


@effect("train.lr_schedule.params", {"warmup_num_steps": 2, "warmup_type": "linear"}, ENGINE,
        base={"train": {"lr_schedule": {"type": "WarmupLR"}}})
def schedule_follows_its_params(runs, e):
    for config, warmed_up in ((e.with_value(), True), (e.with_default(), False)):
        with runs.engine(config) as engine:
            runs.train(engine, 3)
            lr = engine.get_lr()[0]  # linear over 2 steps: at lr by now (default: 1000 steps, log)
            assert lr == pytest.approx(1e-3) if warmed_up else lr < 0.5e-3


FP16 = {"train": {"precision": "fp16"}}
FP16_AT_16 = merged(FP16, {"train": {"fp16": {"initial_scale_power": 4}}})


def _scales(runs, config: dict, steps: int, overflow: tuple[int, ...] = ()) -> list[float]:
    """The loss scale before the first step and after each."""
    with runs.engine(config) as engine:
        scales = [engine.loss_scale()]
        runs.train(engine, steps, overflow, after_step=lambda: scales.append(engine.loss_scale()))
        return scales


@effect("train.fp16.loss_scale", 128.0, ENGINE, base=FP16)
def static_scale(runs, e):
    assert _scales(runs, e.with_value(), 2, overflow=(0,)) == [128.0] * 3
    assert _scales(runs, e.with_default(), 0)[0] == 2.0 ** 16  # dynamic


@effect("train.fp16.initial_scale_power", 8, ENGINE, base=FP16)
def scale_starts_there(runs, e):
    assert _scales(runs, e.with_value(), 0) == [256.0]
    assert _scales(runs, e.with_default(), 0) == [65536.0]


@effect("train.fp16.loss_scale_window", 2, ENGINE, base=FP16_AT_16)
def scale_rises_after_window(runs, e):
    assert _scales(runs, e.with_value(), 3) == [16.0, 16.0, 16.0, 32.0]
    assert _scales(runs, e.with_default(), 3) == [16.0] * 4


@effect("train.fp16.hysteresis", 1, ENGINE, base=FP16_AT_16)
def first_overflow_halves(runs, e):
    assert _scales(runs, e.with_value(), 1, overflow=(0,)) == [16.0, 8.0]
    assert _scales(runs, e.with_default(), 1, overflow=(0,)) == [16.0, 16.0]  # only skipped


@effect("train.fp16.consecutive_hysteresis", True, ENGINE, base=FP16_AT_16)
def clean_step_refills_hysteresis(runs, e):
    assert _scales(runs, e.with_value(), 3, overflow=(0, 2))[-1] == 16.0
    assert _scales(runs, e.with_default(), 3, overflow=(0, 2))[-1] == 8.0


@effect("train.fp16.min_loss_scale", 8.0, ENGINE,
        base=merged(FP16_AT_16, {"train": {"fp16": {"hysteresis": 1}}}))
def scale_floor(runs, e):
    from tierstack.worker.engine.loss_scaler import LossScaleUnderflowError
    with pytest.raises(LossScaleUnderflowError, match="min_loss_scale"):
        _scales(runs, e.with_value(), 2, overflow=(0, 1))  # 16 -> 8, then at the floor
    assert _scales(runs, e.with_default(), 2, overflow=(0, 1)) == [16.0, 8.0, 4.0]


def _partition_rank(env, addresses: list[str], configs: list[dict], out_dir: str) -> None:
    """One of two data-parallel ranks, each on its own tier manager: a step per config
    (ShardedEngine, as a partitioned job's ranks build their engines); the
    bytes of block inputs it sent the other rank."""
    from tierstack.worker.node.distributed import init_process_group
    from tierstack.worker.engine.sharded_engine import ShardedEngine
    from tierstack.worker.store.sharded_store import ShardedLayerStore

    torch.set_num_threads(1)
    init_process_group(env, torch.device("cpu"))
    exchanged = []
    ids, targets = _batches(1)[0]
    rows = slice(env.rank * ROWS // 2, (env.rank + 1) * ROWS // 2)
    for i, config in enumerate(configs):
        torch.manual_seed(0)
        store = ShardedLayerStore(f"effects-partition-{i}", device="cpu", device_budget=1 << 20,
                                  address=addresses[env.rank], durable=False)
        engine = ShardedEngine(Net(), store, load_config(config).train)
        try:
            engine.train_step(ids[rows], targets[rows])
            exchanged.append(store.collectives.bytes_exchanged)
        finally:
            engine.close()
            store.close()
    torch.distributed.destroy_process_group()
    torch.save(exchanged, Path(out_dir) / f"rank{env.rank}.pt")


@effect("train.activations.partition", True, ENGINE,
        base={"train": {"activations": {"policy": "cpu"}}})
def block_inputs_spread_over_the_ranks_nodes(runs, e, node, tmp_path):
    """Two ranks on two tier managers: each sends part of every block input it stashes to
    the other's node (one rank, or ranks sharing a daemon, have nowhere to spread them)."""
    from tierstack.worker.node.distributed import launch_local

    addresses = [runs.address, node.up().tier_manager.address]
    launch_local(_partition_rank, 2, addresses, [e.with_value(), e.with_default()], str(tmp_path))
    for rank in range(2):
        with_value, with_default = torch.load(tmp_path / f"rank{rank}.pt")
        assert with_value > 0 and with_default == 0


@effect("budgets.hbm", "64MiB", ENGINE)
def hbm_budget_places_blocks(runs, e):
    if not torch.cuda.is_available():  # checked against the device: a CPU has none
        with pytest.raises(ConfigError, match="budgets.hbm is 64 MiB but the device's memory is 0"):
            runs.losses(e.with_value(), steps=1)
        runs.losses(e.with_default(), steps=1)
        return
    with runs.engine(e.with_value()) as engine:
        runs.train(engine, 1)
        assert engine.core.budgets.hbm == 64 * MiB and engine.core.placement is not None


# ---- train.monitor: what the engine prints and records of its steps ----------------------


@effect("train.monitor.steps_per_print", 1, ENGINE)
def prints_a_step_line_every_step(runs, e, capsys):
    for config, steps in ((e.with_value(), [0, 1, 2]), (e.with_default(), [])):
        capsys.readouterr()
        runs.losses(config, steps=2)
        printed = capsys.readouterr().out
        assert [int(n) for n in re.findall(r"\[Rank 0\] step=(\d+), skipped=0", printed)] == steps
        assert printed.count("RunningAvgSamplesPerSec=") == len(steps[1:])


@effect("train.monitor.wall_clock_breakdown", True, ENGINE)
def prints_the_phase_timers(runs, e, capsys):
    for config, lines in ((e.with_value(), 2), (e.with_default(), 0)):
        capsys.readouterr()
        runs.losses(config, steps=2)
        printed = capsys.readouterr().out
        assert len(re.findall(r"time \(ms\) \| fwd_microstep: [\d.]+ \| bwd_microstep: [\d.]+",
                              printed)) == lines
        assert len(re.findall(r"time \(ms\) \| fwd: [\d.]+ \| bwd: [\d.]+", printed)) == lines


def _monitor_files(runs, e, tmp_path, monkeypatch, section: str, pattern: str) -> None:
    """With the value the files of `section` are where it says (or there at all), with the
    default where the default puts them (or nowhere): under the working directory."""
    monkeypatch.chdir(tmp_path)
    for config, place in ((e.with_value(), "value"), (e.with_default(), "default")):
        directory = tmp_path / place
        directory.mkdir()
        monkeypatch.chdir(directory)
        runs.losses(config, steps=2)
        found = sorted(str(p.relative_to(directory)).replace(os.sep, "/")
                       for p in directory.rglob(pattern))
        monitor = load_config(config).train.monitor
        settings = getattr(monitor, section)
        if settings.enabled:
            where = f"{Path(settings.output_path) / settings.job_name}/"
            assert found and all(f.startswith(where) for f in found), (place, found)
        else:
            assert not found, (place, found)


def _files_where_the_section_says(section: str, pattern: str):
    def check(runs, e, tmp_path, monkeypatch):
        _monitor_files(runs, e, tmp_path, monkeypatch, section, pattern)
    return check


_CSV_ON = {"train": {"monitor": {"csv_monitor": {"enabled": True}}}}
_TB_ON = {"train": {"monitor": {"tensorboard": {"enabled": True}}}}
for _section, _pattern, _on in (("csv_monitor", "*.csv", _CSV_ON), ("tensorboard", "events.out.*", _TB_ON)):
    for _key, _value, _base in (("enabled", True, None), ("output_path", "monitor-out", _on),
                                ("job_name", "my-run", _on)):
        effect(f"train.monitor.{_section}.{_key}", _value, ENGINE, base=_base)(
            _files_where_the_section_says(_section, _pattern))


class FakeWandb(types.ModuleType):
    """The wandb package's two calls the monitor makes, recorded."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict] = []
        self.logged: list[tuple[dict, int]] = []

    def init(self, **kwargs) -> None:
        self.inits.append(kwargs)

    def log(self, data: dict, step: int | None = None, commit=None) -> None:
        self.logged.append((data, step))


_WANDB_ON = {"train": {"monitor": {"wandb": {"enabled": True}}}}


@effect("train.monitor.wandb.enabled", True, ENGINE)
def logs_the_figures_to_wandb(runs, e, monkeypatch):
    for config, logged in ((e.with_value(), True), (e.with_default(), False)):
        wandb = FakeWandb()
        monkeypatch.setitem(sys.modules, "wandb", wandb)
        losses = runs.losses(config, steps=2)
        assert bool(wandb.inits) == logged
        if logged:  # each step's loss and learning rate at the samples trained
            loss_events = [(step, d["Train/Samples/train_loss"]) for d, step in wandb.logged
                           if "Train/Samples/train_loss" in d]
            assert [s for s, _ in loss_events] == [8, 16]
            assert [v for _, v in loss_events] == pytest.approx(losses, rel=1e-6)


for _key, _value in (("group", "ablation"), ("team", "my-team"), ("project", "my-project")):
    @effect(f"train.monitor.wandb.{_key}", _value, ENGINE, base=_WANDB_ON)
    def names_the_wandb_run(runs, e, monkeypatch):
        argument = {"group": "group", "team": "entity", "project": "project"}[e.key.split(".")[-1]]
        default = {"group": None, "entity": None, "project": "deepspeed"}[argument]
        for config, expected in ((e.with_value(), e.value), (e.with_default(), default)):
            wandb = FakeWandb()
            monkeypatch.setitem(sys.modules, "wandb", wandb)
            runs.losses(config, steps=1)
            assert wandb.inits[0][argument] == expected


# ---- last: checks that stop a NODE service (a later check would start it again) ------


@effect("tier_manager.shutdown_grace_seconds", 1, NODE)
def tier_manager_waits_grace_for_calls_in_flight(node):
    seconds = node.up().tier_manager.seconds_to_exit_on_sigterm(
        "/tierstack.tier_manager.v1.TierManager/GetStats")
    # The call held it its 1 s, then was cut; with the default it would hold it 30 s. Half
    # of that bounds the exit: far more than a loaded machine takes to end a process.
    assert 1.0 <= seconds < DEFAULTS.tier_manager.shutdown_grace_seconds / 2


@effect("scheduler.shutdown_grace_seconds", 1, NODE)
def scheduler_waits_grace_for_calls_in_flight(node):
    # The default (5 s) is too near 1 s to bound the exit by: a loaded machine takes
    # seconds to end a process. Its exit with no call in flight, measured here, is the
    # baseline; the call adds its grace to it, 1 s, or the default's 5.
    if node.scheduler.running():
        node.scheduler.kill()
    idle = node.scheduler.start().seconds_to_exit_on_sigterm(None)
    seconds = node.scheduler.start().seconds_to_exit_on_sigterm(
        "/tierstack.scheduler.v1.Scheduler/ListNodes")
    default = DEFAULTS.scheduler.shutdown_grace_seconds
    assert 1.0 <= seconds and seconds - idle < (1.0 + default) / 2, (seconds, idle)


# ---- the tests --------------------------------------------------------------------------------


def test_every_config_key_has_an_effect():
    keys = leaf_keys()
    missing = [k for k in keys if k not in EFFECTS]
    assert not missing, (f"config keys with no effect test: {', '.join(missing)}; add each to "
                         f"tests/test_config_effects.py's EFFECTS (a value and a check that it "
                         f"changes what the path using it does), or refuse the key")
    assert not set(EFFECTS) - set(keys), f"not config keys: {sorted(set(EFFECTS) - set(keys))}"
    for e in EFFECTS.values():
        if not callable(e.value):
            assert e.value != default_of(e.key), f"{e.key}: {e.value!r} is its default"


@pytest.mark.parametrize("key", list(EFFECTS))
def test_config_key_takes_effect(key, request):
    e = EFFECTS[key]
    env = request.getfixturevalue(e.group)
    # A check may ask for more fixtures by name (ENGINE checks get the Effect too).
    names = list(inspect.signature(e.check).parameters)[2 if e.group == ENGINE else 1:]
    more = [request.getfixturevalue(name) for name in names]
    if e.group == ENGINE:
        e.check(env, e, *more)
    else:
        e.check(env, *more)
