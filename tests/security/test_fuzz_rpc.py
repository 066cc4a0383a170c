"""A property-based fuzzer (hypothesis) against live daemons, over every RPC they serve.

Every method of the tier manager (TierManager, NodeMetrics, Health) and of the scheduler
gets requests drawn two ways: generically from its message's descriptor (every field
unset or set to an edge value: huge, negative, NaN, empty, unicode, 1 KiB keys) and, for
the methods with state behind them, from the daemon's own answers (leases it granted,
keys and versions it stored, AdamW blocks over real tensors, duplicated keys), plus raw
bytes that are no message at all. Sentinel tensors written first must come through
bit for bit, also after a restart.

The property: every call ends with a documented status (proto/tier_manager.proto's
header: OK, or one that names the caller's mistake: INVALID_ARGUMENT, NOT_FOUND,
RESOURCE_EXHAUSTED, FAILED_PRECONDITION, OUT_OF_RANGE; UNAVAILABLE only with a retry hint,
for what another call holds; UNIMPLEMENTED for the health methods other than Check)
within CALL_TIMEOUT: never UNKNOWN or INTERNAL (a bug), DATA_LOSS (a corruption),
UNAVAILABLE without a hint (a dead daemon) or DEADLINE_EXCEEDED (a hang). Besides the
drawn requests, a sweep sets every numeric field of every method's request to its
extremes (0, -1, 2^63, 2^64-1, as its type holds them; NaN and infinities for floats)
and every string field to NUL, '..', 4 KiB and invalid UTF-8. Time-bounded: FUZZ_SECONDS in all
(TIERSTACK_FUZZ_SECONDS, default 12 in the suite; longer runs: bench/hardening.py), in batches of
hypothesis examples until the budget is spent; the figures are printed at the end.
"""

from __future__ import annotations

import collections
import fcntl
import json
import os
import threading
import time
import traceback
import urllib.request
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor as pd
from google.protobuf import message_factory
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.conftest import tier_manager_process
from tests.security.sentinels import SENTINEL_JOB, check_sentinels, write_sentinels
from tierstack.config import SchedulerConfig
from tierstack.errors import InvalidArgumentError, KeyNotFoundError
from tierstack.proto import node_metrics_pb2, scheduler_pb2, tier_manager_pb2
from tierstack.rpc import RETRY_PUSHBACK
from tierstack.services.scheduler.embedded import EmbeddedScheduler
from tierstack.services.tier_manager.client import TierManagerClient
from tierstack.worker.store.arenas import ArenaMap

FUZZ_SECONDS = float(os.environ.get("TIERSTACK_FUZZ_SECONDS") or 12.0)
CALL_TIMEOUT = 20.0
STREAM_WINDOW = 1.0
OK = grpc.StatusCode.OK
ALLOWED = {OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.OUT_OF_RANGE}
HEALTH_SERVICE = "grpc.health.v1.Health"


class _RetryLater:
    """UNAVAILABLE with a retry hint (grpc-retry-pushback-ms): a documented answer, told
    apart from UNAVAILABLE without one (a dead daemon)."""

    name = "UNAVAILABLE_RETRY_LATER"


RETRY_LATER = _RetryLater()
ALLOWED.add(RETRY_LATER)

KEYS = ["fuzz/a", "fuzz/b", "fuzz/c", "fuzz2/x", "fuzz2/y", "loose", "a/b/c", "../../etc/passwd",
        "/abs/path", "ключ/🙂", "fuzz/" + "k" * 1100, "fuzz\x01/\x7f"]
JOBS = ["fuzz", "fuzz2", "", "a/b", "j" * 300, "ключ"]
DTYPES = ["float32", "bfloat16", "float16", "uint8", "int64", "bool", "complex7", "", "float8_e4m3fn"]
UINT_EDGES = [0, 1, 2, 3, 4, 13, 4095, 4096, 4097, 65536, 1 << 20, 5 << 20, 1 << 31, (1 << 63) - 1,
              1 << 63, (1 << 64) - 1]


def _no_sentinel(text: str) -> str:
    """Fuzzed strings never name the sentinels' job (they may come close)."""
    return "x" + text if text.startswith("sentinel") else text


# ---- generic requests, from a message's descriptor ----------------------------------------------

TEXT = st.one_of(st.sampled_from(KEYS + JOBS), st.text(max_size=24),
                 st.text(min_size=1020, max_size=1030)).map(_no_sentinel)
_INTS = {
    pd.FieldDescriptor.TYPE_INT64: (-(1 << 63), (1 << 63) - 1),
    pd.FieldDescriptor.TYPE_SINT64: (-(1 << 63), (1 << 63) - 1),
    pd.FieldDescriptor.TYPE_SFIXED64: (-(1 << 63), (1 << 63) - 1),
    pd.FieldDescriptor.TYPE_UINT64: (0, (1 << 64) - 1),
    pd.FieldDescriptor.TYPE_FIXED64: (0, (1 << 64) - 1),
    pd.FieldDescriptor.TYPE_INT32: (-(1 << 31), (1 << 31) - 1),
    pd.FieldDescriptor.TYPE_SINT32: (-(1 << 31), (1 << 31) - 1),
    pd.FieldDescriptor.TYPE_SFIXED32: (-(1 << 31), (1 << 31) - 1),
    pd.FieldDescriptor.TYPE_UINT32: (0, (1 << 32) - 1),
    pd.FieldDescriptor.TYPE_FIXED32: (0, (1 << 32) - 1),
    pd.FieldDescriptor.TYPE_ENUM: (-3, 12),
}


def _scalar(field: pd.FieldDescriptor) -> st.SearchStrategy:
    t = field.type
    if t == pd.FieldDescriptor.TYPE_STRING:
        return TEXT
    if t == pd.FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == pd.FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (pd.FieldDescriptor.TYPE_DOUBLE, pd.FieldDescriptor.TYPE_FLOAT):
        width = 64 if t == pd.FieldDescriptor.TYPE_DOUBLE else 32
        return st.one_of(st.sampled_from([0.0, -0.0, 1e-300, 0.05, 1.0, 1e13, -1.0]),
                         st.floats(width=width))
    lo, hi = _INTS[t]
    return st.one_of(st.sampled_from([v for v in UINT_EDGES + [-1, -4096] if lo <= v <= hi]),
                     st.integers(lo, hi))


def message_strategy(descriptor: pd.Descriptor, depth: int = 0) -> st.SearchStrategy:
    """Messages of this type with each field unset or drawn from its type's edge values."""
    fields = {}
    for field in descriptor.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value = st.dictionaries(TEXT, TEXT, max_size=3)
        elif field.message_type is not None:
            if depth >= 3:
                continue
            inner = message_strategy(field.message_type, depth + 1)
            value = st.lists(inner, max_size=3) if _repeated(field) else inner
        else:
            value = st.lists(_scalar(field), max_size=6) if _repeated(field) else _scalar(field)
        fields[field.name] = st.one_of(st.none(), value)
    cls = message_factory.GetMessageClass(descriptor)
    return st.fixed_dictionaries(fields).map(lambda values: _build(cls, values))


def _repeated(field: pd.FieldDescriptor) -> bool:
    return field.is_repeated


def _build(cls, values: dict):
    msg = cls()
    for name, value in values.items():
        if value is None:
            continue
        field = cls.DESCRIPTOR.fields_by_name[name]
        target = getattr(msg, name) if (_repeated(field) or field.message_type) else None
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            target.update(value)
        elif field.message_type is not None and _repeated(field):
            for item in value:
                target.add().CopyFrom(item)
        elif field.message_type is not None:
            target.CopyFrom(value)
        elif _repeated(field):
            target.extend(value)
        else:
            setattr(msg, name, value)
    return msg


# ---- requests drawn from the daemon's own answers ---------------------------------------------------

_NO_BLOCK = {"params": "p", "grads": "g", "master": "", "exp_avg": "m", "exp_avg_sq": "v",
             "numel": 1, "param_dtype": "float32", "grad_dtype": "float32"}


class State:
    """What the daemon granted so far: the fuzzer aims later requests at it."""

    def __init__(self) -> None:
        self.leases: list[tuple[int, int]] = [(1, 0)]  # (lease id, bytes)
        self.versions: list[int] = [0, 1]
        self.blocks: list[dict] = []  # AdamW blocks whose tensors were stored (see _adamw_setup)


def _keys(data) -> list[str]:
    return data.draw(st.lists(st.sampled_from(KEYS), max_size=4))


def _targeted(method: str, data, state: State):
    """A plausible request for `method`, or None where the generic one suffices."""
    pb = tier_manager_pb2
    if method == "AllocateBuffer":
        return pb.AllocateBufferRequest(nbytes=data.draw(st.sampled_from(UINT_EDGES[:12])))
    if method == "Commit":
        lease, nbytes = _recent(state.leases, data)
        dtype = data.draw(st.sampled_from(DTYPES))
        shape = data.draw(st.sampled_from([[nbytes], [nbytes // 4], [nbytes // 2, 2], [],
                                           [-1, -nbytes], [1 << 62, 1 << 62], [1] * 70]))
        return pb.CommitRequest(key=data.draw(st.sampled_from(KEYS)), lease_id=lease, dtype=dtype,
                                shape=shape, durable=data.draw(st.booleans()),
                                placement=data.draw(st.integers(-1, 4)))
    if method in ("Fetch", "Prefetch", "Evict", "Delete", "SetAccessOrder"):
        return getattr(pb, f"{method}Request")(keys=_keys(data))
    if method == "Release":
        return pb.ReleaseRequest(key=data.draw(st.sampled_from(KEYS)),
                                 version=_recent(state.versions, data))
    if method == "Describe":
        return pb.DescribeRequest(key=data.draw(st.sampled_from(KEYS)))
    if method == "WatchStats":
        return pb.WatchStatsRequest(interval_seconds=data.draw(
            st.sampled_from([0.0, 0.01, 0.05, 1.0, 1e13, -1.0, float("nan"), float("inf")])))
    if method in ("OpenJob", "CloseJob", "DeleteJob"):
        job = data.draw(st.sampled_from(JOBS))
        if method == "OpenJob":
            return pb.OpenJobRequest(job=job, keep=data.draw(st.booleans()),
                                     quota_bytes=data.draw(st.sampled_from(UINT_EDGES[:10])))
        if method == "DeleteJob":
            return pb.DeleteJobRequest(job=job, force=data.draw(st.booleans()))
        return pb.CloseJobRequest(job=job)
    if method == "AdamWStep":
        # Both are drawn whatever the state, so that the draws never depend on it.
        stored, plain = _adamw_on_stored(data, state), _adamw(data)
        return stored if stored is not None and data.draw(st.integers(0, 3)) else plain
    return _targeted_scheduler(method, data)


def _targeted_scheduler(method: str, data):
    """Scheduler requests that get past the first checks: real nodes and traces, then one
    field pushed off the edge."""
    from tierstack.services.scheduler import synthetic, wire

    pb = scheduler_pb2
    nodes = ["n0", "n1", "nx"]
    if method == "RegisterNode":
        msg = wire.node_pb(synthetic.node(data.draw(st.sampled_from(nodes))),
                           metrics_url=data.draw(st.sampled_from(
                               ["", "http://127.0.0.1:9", "file:///etc/passwd", "gopher://x", "http://"])))
        if data.draw(st.booleans()):
            setattr(msg.bandwidth, data.draw(st.sampled_from(["disk_read", "h2d", "d2h"])),
                    data.draw(st.sampled_from([0.0, -1.0, float("nan"), float("inf"), 1e300])))
        return msg
    if method == "ReportTrace":
        trace = synthetic.transformer_trace(layers=data.draw(st.integers(1, 6)), job="fuzz",
                                            nodes=tuple(data.draw(st.lists(st.sampled_from(nodes),
                                                                           min_size=1, max_size=2))))
        msg = wire.trace_pb(trace)
        edit = data.draw(st.sampled_from(["none", "layer", "compute", "nbytes", "lengths", "budget"]))
        if edit == "layer":
            msg.step_layer[0] = 1 << 31
        elif edit == "compute":
            msg.step_compute[0] = data.draw(st.sampled_from([-1.0, float("nan"), float("inf")]))
        elif edit == "nbytes":
            msg.tensors[0].nbytes = (1 << 64) - 1
        elif edit == "lengths":
            del msg.step_backward[:]
        elif edit == "budget":
            msg.device_budget = (1 << 64) - 1
        return msg
    if method == "ReportBandwidth":
        return pb.BandwidthReport(node_id=data.draw(st.sampled_from(nodes)), measured=pb.Bandwidths(
            disk_read=data.draw(st.sampled_from([0.0, 1e9, -1.0, float("nan"), float("inf")]))))
    if method in ("GetPlan", "WatchPlans", "ForgetJob"):
        job = data.draw(st.sampled_from(["fuzz", "nojob", ""]))
        if method == "GetPlan":
            return pb.GetPlanRequest(job=job, newer_than=data.draw(st.sampled_from([0, 1, 5])),
                                     timeout_seconds=data.draw(st.sampled_from(
                                         [0.0, 0.01, 0.2, -1.0, float("nan"), 1e13])))
        return pb.WatchPlansRequest(job=job) if method == "WatchPlans" else pb.ForgetJobRequest(job=job)
    if method == "WatchNodePlans":
        return pb.WatchNodePlansRequest(node_id=data.draw(st.sampled_from(nodes + [""])))
    return None


def _recent(items: list, data):
    """One of the last 8 items. Drawn as an index, not with sampled_from(items): hypothesis
    requires a draw's constraints not to depend on state outside the test case."""
    return items[-1 - data.draw(st.integers(0, 7)) % len(items)]


def _adamw_on_stored(data, state: State):
    """A step over a block whose tensors exist with consistent sizes, or a near miss (None
    while no block is stored; the draws are made either way)."""
    pb = tier_manager_pb2
    block = dict(_recent(state.blocks or [_NO_BLOCK], data))
    edit = data.draw(st.sampled_from(["none"] * 6 + ["swap", "dup", "offset", "dtype", "numel"]))
    segments = [pb.AdamWSegment(numel=block["numel"], param_offset=0, grad_offset=0, state_offset=0)]
    if edit == "swap":
        block["grads"], block["exp_avg"] = block["exp_avg"], block["grads"]
    elif edit == "dup":
        block["exp_avg"] = block[data.draw(st.sampled_from(["params", "grads", "master"]))] or block["params"]
    elif edit == "offset":
        segments[0].grad_offset = data.draw(st.sampled_from([1, 2, 3, 4, 1 << 40]))
    elif edit == "dtype":
        block["grad_dtype"] = data.draw(st.sampled_from(["bfloat16", "float16", "uint8", "float64"]))
    elif edit == "numel":
        segments[0].numel = block["numel"] + data.draw(st.sampled_from([1, 3, -block["numel"] + 1]))
    request = pb.AdamWStepRequest(
        blocks=[pb.AdamWBlock(params=block["params"], grads=block["grads"], master=block["master"],
                              exp_avg=block["exp_avg"], exp_avg_sq=block["exp_avg_sq"],
                              param_dtype=block["param_dtype"], grad_dtype=block["grad_dtype"],
                              state_nbytes=4 * block["numel"], segments=segments,
                              state_placement=data.draw(st.integers(0, 2)))],
        step=data.draw(st.sampled_from([1, 1, 2, 3])), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
        weight_decay=0.01, grad_scale=data.draw(st.sampled_from([0.0, 1.0, 1.0, 0.5, float("nan")])),
        durable=data.draw(st.booleans()), release_gradients=data.draw(st.sampled_from([False] * 4 + [True])))
    return request if state.blocks else None


def _adamw(data):
    """An AdamW step over fuzz keys: mostly well formed, with offsets, sizes, dtypes, roles
    and hyperparameters pushed off the edge one at a time."""
    pb = tier_manager_pb2
    blocks = []
    for _ in range(data.draw(st.integers(0, 3))):
        keys = data.draw(st.lists(st.sampled_from(KEYS[:6]), min_size=5, max_size=5))
        numel = data.draw(st.sampled_from([0, 1, 3, 6, 1024, 25_000, 75_000]))
        segments = [pb.AdamWSegment(numel=numel, param_offset=data.draw(st.sampled_from([0, 1, 2, 4])),
                                    grad_offset=data.draw(st.sampled_from([0, 1, 2, 4])),
                                    state_offset=data.draw(st.sampled_from([0, 4, 8])))
                    for _ in range(data.draw(st.integers(0, 3)))]
        blocks.append(pb.AdamWBlock(
            params=keys[0], grads=keys[1], master=data.draw(st.sampled_from(["", keys[2]])),
            exp_avg=keys[3], exp_avg_sq=keys[4],
            param_dtype=data.draw(st.sampled_from(DTYPES[:4])),
            grad_dtype=data.draw(st.sampled_from(DTYPES[:4])),
            state_nbytes=data.draw(st.sampled_from([0, 4, 13, 4 * numel, 300_000, 1 << 40])),
            segments=segments, state_placement=data.draw(st.integers(-1, 3))))
    floats = st.sampled_from([0.0, 1e-3, 0.9, 0.999, 1.0, -1.0, float("nan"), float("inf")])
    return pb.AdamWStepRequest(
        blocks=blocks, step=data.draw(st.sampled_from([0, 1, 2, 3, 1 << 63])), lr=data.draw(floats),
        beta1=data.draw(floats), beta2=data.draw(floats), eps=data.draw(floats),
        weight_decay=data.draw(floats), grad_scale=data.draw(floats),
        durable=data.draw(st.booleans()), release_gradients=data.draw(st.booleans()))


def _long_poll(method: str, payload: bytes) -> bool:
    """A GetPlan that asked to wait for a newer plan at least as long as our deadline."""
    if method != "GetPlan":
        return False
    request = scheduler_pb2.GetPlanRequest.FromString(payload)
    return request.newer_than > 0 and request.timeout_seconds >= CALL_TIMEOUT


# ---- the driver -----------------------------------------------------------------------------------

class Fuzzer:
    """Sends drawn requests to one daemon and tallies the statuses."""

    def __init__(self, address: str, services: list) -> None:
        self.channel = grpc.insecure_channel(address)
        self.methods = []  # (path, request descriptor, response class, streaming)
        for file, name in services:
            service = file.DESCRIPTOR.services_by_name[name] if name is not None else file
            for m in service.methods:
                self.methods.append((f"/{service.full_name}/{m.name}", m.input_type,
                                     message_factory.GetMessageClass(m.output_type),
                                     m.server_streaming))
        self.generic = {path: message_strategy(inp) for path, inp, _, _ in self.methods}
        # The calls with the most code behind them are drawn more often.
        deep = {"AdamWStep": 8, "Commit": 2, "AllocateBuffer": 2, "Fetch": 2, "ReportTrace": 4,
                "RegisterNode": 2}
        self.weighted = [m for m in self.methods for _ in range(deep.get(m[0].rsplit("/", 1)[1], 1))]
        self.state = State()
        self.session: tuple = ()  # metadata naming a client session, when one is made
        self._session_fd: int | None = None
        self._blocks = 0
        self.tally: collections.Counter = collections.Counter()
        self.sent = 0
        self.slowest = 0.0
        self.failures: list[str] = []
        self.details = ""
        self.messages: collections.Counter = collections.Counter()  # (method, message) seen

    def start_session(self, directory: str) -> None:
        """A client session as TierManagerClient makes one: half the calls then name it."""
        session = os.urandom(16).hex()
        path = Path(directory) / f"tierstack-client-{session}.lock"
        self._session_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self._session_fd, fcntl.LOCK_EX)
        self.session = (("x-tierstack-session", session),)

    def adamw_setup(self, data) -> None:
        """Store a block's tensors with consistent sizes (params, grads, master, moments) for
        later AdamW requests to aim at: the fuzzer then reaches the kernel."""
        pb = tier_manager_pb2
        self._blocks += 1
        numel = data.draw(st.sampled_from([1, 6, 1000, 70_000]))
        param_dtype = data.draw(st.sampled_from(["float32", "bfloat16"]))
        grad_dtype = data.draw(st.sampled_from(["float32", "bfloat16"]))
        names = {role: f"blk/b{self._blocks}/{role}" for role in
                 ("params", "grads", "master", "exp_avg", "exp_avg_sq")}
        sizes = {"params": numel * (4 if param_dtype == "float32" else 2),
                 "grads": numel * (4 if grad_dtype == "float32" else 2), "master": numel * 4}
        if data.draw(st.integers(0, 3)) == 0:
            sizes["grads"] = data.draw(st.sampled_from([13, 1, sizes["grads"] + 1]))  # a misfit
        for role, nbytes in sizes.items():
            if role == "master" and param_dtype == "float32":
                continue
            lease = pb.BufferLease.FromString(self.channel.unary_unary(
                f"/{tier_manager_pb2.DESCRIPTOR.services_by_name['TierManager'].full_name}/AllocateBuffer")(
                pb.AllocateBufferRequest(nbytes=nbytes).SerializeToString(), timeout=CALL_TIMEOUT))
            try:
                self.channel.unary_unary(
                    f"/{tier_manager_pb2.DESCRIPTOR.services_by_name['TierManager'].full_name}/Commit")(
                    pb.CommitRequest(key=names[role], lease_id=lease.lease_id, dtype="uint8",
                                     shape=[nbytes], durable=False).SerializeToString(),
                    timeout=CALL_TIMEOUT)
            except grpc.RpcError:
                return  # the pool is full: no block this time
        self.state.blocks.append({**names, "master": names["master"] if param_dtype != "float32" else "",
                                  "numel": numel, "param_dtype": param_dtype, "grad_dtype": grad_dtype})

    def example(self, data) -> None:
        if self.state.blocks is not None and data.draw(st.integers(0, 9)) == 0 and \
                any(p.endswith("/AdamWStep") for p, *_ in self.methods):
            try:
                self.adamw_setup(data)
            except grpc.RpcError:
                pass  # a full pool: the setup is no call under test
        for _ in range(data.draw(st.integers(1, 10))):
            path, descriptor, response_cls, streaming = data.draw(st.sampled_from(self.weighted))
            name = path.rsplit("/", 1)[1]
            how = data.draw(st.sampled_from(["targeted", "targeted", "generic", "raw"]))
            request = _targeted(name, data, self.state) if how == "targeted" else None
            if how == "raw":
                payload = data.draw(st.binary(max_size=200))
            else:
                payload = (request or data.draw(self.generic[path])).SerializeToString()
            metadata = self.session if data.draw(st.booleans()) else ()
            code = self.send(path, payload, response_cls, streaming, metadata)
            refused = path.startswith(f"/{HEALTH_SERVICE}/") and not path.endswith("/Check")
            allowed = ALLOWED | ({grpc.StatusCode.UNIMPLEMENTED} if refused else set())
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and _long_poll(name, payload):
                continue  # it waited as long as it was asked to: no hang
            if code not in allowed:
                # Recorded, not raised: hypothesis would replay the example against a daemon
                # whose state moved on (its draws depend on that state), and call it flaky.
                self.failures.append(f"{name} answered {code.name} ({self.details[:300]}) to "
                                     f"{payload[:300]!r}")

    def send(self, path: str, payload: bytes, response_cls, streaming: bool,
             metadata: tuple = ()) -> grpc.StatusCode:
        self.sent += 1
        self.details = ""
        start = time.monotonic()
        try:
            if streaming:
                # A watch may rightly wait for its first event: one that stays open without
                # an error for STREAM_WINDOW seconds passes, and is cancelled by us.
                call = self.channel.unary_stream(path)(payload, timeout=CALL_TIMEOUT,
                                                       metadata=metadata)
                timer = threading.Timer(STREAM_WINDOW, call.cancel)
                timer.start()
                try:
                    next(call, None)
                    code = OK
                except grpc.RpcError as e:
                    code = OK if e.code() == grpc.StatusCode.CANCELLED and not timer.is_alive() else e.code()
                finally:
                    timer.cancel()
                    call.cancel()
            else:
                raw = self.channel.unary_unary(path)(payload, timeout=CALL_TIMEOUT,
                                                     metadata=metadata)
                self._learn(path, raw, response_cls)
                code = OK
        except grpc.RpcError as e:
            code = e.code()
            self.details = e.details() or ""
            if code == grpc.StatusCode.UNAVAILABLE and RETRY_PUSHBACK in dict(e.trailing_metadata() or ()):
                code = RETRY_LATER  # refused for now, with a hint: documented
        self.slowest = max(self.slowest, time.monotonic() - start)
        self.tally[(path.rsplit("/", 1)[1], code.name)] += 1
        if os.environ.get("TIERSTACK_FUZZ_TALLY"):
            self.messages[(path.rsplit("/", 1)[1], self.details[:70])] += 1
        return code

    def _learn(self, path: str, raw: bytes, response_cls) -> None:
        name = path.rsplit("/", 1)[1]
        if name == "AllocateBuffer":
            lease = response_cls.FromString(raw)
            self.state.leases.append((lease.lease_id, lease.nbytes))
        elif name in ("Commit", "Describe"):
            self.state.versions.append(response_cls.FromString(raw).version)
        elif name == "Fetch":
            self.state.versions += [r.info.version for r in response_cls.FromString(raw).tensors]

    def run(self, seconds: float) -> float:
        """Batches of examples until `seconds` have passed; returns the time spent."""
        start = time.monotonic()
        batch = 0
        while time.monotonic() - start < seconds:
            batch += 1

            @settings(max_examples=25, deadline=None, database=None, derandomize=False,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            @given(st.data())
            def examples(data):
                try:
                    self.example(data)
                except Exception:  # noqa: BLE001 - recorded, not raised (see example)
                    self.failures.append(traceback.format_exc())

            examples()
            assert not self.failures, "\n".join(self.failures[:20])
        return time.monotonic() - start

    def counts(self) -> dict[str, int]:
        out: collections.Counter = collections.Counter()
        for (_, code), n in self.tally.items():
            out[code] += n
        return dict(out)

    def close(self) -> None:
        self.channel.close()
        if self._session_fd is not None:
            os.close(self._session_fd)
            self._session_fd = None


@pytest.fixture
def fuzz_daemon(tmp_path: Path, shm_dir: Path):
    """A tier manager with small pools, short leases and an HTTP API, for fuzzing."""
    config = tmp_path / "tier-manager.json"
    config.write_text(json.dumps({"tier_manager": {
        "cpu_pool": {"size": "8MiB", "shm_dir": str(shm_dir), "keep_empty_seconds": 0.5},
        "nvme_pool": {"paths": [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")], "size": "64MiB",
                      "aio": {"block_size": "256KiB", "queue_depth": 4}},
        "manifest_path": str(tmp_path / "manifest.sqlite"),
        "lease_timeout_seconds": 2.0, "shutdown_grace_seconds": 10,
        "jobs": {"grace_seconds": 1.0},
        "metrics": {"http_listen": "127.0.0.1:0", "sample_interval_seconds": 0.5}}}))
    proc = tier_manager_process(config, tmp_path / "tm.sock").start()
    yield proc
    proc.kill()


def _http_ok(client: TierManagerClient) -> None:
    url = client.http_endpoint()
    for path in ("/api/v1/node", "/metrics", "/api/v1/plan", "/api/v1/cluster"):
        with urllib.request.urlopen(url + path, timeout=10) as response:
            assert response.status == 200, path


def test_fuzzing_every_rpc_of_both_daemons_gets_proper_statuses_and_touches_no_sentinel(
        fuzz_daemon, tmp_path):
    client = TierManagerClient(fuzz_daemon.address, reconnect_timeout=30)
    write_sentinels(client)
    tm = Fuzzer(fuzz_daemon.address, [(tier_manager_pb2, "TierManager"),
                                     (node_metrics_pb2, "NodeMetrics"),
                                     (_health_service(), None)])
    tm.start_session(client.node().session_dir)
    try:
        spent = tm.run(FUZZ_SECONDS * 2 / 3)
        # The daemon still answers, its HTTP API serves, and the sentinels are intact,
        # also after a graceful restart (they are durable). The fuzzer's own tensors go
        # first: some were placed "cpu" (never evicted) and may fill the pool, rightly.
        # Bound by the answer, not the clock: a wedged daemon never answers, and the
        # client's 30 s deadline ends the call in TierManagerUnavailableError.
        client.node()
        _http_ok(client)
        tm.close()
        for job in client.jobs():
            if job.job != SENTINEL_JOB:
                try:
                    client.delete_job(job.job, force=True)
                except KeyNotFoundError:  # ended by itself since listed (its grace ran out)
                    pass
        for key in KEYS:
            try:
                client.delete([key])
            except (KeyNotFoundError, InvalidArgumentError):
                pass
        time.sleep(3)  # leases and pins the fuzzer left expire (lease_timeout_seconds 2)
        assert check_sentinels(client) == []
        assert fuzz_daemon.stop(timeout=30) == 0  # SIGTERM ends it, with status 0
        fuzz_daemon.start()
        assert check_sentinels(client) == []
        assert "Traceback" not in fuzz_daemon.log_text()
    finally:
        tm.close()
        client.close()
    sched = on_a_scheduler(lambda fuzzer: fuzzer.run(FUZZ_SECONDS / 3))
    spent += sched.spent
    statuses = collections.Counter(tm.counts()) + collections.Counter(sched.counts())
    figures = {"fuzz_seconds": round(spent, 1), "requests": tm.sent + sched.sent,
               "tier_manager_requests": tm.sent, "scheduler_requests": sched.sent,
               "statuses": dict(sorted(statuses.items())), "hangs": 0,
               "slowest_call_seconds": round(max(tm.slowest, sched.slowest), 2),
               "methods": len(tm.methods) + len(sched.methods)}
    print("fuzz figures:", json.dumps(figures))
    if os.environ.get("TIERSTACK_FUZZ_TALLY"):
        print(json.dumps({f"{m} {c}": n for (m, c), n in sorted((tm.tally + sched.tally).items())},
                         indent=0))
        for (method, message), n in sorted((tm.messages + sched.messages).items()):
            print(f"{n:6d} {method}: {message}")
    assert statuses.get("UNKNOWN", 0) == statuses.get("INTERNAL", 0) == 0


def on_a_scheduler(run) -> Fuzzer:
    """`run(fuzzer)` against a fresh embedded scheduler; the fuzzer, with what `run`
    returned as its `spent`, once the scheduler logged no traceback."""
    with EmbeddedScheduler(SchedulerConfig(metrics_listen="")) as scheduler:
        fuzzer = Fuzzer(scheduler.address, [(scheduler_pb2, "Scheduler"), (_health_service(), None)])
        try:
            fuzzer.spent = run(fuzzer)
            assert "Traceback" not in scheduler.log_text()
        finally:
            fuzzer.close()
    return fuzzer


def _health_service():
    from grpc_health.v1 import health_pb2

    return health_pb2.DESCRIPTOR.services_by_name["Health"]


# ---- every field at its extremes ------------------------------------------------------------------

INVALID_UTF8 = b"\xff\xfe\xc0\xaf"  # 0xff is never UTF-8; c0 af is an overlong '/'
_UTF8_STAND_IN = "\x01\x02\x03\x04"  # as long as INVALID_UTF8: swapped in the bytes sent
STRING_EXTREMES = ["", "\x00", "fuzz/a\x00b", "..", "../../etc/passwd", "fuzz/" + "k" * 4091,
                   _UTF8_STAND_IN]
FLOAT_EXTREMES = [0.0, -1.0, 2.0 ** 63, 2.0 ** 64, float("nan"), float("inf"), float("-inf")]


def _extremes(field: pd.FieldDescriptor) -> list:
    """0, -1, 2^63 and 2^64-1 as the field's type holds them (and its own bounds); NaN and
    the infinities for floats; NUL, '..', 4 KiB and invalid UTF-8 for strings."""
    t = field.type
    if t == pd.FieldDescriptor.TYPE_STRING:
        return STRING_EXTREMES
    if t == pd.FieldDescriptor.TYPE_BYTES:
        return [b"", b"\x00", b"\xff" * 4096]
    if t in (pd.FieldDescriptor.TYPE_DOUBLE, pd.FieldDescriptor.TYPE_FLOAT):
        return FLOAT_EXTREMES
    if t == pd.FieldDescriptor.TYPE_BOOL:
        return [True]
    lo, hi = _INTS[t] if t != pd.FieldDescriptor.TYPE_ENUM else (-(1 << 31), (1 << 31) - 1)
    return sorted({v for v in (0, -1, 1 << 63, (1 << 64) - 1, lo, hi) if lo <= v <= hi})


def _scalar_paths(msg, prefix=()):
    """(path, field) of every scalar field of `msg`, into its nested messages (the first
    element of a repeated one), as a path of (field name, index or None)."""
    for field in msg.DESCRIPTOR.fields:
        if field.message_type is not None:
            if field.message_type.GetOptions().map_entry:
                continue
            if _repeated(field):
                items = getattr(msg, field.name)
                if items:
                    yield from _scalar_paths(items[0], prefix + ((field.name, 0),))
            else:
                yield from _scalar_paths(getattr(msg, field.name), prefix + ((field.name, None),))
        else:
            yield prefix + ((field.name, None),), field


def extreme_variants(base):
    """(label, payload): `base` with one scalar field set to one of its extremes."""
    for path, field in _scalar_paths(base):
        for value in _extremes(field):
            msg = type(base)()
            msg.CopyFrom(base)
            target = msg
            for name, index in path[:-1]:
                target = getattr(target, name)[index] if index is not None else getattr(target, name)
            name = path[-1][0]
            if _repeated(field):
                del getattr(target, name)[:]
                getattr(target, name).append(value)
            else:
                setattr(target, name, value)
            payload = msg.SerializeToString()
            if value == _UTF8_STAND_IN:
                payload = payload.replace(_UTF8_STAND_IN.encode(), INVALID_UTF8)
            label = ".".join(n if i is None else f"{n}[{i}]" for n, i in path)
            yield f"{label}={value!r:.40}", payload


def _tier_manager_bases(fuzzer: Fuzzer, client: TierManagerClient) -> dict:
    """A request each method would serve, over tensors stored for the sweep."""
    from tierstack.services.tier_manager import wire
    from tierstack.services.tier_manager.types import AdamWBlock, AdamWHyper, AdamWSegment, WorkerReport

    pb = tier_manager_pb2
    arenas = ArenaMap(client.node(), pin_for_cuda=False, describe=client.node)
    try:
        for role in ("params", "grads"):
            lease = client.allocate(4000)
            arenas.sync(lease.arenas_epoch)
            arenas.view(lease.arena, lease.offset, 4000).fill_(1)
            client.commit(f"sweep/{role}", lease.lease_id, "uint8", (4000,), durable=False)
    finally:
        arenas.close()
    lease = client.allocate(4000).lease_id
    version = client.describe("sweep/params").version
    step = wire.adamw_request_pb([AdamWBlock("sweep/params", "sweep/grads", "", "sweep/m", "sweep/v",
                                             "float32", "float32", 4000, (AdamWSegment(1000, 0, 0, 0),))],
                                 AdamWHyper(1, 1e-3, 0.9, 0.999, 1e-8, 0.01), False)
    report = wire.worker_report_pb(WorkerReport("w", "sweep", "cpu", time.time(), 1, 1, 0.1, (0.01,),
                                                (1, 0), 0.1, 1, 2, 0, 2))
    keys = ["sweep/params"]
    return {"GetNode": pb.GetNodeRequest(), "AllocateBuffer": pb.AllocateBufferRequest(nbytes=4096),
            "CancelBuffer": pb.CancelBufferRequest(lease_id=lease),
            "Commit": pb.CommitRequest(key="sweep/c", lease_id=lease, dtype="uint8", shape=[4000]),
            "Fetch": pb.FetchRequest(keys=keys), "Prefetch": pb.PrefetchRequest(keys=keys),
            "Release": pb.ReleaseRequest(key="sweep/params", version=version),
            "Evict": pb.EvictRequest(keys=keys), "Delete": pb.DeleteRequest(keys=["sweep/gone"]),
            "Describe": pb.DescribeRequest(key="sweep/params"),
            "SetAccessOrder": pb.SetAccessOrderRequest(keys=keys),
            "WatchStats": pb.WatchStatsRequest(interval_seconds=1.0), "AdamWStep": step,
            "OpenJob": pb.OpenJobRequest(job="sweep"), "CloseJob": pb.CloseJobRequest(job="sweep"),
            "DeleteJob": pb.DeleteJobRequest(job="sweep2"), "ReportWorker": report}


def _scheduler_bases() -> dict:
    from tierstack.services.scheduler import synthetic, wire

    pb = scheduler_pb2
    return {"RegisterNode": wire.node_pb(synthetic.node("n0")),
            "ReportTrace": wire.trace_pb(synthetic.transformer_trace(layers=2, job="fuzz", nodes=("n0",))),
            "ReportBandwidth": pb.BandwidthReport(node_id="n0", measured=pb.Bandwidths(disk_read=1e9)),
            "GetPlan": pb.GetPlanRequest(job="fuzz", timeout_seconds=0.05)}


def _sweep(fuzzer: Fuzzer, bases: dict) -> int:
    """Every method's request with each scalar field at each extreme; the calls sent."""
    sent = 0
    for path, descriptor, response_cls, streaming in fuzzer.methods:
        name = path.rsplit("/", 1)[1]
        base = bases.get(name) or message_factory.GetMessageClass(descriptor)()
        for label, payload in extreme_variants(base):
            code = fuzzer.send(path, payload, response_cls, streaming, fuzzer.session)
            sent += 1
            refused = path.startswith(f"/{HEALTH_SERVICE}/") and not path.endswith("/Check")
            allowed = ALLOWED | ({grpc.StatusCode.UNIMPLEMENTED} if refused else set())
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and _long_poll(name, payload):
                continue
            if code not in allowed:
                fuzzer.failures.append(f"{name} with {label} answered {code.name}: {fuzzer.details[:300]}")
    return sent


def test_every_numeric_and_string_field_at_its_extremes_gets_a_documented_status(fuzz_daemon):
    client = TierManagerClient(fuzz_daemon.address, reconnect_timeout=30)
    write_sentinels(client)
    tm = Fuzzer(fuzz_daemon.address, [(tier_manager_pb2, "TierManager"),
                                     (node_metrics_pb2, "NodeMetrics"), (_health_service(), None)])
    tm.start_session(client.node().session_dir)
    try:
        sent = _sweep(tm, _tier_manager_bases(tm, client))
        assert not tm.failures, "\n".join(tm.failures[:30])
        client.node()  # answered at all: a wedged daemon never is (the client's 30 s deadline)
        time.sleep(3)  # pins the sweep left expire (lease_timeout_seconds 2)
        assert check_sentinels(client) == []
        assert "Traceback" not in fuzz_daemon.log_text()
    finally:
        tm.close()
        client.close()
    sched = on_a_scheduler(lambda fuzzer: _sweep(fuzzer, _scheduler_bases()))
    assert not sched.failures, "\n".join(sched.failures[:30])
    sent += sched.sent
    statuses = collections.Counter(tm.counts()) + collections.Counter(sched.counts())
    print("extremes sweep:", json.dumps({"requests": sent, "statuses": dict(sorted(statuses.items())),
                                         "slowest_call_seconds": round(max(tm.slowest, sched.slowest), 2)}))
    assert sent > 500


# ---- a retry hint only for what a retry can serve (issue 53) -----------------------------------------

PIN_PROPERTY_EXAMPLES = int(os.environ.get("TIERSTACK_PIN_PROPERTY_EXAMPLES") or 30)


def test_a_step_refused_while_its_tensors_are_held_is_one_a_retry_can_serve(daemon):
    """Drawn AdamW requests over stored blocks (and their near misses, as above) are sent
    while another client has fetched the tensors they change, then again once it let go.
    Held, a request wrong in itself gets the answer it gets free (same status and
    message); a retry hint (UNAVAILABLE) goes only to a request that, free, is not
    INVALID_ARGUMENT or NOT_FOUND. A segment past the end of a held tensor used to get the
    hint, and INVALID_ARGUMENT after the release. (On a daemon whose pins last: the fuzzing
    one's expire after 2 s, sooner than a first step importing torch on a loaded machine.)"""
    holder = TierManagerClient(daemon.address, reconnect_timeout=30)
    fuzzer = Fuzzer(daemon.address, [(tier_manager_pb2, "TierManager")])
    (step_path,) = [m for m in fuzzer.methods if m[0].endswith("/AdamWStep")]
    seen: collections.Counter = collections.Counter()
    wrong: list[str] = []

    def send(payload: bytes) -> tuple:
        code = fuzzer.send(step_path[0], payload, step_path[2], False)
        return code, fuzzer.details

    @settings(max_examples=PIN_PROPERTY_EXAMPLES, deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(st.data())
    def examples(data):
        # Every draw is made whatever the state (hypothesis replays a failing example).
        if data.draw(st.integers(0, 3)) == 0 or not fuzzer.state.blocks:
            try:
                fuzzer.adamw_setup(data)
            except grpc.RpcError:
                pass  # a full pool: the setup is no call under test
        stored, plain = _adamw_on_stored(data, fuzzer.state), _adamw(data)
        request = stored if stored is not None else plain
        held = []
        for key in {k for b in request.blocks for k in (b.params, b.master, b.exp_avg) if k}:
            try:
                (res,) = holder.fetch([key]).tensors
                held.append((key, res.info.version))
            except Exception:  # noqa: BLE001 - not stored, not a key, no room: not held
                pass
        payload = request.SerializeToString()
        while_held = send(payload)
        for key, version in held:
            holder.release(key, version)
        free = send(payload)
        seen[(while_held[0].name, free[0].name)] += 1
        invalid = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
        if while_held[0] is RETRY_LATER and free[0] in invalid:
            wrong.append(f"a retry hint ({while_held[1][:150]}) for a request that is "
                         f"{free[0].name} once free ({free[1][:150]}): {request}")
        elif while_held[0] in invalid and while_held != free:
            wrong.append(f"held {while_held}, free {free}: {request}")

    try:
        examples()
    finally:
        fuzzer.close()
        holder.close()
    print("held vs free:", json.dumps({f"{a} -> {b}": n for (a, b), n in sorted(seen.items())}))
    assert not wrong, "\n".join(wrong[:10])
    assert seen[("UNAVAILABLE_RETRY_LATER", "OK")] > 0, seen  # held tensors were met at all
